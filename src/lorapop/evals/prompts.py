"""Evaluation prompts: AZR's R1 template for base models, or the model's chat template.

`azr` wraps the task in the template AZR trains and evaluates base models with (its
`instruction_following`): the model thinks in `<think>` and answers in `<answer>`. `chat` uses
the tokenizer's chat template; `auto` picks `chat` when the tokenizer has one.
"""

from __future__ import annotations

from typing import Any

from lorapop.evals.data import Problem

TEMPLATES = ("auto", "azr", "chat")

AZR_R1 = (
    "A conversation between User and Assistant. The user asks a question, and the Assistant "
    "solves it. The assistant first thinks about the reasoning process in the mind and then "
    "provides the user with the answer. The reasoning process and answer are enclosed within "
    "<think> </think> and <answer> </answer> tags, respectively, i.e., <think> reasoning process "
    "here </think> <answer> answer here </answer>. User: {}\nAssistant: <think>"
)

#: evalplus' instruction prefix for chat/instruct code generation.
_EVALPLUS = (
    "Please provide a self-contained Python script that solves the following problem in a "
    "markdown code block:\n```python\n{}\n```"
)
_LCB = (
    "You will be given a question (problem specification) and will generate a correct Python "
    "program that matches the specification and passes all tests.\n\nQuestion: {}\n\n"
)
_LCB_STARTER = (
    "You will use the following starter code to write the solution to the problem and enclose "
    "your code within delimiters.\n```python\n{}\n```"
)
_LCB_STDIN = (
    "Read the inputs from stdin, solve the problem and write the answer to stdout. Enclose your "
    "code within delimiters as follows.\n```python\n# YOUR CODE HERE\n```"
)
_CRUX = {
    "o": "Given the Python function below and an input, predict the exact output of f on that "
    "input. Give the output as a Python literal in a ```output``` block.\n\n```python\n{code}\n"
    "```\n\nInput:\n```input\n{io}\n```",
    "i": "Given the Python function below and an output, find any input such that f(input) "
    "gives that output. Give the arguments as Python source in an ```input``` block (for "
    "several arguments, separate them by commas).\n\n```python\n{code}\n```\n\nOutput:\n"
    "```output\n{io}\n```",
}
_BOXED = "\nPlease reason step by step, and put your final answer within \\boxed{}."


def task_text(p: Problem, chat: bool) -> str:
    """The user turn for problem `p`."""
    if p.kind == "code":
        return _EVALPLUS.format(p.question.strip())
    if p.kind == "lcb":
        starter = p.meta.get("starter_code")
        return _LCB.format(p.question) + (_LCB_STARTER.format(starter) if starter else _LCB_STDIN)
    if p.kind.startswith("crux"):
        mode = p.kind[-1]
        io = p.meta["input"] if mode == "o" else p.meta["output"]
        return _CRUX[mode].format(code=p.question, io=io)
    return p.question + (_BOXED if chat else "")


def resolve(template: str, tokenizer: Any) -> str:
    if template not in TEMPLATES:
        raise ValueError(f"unknown prompt template {template!r} (choose from {TEMPLATES})")
    if template == "auto":
        return "chat" if getattr(tokenizer, "chat_template", None) else "azr"
    if template == "chat" and not getattr(tokenizer, "chat_template", None):
        raise ValueError("template 'chat' needs a tokenizer with a chat template")
    return template


def render(p: Problem, template: str, tokenizer: Any) -> str:
    """The full prompt string for `p` under a resolved template ("azr" or "chat")."""
    if template == "azr":
        return AZR_R1.format(task_text(p, chat=False))
    messages = [{"role": "user", "content": task_text(p, chat=True)}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
