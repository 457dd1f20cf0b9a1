"""Code reward cost: sandboxed executions per second, and the sandbox's overhead per execution.

    python -m tools.perf.bench_code_reward [--programs 64] [--repeats 30] [--sandbox bwrap]

1. Throughput: ``CodeReward.batch`` on ``--programs`` distinct trivial accepted programs (one
   stdin test each; distinct so that none is deduplicated), ``num_workers`` = CPU count.
2. Overhead: one program at a time, interleaved with a bare ``subprocess.run`` of the same
   interpreter on the same program (LiveCodeBench's import prelude included in both, ``-I -S``);
   the median difference is the sandbox's cost (bubblewrap namespaces, the harness, the
   per-test fork, limits and clean-up). Target: <= 50 ms.
Medians are used because the machine may be shared.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

from aspo_lit.rewards.code import LCB_PRELUDE, CodeReward, code_gold, find_python

PROGRAM = "a, b = map(int, input().split())\nprint(a + b)\n"
GOLD = code_gold({"tests": [{"input": "1 2\n", "output": "3\n"}], "fn_name": None})


def fenced(code: str) -> str:
    return f"```python\n{code}```"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--programs", type=int, default=64)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--sandbox", default="bwrap", choices=["bwrap", "rlimit"])
    args = p.parse_args(argv)

    reward = CodeReward(sandbox=args.sandbox, timeout_s=6.0)
    try:
        assert reward.run(fenced(PROGRAM), GOLD).passed   # also checks the sandbox once
        texts = [fenced(f"# program {i}\n{PROGRAM}") for i in range(args.programs)]
        start = time.perf_counter()
        scores = reward.batch(texts, [GOLD] * len(texts))
        elapsed = time.perf_counter() - start
        assert scores == [1.0] * len(texts)
        print(f"throughput ({args.sandbox}, {reward.num_workers} workers, {os.cpu_count()} CPUs): "
              f"{len(texts) / elapsed:.1f} programs/s ({1000 * elapsed / len(texts):.1f} ms each, "
              f"{args.programs} programs)")

        python, _ = find_python("auto")
        bare_cmd = [python, "-I", "-S", "-c", LCB_PRELUDE + PROGRAM]
        sandboxed, bare = [], []
        for i in range(args.repeats):
            start = time.perf_counter()
            assert reward.run(fenced(f"# {i}\n{PROGRAM}"), GOLD).passed
            sandboxed.append(time.perf_counter() - start)
            start = time.perf_counter()
            out = subprocess.run(bare_cmd, input=b"1 2\n", capture_output=True, timeout=30)
            bare.append(time.perf_counter() - start)
            assert out.stdout.strip() == b"3"
        s_ms, b_ms = 1000 * statistics.median(sandboxed), 1000 * statistics.median(bare)
        verdict = "meets" if s_ms - b_ms <= 50 else "misses"
        print(f"one execution: sandboxed {s_ms:.1f} ms, bare subprocess.run {b_ms:.1f} ms (medians of "
              f"{args.repeats}); overhead {s_ms - b_ms:.1f} ms ({verdict} the <= 50 ms target)")
    finally:
        reward.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
