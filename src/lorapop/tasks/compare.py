"""Equality of a model's value and a gold value, with a defence against hostile objects.

A model can answer with an object whose `__eq__` always returns True (or whose `__repr__`
forges the gold text), directly or inside a list. So a value counts as equal to a gold value
made of plain builtins (int, float, complex, bool, str, bytes, None, and lists, tuples, sets,
frozensets, dicts of them) only when it is itself made of plain builtins - checked by exact
`type()` identity, which no user class can fake - and then `==` decides (so 2 == 2.0, as in
AZR). A gold value that is not plain (an instance of a class the program defines) needs the
same type and the same repr.

The check runs inside the sandbox (`EQ_HELPER` is appended to the job's program and captures
the builtins it uses at definition time). Code that deliberately rewrites the sandbox's own
namespace at run time can still fool it; process isolation bounds what that can reach, and it
cannot touch other jobs. When both sides are literals, `literal_equal` decides in this process
without running anything (`ast.literal_eval` builds only plain builtins).
"""

from __future__ import annotations

from lorapop.tasks.parsing import literal

#: Name of the comparison function defined by `EQ_HELPER` inside a sandbox job.
EQ = "_lorapop_same"

EQ_HELPER = f"""

def _lorapop_make_same(_type=type, _repr=repr, _len=len, _iter=iter, _next=next):
    _atoms = (int, float, complex, bool, str, bytes, type(None))
    _seqs = (list, tuple, set, frozenset)

    def plain(v, depth):
        t = _type(v)
        for a in _atoms:
            if t is a:
                return True
        if depth > 200:
            return False
        for s in _seqs:
            if t is s:
                for x in v:
                    if not plain(x, depth + 1):
                        return False
                return True
        if t is dict:
            for k in v:
                if not plain(k, depth + 1) or not plain(v[k], depth + 1):
                    return False
            return True
        return False

    def same(value, gold):
        if plain(gold, 0):
            return plain(value, 0) and bool(value == gold)
        return _type(value) is _type(gold) and _repr(value) == _repr(gold)

    return same


{EQ} = _lorapop_make_same()
del _lorapop_make_same
if "inf" not in globals():
    inf = float("inf")
if "nan" not in globals():
    nan = float("nan")
"""


def literal_equal(answer: str, gold: str) -> bool | None:
    """True/False when both texts are literals (decided here, nothing runs), else None."""
    ok_a, a = literal(answer)
    if not ok_a:
        return None
    ok_g, g = literal(gold)
    if not ok_g:
        return None
    try:
        return bool(a == g)
    except (RecursionError, MemoryError):
        return False


def eq_expr(value_expr: str, gold_expr: str) -> str:
    """The sandbox expression that is True iff the value equals the gold (see module doc)."""
    return f"{EQ}(({value_expr}), ({gold_expr}))"
