"""The held-out tiny benchmark: fixed grammar tasks at five difficulty levels per task type.

It is rebuilt, not shipped: the seed is fixed and every program comes from the held-out side
of `program_split`, so a build gives the same tasks on every run and shares no program with a
training corpus made by `generate_tasks(..., split="train")`, whatever that corpus's seed.
`exclude` additionally drops given programs (pass a training corpus's, to be explicit).
Programs are distinct across the whole set, types included.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from pathlib import Path

from lorapop.tasks.task import Task
from lorapop.tiny.generator import KINDS, generate_tasks, normalize
from lorapop.tiny.grammar import LEVELS, table_level
from lorapop.verify import Sandbox

HELDOUT_SEED = "heldout-v1"


def build_heldout(
    n_per_level: int = 20,
    *,
    seed: str = HELDOUT_SEED,
    kinds: Sequence[str] = KINDS,
    levels: Sequence[int] = tuple(LEVELS),
    sandbox: Sandbox | None = None,
    exclude: Iterable[str] = (),
    table: str = "standard",
) -> list[Task]:
    """`n_per_level` tasks for each kind and level (of level table `table`), ordered by kind
    then level.

    Each task's `meta["difficulty"]` is its level. `exclude` holds program sources to avoid.
    """
    seen = frozenset(normalize(p) for p in exclude)
    tasks: list[Task] = []
    for kind in kinds:
        for level in levels:
            made = generate_tasks(
                kind, n_per_level, table_level(level, table), f"{seed}/{kind}",
                sandbox=sandbox, split="heldout", exclude=seen,
            )  # fmt: skip
            seen |= {normalize(t.program) for t in made}
            tasks += made
    return tasks


def save_jsonl(tasks: Iterable[Task], path: str | Path) -> None:
    """One `Task.to_json()` object per line."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as fh:
        for t in tasks:
            fh.write(json.dumps(t.to_json(), ensure_ascii=False, sort_keys=True) + "\n")


def load_jsonl(path: str | Path) -> list[Task]:
    """Tasks from `save_jsonl`; a bad line raises ValueError naming the line."""
    tasks = []
    with Path(path).open(encoding="utf-8") as fh:
        for no, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                tasks.append(Task.from_json(json.loads(line)))
            except ValueError as e:
                raise ValueError(f"{path}:{no}: {e}") from None
    return tasks


def fingerprint(tasks: Iterable[Task]) -> str:
    """A sha256 of the tasks' content (type, program, pairs, message, difficulty)."""
    h = hashlib.sha256()
    for t in tasks:
        record = [t.type, t.program, t.inputs, t.outputs, t.message, t.meta.get("difficulty")]
        h.update(json.dumps(record).encode() + b"\n")
    return h.hexdigest()
