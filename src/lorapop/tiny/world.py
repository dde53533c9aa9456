"""The world a base model was pretrained for, read from its training.json: its level table,
references and code_f input count, and the world rules (input/output domains, live code,
banned calls) a run on it must keep (`base_rule_overrides`, applied by `lorapop train`)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from lorapop.tiny.grammar import LEVEL_TABLES, TABLE_RULES

#: The tiny world's code_f input count (`configs/world.yaml`), unless its base was pretrained on
#: another one (`world_of`).
CODE_F_INPUTS = 4



def training_record(model_dir: str | Path) -> dict[str, Any]:
    """A base's `training.json` (pretrain-tiny's record: level table, references, weights
    digest, ...); {} where there is none or it does not read as an object (hub ids, older
    models)."""
    try:
        rec = json.loads((Path(model_dir) / "training.json").read_text())
    except (OSError, ValueError):
        return {}
    return rec if isinstance(rec, dict) else {}


def world_of(model_dir: str | Path) -> dict[str, Any]:
    """The world a base model was pretrained for, from its training.json: `levels` (its level
    table: the levels of its measurement, held-out set and seed tasks) and `references` (the
    most references its teacher prompts showed: what the loop should show) and `code_f_inputs`
    (the one input count its code_f teacher examples asked for; None where they asked for
    several: the config's). Defaults (the shipped model, older records): the standard table, 2
    and None. ValueError (one line) for a level table this code does not know."""
    rec = training_record(model_dir)
    table = rec.get("levels", "standard")
    refs = rec.get("max_refs", 2)
    ns = rec.get("code_f_ns")
    if not isinstance(table, str) or table not in LEVEL_TABLES:
        raise ValueError(f"{model_dir} was pretrained on level table {table!r}; known: "
                         f"{', '.join(LEVEL_TABLES)}")  # fmt: skip
    return {"levels": table, "references": refs if isinstance(refs, int) and refs >= 1 else 2,
            "code_f_inputs": ns[0] if isinstance(ns, list) and len(ns) == 1 else None}


def rule_overrides(table: str, skip: Iterable[str] = ()) -> list[str]:
    """The world rules of a level table (`grammar.TABLE_RULES`) as config overrides
    (`tasks.input_domain`, `tasks.output_domain`, `tasks.live_code`, `tasks.banned_calls`), less
    the `tasks` keys in `skip`: the loop's proposals must stay where the base's corpus and the
    sets drew their inputs."""
    r = TABLE_RULES.get(table)
    if r is None:
        return []
    values = {"input_domain": r.inputs and asdict(r.inputs),
              "output_domain": r.outputs and asdict(r.outputs),
              "live_code": r.live_code or None, "banned_calls": list(r.banned_calls) or None}
    skip = set(skip)
    return [f"tasks.{k}={json.dumps(v)}" for k, v in values.items() if v is not None and k not in skip]


def base_rule_overrides(model: str | Path, tasks_set: Iterable[str]) -> tuple[str, list[str]]:
    """The level table a local base was pretrained for (its training.json) and its world rules
    as overrides (`rule_overrides`), and the code_f input count it was pretrained on where it
    was one, less the `tasks` keys in `tasks_set` (those a config gives itself). A hub id, or a
    directory without training.json, has no table: ("standard", []). ValueError (one line) for
    a table this code does not know."""
    path = Path(model)
    if not (path / "training.json").is_file():
        return "standard", []
    world = world_of(path)
    n = world["code_f_inputs"] if "code_f_inputs" not in set(tasks_set) else None
    return world["levels"], [*rule_overrides(world["levels"], skip=tasks_set),
                             *([f"tasks.code_f_inputs={n}"] if n else [])]
