"""Table 1 of the paper, recomputed, beside the paper's own numbers.

The paper's figures (aspo_lit/data/table1.csv, copied from the paper) fix the layout: its
columns in order, its rows in order. Each cell shows ours / paper / Δ (ours − paper). Rows of
ours that the paper does not have are appended; paper rows we have no results for are listed
as "missing" with the reason — never filled in.
"""
from __future__ import annotations

import csv
import io
from pathlib import Path

from aspo_lit.benchmarks import BENCHMARKS, TABLE1_BENCHMARKS

PAPER_TABLE1 = Path(__file__).with_name("data") / "table1.csv"
KEY_COLUMNS = ("base_model", "method")


def load_paper_table(path=PAPER_TABLE1) -> tuple[list[str], dict[tuple[str, str], dict]]:
    """(value columns in order, {(base_model, method): {column: float}}) in the paper's row
    order (dicts keep insertion order)."""
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        columns = [c for c in reader.fieldnames if c not in KEY_COLUMNS]
        rows = {(r["base_model"], r["method"]): {c: float(r[c]) for c in columns} for r in reader}
    return columns, rows


def table1_avg(values: dict) -> float | None:
    """The paper's "Avg." column: the mean of the six benchmarks' avg@K (whatever K was used);
    None unless all six are present."""
    found = []
    for name in TABLE1_BENCHMARKS:
        prefix = f"{BENCHMARKS[name].column}_avg@"
        cells = [v for c, v in values.items() if c.startswith(prefix) and v is not None]
        if not cells:
            return None
        found.append(cells[0])
    return sum(found) / len(found)


def render_table1(results: dict, compare_paper: bool = True, missing: dict | None = None,
                  out_dir=None, paper_csv=PAPER_TABLE1, digits: int = 1):
    """Render Table 1.

    results: {(base_model, method): {column: value (percent)}}; "avg" is computed when absent.
    missing: {(base_model, method): reason} for rows that could not be evaluated.
    compare_paper: include the paper's rows, values and deltas; else only our rows, and only
    the columns that hold a value.
    out_dir: when given, also write <out_dir>/table1.md and table1.csv.
    Returns (markdown, rows); each row is {"base_model", "method", "status" ("ok" | "missing"),
    "reason", "cells": {column: {"ours", "paper", "delta"}}}.
    """
    missing = {tuple(k): reason for k, reason in (missing or {}).items()}
    paper_columns, paper = load_paper_table(paper_csv) if compare_paper else ([], {})
    ours = {}
    for key, values in results.items():
        values = dict(values)
        if values.get("avg") is None:
            values["avg"] = table1_avg(values)
        ours[tuple(key)] = values

    columns = list(paper_columns)
    for values in ours.values():
        columns += [c for c in values if c not in columns and c != "avg"]
    if "avg" in columns:   # the paper's last column stays last
        columns.remove("avg")
    columns.append("avg")
    if not compare_paper:
        columns = [c for c in columns if any(v.get(c) is not None for v in ours.values())]

    keys = list(paper) + [k for k in ours if k not in paper]
    keys += [k for k in missing if k not in keys]
    rows = []
    for key in keys:
        values, reference = ours.get(key), paper.get(key, {})
        row = {"base_model": key[0], "method": key[1],
               "status": "ok" if values is not None else "missing",
               "reason": "" if values is not None else missing.get(key, "not evaluated"),
               "cells": {}}
        for c in columns:
            mine, theirs = (values or {}).get(c), reference.get(c)
            delta = mine - theirs if mine is not None and theirs is not None else None
            row["cells"][c] = {"ours": mine, "paper": theirs, "delta": delta}
        rows.append(row)

    markdown = _markdown(rows, columns, compare_paper, digits)
    if out_dir is not None:
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "table1.md").write_text(markdown, encoding="utf-8")
        (out_dir / "table1.csv").write_text(_csv(rows, columns, compare_paper), encoding="utf-8")
    return markdown, rows


def _fmt(value, digits, signed=False) -> str:
    if value is None:
        return "—"
    return f"{value:+.{digits}f}" if signed else f"{value:.{digits}f}"


def _cell(cell, compare_paper, digits) -> str:
    if not compare_paper or cell["paper"] is None:
        return _fmt(cell["ours"], digits)
    ours = "missing" if cell["ours"] is None else _fmt(cell["ours"], digits)
    return f"{ours} / {_fmt(cell['paper'], digits)} / {_fmt(cell['delta'], digits, signed=True)}"


def _markdown(rows, columns, compare_paper, digits) -> str:
    header = ["Base model", "Method", *columns]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        cells = [_cell(row["cells"][c], compare_paper, digits) for c in columns]
        lines.append("| " + " | ".join([row["base_model"], row["method"], *cells]) + " |")
    legend = ("Cells: ours / paper / Δ (ours − paper), in percent. " if compare_paper
              else "Cells: ours, in percent. ")
    legend += "avg = mean of the six benchmarks' avg@K."
    notes = [f"- {r['base_model']} / {r['method']}: missing — {r['reason']}"
             for r in rows if r["status"] == "missing"]
    return "\n".join(lines + ["", legend] + (["", "Missing rows:", *notes] if notes else [])) + "\n"


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
