"""Is a value's text the same value as a gold text? Decided here, never inside a sandbox job.

Code that runs in a job can write any verdict on the child's result pipe and exit, or rebind
builtins while it runs, so a comparison computed inside a process that ran the code of the
party it rewards could be forged. Checks therefore ask the sandbox only for a *value's repr*
(the student's `f` on hidden inputs, the teacher's `f` on a student's input, a student's stated
value) and compare that text with the gold here. The gold never enters such a process, so a
forged repr is only a guess.

`judge` says, for a value text and a gold text:
- the same text: a match (also `nan` vs `nan`, and values of the program's classes, whose
  repr is all the caller can see);
- else the value text must state a value (`parsing.is_value`: literals, builtin constructors,
  the program's classes; no calls of `f`, no lambdas), or it is "not a value";
- when both texts are plain builtin values (`plain`: literals, plus `inf`, `nan`, `set(...)`
  and `frozenset(...)` as reprs print them, built by `ast.literal_eval`, so no code runs),
  Python's `==` decides, as in AZR (2 == 2.0, {1} == frozenset({1}));
- anything else differs.
"""

from __future__ import annotations

import ast

from lorapop.tasks.parsing import MAX_ANSWER_CHARS, is_value

MATCH, MISMATCH, NOT_A_VALUE = "match", "mismatch", "output is not a value"

#: Appended to a program whose namespace evaluates a stated value: reprs print `inf` and `nan`
#: as bare names. Trusted code that computes nothing about any gold.
VALUE_PRELUDE = """
if "inf" not in globals():
    inf = float("inf")
if "nan" not in globals():
    nan = float("nan")
"""
_FLOATS = {"inf": float("inf"), "nan": float("nan")}
_SETS = {"set": set, "frozenset": frozenset}
_ERRORS = (ValueError, TypeError, SyntaxError, RecursionError, MemoryError, OverflowError)


class _Plain(ast.NodeTransformer):
    """Rewrites the non-literal parts of builtin reprs into constants literal_eval accepts."""

    def visit_Name(self, node: ast.Name) -> ast.AST:
        if node.id in _FLOATS:
            return ast.Constant(_FLOATS[node.id])
        return node  # literal_eval refuses it

    def visit_Call(self, node: ast.Call) -> ast.AST:
        self.generic_visit(node)
        f = node.func
        if isinstance(f, ast.Name) and f.id in _SETS and not node.keywords and len(node.args) < 2:
            items = ast.literal_eval(node.args[0]) if node.args else ()
            if isinstance(items, list | tuple | set | frozenset | str | bytes | dict):
                return ast.Constant(_SETS[f.id](items))
        return node


def plain(text: str) -> tuple[bool, object]:
    """(True, value) when `text` states a value made only of plain builtins; no code runs."""
    if len(text) > MAX_ANSWER_CHARS:
        return False, None
    try:
        tree = _Plain().visit(ast.parse(text.strip(), mode="eval"))
        return True, ast.literal_eval(tree)
    except _ERRORS:
        return False, None


def judge(value: str, gold: str, names: frozenset[str]) -> str:
    """MATCH, MISMATCH or NOT_A_VALUE for a value's text against a gold text (module doc).
    `names`: what a value may call (`parsing.value_names` of the program that made the gold)."""
    if value == gold:
        return MATCH
    if len(value) > MAX_ANSWER_CHARS or not is_value(value, names):
        return NOT_A_VALUE
    ok_v, v = plain(value)
    ok_g, g = plain(gold) if ok_v else (False, None)
    if not (ok_v and ok_g):
        return MISMATCH
    try:
        return MATCH if bool(v == g) else MISMATCH
    except (RecursionError, MemoryError):
        return MISMATCH


def tuple_items(text: str, n: int) -> list[str] | None:
    """The texts of the `n` items of a tuple's repr, or None when `text` is not one."""
    if len(text) > MAX_ANSWER_CHARS * max(n, 1) or "\r" in text:  # \r: odd line numbering
        return None
    try:
        node = ast.parse(text, mode="eval").body
    except _ERRORS:
        return None
    if not isinstance(node, ast.Tuple) or len(node.elts) != n:
        return None
    data = text.encode()  # ast offsets count UTF-8 bytes from the start of their line
    starts = [0] + [k + 1 for k, b in enumerate(data) if b == 10]
    out = []
    for e in node.elts:
        if isinstance(e, ast.Starred) or e.end_lineno is None or e.end_col_offset is None:
            return None
        a = starts[e.lineno - 1] + e.col_offset
        out.append(data[a : starts[e.end_lineno - 1] + e.end_col_offset].decode())
    return out
