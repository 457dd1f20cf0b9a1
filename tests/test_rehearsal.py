"""Rehearse every shipped paper config on CPU (2 processes over gloo, sizes and hardware changed
only): config diff, identical ranks, moving weights, warm-up in rollout batches, 1-process replay,
SIGTERM + resume. See tests/rehearsal/run.py; `make rehearse` runs the same."""

from __future__ import annotations

import json

import pytest

from tests.rehearsal.run import CONFIGS, REPO, rehearse, write_data


def test_every_shipped_fit_config_is_rehearsed():
    """Each shipped fit config (the files under conf/, conf/ablations/ and conf/code/; the table
    configs are not fits) is named by a rehearsal."""
    shipped = {str(p.relative_to(REPO)) for d in ("conf", "conf/ablations", "conf/code") for p in (REPO / d).glob("*.yaml")}
    shipped -= {"conf/table1.yaml", "conf/table2.yaml", "conf/table3.yaml"}
    rehearsed = {c for configs in CONFIGS.values() for c in configs}
    assert shipped <= rehearsed, f"add {sorted(shipped - rehearsed)} to tests/rehearsal/run.py's CONFIGS"


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CONFIGS))
def test_shipped_config_rehearses(name):
    out = REPO / "runs" / "rehearsal"
    write_data(out)
    verdict = rehearse(name, out)
    failed = {k: {x: y for x, y in c.items() if x != "diff"} for k, c in verdict["checks"].items() if not c.get("ok")}
    assert verdict["ok"], json.dumps(failed, indent=1, default=str)


def test_loss_ablations_share_a_resume_check_only_with_a_loss_only_difference(tmp_path):
    """A config whose SIGTERM + resume check is another's (RESUME_AS) differs from it in the loss and
    the logger's name only; any other key that differs fails the check."""
    from tests.rehearsal.run import LOSS_ONLY_KEYS, RESUME_AS, _same_config, config_diff

    for name, other in RESUME_AS.items():
        _, rehearsed = config_diff(name, CONFIGS[name], ["--data.init_args.engine=hf"], tmp_path / name)
        same = _same_config(rehearsed, other, ["--data.init_args.engine=hf"], tmp_path, allowed=LOSS_ONLY_KEYS)
        assert same["ok"], same
        assert rehearsed["model.loss"] != config_diff(other, CONFIGS[other], [], tmp_path / other)[1]["model.loss"]
    changed = {**rehearsed, "model.lr": rehearsed["model.lr"] * 2}
    assert _same_config(changed, other, ["--data.init_args.engine=hf"], tmp_path, allowed=LOSS_ONLY_KEYS)["differ"] == ["model.lr"]


def test_moe_config_rehearses_an_moe_on_vllm(testbed, tmp_path):
    """`qwen3_30b_a3b` rehearses on an MoE (the tiny Qwen3-MoE of tests/rehearsal/moe.py, not the
    dense testbed: otherwise no router, expert weight or expert push runs) with the colocated vLLM
    engine at rollout TP 2, the length reward, and the shipped loss and `rollout_is_cap`."""
    import json as _json
    from pathlib import Path

    from aspo_lit.models import resolve_model_path
    from tests.rehearsal.run import MOE_OVERLAY, VLLM_CONFIGS, config_diff, overlays, run_overrides

    name = "qwen3_30b_a3b"
    assert MOE_OVERLAY in overlays(CONFIGS[name]) and name in VLLM_CONFIGS
    check, rehearsed = config_diff(name, CONFIGS[name], run_overrides(name)[1], tmp_path)
    assert check["ok"], check["outside_overlay"]
    config = _json.loads((Path(resolve_model_path(rehearsed["model.model_name_or_path"])) / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe", config["model_type"]
    assert config["num_local_experts"] > config["num_experts_per_tok"] > 1
    assert rehearsed["data.init_args.engine.class_path"] == "aspo_lit.rollout.VLLMEngine"
    assert rehearsed["data.init_args.engine.init_args.tensor_parallel_size"] == 2
    assert rehearsed["data.init_args.reward.class_path"] == "aspo_lit.rewards.plumbing.LengthReward"
    assert rehearsed["model.rollout_is_cap"] == 2.0 and rehearsed["model.loss"] == "aspo"
