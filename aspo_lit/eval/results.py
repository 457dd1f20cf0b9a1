"""A model's results: avg@K and pass@K per benchmark (paper §7.1) and its `results.csv` / `results.md`."""
from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import torch

from aspo_lit.maths.metrics import AvgAtK, PassAtK, avg_at_k_se, pass_at_k_se

RESULT_FIELDS = ["benchmark", "k", "n_problems", "avg@k", "avg@k_se", "pass@k", "pass@k_se",
                 "mean_response_tokens", "truncated_frac"]
#: what `benchmark_metrics` adds to avg@K and pass@K (percent): `_se` over response sampling on the
#: benchmark's problems, `_se_problems` with the problems drawn from a population too (aspo_lit.maths.metrics)
SE_FIELDS = ("avg@k_se", "pass@k_se", "avg@k_se_problems", "pass@k_se_problems")


def benchmark_metrics(correct_counts: list[int], k: int) -> dict[str, float | None]:
    """avg@K and unbiased pass@K in percent from per-problem correct counts out of K samples, with
    their standard errors (``SE_FIELDS``; None where not estimable: ``_se_problems`` of one problem)."""
    counts = torch.tensor(correct_counts, dtype=torch.long)
    scores = {}
    for name, metric, se in (("avg@k", AvgAtK(), avg_at_k_se), ("pass@k", PassAtK(k), pass_at_k_se)):
        metric.update(counts, k)
        scores[name] = 100.0 * float(metric.compute())
        errors = se(correct_counts, k)
        for suffix, value in (("_se", errors.se), ("_se_problems", errors.se_problems)):
            scores[name + suffix] = 100.0 * value if math.isfinite(value) else None
    return scores


def write_model_results(out: Path, results: dict[str, dict]) -> None:
    """<out>/results.csv and results.md: one line per benchmark evaluated so far for this model
    (merged with earlier calls' benchmarks, from their done.json files)."""
    merged = dict(results)
    for done in sorted(out.glob("*.done.json")):
        r = json.loads(done.read_text())
        merged.setdefault(r["benchmark"], r)
    with open(out / "results.csv", "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=RESULT_FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(merged.values())
    lines = [f"# {out.name}", "", "| benchmark | K | problems | avg@K ± SE | pass@K ± SE | mean tokens | "
             "truncated |", "|---|---|---|---|---|---|---|"]
    for r in merged.values():
        lines.append(f"| {r['benchmark']} | {r['k']} | {r['n_problems']} | {_with_se(r, 'avg@k')} | "
                     f"{_with_se(r, 'pass@k')} | {r['mean_response_tokens']:.0f} | "
                     f"{100 * r['truncated_frac']:.1f}% |")
    (out / "results.md").write_text("\n".join(lines) + "\n", encoding="utf-8")


def _with_se(result: dict, name: str) -> str:
    se = result.get(f"{name}_se")
    return f"{result[name]:.1f}" + (f" ± {se:.1f}" if se is not None else "")
