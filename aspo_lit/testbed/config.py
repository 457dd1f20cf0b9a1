"""The testbed's config and where its build is cached (docs/testbed.md).

:class:`TestbedConfig` holds everything that determines a testbed artefact; :data:`PROFILES` names
the shipped ones; :func:`config_hash` (with :data:`BUILDER_VERSION`) names the cache folder
``<cache root>/testbed-<hash>/`` (:func:`testbed_dir`), so a changed config builds a new testbed.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["BUILDER_VERSION", "TestbedConfig", "PROFILES", "config_hash", "default_cache_dir", "testbed_dir"]

#: Bump when the build procedure changes in a way that changes the artefact.
BUILDER_VERSION = 2


@dataclass
class TestbedConfig:
    """Everything that determines the testbed artefact (its hash names the cache folder)."""

    seed: int = 0
    # data: "arithmetic" (aspo_lit.testbed.arithmetic: 1-3 forced steps) or "chain"
    # (aspo_lit.testbed.multistep: `ops` operations, freely worded solutions)
    task: str = "arithmetic"
    levels: tuple[int, ...] = (1, 2, 3)
    num_train_problems: int = 20000
    word_prob: float = 0.5
    ops: tuple[int, ...] = (4, 5, 6, 7)
    comment_prob: float = 0.6
    check_prob: float = 0.15
    max_value: int = 99
    # tokenizer: byte-level BPE; vocab_size <= 263 (256 bytes + 7 specials) means no merges,
    # i.e. a pure byte/character-level tokenizer
    vocab_size: int = 512
    tokenizer_train_problems: int = 4000
    # model (LlamaConfig); head_dim = hidden_size / num_attention_heads = 32
    model_type: str = "llama"
    hidden_size: int = 128
    intermediate_size: int = 512
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 4
    max_position_embeddings: int = 256
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    # supervised warm start: AdamW, linear warm-up then cosine to 10% at sft_max_steps; the
    # accuracy target is normally met near the end of the cosine (steps ~800 of 900)
    sft_max_steps: int = 900
    sft_batch_size: int = 16
    sft_lr: float = 5e-3
    sft_warmup_steps: int = 30
    sft_weight_decay: float = 0.01
    grad_clip: float = 1.0
    # early stop: every eval_every steps, the accuracy at `temperature` on `dev_problems` held-out
    # problems: "expected" = the probability of reproducing the worked solution (one forward pass;
    # right when the solution is forced), "sampled" = one real sample per problem (when the
    # wording is free, the gold solution's probability says nothing about correctness)
    stop_on: str = "expected"
    eval_every: int = 10
    eval_min_step: int = 200
    dev_problems: int = 128
    stop_accuracy: float = 0.45
    # final report: sampled accuracy on `heldout_problems` other held-out problems
    heldout_problems: int = 256
    max_response_tokens: int = 64
    temperature: float = 1.0
    num_threads: int = 1  # the build's torch threads (1: bit-reproducible, robust on shared cores)

    def __post_init__(self):
        self.levels = tuple(int(x) for x in self.levels)
        self.ops = tuple(int(x) for x in self.ops)
        if self.task not in ("arithmetic", "chain"):
            raise ValueError(f"task must be 'arithmetic' or 'chain', got {self.task!r}")
        if self.stop_on not in ("expected", "sampled"):
            raise ValueError(f"stop_on must be 'expected' or 'sampled', got {self.stop_on!r}")
        head_dim = self.hidden_size // self.num_attention_heads
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size must be divisible by num_attention_heads")
        if head_dim not in (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512):
            raise ValueError(f"head_dim {head_dim} is not supported by vLLM's CPU attention")
        if self.model_type not in ("llama", "qwen3"):
            raise ValueError("model_type must be 'llama' or 'qwen3' (qwen2's tokenizer class "
                             "re-splits digits in transformers 5)")

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["levels"] = list(self.levels)
        d["ops"] = list(self.ops)
        return d

    def problems(self, n: int, split: str) -> list[dict]:
        """``n`` problems of ``split`` ("train" / "heldout") from this config's generator."""
        if self.task == "chain":
            from aspo_lit.testbed.multistep import generate_chain_problems
            return generate_chain_problems(n, self.seed, self.ops, split=split,
                                           comment_prob=self.comment_prob, check_prob=self.check_prob,
                                           max_value=self.max_value)
        from aspo_lit.testbed.arithmetic import generate_problems
        return generate_problems(n, self.seed, self.levels, split=split, word_prob=self.word_prob)


#: Named testbeds: ``model_name_or_path: testbed`` (the fast demo: 1-3 forced steps, ~21-token
#: answers, 0.09 nats/token) and ``testbed-long`` (the paper's regime: 4-7 operations worded
#: freely, ~170-token answers, 0.44 nats/token; docs/studies/testbed-long.md).
PROFILES: dict[str, TestbedConfig] = {
    "testbed": TestbedConfig(),
    "testbed-long": TestbedConfig(
        task="chain", num_train_problems=20000, vocab_size=1024, tokenizer_train_problems=4000,
        hidden_size=128, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=512, sft_max_steps=1500, sft_batch_size=16,
        sft_lr=5e-3, sft_warmup_steps=50, stop_on="sampled", eval_every=100, eval_min_step=400,
        dev_problems=64, stop_accuracy=0.35, heldout_problems=256, max_response_tokens=320),
}


def config_hash(config: TestbedConfig) -> str:
    payload = json.dumps({"builder": BUILDER_VERSION, **config.to_dict()}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:12]


def default_cache_dir() -> Path:
    """``$ASPO_LIT_CACHE``, else ``<repo>/.cache/aspo_lit`` (or ``~/.cache/aspo_lit`` when the
    package is installed outside a checkout)."""
    env = os.environ.get("ASPO_LIT_CACHE")
    if env:
        return Path(env).expanduser()
    repo = Path(__file__).resolve().parents[2]
    if (repo / "pyproject.toml").is_file():
        return repo / ".cache" / "aspo_lit"
    return Path.home() / ".cache" / "aspo_lit"


def testbed_dir(config: TestbedConfig | None = None, cache_dir: str | os.PathLike | None = None) -> Path:
    config = config or TestbedConfig()
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return root / f"testbed-{config_hash(config)}"
