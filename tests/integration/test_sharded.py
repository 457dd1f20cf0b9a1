"""Sharded training on CPU: 2 processes (FSDP2 via FSDP2Strategy, and DDP, over gloo) give the same
gradient norms, weights and logged diagnostics as one process on the same rollout batches, and
validation metrics over all ranks' problems; a NaN on one rank makes every rank skip that step; a
mesh that does not shard over every rank is refused; checkpoints leave the KL reference out and
a resumed fit rebuilds it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.tolerance import rounding_tol

REPO = Path(__file__).resolve().parents[2]
#: the fits run as modules (`python -m tests.multiproc.sharded_fit`) in the test's folder, the repository
#: on PYTHONPATH
SCRIPT, RESUME_SCRIPT, VAL_SCRIPT = ("tests.multiproc.sharded_fit", "tests.multiproc.sharded_resume",
                                     "tests.multiproc.sharded_val")


def _repo_on_path(env: dict[str, str] | None = None) -> dict[str, str]:
    """`env` (default: this process's) with the repository first on PYTHONPATH."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def _run(model_dir, tmp_path, devices, strategy, loss_agg, *extra, timeout=600):
    out = tmp_path / f"{strategy}_{loss_agg}{''.join(extra)}.json"
    cmd = [sys.executable, "-m", SCRIPT, "--model", str(model_dir), "--devices", str(devices),
           "--strategy", strategy, "--loss_agg", loss_agg, "--out", str(out), *extra]
    return subprocess.run(cmd, cwd=tmp_path, env=_repo_on_path(), capture_output=True, text=True, timeout=timeout), out


#: the 1-process fits' results by their arguments: several tests compare against the same one
_SINGLE: dict[tuple, dict] = {}


def _fit(model_dir, tmp_path, devices, strategy, loss_agg, *extra):
    key = (str(model_dir), loss_agg, *extra)
    if strategy == "single" and key in _SINGLE:
        return _SINGLE[key]
    proc, out = _run(model_dir, tmp_path, devices, strategy, loss_agg, *extra)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    if strategy == "single":
        _SINGLE[key] = result
    return result


def _assert_same(single, sharded):
    # Two fp32 fits of the same maths, the batch's sums reduced in another order (over ranks, in shards); no
    # float64 fit exists (model.torch_dtype is fp32 at most), so these bounds are the measured differences
    # with margin (this 2-core box, token-mean): grad norms 3.7e-7 relative (bound 1e-5), diagnostics
    # 1.6e-6 (1e-5), weight sums 6.2e-6 absolute of |sums| <= 64 (1e-4), |weight| sums 3e-9 (1e-6). A wrong
    # reduction (a mean of the ranks' means, a per-rank normaliser) is off by 1e-3 or more (below).
    assert sharded["grad_norms"] == pytest.approx(single["grad_norms"], rel=1e-5)
    for step, logged in enumerate(single["diagnostics"]):  # reduced over ranks = over the whole batch
        assert sharded["diagnostics"][step] == pytest.approx(logged, rel=1e-5), step
    for name, value in single["weights"].items():
        assert sharded["weights"][name] == pytest.approx(value, abs=1e-4), name
        assert sharded["abs_weights"][name] == pytest.approx(single["abs_weights"][name], rel=1e-6), name


@pytest.mark.parametrize("loss_agg", ["token-mean", pytest.param("seq-mean-token-mean", marks=pytest.mark.slow)])
def test_fsdp2_two_processes_match_single(tiny_model_dir, tmp_path, loss_agg):
    single = _fit(tiny_model_dir, tmp_path, 1, "single", loss_agg)
    sharded = _fit(tiny_model_dir, tmp_path, 2, "fsdp2", loss_agg)
    _assert_same(single, sharded)
    # the weights did move: the comparison is not between two untouched models
    moved = [n for n, v in single["weights"].items() if abs(v - single["initial_weights"][n]) > 1e-3]
    assert len(moved) > len(single["weights"]) // 2
    # the ranks hold different token counts, so a mean of the ranks' entropy means would differ
    for ((n0, e0), (n1, e1)), logged in zip(zip(*sharded["local_entropy_per_rank"]), sharded["diagnostics"]):
        # the token-weighted mean of the ranks' fp32 means: 5e-8 relative measured (bound 1e-5); the plain mean
        # of the two means is 1.2e-3 off or more (measured), outside 1e-4
        assert n0 != n1 and (e0 + e1) / 2 != pytest.approx(logged["train/entropy"], rel=1e-4)
        assert logged["train/entropy"] == pytest.approx((n0 * e0 + n1 * e1) / (n0 + n1), rel=1e-5)
    # validation: 3 problems on rank 0, 5 on rank 1; avg@K and pass@K over all 8
    for run in (single, sharded):  # float64 means of 8 problems' scores, the logged one stored in fp32
        assert run["val"] == pytest.approx(run["val_all_problems"], rel=rounding_tol(torch.float32, 2), abs=0)


def test_user_statistic_and_new_diagnostics_two_ranks_match_single(tiny_model_dir, tmp_path):
    """A user loss's own statistic (its name holds "pos"; it is a mean over all response tokens),
    the entropy-mechanism and off-policy diagnostics and the step's statistics, on 2 ranks with
    unequal token counts and 2 optimizer steps per rollout batch, equal one process on the same
    batches; the user statistic equals its definition over the whole rollout batch."""
    extra = ("--loss", "tests.helpers.user_loss:ASPOWithPositionStat", "--minibatches", "2", "--stats")
    single = _fit(tiny_model_dir, tmp_path, 1, "single", "token-mean", *extra)
    sharded = _fit(tiny_model_dir, tmp_path, 2, "fsdp2", "token-mean", *extra)
    for (n0, _), (n1, _) in zip(*sharded["local_entropy_per_rank"]):
        assert n0 != n1
    for ones, twos in zip(single["diagnostics"], sharded["diagnostics"]):
        # fp32 sums in another order under FSDP2: 1.3e-5 relative measured, 2e-7 absolute for the
        # entropy change (2-nat entropies in fp32); a mean of the ranks' means, or a covariance
        # centred per rank, is off by far more
        assert {k: v for k, v in twos.items() if k != "ratio/off_policy_share"} == \
            pytest.approx({k: v for k, v in ones.items() if k != "ratio/off_policy_share"}, rel=1e-4, abs=1e-6)
        # |r - 1| > 1e-6: a few first-mini-batch tokens sit at the fp32 noise of recomputing π_old
        assert twos["ratio/off_policy_share"] == pytest.approx(ones["ratio/off_policy_share"], abs=0.03)
    for lengths, logged in zip(single["response_lengths"], sharded["diagnostics"]):
        positions = sum(n * (n - 1) / 2 for n in lengths) / sum(lengths)  # mean of 0..n-1 over all tokens
        # integer sums (exact in fp32), each rank's mean, ×its weight, the ranks' sum, / the total: < 6 roundings
        assert logged["train/position_mean"] == pytest.approx(positions, rel=rounding_tol(torch.float32, 6), abs=0)
        assert logged["train/updates_per_rollout"] == 2
        assert 0.3 < logged["ratio/off_policy_share"] < 0.7      # the second mini-batch's tokens moved
        assert logged["entropy/measured_change"] != 0


def test_rank0_loads_and_broadcasts(tiny_tied_model_dir, tmp_path):
    """Under FSDP2 only rank 0 reads the checkpoint; the other rank builds on the meta device and
    gets its shards (and the rotary buffers) by broadcast. Both ranks then hold exactly the
    checkpoint's weights, a tied LM head stays tied, and the reference is held in the compute
    dtype (bf16 here)."""
    result = _fit(tiny_tied_model_dir, tmp_path, 2, "fsdp2", "token-mean", "--param_dtype", "bfloat16")
    initial = result["initial_weights"]
    for rank, loaded in enumerate(result["loaded_per_rank"]):
        for name, value in initial.items():
            assert loaded[name] == value, (rank, name)
            assert loaded[f"ref.{name}"] == result["initial_weights_bf16"][name], (rank, name)  # a bf16 copy
        assert result["buffers_per_rank"][rank] == result["initial_buffers"], rank
    assert result["tied_per_rank"] == [True, True]
    assert result["checkpoint_reads_per_rank"] == [2, 0]  # policy and reference, on rank 0 only
    assert result["ref_dtype"] == "torch.bfloat16"


@pytest.mark.slow
def test_ddp_two_processes_match_single(tiny_model_dir, tmp_path):
    single = _fit(tiny_model_dir, tmp_path, 1, "single", "token-mean")
    _assert_same(single, _fit(tiny_model_dir, tmp_path, 2, "ddp", "token-mean"))


def test_nan_on_one_rank_skips_the_step_on_every_rank(tiny_model_dir, tmp_path):
    """Rank 1 alone meets NaN log-probs: both ranks skip that optimizer step, nobody raises or hangs,
    and the ranks still hold the same (sharded) model."""
    result = _fit(tiny_model_dir, tmp_path, 2, "fsdp2", "token-mean", "--nan_rank", "1")
    skipped = result["skipped_per_rank"]
    assert skipped[0] == skipped[1] and skipped[0][0] == 1 and sum(skipped[0]) == 1, skipped  # a skipped step is redone: 3 batches
    moved = [n for n, v in result["weights"].items() if abs(v - result["initial_weights"][n]) > 1e-3]
    assert moved  # the second step was taken


def test_lightning_default_mesh_is_refused(tiny_model_dir, tmp_path):
    """`ModelParallelStrategy()` puts every device on the tensor-parallel axis: FSDP2 over its
    data-parallel axis would train 2 independent models. The module refuses, naming the setting."""
    proc, _ = _run(tiny_model_dir, tmp_path, 2, "model_parallel_default", "token-mean", timeout=300)
    assert proc.returncode != 0
    assert "FSDP2Strategy" in proc.stderr and "1 of 2 processes" in proc.stderr


def test_token_budget_split_matches_fixed_micro_batches(tiny_model_dir, tmp_path):
    """Token-budget micro-batches (sorted by length, each cut to its own width) give the gradient
    of fixed micro-batches: the global normaliser makes the update independent of the split."""
    fixed = _fit(tiny_model_dir, tmp_path, 1, "single", "seq-mean-token-mean")
    budget = _fit(tiny_model_dir, tmp_path, 1, "single", "seq-mean-token-mean", "--budget", "40")
    # fp32 sums in another order: 1.1e-6 relative measured on this 2-core box (a wrong normaliser is ~1e-1);
    # weight sums 3e-6 absolute, |weight| sums 1e-9 relative (measured again with the numerics review)
    assert budget["grad_norms"] == pytest.approx(fixed["grad_norms"], rel=1e-5)
    for name, value in fixed["weights"].items():
        assert budget["weights"][name] == pytest.approx(value, rel=1e-6, abs=1e-6), name
        assert budget["abs_weights"][name] == pytest.approx(fixed["abs_weights"][name], rel=1e-6), name


def test_token_budget_two_ranks_match_single(tiny_model_dir, tmp_path):
    """With a token budget the ranks can need different numbers of micro-batches; they agree on the
    largest count (FSDP2 gathers weights in every forward), and the result equals one process."""
    single = _fit(tiny_model_dir, tmp_path, 1, "single", "token-mean", "--budget", "30")
    _assert_same(single, _fit(tiny_model_dir, tmp_path, 2, "fsdp2", "token-mean", "--budget", "30"))


def test_fsdp2_checkpoints_leave_out_the_reference_and_resume(tiny_model_dir, tmp_path):
    """FSDP2 on 2 ranks (tests/multiproc/sharded_resume.py): the sharded checkpoint and the full file hold the
    policy's tensors and no reference's; a fit resumed from either, or from a sharded checkpoint of
    the older format that held the reference (its tensors not the base's: ignored), rebuilds the
    reference from the base model and takes the uninterrupted fit's step, train/kl included. Each
    rank runs its share of the host's cores: 4 given to 2 ranks, 2 threads each, whatever Lightning's
    launcher set (it would give this 2-core box 1 each)."""
    from aspo_lit.training.threads import THREAD_VARIABLES

    out = tmp_path / "result.json"
    env = _repo_on_path({k: v for k, v in os.environ.items() if k not in THREAD_VARIABLES})
    proc = subprocess.run([sys.executable, "-m", RESUME_SCRIPT, "--model", str(tiny_model_dir), "--out", str(out),
                           "--cores", "4"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    runs = {name: per_rank[0] for name, per_rank in result["runs"].items()}  # rank 0's (the logged ones are reduced)
    full = runs["full"]
    policy = {f"state_dict.policy.{name}" for name in full["loaded"] if not name.startswith("ref.")}
    base_reference = {name: v for name, v in full["loaded"].items() if name.startswith("ref.")}
    assert base_reference and all(d["train/kl"] > 0 for d in full["diagnostics"][1:])
    checkpoints = result["checkpoints"]
    for name in ("cut.ckpt", "cut_full_file.ckpt"):
        assert set(checkpoints[name]["module_tensors"]) == policy, name
    assert checkpoints["cut.ckpt"]["disk_bytes"] < checkpoints["cut_older_format.ckpt"]["disk_bytes"]
    for name in ("resumed", "resumed_full_file", "resumed_old_format"):
        run = runs[name]
        loaded_reference = {n: v for n, v in run["loaded"].items() if n.startswith("ref.")}
        assert loaded_reference == base_reference, name  # the base's, not the checkpoint's or the trained policy's
        assert {n: v for n, v in run["loaded"].items() if not n.startswith("ref.")} == runs["cut"]["weights"], name
        # the same computation from the restored state: the same bits
        assert run["grad_norms"] == full["grad_norms"][1:] and run["diagnostics"] == full["diagnostics"][1:], name
        assert run["weights"] == full["weights"], name
    assert {rank["threads"] for per_rank in result["runs"].values() for rank in per_rank} == {2}


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.alone  # in two full CI runs, beside the other worker, the FSDP2 run aborted (docs/ci.md)
@pytest.mark.parametrize("strategy", ["fsdp2", "ddp"])
def test_validation_is_sharded_over_ranks(tiny_model_dir, tmp_path, strategy):
    """Validation on 2 ranks with the real DataModule and transformers engine (tests/multiproc/sharded_val.py):
    5 problems in batches of 4 and 1, so the shares are unequal (3 and 2) and rank 1 has none in
    the second call. Each rank decodes and counts its share of each batch (problems r, r + 2, ...),
    the shares are the val set with no problem twice, and the logged avg@K / pass@K are the means
    over the problems of what the ranks decoded. Under FSDP2 the engine samples from the shards in
    lockstep: every call has as many prompts on both ranks, a short share padded with the batch's
    first problem, decoded and not counted; under DDP a rank with no problems calls with none."""
    out = tmp_path / "val.json"
    cmd = [sys.executable, "-m", VAL_SCRIPT, "--model", str(tiny_model_dir), "--devices", "2",
           "--strategy", strategy, "--out", str(out)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=_repo_on_path(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    problems, size, k = result["problems"], result["val_batch_size"], result["k"]
    batches = [problems[i:i + size] for i in range(0, len(problems), size)]
    counted: dict[str, list[float]] = {}
    for rank, calls in enumerate(result["calls_per_rank"]):
        assert len(calls) == len(batches), rank                      # every rank takes part in every call
        seeds = {call["seed"] for call in calls}                     # rank 0: the run's seed, as one process
        assert seeds == {5} if rank == 0 else (len(seeds) == 1 and 5 not in seeds), (rank, seeds)
        for batch, call in zip(batches, calls):
            share = batch[rank::2]
            filler = call["problems"][len(share):]
            assert call["problems"][:len(share)] == share, (rank, call["problems"])
            assert filler == ([batch[0]] * (-(-len(batch) // 2) - len(share)) if strategy == "fsdp2" else []), rank
            for problem, grades in zip(share, call["grades"]):
                assert problem not in counted, problem               # no problem decoded by two ranks
                counted[problem] = grades
    assert sorted(counted) == sorted(problems)
    if strategy == "fsdp2":  # lockstep: both ranks decode as many prompts in every call
        assert [len(c["problems"]) for c in result["calls_per_rank"][0]] == \
            [len(c["problems"]) for c in result["calls_per_rank"][1]]
    avg = sum(sum(g) / k for g in counted.values()) / len(counted)
    solved = sum(any(g) for g in counted.values()) / len(counted)
    assert 0 < avg < 1 and 0 < solved                                # the grades vary: not a vacuous check
    # float64 sums of 5 problems' scores, logged as fp32
    assert result["val"][f"val/avg@{k}"] == pytest.approx(avg, rel=rounding_tol(torch.float32, 2), abs=0)
    assert result["val"][f"val/pass@{k}"] == pytest.approx(solved, rel=rounding_tol(torch.float32, 2), abs=0)
