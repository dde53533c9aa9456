"""Rollout dumps: what teachers proposed and students answered, RUN_DIR/rollouts/step_N.jsonl.gz.

One JSON line per completion:

    {"step", "member", "individual", "role": "teacher"|"student", "type", "prompt",
     "completion", "parsed", "verdict", "reward", "advantage", "tokens"}

`parsed` is the task a valid proposal became (program, inputs, outputs, message) or the
student's parsed answer; `verdict` is "valid" or the reason a proposal is invalid, or the
answer's outcome ("correct", "wrong", "format_error"). `run.rollouts` < 1 keeps a random share,
drawn from (seed, step) alone, so a resumed run writes the same files.
"""

from __future__ import annotations

import gzip
import json
import os
import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lorapop.selfplay.records import StepRecord


def path(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / "rollouts" / f"step_{step}.jsonl.gz"


def sample(records: Sequence[dict[str, Any]], fraction: float, seed: int) -> list[dict[str, Any]]:
    """All records, or `round(fraction * n)` of them (at least one when fraction > 0), in order."""
    if fraction >= 1 or not records:
        return list(records)
    k = max(1, round(fraction * len(records))) if fraction > 0 else 0
    keep = sorted(random.Random(seed).sample(range(len(records)), k))
    return [records[i] for i in keep]


def write_records(run_dir: str | Path, step: int, records: Sequence[dict[str, Any]]) -> Path:
    """Write one step's records atomically (a kill leaves the old file or the new one)."""
    out = path(run_dir, step)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    with gzip.open(tmp, "wt", encoding="utf-8") as fh:
        for r in records:
            fh.write(json.dumps(r, ensure_ascii=False) + "\n")
    os.replace(tmp, out)
    return out


def read(file: str | Path) -> list[dict[str, Any]]:
    """The records of one dump (a torn or foreign file gives the lines that parse)."""
    out = []
    try:
        with gzip.open(file, "rt", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(rec, dict):
                    out.append(rec)
    except (OSError, EOFError):
        pass
    return out


def individuals_during(row: dict[str, Any]) -> dict[str, str]:
    """The individual each slot held while it generated this step's rollouts: the row's
    (read after replacement), except replaced slots, which held the `replaced` one."""
    ids = {m: v.get("individual") or f"{m}.g0" for m, v in row["members"].items()}
    for e in row.get("replacements", []):
        if e.get("replaced"):
            ids[e["target"]] = e["replaced"]
    return ids


def step_records(rec: StepRecord, row: dict[str, Any], decode: Callable[[list[int]], str],
                 fraction: float, seed: int) -> list[dict[str, Any]]:
    """The dump of one step: a `fraction` of its proposals and answers (sampled before any
    prompt is decoded)."""
    items: list[tuple[Any, ...]] = [
        (p.rollout, v.task.to_json() if v.valid and v.task else None,
         "valid" if v.valid else v.reason, r, a)
        for p, v, r, a in zip(rec.proposals, rec.verification.validities,
                              rec.update.teacher_rewards, rec.update.teacher_advantages,
                              strict=True)
    ] + [
        (t.rollout, t.grade.answer, t.grade.outcome.value, r, a)
        for t, r, a in zip(rec.attempts, rec.update.student_rewards,
                           rec.update.student_advantages, strict=True)
    ]
    ids = individuals_during(row)
    return [
        {"step": rec.step, "member": ro.member, "individual": ids.get(ro.member),
         "role": ro.role, "type": ro.type, "prompt": decode(ro.prompt_ids),
         "completion": ro.text, "parsed": parsed, "verdict": verdict, "reward": reward,
         "advantage": adv, "tokens": len(ro.token_ids)}
        for ro, parsed, verdict, reward, adv in sample(items, fraction, seed)
    ]
