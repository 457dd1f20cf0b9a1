"""The supervised warm start shared by the testbeds (docs/testbed.md).

:func:`sft_loop`: prompt -> worked solution, loss on response tokens only, stopped early once a
held-out accuracy reaches ``config.stop_accuracy`` (by default the expected sampled accuracy: the
probability of reproducing each worked solution, one forward pass); :func:`deterministic`: the
seeded, deterministic CPU scope the build runs in.
"""
from __future__ import annotations

import contextlib
import math
import time

__all__ = ["deterministic", "sft_loop"]


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
