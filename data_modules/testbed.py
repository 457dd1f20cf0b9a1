"""The CPU testbeds' DataModules: seeded generated problems (``aspo_lit.testbed``) instead of a
training file: arithmetic and operation chains (math), one-line functions (code)."""

from __future__ import annotations

from typing import Any

from aspo_lit.testbed import tiny_code
from aspo_lit.testbed.arithmetic import LEVELS, generate_problems
from aspo_lit.testbed.multistep import generate_chain_problems
from data_modules.code import CodeRLDataModule
from data_modules.math import RLDataModule


class ArithmeticRLDataModule(RLDataModule):
    """`RLDataModule` over generated arithmetic problems (train / held-out splits never overlap).

    Args:
        num_train: training problems drawn from the train split.
        num_val: held-out problems for the validation loop (avg@K during training).
        levels: difficulty levels to draw from (1: a+b, 2: a+b*c, 3: (a-b)*c+d).
        data_seed: the generator's seed (independent of the sampling seed).
        **kwargs: every `RLDataModule` argument (batch_size, group_size, engine, ...).
    """

    def __init__(self, num_train: int = 2000, num_val: int = 64, levels: list[int] = list(LEVELS),  # noqa: B006 - jsonargparse shows the list; never mutated
                 data_seed: int = 0, **kwargs: Any) -> None:
        kwargs.setdefault("train_files", "arithmetic")
        super().__init__(**kwargs)
        self.hparams.update(num_train=num_train, num_val=num_val, levels=list(levels), data_seed=data_seed)

    def load_train_rows(self) -> list[dict[str, Any]]:
        hp = self.hparams
        return generate_problems(hp.num_train, seed=hp.data_seed, levels=hp.levels, split="train")

    def load_val_rows(self) -> list[dict[str, Any]] | None:
        hp = self.hparams
        if hp.num_val <= 0:
            return None
        return generate_problems(hp.num_val, seed=hp.data_seed, levels=hp.levels, split="heldout")


class ChainRLDataModule(RLDataModule):
    """`RLDataModule` over multi-step arithmetic chains (`aspo_lit.testbed.multistep`): the
    ``testbed-long`` profile's task, 5-8 operations per problem, answers worded freely.

    Args:
        num_train: training problems drawn from the train split.
        num_val: held-out problems for the validation loop (avg@K during training).
        ops: numbers of operations per problem to draw from.
        max_value: every intermediate value stays in 0..max_value.
        data_seed: the generator's seed (independent of the sampling seed).
        **kwargs: every `RLDataModule` argument (batch_size, group_size, engine, ...).
    """

    def __init__(self, num_train: int = 2000, num_val: int = 64, ops: list[int] = [4, 5, 6, 7],  # noqa: B006 - jsonargparse shows the list; never mutated
                 max_value: int = 99, data_seed: int = 0, **kwargs: Any) -> None:
        kwargs.setdefault("train_files", "chain")
        super().__init__(**kwargs)
        self.hparams.update(num_train=num_train, num_val=num_val, ops=list(ops), max_value=max_value,
                            data_seed=data_seed)

    def _rows(self, n: int, split: str) -> list[dict[str, Any]]:
        hp = self.hparams
        return generate_chain_problems(n, seed=hp.data_seed, ops=hp.ops, split=split, max_value=hp.max_value)

    def load_train_rows(self) -> list[dict[str, Any]]:
        return self._rows(self.hparams.num_train, "train")

    def load_val_rows(self) -> list[dict[str, Any]] | None:
        return self._rows(self.hparams.num_val, "heldout") if self.hparams.num_val > 0 else None


class TinyCodeRLDataModule(CodeRLDataModule):
    """`CodeRLDataModule` over generated tiny code problems (train / held-out never overlap).

    Args:
        num_train: training problems (the train split, cycled with fresh tests).
        num_val: held-out problems for the validation loop.
        data_seed: the generator's seed.
        **kwargs: every `CodeRLDataModule` argument (sandbox, batch_size, group_size, engine, ...).
    """

    def __init__(self, num_train: int = 512, num_val: int = 32, data_seed: int = 0, **kwargs: Any) -> None:
        kwargs.setdefault("train_files", "tiny_code")
        super().__init__(**kwargs)
        self.hparams.update(num_train=num_train, num_val=num_val, data_seed=data_seed)

    def load_train_rows(self) -> list[dict[str, Any]]:
        return tiny_code.generate_problems(self.hparams.num_train, self.hparams.data_seed, "train")

    def load_val_rows(self) -> list[dict[str, Any]] | None:
        if self.hparams.num_val <= 0:
            return None
        return tiny_code.generate_problems(self.hparams.num_val, self.hparams.data_seed, "heldout")
