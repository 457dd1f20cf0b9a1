"""Every shipped fit config trains on the paper's data (§7.1, Appendix B), read from its effective
config (``--print_config`` through the real CLI): sources, split, config, filters, dedup, held-out
set. Shipping another dataset fails here."""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path

import pytest
import yaml

from aspo_lit.data.mixture import Source
from data_modules.math import RLDataModule
from tests.helpers.cli import print_config

REPO = Path(__file__).resolve().parents[2]

SKYWORK_DIFFICULTY = {"class_path": "aspo_lit.data.filters.FieldRange",
                      "init_args": {"field": "extra_info.model_difficulty.DeepSeek-R1-Distill-Qwen-1.5B",
                                    "min": 1, "max": 15, "name": "difficulty"}}
DAPO_TEMPLATE_START = "Solve the following math problem step by step. The last line of your response"
# the paper's table: (hub id, config, split) of every source, in dedup order, and its filters
MATH_1P5B = [("agentica-org/DeepScaleR-Preview-Dataset", None, "train", []),
             ("Skywork/Skywork-OR1-RL-Data", None, "math", [SKYWORK_DIFFICULTY]),
             ("BytedTsinghua-SIA/DAPO-Math-17k", None, "train", [])]
DAPO_ONLY = [("BytedTsinghua-SIA/DAPO-Math-17k", None, "train", [])]
CODEFORCES_FILTERS = [("FieldIn", "input_mode", ["stdio"]), ("FieldIn", "interaction_format", [None, ""]),
                      ("FieldIn", "generated_checker", [None]), ("FieldIn", "official_tests_complete", [True])]
CODE = [("open-r1/codeforces", "verifiable", "train", CODEFORCES_FILTERS),
        ("deepmind/code_contests", None, "train", []),
        ("agentica-org/DeepCoder-Preview-Dataset", "lcbv5", "train", []),
        ("agentica-org/DeepCoder-Preview-Dataset", "primeintellect", "train", []),
        ("agentica-org/DeepCoder-Preview-Dataset", "taco", "train", [])]
ARCHER2_CODE = [("Fate-Zero/Archer2.0-Code-1.5B", None, "train", [])]
AIME24 = [("HuggingFaceH4/aime_2024", None, "train", [])]
LCB_V5 = [("livecodebench/code_generation_lite", None, "train",
           [("FieldRange", "contest_date", ["2024-08-01", "2025-02-01"])])]

R1_1P5B, QWEN = "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B", "Qwen/Qwen3-"
PAPER = {   # config files -> (model, training sources, held-out sources)
    "aspo": (["conf/aspo.yaml"], R1_1P5B, MATH_1P5B, AIME24),
    "grpo": (["conf/grpo.yaml"], R1_1P5B, MATH_1P5B, AIME24),
    "archer": (["conf/archer.yaml"], R1_1P5B, MATH_1P5B, AIME24),
    **{f"aspo+{a}": (["conf/aspo.yaml", f"conf/ablations/{a}.yaml"], R1_1P5B, MATH_1P5B, AIME24)
       for a in ("grpo_no_is", "grpo_pos_mean", "aspo_no_dual_clip", "cispo")},
    **{q: ([f"conf/{q}.yaml"], QWEN, DAPO_ONLY, AIME24) for q in ("qwen3_4b", "qwen3_8b", "qwen3_30b_a3b")},
    "code_aspo": (["conf/aspo.yaml", "conf/code/aspo.yaml"], R1_1P5B, CODE, LCB_V5),
    "code_grpo": (["conf/aspo.yaml", "conf/code/grpo.yaml"], R1_1P5B, CODE, LCB_V5),
    "code_qwen3_4b": (["conf/aspo.yaml", "conf/code/aspo.yaml", "conf/code/qwen3_4b.yaml"], QWEN, CODE, LCB_V5),
    "code_archer2_data": (["conf/aspo.yaml", "conf/code/aspo.yaml", "conf/code/archer2_data.yaml"], R1_1P5B,
                          ARCHER2_CODE, LCB_V5),
}


@functools.lru_cache(maxsize=None)
def _print_config(configs: tuple[str, ...], data_dir: str | None) -> str:
    """The effective config (``fit --print_config``) under one value of $ASPO_DATA_DIR."""
    return print_config(*configs)


def effective(configs) -> dict:
    return yaml.safe_load(_print_config(tuple(configs), os.environ.get("ASPO_DATA_DIR")))


def _filter(spec) -> tuple:
    kind, args = spec["class_path"].rsplit(".", 1)[-1], spec["init_args"]
    return (kind, args["field"], args["values"] if kind == "FieldIn" else [args["min"], args["max"]])


def _table(sources) -> list[tuple]:
    return [(s["path"], s.get("name"), s["split"], [_filter(f) for f in s["filters"]]) for s in sources]


def _expected(table) -> list[tuple]:
    return [(p, n, s, [f if isinstance(f, tuple) else _filter(f) for f in fs]) for p, n, s, fs in table]


def test_every_shipped_fit_config_is_listed():
    shipped = {str(p.relative_to(REPO)) for p in (REPO / "conf").glob("*.yaml")} - {
        "conf/table1.yaml", "conf/table2.yaml", "conf/table3.yaml"}
    shipped |= {str(p.relative_to(REPO)) for d in ("ablations", "code") for p in (REPO / "conf" / d).glob("*.yaml")}
    listed = {c for configs, *_ in PAPER.values() for c in configs}
    assert shipped <= listed, f"add {sorted(shipped - listed)} to the paper's data table"


@pytest.mark.parametrize("name", list(PAPER))
def test_shipped_config_trains_on_the_papers_data(name, monkeypatch):
    monkeypatch.delenv("ASPO_DATA_DIR", raising=False)
    configs, model, train, val = PAPER[name]
    cfg = effective(configs)
    data = cfg["data"]["init_args"]
    assert cfg["model"]["model_name_or_path"].startswith(model)
    assert _table(data["train_files"]) == _expected(train)
    assert _table(data["val_files"]) == _expected(val)
    assert data["dedup"] is True
    dapo = [s for s in data["train_files"] if s["path"] == "BytedTsinghua-SIA/DAPO-Math-17k"]
    assert all(s["template"].startswith(DAPO_TEMPLATE_START) and "{problem}" in s["template"] for s in dapo)
    skywork = [s for s in data["train_files"] if s["path"] == "Skywork/Skywork-OR1-RL-Data"]
    assert all(s["json_fields"] == ["reward_model.ground_truth"] for s in skywork)


@pytest.mark.parametrize("name", ["aspo", "code_aspo"])
def test_no_local_path_without_the_data_dir(name, monkeypatch):
    """With $ASPO_DATA_DIR unset, the effective config names no local input: every data source is a
    hub id (a staged copy is only a file name looked up under the variable when it is set)."""
    monkeypatch.delenv("ASPO_DATA_DIR", raising=False)
    cfg = effective(PAPER[name][0])
    data = cfg["data"]["init_args"]
    for source in data["train_files"] + data["val_files"]:
        assert re.fullmatch(r"[\w.-]+/[\w.-]+", source["path"]) and not (REPO / source["path"]).exists(), source
    text = yaml.safe_dump(cfg)
    assert "$" + "ASPO_DATA_DIR" not in text and "/work/" not in text and "~/" not in text


def test_shipped_val_source_reads_the_staged_copy_when_set(shared_data_dir):
    """With $ASPO_DATA_DIR set, conf/aspo.yaml's AIME24 comes from the staged file (no hub)."""
    val = effective(["conf/aspo.yaml"])["data"]["init_args"]["val_files"]
    data = RLDataModule(val_files=[Source(**s) for s in val])
    rows = data.task.rows("val")
    assert len(rows) == 30 and rows[0]["id"] == "aime24-I-1" and rows[0]["answer"] == "204"
