"""The testbed's tiny policy: its ``LlamaConfig``/``Qwen3Config`` and generation config (docs/testbed.md).

fp32, *untied* input/output embeddings (vLLM weight reloads never leave a stale packed ``lm_head``),
head_dim 32 (which vLLM's CPU attention supports); sampling is plain ancestral sampling.
"""
from __future__ import annotations

import contextlib

from aspo_lit.testbed.config import TestbedConfig

__all__ = ["model_config", "generation_config_for"]


def model_config(config: TestbedConfig, tokenizer):
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.hidden_size // config.num_attention_heads,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=config.tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        rms_norm_eps=1e-5,
        initializer_range=0.02,
        use_cache=True,
    )
    if config.model_type == "llama":
        from transformers import LlamaConfig
        cfg = LlamaConfig(rope_theta=config.rope_theta, **common)
    else:
        from transformers import Qwen3Config
        cfg = Qwen3Config(rope_theta=config.rope_theta, **common)
    with contextlib.suppress(Exception):  # attribute name differs across transformers versions
        cfg.rope_parameters = {"rope_type": "default", "rope_theta": config.rope_theta}
    cfg.dtype = "float32"
    return cfg


def generation_config_for(tokenizer, config: TestbedConfig):
    from transformers import GenerationConfig
    # Plain ancestral sampling by default (transformers' default top_k=50 would truncate it).
    return GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, do_sample=True, temperature=config.temperature,
        top_k=0, top_p=1.0, max_new_tokens=config.max_response_tokens,
    )
