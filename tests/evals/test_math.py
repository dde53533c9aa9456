"""Gold answers score 100% and perturbed ones 0% through the checker that scores models."""

import re

import pytest

from lorapop.evals import data
from lorapop.evals.mathcheck import check, extract_answer

#: math-verify lower-cases symbols, so `N=n` is the identity and any `N=...` matches it.
KNOWN_BLIND = {("olympiadbench", "N=n")}
SAMPLE = 20  # per benchmark in `make test`; all of them: the self-check command in the README


def perturb(gold: str) -> str:
    m = re.search(r"\d+", gold)
    return gold[: m.start()] + str(int(m.group()) + 1) + gold[m.end() :] if m else gold + "+1"


def test_extraction_order():
    assert extract_answer("<answer>\\boxed{3}</answer>") == "3"
    assert extract_answer("<think>\\boxed{1}</think><answer>x = 2</answer>") == "x = 2"
    assert extract_answer("so the answer is \\boxed{\\frac{1}{2}}.") == "\\frac{1}{2}"
    assert extract_answer("nothing here") is None


def test_equivalent_forms_are_accepted_and_wrong_ones_refused():
    assert check("<answer>\\boxed{\\frac{1}{2}}</answer>", "0.5").correct
    assert check("<answer>1/2</answer>", "\\frac12").correct
    assert check("<answer>\\boxed{(3, \\pi/2)}</answer>", "\\left( 3, \\frac{\\pi}{2} \\right)").correct
    assert not check("<answer>\\boxed{(3, \\pi)}</answer>", "\\left( 3, \\frac{\\pi}{2} \\right)").correct
    assert not check("<answer>\\boxed{}</answer>", "3").correct
    assert not check("no answer at all", "3").correct


@pytest.mark.parametrize("bench", data.MATH)
def test_gold_scores_all_and_perturbed_none(bench, data_dir):
    probs = data.load(bench, data_dir, limit=SAMPLE)
    for p in probs:
        assert check(f"<think>...</think> <answer>\\boxed{{{p.answer}}}</answer>", p.answer).correct, p.id
        assert check(f"<answer>{p.answer}</answer>", p.answer).correct, p.id
        if (bench, p.answer) not in KNOWN_BLIND:
            wrong = perturb(p.answer)
            assert not check(f"<answer>\\boxed{{{wrong}}}</answer>", p.answer).correct, (p.id, wrong)
