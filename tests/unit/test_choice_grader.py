"""The multiple-choice grader of Table 3 (`aspo_lit.eval.choice.extract_choice` / `ChoiceReward`) on
untrusted output: a box naming several letters is no answer, the unboxed fallback follows MMLU-Pro's
official extraction (with markdown bold removed), and 5 MB adversarial responses grade in linear
time without raising."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from aspo_lit.eval.choice import ChoiceReward, extract_choice

REPO = Path(__file__).resolve().parents[2]


def _mismatches(table: dict) -> list[str]:
    return [f"{text!r}: read {extract_choice(text)!r}, expected {want!r}"
            for text, want in table.items() if extract_choice(text) != want]


def test_box_naming_several_letters_is_no_answer():
    table = {
        # hedges: two or more option letters in one box, in any spelling
        "\\boxed{(A) or (C)}": None,
        "\\boxed{(A), (C)}": None,
        "\\boxed{A), B), C), D)}": None,
        "\\boxed{(A) and (C)}": None,
        "\\boxed{(A)(C)}": None,
        "\\boxed{(A) (C)}": None,
        "\\boxed{A) or C)}": None,
        "\\boxed{A. or C.}": None,
        "\\boxed{(a) or (c)}": None,
        "\\boxed{(A) \\text{ or } (C)}": None,
        "\\boxed{\\text{(A) or (C)}}": None,
        "\\boxed{\\textbf{(A)}, \\textbf{(C)}}": None,
        "\\boxed{A)\\ C)}": None,
        "\\boxed{A)B)}": None,
        "\\boxed{(B) or (D) are both correct}": None,
        "\\boxed{(B) 42, (D) 17}": None,
        "\\boxed{C. A}": None,                       # a letter as "option text" is a second letter
        "\\boxed{A, B, C, and D}": None,
        # one letter, with or without its option text: words and capitals in the text are text
        "\\boxed{C. The DNA}": "C",
        "\\boxed{C) The DNA}": "C",
        "\\boxed{(C) The DNA}": "C",
        "\\boxed{C. A cell wall}": "C",
        "\\boxed{D. Both A and C}": "D",
        "\\boxed{C. I and II only}": "C",            # roman numerals of MMLU options
        "\\boxed{B. (ii) and (iv) only}": "B",
        "\\boxed{C. P(A) = 0.5}": "C",
        "\\boxed{E. E. coli}": "E",
        "\\boxed{\\text{C. 10^-4 eV}}": "C",
        "\\boxed{\\textit{C}}": "C",
        "\\boxed{C}": "C", "\\boxed{(C)}": "C", "\\boxed{C)}": "C", "\\boxed{C:}": "C",
        "\\boxed{\\text{C}}": "C", "\\boxed{\\textbf{C}}": "C", "$\\boxed{\\mathrm{(C)}}$.": "C",
    }
    assert not _mismatches(table), "\n".join(_mismatches(table))


def test_unboxed_fallback_follows_mmlu_pro_extraction():
    """MMLU-Pro's patterns "answer is \\(?([A-J])\\)?" and "[aA]nswer:\\s*([A-J])", on the text with
    markdown emphasis removed; its last-letter fallback is not taken."""
    table = {
        "The answer is **B**.": "B",
        "**Answer:** B": "B",
        "**Answer: C**": "C",
        "Answer: **(D)**": "D",
        "The correct answer is ***E***": "E",
        "The answer is (C).": "C",
        "answer is (C)": "C",
        "Answer: B": "B",
        "Answer:B": "B",
        "the answer is J": "J",                       # MMLU-Pro's ten options
        "The answer is: (H)": "H",
        "Answer: A\n...\nActually, the answer is **D**": "D",     # the last statement
        "\\boxed{A} and later the answer is **B**": "A",          # a box keeps priority
        "\\boxed{AB} and later **Answer:** C": None,
        "the answer is a prime": None,                # the article, not option A
        "the answer is **a** prime": None,
        "the answer is Apple": None,
        "I will answer B now": None,                  # "answer" without "is" or ":"
        "I think B is right.": None,                  # no last-letter fallback
        "A) 3  B) 4  C) 5, so B": None,
        "": None,
    }
    assert not _mismatches(table), "\n".join(_mismatches(table))


def test_grader_never_raises():
    reward = ChoiceReward()
    for text in (None, 42, b"\\boxed{B}", "\\boxed{\ud800}", "\x00\\boxed{B\x00}", "\\boxed",
                 "\\boxed ", "\\fbox{B}", "}" * 10 + "\\boxed{B}", "</think>", "answer:"):
        letter = extract_choice(text)
        assert letter is None or letter in "ABCDEFGHIJ"
        assert reward(text, "B") in (0.0, 1.0)
    assert reward("\\fbox{B}", "B") == 1.0


# --- 5 MB adversarial responses: linear time, bounded memory -----------------------------------

SECONDS = 2.0    # per grading of one 5 MB response (measured: at most 0.8 s on 2 loaded cores)
HANG_S = 20      # a child still grading after this fails (the quadratic fallback took hours)
MEMORY_MB = 100  # peak growth while grading (measured: at most 27 MB, the list of box positions)
ANY = object()
# (name, a Python expression building the text, the letter it reads); rep(s): s repeated to 5 MB
CASES = [
    ("whitespace after 'answer is'", "'The answer is' + rep(' ')", None),
    ("whitespace after 'Answer:'", "'Answer:' + rep(' \\t\\n')", None),
    ("whitespace after 'answer'", "'the answer' + rep(' ')", None),
    ("whitespace then the letter", "'the answer is' + rep(' ') + 'B'", "B"),
    ("whitespace after 'answer is ('", "'the answer is (' + rep(' ')", None),
    ("many 'answer is' fragments", "rep('the answer is ') + '(B)'", "B"),
    ("many 'Answer:' fragments", "rep('Answer: ') + 'C'", "C"),
    ("many bold fragments", "rep('**answer is** ') + '**D**'", "D"),
    ("many asterisks", "'The answer is ' + rep('*') + 'B'", "B"),
    ("many bare letters", "rep('A ')", None),
    ("many open parentheses", "rep('answer is (')", None),
    ("many unclosed boxes", "rep('\\\\boxed{')", None),
    ("unclosed box then whitespace", "'\\\\boxed{' + rep(' ')", None),
    ("deep braces before a box", "rep('{') + '\\\\boxed{A}'", "A"),
    ("deep braces in a box", "'\\\\boxed{' + '{' * (SIZE // 2) + 'A' + '}' * (SIZE // 2) + '}'",
     ANY),
    ("nested wrappers in a box", "'\\\\boxed{' + rep('\\\\text{') + 'C' + '}' * (SIZE // 6) + '}'",
     ANY),
    ("option text of whitespace", "'\\\\boxed{C.' + rep(' ') + 'x}'", "C"),
    ("whitespace after the box letter", "'\\\\boxed{C' + rep(' ') + 'x}'", None),
    ("a long hedge", "'\\\\boxed{(A)' + rep(' or (C)') + '}'", None),
    ("a long letter list", "'\\\\boxed{A' + rep(', B') + '}'", None),
    ("a list then whitespace", "'\\\\boxed{A, B' + rep(' ') + 'x}'", None),
    ("many parentheses in option text", "'\\\\boxed{C. ' + rep('( ') + '}'", "C"),
    ("many labels in option text", "'\\\\boxed{C. ' + rep('P(A) ') + '}'", "C"),
    ("whitespace inside the parenthesis", "'\\\\boxed{(' + rep(' ') + 'A)}'", ANY),
    ("many think ends", "rep('</think>') + '\\\\boxed{B}'", "B"),
    ("non-ASCII text", "rep('答案是 ') + 'answer: E'", "E"),
]
_CHILD = r"""
import json, resource, sys, time
import pytest

from aspo_lit.eval.choice import ChoiceReward, extract_choice
SIZE = 5_000_000
rep = lambda s: s * (SIZE // len(s))
text = eval(sys.argv[1], {"rep": rep, "SIZE": SIZE})
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start = time.perf_counter()
letter = extract_choice(text)
mid = time.perf_counter()
score = ChoiceReward()(text, "B")
end = time.perf_counter()
print(json.dumps({"letter": letter, "score": score, "chars": len(text),
                  "seconds": max(mid - start, end - mid),
                  "grown_mb": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss) / 1024}))
"""


@pytest.mark.hostile
def test_5mb_adversarial_responses_grade_in_linear_time():
    """Each case in its own process, so a case that runs for hours (the old quadratic fallback)
    is reported instead of hanging the suite."""
    path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}         # this checkout's package, not an installed one
    failures, timings = [], {}
    for name, expr, want in CASES:
        try:
            out = subprocess.run([sys.executable, "-c", _CHILD, expr], cwd=REPO, env=env,
                                 capture_output=True, text=True, timeout=HANG_S)
        except subprocess.TimeoutExpired:
            failures.append(f"{name}: still grading after {HANG_S} s")
            continue
        if out.returncode != 0:
            failures.append(f"{name}: exit {out.returncode}\n{out.stderr[-1500:]}")
            continue
        r = json.loads(out.stdout.strip().splitlines()[-1])
        timings[name] = round(r["seconds"], 3)
        assert r["chars"] >= 4_900_000, name
        if r["seconds"] > SECONDS:
            failures.append(f"{name}: {r['seconds']:.2f} s (bound {SECONDS} s)")
        if r["grown_mb"] > MEMORY_MB:
            failures.append(f"{name}: peak memory grew {r['grown_mb']:.0f} MB (bound {MEMORY_MB})")
        if want is not ANY and r["letter"] != want:
            failures.append(f"{name}: read {r['letter']!r}, expected {want!r}")
        if r["score"] != float(r["letter"] == "B"):
            failures.append(f"{name}: score {r['score']} for letter {r['letter']!r}")
    print(json.dumps(timings, indent=1, ensure_ascii=False))
    assert not failures, "\n".join(failures)
