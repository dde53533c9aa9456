"""code_i (AZR's abduction): the student sees a program and an output and writes an input.

Any input counts when `f(input)` equals the gold output. The sandbox runs the teacher's
program on the student's input and returns only the repr of `f(input)`; `compare.judge`
compares it with the gold here, so no code in that process sees the gold or decides the
verdict. The arguments must state values, as code_o answers must (no lambdas, no calls of `f`
or helpers, no user-made types), so no code of the student's runs at all.
"""

from __future__ import annotations

from lorapop.tasks import prompts
from lorapop.tasks.code import ProgramInputFamily
from lorapop.tasks.code_o import NOT_A_VALUE
from lorapop.tasks.compare import VALUE_PRELUDE
from lorapop.tasks.parsing import call_args, is_value_args
from lorapop.tasks.task import FormatError, Grade, Outcome, Task
from lorapop.verify import Job


class CodeI(ProgramInputFamily):
    name = "code_i"

    def student_prompt(self, task: Task) -> str:
        return prompts.student_i(task, self.template, self.chat)

    def parse_answer(self, text: str) -> str | FormatError:
        body = self._answer(text, "i")
        if isinstance(body, FormatError):
            return body
        args = call_args(body)
        return args if args is not None else FormatError("answer is not an argument list")

    def _grade_or_job(self, task: Task, answer: str, names: frozenset[str]) -> Grade | Job:
        if not is_value_args(answer, names):
            return Grade(Outcome.FORMAT_ERROR, answer, f"format: {NOT_A_VALUE}")
        return Job(task.program + VALUE_PRELUDE, f"f({answer})", entry="f")
