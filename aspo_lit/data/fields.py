"""Reading one upstream row: a dotted field path, a chat-message prompt, an instruction template
around the problem, a gold answer as one string.

The paper's training sets (§7.1) each store the problem and its answer their own way:
DeepScaleR-Preview as ``problem`` / ``answer``; Skywork-OR1-RL-Data and DAPO-Math-17k in verl's
layout, the problem as a chat message list under ``prompt`` and the answer under
``reward_model.ground_truth`` (Skywork-OR1's as a JSON-encoded list); DAPO-Math-17k's prompt wraps
the problem in its own instruction. These helpers turn any of them into the bare problem text and
one gold string; anything they cannot read raises ``BadRowError`` with the row's location.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from aspo_lit.data.sources import BadRowError

MISSING = object()   # a field path that leads nowhere (distinct from a stored null)


def field_value(row: Any, path: str) -> Any:
    """The value at a dotted `path` of `row` (``reward_model.ground_truth``), or `MISSING`.

    Keys may themselves contain dots (``extra_info.model_difficulty.DeepSeek-R1-Distill-Qwen-1.5B``):
    at each level the longest key that exists wins.
    """
    parts, node, i = path.split("."), row, 0
    while i < len(parts):
        if not isinstance(node, Mapping):
            return MISSING
        for j in range(len(parts), i, -1):
            key = ".".join(parts[i:j])
            if key in node:
                node, i = node[key], j
                break
        else:
            return MISSING
    return node


def problem_text(value: Any, where: str, field: str, template: str | None = None) -> str:
    """The problem of a row: a string, or the content of the last user message of a chat message
    list; with `template` (an instruction around ``{problem}``), the text between its two parts."""
    if isinstance(value, (list, tuple)) and value and all(isinstance(m, Mapping) for m in value):
        users = [m.get("content") for m in value if m.get("role") == "user"]
        if not users:
            raise BadRowError(f"{where}: field {field!r} is a message list without a user message")
        value = users[-1]
    if value is MISSING or not isinstance(value, str) or not value.strip():
        raise BadRowError(f"{where}: field {field!r} is missing or not a non-empty string")
    text = value.strip()
    if template is not None:
        text = strip_template(text, template, where, field)
    return text


def strip_template(text: str, template: str, where: str, field: str) -> str:
    """`text` without the instruction `template` wraps it in (``...{problem}...``)."""
    head, _, tail = template.partition("{problem}")
    head, tail = head.strip(), tail.strip()
    if not (text.startswith(head) and text.endswith(tail)) or len(text) < len(head) + len(tail):
        raise BadRowError(f"{where}: field {field!r} does not match the source's template "
                          f"{_preview(template)!r}")
    inner = text[len(head):len(text) - len(tail)].strip()
    if not inner:
        raise BadRowError(f"{where}: field {field!r} holds the template with an empty problem")
    return inner


def answer_text(value: Any, where: str, field: str) -> str:
    """One gold answer string: a string; an integer (``27.0`` → ``"27"``); a list whose elements
    are all the same answer. Several different answers are a bad row: the reward grades one gold."""
    if isinstance(value, (list, tuple)):
        answers = list(dict.fromkeys(answer_text(v, where, field) for v in value))
        if len(answers) != 1:
            raise BadRowError(f"{where}: field {field!r} holds {len(answers)} different answers "
                              f"{answers[:3]!r}; the reward grades one gold answer")
        return answers[0]
    if isinstance(value, bool) or value is MISSING or value is None:
        raise BadRowError(f"{where}: field {field!r} is missing")
    if isinstance(value, float):
        if not math.isfinite(value):
            raise BadRowError(f"{where}: field {field!r} is {value!r}")
        value = int(value) if value.is_integer() else value
    if isinstance(value, (int, float)):
        return str(value)
    if not isinstance(value, str):
        raise BadRowError(f"{where}: field {field!r} is a {type(value).__name__}, not a string")
    if not value.strip():
        raise BadRowError(f"{where}: field {field!r} is empty")
    return value.strip()


def decoded(value: Any, where: str, field: str) -> Any:
    """A JSON-encoded field's value (Skywork-OR1 stores its ground truth as ``'["336"]'``)."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as err:
        raise BadRowError(f"{where}: field {field!r} is not valid JSON ({err.msg})") from None


def _preview(text: str, n: int = 60) -> str:
    return text if len(text) <= n else text[:n] + "..."


def mapped(raw: Mapping[str, Any], ours: str, fields: Mapping[str, str], json_fields: list[str], where: str) -> tuple[Any, str]:
    """(value, upstream path) of our field `ours` in a raw row, through the source's mapping."""
    path = fields.get(ours, ours)
    value = field_value(raw, path)
    if path in json_fields and value is not MISSING:
        value = decoded(value, where, path)
    return value, path


def math_row(raw: Mapping[str, Any], fields: Mapping[str, str], json_fields: list[str], template: str | None,
             where: str) -> dict[str, str]:
    """``{id, problem, answer}`` of a raw math row (the problem bare, the answer one string)."""
    problem, problem_path = mapped(raw, "problem", fields, json_fields, where)
    answer, answer_path = mapped(raw, "answer", fields, json_fields, where)
    row_id, _ = mapped(raw, "id", fields, json_fields, where)
    return {"id": where if row_id is MISSING or row_id is None else str(row_id),
            "problem": problem_text(problem, where, problem_path, template),
            "answer": answer_text(answer, where, answer_path)}
