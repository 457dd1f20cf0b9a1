"""Where the shipped configs are: `conf/` of a checkout, or its copy inside the installed package;
where the shipped reference files are and their envelope (`python -m aspo_lit compare`'s bands,
the tables' cells: docs/compare.md, docs/evaluation.md), and the checkout's commit (`git_commit`),
which reference files record.

`python -m aspo_lit fit --config conf/aspo.yaml` names a path relative to the working directory. In
a checkout that is the repository's `conf/`; after `pip install aspo-lit` (non-editable) there is no
such folder, and a missing `conf/...` path falls back to the same file shipped in the package
(`aspo_lit/conf`, package data built from the repository's `conf/`).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

PACKAGED_CONF = Path(__file__).resolve().parent / "conf"
#: every reference file's ``format`` and ``version`` (bands over runs, or a table's cells: its ``kind``)
REFERENCE_FORMAT, REFERENCE_VERSION = "aspo-lit-reference", 1
SHIPPED_REFERENCES = Path(__file__).resolve().parent / "references"


def resolve_config(value: str) -> str:
    """`value` when it is a file; else, for a `conf/...` path, the packaged copy when it exists;
    else `value` unchanged (the caller reports it as missing)."""
    path = Path(value)
    if path.is_file() or path.is_absolute() or not path.parts or path.parts[0] != "conf":
        return value
    packaged = PACKAGED_CONF.joinpath(*path.parts[1:])
    return str(packaged) if packaged.is_file() else value


def resolve_config_args(argv: list[str]) -> list[str]:
    """`argv` with every `--config FILE` value passed through `resolve_config`."""
    out, after_flag = [], False
    for word in argv:
        if after_flag:
            word, after_flag = resolve_config(word), False
        elif word == "--config":
            after_flag = True
        elif word.startswith("--config="):
            word = "--config=" + resolve_config(word.split("=", 1)[1])
        out.append(word)
    return out


def git_commit() -> str:
    """``git rev-parse HEAD`` of the checkout this package runs from (``+dirty`` when tracked files
    changed), else ``unknown`` (an installed wheel)."""
    here = Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return "unknown"
        dirty = subprocess.run(["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head.stdout.strip() + ("+dirty" if dirty else "")


def shipped_reference(name: str, folder: Path = SHIPPED_REFERENCES) -> Path | None:
    """``<folder>/<name>.json`` when ``name`` is a bare name (no folder, no suffix) of a file there,
    else None: how `compare` and the tables' ``--reference`` take a shipped reference by name."""
    path = Path(name)
    if path.suffix == "" and len(path.parts) == 1 and (folder / f"{name}.json").is_file():
        return folder / f"{name}.json"
    return None


#: Class paths that moved, old -> new. A config naming an old one stops with the new name (no
#: alias: one name per class).
MOVED_CLASS_PATHS = {
    "data_modules.math.MathRLDataModule": "data_modules.math.RLDataModule",
    "aspo_lit.rollout.VLLMEngine": "aspo_lit.rollout.vllm.VLLMEngine",
    "aspo_lit.strategy.": "aspo_lit.training.strategy.",
    **{f"data_modules.{module}.": f"aspo_lit.data.{module}." for module in ("filters", "mixture", "sources", "fields",
                                                                           "code_layouts")},
}


def check_moved_class_paths(text: str, where: str) -> None:
    """Raise `ValueError` naming `where` and the new class path when `text` (a config file's or an
    argument's) names a class path that moved."""
    for old, new in MOVED_CLASS_PATHS.items():
        at = text.find(old)
        if at >= 0:
            end = at + len(old)
            while end < len(text) and (text[end].isalnum() or text[end] in "._"):
                end += 1
            name = text[at:end]
            raise ValueError(f"{where}: {name!r} has moved: name {new + name[len(old):]!r} instead")
