"""What makes a run's tasks hard: its students' rollouts summarised per task type.

The gate needs the single agent's own solve rate to stay high while its programs get simpler.
This reads the rollout dumps of a world experiment's runs (a directory, or a .tgz of one, holding
`runs/*/rollouts/step_*.jsonl.gz`: `run.rollouts` in the config) and reports, per run and task
type: the tasks' solve-rate distribution (all solved / partly / none), how often all answers
agree and are wrong (a student that has stopped exploring), the solve rate of tasks whose inputs
lie inside an input domain against those outside (`--table`: a level table with bounded inputs),
the operations of unsolved against all-solved programs, with examples, and the run's blind spots:
the operations of code_o/code_i programs that cost the most solve rate.

    PYTHONPATH=src python experiments/regime/world_rollouts.py DIR [--table narrow] [--out FILE.json]

DIR: a world_experiment `--out` directory, or a progress.tgz (unpacked to a temporary place).
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import re
import sys
import tarfile
import tempfile
from collections import Counter, defaultdict
from pathlib import Path
from statistics import fmean

from lorapop.run import rollouts
from lorapop.tasks.metrics import call_name
from lorapop.tiny.grammar import TABLE_RULES

_SYMBOLS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Mod: "%", ast.FloorDiv: "//",
            ast.Div: "/", ast.Pow: "**"}  # fmt: skip


def operations(program: str) -> list[str]:
    """What a program does, read from its syntax tree: the names it calls (`count` for
    `s.count('y')`, never a variable named `count`), its arithmetic (`+`, `//`; `+=` for an
    augmented assignment), indexing (`[`) and control flow (`for`, `while`, `if`)."""
    try:
        tree = ast.parse(program)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return []
    ops: set[str | None] = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Call):
            ops.add(call_name(n))
        elif isinstance(n, ast.BinOp):
            ops.add(_SYMBOLS.get(type(n.op)))
        elif isinstance(n, ast.AugAssign) and type(n.op) in _SYMBOLS:
            ops.add(_SYMBOLS[type(n.op)] + "=")
        elif isinstance(n, ast.Subscript):
            ops.add("[")
        elif isinstance(n, ast.For | ast.While | ast.If | ast.IfExp):
            ops.add({ast.For: "for", ast.While: "while"}.get(type(n), "if"))
    return sorted(o for o in ops if o)


def _tasks(run: Path) -> tuple[list[int], dict[str, list[dict]]]:
    """The steps stored, and per task type each task a student solved in them: its prompt,
    verdicts, answers, inputs and the operations its program uses."""
    by: dict[tuple[str, str], dict] = {}
    steps = set()
    for f in sorted(run.glob("rollouts/step_*.jsonl.gz")):
        for r in rollouts.read(f):
            if r.get("role") != "student" or "type" not in r or "prompt" not in r:
                continue
            steps.add(r.get("step"))
            t = by.setdefault((r["type"], r["prompt"]), {"prompt": r["prompt"], "ok": [],
                                                         "answers": []})  # fmt: skip
            t["ok"].append(r.get("verdict") == "correct")
            t["answers"].append(str(r.get("parsed")))
    out: dict[str, list[dict]] = defaultdict(list)
    for (kind, prompt), t in by.items():
        t["solve"] = sum(t["ok"]) / len(t["ok"])
        t["inputs"] = re.findall(r"<i>(.*?)</i>", prompt, re.S)
        body = prompt.split("<f>", 1)[1].split("</f>", 1)[0] if "<f>" in prompt else ""
        t["ops"] = operations(body)
        out[kind].append(t)
    return sorted(x for x in steps if isinstance(x, int)), out


def _share(xs: list[dict], pred) -> float:
    return round(sum(map(pred, xs)) / len(xs), 3) if xs else 0.0


def _ops(ts: list[dict]) -> dict[str, float]:
    """The share of `ts` whose program uses each of the 8 most used operations."""
    return {o: round(n / len(ts), 2) for o, n in Counter(o for t in ts for o in t["ops"]).most_common(8)}


def blind_spots(ts: list[dict], top: int = 3, min_share: float = 0.05) -> list[dict]:
    """The operations that cost the most solve rate: for each one in >= `min_share` of the
    tasks, its share, the mean solve rate of tasks with and without it, and `lost`, share x
    (without - with): how much higher the mean would be if its tasks were solved as the rest
    (those with `lost` > 0, most first). A teacher paid for tasks its student fails settles on
    such an operation."""
    rows = []
    for op in sorted({o for t in ts for o in t["ops"]}):
        with_ = [t["solve"] for t in ts if op in t["ops"]]
        without = [t["solve"] for t in ts if op not in t["ops"]]
        if len(with_) < min_share * len(ts) or not without:
            continue
        share, w, wo = len(with_) / len(ts), fmean(with_), fmean(without)
        rows.append({"op": op, "share": round(share, 2), "solve_with": round(w, 2),
                     "solve_without": round(wo, 2), "lost": round(share * (wo - w), 3)})  # fmt: skip
    return sorted((r for r in rows if r["lost"] > 0), key=lambda r: -r["lost"])[:top]


def _solved(ts: list[dict]) -> dict:
    return {"tasks": len(ts), "solve": round(fmean(t["solve"] for t in ts), 3) if ts else None}


def summarize(run: Path, table: str | None, examples: int = 4) -> dict:
    """One run's steps and, per task type, what its tasks' solve rates look like."""
    domain = TABLE_RULES[table].inputs if table else None
    rng = random.Random(0)
    steps, tasks = _tasks(run)
    res: dict = {"steps": [steps[0], steps[-1]] if steps else [],
                 "blind_spots_code_o_i": blind_spots(tasks.get("code_o", []) + tasks.get("code_i", []))}
    for kind, ts in sorted(tasks.items()):
        none = [t for t in ts if t["solve"] == 0]
        row = {
            "tasks": len(ts), "solve": round(fmean(t["solve"] for t in ts), 3),
            "all_solved": _share(ts, lambda t: t["solve"] == 1),
            "partial": _share(ts, lambda t: 0 < t["solve"] < 1),
            "unsolved": _share(ts, lambda t: t["solve"] == 0),
            "unanimous_wrong": _share(ts, lambda t: t["solve"] == 0 and len(set(t["answers"])) == 1),
            "ops_unsolved": _ops(none),
            "ops_all_solved": _ops([t for t in ts if t["solve"] == 1]),
            "examples_unsolved": [{"task": t["prompt"].split("\n", 1)[-1][:300],
                                   "answers": t["answers"][:4]}
                                  for t in rng.sample(none, min(examples, len(none)))],
        }  # fmt: skip
        if domain is not None and kind != "code_i":  # code_i's prompt shows no input
            side: dict[bool, list[dict]] = {True: [], False: []}
            for t in ts:
                side[bool(t["inputs"]) and not any(map(domain.problem, t["inputs"]))].append(t)
            row["inside_domain"], row["outside_domain"] = _solved(side[True]), _solved(side[False])
        res[kind] = row
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", help="world_experiment --out directory, or a progress.tgz")
    ap.add_argument(
        "--table",
        choices=sorted(t for t, r in TABLE_RULES.items() if r.inputs),
        help="also split the tasks by this level table's input domain",
    )
    ap.add_argument("--out", help="write the summary here (JSON); default: print it")
    a = ap.parse_args()
    src = Path(a.dir)
    if not src.exists():
        ap.error(f"{src} does not exist")
    with tempfile.TemporaryDirectory() as tmp:
        if src.is_file():
            try:
                with tarfile.open(src) as tar:
                    tar.extractall(tmp, filter="data")
            except tarfile.TarError as e:
                ap.error(f"{src}: not a readable tar archive ({e})")
            src = Path(tmp)
        runs = sorted(
            p for p in (src / "runs").glob("*") if any(p.glob("rollouts/step_*.jsonl.gz"))
        )
        if not runs:
            ap.error(
                f"{a.dir}: no runs with rollouts (set run.rollouts in the runs' config)"
            )
        out = {"source": a.dir, "command": " ".join(sys.argv), "table": a.table,
               "runs": {r.name: summarize(r, a.table) for r in runs}}
    text = json.dumps(out, indent=1)
    if a.out:
        Path(a.out).write_text(text + "\n")
    else:
        print(text)


if __name__ == "__main__":
    main()
