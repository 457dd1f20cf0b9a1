"""Bounded-staleness rollouts (``data.max_staleness``; docs/staleness.md): the engine process, the
schedule replayed sequentially, SIGTERM with rollouts in flight, a killed engine process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from lightning.pytorch import Callback

from aspo_lit.data.sources import PromptBatches
from aspo_lit.maths.seeding import derived_seed
from aspo_lit.rollout import SamplingConfig, build_engine
from aspo_lit.rollout.process import EngineProcess, EngineProcessError
from tests.helpers.tolerance import torch_threads

pytestmark = pytest.mark.multiproc

REPO = Path(__file__).resolve().parents[2]
PROBE = "tools.rehearsal.probe.RehearsalProbe"
UPDATES_PER_BATCH = 2   # batch_size 8 / mini_batch_size 4 below


def test_prompt_batches_give_any_counters_batch_ahead_of_the_loop():
    rows = [{"id": i} for i in range(10)]
    batches = PromptBatches(rows, batch_size=3, seed=5)
    walked, counters = [], []
    for _ in range(3):                     # three epochs of 3 batches (drop_last: 1 row left each)
        for batch in batches:
            walked.append(batch)
            counters.append(batches.mark_consumed())
    assert counters == list(range(1, 10))
    fresh = PromptBatches(rows, batch_size=3, seed=5)
    assert [fresh.batch(c) for c in counters] == walked
    assert walked[0] != walked[3]          # another epoch, another order
    with pytest.raises(ValueError, match="start at 1"):
        fresh.batch(0)


def _sampling(seed: int) -> SamplingConfig:
    return SamplingConfig(temperature=1.0, max_tokens=24, seed=seed, logprobs=True)


def _scaled(state: dict, factor: float) -> dict:
    return {n: t * factor if t.is_floating_point() else t for n, t in state.items()}


def test_engine_process_generates_each_request_with_the_weights_sent_before_it(testbed):
    """Requests are served in order: a request queued after a push samples exactly those weights (a
    run of the same engine in this process with them gives the same tokens), results can be taken
    in any order, and each says the version that made it."""
    from transformers import AutoModelForCausalLM

    state = dict(AutoModelForCausalLM.from_pretrained(testbed).state_dict())
    prompts = [[1, 5, 6, 7], [1, 8, 9]]
    process = EngineProcess(build_engine("hf"), testbed, threads=1).start()
    try:
        process.push(0, state)
        process.submit(1, prompts, 3, _sampling(11))
        process.push(1, _scaled(state, 0.5))
        process.submit(2, prompts, 3, _sampling(12))
        late = process.result(2)
        early = process.result(1)
    finally:
        process.close()
    assert (early[0], late[0]) == (0, 1)
    local = build_engine("hf")
    local.attach(None, None, testbed)
    with torch_threads(1):
        for version, sent, result, seed in ((0, state, early, 11), (1, _scaled(state, 0.5), late, 12)):
            local.update_weights(sent)
            expected = local.generate(prompts, n=3, sampling=_sampling(seed))
            assert [[c.token_ids for c in g] for g in result[1]] == [[c.token_ids for c in g] for g in expected], version
    assert [[c.token_ids for c in g] for g in early[1]] != [[c.token_ids for c in g] for g in late[1]]


@pytest.mark.vllm
def test_the_vllm_engine_serves_the_engine_process(testbed):
    """The engine process with vLLM (as the testbed's engine tests build it): a push reaches the
    engine in order (weights scaled by 0.5 sample other tokens; the first weights pushed again give
    the first tokens again, same seed)."""
    pytest.importorskip("vllm")
    from transformers import AutoModelForCausalLM

    from aspo_lit.rollout.vllm import VLLMEngine

    state = dict(AutoModelForCausalLM.from_pretrained(testbed).state_dict())
    prompts = [[1, 5, 6, 7], [1, 8, 9]]
    process = EngineProcess(VLLMEngine(kv_cache_gb=1, block_size=32, seed=0, per_request_seed=True), testbed,
                            threads=1).start()
    try:
        for version, weights, ticket in ((0, state, 1), (1, _scaled(state, 0.5), 2), (2, state, 3)):
            process.push(version, weights)
            process.submit(ticket, prompts, 3, _sampling(11))
        first, scaled, again = (process.result(t) for t in (1, 2, 3))
    finally:
        process.close()
    assert (first[0], scaled[0], again[0]) == (0, 1, 2)
    tokens = [[[c.token_ids for c in g] for g in r[1]] for r in (first, scaled, again)]
    assert tokens[0] == tokens[2] != tokens[1]


def test_a_killed_engine_process_is_an_error_not_a_hang(testbed):
    process = EngineProcess(build_engine("hf"), testbed, threads=1).start()
    try:
        os.kill(process.pid, signal.SIGKILL)
        process.submit(1, [[1, 5]], 2, _sampling(0))
        start = time.monotonic()
        with pytest.raises(EngineProcessError, match="killed by signal 9"):
            process.result(1)
        assert time.monotonic() - start < 10
    finally:
        process.close()


# -- fits ---------------------------------------------------------------------------------------


class KillEngineProcess(Callback):
    """Kills rank ``rank``'s engine process with SIGKILL at the end of rollout batch ``at``."""

    def __init__(self, at: int = 0, rank: int = 0) -> None:
        self.at, self.rank = at, rank

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        process = trainer.datamodule.controller.engine_process
        if batch_idx == self.at and trainer.global_rank == self.rank and process is not None:
            os.kill(process.pid, signal.SIGKILL)
            process.process.join(10)


def _fit(testbed: str, save_dir: Path, name: str, batches: int, *extra: str, timeout: int = 600):
    args = ["fit", "--config", str(REPO / "conf/tiny/aspo.yaml"), f"--model.model_name_or_path={testbed}",
            f"--trainer.max_steps={batches * UPDATES_PER_BATCH}", f"--trainer.logger.init_args.save_dir={save_dir}",
            f"--trainer.logger.init_args.name={name}", "--trainer.enable_progress_bar=false",
            "--data.init_args.batch_size=8", "--data.init_args.group_size=4", "--data.init_args.num_val=0",
            "--data.init_args.max_response_length=24", "--model.mini_batch_size=4",
            "--data.init_args.max_staleness=1", "--data.init_args.engine_threads=1", *extra]
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "aspo_lit", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


def _probe(out: Path, **options) -> list[str]:
    return [f"--trainer.callbacks+={PROBE}", f"--trainer.callbacks.init_args.out_dir={out}",
            *(f"--trainer.callbacks.init_args.{k}={v}" for k, v in options.items())]


def _rollouts(*probe_dirs: Path) -> dict[int, dict]:
    """global step -> the rollout batch trained there (RehearsalProbe's files)."""
    out = {}
    for folder in probe_dirs:
        for path in sorted((folder / "rollouts").glob("step*_rank0.pt")):
            out[int(path.stem[4:10])] = torch.load(path, weights_only=False)
    return out


def _prompts_and_responses(batch: dict, group_size: int) -> tuple[list[list[int]], list[list[int]]]:
    P = batch["prompt_length"]
    ids, mask = batch["input_ids"], batch["attention_mask"]
    prompts = [ids[r, :P][mask[r, :P].bool()].tolist() for r in range(0, len(ids), group_size)]
    responses = [ids[r, P:P + int(batch["response_lengths"][r])].tolist() for r in range(len(ids))]
    return prompts, responses


def _metrics(run: Path) -> dict[int, dict[str, str]]:
    import csv

    rows: dict[int, dict[str, str]] = {}
    for path in sorted(run.glob("version_*/metrics.csv")):
        with path.open() as f:
            for row in csv.DictReader(f):
                rows.setdefault(int(row["step"]), {}).update({k: v for k, v in row.items() if v})
    return rows


@pytest.fixture(scope="module")
def uninterrupted(testbed, tmp_path_factory) -> Path:
    """A 4-batch fit at k = 1 with the probe's rollouts and weight snapshots (``<root>/probe``)."""
    root = tmp_path_factory.mktemp("k1")
    proc = _fit(testbed, root, "k1", 4, *_probe(root / "probe"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root


def test_staleness_one_replays_sequentially_with_the_weights_each_batch_had(testbed, uninterrupted):
    """k = 1 on the fixed schedule: batch b (from 1) is sampled by the policy after max(0, b - 2)
    batches. Regenerating each batch in this process, with those weights (the probe's snapshot before
    that batch's first optimizer step) and the synchronous loop's seed, gives the same tokens."""
    run = uninterrupted / "k1"
    config = yaml.safe_load((run / "version_0" / "config.yaml").read_text())
    seed, data = config["seed_everything"], config["data"]["init_args"]
    metrics = _metrics(run)
    rollouts = _rollouts(uninterrupted / "probe")
    assert sorted(rollouts) == [0, 2, 4, 6]
    weights = sorted((uninterrupted / "probe" / "weights").glob("*.pt"))
    engine = build_engine("hf")
    engine.attach(None, None, testbed)
    with torch_threads(1):
        for b, step in enumerate(sorted(rollouts), start=1):
            version = max(0, b - 2)
            row = metrics[b - 1]   # a logged step is a rollout batch
            assert float(row["rollout/policy_version"]) == version and float(row["rollout/staleness"]) == b - 1 - version
            prompts, responses = _prompts_and_responses(rollouts[step], data["group_size"])
            engine.update_weights(torch.load(weights[version * UPDATES_PER_BATCH]))
            sampling = SamplingConfig(temperature=data["temperature"], top_p=data["top_p"],
                                      max_tokens=data["max_response_length"], stop=data["stop"],
                                      seed=derived_seed(seed, b), logprobs=True)
            regenerated = engine.generate(prompts, n=data["group_size"], sampling=sampling)
            assert [c.token_ids for g in regenerated for c in g] == responses, f"batch {b}"


def test_sigterm_with_rollouts_in_flight_then_resume_loses_and_repeats_no_batch(testbed, uninterrupted, tmp_path):
    """SIGTERM while batch 3 is being generated ahead: last.ckpt after batch 2; the resume trains
    batches 3 and 4 on the uninterrupted run's prompts (none lost, none twice), its pipeline refilled
    from the restored weights (batch 3's staleness 0)."""
    cut = _fit(testbed, tmp_path, "cut", 4, *_probe(tmp_path / "probe_cut", sigterm_at_batch=1))
    assert cut.returncode == 0 and "saved" in cut.stderr + cut.stdout, (cut.stdout + cut.stderr)[-3000:]
    assert sorted(_rollouts(tmp_path / "probe_cut")) == [0, 2]
    resumed = _fit(testbed, tmp_path, "cut", 4, *_probe(tmp_path / "probe_resumed"), "--ckpt_path", "last")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    reference, pieces = _rollouts(uninterrupted / "probe"), _rollouts(tmp_path / "probe_cut", tmp_path / "probe_resumed")
    assert sorted(pieces) == sorted(reference) == [0, 2, 4, 6]
    for step in reference:
        assert _prompts_and_responses(pieces[step], 4)[0] == _prompts_and_responses(reference[step], 4)[0], step
    after = _metrics(tmp_path / "cut")   # logged per rollout batch
    assert float(after[2]["rollout/staleness"]) == 0.0 and float(after[2]["rollout/policy_version"]) == 2.0
    assert float(after[3]["rollout/staleness"]) == 1.0


def test_which_ratio_the_flip_acts_on_in_each_mode():
    """With stale samples, two policies stand behind a token: the behaviour policy that sampled it
    (its log-prob: the engine's, ``rollout_logprobs``) and the proximal one at the start of the
    update (the trainer's recomputed log-prob). ``old_logprobs: sampler`` (coupled): ASPO's flip
    acts on r = π / π_behav, so an A > 0 token weighs π_behav / π. ``old_logprobs: recompute`` with
    ``rollout_is_cap`` (decoupled, AReaL): the flip acts on r = π / π_prox, and the token's advantage
    is scaled by min(π_prox / π_behav, cap). Hand computation against the module's composition
    (`truncated_is_weights` on the advantage, then the loss)."""
    from aspo_lit.maths.losses import effective_token_weight, get_policy_loss
    from aspo_lit.maths.sampler_mismatch import truncated_is_weights

    aspo = get_policy_loss("aspo", eps_low=0.2, eps_high=0.2, dual_clip=3.0, loss_agg="token-mean")
    lp = torch.tensor([[-1.00, -2.00, -0.50]])      # π (current)
    prox = torch.tensor([[-1.05, -1.90, -0.40]])    # π_prox: the policy at the start of the update
    behav = torch.tensor([[-1.15, -1.85, -0.65]])   # π_behav: the version that sampled the tokens
    adv = torch.tensor([1.0])                       # A > 0 (the flip's side)
    mask = torch.ones(1, 3, dtype=torch.bool)
    # coupled: r = π / π_behav (all inside [1 - ε, 1 + ε]); ASPO's A > 0 weight is 1 / r
    coupled = effective_token_weight(aspo, lp, behav, adv, mask)
    torch.testing.assert_close(coupled, torch.exp(behav - lp), rtol=1e-6, atol=0)
    # decoupled: the flip on π / π_prox, times the truncated behaviour weight (cap 1.2 binds on token 3)
    cap = 1.2
    tis = truncated_is_weights(prox, behav, cap)
    torch.testing.assert_close(tis, torch.exp(prox - behav).clamp(max=cap), rtol=1e-6, atol=0)
    decoupled = effective_token_weight(aspo, lp, prox, adv[:, None] * tis, mask) * tis
    torch.testing.assert_close(decoupled, torch.exp(prox - lp) * torch.exp(prox - behav).clamp(max=cap), rtol=1e-6, atol=0)
    assert not torch.allclose(coupled, decoupled)


def test_the_staleness_studys_arms_are_its_protocols(capsys):
    """`make study-staleness` (docs/studies/staleness-protocol.md): GRPO and ASPO at k = 0, 1, 2, 4 on seeds 6-8
    (outside study v2's and the mechanism check's), 20 rollout batches, the sampler's log-probs as
    π_old, one engine thread; each arm in its own folder. Read through the study's own dry run."""
    from aspo_lit.__main__ import main
    from experiments import study as S

    runs, folders = [], set()
    for arm in (None, "staleness_k1", "staleness_k2", "staleness_k4"):
        configs = ["conf/study/staleness.yaml"] + ([f"conf/study/{arm}.yaml"] if arm else [])
        assert main(["study", *[w for c in configs for w in ("--config", str(REPO / c))], "--dry_run", "true"]) == 0
        commands = [line.split() for line in capsys.readouterr().out.splitlines() if not line.startswith("#")]
        assert commands and all(argv[3] == "fit" for argv in commands)

        def value(argv, key):
            return next(a.split("=", 1)[1] for a in argv if a.startswith(f"{key}="))

        for argv in commands:
            assert value(argv, "--model.old_logprobs") == "sampler" and value(argv, "--data.init_args.engine_threads") == "1"
            runs.append((value(argv, "--model.loss"), int(value(argv, "--data.init_args.max_staleness")),
                         int(value(argv, "--seed_everything")), int(value(argv, "--trainer.max_steps"))))
            folders.add(value(argv, "--trainer.logger.init_args.save_dir"))
    assert sorted(runs) == sorted((loss, k, seed, 320) for loss in ("grpo", "aspo") for k in (0, 1, 2, 4) for seed in (6, 7, 8))
    used = set(S.load_study(REPO / "conf/study/v2.yaml").seeds) | set(S.load_study(REPO / "conf/study/mechanism.yaml").seeds)
    assert not used & {6, 7, 8} and len(folders) == 4


def test_two_ranks_each_with_an_engine_process_fail_together_and_resume(testbed, tmp_path):
    """DDP on 2 CPU ranks at k = 1: each rank's engine process generates its share. Rank 1's is
    killed (SIGKILL) after batch 1: both ranks raise `EngineProcessError` (one collective agrees on
    it; rank 0 never waits alone in the next collective), last.ckpt is saved without the batch
    waited for, and the 2-rank resume trains the remaining batches."""
    two = ("--trainer.accelerator=cpu", "--trainer.devices=2", "--trainer.strategy=ddp", "--model.share_prompt=false")
    crashed = _fit(testbed, tmp_path, "ddp", 3, *two,
                   "--trainer.callbacks+=tests.integration.test_staleness.KillEngineProcess",
                   "--trainer.callbacks.init_args.rank=1", timeout=300)
    output = crashed.stdout + crashed.stderr
    assert crashed.returncode != 0 and "killed by signal 9" in output, output[-3000:]
    assert "the rollout engine process of another rank failed" in output, output[-3000:]
    last = tmp_path / "ddp" / "checkpoints" / "last.ckpt"
    assert last.exists(), output[-3000:]
    # killed after batch 1: batch 2 was generated before the kill or not (a race), batch 3 never was;
    # the checkpoint is the state before the first batch waited for in vain, not counted as consumed
    checkpoint = torch.load(last, weights_only=False)
    step = checkpoint["global_step"]
    assert step in (UPDATES_PER_BATCH, 2 * UPDATES_PER_BATCH), step
    assert checkpoint["loops"]["fit_loop"]["state_dict"]["combined_loader"] == [{"epoch": 0, "consumed": step // UPDATES_PER_BATCH}]
    assert f"waited for rollout batch {step // UPDATES_PER_BATCH + 1}" in output, output[-3000:]
    resumed = _fit(testbed, tmp_path, "ddp", 3, *two, "--ckpt_path", "last", timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rows = {s: r for s, r in _metrics(tmp_path / "ddp").items() if "train/reward_mean" in r}
    assert sorted(rows) == [0, 1, 2]
    assert [float(rows[s]["rollout/staleness_max"]) for s in sorted(rows)][-1] <= 1.0
