"""The CPU testbed: a tiny llama policy, warm-started on arithmetic, as an RL starting point.

No model or data set can be downloaded where the package is tested, and the paper's claims are
about training *dynamics* (entropy, clipping, repetition; paper §3–§5), so the package builds its
own policy on first use:

1. a small byte-level BPE tokenizer (digits always single tokens; ``tokenizers`` library) with
   special tokens ``<s> </s> <pad> <unk>`` and chat markers ``<|system|> <|user|> <|assistant|>``,
   wrapped as a ``PreTrainedTokenizerFast`` with a jinja chat template;
2. a tiny ``LlamaForCausalLM`` (fp32, *untied* input/output embeddings so that vLLM weight
   reloads never leave a stale packed ``lm_head``; head_dim 32, which vLLM's CPU attention
   supports);
3. supervised warm start on prompt → worked solution (loss on response tokens only), stopped as
   soon as its expected sampled accuracy at temperature 1.0 on held-out problems (the probability
   of reproducing the worked solution, one forward pass) reaches ``stop_accuracy``; the reported
   accuracy is then measured by real sampling on other held-out problems — so GRPO/ASPO groups
   contain both correct and wrong answers (eq. 1 needs reward variance within a group).

Two named profiles (:data:`PROFILES`): ``testbed``, the fast demo above (1–3 forced steps,
``aspo_lit.testbed.arithmetic``), and ``testbed-long``, the paper's regime (4–7 steps whose wording is
free, ``aspo_lit.testbed.multistep``; long answers with many free tokens, stopped on *sampled*
accuracy; docs/studies/testbed-long.md).

The result is saved with ``save_pretrained`` into ``<cache_dir>/testbed-<confighash>/`` with a
``testbed.json`` summary, built in a temporary folder and renamed into place, and reused until the
config (or :data:`BUILDER_VERSION`) changes. ``python -m aspo_lit build-testbed [--profile NAME]
[--force]`` builds it (docs/testbed.md).

This module holds the build: the recipe every testbed is built by (:func:`warm_start_into`, also
used by ``aspo_lit.testbed.code``), this testbed's SFT and evaluation steps, :func:`build_testbed`
and the atomic :func:`publish`. The parts live beside it: ``config`` (:class:`TestbedConfig`,
:data:`PROFILES`, the cache folder), ``tokenizer`` (step 1), ``model`` (step 2), ``sft`` (step 3's
loop), ``evaluation`` (the held-out accuracy). The public names of those modules that users call
(``build_testbed``, ``TestbedConfig``, ``testbed_dir``, ``held_out_accuracy``, ...) stay importable
from here.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import time
import uuid
from pathlib import Path
from typing import NamedTuple

from aspo_lit.prompts import INSTRUCTION, instruct
from aspo_lit.testbed.config import (
    BUILDER_VERSION,
    PROFILES,
    TestbedConfig,
    config_hash,
    default_cache_dir,
    testbed_dir,
)
from aspo_lit.testbed.evaluation import held_out_accuracy, is_correct, sample_accuracy
from aspo_lit.testbed.model import generation_config_for, model_config
from aspo_lit.testbed.sft import deterministic, sft_loop
from aspo_lit.testbed.shipped import machine
from aspo_lit.testbed.tokenizer import CHAT_TEMPLATE, encode_prompts, train_tokenizer

__all__ = [
    "CHAT_TEMPLATE",
    "BUILDER_VERSION",
    "TestbedConfig",
    "PROFILES",
    "config_hash",
    "default_cache_dir",
    "testbed_dir",
    "build_testbed",
    "is_correct",
    "held_out_accuracy",
]


def _encode_examples(tokenizer, rows) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, response ids + EOS) per record."""
    prompts = encode_prompts(tokenizer, [r["problem"] for r in rows])
    responses = tokenizer([r["solution"] for r in rows], add_special_tokens=False)["input_ids"]
    return [(p, r + [tokenizer.eos_token_id]) for p, r in zip(prompts, responses)]


def _sft(model, tokenizer, config: TestbedConfig, train_rows, dev_rows, log) -> dict:
    """Supervised warm start on prompt -> worked solution (loss on response tokens and EOS only),
    stopped once the expected sampled accuracy on held-out dev problems reaches
    ``config.stop_accuracy``. Returns a history dict."""
    import torch

    pad = tokenizer.pad_token_id
    examples = _encode_examples(tokenizer, train_rows)
    dev = _encode_examples(tokenizer, dev_rows)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": config.sft_weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=config.sft_lr, betas=(0.9, 0.95),
    )

    def sampled(m) -> float:
        return sample_accuracy(m, tokenizer, dev_rows, temperature=config.temperature,
                               max_new_tokens=config.max_response_tokens, seed=config.seed)["accuracy"]

    return sft_loop(model, opt, examples, dev, pad, config, log, name="testbed",
                    evaluate=sampled if config.stop_on == "sampled" else None)


class WarmStart(NamedTuple):
    """What :func:`warm_start_into` built: the policy's size, its SFT history, its held-out report."""

    num_parameters: int
    vocab_size: int
    history: dict        # sft_loop's
    heldout: dict        # evaluate's, on the final held-out rows


def warm_start_into(out: Path, config: TestbedConfig, train_rows, heldout_rows, *, prompt_text, sft, evaluate,
                    log, name: str) -> WarmStart:
    """The recipe every testbed is built by (steps 1-3 of the module docstring), saved into ``out``.

    A tokenizer trained on ``prompt_text(row)`` and the solutions of the first
    ``config.tokenizer_train_problems`` training rows; a fresh model seeded by ``config.seed``;
    ``sft(model, tokenizer, config, train_rows, dev_rows, log)``, whose early stop reads the held-out
    rows after the first ``config.heldout_problems``; ``evaluate(model, tokenizer, rows, config)``
    on those first ones. The order of these steps is part of the artefact: the same config gives
    the same bytes.
    """
    import torch
    from transformers import AutoModelForCausalLM

    final_rows, dev_rows = heldout_rows[:config.heldout_problems], heldout_rows[config.heldout_problems:]
    corpus_rows = train_rows[:config.tokenizer_train_problems]
    tokenizer = train_tokenizer(config, [prompt_text(r) for r in corpus_rows] + [r["solution"] for r in corpus_rows])
    with deterministic(config.seed, config.num_threads):
        model = AutoModelForCausalLM.from_config(model_config(config, tokenizer), dtype=torch.float32)
        model.generation_config = generation_config_for(tokenizer, config)
        n_params = sum(p.numel() for p in model.parameters())
        log(f"[{name}] {config.model_type} {n_params / 1e6:.2f}M params, vocab {len(tokenizer)}, "
            f"{len(train_rows)} train problems; SFT up to {config.sft_max_steps} steps")
        history = sft(model, tokenizer, config, train_rows, dev_rows, log)
        heldout = evaluate(model, tokenizer, final_rows, config)
    save_policy(out, model, tokenizer)
    return WarmStart(n_params, len(tokenizer), history, heldout)


def _final_accuracy(model, tokenizer, rows, config: TestbedConfig) -> dict:
    return sample_accuracy(model, tokenizer, rows, temperature=config.temperature,
                           max_new_tokens=config.max_response_tokens, seed=config.seed)


def _build_into(out: Path, config: TestbedConfig, log) -> dict:
    t0 = time.perf_counter()
    built = warm_start_into(
        out, config, config.problems(config.num_train_problems, "train"),
        config.problems(config.heldout_problems + config.dev_problems, "heldout"),
        prompt_text=lambda row: instruct(row["problem"]), sft=_sft, evaluate=_final_accuracy, log=log, name="testbed")
    history, final = built.history, built.heldout
    build_seconds = time.perf_counter() - t0
    summary = {
        "name": f"aspo-lit {config.task} testbed",
        "config": config.to_dict(),
        "config_hash": config_hash(config),
        "builder_version": BUILDER_VERSION,
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "build_seconds": round(build_seconds, 1),
        "built_on": machine(config.num_threads),
        "num_parameters": built.num_parameters,
        "vocab_size": built.vocab_size,
        "tie_word_embeddings": config.tie_word_embeddings,
        "instruction": " " + INSTRUCTION,
        "sft_steps": history["steps"],
        "sft_seconds": history["sft_seconds"],
        "sft_final_loss": history["losses"][-1] if history["losses"] else None,
        "sft_evals": history["evals"],
        "heldout": {k: final[k] for k in ("accuracy", "n", "by_level", "mean_response_tokens",
                                          "max_response_tokens", "mean_token_entropy", "boxed_rate")},
        "heldout_temperature": config.temperature,
        "heldout_samples": final["samples"],
    }
    (out / "testbed.json").write_text(json.dumps(summary, indent=2) + "\n")
    log(f"[testbed] held-out acc@T={config.temperature} {final['accuracy']:.3f} "
        f"(n={final['n']}, {final['by_level']}), built in {build_seconds:.0f}s")
    return summary


def build_testbed(config: TestbedConfig | None = None, cache_dir: str | os.PathLike | None = None,
                  force: bool = False, verbose: bool = True) -> Path:
    """Return the folder of the testbed for ``config``, building it only if it is missing.

    The folder loads with ``AutoModelForCausalLM/AutoTokenizer.from_pretrained`` and
    ``vllm.LLM(model=...)``; ``testbed.json`` in it holds the config, its hash, build time,
    parameter count and held-out accuracy. ``force`` rebuilds and replaces it.
    """
    config = config or TestbedConfig()
    final = testbed_dir(config, cache_dir)
    if (final / "testbed.json").is_file() and not force:
        return final
    log = (lambda msg: print(msg, file=sys.stderr, flush=True)) if verbose else (lambda msg: None)
    return publish(final, lambda tmp: _build_into(tmp, config, log), keep_concurrent=not force)


def save_policy(out: Path, model, tokenizer) -> None:
    """`save_pretrained` of the policy and its tokenizer into `out`."""
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    # transformers 5 writes its internal class name; the public alias loads the same tokenizer
    # (tokenizer.json as saved) and is also understood by older readers
    tok_cfg_path = out / "tokenizer_config.json"
    tok_cfg = json.loads(tok_cfg_path.read_text())
    tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    tok_cfg_path.write_text(json.dumps(tok_cfg, indent=2) + "\n")


def publish(final: Path, build_into, keep_concurrent: bool = True) -> Path:
    """`build_into(tmp)` in a temporary sibling of `final`, then renamed into place: a crash or
    Ctrl-C leaves no half-built folder. `keep_concurrent`: when another process published a
    finished `final` meanwhile, keep its result and drop ours."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        build_into(tmp)
        if final.exists():
            if (final / "testbed.json").is_file() and keep_concurrent:
                return final
            trash = final.parent / f".{final.name}.old-{uuid.uuid4().hex[:8]}"
            os.rename(final, trash)
            shutil.rmtree(trash, ignore_errors=True)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "testbed.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
