"""Where the update's and the decoder's time goes, at the paper's shapes, on the GPU.

Builds the paper config's parts (random-weight 7B, 8-slot bank, `loop_step.py`'s set-up) and
times (1) one update micro-batch (teacher-forced log-probs + REINFORCE loss + backward) per
token budget, with and without activation checkpointing, and (2) decode steps at a batch of
rows with long prompts; the CUDA kernels of each case are tabulated by `torch.profiler`.

    PYTHONPATH=src python benchmarks/update_profile.py --out benchmarks/results/update_profile.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import profiler

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loop_step import ROOT, bench_overrides, flop_params  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def _kernels(prof, n: int = 25) -> list[dict]:
    rows = []
    for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:n]:
        rows.append({"name": e.key[:120], "calls": e.count, "cuda_ms": e.device_time_total / 1e3})
    return rows


def update_case(parts, prompt: int, completion: int, tokens: int, ckpt: bool, reps: int,
                profile: bool) -> dict:
    from lorapop.engine.logprobs import sequence_logprobs
    from lorapop.rl.loss import policy_loss

    model, bank = parts.model, parts.bank
    if ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_disable()
    model.train()
    rows = max(1, tokens // (prompt + completion))
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, vocab, (rows, prompt), generator=g).tolist()
    comps = torch.randint(0, vocab, (rows, completion), generator=g).tolist()
    slots = torch.arange(rows, device=DEV) % len(parts.slot)
    slots = slots.sort().values
    adv = torch.randn(rows, device=DEV)

    def once() -> None:
        lp, mask = sequence_logprobs(model, bank, prompts, comps, slots)
        loss, _ = policy_loss(lp.float(), adv, mask, groups=slots)
        loss.backward()

    _sync()
    if DEV == "cuda":
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if DEV == "cuda" else 0
    try:
        once()  # warm-up
        _sync()
        t0 = time.perf_counter()
        for _ in range(reps):
            once()
        _sync()
    except torch.OutOfMemoryError:
        parts.opt.zero_grad()
        torch.cuda.empty_cache()
        return {"rows": rows, "tokens": rows * (prompt + completion), "ckpt": ckpt, "oom": True}
    dt = (time.perf_counter() - t0) / reps
    out = {"rows": rows, "tokens": rows * (prompt + completion), "ckpt": ckpt, "s": dt,
           "tokens_per_s": rows * (prompt + completion) / dt,
           "peak_extra_gib": (torch.cuda.max_memory_allocated() - base) / 2**30
           if DEV == "cuda" else None}
    n = flop_params(model)
    out["mfu_4n"] = 4 * n * out["tokens"] / dt / 989e12
    if profile:
        with profiler.profile(activities=[profiler.ProfilerActivity.CUDA, profiler.ProfilerActivity.CPU]) as prof:
            once()
            _sync()
        out["kernels"] = _kernels(prof)
    parts.opt.zero_grad()
    bank.zero_grad()
    if DEV == "cuda":
        torch.cuda.empty_cache()
    return out


def decode_case(parts, rows: int, prompt: int, new: int, profile: bool) -> dict:
    from lorapop.engine.generate import generate
    from lorapop.engine.sampling import SamplingParams

    model, bank = parts.model, parts.bank
    model.eval()
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, vocab, (rows, prompt), generator=g).tolist()
    slots = [i % len(parts.slot) for i in range(rows)]
    params = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=new, eos_token_ids=())

    def run(n_new: int) -> float:
        p = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=n_new, eos_token_ids=())
        _sync()
        t0 = time.perf_counter()
        generate(model, bank, None, prompts, slots, p, seed=0, batch_size=rows)
        _sync()
        return time.perf_counter() - t0

    short, full = run(8), run(new)
    out = {"rows": rows, "prompt": prompt, "new": new, "s_8": short, f"s_{new}": full,
           "step_ms": (full - short) / (new - 8) * 1e3}
    if profile:
        with profiler.profile(activities=[profiler.ProfilerActivity.CUDA, profiler.ProfilerActivity.CPU]) as prof:
            generate(model, bank, None, prompts, slots, params, seed=0, batch_size=rows)
            _sync()
        out["kernels"] = _kernels(prof, 30)
        out["cpu_ops"] = [{"name": e.key[:100], "calls": e.count, "cpu_ms": e.cpu_time_total / 1e3}
                          for e in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:20]]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/qwen2.5-coder-7b-4v4.yaml")
    ap.add_argument("--prompt", type=int, default=800)
    ap.add_argument("--completion", type=int, default=1024)
    ap.add_argument("--budgets", default="4096,8192,16384")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--decode", default="192:1500,256:900", help="ROWS:PROMPT,... decode cases")
    ap.add_argument("--decode-new", type=int, default=96)
    ap.add_argument("--out", default="benchmarks/results/update_profile.json")
    ap.add_argument("--smoke", action="store_true", help="allow a CPU run (to test the script)")
    ap.add_argument("overrides", nargs="*", help="extra key.path=value")
    args = ap.parse_args()
    if DEV != "cuda" and not args.smoke:
        sys.exit("update_profile.py needs a CUDA GPU (or --smoke for a CPU check of the script)")
    from lorapop.config import load_config
    from lorapop.parts import build

    seeds = Path(tempfile.mkdtemp())
    cfg = load_config(ROOT / args.config, [*bench_overrides(seeds, 4), *args.overrides])
    parts = build(cfg)
    result = {"benchmark": "update_profile", "command": " ".join([Path(sys.executable).name, *sys.argv]),
              "device": torch.cuda.get_device_name() if DEV == "cuda" else "cpu", "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d"), "update": [], "decode": []}
    for budget in map(int, args.budgets.split(",")):
        for ckpt in (True, False):
            r = update_case(parts, args.prompt, args.completion, budget, ckpt, args.reps,
                            profile=budget == 8192)
            print(json.dumps({k: v for k, v in r.items() if k != "kernels"}), flush=True)
            result["update"].append(r)
    for case in filter(None, args.decode.split(",")):
        rows, prompt = map(int, case.split(":"))
        r = decode_case(parts, rows, prompt, args.decode_new, profile=True)
        print(json.dumps({k: v for k, v in r.items() if k not in ("kernels", "cpu_ops")}), flush=True)
        result["decode"].append(r)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
