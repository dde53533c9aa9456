"""Benchmark evaluation of a population: HumanEval+, MBPP+, LiveCodeBench, CRUXEval-O/I and
seven math suites, every member in the same mixed-adapter batches (see `run_eval`)."""

from lorapop.evals.codecheck import TimeRule, score
from lorapop.evals.data import BENCHES, CODE, MATH, DataError, Problem, load
from lorapop.evals.pool import Pool
from lorapop.evals.runner import EvalError, Member, find_members, run_eval
from lorapop.evals.table import markdown, summarize

__all__ = [
    "BENCHES", "CODE", "MATH", "DataError", "EvalError", "Member", "Pool", "Problem",
    "TimeRule", "find_members", "load", "markdown", "run_eval", "score", "summarize",
]  # fmt: skip
