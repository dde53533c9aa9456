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
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def path(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / "rollouts" / f"step_{step}.jsonl.gz"


def sample(records: Sequence[dict[str, Any]], fraction: float, seed: int) -> list[dict[str, Any]]:
    """All records, or `round(fraction * n)` of them (at least one when fraction > 0), in order."""
    if fraction >= 1 or not records:
        return list(records)
    k = max(1, round(fraction * len(records))) if fraction > 0 else 0
    keep = sorted(random.Random(seed).sample(range(len(records)), k))
    return [records[i] for i in keep]


def write(run_dir: str | Path, step: int, records: Sequence[dict[str, Any]]) -> Path:
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
