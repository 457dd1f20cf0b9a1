"""Summarise a CI log (`CI=true bash .ci/run 2>&1 | tee ci.log`) into the tables of docs/ci.md.

    python -m tools.ci_durations ci.log            # Markdown on stdout

It reads pytest's ``--durations`` sections (every phase of every test over `--durations-min`), the
summary line of each pytest phase of ``make test`` (the parallel one, then the wall-clock-bound
tests), the ``== ... passed in N s`` (or ``not rerun``) lines of ``make test-numerics`` and ``.ci/run``'s own ``ci: ...``
timestamps, and prints: the totals, the seconds per test file, and the slowest tests. Nothing is
estimated: a test below `--durations-min` counts in the suite's total only. Under pytest-xdist a
test's seconds are its worker's, so the per-file seconds add up to more than the phase's wall clock.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import defaultdict
from pathlib import Path

DURATION = re.compile(r"^\s*([\d.]+)s (call|setup|teardown)\s+(\S+)")
SUMMARY = re.compile(r"^(?:=+ )?(\d+ (?:passed|failed).*?) in ([\d.]+)s")
NUMERICS = re.compile(r"^== (\S+): (?:passed in (\d+) s|not rerun)")
NUMERICS_START = "== numerics tests under"
CI_STAMP = re.compile(r"^ci: (.+?) (?:in|at) (\d+) s$")


def parse(text: str) -> dict:
    """The durations (seconds, phase, test id), the summaries of ``make test``'s pytest phases (those
    before the numerics reruns), the numerics reruns and ``.ci/run``'s timestamps of one log."""
    rows, phases, numerics, stamps, in_numerics = [], [], [], [], False
    for line in text.splitlines():
        if m := DURATION.match(line):
            rows.append((float(m[1]), m[2], m[3]))
        elif line.startswith(NUMERICS_START):
            in_numerics = True
        elif (m := SUMMARY.match(line)) and not in_numerics:
            phases.append((m[1], float(m[2])))
        elif m := NUMERICS.match(line):
            numerics.append((m[1], int(m[2]) if m[2] else "not rerun (the CPU's own)"))
        elif m := CI_STAMP.match(line):
            stamps.append((m[1], int(m[2])))
    if not phases:
        raise SystemExit("no pytest summary line in the log: is it a `CI=true bash .ci/run` log?")
    summary = (" + ".join(result for result, _ in phases), sum(seconds for _, seconds in phases))
    return {"rows": rows, "summary": summary, "phases": phases, "numerics": numerics, "stamps": stamps}


def render(log: dict, top: int = 30) -> str:
    rows, (result, total), numerics = log["rows"], log["summary"], log["numerics"]
    per_file: dict[str, float] = defaultdict(float)
    for seconds, _, test in rows:
        per_file[test.split("::")[0]] += seconds
    listed = sum(s for s, _, _ in rows)
    out = [f"pytest: {result} in {total:.0f} s of wall clock; the tests listed below account for {listed:.0f} test-seconds.", ""]
    if len(log.get("phases", ())) > 1:
        out += ["| pytest phase | s |", "|---|---|"]
        out += [f"| {result} | {seconds:.0f} |" for result, seconds in log["phases"]] + [""]
    if log.get("stamps"):
        out += ["| `.ci/run` | s since its start |", "|---|---|"]
        out += [f"| {what} | {seconds} |" for what, seconds in log["stamps"]] + [""]
    if numerics:
        out += ["| numerics rerun (`make test-numerics`) | s |", "|---|---|"]
        out += [f"| `{setting}` | {seconds} |" for setting, seconds in numerics] + [""]
    out += ["| test file | test-seconds | share |", "|---|---|---|"]
    for path, seconds in sorted(per_file.items(), key=lambda kv: -kv[1]):
        out.append(f"| `{path}` | {seconds:.0f} | {seconds / max(listed, 1e-9):.0%} |")
    out += ["", f"The {top} slowest phases:", "", "| s | phase | test |", "|---|---|---|"]
    for seconds, phase, test in sorted(rows, reverse=True)[:top]:
        out.append(f"| {seconds:.1f} | {phase} | `{test}` |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("log", type=Path)
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args(argv)
    sys.stdout.write(render(parse(args.log.read_text(errors="replace")), args.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
