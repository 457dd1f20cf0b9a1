"""Stand-in models of the rehearsal (docs/verification.md, "Rehearsing the shipped configs on
CPU"): a shipped config's architecture or size at CPU cost, with random weights and the testbed's
tokenizer, built from a config and cached in ``<cache>/<name>`` like the testbeds (rebuilt when
the spec changes).

- :data:`TINY_MOE` (``testbed-moe``), for ``qwen3_30b_a3b``: Qwen3-30B-A3B is a mixture of
  experts and the testbed a dense llama, so a rehearsal on the testbed runs none of the MoE code
  (the router, the fused expert weights, their push to vLLM and the checksum's TP accounting of
  them). The same architecture at CPU size: 2 layers, hidden 128, 4 experts, top-2, fp32, untied.
- :data:`REAL_SHAPE` (``testbed-real-shape``), for ``aspo_real_shape``: the host memory of the
  colocated path depends on shapes only, and the testbed (0.65M parameters) hides what a real
  model costs per rank. A llama of a real 135M chat checkpoint's shape: 30 layers, hidden 576,
  intermediate 1536, 9 heads, 3 KV heads, head dim 64, vocabulary 49,152, tied embeddings, saved
  in bf16 as such checkpoints are (the engine's dtype "auto" then runs bf16), with the weight
  magnitudes of a pretrained checkpoint rather than a fresh initialisation's (``magnitudes``): RMSNorm
  weights of several units (log-uniform in [0.5, 8]; a fresh model's are all 1) and embeddings of
  standard deviation 0.05 (a fresh one's: 0.02). What a rehearsal's bounds depend on: whether an AdamW
  step of a warm-up lr is representable on such a weight (ulp(4.0) = 4.8e-7 in fp32), and how much
  rounding moves a bf16 update.

Random weights never solve a problem, so their rehearsals score a response by its length
(``aspo_lit.rewards.plumbing.LengthReward``: lengths vary within every group, so every rollout
batch has a gradient). The vocabulary rows past the tokenizer's are never sampled by a trained
model; here they are, and the tokenizer decodes them as nothing (the reward reads the length in
tokens).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["REAL_SHAPE", "TINY_MOE", "StandIn", "build_standin", "standin_dir"]

SEED = 0
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


@dataclass(frozen=True)
class StandIn:
    folder: str           # under the testbeds' cache
    model_class: str      # a transformers class name
    config_class: str
    fields: dict = field(default_factory=dict)   # the config's fields (vocabulary and special tokens: the testbed's unless given)
    dtype: str = "float32"                       # saved dtype, written as config.dtype ("auto" engines run it)
    magnitudes: dict = field(default_factory=dict)   # {"norm": (low, high), "embedding_std": s}: a pretrained model's


TINY_MOE = StandIn(
    "testbed-moe", "Qwen3MoeForCausalLM", "Qwen3MoeConfig",
    dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=2,
         num_attention_heads=4, num_key_value_heads=4, head_dim=32, num_experts=4, num_experts_per_tok=2,
         decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True, max_position_embeddings=256,
         tie_word_embeddings=False, rms_norm_eps=1e-5, initializer_range=0.02))
REAL_SHAPE = StandIn(
    "testbed-real-shape", "LlamaForCausalLM", "LlamaConfig",
    dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
         num_key_value_heads=3, head_dim=64, vocab_size=49152, tie_word_embeddings=True,
         max_position_embeddings=2048, rms_norm_eps=1e-5, initializer_range=0.02),
    dtype="bfloat16", magnitudes={"norm": (0.5, 8.0), "embedding_std": 0.05})


def standin_dir(spec: StandIn, cache_dir: str | Path | None = None) -> Path:
    """``<cache_dir>/<spec.folder>`` (``cache_dir``: the testbeds' cache, ``default_cache_dir()``)."""
    from aspo_lit.testbed import default_cache_dir

    return (Path(cache_dir) if cache_dir is not None else default_cache_dir()) / spec.folder


def _digest(spec: StandIn, testbed: Path) -> str:
    """Names the build: the spec, the seed and the tokenizer it was built with."""
    payload = json.dumps({"spec": [spec.model_class, spec.fields, spec.dtype, spec.magnitudes], "seed": SEED,
                          "testbed": testbed.name}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:12]


def _build_into(out: Path, spec: StandIn, testbed: Path, digest: str) -> None:
    """Random weights from ``spec`` and the testbed's tokenizer files, saved in ``out``."""
    import torch
    import transformers

    dense = json.loads((testbed / "config.json").read_text())
    special = {k: dense[k] for k in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id") if k not in spec.fields}
    config = getattr(transformers, spec.config_class)(**spec.fields, **special)
    config.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    config.dtype = spec.dtype
    torch.manual_seed(SEED)
    model = getattr(transformers, spec.model_class)(config)
    pretrained_magnitudes(model, **spec.magnitudes)
    model = model.to(getattr(torch, spec.dtype))
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        shutil.copy(testbed / name, out / name)
    params = sum(p.numel() for p in model.parameters())
    (out / "testbed.json").write_text(json.dumps({"config_hash": digest, "config": spec.fields, "dtype": spec.dtype,
                                                  "seed": SEED, "tokenizer_from": str(testbed), "parameters": params},
                                                 indent=2))


def pretrained_magnitudes(model, norm: tuple[float, float] | None = None, embedding_std: float | None = None) -> None:
    """Give a fresh model a pretrained checkpoint's weight magnitudes (module docstring): every RMSNorm
    weight log-uniform in ``norm``, the input embedding (the head too, when tied) normal with
    ``embedding_std``."""
    import math

    import torch

    with torch.no_grad():
        if norm is not None:
            low, high = math.log(norm[0]), math.log(norm[1])
            for module in model.modules():
                if type(module).__name__.endswith("RMSNorm"):
                    module.weight.copy_(torch.empty_like(module.weight).uniform_(low, high).exp())
        if embedding_std is not None:
            model.get_input_embeddings().weight.normal_(0.0, embedding_std)


def build_standin(spec: StandIn, cache_dir: str | Path | None = None, force: bool = False) -> Path:
    """The stand-in's folder, built (seconds; atomically, as the testbeds) when missing or built
    from another spec. Loads with ``from_pretrained`` and ``vllm.LLM(model=...)``."""
    from aspo_lit.testbed.build import publish
    from aspo_lit.testbed.shipped import shipped_dir

    testbed = shipped_dir("testbed")
    final, digest = standin_dir(spec, cache_dir), _digest(spec, testbed)
    meta = final / "testbed.json"
    if meta.is_file() and not force and json.loads(meta.read_text()).get("config_hash") == digest:
        return final
    return publish(final, lambda tmp: _build_into(tmp, spec, testbed, digest), keep_concurrent=False)


if __name__ == "__main__":
    print(build_standin(TINY_MOE), build_standin(REAL_SHAPE))
