"""The one prompt builder: math problems (training, evaluation, the testbeds) and code problems.

Math (paper §7.1, following DeepScaleR): one instruction is appended to every problem and, for
Qwen3, the chat template runs in non-thinking mode. Training and evaluation must build the prompt
the same way, so this is the one place that does it.

Code: the user message is LiveCodeBench's generic code-generation template
(``lcb_runner/prompts/code_generation.py``, ``get_generic_question_template_answer``; Jain et al.,
2025): the statement under ``### Question:``, then either the LeetCode starter code (functional
problems) or the stdin/stdout instruction with an empty ``# YOUR CODE HERE`` block, then
``### Answer: (use the provided format with backticks)``. The response's last fenced Python block
is graded (``aspo_lit.rewards.code.extract_code``). LiveCodeBench gives chat models a system
message (``SYSTEM_MESSAGE_GENERIC``); DeepSeek-R1 and its distillations are prompted without one
(their model card recommends no system prompt), which is the default here; pass
``system_prompt=LCB_SYSTEM_MESSAGE`` for LiveCodeBench's.
"""
from __future__ import annotations

INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."
TEMPLATES = ("chat", "plain")

LCB_SYSTEM_MESSAGE = ("You are an expert Python programmer. You will be given a question (problem "
                      "specification) and will generate a correct Python program that matches the "
                      "specification and passes all tests.")
LCB_FORMAT_WITH_STARTER_CODE = ("You will use the following starter code to write the solution to the "
                                "problem and enclose your code within delimiters.")
LCB_FORMAT_WITHOUT_STARTER_CODE = (
    "Read the inputs from stdin solve the problem and write the answer to stdout (do not directly test "
    "on the sample inputs). Enclose your code within delimiters as follows. Ensure that when the python "
    "program runs, it reads the inputs, runs the algorithm and writes output to STDOUT.")


def instruct(problem: str) -> str:
    """The math user message: the problem followed by the paper's instruction."""
    return f"{problem.strip()} {INSTRUCTION}"


def lcb_user_message(problem: str, starter_code: str | None = None) -> str:
    """LiveCodeBench's generic question template for one problem."""
    prompt = f"### Question:\n{problem.strip()}\n\n"
    if starter_code and starter_code.strip():
        prompt += f"### Format: {LCB_FORMAT_WITH_STARTER_CODE}\n"
        prompt += f"```python\n{starter_code}\n```\n\n"
    else:
        prompt += f"### Format: {LCB_FORMAT_WITHOUT_STARTER_CODE}\n"
        prompt += "```python\n# YOUR CODE HERE\n```\n\n"
    prompt += "### Answer: (use the provided format with backticks)\n\n"
    return prompt


def render(message: str, tokenizer=None, template: str = "chat", enable_thinking: bool | None = False,
           system_prompt: str | None = None) -> str:
    """The prompt text around one user message.

    template="chat": the tokenizer's chat template with an optional system turn, the user turn and
    the generation prompt (falls back to "plain" when the tokenizer has no chat template).
    `enable_thinking` is passed to the template (Qwen3 reads it; the paper evaluates Qwen3 in
    non-thinking mode; other templates ignore it); None leaves the template's default.
    template="plain": the (system prompt and) user message alone, no special tokens.
    """
    if template not in TEMPLATES:
        raise ValueError(f"unknown prompt template {template!r}; expected one of {TEMPLATES}")
    if template == "plain" or not has_chat_template(tokenizer):
        return message if not system_prompt else f"{system_prompt}\n\n{message}"
    messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + \
        [{"role": "user", "content": message}]
    extra = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **extra)


def encode(text: str, tokenizer, template: str = "chat") -> list[int]:
    """Token ids of a rendered prompt. A chat template already writes its special tokens (BOS
    included), so they are not added a second time; a plain prompt gets the tokenizer's usual
    special tokens."""
    templated = template == "chat" and has_chat_template(tokenizer)
    return list(tokenizer(text, add_special_tokens=not templated)["input_ids"])


def build_prompt(problem: str, tokenizer=None, template: str = "chat",
                 enable_thinking: bool | None = False) -> str:
    """The prompt text for one math problem (`render` around `instruct`)."""
    return render(instruct(problem), tokenizer, template, enable_thinking)


def encode_prompt(problem: str, tokenizer, template: str = "chat",
                  enable_thinking: bool | None = False) -> list[int]:
    """Token ids of `build_prompt`."""
    return encode(build_prompt(problem, tokenizer, template, enable_thinking), tokenizer, template)


def build_code_prompt(problem: str, starter_code: str | None = None, tokenizer=None,
                      template: str = "chat", enable_thinking: bool | None = False,
                      system_prompt: str | None = None) -> str:
    """The prompt text for one code problem (`render` around `lcb_user_message`)."""
    return render(lcb_user_message(problem, starter_code), tokenizer, template, enable_thinking, system_prompt)


def encode_code_prompt(problem: str, starter_code: str | None, tokenizer, template: str = "chat",
                       enable_thinking: bool | None = False, system_prompt: str | None = None) -> list[int]:
    """Token ids of `build_code_prompt`."""
    text = build_code_prompt(problem, starter_code, tokenizer, template, enable_thinking, system_prompt)
    return encode(text, tokenizer, template)


def has_chat_template(tokenizer) -> bool:
    return tokenizer is not None and bool(getattr(tokenizer, "chat_template", None))
