"""Benchmark evaluation: K samples per problem, graded, avg@K and pass@K (paper §7.1, "Evaluation").

Math benchmarks (Table 1) are graded on the last ``\\boxed{}`` by ``aspo_lit.rewards.MathReward``
(correct when DeepScaleR's or math-verify's verifier accepts, docs/grading.md); code benchmarks
(Table 2: LiveCodeBench v5/v6) get LiveCodeBench's prompt and are graded by running the last
fenced Python block on the problem's tests in a sandbox (``aspo_lit.rewards.code.CodeReward``);
multiple-choice benchmarks (Table 3: ARC-Challenge, GPQA-Diamond, MMLU-Pro) get the lettered-options
prompt of ``aspo_lit.eval.choice`` and are graded by exact match of the last boxed letter
(``aspo_lit.eval.choice.ChoiceReward``).

Every sample is recorded as one JSONL line, flushed per problem, in
`<out_dir>/<model_tag>/<benchmark>.samples.jsonl`:

    {"problem_id", "sample_index", "text_sha1", "answer_extracted", "correct",
     "finish_reason", "num_tokens"}

so a killed or preempted evaluation resumes where it stopped (done (problem, sample) pairs are
skipped, never written twice), and a finished (model, benchmark) pair — `<benchmark>.done.json`
holding its metrics — is never recomputed. `<benchmark>.meta.json` pins the sampling settings:
samples drawn under other settings are never mixed in.

The model is an HF hub id, a local folder, "testbed", or a Lightning checkpoint (`.ckpt`) of
`ASPOModule`, exported to HF format on the fly (`export_checkpoint`).
"""
from __future__ import annotations

import csv
import functools
import hashlib
import json
import logging
import os
import re
import sys
import warnings
from pathlib import Path
from typing import Any, Literal

from aspo_lit.eval.datasets import Benchmark, get_benchmark, load_benchmark
from aspo_lit.prompts import encode_prompt
from aspo_lit.rewards import extract_answer

log = logging.getLogger(__name__)

#: The paper states T = 0.8 (§7.1) and 32,768 new tokens (Appendix B); top_p 0.95 is the authors'
#: evaluation scripts' (Archer2.0, scripts/eval/run_eval.sh: `top_p=0.95` for LiveCodeBench v5 and
#: v6; tools/run_eval_pipeline.sh: `top_p=0.95` for LiveCodeBench, AIME24 and AIME25), with top_k off.
SAMPLING_DEFAULTS = {"temperature": 0.8, "top_p": 0.95, "max_tokens": 32768, "seed": 0}
EVAL_DTYPES = ("bfloat16", "float16", "float32")


def eval_dtype(dtype: str | None = None) -> str:
    """The dtype every row of an evaluation runs in, hub baselines and exported checkpoints alike:
    `dtype` as given, else bf16 on GPU (the authors' vLLM rollouts: `rollout.dtype: bfloat16`,
    Archer2.0 verl/trainer/config/generation.yaml) and fp32 on CPU (the testbed, trained in fp32)."""
    if dtype is None:
        import torch
        return "bfloat16" if torch.cuda.is_available() else "float32"
    if dtype not in EVAL_DTYPES:
        raise ValueError(f"dtype must be one of {EVAL_DTYPES} (or null: bf16 on GPU, fp32 on CPU), got {dtype!r}")
    return dtype


# --- models ------------------------------------------------------------------------------------

def is_checkpoint(model: str) -> bool:
    return str(model).endswith(".ckpt")


def export_checkpoint(ckpt_path, out_dir, torch_dtype: str | None = None) -> Path:
    """Write the policy of an `ASPOModule` Lightning checkpoint as an HF model folder.

    The module keeps its policy under the attribute `policy` (state-dict keys `policy.*`) and
    its base model in the hyper-parameter `model_name_or_path`; the base model is loaded, the
    trained weights are put into it (all of them: a missing or unexpected key is an error), and
    model + tokenizer are saved with `save_pretrained`. Returns `out_dir`.
    """

    from aspo_lit.models import load_policy, load_tokenizer, resolve_model_path

    ckpt_path, out_dir = Path(ckpt_path), Path(out_dir)
    checkpoint = load_checkpoint(ckpt_path)
    hparams = checkpoint.get("hyper_parameters") or {}
    base = hparams.get("model_name_or_path")
    if not base:
        raise ValueError(f"{ckpt_path}: no hyper_parameters['model_name_or_path'] "
                         "(not an ASPOModule checkpoint?)")
    prefix = "policy."
    state = {k[len(prefix):]: v for k, v in checkpoint["state_dict"].items() if k.startswith(prefix)}
    if not state:
        raise ValueError(f"{ckpt_path}: no '{prefix}*' weights in its state_dict")
    dtype = torch_dtype or hparams.get("torch_dtype") or "float32"
    model = load_policy(base, dtype)
    try:
        result = model.load_state_dict(state, strict=False)
    except RuntimeError as e:   # shape mismatches raise even with strict=False
        raise ValueError(f"{ckpt_path}: weights do not fit base model {base!r} (resolved to "
                         f"{resolve_model_path(base)}; was it rebuilt or changed since "
                         f"training?): {str(e).splitlines()[-1].strip()}") from None
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    missing = [k for k in result.missing_keys if k not in tied]
    if missing or result.unexpected_keys:
        raise ValueError(f"{ckpt_path}: weights do not fit base model {base!r}: missing "
                         f"{missing[:5]}, unexpected {result.unexpected_keys[:5]}")
    model.config.use_cache = True
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    load_tokenizer(base).save_pretrained(out_dir)
    (out_dir / "exported_from.json").write_text(json.dumps(
        {"checkpoint": str(ckpt_path.resolve()), "base_model": base,
         "global_step": checkpoint.get("global_step")}, indent=1))
    return out_dir


def load_checkpoint(ckpt_path: Path) -> dict:
    """A Lightning checkpoint as one dict, with the module's full (unsharded) `state_dict`.

    A file is a plain `torch.save`. A folder is what `ModelParallelStrategy` (FSDP2) writes: a
    torch.distributed checkpoint of the sharded state plus `meta.pt` with everything else; only
    its `state_dict` entry is read (not the optimizer states), gathered into one process.
    """
    import torch

    def torch_load(path):
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except Exception:   # our own checkpoints: hyper-parameters may hold non-tensor objects
            return torch.load(path, map_location="cpu", weights_only=False)

    if not ckpt_path.is_dir():
        return torch_load(ckpt_path)
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    if not (ckpt_path / "meta.pt").is_file():
        raise ValueError(f"{ckpt_path}: a folder, but not a Lightning distributed checkpoint "
                         "(no meta.pt)")
    checkpoint = torch_load(ckpt_path / "meta.pt")
    with warnings.catch_warnings():   # "assuming the intent is to load in a single process"
        warnings.simplefilter("ignore", UserWarning)
        sharded = _load_state_dict_from_keys({"state_dict"}, checkpoint_id=str(ckpt_path))
    checkpoint["state_dict"] = sharded["state_dict"]
    return checkpoint


def model_fingerprint(model: str) -> str:
    """Identifies the weights: the hub id, or sizes and mtimes of a local file/folder."""
    path = Path(model).expanduser()
    if not path.exists():
        return str(model)
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())
    parts = [f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in files]
    return hashlib.sha1("|".join([str(path.resolve()), *parts]).encode()).hexdigest()[:12]


def model_tag(model: str) -> str:
    """Folder name of a model's results: `org__name` for a hub id; for local weights their name
    and fingerprint, `<folder>-<fp>` or `<run>-<ckpt stem>-<fp>`, so that retrained or rebuilt
    weights (the testbed included) get fresh results instead of stale ones."""
    from aspo_lit.models import resolve_model_path
    from aspo_lit.testbed import PROFILES

    model = str(model)
    path = Path(model).expanduser()
    if is_checkpoint(model):   # runs/<name>/checkpoints/last.ckpt -> <name>-last-<fp>
        run = path.parent.parent if path.parent.name == "checkpoints" else path.parent
        run = f"{run.parent.name}-{run.name}" if run.name.startswith("version_") else run.name
        tag = f"{run}-{path.stem}-{model_fingerprint(model)[:8]}"
    elif model in PROFILES or path.exists():
        local = Path(resolve_model_path(model)).resolve()
        tag = f"{local.name}-{model_fingerprint(str(local))[:8]}"
    else:
        tag = model.replace("/", "__")
    return re.sub(r"[^A-Za-z0-9._=+-]", "_", tag)


def resolve_model(model: str, cache_dir: Path) -> str:
    """An HF-loadable path or id for `model` (a checkpoint is exported once into `cache_dir`)."""
    from aspo_lit.models import resolve_model_path

    if not is_checkpoint(model):
        return resolve_model_path(str(model))
    if not Path(model).exists():
        raise FileNotFoundError(f"checkpoint {model} not found")
    out = Path(cache_dir) / f"{model_tag(model)}"
    if not (out / "exported_from.json").is_file():
        export_checkpoint(model, out)
    return str(out)


# --- per-sample records ------------------------------------------------------------------------

def read_sample_records(path: Path) -> dict[tuple[str, int], dict]:
    """Records already written, keyed by (problem_id, sample_index); the first one wins. A torn
    last line (the process was killed mid-write) is cut off so appending continues cleanly."""
    records: dict[tuple[str, int], dict] = {}
    if not path.is_file():
        return records
    with open(path, "rb+") as f:
        data = f.read()
        end = data.rfind(b"\n") + 1
        if end < len(data):
            log.warning("%s: dropping a torn last line (%d bytes)", path, len(data) - end)
            f.truncate(end)
    for lineno, line in enumerate(data[:end].decode("utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            records.setdefault((str(rec["problem_id"]), int(rec["sample_index"])), rec)
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            log.warning("%s, line %d: unreadable record skipped", path, lineno)
    return records


# --- metrics -----------------------------------------------------------------------------------

def benchmark_metrics(correct_counts: list[int], k: int) -> dict[str, float]:
    """avg@K and unbiased pass@K in percent from per-problem correct counts out of K samples."""
    import torch

    from aspo_lit.metrics import AvgAtK, PassAtK

    counts = torch.tensor(correct_counts, dtype=torch.long)
    scores = {}
    for name, metric in (("avg@k", AvgAtK()), ("pass@k", PassAtK(k))):
        metric.update(counts, k)
        scores[name] = 100.0 * float(metric.compute())
    return scores


# --- evaluation --------------------------------------------------------------------------------

def evaluate_model(model, benchmarks, out_dir, k=None, temperature=0.8,
                   top_p=SAMPLING_DEFAULTS["top_p"], max_tokens=32768, engine="auto", limit=None,
                   seed=0, *, tag=None, data_dir=None, template="chat", enable_thinking=False,
                   reward=None, samples_per_call=1024, engine_kwargs=None, code_reward=None,
                   system_prompt=None, dtype=None, failures: dict[str, str] | None = None) -> dict[str, dict]:
    """Evaluate one model on benchmarks; returns {benchmark: metrics} (see `done.json`).

    benchmarks: names ("aime24", ...) or dicts {"name", "path"?, "k"?, "limit"?, "rows"?, ...}
    ("rows": the benchmark's rows, already loaded).
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
    """
    out = Path(out_dir) / (tag or model_tag(model))
    out.mkdir(parents=True, exist_ok=True)
    session = _Session(model, out, engine, engine_kwargs, template, enable_thinking, reward,
                       cache_dir=Path(out_dir) / ".exported", code_reward=code_reward,
                       system_prompt=system_prompt, dtype=eval_dtype(dtype))
    sampling = {"temperature": temperature, "top_p": top_p, "max_tokens": max_tokens, "seed": seed}
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
                results[bench.name] = _evaluate_benchmark(session, bench, rows, bench.k, sampling,
                                                          samples_per_call)
            except Exception as e:   # noqa: BLE001 - with `failures`, one benchmark must not lose the others
                if failures is None:
                    raise
                failures[spec["name"]] = failure_reason(e)
                log.error("%s: %s failed — %s", out.name, spec["name"], failures[spec["name"]],
                          exc_info=not isinstance(e, (FileNotFoundError, ConnectionError)))
    finally:
        session.close()
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


class _Session:
    """The model side of one evaluation: resolved/exported lazily, the engine built on first use
    (a model whose benchmarks are all done never loads)."""

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
        from aspo_lit.models import resolve_model_path
        weights = self.model if is_checkpoint(self.model) else resolve_model_path(self.model)
        return {"model": self.model, "model_fingerprint": model_fingerprint(weights),
                "template": self.template, "enable_thinking": self.enable_thinking,
                "dtype": self.dtype}

    @property
    def reward(self):
        if self._reward is None:
            from aspo_lit.rewards import MathReward
            self._reward = MathReward(**(self.reward_spec or {}))
        return self._reward

    @property
    def code_reward(self):
        if self._code_reward is None:
            from aspo_lit.rewards.code import CodeReward
            self._code_reward = CodeReward(**(self.code_reward_spec or {}))
        return self._code_reward

    @property
    def choice_reward(self):
        if self._choice_reward is None:
            from aspo_lit.eval.choice import ChoiceReward
            self._choice_reward = ChoiceReward()
        return self._choice_reward

    def reward_for(self, domain: str):
        if domain == "choice":
            return self.choice_reward
        return self.code_reward if domain == "code" else self.reward

    def meta_for(self, bench) -> dict:
        """What a benchmark's samples depend on besides sampling: code prompts add their format."""
        if bench.domain == "choice":
            from aspo_lit.eval.choice import GPQA_SHUFFLE_SEED, PROMPT_FORMAT
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
                from aspo_lit.models import load_tokenizer
                path = resolve_model(self.model, self.cache_dir)
                self.tokenizer = load_tokenizer(path)
                engine = self.engine_spec
                if isinstance(engine, str):
                    from aspo_lit.rollout import build_engine
                    engine = build_engine(engine, **{**self.engine_kwargs, "dtype": self.dtype})
                engine.attach(None, self.tokenizer, path)   # the engine loads the weights itself
            except Exception as e:
                self._engine_error = failure_reason(e)
                raise
            self._engine = engine
        return self._engine

    def prompt_ids(self, row: dict, domain: str = "math") -> list[int]:
        if domain == "choice":
            from aspo_lit.eval.choice import encode_choice_prompt
            return encode_choice_prompt(row, self.tokenizer, self.template, self.enable_thinking)
        if domain == "code":
            from aspo_lit.prompts import encode_code_prompt
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


def _evaluate_benchmark(session, bench, rows, k, sampling, samples_per_call) -> dict:
    out = session.out
    done_path = out / f"{bench.name}.done.json"
    ids = [r["id"] for r in rows]
    ids_sha1 = hashlib.sha1("\n".join(ids).encode()).hexdigest()
    meta = {**session.meta_for(bench), **_grading_meta(session, bench, rows), **sampling}
    _check_meta(out / f"{bench.name}.meta.json", meta)
    if done_path.is_file():
        done = json.loads(done_path.read_text())
        if done.get("k") == k and done.get("problem_ids_sha1") == ids_sha1:
            log.info("%s: %s already evaluated (%s), not recomputed", out.name, bench.name, done_path)
            return done

    samples_path = out / f"{bench.name}.samples.jsonl"
    records = read_sample_records(samples_path)
    todo = [(i, row, [s for s in range(k) if (row["id"], s) not in records])
            for i, row in enumerate(rows)]
    todo = [t for t in todo if t[2]]
    if todo:
        log.info("%s: %s — %d of %d problems to sample (K=%d)", out.name, bench.name, len(todo),
                 len(rows), k)
        with open(samples_path, "a", encoding="utf-8") as sink:
            for chunk in _chunks(todo, samples_per_call):
                _sample_chunk(session, chunk, sampling, sink, records, bench.domain)

    counts, tokens, truncated = [], [], 0
    for row in rows:
        recs = [records[(row["id"], s)] for s in range(k)]
        counts.append(sum(int(bool(r["correct"])) for r in recs))
        tokens += [r.get("num_tokens") or 0 for r in recs]
        truncated += sum(r.get("finish_reason") == "length" for r in recs)
    metrics = benchmark_metrics(counts, k)
    done = {"benchmark": bench.name, "column": bench.column, "k": k, "n_problems": len(rows),
            "avg@k": metrics["avg@k"], "pass@k": metrics["pass@k"],
            f"{bench.column}_avg@{k}": metrics["avg@k"],
            f"{bench.column}_pass@{k}": metrics["pass@k"],
            "mean_response_tokens": sum(tokens) / max(len(tokens), 1),
            "truncated_frac": truncated / max(len(rows) * k, 1),
            "problem_ids_sha1": ids_sha1, "settings": meta}
    _write_json(done_path, done)
    return done


def _grading_meta(session, bench, rows) -> dict:
    """What a code benchmark's verdicts depend on besides the samples: which tests its rows hold
    (`tests_scope`) and the grader's limits."""
    if bench.domain != "code":
        return {}
    reward = session.code_reward
    limits = {name: getattr(reward, name, None) for name in
              ("timeout_s", "max_total_timeout_s", "memory_limit_mb", "max_tests", "use_row_limits")}
    return {"tests_scope": ",".join(sorted({str(r.get("tests_scope") or "as_given") for r in rows})),
            "code_grader": limits}


def _check_meta(path: Path, meta: dict) -> None:
    if path.is_file():
        old = json.loads(path.read_text())
        if old != meta:
            diff = {key: (old.get(key), meta.get(key)) for key in set(old) | set(meta)
                    if old.get(key) != meta.get(key)}
            raise ValueError(f"{path}: samples there were drawn with other settings {diff} "
                             "(old, new); use another out_dir or tag, or delete that folder")
    else:
        _write_json(path, meta)


def _chunks(todo, samples_per_call):
    """Consecutive problems needing the same number of samples, up to `samples_per_call`
    samples per engine call (one problem at least)."""
    chunk, size = [], 0
    for item in todo:
        n = len(item[2])
        if chunk and (n != len(chunk[0][2]) or size + n > samples_per_call):
            yield chunk
            chunk, size = [], 0
        chunk.append(item)
        size += n
    if chunk:
        yield chunk


def _sample_chunk(session, chunk, sampling, sink, records, domain="math") -> None:
    from aspo_lit.rollout import SamplingConfig

    engine = session.engine
    n = len(chunk[0][2])
    first_index, first_sample = chunk[0][0], chunk[0][2][0]
    config = SamplingConfig(temperature=sampling["temperature"], top_p=sampling["top_p"],
                            max_tokens=sampling["max_tokens"],
                            seed=_call_seed(sampling["seed"], first_index, first_sample))
    outputs = engine.generate([session.prompt_ids(row, domain) for _, row, _ in chunk], n, config)
    if len(outputs) != len(chunk) or any(len(o) != n for o in outputs):
        raise RuntimeError(f"engine returned {[len(o) for o in outputs]} samples for "
                           f"{len(chunk)} prompts x n={n}")
    texts = [c.text for completions in outputs for c in completions]
    golds = [row["answer"] for _, row, _ in chunk for _ in range(n)]
    reward = session.reward_for(domain)
    statuses = [None] * len(texts)
    if domain == "code" and hasattr(reward, "run_batch"):
        graded = reward.run_batch(texts, golds)
        scores, statuses = [g.score for g in graded], [g.status for g in graded]
    else:
        scores = reward.batch(texts, golds)
    think_end = getattr(reward, "think_end_token", "</think>")
    flat = iter(zip([c for completions in outputs for c in completions], scores, statuses))
    for _, row, sample_indices in chunk:
        for s in sample_indices:
            completion, score, status = next(flat)
            rec = {"problem_id": row["id"], "sample_index": s,
                   "text_sha1": hashlib.sha1(completion.text.encode()).hexdigest(),
                   "answer_extracted": _extracted(completion.text, domain, think_end),
                   "correct": bool(score > 0.5), "finish_reason": completion.finish_reason,
                   "num_tokens": len(completion.token_ids)}
            if status is not None:
                rec["status"] = status
            sink.write(json.dumps(rec, ensure_ascii=False) + "\n")
            records[(row["id"], s)] = rec
        sink.flush()


def _extracted(text: str, domain: str, think_end: str | None):
    """What was graded: the boxed answer (math), the letter (choice), or the sha1 of the
    extracted program (code)."""
    if domain == "choice":
        from aspo_lit.eval.choice import extract_choice
        return extract_choice(text, think_end)
    if domain == "code":
        from aspo_lit.rewards.code import extract_code
        code = extract_code(text, think_end)
        return None if code is None else "code:" + hashlib.sha1(code.encode()).hexdigest()[:16]
    return extract_answer(text, think_end)


def _call_seed(seed: int, problem_index: int, sample_index: int) -> int:
    return (int(seed) * 1_000_003 + problem_index * 1009 + sample_index) % (2**31 - 1)


def _write_json(path: Path, obj) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=1, ensure_ascii=False))
    os.replace(tmp, path)


# --- outputs -----------------------------------------------------------------------------------

RESULT_FIELDS = ["benchmark", "k", "n_problems", "avg@k", "pass@k", "mean_response_tokens",
                 "truncated_frac"]


def table_columns(results: dict[str, dict]) -> dict[str, float]:
    """One Table 1 row of ours: {"aime24_avg@64": ..., "aime24_pass@64": ..., ...}."""
    columns = {}
    for r in results.values():
        columns[f"{r['column']}_avg@{r['k']}"] = r["avg@k"]
        columns[f"{r['column']}_pass@{r['k']}"] = r["pass@k"]
    return columns


def write_model_results(out: Path, results: dict[str, dict]) -> None:
    """<out>/results.csv and results.md: one line per benchmark evaluated so far for this model
    (merged with earlier calls' benchmarks, from their done.json files)."""
    merged = dict(results)
    for done in sorted(out.glob("*.done.json")):
        r = json.loads(done.read_text())
        merged.setdefault(r["benchmark"], r)
    with open(out / "results.csv", "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=RESULT_FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(merged.values())
    lines = [f"# {out.name}", "", "| benchmark | K | problems | avg@K | pass@K | mean tokens | "
             "truncated |", "|---|---|---|---|---|---|---|"]
    for r in merged.values():
        lines.append(f"| {r['benchmark']} | {r['k']} | {r['n_problems']} | {r['avg@k']:.1f} | "
                     f"{r['pass@k']:.1f} | {r['mean_response_tokens']:.0f} | "
                     f"{100 * r['truncated_frac']:.1f}% |")
    (out / "results.md").write_text("\n".join(lines) + "\n", encoding="utf-8")


# --- CLI: `python -m aspo_lit evaluate | table1 | table2 | table3` (aspo_lit/__main__.py) -------

def evaluate(model: str, benchmarks: list[str] | None = None, data_paths: dict[str, str] | None = None,
             data_dir: str | None = None, out: str = "runs/eval", tag: str | None = None,
             k: int | None = None, limit: int | None = None,
             temperature: float = SAMPLING_DEFAULTS["temperature"], top_p: float = SAMPLING_DEFAULTS["top_p"],
             max_tokens: int = SAMPLING_DEFAULTS["max_tokens"], seed: int = SAMPLING_DEFAULTS["seed"],
             engine: str = "auto", template: Literal["chat", "plain"] = "chat",
             sandbox: Literal["bwrap", "rlimit"] = "bwrap", reward_timeout: float = 6.0,
             reward_total_timeout: float = 120.0,
             reward_workers: int | None = None,
             dtype: Literal["bfloat16", "float16", "float32"] | None = None,
             verifier: Literal["either", "released", "math_verify", "deepscaler"] = "either") -> int:
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
        temperature: sampling temperature (the paper: 0.8).
        top_p: nucleus sampling (the authors' evaluation scripts: 0.95).
        max_tokens: new tokens per sample.
        seed: sampling seed.
        engine: 'auto', 'hf' or 'vllm' (aspo_lit.rollout.build_engine).
        template: the model's chat template ('chat') or the bare message ('plain').
        sandbox: code benchmarks: bubblewrap (default) or rlimit-only isolation (opt-in).
        reward_timeout: code benchmarks: seconds per test (LiveCodeBench: 6; the authors' Table 2: 150).
        reward_total_timeout: code benchmarks: seconds per program over all its tests (the bound on
            DeepCoder's ``(per-test + 1) * tests + 5``; ``inf`` lifts it, as conf/table2.yaml).
        reward_workers: code benchmarks: programs graded in parallel (default: CPU count).
        dtype: the weights' dtype in the engine, checkpoints and hub models alike (null: bfloat16
            on GPU, as the authors; float32 on CPU).
        verifier: math benchmarks: the verifier rule of `aspo_lit.rewards.MathReward`
            (docs/grading.md).
    """
    _setup_logging()
    from aspo_lit.eval.datasets import TABLE1_BENCHMARKS
    paths = data_paths or {}
    names = benchmarks or list(TABLE1_BENCHMARKS)
    evaluate_model(model, [{"name": n, "path": paths.get(n)} for n in names], out, k=k,
                   temperature=temperature, top_p=top_p, max_tokens=max_tokens, engine=engine,
                   limit=limit, seed=seed, tag=tag, data_dir=data_dir, template=template, dtype=dtype,
                   reward={"verifier": verifier},
                   code_reward={"sandbox": sandbox, "timeout_s": reward_timeout, "num_workers": reward_workers,
                                "max_total_timeout_s": reward_total_timeout})
    folder = Path(out) / (tag or model_tag(model))
    print((folder / "results.md").read_text())
    print(f"per-sample records and results in {folder}")
    return 0


def _setup_logging():
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s",
                            stream=sys.stderr)


# --- Table 1 -----------------------------------------------------------------------------------

def check_model(model: str, local_only: bool = False) -> str | None:
    """Why `model` cannot be evaluated (None when it can): a missing checkpoint or folder, or a
    hub id that does not load (offline, gated, misspelt). `local_only`: look in the HF cache
    only (after the hub was found unreachable, rather than waiting out its retries again)."""
    model = str(model)
    path = Path(model).expanduser()
    if is_checkpoint(model) or model.startswith((".", "/", "~")) or path.exists():
        return None if path.exists() else f"not found: {model}"
    from aspo_lit.testbed import PROFILES

    if model in PROFILES:   # built locally on first use
        return None
    try:
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
                    from aspo_lit.eval.choice import write_fixture
                    write_fixture(generate.pop("format"), path, **generate)
                    generate = None
                elif kind == "tiny_code":
                    from aspo_lit.testbed.tiny_code import generate_problems, write_jsonl
                else:
                    from aspo_lit.testbed.arithmetic import generate_problems, write_jsonl
                if generate is not None:
                    write_jsonl(generate_problems(**generate), path)
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


def run_table1(config: dict, compare_paper: bool | None = None, only: list[str] | None = None,
               root: Path | None = None):
    """Evaluate every row of a Table 1 config whose model is available and render the table.
    Returns (markdown, rows) of `aspo_lit.eval.tables.render_table1`."""
    return run_table(config, compare_paper, only, root, table="table1")


def run_table2(config: dict, compare_paper: bool | None = None, only: list[str] | None = None,
               root: Path | None = None):
    """Evaluate every row of a Table 2 (code) config whose model is available and render the
    table. Returns (markdown, rows) of `aspo_lit.eval.tables.render_table2`."""
    return run_table(config, compare_paper, only, root, table="table2")


def run_table(config: dict, compare_paper: bool | None = None, only: list[str] | None = None,
              root: Path | None = None, table: str | None = None):
    """Evaluate every row of a table config (`table: table1 | table2 | table3`, default table1) whose model
    is available and render the table beside the paper's. Math benchmarks are graded by
    `MathReward(**config["math_reward"])`, code benchmarks by `CodeReward(**config["code_reward"])`.

    Each (model, benchmark) cell is computed or marked missing on its own, with its reason: every
    benchmark is loaded once, before any model, and one that does not load (hub unreachable, no
    local file) or whose evaluation fails leaves only its own cells missing. The table's last line
    counts the cells (`count_cells`). Returns (markdown, rows) of `render_table`; a row's status is
    "ok", "incomplete" (its model was evaluated, some cells are missing) or "missing" (no model)."""
    from aspo_lit.eval.tables import lcb_tests_note, render_table

    table = table or config.get("table", "table1")
    root = Path(root or Path.cwd())
    out_dir = Path(config.get("out_dir", f"runs/{table}"))
    out_dir = out_dir if out_dir.is_absolute() else root / out_dir
    compare = config.get("compare_paper", False) if compare_paper is None else compare_paper
    sampling = {**SAMPLING_DEFAULTS, **(config.get("sampling") or {})}
    specs = [benchmark_spec(spec, config.get("k"))
             for spec in prepare_benchmark_files(list(config["benchmarks"]), out_dir)]
    loaded, unavailable = load_table_benchmarks(specs, config.get("data_dir"))
    results, missing, failed_cells, graded = {}, {}, {}, {}
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
        except Exception as e:   # noqa: BLE001 - one failed row must not lose the others
            log.exception("%s / %s: evaluation failed", *key)
            failed.update({s["name"]: f"evaluation failed: {failure_reason(e)}" for s in loaded})
        computed = table_columns(per_bench)   # in the config's benchmark order, missing cells as None
        ordered = {column: computed.get(column) for spec in specs for column in _columns_of(specs, spec["name"])}
        results[key] = {**ordered, **computed}
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
    return render_table(results, table, compare_paper=compare, missing=missing, out_dir=out_dir,
                        note=note, missing_cells=missing_cells,
                        footer=count_cells(n_rows * len(specs), len(missing) * len(specs),
                                           sum(len(failed) for failed in failed_cells.values())))


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


def run_table3(config: dict, compare_paper: bool | None = None, only: list[str] | None = None,
               root: Path | None = None):
    """Evaluate every row of a Table 3 (out-of-domain multiple choice) config whose model is
    available and render the table. Returns (markdown, rows) of `aspo_lit.eval.tables.render_table`."""
    return run_table(config, compare_paper, only, root, table="table3")


def table(rows: list[dict[str, Any]], benchmarks: list[str | dict[str, Any]],
          table: Literal["table1", "table2", "table3"] = "table1", out_dir: str | None = None,
          compare_paper: bool = False, engine: str = "auto", engine_kwargs: dict[str, Any] | None = None,
          data_dir: str | None = None, k: int | None = None, limit: int | None = None,
          template: Literal["chat", "plain"] = "chat", enable_thinking: bool = False,
          sampling: dict[str, Any] | None = None, samples_per_call: int = 1024,
          code_reward: dict[str, Any] | None = None, system_prompt: str | None = None,
          note: str | None = None, dtype: Literal["bfloat16", "float16", "float32"] | None = None,
          only: list[str] | None = None, math_reward: dict[str, Any] | None = None) -> int:
    """Evaluate a table config's rows (missing models are reported, not fabricated) and print the
    table beside the paper's: Table 1 (math), Table 2 (LiveCodeBench, in the code sandbox) or
    Table 3 (ARC-Challenge, GPQA-Diamond, MMLU-Pro: lettered options, last boxed letter).

    Each (model, benchmark) cell is computed or marked missing with its reason; the last line
    printed counts them. Exit status 0 when every cell of every available model was computed
    (rows whose model is not there yet are listed as missing), 1 when a benchmark did not load
    or an evaluation failed (the table is still written, with those cells missing).

    Args:
        rows: {base_model, method, model, produced_by?, tag?, sampling?, engine_kwargs?, template?,
            enable_thinking?} per row; base_model / method name the paper's row to compare with.
        benchmarks: benchmark names, or {name, k?, path?, generate?} (see prepare_benchmark_files).
        table: which of the paper's tables the rows fill.
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
    """
    _setup_logging()
    config = {key: value for key, value in locals().items() if key not in ("only", "table")}
    config["out_dir"] = out_dir or f"runs/{table}"
    markdown, rendered = run_table(config, compare_paper=compare_paper, only=only, table=table)
    print(markdown)
    folder = Path(config["out_dir"])
    print(f"written: {folder / f'{table}.md'}, {folder / f'{table}.csv'}; per-model results under "
          f"{folder / 'models'}")
    print(markdown.rstrip().splitlines()[-1])   # the count of computed and missing cells, last
    return 1 if any(r["status"] == "incomplete" for r in rendered) else 0
