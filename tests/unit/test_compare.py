"""Reference runs and `compare` (aspo_lit/maths/bands.py, aspo_lit/compare/run_reference.py, aspo_lit/compare/commands.py;
docs/compare.md): the maths against brute force and hand counts, the family-wise rate by simulation, a
reference built from seeds, a run compared with it, the CLI and its errors, and the shipped references.

No training but in the last test: every run is a synthetic ``metrics.csv`` in the layout a real
CSVLogger run of ``conf/tiny/aspo.yaml`` writes (rows for the data sizes first; then per rollout batch one
``lr-AdamW`` row and one row of the training metrics, both at the batch's ``step``; a validation row at the
end of every ``val_every`` batches), beside a ``config.yaml`` holding its seed and an ``hparams.yaml``
holding its testbed.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np
import pytest

from aspo_lit.__main__ import gather_leading_words, main
from aspo_lit.compare.run_reference import (
    METRICS,
    build_reference,
    comparable_config,
    compare_run,
    config_matches,
    exit_code,
    family_p,
    leave_one_out,
    parse_reference,
    read_reference,
)
from aspo_lit.compare.runlog import CompareError, config_differences, load_run
from aspo_lit.maths.bands import (
    MetricSpec,
    complete_windows,
    holm,
    prediction_test,
    seed_range,
    trajectory_score,
    window_values,
)

TRAIN = {  # metric: (level, per-seed SD, per-step noise SD): what the tiny config logs, roughly
    "train/reward_mean": (0.5, 0.02, 0.05), "train/entropy": (0.08, 0.004, 0.008),
    "clip/pos_high": (0.004, 0.0005, 0.001), "clip/neg_low": (0.01, 0.001, 0.002),
    "ratio/pos_mean": (1.0, 0.0005, 0.001), "ratio/neg_mean": (1.0, 0.0005, 0.001),
    "train/kl": (0.01, 0.001, 0.002), "train/grad_norm": (0.5, 0.03, 0.1), "response/length_mean": (20.0, 0.5, 1.5),
    "train/repetition_rate": (0.02, 0.002, 0.005), "train/pg_loss": (0.0, 0.001, 0.01),
    "ratio/off_policy_share": (0.75, 0.005, 0.01),
}
CONFIG = "seed_everything: {seed}\ntrainer:\n  max_steps: 160\n  logger:\n    init_args: {{save_dir: {dir}}}\n" \
         "model:\n  lr: {lr}\n  seed: {seed}\n"


def series(seed: int, steps: int, shift: dict[str, float] | None = None) -> dict[str, np.ndarray]:
    """Per-step values of each training metric for one seed: level + seed offset + step noise (all > 0)."""
    rng = np.random.default_rng(seed)
    out = {}
    for key, (level, seed_sd, step_sd) in TRAIN.items():
        out[key] = level + rng.normal(0, seed_sd) + rng.normal(0, step_sd, steps) + (shift or {}).get(key, 0.0)
        if key != "train/pg_loss":
            out[key] = np.abs(out[key])
    return out


def write_run(root: Path, seed: int, steps: int = 40, shift: dict[str, float] | None = None, val_every: int = 10,
              drop: tuple[str, ...] = (), lr: float = 2e-4, values: dict[str, np.ndarray] | None = None,
              testbed: str | None = "testbed v1") -> Path:
    """A CSVLogger-layout run folder ``root/version_<seed>`` (metrics.csv, config.yaml, hparams.yaml)."""
    folder = root / f"version_{seed}"
    folder.mkdir(parents=True)
    values = series(seed, steps, shift) if values is None else values
    val = 0.5 + np.random.default_rng(1000 + seed).normal(0, 0.01, steps)
    keys = [k for k in TRAIN if k not in drop]
    header = sorted({"epoch", "step", "lr-AdamW", "data/train_prompts", "val/avg@4", "val/pass@4", *keys})
    rows = [{"data/train_prompts": 2000, "step": 0}]
    for step in range(steps):
        rows.append({"lr-AdamW": lr, "step": step})
        rows.append({"epoch": 0, "step": step, **{k: repr(float(values[k][step])) for k in keys}})
        if (step + 1) % val_every == 0 and "val/avg@4" not in drop:
            rows.append({"epoch": 0, "step": step, "val/avg@4": repr(float(val[step])), "val/pass@4": 0.7})
    with open(folder / "metrics.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=header)
        writer.writeheader()
        writer.writerows(rows)
    (folder / "config.yaml").write_text(CONFIG.format(seed=seed, dir=root, lr=lr))
    if testbed:
        (folder / "hparams.yaml").write_text(f"testbed: {testbed}\nmodel_name_or_path: testbed\n")
    return folder


@pytest.fixture
def seeds(tmp_path) -> list[Path]:
    return [write_run(tmp_path / "ref", s) for s in range(8)]


def reference_of(seeds, window: int = 4, **kwargs):
    data = build_reference([load_run(str(s)) for s in seeds], window=window, **kwargs)
    return data, parse_reference(data, "test")


# --------------------------------------------------------------------------- the maths

def test_window_values_keep_complete_windows_median_or_mean():
    steps = np.arange(11.0)
    assert window_values(steps, steps * 2, 5, last_step=10) == {0: 4.0, 1: 14.0}    # step 10 alone: not complete
    assert window_values(steps, steps, 5, last_step=14) == {0: 2.0, 1: 7.0, 2: 10.0}  # the run reached step 14
    spiky = np.array([0.0, 0.0, 0.0, 8.0])
    assert window_values(np.arange(4.0), spiky, 4, 3) == {0: 0.0}
    assert window_values(np.arange(4.0), spiky, 4, 3, "mean") == {0: 2.0}
    assert complete_windows(9, 5) == 2 and complete_windows(8, 5) == 1 and complete_windows(-1, 5) == 0


def test_trajectory_score_is_the_mean_of_transformed_window_values():
    values = {0: 0.01, 1: 0.04, 2: 0.09}
    assert trajectory_score(values, [0, 1, 2]) == pytest.approx(0.14 / 3)
    assert trajectory_score(values, [0, 1, 2], "sqrt") == pytest.approx((0.1 + 0.2 + 0.3) / 3)
    assert trajectory_score(values, [1, 2], "log") == pytest.approx((math.log(0.04) + math.log(0.09)) / 2)
    assert math.isnan(trajectory_score(values, [0, 3]))                      # a window the run lacks
    assert math.isnan(trajectory_score({0: 0.0}, [0], "log"))                 # outside the transform's domain
    with pytest.raises(ValueError, match="transform"):
        MetricSpec("median", "cube")


def test_prediction_test_by_hand():
    """Seeds 1, 2, 3, 4, 5: mean 3, SD sqrt(2.5); a new score of 8 is (8 - 3) / (sqrt(2.5)·sqrt(1.2)) = 2.887 SDs
    of a new draw, t with 4 degrees of freedom: two-sided p = 0.0447 (tables: t_{4, 0.975} = 2.776)."""
    test = prediction_test(8.0, [1.0, 2.0, 3.0, 4.0, 5.0])
    assert test.mean == 3.0 and test.sd == pytest.approx(math.sqrt(2.5)) and test.n == 5
    assert test.t == pytest.approx(5 / math.sqrt(2.5 * 1.2)) and test.p == pytest.approx(0.04466, abs=1e-4)
    low, high = test.limits(0.05)
    assert high - 3 == pytest.approx(2.776445 * math.sqrt(2.5 * 1.2), rel=1e-5) and 3 - low == pytest.approx(high - 3)
    # seeds that agree exactly: equal up to float32 rounding passes, anything else fails
    assert prediction_test(0.1, [0.1] * 5).p == 1.0
    assert prediction_test(float(np.float32(0.1)), [0.1] * 5).p == 1.0
    assert prediction_test(0.1 * (1 + 1e-6), [0.1] * 5).p == 0.0
    assert prediction_test(math.nan, [1.0, 2.0]).p == 0.0
    with pytest.raises(ValueError, match=">= 2 seeds"):
        prediction_test(1.0, [1.0, math.nan])


def test_holm_by_hand():
    p = {"a": 0.001, "b": 0.02, "c": 0.03, "d": 0.2}
    assert holm(p, 0.05) == {"a"}                    # 0.001 <= 0.05/4; 0.02 > 0.05/3
    assert holm({**p, "b": 0.015}, 0.05) == {"a", "b"}   # 0.015 <= 0.05/3; 0.03 > 0.05/2
    assert holm({"a": 0.01, "b": 0.02}, 0.05) == {"a", "b"}   # 0.01 <= 0.025, 0.02 <= 0.05
    assert holm(p, 0.001) == set() and holm({}, 0.05) == set()


def test_family_wise_rate_by_simulation():
    """Holm over 12 metrics with t prediction intervals holds a same-config seed's chance of departing
    anywhere at or under alpha: 4,000 draws of n + 1 normal seeds over 12 independent metrics (the rate there
    is 1 - (1 - alpha/12)^12 ~ 0.049; binomial SE 0.0034, so the check is <= alpha + 3 SE). A band from the
    seeds' SD alone (no sqrt(1 + 1/n)) fails the same check."""
    from scipy import stats

    rng = np.random.default_rng(0)
    n, m, alpha, draws = 20, 12, 0.05, 4000
    x = rng.normal(size=(draws, n + 1, m))
    departs = [bool(holm({j: prediction_test(x[d, n, j], x[d, :n, j]).p for j in range(m)}, alpha))
               for d in range(draws)]
    rate = float(np.mean(departs))
    assert 0.035 <= rate <= alpha + 3 * 0.0034, rate
    ref, new = x[:, :n], x[:, n]
    t = np.abs(new - ref.mean(axis=1)) / ref.std(axis=1, ddof=1)     # k·SD, not the prediction interval
    too_narrow = (2 * stats.t.sf(t, n - 1) <= alpha / m).any(axis=1).mean()
    assert too_narrow > alpha + 3 * 0.0034


def test_calibrated_df_widens_the_tails_only_for_heavy_tailed_seeds():
    """Leaving one seed out of 40: seeds drawn from a normal keep (nearly) the normal model's 39 degrees of
    freedom; seeds from a Student-t with 3 degrees of freedom (heavy tails: the demo's early KL, its ratio
    means) get fewer, and at them no more than alpha of the held-out seeds depart on any prefix. Under 20
    seeds the normal model's n - 1 is kept (leaving one out measures a rate in steps of 1/n)."""
    from aspo_lit.maths.bands import calibrated_df, t_p_value

    def held_out(draws: np.ndarray) -> list[list[dict[str, float]]]:
        n = draws.shape[0]
        prefixes = []
        for upto in (1, 2):
            seeds = []
            for i in range(n):
                others = np.delete(draws, i, axis=0)[:, :upto].mean(axis=1)   # [n-1, metrics]
                score = draws[i, :upto].mean(axis=0)
                t = (score - others.mean(axis=0)) / (others.std(axis=0, ddof=1) * math.sqrt(1 + 1 / (n - 1)))
                seeds.append({f"m{j}": float(v) for j, v in enumerate(t)})
            prefixes.append(seeds)
        return prefixes

    rng = np.random.default_rng(3)
    normal = held_out(rng.normal(size=(40, 2, 12)))
    heavy = held_out(rng.standard_t(3, size=(40, 2, 12)))
    df_normal, df_heavy = calibrated_df(normal, 40, 0.05), calibrated_df(heavy, 40, 0.05)
    assert df_normal >= 20 and df_heavy < df_normal, (df_normal, df_heavy)
    for prefix in heavy:
        assert np.mean([bool(holm({k: t_p_value(v, df_heavy) for k, v in seed.items()}, 0.05)) for seed in prefix]) <= 0.05
    assert calibrated_df(heavy, 12, 0.05) == 11.0
    assert t_p_value(float("inf"), 5) == 0.0 and t_p_value(0.0, 5) == 1.0


def test_seed_range_is_the_percentiles_per_window():
    per_seed = [{0: float(v), 1: float(2 * v)} for v in range(21)]
    ranges = seed_range(per_seed)
    assert ranges[0] == pytest.approx((1.0, 10.0, 19.0)) and ranges[1] == pytest.approx((2.0, 20.0, 38.0))


# --------------------------------------------------------------------------- a reference

def test_reference_keeps_every_seeds_window_values(tmp_path, seeds):
    data, ref = reference_of(seeds)
    assert data["version"] == 2 and data["kind"] == "run" and data["window"] == 4 and data["seeds"] == list(range(8))
    assert data["testbed"] == "testbed v1" and data["alpha"] == 0.05
    for key in ("train/reward_mean", "response/length_mean"):
        medians = [np.median(series(s, 40)[key].reshape(10, 4), axis=1) for s in range(8)]
        np.testing.assert_allclose(np.array(data["metrics"][key]["values"]), np.array(medians), rtol=1e-12)
        assert data["metrics"][key]["windows"] == list(range(10))
    means = [series(s, 40)["clip/pos_high"].reshape(10, 4).mean(axis=1) for s in range(8)]   # a mean metric
    np.testing.assert_allclose(np.array(data["metrics"]["clip/pos_high"]["values"]), np.array(means), rtol=1e-12)
    assert data["metrics"]["train/kl"]["transform"] == "log"
    # val/avg@4 is logged at steps 9, 19, 29, 39: windows 2, 4, 7, 9 of 4 steps
    assert data["metrics"]["val/avg@4"]["windows"] == [2, 4, 7, 9]
    assert set(data["metrics"]) == {k for k in TRAIN if k != "train/pg_loss"} | {"val/avg@4"}
    assert ref.windows == 10 and len(ref.metrics) == len(METRICS)


def test_held_out_seed_passes_and_a_shift_departs_from_its_window(tmp_path, seeds):
    _, ref = reference_of(seeds)
    same = load_run(str(write_run(tmp_path / "new", 11)))
    assert exit_code(compare_run(same, ref)) == 0
    # the KL three times higher from step 20 (window 5) on: its log-score up by log(3)/2 = 0.55, about 5 of
    # the seeds' SDs of it (~0.1: a seed's level 10 %, a window median's noise ~10 % / sqrt(10 windows))
    values = series(12, 40)
    values["train/kl"] = values["train/kl"] * np.where(np.arange(40) >= 20, 3.0, 1.0)
    results = {r.metric: r for r in compare_run(load_run(str(write_run(tmp_path / "bad", 12, values=values))), ref)}
    assert results["train/kl"].status == "departs" and results["train/kl"].first_window >= 5
    assert [m for m, r in results.items() if r.status == "departs"] == ["train/kl"]
    kl = results["train/kl"]
    assert kl.score > kl.limits[1] and kl.p < 0.05 / len(results) and kl.compared == 10


def test_a_shift_within_every_windows_spread_departs_on_the_trajectory(tmp_path):
    """The trajectory score's power where seeds do not stay high or low for a whole run (the demo's
    window values correlate at |rho| <= 0.4 between windows): a reward 0.05 lower on every batch is within
    2 of the seeds' SDs of a window value, yet the mean over 10 windows, whose spread is a third of a
    window's, departs."""
    def reward_only(seed: int, shift: float = 0.0) -> dict[str, np.ndarray]:
        values = series(seed, 40)
        values["train/reward_mean"] = 0.5 + shift + np.random.default_rng(500 + seed).normal(0, 0.05, 40)
        return values

    data, ref = reference_of([write_run(tmp_path / "ref", s, values=reward_only(s)) for s in range(8)])
    per_window = np.array(data["metrics"]["train/reward_mean"]["values"]).std(axis=0, ddof=1)
    assert 0.05 < 2 * per_window.mean(), per_window
    scores = ref.metrics["train/reward_mean"].seed_scores(list(range(10)))
    assert np.std(scores, ddof=1) < per_window.mean() / 2
    low = load_run(str(write_run(tmp_path / "low", 13, values=reward_only(13, -0.05))))
    results = {r.metric: r for r in compare_run(low, ref)}
    assert results["train/reward_mean"].status == "departs", results["train/reward_mean"]


def test_one_batch_spike_stays_inside_a_burst_does_not(tmp_path, seeds):
    """A window is summarised by its median: one batch's grad-norm burst (x20) leaves the window where the
    other batches put it; a burst on every batch from step 24 on (lr too large) departs."""
    _, ref = reference_of(seeds)
    values = series(9, 40)
    values["train/grad_norm"][6] *= 20
    spiked = load_run(str(write_run(tmp_path / "spike", 9, values=values)))
    assert {r.metric: r for r in compare_run(spiked, ref)}["train/grad_norm"].status == "inside"
    values["train/grad_norm"][24:] *= 3
    burst = load_run(str(write_run(tmp_path / "burst", 9, values=values)))
    assert {r.metric: r for r in compare_run(burst, ref)}["train/grad_norm"].status == "departs"


def test_shorter_run_is_compared_on_its_windows(tmp_path, seeds, capsys):
    ref_file = tmp_path / "ref.json"
    assert main(["reference", *map(str, seeds), "--out", str(ref_file), "--window", "5",
                 "--leave_one_out", "false"]) == 0
    ref = read_reference(str(ref_file))
    short = load_run(str(write_run(tmp_path / "short", 9, steps=12)))   # windows 0, 1 complete; 10-11 partial
    results = {r.metric: r for r in compare_run(short, ref)}
    assert results["train/reward_mean"].status == "inside" and results["train/reward_mean"].compared == 2
    assert results["val/avg@4"].compared == 1
    # the seeds' scores are over the same two windows: a shift inside them shows, one after them cannot
    values = series(9, 12)
    values["train/reward_mean"][5:] += 0.3
    results = {r.metric: r for r in compare_run(load_run(str(write_run(tmp_path / "bad", 9, steps=12, values=values))),
                                                ref)}
    assert results["train/reward_mean"].status == "departs" and results["train/reward_mean"].first_window == 1
    capsys.readouterr()
    assert main(["compare", str(tmp_path / "short" / "version_9"), "--reference", str(ref_file)]) == 0
    assert "2 of the reference's 8 windows" in capsys.readouterr().out
    too_short = write_run(tmp_path / "too_short", 9, steps=4)
    assert main(["compare", str(too_short), "--reference", str(ref_file)]) == 2


def test_missing_metrics_are_reported_not_failed(tmp_path):
    seeds = [write_run(tmp_path / "ref", s, drop=("train/repetition_rate",)) for s in range(5)]
    data, ref = reference_of(seeds)
    assert data["missing"] == ["train/repetition_rate"]
    run = load_run(str(write_run(tmp_path / "run", 9, drop=("train/grad_norm", "val/avg@4"))))
    results = {r.metric: r for r in compare_run(run, ref)}
    assert results["train/grad_norm"].status == "missing" and "not logged" in results["train/grad_norm"].reason
    assert results["val/avg@4"].status == "missing"
    assert results["train/repetition_rate"].reason == "not in the reference"
    assert sum(r.status == "inside" for r in results.values()) == len(METRICS) - 3


def test_leave_one_out_catches_the_odd_seed_only(tmp_path):
    """Each seed against the reference of the others: seeds of one distribution pass; a seed whose KL sits
    three times as high is caught when held out."""
    runs = [load_run(str(write_run(tmp_path / "ok", s))) for s in range(8)]
    loo = leave_one_out(runs, window=4)
    # each of 8 same-distribution seeds departs with probability <= 5 %: here seed 1, by chance (p = 0.029)
    assert loo["seeds"] == 8 and loo["departed"] <= 1 and len(loo["family_p"]) == 8
    odd = series(99, 40)
    odd["train/kl"] = odd["train/kl"] * 3
    runs[3] = load_run(str(write_run(tmp_path / "odd", 99, values=odd)))
    loo = leave_one_out(runs, window=4)
    assert loo["departures"][runs[3].source] == ["train/kl"]
    assert min(loo["family_p"]) == loo["family_p"][3] < 0.01
    assert family_p([]) == 1.0


# --------------------------------------------------------------------------- the commands

def test_compare_prints_verdicts_and_draws_the_seeds(tmp_path, seeds, capsys):
    ref_file = tmp_path / "ref.json"
    assert main(["reference", f"[{', '.join(map(str, seeds))}]", "--out", str(ref_file), "--window", "5"]) == 0
    out = capsys.readouterr().out
    assert "8 seeds" in out and "testbed testbed v1" in out and "leave one seed out:" in out
    bad = write_run(tmp_path / "bad", 9, shift={"train/entropy": 0.05})
    assert main(["compare", str(bad / "metrics.csv"), "--reference", str(ref_file)]) == 1
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.startswith("train/entropy"))
    assert "departs from window 0" in line
    assert next(line for line in out.splitlines() if line.startswith("train/reward_mean")).split()[2] == "inside"
    assert out.splitlines()[-1].startswith("DEPARTS: 1 of") and "train/entropy" in out.splitlines()[-1]
    png = bad / "compare-ref.png"
    assert png.read_bytes()[:4] == b"\x89PNG" and png.stat().st_size > 20_000
    assert main(["compare", str(bad), "--reference", str(ref_file), "--out", str(tmp_path / "figs")]) == 1
    assert (tmp_path / "figs" / "compare-ref.png").is_file()
    assert main(["compare", str(bad), "--reference", str(ref_file), "--alpha", "1e-30"]) == 0   # alpha: the rate


def test_notes_name_the_testbed_and_the_config_changes(tmp_path, seeds, capsys):
    """Another testbed is said; settings that keep the maths (the shared prompt, the token budget) are told
    apart from an lr change."""
    ref_file = tmp_path / "ref.json"
    assert main(["reference", *map(str, seeds), "--out", str(ref_file), "--leave_one_out", "false"]) == 0
    other = write_run(tmp_path / "other", 9, testbed="a local build of testbed (weights 0123456789ab)")
    capsys.readouterr()
    main(["compare", str(other), "--reference", str(ref_file)])
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note:")]
    assert notes == ["note: the reference's runs started from testbed v1, this run from a local build of testbed "
                     "(weights 0123456789ab): another starting policy, whose runs the bands do not describe"]
    fast, slow_lr = write_run(tmp_path / "fast", 9), write_run(tmp_path / "lr", 9, lr=1e-3)
    config = fast / "config.yaml"
    config.write_text(config.read_text() + "  share_prompt: true\n  max_tokens_per_micro_batch: 2048\n")
    assert main(["compare", str(fast), "--reference", str(ref_file)]) == 0
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and "speed settings that keep the maths" in notes[0], notes
    assert "model.share_prompt: '<unset>' != True" in notes[0] and "model.max_tokens_per_micro_batch" in notes[0]
    main(["compare", str(slow_lr), "--reference", str(ref_file)])
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and "differs from the reference's: model.lr" in notes[0], notes


def test_nothing_in_common_exits_2(tmp_path, seeds, capsys):
    ref_file = tmp_path / "ref.json"
    assert main(["reference", *map(str, seeds), "--out", str(ref_file), "--leave_one_out", "false"]) == 0
    other = tmp_path / "other" / "metrics.csv"
    other.parent.mkdir()
    other.write_text("epoch,step,foo/bar\n0,0,1.0\n0,1,2.0\n0,2,3.0\n0,3,4.0\n0,4,5.0\n")
    capsys.readouterr()
    assert main(["compare", str(other), "--reference", str(ref_file)]) == 2
    assert "nothing to compare" in capsys.readouterr().err


def test_bad_files_name_the_file(tmp_path, seeds, capsys):
    ref_file = tmp_path / "ref.json"
    assert main(["reference", *map(str, seeds), "--out", str(ref_file), "--leave_one_out", "false"]) == 0
    run = str(seeds[0])
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    for reference, message in {"nope.json": "reference nope.json: no such file",
                               str(broken): f"reference {broken}: not JSON"}.items():
        capsys.readouterr()
        assert main(["compare", run, "--reference", reference]) == 2
        assert message in capsys.readouterr().err
    good = json.loads(ref_file.read_text())
    for name, edit, message in (("fmt.json", {"format": "x"}, "not an aspo-lit reference"),
                                ("v1.json", {"version": 1}, "version 1; this aspo-lit reads version 2"),
                                ("alpha.json", {"alpha": "x"}, "field 'alpha'"),
                                ("row.json", {"metrics": {"train/kl": {**good["metrics"]["train/kl"],
                                                                       "values": [[1.0], [2.0]]}}},
                                 "metrics['train/kl'] needs window_summary, transform, windows and one row"),
                                ("nan.json", {"metrics": {"train/kl": {**good["metrics"]["train/kl"],
                                                                       "values": [[float("nan")] * 10] * 2}}},
                                 "metrics['train/kl'] needs >= 2 seeds of finite values")):
        path = tmp_path / name
        path.write_text(json.dumps({**good, **edit}))
        capsys.readouterr()
        assert main(["compare", run, "--reference", str(path)]) == 2
        err = capsys.readouterr().err
        assert str(path) in err and message in err, err
    capsys.readouterr()
    assert main(["compare", str(tmp_path / "no_run"), "--reference", str(ref_file)]) == 2
    assert f"run {tmp_path / 'no_run'}: no metrics.csv" in capsys.readouterr().err
    binary = tmp_path / "bin" / "metrics.csv"
    binary.parent.mkdir()
    binary.write_bytes(b"\xff\xfe\x00garbage")
    assert main(["compare", str(binary), "--reference", str(ref_file)]) == 2
    assert f"run {binary}: cannot read its metrics" in capsys.readouterr().err
    assert main(["compare", run]) == 2
    assert "--reference FILE" in capsys.readouterr().err
    assert main(["compare", run, "--reference", str(ref_file), "--alpha", "2"]) == 2
    assert "--alpha must be in (0, 1)" in capsys.readouterr().err


def test_reference_refuses_too_few_seeds_mixed_configs_and_testbeds(tmp_path, seeds, capsys):
    assert main(["reference", *map(str, seeds[:4]), "--out", str(tmp_path / "r.json")]) == 2
    assert "a reference needs >= 5 runs (seeds), got 4" in capsys.readouterr().err
    other_lr = write_run(tmp_path / "lr", 50, lr=2e-3)
    assert main(["reference", *map(str, seeds[:4]), str(other_lr), "--out", str(tmp_path / "r.json")]) == 2
    err = capsys.readouterr().err
    assert "model.lr: 0.0002 != 0.002" in err and str(other_lr / "config.yaml") in err
    other_testbed = write_run(tmp_path / "tb", 51, testbed="testbed v2")
    assert main(["reference", *map(str, seeds[:4]), str(other_testbed), "--out", str(tmp_path / "r.json")]) == 2
    assert "different testbeds (testbed v1, testbed v2)" in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()
    assert main(["reference", *map(str, seeds[:4]), str(other_lr), "--out", str(tmp_path / "r.json"),
                 "--allow_mixed_configs", "true", "--leave_one_out", "false"]) == 0
    twin = write_run(tmp_path / "twin", 0)
    assert main(["reference", *map(str, seeds[:4]), str(twin), "--out", str(tmp_path / "t.json")]) == 2
    assert "share a seed" in capsys.readouterr().err


def test_reference_records_config_commit_and_shipped_names(tmp_path, seeds, monkeypatch):
    import hashlib

    import aspo_lit.compare.run_reference as R

    ref_file = tmp_path / "ref.json"
    assert main(["reference", *map(str, seeds), "--out", str(ref_file), "--leave_one_out", "false"]) == 0
    ref = json.loads(ref_file.read_text())
    text = (seeds[0] / "config.yaml").read_text()
    assert ref["config"]["text"] == text and ref["config"]["sha256"] == hashlib.sha256(text.encode()).hexdigest()
    assert ref["commit"] == R.git_commit() and ref["commit"]
    assert ref["window"] == 4                           # default: 40 steps in about 10 windows
    shipped = tmp_path / "references"
    shipped.mkdir()
    (shipped / "demo.json").write_text(ref_file.read_text())
    monkeypatch.setattr(R, "REFERENCES", shipped)
    assert read_reference("demo").path == str(shipped / "demo.json")
    with pytest.raises(CompareError, match="shipped references: demo"):
        read_reference("nodemo")
    assert R.matching_reference(text.replace("seed_everything: 0", "seed_everything: 7")).path.endswith("demo.json")
    assert R.matching_reference(text.replace("lr: 0.0002", "lr: 0.001")) is None


def test_leading_words_become_one_list():
    assert gather_leading_words(["a", "b", "--out", "x"]) == ['["a", "b"]', "--out", "x"]
    assert gather_leading_words(["[a, b]", "--out", "x"]) == ["[a, b]", "--out", "x"]
    assert gather_leading_words(["--help"]) == ["--help"]


def test_a_setting_added_later_counts_at_its_old_behaviour():
    """A config recorded before `data.max_staleness` existed ran the synchronous loop: it equals a config
    with k = 0 (and no engine_threads), not one with k = 1."""
    old = "data:\n  init_args:\n    batch_size: 8\n"
    assert config_differences(old, old.replace("8\n", "8\n    max_staleness: 0\n    engine_threads: null\n")) == []
    assert config_differences(old, old.replace("8\n", "8\n    max_staleness: 1\n")) == [
        "data.init_args.max_staleness: 0 != 1"]


def test_a_run_is_of_a_config_whatever_its_length_progress_bar_and_logging_only_callbacks():
    base = ("trainer:\n  max_steps: 160\n  callbacks:\n  - aspo_lit.callbacks.TrainingStats\n"
            "  - aspo_lit.callbacks.CounterfactualWeights\nmodel:\n  lr: 0.0002\n")
    user = base.replace("160", "48\n  enable_progress_bar: true").replace(
        "  - aspo_lit.callbacks.CounterfactualWeights\n", "  - aspo_lit.callbacks.DiagnosticsTQDMProgressBar\n")
    assert config_matches(base, user) == []
    assert config_matches(base, base.replace("0.0002", "0.001")) == ["model.lr: 0.0002 != 0.001"]
    assert "CounterfactualWeights" not in comparable_config(base)


# --------------------------------------------------------------------------- the shipped references

REPO = Path(__file__).resolve().parents[2]
CHECKED_BATCHES = 8  # the first two windows (4 rollout batches each) of the shipped demo reference
BROKEN_BATCHES = 4   # the first window: each broken run departs there already (5, 8 and 2 of 12 metrics)

SHIPPED = {  # reference name: (its seeds, the command line of the config it was made from)
    "demo": ([*range(20), *range(100, 120)], ["--config", "conf/tiny/aspo.yaml"]),
    "testbed_long_aspo": (list(range(10)), ["--config", "conf/tiny/aspo_long.yaml"]),
    "testbed_long_grpo": (list(range(10)), ["--config", "conf/tiny/aspo_long.yaml", "--model.loss=grpo"]),
}


@pytest.mark.parametrize("name", list(SHIPPED))
def test_shipped_reference_is_of_the_shipped_config_and_testbed(name, capsys):
    """Each reference in aspo_lit/references was made from its config as shipped, on the shipped testbed:
    its runs' effective config trains what `--print_config` of that config trains (the keys that differ
    between seeds, the progress bar and the speed settings aside); a config changed without its reference
    made again fails here, as does a testbed shipped anew."""
    from aspo_lit.testbed.shipped import shipped_record

    seeds, args = SHIPPED[name]
    ref = read_reference(name)
    assert ref.seeds == seeds and all(len(m.values) == len(seeds) for m in ref.metrics.values())
    with pytest.raises(SystemExit) as printed:
        main(["fit", *[str(REPO / a) if a.endswith(".yaml") else a for a in args], "--print_config"])
    assert printed.value.code in (0, None)
    assert config_matches(ref.config_text, capsys.readouterr().out) == []
    testbed = "testbed-long" if "long" in name else "testbed"
    assert ref.testbed == f"{testbed} v{shipped_record(testbed)['version']}"


def demo_fit(tmp_path: Path, name: str, seed: int, *extra: str, batches: int = CHECKED_BATCHES) -> Path:
    assert main(["fit", "--config", str(REPO / "conf/tiny/aspo.yaml"), f"--trainer.max_steps={4 * batches}",
                 f"--seed_everything={seed}", f"--trainer.logger.init_args.save_dir={tmp_path}",
                 f"--trainer.logger.init_args.name={name}", "--trainer.logger.init_args.version=0",
                 "--trainer.enable_progress_bar=false", *extra]) == 0
    return tmp_path / name / "version_0"


@pytest.mark.slow
def test_demo_reference_passes_held_out_seeds_and_fails_broken_runs(tmp_path, capsys):
    """The CI check of the shipped demo reference at its own alpha (0.05; on the first two windows 1 of 50
    held-out seeds under five CPU settings departed, docs/compare.md): the first 8 batches of two seeds it was not
    made from pass; three runs broken on purpose (tests/helpers/broken_losses.py, lr x 10) depart in their first
    4 batches, compared on the one window they have."""
    for seed in (1000, 1001):
        run = demo_fit(tmp_path, f"s{seed}", seed)
        assert main(["compare", str(run), "--reference", "demo"]) == 0, capsys.readouterr().out
    broken = {"sign_flipped": (["--model.loss=tests.helpers.broken_losses:ASPOSignFlipped"], "train/kl"),
              "lr_x10": (["--model.lr=2.0e-3"], "train/kl"),
              "unit_ratio": (["--model.loss=tests.helpers.broken_losses:ASPOUnitRatio"], "ratio/off_policy_share")}
    for name, (extra, metric) in broken.items():
        run = demo_fit(tmp_path, name, 1000, *extra, batches=BROKEN_BATCHES)
        capsys.readouterr()
        assert main(["compare", str(run), "--reference", "demo"]) == 1, name
        departed = capsys.readouterr().out.splitlines()[-1]
        assert departed.startswith("DEPARTS") and metric in departed, (name, departed)
