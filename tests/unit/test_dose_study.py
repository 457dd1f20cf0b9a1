"""The dose-response study's policy, runs and analysis (`experiments.dose_policy`,
`experiments.dose_study`, `experiments.dose_analysis`): the exact outcomes against sampling, a seed's
run the same alone and among others, the counterfactual's zero where the flip changes nothing, the
flip's share as the callback logs it, and the analysis's verdicts on synthetic outcomes with planted
effects."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from aspo_lit.callbacks import CounterfactualWeights
from aspo_lit.maths.step import StepOutput
from experiments import dose_analysis as analysis
from experiments import dose_policy as policy
from experiments import dose_study as study


def test_exact_outcome_matches_sampling():
    # a table whose rows differ with the previous token, so the chain rule matters
    logits = policy.initial_logits([0, 1]) + torch.randn(2, policy.T, policy.V, policy.V, dtype=torch.float64,
                                                         generator=torch.Generator().manual_seed(1))
    draws = 40_000
    tokens = policy.sample(logits, torch.rand(2, draws, policy.T, generator=torch.Generator().manual_seed(0),
                                              dtype=torch.float64))
    reward = policy.rewards(tokens).mean(1)
    exact = policy.outcome(logits)
    se = torch.sqrt(exact["reward"] * (1 - exact["reward"]) / draws)
    assert ((reward - exact["reward"]).abs() <= 5 * se).all(), (reward, exact["reward"])
    _, entropy = policy.token_logprobs(logits, tokens)
    fork = entropy[:, :, list(policy.FORKS)].mean((1, 2))
    fork_se = entropy[:, :, list(policy.FORKS)].mean(-1).std(1) / math.sqrt(draws)
    assert ((fork - exact["fork_entropy"]).abs() <= 5 * fork_se).all()
    filler = [t for t in range(policy.T) if t not in policy.FORKS]
    filler_se = entropy[:, :, filler].mean(-1).std(1) / math.sqrt(draws)
    assert ((entropy[:, :, filler].mean((1, 2)) - exact["filler_entropy"]).abs() <= 5 * filler_se).all()
    assert float(fork_se.min()) > 0 and float(filler_se.min()) > 0
    start = policy.outcome(policy.initial_logits([0]))
    assert float(start["filler_entropy"][0]) == pytest.approx(math.log(policy.V), rel=1e-12)
    assert float(policy.pattern_probs(logits).flatten(1).sum(-1).sub(1).abs().max()) < 1e-12


def test_a_seed_runs_the_same_alone_and_among_others():
    alone = study.run_arm("aspo", 2, 0.03, [3], 4, counterfactual=True)
    among = study.run_arm("aspo", 2, 0.03, [5, 3], 4, counterfactual=True)
    for key, rows in alone["record"].items():
        a, b = np.array(rows)[:, 0], np.array(among["record"][key])[:, 1]
        assert np.allclose(a, b, rtol=1e-9, atol=1e-12, equal_nan=True), key
    other = study.run_arm("aspo", 2, 0.03, [5], 4, counterfactual=False)
    assert not np.allclose(np.array(other["record"]["fork_entropy"])[-1], np.array(alone["record"]["fork_entropy"])[-1])


def test_the_true_gap_is_zero_when_the_flip_changes_nothing(monkeypatch):
    """One epoch of one mini-batch: every token is updated on-policy (r ≡ 1), where GRPO's r and
    ASPO's 1/r are both 1: the same update, so the counterfactual's true gap is 0 (to rounding), while
    with 4 mini-batches it is not."""
    monkeypatch.setattr(study, "MINI_BATCHES", 1)
    result = study.run_arm("grpo", 1, 0.05, [0, 1], 3, counterfactual=True)
    true = np.array(result["record"]["gap_true"][1:])
    assert np.abs(true).max() < 1e-9
    assert np.nanmax(np.array(result["flip_share_mean"])) == 0.0
    monkeypatch.setattr(study, "MINI_BATCHES", 4)
    result = study.run_arm("grpo", 2, 0.05, [0, 1], 3, counterfactual=True)
    assert np.abs(np.array(result["record"]["gap_true"][1:])).max() > 1e-6


def test_flip_share_is_the_callbacks_weight_change():
    seeds = [0]
    logits = policy.initial_logits(seeds).requires_grad_(True)
    optimizer = torch.optim.Adam([logits], lr=0.05)
    batch = study.rollout(logits, seeds, 0, 2)
    logprobs, entropy = study.update(logits, optimizer, study.get_policy_loss("grpo"), batch)
    share = float(study.flip_share(batch, logprobs)[0])
    mask = torch.ones(study.BATCH, policy.T)
    step = StepOutput(response_mask=mask, old_logprobs=batch.old_logprobs[0].float(), entropy=batch.old_entropy[0].float(),
                      logprobs=logprobs[0].float(), ratio=mask, updated_entropy=entropy[0].float(), token_weight=mask,
                      advantages=batch.advantages[0].float(), rewards=torch.zeros(study.BATCH),
                      response_lengths=torch.full((study.BATCH,), policy.T), truncated=torch.zeros(study.BATCH, dtype=torch.bool),
                      texts=[""] * study.BATCH)
    logged = float(CounterfactualWeights().compute(None, None, step)["flip/weight_change"])
    assert share > 0.01
    assert share == pytest.approx(logged, rel=1e-5)      # float64 here, the step's fp32 log-probs there


def test_doses_get_the_same_step_budget():
    assert [study.batches_for(e, lr) for e, lr in study.DOSES] == [round(study.BUDGET / (e * lr)) for e, lr in study.DOSES]
    assert study.checkpoints(7) == [0, 1, 2, 3, 4, 5, 6, 7]
    marks = study.checkpoints(1200)
    assert marks[0] == 0 and marks[-1] == 1200 and len(marks) == study.CHECKPOINTS + 1


# --------------------------------------------------------------------------- the analysis, on synthetic outcomes
SHARES = (0.003, 0.006, 0.018, 0.036, 0.09, 0.16)


def synthetic(tmp_path, gap_of_share, seeds=50, estimate_noise=None, pooled_offset=0.0, world=0):
    """Runs on disk whose ASPO − GRPO fork-entropy gap is ``gap_of_share(share)`` + N(0, 0.01) per
    seed; GRPO's true gaps random, the state-centred estimates = true + noise, the pooled ones =
    offset + noise."""
    rng = np.random.default_rng(world)
    for k, share in enumerate(SHARES):
        folder = tmp_path / f"d{k}"
        folder.mkdir()
        base = rng.uniform(0.2, 1.0, seeds)
        true = rng.normal(0, 1e-4, (3, seeds))
        for arm in ("grpo", "aspo", "grpo_no_is"):
            final = base + (gap_of_share(share) + rng.normal(0, 0.01, seeds) if arm == "aspo" else 0.0)
            record = {q: [[math.nan] * seeds, list(final * 1.5), list(final)]
                      for q in ("fork_entropy", "filler_entropy", "reward", "modes_kept")}
            noise = estimate_noise if estimate_noise is not None else 1e-5
            record |= {"gap_true": [[math.nan] * seeds, *true[1:].tolist()],
                       "gap_state_old": [[math.nan] * seeds, *(true[1:] + rng.normal(0, noise, (2, seeds))).tolist()],
                       "gap_state": [[math.nan] * seeds, *(true[1:] + rng.normal(0, noise, (2, seeds))).tolist()],
                       "gap_pooled": [[math.nan] * seeds, *(pooled_offset + rng.normal(0, 1e-4, (2, seeds))).tolist()]}
            (folder / f"{arm}.json").write_text(json.dumps(
                {"arm": arm, "epochs": 1, "lr": share, "seeds": list(range(seeds)), "batches": 2,
                 "checkpoints": [0, 1, 2], "record": record, "flip_share_mean": [share] * seeds}))
    return analysis.load(tmp_path)


def outcomes(doses):
    return {pid: outcome for pid, _, _, outcome in analysis.predictions(doses)}


def test_second_order_world(tmp_path):
    doses = synthetic(tmp_path, lambda s: 0.1 if s >= 0.1 else 0.0, pooled_offset=3e-4)
    assert [round(d.flip_share, 3) for d in doses] == list(SHARES)
    assert outcomes(doses) == {"P1": "not confirmed", "P2": "confirmed", "P3": "confirmed", "P4": "confirmed",
                               "P5": "confirmed", "P6": "confirmed"}
    text = analysis.render(doses, tmp_path)
    assert "**equivalent**" in text and "**ASPO higher**" in text


def test_paper_world(tmp_path):
    doses = synthetic(tmp_path, lambda s: 2 * s)
    assert outcomes(doses) | {"P5": None, "P6": None} == {"P1": "confirmed", "P2": "confirmed", "P3": "not confirmed",
                                                         "P4": "confirmed", "P5": None, "P6": None}


def test_null_world_and_a_useless_estimator(tmp_path):
    """No gap anywhere: P3 holds and P1 (four doses at once) fails in every null world; P2 (a
    one-sided 5 % test) and P4 (one dose's 95 % CI) are confirmed in about 1 world in 20: at most 6
    of 40 (binomial tail 0.003); a noise estimate ranks nothing."""
    confirmed = {"P2": 0, "P4": 0}
    for world in range(40):
        (tmp_path / str(world)).mkdir()
        got = outcomes(synthetic(tmp_path / str(world), lambda s: 0.0, estimate_noise=1.0, world=world))
        assert (got["P1"], got["P3"]) == ("not confirmed", "confirmed"), world
        for pid in confirmed:
            confirmed[pid] += got[pid] == "confirmed"
        if world < 5:
            assert got["P6"] == "not confirmed", world
    assert max(confirmed.values()) <= 6, confirmed


def test_paired_verdicts_and_slope_by_hand():
    assert analysis.paired(np.array([1.0, 1.1, 0.9]), np.zeros(3)).verdict == "ASPO higher"
    assert analysis.paired(-np.array([1.0, 1.1, 0.9]), np.zeros(3)).verdict == "ASPO lower"
    assert analysis.paired(np.array([1e-3, -1e-3, 0.0, 2e-3]), np.zeros(4)).verdict == "equivalent"
    assert analysis.paired(np.array([0.5, -0.5, 0.4, -0.3]), np.zeros(4)).verdict == "inconclusive"
