"""experiments.mechanism: the mechanism check's analysis (docs/studies/mechanism-protocol.md) on synthetic
metrics.csv files whose predictions, projections and decisions are computed by hand below."""

from __future__ import annotations

import csv
import math
import re
from pathlib import Path

import pytest
import yaml

from experiments import mechanism as M
from tests.helpers.tolerance import approx64  # float64 maths, O(1)-O(100) values: docs/design.md, "Tolerances in tests"

REPO = Path(__file__).resolve().parents[2]
LOSSES = ("grpo", "grpo_no_is", "grpo_pos_mean", "cispo", "gspo", "aspo", "aspo_no_dual_clip")
GRPO_CHANGE = -0.006          # Δ_grpo in every batch (a constant: its SE is 0, so ρ is defined)
#: per arm: δ, the gap d_b = Δ_grpo − Δ_aspo = mu + s·(−1)^b, and entropy/measured_change
WORLD = {1: dict(delta=0.01, mu=1e-4, s=math.sqrt(19) * 1e-4, measured=-0.0009),
         2: dict(delta=0.02, mu=2e-4, s=0.0, measured=-0.0012),
         3: dict(delta=0.06, mu=2.5e-4, s=0.0, measured=-0.0018),
         4: dict(delta=0.02, mu=3e-4, s=0.0, measured=-0.003)}


def batches(*, delta, mu, s, measured, reward_slope=0.01, health=0.0, grpo_noise=0.0, pos_max=None, n=20,
            state_gap=None):
    """One CSV row per rollout batch (step: the optimizer step the batch ends on), then a held-out row."""
    rows = []
    for b in range(n):
        d = mu + s * (-1) ** b
        grpo = GRPO_CHANGE + grpo_noise * (-1) ** b
        row = {"step": 16 * (b + 1) - 1, "train/entropy": 0.5 - 0.0005 * b, "train/reward_mean": 0.3 + reward_slope * b,
               "health/status": health if b == n - 1 else 0.0, "entropy/measured_change": measured,
               "flip/weight_change": delta, "flip/weight_change_forced": 0.1 * delta, "flip/weight_change_free": 2 * delta,
               "flip/forced_weight_share": 1 / 1.9, "flip/forced_token_share": 0.8, "flip/entropy_forced": 0.01,
               "flip/entropy_free": 0.09, "flip/spearman_pi_old_ratio": -0.1, "flip/entropy_change_pooled_gap": d}
        for sign in ("pos", "neg"):
            row.update({f"flip/abs_log_ratio_{sign}_p50": 1e-5, f"flip/abs_log_ratio_{sign}_p90": 1e-3,
                        f"flip/abs_log_ratio_{sign}_p99": 0.02, f"flip/abs_log_ratio_{sign}_max": 0.05})
        if pos_max is not None and b == 7:
            row["flip/abs_log_ratio_pos_max"] = pos_max
        for k in range(1, 11):
            w_grpo, w_aspo = {1: (1.02, 0.98), 10: (1.0001, 0.9999)}.get(k, (1.0, 1.0))
            row.update({f"flip/pi_old_decile{k:02d}": k / 10 - 0.05, f"flip/w_grpo_decile{k:02d}": w_grpo,
                        f"flip/w_aspo_decile{k:02d}": w_aspo})
        row.update({f"flip/entropy_change_pooled/{loss}": grpo for loss in LOSSES})
        row["flip/entropy_change_pooled/aspo"] = grpo - d
        if state_gap is not None:      # the state-centred gaps: alternating about state_gap
            row["flip/entropy_change_state_gap"] = state_gap + 2 * abs(state_gap) * (-1) ** b
            row["flip/entropy_change_state_old_gap"] = state_gap
        rows.append(row)
    rows.append({"step": 16 * n - 1, "val/avg@4": 0.4})
    return rows


def write_world(root: Path, **changes: dict) -> Path:
    """The four arms under ``root`` as `make study-mechanism` lays them out, finished; ``changes``
    (``arm2={...}``) override an arm's parameters."""
    for arm in M.ARMS:
        rows = batches(**{**WORLD[arm.number], **changes.get(f"arm{arm.number}", {})})
        path = M.run_dir(root, arm)
        (path / "version_0").mkdir(parents=True)
        keys = ["epoch", "step"] + sorted({k for r in rows for k in r} - {"step"})
        with (path / "version_0" / "metrics.csv").open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=keys, restval="")
            writer.writeheader()
            writer.writerows({"epoch": 0, **r} for r in rows)
        (path / "done").write_text("{}")
    return root


def outcomes(analysis: M.Analysis) -> dict[str, bool]:
    return {o.id: o.confirmed for o in analysis.outcomes}


def test_the_arms_are_the_study_configs_folders():
    """ARMS reads the folders `make study-mechanism` writes (conf/study/mechanism*.yaml)."""
    base = yaml.safe_load((REPO / "conf/study/mechanism.yaml").read_text())
    folders = {Path(base["out_dir"]).name: base["losses"]}
    for overlay in ("mechanism_lr5e-5.yaml", "mechanism_lr2e-4.yaml"):
        extra = yaml.safe_load((REPO / "conf/study" / overlay).read_text())
        folders[Path(extra["out_dir"]).name] = extra["losses"]
    assert sorted((a.folder, a.loss) for a in M.ARMS) == sorted((f, loss) for f, losses in folders.items() for loss in losses)
    assert base["seeds"] == [M.SEED]


def test_lag1_autocorrelation_and_the_inflated_se():
    # [1, 2, 3, 4]: centred ±0.5, ±1.5; lag-1 products 0.75 − 0.25 + 0.75 over squares 5 -> 0.25
    assert M.lag1_autocorrelation([1, 2, 3, 4]) == approx64(0.25)
    # sd = √(5/3), /√4, × √(1.25/0.75) = √(5/3) -> (5/3)/2
    se, a = M.mean_se([1, 2, 3, 4])
    assert (se, a) == (approx64(5 / 6), approx64(0.25))
    # alternating: lag-1 −3/4, clipped to 0 (no deflation): sd/√n = √(4/3)/2
    assert M.mean_se([1, -1, 1, -1]) == (approx64(math.sqrt(4 / 3) / 2), 0.0)


def test_predictions_pass_and_fail_as_computed_by_hand(tmp_path):
    analysis = M.analyse(write_world(tmp_path))
    # P3: δ = 0.01, 0.02, 0.06: the second ratio, 3, is above 2.7.
    # P8: at lr 5e-5 the gap alternates 1e-4 ± √19·1e-4: 10 of 20 batches > 0, not 14.
    assert outcomes(analysis) == {"P1": True, "P2": True, "P3": False, "P4": True, "P5": True, "P6": True,
                                  "P7": True, "P8": False, "P9": True, "P10": True, "P11": True}
    measured = {o.id: o.measured for o in analysis.outcomes}
    assert "ratios 2, 3" in measured["P3"]
    assert "5e-5: mean 0.0001, 10/20 > 0" in measured["P8"]
    assert analysis.eta == {1: approx64(0.15), 2: approx64(0.2), 3: approx64(0.3), 4: approx64(0.5)}
    # D = max(80·|measured|, 4 × (mean of batches 0-3 − of 16-19) = 4 × 0.008)
    assert analysis.decline[5e-5] == (approx64(0.072), approx64(0.072), approx64(0.032))
    assert analysis.decline[2e-4][0] == approx64(0.144)


def test_a_broken_identity_fails_p1(tmp_path):
    """One batch whose δ (0.02) exceeds exp(2 × 0.001) − 1."""
    analysis = M.analyse(write_world(tmp_path, arm2={"pos_max": 0.001}))
    (p1,) = [o for o in analysis.outcomes if o.id == "P1"]
    assert not p1.confirmed
    assert p1.measured == f"79 of 80 batches; largest δ − bound {0.02 - math.expm1(0.002):.3g}"


def test_the_projection_by_hand(tmp_path):
    analysis = M.analyse(write_world(tmp_path))
    by = {(p.arm.number, p.pair): p for p in analysis.projections}
    # arm 1: ρ = 1e-4/0.006; sd(d) = √20·1e-4, SE = sd/√20/0.006 (a = −0.95, clipped to 0); D = 0.072
    one = by[(1, "aspo")]
    assert (one.rho, one.se, one.a, one.decline) == (approx64(1 / 60), approx64(1 / 60), 0.0, approx64(0.072))
    assert one.p == approx64(3 / 60 * 0.072)
    # arm 4 (ASPO) uses GRPO's D at its lr (arm 2's 0.096), not its own 80 × 0.003
    assert by[(4, "aspo")].decline == approx64(0.096) and by[(4, "aspo")].p == approx64(0.05 * 0.096)
    assert by[(1, "grpo_no_is")].p == 0.0     # identical first-order changes: ρ = SE = 0 exactly
    # lr 1e-4: the larger of arm 2 (1/30 × 0.096) and arm 4 (0.05 × 0.096)
    assert analysis.p_by_lr[(1e-4, "aspo")] == approx64(0.05 * 0.096)
    d = analysis.decision
    assert (d.band, d.at) == ("far below", (2e-4, "aspo"))
    assert d.p_max == approx64(0.144 / 24) and math.ceil(d.seeds) == 109   # 5·(0.028/0.006)² = 108.9


@pytest.mark.parametrize("arm2, band, p_max, seeds", [
    ({"mu": 8e-4}, "between", 0.8 / 6 * 0.096, 24),                        # 0.0128: 5·(0.028/0.0128)² = 23.9
    ({"mu": 1.5e-3}, "near", 0.25 * 0.096, 7),                             # 0.024: 6.8
    ({"mu": 1.5e-3, "reward_slope": -0.01}, "between", 0.25 * 0.096, 7),   # near, but GRPO does not learn there
    ({"mu": 1.5e-3, "health": 2.0}, "between", 0.25 * 0.096, 7),           # near, but GRPO collapsed there
])
def test_the_decision_bands(tmp_path, arm2, band, p_max, seeds):
    d = M.analyse(write_world(tmp_path, arm2=arm2)).decision
    assert (d.band, d.at, d.p_max, math.ceil(d.seeds)) == (band, (1e-4, "aspo"), approx64(p_max), seeds)
    assert d.follow_up == ((1e-4, "aspo") if band == "near" else None)
    assert d.defined and d.label == band      # a finite P: the band is printed as it is


def test_an_undefined_rho_counts_as_near(tmp_path):
    """Δ_grpo = −0.006 ± 0.1 at lr 2e-4: its mean is within 2 SE of 0, so P is undefined there."""
    analysis = M.analyse(write_world(tmp_path, arm3={"grpo_noise": 0.1}))
    assert analysis.decision.band == "near" and analysis.decision.follow_up == (2e-4, "aspo")
    assert math.isinf(analysis.decision.p_max) and not outcomes(analysis)["P9"]


def test_a_near_resting_only_on_an_undefined_rho_is_printed_indeterminate(tmp_path):
    """Added 2026-12-07: the protocol's "near" through an undefined ρ alone is reported as
    "indeterminate (ρ undefined)", never as "near" with "P = undefined nats ≥ 0.014"."""
    analysis = M.analyse(write_world(tmp_path / "runs", arm3={"grpo_noise": 0.1}))
    assert (analysis.decision.band, analysis.decision.defined) == ("near", False)
    assert analysis.decision.label == "indeterminate (ρ undefined)"
    out = M.write_report(analysis, tmp_path / "docs" / "mechanism.md", "python -m experiments.mechanism")
    text = out.read_text()
    assert "**Decision: indeterminate (ρ undefined).** No defined P reaches 0.014 nats." in text
    assert "Decision: near" not in text and "undefined nats" not in text
    assert "P_max is undefined (ρ undefined for ASPO against GRPO at lr 2e-4)" in text
    assert "**What the decision rests on.** ρ is undefined at lr 2e-4" in text


def test_the_report_renders(tmp_path):
    out = tmp_path / "docs" / "mechanism.md"
    M.write_report(M.analyse(write_world(tmp_path / "runs")), out, "python -m experiments.mechanism")
    text = out.read_text()
    assert "9 of 11 predictions confirmed." in text
    assert "**Decision: far below** (P_max < 0.007 nats; n(P_max) = 109 seeds per arm)" in text
    rows = [line for line in text.splitlines() if re.match(r"\| P\d+ \|", line)]
    assert len(rows) == 11
    # every prediction row has its 5 cells: a |…| inside a cell is escaped
    assert all(len(re.findall(r"(?<!\\)\|", line)) == 6 for line in rows)
    assert "| P3 |" in rows[2] and rows[2].endswith("| **not confirmed** |")
    # the first-order estimator is named and labelled pooled; the post-hoc reading is there, labelled
    assert "| `flip/entropy_change_pooled/grpo` |" in text and "| `flip/entropy_change_pooled_gap` |" in text
    assert "flip/entropy_change/" not in text and "`flip/entropy_change_gap`" not in text
    assert "is the *pooled* first-order estimator" in text
    reading = text[text.index("## Reading (post hoc: not part of the pre-registered analysis)"):]
    assert "the pooled gap's sign says nothing about ASPO's per-state effect" in reading
    assert "P8 cannot be re-read with it here" in reading            # this world's runs predate it
    assert "What the decision rests on" not in reading       # ρ is defined in this world
    for name in ("deciles.png", "spread.png"):
        assert f"](mechanism/{name})" in text
        assert (out.parent / "mechanism" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_p8_re_read_with_the_state_centred_estimator(tmp_path):
    """Runs that log the state-centred gaps: P8's rule applied to them, under π_θ (alternating about
    the mean: half the batches > 0) and under π_old (every batch at the mean)."""
    worlds = {f"arm{k}": {"state_gap": -0.002} for k in (1, 2, 3, 4)}
    text = M.reading_lines(M.analyse(write_world(tmp_path / "neg", **worlds)))
    line = next(x for x in text if "P8 re-read with the state-centred estimator" in x)
    assert "Under π_θ: mean per batch (batches > 0) -0.002 (10/20 > 0), -0.002 (10/20 > 0)" in line
    assert "under π_old: mean per batch (batches > 0) -0.002 (0/20 > 0)" in line
    assert line.count("P8's rule does not hold") == 2
    worlds = {f"arm{k}": {"state_gap": 0.001} for k in (1, 2, 3, 4)}
    line = next(x for x in M.reading_lines(M.analyse(write_world(tmp_path / "pos", **worlds)))
                if "P8 re-read" in x)
    assert "under π_old: mean per batch (batches > 0) +0.001 (20/20 > 0)" in line
    assert line.count("P8's rule holds") == 1 and line.count("P8's rule does not hold") == 1   # π_θ: 10/20 < 14


def test_missing_and_unfinished_runs_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"arm 1: GRPO, lr 5e-5: no run folder .*lr5e-5/runs/grpo_s5"):
        M.analyse(tmp_path)
    write_world(tmp_path)
    (M.run_dir(tmp_path, M.ARMS[3]) / "done").unlink()
    with pytest.raises(RuntimeError, match=r"arm 4: ASPO.*aspo_s5 is not finished"):
        M.analyse(tmp_path)


def test_a_tie_goes_to_the_lower_lr():
    """Equal P at two learning lrs: the follow-up (and P_max's place) is the lower lr."""
    p = {(5e-5, "aspo"): 0.001, (1e-4, "aspo"): 0.02, (2e-4, "aspo"): 0.02}
    d = M.decide(p, {5e-5: True, 1e-4: True, 2e-4: True})
    assert (d.band, d.at, d.follow_up) == ("near", (1e-4, "aspo"), (1e-4, "aspo"))
