"""Continuous batching of mixed-adapter rows over a static KV cache.

Where a decode step happens and what it computes: `Decoder._step`. For each of the batch's
rows it feeds the row's last token through the patched model (`_logits`; every patch is
listed in `engine/patches.py`) and samples the next one (`sampling.sample`):

    per layer, for one token a row (no autograd):
      RMSNorm                      one `F.rms_norm` kernel, weight inside (`fused`)
      q, k, v                      one GEMM for the three (`merged`) + each row's LoRA delta,
                                   its slot's B @ A @ x (`lora.bank` hooks, decode cache:
                                   q/k/v share the shrink; on GPU two Triton kernels
                                   reading the row's own slot only, `lora.decode_kernel`)
      rotary embedding             one fused pass on CUDA (`fused`), the model's own on CPU
      attention                    the new key/value written at the row's position in the
                                   static cache, the query over the row's own cached keys
                                   (`kvcache`, `decode_attention`: a Triton kernel on GPU
                                   reading each row's length only, each key once per group)
      o_proj                       GEMM + LoRA delta
      RMSNorm, gate/up             one GEMM for the two + LoRA deltas (added in place);
                                   silu(gate) * up, one fused pass on CUDA
      down_proj                    GEMM + LoRA delta
    final RMSNorm, LM head         logits [rows, vocabulary]
    sample                         temperature and top-p from the row's own uniform; the
                                   token's log-probability under the policy (temperature 1);
                                   one Triton kernel on CUDA at top-p 1 (`sampling_kernel`)

The step has fixed shapes and addresses: on CUDA it is captured once per (rows, attention
width) and replayed as a CUDA graph.

The decoder holds `batch` cache rows. Each prompt is prefilled into a free row (from cache
index 0, in chunks of at most `prefill_tokens` tokens per forward), then decoded; when a row
finishes (EOS, the caller's stop function, or its own max length) its result is collected and
the row is refilled with the next waiting prompt (at the next host check, or once `admit_min`
rows are free: one prefill for several), so the batch stays full until the queue is empty.
Then, as rows finish, the last running rows move to the front of the cache and the step runs
over half as many rows at a time (down to `shrink_min`): the tail of a phase, where
a few long rows decode alone, costs the steps of a small batch, not of the full one. Copies
of one prompt under one slot (a task's answers) share one prefill. A row's position ids are
its cache indices and the decode mask is per row (`key <= the row's position`), so rows of
any length and age share a step.

The decode step is a pure function of static device buffers (tokens, per-row positions,
output columns, uniforms, done flags), so on CUDA it is captured in a graph (one per row
count and attention width) and replayed; on CPU the same step runs eagerly. Host checks
(every few steps) fetch only the token columns written since the last one. Finished rows keep
running in the graph until refilled, writing into a spare output column. Every row draws its
uniforms from its own stream (`row_uniforms(seed, key)`), indexed by its own output column:
a prompt's tokens do not depend on its batch-mates, on when it was admitted or on where it
moved. Adapter routing is set in place (`set_slot_ids_`) whenever rows change, so the
captured step reads the current routing; the bank's decode cache (a compute-dtype copy of
its weights, read by the graph) is brought up to date before every run. Compiled steps
(below) keep the whole batch.

With `compile=True` the model forward of the step (model, LoRA hooks, the reference
attention) goes through torch.compile, which fuses the base model's small elementwise kernels
(RMSNorm, rotary, SiLU, residual adds); the sampler stays eager (inductor's scan over a 150k-token
vocabulary fails on CUDA, and the sampler is a handful of kernels). The whole step, compiled
part and sampler, is then captured in the graph as before. Shapes are static
(`dynamic=False`): one compilation per (batch, cache length, bank state), which `generate`
bounds by rounding both up to a few buckets. If compilation fails the decoder warns and runs
the plain forward.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lorapop.engine import decode_attention
from lorapop.engine.decode_attention import Kernel
from lorapop.engine.kvcache import Prefill, StaticKV, kv_shape
from lorapop.engine.patches import static_kv
from lorapop.engine.sampling import SamplingParams, sample

# host callback: (prompt index, the row's tokens so far) -> how many tokens to keep if the
# row must stop now, else None
StopFn = Callable[[int, list[int]], int | None]
Result = tuple[list[int], list[float], bool]  # tokens, logprobs, ended by the stop function


@dataclass(frozen=True)
class Row:
    """A prompt added to a running decoder: its ids, adapter slot, uniforms [cap] and its own
    cap on new tokens (at most the decoder's)."""

    prompt: Sequence[int]
    slot: int
    u: torch.Tensor
    cap: int


#: (prompts finished since the last call, as (index, result); wait) -> prompts to add (their
#: indices follow the last), or None once no more will come. wait=True: no row runs and none
#: waits, so return only once some come (or none ever will).
Feed = Callable[[list[tuple[int, Result]], bool], list[Row] | None]
#: (rows wanted, cache length, bytes the decoder's cache would free) -> rows that fit
Fit = Callable[[int, int, int], int]
WIDTH_STEP = 512  # decode attention widths are multiples of this (one graph per width)


def admit_at(admit_min: int, batch: int) -> int:
    """Free rows that waiting prompts wait for: `admit_min`, or with 0 an eighth of the batch
    (at least 1). At 7B a prefill's fixed cost is tens of milliseconds: rows that end one by
    one would otherwise cost one prefill each (docs/performance.md: the paper step's
    rollouts at realistic lengths, 90.7 s admitting at every check, 80.5-81.1 s at 16-32)."""
    return admit_min or max(1, batch // 8)


def _prefill_weights(bank: Any, dtype: torch.dtype) -> contextlib.AbstractContextManager[Any]:
    """The bank's prefill weights (`AdapterBank.prefill_weights`): the decode steps' own."""
    return contextlib.nullcontext() if bank is None else bank.prefill_weights(dtype)


def route(bank: Any, slots: torch.Tensor) -> contextlib.AbstractContextManager[Any]:
    return contextlib.nullcontext() if bank is None else bank.route(slots)


def _compile(fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """torch.compile with static shapes, guarding on forward hooks being present.

    By default dynamo does not guard on empty hook dicts, so a forward compiled before an
    AdapterBank was attached would later run without the bank's LoRA hooks.
    """
    compiled = torch.compile(fn, dynamic=False)

    def run() -> torch.Tensor:
        with torch._dynamo.config.patch(skip_nnmodule_hook_guards=False):
            return compiled()

    return run


def prefill_chunks(widths: Sequence[int], budget: int) -> list[tuple[list[int], int]]:
    """Split prompts of `widths` (longest first) into forwards of at most `budget` tokens.

    Returns (prompt indices, chunk length) per group: a group's prompts are right-padded to
    its widest and fed `chunk length` positions per forward, rows x chunk <= budget.
    """
    order = sorted(range(len(widths)), key=lambda i: -widths[i])
    groups, i = [], 0
    while i < len(order):
        chunk = min(widths[order[i]], budget)
        rows = max(1, budget // chunk)
        groups.append((order[i : i + rows], chunk))
        i += rows
    return groups


@dataclass
class _Queue:
    """Host state of one `Decoder.run`: the prompts, and what each cache row holds."""

    prompts: list[Sequence[int]]
    slots: list[int]
    u: list[torch.Tensor]  # each prompt's uniforms [max_new_tokens], on the host
    caps: list[int]  # each prompt's cap on new tokens
    keys: list[int]  # each prompt's (slot, prompt ids) as an int: equal keys share a prefill
    distinct: dict[tuple[int, tuple[int, ...]], int]  # (slot, prompt ids) -> its key
    waiting: deque[int]
    owner: list[int]  # prompt index held by each row, -1: free
    used: list[bool]  # rows that have held a prompt
    cols: list[int]  # tokens written per row, as of the last check
    toks: list[list[int]]  # each row's tokens fetched to the host so far (for stop_fn)
    left: Counter[int]  # prompts of each key not yet admitted
    first: dict[int, torch.Tensor]  # first-token logits of keys whose copies still wait
    out: list[Result | None]
    feed: Feed | None = None  # more prompts to come (None: none)
    need: int = 0  # cache length the rows asked for at the last re-grid check

    def add(self, prompt: Sequence[int], slot: int, u: torch.Tensor, cap: int) -> None:
        self.keys.append(self.distinct.setdefault((int(slot), tuple(prompt)), len(self.distinct)))
        self.prompts.append(prompt)
        self.slots.append(int(slot))
        self.u.append(u)
        self.caps.append(cap)
        self.left[self.keys[-1]] += 1
        self.waiting.append(len(self.out))
        self.out.append(None)


class Decoder:
    """Static buffers, KV cache and (optionally) CUDA graphs for one batch size and length.

    Rows with the same (slot, prompt) share one prefill: the first is prefilled, the others
    get a copy of its cache rows and sample their first token from its logits with their own
    uniforms (the answers of one task). The decode step attends over the cache's first
    `width` positions, the smallest multiple of `width_step` that covers every row until the
    next host check, so early steps read less of the cache; one graph per width. Masked
    positions add exact zeros, so the width does not change a row's results beyond the
    rounding of batched kernels.
    """

    def __init__(
        self,
        model: Any,
        bank: Any,
        batch: int,
        length: int,
        params: SamplingParams,
        eos_ids: Sequence[int],
        cuda_graph: bool = True,
        compile: bool = False,
        prefill_tokens: int = 8192,
        width_step: int = WIDTH_STEP,
        shrink_min: int = 8,
        attention: Kernel = "auto",
    ) -> None:
        param = next(model.parameters())
        dev, steps = param.device, params.max_new_tokens
        layers, kv_heads, head_dim = kv_shape(model)
        self.model, self.bank, self.params = model, bank, params
        self.batch, self.length, self.prefill_tokens = batch, length, prefill_tokens
        # compiled steps are specialised to their width: one width, no recompilation; the
        # Triton attention reads each row's own positions, so a width saves nothing: one
        # graph per row count
        self.own_rows = decode_attention.applies(dev, param.dtype, head_dim, attention)
        self.width_step = length if compile or self.own_rows else max(1, width_step)
        self.kv = StaticKV(layers, batch, kv_heads, length, head_dim, param.dtype, dev,
                           attention)
        self.dtype = param.dtype
        self.width = length  # cache positions the decode step attends over
        self.rows = batch  # cache rows the decode step runs over (the first ones)
        self.shrink_min = shrink_min
        self.tok = torch.zeros(batch, dtype=torch.long, device=dev)
        self.slots = torch.zeros(batch, dtype=torch.long, device=dev)
        self.u = torch.zeros(batch, steps, device=dev)
        # one spare column: rows that are done write there until they are refilled
        self.out_tok = torch.zeros(batch, steps + 1, dtype=torch.long, device=dev)
        self.out_lp = torch.zeros(batch, steps + 1, device=dev)
        self.col = torch.zeros(batch, dtype=torch.long, device=dev)  # tokens written per row
        self.done = torch.ones(batch, dtype=torch.bool, device=dev)
        self.cap = torch.full((batch,), steps, dtype=torch.long, device=dev)  # new tokens a row
        self.eos = torch.tensor(list(eos_ids), dtype=torch.long, device=dev)
        self.use_graph = cuda_graph and dev.type == "cuda" and steps > 3
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}  # per (rows, width)
        self._pool: Any = None
        self.compiled: Callable[[], torch.Tensor] | None = None
        self._compiled = False
        self.refills = 0  # prompts admitted into a row that an earlier prompt had used
        self.shared = 0  # prompts whose cache rows were copied from an identical prompt's
        self.regrids = 0  # times the cache was re-sized to the rows left (`run`'s feed)
        self.widths: set[int] = set()  # widths the decode step ran at
        self.row_counts: set[int] = set()  # row counts the decode step ran over
        # where a run's wall time went: prefills (admissions), graph captures and compiles,
        # decode steps (the rest, host checks included); steps and row-steps run
        self.timing: Counter[str] = Counter()
        if compile:
            self.compiled = _compile(self._logits)

    @property
    def graph(self) -> torch.cuda.CUDAGraph | None:
        """The captured step at the current rows and width (None: not captured, or eager)."""
        return self.graphs.get((self.rows, self.width))

    @torch.no_grad()
    def run(
        self,
        prompts: Sequence[Sequence[int]],
        slots: Sequence[int],
        u: torch.Tensor,
        stop_fn: StopFn | None = None,
        check_every: int = 8,
        refill: bool = True,
        admit_min: int = 0,
        feed: Feed | None = None,
        fit: Fit | None = None,
        caps: Sequence[int] | None = None,
    ) -> list[Result]:
        """Each prompt's (tokens, logprobs, stopped by stop_fn), admitted in the given order.

        `u` [len(prompts), max_new_tokens] holds each prompt's uniforms. A row stops at EOS
        (returned), at max_new_tokens, or where `stop_fn` says (cut to the count it returns;
        it gets the row's token list, which it must not modify). `refill=False` is static
        batching (the baseline continuous batching is measured against): waiting prompts
        are admitted only once every row of the batch has finished, and every step runs
        over the whole batch. With refills, waiting prompts are admitted once `admit_at` rows
        are free, or once every waiting prompt fits, or when no row runs: fewer, larger
        prefills. When a row is admitted changes none of its results.

        `caps`: each prompt's cap on new tokens (default max_new_tokens). `feed` adds prompts
        while the batch runs, each with its own cap; the results of all, the added ones after
        `prompts`, come back in order. Added prompts too long for this cache wait. Once the
        feed has no more to add, the decoder re-grids to the cache length the rows left need
        when `fit` gives more rows at that length, or when a waiting prompt needs a longer
        cache (the running rows move over with their cache): short answers that started in
        the cache of long proposals get the batch their own cache allows.
        """
        steps = self.params.max_new_tokens
        caps = [steps] * len(prompts) if caps is None else list(caps)
        if any(len(p) + c - 1 > self.length for p, c in zip(prompts, caps, strict=True)):
            raise ValueError(f"a prompt + its new tokens do not fit a cache of {self.length}")
        if feed is not None and not refill:
            raise ValueError("a decoder with a feed refills its rows (refill=True)")
        b = self.batch
        q = _Queue([], [], [], [], [], {}, deque(), [-1] * b, [False] * b, [0] * b,
                   [[] for _ in range(b)], Counter(), {}, [], feed, self.length + 1)
        for p, s, row_u, c in zip(prompts, slots, u, caps, strict=True):
            q.add(p, s, torch.nn.functional.pad(row_u, (0, steps - len(row_u))), c)
        self.done.fill_(True)
        self.rows = self.kv.rows = self.batch
        if hasattr(self.bank, "sync_caches"):
            self.bank.sync_caches()  # the graph reads the cache: refresh it in place
        t0 = time.perf_counter()
        with static_kv(self.model, self.kv), route(self.bank, self.slots):
            self._timed("prefill_s", self._admit, q, list(range(self.batch)))
            n, step = 0, self._step
            while True:
                if n % check_every == 0:  # also right after the first prefill
                    if not self._check(q, stop_fn, refill, admit_min, fit):
                        break
                    step = self._at_width(self._need(q, check_every))
                step()
                n += 1
                self.timing["row_steps"] += self.rows
        self.timing["steps"] += n
        self.timing["run_s"] += time.perf_counter() - t0
        return [o for o in q.out if o is not None]

    def _check(self, q: _Queue, stop_fn: StopFn | None, refill: bool, admit_min: int,
               fit: Fit | None) -> bool:
        """A host check: collect finished rows, take what the feed adds, re-grid, admit
        waiting prompts, shrink the tail. False once every prompt is done."""
        finished, wait = self._collect(q, stop_fn), False
        while True:
            if q.feed is not None:  # waits only once nothing runs and nothing it has fits
                self._pull(q, finished, wait)
                finished = []
            if q.feed is None and fit is not None:
                idle = all(o < 0 for o in q.owner)
                self._regrid_if_better(q, fit, must=idle and not self._fitting(q))
            free = [r for r in range(self.rows) if q.owner[r] < 0]
            if not refill:  # static: the next batch once every row is free
                free = free if len(free) == self.batch else []
            elif len(free) < min(admit_at(admit_min, self.batch), len(q.waiting)) \
                    and len(free) < self.batch:
                free = []  # too few rows for a prefill of its own yet
            if free and q.waiting:
                self._timed("prefill_s", self._admit, q, free)
            if any(o >= 0 for o in q.owner):
                break
            if not q.waiting and q.feed is None:
                return False
            if q.waiting and q.feed is None and fit is None:
                raise ValueError("a prompt + its new tokens do not fit a cache of "
                                 f"{self.length} and no re-grid was allowed")
            wait = True
        if refill and not q.waiting and q.feed is None and self.compiled is None:
            self._shrink(q)
        return True

    def _pull(self, q: _Queue, finished: list[int], wait: bool) -> None:
        """Pass the finished prompts' results to the feed and queue the prompts it adds."""
        assert q.feed is not None
        t0 = time.perf_counter()
        rows = q.feed([(i, r) for i in finished if (r := q.out[i]) is not None], wait)
        self.timing["feed_wait_s" if wait else "feed_s"] += time.perf_counter() - t0
        if rows is None:
            q.feed = None
            return
        steps = self.params.max_new_tokens
        for row in rows:
            if not 1 <= row.cap <= steps or row.u.shape != (row.cap,):
                raise ValueError(f"an added prompt asks for {row.cap} new tokens with "
                                 f"{tuple(row.u.shape)} uniforms; this decoder runs {steps}")
            q.add(row.prompt, row.slot, torch.nn.functional.pad(row.u, (0, steps - row.cap)),
                  row.cap)

    def _fits(self, q: _Queue, i: int) -> bool:
        return len(q.prompts[i]) + q.caps[i] - 1 <= self.length

    def _fitting(self, q: _Queue) -> bool:
        """Whether some waiting prompt fits this cache."""
        return any(self._fits(q, i) for i in q.waiting)

    def _regrid_if_better(self, q: _Queue, fit: Fit, must: bool) -> None:
        """Once nothing more will be added: if the running and waiting rows need a shorter
        cache (or a longer one: `must`, when none of them fits this one) and `fit` gives more
        rows at that length, re-grid."""
        rows = [i for i in q.owner if i >= 0] + list(q.waiting)
        if not rows:
            return
        need = max(len(q.prompts[i]) + q.caps[i] - 1 for i in rows)
        need = -(-need // 64) * 64
        if need >= q.need and not must:
            return  # checked at this length already
        q.need = need
        live = sum(i >= 0 for i in q.owner)
        batch = fit(len(rows), need, self.kv.nbytes)
        if must or (batch > self.batch and live <= batch):
            self._regrid(q, batch, need)

    def _regrid(self, q: _Queue, batch: int, length: int) -> None:
        """Re-size the cache and the step's buffers to `batch` rows x `length` positions; the
        running rows move to the front with their cache, uniforms and outputs (their results
        are those they would get in place), and the graphs are captured again."""
        live = [b for b in range(self.batch) if q.owner[b] >= 0]
        written = max((len(q.prompts[q.owner[b]]) + q.cols[b] for b in live), default=0)
        self.graphs.clear()  # their pool goes with them
        self._pool = None
        self._compiled = False
        self.kv.regrid(batch, length, live, min(written, self.length, length))
        src = torch.tensor(live, dtype=torch.long, device=self.tok.device)

        def moved(buf: torch.Tensor, fill: float | bool) -> torch.Tensor:
            new = buf.new_full((batch, *buf.shape[1:]), fill)
            new[: len(live)] = buf[src]
            return new

        self.tok, self.slots, self.col, self.cap, self.u, self.out_tok, self.out_lp = (
            moved(x, 0) for x in (self.tok, self.slots, self.col, self.cap, self.u, self.out_tok,
                                  self.out_lp))
        self.done = moved(self.done, True)
        pad = batch - len(live)
        q.owner = [q.owner[b] for b in live] + [-1] * pad
        q.cols = [q.cols[b] for b in live] + [0] * pad
        q.toks = [q.toks[b] for b in live] + [[] for _ in range(pad)]
        q.used = [True] * len(live) + [False] * pad
        self.batch = self.rows = self.kv.rows = batch
        self.length = self.width = self.kv.width = length
        if self.width_step > length or self.own_rows or self.compiled is not None:
            self.width_step = length
        self.regrids += 1
        if self.bank is not None:
            self.bank.set_slot_ids_(self.slots)

    def _timed(self, key: str, fn: Callable[..., Any], *args: Any) -> None:
        """`fn(*args)`, its wall time (to the end of its GPU work) added to `timing[key]`."""
        t0 = time.perf_counter()
        fn(*args)
        if self.tok.is_cuda:
            torch.cuda.synchronize()
        self.timing[key] += time.perf_counter() - t0

    def _need(self, q: _Queue, ahead: int) -> int:
        """Cache positions the next `ahead` steps read: a row at column c of a prompt of
        length p attends over p + c - 1 + ahead positions by then."""
        need = max(len(q.prompts[i]) + q.cols[b] for b, i in enumerate(q.owner) if i >= 0)
        return min(self.length, -(-(need + ahead) // self.width_step) * self.width_step)

    def _shrink(self, q: _Queue) -> None:
        """Halve the rows the step runs over while the running rows fit in half (no prompt
        waits): rows beyond the new count move into free rows before it, with their cache,
        uniforms and outputs, so each row's results are those it would get in place."""
        live = [b for b in range(self.rows) if q.owner[b] >= 0]
        n = self.rows
        while n // 2 >= max(len(live), self.shrink_min, 1):
            n //= 2
        if n == self.rows:
            return
        movers = [b for b in live if b >= n]
        holes = [b for b in range(n) if q.owner[b] < 0][: len(movers)]
        if movers:
            dev = self.tok.device
            src, dst = torch.tensor(movers, device=dev), torch.tensor(holes, device=dev)
            for buf in (self.tok, self.slots, self.u, self.out_tok, self.out_lp, self.col,
                        self.cap, self.done, self.kv.pos):
                buf[dst] = buf[src]
            written = max(len(q.prompts[q.owner[b]]) + q.cols[b] for b in movers)
            self.kv.copy_rows(holes, movers, min(written, self.length))
            for d, b in zip(holes, movers, strict=True):
                q.owner[d], q.cols[d], q.toks[d], q.used[d] = q.owner[b], q.cols[b], q.toks[b], True
                q.owner[b], q.toks[b] = -1, []
        self.rows = self.kv.rows = n
        if self.bank is not None:
            self.bank.set_slot_ids_(self.slots[:n])

    def _at_width(self, width: int) -> Callable[[], None]:
        """The decode step over `width` cache positions and the current rows: its graph
        (captured on first use) or the eager step."""
        self.width = self.kv.width = width
        self.widths.add(width)
        self.row_counts.add(self.rows)
        if self.params.max_new_tokens > 1 and (
            (self.compiled is not None and not self._compiled)
            or (self.use_graph and (self.rows, width) not in self.graphs)
        ):
            self._timed("capture_s", self._prepare)
        graph = self.graph
        return self._step if graph is None else graph.replay

    def _collect(self, q: _Queue, stop_fn: StopFn | None) -> list[int]:
        """Move finished rows' results to `q.out` and free their rows; the prompts finished."""
        done, q.cols = self.done.tolist(), self.col.tolist()
        owned = [b for b in range(self.batch) if q.owner[b] >= 0]
        keep = {b: (q.cols[b], False) for b in owned if done[b]}
        if stop_fn is not None and owned:  # rows that just ended may have passed a stop too
            self._fetch_tokens(q, owned)
            stops = []
            for b in owned:
                n = stop_fn(q.owner[b], q.toks[b])
                if n is not None and (not done[b] or n < q.cols[b]):
                    keep[b] = (min(n, q.cols[b]), True)
                    stops.append(b)
            if stops:
                self.done[torch.tensor(stops, device=self.done.device)] = True
        if not keep:
            return []
        rows = sorted(keep)
        width = max(n for n, _ in keep.values())
        idx = torch.tensor(rows, device=self.out_tok.device)
        toks = self.out_tok[:, :width].index_select(0, idx).cpu()
        lps = self.out_lp[:, :width].index_select(0, idx).cpu()
        finished = [q.owner[b] for b in rows]
        for j, b in enumerate(rows):
            n, stopped = keep[b]
            q.out[q.owner[b]] = (toks[j, :n].tolist(), lps[j, :n].tolist(), stopped)
            q.owner[b] = -1
            q.toks[b] = []
        return finished

    def _fetch_tokens(self, q: _Queue, owned: list[int]) -> None:
        """Append to each owned row's host tokens only the columns written since the last
        check: one small copy per check instead of every row's whole output."""
        seen = [len(q.toks[b]) for b in owned]
        new = max(q.cols[b] - s for b, s in zip(owned, seen, strict=True))
        if new <= 0:
            return
        dev = self.out_tok.device
        cols = torch.tensor(seen)[:, None] + torch.arange(new)
        rows = torch.tensor(owned)[:, None]
        got = self.out_tok[rows.to(dev), cols.clamp(max=self.params.max_new_tokens).to(dev)]
        for b, s, row in zip(owned, seen, got.tolist(), strict=True):
            q.toks[b].extend(row[: q.cols[b] - s])

    def _admit(self, q: _Queue, free: list[int]) -> None:
        """Start the next waiting prompts in the free rows: each distinct (slot, prompt) is
        prefilled once, in this admission or (while its row still runs) an earlier one; its
        copies get its cache rows and first-token logits."""
        if all(self._fits(q, i) for i in q.waiting):
            take = [q.waiting.popleft() for _ in range(min(len(free), len(q.waiting)))]
        else:  # those too long for this cache wait for a re-grid, in order
            take = [i for i in q.waiting if self._fits(q, i)][: len(free)]
            taken = set(take)
            q.waiting = deque(i for i in q.waiting if i not in taken)
        if not take:
            return
        rows = free[: len(take)]
        live = {q.keys[i]: b for b, i in enumerate(q.owner) if i >= 0}  # prompt cache intact
        fresh: list[int] = []  # positions in `take` to prefill
        new: dict[int, int] = {}  # key -> its position in `fresh`
        copies: list[tuple[int, int]] = []  # (row, source row) of shared prefills
        pick: list[int | torch.Tensor] = []  # each admitted row's logits: fresh index or row
        for j, i in enumerate(take):
            k = q.keys[i]
            if k in live and k in q.first:
                copies.append((rows[j], live[k]))
                pick.append(q.first[k])
            elif k in new:
                copies.append((rows[j], rows[fresh[new[k]]]))
                pick.append(new[k])
            else:
                new[k] = len(fresh)
                fresh.append(j)
                pick.append(new[k])
        for b, i in zip(rows, take, strict=True):
            q.owner[b], q.cols[b], q.toks[b] = i, 1, []
            self.refills += q.used[b]
            q.used[b] = True
            q.left[q.keys[i]] -= 1
        prefilled = self._prefill(
            [q.prompts[take[j]] for j in fresh],
            [q.slots[take[j]] for j in fresh],
            [rows[j] for j in fresh],
        )
        if copies:
            self.shared += len(copies)
            width = max(len(q.prompts[q.owner[d]]) for d, _ in copies)
            self.kv.copy_rows([d for d, _ in copies], [s for _, s in copies], width)
        logits = torch.stack([prefilled[p] if isinstance(p, int) else p for p in pick])
        for k, j in {q.keys[i]: j for j, i in enumerate(take)}.items():
            if q.left[k] > 0:
                q.first[k] = logits[j].clone()  # for copies admitted later
            else:
                q.first.pop(k, None)
        self._start(rows, logits, torch.stack([q.u[i] for i in take]),
                    [len(q.prompts[i]) for i in take], [q.slots[i] for i in take],
                    [q.caps[i] for i in take])

    def prefill(
        self,
        prompts: Sequence[Sequence[int]],
        slots: Sequence[int],
        rows: Sequence[int],
        u: torch.Tensor,
    ) -> None:
        """Fill cache `rows` with `prompts` (chunked) and sample each row's first token."""
        logits = self._prefill(prompts, slots, rows)
        self._start(rows, logits, u, [len(p) for p in prompts], slots,
                    [self.params.max_new_tokens] * len(rows))

    def _prefill(
        self, prompts: Sequence[Sequence[int]], slots: Sequence[int], rows: Sequence[int]
    ) -> torch.Tensor:
        """Fill cache `rows` with `prompts` (chunked); the logits [n, V] after each prompt."""
        dev = self.tok.device
        hidden_all: torch.Tensor | None = None
        widths = [len(p) for p in prompts]
        for group, chunk in prefill_chunks(widths, self.prefill_tokens):
            group = sorted(group, key=lambda i: slots[i])  # slot order: grouped LoRA kernel
            width = max(widths[i] for i in group)
            ids = torch.zeros(len(group), width, dtype=torch.long)
            for j, i in enumerate(group):
                ids[j, : widths[i]] = torch.as_tensor(list(prompts[i]), dtype=torch.long)
            ids = ids.to(dev)
            at = torch.tensor([rows[i] for i in group], device=dev)
            last = torch.tensor([widths[i] - 1 for i in group], device=dev)
            hidden = torch.empty(0)
            with route(self.bank, torch.tensor([slots[i] for i in group])), \
                    _prefill_weights(self.bank, self.dtype):
                for s in range(0, width, chunk):
                    e = min(s + chunk, width)
                    self.kv.prefill = Prefill(at, s)
                    try:
                        h = self.model.get_decoder()(
                            input_ids=ids[:, s:e],
                            position_ids=torch.arange(s, e, device=dev).expand(len(group), -1),
                            use_cache=False,
                        ).last_hidden_state
                    finally:
                        self.kv.prefill = None
                    self.timing["prefills"] += 1
                    self.timing["prefill_tokens"] += len(group) * (e - s)  # padding included
                    ends = (last >= s) & (last < e)  # rows whose last prompt token is here
                    pick = h[torch.arange(len(group), device=dev), (last - s).clamp(0, e - s - 1)]
                    hidden = pick if s == 0 else torch.where(ends[:, None], pick, hidden)
            if hidden_all is None:
                hidden_all = hidden.new_empty(len(prompts), hidden.shape[-1])
            hidden_all[torch.tensor(group, device=dev)] = hidden
        if hidden_all is None:
            return torch.empty(0, device=dev)
        return self.model.get_output_embeddings()(hidden_all)

    def _start(
        self,
        rows: Sequence[int],
        logits: torch.Tensor,
        u: torch.Tensor,
        lengths: Sequence[int],
        slots: Sequence[int],
        caps: Sequence[int],
    ) -> None:
        """Sample the first token of prompts (of `lengths`, prefilled into `rows`, `logits`
        after their last token, at most `caps` new tokens) and set the rows' decode state;
        the routing follows."""
        dev = self.tok.device
        at = torch.tensor(list(rows), device=dev)
        u = u.to(dev)
        tok, lp = sample(logits, u[:, 0], self.params.temperature, self.params.top_p)
        cap = torch.tensor(list(caps), device=dev)
        self.u[at] = u
        self.out_tok[at, 0] = tok
        self.out_lp[at, 0] = lp
        self.done[at] = torch.isin(tok, self.eos) | (cap == 1)
        self.cap[at] = cap
        self.col[at] = 1
        self.tok[at] = tok
        self.kv.pos[at] = torch.tensor(list(lengths), device=dev)
        self.slots[at] = torch.tensor(list(slots), device=dev)
        if self.bank is not None:  # the step's routing (prefill re-routed)
            self.bank.set_slot_ids_(self.slots[: self.rows])

    def _logits(self) -> torch.Tensor:
        """Logits [rows, V] of each running row's next token (the part of a step that is
        compiled)."""
        b, pos = self.rows, self.kv.pos[: self.rows]
        # the kernel reads each row's positions; the reference's mask is made once, not a layer
        mask = None if self.own_rows else decode_attention.row_mask(pos, self.width, self.dtype)
        out = self.model(input_ids=self.tok[:b].view(b, 1), attention_mask=mask,
                         position_ids=pos.view(b, 1), use_cache=False)
        return out.logits[:, -1]

    def _step(self) -> None:
        """Feed each running row's last token, sample its next: fixed shapes, no host sync."""
        steps, n = self.params.max_new_tokens, self.rows
        done, col, pos = self.done[:n], self.col[:n], self.kv.pos[:n]
        logits = (self.compiled or self._logits)()
        u = self.u[:n].gather(1, col.clamp(max=steps - 1).view(-1, 1)).view(-1)
        tok, lp = sample(logits, u, self.params.temperature, self.params.top_p)
        at = torch.where(done, steps, col).view(-1, 1)  # done rows: spare column
        self.out_tok[:n].scatter_(1, at, tok.view(-1, 1))
        self.out_lp[:n].scatter_(1, at, lp.view(-1, 1))
        col += ~done
        done |= torch.isin(tok, self.eos) | (col >= self.cap[:n])
        pos += ~done
        self.tok[:n].copy_(tok)

    def _prepare(self) -> None:
        """Compile (if asked, once) and capture (on CUDA) the step at the current width, then
        restore the state they advanced; the tokens and cache entries they wrote are
        overwritten by the real steps."""
        state = [self.tok, self.done, self.col, self.kv.pos]
        saved = [x.clone() for x in state]
        if self.compiled is not None and not self._compiled:
            self._compiled = True
            self._logits()  # eager first: lazily built bank caches exist before tracing
            try:
                self.compiled()
            except Exception as e:  # noqa: BLE001 - any compiler failure: run uncompiled
                warnings.warn(f"torch.compile of the decode step failed: {e}", stacklevel=3)
                self.compiled = None
        if self.use_graph and (self.rows, self.width) not in self.graphs:
            self._capture()
        for x, s in zip(state, saved, strict=True):
            x.copy_(s)

    def _capture(self) -> None:
        """Warm up on a side stream and capture one step (`_prepare` restores the state).

        Every (rows, width) graph shares one memory pool: they never run at the same time, and
        all state lives in the decoder's static buffers."""
        step = self._step
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    step()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            # thread-local: another thread's CUDA calls (NCCL's watchdog, a compiler's
            # workers) must not invalidate the capture; the step itself never syncs
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                step()
            self._pool = self._pool if self._pool is not None else graph.pool()
            self.graphs[self.rows, self.width] = graph
        except RuntimeError as e:  # e.g. a host sync inside routing: decode eagerly instead
            warnings.warn(f"CUDA graph capture failed ({self.rows} rows, width {self.width}), "
                          f"decoding eagerly: {e}", stacklevel=2)
            self.use_graph = False
            torch.cuda.synchronize()
