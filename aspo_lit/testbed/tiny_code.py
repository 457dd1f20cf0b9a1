"""A tiny code task for the CPU testbed: one-line Python functions a 2-layer model can learn.

Each problem asks for ``def <name>(x): return <expression>`` described in words ("Return the
largest element of the list x."), with the function name given by the starter code, and three
functional tests (JSON arguments, LiveCodeBench's functional semantics). Families cover integers,
lists and strings; most carry a constant. Problems are split into train and held-out by a hash of
(family, constant, function name), so held-out problems are combinations the model never trained
on. The reference solution is the fenced block ``aspo_lit.rewards.code.extract_code`` grades.

    {"id": "tiny-3f2a...", "problem": "Write a Python function g(x). Return x plus 7.",
     "starter_code": "def g(x):\\n    ", "fn_name": "g",
     "tests": [{"input": "3", "output": "10", "type": "functional"}, ...],
     "solution": "```python\\ndef g(x):\\n    return x + 7\\n```"}
"""

from __future__ import annotations

import hashlib
import json
import random
from typing import Any, Callable

from aspo_lit.rewards.code import code_gold

FUNCTION_NAMES = ("f", "g", "h", "solve", "calc")
SPLITS = ("train", "heldout")
HELDOUT_FRACTION = 0.2


def _ints(rng):
    return rng.randint(-20, 40)


def _lists(rng):
    return [rng.randint(0, 9) for _ in range(rng.randint(1, 5))]


def _strings(rng):
    return "".join(rng.choice("abcxyz") for _ in range(rng.randint(1, 6)))


# (family, description template, expression template, argument generator, constants)
FAMILIES: list[tuple[str, str, str, Callable, tuple]] = [
    ("add", "Return x plus {c}.", "x + {c}", _ints, tuple(range(1, 10))),
    ("sub", "Return x minus {c}.", "x - {c}", _ints, tuple(range(1, 10))),
    ("mul", "Return x times {c}.", "x * {c}", _ints, tuple(range(2, 10))),
    ("mod", "Return the remainder of x divided by {c}.", "x % {c}", _ints, tuple(range(2, 10))),
    ("sum", "Return the sum of the list x.", "sum(x)", _lists, (None,)),
    ("max", "Return the largest element of the list x.", "max(x)", _lists, (None,)),
    ("min", "Return the smallest element of the list x.", "min(x)", _lists, (None,)),
    ("len", "Return the length of the list x.", "len(x)", _lists, (None,)),
    ("sorted", "Return the list x sorted in increasing order.", "sorted(x)", _lists, (None,)),
    ("rev", "Return the list x reversed.", "x[::-1]", _lists, (None,)),
    ("take", "Return the first {c} elements of the list x.", "x[:{c}]", _lists, tuple(range(1, 5))),
    ("addall", "Return the list x with {c} added to every element.", "[v + {c} for v in x]", _lists,
     tuple(range(1, 10))),
    ("upper", "Return the string x in upper case.", "x.upper()", _strings, (None,)),
    ("srev", "Return the string x reversed.", "x[::-1]", _strings, (None,)),
    ("count", "Return how many times the letter {q} occurs in the string x.", "x.count({q})", _strings,
     ("a", "b", "c", "x", "y", "z")),
    ("repeat", "Return the string x repeated {c} times.", "x * {c}", _strings, tuple(range(2, 5))),
]


def split_of(family: str, constant, fn_name: str) -> str:
    """``train`` or ``heldout``, fixed by a hash of the problem's identity (seed-independent)."""
    digest = hashlib.sha256(f"{family}|{constant}|{fn_name}".encode()).digest()
    return "heldout" if digest[0] < 256 * HELDOUT_FRACTION else "train"


def _problem(family, describe, expression, args_of, constant, fn_name, rng) -> dict[str, Any]:
    fill = {"c": constant, "q": repr(constant)}
    expr = expression.format(**fill)
    reference = eval(f"lambda x: {expr}")
    inputs, tests = set(), []
    while len(tests) < 3:
        arg = args_of(rng)
        key = json.dumps(arg)
        if key in inputs and len(inputs) < 50:
            continue
        inputs.add(key)
        tests.append({"input": key, "output": json.dumps(reference(arg)), "type": "functional"})
    ident = hashlib.sha1(f"{family}|{constant}|{fn_name}".encode()).hexdigest()[:10]
    return {"id": f"tiny-{ident}", "problem": f"Write a Python function {fn_name}(x). "
                                              f"{describe.format(**fill)}",
            "starter_code": f"def {fn_name}(x):\n    ", "fn_name": fn_name, "tests": tests,
            "family": family,
            "solution": f"```python\ndef {fn_name}(x):\n    return {expr}\n```"}


def all_problems(seed: int = 0) -> dict[str, list[dict[str, Any]]]:
    """Every (family, constant, name) problem once, tests drawn with ``seed``, by split."""
    rng = random.Random(seed)
    out: dict[str, list] = {s: [] for s in SPLITS}
    for family, describe, expression, args_of, constants in FAMILIES:
        for constant in constants:
            for fn_name in FUNCTION_NAMES:
                out[split_of(family, constant, fn_name)].append(
                    _problem(family, describe, expression, args_of, constant, fn_name, rng))
    return out


def generate_problems(n: int, seed: int = 0, split: str = "train") -> list[dict[str, Any]]:
    """``n`` problems of ``split`` (cycling through them, shuffled with ``seed``; tests redrawn
    per cycle), each with its gold test spec as ``answer``."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    rows, cycle = [], 0
    while len(rows) < n:
        pool = all_problems(seed * 1000 + cycle)[split]
        random.Random(seed * 7919 + cycle).shuffle(pool)
        for p in pool[: n - len(rows)]:
            rows.append(dict(p, id=f"{p['id']}-{cycle}" if cycle else p["id"], answer=code_gold(p)))
        cycle += 1
    return rows


def write_jsonl(rows, path) -> None:
    from pathlib import Path

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "answer"}) + "\n" for r in rows))
