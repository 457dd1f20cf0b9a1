"""Validate an untrained tiny policy with the real `RLDataModule` on 1 or 2 CPU processes (FSDP2 or
DDP over gloo) and record what each rank's engine decoded.

Run as a module from the repository's root, or with it on PYTHONPATH (Lightning re-launches it
once per extra process):
    python -m tests.multiproc.sharded_val --model DIR --devices 2 --strategy fsdp2 --out result.json
The transformers engine samples with the policy (under FSDP2 from its shards, in lockstep); a
sample is graded by a hash of its text, so correctness varies from sample to sample. Writes, from
rank 0, every rank's engine calls (each prompt's problem id and its samples' grades, the seed) and
the logged ``val/avg@K`` and ``val/pass@K``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import torch.distributed as dist
from lightning.pytorch import Trainer, seed_everything

from aspo_lit.rollout.hf import HFEngine
from aspo_lit.tasks.base import Task
from aspo_lit.training.module import ASPOModule
from data_modules.math import RLDataModule
from tests.multiproc.sharded_fit import make_strategy

PROBLEMS, VAL_BATCH, K = 5, 4, 3  # batches of 4 and 1 problems: in the second, rank 1 of 2 has none


def graded(text: str) -> float:
    """A sample's grade: a hash of its text (about a third correct)."""
    return float(int(hashlib.sha1(text.encode()).hexdigest(), 16) % 3 == 0)


class HashReward:
    def batch(self, texts, golds):
        return [graded(t) for t in texts]


class RecordingEngine(HFEngine):
    """The transformers engine, recording each call's prompts, seed and samples' grades."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.calls: list[dict] = []

    def generate(self, prompts, n=1, sampling=None):
        out = super().generate(prompts, n=n, sampling=sampling)
        self.calls.append({"prompts": [list(p) for p in prompts], "seed": sampling.seed,
                           "grades": [[graded(c.text) for c in group] for group in out]})
        return out


class FewProblemsTask(Task):
    """PROBLEMS held-out problems, distinct prompts; no training data."""

    def rows(self, split):
        return [{"id": f"p{i}", "problem": f"What is {i} + {i + 2}?", "answer": str(2 * i + 2)}
                for i in range(PROBLEMS)] if split == "val" else None


class FewProblems(RLDataModule):
    def build_task(self):
        return FewProblemsTask(self.hparams.prompt_template, self._reward)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--strategy", choices=["single", "fsdp2", "ddp"], default="single")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    seed_everything(5)
    strategy = make_strategy(args.strategy)
    engine = RecordingEngine()
    datamodule = FewProblems(val_k=K, val_batch_size=VAL_BATCH, val_temperature=1.0, max_response_length=6,
                             prompt_template="plain", engine=engine, reward=HashReward(), batch_size=2, group_size=2)
    module = ASPOModule(model_name_or_path=args.model, lr=1e-3, warmup_steps=0, mini_batch_size=1)
    trainer = Trainer(accelerator="cpu", devices=args.devices, strategy=strategy, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    logged = trainer.validate(module, datamodule=datamodule, verbose=False)[0]
    ids = {tuple(row["prompt_ids"]): row["id"] for row in datamodule.val_rows()}
    calls = [{"problems": [ids[tuple(p)] for p in call["prompts"]], "seed": call["seed"], "grades": call["grades"]}
             for call in engine.calls]
    per_rank = [None] * trainer.world_size
    if trainer.world_size > 1:
        dist.all_gather_object(per_rank, calls)
    else:
        per_rank = [calls]
    if trainer.is_global_zero:
        Path(args.out).write_text(json.dumps({
            "calls_per_rank": per_rank, "val": {k: float(v) for k, v in logged.items()},
            "problems": [f"p{i}" for i in range(PROBLEMS)], "val_batch_size": VAL_BATCH, "k": K,
        }))
    if trainer.world_size > 1:
        # both ranks leave the group together: rank 0 hosts the TCPStore, and one CI run in ~30 aborted
        # at exit ("terminate called without an active exception") with the group left to atexit
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
