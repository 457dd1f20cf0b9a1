"""Table 3 (out of domain, multiple choice): options, GPQA shuffle, letter grading, loaders in the
upstream row formats, resume after a kill, Table 3 beside the paper, the tiny profile."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from aspo_lit.eval.choice import (
    CHOICE_INSTRUCTION,
    LETTERS,
    ChoiceReward,
    build_choice_message,
    extract_choice,
    fixture_records,
    gpqa_permutation,
    normalize_record,
    render_options,
    write_fixture,
)
from aspo_lit.eval.datasets import BENCHMARKS, load_benchmark
from aspo_lit.eval.evaluate import evaluate_model
from tests.helpers.engines import FakeEngine
from tests.helpers.tolerance import approx64  # float64 maths, O(1)-O(100) values: docs/design.md, "Tolerances in tests"

REPO = Path(__file__).resolve().parents[2]

# --- rows in each benchmark's real upstream layout ----------------------------------------------

ARC_ROWS = [   # allenai/ai2_arc ARC-Challenge: most rows lettered, a few numbered 1-4, some 3 or 5 options
    {"id": "Mercury_7175875", "question": "An astronomer observes that a planet rotates faster after "
     "a meteorite impact. Which is the most likely effect of this increase in rotation?",
     "choices": {"text": ["Planetary density will decrease.", "Planetary years will become longer.",
                          "Planetary days will become shorter.", "Planetary gravity will become stronger."],
                 "label": ["A", "B", "C", "D"]}, "answerKey": "C"},
    {"id": "NYSEDREGENTS_2015_4_8", "question": "Which object is the best conductor of electricity?",
     "choices": {"text": ["a wax crayon", "a plastic spoon", "a rubber eraser", "an iron nail"],
                 "label": ["1", "2", "3", "4"]}, "answerKey": "4"},
    {"id": "Mercury_SC_401167", "question": "Which is a renewable resource?",
     "choices": {"text": ["coal", "oil", "wind"], "label": ["A", "B", "C"]}, "answerKey": "C"},
]
GPQA_ROWS = [   # Idavidrein/gpqa gpqa_diamond: the gold is always "Correct Answer"; fields padded
    {"Record ID": "recZ1", "Question": "Two quantum states with energies E1 and E2 have lifetimes "
     "of 1e-9 s and 1e-8 s. Which energy difference lets them be clearly resolved?\n",
     "Correct Answer": "10^-4 eV", "Incorrect Answer 1": "10^-11 eV ",
     "Incorrect Answer 2": "10^-8 eV\n", "Incorrect Answer 3": "10^-9 eV",
     "Subdomain": "Physics (general)", "High-level domain": "Physics"},
    {"Record ID": "recZ2", "Question": "Which compound is aromatic?", "Correct Answer": "benzene",
     "Incorrect Answer 1": "cyclohexane", "Incorrect Answer 2": "cyclooctatetraene",
     "Incorrect Answer 3": "cyclobutadiene", "Subdomain": "Organic Chemistry",
     "High-level domain": "Chemistry"},
]
MMLU_PRO_ROWS = [   # TIGER-Lab/MMLU-Pro test: up to 10 options, answer letter + answer_index
    {"question_id": 70, "question": "Typical advertising regulatory bodies suggest that adverts must not:",
     "options": [f"option {i}" for i in range(10)], "answer": "I", "answer_index": 8,
     "cot_content": "", "category": "business", "src": "ori_mmlu-business_ethics"},
    {"question_id": 71, "question": "What is the value of 2+2?",
     "options": ["3", "4", "5", "22", "0", "1", "8"], "answer": "B", "answer_index": 1,
     "cot_content": "", "category": "math", "src": "stemez-Math"},
]
UPSTREAM = {"arc_challenge": ARC_ROWS, "gpqa_diamond": GPQA_ROWS, "mmlu_pro": MMLU_PRO_ROWS}
HUB = {"arc_challenge": ("allenai/ai2_arc", "ARC-Challenge", "test"),
       "gpqa_diamond": ("Idavidrein/gpqa", "gpqa_diamond", "train"),
       "mmlu_pro": ("TIGER-Lab/MMLU-Pro", None, "test")}


def _write_jsonl(path: Path, records) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


# --- prompt ------------------------------------------------------------------------------------

def test_option_rendering():
    message = build_choice_message("  What is 2+2? ", ["3", " 4 ", "5", "22"])
    assert message == f"What is 2+2?\n\nA. 3\nB. 4\nC. 5\nD. 22\n\n{CHOICE_INSTRUCTION}"
    assert "\\boxed{}" in CHOICE_INSTRUCTION
    ten = render_options([f"o{i}" for i in range(10)]).splitlines()
    assert [line[:3] for line in ten] == [f"{c}. " for c in "ABCDEFGHIJ"]
    with pytest.raises(ValueError):
        render_options([f"o{i}" for i in range(11)])


def test_prompt_goes_through_the_chat_template(tiny_model_dir):
    from transformers import AutoTokenizer

    from aspo_lit.eval.choice import encode_choice_prompt

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    row = {"problem": "what is 1+1?", "options": ["1", "2"], "answer": "B"}
    text = tok.decode(encode_choice_prompt(row, tok, template="plain"), skip_special_tokens=True)
    assert "what is 1+1?" in text and "a. 1\nb. 2" in text


# --- the GPQA shuffle ----------------------------------------------------------------------------

def test_gpqa_shuffle_is_deterministic_per_question():
    rows = [normalize_record("gpqa", r, i) for i, r in enumerate(GPQA_ROWS)]
    again = [normalize_record("gpqa", r, 5 - i) for i, r in reversed(list(enumerate(GPQA_ROWS)))]
    assert rows == list(reversed(again))                  # not row order, not the call
    for row, record in zip(rows, GPQA_ROWS):
        gold = LETTERS.index(row["answer"])
        assert row["options"][gold] == record["Correct Answer"].strip()
        assert sorted(row["options"]) == sorted(
            record[k].strip() for k in ("Correct Answer", "Incorrect Answer 1",
                                        "Incorrect Answer 2", "Incorrect Answer 3"))
    # pinned: the shuffle must not change between versions (cached samples would mismatch)
    assert gpqa_permutation("Which compound is aromatic?") == [0, 2, 3, 1]
    assert rows[1]["answer"] == "A" and rows[1]["options"][1] == "cyclooctatetraene"
    # the gold is not always first: over many questions every position occurs, about evenly
    golds = [gpqa_permutation(f"question {i}").index(0) for i in range(400)]
    assert all(60 < golds.count(p) < 140 for p in range(4))
    assert gpqa_permutation("q", seed=1) != gpqa_permutation("q", seed=0) or \
        gpqa_permutation("q2", seed=1) != gpqa_permutation("q2", seed=0)


# --- the grader ----------------------------------------------------------------------------------

@pytest.mark.parametrize("text, letter", [
    ("so \\boxed{B}", "B"),
    ("first \\boxed{A}, no wait: \\boxed{C}", "C"),            # several boxes: the last
    ("\\boxed{c}", "C"),                                       # lower case inside a box
    ("\\boxed{(D)}", "D"),
    ("\\boxed{\\text{B}}", "B"),
    ("\\boxed{\\textbf{E}.}", "E"),
    ("\\boxed{C. 10^-4 eV}", "C"),                             # letter and option text
    ("$\\boxed{J}$", "J"),
    ("\\boxed{AC}", None),                                     # several letters
    ("\\boxed{A, C}", None),
    ("\\boxed{A and C}", None),
    ("\\boxed{42}", None),
    ("\\boxed{}", None),
    ("\\boxed{K}", None),                                      # beyond J
    ("the answer is \\boxed{B", None),                         # unbalanced (truncated)
    ("\\boxed{AB} ... the answer is (C)", None),               # a box wins over the fallback
    ("Therefore, the answer is (C).", "C"),
    ("the answer is (c)", "C"),
    ("Answer: D", "D"),
    ("The final answer is B", "B"),
    ("answer: A then later Answer: (B)", "B"),                 # the last one
    ("the answer is a prime number", None),                    # bare lower-case "a" is a word
    ("the answer is Apple", None),
    ("I think it is B", None),                                 # no box, no "answer": nothing
    ("", None),
    ("<think>\\boxed{A}</think> so \\boxed{D}", "D"),          # after the reasoning
    ("<think>the answer is (A)</think> nothing boxed", None),
])
def test_extract_choice_adversarial(text, letter):
    assert extract_choice(text) == letter


def test_choice_reward_exact_letter_match():
    reward = ChoiceReward()
    texts = ["\\boxed{B}", "\\boxed{b}", "\\boxed{A}", "\\boxed{AB}", "no answer", "Answer: B"]
    assert reward.batch(texts, ["B"] * len(texts)) == [1.0, 1.0, 0.0, 0.0, 0.0, 1.0]


def test_grader_is_fast_on_long_adversarial_text():
    import time

    reward = ChoiceReward()
    texts = ["\\boxed{" * 20000, "answer is " * 50000 + "(B)", "{" * 100000 + "\\boxed{A}"]
    start = time.perf_counter()
    assert reward.batch(texts, ["B", "B", "A"]) == [0.0, 1.0, 1.0]
    assert time.perf_counter() - start < 5.0


# --- loaders: hub path and local copies share the normalization ----------------------------------

@pytest.mark.parametrize("name", list(UPSTREAM))
def test_hub_rows_are_normalized_from_local_copies(name, tmp_path, monkeypatch):
    """`datasets.load_dataset` is served from a local copy of the upstream rows; the hub path
    and a local file in the same layout give the same normalized rows."""
    import datasets

    path = _write_jsonl(tmp_path / f"{name}.jsonl", UPSTREAM[name])
    real_load_dataset, calls = datasets.load_dataset, []

    def fake_load_dataset(hub_id, config=None, split=None):
        calls.append((hub_id, config, split))
        return real_load_dataset("json", data_files=str(path), split="train",
                                 cache_dir=str(tmp_path / "hf-cache"))

    from_local = load_benchmark(name, path=path)
    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    from_hub = load_benchmark(name, data_dir=tmp_path / "nothing-here")
    assert calls[-1] == HUB[name]
    assert from_hub == from_local
    assert len(from_hub) == len(UPSTREAM[name])
    for row, record in zip(from_hub, UPSTREAM[name]):
        assert set(row) == {"id", "problem", "options", "answer"}
        assert row["options"][LETTERS.index(row["answer"])] == _correct_text(name, record)


def _correct_text(name, record):
    """The gold option's text, read from an upstream row the way its dataset card defines it."""
    if name == "arc_challenge":
        return record["choices"]["text"][record["choices"]["label"].index(record["answerKey"])]
    if name == "gpqa_diamond":
        return record["Correct Answer"].strip()
    return record["options"][record["answer_index"]]


def test_normalized_rows_per_format():
    arc = [normalize_record("arc", r, i) for i, r in enumerate(ARC_ROWS)]
    assert arc[0] == {"id": "Mercury_7175875", "problem": ARC_ROWS[0]["question"],
                      "options": ARC_ROWS[0]["choices"]["text"], "answer": "C"}
    assert arc[1]["answer"] == "D" and arc[1]["options"][3] == "an iron nail"   # 1-4 -> A-D
    assert len(arc[2]["options"]) == 3
    mmlu = [normalize_record("mmlu_pro", r, i) for i, r in enumerate(MMLU_PRO_ROWS)]
    assert mmlu[0]["answer"] == "I" and len(mmlu[0]["options"]) == 10 and mmlu[0]["id"] == "70"
    assert mmlu[1]["answer"] == "B" and mmlu[1]["options"][1] == "4"
    with pytest.raises(ValueError, match="disagree"):
        normalize_record("mmlu_pro", {**MMLU_PRO_ROWS[1], "answer_index": 2}, 0)
    with pytest.raises(ValueError, match="answerKey"):
        normalize_record("arc", {**ARC_ROWS[0], "answerKey": "E"}, 0)
    with pytest.raises(ValueError, match="Incorrect Answer 3"):
        normalize_record("gpqa", {**GPQA_ROWS[0], "Incorrect Answer 3": ""}, 0)


def test_local_parquet_with_field_mapping(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    renamed = [{"qid": r["question_id"], "prompt": r["question"], "choices": r["options"],
                "answer": r["answer"], "answer_index": r["answer_index"]} for r in MMLU_PRO_ROWS]
    path = tmp_path / "mmlu.parquet"
    pq.write_table(pa.Table.from_pylist(renamed), path)
    bench = {"name": "mmlu_pro", "fields": {"question_id": "qid", "question": "prompt",
                                            "options": "choices"}}
    rows = load_benchmark(bench, path=path)
    assert rows == [normalize_record("mmlu_pro", r, i) for i, r in enumerate(MMLU_PRO_ROWS)]


def test_registry():
    assert {n: (BENCHMARKS[n].k, BENCHMARKS[n].domain) for n in UPSTREAM} == {
        "arc_challenge": (4, "choice"), "gpqa_diamond": (8, "choice"), "mmlu_pro": (4, "choice")}
    from aspo_lit.__main__ import TOOLS, resolve
    from aspo_lit.eval.table_commands import table
    assert resolve(TOOLS["table3"].target) is table and TOOLS["table3"].fixed == {"table": "table3"}


# --- resume after a kill ---------------------------------------------------------------------------

def LetterEngine(rows, fail_on_call=None) -> FakeEngine:
    """Answers `\\boxed{gold}` for sample j of a problem iff (hash(question) + j) % 3 == 0, else
    another letter (questions lower-cased, as the decoded prompt is matched)."""
    return FakeEngine({r["problem"].lower(): r["answer"] for r in rows}, fail_on_call=fail_on_call,
                      wrong=lambda gold: "A" if gold != "A" else "B")


def _records(out: Path, name: str):
    return [json.loads(x) for x in next(out.glob(f"*/{name}.samples.jsonl")).read_text().splitlines()]


def test_killed_choice_evaluation_resumes(tmp_path, tiny_model_dir):
    path = write_fixture("gpqa", tmp_path / "gpqa.jsonl", n=6, seed=3)
    bench = {"name": "gpqa_diamond", "path": str(path), "k": 4}
    rows = load_benchmark(bench, path=path)

    def run(out, engine):
        return evaluate_model(str(tiny_model_dir), [bench], out, engine=engine, max_tokens=16,
                              samples_per_call=4)

    reference = run(tmp_path / "ref", LetterEngine(rows))["gpqa_diamond"]
    with pytest.raises(RuntimeError, match="killed"):
        run(tmp_path / "run", LetterEngine(rows, fail_on_call=4))   # dies after 3 problems
    assert len(_records(tmp_path / "run", "gpqa_diamond")) == 3 * 4
    assert not list((tmp_path / "run").glob("*/gpqa_diamond.done.json"))

    engine = LetterEngine(rows)
    resumed = run(tmp_path / "run", engine)["gpqa_diamond"]
    assert engine.prompts == 3                                        # only the unfinished ones
    records = _records(tmp_path / "run", "gpqa_diamond")
    keys = [(r["problem_id"], r["sample_index"]) for r in records]
    assert len(keys) == len(set(keys)) == 6 * 4
    ref = {(r["problem_id"], r["sample_index"]): r for r in _records(tmp_path / "ref", "gpqa_diamond")}
    assert all(ref[(r["problem_id"], r["sample_index"])] == r for r in records)
    assert resumed["avg@k"] == approx64(reference["avg@k"])
    assert resumed["pass@k"] == approx64(reference["pass@k"])
    correct = {}
    for r in records:
        assert r["answer_extracted"] in LETTERS
        correct[r["problem_id"]] = correct.get(r["problem_id"], 0) + r["correct"]
    assert 0 < sum(correct.values()) < 24                             # graded, not all one way
    assert resumed["avg@k"] == approx64(100 * sum(correct.values()) / 24)
    assert resumed["pass@k"] == approx64(100 * sum(c > 0 for c in correct.values()) / 6)
    meta = json.loads(next((tmp_path / "run").glob("*/gpqa_diamond.meta.json")).read_text())
    assert meta["prompt_format"] == "choice-v1" and meta["gpqa_shuffle_seed"] == 0


# --- Table 3 beside the paper ------------------------------------------------------------------------

def test_render_table3_against_the_paper(tmp_path):
    from aspo_lit.eval.tables import load_paper_table, render_table

    columns, paper = load_paper_table(REPO / "aspo_lit" / "eval" / "data" / "table3.csv")
    assert columns == ["arc_challenge", "gpqa_diamond", "mmlu_pro", "avg"]
    assert paper[("Qwen3-8B", "ASPO")] == {"arc_challenge": 88.6, "gpqa_diamond": 56.3,
                                           "mmlu_pro": 57.4, "avg": 59.8}
    ours = {("Qwen3-4B", "base"): {"arc_challenge_avg@4": 70.0, "arc_challenge_pass@4": 90.0,
                                   "gpqa_diamond_avg@8": 20.0, "gpqa_diamond_pass@8": 60.0,
                                   "mmlu_pro_avg@4": 30.0, "mmlu_pro_pass@4": 50.0},
            ("Qwen3-4B", "mine"): {"arc_challenge_avg@4": 10.0}}
    # SEs ride with their columns through the renaming to the paper's single accuracy column
    errors = {("Qwen3-4B", "base"): {"arc_challenge_avg@4": 3.0, "gpqa_diamond_avg@8": 4.0, "mmlu_pro_avg@4": 0.5,
                                     "gpqa_diamond_pass@8": 2.0}}
    markdown, rows = render_table(ours, "table3", compare_paper=True, out_dir=tmp_path, errors=errors,
                                  missing={("Qwen3-4B", "ASPO"): "not found: runs/x.ckpt"})
    by_key = {(r["base_model"], r["method"]): r for r in rows}
    base = by_key[("Qwen3-4B", "base")]
    # |70.0 - 74.7| = 4.7 <= 2·3.0 + 0.05 (the paper's rounding)
    assert base["cells"]["arc_challenge"] == {"ours": 70.0, "se": 3.0, "paper": 74.7, "paper_se": None,
                                              "delta": approx64(-4.7), "verdict": "consistent", "why": ""}
    assert base["cells"]["mmlu_pro"]["verdict"] == "below"       # 30.0 vs 31.5: 1.5 > 2·0.5 + 0.05
    assert base["cells"]["avg"]["ours"] == approx64(40.0)
    assert base["cells"]["avg"]["delta"] == approx64(-0.2)
    assert base["cells"]["avg"]["se"] == approx64(math.sqrt(3.0 ** 2 + 4.0 ** 2 + 0.5 ** 2) / 3)
    assert base["cells"]["gpqa_diamond_pass@8"] == {"ours": 60.0, "se": 2.0, "paper": None, "paper_se": None,
                                                    "delta": None, "verdict": "missing", "why": "reference"}
    assert by_key[("Qwen3-4B", "ASPO")]["status"] == "missing"
    assert by_key[("Qwen3-8B", "GRPO")]["reason"] == "not evaluated"
    assert by_key[("Qwen3-4B", "mine")]["cells"]["avg"]["ours"] is None   # not all three
    assert list(by_key)[:6] == list(paper)                               # the paper's row order
    header = markdown.splitlines()[0]
    assert header.index("arc_challenge") < header.index("arc_challenge_pass@4") < header.index("| avg |")
    assert "70.0 ± 3.0 / 74.7 / -4.7 consistent" in markdown and "not found: runs/x.ckpt" in markdown
    assert "| 60.0 ± 2.0 |" in markdown                                  # pass@K: no paper value, no verdict
    assert (tmp_path / "table3.md").is_file() and (tmp_path / "table3.csv").is_file()


# --- the tiny profile end to end ------------------------------------------------------------------

def test_tiny_profile_fixtures_are_in_upstream_layout(tmp_path):
    import yaml

    from aspo_lit.eval.table_commands import prepare_benchmark_files

    config = yaml.safe_load((REPO / "conf" / "tiny" / "table3.yaml").read_text())
    prepared = prepare_benchmark_files(config["benchmarks"], tmp_path)
    keys = {"arc_challenge": {"id", "question", "choices", "answerKey"},
            "gpqa_diamond": {"Record ID", "Question", "Correct Answer", "Incorrect Answer 1",
                             "Incorrect Answer 2", "Incorrect Answer 3"},
            "mmlu_pro": {"question_id", "question", "options", "answer", "answer_index"}}
    for spec in prepared:
        first = json.loads(Path(spec["path"]).read_text().splitlines()[0])
        assert keys[spec["name"]] <= set(first)
        rows = load_benchmark(spec, path=spec["path"])
        assert len(rows) == 12 and all(r["answer"] in LETTERS for r in rows)
    assert fixture_records("arc", 3) == fixture_records("arc", 3)


@pytest.mark.slow
def test_tiny_profile_table3(tmp_path):
    """conf/tiny/table3.yaml end to end on the testbed (what `make reproduce-table3 PROFILE=tiny`
    runs): base always; the tiny GRPO/ASPO rows when trained, else reported missing."""
    import yaml

    from aspo_lit.eval.table_commands import evaluate_table

    config = yaml.safe_load((REPO / "conf" / "tiny" / "table3.yaml").read_text())
    markdown, rows = evaluate_table({**config, "out_dir": str(tmp_path)}, root=REPO, table="table3")
    by_method = {r["method"]: r for r in rows}
    base = by_method["base"]
    assert base["status"] == "ok", base["reason"]
    for column in ("arc_challenge", "gpqa_diamond", "mmlu_pro", "avg", "mmlu_pro_pass@2"):
        assert base["cells"][column]["ours"] is not None
    for method in ("GRPO", "ASPO"):
        assert by_method[method]["status"] == "ok" or "conf/tiny/" in by_method[method]["reason"]
    for name in ("arc_challenge", "gpqa_diamond", "mmlu_pro"):
        records = _records(tmp_path / "models", name)
        assert len(records) == 12 * 2
    assert (tmp_path / "table3.md").read_text() == markdown
