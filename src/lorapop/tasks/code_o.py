"""code_o (AZR's deduction): the student sees a program and an input and predicts the output.

The answer must state a value: literals, and calls of builtin constructors, the program's
classes and names it imports (`frozenset({1})`, `Point(1, 2)`); an answer that computes
(calls `f` or a helper, a lambda, a comprehension, arithmetic) is a format error, or a student
could answer `f(<input>)`. Correct when the value equals the gold output (`compare.judge`):
when the answer is a plain builtin value it is decided here (`ast.literal_eval`, nothing runs);
otherwise the sandbox evaluates the answer with the program's classes and returns only its
repr, which is compared here, so the gold never enters the sandbox.
"""

from __future__ import annotations

from collections.abc import Sequence

from lorapop.tasks import prompts
from lorapop.tasks.code import ProgramInputFamily, graded
from lorapop.tasks.compare import VALUE_PRELUDE, judge, plain
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
        names = [value_names(t.program) for t in tasks]
        for i, (task, a) in enumerate(zip(tasks, answers, strict=True)):
            if isinstance(a, FormatError):
                continue
            if not is_value(a, names[i]):
                decided[i] = Grade(Outcome.FORMAT_ERROR, a, f"format: {NOT_A_VALUE}")
            elif plain(a)[0]:
                decided[i] = graded(a, judge(a, task.output, names[i]))
            else:  # the program's classes may be needed: only the value's repr comes back
                jobs[i] = Job(task.program + VALUE_PRELUDE, a, entry=None)

        def grade(i: int, output: str) -> Grade:
            answer = answers[i]
            assert isinstance(answer, str)
            return graded(answer, judge(output, tasks[i].output, names[i]))

        return self._run_checks(answers, jobs, runner, grade, decided)
