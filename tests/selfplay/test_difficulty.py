"""The frozen solver's view of the teachers' tasks (`cfg.difficulty`), on the shipped tiny model."""

import json
from pathlib import Path

import pytest
import torch

from lorapop.config import ConfigError, load_config
from lorapop.run.report import plot_difficulty, write_report
from lorapop.selfplay.loop import SelfPlay, _Clock
from lorapop.selfplay.records import Difficulty, SolverAnswer, difficulty_metrics, without_timings
from lorapop.tasks.task import Grade, Outcome, Task

FAST = [
    "tasks.types=[code_o, code_i, code_f]", "tasks.code_f_inputs=4", "tasks.references=1",
    "sampling.teacher_max_new_tokens=48", "sampling.student_max_new_tokens=8",
    "tasks.proposals_per_type=2", "train.micro_batch_size=64", "evolve.every=2",
    "evolve.protect_matches=0", "run.save_every=2", "verify.timeout_s=5",
]
ON = ["difficulty.every=1", "difficulty.samples=2", "difficulty.answers=2"]


def _cfg(*extra):
    return load_config(Path(__file__).parents[2] / "configs" / "tiny.yaml", [*FAST, *extra])


def _train(cfg, run_dir, steps, **step_kw):
    sp = SelfPlay(cfg, run_dir)
    try:
        for _ in range(steps):
            sp.step(**step_kw)
        weights = sp.parts.bank.weights.detach().clone()
        buffers = {t: [task.key for task in b] for t, b in sp.parts.buffers.items()}
    finally:
        sp.close()
    rows = [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return rows, weights, buffers


@pytest.fixture(scope="module")
def off(tmp_path_factory):
    """Three steps without the solver: rows, adapter weights, buffers."""
    return _train(_cfg(), tmp_path_factory.mktemp("off"), 3)


@pytest.fixture(scope="module")
def off_kept(tmp_path_factory):
    """The same with kept decoders: the run above to float rounding, not bit for bit (their
    bucketed shapes batch rows otherwise), so a run with them is compared with this one."""
    return _train(_cfg("sampling.keep_decoders=2"), tmp_path_factory.mktemp("off_kept"), 3)


def test_measuring_difficulty_leaves_the_run_as_it_was(tmp_path, off):
    """Same rows (less timings and the difficulty itself), same adapters, same buffers, through
    a replacement (step 2), with the solver measuring at every step."""
    off, w_off, b_off = off
    on, w_on, b_on = _train(_cfg(*ON), tmp_path / "on", 3)
    assert all("difficulty" not in r for r in off)
    assert [without_timings(r, ("difficulty",)) for r in on] == [without_timings(r) for r in off]
    assert torch.equal(w_on, w_off) and b_on == b_off
    valid_tasks = 0
    for r in on:
        d = r["difficulty"]
        assert d["solver"] == "base" and set(d["by_teacher"]) <= {"T0", "T1"}
        assert d["tasks"] <= 2 * 2 and d["answers"] == 2 * d["tasks"]  # samples x teachers
        assert (d["solve_rate"] is None) == (d["tasks"] == 0)
        valid_tasks += d["tasks"]
    assert valid_tasks  # the tiny model's teachers write some valid tasks in 3 steps


def test_a_frozen_member_leaves_the_run_as_it_was_and_is_checkpointed(tmp_path, off_kept):
    """S1 copied after step 2's update (before its replacement), measuring from then on; the
    copy is in the step-2 checkpoint, so a resumed run measures step 3 as the straight one.
    Kept decoders (whose caches follow the bank) see the members again after the solver."""
    off, w_off, b_off = off_kept
    cfg = _cfg(*ON, "difficulty.solver=S1", "difficulty.freeze_step=2",
               "sampling.keep_decoders=2")
    sp = SelfPlay(cfg, tmp_path / "on")
    seen = {}
    try:
        rows = [sp.step(before_replacement=lambda s: seen.update(
            s1=sp.parts.bank.weights[sp.parts.slot["S1"]].detach().clone())) for _ in range(2)]
        sp.save()
        rows.append(sp.step())
        assert torch.equal(sp.parts.solver, seen["s1"])  # S1 as it trained to step 2
        assert not torch.equal(sp.parts.solver, sp.parts.bank.weights[sp.parts.slot["S1"]])
        assert torch.equal(sp.parts.bank.weights, w_off)
    finally:
        sp.close()
    assert [without_timings(r, ("difficulty",)) for r in rows] == [without_timings(r) for r in off]
    assert ["difficulty" in r for r in rows] == [False, True, True]
    assert rows[1]["difficulty"]["solver"] == "S1"
    (tmp_path / "on" / "metrics.jsonl").write_text("".join(
        json.dumps(r) + "\n" for r in rows[:2]))  # as a run killed in step 3 leaves it
    again = SelfPlay(cfg, tmp_path / "on", resume=True)
    try:
        assert torch.equal(again.parts.solver, seen["s1"])
        assert without_timings(again.step()) == without_timings(rows[2])
    finally:
        again.close()


def test_the_solver_is_the_base_model(tmp_path):
    """Its answers do not move when every adapter does, and it draws the same from its seed."""
    sp = SelfPlay(_cfg(*ON, "difficulty.samples=0"), tmp_path)
    try:
        props = sp.proposal(1, _Clock())
        ver = sp.verification(1, props)
        first = sp.difficulty(1, props, ver.validities, _Clock())
        assert first.answers  # the tiny model wrote valid tasks
        with torch.no_grad():
            sp.parts.bank.weights.normal_(generator=torch.Generator().manual_seed(0))
        sp.parts.bank.invalidate_caches()
        again = sp.difficulty(1, props, ver.validities, _Clock())
        assert again == first
        mine = sum(v.valid for v in ver.validities)
        assert len(first.answers) == 2 * mine  # samples=0: every valid task, 2 answers each
    finally:
        sp.close()


def test_before_replacement_sees_the_members_that_are_replaced(tmp_path):
    seen = {}
    sp = SelfPlay(_cfg(), tmp_path)

    def look(step):
        seen[step] = {m: sp.parts.lineage.individual(m) for m in sp.parts.slot}

    try:
        rows = [sp.step(before_replacement=look) for _ in range(2)]
    finally:
        sp.close()
    assert list(seen) == [2]  # only where a replacement follows
    for rep in rows[1]["replacements"]:
        assert seen[2][rep["target"]] == rep["replaced"] != rows[1]["members"][rep["target"]][
            "individual"]


def test_difficulty_metrics_average_tasks_not_answers():
    def task(i, type_="code_o"):
        return Task(type=type_, program=f"def f(x):\n    return x + {i}", inputs=["1"],
                    outputs=[str(1 + i)])

    ok, bad = Grade(Outcome.CORRECT), Grade(Outcome.WRONG)
    a, b, c = task(1), task(2), task(3, "code_i")
    d = difficulty_metrics(Difficulty("base", [
        SolverAnswer("T0", a, ok), SolverAnswer("T0", a, ok), SolverAnswer("T0", a, ok),
        SolverAnswer("T0", a, bad), SolverAnswer("T0", b, bad), SolverAnswer("T1", c, ok)]))
    assert d["tasks"] == 3 and d["answers"] == 6
    assert d["solve_rate"] == pytest.approx((0.75 + 0 + 1) / 3)
    assert d["by_teacher"] == {"T0": 0.375, "T1": 1.0}
    assert d["by_type"] == {"code_i": 1.0, "code_o": 0.375}
    assert difficulty_metrics(Difficulty("base", []))["solve_rate"] is None


def test_report_draws_the_solver_curve_per_arm_and_teacher(tmp_path):
    rows = [{"step": s, "members": {}, "difficulty": {
        "solver": "base", "tasks": 4, "answers": 8, "solve_rate": 0.5 - 0.1 * s,
        "by_teacher": {"T0": 0.4, "T1": 0.6}, "by_type": {"code_o": 0.5}}} for s in (2, 4, 6)]
    base = [{"step": s, "members": {}, "difficulty": {
        "solver": "base", "tasks": 2, "answers": 4, "solve_rate": 0.7, "by_teacher": {"A0": 0.7},
        "by_type": {}}} for s in (2, 4, 6)]
    assert plot_difficulty({"population": rows, "baseline": base}) is not None
    assert plot_difficulty({"population": [{"step": 1, "members": {}}]}) is None


def test_report_page_has_the_curve(tmp_path):
    on, _, _ = _train(_cfg(*ON, "evolve.every=0"), tmp_path, 2)
    assert all("difficulty" in r for r in on)
    page = write_report(tmp_path).read_text()
    assert "id='difficulty'" in page


def test_bad_difficulty_settings_are_one_line_errors():
    with pytest.raises(ConfigError, match="difficulty.solver"):
        _cfg("difficulty.solver=S9")
    with pytest.raises(ConfigError, match="difficulty.solver"):
        _cfg("difficulty.solver=A0")  # a population has no A0
    assert _cfg("difficulty.solver=A0", "league.mode=single").difficulty.solver == "A0"
    with pytest.raises(ConfigError, match="difficulty.every"):
        _cfg("difficulty.every=-1")
