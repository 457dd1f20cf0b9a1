"""What each rank of a multi-process run sets up, checked in one process: the environment a
colocated vLLM engine is created in, which of vLLM's parameters the weight checksum adds over a
TP group, the order rank 0's buffers are broadcast in, and the EOS ids of the transformers engine
on a rank that built its model on the meta device."""

from __future__ import annotations

import importlib.util
import shutil

import pytest
import torch

from aspo_lit.rollout.checksum import tp_part
from aspo_lit.rollout.vllm import colocate_env


def test_colocated_tp_engine_runs_its_all_reduce_on_nccl():
    """At TP > 1 every rank's engine starts with vLLM's FlashInfer and symmetric-memory
    all-reduce off (both are on by default, and FlashInfer's is tried first); at TP 1 there is
    no TP all-reduce and the environment names only the ranks."""
    env = colocate_env(rank=1, local_rank=1, world_size=2, tensor_parallel_size=2)
    assert env["VLLM_ALLREDUCE_USE_FLASHINFER"] == "0" and env["VLLM_ALLREDUCE_USE_SYMM_MEM"] == "0"
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"]) == ("1", "1", "2")
    assert colocate_env(rank=1, local_rank=1, world_size=2, tensor_parallel_size=1) == {
        "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2"}


@pytest.mark.parametrize("kind, param, expert_parallel, part", [
    # MoE experts at TP > 1: w13 [E, 2I, H], w2 [E, H, I] and w13's bias are split along I
    ("experts", "w13_weight", False, "sharded"),
    ("experts", "w2_weight", False, "sharded"),
    ("experts", "w13_bias", False, "sharded"),
    ("experts", "w2_bias", False, "replicated"),  # [E, H]: whole on every rank
    ("experts", "w2_bias", True, "sharded"),  # expert parallelism splits every tensor along E
    ("replicated", "weight", False, "replicated"),  # the MoE router
    ("row", "weight", False, "sharded"),
    ("row", "bias", False, "replicated"),
    ("column", "bias", False, "sharded"),
    ("embedding", "weight", False, "sharded"),
    ("lm_head", "weight", False, "sharded"),
    ("other", "weight", False, "replicated"),  # norms
])
def test_tp_part_of_each_parameter(kind, param, expert_parallel, part):
    """The engine's checksum adds a TP-split parameter's per-rank sums over the group and counts a
    whole one once; counting split expert weights once gives a false mismatch at TP > 1."""
    assert tp_part(kind, param, expert_parallel=expert_parallel) == part


def test_tp_part_names_an_unknown_layer_kind():
    with pytest.raises(ValueError, match="kind"):
        tp_part("moe", "w13_weight")


def test_engine_checksum_adds_its_tp_group_without_a_cpu_tensor_collective(monkeypatch):
    """On GPU the TP group is an NCCL group, which refuses CPU tensors ("No backend type
    associated with device type cpu"): the engine adds its TP ranks' partial sums without one."""
    import torch.distributed as dist

    from aspo_lit.rollout.vllm import VLLMEngine

    part = {"sharded": {"plain": 1.0, "projected": 10.0}, "replicated": {"plain": 5.0, "projected": 50.0}}

    class LLM:  # this rank's worker
        def collective_rpc(self, method):
            return [part]

    def nccl_all_reduce(tensor, *args, **kwargs):
        if tensor.device.type == "cpu":
            raise RuntimeError("No backend type associated with device type cpu")

    def all_gather_object(out, obj, group=None):  # both TP ranks hold the same partial sums
        out[:] = [obj] * len(out)

    monkeypatch.setattr(dist, "all_reduce", nccl_all_reduce)
    monkeypatch.setattr(dist, "all_gather_object", all_gather_object)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    engine = VLLMEngine()
    engine.llm, engine._attached, engine.colocate, engine._tp_group = LLM(), True, True, "tp group"
    assert engine.weights_checksum() == {"plain": 2 * 1.0 + 5.0, "projected": 2 * 10.0 + 50.0}


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="the vllm package is not installed")
def test_vllm_layers_map_to_their_tp_kind():
    """The worker's map from vLLM's layer classes to `tp_part`'s kinds (the MoE router is a
    ReplicatedLinear, the LM head a VocabParallelEmbedding: the order of the checks matters)."""
    from vllm.model_executor.layers.fused_moe import RoutedExperts
    from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    from aspo_lit.rollout.vllm_worker import _layer_kind

    expected = {RoutedExperts: "experts", GateLinear: "replicated", QKVParallelLinear: "column",
                MergedColumnParallelLinear: "column", RowParallelLinear: "row", ParallelLMHead: "lm_head",
                VocabParallelEmbedding: "embedding", torch.nn.LayerNorm: "other"}
    assert {cls: _layer_kind(cls.__new__(cls)) for cls in expected} == expected


def test_buffers_broadcast_in_name_order(monkeypatch):
    """Rank 0 broadcasts the buffers outside the state dict by name: a broadcast pairs tensors by
    call order, and FSDP2 may list a model's buffers in another order on each rank."""
    import torch.distributed as dist
    import torch.distributed.checkpoint.state_dict as dcp_state_dict

    from aspo_lit.training import models

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("inv_freq", torch.ones(2), persistent=False)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("rotary", torch.ones(2), persistent=False)  # registered before a_block's
            self.a_block = Block()

    model = Model()
    sent: list[torch.Tensor] = []
    monkeypatch.setattr(models, "shard_decoder_layers", lambda *args: None)
    monkeypatch.setattr(dcp_state_dict, "set_model_state_dict", lambda *args, **kwargs: None)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    monkeypatch.setattr(dist, "broadcast", lambda tensor, src, **kwargs: sent.append(tensor))
    models.shard_and_broadcast(model, None, None, torch.device("cpu"))
    names = {id(t): name for name, t in model.named_buffers()}
    assert [names[id(t)] for t in sent] == ["a_block.inv_freq", "rotary"]


def test_hf_engine_eos_ids_agree_across_ranks(tiny_model_dir, tmp_path):
    """Rank 0 loads the policy with `from_pretrained` (generation_config.json's EOS ids), the other
    ranks build it on the meta device (config.json's): the engine reads generation_config.json
    on every rank, so all ranks stop on the same tokens."""
    from transformers import AutoTokenizer, GenerationConfig

    from aspo_lit.rollout import HFEngine
    from aspo_lit.training.models import load_policy

    path = tmp_path / "model"
    shutil.copytree(tiny_model_dir, path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    extra = tokenizer.eos_token_id + 1  # as Qwen3: generation_config.json lists one more EOS id
    GenerationConfig(eos_token_id=[tokenizer.eos_token_id, extra]).save_pretrained(path)
    ids = []
    for materialize in (True, False):  # rank 0, another rank
        engine = HFEngine()
        engine.attach(load_policy(str(path), materialize=materialize), tokenizer, path)
        ids.append(engine.eos_token_ids)
    assert ids[0] == ids[1] and extra in ids[1], ids


@pytest.mark.parametrize("policy, load_format, needs_push", [(object(), "dummy", True), (None, None, False)])
def test_colocated_engine_reads_the_checkpoint_only_when_nothing_will_push(monkeypatch, policy, load_format, needs_push):
    """Under a process group a training engine (given the policy it is pushed from) starts with random
    weights and asks for a push; an evaluation's (given none) reads the checkpoint and samples from it
    at once. A fake ``vllm.LLM`` records the arguments (no engine is started)."""
    import os
    import sys
    import types

    import torch.distributed as dist

    from aspo_lit.rollout.vllm import VLLMEngine

    seen = {}

    class LLM:
        def __init__(self, **kwargs):
            seen.update(kwargs)
            config = types.SimpleNamespace(tie_word_embeddings=False)
            self.llm_engine = types.SimpleNamespace(model_config=types.SimpleNamespace(hf_config=config, dtype=torch.float32))

    platforms = types.SimpleNamespace(current_platform=types.SimpleNamespace(
        is_cpu=lambda: True, is_sleep_mode_available=lambda: False))
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=LLM, platforms=platforms))
    monkeypatch.setitem(sys.modules, "vllm.platforms", platforms)
    monkeypatch.setattr(os, "environ", dict(os.environ))  # the engine's environment stays in this test
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 1)
    engine = VLLMEngine(dtype="float32")
    engine.attach(policy, tokenizer="a tokenizer", model_path="a/checkpoint")
    assert engine.topology == "colocated" and seen["distributed_executor_backend"] == "external_launcher"
    assert seen.get("load_format") == load_format and engine.needs_weight_push is needs_push


def test_tensor_parallel_engines_turn_the_allreduce_fusion_off(monkeypatch):
    """At TP > 1 a colocated engine asks vLLM for no all-reduce + RMSNorm fusion (the compiled pass builds
    a FlashInfer workspace over the TP group; on by default on SM90), merged with the user's compilation
    config, whose own setting of it wins. A fake ``vllm.LLM`` records the arguments."""
    import os
    import sys
    import types

    import torch.distributed as dist

    from aspo_lit.rollout.vllm import VLLMEngine

    seen = {}

    class LLM:
        def __init__(self, **kwargs):
            seen.clear()
            seen.update(kwargs)
            config = types.SimpleNamespace(tie_word_embeddings=False)
            self.llm_engine = types.SimpleNamespace(model_config=types.SimpleNamespace(hf_config=config, dtype=torch.float32))

        def sleep(self, level=1):
            pass

    platforms = types.SimpleNamespace(current_platform=types.SimpleNamespace(
        is_cpu=lambda: True, is_sleep_mode_available=lambda: False))
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=LLM, platforms=platforms))
    monkeypatch.setitem(sys.modules, "vllm.platforms", platforms)
    monkeypatch.setattr(os, "environ", dict(os.environ))
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "new_subgroups_by_enumeration", lambda ranks: ("tp group", None))
    off = {"fuse_allreduce_rms": False}
    for user, expected in (({}, {"pass_config": off}),
                           ({"compilation_config": {"mode": 0}}, {"pass_config": off, "mode": 0}),
                           ({"compilation_config": {"pass_config": {"fuse_allreduce_rms": True}}},
                            {"pass_config": {"fuse_allreduce_rms": True}})):
        engine = VLLMEngine(dtype="float32", tensor_parallel_size=2, **user)
        engine.attach(None, tokenizer="a tokenizer", model_path="a/checkpoint")
        assert seen["compilation_config"] == expected and seen["disable_custom_all_reduce"] is True
    VLLMEngine(dtype="float32", tensor_parallel_size=1).attach(None, tokenizer="t", model_path="a/checkpoint")
    assert "compilation_config" not in seen


def test_the_datamodule_pushes_the_shards_for_the_engine_to_cast_before_their_gather():
    """The training push hands the engine the policy's state dict as it is (FSDP2 shards), so that a
    bf16 engine casts each before its gather: half the bytes of fp32. Before, the DataModule gathered
    every tensor in fp32 first (aspo_lit.training.models.named_full_tensors) and the cast-before-gather never
    ran. Fake shards count the bytes their gather moves."""

    from aspo_lit.rollout.base import iter_named_tensors
    from aspo_lit.training.module import PolicyHandle
    from data_modules.math import RLDataModule

    gathered = []

    class Shard(torch.Tensor):
        def full_tensor(self):
            gathered.append(self.numel() * self.element_size())
            return torch.Tensor(self).clone()

    class Policy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(64, 32))

        def state_dict(self, *args, **kwargs):
            return {"w": self.w.detach().as_subclass(Shard)}

    class Engine:
        def update_weights(self, named_tensors):
            self.pushed = dict(iter_named_tensors(named_tensors, dtype=torch.bfloat16))   # as VLLMEngine does

    data = RLDataModule(group_size=2)
    data.attach_policy(PolicyHandle(tokenizer=None, policy=Policy(), model_path=None, device=torch.device("cpu")))
    engine = Engine()
    data.controller.sync_weights(engine)
    assert gathered == [64 * 32 * 2] and engine.pushed["w"].dtype == torch.bfloat16   # bf16 bytes, not fp32


@pytest.mark.parametrize("on_cpu", [True, False])
def test_the_push_reloads_layer_by_layer_on_every_platform(monkeypatch, on_cpu):
    """The worker takes pushed tensors with the runner's in-place ``reload_weights`` on CPU and GPU
    alike (it re-runs each layer's post-load processing: CPU packing, B200 MoE layouts), never the
    model's raw ``load_weights``, and through the Worker's own ``reload_weights`` (which sets the
    current vLLM config around it); only the CPU re-packs a tied lm_head. Fake worker, runner and platform."""
    import sys
    import types

    from aspo_lit.rollout.vllm_worker import ASPOWorkerExtension

    calls = []

    class Model:
        def load_weights(self, weights):
            calls.append("load_weights")

    class Runner:
        def reload_weights(self, weights_iterator=None, weights_path=None, is_checkpoint_format=True):
            calls.append(("reload_weights", [name for name, _ in weights_iterator], is_checkpoint_format,
                          config_set[0]))

        def get_model(self):
            return Model()

    config_set = [False]

    class Worker(ASPOWorkerExtension):
        """vLLM's Worker.reload_weights: the runner's, under set_current_vllm_config."""
        def reload_weights(self, *args, **kwargs):
            config_set[0] = True
            try:
                self.model_runner.reload_weights(*args, **kwargs)
            finally:
                config_set[0] = False

    platforms = types.SimpleNamespace(current_platform=types.SimpleNamespace(is_cpu=lambda: on_cpu))
    monkeypatch.setitem(sys.modules, "vllm.platforms", platforms)
    worker = Worker()
    worker.model_runner = Runner()
    monkeypatch.setattr(worker, "aspo_retie_lm_head", lambda: calls.append("retie") or True)
    out = worker.aspo_load_weights(iter([("w", torch.ones(2))]))
    assert out["load_call"] == "reload_weights(weights_iterator)" and out["repacked_lm_head"] is on_cpu
    # through the Worker's own reload_weights: the vLLM config set while the runner reloads
    assert calls == [("reload_weights", ["w"], True, True)] + (["retie"] if on_cpu else [])


def test_the_push_gathers_in_the_engines_dtype():
    """An FSDP2 shard is cast to the engine's dtype before its gather (half the bytes of fp32 for a
    bf16 engine), and the engine gets the values its loader would have rounded to; without an engine
    dtype the push is unchanged. A fake DTensor records the dtype it gathers in."""
    from aspo_lit.rollout.base import iter_named_tensors

    gathered = []

    class Shard(torch.Tensor):
        def full_tensor(self):
            gathered.append(self.dtype)
            return torch.Tensor(self).clone()

    master = torch.randn(4, 3)
    ints = torch.arange(3)
    pushed = dict(iter_named_tensors([("w", master.as_subclass(Shard)), ("n", ints)], dtype=torch.bfloat16))
    assert gathered == [torch.bfloat16] and pushed["w"].dtype == torch.bfloat16
    assert torch.equal(pushed["w"], master.to(torch.bfloat16)) and torch.equal(pushed["n"], ints)  # not cast
    assert dict(iter_named_tensors([("w", master.as_subclass(Shard))]))["w"].dtype == torch.float32
    assert gathered[-1] == torch.float32
