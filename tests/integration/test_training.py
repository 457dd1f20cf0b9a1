"""End-to-end `fit` on the CPU testbed: determinism, interrupt + resume, and learning."""

from __future__ import annotations

import csv
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from aspo_lit.__main__ import main
from tests.helpers.tolerance import torch_threads

REPO = Path(__file__).resolve().parents[2]
NONDETERMINISTIC = ("timing/", "perf/")

# Two fits of one seed give the same bits at any fixed thread count: at one (the in-process tests below,
# whose fits must share the pytest worker's thread count) and at the machine's default
# (test_same_seed_same_bits_at_the_default_thread_count, fresh processes as a user starts them). Before
# the shared prompt's gradients were summed by index_select (aspo_lit/training/forward.py), two-thread fits
# differed from the first update on: an advanced index's backward adds with atomic float adds from
# parallel threads.


def fit_args(model: str, save_dir: Path, name: str, max_steps: int, *extra: str) -> list[str]:
    return [
        "fit", "--config", str(REPO / "conf/tiny/aspo.yaml"),
        f"--model.model_name_or_path={model}",
        f"--trainer.max_steps={max_steps}",
        f"--trainer.logger.init_args.save_dir={save_dir}",
        f"--trainer.logger.init_args.name={name}",
        "--trainer.enable_progress_bar=false",
        "--data.init_args.batch_size=8", "--data.init_args.group_size=4",
        "--data.init_args.num_val=0", "--data.init_args.max_response_length=48",
        "--model.mini_batch_size=4", *extra,
    ]


def read_metrics(run_dir: Path) -> dict[int, dict[str, float]]:
    """step -> metrics, merged over every version folder of an experiment (resumed runs add one)."""
    by_step: dict[int, dict[str, float]] = {}
    for path in sorted(run_dir.glob("version_*/metrics.csv"), key=lambda p: int(p.parent.name.split("_")[1])):
        with path.open() as handle:
            for row in csv.DictReader(handle):
                values = {k: float(v) for k, v in row.items() if v not in ("", None) and k != "step"}
                by_step.setdefault(int(row["step"]), {}).update(values)
    return by_step


def deterministic_part(metrics: dict[int, dict[str, float]]) -> dict[int, dict[str, float]]:
    return {step: {k: v for k, v in row.items() if not k.startswith(NONDETERMINISTIC)}
            for step, row in metrics.items()}


def test_same_seed_same_metrics(testbed, tmp_path, one_thread):
    assert main(fit_args(testbed, tmp_path, "a", 4)) == 0
    # the second run also evaluates the untrained policy (ValBeforeTrain): its training is the same
    assert main(fit_args(testbed, tmp_path, "b", 4, "--data.init_args.num_val=8",
                         "--trainer.callbacks+=aspo_lit.callbacks.ValBeforeTrain")) == 0
    with_val = read_metrics(tmp_path / "b")
    assert "val/avg@4" in with_val[0] and not any("val/avg@4" in row for step, row in with_val.items() if step)
    first, second = (deterministic_part(read_metrics(tmp_path / n)) for n in ("a", "b"))
    first, second = ({step: {k: v for k, v in row.items() if "val" not in k} for step, row in run.items()}
                     for run in (first, second))
    assert len(first) == 2 and "train/reward_mean" in first[0] and "train/entropy" in first[0]
    # the sampler/trainer mismatch is logged every step; the transformers engine samples from the
    # policy itself in fp32, so it is tiny (a bf16 vLLM engine on GPU shows far more)
    for row in first.values():
        assert 0.0 <= float(row["rollout/logprob_diff_mean"]) <= float(row["rollout/logprob_diff_max"]) < 1e-3
        assert abs(float(row["rollout/is_ratio_mean"]) - 1.0) < 1e-3
    assert first == second
    # `seed_everything` alone is the run's seed: the data's and the module's seeds derive from it
    assert main(fit_args(testbed, tmp_path, "c", 4, "--seed_everything=1")) == 0
    other = deterministic_part(read_metrics(tmp_path / "c"))
    assert other != first
    # other samples from the first batch on (the first rollout is drawn before any update)
    first_samples = [first[0][k] for k in ("response/length_mean", "train/reward_mean")]
    assert [other[0][k] for k in ("response/length_mean", "train/reward_mean")] != first_samples
    assert "seed_everything: 1\n" in (tmp_path / "c" / "version_0" / "config.yaml").read_text()


def _fit_at_default_threads(args: list[str], busy: bool = False) -> None:
    """``python -m aspo_lit <args>`` in a fresh process at torch's default thread count (no thread
    variable: one thread per core, as a user's fit starts); ``busy``: beside a process that keeps a
    core busy all along."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
    try:
        proc = subprocess.run([sys.executable, "-m", "aspo_lit", *args], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=600)
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]


@pytest.mark.e2e
def test_same_seed_same_bits_at_the_default_thread_count(testbed, tmp_path):
    """Where users run: fresh fits of one seed at the machine's default thread count give every logged
    non-timing value bit for bit, idle and with a core kept busy, and the default loop they run is
    `data.max_staleness: 0` (the run's saved config; the DataModule takes the synchronous loop for
    any false value). Seen failing before the shared prompt's index_select (the first difference
    after the first update), and passing on one thread there."""
    import yaml

    steps = ("--data.init_args.batch_size=32", "--data.init_args.group_size=8", "--model.mini_batch_size=8")
    _fit_at_default_threads(fit_args(testbed, tmp_path, "a", 8, *steps))
    saved = yaml.safe_load(next((tmp_path / "a").glob("version_*/config.yaml")).read_text())
    assert saved["data"]["init_args"]["max_staleness"] == 0
    _fit_at_default_threads(fit_args(testbed, tmp_path, "b", 8, *steps), busy=True)
    runs = {n: deterministic_part(read_metrics(tmp_path / n)) for n in ("a", "b")}
    assert len(runs["a"]) == 2 and "train/entropy" in runs["a"][1]
    assert runs["b"] == runs["a"], _debug_diff(runs["b"], runs["a"])


def test_a_nucleus_cut_trains_on_the_trainers_own_old_logprobs_and_logs_the_kept_mass(testbed, tmp_path):
    """data.top_p < 1: the sampler's log-probs are renormalised over the nucleus, so with the trainer's own
    π_old (recompute, the default) the run trains and logs the kept mass, π_old / π_sampler at each sampled
    token (the sampler's own engine is the policy here: the ratio is the mass itself); with π_old from the
    sampler, or a truncated IS weight, the combination is refused before training (tests/unit/test_cli.py)."""
    from aspo_lit.maths.sampler_mismatch import check_truncated_support

    assert main(fit_args(testbed, tmp_path, "nucleus", 4, "--data.init_args.top_p=0.8")) == 0
    rows = [row for row in read_metrics(tmp_path / "nucleus").values() if "rollout/kept_mass" in row]
    assert len(rows) == 2
    for row in rows:
        assert 0.5 < row["rollout/kept_mass"] < 1.0 and row["rollout/kept_mass"] == row["rollout/is_ratio_mean"]
    with pytest.raises(ValueError, match="data.top_p=0.8 with model.old_logprobs=sampler"):
        check_truncated_support(0.8, "sampler", None)
    check_truncated_support(1.0, "sampler", None)   # the whole vocabulary: nothing to refuse


@pytest.mark.numerics
def test_exact_speedups_keep_the_metrics(testbed, tmp_path, monkeypatch, one_thread):
    """The speed-ups that claim exactness give the same metrics bit for bit, over two PPO epochs of
    shuffled mini-batches: the rollout engine's in-place KV cache (aspo_lit/rollout/kv_cache.py;
    in its buffer from the prompt on, where the demo's short answers would stay below its
    128-position start) against transformers' own cache, the engine's sampling loop
    (rollout/decode.py) against transformers' `generate`, the first mini-batch's old
    log-probs and entropy taken from its own update forward against a pre-update pass that
    computes them, the fused head's logits kept for its backward against recomputed
    (fused_logprobs.KEEP_LOGITS_MAX), and the update's record made in the last epoch only
    against every epoch."""
    from aspo_lit.maths import fused_logprobs
    from aspo_lit.maths.update_plan import PreUpdate, UpdateRecord
    from aspo_lit.rollout import HFEngine, kv_cache

    calls = {"cache": 0, "lean": 0, "reused": 0, "records": 0}
    real_cache, real_fill = kv_cache.growing_kv_cache, PreUpdate.fill_from_update
    real_sample = __import__("aspo_lit.rollout.decode", fromlist=["sample_rows"]).sample_rows

    def counting(key, fn):
        def wrapped(*args, **kwargs):
            calls[key] += 1
            return fn(*args, **kwargs)
        return wrapped

    def fill(pre, rows, *args):
        calls["reused"] += int(pre.pending_old[rows].all())
        return real_fill(pre, rows, *args)

    monkeypatch.setattr(kv_cache, "growing_kv_cache", counting("cache", lambda model, limit: real_cache(model, limit, start=16)))
    monkeypatch.setattr("aspo_lit.rollout.decode.sample_rows", counting("lean", real_sample))
    monkeypatch.setattr(PreUpdate, "fill_from_update", fill)
    monkeypatch.setattr(UpdateRecord, "at_last_update", counting("records", UpdateRecord.at_last_update))
    epochs = ("--model.ppo_epochs=2", "--model.shuffle_mini_batches=true")
    assert main(fit_args(testbed, tmp_path, "fast", 8, *epochs)) == 0
    assert calls["cache"] and calls["lean"] and calls["reused"] == 2, calls  # one first mini-batch per rollout batch
    fast_records = calls["records"]

    monkeypatch.setattr(kv_cache, "growing_kv_cache", lambda *a: None)
    monkeypatch.setattr(HFEngine.__init__, "__defaults__", _with_default(HFEngine.__init__, decode="generate"))
    monkeypatch.setattr(PreUpdate, "leave_to_first_update", lambda pre, rows: None)  # the pass computes every row
    monkeypatch.setattr(UpdateRecord, "made_at", staticmethod(lambda *step: True))  # a record in every epoch
    monkeypatch.setattr(fused_logprobs, "KEEP_LOGITS_MAX", 0)
    calls.update(lean=0, reused=0, records=0)
    assert main(fit_args(testbed, tmp_path, "plain", 8, *epochs)) == 0
    assert calls["lean"] == 0 and calls["reused"] == 0
    assert calls["records"] == 2 * fast_records  # every epoch of two instead of the last
    fast, plain = (deterministic_part(read_metrics(tmp_path / n)) for n in ("fast", "plain"))
    assert len(fast) == 2 and fast == plain, _debug_diff(fast, plain)


def _with_default(function, **changes) -> tuple:
    """`function.__defaults__` with the named keyword defaults changed."""
    import inspect

    params = [p for p in inspect.signature(function).parameters.values() if p.default is not inspect.Parameter.empty]
    return tuple(changes.get(p.name, p.default) for p in params)


def test_sampler_old_logprobs_match_recompute_up_to_the_engine_gap(testbed, tmp_path, monkeypatch):
    """`model.old_logprobs: sampler` skips the policy pass before the update (the reference pass
    stays) and gives `recompute`'s first-step metrics up to the sampler/trainer gap: the fp32
    transformers engine computes its log-probs in prefill and one-token steps (other matmul
    shapes than the trainer's forward), so π_old differs in the last bits (rollout/logprob_diff_max
    < 1e-4 here) and the ratios, losses and gradient with it, far inside rel 1e-3. The entropy is
    then each token's entropy at its (only) update forward: recompute's entropy after the update,
    `train/entropy + entropy/measured_change`."""
    import torch

    from aspo_lit.training.module import ASPOModule
    from tests.helpers.tolerance import rounding_tol

    policy_passes = []
    real = ASPOModule._logprobs

    def logprobs(module, model, *args, **kwargs):
        policy_passes.append(model is module.policy and not torch.is_grad_enabled())
        return real(module, model, *args, **kwargs)

    monkeypatch.setattr(ASPOModule, "_logprobs", logprobs)
    assert main(fit_args(testbed, tmp_path, "recompute", 2)) == 0
    assert any(policy_passes)
    policy_passes.clear()
    assert main(fit_args(testbed, tmp_path, "sampler", 2, "--model.old_logprobs=sampler")) == 0
    assert policy_passes and not any(policy_passes), "a policy pass ran before the update"
    (recompute,), (sampler,) = (deterministic_part(read_metrics(tmp_path / n)).values() for n in ("recompute", "sampler"))
    assert recompute["rollout/logprob_diff_max"] < 1e-4
    assert 0 < sampler["rollout/logprob_diff_max"] < 1e-4  # measured on the first mini-batch's tokens
    assert sampler["entropy/measured_change"] == 0.0
    gap = max(recompute["rollout/logprob_diff_max"], sampler["rollout/logprob_diff_max"])
    # the same tokens' entropies at their update forwards, whose weights differ only through the first
    # mini-batch's ratios (moved by <= gap, as below: abs 2·gap); the logged fp32 terms and their sum: 3 roundings
    assert sampler["train/entropy"] == pytest.approx(recompute["train/entropy"] + recompute["entropy/measured_change"],
                                                     rel=rounding_tol(torch.float32, 3), abs=2 * gap)
    exact = {k for k in recompute if k.startswith(("batch/", "train/reward", "response/"))}
    assert exact and all(sampler[k] == recompute[k] for k in exact)  # the same samples
    # the first mini-batch's ratio is π_θ / π_sampler, 1 only up to the gap: more tokens "moved"
    assert sampler["ratio/off_policy_share"] >= recompute["ratio/off_policy_share"]
    close = {k for k in recompute if k.startswith(("train/", "ratio/", "clip/"))} - exact - {
        "train/entropy", "ratio/off_policy_share"}
    assert {"train/pg_loss", "train/kl", "train/grad_norm", "ratio/pos_mean"} <= close
    # each term is linear in a ratio that moves by at most exp(gap) - 1 ≈ gap: |Δ| ≤ max|A|·gap (|A| <= 1.5
    # in a group of 4); rel 1e-3 for the gradient norm, whose terms are products of such moved terms
    for key in close:
        assert sampler[key] == pytest.approx(recompute[key], rel=1e-3, abs=2 * gap), key


@pytest.mark.numerics
def test_share_prompt_keeps_the_metrics_with_fewer_tokens(testbed, tmp_path, monkeypatch):
    """`model.share_prompt` (aspo_lit/training/forward.py, "Shared prompts"): over one rollout batch of two
    epochs x two mini-batches, each split into several micro-batches, the policy and reference
    forwards compute each prompt once per mini-batch (per batch before the update) and the
    metrics equal the row-by-row run's to rounding."""
    import torch

    from aspo_lit.training.module import ASPOModule
    from tests.helpers.tolerance import rounding_tol

    seen = {}

    real_configure = ASPOModule.configure_model

    def configure_model(module):
        real_configure(module)
        for model in (module.policy, module.ref_policy):
            model.get_input_embeddings().register_forward_hook(
                lambda m, i, o: seen.__setitem__(run, seen.get(run, 0) + i[0].numel()))

    monkeypatch.setattr(ASPOModule, "configure_model", configure_model)
    args = ("--model.ppo_epochs=2", "--model.max_tokens_per_micro_batch=300")  # 2-4 micro-batches a mini-batch
    for run in ("rows", "shared"):
        extra = (f"--model.share_prompt={run == 'shared'}".lower(),)  # the testbed config has it on
        assert main(fit_args(testbed, tmp_path, run, 4, *args, *extra)) == 0
    assert seen["shared"] < 0.9 * seen["rows"], seen
    (rows,), (shared,) = (deterministic_part(read_metrics(tmp_path / n)).values() for n in ("rows", "shared"))
    assert rows.keys() == shared.keys()
    exact = {k for k in rows if k.startswith(("batch/", "train/reward", "response/"))}
    assert exact and all(shared[k] == rows[k] for k in exact)  # the same samples
    close = {k for k in rows if k.startswith(("train/", "ratio/", "clip/", "entropy/", "rollout/"))} - exact
    assert {"train/pg_loss", "train/kl", "train/grad_norm", "train/entropy", "ratio/pos_mean"} <= close
    assert any(shared[k] != rows[k] for k in close)  # other bits: the option is on
    # The shared-prompt forward is as accurate as the row-by-row one (tests/unit/test_shared_prompt.py, against
    # float64); the two differ as two fp32 evaluations of the same log-probs do. This run measures that
    # itself: rollout/logprob_diff_max, the sampler's (prefill + one-token steps) against the policy's log-probs.
    # Each metric is a mean of terms at most linear in a token's log-prob or entropy with slope <= 2 (ratios
    # move by exp(gap) - 1 ≈ gap, |A| <= 2 in a group of 4), hence abs 2·gap; a mean in another order adds rel γ_16.
    gap = max(rows["rollout/logprob_diff_max"], shared["rollout/logprob_diff_max"])
    assert 0 < gap < 1e-4
    for key in close:
        assert shared[key] == pytest.approx(rows[key], rel=rounding_tol(torch.float32, 16), abs=2 * gap), key


def test_sampler_old_logprobs_refuse_rollout_is_cap():
    from aspo_lit.training.module import ASPOModule

    with pytest.raises(ValueError, match="rollout_is_cap"):
        ASPOModule(model_name_or_path="testbed", old_logprobs="sampler", rollout_is_cap=2.0)
    with pytest.raises(ValueError, match="old_logprobs must be one of recompute, sampler"):
        ASPOModule(model_name_or_path="testbed", old_logprobs="engine")


def _launch(args: list[str], cwd: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")  # one thread, as the fits it is compared with
    return subprocess.Popen([sys.executable, "-m", "aspo_lit", *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.fixture(scope="module")
def interrupted(testbed, tmp_path_factory) -> SimpleNamespace:
    """An uninterrupted run's metrics (``reference``), and a run of the same config that Ctrl-C
    stopped after its first steps: its experiment folder ``root / "cut"`` (metrics, last.ckpt)."""
    root, steps = tmp_path_factory.mktemp("interrupted"), 8
    with torch_threads(1):
        assert main(fit_args(testbed, root, "full", steps)) == 0
    reference = deterministic_part(read_metrics(root / "full"))

    proc = _launch(fit_args(testbed, root, "cut", steps), REPO)
    deadline = time.time() + 300
    last = root / "cut" / "checkpoints" / "last.ckpt"
    while not last.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    assert last.exists(), proc.communicate()[0][-3000:]
    proc.send_signal(signal.SIGINT)  # lands somewhere inside the next step
    output = proc.communicate(timeout=300)[0]
    assert "saved" in output and "last.ckpt" in output, output[-3000:]
    done_before = deterministic_part(read_metrics(root / "cut"))
    assert 0 < len(done_before) < steps // 2, f"interrupted too late: {sorted(done_before)}"
    assert (root / "cut" / "version_0" / "metrics.csv").exists()
    return SimpleNamespace(root=root, steps=steps, reference=reference, last=last)


def _resume_a_copy(testbed, interrupted, save_dir: Path, edit_checkpoint=None) -> dict[int, dict[str, float]]:
    """Resume a copy of the interrupted run (its checkpoint first changed by ``edit_checkpoint``, a
    function of the checkpoint's path) with ``--ckpt_path last``; its metrics, merged over versions."""
    shutil.copytree(interrupted.root / "cut", save_dir / "cut")
    if edit_checkpoint is not None:
        edit_checkpoint(save_dir / "cut" / "checkpoints" / "last.ckpt")
    assert main(fit_args(testbed, save_dir, "cut", interrupted.steps, "--ckpt_path", "last")) == 0
    return deterministic_part(read_metrics(save_dir / "cut"))


def _assert_same_run(resumed, reference) -> None:
    assert sorted(resumed) == sorted(reference)
    for step in sorted(reference):
        # the same computation on the same kernels from the restored state: the same bits (measured so)
        assert resumed[step] == reference[step], (step, {k: (v, reference[step].get(k)) for k, v in resumed[step].items()
                                                         if v != reference[step].get(k)})


def test_interrupt_then_resume_matches_uninterrupted(testbed, interrupted, tmp_path, one_thread):
    """Ctrl-C mid-run saves last.ckpt after the current step; `--ckpt_path last` continues exactly,
    ``train/kl`` included: the checkpoint leaves the frozen reference out and the resumed run
    rebuilds it from the base model (aspo_lit.training.kl_reference)."""
    assert all("train/kl" in row for row in interrupted.reference.values())
    _assert_same_run(_resume_a_copy(testbed, interrupted, tmp_path), interrupted.reference)


def _reference_weights(testbed) -> dict:
    """What the module held as its reference: the base weights, in model.torch_dtype (float32 here)."""
    from aspo_lit.training.models import load_policy

    return load_policy(testbed, "float32").state_dict()


def test_checkpoint_leaves_out_the_reference(testbed, interrupted, tmp_path):
    """The checkpoint of a run with a KL term holds the policy's tensors and no reference's, and is
    smaller than the same checkpoint with them by at least the reference's bytes."""
    import torch

    checkpoint = torch.load(interrupted.last, map_location="cpu", weights_only=False)
    assert checkpoint["hyper_parameters"]["kl_coef"] > 0  # the run has a reference
    base = _reference_weights(testbed)
    assert set(checkpoint["state_dict"]) == {f"policy.{name}" for name in base}
    checkpoint["state_dict"].update({f"ref_policy.{name}": t for name, t in base.items()})  # as one written before
    torch.save(checkpoint, tmp_path / "with_reference.ckpt")
    reference_bytes = sum(t.numel() * t.element_size() for t in base.values())
    size, with_reference = interrupted.last.stat().st_size, (tmp_path / "with_reference.ckpt").stat().st_size
    assert size <= with_reference - reference_bytes, (size, with_reference, reference_bytes)


def test_checkpoint_with_the_reference_still_resumes(testbed, interrupted, tmp_path, one_thread):
    """A checkpoint written while the reference was saved (``ref_policy.*`` keys) resumes like the
    uninterrupted run: those keys are ignored (here they are not the base's weights, which a loaded
    reference would show in train/kl) and the reference rebuilt from the base model."""
    import torch

    def add_reference(path: Path) -> None:
        checkpoint = torch.load(path, map_location="cpu", weights_only=False)
        checkpoint["state_dict"].update({f"ref_policy.{name}": t + 0.5 for name, t in _reference_weights(testbed).items()})
        torch.save(checkpoint, path)

    _assert_same_run(_resume_a_copy(testbed, interrupted, tmp_path, add_reference), interrupted.reference)


@pytest.mark.slow
def test_heldout_accuracy_rises(testbed, tmp_path):
    """A short ASPO run on the testbed improves held-out avg@4 over the starting model."""
    common = ("--data.init_args.num_val=64", "--trainer.val_check_interval=30", "--data.init_args.batch_size=16",
              "--data.init_args.group_size=8", "--model.mini_batch_size=8")
    base = fit_args(testbed, tmp_path, "base", 60, *common)
    assert main(["validate", *base[1:]]) == 0
    assert main(fit_args(testbed, tmp_path, "learn", 60, *common)) == 0

    def accuracy(name):
        rows = read_metrics(tmp_path / name)
        return [row["val/avg@4"] for _, row in sorted(rows.items()) if "val/avg@4" in row]

    start, during = accuracy("base"), accuracy("learn")
    # 60 optimizer steps at 2 per rollout batch = 30 batches: the untrained policy's evaluation at
    # step 0 (ValBeforeTrain), the same number `validate` gives for it, and one after batch 30
    assert len(start) == 1 and len(during) == 2
    assert during[0] == start[0]
    assert during[-1] > start[0] + 0.03, (start, during)


def _debug_diff(a, b):
    return {s: {k: (a[s][k], b[s].get(k)) for k in a[s] if a[s][k] != b[s].get(k)} for s in a}
