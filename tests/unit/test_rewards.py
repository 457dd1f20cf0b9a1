"""MathVerifyReward: self-grading of the six benchmarks, extraction, the grading pool, and the
overlong penalty (applied once, by the DataModule); time bounds for every rule of MathReward."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import signal
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from aspo_lit.rewards import (
    VERIFIERS,
    MathReward,
    MathVerifyReward,
    RewardFn,
    compute_score,
    extract_answer,
    last_boxed_only_string,
    normalize_answer,
    overlong_penalty,
)
from aspo_lit.rewards.pool import GradingPool

BENCHMARKS = ["aime24", "aime25", "amc23", "math500", "minerva", "olympiadbench"]
TIMEOUT_S = 1.0  # per-call bound used by the adversarial tests
MARGIN_S = 2.0  # scheduling slack on a loaded 2-core machine


def _data_dir() -> Path:
    """``$ASPO_DATA_DIR``, else ``<repo root>/../shared/data``."""
    env = os.environ.get("ASPO_DATA_DIR")
    return Path(env) if env else Path(__file__).resolve().parents[2].parent / "shared" / "data"


def _rows(name: str) -> list[dict]:
    path = _data_dir() / f"{name}.jsonl"
    if not path.exists():
        pytest.skip(f"benchmark file {path} not found (set ASPO_DATA_DIR to the folder with the six JSONL files)")
    with path.open() as f:
        return [json.loads(line) for line in f if line.strip()]


def _response(answer: str) -> str:
    return "Let me think. Maybe \\boxed{0}?</think> The answer is \\boxed{%s}." % answer


@pytest.fixture(scope="module")
def reward():
    """Main-thread grading through math-verify (fast path off, so math-verify is exercised)."""
    r = MathVerifyReward(timeout_s=5.0, fast_path=False, num_workers=2)
    yield r
    r.close()


# --------------------------------------------------------------------------- benchmarks


@pytest.mark.parametrize("name", BENCHMARKS)
def test_gold_self_grading(name, reward):
    """Every gold answer graded against itself scores 1 for >= 99% of rows (math-verify path)."""
    rows = _rows(name)
    start = time.perf_counter()
    failures = [(r["id"], r["answer"]) for r in rows if reward(_response(r["answer"]), r["answer"]) != 1.0]
    elapsed = time.perf_counter() - start
    rate = 1 - len(failures) / len(rows)
    print(f"\n{name}: self-grading {rate:.2%} of {len(rows)} in {elapsed:.1f} s; failures: {failures}")
    assert rate >= 0.99, failures


@pytest.mark.parametrize("name", BENCHMARKS)
def test_wrong_answers_score_zero(name, reward):
    """Integer golds off by one, and the next row's (different) gold, score 0."""
    rows = _rows(name)[:40]
    ints = [r["answer"] for r in rows if r["answer"].strip().lstrip("-").isdigit()]
    for gold in ints:
        assert reward(_response(str(int(gold) + 1)), gold) == 0.0, gold
    pairs = [(a["answer"], b["answer"]) for a, b in zip(rows, rows[1:])
             if normalize_answer(a["answer"]) != normalize_answer(b["answer"])]
    scored = [(g, w) for g, w in pairs if reward(_response(w), g) != 0.0]
    # A different gold string can still be the same value (e.g. "5" vs "x=5"): allow a few.
    assert len(scored) <= max(1, len(pairs) // 20), scored


def test_gold_self_grading_process_pool(reward):
    """A sample of every benchmark graded through ``batch`` (worker processes) scores 1."""
    texts, golds = [], []
    for name in BENCHMARKS:
        for row in _rows(name)[::25][:8]:
            texts.append(_response(row["answer"]))
            golds.append(row["answer"])
    start = time.perf_counter()
    scores = reward.batch(texts, golds)
    print(f"\npool: {sum(scores)}/{len(scores)} in {time.perf_counter() - start:.1f} s")
    assert scores == [1.0] * len(texts), [g for g, s in zip(golds, scores) if s != 1.0]
    wrong = reward.batch([_response("\\frac{3}{7}"), _response("x+1")], ["\\frac{1}{2}", "x-1"])
    assert wrong == [0.0, 0.0]


# --------------------------------------------------------------------------- grading rules


@pytest.mark.parametrize(
    "answer, gold",
    [
        ("\\dfrac{1}{2}", "\\frac12"),
        ("0.5", "\\frac{1}{2}"),
        ("\\frac{\\sqrt{3}}{2}", "\\frac{1}{2}\\sqrt{3}"),
        ("x=5", "5"),
        ("\\left(1, 2\\right)", "(1,2)"),
        ("25", "\\boxed{25}"),
        ("25", "$25$"),
    ],
)
def test_equivalent_answers(answer, gold):
    assert MathVerifyReward(fast_path=False)(f"</think>\\boxed{{{answer}}}", gold) == 1.0


def test_think_tag_handling():
    r = MathVerifyReward()
    # A boxed answer inside the reasoning is ignored once </think> is present.
    assert r("<think>\\boxed{7}</think> so the answer is 8", "7") == 0.0
    assert r("<think>\\boxed{8}</think> \\boxed{7}", "7") == 1.0
    # The text after the LAST </think> counts.
    assert r("<think>a</think>\\boxed{7} <think>b</think> \\boxed{9}", "9") == 1.0
    # Without </think> the whole text is graded.
    assert r("no thinking tags, \\boxed{7}", "7") == 1.0
    # think_end_token=None grades everything (the last boxed of the whole text).
    assert MathVerifyReward(think_end_token=None)("\\boxed{8}</think>\\boxed{7}", "7") == 1.0
    assert MathVerifyReward(think_end_token=None)("\\boxed{7}</think>", "7") == 1.0


def test_last_boxed_extraction():
    assert last_boxed_only_string("a \\boxed{1} b \\boxed{\\frac{2}{3}} c") == "\\boxed{\\frac{2}{3}}"
    assert extract_answer("\\boxed{1} then \\fbox{2}") == "2"
    assert extract_answer("\\boxed {12}") == "12"
    assert extract_answer("\\boxed 12 ok") == "12"
    assert extract_answer("nothing here") is None
    assert extract_answer("\\boxed{1} \\boxed{\\frac{2}{3}") is None  # the last one is cut off
    r = MathVerifyReward()
    assert r("\\boxed{3} wait, no: \\boxed{4}", "4") == 1.0
    assert r("\\boxed{3} wait, no: \\boxed{4}", "3") == 0.0
    assert r("no box: the answer is 4", "4") == 0.0


def test_empty_gold_scores_zero():
    assert MathVerifyReward(fast_path=False)("</think>\\boxed{}", "") == 0.0
    assert MathVerifyReward()("</think>\\boxed{1}", "") == 0.0


# --------------------------------------------------------------------------- time bounds

ADVERSARIAL = {
    "power_tower": "\\boxed{9^{9^{9^{9}}}}",
    "power_tower_sum": "\\boxed{9^{9^{9}}+1}",
    "huge_factorial": "\\boxed{(10^{10^{5}})!}",
    "huge_binomial": "\\boxed{\\binom{10^{7}}{5\\cdot 10^{6}}}",
    "long_sum_100k": "\\boxed{" + "1+" * 50000 + "1}",
    "long_text_100k": "x" * 100000 + "\\boxed{" + "a" * 100000 + "}",
    "deep_braces_5000": "\\boxed{" + "{" * 5000 + "1" + "}" * 5000 + "}",
    "nested_fracs": "\\boxed{" + "\\frac{1}{" * 30 + "2" + "}" * 30 + "}",
    "malformed": "\\boxed{\\frac{1}{\\sqrt{}}^^_\\left(}",
    "unbalanced": "\\boxed{\\frac{1}{2}",
    "junk_commands": "\\boxed{\\begin{array}\\end{matrix}\\\\\\\\&&&}",
    # DeepScaleR's sympy path: Python powers, towers DeepScaleR's "^" guards let through,
    # factorials, huge float literals (parse_expr and big-integer maths run in C, beyond signals)
    "python_power_tower": "\\boxed{9**9**9}",
    "paren_power_tower": "\\boxed{" + "(" * 8 + "9" + "^9)" * 8 + "}",
    "factorial_tower": "\\boxed{((9!)!)!}",
    "rising_factorial": "\\boxed{rf(99,9)!}",
    "huge_float": "\\boxed{1e999999}",
    "python_code": "\\boxed{().__class__.__base__}",
    # the released rule parses the whole text: 5 MB of it
    "text_5mb": "$1$ " * 1_250_000,
}
GOLDS = ["5", "\\frac{1}{3}"]  # an integer gold, and one that sends DeepScaleR's answer to sympy


@pytest.mark.hostile
@pytest.mark.parametrize("name", sorted(ADVERSARIAL))
def test_adversarial_main_thread_bounded(name):
    """Every rule, in the calling thread: 0 within the time bound (two verifier steps at most)."""
    for verifier in VERIFIERS:
        r = MathReward(verifier, timeout_s=TIMEOUT_S)
        for gold in GOLDS:
            start = time.perf_counter()
            score = r("</think>" + ADVERSARIAL[name], gold)
            elapsed = time.perf_counter() - start
            assert score == 0.0, (verifier, gold)
            assert elapsed < 2 * TIMEOUT_S + MARGIN_S, f"{name} ({verifier}, gold {gold}) took {elapsed:.1f} s"


@pytest.mark.hostile
@pytest.mark.parametrize("verifier", VERIFIERS)
def test_adversarial_process_pool_bounded(verifier):
    r = MathReward(verifier, timeout_s=TIMEOUT_S, num_workers=2)
    try:
        r.batch(["\\boxed{1}"], ["2"])  # start the workers outside the timed part
        texts = ["</think>" + v for v in ADVERSARIAL.values() for _ in GOLDS] + [_response("\\frac{1}{2}")]
        golds = GOLDS * len(ADVERSARIAL) + ["0.5"]
        start = time.perf_counter()
        scores = r.batch(texts, golds)
        elapsed = time.perf_counter() - start
        assert scores == [0.0] * (len(texts) - 1) + [1.0]
        bound = len(texts) * 2 * TIMEOUT_S / r.num_workers + MARGIN_S
        assert elapsed < bound, f"{elapsed:.1f} s > {bound:.1f} s"
    finally:
        r.close()


@pytest.mark.parametrize("verifier", ["either", "released"])
def test_non_main_thread_is_bounded(verifier):
    """From a worker thread signals are unavailable: the call goes to a process, still bounded."""
    r = MathReward(verifier, timeout_s=TIMEOUT_S, num_workers=1)
    r.batch(["\\boxed{1}"], ["2"])  # start the worker outside the timed part
    out = {}

    def grade():
        start = time.perf_counter()
        out["bad"] = r("</think>" + ADVERSARIAL["power_tower"], "5")
        out["elapsed"] = time.perf_counter() - start
        out["good"] = r(_response("0.5"), "\\frac12")
        out["batch"] = r.batch([_response("3"), _response("4")], ["3", "5"])

    try:
        t = threading.Thread(target=grade)
        t.start()
        t.join(timeout=60)
        assert not t.is_alive()
        assert out["bad"] == 0.0 and out["good"] == 1.0 and out["batch"] == [1.0, 0.0]
        assert out["elapsed"] < TIMEOUT_S * 1.5 + 2.0 + MARGIN_S  # worker hard deadline + slack
    finally:
        r.close()


@pytest.mark.hostile
def test_hung_worker_is_killed_and_replaced(caplog):
    """A worker stuck past the hard deadline is killed (reported); its item scores 0, the pool goes on."""
    r = MathVerifyReward(timeout_s=60.0, hard_timeout_s=1.0, num_workers=1)
    try:
        r.batch(["\\boxed{1}"], ["2"])
        start = time.perf_counter()
        with caplog.at_level(logging.WARNING, logger="aspo_lit.rewards.pool"):
            scores = r.batch(["</think>" + ADVERSARIAL["power_tower"], _response("0.5")], ["5", "\\frac{1}{2}"])
        elapsed = time.perf_counter() - start
        assert scores == [0.0, 1.0]
        assert r.pool.num_killed == 1
        assert "exceeded 1.0 s; killed, item 0 scores 0" in caplog.text
        assert elapsed < 1.0 + 30.0  # the deadline, plus starting one replacement worker
        assert r.batch([_response("x+1"), _response("7")], ["1+x", "8"]) == [1.0, 0.0]
        assert r.pool.num_killed == 1
    finally:
        r.close()


def _call(fn, *args):
    """The pool tests' grading function: ``fn(*args)`` in a worker (``operator.call``, Python 3.11+)."""
    return fn(*args)


@pytest.mark.hostile
def test_grading_pool_deadline_and_dead_workers():
    """Past the hard deadline (even stuck inside C code) or with its worker dead, an item scores 0
    and is counted; the rest are graded, in order, and the pool keeps working, even after a
    worker died between calls."""
    stuck = (hashlib.pbkdf2_hmac, "sha256", b"key", b"salt", 10**9)  # minutes in C code, deaf to signals
    pool = GradingPool(_call, num_workers=2, hard_timeout_s=1.0, memory_limit_mb=None)
    try:
        assert pool.map([(float, 1)]) == [1.0]  # start the workers outside the timed part
        start = time.perf_counter()
        assert pool.map([stuck]) == [0.0]
        assert time.perf_counter() - start < 1.0 + 1.5  # killed at the deadline, no polite wait
        assert pool.map([stuck, (os._exit, 3), (float, 2), (float, 3), (float, 4)]) == [0.0, 0.0, 2.0, 3.0, 4.0]
        assert pool.num_killed == 3
        assert pool.map([(float, 5), (float, 6)]) == [5.0, 6.0]
        assert pool.num_killed == 3
        # A worker that dies while the pool is idle breaks a Pebble pool; the next call starts afresh.
        assert pool.map([(os.system, "(sleep 0.2; kill -9 $PPID) &")]) == [0.0]
        time.sleep(1.5)
        assert pool.map([(float, 7)]) == [7.0]
    finally:
        pool.close()


def test_grading_pool_memory_limit():
    """An item past the worker's address-space limit scores 0; the worker goes on."""
    pool = GradingPool(_call, num_workers=1, hard_timeout_s=30.0, memory_limit_mb=512)
    try:
        assert pool.map([(eval, "len(bytes(2**30))"), (float, 1)]) == [0.0, 1.0]
        assert pool.num_killed == 0
    finally:
        pool.close()


# --------------------------------------------------------------------------- extras


def test_overlong_penalty_values():
    # max 100 tokens, last 20 are the buffer
    assert overlong_penalty(50, 100, 20, 1.0) == 0.0
    assert overlong_penalty(80, 100, 20, 1.0) == 0.0
    # quotients of small integers that are exactly representable: exact
    assert overlong_penalty(90, 100, 20, 1.0) == -0.5
    assert overlong_penalty(100, 100, 20, 1.0) == -1.0
    assert overlong_penalty(95, 100, 20, 2.0) == -1.5
    assert overlong_penalty(100, 100, 0, 1.0) == 0.0  # no buffer: off


@pytest.mark.parametrize("buffer, expected", [(20, [1.0, 0.5, -1.0, 0.0]), (0, [1.0, 1.0, 0.0, 0.0])])
def test_overlong_penalty_applied_once_in_rollouts(buffer, expected):
    """``data.overlong_buffer`` with the default math-verify reward: the penalty is added exactly once."""
    import torch  # here, not at the top: Lightning takes long to import and only this test needs it

    from aspo_lit.rollout import Completion, RolloutEngine
    from aspo_lit.training.module import PolicyHandle
    from data_modules.math import RLDataModule

    class ScriptedEngine(RolloutEngine):
        """Every prompt gets the same group of (text, token count) completions."""

        shares_policy = True

        def attach(self, model, tokenizer, model_path):
            self._attached = True

        def generate(self, prompts, n=1, sampling=None):
            return [[Completion(token_ids=[1] * length, text=text, finish_reason="stop", logprobs=[0.0] * length)
                     for text, length in group] for _ in prompts]

        def update_weights(self, named_tensors):
            pass

    group = [(_response("3"), 50), (_response("3"), 90), (_response("4"), 100), (_response("4"), 10)]
    data = RLDataModule(group_size=4, max_response_length=100, overlong_buffer=buffer,
                            overlong_penalty_factor=1.0, engine=ScriptedEngine(),
                            reward=MathVerifyReward(num_workers=0))
    data.attach_policy(PolicyHandle(tokenizer=SimpleNamespace(pad_token_id=0), policy=None, model_path=None,
                                    device=torch.device("cpu")))
    data.trainer = SimpleNamespace(global_step=0, world_size=1, global_rank=0)
    batch = data.controller.rollout([{"id": 0, "problem": "1+2?", "answer": "3", "prompt_ids": [5, 6]}], seed=0)
    assert batch.rewards.tolist() == expected  # 1 or 0 plus a penalty of 0, -0.5 or -1: exact in fp32


def test_format_reward():
    r = MathVerifyReward(format_reward=True, format_error_score=-1.0)
    assert r("<think>x</think>\\boxed{3}", "3") == 1.0
    assert r("<think>x</think>\\boxed{4}", "3") == 0.0
    assert r("<think>x \\boxed{3}", "3") == -1.0  # thinking never closed
    assert r("<think>x</think> 3", "3") == -1.0  # no boxed answer
    assert MathVerifyReward()("<think>x \\boxed{3}", "3") == 1.0  # off by default


def test_picklable_and_protocol():
    r = MathVerifyReward(timeout_s=2.0, num_workers=1)
    try:
        assert isinstance(r, RewardFn)
        r.batch(["\\boxed{1}"], ["2"])  # a live pool must not break pickling
        clone = pickle.loads(pickle.dumps(r))
        assert clone.timeout_s == 2.0 and clone.pool is None
        assert clone(_response("0.5"), "\\frac12") == 1.0
    finally:
        r.close()


def test_in_process_grading():
    """``num_workers=0`` grades ``batch`` in the main thread (no worker process); ``compute_score``
    called from another thread grades there, without signals."""
    r = MathVerifyReward(num_workers=0, fast_path=False)
    assert r.batch([_response("\\dfrac{2}{4}"), _response("x+1")], ["\\frac12", "x-1"]) == [1.0, 0.0]
    assert r.pool is None
    out = {}
    t = threading.Thread(target=lambda: out.update(score=compute_score(_response("0.5"), "\\frac12", fast_path=False)))
    t.start()
    t.join(timeout=60)
    assert out == {"score": 1.0}


def test_grading_keeps_an_outer_timer():
    """math-verify's ``signal.alarm(0)`` would cancel a timer set by the caller (e.g. pytest-timeout's)."""
    fired = []
    old_handler = signal.signal(signal.SIGALRM, lambda *_: fired.append(True))
    signal.setitimer(signal.ITIMER_REAL, 30.0)
    try:
        assert MathVerifyReward(fast_path=False)(_response("\\dfrac{2}{4}"), "\\frac12") == 1.0
        left, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 20.0 < left <= 30.0 and not fired
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old_handler)


def test_deadline_in_a_finalizer_stays_quiet(monkeypatch):
    """A deadline that lands in a finalizer is swallowed there and raised again by the repeat; it
    must not reach ``sys.unraisablehook`` (pytest's hook, formatting it, was itself interrupted by
    the next alarm and failed the run), while other unraisable exceptions still do."""
    from aspo_lit.rewards.math import bounded_in_main_thread

    seen = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(u.exc_type))

    class SlowFinalizer:
        def __del__(self):
            end = time.monotonic() + 1.0   # the 0.1 s deadline fires in here
            while time.monotonic() < end:
                pass

    class FailingFinalizer:
        def __del__(self):
            raise ValueError("not ours")

    def grade():
        SlowFinalizer()
        FailingFinalizer()   # runs just after an alarm, far from the next one (50 ms)
        while True:   # the repeated deadline ends this
            time.sleep(0.01)

    start = time.monotonic()
    assert bounded_in_main_thread(grade, 0.1) == 0.0
    assert time.monotonic() - start < 0.1 + MARGIN_S
    assert seen == [ValueError]
