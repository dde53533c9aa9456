"""Pulling answers out of model text, and checking their shape without running them.

Everything here is linear-time string work plus `ast.parse` (parsing is not executing), so it
is safe and bounded on hostile text: texts above `MAX_TEXT_CHARS` are refused outright, and
no function raises. Two layouts exist:

- azr: R1-style `<think>…</think><answer>…</answer>`, fenced blocks (```python, ```input,
  ```output, ```message) inside the answer. Like AZR, proposals fall back to fenced blocks
  anywhere in the text when there is no complete answer block, and `# Input:` / `# Message:`
  lines stand in for missing blocks. A student answer needs a closed `</answer>` (a truncated
  generation is a format error); with several answer blocks the last one counts.
- compact: short tags `<f>` program, `<i>` input, `<o>` output, `<m>` message. The prompt ends
  with the opening tag of what the model must write, so the text may start inside it; an
  unclosed final tag runs to the end of the text (a stop string may have eaten it).
"""

from __future__ import annotations

import ast

#: Longer model texts are a format error (a real generation is far shorter; this bounds work).
MAX_TEXT_CHARS = 100_000
#: Longest answer expression accepted (literal_eval and ast.parse cost grows with it).
MAX_ANSWER_CHARS = 20_000

FENCE = "```"
_KNOWN_TAGS = ("python", "py", "input", "output", "message")


def answer_span(text: str) -> str | None:
    """Body of the last complete `<answer>…</answer>`, or None."""
    end = text.rfind("</answer>")
    if end < 0:
        return None
    start = text.rfind("<answer>", 0, end)
    if start < 0:
        return None
    return text[start + len("<answer>") : end]


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """All closed fenced blocks as (tag, body), in order; an unclosed last fence is dropped.

    Handles a tag on the fence line (```python) and one-line blocks (```input 5```).
    """
    parts = text.split(FENCE)
    blocks = []
    for k in range(1, len(parts) - 1, 2):  # odd parts lie between an opening and closing fence
        seg = parts[k]
        first, nl, rest = seg.partition("\n")
        head = first.strip()
        word, _, tail = head.partition(" ")
        if word.lower() in _KNOWN_TAGS:
            tag = "python" if word.lower() == "py" else word.lower()
            body = (tail + nl + rest) if tail else rest
        elif not head:
            tag, body = "", rest
        elif not nl:  # ```5``` : untagged one-liner
            tag, body = "", head
        else:  # an unknown language tag (```text): keep the tag, drop it from the body
            tag, body = word.lower(), (tail + nl + rest) if tail else rest
        blocks.append((tag, body.strip("\n").strip()))
    return blocks


def line_fallback(text: str, label: str) -> str | None:
    """AZR's fallback: the text after `# Input:` (or other label) up to the end of its line."""
    pos = text.find(f"# {label}:")
    if pos < 0:
        return None
    line = text[pos + len(label) + 3 :].split("\n", 1)[0].strip()
    return line or None


def tag_blocks(text: str, tag: str) -> list[str]:
    """Bodies of `<tag>…</tag>` in order; an unclosed last one runs to the end of the text."""
    open_, close = f"<{tag}>", f"</{tag}>"
    out, pos = [], 0
    while True:
        start = text.find(open_, pos)
        if start < 0:
            return out
        start += len(open_)
        end = text.find(close, start)
        if end < 0:
            out.append(text[start:].strip())
            return out
        out.append(text[start:end].strip())
        pos = end + len(close)


def opened(text: str, tag: str) -> str:
    """The text as if the prompt's trailing `<tag>` belonged to it (unless the model repeated it)."""
    return text if text.lstrip().startswith(f"<{tag}>") else f"<{tag}>" + text


def strip_fence(answer: str) -> str:
    """`42` from a student who wrapped an answer in a fence (```output\\n42\\n```)."""
    blocks = fenced_blocks(answer)
    return blocks[-1][1] if blocks else answer.strip()


def python_expr(text: str) -> str | None:
    """Normalised source of `text` when it is a single Python expression, else None.

    The result is `ast.unparse` of the parsed tree, so comments and trailing tricks are gone
    and it can be spliced into a larger expression inside parentheses.
    """
    if not text.strip() or len(text) > MAX_ANSWER_CHARS:
        return None
    try:
        tree = ast.parse(f"(\n{text}\n)", mode="eval")
        return ast.unparse(tree.body)
    except (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError):
        return None


def call_args(text: str, name: str = "f") -> str | None:
    """Normalised argument text when `f(<text>)` is exactly one call of `f`, else None.

    Rejects text that escapes the call (`1), g(2`), so it can be spliced safely.
    """
    if not text.strip() or len(text) > MAX_ANSWER_CHARS:
        return None
    try:
        tree = ast.parse(f"{name}(\n{text}\n)", mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError):
        return None
    call = tree.body
    if not (
        isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == name
    ):
        return None
    try:
        src = ast.unparse(call)
    except (ValueError, RecursionError):
        return None
    return src[len(name) + 1 : -1]


def literal(text: str) -> tuple[bool, object]:
    """(True, value) when `text` is a Python literal (ast.literal_eval: no code runs)."""
    if len(text) > MAX_ANSWER_CHARS:
        return False, None
    try:
        return True, ast.literal_eval(text.strip())
    except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError, OverflowError):
        return False, None


def is_program(text: str) -> bool:
    """True when `text` parses as a module (the sandbox repeats this and more)."""
    if not text.strip() or len(text) > MAX_TEXT_CHARS:
        return False
    try:
        ast.parse(text)
        return True
    except (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError):
        return False


def cap(text: str, limit: int) -> str:
    """`text` cut to `limit` characters with a visible marker, for prompts only."""
    if len(text) <= limit:
        return text
    return text[:limit] + " …(truncated)"


#: Calls a value answer may contain besides the program's own classes and imported names
#: (they rebuild values whose repr is not a literal: frozenset({1}), range(0, 3), ...).
SAFE_CALLS = frozenset(
    {"set", "frozenset", "dict", "list", "tuple", "complex", "float", "int", "str", "bytes",
     "bytearray", "range", "bool", "slice"}
)  # fmt: skip
_DATA_NODES = (
    ast.Expression, ast.Constant, ast.List, ast.Tuple, ast.Set, ast.Dict, ast.UnaryOp,
    ast.UAdd, ast.USub, ast.BinOp, ast.Add, ast.Sub, ast.Call, ast.keyword, ast.Name, ast.Load,
)  # fmt: skip


def value_names(program: str) -> frozenset[str]:
    """Names a value answer may use for `program`: SAFE_CALLS, inf, nan, the program's
    top-level classes and the names it imports with `from … import`. Never `f` or helpers."""
    names = set(SAFE_CALLS) | {"inf", "nan"}
    try:
        tree = ast.parse(program)
    except (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError):
        return frozenset(names)
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.ImportFrom):
            names.update(a.asname or a.name for a in node.names if a.name != "*")
    functions = {n.name for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
    return frozenset(names - functions - {"f"})


def is_value(expr: str, names: frozenset[str]) -> bool:
    """True when `expr` only builds a value (literals, and calls of `names` on values), so an
    answer states a value instead of computing it (e.g. by calling `f` or a lambda)."""
    try:
        tree = ast.parse(f"(\n{expr}\n)", mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError):
        return False
    return _value_node(tree, names)


def is_value_args(args: str, names: frozenset[str]) -> bool:
    """`is_value` for every argument of `f(<args>)` (positional, keyword, starred)."""
    try:
        call = ast.parse(f"f(\n{args}\n)", mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError):
        return False
    if not isinstance(call, ast.Call):
        return False
    parts = [a.value if isinstance(a, ast.Starred) else a for a in call.args]
    return all(_value_node(p, names) for p in parts + [k.value for k in call.keywords])


def _value_node(tree: ast.AST, names: frozenset[str]) -> bool:
    for n in ast.walk(tree):
        if not isinstance(n, _DATA_NODES):
            return False
        if isinstance(n, ast.Name) and n.id not in names:
            return False
        if isinstance(n, ast.Call) and not isinstance(n.func, ast.Name):
            return False
        if isinstance(n, ast.keyword) and n.arg is None:
            return False
    return True
