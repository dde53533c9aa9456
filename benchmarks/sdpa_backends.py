"""SDPA's attention backends at the update's shapes: forward + backward time per backend.

Causal rows as long as a teacher row (2,984 tokens) or a whole micro-batch (8,192), a student
pack's shared prompt (500) and its four answers over [prompt; own keys] (1,024 over 1,524,
bottom-right causal), bf16, 28 query heads over 4 key/value heads (Qwen2.5-7B), with
grouped-query attention (`enable_gqa`) and with keys/values repeated per head. Tells which
kernel each of lorapop's attention calls should reach (FlashAttention, cuDNN, efficient).

`--fresh N` measures what the repeated-shape timings hide: cuDNN builds an execution plan for
each new shape (cached per process), and the loop's shapes are new at every step (prompt and
completion lengths vary). Each backend, and the dispatcher's own choice (`default`), runs
forward + backward at N lengths it has not seen (GQA), then again at the last one: the first
calls' mean minus the repeated call is the per-shape set-up a loop step pays.

    PYTHONPATH=src python benchmarks/sdpa_backends.py --out benchmarks/results/sdpa_backends.json
    PYTHONPATH=src python benchmarks/sdpa_backends.py --fresh 8 --out $OUT/sdpa_fresh.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

CASES = {  # name: (batch, query length, key length, bottom-right causal mask)
    "teacher row, causal": (3, 2984, 2984, False),
    "shared prompt, causal": (4, 500, 500, False),
    "4 answers over prompt + own keys": (4, 1024, 1524, True),
    "8192-token row, causal": (1, 8192, 8192, False),
}
BACKENDS = (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION)


def _time(q, k, v, lower: bool, gqa: bool, backend: SDPBackend, reps: int) -> float | str:
    """Milliseconds per forward + backward, or why the backend refused."""
    mask = causal_lower_right(q.shape[2], k.shape[2]) if lower else None

    def once() -> None:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=not lower,
                                             enable_gqa=gqa)
        out.sum().backward()

    with sdpa_kernel([backend]):
        try:
            once()
            once()
        except RuntimeError as e:
            return str(e).splitlines()[0][:200]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            once()
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e3


def _fresh(case: tuple[int, int, int, bool], backend: SDPBackend | None, n: int,
           offset: int) -> dict:
    """First-call ms at `n` new lengths (the case's lengths + offset + i) and the repeated
    call's ms at the last one, forward + backward, GQA."""
    b, tq, tk, lower = case
    first = []
    for i in range(n + 1):
        dq = offset + min(i, n - 1)  # the last round repeats the last length: steady state
        q, k, v = (torch.randn(b, h, m + dq, 128, device="cuda", dtype=torch.bfloat16,
                               requires_grad=True)
                   for h, m in ((28, tq), (4, tk), (4, tk)))  # fmt: skip
        mask = causal_lower_right(q.shape[2], k.shape[2]) if lower else None
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with sdpa_kernel([backend]) if backend else contextlib.nullcontext():
            try:
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=not lower,
                                                     enable_gqa=True)  # fmt: skip
                out.sum().backward()
            except RuntimeError as e:
                return {"refused": str(e).splitlines()[0][:200]}
        torch.cuda.synchronize()
        first.append((time.perf_counter() - t0) * 1e3)
    steady = first.pop()
    return {"first_ms_mean": sum(first) / n, "first_ms": first, "repeated_ms": steady,
            "setup_ms_per_shape": sum(first) / n - steady}


def _repeated(reps: int) -> list[dict]:
    """Milliseconds per forward + backward of each case and backend, on one shape repeated."""
    runs = []
    for name, (b, tq, tk, lower) in CASES.items():
        for gqa in (True, False):
            kv_heads = 4 if gqa else 28
            q, k, v = (torch.randn(b, h, n, 128, device="cuda", dtype=torch.bfloat16,
                                   requires_grad=True)
                       for h, n in ((28, tq), (kv_heads, tk), (kv_heads, tk)))
            # attended pairs x 4 d FLOPs forward; the backward ~2.5x the forward
            pairs = b * 28 * (tq * tk - tq * (tq - 1) / 2 if lower else tq * (tq + 1) / 2)
            for backend in BACKENDS:
                ms = _time(q, k, v, lower, gqa, backend, reps)
                runs.append({"case": name, "gqa": gqa, "backend": backend.name, "ms": ms,
                             "tflops": pairs * 4 * 128 * 3.5 / (ms / 1e3) / 1e12
                             if isinstance(ms, float) else None})
                print(json.dumps(runs[-1]), flush=True)
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--fresh", type=int, metavar="N",
                    help="per-shape set-up instead: forward + backward at N new lengths per case")
    ap.add_argument("--out", default="benchmarks/results/sdpa_backends.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("sdpa_backends.py needs a CUDA GPU")
    if args.fresh is not None and args.fresh < 1:
        ap.error("--fresh must be >= 1")
    runs = []
    if args.fresh:  # a different length range for each backend: none reuses another's plans
        for backend in (None, *BACKENDS):  # CUDA and each kernel's library loaded first
            _fresh((1, 64, 64, False), backend, 1, 0)
        for c, (name, case) in enumerate(CASES.items()):
            for j, backend in enumerate((None, *BACKENDS)):
                runs.append({"case": name, "backend": backend.name if backend else "default",
                             **_fresh(case, backend, args.fresh, 1 + 97 * (4 * c + j))})
                print(json.dumps(runs[-1]), flush=True)
    else:
        runs = _repeated(args.reps)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "benchmark": "sdpa_backends" + ("_fresh" if args.fresh else ""),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
