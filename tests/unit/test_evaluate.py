"""Evaluation (resume, never recompute), Table 1 rendering, benchmark loading, checkpoint export."""
from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest

from aspo_lit.eval.datasets import BENCHMARKS, load_benchmark
from aspo_lit.eval.evaluate import evaluate_model
from aspo_lit.eval.records import read_sample_records
from aspo_lit.eval.reference import (
    PAPER_SOURCE,
    REFERENCES,
    ReferenceCell,
    ReferenceError,
    load_reference,
    reference_from_csv,
    verdict,
)
from aspo_lit.eval.tables import TABLES, load_paper_table, render_table1
from aspo_lit.maths.metrics import avg_at_k_se, pass_at_k_se
from aspo_lit.prompts import INSTRUCTION, build_prompt
from aspo_lit.training.export import export_checkpoint
from tests.helpers.engines import FakeEngine
from tests.helpers.tolerance import approx64  # float64 maths, O(1)-O(100) values: docs/design.md, "Tolerances in tests"

PAPER_COUNTS = {"aime24": 30, "aime25": 30, "amc23": 40, "math500": 500, "minerva": 272,
                "olympiadbench": 675}


# --- a fake reward implementing the contract (docs/design.md); the engine: tests/helpers/engines.py ------

class ExactReward:
    think_end_token = "</think>"

    def batch(self, texts, golds):
        return [float(t.endswith(f"\\boxed{{{g}}}")) for t, g in zip(texts, golds)]


class ExplodingEngine(FakeEngine):
    def attach(self, *a):
        raise AssertionError("a finished (model, benchmark) pair must not load the model")

    def generate(self, *a, **k):
        raise AssertionError("a finished (model, benchmark) pair must not be recomputed")


@pytest.fixture
def arith(tmp_path):
    rows = [{"id": f"p{i}", "problem": f"what is {i}+{i}?", "answer": str(2 * i)} for i in range(6)]
    path = tmp_path / "arith.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"name": "arith", "path": str(path), "k": 4}, {r["problem"]: r["answer"] for r in rows}


def _run(model_dir, bench, answers, out, engine=None, **kw):
    engine = engine or FakeEngine(answers)
    kw.setdefault("samples_per_call", 4)
    return evaluate_model(str(model_dir), [bench], out, engine=engine, reward=ExactReward(),
                          max_tokens=16, **kw), engine


def _records(out: Path, name="arith"):
    lines = [json.loads(x) for x in next(out.glob(f"*/{name}.samples.jsonl")).read_text().splitlines()]
    return lines


# --- resume ------------------------------------------------------------------------------------

def test_killed_evaluation_resumes_without_duplicates_or_losses(tmp_path, tiny_model_dir, arith):
    bench, answers = arith
    reference, _ = _run(tiny_model_dir, bench, answers, tmp_path / "ref")

    killed = FakeEngine(answers, fail_on_call=4)   # one problem per call: dies after 3 problems
    with pytest.raises(RuntimeError, match="killed"):
        _run(tiny_model_dir, bench, answers, tmp_path / "run", engine=killed)
    partial = _records(tmp_path / "run")
    assert len(partial) == 3 * 4
    assert not list((tmp_path / "run").glob("*/arith.done.json"))

    resumed, engine = _run(tiny_model_dir, bench, answers, tmp_path / "run")
    assert engine.prompts == 3                      # only the 3 unfinished problems
    records = _records(tmp_path / "run")
    keys = [(r["problem_id"], r["sample_index"]) for r in records]
    assert len(keys) == len(set(keys)) == 6 * 4     # no duplicate, no lost sample
    assert set(keys) == {(f"p{i}", s) for i in range(6) for s in range(4)}
    ref = {(r["problem_id"], r["sample_index"]): r for r in _records(tmp_path / "ref")}
    assert all(ref[(r["problem_id"], r["sample_index"])] == r for r in records)
    assert resumed["arith"]["avg@k"] == approx64(reference["arith"]["avg@k"])
    assert resumed["arith"]["pass@k"] == approx64(reference["arith"]["pass@k"])
    # final counts: recomputed from the records by hand
    correct = {}
    for r in records:
        correct[r["problem_id"]] = correct.get(r["problem_id"], 0) + r["correct"]
    assert resumed["arith"]["avg@k"] == approx64(100 * sum(correct.values()) / 24)
    assert resumed["arith"]["pass@k"] == approx64(100 * sum(c > 0 for c in correct.values()) / 6)
    # and their standard errors, from the same counts (aspo_lit.maths.metrics; tests/unit/test_metrics.py)
    counts = list(correct.values())
    assert resumed["arith"]["avg@k_se"] == approx64(100 * avg_at_k_se(counts, 4).se)
    assert resumed["arith"]["pass@k_se_problems"] == approx64(100 * pass_at_k_se(counts, 4).se_problems)


def test_torn_last_line_is_dropped_and_resampled(tmp_path, tiny_model_dir, arith):
    bench, answers = arith
    with pytest.raises(RuntimeError):
        _run(tiny_model_dir, bench, answers, tmp_path, engine=FakeEngine(answers, fail_on_call=3))
    path = next(tmp_path.glob("*/arith.samples.jsonl"))
    text = path.read_text()
    path.write_text(text[: len(text) - 25])         # killed in the middle of a write
    assert len(read_sample_records(path)) == 7
    result, engine = _run(tiny_model_dir, bench, answers, tmp_path)
    keys = [(r["problem_id"], r["sample_index"]) for r in _records(tmp_path)]
    assert len(keys) == len(set(keys)) == 24
    assert engine.prompts == 5                      # p1 (one sample lost) + p2..p5
    assert result["arith"]["n_problems"] == 6


def test_larger_k_samples_only_the_missing_indices(tmp_path, tiny_model_dir, arith):
    bench, answers = arith
    _run(tiny_model_dir, {**bench, "k": 2}, answers, tmp_path)
    result, engine = _run(tiny_model_dir, {**bench, "k": 4}, answers, tmp_path)
    assert engine.prompts == 6 and result["arith"]["k"] == 4
    keys = [(r["problem_id"], r["sample_index"]) for r in _records(tmp_path)]
    assert len(keys) == len(set(keys)) == 24


def test_finished_pair_is_not_recomputed(tmp_path, tiny_model_dir, arith):
    bench, answers = arith
    first, _ = _run(tiny_model_dir, bench, answers, tmp_path)
    again, _ = _run(tiny_model_dir, bench, answers, tmp_path, engine=ExplodingEngine(answers))
    assert again == first
    model_dir = next(tmp_path.glob("*/arith.done.json")).parent
    with open(model_dir / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert rows[0]["benchmark"] == "arith" and float(rows[0]["avg@k"]) == approx64(first["arith"]["avg@k"])
    assert "| arith | 4 | 6 |" in (model_dir / "results.md").read_text()


def test_a_finished_pair_without_ses_gets_them_from_its_records(tmp_path, tiny_model_dir, arith):
    """A done.json written before the standard errors: they are computed from the records, nothing is
    sampled again."""
    bench, answers = arith
    first, _ = _run(tiny_model_dir, bench, answers, tmp_path)
    done_path = next(tmp_path.glob("*/arith.done.json"))
    old = {k: v for k, v in json.loads(done_path.read_text()).items() if "_se" not in k}
    done_path.write_text(json.dumps(old))
    again, _ = _run(tiny_model_dir, bench, answers, tmp_path, engine=ExplodingEngine(answers))
    assert again == first and again["arith"]["avg@k_se"] is not None
    assert "| arith | 4 | 6 | " in (done_path.parent / "results.md").read_text() and " ± " in \
        (done_path.parent / "results.md").read_text()


def test_other_sampling_settings_are_not_mixed_in(tmp_path, tiny_model_dir, arith):
    bench, answers = arith
    _run(tiny_model_dir, bench, answers, tmp_path)
    with pytest.raises(ValueError, match="temperature"):
        _run(tiny_model_dir, bench, answers, tmp_path, temperature=1.0)


def test_fit_batches_draw_and_resume_whole_calls(tmp_path, tiny_model_dir, arith):
    """`fit_batches` (a fit's validation, `evaluate --like_fit`): calls of B consecutive problems x K,
    each seeded with the seed itself; a resumed evaluation redraws a call whole, never a part of
    one, since a sample depends on every row of its call (tests/integration/test_val_equals_eval.py: the fit's
    own samples)."""
    bench, answers = arith

    class Recording(FakeEngine):
        def generate(self, prompts, n=1, sampling=None):
            if self.fail_on_call is None or self.calls + 1 < self.fail_on_call:
                self.seen.append((len(prompts), n, sampling.seed, sampling.top_p, sampling.stop))
            return super().generate(prompts, n, sampling)

    def run(out, **kw):
        engine = Recording(answers, **kw)
        engine.seen = []
        try:
            _run(tiny_model_dir, bench, answers, out, engine=engine, seed=7, top_p=1.0, stop=["\n\n"], fit_batches=4)
        except RuntimeError as err:   # the simulated preemption
            assert "killed" in str(err)
        return engine.seen

    assert run(tmp_path / "whole") == [(4, 4, 7, 1.0, ["\n\n"]), (2, 4, 7, 1.0, ["\n\n"])]
    assert run(tmp_path / "cut", fail_on_call=2) == [(4, 4, 7, 1.0, ["\n\n"])]
    samples = next((tmp_path / "cut").glob("*/arith.samples.jsonl"))
    text = samples.read_text()
    samples.write_text(text[: len(text) - 25])                 # the first call torn: redrawn whole
    assert run(tmp_path / "cut") == [(4, 4, 7, 1.0, ["\n\n"]), (2, 4, 7, 1.0, ["\n\n"])]
    assert run(tmp_path / "cut") == []                            # finished: nothing drawn
    whole, cut = (json.loads(next((tmp_path / name).glob("*/arith.done.json")).read_text())
                  for name in ("whole", "cut"))
    assert whole["avg@k"] == cut["avg@k"] and whole["settings"]["fit_batches"] == 4
    assert whole["settings"]["stop"] == ["\n\n"]


def test_limit_and_prompt(tmp_path, tiny_model_dir, arith):
    bench, answers = arith
    result, _ = _run(tiny_model_dir, bench, answers, tmp_path, limit=2)
    assert result["arith"]["n_problems"] == 2
    assert build_prompt("What is 1+1?", None) == "What is 1+1? " + INSTRUCTION


# --- Table 1 -----------------------------------------------------------------------------------

def test_render_table1_against_the_paper(tmp_path):
    columns, paper = load_paper_table()
    assert columns[0] == "aime24_avg@64" and columns[-1] == "avg" and len(paper) == 14
    offsets = {("Qwen3-4B", "ASPO"): 1.0, ("DeepSeek-R1-Distill-Qwen-1.5B", "GRPO"): -2.5}
    results = {}
    for key, off in offsets.items():
        results[key] = {c: v + off for c, v in paper[key].items() if c != "avg"}
    results[("Qwen3-4B", "ASPO")]["aime24_avg@64"] = 60.0          # one cell off by its own
    results[("testbed", "ASPO")] = {"arith_avg@8": 42.0, "arith_pass@8": 80.0}
    missing = {("Qwen3-8B", "GRPO"): "not found: runs/qwen3-8b/grpo/checkpoints/last.ckpt"}
    markdown, rows = render_table1(results, compare_paper=True, missing=missing, out_dir=tmp_path)

    assert [(r["base_model"], r["method"]) for r in rows] == list(paper) + [("testbed", "ASPO")]
    by_key = {(r["base_model"], r["method"]): r for r in rows}
    for key, off in offsets.items():
        row = by_key[key]
        assert row["status"] == "ok"
        for c in columns:
            cell = row["cells"][c]
            assert cell["paper"] == paper[key][c]
            expected = 60.0 - 50.5 if (key, c) == (("Qwen3-4B", "ASPO"), "aime24_avg@64") else off
            if c == "avg":     # recomputed from our six avg@K, not copied
                ours = [results[key][x] for x in columns if "_avg@" in x]
                assert cell["ours"] == approx64(sum(ours) / 6)
                assert cell["delta"] == approx64(sum(ours) / 6 - paper[key]["avg"])
            else:
                assert cell["delta"] == approx64(expected), (key, c)
    # missing rows: reported, never filled in
    assert by_key[("Qwen3-8B", "GRPO")]["status"] == "missing"
    assert "not found" in by_key[("Qwen3-8B", "GRPO")]["reason"]
    assert by_key[("Qwen3-30B-A3B", "ASPO")]["reason"] == "not evaluated"
    assert all(c["ours"] is None for c in by_key[("Qwen3-8B", "GRPO")]["cells"].values())
    assert "Qwen3-8B / GRPO: missing — not found" in markdown
    assert "| Qwen3-4B | ASPO | 60.0 / 50.5 / +9.5 |" in markdown
    # the extra row keeps its own columns; no paper value, no delta
    extra = by_key[("testbed", "ASPO")]["cells"]
    assert extra["arith_avg@8"] == {"ours": 42.0, "se": None, "paper": None, "paper_se": None, "delta": None,
                                    "verdict": "missing", "why": "reference"}
    # CSV: same numbers, one column triple per paper column
    with open(tmp_path / "table1.csv") as f:
        table = list(csv.DictReader(f))
    row = next(r for r in table if r["base_model"] == "Qwen3-4B" and r["method"] == "ASPO")
    assert float(row["amc23_pass@64_delta"]) == approx64(1.0)
    assert float(row["amc23_pass@64_paper"]) == 97.5
    assert (tmp_path / "table1.md").read_text() == markdown


def test_render_table1_without_paper_shows_only_ours():
    markdown, rows = render_table1({("testbed", "base"): {"arith_avg@8": 10.0}}, compare_paper=False,
                                   missing={("testbed", "GRPO"): "not found: x.ckpt"})
    assert [(r["base_model"], r["method"], r["status"]) for r in rows] == [
        ("testbed", "base", "ok"), ("testbed", "GRPO", "missing")]
    assert "| testbed | base | 10.0 |" in markdown and "aime24" not in markdown


# --- standard errors and verdicts (docs/evaluation.md) -------------------------------------------

def test_verdict_rule():
    """ours ± 2·sqrt(se² + se_ref²), widened by half the reference's rounding; outside: above / below."""
    assert verdict(50.0, 1.0, ReferenceCell(52.0)) == "consistent"                 # 2.0 <= 2·1
    assert verdict(50.0, 1.0, ReferenceCell(52.04)) == "below"                     # 2.04 > 2·1
    assert verdict(50.0, 1.0, ReferenceCell(52.04), resolution=0.1) == "consistent"   # <= 2 + 0.05
    assert verdict(50.0, 1.0, ReferenceCell(52.1), resolution=0.1) == "below"
    assert verdict(55.0, 1.0, ReferenceCell(52.0)) == "above"
    # a reference's own SE combines with ours: sqrt(1² + 0.75²) = 1.25, half-width 2.5
    assert verdict(50.0, 1.0, ReferenceCell(52.4, se=0.75)) == "consistent"
    assert verdict(50.0, 1.0, ReferenceCell(52.4)) == "below"
    assert verdict(50.0, 1.0, ReferenceCell(53.0, se=0.75)) == "below"
    assert verdict(50.0, 0.0, ReferenceCell(50.0)) == "consistent"
    with pytest.raises(ValueError, match="SE >= 0"):
        verdict(50.0, float("nan"), ReferenceCell(50.0))


def _reference_file(path, rows, table="table1", resolution=0.0):
    data = {"format": "aspo-lit-reference", "version": 1, "kind": "table", "table": table, "source": "lab X",
            "resolution": resolution, "band": {"k": 2.0},
            "rows": [{"base_model": b, "method": m, "metrics": cells} for (b, m), cells in rows.items()]}
    path.write_text(json.dumps(data))
    return path


def test_cells_show_se_and_verdict_against_a_reference_file(tmp_path):
    """Every cell: ours ± SE / reference ± SE / Δ and the verdict, in Markdown and CSV; the Avg's SE
    propagated from its six cells; the verdicts' line counts them, missing ones by what is missing."""
    ref = _reference_file(tmp_path / "ref.json", {
        ("M", "a"): {"aime24_avg@64": {"mean": 30.0, "se": None}, "math500_avg@4": {"mean": 40.0, "se": 0.3},
                     "math500_pass@4": {"mean": 60.0, "se": None}, "avg": {"mean": 20.0}},
        ("M", "gone"): {"aime24_avg@64": {"mean": 1.0}}})
    six = {"aime24_avg@64": 31.0, "aime25_avg@64": 10.0, "amc23_avg@64": 10.0, "math500_avg@4": 39.5,
           "minerva_avg@8": 10.0, "olympiad_avg@4": 10.0}
    errors = {"aime24_avg@64": 0.4, "aime25_avg@64": 1.0, "amc23_avg@64": 1.0, "math500_avg@4": 0.5,
              "minerva_avg@8": 1.0, "olympiad_avg@4": 1.0, "aime24_pass@64": 2.0}
    results = {("M", "a"): {**six, "aime24_pass@64": 70.0, "math500_pass@4": 58.0}}
    markdown, rows = render_table1(results, errors={("M", "a"): errors}, reference=str(ref), out_dir=tmp_path,
                                   missing={("M", "gone"): "not found: x.ckpt", ("M", "new"): "no ckpt"})
    cells = {(r["method"], c): cell for r in rows for c, cell in r["cells"].items()}
    assert cells[("a", "aime24_avg@64")]["verdict"] == "above"           # 1.0 > 2·0.4
    assert cells[("a", "math500_avg@4")]["verdict"] == "consistent"      # 0.5 <= 2·sqrt(0.5² + 0.3²)
    assert cells[("a", "math500_pass@4")] | {"delta": None} == {
        "ours": 58.0, "se": None, "paper": 60.0, "paper_se": None, "delta": None, "verdict": "missing", "why": "se"}
    assert cells[("a", "aime24_pass@64")]["why"] == "reference"
    assert cells[("gone", "aime24_avg@64")]["why"] == "ours"
    assert cells[("gone", "math500_avg@4")]["verdict"] is None           # not in the reference's row: no cell
    assert {cell["why"] for c, cell in cells.items() if c[0] == "new"} == {"ours"}   # a row of ours: every column
    avg = cells[("a", "avg")]
    assert avg["ours"] == approx64(sum(six.values()) / 6)
    assert avg["se"] == approx64(math.sqrt(sum(errors[c] ** 2 for c in six)) / 6)
    assert avg["verdict"] == "below"                                     # 18.42 vs 20.0: 1.58 > 2·0.36
    # the reference's columns first, then ours; a cell without a reference value shows ours ± SE only
    assert ("| M | a | 31.0 ± 0.4 / 30.0 / +1.0 above | 39.5 ± 0.5 / 40.0 ± 0.3 / -0.5 consistent | "
            "58.0 / 60.0 / -2.0 | 10.0 ± 1.0 |") in markdown
    assert "| 70.0 ± 2.0 | 18.4 ± 0.4 / 20.0 / -1.6 below |" in markdown
    assert "| M | gone | missing / 1.0 / — | — |" in markdown
    # cells: a's 9 (4 avg@K and aime24_pass@64 without a reference value), gone's aime24_avg@64, new's 9
    line = ("Verdicts against lab X (consistent: its value within ours ± 2 SE): 19 cells, 1 consistent, "
            "2 inconsistent (1 above, 1 below), 16 missing (10 without a value of ours, 5 without a reference "
            "value, 1 without an SE).")
    assert markdown.rstrip().endswith(line)
    with open(tmp_path / "table1.csv") as f:
        row = next(r for r in csv.DictReader(f) if r["method"] == "a")
    assert (row["aime24_avg@64_se"], row["aime24_avg@64_verdict"]) == ("0.4", "above")
    assert (row["math500_avg@4_paper_se"], row["math500_pass@4_verdict"]) == ("0.3", "missing: no SE")
    # without the layout: our rows and columns only, the same verdicts
    markdown, _ = render_table1(results, compare_paper=False, errors={("M", "a"): errors}, reference=str(ref))
    assert "| M | a | 31.0 ± 0.4 above | 10.0 ± 1.0 | 10.0 ± 1.0 | 39.5 ± 0.5 consistent |" in markdown
    assert "gone" not in markdown


def test_shipped_paper_references_are_the_papers_tables():
    """aspo_lit/references/paper_table{1,2,3}.json hold every value of the paper's tables (the
    package's CSV copies), no SE (single runs), 0.1-point rounding; a table is judged against them by
    default."""
    for name, spec in TABLES.items():
        shipped = json.loads((REFERENCES / f"paper_{name}.json").read_text())
        assert shipped == reference_from_csv(spec.paper_csv, name, PAPER_SOURCE[name]), name
        columns, paper = load_paper_table(spec.paper_csv)
        ref = load_reference(None, name)
        assert ref.resolution == 0.1 and list(ref.rows) == list(paper) and ref.columns == columns
        assert all(ref.cell(key, c) == ReferenceCell(v, None) for key, row in paper.items() for c, v in row.items())


@pytest.mark.parametrize("edit, message", [
    ({"format": "x"}, "not an aspo-lit reference"),
    ({"kind": None}, "kind None, not 'table'"),
    ({"table": "table2"}, "field 'table' is 'table2', not 'table1'"),
    ({"resolution": -1}, "'resolution' must be a finite number >= 0"),
    ({"rows": [{"base_model": "M", "method": "a", "metrics": {"avg": {"se": 1.0}}}]},
     r"rows\[0\]\.metrics\['avg'\] lacks a numeric 'mean'"),
    ({"rows": [{"base_model": "M", "method": "a", "metrics": {"avg": {"mean": 1.0, "se": -1}}}]},
     r"rows\[0\]\.metrics\['avg'\]: 'se' must be a finite number >= 0"),
    ({"rows": [{"base_model": "M", "metrics": {}}]}, r"rows\[0\] needs string 'base_model' and 'method'"),
])
def test_reference_file_errors_name_the_field(tmp_path, edit, message):
    path = _reference_file(tmp_path / "ref.json", {("M", "a"): {"avg": {"mean": 1.0}}})
    path.write_text(json.dumps({**json.loads(path.read_text()), **edit}))
    with pytest.raises(ReferenceError, match=message) as err:
        load_reference(str(path), "table1")
    assert str(path) in str(err.value)
    with pytest.raises(ReferenceError, match="no such file"):
        load_reference(str(tmp_path / "nope.json"), "table1")


def test_sample_size_table_in_the_docs_is_the_formula_at_the_papers_accuracies():
    """docs/evaluation.md's table: A is the paper's value closest to 50 % (the 1.5B rows of Tables 1-2,
    every row of Table 3), N = samples_for_halfwidth(A, 1.5 points), the half-width at the paper's P × K."""
    import re

    from aspo_lit.maths.metrics import samples_for_halfwidth

    text = (Path(__file__).resolve().parents[2] / "docs" / "evaluation.md").read_text()
    table = text[text.index("| benchmark | paper's avg@K, 1.5B rows |"):]
    lines = re.findall(r"^\| ([^|]+?) \| [\d.]+-[\d.]+ \| ([\d.]+) \| ([\d,]+) \| ([\d,]+) × (\d+) = [\d,]+ \| "
                       r"±([\d.]+) \| (\d+) \|$", table, flags=re.M)
    names = {"AIME24": "aime24", "AIME25": "aime25", "AMC23": "amc23", "MATH-500": "math500", "Minerva": "minerva",
             "OlympiadBench": "olympiadbench", "LiveCodeBench v5": "lcb_v5", "LiveCodeBench v6": "lcb_v6",
             "ARC-Challenge": "arc_challenge", "GPQA-Diamond": "gpqa_diamond", "MMLU-Pro": "mmlu_pro"}
    assert len(lines) == len(names)
    for label, used, n, problems, k, halfwidth, k_needed in lines:
        name = names[label.split(" (")[0]]
        spec = next(s for s in TABLES.values() if name in s.avg_benchmarks)
        bench = BENCHMARKS[name]
        _, paper = load_paper_table(spec.paper_csv)
        column = bench.column if spec.single_figure else f"{bench.column}_avg@{bench.k}"
        values = [row[column] for key, row in paper.items()
                  if spec.single_figure or key[0] == "DeepSeek-R1-Distill-Qwen-1.5B"]
        accuracy = min(values, key=lambda v: abs(v - 50)) / 100
        assert float(used) == approx64(100 * accuracy, scale=100), label
        assert int(n.replace(",", "")) == samples_for_halfwidth(accuracy, 0.015), label
        problems, k = int(problems.replace(",", "")), int(k)
        assert (problems, k) == (PAPER_COUNTS.get(name, problems), bench.k), label
        assert float(halfwidth) == round(200 * math.sqrt(accuracy * (1 - accuracy) / (problems * k)), 1), label
        assert int(k_needed) == math.ceil(samples_for_halfwidth(accuracy, 0.015) / problems), label


def test_compare_refuses_a_table_reference():
    from aspo_lit.compare.run_reference import read_reference
    from aspo_lit.compare.runlog import CompareError

    with pytest.raises(CompareError, match="a 'table' reference, not bands"):
        read_reference("paper_table1")


# --- benchmarks --------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(PAPER_COUNTS))
def test_load_each_local_benchmark(name, shared_data_dir):
    rows = load_benchmark(name, data_dir=shared_data_dir)
    assert len(rows) == PAPER_COUNTS[name]
    assert len({r["id"] for r in rows}) == len(rows)
    assert all(isinstance(r["answer"], str) and r["answer"] and r["problem"] for r in rows)
    assert BENCHMARKS[name].k == {"aime24": 64, "aime25": 64, "amc23": 64, "math500": 4,
                                  "minerva": 8, "olympiadbench": 4}[name]


def test_benchmark_sources(tmp_path, shared_data_dir, monkeypatch):
    monkeypatch.setenv("ASPO_DATA_DIR", str(shared_data_dir))
    assert len(load_benchmark("amc23")) == 40                      # env default
    assert len(load_benchmark("amc23", path=shared_data_dir)) == 40  # a folder
    assert load_benchmark("minerva")[57]["answer"] == "0.53"       # README's answer fix


@pytest.mark.parametrize("bad_line, message", [
    ({"id": "b", "problem": "2+2?"}, "'answer' is missing"),
    ({"id": "b", "answer": "4"}, "'problem' is missing"),
    ({"id": "b", "problem": "2+2?", "answer": 4}, "'answer' is a int"),
])
def test_bad_row_names_file_and_line(tmp_path, bad_line, message):
    path = tmp_path / "bad.jsonl"
    good = {"id": "a", "problem": "1+1?", "answer": "2"}
    path.write_text(json.dumps(good) + "\n\n" + json.dumps(bad_line) + "\n")
    with pytest.raises(ValueError, match=rf"bad\.jsonl:3: .*{message}"):
        load_benchmark("aime24", path=path)


# --- checkpoint export -------------------------------------------------------------------------

def test_export_checkpoint_round_trip(tmp_path, tiny_model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    trained = {k: v + 0.01 * torch.randn_like(v) if v.is_floating_point() else v
               for k, v in base.state_dict().items()}
    state = {f"policy.{k}": v for k, v in trained.items()}
    state.update({f"ref_policy.{k}": v for k, v in base.state_dict().items()})
    ckpt = tmp_path / "run" / "checkpoints" / "last.ckpt"
    ckpt.parent.mkdir(parents=True)
    torch.save({"state_dict": state, "global_step": 7,
                "hyper_parameters": {"model_name_or_path": str(tiny_model_dir),
                                     "torch_dtype": "float32", "loss_name": "aspo"}}, ckpt)
    out = export_checkpoint(ckpt, tmp_path / "exported")
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    for k, v in trained.items():
        assert torch.equal(reloaded[k], v), k
    assert json.loads((out / "exported_from.json").read_text())["global_step"] == 7
    assert (out / "tokenizer.json").is_file()

    bad = tmp_path / "bad.ckpt"
    torch.save({"state_dict": {"policy.nope": torch.zeros(1), **state}, "hyper_parameters":
                {"model_name_or_path": str(tiny_model_dir)}}, bad)
    with pytest.raises(ValueError, match="unexpected"):
        export_checkpoint(bad, tmp_path / "bad")


def test_export_distributed_checkpoint_folder(tmp_path, tiny_model_dir):
    """FSDP2 (ModelParallelStrategy) writes `last.ckpt` as a torch.distributed checkpoint folder
    plus meta.pt; only its state_dict is read."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).state_dict()
    trained = {f"policy.{k}": v + 1.0 for k, v in base.items()}
    folder = tmp_path / "runs" / "aspo" / "version_0" / "checkpoints" / "last.ckpt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"state_dict": trained, "optimizer_0": {"step": torch.tensor(3.0)}},
                 checkpoint_id=str(folder))
    torch.save({"global_step": 3, "hyper_parameters": {"model_name_or_path": str(tiny_model_dir)}},
               folder / "meta.pt")
    out = export_checkpoint(folder, tmp_path / "exported")
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    assert all(torch.equal(reloaded[k], v + 1.0) for k, v in base.items())


# --- the real engine and reward, and the table1 command ---------------------------------------

def test_real_hf_engine_and_math_verify(tmp_path, tiny_model_dir, arith):
    pytest.importorskip("aspo_lit.rollout.hf")
    bench, _ = arith
    result = evaluate_model(str(tiny_model_dir), [{**bench, "k": 2}], tmp_path, engine="hf",
                            max_tokens=8, limit=3, seed=1)
    assert result["arith"]["n_problems"] == 3 and result["arith"]["k"] == 2
    records = _records(tmp_path)
    assert len(records) == 6 and all(r["num_tokens"] <= 8 for r in records)
    assert {r["finish_reason"] for r in records} <= {"stop", "length"}
    # the random model is wrong; the number is still computed from its records
    assert result["arith"]["avg@k"] == approx64(100 * sum(r["correct"] for r in records) / 6)


def test_table1_main_end_to_end(tmp_path, tiny_model_dir, monkeypatch, capsys):
    pytest.importorskip("aspo_lit.rollout.hf")
    import yaml

    from aspo_lit.__main__ import main

    torch = pytest.importorskip("torch")
    ckpt = tmp_path / "runs" / "tiny_aspo" / "version_1" / "checkpoints" / "last.ckpt"
    ckpt.parent.mkdir(parents=True)
    from transformers import AutoModelForCausalLM
    state = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).state_dict()
    torch.save({"state_dict": {f"policy.{k}": v for k, v in state.items()},
                "hyper_parameters": {"model_name_or_path": str(tiny_model_dir)}}, ckpt)
    config = {
        "out_dir": "out", "engine": "hf", "sampling": {"max_tokens": 6, "temperature": 1.0},
        "benchmarks": [{"name": "arith_heldout", "k": 2,
                        "generate": {"n": 3, "seed": 0, "levels": [1], "split": "heldout"}}],
        "rows": [
            {"base_model": "tiny", "method": "base", "model": str(tiny_model_dir)},
            {"base_model": "tiny", "method": "ASPO",
             "model": "runs/tiny_aspo/version_*/checkpoints/last.ckpt"},
            {"base_model": "tiny", "method": "GRPO",
             "model": "runs/tiny_grpo/version_*/checkpoints/last.ckpt",
             "produced_by": "python -m aspo_lit fit --config conf/tiny/grpo.yaml"},
        ],
    }
    (tmp_path / "t1.yaml").write_text(yaml.safe_dump(config))
    monkeypatch.chdir(tmp_path)
    assert main(["table1", "--config", "t1.yaml"]) == 0
    with open(tmp_path / "out" / "table1.csv") as f:
        status = {(r["base_model"], r["method"]): r for r in csv.DictReader(f)}
    assert status[("tiny", "base")]["status"] == status[("tiny", "ASPO")]["status"] == "ok"
    assert status[("tiny", "GRPO")]["status"] == "missing"
    assert "no file matches" in status[("tiny", "GRPO")]["reason"]
    assert "conf/tiny/grpo.yaml" in status[("tiny", "GRPO")]["reason"]
    assert status[("tiny", "base")]["arith_heldout_avg@2"] != ""
    # same weights, same seed, same prompts: the exported checkpoint samples what the base does
    cells = lambda r: {c: v for c, v in r.items() if c.startswith("arith")}
    assert cells(status[("tiny", "base")]) == cells(status[("tiny", "ASPO")])
    assert len((tmp_path / "out" / "data" / "arith_heldout.jsonl").read_text().splitlines()) == 3
    markdown = (tmp_path / "out" / "table1.md").read_text()
    assert "| tiny | base |" in markdown and "tiny / GRPO: missing" in markdown
    assert "aime24" not in markdown                            # compare_paper off: our columns only
    assert float(status[("tiny", "base")]["arith_heldout_avg@2_se"]) >= 0
    # the run as a reference file (others compare with it): our cells, their SEs and what they came from
    published = json.loads((tmp_path / "out" / "table1.reference.json").read_text())
    assert published["kind"] == "table" and "\nout_dir: out\n" in published["config"]["text"]
    assert [(r["base_model"], r["method"]) for r in published["rows"]] == [("tiny", "base"), ("tiny", "ASPO")]
    cell = published["rows"][0]["metrics"]["arith_heldout_avg@2"]
    assert (cell["problems"], cell["k"], cell["n"]) == (3, 2, 1)
    assert cell["mean"] == approx64(float(status[("tiny", "base")]["arith_heldout_avg@2"]), scale=100)
    # the same run against it: every computed cell consistent (Δ = 0), the GRPO row's missing
    capsys.readouterr()
    assert main(["table1", "--config", "t1.yaml", "--compare_paper", "true",
                 "--reference", "out/table1.reference.json"]) == 0
    printed = capsys.readouterr().out.rstrip().splitlines()
    assert printed[-2] == ("Verdicts against an aspo-lit table1 run (consistent: its value within ours ± 2 SE): "
                           "7 cells, 4 consistent, 0 inconsistent (0 above, 0 below), 3 missing (3 without a "
                           "value of ours, 0 without a reference value, 0 without an SE).")


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_engine_evaluation(tmp_path, tiny_model_dir, arith):
    from aspo_lit.rollout.registry import vllm_available

    if not vllm_available():
        pytest.skip("vllm does not import here")
    bench, _ = arith
    result = evaluate_model(str(tiny_model_dir), [{**bench, "k": 3}], tmp_path, engine="vllm",
                            max_tokens=8, limit=4, samples_per_call=6)
    records = _records(tmp_path)
    keys = {(r["problem_id"], r["sample_index"]) for r in records}
    assert len(records) == len(keys) == 12 and result["arith"]["n_problems"] == 4


@pytest.mark.slow
def test_tiny_profile_table1(tmp_path, shared_data_dir):
    """conf/tiny/table1.yaml end to end on the testbed (built on first use): base always, the
    GRPO/ASPO rows from the tiny runs when they exist, else reported missing."""
    import yaml

    from aspo_lit.eval.table_commands import evaluate_table

    repo = Path(__file__).resolve().parents[2]
    config = yaml.safe_load((repo / "conf" / "tiny" / "table1.yaml").read_text())
    _, rows = evaluate_table({**config, "out_dir": str(tmp_path)}, root=repo, table="table1")
    by_method = {r["method"]: r for r in rows}
    base = by_method["base"]
    assert base["status"] == "ok", base["reason"]
    assert base["cells"]["arith_heldout_avg@4"]["ours"] is not None
    for column in ("aime24_avg@2", "math500_pass@2", "olympiad_avg@2"):
        assert base["cells"][column]["ours"] is not None
    for method in ("GRPO", "ASPO"):
        row = by_method[method]
        assert row["status"] == "ok" or "conf/tiny/" in row["reason"]
    assert (tmp_path / "table1.md").is_file() and (tmp_path / "table1.csv").is_file()


def test_hub_rows_are_normalized(monkeypatch):
    """Hub copies: OlympiadBench answers are one-element lists with `$`, amc23's are floats."""
    import datasets

    fake = {"Hothan/OlympiadBench": [{"id": 7, "question": "Q?", "final_answer": ["$\\frac{1}{2}$"]}],
            "math-ai/amc23": [{"id": 0, "question": "A?", "answer": 27.0}]}
    monkeypatch.setattr(datasets, "load_dataset", lambda hub_id, config=None, split=None: fake[hub_id])
    assert load_benchmark("olympiadbench", data_dir="/nonexistent") == [
        {"id": "7", "problem": "Q?", "answer": "\\frac{1}{2}"}]
    assert load_benchmark("amc23", data_dir="/nonexistent")[0]["answer"] == "27"


# --- a benchmark that cannot load loses only its own cells --------------------------------------

def test_unloadable_benchmark_leaves_the_other_cells(tmp_path, tiny_model_dir, monkeypatch, capsys):
    """Offline: aime24 cannot reach the hub and one benchmark's file is gone, beside a local
    benchmark that loads: the local column is computed for every available model, the other two
    are missing with their reasons, the exit status says some cells failed, the last line counts."""
    import datasets
    import yaml

    from aspo_lit.__main__ import main

    def offline(hub_id, *args, **kwargs):
        raise ConnectionError(f"Couldn't reach '{hub_id}' on the Hub (OfflineModeIsEnabled)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    config = {
        "out_dir": "out", "engine": "hf", "sampling": {"max_tokens": 6}, "data_dir": str(tmp_path / "empty"),
        "benchmarks": [{"name": "arith_heldout", "k": 2,
                        "generate": {"n": 3, "seed": 0, "levels": [1], "split": "heldout"}},
                       {"name": "aime24", "k": 2, "limit": 2},
                       {"name": "gone", "k": 2, "path": str(tmp_path / "gone.jsonl")}],
        "rows": [{"base_model": "tiny", "method": "base", "model": str(tiny_model_dir)},
                 {"base_model": "tiny", "method": "GRPO", "model": "runs/none/last.ckpt"}],
    }
    (tmp_path / "t1.yaml").write_text(yaml.safe_dump(config))
    monkeypatch.chdir(tmp_path)
    assert main(["table1", "--config", "t1.yaml"]) == 1
    last = capsys.readouterr().out.rstrip().splitlines()[-1]
    assert last == ("Cells (model x benchmark): 1 of 6 computed, 5 missing (3 without a model, "
                    "2 whose benchmark did not load or whose evaluation failed).")
    with open(tmp_path / "out" / "table1.csv") as f:
        rows = {r["method"]: r for r in csv.DictReader(f)}
    base = rows["base"]
    assert list(base).index("arith_heldout_avg@2") < list(base).index("aime24_avg@2")   # the config's order
    assert base["status"] == "incomplete" and rows["GRPO"]["status"] == "missing"
    assert base["arith_heldout_avg@2"] != "" and base["arith_heldout_pass@2"] != ""
    assert base["aime24_avg@2"] == base["aime24_pass@2"] == base["gone_avg@2"] == ""
    assert "aime24: ConnectionError: Couldn't reach 'HuggingFaceH4/aime_2024' on the Hub" in base["reason"]
    assert "gone: FileNotFoundError" in base["reason"]
    markdown = (tmp_path / "out" / "table1.md").read_text()
    header = markdown.splitlines()[0].split(" | ")
    assert len(header) == len(set(header)) == 2 + 6              # each column once (no avg: it has no value)
    assert "| tiny | base | " in markdown and "| missing | missing |" in markdown
    assert markdown.rstrip().endswith(last)


def test_failures_are_recorded_per_benchmark_and_the_engine_is_not_retried(tmp_path, tiny_model_dir, arith):
    bench, answers = arith

    class BrokenEngine(FakeEngine):
        def attach(self, *args):
            self.attached = self.calls = self.calls + 1
            raise RuntimeError("CUDA out of memory")

    engine, failures = BrokenEngine(answers), {}
    second = {**bench, "name": "arith2"}
    results = evaluate_model(str(tiny_model_dir), [bench, second, {"name": "nope", "k": 2}], tmp_path,
                             engine=engine, reward=ExactReward(), failures=failures)
    assert results == {} and engine.calls == 1                 # started once, not once per benchmark
    assert failures["arith"] == "RuntimeError: CUDA out of memory"
    assert failures["arith2"] == "RuntimeError: the engine did not start: RuntimeError: CUDA out of memory"
    assert failures["nope"].startswith("FileNotFoundError: benchmark 'nope': no local file")
    with pytest.raises(RuntimeError, match="out of memory"):   # without `failures`: raised, as before
        evaluate_model(str(tiny_model_dir), [bench], tmp_path / "raise", engine=BrokenEngine(answers),
                       reward=ExactReward())


# --- the authors' sampling and precision -------------------------------------------------------

def test_default_top_p_is_the_authors(tmp_path, tiny_model_dir, arith):
    """top_p 0.95 (Archer2.0 scripts/eval/run_eval.sh) reaches the engine and the records' settings."""
    bench, answers = arith

    class Recording(FakeEngine):
        def generate(self, prompts, n=1, sampling=None):
            self.sampling = sampling
            return super().generate(prompts, n, sampling)

    engine = Recording(answers)
    result = evaluate_model(str(tiny_model_dir), [bench], tmp_path, engine=engine, reward=ExactReward(),
                            limit=1)
    assert engine.sampling.top_p == 0.95 and result["arith"]["settings"]["top_p"] == 0.95


def test_eval_configs_sample_and_load_as_the_authors():
    import yaml

    repo = Path(__file__).resolve().parents[2]
    for name in ("table1", "table2", "table3"):
        paper = yaml.safe_load((repo / "conf" / f"{name}.yaml").read_text())
        tiny = yaml.safe_load((repo / "conf" / "tiny" / f"{name}.yaml").read_text())
        assert paper["sampling"]["top_p"] == tiny["sampling"]["top_p"] == 0.95, name
        assert paper["sampling"]["temperature"] == 0.8 and paper["dtype"] == "bfloat16", name
        assert "dtype" in tiny and tiny["dtype"] is None, name     # the device's: fp32 on the CPU testbed


def test_exported_checkpoint_runs_in_the_evaluation_dtype(tmp_path, tiny_model_dir, arith, monkeypatch):
    """A trained checkpoint (fp32 master weights, exported in fp32) is evaluated in the same dtype
    as a hub model: the engine gets `dtype` and casts on load; the dtype is pinned in the meta."""
    import torch
    from transformers import AutoModelForCausalLM

    from aspo_lit.rollout import hf as hf_engine

    bench, _ = arith
    state = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).state_dict()
    ckpt = tmp_path / "runs" / "aspo" / "checkpoints" / "last.ckpt"
    ckpt.parent.mkdir(parents=True)
    torch.save({"state_dict": {f"policy.{k}": v for k, v in state.items()},
                "hyper_parameters": {"model_name_or_path": str(tiny_model_dir), "torch_dtype": "float32"}}, ckpt)
    loaded = {}
    attach = hf_engine.HFEngine.attach

    def spy(self, model, tokenizer, model_path=None):
        attach(self, model, tokenizer, model_path)
        loaded[str(model_path)] = self.model.dtype

    monkeypatch.setattr(hf_engine.HFEngine, "attach", spy)
    for model in (str(tiny_model_dir), str(ckpt)):
        result = evaluate_model(model, [{**bench, "k": 1}], tmp_path / "eval", engine="hf", dtype="bfloat16",
                                max_tokens=2, limit=1)
        assert result["arith"]["settings"]["dtype"] == "bfloat16"
    assert list(loaded.values()) == [torch.bfloat16, torch.bfloat16]
    exported = next(p for p in loaded if p != str(tiny_model_dir))
    assert json.loads((Path(exported) / "config.json").read_text())["dtype"] == "float32"   # lossless export
    with pytest.raises(ValueError, match="dtype"):
        evaluate_model(str(tiny_model_dir), [bench], tmp_path / "x", engine="hf", dtype="float64")
    with pytest.raises(ValueError, match="engine_kwargs dtype"):
        evaluate_model(str(tiny_model_dir), [bench], tmp_path / "y", engine="hf", dtype="bfloat16",
                       engine_kwargs={"dtype": "float32"})
