"""The dose-response study's runs (docs/studies/dose-protocol.md): GRPO, ASPO and GRPO without IS on
the tabular policy of `experiments.dose_policy`, trained with the package's own losses
(`aspo_lit.maths.losses`) and group advantages (`aspo_lit.maths.advantages`, eq. 1) on the
policy's log-probs, paired by seed (the same initial tables, the same uniforms for sampling, the
same mini-batch orders), at doses of PPO epochs × Adam lr.

    make study-dose                       # the protocol's doses and seeds, then the report
    python -m experiments.dose_study --out runs/study_dose [--seeds 50] [--budget 6]
    python -m experiments.dose_study --calibrate     # the flip's share per dose, GRPO only, 5 seeds

Every seed of an arm runs in one set of tensors with a leading seed dimension: the tables, the
samples and Adam's state are per element, and each seed's loss is its own mean (the summed loss is
scaled by the seed count), so a seed's run is the run it would be alone.

Per rollout batch and seed it records the exact outcome after the batch (`dose_policy.outcome`),
the flip's share (``flip/weight_change`` of `aspo_lit.callbacks.CounterfactualWeights`: Σ|w_grpo −
w_aspo| / Σ w_grpo over the A > 0 tokens at their last update), the three first-order estimates of
the GRPO − ASPO entropy-change gap (pooled; state-centred under π_θ and under π_old) and, on the
GRPO arm, the true one-batch effect of the flip: the exact change of the mean entropy over the
batch's states under GRPO's update minus under ASPO's update from the same tables, optimizer state,
samples and mini-batch order.
"""

from __future__ import annotations

import argparse
import copy
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from aspo_lit.maths.advantages import group_advantages
from aspo_lit.maths.counterfactual import (
    covariance_sums,
    entropy_change,
    share,
    state_centred_entropy_change,
    state_centred_sums,
    token_weights,
)
from aspo_lit.maths.losses import PolicyLoss, get_policy_loss
from experiments import dose_policy as policy

ARMS = ("grpo", "aspo", "grpo_no_is")
GROUP, GROUPS, MINI_BATCHES = 8, 16, 4
BATCH = GROUP * GROUPS
# (PPO epochs, Adam lr): fixed by the calibration recorded in docs/studies/dose-protocol.md
DOSES = ((1, 0.005), (1, 0.01), (1, 0.03), (2, 0.01), (2, 0.03), (4, 0.05))
CANDIDATES = ((1, 0.003), (1, 0.005), (1, 0.01), (1, 0.03), (2, 0.01), (2, 0.03), (4, 0.02), (4, 0.05), (8, 0.05))
BUDGET = 6.0           # lr × epochs × batches of every dose
CHECKPOINTS = 50
CALIBRATION_SEEDS = (1000, 1001, 1002, 1003, 1004)
RECORDED = ("reward", "fork_entropy", "filler_entropy", "modes_kept", "flip_share", "gap_pooled",
            "gap_state", "gap_state_old", "gap_true")


def dose_name(epochs: int, lr: float) -> str:
    return f"e{epochs}_lr{lr:g}"


@dataclass
class Rollout:
    """One rollout batch of every seed: tokens ``[S, B, T]``, advantages ``[S, B]``, π_old's
    log-probs and entropy ``[S, B, T]``, and the mini-batch orders (one row order per epoch)."""
    tokens: Tensor
    advantages: Tensor
    old_logprobs: Tensor
    old_entropy: Tensor
    orders: list[Tensor]


def uniforms(seeds: list[int], batch: int) -> Tensor:
    """``[S, B, T]``: seed ``s``'s sampling uniforms of rollout batch ``batch``, the same in every arm."""
    return torch.stack([torch.rand(BATCH, policy.T, generator=torch.Generator().manual_seed(seed * 100_003 + batch),
                                   dtype=torch.float64) for seed in seeds])


def rollout(logits: Tensor, seeds: list[int], batch: int, epochs: int) -> Rollout:
    tokens = policy.sample(logits, uniforms(seeds, batch))
    rewards = policy.rewards(tokens)
    advantages, _ = group_advantages(rewards.reshape(-1), GROUP)
    with torch.no_grad():
        old_logprobs, old_entropy = policy.token_logprobs(logits, tokens)
    g = torch.Generator().manual_seed(7_919 + batch)
    orders = [torch.randperm(BATCH, generator=g) for _ in range(epochs)]
    return Rollout(tokens, advantages.double().reshape(len(seeds), BATCH), old_logprobs, old_entropy, orders)


def update(logits: Tensor, optimizer: torch.optim.Optimizer, loss_fn: PolicyLoss, batch: Rollout
           ) -> tuple[Tensor, Tensor]:
    """PPO epochs × mini-batches of ``loss_fn`` on ``batch``; returns each token's log π_θ and entropy
    at its last update (the forward before its mini-batch's step in the last epoch)."""
    seeds = logits.shape[0]
    last_logprobs, last_entropy = torch.empty_like(batch.old_logprobs), torch.empty_like(batch.old_entropy)
    mask = torch.ones(seeds * (BATCH // MINI_BATCHES), policy.T)
    for order in batch.orders:
        for rows in order.chunk(MINI_BATCHES):
            logprobs, entropy = policy.token_logprobs(logits, batch.tokens[:, rows])
            loss, _ = loss_fn(logprobs.reshape(-1, policy.T), batch.old_logprobs[:, rows].reshape(-1, policy.T),
                              batch.advantages[:, rows].reshape(-1), mask)
            optimizer.zero_grad(set_to_none=True)
            (loss * seeds).backward()                 # each seed's gradient is its own loss's
            optimizer.step()
            last_logprobs[:, rows], last_entropy[:, rows] = logprobs.detach(), entropy
    return last_logprobs, last_entropy


def state_entropy(logits: Tensor, tokens: Tensor) -> Tensor:
    """``[S]``: the mean entropy of the tables' rows at the batch's states (position, previous token)."""
    rows = policy.table_entropy(logits)                                # [S, T, V]
    s = torch.arange(tokens.shape[0])[:, None, None]
    return rows[s, torch.arange(policy.T)[None, None, :], policy.previous(tokens)].mean((1, 2))


def flip_share(batch: Rollout, logprobs: Tensor) -> Tensor:
    """``[S]``: the flip's share, Σ|w_grpo − w_aspo| / Σ w_grpo over the A > 0 tokens at their last
    update (``flip/weight_change``), from the shipped losses' weights."""
    seeds = logprobs.shape[0]
    weights = _weights(batch, logprobs)
    positive = (batch.advantages > 0)[:, :, None].expand_as(logprobs)
    change = torch.where(positive, (weights["grpo"] - weights["aspo"]).abs(), 0.0).reshape(seeds, -1).sum(-1)
    return share(change, torch.where(positive, weights["grpo"], 0.0).reshape(seeds, -1).sum(-1))


def _weights(batch: Rollout, logprobs: Tensor) -> dict[str, Tensor]:
    seeds = logprobs.shape[0]
    flat = lambda x: x.reshape(seeds * BATCH, -1).float()                # noqa: E731
    losses = {name: get_policy_loss(name) for name in ("grpo", "aspo")}
    return {k: w.double().reshape(seeds, BATCH, policy.T) for k, w in token_weights(
        losses, flat(logprobs), flat(batch.old_logprobs), batch.advantages.reshape(-1).float(),
        torch.ones(seeds * BATCH, policy.T)).items()}


def gap_estimates(batch: Rollout, logprobs: Tensor, entropy: Tensor) -> dict[str, Tensor]:
    """Per seed ``[S]``: the three first-order estimates of the GRPO − ASPO entropy-change gap on
    the batch's tokens, by `aspo_lit.maths.counterfactual`'s functions (what the callback logs)."""
    seeds = logprobs.shape[0]
    weights = _weights(batch, logprobs)
    advantages = batch.advantages[:, :, None].expand_as(logprobs)
    importance = (logprobs - batch.old_logprobs).exp()
    every = torch.ones(BATCH, policy.T, dtype=torch.bool)
    out = {key: torch.empty(seeds, dtype=torch.float64) for key in ("gap_pooled", "gap_state", "gap_state_old")}
    for i in range(seeds):
        change = {}
        for name, w in weights.items():
            y = w[i] * advantages[i]
            change[name] = (entropy_change(covariance_sums(batch.old_logprobs[i], y, every)),
                            state_centred_entropy_change(state_centred_sums(logprobs[i], entropy[i], y, every, importance[i])),
                            state_centred_entropy_change(state_centred_sums(batch.old_logprobs[i], batch.old_entropy[i], y, every)))
        for k, key in enumerate(("gap_pooled", "gap_state", "gap_state_old")):
            out[key][i] = change["grpo"][k] - change["aspo"][k]
    return out


def checkpoints(batches: int) -> list[int]:
    """The batch counts after which a run records its outcome and statistics: 0 (the start) and
    ``CHECKPOINTS`` evenly spaced ones up to ``batches``."""
    return sorted({round(k * batches / CHECKPOINTS) for k in range(CHECKPOINTS + 1)})


def batches_for(epochs: int, lr: float, budget: float = BUDGET) -> int:
    """Rollout batches of a dose: every dose gets the same step budget, Σ lr over its Adam steps /
    mini-batches per epoch (lr × epochs × batches), so a low dose trains as far as a high one."""
    return max(1, round(budget / (lr * epochs)))


def run_arm(arm: str, epochs: int, lr: float, seeds: list[int], batches: int, counterfactual: bool) -> dict:
    """One arm at one dose over ``seeds``: at each of `checkpoints` the exact outcome and, for the
    batch that ended there, the gap estimates and (``counterfactual``) the true gap, ``[C][S]``
    (NaN at the start); ``flip_share_mean``: each seed's mean over the batches that had an A > 0
    token ``[S]``."""
    logits = policy.initial_logits(seeds).requires_grad_(True)
    optimizer = torch.optim.Adam([logits], lr=lr)
    loss_fn, aspo = get_policy_loss(arm), get_policy_loss("aspo")
    nan = torch.full((len(seeds),), float("nan"), dtype=torch.float64)
    marks = checkpoints(batches)
    start = policy.outcome(logits)
    record = {key: [start[key].tolist() if key in start else nan.tolist()] for key in RECORDED}
    share_sum, share_count = (torch.zeros(len(seeds), dtype=torch.float64) for _ in range(2))
    for b in range(batches):
        batch = rollout(logits, seeds, b, epochs)
        marked = b + 1 in marks
        if marked and counterfactual:
            shadow = logits.detach().clone().requires_grad_(True)
            shadow_opt = torch.optim.Adam([shadow], lr=lr)
            shadow_opt.load_state_dict(copy.deepcopy(optimizer.state_dict()))
            before = state_entropy(logits, batch.tokens)
            update(shadow, shadow_opt, aspo, batch)
            aspo_change = state_entropy(shadow, batch.tokens) - before
        logprobs, entropy = update(logits, optimizer, loss_fn, batch)
        shares = flip_share(batch, logprobs)
        share_sum += shares.nan_to_num(0.0)        # NaN: no A > 0 token (every group solved or failed)
        share_count += shares.isfinite()
        if marked:
            true_gap = (state_entropy(logits, batch.tokens) - before) - aspo_change if counterfactual else nan
            stats = {**policy.outcome(logits), "flip_share": shares, **gap_estimates(batch, logprobs, entropy),
                     "gap_true": true_gap}
            for key in RECORDED:
                record[key].append(stats[key].tolist())
    return {"checkpoints": marks, "record": record, "flip_share_mean": share(share_sum, share_count).tolist()}


def run(out: Path, seeds: list[int], doses=DOSES, budget: float = BUDGET) -> None:
    """Every dose and arm not yet in ``out`` (resumable: a finished (dose, arm) is a JSON file)."""
    for epochs, lr in doses:
        batches = batches_for(epochs, lr, budget)
        for arm in ARMS:
            path = out / dose_name(epochs, lr) / f"{arm}.json"
            if path.exists():
                continue
            result = run_arm(arm, epochs, lr, seeds, batches, counterfactual=arm == "grpo")
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"arm": arm, "epochs": epochs, "lr": lr, "seeds": seeds, "batches": batches,
                                       **result}))
            tmp.replace(path)
            print(f"{dose_name(epochs, lr)} {arm}: {batches} batches, done", flush=True)


def calibrate(batches: int = 30) -> None:
    """The flip's share (mean over batches and the calibration seeds) of GRPO per candidate dose:
    what the doses were chosen by. It prints nothing of the outcomes."""
    for epochs, lr in CANDIDATES:
        result = run_arm("grpo", epochs, lr, list(CALIBRATION_SEEDS), batches, counterfactual=False)
        shares = torch.tensor(result["flip_share_mean"])
        print(f"epochs {epochs} lr {lr:g}: flip share {100 * float(shares.nanmean()):.2f} %", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/study_dose"))
    parser.add_argument("--seeds", type=int, default=50, help="paired seeds per cell: 0 .. n-1")
    parser.add_argument("--budget", type=float, default=BUDGET, help="lr × epochs × batches of every dose")
    parser.add_argument("--calibrate", action="store_true", help="print GRPO's flip share per candidate dose")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.calibrate:
        calibrate()
        return
    run(args.out, list(range(args.seeds)), budget=args.budget)


if __name__ == "__main__":
    main()
