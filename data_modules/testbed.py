"""The CPU testbed's DataModule: seeded arithmetic problems instead of a math training file."""

from __future__ import annotations

from typing import Any

from data_modules.arithmetic import LEVELS, generate_problems
from data_modules.math import MathRLDataModule


class ArithmeticRLDataModule(MathRLDataModule):
    """`MathRLDataModule` over generated arithmetic problems (train / held-out splits never overlap).

    Args:
        num_train: training problems drawn from the train split.
        num_val: held-out problems for the validation loop (avg@K during training).
        levels: difficulty levels to draw from (1: a+b, 2: a+b*c, 3: (a-b)*c+d).
        data_seed: the generator's seed (independent of the sampling seed).
        **kwargs: every `MathRLDataModule` argument (batch_size, group_size, engine, ...).
    """

    def __init__(self, num_train: int = 2000, num_val: int = 64, levels: list[int] = list(LEVELS),
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
