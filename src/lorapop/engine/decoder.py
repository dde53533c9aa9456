"""Batched decoding of a fixed-size, mixed-adapter batch over a static KV cache.

Prompts are left-padded to a common length P; each row's position ids count only its real
tokens, and padding is masked out of every attention. The decode step is a pure function of
static device buffers (token, cache position, step index, uniforms), so on CUDA it is captured
once in a graph and replayed; on CPU the same step runs eagerly. Adapter routing is entered
once per batch, outside the step: the bank fills its per-batch-size index buffers in place,
so the captured step reads each new batch's routing. Rows must come sorted by slot (the
bank's grouped kernel then skips its gathers, and that choice is baked into the graph).
The bank's decode cache (a compute-dtype copy of its weights, read by the graph) is brought
up to date before every batch.

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
from collections.abc import Callable, Sequence
from typing import Any

import torch

from lorapop.engine.kvcache import StaticKV, static_kv
from lorapop.engine.sampling import SamplingParams, sample

# host callback: (tokens so far [B, n] on CPU, n, rows still running) -> rows that hit a stop
StopFn = Callable[[torch.Tensor, int, list[int]], list[int]]


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
    ) -> None:
        cfg = model.config.get_text_config()
        param = next(model.parameters())
        dev, steps = param.device, params.max_new_tokens
        heads = cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        self.model, self.bank, self.params = model, bank, params
        self.batch, self.length = batch, length
        self.kv = StaticKV(
            cfg.num_hidden_layers, batch, kv_heads, length, head_dim, param.dtype, dev
        )
        self.tok = torch.zeros(batch, dtype=torch.long, device=dev)
        self.slots = torch.zeros(batch, dtype=torch.long, device=dev)
        self.pos_off = torch.zeros(batch, dtype=torch.long, device=dev)  # position id - cache index
        self.key_ok = torch.zeros(batch, length, dtype=torch.bool, device=dev)
        self.arange = torch.arange(length, device=dev)
        self.u = torch.zeros(batch, steps, device=dev)
        self.out_tok = torch.zeros(batch, steps, dtype=torch.long, device=dev)
        self.out_lp = torch.zeros(batch, steps, device=dev)
        self.done = torch.zeros(batch, dtype=torch.bool, device=dev)
        self.step = torch.zeros((), dtype=torch.long, device=dev)  # column of the next token
        self.eos = torch.tensor(list(eos_ids), dtype=torch.long, device=dev)
        self.bias = torch.tensor([0.0, float("-inf")], dtype=param.dtype, device=dev)
        self.use_graph = cuda_graph and dev.type == "cuda" and steps > 3
        self.graph: torch.cuda.CUDAGraph | None = None
        self.compiled: Callable[[], torch.Tensor] | None = None
        self._ready = False
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
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens [B, n] and their logprobs [B, n] on CPU; n < max_new_tokens when all stopped."""
        steps = self.params.max_new_tokens
        host = torch.zeros(self.batch, steps, dtype=torch.long)
        stopped = [False] * self.batch
        self.slots.copy_(torch.as_tensor(list(slots), dtype=torch.long))
        if hasattr(self.bank, "sync_caches"):
            self.bank.sync_caches()  # the graph reads the cache: refresh it in place
        with static_kv(self.model, self.kv), route(self.bank, self.slots):
            self.prefill(prompts, u)
            if not self._ready and steps > 1:
                self._prepare()
            n, seen = 1, 0
            while n < steps:
                if self.graph is not None:
                    self.graph.replay()
                else:
                    self._step()
                n += 1
                if n % check_every and n < steps:
                    continue
                host[:, seen:n] = self.out_tok[:, seen:n].cpu()
                seen = n
                done = self.done.tolist()
                running = [b for b in range(self.batch) if not (done[b] or stopped[b])]
                if stop_fn is not None and running:
                    for b in stop_fn(host, n, running):
                        stopped[b] = True
                if all(d or s for d, s in zip(done, stopped, strict=True)):
                    break
        host[:, seen:n] = self.out_tok[:, seen:n].cpu()
        return host[:, :n], self.out_lp[:, :n].cpu()

    def prefill(self, prompts: Sequence[Sequence[int]], u: torch.Tensor) -> None:
        """Fill the cache with the prompts and sample every row's first token."""
        b, dev = self.batch, self.tok.device
        width = max(len(p) for p in prompts)
        if width + self.params.max_new_tokens - 1 > self.length:
            raise ValueError(f"prompt of {width} tokens does not fit a cache of {self.length}")
        ids = torch.zeros(b, width, dtype=torch.long)
        real = torch.zeros(b, width, dtype=torch.bool)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.as_tensor(list(p), dtype=torch.long)
            real[i, width - len(p) :] = True
        ids, real = ids.to(dev), real.to(dev)
        self.u.copy_(u)
        self.key_ok.fill_(True)
        self.key_ok[:, :width] = real
        self.pos_off.copy_(real.sum(1) - width)
        positions = (real.cumsum(1) - 1).clamp_(min=0)
        causal = torch.ones(width, width, dtype=torch.bool, device=dev).tril_()
        mask = causal & real[:, None, :]
        mask |= torch.eye(width, dtype=torch.bool, device=dev)  # padding attends to itself: no NaN
        self.kv.prefilling = True
        try:
            out = self.model(
                input_ids=ids,
                attention_mask=mask[:, None],
                position_ids=positions,
                use_cache=False,
                logits_to_keep=1,
            )
        finally:
            self.kv.prefilling = False
        tok, lp = sample(
            out.logits[:, -1], self.u[:, 0], self.params.temperature, self.params.top_p
        )
        self.out_tok[:, 0] = tok
        self.out_lp[:, 0] = lp
        self.done.copy_(torch.isin(tok, self.eos))
        self.tok.copy_(tok)
        self.kv.pos.fill_(width)
        self.step.fill_(1)

    def _logits(self) -> torch.Tensor:
        """Logits [B, V] of each row's next token (the part of a step that is compiled)."""
        b, t = self.batch, self.kv.pos
        ok = (self.key_ok & (self.arange <= t)).view(b, 1, 1, self.length)
        mask = torch.where(ok, self.bias[0], self.bias[1])  # additive: SDPA needs no conversion
        out = self.model(
            input_ids=self.tok.view(b, 1),
            attention_mask=mask,
            position_ids=(self.pos_off + t).view(b, 1),
            use_cache=False,
        )
        return out.logits[:, -1]

    def _step(self) -> None:
        """Feed each row's last token, sample the next: fixed shapes, no host sync."""
        b = self.batch
        logits = (self.compiled or self._logits)()
        col = self.step.view(1)
        u = self.u.index_select(1, col).view(b)
        tok, lp = sample(logits, u, self.params.temperature, self.params.top_p)
        self.out_tok.index_copy_(1, col, tok.view(b, 1))
        self.out_lp.index_copy_(1, col, lp.view(b, 1))
        self.done |= torch.isin(tok, self.eos)
        self.tok.copy_(tok)
        self.kv.pos += 1
        self.step += 1

    def _prepare(self) -> None:
        """Compile (if asked) and capture (on CUDA) the step, then restore the state they
        advanced; the tokens and cache entries they wrote are overwritten by the real steps."""
        state = [self.tok, self.done, self.step, self.kv.pos]
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
