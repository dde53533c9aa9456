"""evalplus' output oracle: exact match, float tolerance and its special cases, on plain values.

Mirrors `evalplus.eval.unsafe_execute` (v0.3): `out == exp`; for MBPP+ a few tasks compare sets,
accept `None`-ness or use a reference formula; HumanEval/32 checks the root; otherwise, when
`atol` is set (or forced to 1e-6 because `exp` is a float or a list of floats; evalplus keeps
that forced value for the remaining tests of the run), `type(out) == type(exp)`, equal lengths
and `np.allclose(out, exp, rtol=1e-7, atol)`. numpy is not needed: `allclose` below does it.
"""

from __future__ import annotations

import math
from typing import Any

MBPP_NOT_NONE = ("check_str", "text_match_three", "text_starta_endb")
MBPP_SET_EQ = ("similar_elements", "find_char_long", "common_in_nested_lists", "extract_singly",
               "larg_nnum", "intersection_array", "find_dissimilar", "Diff")  # fmt: skip


def _poly(xs: list, x: float) -> float:
    return sum(c * math.pow(x, i) for i, c in enumerate(xs))


def _surface_area(base_edge: float, height: float) -> float:
    slant = math.sqrt((base_edge / 2) ** 2 + height**2)
    return round(base_edge**2 + 4 * (base_edge * slant) / 2)


def _digit_distance(a: int, b: int) -> int:
    sa, sb = str(a), str(b)
    n = max(len(sa), len(sb))
    return sum(abs(int(x) - int(y)) for x, y in zip(sa.zfill(n), sb.zfill(n), strict=False))


def is_floats(x: Any) -> bool:
    if isinstance(x, float):
        return True
    return isinstance(x, list | tuple) and bool(x) and all(isinstance(i, float) for i in x)


def _num(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, complex)


def allclose(a: Any, b: Any, rtol: float, atol: float) -> bool:
    """np.allclose for scalars and equal-shape nests of numbers (no broadcasting)."""
    if _num(a) and _num(b):
        if math.isinf(a) or math.isinf(b):
            return a == b
        return abs(a - b) <= atol + rtol * abs(b)  # nan compares False, as in numpy
    if isinstance(a, list | tuple) and isinstance(b, list | tuple) and len(a) == len(b):
        return all(allclose(x, y, rtol, atol) for x, y in zip(a, b, strict=False))
    return False


class Oracle:
    """Judge one run of tests (evalplus runs base and plus separately, each with fresh atol)."""

    def __init__(self, dataset: str, entry: str, atol: float) -> None:
        self.dataset, self.entry, self.atol = dataset, entry, atol

    def __call__(self, out: Any, exp: Any, inp: list) -> bool:
        try:
            return self._judge(out, exp, inp)
        except Exception:  # e.g. set() of an unhashable output: a failed test, as in evalplus
            return False

    def _judge(self, out: Any, exp: Any, inp: list) -> bool:
        exact = out == exp
        e = self.entry
        if self.dataset == "mbpp":
            if e == "are_equivalent":
                exact = True  # evalplus: `exact_match or True`
            elif e == "sum_div":
                exact = exact or out == 0
            elif e == "surface_Area":
                exact = exact or abs(out - _surface_area(*inp)) <= self.atol
            elif e == "digit_distance_nums":
                exact = exact or out == _digit_distance(*inp)
            elif e in MBPP_SET_EQ:
                exact = set(out) == set(exp)
        if self.dataset == "humaneval" and e == "find_zero":
            return abs(_poly(*inp, out)) <= self.atol
        if self.atol == 0 and is_floats(exp):
            self.atol = 1e-6
        if not exact and self.atol != 0:
            if type(out) is not type(exp):
                return False
            if isinstance(exp, list | tuple) and len(out) != len(exp):
                return False
            return allclose(out, exp, 1e-7, self.atol)
        return bool(exact)
