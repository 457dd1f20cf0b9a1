"""The paper's path on a real shape, each part of a rollout batch beside its floor.

    python -m tools.perf.paper_path [--batches 6] [--out runs/perf/paper_path] [FIT OVERRIDES ...]
    python -m tools.perf.paper_path --config conf/tiny/grpo.yaml [--out DIR]   # the demo's update against its floor

Other arguments go to the fit after the config's: ``--trainer.strategy.param_dtype=null`` computes
in fp32 on a CPU that emulates bf16 (without AVX-512 BF16: a 256 x 896 x 896 product takes 240 ms
in bf16 against 4 ms in fp32 on a 2-core AVX2 EPYC).

Runs ``conf/aspo.yaml`` as ``make rehearse CONFIGS=aspo_real_shape`` does (the CPU overlay and the
real-shape overlay: 2 ranks over gloo, FSDP2, the colocated vLLM engine with sleep mode, one per
rank, the weights pushed from memory before every rollout) on the random llama of a real 135M
checkpoint's shape (`tools/rehearsal/standins.py`), with one callback more, `Floors`, which
measures on the same ranks, the same batches and the same weights:

* the rollout's floor: vLLM's own ``LLM.generate`` on the batch's prompts, with the rollout's
  sampling parameters, called on the engine the rollout used, already awake (no push, no wake, no
  sleep, no packing), right after the rollout and before the update;
* the pre-update pass's floor: a bare no-grad forward of the batch's tokens through the policy and
  the reference, in the update's micro-batches (the pass itself skips the first mini-batch's
  policy rows, which the update's first forward gives: it can beat this floor);
* the update's floor: a bare forward and backward of the batch's tokens through the policy (the
  FSDP2 module, gradient checkpointing as configured), in the update's micro-batches, once per
  epoch: the next-token log-probs of the response columns, summed; no loss maths, no clipping, no
  optimizer step (the gradients are dropped).

Each floor runs in its own hook, so the batch's accounting shows its seconds as the callback's
(``timing/callback/Floors_s``), and the table leaves them out of the batch. It prints, per part of
the batch (means over the batches after the first, max over ranks as ``timing/*`` is logged): the
seconds, the floor where there is one, and the overhead above it; the push's bytes and seconds,
and how vLLM's reload splits between the gathers and casts of the weight stream and vLLM's loader;
and how the update splits (`UpdateSplit`: its forwards, the loss maths, the backwards, the
gradient clip, the optimizer step, and the rest: the record, the statistics, the finite checks).
``--config FILE`` runs that config as it is instead (no overlay, no stand-in); on the transformers
engine (the demo's) there is no generation floor and no push, and the table prints the pre-update
pass and the update against theirs. On CPU vLLM cannot sleep (its sleep and wake calls are
no-ops), so wake and sleep measure the calls' own cost only; the floor's ``LLM.generate`` needs the weights the rollout left (sleep level 2 on a
GPU discards them), so the tool runs on CPU only.
"""

from __future__ import annotations

import argparse
import csv
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback

REPO = Path(__file__).resolve().parents[2]
REHEARSAL = "aspo_real_shape"   # the fit is this rehearsal's: its config files, overlays and stand-in


def _engine(trainer):
    controller = trainer.datamodule.controller
    return controller, controller.engine


def _prompt_ids(batch) -> list[list[int]]:
    """Each group's prompt, its left padding removed (rows g·G ... g·G + G − 1 share it)."""
    P, G = batch.prompt_length, batch.group_size
    return [ids[mask.bool()].tolist() for ids, mask in zip(batch.input_ids[::G, :P], batch.attention_mask[::G, :P])]


def _time_the_gathers() -> None:
    """Split the push: what the engine's weight stream spends producing each tensor (the FSDP2
    gather and the cast to the engine's dtype, `VLLMEngine._stream`) is summed into the engine's
    ``gather_s``; the rest of vLLM's in-place reload is its loader's (re-packing for its kernels)."""
    from aspo_lit.rollout.vllm import VLLMEngine

    stream = VLLMEngine._stream
    if getattr(stream, "timed", False):
        return

    def timed(self, named_tensors):
        self.gather_s, tensors = 0.0, stream(self, named_tensors)
        while True:
            start = time.perf_counter()
            item = next(tensors, None)
            self.gather_s += time.perf_counter() - start
            if item is None:
                return
            yield item

    timed.timed = True
    VLLMEngine._stream = timed


#: the update's parts `UpdateSplit` times: (the module's method, the part's key); the clip is
#: ``torch.nn.utils.clip_grad_norm_`` inside ``_clip_and_step``, whose rest is the optimizer step
SPLIT = (("_logprobs", "update_forward_s"), ("_encode_prompts", "update_forward_s"),
         ("_micro_batch_loss", "update_loss_s"), ("manual_backward", "update_backward_s"),
         ("_clip_and_step", "update_step_s"))
SPLIT_KEYS = ("update_total_s", "update_forward_s", "update_loss_s", "update_backward_s", "update_clip_s",
              "update_step_s")


class UpdateSplit:
    """Times the parts of the module's update (``ASPOModule._update_minibatch``) by wrapping the
    module's own methods on the instance: only calls made inside the update count (the pre-update
    pass runs the same forward). ``seconds`` holds the batch's sums; ``update_step_s`` is
    ``_clip_and_step`` less the clip (the finite check's all-reduce, AdamW's step, zero_grad)."""

    def __init__(self, pl_module) -> None:
        self.seconds = dict.fromkeys(SPLIT_KEYS, 0.0)
        self.inside = False
        self._wrap(pl_module, "_update_minibatch", "update_total_s", always=True)
        for method, key in SPLIT:
            self._wrap(pl_module, method, key)
        clip = torch.nn.utils.clip_grad_norm_

        def timed_clip(*args, **kwargs):
            start = time.perf_counter()
            try:
                return clip(*args, **kwargs)
            finally:
                if self.inside:
                    seconds = time.perf_counter() - start
                    self.seconds["update_clip_s"] += seconds
                    self.seconds["update_step_s"] -= seconds   # counted in `_clip_and_step`'s time

        torch.nn.utils.clip_grad_norm_ = timed_clip

    def _wrap(self, obj, method: str, key: str, always: bool = False) -> None:
        original = getattr(obj, method)

        def timed(*args, **kwargs):
            if not (self.inside or always):
                return original(*args, **kwargs)
            outer, self.inside = self.inside, True
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.inside = outer
                self.seconds[key] += time.perf_counter() - start

        setattr(obj, method, timed)

    def reset(self) -> dict[str, float]:
        """The sums since the last reset, and zero them."""
        out, self.seconds = self.seconds, dict.fromkeys(SPLIT_KEYS, 0.0)
        return out


class Floors(Callback):
    """The floors of a rollout batch's generation and update on the same work (module docstring),
    one JSON line per batch in ``<out_dir>/floors_rank<r>.jsonl``; also the push's split (gather and
    cast against vLLM's load)."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = Path(out_dir)
        self.row: dict = {}
        self.split: UpdateSplit | None = None
        _time_the_gathers()

    def on_train_start(self, trainer, pl_module) -> None:
        self.split = UpdateSplit(pl_module)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        controller, engine = _engine(trainer)
        self.row = {"batch": batch_idx, "rollout_tokens": int(batch.response_lengths.sum())}
        if hasattr(engine, "llm"):               # the transformers engine has no floor of its own
            self.row.update(self._generate_floor(controller, engine, pl_module, batch, batch_idx))
        self.row["old_floor_s"] = self._forward_floor(trainer, pl_module, batch)
        self.split.reset()                       # the update's split counts this batch's update only

    @staticmethod
    def _generate_floor(controller, engine, pl_module, batch, batch_idx) -> dict:
        """vLLM's own ``LLM.generate`` on the batch's prompts, and the push's bytes and seconds."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        sampling = controller.settings.sampling(0)
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in _prompt_ids(batch)]
        params = SamplingParams(n=batch.group_size, temperature=sampling.temperature, top_p=sampling.top_p,
                                max_tokens=sampling.max_tokens, seed=batch_idx,
                                logprobs=0 if sampling.logprobs else None, skip_special_tokens=True)
        engine.wake()                            # untimed: the floor is generation alone
        with engine._engine_context(None):       # the trainer's RNG and threads, restored after
            start = time.perf_counter()
            outputs = engine.llm.generate(prompts, [params] * len(prompts), use_tqdm=False)
            seconds = time.perf_counter() - start
        engine.sleep()
        itemsize = torch.empty(0, dtype=engine.model_dtype).element_size()
        pushed = sum(t.numel() for n, t in pl_module.policy.state_dict().items()
                     if not (engine.tied_embeddings and n == "lm_head.weight")) * itemsize
        return {"generate_floor_s": seconds, "floor_tokens": sum(len(o.token_ids) for r in outputs for o in r.outputs),
                "push_bytes": pushed, "push_s": engine.last_sync_s, "push_info": engine.last_sync_info,
                "push_gather_s": getattr(engine, "gather_s", None),
                "push_reload_s": engine.last_sync_info.get("reload_s")}

    @staticmethod
    def _micro_batches(trainer, pl_module, batch, epochs: int):
        """The update's micro-batches of the batch (its mini-batches in order: no shuffle, so the
        run's random stream is untouched), each as trimmed ``(input_ids, attention_mask)``."""
        from aspo_lit.maths.microbatch import trim_to_micro_batch
        from aspo_lit.maths.update_plan import epoch_minibatches, rows_per_minibatch

        hp = pl_module.hparams
        rows_per_step = rows_per_minibatch(hp.mini_batch_size, batch.group_size, trainer.world_size)
        for rows in epoch_minibatches(batch.input_ids.shape[0], rows_per_step, epochs, None):
            for micro in pl_module._micro_batches(batch, rows.to(batch.input_ids.device)):
                yield trim_to_micro_batch(batch.input_ids, batch.attention_mask, batch.prompt_length,
                                          batch.response_lengths, micro)

    @staticmethod
    def _response_logprobs(model, ids, mask, prompt_length: int):
        """The bare next-token log-probs of the response columns (full-vocabulary logits of those
        positions only, fp32 log-softmax), masked."""
        keep = ids.shape[1] - prompt_length + 1      # the positions that predict a response token
        logits = model(input_ids=ids, attention_mask=mask, logits_to_keep=keep).logits[:, :-1].float()
        logprobs = torch.log_softmax(logits, -1).gather(-1, ids[:, prompt_length:].unsqueeze(-1)).squeeze(-1)
        return logprobs * mask[:, prompt_length:]

    def _forward_floor(self, trainer, pl_module, batch) -> float:
        """A bare no-grad forward of every row through the policy and the reference."""
        models = [m for m in (pl_module.policy, pl_module.ref_policy) if m is not None]
        was_training = pl_module.policy.training
        pl_module.policy.eval()
        start = time.perf_counter()
        with torch.no_grad():
            for ids, mask in self._micro_batches(trainer, pl_module, batch, epochs=1):
                for model in models:
                    self._response_logprobs(model, ids, mask, batch.prompt_length)
        seconds = time.perf_counter() - start
        pl_module.policy.train(was_training)
        return seconds

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        policy, start, micro_batches = pl_module.policy, time.perf_counter(), 0
        for ids, mask in self._micro_batches(trainer, pl_module, batch, epochs=pl_module.hparams.ppo_epochs):
            self._response_logprobs(policy, ids, mask, batch.prompt_length).sum().backward()
            micro_batches += 1
        seconds = time.perf_counter() - start
        for p in policy.parameters():
            p.grad = None
        self.row.update(update_floor_s=seconds, floor_micro_batches=micro_batches, **self.split.reset())
        self.out_dir.mkdir(parents=True, exist_ok=True)
        with (self.out_dir / f"floors_rank{trainer.global_rank}.jsonl").open("a") as f:
            f.write(json.dumps(self.row) + "\n")


#: the parts of a rollout batch, in its order, and the floor each is measured against
PARTS = [("timing/engine_wake_s", "wake", None), ("timing/weight_sync_s", "push", None),
         ("timing/rollout_s", "generate", "generate_floor_s"), ("timing/engine_sleep_s", "sleep", None),
         ("timing/reward_s", "reward", None),
         ("timing/old_logprob_s", "old and reference log-probs", "old_floor_s"),
         ("timing/update_s", "update", "update_floor_s"), ("timing/checkpoint_s", "checkpoint", None)]
#: what else the accounting holds: (row, the keys it adds, the keys it takes away)
OTHER = [("the DataModule's other work (packing, advantages, tokenising)", ["timing/data_s"],
          ["timing/engine_wake_s", "timing/weight_sync_s", "timing/rollout_s", "timing/engine_sleep_s",
           "timing/reward_s"]),
         ("the training step's other work (hooks, the plan)", ["timing/train_step_s"],
          ["timing/old_logprob_s", "timing/update_s"]),
         ("the callbacks (Floors left out)", ["timing/callback/"], ["timing/callback/Floors_s"]),
         ("Lightning's loop, other hooks, the loader, what no hook covers",
          ["timing/loop_s", "timing/hooks_s", "timing/fetch_s", "timing/validation_s", "timing/unprofiled_s"], [])]


def _batches(metrics_csv: Path) -> list[dict[str, float]]:
    rows = [r for r in csv.DictReader(metrics_csv.open()) if r.get("timing/batch_s")]
    return [{k: float(v) for k, v in r.items() if k.startswith("timing/") and v} for r in rows]


def _floors(out_dir: Path) -> list[dict]:
    """Per batch, each floor's maximum over ranks (the slower rank sets the pace, as for timing/*)."""
    per_rank = [[json.loads(line) for line in p.read_text().splitlines()] for p in sorted(out_dir.glob("floors_rank*.jsonl"))]
    out = []
    for rows in zip(*per_rank):
        merged = dict(rows[0])
        for key in ("old_floor_s", "update_floor_s"):
            merged[key] = max(r[key] for r in rows)
        # where measured: the generation floor and the push (vLLM only), the splits
        for key in ("generate_floor_s", "push_s", "push_gather_s", "push_reload_s", *SPLIT_KEYS):
            if all(r.get(key) is not None for r in rows):
                merged[key] = max(r[key] for r in rows)
        for key in ("floor_tokens", "rollout_tokens"):
            if all(r.get(key) is not None for r in rows):
                merged[key] = sum(r[key] for r in rows)
        out.append(merged)
    return out


def table(batches: list[dict[str, float]], floors: list[dict], skip_first: int = 1) -> str:
    """The Markdown table: each part's mean seconds, its share of the batch (the floors' callback
    left out), its floor and the overhead above it. Every ``timing/*`` key is the slowest rank's, so
    the rows can add up to a little more than the batch."""
    batches, floors = batches[skip_first:], floors[skip_first:]

    def mean(key: str, rows: list[dict]) -> float:
        if key.endswith("/"):
            return sum(mean(k, rows) for k in rows[0] if k.startswith(key))
        # a timing key a run does not log (an engine without sleep mode) is 0 s; a floor must be there
        return statistics.fmean(r.get(key, 0.0) if key.startswith("timing/") else r[key] for r in rows)

    whole = mean("timing/batch_s", batches) - mean("timing/callback/Floors_s", batches)
    lines = ["| part | s per batch | share | floor, s | above the floor |", "|---|--:|--:|--:|--:|"]
    floor_sum = 0.0
    vllm = all(f.get("generate_floor_s") is not None for f in floors)   # the transformers engine has no floor
    for key, name, floor_key in PARTS:
        seconds = mean(key, batches)
        cells = ["", ""]
        if floor_key and (vllm or floor_key != "generate_floor_s"):
            floor = mean(floor_key, floors)
            floor_sum += floor
            cells = [f"{floor:.3f}", f"{seconds - floor:+.3f} s ({seconds / floor - 1:+.0%})"]
        lines.append(f"| {name} | {seconds:.3f} | {seconds / whole:.0%} | " + " | ".join(cells) + " |")
    for name, plus, minus in OTHER:
        seconds = sum(mean(k, batches) for k in plus) - sum(mean(k, batches) for k in minus)
        lines.append(f"| {name} | {seconds:.3f} | {seconds / whole:.0%} | | |")
    lines.append(f"| **the batch** | **{whole:.3f}** | 100% | {floor_sum:.3f} (the floors) | "
                 f"{whole - floor_sum:+.3f} s ({whole / floor_sum - 1:+.0%}) |")
    lines += ["", f"Batches {skip_first + 1}-{skip_first + len(batches)}. Generated tokens per batch, all ranks: "
              f"rollout {mean('rollout_tokens', floors):.0f}"]
    if vllm:
        push_mib, push_s = mean("push_bytes", floors) / 2**20, mean("timing/weight_sync_s", batches)
        lines[-1] += (f", floor {mean('floor_tokens', floors):.0f}. Push: {push_mib:.1f} MiB a rank "
                      f"(the engine's dtype), {push_s:.3f} s ({push_mib / max(push_s, 1e-9):.0f} MiB/s).")
    else:
        lines[-1] += ". The engine is not vLLM: no generation floor, no push."
    if all(f.get("push_gather_s") is not None and f.get("push_reload_s") is not None for f in floors):
        gather, reload = mean("push_gather_s", floors), mean("push_reload_s", floors)
        lines[-1] += (f" Of vLLM's reload, {reload:.3f} s: the gathers and casts {gather:.3f} s, its loader "
                      f"{reload - gather:.3f} s (the slower rank's of each).")
    if all(all(f.get(k) is not None for k in SPLIT_KEYS) for f in floors):
        split = {k: mean(k, floors) for k in SPLIT_KEYS}
        parts = {"forwards": split["update_forward_s"], "loss maths": split["update_loss_s"],
                 "backwards": split["update_backward_s"], "gradient clip": split["update_clip_s"],
                 "optimizer step (with the finite check and zero_grad)": split["update_step_s"]}
        rest = split["update_total_s"] - sum(parts.values())
        bare = split["update_forward_s"] + split["update_backward_s"]
        lines += ["", f"The update, {split['update_total_s']:.3f} s (the slower rank's of each part): "
                  + ", ".join(f"{name} {s:.3f} s" for name, s in parts.items())
                  + f", the rest (the record, the statistics, the finite checks) {rest:.3f} s. Its forwards and "
                  f"backwards, {bare:.3f} s, against the update's floor, {mean('update_floor_s', floors):.3f} s."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=6,
                        help="rollout batches an epoch (--trainer.limit_train_batches; the first is left out of the "
                        "means); a config with max_steps stops there")
    parser.add_argument("--out", type=Path, default=REPO / "runs/perf/paper_path")
    parser.add_argument("--config", help="run this config as it is instead of the real-shape rehearsal (e.g. "
                        "conf/tiny/grpo.yaml, all 40 of its batches: the transformers engine, so no generation floor "
                        "and no push)")
    args, overrides = parser.parse_known_args(argv)

    from tools.rehearsal.run import CONFIGS, ENV, overlays, run_overrides, write_data

    out = args.out.resolve()
    if args.config:
        files, extra = [args.config], []
    else:
        configs = CONFIGS[REHEARSAL]
        files = configs + overlays(configs, REHEARSAL)
        _, extra = run_overrides(REHEARSAL)  # builds the stand-in: --model.model_name_or_path=<its folder>
        write_data(args.out)
    shutil.rmtree(out, ignore_errors=True)   # a stale last.ckpt would be resumed
    fit = [sys.executable, "-m", "aspo_lit", "fit", *sum((["--config", c] for c in files), []),
           *extra, f"--trainer.limit_train_batches={args.batches}",
           f"--trainer.logger.init_args.save_dir={out}", "--trainer.callbacks+=tools.perf.paper_path.Floors",
           f"--trainer.callbacks.init_args.out_dir={out / 'floors'}", *overrides]
    print(" ".join(fit), flush=True)
    start = time.perf_counter()
    subprocess.run(fit, cwd=REPO, env=ENV, check=True)
    print(f"fit: {time.perf_counter() - start:.0f} s")
    metrics = next(out.rglob("metrics.csv"))
    print(table(_batches(metrics), _floors(out / "floors")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
