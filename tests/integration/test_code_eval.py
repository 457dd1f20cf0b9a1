"""Code benchmarks in the evaluator (LiveCodeBench v5/v6, Table 2) and the Table 2 renderer."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import pytest

from aspo_lit.eval.datasets import BENCHMARKS, TABLE2_BENCHMARKS, load_benchmark
from aspo_lit.eval.evaluate import evaluate_model
from aspo_lit.eval.tables import LCB_PUBLIC_TESTS_NOTE, lcb_tests_note, load_paper_table, render_table2
from tests.helpers.tolerance import approx64

REPO = Path(__file__).resolve().parents[2]
needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed (make setup)")


class Completion:
    def __init__(self, text, n_tokens):
        self.text, self.token_ids, self.finish_reason, self.logprobs = text, [1] * n_tokens, "stop", None


class CodeEngine:
    """Answers sample j of every problem with a right program when j % 2 == 0, else a wrong one."""

    def __init__(self, programs):
        self.programs, self.prompts = programs, []

    def attach(self, model, tokenizer, model_path):
        self.tokenizer = tokenizer

    def generate(self, prompts, n=1, sampling=None):
        out = []
        for ids in prompts:
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            self.prompts.append(text)
            key = next(k for k in self.programs if k in text)
            right, wrong = self.programs[key]
            out.append([Completion(f"```python\n{right if j % 2 == 0 else wrong}\n```", 5) for j in range(n)])
        return out

    def close(self):
        pass


def test_code_benchmarks_registered():
    assert TABLE2_BENCHMARKS == ("lcb_v5", "lcb_v6")
    assert (BENCHMARKS["lcb_v5"].k, BENCHMARKS["lcb_v6"].k) == (8, 16)          # paper, Appendix B
    assert all(BENCHMARKS[n].domain == "code" for n in TABLE2_BENCHMARKS)
    with pytest.raises(FileNotFoundError, match="--data_paths"):   # a code benchmark with no hub release
        load_benchmark({"name": "mycode", "k": 2, "domain": "code"}, data_dir="/nonexistent")


def test_load_staged_lcb(shared_data_dir):
    if not (shared_data_dir / "code" / "lcb_v5.jsonl").is_file():
        pytest.skip("LiveCodeBench files not staged")
    v5, v6 = load_benchmark("lcb_v5", data_dir=shared_data_dir), load_benchmark("lcb_v6", data_dir=shared_data_dir)
    assert (len(v5), len(v6)) == (279, 131)
    assert sum(bool(r["starter_code"]) for r in v5) == 104
    assert load_benchmark("lcb_v5", path=shared_data_dir / "code")[0]["id"] == v5[0]["id"]


@needs_bwrap
def test_evaluate_code_benchmark(tmp_path, tiny_model_dir):
    rows = [
        {"id": "add", "problem": "Print the sum of two integers.", "starter_code": "",
         "tests": [{"input": "1 2\n", "output": "3\n", "type": "stdin"}], "fn_name": None},
        {"id": "rev", "problem": "Reverse a list.",
         "starter_code": "class Solution:\n    def rev(self, a: List[int]) -> List[int]:\n        ",
         "tests": [{"input": "[1, 2, 3]", "output": "[3, 2, 1]", "type": "functional"}], "fn_name": "rev"},
    ]
    path = tmp_path / "code.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    engine = CodeEngine({
        "sum of two": ("a, b = map(int, input().split())\nprint(a + b)", "print(0)"),
        "reverse a list": ("class Solution:\n    def rev(self, a):\n        return a[::-1]",
                           "class Solution:\n    def rev(self, a):\n        return a"),
    })
    bench = {"name": "tinycode", "path": str(path), "k": 4, "domain": "code"}
    results = evaluate_model(str(tiny_model_dir), [bench], tmp_path / "out", engine=engine,
                             template="plain", max_tokens=8,
                             code_reward={"timeout_s": 2.0, "num_workers": 2})
    r = results["tinycode"]
    assert (r["avg@k"], r["pass@k"], r["k"]) == (50.0, 100.0, 4)
    assert any("class solution:" in p and "question:" in p for p in engine.prompts)   # starter code shown
    records = [json.loads(x) for x in next((tmp_path / "out").glob("*/tinycode.samples.jsonl")).read_text().splitlines()]
    assert {rec["status"] for rec in records} == {"passed", "wrong_answer"}
    assert all(rec["answer_extracted"].startswith("code:") for rec in records)
    meta = json.loads(next((tmp_path / "out").glob("*/tinycode.meta.json")).read_text())
    assert meta["prompt_format"] == "livecodebench-generic"


def test_render_table2_beside_the_paper(tmp_path):
    columns, paper = load_paper_table(REPO / "aspo_lit" / "eval" / "data" / "table2.csv")
    assert columns == ["lcb_v5_avg@8", "lcb_v5_pass@8", "lcb_v6_avg@16", "lcb_v6_pass@16", "avg"]
    assert paper[("DeepSeek-R1-Distill-Qwen-1.5B", "ASPO")]["avg"] == 31.0
    ours = {("Qwen3-4B", "base"): {"lcb_v5_avg@8": 20.0, "lcb_v5_pass@8": 30.0, "lcb_v6_avg@16": 22.0,
                                   "lcb_v6_pass@16": 33.0}}
    markdown, rows = render_table2(ours, missing={("Qwen3-4B", "ASPO"): "no checkpoint"}, out_dir=tmp_path)
    row = next(r for r in rows if (r["base_model"], r["method"]) == ("Qwen3-4B", "base"))
    assert row["cells"]["avg"]["ours"] == 21.0                        # mean of the avg@K: (20 + 22) / 2, exact
    # one float64 subtraction of the paper's decimal: the same double (approx64 in case it is formed otherwise)
    assert row["cells"]["lcb_v5_avg@8"]["delta"] == approx64(20.0 - 23.8, scale=23.8)
    assert "| Qwen3-4B | base | 20.0 / 23.8 / -3.8 |" in markdown
    assert "Qwen3-4B / ASPO: missing — no checkpoint" in markdown
    assert markdown.count("upper bound") == 0                  # the note says what was graded: given here
    markdown, _ = render_table2(ours, note=lcb_tests_note({"lcb_v5": {("public_only", 6.0)}}))
    assert LCB_PUBLIC_TESTS_NOTE in markdown and "lcb_v5: " in markdown
    with open(tmp_path / "table2.csv") as f:
        status = {(r["base_model"], r["method"]): r["status"] for r in csv.DictReader(f)}
    assert status[("Qwen3-4B", "base")] == "ok" and status[("DeepSeek-R1-Distill-Qwen-1.5B", "GRPO")] == "missing"


def test_table2_configs_parse():
    import yaml

    for name in ("conf/table2.yaml", "conf/tiny/table2.yaml"):
        config = yaml.safe_load((REPO / name).read_text())
        assert config["table"] == "table2" and config["rows"]
        names = [b if isinstance(b, str) else b["name"] for b in config["benchmarks"]]
        assert {"lcb_v5", "lcb_v6"} <= set(names)
    full = yaml.safe_load((REPO / "conf/table2.yaml").read_text())
    _, paper = load_paper_table(REPO / "aspo_lit" / "eval" / "data" / "table2.csv")
    assert {(r["base_model"], r["method"]) for r in full["rows"]} == set(paper)


@pytest.mark.slow
@needs_bwrap
def test_tiny_profile_table2(tmp_path, shared_data_dir):
    """conf/tiny/table2.yaml end to end on the code testbed (shipped): the base row always, the
    GRPO/ASPO rows when the tiny code runs exist, else reported missing."""
    import yaml

    from aspo_lit.eval.table_commands import evaluate_table

    if not (shared_data_dir / "code" / "lcb_v5.jsonl").is_file():
        pytest.skip("LiveCodeBench files not staged")
    config = yaml.safe_load((REPO / "conf" / "tiny" / "table2.yaml").read_text())
    config["benchmarks"][0]["generate"]["n"] = 16
    _, rows = evaluate_table({**config, "out_dir": str(tmp_path), "data_dir": str(shared_data_dir)}, root=REPO,
                             table="table2")
    by_method = {r["method"]: r for r in rows}
    base = by_method["base"]
    assert base["status"] == "ok", base["reason"]
    assert base["cells"]["tiny_code_heldout_avg@4"]["ours"] > 0          # the testbed writes working code
    assert base["cells"]["lcb_v5_avg@2"]["ours"] is not None and base["cells"]["lcb_v6_pass@2"]["ours"] is not None
    for method in ("GRPO", "ASPO"):
        assert by_method[method]["status"] == "ok" or "conf/tiny/" in by_method[method]["reason"]
    markdown = (tmp_path / "table2.md").read_text()
    assert "upper bound" in markdown and (tmp_path / "table2.csv").is_file()


# --- LiveCodeBench from its hub release files (no loading script) -------------------------------

def _lcb_row(qid, date, public, private, func_name=None, content=None):
    """A row in LiveCodeBench's release layout: tests as JSON strings, the private ones encoded
    as LiveCodeBench does (base64(zlib(pickle(JSON string))))."""
    import base64
    import pickle
    import zlib

    kind = "functional" if func_name else "stdin"
    tests = lambda pairs: json.dumps([{"input": i, "output": o, "testtype": kind} for i, o in pairs])
    return {"question_title": qid, "question_content": content or f"problem {qid}: print the sum of two integers.",
            "platform": "leetcode" if func_name else "atcoder", "question_id": qid, "contest_id": qid[:6],
            "contest_date": date, "difficulty": "easy",
            "starter_code": f"class Solution:\n    def {func_name}(self, a):\n        " if func_name else "",
            "public_test_cases": tests(public),
            "private_test_cases": base64.b64encode(zlib.compress(pickle.dumps(tests(private)))).decode(),
            "metadata": json.dumps({"func_name": func_name} if func_name else {})}


SUM = [("1 2\n", "3\n")], [("5 7\n", "12\n"), ("10 20\n", "30\n")]   # public, private tests
LCB_FILES = {   # file -> rows (question_id, contest_date); release_v5 = test..test5, release_v6 adds test6
    "test.jsonl": [("old001", "2023-05-01T00:00:00")],
    "test2.jsonl": [], "test3.jsonl": [],
    "test4.jsonl": [("abc365_a", "2024-08-03T00:00:00"), ("early1", "2024-07-31T23:59:59")],
    "test5.jsonl": [("edge01", "2024-08-01T00:00:00"), ("lcfun1", "2024-09-10T19:30:00"),
                    ("late01", "2025-01-04T18:30:00")],
    "test6.jsonl": [("jan001", "2025-01-10T00:00:00"), ("feb001", "2025-02-01T00:00:00"),
                    ("apr001", "2025-04-06T00:00:00"), ("may001", "2025-05-01T00:00:00")],
}


@pytest.fixture
def lcb_hub(tmp_path, monkeypatch):
    """LiveCodeBench's release files in the HF hub cache layout, the hub offline: what
    `hf_hub_download` finds on a node whose cache is warm (and nothing else)."""
    from huggingface_hub import constants

    repo = tmp_path / "hub" / "datasets--livecodebench--code_generation_lite"
    snapshot = repo / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    for name, rows in LCB_FILES.items():
        lines = [_lcb_row(q, d, [("[1, 2]", "[2, 1]")], [("[3, 4, 5]", "[5, 4, 3]")], func_name="rev",
                          content=f"problem {q}: reverse a list.")
                 if q.startswith("lcfun") else _lcb_row(q, d, *SUM) for q, d in rows]
        (snapshot / name).write_text("".join(json.dumps(r) + "\n" for r in lines))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    return snapshot


def test_lcb_loads_from_the_hub_release_files(lcb_hub, tmp_path):
    from aspo_lit.rewards.livecodebench import parse_gold

    v5 = load_benchmark("lcb_v5", data_dir=tmp_path / "nothing-here")
    # release_v5 = test..test5; [2024-08-01, 2025-02-01): jan001 is in the window but only in test6
    assert [r["id"] for r in v5] == ["lcb-abc365_a", "lcb-edge01", "lcb-lcfun1", "lcb-late01"]
    v6 = load_benchmark("lcb_v6", data_dir=tmp_path / "nothing-here")
    assert [r["id"] for r in v6] == ["lcb-feb001", "lcb-apr001"]     # [2025-02-01, 2025-05-01)
    assert {r["tests_scope"] for r in v5 + v6} == {"public+private"}
    stdin = parse_gold(v5[0]["answer"])        # public then the decoded private tests, LCB's order
    assert stdin.fn_name is None and stdin.tests == (("1 2\n", "3\n"), ("5 7\n", "12\n"), ("10 20\n", "30\n"))
    functional = parse_gold(v5[2]["answer"])
    assert functional.fn_name == "rev" and functional.tests == (("[1, 2]", "[2, 1]"), ("[3, 4, 5]", "[5, 4, 3]"))
    assert "def rev" in v5[2]["starter_code"]


def test_lcb_hub_bad_row_names_file_and_line(lcb_hub, tmp_path):
    from aspo_lit.data.sources import BadRowError

    rows = (lcb_hub / "test5.jsonl").read_text().splitlines()
    broken = json.loads(rows[1])
    broken["private_test_cases"] = "not base64 of anything"
    (lcb_hub / "test5.jsonl").write_text("\n".join([rows[0], json.dumps(broken), rows[2]]) + "\n")
    with pytest.raises(BadRowError, match=r"code_generation_lite/test5\.jsonl:2: tests are neither JSON"):
        load_benchmark("lcb_v5", data_dir=tmp_path / "nothing-here")
    (lcb_hub / "test4.jsonl").write_text(json.dumps({"question_id": "x"}) + "\n")
    with pytest.raises(BadRowError, match=r"test4\.jsonl:1: not a LiveCodeBench row with a contest_date"):
        load_benchmark("lcb_v5", data_dir=tmp_path / "nothing-here")
    (lcb_hub / "test3.jsonl").unlink()     # offline, not in the cache: the error names the file
    with pytest.raises(FileNotFoundError, match=r"code_generation_lite: test3\.jsonl of source 'release_v5' is neither"):
        load_benchmark("lcb_v5", data_dir=tmp_path / "nothing-here")


@needs_bwrap
def test_table2_from_the_hub_grades_private_tests(lcb_hub, tmp_path, tiny_model_dir):
    """A program right on the public test and wrong on the private ones fails; the table's note
    says what was graded (every test, the per-test limit) instead of the public-tests caveat."""
    from aspo_lit.eval.table_commands import evaluate_table

    engine = CodeEngine({"print the sum": ("a, b = map(int, input().split())\nprint(a + b)", "print(3)"),
                         "reverse a list": ("class Solution:\n    def rev(self, a):\n        return a[::-1]",
                                            "class Solution:\n    def rev(self, a):\n        return [2, 1]")})
    config = {"table": "table2", "out_dir": str(tmp_path / "t2"), "engine": engine, "template": "plain",
              "data_dir": str(tmp_path / "nothing-here"), "sampling": {"max_tokens": 8},
              "code_reward": {"timeout_s": 2.0, "num_workers": 2},
              "benchmarks": [{"name": "lcb_v5", "k": 2}, {"name": "lcb_v6", "k": 2}],
              "rows": [{"base_model": "tiny", "method": "base", "model": str(tiny_model_dir)}]}
    markdown, rows = evaluate_table(config, compare_paper=False, table="table2")
    row = rows[0]
    assert row["status"] == "ok", row["reason"]
    # sample 0 right, sample 1 right on the public test only: 50%, not the 100% public tests give
    assert row["cells"]["lcb_v5_avg@2"]["ours"] == row["cells"]["lcb_v6_avg@2"]["ours"] == 50.0
    assert "lcb_v5, lcb_v6: graded on every test of each problem, public and private" in markdown
    assert "2 s per test; the authors allowed 150 s" in markdown and "upper bound" not in markdown
    meta = json.loads(next((tmp_path / "t2" / "models").glob("*/lcb_v5.meta.json")).read_text())
    assert meta["tests_scope"] == "public+private" and meta["code_grader"]["timeout_s"] == 2.0
