"""Token-budget micro-batches: group rows of similar length so little compute goes to padding.

verl's dynamic batch size (``use_dynamic_bsz`` with ``ppo_max_token_len_per_gpu``, split by
``rearrange_micro_batches``) sizes each micro-batch by a token budget instead of a fixed number of
rows. Here that idea is applied to padded rows: a micro-batch costs ``rows × width`` tokens, its
width set by its longest row, so rows are sorted by length and packed greedily -- many short rows
together, few long ones -- while the cost stays within ``max_tokens``.

Our rows are ``[left-padded prompt | right-padded response]`` with one prompt width ``P`` per
batch, so a micro-batch cut to its own longest response computes ``P + max(response length)``
columns: pass the response lengths as ``lengths`` and ``P`` as ``fixed_width`` (width of a row =
``fixed_width + lengths[i]``). ``trim_to_micro_batch`` cuts a micro-batch's rows to that width.
Left padding inside the prompt columns is not counted (it is fixed by the batch layout).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["token_budget_micro_batches", "padding_fraction", "trim_to_micro_batch"]


def _check_lengths(lengths: Tensor, fixed_width: int) -> Tensor:
    if not isinstance(lengths, Tensor) or lengths.dim() != 1 or lengths.is_floating_point() \
            or lengths.dtype == torch.bool:
        raise ValueError(f"lengths must be a 1-D integer tensor, got {getattr(lengths, 'shape', type(lengths))} "
                         f"{getattr(lengths, 'dtype', '')}")
    if lengths.numel() == 0:
        raise ValueError("lengths is empty: there are no rows to split into micro-batches")
    if bool((lengths < 0).any()):
        raise ValueError("lengths must be >= 0")
    if isinstance(fixed_width, bool) or not isinstance(fixed_width, int) or fixed_width < 0:
        raise ValueError(f"fixed_width must be an int >= 0, got {fixed_width!r}")
    return lengths.detach().long().cpu()


def token_budget_micro_batches(lengths: Tensor, max_tokens: int, *, fixed_width: int = 0) -> list[Tensor]:
    """Split rows into micro-batches of at most ``max_tokens`` padded tokens each.

    ``lengths`` ``[N]``: per-row lengths (response lengths, with the prompt width in
    ``fixed_width``; or whole row lengths with ``fixed_width=0``). A micro-batch of rows ``S``
    costs ``|S| × (fixed_width + max(lengths[S]))``. Rows are sorted by length (stable, so ties
    keep their order) and added in that order to the current micro-batch while its cost stays
    ``≤ max_tokens``; a row whose own width exceeds the budget gets a micro-batch of its own.

    Returns int64 index tensors into the original rows (ascending length, micro-batch by
    micro-batch): every row appears exactly once; deterministic for given inputs.
    """
    lengths = _check_lengths(lengths, fixed_width)
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens must be an int >= 1, got {max_tokens!r}")
    order = torch.sort(lengths, stable=True).indices
    widths = (lengths[order] + fixed_width).tolist()
    micro_batches, start = [], 0
    for i in range(1, len(widths) + 1):
        # sorted ascending: row i (if any) would be the widest of rows start..i
        if i == len(widths) or (i + 1 - start) * widths[i] > max_tokens:
            micro_batches.append(order[start:i])
            start = i
    return micro_batches


def padding_fraction(lengths: Tensor, micro_batches: list[Tensor], *, fixed_width: int = 0) -> float:
    """Padded tokens / computed tokens of ``micro_batches`` (each computed at its longest row's width).

    computed = ``Σ_mb |mb| × (fixed_width + max(lengths[mb]))``; padded = computed −
    ``Σ_rows (fixed_width + lengths[i])``. One micro-batch holding every row gives the fraction of a
    batch padded to its longest row (as when every micro-batch keeps all of the batch's columns).
    """
    lengths = _check_lengths(lengths, fixed_width)
    if not micro_batches:
        raise ValueError("micro_batches is empty")
    computed = needed = 0
    for rows in micro_batches:
        rows = torch.as_tensor(rows, dtype=torch.long)
        if rows.numel() == 0:
            raise ValueError("micro_batches holds an empty micro-batch")
        row_lengths = lengths[rows]
        computed += rows.numel() * (fixed_width + int(row_lengths.max()))
        needed += int(row_lengths.sum()) + rows.numel() * fixed_width
    return (computed - needed) / computed if computed else 0.0


def trim_to_micro_batch(input_ids: Tensor, attention_mask: Tensor, prompt_length: int, response_lengths: Tensor,
                        rows: Tensor) -> tuple[Tensor, Tensor]:
    """``input_ids[rows]`` and ``attention_mask[rows]`` cut to ``prompt_length + w`` columns, ``w`` the
    longest response among ``rows`` (all prompt columns kept).

    The log-probs of the trimmed rows are ``[len(rows), w]``: they fill columns ``:w`` of those rows'
    ``[N, T]`` response tensors (the rest is padding, masked out by ``response_mask``).
    """
    if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
        raise ValueError(f"input_ids and attention_mask must be [N, P+T] tensors of one shape, got "
                         f"{tuple(input_ids.shape)} and {tuple(attention_mask.shape)}")
    n, width = input_ids.shape
    if isinstance(prompt_length, bool) or not isinstance(prompt_length, int) or not 0 <= prompt_length <= width:
        raise ValueError(f"prompt_length must be an int in [0, {width}], got {prompt_length!r}")
    if not isinstance(response_lengths, Tensor) or response_lengths.shape != (n,):
        raise ValueError(f"response_lengths must be a [{n}] tensor, got {getattr(response_lengths, 'shape', None)}")
    rows = torch.as_tensor(rows, dtype=torch.long, device=input_ids.device)
    if rows.dim() != 1 or rows.numel() == 0:
        raise ValueError(f"rows must be a non-empty 1-D index tensor, got shape {tuple(rows.shape)}")
    longest = int(response_lengths[rows.to(response_lengths.device)].max())
    if not 0 <= longest <= width - prompt_length:
        raise ValueError(f"response_lengths of rows must lie in [0, {width - prompt_length}] (the response "
                         f"columns), got {longest}")
    end = prompt_length + longest
    return input_ids[rows, :end], attention_mask[rows, :end]
