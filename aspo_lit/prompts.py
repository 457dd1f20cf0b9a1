"""Prompt construction shared by training (the math DataModule) and evaluation.

The paper (§7.1, following DeepScaleR) appends one instruction to every problem and, for Qwen3,
uses the non-thinking mode of the chat template. Both training and evaluation must build the
prompt the same way, so this is the one place that does it.
"""
from __future__ import annotations

INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."
TEMPLATES = ("chat", "plain")


def instruct(problem: str) -> str:
    """The user message: the problem followed by the paper's instruction."""
    return f"{problem.strip()} {INSTRUCTION}"


def build_prompt(problem: str, tokenizer=None, template: str = "chat",
                 enable_thinking: bool | None = False) -> str:
    """The prompt text for one problem.

    template="chat": the tokenizer's chat template with a single user turn and the generation
    prompt (falls back to "plain" when the tokenizer has no chat template). `enable_thinking`
    is passed to the template (Qwen3 reads it; the paper evaluates Qwen3 in non-thinking mode;
    other templates ignore it); None leaves the template's default.
    template="plain": the user message alone, no special tokens.
    """
    if template not in TEMPLATES:
        raise ValueError(f"unknown prompt template {template!r}; expected one of {TEMPLATES}")
    message = instruct(problem)
    if template == "plain" or not has_chat_template(tokenizer):
        return message
    extra = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    return tokenizer.apply_chat_template([{"role": "user", "content": message}], tokenize=False,
                                         add_generation_prompt=True, **extra)


def encode_prompt(problem: str, tokenizer, template: str = "chat",
                  enable_thinking: bool | None = False) -> list[int]:
    """Token ids of `build_prompt`. A chat template already writes its special tokens (BOS
    included), so they are not added a second time; a plain prompt gets the tokenizer's usual
    special tokens."""
    text = build_prompt(problem, tokenizer, template, enable_thinking)
    templated = template == "chat" and has_chat_template(tokenizer)
    return list(tokenizer(text, add_special_tokens=not templated)["input_ids"])


def has_chat_template(tokenizer) -> bool:
    return tokenizer is not None and bool(getattr(tokenizer, "chat_template", None))
