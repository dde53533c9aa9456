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

from lorapop.tasks import prompts
from lorapop.tasks.code import ProgramInputFamily, graded
from lorapop.tasks.compare import VALUE_PRELUDE, judge, plain
from lorapop.tasks.parsing import is_value, python_expr
from lorapop.tasks.task import FormatError, Grade, Outcome, Task
from lorapop.verify import Job

NOT_A_VALUE = "answer computes a value instead of stating it"


class CodeO(ProgramInputFamily):
    name = "code_o"

    def student_prompt(self, task: Task) -> str:
        return prompts.student_o(task, self.template, self.chat)

    def parse_answer(self, text: str) -> str | FormatError:
        body = self._answer(text, "o")
        if isinstance(body, FormatError):
            return body
        expr = python_expr(body)
        return expr if expr is not None else FormatError("answer is not a Python expression")

    def _grade_or_job(self, task: Task, answer: str, names: frozenset[str]) -> Grade | Job:
        if not is_value(answer, names):
            return Grade(Outcome.FORMAT_ERROR, answer, f"format: {NOT_A_VALUE}")
        if plain(answer)[0]:
            return graded(answer, judge(answer, task.output, names))
        # the program's classes may be needed: only the value's repr comes back
        return Job(task.program + VALUE_PRELUDE, answer, entry=None)
