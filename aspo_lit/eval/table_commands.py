"""The table commands, `python -m aspo_lit table1 | table2 | table3` (aspo_lit/__main__.py): a table
config's rows (conf/table*.yaml) evaluated with `evaluate_model` and rendered beside the paper's
Tables 1-3 (`aspo_lit.eval.tables`; docs/evaluation.md).

`evaluate_table` does the work on a config dict and returns the table; `table` is the command, with
the config's keys as typed arguments.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Literal

from aspo_lit.eval.choice import write_fixture
from aspo_lit.eval.datasets import get_benchmark, load_benchmark
from aspo_lit.eval.evaluate import SAMPLING_DEFAULTS, benchmark_spec, evaluate_model, failure_reason, setup_logging
from aspo_lit.eval.reference import load_reference, table_reference_json, write_reference
from aspo_lit.eval.tables import lcb_tests_note, render_table
from aspo_lit.testbed import arithmetic, tiny_code
from aspo_lit.testbed.shipped import NAMES as TESTBEDS
from aspo_lit.training.export import is_checkpoint

log = logging.getLogger(__name__)


def evaluate_table(config: dict, compare_paper: bool | None = None, only: list[str] | None = None,
                   root: Path | None = None, table: str | None = None):
    """Evaluate every row of a table config (`table: table1 | table2 | table3`, default table1) whose model
    is available and render the table beside the paper's. Math benchmarks are graded by
    `MathReward(**config["math_reward"])`, code benchmarks by `CodeReward(**config["code_reward"])`.

    Each (model, benchmark) cell is computed or marked missing on its own, with its reason: every
    benchmark is loaded once, before any model, and one that does not load (hub unreachable, no
    local file) or whose evaluation fails leaves only its own cells missing. The table's last line
    counts the cells (`count_cells`), the line before it the verdicts against the reference
    (`config["reference"]`: a reference file or shipped name, default the paper's; docs/evaluation.md).
    Our run is written as a reference too, `<out_dir>/<table>.reference.json`, for others to compare with.
    Returns (markdown, rows) of `render_table`; a row's status is "ok", "incomplete" (its model was
    evaluated, some cells are missing) or "missing" (no model)."""
    table = table or config.get("table", "table1")
    root = Path(root or Path.cwd())
    out_dir = Path(config.get("out_dir", f"runs/{table}"))
    out_dir = out_dir if out_dir.is_absolute() else root / out_dir
    compare = config.get("compare_paper", False) if compare_paper is None else compare_paper
    reference = load_reference(config.get("reference"), table)   # a bad file fails before any evaluation
    sampling = {**SAMPLING_DEFAULTS, **(config.get("sampling") or {})}
    specs = [benchmark_spec(spec, config.get("k"))
             for spec in prepare_benchmark_files(list(config["benchmarks"]), out_dir)]
    loaded, unavailable = load_table_benchmarks(specs, config.get("data_dir"))
    results, missing, failed_cells, graded, errors, details = {}, {}, {}, {}, {}, {}
    hub_unreachable, n_rows = False, 0
    for row in config["rows"]:
        key = (row["base_model"], row["method"])
        if only and not any(o in f"{key[0]}/{key[1]}" for o in only):
            continue
        n_rows += 1
        model, reason = _row_model(str(row["model"]), root), None
        if model is None:
            reason = f"no file matches {row['model']}"
        else:
            reason = check_model(model, local_only=hub_unreachable)
            hub_unreachable |= reason is not None and "connect" in reason
        if reason is not None:
            hint = f" (produced by: {row['produced_by']})" if row.get("produced_by") else ""
            missing[key] = reason + hint
            log.warning("%s / %s: missing — %s", *key, missing[key])
            continue
        row_sampling = {**sampling, **(row.get("sampling") or {})}
        failed = dict(unavailable)
        per_bench = {}
        try:
            if loaded:
                per_bench = evaluate_model(
                    model, loaded, out_dir / "models", k=config.get("k"),
                    limit=config.get("limit"), engine=config.get("engine", "auto"),
                    engine_kwargs=row.get("engine_kwargs", config.get("engine_kwargs")),
                    data_dir=config.get("data_dir"), dtype=config.get("dtype"),
                    template=row.get("template", config.get("template", "chat")),
                    enable_thinking=row.get("enable_thinking", config.get("enable_thinking", False)),
                    tag=row.get("tag"), samples_per_call=config.get("samples_per_call", 1024),
                    reward=config.get("math_reward"), code_reward=config.get("code_reward"),
                    system_prompt=config.get("system_prompt"),
                    failures=failed, **row_sampling)
        except Exception as e:   # one failed row must not lose the others
            log.exception("%s / %s: evaluation failed", *key)
            failed.update({s["name"]: f"evaluation failed: {failure_reason(e)}" for s in loaded})
        computed = table_columns(per_bench)   # in the config's benchmark order, missing cells as None
        ordered = {column: computed.get(column) for spec in specs for column in _columns_of(specs, spec["name"])}
        results[key] = {**ordered, **computed}
        errors[key], details[key] = table_errors(per_bench), table_details(per_bench)
        failed_cells[key] = {spec["name"]: failed[spec["name"]] for spec in specs if spec["name"] in failed}
        for name, done in per_bench.items():
            settings = done.get("settings") or {}
            if "tests_scope" in settings:
                graded.setdefault(name, set()).add(
                    (settings["tests_scope"], (settings.get("code_grader") or {}).get("timeout_s")))
    note = config.get("note")
    if note is None and table == "table2":
        note = lcb_tests_note(graded)
    missing_cells = {key: {column: f"{name}: {why}" for name, why in failed.items()
                           for column in _columns_of(specs, name)} for key, failed in failed_cells.items()}
    markdown, rows = render_table(results, table, compare_paper=compare, missing=missing, out_dir=out_dir,
                                  note=note, missing_cells=missing_cells, errors=errors, reference=reference,
                                  footer=count_cells(n_rows * len(specs), len(missing) * len(specs),
                                                     sum(len(failed) for failed in failed_cells.values())))
    ours = [row for row in rows if (row["base_model"], row["method"]) in results]
    write_reference(table_reference_json(ours, table, f"an aspo-lit {table} run", config=config, details=details),
                    out_dir / f"{table}.reference.json")
    return markdown, rows


def table_columns(results: dict[str, dict]) -> dict[str, float]:
    """One table row of ours: {"aime24_avg@64": ..., "aime24_pass@64": ..., ...}."""
    columns = {}
    for r in results.values():
        columns[f"{r['column']}_avg@{r['k']}"] = r["avg@k"]
        columns[f"{r['column']}_pass@{r['k']}"] = r["pass@k"]
    return columns


def table_errors(results: dict[str, dict]) -> dict[str, float | None]:
    """The SEs of `table_columns`' cells (percent; None where the results hold none)."""
    errors = {}
    for r in results.values():
        for metric in ("avg", "pass"):
            errors[f"{r['column']}_{metric}@{r['k']}"] = r.get(f"{metric}@k_se")
    return errors


def table_details(results: dict[str, dict]) -> dict[str, dict]:
    """What each cell's SE was computed from, for the run's reference file: {column: {problems, k,
    se_problems}} (`se_problems`: with the problems drawn from a population too; aspo_lit.maths.metrics)."""
    return {f"{r['column']}_{metric}@{r['k']}": {"problems": r["n_problems"], "k": r["k"],
                                                  "se_problems": r.get(f"{metric}@k_se_problems")}
            for r in results.values() for metric in ("avg", "pass")}


def load_table_benchmarks(specs: list[dict], data_dir=None) -> tuple[list[dict], dict[str, str]]:
    """Every benchmark of a table loaded once: (the specs that loaded, each with its `rows`;
    {name: why} for those that did not)."""
    loaded, unavailable = [], {}
    for spec in specs:
        try:
            rows = load_benchmark(get_benchmark(spec), path=spec.get("path"), data_dir=data_dir)
        except Exception as e:   # noqa: BLE001 - a benchmark that cannot load loses only its cells
            unavailable[spec["name"]] = failure_reason(e)
            log.warning("%s: cannot be loaded, its cells will be missing — %s", spec["name"],
                        unavailable[spec["name"]])
            continue
        loaded.append({**spec, "rows": rows})
    return loaded, unavailable


def _columns_of(specs: list[dict], name: str) -> list[str]:
    """The table columns of a benchmark (`<column>_avg@K`, `<column>_pass@K`)."""
    spec = next(s for s in specs if s["name"] == name)
    try:
        bench = get_benchmark(spec)
    except (KeyError, ValueError):   # not even a valid benchmark: one column under its name
        return [name]
    return [f"{bench.column}_avg@{bench.k}", f"{bench.column}_pass@{bench.k}"]


def count_cells(total: int, no_model: int, failed: int) -> str:
    """The table's last line: of `total` (model, benchmark) cells, how many were computed and why
    the others are missing (`no_model`: the row's model is not there; `failed`: the benchmark did
    not load, or its evaluation failed). `table` exits 1 when `failed` > 0."""
    return (f"Cells (model x benchmark): {total - no_model - failed} of {total} computed, "
            f"{no_model + failed} missing ({no_model} without a model, {failed} whose benchmark did not "
            "load or whose evaluation failed).")


def check_model(model: str, local_only: bool = False) -> str | None:
    """Why `model` cannot be evaluated (None when it can): a missing checkpoint or folder, or a
    hub id that does not load (offline, gated, misspelt). `local_only`: look in the HF cache
    only (after the hub was found unreachable, rather than waiting out its retries again)."""
    model = str(model)
    path = Path(model).expanduser()
    if is_checkpoint(model) or model.startswith((".", "/", "~")) or path.exists():
        return None if path.exists() else f"not found: {model}"
    if model in TESTBEDS:   # shipped with the package
        return None
    try:
        # lazy, as in aspo_lit.training.models: transformers takes seconds to import and only a hub id needs it here
        from transformers import AutoConfig
        AutoConfig.from_pretrained(model, local_files_only=local_only)
    except Exception as e:   # noqa: BLE001 - any failure means "cannot load", with its reason
        where = "the local HF cache (hub unreachable)" if local_only else "the hub"
        return f"cannot load {model!r} from {where}: {type(e).__name__}: " \
               f"{str(e).splitlines()[0][:200]}"
    return None


def prepare_benchmark_files(benchmarks: list, out_dir: Path) -> list:
    """Benchmarks that name a generator (the testbed's arithmetic held-out split, or with
    `kind: tiny_code` the code testbed's, with `kind: choice_fixture` small arithmetic
    multiple-choice questions in a Table 3 benchmark's upstream row format, `format: arc | gpqa |
    mmlu_pro`) get their JSONL written under `out_dir` (`path`, default `data/<name>.jsonl`) when
    it is missing: `{"name", "k", "generate": {"kind"?, "n", "seed", "levels"?, "split", ...}}`."""
    prepared = []
    for spec in benchmarks:
        if isinstance(spec, dict) and spec.get("generate"):
            spec = dict(spec)
            path = out_dir / spec.get("path", f"data/{spec['name']}.jsonl")
            if not path.is_file():
                generate = dict(spec.pop("generate"))
                kind = generate.pop("kind", "arithmetic")
                if kind == "choice_fixture":
                    write_fixture(generate.pop("format"), path, **generate)
                else:
                    testbed = tiny_code if kind == "tiny_code" else arithmetic
                    testbed.write_jsonl(testbed.generate_problems(**generate), path)
            spec.pop("generate", None)
            spec["path"] = str(path)
        prepared.append(spec)
    return prepared


def _row_model(model: str, root: Path) -> str | None:
    """A config row's model: checkpoint and ./relative paths are taken from `root`; a glob
    (`runs/tiny_aspo/version_*/checkpoints/last.ckpt`: Lightning numbers its log versions)
    means the newest match, None when nothing matches."""
    if not (is_checkpoint(model) or model.startswith(".") or any(c in model for c in "*?[")):
        return model
    path = Path(model).expanduser()
    path = path if path.is_absolute() else root / path
    if not any(c in model for c in "*?["):
        return str(path)
    matches = sorted(Path(path.anchor).glob(str(path.relative_to(path.anchor))),
                     key=lambda p: p.stat().st_mtime)
    return str(matches[-1]) if matches else None


def table(rows: list[dict[str, Any]], benchmarks: list[str | dict[str, Any]],
          table: Literal["table1", "table2", "table3"] = "table1", out_dir: str | None = None,
          compare_paper: bool = False, engine: str = "auto", engine_kwargs: dict[str, Any] | None = None,
          data_dir: str | None = None, k: int | None = None, limit: int | None = None,
          template: Literal["chat", "plain"] = "chat", enable_thinking: bool = False,
          sampling: dict[str, Any] | None = None, samples_per_call: int = 1024,
          code_reward: dict[str, Any] | None = None, system_prompt: str | None = None,
          note: str | None = None, dtype: Literal["bfloat16", "float16", "float32"] | None = None,
          only: list[str] | None = None, math_reward: dict[str, Any] | None = None,
          reference: str | None = None) -> int:
    """Evaluate a table config's rows (missing models are reported, not fabricated) and print the
    table beside the paper's: Table 1 (math), Table 2 (LiveCodeBench, in the code sandbox) or
    Table 3 (ARC-Challenge, GPQA-Diamond, MMLU-Pro: lettered options, last boxed letter).

    Each (model, benchmark) cell is computed or marked missing with its reason, and shown with its
    standard error and its verdict against the reference (docs/evaluation.md); the last two lines
    printed count the verdicts and the cells. Exit status 0 when every cell of every available
    model was computed (rows whose model is not there yet are listed as missing), 1 when a benchmark did not load
    or an evaluation failed (the table is still written, with those cells missing).

    Args:
        rows: {base_model, method, model, produced_by?, tag?, sampling?, engine_kwargs?, template?,
            enable_thinking?} per row; base_model / method name the paper's row to compare with.
        benchmarks: benchmark names, or {name, k?, path?, generate?} (see prepare_benchmark_files).
        table: which of the paper's tables the rows fill: the command's name (`python -m aspo_lit
            table2`); a config's `table:` must agree with it.
        out_dir: output folder (default: runs/<table>).
        compare_paper: show the paper's value and the delta in every cell.
        engine: 'auto', 'hf' or 'vllm' (aspo_lit.rollout.build_engine).
        engine_kwargs: to the engine class, e.g. vLLM {gpu_memory_utilization: 0.85}.
        data_dir: folder with <name>.jsonl files (default: $ASPO_DATA_DIR; else the hub).
        k: samples per problem (null: the paper's K per benchmark).
        limit: the first N problems of each benchmark (null: all).
        template: the model's chat template ('chat') or the bare message ('plain').
        enable_thinking: passed to the chat template (the paper: Qwen3's non-thinking mode).
        sampling: {temperature, top_p, max_tokens, seed} (default: the paper's protocol).
        samples_per_call: samples per engine call (a preemption loses at most one call).
        code_reward: CodeReward arguments for code benchmarks (sandbox, timeout_s, num_workers).
        system_prompt: a system turn before every prompt (code: LiveCodeBench's).
        note: a line printed under the table (Table 2's default: which tests were graded).
        dtype: every row's weights in the engine, hub baselines and exported checkpoints alike
            (null: bfloat16 on GPU, as the authors; float32 on CPU).
        only: evaluate only rows whose 'base_model/method' contains one of these.
        math_reward: MathReward arguments for math benchmarks, e.g. {verifier: either}
            (default: MathReward(); docs/grading.md).
        reference: the values each cell is judged against: a table reference file (another lab's
            <table>.reference.json) or a shipped name; default the paper's (aspo_lit/references/
            paper_<table>.json). With compare_paper, its rows, values and deltas are laid out.
    """
    setup_logging()
    config = {key: value for key, value in locals().items() if key not in ("only", "table")}
    config["out_dir"] = out_dir or f"runs/{table}"
    markdown, rendered = evaluate_table(config, compare_paper=compare_paper, only=only, table=table)
    print(markdown)
    folder = Path(config["out_dir"])
    print(f"written: {folder / f'{table}.md'}, {folder / f'{table}.csv'}, {folder / f'{table}.reference.json'}; "
          f"per-model results under {folder / 'models'}")
    lines = markdown.rstrip().splitlines()
    print(next(line for line in reversed(lines) if line.startswith("Verdicts against")))
    print(lines[-1])   # the count of computed and missing cells, last
    return 1 if any(r["status"] == "incomplete" for r in rendered) else 0
