"""Values back from the sandbox's reprs, and Python source for test inputs.

The sandbox returns `repr(value)`; comparing values (evalplus' float tolerance, set equality)
needs them back in the trainer's process. `parse` walks the AST of a repr and rebuilds only plain
data (numbers, strings, bytes, containers, `nan`/`inf`, `set()`), so hostile text can never run.
"""

from __future__ import annotations

import ast
import math
from typing import Any

_NAMES = {"nan": math.nan, "inf": math.inf, "True": True, "False": False, "None": None}


class NotLiteral(ValueError):
    pass


def _build(node: ast.AST) -> Any:
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name) and node.id in _NAMES:
        return _NAMES[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        v = _build(node.operand)
        if isinstance(v, int | float | complex) and not isinstance(v, bool):
            return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add | ast.Sub):
        a, b = _build(node.left), _build(node.right)  # complex reprs: (1+2j), (-0-1j)
        if isinstance(b, complex) and isinstance(a, int | float):
            return a + b if isinstance(node.op, ast.Add) else a - b
    if isinstance(node, ast.Tuple):
        return tuple(_build(e) for e in node.elts)
    if isinstance(node, ast.List):
        return [_build(e) for e in node.elts]
    if isinstance(node, ast.Set):
        return {_build(e) for e in node.elts}
    if isinstance(node, ast.Dict) and None not in node.keys:
        return {_build(k): _build(v) for k, v in zip(node.keys, node.values, strict=False)}  # type: ignore[arg-type]
    if (
        isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
        and node.func.id in ("set", "frozenset") and len(node.args) <= 1 and not node.keywords
    ):  # fmt: skip
        items = _build(node.args[0]) if node.args else ()
        return set(items) if node.func.id == "set" else frozenset(items)
    raise NotLiteral(type(node).__name__)


def parse(text: str) -> Any:
    """The value whose repr is `text`; raises NotLiteral for anything but plain data."""
    try:
        return _build(ast.parse(text.strip(), mode="eval").body)
    except (SyntaxError, RecursionError, MemoryError, TypeError, ValueError) as e:
        raise NotLiteral(str(e)) from None


def source(v: Any) -> str:
    """Python source that rebuilds `v` (repr, except floats that repr to `nan`/`inf`)."""
    if isinstance(v, float) and not math.isfinite(v):
        return f"float({str(v)!r})"
    if isinstance(v, complex) and not (math.isfinite(v.real) and math.isfinite(v.imag)):
        return f"complex({source(v.real)}, {source(v.imag)})"
    if isinstance(v, list):
        return "[" + ", ".join(source(x) for x in v) + "]"
    if isinstance(v, tuple):
        return "(" + "".join(source(x) + ", " for x in v) + ")"
    if isinstance(v, set | frozenset):
        inner = ", ".join(source(x) for x in v)
        return ("frozenset" if isinstance(v, frozenset) else "set") + f"([{inner}])"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{source(k)}: {source(x)}" for k, x in v.items()) + "}"
    return repr(v)
