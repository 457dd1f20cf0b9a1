"""Repetition of responses (paper Fig. 2, "repetition rate"; docs/metrics.md).

The definitions, in one place. A response is split into words on whitespace (``str.split``, case
kept); its word n-grams (n = 20 by default) are the ``L - n + 1`` windows of n consecutive words.

* ``has_repeat`` — some n-gram occurs at least twice in the response.
* ``repetition_ratio`` — repeated n-grams / all n-grams = ``(total - distinct) / total``: every
  occurrence of an n-gram beyond its first counts as a repeat (0 = no repetition, → 1 = a loop).
* ``max_ngram_frequency`` — the count of the most frequent n-gram (1 = none repeats).

A response shorter than n words has no n-grams: ``(False, 0.0, 0)``.

Logged per step, over the step's responses on all ranks (each response weighs 1):

* ``train/repetition_rate`` — share of responses with ``has_repeat``;
* ``train/repetition_ratio`` — mean ``repetition_ratio``;
* ``train/max_ngram_frequency`` — mean ``max_ngram_frequency``;
* each also as ``train/pos_*`` (reward > 0) and ``train/neg_*`` (reward <= 0).

N-grams are compared by a 64-bit polynomial hash of their word ids, computed for all windows at
once with numpy (n vectorised passes), so a 30k-word response costs milliseconds.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from aspo_lit.callbacks.base import Diagnostic, weighted_means
from aspo_lit.maths.step import StepOutput

_BASE = np.uint64(0x9E3779B97F4A7C15)  # odd multiplier; arithmetic wraps mod 2**64


def ngram_hashes(text: str, n: int = 20) -> np.ndarray:
    """64-bit hashes of the word n-grams of ``text`` (empty if fewer than ``n`` words)."""
    words = text.split()
    m = len(words) - n + 1
    if m <= 0:
        return np.empty(0, dtype=np.uint64)
    vocab: dict[str, int] = {}
    ids = np.fromiter((vocab.setdefault(w, len(vocab) + 1) for w in words), np.uint64, len(words))
    h = np.zeros(m, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for k in range(n):  # h = Σ_k id[i+k]·B^(n-1-k)  (Horner, wrapping)
            h = h * _BASE + ids[k:k + m]
    return h


def ngram_stats(text: str, n: int = 20) -> tuple[bool, float, int]:
    """``(has_repeat, repetition_ratio, max_ngram_frequency)`` of one response (module docstring)."""
    h = ngram_hashes(text, n)
    if h.size == 0:
        return False, 0.0, 0
    _, counts = np.unique(h, return_counts=True)
    max_freq = int(counts.max())
    return max_freq > 1, float(h.size - counts.size) / h.size, max_freq


class RepetitionDiagnostic(Diagnostic):
    """Repetition rate, ratio and max n-gram frequency, split by the sign of the reward."""

    def __init__(self, n: int = 20, prog_bar: tuple[str, ...] = ()) -> None:
        super().__init__(prog_bar)
        self.n = n

    def compute(self, trainer, pl_module, step: StepOutput) -> dict[str, Any]:
        stats = [ngram_stats(t, self.n) for t in step.texts]
        columns = torch.tensor(stats, dtype=torch.float64).reshape(len(stats), 3)
        pos = (step.rewards.detach().cpu().reshape(-1) > 0).double()
        pairs = {}
        for col, name in enumerate(("repetition_rate", "repetition_ratio", "max_ngram_frequency")):
            values = columns[:, col]
            pairs[f"train/{name}"] = (values, None)
            pairs[f"train/pos_{name}"] = (values, pos)
            pairs[f"train/neg_{name}"] = (values, 1.0 - pos)
        return weighted_means(pairs, trainer=trainer)
