"""Why a tiny-world base is out of the regime: memorised programs, and the shape of its proposals.

    PYTHONPATH=src python experiments/regime/tiny_memorization.py --model DIR --out experiments/regime/results/X.json

1. Completion loss per role (nats/token) on fresh examples of the base's own training programs
   (a prefix of its corpus: same seed, same generator) vs of unseen programs drawn the same way
   (another corpus seed), with the recipe in DIR/training.json. A base that learned the grammar
   scores both alike; one that memorised its corpus scores its own programs far lower.
2. `--proposals N` code_o/code_i teacher proposals per level (T=1, two references of that
   level): valid share, and how many have the reference-conditioned examples' shape (a helper
   `g` called by `f`) and how many of those helpers are one of the shown references.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
from collections import defaultdict
from pathlib import Path

import torch

from lorapop.engine.generate import GenerateSpec, SamplingParams, generate
from lorapop.engine.load import load_base_model, load_tokenizer
from lorapop.tasks import get_family
from lorapop.tiny.generator import generate_variants, normalize
from lorapop.tiny.pretrain import Examples, build_corpus, encode
from lorapop.verify import Sandbox
from regime_measure import world_pools


def role_losses(model, tok, rec: dict, seed: int, n_per_level: int, examples: int, sb) -> dict:
    """Mean completion loss per role of `examples` fresh draws over corpus `seed`'s programs."""
    corpus = build_corpus(n_per_level, seed, sb)
    anchors = [t for t in corpus if (t.meta.get("difficulty") or 5) <= 3]
    variants = generate_variants(anchors, f"pretrain/{seed}", sb) if rec["variant_share"] else []
    ex = Examples(corpus, random.Random(f"probe/{seed}"), teacher_max_level=rec["teacher_max_level"],
                  variants=variants, variant_share=rec["variant_share"],
                  level_refs=rec.get("level_refs", False),
                  ref_max_chars=rec.get("ref_max_chars", 400))  # fmt: skip
    by: dict[str, list[tuple[str, str]]] = defaultdict(list)
    for _ in range(examples):
        role, p, c = ex.draw()
        by[role].append((p, c))
    out = {}
    for role, pairs in sorted(by.items()):
        total, count = 0.0, 0
        for i in range(0, len(pairs), 16):
            ids, mask, labels = encode(tok, pairs[i : i + 16], rec.get("max_len", 1024))
            with torch.no_grad():
                logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
            y = labels[:, 1:]
            total += float(torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), y.reshape(-1), ignore_index=-100,
                reduction="sum"))  # fmt: skip
            count += int((y != -100).sum())
        out[role] = round(total / count, 4)
    return out


def proposal_shapes(model, tok, sb, levels: list[int], n: int, seed: int) -> dict:
    rng = random.Random(f"shapes/{seed}")
    pools = world_pools(8, sb, levels=levels)
    out = {}
    for lv in levels:
        for kind in ("code_o", "code_i"):
            fam = get_family(kind, template="compact")
            shown = [rng.sample(pools[lv][kind], 2) for _ in range(n)]
            gens = generate(model, None, tok, [fam.teacher_prompt(s) for s in shown], [0] * n,
                            GenerateSpec(params=SamplingParams(temperature=1.0, max_new_tokens=512),
                                         seed=seed))
            verdicts = fam.verify([g.text for g in gens], sb)
            helper = copies = 0
            for g, refs in zip(gens, shown, strict=True):
                if "def g(" in g.text:
                    helper += 1
                    h = normalize(g.text.split("def f(")[0].replace("def g(", "def f(", 1))
                    copies += any(h == normalize(r.program) for r in refs)
            out[f"{kind}/level_{lv}"] = {"n": n, "valid": sum(v.valid for v in verdicts),
                                         "helper_shape": helper, "helper_is_shown_ref": copies}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a pretrain-tiny directory (with training.json)")
    ap.add_argument("--out", default="experiments/regime/results/tiny_memorization.json")
    ap.add_argument("--per-level", type=int, default=24, help="programs per level of each corpus")
    ap.add_argument("--examples", type=int, default=360, help="examples per corpus (all roles)")
    ap.add_argument("--proposals", type=int, default=0, help="per type and level; 0: skip")
    ap.add_argument("--levels", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--workers", type=int, default=2)
    a = ap.parse_args()
    rec = json.loads((Path(a.model) / "training.json").read_text())
    tok = load_tokenizer(a.model)
    model = load_base_model(a.model, tok, "cpu", "float32", 0).eval()
    with Sandbox(workers=a.workers, timeout_s=2.0) as sb:
        result = {
            "benchmark": "tiny_memorization",
            "command": "PYTHONPATH=src python " + " ".join(sys.argv),
            "machine": {"device": "cpu", "cpus": os.cpu_count(), "platform": platform.platform()},
            "model": {"path": a.model, "final_loss": rec.get("final_loss"),
                      "steps": rec.get("steps"), "corpus_seed": rec["seed"]},
            "loss_own_programs": role_losses(model, tok, rec, rec["seed"], a.per_level,
                                             a.examples, sb),
            "loss_unseen_programs": role_losses(model, tok, rec, rec["seed"] + 1, a.per_level,
                                                a.examples, sb),
        }  # fmt: skip
        tok.padding_side = "left"
        if a.proposals:
            result["proposals"] = proposal_shapes(model, tok, sb, a.levels, a.proposals, 0)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
