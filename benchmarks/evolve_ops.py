"""Time per child of every evolution operator at Qwen2.5-7B shapes, rank 32, all projections.

Random bf16 factors stand in for trained adapters (the cost does not depend on the values).
Imports only torch and lorapop.lora.evolve, so it runs on a machine without our other deps.

    python benchmarks/evolve_ops.py                          # cuda, 28 layers
    python benchmarks/evolve_ops.py --device cpu --layers 2 --threads 1  # quick CPU check
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
HIDDEN, INTER, KV = 3584, 18944, 512  # Qwen2.5-7B: 28 heads x 128, 4 KV heads x 128
MODULES = {  # name: (out, in)
    "self_attn.q_proj": (HIDDEN, HIDDEN), "self_attn.k_proj": (KV, HIDDEN),
    "self_attn.v_proj": (KV, HIDDEN), "self_attn.o_proj": (HIDDEN, HIDDEN),
    "mlp.gate_proj": (INTER, HIDDEN), "mlp.up_proj": (INTER, HIDDEN),
    "mlp.down_proj": (HIDDEN, INTER),
}


def load_evolve():
    """lorapop.lora.evolve; straight from its file if the package's __init__ needs more."""
    sys.path.insert(0, str(ROOT / "src"))
    try:
        from lorapop.lora import evolve
        return evolve
    except ImportError:
        spec = importlib.util.spec_from_file_location(
            "lorapop_evolve", ROOT / "src/lorapop/lora/evolve.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up here
        spec.loader.exec_module(module)
        return module


def make_state(layers: int, rank: int, device: str, seed: int) -> dict:
    g = torch.Generator(device=device).manual_seed(seed)
    state = {}
    for i in range(layers):
        for name, (out, inp) in MODULES.items():
            a = (torch.rand(rank, inp, generator=g, device=device) * 2 - 1) / inp**0.5
            b = torch.randn(out, rank, generator=g, device=device) * 1e-2
            state[f"model.layers.{i}.{name}"] = {"A": a.bfloat16(), "B": b.bfloat16()}
    return state


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_op(op, parents: list, device: str, repeats: int) -> dict:
    op(parents, 0)  # warm-up (kernels, allocator, lazy init)
    sync(device)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    times = []
    for seed in range(1, repeats + 1):
        sync(device)
        t0 = time.perf_counter()
        child = op(parents, seed)
        sync(device)
        times.append(time.perf_counter() - t0)
        del child
    row = {"median_s": statistics.median(times), "min_s": min(times), "times_s": times}
    if device.startswith("cuda"):
        row["peak_extra_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--ops", default="", help="comma list of operators (default: all)")
    ap.add_argument("--out", default="", help="JSON path (default benchmarks/results/evolve_<device>_l<layers>.json)")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    evolve = load_evolve()
    parents = [make_state(args.layers, args.rank, args.device, s) for s in (1, 2)]
    n_params = sum(t.numel() for f in parents[0].values() for t in f.values())
    names = [n for n in args.ops.split(",") if n] or list(evolve.OPERATORS)
    results: dict[str, dict] = {}
    for name in names:
        op = evolve.OPERATORS[name]
        n = evolve.INFO[name].n_parents
        row = time_op(op, parents[:n], args.device, args.repeats)
        results[name] = row
        print(f"{name:>13}  median {row['median_s']:.4f} s  min {row['min_s']:.4f} s"
              + (f"  peak +{row['peak_extra_gib']:.2f} GiB" if "peak_extra_gib" in row else ""),
              flush=True)

    dev_name = (torch.cuda.get_device_name(args.device) if args.device.startswith("cuda")
                else cpu_name())
    report = {
        "benchmark": "evolve_ops",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "device": args.device, "device_name": dev_name,
        "torch": torch.__version__, "python": platform.python_version(),
        "cpu_threads": torch.get_num_threads(),
        "shapes": "Qwen2.5-7B (hidden 3584, inter 18944, kv 512), all 7 projections",
        "layers": args.layers, "rank": args.rank, "dtype": "bfloat16",
        "adapter_params": n_params, "repeats": args.repeats,
        "target_s_per_child": 0.5, "results": results,
    }
    out = Path(args.out or ROOT / f"benchmarks/results/evolve_{args.device.split(':')[0]}_l{args.layers}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
