"""The effective config of a command: ``--print_config`` through the real CLI."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import yaml

from aspo_lit.__main__ import main

REPO = Path(__file__).resolve().parents[2]


def print_config(*configs: str, extra: tuple[str, ...] = (), command: str = "fit") -> str:
    """The text ``command --config c1 --config c2 ... [extra] --print_config`` prints (configs relative
    to the repository, composed left to right); fails the test when the command does not exit 0."""
    args = [command] + [w for c in configs for w in ("--config", str(REPO / c))] + list(extra) + ["--print_config"]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(args)
        except SystemExit as exc:  # jsonargparse exits after --print_config
            code = exc.code
    assert code in (0, None), (out.getvalue() + err.getvalue())[-3000:]
    return out.getvalue()


def effective(*configs: str, extra: tuple[str, ...] = (), command: str = "fit") -> dict:
    """``print_config`` parsed."""
    return yaml.safe_load(print_config(*configs, extra=extra, command=command))
