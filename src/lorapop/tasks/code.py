"""What the three code families share: settings, the seed, proposal parsing and verdict reading."""

from __future__ import annotations

import ast
from collections.abc import Callable, Sequence

from lorapop.tasks import prompts
from lorapop.tasks.compare import MATCH, judge
from lorapop.tasks.domain import WorldRules
from lorapop.tasks.family import Runner
from lorapop.tasks.parsing import (
    MAX_TEXT_CHARS,
    answer_span,
    call_args,
    fenced_blocks,
    line_fallback,
    opened,
    python_expr,
    strip_fence,
    tag_blocks,
    value_names,
)
from lorapop.tasks.prompts import Caps, ChatFormat, check_template
from lorapop.tasks.task import Draft, FormatError, Grade, Outcome, Task, Validity
from lorapop.verify import Job, Verdict

#: AZR's seed task: the identity function on "Hello World".
IDENTITY = "def f(a):\n    return a"
SEED_INPUT = "'Hello World'"


class CodeFamily:
    """Base of code_o / code_i / code_f. Subclasses set `name` and the type-specific parts."""

    name = ""
    needs_base = False

    def __init__(self, template: str = "azr", caps: Caps | None = None,
                 chat: ChatFormat | None = None, rules: WorldRules | None = None) -> None:
        self.template = check_template(template)
        if template == "chat" and chat is None:
            raise ValueError("template 'chat' needs chat=prompts.chat_format(tokenizer)")
        self.caps = caps or Caps()
        self.chat = chat
        self.rules = rules or WorldRules()

    # -- helpers shared by the subclasses --------------------------------------------------

    def _too_long(self, text: str) -> FormatError | None:
        if len(text) > MAX_TEXT_CHARS:
            return FormatError(f"text longer than {MAX_TEXT_CHARS} chars")
        return None

    def _answer(self, text: str, tag: str) -> str | FormatError:
        """The raw answer text of a student: the azr `<answer>` body (fence stripped) or the
        compact `<tag>` body."""
        if err := self._too_long(text):
            return err
        if self.template == "compact":
            blocks = tag_blocks(opened(text, tag), tag)
            body = blocks[0] if blocks else ""
        else:
            span = answer_span(text)
            if span is None:
                return FormatError("no complete <answer> block")
            body = strip_fence(span)
        if not body.strip():
            return FormatError("empty answer")
        return body

    def _shown_problem(self, p: Draft) -> str | None:
        """Why a proposal cannot become a task a student is shown whole, or None: every part
        must fit the caps (prompts never truncate a student's own task), every input the
        world's input domain."""
        if len(p.program) > self.caps.program_chars:
            return f"program longer than {self.caps.program_chars} chars"
        if len(p.message) > self.caps.shown_chars:
            return f"message longer than {self.caps.shown_chars} chars"
        for k, x in enumerate(p.inputs):
            if len(x) > self.caps.shown_chars:
                return f"input {k} longer than {self.caps.shown_chars} chars"
            if why := self.rules.input_problem(k, x):
                return why
        return None

    def _gold_problem(self, output: str) -> str | None:
        """Why a verified output cannot serve as a gold answer, or None when it can."""
        if len(output) > self.caps.shown_chars:
            return f"output longer than {self.caps.shown_chars} chars"
        if python_expr(output) is None:
            return "output is not a Python expression"
        return self.rules.output_problem(output)

    def _run_checks(
        self,
        answers: Sequence[str | FormatError],
        jobs: dict[int, Job],
        runner: Runner,
        grade: Callable[[int, str], Grade],
        decided: dict[int, Grade] | None = None,
    ) -> list[Grade]:
        """Grades in order: format errors, those `decided` already, and the rest from one
        batched sandbox call over `jobs`: a job that fails is wrong, else `grade(i, output)`
        compares its output (a repr) with the gold in this process."""
        idx = sorted(jobs)
        verdicts = runner.run([jobs[i] for i in idx]) if idx else []
        by_idx = dict(zip(idx, verdicts, strict=True))
        decided = decided or {}
        out = []
        for i, a in enumerate(answers):
            if isinstance(a, FormatError):
                out.append(Grade(Outcome.FORMAT_ERROR, None, f"format: {a.reason}"))
            elif i in decided:
                out.append(decided[i])
            elif not by_idx[i].ok or by_idx[i].output is None:
                out.append(Grade(Outcome.WRONG, a, reason_of(by_idx[i])))
            else:
                out.append(grade(i, str(by_idx[i].output)))
        return out

    def seed_tasks(self) -> list[Task]:
        return [Task(self.name, IDENTITY, (SEED_INPUT,), (SEED_INPUT,))]


def graded(answer: str, judgement: str) -> Grade:
    """A `compare.judge` result as a grade: a match is correct, anything else wrong."""
    return Grade(Outcome.CORRECT if judgement == MATCH else Outcome.WRONG, answer, judgement)


def reason_of(verdict: Verdict) -> str:
    return f"{verdict.status.value}: {verdict.error}" if verdict.error else verdict.status.value


def parse_program_input(text: str, template: str) -> tuple[str, str] | FormatError:
    """(program, normalised input) from a code_o/code_i teacher text, with AZR's fallbacks."""
    if len(text) > MAX_TEXT_CHARS:
        return FormatError(f"text longer than {MAX_TEXT_CHARS} chars")
    if template == "compact":
        t = opened(text, "f")
        programs, inputs = tag_blocks(t, "f"), tag_blocks(t, "i")
        program = programs[0] if programs else None
        raw_input = inputs[0] if inputs else None
    else:
        span = answer_span(text)
        src = span if span is not None else text  # AZR searches the whole text as a fallback
        blocks = fenced_blocks(src)
        code = [b for tag, b in blocks if tag == "python"] or [b for tag, b in blocks if not tag]
        program = code[0] if code else None
        ins = [b for tag, b in blocks if tag == "input"]
        raw_input = ins[0] if ins else line_fallback(src, "Input")
    if not program:
        return FormatError("no program block")
    if raw_input is None:
        return FormatError("no input block")
    args = call_args(raw_input)
    if args is None:
        return FormatError("input is not an argument list for f(...)")
    return rename_entry(program), args


def rename_entry(program: str) -> str:
    """AZR's fallback: a program whose only top-level function is not called `f` gets it
    renamed (with its recursive calls). Programs that do not parse are returned unchanged."""
    try:
        tree = ast.parse(program)
    except (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError):
        return program
    defs = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    if len(defs) != 1 or defs[0].name == "f":
        return program
    if any(isinstance(n, ast.ClassDef) and n.name == "f" for n in tree.body):
        return program
    old = defs[0].name
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id == old:
            node.id = "f"
    defs[0].name = "f"
    try:
        return ast.unparse(tree)
    except (ValueError, RecursionError):
        return program


def split_pairs(task: Task) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """code_f's (visible, hidden) pairs: even positions are shown, odd ones check."""
    pairs = list(zip(task.inputs, task.outputs, strict=True))
    return pairs[0::2], pairs[1::2]


def teacher_per_text(teachers: Sequence[str | None] | None, n: int) -> list[str | None]:
    """`verify`'s teachers, one per text (None when not given); ValueError on a mismatch."""
    who = list(teachers) if teachers is not None else [None] * n
    if len(who) != n:
        raise ValueError("verify: teachers and texts differ in length")
    return who


def unique(items: Sequence[str]) -> bool:
    return len(set(items)) == len(items)


class ProgramInputFamily(CodeFamily):
    """code_o and code_i: the teacher writes a program and one input; the sandbox runs it
    twice under different hash seeds and its output becomes the gold."""

    def teacher_prompt(self, references: Sequence[Task], base: Task | None = None) -> str:
        return prompts.teacher_io(self.name, references, self.template, self.caps,
                                  self.chat)

    def parse_proposal(self, text: str, base: Task | None = None) -> Draft | FormatError:
        parsed = parse_program_input(text, self.template)
        if isinstance(parsed, FormatError):
            return parsed
        return Draft(program=parsed[0], inputs=(parsed[1],))

    def verify(
        self,
        texts: Sequence[str],
        runner: Runner,
        *,
        bases: Sequence[Task | None] | None = None,
        teachers: Sequence[str | None] | None = None,
        step: int | None = None,
    ) -> list[Validity]:
        who = teacher_per_text(teachers, len(texts))
        parsed = [self.parse_proposal(t) for t in texts]
        early = {
            i: Validity(False, problem)
            for i, p in enumerate(parsed)
            if isinstance(p, Draft)
            and (problem := self._shown_problem(p) or self.rules.program_problem(p.program))
        }
        idx = [i for i, p in enumerate(parsed) if isinstance(p, Draft) and i not in early]
        jobs = []
        for i in idx:
            p = parsed[i]
            assert isinstance(p, Draft)
            jobs.append(Job(p.program, f"f({p.inputs[0]})", entry="f", deterministic=True))
        verdicts = dict(zip(idx, runner.run(jobs) if jobs else [], strict=True))
        out = []
        for i, p in enumerate(parsed):
            if isinstance(p, FormatError):
                out.append(Validity(False, f"format: {p.reason}", format_error=True))
                continue
            if i in early:
                out.append(early[i])
                continue
            v = verdicts[i]
            if not v.ok or v.output is None:
                out.append(Validity(False, reason_of(v)))
            elif problem := self._gold_problem(v.output):
                out.append(Validity(False, problem))
            else:
                task = Task(self.name, p.program, p.inputs, (v.output,), teacher=who[i], step=step)
                out.append(Validity(True, task=task))
        return out

    def check(self, tasks: Sequence[Task], texts: Sequence[str], runner: Runner) -> list[Grade]:
        """Each answer is decided here (`_grade_or_job`) or becomes a sandbox job whose output, a
        value's repr, is judged against the gold in this process."""
        if len(tasks) != len(texts):
            raise ValueError("check: tasks and texts differ in length")
        answers = [self.parse_answer(t) for t in texts]
        names = [value_names(t.program) for t in tasks]
        decided: dict[int, Grade] = {}
        jobs: dict[int, Job] = {}
        for i, (task, a) in enumerate(zip(tasks, answers, strict=True)):
            if not isinstance(a, FormatError):
                outcome = self._grade_or_job(task, a, names[i])
                (jobs if isinstance(outcome, Job) else decided)[i] = outcome

        def grade(i: int, output: str) -> Grade:
            answer = answers[i]
            assert isinstance(answer, str)
            return graded(answer, judge(output, tasks[i].output, names[i]))

        return self._run_checks(answers, jobs, runner, grade, decided)

    def _grade_or_job(self, task: Task, answer: str, names: frozenset[str]) -> Grade | Job:
        """A parsed answer: its grade when decidable here, else the job computing its value."""
        raise NotImplementedError
