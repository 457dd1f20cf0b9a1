"""The worker extension: code that runs inside vLLM's worker, next to the model it serves.

vLLM imports ``ASPOWorkerExtension`` by its qualified name (``worker_extension_cls``) in every
worker: in a process it spawns (the multiprocess engine) or in the trainer's own process
(colocated, in-process). ``VLLMEngine`` calls its methods through ``collective_rpc``. So that the
import costs a spawned worker nothing, this module imports only what vLLM's worker already holds
(torch, numpy); vLLM's own layers are imported inside the methods that read them.

The call that takes the tensors (``aspo_load_weights``) is the model runner's
``reload_weights(weights_iterator=...)`` on CPU and GPU alike: a layer-wise reload that redoes each
layer's post-load processing. The model's ``load_weights`` (TRL's and verl's call) fails on CPU,
where vLLM repacks every linear weight into a oneDNN handle after loading ("'Parameter' object has
no attribute 'weight_loader'"), and on B200/GB200 writes checkpoint layout into the FlashInfer
layout vLLM converted the MoE experts to. Tied embeddings: the layer-wise reload re-processes ``embed_tokens`` only, so on CPU
the packed ``lm_head`` is re-tied and re-packed after every reload (on GPU vLLM's ``lm_head`` *is*
the embedding parameter).

``aspo_reseed`` reseeds the global RNGs (Python, NumPy, torch) before a seeded ``generate``; an
engine that shares the trainer's process swaps them around every call (``aspo_lit.rollout.vllm``).
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Iterable

import numpy as np
import torch

__all__ = ["ASPOWorkerExtension"]


class ASPOWorkerExtension:
    """Mixed into vLLM's worker class (``worker_extension_cls``); called via ``collective_rpc``."""

    def aspo_load_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor]] | None = None,
        weights_path: str | None = None,
        retie: bool = True,
    ) -> dict:
        """Load checkpoint-named tensors (an iterator, consumed once) or a safetensors folder.

        One call on every platform: the runner's layer-wise in-place ``reload_weights``, which
        re-runs each layer's post-load processing and copies the result into the kernel tensors'
        own storage (CUDA graphs and sleep mode keep their pointers). The model's ``load_weights``
        (TRL's and verl's call) would write checkpoint layout into processed storage: the CPU's
        oneDNN-packed linears, the FlashInfer expert layouts vLLM makes on B200/GB200. Only the CPU
        then re-packs a tied ``lm_head`` (module docstring)."""
        from vllm.platforms import current_platform

        t0 = time.perf_counter()
        # the Worker's own reload_weights: it runs the runner's under set_current_vllm_config, which
        # get_current_vllm_config() asserts on (the runner's alone would leave it unset)
        reload = self.reload_weights  # type: ignore[attr-defined]
        if weights is None:
            reload(weights_path=weights_path, is_checkpoint_format=True)
            call = "reload_weights(weights_path)"
        else:
            reload(weights_iterator=iter(weights), is_checkpoint_format=True)
            call = "reload_weights(weights_iterator)"
        repacked = self.aspo_retie_lm_head() if retie and current_platform.is_cpu() else False
        return {"reload_s": time.perf_counter() - t0, "repacked_lm_head": repacked, "load_call": call}

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
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)

    def aspo_weights_checksum(self) -> dict:
        """This rank's share of the weight checksum (``aspo_lit.rollout.checksum``), read through
        each layer's compute path: ``sharded`` (partial sums of TP-split tensors: add them over
        the TP group) and ``replicated`` (held whole by every TP rank: count once), each with
        its ``plain`` and ``projected`` sums; ``checksum.tp_part`` says which is which."""
        from vllm.model_executor.layers.linear import QKVParallelLinear, RowParallelLinear

        from aspo_lit.rollout.checksum import probe_vector, tp_part

        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        dtype = self.model_runner.model_config.dtype  # type: ignore[attr-defined]
        sums = {part: {"plain": 0.0, "projected": 0.0} for part in ("sharded", "replicated")}
        with torch.no_grad():
            for module in model.modules():
                kind = _layer_kind(module)
                params = dict(module.named_parameters(recurse=False))
                if kind in ("column", "row", "replicated", "lm_head"):
                    params.pop("weight", None)
                    full_k = module.embedding_dim if kind == "lm_head" else module.input_size
                    r = probe_vector(full_k, dtype, self.device)  # type: ignore[attr-defined]
                    if isinstance(module, RowParallelLinear) and module.tp_size > 1:
                        k = module.input_size_per_partition
                        r = r[module.tp_rank * k:(module.tp_rank + 1) * k]
                    out = module.quant_method.apply(module, r[None, :], bias=None)[0].double()
                    if isinstance(module, QKVParallelLinear) and module.num_kv_head_replicas > 1:
                        q = module.num_heads * module.head_size  # k/v heads are copied on several ranks
                        value = float(out[:q].sum() + out[q:].sum() / module.num_kv_head_replicas)
                    else:
                        value = float(out.sum())
                    sums[tp_part(kind, "weight")]["projected"] += value
                expert_parallel = kind == "experts" and bool(module.moe_config.moe_parallel_config.use_ep)
                for name, p in params.items():
                    part = tp_part(kind, name, expert_parallel=expert_parallel)
                    sums[part]["plain"] += float(p.sum(dtype=torch.float64))
        return sums


def _layer_kind(module: torch.nn.Module) -> str:
    """The module's ``checksum.LayerKind``: its vLLM layer family."""
    from vllm.model_executor.layers.fused_moe import RoutedExperts
    from vllm.model_executor.layers.linear import LinearBase, ReplicatedLinear, RowParallelLinear
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    families = ((ParallelLMHead, "lm_head"), (VocabParallelEmbedding, "embedding"), (ReplicatedLinear, "replicated"),
                (RowParallelLinear, "row"), (LinearBase, "column"), (RoutedExperts, "experts"))
    return next((kind for cls, kind in families if isinstance(module, cls)), "other")

