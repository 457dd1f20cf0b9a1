"""Seeded multi-step arithmetic with freely worded worked solutions: the paper-regime testbed's data.

The short testbed (``aspo_lit.testbed.arithmetic``) writes one forced line per step, so its policy
starts near-deterministic (0.09 nats per token) with ~21-token answers. The paper's mechanism acts
on long, high-entropy responses: many tokens are stylistic choices, a few carry the reasoning
(paper §3, Fig. 1). This generator gives the warm start that mix::

    {"id": "chain-6-1a2b3c4d5e", "answer": "98", "level": 6, "ops": 6,
     "problem": "Take the number 7. Do this 6 times, taking turns: add 3, then times 2. ...",
     "solution": "Step 1: add 3: 7 and 3 give 10. Neat.\nGood so far.\nStep 2: next times 2: ..."}

* **Problem:** a start value (2–20), two operations that take turns (add a digit ``a``, then take
  away a digit below ``a`` or double) and a number of steps ``ops``; every value stays in
  0..``max_value``. ``level`` is the number of steps.
* **Solution:** one line per step, ``Step i: [free word] <operation quoted from the problem>:
  <the fact in one of four phrasings>. <Free word>.``; optional comments (a running-total remark
  or two free words), optional re-checks (``Check: 98/2=49.``), optional opening and closing
  sentences, then ``\\boxed{answer}``. The step number, the operation and the numbers are forced;
  the wording is free. Which operation comes next is the parity of ``i``, and the last step is
  the number the problem gives, so a 2-layer model can read the chain. Every 4-word window of a
  step line holds a number that changes from line to line: word 4-gram repeats measure loops,
  not the format.

Splits are a pure function of the problem's canonical chain (``7+3*2+3*2...``), as in
``aspo_lit.testbed.arithmetic``: the same arithmetic never appears in both splits.
"""
from __future__ import annotations

import hashlib
import random
from typing import Sequence

from aspo_lit.testbed.arithmetic import SPLITS, split_of

__all__ = ["make_chain_problem", "generate_chain_problems"]

_START = ("Start with {x}.", "Begin with {x}.", "Take the number {x}.", "A counter shows {x}.")
#: operations as the problem states them and every step line quotes them: at most two words, so
#: that every 4-word window of a step line holds a number that changes from line to line (word
#: 4-gram repetition then measures loops, not the format)
_OPS_TEXT = {
    "add": ("add {k}", "plus {k}", "add {k}"),
    "sub": ("take {k}", "minus {k}", "subtract {k}"),
    "mul2": ("double", "times 2"),
}
_REPEAT = ("First {first}, then {second}, and keep taking turns until you have done {n} steps.",
           "Do this {n} times, taking turns: {first}, then {second}.",
           "Take turns: {first}, then {second}; stop after {n} steps in all.")
_QUESTION = ("What number do you get?", "What is the result?", "Where does it end?",
             "What does the counter show at the end?")
_OPEN = ("Let's go step by step.", "We start with {x}.", "Start: {x}.", "First we have {x}.",
         "Let me work it out.", "OK, one step at a time.")
_WORDS = ("good", "fine", "easy", "nice", "sure", "right", "clear", "great", "neat", "simple", "done",
          "correct", "true", "solid", "perfect", "lovely", "quick", "smooth", "okay", "yes", "cool",
          "super", "sweet", "plain", "obvious", "exact", "natural", "tidy", "steady", "calm")
#: one free word before the quoted operation (or none)
_PREFIX = ("", "", "", "next ", "then ", "now ", "so ", "OK ", "right ", "well ", "alright ", "sure ",
           "good ", "yes ", "hmm ", "okay ", "first ", "again ", "also ", "and ", "we ", "just ",
           "fine ", "great ", "indeed ", "cool ", "nice ", "look ")
#: the fact, worded freely; the running value comes first, so it sits in every 4-word window
_CORE = {
    "add": ("{x}+{k}={y}", "{x} plus {k} is {y}", "{x}+{k} makes {y}", "{x} and {k} give {y}"),
    "sub": ("{x}-{k}={y}", "{x} minus {k} is {y}", "{x}-{k} makes {y}", "{x} less {k} is {y}"),
    "mul2": ("{x}*2={y}", "{x} times 2 is {y}", "{x} doubled is {y}", "twice {x} is {y}"),
}
#: the end of a step line: a full stop and one free word
_END = tuple(f". {w.capitalize()}." for w in _WORDS)
#: a comment line: a running-total remark, or two free words
_COMMENT = ("We have {y} so far.", "The total is {y} now.", "Keep going.", "Almost there.",
            "That leaves {y}.", "Still fine.", "Now it is {y}.", "On we go.", "Good so far.",
            "Let me continue.", "That was easy.", "{a} and {b}.", "{a} and {b}.", "{a} and {b}.",
            "{a} and {b}.", "{a}, {b}.", "{a}, {b}.", "{a}, {b}.")
_CHECK = {"add": "Check: {y}-{k}={x}.", "sub": "Check: {y}+{k}={x}.", "mul2": "Check: {y}/2={x}."}
_CLOSE = ("", "", "The answer is {y}.", "So the result is {y}.", "That gives {y}.", "Done: {y}.")


def _chain(rng: random.Random, n_ops: int, max_value: int) -> tuple[int, list[tuple[str, int, int, int]]]:
    """A start value and ``n_ops`` steps ``(kind, x, k, y)`` that alternate two operations (the
    first adds ``a``, the second takes away ``b < a`` or doubles), every value in 0..max_value."""
    while True:
        x0 = rng.randint(2, min(20, max_value))
        a = rng.randint(2, 9)
        second = ("sub", rng.randint(1, a - 1)) if rng.random() < 0.75 else ("mul2", 2)
        x, steps = x0, []
        for i in range(n_ops):
            kind, k = ("add", a) if i % 2 == 0 else second
            y = x + k if kind == "add" else x - k if kind == "sub" else x * 2
            steps.append((kind, x, k, y))
            x = y
        if all(0 <= y <= max_value for *_, y in steps):
            return x0, steps


def _canonical(x0: int, steps) -> str:
    sym = {"add": "+", "sub": "-", "mul2": "*"}
    return str(x0) + "".join(f"{sym[kind]}{k}" for kind, _, k, _ in steps)


def make_chain_problem(rng: random.Random, n_ops: int, comment_prob: float = 0.6,
                       check_prob: float = 0.15, max_value: int = 99) -> dict:
    """One problem with ``n_ops`` alternating operations and a freely worded worked solution
    (no id, no split). Every step line starts with ``Step i:`` and quotes its operation from the
    problem: which operation comes next is the parity of ``i``, and the last line is ``i = n_ops``."""
    x0, steps = _chain(rng, n_ops, max_value)
    first, second = [rng.choice(_OPS_TEXT[kind]).format(k=k) for kind, _, k, _ in steps[:2]]
    problem = " ".join([rng.choice(_START).format(x=x0),
                        rng.choice(_REPEAT).format(first=first, second=second, n=n_ops),
                        rng.choice(_QUESTION)])
    lines = []
    if rng.random() < 0.6:
        lines.append(rng.choice(_OPEN).format(x=x0))
    for i, (kind, x, k, y) in enumerate(steps, start=1):
        phrase = first if i % 2 else second
        core = rng.choice(_CORE[kind]).format(x=x, k=k, y=y)
        # the step number and the quoted operation are forced; the wording around the fact is free
        lines.append(f"Step {i}: {rng.choice(_PREFIX)}{phrase}: {core}{rng.choice(_END)}")
        if rng.random() < comment_prob:
            lines.append(rng.choice(_COMMENT).format(y=y, a=rng.choice(_WORDS).capitalize(), b=rng.choice(_WORDS)))
        if rng.random() < check_prob:
            lines.append(_CHECK[kind].format(x=x, k=k, y=y))
    answer = steps[-1][3]
    close = rng.choice(_CLOSE).format(y=answer)
    if close:
        lines.append(close)
    lines.append(f"\\boxed{{{answer}}}")
    return {"problem": problem, "answer": str(answer), "level": n_ops, "ops": n_ops,
            "solution": "\n".join(lines), "expression": _canonical(x0, steps)}


def generate_chain_problems(n: int, seed: int, ops: Sequence[int] = (4, 5, 6, 7),
                            split: str = "train", comment_prob: float = 0.6,
                            check_prob: float = 0.15, max_value: int = 99) -> list[dict]:
    """``n`` distinct problems of ``split``, the number of operations drawn uniformly from ``ops``.

    Deterministic and prefix-stable for fixed arguments; the split is decided by the hash of the
    canonical chain, so no arithmetic is shared between train and held-out.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    ops = tuple(int(x) for x in ops)
    if not ops or min(ops) < 1:
        raise ValueError(f"ops must be a non-empty list of positive operation counts, got {ops}")
    if max_value < 20:
        raise ValueError(f"max_value must be at least 20, got {max_value}")
    rng = random.Random(f"chain|{seed}|{split}|{ops}|{comment_prob}|{check_prob}|{max_value}")
    rows, seen = [], set()
    attempts = 0
    while len(rows) < n:
        attempts += 1
        if attempts > 50 * n + 1000:
            raise ValueError(f"could not draw {n} distinct {split} chain problems for ops {ops}")
        rec = make_chain_problem(rng, rng.choice(ops), comment_prob, check_prob, max_value)
        if split_of(rec["expression"]) != split or rec["problem"] in seen:
            continue
        seen.add(rec["problem"])
        digest = hashlib.sha256(rec["problem"].encode()).hexdigest()[:10]
        rows.append({"id": f"chain-{rec['ops']}-{digest}", "problem": rec["problem"],
                     "answer": rec["answer"], "level": rec["ops"], "solution": rec["solution"]})
    return rows
