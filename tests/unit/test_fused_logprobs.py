"""Fused linear log-probs (hidden states + LM-head weight, chunked) against the naive full-logits path:
values, entropy and gradients (of hidden, of the head weight and bias, and of every model parameter
through `response_logprobs`), tied and untied heads, padded rows, under FSDP2 too.

Every fp32 comparison runs the same maths in float64 beside it: the path under test must be as
accurate as the trusted fp32 one (`tests.helpers.tolerance.assert_as_accurate`; docs/design.md, "Tolerances
in tests")."""

from __future__ import annotations

import copy
import math
import os

import pytest
import torch
from torch.nn import functional as F

from aspo_lit.maths.fused_logprobs import fused_linear_logprobs
from aspo_lit.rollout.base import Completion
from aspo_lit.rollout.batch import pack_rollouts, position_ids_from_mask
from aspo_lit.training.forward import response_logprobs, response_logprobs_unfused
from tests.helpers.ranks import leave_group
from tests.helpers.tolerance import assert_as_accurate, assert_within, gamma, log_softmax_tol, rounding_tol
from tools.ports import free_port

pytestmark = pytest.mark.numerics
VOCAB = 50


def fp32_or_wider(t: torch.Tensor) -> torch.Tensor:
    """fp32 maths, float64 for the float64 reference."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def log_softmax_and_entropy(logits: torch.Tensor, temperature: float):
    """Full-vocabulary log_softmax and entropy, the entropy as chunk_forward writes it, log Z - E_softmax[z]
    (so that an fp32 reference rounds the same maths: -Σ p·log p rounds less near one-hot logits)."""
    z = fp32_or_wider(logits) / temperature
    logp = torch.log_softmax(z, dim=-1)
    return logp, torch.logsumexp(z, dim=-1) - (logp.exp() * z).sum(-1)


def naive(hidden, weight, labels, bias=None, temperature=1.0):
    logits = hidden @ weight.T + (bias if bias is not None else 0.0)
    logp, entropy = log_softmax_and_entropy(logits, temperature)
    return logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1), entropy


def _grads(loss, tensors):
    return torch.autograd.grad(loss, tensors)


def head_error_bounds(hidden, weight, bias, labels, upstream, temperature=1.0) -> dict[str, torch.Tensor | float]:
    """First-order a-priori bounds on |fp32 - exact| of lp, entropy and the gradients of (lp·upstream).sum()
    w.r.t. hidden, weight and bias, for z = (h·Wᵀ + b)/τ then the log-softmax, in any order of the sums:
    z is off by γ_{H+2}·(|h||W|ᵀ + |b|)/τ (H products and sums, + b, /τ), which moves lp by <= 2 max δz and
    H by <= 2 log V max δz (∂H/∂z_j = -softmax_j (z_j - E z)); softmax_j = exp(z_j - log Z) is then off by a
    relative lp-bound + 2 max δz + 3u, g = (onehot - softmax)·upstream/τ by that and 3u more (×, scatter-add,
    /τ) of G = (onehot + softmax)|upstream|/τ >= |g|; the gradients are V-term (hidden) and n-token (weight,
    bias) sums of g: γ_V·G|W| and γ_n·Gᵀ|h| plus the error of g carried through them."""
    h, W = hidden.detach().double().reshape(-1, hidden.shape[-1]), weight.detach().double()
    b = bias.detach().double() if bias is not None else torch.zeros(W.shape[0], dtype=torch.float64)
    (n, H), V = h.shape, W.shape[0]
    z = (h @ W.T + b) / temperature
    z_err = (gamma(H + 2) * (h.abs() @ W.abs().T + b.abs()) / temperature).max().item()
    lp_tol, entropy_tol = log_softmax_tol(z)  # the rounding of /τ is in z_err
    softmax_rel = lp_tol + 2 * z_err + rounding_tol(torch.float32, 3)
    onehot = torch.nn.functional.one_hot(labels.reshape(-1), V).double()
    G = (onehot + z.softmax(-1)) * upstream.detach().double().reshape(-1, 1).abs() / temperature
    g_err = (softmax_rel + rounding_tol(torch.float32, 3)) * G
    return {"lp": lp_tol + 2 * z_err, "entropy": entropy_tol + 2 * math.log(V) * z_err,
            "hidden": ((gamma(V) * G + g_err) @ W.abs()).view(hidden.shape),
            "weight": (gamma(n) * G + g_err).T @ h.abs(), "bias": (gamma(n) * G + g_err).sum(0)}


def float64_copies(tensors):
    return [t.detach().double().requires_grad_(t.requires_grad) if t is not None else None for t in tensors]


def assert_all_as_accurate(got, ref, truth, names):
    for name, g, r, t in zip(names, got, ref, truth, strict=True):
        assert_as_accurate(g, r, t, name=name)


@pytest.mark.parametrize("chunk_size", [1, 3, 7, 4096])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("with_bias", [False, True])
def test_function_equals_naive(chunk_size, temperature, with_bias):
    g = torch.Generator().manual_seed(chunk_size)
    B, T, H = 2, 5, 16
    hidden = torch.randn(B, T, H, generator=g, requires_grad=True)
    weight = (torch.randn(VOCAB, H, generator=g) * 0.5).requires_grad_(True)
    bias = torch.randn(VOCAB, generator=g).requires_grad_(True) if with_bias else None
    labels = torch.randint(0, VOCAB, (B, T), generator=g)
    upstream = torch.randn(B, T, generator=g)
    inputs = [hidden, weight] + ([bias] if with_bias else [])

    lp, entropy = fused_linear_logprobs(hidden, weight, labels, bias, temperature=temperature,
                                        chunk_size=chunk_size, with_entropy=True)
    ref_lp, ref_entropy = naive(hidden, weight, labels, bias, temperature)
    hidden64, weight64, bias64 = float64_copies([hidden, weight, bias])
    true_lp, true_entropy = naive(hidden64, weight64, labels, bias64, temperature)
    inputs64 = [hidden64, weight64] + ([bias64] if with_bias else [])
    assert lp.dtype == entropy.dtype == torch.float32 and lp.shape == (B, T)
    assert not entropy.requires_grad
    bounds = head_error_bounds(hidden, weight, bias, labels, upstream, temperature)
    names = ["lp", "entropy", "hidden", "weight", "bias"][:len(inputs) + 2]
    truth = [true_lp, true_entropy, *_grads((true_lp * upstream.double()).sum(), inputs64)]
    # the fused path and, as a check of the bounds themselves, the naive fp32 one
    for path, (path_lp, path_entropy) in (("fused", (lp, entropy)), ("naive", (ref_lp, ref_entropy))):
        got = [path_lp, path_entropy, *_grads((path_lp * upstream).sum(), inputs)]
        for name, value, want in zip(names, got, truth, strict=True):
            assert_within(value, want, bounds[name], name=f"{path} {name}")


def test_without_entropy_and_validation():
    hidden, weight = torch.randn(3, 8), torch.randn(VOCAB, 8)
    labels = torch.tensor([0, 1, VOCAB - 1])
    lp, entropy = fused_linear_logprobs(hidden, weight, labels, chunk_size=2)
    assert entropy is None
    bound = head_error_bounds(hidden, weight, None, labels, torch.zeros(3))["lp"]
    assert_within(lp, naive(hidden.double(), weight.double(), labels)[0], bound, name="lp")
    with pytest.raises(ValueError, match="labels"):
        fused_linear_logprobs(hidden, weight, torch.tensor([0, 1, VOCAB]))
    with pytest.raises(ValueError, match="hidden"):
        fused_linear_logprobs(torch.randn(3, 7), weight, labels)
    with pytest.raises(ValueError, match="chunk_size"):
        fused_linear_logprobs(hidden, weight, labels, chunk_size=0)
    with pytest.raises(ValueError, match="temperature"):
        fused_linear_logprobs(hidden, weight, labels, temperature=0.0)


def test_bf16_weights_match_bf16_logits():
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(2, 4, 16, generator=g).bfloat16()
    weight = torch.randn(VOCAB, 16, generator=g).bfloat16()
    labels = torch.randint(0, VOCAB, (2, 4), generator=g)
    lp, _ = fused_linear_logprobs(hidden, weight, labels, chunk_size=3)
    # the bf16 logits of the same three products the fused path makes (a GEMM may round a row otherwise
    # at another height), then fp32 maths: only the log-softmax rounds differently, within its bound
    logits = torch.cat([F.linear(rows, weight) for rows in hidden.reshape(-1, 16).split(3)]).float().view(2, 4, VOCAB)
    assert lp.dtype == torch.float32
    assert_within(lp, torch.log_softmax(logits.double(), -1).gather(-1, labels[..., None])[..., 0],
                  log_softmax_tol(logits)[0], name="lp")
    # gradients come back in the inputs' dtype, as accurate as the unfused bf16 path (bf16 logits, fp32
    # log-softmax, autograd back through the bf16 matmul) against float64 maths on the same bf16 values
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    grads = _grads(fused_linear_logprobs(h, w, labels, chunk_size=3)[0].sum(), [h, w])
    h16, w16 = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    ref_grads = _grads(naive(h16, w16, labels)[0].sum(), [h16, w16])
    h64, w64 = float64_copies([h, w])
    true_grads = _grads(naive(h64, w64, labels)[0].sum(), [h64, w64])
    for name, got, want, truth in zip(["hidden", "weight"], grads, ref_grads, true_grads):
        assert got.dtype == want.dtype == torch.bfloat16
        assert_as_accurate(got, want, truth, name=name)


# --- end to end through response_logprobs on tiny HF models --------------------------------------

def tiny_model(arch: str, tied: bool, seed: int = 0):
    import transformers

    config_cls = {"qwen2": transformers.Qwen2Config, "llama": transformers.LlamaConfig}[arch]
    config = config_cls(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                        tie_word_embeddings=tied, pad_token_id=0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config).float()
        with torch.no_grad():
            for p in model.parameters():  # wider than the default init: peaked, non-trivial softmaxes
                if p.ndim == 2:
                    p.normal_(0.0, 0.3)
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == tied
    return model


def padded_batch(seed: int = 0):
    """`pack_rollouts` rows: prompts of 2..5 tokens left-padded, responses of 0..7 tokens right-padded."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in (2, 5, 3)]
    completions = [[Completion(torch.randint(1, VOCAB, (n,), generator=g).tolist(), "", "stop")
                    for n in lengths] for lengths in ((7, 3), (1, 6), (0, 4))]
    packed = pack_rollouts(prompts, completions, pad_token_id=0)
    assert packed["attention_mask"][:, 0].eq(0).any() and packed["response_mask"][:, -1].eq(0).any()
    return packed


def naive_response_logprobs(model, packed, temperature):
    P = packed["prompt_length"]
    logits = model(input_ids=packed["input_ids"], attention_mask=packed["attention_mask"],
                   position_ids=position_ids_from_mask(packed["attention_mask"]), use_cache=False).logits
    logp, entropy = log_softmax_and_entropy(logits[:, P - 1:-1], temperature)
    return logp.gather(-1, packed["input_ids"][:, P:, None])[..., 0], entropy.detach()


def naive_with_grads(model, packed, temperature, upstream):
    """The naive path's log-probs, entropy and parameter gradients of (lp · upstream).sum()."""
    lp, entropy = naive_response_logprobs(model, packed, temperature)
    grads = _grads((lp * upstream.to(lp.dtype)).sum(), list(model.parameters()))
    return lp, entropy, grads


def float64_truth(model, packed, temperature, upstream):
    """`naive_with_grads` on a float64 copy of the model: the maths the fp32 paths round."""
    return naive_with_grads(copy.deepcopy(model).double(), packed, temperature, upstream)


def assert_model_outputs_as_accurate(model, got, ref, truth, label=""):
    """lp, entropy and every parameter's gradient: `got` as accurate as `ref` against `truth`."""
    names = ["lp", "entropy"] + [name for name, _ in model.named_parameters()]
    flat = [[lp, entropy, *grads] for lp, entropy, grads in (got, ref, truth)]
    assert_all_as_accurate(*flat, [f"{label}{name}" for name in names])


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("tied", [True, False])
def test_response_logprobs_equals_naive(arch, tied):
    model = tiny_model(arch, tied)
    packed = padded_batch()
    P, temperature = packed["prompt_length"], 0.8
    mask = packed["response_mask"]
    upstream = torch.randn(mask.shape, generator=torch.Generator().manual_seed(1)) * mask
    params = [p for p in model.parameters()]

    lp, entropy = response_logprobs(model, packed["input_ids"], packed["attention_mask"], P,
                                    temperature=temperature, chunk_size=5, with_entropy=True)  # 5 ∤ B·T
    grads = _grads((lp * upstream).sum(), params)
    ref = naive_with_grads(model, packed, temperature, upstream)
    truth = float64_truth(model, packed, temperature, upstream)

    assert lp.shape == mask.shape and lp.dtype == entropy.dtype == torch.float32
    assert not entropy.requires_grad
    assert_model_outputs_as_accurate(model, (lp, entropy, grads), ref, truth)
    head = model.get_output_embeddings()
    assert "forward" not in vars(head)  # the head's forward swap was undone
    # the old logits path (still the fallback) is as accurate too
    old_lp, old_entropy = response_logprobs_unfused(model, packed["input_ids"], packed["attention_mask"], P,
                                                    temperature=temperature, chunk_size=5, with_entropy=True)
    assert_as_accurate(old_lp, ref[0], truth[0], name="unfused lp")
    assert_as_accurate(old_entropy, ref[1], truth[1], name="unfused entropy")


def test_head_with_bias_equals_naive():
    model = tiny_model("llama", tied=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        model.lm_head = torch.nn.Linear(32, VOCAB, bias=True)
    packed = padded_batch(seed=1)
    upstream = packed["response_mask"] * 0.5
    head = model.get_output_embeddings()
    lp, _ = response_logprobs(model, packed["input_ids"], packed["attention_mask"], packed["prompt_length"],
                              temperature=1.3, chunk_size=4)
    ref_lp, _ = naive_response_logprobs(model, packed, 1.3)
    model64 = copy.deepcopy(model).double()
    true_lp, _ = naive_response_logprobs(model64, packed, 1.3)
    assert_as_accurate(lp, ref_lp, true_lp, name="lp")
    head64 = model64.get_output_embeddings()
    assert_all_as_accurate(_grads((lp * upstream).sum(), [head.weight, head.bias]),
                           _grads((ref_lp * upstream).sum(), [head.weight, head.bias]),
                           _grads((true_lp * upstream.double()).sum(), [head64.weight, head64.bias]),
                           ["lm_head.weight", "lm_head.bias"])


def test_other_model_types_fall_back_to_logits(monkeypatch):
    model = tiny_model("llama", tied=False)
    packed = padded_batch(seed=2)
    monkeypatch.setattr(model.config, "model_type", "gemma2")  # soft-caps logits after the head
    called = []
    model.get_output_embeddings().register_forward_hook(lambda m, i, o: called.append(o.shape))
    lp, _ = response_logprobs(model, packed["input_ids"], packed["attention_mask"], packed["prompt_length"])
    assert called and called[0][-1] == VOCAB  # the real head ran: logits path
    ref_lp, _ = naive_response_logprobs(model, packed, 1.0)
    true_lp, _ = naive_response_logprobs(copy.deepcopy(model).double(), packed, 1.0)
    assert_as_accurate(lp, ref_lp, true_lp, name="lp")


def test_head_forward_restored_after_error():
    model = tiny_model("qwen2", tied=True)
    packed = padded_batch()
    bad_ids = packed["input_ids"].clone()
    bad_ids[0, -1] = VOCAB  # out-of-vocab label: the fused head raises inside the model's forward
    with pytest.raises((ValueError, IndexError)):
        response_logprobs(model, bad_ids, packed["attention_mask"], packed["prompt_length"])
    assert "forward" not in vars(model.get_output_embeddings())


# --- FSDP2 (2 CPU processes over gloo) -----------------------------------------------------------

def _fsdp_worker(rank: int, world: int, port: int, out_path: str) -> None:
    import warnings

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    warnings.filterwarnings("error", message=".*returned a view tensor")  # FSDP2's pre-backward hook holds
    try:
        mesh = init_device_mesh("cpu", (world,))
        results = {}
        for tied in (True, False):
            model = tiny_model("qwen2", tied)
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            # outside the root forward the head weight is a shard: the fused head must run inside it
            assert isinstance(model.get_output_embeddings().weight, DTensor)
            packed = padded_batch()
            mask = packed["response_mask"]
            upstream = torch.randn(mask.shape, generator=torch.Generator().manual_seed(1)) * mask
            lp, entropy = response_logprobs(model, packed["input_ids"], packed["attention_mask"],
                                            packed["prompt_length"], temperature=0.8, chunk_size=5, with_entropy=True)
            (lp * upstream).sum().backward()  # same rows on both ranks: the averaged grad is the full one
            grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
            results[tied] = (lp.detach(), entropy, grads)
        if rank == 0:
            torch.save(results, out_path)
    except BaseException:
        dist.destroy_process_group()
        raise
    leave_group()


@pytest.mark.multiproc
def test_fsdp2_two_processes_equal_naive(tmp_path):
    out = tmp_path / "fsdp.pt"
    torch.multiprocessing.spawn(_fsdp_worker, args=(2, free_port(), str(out)), nprocs=2, join=True)
    results = torch.load(out)
    for tied, (lp, entropy, grads) in results.items():
        model = tiny_model("qwen2", tied)
        packed = padded_batch()
        mask = packed["response_mask"]
        upstream = torch.randn(mask.shape, generator=torch.Generator().manual_seed(1)) * mask
        ref = naive_with_grads(model, packed, 0.8, upstream)
        truth = float64_truth(model, packed, 0.8, upstream)
        names = [name for name, _ in model.named_parameters()]
        assert set(grads) == set(names)
        got = (lp, entropy, [grads[name] for name in names])
        assert_model_outputs_as_accurate(model, got, ref, truth, label=f"tied={tied} ")
