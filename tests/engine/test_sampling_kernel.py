"""The Triton sampler (`engine/sampling_kernel`) against the torch sampler it stands in for.

The kernel runs on CUDA only (the CPU build of torch has no Triton): on a CPU the dispatch
and the fallback are tested, on a GPU the draws themselves.
"""

from __future__ import annotations

import pytest
import torch

from lorapop.engine import sampling, sampling_kernel

KERNEL = torch.cuda.is_available() and sampling_kernel._kernel() is not None


def _torch_sample(logits, u, temperature):
    """`sampling.sample`'s torch code (the kernel switched off)."""
    real = sampling_kernel.usable
    try:
        sampling_kernel.usable = lambda *a: False
        return sampling.sample(logits, u, temperature, 1.0)
    finally:
        sampling_kernel.usable = real


def test_the_kernel_runs_only_where_it_applies():
    cpu = torch.zeros(2, 10)
    assert not sampling_kernel.usable(cpu, 1.0, 1.0)  # CPU: the torch sampler
    if torch.cuda.is_available():
        gpu = cpu.cuda()
        assert sampling_kernel.usable(gpu, 1.0, 1.0) == KERNEL
        assert not sampling_kernel.usable(gpu, 0.0, 1.0)  # greedy: argmax
        assert not sampling_kernel.usable(gpu, 1.0, 0.9)  # top-p: sorted draws


def test_a_kernel_that_fails_warns_once_and_torch_samples(monkeypatch):
    """An older GPU or a Triton that cannot build the kernel slows sampling; it never stops it."""
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    u = torch.rand(4, generator=torch.Generator().manual_seed(1))
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("PassManager::run failed\nmore detail")

    monkeypatch.setattr(sampling_kernel, "failure", None)
    monkeypatch.setattr(sampling_kernel, "usable",
                        lambda *a: sampling_kernel.failure is None)
    monkeypatch.setattr(sampling_kernel, "_kernel", lambda: _Broken(broken))
    want = _torch_sample(logits, u, 1.0)
    with pytest.warns(UserWarning, match="PassManager::run failed"):
        got = sampling.sample(logits, u, 1.0, 1.0)
    assert [g.tolist() for g in got] == [w.tolist() for w in want]
    got = sampling.sample(logits, u, 1.0, 1.0)  # not retried, no warning
    assert [g.tolist() for g in got] == [w.tolist() for w in want]
    assert calls == [1]
    assert sampling_kernel.failure == "RuntimeError: PassManager::run failed"


class _Broken:
    """A kernel whose launch (`kernel[grid](...)`) raises."""

    def __init__(self, launch):
        self.launch = launch

    def __getitem__(self, grid):
        return self.launch


@pytest.mark.skipif(not KERNEL, reason="the Triton kernel needs CUDA and Triton")
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_draws_the_torch_samplers_tokens(temperature, dtype):
    """Rows of a 152k vocabulary, uniforms at the edges too (one a strided column, as the
    decoder passes a prompt's first uniforms): the same tokens as the torch sampler, except
    where u x total falls within float32 rounding of a boundary (the sums run in another
    order; the tokens between the two draws then hold no mass to speak of), and the same
    temperature-1 log-probabilities."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows, vocab = 300, 152064
    logits = (torch.randn(rows, vocab, device="cuda", generator=gen) * 4).to(dtype)
    u = torch.rand(rows, 2, device="cuda", generator=gen)[:, 1]
    u[:3] = torch.tensor([0.0, 0.5, 1 - 2**-24], device="cuda")
    tok, lp = sampling.sample(logits, u, temperature, 1.0)
    ref_tok, ref_lp = _torch_sample(logits, u, temperature)
    differ = (tok != ref_tok).nonzero().flatten().tolist()
    assert len(differ) <= rows // 20
    cdf = torch.softmax(logits.double() / temperature, dim=-1).cumsum(dim=-1)
    for r in differ:  # the mass up to either draw is the target, to rounding
        lo, hi = sorted((int(tok[r]), int(ref_tok[r])))
        target = float(u[r])
        assert abs(float(cdf[r, lo]) - target) < 1e-5
        assert abs(float(cdf[r, hi - 1]) - target) < 1e-5
    torch.testing.assert_close(lp, torch.log_softmax(logits.float(), -1).gather(
        -1, tok.view(-1, 1)).view(-1), rtol=0, atol=2e-5)
    same = tok == ref_tok
    torch.testing.assert_close(lp[same], ref_lp[same], rtol=0, atol=2e-5)
