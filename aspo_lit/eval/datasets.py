"""The benchmarks of Tables 1, 2 and 3: where their rows come from, how many samples per problem.

Table 1 (math) has six; Table 2 (code) has LiveCodeBench v5 (2024-08-01 to 2025-02-01, K = 8)
and v6 (2025-02-01 to 2025-05-01, K = 16) (paper §7.1 and Appendix B; Jain et al., 2025), graded
by running the program on the problem's tests in a sandbox (``aspo_lit.rewards.code``). Their rows
carry the test spec (``code_gold``) as ``answer``, the LeetCode ``starter_code`` and
``tests_scope``, which tests the spec holds: ``public+private`` (every test of the problem),
``public_only`` or ``as_given`` (a file that does not say). By default they load from
LiveCodeBench's release files on the hub (``aspo_lit.eval.livecodebench``: release v5 / v6
selected by contest date, public + private tests); a local file takes precedence: the normalized
JSONL copies (``<data dir>/code/lcb_v5.jsonl``, ``lcb_v6.jsonl``: public tests only, so scores are
an upper bound on the official ones) or any file in LiveCodeBench's own layout given as ``path``
(``data_modules.code``).

Each benchmark loads from a local file (the normalized JSONL copies under $ASPO_DATA_DIR, docs/data.md,
whose row counts are the ones the paper's numbers imply) or, when none is given or found, from its public
Hugging Face dataset. K per benchmark is the paper's (Appendix B): 64 for AIME24/25 and AMC23,
8 for Minerva Math, 4 for MATH-500 and OlympiadBench.

Table 3 (out of domain, multiple choice; ``aspo_lit.eval.choice``): ARC-Challenge
(allenai/ai2_arc, config ARC-Challenge, test, 1,172 rows), GPQA-Diamond (Idavidrein/gpqa, config
gpqa_diamond, train, 198 rows; gated: accept its terms on the hub, then `huggingface-cli login` or
set HF_TOKEN) and MMLU-Pro (TIGER-Lab/MMLU-Pro, test, 12,032 rows). Their rows, from the hub or a
local JSONL/JSON/parquet copy in the same upstream layout (``path``; ``fields`` renames upstream
fields), carry the options and the gold letter. The paper states no K for them; ours follow the
rule its Table 1 K's follow (fewer problems, more samples): 8 for GPQA-Diamond (198 problems, as
Minerva's 272), 4 for ARC-Challenge and MMLU-Pro (over 1,000, as MATH-500 and OlympiadBench).

Hub ids (what verl/rllm/Qwen2.5-Math-style evaluation scripts load; none is the paper's own
release, which has none):
- aime24: HuggingFaceH4/aime_2024 (train, 30 rows)
- aime25: yentinglin/aime_2025 (train, 30 rows; math-ai/aime25 and MathArena/aime_2025 are copies)
- amc23: math-ai/amc23 (test, the 40-problem AMC 12A/12B 2023 set; fields question/answer)
- math500: HuggingFaceH4/MATH-500 (test, 500 rows)
- minerva: math-ai/minervamath (test, 272 rows; fields question/answer). The local file is
  preferred: its answer is the last \\boxed{} of the official solution (see
  docs/data.md on the DeepScaleR copy's wrong sub-problem answers).
- olympiadbench: Hothan/OlympiadBench, config OE_TO_maths_en_COMP (train, 675 rows; fields
  question/final_answer, a one-element list whose `$` are removed here).
- lcb_v5, lcb_v6: livecodebench/code_generation_lite, its JSONL release files (release_v5 rows with
  2024-08-01 <= contest_date < 2025-02-01: 279; release_v6 rows in [2025-02-01, 2025-05-01): 131).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from aspo_lit.data.sources import normalize_golds


@dataclass(frozen=True)
class Benchmark:
    name: str
    k: int                              # samples per problem (avg@K / pass@K)
    column: str                         # Table 1 column prefix: "<column>_avg@K"
    filename: str                       # default local file name inside the data dir
    hub_id: str | None = None
    hub_config: str | None = None
    split: str = "test"
    # our field ("problem", "answer", "id") -> the hub dataset's; local files use ours
    fields: dict = field(default_factory=dict)
    domain: str = "math"                # "math" (math-verify) | "code" (sandboxed tests) | "choice"
    choice_format: str | None = None    # "choice": the upstream row format, aspo_lit.eval.choice.FORMATS
    # "code" from LiveCodeBench's hub files (aspo_lit.eval.livecodebench): the release read and the
    # half-open contest-date window [start, end) kept
    lcb_release: str | None = None
    contest_dates: tuple | None = None


BENCHMARKS: dict[str, Benchmark] = {b.name: b for b in [
    Benchmark("aime24", 64, "aime24", "aime24.jsonl", "HuggingFaceH4/aime_2024", split="train",
              fields={"problem": "problem", "answer": "answer", "id": "id"}),
    Benchmark("aime25", 64, "aime25", "aime25.jsonl", "yentinglin/aime_2025", split="train",
              fields={"problem": "problem", "answer": "answer", "id": "id"}),
    Benchmark("amc23", 64, "amc23", "amc23.jsonl", "math-ai/amc23", split="test",
              fields={"problem": "question", "answer": "answer", "id": "id"}),
    Benchmark("math500", 4, "math500", "math500.jsonl", "HuggingFaceH4/MATH-500", split="test",
              fields={"problem": "problem", "answer": "answer", "id": "unique_id"}),
    Benchmark("minerva", 8, "minerva", "minerva.jsonl", "math-ai/minervamath", split="test",
              fields={"problem": "question", "answer": "answer"}),
    Benchmark("olympiadbench", 4, "olympiad", "olympiadbench.jsonl", "Hothan/OlympiadBench",
              hub_config="OE_TO_maths_en_COMP", split="train",
              fields={"problem": "question", "answer": "final_answer", "id": "id"}),
    Benchmark("lcb_v5", 8, "lcb_v5", "code/lcb_v5.jsonl", "livecodebench/code_generation_lite",
              domain="code", lcb_release="release_v5", contest_dates=("2024-08-01", "2025-02-01")),
    Benchmark("lcb_v6", 16, "lcb_v6", "code/lcb_v6.jsonl", "livecodebench/code_generation_lite",
              domain="code", lcb_release="release_v6", contest_dates=("2025-02-01", "2025-05-01")),
    Benchmark("arc_challenge", 4, "arc_challenge", "ood/arc_challenge.jsonl", "allenai/ai2_arc",
              hub_config="ARC-Challenge", split="test", domain="choice", choice_format="arc"),
    Benchmark("gpqa_diamond", 8, "gpqa_diamond", "ood/gpqa_diamond.jsonl", "Idavidrein/gpqa",
              hub_config="gpqa_diamond", split="train", domain="choice", choice_format="gpqa"),
    Benchmark("mmlu_pro", 4, "mmlu_pro", "ood/mmlu_pro.jsonl", "TIGER-Lab/MMLU-Pro", split="test",
              domain="choice", choice_format="mmlu_pro"),
]}
TABLE1_BENCHMARKS = ("aime24", "aime25", "amc23", "math500", "minerva", "olympiadbench")   # column order
TABLE2_BENCHMARKS = ("lcb_v5", "lcb_v6")
TABLE3_BENCHMARKS = ("arc_challenge", "gpqa_diamond", "mmlu_pro")
DOMAINS = ("math", "code", "choice")


def get_benchmark(spec) -> Benchmark:
    """A registered benchmark by name, or an ad-hoc one from a dict (config files): at least
    `name` and `k`; `path`-only benchmarks need no hub id."""
    if isinstance(spec, Benchmark):
        return spec
    if isinstance(spec, str):
        if spec not in BENCHMARKS:
            raise KeyError(f"unknown benchmark {spec!r}; registered: {', '.join(BENCHMARKS)}")
        return BENCHMARKS[spec]
    spec = dict(spec)
    name = spec.pop("name")
    base = BENCHMARKS.get(name)
    known = {f for f in Benchmark.__dataclass_fields__ if f != "name"}
    overrides = {key: value for key, value in spec.items() if key in known}
    if overrides.get("contest_dates") is not None:
        overrides["contest_dates"] = tuple(overrides["contest_dates"])
    if base is not None:
        return Benchmark(**{**base.__dict__, **overrides})
    if "k" not in overrides:
        raise ValueError(f"benchmark {name!r} is not registered: give its 'k' (and 'path')")
    overrides.setdefault("column", name)
    overrides.setdefault("filename", f"{name}.jsonl")
    if overrides.get("domain", "math") not in DOMAINS:
        raise ValueError(f"benchmark {name!r}: domain must be one of {DOMAINS}")
    if overrides.get("domain") == "choice" and not overrides.get("choice_format"):
        raise ValueError(f"benchmark {name!r}: a 'choice' benchmark needs its 'choice_format'")
    return Benchmark(name=name, **overrides)


def default_data_dir() -> Path | None:
    """$ASPO_DATA_DIR (the folder of staged ``<name>.jsonl`` copies, docs/data.md), else None: the hub."""
    env = os.environ.get("ASPO_DATA_DIR")
    return Path(env) if env else None


def load_benchmark(name, path=None, data_dir=None) -> list[dict]:
    """Rows `{"id", "problem", "answer"}` of one benchmark, in file order (code benchmarks add
    `starter_code`; their `answer` is the test spec).

    Source, first that applies: `path` (a JSONL/JSON/parquet file, or a folder holding the
    benchmark's default file or such files); `<data_dir>/<default file>` (data_dir defaults to
    `default_data_dir()`); the benchmark's hub dataset. A row without a problem or answer, or
    with a non-string answer, in a local file raises ValueError naming the file and line
    (`aspo_lit.data.sources.load_rows`, shared with training).
    """
    bench = get_benchmark(name)
    if path is None:
        data_dir = Path(data_dir) if data_dir is not None else default_data_dir()
        if data_dir is not None and (data_dir / bench.filename).is_file():
            path = data_dir / bench.filename
    if path is not None:
        return _load_local(bench, Path(path))
    if bench.domain == "choice":
        from aspo_lit.eval.choice import load_choice_hub
        return load_choice_hub(bench.hub_id, bench.hub_config, bench.split, bench.choice_format,
                               bench.fields)
    if bench.domain == "code":
        if bench.hub_id and bench.lcb_release:
            from aspo_lit.eval.livecodebench import load_lcb_release
            return load_lcb_release(bench.lcb_release, bench.contest_dates, bench.hub_id)
        raise FileNotFoundError(f"benchmark {bench.name!r}: no local file {bench.filename} in {data_dir}; "
                                "give its path (a normalized JSONL or LiveCodeBench's own layout), e.g. "
                                f"--data_paths '{{{bench.name}: FILE}}' or $ASPO_DATA_DIR")
    if bench.hub_id is None:
        raise FileNotFoundError(f"benchmark {bench.name!r}: no local file {bench.filename} in "
                                f"{data_dir} and no hub dataset id")
    return _load_hub(bench)


def _load_local(bench: Benchmark, path: Path) -> list[dict]:
    """Rows of a local file, or of a folder's default file (else all its data files). Rows are
    validated by the training DataModule's loader, so errors name the file and line alike."""
    from aspo_lit.data.sources import load_rows

    if path.is_dir() and (path / bench.filename).is_file():
        path = path / bench.filename
    elif path.is_dir() and (path / Path(bench.filename).name).is_file():   # e.g. data/code/lcb_v5.jsonl
        path = path / Path(bench.filename).name
    if not path.exists():
        raise FileNotFoundError(f"benchmark {bench.name!r}: {path} does not exist")
    if bench.domain == "code":
        return _load_code_local(path)
    if bench.domain == "choice":   # the upstream layout, normalized as the hub rows are
        from aspo_lit.eval.choice import load_choice_local
        return load_choice_local(path, bench.choice_format, bench.fields)
    rows, _ = load_rows(str(path), "problem", "answer", on_bad_row="error")
    _check_unique_ids(rows, str(path))
    return normalize_golds(rows, str(path))[0]


def _load_code_local(path: Path) -> list[dict]:
    """Code rows of a local file or folder, each with the ``tests_scope`` its raw row implies:
    LiveCodeBench's layout (``private_test_cases``) holds every test; the staged copies say
    ``public_only``; anything else is graded on the tests it holds (``as_given``)."""
    from aspo_lit.data.code_rows import normalize_code_row
    from aspo_lit.data.sources import collect_rows

    def check(raw, where):
        row = normalize_code_row(raw, where)
        scope = "public+private" if "private_test_cases" in raw else raw.get("tests_scope") or "as_given"
        return {"id": row["id"], "problem": row["problem"], "answer": row["answer"],
                "starter_code": row["starter_code"], "tests_scope": str(scope)}

    rows, _ = collect_rows(str(path), "train", "error", check)
    if not rows:
        raise ValueError(f"{path}: no code rows")
    _check_unique_ids(rows, str(path))
    return rows


def _load_hub(bench: Benchmark) -> list[dict]:
    import datasets

    table = datasets.load_dataset(bench.hub_id, bench.hub_config, split=bench.split)

    def get(record, ours, default=None):
        return record.get(bench.fields.get(ours, ours), default)

    rows = []
    for i, record in enumerate(table):
        problem, answer = get(record, "problem"), _hub_answer(get(record, "answer"))
        if not isinstance(problem, str) or not problem.strip() or not isinstance(answer, str) \
                or not answer.strip():
            raise ValueError(f"{bench.hub_id}[{bench.split}] row {i}: no usable problem/answer")
        rows.append({"id": str(get(record, "id", f"{bench.name}-{i}")), "problem": problem,
                     "answer": answer})
    _check_unique_ids(rows, bench.hub_id)
    return normalize_golds(rows, bench.hub_id)[0]


def _hub_answer(answer):
    """Hub copies store answers as numbers (amc23: 27.0) or one-element lists with `$`
    (OlympiadBench); normalize them the way the staged copies are (docs/data.md)."""
    if isinstance(answer, list) and answer:
        answer = ",".join(str(a).replace("$", "").strip() for a in answer)
    if isinstance(answer, float) and answer.is_integer():
        answer = int(answer)
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        answer = str(answer)
    return answer


def _check_unique_ids(rows: list[dict], source: str) -> None:
    seen = set()
    for row in rows:
        if row["id"] in seen:
            raise ValueError(f"{source}: duplicate problem id {row['id']!r}")
        seen.add(row["id"])
