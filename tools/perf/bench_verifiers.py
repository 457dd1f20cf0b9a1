"""How often DeepScaleR's and math-verify's verifiers disagree, and what gold normalisation changes
(docs/grading.md has the figures).

    python -m tools.perf.bench_verifiers [--data-dir DIR] [--testbed] [--json OUT]

On the staged benchmark golds (``$ASPO_DATA_DIR``): each gold written as a model writes it
(Python e-notation printed by sympy's LaTeX printer, Minerva's five code-like golds by hand),
graded against the gold as staged and as loaded (``normalize_gold``); then perturbed answers: the
gold with its last number plus one, and the next problem's gold. Real answers: the Minerva answer
lists DeepScaleR's test set carries (``answer_deepscaler``, written by people), and with
``--testbed`` samples of the CPU testbed model on its held-out arithmetic and the six benchmarks.
Every pair is graded in this process by each verifier alone, with the fast path off.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections import Counter
from pathlib import Path

BENCHMARKS = ["aime24", "aime25", "amc23", "math500", "minerva", "olympiadbench"]
RULES = ["either", "released", "math_verify", "deepscaler"]
BY_HAND = {   # Minerva's code-like golds, as a model writes them
    "np.arcsin(10/13)": "\\sin^{-1}\\left(\\frac{10}{13}\\right)",
    "-1./3": "-\\frac{1}{3}",
    "-3./2": "-\\frac{3}{2}",
    "\\frac{1}{2a}(\\exp{a*t} - \\exp{-a*t})": "\\frac{e^{at}-e^{-at}}{2a}",
    "\\frac{1}{2}(\\exp{a*t} + \\exp{-a*t})": "\\frac{e^{at}+e^{-at}}{2}",
}


def model_written(gold: str) -> str:
    """The gold as a model writes it, independently of ``normalize_gold``."""
    import sympy

    if gold in BY_HAND:
        return BY_HAND[gold]
    if re.fullmatch(r"-?\d+(\.\d*)?[eE][-+]?\d+", gold):
        digits = len(re.sub(r"\D", "", re.split("[eE]", gold)[0]).lstrip("0")) or 1
        return sympy.latex(sympy.Float(gold, digits))
    return gold


def last_number_plus_one(gold: str) -> str | None:
    matches = list(re.finditer(r"\d+", gold))
    if not matches:
        return None
    m = matches[-1]
    return gold[: m.start()] + str(int(m[0]) + 1) + gold[m.end():]


def boxed(answer: str) -> str:
    return "<think>...</think> The final answer is $\\boxed{%s}$." % answer


class Grader:
    """Each rule's verdict, in this process (fast path off)."""

    def __init__(self):
        from aspo_lit.rewards import MathReward

        self.rewards = {v: MathReward(verifier=v, num_workers=0, fast_path=False) for v in RULES}

    def __call__(self, text: str, gold: str) -> dict[str, int]:
        return {v: int(r(text, gold)) for v, r in self.rewards.items()}


def agreement(verdicts: list[dict[str, int]]) -> dict:
    """Counts of (math_verify, deepscaler) verdict pairs, and each rule's acceptances."""
    cells = Counter((v["math_verify"], v["deepscaler"]) for v in verdicts)
    n = len(verdicts)
    return {"n": n, "both": cells[1, 1], "only_math_verify": cells[1, 0], "only_deepscaler": cells[0, 1],
            "neither": cells[0, 0], "disagree_pct": 100 * (cells[1, 0] + cells[0, 1]) / max(n, 1),
            **{f"accept_{v}": sum(x[v] for x in verdicts) for v in RULES}}


def staged(data_dir: Path, name: str) -> list[dict]:
    with open(data_dir / f"{name}.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]


def gold_sections(data_dir: Path, grade: Grader) -> dict:
    from aspo_lit.rewards import normalize_gold

    out = {}
    for name in BENCHMARKS:
        rows = staged(data_dir, name)
        raw = [r["answer"] for r in rows]
        golds = [normalize_gold(g) for g in raw]
        written = [model_written(g) for g in raw]
        before = [grade(boxed(w), g) for w, g in zip(written, raw)]
        after = [grade(boxed(w), g) for w, g in zip(written, golds)]
        plus_one = [(p, g) for p, g in ((last_number_plus_one(g), g) for g in golds) if p is not None]
        nxt = [(a, g) for a, g in zip(golds[1:], golds) if a.strip() != g.strip()]
        out[name] = {
            "golds": len(rows), "normalised": sum(g != r for g, r in zip(golds, raw)),
            "self_fail_before": {v: sum(1 - x[v] for x in before) for v in RULES},
            "self_fail_after": {v: sum(1 - x[v] for x in after) for v in RULES},
            "self": agreement(after),
            "plus_one": agreement([grade(boxed(a), g) for a, g in plus_one]),
            "next_gold": agreement([grade(boxed(a), g) for a, g in nxt]),
        }
        if name == "minerva":
            pairs = [(a, g) for row, g in zip(rows, golds) for a in row.get("answer_deepscaler") or []]
            out["minerva_deepscaler_answers"] = agreement([grade(boxed(a), g) for a, g in pairs])
        print(f"{name}: done", file=sys.stderr, flush=True)
    return out


class Recorder:
    """A reward that keeps what it was asked to grade (the samples), and scores nothing."""

    think_end_token = "</think>"

    def __init__(self):
        self.items: list[tuple[str, str]] = []

    def batch(self, texts, golds):
        self.items += list(zip(texts, golds))
        return [0.0] * len(texts)


def testbed_section(out_dir: Path, grade: Grader) -> dict:
    """Samples of the CPU testbed model (held-out arithmetic, and the six benchmarks' first problems)."""
    from aspo_lit.eval.evaluate import evaluate_model
    from aspo_lit.eval.table_commands import prepare_benchmark_files

    bench = prepare_benchmark_files([{"name": "arith_heldout", "k": 4, "generate": {
        "n": 128, "seed": 0, "levels": [1, 2, 3], "split": "heldout"}}], out_dir)
    benches = bench + [{"name": n, "k": 4, "limit": 25} for n in BENCHMARKS]
    recorder = Recorder()
    evaluate_model("testbed", benches, out_dir / "models", engine="hf", max_tokens=64, seed=0, reward=recorder,
                   temperature=0.8, top_p=1.0)
    return agreement([grade(text, gold) for text, gold in recorder.items])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data-dir", default=os.environ.get("ASPO_DATA_DIR"))
    parser.add_argument("--testbed", action="store_true", help="also grade testbed samples (CPU, minutes)")
    parser.add_argument("--out-dir", default="runs/bench_verifiers")
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args()
    if not args.data_dir:
        sys.exit("give --data-dir or set ASPO_DATA_DIR (the folder of the six staged <name>.jsonl)")
    start = time.perf_counter()
    grade = Grader()
    figures = gold_sections(Path(args.data_dir), grade)
    if args.testbed:
        figures["testbed_samples"] = testbed_section(Path(args.out_dir), grade)
    figures["seconds"] = round(time.perf_counter() - start, 1)
    print(json.dumps(figures, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
