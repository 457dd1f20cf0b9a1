"""Tables 1 (math), 2 (code) and 3 (out of domain) of the paper, recomputed, beside the paper's own
numbers.

The paper's figures (aspo_lit/eval/data/table1.csv, table2.csv, table3.csv, copied from the paper) fix the
layout: its columns in order, its rows in order. Each cell shows ours / paper / Δ (ours − paper).
Rows of ours that the paper does not have are appended; paper rows we have no results for are
listed as "missing" with the reason — never filled in. A row of ours whose benchmark could not be
loaded or evaluated is "incomplete": its other cells are shown, those are "missing" with the reason.

Table 3 gives one accuracy per benchmark (column ``arc_challenge``, ...) and no K: our avg@K (the
mean accuracy over K samples, an estimate of the same single-sample accuracy whatever K is) fills
that column; our pass@K is shown beside it, with no paper value.
"""
from __future__ import annotations

import csv
import io
from dataclasses import dataclass
from pathlib import Path

from aspo_lit.eval.datasets import BENCHMARKS, TABLE1_BENCHMARKS, TABLE2_BENCHMARKS, TABLE3_BENCHMARKS

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


def render_table2(results: dict, compare_paper: bool = True, missing: dict | None = None,
                  out_dir=None, paper_csv=PAPER_TABLE2, digits: int = 1, note: str | None = None):
    """Render Table 2 (code: LiveCodeBench v5 avg@8 / pass@8, v6 avg@16 / pass@16, avg), with
    ``note`` under it (``lcb_tests_note``: which tests were graded). Same arguments and return
    value as ``render_table1``; files ``table2.md`` / ``table2.csv``."""
    return render_table(results, "table2", compare_paper, missing, out_dir, paper_csv, digits, note)


def render_table1(results: dict, compare_paper: bool = True, missing: dict | None = None,
                  out_dir=None, paper_csv=PAPER_TABLE1, digits: int = 1):
    """Render Table 1 (see ``render_table``)."""
    return render_table(results, "table1", compare_paper, missing, out_dir, paper_csv, digits)


def render_table(results: dict, table: str = "table1", compare_paper: bool = True,
                 missing: dict | None = None, out_dir=None, paper_csv=None, digits: int = 1,
                 note: str | None = None, missing_cells: dict | None = None, footer: str | None = None):
    """Render one of the paper's tables (``table1``, ``table2`` or ``table3``).

    results: {(base_model, method): {column: value (percent)}}; "avg" is computed when absent.
    missing: {(base_model, method): reason} for rows that could not be evaluated (no model).
    missing_cells: {(base_model, method): {column: reason}} for cells of an evaluated row that
    could not be computed (the row is then "incomplete").
    compare_paper: include the paper's rows, values and deltas; else only our rows, and only
    the columns that hold a value or a missing cell.
    out_dir: when given, also write <out_dir>/<table>.md and <table>.csv.
    note: a caveat printed under the table (default: the table's own, if any).
    footer: the last line (``evaluate_table``: the count of computed and missing cells).
    Returns (markdown, rows); each row is {"base_model", "method", "status" ("ok" | "incomplete" |
    "missing"), "reason", "missing_cells": {column: reason}, "cells": {column: {"ours", "paper",
    "delta"}}}.
    """
    spec = TABLES[table]
    paper_csv = paper_csv or spec.paper_csv
    note = spec.note if note is None else note
    missing = {tuple(k): reason for k, reason in (missing or {}).items()}
    missing_cells = {tuple(k): dict(cells) for k, cells in (missing_cells or {}).items() if cells}
    paper_columns, paper = load_paper_table(paper_csv) if compare_paper else ([], {})
    ours = {}
    for key, values in results.items():
        values = dict(values)
        if values.get("avg") is None:
            values["avg"] = table_avg(values, spec.avg_benchmarks)
        if spec.single_figure:
            values = _single_figures(values, spec.avg_benchmarks)
        ours[tuple(key)] = values

    columns = list(paper_columns)
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

    keys = list(paper) + [k for k in ours if k not in paper]
    keys += [k for k in missing if k not in keys]
    rows = []
    for key in keys:
        values, reference = ours.get(key), paper.get(key, {})
        gaps = missing_cells.get(key, {}) if values is not None else {}
        status = "missing" if values is None else "incomplete" if gaps else "ok"
        reason = missing.get(key, "not evaluated") if values is None else \
            "; ".join(dict.fromkeys(gaps.values()))
        row = {"base_model": key[0], "method": key[1], "status": status, "reason": reason,
               "missing_cells": gaps, "cells": {}}
        for c in columns:
            mine, theirs = (values or {}).get(c), reference.get(c)
            delta = mine - theirs if mine is not None and theirs is not None else None
            row["cells"][c] = {"ours": mine, "paper": theirs, "delta": delta}
        rows.append(row)

    markdown = _markdown(rows, columns, compare_paper, digits, spec.avg_legend, note, footer)
    if out_dir is not None:
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / f"{table}.md").write_text(markdown, encoding="utf-8")
        (out_dir / f"{table}.csv").write_text(_csv(rows, columns, compare_paper), encoding="utf-8")
    return markdown, rows


def _single_figures(values: dict, benchmarks) -> dict:
    """`<column>_avg@K` -> `<column>` (the paper's single accuracy column); those columns first,
    in the paper's order, then the rest (pass@K) as they came."""
    values, first = dict(values), {}
    for name in benchmarks:
        column = BENCHMARKS[name].column
        found = [c for c in values if c.startswith(f"{column}_avg@")]
        if found and values.get(column) is None:
            first[column] = values.pop(found[0])
        elif column in values:
            first[column] = values.pop(column)
    return {**first, **values}


def _fmt(value, digits, signed=False) -> str:
    if value is None:
        return "—"
    return f"{value:+.{digits}f}" if signed else f"{value:.{digits}f}"


def _cell(cell, compare_paper, digits, gap=False) -> str:
    if not compare_paper or cell["paper"] is None:
        return "missing" if gap and cell["ours"] is None else _fmt(cell["ours"], digits)
    ours = "missing" if cell["ours"] is None else _fmt(cell["ours"], digits)
    return f"{ours} / {_fmt(cell['paper'], digits)} / {_fmt(cell['delta'], digits, signed=True)}"


def _markdown(rows, columns, compare_paper, digits, avg_legend, note="", footer=None) -> str:
    header = ["Base model", "Method", *columns]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        cells = [_cell(row["cells"][c], compare_paper, digits, c in row["missing_cells"]) for c in columns]
        lines.append("| " + " | ".join([row["base_model"], row["method"], *cells]) + " |")
    legend = ("Cells: ours / paper / Δ (ours − paper), in percent. " if compare_paper
              else "Cells: ours, in percent. ")
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
    for c in columns:
        header += [c, f"{c}_paper", f"{c}_delta"] if compare_paper else [c]
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(header)
    for row in rows:
        line = [row["base_model"], row["method"], row["status"], row["reason"]]
        for c in columns:
            cell = row["cells"][c]
            parts = [cell["ours"], cell["paper"], cell["delta"]] if compare_paper else [cell["ours"]]
            line += ["" if v is None else str(round(v, 4)) for v in parts]
        writer.writerow(line)
    return buf.getvalue()
