"""`python -m aspo_lit`: LightningCLI (fit / validate / test / predict) plus the package's own tools.

    python -m aspo_lit fit --config conf/aspo.yaml
    python -m aspo_lit build-testbed [--force]
    python -m aspo_lit evaluate --model PATH --benchmarks aime24 math500 ...
    python -m aspo_lit table1 --config conf/table1.yaml --compare-paper
    python -m aspo_lit table2 --config conf/table2.yaml
    python -m aspo_lit table3 --config conf/table3.yaml
    python -m aspo_lit figure2 RUN [RUN ...] --out figures/figure2
    python -m aspo_lit study --config conf/study/default.yaml
"""

from __future__ import annotations

import sys
from typing import Callable

TOOLS: dict[str, tuple[str, str]] = {
    "build-testbed": ("aspo_lit.testbed.build", "build (or find in the cache) the tiny CPU testbed model"),
    "evaluate": ("aspo_lit.eval.evaluate", "avg@K / pass@K of a model on the math, code or multiple-choice benchmarks"),
    "table1": ("aspo_lit.eval.evaluate", "evaluate the rows of conf/table1.yaml, render Table 1 beside the paper"),
    "table2": ("aspo_lit.eval.evaluate", "evaluate the rows of conf/table2.yaml (LiveCodeBench), render Table 2 beside the paper"),
    "table3": ("aspo_lit.eval.evaluate", "evaluate the rows of conf/table3.yaml (ARC-Challenge, GPQA-Diamond, MMLU-Pro), render Table 3 beside the paper"),
    "figure2": ("aspo_lit.figures", "overlay the paper's Figure 2 panels for several runs"),
    "study": ("experiments.study", "the CPU-scale study of the paper's training dynamics"),
}
_ENTRY = {"build-testbed": "main", "evaluate": "evaluate_main", "table1": "table1_main", "table2": "table2_main", "table3": "table3_main",
          "figure2": "main",
          "study": "main"}


def _tool(name: str) -> Callable[[list[str]], int | None]:
    import importlib

    module_name, _ = TOOLS[name]
    return getattr(importlib.import_module(module_name), _ENTRY[name])


def _epilog() -> str:
    lines = ["aspo-lit tools (python -m aspo_lit TOOL --help):"]
    lines += [f"  {name:<14} {help_}" for name, (_, help_) in TOOLS.items()]
    return "\n".join(lines)


def run_cli(args: list[str] | None = None):
    from aspo_lit.cli import ASPOCLI

    return ASPOCLI(args=args, epilog=_epilog())


def main(argv: list[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    if words and words[0] in TOOLS:
        return int(_tool(words[0])(words[1:]) or 0)
    from aspo_lit.cli import ConfigError

    try:
        run_cli(argv)
    except ConfigError as err:
        print(f"aspo-lit: config error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":  # vLLM spawns engine processes: the entry point must be guarded
    sys.exit(main())
