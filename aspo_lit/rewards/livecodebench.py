"""LiveCodeBench's test semantics: the program to run, the test spec, and the comparison.

From ``lcb_runner/evaluation/testing_util.py`` (Jain et al., 2025), as the paper's code runs use
them (DeepCoder's reward follows it):

* ``extract_code``: the last closed fenced Python block of the response.
* ``code_gold`` / ``parse_gold``: a problem's tests as one JSON string (what ``CodeReward`` grades
  against), with the row's own time and memory limits when it has them.
* ``stdin`` problems (``stdout_match``): stdout and the expected output are each stripped as a
  whole, split on ``\n`` and stripped line by line; the line counts must agree, and each line must
  be equal as a string or, failing that, as the list of its whitespace-separated tokens read as
  ``decimal.Decimal`` (no float tolerance).
* ``functional`` (LeetCode) problems (``functional_match``): the result of
  ``Solution().<fn_name>(...)`` (a tuple turned into a list) must ``==`` the JSON-decoded expected
  output. The harness sends the result in a tagged JSON encoding (``decode_result``).
* ``LCB_PRELUDE``: the imports LiveCodeBench runs before the program.

``result_matches`` is the one entry the reward uses: any result the program can produce, however
malformed or large, gives True or False, never an exception, in time and memory bounded by the
expected output's size (or, for stdout, the output's own).
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any, Mapping

__all__ = ["LCB_PRELUDE", "CodeSpec", "Opaque", "code_gold", "decode_result", "extract_code",
           "functional_match", "parse_gold", "result_matches", "stdout_match"]

# LiveCodeBench's prelude (lcb_runner/evaluation/testing_util.py ``import_string``).
LCB_PRELUDE = (
    "from string import *\nfrom re import *\nfrom datetime import *\nfrom collections import *\n"
    "from heapq import *\nfrom bisect import *\nfrom copy import *\nfrom math import *\n"
    "from random import *\nfrom statistics import *\nfrom itertools import *\nfrom functools import *\n"
    "from operator import *\nfrom io import *\nfrom sys import *\nfrom json import *\n"
    "from builtins import *\nfrom typing import *\nimport string\nimport re\nimport datetime\n"
    "import collections\nimport heapq\nimport bisect\nimport copy\nimport math\nimport random\n"
    "import statistics\nimport itertools\nimport functools\nimport operator\nimport io\nimport sys\n"
    "import json\nsys.setrecursionlimit(50000)\n"
)




# --------------------------------------------------------------------------- extraction

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+.-]*)[^\n]*\n(.*?)```", re.DOTALL)
_PYTHON_TAGS = {"", "python", "py", "python3", "py3"}


def extract_code(text: str, think_end_token: str | None = "</think>") -> str | None:
    """The last closed fenced Python block of ``text`` (after the last ``think_end_token``).

    A block tagged ``python``/``py``/``python3`` or untagged counts (DeepCoder takes the last
    block, Archer the last ``python`` one); an unclosed final fence (a truncated response) does
    not. None when there is no such block (or ``text`` is not a string).
    """
    if not isinstance(text, str):
        return None
    if think_end_token and think_end_token in text:
        text = text.rsplit(think_end_token, 1)[1]
    blocks = [m.group(2) for m in _FENCE.finditer(text) if m.group(1).lower() in _PYTHON_TAGS]
    if not blocks:
        return None
    code = blocks[-1]
    return code if code.strip() else None


# --------------------------------------------------------------------------- gold (test spec)


@dataclass(frozen=True)
class CodeSpec:
    """A problem's tests: ``tests`` are ``(input, output)`` pairs; ``fn_name`` set = functional."""

    tests: tuple[tuple[str, str], ...]
    fn_name: str | None = None
    time_limit_s: float | None = None
    memory_limit_bytes: int | None = None

    @property
    def kind(self) -> str:
        return "functional" if self.fn_name else "stdin"


def code_gold(row: Mapping[str, Any]) -> str:
    """The gold string of a normalized code row (what ``CodeReward`` grades against): JSON of
    its tests, ``fn_name`` and, when present, the row's own time and memory limits."""
    spec = {"fn_name": row.get("fn_name") or None,
            "tests": [{"input": t["input"], "output": t["output"]} for t in row["tests"]]}
    for key in ("time_limit_s", "memory_limit_bytes"):
        if row.get(key):
            spec[key] = row[key]
    return json.dumps(spec, ensure_ascii=False, separators=(",", ":"))


@functools.lru_cache(maxsize=4096)
def _parse_gold_str(gold: str) -> CodeSpec:
    return _spec_from_mapping(json.loads(gold))


def _spec_from_mapping(obj: Mapping[str, Any]) -> CodeSpec:
    tests = obj.get("tests")
    if not isinstance(tests, list) or not tests:
        raise ValueError("a code gold needs a non-empty 'tests' list")
    pairs = []
    for t in tests:
        if not isinstance(t, Mapping) or not isinstance(t.get("input"), str) \
                or not isinstance(t.get("output"), str):
            raise ValueError("every test needs string 'input' and 'output'")
        pairs.append((t["input"], t["output"]))
    fn_name = obj.get("fn_name") or None
    if fn_name is not None and (not isinstance(fn_name, str) or not fn_name.isidentifier()):
        raise ValueError(f"fn_name {fn_name!r} is not an identifier")
    time_limit = obj.get("time_limit_s")
    memory = obj.get("memory_limit_bytes")
    return CodeSpec(tuple(pairs), fn_name, float(time_limit) if time_limit else None,
                    int(memory) if memory else None)


def parse_gold(gold: str | Mapping[str, Any] | CodeSpec) -> CodeSpec:
    """A ``CodeSpec`` from the gold string of ``code_gold``, an equivalent dict, or a spec."""
    if isinstance(gold, CodeSpec):
        return gold
    if isinstance(gold, str):
        return _parse_gold_str(gold)
    return _spec_from_mapping(gold)


# --------------------------------------------------------------------------- comparison


def _stripped_lines(text: str) -> list[str]:
    return [line.strip() for line in text.strip().split("\n")]


def _decimals(line: str) -> list[Decimal] | None:
    try:
        return [Decimal(token) for token in line.split()]
    except (InvalidOperation, ValueError):
        return None


def stdout_match(prediction: str, expected: str) -> bool:
    """LiveCodeBench's stdin-problem check: line-wise after stripping, each line equal as a
    string or as a list of ``Decimal`` tokens. The line counts are compared before anything is
    split, so a program's output never costs more than its own size (16 MB of newlines would
    otherwise be 16 M string objects in the grader)."""
    prediction, expected = prediction.strip(), expected.strip()
    if prediction.count("\n") != expected.count("\n"):
        return False
    got, want = _stripped_lines(prediction), _stripped_lines(expected)
    for a, b in zip(got, want):
        if a == b:
            continue
        da, db = _decimals(a), _decimals(b)
        if da is None or db is None:
            return False
        try:
            if da != db:
                return False
        except InvalidOperation:   # signalling NaN
            return False
    return True


class Opaque:
    """A value the harness could not encode (a set, a custom object): equal to nothing, and
    usable as a dict key (a program may return a dict keyed by frozensets or dataclasses)."""

    def __init__(self, type_name: str):
        self.type_name = type_name

    def __eq__(self, other):
        return False

    def __hash__(self):
        return id(self)

    def __repr__(self):
        return f"<unencodable {self.type_name}>"


def decode_result(obj):
    """Inverse of the harness's tagged encoding (tuples and non-string-keyed dicts kept). Raises
    ValueError/TypeError on a shape the harness never writes (``result_matches`` catches them)."""
    if isinstance(obj, list):
        return [decode_result(v) for v in obj]
    if isinstance(obj, dict):
        if "t" in obj and len(obj) == 1:
            return tuple(decode_result(v) for v in obj["t"])
        if "d" in obj and len(obj) == 1:
            return {_hashable(decode_result(k)): decode_result(v) for k, v in obj["d"]}
        if "o" in obj and len(obj) == 1:
            return Opaque(str(obj["o"]))
        raise ValueError("bad encoded value")
    return obj


def _hashable(key):
    try:
        hash(key)
    except TypeError:   # a list, a dict, a tuple holding one: equal to no expected key
        return Opaque("unhashable key")
    return key


def functional_match(prediction: Any, expected_json: str) -> bool:
    """LiveCodeBench's functional check: ``prediction == json.loads(expected)``, a returned tuple
    compared as a list."""
    if isinstance(prediction, tuple):
        prediction = list(prediction)
    try:
        expected = json.loads(expected_json)
    except (json.JSONDecodeError, ValueError):
        return False
    try:
        return bool(prediction == expected)
    except Exception:  # noqa: BLE001 - comparing exotic values must not crash grading
        return False


#: an encoded value matching ``expected`` is at most this many times its JSON's size, plus
#: RESULT_SLACK bytes: ``false`` for ``0`` is 5x, a tuple's ``{"t": []}`` for ``[]`` 4.5x, a
#: ``\uXXXX`` escape 3x the UTF-8 bytes
RESULT_RATIO, RESULT_SLACK = 8, 4096


def result_matches(fn_name: str | None, payload: bytes, expected: str) -> bool:
    """Does one test's result (the harness's payload: stdout, or the encoded return value of
    ``fn_name``) match ``expected``? Never raises, and never decodes a payload too large to be
    equal: a list of 4 M empty lists is 16 MB encoded and ~800 MB decoded."""
    try:
        if not fn_name:
            return stdout_match(payload.decode("utf-8", "replace"), expected)
        if len(payload) > RESULT_RATIO * len(expected.encode("utf-8", "surrogatepass")) + RESULT_SLACK:
            return False
        return functional_match(decode_result(json.loads(payload)), expected)
    except Exception:  # noqa: BLE001 - any undecodable or incomparable result scores 0
        return False
