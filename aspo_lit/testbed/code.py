"""The CPU code testbed: the arithmetic testbed's recipe, warm-started on tiny code problems.

Same architecture, tokenizer recipe and supervised warm start as ``aspo_lit.testbed`` (a 2-layer
llama, byte-level BPE with chat markers, SFT on response tokens stopped early at a target
expected sampled accuracy), but the prompts are LiveCodeBench's template
(``aspo_lit.prompts``) around the tiny problems of ``aspo_lit.testbed.tiny_code`` and the
responses are fenced one-line Python functions. The result is an RL starting point for the code
path (rollout → sandboxed execution reward → update) that runs in minutes on a CPU: groups hold
both passing and failing programs.

    python -m aspo_lit build-testbed --profile testbed-code [--force true] [--cache_dir DIR]

The folder ``<cache root>/testbed-code`` (the cache root of ``aspo_lit.testbed.config``:
``$ASPO_LIT_CACHE``, else ``<repo>/.cache/aspo_lit``, the folder ``conf/tiny/code_*.yaml`` name)
holds ``testbed.json`` with the config hash; a changed config rebuilds it.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from aspo_lit.testbed.build import publish, warm_start_into
from aspo_lit.testbed.config import TestbedConfig, default_cache_dir
from aspo_lit.testbed.sft import sft_loop
from aspo_lit.testbed.shipped import machine
from aspo_lit.testbed.tokenizer import left_padded

BUILDER_VERSION = 1
REPO_ROOT = Path(__file__).resolve().parents[2]
FOLDER = "testbed-code"


def code_testbed_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """``<cache_dir>/testbed-code``; ``cache_dir`` defaults to ``default_cache_dir()`` (``$ASPO_LIT_CACHE``,
    else ``<repo>/.cache/aspo_lit``), read at every call like the math testbed's."""
    return (Path(cache_dir) if cache_dir is not None else default_cache_dir()) / FOLDER


#: The folder when this module was imported (``build_code_testbed`` resolves it again per call).
DEFAULT_DIR = code_testbed_dir()


@dataclass
class CodeTestbedConfig(TestbedConfig):
    """``TestbedConfig`` with the code task's sizes (longer prompts, shorter warm start)."""

    num_train_problems: int = 4000
    tokenizer_train_problems: int = 2000
    max_position_embeddings: int = 2048   # LiveCodeBench prompts in the tiny Table 2 smoke test
    max_response_tokens: int = 48
    sft_max_steps: int = 1200
    sft_lr: float = 3e-3
    eval_min_step: int = 100
    stop_accuracy: float = 0.45
    dev_problems: int = 64
    heldout_problems: int = 64


def config_hash(config: CodeTestbedConfig) -> str:
    payload = json.dumps({"builder": BUILDER_VERSION, "kind": "code", **config.to_dict()}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:12]


def _prompt_ids(tokenizer, rows) -> list[list[int]]:
    from aspo_lit.prompts import encode_code_prompt

    return [encode_code_prompt(r["problem"], r["starter_code"], tokenizer, "chat") for r in rows]


def _examples(tokenizer, rows):
    responses = tokenizer([r["solution"] for r in rows], add_special_tokens=False)["input_ids"]
    return [(p, r + [tokenizer.eos_token_id]) for p, r in zip(_prompt_ids(tokenizer, rows), responses)]


def _normalized(code: str | None) -> str | None:
    return None if code is None else "".join(code.split())


def _sampled_match_rate(model, tokenizer, rows, config) -> dict:
    """One sample per problem at ``config.temperature``: the share whose extracted program equals
    the reference up to whitespace (a lower bound on the pass rate; no code is run here)."""
    import torch

    from aspo_lit.rewards.code import extract_code

    model.eval()
    prompts = _prompt_ids(tokenizer, rows)
    texts = []
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(config.seed)
        for start in range(0, len(prompts), 64):
            ids, mask = left_padded(prompts[start:start + 64], tokenizer.pad_token_id)
            width = ids.shape[1]
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True,
                                 temperature=config.temperature, top_k=0, top_p=1.0,
                                 max_new_tokens=config.max_response_tokens,
                                 eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
            texts += tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
    model.train()
    match = [_normalized(extract_code(t)) == _normalized(extract_code(r["solution"])) for t, r in zip(texts, rows)]
    return {"match_rate": sum(match) / max(len(match), 1), "n": len(match),
            "code_rate": sum(extract_code(t) is not None for t in texts) / max(len(texts), 1),
            "samples": [{"problem": r["problem"], "response": t} for r, t in list(zip(rows, texts))[:4]]}


def _sft(model, tokenizer, config, train_rows, dev_rows, log) -> dict:
    """Warm start on prompt → reference program (loss on response tokens), stopped once the
    expected sampled accuracy on held-out problems reaches ``config.stop_accuracy``."""
    import torch

    examples, dev = _examples(tokenizer, train_rows), _examples(tokenizer, dev_rows)
    opt = torch.optim.AdamW(model.parameters(), lr=config.sft_lr, betas=(0.9, 0.95),
                            weight_decay=config.sft_weight_decay)
    return sft_loop(model, opt, examples, dev, tokenizer.pad_token_id, config, log, name="code testbed")


def _build_into(out: Path, config: CodeTestbedConfig, log) -> dict:
    from aspo_lit.prompts import build_code_prompt
    from aspo_lit.testbed.tiny_code import generate_problems

    t0 = time.perf_counter()
    built = warm_start_into(
        out, config, generate_problems(config.num_train_problems, config.seed, "train"),
        generate_problems(config.heldout_problems + config.dev_problems, config.seed + 1, "heldout"),
        prompt_text=lambda row: build_code_prompt(row["problem"], row["starter_code"], None, "plain"),
        sft=_sft, evaluate=_sampled_match_rate, log=log, name="code testbed")
    history, final = built.history, built.heldout
    summary = {"name": "aspo-lit tiny code testbed", "config": config.to_dict(),
               "config_hash": config_hash(config), "builder_version": BUILDER_VERSION,
               "build_seconds": round(time.perf_counter() - t0, 1), "built_on": machine(config.num_threads),
               "num_parameters": built.num_parameters,
               "vocab_size": built.vocab_size, "sft_steps": history["steps"],
               "sft_seconds": history["sft_seconds"], "longest_example_tokens": history["longest_example"],
               "sft_evals": history["evals"][-5:], "heldout": final}
    (out / "testbed.json").write_text(json.dumps(summary, indent=2) + "\n")
    log(f"[code testbed] held-out exact-program rate @T={config.temperature} {final['match_rate']:.3f} "
        f"(n={final['n']}, fenced code in {final['code_rate']:.0%}), built in {summary['build_seconds']:.0f}s")
    return summary


def build_code_testbed(config: CodeTestbedConfig | None = None, out: str | Path | None = None,
                       force: bool = False, verbose: bool = True) -> Path:
    """The code testbed's folder, built (in a temporary folder, renamed into place) when missing
    or built from another config."""
    config = config or CodeTestbedConfig()
    final = Path(out) if out is not None else code_testbed_dir()
    meta = final / "testbed.json"
    if meta.is_file() and not force and json.loads(meta.read_text()).get("config_hash") == config_hash(config):
        return final
    log = (lambda msg: print(msg, file=sys.stderr, flush=True)) if verbose else (lambda msg: None)
    return publish(final, lambda tmp: _build_into(tmp, config, log), keep_concurrent=False)
