"""What the demo reference's bands detect: graded regressions of the demo config, each over seeds.

    python -m experiments.sensitivity --out runs/sensitivity              # every regression, seeds 200-202
    python -m experiments.sensitivity --out runs/sensitivity --only lr_x2 kl_x10 --seeds 200 201 202 203

Each regression is the shipped demo config (``conf/tiny/aspo.yaml``) with the overrides of
:data:`REGRESSIONS`, one ``python -m aspo_lit fit`` per seed (:func:`experiments.seeds.run_seeds`)
into ``<out>/<regression>/s<seed>/version_0``; ``python -m experiments.bands`` then compares each
with the reference (docs/compare.md, "What the bands detect"). The regressions are what a user
would call one: a larger step, a wider clip, the dual clip off, a stronger KL pull, no advantage
normalisation, a hotter sampler, a noisy reward, and the other loss.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

from aspo_lit.rollout_stage.controller import RolloutController
from data_modules.testbed import ArithmeticRLDataModule
from experiments.seeds import run_seeds

DEMO = "conf/tiny/aspo.yaml"
SEEDS = (200, 201, 202)

#: regression name -> (what it is, the fit's overrides of the demo config)
REGRESSIONS: dict[str, tuple[str, list[str]]] = {
    "lr_x2": ("lr x 2 (2e-4 -> 4e-4)", ["--model.lr=4.0e-4"]),
    "lr_x5": ("lr x 5 (2e-4 -> 1e-3)", ["--model.lr=1.0e-3"]),
    "eps_high_0.28": ("eps_high 0.2 -> 0.28 (DAPO's clip-higher)",
                      ["--model.loss_kwargs={eps_low: 0.2, eps_high: 0.28, dual_clip: 3.0, "
                       "loss_agg: seq-mean-token-mean}"]),
    "no_dual_clip": ("ASPO without its soft dual clip (aspo_no_dual_clip)",
                     ["--model.loss=aspo_no_dual_clip",
                      "--model.loss_kwargs={eps_low: 0.2, eps_high: 0.2, loss_agg: seq-mean-token-mean}"]),
    "kl_x10": ("KL coefficient x 10 (0.001 -> 0.01)", ["--model.kl_coef=0.01"]),
    "no_adv_norm": ("advantages not divided by the group's SD (Dr.GRPO's adv_norm: none)",
                    ["--data.init_args.adv_norm=none"]),
    "temperature_1.2": ("rollout temperature 1.0 -> 1.2", ["--data.init_args.temperature=1.2"]),
    "reward_flip_10": ("10 % of the training rewards flipped (held-out grading untouched)",
                       ["--data.class_path=experiments.sensitivity.FlippedRewardArithmetic",
                        "--data.init_args.flip_share=0.1"]),
    "grpo": ("GRPO instead of ASPO", ["--model.loss=grpo"]),
}


class FlippedRewardArithmetic(ArithmeticRLDataModule):
    """The demo's DataModule with a share of the *training* rewards flipped (1 -> 0, 0 -> 1), chosen
    by a generator seeded from the run's seed: a grader that is wrong on ``flip_share`` of the
    answers. The held-out evaluation is graded as shipped.

    Args:
        flip_share: the share of each rollout batch's rewards flipped.
        **kwargs: every `ArithmeticRLDataModule` argument.
    """

    def __init__(self, flip_share: float = 0.1, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if not 0.0 <= flip_share <= 1.0:
            raise ValueError(f"flip_share must be in [0, 1], got {flip_share}")
        c = self.controller
        self.controller = FlippingController(float(flip_share), c.settings, c.engine_spec, c.grader, c.policy, c.seed)


class FlippingController(RolloutController):
    """Grades training rollouts with a share of the rewards flipped (validation is graded as shipped)."""

    def __init__(self, flip_share: float, *args: Any) -> None:
        super().__init__(*args)
        self.flip_share = flip_share
        self._flips: torch.Generator | None = None

    def grade(self, records, completions):
        if self._flips is None:
            self._flips = torch.Generator().manual_seed(self.seed + 7919)
        grader, flipped = self.grader, FlippedReward(self.grader(), self.flip_share, self._flips)
        self.grader = lambda: flipped
        try:
            return super().grade(records, completions)
        finally:
            self.grader = grader


class FlippedReward:
    """``reward``'s scores with each flipped (``1 - score``) with probability ``share``."""

    def __init__(self, reward, share: float, generator: torch.Generator) -> None:
        self.reward, self.share, self.generator = reward, share, generator

    def batch(self, texts, golds) -> list[float]:
        scores = torch.tensor(self.reward.batch(texts, golds), dtype=torch.float32)
        flip = torch.rand(scores.shape, generator=self.generator) < self.share
        return torch.where(flip, 1.0 - scores, scores).tolist()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.sensitivity", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--only", nargs="+", choices=sorted(REGRESSIONS), help="these regressions only")
    parser.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time (the cores are shared out)")
    args = parser.parse_args(argv)
    failed = {}
    for name in args.only or REGRESSIONS:
        what, overrides = REGRESSIONS[name]
        print(f"== {name}: {what}", flush=True)
        bad = run_seeds([DEMO], args.seeds, args.out / name, overrides, args.jobs)
        if bad:
            failed[name] = bad
    if failed:
        print(f"failed runs: {failed}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
