"""RehearsalProbe: records what a rehearsal of a shipped config checks, from inside the run.

Added to a run with `--trainer.callbacks+=tools.rehearsal.probe.RehearsalProbe`. Per rank it writes
to `out_dir`:

* `rollouts/step{k}_rank{r}.pt`: the rollout batch this rank trained on (for the 1-process replay);
* `weights/{i:03d}.pt` (rank 0): the gathered full weights before optimizer step i+1, and after the
  last step as the final file, so a replay can be compared step by step; `gradient_000.pt` (rank 0):
  the first optimizer step's gathered gradient;
* `probe_rank{r}.json`: the lr of every rollout batch, per optimizer step the largest difference
  between the ranks' gathered weights, after the first optimizer step with a gradient (a batch whose
  groups are all solved by all or none of their samples has none) whether every entry whose AdamW
  update is representable in its weight's dtype changed (:func:`representable_moves`), the peak host RSS of the
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
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.distributed as dist
from lightning.pytorch import Callback

from aspo_lit.training.models import full_tensor, named_full_tensors


def ulp(x: torch.Tensor) -> torch.Tensor:
    """The spacing of ``x``'s dtype just above ``|x|`` (float64): one unit in the last place."""
    a = x.detach().abs()
    return (torch.nextafter(a, torch.full_like(a, float("inf"))) - a).double()


def adamw_update(before: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, step: float, lr: float,
                 betas: tuple[float, float], eps: float, weight_decay: float) -> torch.Tensor:
    """The change torch's AdamW made to ``before`` in its step number ``step`` (float64, exact maths):
    decoupled decay ``-lr·wd·w``, then ``-lr/(1-β1^t) · m / (sqrt(v)/sqrt(1-β2^t) + eps)`` from the
    moments after the step."""
    beta1, beta2 = betas
    bias1, bias2 = 1 - beta1 ** step, 1 - beta2 ** step
    w, m, v = before.double(), exp_avg.double(), exp_avg_sq.double()
    return -lr * weight_decay * w - (lr / bias1) * m / (v.sqrt() / bias2 ** 0.5 + eps)


def representable_moves(tensors: Iterable[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor | None]]) -> dict:
    """Did every entry whose update its dtype can represent change? ``tensors``: per parameter its
    name, its weights before and after the step, and the step's update (:func:`adamw_update`; None
    when the optimizer holds no state for it), one at a time (a real-shaped model's float64 updates
    are never all in memory).

    An update ``Δ`` reaches a stored weight ``w`` through two roundings (the decay, then the step),
    each off by at most half an ulp of ``w``, so the weight must change when ``|Δ| > 2·ulp(w)``;
    below that the step may vanish in rounding, as it does for a norm weight of several units at a
    warm-up lr of 1e-7 (ulp(4.0) = 4.8e-7 in fp32). Every entry above the resolution must have
    changed, every parameter must have optimizer state (else the optimizer never stepped it), and
    some entry must be above it (else nothing was checked)."""
    must = moved = below = below_moved = 0
    stuck: dict[str, int] = {}
    stateless: list[str] = []
    for name, before, after, delta in tensors:
        if delta is None:
            stateless.append(name)
            continue
        changed = after != before
        needed = delta.abs() > 2 * ulp(before)
        must += int(needed.sum())
        moved += int((needed & changed).sum())
        below += int((~needed).sum())
        below_moved += int((~needed & changed).sum())
        if (needed & ~changed).any():
            stuck[name] = int((needed & ~changed).sum())
    return {"ok": must > 0 and moved == must and not stateless, "representable_entries": must,
            "representable_changed": moved, "below_resolution_entries": below,
            "below_resolution_changed": below_moved, "unchanged_by_tensor": stuck, "without_optimizer_state": stateless,
            "rule": "every entry whose AdamW update exceeds 2 ulp of its weight changed"}


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
        self._pending: dict | None = None   # the first optimizer step with a gradient: weights before it
        self.first_batch: dict | None = None
        self.zero_gradient_batches = 0
        self.engine_checks: list[dict] = []
        self.engine: dict = {}
        self.rss_mib: dict[str, float] = {}
        self.phases = PhaseRSS()
        self._resume_phase = "setup"
        self.is_weights: list[dict] = []
        self.loads: list[bool] = []   # per policy load: whether this rank read the checkpoint (else: meta + broadcast)
        self._record_loads()

    def _record_loads(self) -> None:
        """Wrap the module's ``load_policy``: whether each load on this rank read the checkpoint
        (``materialize``) or built the architecture on the meta device for rank 0's broadcast."""
        import aspo_lit.training.module as module

        original = module.load_policy

        def recorded(*args, **kwargs):
            self.loads.append(bool(kwargs.get("materialize", True)))
            return original(*args, **kwargs)

        module.load_policy = recorded

    @staticmethod
    def _peak_rss_mib() -> float:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    def _check_engine(self, trainer, pl_module) -> None:
        """After the push this rollout batch was sampled with: engine checksum vs the trainer's."""
        engine = trainer.datamodule.controller.engine
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
        # the rollout engine's calls (RolloutController._generate: the engine's start on the first
        # rollout, the weight push, the generation; nested, each back to its caller's phase after)
        for method, phase in (("_generate", "generate"), ("ensure_engine", "attach"), ("sync_weights", "push")):
            self._in_phase(trainer.datamodule.controller, method, phase)
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

    def _save_gradient(self, trainer, pl_module) -> None:
        """The first optimizer step's gradient, gathered (a collective) and saved on rank 0: from the
        same weights and batch in every run of a rehearsal, it differs between them only by rounding,
        before AdamW's normalisation magnifies that into the update."""
        keep = self.save and trainer.is_global_zero
        grads = {n: full_tensor(p.grad).float().cpu() for n, p in pl_module.policy.named_parameters()
                 if p.grad is not None}
        if keep:
            self.out.mkdir(parents=True, exist_ok=True)
            torch.save(grads, self.out / "gradient_000.pt")

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
        self._check_engine(trainer, pl_module)
        if self.sigterm_at_batch is not None and batch_idx == self.sigterm_at_batch and trainer.is_global_zero:
            os.kill(os.getpid(), signal.SIGTERM)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.phases.enter("probe")
        self._on_before_optimizer_step(trainer, pl_module, optimizer)
        self.phases.enter("update")

    def _on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self._snap == 0:
            self._save_gradient(trainer, pl_module)
        self._snapshot(trainer, pl_module)
        if self.first_batch is not None:
            return
        if self._pending is not None:   # the step before this one was the first with a gradient
            self._check_first_step(pl_module)
            return
        # every rank gathers every gradient (no short cut: the gathers are collectives)
        nonzero = [bool(full_tensor(p.grad).ne(0).any()) for p in pl_module.policy.parameters() if p.grad is not None]
        if any(nonzero):
            params = list(pl_module.policy.named_parameters())
            self._pending = {"before": {n: full_tensor(p).detach().clone() for n, p in params},
                             "stepped": {n for n, p in params if p.grad is not None},
                             "optimizer": getattr(optimizer, "optimizer", optimizer), "batch": self._batch}

    def _check_first_step(self, pl_module) -> None:
        """`representable_moves` of the first step with a gradient, from the weights before it, the
        weights now and the optimizer's state after it (one tensor at a time)."""
        pending, self._pending = self._pending, None
        optimizer = pending["optimizer"]
        groups = {id(p): group for group in optimizer.param_groups for p in group["params"]}

        def tensors():   # the parameters that had a gradient (AdamW steps no other)
            for name, p in pl_module.policy.named_parameters():
                if name not in pending["stepped"]:
                    continue
                before, state, group = pending["before"].pop(name), optimizer.state.get(p), groups.get(id(p))
                delta = None if not state or group is None else adamw_update(
                    before, full_tensor(state["exp_avg"]), full_tensor(state["exp_avg_sq"]), float(state["step"]),
                    group["lr"], tuple(group["betas"]), group["eps"], group["weight_decay"])
                yield name, before, full_tensor(p).detach(), delta

        self.first_batch = {**representable_moves(tensors()), "batch": pending["batch"],
                            "without_gradient": sorted(set(pending["before"]) - pending["stepped"]),
                            "zero_gradient_batches_before": self.zero_gradient_batches}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.phases.enter("probe")
        if self.first_batch is None:
            if self._pending is not None:   # a batch of one optimizer step
                self._check_first_step(pl_module)
            else:                           # every group solved by all or none of its samples: no gradient
                self.zero_gradient_batches += 1
        self.phases.enter("rollout")

    def on_train_end(self, trainer, pl_module) -> None:
        self.phases.enter("probe")
        self._snapshot(trainer, pl_module)
        self.out.mkdir(parents=True, exist_ok=True)
        self.rss_mib["end"] = self._peak_rss_mib()
        self.rss_mib["phases"] = self.phases.stop()
        record = {"world_size": trainer.world_size, "global_step": trainer.global_step, "lrs": self.lrs,
                  "global_rank": trainer.global_rank, "node_rank": trainer.node_rank, "local_rank": trainer.local_rank,
                  "num_nodes": trainer.num_nodes, "env_local_rank": os.environ.get("LOCAL_RANK"),
                  "policy_loads": self.loads,
                  "engine": self.engine, "engine_checks": self.engine_checks, "peak_rss_mib": self.rss_mib,
                  "cross_rank_max_diff": self.cross_rank_max_diff, "first_batch": self.first_batch,
                  "is_weights": self.is_weights,
                  "warmup_steps": pl_module.hparams.warmup_steps, "lr": pl_module.hparams.lr,
                  "policy_model_type": pl_module.policy.config.model_type}
        (self.out / f"probe_rank{trainer.global_rank}.json").write_text(json.dumps(record, indent=1))
