"""Train ASPOModule on fixed rollout batches with 1 or 2 CPU processes (FSDP2 or DDP over gloo).

Run as a module from the repository's root, or with it on PYTHONPATH (Lightning re-launches it
once per extra process):
    python -m tests.multiproc.sharded_fit --model DIR --devices 2 --strategy fsdp2 --out result.json
Writes, from rank 0, the per-step grad norms, the final full policy weights' checksums and the
logged diagnostics and validation metrics (reduced over the ranks), so a test can compare sharded
training against the single-process run of the same batches.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from lightning.pytorch import Callback, Trainer, seed_everything

from aspo_lit.callbacks import EntropyMechanism, EntropyMonitor, TrainingStats
from aspo_lit.training.models import full_state_dict
from aspo_lit.training.module import ASPOModule
from tools.fixed_rollouts import GROUPS, VAL_K, FixedRollouts, fixed_rollout, val_correct

DIAGNOSTICS = ("train/entropy", "train/kl", "train/reward_mean", "response/length_mean", "response/length_max")
# with --stats: the step's statistics and the diagnostics the ranks reduce by their own weights
STATS = ("clip/pos_high", "clip/neg_low", "ratio/pos_mean", "ratio/neg_mean", "train/pg_loss", "train/grad_norm",
         "train/updates_per_rollout", "ratio/off_policy_share", "train/position_mean", "entropy/cov",
         "entropy/cov_pos", "entropy/cov_neg", "entropy/measured_change")


class Record(Callback):
    """After the diagnostics: each step's grad norm, skips, logged diagnostics and this rank's
    own token count and token-mean entropy."""

    def __init__(self, diagnostics=DIAGNOSTICS) -> None:
        self.keys = tuple(diagnostics)
        self.grad_norms: list[float] = []
        self.skipped: list[int] = []
        self.diagnostics: list[dict[str, float]] = []
        self.local_entropy: list[tuple[int, float]] = []
        self.loaded: dict[str, float] = {}
        self.loaded_buffers: dict[str, float] = {}

    def on_train_start(self, trainer, pl_module) -> None:
        """What every rank holds after configure_model (rank 0 loaded it; the others got shards)."""
        self.loaded = {name: t.double().sum().item() for name, t in full_state_dict(pl_module.policy).items()}
        if pl_module.ref_policy is not None:
            ref = full_state_dict(pl_module.ref_policy)
            self.loaded.update({f"ref.{n}": t.double().sum().item() for n, t in ref.items()})
            self.ref_dtype = str(next(iter(ref.values())).dtype)
        self.loaded_buffers = {n: b.double().sum().item() for n, b in pl_module.policy.named_buffers()}
        self.tied = pl_module.policy.lm_head.weight is pl_module.policy.get_input_embeddings().weight

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.grad_norms.append(float(outputs.stats["train/grad_norm"]))
        self.skipped.append(int(float(outputs.stats["train/skipped_steps"])))
        self.diagnostics.append({k: float(trainer.callback_metrics[k]) for k in self.keys})
        mask = outputs.response_mask
        self.local_entropy.append((int(mask.sum()), float((outputs.entropy * mask).sum() / mask.sum())))


def _inject_nan(rank: int) -> None:
    """Rank `rank`'s first log-probs with grad (the first micro-batch of the update) come out NaN."""
    import aspo_lit.training.module as module_lib

    original = module_lib.response_logprobs
    state = {"done": False}

    def patched(model, *args, **kwargs):
        logprobs, entropy = original(model, *args, **kwargs)
        import torch.distributed as dist

        if (torch.is_grad_enabled() and not state["done"] and dist.is_initialized() and dist.get_rank() == rank):
            state["done"] = True
            logprobs = logprobs * float("nan")
        return logprobs, entropy

    module_lib.response_logprobs = patched


def _count_checkpoint_reads() -> dict[str, int]:
    """Count `from_pretrained` weight loads from here on (in this process)."""
    from transformers import AutoModelForCausalLM

    count = {"n": 0}
    original = AutoModelForCausalLM.from_pretrained.__func__

    def counted(cls, *args, **kwargs):
        count["n"] += 1
        return original(cls, *args, **kwargs)

    AutoModelForCausalLM.from_pretrained = classmethod(counted)
    return count


def make_strategy(name: str, param_dtype: str | None = None):
    """The Trainer's strategy for ``--strategy``: single, ddp, fsdp2 (`FSDP2Strategy`, compute in
    `param_dtype`) or model_parallel_default (Lightning's defaults: tensor parallel over the devices)."""
    if name == "fsdp2":
        from aspo_lit.training.strategy import FSDP2Strategy

        return FSDP2Strategy(param_dtype=param_dtype)
    if name == "model_parallel_default":
        from lightning.pytorch.strategies import ModelParallelStrategy

        return ModelParallelStrategy()
    return {"single": "auto", "ddp": "ddp"}[name]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--strategy", choices=["single", "fsdp2", "ddp", "model_parallel_default"], default="single")
    parser.add_argument("--budget", type=int, default=None, help="model.max_tokens_per_micro_batch (default: fixed 3 rows)")
    parser.add_argument("--nan_rank", type=int, default=None,
                        help="this rank's first update log-probs are NaN (a rank-local numerical failure)")
    parser.add_argument("--loss_agg", default="seq-mean-token-mean")
    parser.add_argument("--param_dtype", default=None, help="FSDP2Strategy param_dtype (default: none, fp32 compute)")
    parser.add_argument("--loss", default="aspo", help="model.loss: a name or an import path")
    parser.add_argument("--minibatches", type=int, default=1, help="optimizer steps per rollout batch")
    parser.add_argument("--stats", action="store_true", help="also record STATS (and run EntropyMechanism)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    seed_everything(0)
    strategy = make_strategy(args.strategy, param_dtype=args.param_dtype)
    if args.nan_rank is not None:
        _inject_nan(args.nan_rank)
    module = ASPOModule(model_name_or_path=args.model, loss=args.loss, loss_kwargs={"loss_agg": args.loss_agg},
                        lr=1e-3, warmup_steps=0, kl_coef=0.01, mini_batch_size=GROUPS // args.minibatches,
                        micro_batch_size=3, max_tokens_per_micro_batch=args.budget)
    record = Record(DIAGNOSTICS + (STATS if args.stats else ()))
    callbacks = [TrainingStats(), EntropyMonitor(), *([EntropyMechanism()] if args.stats else []), record]
    trainer = Trainer(accelerator="cpu", devices=args.devices, strategy=strategy, max_steps=2 * args.minibatches,
                      logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, callbacks=callbacks, use_distributed_sampler=False)
    from aspo_lit.training.models import load_policy

    base = load_policy(args.model)
    initial = {name: t.double().sum().item() for name, t in base.state_dict().items()}
    initial_buffers = {name: b.double().sum().item() for name, b in base.named_buffers()}
    initial_bf16 = {name: t.bfloat16().double().sum().item() for name, t in base.state_dict().items()}
    reads = _count_checkpoint_reads()
    trainer.fit(module, datamodule=FixedRollouts(steps=2))
    state = full_state_dict(module.policy)
    import torch.distributed as dist

    per_rank = [None] * trainer.world_size
    mine = (record.skipped, record.local_entropy, record.loaded, record.loaded_buffers, record.tied, reads["n"])
    if trainer.world_size > 1:
        dist.all_gather_object(per_rank, mine)
    else:
        per_rank = [mine]
    if trainer.is_global_zero:
        correct = val_correct()
        result = {
            "skipped_per_rank": [r[0] for r in per_rank],
            "local_entropy_per_rank": [r[1] for r in per_rank],
            "loaded_per_rank": [r[2] for r in per_rank],
            "buffers_per_rank": [r[3] for r in per_rank],
            "tied_per_rank": [r[4] for r in per_rank],
            "checkpoint_reads_per_rank": [r[5] for r in per_rank],
            "ref_dtype": getattr(record, "ref_dtype", None),
            "diagnostics": record.diagnostics,
            "val": {k: float(trainer.callback_metrics[f"val/{k}@{VAL_K}"]) for k in ("avg", "pass")},
            "val_all_problems": {"avg": correct.float().mean().item(), "pass": correct.any(1).float().mean().item()},
            "response_lengths": [fixed_rollout(step, module.policy.config.vocab_size, module.tokenizer.pad_token_id)
                                 .response_lengths.tolist() for step in range(2)],
            "grad_norms": record.grad_norms,
            "initial_weights": initial,
            "initial_buffers": initial_buffers,
            "initial_weights_bf16": initial_bf16,
            "weights": {name: tensor.double().sum().item() for name, tensor in state.items()},
            "abs_weights": {name: tensor.double().abs().sum().item() for name, tensor in state.items()},
        }
        Path(args.out).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
