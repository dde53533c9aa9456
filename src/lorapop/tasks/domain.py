"""A world's rules on proposals: the values a task's inputs and outputs may take, live code.

A teacher free to pick any input finds difficulty in the values rather than in the program:
the tiny world's single agent, its programs down to one line, kept half its tasks unsolved with
two-digit products and character counts over 7-letter strings (experiments/regime/README.md).
Where a world bounds its inputs, a proposal whose input leaves the bounds is invalid, so
difficulty has to come from the program. The check reads the input's syntax tree: only stated
values are inside (`'ab' * 9` computes, so it is outside), and nothing runs. The same bounds
can hold the outputs (products of small inputs grow past what a small student computes), a
world can ask for live code (`lorapop.tasks.liveness`), and it can leave calls out (a tiny
student that never learns to count characters makes every `s.count('y')` task hard).
"""

from __future__ import annotations

import ast
import math
from dataclasses import dataclass

from lorapop.tasks.liveness import dead_statement
from lorapop.tasks.metrics import called_names

OUTSIDE_COMPUTED = "input computes a value instead of stating it"


@dataclass(frozen=True)
class InputDomain:
    """Values inside: numbers in [int_min, int_max], strings of at most `str_chars` characters,
    containers of at most `items` items, nested alike; True, False and None. (Named for its
    first use; `WorldRules.outputs` bounds outputs with it too.)"""

    int_min: int
    int_max: int
    str_chars: int
    items: int

    def __post_init__(self) -> None:
        if self.int_min > self.int_max or self.str_chars < 0 or self.items < 0:
            raise ValueError("input domain: need int_min <= int_max, str_chars >= 0, items >= 0")

    def problem(self, args: str) -> str | None:
        """Why the argument list `args` (the text inside `f(...)`, or one value's repr) leaves
        the domain, or None."""
        try:
            call = ast.parse(f"f({args})", mode="eval").body
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            return "input is not an argument list"
        if not isinstance(call, ast.Call):
            return "input is not an argument list"
        if any(isinstance(v, ast.Starred) for v in call.args) or any(
            k.arg is None for k in call.keywords
        ):
            return OUTSIDE_COMPUTED
        try:
            return self._all_problem([*call.args, *(k.value for k in call.keywords)])
        except RecursionError:
            return "input nests too deeply"

    def _value_problem(self, node: ast.expr) -> str | None:
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            inner = node.operand
            if isinstance(inner, ast.Constant) and _is_number(inner.value):
                sign = -1 if isinstance(node.op, ast.USub) else 1
                return self._number_problem(sign * inner.value)
            return OUTSIDE_COMPUTED
        if isinstance(node, ast.Constant):
            v = node.value
            if v is None or isinstance(v, bool):
                return None
            if _is_number(v):
                return self._number_problem(v)
            if isinstance(v, (str, bytes)):
                if len(v) > self.str_chars:
                    return f"a string of {len(v)} characters (at most {self.str_chars})"
                return None
            return f"a value of type {type(v).__name__}"
        if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
            return self._items_problem(len(node.elts)) or self._all_problem(node.elts)
        if isinstance(node, ast.Dict):
            if any(k is None for k in node.keys):  # {**other}
                return OUTSIDE_COMPUTED
            return self._items_problem(len(node.keys)) or self._all_problem([*node.keys, *node.values])
        return OUTSIDE_COMPUTED

    def _number_problem(self, v: int | float) -> str | None:
        if isinstance(v, float) and not math.isfinite(v):
            return "a number that is not finite"
        if not self.int_min <= v <= self.int_max:
            return f"the number {v} (outside {self.int_min}..{self.int_max})"
        return None

    def _items_problem(self, n: int) -> str | None:
        return f"a container of {n} items (at most {self.items})" if n > self.items else None

    def _all_problem(self, nodes: list) -> str | None:
        """The first problem among `nodes`, or None."""
        return next((why for x in nodes if (why := self._value_problem(x))), None)


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass(frozen=True)
class WorldRules:
    """What a world asks of a proposal beyond running: its inputs and its outputs inside
    bounds (None: any), its program free of dead statements and of calls the world leaves out
    (`banned_calls`: function or method names). Each broken rule makes the proposal invalid
    with the reason, never a format error."""

    inputs: InputDomain | None = None
    outputs: InputDomain | None = None
    live_code: bool = False
    banned_calls: tuple[str, ...] = ()

    def input_problem(self, k: int, args: str) -> str | None:
        if self.inputs and (why := self.inputs.problem(args)):
            return f"input {k} outside the world's input domain: {why}"
        return None

    def output_problem(self, output: str) -> str | None:
        if self.outputs and (why := self.outputs.problem(output)):
            return f"output outside the world's output domain: {why}"
        return None

    def program_problem(self, program: str) -> str | None:
        if self.live_code and (why := dead_statement(program)):
            return f"dead code: {why}"
        return self.call_problem(program)

    def call_problem(self, program: str) -> str | None:
        """A call of a banned name (`len(s)`, `s.count(c)`), read from the syntax tree; None
        for a program that does not parse (running it reports that)."""
        hit = sorted(called_names(program).intersection(self.banned_calls)) if self.banned_calls else []
        return f"calls {hit[0]}(), which the world leaves out" if hit else None
