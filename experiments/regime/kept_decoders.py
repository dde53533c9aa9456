"""Kept decoders against fresh ones: a world step's two generations, same card, same process.

Each step generates as a `world.yaml` step on `world-nocount-77m` does (a run's rollouts at
steps 290-291): 48 teacher prompts of ~110 tokens (max ~350) under 4 slots, up to 256 new
tokens, completions ~40 tokens (p90 ~100); then 42 student prompts of ~90 tokens, 16 answers
each, under 4 other slots, up to 192 new tokens, answers ~8 tokens (p90 ~20). The model has
the recipe's shape and random weights (the cost does not depend on them); EOS is off and each
row stops at a drawn length (a stop function), so both modes decode the same tokens. Between
steps every slot's weights move in place, as an update does. Modes alternate step by step
after one warm-up step each: `fresh` builds a decoder (KV cache, CUDA graphs) at every call,
`kept` reuses `KeptDecoders(3)`'s. Reports per mode the median step wall, the graph captures,
decode steps and prefills (`generate(timing=...)`), peak memory, and the ratio.

    PYTHONPATH=src python experiments/regime/kept_decoders.py --out results.json          # GPU
    PYTHONPATH=src python experiments/regime/kept_decoders.py --size tiny --steps 2       # CPU smoke
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch

from lorapop.engine.generate import GenerateSpec, KeptDecoders, generate
from lorapop.engine.load import TINY_DIR, load_tokenizer
from lorapop.engine.sampling import SamplingParams
from lorapop.lora.bank import AdapterBank
from lorapop.tiny.pretrain import build_model
from regime_recipes import RECIPES as SIZES

TEACHERS = (48, 110, 350, 256, 40)  # prompts, median / max prompt tokens, max new, median new
STUDENTS = (42, 90, 160, 192, 8)
ANSWERS = 16


def _phase(rng: random.Random, shape: tuple[int, int, int, int, int], copies: int,
           slots: list[int], vocab: int) -> tuple[list[list[int]], list[int], list[int]]:
    """Prompts (each `copies` times), their slots and each row's length to stop at."""
    n, mid, top, cap, new = shape
    prompts, slot_ids, stops = [], [], []
    for i in range(n):
        length = min(top, max(8, round(rng.lognormvariate(0, 0.5) * mid)))
        prompt = [rng.randrange(3, vocab) for _ in range(length)]
        for _ in range(copies):
            prompts.append(prompt)
            slot_ids.append(slots[i % len(slots)])
            stops.append(min(cap, max(1, round(rng.lognormvariate(0, 0.8) * new))))
    return prompts, slot_ids, stops


def _step(model, bank, rng: random.Random, vocab: int, kept: KeptDecoders | None,
          seed: int) -> dict[str, float]:
    """One step's two generations; seconds and where they went, summed."""
    out = {"wall_s": 0.0, "capture_s": 0.0, "decode_s": 0.0, "prefill_s": 0.0}
    for shape, copies, slots in ((TEACHERS, 1, [0, 1, 2, 3]), (STUDENTS, ANSWERS, [4, 5, 6, 7])):
        prompts, slot_ids, stops = _phase(rng, shape, copies, slots, vocab)
        params = SamplingParams(temperature=1.0, max_new_tokens=shape[3], eos_token_ids=())
        timing: dict[str, float] = {}
        sync()
        t0 = time.perf_counter()
        gens = generate(model, bank, None, prompts, slot_ids,
                        GenerateSpec(params=params, seed=seed, batch_size=1024, decoders=kept),
                        timing=timing, stop_fn=partial(_stop_at, stops))
        sync()
        out["wall_s"] += time.perf_counter() - t0
        for k in ("capture_s", "decode_s", "prefill_s"):
            out[k] += timing[k]
        assert [len(g.token_ids) for g in gens] == stops, "a row did not stop at its length"
    return out


def _stop_at(stops: list[int], i: int, toks: list[int]) -> int | None:
    return stops[i] if len(toks) >= stops[i] else None


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _move(bank: AdapterBank, gen: torch.Generator) -> None:
    """Every slot's B moves in place, as an update step moves it."""
    with torch.no_grad():
        for t in bank.targets.values():
            t.b.add_(torch.randn(t.b.shape, generator=gen).to(t.b) * 1e-3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="world-nocount-77m", help="a pretrain-tiny recipe's shape")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per mode")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tok = load_tokenizer(str(TINY_DIR))
    size = SIZES[args.size].size
    model = build_model(tok, size, 0).to(dev)
    if dev.type == "cuda":
        model = model.to(torch.bfloat16)
    model.requires_grad_(False)
    bank = AdapterBank(model, n_slots=8, rank=8, alpha=16.0)
    gen = torch.Generator().manual_seed(0)
    _move(bank, gen)
    vocab = model.config.vocab_size
    modes = {"fresh": None, "kept": KeptDecoders(3)}
    steps: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    peak: dict[str, float] = {}
    for i in range(args.steps + 1):  # step 0: warm-up of each mode
        for mode, kept in modes.items():
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            rec = _step(model, bank, random.Random(i), vocab, kept, seed=i)
            if dev.type == "cuda":
                peak[mode] = max(peak.get(mode, 0.0), torch.cuda.max_memory_allocated() / 2**30)
            if i:
                steps[mode].append(rec)
            _move(bank, gen)
        if i:
            print(f"step {i}: " + ", ".join(f"{m} {s[-1]['wall_s']:.2f} s"
                                            for m, s in steps.items()), file=sys.stderr)
    med = {m: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for m, rs in steps.items()}
    result = {
        "benchmark": "kept_decoders",
        "command": "python " + " ".join(sys.argv),
        "device": (torch.cuda.get_device_name() if dev.type == "cuda"
                   else f"cpu, {platform.machine()}"),
        "torch": torch.__version__, "size": args.size, "steps_per_mode": args.steps,
        "median_per_step": med,
        "peak_gib": peak or None,
        "fresh_over_kept_wall": med["fresh"]["wall_s"] / med["kept"]["wall_s"],
        "kept_decoders_made": modes["kept"].made, "kept_decoders_reused": modes["kept"].reused,
    }
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
