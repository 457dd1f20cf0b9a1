"""The CPU testbeds' tasks: seeded generated problems (`aspo_lit.testbed`) instead of a training
file: arithmetic and operation chains (math), one-line functions (code). Train and held-out splits
never overlap."""

from __future__ import annotations

from typing import Any, Sequence

from aspo_lit.tasks.base import Task
from aspo_lit.tasks.code import CodeTask
from aspo_lit.testbed import tiny_code
from aspo_lit.testbed.arithmetic import generate_problems
from aspo_lit.testbed.multistep import generate_chain_problems


class ArithmeticTask(Task):
    """Arithmetic problems of `levels` (1: a+b, 2: a+b*c, 3: (a-b)*c+d): `num_train` to train on,
    `num_val` held out (0: none), drawn with `data_seed`."""

    def __init__(self, num_train: int, num_val: int, levels: Sequence[int], data_seed: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.num = {"train": num_train, "val": num_val}
        self.levels, self.data_seed = list(levels), data_seed

    def rows(self, split: str) -> list[dict[str, Any]] | None:
        if split == "val" and self.num[split] <= 0:
            return None
        return generate_problems(self.num[split], seed=self.data_seed, levels=self.levels,
                                 split="train" if split == "train" else "heldout")


class ChainTask(Task):
    """Multi-step arithmetic chains (`aspo_lit.testbed.multistep`, the ``testbed-long`` profile):
    `ops` operations per problem, every intermediate value in 0..`max_value`."""

    def __init__(self, num_train: int, num_val: int, ops: Sequence[int], max_value: int, data_seed: int,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.num = {"train": num_train, "val": num_val}
        self.ops, self.max_value, self.data_seed = list(ops), max_value, data_seed

    def rows(self, split: str) -> list[dict[str, Any]] | None:
        if split == "val" and self.num[split] <= 0:
            return None
        return generate_chain_problems(self.num[split], seed=self.data_seed, ops=self.ops,
                                       split="train" if split == "train" else "heldout", max_value=self.max_value)


class TinyCodeTask(CodeTask):
    """Generated one-line function problems (`aspo_lit.testbed.tiny_code`), graded as `CodeTask`."""

    def __init__(self, num_train: int, num_val: int, data_seed: int, **kwargs: Any) -> None:
        super().__init__(train_files="tiny_code", **kwargs)
        self.num = {"train": num_train, "val": num_val}
        self.data_seed = data_seed

    def rows(self, split: str) -> list[dict[str, Any]] | None:
        if split == "val" and self.num[split] <= 0:
            return None
        return tiny_code.generate_problems(self.num[split], self.data_seed, "train" if split == "train" else "heldout")
