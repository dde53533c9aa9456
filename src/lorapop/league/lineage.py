"""Individuals: which adapter has held each slot, so curves and events follow individuals.

A slot (``T0``) is where an adapter lives and how rows are routed; an *individual* is one
adapter that held it, from its creation to its replacement. Its id is the slot name,
``.g`` and how many individuals the slot has held before: ``T0.g0`` is the slot's first,
``T0.g3`` the child made at the third replacement of ``T0``.

``Lineage.replace`` turns one replacement plan into the metrics rows' ``"replacements"``
entries (the shared schema: target, replaced, child, parents, parent_slots, operator, seed)
and advances the targets' generations. Parents are read before any target advances, and a
plan never has a member as both parent and target, so the entries do not depend on order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lorapop.league.replacement import Replacement


def individual_id(slot: str, generation: int) -> str:
    return f"{slot}.g{generation}"


class Lineage:
    """The generation of each slot's current individual."""

    def __init__(self, slots: Sequence[str]) -> None:
        self._generation = dict.fromkeys(slots, 0)

    def individual(self, slot: str) -> str:
        """The id of the individual that holds ``slot`` now."""
        if slot not in self._generation:
            raise KeyError(f"unknown slot {slot!r}; slots: {list(self._generation)}")
        return individual_id(slot, self._generation[slot])

    def replace(self, plan: Sequence[Replacement]) -> list[dict[str, Any]]:
        """Record a plan's children; one schema entry per replacement, in plan order."""
        entries = [
            {
                "target": r.target,
                "replaced": self.individual(r.target),
                "child": individual_id(r.target, self._generation[r.target] + 1),
                "parents": [self.individual(p) for p in r.parents],
                "parent_slots": list(r.parents),
                "operator": r.operator,
                "seed": r.seed,
            }
            for r in plan
        ]
        for r in plan:
            self._generation[r.target] += 1
        return entries

    def to_dict(self) -> dict[str, int]:
        return dict(self._generation)

    @classmethod
    def from_dict(cls, state: dict[str, int], slots: Sequence[str]) -> Lineage:
        """Restore the generations (a slot missing from ``state``, e.g. an older run: g0)."""
        lineage = cls(slots)
        for slot, gen in state.items():
            if slot not in lineage._generation:
                raise ValueError(f"lineage names slot {slot!r}, not one of {list(slots)}")
            if not isinstance(gen, int) or gen < 0:
                raise ValueError(f"lineage generation of {slot!r} must be an int >= 0, got {gen!r}")
            lineage._generation[slot] = gen
        return lineage
