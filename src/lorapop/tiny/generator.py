"""Verified tasks from the grammar: programs and inputs run through the sandbox.

A candidate program is kept only when the sandbox runs it `ok` (deterministically, under two
hash seeds) on every probe input, its outputs are short, and they are not all equal (a
function that ignores its input makes a trivial code_i or code_f task). Outputs are always the
sandbox's, never ours.

Train / held-out split: every program belongs to one side by a hash of its normalised source
(`program_split`), so the held-out benchmark and any training corpus are disjoint whatever seeds
either uses. Candidate `i` of a call is drawn from `random.Random(f"{split}/{seed}/{level}/{i}")`;
the result is the first `n` candidates that pass, so it does not depend on batch sizes.
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import itertools
import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from lorapop.tasks.family import Runner
from lorapop.tasks.task import Task
from lorapop.tiny.grammar import (
    Knobs,
    Level,
    Program,
    describe,
    extend_program,
    generate_input,
    generate_program,
    knobs_for,
    level_number,
    level_rules,
    table_level,
)
from lorapop.verify import Job, Sandbox, Verdict

KINDS = ("code_o", "code_i", "code_f")
SPLITS = ("train", "heldout")
#: One program in this many belongs to the held-out side.
HELDOUT_EVERY = 8


def normalize(source: str) -> str:
    """Source re-printed from its AST: formatting and comments do not make a new program."""
    try:
        return ast.unparse(ast.parse(source))
    except (SyntaxError, ValueError, RecursionError):
        return source.strip()


def program_split(source: str) -> str:
    """The side of a program: "heldout" for one in `HELDOUT_EVERY`, else "train".

    Hashes the text with trailing spaces dropped, not `normalize`'s AST print, whose format
    may change between Python versions (and with it the benchmark).
    """
    text = "\n".join(line.rstrip() for line in source.strip().splitlines())
    digest = hashlib.sha256(text.encode()).digest()
    return "heldout" if int.from_bytes(digest[:8], "big") % HELDOUT_EVERY == 0 else "train"


@dataclass(frozen=True)
class Candidate:
    """A generated program and its inputs, before any run."""

    program: Program
    inputs: tuple[str, ...]
    level: int | None


@contextlib.contextmanager
def _sandbox(sandbox: Sandbox | None) -> Iterator[Sandbox]:
    if sandbox is not None:
        yield sandbox
        return
    with Sandbox(workers=2, timeout_s=2.0) as sb:
        yield sb


def _level_key(difficulty: int | Knobs | Level) -> str:
    if isinstance(difficulty, Level):
        knobs = repr(difficulty.knobs)
        if level_rules(difficulty).live_code:  # as the knobs' repr read when world-live was built
            knobs = knobs[:-1] + ", live=True)"
        return f"{difficulty.number}/{knobs}"
    return str(difficulty) if isinstance(difficulty, int) else repr(difficulty)


def candidate(
    difficulty: int | Knobs | Level, seed: int | str, split: str, n_inputs: int, i: int
) -> Candidate | None:
    """Candidate `i` of a stream: a program with `n_inputs` distinct inputs, or None when the
    program is of the other split, calls what its world leaves out or has too few distinct
    inputs."""
    rng = random.Random(f"{split}/{seed}/{_level_key(difficulty)}/{i}")
    program = generate_program(rng, difficulty)
    rules = level_rules(difficulty)
    if program_split(program.source) != split or rules.call_problem(program.source):
        return None
    domain = rules.inputs
    inputs: list[str] = []
    for _ in range(4 * n_inputs):
        text = generate_input(rng, program, domain)
        if text not in inputs:
            inputs.append(text)
        if len(inputs) == n_inputs:
            return Candidate(program, tuple(inputs), level_number(difficulty))
    return None


def _candidates(
    difficulty: int | Knobs | Level, seed: int | str, split: str, n_inputs: int
) -> Iterator[Candidate]:
    """Programs of the given split with `n_inputs` distinct inputs each, in a fixed order."""
    for i in itertools.count():
        if (cand := candidate(difficulty, seed, split, n_inputs, i)) is not None:
            yield cand


def generate_tasks(
    kind: str,
    n: int,
    difficulty: int | Knobs | Level,
    seed: int | str = 0,
    *,
    sandbox: Sandbox | None = None,
    split: str = "train",
    n_inputs: int = 6,
    probes: int = 3,
    max_output_chars: int = 60,
    exclude: Iterable[str] = (),
    batch: int = 64,
    max_candidates: int | None = None,
) -> list[Task]:
    """`n` verified tasks of `kind` at `difficulty` (1..5, a `Level` of another level table, or
    explicit `Knobs`; `meta["difficulty"]` is the level's number, None for bare knobs).

    code_o / code_i tasks carry one (input, output) pair, checked on `probes` inputs;
    code_f tasks carry `n_inputs` pairs and a short message. `exclude` holds normalised
    programs (see `normalize`) to skip, e.g. those of a training corpus. Programs are distinct
    within a call. Raises RuntimeError when `max_candidates` (default 100 * n) are not enough.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if n < 0 or probes < 1 or n_inputs < 2:
        raise ValueError("need n >= 0, probes >= 1 and n_inputs >= 2")
    knobs_for(difficulty)  # a bad level fails here, before any sandbox starts
    width = n_inputs if kind == "code_f" else probes
    limit = max_candidates if max_candidates is not None else 100 * max(n, 1)
    stream = _candidates(difficulty, seed, split, width)
    seen = set(exclude)
    out: list[Task] = []
    tried = 0
    with _sandbox(sandbox) as sb:
        while len(out) < n:
            if tried >= limit:
                raise RuntimeError(
                    f"only {len(out)} of {n} {kind} tasks verified in {limit} candidates"
                )
            chunk = []
            size = min(batch, 2 * (n - len(out)) + 2)  # about 1 in 4 candidates fails
            while len(chunk) < size and tried < limit:
                cand = next(stream)
                tried += 1
                key = normalize(cand.program.source)
                if key not in seen:
                    seen.add(key)
                    chunk.append(cand)
            jobs = [
                Job(c.program.source, f"f({text})", deterministic=True)
                for c in chunk
                for text in c.inputs
            ]
            verdicts = iter(sb.run(jobs))
            for cand in chunk:
                outputs = [next(verdicts) for _ in cand.inputs]
                if len(out) < n and acceptable(outputs, max_output_chars, difficulty):
                    texts = [v.output or "" for v in outputs]
                    out.append(make_task(kind, cand, texts, seed, split))
    return out


def acceptable(
    verdicts: Sequence[Verdict], max_output_chars: int, difficulty: int | Knobs | Level = 1
) -> bool:
    """A program's runs make a task: all ok, outputs short, not all equal, and inside the
    level's output domain if it has one."""
    if not all(v.ok and v.output is not None for v in verdicts):
        return False
    outputs = [v.output or "" for v in verdicts]
    rules = level_rules(difficulty)
    return (max(len(o) for o in outputs) <= max_output_chars and len(set(outputs)) > 1
            and not any(map(rules.output_problem, outputs)))  # fmt: skip


def make_task(kind: str, cand: Candidate, outputs: list[str], seed: int | str, split: str) -> Task:
    """The task of `kind` for `cand` with the outputs its runs gave (code_f keeps every pair)."""
    keep = len(cand.inputs) if kind == "code_f" else 1
    meta = {
        "difficulty": cand.level,
        "features": list(cand.program.features),
        "seed": str(seed),
        "split": split,
        "source": "tiny-grammar",
    }
    return Task(
        type=kind,
        program=cand.program.source,
        inputs=cand.inputs[:keep],
        outputs=tuple(outputs[:keep]),
        message=describe(cand.program) if kind == "code_f" else "",
        meta=meta,
    )


_RESULT_TYPES = {int: "int", str: "str", list: "list", dict: "dict"}


def generate_variants(
    anchors: Sequence[Task],
    seed: int | str,
    sandbox: Runner,
    *,
    level_up: int = 1,
    max_output_chars: int = 60,
    offset: int = 0,
    table: str = "standard",
) -> list[tuple[Task, Task]]:
    """(anchor, variant) pairs: each variant is `extend_program` of its anchor at the anchor's
    level + `level_up` (capped at 5) of level table `table`, run by `sandbox` (or any runner
    of grammar programs, e.g. `lorapop.tiny.corpus.TrustedRunner`) on the anchor's inputs and
    kept under
    the same rules as `generate_tasks` (train split, all `ok`, short and not all equal outputs).

    Anchors must be helper-free grammar code_f tasks (levels 1..3); others are skipped. The
    variant of anchor `i` is drawn from `random.Random(f"variant/{seed}/{offset + i}")`, so a
    slice of the anchors with its `offset` gives that slice of the variants.
    """
    cands: list[tuple[Task, Program, int | Level]] = []
    for i, a in enumerate(anchors):
        level = a.meta.get("difficulty")
        kind = type(_literal(a.outputs[0])) if a.outputs else None
        if not isinstance(level, int) or kind not in _RESULT_TYPES:
            continue
        rng = random.Random(f"variant/{seed}/{offset + i}")
        try:
            up = table_level(min(5, level + level_up), table)
            prog = extend_program(rng, a.program, _RESULT_TYPES[kind], up)
        except ValueError:
            continue
        if program_split(prog.source) == "train" and not level_rules(up).call_problem(prog.source):
            cands.append((a, prog, up))
    jobs = [Job(p.source, f"f({x})", deterministic=True) for a, p, _ in cands for x in a.inputs]
    verdicts = iter(sandbox.run(jobs))
    out = []
    for a, prog, up in cands:
        vs = [next(verdicts) for _ in a.inputs]
        if acceptable(vs, max_output_chars, up):
            level = min(5, a.meta["difficulty"] + level_up)
            cand = Candidate(prog, a.inputs, level)
            variant = make_task("code_f", cand, [v.output or "" for v in vs], seed, "train")
            out.append((a, variant))
    return out


def _literal(text: str) -> object:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return None


def generate_triples(
    n: int,
    difficulty: int | Knobs | Level,
    seed: int | str = 0,
    *,
    sandbox: Sandbox | None = None,
    split: str = "train",
) -> list[tuple[str, str, str]]:
    """`n` verified (program, input, output) triples: the sandbox computed each output."""
    tasks = generate_tasks("code_o", n, difficulty, seed, sandbox=sandbox, split=split)
    return [(t.program, t.input, t.output) for t in tasks]
