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
raise difficulty.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import platform
import random
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import PreTrainedTokenizerFast

from lorapop.engine.model import TINY_DIR, random_qwen2, resolve_device
from lorapop.tasks import Task, get_family
from lorapop.tiny.generator import generate_tasks, generate_variants
from lorapop.tiny.grammar import LEVELS
from lorapop.tiny.heldout import fingerprint
from lorapop.tiny.tokenizer import corpus_texts, save_tokenizer, train_tokenizer
from lorapop.verify import Sandbox

#: Where the shipped model lives (package data).
TINY_MODEL_DIR = TINY_DIR  # where the shipped model lives (model name `tiny`)
ROLES = (
    "teacher/code_o", "teacher/code_i", "teacher/code_f",
    "student/code_o", "student/code_i", "student/code_f",
)  # fmt: skip
#: code_f teacher prompts ask for this many inputs (the corpus has 6 pairs per program).
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


SIZES: dict[str, Recipe] = {
    # today's shipped model (src/lorapop/assets/tiny), rebuilt exactly by these settings
    "tiny": Recipe(ModelSize(), steps=3000, n_per_level=1000, lr=2e-3, teacher_max_level=3,
                   variant_share=0.0),
    # about 26M parameters, for the regime world on one GPU (~6 minutes on an H100):
    # references of the completion's level (level 5 programs are ~330 tokens, so longer
    # references and rows), a pre-tokenized pool in length-bucketed batches of ~80k tokens
    # (~250 rows); steps sized to fit one 9-minute GPU call with the regime measurement
    "small": Recipe(ModelSize(hidden=512, layers=8, heads=8, kv_heads=4, intermediate=1536),
                    steps=1400, n_per_level=1000, lr=1e-3, teacher_max_level=5,
                    variant_share=0.5, level_refs=True, ref_max_chars=1500, max_len=1536,
                    pool=120_000, batch_tokens=81_920),
}  # fmt: skip


# -- the corpus and its examples --------------------------------------------------------------


def build_corpus(
    n_per_level: int, seed: int, sandbox: Sandbox, levels: Sequence[int] = tuple(LEVELS)
) -> list[Task]:
    """code_f tasks (6 verified pairs + message) of the train split, `n_per_level` per level."""
    tasks: list[Task] = []
    for level in levels:
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


class Examples:
    """Draws (prompt, completion) pairs for all six roles from a corpus with one RNG.

    With `variants` ((anchor, variant) pairs) and `variant_share` > 0, that share of code_o /
    code_i teacher examples shows the anchor among the references and completes its variant.
    With `level_refs`, a teacher's references are of its completion's level (a variant's, of
    its anchor's level), so the level of what it writes follows the level of what it is shown.
    With neither, the draws are exactly those of the shipped tiny model's recipe.
    """

    def __init__(
        self, corpus: Sequence[Task], rng: random.Random, max_refs: int = 2,
        teacher_max_level: int = 3, ref_max_chars: int = 400,
        variants: Sequence[tuple[Task, Task]] = (), variant_share: float = 0.0,
        level_refs: bool = False,
    ) -> None:  # fmt: skip
        self.rng, self.max_refs, self.level_refs = rng, max_refs, level_refs
        self.variants = [(a, v) for a, v in variants if len(a.program) <= ref_max_chars]
        self.variant_share = variant_share
        self.all = list(corpus)
        easy = [t for t in corpus if (t.meta.get("difficulty") or 5) <= teacher_max_level]
        self.teach = easy or self.all
        if not self.all:
            raise ValueError("the corpus is empty")
        short = [t for t in corpus if len(t.program) <= ref_max_chars]
        self.ref_pool = short or self.all
        self.refs_by_level: dict[object, list[Task]] = {}
        for t in self.ref_pool:
            self.refs_by_level.setdefault(t.meta.get("difficulty"), []).append(t)
        self.seeds = {k: get_family(k, template="compact").seed_tasks()[0] for k in
                      ("code_o", "code_i")}  # fmt: skip

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
        role = ROLES[self.rng.randrange(len(ROLES))]
        who, kind = role.split("/")
        if (who == "teacher" and kind != "code_f" and self.variants and self.variant_share > 0
                and self.rng.random() < self.variant_share):  # fmt: skip
            return role, *self._variant(role, kind)
        src = self.rng.choice(self.teach if who == "teacher" else self.all)
        n = self.rng.choice(CODE_F_NS)
        task = as_type(src, kind, self.rng.randrange(len(src.inputs)), n)
        refs = self._refs(kind, n, src.meta.get("difficulty")) if who == "teacher" else []
        return role, prompt(role, task, refs), completion(role, task)

    def _variant(self, role: str, kind: str) -> tuple[str, str]:
        """A teacher example whose completion extends one of the references it shows."""
        anchor, variant = self.rng.choice(self.variants)
        task = as_type(variant, kind, self.rng.randrange(len(variant.inputs)))
        refs = self._refs(kind, 0, anchor.meta.get("difficulty"))[: self.max_refs - 1]
        refs.insert(self.rng.randint(0, len(refs)),
                    as_type(anchor, kind, self.rng.randrange(len(anchor.inputs))))  # fmt: skip
        return prompt(role, task, refs), completion(role, task)


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


# -- the model --------------------------------------------------------------------------------


def build_model(tok: PreTrainedTokenizerFast, size: ModelSize, seed: int) -> torch.nn.Module:
    """A Qwen2 with tied embeddings sized to the tokenizer, initialised from `seed`."""
    return random_qwen2(
        tok, seed, hidden=size.hidden, intermediate=size.intermediate, layers=size.layers,
        heads=size.heads, kv_heads=size.kv_heads, max_positions=size.max_positions,
        dtype=torch.float32,
    )  # fmt: skip


def lr_at(step: int, steps: int, lr: float, warmup: int) -> float:
    """Linear warm-up, then cosine down to a tenth."""
    if step < warmup:
        return lr * (step + 1) / warmup
    frac = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


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
        if not pairs or batch_tokens < max_len:
            raise ValueError("need examples, and batch_tokens >= max_len")
        ps = tok([p for p, _ in pairs], add_special_tokens=False)["input_ids"]
        cs = tok([c for _, c in pairs], add_special_tokens=False)["input_ids"]
        eos = [tok.eos_token_id]
        lengths = [min(len(p) + len(c) + 1, max_len) for p, c in zip(ps, cs, strict=True)]
        self.cut = sum(len(p) + len(c) + 1 > max_len for p, c in zip(ps, cs, strict=True))
        flat = np.fromiter(itertools.chain.from_iterable(
            (p + c + eos)[:max_len] for p, c in zip(ps, cs, strict=True)),
            dtype=np.int64, count=sum(lengths))  # fmt: skip
        self.tokens = torch.from_numpy(flat)
        self.lengths = torch.tensor(lengths)
        self.prompt_lens = torch.tensor([len(p) for p in ps]).clamp_(max=self.lengths)
        self.offsets = torch.cumsum(self.lengths, 0) - self.lengths
        self.batch_tokens, self.pad = batch_tokens, tok.pad_token_id
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
            for rows in self._epoch()[: steps - done]:
                width = int(lengths[rows].max())
                rows = rows.to(dev)
                pos = torch.arange(width, device=dev)[None, :]
                inside = pos < self.lengths[rows, None]
                at = (self.offsets[rows, None] + pos).clamp_(max=len(self.tokens) - 1)
                ids = torch.where(inside, self.tokens[at], self.pad)
                labels = torch.where(inside & (pos >= self.prompt_lens[rows, None]), ids, -100)
                yield ids, inside.long(), labels
                done += 1


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
) -> list[float]:
    """AdamW on the completion-token mean loss of `steps` batches; returns every step's loss.

    On CUDA: bf16 autocast, fused AdamW, and the loss read back only at log steps (no sync
    per step). `attention_mask=False` drops the batches' masks: rows are right-padded, so
    under the causal mask no real token sees padding (whose labels are -100), and attention
    runs as plain causal SDPA (flash kernels) instead of a masked one."""
    model.to(device).train()
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    other = [p for n, p in model.named_parameters() if p.ndim < 2]
    amp = device.type == "cuda"
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
        lr=lr, betas=(0.9, 0.95), fused=amp or None,
    )  # fmt: skip
    losses: list[torch.Tensor] = []
    t0 = time.perf_counter()
    for step, batch in zip(range(steps), batches, strict=False):
        ids, mask, labels = (x.to(device, non_blocking=True) for x in batch)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, lr, warmup)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
            loss = model(input_ids=ids, attention_mask=mask if attention_mask else None,
                         labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.detach())
        if log and (step % log_every == 0 or step == steps - 1):
            log(f"step {step:5d}  loss {float(losses[-1]):.4f}  {time.perf_counter() - t0:6.1f}s")
    model.eval()
    return [float(x) for x in torch.stack(losses).float().cpu().tolist()] if losses else []


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
    workers: int = 2,
    corpus: Sequence[Task] | None = None,
    command: str | None = None,
    log: Callable[[str], None] | None = print,
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
    pool's batches hold up to `batch_tokens` padded tokens. Training on CPU is bit-for-bit
    reproducible; on GPU, kernels may add float noise.
    """
    if steps < 1 or n_per_level < 1 or batch_size < 1 or pool < 0:
        raise ValueError("steps, n_per_level and batch_size must be >= 1, pool >= 0")
    if not 0.0 <= variant_share <= 1.0 or teacher_max_level not in LEVELS:
        raise ValueError("variant_share must be in [0, 1] and teacher_max_level in 1..5")
    size = size or ModelSize()
    dev = resolve_device(device)  # ModelLoadError (one line) for cuda without a GPU
    t0 = time.perf_counter()
    variants: list[tuple[Task, Task]] = []
    if corpus is None or variant_share > 0:
        with Sandbox(workers=workers, timeout_s=2.0) as sb:
            corpus = build_corpus(n_per_level, seed, sb) if corpus is None else corpus
            if variant_share > 0:
                anchors = [t for t in corpus if (t.meta.get("difficulty") or 5) <= 3]
                variants = generate_variants(anchors, f"pretrain/{seed}", sb)
    corpus = list(corpus)
    t_corpus = time.perf_counter() - t0
    if log:
        log(f"corpus: {len(corpus)} programs, {len(variants)} variants in {t_corpus:.1f}s")
    progs = corpus + [v for _, v in variants]
    texts = list(corpus_texts([as_type(t, k) for t in progs for k in ("code_o", "code_i")]))
    texts += list(corpus_texts(progs))
    tok = train_tokenizer(texts, vocab_size=vocab_size)
    model = build_model(tok, size, seed)
    examples = Examples(corpus, random.Random(f"pretrain/{seed}"), teacher_max_level=teacher_max_level,
                        variants=variants, variant_share=variant_share, level_refs=level_refs,
                        ref_max_chars=ref_max_chars)  # fmt: skip
    if pool:
        t1 = time.perf_counter()
        data = ExamplePool(tok, [examples.draw()[1:] for _ in range(pool)], max_len,
                           batch_tokens, seed).to(dev)  # fmt: skip
        pool_info = {"examples": pool, "tokens": len(data.tokens), "cut_rows": data.cut,
                     "batch_tokens": batch_tokens,
                     "seconds": round(time.perf_counter() - t1, 1)}  # fmt: skip
        if log:
            log(f"pool: {pool} examples, {len(data.tokens)} tokens, {data.cut} cut at {max_len} "
                f"in {pool_info['seconds']}s")
        batches: Iterable = data.batches(steps)
    else:
        pool_info = None
        batches = (encode(tok, [examples.draw()[1:] for _ in range(batch_size)], max_len)
                   for _ in range(steps))  # fmt: skip
    t_train = time.perf_counter()
    losses = train(model, batches, steps, dev, lr=lr, log=log, attention_mask=not pool)
    t_train = time.perf_counter() - t_train
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.to("cpu").save_pretrained(str(out), safe_serialization=True)
    save_tokenizer(tok, out)
    record = {
        "seed": seed,
        "steps": steps,
        "device": str(dev),
        "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "command": command or " ".join(sys.argv),
        "batch_size": None if pool else batch_size,  # the pool's batches: batch_tokens
        "lr": lr,
        "n_per_level": n_per_level,
        "teacher_max_level": teacher_max_level,
        "variant_share": variant_share,
        "variants": len(variants),
        "level_refs": level_refs,
        "ref_max_chars": ref_max_chars,
        "max_len": max_len,
        "pool": pool_info,
        "vocab_size": len(tok),
        "size": size.__dict__,
        "parameters": sum(p.numel() for p in model.parameters()),
        "corpus_programs": len(corpus),
        "corpus_fingerprint": fingerprint(corpus),
        "final_loss": sum(losses[-50:]) / len(losses[-50:]),
        "loss_curve": {str(i): round(x, 4) for i, x in enumerate(losses) if i % 50 == 0},
        "corpus_s": round(t_corpus, 1),
        "train_s": round(t_train, 1),
        "step_ms": round(1000 * t_train / steps, 1),
        "total_s": round(time.perf_counter() - t0, 1),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "python": platform.python_version()},  # fmt: skip
    }
    (out / "training.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


def pretrain_size(
    out_dir: str | Path, size: str = "tiny", seed: int = 0, device: str = "auto", *,
    steps: int | None = None, n_per_level: int | None = None, lr: float | None = None,
    **kwargs: object,
) -> dict:  # fmt: skip
    """`pretrain_tiny` with the settings of `SIZES[size]`; given values override the recipe."""
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; known: {', '.join(SIZES)}")
    r = SIZES[size]
    kwargs.setdefault("batch_size", r.batch_size)
    record = pretrain_tiny(
        out_dir, seed, steps or r.steps, device, n_per_level=n_per_level or r.n_per_level,
        size=r.size, lr=lr or r.lr, teacher_max_level=r.teacher_max_level,
        variant_share=r.variant_share, level_refs=r.level_refs, ref_max_chars=r.ref_max_chars,
        max_len=r.max_len, pool=r.pool, batch_tokens=r.batch_tokens, **kwargs,  # type: ignore[arg-type]
    )  # fmt: skip
    record["size_name"] = size
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
    p.add_argument("--workers", type=int, default=2)
    a = p.parse_args(argv)
    args = sys.argv[1:] if argv is None else list(argv)
    rec = pretrain_size(a.out, a.size, a.seed, a.device, steps=a.steps, n_per_level=a.n_per_level,
                        lr=a.lr, workers=a.workers,
                        **({"batch_size": a.batch_size} if a.batch_size else {}),
                        command=" ".join(["python -m lorapop.tiny.pretrain", *args]))  # fmt: skip
    print(f"saved to {a.out}: final loss {rec['final_loss']:.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
