"""The study's page and its figures, rendered from :class:`experiments.results.Results`.

The Markdown page (docs/studies/study.md, docs/studies/study-v2.md): the verdicts of the claims
(``experiments.claims``), every run's regime properties (``experiments.regime``: did it learn,
plateau, lose entropy?), the dynamics, accuracy, budget and runs tables. Its figures: the Fig.
2-style overlays (mean ± std over seeds), the Fig. 4 token-weight surfaces of seed 0 of GRPO and
ASPO, and the entropy-mechanism curves per loss when the runs logged them.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from aspo_lit.training.figures import PANELS, ema_smooth
from experiments.claims import Claim, Verdict, judge
from experiments.regime import MIN_RISE, regime_of
from experiments.results import ACCURACY, Results
from experiments.runner import REPO, read_json, run_name

LABELS = {
    "grpo": "GRPO",
    "grpo_no_is": "GRPO w/o IS",
    "grpo_pos_mean": "GRPO w/ Pos. Resp. IS Mean",
    "aspo": "ASPO",
    "aspo_no_dual_clip": "ASPO w/o dual clip",
    "cispo": "CISPO",
    "gspo": "GSPO",
}
#: Paper Table 4 (Qwen3-4B, average over the six math benchmarks), for reference in the table.
PAPER_TABLE4_AVG = {"grpo": 61.6, "grpo_no_is": 63.5, "grpo_pos_mean": 64.0}

#: Figure panels: (metric, title); the accuracy key is resolved from the runs.
STUDY_PANELS = tuple(PANELS) + (("train/grad_norm", "Grad norm"),)
#: the entropy-mechanism diagnostic (aspo_lit.callbacks.EntropyMechanism), when the runs logged it
MECHANISM_PANELS = (("entropy/cov", "Cov(log π_old, A), all tokens"), ("entropy/cov_pos", "its A > 0 part"),
                    ("entropy/cov_neg", "its A < 0 part"), ("entropy/measured_change", "entropy change of the updates"))
#: Plotted raw (spikes are the point of Fig. 8).
UNSMOOTHED = ("train/grad_norm",)
#: Training metrics tabulated in the report (first 20% -> last 20% of logged steps).
DYNAMICS = ("train/entropy", "train/repetition_rate", "clip/pos_high", "train/kl", "train/reward_mean")


def label(loss: str) -> str:
    return LABELS.get(loss, loss)


def show_path(path: str | os.PathLike) -> str:
    """A path relative to the repository when it lies inside it, else absolute."""
    path = Path(path).resolve()
    try:
        return str(path.relative_to(REPO))
    except ValueError:
        return str(path)


# =========================================================================== figures

def seed_band(curves: Sequence[tuple[np.ndarray, np.ndarray]]) -> pd.DataFrame:
    """Mean, std (0 for a single seed) and seed count at every step any seed logged."""
    frame = pd.concat([pd.DataFrame({"step": steps, "value": values}) for steps, values in curves])
    band = frame.groupby("step")["value"].agg(["mean", "std", "count"])
    band["std"] = band["std"].fillna(0.0)
    return band


def plot_overlays(results: Results, path: Path, panels: Sequence[tuple[str | None, str]] = STUDY_PANELS,
                  grid: tuple[int, int] = (2, 3), title: str | None = None) -> Path:
    """Fig. 2-style panels (``panels``: ``(metric, title)``, None = held-out accuracy), one line per
    loss: mean over seeds, band = ± 1 std over seeds. Train curves are EMA-smoothed per seed
    (``smooth``) before averaging; accuracy and grad norm are not."""
    from matplotlib.figure import Figure  # no pyplot: no global backend state

    study = results.study
    fig = Figure(figsize=(5 * grid[1], 4 * grid[0]), layout="constrained")
    axes = fig.subplots(*grid, squeeze=False).reshape(-1)
    for ax, (key, title_) in zip(axes, panels):
        is_accuracy = key is None
        key = results.accuracy_key if is_accuracy else key
        for i, loss in enumerate(study.losses):
            curves = []
            for seed in study.seeds:
                series = results.series(run_name(loss, seed), key)
                if series is None or not len(series[0]):
                    continue
                steps, values = series
                if is_accuracy:  # start every curve at the untrained model's accuracy (step 0)
                    base = results.series(run_name("base", seed), key)
                    if base is not None and len(base[1]) and (not len(steps) or steps[0] > 0):
                        steps, values = np.r_[0.0, steps], np.r_[base[1][-1], values]
                elif key not in UNSMOOTHED:
                    values = ema_smooth(values, study.smooth)
                curves.append((steps, values))
            if not curves:
                continue
            band = seed_band(curves)
            steps, mean, std = band.index.to_numpy(), band["mean"].to_numpy(), band["std"].to_numpy()
            color = f"C{i}"
            ax.plot(steps, mean, color=color, lw=1.5, label=f"{label(loss)} (n={len(curves)})",
                    marker="o" if is_accuracy else None, ms=3)
            ax.fill_between(steps, mean - std, mean + std, color=color, alpha=0.15, lw=0)
        ylabel = key if not is_accuracy else f"{key} (held-out)"
        ax.set(title=title_ if not is_accuracy else f"Held-out accuracy (avg@{results.val_k})",
               xlabel="training step (rollout batch, as logged)", ylabel=ylabel)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title or (f"{study.name}: mean ± 1 std over seeds {study.seeds}"
                           f" (train curves EMA {study.smooth:g}, grad norm raw); accuracy at step 0 = untrained testbed"))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def copy_fig4(results: Results, figures_dir: Path) -> dict[str, Path]:
    """The last token-weight surface of the first seed of grpo and aspo -> ``fig4_<loss>.png``."""
    def order(path: Path) -> tuple[int, int]:
        match = re.search(r"step(\d+)", path.name)
        version = re.search(r"version_(\d+)", str(path))
        return int(match.group(1)) if match else -1, int(version.group(1)) if version else -1

    out = {}
    seed = results.study.seeds[0]
    for loss in ("grpo", "aspo"):
        if loss not in results.study.losses:
            continue
        run_dir = results.study.runs_dir / run_name(loss, seed)
        found = sorted(Path(run_dir).glob("version_*/figures/token_weights_step*.png"), key=order)
        if found:
            target = figures_dir / f"fig4_{loss}.png"
            figures_dir.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(found[-1], target)
            out[loss] = target
    return out


# =========================================================================== formatting

def fmt(x: float | None, pct: bool = False) -> str:
    """3 significant digits (accuracy in % with one decimal); n/a for NaN."""
    if x is None or not math.isfinite(x):
        return "n/a"
    return f"{x:.1f}" if pct else f"{x:.3g}"


def mean_std(values: Sequence[float], scale: float = 1.0) -> str:
    """``mean ± std`` over seeds (sample std; ``(n=1)`` for one value; NaN dropped)."""
    v = pd.Series(values, dtype=np.float64).dropna() * scale
    pct = scale != 1.0
    if v.empty:
        return "n/a"
    if len(v) == 1:
        return f"{fmt(v.iloc[0], pct)} (n=1)"
    mean, std = float(np.mean(v)), float(np.std(v, ddof=1))
    if std < 1e-9 * max(1.0, abs(mean)):
        std = 0.0
    return f"{fmt(mean, pct)} ± {fmt(std, pct)}"


def slashed(values: Sequence[float], scale: float = 1.0) -> str:
    """Per-seed values, ``a / b / c``."""
    return " / ".join(fmt(x * scale, scale != 1.0) for x in values)


def markdown(table: pd.DataFrame) -> list[str]:
    """A Markdown table (cells kept as formatted) and a blank line."""
    return [table.to_markdown(index=False, disable_numparse=True), ""]


def get(d: Any, *keys, default=None):
    for k in keys:
        if not isinstance(d, Mapping) or k not in d:
            return default
        d = d[k]
    return d


# =========================================================================== the report's sections

def header_section(results: Results, figures: Mapping[str, Path]) -> list[str]:
    study = results.study
    cmd = "python -m aspo_lit study" + (f" --config {show_path(study.path)}" if study.path else "")
    lines = [
        f"# The CPU-scale study: {study.name}",
        "",
        f"_Generated by `{cmd}` on {time.strftime('%Y-%m-%d %H:%M')}; do not edit by hand "
        f"(`--report_only true` re-renders it from `{show_path(study.out_dir)}`)._",
        "",
        "Does the mechanism of the paper (Sec. 4-7) show up on the CPU testbed? Every loss is trained "
        "with identical data, seeds and budget on the tiny arithmetic testbed model; nothing is tuned "
        "per loss. This page reports what was measured; a claim that does not reproduce at this "
        "scale is a finding about the testbed, not a statement about the paper's setting.",
        "",
    ]
    return lines + ([str(study.description).strip(), ""] if study.description else [])


def claim_line(results: Results, claim: Claim, v: Verdict) -> str:
    study = results.study
    metric = f"val/avg@{results.val_k}" if claim.metric == ACCURACY else claim.metric
    stat = {"tail_mean": f"last-{study.tail_fraction:.0%} mean", "last_eval": "last evaluation",
            "max": "max over the run"}[claim.statistic]
    scale = 100.0 if claim.metric == ACCURACY else 1.0
    pct, unit = scale != 1.0, " (%)" if scale != 1.0 else ""
    missing = [x for x in (claim.higher, claim.lower) if x not in study.losses]
    if missing:
        return (f"* **({claim.id}) {claim.text}** ({claim.source}) — **{v.verdict}**: "
                f"not tested: {', '.join(label(x) for x in missing)} not in this study.")
    hi = results.per_seed(claim.higher, claim.metric, claim.statistic)
    lo = results.per_seed(claim.lower, claim.metric, claim.statistic)
    if v.verdict == "no data":
        detail = f"no finished run logged `{claim.metric}` for {label(claim.higher)} and/or {label(claim.lower)}"
    else:
        detail = (f"`{metric}`{unit} ({stat}) {label(claim.higher)} {mean_std(hi, scale)} vs {label(claim.lower)} "
                  f"{mean_std(lo, scale)} (n = {v.n_higher}/{v.n_lower}); difference {fmt(v.diff * scale, pct)}, "
                  f"2×SE = {fmt(v.margin * scale, pct)}, Welch p = {fmt(v.p_value)}")
    values = np.concatenate([hi, lo])
    values = values[np.isfinite(values)]
    if len(values) > 1 and values.max() == values.min():
        detail += f" — no signal: the metric is {fmt(values[0])} in every run"
    elif len(values) and all(math.isfinite(a) and a == b for a, b in zip(hi, lo)):
        detail += " — the two losses gave identical values for every seed"
    return f"* **({claim.id}) {claim.text}** ({claim.source}) — **{v.verdict}**: {detail}."


def verdict_section(results: Results, figures: Mapping[str, Path]) -> list[str]:
    judged = judge(results)
    counts = pd.Series([v.verdict for _, v in judged]).value_counts(sort=False).sort_values(ascending=False,
                                                                                              kind="stable")
    return ["## Verdicts per claim", "",
            "Decision rule: for every seed, the *final* value of the metric — the mean over the last "
            f"{results.study.tail_fraction:.0%} of the logged training steps for training metrics, the last "
            "held-out evaluation for accuracy, and the maximum over the run for the grad norm of "
            "claim 7 — then the difference of the two losses' means over seeds. **supported** when "
            "it is in the claimed direction and larger than 2 × the pooled standard error "
            "(pooled variance, SE = s_p·√(1/n₁ + 1/n₂)); **not supported** when it is in the opposite "
            "direction by that margin; **inconclusive** otherwise (and with fewer than 2 seeds). "
            "Each line also gives the two-sided p-value of Welch's t-test (unequal variances) of the "
            "same difference, as information: the 2·SE rule decides, and no correction for the "
            "number of claims is applied.", "",
            "Summary: " + ", ".join(f"{n} {w}" for w, n in counts.items()) + f" (of {len(judged)} claim lines).", "",
            *(claim_line(results, claim, v) for claim, v in judged), ""]


def dynamics_table(results: Results) -> pd.DataFrame:
    """Per loss: first → last ``tail_fraction`` of each DYNAMICS metric, grad norm mean and max,
    and the runs' health verdicts (mean ± std over seeds)."""
    columns = {f"{m} head": (m, "head_mean") for m in DYNAMICS} | {f"{m} tail": (m, "tail_mean") for m in DYNAMICS}
    columns |= {"train/grad_norm mean": ("train/grad_norm", "mean"), "train/grad_norm max": ("train/grad_norm", "max")}
    summary = results.by_seed(columns).groupby(level="loss", sort=False).agg(mean_std)
    health = results.runs[results.runs["kind"] == "fit"].fillna({"health": "n/a"}).groupby("loss")["health"].agg(
        lambda h: ", ".join(f"{n}× {w}" for w, n in h.value_counts().sort_index().items()))
    table = pd.DataFrame({"loss": [label(loss) for loss in summary.index]})
    for m in DYNAMICS:
        table[m] = (summary[f"{m} head"] + " → " + summary[f"{m} tail"]).to_numpy()
    for name in ("train/grad_norm mean", "train/grad_norm max"):
        table[name] = summary[name].to_numpy()
    table["health"] = health.reindex(summary.index).to_numpy()
    return table


def regime_lines(results: Results) -> list[str]:
    """How far off-policy the updates were: the range of the per-step mean IS ratios and the
    largest dual-clip fractions over all finished runs (what the losses can differ on)."""
    keys = ("ratio/pos_mean", "ratio/neg_mean", "clip/pos_dual", "clip/neg_dual")
    m = results.metrics
    spans = m[m["run"].isin(results.fit_names) & m["metric"].isin(keys)].groupby("metric")["value"].agg(["min", "max"])
    if not {"ratio/pos_mean", "ratio/neg_mean"} & set(spans.index):
        return []

    def span(key: str) -> str:
        return f"[{fmt(spans.at[key, 'min'])}, {fmt(spans.at[key, 'max'])}]" if key in spans.index else "[n/a, n/a]"

    text = ("Off-policy regime, over every step of every run: the mean IS ratio of the A > 0 tokens "
            f"(`ratio/pos_mean`) stayed within {span('ratio/pos_mean')}, of the A < 0 tokens (`ratio/neg_mean`) "
            f"within {span('ratio/neg_mean')}")
    dual = [k for k in ("clip/pos_dual", "clip/neg_dual") if k in spans.index]
    if dual:
        text += ("; the largest share of dual-clipped tokens in a step was "
                 + ", ".join(f"{fmt(spans.at[k, 'max'])} (`{k}`)" for k in dual))
    return [text + ".", ""]


def profile_lines(results: Results) -> list[str]:
    """The profile's measured properties, from the runs themselves, beside the targets it was
    designed to (``docs/studies/testbed-long.md``; a study's own criteria are in its protocol)."""
    first = results.by_seed({"entropy": ("train/entropy", "first"), "length": ("response/length_mean", "first")})
    entropy = first["entropy"].dropna()
    if entropy.empty:
        return []
    peaks = results.by_seed({"peak": ("clip/pos_high", "max")})["peak"].groupby(level="loss", sort=False).agg(
        [slashed, lambda p: f"{int((p >= 0.05).sum())} of {int(p.notna().sum())}"])
    table = pd.DataFrame({"loss": [label(loss) for loss in peaks.index],
                          "max `clip/pos_high` per seed": peaks.iloc[:, 0].to_numpy(),
                          "runs reaching 5 %": peaks.iloc[:, 1].to_numpy()})
    return [f"Profile properties measured in these runs, beside the design targets of `testbed-long` "
            f"(docs/studies/testbed-long.md): the first rollout batch's mean token entropy "
            f"(`train/entropy`) {mean_std(entropy)} nats (design target ≥ 0.5), its mean "
            f"response length {mean_std(first['length'])} tokens (target 80–300) "
            f"over {len(entropy)} runs. The share of A > 0 tokens with r > 1 + ε "
            "(`clip/pos_high`), maximum over the steps of a run (design target ≥ 5 % at some step):", "",
            *markdown(table)]


def per_seed_table(results: Results) -> pd.DataFrame:
    """The per-seed values entering the verdicts."""
    columns = [("train/entropy", "tail_mean", 1.0), ("train/repetition_rate", "tail_mean", 1.0),
               ("clip/pos_high", "tail_mean", 1.0), ("train/kl", "tail_mean", 1.0),
               ("train/grad_norm", "max", 1.0), (ACCURACY, "last_eval", 100.0)]
    table = pd.DataFrame({"loss": [label(loss) for loss in results.study.losses]})
    for metric, statistic, scale in columns:
        name = f"{metric if metric != ACCURACY else results.accuracy_key} ({'max' if statistic == 'max' else 'final'})"
        table[name] = [slashed(results.per_seed(loss, metric, statistic), scale) for loss in results.study.losses]
    return table


def dynamics_section(results: Results, figures: Mapping[str, Path]) -> list[str]:
    study = results.study
    lines = ["## Training dynamics (Fig. 2 style)", ""]
    if "overlays" in figures:
        lines += [f"![Fig. 2-style overlays]({os.path.relpath(figures['overlays'], study.report.parent)})", "",
                  f"One line per loss: the mean over seeds {study.seeds}, the band ± 1 std over seeds. "
                  f"Training curves are smoothed per seed with an EMA of weight {study.smooth:g} for "
                  "display (the grad norm is raw; the verdicts use the raw values). Held-out accuracy starts at "
                  "the untrained model's accuracy (step 0, the `validate` run of the same seed). The grad-norm panel "
                  "is Fig. 8's quantity (ASPO with vs without dual clip).", ""]
    lines += ["Final values (mean ± std over seeds; first → last "
              f"{study.tail_fraction:.0%} of logged steps; grad norm: mean and max over the run):", "",
              *markdown(dynamics_table(results)),
              "`health` is each run's `health.json` verdict (`HealthMonitor`, App. D: healthy / watch / "
              "collapsed).", ""]
    lines += regime_lines(results) + profile_lines(results)
    return lines + [f"Per-seed values entering the verdicts (seeds {' / '.join(map(str, study.seeds))}; "
                    "accuracy in %):", "", *markdown(per_seed_table(results))]


def fig4_section(results: Results, figures: Mapping[str, Path]) -> list[str]:
    lines = ["## Token-weight surfaces (Fig. 4)", ""]
    if not (figures.get("fig4_grpo") or figures.get("fig4_aspo")):
        return lines + ["No token-weight figure was found (grpo/aspo not in the study or not run).", ""]
    lines += [f"The last `token_weights_step*.png` of seed {results.study.seeds[0]}: the mean effective "
              "token weight per (π_old, π) bin, A > 0 left, A < 0 right (the last window of steps only). "
              "What the paper's Fig. 4 shows off the diagonal: GRPO's A > 0 weight grows toward "
              "the top-left (π ≫ π_old), ASPO's flipped weight toward the bottom-right. How far "
              "tokens get from the diagonal at all is the off-policy regime line above.", ""]
    for loss in ("grpo", "aspo"):
        if figures.get(f"fig4_{loss}"):
            link = os.path.relpath(figures[f"fig4_{loss}"], results.study.report.parent)
            lines += [f"**{label(loss)}**", "", f"![Fig. 4 {label(loss)}]({link})", ""]
    return lines


def accuracy_section(results: Results, figures: Mapping[str, Path]) -> list[str]:
    k = results.val_k
    rows = [("initial model (testbed, before RL)", "base", "")]
    rows += [(label(loss), loss, PAPER_TABLE4_AVG.get(loss, "")) for loss in results.study.losses]
    acc = {loss: results.per_seed(loss, results.accuracy_key, "last_eval") for _, loss, _ in rows}
    table = pd.DataFrame({
        "model": [name for name, _, _ in rows],
        f"avg@{k}": [mean_std(acc[loss], 100) for _, loss, _ in rows],
        f"pass@{k}": [mean_std(results.per_seed(loss, results.pass_key, "last_eval"), 100) for _, loss, _ in rows],
        "seeds": [str(int(np.isfinite(acc[loss]).sum())) for _, loss, _ in rows],
        "paper Table 4 avg": [str(paper) for _, _, paper in rows]})
    return ["## Final held-out accuracy (Table 4 style)", "",
            f"Last evaluation of each run on the held-out arithmetic split, K = {k} samples per "
            "problem; mean ± std over seeds, in %. The paper's Table 4 (Qwen3-4B, average over six "
            "math benchmarks) is shown for the losses it has — a different model and task, for the "
            "direction only.", "", *markdown(table)]


def task(data: Mapping) -> str:
    """The testbed task of a run's data section, in words."""
    if data.get("ops") is not None:
        return f"multi-step chains of {data['ops']} operations (values 0–{data.get('max_value', 99)})"
    return f"arithmetic levels {data.get('levels')}"


def settings_lines(results: Results) -> list[str]:
    """The runs' settings, from the first fit run's saved config."""
    study, cfg = results.study, results.config
    data = get(cfg, "data", "init_args", default={}) or {}
    model = get(cfg, "model", default={}) or {}
    trainer = get(cfg, "trainer", default={}) or {}
    batch, mini, epochs = data.get("batch_size"), model.get("mini_batch_size"), model.get("ppo_epochs", 1)
    per_batch = (batch // mini) * epochs if batch and mini else None
    lines = [
        f"* Runs: {len(study.losses)} losses × {len(study.seeds)} seeds = {len(results.fit_names)} `fit` runs"
        + (f" + {len(study.seeds)} `validate` runs of the untrained testbed" if study.base_eval else "")
        + f"; every run: `trainer.max_steps={study.max_steps}` optimizer steps.",
    ]
    if per_batch:
        lines += [
            f"* Per run: {study.max_steps // per_batch} rollout batches × {batch} prompts × G = "
            f"{data.get('group_size')} responses (≤ {data.get('max_response_length')} tokens, temperature "
            f"{data.get('temperature')}); {per_batch} optimizer steps per rollout batch (mini-batch {mini} prompts, "
            f"ppo_epochs {epochs}); lr {model.get('lr')}, ε = {get(model, 'loss_kwargs', 'eps_high', default='?')}, "
            f"dual clip {get(model, 'loss_kwargs', 'dual_clip', default='?')}, KL β = {model.get('kl_coef')}.",
            f"* Data: {task(data)}, {data.get('num_train')} training problems; "
            f"held-out evaluation on {data.get('num_val')} problems × K = {data.get('val_k')} samples at "
            f"temperature {data.get('val_temperature')}, every {trainer.get('val_check_interval')} rollout "
            f"batches and at the end. A logged step (the figures' x axis) is one rollout batch."]
    path = model.get("model_name_or_path")
    if path:
        folder = Path(str(path)).is_dir()
        meta = read_json(Path(path) / "testbed.json") if folder else {}
        extra = (f" ({meta.get('num_parameters', 0) / 1e6:.2f}M parameters, warm-started for "
                 f"{meta.get('sft_steps')} SFT steps)") if meta else ""
        testbeds = sorted({inv["testbed"] for inv in results.invocations if inv.get("testbed")})
        named = f"; testbed: {', '.join(testbeds)} (docs/testbed.md)" if testbeds else ""
        lines.append(f"* Model: `{show_path(path) if folder else path}`{extra}, the same folder for every run{named}.")
    if study.executor == "slurm":
        lines.append(f"* Parallelism: a SLURM job array, {study.jobs} runs at a time, {study.threads_per_job} "
                     "thread(s) each (`OMP_NUM_THREADS`).")
    else:
        lines.append(f"* Parallelism: {study.jobs} runs at a time, {study.threads_per_job} thread(s) each "
                     f"(`OMP_NUM_THREADS`), on a machine with {os.cpu_count()} cores.")
    return lines


def timing_lines(results: Results) -> list[str]:
    """Measured wall times, response lengths and per-batch timings."""
    fits = results.runs[(results.runs["kind"] == "fit") & (results.runs["wall_s"].fillna(0) > 0)]
    per_run = results.stats.reindex(pd.MultiIndex.from_product(
        [results.fit_names, ["timing/step_s", "timing/rollout_s", "response/length_mean", "response/length_max"]]))
    means = per_run["mean"].groupby(level=1).agg("mean")
    lines = []
    if len(fits):
        walls = fits["wall_s"].astype(float) / 60
        by_loss = walls.groupby(fits["loss"]).mean().reindex(results.study.losses).dropna()
        lines.append(f"* Measured wall time per `fit` run: mean {walls.mean():.1f} min "
                     f"(min {walls.min():.1f}, max {walls.max():.1f}); per loss: "
                     + ", ".join(f"{label(k)} {v:.1f}" for k, v in by_loss.items()) + " min.")
    if pd.notna(means.get("response/length_mean")):
        longest = per_run["max"].xs("response/length_max", level=1).max()
        lines.append(f"* Measured response length: {means['response/length_mean']:.1f} tokens on average, longest "
                     f"{fmt(longest)} (`response/length_mean`, `response/length_max`).")
    if pd.notna(means.get("timing/step_s")) and pd.notna(means.get("timing/rollout_s")):
        lines.append(f"* Mean time per rollout batch: generation {means['timing/rollout_s']:.1f} s "
                     f"(`timing/rollout_s`) + old log-probs and updates {means['timing/step_s']:.1f} s "
                     "(`timing/step_s`).")
    if results.invocations:
        total = sum(inv.get("wall_s", 0.0) for inv in results.invocations)
        loads = [inv.get("load_start") for inv in results.invocations if inv.get("load_start") is not None]
        lines.append(
            f"* Measured wall time of the study: {total / 60:.1f} min over {len(results.invocations)} "
            f"invocation(s) of `python -m aspo_lit study` (load average at start: "
            + ", ".join(f"{x:.1f}" for x in loads) + ").")
    return lines


def budget_section(results: Results, figures: Mapping[str, Path]) -> list[str]:
    return ["## Budget and wall time", "", *settings_lines(results), *timing_lines(results), ""]


def runs_section(results: Results, figures: Mapping[str, Path]) -> list[str]:
    lines = ["## Runs", "",
             f"Runs, logs and markers under `{show_path(results.study.out_dir)}` "
             "(`runs/<name>/version_*/metrics.csv`, `logs/<name>.log`).", ""]
    problems = results.runs[results.runs["status"] != "done"]
    if problems.empty:
        return lines + [f"All {len(results.runs)} runs finished.", ""]
    for name, run in problems.iterrows():
        if run["status"] == "failed":
            lines.append(f"* `{name}`: **failed** (exit {run['rc']}), log `{run['log']}`")
        else:
            lines.append(f"* `{name}`: {run['status']} (not finished, left out of the figures and verdicts; "
                         "rerun the study to resume it)")
    return lines + [""]


def mechanism_section(results: Results, figures: Mapping[str, Path]) -> list[str]:
    """The entropy-mechanism diagnostic per loss (only when the runs logged it)."""
    if "mechanism" not in figures:
        return []
    study = results.study
    link = os.path.relpath(figures["mechanism"], study.report.parent)
    keys = [key for key, _ in MECHANISM_PANELS]
    table = pd.DataFrame({"loss": [label(loss) for loss in study.losses]})
    for key in keys:
        table[f"{key} (first → last {study.tail_fraction:.0%})"] = [
            f"{fmt(np.nanmean(results.per_seed(loss, key, 'head_mean')))} → "
            f"{fmt(np.nanmean(results.per_seed(loss, key, 'tail_mean')))}" for loss in study.losses]
    return ["## Entropy mechanism (Cui et al. 2025)", "",
            f"![entropy mechanism]({link})", "",
            "`aspo_lit.callbacks.EntropyMechanism` (docs/metrics.md): per rollout batch, the covariance "
            "between a response token's log-probability under π_old and its advantage, whose negative "
            "is the first-order entropy change of a policy-gradient step, split by the advantage's "
            "sign, and the entropy change the batch's updates measured on the same tokens. Means over "
            "seeds of each run's first and last values:", "", *markdown(table)]


def regime_section(results: Results, figures: Mapping[str, Path]) -> list[str]:
    """The regime properties of every finished fit (experiments.regime), and over seeds per loss."""

    study = results.study
    rows, per_loss = [], {}
    for loss in study.losses:
        for seed in study.seeds:
            name = run_name(loss, seed)
            base = results.series(run_name("base", seed), results.accuracy_key)
            if name not in results.runs.index or results.runs.at[name, "status"] != "done" or base is None:
                continue
            r = regime_of(results.metrics[results.metrics["run"] == name], name, acc0=100 * float(base[1][-1]))
            per_loss.setdefault(loss, []).append(r)
            rows.append({"run": name, "acc0 → best / last (%)": f"{r.acc0:.1f} → {r.acc_best:.1f} / {r.acc_last:.1f}",
                         "rise": f"{r.rise:+.1f}", "entropy decline": f"{r.entropy_decline:+.4f}",
                         "ratio gap": f"{r.ratio_gap:+.2e}", "plateau": "yes" if r.plateau else "no"})
    if not rows:
        return []
    summary = []
    for loss, regimes in per_loss.items():
        decline = np.array([r.entropy_decline for r in regimes])
        se = float(decline.std(ddof=1) / math.sqrt(len(decline))) if len(decline) > 1 else math.nan
        summary.append({"loss": label(loss), "runs": str(len(regimes)),
                        f"rise >= {MIN_RISE:g}": f"{sum(r.rise >= MIN_RISE for r in regimes)}/{len(regimes)}",
                        "rise (points)": mean_std([r.rise for r in regimes]),
                        "entropy decline": f"{fmt(decline.mean())} (2 SE {fmt(2 * se)})",
                        "> 2 SE": "yes" if math.isfinite(se) and decline.mean() > 2 * se else "no",
                        "ratio gap": fmt(float(np.mean([r.ratio_gap for r in regimes]))),
                        "plateau": f"{sum(r.plateau for r in regimes)}/{len(regimes)}"})
    return ["## The regime, per run (`python -m experiments.regime`)", "",
            "Did each run show the paper's GRPO dynamics (the properties of docs/studies/study-protocol-v2.md)? "
            "Measured on every finished run: the best held-out evaluation minus the untrained model's (same seed), "
            "the mean entropy of the first minus the last 20 % of rollout batches, the mean of "
            "`ratio/pos_mean - ratio/neg_mean`, and whether the last evaluation is at most 1 point "
            "above the best earlier one (plateau). Over seeds:", "",
            *markdown(pd.DataFrame(summary)), "Per run:", "", *markdown(pd.DataFrame(rows))]


SECTIONS: tuple[Callable[[Results, Mapping[str, Path]], list[str]], ...] = (
    header_section, verdict_section, regime_section, dynamics_section, mechanism_section, fig4_section,
    accuracy_section, budget_section, runs_section)


def render_report(results: Results, figures: Mapping[str, Path]) -> str:
    """The Markdown report (figures given as paths; links are written relative to the report)."""
    return "\n".join(line for section in SECTIONS for line in section(results, figures))
