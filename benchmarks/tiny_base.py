"""The tiny base before self-play: valid-proposal rate per task type and held-out pass@1.

PYTHONPATH=src python benchmarks/tiny_base.py [--model DIR] [--out benchmarks/results/tiny_base.json]

Proposals: `--proposals` per type, sampled at temperature 1 from the shipped model (no
adapters), each shown `--references` tasks drawn from a buffer of generated train-split tasks
(levels 1..3); code_f bases are drawn from the code_o/code_i buffers. Held-out: the fixed
benchmark (`build_heldout`, 20 tasks per type and level), greedy pass@1.
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
from transformers import AutoModelForCausalLM, AutoTokenizer

from lorapop.tiny import build_heldout, fingerprint, generate_tasks
from lorapop.tiny.evaluate import evaluate_tiny, proposal_validity
from lorapop.tiny.pretrain import TINY_MODEL_DIR
from lorapop.verify import Sandbox


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=str(TINY_MODEL_DIR))
    p.add_argument("--out", default="benchmarks/results/tiny_base.json")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--proposals", type=int, default=100)
    p.add_argument("--references", type=int, default=2)
    p.add_argument("--per-level", type=int, default=20)
    p.add_argument("--device", default="auto")
    p.add_argument("--workers", type=int, default=2)
    a = p.parse_args()
    dev = "cuda" if a.device == "auto" and torch.cuda.is_available() else a.device
    dev = "cpu" if dev == "auto" else dev
    tok = AutoTokenizer.from_pretrained(a.model)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32).to(dev).eval()
    t0 = time.perf_counter()
    with Sandbox(workers=a.workers, timeout_s=2.0) as sb:
        buffer = {
            kind: [t for lvl in (1, 2, 3)
                   for t in generate_tasks(kind, 20, lvl, f"buffer/{a.seed}", sandbox=sb)]
            for kind in ("code_o", "code_i")
        }  # fmt: skip
        buffer["code_f"] = [t for lvl in (1, 2, 3) for t in generate_tasks(
            "code_f", 20, lvl, f"buffer/{a.seed}", sandbox=sb, n_inputs=4)]  # fmt: skip
        t1 = time.perf_counter()
        validity = proposal_validity(model, tok, buffer, sb, n=a.proposals,
                                     references=a.references, seed=a.seed)  # fmt: skip
        t2 = time.perf_counter()
        heldout = build_heldout(a.per_level, sandbox=sb)
        table = evaluate_tiny(model, tok, heldout, sb, seed=a.seed)
        t3 = time.perf_counter()
    train = json.loads((Path(a.model) / "training.json").read_text())
    result = {
        "command": "PYTHONPATH=src python " + " ".join(sys.argv),
        "seed": a.seed,
        "machine": {
            "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
        "model": {"dir": a.model, "parameters": sum(p.numel() for p in model.parameters()),
                  "training": {k: train.get(k) for k in ("seed", "steps", "device", "final_loss")}},
        "valid_proposals": validity,
        "heldout": {"n_per_level": a.per_level, "fingerprint": fingerprint(heldout),
                    **table["members"]["base"]},
        "seconds": {"buffer": round(t1 - t0, 1), "proposals": round(t2 - t1, 1),
                    "heldout": round(t3 - t2, 1)},
    }  # fmt: skip
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({"valid": {k: v["valid_rate"] for k, v in validity.items()},
                      "heldout": table["members"]["base"]["by_level"],
                      "by_type": table["members"]["base"]["by_type"]}))  # fmt: skip


if __name__ == "__main__":
    main()
