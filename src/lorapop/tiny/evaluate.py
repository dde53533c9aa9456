"""Score the tiny world: held-out pass@1 per task type and level, and valid-proposal rates.

`evaluate_tiny` answers every held-out task greedily under each member's adapter slot in one
mixed batch per task type (`lorapop.engine.generate` with `slot_ids`), so a whole population is
scored at once, and grades the answers with the families' own `check` in the sandbox: the same
path as a student's reward in the loop. `score` is that grading step alone, for texts from any
source. `proposal_validity` samples teacher proposals (temperature 1, references from a buffer)
and runs them through `verify`, as the loop does.
"""

from __future__ import annotations

import random
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from lorapop.engine.generate import GenerateSpec, SamplingParams, generate
from lorapop.evals.progress import generate_logged
from lorapop.tasks import Outcome, Runner, Task, get_family
from lorapop.tiny.heldout import build_heldout, fingerprint
from lorapop.verify import Sandbox

#: New-token budgets per type: outputs and inputs are short, code_f answers are programs.
MAX_NEW = {"code_o": 48, "code_i": 64, "code_f": 384}


def _members(slots: Mapping[str, int] | Sequence[int] | None) -> dict[str, int]:
    if slots is None:
        return {"base": 0}
    if isinstance(slots, Mapping):
        return dict(slots)
    return {f"slot{s}": int(s) for s in slots}


def _family(kind: str, template: str) -> Any:
    return get_family(kind, template=template)


def score(
    tasks: Sequence[Task],
    texts: Mapping[str, Sequence[str]],
    runner: Runner,
    template: str = "compact",
) -> dict:
    """Grade `texts[member][i]` as the answer to `tasks[i]`; returns the table (see `table`)."""
    return table(tasks, grade(tasks, texts, runner, template))


def grade(
    tasks: Sequence[Task],
    texts: Mapping[str, Sequence[str]],
    runner: Runner,
    template: str = "compact",
) -> dict[str, list[bool]]:
    """Whether `texts[member][i]` answers `tasks[i]` correctly, per member."""
    grades: dict[str, list[bool]] = {}
    for member, answers in texts.items():
        if len(answers) != len(tasks):
            raise ValueError(f"{member}: {len(answers)} answers for {len(tasks)} tasks")
        ok = [False] * len(tasks)
        by_type: dict[str, list[int]] = defaultdict(list)
        for i, t in enumerate(tasks):
            by_type[t.type].append(i)
        for kind, idx in by_type.items():
            gs = _family(kind, template).check([tasks[i] for i in idx], [answers[i] for i in idx],
                                               runner)  # fmt: skip
            for i, g in zip(idx, gs, strict=True):
                ok[i] = g.outcome == Outcome.CORRECT
        grades[member] = ok
    return grades


def table(tasks: Sequence[Task], grades: Mapping[str, Sequence[bool]]) -> dict:
    """JSON-able pass@1: per member overall, by type, by level and by (type, level); plus the
    population's mean, best and worst overall (members named "base"/"baseline" excluded)."""
    members: dict[str, dict] = {}
    for member, ok in grades.items():
        cells: dict[str, dict[str, list[bool]]] = defaultdict(lambda: defaultdict(list))
        for t, g in zip(tasks, ok, strict=True):
            cells[t.type][str(t.meta.get("difficulty"))].append(g)
        by_level: dict[str, list[bool]] = defaultdict(list)
        for lv in cells.values():
            for level, gs in lv.items():
                by_level[level] += gs
        members[member] = {
            "pass@1": _mean(ok),
            "n": len(ok),
            "by_type": {k: _mean([g for gs in lv.values() for g in gs]) for k, lv in cells.items()},
            "by_level": {k: _mean(v) for k, v in sorted(by_level.items())},
            "cells": {k: {lvl: _mean(gs) for lvl, gs in sorted(lv.items())}
                      for k, lv in cells.items()},  # fmt: skip
        }
    pop = {m: r["pass@1"] for m, r in members.items() if m not in ("base", "baseline")}
    summary = {}
    if pop:
        best, worst = max(pop, key=pop.__getitem__), min(pop, key=pop.__getitem__)
        summary = {"population_mean": sum(pop.values()) / len(pop), "best": best,
                   "best_pass@1": pop[best], "worst": worst, "worst_pass@1": pop[worst]}  # fmt: skip
    for name in ("baseline", "base"):
        if name in members:
            summary[f"{name}_pass@1"] = members[name]["pass@1"]
    return {"members": members, "summary": summary}


def _mean(xs: Sequence[bool]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def evaluate_tiny(
    model: Any,
    tokenizer: Any,
    tasks: Sequence[Task],
    runner: Runner,
    *,
    bank: Any = None,
    slots: Mapping[str, int] | Sequence[int] | None = None,
    template: str = "compact",
    max_new_tokens: Mapping[str, int] | None = None,
    batch_size: int | None = 64,
    seed: int = 0,
    keep_texts: bool = False,
    keep_grades: bool = False,
    log: Callable[[str], None] | None = None,
) -> dict:
    """Greedy pass@1 of each member on `tasks` (e.g. `build_heldout()`).

    `slots`: member name -> adapter slot of `bank` (a list of slots names them "slot<i>");
    None scores the plain model as "base" (with a bank, its slot 0). Every member answers every
    task; rows of all members decode together, in chunks of `batch_size` per task type, with
    a progress line to `log` after each chunk.
    `keep_texts` adds "texts": {member: [answer text per task]} to the table; `keep_grades`
    adds "grades": {member: [correct per task]} (for paired statistics).
    """
    members = _members(slots)
    budget = {**MAX_NEW, **(max_new_tokens or {})}
    texts: dict[str, list[str]] = {m: [""] * len(tasks) for m in members}
    by_type: dict[str, list[int]] = defaultdict(list)
    for i, t in enumerate(tasks):
        by_type[t.type].append(i)
    for kind, idx in by_type.items():
        fam = _family(kind, template)
        prompts = [fam.student_prompt(tasks[i]) for i in idx]
        rows = [(m, i, p) for m in members for i, p in zip(idx, prompts, strict=True)]
        params = SamplingParams(temperature=0.0, max_new_tokens=budget[kind])
        gens = generate_logged(model, bank, tokenizer, [p for _, _, p in rows],
                               [members[m] for m, _, _ in rows], params, seed=seed,
                               batch_size=batch_size, log=log, what=kind)  # fmt: skip
        for (m, i, _), g in zip(rows, gens, strict=True):
            texts[m][i] = g.text
    grades = grade(tasks, texts, runner, template)
    result = table(tasks, grades)
    if keep_texts:
        result["texts"] = texts
    if keep_grades:
        result["grades"] = grades
    return result


def proposal_validity(
    model: Any,
    tokenizer: Any,
    buffer: Mapping[str, Sequence[Task]],
    runner: Runner,
    *,
    n: int = 100,
    references: int = 2,
    bank: Any = None,
    slot: int = 0,
    template: str = "compact",
    code_f_inputs: int = 4,
    temperature: float = 1.0,
    max_new_tokens: int = 256,
    seed: int = 0,
) -> dict:
    """Sample `n` proposals per type and verify them as the loop does.

    `buffer[kind]` holds the tasks references are drawn from (code_f bases come from the
    code_o/code_i buffers, as in AZR). Returns per type: valid rate, distinct valid programs
    and the most common reasons for invalid proposals.
    """
    rng = random.Random(seed)
    out: dict[str, dict] = {}
    bases = [t for k in ("code_o", "code_i") for t in buffer.get(k, ())]
    for k, kind in enumerate(("code_o", "code_i", "code_f")):
        if kind == "code_f":
            fam = get_family(kind, template=template, n_inputs=code_f_inputs)
        else:
            fam = _family(kind, template)
        pool = list(buffer.get(kind, ())) or fam.seed_tasks()
        refs = [rng.sample(pool, min(references, len(pool))) for _ in range(n)]
        base = [rng.choice(bases) if kind == "code_f" else None for _ in range(n)]
        prompts = [fam.teacher_prompt(r, b) for r, b in zip(refs, base, strict=True)]
        params = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens)
        gens = generate(model, bank, tokenizer, prompts, [slot] * n,
                        GenerateSpec(params=params, seed=seed + k))
        texts = [g.text for g in gens]
        verdicts = fam.verify(texts, runner, bases=base if kind == "code_f" else None)
        valid = [v for v in verdicts if v.valid]
        reasons = Counter(v.reason.split(":")[0] for v in verdicts if not v.valid)
        out[kind] = {
            "valid_rate": len(valid) / n,
            "n": n,
            "distinct_valid_programs": len({v.task.program for v in valid if v.task}),
            "truncated": sum(g.finish == "length" for g in gens),
            "mean_new_tokens": sum(len(g.token_ids) for g in gens) / n,
            "invalid_reasons": dict(reasons.most_common(6)),
        }
    return out


def evaluate_run(
    target: str | Path,
    *,
    base_model: str | None = None,
    per_level: int = 20,
    include_base: bool = True,
    device: str = "auto",
    dtype: str = "auto",
    workers: int = 2,
    seed: int = 0,
    max_new_tokens: Mapping[str, int] | None = None,
    batch_size: int | None = 64,
    log: Callable[[str], None] | None = None,
) -> dict:
    """Held-out pass@1 of every member of `target` on the tiny benchmark, in one mixed batch.

    `target`: a `lorapop train` run directory (its last checkpoint's members, and `baseline/`),
    any directory of PEFT adapter directories, one adapter directory, or a model directory /
    name (the base alone). Members are found and loaded as `lorapop.evals` does; the base model
    (default: the adapters' `base_model_name_or_path`, else the shipped tiny model) is a row
    named "base". Raises `lorapop.evals.EvalError` (one line) on a bad target.
    """
    from lorapop.evals.runner import EvalError, Member, find_members, load_population
    from lorapop.tiny.pretrain import TINY_MODEL_DIR

    path = Path(target)
    if path.exists() and not path.is_dir():
        raise EvalError(f"{path}: not a run, adapter or model directory")
    if (path / "config.json").is_file() or not path.exists():
        members, named = [], str(target)  # a model, not adapters
    else:
        members, named = find_members(path)
    base = base_model or named or str(TINY_MODEL_DIR)
    if include_base or not members:
        members = [*members, Member("base", None, "base")]
    tok, model, bank = load_population(base, members, device, dtype, seed)
    tok.padding_side = "left"
    slots = {m.name: i for i, m in enumerate(members)} if bank is not None else None
    with Sandbox(workers=workers, timeout_s=2.0) as sb:
        tasks = build_heldout(per_level, sandbox=sb)
        result = evaluate_tiny(model, tok, tasks, sb, bank=bank, slots=slots,
                               max_new_tokens=max_new_tokens, batch_size=batch_size, seed=seed,
                               log=log)
    result["heldout"] = {"n_per_level": per_level, "fingerprint": fingerprint(tasks)}
    result["base_model"] = base
    return result


def markdown(result: dict) -> str:
    """The held-out table as markdown: one row per member, pass@1 overall, by type and level."""
    members = result["members"]
    types = sorted({t for m in members.values() for t in m["by_type"]})
    levels = sorted({lv for m in members.values() for lv in m["by_level"]})
    head = ["member", "pass@1", *types, *(f"L{lv}" for lv in levels)]
    lines = ["| " + " | ".join(head) + " |", "|---" + "|---:" * (len(head) - 1) + "|"]
    for name, m in members.items():
        cells = [m["pass@1"], *(m["by_type"].get(t, 0.0) for t in types),
                 *(m["by_level"].get(lv, 0.0) for lv in levels)]
        lines.append(f"| {name} | " + " | ".join(f"{100 * c:.1f}" for c in cells) + " |")
    return "\n".join(lines)
