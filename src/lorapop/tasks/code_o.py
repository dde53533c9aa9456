"""code_o (AZR's deduction): the student sees a program and an input and predicts the output.

The answer must state a value: literals, and calls of builtin constructors, the program's
classes and names it imports (`frozenset({1})`, `Point(1, 2)`); an answer that computes
(calls `f` or a helper, a lambda, a comprehension, arithmetic) is a format error, or a student
could answer `f(<input>)`. Correct when the value equals the gold output: decided here with
`ast.literal_eval` when both are literals, otherwise in the sandbox by `compare.EQ_HELPER`.
"""

from __future__ import annotations

from collections.abc import Sequence

from lorapop.tasks import prompts
from lorapop.tasks.code import ProgramInputFamily
from lorapop.tasks.compare import EQ_HELPER, eq_expr, literal_equal
from lorapop.tasks.family import Runner
from lorapop.tasks.parsing import is_value, python_expr, value_names
from lorapop.tasks.task import FormatError, Grade, Outcome, Task
from lorapop.verify import Job

NOT_A_VALUE = "answer computes a value instead of stating it"


class CodeO(ProgramInputFamily):
    name = "code_o"

    def student_prompt(self, task: Task) -> str:
        return prompts.student_o(task, self.template)

    def parse_answer(self, text: str) -> str | FormatError:
        body = self._answer(text, "o")
        if isinstance(body, FormatError):
            return body
        expr = python_expr(body)
        return expr if expr is not None else FormatError("answer is not a Python expression")

    def check(self, tasks: Sequence[Task], texts: Sequence[str], runner: Runner) -> list[Grade]:
        if len(tasks) != len(texts):
            raise ValueError("check: tasks and texts differ in length")
        answers = [self.parse_answer(t) for t in texts]
        decided: dict[int, Grade] = {}
        jobs: dict[int, Job] = {}
        for i, (task, a) in enumerate(zip(tasks, answers, strict=True)):
            if isinstance(a, FormatError):
                continue
            if not is_value(a, value_names(task.program)):
                decided[i] = Grade(Outcome.FORMAT_ERROR, a, f"format: {NOT_A_VALUE}")
                continue
            same = literal_equal(a, task.output)
            if same is not None:
                decided[i] = Grade(
                    Outcome.CORRECT if same else Outcome.WRONG, a, "match" if same else "mismatch"
                )
            else:
                jobs[i] = Job(task.program + EQ_HELPER, eq_expr(a, task.output), entry=None)
        return self._run_checks(answers, jobs, runner, decided)
