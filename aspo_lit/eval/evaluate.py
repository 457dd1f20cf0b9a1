"""Benchmark evaluation: K samples per problem, graded, avg@K and pass@K (paper §7.1, "Evaluation").

Math benchmarks (Table 1) are graded on the last ``\\boxed{}`` by ``aspo_lit.rewards.MathReward``
(correct when DeepScaleR's or math-verify's verifier accepts, docs/grading.md); code benchmarks
(Table 2: LiveCodeBench v5/v6) get LiveCodeBench's prompt and are graded by running the last
fenced Python block on the problem's tests in a sandbox (``aspo_lit.rewards.code.CodeReward``);
multiple-choice benchmarks (Table 3: ARC-Challenge, GPQA-Diamond, MMLU-Pro) get the lettered-options
prompt of ``aspo_lit.eval.choice`` and are graded by exact match of the last boxed letter
(``aspo_lit.eval.choice.ChoiceReward``).

Every sample is recorded as it is graded, so an evaluation resumes where it stopped
(``aspo_lit.eval.records``); a model's metrics are summarised by ``aspo_lit.eval.results``. The
table commands, which run this over a table's rows, are ``aspo_lit.eval.table_commands``.

The model is an HF hub id, a local folder, "testbed", or a Lightning checkpoint (`.ckpt`) of
`ASPOModule`, exported to HF format on the fly (``aspo_lit.training.export.export_checkpoint``).

``--like_fit`` evaluates a fit's own held-out problems with its validation loop's settings, so that
the number is the ``val/avg@K`` the fit logged (``aspo_lit.eval.like_fit``, docs/evaluation.md,
"In-training validation and offline evaluation").
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import sys
from pathlib import Path
from typing import Any, Literal

import torch

from aspo_lit.eval import like_fit
from aspo_lit.eval.choice import GPQA_SHUFFLE_SEED, PROMPT_FORMAT, ChoiceReward, encode_choice_prompt, extract_choice
from aspo_lit.eval.datasets import TABLE1_BENCHMARKS, Benchmark, get_benchmark, load_benchmark
from aspo_lit.eval.records import model_fingerprint, model_tag, pin_settings, read_done, read_sample_records, write_json
from aspo_lit.eval.results import SE_FIELDS, benchmark_metrics, write_model_results
from aspo_lit.prompts import encode_code_prompt, encode_prompt
from aspo_lit.rewards import MathReward, extract_answer
from aspo_lit.rewards.code import CodeReward, extract_code
from aspo_lit.rollout import SamplingConfig, build_engine
from aspo_lit.training.export import export_checkpoint, is_checkpoint
from aspo_lit.training.models import load_tokenizer, resolve_model_path

log = logging.getLogger(__name__)


#: The paper states T = 0.8 (§7.1) and 32,768 new tokens (Appendix B); top_p 0.95 is the authors'
#: evaluation scripts' (Archer2.0, scripts/eval/run_eval.sh: `top_p=0.95` for LiveCodeBench v5 and
#: v6; tools/run_eval_pipeline.sh: `top_p=0.95` for LiveCodeBench, AIME24 and AIME25), with top_k off.
SAMPLING_DEFAULTS = {"temperature": 0.8, "top_p": 0.95, "max_tokens": 32768, "seed": 0}
#: The `evaluate` command's defaults for the options it leaves unset (None: `--like_fit` tells them apart).
EVALUATE_DEFAULTS = {**SAMPLING_DEFAULTS, "engine": "auto", "template": "chat", "verifier": "either"}
EVAL_DTYPES = ("bfloat16", "float16", "float32")


def eval_dtype(dtype: str | None = None) -> str:
    """The dtype every row of an evaluation runs in, hub baselines and exported checkpoints alike:
    `dtype` as given, else bf16 on GPU (the authors' vLLM rollouts: `rollout.dtype: bfloat16`,
    Archer2.0 verl/trainer/config/generation.yaml) and fp32 on CPU (the testbed, trained in fp32)."""
    if dtype is None:
        return "bfloat16" if torch.cuda.is_available() else "float32"
    if dtype not in EVAL_DTYPES:
        raise ValueError(f"dtype must be one of {EVAL_DTYPES} (or null: bf16 on GPU, fp32 on CPU), got {dtype!r}")
    return dtype


def resolve_model(model: str, cache_dir: Path) -> str:
    """An HF-loadable path or id for `model` (a checkpoint is exported once into `cache_dir`)."""
    if not is_checkpoint(model):
        return resolve_model_path(str(model))
    if not Path(model).exists():
        raise FileNotFoundError(f"checkpoint {model} not found")
    out = Path(cache_dir) / f"{model_tag(model)}"
    if not (out / "exported_from.json").is_file():
        export_checkpoint(model, out)
    return str(out)


def evaluate_model(model, benchmarks, out_dir, k=None, temperature=0.8,
                   top_p=SAMPLING_DEFAULTS["top_p"], max_tokens=32768, engine="auto", limit=None,
                   seed=0, *, tag=None, data_dir=None, template="chat", enable_thinking=False,
                   reward=None, samples_per_call=1024, engine_kwargs=None, code_reward=None,
                   system_prompt=None, dtype=None, failures: dict[str, str] | None = None,
                   stop: list[str] | None = None, fit_batches: int | None = None) -> dict[str, dict]:
    """Evaluate one model on benchmarks; returns {benchmark: metrics} (see `done.json`).

    benchmarks: names ("aime24", ...) or dicts {"name", "path"?, "k"?, "limit"?, "rows"?, "meta"?, ...}
    ("rows": the benchmark's rows, already loaded; a row with ``prompt_ids`` is sampled from those
    token ids as they are; "meta": more settings to pin in its `meta.json`).
    k: None (each benchmark's paper K), an int, or {name: K}. limit: first N problems.
    engine: "auto" / an engine name for `aspo_lit.rollout.build_engine`, or a RolloutEngine (used
    as it is: `dtype` does not reach it).
    dtype: the model's dtype in the engine (`eval_dtype`: default bf16 on GPU, fp32 on CPU).
    reward: for math benchmarks, an object with `.batch(texts, golds)` or a dict of `MathReward`
    arguments (e.g. `{"verifier": "released"}`); default `MathReward()` (verifier "either").
    code_reward: for code benchmarks, such an object or a dict of `CodeReward` arguments (e.g.
    `{"sandbox": "bwrap", "timeout_s": 6}`); default `CodeReward()`.
    system_prompt: an optional system message for code prompts (default none).
    failures: None: the first benchmark that cannot be loaded or evaluated raises. A dict: each
    such benchmark is recorded there ({name: reason}) and the others are evaluated.
    stop: stop strings (default none).
    fit_batches: None (default): engine calls of up to `samples_per_call` samples, each seeded by
    `_call_seed`. An int B: a fit's validation draw (`aspo_lit.rollout_stage.controller.RolloutController.evaluate`):
    calls of B consecutive problems x K samples, every call seeded with `seed` itself.
    """
    out = Path(out_dir) / (tag or model_tag(model))
    out.mkdir(parents=True, exist_ok=True)
    run = _EvalRun(model, out, engine, engine_kwargs, template, enable_thinking, reward,
                   cache_dir=Path(out_dir) / ".exported", code_reward=code_reward,
                   system_prompt=system_prompt, dtype=eval_dtype(dtype))
    sampling = {"temperature": temperature, "top_p": top_p, "max_tokens": max_tokens, "seed": seed}
    # pinned only when set, so that results folders written before them stay readable
    sampling.update({key: value for key, value in (("stop", stop), ("fit_batches", fit_batches)) if value})
    results = {}
    try:
        for spec in benchmarks:
            spec = benchmark_spec(spec, k)
            try:
                bench = get_benchmark(spec)
                rows = spec.get("rows")
                if rows is None:
                    rows = load_benchmark(bench, path=spec.get("path"), data_dir=data_dir)
                bench_limit = spec.get("limit", limit)
                rows = rows[:bench_limit] if bench_limit else rows
                results[bench.name] = _evaluate_benchmark(run, bench, rows, bench.k, sampling, samples_per_call,
                                                          spec.get("meta"))
            except Exception as e:   # with `failures`, one benchmark must not lose the others
                if failures is None:
                    raise
                failures[spec["name"]] = failure_reason(e)
                log.error("%s: %s failed — %s", out.name, spec["name"], failures[spec["name"]],
                          exc_info=not isinstance(e, (FileNotFoundError, ConnectionError)))
    finally:
        run.close()
    write_model_results(out, results)
    return results


def benchmark_spec(spec, k=None) -> dict:
    """A benchmark entry as a dict {"name", "k"?, ...}: K is the entry's own, else the call's (an
    int or {name: K}), else (absent) the paper's."""
    if isinstance(spec, Benchmark):
        spec = {**spec.__dict__}
    spec = {"name": spec} if isinstance(spec, str) else dict(spec)
    spec["k"] = spec.get("k") or (k.get(spec["name"]) if isinstance(k, dict) else k)
    return {key: value for key, value in spec.items() if value is not None}


def failure_reason(error: BaseException) -> str:
    """One line saying why: the exception's type and the first line of its message."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0][:300] if lines else ''}".rstrip(": ")


class _EvalRun:
    """One model's evaluation, its model side: the model resolved/exported lazily, the engine built on
    first use (a model whose benchmarks are all done never loads), the graders, the prompt encoders."""

    def __init__(self, model, out, engine, engine_kwargs, template, enable_thinking, reward,
                 cache_dir, code_reward=None, system_prompt=None, dtype="float32"):
        self.model, self.out, self.engine_spec = str(model), out, engine
        self.engine_kwargs = dict(engine_kwargs or {})
        if self.engine_kwargs.get("dtype", dtype) != dtype:
            raise ValueError(f"engine_kwargs dtype {self.engine_kwargs['dtype']!r} differs from the "
                             f"evaluation dtype {dtype!r}: set `dtype` alone")
        # an engine instance is used as it is: record its own dtype, if it says
        self.dtype = dtype if isinstance(engine, str) else getattr(engine, "dtype", None)
        self._engine_error = None
        self.template, self.enable_thinking = template, enable_thinking
        self.cache_dir = cache_dir
        self.reward_spec, self._engine, self.tokenizer = reward, None, None
        self._reward = reward if hasattr(reward, "batch") else None
        self.code_reward_spec = code_reward
        self._code_reward = code_reward if hasattr(code_reward, "batch") else None
        self.system_prompt = system_prompt
        self._choice_reward = None

    @functools.cached_property
    def meta(self) -> dict:
        """What the samples depend on besides the sampling settings."""
        weights = self.model if is_checkpoint(self.model) else resolve_model_path(self.model)
        return {"model": self.model, "model_fingerprint": model_fingerprint(weights),
                "template": self.template, "enable_thinking": self.enable_thinking,
                "dtype": self.dtype}

    @property
    def reward(self):
        if self._reward is None:
            self._reward = MathReward(**(self.reward_spec or {}))
        return self._reward

    @property
    def code_reward(self):
        if self._code_reward is None:
            self._code_reward = CodeReward(**(self.code_reward_spec or {}))
        return self._code_reward

    @property
    def choice_reward(self):
        if self._choice_reward is None:
            self._choice_reward = ChoiceReward()
        return self._choice_reward

    def reward_for(self, domain: str):
        if domain == "choice":
            return self.choice_reward
        return self.code_reward if domain == "code" else self.reward

    def meta_for(self, bench) -> dict:
        """What a benchmark's samples depend on besides sampling: code prompts add their format."""
        if bench.domain == "choice":
            return {**self.meta, "prompt_format": PROMPT_FORMAT, "gpqa_shuffle_seed": GPQA_SHUFFLE_SEED}
        if bench.domain != "code":   # a sample's `correct` is the verifier's
            return {**self.meta, "verifier": getattr(self.reward, "verifier", type(self.reward).__name__)}
        return {**self.meta, "prompt_format": "livecodebench-generic", "system_prompt": self.system_prompt}

    @property
    def engine(self):
        """Built on first use; the model is loaded in `self.dtype` (an exported checkpoint, saved in
        its training dtype, is cast on load like a hub model). An engine that failed to start is
        not retried for the next benchmark: its error is raised again."""
        if self._engine_error is not None:
            raise RuntimeError(f"the engine did not start: {self._engine_error}")
        if self._engine is None:
            try:
                path = resolve_model(self.model, self.cache_dir)
                self.tokenizer = load_tokenizer(path)
                engine = self.engine_spec
                if isinstance(engine, str):
                    engine = build_engine(engine, **{**self.engine_kwargs, "dtype": self.dtype})
                engine.attach(None, self.tokenizer, path)   # the engine loads the weights itself
            except Exception as e:
                self._engine_error = failure_reason(e)
                raise
            self._engine = engine
        return self._engine

    def prompt_ids(self, row: dict, domain: str = "math") -> list[int]:
        if "prompt_ids" in row:   # encoded by its source (a fit's DataModule: aspo_lit.eval.like_fit)
            return list(row["prompt_ids"])
        if domain == "choice":
            return encode_choice_prompt(row, self.tokenizer, self.template, self.enable_thinking)
        if domain == "code":
            return encode_code_prompt(row["problem"], row.get("starter_code"), self.tokenizer, self.template,
                                      self.enable_thinking, self.system_prompt)
        return encode_prompt(row["problem"], self.tokenizer, self.template, self.enable_thinking)

    def close(self):
        # an engine or reward passed in belongs to the caller
        if self._engine is not None and self._engine is not self.engine_spec:
            self._engine.close()
        if self._reward is not None and self._reward is not self.reward_spec:
            getattr(self._reward, "close", lambda: None)()
        if self._code_reward is not None and self._code_reward is not self.code_reward_spec:
            getattr(self._code_reward, "close", lambda: None)()


def _evaluate_benchmark(run, bench, rows, k, sampling, samples_per_call, extra_meta=None) -> dict:
    out = run.out
    done_path = out / f"{bench.name}.done.json"
    ids = [r["id"] for r in rows]
    ids_sha1 = hashlib.sha1("\n".join(ids).encode()).hexdigest()
    meta = {**run.meta_for(bench), **_grading_meta(run, bench, rows), **(extra_meta or {}), **sampling}
    pin_settings(out / f"{bench.name}.meta.json", meta)
    done = read_done(done_path, k, ids_sha1)
    if done is not None and all(field in done for field in SE_FIELDS):
        log.info("%s: %s already evaluated (%s), not recomputed", out.name, bench.name, done_path)
        return done
    # a done.json from before the standard errors: its records give them, nothing is sampled again

    samples_path = out / f"{bench.name}.samples.jsonl"
    records = read_sample_records(samples_path)
    if sampling.get("fit_batches"):
        batches = list(_fit_batches(rows, k, sampling["fit_batches"], records))
    else:
        todo = [(i, row, [s for s in range(k) if (row["id"], s) not in records])
                for i, row in enumerate(rows)]
        batches = list(_engine_batches([t for t in todo if t[2]], samples_per_call))
    if batches:
        log.info("%s: %s — %d of %d problems to sample (K=%d)", out.name, bench.name,
                 sum(len(b) for b in batches), len(rows), k)
        with open(samples_path, "a", encoding="utf-8") as sink:
            for batch in batches:
                _sample_batch(run, batch, sampling, sink, records, bench.domain)

    counts, tokens, truncated = [], [], 0
    for row in rows:
        recs = [records[(row["id"], s)] for s in range(k)]
        counts.append(sum(int(bool(r["correct"])) for r in recs))
        tokens += [r.get("num_tokens") or 0 for r in recs]
        truncated += sum(r.get("finish_reason") == "length" for r in recs)
    metrics = benchmark_metrics(counts, k)
    done = {"benchmark": bench.name, "column": bench.column, "k": k, "n_problems": len(rows),
            "avg@k": metrics["avg@k"], "pass@k": metrics["pass@k"],
            **{field: metrics[field] for field in SE_FIELDS},
            f"{bench.column}_avg@{k}": metrics["avg@k"],
            f"{bench.column}_pass@{k}": metrics["pass@k"],
            "mean_response_tokens": sum(tokens) / max(len(tokens), 1),
            "truncated_frac": truncated / max(len(rows) * k, 1),
            "problem_ids_sha1": ids_sha1, "settings": meta}
    write_json(done_path, done)
    return done


def _grading_meta(run, bench, rows) -> dict:
    """What a code benchmark's verdicts depend on besides the samples: which tests its rows hold
    (`tests_scope`) and the grader's limits."""
    if bench.domain != "code":
        return {}
    reward = run.code_reward
    limits = {name: getattr(reward, name, None) for name in
              ("timeout_s", "max_total_timeout_s", "memory_limit_mb", "max_tests", "use_row_limits")}
    return {"tests_scope": ",".join(sorted({str(r.get("tests_scope") or "as_given") for r in rows})),
            "code_grader": limits}


def _engine_batches(todo, samples_per_call):
    """The problems of one engine call each: consecutive problems needing the same number of
    samples, up to `samples_per_call` samples per call (one problem at least)."""
    batch, size = [], 0
    for item in todo:
        n = len(item[2])
        if batch and (n != len(batch[0][2]) or size + n > samples_per_call):
            yield batch
            batch, size = [], 0
        batch.append(item)
        size += n
    if batch:
        yield batch


def _fit_batches(rows, k, problems_per_call, records):
    """The calls of a fit's validation loop (`fit_batches`): consecutive `problems_per_call`
    problems, K samples each, as its dataloader batches them (`RLDataModule.val_dataloader`). A
    call whose samples are all recorded is skipped; any other is drawn whole, since a sample
    depends on every row of its call."""
    for start in range(0, len(rows), problems_per_call):
        batch = [(i, row, list(range(k))) for i, row in enumerate(rows[start:start + problems_per_call], start)]
        if any((row["id"], s) not in records for _, row, samples in batch for s in samples):
            yield batch


def _sample_batch(run, batch, sampling, sink, records, domain="math") -> None:
    engine = run.engine
    n = len(batch[0][2])
    first_index, first_sample = batch[0][0], batch[0][2][0]
    # a fit's validation seeds every call with its run seed (RolloutController.val_sampling)
    seed = sampling["seed"] if sampling.get("fit_batches") else _call_seed(sampling["seed"], first_index, first_sample)
    config = SamplingConfig(temperature=sampling["temperature"], top_p=sampling["top_p"],
                            max_tokens=sampling["max_tokens"], stop=sampling.get("stop"), seed=seed)
    outputs = engine.generate([run.prompt_ids(row, domain) for _, row, _ in batch], n, config)
    if len(outputs) != len(batch) or any(len(o) != n for o in outputs):
        raise RuntimeError(f"engine returned {[len(o) for o in outputs]} samples for "
                           f"{len(batch)} prompts x n={n}")
    texts = [c.text for completions in outputs for c in completions]
    golds = [row["answer"] for _, row, _ in batch for _ in range(n)]
    reward = run.reward_for(domain)
    statuses = [None] * len(texts)
    if domain == "code" and hasattr(reward, "run_batch"):
        graded = reward.run_batch(texts, golds)
        scores, statuses = [g.score for g in graded], [g.status for g in graded]
    else:
        scores = reward.batch(texts, golds)
    think_end = getattr(reward, "think_end_token", "</think>")
    flat = iter(zip([c for completions in outputs for c in completions], scores, statuses))
    lines = []
    for _, row, sample_indices in batch:
        for s in sample_indices:
            completion, score, status = next(flat)
            rec = {"problem_id": row["id"], "sample_index": s,
                   "text_sha1": hashlib.sha1(completion.text.encode()).hexdigest(),
                   "answer_extracted": _extracted(completion.text, domain, think_end),
                   "correct": bool(score > 0.5), "finish_reason": completion.finish_reason,
                   "num_tokens": len(completion.token_ids)}
            if status is not None:
                rec["status"] = status
            lines.append(json.dumps(rec, ensure_ascii=False) + "\n")
            records[(row["id"], s)] = rec
    sink.write("".join(lines))   # one write per call: a kill leaves whole calls (and a torn last line)
    sink.flush()


def _extracted(text: str, domain: str, think_end: str | None):
    """What was graded: the boxed answer (math), the letter (choice), or the sha1 of the
    extracted program (code)."""
    if domain == "choice":
        return extract_choice(text, think_end)
    if domain == "code":
        code = extract_code(text, think_end)
        return None if code is None else "code:" + hashlib.sha1(code.encode()).hexdigest()[:16]
    return extract_answer(text, think_end)


def _call_seed(seed: int, problem_index: int, sample_index: int) -> int:
    return (int(seed) * 1_000_003 + problem_index * 1009 + sample_index) % (2**31 - 1)


# --- CLI: `python -m aspo_lit evaluate` (aspo_lit/__main__.py) ---------------------------------

def evaluate(model: str, benchmarks: list[str] | None = None, data_paths: dict[str, str] | None = None,
             data_dir: str | None = None, out: str = "runs/eval", tag: str | None = None,
             k: int | None = None, limit: int | None = None,
             temperature: float | None = None, top_p: float | None = None,
             max_tokens: int | None = None, seed: int | None = None,
             engine: str | None = None, template: Literal["chat", "plain"] | None = None,
             sandbox: Literal["bwrap", "rlimit"] = "bwrap", reward_timeout: float = 6.0,
             reward_total_timeout: float = 120.0,
             reward_workers: int | None = None,
             dtype: Literal["bfloat16", "float16", "float32"] | None = None,
             verifier: Literal["either", "released", "math_verify", "deepscaler"] | None = None,
             like_fit: str | None = None) -> int:
    """avg@K / pass@K of one model on the math, code or multiple-choice benchmarks.

    Args:
        model: HF hub id, local HF folder, 'testbed' / 'testbed-long', or an ASPOModule .ckpt.
        benchmarks: benchmark names (default: the six of Table 1; Table 2: lcb_v5, lcb_v6;
            Table 3: arc_challenge, gpqa_diamond, mmlu_pro).
        data_paths: a local file or folder per benchmark, e.g. {lcb_v5: data/code/lcb_v5.jsonl}.
        data_dir: folder with <name>.jsonl files (default: $ASPO_DATA_DIR; else the hub).
        out: output folder.
        tag: results folder name (default: from the model).
        k: samples per problem (default: the paper's K).
        limit: the first N problems of each benchmark.
        temperature: sampling temperature (default 0.8, the paper's).
        top_p: nucleus sampling (default 0.95, the authors' evaluation scripts').
        max_tokens: new tokens per sample (default 32768).
        seed: sampling seed (default 0).
        engine: 'auto' (default), 'hf' or 'vllm' (aspo_lit.rollout.build_engine).
        template: the model's chat template ('chat', default) or the bare message ('plain').
        sandbox: code benchmarks: bubblewrap (default) or rlimit-only isolation (opt-in).
        reward_timeout: code benchmarks: seconds per test (LiveCodeBench: 6; the authors' Table 2: 150).
        reward_total_timeout: code benchmarks: seconds per program over all its tests (the bound on
            DeepCoder's ``(per-test + 1) * tests + 5``; ``inf`` lifts it, as conf/table2.yaml).
        reward_workers: code benchmarks: programs graded in parallel (default: CPU count).
        dtype: the weights' dtype in the engine, checkpoints and hub models alike (null: bfloat16
            on GPU, as the authors; float32 on CPU; with like_fit: the fit's model.torch_dtype).
        verifier: math benchmarks: the verifier rule of `aspo_lit.rewards.MathReward`
            (default 'either'; docs/grading.md).
        like_fit: a fit's config.yaml (runs/NAME/version_N/config.yaml, or that folder): evaluate
            the fit's held-out problems as its validation loop did, so that avg@K is the
            val/avg@K it logged for this checkpoint: its K, temperature, top_p, max tokens, seeds,
            batches, prompts, engine and grader (data.reward; the code-grader options above do not
            apply). The options that choose problems or samples are then the fit's and must be left
            out (docs/evaluation.md, "In-training validation and offline evaluation").
    """
    setup_logging()
    chosen = {"benchmarks": benchmarks, "data_paths": data_paths, "data_dir": data_dir, "k": k, "limit": limit,
              "temperature": temperature, "top_p": top_p, "max_tokens": max_tokens, "seed": seed,
              "engine": engine, "template": template, "verifier": verifier}
    if like_fit is not None:
        given = [f"--{name}" for name, value in chosen.items() if value is not None]
        if given:
            raise ValueError(f"evaluate: with --like_fit the problems and sampling are the fit's; leave out "
                             f"{', '.join(given)}")
        evaluate_like_fit(model, like_fit, out, tag=tag, dtype=dtype)
    else:
        s = {name: EVALUATE_DEFAULTS[name] if value is None and name in EVALUATE_DEFAULTS else value
             for name, value in chosen.items()}
        paths = data_paths or {}
        names = benchmarks or list(TABLE1_BENCHMARKS)
        evaluate_model(model, [{"name": n, "path": paths.get(n)} for n in names], out, k=k,
                       temperature=s["temperature"], top_p=s["top_p"], max_tokens=s["max_tokens"],
                       engine=s["engine"], limit=limit, seed=s["seed"], tag=tag, data_dir=data_dir,
                       template=s["template"], dtype=dtype, reward={"verifier": s["verifier"]},
                       code_reward={"sandbox": sandbox, "timeout_s": reward_timeout, "num_workers": reward_workers,
                                    "max_total_timeout_s": reward_total_timeout})
    folder = Path(out) / (tag or model_tag(model))
    print((folder / "results.md").read_text())
    print(f"per-sample records and results in {folder}")
    return 0


def setup_logging():
    """INFO to stderr for a command (`evaluate`, `table1`...), unless the caller set up logging."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s",
                            stream=sys.stderr)


def evaluate_like_fit(model: str, config: str | Path, out: str | Path, tag: str | None = None,
                      dtype: str | None = None) -> dict[str, Any]:
    """Evaluate `model` (the fit's checkpoint, or its export) on the fit's held-out problems with
    its validation settings; returns the ``fit_val`` metrics (`evaluate_model`'s). `dtype`
    overrides ``model.torch_dtype`` (a vLLM fit sampled in the engine's dtype)."""
    fit = like_fit.fit_validation(config, model)
    kwargs = fit.evaluate_kwargs()
    if dtype is not None:
        kwargs["dtype"] = dtype
    try:
        return evaluate_model(model, [fit.benchmark()], out, tag=tag, **kwargs)[like_fit.FIT_VAL]
    finally:   # built from the config, so ours to close: the grader's workers, an engine instance
        for owned in (fit.reward, None if isinstance(fit.engine, str) else fit.engine):
            getattr(owned, "close", lambda: None)()
