"""What one self-play step leaves behind: its records, and the metrics.jsonl row made of them.

Each phase of the loop returns frozen records; `StepRecord` gathers them and `step_metrics`
turns it, with a read-only summary of the league, into one JSON row. Nothing here changes
training state, so logging a step (or not) never changes the run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from statistics import fmean, pvariance
from typing import Any

from lorapop.league import Role
from lorapop.rl import solve_rate, solve_rates
from lorapop.tasks.metrics import CoverageStep, program_metrics
from lorapop.tasks.task import Grade, Outcome, Task, Validity


@dataclass(frozen=True)
class Rollout:
    """One sampled completion that the update phase trains on."""

    member: str
    role: Role  # the role the member played in this completion
    type: str  # task family name
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]  # the sampler's, per generated token
    text: str = ""


@dataclass(frozen=True)
class Proposal:
    """A teacher's generated proposal of one task of one type (`base`: code_f's program)."""

    teacher: str
    type: str
    base: Task | None
    rollout: Rollout


@dataclass(frozen=True)
class Verification:
    """The sandbox's judgement of a step's proposals, and what the valid ones added."""

    validities: list[Validity]  # one per proposal, in order
    coverage: dict[str, CoverageStep | None]  # per task type: distinct program shapes the
    # teachers wrote (None: code_f, whose programs are copied from the buffer)
    buffer_sizes: dict[str, int]  # per task type, after the valid tasks were added


@dataclass(frozen=True)
class Attempt:
    """A student's graded answer to one task of a match."""

    teacher: str
    student: str
    task: Task
    own: bool  # the task is the teacher's own proposal of this step (not a buffer fill)
    rollout: Rollout
    grade: Grade


@dataclass(frozen=True)
class Update:
    """What the update phase computed: rewards and TRR++ advantages (aligned with proposals
    and attempts), the per-member policy-gradient loss and gradient norm before clipping."""

    teacher_rewards: list[float]
    student_rewards: list[float]
    losses: dict[str, float]  # member -> its loss (members without trained tokens absent)
    grad_norms: dict[str, float]  # member -> norm; empty when nothing was trained
    teacher_advantages: list[float | None]  # None: an empty completion, not trained on
    student_advantages: list[float | None]
    kl: dict[str, float] = field(default_factory=dict)  # member -> per-token KL of the update
    # on a subsample of the step's rollouts (`train.kl_rows`; empty when off)


@dataclass(frozen=True)
class SolverAnswer:
    """The fixed solver's graded answer to one of a teacher's valid tasks (`difficulty`)."""

    teacher: str
    task: Task
    grade: Grade


@dataclass(frozen=True)
class Difficulty:
    """The step's tasks as a fixed solver saw them (`cfg.difficulty`): who solved, its answers."""

    solver: str
    answers: list[SolverAnswer]


@dataclass(frozen=True)
class StepRecord:
    step: int
    pairs: list[tuple[str, str]]
    proposals: list[Proposal]
    verification: Verification
    attempts: list[Attempt]
    update: Update
    replacements: list[dict[str, Any]]
    phase_s: dict[str, float]
    generated_tokens: int
    generation_s: float
    # per phase, where this rank's generation time went (`generate(timing=...)`: prefill_s,
    # prefill_tokens, capture_s, decode_s, steps): a small model's steps can be mostly graph
    # captures
    generation: dict[str, dict[str, float]] = field(default_factory=dict)
    difficulty: Difficulty | None = None  # None: not measured at this step


@dataclass(frozen=True)
class MemberInfo:
    """A league member as the metrics row shows it, read after the step's replacement."""

    slot: int
    role: str  # "teacher" | "student", or "solo" for the single-agent baseline's A0
    mu: float | None = None  # rating (None: the baseline has no ratings)
    sigma: float | None = None
    individual: str | None = None  # who holds the slot (`T0.g3`, `lorapop.league.lineage`)


#: a row's wall-time fields: two runs that train alike still differ in them
TIMINGS = ("phase_s", "tokens_per_s", "generation")


def without_timings(row: dict[str, Any], also: tuple[str, ...] = ()) -> dict[str, Any]:
    """The row less its wall times (and the fields in `also`): what repeats between runs."""
    return {k: v for k, v in row.items() if k not in TIMINGS and k not in also}


def step_metrics(rec: StepRecord, league: dict[str, MemberInfo]) -> dict[str, Any]:
    """The metrics.jsonl row of one step: per member, per matchup, per task type."""
    valid = [v.valid for v in rec.verification.validities]
    members: dict[str, dict[str, Any]] = {}
    for name, info in league.items():
        props = [i for i, p in enumerate(rec.proposals) if p.teacher == name]
        atts = [i for i, a in enumerate(rec.attempts) if a.student == name]
        mine = [rec.proposals[i].rollout for i in props] + [rec.attempts[i].rollout for i in atts]
        m: dict[str, Any] = {"slot": info.slot, "role": info.role}
        if info.individual is not None:
            m["individual"] = info.individual
        if props:
            m["teacher_reward"] = fmean(rec.update.teacher_rewards[i] for i in props)
            m["valid_rate"] = fmean(valid[i] for i in props)
            m["proposal_format_error_rate"] = fmean(
                rec.verification.validities[i].format_error for i in props)
            m["task_solve_rate"] = solve_rate(
                a.grade.outcome for a in rec.attempts if a.teacher == name and a.own)
        if atts:
            m["student_reward"] = fmean(rec.update.student_rewards[i] for i in atts)
            m["solve_rate"] = solve_rate(rec.attempts[i].grade.outcome for i in atts)
            m["answer_format_error_rate"] = fmean(
                rec.attempts[i].grade.outcome is Outcome.FORMAT_ERROR for i in atts)
        if mine:
            m["response_tokens"] = fmean(len(r.token_ids) for r in mine)
            m["entropy"] = _entropy_estimate(mine)
        if info.mu is not None:
            m["mu"], m["sigma"] = info.mu, info.sigma
        m["grad_norm"] = rec.update.grad_norms.get(name)
        m["loss"] = rec.update.losses.get(name)
        if name in rec.update.kl:
            m["kl"] = rec.update.kl[name]
        members[name] = m
    matchups = []
    for teacher, student in rec.pairs:
        own = [a for a in rec.attempts if a.teacher == teacher and a.student == student
               and a.own]
        matchups.append({"teacher": teacher, "student": student, "answers": len(own),
                         "solve_rate": solve_rate(a.grade.outcome for a in own)})
    rates = list(solve_rates(((a.teacher, a.task.key), a.grade.outcome)
                             for a in rec.attempts if a.own).values())
    rewards = rec.update.teacher_rewards
    programs = {}
    for t, cov in rec.verification.coverage.items():
        accepted = [(p, v.task) for p, v in zip(rec.proposals, rec.verification.validities,
                                                strict=True)
                    if p.type == t and v.valid and v.task is not None]
        # complexity and coverage of programs the teacher wrote, not code_f's copied ones
        stats = [s for p, task in accepted
                 if p.base is None and (s := program_metrics(task.program)) is not None]
        own = [a.grade.outcome for a in rec.attempts if a.own and a.task.type == t]
        programs[t] = {
            "valid": len(accepted),
            "proposed": sum(p.type == t for p in rec.proposals),
            # the students' answers to this step's own tasks of the type: which type holds
            # a solve rate down (code_f, whose tasks students induce from a few pairs)
            "answers": len(own),
            "solve_rate": solve_rate(own),
            "buffer": rec.verification.buffer_sizes[t],
            **{k: (fmean(getattr(s, k) for s in stats) if stats else None)
               for k in ("ast_depth", "cyclomatic", "loc", "variables")},
            "coverage": None if cov is None else cov.total_distinct,
            "coverage_new": None if cov is None else cov.new,
            "distinct_in_step": None if cov is None else cov.batch_distinct,
        }
    row = {
        "step": rec.step,
        "members": members,
        "matchups": matchups,
        "programs": programs,
        # how informative the teacher signal is: solve rates of this step's own valid tasks
        # (a task at 0 or 1 earns its teacher nothing) and the spread of teacher rewards
        "task_solve_rates": {"tasks": len(rates),
                             "partial": fmean(0 < r < 1 for r in rates) if rates else None,
                             "unsolved": fmean(r == 0 for r in rates) if rates else None,
                             "all_solved": fmean(r == 1 for r in rates) if rates else None},
        "teacher_reward_var": pvariance(rewards) if len(rewards) > 1 else None,
        "replacements": rec.replacements,
        "phase_s": {k: round(v, 4) for k, v in rec.phase_s.items()},
        "tokens_per_s": rec.generated_tokens / rec.generation_s if rec.generation_s else 0.0,
        "generated_tokens": rec.generated_tokens,
        "generation": {ph: {k: round(v, 4) for k, v in t.items()} for ph, t in rec.generation.items()},
    }
    if rec.difficulty is not None:
        row["difficulty"] = difficulty_metrics(rec.difficulty)
    return row


def difficulty_metrics(d: Difficulty) -> dict[str, Any]:
    """The fixed solver's solve rate of the step's tasks: the mean over tasks of each task's
    share of correct answers, overall, per teacher and per task type (None: no valid task)."""
    rates = solve_rates(((a.teacher, a.task.type, a.task.key), a.grade.outcome)
                        for a in d.answers)

    def mean(keep: Any) -> float | None:
        xs = [r for k, r in rates.items() if keep(k)]
        return fmean(xs) if xs else None

    teachers = sorted({k[0] for k in rates})
    types = sorted({k[1] for k in rates})
    return {"solver": d.solver, "tasks": len(rates), "answers": len(d.answers),
            "solve_rate": mean(lambda k: True),
            "by_teacher": {t: mean(lambda k, t=t: k[0] == t) for t in teachers},
            "by_type": {t: mean(lambda k, t=t: k[1] == t) for t in types}}


def _entropy_estimate(rollouts: list[Rollout]) -> float | None:
    """Mean negative log-probability of sampled tokens: a Monte Carlo estimate of the policy's
    per-token entropy that needs no extra forward pass."""
    lps = [lp for r in rollouts for lp in r.logprobs]
    return -fmean(lps) if lps else None
