"""A scripted evaluation engine implementing the engine contract (docs/design.md): each problem's
sample j is right iff (hash(problem) + j) % 3 == 0, so results depend only on (problem, sample index)."""
from __future__ import annotations

import hashlib
from collections.abc import Callable


class Completion:
    def __init__(self, text, token_ids):
        self.text, self.token_ids, self.finish_reason, self.logprobs = text, token_ids, "stop", None


class FakeEngine:
    """Answers each problem from `answers` (problem text -> gold) with ``so \\boxed{gold}`` when
    (hash(problem) + j) % 3 == 0 for sample j of a call, else ``\\boxed{wrong(gold)}``, so results
    depend only on (problem, sample index) when a problem's samples come in one call.
    `fail_on_call` raises at the start of that call (a preemption)."""

    def __init__(self, answers: dict[str, str], fail_on_call: int | None = None,
                 wrong: Callable[[str], str] = lambda gold: "x"):
        self.answers, self.fail_on_call, self.wrong = answers, fail_on_call, wrong
        self.calls, self.prompts, self.attached = 0, 0, False

    def attach(self, model, tokenizer, model_path):
        self.tokenizer, self.attached = tokenizer, True

    def generate(self, prompts, n=1, sampling=None):
        self.calls += 1
        if self.fail_on_call is not None and self.calls >= self.fail_on_call:
            raise RuntimeError("killed (simulated preemption)")
        out = []
        for ids in prompts:
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            problem = next(p for p in self.answers if p.lower() in text.lower())
            gold = self.answers[problem]
            h = int(hashlib.sha1(problem.encode()).hexdigest(), 16)
            out.append([Completion(f"so \\boxed{{{gold if (h + j) % 3 == 0 else self.wrong(gold)}}}",
                                   [1] * (j + 3)) for j in range(n)])
            self.prompts += 1
        return out

    def close(self):
        pass
