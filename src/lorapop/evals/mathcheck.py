"""Math answers: extract from `<answer>` / `\\boxed{}` and compare with math-verify.

math-verify (a maintained checker: sympy equivalence of LaTeX and plain expressions, sets,
intervals, equations) decides; normalised string equality is only a fallback for answers
neither side can parse (e.g. Minerva's `np.arcsin(10/13)`). math-verify is imported lazily so
that code-only evaluation does not need it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from lorapop.evals.extract import answer_span, last_boxed


@dataclass(frozen=True)
class MathVerdict:
    correct: bool
    extracted: str | None  # what was compared ("" when nothing could be found)


def extract_answer(text: str) -> str | None:
    """`\\boxed{}` inside the last `<answer>`, else that answer's text, else the last `\\boxed{}`."""
    span = answer_span(text)
    if span is not None:
        return last_boxed(span) or span
    return last_boxed(text)


def _strip(s: str) -> str:
    s = s.strip().strip("$").strip()
    s = re.sub(r"\\(left|right|displaystyle|!|,|;|:)", "", s)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    return re.sub(r"\s+", "", s).rstrip(".")


def _parse(s: str):  # -> list of sympy objects and strings (math-verify's format)
    from math_verify import parse

    return parse("\\boxed{" + s.strip().strip("$") + "}", parsing_timeout=5)


def check(text: str, gold: str) -> MathVerdict:
    """Is the model's final answer in `text` equivalent to `gold` (a LaTeX or plain answer)?"""
    from math_verify import parse, verify

    ans = extract_answer(text)
    gold_p = _parse(gold)
    pred_p = _parse(ans) if ans is not None else parse(text, parsing_timeout=5)
    if gold_p and pred_p:
        try:
            if verify(gold_p, pred_p, timeout_seconds=5):
                return MathVerdict(True, ans or "")
        except Exception:  # a checker failure is a wrong answer, never a crash
            pass
    ok = ans is not None and _strip(ans) == _strip(gold) and _strip(gold) != ""
    return MathVerdict(ok, ans if ans is not None else "")
