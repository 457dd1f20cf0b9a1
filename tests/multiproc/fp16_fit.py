"""Fits of ASPOModule with fp16 compute under FSDP2 (`FSDP2Strategy(param_dtype="float16")`) on the
fixed rollout batches of tools/fixed_rollouts.py, on 2 CPU processes over gloo, one after another in
the same processes (Lightning launches the second process once, at the first fit).

Run as a module from the repository's root, or with it on PYTHONPATH:
    python -m tests.multiproc.fp16_fit --model DIR --out result.json --runs '[{"loss_scale": 2**-20}, ...]'
Each run is a dict of `Run`'s fields. Writes, from rank 0, for each run and each rank: the
per-batch grad norm, skipped steps and logged ``train/grad_scale``, and the grad scaler's state
when training starts (after a resume's restore) and when it ends.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from lightning.pytorch import Callback, Trainer, seed_everything

from aspo_lit.maths.losses import ASPOLoss
from aspo_lit.training.module import ASPOModule
from tools.fixed_rollouts import GROUPS, FixedRollouts

#: the injected overflow: one micro-batch's gradient times 2^20 (its loss unchanged), which the
#: scale 2^16 takes far past fp16's largest value, 65504
OVERFLOW = 2.0 ** 20


@dataclass
class Run:
    param_dtype: str = "float16"   # FSDP2Strategy's
    loss_scale: float = 1.0        # ScaledASPO's factor on the loss
    grad_scaler: bool = True       # False: the module's scaler built disabled (scale 1), fp16 without one
    overflow_rank: int | None = None
    max_nonfinite_steps: int = 3   # ASPOModule's
    steps: int = 1                 # trainer.max_steps (optimizer steps taken)
    save: str | None = None        # save a checkpoint here at the end
    resume: str | None = None      # resume from this checkpoint


class ScaledASPO(ASPOLoss):
    """ASPO's per-token loss times ``loss_scale`` (a power of two, so exact in every dtype): every
    gradient shrinks by that factor, into fp16's underflow."""

    def __init__(self, loss_scale: float = 1.0, **kwargs) -> None:
        super().__init__(**kwargs)
        self.loss_scale = loss_scale

    def token_loss(self, logprobs, old_logprobs, advantages, mask, eps_low, eps_high):
        per_token, stats = super().token_loss(logprobs, old_logprobs, advantages, mask, eps_low, eps_high)
        return per_token * self.loss_scale, stats


class Record(Callback):
    def __init__(self) -> None:
        self.grad_norms: list[float] = []
        self.skipped: list[int] = []
        self.grad_scale: list[float] = []
        self.scaler_at_start: dict | None = None

    def on_train_start(self, trainer, pl_module) -> None:
        scaler = pl_module.grad_scaler
        self.scaler_at_start = None if scaler is None else scaler.state_dict()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.grad_norms.append(float(outputs.stats["train/grad_norm"]))
        self.skipped.append(int(float(outputs.stats["train/skipped_steps"])))
        if "train/grad_scale" in outputs.stats:
            self.grad_scale.append(float(outputs.stats["train/grad_scale"]))


def _overflow_once(rank: int):
    """A `response_logprobs` whose first call with grad on rank ``rank`` returns log-probs carrying a
    gradient `OVERFLOW` times too large (their values, hence the loss, unchanged): a scaled gradient
    that overflows on that rank only."""
    import torch.distributed as dist

    from aspo_lit.training.forward import response_logprobs

    state = {"done": False}

    def patched(model, *args, **kwargs):
        logprobs, entropy = response_logprobs(model, *args, **kwargs)
        if torch.is_grad_enabled() and not state["done"] and dist.get_rank() == rank:
            state["done"] = True
            logprobs = logprobs + (logprobs - logprobs.detach()) * (OVERFLOW - 1)
        return logprobs, entropy

    return patched


def fit(model_dir: str, run: Run) -> dict:
    import torch.distributed.fsdp.sharded_grad_scaler as sharded_grad_scaler

    import aspo_lit.training.module as module_lib
    from aspo_lit.training.strategy import FSDP2Strategy

    seed_everything(0)
    scaler_class, logprobs_fn = sharded_grad_scaler.ShardedGradScaler, module_lib.response_logprobs
    if not run.grad_scaler:
        sharded_grad_scaler.ShardedGradScaler = lambda *a, **k: scaler_class(*a, **{**k, "enabled": False})
    if run.overflow_rank is not None:
        module_lib.response_logprobs = _overflow_once(run.overflow_rank)
    try:
        module = ASPOModule(model_name_or_path=model_dir, loss=ScaledASPO(run.loss_scale, loss_agg="token-mean"),
                            lr=1e-3, warmup_steps=0, kl_coef=0.0, mini_batch_size=GROUPS, micro_batch_size=16,
                            max_tokens_per_micro_batch=None, max_nonfinite_steps=run.max_nonfinite_steps)
        record = Record()
        trainer = Trainer(accelerator="cpu", devices=2, strategy=FSDP2Strategy(param_dtype=run.param_dtype),
                          max_steps=run.steps, limit_val_batches=0, logger=False, enable_checkpointing=False,
                          enable_progress_bar=False, enable_model_summary=False, callbacks=[record],
                          use_distributed_sampler=False)
        trainer.fit(module, datamodule=FixedRollouts(steps=2), ckpt_path=run.resume)
        if run.save:
            trainer.save_checkpoint(run.save)
    finally:
        sharded_grad_scaler.ShardedGradScaler, module_lib.response_logprobs = scaler_class, logprobs_fn
    scaler = module.grad_scaler
    return {"grad_norms": record.grad_norms, "skipped": record.skipped, "grad_scale": record.grad_scale,
            "scaler_at_start": record.scaler_at_start, "scaler_at_end": None if scaler is None else scaler.state_dict(),
            "global_step": trainer.global_step}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--runs", required=True, help="a JSON list of Run fields")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    import torch.distributed as dist

    results = []
    for fields in json.loads(args.runs):
        mine = fit(args.model, Run(**fields))
        per_rank = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, mine)
        results.append(per_rank)
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(results))


if __name__ == "__main__":
    main()
