"""Does a run show the paper's GRPO dynamics? The regime properties of a pilot, measured.

    python -m experiments.regime runs/pilots/g_lr5e-5_e1 [...] --base runs/pilots/base0 [--markdown]

The paper's GRPO runs *learn* (Fig. 2, App. D): held-out accuracy rises, then plateaus or peaks;
entropy declines; the positive-advantage tokens' mean IS ratio sits above the negative ones'
(Fig. 3). A comparison of losses speaks to the paper only among runs with those dynamics, so the
study protocol v2 (docs/studies/study-protocol-v2.md) first finds a regime whose GRPO runs have them.
For each run folder (a ``fit`` logged by ``CSVLogger``; ``version_*`` folders of a resumed run are
merged) this prints, from its ``metrics.csv``:

* ``acc0``: the untrained model's held-out accuracy (``--base``: a ``validate`` run of it with the
  same held-out settings), ``acc_best`` / ``acc_last``: the run's best and last evaluation;
  **rise** = ``acc_best - acc0`` (points; property: >= 5);
* **entropy decline**: mean ``train/entropy`` of the first 20 % of logged rollout batches minus
  that of the last 20 % (property: > 0; over seeds, > 2 SE);
* **ratio gap**: the run's mean of ``ratio/pos_mean - ratio/neg_mean`` over its steps (property: > 0);
* **plateau**: the rise has stopped: the last evaluation is not more than 1 point above the best
  earlier one (a run still climbing at its end is too short);
* the starting profile kept from ``testbed-long``: entropy (>= 0.4 nats) and mean response length
  (80-300 tokens) of the first rollout batch, ``acc0`` (20-60 %);
* for reading: ``train/reward_mean`` first and last 20 %, the largest ``clip/pos_high``, ``train/kl``
  at the end.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from aspo_lit.training.figures import accuracy_key
from experiments.results import head_mean, read_run, tail_mean

__all__ = ["Regime", "measure", "regime_of", "accuracy", "main"]

MIN_RISE = 5.0      # points of held-out accuracy above the untrained model
PLATEAU_SLACK = 1.0  # points the last evaluation may exceed the best earlier one by
RATIOS = ("ratio/pos_mean", "ratio/neg_mean")


@dataclass
class Regime:
    run: str
    batches: int
    acc0: float
    acc_best: float
    acc_last: float
    evals: int
    entropy_start: float
    entropy_decline: float
    ratio_gap: float
    length_start: float
    reward_head: float
    reward_tail: float
    clip_pos_high_max: float
    kl_last: float
    last_gain: float  # last evaluation minus the best earlier one (points)

    @property
    def rise(self) -> float:
        return self.acc_best - self.acc0

    @property
    def plateau(self) -> bool:
        """The last evaluation is at most `PLATEAU_SLACK` points above the best earlier one."""
        return self.evals >= 2 and self.last_gain <= PLATEAU_SLACK

    def checks(self) -> dict[str, bool]:
        return {
            "rise": self.rise >= MIN_RISE,
            "entropy": self.entropy_decline > 0,
            "ratio": self.ratio_gap > 0,
            "plateau": self.plateau,
            "start": self.entropy_start >= 0.4 and 80 <= self.length_start <= 300 and 20 <= self.acc0 <= 60,
        }


def _series(metrics, key: str) -> np.ndarray:
    return metrics.loc[metrics["metric"] == key, "value"].to_numpy(dtype=np.float64)


def _accuracy(metrics) -> list[float]:
    key = accuracy_key([set(metrics["metric"])])  # val/...avg@K, else the reward: not an accuracy
    return [100 * v for v in _series(metrics, key)] if key.startswith("val/") else []


def accuracy(run_dir: str | Path) -> list[float]:
    """The held-out accuracy (%) of each evaluation of a run, in order."""
    return _accuracy(read_run(run_dir))


def measure(run_dir: str | Path, acc0: float) -> Regime:
    """The regime properties of the fit in `run_dir` (the module docstring names each)."""
    metrics = read_run(run_dir)
    if metrics.empty:
        raise ValueError(f"{run_dir}: no metrics.csv under its version_* folders")
    return regime_of(metrics, Path(run_dir).name, acc0)


def regime_of(metrics, run: str, acc0: float) -> Regime:
    """The regime properties of a run's ``metric, step, value`` frame (``read_run``'s)."""
    entropy = _series(metrics, "train/entropy")
    acc = _accuracy(metrics)
    ratios = metrics[metrics["metric"].isin(RATIOS)].pivot_table(index="step", columns="metric", values="value")
    gap = (ratios[RATIOS[0]] - ratios[RATIOS[1]]).dropna().to_numpy() if set(RATIOS) <= set(ratios.columns) else []
    reward, clip, kl, length = (_series(metrics, k) for k in
                                ("train/reward_mean", "clip/pos_high", "train/kl", "response/length_mean"))
    return Regime(
        run=run, batches=len(entropy), acc0=acc0,
        acc_best=max(acc) if acc else math.nan, acc_last=acc[-1] if acc else math.nan, evals=len(acc),
        entropy_start=float(entropy[0]) if len(entropy) else math.nan,
        entropy_decline=head_mean(entropy) - tail_mean(entropy),
        ratio_gap=float(np.mean(gap)) if len(gap) else math.nan,
        length_start=float(length[0]) if len(length) else math.nan,
        reward_head=head_mean(reward), reward_tail=tail_mean(reward),
        clip_pos_high_max=float(np.max(clip)) if len(clip) else math.nan,
        kl_last=float(kl[-1]) if len(kl) else math.nan,
        last_gain=acc[-1] - max(acc[:-1]) if len(acc) >= 2 else math.nan,
    )


HEADER = ("| run | batches | acc0 → best / last (%) | rise | entropy: start, decline | ratio gap (pos - neg) | "
          "plateau | length start | reward first → last 20 % | max clip/pos_high | KL end | properties met |")


def row(r: Regime) -> str:
    met = [k for k, ok in r.checks().items() if ok]
    return (f"| {r.run} | {r.batches} | {r.acc0:.1f} → {r.acc_best:.1f} / {r.acc_last:.1f} | {r.rise:+.1f} | "
            f"{r.entropy_start:.3f}, {r.entropy_decline:+.3f} | {r.ratio_gap:+.2e} | {'yes' if r.plateau else 'no'} | "
            f"{r.length_start:.0f} | {r.reward_head:.2f} → {r.reward_tail:.2f} | {100 * r.clip_pos_high_max:.1f} % | "
            f"{r.kl_last:.3f} | {', '.join(met) or 'none'} ({len(met)}/5) |")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", help="run folders (save_dir/name)")
    p.add_argument("--base", required=True, help="a validate run of the untrained model (its held-out accuracy)")
    p.add_argument("--markdown", action="store_true", help="a markdown table instead of one dict per run")
    args = p.parse_args(argv)
    base = accuracy(args.base)
    if not base:
        p.error(f"{args.base}: no held-out accuracy logged")
    acc0 = base[0]
    if args.markdown:
        print(HEADER)
        print("|" + "---|" * HEADER.count(" | ") + "---|")
    for run in args.runs:
        try:
            r = measure(run, acc0)
        except ValueError as err:
            print(f"{run}: {err}", file=sys.stderr)
            continue
        print(row(r) if args.markdown else {**asdict(r), "rise": r.rise, "plateau": r.plateau, **r.checks()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
