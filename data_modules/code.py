"""CodeRLDataModule: code problems → G sampled programs per prompt → sandboxed execution reward.

The paper's code runs (§7, Appendix B) train on DeepCoder, CodeContests and CodeForces problems
with the same recipe as math (16 samples at T = 1.0), graded by running the program on the
problem's tests (`aspo_lit.tasks.code.CodeTask`; rows as `aspo_lit.data.code_rows` reads them).
"""

from __future__ import annotations

from typing import Any

from aspo_lit.data.mixture import Source
from aspo_lit.maths.settings import check_choice
from aspo_lit.tasks.code import CodeTask, Sandbox
from data_modules.math import RLDataModule

DEFAULT_TRAIN = "agentica-org/DeepCoder-Preview-Dataset:lcbv5"  # the paper's code RL data (its LiveCodeBench part)


class CodeRLDataModule(RLDataModule):
    """`RLDataModule` for code: LiveCodeBench-style prompts, sandboxed execution reward.

    Args:
        train_files, val_files: a list of `aspo_lit.data.mixture.Source` (each with its layout,
            field mapping and filters; CodeContests and CodeForces rows by ``layout``,
            `aspo_lit.data.code_layouts`), or a local file/folder or HF hub id of code problems (any
            layout of the module docstring), several joined with ``+``.
        sandbox: ``bwrap`` (default) or ``rlimit`` (explicit opt-in to rlimit-only isolation).
        reward_timeout_s: wall-clock limit per test (LiveCodeBench / DeepCoder: 6 s); CodeContests
            rows use their own ``time_limit_s``.
        reward_memory_mb: address-space limit per test process (rows' own limits win).
        reward_workers: programs graded in parallel (default: CPU count).
        reward_max_tests: run only the longest-input tests of large test sets (DeepCoder: 15).
        reward_batch_timeout_s: optional bound on grading one rollout batch (programs not
            finished by then score 0); by default each program is bounded by its own limits.
        system_prompt: an optional system message (default none; DeepSeek-R1's recommendation).
        enable_thinking: passed to the chat template (Qwen3 reads it; the paper uses
            non-thinking mode for Qwen3).
        hub_split: the split loaded from an HF hub id.
        **kwargs: every `RLDataModule` argument (batch_size, group_size, engine, ...); a
            ``reward`` object replaces the default ``CodeReward``.
    """

    def __init__(self, train_files: str | list[Source] = DEFAULT_TRAIN, val_files: str | list[Source] | None = None,
                 sandbox: Sandbox = "bwrap", reward_timeout_s: float = 6.0, reward_memory_mb: int = 2048,
                 reward_workers: int | None = None, reward_max_tests: int | None = None,
                 reward_batch_timeout_s: float | None = None,
                 system_prompt: str | None = None, enable_thinking: bool | None = False,
                 hub_split: str = "train", **kwargs: Any) -> None:
        check_choice("data.sandbox", sandbox, Sandbox)
        if reward_timeout_s <= 0:
            raise ValueError(f"data.reward_timeout_s must be > 0, got {reward_timeout_s!r}")
        from aspo_lit.rewards import MathReward

        if isinstance(kwargs.get("reward"), MathReward):   # e.g. inherited from a math config's `data.reward`
            raise ValueError("data.reward is a MathReward, which grades math answers, not programs: every "
                             "program would score 0. Set `data.init_args.reward: null` for the sandboxed "
                             "CodeReward built from data.reward_* (conf/code/aspo.yaml does).")
        super().__init__(train_files=train_files, val_files=val_files, **kwargs)
        self.hparams.update(sandbox=sandbox, reward_timeout_s=reward_timeout_s,
                            reward_memory_mb=reward_memory_mb, reward_workers=reward_workers,
                            reward_max_tests=reward_max_tests, reward_batch_timeout_s=reward_batch_timeout_s,
                            system_prompt=system_prompt,
                            enable_thinking=enable_thinking, hub_split=hub_split)

    def build_task(self) -> CodeTask:
        hp = self.hparams
        return CodeTask(self.data_sources["train"], self.data_sources["val"], hp.problem_key, hp.dedup,
                        hp.on_bad_row, hp.prompt_template, self._reward, hp.hub_split, hp.enable_thinking,
                        hp.system_prompt, hp.sandbox, hp.reward_timeout_s, hp.reward_memory_mb, hp.reward_workers,
                        hp.reward_max_tests, hp.reward_batch_timeout_s)
