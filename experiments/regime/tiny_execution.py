"""How much data does executing programs take? A model trained on student code_o alone.

    PYTHONPATH=src python experiments/regime/tiny_execution.py --level 1 --steps 1500 \\
        --out experiments/regime/results/tiny_execution_level1.json
    PYTHONPATH=src python experiments/regime/tiny_execution.py --model DIR --level 1   # a base, no training
    PYTHONPATH=src python experiments/regime/tiny_execution.py --table natural --eval-table direct \
        --out experiments/regime/results/tiny_execution_natural_on_direct.json     # another table's level
    PYTHONPATH=src python experiments/regime/tiny_execution.py --size world-direct --table direct \
        --steps 4000 --batch-size 256 --lr 1.5e-3 --eval 400 --eval-every 500  # a learning curve
    PYTHONPATH=src python experiments/regime/tiny_execution.py --table nojoin --level 2 \
        --shape hidden=192,layers=8,heads=6,kv_heads=2,intermediate=512  # deeper, same parameters

The regime world's students barely execute (README, "A world in the paper's regime"). This
trains a fresh model of `--size`'s shape (the world tokenizer: string characters unmerged) on
student code_o examples of one level only, drawn from a fresh corpus (`lorapop.tiny.corpus`),
and reports greedy and T=1 accuracy on unseen programs of that level (of `--eval-table`'s, so a
table's level 1 can be scored on another's), by output type and for one-line programs; with
`--model` it scores an existing base on the same tasks instead. How many examples a model
needs for a level says how a pretraining budget should be split between roles.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import os
import platform
import random
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from lorapop.engine.generate import GenerateSpec, SamplingParams, generate
from lorapop.engine.load import load_base_model, load_tokenizer, resolve_device
from lorapop.tasks import Outcome, get_family
from lorapop.tiny.corpus import generate_corpus
from lorapop.tiny.generator import generate_tasks
from lorapop.tiny.grammar import LEVEL_TABLES, table_level
from lorapop.tiny.pretrain import (
    STRING_CHARS,
    Examples,
    as_type,
    build_model,
    encode,
    reshape,
    train,
)
from lorapop.tiny.tokenizer import corpus_texts, train_tokenizer
from lorapop.verify import Sandbox
from regime_recipes import RECIPES as SIZES


def accuracy(model, tok, tasks, sb, temperature: float) -> dict:
    fam = get_family("code_o", template="compact")
    gens = generate(model, None, tok, [fam.student_prompt(t) for t in tasks], [0] * len(tasks),
                    GenerateSpec(params=SamplingParams(temperature=temperature, max_new_tokens=48),
                                 seed=0))  # fmt: skip
    by: dict[str, list[bool]] = defaultdict(list)
    for t, g in zip(tasks, fam.check(tasks, [g.text for g in gens], sb), strict=True):
        ok = g.outcome == Outcome.CORRECT
        by["all"].append(ok)
        by[type(ast.literal_eval(t.output)).__name__].append(ok)
        if len(t.program.strip().splitlines()) == 2:  # `def f(...):` and one `return`
            by["one_line"].append(ok)
    return {k: round(sum(v) / len(v), 3) for k, v in sorted(by.items())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--level", type=int, default=1)
    ap.add_argument("--table", default="standard", choices=sorted(LEVEL_TABLES),
                    help="level table of the training programs")
    ap.add_argument("--eval-table", choices=sorted(LEVEL_TABLES),
                    help="level table of the scored programs (default: --table)")
    ap.add_argument("--model", help="score this base instead of training one")
    ap.add_argument("--size", default="tiny", help="model shape of a pretrain-tiny size")
    ap.add_argument("--shape", default="", metavar="KEY=N,...",
                    help="change --size's shape, e.g. hidden=192,layers=8,heads=6,kv_heads=2,"
                         "intermediate=512 (deeper at equal parameters)")
    ap.add_argument("--programs", type=int, default=20_000, help="training programs")
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--eval", type=int, default=80, help="unseen tasks to score")
    ap.add_argument("--eval-every", type=int, default=0,
                    help="also score every N steps (a learning curve: `curve` in the JSON)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out", default="experiments/regime/results/tiny_execution.json")
    a = ap.parse_args()
    a.eval_table = a.eval_table or a.table
    if a.size not in SIZES:
        ap.error(f"--size {a.size!r}: known sizes are {', '.join(SIZES)}")
    try:
        shape = reshape(SIZES[a.size].size, a.shape)
    except ValueError as e:
        ap.error(f"--shape {a.shape!r}: {e}")
    dev = resolve_device(a.device)
    t0 = time.perf_counter()
    train_level = table_level(a.level, a.table)
    eval_level = table_level(a.level, a.eval_table)
    record: dict = {"benchmark": "tiny_execution", "level": a.level, "table": a.table,
                    "eval_table": a.eval_table,
                    "command": "PYTHONPATH=src python " + " ".join(sys.argv),
                    "machine": {"device": str(dev), "cpus": os.cpu_count(),
                                "platform": platform.platform(), "torch": torch.__version__}}  # fmt: skip
    with Sandbox(workers=a.workers, timeout_s=2.0) as sb:
        tasks = generate_tasks("code_o", a.eval, eval_level, "probe-exec", sandbox=sb)
        if a.model:
            tok = load_tokenizer(a.model)
            model = load_base_model(a.model, tok, str(dev), "float32", 0).eval()
            record["model"] = a.model
        else:
            corpus = generate_corpus(a.programs, "exec/0", levels=(train_level,), workers=a.workers)
            texts = corpus_texts([as_type(t, "code_o") for t in corpus[:5000]])
            tok = train_tokenizer(texts, vocab_size=1024, single_chars=STRING_CHARS)
            model = build_model(tok, shape, 0)
            ex = Examples(corpus, random.Random("exec/0"), role_weights=(0, 0, 0, 1, 0, 0))
            batches = (encode(tok, [ex.draw()[1:] for _ in range(a.batch_size)], 512)
                       for _ in range(a.steps))  # fmt: skip
            curve: list[dict] = []

            def score(step: int) -> None:
                side, tok.padding_side = tok.padding_side, "left"
                model.eval()
                curve.append({"step": step, "examples": step * a.batch_size,
                              "greedy": accuracy(model, tok, tasks, sb, 0.0)["all"],
                              "t1": accuracy(model, tok, tasks, sb, 1.0)["all"]})  # fmt: skip
                model.train()
                tok.padding_side = side
                print(json.dumps(curve[-1]), flush=True)

            record.update(size=a.size, shape=dataclasses.asdict(shape),
                          parameters=sum(p.numel() for p in model.parameters()),
                          programs=a.programs, steps=a.steps, examples=a.steps * a.batch_size,
                          lr=a.lr)  # fmt: skip
            try:
                losses = train(model, batches, a.steps, dev, lr=a.lr, log=None,
                               every=(a.eval_every, score) if a.eval_every else None)
                record.update(loss={str(i): round(x, 4) for i, x in enumerate(losses) if i % 250 == 0},
                              final_loss=sum(losses[-50:]) / len(losses[-50:]))  # fmt: skip
            except FloatingPointError as e:  # the curve so far stands; the model is not scored
                record["diverged"] = str(e)
                print(f"diverged: {e}", file=sys.stderr)
            if curve:
                record["curve"] = curve
        tok.padding_side = "left"
        if "diverged" not in record:
            record["greedy"] = accuracy(model, tok, tasks, sb, 0.0)
            record["t1"] = accuracy(model, tok, tasks, sb, 1.0)
    record["seconds"] = round(time.perf_counter() - t0, 1)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps({k: record.get(k) for k in ("greedy", "t1", "final_loss", "diverged", "seconds")}))


if __name__ == "__main__":
    main()
