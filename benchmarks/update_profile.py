"""Where the update's time goes, at the paper's shapes, on the GPU (a decode step's:
`decode_step.py`).

Builds the paper config's parts (random-weight 7B, 8-slot bank, `loop_step.py`'s set-up) and
times (1) the update at the paper step's composition (`--tasks` tasks x `--answers` student
answers sharing a `--student-prompt`-token prompt, and `--teachers` teacher rows of
`--teacher-prompt` tokens, every completion `--completion` tokens): the loop's own path
(packs, memory plan, micro-batches, log-probs + REINFORCE loss + backward) with prompts shared
or not, under checkpointing or `auto`, plus the bf16 log-prob difference packed vs unpacked
and the kernel table of one micro-batch without checkpointing (and its operators by the code
that ran them, `ops`: which projection's backward an add or a copy belongs to); (2)
optionally one update micro-batch per token budget (`--budgets`) with and without
checkpointing; kernels tabulated by `torch.profiler`.

    PYTHONPATH=src python benchmarks/update_profile.py --out benchmarks/results/update_profile.json
    PYTHONPATH=src python benchmarks/update_profile.py --smoke --tasks 2 --teachers 2 \
        --student-prompt 12 --teacher-prompt 30 --completion 16 --out /tmp/update_profile.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
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
    flop_params,
    hold_all_but,
    kernel_kinds,
    kernel_table,
    op_table,
    stack_profile,
    sync_cuda,
)


def _rows(vocab: int, n: int, prompt: int, completion: int, share: int, slots: list[int],
          seed: int) -> tuple[list, list, list]:
    """`n` rows, every `share` consecutive rows one prompt and slot; random token ids; rows in
    slot order, as the loop sorts them (so the bank's grouped LoRA kernel runs)."""
    g = torch.Generator().manual_seed(seed)
    tasks = n // share
    prompts = [torch.randint(0, vocab, (prompt,), generator=g).tolist() for _ in range(tasks)]
    comps = torch.randint(0, vocab, (n, completion), generator=g).tolist()
    return ([prompts[i // share] for i in range(n)], comps,
            [slots[(i // share) * len(slots) // tasks] for i in range(n)])


def update_pass(parts, rows: tuple[list, list, list], share: bool, mode: bool | str,
                max_tokens: int, profile: bool = False, held: bool = True) -> dict:
    """The loop's update over `rows` (`PolicyUpdate.step` minus advantages and the
    optimizer): timed, with its peak memory; `profile` tabulates the first micro-batch;
    `held=False` casts the bank in every forward instead of holding one copy."""
    from lorapop.engine.load import use_checkpointing
    from lorapop.engine.logprobs import (
        HEAD_CHUNK,
        head_compiled,
        pack_widths,
        sequence_logprobs,
        shared_prompt_packs,
    )
    from lorapop.engine.memory import (
        pack_overhead,
        plan_update,
        update_budget,
        update_bytes_per_token,
    )
    from lorapop.engine.transfer import host_to_device
    from lorapop.rl.loss import group_token_counts, policy_loss
    from lorapop.selfplay.update import pack_micro_batches

    model = parts.model
    prompts, comps, slot_list = rows
    packs = shared_prompt_packs(prompts, slot_list) if share else [[i] for i in range(len(comps))]
    widths = pack_widths(packs, prompts, comps)
    # as the loop: memory widths (what a shared pack's attention keeps) plan and group them
    mem = pack_widths(packs, prompts, comps, pack_overhead(model))
    slots = torch.tensor(slot_list, device=DEV)
    adv = torch.randn(len(comps), device=DEV, generator=torch.Generator(DEV).manual_seed(0))
    lengths = torch.tensor([len(c) for c in comps], device=DEV)
    counts = group_token_counts(torch.arange(int(lengths.max()), device=DEV) < lengths[:, None],
                                slots, n_groups=len(parts.slot))  # once per update, as the loop

    def micro(idx: list[int]) -> None:
        # as the loop: host slot ids, queued copies, the update's token counts
        i = host_to_device(torch.tensor(idx), DEV)
        lp, mask = sequence_logprobs(model, parts.bank, [prompts[j] for j in idx],
                                     [comps[j] for j in idx], [slot_list[j] for j in idx],
                                     share_prompts=share)
        loss, _ = policy_loss(lp.float(), adv[i], mask, groups=slots[i], token_counts=counts)
        loss.backward()

    sync_cuda()
    if DEV == "cuda":
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if DEV == "cuda" else 0  # the held copy counts
    t0 = time.perf_counter()
    with parts.bank.held_copy(model.dtype) if held else contextlib.nullcontext():
        # as the loop: the copy is made before the memory plan
        keep, cap = (plan_update(model, max(mem), max_tokens, HEAD_CHUNK,
                                 update_budget(model, parts.cfg.train.memory_share),
                                 head_compiled(model))
                     if mode == "auto" else (None, max_tokens))
        ckpt = bool(mode) if keep is None else keep < max(mem)
        model.train()
        groups = pack_micro_batches(packs, mem, cap, 64, slot_list)
        for idx, padded in groups:
            use_checkpointing(model, ckpt if keep is None else padded > keep)
            micro(idx)
        sync_cuda()
        dt = time.perf_counter() - t0
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30 if DEV == "cuda" else None
        tokens = sum(len(p) + len(c) for p, c in zip(prompts, comps, strict=True))
        out = {"share": share, "mode": mode, "held_copy": held, "checkpointing": ckpt,
               "micro_batch_tokens": cap, "micro_batches": len(groups),
               "sequences_per_micro_batch": max(sum(g[0] in idx for g in packs) for idx, _ in groups),
               "est_bytes_per_token": update_bytes_per_token(model),
               "row_tokens": tokens, "forward_tokens": sum(widths), "s": dt,
               "tokens_per_s": tokens / dt, "mfu_4n": 4 * flop_params(model) * tokens / dt / 989e12,
               "peak_extra_gib": peak}
        if profile:
            with profiler.profile(activities=[profiler.ProfilerActivity.CUDA,
                                              profiler.ProfilerActivity.CPU]) as prof:
                t0 = time.perf_counter()
                micro(groups[0][0])
                sync_cuda()
                wall_ms = (time.perf_counter() - t0) * 1e3
            out["profiled_micro_batch_rows"] = len(groups[0][0])
            out["kernel_kinds_ms"] = kernel_kinds(prof)
            out["profiled_wall_ms"] = wall_ms  # as loop_step.py --update-trace: GPU busy share
            out["gpu_busy"] = sum(out["kernel_kinds_ms"].values()) / wall_ms
            out["kernels"] = kernel_table(prof, 30)
            with stack_profile(profiler.ProfilerActivity.CUDA,
                               profiler.ProfilerActivity.CPU) as prof_stack:  # slower host
                micro(groups[0][0])
                sync_cuda()
            out["ops"] = op_table(prof_stack, 60)  # the copies spread over many places
            out["cpu_ops"] = [{"name": e.key[:100], "calls": e.count,
                               "self_cpu_ms": e.self_cpu_time_total / 1e3}
                              for e in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:15]]
    parts.opt.zero_grad()
    parts.bank.zero_grad()
    if DEV == "cuda":
        torch.cuda.empty_cache()
    return out


def packed_difference(parts, rows: tuple[list, list, list]) -> dict:
    """Log-probs of the same rows packed vs unpacked (model dtype), beside the difference the
    dtype alone makes between one row scored alone and in a batch."""
    from lorapop.engine.logprobs import sequence_logprobs

    prompts, comps, slots = rows
    parts.model.eval()
    with torch.no_grad():
        unpacked, mask = sequence_logprobs(parts.model, parts.bank, prompts, comps, slots)
        packed, _ = sequence_logprobs(parts.model, parts.bank, prompts, comps, slots,
                                      share_prompts=True)
        alone, _ = sequence_logprobs(parts.model, parts.bank, prompts[:1], comps[:1], slots[:1])
    diff = (packed.float() - unpacked.float()).abs()[mask]
    return {"rows": len(comps), "dtype": str(parts.model.dtype),
            "max_abs": float(diff.max()), "mean_abs": float(diff.mean()),
            "alone_vs_batch_max_abs": float((alone.float() - unpacked[:1].float()).abs()[mask[:1]].max())}


def slot_tokens(args, students: int, teachers: int) -> dict[str, int]:
    """Forward tokens of one slot's student packs (prompt shared by its answers) and teacher
    rows: the most a micro-batch of that slot can hold (the paper step: 48 tasks, 48 rows)."""
    pack = args.student_prompt + args.answers * args.completion
    return {"student": -(-args.tasks // students) * pack,
            "teacher": -(-args.teachers // teachers) * (args.teacher_prompt + args.completion)}


def paper_case(parts, args, write) -> dict:
    """Student rows (shared prompts) and teacher rows at the paper's composition, timed with
    checkpointing or `auto`, prompts shared or not, the bank held or cast per forward; the
    paper step's update time predicted from the measured tokens/s."""
    vocab = parts.model.config.vocab_size
    teachers = [parts.slot[n] for n in parts.teachers]
    students = [parts.slot[n] for n in parts.students]
    student = _rows(vocab, args.tasks * args.answers, args.student_prompt, args.completion,
                    args.answers, students, 2)
    teacher = _rows(vocab, args.teachers, args.teacher_prompt, args.completion, 1, teachers, 3)
    out: dict = {"tasks": args.tasks, "answers": args.answers, "student_prompt": args.student_prompt,
                 "teachers": args.teachers, "teacher_prompt": args.teacher_prompt,
                 "completion": args.completion, "runs": [],
                 "slot_tokens": slot_tokens(args, len(students), len(teachers))}
    if fits := [k for k, v in out["slot_tokens"].items() if v <= args.max_tokens]:
        print(f"warning: each slot's {' and '.join(fits)} rows fit one micro-batch of "
              f"--max-tokens {args.max_tokens} (a micro-batch holds one slot's rows), so the "
              "budget does not shape these micro-batches as it does the paper step's: pass more "
              "--tasks / --teachers", file=sys.stderr)
    update_pass(parts, student, True, "auto", args.max_tokens)  # warm-up
    # (rows, share, mode, held copy): the last two cast the bank in every forward
    cases = [("student", False, True, True), ("student", True, True, True),
             ("student", False, "auto", True), ("student", True, "auto", True),
             ("teacher", False, True, True), ("teacher", False, "auto", True),
             ("student", True, "auto", False), ("teacher", False, "auto", False)]
    if args.default_only:
        cases = [("student", True, "auto", True), ("teacher", False, "auto", True)]
    for name, share, mode, held in cases:
        rows = student if name == "student" else teacher
        profile = mode == "auto" and held and (share or name == "teacher")
        r = {"rows": name, **update_pass(parts, rows, share, mode, args.max_tokens, profile, held)}
        print(json.dumps({k: v for k, v in r.items() if k not in ("kernels", "cpu_ops", "ops")}), flush=True)
        out["runs"].append(r)
        write()
    out["packed_vs_unpacked"] = packed_difference(
        parts, tuple(x[: 2 * args.answers] for x in student))
    # the paper step: 192 teacher rows and 768 student rows (4 answers x 192 tasks)
    tps = {(r["rows"], r["share"], r["mode"], r["held_copy"]): r["tokens_per_s"] for r in out["runs"]}
    t_tok = 192 * (args.teacher_prompt + args.completion)
    s_tok = 768 * (args.student_prompt + args.completion)

    def predicted(teacher: tuple, student: tuple) -> float:
        return t_tok / tps[("teacher", *teacher)] + s_tok / tps[("student", *student)]

    runs = {"checkpointing_unshared": ((False, True, True), (False, True, True)),
            "checkpointing_shared": ((False, True, True), (True, True, True)),
            "auto_unshared": ((False, "auto", True), (False, "auto", True)),
            "auto_shared, bank cast per forward": ((False, "auto", False), (True, "auto", False)),
            "auto_shared (default)": ((False, "auto", True), (True, "auto", True))}
    out["paper_step"] = {"teacher_tokens": t_tok, "student_tokens": s_tok, "predicted_update_s": {
        name: predicted(*modes) for name, modes in runs.items()
        if ("teacher", *modes[0]) in tps and ("student", *modes[1]) in tps}}
    print(json.dumps(out["paper_step"]), flush=True)
    return out


def update_case(parts, prompt: int, completion: int, tokens: int, ckpt: bool, reps: int,
                profile: bool) -> dict:
    from lorapop.engine.load import use_checkpointing
    from lorapop.engine.logprobs import sequence_logprobs
    from lorapop.rl.loss import policy_loss

    model, bank = parts.model, parts.bank
    use_checkpointing(model, ckpt)
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

    sync_cuda()
    if DEV == "cuda":
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if DEV == "cuda" else 0
    try:
        once()  # warm-up
        sync_cuda()
        t0 = time.perf_counter()
        for _ in range(reps):
            once()
        sync_cuda()
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
            sync_cuda()
        out["kernels"] = kernel_table(prof)
    parts.opt.zero_grad()
    bank.zero_grad()
    if DEV == "cuda":
        torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/qwen2.5-coder-7b-4v4.yaml")
    ap.add_argument("--prompt", type=int, default=800)
    ap.add_argument("--completion", type=int, default=1024)
    ap.add_argument("--tasks", type=int, default=8, help="student tasks in the paper case (0: skip it)")
    ap.add_argument("--answers", type=int, default=4)
    ap.add_argument("--student-prompt", type=int, default=500)
    ap.add_argument("--teachers", type=int, default=8, help="teacher rows in the paper case")
    ap.add_argument("--teacher-prompt", type=int, default=1960)
    ap.add_argument("--max-tokens", type=int, default=16384, help="train.micro_batch_tokens")
    ap.add_argument("--default-only", action="store_true",
                    help="the paper case in the loop's default mode only (auto, prompts shared, "
                         "bank held): student and teacher rows")
    ap.add_argument("--budgets", default="", help="tokens,... one micro-batch per budget")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--card-gib", type=float, default=None,
                    help="hold all but this many GiB of the GPU first (as loop_step.py): "
                         "micro-batches sized as on a smaller card, e.g. 79.6 for an H100 80GB")
    ap.add_argument("--out", default="benchmarks/results/update_profile.json")
    ap.add_argument("--smoke", action="store_true",
                    help="CPU check of the script: tiny random model (pass small sizes)")
    ap.add_argument("overrides", nargs="*", help="extra key.path=value")
    args = ap.parse_args()
    if args.smoke:  # a CPU check of the script: tiny random model in bf16 (the held copy)
        args.overrides = [*SMOKE, *args.overrides]
    elif DEV != "cuda":
        sys.exit("update_profile.py needs a CUDA GPU (or --smoke for a CPU check of the script)")
    from lorapop.config import load_config
    from lorapop.selfplay.parts import build

    seeds = Path(tempfile.mkdtemp())
    cfg = load_config(ROOT / args.config, [*bench_overrides(seeds, 4), *args.overrides])
    parts = build(cfg)
    ballast = hold_all_but(args.card_gib) if args.card_gib and DEV == "cuda" else None
    result = {"benchmark": "update_profile", "card_gib": args.card_gib if ballast is not None else None, "command": " ".join([Path(sys.executable).name, *sys.argv]),
              "device": torch.cuda.get_device_name() if DEV == "cuda" else "cpu", "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d"), "paper": None, "update": []}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def write() -> None:
        out.write_text(json.dumps(result, indent=2))

    if args.tasks:
        result["paper"] = paper_case(parts, args, write)
        write()
    for budget in map(int, filter(None, args.budgets.split(","))):
        for ckpt in (True, False):
            r = update_case(parts, args.prompt, args.completion, budget, ckpt, args.reps,
                            profile=budget == 8192)
            print(json.dumps({k: v for k, v in r.items() if k != "kernels"}), flush=True)
            result["update"].append(r)
            write()


if __name__ == "__main__":
    main()
