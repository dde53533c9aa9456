"""Sampling for a mixed-adapter batch: every row runs under its own adapter slot.

`generate` tokenizes, sizes the decode batch to the memory free, and streams the prompts
(longest first) through one continuously refilled `Decoder` (static KV cache, CUDA graph on
GPU), then turns each row's tokens into a `Generation`; `KeptDecoders` keeps decoders (their
caches and captured graphs) from one call to the next. Row i's random stream depends only on
(seed, its row key): a row's output does not depend on the other prompts, their order, the
batch size or when it was admitted, beyond floating-point differences of batched kernels in
low precision.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Protocol

import torch

from lorapop.engine.decode_attention import Kernel
from lorapop.engine.decoder import Decoder, Result, Row, StopFn
from lorapop.engine.memory import fit_batch, free_memory
from lorapop.engine.sampling import SamplingParams, row_uniforms

Finish = Literal["eos", "stop", "length"]
_CHECK_EVERY = 8  # decode steps between host checks for stop strings / all-finished


@dataclass
class Generation:
    """One sampled completion.

    `token_ids`/`logprobs` are what the policy sampled: they include the EOS token
    (finish "eos") or run through the token that completed the stop string (finish "stop").
    `logprobs[j]` is log pi(token_ids[j]) at temperature 1 over the full vocabulary.
    `text` is the decoded completion without special tokens, cut before the stop string.
    """

    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    logprobs: list[float]
    finish: Finish


@dataclass(frozen=True)
class Prompt:
    """A prompt a `Feed` adds to a running `generate`: its ids, adapter slot, cap on new
    tokens, and the (seed, key) its random stream comes from."""

    ids: str | Sequence[int]
    slot: int
    max_new_tokens: int
    seed: int
    key: int


class Feed(Protocol):
    """Prompts that `generate` takes into its running batch as they become known (the
    answers of a proposal once it is verified, while other proposals still decode)."""

    #: the most new tokens an added prompt asks for (sizes the decoder's buffers)
    max_new_tokens: int

    def __call__(self, done: dict[int, Generation], wait: bool) -> list[Prompt] | None:
        """Given the generations finished since the last call (by index), the prompts to add
        (their indices follow the last one's), [] if none yet, None once none will come.
        `wait`: nothing else is left to run; return only once some come or none will."""
        ...


class KeptDecoders:
    """The decoders of the last `capacity` generation shapes, kept between `generate` calls.

    A decoder captures one CUDA graph per (rows, attention width) it meets; made anew at
    every call, a small model spends more time capturing than decoding (a 77M world step on
    an H100: 0.77 s of captures against 0.57 s of decode steps). Kept, each (rows, width) is
    captured once per run (~0 s a step). Calls that pass this object round their
    batch and cache length up to a few buckets (`compile_buckets`) so that shapes repeat, and
    the kept caches hold their memory between calls (through the update too): for models
    whose caches are small. The least recently used decoder goes when a new shape would
    exceed `capacity`.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"KeptDecoders needs capacity >= 1, got {capacity}")
        self.capacity = capacity
        self.decoders: OrderedDict[tuple, Decoder] = OrderedDict()
        self.made = self.reused = 0

    def get(self, key: tuple) -> Decoder | None:
        decoder = self.decoders.get(key)
        if decoder is not None:
            self.decoders.move_to_end(key)
            self.reused += 1
        return decoder

    def make_room(self) -> None:
        """Drop the least recently used decoders until one more fits the capacity."""
        while len(self.decoders) >= self.capacity:
            self.decoders.popitem(last=False)

    def add(self, key: tuple, decoder: Decoder) -> None:
        self.make_room()
        self.decoders[key] = decoder
        self.made += 1


@dataclass(frozen=True)
class GenerateSpec:
    """How `generate` samples and runs: everything but the prompts, their slots and the
    per-call hooks."""

    #: temperature, top-p, max new tokens, stop strings, EOS ids
    params: SamplingParams = field(default_factory=SamplingParams)
    seed: int = 0
    #: at most this many rows decode together (default: all), fewer if their KV cache does not
    #: fit `memory_budget` bytes (default on CUDA: the free device memory; on CPU: no limit); a
    #: prompt too long for even one row is a `GenerationMemoryError` before any work
    batch_size: int | None = None
    memory_budget: int | None = None
    #: prompts are prefilled at most this many tokens per forward; identical prompts under one
    #: slot are prefilled once (the others copy its cache rows)
    prefill_tokens: int = 8192
    #: False forces the eager decode step on GPU
    cuda_graph: bool = True
    #: True (None: on CUDA only) runs the decode step's model forward through torch.compile
    #: before capturing the step: ~1.25x faster decode steps at 7B, for ~45 s of compilation
    #: the first time a shape is seen in a process. Off by default: in a self-play step the
    #: padding to shape buckets ate the gain and raised peak memory (docs/performance.md). It
    #: falls back to the plain forward with a warning if compilation fails. Shapes are then
    #: bucketed to bound recompilation: the batch rounded up to a power of two (at most
    #: `batch_size`), the cache length to 64 or 96 times a power of two.
    compile: bool | None = False
    #: rows that finish are refilled with waiting prompts (continuous batching); False decodes
    #: static batches (a batch's rows wait for its slowest): a baseline for benchmarks
    refill: bool = True
    #: reuse a decoder of the same shape from an earlier call, its graphs already captured, and
    #: keep this call's; shapes are then bucketed as for `compile`. A row's output is the one
    #: a fresh decoder of that shape gives (tested bit for bit)
    decoders: KeptDecoders | None = None
    #: decode attention: "auto" runs `decode_attention`'s Triton kernel where it applies (CUDA,
    #: bf16/fp16), reading each row's own positions only; "sdpa" the masked SDPA reference
    attention: Kernel = "auto"
    #: waiting prompts are admitted once at least this many rows are free (or all that wait
    #: fit, or no row runs): each admission is a prefill forward of its own, whose fixed cost
    #: at 7B (a forward's kernels, launched eagerly) outweighs a few rows idle for a few steps
    #: when rows end one by one; 1 admits at every host check, 0 (default) once an eighth of
    #: the batch is free (`decoder.admit_at`)
    admit_min: int = 0


def generate(
    model: Any,
    bank: Any,
    tokenizer: Any,
    prompts: Sequence[str | Sequence[int]],
    slot_ids: Sequence[int],
    spec: GenerateSpec | None = None,
    *,
    row_keys: Sequence[int] | None = None,
    stop_fn: StopFn | None = None,
    timing: dict[str, float] | None = None,
    feed: Feed | None = None,
) -> list[Generation]:
    """Sample one completion per prompt, prompt i under adapter slot `slot_ids[i]`, as `spec`
    says (default `GenerateSpec()`).

    Prompts are strings (tokenized with the tokenizer's defaults) or token-id lists.
    `bank` may be None (the plain model); `tokenizer` may be None when prompts are ids and
    no stop strings are given (texts are then empty). Row i's samples depend only on
    (spec.seed, `row_keys[i]`) (default: i), so a caller that splits prompts across calls or
    processes gets the same samples by passing each prompt's global key. `stop_fn(i, tokens)`
    may end prompt i early (it returns how many tokens to keep; `tokens` is read-only), on top
    of EOS and `spec.params.stop`.

    `feed` adds prompts while these decode (`Feed`); they are returned after `prompts`, in
    the order added, each sampled as it would be in a call of its own (its (seed, key), its
    cap). The batch starts at the size these prompts' cache allows and is re-sized once the
    feed is done, to what the rows left allow (`Decoder.run`). Not with `spec.decoders`.

    `timing`, if given, receives where the time went: `batch` (rows decoding at once),
    `prefill_s`, `prefills` and `prefill_tokens` (forwards over prompts and the positions
    they fed, padding included), `capture_s` (CUDA graphs, compiles), `decode_s` (the steps
    and host checks), `steps` and `row_steps` (steps times the rows each ran over), `feed_s`
    (in the feed, while rows waited) and `regrids`.
    """
    spec = spec or GenerateSpec()
    params, batch_size, compile = spec.params, spec.batch_size, spec.compile
    seed, prefill_tokens, memory_budget = spec.seed, spec.prefill_tokens, spec.memory_budget
    cuda_graph, refill, decoders = spec.cuda_graph, spec.refill, spec.decoders
    ids = _encode(tokenizer, prompts)
    keys = list(range(len(ids))) if row_keys is None else [int(k) for k in row_keys]
    _check(model, bank, tokenizer, ids, slot_ids, keys, params, batch_size)
    if prefill_tokens < 1:
        raise ValueError(f"prefill_tokens must be >= 1, got {prefill_tokens}")
    if spec.admit_min < 0:
        raise ValueError(f"admit_min must be >= 0, got {spec.admit_min}")
    if feed is not None and (decoders is not None or not refill):
        raise ValueError("a feed needs refills and no kept decoders")
    if not ids:
        return []
    eos = _eos_ids(model, tokenizer, params)
    # longest admitted first; copies of one (slot, prompt) next to each other, so that they
    # share one prefill (the answers of one task)
    first: dict[tuple[int, tuple[int, ...]], int] = {}
    group = [first.setdefault((int(slot_ids[i]), tuple(p)), i) for i, p in enumerate(ids)]
    order = sorted(range(len(ids)), key=lambda i: (-len(ids[i]), group[i]))
    steps = params.max_new_tokens
    length = -(-(len(ids[order[0]]) + steps - 1) // 64) * 64
    if compile is None:
        compile = next(model.parameters()).device.type == "cuda"
    want = min(batch_size or len(ids), len(ids))
    if compile or decoders is not None:
        want, length = compile_buckets(want, batch_size, length)
    key = (id(model), id(bank), want, length, params.max_new_tokens, params.temperature,
           params.top_p, tuple(eos), cuda_graph, compile, prefill_tokens, spec.attention)
    decoder = decoders.get(key) if decoders is not None else None
    # a feed's rows may ask for more new tokens than these prompts: buffers for the most
    dparams = params if feed is None else replace(
        params, max_new_tokens=max(steps, feed.max_new_tokens))

    def fit(rows: int, at: int, freed: int = 0) -> int:
        """Rows of `at` positions that fit the memory free plus `freed` bytes."""
        budget = memory_budget if memory_budget is not None else free_memory(model)
        if memory_budget is None and budget is not None:
            budget += freed  # what the decoder's cache gives back (a set budget counts it)
        batch = fit_batch(model, min(rows, batch_size or rows), at,
                          dparams.max_new_tokens, prefill_tokens, budget)
        if compile and batch < rows:
            batch = 1 << (batch.bit_length() - 1)  # a bucket that still fits
        return batch

    if decoder is None:
        if decoders is not None:
            decoders.make_room()  # before sizing: a dropped decoder's cache is free memory
        decoder = Decoder(model, bank, fit(want, length), length, dparams, eos, cuda_graph,
                          compile, prefill_tokens, attention=spec.attention)
        if decoders is not None:
            decoders.add(key, decoder)
    before = Counter(decoder.timing)
    stops = _stop_fn(tokenizer, params.stop, eos) if params.stop else None
    host_stop = _either(stops, stop_fn, order)
    results = decoder.run(
        [ids[i] for i in order],
        [slot_ids[i] for i in order],
        row_uniforms(seed, [keys[i] for i in order], steps),
        host_stop,
        _CHECK_EVERY,
        refill,
        spec.admit_min,
        feed=None if feed is None else _rows_of(feed, model, bank, tokenizer, ids, order,
                                                eos, params),
        fit=None if feed is None else fit,
        caps=[steps] * len(ids),
    )
    if timing is not None:  # this call's share of the decoder's clock
        t = Counter(decoder.timing)
        t.subtract(before)
        timing.update(batch=decoder.batch, prefill_s=t["prefill_s"], capture_s=t["capture_s"],
                      decode_s=t["run_s"] - t["prefill_s"] - t["capture_s"] - t["feed_wait_s"],
                      steps=t["steps"], row_steps=t["row_steps"], prefills=t["prefills"],
                      prefill_tokens=t["prefill_tokens"],
                      feed_s=t["feed_s"] + t["feed_wait_s"], regrids=decoder.regrids)
    if decoders is None:
        del decoder  # its cache and graph pool go back before the caller's next phase
        if next(model.parameters()).device.type == "cuda":
            torch.cuda.empty_cache()
    out: list[Generation | None] = [None] * len(ids)
    for i, (toks, lps, stopped) in zip(order, results, strict=True):
        out[i] = _finish(tokenizer, ids[i], toks, lps, eos, params, stopped)
    return [g for g in out if g is not None]


def _rows_of(feed: Feed, model: Any, bank: Any, tokenizer: Any, ids: list[list[int]],
             order: list[int], eos: list[int], params: SamplingParams
             ) -> Callable[[list[tuple[int, Result]], bool], list[Row] | None]:
    """The decoder's feed: finished rows to `Generation`s for `feed`, its prompts to rows.
    `ids` and `order` (decoder index -> prompt index) grow with the added prompts."""

    def pull(finished: list[tuple[int, Result]], wait: bool) -> list[Row] | None:
        done = {order[j]: _finish(tokenizer, ids[order[j]], toks, lps, eos, params, stopped)
                for j, (toks, lps, stopped) in finished}
        added = feed(done, wait)
        if added is None:
            return None
        rows = []
        for p in added:
            x = _encode(tokenizer, [p.ids])[0]
            try:
                _check(model, bank, tokenizer, [x], [p.slot], [p.key],
                       replace(params, max_new_tokens=p.max_new_tokens), None)
            except ValueError as e:
                why = str(e).replace("prompt 0: ", "").replace("prompt 0 ", "it ")
                raise ValueError(f"a prompt the feed added (key {p.key}): {why}") from None
            order.append(len(ids))
            ids.append(x)
            rows.append(Row(x, int(p.slot), row_uniforms(p.seed, [p.key], p.max_new_tokens)[0],
                            p.max_new_tokens))
        return rows

    return pull


def _either(stops: StopFn | None, user: StopFn | None, order: list[int]) -> StopFn | None:
    """One host stop function over the decoder's prompt indices (positions in `order`)."""
    if stops is None and user is None:
        return None

    def fn(j: int, toks: list[int]) -> int | None:
        i = order[j]
        hits = [n for f in (user, stops) if f is not None and (n := f(i, toks)) is not None]
        return min(hits) if hits else None

    return fn


def compile_buckets(batch: int, cap: int | None, length: int) -> tuple[int, int]:
    """(batch, length) rounded up to a few sizes, so compiled steps are reused across calls.

    Batch: the next power of two, at most `cap` (extra rows repeat a real one; decoding is
    memory-bound, so they cost little). Length: the next 64 * 2^k or 96 * 2^k (at most 1.5x
    the cache). Up to 4,096 positions and batch 64: at most 7 x 13 shapes.
    """
    b = 1 << (batch - 1).bit_length()
    b = min(b, cap) if cap is not None else b
    size = 64
    while size < length:
        size = size * 3 // 2 if size & (size - 1) == 0 else size * 4 // 3
    return b, size


def _encode(tokenizer: Any, prompts: Sequence[str | Sequence[int]]) -> list[list[int]]:
    ids = []
    for p in prompts:
        if isinstance(p, str):
            if tokenizer is None:
                raise ValueError("string prompts need a tokenizer")
            ids.append(list(tokenizer(p)["input_ids"]))
        else:
            ids.append([int(t) for t in p])
    return ids


def _check(
    model: Any,
    bank: Any,
    tokenizer: Any,
    ids: list[list[int]],
    slot_ids: Sequence[int],
    keys: list[int],
    params: SamplingParams,
    batch_size: int | None,
) -> None:
    if len(slot_ids) != len(ids):
        raise ValueError(f"{len(ids)} prompts but {len(slot_ids)} slot ids")
    if len(keys) != len(ids):
        raise ValueError(f"{len(ids)} prompts but {len(keys)} row keys")
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if params.stop and tokenizer is None:
        raise ValueError("stop strings need a tokenizer")
    n_slots = getattr(bank, "n_slots", None)
    if n_slots is not None and any(not 0 <= s < n_slots for s in slot_ids):
        raise ValueError(f"slot ids must be in [0, {n_slots})")
    cfg = model.config.get_text_config()
    vocab, limit = cfg.vocab_size, getattr(cfg, "max_position_embeddings", None)
    for i, p in enumerate(ids):
        if not p:
            raise ValueError(f"prompt {i} is empty")
        if any(not 0 <= t < vocab for t in p):
            raise ValueError(f"prompt {i} has token ids outside [0, {vocab})")
        if limit is not None and len(p) + params.max_new_tokens > limit:
            raise ValueError(
                f"prompt {i}: {len(p)} + {params.max_new_tokens} new tokens exceed {limit} positions"
            )


def _eos_ids(model: Any, tokenizer: Any, params: SamplingParams) -> list[int]:
    if params.eos_token_ids is not None:
        return list(params.eos_token_ids)
    found: set[int] = set()
    config_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    tok_eos = getattr(tokenizer, "eos_token_id", None)
    for e in (config_eos, tok_eos):
        if isinstance(e, int):
            found.add(e)
        elif e is not None:
            found.update(int(x) for x in e)
    return sorted(found)


def _decode(tokenizer: Any, toks: list[int]) -> str:
    return "" if tokenizer is None else tokenizer.decode(toks, skip_special_tokens=True)


def _first_stop(text: str, stops: Sequence[str]) -> tuple[int, str] | None:
    hits = [(text.find(s), s) for s in stops if s in text]
    return min(hits, key=lambda h: (h[0], -len(h[1]))) if hits else None


def _before_eos(toks: list[int], eos: Sequence[int]) -> list[int]:
    ends = [j for j, t in enumerate(toks) if t in eos]
    return toks[: ends[0]] if ends else toks


def _stop_fn(tokenizer: Any, stops: Sequence[str], eos: Sequence[int]) -> StopFn:
    """Stop a row whose text contains a stop string, decoding only a recent window per check
    (`_finish` then cuts at the string)."""
    window = _CHECK_EVERY + 4 * max(len(s) for s in stops) + 4

    def fn(i: int, toks: list[int]) -> int | None:
        recent = _decode(tokenizer, toks[-window:])
        if any(s in recent for s in stops):
            full = _decode(tokenizer, _before_eos(toks, eos))
            if _first_stop(full, stops) is not None:
                return len(toks)
        return None

    return fn


def _finish(
    tokenizer: Any,
    prompt: list[int],
    toks: list[int],
    lps: list[float],
    eos: Sequence[int],
    params: SamplingParams,
    stopped: bool = False,
) -> Generation:
    """`stopped`: a stop function ended the row (finish "stop" unless EOS came first)."""
    body = _before_eos(toks, eos)
    if params.stop and _first_stop(_decode(tokenizer, body), params.stop) is not None:
        lo, hi = 1, len(body)  # shortest prefix whose text holds a stop string
        while lo < hi:
            mid = (lo + hi) // 2
            if _first_stop(_decode(tokenizer, body[:mid]), params.stop) is None:
                lo = mid + 1
            else:
                hi = mid
        text = _decode(tokenizer, body[:lo])
        at, stop = _first_stop(text, params.stop) or (len(text), "")
        text = text[: at + len(stop)] if params.include_stop else text[:at]
        return Generation(prompt, body[:lo], text, lps[:lo], "stop")
    if len(body) < len(toks):
        n = len(body) + 1
        return Generation(prompt, toks[:n], _decode(tokenizer, body), lps[:n], "eos")
    finish: Finish = "stop" if stopped else "length"
    return Generation(prompt, toks, _decode(tokenizer, toks), lps, finish)
