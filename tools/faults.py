"""The fault suite (`make faults`): each fault an operator meets, done to a real CLI fit of the demo
config cut to 6 rollout batches, and what became of the run.

    python -m tools.faults [--out runs/faults] [--only kill9 sigterm ...]

Prints one row a fault: fault | outcome | nothing lost (yes / no / n.a.), and writes the table to
``<out>/faults.md``. "Nothing lost" compares every logged training value of the interrupted and
resumed run, step by step, with an uninterrupted run of the same seed (the ``reference`` case):
equal bits, none missing. The faults: kill -9 mid-run; SIGTERM; Ctrl-C twice; the checkpoint disk
full mid-run (a 12 MiB tmpfs, root only); a torn checkpoint; a non-finite reward; a resume with
another loss; two fits on one folder; ``--ckpt_path last`` with nothing to resume (docs/running.md,
"Checkpoints, resume, determinism").
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

import torch

REPO = Path(__file__).resolve().parents[1]
NAME = "tiny_aspo"
BATCHES, STEPS_PER_BATCH = 6, 2
SMALL = ["--data.init_args.batch_size=8", "--data.init_args.group_size=4", "--model.mini_batch_size=4",
         "--data.init_args.num_val=8", "--data.init_args.max_response_length=32", "--trainer.val_check_interval=3",
         f"--trainer.max_steps={BATCHES * STEPS_PER_BATCH}", "--trainer.enable_progress_bar=false"]
#: logged values that are wall clock or count this process's work: not a run's state
CLOCK = ("timing/", "perf/", "throughput/", "epoch")


class NaNReward:
    """A grader that gives one sample of every batch a NaN reward (a broken user reward)."""

    def __call__(self, response_text: str, gold: str) -> float:
        return math.nan

    def batch(self, texts: Sequence[str], golds: Sequence[str]) -> list[float]:
        return [math.nan] + [0.0] * (len(texts) - 1)


def fit_command(folder: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "aspo_lit", "fit", "--config", str(REPO / "conf/tiny/aspo.yaml"),
            f"--trainer.logger.init_args.save_dir={folder}", *SMALL, *extra]


def run(folder: Path, *extra: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run(fit_command(folder, *extra), capture_output=True, text=True, timeout=timeout, cwd=REPO)


def checkpoint(folder: Path) -> Path:
    return folder / NAME / "checkpoints" / "last.ckpt"


def saved_step(folder: Path) -> int:
    """The global step of the folder's last.ckpt (-1 when there is none or it does not load)."""
    try:
        return int(torch.load(checkpoint(folder), map_location="cpu", weights_only=False)["global_step"])
    except Exception:   # noqa: BLE001 - mid-write or absent: not yet
        return -1


def start_and_wait(folder: Path, at_step: int, *extra: str) -> subprocess.Popen:
    """A fit in the background, returned once its last.ckpt is at `at_step` or later."""
    process = subprocess.Popen(fit_command(folder, *extra), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               text=True, cwd=REPO)
    deadline = time.monotonic() + 900
    while saved_step(folder) < at_step:
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the fit in {folder} ended (or stalled) before step {at_step}: {process.stderr.read()[-2000:]}")
        time.sleep(0.5)
    return process


def logged(folder: Path) -> dict[tuple[int, str], str]:
    """Every (step, key) -> value of every version's metrics.csv, a later version's winning (the
    resumed run recomputes the steps after its checkpoint)."""
    values: dict[tuple[int, str], str] = {}
    for version in sorted((folder / NAME).glob("version_*"), key=lambda p: int(p.name.split("_")[1])):
        with open(version / "metrics.csv") as f:
            for row in csv.DictReader(f):
                for key, value in row.items():
                    if value != "" and key != "step" and not key.startswith(CLOCK):
                        values[(int(row["step"]), key)] = value
    return values


def nothing_lost(folder: Path, reference: Path) -> str:
    want, got = logged(reference), logged(folder)
    missing = [k for k in want if k not in got]
    differ = [k for k in want if k in got and got[k] != want[k]]
    if not missing and not differ:
        return f"yes ({len(want)} values equal)"
    return f"no: {len(missing)} missing (e.g. {missing[:2]}), {len(differ)} differ (e.g. {differ[:2]})"


def last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:220] if lines else ""


# --- the faults ------------------------------------------------------------------------------------

def case_reference(out: Path, ref: Path) -> tuple[str, str]:
    done = run(ref)
    return f"exit {done.returncode}, step {saved_step(ref)}", "n.a."


def case_kill9(out: Path, ref: Path) -> tuple[str, str]:
    folder = out / "kill9"
    process = start_and_wait(folder, 3 * STEPS_PER_BATCH)
    process.send_signal(signal.SIGKILL)
    process.wait()
    killed_at = saved_step(folder)
    done = run(folder, "--ckpt_path=last")
    return f"killed after step {killed_at}; resumed, exit {done.returncode}", nothing_lost(folder, ref)


def case_sigterm(out: Path, ref: Path) -> tuple[str, str]:
    folder = out / "sigterm"
    process = start_and_wait(folder, 2 * STEPS_PER_BATCH)
    start = time.monotonic()
    process.send_signal(signal.SIGTERM)
    code = process.wait(timeout=300)
    took, step = time.monotonic() - start, saved_step(folder)
    done = run(folder, "--ckpt_path=last")
    return (f"exit {code} {took:.0f} s after the signal, last.ckpt at step {step}; resumed, exit {done.returncode}",
            nothing_lost(folder, ref))


def case_ctrl_c_twice(out: Path, ref: Path) -> tuple[str, str]:
    folder = out / "ctrl_c_twice"
    process = start_and_wait(folder, 2 * STEPS_PER_BATCH)
    process.send_signal(signal.SIGINT)
    time.sleep(0.2)
    process.send_signal(signal.SIGINT)
    code = process.wait(timeout=300)
    step = saved_step(folder)
    done = run(folder, "--ckpt_path=last")
    return f"aborted (exit {code}) with last.ckpt at step {step}; resumed, exit {done.returncode}", \
        nothing_lost(folder, ref)


def case_full_disk(out: Path, ref: Path) -> tuple[str, str]:
    folder = out / "full_disk"
    folder.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(folder)],
                                           capture_output=True).returncode:
        return "skipped (mounting a tmpfs needs root)", "n.a."
    try:
        process = start_and_wait(folder, 2 * STEPS_PER_BATCH)
        size = checkpoint(folder).stat().st_size
        free = shutil.disk_usage(folder).free
        (folder / "filler").write_bytes(b"\0" * max(free - size // 2, 0))   # room for half a checkpoint
        code = process.wait(timeout=600)
        message = last_line(process.stderr.read())
        step = saved_step(folder)
        (folder / "filler").unlink()
        done = run(folder, "--ckpt_path=last")
        return (f"exit {code}: {message!r}; last.ckpt loads (step {step}); resumed, exit {done.returncode}",
                nothing_lost(folder, ref))
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def case_torn_checkpoint(out: Path, ref: Path) -> tuple[str, str]:
    folder = out / "torn_checkpoint"
    run(folder, f"--trainer.max_steps={2 * STEPS_PER_BATCH}")
    data = checkpoint(folder).read_bytes()
    checkpoint(folder).write_bytes(data[: len(data) // 2])
    done = run(folder, "--ckpt_path=last")
    return f"exit {done.returncode}: {last_line(done.stderr)!r}", "n.a. (the file was cut by hand)"


def case_nan_reward(out: Path, ref: Path) -> tuple[str, str]:
    folder = out / "nan_reward"
    done = run(folder, "--data.init_args.reward=tools.faults.NaNReward")
    return f"exit {done.returncode}: {last_line(done.stderr)!r}", "n.a."


def case_resume_another_loss(out: Path, ref: Path) -> tuple[str, str]:
    folder = out / "resume_another_loss"
    run(folder, f"--trainer.max_steps={2 * STEPS_PER_BATCH}")
    done = run(folder, "--ckpt_path=last", "--model.loss=grpo")
    kept = saved_step(folder) == 2 * STEPS_PER_BATCH
    return (f"exit {done.returncode}: {last_line(done.stderr)!r}",
            f"yes (last.ckpt untouched, step {2 * STEPS_PER_BATCH})" if kept and done.returncode else "no")


def case_two_fits_one_folder(out: Path, ref: Path) -> tuple[str, str]:
    folder = out / "two_fits_one_folder"
    first = start_and_wait(folder, STEPS_PER_BATCH, "--trainer.max_steps=400")   # still running while the second starts
    second = run(folder)
    running = first.poll() is None
    first.send_signal(signal.SIGTERM)
    first.wait(timeout=300)
    step = saved_step(folder)
    third = run(folder)
    kept = saved_step(folder) == step
    return (f"a second fit while the first runs ({'it was' if running else 'it was NOT'}): exit {second.returncode}: "
            f"{last_line(second.stderr)!r}; a fresh fit after it: exit {third.returncode}: "
            f"{last_line(third.stderr)!r}", f"yes (the first run's last.ckpt, step {step}, untouched)" if kept else "no")


def case_ckpt_last_nothing(out: Path, ref: Path) -> tuple[str, str]:
    done = run(out / "ckpt_last_nothing", "--ckpt_path=last")
    return f"exit {done.returncode}: {last_line(done.stderr)!r}", "n.a."


#: the faults whose "nothing lost" compares with the uninterrupted reference run
NEEDS_REFERENCE = {"kill9", "sigterm", "ctrl_c_twice", "full_disk"}
CASES = {"reference": case_reference, "kill9": case_kill9, "sigterm": case_sigterm,
         "ctrl_c_twice": case_ctrl_c_twice, "full_disk": case_full_disk, "torn_checkpoint": case_torn_checkpoint,
         "nan_reward": case_nan_reward, "resume_another_loss": case_resume_another_loss,
         "two_fits_one_folder": case_two_fits_one_folder, "ckpt_last_nothing": case_ckpt_last_nothing}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.faults", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "faults")
    parser.add_argument("--only", nargs="+", choices=sorted(CASES), help="these faults only (and the reference run "
                                                                         "when one of them needs it)")
    args = parser.parse_args(argv)
    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)
    ref = args.out / "reference"
    rows = []
    chosen = [n for n in CASES if n != "reference" and (not args.only or n in args.only)]
    for name in (["reference"] if NEEDS_REFERENCE & set(chosen) else []) + chosen:
        start = time.monotonic()
        try:
            outcome, lost = CASES[name](args.out, ref)
        except Exception as err:   # noqa: BLE001 - a fault the suite could not stage is a row, not a crash
            outcome, lost = f"could not run: {type(err).__name__}: {str(err)[:200]}", "?"
        rows.append((name, outcome, lost, time.monotonic() - start))
        print(f"{name:22s} {rows[-1][3]:5.0f} s  {lost:30.30s}  {outcome}", flush=True)
    table = ["| fault | outcome | nothing lost | s |", "| --- | --- | --- | --- |"]
    table += [f"| {n} | {o.replace('|', '/')} | {lost} | {s:.0f} |" for n, o, lost, s in rows]
    (args.out / "faults.md").write_text("\n".join(table) + "\n")
    print("\n".join(table))
    return 0 if all(not lost.startswith(("no", "?")) for _, _, lost, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
