"""The task-family interface: everything the loop needs to turn model text into rewards.

A family is one verifiable domain. The loop never looks inside a task; it calls, per family:

    prompt = fam.teacher_prompt(refs, base)            # refs: K tasks sampled from a buffer
    validity = fam.verify(texts, sandbox, bases=..., teachers=..., step=...)   # batched
    prompt = fam.student_prompt(task)
    grades = fam.check(tasks, texts, sandbox)          # batched

`verify` and `check` take lists and make one `sandbox.run` call each, so the pool works in
parallel; parsing never raises (bad text becomes a format error). A new domain (math with a
checker, say) is a class with these members, registered with `register_family`; nothing else
changes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from lorapop.tasks.task import Draft, FormatError, Grade, Task, Validity
from lorapop.verify import Job, Verdict


class Runner(Protocol):
    """What a family needs from the sandbox (`lorapop.verify.Sandbox` is one)."""

    def run(self, jobs: Sequence[Job]) -> list[Verdict]: ...


@runtime_checkable
class TaskFamily(Protocol):
    #: registry name, also `Task.type` of the tasks it makes ("code_o", ...)
    name: str
    #: prompt template, one of `prompts.TEMPLATES`
    template: str
    #: True when a proposal is written for a given task (code_f: a program from a buffer)
    needs_base: bool

    def seed_tasks(self) -> list[Task]:
        """Tasks a fresh buffer starts with."""
        ...

    def teacher_prompt(self, references: Sequence[Task], base: Task | None = None) -> str:
        """Prompt asking for a new task, showing `references`; `base` when `needs_base`."""
        ...

    def parse_proposal(self, text: str, base: Task | None = None) -> Draft | FormatError:
        """Teacher text -> proposal; never raises."""
        ...

    def verify(
        self,
        texts: Sequence[str],
        runner: Runner,
        *,
        bases: Sequence[Task | None] | None = None,
        teachers: Sequence[str | None] | None = None,
        step: int | None = None,
    ) -> list[Validity]:
        """Teacher texts -> one `Validity` each, in order (one batched sandbox call)."""
        ...

    def student_prompt(self, task: Task) -> str:
        """Prompt showing a valid task to a student."""
        ...

    def parse_answer(self, text: str) -> str | FormatError:
        """Student text -> normalised answer; never raises."""
        ...

    def check(self, tasks: Sequence[Task], texts: Sequence[str], runner: Runner) -> list[Grade]:
        """Student texts (texts[i] answers tasks[i]) -> one `Grade` each, in order."""
        ...
