"""A bounded buffer of valid tasks of one type, the pool teachers' references come from.

- Starts with the family's seed tasks (AZR's identity task) unless told otherwise.
- `add` drops a task whose program and inputs repeat one already held (`Task.key`).
- Bounded: when full, a new task evicts the oldest one (`eviction="oldest"`, the default) or
  a uniformly random one (`"random"`, under the buffer's seeded RNG). AZR instead stops adding
  once full, which freezes the references; evicting keeps them tracking the current teachers.
  Seeds are ordinary entries, so they are the first to go.
- `sample(k)` draws k distinct tasks uniformly (all of them when fewer are held) under the
  buffer's RNG or one passed in, so runs are reproducible under a seed.
- `save` / `load` use JSONL, one `Task.to_json()` per line.
"""

from __future__ import annotations

import json
import random
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from pathlib import Path

from lorapop.tasks.task import Task

EVICTIONS = ("oldest", "random")


class TaskBuffer:
    def __init__(
        self,
        type: str,
        capacity: int = 10_000,
        eviction: str = "oldest",
        seed: int = 0,
        seeds: Iterable[Task] = (),
    ) -> None:
        if capacity < 1:
            raise ValueError("buffer capacity must be at least 1")
        if eviction not in EVICTIONS:
            raise ValueError(f"unknown eviction {eviction!r}; expected one of {EVICTIONS}")
        self.type = type
        self.capacity = capacity
        self.eviction = eviction
        self.rng = random.Random(seed)
        self._tasks: OrderedDict[str, Task] = OrderedDict()  # insertion order = age
        self.add_all(seeds)

    def __len__(self) -> int:
        return len(self._tasks)

    def __iter__(self) -> Iterator[Task]:
        return iter(list(self._tasks.values()))

    def __contains__(self, task: Task) -> bool:
        return task.key in self._tasks

    def add(self, task: Task) -> bool:
        """Add a task; False when it duplicates one held. Evicts one task when full."""
        if task.type != self.type:
            raise ValueError(f"a {task.type} task cannot go into the {self.type} buffer")
        key = task.key
        if key in self._tasks:
            return False
        if len(self._tasks) >= self.capacity:
            if self.eviction == "oldest":
                self._tasks.popitem(last=False)
            else:
                victim = self.rng.choice(list(self._tasks))
                del self._tasks[victim]
        self._tasks[key] = task
        return True

    def add_all(self, tasks: Iterable[Task]) -> int:
        """Add several tasks; returns how many were new."""
        return sum(self.add(t) for t in tasks)

    def sample(self, k: int, rng: random.Random | None = None) -> list[Task]:
        """k distinct tasks drawn uniformly (min(k, len) of them)."""
        tasks = list(self._tasks.values())
        return (rng or self.rng).sample(tasks, min(k, len(tasks)))

    def save(self, path: str | Path) -> None:
        with open(path, "w", encoding="utf-8") as fh:
            for t in self._tasks.values():
                fh.write(t.dumps() + "\n")

    @classmethod
    def load(
        cls,
        path: str | Path,
        type: str,
        capacity: int = 10_000,
        eviction: str = "oldest",
        seed: int = 0,
    ) -> TaskBuffer:
        """A buffer holding the tasks saved at `path` (no seeds added); raises ValueError
        naming the line of a malformed record."""
        buf = cls(type, capacity, eviction, seed)
        with open(path, encoding="utf-8") as fh:
            for n, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    buf.add(Task.from_json(json.loads(line)))
                except (json.JSONDecodeError, ValueError) as e:
                    raise ValueError(f"{path}:{n}: {e}") from None
        return buf
