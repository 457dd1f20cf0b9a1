"""Rollout engines behind one interface (docs/design.md, "Rollout engines") and the rollout batch.

``HFEngine`` (transformers ``generate``; the CPU default) and ``VLLMEngine`` (in-process
``vllm.LLM``; import it from ``aspo_lit.rollout.vllm``, which this package leaves unimported, and
vLLM itself is imported only when an engine attaches). ``build_engine("auto")`` picks one.
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

__all__ = [
    "Completion",
    "HFEngine",
    "RolloutBatch",
    "RolloutEngine",
    "SamplingConfig",
    "build_engine",
    "named_tensors_of",
    "normalize_param_name",
    "pack_rollouts",
    "position_ids_from_mask",
    "vllm_available",
]
