"""`Task`: the rows, the prompt and the reward of one kind of problem, without a Trainer.

A fit's DataModule (``data_modules``) holds one task and a `aspo_lit.rollout_stage.controller.
RolloutController`; ``python -m aspo_lit evaluate --like_fit`` builds the same task from the fit's
config to evaluate its held-out problems (`aspo_lit.eval.like_fit`).
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from aspo_lit.prompts import encode_prompt

log = logging.getLogger(__name__)


class Task:
    """Math-answer problems: rows ``{id, problem, answer}``, the math prompt, `MathReward` (a
    subclass changes what it needs to).

    Args:
        prompt_template: ``chat`` (the tokenizer's chat template) or ``plain``.
        reward: the grader (``.batch(texts, golds)``); None builds `default_reward` when first used.
    """

    #: ``math`` or ``code``: which of evaluation's graders and tables the problems belong to.
    domain = "math"

    def __init__(self, prompt_template: str = "chat", reward: Any = None) -> None:
        self.prompt_template = prompt_template
        self._reward = reward
        #: data counts (``data/...``), also handed to `on_stats` as they are made (a fit logs them)
        self.stats: dict[str, float] = {}
        self.on_stats: Callable[[dict[str, float]], None] | None = None

    def rows(self, split: str) -> list[dict[str, Any]] | None:
        """The rows of ``train`` or ``val`` (None: no held-out problems)."""
        raise NotImplementedError

    def encode_row(self, row: dict[str, Any], tokenizer: Any) -> list[int]:
        """The prompt's token ids of a row."""
        return encode_prompt(row["problem"], tokenizer, self.prompt_template)

    def encode(self, rows: list[dict[str, Any]], split: str, tokenizer: Any, max_prompt_length: int) -> list[dict[str, Any]]:
        """Rows with their ``prompt_ids``; those over `max_prompt_length` dropped and counted."""
        kept = []
        for row in rows:
            ids = self.encode_row(row, tokenizer)
            if len(ids) <= max_prompt_length:
                kept.append(dict(row, prompt_ids=ids))
        dropped = len(rows) - len(kept)
        self.record({f"data/{split}_prompts": float(len(kept)), f"data/{split}_dropped_long_prompts": float(dropped)})
        if dropped:
            log.warning("%s: dropped %d of %d prompts longer than max_prompt_length=%d",
                        split, dropped, len(rows), max_prompt_length)
        if not kept:
            raise ValueError(f"data.max_prompt_length={max_prompt_length} drops every {split} prompt")
        return kept

    def record(self, stats: dict[str, float]) -> None:
        """Data counts into `stats` and to `on_stats`."""
        self.stats.update(stats)
        if self.on_stats is not None:
            self.on_stats(stats)

    @property
    def reward(self) -> Any:
        if self._reward is None:
            self._reward = self.default_reward()
        return self._reward

    def default_reward(self) -> Any:
        """`MathReward()`: correct when DeepScaleR's or math-verify's verifier accepts (docs/grading.md)."""
        from aspo_lit.rewards.reward import MathReward

        return MathReward()

    def check_ready(self) -> None:
        """Raise, in one line, when the reward cannot run here (a fit calls it before any rollout)."""

    def close(self) -> None:
        """Release what the task started (the code grader's workers)."""
