"""The MoE stand-in of the `qwen3_30b_a3b` rehearsal (docs/verification.md, "Rehearsing the
shipped configs on CPU"): a tiny random ``Qwen3MoeForCausalLM`` with the testbed's tokenizer, and
the reward that gives its random policy a gradient.

The shipped config trains Qwen3-30B-A3B, a mixture of experts; the testbed is a dense llama, so a
rehearsal on it runs none of the MoE code (the router, the fused expert weights, their push to
vLLM and the checksum's TP accounting of them). :func:`build_tiny_moe` builds the same
architecture at CPU size (2 layers, hidden 128, 4 experts, top-2, fp32, untied head), with random
weights, cached in ``<cache>/testbed-moe`` like the testbeds (rebuilt when :data:`MOE_CONFIG`
changes). Random weights never solve a problem, so ``aspo_lit.rewards.plumbing.LengthReward``
scores a response by its length (lengths vary within every group: every rollout batch has a
gradient).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

__all__ = ["MOE_CONFIG", "build_tiny_moe", "moe_dir"]

#: the ``Qwen3MoeConfig`` fields of the stand-in (vocabulary and special tokens: the testbed's)
MOE_CONFIG = dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=4, head_dim=32, num_experts=4, num_experts_per_tok=2,
                  decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True, max_position_embeddings=256,
                  tie_word_embeddings=False, rms_norm_eps=1e-5, initializer_range=0.02)
SEED = 0
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def moe_dir(cache_dir: str | Path | None = None) -> Path:
    """``<cache_dir>/testbed-moe`` (``cache_dir``: the testbeds' cache, ``default_cache_dir()``)."""
    from aspo_lit.testbed import default_cache_dir

    return (Path(cache_dir) if cache_dir is not None else default_cache_dir()) / "testbed-moe"


def _moe_hash(testbed: Path) -> str:
    """Names the build: the config, the seed and the tokenizer it was built with."""
    payload = json.dumps({"config": MOE_CONFIG, "seed": SEED, "testbed": testbed.name}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:12]


def _build_into(out: Path, testbed: Path, digest: str) -> None:
    """Random fp32 weights from ``MOE_CONFIG`` and the testbed's tokenizer files, saved in ``out``."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    dense = json.loads((testbed / "config.json").read_text())
    special = {k: dense[k] for k in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id")}
    config = Qwen3MoeConfig(**MOE_CONFIG, **special)
    config.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    config.dtype = "float32"  # the engine's dtype "auto" then keeps fp32, as for the testbed
    torch.manual_seed(SEED)
    model = Qwen3MoeForCausalLM(config).float()
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        shutil.copy(testbed / name, out / name)
    params = sum(p.numel() for p in model.parameters())
    (out / "testbed.json").write_text(json.dumps({"config_hash": digest, "config": MOE_CONFIG, "seed": SEED,
                                                  "tokenizer_from": str(testbed), "parameters": params}, indent=2))


def build_tiny_moe(cache_dir: str | Path | None = None, force: bool = False) -> Path:
    """The stand-in's folder, built (a few seconds; atomically, as the testbeds) when missing or
    built from another config. Loads with ``from_pretrained`` and ``vllm.LLM(model=...)``."""
    from aspo_lit.testbed import build_testbed
    from aspo_lit.testbed.build import publish

    testbed = build_testbed(cache_dir=cache_dir, verbose=False)
    final, digest = moe_dir(cache_dir), _moe_hash(testbed)
    meta = final / "testbed.json"
    if meta.is_file() and not force and json.loads(meta.read_text()).get("config_hash") == digest:
        return final
    return publish(final, lambda tmp: _build_into(tmp, testbed, digest), keep_concurrent=False)


if __name__ == "__main__":
    print(build_tiny_moe())
