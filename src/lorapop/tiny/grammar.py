"""A hand-written grammar of small, deterministic Python functions `f` and of inputs for them.

The tiny world needs programs whose difficulty we control: a warm-start corpus, a held-out
benchmark at five levels, and a static curriculum to compare self-play against. Programs are
built from a typed grammar (int, str, list of int, dict of str to int) so that they are safe
by construction, not by luck:

- no imports, no sets, no `hash()`/`id()`: the result cannot depend on hash seeds;
- loops run over `range` of a literal or a length, over a sequence that the loop body may not
  mutate in place, or halve a non-negative counter, so every loop ends;
- inside a loop, strings and lists grow by at most a small piece per step (no `s = s + s`),
  integers are multiplied only by small literals, so values stay small and fast to compute;
- list and dict assignments copy (`xs[:]`, `dict(d)`), so no alias lets a loop feed itself;
- indexing, `max`, `min`, division are guarded (`if xs else`, `default=0`, literal divisors).

Everything draws from one `random.Random`; the same seed gives the same program.
"""

from __future__ import annotations

import ast
import random
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

from lorapop.tasks.domain import InputDomain, WorldRules
from lorapop.tasks.liveness import drop_dead

INT, STR, LIST, DICT = "int", "str", "list", "dict"
TYPES = (INT, STR, LIST, DICT)

_NAMES = {
    INT: ["n", "k", "total", "count", "acc", "m", "best", "step", "val", "num"],
    STR: ["s", "word", "text", "out", "res", "tag", "buf", "part"],
    LIST: ["nums", "xs", "items", "vals", "seq", "arr", "keep", "stack"],
    DICT: ["d", "counts", "table", "seen", "freq", "memo"],
}
_LOOP_NAMES = {INT: ["i", "j", "x", "y", "v", "e"], STR: ["c", "ch", "key", "w"]}
_HELPER_NAMES = ["g", "h"]
ALPHABET = "abcdexyz"
_WORDS = ["ab", "abc", "xyz", "hello", "cab", "dad", "zed", "bee", "ace", "exa"]
_CMP = [">", "<", ">=", "<=", "==", "!="]


# one-step conversions between types, used where an expression needs a type no variable has
_CONVERT = {
    INT: {STR: ["str({v})"], LIST: ["[{v}]", "list(range({v} % 5))"], DICT: ["{{{c}: {v}}}"]},
    STR: {INT: ["len({v})", "{v}.count({c})"], LIST: ["[len({v})]", "[{v}.count({c})]"],
          DICT: ["{{ch: {v}.count(ch) for ch in {v}}}"]},
    LIST: {INT: ["len({v})", "sum({v})"], STR: ["''.join(map(str, {v}))"],
           DICT: ["dict(zip('abcde', {v}))"]},
    DICT: {INT: ["len({v})", "sum({v}.values())"], STR: ["''.join(sorted({v}))"],
           LIST: ["sorted({v}.values())"]},
}  # fmt: skip


@dataclass(frozen=True)
class Knobs:
    """Grammar settings; `LEVELS` maps difficulty 1..5 to a setting of these."""

    statements: int = 3  # statements in f's body, nested ones included, the final return not
    depth: int = 1  # deepest nesting of if / for / while blocks
    params: int = 1  # arguments of f
    types: tuple[str, ...] = (INT, STR)  # value types in play
    loops: bool = False
    conditionals: bool = True
    helpers: int = 0  # helper functions defined before f and called by it
    expr_depth: int = 2  # deepest nesting of an expression

    def __post_init__(self) -> None:
        if self.statements < 0 or self.depth < 0 or self.expr_depth < 1:
            raise ValueError("statements and depth must be >= 0 and expr_depth >= 1")
        if not 1 <= self.params <= 4:
            raise ValueError(f"params must be in 1..4, got {self.params}")
        if not self.types or any(t not in TYPES for t in self.types):
            raise ValueError(f"types must be a non-empty subset of {TYPES}, got {self.types}")
        if not 0 <= self.helpers <= len(_HELPER_NAMES):
            raise ValueError(f"helpers must be in 0..{len(_HELPER_NAMES)}, got {self.helpers}")


LEVELS: dict[int, Knobs] = {
    1: Knobs(statements=1, depth=0, params=1, types=(INT, STR), loops=False,
             conditionals=False, helpers=0, expr_depth=1),
    2: Knobs(statements=3, depth=1, params=1, types=(INT, STR, LIST), loops=False,
             conditionals=True, helpers=0, expr_depth=2),
    3: Knobs(statements=5, depth=1, params=2, types=(INT, STR, LIST), loops=True,
             conditionals=True, helpers=0, expr_depth=2),
    4: Knobs(statements=8, depth=2, params=2, types=TYPES, loops=True,
             conditionals=True, helpers=1, expr_depth=2),
    5: Knobs(statements=12, depth=3, params=3, types=TYPES, loops=True,
             conditionals=True, helpers=2, expr_depth=3),
}  # fmt: skip


#: The regime world's levels: levels 1-3 are `LEVELS`' own; 4 and 5 stay close to 3
#: (6 and 7 statements, nesting 2 and 3, dicts at 5, no helpers: the world's variants bring
#: those), ~250 and ~350 characters where `LEVELS`' are ~500 and ~1000, so a 26M model can
#: write a valid program at every level (one bad token of ~330 sinks a level-5 proposal).
#: `LEVELS` stays as it is: the shipped tiny model and the held-out benchmark are built on it.
WORLD_LEVELS: dict[int, Knobs] = {
    **{lv: LEVELS[lv] for lv in (1, 2, 3)},
    4: Knobs(statements=6, depth=2, params=2, types=(INT, STR, LIST), loops=True,
             conditionals=True, helpers=0, expr_depth=2),
    5: Knobs(statements=7, depth=3, params=2, types=TYPES, loops=True,
             conditionals=True, helpers=0, expr_depth=2),
}  # fmt: skip
#: A shorter regime world: every level short enough for a 26M model to write at
#: temperature 1 and to execute. Level 1 is `LEVELS`' own; then one statement more a level
#: (2..5), conditionals from 2, loops and lists from 3, two arguments and nested expressions
#: from 4, nesting 2 at 5; no dicts or helpers (variants bring helpers). ~60, 85, 120, 185 and
#: 220 characters (`WORLD_LEVELS`: 60, 155, 220, 255, 350), cyclomatic 1.0 / 1.3 / 2.1 / 3.0 /
#: 3.8, so the complexity of proposals still rises with the level.
SHORT_LEVELS: dict[int, Knobs] = {
    1: LEVELS[1],
    2: Knobs(statements=2, depth=1, params=1, types=(INT, STR), loops=False,
             conditionals=True, helpers=0, expr_depth=1),
    3: Knobs(statements=3, depth=1, params=1, types=(INT, STR, LIST), loops=True,
             conditionals=True, helpers=0, expr_depth=1),
    4: Knobs(statements=4, depth=1, params=2, types=(INT, STR, LIST), loops=True,
             conditionals=True, helpers=0, expr_depth=2),
    5: Knobs(statements=5, depth=2, params=2, types=(INT, STR, LIST), loops=True,
             conditionals=True, helpers=0, expr_depth=2),
}  # fmt: skip
#: Level 1 of single `return` expressions (`return n + 7`, `return len(s) + 5`, `return
#: s[1:].upper()`), then `short`'s levels 1-4 one level up. On `natural` the single
#: agent's teacher settled on such one-liners, which were ~1% of its base's level-1 programs
#: (`return n + 7` on 3 was answered 11 and 12; seed 0's student got 51% of 1,952 such answers
#: right after 250 steps); here they are a fifth of the corpus, so the base's student learns them
#: before self-play. Expressions nest two deep: one deep has only ~3.5k distinct programs (after
#: renaming), too few for a 24k-program level.
DIRECT_LEVELS: dict[int, Knobs] = {
    1: Knobs(statements=0, depth=0, params=1, types=(INT, STR), loops=False,
             conditionals=False, helpers=0, expr_depth=2),
    **{lv + 1: SHORT_LEVELS[lv] for lv in (1, 2, 3, 4)},
}  # fmt: skip
#: Level tables by name (`Recipe.levels`, `tiny_world.py --level-table`). `narrow` is `short`'s
#: programs on bounded inputs, `live` those programs without their dead statements, `natural`
#: those on non-negative values, `direct` `natural`'s rules on `DIRECT_LEVELS`, `nocount` those
#: without `count` calls, `nojoin` also without `join`: the tables differ in their world rules
#: (`TABLE_RULES`), which the generators keep.
LEVEL_TABLES: dict[str, dict[int, Knobs]] = {
    "standard": LEVELS, "world": WORLD_LEVELS, "short": SHORT_LEVELS, "narrow": SHORT_LEVELS,
    "live": SHORT_LEVELS, "natural": SHORT_LEVELS, "direct": DIRECT_LEVELS,
    "nocount": DIRECT_LEVELS, "nojoin": DIRECT_LEVELS,
}  # fmt: skip
_SMALL = InputDomain(int_min=-5, int_max=9, str_chars=4, items=4)
#: The rules of a level table's world (`tasks.input_domain`, `tasks.output_domain`,
#: `tasks.live_code`): its corpus, held-out and seed tasks draw inputs inside `inputs`, and the
#: loop makes a proposal that breaks a rule invalid. Each closes a way the single agent found to
#: make tasks hard without making programs complex (experiments/regime/README.md). On `short` it used
#: the values (two-digit products, counts over 7-letter strings), so `narrow` keeps inputs small.
#: On `narrow` it padded one-line programs with `x = x` chains and values never read, and
#: multiplied small inputs into large outputs, so `live` also drops dead statements from its
#: programs (so does its corpus), asks for live code and bounds outputs (95% of its programs'
#: outputs fall inside: ints -9..19, 8 characters, 8 items). On `live` many of its unsolved
#: tasks did arithmetic through negative values (`(n - 3) // 3` on -4, `x - 6` on -2), so
#: `natural` keeps inputs and outputs non-negative (its programs are `live`'s: same stream).
#: On `direct` (two seeds) 69-86% of its unsolved code_o tasks
#: counted characters (`s.count('y') + len(s)` on 'yybd'), which its students did not learn, so
#: `nocount` is `direct` without `count` calls: `direct`'s stream less the programs that call it. On
#: `nocount` the seed whose solve rate fell had 91-96% of its unsolved code_o and
#: code_i tasks on `''.join(map(str, xs))`, so `nojoin` also leaves `join` out.
_NATURAL = WorldRules(inputs=InputDomain(0, 9, 4, 4), outputs=InputDomain(0, 19, 8, 8),
                      live_code=True)
TABLE_RULES: dict[str, WorldRules] = {
    "narrow": WorldRules(inputs=_SMALL),
    "live": WorldRules(inputs=_SMALL, outputs=InputDomain(-9, 19, 8, 8), live_code=True),
    "natural": _NATURAL, "direct": _NATURAL,
    "nocount": replace(_NATURAL, banned_calls=("count",)),
    "nojoin": replace(_NATURAL, banned_calls=("count", "join")),
}


@dataclass(frozen=True)
class Level:
    """Level `number` of a table other than `LEVELS`: generated with `knobs`, labelled `number`,
    its tasks kept to the table's world `rules` (inputs drawn inside its input domain, outputs
    inside its output domain; None: the grammar's own ranges, any output)."""

    number: int
    knobs: Knobs
    rules: WorldRules | None = None


def table_level(number: int, table: str = "standard") -> int | Level:
    """How to ask the generators for level `number` of a level table: the plain number where
    the table's knobs are `LEVELS`' and its inputs unbounded (so the same programs come out),
    else a `Level`."""
    if table not in LEVEL_TABLES:
        raise ValueError(f"unknown level table {table!r}; known: {', '.join(LEVEL_TABLES)}")
    knobs = LEVEL_TABLES[table].get(number)
    if knobs is None:
        raise ValueError(f"level table {table!r} has no level {number!r}")
    rules = TABLE_RULES.get(table)
    return number if LEVELS.get(number) == knobs and not rules else Level(number, knobs, rules)


def level_rules(difficulty: int | Knobs | Level) -> WorldRules:
    """The world rules a level's tasks keep (none for plain levels and bare knobs)."""
    return (difficulty.rules if isinstance(difficulty, Level) else None) or WorldRules()


def _kept(source: str, difficulty: int | Knobs | Level) -> str:
    """`source` as the level's world keeps it: without dead statements where it asks for live
    code."""
    return drop_dead(source) if level_rules(difficulty).live_code else source


def table_levels(
    table: str = "standard", numbers: Iterable[int] = (1, 2, 3, 4, 5)
) -> list[int | Level]:
    """`table_level` of each number."""
    return [table_level(n, table) for n in numbers]


def level_number(difficulty: int | Knobs | Level) -> int | None:
    """The level a program of `difficulty` is labelled with (None for bare knobs)."""
    if isinstance(difficulty, Level):
        return difficulty.number
    return difficulty if isinstance(difficulty, int) else None


def knobs_for(difficulty: int | Knobs | Level) -> Knobs:
    """The grammar settings of a difficulty level 1..5 (or the given settings unchanged)."""
    if isinstance(difficulty, Knobs):
        return difficulty
    if isinstance(difficulty, Level):
        return difficulty.knobs
    if difficulty not in LEVELS:
        raise ValueError(f"difficulty must be one of {sorted(LEVELS)}, got {difficulty!r}")
    return LEVELS[difficulty]


@dataclass(frozen=True)
class Program:
    """A generated program: its source and the types of f's parameters and result."""

    source: str
    params: tuple[tuple[str, str], ...]  # (name, type) of each argument of f
    returns: str
    features: tuple[str, ...]  # constructs used: "loop", "while", "if", "helper"


@dataclass
class _Var:
    name: str
    type: str
    locked: bool = False  # no in-place mutation or reassignment (loop variables, iterated seqs)
    uses: int = 0


@dataclass(frozen=True)
class _Helper:
    name: str
    params: tuple[str, ...]  # types
    returns: str


@dataclass
class _Builder:
    """Writes one function body; scopes pop the names a block defined when it ends."""

    rng: random.Random
    knobs: Knobs
    helpers: list[_Helper] = field(default_factory=list)
    is_helper: bool = False
    scopes: list[list[_Var]] = field(default_factory=lambda: [[]])
    lines: list[str] = field(default_factory=list)
    taken: set[str] = field(default_factory=set)
    in_loop: int = 0
    features: set[str] = field(default_factory=set)
    returned: bool = False  # an early `return` fixed the result type

    # ---- environment -------------------------------------------------------------------
    def visible(self, t: str | None = None) -> list[_Var]:
        return [v for scope in self.scopes for v in scope if t is None or v.type == t]

    def fresh(self, t: str, loop: bool = False) -> str:
        pool = _LOOP_NAMES[t] if loop else _NAMES[t]
        free = [n for n in pool if n not in self.taken]
        name = self.rng.choice(free) if free else f"{pool[0]}{len(self.taken)}"
        self.taken.add(name)
        return name

    def declare(self, name: str, t: str, locked: bool = False) -> _Var:
        var = _Var(name, t, locked)
        self.scopes[-1].append(var)
        return var

    def pick_var(self, t: str, mutable: bool = False) -> _Var | None:
        cands = [v for v in self.visible(t) if not (mutable and v.locked)]
        if not cands:
            return None
        var = self.rng.choices(cands, weights=[4 if v.uses == 0 else 1 for v in cands])[0]
        var.uses += 1
        return var

    def has(self, t: str) -> bool:
        return bool(self.visible(t))

    # ---- literals ----------------------------------------------------------------------
    def lit(self, t: str) -> str:
        r = self.rng
        if t == INT:
            return str(r.randint(0, 9) if r.random() < 0.85 else r.randint(-5, -1))
        if t == STR:
            return repr(r.choice(ALPHABET) if r.random() < 0.6 else r.choice(_WORDS))
        if t == LIST:
            return repr([r.randint(-3, 9) for _ in range(r.randint(0, 4))])
        keys = r.sample(ALPHABET[:5], r.randint(0, 3))
        return "{" + ", ".join(f"{k!r}: {r.randint(0, 9)}" for k in keys) + "}"

    def char(self) -> str:
        return repr(self.rng.choice(ALPHABET))

    def swap(self) -> str:
        """Arguments of `str.replace`: a char by another char or by nothing (never longer)."""
        old, new = self.rng.sample(ALPHABET, 2)
        return f"{old!r}, {new!r}" if self.rng.random() < 0.7 else f"{old!r}, ''"

    def arith(self) -> str:
        return f"{self.rng.choice(['+', '-', '*'])} {self.small_int()}"

    def small_int(self) -> str:
        return str(self.rng.randint(2, 5))

    # ---- expressions -------------------------------------------------------------------
    def leaf(self, t: str, fresh: bool = False) -> str:
        var = self.pick_var(t) if self.rng.random() < 0.85 else None
        if var is None and not self.has(t) and self.visible() and self.rng.random() < 0.7:
            src = self.rng.choice(self.visible())
            src.uses += 1
            return self.rng.choice(_CONVERT[src.type][t]).format(v=src.name, c=self.char())
        if var is None:
            return self.lit(t)
        if fresh and t == LIST:
            return f"{var.name}[:]"
        if fresh and t == DICT:
            return f"dict({var.name})"
        return var.name

    def operand(self, t: str, d: int) -> str:
        """An expression safe to use as the operand of an operator or a method call.

        It is rarely a bare literal: `'ab'.upper()` or `(2 % 5)` only add noise."""
        text = self.expr(t, d)
        for _ in range(3):
            if not _is_literal(text):
                break
            text = self.expr(t, d)
        return text if text.replace("_", "").isalnum() or _is_wrapped(text) else f"({text})"

    def int_or_lit(self, d: int) -> str:
        return self.lit(INT) if self.rng.random() < 0.5 else self.operand(INT, d)

    def expr(self, t: str, d: int, fresh: bool = False) -> str:
        """An expression of type `t` with at most `d` levels of nesting."""
        if d <= 0 or self.rng.random() < 0.25:
            return self.leaf(t, fresh)
        prods = self.productions(t, d - 1, fresh)
        return self.rng.choice(prods)()

    def productions(self, t: str, d: int, fresh: bool) -> list[Callable[[], str]]:
        o, h = self.operand, self.has
        loop = self.in_loop > 0
        p: list[Callable[[], str]] = []
        if t == INT:
            p += [
                lambda: f"{o(INT, d)} + {self.int_or_lit(d)}",
                lambda: f"{o(INT, d)} - {self.int_or_lit(d)}",
                lambda: f"{o(INT, d)} * {self.small_int()}",
                lambda: f"{o(INT, d)} // {self.small_int()}",
                lambda: f"{o(INT, d)} % {self.small_int()}",
                lambda: f"abs({self.expr(INT, d)})",
                lambda: f"{self.rng.choice(['max', 'min'])}({self.expr(INT, d)}, {self.lit(INT)})",
            ]
            if h(STR):
                p += [lambda: f"len({self.expr(STR, d)})",
                      lambda: f"{o(STR, d)}.count({self.char()})",
                      lambda: f"{o(STR, d)}.find({self.char()})"]  # fmt: skip
            if h(LIST):
                p += [lambda: f"len({self.expr(LIST, d)})",
                      lambda: f"sum({self.expr(LIST, d)})",
                      lambda: f"{self.rng.choice(['max', 'min'])}({self.expr(LIST, d)}, default=0)",
                      lambda: f"{o(LIST, d)}.count({self.lit(INT)})",
                      self.index_expr]  # fmt: skip
            if h(DICT):
                p += [lambda: f"{o(DICT, d)}.get({self.expr(STR, d)}, 0)",
                      lambda: f"len({self.expr(DICT, d)})",
                      lambda: f"sum({o(DICT, d)}.values())"]  # fmt: skip
        elif t == STR:
            p += [
                lambda: f"{o(STR, d)} + {self.lit(STR)}",
                lambda: f"{o(STR, d)}[::-1]",
                lambda: f"{o(STR, d)}.upper()",
                lambda: f"{o(STR, d)}[:{self.small_int()}]",
                lambda: f"{o(STR, d)}[1:]",
                lambda: f"{o(STR, d)}.replace({self.swap()})",
                lambda: f"''.join(sorted({self.expr(STR, d)}))",
            ]
            if h(INT):
                p.append(lambda: f"str({self.expr(INT, d)})")
            if not loop:  # growth by a multiple only outside loops
                p += [lambda: f"{o(STR, d)} + {o(STR, d)}",
                      lambda: f"{o(STR, d)} * {self.rng.randint(2, 3)}"]  # fmt: skip
            if h(LIST):
                p.append(
                    lambda: (
                        f"{self.rng.choice(['-', ',', ''])!r}.join(map(str, {self.expr(LIST, d)}))"
                    )
                )
            if h(DICT):
                p.append(lambda: f"''.join(sorted({self.expr(DICT, d)}))")
        elif t == LIST:
            x = self.fresh_comp()
            p += [
                lambda: f"sorted({self.expr(LIST, d)})",
                lambda: f"{o(LIST, d)}[::-1]",
                lambda: f"[{x} {self.arith()} for {x} in {o(LIST, d)}]",
                lambda: (
                    f"[{x} for {x} in {o(LIST, d)} if {x} {self.rng.choice(_CMP)} {self.lit(INT)}]"
                ),
                lambda: f"{o(LIST, d)}[:{self.small_int()}]",
                lambda: f"{o(LIST, d)} + [{self.expr(INT, d)}]",
                lambda: f"list(range({self.small_int()}))",
            ]
            if not loop:
                p.append(lambda: f"{o(LIST, d)} + {o(LIST, d)}")
            if h(STR):
                c = self.fresh_comp("c")
                p.append(lambda: f"[{o(STR, d)}.count({c}) for {c} in {self.lit(STR)}]")
            if h(DICT):
                p.append(lambda: f"sorted({o(DICT, d)}.values())")
        else:  # DICT
            c = self.fresh_comp("c")
            p += [
                lambda: f"{{{c}: {o(STR, d)}.count({c}) for {c} in {o(STR, d)}}}",
                lambda: f"dict(zip({self.expr(STR, d)}, {self.expr(LIST, d)}))",
            ]
            if h(DICT):
                k, v = self.fresh_comp("k"), self.fresh_comp("v")
                p.append(
                    lambda: (
                        f"{{{k}: {v} * {self.small_int()} for {k}, {v} in {o(DICT, d)}.items()}}"
                    )
                )
        p += [lambda: self.helper_call(t, d)] * 2 if self.helpers_returning(t) else []
        if d >= 1 and self.knobs.conditionals:
            p.append(
                lambda: f"{self.expr(t, d, fresh)} if {self.cond(d)} else {self.expr(t, d, fresh)}"
            )
        return p

    def rooted(self, make: Callable[[], str]) -> str:
        """`make()` retried until its text reads a variable: constant expressions are dull."""
        names = {v.name for v in self.visible()}
        text = make()
        for _ in range(12):
            if _names(text) & names:
                break
            text = make()
        return text

    def fresh_comp(self, base: str = "x") -> str:
        """A comprehension variable that shadows nothing in scope."""
        names = {v.name for v in self.visible()}
        for cand in [base, base + "2", base + "3", "q", "z", "u"]:
            if cand not in names and cand not in _HELPER_NAMES:
                return cand
        return "z9"

    def index_expr(self) -> str:
        xs = self.pick_var(LIST)
        assert xs is not None
        return f"({xs.name}[{self.operand(INT, 0)} % len({xs.name})] if {xs.name} else 0)"

    def helpers_returning(self, t: str) -> list[_Helper]:
        return [hp for hp in self.helpers if hp.returns == t]

    def helper_call(self, t: str, d: int) -> str:
        hp = self.rng.choice(self.helpers_returning(t))
        self.features.add("helper")
        return f"{hp.name}({', '.join(self.expr(a, d) for a in hp.params)})"

    def cond(self, d: int) -> str:
        o, h, r = self.operand, self.has, self.rng
        p: list[Callable[[], str]] = [
            lambda: f"{o(INT, d)} {r.choice(_CMP)} {self.int_or_lit(d)}",
            lambda: f"{o(INT, d)} % 2 == {r.randint(0, 1)}",
        ]
        if h(STR):
            p += [
                lambda: f"{self.char()} in {o(STR, d)}",
                lambda: f"{o(STR, d)}.startswith({self.char()})",
                lambda: f"len({self.expr(STR, d)}) {r.choice(_CMP)} {self.small_int()}",
            ]
        if h(LIST):
            p += [
                lambda: f"{self.int_or_lit(d)} in {o(LIST, d)}",
                lambda: f"len({self.expr(LIST, d)}) {r.choice(_CMP)} {self.small_int()}",
            ]
        if h(DICT):
            p.append(lambda: f"{o(STR, d)} in {o(DICT, d)}")
        if d >= 1:
            p += [lambda: f"{self.cond(d - 1)} {r.choice(['and', 'or'])} {self.cond(d - 1)}",
                  lambda: f"not {self.cond(d - 1)}"]  # fmt: skip
        return r.choice(p)()

    # ---- statements --------------------------------------------------------------------
    def emit(self, indent: int, text: str) -> None:
        self.lines.append("    " * indent + text)

    def block(self, budget: int, depth: int, indent: int, ret: str) -> None:
        """Write about `budget` statements at `indent`; blocks nest at most `depth` deeper."""
        while budget > 0:
            budget -= self.statement(budget, depth, indent, ret)

    def statement(self, budget: int, depth: int, indent: int, ret: str) -> int:
        """Write one statement (with its body, if any); return the statements it used."""
        k, r = self.knobs, self.rng
        kinds = ["assign"] * 3 + ["update"] * 2
        if budget >= 2 and depth > 0:
            kinds += ["if"] * 2 * k.conditionals + ["for"] * 2 * k.loops
            if budget >= 3 and INT in k.types and k.loops:
                kinds.append("while")
        kind = r.choice(kinds)
        if kind == "if":
            return self.if_stmt(budget, depth, indent, ret)
        if kind == "for":
            return self.for_stmt(budget, depth, indent, ret)
        if kind == "while":
            return self.while_stmt(budget, depth, indent, ret)
        if kind == "update" and self.update(indent):
            return 1
        self.assign(indent)
        return 1

    def assign(self, indent: int) -> None:
        mutable = [v for v in self.visible() if not v.locked and v.type in self.knobs.types]
        if mutable and (len(self.visible()) >= 6 or self.rng.random() < 0.3):
            var = self.rng.choice(mutable)
            copies = {var.name, f"{var.name}[:]", f"dict({var.name})"}
            text = self.rooted(lambda: self.expr(var.type, self.knobs.expr_depth, True))
            if text not in copies:
                self.emit(indent, f"{var.name} = {text}")
                return
        t = self.rng.choice(self.knobs.types)
        text = self.rooted(lambda: self.expr(t, self.knobs.expr_depth, True))
        self.emit(indent, f"{self.declare(self.fresh(t), t).name} = {text}")

    def update(self, indent: int) -> bool:
        """An in-place change of an existing variable; False when none can change."""
        var = self.pick_var(self.rng.choice(self.knobs.types), mutable=True)
        if var is None:
            return False
        d, r, n = max(1, self.knobs.expr_depth - 1), self.rng, var.name
        if var.type == INT:
            op = r.choice(["+=", "-=", "+=", "*="])
            rhs = self.small_int() if op == "*=" else self.rooted(lambda: self.expr(INT, d))
            self.emit(indent, f"{n} {op} {rhs}")
        elif var.type == STR:
            # in a loop only pieces that do not grow (literals, loop chars, iterated strings)
            others = [v for v in self.visible(STR) if v.name != n]
            pieces = [self.lit(STR)] + [v.name for v in others if v.locked or not self.in_loop]
            if self.has(INT):
                pieces.append(f"str({self.leaf(INT)})")
            self.emit(indent, f"{n} += {r.choice(pieces)}")
        elif var.type == LIST:
            choice = r.choice(["append", "append", "sort", "reverse"])
            arg = self.expr(INT, d) if choice == "append" else ""
            self.emit(indent, f"{n}.{choice}({arg})")
        else:
            key = self.expr(STR, d)
            if r.random() < 0.5:
                self.emit(indent, f"{n}[{key}] = {n}.get({key}, 0) + {self.int_or_lit(d - 1)}")
            else:
                self.emit(indent, f"{n}[{key}] = {self.expr(INT, d)}")
        return True

    def body(self, budget: int, depth: int, indent: int, ret: str, can_return: bool) -> None:
        self.scopes.append([])
        self.block(budget, depth, indent, ret)
        if can_return and not self.is_helper and self.rng.random() < 0.15:
            self.emit(indent, f"return {self.rooted(lambda: self.expr(ret, 1))}")
            self.returned = True
        self.scopes.pop()

    def if_stmt(self, budget: int, depth: int, indent: int, ret: str) -> int:
        self.features.add("if")
        inner = budget - 1
        then = self.rng.randint(1, inner) if inner > 1 else 1
        self.emit(indent, f"if {self.rooted(lambda: self.cond(self.knobs.expr_depth - 1))}:")
        self.body(then, depth - 1, indent + 1, ret, True)
        rest = inner - then
        if rest > 0 and self.rng.random() < 0.6:
            els = self.rng.randint(1, rest)
            self.emit(indent, "else:")
            self.body(els, depth - 1, indent + 1, ret, True)
            return 1 + then + els
        return 1 + then

    def for_stmt(self, budget: int, depth: int, indent: int, ret: str) -> int:
        self.features.add("loop")
        r = self.rng
        heads: list[tuple[str, list[tuple[str, str]], _Var | None]] = []
        i = self.fresh(INT, loop=True)
        bound = self.small_int()
        seqs = self.visible(STR) + self.visible(LIST)
        if seqs and r.random() < 0.5:
            bound = f"len({r.choice(seqs).name})"
        heads.append((f"for {i} in range({bound}):", [(i, INT)], None))
        if xs := self.pick_var(LIST):
            x = self.fresh(INT, loop=True)
            heads.append((f"for {x} in {xs.name}:", [(x, INT)], xs))
            heads.append((f"for {i}, {x} in enumerate({xs.name}):", [(i, INT), (x, INT)], xs))
        if s := self.pick_var(STR):
            c = self.fresh(STR, loop=True)
            heads.append((f"for {c} in {s.name}:", [(c, STR)], s))
        if d := self.pick_var(DICT):
            key, v = self.fresh(STR, loop=True), self.fresh(INT, loop=True)
            heads.append((f"for {key}, {v} in {d.name}.items():", [(key, STR), (v, INT)], d))
            heads.append((f"for {key} in sorted({d.name}):", [(key, STR)], d))
        head, loop_vars, seq = r.choice(heads)
        self.emit(indent, head)
        self.scopes.append([])
        for name, t in loop_vars:
            self.declare(name, t, locked=True)
        was_locked = seq.locked if seq else False
        if seq:
            seq.locked = True
        inner = r.randint(1, budget - 1)
        self.in_loop += 1
        self.body(inner, depth - 1, indent + 1, ret, False)
        self.in_loop -= 1
        if seq:
            seq.locked = was_locked
        self.scopes.pop()
        return 1 + inner

    def while_stmt(self, budget: int, depth: int, indent: int, ret: str) -> int:
        """`j = abs(e)` then `while j > 0: ...; j //= k`: halving ends the loop."""
        self.features.add("while")
        j = self.fresh(INT)
        self.emit(indent, f"{j} = abs({self.rooted(lambda: self.expr(INT, 1))})")
        var = self.declare(j, INT, locked=True)
        self.emit(indent, f"while {j} > 0:")
        inner = self.rng.randint(0, budget - 3)
        self.scopes.append([])
        self.in_loop += 1
        self.block(inner, depth - 1, indent + 1, ret)
        self.in_loop -= 1
        self.scopes.pop()
        self.emit(indent + 1, f"{j} //= {self.rng.choice([2, 3, 10])}")
        var.locked = False
        return 3 + inner


def _names(text: str) -> set[str]:
    """The names an expression reads."""
    return {n.id for n in ast.walk(ast.parse(text, mode="eval")) if isinstance(n, ast.Name)}


def _is_literal(text: str) -> bool:
    try:
        ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError):
        return False
    return True


def _is_wrapped(text: str) -> bool:
    """True when `text` is one call, subscript or bracketed literal (safe as an operand)."""
    text = re.sub(r"'[^']*'", "''", text)  # our string literals hold no quotes or escapes
    depth = 0
    for i, ch in enumerate(text):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif depth == 0 and ch in " +-*/%<>=!":
            return False
        if depth == 0 and ch in ")]}" and i < len(text) - 1 and text[i + 1] not in "([.":
            return False
    return True


def _signature(name: str, params: list[tuple[str, str]]) -> str:
    return f"def {name}({', '.join(f'{p}: {t}' for p, t in params)}):"


def _function(
    rng: random.Random,
    knobs: Knobs,
    name: str,
    params: list[tuple[str, str]],
    helpers: list[_Helper],
    is_helper: bool,
) -> tuple[list[str], str, set[str]]:
    """Lines of one function, its return type and the constructs it used."""
    b = _Builder(rng, knobs, helpers=helpers, is_helper=is_helper)
    b.taken.update(p for p, _ in params)
    b.taken.update(_HELPER_NAMES)
    for p, t in params:
        b.declare(p, t, locked=is_helper and t in (LIST, DICT))  # helpers never mutate args
    ret = rng.choice(knobs.types)
    for hp in helpers:  # every helper gets called at least once
        args = b.rooted(lambda hp=hp: ", ".join(b.expr(a, 1) for a in hp.params))
        b.emit(1, f"{b.declare(b.fresh(hp.returns), hp.returns).name} = {hp.name}({args})")
        b.features.add("helper")
    b.block(max(0, knobs.statements - len(helpers)), knobs.depth, 1, ret)
    recent = [v for v in b.visible() if v.type in knobs.types and v.uses == 0]
    if recent and not b.returned and rng.random() < 0.7:
        ret = recent[-1].type
    b.emit(1, f"return {b.rooted(lambda: b.expr(ret, knobs.expr_depth))}")
    return [_signature(name, params), *b.lines], ret, b.features


def generate_program(rng: random.Random, difficulty: int | Knobs | Level) -> Program:
    """One random program at a difficulty level (1..5) or with explicit grammar settings."""
    knobs = knobs_for(difficulty)
    helpers: list[_Helper] = []
    lines: list[str] = []
    for name in _HELPER_NAMES[: knobs.helpers]:
        hk = Knobs(
            statements=max(1, knobs.statements // 4),
            depth=min(1, knobs.depth),
            params=1,
            types=knobs.types,
            loops=knobs.loops,
            conditionals=knobs.conditionals,
            expr_depth=max(1, knobs.expr_depth - 1),
        )
        ptypes = [rng.choice(knobs.types) for _ in range(rng.randint(1, 2))]
        params = _param_names(rng, ptypes)
        body, ret, _ = _function(rng, hk, name, params, [], is_helper=True)
        helpers.append(_Helper(name, tuple(ptypes), ret))
        lines += [*body, ""]
    ptypes = [rng.choice(knobs.types) for _ in range(knobs.params)]
    params = _param_names(rng, ptypes)
    body, ret, features = _function(rng, knobs, "f", params, helpers, is_helper=False)
    lines += body
    return Program(
        source=_kept("\n".join(lines) + "\n", difficulty),
        params=tuple(params),
        returns=ret,
        features=tuple(sorted(features)),
    )


def extend_program(
    rng: random.Random, source: str, returns: str, difficulty: int | Knobs | Level
) -> Program:
    """A harder program built on `source`: its `f` becomes the helper `g`, and a new `f` with
    the same parameters calls `g` and does more (body written at `difficulty`).

    This is the "harder variant of a reference" that reference-conditioned teacher examples
    complete: the shown reference is visibly inside the answer. `source` must be one grammar
    function `f` with typed parameters and no helpers; `returns` is its result type.
    """
    tree = ast.parse(source)
    fns = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
    if len(tree.body) != 1 or len(fns) != 1 or fns[0].name != "f":
        raise ValueError("source must be exactly one function `f` (no helpers)")
    params = [(a.arg, ast.unparse(a.annotation) if a.annotation else "") for a in fns[0].args.args]
    used = {t for _, t in params} | {returns}
    if not used <= set(TYPES):
        raise ValueError(f"untyped or unknown parameter/result types in {sorted(used)}")
    knobs = knobs_for(difficulty)
    types = tuple(t for t in TYPES if t in used or t in knobs.types)
    body_knobs = Knobs(statements=knobs.statements, depth=knobs.depth, params=len(params),
                       types=types, loops=knobs.loops, conditionals=knobs.conditionals,
                       helpers=0, expr_depth=knobs.expr_depth)  # fmt: skip
    helper = _Helper(_HELPER_NAMES[0], tuple(t for _, t in params), returns)
    lines, ret, features = _function(rng, body_knobs, "f", params, [helper], is_helper=False)
    inner = source.strip().splitlines()
    inner[0] = inner[0].replace("def f(", f"def {helper.name}(", 1)
    return Program(
        source=_kept("\n".join([*inner, "", *lines]) + "\n", difficulty),
        params=tuple(params),
        returns=ret,
        features=tuple(sorted(features | {"helper"})),
    )


def _param_names(rng: random.Random, types: list[str]) -> list[tuple[str, str]]:
    taken: set[str] = set()
    out = []
    for t in types:
        name = rng.choice([n for n in _NAMES[t] if n not in taken])
        taken.add(name)
        out.append((name, t))
    return out


def generate_value(rng: random.Random, t: str, domain: InputDomain | None = None) -> object:
    """A small random argument value of type `t` (inside `domain` when one is given)."""
    if domain is not None:
        return _domain_value(rng, t, domain)
    if t == INT:
        return rng.randint(0, 20) if rng.random() < 0.8 else rng.randint(-9, -1)
    if t == STR:
        if rng.random() < 0.3:
            return rng.choice(_WORDS)
        return "".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 7)))
    if t == LIST:
        return [rng.randint(-5, 15) for _ in range(rng.randint(0, 6))]
    if t == DICT:
        keys = rng.sample(ALPHABET[:6], rng.randint(0, 4))
        return {k: rng.randint(0, 9) for k in keys}
    raise ValueError(f"unknown type {t!r}")


def _domain_value(rng: random.Random, t: str, d: InputDomain) -> object:
    """`generate_value`'s shapes inside `d`: ints mostly non-negative, a third of the strings
    words."""

    def num() -> int:
        neg = d.int_min < 0 and (d.int_max < 0 or rng.random() < 0.2)
        return rng.randint(d.int_min, min(d.int_max, -1)) if neg else rng.randint(max(d.int_min, 0), d.int_max)

    if t == INT:
        return num()
    if t == STR:
        words = [w for w in _WORDS if len(w) <= d.str_chars]
        if words and rng.random() < 0.3:
            return rng.choice(words)
        return "".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, d.str_chars)))
    if t == LIST:
        return [num() for _ in range(rng.randint(0, d.items))]
    if t == DICT:
        keys = rng.sample(ALPHABET[:6], rng.randint(0, min(4, d.items))) if d.str_chars else []
        return {k: num() for k in keys}
    raise ValueError(f"unknown type {t!r}")


def generate_input(rng: random.Random, program: Program, domain: InputDomain | None = None) -> str:
    """Argument text for `f(<input>)`: the reprs of one random value per parameter."""
    return ", ".join(repr(generate_value(rng, t, domain)) for _, t in program.params)


def describe(program: Program) -> str:
    """A short message about f (argument and result types, constructs), for code_f tasks."""
    article = {INT: "an int", STR: "a string", LIST: "a list of ints", DICT: "a dict"}
    args = " and ".join(article[t] for _, t in program.params)
    uses = {"loop": "loops", "while": "loops", "if": "branches", "helper": "calls a helper"}
    parts = sorted({uses[f] for f in program.features})
    tail = f"; it {', '.join(parts)}" if parts else ""
    return f"f takes {args} and returns {article[program.returns]}{tail}."
