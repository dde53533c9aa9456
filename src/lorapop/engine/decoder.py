"""Continuous batching of mixed-adapter rows over a static KV cache.

The decoder holds `batch` cache rows. Each prompt is prefilled into a free row (from cache
index 0, in chunks of at most `prefill_tokens` tokens per forward), then decoded; when a row
finishes (EOS, the caller's stop function, or its own max length) its result is collected and
the row is refilled with the next waiting prompt, so the batch stays full until the queue is
empty. A row's position ids are its cache indices and the decode mask is per row
(`key <= the row's position`), so rows of any length and age share a step.

The decode step is a pure function of static device buffers (tokens, per-row positions,
output columns, uniforms, done flags), so on CUDA it is captured once in a graph and
replayed; on CPU the same step runs eagerly. Finished rows keep running in the graph until
refilled, writing into a spare output column. Every row draws its uniforms from its own
stream (`row_uniforms(seed, key)`), indexed by its own output column: a prompt's tokens do not
depend on its batch-mates or on when it was admitted. Adapter routing is set in place
(`set_slot_ids_`) whenever rows change, so the captured step reads the current routing; the
bank's decode cache (a compute-dtype copy of its weights, read by the graph) is brought up to
date before every run.

With `compile=True` the model forward of the step (attention mask, model, LoRA hooks) goes
through torch.compile, which fuses the base model's small elementwise kernels (RMSNorm,
rotary, SiLU, residual adds); the sampler stays eager (inductor's scan over a 150k-token
vocabulary fails on CUDA, and the sampler is a handful of kernels). The whole step, compiled
part and sampler, is then captured in the graph as before. Shapes are static
(`dynamic=False`): one compilation per (batch, cache length, bank state), which `generate`
bounds by rounding both up to a few buckets. If compilation fails the decoder warns and runs
the plain forward.
"""

from __future__ import annotations

import contextlib
import warnings
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch

from lorapop.engine.kvcache import Prefill, StaticKV, kv_shape, static_kv
from lorapop.engine.sampling import SamplingParams, sample

# host callback: (prompt index, the row's tokens so far) -> how many tokens to keep if the
# row must stop now, else None
StopFn = Callable[[int, list[int]], int | None]
Result = tuple[list[int], list[float], bool]  # tokens, logprobs, ended by the stop function


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


class Decoder:
    """Static buffers, KV cache and (optionally) the CUDA graph for one batch size and length."""

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
    ) -> None:
        param = next(model.parameters())
        dev, steps = param.device, params.max_new_tokens
        layers, kv_heads, head_dim = kv_shape(model)
        self.model, self.bank, self.params = model, bank, params
        self.batch, self.length, self.prefill_tokens = batch, length, prefill_tokens
        self.kv = StaticKV(layers, batch, kv_heads, length, head_dim, param.dtype, dev)
        self.tok = torch.zeros(batch, dtype=torch.long, device=dev)
        self.slots = torch.zeros(batch, dtype=torch.long, device=dev)
        self.arange = torch.arange(length, device=dev)
        self.u = torch.zeros(batch, steps, device=dev)
        # one spare column: rows that are done write there until they are refilled
        self.out_tok = torch.zeros(batch, steps + 1, dtype=torch.long, device=dev)
        self.out_lp = torch.zeros(batch, steps + 1, device=dev)
        self.col = torch.zeros(batch, dtype=torch.long, device=dev)  # tokens written per row
        self.done = torch.ones(batch, dtype=torch.bool, device=dev)
        self.eos = torch.tensor(list(eos_ids), dtype=torch.long, device=dev)
        self.bias = torch.tensor([0.0, float("-inf")], dtype=param.dtype, device=dev)
        self.use_graph = cuda_graph and dev.type == "cuda" and steps > 3
        self.graph: torch.cuda.CUDAGraph | None = None
        self.compiled: Callable[[], torch.Tensor] | None = None
        self._ready = False
        self.refills = 0  # prompts admitted into a row that an earlier prompt had used
        if compile:
            self.compiled = _compile(self._logits)

    @torch.no_grad()
    def run(
        self,
        prompts: Sequence[Sequence[int]],
        slots: Sequence[int],
        u: torch.Tensor,
        stop_fn: StopFn | None = None,
        check_every: int = 8,
    ) -> list[Result]:
        """Each prompt's (tokens, logprobs, stopped by stop_fn), admitted in the given order.

        `u` [len(prompts), max_new_tokens] holds each prompt's uniforms. A row stops at EOS
        (returned), at max_new_tokens, or where `stop_fn` says (cut to the count it returns).
        """
        steps = self.params.max_new_tokens
        if max(len(p) for p in prompts) + steps - 1 > self.length:
            raise ValueError(f"a prompt + {steps} new tokens do not fit a cache of {self.length}")
        waiting = deque(range(len(prompts)))
        owner = [-1] * self.batch  # prompt index held by each row, -1: free
        used = [False] * self.batch
        out: list[Result | None] = [None] * len(prompts)
        self.done.fill_(True)
        if hasattr(self.bank, "sync_caches"):
            self.bank.sync_caches()  # the graph reads the cache: refresh it in place
        with static_kv(self.model, self.kv), route(self.bank, self.slots):
            self._admit(list(range(self.batch)), waiting, owner, used, prompts, slots, u)
            if not self._ready and steps > 1:
                self._prepare()
            n = 0
            while True:
                if n % check_every == 0:  # also right after the first prefill
                    free = self._collect(owner, out, stop_fn)
                    if free and waiting:
                        self._admit(free, waiting, owner, used, prompts, slots, u)
                    if all(o < 0 for o in owner):
                        break
                if self.graph is not None:
                    self.graph.replay()
                else:
                    self._step()
                n += 1
        return [o for o in out if o is not None]

    def _collect(
        self,
        owner: list[int],
        out: list[Result | None],
        stop_fn: StopFn | None,
    ) -> list[int]:
        """Move finished rows' results to `out`; returns the rows now free."""
        done, cols = self.done.tolist(), self.col.tolist()
        owned = [b for b in range(self.batch) if owner[b] >= 0]
        keep = {b: (cols[b], False) for b in owned if done[b]}
        if stop_fn is not None and owned:  # rows that just ended may have passed a stop too
            host = self.out_tok[:, : max(cols[b] for b in owned)].tolist()
            for b in owned:
                n = stop_fn(owner[b], host[b][: cols[b]])
                if n is not None and (not done[b] or n < cols[b]):
                    keep[b] = (min(n, cols[b]), True)
                    self.done[b] = True
        if not keep:
            return []
        rows = sorted(keep)
        idx = torch.tensor(rows, device=self.out_tok.device)
        toks = self.out_tok.index_select(0, idx).cpu()
        lps = self.out_lp.index_select(0, idx).cpu()
        for j, b in enumerate(rows):
            n, stopped = keep[b]
            out[owner[b]] = (toks[j, :n].tolist(), lps[j, :n].tolist(), stopped)
            owner[b] = -1
        return rows

    def _admit(
        self,
        free: list[int],
        waiting: deque[int],
        owner: list[int],
        used: list[bool],
        prompts: Sequence[Sequence[int]],
        slots: Sequence[int],
        u: torch.Tensor,
    ) -> None:
        """Prefill the next waiting prompts into the free rows; the routing follows."""
        take = [waiting.popleft() for _ in range(min(len(free), len(waiting)))]
        if not take:
            return
        rows = free[: len(take)]
        for b, i in zip(rows, take, strict=True):
            owner[b] = i
            self.refills += used[b]
            used[b] = True
        self.prefill([prompts[i] for i in take], [slots[i] for i in take], rows, u[take])
        if self.bank is not None:
            self.bank.set_slot_ids_(self.slots)  # the step's routing (prefill re-routed)

    def prefill(
        self,
        prompts: Sequence[Sequence[int]],
        slots: Sequence[int],
        rows: Sequence[int],
        u: torch.Tensor,
    ) -> None:
        """Fill cache `rows` with `prompts` (chunked) and sample each row's first token."""
        dev = self.tok.device
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
            with route(self.bank, torch.tensor([slots[i] for i in group])):
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
                    ends = (last >= s) & (last < e)  # rows whose last prompt token is here
                    pick = h[torch.arange(len(group), device=dev), (last - s).clamp(0, e - s - 1)]
                    hidden = pick if s == 0 else torch.where(ends[:, None], pick, hidden)
            logits = self.model.get_output_embeddings()(hidden)
            u_rows = u[group].to(dev)
            tok, lp = sample(logits, u_rows[:, 0], self.params.temperature, self.params.top_p)
            steps = self.params.max_new_tokens
            self.u[at] = u_rows
            self.out_tok[at, 0] = tok
            self.out_lp[at, 0] = lp
            self.done[at] = torch.isin(tok, self.eos) | (steps == 1)
            self.col[at] = 1
            self.tok[at] = tok
            self.kv.pos[at] = last + 1
            self.slots[at] = torch.tensor([slots[i] for i in group], device=dev)

    def _logits(self) -> torch.Tensor:
        """Logits [B, V] of each row's next token (the part of a step that is compiled)."""
        b, pos = self.batch, self.kv.pos
        ok = (self.arange <= pos[:, None]).view(b, 1, 1, self.length)
        mask = torch.where(ok, self.bias[0], self.bias[1])  # additive: SDPA needs no conversion
        out = self.model(
            input_ids=self.tok.view(b, 1),
            attention_mask=mask,
            position_ids=pos.view(b, 1),
            use_cache=False,
        )
        return out.logits[:, -1]

    def _step(self) -> None:
        """Feed each row's last token, sample its next: fixed shapes, no host sync."""
        steps = self.params.max_new_tokens
        logits = (self.compiled or self._logits)()
        col = self.col.clamp(max=steps - 1).view(-1, 1)
        tok, lp = sample(
            logits, self.u.gather(1, col).view(-1), self.params.temperature, self.params.top_p
        )
        at = torch.where(self.done, steps, self.col).view(-1, 1)  # done rows: spare column
        self.out_tok.scatter_(1, at, tok.view(-1, 1))
        self.out_lp.scatter_(1, at, lp.view(-1, 1))
        running = ~self.done
        self.col += running
        self.done |= torch.isin(tok, self.eos) | (self.col >= steps)
        self.kv.pos += ~self.done
        self.tok.copy_(tok)

    def _prepare(self) -> None:
        """Compile (if asked) and capture (on CUDA) the step, then restore the state they
        advanced; the tokens and cache entries they wrote are overwritten by the real steps."""
        state = [self.tok, self.done, self.col, self.kv.pos]
        saved = [x.clone() for x in state]
        if self.compiled is not None:
            self._logits()  # eager first: lazily built bank caches exist before tracing
            try:
                self.compiled()
            except Exception as e:  # noqa: BLE001 - any compiler failure: run uncompiled
                warnings.warn(f"torch.compile of the decode step failed: {e}", stacklevel=3)
                self.compiled = None
        if self.use_graph:
            self._capture()
        for x, s in zip(state, saved, strict=True):
            x.copy_(s)
        self._ready = True

    def _capture(self) -> None:
        """Warm up on a side stream and capture one step (`_prepare` restores the state)."""
        step = self._step
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    step()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            self.graph = graph
        except RuntimeError as e:  # e.g. a host sync inside routing: decode eagerly instead
            warnings.warn(f"CUDA graph capture failed, decoding eagerly: {e}", stacklevel=2)
            self.use_graph = False
            torch.cuda.synchronize()
