"""Where one decode step's time goes, at the paper's batch shapes, on the GPU.

For each case ROWS:CONTEXT the paper config's decoder (random-weight 7B, 8-slot bank, rows
spread over 4 adapters as in a phase) is set as if every row had CONTEXT cached positions,
its step captured in a CUDA graph as generation captures it, and replayed: milliseconds per
step against the roofline bound at that shape (`loop_step.decode_cost` for one step), and
with `--profile` the GPU kernels of a few replays by kind, with the number of kernels a step
launches. No prefill runs: the cache holds zeros, which the attention reads at
the same cost as keys. `--and-unfused` replays each case again with the fused inference passes
off (`lorapop.engine.fused.INFERENCE`), `--and-plain-lora` with the LoRA terms as every
slot's masked GEMMs (`lorapop.lora.decode_kernel.ENABLED`), `--and-scatter-write` with the
step's key and value scattered before the attention kernel rather than written by it
(`lorapop.engine.decode_attention.WRITE_IN_KERNEL`), `--and-shrink-kernel` with the LoRA
shrinks as kernels of their own rather than from the projections' GEMMs
(`lorapop.engine.merged.LORA_ROWS`), `--and-split-swiglu` with the gate/up LoRA expand and the
SwiGLU as two kernels rather than one (`lorapop.lora.decode_kernel.SWIGLU`): before/afters in
one process.
`--prefill ROWS:LENGTH,...` times one admission's prefill too (tokens/s, MFU, kernels; again
with each `--and-FLAG`'s path off), and
`--and-other-prefills` each again through the paths the default replaced: the decode cache's
factors as one GEMM pair per slot and projection (`runs`: `decode_kernel.ENABLED` off), and
the slots' factors cast per projection and run (`cast`: `bank.PREFILL_FROM_CACHE` off).

    python benchmarks/decode_step.py --cases 176:2600,266:1300,8:3500 --profile \\
        --out benchmarks/results/decode_step_h200.json
    PYTHONPATH=src python benchmarks/decode_step.py --smoke --cases 4:32 --out /tmp/d.json
"""

from __future__ import annotations

import argparse
import importlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import profiler

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loop_step import (  # noqa: E402
    DEV,
    ROOT,
    SMOKE,
    bench_overrides,
    decode_cost,
    prefill_mfu,
    roofline_s,
    sync_cuda,
)

#: kernel kinds by name, first match wins (Triton kernels of the fused passes are "triton_")
KINDS = {"lora": ("_shrink_kernel", "_expand_kernel"),
         "attention": ("_split_kernel", "_combine_kernel", "attn", "fmha", "flash"),
         "sampler": ("_sample_kernel", "softmax", "scan", "search", "cumsum"),
         "gemm": ("gemm", "nvjet", "cutlass", "sm90_xmma", "splitk"),
         "fused_passes": ("triton_",),
         "elementwise": ("elementwise", "rms_norm", "index", "copy", "scatter", "gather", "cat")}


#: --and-FLAG: each case again with one fast path off, as (its record key, the module, its
#: switch, what runs instead)
SWITCHES = {
    "unfused": ("fused_inference", "lorapop.engine.fused", "INFERENCE",
                "the unfused inference kernels"),
    "plain-lora": ("lora_kernels", "lorapop.lora.decode_kernel", "ENABLED",
                   "the LoRA terms as the masked GEMMs of every slot"),
    "scatter-write": ("write_in_kernel", "lorapop.engine.decode_attention", "WRITE_IN_KERNEL",
                      "the step's key and value scattered into the cache before the attention "
                      "kernel"),
    "shrink-kernel": ("shrink_in_gemm", "lorapop.engine.merged", "LORA_ROWS",
                      "the LoRA shrinks as kernels of their own rather than from the "
                      "projections' GEMMs"),
    "split-swiglu": ("swiglu_epilogue", "lorapop.lora.decode_kernel", "SWIGLU",
                     "the gate/up LoRA expand and the SwiGLU as kernels of their own"),
}


def set_switches(off: str | None) -> dict[str, bool]:
    """Every fast path in `SWITCHES` on but `off`'s; returns them by record key."""
    state = {}
    for flag, (key, module, switch, _) in SWITCHES.items():
        setattr(importlib.import_module(module), switch, flag != off)
        state[key] = flag != off
    return state


def _us(e) -> float:
    """An event's own time in us: GPU kernel time on CUDA, the operator's CPU time on a CPU."""
    return e.device_time_total if DEV == "cuda" else e.self_cpu_time_total


def kinds_of(prof, steps: int) -> tuple[dict[str, float], int, list[dict]]:
    """GPU ms per step by kind, kernels per step, and the 25 costliest kernels per step (on
    a CPU: operators and their CPU time)."""
    device = "CUDA" if DEV == "cuda" else "CPU"
    events = [e for e in prof.key_averages()
              if device in str(getattr(e, "device_type", "")) and _us(e) > 0
              and (DEV != "cuda" or not e.key.startswith(("aten::", "cuda", "Memcpy", "Memset")))]
    kinds = dict.fromkeys([*KINDS, "other"], 0.0)
    for e in events:
        name = e.key.lower()
        kind = next((k for k, words in KINDS.items() if any(w in name for w in words)), "other")
        kinds[kind] += _us(e) / 1e3 / steps
    top = [{"name": e.key[:120], "per_step": e.count / steps, "ms_per_step": _us(e) / 1e3 / steps}
           for e in sorted(events, key=_us, reverse=True)[:25]]
    return kinds, round(sum(e.count for e in events) / steps), top


def seconds(fn, reps: int) -> float:
    """Mean seconds a call of `fn` takes over `reps` calls, its GPU work included."""
    sync_cuda()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    sync_cuda()
    return (time.perf_counter() - t0) / reps


def kernels(fn, calls: int) -> tuple[dict[str, float], int, list[dict]]:
    """`kinds_of` `calls` calls of `fn`: GPU ms per call by kind, kernels, the costliest."""
    activity = profiler.ProfilerActivity.CUDA if DEV == "cuda" else profiler.ProfilerActivity.CPU
    with profiler.profile(activities=[activity]) as prof:
        for _ in range(calls):
            fn()
        sync_cuda()
    return kinds_of(prof, calls)


def case(parts, rows: int, context: int, reps: int, profile: bool) -> dict:
    """One (rows, context) decoder: its captured step replayed `reps` times."""
    from lorapop.engine.decoder import Decoder, route
    from lorapop.engine.patches import static_kv
    from lorapop.engine.sampling import SamplingParams

    model, bank = parts.model, parts.bank
    model.eval()
    steps = reps + 8
    params = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=steps, eos_token_ids=())
    dec = Decoder(model, bank, rows, context + steps + 1, params, eos_ids=())
    adapters = min(4, len(parts.slot))
    g = torch.Generator().manual_seed(rows)
    dec.tok.copy_(torch.randint(0, model.config.vocab_size, (rows,), generator=g))
    dec.slots.copy_(torch.arange(rows) * adapters // rows)  # rows in slot order, 4 adapters
    dec.u.uniform_()
    bank.sync_caches()
    start = dec.kv.pos.clone().fill_(context)

    def reset() -> None:
        dec.kv.pos.copy_(start)
        dec.col.fill_(1)
        dec.done.fill_(False)

    out: dict = {"rows": rows, "context": context, "adapters": adapters,
                 "bound_ms": None}
    bound = roofline_s(*decode_cost(model, bank, 1, adapters, rows, rows * context))
    if bound is not None:
        out["bound_ms"] = 1e3 * bound
    with torch.no_grad(), static_kv(model, dec.kv), route(bank, dec.slots):
        bank.set_slot_ids_(dec.slots)
        reset()
        t0 = time.perf_counter()
        step = dec._at_width(dec.length)  # captures the graph (CUDA), as generation does
        sync_cuda()
        out["capture_s"] = time.perf_counter() - t0
        reset()
        for _ in range(3):
            step()
        reset()
        out["ms_per_step"] = 1e3 * seconds(step, reps)
        if out["bound_ms"]:
            out["fraction_of_bound"] = out["bound_ms"] / out["ms_per_step"]
        if profile:
            reset()
            out["kernel_ms_per_step"], out["kernels_per_step"], out["top_kernels"] = \
                kernels(step, min(reps, 10))
    return out


def prefill_case(parts, rows: int, length: int, reps: int, profile: bool,
                 prefill_tokens: int) -> dict:
    """One admission's prefill: `rows` prompts of `length` random tokens over 4 adapters in
    slot order, fed as the decoder feeds them (`prefill_tokens` a forward): seconds, tokens/s
    and MFU (`loop_step.prefill_mfu`), `profile` its kernels by kind."""
    from lorapop.engine.decoder import Decoder
    from lorapop.engine.patches import static_kv
    from lorapop.engine.sampling import SamplingParams

    model, bank = parts.model, parts.bank
    model.eval()
    params = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=2, eos_token_ids=())
    dec = Decoder(model, bank, rows, length + 64, params, eos_ids=(),
                  prefill_tokens=prefill_tokens)
    g = torch.Generator().manual_seed(rows)
    prompts = torch.randint(0, model.config.vocab_size, (rows, length), generator=g).tolist()
    adapters = min(4, len(parts.slot))
    slots = [i * adapters // rows for i in range(rows)]
    out: dict = {"prefill_rows": rows, "length": length, "tokens": rows * length,
                 "adapters": adapters, "prefill_tokens": prefill_tokens}
    with torch.no_grad(), static_kv(model, dec.kv):
        def fill() -> None:
            dec._prefill(prompts, slots, list(range(rows)))

        for _ in range(2):
            fill()
        s = seconds(fill, reps)
        out.update(ms=1e3 * s, tokens_per_s=rows * length / s)
        if (mfu := prefill_mfu(model, rows * length, s)) is not None:
            out["mfu"] = mfu
        if profile:
            out["kernel_ms"], out["kernels"], out["top_kernels"] = kernels(fill, 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/qwen2.5-coder-7b-4v4.yaml")
    ap.add_argument("--cases", default="176:2600,266:1300,8:3500",
                    help="ROWS:CONTEXT,... (default: the proposals' and answers' full batches "
                         "at their mean cached length, and a tail of 8 long rows)")
    ap.add_argument("--prefill", default="",
                    help="ROWS:LENGTH,... also time one admission's prefill of ROWS prompts of "
                         "LENGTH tokens (e.g. 4:1960,9:700: the paper's proposals and a group "
                         "of answers' tasks)")
    ap.add_argument("--and-other-prefills", action="store_true",
                    help="also run each --prefill with the LoRA terms as a GEMM pair per slot "
                         "and projection (runs: the decode kernels off), and with each slot's "
                         "factors cast per projection and run (cast: lorapop.lora.bank."
                         "PREFILL_FROM_CACHE off)")
    ap.add_argument("--reps", type=int, default=50, help="replays timed per case")
    ap.add_argument("--profile", action="store_true", help="kernels of 10 replays by kind")
    for flag, (_, module, switch, what) in SWITCHES.items():
        ap.add_argument(f"--and-{flag}", action="store_true",
                        help=f"also replay each case with {what} ({module}.{switch} off)")
    ap.add_argument("--out", default="benchmarks/results/decode_step.json")
    ap.add_argument("--smoke", action="store_true",
                    help="CPU check of the script: tiny random model (pass small cases)")
    ap.add_argument("overrides", nargs="*", help="extra key.path=value")
    args = ap.parse_args()
    if args.smoke:
        args.overrides = [*SMOKE, *args.overrides]
    elif DEV != "cuda":
        sys.exit("decode_step.py needs a CUDA GPU (or --smoke for a CPU check of the script)")
    from lorapop.config import load_config
    from lorapop.lora import bank as bank_mod
    from lorapop.lora import decode_kernel
    from lorapop.selfplay.parts import build

    cfg = load_config(ROOT / args.config,
                      [*bench_overrides(Path(tempfile.mkdtemp()), 4), *args.overrides])
    parts = build(cfg)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    result = {"benchmark": "decode_step", "commit": commit,
              "command": " ".join(["python", *sys.argv]),
              "device": torch.cuda.get_device_name() if DEV == "cuda" else "cpu",
              "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "cases": []}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    offs = [None, *(f for f in SWITCHES if getattr(args, "and_" + f.replace("-", "_")))]
    for spec in filter(None, args.cases.split(",")):
        rows, context = map(int, spec.split(":"))
        for off in offs:
            r = set_switches(off) | case(parts, rows, context, args.reps, args.profile)
            if DEV == "cuda":  # the case's cache and graph pool
                torch.cuda.empty_cache()
            print(json.dumps({k: v for k, v in r.items() if k != "top_kernels"}), flush=True)
            result["cases"].append(r)
            out.write_text(json.dumps(result, indent=2))
    result["prefills"] = []
    for spec in filter(None, args.prefill.split(",")):
        rows, length = map(int, spec.split(":"))
        paths = ("kernels", "runs", "cast") if args.and_other_prefills else ("kernels",)
        for path, off in [(p, o) for p in paths for o in (offs if p == "kernels" else [None])]:
            switches = set_switches(off)
            decode_kernel.ENABLED = path == "kernels" and switches["lora_kernels"]
            bank_mod.PREFILL_FROM_CACHE = path != "cast"
            r = {"path": path, **switches,
                 **prefill_case(parts, rows, length, max(3, args.reps // 10), args.profile,
                                cfg.sampling.prefill_tokens)}
            if DEV == "cuda":
                torch.cuda.empty_cache()
            print(json.dumps({k: v for k, v in r.items() if k != "top_kernels"}), flush=True)
            result["prefills"].append(r)
            out.write_text(json.dumps(result, indent=2))
    set_switches(None)
    bank_mod.PREFILL_FROM_CACHE = decode_kernel.ENABLED = True


if __name__ == "__main__":
    main()
