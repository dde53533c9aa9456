"""Prompt text for the code families, in two templates.

- `azr`: for real base models, the R1-style conversation AZR uses: the assistant thinks in
  `<think>…</think>` and answers in `<answer>…</answer>`, with fenced ```python / ```input /
  ```output / ```message blocks. The prompt ends with "Assistant: <think>" as AZR's base-model
  prompts do, so the generation starts inside the thinking.
- `chat`: the same instructions as `azr`, as one user turn wrapped in the tokenizer's chat
  template (Instruct/chat models); the answer is parsed as in `azr`.
- `compact`: for a model of a few million parameters: a one-line header, short tags
  (`<f>` program, `<i>` input, `<o>` output, `<m>` message), and the prompt ends with the
  opening tag of what the model must write.

Long inputs, outputs and messages of references are capped (`shown_chars`), as are reference
programs (`program_chars`). What a student must reason about (its own task) is never cut:
families reject proposals whose parts exceed the caps instead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from lorapop.tasks.parsing import cap
from lorapop.tasks.task import Task

TEMPLATES = ("azr", "compact", "chat")

#: A user turn -> the full prompt text (the tokenizer's chat template, generation prompt on).
ChatFormat = Callable[[str], str]

BANNED_WORDS = (
    "logging, random, multiprocessing, pebble, subprocess, threading, datetime, time, hashlib, "
    "hmac, bcrypt, os.sys, os.path, sys.exit, os.environ, calendar"
)

_R1 = (
    "A conversation between a User and an Assistant. The Assistant first reasons step by step "
    "inside <think> </think>, then writes its final result inside <answer> </answer>, like "
    "<think> reasoning </think> <answer> result </answer>.\nUser: {body}\nAssistant: <think>"
)

_RULES = (
    "Rules:\n"
    "- name the entry function `f`; helper functions and classes may be defined above it\n"
    "- `f` takes at least one argument and returns a value\n"
    "- deterministic: no randomness, clock, files, network, printing or global state\n"
    f"- do not use these modules or names, not even in comments: {BANNED_WORDS}\n"
    "- an input is the argument text of the call `f(<input>)`, e.g. `[3, 1, 2], 'abc'`\n"
)


#: The `azr` system text as the head of a chat user turn.
_CHAT_HEAD = (
    "First reason step by step inside <think> </think>, then write your final result inside "
    "<answer> </answer>, like <think> reasoning </think> <answer> result </answer>.\n\n"
)


def chat_format(tokenizer: Any) -> ChatFormat:
    """The `chat` template's wrapper for a tokenizer; ValueError when it has no chat template."""
    if not getattr(tokenizer, "chat_template", None):
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise ValueError(f"tasks.template=chat needs a tokenizer with a chat template; "
                         f"{name} has none (use azr)")

    def wrap(user: str) -> str:
        return tokenizer.apply_chat_template([{"role": "user", "content": user}],
                                             tokenize=False, add_generation_prompt=True)

    return wrap


def _wrap(body: str, template: str, chat: ChatFormat | None) -> str:
    """The full prompt of an azr/chat body."""
    if template == "chat":
        if chat is None:
            raise ValueError("template 'chat' needs the tokenizer's chat format (chat_format)")
        return chat(_CHAT_HEAD + body)
    return _R1.format(body=body)


@dataclass(frozen=True)
class Caps:
    """How much of a reference is shown in a prompt."""

    shown_chars: int = 400
    program_chars: int = 3000


def check_template(template: str) -> str:
    if template not in TEMPLATES:
        raise ValueError(f"unknown template {template!r}; expected one of {TEMPLATES}")
    return template


def _fence(tag: str, body: str) -> str:
    return f"```{tag}\n{body}\n```"


def _azr_reference(i: int, t: Task, caps: Caps, pairs: int) -> str:
    parts = [f"<reference {i}>", _fence("python", cap(t.program, caps.program_chars))]
    if t.message:
        parts.append(_fence("message", cap(t.message, caps.shown_chars)))
    for inp, out in list(zip(t.inputs, t.outputs, strict=True))[:pairs]:
        parts.append(_fence("input", cap(inp, caps.shown_chars)))
        parts.append(_fence("output", cap(out, caps.shown_chars)))
    parts.append(f"</reference {i}>")
    return "\n".join(parts)


def _compact_reference(t: Task, caps: Caps) -> str:
    """A reference in the layout the teacher must write: program, one input and its output
    (code_o/code_i), or program, its inputs and the message (code_f)."""
    s = f"<f>{cap(t.program, caps.program_chars)}</f>"
    if t.type == "code_f":
        s += "".join(f"<i>{cap(i, caps.shown_chars)}</i>" for i in t.inputs)
        return s + f"<m>{cap(t.message, caps.shown_chars)}</m>"
    return s + f"<i>{cap(t.input, caps.shown_chars)}</i><o>{cap(t.output, caps.shown_chars)}</o>"


def _azr_refs(refs: Sequence[Task], caps: Caps, pairs: int) -> str:
    if not refs:
        return "Reference tasks: none yet.\n"
    body = "\n".join(_azr_reference(i + 1, t, caps, pairs) for i, t in enumerate(refs))
    return f"Reference tasks:\n{body}\n"


_GOAL = {
    "code_o": (
        "## Task: propose a new program and one input; a test taker will predict the output\n\n"
        "Write a new Python program and one input for it. The test taker sees the program and "
        "the input and must work out the returned value by reasoning alone, so make that take "
        "several careful steps (state changing across loops, recursion, data structures). "
        "Make it clearly different from the reference tasks.\n\n"
    ),
    "code_i": (
        "## Task: propose a new program and one input; a test taker will recover an input\n\n"
        "Write a new Python program and one input for it. The test taker sees the program and "
        "the value it returns for your input, and must find an input that gives that value, "
        "so make working backwards take several careful steps. Make it clearly different "
        "from the reference tasks.\n\n"
    ),
}


def teacher_io(kind: str, refs: Sequence[Task], template: str, caps: Caps,
               chat: ChatFormat | None = None) -> str:
    """Teacher prompt for code_o / code_i: write a program and one input."""
    if check_template(template) == "compact":
        lines = [f"propose {kind}", *(_compact_reference(t, caps) for t in refs), "new", "<f>"]
        return "\n".join(lines)
    body = (
        _GOAL[kind]
        + _RULES
        + "\n"
        + _azr_refs(refs, caps, 1)
        + "\nAnswer in exactly this layout:\n<answer>\n"
        + _fence("python", "def f(...):\n    ...")
        + "\n"
        + _fence("input", "...")
        + "\n</answer>"
    )
    return _wrap(body, template, chat)


def teacher_f(refs: Sequence[Task], base: Task, n_inputs: int, template: str, caps: Caps,
              chat: ChatFormat | None = None) -> str:
    """Teacher prompt for code_f: write `n_inputs` inputs and a message for `base.program`."""
    if check_template(template) == "compact":
        lines = [
            f"propose code_f n={n_inputs}",
            *(_compact_reference(t, caps) for t in refs),
            "new",
            f"<f>{base.program}</f>",
            "<i>",
        ]
        return "\n".join(lines)
    body = (
        "## Task: write inputs and a message for a program; a test taker will rewrite it\n\n"
        f"Below is a program. Write {n_inputs} different inputs for it and a short message. "
        "The test taker sees half of the input/output pairs and your message, must write the "
        "program, and is checked on the other half. Choose inputs that together pin down the "
        "behaviour; the message is a hint that must not give the code away.\n\n"
        "- every input must run without error; an input is the argument text of `f(<input>)`\n\n"
        + _azr_refs(refs, caps, 2)
        + "\nThe program:\n"
        + _fence("python", base.program)
        + f"\n\nAnswer in exactly this layout ({n_inputs} input blocks, then the message):\n"
        + "<answer>\n"
        + _fence("input", "...")
        + "\n...\n"
        + _fence("message", "...")
        + "\n</answer>"
    )
    return _wrap(body, template, chat)


def student_o(task: Task, template: str, chat: ChatFormat | None = None) -> str:
    """code_o: predict the output of `f(task.input)`."""
    if check_template(template) == "compact":
        return f"solve code_o\n<f>{task.program}</f><i>{task.input}</i>\n<o>"
    body = (
        "## Task: predict the output\n\n"
        "Work out the value the program's function `f` returns for the input.\n\n"
        + _fence("python", task.program)
        + "\n"
        + _fence("input", task.input)
        + "\n\nGive the value as a Python literal, as `repr` would print it, inside "
        "<answer> </answer>, e.g. <answer>[1, 'a']</answer>."
    )
    return _wrap(body, template, chat)


def student_i(task: Task, template: str, chat: ChatFormat | None = None) -> str:
    """code_i: find an input for which `f` returns `task.output`."""
    if check_template(template) == "compact":
        return f"solve code_i\n<f>{task.program}</f><o>{task.output}</o>\n<i>"
    body = (
        "## Task: find an input\n\n"
        "Find an input for which the program's function `f` returns exactly the output below. "
        "Any such input counts.\n\n"
        + _fence("python", task.program)
        + "\n"
        + _fence("output", task.output)
        + "\n\nGive the argument text of the call `f(...)` inside <answer> </answer>, "
        "e.g. <answer>[1, 2], 'a'</answer>."
    )
    return _wrap(body, template, chat)


def student_f(visible: Sequence[tuple[str, str]], message: str, template: str,
              chat: ChatFormat | None = None) -> str:
    """code_f: write `f` from the visible pairs and the message."""
    if check_template(template) == "compact":
        pairs = "".join(f"<i>{i}</i><o>{o}</o>" for i, o in visible)
        return f"solve code_f\n<m>{message}</m>{pairs}\n<f>"
    shown = "\n".join(_fence("input", i) + "\n" + _fence("output", o) for i, o in visible)
    body = (
        "## Task: write the function\n\n"
        "A hidden Python function `f` gives these outputs for these inputs (an input is the "
        "argument text of `f(<input>)`). Write `f`; it is checked on other inputs.\n\n"
        + shown
        + "\n"
        + _fence("message", message)
        + f"\n\nDo not use these modules or names: {BANNED_WORDS}.\n"
        "Write the program in a ```python block inside <answer> </answer>."
    )
    return _wrap(body, template, chat)
