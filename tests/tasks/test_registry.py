"""The family interface: the code families implement it, and a new domain plugs in alone."""

import re
from collections.abc import Sequence

import pytest

from lorapop.tasks import (
    FAMILIES,
    Draft,
    FormatError,
    Grade,
    Outcome,
    Task,
    TaskBuffer,
    TaskFamily,
    Validity,
    get_family,
    register_family,
)


class Sums:
    """A toy verifiable domain: the teacher proposes `a + b`, the student answers the sum.
    Checked in this process (integers only), so it ignores the runner."""

    name = "sums"
    needs_base = False

    def __init__(self, template: str = "azr") -> None:
        self.template = template

    def seed_tasks(self) -> list[Task]:
        return [Task(self.name, "", ("1 + 1",), ("2",))]

    def teacher_prompt(self, references: Sequence[Task], base: Task | None = None) -> str:
        return "Propose a sum like " + "; ".join(t.input for t in references)

    def parse_proposal(self, text: str, base: Task | None = None) -> Draft | FormatError:
        m = re.fullmatch(r"\s*(\d{1,6})\s*\+\s*(\d{1,6})\s*", text)
        return Draft("", (f"{m[1]} + {m[2]}",)) if m else FormatError("not a + b")

    def verify(self, texts, runner, *, bases=None, teachers=None, step=None) -> list[Validity]:
        out = []
        for t in texts:
            p = self.parse_proposal(t)
            if isinstance(p, FormatError):
                out.append(Validity(False, p.reason, format_error=True))
            else:
                a, b = (int(x) for x in p.inputs[0].split("+"))
                out.append(
                    Validity(True, task=Task(self.name, "", p.inputs, (str(a + b),), step=step))
                )
        return out

    def student_prompt(self, task: Task) -> str:
        return f"{task.input} = "

    def parse_answer(self, text: str) -> str | FormatError:
        m = re.match(r"\s*(-?\d+)", text)
        return m[1] if m else FormatError("no integer")

    def check(self, tasks, texts, runner) -> list[Grade]:
        out = []
        for task, text in zip(tasks, texts, strict=True):
            a = self.parse_answer(text)
            if isinstance(a, FormatError):
                out.append(Grade(Outcome.FORMAT_ERROR, None, a.reason))
            else:
                ok = int(a) == int(task.output)
                out.append(Grade(Outcome.CORRECT if ok else Outcome.WRONG, a))
        return out


def test_code_families_implement_the_interface():
    for name in ("code_o", "code_i", "code_f"):
        fam = get_family(name, template="compact")
        assert isinstance(fam, TaskFamily) and fam.name == name and fam.template == "compact"
        assert all(t.type == name for t in fam.seed_tasks())
    assert get_family("code_f").needs_base and not get_family("code_o").needs_base
    assert get_family("code_f", n_inputs=6).n_inputs == 6


def test_unknown_family_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown task family 'mathz'"):
        get_family("mathz")


def test_a_new_domain_plugs_in_without_other_changes(tmp_path):
    register_family("sums", Sums)
    try:
        fam = get_family("sums")
        assert isinstance(fam, TaskFamily)
        buf = TaskBuffer("sums", seeds=fam.seed_tasks())
        assert "1 + 1" in fam.teacher_prompt(buf.sample(6))
        v = fam.verify(["12 + 30", "twelve"], runner=None, step=1)
        assert [x.valid for x in v] == [True, False] and v[1].format_error
        buf.add(v[0].task)
        grades = fam.check([v[0].task] * 3, ["42", "41", "?"], runner=None)
        assert [g.outcome for g in grades] == [Outcome.CORRECT, Outcome.WRONG, Outcome.FORMAT_ERROR]
        buf.save(tmp_path / "sums.jsonl")
        assert len(TaskBuffer.load(tmp_path / "sums.jsonl", "sums")) == 2
        with pytest.raises(ValueError, match="already registered"):
            register_family("sums", lambda **kw: Sums(**kw))
    finally:
        FAMILIES.pop("sums", None)
