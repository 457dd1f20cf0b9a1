"""The rollout-engine interface shared by the transformers and vLLM engines.

Contract (docs/design.md, "Rollout engines"):

* ``attach(model, tokenizer, model_path)`` once before the first ``generate``.
* ``generate(prompts, n, sampling) -> list[list[Completion]]``: ``[prompt][sample]``; prompts are
  token-id lists (used as given) or strings (tokenized with the attached tokenizer, with its
  special tokens, as ``tokenizer(text)`` does).
* ``update_weights(named_tensors)``: push the policy's current weights; accepts an iterable of
  ``(name, tensor)`` (``model.named_parameters()``) or a state dict. Names are the Hugging Face
  checkpoint names of the attached model; wrapper prefixes (``_orig_mod.`` of ``torch.compile``,
  ``module.`` of DDP, FSDP/checkpoint wrappers) are stripped.
* ``sleep()/wake()`` free/restore accelerator memory where the engine supports it (no-ops
  otherwise); ``close()`` releases everything. Engines are also context managers.

`Completion` semantics, identical for both engines:

* ``token_ids``: every sampled token, including the EOS token when one ended the response and the
  token that completed a stop string.
* ``text``: the decoded response without special tokens, cut before the first stop string.
* ``finish_reason``: ``"stop"`` when EOS or a stop string ended it, ``"length"`` when
  ``max_tokens`` was reached.
* ``logprobs`` (when ``SamplingConfig.logprobs``): one float per token of ``token_ids``: the
  log-probability of the sampled token under the distribution it was sampled from (the engine's
  ``logprobs_mode="processed"``, the default: logits / temperature, renormalised over the top-p
  nucleus when ``top_p < 1``), or under the unmodified model (``logprobs_mode="raw"``). With
  ``temperature=1, top_p=1`` both equal the policy's own log-probability, which is what the
  on-policy check compares. ``temperature=0`` is greedy decoding; its log-probs are the raw ones.
"""

from __future__ import annotations

import abc
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch

__all__ = [
    "SamplingConfig",
    "Completion",
    "RolloutEngine",
    "normalize_param_name",
    "iter_named_tensors",
    "named_tensors_of",
]

FINISH_REASONS = ("stop", "length")
LogprobsMode = Literal["processed", "raw"]
LOGPROBS_MODES: tuple[str, ...] = get_args(LogprobsMode)


@dataclass
class SamplingConfig:
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 256
    stop: list[str] | None = None
    seed: int | None = None
    logprobs: bool = False

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None:
            self.stop = [s for s in self.stop if s] or None


@dataclass
class Completion:
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" | "length"
    logprobs: list[float] | None = None


_WRAPPER_PARTS = ("_orig_mod.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")


def normalize_param_name(name: str) -> str:
    """Strip the wrapper parts torch.compile / FSDP / activation checkpointing / DDP add."""
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    if name.startswith("module."):
        name = name[len("module."):]
    return name


def iter_named_tensors(
    named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor] | torch.nn.Module,
    dtype: torch.dtype | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, detached tensor) pairs, names normalised, from named_parameters(), a state dict or
    a module (its named_parameters()), one at a time: an FSDP2 DTensor is gathered to its full
    tensor only when the pair is taken. With ``dtype`` (the engine's), floating tensors are cast
    *before* the gather: a bf16 engine's push moves half the bytes of the fp32 master weights, and
    the engine holds the same values (its loader would round each to its dtype alike)."""
    if isinstance(named_tensors, torch.nn.Module):
        named_tensors = named_tensors.named_parameters()
    elif isinstance(named_tensors, Mapping):
        named_tensors = named_tensors.items()
    for name, tensor in named_tensors:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"update_weights: {name!r} is a {type(tensor).__name__}, not a tensor")
        tensor = tensor.detach()
        if dtype is not None and tensor.is_floating_point() and tensor.dtype != dtype:
            tensor = tensor.to(dtype)
        if hasattr(tensor, "full_tensor"):  # DTensor (FSDP2) -> full tensor
            tensor = tensor.full_tensor()
        yield normalize_param_name(name), tensor


def named_tensors_of(
    named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor] | torch.nn.Module,
) -> list[tuple[str, torch.Tensor]]:
    """``iter_named_tensors`` as a list."""
    return list(iter_named_tensors(named_tensors))


class RolloutEngine(abc.ABC):
    """Abstract rollout engine; see the module docstring for the contract."""

    name: str = "base"
    #: seconds the last ``update_weights`` took (0.0 for a no-op sync)
    last_sync_s: float = 0.0
    #: whether ``sleep`` frees memory (then a rollout logs its wake and sleep seconds apart)
    sleeps: bool = False
    #: seconds spent waking from ``sleep`` (inside ``update_weights`` or ``generate``) since the
    #: last `take_wake_seconds`
    _wake_s: float = 0.0

    def take_wake_seconds(self) -> float:
        """The seconds spent waking since the last call, and start counting again."""
        seconds, self._wake_s = self._wake_s, 0.0
        return seconds

    def __init__(self) -> None:
        self.model: Any = None
        self.tokenizer: Any = None
        self.model_path: str | None = None
        self._attached = False

    # -- lifecycle ---------------------------------------------------------------------------
    @abc.abstractmethod
    def attach(self, model: Any, tokenizer: Any, model_path: str | os.PathLike | None) -> None:
        """Bind the engine to the policy (module, tokenizer, and the path it was loaded from)."""

    @property
    def attached(self) -> bool:
        return self._attached

    def _require_attached(self) -> None:
        if not self._attached:
            raise RuntimeError(f"{type(self).__name__}: call attach(model, tokenizer, model_path) first")

    @abc.abstractmethod
    def generate(self, prompts: list[list[int]] | list[str], n: int = 1,
                 sampling: SamplingConfig | None = None) -> list[list[Completion]]:
        """Sample ``n`` completions per prompt: ``result[i][j]`` is sample ``j`` of prompt ``i``."""

    @abc.abstractmethod
    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]
    ) -> None:
        """Make the engine sample from these weights from the next ``generate`` on."""

    def sleep(self) -> None:  # noqa: B027 - optional hook
        """Free accelerator memory between rollouts (no-op unless supported)."""

    def wake(self) -> None:  # noqa: B027 - optional hook
        """Undo ``sleep`` (no-op unless supported)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release the engine's resources."""

    def __enter__(self) -> "RolloutEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- helpers -----------------------------------------------------------------------------
    def _start_generate(self, prompts: list[list[int]] | list[str], n: int,
                        sampling: SamplingConfig | None) -> tuple[list[list[int]], SamplingConfig]:
        """What every ``generate`` does first: check that the engine is attached and ``n >= 1``;
        returns the prompts as token-id lists (``_encode_prompts``) and the sampling settings."""
        self._require_attached()
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        return self._encode_prompts(prompts), sampling or SamplingConfig()

    def _encode_prompts(self, prompts: list[list[int]] | list[str]) -> list[list[int]]:
        if isinstance(prompts, (str, bytes)) or (
            prompts and isinstance(prompts[0], int)
        ):
            raise TypeError("generate expects a list of prompts (strings or token-id lists)")
        out: list[list[int]] = []
        for p in prompts:
            if isinstance(p, str):
                if self.tokenizer is None:
                    raise RuntimeError("string prompts need a tokenizer; pass one to attach()")
                out.append(list(self.tokenizer(p)["input_ids"]))
            else:
                ids = [int(t) for t in (p.tolist() if isinstance(p, torch.Tensor) else p)]
                out.append(ids)
        for i, ids in enumerate(out):
            if not ids:
                raise ValueError(f"prompt {i} is empty")
        return out
