"""Is a base model in the regime where self-play can show the paper's effect? Measure it.

Before any self-play, a world must have: proposals mostly valid at temperature 1;
a student that solves some but not all of its own tasks, fewer at higher levels; code_f
solvable at all; and proposals that depend on the references shown (else a teacher has no cue
to raise difficulty). `measure_world` measures each on the plain base model (or one adapter
slot), as the loop would use it:

- proposals: for each level L (1..5) and task type, `proposals` teacher prompts whose
  references are all level-L tasks of the train split (code_f: a level-L base program), sampled
  at temperature 1 and verified by the families, as the loop verifies them. A proposal's level
  is the level of what it was shown.
- solving: the same model answers each valid task `answers` times at temperature 1; the task's
  solve rate s is the share of correct answers. Reported by level and type, with the share of
  tasks at 0 < s < 1 and the teacher reward those tasks would earn (PopuLoRA's rule).
- the teacher's reward landscape: the mean teacher reward of a proposal at each level, invalid
  ones included (-1). Where it falls with the level, a teacher that follows its reward drifts
  to easy tasks (the single agent's collapse); where it rises, to hard ones.
- complexity drift: per level, the cyclomatic complexity of valid code_o/code_i proposals minus
  that of the references shown. The loop's references come from the buffer of past valid
  proposals, so a positive drift raises the complexity of proposals step by step without any
  learning, against the reward landscape's pull.
- reference dependence: for each valid code_o/code_i proposal, the highest text similarity
  (difflib ratio of the normalised programs) to the references it was shown vs to as many
  references of the same level it was not shown; dependence is the mean difference (0 when
  proposals ignore their references), with the share of proposals closer to a shown one and
  the share that copy a shown reference outright.
"""

from __future__ import annotations

import difflib
import random
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from statistics import fmean, pvariance
from typing import Any

from lorapop.engine.generate import GenerateSpec, SamplingParams, generate
from lorapop.rl import RewardScheme, teacher_reward
from lorapop.tasks import Outcome, Runner, Task, get_family, program_metrics
from lorapop.tasks.domain import WorldRules
from lorapop.tiny.evaluate import MAX_NEW
from lorapop.tiny.generator import KINDS, generate_tasks, normalize
from lorapop.tiny.grammar import LEVELS, table_level
from lorapop.tiny.world import CODE_F_INPUTS
from lorapop.verify import Sandbox

Pools = Mapping[int, Mapping[str, Sequence[Task]]]  # level -> task type -> tasks
def world_pools(
    per_level: int, sandbox: Sandbox, *, seed: str = "world-pool", code_f_inputs: int = CODE_F_INPUTS,
    levels: Sequence[int] = tuple(LEVELS), table: str = "standard",
) -> dict[int, dict[str, list[Task]]]:  # fmt: skip
    """Train-split grammar tasks per level (of level table `table`) and type to draw references
    (and code_f bases) from."""
    return {
        lv: {k: generate_tasks(k, per_level, table_level(lv, table), f"{seed}/{k}",
                               sandbox=sandbox, n_inputs=code_f_inputs if k == "code_f" else 6)
             for k in KINDS}
        for lv in levels
    }  # fmt: skip


@dataclass(frozen=True)
class _Ask:
    level: int
    kind: str
    shown: tuple[Task, ...]
    unshown: tuple[Task, ...]
    base: Task | None


def similarity(a: str, b: str) -> float:
    """difflib's ratio of two programs after `normalize` (formatting does not count)."""
    return difflib.SequenceMatcher(None, normalize(a), normalize(b), autojunk=False).ratio()


def measure_world(
    model: Any,
    tokenizer: Any,
    runner: Runner,
    pools: Pools,
    *,
    proposals: int = 20,
    references: int = 2,
    answers: int = 8,
    code_f_inputs: int = CODE_F_INPUTS,
    temperature: float = 1.0,
    teacher_max_new_tokens: int = 256,
    bank: Any = None,
    slot: int = 0,
    batch_size: int | None = 256,
    seed: int = 0,
    rules: WorldRules | None = None,
) -> dict:
    """The regime measurements (module doc) of one model; a JSON-able dict. `rules`: the
    world's rules (`grammar.TABLE_RULES`), under which a proposal is valid (as in the loop)."""
    if proposals < 1 or answers < 1 or references < 1:
        raise ValueError("proposals, answers and references must be >= 1")
    rng = random.Random(f"world/{seed}")
    fams = {k: get_family(k, template="compact", rules=rules,
                          **({"n_inputs": code_f_inputs} if k == "code_f" else {}))
            for k in KINDS}  # fmt: skip
    asks: list[_Ask] = []
    for lv in sorted(pools):
        for kind in KINDS:
            pool = list(pools[lv][kind])
            if len(pool) < 2 * references:
                raise ValueError(f"level {lv} {kind}: need >= {2 * references} pool tasks")
            for _ in range(proposals):
                picked = rng.sample(pool, 2 * references)
                base = rng.choice(pools[lv]["code_o"]) if kind == "code_f" else None
                asks.append(_Ask(lv, kind, tuple(picked[:references]),
                                 tuple(picked[references:]), base))  # fmt: skip
    params = SamplingParams(temperature=temperature, max_new_tokens=teacher_max_new_tokens)
    prompts = [fams[a.kind].teacher_prompt(list(a.shown), a.base) for a in asks]
    gens = generate(model, bank, tokenizer, prompts, [slot] * len(prompts),
                    GenerateSpec(params=params, seed=seed, batch_size=batch_size))  # fmt: skip
    verdicts: list[Any] = [None] * len(asks)
    for kind in KINDS:
        idx = [i for i, a in enumerate(asks) if a.kind == kind]
        vs = fams[kind].verify([gens[i].text for i in idx], runner,
                               bases=[asks[i].base for i in idx])  # fmt: skip
        for i, v in zip(idx, vs, strict=True):
            verdicts[i] = v
    valid = [(a, v.task) for a, v in zip(asks, verdicts, strict=True) if v.valid and v.task]
    rates = _solve(model, tokenizer, runner, fams, [t for _, t in valid], answers,
                   temperature, bank, slot, batch_size, seed)  # fmt: skip
    by_level: dict[int, list[float]] = defaultdict(list)  # every proposal's teacher reward
    valid_rates = iter(rates)
    for a, v in zip(asks, verdicts, strict=True):
        ok = bool(v.valid and v.task)
        by_level[a.level].append(teacher_reward(ok, next(valid_rates) if ok else None))
    return {
        "settings": {"proposals_per_type_and_level": proposals, "references": references,
                     "answers": answers, "code_f_inputs": code_f_inputs,
                     "temperature": temperature, "levels": sorted(pools), "seed": seed},
        **_validity(asks, verdicts),
        **_solving(valid, rates),
        "reference_dependence": _dependence([(a, t) for a, t in valid if a.kind != "code_f"]),
        "teacher_reward_by_level": {str(lv): _mean(xs) for lv, xs in sorted(by_level.items())},
        "complexity_drift_by_level": _drift([(a, t) for a, t in valid if a.kind != "code_f"]),
    }  # fmt: skip


def _solve(model: Any, tokenizer: Any, runner: Runner, fams: Mapping[str, Any],
           tasks: Sequence[Task], answers: int, temperature: float, bank: Any, slot: int,
           batch_size: int | None, seed: int) -> list[float]:  # fmt: skip
    """Each task's solve rate over `answers` sampled answers of the same model."""
    correct = [0] * len(tasks)
    for k, kind in enumerate(KINDS):
        idx = [i for i, t in enumerate(tasks) if t.type == kind]
        if not idx:
            continue
        rows = [i for i in idx for _ in range(answers)]
        params = SamplingParams(temperature=temperature, max_new_tokens=MAX_NEW[kind])
        gens = generate(model, bank, tokenizer, [fams[kind].student_prompt(tasks[i]) for i in rows],
                        [slot] * len(rows),
                        GenerateSpec(params=params, seed=seed + 1 + k, batch_size=batch_size))  # fmt: skip
        grades = fams[kind].check([tasks[i] for i in rows], [g.text for g in gens], runner)
        for i, g in zip(rows, grades, strict=True):
            correct[i] += g.outcome == Outcome.CORRECT
    return [c / answers for c in correct]


def _mean(xs: Sequence[float]) -> float | None:
    return fmean(xs) if xs else None


def _validity(asks: Sequence[_Ask], verdicts: Sequence[Any]) -> dict:
    by: dict[str, dict[int, list[bool]]] = defaultdict(lambda: defaultdict(list))
    reasons: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for a, v in zip(asks, verdicts, strict=True):
        by[a.kind][a.level].append(bool(v.valid))
        if not v.valid:
            reasons[a.kind][v.reason.split(":")[0]] += 1
    return {
        "valid_rate": {k: _mean([x for xs in lv.values() for x in xs]) for k, lv in by.items()},
        "valid_rate_by_level": {k: {str(lv): _mean(xs) for lv, xs in sorted(d.items())}
                                for k, d in by.items()},  # fmt: skip
        "invalid_reasons": {k: dict(sorted(r.items(), key=lambda x: -x[1])[:6])
                            for k, r in reasons.items()},  # fmt: skip
    }


def _solving(valid: Sequence[tuple[_Ask, Task]], rates: Sequence[float]) -> dict:
    by_level: dict[int, list[float]] = defaultdict(list)
    by_type: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    complexity: dict[int, list[float]] = defaultdict(list)
    for (a, t), s in zip(valid, rates, strict=True):
        by_level[a.level].append(s)
        by_type[t.type][a.level].append(s)
        if t.type != "code_f" and (m := program_metrics(t.program)) is not None:
            complexity[a.level].append(m.cyclomatic)
    scheme = RewardScheme()
    rewards = [teacher_reward(True, s, scheme) for s in rates]
    code_f = [s for (_, t), s in zip(valid, rates, strict=True) if t.type == "code_f"]
    return {
        "valid_tasks": len(rates),
        "solve_rate_by_level": {str(lv): _mean(xs) for lv, xs in sorted(by_level.items())},
        "solve_rate_by_type_level": {k: {str(lv): _mean(xs) for lv, xs in sorted(d.items())}
                                     for k, d in by_type.items()},  # fmt: skip
        "solve_rate_levels_1_3": _mean([s for lv, xs in by_level.items() if lv <= 3 for s in xs]),
        "solve_rate_levels_4_5": _mean([s for lv, xs in by_level.items() if lv >= 4 for s in xs]),
        "code_f_solved": _mean(code_f),
        "code_f_any_solved": _mean([float(s > 0) for s in code_f]),
        "share_partial": _mean([float(0 < s < 1) for s in rates]),
        "share_unsolved": _mean([float(s == 0) for s in rates]),
        "share_all_solved": _mean([float(s == 1) for s in rates]),
        "teacher_reward_valid": {"mean": _mean(rewards),
                                 "var": pvariance(rewards) if len(rewards) > 1 else None,
                                 "positive_share": _mean([float(r > 0) for r in rewards])},
        "cyclomatic_by_level": {str(lv): _mean(xs) for lv, xs in sorted(complexity.items())},
    }  # fmt: skip


def _drift(valid: Sequence[tuple[_Ask, Task]]) -> dict[str, float | None]:
    """Per level, the mean cyclomatic complexity of valid proposals minus that of the
    references they were shown."""
    by: dict[int, list[float]] = defaultdict(list)
    for a, t in valid:
        mine = program_metrics(t.program)
        refs = [m.cyclomatic for r in a.shown if (m := program_metrics(r.program)) is not None]
        if mine is not None and refs:
            by[a.level].append(mine.cyclomatic - fmean(refs))
    return {str(lv): _mean(xs) for lv, xs in sorted(by.items())}


def _dependence(valid: Sequence[tuple[_Ask, Task]]) -> dict:
    shown, unshown, closer, copies = [], [], [], []
    for a, t in valid:
        s = max(similarity(t.program, r.program) for r in a.shown)
        u = max(similarity(t.program, r.program) for r in a.unshown)
        shown.append(s)
        unshown.append(u)
        closer.append(float(s > u))
        copies.append(float(any(normalize(t.program) == normalize(r.program) for r in a.shown)))
    diff = [s - u for s, u in zip(shown, unshown, strict=True)]
    return {"n": len(valid), "shown_similarity": _mean(shown),
            "unshown_similarity": _mean(unshown), "dependence": _mean(diff),
            "shown_closer_share": _mean(closer), "copy_rate": _mean(copies)}  # fmt: skip


def regime_checks(m: Mapping[str, Any]) -> dict[str, bool | None]:
    """The regime's targets for a world, each True/False (None: not measured)."""

    def ok(x: float | None, test: Any) -> bool | None:
        return None if x is None else bool(test(x))

    valid = m["valid_rate"]
    lo, hi = m["solve_rate_levels_1_3"], m["solve_rate_levels_4_5"]
    return {
        "valid_at_least_0.8_every_type": all(valid.get(k, 0) >= 0.8 for k in KINDS),
        "solves_0.3_to_0.7_of_levels_1_3": ok(lo, lambda x: 0.3 <= x <= 0.7),
        "solves_fewer_at_levels_4_5": None if lo is None or hi is None else hi < lo,
        "code_f_solved_at_least_0.1": ok(m["code_f_solved"], lambda x: x >= 0.1),
        "proposals_depend_on_references": ok(m["reference_dependence"]["dependence"],
                                             lambda x: x > 0.05),  # fmt: skip
    }
