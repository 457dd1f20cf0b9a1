"""Per-token log-probs (and entropy) of response tokens under a causal LM.

Rows are `[left-padded prompt | right-padded response]`; response token t sits at column
`prompt_length + t`, predicted from the hidden state at column `prompt_length + t - 1`.

`response_logprobs` never materialises `[B, T, vocab]` logits: the model runs its own forward
(`logits_to_keep=T+1`, so only the response positions reach the head), but for that call the LM
head's `forward` is swapped for the fused-linear reduction of :mod:`aspo_lit.fused_logprobs`
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
:mod:`aspo_lit.logprobs`, exact but `O(T × vocab)` in memory.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

import torch
from torch import Tensor

from aspo_lit.fused_logprobs import fused_linear_logprobs
from aspo_lit.logprobs import logprobs_and_entropy
from aspo_lit.rollout.batch import position_ids_from_mask

__all__ = ["response_logprobs", "response_logprobs_unfused", "FUSED_MODEL_TYPES"]

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
) -> tuple[Tensor, Tensor | None]:
    """log pi(o_t | q, o_<t) for every response position, fp32 `[B, T]` (differentiable w.r.t. the
    model's parameters), and the token entropy (fp32 `[B, T]`, detached; None unless
    `with_entropy`). `temperature` divides the logits; `chunk_size` tokens' logits at most exist
    at once."""
    head = _fusable_head(model)
    if head is None:
        return response_logprobs_unfused(model, input_ids, attention_mask, prompt_length,
                                         temperature=temperature, chunk_size=chunk_size, with_entropy=with_entropy)
    num_response = input_ids.shape[1] - prompt_length
    labels = input_ids[:, prompt_length:]
    entropy: list[Tensor | None] = [None]

    def fused_head(hidden: Tensor) -> Tensor:  # hidden [B, T+1, H]; the last position predicts nothing
        logprobs, entropy[0] = fused_linear_logprobs(
            hidden[:, :-1], head.weight, labels, head.bias,
            temperature=temperature, chunk_size=chunk_size, with_entropy=with_entropy)
        return logprobs

    with _head_forward(head, fused_head):
        out = model(**_model_inputs(input_ids, attention_mask, num_response))
    return out.logits, entropy[0]


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
