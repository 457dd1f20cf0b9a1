"""Rehearse every shipped paper config on CPU (2 processes over gloo, sizes and hardware changed
only): config diff, identical ranks, moving weights, warm-up in rollout batches, 1-process replay,
SIGTERM + resume. See tools/rehearsal/run.py; `make rehearse` runs the same."""

from __future__ import annotations

import json

import pytest
import torch

from tools.rehearsal.run import CONFIGS, REPO, rehearse, write_data


def test_every_shipped_fit_config_is_rehearsed():
    """Each shipped fit config (the files under conf/, conf/ablations/ and conf/code/; the table
    configs are not fits) is named by a rehearsal."""
    shipped = {str(p.relative_to(REPO)) for d in ("conf", "conf/ablations", "conf/code") for p in (REPO / d).glob("*.yaml")}
    shipped -= {"conf/table1.yaml", "conf/table2.yaml", "conf/table3.yaml"}
    rehearsed = {c for configs in CONFIGS.values() for c in configs}
    assert shipped <= rehearsed, f"add {sorted(shipped - rehearsed)} to tools/rehearsal/run.py's CONFIGS"


#: rehearsals too long for CI (`make rehearse` runs them): the real-shaped model's (~10 min, ~11 GB), and
#: the 2-node one's (~2.5 min: every fit two torchrun launches; its config and launch are checked below)
HEAVY = ("aspo_real_shape", "aspo_2nodes")
#: the rehearsals tests/integration/test_rehearsal_more.py runs: a second file, so that pytest-xdist (`--dist
#: loadfile`) can give them to the other worker (the fits of each file take 6-10 min of a worker's time on a
#: 2-core AVX2 machine: `aspo` and `qwen3_30b_a3b` here, `archer` and `code_aspo` there)
IN_SECOND_FILE = ("grpo", "archer", "aspo+grpo_no_is", "qwen3_8b", "code_aspo", "code_grpo", "code_qwen3_4b",
                  "code_archer2_data")


def check_rehearsal(name: str) -> None:
    """Rehearse the shipped config ``name``; fail with the checks that did not hold."""
    out = REPO / "runs" / "rehearsal"
    write_data(out)
    verdict = rehearse(name, out)
    failed = {k: {x: y for x, y in c.items() if x != "diff"} for k, c in verdict["checks"].items() if not c.get("ok")}
    assert verdict["ok"], json.dumps(failed, indent=1, default=str)


def test_the_second_files_rehearsals_are_ci_rehearsals():
    """A name in `IN_SECOND_FILE` that is no rehearsal, or a HEAVY one, would run nothing or too much."""
    assert set(IN_SECOND_FILE) <= set(CONFIGS) and not set(IN_SECOND_FILE) & set(HEAVY)


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in CONFIGS if n not in HEAVY and n not in IN_SECOND_FILE])
def test_shipped_config_rehearses(name):
    check_rehearsal(name)


def test_loss_ablations_rehearse_as_a_config_that_differs_in_the_loss_only(tmp_path):
    """A config that rehearses as another (LOSS_ONLY_AS) differs from it in the loss and the logger's
    name only, and its loss builds from its config; any other key that differs, or a loss that does
    not build, fails the rehearsal's checks."""
    from tools.rehearsal.run import LOSS_ONLY_AS, LOSS_ONLY_KEYS, _same_config, config_diff, loss_builds

    for name, other in LOSS_ONLY_AS.items():
        _, rehearsed = config_diff(name, CONFIGS[name], ["--data.init_args.engine=hf"], tmp_path / name)
        same = _same_config(rehearsed, other, ["--data.init_args.engine=hf"], tmp_path, allowed=LOSS_ONLY_KEYS)
        assert same["ok"], same
        assert rehearsed["model.loss"] != config_diff(other, CONFIGS[other], [], tmp_path / other)[1]["model.loss"]
        assert loss_builds(rehearsed)["ok"], (name, loss_builds(rehearsed))
    changed = {**rehearsed, "model.lr": rehearsed["model.lr"] * 2}
    assert _same_config(changed, other, ["--data.init_args.engine=hf"], tmp_path, allowed=LOSS_ONLY_KEYS)["differ"] == ["model.lr"]
    assert not loss_builds({**rehearsed, "model.loss": "aspo_typo"})["ok"]
    assert not loss_builds({**rehearsed, "model.loss_kwargs.dual_clip": 0.5})["ok"]


def test_moe_config_rehearses_an_moe_on_vllm(testbed, tmp_path):
    """`qwen3_30b_a3b` rehearses on an MoE (the tiny Qwen3-MoE of tools/rehearsal/standins.py, not the
    dense testbed: otherwise no router, expert weight or expert push runs) with the colocated vLLM
    engine at rollout TP 2, the length reward, and the shipped loss and `rollout_is_cap`."""
    import json as _json
    from pathlib import Path

    from aspo_lit.training.models import resolve_model_path
    from tools.rehearsal.run import MOE_OVERLAY, VLLM_CONFIGS, config_diff, overlays, run_overrides

    name = "qwen3_30b_a3b"
    assert MOE_OVERLAY in overlays(CONFIGS[name]) and name in VLLM_CONFIGS
    check, rehearsed = config_diff(name, CONFIGS[name], run_overrides(name)[1], tmp_path)
    assert check["ok"], check["outside_overlay"]
    config = _json.loads((Path(resolve_model_path(rehearsed["model.model_name_or_path"])) / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe", config["model_type"]
    assert config["num_local_experts"] > config["num_experts_per_tok"] > 1
    assert rehearsed["data.init_args.engine.class_path"] == "aspo_lit.rollout.vllm.VLLMEngine"
    assert rehearsed["data.init_args.engine.init_args.tensor_parallel_size"] == 2
    assert rehearsed["data.init_args.reward.class_path"] == "aspo_lit.rewards.plumbing.LengthReward"
    assert rehearsed["model.rollout_is_cap"] == 2.0 and rehearsed["model.loss"] == "aspo"


def test_phase_rss_gives_a_peak_to_the_phase_that_made_it():
    """The probe's per-phase peak RSS: 256 MiB touched and freed inside one phase count there, not in
    the phase after it."""
    from tools.rehearsal.probe import PhaseRSS

    phases = PhaseRSS(interval=0.001)
    phases.enter("big")
    block = torch.ones(64 * 2**20)    # 256 MiB, written
    phases.sample()
    del block
    phases.enter("small")
    peaks = phases.stop()
    assert peaks["big"] - peaks["small"] >= 200, peaks
    assert set(peaks) == {"setup", "big", "small"}


def test_host_memory_check_holds_every_rank_and_phase_to_the_bound():
    from tools.rehearsal.run import host_memory

    probes = [{"peak_rss_mib": {"phases": {"rollout": 3000.0, "update": 4100.0}}},
              {"peak_rss_mib": {"phases": {"rollout": 2900.0, "update": 3900.0}}}]
    assert host_memory(probes, 8192)["ok"] and host_memory(probes, 8192)["worst_mib"] == 4100.0
    assert not host_memory(probes, 4096)["ok"]                       # rank 0's update phase is over
    assert not host_memory([{"peak_rss_mib": {}}] * 2, 8192)["ok"]    # nothing measured is no pass


def test_real_shape_rehearsal_trains_the_real_shape_on_vllm(testbed, tmp_path):
    """`aspo_real_shape` is conf/aspo.yaml with the CPU overlay and its own: a llama of a real 135M
    checkpoint's shape (not the testbed: the host memory it bounds depends on shapes), the colocated
    vLLM engine, the length reward, 96-token responses, and a host-memory bound."""
    import json as _json
    from pathlib import Path

    from aspo_lit.training.models import resolve_model_path
    from tools.rehearsal.run import (
        REAL_SHAPE_OVERLAY,
        RSS_BOUND_MIB,
        VLLM_CONFIGS,
        config_diff,
        overlays,
        run_overrides,
    )

    name = "aspo_real_shape"
    assert overlays(CONFIGS[name], name)[-1] == REAL_SHAPE_OVERLAY and name in VLLM_CONFIGS and RSS_BOUND_MIB[name] <= 8192
    check, rehearsed = config_diff(name, CONFIGS[name], run_overrides(name)[1], tmp_path)
    assert check["ok"], check["outside_overlay"]
    config = _json.loads((Path(resolve_model_path(rehearsed["model.model_name_or_path"])) / "config.json").read_text())
    shape = {k: config[k] for k in ("model_type", "num_hidden_layers", "hidden_size", "intermediate_size",
                                    "num_attention_heads", "num_key_value_heads", "vocab_size", "tie_word_embeddings")}
    assert shape == {"model_type": "llama", "num_hidden_layers": 30, "hidden_size": 576, "intermediate_size": 1536,
                     "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152, "tie_word_embeddings": True}
    # a pretrained checkpoint's magnitudes, not a fresh initialisation's (norms of 1, embeddings of 0.02)
    from safetensors import safe_open

    folder = Path(resolve_model_path(rehearsed["model.model_name_or_path"]))
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        norms = torch.cat([f.get_tensor(k).float() for k in f.keys() if k.endswith("norm.weight")])
        embedding = f.get_tensor("model.embed_tokens.weight").float()
    assert 0.5 <= norms.min() and norms.max() <= 8.0 * 1.01 and norms.mean() > 2.0 and (norms > 4.0).float().mean() > 0.2
    assert abs(float(embedding.std()) - 0.05) < 0.002
    assert rehearsed["data.init_args.engine.class_path"] == "aspo_lit.rollout.vllm.VLLMEngine"
    assert rehearsed["data.init_args.reward.class_path"] == "aspo_lit.rewards.plumbing.LengthReward"
    assert rehearsed["data.init_args.max_response_length"] == 96 and rehearsed["model.loss"] == "aspo"


def _one_adamw_step(lr: float, frozen: bool = False):
    """A norm-like weight of several units and an embedding-scale matrix, one AdamW step at ``lr``
    (``frozen``: the matrix has a gradient but is not in the optimizer); what the probe reads."""
    from tools.rehearsal.probe import adamw_update

    torch.manual_seed(0)
    params = {"norm": torch.nn.Parameter(torch.empty(64).uniform_(2.0, 6.0)),
              "matrix": torch.nn.Parameter(torch.randn(32, 64) * 0.02)}
    optimizer = torch.optim.AdamW([params["norm"]] if frozen else list(params.values()), lr=lr, weight_decay=0.1)
    before = {n: p.detach().clone() for n, p in params.items()}
    (params["matrix"] @ params["norm"]).square().sum().backward()
    optimizer.step()
    group = optimizer.param_groups[0]
    for n, p in params.items():
        state = optimizer.state.get(p)
        delta = None if not state else adamw_update(before[n], state["exp_avg"], state["exp_avg_sq"],
                                                    float(state["step"]), group["lr"], group["betas"], group["eps"],
                                                    group["weight_decay"])
        yield n, before[n], p.detach().clone(), delta


def test_weights_move_asks_only_representable_updates_to_move():
    """At a warm-up lr of 1e-7 a norm weight of several units cannot move (its ulp is 2.4e-7 to
    4.8e-7): the old rule (>= 99 % of the entries with a gradient changed) failed a real checkpoint
    there; the derived rule asks every entry whose update exceeds 2 ulp to move, and each did."""
    from tools.rehearsal.probe import representable_moves

    steps = list(_one_adamw_step(lr=1e-7))
    moved = sum(int((after != before).sum()) for _, before, after, _ in steps)
    assert moved / sum(before.numel() for _, before, _, _ in steps) < 0.99    # the fixed fraction fails here
    check = representable_moves(iter(steps))
    assert check["ok"], check
    assert check["below_resolution_entries"] >= 64 and check["representable_entries"] == 32 * 64


def test_weights_move_fails_an_update_that_did_not_land_or_a_parameter_not_stepped():
    from tools.rehearsal.probe import representable_moves

    steps = list(_one_adamw_step(lr=1e-3))
    name, before, after, delta = steps[1]
    undone = after.clone()
    undone[0, :3] = before[0, :3]       # three entries whose update never reached the weight
    check = representable_moves(iter([steps[0], (name, before, undone, delta)]))
    assert not check["ok"] and check["unchanged_by_tensor"] == {"matrix": 3}
    check = representable_moves(_one_adamw_step(lr=1e-3, frozen=True))
    assert not check["ok"] and check["without_optimizer_state"] == ["matrix"]
    assert not representable_moves(_one_adamw_step(lr=1e-12))["ok"]   # nothing representable: nothing checked


def test_bf16_replay_is_held_to_the_noise_it_measured():
    from tools.rehearsal.run import BF16_NOISE_FACTOR, compare_weights

    w0 = {"w": torch.zeros(1000)}
    single = {"w": torch.ones(1000)}
    close = {"w": torch.ones(1000) * 1.05}      # 5 % off the replay's update
    assert compare_weights([w0, close], [w0, single], bf16=True, noise=0.05 / BF16_NOISE_FACTOR * 1.01)["ok"]
    assert not compare_weights([w0, close], [w0, single], bf16=True, noise=0.05 / BF16_NOISE_FACTOR * 0.99)["ok"]
    assert not compare_weights([w0, close], [w0, single], bf16=True, noise=None)["ok"]   # nothing to hold it to


def test_two_node_rehearsal_is_the_aspo_config_on_two_nodes_of_one_rank(tmp_path):
    """`aspo_2nodes` is conf/aspo.yaml with the CPU overlay and 2 nodes of 1 rank (trainer.num_nodes 2,
    devices 1: nothing else differs from `aspo`'s rehearsal), every fit one torchrun per node; the
    multi-node check holds ranks, nodes and local ranks to two machines' and refuses any other."""
    from tools.rehearsal.run import MULTI_NODE, TWO_NODES_OVERLAY, VLLM_CONFIGS, config_diff, multi_node, overlays

    name = "aspo_2nodes"
    assert name in MULTI_NODE and name in VLLM_CONFIGS and overlays(CONFIGS[name], name)[-1] == TWO_NODES_OVERLAY
    check, rehearsed = config_diff(name, CONFIGS[name], [], tmp_path / name)
    assert check["ok"], check["outside_overlay"]
    _, single_node = config_diff("aspo", CONFIGS["aspo"], [], tmp_path / "aspo")
    assert {k for k in set(rehearsed) | set(single_node) if rehearsed.get(k) != single_node.get(k)} == {
        "trainer.num_nodes", "trainer.devices"}
    probes = [{"global_rank": r, "node_rank": r, "local_rank": 0, "env_local_rank": "0", "num_nodes": 2,
               "policy_loads": [r == 0, r == 0], "engine": {"topology": "colocated"}} for r in range(2)]
    assert multi_node(probes, 2)["ok"]
    both_read = [{**p, "policy_loads": [True, True]} for p in probes]            # every node read the checkpoint
    one_node = [{**p, "node_rank": 0, "local_rank": p["global_rank"]} for p in probes]   # 2 ranks on one node
    assert not multi_node(both_read, 2)["ok"] and not multi_node(one_node, 2)["ok"]


def test_first_gradient_is_held_to_the_rounding_the_run_measured(tmp_path):
    """From the same weights and batch, the multi-process run's first gradient differs from the replay's
    by rounding only: within 3x the bf16 replay's distance from an fp32 replay (bf16), 1e-5 (fp32). A
    gradient that lost a rank's half of the batch is far outside either."""
    from tools.rehearsal.run import compare_gradients

    g = torch.Generator().manual_seed(0)
    half_a, half_b = torch.randn(100, 50, generator=g), torch.randn(100, 50, generator=g)
    exact = {"w": (half_a + half_b) / 2}
    rounded = {"w": exact["w"] * (1 + 1e-3 * torch.randn(100, 50, generator=g))}     # bf16-like noise
    reordered = {"w": exact["w"] * (1 + 1e-3 * torch.randn(100, 50, generator=g))}
    lost_rank = {"w": half_a}
    paths = {}
    for name, state in (("exact", exact), ("rounded", rounded), ("reordered", reordered), ("lost", lost_rank)):
        paths[name] = tmp_path / f"{name}.pt"
        torch.save(state, paths[name])
    assert compare_gradients(paths["reordered"], paths["rounded"], paths["exact"])["ok"]
    assert not compare_gradients(paths["lost"], paths["rounded"], paths["exact"])["ok"]
    assert compare_gradients(paths["exact"], paths["exact"], None)["ok"]
    assert not compare_gradients(paths["rounded"], paths["exact"], None)["ok"]          # fp32: 1e-5
    assert not compare_gradients(tmp_path / "none.pt", paths["exact"], None)["ok"]
