"""`RolloutBatch` (docs/design.md, "Tensors of one rollout batch") and `pack_rollouts`.

Rows are responses, group-contiguous: rows ``g*G .. g*G+G-1`` are the G responses of prompt g.
``input_ids`` is ``[N, P+T]``: each prompt left-padded to P, then its response right-padded to T
(the longest response); response token t of a row sits at column ``P+t``.

Left padding shifts the real tokens, so a forward pass over ``input_ids`` must be given
``position_ids_from_mask(attention_mask)`` (positions 0.. of the real tokens, as both rollout
engines use) to reproduce the engines' log-probs; ``pack_rollouts`` returns them as well.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from aspo_lit.maths.stats import Stat

from .base import Completion

__all__ = ["RolloutBatch", "pack_rollouts", "position_ids_from_mask"]


@dataclass
class RolloutBatch:
    input_ids: torch.LongTensor  # [N, P+T]: left-padded prompt ids ++ right-padded response ids
    attention_mask: torch.LongTensor  # [N, P+T]
    response_mask: torch.FloatTensor  # [N, T]
    prompt_length: int  # P (response token t sits at column P+t of input_ids)
    rewards: torch.FloatTensor  # [N]
    advantages: torch.FloatTensor  # [N]  (eq. 1, broadcast to tokens by the loss)
    group_size: int  # G
    texts: list[str]  # decoded responses
    prompts: list[str]  # decoded prompt per row
    answers: list[str]  # gold answer per row
    finish_reasons: list[str]  # "stop" | "length"
    response_lengths: torch.LongTensor  # [N]
    # batch/solve_all, batch/solve_none, ...: a Stat declares its reduction over ranks (aspo_lit.maths.stats);
    # a plain number is a mean over ranks, each rank weighing 1
    stats: dict[str, float | Stat] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)  # timing/rollout_s, timing/reward_s, ...
    rollout_logprobs: torch.FloatTensor | None = None  # [N, T] the engine's log-probs of its samples (0 on padding)
    top_p: float = 1.0  # the nucleus the responses were sampled with (rollout_logprobs are renormalised over it)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "RolloutBatch":
        """A copy with every tensor field on ``device`` (other fields shared)."""
        changes: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                changes[f.name] = value.to(device, non_blocking=non_blocking)
        return dataclasses.replace(self, **changes)

    @property
    def num_rows(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def response_ids(self) -> torch.LongTensor:
        """``[N, T]`` response token ids (padding where ``response_mask`` is 0)."""
        return self.input_ids[:, self.prompt_length:]


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.LongTensor:
    """Positions 0, 1, ... of the real tokens of each row (0 on left padding)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp_(min=0)


def pack_rollouts(
    prompt_ids: list[list[int]],
    completions: list[list[Completion]],
    pad_token_id: int,
) -> dict[str, Any]:
    """Lay prompts and their completions out as rollout-batch tensors.

    Returns ``input_ids [N, P+T]``, ``attention_mask [N, P+T]``, ``position_ids [N, P+T]``,
    ``response_mask [N, T]`` (float), ``prompt_length`` (int P), ``response_lengths [N]``,
    ``group_size`` (int, when all groups have the same size, else None) and ``engine_logprobs
    [N, T]`` (0 on padding) when every completion carries log-probs, else None.
    """
    if len(prompt_ids) != len(completions):
        raise ValueError(f"{len(prompt_ids)} prompts but {len(completions)} completion groups")
    rows: list[tuple[list[int], Completion]] = []
    for g, (prompt, group) in enumerate(zip(prompt_ids, completions)):
        if len(prompt) == 0:
            raise ValueError(f"prompt {g} is empty")
        for c in group:
            rows.append((list(prompt), c))
    N = len(rows)
    P = max((len(p) for p, _ in rows), default=0)
    T = max((len(c.token_ids) for _, c in rows), default=0)
    input_ids = torch.full((N, P + T), int(pad_token_id), dtype=torch.long)
    attention_mask = torch.zeros((N, P + T), dtype=torch.long)
    response_mask = torch.zeros((N, T), dtype=torch.float32)
    response_lengths = torch.zeros(N, dtype=torch.long)
    with_logprobs = N > 0 and all(c.logprobs is not None for _, c in rows)
    engine_logprobs = torch.zeros((N, T), dtype=torch.float32) if with_logprobs else None
    for i, (prompt, c) in enumerate(rows):
        p, t = len(prompt), len(c.token_ids)
        input_ids[i, P - p:P] = torch.tensor(prompt, dtype=torch.long)
        attention_mask[i, P - p:P] = 1
        if t:
            input_ids[i, P:P + t] = torch.tensor(c.token_ids, dtype=torch.long)
            attention_mask[i, P:P + t] = 1
            response_mask[i, :t] = 1.0
            if engine_logprobs is not None:
                if len(c.logprobs) != t:
                    raise ValueError(f"row {i}: {len(c.logprobs)} log-probs for {t} tokens")
                engine_logprobs[i, :t] = torch.tensor(c.logprobs, dtype=torch.float32)
        response_lengths[i] = t
    sizes = {len(group) for group in completions}
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids_from_mask(attention_mask),
        "response_mask": response_mask,
        "prompt_length": P,
        "response_lengths": response_lengths,
        "group_size": sizes.pop() if len(sizes) == 1 else None,
        "engine_logprobs": engine_logprobs,
    }
