"""The testbed's held-out evaluation: sampled exact-match accuracy of a policy (docs/testbed.md).

:func:`is_correct` grades a response (exact integer match of the last ``\\boxed{}``);
:func:`sample_accuracy` samples one response per problem and reports accuracy, lengths and token
entropy; :func:`held_out_accuracy` does it for a saved testbed folder.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path
from typing import Sequence

from aspo_lit.rewards.math import extract_answer
from aspo_lit.testbed.config import TestbedConfig
from aspo_lit.testbed.tokenizer import encode_prompts, left_padded

__all__ = ["is_correct", "sample_accuracy", "held_out_accuracy"]


def is_correct(text: str, answer: str) -> bool:
    """Exact integer match of the last ``\\boxed{}`` against the gold answer."""
    got = extract_answer(text, think_end_token=None)
    if got is None or not re.fullmatch(r"[+-]?\d+", got.strip()):
        return False
    return int(got) == int(answer)


def sample_accuracy(model, tokenizer, problems: Sequence[dict], *, temperature: float,
                    max_new_tokens: int, seed: int, batch_size: int = 128) -> dict:
    """Sampled (one sample per problem) exact-match accuracy, overall and per level, with the mean
    response length and the mean token entropy (nats) of the sampling distribution."""
    import torch
    was_training = model.training
    model.eval()
    prompts = encode_prompts(tokenizer, [p["problem"] for p in problems])
    texts: list[str] = []
    lengths: list[int] = []
    entropy_sum = 0.0
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        for start in range(0, len(prompts), batch_size):
            ids, mask = left_padded(prompts[start:start + batch_size], tokenizer.pad_token_id)
            width = ids.shape[1]
            gen = model.generate(
                input_ids=ids, attention_mask=mask, do_sample=True, temperature=temperature,
                top_k=0, top_p=1.0, max_new_tokens=max_new_tokens,
                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                output_logits=True, return_dict_in_generate=True,
            )
            # entropy of the sampling distribution at every generated position (EOS included)
            logp = torch.log_softmax(torch.stack(gen.logits, dim=1).float() / temperature, dim=-1)
            step_entropy = -(logp.exp() * logp).sum(-1)
            for i, row in enumerate(gen.sequences[:, width:].tolist()):
                n = row.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in row else len(row)
                lengths.append(n)
                entropy_sum += step_entropy[i, :n].sum().item()
                texts.append(tokenizer.decode(row[:n], skip_special_tokens=True))
    model.train(was_training)
    correct = [is_correct(t, p["answer"]) for t, p in zip(texts, problems)]
    by_level: dict[str, list[bool]] = {}
    for ok, p in zip(correct, problems):
        by_level.setdefault(str(p["level"]), []).append(ok)
    return {
        "accuracy": sum(correct) / max(len(correct), 1),
        "n": len(correct),
        "by_level": {k: sum(v) / len(v) for k, v in sorted(by_level.items())},
        "mean_response_tokens": sum(lengths) / max(len(lengths), 1),
        "mean_token_entropy": entropy_sum / max(sum(lengths), 1),
        "max_response_tokens": max(lengths, default=0),
        "boxed_rate": sum(extract_answer(t, think_end_token=None) is not None for t in texts) / max(len(texts), 1),
        "samples": [{"problem": p["problem"], "answer": p["answer"], "response": t}
                    for p, t in list(zip(problems, texts))[:4]],
    }


def held_out_accuracy(model_dir: str | os.PathLike, n: int = 256, seed: int = 0,
                      temperature: float = 1.0, levels: Sequence[int] | None = None,
                      max_new_tokens: int | None = None) -> float:
    """Sampled accuracy of a saved testbed on ``n`` held-out arithmetic problems.

    One sample per problem with plain ``transformers.generate`` (no top-k/top-p), graded by exact
    integer match of the last ``\\boxed{}``. ``levels``/``max_new_tokens`` default to the
    testbed's own (from ``testbed.json``) when present.
    """
    return _held_out_report(model_dir, n, seed, temperature, levels, max_new_tokens)["accuracy"]


def _held_out_report(model_dir, n, seed, temperature, levels=None, max_new_tokens=None) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = Path(model_dir)
    meta = {}
    if (model_dir / "testbed.json").is_file():
        meta = json.loads((model_dir / "testbed.json").read_text())["config"]
    known = {f.name for f in dataclasses.fields(TestbedConfig)}
    config = TestbedConfig(**{k: v for k, v in meta.items() if k in known})
    config.seed = seed
    if levels:
        config.levels = tuple(levels)
    max_new_tokens = max_new_tokens or config.max_response_tokens
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32")
    problems = config.problems(n, "heldout")
    return sample_accuracy(model, tokenizer, problems, temperature=temperature,
                           max_new_tokens=max_new_tokens, seed=seed)
