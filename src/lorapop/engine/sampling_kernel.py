"""The token sampler of `sampling.sample` as one Triton kernel (temperature > 0, top-p 1).

The plain sampler makes ~8 passes over a [rows, vocabulary] float32 copy of the logits (the
cast, log-softmax, the scaled softmax, a cumulative sum, a search, gathers): at a 152k
vocabulary and a few hundred rows, 0.5-0.8 ms of each 7B decode step on an H200. Here one
program per row reads its bf16 logits once for the maxima and sums of exponentials (the
policy's at temperature 1 and the draw's at the temperature), then scans the draw's
unnormalised cumulative sum from the start only until it passes u x the total: the token is
the first whose cumulative mass exceeds u, as `sampling.sample` draws it, from the row's own
uniform. The sums run in another order than torch's scan, so where u x the total falls within
float32 rounding of a boundary the kernel may draw a token on its other side (any tokens
between the two hold no mass to speak of); tests/engine/test_sampling_kernel.py compares the
two on the GPU.
"""

from __future__ import annotations

import torch

from lorapop.kernels import built, failed

BLOCK = 4096  # vocabulary entries per inner step

#: why the kernel failed to build or run on this machine (the plain sampler runs from then on)
failure: str | None = None


_kernel = built(lambda: _build())  # the kernel, or None without Triton


def usable(logits: torch.Tensor, temperature: float, top_p: float) -> bool:
    """Whether `sampling.sample` runs the kernel for these logits and parameters."""
    return (logits.is_cuda and logits.dim() == 2 and temperature > 0 and top_p == 1
            and failure is None and not torch.compiler.is_compiling() and _kernel() is not None)


def sample(logits: torch.Tensor, u: torch.Tensor, temperature: float
           ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Tokens [B] and their log-probabilities at temperature 1 [B] from logits [B, V] (last dim
    contiguous) and uniforms u [B], or None if the kernel failed here (it warns once; the
    caller then samples with torch)."""
    global failure
    try:
        if logits.stride(-1) != 1:
            logits = logits.contiguous()
        rows, vocab = logits.shape
        tok = torch.empty(rows, dtype=torch.long, device=logits.device)
        lp = torch.empty(rows, dtype=torch.float32, device=logits.device)
        u = u.to(device=logits.device, dtype=torch.float32).contiguous()  # e.g. a column
        _kernel()[(rows,)](logits, u, tok, lp,
                           vocab, logits.stride(0), float(temperature), BLOCK=BLOCK,
                           num_warps=8)
        return tok, lp
    except torch.OutOfMemoryError:
        raise
    except Exception as e:  # noqa: BLE001 - any compiler or launch failure: the plain sampler
        failure = failed(e, "sampling kernel", "sampling with torch")
        return None


def _build():
    import triton
    import triton.language as tl

    @triton.jit
    def _sample_kernel(Logits, U, Tok, Lp, vocab, stride, temperature, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        base = Logits + row.to(tl.int64) * stride
        offs = tl.arange(0, BLOCK)
        # pass 1: running max and sum of exponentials, at temperature 1 and at the draw's
        m = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), 0)
        s = tl.sum(tl.zeros([BLOCK], tl.float32), 0)
        mt = m
        st = s
        for v0 in range(0, vocab, BLOCK):
            x = tl.load(base + v0 + offs, mask=v0 + offs < vocab, other=float("-inf"))
            x = x.to(tl.float32)
            m_new = tl.maximum(m, tl.max(x, 0))
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
            m = m_new
            xt = x / temperature
            mt_new = tl.maximum(mt, tl.max(xt, 0))
            st = st * tl.exp(mt - mt_new) + tl.sum(tl.exp(xt - mt_new), 0)
            mt = mt_new
        # pass 2: the first token whose cumulative mass exceeds u x total (stay strictly
        # below the total, as the plain sampler does)
        u = tl.load(U + row)
        target = tl.minimum(u * st, st * (1 - 1e-6))
        idx = vocab - 1
        carry = st * 0
        v0 = vocab * 0
        while v0 < vocab:
            at = v0 + offs
            ok = at < vocab
            xt = tl.load(base + at, mask=ok, other=float("-inf")).to(tl.float32) / temperature
            p = tl.where(ok, tl.exp(xt - mt), 0.0)
            c = tl.cumsum(p, 0) + carry
            first = tl.min(tl.where((c > target) & ok, at, vocab), 0)
            if first < vocab:
                idx = first
                v0 = vocab
            else:
                carry = carry + tl.sum(p, 0)
                v0 = v0 + BLOCK
        x_tok = tl.load(base + idx).to(tl.float32)
        tl.store(Tok + row, idx.to(tl.int64))
        tl.store(Lp + row, x_tok - m - tl.log(s))

    return _sample_kernel
