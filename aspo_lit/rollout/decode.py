"""The transformers engine's sampling loop: ``generate``'s ancestral sampling with less work.

transformers' ``GenerationMixin._sample`` computes every row at every step until the last row of
the call has finished, and computes the prompt once per row. Here the same ops run in the same
order on the rows that matter:

* **One prefill per distinct prompt.** The G samples of a prompt share its prompt: the prompt is
  computed once, and its KV cache and last-position logits are copied to its G rows
  (``Cache.batch_select_indices``). The G rows would have computed the same numbers.
* **Finished rows leave the batch.** Once a quarter of the rows still computed have finished
  (EOS or a stop string), the cache keeps only the unfinished rows; a finished row's later
  tokens are padding, as in ``generate``, without being computed. Attention reads the whole KV
  cache of every row it computes, so on long answers this is most of the saving.

Per step, as ``_sample`` does: the float32 logits of the last position, the processors (the
engine's temperature / top-p warpers, transformers' own classes), ``softmax``, then the sample.
``torch.multinomial(probs, 1)`` on CPU draws ``q ~ Exp(1)`` for every entry of the ``[rows,
vocab]`` matrix and returns ``argmax(probs / q)``; the loop draws ``q`` for the whole call's rows
(finished ones too) with the same ``exponential_`` call and divides only the unfinished rows'
probabilities by their ``q``, so the random stream and each row's draw are those of
``generate``. Greedy decoding takes ``argmax`` of the processed scores. The log-prob of each
sample is read from ``log_softmax`` of the processed (or, ``raw``, unprocessed) scores, as the
engine's recorder reads it inside ``generate``.

Exactness: a row's numbers equal ``generate``'s when the BLAS gives a row the same bits whatever
the number of rows in the matrix product and the row's place in it. With one torch thread MKL's
AVX-512 kernels do for 16 or more rows (products of 4-15 rows use other kernels, whose last bits
differ), so the loop never computes fewer than ``min_rows`` = 16 rows (or the call's rows, when
fewer). MKL's AVX2 kernels (``MKL_ENABLE_INSTRUCTIONS=AVX2``) do not: they compute rows in blocks
of 6 and round the remainder rows differently, at any height. :func:`rows_are_stable` checks the
BLAS the model runs on, for each of its weight shapes, at the heights and offsets the loop uses;
where it fails, the engine runs the loop at ``generate``'s heights (``full_height``: every row of
the call, in its order, at every step: the prompt computed once per row, no row leaving the batch).
Either way the samples and log-probs are ``generate``'s bit for bit (tests/unit/test_rollout.py, under
every kernel setting CI runs); only the saving is lost on a BLAS that is not row-stable. With more
threads MKL may split a product of another height differently, so a row can round differently in
the last bit and, rarely, a sample differs from the one ``generate`` would have drawn; the sampler
is the same distribution, and the same seed on the same machine and thread count gives the same run.

``sample_rows`` runs on a CPU model that is not sharded, whose cache layers are transformers'
plain ``DynamicLayer`` (or the engine's ``GrowingLayer``) and whose forward takes
``position_ids`` and ``logits_to_keep``; ``lean_decoding_applies`` says so, and the engine runs
``generate`` otherwise.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor
from transformers.cache_utils import DynamicCache, DynamicLayer

from .kv_cache import GrowingLayer

__all__ = ["DecodeResult", "lean_decoding_applies", "rows_are_stable", "sample_rows"]

#: compact the batch once the unfinished rows are at most this share of the rows computed
COMPACT_AT = 0.75
#: never compute fewer rows than this (MKL computes fewer with other kernels, other bits: module docstring)
MIN_ROWS = 16
#: the heights `rows_are_stable` checks: `min_rows` up to this (every residue of the BLAS's row blocks)
PROBE_MAX_ROWS = 64
_STABLE: dict[tuple, bool] = {}


@dataclass
class DecodeResult:
    """``tokens`` ``[B, L]``: the sampled tokens, the pad token after a row's end (as the tail of
    ``generate``'s sequences); ``logprobs`` ``[B, L]`` fp32 of each sampled token (0 after the
    end), or None."""

    tokens: Tensor
    logprobs: Tensor | None


def lean_decoding_applies(model: Any, cache: Any, sharded: bool) -> bool:
    """True when `sample_rows` can run `model` with `cache` (see the module docstring)."""
    if sharded or getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return False
    device = next(model.parameters()).device
    if device.type != "cpu":
        return False  # multinomial's draw is emulated as the CPU kernel makes it
    params = inspect.signature(model.forward).parameters
    if not {"position_ids", "logits_to_keep", "past_key_values"} <= set(params):
        return False
    return isinstance(cache, DynamicCache) and bool(cache.layers) and \
        all(type(layer) in (DynamicLayer, GrowingLayer) for layer in cache.layers)


def _full(tensor: Tensor) -> Tensor:
    full_tensor = getattr(tensor, "full_tensor", None)  # torch.distributed.tensor.DTensor
    return full_tensor() if callable(full_tensor) else tensor


@torch.no_grad()
def rows_are_stable(model: Any, min_rows: int = MIN_ROWS, max_rows: int = PROBE_MAX_ROWS) -> bool:
    """True when, for every linear layer shape of ``model``, a product of ``h`` rows gives each row the
    bits it has in a product of ``max_rows + 1`` rows, for every ``h`` in ``[min_rows, max_rows]`` and
    starting at row 0 or 1 (a row's place moves when finished rows leave the batch). Checked once per
    (shapes, dtype, torch threads) in a process; on random rows of a fixed seed."""
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    shapes = sorted({(m.in_features, m.out_features, m.weight.dtype, m.bias is not None) for m in linears},
                    key=str)
    key = (tuple(shapes), torch.get_num_threads(), min_rows, max_rows)
    if key not in _STABLE:
        by_shape = {(m.in_features, m.out_features, m.weight.dtype, m.bias is not None): m for m in linears}
        generator = torch.Generator().manual_seed(0)
        stable = True
        for shape in shapes:
            layer = by_shape[shape]
            # a DTensor parameter (FSDP2 on one rank) multiplies as its full local tensor does
            weight, bias = (None if p is None else _full(p.detach()) for p in (layer.weight, layer.bias))
            x = torch.randn(max_rows + 1, shape[0], generator=generator).to(weight.device, weight.dtype)
            full = torch.nn.functional.linear(x, weight, bias)
            stable = all(torch.equal(torch.nn.functional.linear(x[start:start + h], weight, bias),
                                     full[start:start + h])
                         for h in range(min_rows, max_rows + 1) for start in (0, 1))
            if not stable:
                break
        _STABLE[key] = stable
    return _STABLE[key]


def _sample_like_multinomial(probs: Tensor, rows: Tensor, batch: int) -> Tensor:
    """``torch.multinomial(full_probs, 1)`` for the ``rows`` of a ``[batch, V]`` matrix whose other
    rows are never read: the CPU kernel's ``argmax(p / q)``, ``q ~ Exp(1)`` drawn for all rows."""
    if not bool(torch.isfinite(probs).all()) or bool((probs < 0).any()):
        raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")
    if bool((probs.sum(-1) <= 0).any()):
        raise RuntimeError("invalid multinomial distribution (sum of probabilities <= 0)")
    q = torch.empty((batch, probs.shape[-1]), dtype=probs.dtype, device=probs.device).exponential_(1)
    return (probs / q[rows]).argmax(dim=-1)


@torch.no_grad()
def sample_rows(
    model: Any,
    input_ids: Tensor,
    attention_mask: Tensor,
    cache: DynamicCache,
    *,
    max_new_tokens: int,
    eos_token_ids: list[int],
    pad_token_id: int,
    warpers: list[Callable[[Tensor, Tensor], Tensor]],
    greedy: bool,
    logprobs: str | None,
    stop: Callable[[Tensor, Tensor], Tensor] | None = None,
    compact_at: float = COMPACT_AT,
    min_rows: int = MIN_ROWS,
    full_height: bool = False,
) -> DecodeResult:
    """Sample up to `max_new_tokens` tokens for each row of left-padded ``input_ids`` ``[B, P]``.

    `full_height`: compute every row of the call in its order at every step, as ``generate`` does
    (for a BLAS whose rows are not stable, :func:`rows_are_stable`).

    `warpers`: the score processors in order (``processor(input_ids, scores)``; none may read
    ``input_ids``). `logprobs`: ``"processed"`` (after the warpers), ``"raw"`` (before) or None.
    `stop`: a stopping criterion ``stop(sequences [B, P+t], scores) -> done [B]`` (the engine's
    stop strings), called every step on every row as ``generate`` calls it.
    """
    batch, prompt_len = input_ids.shape
    device = input_ids.device
    eos = torch.tensor(eos_token_ids, dtype=torch.long, device=device)
    positions = (attention_mask.long().cumsum(-1) - 1).masked_fill_(attention_mask == 0, 0)

    # prefill: one row per distinct prompt, copied to its rows
    first_row: dict[tuple, int] = {}
    keys = [tuple(row) for row in torch.cat([input_ids, attention_mask], 1).tolist()]
    for b, key in enumerate(keys):
        first_row.setdefault(key, b)
    shared = len(first_row) < batch and not full_height
    prefill = list(first_row.values())
    if shared:  # at least `min_rows` rows (the last position's logits are a product of that height)
        prefill += [b for b in range(batch) if b not in set(prefill)][:max(0, min(min_rows, batch) - len(prefill))]
    prefill = torch.tensor(prefill, device=device) if shared else torch.arange(batch, device=device)
    out = model(input_ids=input_ids[prefill], attention_mask=attention_mask[prefill], position_ids=positions[prefill],
                past_key_values=cache, use_cache=True, logits_to_keep=1, return_dict=True)
    logits = out.logits[:, -1].to(copy=True, dtype=torch.float32)
    del out
    if shared:
        slot = {key: i for i, key in enumerate(first_row)}  # first rows lead `prefill`, in this order
        owner = torch.tensor([slot[key] for key in keys], device=device)
        cache.batch_select_indices(owner)
        logits = logits[owner]

    tokens = torch.full((batch, max_new_tokens), pad_token_id, dtype=torch.long, device=device)
    recorded = torch.zeros((batch, max_new_tokens), dtype=torch.float32, device=device) if logprobs else None
    sequences = None
    if stop is not None:
        sequences = torch.full((batch, prompt_len + max_new_tokens), pad_token_id, dtype=torch.long, device=device)
        sequences[:, :prompt_len] = input_ids
    unfinished = torch.ones(batch, dtype=torch.bool, device=device)
    computed = torch.arange(batch, device=device)  # the rows the model computes, in cache order
    mask = attention_mask
    steps = 0
    for step in range(max_new_tokens):
        # `logits` holds the rows of `computed`; sample the unfinished ones among them
        live = unfinished[computed]
        rows = computed[live]
        scores = logits[live]
        raw = scores
        for warper in warpers:
            scores = warper(None, scores)
        if greedy:
            picked = scores.argmax(dim=-1)
        else:
            picked = _sample_like_multinomial(torch.softmax(scores, dim=-1), rows, batch)
        tokens[rows, step] = picked
        if recorded is not None:
            source = scores if logprobs == "processed" else raw
            recorded[rows, step] = torch.log_softmax(source.float(), dim=-1).gather(1, picked[:, None]).squeeze(1)
        steps = step + 1
        done = torch.zeros(batch, dtype=torch.bool, device=device)
        done[rows] = torch.isin(picked, eos)
        if sequences is not None:
            sequences[rows, prompt_len + step] = picked
            done |= stop(sequences[:, :prompt_len + step + 1], None).to(device)
        unfinished &= ~done
        if not bool(unfinished.any()) or step == max_new_tokens - 1:
            break
        # the next forward: the unfinished rows' new token, on a batch compacted when worth it
        mask = torch.cat([mask, mask.new_ones((batch, 1))], dim=-1)
        positions = positions[:, -1:] + 1
        keep = unfinished[computed]
        kept = int(keep.sum())
        if not full_height and kept <= compact_at * computed.numel() and kept >= min_rows:
            selected = keep.nonzero().squeeze(1)
            cache.batch_select_indices(selected)
            computed = computed[selected]
        out = model(input_ids=tokens[computed, step, None], attention_mask=mask[computed],
                    position_ids=positions[computed], past_key_values=cache, use_cache=True, logits_to_keep=1,
                    return_dict=True)
        logits = out.logits[:, -1].to(copy=True, dtype=torch.float32)
        del out
    tokens = tokens[:, :steps]
    return DecodeResult(tokens, recorded[:, :steps] if recorded is not None else None)

