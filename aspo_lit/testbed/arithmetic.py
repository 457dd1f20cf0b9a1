"""Seeded arithmetic problems: the CPU testbed's stand-in for a math training set.

Records have the same shape as the staged math benchmarks (docs/data.md)::

    {"id": "arith-L2-3f9c0a1b2d", "problem": "What is 3+4*5?", "answer": "23",
     "level": 2, "solution": "4*5=20\\n20+3=23\\n\\boxed{23}"}

``solution`` is a short worked solution, one ``x op y = z`` step per line, ending with
``\\boxed{answer}``; ``answer`` is a non-negative integer written as a string.

Difficulty levels (operands are single digits; what grows is the number of steps)::

    1  a+b or a-b          one step
    2  a+b*c               precedence, two steps (b*c, then +a)
    3  (a-b)*c+d           brackets, three steps

Every step is a fact from a small table (one-digit sums/differences/products, or "product plus
one digit"), so a tiny model can learn the tables from the train split and a held-out problem is a
new *combination* of known facts. Each problem is phrased either as a bare expression or as a
short word problem.

Splits are a pure function of the problem, not of the seed: levels 2–3 are split by the hash of
the canonical expression (``"3+4*5"``), so the same arithmetic never appears in both splits
whatever its phrasing; level 1 (one step: the problem *is* a table fact) is split by the hash of
its text.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
from pathlib import Path
from typing import Iterable, Sequence

__all__ = [
    "LEVELS",
    "SPLITS",
    "HELDOUT_FRACTION",
    "split_of",
    "make_problem",
    "generate_problems",
    "write_jsonl",
    "read_jsonl",
]

LEVELS = (1, 2, 3)
SPLITS = ("train", "heldout")
#: share of all expressions that belong to the held-out split (by hash, not by sampling)
HELDOUT_FRACTION = 0.2

_NAMES = ("Ann", "Ben", "Cara", "Dev", "Eli", "Fay", "Gus", "Hana", "Ivo", "Jo")
_ITEMS = ("apples", "stamps", "coins", "books", "pens", "cards", "shells", "marbles")

_EXPR_TEMPLATES = ("What is {e}?", "Compute {e}.", "Evaluate {e}.", "Calculate {e}.")

_WORD_TEMPLATES = {
    "add": (
        "{n} has {a} {i} and gets {b} more. How many {i} does {n} have now?",
        "A box holds {a} {i}. {n} puts {b} more {i} in it. How many {i} are in the box?",
    ),
    "sub": (
        "{n} has {a} {i} and gives {b} away. How many {i} does {n} have left?",
        "A box holds {a} {i}. {n} takes {b} {i} out. How many {i} are left in the box?",
    ),
    "l2": (
        "{n} has {a} {i} and buys {b} bags with {c} {i} in each. How many {i} does {n} have now?",
        "A shelf has {a} loose {i} and {b} boxes of {c} {i} each. How many {i} are there in all?",
    ),
    "l3": (
        "{n} has {a} {i} and gives {b} away. Then the number of {i} {n} has becomes {c} times "
        "as large, and {n} finds {d} more. How many {i} does {n} have now?",
        "A box holds {a} {i} and {b} are taken out. {c} boxes are then filled like it, and {d} "
        "loose {i} are added. How many {i} are there in total?",
    ),
}


def split_of(expression: str) -> str:
    """Deterministic train/heldout assignment of a canonical expression (seed-independent)."""
    h = int.from_bytes(hashlib.sha256(expression.encode()).digest()[:8], "big")
    return "heldout" if (h % 1000) < HELDOUT_FRACTION * 1000 else "train"


def split_key(record: dict) -> str:
    """What decides a problem's split: its canonical expression for multi-step levels, its text
    for level 1 (a one-step problem *is* its fact; hiding facts would make level 1 unlearnable)."""
    return record["problem"] if record["level"] == 1 else record["expression"]


def _steps_level1(rng: random.Random):
    if rng.random() < 0.5:
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        return "add", {"a": a, "b": b}, f"{a}+{b}", [f"{a}+{b}={a + b}"], a + b
    a = rng.randint(2, 9)
    b = rng.randint(1, a - 1)
    return "sub", {"a": a, "b": b}, f"{a}-{b}", [f"{a}-{b}={a - b}"], a - b


def _steps_level2(rng: random.Random):
    a, b, c = rng.randint(1, 9), rng.randint(2, 9), rng.randint(2, 9)
    bc = b * c
    return "l2", {"a": a, "b": b, "c": c}, f"{a}+{b}*{c}", [f"{b}*{c}={bc}", f"{bc}+{a}={bc + a}"], a + bc


def _steps_level3(rng: random.Random):
    a = rng.randint(2, 9)
    b = rng.randint(1, a - 1)
    c, d = rng.randint(2, 9), rng.randint(1, 9)
    ab = a - b
    abc = ab * c
    steps = [f"{a}-{b}={ab}", f"{ab}*{c}={abc}", f"{abc}+{d}={abc + d}"]
    return "l3", {"a": a, "b": b, "c": c, "d": d}, f"({a}-{b})*{c}+{d}", steps, abc + d


_LEVEL_FNS = {1: _steps_level1, 2: _steps_level2, 3: _steps_level3}


def make_problem(rng: random.Random, level: int, word_prob: float = 0.5) -> dict:
    """One problem of ``level`` drawn from ``rng`` (no id, no split check)."""
    kind, nums, expr, steps, answer = _LEVEL_FNS[level](rng)
    if rng.random() < word_prob:
        template = rng.choice(_WORD_TEMPLATES[kind])
        problem = template.format(n=rng.choice(_NAMES), i=rng.choice(_ITEMS), **nums)
    else:
        problem = rng.choice(_EXPR_TEMPLATES).format(e=expr)
    solution = "\n".join(steps + [f"\\boxed{{{answer}}}"])
    return {"problem": problem, "answer": str(answer), "level": level,
            "solution": solution, "expression": expr}


def generate_problems(
    n: int,
    seed: int,
    levels: Sequence[int] = LEVELS,
    split: str = "train",
    word_prob: float = 0.5,
) -> list[dict]:
    """``n`` distinct problems of ``split``, levels drawn uniformly from ``levels``.

    Deterministic for ``(n, seed, levels, split, word_prob)``; a larger ``n`` with the same other
    arguments extends the smaller list (prefix-stable). Problem texts are unique within the list.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    levels = tuple(int(x) for x in levels)
    bad = [x for x in levels if x not in _LEVEL_FNS]
    if not levels or bad:
        raise ValueError(f"levels must be a non-empty subset of {LEVELS}, got {levels}")
    rng = random.Random(f"arithmetic|{seed}|{split}|{levels}|{word_prob}")
    rows: list[dict] = []
    seen: set[str] = set()
    attempts, max_attempts = 0, 50 * n + 1000
    while len(rows) < n:
        attempts += 1
        if attempts > max_attempts:
            raise ValueError(f"could not draw {n} distinct {split} problems for levels {levels}")
        level = rng.choice(levels)
        rec = make_problem(rng, level, word_prob)
        if split_of(split_key(rec)) != split or rec["problem"] in seen:
            continue
        seen.add(rec["problem"])
        digest = hashlib.sha256(rec["problem"].encode()).hexdigest()[:10]
        rows.append({"id": f"arith-L{level}-{digest}", "problem": rec["problem"],
                     "answer": rec["answer"], "level": level, "solution": rec["solution"]})
    return rows


def write_jsonl(rows: Iterable[dict], path: str | os.PathLike) -> Path:
    """Write one JSON object per line (atomically: temp file then rename). Returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    os.replace(tmp, path)
    return path


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
