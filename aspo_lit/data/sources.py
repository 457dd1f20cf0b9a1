"""Prompt datasets: rows `{problem, answer}` from a local JSONL/JSON/parquet file, a folder, or an
HF hub id, validated row by row; and a resumable, seeded iterable of prompt batches."""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Literal, get_args

import torch

log = logging.getLogger(__name__)

OnBadRow = Literal["error", "skip"]
BAD_ROW_POLICIES = get_args(OnBadRow)


class BadRowError(ValueError):
    """A dataset row without a usable problem/answer; the message names the file and row."""


@dataclass
class RowReport:
    """What loading kept and dropped, so nothing is dropped silently."""

    source: str
    kept: int = 0
    skipped: list[str] = field(default_factory=list)


def _check_row(row: Any, where: str, problem_key: str, answer_key: str) -> dict[str, str]:
    if not isinstance(row, dict):
        raise BadRowError(f"{where}: expected a JSON object, got {type(row).__name__}")
    problem, answer = row.get(problem_key), row.get(answer_key)
    if not isinstance(problem, str) or not problem.strip():
        raise BadRowError(f"{where}: field {problem_key!r} is missing or not a non-empty string")
    if not isinstance(answer, str) or not answer.strip():
        kind = "missing" if answer is None else "empty" if isinstance(answer, str) else \
            f"a {type(answer).__name__}, not a string"
        raise BadRowError(f"{where}: field {answer_key!r} is {kind}")
    return {"id": str(row.get("id", where)), "problem": problem, "answer": answer}


def expand_source(source: str) -> str:
    """`source` with ``~`` and environment variables expanded (``$ASPO_DATA_DIR/aime24.jsonl``);
    an unset variable is an error that names it."""
    expanded = os.path.expanduser(os.path.expandvars(source))
    unset = re.findall(r"\$\{?(\w+)", expanded)
    if unset:
        raise FileNotFoundError(f"{source}: environment variable ${unset[0]} is not set (the folder "
                                "with the staged JSONL files: see docs/data.md)")
    return expanded


def raw_rows(source: str, split: str) -> Iterator[tuple[str, Any]]:
    """(location, raw row) pairs; JSONL is read line by line so errors name the line. A hub id
    may name the dataset's config after a colon: ``agentica-org/DeepCoder-Preview-Dataset:lcbv5``."""
    source = expand_source(source)
    path = Path(source)
    if path.is_file() and path.suffix == ".jsonl":
        with path.open("rb") as handle:
            for lineno, raw in enumerate(handle, start=1):
                where = f"{path}:{lineno}"
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as err:
                    yield where, BadRowError(f"{where}: not UTF-8 (byte 0x{raw[err.start]:02x} at column "
                                             f"{err.start + 1})")
                    continue
                if not line.strip():
                    continue
                try:
                    yield where, json.loads(line)
                except json.JSONDecodeError as err:
                    yield where, BadRowError(f"{where}: not valid JSON ({err.msg})")
        return
    import datasets

    if path.exists():
        files = sorted(str(p) for p in path.glob("*")) if path.is_dir() else [str(path)]
        kind = "parquet" if all(f.endswith(".parquet") for f in files) else "json"
        dataset = datasets.load_dataset(kind, data_files=files, split="train")
        label = str(path)
    elif source.startswith((".", "/", "~")) or source.endswith((".jsonl", ".json", ".parquet")):
        raise FileNotFoundError(f"dataset file not found: {source}")
    else:
        repo, _, name = source.partition(":")
        dataset = datasets.load_dataset(repo, name=name or None, split=split)
        label = f"{source}[{split}]"
    for index, row in enumerate(dataset):
        yield f"{label} row {index}", row


def load_rows(
    source: str, problem_key: str = "problem", answer_key: str = "answer", split: str = "train",
    on_bad_row: str = "error",
) -> tuple[list[dict[str, str]], RowReport]:
    """Validated rows of a prompt dataset; a bad row raises (naming file and row) or is skipped and counted."""
    rows, report = collect_rows(source, split, on_bad_row, lambda raw, where: _check_row(raw, where, problem_key, answer_key))
    if not rows:
        raise BadRowError(f"{source}: no usable rows (fields {problem_key!r}/{answer_key!r})")
    return rows, report


def collect_rows(source: str, split: str, on_bad_row: str, check) -> tuple[list[dict], RowReport]:
    """`check(raw_row, where)` over every row of `source`: a `BadRowError` stops (``on_bad_row:
    error``, naming file and row) or the row is skipped, counted and logged (``skip``)."""
    if on_bad_row not in BAD_ROW_POLICIES:
        raise ValueError(f"on_bad_row must be one of {BAD_ROW_POLICIES}, got {on_bad_row!r}")
    rows, report = [], RowReport(source)
    for where, raw in raw_rows(source, split):
        try:
            if isinstance(raw, Exception):
                raise raw
            rows.append(check(raw, where))
        except BadRowError as err:
            if on_bad_row == "error":
                raise
            report.skipped.append(str(err))
    report.kept = len(rows)
    if report.skipped:
        log.warning("%s: skipped %d bad rows, e.g. %s", source, len(report.skipped), report.skipped[0])
    return rows, report


def normalize_golds(rows: list[dict[str, Any]], source: str) -> tuple[list[dict[str, Any]], int]:
    """Math golds in the LaTeX a model writes (`aspo_lit.rewards.normalize_gold`: Python
    e-notation such as Minerva's ``3.83e35``, and code such as ``np.arcsin(10/13)``), and how many
    were rewritten; the count is logged per source. Graders read ``e`` as Euler's number otherwise."""
    from aspo_lit.rewards import normalize_gold

    out = [dict(row, answer=normalize_gold(row["answer"])) for row in rows]
    changed = [(row["answer"], new["answer"]) for row, new in zip(rows, out) if new["answer"] != row["answer"]]
    if changed:
        log.info("%s: %d of %d gold answers rewritten as LaTeX by normalize_gold (e.g. %r -> %r)",
                 source, len(changed), len(rows), *changed[0])
    return out, len(changed)


class PromptBatches:
    """Shuffled prompt batches, reshuffled per epoch from `(seed, epoch)`, resumable mid-epoch.

    Lightning saves `state_dict()` of a stateful loader in the checkpoint. `consumed` counts the
    batches that reached a training step (`mark_consumed`), not the ones prefetched, so a resume
    continues at the first batch that was not trained on.
    """

    def __init__(self, rows: list[dict[str, Any]], batch_size: int, seed: int = 0, shuffle: bool = True,
                 drop_last: bool = True) -> None:
        if len(rows) < batch_size and drop_last:
            raise ValueError(f"data.batch_size={batch_size} is larger than the dataset ({len(rows)} prompts)")
        self.rows, self.batch_size, self.seed, self.shuffle, self.drop_last = rows, batch_size, seed, shuffle, drop_last
        self.epoch = 0
        self.consumed = 0

    def __len__(self) -> int:
        full, rest = divmod(len(self.rows), self.batch_size)
        return full + int(rest > 0 and not self.drop_last)

    def _order(self) -> list[int]:
        if not self.shuffle:
            return list(range(len(self.rows)))
        generator = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
        return torch.randperm(len(self.rows), generator=generator).tolist()

    def __iter__(self) -> Iterator[list[dict[str, Any]]]:
        if self.consumed >= len(self):
            self.epoch, self.consumed = self.epoch + 1, 0
        order = self._order()
        for index in range(self.consumed, len(self)):
            chunk = order[index * self.batch_size : (index + 1) * self.batch_size]
            yield [self.rows[i] for i in chunk]

    def mark_consumed(self) -> int:
        """Record that one more batch was trained on; returns a unique, resumable batch counter."""
        self.consumed += 1
        return self.epoch * len(self) + self.consumed

    def batch(self, counter: int) -> list[dict[str, Any]]:
        """The batch that ``mark_consumed`` numbers ``counter`` (1-based over epochs): what iterating
        yields there, computed ahead of time (the bounded-staleness rollouts request batches
        before the loop reaches them)."""
        if counter < 1:
            raise ValueError(f"batch counters start at 1, got {counter}")
        epoch, index = divmod(counter - 1, len(self))
        saved, self.epoch = self.epoch, epoch
        try:
            order = self._order()
        finally:
            self.epoch = saved
        return [self.rows[i] for i in order[index * self.batch_size : (index + 1) * self.batch_size]]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "consumed": self.consumed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.consumed = int(state["epoch"]), int(state["consumed"])
