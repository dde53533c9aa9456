"""Verified tasks: sandbox outputs, plain execution, seeds, the train / held-out split."""

import pytest

from lorapop.tasks.code import split_pairs
from lorapop.tiny.generator import generate_tasks, generate_triples, normalize, program_split
from lorapop.tiny.grammar import LEVELS
from lorapop.verify import Job, Sandbox


def _plain(program: str, inp: str) -> str:
    """Plain execution of our own (trusted) program, as the reference."""
    ns: dict = {}
    exec(program, ns)
    return repr(eval(f"f({inp})", ns))


@pytest.fixture(scope="module")
def tasks(tiny_sandbox: Sandbox) -> dict:
    return {
        kind: [t for lv in LEVELS for t in generate_tasks(kind, 2, lv, 7, sandbox=tiny_sandbox)]
        for kind in ("code_o", "code_i", "code_f")
    }


def test_every_task_verifies_and_matches_plain_execution(tasks: dict, tiny_sandbox) -> None:
    all_tasks = [t for ts in tasks.values() for t in ts]
    assert len(all_tasks) == 3 * 2 * len(LEVELS)
    jobs = [Job(t.program, f"f({i})", deterministic=True) for t in all_tasks for i in t.inputs]
    verdicts = iter(tiny_sandbox.run(jobs))
    for t in all_tasks:
        for inp, out in zip(t.inputs, t.outputs, strict=True):
            v = next(verdicts)
            assert v.ok, (t.program, inp, v)
            assert v.output == out == _plain(t.program, inp)
            assert len(out) <= 60


def test_task_shapes_per_kind(tasks: dict) -> None:
    for kind, ts in tasks.items():
        assert [t.meta["difficulty"] for t in ts] == [lv for lv in LEVELS for _ in range(2)]
        for t in ts:
            assert t.type == kind and program_split(t.program) == "train"
            if kind == "code_f":
                assert len(t.inputs) == 6 and len(set(t.inputs)) == 6
                assert t.message.startswith("f takes ")
                visible, hidden = split_pairs(t)
                assert len(visible) == len(hidden) == 3
                assert len(set(t.outputs)) > 1
            else:
                assert len(t.inputs) == len(t.outputs) == 1 and t.message == ""
        programs = [normalize(t.program) for t in ts]
        assert len(set(programs)) == len(programs)


def test_same_seed_same_tasks_other_seed_other_tasks(tiny_sandbox: Sandbox, tasks: dict) -> None:
    again = generate_tasks("code_o", 2, 3, 7, sandbox=tiny_sandbox)
    assert again == [t for t in tasks["code_o"] if t.meta["difficulty"] == 3]
    other = generate_tasks("code_o", 2, 3, 8, sandbox=tiny_sandbox)
    assert {t.program for t in other}.isdisjoint(t.program for t in again)


def test_triples_and_heldout_split(tiny_sandbox: Sandbox) -> None:
    triples = generate_triples(3, 2, seed=1, sandbox=tiny_sandbox)
    assert len(triples) == 3
    for program, inp, out in triples:
        assert _plain(program, inp) == out
    held = generate_tasks("code_o", 3, 2, 1, sandbox=tiny_sandbox, split="heldout")
    assert all(program_split(t.program) == "heldout" for t in held)
    assert {t.program for t in held}.isdisjoint(p for p, _, _ in triples)


def test_exclude_skips_given_programs(tiny_sandbox: Sandbox) -> None:
    first = generate_tasks("code_o", 2, 1, 11, sandbox=tiny_sandbox)
    skip = frozenset(normalize(t.program) for t in first)
    second = generate_tasks("code_o", 2, 1, 11, sandbox=tiny_sandbox, exclude=skip)
    assert not skip & {normalize(t.program) for t in second}


def test_bad_arguments_give_clear_errors(tiny_sandbox: Sandbox) -> None:
    with pytest.raises(ValueError, match="kind"):
        generate_tasks("code_x", 1, 1, sandbox=tiny_sandbox)
    with pytest.raises(ValueError, match="split"):
        generate_tasks("code_o", 1, 1, split="test", sandbox=tiny_sandbox)
    with pytest.raises(ValueError, match="difficulty"):
        generate_tasks("code_o", 1, 9, sandbox=tiny_sandbox)
    with pytest.raises(RuntimeError, match="verified"):
        generate_tasks("code_o", 5, 1, sandbox=tiny_sandbox, max_candidates=2)
