"""What one self-play step leaves behind: its records, and the metrics.jsonl row made of them."""

from __future__ import annotations

from dataclasses import dataclass, field
from statistics import fmean
from typing import TYPE_CHECKING, Any

from lorapop.rl import solve_rate
from lorapop.tasks.metrics import program_metrics
from lorapop.tasks.task import Grade, Outcome, Task, Validity

if TYPE_CHECKING:
    from lorapop.loop import SelfPlay


@dataclass
class Rollout:
    """One sampled completion that the update phase trains on."""

    member: str
    role: str  # "teacher" | "student"
    type: str  # task family name
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    text: str = ""
    reward: float = 0.0


@dataclass
class ProposalSlot:
    """A teacher's proposal of one task of one type, from prompt to validity."""

    teacher: str
    type: str
    base: Task | None
    rollout: Rollout | None = None
    validity: Validity | None = None


@dataclass
class Attempt:
    """A student's answer to one task of a match."""

    teacher: str
    student: str
    task: Task
    own: bool  # the task is the teacher's own proposal of this step (not a buffer fill)
    rollout: Rollout
    grade: Grade | None = None


@dataclass
class StepRecord:
    step: int
    pairs: list[tuple[str, str]] = field(default_factory=list)
    proposals: list[ProposalSlot] = field(default_factory=list)
    attempts: list[Attempt] = field(default_factory=list)
    phase_s: dict[str, float] = field(default_factory=dict)
    generated_tokens: int = 0
    generation_s: float = 0.0
    replacements: list[dict[str, Any]] = field(default_factory=list)
    grad_norms: dict[str, float] = field(default_factory=dict)


def step_metrics(sp: SelfPlay, rec: StepRecord) -> dict[str, Any]:
    """The metrics.jsonl row of one step: per member, per matchup, per task type."""
    members: dict[str, dict[str, Any]] = {}
    for name in sp.members:
        props = [p for p in rec.proposals if p.teacher == name]
        atts = [a for a in rec.attempts if a.student == name]
        mine = [p.rollout for p in props] + [a.rollout for a in atts]
        m: dict[str, Any] = {"slot": sp.slot[name], "role": sp.role(name)}
        if props:
            m["teacher_reward"] = fmean(p.rollout.reward for p in props)
            m["valid_rate"] = fmean(bool(p.validity and p.validity.valid) for p in props)
            m["proposal_format_error_rate"] = fmean(
                bool(p.validity and p.validity.format_error) for p in props)
            own = [a for a in rec.attempts if a.teacher == name and a.own]
            m["task_solve_rate"] = solve_rate([a.grade.outcome for a in own])
        if atts:
            m["student_reward"] = fmean(a.rollout.reward for a in atts)
            m["solve_rate"] = solve_rate([a.grade.outcome for a in atts])
            m["answer_format_error_rate"] = fmean(
                a.grade.outcome is Outcome.FORMAT_ERROR for a in atts)
        if mine:
            m["response_tokens"] = fmean(len(r.token_ids) for r in mine)
            m["entropy"] = _entropy_estimate(mine)
        if not sp.single:
            rating = sp.ratings.get(name)
            m["mu"], m["sigma"] = rating.mu, rating.sigma
        m["grad_norm"] = rec.grad_norms.get(name)
        members[name] = m
    matchups = []
    for teacher, student in rec.pairs:
        own = [a for a in rec.attempts if a.teacher == teacher and a.student == student
               and a.own]
        rate = solve_rate([a.grade.outcome for a in own])
        matchups.append({"teacher": teacher, "student": student, "answers": len(own),
                         "solve_rate": rate})
    programs = {}
    for t in sp.families:
        valid = [p.validity.task for p in rec.proposals
                 if p.type == t and p.validity and p.validity.valid and p.validity.task]
        stats = [program_metrics(task.program) for task in valid]
        stats = [s for s in stats if s is not None]
        cov = sp.coverage[t].update([task.program for task in valid])
        programs[t] = {
            "valid": len(valid),
            "proposed": sum(p.type == t for p in rec.proposals),
            "buffer": len(sp.buffers[t]),
            **{k: (fmean(getattr(s, k) for s in stats) if stats else None)
               for k in ("ast_depth", "cyclomatic", "loc", "variables")},
            "coverage": cov.total_distinct,
            "coverage_new": cov.new,
            "distinct_in_step": cov.batch_distinct,
        }
    return {
        "step": rec.step,
        "members": members,
        "matchups": matchups,
        "programs": programs,
        "replacements": rec.replacements,
        "phase_s": {k: round(v, 4) for k, v in rec.phase_s.items()},
        "tokens_per_s": rec.generated_tokens / rec.generation_s if rec.generation_s else 0.0,
        "generated_tokens": rec.generated_tokens,
    }


def solve_rates(attempts: list[Attempt]) -> dict[tuple[str, str], float]:
    """Solve rate of each teacher's own task (by task key) over all its matched students' answers."""
    by: dict[tuple[str, str], list[Outcome]] = {}
    for a in attempts:
        if a.own:
            by.setdefault((a.teacher, a.task.key), []).append(a.grade.outcome)
    return {k: solve_rate(v) for k, v in by.items()}


def _entropy_estimate(rollouts: list[Rollout]) -> float | None:
    """Mean negative log-probability of sampled tokens: a Monte Carlo estimate of the policy's
    per-token entropy that needs no extra forward pass."""
    lps = [lp for r in rollouts for lp in r.logprobs]
    return -fmean(lps) if lps else None
