"""`CodeTask`: code problems, the LiveCodeBench prompt, sandboxed execution reward (the paper's §7,
Appendix B; rows as `aspo_lit.data.code_rows` normalizes them)."""

from __future__ import annotations

import os
from typing import Any, Literal, Mapping, Sequence

from aspo_lit.data.code_layouts import LAYOUTS, layout_row
from aspo_lit.data.code_rows import normalize_code_row
from aspo_lit.data.fields import MISSING, mapped, problem_text
from aspo_lit.data.mixture import Source
from aspo_lit.prompts import encode_code_prompt
from aspo_lit.tasks.math import MathTask

Sandbox = Literal["bwrap", "rlimit"]


class CodeTask(MathTask):
    """Code problems ``{id, problem, starter_code, answer}`` (``answer``: the test spec).

    Args:
        train_files, val_files: `Source`s (each with its layout: CodeContests and CodeForces rows by
            ``layout``, `aspo_lit.data.code_layouts`), or a local file/folder or HF hub id of code
            problems, several joined with ``+``.
        hub_split: the split loaded from an HF hub id.
        enable_thinking, system_prompt: passed to the prompt (`aspo_lit.prompts.build_code_prompt`).
        sandbox, reward_timeout_s, reward_memory_mb, reward_workers, reward_max_tests,
            reward_batch_timeout_s: the default `CodeReward`'s settings.
        problem_key, dedup, on_bad_row, prompt_template, reward: as `MathTask`.
    """

    domain = "code"

    def __init__(self, train_files: str | Sequence[Source], val_files: str | Sequence[Source] | None = None,
                 problem_key: str = "problem", dedup: bool = True, on_bad_row: str = "error",
                 prompt_template: str = "chat", reward: Any = None, hub_split: str = "train",
                 enable_thinking: bool | None = False, system_prompt: str | None = None,
                 sandbox: Sandbox = "bwrap", reward_timeout_s: float = 6.0, reward_memory_mb: int = 2048,
                 reward_workers: int | None = None, reward_max_tests: int | None = None,
                 reward_batch_timeout_s: float | None = None) -> None:
        super().__init__(train_files, val_files, problem_key, "answer", dedup, on_bad_row, prompt_template, reward)
        self.hub_split, self.enable_thinking, self.system_prompt = hub_split, enable_thinking, system_prompt
        self.grader_settings = {"sandbox": sandbox, "timeout_s": reward_timeout_s, "memory_limit_mb": reward_memory_mb,
                                "num_workers": reward_workers, "max_tests": reward_max_tests,
                                "batch_timeout_s": reward_batch_timeout_s}

    def sources(self, spec: str | os.PathLike | Sequence[Source]) -> list[Source]:
        """The sources of a ``train_files`` / ``val_files`` value (a string: ``+``-joined parts)."""
        if isinstance(spec, (str, os.PathLike)):
            return [Source(path=part.strip(), split=self.hub_split, fields={"problem": self.problem_key})
                    for part in os.fspath(spec).split("+")]
        sources = [s if isinstance(s, Source) else Source(**s) for s in spec]
        for source in sources:
            if source.layout not in LAYOUTS:
                raise ValueError(f"source {source.tag!r}: layout must be one of {LAYOUTS}, got {source.layout!r}")
        return sources

    def normalize_answers(self, rows, split):
        """A code row's answer is its test spec: nothing to rewrite."""
        return rows, {}

    def convert_row(self, raw: Mapping[str, Any], source: Source, where: str, staged: bool) -> dict[str, Any]:
        """One upstream row as a normalized code row (``normalize_code_row``)."""
        if staged:
            return normalize_code_row(raw, where)
        if source.layout != "fields":
            view = layout_row(raw, source.layout, where, source.fields.get("tests"))
            problem_path = "description"
        else:
            view = dict(raw)
            for ours in source.fields:
                value, _ = mapped(raw, ours, source.fields, source.json_fields, where)
                view[ours] = None if value is MISSING else value
            problem_path = source.fields.get("problem", "problem")
            if view.get("problem") is None and problem_path == "problem":   # LiveCodeBench's own names
                view["problem"] = raw.get("question_content") or raw.get("question")
        view["problem"] = problem_text(view.get("problem", MISSING), where, problem_path, source.template)
        return normalize_code_row(view, where)

    def encode_row(self, row: dict[str, Any], tokenizer: Any) -> list[int]:
        """The LiveCodeBench prompt (with the starter code of a functional problem), tokenized."""
        return encode_code_prompt(row["problem"], row.get("starter_code"), tokenizer,
                                  self.prompt_template, self.enable_thinking, self.system_prompt)

    def default_reward(self) -> Any:
        """`CodeReward` with this task's sandbox and limits: 1 iff every test passes."""
        from aspo_lit.rewards.code import CodeReward

        return CodeReward(**self.grader_settings)

    def check_ready(self) -> None:
        """A missing sandbox stops the run before any rollout, in one line."""
        ready = getattr(self.reward, "sandbox_ready", None)
        if ready is not None:
            ready()

    def close(self) -> None:
        if self._reward is not None and hasattr(self._reward, "close"):
            self._reward.close()
