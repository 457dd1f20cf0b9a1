"""The verifiers beside each other (docs/grading.md): DeepScaleR's verdicts as its source gives
them, the four rules of ``MathReward``, gold normalisation, and every staged benchmark gold,
written the way a model writes it, scoring 1 under the default reward."""

from __future__ import annotations

import json
import re

import pytest

from aspo_lit.rewards import VERIFIERS, MathReward, normalize_gold
from aspo_lit.rewards.deepscaler import extract_boxed, grade_answer_mathd, grade_answer_sympy

BENCHMARKS = ["aime24", "aime25", "amc23", "math500", "minerva", "olympiadbench"]


def _boxed(answer: str) -> str:
    return "<think>Let me check.</think> So the answer is $\\boxed{%s}$." % answer


@pytest.fixture(scope="module")
def rewards():
    """One in-thread reward per rule, the fast path off so that the verifiers decide."""
    return {v: MathReward(verifier=v, num_workers=0, fast_path=False) for v in VERIFIERS}


# --------------------------------------------------------------------------- DeepScaleR's verdicts

# (answer, gold, grade_answer_mathd, grade_answer_sympy): the verdicts of DeepScaleR's own
# deepscaler/rewards/math_utils/utils.py on these pairs, quirks included.
DEEPSCALER_VERDICTS = [
    ("\\frac12", "\\frac{1}{2}", True, True),            # mathd braces \frac12
    ("0.5", "\\frac{1}{2}", True, True),                 # mathd turns 0.5 into \frac{1}{2}
    ("\\dfrac{1}{2}", "1/2", True, True),
    ("\\frac{2}{4}", "\\frac{1}{2}", False, False),       # an unreduced fraction is not accepted
    ("k = 5", "5", True, False),                         # mathd drops a short "k = " prefix
    ("5\\text{ cm}", "5", True, True),                   # units after \text{ are dropped
    ("90^\\circ", "90", True, True),
    ("2^3", "8", False, False),                          # an integer gold takes an integer answer
    ("8.0", "8", False, True),
    ("1,000", "1000", False, True),
    ("(1, 2)", "(1,2)", True, True),
    ("(2,1)", "(1,2)", False, False),
    ("[1,2)", "(1,2)", False, False),                    # the brackets must match
    ("x^2-1", "(x-1)(x+1)", False, True),                # sympy.simplify(gold - answer) == 0
    ("\\sqrt{8}", "2\\sqrt{2}", False, True),
    ("0.001", "10^{-3}", False, True),
    ("\\frac{1}{\\frac{1}{2}}", "\\frac{1}{2}", False, True),   # pylatexenc drops the inner brackets: 1/1/2
    ("x^{10}", "x^{10}", True, True),
    ("x^{10}", "(x^5)^2", False, False),                 # "^{" is never handed to sympy
    ("\\text{(A)}", "A", False, True),
    ("2 and 3", "2, 3", False, True),
]


@pytest.mark.parametrize("answer, gold, mathd, sympy_", DEEPSCALER_VERDICTS)
def test_deepscaler_verdicts(answer, gold, mathd, sympy_):
    assert grade_answer_mathd(answer, gold) is mathd
    assert grade_answer_sympy(answer, gold) is sympy_


def test_deepscaler_extraction():
    """The last ``\\boxed{...}``; ``\\boxed 5``, ``\\fbox`` and an unclosed box are not read."""
    assert extract_boxed("\\boxed{1} then \\boxed{\\frac{1}{2}}.") == "\\frac{1}{2}"
    assert extract_boxed("\\boxed{\\boxed{3}}") == "3"   # the last \\boxed is the inner one
    assert extract_boxed("\\boxed 5") is None
    assert extract_boxed("\\fbox{5}") is None
    assert extract_boxed("\\boxed{5") is None
    assert extract_boxed("no answer") is None


# --------------------------------------------------------------------------- the rules


# (response, gold, {rule: score}): cases where the rules part ways
RULE_CASES = [
    # math-verify's semantics, DeepScaleR's strings: only math-verify accepts
    (_boxed("\\frac{e^{at}-e^{-at}}{2a}"), "\\frac{1}{2a}(e^{a t} - e^{-a t})",
     {"either": 1, "released": 0, "math_verify": 1, "deepscaler": 0}),
    (_boxed("\\sin^{-1}(10/13)"), "\\arcsin\\left(\\frac{10}{13}\\right)",
     {"either": 1, "released": 0, "math_verify": 1, "deepscaler": 0}),
    # DeepScaleR's reading of nested fractions accepts what math-verify rejects
    (_boxed("\\frac{1}{\\frac{1}{2}}"), "\\frac{1}{2}",
     {"either": 1, "released": 1, "math_verify": 0, "deepscaler": 1}),
    # no box: Skywork-OR1's parse of the whole text finds the answer; the released rule takes
    # only the string match, the semantic match is the one its missing `return` drops
    ("<think>hm</think> The answer is $12$.", "12",
     {"either": 1, "released": 1, "math_verify": 0, "deepscaler": 0}),
    ("<think>hm</think> The answer is $\\frac{24}{2}$.", "12",
     {"either": 1, "released": 0, "math_verify": 0, "deepscaler": 0}),
    ("<think>hm</think> The answer is $\\frac{25}{2}$.", "12",
     {"either": 0, "released": 0, "math_verify": 0, "deepscaler": 0}),
    # a wrong answer stays wrong under every rule
    (_boxed("13"), "12", {"either": 0, "released": 0, "math_verify": 0, "deepscaler": 0}),
    (_boxed("\\frac{3}{2}"), "1.5", {"either": 1, "released": 1, "math_verify": 1, "deepscaler": 1}),
]


@pytest.mark.parametrize("response, gold, expected", RULE_CASES)
def test_rules(response, gold, expected, rewards):
    assert {v: rewards[v](response, gold) for v in VERIFIERS} == expected


def test_rule_names_are_checked():
    with pytest.raises(ValueError, match="verifier must be one of either, released, math_verify, deepscaler"):
        MathReward(verifier="both")


def test_fast_path_follows_each_rule():
    """The exact-match shortcut reads the box as the rule's verifier does: DeepScaleR never reads
    ``\\boxed 5``, so the DeepScaleR rule gives it 0 even on an exact match."""
    assert MathReward(verifier="either", num_workers=0)("</think>\\boxed 5", "5") == 1.0
    assert MathReward(verifier="deepscaler", num_workers=0)("</think>\\boxed 5", "5") == 0.0
    assert MathReward(verifier="deepscaler", num_workers=0)("</think>\\boxed{5}", "5") == 1.0


# --------------------------------------------------------------------------- gold normalisation


@pytest.mark.parametrize("gold, latex", [
    ("3.83e35", "3.83 \\times 10^{35}"),
    ("1e-3", "10^{-3}"),
    ("-2.5E+4", "-2.5 \\times 10^{4}"),
    ("1.70e4", "1.70 \\times 10^{4}"),       # significant figures kept as written
    ("-1./3", "-\\frac{1}{3}"),
    ("np.arcsin(10/13)", "\\arcsin\\left(\\frac{10}{13}\\right)"),
    ("\\frac{1}{2}(\\exp{a*t} + \\exp{-a*t})", "\\frac{1}{2}(e^{a t} + e^{-a t})"),
])
def test_normalize_gold_rewrites_python(gold, latex):
    assert normalize_gold(gold) == latex


@pytest.mark.parametrize("gold", ["25", "\\frac{14}{3}", "3e^{2}", "e^{-2t}", "2.5", "1/3", "x^{2}+1", "10^{-3}",
                                  "\\text{(C)}", "6.5 \\times 10^{3}", "(1, 2)", "  7 "])
def test_normalize_gold_keeps_latex(gold):
    assert normalize_gold(gold) == gold


# --------------------------------------------------------------------------- every staged gold


def _model_written(gold: str) -> str:
    """A gold as a model writes it, built without ``normalize_gold``: Python e-notation printed by
    sympy's LaTeX printer (``3.83e35`` -> ``3.83 \\cdot 10^{35}``, ``1e-3`` -> ``0.001``), the five
    code-like Minerva golds by hand, anything else (already LaTeX) as it is."""
    import sympy

    by_hand = {
        "np.arcsin(10/13)": "\\sin^{-1}\\left(\\frac{10}{13}\\right)",
        "-1./3": "-\\frac{1}{3}",
        "-3./2": "-\\frac{3}{2}",
        "\\frac{1}{2a}(\\exp{a*t} - \\exp{-a*t})": "\\frac{e^{at}-e^{-at}}{2a}",
        "\\frac{1}{2}(\\exp{a*t} + \\exp{-a*t})": "\\frac{e^{at}+e^{-at}}{2}",
    }
    if gold in by_hand:
        return by_hand[gold]
    if re.fullmatch(r"-?\d+(\.\d*)?[eE][-+]?\d+", gold):
        digits = len(re.sub(r"\D", "", gold.split("e")[0].split("E")[0]).lstrip("0")) or 1
        return sympy.latex(sympy.Float(gold, digits))
    return gold


def _staged_rows(data_dir, name):
    with open(data_dir / f"{name}.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.mark.parametrize("name", BENCHMARKS)
def test_every_gold_written_by_a_model_scores_one(name, shared_data_dir, rewards):
    """Each gold as loaded for evaluation (normalised), against the answer a model writes for it,
    scores 1 under the default rule; the raw Minerva golds did not (the e-notation ones scored 0)."""
    from aspo_lit.eval.datasets import load_benchmark

    raw = {row["id"]: row["answer"] for row in _staged_rows(shared_data_dir, name)}
    loaded = load_benchmark(name, data_dir=shared_data_dir)
    assert len(loaded) == len(raw)
    texts = [_boxed(_model_written(raw[row["id"]])) for row in loaded]
    reward = rewards["either"]
    failures = [(row["id"], raw[row["id"]]) for row, text in zip(loaded, texts)
                if reward(text, row["answer"]) != 1.0]
    assert failures == []
    if name == "minerva":   # the same answers against the golds as staged
        before = sum(reward(text, raw[row["id"]]) != 1.0 for row, text in zip(loaded, texts))
        assert before > 0


def test_normalised_minerva_golds_still_reject_wrong_answers(shared_data_dir, rewards):
    """The rewritten golds are not accept-anything: a model's answer with another exponent, or
    another problem's rewritten gold, scores 0."""
    rows = [r for r in _staged_rows(shared_data_dir, "minerva") if normalize_gold(r["answer"]) != r["answer"]]
    golds = [normalize_gold(r["answer"]) for r in rows]
    reward = rewards["either"]
    big = [g for g in golds if re.fullmatch(r"[\d.]+ \\times 10\^\{\d+\}", g)]
    assert len(big) >= 20
    off = [g.replace("10^{", "10^{1") for g in big]   # 10^{35} -> 10^{135}
    assert sum(reward(_boxed(o), g) for o, g in zip(off, big)) == 0
    shifted = list(zip(golds[1:], golds))
    accepted = [(a, g) for a, g in shifted if a != g and reward(_boxed(a), g) == 1.0]
    # math-verify rounds to 6 decimals: two values both below 5e-7 compare equal (docs/grading.md)
    assert all(abs(float(sympy_value(a))) < 5e-7 and abs(float(sympy_value(g))) < 5e-7 for a, g in accepted)


def sympy_value(latex: str) -> float:
    """The number a rewritten e-notation gold stands for."""
    m = re.fullmatch(r"(?:([\d.]+) \\times )?10\^\{(-?\d+)\}", latex)
    if m is None:
        return float("nan")
    return float(m[1] or 1) * 10 ** int(m[2])


# --------------------------------------------------------------------------- where the reward is set


def test_deepscaler_rules_need_pylatexenc(monkeypatch):
    """A missing pylatexenc is a clear error when the reward is built, not a silent 0 later."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "pylatexenc" else real(name, *a))
    with pytest.raises(ImportError, match="pip install pylatexenc"):
        MathReward(verifier="either")
    assert MathReward(verifier="math_verify").verifier == "math_verify"


@pytest.mark.parametrize("config", ["conf/aspo.yaml", "conf/tiny/aspo.yaml", "conf/table1.yaml",
                                    "conf/tiny/table1.yaml"])
def test_shipped_configs_name_the_verifier(config, capsys):
    """``--print_config`` of the math fit and Table 1 configs shows the verifier rule (the other
    fit configs compose on these two)."""
    import yaml

    from aspo_lit.__main__ import main

    command = "table1" if "table1" in config else "fit"
    with pytest.raises(SystemExit):
        main([command, "--config", config, "--print_config"])
    printed = yaml.safe_load(capsys.readouterr().out)
    if command == "fit":
        reward = printed["data"]["init_args"]["reward"]
        assert reward["class_path"] == "aspo_lit.rewards.MathReward"
        assert reward["init_args"]["verifier"] == "either"
    else:
        assert printed["math_reward"] == {"verifier": "either"}


def test_defaults_of_training_and_evaluation():
    """The DataModule's and the evaluator's default math reward is ``MathReward`` (rule
    ``either``); a table config's ``math_reward`` arguments reach the evaluator, and the rule is
    part of a math benchmark's sample settings (results graded by another rule are not mixed in)."""
    from aspo_lit.eval.datasets import get_benchmark
    from aspo_lit.eval.evaluate import _EvalRun
    from data_modules.math import RLDataModule

    assert repr(RLDataModule().task.reward).startswith("MathReward(verifier='either'")
    session = _EvalRun("m", None, "hf", None, "chat", False, None, cache_dir=None)
    assert type(session.reward) is MathReward and session.reward.verifier == "either"
    session = _EvalRun("m", None, "hf", None, "chat", False, {"verifier": "released", "timeout_s": 2},
                       cache_dir=None)
    assert session.reward.verifier == "released" and session.reward.timeout_s == 2.0
    session.meta = {"model": "m"}   # the model's fingerprint is not what this test is about
    assert session.meta_for(get_benchmark("aime24")) == {"model": "m", "verifier": "released"}


def test_hub_golds_are_normalised_too(monkeypatch, caplog):
    """A benchmark read from the hub gets the same gold rewriting, reported in the log."""
    import logging

    import datasets

    from aspo_lit.eval.datasets import load_benchmark

    rows = [{"question": "Q1?", "answer": "1e-3"}, {"question": "Q2?", "answer": "\\frac{1}{2}"}]
    monkeypatch.setattr(datasets, "load_dataset", lambda hub_id, config=None, split=None: rows)
    with caplog.at_level(logging.INFO, logger="aspo_lit.data.sources"):
        loaded = load_benchmark("minerva", data_dir="/nonexistent")
    assert [r["answer"] for r in loaded] == ["10^{-3}", "\\frac{1}{2}"]
    assert "math-ai/minervamath: 1 of 2 gold answers rewritten as LaTeX" in caplog.text


# --------------------------------------------------------------------------- repeated work done once

# A demo batch in miniature: a group's samples repeat one another, wrong integer answers recur
# against one gold, one answer is right by math-verify's reading of the whole text only.
REPEATS = [("3*5=15\n15+6=20\n\\boxed{20}", "21"), ("3*5=15\n15+6=21\n\\boxed{21}", "21"),
           ("3*5=15\n15+6=20\n\\boxed{20}", "21"), ("8+5=13\n\\boxed{\\boxed=}", "13"),
           ("8+5=13\n\\boxed{\\boxed=}", "13"), ("2+2=5\n\\boxed{5}", "4"), ("x^2-1", "(x-1)(x+1)"),
           ("3*5=15\n15+6=20\n\\boxed{20}", "21")]


@pytest.mark.parametrize("verifier", VERIFIERS)
def test_a_batch_grades_each_distinct_pair_once_with_the_same_scores(verifier, monkeypatch):
    """``batch`` sends each distinct (text, gold) pair to a verifier once and gives every copy its
    score: the scores of grading every item alone, in the main thread and through the pool."""
    import aspo_lit.rewards.reward as reward_module
    from aspo_lit.rewards.verifiers import grade, quick_score

    texts, golds = map(list, zip(*REPEATS))
    alone = [grade(t, g, verifier, fast_path=False) for t, g in REPEATS]
    assert alone[3] == alone[4] and (verifier != "either" or alone[3] == 1.0)   # the whole-text reading
    undecided = [(t, g) for t, g in REPEATS if quick_score(t, g, verifier, fast_path=False) is None]
    assert len(undecided) > len(set(undecided))    # copies reach the verifiers
    seen = []
    monkeypatch.setattr(reward_module, "grade", lambda t, g, **kw: seen.append((t, g)) or grade(t, g, **kw))
    in_thread = MathReward(verifier=verifier, num_workers=0, fast_path=False)
    assert in_thread.batch(texts, golds) == alone
    assert sorted(seen) == sorted(set(undecided))
    monkeypatch.setattr(reward_module, "grade", grade)   # the pool's workers get the real one
    pooled = MathReward(verifier=verifier, num_workers=1, fast_path=False)
    sent = []
    grade_in_processes = pooled._grade_in_processes
    monkeypatch.setattr(pooled, "_grade_in_processes", lambda items: sent.extend(items) or grade_in_processes(items))
    try:
        assert pooled.batch(texts, golds) == alone
    finally:
        pooled.close()
    assert sorted(sent) == sorted(set(undecided))


def test_recurring_verifier_work_is_cached_and_a_timeout_is_not(monkeypatch):
    """DeepScaleR's sympy comparison of a (gold, answer) pair and math-verify's parse of a gold run
    once per process for a recurring pair or gold (the verdicts unchanged); a comparison that the
    grading deadline interrupts is not cached: the next call compares again. (Strings no other
    test grades, so that the process's caches start without them.)"""
    import math_verify
    from math_verify.errors import TimeoutException

    import aspo_lit.rewards.deepscaler as ds
    import aspo_lit.rewards.verifiers as vf

    parse, parsed = ds._parse, []
    monkeypatch.setattr(ds, "_parse", lambda expr, evaluate: parsed.append(expr) or parse(expr, evaluate))
    assert grade_answer_sympy("z^2-9", "(z-3)(z+3)") and grade_answer_sympy("z^2-9", "(z-3)(z+3)")
    assert not grade_answer_sympy("z^2+9", "(z-3)(z+3)")
    assert len(parsed) == 4     # two parses (the size bound, then simplify) per distinct pair

    def interrupted(expr, evaluate):
        raise TimeoutException("grading deadline")

    monkeypatch.setattr(ds, "_parse", interrupted)
    with pytest.raises(TimeoutException):
        ds._equal_under_sympy("(w-1)(w+1)", "w^2-1")
    monkeypatch.setattr(ds, "_parse", parse)
    assert ds._equal_under_sympy("(w-1)(w+1)", "w^2-1")

    mv_parse, golds_parsed = math_verify.parse, []
    monkeypatch.setattr(math_verify, "parse", lambda text, **kw: golds_parsed.append(text) or mv_parse(text, **kw))
    assert vf.skywork_math_verify("so \\boxed{\\frac{10}{22}}", "\\frac{5}{11}")
    assert not vf.skywork_math_verify("so \\boxed{\\frac{1}{4}}", "\\frac{5}{11}")
    assert vf.skywork_math_verify("so \\boxed{\\frac{15}{33}}", "\\frac{5}{11}")
    assert golds_parsed.count("\\boxed{\\frac{5}{11}}") == 1 and len(golds_parsed) == 4
