"""Name -> task family. A new domain registers a factory here from its own module:

register_family("math", MathFamily)   # MathFamily(template=..., **options) -> TaskFamily
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lorapop.tasks.code_f import CodeF
from lorapop.tasks.code_i import CodeI
from lorapop.tasks.code_o import CodeO
from lorapop.tasks.family import TaskFamily

#: Factories by name; `get_family` builds one with options (template, caps, n_inputs, ...).
FAMILIES: dict[str, Callable[..., TaskFamily]] = {"code_o": CodeO, "code_i": CodeI, "code_f": CodeF}


def register_family(name: str, factory: Callable[..., TaskFamily]) -> None:
    if name in FAMILIES and FAMILIES[name] is not factory:
        raise ValueError(f"task family {name!r} is already registered")
    FAMILIES[name] = factory


def get_family(name: str, **options: Any) -> TaskFamily:
    """A configured family, e.g. `get_family("code_f", template="compact", n_inputs=6)`."""
    if name not in FAMILIES:
        raise ValueError(f"unknown task family {name!r}; known: {sorted(FAMILIES)}")
    return FAMILIES[name](**options)
