"""The CPU testbeds' DataModules: seeded generated problems (``aspo_lit.testbed``) instead of a
training file: arithmetic and operation chains (math), one-line functions (code)."""

from __future__ import annotations

from typing import Any

from aspo_lit.tasks.testbed import ArithmeticTask, ChainTask, TinyCodeTask
from aspo_lit.testbed.arithmetic import LEVELS
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

    def build_task(self) -> ArithmeticTask:
        hp = self.hparams
        return ArithmeticTask(hp.num_train, hp.num_val, hp.levels, hp.data_seed,
                              prompt_template=hp.prompt_template, reward=self._reward)


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

    def build_task(self) -> ChainTask:
        hp = self.hparams
        return ChainTask(hp.num_train, hp.num_val, hp.ops, hp.max_value, hp.data_seed,
                         prompt_template=hp.prompt_template, reward=self._reward)


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

    def build_task(self) -> TinyCodeTask:
        hp = self.hparams
        return TinyCodeTask(hp.num_train, hp.num_val, hp.data_seed, problem_key=hp.problem_key, dedup=hp.dedup,
                            on_bad_row=hp.on_bad_row, prompt_template=hp.prompt_template, reward=self._reward,
                            hub_split=hp.hub_split, enable_thinking=hp.enable_thinking,
                            system_prompt=hp.system_prompt, sandbox=hp.sandbox,
                            reward_timeout_s=hp.reward_timeout_s, reward_memory_mb=hp.reward_memory_mb,
                            reward_workers=hp.reward_workers, reward_max_tests=hp.reward_max_tests,
                            reward_batch_timeout_s=hp.reward_batch_timeout_s)
