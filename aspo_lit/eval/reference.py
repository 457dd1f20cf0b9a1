"""A table's reference: per (row, column) cell a value and its standard error, in the format of the
``compare`` command's reference files (docs/compare.md), and the verdict of a cell of ours against it.

    python -m aspo_lit table1 --config conf/table1.yaml --compare_paper true                  # the paper's
    python -m aspo_lit table1 --config conf/table1.yaml --reference their_run/table1.reference.json

A reference file is JSON: the compare format's envelope (``format: aspo-lit-reference``,
``version: 1``, ``commit``, ``config``) with ``kind: table`` and, for each row of the table, its
cells as ``{mean, se, sd, n}`` as a ``compare`` cell is: ``mean`` the value in percent, ``se`` its
sampling standard error (``null`` for a single run that gave none: the paper's), ``sd`` the spread
over ``n`` training runs (``null`` for one run). docs/evaluation.md ("Reference files") lists the
fields. The paper's Tables 1-3 are shipped in it (``aspo_lit/references/paper_table{1,2,3}.json``,
built from ``aspo_lit/eval/data/table*.csv`` by :func:`reference_from_csv`), and every table
command writes its own run beside its table (``<out_dir>/<table>.reference.json``), so a lab can
publish its run and others compare with it.

The verdict (docs/evaluation.md, "Standard errors and verdicts"): a cell is ``consistent`` when
``|ours - reference| <= k·sqrt(se² + se_ref²) + resolution/2`` (k = 2; ``resolution``: the
reference's rounding, 0.1 point for the paper), else ``above`` (ours is higher) or ``below``.
"""
from __future__ import annotations

import csv
import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import yaml

from aspo_lit.configs import REFERENCE_FORMAT, REFERENCE_VERSION, SHIPPED_REFERENCES, git_commit, shipped_reference

FORMAT, VERSION, KIND = REFERENCE_FORMAT, REFERENCE_VERSION, "table"
#: the verdict's half-width in SE units: the reference's value within ours ± 2 SE
VERDICT_K = 2.0
REFERENCES = SHIPPED_REFERENCES
KEY_COLUMNS = ("base_model", "method")
VERDICTS = ("consistent", "above", "below")
RULE = ("consistent when |ours - mean| <= k * sqrt(se_ours^2 + se^2) + resolution/2, else above/below "
        "(ours higher/lower); se null counts as 0")


#: what the shipped paper references (aspo_lit/references/paper_<table>.json) say they are
PAPER_SOURCE = {name: f"the paper's {name.replace('table', 'Table ')}, single runs without SEs"
                for name in ("table1", "table2", "table3")}


class ReferenceError(ValueError):
    """A reference file that cannot be used: the message names the file and the field."""


@dataclass(frozen=True)
class ReferenceCell:
    """One cell of a reference: its value and standard error (percent; ``se`` None: none given)."""
    mean: float
    se: float | None = None


@dataclass(frozen=True)
class TableReference:
    """A table's reference values: ``rows`` in the file's order, ``columns`` in order of first use."""
    table: str
    source: str
    path: str | None
    rows: dict[tuple[str, str], dict[str, ReferenceCell]]
    columns: list[str]
    resolution: float = 0.0
    k: float = VERDICT_K

    def cell(self, key: tuple[str, str], column: str) -> ReferenceCell | None:
        return self.rows.get(tuple(key), {}).get(column)


def verdict(ours: float, se: float, reference: ReferenceCell, resolution: float = 0.0,
            k: float = VERDICT_K) -> str:
    """``consistent`` when the reference's value (± half its rounding) lies within ``ours ± k·SE``,
    SE the two independent SEs combined (``sqrt(se² + se_ref²)``; a reference without an SE, a single
    run like the paper's, adds none); else ``above`` (ours is higher) or ``below``."""
    if not (math.isfinite(ours) and math.isfinite(se) and se >= 0):
        raise ValueError(f"verdict needs a finite value and SE >= 0, got {ours} ± {se}")
    halfwidth = k * math.hypot(se, reference.se or 0.0) + resolution / 2
    delta = ours - reference.mean
    if abs(delta) <= halfwidth:
        return "consistent"
    return "above" if delta > 0 else "below"


# ---------------------------------------------------------------------------------------------
# files

def resolve_table_reference(name: str | None, table: str) -> Path:
    """A file path as given; ``None`` or ``paper``: the paper's values of ``table``, shipped; another
    bare name: ``aspo_lit/references/<name>.json``."""
    if name is None or name == "paper":
        return REFERENCES / f"paper_{table}.json"
    path = Path(name)
    if path.is_file():
        return path
    if (shipped := shipped_reference(name, REFERENCES)) is not None:
        return shipped
    raise ReferenceError(f"reference {name}: no such file (the paper's values: --reference paper)")


def load_reference(reference, table: str, paper_csv=None) -> TableReference:
    """The values a table's cells are judged against: ``reference`` (a ``TableReference``, a file or
    a shipped name), else the paper's CSV ``paper_csv`` when given, else the paper's shipped values."""
    if isinstance(reference, TableReference):
        return reference
    if reference is None and paper_csv is not None:
        return parse_table_reference(reference_from_csv(paper_csv, table, PAPER_SOURCE[table]), table, str(paper_csv))
    return read_table_reference(None if reference is None else str(reference), table)


def read_table_reference(name: str | None, table: str) -> TableReference:
    """Load and check a table reference (a path, or a shipped name; None: the paper's); errors name
    the file and the field."""
    path = resolve_table_reference(name, table)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ReferenceError(f"reference {path}: not JSON ({err})") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ReferenceError(f"reference {path}: cannot read it ({err})") from None
    return parse_table_reference(data, table, str(path))


def parse_table_reference(data, table: str, where: str = "reference") -> TableReference:
    """A reference's JSON (as loaded) as a :class:`TableReference` for ``table``."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ReferenceError(f"reference {where}: not an aspo-lit reference (its 'format' must be {FORMAT!r})")
    if data.get("version") != VERSION:
        raise ReferenceError(f"reference {where}: version {data.get('version')!r}; this aspo-lit reads {VERSION}")
    if data.get("kind") != KIND:
        raise ReferenceError(f"reference {where}: kind {data.get('kind')!r}, not {KIND!r} (bands over runs' "
                             "windows are for `python -m aspo_lit compare`)")
    if data.get("table") != table:
        raise ReferenceError(f"reference {where}: field 'table' is {data.get('table')!r}, not {table!r}")
    resolution = _number(data.get("resolution", 0.0), f"reference {where}: field 'resolution'", minimum=0.0)
    k = _number((data.get("band") or {}).get("k", VERDICT_K), f"reference {where}: field 'band.k'", minimum=0.0)
    if not isinstance(data.get("rows"), list):
        raise ReferenceError(f"reference {where}: field 'rows' missing or not a list")
    rows, columns = {}, []
    for i, row in enumerate(data["rows"]):
        at = f"reference {where}: rows[{i}]"
        if not isinstance(row, dict) or not all(isinstance(row.get(c), str) for c in KEY_COLUMNS):
            raise ReferenceError(f"{at} needs string 'base_model' and 'method'")
        if not isinstance(row.get("metrics"), dict):
            raise ReferenceError(f"{at}: field 'metrics' missing or not an object")
        key = (row["base_model"], row["method"])
        if key in rows:
            raise ReferenceError(f"{at}: row {key[0]} / {key[1]} given twice")
        cells = {}
        for column, cell in row["metrics"].items():
            name = f"{at}.metrics[{column!r}]"
            if not isinstance(cell, dict):
                raise ReferenceError(f"{name} must be an object {{mean, se, sd, n}}")
            se = cell.get("se")
            cells[column] = ReferenceCell(_number(cell.get("mean"), f"{name} lacks a numeric 'mean'"),
                                          None if se is None else _number(se, f"{name}: 'se'", minimum=0.0))
            columns += [column] if column not in columns else []
        rows[key] = cells
    return TableReference(table, str(data.get("source") or where), where, rows, columns, resolution, k)


def _number(value, what: str, minimum: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or (minimum is not None and value < minimum):
        raise ReferenceError(f"{what} must be a finite number" + (f" >= {minimum:g}" if minimum is not None else "")
                             + f", got {value!r}")
    return float(value)


def table_reference_json(rows: list[dict], table: str, source: str, *, config: dict | None = None,
                         resolution: float = 0.0, details: dict | None = None) -> dict:
    """A table's values as a reference file (JSON-ready): ``rows`` as ``render_table`` returns them
    (our values and SEs; cells without a value of ours are left out, rows without any too).
    ``details``: {(base_model, method): {column: {problems, k, se_problems}}} stored beside each cell."""
    details = {tuple(k): v for k, v in (details or {}).items()}
    out_rows = []
    for row in rows:
        key = (row["base_model"], row["method"])
        metrics = {}
        for column, cell in row["cells"].items():
            if cell["ours"] is None:
                continue
            known = details.get(key, {})
            # Table 3 shows `<column>_avg@K` under the paper's `<column>`
            detail = known.get(column) or next((v for c, v in known.items() if c.startswith(f"{column}_avg@")), {})
            metrics[column] = {"mean": cell["ours"], "se": cell.get("se"), "sd": None, "n": 1, **detail}
        if metrics:
            out_rows.append({"base_model": key[0], "method": key[1], "metrics": metrics})
    # through JSON: a config may hold paths and other objects YAML would not write plainly
    text = yaml.safe_dump(json.loads(json.dumps(config, default=str)), sort_keys=False) if config is not None else None
    return {"format": FORMAT, "version": VERSION, "kind": KIND, "table": table, "source": source,
            "config": {"path": None, "sha256": hashlib.sha256(text.encode()).hexdigest(), "text": text}
            if text is not None else None,
            "commit": git_commit(), "resolution": resolution,
            "band": {"k": VERDICT_K, "rule": RULE},
            "rows": out_rows}


def reference_from_csv(path, table: str, source: str, resolution: float = 0.1) -> dict:
    """The paper's table (``aspo_lit/eval/data/<table>.csv``: base_model, method, a column per cell,
    in percent) as a reference: single runs, so no SE and no SD; ``resolution``: the rounding of its
    printed values. How the shipped ``paper_<table>.json`` files are made (a test checks they agree)."""
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        columns = [c for c in reader.fieldnames if c not in KEY_COLUMNS]
        rows = [{"base_model": r["base_model"], "method": r["method"],
                 "metrics": {c: {"mean": float(r[c]), "se": None, "sd": None, "n": 1} for c in columns if r[c]}}
                for r in reader]
    return {"format": FORMAT, "version": VERSION, "kind": KIND, "table": table, "source": source,
            "config": None, "commit": None, "resolution": resolution,
            "band": {"k": VERDICT_K, "rule": RULE}, "rows": rows}


def write_reference(data: dict, path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return path
