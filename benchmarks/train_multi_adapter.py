"""Multi-adapter training cost on the Qwen2.5-7B architecture (random bf16 weights, LoRA r=32).

Measures one training step (forward, backward, optimizer) at a fixed total batch for
N = 1, 2, 4, 8, 16 slots, PEFT's one-adapter step on the same batch, N=8 jointly vs one
adapter after another at a fixed per-adapter batch, and peak GPU memory of each case. A
short decode section times one decode step's projections (base + LoRA, CUDA graph) per
LoRA kernel at batch 64, to pick `decode_kernel`.

    PYTHONPATH=src python benchmarks/train_multi_adapter.py --out benchmarks/results/train_h100.json
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import transformers

from lorapop.engine.optim import BankOptimizer
from lorapop.lora import DEFAULT_TARGETS, AdapterBank
from lorapop.lora.routing import Routing, grouped_probe, lora_delta
from qwen7b import ARCH, build_qwen7b

QWEN25_7B = ARCH
RANK, ALPHA = 32, 64


def timed(fn: Callable[[], None], warmup: int, iters: int) -> dict:
    """Median seconds per call and peak memory (GiB) over the timed calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return {
        "seconds": statistics.median(times),
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
    }


def guarded(name: str, make: Callable[[], dict]) -> dict:
    try:
        out = make()
    except torch.cuda.OutOfMemoryError:
        out = {"error": "out of memory"}
    except Exception as err:  # noqa: BLE001 - a failed case is recorded, the others still run
        out = {"error": f"{type(err).__name__}: {err}"[:300]}
    gc.collect()
    torch.cuda.empty_cache()
    print(name, json.dumps(out), flush=True)
    return out


def bank_step_case(model, n: int, ids, slots, warmup, iters, kernel="auto", **bank_kw) -> dict:
    bank = AdapterBank(model, n_slots=n, rank=RANK, alpha=ALPHA, kernel=kernel, **bank_kw)
    opt = BankOptimizer(bank, lr=1e-5, max_grad_norm=1.0)

    def step() -> None:
        opt.zero_grad()
        with torch.autocast("cuda", dtype=torch.bfloat16), bank.route(slots):
            loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()

    try:
        return timed(step, warmup, iters)
    finally:
        bank.detach()


def peft_step_case(model, ids, warmup, iters) -> dict:
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=list(DEFAULT_TARGETS))
    peft = get_peft_model(model, config)
    params = [p for p in peft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5)

    def step() -> None:
        opt.zero_grad()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = peft(ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()

    try:
        return timed(step, warmup, iters)
    finally:
        peft.unload()


def sequential_case(model, n, rows_per_slot, seq, warmup, iters) -> dict:
    """N adapters one after another, each with its own rows: N steps of a one-slot batch."""
    bank = AdapterBank(model, n_slots=n, rank=RANK, alpha=ALPHA)
    opt = BankOptimizer(bank, lr=1e-5, max_grad_norm=1.0)
    ids = torch.randint(0, QWEN25_7B["vocab_size"], (rows_per_slot, seq), device="cuda")

    def all_slots() -> None:
        for s in range(n):
            opt.zero_grad()
            with torch.autocast("cuda", dtype=torch.bfloat16), bank.route([s] * rows_per_slot):
                loss = model(ids, labels=ids).loss
            loss.backward()
            opt.step(slots=[s])

    try:
        return timed(all_slots, warmup, iters)
    finally:
        bank.detach()


@torch.no_grad()
def decode_lora_case(model, n: int, batch: int, kernel: str, replays: int = 20) -> dict:
    """One decode step's projections (base + LoRA of every target), CUDA-graph captured.

    kernel "base": the base projections alone. Seconds per step, and bytes of projection
    weights read per step over that time.
    """
    linears = [
        m
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] in DEFAULT_TARGETS
    ]
    routing = Routing.empty(batch, n, torch.device("cuda"))
    routing.fill_(torch.arange(batch, device="cuda") % n, False)
    bank_a = [
        torch.randn(n, RANK, m.in_features, device="cuda", dtype=torch.bfloat16) for m in linears
    ]
    bank_b = [
        torch.randn(n, m.out_features, RANK, device="cuda", dtype=torch.bfloat16) for m in linears
    ]
    xs = [
        torch.randn(batch, 1, m.in_features, device="cuda", dtype=torch.bfloat16) for m in linears
    ]

    def step() -> None:
        for m, x, a, b in zip(linears, xs, bank_a, bank_b, strict=True):
            y = m(x)
            if kernel != "base":
                y = y + lora_delta(x, a, b, routing, kernel, ALPHA / RANK)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    res = timed(graph.replay, 3, replays)
    weight_bytes = sum(m.weight.numel() * 2 for m in linears)
    if kernel != "base":
        weight_bytes += sum(
            (a.numel() + b.numel()) * 2 for a, b in zip(bank_a, bank_b, strict=True)
        )
    res["weight_gb_per_s"] = weight_bytes / res["seconds"] / 1e9
    return res


@torch.no_grad()
def kernel_check(model) -> dict:
    """Grouped (bf16) vs gather (fp32) LoRA logits on a mixed, unsorted batch."""
    bank = AdapterBank(model, n_slots=4, rank=RANK, alpha=ALPHA)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for t in bank.targets.values():
        t.b.copy_(torch.randn(t.b.shape, generator=gen, device="cuda") * 0.01)
    ids = torch.randint(0, 1000, (4, 16), device="cuda")
    model.eval()
    outs = {}
    try:
        for k in ("grouped", "gather", "dense"):
            bank.kernel = k
            with bank.route([3, 1, 0, 1]):
                outs[k] = model(ids).logits.float()
        base = outs["gather"]
        grads = {}
        model.train()
        with torch.enable_grad():
            for k in ("grouped", "gather"):
                bank.kernel = k
                bank.zero_grad()
                with bank.route([3, 1, 0, 1]):
                    model(ids, labels=ids).loss.backward()
                grads[k] = bank.grads.clone()
        rel = (grads["grouped"] - grads["gather"]).norm() / grads["gather"].norm()
        return {
            "grad_rel_diff_grouped_vs_gather_bf16": rel.item(),
            "grouped_probe_bf16": grouped_probe(torch.device("cuda"), torch.bfloat16) or "ok",
            "grouped_probe_fp32": grouped_probe(torch.device("cuda"), torch.float32) or "ok",
            "max_abs_diff_grouped_vs_gather": (outs["grouped"] - base).abs().max().item(),
            "max_abs_diff_dense_vs_gather": (outs["dense"] - base).abs().max().item(),
            "logit_scale": base.abs().max().item(),
        }
    finally:
        model.train()
        bank.detach()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/train_multi_adapter.json")
    ap.add_argument("--layers", type=int, default=QWEN25_7B["num_hidden_layers"])
    ap.add_argument("--rows", type=int, default=16, help="total rows of the fixed batch")
    ap.add_argument("--seq", type=int, default=256, help="tokens per row")
    ap.add_argument("--slots", default="1,2,4,8,16")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--skip", default="", help="comma list of sections to skip")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))

    torch.manual_seed(0)
    t0 = time.perf_counter()
    model = build_qwen7b(args.layers).train()
    print(f"model built in {time.perf_counter() - t0:.1f}s", flush=True)
    vocab = QWEN25_7B["vocab_size"]
    ids = torch.randint(0, vocab, (args.rows, args.seq), device="cuda")
    result: dict = {
        "command": " ".join([sys.executable, *sys.argv]),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "model": {**QWEN25_7B, "num_hidden_layers": args.layers, "dtype": "bfloat16"},
        "lora": {"rank": RANK, "alpha": ALPHA, "targets": list(DEFAULT_TARGETS)},
        "batch": {"rows": args.rows, "tokens_per_row": args.seq},
        "optimizer": "AdamW, per-slot clipping at 1.0; LoRA weights fp32, bf16 autocast",
    }
    if "check" not in skip:
        result["kernel_check"] = guarded("kernel_check", lambda: kernel_check(model))
    w, it = args.warmup, args.iters
    if "peft" not in skip:
        result["peft_one_adapter"] = guarded("peft", lambda: peft_step_case(model, ids, w, it))
    sweep = {}
    for n in (int(x) for x in args.slots.split(",")):
        slots = sorted(b * n // args.rows for b in range(args.rows))
        sweep[n] = guarded(f"N={n}", lambda n=n, s=slots: bank_step_case(model, n, ids, s, w, it))
    result["fixed_total_batch"] = sweep
    if 1 in sweep and "seconds" in sweep[1]:
        for r in sweep.values():
            if "seconds" in r:
                r["ratio_vs_n1"] = r["seconds"] / sweep[1]["seconds"]
    if "variants" not in skip:
        mixed = [b % 8 for b in range(args.rows)]
        for name, kernel, slots in (
            ("n8_gather_unsorted", "gather", mixed),
            ("n8_gather_sorted", "gather", sorted(mixed)),
            ("n8_grouped_sorted", "grouped", sorted(mixed)),
            ("n8_grouped_unsorted", "grouped", mixed),
        ):
            result[name] = guarded(
                name, lambda k=kernel, s=slots: bank_step_case(model, 8, ids, s, w, it, kernel=k)
            )
    if "seq" not in skip:
        per = args.rows // 8
        joint = sweep.get(8) or guarded("joint", lambda: bank_step_case(model, 8, ids, [], w, it))
        seq = guarded("sequential", lambda: sequential_case(model, 8, per, args.seq, 1, 3))
        result["joint_vs_sequential_n8"] = {
            "rows_per_adapter": per,
            "joint": joint,
            "sequential": seq,
            "speedup": seq.get("seconds", float("nan")) / joint.get("seconds", float("nan")),
        }
    if "decode" not in skip:
        dec = {
            k: guarded(f"decode {k}", lambda k=k: decode_lora_case(model, 8, 64, k))
            for k in ("base", "grouped", "dense", "gather", "base")
        }
        if "seconds" in dec["base"]:
            for r in dec.values():
                if "seconds" in r:
                    r["ratio_vs_base"] = r["seconds"] / dec["base"]["seconds"]
        result["decode_projections_n8_batch64_cuda_graph"] = dec
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out} in {time.perf_counter() - t0:.0f}s", flush=True)


if __name__ == "__main__":
    main()
