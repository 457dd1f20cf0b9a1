"""Code problems as rows: the layouts the code task reads, normalized to one.

The paper's code runs (§7, Appendix B) train on DeepCoder, CodeContests and CodeForces problems
with the same recipe as math (16 samples at T = 1.0), graded by running the program on the
problem's tests (``aspo_lit.rewards.CodeReward``: 1 iff every test passes). Prompts are
LiveCodeBench's generic code-generation template (``aspo_lit.prompts``), with the LeetCode
starter code for functional problems.

Rows come from a local JSONL/JSON/parquet file or folder, or an HF hub dataset id
(``datasets.load_dataset``). Accepted layouts, normalized to ``{id, problem, starter_code,
answer}`` where ``answer`` is the test spec string of ``aspo_lit.rewards.code.code_gold``:

* the normalized one (``problem``, ``starter_code``, ``tests: [{input, output, type}]``,
  ``fn_name``, optional ``time_limit_s`` / ``memory_limit_bytes``);
* LiveCodeBench's (``question_content``, ``starter_code``, ``public_test_cases`` and
  ``private_test_cases`` as JSON — the private ones possibly base64/zlib/pickle-encoded, decoded
  here by an unpickler that refuses every global —, ``metadata: {"func_name"}``);
* DeepCoder's (``problem``, ``tests`` as a JSON string: a list of ``{input, output, testtype,
  metadata: {func_name}}``, or ``{"inputs": [...], "outputs": [...], "fn_name"?}``).

A row without a statement or usable tests stops the run naming the file and line
(``on_bad_row: error``) or is skipped, counted and logged (``skip``).
"""

from __future__ import annotations

import base64
import io
import json
import pickle
import re
import zlib
from typing import Any, Mapping

from aspo_lit.data.sources import BadRowError, RowReport, collect_rows
from aspo_lit.rewards.code import code_gold

_DEF = re.compile(r"^\s*def\s+([A-Za-z_]\w*)\s*\(", re.MULTILINE)


class _NoGlobals(pickle.Unpickler):
    """Unpickles plain data only: any class or function reference is refused."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}")


def _json_or_encoded(value: Any) -> Any:
    """A test list stored as JSON, or LiveCodeBench's base64(zlib(pickle(JSON string)))."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        pass
    try:
        decoded = _NoGlobals(io.BytesIO(zlib.decompress(base64.b64decode(value.encode())))).load()
        return json.loads(decoded) if isinstance(decoded, (str, bytes)) else decoded
    except Exception as err:   # noqa: BLE001 - any decoding failure is a bad row
        raise ValueError(f"tests are neither JSON nor LiveCodeBench-encoded ({type(err).__name__})") from None


def _tests_of(raw: Mapping[str, Any]) -> tuple[list[dict], str | None]:
    """(tests [{input, output}], fn_name from the tests' metadata) of a raw row."""
    fn_name = None
    if "tests" in raw and raw["tests"] is not None:
        tests = _json_or_encoded(raw["tests"])
        parts = [tests]
    else:
        parts = [_json_or_encoded(raw.get(k)) for k in ("public_test_cases", "private_test_cases")
                 if raw.get(k) not in (None, "", [])]
    out: list[dict] = []
    for part in parts:
        if isinstance(part, Mapping) and "functional" in part and "inputs" not in part:
            raise ValueError("assert-style tests (a 'functional' check script) cannot be graded by "
                             "CodeReward, which compares outputs")
        if isinstance(part, Mapping) and "inputs" in part:   # {"inputs": [...], "outputs": [...]}
            fn_name = part.get("fn_name") or fn_name
            for i, o in zip(part["inputs"], part.get("outputs") or []):
                if fn_name and isinstance(i, list):   # call-based: one JSON argument per line
                    i = "\n".join(json.dumps(a) for a in i)
                    o = json.dumps(o[0] if isinstance(o, list) and len(o) == 1 else o)
                out.append({"input": i, "output": o})
            continue
        if not isinstance(part, list):
            raise ValueError("'tests' must be a list of {input, output} objects")
        for t in part:
            if not isinstance(t, Mapping):
                raise ValueError("every test must be an object with 'input' and 'output'")
            meta = _mapping(t.get("metadata"))
            if meta and meta.get("func_name"):
                fn_name = meta["func_name"]
            out.append({"input": t.get("input"), "output": t.get("output"),
                        "type": t.get("type") or t.get("testtype")})
    return out, fn_name


def _mapping(value: Any) -> Mapping | None:
    """A metadata field as a mapping: given as an object or as a JSON string (LiveCodeBench); else None."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return None
    return value if isinstance(value, Mapping) else None


def normalize_code_row(raw: Any, where: str, problem_key: str = "problem") -> dict[str, Any]:
    """One raw row → ``{id, problem, starter_code, fn_name, num_tests, answer}``; raises
    ``BadRowError`` naming ``where`` when it is unusable."""
    if not isinstance(raw, Mapping):
        raise BadRowError(f"{where}: expected a JSON object, got {type(raw).__name__}")
    problem = raw.get(problem_key)
    if problem is None and problem_key == "problem":
        problem = raw.get("question_content") or raw.get("question")
    if not isinstance(problem, str) or not problem.strip():
        raise BadRowError(f"{where}: field {problem_key!r} is missing or not a non-empty string")
    try:
        tests, meta_fn = _tests_of(raw)
    except (ValueError, TypeError) as err:
        raise BadRowError(f"{where}: {err}") from None
    if not tests:
        raise BadRowError(f"{where}: no tests")
    for i, t in enumerate(tests):
        if not isinstance(t.get("input"), str) or not isinstance(t.get("output"), str):
            raise BadRowError(f"{where}: test {i} needs string 'input' and 'output'")
    starter = raw.get("starter_code") or ""
    metadata = _mapping(raw.get("metadata"))
    fn_name = raw.get("fn_name") or (metadata.get("func_name") if metadata else None) \
        or meta_fn
    kinds = {t.get("type") for t in tests} - {None, "stdin_stdout"}
    if "functional" in kinds and not fn_name and starter:
        names = _DEF.findall(starter)
        fn_name = names[-1] if names else None
    if "functional" in kinds and not fn_name:
        raise BadRowError(f"{where}: functional tests but no fn_name")
    if fn_name and (not isinstance(fn_name, str) or not fn_name.isidentifier()):
        raise BadRowError(f"{where}: fn_name {fn_name!r} is not an identifier")
    if "stdin" in kinds and fn_name and "functional" not in kinds:
        fn_name = None   # stdin tests graded on stdout, whatever the metadata says
    row = {"tests": tests, "fn_name": fn_name,
           "time_limit_s": raw.get("time_limit_s"), "memory_limit_bytes": raw.get("memory_limit_bytes")}
    return {"id": str(raw.get("id") or raw.get("question_id") or where), "problem": problem,
            "starter_code": starter, "fn_name": fn_name, "num_tests": len(tests),
            "answer": code_gold(row)}


def load_code_rows(source: str, split: str = "train", on_bad_row: str = "error",
                   problem_key: str = "problem") -> tuple[list[dict[str, Any]], RowReport]:
    """Validated code rows of a file, folder or hub dataset (see the module docstring)."""
    rows, report = collect_rows(source, split, on_bad_row, lambda raw, where: normalize_code_row(raw, where, problem_key))
    if not rows:
        raise BadRowError(f"{source}: no usable code rows")
    seen = set()
    for row in rows:
        if row["id"] in seen:
            raise BadRowError(f"{source}: duplicate problem id {row['id']!r}")
        seen.add(row["id"])
    return rows, report
