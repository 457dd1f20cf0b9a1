"""The run's seed, and deterministic per-step seeds derived from it.

One key seeds a run: ``seed_everything`` (LightningCLI's, which calls Lightning's
``seed_everything``; it records the seed in ``PL_GLOBAL_SEED``, inherited by every rank). The
DataModule's rollout/shuffle seed and the module's mini-batch shuffle seed take that value unless
a config sets them explicitly (:func:`run_seed`), so ``--seed_everything 1`` alone gives another run.
Each step then seeds its own generator from ``derived_seed(run seed, step counter)``, so sampling
and shuffles never depend on global RNG state (a resumed run draws what the uninterrupted one did).
"""

from __future__ import annotations

import os


def run_seed(explicit: int | None = None) -> int:
    """``explicit`` when a config sets it, else the seed Lightning's ``seed_everything`` recorded
    (``PL_GLOBAL_SEED``), else 0 (Lightning's own default when nothing was seeded)."""
    if explicit is not None:
        return int(explicit)
    value = os.environ.get("PL_GLOBAL_SEED")
    if value is None:
        return 0
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"PL_GLOBAL_SEED={value!r} is not an integer seed (set by seed_everything)") from None


def derived_seed(*parts: int) -> int:
    """A deterministic seed from integers (e.g. run seed and step counter)."""
    seed = 0
    for part in parts:
        seed = (seed * 1_000_003 + int(part)) % (2**31 - 1)
    return seed
