"""RehearsalProbe: records what a rehearsal of a shipped config checks, from inside the run.

Added to a run with `--trainer.callbacks+=tests.rehearsal.probe.RehearsalProbe`. Per rank it writes
to `out_dir`:

* `rollouts/step{k}_rank{r}.pt`: the rollout batch this rank trained on (for the 1-process replay);
* `weights/{i:03d}.pt` (rank 0): the gathered full weights before optimizer step i+1, and after the
  last step as the final file, so a replay can be compared step by step;
* `probe_rank{r}.json`: the lr of every rollout batch, per optimizer step the largest difference
  between the ranks' gathered weights, and after the first rollout batch which parameter tensors
  changed and how many of the entries with a non-zero gradient changed.

`sigterm_at_batch=k` sends SIGTERM to rank 0's own process at the start of rollout batch k (a
mid-run interruption, as a scheduler would send).
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import torch
import torch.distributed as dist
from lightning.pytorch import Callback


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor (a collective for an FSDP2 DTensor shard)."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach()


class RehearsalProbe(Callback):
    def __init__(self, out_dir: str, sigterm_at_batch: int | None = None, save: bool = True) -> None:
        self.out = Path(out_dir)
        self.sigterm_at_batch = sigterm_at_batch
        self.save = save
        self.lrs: list[float] = []
        self.cross_rank_max_diff: list[float] = []
        self._snap = 0
        self._batch = -1
        self._before: dict[str, torch.Tensor] | None = None
        self._nonzero: dict[str, torch.Tensor] = {}
        self.first_batch: dict | None = None

    # -- helpers ---------------------------------------------------------------------------------
    def _snapshot(self, trainer, pl_module) -> None:
        """Gather full weights (collective), compare the ranks' copies, save rank 0's."""
        state = {n: (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().float().cpu()
                 for n, t in pl_module.policy.state_dict().items()}
        flat = torch.cat([t.reshape(-1) for t in state.values()]).double()
        if trainer.world_size > 1:
            copies = [torch.zeros_like(flat) for _ in range(trainer.world_size)]
            dist.all_gather(copies, flat)
            self.cross_rank_max_diff.append(max(float((c - copies[0]).abs().max()) for c in copies))
        else:
            self.cross_rank_max_diff.append(0.0)
        if self.save and trainer.is_global_zero:
            (self.out / "weights").mkdir(parents=True, exist_ok=True)
            torch.save(state, self.out / "weights" / f"{self._snap:03d}.pt")
        self._snap += 1

    # -- hooks -----------------------------------------------------------------------------------
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._batch = batch_idx
        self.lrs.append(float(trainer.optimizers[0].param_groups[0]["lr"]))
        if self.save:
            folder = self.out / "rollouts"
            folder.mkdir(parents=True, exist_ok=True)
            fields = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in vars(batch).items()}
            torch.save(fields, folder / f"step{trainer.global_step:06d}_rank{trainer.global_rank}.pt")
        if self._before is None:
            self._before = {n: _full(p).clone() for n, p in pl_module.policy.named_parameters()}
        if self.sigterm_at_batch is not None and batch_idx == self.sigterm_at_batch and trainer.is_global_zero:
            os.kill(os.getpid(), signal.SIGTERM)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self._snapshot(trainer, pl_module)
        if self.first_batch is None:
            for n, p in pl_module.policy.named_parameters():
                if p.grad is not None:
                    # AdamW moves an entry by ~lr * g / (|g| + eps): entries with |g| << eps move far
                    # less than lr by design, so only |g| >= eps counts as "received a gradient"
                    nz = _full(p.grad).abs() >= optimizer.param_groups[0].get("eps", 1e-8)
                    self._nonzero[n] = self._nonzero[n] | nz if n in self._nonzero else nz

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.first_batch is not None:
            return
        changed_tensors, n_params = 0, 0
        counts = torch.zeros(2, dtype=torch.float64)  # entries with a non-zero grad, of those changed
        for n, p in pl_module.policy.named_parameters():
            delta = _full(p) != self._before[n]
            n_params += 1
            changed_tensors += int(bool(delta.any()))
            nz = self._nonzero.get(n)
            if nz is not None:
                counts += torch.tensor([float(nz.sum()), float((nz & delta).sum())], dtype=torch.float64)
        self.first_batch = {"param_tensors": n_params, "param_tensors_changed": changed_tensors,
                            "nonzero_grad_entries": float(counts[0]), "nonzero_grad_entries_changed": float(counts[1])}

    def on_train_end(self, trainer, pl_module) -> None:
        self._snapshot(trainer, pl_module)
        self.out.mkdir(parents=True, exist_ok=True)
        record = {"world_size": trainer.world_size, "global_step": trainer.global_step, "lrs": self.lrs,
                  "cross_rank_max_diff": self.cross_rank_max_diff, "first_batch": self.first_batch,
                  "warmup_steps": pl_module.hparams.warmup_steps, "lr": pl_module.hparams.lr}
        (self.out / f"probe_rank{trainer.global_rank}.json").write_text(json.dumps(record, indent=1))
