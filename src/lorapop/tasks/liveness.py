"""Dead code in a teacher's program: statements that cannot change what the function returns.

A learnability-rewarded teacher is paid for tasks its student half-solves, and a small student
is easily distracted: on the tiny world's `narrow` table the single agent padded one-line
programs with `word = word` chains and values computed and never read, and its own solve rate
fell from 0.7 to 0.3 while the programs' control flow went to nothing
(experiments/regime/README.md). Where a world asks for live code (`tasks.live_code`), such a program is invalid,
so difficulty has to come from what the program computes.

The check reads the syntax tree backwards through each function with the set of names still
to be read (a loop's body to a fixed point, since it runs again after itself). It judges only
what it can judge without running anything, and errs towards calling a statement live: stores
into items or attributes, statements that may change something else (a call of a mutating
method such as `append`, of a function not among the pure builtins, an `:=`), `while` loops
and blocks with `break`/`continue` always count. Deeply nested loops make the fixed points cost
exponentially more: past `MAX_VISITS` statement visits a program is not judged at all.
"""

from __future__ import annotations

import ast

#: Builtins whose calls change nothing they are given.
PURE_BUILTINS = frozenset([
    "abs", "all", "any", "bool", "chr", "dict", "divmod", "enumerate", "filter", "float",
    "format", "frozenset", "hash", "hex", "int", "len", "list", "map", "max", "min", "oct",
    "ord", "pow", "range", "repr", "reversed", "round", "set", "sorted", "str", "sum", "tuple",
    "zip",
])  # fmt: skip
#: Methods of the builtin containers that change their object in place.
MUTATORS = frozenset([
    "add", "append", "clear", "difference_update", "discard", "extend", "insert",
    "intersection_update", "pop", "popitem", "remove", "reverse", "setdefault", "sort",
    "symmetric_difference_update", "update",
])  # fmt: skip

#: Statement visits one program may cost (the grammar's level-5 programs take at most ~50).
MAX_VISITS = 5_000

Dead = list[tuple[ast.stmt, str]]


class _TooCostly(Exception):
    pass


def dead_statement(program: str) -> str | None:
    """Why a statement of `program` is dead (the first in source order), or None. A program
    that does not parse has none here: running it reports that."""
    found = _dead_statements(_parse(program))
    return f"line {found[0][0].lineno}: {found[0][1]}" if found else None


def drop_dead(program: str) -> str:
    """`program` without its dead statements (the same results: a dead statement changes
    nothing, unless it raised); a block left empty keeps a `pass`. For generated programs,
    whose simple statements are whole lines."""
    while found := _dead_statements(tree := _parse(program)):
        dead = {id(stmt) for stmt, _ in found}
        edits: dict[int, str] = {}  # line number -> its replacement ("" drops it)
        for block in _blocks(tree):
            gone = [stmt for stmt in block if id(stmt) in dead]
            for stmt in gone:
                edits |= dict.fromkeys(range(stmt.lineno, (stmt.end_lineno or stmt.lineno) + 1), "")
            if gone and len(gone) == len(block):
                edits[gone[0].lineno] = " " * gone[0].col_offset + "pass\n"
        lines = program.splitlines(keepends=True)
        program = "".join(edits.get(n, x) for n, x in enumerate(lines, 1))
    return program


def _blocks(tree: ast.AST) -> list[list[ast.stmt]]:
    """Every statement list of `tree`'s functions and of their blocks."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.If, ast.For, ast.While)):
            out += [b for b in (node.body, getattr(node, "orelse", [])) if b]
    return out


def _parse(program: str) -> ast.Module | None:
    try:
        return ast.parse(program)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None


def _dead_statements(tree: ast.Module | None) -> Dead:
    found: Dead = []
    visits = [MAX_VISITS]
    try:
        for fn in tree.body if tree else []:
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and not _declares_scope(fn):
                found += _dead_in(fn.body, set(), visits)[1]
    except (_TooCostly, RecursionError):
        return []
    return sorted(found, key=lambda x: x[0].lineno)


def _dead_in(body: list[ast.stmt], live_out: set[str], visits: list[int]) -> tuple[set[str], Dead]:
    """The names live before `body` and its dead statements, given the names live after it.
    `visits[0]`: the statement visits left (`_TooCostly` when none)."""
    visits[0] -= len(body)
    if visits[0] < 0:
        raise _TooCostly
    live = set(live_out)
    dead: Dead = []
    for k, stmt in reversed(list(enumerate(body))):
        if isinstance(stmt, (ast.Return, ast.Raise)):
            live = _loads(stmt)
        elif isinstance(stmt, ast.Pass):
            if len(body) > 1:
                dead.append((stmt, "`pass` does nothing"))
        elif isinstance(stmt, ast.Expr) and not _effects(stmt.value) and not _docstring(k, stmt):
            dead.append((stmt, f"`{_text(stmt)}` computes a value and drops it"))
        elif isinstance(stmt, ast.Assign) and all(isinstance(t, ast.Name) for t in stmt.targets):
            names = {t.id for t in stmt.targets if isinstance(t, ast.Name)}
            if isinstance(stmt.value, ast.Name) and names == {stmt.value.id}:
                dead.append((stmt, f"`{_text(stmt)}` assigns a name to itself"))
            elif not names & live and not _effects(stmt.value):
                dead.append((stmt, f"`{_text(stmt)}` stores a value never read"))
            else:
                live = (live - names) | _loads(stmt.value)
        elif isinstance(stmt, ast.AugAssign) and isinstance(stmt.target, ast.Name):
            if stmt.target.id not in live and not _effects(stmt.value):
                dead.append((stmt, f"`{_text(stmt)}` changes a value never read"))
            else:
                live |= _loads(stmt.value) | {stmt.target.id}
        elif isinstance(stmt, (ast.If, ast.For, ast.While)) and not _jumps(stmt):
            before, inner = _dead_in_block(stmt, live, visits)
            if _all_dead(stmt, inner):
                head = _text(stmt).splitlines()[0]
                dead.append((stmt, f"the block `{head}` changes nothing read after it"))
            else:
                live, dead = before, dead + inner
        else:  # item stores, calls, try/with, loops with jumps: live, and all they read is read
            live |= _loads(stmt)
    return live, dead


def _dead_in_block(
    stmt: ast.If | ast.For | ast.While, live: set[str], visits: list[int]
) -> tuple[set[str], Dead]:
    """`_dead_in` of an `if` or a loop. After a loop's body come the loop's next test and pass:
    the names live there are those live after the loop and those the next pass reads."""
    if isinstance(stmt, ast.If):
        b_in, b_dead = _dead_in(stmt.body, live, visits)
        o_in, o_dead = _dead_in(stmt.orelse, live, visits)
        return b_in | o_in | _loads(stmt.test), b_dead + o_dead
    test = stmt.test if isinstance(stmt, ast.While) else stmt.iter
    targets = _stores(stmt.target) if isinstance(stmt, ast.For) else set()
    head = live | (_loads(test) if isinstance(stmt, ast.While) else set())
    while True:
        b_in, b_dead = _dead_in(stmt.body, head, visits)
        if (new := head | (b_in - targets)) == head:
            o_in, o_dead = _dead_in(stmt.orelse, live, visits)
            return head | o_in | _loads(test), b_dead + o_dead
        head = new


def _all_dead(stmt: ast.If | ast.For | ast.While, inner: Dead) -> bool:
    """Whether a whole block changes nothing: a header without effects (never a `while`, which
    may not end) and every statement inside dead or a lone `pass`."""
    if isinstance(stmt, ast.While) or _effects(stmt.test if isinstance(stmt, ast.If) else stmt.iter):
        return False
    dead = {id(s) for s, _ in inner}
    return all(id(s) in dead or (isinstance(s, ast.Pass) and len(b) == 1)
               for b in (stmt.body, stmt.orelse) for s in b)  # fmt: skip


def _loads(node: ast.AST) -> set[str]:
    """Every name `node` reads (an augmented store reads its target too)."""
    out = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load):
            out.add(n.id)
        elif isinstance(n, ast.AugAssign) and isinstance(n.target, ast.Name):
            out.add(n.target.id)
    return out


def _stores(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}


def _effects(node: ast.AST) -> bool:
    """Whether evaluating `node` may change something besides giving its value: a mutating
    method, a call of anything but a pure builtin (a helper may change its argument), `:=`."""
    for n in ast.walk(node):
        if isinstance(n, (ast.NamedExpr, ast.Yield, ast.YieldFrom, ast.Await)):
            return True
        if isinstance(n, ast.Call):
            f = n.func
            if not isinstance(f, (ast.Name, ast.Attribute)):
                return True
            if isinstance(f, ast.Name) and f.id not in PURE_BUILTINS:
                return True
            if isinstance(f, ast.Attribute) and (f.attr in MUTATORS or f.attr.startswith("__")):
                return True
    return False


def _jumps(stmt: ast.stmt) -> bool:
    """`break`/`continue` inside: the flow is not judged (the block counts as live)."""
    return any(isinstance(n, (ast.Break, ast.Continue)) for n in ast.walk(stmt))


def _docstring(k: int, stmt: ast.Expr) -> bool:
    return k == 0 and isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, str)


def _declares_scope(fn: ast.AST) -> bool:
    """`global`/`nonlocal` make a store visible outside the function: not judged."""
    return any(isinstance(n, (ast.Global, ast.Nonlocal)) for n in ast.walk(fn))


def _text(stmt: ast.stmt) -> str:
    text = ast.unparse(stmt)
    return text if len(text) <= 60 else text[:57] + "..."
