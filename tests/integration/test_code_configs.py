"""The code configs compose on the math ones with repeated --config; the CPU code profile trains
end to end (rollout -> sandboxed execution reward -> update)."""

from __future__ import annotations

import csv
import shutil
from pathlib import Path

import pytest

from aspo_lit.__main__ import main
from tests.helpers.cli import effective

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("configs, loss, name, model, max_response", [
    (["conf/aspo.yaml", "conf/code/aspo.yaml"], "aspo", "code_aspo",
     "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B", 32768),
    (["conf/aspo.yaml", "conf/code/grpo.yaml"], "grpo", "code_grpo",
     "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B", 32768),
    (["conf/aspo.yaml", "conf/code/aspo.yaml", "conf/code/qwen3_4b.yaml"], "aspo", "code_aspo_qwen3_4b",
     "Qwen/Qwen3-4B", 8192),
])
def test_code_configs_compose_on_the_math_run(capsys, configs, loss, name, model, max_response):
    cfg = effective(*configs)
    data = cfg["data"]["init_args"]
    assert cfg["data"]["class_path"] == "data_modules.code.CodeRLDataModule"
    assert cfg["model"]["loss"] == loss and cfg["model"]["model_name_or_path"] == model
    assert cfg["trainer"]["logger"]["init_args"]["name"] == name
    # the paper's shared recipe comes from conf/aspo.yaml: 64 prompts, G = 16 at T = 1.0, lr 1e-6
    assert (data["batch_size"], data["group_size"], data["temperature"]) == (64, 16, 1.0)
    assert cfg["model"]["lr"] == 1e-6 and data["max_response_length"] == max_response
    assert data["sandbox"] == "bwrap"
    assert data["reward"] is None      # the sandboxed CodeReward, not conf/aspo.yaml's math verifier
    assert [s["label"] for s in data["train_files"]] == ["codeforces", "code_contests", "deepcoder_lcbv5",
                                                        "deepcoder_primeintellect", "deepcoder_taco"]


def test_tiny_code_configs_compose(capsys):
    for loss in ("aspo", "grpo"):
        cfg = effective("conf/tiny/aspo.yaml", f"conf/tiny/code_{loss}.yaml")
        assert cfg["data"]["class_path"] == "data_modules.testbed.TinyCodeRLDataModule"
        assert cfg["model"]["loss"] == loss and cfg["trainer"]["accelerator"] == "cpu"
        assert "levels" not in cfg["data"]["init_args"]        # the arithmetic module's keys are gone
        assert cfg["data"]["init_args"]["reward"] is None      # not the math profile's MathReward


def test_a_math_reward_on_code_data_is_an_error():
    """A MathReward left in `data.reward` (a code config composed on a math one without
    `reward: null`) would score every program 0: the code DataModule refuses it, naming the key."""
    from aspo_lit.rewards import MathReward
    from data_modules.code import CodeRLDataModule

    with pytest.raises(ValueError, match="data.init_args.reward: null"):
        CodeRLDataModule(reward=MathReward(num_workers=0))


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed (make setup)")
def test_tiny_code_profile_trains_end_to_end(tmp_path):
    from aspo_lit.testbed.shipped import shipped_dir

    model = shipped_dir("testbed-code")
    args = ["fit", "--config", str(REPO / "conf/tiny/aspo.yaml"), "--config", str(REPO / "conf/tiny/code_aspo.yaml"),
            f"--model.model_name_or_path={model}", "--trainer.max_steps=8", "--trainer.val_check_interval=2",
            f"--trainer.logger.init_args.save_dir={tmp_path}", "--trainer.logger.init_args.name=code",
            "--trainer.enable_progress_bar=false", "--data.init_args.num_val=8"]
    assert main(args) == 0
    rows = list(csv.DictReader(next(tmp_path.glob("code/version_*/metrics.csv")).open()))
    rewards = [float(r["train/reward_mean"]) for r in rows if r.get("train/reward_mean")]
    assert len(rewards) == 2 and all(0.0 < r < 1.0 for r in rewards)    # groups hold passing and failing programs
    assert any(r.get("val/avg@4") for r in rows)
    assert (tmp_path / "code" / "checkpoints" / "last.ckpt").is_file()
