"""Pull the answer out of model text: `<answer>` tags, `\\boxed{}` and fenced code blocks.

Pure string functions (no imports beyond `re`), so the code-scoring path needs nothing else.
"""

from __future__ import annotations

import re

_ANSWER = re.compile(r"<answer>(.*?)(?:</answer>|$)", re.S)
_FENCE = re.compile(r"```([\w+-]*)[ \t]*\n(.*?)(?:```|$)", re.S)
_THINK_END = "</think>"


def answer_span(text: str) -> str | None:
    """The content of the last `<answer>...</answer>` (an unclosed last tag runs to the end)."""
    found = _ANSWER.findall(text)
    return found[-1].strip() if found else None


def last_boxed(text: str) -> str | None:
    """The brace-matched content of the last `\\boxed{...}` or `\\fbox{...}`, else None."""
    starts = [m.end() for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text)]
    for start in reversed(starts):
        depth, i = 1, start
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            return text[start : i - 1].strip()
    return None


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """Every ```lang ... ``` block as (lang, body); an unclosed last fence runs to the end."""
    return [(lang.lower(), body) for lang, body in _FENCE.findall(text)]


def code_block(text: str, entry: str | None = None) -> str:
    """The program in a completion: the last python (or untagged) fenced block, preferring one
    that defines `entry`; else the text after `</think>` (base models often write bare code)."""
    tail = text.split(_THINK_END)[-1]
    scope = answer_span(tail) or tail
    for src in (scope, tail, text):
        blocks = [b for lang, b in fenced_blocks(src) if lang in ("", "python", "py", "python3")]
        if entry is not None:
            defining = [b for b in blocks if re.search(rf"\bdef\s+{re.escape(entry)}\s*\(", b)]
            blocks = defining or blocks
        if blocks:
            return blocks[-1]
    return scope
