"""Fused linear log-probs (hidden states + LM-head weight, chunked) against the naive full-logits path:
values, entropy and gradients (of hidden, of the head weight and bias, and of every model parameter
through `response_logprobs`), tied and untied heads, padded rows, under FSDP2 too."""

from __future__ import annotations

import os
import socket

import pytest
import torch

from aspo_lit.forward import response_logprobs, response_logprobs_unfused
from aspo_lit.fused_logprobs import fused_linear_logprobs
from aspo_lit.rollout.base import Completion
from aspo_lit.rollout.batch import pack_rollouts, position_ids_from_mask

TOL = dict(rtol=1e-5, atol=1e-5)
VOCAB = 50


def naive(hidden, weight, labels, bias=None, temperature=1.0):
    logits = hidden @ weight.T + (bias if bias is not None else 0.0)
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1), entropy


def _grads(loss, tensors):
    return torch.autograd.grad(loss, tensors)


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
    assert lp.dtype == entropy.dtype == torch.float32 and lp.shape == (B, T)
    assert not entropy.requires_grad
    torch.testing.assert_close(lp, ref_lp, **TOL)
    torch.testing.assert_close(entropy, ref_entropy.detach(), **TOL)
    for got, want in zip(_grads((lp * upstream).sum(), inputs), _grads((ref_lp * upstream).sum(), inputs)):
        torch.testing.assert_close(got, want, **TOL)


def test_without_entropy_and_validation():
    hidden, weight = torch.randn(3, 8), torch.randn(VOCAB, 8)
    labels = torch.tensor([0, 1, VOCAB - 1])
    lp, entropy = fused_linear_logprobs(hidden, weight, labels, chunk_size=2)
    assert entropy is None
    torch.testing.assert_close(lp, naive(hidden, weight, labels)[0], **TOL)
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
    ref = torch.log_softmax((hidden @ weight.T).float(), -1).gather(-1, labels[..., None])[..., 0]
    assert lp.dtype == torch.float32
    torch.testing.assert_close(lp, ref, **TOL)
    # gradients come back in the inputs' dtype, close to the fp32 maths on the same bf16 values
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    grads = _grads(fused_linear_logprobs(h, w, labels, chunk_size=3)[0].sum(), [h, w])
    h32, w32 = hidden.float().requires_grad_(True), weight.float().requires_grad_(True)
    ref_grads = _grads(naive(h32, w32, labels)[0].sum(), [h32, w32])
    for got, want in zip(grads, ref_grads):
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want, rtol=3e-2, atol=3e-2)


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
    logp = torch.log_softmax(logits[:, P - 1:-1].float() / temperature, dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return logp.gather(-1, packed["input_ids"][:, P:, None])[..., 0], entropy.detach()


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
    ref_lp, ref_entropy = naive_response_logprobs(model, packed, temperature)
    ref_grads = _grads((ref_lp * upstream).sum(), params)

    assert lp.shape == mask.shape and lp.dtype == entropy.dtype == torch.float32
    assert not entropy.requires_grad
    torch.testing.assert_close(lp, ref_lp, **TOL)
    torch.testing.assert_close(entropy, ref_entropy, **TOL)
    for (name, _), got, want in zip(model.named_parameters(), grads, ref_grads):
        torch.testing.assert_close(got, want, **TOL, msg=lambda m: f"{name}: {m}")
    head = model.get_output_embeddings()
    assert "forward" not in vars(head)  # the head's forward swap was undone
    # the old logits path (still the fallback) agrees too
    old_lp, old_entropy = response_logprobs_unfused(model, packed["input_ids"], packed["attention_mask"], P,
                                                    temperature=temperature, chunk_size=5, with_entropy=True)
    torch.testing.assert_close(lp, old_lp, **TOL)
    torch.testing.assert_close(entropy, old_entropy, **TOL)


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
    torch.testing.assert_close(lp, ref_lp, **TOL)
    grads = _grads((lp * upstream).sum(), [head.weight, head.bias])
    for got, want in zip(grads, _grads((ref_lp * upstream).sum(), [head.weight, head.bias])):
        torch.testing.assert_close(got, want, **TOL)


def test_other_model_types_fall_back_to_logits(monkeypatch):
    model = tiny_model("llama", tied=False)
    packed = padded_batch(seed=2)
    monkeypatch.setattr(model.config, "model_type", "gemma2")  # soft-caps logits after the head
    called = []
    model.get_output_embeddings().register_forward_hook(lambda m, i, o: called.append(o.shape))
    lp, _ = response_logprobs(model, packed["input_ids"], packed["attention_mask"], packed["prompt_length"])
    assert called and called[0][-1] == VOCAB  # the real head ran: logits path
    ref_lp, _ = naive_response_logprobs(model, packed, 1.0)
    torch.testing.assert_close(lp, ref_lp.detach(), **TOL)


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
    from torch.distributed.tensor import DTensor
    from torch.distributed.fsdp import fully_shard

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
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_fsdp2_two_processes_equal_naive(tmp_path):
    out = tmp_path / "fsdp.pt"
    torch.multiprocessing.spawn(_fsdp_worker, args=(2, _free_port(), str(out)), nprocs=2, join=True)
    results = torch.load(out)
    for tied, (lp, entropy, grads) in results.items():
        model = tiny_model("qwen2", tied)
        packed = padded_batch()
        mask = packed["response_mask"]
        upstream = torch.randn(mask.shape, generator=torch.Generator().manual_seed(1)) * mask
        ref_lp, ref_entropy = naive_response_logprobs(model, packed, 0.8)
        names, params = zip(*model.named_parameters())
        ref_grads = _grads((ref_lp * upstream).sum(), params)
        torch.testing.assert_close(lp, ref_lp.detach(), **TOL)
        torch.testing.assert_close(entropy, ref_entropy, **TOL)
        assert set(grads) == set(names)
        for name, want in zip(names, ref_grads):
            torch.testing.assert_close(grads[name], want, **TOL, msg=lambda m: f"tied={tied} {name}: {m}")
