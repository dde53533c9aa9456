"""What makes a run's tasks hard: its students' rollouts summarised per task type.

Issue 15's gate needs the single agent's own solve rate to stay high while its programs get
simpler; session 10's stayed at ~0.5 with programs of one line. This reads the rollouts that
`world_call.sh` brings back (`ROLLOUTS=N`: each run's last N steps) and reports, per run and task
type: the tasks' solve-rate distribution (all solved / partly / none), how often all answers
agree and are wrong (a student that has stopped exploring), the solve rate of tasks whose inputs
lie inside an input domain against those outside (`--table`: a level table with bounded inputs),
and the operations of unsolved against all-solved programs, with examples.

    PYTHONPATH=src python benchmarks/world_rollouts.py DIR [--table narrow] [--out FILE.json]

DIR: a world_experiment `--out` directory, or a progress.tgz (unpacked to a temporary place).
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import re
import sys
import tarfile
import tempfile
from collections import Counter, defaultdict
from pathlib import Path
from statistics import fmean

from lorapop.tiny.grammar import TABLE_DOMAINS

OPS = ("count", "len", "find", "replace", "upper", "sorted", "sum", "max", "min", "join", "split",
       "*", "+=", "%", "//", "[", "for", "while", "if")  # fmt: skip


def _tasks(run: Path) -> dict[str, list[dict]]:
    """Per task type, each task a student solved in the stored steps: its prompt, verdicts,
    answers and inputs."""
    by: dict[tuple[str, str], dict] = {}
    for f in sorted(run.glob("rollouts/step_*.jsonl.gz")):
        with gzip.open(f, "rt") as fh:
            for line in fh:
                r = json.loads(line)
                if r.get("role") != "student":
                    continue
                t = by.setdefault((r["type"], r["prompt"]), {"prompt": r["prompt"], "ok": [],
                                                             "answers": []})  # fmt: skip
                t["ok"].append(r["verdict"] == "correct")
                t["answers"].append(str(r.get("parsed")))
    out: dict[str, list[dict]] = defaultdict(list)
    for (kind, prompt), t in by.items():
        t["solve"] = sum(t["ok"]) / len(t["ok"])
        t["inputs"] = re.findall(r"<i>(.*?)</i>", prompt, re.S)
        body = prompt.split("<f>", 1)[1].split("</f>", 1)[0] if "<f>" in prompt else ""
        t["ops"] = [o for o in OPS if o in body]
        out[kind].append(t)
    return out


def _share(xs: list[dict], pred) -> float:
    return round(sum(map(pred, xs)) / len(xs), 3) if xs else 0.0


def summarize(run: Path, table: str | None, examples: int = 4) -> dict:
    domain = TABLE_DOMAINS.get(table or "")
    rng = random.Random(0)
    res: dict = {}
    for kind, ts in sorted(_tasks(run).items()):
        none = [t for t in ts if t["solve"] == 0]
        every = [t for t in ts if t["solve"] == 1]
        row = {
            "tasks": len(ts), "solve": round(fmean(t["solve"] for t in ts), 3),
            "all_solved": _share(ts, lambda t: t["solve"] == 1),
            "partial": _share(ts, lambda t: 0 < t["solve"] < 1),
            "unsolved": _share(ts, lambda t: t["solve"] == 0),
            "unanimous_wrong": _share(ts, lambda t: t["solve"] == 0 and len(set(t["answers"])) == 1),
            "ops_unsolved": {o: round(n / len(none), 2) for o, n in
                             Counter(o for t in none for o in t["ops"]).most_common(8)} if none else {},
            "ops_all_solved": {o: round(n / len(every), 2) for o, n in
                               Counter(o for t in every for o in t["ops"]).most_common(8)} if every else {},
            "examples_unsolved": [{"task": t["prompt"].split("\n", 1)[-1][:300],
                                   "answers": t["answers"][:4]}
                                  for t in rng.sample(none, min(examples, len(none)))],
        }  # fmt: skip
        if domain is not None and kind != "code_i":  # code_i's prompt shows no input
            inside = [t for t in ts if t["inputs"] and not any(map(domain.problem, t["inputs"]))]
            outside = [t for t in ts if t not in inside]
            row["inside_domain"] = {
                "tasks": len(inside),
                "solve": round(fmean(t["solve"] for t in inside), 3) if inside else None,
            }
            row["outside_domain"] = {
                "tasks": len(outside),
                "solve": round(fmean(t["solve"] for t in outside), 3) if outside else None,
            }
        res[kind] = row
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", help="world_experiment --out directory, or a progress.tgz")
    ap.add_argument(
        "--table",
        choices=sorted(TABLE_DOMAINS),
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
                f"{a.dir}: no runs with rollouts (world_call.sh brings them back with ROLLOUTS=N)"
            )
        steps = {r.name: sorted(int(f.name[5:-9]) for f in r.glob("rollouts/step_*.jsonl.gz"))
                 for r in runs}  # fmt: skip
        out = {"source": a.dir, "command": " ".join(sys.argv), "table": a.table,
               "runs": {r.name: {"steps": [steps[r.name][0], steps[r.name][-1]],
                                 **summarize(r, a.table)} for r in runs}}  # fmt: skip
    text = json.dumps(out, indent=1)
    if a.out:
        Path(a.out).write_text(text + "\n")
    else:
        print(text)


if __name__ == "__main__":
    main()
