"""`MathTask`: math problems from files and hub datasets, mixed and deduplicated (docs/data.md)."""

from __future__ import annotations

import os
from typing import Any, Sequence

from aspo_lit.data.fields import math_row
from aspo_lit.data.mixture import Source, load_mixture, mixture_stats
from aspo_lit.data.sources import BadRowError, normalize_golds
from aspo_lit.tasks.base import Task


class MathTask(Task):
    """Math problems ``{id, problem, answer}`` read from `Source`s.

    Args:
        train_files, val_files: a list of `aspo_lit.data.mixture.Source` (hub ids or local files,
            each with its field mapping and filters; deduplicated across sources), or one local
            JSONL/JSON/parquet file or folder or HF hub id (``repo:config``); ``val_files`` None: no
            held-out problems.
        problem_key, answer_key: field mapping of a plain-string source (a `Source` has its own).
        dedup: drop problems whose normalized text repeats one kept before.
        on_bad_row: ``error`` (stop, naming file and row) or ``skip`` (count and log).
        prompt_template, reward: as `Task`.
    """

    def __init__(self, train_files: str | Sequence[Source], val_files: str | Sequence[Source] | None = None,
                 problem_key: str = "problem", answer_key: str = "answer", dedup: bool = True,
                 on_bad_row: str = "error", prompt_template: str = "chat", reward: Any = None) -> None:
        super().__init__(prompt_template, reward)
        self.files = {"train": train_files, "val": val_files}
        self.problem_key, self.answer_key = problem_key, answer_key
        self.dedup, self.on_bad_row = dedup, on_bad_row

    def rows(self, split: str) -> list[dict[str, Any]] | None:
        spec = self.files[split]
        return self.load_split(spec, split) if spec else None

    def sources(self, spec: str | os.PathLike | Sequence[Source]) -> list[Source]:
        """The sources of a ``train_files`` / ``val_files`` value (a plain string is one source
        read with ``problem_key`` / ``answer_key``)."""
        if isinstance(spec, (str, os.PathLike)):
            return [Source(path=os.fspath(spec), fields={"problem": self.problem_key, "answer": self.answer_key})]
        sources = [s if isinstance(s, Source) else Source(**s) for s in spec]
        for source in sources:
            if source.layout != "fields":
                raise ValueError(f"source {source.tag!r}: layout {source.layout!r} is for code rows; math "
                                 "sources map their fields (layout: fields)")
        return sources

    def convert_row(self, raw: dict[str, Any], source: Source, where: str, staged: bool) -> dict[str, Any]:
        """One upstream row as ``{id, problem, answer}`` (a staged copy is already normalized)."""
        if staged:
            return math_row(raw, {}, [], None, where)
        return math_row(raw, source.fields, source.json_fields, source.template, where)

    def normalize_answers(self, rows: list[dict[str, Any]], split: str) -> tuple[list[dict[str, Any]], dict[str, float]]:
        """Gold answers as a model writes them, as evaluation reads them (`normalize_golds`), and
        the count rewritten (``data/<split>/golds_rewritten``)."""
        rows, rewritten = normalize_golds(rows, f"data.{split}_files")
        return rows, {f"data/{split}/golds_rewritten": float(rewritten)}

    def load_split(self, spec, split: str) -> list[dict[str, Any]]:
        sources = self.sources(spec)
        rows, reports = load_mixture(sources, self.convert_row, self.on_bad_row, self.dedup, split)
        rows, gold_stats = self.normalize_answers(rows, split)
        self.record({**mixture_stats(reports, split), **gold_stats})
        if not rows:
            raise BadRowError(f"data.{split}_files: no usable rows in "
                              f"{', '.join(f'{s.tag} ({_where(s)})' for s in sources)}")
        return rows


def _where(source: Source) -> str:
    """What a source read: its staged file, a local path made absolute, or the hub id."""
    staged = source.staged_file()
    if staged is not None:
        return str(staged)
    return os.path.abspath(source.path) if os.path.exists(source.path) else source.path
