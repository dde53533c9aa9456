"""Mixed-adapter generation at Qwen2.5-7B scale: lorapop's engine against HF generate + PEFT.

Random bf16 weights stand in for the real model (the cost does not depend on the values).
Batch 64, 128-token prompts, 128 new tokens, LoRA rank 32 on all projections. Measures:
end-to-end tokens/s of `generate` for N = 1, 2, 4, 8, 16 slots (slots mixed in the batch),
the decode step alone (CUDA graph replay) as a fraction of the memory-bandwidth bound,
the base model through our engine and through HF `generate`, PEFT with one adapter and with
8 adapters mixed via `adapter_names=`, and peak GPU memory of each case. It also checks that
the CUDA-graph path emits the same tokens as the eager path, and how far the returned
logprobs are from a teacher-forced forward pass in bf16.
Imports only torch / transformers / peft and lorapop.lora / lorapop.engine.

    PYTHONPATH=src python benchmarks/generate_multi_adapter.py --out results.json
    PYTHONPATH=src python benchmarks/generate_multi_adapter.py --layers 2 --quick  # smoke
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import peft
import torch
import transformers
from transformers import Qwen2Config, Qwen2ForCausalLM

from lorapop.engine.decoder import Decoder, route
from lorapop.engine.generate import generate
from lorapop.engine.kvcache import static_kv
from lorapop.engine.logprobs import sequence_logprobs
from lorapop.engine.sampling import SamplingParams, row_uniforms
from lorapop.lora.bank import DEFAULT_TARGETS, AdapterBank

BATCH, PROMPT, NEW, RANK = 64, 128, 128, 32
NOMINAL_TBPS = {"H200": 4.8, "H100": 3.35}  # HBM bandwidth of the SXM parts, TB/s


def build_model(layers: int) -> Qwen2ForCausalLM:
    config = Qwen2Config(
        hidden_size=3584,
        num_hidden_layers=layers,
        num_attention_heads=28,
        num_key_value_heads=4,
        intermediate_size=18944,
        vocab_size=152064,
        max_position_embeddings=32768,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = Qwen2ForCausalLM(config)
    torch.set_default_dtype(previous)
    return model.eval().requires_grad_(False)


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


def decode_step_seconds(model, bank, prompts, slots, params) -> tuple[float, float]:
    """(prefill seconds, seconds per decode step) with the step replayed from its CUDA graph."""
    length = -(-(PROMPT + NEW - 1) // 64) * 64
    dec = Decoder(model, bank, BATCH, length, params, [], cuda_graph=True)
    u = row_uniforms(0, range(BATCH), NEW)
    dec.slots.copy_(torch.tensor(slots))
    with torch.no_grad(), static_kv(model, dec.kv), route(bank, dec.slots):
        dec.prefill(prompts, u)
        dec._capture()
        assert dec.graph is not None, "CUDA graph capture failed"
        prefill_s, _ = timed(lambda: dec.prefill(prompts, u))
        steps = NEW - 1
        decode_s, _ = timed(lambda: [dec.graph.replay() for _ in range(steps)])
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
    ap.add_argument("--slots", default="1,2,4,8,16")
    ap.add_argument("--quick", action="store_true", help="skip the slow PEFT-mixed baseline")
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
        },
    }
    nominal = next((v for k, v in NOMINAL_TBPS.items() if k in name), None)
    result["bandwidth_tbps"] = {"nominal": nominal, "measured_copy": measured_tbps()}
    peak = nominal or result["bandwidth_tbps"]["measured_copy"]
    print(json.dumps(result, indent=1), flush=True)

    model = build_model(args.layers)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(100, 150000, (BATCH, PROMPT), generator=g)
    prompts = ids.tolist()
    tokens = BATCH * NEW
    params = SamplingParams(temperature=1.0, max_new_tokens=NEW, eos_token_ids=())
    cases: dict[str, dict] = {}

    def record(key: str, seconds: float, mem: float, **extra) -> None:
        cases[key] = {"seconds": seconds, "tok_per_s": tokens / seconds, "peak_gib": mem, **extra}
        print(key, json.dumps(cases[key]), flush=True)

    # HF generate, base model alone
    hf_kw = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0)
    model.generation_config.eos_token_id = None
    cuda_ids = ids.cuda()
    mask = torch.ones_like(cuda_ids)
    model.generate(input_ids=cuda_ids[:, :8], attention_mask=mask[:, :8], max_new_tokens=4)
    s, m = peak_gb(lambda: model.generate(input_ids=cuda_ids, attention_mask=mask, **hf_kw))
    record("hf_generate_base", s, m)

    # lorapop engine, base model (no bank)
    generate(model, None, None, prompts, [0] * BATCH, params)  # warm-up
    s, m = peak_gb(lambda: generate(model, None, None, prompts, [0] * BATCH, params))
    pre, step = decode_step_seconds(model, None, prompts, [0] * BATCH, params)
    record("lorapop_base", s, m, prefill_s=pre, decode_step_s=step)

    # lorapop engine, N slots mixed in the batch
    checks: dict = {}
    for n in [int(x) for x in args.slots.split(",")]:
        bank = AdapterBank(model, n_slots=n, rank=RANK, alpha=2.0 * RANK, dtype=torch.bfloat16)
        slots = [i * n // BATCH for i in range(BATCH)]
        generate(model, bank, None, prompts, slots, params)  # warm-up
        s, m = peak_gb(
            lambda bank=bank, slots=slots: generate(model, bank, None, prompts, slots, params)
        )
        pre, step = decode_step_seconds(model, bank, prompts, slots, params)
        cache_len = -(-(PROMPT + NEW - 1) // 64) * 64
        nbytes = bytes_per_step(model, n, cache_len)
        read = nbytes["weights"] + nbytes["adapters"] + nbytes["kv_static"]
        need = nbytes["weights"] + nbytes["adapters"] + nbytes["kv_mean_context"]
        record(
            f"lorapop_N{n}",
            s,
            m,
            prefill_s=pre,
            decode_step_s=step,
            decode_tok_per_s=BATCH / step,
            bytes_per_step=nbytes,
            bandwidth_fraction=need / step / (peak * 1e12),
            bandwidth_fraction_static_reads=read / step / (peak * 1e12),
        )
        if n in (1, 8):  # the bank's "dense" decode kernel: every row through every slot
            bank.decode_kernel = "dense"
            pre, step = decode_step_seconds(model, bank, prompts, slots, params)
            cases[f"lorapop_N{n}_dense_decode"] = {
                "decode_step_s": step,
                "decode_tok_per_s": BATCH / step,
                "bandwidth_fraction": need / step / (peak * 1e12),
            }
            print(n, "dense", cases[f"lorapop_N{n}_dense_decode"], flush=True)
            bank.decode_kernel = "auto"
        if n == 8:
            s, m = peak_gb(
                lambda bank=bank, slots=slots: generate(
                    model, bank, None, prompts, slots, params, cuda_graph=False
                )
            )
            record("lorapop_N8_eager", s, m)
            greedy = SamplingParams(temperature=0.0, max_new_tokens=16, eos_token_ids=())
            a = generate(model, bank, None, prompts, slots, greedy)
            b = generate(model, bank, None, prompts, slots, greedy, cuda_graph=False)
            checks["graph_equals_eager_tokens"] = [x.token_ids for x in a] == [
                x.token_ids for x in b
            ]
            sub = slice(0, 16)
            with torch.no_grad():
                lp, _ = sequence_logprobs(
                    model, bank, prompts[sub], [x.token_ids for x in a[sub]], slots[sub]
                )
            ref = torch.tensor([x.logprobs for x in a[sub]])
            checks["max_abs_logprob_vs_teacher_forced_bf16"] = float((lp.cpu() - ref).abs().max())
            checks["mean_abs_logprob_vs_teacher_forced_bf16"] = float((lp.cpu() - ref).abs().mean())
        bank.detach()
        del bank
        torch.cuda.empty_cache()
    result["checks"] = checks
    base = cases["lorapop_N1"]["tok_per_s"]
    result["overhead_vs_N1"] = {
        k: base / v["tok_per_s"]
        for k, v in cases.items()
        if "tok_per_s" in v and k.startswith("lorapop_N")
    }
    step1 = cases["lorapop_N1"]["decode_step_s"]
    result["decode_step_overhead_vs_N1"] = {
        k: v["decode_step_s"] / step1 for k, v in cases.items() if "decode_step_s" in v
    }

    # HF generate + PEFT: one adapter, then 8 adapters mixed in the batch
    cfg = peft.LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=list(DEFAULT_TARGETS))
    pm = peft.get_peft_model(model, cfg, adapter_name="a0")
    for i in range(1, 8):
        pm.add_adapter(f"a{i}", cfg)
    pm.set_adapter("a0")
    pm.eval()  # PEFT refuses adapter_names= in training mode
    pm.generate(input_ids=cuda_ids[:, :8], attention_mask=mask[:, :8], max_new_tokens=4)
    s, m = peak_gb(lambda: pm.generate(input_ids=cuda_ids, attention_mask=mask, **hf_kw))
    record("hf_peft_1_adapter", s, m)
    if not args.quick:
        names = [f"a{i * 8 // BATCH}" for i in range(BATCH)]
        s, m = peak_gb(
            lambda: pm.generate(
                input_ids=cuda_ids, attention_mask=mask, adapter_names=names, **hf_kw
            )
        )
        record("hf_peft_8_adapters_mixed", s, m)
        result["lorapop_N8_vs_peft_mixed"] = (
            cases["lorapop_N8"]["tok_per_s"] / cases["hf_peft_8_adapters_mixed"]["tok_per_s"]
        )
    result["lorapop_N1_vs_hf_base"] = (
        cases["lorapop_N1"]["tok_per_s"] / cases["hf_generate_base"]["tok_per_s"]
    )
    result["cases"] = cases
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "cases"}, indent=1))


if __name__ == "__main__":
    main()
