"""The metrics row: a pure function of one step's records and a league summary."""

import copy
from dataclasses import replace

import pytest

from lorapop.selfplay.records import (
    Attempt,
    MemberInfo,
    Proposal,
    Rollout,
    StepRecord,
    Update,
    Verification,
    step_metrics,
)
from lorapop.tasks.metrics import CoverageStep
from lorapop.tasks.task import Grade, Outcome, Task, Validity

TASK = Task("code_o", "def f(a):\n    return a + 1", ("1",), ("2",), teacher="T0", step=1)


def rollout(member, role, n_tokens, logprob=-0.5):
    return Rollout(member, role, "code_o", [1, 2], list(range(n_tokens)), [logprob] * n_tokens)


def record():
    proposals = [Proposal("T0", "code_o", None, rollout("T0", "teacher", 4)),
                 Proposal("T0", "code_o", None, rollout("T0", "teacher", 2))]
    validities = [Validity(True, task=TASK), Validity(False, "format: no block", format_error=True)]
    outcomes = [Outcome.CORRECT, Outcome.WRONG, Outcome.FORMAT_ERROR]
    attempts = [Attempt("T0", "S0", TASK, True, rollout("S0", "student", 3, -1.0), Grade(o))
                for o in outcomes]
    attempts.append(Attempt("T0", "S0", TASK, False, rollout("S0", "student", 1, -1.0),
                            Grade(Outcome.CORRECT)))  # a buffer fill: not the teacher's match
    return StepRecord(
        step=7, pairs=[("T0", "S0")], proposals=proposals,
        verification=Verification(validities, {"code_o": CoverageStep(1, 1, 1, 1, 5)},
                                   {"code_o": 9}),
        attempts=attempts,
        update=Update([0.5, -1.0], [1.0, -0.5, -1.0, 1.0], {"T0": 0.25, "S0": -0.1},
                      {"T0": 0.3, "S0": 0.2}, [0.7, -0.7], [1.1, -0.2, -0.9, None]),
        replacements=[], phase_s={"update": 0.123456}, generated_tokens=13, generation_s=2.0,
    )


LEAGUE = {"T0": MemberInfo(0, "teacher", 27.0, 7.0), "S0": MemberInfo(1, "student", 23.0, 6.0)}


def test_members_matchups_and_programs_come_from_the_records():
    row = step_metrics(record(), LEAGUE)
    t0, s0 = row["members"]["T0"], row["members"]["S0"]
    assert t0["teacher_reward"] == pytest.approx(-0.25)
    assert (t0["valid_rate"], t0["proposal_format_error_rate"]) == (0.5, 0.5)
    assert t0["task_solve_rate"] == pytest.approx(1 / 3)  # own tasks only, not the fill
    assert t0["response_tokens"] == 3 and t0["entropy"] == pytest.approx(0.5)
    assert (t0["mu"], t0["sigma"], t0["loss"], t0["grad_norm"]) == (27.0, 7.0, 0.25, 0.3)
    assert "student_reward" not in t0 and "teacher_reward" not in s0
    assert s0["student_reward"] == pytest.approx(0.125)
    assert s0["solve_rate"] == 0.5 and s0["answer_format_error_rate"] == 0.25
    assert row["matchups"] == [{"teacher": "T0", "student": "S0", "answers": 3,
                                "solve_rate": pytest.approx(1 / 3)}]
    prog = row["programs"]["code_o"]
    assert (prog["valid"], prog["proposed"], prog["buffer"]) == (1, 2, 9)
    assert (prog["coverage"], prog["coverage_new"], prog["distinct_in_step"]) == (5, 1, 1)
    assert prog["loc"] == 2
    assert (prog["answers"], prog["solve_rate"]) == (3, pytest.approx(1 / 3))  # own answers only
    assert row["phase_s"] == {"update": 0.1235} and row["tokens_per_s"] == 6.5
    # the one own task was solved by 1 of 3 answers: informative (0 < s < 1)
    assert row["task_solve_rates"] == {"tasks": 1, "partial": 1.0, "unsolved": 0.0,
                                       "all_solved": 0.0}
    assert row["teacher_reward_var"] == pytest.approx(0.5625)  # rewards 0.5 and -1.0


def test_the_row_changes_nothing_and_repeats():
    rec = record()
    before = copy.deepcopy(rec)
    assert step_metrics(rec, LEAGUE) == step_metrics(rec, LEAGUE)
    assert rec == before


def test_baseline_member_has_no_rating_and_untrained_member_no_loss():
    rec = record()
    row = step_metrics(rec, {"T0": MemberInfo(0, "solo"), "S9": MemberInfo(2, "student")})
    assert "mu" not in row["members"]["T0"] and row["members"]["T0"]["role"] == "solo"
    assert row["members"]["S9"] == {"slot": 2, "role": "student", "grad_norm": None,
                                    "loss": None}


def test_rows_name_individuals_and_count_only_programs_the_teacher_wrote():
    """code_f's program comes from the buffer: it adds no complexity and no coverage."""
    rec = record()
    code_f = Task("code_f", "def f(a):\n    if a:\n        return 1\n    return 2", ("1",), ("1",),
                  teacher="T0", step=1)
    proposals = [*rec.proposals, Proposal("T0", "code_f", code_f, rollout("T0", "teacher", 2))]
    validities = [*rec.verification.validities, Validity(True, task=code_f)]
    rec = replace(rec, proposals=proposals,
                  verification=Verification(validities, {**rec.verification.coverage,
                                                         "code_f": None},
                                            {**rec.verification.buffer_sizes, "code_f": 3}),
                  update=replace(rec.update, teacher_rewards=[*rec.update.teacher_rewards, 0.0]))
    league = {**LEAGUE, "T0": replace(LEAGUE["T0"], individual="T0.g2")}
    row = step_metrics(rec, league)
    assert row["members"]["T0"]["individual"] == "T0.g2"
    assert "individual" not in row["members"]["S0"]  # not given: readers treat it as S0.g0
    prog = row["programs"]["code_f"]
    assert (prog["valid"], prog["proposed"], prog["buffer"]) == (1, 1, 3)
    assert all(prog[k] is None for k in ("ast_depth", "cyclomatic", "loc", "variables",
                                         "coverage", "coverage_new", "distinct_in_step",
                                         "solve_rate"))
    assert prog["answers"] == 0  # no student answered a code_f task this step
    assert row["programs"]["code_o"]["loc"] == 2  # the teacher's own program still counts
