"""A model's results: avg@K and pass@K per benchmark (paper §7.1) and its `results.csv` / `results.md`."""
from __future__ import annotations

import csv
import json
from pathlib import Path

import torch

from aspo_lit.metrics import AvgAtK, PassAtK

RESULT_FIELDS = ["benchmark", "k", "n_problems", "avg@k", "pass@k", "mean_response_tokens",
                 "truncated_frac"]


def benchmark_metrics(correct_counts: list[int], k: int) -> dict[str, float]:
    """avg@K and unbiased pass@K in percent from per-problem correct counts out of K samples."""
    counts = torch.tensor(correct_counts, dtype=torch.long)
    scores = {}
    for name, metric in (("avg@k", AvgAtK()), ("pass@k", PassAtK(k))):
        metric.update(counts, k)
        scores[name] = 100.0 * float(metric.compute())
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
    lines = [f"# {out.name}", "", "| benchmark | K | problems | avg@K | pass@K | mean tokens | "
             "truncated |", "|---|---|---|---|---|---|---|"]
    for r in merged.values():
        lines.append(f"| {r['benchmark']} | {r['k']} | {r['n_problems']} | {r['avg@k']:.1f} | "
                     f"{r['pass@k']:.1f} | {r['mean_response_tokens']:.0f} | "
                     f"{100 * r['truncated_frac']:.1f}% |")
    (out / "results.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
