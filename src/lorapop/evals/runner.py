"""`run_eval`: every member of a population on every benchmark, in mixed-adapter batches.

TARGET is a run directory (each PEFT adapter directory below it is a member; one named
`baseline` is the single-agent baseline), one PEFT adapter directory, or a base model alone
(hub id, local path or `tiny-random`). The base model without adapter is evaluated too, as
`base`, through an all-zero slot of the same bank, so all rows share each `generate` call.
Decoding is greedy (pass@1 as AZR reports it).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lorapop.evals import codecheck, data, prompts, table
from lorapop.evals.pool import Pool

CONFIG_NAME = "adapter_config.json"


class EvalError(RuntimeError):
    """The evaluation cannot start (bad target, data, options); the message is one line."""


@dataclass(frozen=True)
class Member:
    name: str
    adapter: Path | None  # None: the base model itself
    role: str  # "member" | "baseline" | "base"


def find_members(target: str | Path) -> tuple[list[Member], str | None]:
    """Members under `target` and the base model their adapter configs name (if any)."""
    path = Path(target)
    named: dict[Path, tuple[str, str]] = {}
    if (path / CONFIG_NAME).is_file():
        dirs = [path]
    elif (run := _run_members(path)) is not None:
        named = run
        dirs = list(run)
    elif path.is_dir():
        dirs = sorted(p.parent for p in path.rglob(CONFIG_NAME))
        if not dirs:
            raise EvalError(f"{path}: no PEFT adapter directories ({CONFIG_NAME}) found")
    else:
        return [], None  # a base model name
    members, bases = [], set()
    for d in dirs:
        try:
            cfg = json.loads((d / CONFIG_NAME).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise EvalError(f"{d / CONFIG_NAME}: unreadable ({e})") from None
        if cfg.get("base_model_name_or_path"):
            bases.add(cfg["base_model_name_or_path"])
        if d in named:
            name, role = named[d]
        else:
            name = d.name if d == path else str(d.relative_to(path))
            role = "baseline" if d.name == "baseline" else "member"
        members.append(Member(name, d, role))
    if len(bases) > 1:
        raise EvalError(f"adapters name different base models: {sorted(bases)}")
    return members, next(iter(bases), None)


def _run_members(path: Path) -> dict[Path, tuple[str, str]] | None:
    """A `lorapop train` run directory: the members of its last checkpoint, and the single
    agent of its `baseline/` run (if any) as the baseline. None for any other directory."""
    from lorapop.run.checkpoint import latest_checkpoint

    ckpt = latest_checkpoint(path)
    if ckpt is None:
        return None
    found = {d: (d.name, "member") for d in sorted((ckpt / "adapters").iterdir()) if d.is_dir()}
    base_ckpt = latest_checkpoint(path / "baseline")
    if base_ckpt is not None:
        for d in sorted((base_ckpt / "adapters").iterdir()):
            found[d] = ("baseline", "baseline")
    return found


def load_population(base: str, members: list[Member], device: str, dtype: str, seed: int):  # noqa: ANN202
    """(tokenizer, model, bank or None): the base with one bank slot per member (the members'
    PEFT adapters imported; a member without one keeps an all-zero slot)."""
    from lorapop.engine.load import ModelLoadError, load_base_model, load_tokenizer

    try:
        tok = load_tokenizer(base)
        model = load_base_model(base, tok, device=device, dtype=dtype, seed=seed)
    except (ModelLoadError, OSError, ValueError) as e:
        raise EvalError(str(e).splitlines()[0] if str(e) else type(e).__name__) from None
    adapters = [m for m in members if m.adapter is not None]
    if not adapters:
        return tok, model, None
    from lorapop.engine.patches import attach_lora
    from lorapop.lora.peft_io import import_slot

    cfgs = [json.loads((m.adapter / CONFIG_NAME).read_text()) for m in adapters]  # type: ignore[operator]
    ranks = {int(c.get("r", 8)) for c in cfgs}
    if len(ranks) != 1:
        raise EvalError(f"members have different LoRA ranks {sorted(ranks)}; evaluate them apart")
    targets = sorted({t for c in cfgs for t in (c.get("target_modules") or [])})
    rank = ranks.pop()
    alpha = float(cfgs[0].get("lora_alpha", rank))
    try:
        bank = attach_lora(model, n_slots=len(members), rank=rank, alpha=alpha,
                           target_modules=targets, dtype=next(model.parameters()).dtype)  # fmt: skip
        for i, m in enumerate(members):
            if m.adapter is None:  # the base model: a slot whose delta is exactly zero
                state = bank.slot_state(i)
                bank.load_slot(i, {k: {n: t.zero_() for n, t in ab.items()}
                                   for k, ab in state.items()})  # fmt: skip
            else:
                import_slot(bank, i, m.adapter)
    except ValueError as e:
        raise EvalError(str(e).splitlines()[0]) from None
    return tok, model, bank


def _score_math(problems: list[data.Problem], texts: list[str]) -> list[dict[str, Any]]:
    from lorapop.evals.mathcheck import check

    out = []
    for p, t in zip(problems, texts, strict=True):
        v = check(t, p.answer)
        out.append({"passed": v.correct, "extracted": v.extracted, "gold": p.answer})
    return out


def run_eval(
    target: str | Path,
    benches: Sequence[str],
    data_dir: str | Path | None = None,
    out_dir: str | Path | None = None,
    *,
    sources: dict[str, str] | None = None,
    base_model: str | None = None,
    include_base: bool = True,
    template: str = "auto",
    max_new_tokens: int = 2048,
    batch_size: int | None = None,
    limit: int | None = None,
    device: str = "auto",
    dtype: str = "auto",
    workers: int = 2,
    seed: int = 0,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Evaluate TARGET on `benches`; returns the results dict and, with `out_dir`, writes
    `eval.json` (per-problem results) and `eval.md` (the table) there."""
    from lorapop.engine.sampling import SamplingParams
    from lorapop.evals.progress import generate_logged

    say = log or (lambda s: None)
    unknown = [b for b in benches if b not in data.BENCHES]
    if unknown or not benches:
        raise EvalError(f"unknown benchmarks {unknown} (known: {', '.join(data.BENCHES)})")
    members, named_base = find_members(target)
    base = base_model or named_base or (None if members else str(target))
    if base is None:
        raise EvalError("the adapters do not name their base model; pass base_model")
    if include_base or not members:
        members = [*members, Member(table.BASE, None, "base")]
    try:
        problems = {b: data.load(b, data_dir, (sources or {}).get(b), limit) for b in benches}
    except data.DataError as e:
        raise EvalError(str(e)) from None
    tok, model, bank = load_population(base, members, device, dtype, seed)
    tmpl = prompts.resolve(template, tok)
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)
    result: dict[str, Any] = {
        "target": str(target), "base_model": base, "template": tmpl,
        "max_new_tokens": max_new_tokens, "members": {m.name: m.role for m in members},
        "benchmarks": {},
    }  # fmt: skip
    roles = {m.name: m.role for m in members}
    scores: dict[str, dict[str, float]] = {}
    rows = [(b, m_i, p) for b, probs in problems.items() for m_i in range(len(members))
            for p in probs]  # fmt: skip
    t0 = time.perf_counter()
    say(f"{len(rows)} completions to generate ({len(members)} members)")
    gens = generate_logged(model, bank, tok, [prompts.render(p, tmpl, tok) for _, _, p in rows],
                           [m_i if bank is not None else 0 for _, m_i, _ in rows], params,
                           seed=seed, batch_size=batch_size, log=say)  # fmt: skip
    result["generate_s"] = round(time.perf_counter() - t0, 3)
    result["generated_tokens"] = sum(len(g.token_ids) for g in gens)
    say(f"generated {len(rows)} completions in {result['generate_s']:.1f}s")
    with Pool(workers=workers) as pool:
        for b, probs in problems.items():
            t1 = time.perf_counter()
            idx = [k for k, r in enumerate(rows) if r[0] == b]
            items = [(rows[k][2], gens[k].text) for k in idx]
            if data.BENCHES[b].group == "math":
                graded = _score_math([p for p, _ in items], [c for _, c in items])
            else:
                graded = codecheck.score(items, pool)
            per: dict[str, list[bool]] = {m.name: [] for m in members}
            records = []
            for k, r in zip(idx, graded, strict=True):
                _, m_i, p = rows[k]
                per[members[m_i].name].append(bool(r["passed"]))
                records.append({"member": members[m_i].name, "id": p.id, **r,
                                "completion": gens[k].text, "finish": gens[k].finish})  # fmt: skip
            scores[b] = {m: (sum(v) / len(v) if v else 0.0) for m, v in per.items()}
            result["benchmarks"][b] = {
                "n": len(probs), "pass@1": scores[b],
                "score_s": round(time.perf_counter() - t1, 3), "problems": records,
            }  # fmt: skip
            say(f"{b}: {len(probs)} problems x {len(members)} members scored")
    summary = table.summarize(scores, roles)
    result["summary"] = summary
    result["table"] = table.markdown(summary, roles)
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "eval.json").write_text(json.dumps(result, indent=1, default=str))
        (out / "eval.md").write_text(result["table"])
    return result
