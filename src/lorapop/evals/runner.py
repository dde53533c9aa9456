"""`run_eval`: every member of a population on every benchmark, in mixed-adapter batches.

TARGET is a run directory (each PEFT adapter directory below it is a member; one named
`baseline` is the single-agent baseline), one PEFT adapter directory, or a base model alone
(hub id, local path or `tiny-random`). The base model without adapter is evaluated too, as
`base`, through an all-zero slot of the same bank, so all rows share each `generate` call.
Decoding is greedy (pass@1 as AZR reports it).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lorapop.evals import codecheck, data, prompts, table
from lorapop.evals.pool import Pool

CONFIG_NAME = "adapter_config.json"


class EvalError(RuntimeError):
    """The evaluation cannot start (bad target, data, options); the message is one line."""


class EvalInterrupted(EvalError):
    """Ctrl-C during an evaluation; the message says where the results so far are kept."""


#: Results appended here as they are scored; removed when eval.json is written.
PARTIAL = "eval.partial.jsonl"
#: Completions generated and scored per chunk (more when --batch-size is larger).
CHUNK_ROWS = 256


def _read_partial(path: Path, settings: dict[str, Any]) -> dict[tuple[str, str, str], dict]:
    """The results an interrupted evaluation of the same settings kept at `path`."""
    if not path.is_file():
        return {}
    lines = path.read_text(errors="replace").splitlines()
    try:
        head = json.loads(lines[0]) if lines else {}
    except json.JSONDecodeError:
        head = {}
    if head.get("settings") != settings:
        raise EvalError(f"{path} holds results of another evaluation (target, base model, "
                        "template, length or seed differ): remove it or pick another --out")
    done = {}
    for line in lines[1:]:
        try:
            rec = json.loads(line)
            done[(rec.pop("bench"), rec["member"], rec["id"])] = rec
        except (json.JSONDecodeError, KeyError, TypeError):
            continue  # a line cut by the interruption
    return done


@contextmanager
def _appender(path: Path | None, settings: dict[str, Any]) -> Iterator[Callable[[dict], None]]:
    """A function appending one result line to `path` (flushed each time), or discarding it."""
    if path is None:
        yield lambda rec: None
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.is_file()
    with open(path, "a") as fh:
        if new:
            fh.write(json.dumps({"settings": settings}) + "\n")

        def keep(rec: dict) -> None:
            fh.write(json.dumps(rec, default=str) + "\n")
            fh.flush()

        yield keep


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


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
    partial = Path(out_dir) / PARTIAL if out_dir is not None else None
    settings = {"target": str(target), "base_model": base, "template": template,
                "max_new_tokens": max_new_tokens, "seed": seed}
    done = _read_partial(partial, settings) if partial is not None else {}
    if done:
        say(f"{len(done)} results kept from {partial} (an earlier, interrupted evaluation)")
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
    todo = [(b, m_i, p) for b, probs in problems.items() for m_i in range(len(members))
            for p in probs if (b, members[m_i].name, p.id) not in done]  # fmt: skip
    t0 = time.perf_counter()
    result["generated_tokens"] = 0
    say(f"{len(todo)} completions to generate ({len(members)} members)")
    # in chunks whose results are appended to `partial` as they are scored: an interrupted or
    # failed evaluation keeps them, and the same command goes on from there
    step = max(CHUNK_ROWS, 4 * (batch_size or 0))
    try:
        with Pool(workers=workers) as pool, _appender(partial, settings) as keep:
            for c in range(0, len(todo), step):
                rows = todo[c: c + step]
                gens = generate_logged(
                    model, bank, tok, [prompts.render(p, tmpl, tok) for _, _, p in rows],
                    [m_i if bank is not None else 0 for _, m_i, _ in rows], params,
                    seed=seed, batch_size=batch_size, log=say)  # fmt: skip
                result["generated_tokens"] += sum(len(g.token_ids) for g in gens)
                for b in dict.fromkeys(b for b, _, _ in rows):
                    idx = [k for k, r in enumerate(rows) if r[0] == b]
                    items = [(rows[k][2], gens[k].text) for k in idx]
                    if data.BENCHES[b].group == "math":
                        graded = _score_math([p for p, _ in items], [x for _, x in items])
                    else:
                        graded = codecheck.score(items, pool)
                    for k, r in zip(idx, graded, strict=True):
                        _, m_i, p = rows[k]
                        rec = {"member": members[m_i].name, "id": p.id, **r,
                               "completion": gens[k].text, "finish": gens[k].finish}  # fmt: skip
                        done[(b, rec["member"], p.id)] = rec
                        keep({"bench": b, **rec})
                say(f"{min(c + step, len(todo))}/{len(todo)} completions scored")
    except KeyboardInterrupt:
        where = f"; {len(done)} results are kept in {partial}: the same command goes on " \
                "from there" if partial is not None else " (no --out: nothing kept)"
        raise EvalInterrupted(f"interrupted{where}") from None
    result["generate_s"] = round(time.perf_counter() - t0, 3)
    for b, probs in problems.items():
        per: dict[str, list[bool]] = {m.name: [] for m in members}
        records = []
        for m in members:
            for p in probs:
                rec = done[(b, m.name, p.id)]
                per[m.name].append(bool(rec["passed"]))
                records.append(rec)
        scores[b] = {m: (sum(v) / len(v) if v else 0.0) for m, v in per.items()}
        result["benchmarks"][b] = {"n": len(probs), "pass@1": scores[b], "problems": records}
    summary = table.summarize(scores, roles)
    result["summary"] = summary
    result["table"] = table.markdown(summary, roles)
    if out_dir is not None:
        out = Path(out_dir)
        _write_atomic(out / "eval.json", json.dumps(result, indent=1, default=str))
        _write_atomic(out / "eval.md", result["table"])
        if partial is not None:
            partial.unlink(missing_ok=True)
    return result
