"""LiveCodeBench v5 / v6 (Table 2) from LiveCodeBench's own release files on the hub, no loading script.

The paper evaluates on LiveCodeBench v5 (2024-08-01 to 2025-02-01) and v6 (2025-02-01 to
2025-05-01) (§7.1, Appendix B; Jain et al., 2025). LiveCodeBench publishes its problems as JSONL
files in the hub dataset ``livecodebench/code_generation_lite``; a release is a prefix of them
(its loading script ``code_generation_lite.py`` and ``lcb_runner/benchmarks/code_generation.py``):
``release_v1`` = ``test.jsonl``, ``release_v2`` adds ``test2.jsonl``, ... ``release_v6`` adds
``test6.jsonl``. The authors' evaluation (their LiveCodeBench fork, ``compute_code_generation_metrics``)
loads ``release_v5`` and keeps ``2024-08-01 <= contest_date`` up to ``2025-02-01``: 279 problems.

Here each file of the release is fetched with ``huggingface_hub.hf_hub_download`` (through
`aspo_lit.data.mixture.Source`'s ``data_files``; cached, so a second run and an offline node with a
warm cache read it locally), and a problem is kept when its
``contest_date`` lies in the benchmark's half-open window ``[start, end)``:

* v5 = ``release_v5`` rows in ``[2024-08-01, 2025-02-01)``: 279 problems. ``release_v6`` has 44
  more problems dated 2025-01-05 to 01-27 (in ``test6.jsonl``): they fall in the window but are
  not in ``release_v5``, so they are not in the paper's v5.
* v6 = ``release_v6`` rows in ``[2025-02-01, 2025-05-01)``: 131 problems.

LiveCodeBench's own end bound is inclusive (``contest_date <= end``, at midnight); half-open keeps
v5 and v6 disjoint at 2025-02-01T00:00:00, and changes nothing on these files (``release_v5`` ends
on 2025-01-04, the v6 window's last problem is dated 2025-04-06).

Rows are LiveCodeBench's layout (``question_content``, ``starter_code``, ``public_test_cases``,
``private_test_cases`` — JSON, or base64(zlib(pickle(JSON))) decoded by an unpickler that refuses
every class —, ``metadata: {"func_name"}``), normalized by ``data_modules.code.normalize_code_row``
with the public then the private tests, the order of LiveCodeBench's ``get_evaluation_sample``:
every problem is graded on all of its tests, as the official and the authors' evaluations are.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import date, datetime

log = logging.getLogger(__name__)

LCB_HUB_ID = "livecodebench/code_generation_lite"
#: the files of each release (LiveCodeBench's ``code_generation_lite.py``, ``ALLOWED_FILES``)
RELEASE_FILES: dict[str, tuple[str, ...]] = {
    f"release_v{v}": tuple("test.jsonl" if i == 1 else f"test{i}.jsonl" for i in range(1, v + 1))
    for v in range(1, 7)
}
#: the ``tests_scope`` of a row graded on every test of its problem
ALL_TESTS = "public+private"


@dataclass(frozen=True)
class ContestWindow:
    """Problems with ``start <= contest_date < end`` (dates at midnight)."""

    start: datetime
    end: datetime

    @classmethod
    def of(cls, bounds) -> "ContestWindow":
        """From ``(start, end)`` as ISO strings or dates (YAML reads ``2024-08-01`` as a date)."""
        if bounds is None or len(bounds) != 2:
            raise ValueError(f"contest_dates must be [start, end], got {bounds!r}")
        start, end = (_as_datetime(b) for b in bounds)
        if not start < end:
            raise ValueError(f"contest_dates: start {start.date()} is not before end {end.date()}")
        return cls(start, end)

    def __contains__(self, when: datetime) -> bool:
        return self.start <= when < self.end

    def __str__(self) -> str:
        return f"{self.start.date()} <= contest_date < {self.end.date()}"


def _as_datetime(value) -> datetime:
    if isinstance(value, datetime):
        return value
    if isinstance(value, date):
        return datetime(value.year, value.month, value.day)
    return datetime.fromisoformat(str(value))


def load_lcb_release(release: str, contest_dates, hub_id: str = LCB_HUB_ID) -> list[dict]:
    """Rows ``{id, problem, answer, starter_code, tests_scope}`` of LiveCodeBench release
    ``release`` (e.g. ``"release_v5"``) whose ``contest_date`` is in ``contest_dates`` =
    ``(start, end)``, half-open, in file order; ``answer`` is the test spec (public + private
    tests). The release files are read as a `aspo_lit.data.mixture.Source` with ``data_files``
    (``hf_hub_download``, as the training configs' LiveCodeBench validation source). A row without
    a usable date, statement or tests raises ``BadRowError`` naming the file and line."""
    from aspo_lit.data.mixture import Source, source_rows
    from aspo_lit.data.sources import BadRowError

    if release not in RELEASE_FILES:
        raise ValueError(f"unknown LiveCodeBench release {release!r}; known: {', '.join(RELEASE_FILES)}")
    window = ContestWindow.of(contest_dates)
    source = Source(path=hub_id, label=release, data_files=list(RELEASE_FILES[release]))
    rows, seen = [], set()
    for where, raw in source_rows(source)[2]:
        if isinstance(raw, Exception):
            raise raw
        row = _in_window(raw, where, window)
        if row is None:
            continue
        if row["id"] in seen:
            raise BadRowError(f"{where}: duplicate problem {row['id']!r}")
        seen.add(row["id"])
        rows.append(row)
    log.info("%s %s: %d problems with %s (files %s)", hub_id, release, len(rows), window,
             ", ".join(RELEASE_FILES[release]))
    return rows


def _in_window(raw, where: str, window: ContestWindow) -> dict | None:
    """One release row, normalized, if it is in ``window`` (out-of-window rows are not decoded)."""
    from aspo_lit.data.code_rows import normalize_code_row
    from aspo_lit.data.sources import BadRowError

    try:
        when = _as_datetime(raw["contest_date"])
    except (KeyError, TypeError, ValueError) as err:
        raise BadRowError(f"{where}: not a LiveCodeBench row with a contest_date "
                          f"({type(err).__name__}: {err})") from None
    if when not in window:
        return None
    if "private_test_cases" not in raw or not raw.get("question_id"):
        raise BadRowError(f"{where}: no question_id or private_test_cases (not LiveCodeBench's "
                          "release layout)")
    row = normalize_code_row({**raw, "id": f"lcb-{raw['question_id']}"}, where)
    return {"id": row["id"], "problem": row["problem"], "answer": row["answer"],
            "starter_code": row["starter_code"], "tests_scope": ALL_TESTS}
