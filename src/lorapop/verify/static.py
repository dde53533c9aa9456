"""Static checks run in the caller before any process is started.

They parse and walk the AST and compile it (`compile_job`), which runs nothing, so they are safe
on hostile text; the code objects go to the sandbox's child, which then needs no compiler.
Banned names are matched as dotted paths resolved through import aliases: `import os as o;
o.environ` is `os.environ` (banned), while `import randomize` or `numpy.random` are not `random`
(AZR matches substrings and gets both wrong). Dynamic tricks (`__import__(name_var)`) cannot be
seen statically; the sandbox's process isolation is the real defence, these checks only keep
AZR's validity rules.
"""

from __future__ import annotations

import ast
import threading
from types import CodeType

from lorapop.verify.verdict import Status

#: AZR's banned list (modules and attributes), matched on whole dotted components.
BANNED: tuple[str, ...] = (
    "logging", "random", "multiprocessing", "pebble", "subprocess", "threading", "datetime",
    "time", "hashlib", "hmac", "bcrypt", "os.sys", "os.path", "sys.exit", "os.environ",
    "calendar",
)  # fmt: skip

#: Longer sources are refused before parsing (the parser's cost grows with size).
MAX_SOURCE_CHARS = 100_000

_IMPORTERS = {"__import__", "importlib.import_module", "import_module"}

#: CPython (3.11 at least) counts the AST constructor's recursion depth in interpreter-wide
#: state, so two threads building ASTs at once (two sandboxes of one process) can make one
#: raise `SystemError: AST constructor recursion depth mismatch` (seen in a full test run).
_AST_LOCK = threading.Lock()


def parse(source: str, mode: str = "exec") -> ast.AST:
    """`ast.parse` one thread at a time; the mismatch error, should a parse outside this
    module's lock still collide with one, is retried once."""
    with _AST_LOCK:
        try:
            return ast.parse(source, mode=mode)
        except SystemError as e:
            if "recursion depth mismatch" not in str(e):
                raise
            return ast.parse(source, mode=mode)


def _banned(dotted: str, banned: tuple[str, ...]) -> str | None:
    for b in banned:
        if dotted == b or dotted.startswith(b + "."):
            return b
    return None


def _dotted(node: ast.expr, aliases: dict[str, str]) -> str | None:
    """`a.b.c` -> the dotted path it names when `a` is bound by an import, else None."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name) or node.id not in aliases:
        return None
    return ".".join([aliases[node.id], *reversed(parts)])


def _callee(func: ast.expr, aliases: dict[str, str]) -> str | None:
    if isinstance(func, ast.Name) and func.id not in aliases:
        return func.id  # a builtin such as __import__ or getattr
    return _dotted(func, aliases)


def _aliases(nodes: list[ast.AST]) -> dict[str, str]:
    """Names bound by imports anywhere in the program -> the dotted path they stand for."""
    out: dict[str, str] = {}
    for node in nodes:
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.asname:
                    out[a.asname] = a.name
                else:
                    top = a.name.split(".")[0]
                    out[top] = top
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                if a.name != "*":
                    out[a.asname or a.name] = f"{node.module}.{a.name}"
    return out


def _walk(tree: ast.AST) -> list[ast.AST]:
    """`list(ast.walk(tree))`, in the same (breadth-first) order, without its generators: the
    caller checks every job, so this runs on the trainer's critical path."""
    out, i, node_type = [tree], 0, ast.AST
    while i < len(out):
        node = out[i]
        i += 1
        for name in node._fields:
            value = getattr(node, name, None)
            if isinstance(value, list):
                out.extend(v for v in value if isinstance(v, node_type))
            elif isinstance(value, node_type):
                out.append(value)
    return out


def _uses(nodes: list[ast.AST], aliases: dict[str, str]) -> list[str]:
    """Every dotted name the nodes import or reference (including `__import__("x")`)."""
    used: list[str] = []
    for node in nodes:
        kind = type(node)  # the parser makes no subclasses of its node types
        if kind is ast.Import:
            used += [a.name for a in node.names]  # type: ignore[attr-defined]
        elif kind is ast.ImportFrom:
            if node.module and not node.level:  # type: ignore[attr-defined]
                for a in node.names:  # type: ignore[attr-defined]
                    m = node.module  # type: ignore[attr-defined]
                    used.append(m + ".*" if a.name == "*" else f"{m}.{a.name}")
        elif kind is ast.Attribute or kind is ast.Name:
            if type(node.ctx) is ast.Load:  # type: ignore[attr-defined]
                d = _dotted(node, aliases)  # type: ignore[arg-type]
                if d:
                    used.append(d)
        elif kind is ast.Call and node.args:  # type: ignore[attr-defined]
            fn = _callee(node.func, aliases)
            first = node.args[0]
            if fn in _IMPORTERS and isinstance(first, ast.Constant):
                used.append(str(first.value))
            elif fn == "getattr" and len(node.args) >= 2:
                base, name = _dotted(first, aliases), node.args[1]
                if base and isinstance(name, ast.Constant) and isinstance(name.value, str):
                    used.append(f"{base}.{name.value}")
    return used


def _star_banned(dotted: str, banned: tuple[str, ...]) -> str | None:
    """`from os import *` exposes `os.path`, so a star import of a banned parent is banned."""
    module = dotted[: -len(".*")]
    for b in banned:
        if b == module or b.startswith(module + ".") or module.startswith(b + "."):
            return b
    return None


def _defines(tree: ast.Module, name: str) -> bool:
    """True when a top-level `def`, `class` or assignment binds `name`."""
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            bound = [node.name]
        elif isinstance(node, ast.Assign):
            bound = [t.id for t in node.targets if isinstance(t, ast.Name)]
        else:
            continue
        if name in bound:
            return True
    return False


def _calls_input(nodes: list[ast.AST]) -> bool:
    return any(
        isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "input"
        for n in nodes
    )


def check(
    program: str,
    expr: str,
    entry: str | None = "f",
    banned: tuple[str, ...] = BANNED,
    ban_input: bool = True,
) -> tuple[Status, str] | None:
    """Return `(status, reason)` when the job is statically invalid, else None. With no
    `banned` names and `ban_input` off only parsing and the entry are checked."""
    trees = _parse(program, expr)
    return trees if isinstance(trees, tuple) else _rules(trees, entry, banned, ban_input)


def compile_job(
    program: str,
    expr: str,
    entry: str | None = "f",
    banned: tuple[str, ...] = BANNED,
    ban_input: bool = True,
) -> tuple[CodeType, CodeType] | tuple[Status, str]:
    """The code objects of a statically valid job (`check`'s rules), or `(status, reason)`.

    Compiled as `python prog.py` would: no future flags of this module, asserts kept. Errors
    the parser lets through (`return` outside a function, bad `nonlocal`) are syntax errors."""
    trees = _parse(program, expr)
    if isinstance(trees, tuple):
        return trees
    bad = _rules(trees, entry, banned, ban_input)
    if bad is not None:
        return bad
    try:
        with _AST_LOCK:
            return (
                compile(trees[0], "<program>", "exec", dont_inherit=True, optimize=0),
                compile(trees[1], "<expr>", "eval", dont_inherit=True, optimize=0),
            )
    except SyntaxError as e:
        return Status.SYNTAX_ERROR, f"{type(e).__name__}: {e.msg} (line {e.lineno})"
    except (ValueError, RecursionError, MemoryError) as e:
        return Status.SYNTAX_ERROR, f"{type(e).__name__}: {e}"


def _parse(program: str, expr: str) -> list[ast.AST] | tuple[Status, str]:
    if not isinstance(program, str) or not isinstance(expr, str):
        return Status.SYNTAX_ERROR, "program and expr must be strings"
    if len(program) + len(expr) > MAX_SOURCE_CHARS:
        return Status.SYNTAX_ERROR, f"source longer than {MAX_SOURCE_CHARS} characters"
    trees: list[ast.AST] = []
    for src, mode in ((program, "exec"), (expr, "eval")):
        try:
            trees.append(parse(src, mode))
        except SyntaxError as e:
            where = "program" if mode == "exec" else "expr"
            return Status.SYNTAX_ERROR, f"{where}: {type(e).__name__}: {e.msg} (line {e.lineno})"
        except (ValueError, RecursionError, MemoryError) as e:  # null bytes, absurd nesting
            return Status.SYNTAX_ERROR, f"{type(e).__name__}: {e}"
    return trees


def _rules(
    trees: list[ast.AST], entry: str | None, banned: tuple[str, ...], ban_input: bool
) -> tuple[Status, str] | None:
    prog_tree = trees[0]
    assert isinstance(prog_tree, ast.Module)
    if entry is not None and not _defines(prog_tree, entry):
        return Status.NO_ENTRY, f"program does not define {entry!r}"
    if not banned and not ban_input:
        return None
    walks = [_walk(tree) for tree in trees]  # walked once, read three times
    aliases = _aliases(walks[0])
    for nodes in walks:
        for dotted in _uses(nodes, aliases):
            hit = _star_banned(dotted, banned) if dotted.endswith(".*") else _banned(dotted, banned)
            if hit:
                return Status.BANNED, f"banned: {hit}"
        if ban_input and _calls_input(nodes):
            return Status.BANNED, "banned: input()"
    return None
