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
accuracy; docs/testbed-long.md).

The result is saved with ``save_pretrained`` into ``<cache_dir>/testbed-<confighash>/`` with a
``testbed.json`` summary, built in a temporary folder and renamed into place, and reused until the
config (or :data:`BUILDER_VERSION`) changes. ``python -m aspo_lit build-testbed [--profile NAME]
[--force]`` builds it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import re
import shutil
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, Sequence

from aspo_lit.prompts import INSTRUCTION, encode_prompt, instruct
from aspo_lit.rewards.math import extract_answer

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

#: Bump when the build procedure changes in a way that changes the artefact.
BUILDER_VERSION = 2

BOS, EOS, PAD, UNK = "<s>", "</s>", "<pad>", "<unk>"
SYSTEM, USER, ASSISTANT = "<|system|>", "<|user|>", "<|assistant|>"
SPECIAL_TOKENS = [PAD, BOS, EOS, UNK, SYSTEM, USER, ASSISTANT]

#: ``<s><|user|>{problem}{instruction}</s><|assistant|>{solution}</s>``; every turn ends with EOS,
#: so generation stops at the tokenizer's ``eos_token_id``.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)

# GPT-2-style split, except that every digit is its own piece (numbers are read digit by digit).
_SPLIT_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


@dataclass
class TestbedConfig:
    """Everything that determines the testbed artefact (its hash names the cache folder)."""

    seed: int = 0
    # data: "arithmetic" (aspo_lit.testbed.arithmetic: 1-3 forced steps) or "chain"
    # (aspo_lit.testbed.multistep: `ops` operations, freely worded solutions)
    task: str = "arithmetic"
    levels: tuple[int, ...] = (1, 2, 3)
    num_train_problems: int = 20000
    word_prob: float = 0.5
    ops: tuple[int, ...] = (4, 5, 6, 7)
    comment_prob: float = 0.6
    check_prob: float = 0.15
    max_value: int = 99
    # tokenizer: byte-level BPE; vocab_size <= 263 (256 bytes + 7 specials) means no merges,
    # i.e. a pure byte/character-level tokenizer
    vocab_size: int = 512
    tokenizer_train_problems: int = 4000
    # model (LlamaConfig); head_dim = hidden_size / num_attention_heads = 32
    model_type: str = "llama"
    hidden_size: int = 128
    intermediate_size: int = 512
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 4
    max_position_embeddings: int = 256
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    # supervised warm start: AdamW, linear warm-up then cosine to 10% at sft_max_steps; the
    # accuracy target is normally met near the end of the cosine (steps ~800 of 900)
    sft_max_steps: int = 900
    sft_batch_size: int = 16
    sft_lr: float = 5e-3
    sft_warmup_steps: int = 30
    sft_weight_decay: float = 0.01
    grad_clip: float = 1.0
    # early stop: every eval_every steps, the accuracy at `temperature` on `dev_problems` held-out
    # problems: "expected" = the probability of reproducing the worked solution (one forward pass;
    # right when the solution is forced), "sampled" = one real sample per problem (when the
    # wording is free, the gold solution's probability says nothing about correctness)
    stop_on: str = "expected"
    eval_every: int = 10
    eval_min_step: int = 200
    dev_problems: int = 128
    stop_accuracy: float = 0.45
    # final report: sampled accuracy on `heldout_problems` other held-out problems
    heldout_problems: int = 256
    max_response_tokens: int = 64
    temperature: float = 1.0
    num_threads: int = 1  # the build's torch threads (1: bit-reproducible, robust on shared cores)

    def __post_init__(self):
        self.levels = tuple(int(x) for x in self.levels)
        self.ops = tuple(int(x) for x in self.ops)
        if self.task not in ("arithmetic", "chain"):
            raise ValueError(f"task must be 'arithmetic' or 'chain', got {self.task!r}")
        if self.stop_on not in ("expected", "sampled"):
            raise ValueError(f"stop_on must be 'expected' or 'sampled', got {self.stop_on!r}")
        head_dim = self.hidden_size // self.num_attention_heads
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size must be divisible by num_attention_heads")
        if head_dim not in (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512):
            raise ValueError(f"head_dim {head_dim} is not supported by vLLM's CPU attention")
        if self.model_type not in ("llama", "qwen3"):
            raise ValueError("model_type must be 'llama' or 'qwen3' (qwen2's tokenizer class "
                             "re-splits digits in transformers 5)")

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["levels"] = list(self.levels)
        d["ops"] = list(self.ops)
        return d

    def problems(self, n: int, split: str) -> list[dict]:
        """``n`` problems of ``split`` ("train" / "heldout") from this config's generator."""
        if self.task == "chain":
            from aspo_lit.testbed.multistep import generate_chain_problems
            return generate_chain_problems(n, self.seed, self.ops, split=split,
                                           comment_prob=self.comment_prob, check_prob=self.check_prob,
                                           max_value=self.max_value)
        from aspo_lit.testbed.arithmetic import generate_problems
        return generate_problems(n, self.seed, self.levels, split=split, word_prob=self.word_prob)


#: Named testbeds: ``model_name_or_path: testbed`` (the fast demo: 1-3 forced steps, ~21-token
#: answers, 0.09 nats/token) and ``testbed-long`` (the paper's regime: 4-7 operations worded
#: freely, ~170-token answers, 0.44 nats/token; docs/testbed-long.md).
PROFILES: dict[str, TestbedConfig] = {
    "testbed": TestbedConfig(),
    "testbed-long": TestbedConfig(
        task="chain", num_train_problems=20000, vocab_size=1024, tokenizer_train_problems=4000,
        hidden_size=128, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=512, sft_max_steps=1500, sft_batch_size=16,
        sft_lr=5e-3, sft_warmup_steps=50, stop_on="sampled", eval_every=100, eval_min_step=400,
        dev_problems=64, stop_accuracy=0.35, heldout_problems=256, max_response_tokens=320),
}


def config_hash(config: TestbedConfig) -> str:
    payload = json.dumps({"builder": BUILDER_VERSION, **config.to_dict()}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:12]


def default_cache_dir() -> Path:
    """``$ASPO_LIT_CACHE``, else ``<repo>/.cache/aspo_lit`` (or ``~/.cache/aspo_lit`` when the
    package is installed outside a checkout)."""
    env = os.environ.get("ASPO_LIT_CACHE")
    if env:
        return Path(env).expanduser()
    repo = Path(__file__).resolve().parents[2]
    if (repo / "pyproject.toml").is_file():
        return repo / ".cache" / "aspo_lit"
    return Path.home() / ".cache" / "aspo_lit"


def testbed_dir(config: TestbedConfig | None = None, cache_dir: str | os.PathLike | None = None) -> Path:
    config = config or TestbedConfig()
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return root / f"testbed-{config_hash(config)}"


# ----------------------------------------------------------------------------- grading

def is_correct(text: str, answer: str) -> bool:
    """Exact integer match of the last ``\\boxed{}`` against the gold answer."""
    got = extract_answer(text, think_end_token=None)
    if got is None or not re.fullmatch(r"[+-]?\d+", got.strip()):
        return False
    return int(got) == int(answer)


# ----------------------------------------------------------------------------- tokenizer

def train_tokenizer(config: TestbedConfig, corpus: Sequence[str]):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=max(config.vocab_size, 256 + len(SPECIAL_TOKENS)),
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK,
        additional_special_tokens=[SYSTEM, USER, ASSISTANT],
        clean_up_tokenization_spaces=False, model_max_length=config.max_position_embeddings,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _encode_prompts(tokenizer, problems: Sequence[str]) -> list[list[int]]:
    return [encode_prompt(p, tokenizer, "chat", enable_thinking=None) for p in problems]


def left_padded(prompts: Sequence[Sequence[int]], pad_id: int):
    """``(ids, attention_mask)`` of prompts padded on the left, so that generation continues every
    prompt at the same position."""
    import torch
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    return ids, mask


# ----------------------------------------------------------------------------- model

def model_config(config: TestbedConfig, tokenizer):
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.hidden_size // config.num_attention_heads,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=config.tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        rms_norm_eps=1e-5,
        initializer_range=0.02,
        use_cache=True,
    )
    if config.model_type == "llama":
        from transformers import LlamaConfig
        cfg = LlamaConfig(rope_theta=config.rope_theta, **common)
    else:
        from transformers import Qwen3Config
        cfg = Qwen3Config(rope_theta=config.rope_theta, **common)
    with contextlib.suppress(Exception):  # attribute name differs across transformers versions
        cfg.rope_parameters = {"rope_type": "default", "rope_theta": config.rope_theta}
    cfg.dtype = "float32"
    return cfg


def generation_config_for(tokenizer, config: TestbedConfig):
    from transformers import GenerationConfig
    # Plain ancestral sampling by default (transformers' default top_k=50 would truncate it).
    return GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, do_sample=True, temperature=config.temperature,
        top_k=0, top_p=1.0, max_new_tokens=config.max_response_tokens,
    )


@contextlib.contextmanager
def deterministic(seed: int, num_threads: int | None = None):
    """Seeded, deterministic-algorithm CPU scope that restores the caller's RNG/threads/flags."""
    import torch
    prev_threads = torch.get_num_threads()
    if num_threads:
        torch.set_num_threads(num_threads)
    prev = torch.are_deterministic_algorithms_enabled()
    prev_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        torch.use_deterministic_algorithms(True, warn_only=True)
        try:
            yield
        finally:
            torch.use_deterministic_algorithms(prev, warn_only=prev_warn)
            torch.set_num_threads(prev_threads)


# ----------------------------------------------------------------------------- evaluation

def _sample_accuracy(model, tokenizer, problems: Sequence[dict], *, temperature: float,
                     max_new_tokens: int, seed: int, batch_size: int = 128) -> dict:
    """Sampled (one sample per problem) exact-match accuracy, overall and per level, with the mean
    response length and the mean token entropy (nats) of the sampling distribution."""
    import torch
    was_training = model.training
    model.eval()
    prompts = _encode_prompts(tokenizer, [p["problem"] for p in problems])
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
    return _sample_accuracy(model, tokenizer, problems, temperature=temperature,
                            max_new_tokens=max_new_tokens, seed=seed)


# ----------------------------------------------------------------------------- build

def _encode_examples(tokenizer, rows) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, response ids + EOS) per record."""
    prompts = _encode_prompts(tokenizer, [r["problem"] for r in rows])
    responses = tokenizer([r["solution"] for r in rows], add_special_tokens=False)["input_ids"]
    return [(p, r + [tokenizer.eos_token_id]) for p, r in zip(prompts, responses)]


def _collate(examples, pad_id: int):
    """Right-padded ids, attention mask, and labels that are -100 except on response tokens."""
    import torch
    width = max(len(p) + len(r) for p, r in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full_like(ids, -100)
    mask = torch.zeros_like(ids)
    for i, (p, r) in enumerate(examples):
        seq = p + r
        ids[i, :len(seq)] = torch.tensor(seq)
        labels[i, len(p):len(seq)] = torch.tensor(r)
        mask[i, :len(seq)] = 1
    return ids, mask, labels


def _gold_probability(model, examples, pad_id: int, temperature: float, batch_size: int = 64):
    """P(the sampler at ``temperature`` reproduces the worked solution exactly), per example.

    A cheap, low-variance stand-in for sampled accuracy during SFT (one forward pass, no
    generation); it is a lower bound, as another correct derivation would also score.
    """
    import torch
    was_training = model.training
    model.eval()
    out = []
    with torch.no_grad():
        for start in range(0, len(examples), batch_size):
            ids, mask, labels = _collate(examples[start:start + batch_size], pad_id)
            logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
            logp = torch.log_softmax(logits / temperature, dim=-1)
            target = labels[:, 1:]
            keep = target != -100
            tok_lp = logp.gather(-1, target.clamp_min(0).unsqueeze(-1)).squeeze(-1)
            out.extend((tok_lp * keep).sum(-1).exp().tolist())
    model.train(was_training)
    return out


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
        return _sample_accuracy(m, tokenizer, dev_rows, temperature=config.temperature,
                                max_new_tokens=config.max_response_tokens, seed=config.seed)["accuracy"]

    return sft_loop(model, opt, examples, dev, pad, config, log, name="testbed",
                    evaluate=sampled if config.stop_on == "sampled" else None)


def sft_loop(model, opt, examples, dev, pad, config, log, name: str, evaluate=None) -> dict:
    """The warm-start loop shared by the testbeds: shuffled batches of (prompt, response) ids, linear
    warm-up then cosine LR to 10 % at ``config.sft_max_steps``, grad clipping, and a held-out check
    every ``config.eval_every`` steps that stops at ``config.stop_accuracy``: ``evaluate(model)``
    when given (e.g. sampled accuracy), else the expected sampled accuracy of the ``dev`` examples
    (the probability of reproducing each worked solution). Returns the history (losses,
    evaluations, steps, seconds, the longest example's tokens)."""
    import torch

    longest = max(len(p) + len(r) for p, r in examples + dev)
    if longest > config.max_position_embeddings:
        raise ValueError(f"[{name}] an SFT example of {longest} tokens exceeds max_position_embeddings="
                         f"{config.max_position_embeddings}")

    def lr_at(step: int) -> float:  # linear warm-up, cosine to 10% at sft_max_steps
        if step < config.sft_warmup_steps:
            return config.sft_lr * (step + 1) / config.sft_warmup_steps
        frac = (step - config.sft_warmup_steps) / max(1, config.sft_max_steps - config.sft_warmup_steps)
        return config.sft_lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))

    gen = torch.Generator().manual_seed(config.seed)
    order = torch.randperm(len(examples), generator=gen).tolist()
    cursor = 0
    history: dict = {"evals": [], "losses": []}
    model.train()
    t0 = time.perf_counter()
    step = 0
    for step in range(1, config.sft_max_steps + 1):
        if cursor + config.sft_batch_size > len(order):
            order = torch.randperm(len(examples), generator=gen).tolist()
            cursor = 0
        ids, mask, labels = _collate([examples[i] for i in order[cursor:cursor + config.sft_batch_size]], pad)
        cursor += config.sft_batch_size
        for group in opt.param_groups:
            group["lr"] = lr_at(step - 1)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        opt.step()
        history["losses"].append(round(loss.item(), 4))

        if step >= config.eval_min_step and (step % config.eval_every == 0 or step == config.sft_max_steps):
            if evaluate is not None:
                expected = evaluate(model)
                model.train()
            else:
                probs = _gold_probability(model, dev, pad, config.temperature)
                expected = sum(probs) / len(probs)
            history["evals"].append({"step": step, "expected_accuracy": round(expected, 4),
                                     "loss": round(loss.item(), 4),
                                     "elapsed_s": round(time.perf_counter() - t0, 1)})
            done = expected >= config.stop_accuracy
            if done or step % 100 == 0 or step == config.sft_max_steps:
                log(f"[{name}] step {step:4d}  loss {loss.item():.3f}  expected held-out acc@T="
                    f"{config.temperature} {expected:.3f}  {time.perf_counter() - t0:.0f}s")
            if done:
                break
    history["steps"] = step
    history["sft_seconds"] = round(time.perf_counter() - t0, 1)
    history["longest_example"] = longest
    return history


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
    return _sample_accuracy(model, tokenizer, rows, temperature=config.temperature,
                            max_new_tokens=config.max_response_tokens, seed=config.seed)


def _build_into(out: Path, config: TestbedConfig, log) -> dict:
    import torch
    import transformers

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
        "torch_threads": config.num_threads,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
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
