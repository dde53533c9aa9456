"""The regime measurement of a tiny-world base model (`lorapop.tiny.world.measure_world`).

    PYTHONPATH=src python experiments/regime/tiny_world.py --model tiny --out experiments/regime/results/tiny_world_tiny.json
    PYTHONPATH=src python experiments/regime/tiny_world.py --model DIR --proposals 40 --answers 8 --workers 14

Writes JSON: valid rate at T=1 per type (and level), the model's solve rate on its own valid
tasks by level 1-5 and type, code_f solved rate, the share of tasks with 0 < s < 1 and the
teacher rewards they would earn, reference dependence, the regime's targets (`checks`), and
optionally held-out greedy pass@1 (`--heldout-per-level`), with machine and command. Levels
are those of the model's own level table (`--level-table`; the world recipes' is `world`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch
import transformers

from lorapop.engine.load import TINY_DIR, load_base_model, load_tokenizer, resolve_device
from lorapop.tiny.evaluate import evaluate_tiny
from lorapop.tiny.grammar import LEVEL_TABLES, TABLE_RULES
from lorapop.tiny.heldout import build_heldout, fingerprint
from lorapop.tiny.world import CODE_F_INPUTS, world_of
from lorapop.verify import Sandbox
from regime_measure import measure_world, regime_checks, world_pools


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny", help="model directory, or `tiny` (the shipped one)")
    ap.add_argument("--out", default="experiments/regime/results/tiny_world.json")
    ap.add_argument("--proposals", type=int, default=20, help="per task type and level")
    ap.add_argument("--answers", type=int, default=8, help="answers per valid task")
    ap.add_argument("--references", type=int,
                    help="default: as many as the model's teacher prompts showed (at most)")
    ap.add_argument("--code-f-inputs", type=int,
                    help="inputs a code_f proposal gives (tasks.code_f_inputs; even ones are "
                    "shown to students, odd ones check them); default: the one count the model "
                    "was pretrained on (its training.json), else 4")
    ap.add_argument("--pool-per-level", type=int, default=40, help="reference pool per type/level")
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    ap.add_argument("--level-table", choices=sorted(LEVEL_TABLES),
                    help="level table of the references and held-out tasks; default: the one "
                    "the model was pretrained on (its training.json), else standard")
    ap.add_argument("--heldout-per-level", type=int, default=0, help="0: skip held-out pass@1")
    ap.add_argument("--teacher-max-new-tokens", type=int, default=512,
                    help="level-5 programs are ~330 tokens (p90 ~400)")
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto", help="auto: bfloat16 on GPU (as the loop), else float32")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    model_dir = TINY_DIR if a.model == "tiny" else Path(a.model)
    try:
        world = world_of(model_dir)
    except ValueError as e:
        ap.error(str(e))
    table = a.level_table or world["levels"]
    references = a.references or world["references"]
    code_f_inputs = a.code_f_inputs or world["code_f_inputs"] or CODE_F_INPUTS
    dev = resolve_device(a.device)
    tok = load_tokenizer(a.model)
    tok.padding_side = "left"
    model = load_base_model(a.model, tok, str(dev), a.dtype, a.seed).eval()
    t0 = time.perf_counter()
    with Sandbox(workers=a.workers, timeout_s=2.0) as sb:
        pools = world_pools(a.pool_per_level, sb, levels=a.levels, table=table,
                            code_f_inputs=code_f_inputs)
        t1 = time.perf_counter()
        m = measure_world(model, tok, sb, pools, proposals=a.proposals, answers=a.answers,
                          references=references, teacher_max_new_tokens=a.teacher_max_new_tokens,
                          batch_size=a.batch_size, seed=a.seed, code_f_inputs=code_f_inputs,
                          rules=TABLE_RULES.get(table))  # fmt: skip
        m["settings"]["level_table"] = table
        t2 = time.perf_counter()
        heldout = None
        if a.heldout_per_level:
            tasks = build_heldout(a.heldout_per_level, sandbox=sb, table=table)
            table = evaluate_tiny(model, tok, tasks, sb, batch_size=a.batch_size, seed=a.seed)
            heldout = {"n_per_level": a.heldout_per_level, "fingerprint": fingerprint(tasks),
                       **table["members"]["base"]}  # fmt: skip
        t3 = time.perf_counter()
    training = model_dir / "training.json"
    result = {
        "benchmark": "tiny_world",
        "command": "PYTHONPATH=src python " + " ".join(sys.argv),
        "machine": {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                    "cpus": os.cpu_count(), "platform": platform.platform(),
                    "torch": torch.__version__, "transformers": transformers.__version__},
        "model": {"name_or_path": a.model, "parameters": sum(p.numel() for p in model.parameters()),
                  "training": json.loads(training.read_text()) if training.is_file() else None},
        "checks": regime_checks(m),
        **m,
        "heldout": heldout,
        "seconds": {"pools": round(t1 - t0, 1), "measure": round(t2 - t1, 1),
                    "heldout": round(t3 - t2, 1)},
    }  # fmt: skip
    if result["model"]["training"]:
        result["model"]["training"].pop("loss_curve", None)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({"checks": result["checks"], "valid_rate": m["valid_rate"],
                      "solve_rate_by_level": m["solve_rate_by_level"],
                      "code_f_solved": m["code_f_solved"],
                      "dependence": m["reference_dependence"]["dependence"]}))  # fmt: skip


if __name__ == "__main__":
    main()
