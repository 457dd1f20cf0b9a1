"""RehearsalProbe: records what a rehearsal of a shipped config checks, from inside the run.

Added to a run with `--trainer.callbacks+=tests.rehearsal.probe.RehearsalProbe`. Per rank it writes
to `out_dir`:

* `rollouts/step{k}_rank{r}.pt`: the rollout batch this rank trained on (for the 1-process replay);
* `weights/{i:03d}.pt` (rank 0): the gathered full weights before optimizer step i+1, and after the
  last step as the final file, so a replay can be compared step by step;
* `probe_rank{r}.json`: the lr of every rollout batch, per optimizer step the largest difference
  between the ranks' gathered weights, after the first rollout batch with a gradient (a batch whose
  groups are all solved by all or none of their samples has none) which parameter tensors changed
  and how many of the entries with a non-zero gradient changed, the peak host RSS of the
  process (after the models are built, and at the end) and per phase of the run
  (:class:`PhaseRSS`: setup; attach = the engine's start at the first rollout; push; generate;
  rollout = the rest of making a rollout batch (rewards, packing); logprobs = old and reference log-probs, until the
  first backward; update = forward/backward/optimizer; probe = this callback's own gathers and saves),
  and with a vLLM engine, after every
  push (at the start of each rollout batch) whether the engine's weight checksum matches the
  trainer's (`aspo_lit.rollout.checksum`), with the engine's topology and load call; per call of
  the module's `_loss_advantages`, whether the loss got per-token advantages (`rollout_is_cap`'s
  truncated IS weights) and the largest weight; the policy's model_type.

`sigterm_at_batch=k` sends SIGTERM to rank 0's own process at the start of rollout batch k (a
mid-run interruption, as a scheduler would send).
"""

from __future__ import annotations

import json
import os
import resource
import signal
import threading
from pathlib import Path

import torch
import torch.distributed as dist
from lightning.pytorch import Callback

from aspo_lit.models import full_tensor, named_full_tensors


class PhaseRSS:
    """The peak resident set size (MiB) of this process in each phase, sampled every ``interval``
    seconds by a daemon thread from ``/proc/self/statm`` (``ru_maxrss`` only says the peak of the
    whole life). ``phase`` is set by the probe's hooks; a sample is attributed to the phase current
    when it was taken."""

    def __init__(self, interval: float = 0.01) -> None:
        self.phase = "setup"
        self.peak_mib: dict[str, float] = {}
        self._page_mib = os.sysconf("SC_PAGE_SIZE") / 2**20
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval,), daemon=True, name="PhaseRSS")
        self._thread.start()

    def rss_mib(self) -> float:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self._page_mib

    def sample(self) -> None:
        phase, rss = self.phase, self.rss_mib()
        if rss > self.peak_mib.get(phase, 0.0):
            self.peak_mib[phase] = round(rss, 1)

    def _run(self, interval: float) -> None:
        while not self._stop.wait(interval):
            self.sample()

    def enter(self, phase: str) -> None:
        self.sample()   # the end of the previous phase is its own
        self.phase = phase
        self.sample()

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join()
        self.sample()
        return dict(self.peak_mib)


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
        self.zero_gradient_batches = 0
        self.engine_checks: list[dict] = []
        self.engine: dict = {}
        self.rss_mib: dict[str, float] = {}
        self.phases = PhaseRSS()
        self._resume_phase = "setup"
        self.is_weights: list[dict] = []

    @staticmethod
    def _peak_rss_mib() -> float:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    def _check_engine(self, trainer, pl_module) -> None:
        """After the push this rollout batch was sampled with: engine checksum vs the trainer's."""
        engine = getattr(trainer.datamodule, "engine", None)
        if engine is None or not hasattr(engine, "weights_checksum"):
            return
        from aspo_lit.rollout.checksum import checksum_of, weights_match

        trainer_sum = checksum_of(named_full_tensors(pl_module.policy), engine.model_dtype)
        ok, diff = weights_match(engine.weights_checksum(), trainer_sum, engine.model_dtype)
        self.engine = {"topology": engine.topology, "tensor_parallel_size": engine.tensor_parallel_size,
                       "sync_path": engine.sync_path, "load_call": engine.last_sync_info.get("load_call"),
                       "sleep_mode": engine.enable_sleep_mode, "calls": engine.calls[-8:]}
        self.engine_checks.append({"global_step": trainer.global_step, "match": ok, **diff})

    def on_train_start(self, trainer, pl_module) -> None:
        self.rss_mib["after_configure_model"] = self._peak_rss_mib()
        self._record_is_weights(pl_module)
        # the rollout engine's calls (RLDataModule._generate: the engine's start on the first
        # rollout, the weight push, the generation; nested, each back to its caller's phase after)
        for method, phase in (("_generate", "generate"), ("_ensure_engine", "attach"), ("_sync_weights", "push")):
            if hasattr(trainer.datamodule, method):
                self._in_phase(trainer.datamodule, method, phase)
        self.phases.enter("rollout")   # the first batch's push, generation and reward come next

    def _in_phase(self, obj, method: str, phase: str) -> None:
        """Count the time inside ``obj.method`` as ``phase`` (then back to the phase it was called in)."""
        original = getattr(obj, method)

        def timed(*args, **kwargs):
            outer = self.phases.phase
            self.phases.enter(phase)
            try:
                return original(*args, **kwargs)
            finally:
                self.phases.enter(outer)

        setattr(obj, method, timed)

    def _record_is_weights(self, pl_module) -> None:
        """Wrap the module's ``_loss_advantages``: per call, whether the loss got per-token
        advantages (``model.rollout_is_cap``'s truncated IS weights) and the largest weight."""
        original = pl_module._loss_advantages

        def recorded(batch, old_logprobs, rows):
            out = original(batch, old_logprobs, rows)
            advantages = batch.advantages.float()[rows].to(out.device)
            per_token = out.ndim == 2
            weights = out / advantages[:, None] if per_token else torch.ones(1)
            weights = weights[advantages != 0] if per_token else weights
            self.is_weights.append({"per_token": per_token,
                                    "max_weight": float(weights.max()) if weights.numel() else 1.0})
            return out

        pl_module._loss_advantages = recorded

    # -- helpers ---------------------------------------------------------------------------------
    def _snapshot(self, trainer, pl_module) -> None:
        """Gather full weights (collective), compare the ranks' copies, save rank 0's.

        One tensor at a time: the ranks' copies of one tensor are all that is held beside the saved
        state (a flat copy of the whole model per rank, as before, held ~4 bytes x 3 x parameters
        more per step: 1.6 GB for a 135M model, most of a rank's growth in a real-shaped rehearsal)."""
        keep = self.save and trainer.is_global_zero
        state, worst = {}, 0.0
        for n, t in named_full_tensors(pl_module.policy):
            t = t.detach().float().cpu()
            if trainer.world_size > 1:
                copies = [torch.empty_like(t) for _ in range(trainer.world_size)]
                dist.all_gather(copies, t)
                worst = max([worst] + [float((c - copies[0]).abs().max()) for c in copies[1:]])
            if keep:
                state[n] = t
        self.cross_rank_max_diff.append(worst)
        if keep:
            (self.out / "weights").mkdir(parents=True, exist_ok=True)
            torch.save(state, self.out / "weights" / f"{self._snap:03d}.pt")
        self._snap += 1

    # -- hooks -----------------------------------------------------------------------------------
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.phases.enter("probe")
        self._on_train_batch_start(trainer, pl_module, batch, batch_idx)
        self.phases.enter("logprobs")  # the old and reference log-probs, until the first backward

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        if self.phases.phase == "logprobs":
            self.phases.enter("update")

    def _on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._batch = batch_idx
        self.lrs.append(float(trainer.optimizers[0].param_groups[0]["lr"]))
        if self.save:
            folder = self.out / "rollouts"
            folder.mkdir(parents=True, exist_ok=True)
            fields = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in vars(batch).items()}
            torch.save(fields, folder / f"step{trainer.global_step:06d}_rank{trainer.global_rank}.pt")
        if self.first_batch is None:   # until a batch with gradients: the weights it starts from
            self._before = {n: full_tensor(p).clone() for n, p in pl_module.policy.named_parameters()}
            self._nonzero = {}
        self._check_engine(trainer, pl_module)
        if self.sigterm_at_batch is not None and batch_idx == self.sigterm_at_batch and trainer.is_global_zero:
            os.kill(os.getpid(), signal.SIGTERM)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.phases.enter("probe")
        self._on_before_optimizer_step(trainer, pl_module, optimizer)
        self.phases.enter("update")

    def _on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self._snapshot(trainer, pl_module)
        if self.first_batch is None:
            for n, p in pl_module.policy.named_parameters():
                if p.grad is not None:
                    # AdamW moves an entry by ~lr * g / (|g| + eps): entries with |g| << eps move far
                    # less than lr by design, so only |g| >= eps counts as "received a gradient"
                    nz = full_tensor(p.grad).abs() >= optimizer.param_groups[0].get("eps", 1e-8)
                    self._nonzero[n] = self._nonzero[n] | nz if n in self._nonzero else nz

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.phases.enter("probe")
        self._on_train_batch_end(trainer, pl_module, batch_idx)
        self.phases.enter("rollout")

    def _on_train_batch_end(self, trainer, pl_module, batch_idx) -> None:
        if self.first_batch is not None:
            return
        changed_tensors, n_params = 0, 0
        counts = torch.zeros(2, dtype=torch.float64)  # entries with a non-zero grad, of those changed
        for n, p in pl_module.policy.named_parameters():
            delta = full_tensor(p) != self._before[n]
            n_params += 1
            changed_tensors += int(bool(delta.any()))
            nz = self._nonzero.get(n)
            if nz is not None:
                counts += torch.tensor([float(nz.sum()), float((nz & delta).sum())], dtype=torch.float64)
        if counts[0] == 0:   # every group solved by all or none of its samples: no gradient to follow
            self.zero_gradient_batches += 1
            return
        self.first_batch = {"param_tensors": n_params, "param_tensors_changed": changed_tensors,
                            "nonzero_grad_entries": float(counts[0]), "nonzero_grad_entries_changed": float(counts[1]),
                            "batch": batch_idx, "zero_gradient_batches_before": self.zero_gradient_batches}

    def on_train_end(self, trainer, pl_module) -> None:
        self.phases.enter("probe")
        self._snapshot(trainer, pl_module)
        self.out.mkdir(parents=True, exist_ok=True)
        self.rss_mib["end"] = self._peak_rss_mib()
        self.rss_mib["phases"] = self.phases.stop()
        record = {"world_size": trainer.world_size, "global_step": trainer.global_step, "lrs": self.lrs,
                  "engine": self.engine, "engine_checks": self.engine_checks, "peak_rss_mib": self.rss_mib,
                  "cross_rank_max_diff": self.cross_rank_max_diff, "first_batch": self.first_batch,
                  "is_weights": self.is_weights,
                  "warmup_steps": pl_module.hparams.warmup_steps, "lr": pl_module.hparams.lr,
                  "policy_model_type": pl_module.policy.config.model_type}
        (self.out / f"probe_rank{trainer.global_rank}.json").write_text(json.dumps(record, indent=1))
