"""code_f (AZR's induction): the student writes `f` from input/output pairs and a message.

The teacher is given a program (`base`, drawn by the loop from a buffer) and writes
`n_inputs` distinct inputs and a message; every input must run (deterministically) in the
sandbox. The student sees the even-position pairs and the message; its program must
reproduce every odd-position (hidden) pair. One sandbox job per answer runs the student's
program on the hidden inputs and returns only the repr of the tuple of its values; the hidden
outputs never enter that process, and each item is compared with its gold here
(`compare.judge`), so a program that forges its job's verdict or rebinds builtins gains
nothing. The student's program goes through the sandbox's static checks like any other.
"""

from __future__ import annotations

from collections.abc import Sequence

from lorapop.tasks import prompts
from lorapop.tasks.code import (
    IDENTITY,
    CodeFamily,
    graded,
    reason_of,
    split_pairs,
    teacher_per_text,
    unique,
)
from lorapop.tasks.compare import MATCH, judge, tuple_items
from lorapop.tasks.domain import WorldRules
from lorapop.tasks.family import Runner
from lorapop.tasks.parsing import (
    answer_span,
    call_args,
    fenced_blocks,
    is_program,
    line_fallback,
    opened,
    tag_blocks,
    value_names,
)
from lorapop.tasks.prompts import Caps
from lorapop.tasks.task import Draft, FormatError, Grade, Outcome, Task, Validity
from lorapop.verify import Job, Verdict

#: Inputs of the seed task (the identity program, as in AZR): reprs equal the inputs.
SEED_INPUTS = (
    "'Hello World'", "0", "-7", "3.5", "[1, 2, 3]", "'abc'", "(1, 'a')", "{'k': 1}", "True",
    "None",
)  # fmt: skip


class CodeF(CodeFamily):
    name = "code_f"
    needs_base = True

    def __init__(self, template: str = "azr", caps: Caps | None = None, n_inputs: int = 10,
                 chat: prompts.ChatFormat | None = None, rules: WorldRules | None = None):
        super().__init__(template, caps, chat, rules)
        if n_inputs < 2:
            raise ValueError("code_f needs n_inputs >= 2 (half are shown, half check)")
        self.n_inputs = n_inputs

    def seed_tasks(self) -> list[Task]:
        extra = tuple(str(100 + k) for k in range(max(0, self.n_inputs - len(SEED_INPUTS))))
        ins = (SEED_INPUTS + extra)[: self.n_inputs]
        return [Task(self.name, IDENTITY, ins, ins, message="It returns what it is given.")]

    def teacher_prompt(self, references: Sequence[Task], base: Task | None = None) -> str:
        if base is None:
            raise ValueError("code_f needs a base task whose program the teacher writes inputs for")
        return prompts.teacher_f(references, base, self.n_inputs, self.template, self.caps,
                                 self.chat)

    def parse_proposal(self, text: str, base: Task | None = None) -> Draft | FormatError:
        if err := self._too_long(text):
            return err
        if self.template == "compact":
            t = opened(text, "i")
            raw = tag_blocks(t, "i")
            msgs = tag_blocks(t, "m")
            message = msgs[0] if msgs else None
        else:
            span = answer_span(text)
            src = span if span is not None else text
            blocks = fenced_blocks(src)
            raw = [b for tag, b in blocks if tag == "input"]
            msgs = [b for tag, b in blocks if tag == "message"] or tag_blocks(src, "message")
            message = msgs[0] if msgs else line_fallback(src, "Message")
        if len(raw) < self.n_inputs:
            return FormatError(f"{len(raw)} of {self.n_inputs} inputs")
        if not message:
            return FormatError("no message")
        inputs = []
        for k, r in enumerate(raw[-self.n_inputs :]):  # AZR keeps the last n
            args = call_args(r)
            if args is None:
                return FormatError(f"input {k} is not an argument list for f(...)")
            inputs.append(args)
        program = base.program if base is not None else ""
        return Draft(program=program, inputs=tuple(inputs), message=message)

    def verify(
        self,
        texts: Sequence[str],
        runner: Runner,
        *,
        bases: Sequence[Task | None] | None = None,
        teachers: Sequence[str | None] | None = None,
        step: int | None = None,
    ) -> list[Validity]:
        if bases is None or len(bases) != len(texts):
            raise ValueError("code_f verify needs one base task per text")
        who = teacher_per_text(teachers, len(texts))
        parsed = [self.parse_proposal(t, b) for t, b in zip(texts, bases, strict=True)]
        jobs: list[Job] = []
        spans: dict[int, tuple[int, int]] = {}
        early: dict[int, Validity] = {}
        for i, p in enumerate(parsed):
            if isinstance(p, FormatError):
                early[i] = Validity(False, f"format: {p.reason}", format_error=True)
            elif not p.program:
                early[i] = Validity(False, "no base program")
            elif not unique(p.inputs):
                early[i] = Validity(False, "duplicate inputs")
            elif problem := self._shown_problem(p) or self.rules.call_problem(p.program):
                early[i] = Validity(False, problem)
            else:
                spans[i] = (len(jobs), len(jobs) + len(p.inputs))
                jobs += [Job(p.program, f"f({x})", entry="f", deterministic=True) for x in p.inputs]
        verdicts = runner.run(jobs) if jobs else []
        out = []
        for i, p in enumerate(parsed):
            if i in early:
                out.append(early[i])
                continue
            assert isinstance(p, Draft)
            a, b = spans[i]
            out.append(self._judge(p, verdicts[a:b], who[i], step))
        return out

    def _judge(
        self, p: Draft, verdicts: Sequence[Verdict], teacher: str | None, step: int | None
    ) -> Validity:
        outputs = []
        for k, v in enumerate(verdicts):
            if not v.ok or v.output is None:
                return Validity(False, f"input {k}: {reason_of(v)}")
            if problem := self._gold_problem(v.output):
                return Validity(False, f"input {k}: {problem}")
            outputs.append(v.output)
        task = Task(self.name, p.program, p.inputs, tuple(outputs), p.message, teacher, step)
        return Validity(True, task=task)

    def student_prompt(self, task: Task) -> str:
        visible, _ = split_pairs(task)
        return prompts.student_f(visible, task.message, self.template, self.chat)

    def parse_answer(self, text: str) -> str | FormatError:
        if err := self._too_long(text):
            return err
        if self.template == "compact":
            blocks = tag_blocks(opened(text, "f"), "f")
            program = blocks[0] if blocks else ""
        else:
            span = answer_span(text)
            if span is None:
                return FormatError("no complete <answer> block")
            code = [b for tag, b in fenced_blocks(span) if tag in ("python", "")]
            program = code[-1] if code else span.strip()  # AZR takes the last code block
        if not program.strip():
            return FormatError("empty program")
        if not is_program(program):
            return FormatError("program does not parse")
        return program

    def check(self, tasks: Sequence[Task], texts: Sequence[str], runner: Runner) -> list[Grade]:
        if len(tasks) != len(texts):
            raise ValueError("check: tasks and texts differ in length")
        answers = [self.parse_answer(t) for t in texts]
        jobs = {}
        for i, (task, a) in enumerate(zip(tasks, answers, strict=True)):
            if isinstance(a, FormatError):
                continue
            _, hidden = split_pairs(task)
            jobs[i] = Job(a, "(" + "".join(f"f({x}), " for x, _ in hidden) + ")", entry="f")

        def grade(i: int, output: str) -> Grade:
            answer, task = answers[i], tasks[i]
            assert isinstance(answer, str)
            golds = [y for _, y in split_pairs(task)[1]]
            items = tuple_items(output, len(golds))
            if items is None:
                return Grade(Outcome.WRONG, answer, f"output is not a tuple of {len(golds)} values")
            names = value_names(task.program)
            for k, (item, gold) in enumerate(zip(items, golds, strict=True)):
                if (j := judge(item, gold, names)) != MATCH:
                    return graded(answer, f"hidden pair {k}: {j}")
            return graded(answer, MATCH)

        return self._run_checks(answers, jobs, runner, grade)
