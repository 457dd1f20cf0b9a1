"""Interrupt and resume FSDP2 fits with a KL reference, on 2 CPU processes over gloo, one launch:
the fits run one after another in the same processes (Lightning launches the second process once,
at the first fit), on the fixed rollout batches of tools/fixed_rollouts.py.

Fits: ``full``, two rollout batches uninterrupted; ``cut`` and ``cut_full_file``, the first batch,
each saving its checkpoint (FSDP2's sharded folder; with ``save_distributed_checkpoint=False``, the
full file); then one fit resumed from each (``resumed``, ``resumed_full_file``) and one from the
sharded checkpoint rewritten as the older format held it, with the reference's tensors under
``ref_policy.*`` (here the base weights + 0.5, so a loaded one would show in train/kl):
``resumed_old_format``.

Run as a module from the repository's root, or with it on PYTHONPATH:
    python -m tests.multiproc.sharded_resume --model DIR --out result.json [--cores 8]
Writes, from rank 0, for each fit and rank: the per-step grad norms and logged diagnostics, the
weight checksums when training starts (after a resume's restore; the reference's as ``ref.*``) and
the policy's at the end, and each rank's torch threads; and each checkpoint's module tensors and
bytes on disk.
``--cores N`` makes `aspo_lit.training.threads.usable_cores` answer N (a host with more cores than this one).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from lightning.pytorch import Trainer, seed_everything

from aspo_lit.callbacks import EntropyMonitor, TrainingStats
from aspo_lit.training.models import full_state_dict, load_policy
from aspo_lit.training.module import ASPOModule
from aspo_lit.training.strategy import FSDP2Strategy
from tests.multiproc.sharded_fit import Record
from tools.fixed_rollouts import GROUPS, FixedRollouts

SHIFT = 0.5  # added to the older-format checkpoint's reference tensors


class StepRollouts(FixedRollouts):
    """The rollout batch of the fit's step (one optimizer step per batch here), so a resumed fit
    takes the batch the uninterrupted one took (Lightning restarts a plain loader's epoch)."""

    def on_after_batch_transfer(self, batch, dataloader_idx):
        if self.trainer.training:
            batch = torch.tensor([self.trainer.global_step])
        return super().on_after_batch_transfer(batch, dataloader_idx)


def fit(model_dir: str, steps: int, resume: Path | None = None, save: Path | None = None,
        distributed_checkpoint: bool = True) -> dict:
    seed_everything(0)
    module = ASPOModule(model_name_or_path=model_dir, loss_kwargs={"loss_agg": "token-mean"}, lr=1e-3,
                        warmup_steps=0, kl_coef=0.01, mini_batch_size=GROUPS, micro_batch_size=16,
                        max_tokens_per_micro_batch=None)
    record = Record()
    trainer = Trainer(accelerator="cpu", devices=2, max_steps=steps, limit_val_batches=0, logger=False,
                      strategy=FSDP2Strategy(param_dtype=None, save_distributed_checkpoint=distributed_checkpoint),
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[TrainingStats(), EntropyMonitor(), record], use_distributed_sampler=False)
    trainer.fit(module, datamodule=StepRollouts(steps=2), ckpt_path=resume)
    if save is not None:
        trainer.save_checkpoint(save)
    final = {name: t.double().sum().item() for name, t in full_state_dict(module.policy).items()}
    return {"grad_norms": record.grad_norms, "diagnostics": record.diagnostics, "loaded": record.loaded,
            "weights": final, "threads": torch.get_num_threads()}


def checkpoint_contents(path: Path) -> dict:
    """A checkpoint's module tensors (``state_dict.*`` names) and its bytes on disk."""
    if path.is_dir():
        from torch.distributed.checkpoint import FileSystemReader

        names = list(FileSystemReader(str(path)).read_metadata().state_dict_metadata)
        disk = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    else:
        checkpoint = torch.load(path, map_location="cpu", weights_only=False)
        names, disk = [f"state_dict.{k}" for k in checkpoint["state_dict"]], path.stat().st_size
    return {"module_tensors": sorted(n for n in names if n.startswith("state_dict.")), "disk_bytes": disk}


def as_older_format(model_dir: str, sharded: Path, out: Path) -> None:
    """``sharded`` (a sharded checkpoint folder) with the reference's tensors added, as checkpoints
    held them while the reference was a submodule (``state_dict.ref_policy.*``)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp

    whole = out.with_suffix(".pt")
    dcp_to_torch_save(sharded, whole)
    state = torch.load(whole, weights_only=False)
    base = load_policy(model_dir, "float32").state_dict()
    state["state_dict"].update({f"ref_policy.{name}": t + SHIFT for name, t in base.items()})
    torch.save(state, whole)
    torch_save_to_dcp(whole, out)
    shutil.copy(sharded / "meta.pt", out / "meta.pt")
    whole.unlink()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--cores", type=int, default=None, help="the cores aspo_lit.training.threads sees")
    args = parser.parse_args()
    if args.cores is not None:
        import aspo_lit.training.threads

        aspo_lit.training.threads.usable_cores = lambda: args.cores
    import torch.distributed as dist

    work = Path(args.out).parent
    sharded, full_file, older = work / "cut.ckpt", work / "cut_full_file.ckpt", work / "cut_older_format.ckpt"
    runs = {"full": fit(args.model, 2)}
    runs["cut"] = fit(args.model, 1, save=sharded)
    runs["cut_full_file"] = fit(args.model, 1, save=full_file, distributed_checkpoint=False)
    if dist.get_rank() == 0:
        as_older_format(args.model, sharded, older)
    dist.barrier()
    runs["resumed"] = fit(args.model, 2, resume=sharded)
    runs["resumed_full_file"] = fit(args.model, 2, resume=full_file)
    runs["resumed_old_format"] = fit(args.model, 2, resume=older)

    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, runs)
    if dist.get_rank() == 0:
        result = {"runs": {name: [rank[name] for rank in per_rank] for name in runs},
                  "checkpoints": {p.name: checkpoint_contents(p) for p in (sharded, full_file, older)}}
        Path(args.out).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
