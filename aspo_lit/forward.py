"""Per-token log-probs (and entropy) of response tokens under a causal LM.

Rows are `[left-padded prompt | right-padded response]`; response token t sits at column
`prompt_length + t`. Only the last T+1 positions go through the LM head (`logits_to_keep`), and
the log-softmax / entropy maths runs in chunks (aspo_lit.logprobs), so a 150k vocabulary never
materialises [tokens x vocab] in fp32.
"""

from __future__ import annotations

import torch
from torch import Tensor

from aspo_lit.logprobs import logprobs_and_entropy
from aspo_lit.rollout.batch import position_ids_from_mask


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
    """log pi(o_t | q, o_<t) for every response position, fp32 `[B, T]`, and the token entropy."""
    num_response = input_ids.shape[1] - prompt_length
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        logits_to_keep=num_response + 1,
        use_cache=False,
    )
    logits = out.logits[:, :-1]
    labels = input_ids[:, prompt_length:]
    return logprobs_and_entropy(
        logits, labels, chunk_size=chunk_size, with_entropy=with_entropy, temperature=temperature
    )
