"""Rollout engines behind one interface (docs/design.md, "Rollout engines") and the rollout batch.

``HFEngine`` (transformers ``generate``; the CPU default) and ``VLLMEngine`` (in-process
``vllm.LLM``; imported lazily, so this package imports without vLLM). ``build_engine("auto")``
picks one.
"""

from .base import (
    Completion,
    RolloutEngine,
    SamplingConfig,
    named_tensors_of,
    normalize_param_name,
)
from .batch import RolloutBatch, pack_rollouts, position_ids_from_mask
from .hf import HFEngine
from .registry import build_engine, vllm_available


def __getattr__(name: str):
    # VLLMEngine lives in .vllm, whose import is cheap (vllm itself is imported in attach()),
    # but keep it lazy so `import aspo_lit.rollout` never touches the vllm package.
    if name in ("VLLMEngine", "ASPOWorkerExtension"):
        from . import vllm as _vllm_engine

        return getattr(_vllm_engine, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "Completion",
    "HFEngine",
    "RolloutBatch",
    "RolloutEngine",
    "SamplingConfig",
    "VLLMEngine",
    "build_engine",
    "named_tensors_of",
    "normalize_param_name",
    "pack_rollouts",
    "position_ids_from_mask",
    "vllm_available",
]
