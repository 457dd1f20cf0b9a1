"""Multiple-choice benchmarks of Table 3 (out of domain): ARC-Challenge, GPQA-Diamond, MMLU-Pro.

Table 3 of the paper asks whether math RL transfers to out-of-domain multiple-choice questions.
The paper states no prompt, grader, K or temperature for it, so this module's choices are ours:

Rows. Each benchmark's upstream row format is normalized (``normalize_record``) to
``{"id", "problem" (the question), "options" (list of option texts), "answer" (gold letter)}``,
the same code for a hub dataset (``datasets.load_dataset``) and a local JSONL/JSON/parquet copy in
the upstream layout (``fields`` renames upstream fields for a file that spells them otherwise):

- ``arc``: ``question``, ``choices {text: [...], label: [...]}``, ``answerKey`` (some ARC rows are
  labelled 1-4 instead of A-D: options are re-lettered A, B, ... in their upstream order).
- ``gpqa``: ``Question``, ``Correct Answer``, ``Incorrect Answer 1..3`` (``Record ID``). Upstream
  the gold is always the first of these, so the four options are shuffled with a fixed seed; the
  permutation depends only on the seed and the question text (not on row order or the process).
- ``mmlu_pro``: ``question``, ``options`` (up to 10), ``answer`` (letter), ``answer_index``
  (``question_id``); letter and index must agree.

Prompt (``build_choice_message``): the question, a blank line, one ``A. text`` line per option,
a blank line, then the paper's math instruction (§7.1, "Let's think step by step and output the
final answer within \\boxed{}.") with the letter asked for: the models were RL-trained to box a
final answer under exactly that instruction, so the out-of-domain question changes only the
content, not the answer format. Encoded with the model's chat template like the math prompts.

Grader (``extract_choice`` / ``ChoiceReward``): regex and brace matching only, linear in the
response length (no pattern repeats a group, so a failed attempt backtracks at most once over a
run of characters; a 5 MB response grades well under a second), never raising (a non-string is no
answer):
1. after the last ``</think>`` when present, the content of the LAST ``\\boxed{}`` (math's
   extractor), read with ``\\text{}``-like wrappers, braces, ``$`` and LaTeX spaces dropped and a
   trailing ``.`` ignored. It names one letter A-J, upper or lower case (inside a box a letter can
   only be the answer), when it is that letter alone -- ``C``, ``(C)``, ``C)``, ``C.``, ``C:``,
   ``\\text{C}``, ``\\textbf{C}`` -- or that letter, then ``.``/``:``/``)`` and an option text
   (``\\boxed{C. 42}``, ``\\boxed{C) The DNA}``). A box naming several letters is no answer:
   a. it is nothing but two or more standalone letters A-J and separators (spaces,
      ``. , : ; / & + | ( )``, "or", "and"): ``(A) or (C)``, ``(A), (C)``, ``A), B), C), D)``,
      ``A. or C.``, ``C. A``;
   b. or its option text holds a parenthesised capital ``(D)`` not right after a letter or digit:
      ``(B) or (D) are both correct``, ``(B) 42, (D) 17`` (``P(A)`` is text).
   Letters inside the words of an option text, or standing among its words, are text:
   ``C. The DNA``, ``C. A cell wall``, ``D. Both A and C``, ``C. I and II only``, ``E. E. coli``,
   ``B. (ii) and (iv) only`` read their leading letter. Anything else -- ``AC``, ``A, C``,
   ``A and C``, a number, empty -- is no answer;
2. only when there is no ``\\boxed`` at all: the answer statements of MMLU-Pro's official
   extraction (TIGER-AI-Lab/MMLU-Pro, ``evaluate_from_local.py``: ``extract_answer``
   "answer is \\(?([A-J])\\)?", then ``extract_again`` "[aA]nswer:\\s*([A-J])", then
   ``extract_final``), read after removing markdown emphasis ``*``, so "The answer is **B**." and
   "**Answer:** B" read B (simple-evals' ``normalize_response`` drops ``**`` the same way;
   MMLU-Pro reaches these only through its last-letter fallback). Where it differs from MMLU-Pro,
   to agree with rule 1 and to grade untrusted text: the LAST statement of either kind counts
   (MMLU-Pro: the first "answer is", else the last "answer:" of a line); "answer" in any case,
   "answer is:" too; the letter must stand alone ("the answer is Apple" is not A) and may be lower
   case only in parentheses ("the answer is a prime" is not A, "answer is (c)" is C). MMLU-Pro's
   last fallback, ``extract_final`` (the last standalone capital A-J anywhere), is not taken: it
   reads the pronoun "I" (MMLU-Pro's option I) and the article "A" as answers, scores a sample cut
   at max tokens by whatever letter its reasoning named last, and its pattern is quadratic;
3. else no answer.
Exact match of the extracted letter with the gold letter scores 1, anything else (no answer,
several letters, another letter) 0.
"""
from __future__ import annotations

import hashlib
import json
import random
import re
from pathlib import Path
from typing import Sequence

from aspo_lit.prompts import has_chat_template
from aspo_lit.rewards.math import extract_answer

LETTERS = "ABCDEFGHIJ"
CHOICE_INSTRUCTION = ("Let's think step by step and output the final answer within \\boxed{}: "
                      "the letter of the correct option only, e.g. \\boxed{A}.")
PROMPT_FORMAT = "choice-v1"          # recorded in each benchmark's meta.json
GPQA_SHUFFLE_SEED = 0
FORMATS = ("arc", "gpqa", "mmlu_pro")


# --- rows ----------------------------------------------------------------------------------------

def gpqa_permutation(question: str, n: int = 4, seed: int = GPQA_SHUFFLE_SEED) -> list[int]:
    """The fixed shuffle of one GPQA question's options: position i shows upstream option
    perm[i] (upstream option 0 is the correct one). Depends only on seed and question text."""
    digest = hashlib.sha256(f"{seed}\0{question.strip()}".encode()).digest()
    perm = list(range(n))
    random.Random(int.from_bytes(digest[:8], "big")).shuffle(perm)
    return perm


def normalize_record(fmt: str, record: dict, index: int, fields: dict | None = None,
                     seed: int = GPQA_SHUFFLE_SEED, source: str = "") -> dict:
    """One upstream row -> ``{"id", "problem", "options", "answer"}`` (see the module doc).
    ``fields``: {upstream field name: the name in this file}. Raises ValueError naming the row."""
    fields = fields or {}
    where = f"{source} row {index}"

    def get(key, default=None):
        return record.get(fields.get(key, key), default)

    def text(value, what):
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f"{where}: no usable {what}")
        return value.strip()

    if fmt == "arc":
        choices = get("choices") or {}
        options = [text(t, "option") for t in (choices.get("text") or [])]
        labels = [str(x).strip() for x in (choices.get("label") or [])]
        key = str(get("answerKey", "")).strip()
        if len(labels) != len(options) or key not in labels:
            raise ValueError(f"{where}: answerKey {key!r} is not one of the labels {labels}")
        question, gold, rid = text(get("question"), "question"), labels.index(key), get("id")
    elif fmt == "gpqa":
        question = text(get("Question"), "Question")
        upstream = [text(get("Correct Answer"), "Correct Answer")]
        upstream += [text(get(f"Incorrect Answer {i}"), f"Incorrect Answer {i}") for i in (1, 2, 3)]
        perm = gpqa_permutation(question, len(upstream), seed)
        options, gold, rid = [upstream[p] for p in perm], perm.index(0), get("Record ID")
    elif fmt == "mmlu_pro":
        question = text(get("question"), "question")
        options = [text(str(o), "option") for o in (get("options") or [])]
        letter, idx = get("answer"), get("answer_index")
        if isinstance(letter, str) and letter.strip().upper() in LETTERS[:len(options)]:
            gold = LETTERS.index(letter.strip().upper())
            if idx is not None and int(idx) != gold:
                raise ValueError(f"{where}: answer {letter!r} and answer_index {idx} disagree")
        elif idx is not None and 0 <= int(idx) < len(options):
            gold = int(idx)
        else:
            raise ValueError(f"{where}: no usable answer / answer_index")
        rid = get("question_id")
    else:
        raise ValueError(f"unknown multiple-choice format {fmt!r}; expected one of {FORMATS}")
    if not 2 <= len(options) <= len(LETTERS):
        raise ValueError(f"{where}: {len(options)} options (2 to {len(LETTERS)} supported)")
    rid = str(rid).strip() if rid is not None and str(rid).strip() else f"{index}"
    return {"id": rid, "problem": question, "options": options, "answer": LETTERS[gold]}


def normalize_records(fmt: str, records, fields=None, seed=GPQA_SHUFFLE_SEED, source="") -> list[dict]:
    rows, seen = [], set()
    for i, record in enumerate(records):
        row = normalize_record(fmt, dict(record), i, fields, seed, source)
        if row["id"] in seen:
            raise ValueError(f"{source}: duplicate problem id {row['id']!r}")
        seen.add(row["id"])
        rows.append(row)
    return rows


def read_records(path: Path) -> list[dict]:
    """Upstream rows of a local JSONL / JSON (a list) / parquet file."""
    path = Path(path)
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq
        return pq.read_table(path).to_pylist()
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json" and text.lstrip().startswith("["):
        return json.loads(text)
    records = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}, line {lineno}: not JSON ({e.msg})") from None
    return records


def load_choice_hub(hub_id, hub_config, split, fmt, fields=None) -> list[dict]:
    import datasets

    table = datasets.load_dataset(hub_id, hub_config, split=split)
    return normalize_records(fmt, table, fields, source=f"{hub_id}[{split}]")


def load_choice_local(path, fmt, fields=None) -> list[dict]:
    return normalize_records(fmt, read_records(path), fields, source=str(path))


# --- prompt ----------------------------------------------------------------------------------------

def render_options(options: Sequence[str]) -> str:
    if len(options) > len(LETTERS):
        raise ValueError(f"{len(options)} options: at most {len(LETTERS)} letters")
    return "\n".join(f"{LETTERS[i]}. {str(o).strip()}" for i, o in enumerate(options))


def build_choice_message(question: str, options: Sequence[str]) -> str:
    """The user message: question, lettered options, instruction."""
    return f"{question.strip()}\n\n{render_options(options)}\n\n{CHOICE_INSTRUCTION}"


def encode_choice_prompt(row: dict, tokenizer, template: str = "chat",
                         enable_thinking: bool | None = False) -> list[int]:
    """Token ids of the prompt, built as ``aspo_lit.prompts.encode_prompt`` builds math ones."""
    message = build_choice_message(row["problem"], row["options"])
    templated = template == "chat" and has_chat_template(tokenizer)
    if templated:
        extra = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
        message = tokenizer.apply_chat_template([{"role": "user", "content": message}],
                                                tokenize=False, add_generation_prompt=True, **extra)
    return list(tokenizer(message, add_special_tokens=not templated)["input_ids"])


# --- grader ----------------------------------------------------------------------------------------

# Linear patterns (Python 3.10 has no possessive quantifiers): no repeated group, so a failed try
# backtracks at most once over a run of characters and the match stack stays small.
_DROP = dict.fromkeys(map(ord, "{}$"))
_UNWRAP = re.compile(r"\\(?:text|textbf|textit|textrm|mathrm|mathbf|mathit|mbox)\s*\{")
_SPACE = re.compile(r"\\(?:[,;:! ]|q?quad(?![A-Za-z]))|~")
_SINGLE = re.compile(r"\(?([A-Ja-j])(?:\s*[.:)](.*))?", re.S)           # C  (C)  C.  C) text
_ITEM = re.compile(r"(?<![A-Za-z0-9])(?:\(\s*[A-Ja-j]\s*\)|[A-Ja-j]\)?)(?![A-Za-z0-9])")
_CONJ = re.compile(r"\b(?:or|and)\b")
_SEPS = re.compile(r"[\s.,:;/&+|()]*")
_LIST_CHARS = re.compile(r"[\s.,:;/&+|()A-Ja-jorn]*")                 # a fast first test
_LABEL = re.compile(r"(?<![A-Za-z0-9])\(\s*[A-J]\s*\)")                # (C) in an option text
_ANSWER = re.compile(r"(?i:answer(?:\s+is(?:\s*:)?|\s*:))\s*"
                     r"(?:\(\s*([A-Ja-j])\s*\)|\(?([A-J])(?![A-Za-z0-9]))")


def _boxed_letter(content: str) -> str | None:
    """The letter a box's content names (rule 1 of the module doc), or None."""
    content = _SPACE.sub(" ", _UNWRAP.sub("", content).translate(_DROP)).replace("\\&", "&")
    content = content.strip().rstrip(". ")
    m = _SINGLE.fullmatch(content)
    if m is None or _LABEL.search(m.group(2) or ""):
        return None
    if _LIST_CHARS.fullmatch(content):               # only letters and separators: a list?
        rest, items = _ITEM.subn(" ", content)
        if items > 1 and _SEPS.fullmatch(_CONJ.sub(" ", rest)):
            return None
    return m.group(1).upper()


def extract_choice(text: str, think_end_token: str | None = "</think>") -> str | None:
    """The answer letter of a response (see the module doc), or None; linear in ``len(text)``,
    None for anything that is not a string."""
    if not isinstance(text, str):
        return None
    if think_end_token and think_end_token in text:
        text = text.rsplit(think_end_token, 1)[1]
    if re.search(r"\\(?:boxed|fbox)(?![A-Za-z])", text):
        content = extract_answer(text, None)
        return None if content is None else _boxed_letter(content)
    letter = None
    for m in _ANSWER.finditer(text.replace("*", "")):      # markdown emphasis: **B**, *B*
        letter = (m.group(1) or m.group(2)).upper()
    return letter


class ChoiceReward:
    """1.0 when the extracted letter equals the gold letter, else 0.0 (`extract_choice`)."""

    think_end_token = "</think>"

    def __init__(self, think_end_token: str | None = "</think>"):
        self.think_end_token = think_end_token

    def __call__(self, response_text: str, gold: str) -> float:
        letter = extract_choice(response_text, self.think_end_token)
        return float(letter is not None and letter == str(gold).strip().upper())

    def batch(self, texts: Sequence[str], golds: Sequence[str]) -> list[float]:
        return [self(t, g) for t, g in zip(texts, golds)]


# --- fixtures (tiny profile, tests) -------------------------------------------------------------

def fixture_records(fmt: str, n: int = 16, seed: int = 0) -> list[dict]:
    """Small arithmetic multiple-choice questions in a benchmark's real upstream row format."""
    rng = random.Random(f"{fmt}:{seed}")
    n_options = {"arc": 4, "gpqa": 4, "mmlu_pro": 10}[fmt]
    records = []
    for i in range(n):
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        right = a + b
        wrong = rng.sample([v for v in range(2, 30) if v != right], n_options - 1)
        question = f"What is {a}+{b}? (item {i})"
        if fmt == "gpqa":
            records.append({"Record ID": f"rec{seed}_{i}", "Question": question,
                            "Correct Answer": str(right),
                            **{f"Incorrect Answer {j + 1}": str(w) for j, w in enumerate(wrong)}})
            continue
        options = [str(v) for v in wrong]
        gold = rng.randrange(n_options)
        options.insert(gold, str(right))
        if fmt == "arc":
            records.append({"id": f"Mercury_{seed}_{i}", "question": question,
                            "choices": {"text": options, "label": list(LETTERS[:n_options])},
                            "answerKey": LETTERS[gold]})
        else:
            records.append({"question_id": seed * 100000 + i, "question": question,
                            "options": options, "answer": LETTERS[gold], "answer_index": gold,
                            "cot_content": "", "category": "math", "src": "fixture"})
    return records


def write_fixture(fmt: str, path, n: int = 16, seed: int = 0) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in fixture_records(fmt, n, seed)),
                    encoding="utf-8")
    return path
