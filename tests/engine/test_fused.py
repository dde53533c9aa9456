"""Fused RMSNorm and SwiGLU: the base model's outputs and gradients are unchanged."""

from __future__ import annotations

import shutil

import pytest
import torch

from lorapop.engine.fused import (
    _silu_mul,
    _silu_mul_grad,
    compile_failures,
    compiled_call,
    decoder_layers,
    fuse_mlps,
    fuse_rms_norms,
    mlps_fused,
    unfuse_mlps,
    unfuse_rms_norms,
    use_compiled_layers,
)
from lorapop.engine.logprobs import sequence_logprobs, warm_up_compiled_layers
from lorapop.engine.model import load_base_model, load_tokenizer
from lorapop.lora.bank import AdapterBank
from tiny_models import VOCAB, tiny_model

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_norms_give_the_same_logits_and_gradients(arch, dtype, device):
    model = tiny_model(arch).to(device=device, dtype=dtype)
    ids = torch.randint(0, VOCAB, (3, 9), generator=torch.Generator().manual_seed(0)).to(device)
    emb = model.get_input_embeddings()

    def run():
        x = emb(ids).detach().requires_grad_()
        logits = model(inputs_embeds=x).logits
        logits.float().square().mean().backward()
        return logits.detach(), x.grad

    ref = run()
    layers = model.config.num_hidden_layers
    assert fuse_rms_norms(model) == 2 * layers + 1  # two per layer and the final norm
    fused = run()
    # on CPU the composite rms_norm does the same arithmetic as the original: bit for bit;
    # CUDA's fused kernel sums in another order (a rounding step in bf16)
    tol = 0 if device == "cpu" else 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(fused[0], ref[0], rtol=tol, atol=tol)
    torch.testing.assert_close(fused[1], ref[1], rtol=tol, atol=tol)
    unfuse_rms_norms(model)
    assert all("forward" not in vars(m) for m in model.modules())


def test_loaded_base_models_run_the_fused_norms():
    model = load_base_model("tiny-random", load_tokenizer("tiny-random"), device="cpu")
    norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]
    assert norms and all("forward" in vars(m) for m in norms)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_mlps_give_the_same_logits_and_gradients(arch, dtype, device):
    """Training forwards run the fused SwiGLU (own backward, compiled on CUDA): the logits
    and input gradients of the plain MLP; inference forwards run the plain kernels."""
    model = tiny_model(arch).to(device=device, dtype=dtype)
    ids = torch.randint(0, VOCAB, (3, 9), generator=torch.Generator().manual_seed(0)).to(device)
    emb = model.get_input_embeddings()

    def run():
        x = emb(ids).detach().requires_grad_()
        logits = model(inputs_embeds=x).logits
        logits.float().square().mean().backward()
        with torch.no_grad():
            inference = model(inputs_embeds=x).logits
        return logits.detach(), x.grad, inference

    ref = run()
    assert not mlps_fused(model)
    assert fuse_mlps(model) == model.config.num_hidden_layers
    assert mlps_fused(model)
    fused = run()
    # one float32 rounding of silu(gate) * up instead of two roundings to the dtype
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(fused[0], ref[0], rtol=tol, atol=tol)
    torch.testing.assert_close(fused[1], ref[1], rtol=tol, atol=tol)
    torch.testing.assert_close(fused[2], ref[2], rtol=0, atol=0)  # the same kernels
    assert not compile_failures
    unfuse_mlps(model)
    assert not mlps_fused(model)


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                    reason="torch.compile on CPU needs a C compiler")
def test_compiled_swiglu_passes_equal_the_eager_ones_on_cpu():
    """CUDA's compiled passes, compiled here for the CPU, give the eager values, and the
    eager backward equals autograd through the plain formula."""
    g0 = torch.randn(5, 7, generator=torch.Generator().manual_seed(1))
    u0, d = torch.randn(5, 7), torch.randn(5, 7)
    gate, up = g0.clone().requires_grad_(), u0.clone().requires_grad_()
    (torch.nn.functional.silu(gate) * up).backward(d)
    for fn, args in ((_silu_mul, (g0, u0)), (_silu_mul_grad, (g0, u0, d))):
        torch.testing.assert_close(compiled_call(fn, *args), fn(*args))
    assert not compile_failures
    torch.testing.assert_close(_silu_mul_grad(g0, u0, d), (gate.grad, up.grad))


def _update_grads(model, bank, cases, dtype):
    out = []
    for prompts, comps, slots, share in cases:
        bank.zero_grad()
        with bank.held_copy(dtype):
            lp, mask = sequence_logprobs(model, bank, prompts, comps, slots, share_prompts=share)
            lp[mask].sum().backward()
        out.append((lp.detach().float(), bank.grads.clone()))
    bank.zero_grad()
    return out


LAYER_CASES = [([[5, 6, 7], [8, 9], [4, 4, 4, 4]], [[11, 12], [13], [3, 3, 9]], [0, 1, 2], False),
               ([[5, 6, 7], [5, 6, 7], [9, 2]], [[11, 12, 1], [13, 14], [15]], [1, 1, 2], True),
               ([[7, 8, 9, 10, 11]], [[12, 13, 14]], [2], False)]


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                    reason="torch.compile on CPU needs a C compiler")
def test_compiled_layers_give_the_eager_update_on_cpu():
    """The update's compiled decoder layers (`train.compile`; CUDA's path, compiled here for
    the CPU) give the eager log-probs and bank gradients: unshared rows of several slots,
    shared-prompt packs and one row, with one graph serving every compiled layer."""
    model = tiny_model(layers=3)
    bank = AdapterBank(model, n_slots=3, rank=4, alpha=8.0)
    with torch.no_grad():
        bank.weights.normal_(0.0, 0.3, generator=torch.Generator().manual_seed(2))
    model.train()
    eager = _update_grads(model, bank, LAYER_CASES, torch.float32)
    assert warm_up_compiled_layers(model, bank) and not compile_failures
    assert not bank.grads.any()  # the warm-up leaves the gradients as they were
    use_compiled_layers(model, True)
    compiled = _update_grads(model, bank, LAYER_CASES, torch.float32)
    use_compiled_layers(model, False)
    assert not compile_failures
    assert all(layer._compiled_call_impl is None for layer in decoder_layers(model))
    for (lp_e, g_e), (lp_c, g_c) in zip(eager, compiled, strict=True):
        torch.testing.assert_close(lp_c, lp_e, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(g_c, g_e, atol=1e-5, rtol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 grouped LoRA kernels on CUDA")
def test_compiled_layers_on_cuda_are_as_close_to_float32_as_eager_bf16():
    """On CUDA in bf16 (the grouped LoRA kernel inside the compiled graph): the compiled
    update is no further from the float32 update than the eager bf16 one."""
    ref_model = tiny_model(layers=3).cuda()
    model = tiny_model(layers=3).cuda().to(torch.bfloat16)
    fuse_mlps(model)
    banks = [AdapterBank(m, n_slots=3, rank=8, alpha=8.0) for m in (ref_model, model)]
    with torch.no_grad():
        banks[0].weights.normal_(0.0, 0.3, generator=torch.Generator("cuda").manual_seed(2))
        banks[1].weights.copy_(banks[0].weights)
    ref_model.train()
    model.train()
    cases = [(p, c, s, share) for p, c, s, share in LAYER_CASES]
    ref = _update_grads(ref_model, banks[0], cases, torch.float32)
    eager = _update_grads(model, banks[1], cases, torch.bfloat16)
    assert warm_up_compiled_layers(model, banks[1]) and not compile_failures
    use_compiled_layers(model, True)
    compiled = _update_grads(model, banks[1], cases, torch.bfloat16)
    use_compiled_layers(model, False)
    assert not compile_failures

    def rel(a, b):
        return float((a - b).norm() / b.norm())

    for (lp_r, g_r), (lp_e, g_e), (lp_c, g_c) in zip(ref, eager, compiled, strict=True):
        assert rel(lp_c, lp_r) <= 1.5 * rel(lp_e, lp_r) + 1e-3
        assert rel(g_c, g_r) <= 1.5 * rel(g_e, g_r) + 1e-2
