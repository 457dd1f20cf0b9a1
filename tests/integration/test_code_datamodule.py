"""CodeRLDataModule: code rows in every supported layout, LiveCodeBench prompts, and one training
run whose rewards come from the sandbox."""

from __future__ import annotations

import base64
import json
import pickle
import shutil
import zlib

import pytest

from aspo_lit.data.code_rows import load_code_rows, normalize_code_row
from aspo_lit.data.sources import BadRowError
from aspo_lit.prompts import LCB_FORMAT_WITHOUT_STARTER_CODE, build_code_prompt, lcb_user_message
from aspo_lit.rewards.code import parse_gold
from data_modules.code import CodeRLDataModule

STDIN_ROW = {"id": "p1", "problem": "Print the sum of two integers.", "starter_code": "",
             "tests": [{"input": "1 2\n", "output": "3\n", "type": "stdin"}], "fn_name": None}
FUNC_ROW = {"id": "p2", "problem": "Return the sum of a list.",
            "starter_code": "class Solution:\n    def total(self, nums: List[int]) -> int:\n        ",
            "tests": [{"input": "[1, 2, 3]", "output": "6", "type": "functional"}], "fn_name": "total"}


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_loads_staged_code_sets(shared_data_dir):
    folder = shared_data_dir / "code"
    if not folder.is_dir():
        pytest.skip(f"{folder} not staged")
    expected = {"lcb_v5.jsonl": (279, 104), "lcb_v6.jsonl": (131, 49), "train/deepcoder_lcb.jsonl": (580, 277),
                "train/codecontests_test165.jsonl": (165, 0)}
    for name, (n, functional) in expected.items():
        rows, report = load_code_rows(str(folder / name))
        assert len(rows) == report.kept == n and sum(bool(r["fn_name"]) for r in rows) == functional
    cc = load_code_rows(str(folder / "train/codecontests_test165.jsonl"))[0]
    spec = parse_gold(cc[0]["answer"])
    assert spec.time_limit_s and spec.memory_limit_bytes      # CodeContests carries its own limits


@pytest.mark.parametrize("bad, complaint", [
    ({"problem": "x"}, "no tests"),
    ({"problem": "", "tests": STDIN_ROW["tests"]}, "'problem' is missing"),
    ({"problem": "x", "tests": [{"input": 1, "output": "2"}]}, "test 0 needs string"),
    ({"problem": "x", "tests": [{"input": "1", "output": "2", "type": "functional"}]}, "no fn_name"),
    ({"problem": "x", "tests": "{broken"}, "neither JSON"),
])
def test_bad_code_row_names_file_and_line(tmp_path, bad, complaint):
    path = write_jsonl(tmp_path / "c.jsonl", [STDIN_ROW, bad])
    with pytest.raises(BadRowError, match=rf"c\.jsonl:2: .*{complaint}"):
        load_code_rows(path)
    rows, report = load_code_rows(path, on_bad_row="skip")
    assert len(rows) == 1 and len(report.skipped) == 1 and "c.jsonl:2" in report.skipped[0]


def test_livecodebench_hub_layout_with_encoded_private_tests():
    private = [{"input": "[4]", "output": "4", "testtype": "functional"}]
    encoded = base64.b64encode(zlib.compress(pickle.dumps(json.dumps(private)))).decode()
    raw = {"question_id": "3000", "question_content": "Sum.", "starter_code": FUNC_ROW["starter_code"],
           "public_test_cases": json.dumps([{"input": "[1, 2]", "output": "3", "testtype": "functional"}]),
           "private_test_cases": encoded, "metadata": json.dumps({"func_name": "total"})}
    row = normalize_code_row(raw, "hub row 0")
    spec = parse_gold(row["answer"])
    assert row["id"] == "3000" and spec.fn_name == "total" and spec.tests == (("[1, 2]", "3"), ("[4]", "4"))

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    raw["private_test_cases"] = base64.b64encode(zlib.compress(pickle.dumps(Evil()))).decode()
    with pytest.raises(BadRowError, match="hub row 0: tests are neither JSON nor LiveCodeBench-encoded"):
        normalize_code_row(raw, "hub row 0")


def test_deepcoder_layouts():
    listed = {"problem": "Sum.", "tests": json.dumps([{"input": "[1, 2]", "output": "3", "testtype": "functional",
                                                       "metadata": {"func_name": "total"}}])}
    assert parse_gold(normalize_code_row(listed, "r")["answer"]).fn_name == "total"
    taco = {"problem": "Echo.", "tests": json.dumps({"inputs": ["1\n"], "outputs": ["1\n"]})}
    assert parse_gold(normalize_code_row(taco, "r")["answer"]).tests == (("1\n", "1\n"),)
    call = {"problem": "Add.", "tests": json.dumps({"inputs": [[1, 2]], "outputs": [[3]], "fn_name": "add"})}
    spec = parse_gold(normalize_code_row(call, "r")["answer"])
    assert spec.fn_name == "add" and spec.tests == (("1\n2", "3"),)


def test_hub_id_goes_through_datasets(monkeypatch):
    import datasets

    calls = []

    def fake_load_dataset(path, name=None, split=None, **kwargs):
        calls.append((path, name, split))
        return [STDIN_ROW]

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    rows, _ = load_code_rows("agentica-org/DeepCoder-Preview-Dataset:lcbv5")   # the default train_files
    assert calls == [("agentica-org/DeepCoder-Preview-Dataset", "lcbv5", "train")] and rows[0]["id"] == "p1"
    assert CodeRLDataModule().hparams.train_files == "agentica-org/DeepCoder-Preview-Dataset:lcbv5"


def test_sources_expand_environment_variables(monkeypatch, tmp_path):
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "p.jsonl").write_text(json.dumps(STDIN_ROW) + "\n")
    monkeypatch.setenv("ASPO_DATA_DIR", str(tmp_path))
    assert load_code_rows("$ASPO_DATA_DIR/code/p.jsonl")[0][0]["id"] == "p1"
    monkeypatch.delenv("ASPO_DATA_DIR")
    with pytest.raises(FileNotFoundError, match=r"\$ASPO_DATA_DIR is not set"):
        load_code_rows("$ASPO_DATA_DIR/code/p.jsonl")


def test_lcb_prompts():
    stdin = lcb_user_message(STDIN_ROW["problem"], "")
    assert stdin.startswith("### Question:\nPrint the sum") and LCB_FORMAT_WITHOUT_STARTER_CODE in stdin
    assert "```python\n# YOUR CODE HERE\n```" in stdin and stdin.rstrip().endswith("(use the provided format with backticks)")
    func = lcb_user_message(FUNC_ROW["problem"], FUNC_ROW["starter_code"])
    assert "### Format: You will use the following starter code" in func and "def total(self" in func
    assert "YOUR CODE HERE" not in func
    assert build_code_prompt("p", None, None, "plain", system_prompt="SYS").startswith("SYS\n\n### Question:")


def test_invalid_settings_name_the_key():
    with pytest.raises(ValueError, match="data.sandbox"):
        CodeRLDataModule(sandbox="none")
    with pytest.raises(ValueError, match="data.group_size"):
        CodeRLDataModule(group_size=1)


# --------------------------------------------------------------------------- training through the sandbox

CANNED = {
    "p1": ["```python\na, b = map(int, input().split())\nprint(a + b)\n```", "```python\nprint(0)\n```"],
    "p2": ["```python\nclass Solution:\n    def total(self, nums):\n        return sum(nums)\n```",
           "```python\nwhile True:\n    pass\n```"],
}


def _canned_engine():
    from aspo_lit.rollout.hf import HFEngine

    class CannedEngine(HFEngine):
        """Samples tokens with the policy, but answers with fixed programs (right and wrong)."""

        def __init__(self):
            super().__init__()
            self.prompts_seen = []

        def generate(self, prompts, n=1, sampling=None):
            groups = super().generate(prompts, n, sampling)
            for prompt, group in zip(prompts, groups):
                text = self.tokenizer.decode(prompt)
                self.prompts_seen.append(text)
                key = "p2" if "sum of a list" in text else "p1"
                for i, c in enumerate(group):
                    c.text = CANNED[key][i % 2]
            return groups

    return CannedEngine()


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed (make setup)")
def test_training_step_graded_by_the_sandbox(tiny_model_dir, tmp_path):
    from lightning.pytorch import Callback, Trainer

    from aspo_lit.training.module import ASPOModule

    class Record(Callback):
        def __init__(self):
            self.rewards = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.rewards.append(outputs["rewards"].tolist())

    engine = _canned_engine()
    path = write_jsonl(tmp_path / "code.jsonl", [STDIN_ROW, FUNC_ROW])
    data = CodeRLDataModule(train_files=path, batch_size=2, group_size=2, max_response_length=4,
                            max_prompt_length=1024, prompt_template="plain", engine=engine,
                            reward_timeout_s=1.0, reward_workers=2)
    module = ASPOModule(model_name_or_path=str(tiny_model_dir), loss="aspo", lr=1e-3, warmup_steps=0,
                        mini_batch_size=2, micro_batch_size=4)
    record = Record()
    trainer = Trainer(accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                      callbacks=[record])
    trainer.fit(module, datamodule=data)
    assert record.rewards and all(sorted(r) == [0.0, 0.0, 1.0, 1.0] for r in record.rewards)
    assert any("question:" in p and "class solution" in p for p in engine.prompts_seen)   # char tokenizer: lower case
    assert data.task.reward._pool is None   # closed at teardown
