"""Diagnostics callbacks: definitions on hand-made inputs, metric values through a real
Trainer + CSVLogger on synthetic step diagnostics, RunSummary's start/end values, the Fig. 4 binning
direction, Fig. 2 from a fixture log, and rank-correct reductions with 2 CPU processes (gloo). Health
verdicts: tests/unit/test_health.py."""

from __future__ import annotations

import csv
import json
import math
import random
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

from aspo_lit.__main__ import main as aspo_lit_main
from aspo_lit.callbacks import (
    DiagnosticsTQDMProgressBar,
    EntropyMechanism,
    EntropyMonitor,
    HealthMonitor,
    RepetitionDiagnostic,
    TokenWeightSurface,
    TrainingStats,
    bin_token_weights,
    ngram_stats,
    weighted_mean,
)
from aspo_lit.callbacks.summary import _first_last, _first_last_evaluation, end_window
from aspo_lit.callbacks.token_weights import Reservoir
from aspo_lit.maths.stats import Stat
from aspo_lit.maths.step import StepOutput
from aspo_lit.training.figures import plot_figure2, read_metrics
from tests.helpers.tolerance import approx64, gamma, rounding_tol

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "metrics_fixture.csv"

# --------------------------------------------------------------------------- hand-made texts
WORDS20 = [f"w{i}" for i in range(20)]
ONE_REPEAT = " ".join(WORDS20 + WORDS20 + ["end"])           # 41 words, 22 20-grams, 1 repeat
LOOP = " ".join(["a b c d"] * 30)                            # 120 words, period 4
UNIQUE = " ".join(f"u{i}" for i in range(30))                # 30 distinct words
SHORT = "the answer is \\boxed{4}"                           # fewer than 20 words
NEAR = " ".join(WORDS20[:19] + ["x"] + WORDS20[:19] + ["y"])  # 19 words repeat, no 20-gram does


def test_ngram_stats_hand_made_texts():
    assert ngram_stats(ONE_REPEAT) == (True, approx64(1 / 22), 2)  # counts' quotient, float64
    assert ngram_stats(LOOP) == (True, approx64(97 / 101), 26)
    assert ngram_stats(UNIQUE) == (False, 0.0, 1)
    assert ngram_stats(SHORT) == (False, 0.0, 0)
    assert ngram_stats("") == (False, 0.0, 0)
    assert ngram_stats(NEAR) == (False, 0.0, 1)
    assert ngram_stats(NEAR, n=19)[0]


def test_ngram_stats_matches_naive_counting():
    rng = random.Random(0)
    for _ in range(50):
        words = [rng.choice("abc") for _ in range(rng.randint(0, 40))]
        grams = Counter(tuple(words[i:i + 3]) for i in range(len(words) - 2))
        total = sum(grams.values())
        expected = (any(c > 1 for c in grams.values()), (total - len(grams)) / total if total else 0.0,
                    max(grams.values(), default=0))
        has, ratio, top = ngram_stats(" ".join(words), n=3)
        assert (has, top) == (expected[0], expected[2]) and ratio == approx64(expected[1])  # counts' quotient, float64


# --------------------------------------------------------------------------- synthetic step
LENGTHS = [5, 3, 2, 4]
ROW_ENTROPY = [1.0, 2.0, 3.0, 0.5]
TOKEN_ENTROPY = (5 * 1.0 + 3 * 2.0 + 2 * 3.0 + 4 * 0.5) / 14  # token-weighted, not 1.625


def stats(pos_tokens=7.0, neg_tokens=7.0, groups=2.0, **over):
    """A step's statistics, each with the weight and reduction the module declares for it."""
    tokens = pos_tokens + neg_tokens
    out = {
        "clip/pos_high": Stat.mean(0.25, pos_tokens), "clip/neg_low": Stat.mean(0.5, neg_tokens),
        "clip/pos_dual": Stat.mean(0.0, pos_tokens), "clip/neg_dual": Stat.mean(0.125, neg_tokens),
        "ratio/pos_mean": Stat.mean(1.1, pos_tokens), "ratio/neg_mean": Stat.mean(0.9, neg_tokens),
        "train/pg_loss": Stat.mean(0.1), "train/kl": Stat.mean(0.01, tokens), "train/grad_norm": Stat.mean(2.0),
        "train/skipped_steps": Stat.max(0.0), "train/updates_per_rollout": Stat.max(4.0),
        "batch/solve_all": Stat.mean(0.25, groups), "batch/solve_none": Stat.mean(0.5, groups),
        "batch/filtered_groups": Stat.sum(1.0),
        "timing/rollout_s": Stat.max(1.5), "timing/old_logprob_s": Stat.max(0.2), "timing/update_s": Stat.max(0.5),
        "timing/weight_sync_s": Stat.max(0.0),
    }
    out.update(over)
    return dict(sorted(out.items()))


def make_diagnostics(lengths=LENGTHS, row_entropy=ROW_ENTROPY, rewards=(1.0, 0.0, 1.0, 0.0),
                     texts=(LOOP, UNIQUE, ONE_REPEAT, SHORT), entropy_scale=1.0, **over) -> StepOutput:
    """A synthetic `StepOutput`: A = ±1 by reward, r = e^{±0.1} on the response tokens."""
    n, t = len(lengths), max(lengths)
    mask = (torch.arange(t)[None, :] < torch.tensor(lengths)[:, None]).float()
    rewards = torch.tensor(rewards, dtype=torch.float32)
    advantages = torch.where(rewards > 0, 1.0, -1.0)
    old = torch.full((n, t), math.log(0.5)) * mask
    lp = old + 0.1 * advantages[:, None] * mask
    entropy = entropy_scale * torch.tensor(row_entropy)[:, None].expand(n, t) * mask
    fields = dict(
        response_mask=mask, old_logprobs=old, entropy=entropy, logprobs=lp, ratio=(lp - old).exp(),
        updated_entropy=entropy * 0.9, token_weight=(lp - old).exp() * mask, advantages=advantages,
        rewards=rewards, response_lengths=torch.tensor(lengths),
        truncated=torch.tensor([False] * (n - 1) + [True]), texts=list(texts),
        stats=stats(pos_tokens=float(mask[rewards > 0].sum()), neg_tokens=float(mask[rewards <= 0].sum())),
    )
    fields.update(over)
    return StepOutput(**fields)


def rank_diagnostics(rank: int) -> StepOutput:
    """Two ranks with different token and response counts (for the 2-process test). Every
    statistic's weight is this rank's own count, including a user loss's ``train/position_mean``,
    whose name holds "pos" and which is a mean over all response tokens, not the A > 0 ones."""
    if rank == 0:
        return make_diagnostics(lengths=[1], row_entropy=[1.0], rewards=(1.0,), texts=(LOOP,),
                                old_logprobs=torch.full((1, 1), -0.1), stats=stats(
            pos_tokens=1.0, neg_tokens=0.0, groups=1.0, **{
                "clip/pos_high": Stat.mean(1.0, 1.0), "train/pg_loss": Stat.mean(0.2),
                "train/kl": Stat.mean(0.0, 1.0), "train/grad_norm": Stat.mean(2.0),
                "timing/rollout_s": Stat.max(1.0), "batch/solve_all": Stat.mean(0.0, 1.0),
                "batch/filtered_groups": Stat.sum(1.0), "train/position_mean": Stat.mean(0.0, 1.0)}))
    return make_diagnostics(lengths=[3, 3, 3], row_entropy=[3.0, 3.0, 3.0], rewards=(0.0, 0.0, 0.0),
                            texts=(UNIQUE, SHORT, NEAR), old_logprobs=torch.full((3, 3), -2.0), stats=stats(
                                pos_tokens=0.0, neg_tokens=9.0, groups=1.0, **{
                                    "clip/pos_high": Stat.mean(0.0, 9.0), "train/pg_loss": Stat.mean(0.4),
                                    "train/kl": Stat.mean(1.0, 9.0), "train/grad_norm": Stat.mean(5.0),
                                    "timing/rollout_s": Stat.max(4.0), "batch/solve_all": Stat.mean(1.0, 1.0),
                                    "batch/filtered_groups": Stat.sum(2.0),
                                    "train/position_mean": Stat.mean(1.0, 9.0)}))


class DummyModule(LightningModule):
    """Manual optimisation like ASPOModule; returns synthetic step diagnostics."""

    def __init__(self, collapse_at: int | None = None, per_rank: bool = False, **step):
        super().__init__()
        self.automatic_optimization = False
        self.layer = torch.nn.Linear(1, 1)
        self.collapse_at, self.per_rank, self.step = collapse_at, per_rank, step

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(self.layer(torch.ones(1, 1)).sum())
        opt.step()
        if self.per_rank:
            return rank_diagnostics(self.global_rank)
        collapsed = self.collapse_at is not None and batch_idx >= self.collapse_at
        return make_diagnostics(entropy_scale=1e-3 if collapsed else 1.0, **self.step)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)

    def train_dataloader(self):
        return DataLoader(range(16), batch_size=1)


def fit(tmp_path, callbacks, max_steps=3, module=None, **trainer_kwargs):
    trainer = Trainer(max_steps=max_steps, logger=CSVLogger(tmp_path), accelerator="cpu",
                      callbacks=callbacks, log_every_n_steps=1, enable_checkpointing=False,
                      enable_model_summary=False, **{"enable_progress_bar": False, **trainer_kwargs})
    trainer.fit(module or DummyModule())
    return trainer


def last_logged(log_dir) -> dict[str, float]:
    """The last value of every column of the run's metrics.csv."""
    path = next(Path(log_dir).rglob("metrics.csv"))
    last = {}
    with open(path) as f:
        for row in csv.DictReader(f):
            last.update({k: float(v) for k, v in row.items() if v != ""})
    return last


# --------------------------------------------------------------------------- callbacks in a Trainer
def test_repetition_callback_logs_split_metrics(tmp_path):
    logged = last_logged(fit(tmp_path, [RepetitionDiagnostic()]).log_dir)
    ratios = [97 / 101, 0.0, 1 / 22, 0.0]                      # LOOP, UNIQUE, ONE_REPEAT, SHORT
    # means of small integers over 4 or 2 responses are exact in fp32
    assert logged["train/repetition_rate"] == 0.5
    assert logged["train/pos_repetition_rate"] == 1.0  # rewards 1, 0, 1, 0
    assert logged["train/neg_repetition_rate"] == 0.0
    # the ratios stored in fp32 (1 rounding each), summed (<= 3) and halved or quartered (exact): < 5
    assert logged["train/repetition_ratio"] == pytest.approx(sum(ratios) / 4, rel=rounding_tol(torch.float32, 5), abs=0)
    assert logged["train/pos_repetition_ratio"] == pytest.approx((ratios[0] + ratios[2]) / 2,
                                                                 rel=rounding_tol(torch.float32, 5), abs=0)
    assert logged["train/max_ngram_frequency"] == (26 + 1 + 2 + 0) / 4
    assert logged["train/pos_max_ngram_frequency"] == 14.0
    assert logged["train/neg_max_ngram_frequency"] == 0.5


def test_entropy_callback_logs_token_weighted_mean_and_slope(tmp_path):
    logged = last_logged(fit(tmp_path, [EntropyMonitor(window=2)]).log_dir)
    # exact dyadic entropies and masks: the sums are exact, the division by 14 tokens rounds once
    assert logged["train/entropy"] == pytest.approx(TOKEN_ENTROPY, rel=rounding_tol(torch.float32, 1), abs=0)
    assert logged["train/entropy_slope"] == 0.0  # two equal values: their float64 mean is exact, so is the slope
    assert logged["alarm/entropy_collapse"] == 0.0


def test_entropy_collapse_alarm_stops_the_run(tmp_path):
    monitor = EntropyMonitor(window=1, stop_on_collapse=True)
    with pytest.warns(UserWarning, match="Entropy collapse"):
        trainer = fit(tmp_path, [monitor], max_steps=6, module=DummyModule(collapse_at=2))
    assert trainer.global_step == 3 and monitor.collapsed      # stopped after the first collapsed step
    logged = last_logged(trainer.log_dir)
    assert logged["alarm/entropy_collapse"] == 1.0
    # the entropies 1e-3·H rounded to fp32 (1 each), 13 additions, the division: < 16
    assert logged["train/entropy"] == pytest.approx(1e-3 * TOKEN_ENTROPY, rel=rounding_tol(torch.float32, 16), abs=0)
    assert logged["train/entropy_slope"] < 0


def test_training_stats_values(tmp_path):
    logged = last_logged(fit(tmp_path, [TrainingStats()]).log_dir)
    expected = {
        "clip/pos_high": 0.25, "clip/neg_low": 0.5, "clip/pos_dual": 0.0, "clip/neg_dual": 0.125,
        "ratio/pos_mean": 1.1, "ratio/neg_mean": 0.9, "train/pg_loss": 0.1, "train/kl": 0.01,
        "train/grad_norm": 2.0, "train/skipped_steps": 0.0, "train/reward_mean": 0.5,
        "train/reward_std": 0.5, "batch/solve_all": 0.25, "batch/solve_none": 0.5,
        "batch/filtered_groups": 1.0, "response/length_mean": 3.5, "response/length_max": 5.0,
        "response/clip_ratio": 0.25, "timing/rollout_s": 1.5, "timing/old_logprob_s": 0.2,
        "timing/update_s": 0.5, "timing/weight_sync_s": 0.0, "train/updates_per_rollout": 4.0,
        "ratio/off_policy_share": 1.0,   # r = e^{±0.1} on every response token
    }
    # weighted means over <= 14 tokens of values rounded once to fp32: <= 13 additions, ×weight, the division
    for key, value in expected.items():
        assert logged[key] == pytest.approx(value, rel=rounding_tol(torch.float32, 16), abs=0), key
    assert logged["timing/step_s"] > 0
    # 14 tokens / the logged step time itself: its fp32 rounding, the quotient's and the log's
    assert logged["perf/tokens_per_s"] == pytest.approx(14 / logged["timing/step_s"], rel=rounding_tol(torch.float32, 4))


def test_token_weight_surface_saves_figures(tmp_path):
    surface = TokenWeightSurface(every_n_steps=2, bins=10)
    trainer = fit(tmp_path, [surface])
    figures = Path(trainer.log_dir) / "figures"
    assert sorted(p.name for p in figures.glob("*.png")) == ["token_weights_step2.png", "token_weights_step3.png"]
    grids = np.load(figures / "token_weights_step3.npz")
    # one step's tokens: 7 positive at (0.5, 0.5·e^0.1), 7 negative at (0.5, 0.5·e^-0.1)
    assert grids["pos_count"].sum() == 7 and grids["neg_count"].sum() == 7
    # r = exp((old + 0.1) - old) in fp32: 0.1 and the sum round (<= 0.7u of 0.1 absolute; the difference
    # is exact, Sterbenz), exp 2u; a bin's mean of equal float32 values is exact in float64
    assert np.nanmax(grids["pos_mean"]) == pytest.approx(math.exp(0.1), rel=rounding_tol(torch.float32, 3), abs=0)


# --------------------------------------------------------------------------- pure functions
def test_run_summary_start_and_end_are_window_means():
    """RunSummary's "reward mean  a -> b": means of the first/last 10 batches (a quarter of a short
    run), not two single batches; val/avg@K its first and last evaluation."""
    rewards = np.r_[0.9, np.full(9, 0.5), np.full(20, 0.55), np.full(9, 0.6), 0.1]   # one odd batch at each end
    series = {"train/reward_mean": (np.arange(40.0), rewards),
              "val/avg@4": (np.array([9.0, 39.0]), np.array([0.5, 0.53]))}
    assert _first_last(series, "train/reward_mean") == "0.540 -> 0.550  (means of the first/last 10 batches)"
    assert _first_last(series, "train/reward_mean", window=1) == "0.900 -> 0.100  (first/last batch)"
    short = {"train/entropy": (np.arange(8.0), np.array([1.0, 3.0, 5, 5, 5, 5, 7.0, 9.0]))}
    assert _first_last(short, "train/entropy") == "2.000 -> 8.000  (means of the first/last 2 batches)"
    assert [end_window(n) for n in (1, 3, 4, 8, 40, 500)] == [1, 1, 1, 2, 10, 10]
    assert _first_last_evaluation(series, "val/avg@4") == "0.500 -> 0.530  (first/last evaluation)"
    assert _first_last({}, "train/entropy") == "n/a" and _first_last_evaluation({}, "val/avg@4") == "n/a"


def test_bin_token_weights_direction_grpo_vs_aspo():
    rng = np.random.default_rng(0)
    pi_old, pi = rng.uniform(0.01, 1, 50_000), rng.uniform(0.01, 1, 50_000)
    r = pi / pi_old
    grpo, count = bin_token_weights(pi_old, pi, r, bins=10)      # w = r (GRPO, Fig. 4b)
    aspo, _ = bin_token_weights(pi_old, pi, 1 / r, bins=10)      # w = 1/r (ASPO, flipped)
    assert count.sum() == 50_000 and grpo.shape == (10, 10)
    top_left, bottom_right = (9, 0), (0, 9)                      # [π bin, π_old bin]
    assert grpo[top_left] > 5 > 0.2 > grpo[bottom_right]
    assert aspo[bottom_right] > 5 > 0.2 > aspo[top_left]
    centre = (np.arange(10) + 0.5) / 10
    above_diagonal = centre[:, None] - centre[None, :]           # π - π_old per bin
    assert np.corrcoef(above_diagonal.ravel(), np.log(grpo).ravel())[0, 1] > 0.9
    assert np.corrcoef(above_diagonal.ravel(), np.log(aspo).ravel())[0, 1] < -0.9
    mean, count = bin_token_weights([0.9], [0.1], [1 / 9], bins=20)  # the paper's example token
    assert count[2, 18] == 1 and mean[2, 18] == 1 / 9 and np.isnan(mean[18, 2])  # one float64 value / 1: exact


def test_reservoir_is_bounded_and_uniform():
    res = Reservoir(capacity=500, width=1, seed=0)
    for start in range(0, 100_000, 1000):
        res.add(np.arange(start, start + 1000, dtype=np.float32)[:, None])
    sample = res.sample()[:, 0]
    assert sample.shape == (500,) and res.seen == 100_000
    assert abs(sample.mean() - 50_000) < 5_000 and sample.min() < 10_000 and sample.max() > 90_000


def test_weighted_mean_local_is_not_mean_of_means():
    # 28 / 10: exact sums, one fp32 division
    assert float(weighted_mean(torch.tensor([1.0, 3.0]), torch.tensor([1.0, 9.0]))) == pytest.approx(
        2.8, rel=rounding_tol(torch.float32, 1), abs=0)
    assert math.isnan(float(weighted_mean(torch.tensor([1.0]), torch.tensor([0.0]))))


# --------------------------------------------------------------------------- Fig. 2
def test_figure2_renders_png_and_svg_from_fixture(tmp_path):
    for name in ("grpo", "aspo"):
        run = tmp_path / name / "lightning_logs" / "version_0"
        run.mkdir(parents=True)
        (run / "metrics.csv").write_text(FIXTURE.read_text())
    paths = plot_figure2([str(tmp_path / "grpo"), str(tmp_path / "aspo")], str(tmp_path / "out" / "fig2"),
                         labels=["GRPO", "ASPO"])
    assert [Path(p).suffix for p in paths] == [".png", ".svg"]
    assert all(Path(p).stat().st_size > 10_000 for p in paths)
    assert Path(paths[0]).read_bytes()[:4] == b"\x89PNG" and b"<svg" in Path(paths[1]).read_bytes()[:500]
    metrics = read_metrics(str(FIXTURE))
    assert len(metrics["val/avg@4"][0]) == 3 and len(metrics["train/entropy"][0]) == 30
    assert aspo_lit_main(["figure2", f"[{FIXTURE}, {FIXTURE}]", "--out", str(tmp_path / "cli"), "--labels", "[a, b]"]) == 0
    assert (tmp_path / "cli.png").exists() and (tmp_path / "cli.svg").exists()


def test_a_runs_figure2_draws_the_reference_seeds_and_says_when_a_panel_is_empty(tmp_path, monkeypatch):
    """A run's own Fig. 2: with the shipped reference its config trains (the demo's), the seeds' range
    per window behind the run's window means; a panel whose series is 0 in every batch says so instead
    of a flat line; without a reference, the window means over the faint per-batch values."""
    from types import SimpleNamespace

    from matplotlib.figure import Figure

    from aspo_lit.callbacks.summary import figure_bands
    from aspo_lit.compare.run_reference import read_reference

    drawn = []
    monkeypatch.setattr(Figure, "savefig", lambda fig, path, **kw: drawn.append(fig))
    run = tmp_path / "run"
    run.mkdir()
    rows = ["step,train/entropy,train/repetition_rate,clip/pos_high,train/kl,train/reward_mean"]
    rows += [f"{t},{0.07 - 0.0005 * t},0.0,0.001,{0.001 * t},0.5" for t in range(40)]
    (run / "metrics.csv").write_text("\n".join(rows) + "\n")
    demo = read_reference("demo")
    (run / "config.yaml").write_text(demo.config_text.replace("seed_everything: 0", "seed_everything: 5"))
    module = SimpleNamespace(hparams={"testbed": demo.testbed})
    window, bands, name = figure_bands(run, module, read_metrics(str(run)))
    assert (window, name) == (demo.window, "demo") and set(bands) >= {"train/entropy", "train/kl"}
    plot_figure2([str(run)], str(tmp_path / "fig"), window=window, bands=bands, band_label=name)
    axes = {ax.get_ylabel(): ax for ax in drawn[-1].axes}
    entropy = axes["train/entropy"]
    assert entropy.collections and any("demo: 5-95 % of seeds" == c.get_label() for c in entropy.collections)
    assert any("means of 4 batches" in line.get_label() for line in entropy.lines)
    repetition = axes["train/repetition_rate"]
    assert [t.get_text() for t in repetition.texts] == ["no repeated n-grams in any batch"]
    assert not [line for line in repetition.lines if "means of" in line.get_label()]  # the seeds' mean only
    # another testbed, or a config the reference is not: window means, no band
    assert figure_bands(run, SimpleNamespace(hparams={"testbed": "testbed v2"}), read_metrics(str(run)))[1] is None
    (run / "config.yaml").write_text(demo.config_text.replace("lr: 0.0002", "lr: 0.001"))
    assert figure_bands(run, module, read_metrics(str(run))) == (4, None, "")


# --------------------------------------------------------------------------- 2 processes
@pytest.mark.multiproc
@pytest.mark.timeout(180)
def test_reductions_across_two_ranks_are_weighted(tmp_path):
    callbacks = [TrainingStats(), EntropyMonitor(window=1), RepetitionDiagnostic(),
                 HealthMonitor(interval=1, window=1), TokenWeightSurface(every_n_steps=1), EntropyMechanism()]
    trainer = Trainer(max_steps=2, logger=CSVLogger(tmp_path), accelerator="cpu", devices=2,
                      strategy="ddp_spawn", callbacks=callbacks, log_every_n_steps=1,
                      enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=False)
    trainer.fit(DummyModule(per_rank=True))
    logged = last_logged(tmp_path)
    expected = {  # rank 0: 1 response of 1 token; rank 1: 3 responses of 3 tokens
        "train/entropy": (1 * 1.0 + 9 * 3.0) / 10,               # mean of rank means: 2.0
        "clip/pos_high": (1 * 1.0 + 9 * 0.0) / 10,               # 0.5
        "train/kl": (1 * 0.0 + 9 * 1.0) / 10,                     # 0.5
        "train/position_mean": (1 * 0.0 + 9 * 1.0) / 10,          # 0.5; by A > 0 tokens: 0.0
        "train/reward_mean": 1 / 4,                              # 0.5
        "train/repetition_rate": 1 / 4,                          # 0.5
        "response/length_mean": (1 + 9) / 4,
        "response/length_max": 3.0, "timing/rollout_s": 4.0,
        "train/grad_norm": 3.5,                                  # declared a mean (equal on every rank in a fit)
        "train/pg_loss": 0.3, "batch/solve_all": 0.5, "batch/filtered_groups": 3.0,
        "ratio/off_policy_share": 1.0,
        # x = log π_old: -0.1 (1 token, A = 1) and -2.0 (9 tokens, A = -1), centred on all 10 tokens
        # (each rank centred on its own means would give 0): E[xA] - E[x]E[A] = 1.79 - 1.448
        "entropy/cov": 0.342, "entropy/cov_pos": (-0.1 + 1.81) * (1 + 0.8) / 10,
        "entropy/cov_neg": 9 * (-2.0 + 1.81) * (-1 + 0.8) / 10,
        "entropy/measured_change": -(1 * 0.1 + 9 * 0.3) / 10,   # updated entropy = 0.9 H
    }
    # the covariances: from raw sums over the 10 tokens, with their cancellation (covariance_tol); the entropy
    # change: (0.9·H - H) per token (measured_change_rel); the rest: weighted means of values rounded once to
    # fp32, <= 8 additions per rank, the ranks' sum, ×weight and the division: < 16 roundings
    x, a = [-0.1] + [-2.0] * 9, [1.0] + [-1.0] * 9
    tol = {key: dict(rel=0, abs=covariance_tol(x, a, ranks=2)) for key in ("entropy/cov", "entropy/cov_pos", "entropy/cov_neg")}
    tol["entropy/measured_change"] = dict(rel=measured_change_rel(10, ranks=2), abs=0)
    for key, value in expected.items():
        assert logged[key] == pytest.approx(value, **tol.get(key, dict(rel=rounding_tol(torch.float32, 16), abs=0))), key
    # 10 tokens / the logged step time itself: its fp32 rounding, the quotient's and the log's
    assert logged["perf/tokens_per_s"] == pytest.approx(10 / logged["timing/step_s"], rel=rounding_tol(torch.float32, 4))
    log_dir = next(tmp_path.rglob("metrics.csv")).parent
    health = json.loads((log_dir / "health.json").read_text())["last"]  # what HealthMonitor judged
    for key in ("train/entropy", "clip/pos_high", "train/kl", "train/reward_mean"):
        assert health[key] == pytest.approx(expected[key], rel=rounding_tol(torch.float32, 16), abs=0), key  # as above
    assert sorted(p.name for p in (log_dir / "figures").glob("*.png")) == ["token_weights_step1.png",
                                                                         "token_weights_step2.png"]


# --------------------------------------------------------------------------- the entropy mechanism
def test_entropy_mechanism_definitions(tmp_path):
    """Cov(log π_old, A) over response tokens, its A>0 / A<0 parts, −Cov as the predicted change and
    the entropy change measured on the same tokens, against numpy on the synthetic step."""
    old = torch.log(torch.tensor([0.5, 0.3, 0.8, 0.1]))[:, None] + torch.linspace(-0.5, 0.0, 5)[None, :]
    step = make_diagnostics(old_logprobs=old * make_diagnostics().response_mask)
    logged = last_logged(fit(tmp_path, [EntropyMechanism()], module=DummyModule(old_logprobs=step.old_logprobs)).log_dir)
    assert abs(logged["entropy/cov"]) > 0.05
    keep = step.response_mask.numpy() > 0
    x = step.old_logprobs.numpy()[keep].astype(np.float64)
    a = np.broadcast_to(step.advantages.numpy()[:, None], keep.shape)[keep].astype(np.float64)
    centred = (x - x.mean()) * (a - a.mean())
    atol = covariance_tol(x, a)
    assert logged["entropy/cov"] == pytest.approx(np.cov(x, a, bias=True)[0, 1], rel=0, abs=atol)
    assert logged["entropy/cov_pos"] == pytest.approx(centred[a > 0].sum() / centred.size, rel=0, abs=atol)
    assert logged["entropy/cov_neg"] == pytest.approx(centred[a < 0].sum() / centred.size, rel=0, abs=atol)
    assert logged["entropy/predicted_change"] == -logged["entropy/cov"]  # a negation: exact
    assert logged["entropy/measured_change"] == pytest.approx(-0.1 * TOKEN_ENTROPY, rel=measured_change_rel(14), abs=0)  # updated = 0.9 H


def covariance_tol(x, a, ranks: int = 1) -> float:
    """|fp32 - exact| of EntropyMechanism's centred covariance (or a part of it) over n tokens, formed from
    raw sums: Σx, ΣA, ΣxA (each within γ_n of its terms' absolute sum, the inputs' fp32 rounding one more),
    then (sxa - ā·sx - x̄·sa + n·x̄·ā) / n (4 roundings), summed over ranks (ranks - 1 more): so
    γ_{n+5+ranks}·(Σ|xA| + |ā|Σ|x| + |x̄|Σ|A| + n|x̄ā|)/n, the cancellation of the raw sums included."""
    x, a = np.asarray(x, dtype=np.float64), np.asarray(a, dtype=np.float64)
    n, mx, ma = x.size, x.mean(), a.mean()
    terms = np.abs(x * a).sum() + abs(ma) * np.abs(x).sum() + abs(mx) * np.abs(a).sum() + n * abs(mx * ma)
    return gamma(n + 5 + ranks) * terms / n


def measured_change_rel(n: int, ranks: int = 1) -> float:
    """Relative error of the mean of (0.9·H - H) over n tokens: 0.9·H rounds twice (the constant, the
    product), which is 18u of the 0.1·H difference (exact itself, Sterbenz); n - 1 same-sign additions,
    the division, and the ranks' sum."""
    return rounding_tol(torch.float32, 18 + n + ranks)


def test_entropy_mechanism_sign_follows_confidence_times_advantage():
    """Confident tokens (high log π) with A > 0 give a positive covariance: entropy predicted to
    fall (Cui et al. 2025); the same tokens with A < 0 give the opposite sign."""
    from aspo_lit.callbacks.entropy_mechanism import EntropyMechanism as Mechanism

    def step(advantages):
        old = torch.tensor([[-0.1, -0.2], [-3.0, -2.5]])  # row 0 confident, row 1 not
        return make_diagnostics(lengths=[2, 2], row_entropy=[1.0, 1.0], rewards=(1.0, 0.0), texts=("a", "b"),
                                old_logprobs=old, advantages=torch.tensor(advantages))

    confident_rewarded = Mechanism().compute(None, None, step([1.0, -1.0]))
    confident_punished = Mechanism().compute(None, None, step([-1.0, 1.0]))
    assert confident_rewarded["entropy/cov"] > 0 > confident_rewarded["entropy/predicted_change"]
    assert confident_punished["entropy/cov"] < 0 < confident_punished["entropy/predicted_change"]


# --------------------------------------------------------------------------- the progress bar's total
class StepsPerBatch(LightningModule):
    """Manual optimisation with `mini_batch_size`/`ppo_epochs` hparams, as ASPOModule: 4 optimizer
    steps per batch of 16 prompts."""

    def __init__(self, mini_batch_size=4, ppo_epochs=1):
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False
        self.layer = torch.nn.Linear(1, 1)

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        for _ in range(4):
            opt.zero_grad()
            self.manual_backward(self.layer(torch.ones(1, 1)).sum())
            opt.step()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


class PromptBatches(LightningDataModule):
    def __init__(self, batch_size=16):
        super().__init__()
        self.save_hyperparameters()

    def train_dataloader(self):
        return DataLoader(range(10), batch_size=1)  # 10 batches an epoch


def test_progress_bar_total_is_the_batches_that_will_run(tmp_path):
    """max_steps=12 optimizer steps at 4 per rollout batch: 3 batches run; the bar says 3/3, not 3/10."""
    bar = DiagnosticsTQDMProgressBar()
    trainer = Trainer(max_steps=12, logger=False, accelerator="cpu", callbacks=[bar], enable_checkpointing=False,
                      enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(StepsPerBatch(), datamodule=PromptBatches())
    assert trainer.global_step == 12 and bar.train_progress_bar.n == 3
    assert bar.train_progress_bar.total == 3
