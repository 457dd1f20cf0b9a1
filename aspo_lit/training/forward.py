"""Per-token log-probs (and entropy) of response tokens under a causal LM.

Rows are `[left-padded prompt | right-padded response]`; response token t sits at column
`prompt_length + t`, predicted from the hidden state at column `prompt_length + t - 1`.

`response_logprobs` never materialises `[B, T, vocab]` logits: the model runs its own forward
(`logits_to_keep=T+1`, so only the response positions reach the head), but for that call the LM
head's `forward` is swapped for the fused-linear reduction of :mod:`aspo_lit.maths.fused_logprobs`
(verl's `FusedLinearForPPO` idea), which turns the hidden states and the head weight straight
into label log-probs and entropy, chunk by chunk. The head's result comes back as
`output.logits`, now `[B, T]` fp32 log-probs.

Why inside the root forward rather than calling the backbone and reading `lm_head.weight`
afterwards: under FSDP2 (`fully_shard` on the decoder layers and the root), the root module's
forward pre-hook is what all-gathers the root-level parameters (embeddings, final norm, LM head)
into full tensors and its post-forward hook registers the pre-backward hook on the outputs. Outside
the root forward `lm_head.weight` is the sharded DTensor parameter. Swapping the head's `forward`
keeps every FSDP2 hook on its usual path: the fused function receives the unsharded full weight,
its output is the root's output (so the root's pre-backward unshard fires), and the weight's
gradient flows into the unsharded parameter that FSDP2 reduce-scatters. With tied embeddings the
head's weight *is* the embedding tensor, so its gradient accumulates on the shared parameter.

Model families whose causal-LM forward applies the head as its last op on the logits are fused
(`FUSED_MODEL_TYPES`); any other model (e.g. with logit soft-capping or scaling after the head)
falls back to `response_logprobs_unfused`: HF logits + the chunked maths of
:mod:`aspo_lit.maths.logprobs`, exact but `O(T × vocab)` in memory.

**Shared prompts.** The G responses of a group share their prompt, and a row-by-row forward
computes it G times (on the CPU testbeds a quarter of a row's tokens). Causal attention makes a
prompt's hidden states and keys/values independent of what follows it, so `encode_prompts` runs
each distinct prompt once (with the grad when it is enabled) into transformers' ``DynamicCache``,
keeping its keys/values and its last position's final hidden state (`PromptStates`), and
`responses_from_prompts` runs only the response columns of each row against its prompt's copy
(``index_select``, whose backward sums the rows' gradients into the prompt's one row after another:
the same bits on any number of threads, where an advanced index's backward adds them with atomic
float adds from parallel threads, in an order that changed from run to run). ``response_logprobs(...,
share_prompt=True)`` does both for one call; `ASPOModule` encodes a mini-batch's prompts once for
all its micro-batches: the micro-batches' backwards accumulate into `PromptStates.leaves`, and
`prompt_backward_term` carries that sum through the prompt pass once. The log-probs, entropy
and gradients are the row-by-row ones in exact arithmetic; in floating point the prompt's matmuls
and attention run in other shapes, so they agree to rounding (~1e-6 on the testbeds,
tests/unit/test_shared_prompt.py), not bit for bit. It applies (`prompt_sharing_applies`) to the
fused model families with plain ``DynamicLayer`` caches, without gradient checkpointing
(transformers drops the cache under it), on an unsharded model: with FSDP2 a layer reshards after
its backward, possibly before the gradient reaching its shared prompt through the cache needs its
weights (``ASPOModule`` refuses the combination).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch import Tensor
from transformers.cache_utils import DynamicCache, DynamicLayer

from aspo_lit.maths.fused_logprobs import fused_linear_logprobs
from aspo_lit.maths.logprobs import logprobs_and_entropy
from aspo_lit.rollout.batch import position_ids_from_mask

__all__ = ["response_logprobs", "response_logprobs_unfused", "FUSED_MODEL_TYPES", "distinct_prompts",
           "prompt_sharing_applies", "PromptStates", "encode_prompts", "responses_from_prompts",
           "prompt_backward_term"]

# `XForCausalLM.forward` ends in `logits = self.lm_head(hidden_states[:, slice_indices, :])`, then
# only the (unused) loss: checked in transformers' modeling files for each of these.
FUSED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe"})


def _fusable_head(model: torch.nn.Module) -> torch.nn.Linear | None:
    """The model's `nn.Linear` LM head when the fused path applies to it, else None."""
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) not in FUSED_MODEL_TYPES:
        return None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return head if isinstance(head, torch.nn.Linear) else None


@contextmanager
def _head_forward(head: torch.nn.Module, forward: Callable[[Tensor], Tensor]) -> Iterator[None]:
    """Temporarily replace `head.forward` (an instance attribute shadows the class method)."""
    head.forward = forward
    try:
        yield
    finally:
        del head.forward


def _model_inputs(input_ids: Tensor, attention_mask: Tensor, num_response: int) -> dict:
    return dict(input_ids=input_ids, attention_mask=attention_mask,
                position_ids=position_ids_from_mask(attention_mask),
                logits_to_keep=num_response + 1, use_cache=False)


def response_logprobs(
    model: torch.nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    prompt_length: int,
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    with_entropy: bool = False,
    share_prompt: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """log pi(o_t | q, o_<t) for every response position, fp32 `[B, T]` (differentiable w.r.t. the
    model's parameters), and the token entropy (fp32 `[B, T]`, detached; None unless
    `with_entropy`). `temperature` divides the logits; `chunk_size` tokens' logits at most exist
    at once; `share_prompt` computes each distinct prompt once (module docstring)."""
    head = _fusable_head(model)
    if head is None:
        return response_logprobs_unfused(model, input_ids, attention_mask, prompt_length,
                                         temperature=temperature, chunk_size=chunk_size, with_entropy=with_entropy)
    num_response = input_ids.shape[1] - prompt_length
    if share_prompt and num_response > 0 and prompt_sharing_applies(model):
        first, owner = distinct_prompts(input_ids, attention_mask, prompt_length)
        if first.numel() < owner.numel():
            prompts = encode_prompts(model, input_ids[first, :prompt_length], attention_mask[first, :prompt_length])
            return responses_from_prompts(model, input_ids, attention_mask, prompt_length, prompts, owner,
                                          temperature=temperature, chunk_size=chunk_size, with_entropy=with_entropy)
    inputs = _model_inputs(input_ids, attention_mask, num_response)
    return _with_fused_head(model, head, input_ids[:, prompt_length:], inputs,
                            temperature=temperature, chunk_size=chunk_size, with_entropy=with_entropy)


def _with_fused_head(model, head, labels: Tensor, inputs: dict, *, first_hidden: Tensor | None = None,
                     temperature: float, chunk_size: int, with_entropy: bool) -> tuple[Tensor, Tensor | None]:
    """``model(**inputs)`` with its head's ``forward`` swapped for the fused log-prob reduction of
    ``labels``: the head receives one more position than ``labels`` (the last predicts nothing);
    ``first_hidden`` ``[B, 1, H]``, when given, is the hidden state that predicts ``labels[:, 0]``
    (a shared prompt's last position), put before the head's positions."""
    entropy: list[Tensor | None] = [None]

    def fused_head(hidden: Tensor) -> Tensor:  # hidden [B, T+1, H], or [B, T, H] after first_hidden
        hidden = hidden[:, :-1]
        if first_hidden is not None:
            hidden = torch.cat([first_hidden.to(hidden.dtype), hidden], dim=1)
        logprobs, entropy[0] = fused_linear_logprobs(
            hidden, head.weight, labels, head.bias,
            temperature=temperature, chunk_size=chunk_size, with_entropy=with_entropy)
        return logprobs

    with _head_forward(head, fused_head):
        out = model(**inputs)
    return out.logits, entropy[0]


def distinct_prompts(input_ids: Tensor, attention_mask: Tensor, prompt_length: int) -> tuple[Tensor, Tensor]:
    """``(first, owner)``: the first row of each distinct prompt (ids and mask of the first
    ``prompt_length`` columns), in row order, and each row's index into ``first``."""
    key = torch.cat([input_ids[:, :prompt_length], attention_mask[:, :prompt_length].to(input_ids.dtype)], 1)
    _, inverse = torch.unique(key, dim=0, return_inverse=True)
    rows = torch.arange(key.shape[0], device=key.device)
    first_of = torch.full((int(inverse.max()) + 1,), key.shape[0], dtype=torch.long, device=key.device)
    first_of.scatter_reduce_(0, inverse, rows, reduce="amin")
    order = torch.argsort(first_of)  # distinct prompts in the order of their first row
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=key.device)
    return first_of[order], rank[inverse]


def prompt_sharing_applies(model: torch.nn.Module) -> bool:
    """The shared-prompt path's conditions that the model decides (module docstring)."""
    if _fusable_head(model) is None:
        return False
    if getattr(model, "is_gradient_checkpointing", False) and model.training:
        return False
    if any(hasattr(p, "full_tensor") for p in model.parameters()):
        return False  # a DTensor shard (FSDP2): ASPOModule refuses share_prompt there
    cache = DynamicCache(config=model.config)
    return bool(cache.layers) and all(type(layer) is DynamicLayer for layer in cache.layers)


@dataclass
class PromptStates:
    """What a prompt pass leaves for its responses, one entry per distinct prompt: each layer's
    keys and values ``[U, heads, P, d]`` and the final hidden state of the last prompt position
    ``[U, 1, H]`` (which predicts response token 0)."""

    keys: list[Tensor]
    values: list[Tensor]
    last_hidden: Tensor

    def leaves(self) -> "PromptStates":
        """The same values as leaves of a new graph (each requires grad): the responses' backwards
        accumulate into their ``.grad``, and `prompt_backward_term` carries the sum through the
        prompt pass once."""
        detach = lambda t: t.detach().requires_grad_(True)  # noqa: E731
        return PromptStates([detach(k) for k in self.keys], [detach(v) for v in self.values], detach(self.last_hidden))

    def tensors(self) -> list[Tensor]:
        return [*self.keys, *self.values, self.last_hidden]

    def cache_for(self, owner: Tensor, config) -> DynamicCache:
        """A ``DynamicCache`` holding each row's prompt (``owner``: the row's index into the prompts)."""
        cache = DynamicCache(config=config)
        for layer, (keys, values) in enumerate(zip(self.keys, self.values)):
            cache.update(keys.index_select(0, owner), values.index_select(0, owner), layer)
        return cache


def encode_prompts(model: torch.nn.Module, prompt_ids: Tensor, prompt_mask: Tensor) -> PromptStates:
    """The prompt pass of the shared-prompt path: ``[U, P]`` left-padded distinct prompts, with the
    grad when it is enabled (module docstring)."""
    head = _fusable_head(model)
    cache = DynamicCache(config=model.config)
    # the head hands back its input as the root's output: the last position's final hidden state
    with _head_forward(head, lambda hidden: hidden):
        last_hidden = model(input_ids=prompt_ids, attention_mask=prompt_mask,
                            position_ids=position_ids_from_mask(prompt_mask), past_key_values=cache,
                            use_cache=True, logits_to_keep=1).logits
    return PromptStates([layer.keys for layer in cache.layers], [layer.values for layer in cache.layers], last_hidden)


def prompt_backward_term(computed: PromptStates, leaves: PromptStates) -> Tensor:
    """A scalar whose backward is the prompt pass's backward for the gradients accumulated on
    ``leaves`` (the vector-Jacobian product ``Σ <t, ∂L/∂t>``, the leaves' grads held constant)."""
    terms = [(t * leaf.grad).sum() for t, leaf in zip(computed.tensors(), leaves.tensors()) if leaf.grad is not None]
    return torch.stack(terms).sum() if terms else computed.last_hidden.sum() * 0.0


def responses_from_prompts(
    model: torch.nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    prompt_length: int,
    prompts: PromptStates,
    owner: Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    with_entropy: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """`response_logprobs` of rows whose prompts were computed by `encode_prompts`: only the
    response columns of ``input_ids`` run, against the cache of each row's prompt
    (``prompts``' entry ``owner[row]``)."""
    labels = input_ids[:, prompt_length:]
    inputs = dict(input_ids=labels, attention_mask=attention_mask,
                  position_ids=position_ids_from_mask(attention_mask)[:, prompt_length:],
                  past_key_values=prompts.cache_for(owner, model.config), use_cache=False,
                  logits_to_keep=labels.shape[1])
    return _with_fused_head(model, _fusable_head(model), labels, inputs, first_hidden=prompts.last_hidden.index_select(0, owner),
                            temperature=temperature, chunk_size=chunk_size, with_entropy=with_entropy)


def response_logprobs_unfused(
    model: torch.nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    prompt_length: int,
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    with_entropy: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """`response_logprobs` through the model's `[B, T+1, vocab]` logits (any causal LM)."""
    num_response = input_ids.shape[1] - prompt_length
    out = model(**_model_inputs(input_ids, attention_mask, num_response))
    logits = out.logits[:, :-1]
    labels = input_ids[:, prompt_length:]
    return logprobs_and_entropy(
        logits, labels, chunk_size=chunk_size, with_entropy=with_entropy, temperature=temperature
    )
