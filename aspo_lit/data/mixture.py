"""Training and held-out data as a list of sources: each read in its own layout, filtered by the
filters it declares, then deduplicated across sources (paper §7.1, Appendix B).

The paper trains DeepSeek-R1-Distill-Qwen-1.5B on DeepScaleR-Preview + Skywork-OR1-RL-Data (math)
+ DAPO-Math-17K, the Qwen3 models on DAPO-Math-17K, and the code runs on DeepCoder + CodeContests
+ CodeForces, "cleaned and filtered following the preprocessing protocol of [35]" (the authors'
Archer work). A `Source` names one of them; the shipped configs list the paper's (docs/data.md
says which parts of the authors' protocol are implemented and which could not be pinned down).

Deduplication: a problem is a duplicate when its normalized text equals one kept before it, in
source order (the first source listed wins, as the authors' code data card gives CodeContests and
CodeForces priority over DeepCoder). Normalization: Unicode NFKC, case folding, every run of
whitespace collapsed to one space, ends stripped. A duplicate whose gold answer differs from the
kept one is counted (``answer_conflicts``) and dropped all the same.

Counts per source (rows read, bad rows, each filter's drops, duplicates, kept) are logged and
returned as stats ``data/<split>/<source>/...``.
"""

from __future__ import annotations

import importlib
import logging
import os
import re
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

from aspo_lit.data.filters import RowFilter
from aspo_lit.data.sources import BAD_ROW_POLICIES, BadRowError, raw_rows

log = logging.getLogger(__name__)


@dataclass
class Source:
    """One data source of a mixture.

    Args:
        path: an HF hub dataset id, or a local JSONL/JSON/parquet file or folder (``~`` and
            environment variables expanded).
        name: the hub dataset's config (``lcbv5`` of DeepCoder-Preview-Dataset).
        split: the split to read (Skywork-OR1-RL-Data: ``math``).
        label: the source's name in logs, stats and bad-row reports (default: from path and name).
        data_files: files of the hub dataset repo read directly with ``huggingface_hub`` instead of
            ``datasets.load_dataset`` (a dataset whose hub release needs a loading script:
            LiveCodeBench's ``test.jsonl`` ... ``test6.jsonl``).
        staged: a file under ``$ASPO_DATA_DIR`` (docs/data.md) read instead of the hub when that
            variable is set and the file exists; it is in the normalized layout (``problem``,
            ``answer`` / code ``tests``), so ``fields``, ``json_fields``, ``template`` and
            ``layout`` do not apply to it; ``filters`` do.
        fields: our field → the upstream field path (``answer: reward_model.ground_truth``); ours
            are ``problem``, ``answer``, ``id`` (code: ``tests``, ``starter_code``, ``fn_name``).
            A problem stored as a chat message list yields its user message.
        json_fields: upstream field paths whose value is a JSON-encoded string, decoded first
            (Skywork-OR1's ``reward_model.ground_truth``: ``'["336"]'``).
        template: the instruction the upstream prompt wraps the problem in, with ``{problem}``
            where the problem is; it is removed (our prompt builder adds its own instruction). A
            row that does not match it is a bad row.
        layout: code rows only: ``fields`` (normalized, LiveCodeBench, DeepCoder and verl-style
            rows, through ``fields``), ``code_contests`` or ``codeforces``
            (`aspo_lit.data.code_layouts`).
        filters: `RowFilter` s applied to the upstream rows, in order; the first that drops a
            row is the one counted.
    """

    path: str
    name: str | None = None
    split: str = "train"
    label: str | None = None
    data_files: list[str] = field(default_factory=list)
    staged: str | None = None
    fields: dict[str, str] = field(default_factory=dict)
    json_fields: list[str] = field(default_factory=list)
    template: str | None = None
    layout: str = "fields"
    filters: list[RowFilter] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.path = os.fspath(self.path)
        if not self.path:
            raise ValueError("a data source needs a path (a hub dataset id or a local file)")
        if self.template is not None and self.template.count("{problem}") != 1:
            raise ValueError(f"source {self.tag!r}: template must contain '{{problem}}' exactly once")
        self.filters = [_as_filter(f, self.tag) for f in self.filters]
        names = [f.name for f in self.filters]
        if len(set(names)) != len(names):
            raise ValueError(f"source {self.tag!r}: filters need distinct names (counts are kept per name), got {names}")

    @property
    def tag(self) -> str:
        if self.label:
            return self.label
        stem = Path(self.path).stem if Path(self.path).suffix else self.path.rstrip("/").rsplit("/", 1)[-1]
        return f"{stem}:{self.name}" if self.name else stem

    def staged_file(self) -> Path | None:
        """The staged copy to read instead of the hub, if ``$ASPO_DATA_DIR`` has it."""
        root = os.environ.get("ASPO_DATA_DIR")
        if not self.staged or not root or not (Path(root) / self.staged).is_file():
            return None
        return Path(root) / self.staged


def _as_filter(spec: Any, tag: str) -> RowFilter:
    """A `RowFilter`, also from its config form ``{class_path, init_args}`` (a saved hparams dict)."""
    if isinstance(spec, Mapping) and isinstance(spec.get("class_path"), str):
        module, _, name = spec["class_path"].rpartition(".")
        spec = getattr(importlib.import_module(module), name)(**(spec.get("init_args") or {}))
    if not isinstance(spec, RowFilter):
        raise ValueError(f"source {tag!r}: a filter must be a aspo_lit.data.filters.RowFilter, got {spec!r}")
    return spec


@dataclass
class SourceReport:
    """What one source gave: rows read, bad rows, each filter's drops, duplicates, kept."""

    label: str
    origin: str = ""
    rows: int = 0
    bad: list[str] = field(default_factory=list)
    filtered: dict[str, int] = field(default_factory=dict)
    duplicates: int = 0
    answer_conflicts: int = 0
    kept: int = 0

    def stats(self, split: str) -> dict[str, float]:
        key = f"data/{split}/{self.label}"
        out = {f"{key}/rows": self.rows, f"{key}/bad_rows": len(self.bad), f"{key}/duplicates": self.duplicates,
               f"{key}/answer_conflicts": self.answer_conflicts, f"{key}/kept": self.kept}
        out.update({f"{key}/filter/{name}": n for name, n in self.filtered.items()})
        return {k: float(v) for k, v in out.items()}

    def summary(self) -> str:
        drops = ", ".join(f"filter {name!r} dropped {n}" for name, n in self.filtered.items())
        return (f"{self.label} ({self.origin}): {self.rows} rows, {len(self.bad)} bad, {drops + ', ' if drops else ''}"
                f"{self.duplicates} duplicates ({self.answer_conflicts} with another answer), {self.kept} kept")


def normalized_problem(text: str) -> str:
    """The deduplication key: NFKC, case-folded, whitespace runs collapsed, ends stripped."""
    return re.sub(r"\s+", " ", unicodedata.normalize("NFKC", text).casefold()).strip()


def source_rows(source: Source) -> tuple[str, bool, Iterator[tuple[str, Any]]]:
    """(origin, staged?, (location, raw row) pairs) of a source: its staged copy, its hub data
    files, or its path (a local file or folder, or a hub dataset through ``datasets``)."""
    staged = source.staged_file()
    if staged is not None:
        return f"staged {staged}", True, raw_rows(str(staged), source.split)
    if source.data_files:
        return f"hub {source.path} files", False, _hub_file_rows(source)
    target = f"{source.path}:{source.name}" if source.name else source.path
    return target, False, raw_rows(target, source.split)


def _hub_file_rows(source: Source) -> Iterator[tuple[str, Any]]:
    """(location, raw row) of each of the source's hub files, fetched with ``hf_hub_download``
    (cached: a node with a warm cache reads them offline); a file that can be neither fetched nor
    found in the cache is named."""
    from huggingface_hub import hf_hub_download

    for name in source.data_files:
        try:
            local = hf_hub_download(repo_id=source.path, filename=name, repo_type="dataset")
        except Exception as err:   # offline with a cold cache, unreachable, renamed: say which file
            first = (str(err).strip().splitlines() or [""])[0]
            raise FileNotFoundError(f"{source.path}: {name} of source {source.tag!r} is neither in the local "
                                    f"HF cache nor reachable on the hub ({type(err).__name__}: {first[:160]})") from err
        for where, raw in raw_rows(local, source.split):
            yield where.replace(local, f"{source.path}/{name}"), raw


Convert = Callable[[Mapping[str, Any], Source, str, bool], dict[str, Any]]


def load_mixture(sources: list[Source], convert: Convert, on_bad_row: str = "error", dedup: bool = True,
                 split: str = "train") -> tuple[list[dict[str, Any]], list[SourceReport]]:
    """Rows of every source, converted by ``convert(raw, source, where, staged)`` (which raises
    `BadRowError` for an unusable row), filtered, then deduplicated across sources in order."""
    if on_bad_row not in BAD_ROW_POLICIES:
        raise ValueError(f"on_bad_row must be one of {BAD_ROW_POLICIES}, got {on_bad_row!r}")
    labels = [s.tag for s in sources]
    if len(set(labels)) != len(labels):
        raise ValueError(f"data sources need distinct labels, got {labels}")
    rows: list[dict[str, Any]] = []
    kept_answer: dict[str, Any] = {}
    reports = []
    for source in sources:
        origin, staged, raws = source_rows(source)
        report = SourceReport(source.tag, origin, filtered={f.name: 0 for f in source.filters})
        for where, raw in raws:
            report.rows += 1
            row = _usable(raw, source, where, convert, report, on_bad_row, staged)
            if row is None:
                continue
            key = normalized_problem(row["problem"]) if dedup else None
            if key is not None and key in kept_answer:
                report.duplicates += 1
                report.answer_conflicts += kept_answer[key] != row.get("answer")
                continue
            if key is not None:
                kept_answer[key] = row.get("answer")
            rows.append(row)
            report.kept += 1
        log.info("%s data: %s", split, report.summary())
        if report.bad:
            log.warning("%s data: %s: %d bad rows skipped, e.g. %s", split, report.label, len(report.bad), report.bad[0])
        reports.append(report)
    return rows, reports


def _usable(raw, source, where, convert, report, on_bad_row, staged) -> dict[str, Any] | None:
    """The converted row, or None when a filter drops it or it is bad (and bad rows are skipped)."""
    try:
        if isinstance(raw, Exception):
            raise raw
        if not isinstance(raw, Mapping):
            raise BadRowError(f"{where}: expected a JSON object, got {type(raw).__name__}")
        for row_filter in source.filters:
            if not row_filter.keep(raw):
                report.filtered[row_filter.name] += 1
                return None
        return convert(raw, source, where, staged)
    except BadRowError as err:
        message = f"source {source.tag!r}: {err}"
        if on_bad_row == "error":
            raise BadRowError(message) from None
        report.bad.append(message)
        return None


def mixture_stats(reports: list[SourceReport], split: str) -> dict[str, float]:
    """Every source's counts as flat stats (``data/<split>/<source>/<count>``)."""
    out: dict[str, float] = {}
    for report in reports:
        out.update(report.stats(split))
    return out
