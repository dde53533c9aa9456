"""Evaluating a population on HumanEval+: 8 members in mixed-adapter batches vs 1 member.

Qwen2.5-7B shapes with random bf16 weights on CUDA (the cost does not depend on the values),
LoRA rank 16 on all projections, greedy decoding with a fixed generation length (EOS off), the
164 HumanEval+ problems in AZR's R1 prompt. Without a tokenizer on the GPU machine, prompts are
token ids of length len(text) / --chars-per-token (Qwen averages about 3.6 characters per token
on code and English); without `--data-dir` every prompt has --prompt-len tokens. Measures the
`generate` time of all 164 x N rows in one call (N = 1 and N = --members) and, with data, the
sandbox scoring time (ground truth computed once beforehand, reported apart). Target: N = 8
costs at most 1.5x N = 1. `--tiny` runs the same path on CPU with the tiny random model and
its byte tokenizer (real prompts and completions). Imports no math-verify / typer / pydantic.

    PYTHONPATH=src python benchmarks/eval_multi_adapter.py --data-dir ../shared/data
    PYTHONPATH=src python benchmarks/eval_multi_adapter.py --tiny --problems 8 --new-tokens 16
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

import torch
import transformers

from lorapop.engine.generate import GenerateSpec, generate
from lorapop.engine.sampling import SamplingParams
from lorapop.evals import codecheck, data, prompts
from lorapop.evals.pool import Pool
from lorapop.lora.bank import AdapterBank
from qwen7b import build_qwen7b

RESULTS = Path(__file__).parent / "results"


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def auto_batch(model: torch.nn.Module, rows: int, length: int) -> int:
    """Rows per decode batch so the static KV cache takes at most 60% of free GPU memory."""
    if not torch.cuda.is_available():
        return rows
    cfg = model.config
    head = cfg.hidden_size // cfg.num_attention_heads
    per_row = length * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head * 2
    free, _ = torch.cuda.mem_get_info()
    return max(1, min(rows, int(0.6 * free // per_row)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run with the tiny model")
    ap.add_argument("--members", type=int, default=8)
    ap.add_argument("--problems", type=int, default=164)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=192)
    ap.add_argument("--chars-per-token", type=float, default=3.6)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--batch-size", type=int, default=0, help="rows per decode batch (0: auto)")
    args = ap.parse_args()

    probs = data.load("humanevalplus", args.data_dir, limit=args.problems) if args.data_dir else []
    if args.tiny:
        from lorapop.engine.load import load_base_model, load_tokenizer

        tok = load_tokenizer("tiny-random")
        model = load_base_model("tiny-random", tok, device="cpu")
        texts = [prompts.render(p, "azr", tok) for p in probs] or ["def f(x):"] * args.problems
        base_prompts: list = texts
        device = "cpu (tiny-random)"
    else:
        tok = None
        model = build_qwen7b(args.layers).requires_grad_(False)
        g = torch.Generator().manual_seed(0)
        lens = ([math.ceil(len(prompts.render(p, "azr", None)) / args.chars_per_token)
                 for p in probs] or [args.prompt_len] * args.problems)  # fmt: skip
        base_prompts = [torch.randint(100, 150000, (n,), generator=g).tolist() for n in lens]
        device = torch.cuda.get_device_name()
    n = len(base_prompts)
    dtype = next(model.parameters()).dtype
    bank = AdapterBank(model, n_slots=args.members, rank=args.rank, alpha=2.0 * args.rank,
                       dtype=dtype)  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    for i in range(args.members):  # non-zero B: every slot really computes its delta
        state = bank.slot_state(i)
        bank.load_slot(i, {k: {m: torch.randn(t.shape, generator=gen) * 0.01
                               for m, t in ab.items()} for k, ab in state.items()})  # fmt: skip
    params = SamplingParams(temperature=0.0, max_new_tokens=args.new_tokens, eos_token_ids=())
    warm = SamplingParams(temperature=0.0, max_new_tokens=8, eos_token_ids=())
    plen = max(len(p) if isinstance(p, list) else len(tok(p).input_ids) for p in base_prompts)
    result: dict = {
        "benchmark": "eval_multi_adapter",
        "command": " ".join([sys.executable, *sys.argv]),
        "device": device, "torch": torch.__version__, "transformers": transformers.__version__,
        "python": platform.python_version(), "machine": platform.machine(),
        "setup": {"problems": n, "members": args.members, "new_tokens": args.new_tokens,
                  "rank": args.rank, "layers": args.layers, "max_prompt_tokens": plen,
                  "prompts": "HumanEval+ in AZR's R1 template" if probs else "synthetic",
                  "arch": "tiny-random" if args.tiny else "Qwen2.5-7B shapes, random bf16"},
        "cases": {},
    }  # fmt: skip
    truth = None
    pool = Pool(workers=2)
    if probs:
        t0 = time.perf_counter()
        truth = codecheck.ground_truth(probs, pool, codecheck.TimeRule())
        result["ground_truth_s"] = time.perf_counter() - t0

    for members in (1, args.members):
        rows = [p for _ in range(members) for p in base_prompts]
        slots = [m for m in range(members) for _ in base_prompts]
        batch = args.batch_size or auto_batch(model, len(rows), plen + args.new_tokens + 64)
        generate(model, bank, tok, rows[:batch], slots[:batch],
                 GenerateSpec(params=warm, batch_size=batch))
        sync()
        t0 = time.perf_counter()
        gens = generate(model, bank, tok, rows, slots, GenerateSpec(params=params, batch_size=batch))
        sync()
        t_gen = time.perf_counter() - t0
        case = {"rows": len(rows), "batch_size": batch, "generate_s": t_gen,
                "tok_per_s": sum(len(g.token_ids) for g in gens) / t_gen}  # fmt: skip
        if probs and truth is not None:
            t1 = time.perf_counter()
            codecheck.score([(p, g.text) for p, g in zip(probs * members, gens, strict=True)],
                            pool, truth=truth)  # fmt: skip
            case["score_s"] = time.perf_counter() - t1
        case["total_s"] = case["generate_s"] + case.get("score_s", 0.0)
        result["cases"][f"members_{members}"] = case
        print(f"members={members}", json.dumps(case), flush=True)
    pool.close()
    one, many = result["cases"]["members_1"], result["cases"][f"members_{args.members}"]
    result["ratio_total"] = many["total_s"] / one["total_s"]
    result["ratio_generate"] = many["generate_s"] / one["generate_s"]
    result["target_ratio"] = 1.5
    result["meets_target"] = result["ratio_total"] <= 1.5
    tag = "cpu_tiny" if args.tiny else device.replace("NVIDIA ", "").split()[0].lower()
    out = args.out or RESULTS / f"eval_multi_adapter_{tag}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in ("ratio_total", "ratio_generate", "meets_target")}))


if __name__ == "__main__":
    main()
