"""Diagnostics callbacks: definitions on hand-made inputs, metric values through a real
Trainer + CSVLogger on synthetic step diagnostics, health verdicts, the Fig. 4 binning direction,
Fig. 2 from a fixture log, and rank-correct reductions with 2 CPU processes (gloo)."""

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

from aspo_lit.callbacks import (
    DiagnosticsProgressBar, DiagnosticsTQDMProgressBar, EntropyMechanism, EntropyMonitor, HealthMonitor,
    RepetitionDiagnostic, TokenWeightSurface, TrainingStats, assess_health, bin_token_weights, ngram_stats,
    weighted_mean,
)
from aspo_lit.__main__ import main as aspo_lit_main
from aspo_lit.figures import plot_figure2, read_metrics
from aspo_lit.callbacks.token_weights import Reservoir
from aspo_lit.stats import Stat
from aspo_lit.step import StepOutput

FIXTURE = Path(__file__).parent / "fixtures" / "metrics_fixture.csv"

# --------------------------------------------------------------------------- hand-made texts
WORDS20 = [f"w{i}" for i in range(20)]
ONE_REPEAT = " ".join(WORDS20 + WORDS20 + ["end"])           # 41 words, 22 20-grams, 1 repeat
LOOP = " ".join(["a b c d"] * 30)                            # 120 words, period 4
UNIQUE = " ".join(f"u{i}" for i in range(30))                # 30 distinct words
SHORT = "the answer is \\boxed{4}"                           # fewer than 20 words
NEAR = " ".join(WORDS20[:19] + ["x"] + WORDS20[:19] + ["y"])  # 19 words repeat, no 20-gram does


def test_ngram_stats_hand_made_texts():
    assert ngram_stats(ONE_REPEAT) == (True, pytest.approx(1 / 22), 2)
    assert ngram_stats(LOOP) == (True, pytest.approx(97 / 101), 26)
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
        assert (has, top) == (expected[0], expected[2]) and ratio == pytest.approx(expected[1])


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
    assert logged["train/repetition_rate"] == pytest.approx(0.5)
    assert logged["train/pos_repetition_rate"] == pytest.approx(1.0)  # rewards 1, 0, 1, 0
    assert logged["train/neg_repetition_rate"] == pytest.approx(0.0)
    assert logged["train/repetition_ratio"] == pytest.approx(sum(ratios) / 4)
    assert logged["train/pos_repetition_ratio"] == pytest.approx((ratios[0] + ratios[2]) / 2)
    assert logged["train/max_ngram_frequency"] == pytest.approx((26 + 1 + 2 + 0) / 4)
    assert logged["train/pos_max_ngram_frequency"] == pytest.approx(14.0)
    assert logged["train/neg_max_ngram_frequency"] == pytest.approx(0.5)


def test_entropy_callback_logs_token_weighted_mean_and_slope(tmp_path):
    logged = last_logged(fit(tmp_path, [EntropyMonitor(window=2)]).log_dir)
    assert logged["train/entropy"] == pytest.approx(TOKEN_ENTROPY)
    assert logged["train/entropy_slope"] == pytest.approx(0.0)
    assert logged["alarm/entropy_collapse"] == 0.0


def test_entropy_collapse_alarm_stops_the_run(tmp_path):
    monitor = EntropyMonitor(window=1, stop_on_collapse=True)
    with pytest.warns(UserWarning, match="Entropy collapse"):
        trainer = fit(tmp_path, [monitor], max_steps=6, module=DummyModule(collapse_at=2))
    assert trainer.global_step == 3 and monitor.collapsed      # stopped after the first collapsed step
    logged = last_logged(trainer.log_dir)
    assert logged["alarm/entropy_collapse"] == 1.0
    assert logged["train/entropy"] == pytest.approx(1e-3 * TOKEN_ENTROPY)
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
    for key, value in expected.items():
        assert logged[key] == pytest.approx(value, rel=1e-6), key
    assert logged["timing/step_s"] > 0
    assert logged["perf/tokens_per_s"] == pytest.approx(14 / logged["timing/step_s"], rel=1e-4)


def test_health_callback_logs_status_and_writes_json(tmp_path):
    trainer = fit(tmp_path, [TrainingStats(), EntropyMonitor(), HealthMonitor(interval=1, window=2),
                             DiagnosticsProgressBar()], enable_progress_bar=True)
    logged = last_logged(trainer.log_dir)
    assert logged["health/status"] == 1.0   # clip/pos_high 0.25 > 0.02
    report = json.loads((Path(trainer.log_dir) / "health.json").read_text())
    assert report["verdict"] == "watch" and "clip ratio persistently high" in report["reason"]
    assert report["steps_seen"] == 3
    assert report["last"]["train/entropy"] == pytest.approx(TOKEN_ENTROPY)
    assert report["last"]["clip/pos_high"] == pytest.approx(0.25)
    for key in ("train/entropy", "train/reward_mean", "clip/pos_high", "train/kl"):  # what was logged
        assert report["last"][key] == logged[key], key
    bar = trainer.progress_bar_callback
    assert isinstance(bar, DiagnosticsProgressBar)
    assert bar.get_metrics(trainer, trainer.lightning_module)["health"] == "watch"


@pytest.mark.parametrize("callbacks", [[HealthMonitor()], [HealthMonitor(), TrainingStats(), EntropyMonitor()],
                                       [EntropyMonitor(), HealthMonitor(), TrainingStats()]])
def test_health_monitor_needs_its_sources_before_it(tmp_path, callbacks):
    with pytest.raises(ValueError, match="before it in trainer.callbacks"):
        fit(tmp_path, callbacks)


def test_token_weight_surface_saves_figures(tmp_path):
    surface = TokenWeightSurface(every_n_steps=2, bins=10)
    trainer = fit(tmp_path, [surface])
    figures = Path(trainer.log_dir) / "figures"
    assert sorted(p.name for p in figures.glob("*.png")) == ["token_weights_step2.png", "token_weights_step3.png"]
    grids = np.load(figures / "token_weights_step3.npz")
    # one step's tokens: 7 positive at (0.5, 0.5·e^0.1), 7 negative at (0.5, 0.5·e^-0.1)
    assert grids["pos_count"].sum() == 7 and grids["neg_count"].sum() == 7
    assert np.nanmax(grids["pos_mean"]) == pytest.approx(math.exp(0.1), rel=1e-5)


# --------------------------------------------------------------------------- pure functions
def _history(steps=200, entropy=None, reward=None, clip=None, seed=0):
    rng = np.random.default_rng(seed)
    t = np.arange(steps)
    noise = lambda s: rng.normal(0, s, steps)  # noqa: E731
    return {
        "train/entropy": entropy if entropy is not None else 0.3 + 0.3 * np.exp(-t / 30) + noise(0.005),
        "train/reward_mean": reward if reward is not None else 0.2 + 0.4 * (1 - np.exp(-t / 40)) + noise(0.01),
        "clip/pos_high": clip if clip is not None else 0.003 + noise(3e-4),
        "train/kl": 1e-4 + 2e-3 * (1 - np.exp(-t / 50)) + noise(1e-5),
    }


def test_health_verdicts_on_synthetic_histories():
    t = np.arange(200)
    assert assess_health(_history())[0] == "healthy"
    verdict, reason = assess_health(_history(entropy=0.6 * np.exp(-t / 10) + 1e-3,
                                             reward=0.3 + np.random.default_rng(1).normal(0, 0.01, 200)))
    assert verdict == "collapsed" and "entropy collapsed" in reason and "reward flat" in reason
    surge = _history()["clip/pos_high"].copy()
    surge[160:] = np.linspace(0.004, 0.06, 40)
    verdict, reason = assess_health(_history(clip=surge))
    assert verdict in ("watch", "collapsed") and "clip ratio" in reason
    assert assess_health({k: v[:5] for k, v in _history().items()})[0] == "healthy"  # too early


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
    assert count[2, 18] == 1 and mean[2, 18] == pytest.approx(1 / 9) and np.isnan(mean[18, 2])


def test_reservoir_is_bounded_and_uniform():
    res = Reservoir(capacity=500, width=1, seed=0)
    for start in range(0, 100_000, 1000):
        res.add(np.arange(start, start + 1000, dtype=np.float32)[:, None])
    sample = res.sample()[:, 0]
    assert sample.shape == (500,) and res.seen == 100_000
    assert abs(sample.mean() - 50_000) < 5_000 and sample.min() < 10_000 and sample.max() > 90_000


def test_weighted_mean_local_is_not_mean_of_means():
    assert float(weighted_mean(torch.tensor([1.0, 3.0]), torch.tensor([1.0, 9.0]))) == pytest.approx(2.8)
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


# --------------------------------------------------------------------------- 2 processes
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
    for key, value in expected.items():
        assert logged[key] == pytest.approx(value, rel=1e-6), key
    assert logged["perf/tokens_per_s"] == pytest.approx(10 / logged["timing/step_s"], rel=1e-4)
    log_dir = next(tmp_path.rglob("metrics.csv")).parent
    health = json.loads((log_dir / "health.json").read_text())["last"]  # what HealthMonitor judged
    for key in ("train/entropy", "clip/pos_high", "train/kl", "train/reward_mean"):
        assert health[key] == pytest.approx(expected[key], rel=1e-6), key
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
    assert logged["entropy/cov"] == pytest.approx(np.cov(x, a, bias=True)[0, 1], abs=1e-7)
    assert logged["entropy/cov_pos"] == pytest.approx(centred[a > 0].sum() / centred.size, abs=1e-7)
    assert logged["entropy/cov_neg"] == pytest.approx(centred[a < 0].sum() / centred.size, abs=1e-7)
    assert logged["entropy/predicted_change"] == pytest.approx(-logged["entropy/cov"])
    assert logged["entropy/measured_change"] == pytest.approx(-0.1 * TOKEN_ENTROPY, rel=1e-6)  # updated = 0.9 H


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
