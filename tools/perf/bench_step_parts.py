"""The parts of one rollout batch inside a real `fit`, and what the old-log-prob pass could save.

    python -m tools.perf.bench_step_parts [--config conf/tiny/grpo.yaml] [--batches 6] [--repeats 3]
        [--out parts.json] [-- <more fit arguments>]

Runs ``fit`` in this process with one extra callback. At the start of every rollout batch after
the first, on the batch the step is about to train on (the model untouched), it times - in turn,
`--repeats` times, so load changes hit each alike - the passes the old-log-prob stage is made of:

* ``old pass``: the module's own pre-update pass (policy log-probs + entropy, reference log-probs;
  the first mini-batch's policy rows are left to its update forward, ``model.old_logprobs:
  sampler`` leaves all of them);
* ``policy + entropy``, ``policy only``, ``reference``: the same micro-batches, one model each;
* ``first mini-batch forward``: the training forward of the first optimizer step's rows.

and checks the two facts the old-log-prob levers rest on, with no optimizer step between:

* the sampler's log-probs (``batch.rollout_logprobs``, recorded by the engine) against the
  trainer's old log-probs: max |difference| over response tokens (0 means bit-identical);
* the first mini-batch's training forward (train mode, with grad) against the old pass's values
  for the same rows (π_old = π_θ there): max |difference|.

It prints those next to the step's own ``timing/*`` (rollout, reward, old log-probs, update) and
the wall time per rollout batch (end of one batch to end of the next, this callback's own time
taken out).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from lightning.pytorch.callbacks import Callback

REPO = Path(__file__).resolve().parents[2]


def _max_abs_diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    m = mask.bool()
    return float((a.float() - b.float())[m].abs().max()) if m.any() else 0.0


class StepParts(Callback):
    """Times the old-log-prob pass's parts on each batch (after the first) before it trains."""

    def __init__(self, repeats: int) -> None:
        self.repeats = repeats
        self.records: list[dict[str, Any]] = []
        self._own_s = 0.0
        self._last_end: float | None = None

    @torch.no_grad()
    def _pass(self, module, batch, model, with_entropy: bool, epoch) -> None:
        for rows in epoch:  # the micro-batches of the module's pre-update pass
            for micro in module._micro_batches(batch, rows):
                module._logprobs(model, batch, micro, with_entropy=with_entropy)

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        if batch_idx == 0:
            return
        t_own = time.perf_counter()
        from aspo_lit.maths.update_plan import PreUpdate, minibatch_rows, rows_per_minibatch

        policy, ref = module.policy, module.ref_policy
        epoch = minibatch_rows(batch.input_ids.shape[0],
                               rows_per_minibatch(module.hparams.mini_batch_size, batch.group_size,
                                                  trainer.world_size))
        first = epoch[0]

        def old_pass():
            module._pre_update_pass(batch, epoch)

        def policy_entropy():
            policy.eval()
            self._pass(module, batch, policy, True, epoch)
            policy.train()

        def policy_only():
            policy.eval()
            self._pass(module, batch, policy, False, epoch)
            policy.train()

        def reference():
            if ref is not None:
                self._pass(module, batch, ref, False, epoch)

        def first_forward():
            for micro in module._micro_batches(batch, first):
                module._logprobs(policy, batch, micro, with_entropy=False)

        parts = {"old pass": old_pass, "policy + entropy": policy_entropy, "policy only": policy_only,
                 "reference": reference, "first mini-batch forward": first_forward}
        seconds: dict[str, list[float]] = {k: [] for k in parts}
        for _ in range(self.repeats):
            for name, fn in parts.items():
                t0 = time.perf_counter()
                fn()
                seconds[name].append(time.perf_counter() - t0)

        with mock.patch.object(PreUpdate, "leave_to_first_update", lambda pre, rows: None):
            old = module._pre_update_pass(batch, epoch).old_logprobs  # every row's old log-prob from the pass itself
        mask = batch.response_mask
        record: dict[str, Any] = {"batch": batch_idx, **{k: statistics.median(v) for k, v in seconds.items()}}
        if batch.rollout_logprobs is not None:
            record["sampler_vs_old_max_abs"] = _max_abs_diff(batch.rollout_logprobs, old, mask)
        train_lp = torch.cat([module._logprobs(policy, batch, micro, with_entropy=False)[0].detach()
                              for micro in module._micro_batches(batch, first)])
        order = torch.cat(module._micro_batches(batch, first))
        record["first_minibatch_vs_old_max_abs"] = _max_abs_diff(train_lp, old[order], mask[order])
        record["response_tokens"] = int(mask.sum())
        self.records.append(record)
        self._own_s += time.perf_counter() - t_own

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        now = time.perf_counter()
        if self._last_end is not None and self.records and self.records[-1]["batch"] == batch_idx:
            self.records[-1]["wall_s"] = now - self._last_end - self._own_s
            stats = getattr(outputs, "stats", {})  # StepOutput: timing/* are Stat values
            self.records[-1].update({k: float(v.value) for k, v in stats.items() if k.startswith("timing/")})
        self._own_s = 0.0
        self._last_end = time.perf_counter()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="conf/tiny/grpo.yaml")
    p.add_argument("--batches", type=int, default=6)
    p.add_argument("--steps-per-batch", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None)
    p.add_argument("fit_args", nargs="*", help="more `fit` arguments (after --)")
    args = p.parse_args(argv)

    import logging
    import warnings

    from aspo_lit.cli import ASPOCLI

    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    parts = StepParts(args.repeats)
    with tempfile.TemporaryDirectory(prefix="step_parts_") as tmp:
        cli = ASPOCLI(args=["--config", str(REPO / args.config),
                            f"--trainer.max_steps={args.batches * args.steps_per_batch}",
                            f"--trainer.logger.init_args.save_dir={tmp}", "--trainer.enable_progress_bar=false",
                            "--data.init_args.num_val=0", *args.fit_args], run=False)
        cli.trainer.callbacks.append(parts)
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)

    records = [r for r in parts.records if "wall_s" in r]
    keys = [k for k in records[0] if k not in ("batch",)]
    print(f"\n{args.config}: batches 2..{args.batches}, torch threads {torch.get_num_threads()}")
    print("\n| part | median s | share of the batch's wall time |")
    print("|---|---|---|")
    wall = statistics.median(r["wall_s"] for r in records)
    for k in keys:
        values = [r[k] for r in records if k in r]
        med = statistics.median(values)
        share = f"{100 * med / wall:.0f} %" if isinstance(med, float) and not k.endswith("max_abs") and k != "wall_s" \
            and "tokens" not in k else ""
        fmt = f"{max(values):.3g} (max)" if k.endswith("max_abs") else f"{med:.4f}"
        print(f"| {k} | {fmt} | {share} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"config": args.config, "records": records}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
