"""A reward for checking the training plumbing on a policy that solves nothing.

A randomly initialised model (the MoE of the ``qwen3_30b_a3b`` rehearsal) or one whose head was
re-tied (``make gpu-check``'s tied variant) earns no correctness reward: every group's rewards are
equal, every advantage is 0, the weights never move, and a weight push carries nothing new to
check. `LengthReward` scores a response by its length, which varies within every group, so every
rollout batch has a gradient. It measures nothing about the task: checks only, never a study.
"""

from __future__ import annotations

from collections.abc import Sequence


class LengthReward:
    """The response's length in characters / 100 (``gold`` unused)."""

    def __call__(self, response_text: str, gold: str) -> float:
        return len(response_text) / 100.0

    def batch(self, texts: Sequence[str], golds: Sequence[str]) -> list[float]:
        return [self(text, gold) for text, gold in zip(texts, golds)]
