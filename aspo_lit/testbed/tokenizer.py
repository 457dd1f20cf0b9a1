"""The testbed's tokenizer: byte-level BPE with chat markers, and prompt encoding (docs/testbed.md).

Digits are always single tokens; special tokens ``<s> </s> <pad> <unk>`` and chat markers
``<|system|> <|user|> <|assistant|>``; wrapped as a ``PreTrainedTokenizerFast`` with a jinja chat
template (:data:`CHAT_TEMPLATE`). :func:`left_padded` batches prompts for generation.
"""
from __future__ import annotations

from typing import Sequence

from aspo_lit.prompts import encode_prompt
from aspo_lit.testbed.config import TestbedConfig

__all__ = ["CHAT_TEMPLATE", "SPECIAL_TOKENS", "train_tokenizer", "encode_prompts", "left_padded"]

BOS, EOS, PAD, UNK = "<s>", "</s>", "<pad>", "<unk>"
SYSTEM, USER, ASSISTANT = "<|system|>", "<|user|>", "<|assistant|>"
SPECIAL_TOKENS = [PAD, BOS, EOS, UNK, SYSTEM, USER, ASSISTANT]

#: ``<s><|user|>{problem}{instruction}</s><|assistant|>{solution}</s>``; every turn ends with EOS,
#: so generation stops at the tokenizer's ``eos_token_id``.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)

# GPT-2-style split, except that every digit is its own piece (numbers are read digit by digit).
_SPLIT_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def train_tokenizer(config: TestbedConfig, corpus: Sequence[str]):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=max(config.vocab_size, 256 + len(SPECIAL_TOKENS)),
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK,
        additional_special_tokens=[SYSTEM, USER, ASSISTANT],
        clean_up_tokenization_spaces=False, model_max_length=config.max_position_embeddings,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def encode_prompts(tokenizer, problems: Sequence[str]) -> list[list[int]]:
    """The chat-template prompt ids of each problem (``aspo_lit.prompts.encode_prompt``)."""
    return [encode_prompt(p, tokenizer, "chat", enable_thinking=None) for p in problems]


def left_padded(prompts: Sequence[Sequence[int]], pad_id: int):
    """``(ids, attention_mask)`` of prompts padded on the left, so that generation continues every
    prompt at the same position."""
    import torch
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    return ids, mask
