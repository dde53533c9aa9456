"""Scoring code benchmarks through the sandbox: evalplus (HumanEval+, MBPP+), LiveCodeBench and
CRUXEval. Nothing here imports math-verify, pydantic or typer (the GPU machine lacks them).

evalplus, as `evalplus.evaluate` does it: expected outputs come from running the canonical
solution on `base_input` and `plus_input`; a program passes when every base and plus test
matches under `Oracle` within its time limit. Tests go to the sandbox in chunks (the first test
alone, so a looping program costs one test's limit); a chunk's limit is evalplus' per-task
timeout formula, `min(cap, sum_i max(min_s, factor * t_i))`, with the canonical chunk time split
evenly over its tests (evalplus: factor 4, min 4 s per its docs, cap 60 s per task).
"""

from __future__ import annotations

import ast
import json
import re
import zlib
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any

from lorapop.evals.data import Problem
from lorapop.evals.extract import answer_span, code_block, fenced_blocks
from lorapop.evals.literal import NotLiteral, parse, source
from lorapop.evals.oracle import MBPP_NOT_NONE, Oracle
from lorapop.evals.pool import Case, Pool, Step
from lorapop.verify import Job, Verdict


@dataclass(frozen=True)
class TimeRule:
    factor: float = 4.0  # evalplus DEFAULT_GT_TIME_LIMIT_FACTOR
    min_s: float = 4.0  # evalplus --min-time-limit (docs/execution.md)
    cap_s: float = 60.0  # evalplus EVALPLUS_TIMEOUT_PER_TASK
    chunk: int = 100  # tests per sandbox job
    lcb_s: float = 6.0  # LiveCodeBench's per-test timeout


def sanitize(code: str) -> str:
    """Keep the top-level imports, defs, classes and assignments (as evalplus' sanitizer does),
    dropping example calls and `__main__` blocks; unparsable code is returned unchanged."""
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return code
    lines = code.splitlines()
    keep = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef,
            ast.Assign, ast.AnnAssign)  # fmt: skip
    parts = []
    for node in tree.body:
        if isinstance(node, keep):
            start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
            parts.append("\n".join(lines[start - 1 : node.end_lineno]))
    return "\n".join(parts) + "\n"


def _imports(prompt: str) -> str:
    return "".join(ln + "\n" for ln in prompt.splitlines() if re.match(r"(import|from)\s", ln))


def _reprs(v: Verdict) -> list[str] | str:
    """The list of element reprs a chunk job returns, or a failure reason."""
    if not v.ok or v.output is None:
        return f"{v.status.value}: {v.error}" if v.error else v.status.value
    try:
        got = parse(v.output)
    except NotLiteral:
        return "bad harness output"
    return got if isinstance(got, list) and all(isinstance(s, str) for s in got) else "bad output"


def _value(r: str) -> Any:
    try:
        return parse(r)
    except NotLiteral:
        return _Opaque(r)


@dataclass(frozen=True)
class _Opaque:
    """A non-literal result: equal only to the same repr (evalplus compares objects with ==)."""

    text: str


# --- evalplus ------------------------------------------------------------------------------


@dataclass
class Chunk:
    group: str  # "base" | "plus"
    args: list
    expected: list[str]  # reprs from the canonical solution
    seconds: float


_MAX_SRC = 30_000  # characters of test-input source per job (the sandbox refuses > 100k)


def _chunks(inputs: list, group: str, size: int) -> list[tuple[str, list]]:
    """The first base test alone, then runs of at most `size` tests and ~_MAX_SRC characters."""
    out: list[tuple[str, list]] = []
    cur: list = []
    chars = 0
    for k, a in enumerate(inputs):
        n = len(source(a))
        if cur and (len(cur) >= size or chars + n > _MAX_SRC or (group == "base" and k == 1)):
            out.append((group, cur))
            cur, chars = [], 0
        cur.append(a)
        chars += n
    return out + ([(group, cur)] if cur else [])


def _args_source(args: list) -> str:
    src = source(args)
    if len(src) <= _MAX_SRC:
        return src
    packed = zlib.compress(src.encode(), 9)  # a huge input travels compressed
    return f"eval(__import__('zlib').decompress({packed!r}).decode())"


#: Each result as a repr, with three guards (evalplus compares values in memory): a huge int
#: goes as hex (decimal conversion is quadratic), Python's 4300-digit cap is lifted for ints
#: nested in containers, and a repr over 4 KiB becomes a (length, crc32) fingerprint.
_HARNESS = (
    "(getattr(__import__('sys'), 'set_int_max_str_digits', lambda n: None)(0), "
    "[(lambda r: r if len(r) <= 4096 else '#fp:%d:%d' % (len(r), "
    "__import__('zlib').crc32(r.encode('utf-8', 'surrogatepass'))))("
    "(lambda v: hex(v) if type(v) is int and v.bit_length() > 14000 else repr(v))({call})) "
    "for _a in {args}])[1]"
)


def _call_expr(entry: str, args: list) -> str:
    return _HARNESS.format(call=f"{entry}(*_a)", args=_args_source(args))


def ground_truth(problems: list[Problem], pool: Pool, rule: TimeRule) -> dict[str, Any]:
    """problem id -> list[Chunk] (expected outputs and canonical times), or an error string
    when the canonical solution does not run in the sandbox."""
    plan = []
    for p in problems:
        m = p.meta
        for group, args in _chunks(m["base_input"], "base", rule.chunk) + _chunks(
            m["plus_input"], "plus", rule.chunk
        ):
            job = Job(program=m["canonical"], expr=_call_expr(m["entry_point"], args),
                      entry=m["entry_point"])  # fmt: skip
            plan.append((p, group, args, job))
    verdicts = pool.run([(job, rule.cap_s) for *_, job in plan])
    out: dict[str, Any] = {p.id: [] for p in problems}
    for (p, group, args, _), v in zip(plan, verdicts, strict=False):
        got = _reprs(v)
        if isinstance(got, str) or len(got) != len(args):
            out[p.id] = f"canonical solution failed: {got}"
        elif isinstance(out[p.id], list):
            if p.meta["entry_point"] in MBPP_NOT_NONE and p.meta["dataset"] == "mbpp":
                got = [repr(r != "None") for r in got]
            out[p.id].append(Chunk(group, args, got, v.duration))
    return out


def _evalplus_case(p: Problem, code: str, truth: list[Chunk], rule: TimeRule) -> Case:
    m = p.meta
    entry = m["entry_point"]
    program = sanitize(code)
    if m["dataset"] == "humaneval":
        program = _imports(p.question) + program
    not_none = m["dataset"] == "mbpp" and entry in MBPP_NOT_NONE
    oracles = {g: Oracle(m["dataset"], entry, m["atol"]) for g in ("base", "plus")}

    def judge_for(ch: Chunk):  # noqa: ANN202
        def judge(v: Verdict) -> str | None:
            got = _reprs(v)
            if isinstance(got, str):
                return f"{ch.group}: {got}"
            for k, (r, e, a) in enumerate(zip(got, ch.expected, ch.args, strict=False)):
                if not_none:
                    exp = e == "True"
                    out = _value(r)
                    ok = out == exp if isinstance(out, bool) else exp == (r != "None")
                else:
                    ok = oracles[ch.group](_value(r), _value(e), a)
                if not ok:
                    return f"{ch.group}: wrong output on test {k} of a chunk"
            return None

        return judge

    steps = []
    for ch in truth:
        n = len(ch.args)
        limit = min(rule.cap_s, n * max(rule.min_s, rule.factor * ch.seconds / n))
        job = Job(program=program, expr=_call_expr(entry, ch.args), entry=entry)
        steps.append(Step(job, limit, judge_for(ch)))
    return Case(steps)


# --- LiveCodeBench ---------------------------------------------------------------------------

#: A short form of LiveCodeBench's import header, put before functional and stdin solutions
#: alike (the sandbox's benchmark policy makes random, datetime, ... importable).
LCB_HEADER = (
    "from typing import *\nfrom collections import *\nfrom functools import *\n"
    "from itertools import *\nfrom heapq import *\nfrom bisect import *\n"
    "import math, heapq, bisect, itertools, functools, collections, string, re\n"
    "import random, datetime, copy, statistics, operator, io, sys, json\n"
)

_STDIO = '''
import io as _io, sys as _sys, contextlib as _cl
_SRC = {src}
def _run_stdin(_text):
    _out = _io.StringIO()
    _old = _sys.stdin
    _sys.stdin = _io.StringIO(_text)
    try:
        with _cl.redirect_stdout(_out):
            try:
                exec(compile(_SRC, "<solution>", "exec"), {{"__name__": "__main__"}})
            except SystemExit:
                pass
    finally:
        _sys.stdin = _old
    return _out.getvalue()
'''


def _lcb_tuple_to_list(x: Any) -> Any:
    if isinstance(x, list | tuple):
        return [_lcb_tuple_to_list(i) for i in x]
    return x


def stdout_matches(got: str, want: str) -> bool:
    """LiveCodeBench's stdio check: equal stripped lines, else equal numeric tokens."""
    g = [ln.strip() for ln in got.strip().splitlines()]
    w = [ln.strip() for ln in want.strip().splitlines()]
    if g == w:
        return True
    if len(g) != len(w):
        return False
    for a, b in zip(g, w, strict=False):
        ta, tb = a.split(), b.split()
        if len(ta) != len(tb):
            return False
        try:
            if any(Decimal(x) != Decimal(y) for x, y in zip(ta, tb, strict=False)):
                return False
        except InvalidOperation:
            if ta != tb:
                return False
    return True


def _lcb_case(p: Problem, code: str, rule: TimeRule) -> Case:
    tests = p.meta["tests"]
    functional = bool(tests) and tests[0].get("testtype") == "functional"
    size = 10
    steps = []
    for i in range(0, len(tests), size):
        chunk = tests[i : i + size]
        limit = min(rule.cap_s, rule.lcb_s * len(chunk))
        if functional:
            func = p.meta["func_name"]
            args = [[json.loads(a) for a in t["input"].split("\n") if a.strip()] for t in chunk]
            program = LCB_HEADER + sanitize(code)
            job = Job(program=program, entry="Solution",
                      expr=_HARNESS.format(call=f"Solution().{func}(*_a)", args=_args_source(args)))
            wants = [json.loads(t["output"]) for t in chunk]
        else:
            program = LCB_HEADER + _STDIO.format(src=repr(LCB_HEADER + code))
            job = Job(program=program, entry="_run_stdin",
                      expr=f"[_run_stdin(_t) for _t in {source([t['input'] for t in chunk])}]")
            wants = [t["output"] for t in chunk]

        def judge(v: Verdict, wants: list = wants, fn: bool = functional) -> str | None:
            if fn:
                got = _reprs(v)
                if isinstance(got, str):
                    return got
                pairs = [(_lcb_tuple_to_list(_value(r)), _lcb_tuple_to_list(w))
                         for r, w in zip(got, wants, strict=False)]  # fmt: skip
                return None if all(a == b for a, b in pairs) else "wrong output"
            if not v.ok or v.output is None:
                return f"{v.status.value}: {v.error}"
            outs = _value(v.output)
            if not isinstance(outs, list):
                return "bad output"
            ok = all(isinstance(o, str) and stdout_matches(o, w) for o, w in zip(outs, wants, strict=False))
            return None if ok else "wrong output"

        steps.append(Step(job, limit, judge))
    return Case(steps)


# --- CRUXEval --------------------------------------------------------------------------------


def crux_prediction(text: str, mode: str) -> str | None:
    """The predicted output (mode "o") or input ("i") as Python source, or None."""
    tail = text.split("</think>")[-1]
    span = answer_span(tail) or tail
    tag = "output" if mode == "o" else "input"
    blocks = [b for lang, b in fenced_blocks(span) if lang in (tag, "python", "")]
    m = re.search(r"\[ANSWER\](.*?)\[/ANSWER\]", span, re.S)
    pred = (blocks[-1] if blocks else m.group(1) if m else span).strip()
    if pred.startswith("assert "):  # "assert f(x) == y"
        lhs, _, rhs = pred[7:].partition("==")
        pred = rhs if mode == "o" else lhs
    pred = pred.strip()
    if mode == "i" and pred.startswith("f(") and pred.endswith(")"):
        pred = pred[2:-1]
    try:
        if mode == "o":
            ast.parse(pred, mode="eval")
        else:  # arguments only: `1) or f(2` must not smuggle an expression in
            call = ast.parse(f"f({pred})", mode="eval").body
            if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)):
                return None
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    return pred or None


def _crux_case(p: Problem, text: str, rule: TimeRule) -> Case:
    mode = p.kind[-1]
    pred = crux_prediction(text, mode)
    if pred is None:
        return Case([], passed=False, reason="no parsable prediction")
    inp, out = (p.meta["input"], pred) if mode == "o" else (pred, p.meta["output"])
    job = Job(program=p.question, expr=f"f({inp}) == ({out})", entry="f")

    def judge(v: Verdict) -> str | None:
        if not v.ok:
            return f"{v.status.value}: {v.error}"
        return None if v.output == "True" else "wrong prediction"

    return Case([Step(job, rule.min_s, judge)])


# --- entry point -----------------------------------------------------------------------------


def score(
    items: list[tuple[Problem, str]], pool: Pool, rule: TimeRule = TimeRule(),
    truth: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:  # fmt: skip
    """Score (problem, completion) pairs of code/crux problems; one result dict per pair
    (`passed`, `reason`, `code`). Identical programs of one problem are run once."""
    evalplus = {p.id: p for p, _ in items if p.kind == "code"}
    if truth is None:
        truth = ground_truth(list(evalplus.values()), pool, rule) if evalplus else {}
    cases: dict[tuple[str, str, str], Case] = {}
    keys = []
    for p, text in items:
        code = text if p.kind.startswith("crux") else code_block(text, p.meta.get("entry_point"))
        key = (p.bench, p.id, code)
        keys.append(key)
        if key in cases:
            continue
        if p.kind == "code":
            t = truth[p.id]
            cases[key] = (Case([], passed=False, reason=t) if isinstance(t, str)
                          else _evalplus_case(p, code, t, rule))  # fmt: skip
        elif p.kind == "lcb":
            cases[key] = _lcb_case(p, code, rule)
        else:
            cases[key] = _crux_case(p, code, rule)
    pool.run_cases(list(cases.values()))
    return [
        {"passed": bool(cases[k].passed), "reason": cases[k].reason,
         "code": k[2] if not k[0].startswith("cruxeval") else None}
        for k in keys
    ]  # fmt: skip
