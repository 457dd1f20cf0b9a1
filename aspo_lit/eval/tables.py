"""Tables 1 (math), 2 (code) and 3 (out of domain) of the paper, recomputed, beside the paper's own
numbers.

The reference's figures (default: the paper's, aspo_lit/references/paper_table{1,2,3}.json, made from
aspo_lit/eval/data/table*.csv, copied from the paper; ``aspo_lit.eval.reference``) fix the layout: its
columns in order, its rows in order. Each cell shows ours ± SE / reference / Δ (ours − reference) and
the verdict, consistent, above or below (docs/evaluation.md, "Standard errors and verdicts"); a line
under the table counts the verdicts. Rows of ours that the reference does not have are appended;
reference rows we have no results for are listed as "missing" with the reason — never filled in. A
row of ours whose benchmark could not be loaded or evaluated is "incomplete": its other cells are
shown, those are "missing" with the reason.

Table 3 gives one accuracy per benchmark (column ``arc_challenge``, ...) and no K: our avg@K (the
mean accuracy over K samples, an estimate of the same single-sample accuracy whatever K is) fills
that column; our pass@K is shown beside it, with no paper value.
"""
from __future__ import annotations

import csv
import io
import math
from dataclasses import dataclass
from pathlib import Path

from aspo_lit.eval.datasets import BENCHMARKS, TABLE1_BENCHMARKS, TABLE2_BENCHMARKS, TABLE3_BENCHMARKS
from aspo_lit.eval.reference import VERDICTS, ReferenceCell, TableReference, load_reference, verdict
from aspo_lit.maths.metrics import mean_se

PAPER_TABLE1 = Path(__file__).with_name("data") / "table1.csv"
PAPER_TABLE2 = Path(__file__).with_name("data") / "table2.csv"
PAPER_TABLE3 = Path(__file__).with_name("data") / "table3.csv"
KEY_COLUMNS = ("base_model", "method")

#: Table 2's caveat when a benchmark was graded on the staged files, which hold the public tests only.
LCB_PUBLIC_TESTS_NOTE = (
    "LiveCodeBench scores here are graded on the public test cases only (the hidden tests could not "
    "be staged), so they are an upper bound on the official avg@K / pass@K: a program that passes "
    "the public tests but would fail a hidden one counts as correct.")
#: the authors' per-test limit (their LiveCodeBench fork, compute_code_generation_metrics: timeout=150)
AUTHORS_PER_TEST_S = 150.0


def lcb_tests_note(graded: dict[str, set[tuple[str, float | None]]]) -> str:
    """Table 2's note on what its LiveCodeBench cells were graded on. `graded`: {benchmark:
    {(tests_scope, per-test limit in s)}} over the computed cells (``done.json`` settings)."""
    public = sorted(name for name, seen in graded.items() if any(scope == "public_only" for scope, _ in seen))
    full = sorted(name for name, seen in graded.items() if any(scope == "public+private" for scope, _ in seen))
    notes = []
    if full:
        limits = sorted({t for name in full for scope, t in graded[name] if scope == "public+private" and t})
        limit = ", ".join(f"{t:g} s" for t in limits) or "the default limit"
        same = limits == [AUTHORS_PER_TEST_S]
        notes.append(f"{', '.join(full)}: graded on every test of each problem, public and private "
                     f"(LiveCodeBench's release files), {limit} per test" +
                     (", as the authors' evaluation: comparable with the paper's figures." if same else
                      f"; the authors allowed {AUTHORS_PER_TEST_S:g} s per test, so slow but correct "
                      "programs may score differently from the paper's."))
    if public:
        notes.append(f"{', '.join(public)}: {LCB_PUBLIC_TESTS_NOTE}")
    return " ".join(notes)


@dataclass(frozen=True)
class TableSpec:
    """One paper table: its CSV, the benchmarks whose avg@K its "avg" column averages."""

    name: str
    paper_csv: Path
    avg_benchmarks: tuple[str, ...]
    avg_legend: str
    note: str = ""
    #: the paper reports one accuracy per benchmark, column `<column>`: our `<column>_avg@K` fills it
    single_figure: bool = False


TABLES = {
    "table1": TableSpec("table1", PAPER_TABLE1, TABLE1_BENCHMARKS, "avg = mean of the six benchmarks' avg@K."),
    "table2": TableSpec("table2", PAPER_TABLE2, TABLE2_BENCHMARKS,
                        "avg = mean of LiveCodeBench v5 and v6 avg@K."),
    "table3": TableSpec("table3", PAPER_TABLE3, TABLE3_BENCHMARKS,
                        "arc_challenge / gpqa_diamond / mmlu_pro = our avg@K (mean accuracy over K "
                        "samples) against the paper's accuracy, which states no K; avg = mean of the "
                        "three.", single_figure=True),
}


def load_paper_table(path=PAPER_TABLE1) -> tuple[list[str], dict[tuple[str, str], dict]]:
    """(value columns in order, {(base_model, method): {column: float}}) in the paper's row
    order (dicts keep insertion order)."""
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        columns = [c for c in reader.fieldnames if c not in KEY_COLUMNS]
        rows = {(r["base_model"], r["method"]): {c: float(r[c]) for c in columns} for r in reader}
    return columns, rows


def table_avg(values: dict, benchmarks=TABLE1_BENCHMARKS) -> float | None:
    """The paper's "Avg." column: the mean of the benchmarks' avg@K (whatever K was used); None
    unless all of them are present."""
    found = []
    for name in benchmarks:
        prefix = f"{BENCHMARKS[name].column}_avg@"
        cells = [v for c, v in values.items() if c.startswith(prefix) and v is not None]
        if not cells:
            return None
        found.append(cells[0])
    return sum(found) / len(found)


def table1_avg(values: dict) -> float | None:
    """Table 1's "Avg.": the mean of the six math benchmarks' avg@K."""
    return table_avg(values, TABLE1_BENCHMARKS)


def table2_avg(values: dict) -> float | None:
    """Table 2's "Avg.": the mean of LiveCodeBench v5 avg@8 and v6 avg@16."""
    return table_avg(values, TABLE2_BENCHMARKS)


def table_avg_se(values: dict, errors: dict, benchmarks=TABLE1_BENCHMARKS) -> float | None:
    """The SE of ``table_avg(values)``: the benchmarks' avg@K are separate samples, so independent,
    and the SE of their mean is ``sqrt(Σ SE²) / B`` (``aspo_lit.maths.metrics.mean_se``); None unless every
    cell the mean uses has an SE."""
    ses = []
    for name in benchmarks:
        prefix = f"{BENCHMARKS[name].column}_avg@"
        cells = [c for c, v in values.items() if c.startswith(prefix) and v is not None]
        if not cells or errors.get(cells[0]) is None:
            return None
        ses.append(errors[cells[0]])
    se = mean_se(ses)
    return se if math.isfinite(se) else None


def render_table2(results: dict, compare_paper: bool = True, missing: dict | None = None,
                  out_dir=None, paper_csv=None, digits: int = 1, note: str | None = None, **kwargs):
    """Render Table 2 (code: LiveCodeBench v5 avg@8 / pass@8, v6 avg@16 / pass@16, avg), with
    ``note`` under it (``lcb_tests_note``: which tests were graded). Same arguments and return
    value as ``render_table``; files ``table2.md`` / ``table2.csv``."""
    return render_table(results, "table2", compare_paper, missing, out_dir, paper_csv, digits, note, **kwargs)


def render_table1(results: dict, compare_paper: bool = True, missing: dict | None = None,
                  out_dir=None, paper_csv=None, digits: int = 1, **kwargs):
    """Render Table 1 (see ``render_table``)."""
    return render_table(results, "table1", compare_paper, missing, out_dir, paper_csv, digits, **kwargs)


def render_table(results: dict, table: str = "table1", compare_paper: bool = True,
                 missing: dict | None = None, out_dir=None, paper_csv=None, digits: int = 1,
                 note: str | None = None, missing_cells: dict | None = None, footer: str | None = None,
                 errors: dict | None = None, reference=None):
    """Render one of the paper's tables (``table1``, ``table2`` or ``table3``), each cell with its
    standard error and its verdict against a reference (docs/evaluation.md, "Standard errors and
    verdicts").

    results: {(base_model, method): {column: value (percent)}}; "avg" is computed when absent.
    errors: {(base_model, method): {column: SE (percent)}} of those values (``aspo_lit.maths.metrics``:
    response sampling on the benchmark's problems); avg's is propagated (``table_avg_se``).
    missing: {(base_model, method): reason} for rows that could not be evaluated (no model).
    missing_cells: {(base_model, method): {column: reason}} for cells of an evaluated row that
    could not be computed (the row is then "incomplete").
    reference: what every cell of ours is judged against (``load_reference``): a
    ``TableReference``, a reference file or a shipped name; default the paper's values
    (``paper_csv``: the paper's CSV instead).
    compare_paper: lay out the reference's rows, values and deltas; else only our rows, and only
    the columns that hold a value or a missing cell (verdicts are given either way).
    out_dir: when given, also write <out_dir>/<table>.md and <table>.csv.
    note: a caveat printed under the table (default: the table's own, if any).
    footer: the last line (``evaluate_table``: the count of computed and missing cells); the count of
    verdicts (``count_verdicts``) comes before it.
    Returns (markdown, rows); each row is {"base_model", "method", "status" ("ok" | "incomplete" |
    "missing"), "reason", "missing_cells": {column: reason}, "cells": {column: {"ours", "se",
    "paper", "paper_se", "delta", "verdict", "why"}}}: "paper" is the reference's value; "verdict"
    is "consistent", "above", "below" (ours higher / lower), "missing" ("why": "ours", "reference",
    "se": what it lacks) or None (no cell: neither side has it).
    """
    spec = TABLES[table]
    note = spec.note if note is None else note
    ref = load_reference(reference, table, paper_csv)
    missing = {tuple(k): reason for k, reason in (missing or {}).items()}
    missing_cells = {tuple(k): dict(cells) for k, cells in (missing_cells or {}).items() if cells}
    errors = {tuple(k): dict(v) for k, v in (errors or {}).items()}
    ours, ours_se = {}, {}
    for key, values in results.items():
        key, values = tuple(key), dict(values)
        ses = dict(errors.get(key, {}))
        if values.get("avg") is None:
            values["avg"] = table_avg(values, spec.avg_benchmarks)
            ses["avg"] = table_avg_se(values, ses, spec.avg_benchmarks) if values["avg"] is not None else None
        if spec.single_figure:
            names = _single_figure_names(values, spec.avg_benchmarks)
            values, ses = _renamed(values, names), _renamed(ses, names)
        ours[key], ours_se[key] = values, ses

    shown = ref.rows if compare_paper else {}
    columns = list(ref.columns) if compare_paper else []
    for key, values in ours.items():
        for c in [*values, *missing_cells.get(key, {})]:
            if c not in columns and c != "avg":
                columns.append(c)
    if "avg" in columns:   # the paper's last column stays last
        columns.remove("avg")
    columns.append("avg")
    if not compare_paper:
        columns = [c for c in columns if any(v.get(c) is not None for v in ours.values())
                   or any(c in cells for cells in missing_cells.values())]

    keys = list(shown) + [k for k in ours if k not in shown]
    keys += [k for k in missing if k not in keys]
    rows = []
    for key in keys:
        values = ours.get(key)
        gaps = missing_cells.get(key, {}) if values is not None else {}
        status = "missing" if values is None else "incomplete" if gaps else "ok"
        reason = missing.get(key, "not evaluated") if values is None else \
            "; ".join(dict.fromkeys(gaps.values()))
        row = {"base_model": key[0], "method": key[1], "status": status, "reason": reason,
               "missing_cells": gaps, "cells": {}}
        for c in columns:
            mine, se, theirs = (values or {}).get(c), ours_se.get(key, {}).get(c), ref.cell(key, c)
            # due but not computed: a missing cell, or any cell of a missing row the reference lacks (a
            # missing reference row's cells are those the reference has)
            due = c in gaps or (values is None and key not in ref.rows)
            row["cells"][c] = _judge(mine, se, theirs, ref, due)
        rows.append(row)

    counts = count_verdicts(rows, ref.source)
    footer = counts if footer is None else f"{counts}\n\n{footer}"
    markdown = _markdown(rows, columns, compare_paper, digits, spec.avg_legend, note, footer, ref)
    if out_dir is not None:
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / f"{table}.md").write_text(markdown, encoding="utf-8")
        (out_dir / f"{table}.csv").write_text(_csv(rows, columns, compare_paper), encoding="utf-8")
    return markdown, rows


def _judge(mine, se, theirs: ReferenceCell | None, ref: TableReference, due: bool) -> dict:
    """One cell: our value and SE, the reference's, Δ and the verdict (``due``: the cell was due, so
    its absence is a missing value of ours)."""
    se = se if se is not None and math.isfinite(se) else None
    cell = {"ours": mine, "se": se, "paper": theirs.mean if theirs else None,
            "paper_se": theirs.se if theirs else None,
            "delta": mine - theirs.mean if mine is not None and theirs is not None else None,
            "verdict": None, "why": ""}
    if mine is None and theirs is None and not due:
        return cell
    if mine is None:
        cell.update(verdict="missing", why="ours")
    elif theirs is None:
        cell.update(verdict="missing", why="reference")
    elif se is None:
        cell.update(verdict="missing", why="se")
    else:
        cell["verdict"] = verdict(mine, se, theirs, ref.resolution, ref.k)
    return cell


def count_verdicts(rows: list[dict], source: str = "the reference") -> str:
    """The verdicts' line: of the table's cells (those that either side has), how many are
    consistent with the reference, above or below it, and missing, by what is missing."""
    cells = [cell for row in rows for cell in row["cells"].values() if cell["verdict"] is not None]
    n = {v: sum(cell["verdict"] == v for cell in cells) for v in (*VERDICTS, "missing")}
    why = {w: sum(cell["why"] == w for cell in cells) for w in ("ours", "reference", "se")}
    return (f"Verdicts against {source} (consistent: its value within ours ± 2 SE): {len(cells)} cells, "
            f"{n['consistent']} consistent, {n['above'] + n['below']} inconsistent ({n['above']} above, "
            f"{n['below']} below), {n['missing']} missing ({why['ours']} without a value of ours, "
            f"{why['reference']} without a reference value, {why['se']} without an SE).")


def _single_figure_names(values: dict, benchmarks) -> dict[str, str]:
    """{our column: the paper's}: `<column>_avg@K` -> `<column>` (the paper's single accuracy
    column), in the paper's order."""
    names = {}
    for name in benchmarks:
        column = BENCHMARKS[name].column
        found = [c for c in values if c.startswith(f"{column}_avg@")]
        if found and values.get(column) is None:
            names[found[0]] = column
        elif column in values:
            names[column] = column
    return names


def _renamed(values: dict, names: dict[str, str]) -> dict:
    """``values`` with ``names`` applied: those columns first, then the rest (pass@K) as they came."""
    first = {names[c]: values[c] for c in names if c in values}
    return {**first, **{c: v for c, v in values.items() if c not in names and c not in first}}


def _fmt(value, digits, signed=False) -> str:
    if value is None:
        return "—"
    return f"{value:+.{digits}f}" if signed else f"{value:.{digits}f}"


def _with_se(value, se, digits) -> str:
    return _fmt(value, digits) + (f" ± {se:.{digits}f}" if value is not None and se is not None else "")


def _cell(cell, compare_paper, digits) -> str:
    ours = "missing" if cell["why"] == "ours" else _with_se(cell["ours"], cell["se"], digits)
    judged = f" {cell['verdict']}" if cell["verdict"] in VERDICTS else ""
    if not compare_paper or cell["paper"] is None:
        return ours + judged
    return (f"{ours} / {_with_se(cell['paper'], cell['paper_se'], digits)} / "
            f"{_fmt(cell['delta'], digits, signed=True)}{judged}")


def _markdown(rows, columns, compare_paper, digits, avg_legend, note="", footer=None, ref=None) -> str:
    header = ["Base model", "Method", *columns]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        cells = [_cell(row["cells"][c], compare_paper, digits) for c in columns]
        lines.append("| " + " | ".join([row["base_model"], row["method"], *cells]) + " |")
    source = ref.source if ref is not None else "the reference"
    legend = ("Cells: ours ± SE / reference ± SE / Δ (ours − reference), in percent, and the verdict. "
              if compare_paper else "Cells: ours ± SE, in percent, and the verdict. ")
    legend += (f"Reference: {source}. SE: response sampling on the benchmark's problems (not training "
               "seeds; docs/evaluation.md). Verdict: consistent when the reference's value lies within "
               "ours ± 2 SE (both SEs combined when the reference gives one; ± half its rounding), "
               "else above / below (ours higher / lower). ")
    legend += avg_legend
    if note:
        legend += f"\n\n**Note.** {note}"
    notes = [f"- {r['base_model']} / {r['method']}: missing — {r['reason']}"
             for r in rows if r["status"] == "missing"]
    gaps = [f"- {r['base_model']} / {r['method']}: {reason}" for r in rows if r["status"] == "incomplete"
            for reason in dict.fromkeys(r["missing_cells"].values())]
    lines += ["", legend] + (["", "Missing rows:", *notes] if notes else [])
    lines += (["", "Missing cells:", *gaps] if gaps else []) + (["", footer] if footer else [])
    return "\n".join(lines) + "\n"


def _csv(rows, columns, compare_paper) -> str:
    buf = io.StringIO()
    header = ["base_model", "method", "status", "reason"]
    parts = ("", "_se", "_paper", "_paper_se", "_delta", "_verdict") if compare_paper else ("", "_se", "_verdict")
    for c in columns:
        header += [f"{c}{part}" for part in parts]
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(header)
    fields = {"": "ours", "_se": "se", "_paper": "paper", "_paper_se": "paper_se", "_delta": "delta"}
    for row in rows:
        line = [row["base_model"], row["method"], row["status"], row["reason"]]
        for c in columns:
            cell = row["cells"][c]
            for part in parts:
                if part == "_verdict":
                    line.append(_verdict_text(cell))
                else:
                    value = cell[fields[part]]
                    line.append("" if value is None else str(round(value, 4)))
        writer.writerow(line)
    return buf.getvalue()


def _verdict_text(cell) -> str:
    """The CSV's verdict: the word, or `missing: <what>`; empty where there is no cell."""
    if cell["verdict"] == "missing":
        return "missing: " + {"ours": "no value of ours", "reference": "not in the reference",
                              "se": "no SE"}[cell["why"]]
    return cell["verdict"] or ""
