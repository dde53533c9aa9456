"""Mixed-adapter generation at Qwen2.5-7B scale: lorapop's engine against HF generate + PEFT.

Random bf16 weights stand in for the real model (the cost does not depend on the values).
Batch 64, 128-token prompts, 128 new tokens, LoRA rank 32 on all projections, the bank in
fp32 (master weights, as in self-play) unless a case says bf16. Measures: end-to-end tokens/s
of `generate` for N = 1, 2, 4, 8, 16 slots (slots mixed in the batch), the decode step alone
(CUDA graph replay) as a fraction of the memory-bandwidth bound, "before" cases (the "dense"
decode kernel that casts the bank every step), a bf16 bank, the decode step with its model
forward under torch.compile (sampler eager, whole step in the CUDA graph), the base model through our engine and (unless --no-hf) through HF `generate`,
PEFT with one adapter and with 8 adapters mixed via `adapter_names=`, and peak GPU memory.
It also checks that the CUDA-graph path emits the eager path's tokens, the fused decode
kernel the dense one's, and how far the returned logprobs are from a teacher-forced forward
pass in bf16. The JSON is rewritten after every case (the run may be cut short).
Imports only torch / transformers / peft and lorapop.lora / lorapop.engine.

    PYTHONPATH=src python benchmarks/generate_multi_adapter.py --out results.json
    PYTHONPATH=src python benchmarks/generate_multi_adapter.py --layers 2 --no-hf  # smoke
    PYTHONPATH=src python benchmarks/generate_multi_adapter.py --compiled-only --out c.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import peft
import torch
import transformers

from lorapop.engine.decoder import Decoder, route
from lorapop.engine.generate import GenerateSpec, generate
from lorapop.engine.logprobs import sequence_logprobs
from lorapop.engine.patches import static_kv
from lorapop.engine.sampling import SamplingParams, row_uniforms
from lorapop.lora.bank import DEFAULT_TARGETS, AdapterBank
from qwen7b import build_qwen7b

BATCH, PROMPT, NEW, RANK = 64, 128, 128, 32
NOMINAL_TBPS = {"H200": 4.8, "H100": 3.35}  # HBM bandwidth of the SXM parts, TB/s


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0, out


def peak_gb(fn: Callable[[], object]) -> tuple[float, float]:
    """(seconds, peak GiB allocated) of one call."""
    torch.cuda.reset_peak_memory_stats()
    seconds, _ = timed(fn)
    return seconds, torch.cuda.max_memory_allocated() / 2**30


def measured_tbps() -> float:
    """Achieved copy bandwidth (read + write) of a 4 GiB device-to-device copy."""
    src = torch.empty(2**31, dtype=torch.int16, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    seconds, _ = timed(lambda: [dst.copy_(src) for _ in range(5)])
    return 5 * 2 * 2**32 / seconds / 1e12


def decode_step_seconds(model, bank, prompts, slots, params, compile=False) -> tuple[float, float]:
    """(prefill seconds, seconds per decode step) with the step replayed from its CUDA graph."""
    length = -(-(PROMPT + NEW - 1) // 64) * 64
    dec = Decoder(model, bank, BATCH, length, params, [], cuda_graph=True, compile=compile)
    u = row_uniforms(0, range(BATCH), NEW)
    rows = list(range(BATCH))
    if bank is not None:
        bank.sync_caches()
    with torch.no_grad(), static_kv(model, dec.kv), route(bank, torch.tensor(slots)):
        dec.prefill(prompts, slots, rows, u)
        if bank is not None:
            bank.set_slot_ids_(dec.slots)  # the decode step's routing (prefill re-routed)
        dec._prepare()
        assert dec.graph is not None or not dec.use_graph, "CUDA graph capture failed"
        assert not compile or dec.compiled is not None, "torch.compile failed"
        prefill_s, _ = timed(lambda: dec.prefill(prompts, slots, rows, u))
        steps = NEW - 1
        step = dec._step if dec.graph is None else dec.graph.replay  # eager: CPU smoke runs
        decode_s, _ = timed(lambda: [step() for _ in range(steps)])
    return prefill_s, decode_s / steps


def bytes_per_step(model, n_slots: int, cache_len: int) -> dict[str, float]:
    cfg = model.config
    weights = sum(
        p.numel() * p.element_size() for n, p in model.named_parameters() if "embed_tokens" not in n
    )
    per_slot = 0
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and name.rsplit(".", 1)[-1] in DEFAULT_TARGETS:
            per_slot += RANK * (mod.in_features + mod.out_features) * 2  # bf16
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    kv_token = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim * 2
    return {
        "weights": weights,
        "adapters": n_slots * per_slot,
        "kv_static": BATCH * cache_len * kv_token,  # what our decode step reads
        "kv_mean_context": BATCH * (PROMPT + NEW / 2) * kv_token,  # what it must read
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--slots", default="1,8,2,4,16")
    ap.add_argument("--no-hf", action="store_true", help="skip HF generate / PEFT baselines")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile cases")
    ap.add_argument("--quick", action="store_true", help="skip the slow PEFT-mixed baseline")
    ap.add_argument(
        "--compiled-only",
        action="store_true",
        help="eager decode steps (base, N=1, N=8) as the same-run baseline, then compiled ones",
    )
    args = ap.parse_args()
    name = torch.cuda.get_device_name()
    result: dict = {
        "benchmark": "generate_multi_adapter",
        "command": " ".join([sys.executable, *sys.argv]),
        "device": name,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        "python": platform.python_version(),
        "setup": {
            "batch": BATCH,
            "prompt": PROMPT,
            "new_tokens": NEW,
            "rank": RANK,
            "layers": args.layers,
            "arch": "Qwen2.5-7B shapes, random bf16 weights",
            "bank": "fp32 master weights (the self-play case) unless the case says bf16",
        },
    }
    nominal = next((v for k, v in NOMINAL_TBPS.items() if k in name), None)
    result["bandwidth_tbps"] = {"nominal": nominal, "measured_copy": measured_tbps()}
    peak = nominal or result["bandwidth_tbps"]["measured_copy"]
    print(json.dumps(result, indent=1), flush=True)

    model = build_qwen7b(args.layers).requires_grad_(False)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(100, 150000, (BATCH, PROMPT), generator=g)
    prompts = ids.tolist()
    tokens = BATCH * NEW
    params = SamplingParams(temperature=1.0, max_new_tokens=NEW, eos_token_ids=())
    cache_len = -(-(PROMPT + NEW - 1) // 64) * 64
    cases: dict[str, dict] = {}
    checks: dict = {}
    result["checks"], result["cases"] = checks, cases

    def save() -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))

    def record(key: str, seconds: float | None = None, mem: float | None = None, **extra) -> None:
        entry = dict(extra)
        if seconds is not None:
            entry.update(seconds=seconds, tok_per_s=tokens / seconds, peak_gib=mem)
        cases[key] = entry
        print(key, json.dumps(entry), flush=True)
        save()

    def step_case(key, bank, n, slots, compile=False) -> None:
        t0 = time.perf_counter()
        pre, step = decode_step_seconds(model, bank, prompts, slots, params, compile)
        nbytes = bytes_per_step(model, n, cache_len)
        need = nbytes["weights"] + nbytes["adapters"] + nbytes["kv_mean_context"]
        read = nbytes["weights"] + nbytes["adapters"] + nbytes["kv_static"]
        extra = cases.get(key, {})
        record(
            key,
            extra.get("seconds"),
            extra.get("peak_gib"),
            prefill_s=pre,
            decode_step_s=step,
            decode_tok_per_s=BATCH / step,
            bytes_per_step=nbytes,
            bandwidth_fraction=need / step / (peak * 1e12),
            bandwidth_fraction_static_reads=read / step / (peak * 1e12),
            setup_s=time.perf_counter() - t0,
        )

    def e2e_case(key, bank, slots, compile: bool = False) -> None:
        spec = GenerateSpec(params=params, compile=compile)
        generate(model, bank, None, prompts, slots, spec)  # warm-up (and compile)
        s, m = peak_gb(lambda: generate(model, bank, None, prompts, slots, spec))
        record(key, s, m)

    banks: dict[tuple[int, torch.dtype], AdapterBank] = {}

    def bank_for(n: int, dtype=torch.float32) -> AdapterBank | None:
        """The bank with n slots (others detached); n < 1: detach all, None."""
        for key in list(banks):
            if key != (n, dtype):
                banks.pop(key).detach()
        torch.cuda.empty_cache()
        if n < 1:
            return None
        if (n, dtype) not in banks:
            banks[(n, dtype)] = AdapterBank(model, n, rank=RANK, alpha=2.0 * RANK, dtype=dtype)
            with torch.no_grad():  # nonzero B: every slot differs from the base
                for t in banks[(n, dtype)].targets.values():
                    t.b.normal_(0.0, 1e-3)
        return banks[(n, dtype)]

    def slots_of(n: int) -> list[int]:
        return [i * n // BATCH for i in range(BATCH)]

    if args.compiled_only:
        run = dict(step=step_case, e2e=e2e_case, record=record, bank_for=bank_for, save=save)
        compiled_cases(model, prompts, slots_of, checks, **run)
        bank_for(-1)
        save()
        return

    # lorapop engine, base model (no bank)
    e2e_case("lorapop_base", None, [0] * BATCH)
    step_case("lorapop_base", None, 0, [0] * BATCH)

    sweep = [int(x) for x in args.slots.split(",")]
    for n in sweep[:2]:  # the headline counts first (the run has a time limit)
        bank = bank_for(n)
        e2e_case(f"lorapop_N{n}", bank, slots_of(n))
        step_case(f"lorapop_N{n}", bank, n, slots_of(n))
        # before this change: the "dense" decode kernel casting the fp32 bank every step
        bank.decode_kernel = "dense"
        step_case(f"lorapop_N{n}_before_dense_fp32_cast", bank, n, slots_of(n))
        bank.decode_kernel = "auto"
        if n == 8:
            greedy = SamplingParams(temperature=0.0, max_new_tokens=16, eos_token_ids=())
            a = generate(model, bank, None, prompts, slots_of(8),
                         GenerateSpec(params=greedy, compile=False))
            b = generate(model, bank, None, prompts, slots_of(8),
                         GenerateSpec(params=greedy, cuda_graph=False, compile=False))
            checks["graph_equals_eager_tokens"] = [x.token_ids for x in a] == [
                x.token_ids for x in b
            ]
            bank.decode_kernel = "dense"
            c = generate(model, bank, None, prompts, slots_of(8),
                         GenerateSpec(params=greedy, compile=False))
            bank.decode_kernel = "auto"
            same = [x.token_ids == y.token_ids for x, y in zip(a, c, strict=True)]
            checks["fused_vs_dense_rows_same_greedy_tokens"] = sum(same) / len(same)
            lp_a = torch.tensor([x.logprobs[0] for x in a])
            lp_c = torch.tensor([x.logprobs[0] for x in c])
            checks["fused_vs_dense_first_logprob_max_abs"] = float((lp_a - lp_c).abs().max())
            sub = slice(0, 16)
            with torch.no_grad():
                lp, _ = sequence_logprobs(
                    model, bank, prompts[sub], [x.token_ids for x in a[sub]], slots_of(8)[sub]
                )
            ref = torch.tensor([x.logprobs for x in a[sub]])
            checks["max_abs_logprob_vs_teacher_forced_bf16"] = float((lp.cpu() - ref).abs().max())
            checks["mean_abs_logprob_vs_teacher_forced_bf16"] = float((lp.cpu() - ref).abs().mean())
            save()
    bank = bank_for(8, torch.bfloat16)
    step_case("lorapop_N8_bf16_bank", bank, 8, slots_of(8))
    bank.decode_kernel = "dense"
    step_case("lorapop_N8_bf16_bank_before_dense", bank, 8, slots_of(8))
    bank.decode_kernel = "auto"

    if not args.no_compile:
        for n in (8, 0, 1):
            bank = bank_for(n)
            key = f"lorapop_N{n}_compiled" if n else "lorapop_base_compiled"
            try:
                step_case(key, bank, n, slots_of(max(n, 1)) if n else [0] * BATCH, True)
                e2e_case(key, bank, slots_of(max(n, 1)) if n else [0] * BATCH, compile=True)
            except Exception as e:  # noqa: BLE001 - record and go on
                record(key, error=f"{type(e).__name__}: {e}"[:500])

    for n in sweep[2:]:
        bank = bank_for(n)
        e2e_case(f"lorapop_N{n}", bank, slots_of(n))
        step_case(f"lorapop_N{n}", bank, n, slots_of(n))
    bank_for(-1)

    base = cases.get("lorapop_N1", {}).get("decode_step_s")
    if base:
        result["decode_step_vs_N1"] = {
            k: v["decode_step_s"] / base for k, v in cases.items() if "decode_step_s" in v
        }
    if not args.no_hf:
        hf_baselines(model, ids, cases, record, args.quick)
    save()
    print(json.dumps({k: v for k, v in result.items() if k != "cases"}, indent=1))


def compiled_cases(model, prompts, slots_of, checks, step, e2e, record, bank_for, save) -> None:
    """Eager decode steps as this run's baseline, then the same steps compiled (N=8 first:
    the run has a time limit), compile counters, and compiled-vs-eager agreement."""
    from torch._dynamo.utils import counters

    for n in (0, 1, 8):
        bank = bank_for(n)
        step(f"lorapop_N{n}" if n else "lorapop_base", bank, n, slots_of(max(n, 1)))
    for n in (8, 0, 1):
        bank = bank_for(n)
        key = f"lorapop_N{n}_compiled" if n else "lorapop_base_compiled"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                step(key, bank, n, slots_of(max(n, 1)), True)
            except Exception as e:  # noqa: BLE001 - record (with the decoder's warning) and go on
                said = [str(w.message)[:3000] for w in caught if "failed" in str(w.message)]
                record(key, error=f"{type(e).__name__}: {e}"[:500], warnings=said)
                continue
        checks[f"{key}_dynamo"] = {
            "unique_graphs": counters["stats"]["unique_graphs"],
            "graph_breaks": sum(counters["graph_break"].values()),
            "break_reasons": list(counters["graph_break"])[:5],
        }
        save()
        if n == 8:  # generate() with a new decoder of the same shapes: no recompilation
            e2e(f"{key}_e2e", bank, slots_of(8), compile=True)
            greedy = SamplingParams(temperature=0.0, max_new_tokens=NEW, eos_token_ids=())
            a = generate(model, bank, None, prompts, slots_of(8),
                         GenerateSpec(params=greedy, compile=True))
            b = generate(model, bank, None, prompts, slots_of(8),
                         GenerateSpec(params=greedy, compile=False))
            # token 0 comes from the (eager) prefill, token 1 from the first decode step
            pairs = list(zip(a, b, strict=True))
            same = [x.token_ids[1] == y.token_ids[1] for x, y in pairs]
            checks["compiled_vs_eager_step1_token_same_rows"] = sum(same) / len(same)
            lp = [abs(x.logprobs[1] - y.logprobs[1]) for x, y in pairs]
            checks["compiled_vs_eager_step1_logprob_max_abs"] = max(lp)
            checks["compiled_vs_eager_step1_logprob_mean_abs"] = sum(lp) / len(lp)
            checks["unique_graphs_after_e2e"] = counters["stats"]["unique_graphs"]
            save()


def hf_baselines(model, ids, cases, record, quick: bool) -> None:
    """HF generate on the base model, and + PEFT with one adapter / 8 mixed adapters."""
    hf_kw = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0)
    model.generation_config.eos_token_id = None
    cuda_ids = ids.cuda()
    mask = torch.ones_like(cuda_ids)
    model.generate(input_ids=cuda_ids[:, :8], attention_mask=mask[:, :8], max_new_tokens=4)
    s, m = peak_gb(lambda: model.generate(input_ids=cuda_ids, attention_mask=mask, **hf_kw))
    record("hf_generate_base", s, m)
    cfg = peft.LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=list(DEFAULT_TARGETS))
    pm = peft.get_peft_model(model, cfg, adapter_name="a0")
    for i in range(1, 8):
        pm.add_adapter(f"a{i}", cfg)
    pm.set_adapter("a0")
    pm.eval()  # PEFT refuses adapter_names= in training mode
    pm.generate(input_ids=cuda_ids[:, :8], attention_mask=mask[:, :8], max_new_tokens=4)
    s, m = peak_gb(lambda: pm.generate(input_ids=cuda_ids, attention_mask=mask, **hf_kw))
    record("hf_peft_1_adapter", s, m)
    if not quick:
        names = [f"a{i * 8 // BATCH}" for i in range(BATCH)]
        s, m = peak_gb(
            lambda: pm.generate(
                input_ids=cuda_ids, attention_mask=mask, adapter_names=names, **hf_kw
            )
        )
        record("hf_peft_8_adapters_mixed", s, m)


if __name__ == "__main__":
    main()
