"""LoRA part of one decode step at Qwen2.5-7B shapes: the decode cache's kernels alone.

28 layers of `DecodeCache.add_delta` calls (q/k/v sharing one shrink, o, gate/up sharing one,
down), batch 64, rank 32, bf16 cache, captured in one CUDA graph and replayed; each layer
has its own adapters so nothing is served from L2 across layers. Variants:

- ``old``: the previous path: mm, multiply by a mask that also applies the scaling, 7 addmm;
- ``torch``: mm (+ a 0/1 mask multiply when N > 1; scaling folded into the cached B), addmm;
- ``triton``: the split-K Triton shrink with the mask in its epilogue, addmm.

Also times each shrink shape alone (mm, mm + mask, Triton) and checks the Triton shrink
against a float64 reference (odd row counts, repeated launches, graph replay after the slot
ids change in place) and the decode cache's Triton path against its torch path.

    PYTHONPATH=src python benchmarks/lora_decode_kernels.py --out results.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from lorapop.lora import triton_shrink
from lorapop.lora.routing import DecodeCache, Routing

BATCH, RANK, LAYERS, HIDDEN, INTER, KV = 64, 32, 28, 3584, 18944, 512
SCALING = 2.0


def graph_ms(fn: Callable[[], object], replays: int = 20, reps: int = 5) -> float:
    """Median milliseconds of one `fn()` replayed from a CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / replays)
    return sorted(times)[len(times) // 2]


def layer_groups(n: int, layer: int) -> list[list[tuple[str, torch.Tensor, torch.Tensor]]]:
    def ab(width: int, out: int) -> tuple[torch.Tensor, torch.Tensor]:
        a = torch.randn(n, RANK, width, device="cuda") / width**0.5
        return a, torch.randn(n, out, RANK, device="cuda") * 0.02

    p = f"l{layer}."
    return [
        [(p + "q", *ab(HIDDEN, HIDDEN)), (p + "k", *ab(HIDDEN, KV)), (p + "v", *ab(HIDDEN, KV))],
        [(p + "o", *ab(HIDDEN, HIDDEN))],
        [(p + "gate", *ab(HIDDEN, INTER)), (p + "up", *ab(HIDDEN, INTER))],
        [(p + "down", *ab(INTER, HIDDEN))],
    ]


class Step:
    """Inputs and base outputs of 28 layers, and the decode-cache calls of one step."""

    def __init__(self, n: int, rows: int = BATCH) -> None:
        groups = [g for i in range(LAYERS) for g in layer_groups(n, i)]
        self.cache = DecodeCache(groups, torch.bfloat16, SCALING)
        self.cache.refresh_(0)
        self.unscaled = {name: (b.float() / SCALING).bfloat16() for name, b in self._bs()}
        self.routing = Routing.empty(rows, n, torch.device("cuda"))
        self.routing.fill_(torch.arange(rows, device="cuda") * n // rows, False)

        def act(width: int) -> torch.Tensor:
            return torch.randn(rows, 1, width, device="cuda", dtype=torch.bfloat16)

        self.xs = [(act(HIDDEN), act(HIDDEN), act(HIDDEN), act(INTER)) for _ in range(LAYERS)]
        widths = {"q": HIDDEN, "k": KV, "v": KV, "o": HIDDEN, "gate": INTER, "up": INTER}
        widths["down"] = HIDDEN
        self.outs = [{k: act(w) for k, w in widths.items()} for _ in range(LAYERS)]

    def _bs(self):
        return [(name, m.b) for name, m in self.cache.members.items()]

    def calls(self):
        for i, (x_attn, x_o, x_mlp, x_down) in enumerate(self.xs):
            for leaf, x in (("q", x_attn), ("k", x_attn), ("v", x_attn), ("o", x_o)):
                yield f"l{i}.{leaf}", x, self.outs[i][leaf]
            for leaf, x in (("gate", x_mlp), ("up", x_mlp), ("down", x_down)):
                yield f"l{i}.{leaf}", x, self.outs[i][leaf]

    def run(self) -> list[torch.Tensor]:
        return [self.cache.add_delta(n, x, o, self.routing, True) for n, x, o in self.calls()]

    def run_old(self) -> list[torch.Tensor]:
        """The previous add_delta: mm, mask * scaling, addmm with the unscaled B."""
        c, nr, ys = self.cache, self.cache.n_slots * RANK, []
        held: dict[int, torch.Tensor] = {}
        for name, x, out in self.calls():
            m = c.members[name]
            if m.index == 0:
                h = torch.mm(x.view(x.shape[0], -1), m.group.a.t())
                h.mul_(self.routing.col_mask(RANK, m.group.size, torch.bfloat16, SCALING))
                held[id(m.group)] = h
            h = held[id(m.group)][:, m.index * nr : (m.index + 1) * nr]
            y = torch.addmm(out.view(out.shape[0], -1), h, self.unscaled[name])
            ys.append(y.view(out.shape))
        return ys


def check_shrink() -> dict:
    """Worst relative error of the Triton shrink against float64, over odd shapes and ids."""
    worst, gen = 0.0, torch.Generator(device="cuda").manual_seed(0)
    cases = [(64, 1, 3, HIDDEN), (64, 8, 1, INTER), (5, 3, 2, 1000), (100, 8, 3, HIDDEN)]
    cases += [(1, 2, 1, 64), (128, 16, 2, HIDDEN), (64, 1, 1, INTER), (17, 4, 1, 4096 + 40)]
    for rows, n, tiles, width in cases:
        x = torch.randn(rows, width, device="cuda", generator=gen).bfloat16()
        a = torch.randn(tiles * n * RANK, width, device="cuda", generator=gen).bfloat16()
        cnt = triton_shrink.counters(rows, a.shape[0], width, x.device)
        for _ in range(3):  # fresh ids each time: counters must have reset themselves
            ids = torch.randint(0, n, (rows,), device="cuda", generator=gen)
            h = triton_shrink.shrink(x, a, ids, RANK, n, cnt)
            ref = x.double() @ a.double().t()
            col_slot = (torch.arange(a.shape[0], device="cuda") // RANK) % n
            ref = ref * (col_slot[None, :] == ids[:, None])
            err = float((h.double() - ref).norm() / ref.norm())
            worst = max(worst, err)
        assert int(cnt.abs().sum()) == 0, "counters not reset"
    # graph replay after changing the ids in place
    rows, n = 64, 8
    x = torch.randn(rows, INTER, device="cuda").bfloat16()
    a = torch.randn(n * RANK, INTER, device="cuda").bfloat16()
    ids = torch.zeros(rows, dtype=torch.long, device="cuda")
    cnt = triton_shrink.counters(rows, a.shape[0], INTER, x.device)
    out = torch.empty(rows, a.shape[0], device="cuda", dtype=torch.bfloat16)
    graph_ms(lambda: out.copy_(triton_shrink.shrink(x, a, ids, RANK, n, cnt)), 1, 1)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(triton_shrink.shrink(x, a, ids, RANK, n, cnt))
    replay_err = 0.0
    for _ in range(3):
        ids.copy_(torch.randint(0, n, (rows,), device="cuda"))
        out.fill_(float("nan"))
        graph.replay()
        ref = x.double() @ a.double().t()
        ref = ref * ((torch.arange(n * RANK, device="cuda") // RANK)[None, :] == ids[:, None])
        replay_err = max(replay_err, float((out.double() - ref).norm() / ref.norm()))
    return {"max_rel_err": worst, "graph_replay_max_rel_err": replay_err}


def shrink_times(n: int) -> dict:
    """ms for 28 launches of each shrink shape (28 different A's), per variant."""
    shapes = {"qkv": (3, HIDDEN), "o": (1, HIDDEN), "gate_up": (2, HIDDEN), "down": (1, INTER)}
    ids = torch.arange(BATCH, device="cuda") * n // BATCH
    routing = Routing.empty(BATCH, n, torch.device("cuda"))
    routing.fill_(ids, False)
    res = {}
    for key, (tiles, width) in shapes.items():
        x = torch.randn(BATCH, width, device="cuda").bfloat16()
        a_s = [torch.randn(tiles * n * RANK, width, device="cuda").bfloat16() for _ in range(28)]
        mask = routing.col_mask(RANK, tiles, torch.bfloat16, 1.0)
        cnt = triton_shrink.counters(BATCH, a_s[0].shape[0], width, x.device)

        def mm(a_s=a_s, x=x):
            return [torch.mm(x, a.t()) for a in a_s]

        def mm_mask(a_s=a_s, x=x, mask=mask):
            return [torch.mm(x, a.t()).mul_(mask) for a in a_s]

        def fused(a_s=a_s, x=x, cnt=cnt):
            return [triton_shrink.shrink(x, a, ids, RANK, n, cnt) for a in a_s]

        plan = triton_shrink.plan(BATCH, a_s[0].shape[0], width)
        res[key] = {
            "cols": a_s[0].shape[0],
            "width": width,
            "plan_bm_bn_split_kchunk_tiles": plan,
            "us_mm": graph_ms(mm) * 1000 / 28,
            "us_mm_mask": graph_ms(mm_mask) * 1000 / 28,
            "us_triton": graph_ms(fused) * 1000 / 28,
        }
        print(n, key, json.dumps(res[key]), flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--slots", default="1,8")
    args = ap.parse_args()
    result: dict = {
        "benchmark": "lora_decode_kernels",
        "command": " ".join([sys.executable, *sys.argv]),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": getattr(triton_shrink.triton, "__version__", None),
        "python": platform.python_version(),
        "setup": {"batch": BATCH, "rank": RANK, "layers": LAYERS, "dtype": "bf16 cache"},
    }
    result["check_triton_shrink"] = check_shrink()
    print(json.dumps(result, indent=1), flush=True)
    for n in (int(s) for s in args.slots.split(",")):
        step = Step(n)
        step.cache.fused_shrink = True
        fused = step.run()
        step.cache.fused_shrink = False
        plain = step.run()
        old = step.run_old()
        err = max(
            float((f.float() - p.float()).abs().max()) for f, p in zip(fused, plain, strict=True)
        )
        err_old = max(
            float((f.float() - p.float()).abs().max()) for f, p in zip(old, plain, strict=True)
        )
        entry = {"max_abs_triton_vs_torch": err, "max_abs_old_vs_torch": err_old}
        entry["step_ms_old"] = graph_ms(step.run_old)
        entry["step_ms_torch"] = graph_ms(step.run)
        step.cache.fused_shrink = True
        entry["step_ms_triton"] = graph_ms(step.run)
        entry["shrink_us_per_launch"] = shrink_times(n)
        result[f"N{n}"] = entry
        print(f"N={n}", json.dumps({k: v for k, v in entry.items() if "shrink" not in k}))
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
        del step
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
