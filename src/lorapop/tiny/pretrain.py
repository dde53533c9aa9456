"""Warm-start the tiny base model: a BPE tokenizer and a small Qwen2 trained on every role.

The corpus is grammar programs of the train split (`generate_tasks(..., split="train")`) with
six sandbox-verified input/output pairs each. Every training example is a compact-format prompt
written by the task families themselves (`get_family(t, template="compact")`) and the text the
family's parser accepts, ended by EOS:

- teacher code_o / code_i: `teacher_prompt(refs)` -> `<program></f><i><input></i>`
- teacher code_f: `teacher_prompt(refs, base)` -> `<in_1></i><i>...</i><m><message></m>`
- student code_o / code_i / code_f: `student_prompt(task)` -> output / input / program

The loss covers the completion tokens only. Examples (a random pair, 0..K references, a random
n for code_f) come from one `random.Random(seed)`: drawn afresh for each batch (the `tiny`
recipe), or drawn once into a pre-tokenized pool whose length-bucketed batches are gathered by
tensor indexing on the device (`ExamplePool`, the GPU recipes). Either way a run is a function
of its arguments: the same seed gives the same loss curve and the same weights on CPU (GPU
kernels may add float noise). Teachers learn programs of levels 1..`teacher_max_level`
(short enough to sample on a laptop); students learn all five levels.

Sizes (`SIZES`, `lorapop pretrain-tiny --size`): `tiny` is the shipped 3.5M model, made exactly
as above. Larger sizes are for a world in the paper's regime (GPU): teachers learn all five
levels, their references are of their completion's level, and a share of their code_o/code_i
examples are *reference-conditioned*: one of the shown references is an anchor program and the
completion is a harder variant of it (`generate_variants`: the anchor becomes helper `g` of a
new, longer `f`), so what a teacher proposes depends on what it is shown and it has a cue to
raise difficulty. Their corpus is large enough not to be memorised (`lorapop.tiny.corpus` makes
it in worker processes), the pool is drawn once and trained in one pass, and the example mix,
the loss weights and the tokenizer favour students learning to execute (`Recipe`). A recipe
may draw from another level table (`Recipe.levels`, `grammar.LEVEL_TABLES`) and give each
(role, level) a share of the pool's tokens rather than of its examples (`budget_cells`,
`Examples.budget`), so short student examples are not crowded out by long teacher ones: the
regime world's recipes do (experiments/regime/regime_recipes.py, built with
`pretrain_size(..., sizes=RECIPES)`).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import itertools
import json
import math
import os
import platform
import random
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch
import transformers
from transformers import PreTrainedTokenizerFast

from lorapop import dist
from lorapop.engine.determinism import deterministic_kernels
from lorapop.engine.load import TINY_DIR, random_qwen2, resolve_device
from lorapop.engine.memory import activation_bytes_per_token, host_free_memory
from lorapop.tasks import Task, get_family
from lorapop.tiny.corpus import generate_corpus, generate_variants_fast
from lorapop.tiny.generator import generate_tasks, generate_variants
from lorapop.tiny.grammar import ALPHABET, LEVELS, table_levels
from lorapop.tiny.heldout import fingerprint
from lorapop.tiny.partial import Partial
from lorapop.tiny.tokenizer import corpus_texts, save_tokenizer, train_tokenizer
from lorapop.verify import Sandbox

#: Where the shipped model lives (package data).
TINY_MODEL_DIR = TINY_DIR  # where the shipped model lives (model name `tiny`)
ROLES = (
    "teacher/code_o", "teacher/code_i", "teacher/code_f",
    "student/code_o", "student/code_i", "student/code_f",
)  # fmt: skip
T = TypeVar("T")
#: The grammar's string alphabet (both cases): the world's tokenizer never merges these.
STRING_CHARS = ALPHABET + ALPHABET.upper()
#: code_f teacher prompts ask for one of these many inputs (the corpus has 6 pairs per program),
#: unless a recipe says otherwise (`Recipe.code_f_ns`).
CODE_F_NS = (4, 6)


@dataclass(frozen=True)
class ModelSize:
    """A Qwen2 shape; the default has about 3.3M parameters with a 2048-token vocabulary."""

    hidden: int = 256
    layers: int = 4
    heads: int = 8
    kv_heads: int = 4
    intermediate: int = 704
    max_positions: int = 2048


def reshape(size: ModelSize, spec: str) -> ModelSize:
    """`size` with the fields named in `spec` (`"hidden=768,layers=12"`) changed: benchmarks
    try other shapes of a recipe. A field that is not one, or a value that is not an int, is a
    ValueError that names it."""
    fields = {f.name for f in dataclasses.fields(ModelSize)}
    changes = {}
    for item in filter(None, spec.split(",")):
        key, sep, value = item.partition("=")
        if not sep or key not in fields:
            raise ValueError(f"{item!r}: give KEY=N with KEY one of {', '.join(sorted(fields))}")
        try:
            changes[key] = int(value)
        except ValueError:
            raise ValueError(f"{item!r}: {value!r} is not an integer") from None
    return dataclasses.replace(size, **changes)


@dataclass(frozen=True)
class Recipe:
    """A named size: the model shape and the pretraining choices that go with it."""

    size: ModelSize
    steps: int
    n_per_level: int
    lr: float
    teacher_max_level: int
    variant_share: float  # share of code_o/code_i teacher examples that extend a shown reference
    level_refs: bool = False  # teacher references are of the completion's level (variants: anchor's)
    ref_max_chars: int = 400  # longest reference program shown in pretraining prompts
    batch_size: int = 64
    max_len: int = 1024  # longest example in tokens (longer ones are cut at the end)
    pool: int = 0  # > 0: pre-tokenize this many examples, batches by length (`ExamplePool`)
    batch_tokens: int = 81_920  # the pool's batches: most padded tokens (rows x longest row)
    fast_corpus: bool = False  # corpus, variants and pool made by worker processes
    role_weights: tuple[float, ...] | None = None  # per role of ROLES; None: uniform
    student_level_weights: dict[int, float] | None = None  # None: every level alike
    example_alpha: float = 0.0  # loss weight of an example's tokens: n_tokens ** -alpha
    tokenizer_programs: int = 0  # > 0: train the tokenizer on this many programs
    single_chars: str = ""  # characters the tokenizer never merges (`train_tokenizer`)
    levels: str = "standard"  # the level table of the corpus (`grammar.LEVEL_TABLES`)
    max_refs: int = 2  # a teacher prompt shows 0..max_refs references
    # a token budget instead of role/level weights: share of the pool's tokens per role (of
    # ROLES), split over levels by `token_levels[role or "teacher"/"student"]` (`budget_cells`)
    token_shares: dict[str, float] | None = None
    token_levels: dict[str, dict[int, float]] | None = None
    code_f_ns: tuple[int, ...] = CODE_F_NS  # code_f examples ask for one of these many inputs


SIZES: dict[str, Recipe] = {
    # today's shipped model (src/lorapop/assets/tiny), rebuilt exactly by these settings
    "tiny": Recipe(ModelSize(), steps=3000, n_per_level=1000, lr=2e-3, teacher_max_level=3,
                   variant_share=0.0),
    # about 26M parameters, for the regime world on one GPU (~6 minutes on an H100 with 16
    # cores): 120k distinct programs made by worker processes (`lorapop.tiny.corpus`, not the
    # sandbox) and their reference-conditioned variants, so ~520k examples (one pass, no
    # repeats) see each program a few times and the model learns the grammar, not its corpus;
    # references of the completion's level; more student examples, of levels 1-3 above all,
    # weighted by n_tokens ** -0.5, and string literals one token per character, so students
    # can learn to execute; length-bucketed batches of ~80k tokens; 1,500 steps (~6 minutes on
    # an H100)
    "small": Recipe(ModelSize(hidden=512, layers=8, heads=8, kv_heads=4, intermediate=1536),
                    steps=1500, n_per_level=24_000, lr=1.5e-3, teacher_max_level=5,
                    variant_share=0.25, level_refs=True, ref_max_chars=1500, max_len=1536,
                    pool=520_000, batch_tokens=81_920, fast_corpus=True,
                    role_weights=(1, 1, 0.5, 1.5, 1, 1.5),
                    student_level_weights={1: 2, 2: 2, 3: 2, 4: 1, 5: 1},
                    example_alpha=0.5, tokenizer_programs=8000, single_chars=STRING_CHARS),
}  # fmt: skip

# -- the corpus and its examples --------------------------------------------------------------


def build_corpus(
    n_per_level: int, seed: int, sandbox: Sandbox, levels: Sequence[int] = tuple(LEVELS),
    table: str = "standard",
) -> list[Task]:
    """code_f tasks (6 verified pairs + message) of the train split, `n_per_level` per level
    of level table `table`."""
    tasks: list[Task] = []
    for level in table_levels(table, levels):
        tasks += generate_tasks(
            "code_f", n_per_level, level, f"pretrain/{seed}", sandbox=sandbox, batch=256
        )
    return tasks


def as_type(task: Task, kind: str, k: int = 0, n: int | None = None) -> Task:
    """The code_o / code_i task of pair `k` of a code_f corpus task, or its first `n` pairs."""
    if kind == "code_f":
        n = len(task.inputs) if n is None else n
        return Task("code_f", task.program, task.inputs[:n], task.outputs[:n], task.message,
                    meta=task.meta)  # fmt: skip
    return Task(kind, task.program, (task.inputs[k],), (task.outputs[k],), meta=task.meta)


def completion(role: str, task: Task) -> str:
    """The text the family parses for `role` on `task` (no EOS): the gold answer of a student,
    the proposal that recreates `task` for a teacher."""
    who, kind = role.split("/")
    if who == "student":
        if kind == "code_o":
            return f"{task.output}</o>"
        if kind == "code_i":
            return f"{task.input}</i>"
        return f"{task.program}</f>"
    if kind == "code_f":
        return "</i><i>".join(task.inputs) + f"</i><m>{task.message}</m>"
    return f"{task.program}</f><i>{task.input}</i>"


def prompt(role: str, task: Task, refs: Sequence[Task]) -> str:
    """The compact prompt the loop would show for `role` (teachers see `refs`)."""
    who, kind = role.split("/")
    if kind == "code_f":
        fam = get_family("code_f", template="compact", n_inputs=len(task.inputs))
    else:
        fam = get_family(kind, template="compact")
    if who == "student":
        return fam.student_prompt(task)
    return fam.teacher_prompt(refs, task if kind == "code_f" else None)


def _level(task: Task) -> object:
    return task.meta.get("difficulty")


def _by_level(items: Iterable[T], level_of: Callable[[T], object]) -> dict[object, list[T]]:
    """`items` grouped by level, in order of first appearance."""
    out: dict[object, list[T]] = {}
    for x in items:
        out.setdefault(level_of(x), []).append(x)
    return out


class Examples:
    """Draws (prompt, completion) pairs for all six roles from a corpus with one RNG.

    With `variants` ((anchor, variant) pairs) and `variant_share` > 0, that share of code_o /
    code_i teacher examples shows the anchor among the references and completes its variant.
    With `level_refs`, a teacher's references are of its completion's level (a variant's, of
    its anchor's level), so the level of what it writes follows the level of what it is shown.
    `role_weights` (one per role of `ROLES`) and `student_level_weights` (level -> weight)
    skew the mix; without them roles are uniform and students draw programs of every level
    alike. With none of these, the draws are exactly those of the shipped tiny model's recipe.
    `budget` replaces all that by a token budget: each draw picks a (role, level) cell so that
    the cells' expected shares of tokens are the given ones (`draw_cell`).
    """

    def __init__(
        self, corpus: Sequence[Task], rng: random.Random, max_refs: int = 2,
        teacher_max_level: int = 3, ref_max_chars: int = 400,
        variants: Sequence[tuple[Task, Task]] = (), variant_share: float = 0.0,
        level_refs: bool = False, role_weights: Sequence[float] | None = None,
        student_level_weights: Mapping[int, float] | None = None,
        code_f_ns: Sequence[int] = CODE_F_NS,
    ) -> None:  # fmt: skip
        self.rng, self.max_refs, self.level_refs = rng, max_refs, level_refs
        if not code_f_ns or min(code_f_ns) < 2 or max(code_f_ns) > 6:
            raise ValueError("code_f_ns: input counts in 2..6 (the corpus has 6 pairs a program)")
        self.code_f_ns = tuple(code_f_ns)
        self.role_weights = list(role_weights) if role_weights else None
        if self.role_weights is not None and len(self.role_weights) != len(ROLES):
            raise ValueError(f"role_weights: one weight per role of {ROLES}")
        self.variants = [(a, v) for a, v in variants if len(a.program) <= ref_max_chars]
        self.variant_share = variant_share
        self.all = list(corpus)
        easy = [t for t in corpus if (_level(t) or 5) <= teacher_max_level]
        self.teach = easy or self.all
        if not self.all:
            raise ValueError("the corpus is empty")
        short = [t for t in corpus if len(t.program) <= ref_max_chars]
        self.ref_pool = short or self.all
        self.refs_by_level = _by_level(self.ref_pool, _level)
        self.seeds = {k: get_family(k, template="compact").seed_tasks()[0] for k in
                      ("code_o", "code_i")}  # fmt: skip
        by_level = _by_level(self.all, _level)
        weights = {lv: w for lv, w in (student_level_weights or {}).items() if lv in by_level}
        self.student_levels = [by_level[lv] for lv in weights]
        self.student_weights = list(weights.values())
        self.by_level = by_level
        self.variants_by_level = _by_level(self.variants, lambda pair: _level(pair[1]))
        self.cells: list[tuple[str, int]] = []  # the token budget's (role, level) cells
        self.cell_weights: list[float] = []

    def _refs(self, kind: str, n_inputs: int, level: object = None) -> list[Task]:
        pool = self.refs_by_level.get(level) if self.level_refs else None
        pool = pool or self.ref_pool
        k = self.rng.randint(0, self.max_refs)
        refs = []
        for _ in range(k):
            if self.rng.random() < 0.1 and kind != "code_f":
                refs.append(self.seeds[kind])  # the loop's buffers start with AZR's seed task
                continue
            t = self.rng.choice(pool)
            j = self.rng.randrange(len(t.inputs))
            refs.append(as_type(t, kind, j, n_inputs))
        return refs

    def draw(self) -> tuple[str, str, str]:
        """(role, prompt, completion) of one random example."""
        role, _, p, c = self.draw_cell()
        return role, p, c

    def draw_cell(self) -> tuple[str, object, str, str]:
        """(role, level, prompt, completion) of one random example; level: of the program the
        completion is about (a code_f teacher's: of its base program)."""
        if self.cells:
            role, level = self.rng.choices(self.cells, self.cell_weights)[0]
            return role, level, *self._at(role, level)
        if self.role_weights is None:
            role = ROLES[self.rng.randrange(len(ROLES))]
        else:
            role = self.rng.choices(ROLES, self.role_weights)[0]
        who, kind = role.split("/")
        if (who == "teacher" and kind != "code_f" and self.variants and self.variant_share > 0
                and self.rng.random() < self.variant_share):  # fmt: skip
            return role, *self._variant(role, kind)
        if who == "student" and self.student_levels:
            src = self.rng.choice(self.rng.choices(self.student_levels, self.student_weights)[0])
        else:
            src = self.rng.choice(self.teach if who == "teacher" else self.all)
        return role, _level(src), *self._example(role, src)

    def budget(self, shares: Mapping[tuple[str, int], float], tok: PreTrainedTokenizerFast,
               max_len: int, n: int = 64, seed: str = "budget") -> dict[tuple[str, int], float]:  # fmt: skip
        """Draw by token budget from now on: `shares` of tokens per (role, level) cell (rows:
        prompt + completion + EOS, cut at `max_len`, as trained). Each cell's mean row length
        is estimated from `n` draws of its own RNG (`seed`); a cell is then drawn with weight
        share / mean length (`draw_cell`). Returns the means."""
        if not shares or any(w < 0 for w in shares.values()) or not sum(shares.values()) > 0:
            raise ValueError("token shares must be >= 0 with a positive sum")
        for role, level in shares:
            if role not in ROLES or level not in self.by_level:
                raise ValueError(f"no {role} examples at level {level!r} in this corpus")
        keep, self.rng = self.rng, random.Random(seed)
        try:
            means = {cell: float(tokenize_pairs(tok, [self._at(*cell) for _ in range(n)],
                                                max_len)[1].mean()) for cell in shares}  # fmt: skip
        finally:
            self.rng = keep
        self.cells = list(shares)
        self.cell_weights = [shares[c] / means[c] for c in self.cells]
        return means

    def _at(self, role: str, level: int) -> tuple[str, str]:
        """An example of `role` on a program of `level`: for code_o/code_i teachers, with the
        probability `variant_share`, a variant of that level (where there are any)."""
        who, kind = role.split("/")
        pairs = self.variants_by_level.get(level) if who == "teacher" and kind != "code_f" else None
        if pairs and self.variant_share > 0 and self.rng.random() < self.variant_share:
            return self._variant(role, kind, pairs)[1:]
        return self._example(role, self.rng.choice(self.by_level[level]))

    def _example(self, role: str, src: Task) -> tuple[str, str]:
        """(prompt, completion) of `role` on program `src` (a teacher's with references of
        its level)."""
        who, kind = role.split("/")
        n = self.rng.choice(self.code_f_ns)
        task = as_type(src, kind, self.rng.randrange(len(src.inputs)), n)
        refs = self._refs(kind, n, _level(src)) if who == "teacher" else []
        return prompt(role, task, refs), completion(role, task)

    def _variant(self, role: str, kind: str,
                 pairs: Sequence[tuple[Task, Task]] = ()) -> tuple[object, str, str]:  # fmt: skip
        """(level, prompt, completion) of a teacher example whose completion extends one of the
        references it shows."""
        anchor, variant = self.rng.choice(pairs or self.variants)
        task = as_type(variant, kind, self.rng.randrange(len(variant.inputs)))
        refs = self._refs(kind, 0, _level(anchor))[: self.max_refs - 1]
        refs.insert(self.rng.randint(0, len(refs)),
                    as_type(anchor, kind, self.rng.randrange(len(anchor.inputs))))  # fmt: skip
        return _level(variant), prompt(role, task, refs), completion(role, task)


def budget_cells(
    token_shares: Mapping[str, float], token_levels: Mapping[str, Mapping[int, float]] | None,
    levels: Sequence[int], teacher_max_level: int = 5,
) -> dict[tuple[str, int], float]:  # fmt: skip
    """Token shares per (role, level), summing to 1: each role's share (`token_shares`, roles
    of ROLES) split over `levels` by the weights of `token_levels[role]`, else of
    `token_levels["teacher"]` / `["student"]`, else evenly. Teachers stop at
    `teacher_max_level`; cells of weight 0 are left out."""
    unknown = sorted(set(token_shares) - set(ROLES)) + sorted(
        set(token_levels or {}) - {*ROLES, "teacher", "student"})  # fmt: skip
    if unknown:
        raise ValueError(f"token budget: unknown role {unknown[0]!r}; known: {', '.join(ROLES)}")
    cells: dict[tuple[str, int], float] = {}
    for role, share in token_shares.items():
        who = role.split("/")[0]
        spec = (token_levels or {}).get(role) or (token_levels or {}).get(who) or {}
        lvs = [lv for lv in levels if who == "student" or lv <= teacher_max_level]
        ws = {lv: float(spec.get(lv, 0.0)) if spec else 1.0 for lv in lvs}
        if any(w < 0 for w in ws.values()) or share < 0:
            raise ValueError("token budget: shares and level weights must be >= 0")
        total = sum(ws.values())
        for lv, w in ws.items():
            if share > 0 and w > 0:
                cells[(role, lv)] = share * w / total
    total = sum(cells.values())
    if not total > 0:
        raise ValueError("token budget: no cell with a positive share")
    return {c: w / total for c, w in cells.items()}


def encode(
    tok: PreTrainedTokenizerFast, pairs: Sequence[tuple[str, str]], max_len: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask, labels), right-padded; labels are -100 outside completions.

    Prompt and completion are tokenized apart, as at sampling time (the prompt alone is
    encoded and the model continues it). Rows longer than `max_len` are cut at the end.
    """
    ps = tok([p for p, _ in pairs], add_special_tokens=False)["input_ids"]
    cs = tok([c for _, c in pairs], add_special_tokens=False)["input_ids"]
    rows = [(p + c + [tok.eos_token_id])[:max_len] for p, c in zip(ps, cs, strict=True)]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tok.pad_token_id, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (r, p) in enumerate(zip(rows, ps, strict=True)):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
        labels[i, len(p) : len(r)] = ids[i, len(p) : len(r)]
    return ids, mask, labels


def recipe_tokenizer(programs: Sequence[Task], vocab_size: int, tokenizer_programs: int = 0,
                     single_chars: str = "") -> PreTrainedTokenizerFast:  # fmt: skip
    """The BPE tokenizer of a recipe: trained on the texts of `programs` (every one, or about
    `tokenizer_programs` spread over them), never merging `single_chars`."""
    progs = list(programs)
    if 0 < tokenizer_programs < len(progs):
        progs = progs[:: math.ceil(len(progs) / tokenizer_programs)]
    texts = list(corpus_texts([as_type(t, k) for t in progs for k in ("code_o", "code_i")]))
    texts += list(corpus_texts(progs))
    return train_tokenizer(texts, vocab_size=vocab_size, single_chars=single_chars)


# -- the model --------------------------------------------------------------------------------


def build_model(tok: PreTrainedTokenizerFast, size: ModelSize, seed: int) -> torch.nn.Module:
    """A Qwen2 with tied embeddings sized to the tokenizer, initialised from `seed`."""
    return random_qwen2(
        tok, seed, hidden=size.hidden, intermediate=size.intermediate, layers=size.layers,
        heads=size.heads, kv_heads=size.kv_heads, max_positions=size.max_positions,
        dtype=torch.float32,
    )  # fmt: skip


def _check_cpu_batch(size: ModelSize, batch_tokens: int) -> None:
    """A one-line error before any work when one batch cannot train in the host's memory: the
    kernel would otherwise kill the build mid-way without a word (a GPU recipe on a laptop).
    The update's estimate is 10-20% under what a CPU build keeps (measured: 834-935 KB a token
    at 77M against 768, 415 against 368 at 26M), so only what surely does not fit is refused."""
    per_token = activation_bytes_per_token(size.layers, size.hidden, size.intermediate,
                                           size.kv_heads, size.hidden // size.heads, 4)
    need, free = batch_tokens * per_token, host_free_memory()
    if free is not None and need > free:
        raise ValueError(f"one batch of {batch_tokens:,} tokens needs ~{need / 2**30:.0f} GiB to "
                         f"train this model on the CPU, and {free / 2**30:.0f} GiB are free: "
                         f"build it on a GPU (--device cuda)")


def lr_at(step: int, steps: int, lr: float, warmup: int) -> float:
    """Linear warm-up, then cosine down to a tenth."""
    if step < warmup:
        return lr * (step + 1) / warmup
    frac = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


Rows = tuple[np.ndarray, np.ndarray, np.ndarray, int]  # tokens, lengths, prompt lengths, cut


def tokenize_pairs(tok: PreTrainedTokenizerFast, pairs: Sequence[tuple[str, str]],
                   max_len: int) -> Rows:  # fmt: skip
    """(prompt + completion + EOS) of every pair, cut at `max_len`, stored flat (int32).

    Prompt and completion are tokenized apart, as at sampling time; `cut` counts cut rows."""
    ps = tok([p for p, _ in pairs], add_special_tokens=False)["input_ids"]
    cs = tok([c for _, c in pairs], add_special_tokens=False)["input_ids"]
    eos = [tok.eos_token_id]
    lengths = [min(len(p) + len(c) + 1, max_len) for p, c in zip(ps, cs, strict=True)]
    cut = sum(len(p) + len(c) + 1 > max_len for p, c in zip(ps, cs, strict=True))
    flat = np.fromiter(itertools.chain.from_iterable(
        (p + c + eos)[:max_len] for p, c in zip(ps, cs, strict=True)),
        dtype=np.int32, count=sum(lengths))  # fmt: skip
    prompt_lens = np.minimum([len(p) for p in ps], lengths).astype(np.int32)
    return flat, np.asarray(lengths, dtype=np.int32), prompt_lens, cut


#: What forked `draw_rows` workers draw from (set in the parent just before the fork).
_DRAW: dict[str, object] = {}


def _draw_chunk(k: int, n: int) -> Rows:
    examples, tok = _DRAW["examples"], _DRAW["tok"]
    assert isinstance(examples, Examples) and isinstance(tok, PreTrainedTokenizerFast)
    examples.rng = random.Random(f"{_DRAW['seed']}/{k}")
    pairs = [examples.draw()[1:] for _ in range(n)]
    return tokenize_pairs(tok, pairs, int(_DRAW["max_len"]))  # type: ignore[arg-type]


def draw_rows(examples: Examples, tok: PreTrainedTokenizerFast, n: int, max_len: int,
              seed: str, workers: int = 1, chunk: int = 4096) -> Rows:  # fmt: skip
    """`n` examples drawn and tokenized in chunks of `chunk`: chunk k from
    `random.Random(f"{seed}/{k}")`, so the rows do not depend on `workers` (forked processes)."""
    sizes = [min(chunk, n - s) for s in range(0, n, chunk)]
    _DRAW.update(examples=examples, tok=tok, seed=seed, max_len=max_len)
    env = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # no rayon in forked workers (nor its warning)
    try:
        if workers <= 1:
            parts = [_draw_chunk(k, m) for k, m in enumerate(sizes)]
        else:
            with ProcessPoolExecutor(workers, mp_context=get_context("fork")) as pool:
                parts = list(pool.map(_draw_chunk, range(len(sizes)), sizes))
    finally:
        _DRAW.clear()
        if env is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = env
    return (np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]),
            np.concatenate([p[2] for p in parts]), sum(p[3] for p in parts))  # fmt: skip


class ExamplePool:
    """Examples drawn once, tokenized once and stored flat; batches are gathered by index.

    Each epoch is a permutation of the rows from `seed`, sorted by length within windows of
    16384 rows and cut into batches of at most `batch_tokens` padded tokens (rows x longest
    row; many short rows or a few long ones, so memory is bounded), the batches then shuffled:
    a batch is padded to little more than its own longest row, and the order is a function of
    `seed`. Rows longer than `max_len` are cut at the end (`cut` counts them).
    """

    def __init__(self, tok: PreTrainedTokenizerFast, pairs: Sequence[tuple[str, str]],
                 max_len: int, batch_tokens: int, seed: int) -> None:  # fmt: skip
        self._setup(*tokenize_pairs(tok, pairs, max_len), tok.pad_token_id, batch_tokens, seed)

    @classmethod
    def from_rows(cls, rows: Rows, pad: int, batch_tokens: int, seed: int) -> ExamplePool:
        """A pool of rows already tokenized (`tokenize_pairs`, `draw_rows`)."""
        pool = cls.__new__(cls)
        pool._setup(*rows, pad, batch_tokens, seed)
        return pool

    def _setup(self, tokens: np.ndarray, lengths: np.ndarray, prompt_lens: np.ndarray, cut: int,
               pad: int, batch_tokens: int, seed: int) -> None:  # fmt: skip
        if not len(lengths) or batch_tokens < int(lengths.max()):
            raise ValueError("need examples, and batch_tokens >= the longest row")
        self.tokens = torch.from_numpy(tokens.astype(np.int64))
        self.lengths = torch.from_numpy(lengths.astype(np.int64))
        self.prompt_lens = torch.from_numpy(prompt_lens.astype(np.int64))
        self.offsets = torch.cumsum(self.lengths, 0) - self.lengths
        self.cut, self.batch_tokens, self.pad = cut, batch_tokens, pad
        self.gen = torch.Generator().manual_seed(seed)

    def to(self, device: torch.device) -> ExamplePool:
        for k in ("tokens", "lengths", "prompt_lens", "offsets"):
            setattr(self, k, getattr(self, k).to(device))
        return self

    def _epoch(self) -> list[torch.Tensor]:
        lengths = self.lengths.cpu()
        batches = []
        for w in torch.randperm(len(lengths), generator=self.gen).split(16384):
            w = w[torch.argsort(lengths[w], stable=True)]
            start = 0
            for i, width in enumerate(lengths[w].tolist()):  # ascending: the last is the widest
                if (i + 1 - start) * width > self.batch_tokens:
                    batches.append(w[start:i])
                    start = i
            batches.append(w[start:])
        order = torch.randperm(len(batches), generator=self.gen).tolist()
        return [batches[i] for i in order]

    def batches(self, steps: int) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """`steps` batches of (input_ids, attention_mask, labels) on the pool's device."""
        dev, done = self.tokens.device, 0
        lengths = self.lengths.cpu()
        while done < steps:
            epoch = self._epoch()[: steps - done]
            # one copy of the pass's row indices: a copy per batch would wait for the GPU to
            # finish the step before, so the host could not queue the next one meanwhile
            on_dev = torch.cat(epoch).to(dev).split([len(rows) for rows in epoch])
            for cpu_rows, rows in zip(epoch, on_dev, strict=True):
                width = int(lengths[cpu_rows].max())
                pos = torch.arange(width, device=dev)[None, :]
                inside = pos < self.lengths[rows, None]
                at = (self.offsets[rows, None] + pos).clamp_(max=len(self.tokens) - 1)
                ids = torch.where(inside, self.tokens[at], self.pad)
                labels = torch.where(inside & (pos >= self.prompt_lens[rows, None]), ids, -100)
                yield ids, inside.long(), labels
                done += 1


def _example_weights(labels: torch.Tensor, alpha: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: completion tokens n (after the shift) and the weight n ** -alpha."""
    n = (labels[:, 1:] != -100).sum(1)
    return n, n.clamp(min=1).float().pow(-alpha)


def example_weighted_loss(logits: torch.Tensor, labels: torch.Tensor, alpha: float,
                          total: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """Completion-token cross-entropy, each example's tokens weighted by n ** -alpha (n: its
    completion tokens), normalised by the weights. alpha 0 is the plain token mean, where a
    300-token program outweighs a 5-token output 60 to 1 and students barely learn to execute;
    alpha 1 is the mean of per-example means. `total`: the normaliser of the whole batch when
    these rows are one rank's share of it (`batch_total`), so the ranks' losses sum to it."""
    y = labels[:, 1:]
    ce = torch.nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(), y.flatten(), ignore_index=-100, reduction="none"
    ).view_as(y)  # fmt: skip
    n, w = _example_weights(labels, alpha)
    return (ce.sum(1) * w).sum() / (total if total is not None else (n * w).sum()).clamp(min=1e-9)


def batch_total(labels: torch.Tensor, alpha: float) -> torch.Tensor:
    """The whole batch's loss normaliser: its completion tokens, each weighted by n ** -alpha."""
    n, w = _example_weights(labels, alpha)
    return (n * w).sum()


def rank_share(batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor], world: dist.World,
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """This rank's rows of a batch: every `world.size`-th, so the ranks' tokens balance (a
    batch's rows are of similar lengths: no trimming, and no host sync to find a width)."""
    ids, mask, labels = batch
    return ids[world.rank :: world.size], mask[world.rank :: world.size], labels[world.rank :: world.size]


def _all_reduce_grads(params: Sequence[torch.nn.Parameter], world: dist.World) -> None:
    """Sum the ranks' gradients (one flat all-reduce; a rank without rows adds zeros)."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce_sum(flat, world)
    for p, g in zip(params, flat.split([g.numel() for g in grads]), strict=True):
        p.grad = g.view_as(p)


def optimizer(model: torch.nn.Module, lr: float, device: torch.device) -> torch.optim.Optimizer:
    """AdamW, weight decay on matrices only; fused on CUDA. Params must be on `device`."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    other = [p for p in model.parameters() if p.ndim < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
        lr=lr, betas=(0.9, 0.95), fused=device.type == "cuda" or None,
    )  # fmt: skip


#: Steps between a data-parallel build's `stop` polls (each one syncs the ranks with the host).
STOP_POLL = 10


def kernel_probe(model: torch.nn.Module, device: torch.device, attention_mask: bool
                 ) -> Callable[[], None]:  # fmt: skip
    """One forward and backward of `train`'s kernels on a 2 x 16 batch (the same autocast, a
    padded position when training passes masks, the losses' cross-entropies); gradients
    dropped, weights untouched."""

    def probe() -> None:
        ids = torch.arange(32, device=device).remainder(model.config.vocab_size).view(2, 16)
        mask = torch.ones_like(ids)
        mask[0, -1] = 0
        model.train()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda"):
            out = model(input_ids=ids, attention_mask=mask if attention_mask else None,
                        use_cache=False)  # fmt: skip
        logits, target = out.logits.float().flatten(0, 1), ids.flatten()  # both losses' kernels
        ce = torch.nn.functional.cross_entropy
        (ce(logits, target, reduction="none").mean() + ce(logits, target)).backward()
        model.zero_grad(set_to_none=True)

    return probe


def weights_digest(model: torch.nn.Module) -> str:
    """SHA-256 of the parameters' bytes in order (the first 16 hex digits): two builds of one
    base compare by it (`training.json`, the build's last log line)."""
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def train(
    model: torch.nn.Module,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    steps: int,
    device: torch.device,
    *,
    lr: float = 2e-3,
    warmup: int = 100,
    log_every: int = 50,
    log: Callable[[str], None] | None = None,
    attention_mask: bool = True,
    example_alpha: float = 0.0,
    every: tuple[int, Callable[[int], None]] | None = None,
    opt: torch.optim.Optimizer | None = None,
    start: int = 0,
    stop: Callable[[int], bool] | None = None,
    world: dist.World = dist.SINGLE,
) -> list[float]:
    """AdamW on the completion-token mean loss of steps `start`..`steps` - 1, one batch each;
    returns each of those steps' loss.

    On CUDA: bf16 autocast, fused AdamW, and the loss read back only at log steps (no sync
    per step). `attention_mask=False` drops the batches' masks: rows are right-padded, so
    under the causal mask no real token sees padding (whose labels are -100), and attention
    runs as plain causal SDPA (flash kernels) instead of a masked one. `example_alpha` > 0
    weights examples (`example_weighted_loss`) instead of taking the plain token mean.
    `every=(n, fn)` calls fn(steps done) after every n-th step and the last (a learning curve;
    fn gets the model in train mode and must leave it so). A build that resumes passes its
    optimizer (`optimizer`, state loaded) and `start`, with the batches from `start` on;
    `stop(steps done)` is asked after each step, and True ends training there. A loss that is
    not finite at a step whose loss is read back (log, `every`, stop and last steps) raises
    FloatingPointError, so no NaN model or partial state is saved.

    Data parallel (`world` of several ranks, every rank given the same batches): each rank
    trains on its share of a batch's rows (`rank_share`) with the whole batch's normaliser, the
    gradients are summed, so every rank takes the step one process takes on the whole batch
    (to float rounding). `stop` is then asked every `STOP_POLL` steps and rank 0's answer
    holds on every rank."""
    model.to(device).train()
    amp = device.type == "cuda"
    opt = opt or optimizer(model, lr, device)
    params = [p for p in model.parameters() if p.requires_grad]
    losses: list[torch.Tensor] = []
    t0 = time.perf_counter()
    for step, batch in zip(range(start, steps), batches, strict=False):
        ids, mask, labels = (x.to(device, non_blocking=True) for x in batch)
        if world.distributed:
            total = batch_total(labels, example_alpha)
            ids, mask, labels = rank_share((ids, mask, labels), world)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, lr, warmup)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
            kw = {"input_ids": ids, "attention_mask": mask if attention_mask else None,
                  "use_cache": False}  # fmt: skip
            if world.distributed:
                loss = (example_weighted_loss(model(**kw).logits, labels, example_alpha, total)
                        if len(ids) else torch.zeros((), device=device))  # fmt: skip
            elif example_alpha:
                loss = example_weighted_loss(model(**kw).logits, labels, example_alpha)
            else:
                loss = model(**kw, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        if loss.requires_grad:
            loss.backward()
        if world.distributed:
            _all_reduce_grads(params, world)
            loss = loss.detach().clone()
            dist.all_reduce_sum(loss, world)  # the whole batch's loss
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.detach())
        logged = bool(log) and (step % log_every == 0 or step == steps - 1)
        scored = bool(every) and ((step + 1) % every[0] == 0 or step == steps - 1)
        stopping = (stop is not None and step + 1 < steps
                    and (not world.distributed or (step + 1) % STOP_POLL == 0)
                    and dist.broadcast(stop(step + 1), world))  # fmt: skip
        if logged or scored or stopping or step == steps - 1:  # no sync on the other steps
            _check_finite(losses[-1], step, lr)
        if logged:
            log(f"step {step:5d}  loss {float(losses[-1]):.4f}  {time.perf_counter() - t0:6.1f}s")
        if scored:
            every[1](step + 1)
        if stopping:
            break
    model.eval()
    return [float(x) for x in torch.stack(losses).float().cpu().tolist()] if losses else []


def _check_finite(loss: torch.Tensor, step: int, lr: float) -> None:
    """A diverged run stops here rather than training (and saving) a NaN model."""
    if not torch.isfinite(loss):
        raise FloatingPointError(f"the training loss is {float(loss)} at step {step} (lr {lr:g}): "
                                 "training diverged; try a lower learning rate")


# -- the whole recipe ---------------------------------------------------------------------------


def pretrain_tiny(
    out_dir: str | Path,
    seed: int = 0,
    steps: int = 3000,
    device: str = "auto",
    *,
    n_per_level: int = 1000,
    vocab_size: int = 2048,
    size: ModelSize | None = None,
    batch_size: int = 64,
    lr: float = 2e-3,
    teacher_max_level: int = 3,
    variant_share: float = 0.0,
    level_refs: bool = False,
    ref_max_chars: int = 400,
    max_len: int = 1024,
    pool: int = 0,
    batch_tokens: int = 81_920,
    fast_corpus: bool = False,
    role_weights: Sequence[float] | None = None,
    student_level_weights: Mapping[int, float] | None = None,
    example_alpha: float = 0.0,
    tokenizer_programs: int = 0,
    single_chars: str = "",
    levels: str = "standard",
    max_refs: int = 2,
    token_shares: Mapping[str, float] | None = None,
    token_levels: Mapping[str, Mapping[int, float]] | None = None,
    code_f_ns: Sequence[int] = CODE_F_NS,
    workers: int = 2,
    corpus: Sequence[Task] | None = None,
    command: str | None = None,
    log: Callable[[str], None] | None = print,
    stop: Callable[[int], bool] | None = None,
    world: dist.World = dist.SINGLE,
) -> dict:
    """Build the corpus, train the tokenizer and the model, save both into `out_dir`.

    `out_dir` gets config.json, model.safetensors, generation_config.json, the tokenizer
    files and training.json (the record returned: seed, steps, device, final loss, loss curve,
    corpus fingerprint, versions). `corpus` skips generation (tests); `workers` sizes the
    sandbox that verifies generated programs; `command` is recorded as given (default: argv).
    `variant_share` > 0 adds reference-conditioned teacher examples, `level_refs` shows
    references of the completion's level (see `Examples`). `pool` > 0 draws that many examples
    once and trains on length-bucketed batches of them (`ExamplePool`, the GPU path); 0 draws
    every batch afresh (the shipped tiny model's path): `batch_size` rows a batch, where the
    pool's batches hold up to `batch_tokens` padded tokens. `fast_corpus` generates the corpus
    and variants in `workers` processes (`lorapop.tiny.corpus`) instead of the sandbox, and the
    pool is drawn by `workers` forked processes; `role_weights`, `student_level_weights` skew
    the example mix (`Examples`), `example_alpha` the loss (`example_weighted_loss`);
    `tokenizer_programs` > 0 trains the tokenizer on that many programs spread over the corpus,
    never merging `single_chars` (`train_tokenizer`). `levels` names the corpus's level table
    (`grammar.LEVEL_TABLES`); `max_refs` bounds the references of a teacher prompt;
    `code_f_ns` are the input counts code_f examples ask for (a world's `tasks.code_f_inputs`).
    `token_shares` (with `token_levels`, see `budget_cells`) draws examples by a token budget
    per role and level instead of the weights above (`Examples.budget`) into a pool of `pool`
    examples, or with `pool` 0 of about `steps` x `batch_tokens` tokens (one pass).
    Training on CPU is bit-for-bit reproducible; on GPU, kernels may add float noise.

    A build that must end early stops where `stop(steps done)` says so and
    keeps its training state in `out_dir/partial` (the returned record has `stopped_at`); the
    same call again remakes the corpus, tokenizer and batches from the seed, loads that state
    and goes on, ending with the model an uninterrupted build makes. A partial build of other
    settings is refused.

    Under torchrun (`world` of several ranks, e.g. one per GPU) rank 0 makes the corpus and the
    pool and sends them to the others, every rank trains on its share of each batch (`train`),
    and rank 0 alone writes files; the partial state is the same whatever the number of ranks,
    so a build may go on with another.
    """
    settings = json.dumps({k: v.__dict__ if isinstance(v, ModelSize) else v
                           for k, v in locals().items()
                           if k not in ("out_dir", "device", "workers", "corpus", "command", "log",
                                        "stop", "world")}, sort_keys=True, default=str)  # fmt: skip
    if steps < 1 or n_per_level < 1 or batch_size < 1 or pool < 0:
        raise ValueError("steps, n_per_level and batch_size must be >= 1, pool >= 0")
    if not 0.0 <= variant_share <= 1.0 or teacher_max_level not in LEVELS:
        raise ValueError("variant_share must be in [0, 1] and teacher_max_level in 1..5")
    if max_refs < (1 if variant_share > 0 else 0):
        raise ValueError("max_refs must be >= 0, and >= 1 with variants (they show their anchor)")
    table_levels(levels)  # an unknown level table fails here, before any work
    cells = budget_cells(token_shares, token_levels, tuple(LEVELS),
                         teacher_max_level) if token_shares else None  # fmt: skip
    size = size or ModelSize()
    dev = resolve_device(device)  # ModelLoadError (one line) for cuda without a GPU
    if dev.type == "cpu" and (pool or token_shares):  # batches of up to batch_tokens tokens
        _check_cpu_batch(size, batch_tokens)
    t0 = time.perf_counter()
    variants: list[tuple[Task, Task]] = []
    def anchors(tasks: Sequence[Task]) -> list[Task]:  # variants extend programs of levels 1-3
        return [t for t in tasks if (_level(t) or 5) <= 3]

    if world.main and fast_corpus:  # (other ranks get rank 0's corpus below)
        if corpus is None:
            corpus = generate_corpus(n_per_level, f"pretrain/{seed}", workers=workers, log=log,
                                     levels=table_levels(levels))  # fmt: skip
        if variant_share > 0:
            variants = generate_variants_fast(anchors(corpus), f"pretrain/{seed}",
                                              workers=workers, table=levels)  # fmt: skip
    elif world.main and (corpus is None or variant_share > 0):
        with Sandbox(workers=workers, timeout_s=2.0) as sb:
            corpus = build_corpus(n_per_level, seed, sb, table=levels) if corpus is None else corpus
            if variant_share > 0:
                variants = generate_variants(anchors(corpus), f"pretrain/{seed}", sb, table=levels)
    corpus, variants = dist.broadcast((list(corpus or []), variants), world)
    t_corpus = time.perf_counter() - t0
    if log:
        log(f"corpus: {len(corpus)} programs, {len(variants)} variants in {t_corpus:.1f}s")
    tok = recipe_tokenizer(corpus + [v for _, v in variants], vocab_size, tokenizer_programs,
                           single_chars)  # fmt: skip
    model = build_model(tok, size, seed)
    examples = Examples(corpus, random.Random(f"pretrain/{seed}"), teacher_max_level=teacher_max_level,
                        variants=variants, variant_share=variant_share, level_refs=level_refs,
                        ref_max_chars=ref_max_chars, role_weights=role_weights,
                        student_level_weights=student_level_weights, max_refs=max_refs,
                        code_f_ns=code_f_ns)  # fmt: skip
    budget = None
    if cells:
        means = examples.budget(cells, tok, max_len, seed=f"pretrain/{seed}/budget")
        per_token = sum(w / means[c] for c, w in cells.items())  # examples per token
        pool = pool or max(1, round(steps * batch_tokens * per_token))
        budget = {"cells": {f"{r}@{lv}": {"share": round(w, 4), "mean_tokens": round(means[(r, lv)], 1),
                                          "example_share": round(w / means[(r, lv)] / per_token, 4)}
                            for (r, lv), w in cells.items()},
                  "mean_tokens_per_example": round(1 / per_token, 1)}  # fmt: skip
        if log:
            log(f"token budget: {len(cells)} cells, {1 / per_token:.0f} tokens per example")
    if pool:
        t1 = time.perf_counter()
        rows = share_rows(draw_rows(examples, tok, pool, max_len, f"pretrain/{seed}",
                                    workers=workers if fast_corpus else 1)
                          if world.main else None, world, dev)  # fmt: skip
        data = ExamplePool.from_rows(rows, tok.pad_token_id, batch_tokens, seed).to(dev)
        pool_info = {"examples": pool, "tokens": len(data.tokens), "cut_rows": data.cut,
                     # (counting draws one pass's order from the pool's seeded generator)
                     "batch_tokens": batch_tokens, "batches_per_pass": len(data._epoch()),
                     "seconds": round(time.perf_counter() - t1, 1)}  # fmt: skip
        if log:
            log(f"pool: {pool} examples, {len(data.tokens)} tokens, {data.cut} cut at {max_len} "
                f"in {pool_info['seconds']}s")
        batches: Iterable = data.batches(steps)
    else:
        pool_info = None
        batches = (encode(tok, [examples.draw()[1:] for _ in range(batch_size)], max_len)
                   for _ in range(steps))  # fmt: skip
    out = Path(out_dir)
    part = Partial(out / "partial", settings, fingerprint(corpus))
    model.to(dev)
    opt = optimizer(model, lr, dev)
    start, losses, t_before = part.load(model, opt, log)
    t_train = time.perf_counter()
    with deterministic_kernels(kernel_probe(model, dev, attention_mask=not pool)) as missing:
        if missing and log:
            log(f"no deterministic kernel ({missing}): rebuilds may differ in rounding")
        losses += train(model, itertools.islice(batches, start, None), steps, dev, lr=lr, log=log,
                        attention_mask=not pool, example_alpha=example_alpha, opt=opt,
                        start=start, stop=stop, world=world)  # fmt: skip
    t_train = time.perf_counter() - t_train + t_before
    # rank 0 writes while the others wait, so no rank closes its process group while rank 0
    # still writes (a 2-rank CPU test's rank 1 once aborted at exit, gloo)
    if len(losses) < steps:
        if world.main:
            part.save(model, opt, losses, t_train)
        dist.barrier(world)
        return {"stopped_at": len(losses), "steps": steps, "partial": str(part.dir)}
    if world.main:
        out.mkdir(parents=True, exist_ok=True)
        model.to("cpu").save_pretrained(str(out), safe_serialization=True)
        save_tokenizer(tok, out)
        part.remove()
    record = {
        "seed": seed,
        "steps": steps,
        "device": str(dev),
        "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "ranks": world.size,
        "command": command or " ".join(sys.argv),
        "batch_size": None if pool else batch_size,  # the pool's batches: batch_tokens
        "lr": lr,
        "n_per_level": n_per_level,
        "teacher_max_level": teacher_max_level,
        "variant_share": variant_share,
        "variants": len(variants),
        "fast_corpus": fast_corpus,
        "role_weights": list(role_weights) if role_weights else None,
        "student_level_weights": dict(student_level_weights or {}) or None,
        "example_alpha": example_alpha,
        "single_chars": single_chars,
        "levels": levels,
        "max_refs": max_refs,
        "code_f_ns": list(code_f_ns),
        "token_budget": budget,
        "level_refs": level_refs,
        "ref_max_chars": ref_max_chars,
        "max_len": max_len,
        "pool": pool_info,
        "vocab_size": len(tok),
        "size": size.__dict__,
        "parameters": sum(p.numel() for p in model.parameters()),
        "corpus_programs": len(corpus),
        "corpus_fingerprint": part.corpus,
        "final_loss": sum(losses[-50:]) / len(losses[-50:]),
        "weights_sha256": weights_digest(model),
        "deterministic_kernels": missing is None,
        "no_deterministic_kernel": missing,  # the op's error: rebuilds may differ in rounding
        "loss_curve": {str(i): round(x, 4) for i, x in enumerate(losses) if i % 50 == 0},
        "corpus_s": round(t_corpus, 1),
        "train_s": round(t_train, 1),
        "resumed_at": part.resumed_at,
        "step_ms": round(1000 * t_train / steps, 1),
        "total_s": round(time.perf_counter() - t0, 1),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "python": platform.python_version()},  # fmt: skip
    }
    if world.main:
        (out / "training.json").write_text(json.dumps(record, indent=1) + "\n")
    dist.barrier(world)
    return record


def share_rows(rows: Rows | None, world: dist.World, device: torch.device) -> Rows:
    """Rank 0's rows (None elsewhere) on every rank, sent as tensors on `device` (NCCL moves
    GPU memory)."""
    if not world.distributed:
        assert rows is not None
        return rows
    n_tokens, n_rows, cut = dist.broadcast(rows and (len(rows[0]), len(rows[1]), rows[3]), world)
    parts = ([torch.from_numpy(a).to(device) for a in rows[:3]] if rows is not None else
             [torch.empty(n, dtype=torch.int32, device=device) for n in (n_tokens, n_rows, n_rows)])
    for t in parts:
        dist.broadcast_tensor(t, world)
    tokens, lengths, prompt_lens = (t.cpu().numpy() for t in parts)
    return tokens, lengths, prompt_lens, cut


def pretrain_size(
    out_dir: str | Path, size: str = "tiny", seed: int = 0, device: str = "auto",
    world: dist.World = dist.SINGLE, sizes: Mapping[str, Recipe] = SIZES, **kwargs: object,
) -> dict:  # fmt: skip
    """`pretrain_tiny` with the settings of `sizes[size]` (the package's `SIZES` unless a caller
    brings its own recipes). A keyword named as a `Recipe` field overrides it (None keeps the
    recipe's); others (workers, command, log, corpus) pass on."""
    if size not in sizes:
        raise ValueError(f"unknown size {size!r}; known: {', '.join(sizes)}")
    fields = {f.name for f in dataclasses.fields(Recipe)}
    r = dataclasses.replace(sizes[size], **{k: v for k, v in kwargs.items()
                                             if k in fields and v is not None})  # fmt: skip
    rest = {k: v for k, v in kwargs.items() if k not in fields}
    record = pretrain_tiny(out_dir, seed, device=device, **dataclasses.asdict(r) | {"size": r.size},
                           world=world, **rest)  # type: ignore[arg-type]  # fmt: skip
    if "stopped_at" in record:  # no model yet: `out_dir/partial` holds the state
        return record
    record["size_name"] = size
    if world.main:
        (Path(out_dir) / "training.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lorapop.tiny.pretrain", description=__doc__)
    p.add_argument("--out", required=True,
                   help=f"model directory (the shipped one is {TINY_MODEL_DIR})")
    p.add_argument("--size", default="tiny", choices=sorted(SIZES))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, help="default: the size's recipe")
    p.add_argument("--device", default="auto")
    p.add_argument("--n-per-level", type=int, help="default: the size's recipe")
    p.add_argument("--batch-size", type=int, help="default: the size's recipe")
    p.add_argument("--lr", type=float, help="default: the size's recipe")
    p.add_argument("--pool", type=int, help="pool examples (pool recipes); default: the recipe's")
    p.add_argument("--workers", type=int, default=2,
                   help="processes making the corpus (sandbox or worker processes) and the pool")
    a = p.parse_args(argv)
    args = sys.argv[1:] if argv is None else list(argv)
    rec = pretrain_size(a.out, a.size, a.seed, a.device, steps=a.steps, n_per_level=a.n_per_level,
                        lr=a.lr, batch_size=a.batch_size, pool=a.pool, workers=a.workers,
                        command=" ".join(["python -m lorapop.tiny.pretrain", *args]))  # fmt: skip
    print(f"saved to {a.out}: final loss {rec['final_loss']:.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
