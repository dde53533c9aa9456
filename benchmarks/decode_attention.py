"""Decode attention at the paper's shapes: the kernel the decoder uses vs the alternatives.

One decode step attends, per layer, one query token of each row over the row's cached keys
(Qwen2.5-7B: 28 query heads in 4 KV groups of 7, head dim 128, bf16) with a per-row length.
The decoder runs lorapop's Triton kernel (`engine/decode_attention.py`: each row's own
positions only); its reference folds each group's 7 query heads into the query-length axis
and calls SDPA with an additive mask [B, 1, 1, W]. This times, per call (one layer), the
kernel, that SDPA call under each backend that accepts it, the same maths as three plain
kernels (batched GEMM, masked softmax, batched GEMM), and FlexAttention when this torch build
has it, at rows x width shapes from the paper step (rows at positions spread over the upper
half of the width), and reports the bandwidth on the bytes a row's positions hold (K and V of
positions [0, pos] / time) and the largest difference from an fp32 reference.

    PYTHONPATH=src python benchmarks/decode_attention.py --out benchmarks/results/decode_attention.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

KV_HEADS, GROUPS, HEAD_DIM, LAYERS = 4, 7, 128, 28


def inputs(rows: int, width: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    q = torch.randn(rows, KV_HEADS, GROUPS, HEAD_DIM, generator=g, **bf)
    k = torch.randn(rows, KV_HEADS, width, HEAD_DIM, generator=g, **bf)
    v = torch.randn(rows, KV_HEADS, width, HEAD_DIM, generator=g, **bf)
    # rows at positions spread over the width, as in a running batch
    pos = torch.randint(width // 2, width, (rows,), generator=g, device="cuda")
    ok = torch.arange(width, device="cuda") <= pos[:, None]
    bias = torch.tensor([0.0, float("-inf")], **bf)
    mask = torch.where(ok, bias[0], bias[1]).view(rows, 1, 1, width)
    return {"q": q, "k": k, "v": v, "mask": mask, "pos": pos}


def sdpa(x: dict, backend: SDPBackend | None) -> torch.Tensor:
    scale = HEAD_DIM**-0.5
    if backend is None:
        return F.scaled_dot_product_attention(x["q"], x["k"], x["v"], attn_mask=x["mask"], scale=scale)
    with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(x["q"], x["k"], x["v"], attn_mask=x["mask"], scale=scale)


def lorapop_kernel(x: dict) -> torch.Tensor:
    """The decoder's own call (`decode_attention.attend`), folded back to q's layout."""
    from lorapop.engine.decode_attention import attend

    rows = x["q"].shape[0]
    q = x["q"].reshape(rows, KV_HEADS * GROUPS, 1, HEAD_DIM)
    out = attend(q, x["k"], x["v"], x["pos"], HEAD_DIM**-0.5)
    return out.view(rows, KV_HEADS, GROUPS, HEAD_DIM)


def plain(x: dict) -> torch.Tensor:
    """GEMM, masked softmax in fp32, GEMM: K and V are each read once."""
    s = torch.matmul(x["q"], x["k"].transpose(-1, -2)).float() * HEAD_DIM**-0.5
    p = torch.softmax(s + x["mask"], dim=-1).to(x["v"].dtype)
    return torch.matmul(p, x["v"])


def reference(x: dict) -> torch.Tensor:
    s = torch.matmul(x["q"].float(), x["k"].float().transpose(-1, -2)) * HEAD_DIM**-0.5
    return torch.matmul(torch.softmax(s + x["mask"].float(), dim=-1), x["v"].float())


def flex(x: dict):
    """FlexAttention (compiled; its decode path splits the keys) with a per-row length mask."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    pos = x["pos"]
    rows, _, width, _ = x["k"].shape

    def keep(b, h, q_idx, kv_idx):
        return kv_idx <= pos[b]

    block = create_block_mask(keep, rows, None, GROUPS, width, device="cuda")
    fn = torch.compile(flex_attention, dynamic=False)
    return lambda: fn(x["q"], x["k"], x["v"], block_mask=block, scale=HEAD_DIM**-0.5)


def timed(fn, reps: int) -> tuple[float, str]:
    """Milliseconds a call, replayed from a CUDA graph as the decoder does (host launch costs
    left out); eager where a call cannot be captured."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    run, how = fn, "eager"
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        run, how = graph.replay, "cuda graph"
    except RuntimeError as e:
        print(f"capture failed, timing eagerly: {e}"[:200], flush=True)
        torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps, how


def case(rows: int, width: int, reps: int) -> dict:
    x = inputs(rows, width)
    ref = reference(x)
    kv_bytes = 2 * x["k"].numel() * x["k"].element_size()
    held = int((x["pos"] + 1).sum()) * 2 * KV_HEADS * HEAD_DIM * x["k"].element_size()
    variants = {
        "lorapop_triton": lambda: lorapop_kernel(x),
        "sdpa_default": lambda: sdpa(x, None),
        "sdpa_efficient": lambda: sdpa(x, SDPBackend.EFFICIENT_ATTENTION),
        "sdpa_cudnn": lambda: sdpa(x, SDPBackend.CUDNN_ATTENTION),
        "sdpa_math": lambda: sdpa(x, SDPBackend.MATH),
        "plain": lambda: plain(x),
    }
    try:
        variants["flex"] = flex(x)
    except Exception as e:  # noqa: BLE001 - a build without it: say why, keep the rest
        print(f"flex attention unavailable: {type(e).__name__}: {e}"[:200], flush=True)
    out = {"rows": rows, "width": width, "kv_mib": kv_bytes / 2**20,
           "kv_mib_held": held / 2**20, "variants": {}}
    for name, fn in variants.items():
        try:
            err = (fn().float() - ref).abs().max().item()
            ms, how = timed(fn, reps)
        except Exception as e:  # noqa: BLE001 - a backend that refuses the shape
            out["variants"][name] = {"error": f"{type(e).__name__}: {e}"[:200]}
            continue
        out["variants"][name] = {"ms": ms, "timed": how, "gb_per_s_held": held / ms / 1e6,
                                 "max_abs_err": err,
                                 "step_ms_28_layers": ms * LAYERS}
    return out


def tune(rows: int, width: int, reps: int, grid: dict[str, list[int]]) -> dict:
    """The kernel as the decoder calls it (the step's key and value written by it) under
    each launch in `grid` (`decode_attention`'s BLOCK_N, NUM_WARPS, NUM_STAGES, WAVES):
    ms a call, fastest first; the module's values are restored after."""
    import itertools

    from lorapop.engine import decode_attention as da

    x = inputs(rows, width)
    q = x["q"].reshape(rows, KV_HEADS * GROUPS, 1, HEAD_DIM)
    new = (x["k"][:, :, :1].clone(), x["v"][:, :, :1].clone())
    names = list(grid)
    before = {n: getattr(da, n) for n in names}
    out = {"rows": rows, "width": width, "launches": []}
    try:
        for values in itertools.product(*grid.values()):
            for n, val in zip(names, values, strict=True):
                setattr(da, n, val)
            ms, how = timed(lambda: da.attend(q, x["k"], x["v"], x["pos"], HEAD_DIM**-0.5,
                                              new=new), reps)
            out["launches"].append({**dict(zip(names, values, strict=True)), "ms": ms})
    finally:
        for n, val in before.items():
            setattr(da, n, val)
    out["launches"].sort(key=lambda r: r["ms"])
    out["current"] = next(r["ms"] for r in out["launches"]
                          if all(r[n] == before[n] for n in names))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="8:4096,48:3072,192:3072,176:4544,384:1536,266:2816",
                    help="ROWS:WIDTH,... (width: cache positions attended)")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--tune", action="store_true",
                    help="time lorapop's kernel under a grid of launches instead (--grid)")
    ap.add_argument("--grid", default="BLOCK_N=32,64,128;NUM_WARPS=2,4,8;NUM_STAGES=1,2,3,4;"
                    "WAVES=1,2,4", help="NAME=V,V;... of engine/decode_attention.py")
    ap.add_argument("--out", default="benchmarks/results/decode_attention.json")
    args = ap.parse_args()
    grid = {k: [int(v) for v in vals.split(",")]
            for k, vals in (part.split("=") for part in args.grid.split(";"))}
    if not torch.cuda.is_available():
        sys.exit("decode_attention.py needs a CUDA GPU")
    result = {"benchmark": "decode_attention", "command": " ".join([Path(sys.executable).name, *sys.argv]),
              "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d"), "cases": []}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for shape in args.shapes.split(","):
        rows, width = map(int, shape.split(":"))
        r = tune(rows, width, args.reps, grid) if args.tune else case(rows, width, args.reps)
        print(json.dumps(r), flush=True)
        result["cases"].append(r)
        out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
