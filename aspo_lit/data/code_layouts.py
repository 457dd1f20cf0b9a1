"""Code training sets in their upstream row layouts, as normalized code rows (paper §7.1, App. B:
"DeepCoder, CodeContests and CodeForces").

DeepCoder-Preview-Dataset, LiveCodeBench and verl-style rows (Archer2.0-Code-1.5B) are read by
`data_modules.code.normalize_code_row` directly (after the source's field mapping). Two sets need
their own reading, named by ``layout`` in a source:

* ``code_contests`` (deepmind/code_contests): statement ``description``; tests from dicts of
  parallel lists ``{"input": [...], "output": [...]}``, by default ``public_tests+private_tests``
  (DeepMind's ``generated_tests`` are left out unless the source's ``fields`` names them);
  ``time_limit {seconds, nanos}``, ``memory_limit_bytes``; id ``name``.
* ``codeforces`` (open-r1/codeforces): the statement is composed from ``description``,
  ``input_format``, ``output_format``, ``examples`` and ``note`` under Markdown headings; tests
  ``official_tests`` (a list of ``{input, output}``); ``time_limit`` in seconds, ``memory_limit``
  in MB; id ``id``. Which problems the reward can grade (stdin/stdout, no checker, not
  interactive, complete official tests) is for the source's filters to say.

Every test is a stdin test (compared as LiveCodeBench compares stdout).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from aspo_lit.data.fields import MISSING, field_value
from aspo_lit.data.sources import BadRowError

LAYOUTS = ("fields", "code_contests", "codeforces")
DEFAULT_TESTS = {"code_contests": "public_tests+private_tests", "codeforces": "official_tests"}


def layout_row(raw: Mapping[str, Any], layout: str, where: str, tests_field: str | None = None) -> dict[str, Any]:
    """A raw ``code_contests`` / ``codeforces`` row as ``{id, problem, tests, time_limit_s,
    memory_limit_bytes}`` (then validated by ``normalize_code_row``)."""
    if layout not in DEFAULT_TESTS:
        raise ValueError(f"unknown code layout {layout!r}; one of {LAYOUTS}")
    tests = []
    for name in (tests_field or DEFAULT_TESTS[layout]).split("+"):
        tests += _tests(field_value(raw, name.strip()), where, name.strip())
    if layout == "code_contests":
        limit = raw.get("time_limit") or {}
        seconds = (limit.get("seconds") or 0) + (limit.get("nanos") or 0) / 1e9 if isinstance(limit, Mapping) else 0
        return {"id": raw.get("name"), "problem": raw.get("description"), "tests": tests,
                "time_limit_s": seconds or None, "memory_limit_bytes": raw.get("memory_limit_bytes") or None}
    memory_mb = raw.get("memory_limit")
    return {"id": raw.get("id"), "problem": codeforces_statement(raw), "tests": tests,
            "time_limit_s": raw.get("time_limit") or None,
            "memory_limit_bytes": int(memory_mb * 2**20) if isinstance(memory_mb, (int, float)) and memory_mb > 0 else None}


def codeforces_statement(raw: Mapping[str, Any]) -> str | None:
    """An open-r1/codeforces problem as one statement: description, input and output formats,
    the examples and the note, each under a Markdown heading."""
    description = raw.get("description")
    if not isinstance(description, str) or not description.strip():
        return None
    parts = [description.strip()]
    for heading, key in (("Input Format", "input_format"), ("Output Format", "output_format")):
        if isinstance(raw.get(key), str) and raw[key].strip():
            parts.append(f"## {heading}\n{raw[key].strip()}")
    examples = [e for e in raw.get("examples") or [] if isinstance(e, Mapping)]
    if examples:
        shown = "\n".join(f"```input\n{e.get('input', '').rstrip()}\n```\n```output\n{e.get('output', '').rstrip()}\n```"
                          for e in examples)
        parts.append(f"## Examples\n{shown}")
    if isinstance(raw.get("note"), str) and raw["note"].strip():
        parts.append(f"## Note\n{raw['note'].strip()}")
    return "\n\n".join(parts)


def _tests(value: Any, where: str, name: str) -> list[dict[str, str]]:
    """Tests stored as ``{"input": [...], "output": [...]}`` or as a list of ``{input, output}``."""
    if value is MISSING or value is None:
        return []
    if isinstance(value, Mapping):
        inputs, outputs = value.get("input") or [], value.get("output") or []
        if len(inputs) != len(outputs):
            raise BadRowError(f"{where}: {name} has {len(inputs)} inputs but {len(outputs)} outputs")
        return [{"input": i, "output": o, "type": "stdin"} for i, o in zip(inputs, outputs)]
    if isinstance(value, list) and all(isinstance(t, Mapping) for t in value):
        return [{"input": t.get("input"), "output": t.get("output"), "type": "stdin"} for t in value]
    raise BadRowError(f"{where}: {name} is neither {{input: [...], output: [...]}} nor a list of tests")
