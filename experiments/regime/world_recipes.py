"""Build several base-model recipes at once on one GPU and measure each in the regime world.

    PYTHONPATH=src python experiments/regime/world_recipes.py --out runs/recipes --device cuda \\
        --workers 15 --deadline 560 --json experiments/regime/results/world_recipes.json \\
        --measure="--proposals 20" world world-exec world-refs "world,steps=800,lr=2e-3"
    PYTHONPATH=src python experiments/regime/world_recipes.py --smoke --out /tmp/recipes   # CPU check
    PYTHONPATH=src python experiments/regime/world_recipes.py --mix small world world-exec world-refs \\
        --json experiments/regime/results/world_mix.json                 # CPU: the mixes, no training

A variant is a `lorapop pretrain-tiny` size, optionally with recipe fields overridden
(`SIZE,key=value,...`, values as Python literals: `steps=800`, `levels='world'`,
`token_levels={'teacher': {1: 1}, 'student': {1: 3, 2: 1}}`, `size={'hidden': 256, ...}`).
Variants on the same level table and corpus size share one corpus, made first with all
`--workers` (worker processes, `lorapop.tiny.corpus`); then every variant builds in its own
process, all at once (three 26M builds on an H100: 1.26x the tokens/s of one), the CPU workers
split between them, and is measured by `experiments/regime/tiny_world.py` (its regime checks;
`--measure` passes it arguments) as soon as it is built.
The JSON (`--json`) is rewritten whenever a variant changes state, so a call cut short by a
time limit still returns every finished variant; `--deadline` stops what is still running at
that many seconds and records it as `timeout`. `--pack DIR` writes each model, as soon as it is
built and before it is measured, to DIR as bf16 in 15 MiB parts (`cat NAME_bf16.tgz.part* |
tar xzf -`), so a model whose measurement the deadline cuts can still be measured elsewhere.
`--mix` trains nothing: it measures each variant's example mix on CPU (shares of tokens and
examples per role and level, as drawn, on a smaller corpus with the recipe's own tokenizer) and
the corpus's program lengths per level.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import os
import pickle
import platform
import random
import shlex
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from statistics import fmean

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_VARIANTS = ("world", "world-exec", "world-refs")
#: Overrides of every variant in `--smoke`: a CPU-sized model, corpus, pool and measurement.
SMOKE = {"steps": 2, "n_per_level": 30, "batch_tokens": 8192, "tokenizer_programs": 0,
         "size": {"hidden": 32, "layers": 1, "heads": 2, "kv_heads": 1, "intermediate": 64,
                  "max_positions": 1024}}  # fmt: skip
SMOKE_MEASURE = ["--proposals", "2", "--answers", "2", "--pool-per-level", "4",
                 "--teacher-max-new-tokens", "48", "--batch-size", "64"]  # fmt: skip


def _top_level_split(spec: str) -> list[str]:
    """`spec` split at the commas outside brackets and quotes, so a value may be a dict or a
    tuple of several items."""
    parts, depth, quote, start = [], 0, "", 0
    for i, ch in enumerate(spec):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(spec[start:i])
            start = i + 1
    return [*parts, spec[start:]]


def parse_variant(spec: str) -> tuple[str, dict]:
    """`SIZE,key=value,...` -> (size, overrides); keys must be recipe fields."""
    from lorapop.tiny.grammar import table_levels
    from lorapop.tiny.pretrain import Recipe
    from regime_recipes import RECIPES as SIZES

    size, *pairs = _top_level_split(spec)
    if size not in SIZES:
        raise ValueError(f"{spec!r}: unknown size {size!r}; known: {', '.join(SIZES)}")
    fields = {f.name for f in dataclasses.fields(Recipe)}
    overrides = {}
    for pair in pairs:
        key, eq, text = pair.partition("=")
        if not eq or key not in fields:
            raise ValueError(f"{spec!r}: {pair!r} is not key=value of a recipe field "
                             f"({', '.join(sorted(fields))})")  # fmt: skip
        try:
            overrides[key] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            overrides[key] = text  # a bare word: a string
    try:
        table_levels(recipe_of(size, overrides).levels)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{spec!r}: {e}") from None
    return size, overrides


def recipe_of(size: str, overrides: dict):
    """The `Recipe` a variant builds (`size` overridden by a dict becomes a `ModelSize`)."""
    from lorapop.tiny.pretrain import ModelSize
    from regime_recipes import RECIPES as SIZES

    ov = dict(overrides)
    if isinstance(ov.get("size"), dict):
        ov["size"] = ModelSize(**ov["size"])
    return dataclasses.replace(SIZES[size], **ov)


# -- one variant (a process of its own) -----------------------------------------------------


def build_one(job: dict) -> None:
    """Train one variant into job["dir"] on the shared corpus."""
    import torch

    from lorapop.tiny.pretrain import pretrain_tiny

    torch.set_num_threads(max(1, job["workers"]))
    corpus = None
    if job["corpus"]:
        with open(job["corpus"], "rb") as fh:
            corpus = pickle.load(fh)
    r = recipe_of(job["size"], job["overrides"])
    record = pretrain_tiny(job["dir"], job["seed"], device=job["device"], corpus=corpus,
                           workers=job["workers"], command=job["command"],
                           log=lambda m: print(m, flush=True),
                           **dataclasses.asdict(r) | {"size": r.size})  # fmt: skip
    record |= {"size_name": job["size"], "overrides": job["overrides"]}
    (Path(job["dir"]) / "training.json").write_text(json.dumps(record, indent=1) + "\n")


# -- the driver -------------------------------------------------------------------------------


class Results:
    """The JSON file, rewritten (atomically) on every change."""

    def __init__(self, path: Path, head: dict) -> None:
        self.path, self.data, self.lock = path, {**head, "variants": {}}, threading.Lock()
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def update(self, label: str | None, **fields: object) -> None:
        """Set `fields` of variant `label` (None: of the whole run) and rewrite the file."""
        with self.lock:
            (self.data["variants"].setdefault(label, {}) if label else self.data).update(fields)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.data, indent=1) + "\n")
            tmp.replace(self.path)


def _run(cmd: list[str], log: Path, deadline_at: float) -> str:
    """Run `cmd` (output to `log`) until it ends or the deadline: "ok", "failed" or "timeout"."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])}  # fmt: skip
    with log.open("a") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)  # fmt: skip
        try:
            rc = proc.wait(timeout=max(1.0, deadline_at - time.time()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 15)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait()
            return "timeout"
    return "ok" if rc == 0 else "failed"


def pack_model(model_dir: Path, dest: Path, part_bytes: int = 15 << 20) -> list[str]:
    """Write `model_dir` as a gzipped tar, weights cast to bf16, in `part_bytes` parts
    `dest/NAME_bf16.tgz.partaa`, `...partab`, ...: small enough to copy between machines in 15 MiB pieces.
    Returns the part names."""
    import io
    import itertools
    import string
    import tarfile

    import torch
    from safetensors.torch import load_file, save

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for f in sorted(model_dir.iterdir()):
            if not f.is_file():
                continue
            data = f.read_bytes()
            if f.suffix == ".safetensors":
                data = save({k: v.to(torch.bfloat16) if v.is_floating_point() else v
                             for k, v in load_file(f).items()}, {"format": "pt"})  # fmt: skip
            info = tarfile.TarInfo(f"{model_dir.name}/{f.name}")
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    blob = buf.getvalue()
    dest.mkdir(parents=True, exist_ok=True)
    suffixes = ("".join(t) for t in itertools.product(string.ascii_lowercase, repeat=2))
    names = []
    for i, suffix in zip(range(0, len(blob), part_bytes), suffixes, strict=False):
        name = f"{model_dir.name}_bf16.tgz.part{suffix}"
        (dest / name).write_bytes(blob[i : i + part_bytes])
        names.append(name)
    return names


def _tail(path: Path, n: int = 1500) -> str:
    return path.read_text(errors="replace")[-n:] if path.is_file() else ""


def shared_corpora(variants: dict[str, tuple[str, dict]], out: Path, seed: int, workers: int,
                   log: Path) -> tuple[dict[str, str | None], dict]:  # fmt: skip
    """Make each distinct (level table, programs per level) corpus of the fast-corpus variants
    once; (label -> pickle path or None, facts about each corpus)."""
    from lorapop.tiny.corpus import generate_corpus
    from lorapop.tiny.grammar import table_levels

    paths: dict[str, str | None] = {}
    facts: dict[str, dict] = {}
    for label, (size, ov) in variants.items():
        r = recipe_of(size, ov)
        if not r.fast_corpus:
            paths[label] = None  # the sandbox corpus: built by the variant itself
            continue
        key = f"{r.levels}_{r.n_per_level}_s{seed}"
        path = out / f"corpus_{key}.pkl"
        if key not in facts:
            t0 = time.perf_counter()
            if not path.is_file():
                corpus = generate_corpus(r.n_per_level, f"pretrain/{seed}", workers=workers,
                                         levels=table_levels(r.levels))  # fmt: skip
                tmp = path.with_suffix(".tmp")
                tmp.write_bytes(pickle.dumps(corpus))
                tmp.replace(path)
            else:
                corpus = pickle.loads(path.read_bytes())
            by_level: dict[int, list[int]] = {}
            for t in corpus:
                by_level.setdefault(t.meta["difficulty"], []).append(len(t.program))
            facts[key] = {"programs": len(corpus), "seconds": round(time.perf_counter() - t0, 1),
                          "program_chars_by_level": {str(lv): round(fmean(xs))
                                                     for lv, xs in sorted(by_level.items())}}  # fmt: skip
            with log.open("a") as fh:
                fh.write(f"corpus {key}: {facts[key]}\n")
        paths[label] = str(path)
    return paths, facts


def measure_mix(variants: dict[str, tuple[str, dict]], seed: int, workers: int,
                n_per_level: int, draws: int) -> dict:  # fmt: skip
    """Each variant's example mix as drawn (no training): shares of tokens (rows: prompt +
    completion + EOS, as trained) and of examples per (role, level), the budget's plan, and
    the program length per level of its corpus, in characters and in its tokenizer's tokens."""
    from lorapop.tiny.corpus import generate_corpus, generate_variants_fast
    from lorapop.tiny.grammar import table_levels
    from lorapop.tiny.pretrain import Examples, budget_cells, recipe_tokenizer, tokenize_pairs

    corpora: dict[str, tuple[list, list]] = {}
    out = {}
    for label, (size, ov) in variants.items():
        r = recipe_of(size, ov)
        if r.levels not in corpora:
            corpus = generate_corpus(n_per_level, f"pretrain/{seed}", workers=workers,
                                     levels=table_levels(r.levels))  # fmt: skip
            anchors = [t for t in corpus if t.meta["difficulty"] <= 3]
            corpora[r.levels] = (corpus, generate_variants_fast(
                anchors, f"pretrain/{seed}", workers=workers, table=r.levels))  # fmt: skip
        corpus, pairs = corpora[r.levels]
        pairs = pairs if r.variant_share > 0 else []
        tok = recipe_tokenizer(corpus + [v for _, v in pairs], 2048, r.tokenizer_programs,
                               r.single_chars)  # fmt: skip
        ex = Examples(corpus, random.Random(f"mix/{seed}"), max_refs=r.max_refs,
                      teacher_max_level=r.teacher_max_level, ref_max_chars=r.ref_max_chars,
                      variants=pairs, variant_share=r.variant_share, level_refs=r.level_refs,
                      role_weights=r.role_weights,
                      student_level_weights=r.student_level_weights)  # fmt: skip
        plan = None
        if r.token_shares:
            plan = budget_cells(r.token_shares, r.token_levels, (1, 2, 3, 4, 5), r.teacher_max_level)
            ex.budget(plan, tok, r.max_len)
        got = [ex.draw_cell() for _ in range(draws)]
        lengths = tokenize_pairs(tok, [(p, c) for *_, p, c in got], r.max_len)[1]
        tokens: Counter = Counter()
        count: Counter = Counter()
        for (role, level, _, _), n in zip(got, lengths, strict=True):
            tokens[(role, level)] += int(n)
            count[(role, level)] += 1
        total = sum(tokens.values())

        chars: dict[int, list[int]] = {}
        for t in corpus:
            chars.setdefault(t.meta["difficulty"], []).append(len(t.program))
        sample = {lv: [t.program for t in corpus if t.meta["difficulty"] == lv][:500] for lv in chars}
        out[label] = {
            "levels": r.levels, "draws": draws,
            "mean_tokens_per_example": round(float(lengths.mean()), 1),
            "examples_per_pass": round(r.steps * r.batch_tokens / float(lengths.mean())),
            "token_share_by_role": {role: _share(tokens, lambda ro, lv, role=role: ro == role)
                                    for role in sorted({k[0] for k in tokens})},
            "token_share_students": _share(tokens, lambda ro, lv: ro.startswith("student")),
            "token_share_students_levels_1_3": _share(
                tokens, lambda ro, lv: ro.startswith("student") and lv in (1, 2, 3)),
            "cells": {f"{ro}@{lv}": {"tokens": round(tokens[(ro, lv)] / total, 4),
                                     "examples": round(count[(ro, lv)] / draws, 4),
                                     "mean_tokens": round(tokens[(ro, lv)] / count[(ro, lv)], 1),
                                     "planned": round(plan[(ro, lv)], 4) if plan else None}
                      for ro, lv in sorted(tokens, key=str)},
            "program_chars_by_level": {str(lv): round(fmean(xs)) for lv, xs in sorted(chars.items())},
            "program_tokens_by_level": {
                str(lv): round(fmean(len(ids) for ids in tok(ps, add_special_tokens=False)["input_ids"]))
                for lv, ps in sorted(sample.items())},
        }  # fmt: skip
    return out


def _share(tokens: Counter, pred: Callable[[str, object], bool]) -> float:
    """The share of `tokens` ((role, level) -> count) in the cells where `pred` holds."""
    return round(sum(v for k, v in tokens.items() if pred(*k)) / sum(tokens.values()), 3)


def summary(m: dict) -> dict:
    """The figures of a tiny_world.py result worth comparing across variants."""
    return {"checks": m["checks"], "valid_rate": m["valid_rate"],
            "valid_rate_by_level": m["valid_rate_by_level"],
            "solve_rate_by_level": m["solve_rate_by_level"],
            "solve_rate_levels_1_3": m["solve_rate_levels_1_3"],
            "code_f_solved": m["code_f_solved"], "share_partial": m["share_partial"],
            "dependence": m["reference_dependence"]["dependence"],
            "copy_rate": m["reference_dependence"]["copy_rate"]}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n", 2)[2])  # fmt: skip
    ap.add_argument("variants", nargs="*", help=f"SIZE[,key=value...] (default: "
                    f"{' '.join(DEFAULT_VARIANTS)})")  # fmt: skip
    ap.add_argument("--out", default="runs/recipes", help="models, corpora and logs")
    ap.add_argument("--json", help="results file (default: OUT/world_recipes.json)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 2,
                    help="CPU processes in all: the corpus uses all, then they are split")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--deadline", type=float, default=0, help="seconds; 0: none")
    ap.add_argument("--smoke", action="store_true",
                    help="every variant CPU-sized (2 steps, 30 programs a level): checks the "
                    "pipeline end to end, measures nothing")
    ap.add_argument("--mix", action="store_true",
                    help="measure each variant's example mix on CPU; no training")
    ap.add_argument("--mix-programs", type=int, default=2000, help="--mix: programs per level")
    ap.add_argument("--mix-draws", type=int, default=20000, help="--mix: examples drawn")
    ap.add_argument("--pack", type=Path,
                    help="write each built model here as bf16 parts (e.g. $OUT), before measuring")
    ap.add_argument("--measure", default="",
                    help='arguments for tiny_world.py, e.g. --measure="--proposals 40"')
    ap.add_argument("--build-one", type=Path, help=argparse.SUPPRESS)
    args = sys.argv[1:] if argv is None else list(argv)
    a = ap.parse_args(args)
    if a.build_one:
        build_one(json.loads(a.build_one.read_text()))
        return 0
    t0 = time.time()
    deadline_at = t0 + a.deadline if a.deadline > 0 else float("inf")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    specs = a.variants or list(DEFAULT_VARIANTS)
    try:
        variants = {s: parse_variant(s) for s in specs}
    except ValueError as e:
        ap.error(str(e))
    if a.smoke:
        variants = {k: (size, {**ov, **SMOKE}) for k, (size, ov) in variants.items()}
    if a.mix:
        path = Path(a.json) if a.json else out / "world_mix.json"
        mix = measure_mix(variants, a.seed, a.workers, a.mix_programs, a.mix_draws)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({
            "benchmark": "world_mix", "command": " ".join(
                ["PYTHONPATH=src python experiments/regime/world_recipes.py", *map(shlex.quote, args)]),
            "machine": _machine("cpu"), "programs_per_level": a.mix_programs,
            "seconds": round(time.time() - t0, 1), "variants": mix}, indent=1) + "\n")  # fmt: skip
        print(json.dumps({k: {"students": v["token_share_students"],
                              "students_1_3": v["token_share_students_levels_1_3"],
                              "tokens_per_example": v["mean_tokens_per_example"]}
                          for k, v in mix.items()}))  # fmt: skip
        return 0
    device = "cpu" if a.smoke and a.device == "auto" else a.device
    measure = [*(SMOKE_MEASURE if a.smoke else []), *shlex.split(a.measure)]
    per = max(1, a.workers // len(variants))
    res = Results(Path(a.json) if a.json else out / "world_recipes.json", {
        "benchmark": "world_recipes",
        "command": " ".join(["PYTHONPATH=src python experiments/regime/world_recipes.py",
                             *map(shlex.quote, args)]),
        "smoke": a.smoke, "machine": _machine(device), "workers": a.workers,
        "workers_per_variant": per, "seed": a.seed, "measure_args": measure,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())})  # fmt: skip
    log = out / "driver.log"
    for label, (size, ov) in variants.items():
        res.update(label, size=size, overrides=ov, status="waiting")
    corpora, facts = shared_corpora(variants, out, a.seed, a.workers, log)
    res.update(None, corpora=facts)

    def one(label: str) -> None:
        size, ov = variants[label]
        name = label.replace(",", "_").replace("=", "-").replace("'", "").replace(" ", "")
        d = out / name
        job = {"size": size, "overrides": ov, "dir": str(d), "seed": a.seed, "device": device,
               "workers": per, "corpus": corpora[label],
               "command": f"pretrain_size({size!r}, **{ov!r}) via {res.data['command']}"}  # fmt: skip
        jp = out / f"{name}.job.json"
        jp.write_text(json.dumps(job))
        res.update(label, status="building", dir=str(d), started_s=round(time.time() - t0))
        st = _run([sys.executable, __file__, "--build-one", str(jp)], out / f"{name}.build.log",
                  deadline_at)  # fmt: skip
        if st != "ok":
            res.update(label, status=f"build {st}", log_tail=_tail(out / f"{name}.build.log"))
            return
        training = json.loads((d / "training.json").read_text())
        training.pop("loss_curve", None)
        res.update(label, status="measuring", built_s=round(time.time() - t0), training=training)
        if a.pack:
            res.update(label, packed=pack_model(d, a.pack))
        mp = d / "tiny_world.json"
        st = _run([sys.executable, str(Path(__file__).with_name("tiny_world.py")), "--model", str(d),
                   "--out", str(mp), "--device", device, "--workers", str(per), *measure],
                  out / f"{name}.measure.log", deadline_at)  # fmt: skip
        if st != "ok":
            res.update(label, status=f"measure {st}", log_tail=_tail(out / f"{name}.measure.log"))
            return
        m = json.loads(mp.read_text())
        res.update(label, status="done", done_s=round(time.time() - t0), **summary(m),
                   measure_seconds=m["seconds"], tiny_world=str(mp))  # fmt: skip

    with ThreadPoolExecutor(len(variants)) as pool:
        list(pool.map(one, variants))
    states = {k: v["status"] for k, v in res.data["variants"].items()}
    res.update(None, seconds=round(time.time() - t0, 1))
    print(json.dumps({"json": str(res.path), "status": states,
                      "checks": {k: v.get("checks") for k, v in res.data["variants"].items()}}))  # fmt: skip
    return 0 if all(s == "done" for s in states.values()) else 1


def _machine(device: str) -> dict:
    import torch

    gpu = torch.cuda.get_device_name() if device != "cpu" and torch.cuda.is_available() else None
    return {"device": gpu or "cpu", "cpus": os.cpu_count(), "platform": platform.platform(),
            "torch": torch.__version__}  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
