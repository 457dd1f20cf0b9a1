"""The paper's training data as sources (§7.1): each upstream row layout read into problem / answer
/ tests, filters, dedup across sources, bad rows reported with source and row, held-out data from
the hub or the staged copy, and the counts the staged copies give."""

from __future__ import annotations

import base64
import json
import logging
import pickle
import zlib

import pytest

from aspo_lit.data.filters import FieldIn, FieldRange
from aspo_lit.data.mixture import Source, load_mixture, normalized_problem
from aspo_lit.data.sources import BadRowError
from aspo_lit.rewards.code import parse_gold
from data_modules.code import CodeRLDataModule
from data_modules.math import RLDataModule

DAPO_TEMPLATE = ("Solve the following math problem step by step. The last line of your response should be of "
                 "the form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
                 "{problem}\n\nRemember to put your answer on its own line after \"Answer:\".")

# --- rows in each upstream layout ---------------------------------------------------------------

DEEPSCALER = [   # agentica-org/DeepScaleR-Preview-Dataset: problem / answer / solution
    {"problem": "Find $x$ if $2x = 6$.", "answer": "3", "solution": "Divide by 2: $x = 3$."},
    {"problem": "What is $1+1$?", "answer": "2", "solution": "..."},
]


def skywork(index, problem, truth, difficulty):
    """Skywork/Skywork-OR1-RL-Data, split math: verl layout, JSON-encoded answer list, per-model difficulty."""
    return {"data_source": "train-math-numinamath1.5_olympiads", "prompt": [{"content": problem, "role": "user"}],
            "ability": "math", "reward_model": {"ground_truth": truth, "style": "rule"},
            "extra_info": {"index": index, "model_difficulty": {"DeepSeek-R1-Distill-Qwen-1.5B": difficulty,
                                                                "DeepSeek-R1-Distill-Qwen-32B": 0,
                                                                "DeepSeek-R1-Distill-Qwen-7B": 2}}}


SKYWORK = [skywork(0, "Compute $3 \\cdot 112$.", '["336"]', 7),
           skywork(1, "What is  1+1?", '["2"]', 16),           # always solved by the 1.5B model: filtered
           skywork(2, "A hard one.", '["5"]', 0),              # never solved: filtered
           skywork(3, "Name both roots.", '["1", "2"]', 3)]    # two different answers: a bad row


def dapo(problem, answer, index):
    """BytedTsinghua-SIA/DAPO-Math-17k: verl layout, the problem inside DAPO's instruction."""
    return {"data_source": "math_dapo", "prompt": [{"content": DAPO_TEMPLATE.format(problem=problem), "role": "user"}],
            "ability": "MATH", "reward_model": {"ground_truth": answer, "style": "rule-lighteval/MATH_v2"},
            "extra_info": {"index": index}}


DAPO = [dapo("Let $n = 34$. Find $n$.", "34", "9a9b6eb4"), dapo("What is 1+1?", "2", "a1"),
        dapo("Find $x$ if $2x = 6$.", "4", "b2")]   # DeepScaleR's problem with another answer: a duplicate

DEEPCODER = [   # agentica-org/DeepCoder-Preview-Dataset (primeintellect): tests as a JSON string
    {"problem": "Print the sum of two integers.",
     "tests": json.dumps([{"input": "1 2\n", "output": "3\n", "type": "stdin_stdout"}]), "metadata": "{}"},
    {"problem": "Print the product of two integers.",
     "tests": json.dumps([{"input": "2 3\n", "output": "6\n", "type": "stdin_stdout"}]), "metadata": "{}"},
]
CODE_CONTESTS = [   # deepmind/code_contests: tests as parallel lists, time limit {seconds, nanos}
    {"name": "1548_A. Sum", "description": "Print the sum of two integers.",
     "public_tests": {"input": ["1 2\n"], "output": ["3\n"]},
     "private_tests": {"input": ["5 5\n", "0 0\n"], "output": ["10\n", "0\n"]},
     "generated_tests": {"input": ["7 1\n"], "output": ["8\n"]}, "source": 2, "difficulty": 7,
     "time_limit": {"seconds": 2, "nanos": 500000000}, "memory_limit_bytes": 256000000,
     "cf_contest_id": 1548, "cf_index": "A", "cf_rating": 800, "input_file": "", "output_file": ""},
]


def codeforces(cid, **overrides):
    """open-r1/codeforces (verifiable): statement in parts, official tests, limits in s and MB."""
    row = {"id": cid, "contest_id": cid.split("/")[0], "title": "Subtract", "description": "Print a minus b.",
           "input_format": "Two integers a and b.", "output_format": "One integer.", "interaction_format": None,
           "note": "Mind negative numbers.", "examples": [{"input": "3 1\n", "output": "2\n"}],
           "time_limit": 1.0, "memory_limit": 256.0, "official_tests": [{"input": "3 1\n", "output": "2\n"},
                                                                      {"input": "1 3\n", "output": "-2\n"}],
           "official_tests_complete": True, "input_mode": "stdio", "generated_checker": None,
           "executable": True, "rating": 800, "tags": ["math"]}
    row.update(overrides)
    return row


CODEFORCES = [codeforces("1/A"), codeforces("2/A", input_mode="file"), codeforces("3/A", interaction_format="Ask."),
              codeforces("4/A", generated_checker="int main() {}"), codeforces("5/A", official_tests_complete=False)]
ARCHER2_CODE = [   # Fate-Zero/Archer2.0-Code-1.5B: verl layout, tests as JSON under reward_model.ground_truth
    {"data_source": "code", "prompt": [{"role": "user", "content": "Print the square of an integer."}], "ability": "code",
     "reward_model": {"ground_truth": json.dumps({"inputs": ["3\n"], "outputs": ["9\n"]}), "style": "rule"}},
    {"data_source": "code", "prompt": [{"role": "user", "content": "Implement twoSum."}], "ability": "code",
     "reward_model": {"ground_truth": json.dumps({"functional": "def check(c):\n    assert c([1], 1)"}), "style": "rule"}},
]

HUB = {("agentica-org/DeepScaleR-Preview-Dataset", None, "train"): DEEPSCALER,
       ("Skywork/Skywork-OR1-RL-Data", None, "math"): SKYWORK,
       ("BytedTsinghua-SIA/DAPO-Math-17k", None, "train"): DAPO,
       ("agentica-org/DeepCoder-Preview-Dataset", "primeintellect", "train"): DEEPCODER,
       ("deepmind/code_contests", None, "train"): CODE_CONTESTS,
       ("open-r1/codeforces", "verifiable", "train"): CODEFORCES,
       ("Fate-Zero/Archer2.0-Code-1.5B", None, "train"): ARCHER2_CODE,
       ("HuggingFaceH4/aime_2024", None, "train"): [{"id": 60, "problem": "AIME problem one.", "answer": "204"}]}


@pytest.fixture
def hub(monkeypatch):
    """`datasets.load_dataset` answering from the fixtures above; records what was asked."""
    import datasets

    calls = []

    def load_dataset(path, name=None, split=None, **kwargs):
        calls.append((path, name, split))
        return list(HUB[(path, name, split)])

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    return calls


SKYWORK_SOURCE = dict(path="Skywork/Skywork-OR1-RL-Data", split="math", label="skywork",
                      fields={"problem": "prompt", "answer": "reward_model.ground_truth", "id": "extra_info.index"},
                      json_fields=["reward_model.ground_truth"],
                      filters=[FieldRange("extra_info.model_difficulty.DeepSeek-R1-Distill-Qwen-1.5B", 1, 15,
                                          name="difficulty")])
DAPO_SOURCE = dict(path="BytedTsinghua-SIA/DAPO-Math-17k", label="dapo", template=DAPO_TEMPLATE,
                   fields={"problem": "prompt", "answer": "reward_model.ground_truth", "id": "extra_info.index"})


def math_rows(sources, **kwargs):
    data = RLDataModule(train_files=[Source(**s) for s in sources], **kwargs)
    return data.task.rows("train"), data.stats


def code_rows(sources, **kwargs):
    data = CodeRLDataModule(train_files=[Source(**s) for s in sources], **kwargs)
    return data.task.rows("train"), data.stats


# --- math layouts -----------------------------------------------------------------------------------

def test_deepscaler_layout(hub):
    rows, stats = math_rows([dict(path="agentica-org/DeepScaleR-Preview-Dataset", label="deepscaler")])
    assert [(r["problem"], r["answer"]) for r in rows] == [("Find $x$ if $2x = 6$.", "3"), ("What is $1+1$?", "2")]
    assert stats["data/train/deepscaler/kept"] == 2.0


def test_skywork_layout_difficulty_filter_and_bad_row(hub, caplog):
    with pytest.raises(BadRowError, match=r"source 'skywork': .*Skywork-OR1-RL-Data\[math\] row 3: .*2 different answers"):
        math_rows([SKYWORK_SOURCE])
    with caplog.at_level(logging.INFO):
        rows, stats = math_rows([SKYWORK_SOURCE], on_bad_row="skip")
    assert [(r["id"], r["problem"], r["answer"]) for r in rows] == [("0", "Compute $3 \\cdot 112$.", "336")]
    assert stats["data/train/skywork/filter/difficulty"] == 2.0 and stats["data/train/skywork/bad_rows"] == 1.0
    assert stats["data/train/skywork/rows"] == 4.0 and stats["data/train/skywork/kept"] == 1.0
    assert "filter 'difficulty' dropped 2" in caplog.text and "row 3" in caplog.text


def test_dapo_template_is_removed(hub):
    rows, _ = math_rows([DAPO_SOURCE])
    assert rows[0] == {"id": "9a9b6eb4", "problem": "Let $n = 34$. Find $n$.", "answer": "34"}
    assert not any("Answer:" in r["problem"] or "step by step" in r["problem"] for r in rows)


def test_a_row_off_the_template_is_reported(tmp_path):
    path = tmp_path / "dapo.jsonl"
    rows = [dapo("Fine.", "1", "x"), {"prompt": [{"role": "user", "content": "No instruction here."}],
                                     "reward_model": {"ground_truth": "2"}}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(BadRowError, match=r"source 'dapo': .*dapo\.jsonl:2: field 'prompt' does not match"):
        math_rows([dict(DAPO_SOURCE, path=str(path))])


def test_dedup_across_sources_keeps_the_first_and_counts_conflicts(hub):
    sources = [dict(path="agentica-org/DeepScaleR-Preview-Dataset", label="deepscaler"), SKYWORK_SOURCE, DAPO_SOURCE]
    rows, stats = math_rows(sources, on_bad_row="skip")
    # DAPO's "What is 1+1?" repeats DeepScaleR's "What is $1+1$?" only up to `$`, so both stay; its
    # "Find $x$ if $2x = 6$." is DeepScaleR's problem (with another answer): dropped, counted as a conflict
    assert [r["problem"] for r in rows] == ["Find $x$ if $2x = 6$.", "What is $1+1$?", "Compute $3 \\cdot 112$.",
                                            "Let $n = 34$. Find $n$.", "What is 1+1?"]
    assert rows[0]["answer"] == "3"
    assert stats["data/train/dapo/duplicates"] == 1.0 and stats["data/train/dapo/answer_conflicts"] == 1.0
    assert stats["data/train/deepscaler/duplicates"] == 0.0
    rows, _ = math_rows(sources, on_bad_row="skip", dedup=False)
    assert len(rows) == 6


def test_training_golds_are_normalized_as_evaluation_reads_them(tmp_path):
    """A Python e-notation gold (``1e-3``: math-verify reads ``e`` as Euler's number) is rewritten for
    training as it is for evaluation, and counted; a code row's test spec is left alone."""
    path = tmp_path / "golds.jsonl"
    golds = {"a": "1e-3", "b": "3.83e35", "c": "42"}
    path.write_text("".join(json.dumps({"id": k, "problem": f"Problem {k}.", "answer": v}) + "\n"
                            for k, v in golds.items()))
    rows, stats = math_rows([dict(path=str(path), label="golds")])
    assert [r["answer"] for r in rows] == ["10^{-3}", "3.83 \\times 10^{35}", "42"]
    assert stats["data/train/golds_rewritten"] == 2.0
    spec = json.dumps({"tests": [{"input": "", "output": "print(math.sqrt(2))", "type": "stdin"}]})
    assert CodeRLDataModule().task.normalize_answers([{"answer": spec}], "train") == ([{"answer": spec}], {})


def test_normalized_problem():
    assert normalized_problem("  Ｆind\u00a0 X\n\tnow ") == "find x now"
    assert normalized_problem("x = 1") != normalized_problem("x=1")


# --- code layouts -----------------------------------------------------------------------------------

def test_deepcoder_layout(hub):
    rows, _ = code_rows([dict(path="agentica-org/DeepCoder-Preview-Dataset", name="primeintellect", label="dc")])
    spec = parse_gold(rows[0]["answer"])
    assert rows[0]["problem"] == "Print the sum of two integers." and spec.tests == (("1 2\n", "3\n"),) and spec.kind == "stdin"


def test_code_contests_layout(hub):
    rows, _ = code_rows([dict(path="deepmind/code_contests", label="cc", layout="code_contests")])
    spec = parse_gold(rows[0]["answer"])
    assert rows[0]["id"] == "1548_A. Sum" and rows[0]["problem"] == "Print the sum of two integers."
    assert spec.tests == (("1 2\n", "3\n"), ("5 5\n", "10\n"), ("0 0\n", "0\n"))   # public + private, not generated
    assert spec.time_limit_s == 2.5 and spec.memory_limit_bytes == 256000000
    rows, _ = code_rows([dict(path="deepmind/code_contests", label="cc", layout="code_contests",
                              fields={"tests": "public_tests+generated_tests"})])
    assert parse_gold(rows[0]["answer"]).tests == (("1 2\n", "3\n"), ("7 1\n", "8\n"))


def test_codeforces_layout_and_gradability_filters(hub):
    filters = [FieldIn("input_mode", ["stdio"]), FieldIn("interaction_format", [None, ""], name="not_interactive"),
               FieldIn("generated_checker", [None], name="no_checker"), FieldIn("official_tests_complete", [True])]
    rows, stats = code_rows([dict(path="open-r1/codeforces", name="verifiable", label="cf", layout="codeforces",
                                  filters=filters)])
    assert [r["id"] for r in rows] == ["1/A"]
    statement = rows[0]["problem"]
    assert statement.startswith("Print a minus b.\n\n## Input Format\nTwo integers a and b.\n\n## Output Format")
    assert "```input\n3 1\n```\n```output\n2\n```" in statement and statement.endswith("## Note\nMind negative numbers.")
    spec = parse_gold(rows[0]["answer"])
    assert spec.tests == (("3 1\n", "2\n"), ("1 3\n", "-2\n")) and spec.time_limit_s == 1.0
    assert spec.memory_limit_bytes == 256 * 2**20
    assert [stats[f"data/train/cf/filter/{n}"] for n in ("input_mode", "not_interactive", "no_checker",
                                                           "official_tests_complete")] == [1.0, 1.0, 1.0, 1.0]


def test_archer2_code_layout_and_assert_tests_reported(hub):
    source = dict(path="Fate-Zero/Archer2.0-Code-1.5B", label="archer2_code",
                  fields={"problem": "prompt", "tests": "reward_model.ground_truth"},
                  json_fields=["reward_model.ground_truth"])
    with pytest.raises(BadRowError, match=r"source 'archer2_code': .*row 1: assert-style tests"):
        code_rows([source])
    rows, stats = code_rows([source], on_bad_row="skip")
    assert rows[0]["problem"] == "Print the square of an integer."
    assert parse_gold(rows[0]["answer"]).tests == (("3\n", "9\n"),) and stats["data/train/archer2_code/bad_rows"] == 1.0


def test_code_dedup_gives_codeforces_priority(hub):
    dc = dict(path="agentica-org/DeepCoder-Preview-Dataset", name="primeintellect", label="dc")
    cc = dict(path="deepmind/code_contests", label="cc", layout="code_contests")
    rows, stats = code_rows([cc, dc])
    assert [r["id"] for r in rows][0] == "1548_A. Sum" and len(rows) == 2   # DeepCoder's copy of the sum problem dropped
    assert stats["data/train/dc/duplicates"] == 1.0


# --- held-out data: the hub by default, the staged copy when $ASPO_DATA_DIR has it --------------

def test_val_from_hub_or_staged(hub, tmp_path, monkeypatch):
    source = Source(path="HuggingFaceH4/aime_2024", label="aime24", staged="aime24.jsonl")
    monkeypatch.delenv("ASPO_DATA_DIR", raising=False)
    data = RLDataModule(val_files=[source])
    assert data.task.rows("val") == [{"id": "60", "problem": "AIME problem one.", "answer": "204"}]
    assert hub == [("HuggingFaceH4/aime_2024", None, "train")]
    (tmp_path / "aime24.jsonl").write_text(json.dumps({"id": "aime24-I-1", "problem": "Staged.", "answer": "25"}) + "\n")
    monkeypatch.setenv("ASPO_DATA_DIR", str(tmp_path))
    assert data.task.rows("val")[0]["id"] == "aime24-I-1" and len(hub) == 1


def _lcb_row(qid, date, private):
    encoded = base64.b64encode(zlib.compress(pickle.dumps(json.dumps(private)))).decode()
    return {"question_title": qid, "question_content": f"Problem {qid}.", "platform": "atcoder", "question_id": qid,
            "contest_id": "abc1", "contest_date": date, "starter_code": "", "difficulty": "easy",
            "public_test_cases": json.dumps([{"input": "1\n", "output": "1\n", "testtype": "stdin"}]),
            "private_test_cases": encoded, "metadata": "{}"}


def test_livecodebench_release_files_from_the_hub(tmp_path, monkeypatch):
    """LiveCodeBench's hub release needs a loading script: its JSONL files are read directly, the
    v5 window applied to contest_date, the private tests decoded."""
    import huggingface_hub

    files = {"test.jsonl": [_lcb_row("a", "2024-07-31T00:00:00", []), _lcb_row("b", "2024-08-01T00:00:00", [])],
             "test5.jsonl": [_lcb_row("c", "2025-01-31T12:00:00", [{"input": "2\n", "output": "2\n", "testtype": "stdin"}]),
                             _lcb_row("d", "2025-02-01T00:00:00", [])]}
    asked = []

    def download(repo_id, filename, repo_type=None, **kwargs):
        asked.append((repo_id, filename, repo_type))
        path = tmp_path / filename
        path.write_text("".join(json.dumps(r) + "\n" for r in files[filename]))
        return str(path)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    monkeypatch.delenv("ASPO_DATA_DIR", raising=False)
    source = Source(path="livecodebench/code_generation_lite", label="lcb_v5", data_files=list(files),
                    staged="code/lcb_v5.jsonl", filters=[FieldRange("contest_date", "2024-08-01", "2025-02-01", name="v5")])
    data = CodeRLDataModule(val_files=[source])
    rows = data.task.rows("val")
    assert [r["id"] for r in rows] == ["b", "c"] and data.stats["data/val/lcb_v5/filter/v5"] == 2.0
    assert parse_gold(rows[1]["answer"]).tests == (("1\n", "1\n"), ("2\n", "2\n"))   # public + decoded private
    assert asked == [("livecodebench/code_generation_lite", f, "dataset") for f in files]


# --- config-level checks ------------------------------------------------------------------------------

def test_source_config_errors():
    with pytest.raises(ValueError, match="exactly once"):
        Source(path="x/y", template="no placeholder")
    with pytest.raises(ValueError, match="distinct labels"):
        load_mixture([Source(path="a/x"), Source(path="b/x")], lambda *a: {})
    with pytest.raises(ValueError, match="RowFilter"):
        Source(path="x/y", filters=[{"field": "a"}])
    with pytest.raises(ValueError, match="distinct names"):
        Source(path="x/y", filters=[FieldIn("a", [1]), FieldIn("a", [2])])
    with pytest.raises(ValueError, match="both be numbers or both strings"):
        FieldRange("d", min=1, max="2025")
    with pytest.raises(ValueError, match="layout 'codeforces' is for code rows"):
        RLDataModule(train_files=[Source(path="x/y", layout="codeforces")]).task.rows("train")


def test_filter_from_its_config_form():
    """A source rebuilt from saved hyperparameters (filters as ``{class_path, init_args}``)."""
    source = Source(path="x/y", filters=[{"class_path": "aspo_lit.data.filters.FieldRange",
                                          "init_args": {"field": "a.b", "min": 1, "max": 15, "name": "d"}}])
    keep = source.filters[0].keep
    assert keep({"a": {"b": 3}}) and not keep({"a": {"b": 16}}) and not keep({"a": {}}) and not keep({"a": {"b": "3"}})


# --- the staged copies: measured counts ----------------------------------------------------------

def test_staged_math_training_sets_counts(shared_data_dir):
    """DSR-sub (1,209 of DeepScaleR's 40.3k) and DAPO-Math-17k (one row per original index) as a
    mixture: rows in, bad rows, duplicates (within and across), kept."""
    train = shared_data_dir / "train"
    sources = [dict(path=str(train / "deepscaler_dsr_sub.jsonl"), label="deepscaler_dsr_sub"),
               dict(path=str(train / "dapo_math_17k.jsonl"), label="dapo_math_17k")]
    rows, stats = math_rows(sources, on_bad_row="skip")
    got = {k.split("/", 2)[-1]: v for k, v in stats.items()}
    assert got == {"deepscaler_dsr_sub/rows": 1209, "deepscaler_dsr_sub/bad_rows": 1, "deepscaler_dsr_sub/duplicates": 2,
                   "deepscaler_dsr_sub/answer_conflicts": 0, "deepscaler_dsr_sub/kept": 1206,
                   "dapo_math_17k/rows": 17917, "dapo_math_17k/bad_rows": 0, "dapo_math_17k/duplicates": 811,
                   "dapo_math_17k/answer_conflicts": 13, "dapo_math_17k/kept": 17106,
                   "golds_rewritten": 0}   # no Python-notation gold in these two
    assert len(rows) == 1206 + 17106 and len({normalized_problem(r["problem"]) for r in rows}) == len(rows)


def test_staged_code_training_sets_counts(shared_data_dir):
    train = shared_data_dir / "code" / "train"
    if not train.is_dir():
        pytest.skip(f"{train} not staged")
    rows, stats = code_rows([dict(path=str(train / "codecontests_test165.jsonl"), label="codecontests_test165"),
                             dict(path=str(train / "deepcoder_lcb.jsonl"), label="deepcoder_lcb")])
    got = {k.split("/", 2)[-1]: v for k, v in stats.items() if not k.endswith("answer_conflicts")}
    assert got == {"codecontests_test165/rows": 165, "codecontests_test165/bad_rows": 0,
                   "codecontests_test165/duplicates": 0, "codecontests_test165/kept": 165,
                   "deepcoder_lcb/rows": 580, "deepcoder_lcb/bad_rows": 0, "deepcoder_lcb/duplicates": 0,
                   "deepcoder_lcb/kept": 580}
    assert len(rows) == 745


def test_reward_is_a_typed_class_path():
    """``data.init_args.reward`` takes a ``class_path`` (a `RewardFn`), instantiated by jsonargparse;
    a class that is not a reward is refused when the config is parsed."""
    from jsonargparse import ArgumentParser

    from aspo_lit.rewards import MathVerifyReward

    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(RLDataModule, "data")
    cfg = parser.parse_object({"data": {"reward": {"class_path": "aspo_lit.rewards.MathVerifyReward",
                                                   "init_args": {"timeout_s": 3.0}}}})
    data = parser.instantiate_classes(cfg).data
    assert isinstance(data.task.reward, MathVerifyReward) and data.task.reward.timeout_s == 3.0
    with pytest.raises(Exception, match="reward"):
        parser.parse_object({"data": {"reward": {"class_path": "aspo_lit.data.filters.FieldIn",
                                                 "init_args": {"field": "a", "values": [1]}}}})


def test_counts_reach_the_run_loggers_on_a_fresh_run(hub):
    """The per-source counts go to ``stats`` and, at step 0 of a fresh run, to every logger (not again
    on a resume, which would log them at a step the uninterrupted run does not have)."""
    from types import SimpleNamespace

    class Logger:
        def __init__(self):
            self.logged = []

        def log_metrics(self, metrics, step):
            self.logged.append((step, dict(metrics)))

    for global_step, expect in ((0, True), (7, False)):
        logger = Logger()
        data = RLDataModule(train_files=[Source(**SKYWORK_SOURCE)], on_bad_row="skip")
        data.trainer = SimpleNamespace(global_step=global_step, is_global_zero=True, loggers=[logger])
        data.task.rows("train")
        assert data.stats["data/train/skywork/filter/difficulty"] == 2.0
        assert bool(logger.logged) == expect
        if expect:
            assert logger.logged[0][0] == 0 and logger.logged[0][1]["data/train/skywork/kept"] == 1.0
