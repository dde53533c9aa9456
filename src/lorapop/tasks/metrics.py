"""Program metrics and problem-space coverage, to watch what teachers propose.

Per program (`program_metrics`): AST depth, cyclomatic complexity, lines of code, distinct
variables. Over a stream (`Coverage`): distinct structural signatures, i.e. AST shapes with
identifiers and constants abstracted, seen so far and per batch. Nothing here runs the code
(it only parses), and nothing raises: text that does not parse gets None.

Complexity comes from radon rather than mccabe. We want McCabe's number for the whole program
(1 + every decision point: if/elif, loops, boolean operators, comprehension clauses, except,
ternaries, match cases) in top-level code, functions, methods and nested functions alike,
since AZR programs define helpers, closures and classes next to `f`. radon's visitor gives
per-block numbers for all of these (we add them up, closures included, which radon's own
total leaves out) and also the line counts (`radon.raw.analyze`); mccabe only scores functions
through a flake8-oriented graph API. radon is maintained and already a dependency.
"""

from __future__ import annotations

import ast
import hashlib
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from radon.raw import analyze
from radon.visitors import Class, ComplexityVisitor

from lorapop.tasks.parsing import MAX_TEXT_CHARS


@dataclass(frozen=True)
class ProgramMetrics:
    ast_depth: int  # longest root-to-leaf path in the AST, the Module node counting 1
    cyclomatic: int  # radon's total complexity of the module (see module docstring)
    loc: int  # source lines of code: no blank or comment-only lines (radon's sloc)
    variables: int  # distinct names bound: assignments, loop/with/except targets, arguments

    def to_json(self) -> dict[str, int]:
        return asdict(self)


def _parse(src: str) -> ast.Module | None:
    if not isinstance(src, str) or len(src) > MAX_TEXT_CHARS:
        return None
    try:
        return ast.parse(src)
    except (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError):
        return None


def call_name(node: ast.Call) -> str | None:
    """The name a call calls: `count` for `s.count(c)` and for `count(x)`; None for `g()()`."""
    f = node.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None


def called_names(src: str) -> set[str]:
    """Every name a program calls (`call_name`); empty when it does not parse."""
    tree = _parse(src)
    calls = (call_name(n) for n in ast.walk(tree) if isinstance(n, ast.Call)) if tree else ()
    return {name for name in calls if name}


def ast_depth(tree: ast.AST) -> int:
    """Depth without recursion, so deeply nested programs cannot overflow the stack."""
    best, stack = 0, [(tree, 1)]
    while stack:
        node, d = stack.pop()
        best = max(best, d)
        stack.extend((child, d + 1) for child in ast.iter_child_nodes(node))
    return best


def variables(tree: ast.AST) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            names.add(node.id)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            names.add(node.name)
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            names.update(node.names)
    return names


def _decisions(block: Any) -> int:
    """Decision points of a radon block, nested functions and methods included."""
    if isinstance(block, Class):
        return sum(map(_decisions, block.methods)) + sum(map(_decisions, block.inner_classes))
    return block.complexity - 1 + sum(map(_decisions, block.closures))


def _cyclomatic(v: ComplexityVisitor) -> int:
    # radon's own total_complexity leaves out closures, which AZR programs use a lot
    return v.complexity + sum(map(_decisions, v.functions)) + sum(map(_decisions, v.classes))


def program_metrics(src: str) -> ProgramMetrics | None:
    """Metrics of a program, or None when it does not parse."""
    tree = _parse(src)
    if tree is None:
        return None
    try:
        cyclomatic = _cyclomatic(ComplexityVisitor.from_ast(tree))
        loc = analyze(src).sloc
    except Exception:  # radon on unusual but valid syntax: report what we can still trust
        return None
    return ProgramMetrics(ast_depth(tree), cyclomatic, loc, len(variables(tree)))


class _Abstract(ast.NodeTransformer):
    """Replaces identifiers by `_` and constants by their type name."""

    def visit_Name(self, node: ast.Name) -> ast.AST:
        node.id = "_"
        return node

    def visit_arg(self, node: ast.arg) -> ast.AST:
        node.arg = "_"
        node.annotation = None
        node.type_comment = None
        return node

    def visit_Attribute(self, node: ast.Attribute) -> ast.AST:
        self.generic_visit(node)
        node.attr = "_"
        return node

    def visit_Constant(self, node: ast.Constant) -> ast.AST:
        return ast.Constant(value=type(node.value).__name__, kind=None)

    def generic_visit(self, node: ast.AST) -> ast.AST:
        for field in ("name", "asname", "module"):  # def/class/import/except names
            if isinstance(getattr(node, field, None), str):
                setattr(node, field, "_")
        if isinstance(node, ast.keyword) and node.arg is not None:
            node.arg = "_"
        if isinstance(node, (ast.Global, ast.Nonlocal)):
            node.names = ["_"] * len(node.names)
        return super().generic_visit(node)


def signature(src: str) -> str | None:
    """Structural signature: a hash of the AST shape with identifiers and constants
    abstracted, so `def f(a): return a + 1` and `def g(x): return x + 7` share one."""
    tree = _parse(src)
    if tree is None:
        return None
    try:
        tree = _Abstract().visit(tree)
        dump = ast.dump(tree, annotate_fields=False, include_attributes=False)
    except (RecursionError, MemoryError, ValueError):
        return None
    return hashlib.sha1(dump.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class CoverageStep:
    batch: int  # programs in the batch
    parsed: int  # of them, programs that parse
    batch_distinct: int  # distinct signatures in the batch
    new: int  # signatures never seen before this batch
    total_distinct: int  # distinct signatures seen so far, this batch included

    def to_json(self) -> dict[str, int]:
        return asdict(self)


class Coverage:
    """Distinct structural signatures over a stream of program batches."""

    def __init__(self) -> None:
        self.seen: set[str] = set()

    def update(self, programs: Iterable[str]) -> CoverageStep:
        found = [signature(p) for p in programs]
        sigs = {s for s in found if s is not None}
        new = sigs - self.seen
        self.seen |= sigs
        parsed = sum(s is not None for s in found)
        return CoverageStep(len(found), parsed, len(sigs), len(new), len(self.seen))
