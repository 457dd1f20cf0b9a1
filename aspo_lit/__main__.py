"""`python -m aspo_lit` (also the `aspo-lit` script): one front end for every command.

    python -m aspo_lit fit --config conf/aspo.yaml               # LightningCLI: fit / validate / test
    python -m aspo_lit build-testbed --profile testbed-long
    python -m aspo_lit evaluate --model PATH --benchmarks '[aime24, math500]'
    python -m aspo_lit table1 --config conf/table1.yaml --compare_paper true
    python -m aspo_lit table2 --config conf/table2.yaml
    python -m aspo_lit table3 --config conf/table3.yaml
    python -m aspo_lit figure2 '[runs/grpo, runs/aspo]' --out runs/figure2
    python -m aspo_lit study --config conf/study/default.yaml
    python -m aspo_lit reference runs/tiny_aspo/version_* --out tiny_aspo.json
    python -m aspo_lit compare runs/tiny_aspo/version_7 --reference tiny_aspo.json

`fit` and its siblings are LightningCLI (``aspo_lit.cli.ASPOCLI``); every other command is a typed
function turned into a parser by jsonargparse (the parser LightningCLI itself is built on), so
`--config FILE` (YAML), `--print_config` and `--help` work the same everywhere. A command is named
here by its import path and imported only when run: `study` lives in the `experiments` package,
which the library itself never imports and the wheel does not carry (run it from a checkout's root).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Tool:
    target: str                    # "module:function"
    help: str
    config: str | None = None      # the YAML read when no --config is given (relative to the cwd)
    # what the command's name decides (a table command's `table`): a --config or flag saying otherwise is an error
    fixed: dict[str, Any] = field(default_factory=dict)
    positional: bool = False       # required parameters as positional arguments
    variadic: bool = False         # the first (list) parameter takes every word before the first option


TOOLS: dict[str, Tool] = {
    "build-testbed": Tool("aspo_lit.testbed.cli:build", "build a CPU testbed by its recipe and compare it with the shipped one"),
    "evaluate": Tool("aspo_lit.eval.evaluate:evaluate",
                     "avg@K / pass@K of a model on the math, code or multiple-choice benchmarks"),
    "table1": Tool("aspo_lit.eval.table_commands:table", "evaluate conf/table1.yaml's rows, Table 1 beside the paper",
                   "conf/table1.yaml", fixed={"table": "table1"}),
    "table2": Tool("aspo_lit.eval.table_commands:table", "evaluate conf/table2.yaml's rows (LiveCodeBench), Table 2 beside the paper",
                   "conf/table2.yaml", fixed={"table": "table2"}),
    "table3": Tool("aspo_lit.eval.table_commands:table", "evaluate conf/table3.yaml's rows (ARC-Challenge, GPQA-Diamond, "
                   "MMLU-Pro), Table 3 beside the paper", "conf/table3.yaml", fixed={"table": "table3"}),
    "figure2": Tool("aspo_lit.training.figures:figure2", "overlay the paper's Figure 2 panels for several runs", positional=True),
    "study": Tool("experiments.study:study", "the pre-registered CPU-scale study of the paper's training dynamics"),
    "reference": Tool("aspo_lit.compare.commands:reference", "per-window bands (mean, SD, SE over seeds) of one config's runs",
                      positional=True, variadic=True),
    "compare": Tool("aspo_lit.compare.commands:compare", "a run against a reference's bands: first window out per metric, "
                    "exit 1 on any", positional=True),
}


def resolve(target: str):
    """The function a "module:function" path names."""
    import importlib

    module, name = target.split(":")
    try:
        return getattr(importlib.import_module(module), name)
    except ModuleNotFoundError as err:
        if err.name == "experiments":
            raise SystemExit(f"`{target}` is in the repository's experiments/ folder, not in the installed "
                             "package: run it from a checkout's root (python -m aspo_lit ...)") from err
        if err.name in STUDY_EXTRA:
            raise SystemExit(f"`{target}` needs {err.name!r}, one of the study's libraries: "
                             "pip install 'aspo-lit[study]' (make setup installs it)") from err
        raise


#: The libraries only experiments/ needs: pyproject's `study` extra.
STUDY_EXTRA = ("submitit", "pandas", "tabulate")


def run_tool(name: str, argv: list[str]) -> int:
    """Parse `argv` for the tool (its signature and docstring are the parser) and run it. A tool
    with a `config_files` parameter gets the YAML files it was given (to resolve paths in them)."""
    import inspect
    from pathlib import Path

    from jsonargparse import ActionConfigFile, ArgumentParser

    from aspo_lit.configs import resolve_config

    tool, fn = TOOLS[name], resolve(TOOLS[name].target)
    given = any(a == "--config" or a.startswith("--config=") for a in argv)
    default = resolve_config(tool.config) if tool.config and not given else None
    parser = ArgumentParser(prog=f"python -m aspo_lit {name}", description=inspect.getdoc(fn).split("\n\n")[0],
                            default_config_files=[default] if default and Path(default).is_file() else [])
    parser.add_argument("--config", action=ActionConfigFile, help="a YAML file of these arguments (later files win)")
    params = inspect.signature(fn).parameters
    parser.add_function_arguments(fn, as_group=False, as_positional=tool.positional, skip={"config_files"})
    if tool.fixed:
        parser.set_defaults(tool.fixed)
    cfg = parser.parse_args(gather_leading_words(argv) if tool.variadic else argv)
    for key, value in tool.fixed.items():   # one name per command: `table1 --config conf/table2.yaml` is an error
        given = cfg.get(key)
        if given != value:
            hint = f": python -m aspo_lit {given}" if given in TOOLS else ""
            parser.error(f"{key}: {given!r} contradicts the command: `{name}` is {key} {value!r} "
                         f"(each {key} has its own command{hint})")
    kwargs = {key: cfg[key] for key in params if key in cfg}
    if "config_files" in params:
        files = [*(cfg.get("__default_config__") or []), *(cfg.get("config") or [])]
        kwargs["config_files"] = [str(getattr(f, "absolute", f)) for f in files if f is not None]
    return int(fn(**kwargs) or 0)


def gather_leading_words(argv: list[str]) -> list[str]:
    """``RUN [RUN ...] --opt ...`` → one list word: jsonargparse reads a list positional as one word
    (``'[a, b]'``), a shell glob gives several. A word already in brackets is left as it is."""
    count = next((i for i, word in enumerate(argv) if word.startswith("-")), len(argv))
    if count == 0 or (count == 1 and argv[0].lstrip().startswith("[")):
        return argv
    import json

    return [json.dumps(argv[:count]), *argv[count:]]


def _epilog() -> str:
    lines = ["aspo-lit tools (python -m aspo_lit TOOL --help):"]
    lines += [f"  {name:<14} {tool.help}" for name, tool in TOOLS.items()]
    return "\n".join(lines)


def run_cli(args: list[str] | None = None):
    from aspo_lit.cli import ASPOCLI

    return ASPOCLI(args=args, epilog=_epilog())


def main(argv: list[str] | None = None) -> int:
    from aspo_lit.configs import resolve_config_args

    words = resolve_config_args(list(sys.argv[1:] if argv is None else argv))
    if words and words[0] in TOOLS:
        return run_tool(words[0], words[1:])
    from aspo_lit.cli import ConfigError

    if argv is None:
        sys.argv[1:] = words  # LightningCLI warns when given args while sys.argv has words of its own
    from aspo_lit.callbacks.checkpoint import ResumeRefused
    from aspo_lit.training.checkpoint_io import CheckpointSpaceError, CheckpointUnreadable
    from aspo_lit.training.run_lock import RunFolderHeld

    try:
        run_cli(None if argv is None else words)
    except ConfigError as err:
        print(f"aspo-lit: config error: {err}", file=sys.stderr)
        return 2
    except (RunFolderHeld, ResumeRefused, CheckpointUnreadable, CheckpointSpaceError) as err:
        # a run that stopped for its folder or its checkpoint: what and where, without a traceback
        print(f"aspo-lit: {err.strerror if isinstance(err, OSError) else err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":  # vLLM spawns engine processes: the entry point must be guarded
    sys.exit(main())
