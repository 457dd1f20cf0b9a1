"""Reward shaping on response length: DAPO's soft overlong punishment (Yu et al., 2025, §3.4).

Applied once, by the rollout DataModule (``data.overlong_buffer``, ``data.overlong_penalty_factor``),
which knows each response's token count and ``max_response_length``; the correctness rewards
(``MathReward``, ``CodeReward``) score text only.
"""

from __future__ import annotations

__all__ = ["overlong_penalty"]


def overlong_penalty(
    response_length: int, max_response_length: int, buffer_length: int, penalty_factor: float = 1.0
) -> float:
    """DAPO's soft overlong punishment (``<= 0``), as in verl's ``DAPORewardManager``.

    Zero up to ``max_response_length - buffer_length`` tokens, then falling linearly to
    ``-penalty_factor`` at ``max_response_length`` (and further below beyond it); ``buffer_length
    <= 0`` switches it off.
    """
    if buffer_length <= 0:
        return 0.0
    expected_len = max_response_length - buffer_length
    exceed_len = response_length - expected_len
    return min(-exceed_len / buffer_length * penalty_factor, 0.0)
