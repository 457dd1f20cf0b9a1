"""aspo-lit against TRL's GRPOTrainer on the same work: seconds per rollout batch, and their ratio.

    pip install -e ".[perf]"        # TRL (the `perf` extra; never needed by `make test`)
    python -m tools.perf.bench_peer [--shapes demo,long] [--rounds 3] [--lengths 10 30]
        [--long-lengths 2 6] [--checkpoint off|config] [--default-kv-cache] [--torch-threads N]
        [--kernels native,default,avx2,mkl-avx2] [--out results.json]

Per shape and round it runs four training runs in this one process - aspo-lit and TRL, each for a
short and a long number of rollout batches - and takes ``(t_long - t_short) / (n_long - n_short)``
as the seconds per rollout batch, so start-up (imports aside: both are imported before the
first run), model loading and the first step's warm-up cancel. The order alternates between
rounds (aspo-lit first, then TRL first), so a change of load on a shared machine hits both sides.
It prints each round's per-batch seconds and ratio (aspo-lit / TRL) side by side, and the median.
Next to it, the steady-state seconds per batch inside the long run (end of its first rollout
batch to end of its last, over n_long - 1 batches), which start-up noise cannot reach.
``--default-kv-cache`` adds a third side: aspo-lit with transformers' own KV cache instead of the
engine's (``aspo_lit/rollout/kv_cache.py``), the code before that change, under the same load.

Shapes (the configs are read, not restated: batch shape, sampling and optimiser come from them):

* ``demo``: ``conf/tiny/grpo.yaml``, the ``testbed`` model and its arithmetic prompts: 32 prompts
  x G = 8, <= 64 new tokens, 4 mini-batches of 64 responses (one optimizer step each), 1 epoch,
  k3 KL (beta 0.001).
* ``long``: ``conf/tiny/aspo_long.yaml`` with the GRPO loss (TRL has no ASPO), the
  ``testbed-long`` model (shipped with the package) and its multi-step chains: 16 prompts x G = 8,
  <= 320 new tokens.

What makes the two loops equal work:

* the same model weights (fp32, CPU), tokenizer and chat-templated prompt ids (the bench checks
  that TRL's tokenisation of the first prompt equals aspo-lit's ``encode_prompt``), prompts drawn
  from the same generated training rows, the same reward (the config's ``data.init_args.reward``,
  ``MathReward(verifier="either")`` in the demo: the grader the DataModule uses, one instance per
  run), sampling at the config's temperature / top-p with no top-k, and the same maximum number of
  new tokens;
* per rollout batch: 256 responses sampled with the KV cache (TRL: transformers' ``generate``;
  aspo-lit: its engine's sampling loop, ``aspo_lit/rollout/decode.py``, the same samples as
  ``generate`` with one prefill per prompt and finished rows out of the batch), the policy's old
  log-probs (TRL computes them too, since its 4 optimizer steps per generation make every step
  after the first off-policy: ``steps_per_generation=4 > gradient_accumulation_steps=1``;
  aspo-lit takes the first mini-batch's from its own update forward, where π_old = π_θ), one
  reference-model pass, then 4 optimizer steps of 64
  responses each with one forward/backward per step (aspo-lit's token budget puts each
  mini-batch in one micro-batch), clipped-ratio loss with eps 0.2, per-sequence token mean
  (aspo-lit ``seq-mean-token-mean`` = TRL ``loss_type="grpo"``), k3 KL to the reference with the
  config's beta, AdamW with the config's lr / weight decay / betas, gradient-norm clip 1.0,
  constant learning rate (the config's one-batch warm-up is no warm-up);
* neither evaluates during training (aspo-lit's ``num_val=0``) nor writes a checkpoint
  (``--checkpoint off``, the default, removes ``RunCheckpoint`` from aspo-lit's callbacks; TRL's
  ``save_strategy="no"``). ``--checkpoint config`` keeps the config's checkpoint cadence
  (every rollout batch in the demo) to measure its share.

What differs, and why it is left so:

* each side keeps its own per-step bookkeeping: aspo-lit's callbacks (training stats, entropy,
  repetition, health, token-weight surface, LR monitor, run summary, CSV logger) and TRL's
  metrics (entropy, clip ratios, KL, completion lengths, logged every 4 optimizer steps) - that is
  what a user of each gets;
* aspo-lit records the sampler's log-prob of every sampled token during generation (a log-softmax
  per decoding step; it logs the sampler/trainer mismatch) and generates the 256 rows in the
  engine's ``max_batch_size`` chunks (64); TRL generates all 256 rows in one ``generate`` call;
* aspo-lit's old-log-prob pass also returns the entropy (its loss options and diagnostics read it);
  TRL computes the entropy in the training forward instead;
* the random streams differ, so the two runs sample different responses and learn along different
  paths (response lengths drift differently; the shapes' lengths are bounded by the config);
  group advantages: aspo-lit's ``(R - mean) / (std + 1e-6)``, TRL's ``/ (std + 1e-4)``.

``--kernels`` runs the whole benchmark once per CPU kernel setting, each in a fresh process (torch
and MKL read these variables at import): ``native`` (what the machine picks), ``default`` (torch's
scalar kernels, ``ATEN_CPU_CAPABILITY=default``), ``avx2`` (``ATEN_CPU_CAPABILITY=avx2``) and
``mkl-avx2`` (``MKL_ENABLE_INSTRUCTIONS=AVX2``): the settings ``make test-numerics`` runs under, since
another user's CPU picks other kernels. It prints each setting's rounds and then the ratios of all
settings side by side, so that a speed-up that holds under one kernel set only shows as such.

Run it on a quiet machine, or at least read the load it prints (``os.getloadavg`` before each run).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import Callback

from tools.perf.batch_accounting import stage_means

REPO = Path(__file__).resolve().parents[2]


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    config: str
    extra_args: tuple[str, ...]
    lengths: tuple[int, int]


#: The CPU kernel settings ``--kernels`` runs under (the environment of each one's process).
KERNELS = {
    "native": {},
    "default": {"ATEN_CPU_CAPABILITY": "default"},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2"},
    "mkl-avx2": {"MKL_ENABLE_INSTRUCTIONS": "AVX2"},
}

SHAPES = {
    "demo": Shape("demo", "conf/tiny/grpo.yaml", (), (10, 30)),
    "long": Shape("long", "conf/tiny/aspo_long.yaml", ("--model.loss=grpo",), (2, 6)),
}


# --------------------------------------------------------------------------- the config, read once

def merged_config(config: str) -> dict[str, Any]:
    """The config file and its bases (``config: base.yaml``), merged as the CLI merges them."""
    from omegaconf import OmegaConf

    from aspo_lit.cli import expand_base_configs

    words = expand_base_configs(["--config", str(REPO / config)])
    files = [OmegaConf.load(words[i + 1]) for i in range(0, len(words), 2)]
    merged = OmegaConf.merge(*files)
    # a file that names another data class_path starts its init_args afresh (as jsonargparse does)
    data_class, init_args = None, OmegaConf.create({})
    for f in files:
        data = f.get("data") or {}
        if "class_path" in data and data["class_path"] != data_class:
            data_class, init_args = data["class_path"], OmegaConf.create({})
        init_args = OmegaConf.merge(init_args, data.get("init_args") or {})
    merged.data.init_args = init_args
    return OmegaConf.to_container(merged, resolve=True)


@dataclasses.dataclass
class Work:
    """The work of one rollout batch, from the config (both sides run it)."""

    model_dir: str
    rows: list[dict[str, Any]]
    batch_size: int
    group_size: int
    mini_batch_size: int
    max_prompt_length: int
    max_response_length: int
    temperature: float
    top_p: float
    seed: int
    ppo_epochs: int
    kl_coef: float
    eps_low: float
    eps_high: float
    lr: float
    weight_decay: float
    betas: tuple[float, float]
    max_grad_norm: float
    warmup_batches: int
    adv_norm: str
    callbacks: list[Any]
    reward: Any   # the config's ``data.init_args.reward`` (a class_path dict), or the task's default

    def make_reward(self) -> Any:
        """The reward the fit grades with, for TRL's side."""
        return instantiate(self.reward) if isinstance(self.reward, dict) else self.reward

    @property
    def steps_per_batch(self) -> int:
        return self.ppo_epochs * self.batch_size // self.mini_batch_size


def instantiate(spec: dict[str, Any]) -> Any:
    """The object a config's ``{class_path, init_args}`` names (Lightning's ``instantiate_class``;
    ``init_args: null`` is no arguments, as for the CLI)."""
    from lightning.pytorch.cli import instantiate_class

    return instantiate_class((), {**spec, "init_args": spec.get("init_args") or {}})


def load_work(shape: Shape) -> Work:
    from aspo_lit.training.models import resolve_model_path

    cfg = merged_config(shape.config)
    model, data = cfg["model"], cfg["data"]
    loss = dict(model.get("loss_kwargs") or {})
    for arg in shape.extra_args:  # only "--model.loss=..." is used by the shapes
        key, value = arg.removeprefix("--").split("=", 1)
        if key != "model.loss":
            raise ValueError(f"unsupported extra argument {arg}")
        model["loss"] = value
    if model["loss"] != "grpo" or loss.get("loss_agg", "seq-mean-token-mean") != "seq-mean-token-mean":
        raise ValueError(f"{shape.config}: TRL's loss_type='grpo' matches loss grpo with seq-mean-token-mean, "
                         f"not {model['loss']} / {loss.get('loss_agg')}")
    if model.get("kl_kind", "k3") not in ("k3", "low_var_kl"):
        raise ValueError(f"{shape.config}: TRL's KL is k3, the config's is {model.get('kl_kind')}")
    init = dict(data["init_args"])
    datamodule = instantiate({"class_path": data["class_path"], "init_args": init})
    hp = datamodule.hparams
    if hp.batch_size % model["mini_batch_size"]:
        raise ValueError("batch_size must be a multiple of mini_batch_size")
    return Work(
        model_dir=resolve_model_path(model["model_name_or_path"]),
        rows=datamodule.task.rows("train"),
        batch_size=hp.batch_size, group_size=hp.group_size, mini_batch_size=model["mini_batch_size"],
        max_prompt_length=hp.max_prompt_length, max_response_length=hp.max_response_length,
        temperature=hp.temperature, top_p=hp.top_p, seed=int(cfg.get("seed_everything", 0)),
        ppo_epochs=model.get("ppo_epochs", 1), kl_coef=model["kl_coef"],
        eps_low=loss.get("eps_low", 0.2), eps_high=loss.get("eps_high", 0.2),
        lr=model["lr"], weight_decay=model.get("weight_decay", 0.1),
        betas=tuple(model.get("betas", (0.9, 0.999))), max_grad_norm=model.get("max_grad_norm", 1.0),
        warmup_batches=model.get("warmup_steps", 10), adv_norm=hp.adv_norm,
        callbacks=list(cfg["trainer"].get("callbacks") or []),
        reward=init.get("reward") or datamodule.task.default_reward(),
    )


# --------------------------------------------------------------------------- clocks

#: how the fit's config names `BatchClock` (this module runs as ``__main__``: not its own name)
CLOCK_CLASS_PATH = "tools.perf.bench_peer.BatchClock"


class BatchClock(Callback):
    """The wall clock at the end of every rollout batch, written to `path` when the fit ends
    (named in the run's config by ``class_path: tools.perf.bench_peer.BatchClock``)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.ends: list[float] = []

    def on_train_batch_end(self, *args: Any) -> None:
        self.ends.append(time.perf_counter())

    def on_fit_end(self, *args: Any) -> None:
        Path(self.path).write_text(json.dumps(self.ends))


def steady_s_per_batch(ends: list[float]) -> float:
    """Seconds per rollout batch from the end of the first to the end of the last."""
    return (ends[-1] - ends[0]) / (len(ends) - 1) if len(ends) > 1 else float("nan")


def trl_clock(steps_per_batch: int, ends: list[float]):
    """A transformers ``TrainerCallback``: the wall clock at the end of every rollout batch
    (every `steps_per_batch`-th optimizer step; TRL generates at the first step of each)."""
    from transformers import TrainerCallback

    class _Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step % steps_per_batch == 0:
                ends.append(time.perf_counter())

    return _Clock()


# --------------------------------------------------------------------------- aspo-lit

def _is_checkpoint(callback: Any) -> bool:
    path = callback if isinstance(callback, str) else callback.get("class_path", "")
    return path.endswith(("RunCheckpoint", "ModelCheckpoint"))


def run_aspo(shape: Shape, work: Work, batches: int, tmp: Path, checkpoint: bool, tag: str,
             default_kv_cache: bool = False) -> tuple[float, list[float], Path]:
    """One `fit` of `batches` rollout batches in this process: wall seconds, the end time of
    every rollout batch, and its metrics.csv."""
    import yaml

    from aspo_lit.__main__ import main
    from aspo_lit.rollout import kv_cache

    clock = tmp / f"{tag}.clock.json"
    callbacks = [c for c in work.callbacks if checkpoint or not _is_checkpoint(c)]
    callbacks.append({"class_path": CLOCK_CLASS_PATH, "init_args": {"path": str(clock)}})
    override = tmp / f"{tag}.yaml"
    override.write_text(yaml.safe_dump({"trainer": {"callbacks": callbacks}}))
    args = ["fit", "--config", str(REPO / shape.config), *shape.extra_args, "--config", str(override),
            f"--trainer.max_steps={batches * work.steps_per_batch}",
            f"--trainer.logger.init_args.save_dir={tmp}", f"--trainer.logger.init_args.name={tag}",
            "--trainer.logger.init_args.version=0",
            "--trainer.enable_progress_bar=false", "--data.init_args.num_val=0"]
    engine_cache = kv_cache.growing_kv_cache
    if default_kv_cache:
        kv_cache.growing_kv_cache = lambda model, limit: None  # generate() builds transformers' own
    try:
        t0 = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):
            code = main(args)
        seconds = time.perf_counter() - t0
    finally:
        kv_cache.growing_kv_cache = engine_cache
    if code != 0:
        raise RuntimeError(f"aspo-lit fit failed ({code}): {' '.join(args)}")
    return seconds, json.loads(clock.read_text()), tmp / tag / "version_0" / "metrics.csv"


# --------------------------------------------------------------------------- TRL

def trl_dataset(work: Work, tokenizer):
    """The training rows as TRL conversational prompts, with aspo-lit's prompt-length filter."""
    from datasets import Dataset

    from aspo_lit.prompts import encode_prompt, instruct

    kept = [r for r in work.rows if len(encode_prompt(r["problem"], tokenizer)) <= work.max_prompt_length]
    return Dataset.from_list([{"prompt": [{"role": "user", "content": instruct(r["problem"])}],
                               "answer": r["answer"]} for r in kept])


def check_same_prompt_ids(work: Work, tokenizer) -> None:
    """TRL's tokenisation of a conversational prompt must be aspo-lit's ``encode_prompt``."""
    from aspo_lit.prompts import encode_prompt, instruct

    row = work.rows[0]
    ours = encode_prompt(row["problem"], tokenizer)
    theirs = tokenizer.apply_chat_template([[{"role": "user", "content": instruct(row["problem"])}]],
                                           add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"][0]
    if list(theirs) != list(ours):
        raise RuntimeError(f"TRL would see other prompt ids than aspo-lit: {list(theirs)[:20]} vs {ours[:20]}")


def trl_config(work: Work, batches: int, out_dir: Path):
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=str(out_dir), use_cpu=True, bf16=False, fp16=False, seed=work.seed,
        model_init_kwargs={"dtype": "float32"},
        max_steps=batches * work.steps_per_batch,
        per_device_train_batch_size=work.mini_batch_size * work.group_size,
        gradient_accumulation_steps=1,
        steps_per_generation=work.batch_size // work.mini_batch_size,
        num_iterations=work.ppo_epochs,
        num_generations=work.group_size,
        max_completion_length=work.max_response_length,
        temperature=work.temperature, top_p=work.top_p, top_k=0,
        beta=work.kl_coef, epsilon=work.eps_low, epsilon_high=work.eps_high,
        loss_type="grpo", scale_rewards="group" if work.adv_norm == "std" else "none",
        learning_rate=work.lr, weight_decay=work.weight_decay, adam_beta1=work.betas[0],
        adam_beta2=work.betas[1], max_grad_norm=work.max_grad_norm,
        lr_scheduler_type="constant" if work.warmup_batches <= 1 else "constant_with_warmup",
        warmup_steps=0 if work.warmup_batches <= 1 else (work.warmup_batches - 1) * work.steps_per_batch,
        logging_steps=work.steps_per_batch, save_strategy="no", report_to="none",
        disable_tqdm=True, dataloader_num_workers=0, log_completions=False,
    )


def run_trl(work: Work, batches: int, tmp: Path, tag: str) -> tuple[float, list[float]]:
    """One GRPOTrainer run of `batches` rollout batches: wall seconds (construction included) and
    the end time of every rollout batch."""
    from transformers import AutoTokenizer
    from trl import GRPOTrainer

    t0 = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(work.model_dir)
    reward = work.make_reward()

    def math_reward(completions, answer, **_: Any) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return reward.batch(texts, answer)

    ends: list[float] = []
    try:
        trainer = GRPOTrainer(model=work.model_dir, reward_funcs=math_reward,
                              args=trl_config(work, batches, tmp / tag),
                              train_dataset=trl_dataset(work, tokenizer), processing_class=tokenizer,
                              callbacks=[trl_clock(work.steps_per_batch, ends)])
        with contextlib.redirect_stdout(io.StringIO()):
            trainer.train()
    finally:
        getattr(reward, "close", lambda: None)()
    return time.perf_counter() - t0, ends


# --------------------------------------------------------------------------- rounds

SIDE_NAMES = {"aspo": "aspo-lit", "trl": "TRL", "aspo-default-kv": "aspo-lit, transformers' KV cache"}


def bench_shape(shape: Shape, rounds: int, lengths: tuple[int, int], checkpoint: bool, sides: tuple[str, ...],
                tmp: Path) -> dict[str, Any]:
    from transformers import AutoTokenizer

    work = load_work(shape)
    check_same_prompt_ids(work, AutoTokenizer.from_pretrained(work.model_dir))
    short, long = lengths
    results = []
    print(f"\n[{shape.name}] {shape.config} {' '.join(shape.extra_args)}: {work.batch_size} prompts x G={work.group_size}, "
          f"<= {work.max_response_length} new tokens, {work.steps_per_batch} mini-batches of "
          f"{work.mini_batch_size * work.group_size}; runs of {short} and {long} rollout batches", flush=True)
    for r in range(rounds):
        order = sides[r % len(sides):] + sides[:r % len(sides)]  # each side leads in turn
        seconds: dict[tuple[str, int], float] = {}
        steady: dict[str, float] = {}
        loads: list[float] = []
        stages: dict[str, float] = {}
        for n in (short, long):
            for side in order:
                loads.append(os.getloadavg()[0])
                tag = f"{shape.name}_r{r}_{side}_{n}"
                if side == "trl":
                    seconds[side, n], ends = run_trl(work, n, tmp, tag)
                else:
                    seconds[side, n], ends, metrics = run_aspo(shape, work, n, tmp, checkpoint, tag,
                                                               default_kv_cache=side == "aspo-default-kv")
                    if n == long and side == "aspo":
                        stages = stage_means(metrics)  # batch_accounting's
                if n == long:
                    steady[side] = steady_s_per_batch(ends)
                print(f"  round {r}: {side:15s} {n:3d} batches  {seconds[side, n]:7.1f} s  (load {loads[-1]:.2f})",
                      flush=True)
        per = {side: (seconds[side, long] - seconds[side, short]) / (long - short) for side in sides}
        row = {"round": r, "order": list(order), "seconds": {f"{s}_{n}": v for (s, n), v in seconds.items()},
               "s_per_batch": per, "steady_s_per_batch": steady,
               "ratio": {s: per[s] / per["trl"] for s in sides if s != "trl"},
               "steady_ratio": {s: steady[s] / steady["trl"] for s in sides if s != "trl"},
               "load_1min": loads, "aspo_stages": stages}
        results.append(row)
        print(f"  round {r}: " + ", ".join(f"{SIDE_NAMES[s]} {per[s]:.3f} s/batch (steady {steady[s]:.3f})" for s in sides)
              + "; ratio to TRL " + ", ".join(f"{s} {v:.2f}" for s, v in row["ratio"].items()), flush=True)
    median = {s: statistics.median(x["ratio"][s] for x in results) for s in sides if s != "trl"}
    median_steady = {s: statistics.median(x["steady_ratio"][s] for x in results) for s in sides if s != "trl"}
    return {"shape": shape.name, "config": shape.config, "lengths": [short, long], "checkpoint": checkpoint,
            "rounds": results, "median_ratio": median, "median_steady_ratio": median_steady}


def print_table(summary: list[dict[str, Any]]) -> None:
    """Per shape, round and side: s/batch by difference, its ratio to TRL, and the steady-state pair."""
    print("\n| shape | round | side | s/batch (difference) | ratio to TRL | s/batch (steady) | ratio (steady) | load (1 min) |")
    print("|---|---|---|---|---|---|---|---|")
    for res in summary:
        for x in res["rounds"]:
            load = f"{min(x['load_1min']):.1f}-{max(x['load_1min']):.1f}"
            for side, per in x["s_per_batch"].items():
                ratio = f"**{x['ratio'][side]:.2f}**" if side in x["ratio"] else ""
                steady_ratio = f"{x['steady_ratio'][side]:.2f}" if side in x["steady_ratio"] else ""
                print(f"| {res['shape']} | {x['round']} | {SIDE_NAMES[side]} | {per:.3f} | {ratio} "
                      f"| {x['steady_s_per_batch'][side]:.3f} | {steady_ratio} | {load} |")
        for side, ratio in res["median_ratio"].items():
            print(f"| {res['shape']} | median | {SIDE_NAMES[side]} | | **{ratio:.2f}** | "
                  f"| {res['median_steady_ratio'][side]:.2f} | |")


def print_accounting(summary: list[dict[str, Any]]) -> None:
    """Per shape, aspo-lit's whole batch by what spent it, one column per round (tools/perf/batch_accounting.py)."""
    from tools.perf.batch_accounting import accounting_table

    for res in summary:
        print(f"\n[{res['shape']}] aspo-lit's batch (long runs, after the first batch), s (share of timing/batch_s)\n")
        print(accounting_table({f"round {x['round']}": x["aspo_stages"] for x in res["rounds"]}))


def kernel_names(text: str) -> list[str]:
    """The ``--kernels`` list, each a key of :data:`KERNELS`, in the order given."""
    names = [k.strip() for k in text.split(",") if k.strip()]
    unknown = [k for k in names if k not in KERNELS]
    if unknown or not names:
        raise SystemExit(f"--kernels: unknown setting(s) {unknown or text!r}; choose from {', '.join(KERNELS)}")
    return names


def run_kernels(names: list[str], argv: list[str], out: str | None) -> int:
    """This benchmark once per kernel setting, each in its own process with that setting's
    environment; then every setting's ratio per shape and round side by side."""
    import subprocess

    results: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench_peer_kernels_") as tmp:
        for name in names:
            path = Path(tmp) / f"{name}.json"
            env = {**os.environ, **KERNELS[name]}
            for key in {k for setting in KERNELS.values() for k in setting} - set(KERNELS[name]):
                env.pop(key, None)  # a setting from the caller's shell would leak into the others
            print(f"\n== kernels: {name} {' '.join(f'{k}={v}' for k, v in KERNELS[name].items()) or '(as the machine picks)'}",
                  flush=True)
            code = subprocess.call([sys.executable, "-m", "tools.perf.bench_peer", *argv, "--kernels", "native", "--out", str(path)],
                                   env=env)
            if code != 0:
                print(f"bench_peer: the run under kernels {name} failed ({code})", file=sys.stderr)
                return code
            results[name] = json.loads(path.read_text())
    print_kernel_table(results)
    if out:
        Path(out).write_text(json.dumps(results, indent=2))
    return 0


def print_kernel_table(results: dict[str, list[dict[str, Any]]]) -> None:
    """aspo-lit / TRL per kernel setting, shape and round (by difference; steady in brackets)."""
    print("\n| kernels | shape | " + " | ".join(f"round {r}" for r in range(max(
        len(res["rounds"]) for shapes in results.values() for res in shapes))) + " | median | steady median |")
    print("|---|---|" + "---|" * (2 + max(len(res["rounds"]) for shapes in results.values() for res in shapes)))
    for name, shapes in results.items():
        for res in shapes:
            cells = [f"{x['ratio']['aspo']:.2f} ({x['steady_ratio']['aspo']:.2f})" for x in res["rounds"]]
            print(f"| {name} | {res['shape']} | " + " | ".join(cells)
                  + f" | **{res['median_ratio']['aspo']:.2f}** | {res['median_steady_ratio']['aspo']:.2f} |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="demo,long", help="comma-separated: demo, long")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--lengths", type=int, nargs=2, default=SHAPES["demo"].lengths,
                   help="rollout batches of the short and the long run (demo shape)")
    p.add_argument("--long-lengths", type=int, nargs=2, default=SHAPES["long"].lengths,
                   help="rollout batches of the short and the long run (long shape)")
    p.add_argument("--checkpoint", choices=("off", "config"), default="off",
                   help="off: no checkpoints on either side (equal work); config: aspo-lit keeps its config's")
    p.add_argument("--default-kv-cache", action="store_true",
                   help="a third side: aspo-lit with transformers' own KV cache (the code before the engine's)")
    p.add_argument("--torch-threads", type=int, default=None, help="torch.set_num_threads for both sides")
    p.add_argument("--kernels", default="native",
                   help=f"comma-separated CPU kernel settings, each run in its own process: {', '.join(KERNELS)}")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    kernels = kernel_names(args.kernels)
    if kernels != ["native"]:  # the child's --kernels and --out come last: argparse keeps the last of each
        return run_kernels(kernels, list(sys.argv[1:] if argv is None else argv), args.out)

    import logging
    import warnings

    import torch
    import transformers
    import trl

    warnings.filterwarnings("ignore")
    transformers.utils.logging.disable_progress_bar()
    for name in ("lightning", "lightning.pytorch", "transformers", "trl", "aspo_lit", "data_modules"):
        logging.getLogger(name).setLevel(logging.ERROR)
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    print(f"torch {torch.__version__} ({torch.get_num_threads()} threads, {torch.backends.cpu.get_cpu_capability()} "
          f"kernels{', MKL_ENABLE_INSTRUCTIONS=' + os.environ['MKL_ENABLE_INSTRUCTIONS'] if os.environ.get('MKL_ENABLE_INSTRUCTIONS') else ''}), trl {trl.__version__}, "
          f"{os.cpu_count()} CPUs, load {os.getloadavg()}", flush=True)
    summary = []
    with tempfile.TemporaryDirectory(prefix="bench_peer_") as tmp:
        for name in [s.strip() for s in args.shapes.split(",") if s.strip()]:
            if name not in SHAPES:
                raise SystemExit(f"unknown shape {name!r}; choose from {sorted(SHAPES)}")
            lengths = tuple(args.lengths if name == "demo" else args.long_lengths)
            if not 0 < lengths[0] < lengths[1]:
                raise SystemExit(f"{name}: run lengths must satisfy 0 < short < long, got {lengths}")
            sides = ("aspo", "trl") + (("aspo-default-kv",) if args.default_kv_cache else ())
            summary.append(bench_shape(SHAPES[name], args.rounds, lengths, args.checkpoint == "config", sides,
                                       Path(tmp)))
    print_table(summary)
    print_accounting(summary)
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
