"""Fused RMSNorm, SwiGLU and rotary embedding: the base model's outputs and gradients are
unchanged."""

from __future__ import annotations

import shutil

import pytest
import torch

from lorapop.engine.fused import (
    _rope,
    _rope_grad,
    _silu_mul,
    _silu_mul_grad,
    compile_failures,
    compiled_call,
    fuse_mlps,
    fuse_rms_norms,
    fuse_rotary,
    mlps_fused,
    rotary_fused,
)
from lorapop.engine.load import load_base_model, load_tokenizer
from tiny_models import VOCAB, tiny_model

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _own_forwards(model) -> None:
    """Back to the classes' own forwards: the reference the fused ones are compared with."""
    for module in model.modules():
        if "forward" in vars(module):
            del module.forward


def _own_rotary(model, monkeypatch) -> None:
    """The attention modules' own rotary embedding for this test (loading a base model points
    the process's at `_Rotary`); the process's function comes back at the test's end."""
    from lorapop.engine.fused import _rotary_sources

    for source, current in list(_rotary_sources(model)):  # restored at the test's end
        monkeypatch.setattr(source, "apply_rotary_pos_emb",
                            getattr(current, "lorapop_original", current))


def _inference_takes_the_fused_pass(model, device, ref, fused, tol, monkeypatch) -> None:
    """Inference logits (`fused[2]`, of `_forward_backward`) after a pass was fused: on CPU the
    plain kernels' (`ref[2]`), and, with the fused pass taken as CUDA takes it
    (`fused.INFERENCE`; eager here), the training forward's (`fused[0]`: the same float32
    formula, bit for bit on CPU); on CUDA, within `tol` of both."""
    import lorapop.engine.fused as fused_module

    if device == "cpu":
        torch.testing.assert_close(fused[2], ref[2], rtol=0, atol=0)  # the same kernels
        monkeypatch.setattr(fused_module, "_inference", lambda x: True)
        inference = _forward_backward(model, device)[2]
        torch.testing.assert_close(inference, fused[0], rtol=0, atol=0)
        assert not torch.equal(inference, ref[2]) or tol < 1e-4  # bf16: not the plain kernels
    else:
        torch.testing.assert_close(fused[2], fused[0], rtol=tol, atol=tol)
        torch.testing.assert_close(fused[2], ref[2], rtol=tol, atol=tol)
    assert not compile_failures


def _forward_backward(model, device):
    """Logits and input-embedding gradients of a training forward, and the logits of the same
    input without grad (inference)."""
    ids = torch.randint(0, VOCAB, (3, 9), generator=torch.Generator().manual_seed(0)).to(device)
    x = model.get_input_embeddings()(ids).detach().requires_grad_()
    logits = model(inputs_embeds=x).logits
    logits.float().square().mean().backward()
    with torch.no_grad():
        inference = model(inputs_embeds=x).logits
    return logits.detach(), x.grad, inference


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_a_norm_whose_weight_has_another_dtype_than_its_input_multiplies_as_the_original(
        arch, device):
    """A float32 weight on bfloat16 states (mixed precision): the weight is applied after the
    kernel, as the original applies it (on CPU bit for bit; CUDA's kernel sums in another
    order). The model's own norms get the weight inside the kernel (the test below)."""
    norm = tiny_model(arch).model.norm.to(device)
    norm.weight.data.uniform_(0.5, 1.5, generator=torch.Generator(device).manual_seed(3))
    x = torch.randn(3, 5, norm.weight.shape[0], device=device).to(torch.bfloat16)
    ref = type(norm).forward(norm, x)
    assert fuse_rms_norms(norm) == 1
    got = norm(x)
    assert got.dtype == ref.dtype == torch.float32
    tol = 0 if device == "cpu" else 2e-2
    torch.testing.assert_close(got, ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_weight_in_the_kernel_gives_the_same_logits_and_gradients(arch, dtype, device):
    """The weight applied inside `F.rms_norm` (one rounding in bf16 where the original rounds
    twice): the original's logits and input gradients, frozen weights other than ones, in
    training and inference."""
    model = tiny_model(arch).to(device=device, dtype=dtype).requires_grad_(False)
    for m in model.modules():
        if type(m).__name__.endswith("RMSNorm"):
            m.weight.data.uniform_(0.5, 1.5, generator=torch.Generator(device).manual_seed(3))
    ref = _forward_backward(model, device)
    fuse_rms_norms(model)
    got = _forward_backward(model, device)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for g, r in zip(got, ref, strict=True):
        torch.testing.assert_close(g, r, rtol=tol, atol=tol)


def test_loaded_base_models_run_the_fused_norms():
    model = load_base_model("tiny-random", load_tokenizer("tiny-random"), device="cpu")
    norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]
    assert norms and all("forward" in vars(m) for m in norms)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_mlps_give_the_same_logits_and_gradients(arch, dtype, device, monkeypatch):
    """Training forwards run the fused SwiGLU (own backward, compiled on CUDA): the logits
    and input gradients of the plain MLP; inference forwards run its forward pass on CUDA
    (the training forward's logits), the plain kernels on CPU."""
    model = tiny_model(arch).to(device=device, dtype=dtype)
    ref = _forward_backward(model, device)
    assert not mlps_fused(model)
    assert fuse_mlps(model) == model.config.num_hidden_layers
    assert mlps_fused(model)
    fused = _forward_backward(model, device)
    # one float32 rounding of silu(gate) * up instead of two roundings to the dtype
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(fused[0], ref[0], rtol=tol, atol=tol)
    torch.testing.assert_close(fused[1], ref[1], rtol=tol, atol=tol)
    _inference_takes_the_fused_pass(model, device, ref, fused, tol, monkeypatch)
    _own_forwards(model)
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


def test_swiglu_passes_run_on_two_dimensional_views(monkeypatch):
    """Whatever the batch's shape, the (compiled on CUDA) passes see [tokens, width]: one
    compiled graph serves packs and lone rows alike, with no recompile inside a step."""
    import lorapop.engine.fused as fused

    seen = []
    for name in ("_silu_mul", "_silu_mul_grad"):
        real = getattr(fused, name)
        monkeypatch.setattr(fused, name, lambda *a, _f=real: (seen.append(a[0].shape), _f(*a))[1])
    for shape in ((1, 6, 4), (3, 5, 4)):
        gate, up = (torch.randn(shape, requires_grad=True) for _ in range(2))
        out = fused._SwiGLU.apply(gate, up)
        assert out.shape == shape
        out.sum().backward()
        assert gate.grad.shape == up.grad.shape == shape
    assert seen == [(6, 4), (6, 4), (15, 4), (15, 4)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_rotary_gives_the_same_logits_and_gradients(arch, dtype, device, monkeypatch):
    """Training forwards rotate q and k in one pass each way (compiled on CUDA): the logits
    and input gradients of the model's own rotary embedding; inference runs its forward
    pass on CUDA (the training forward's logits), the original on CPU."""
    import lorapop.engine.fused as fused

    model = tiny_model(arch).to(device=device, dtype=dtype)
    layers = model.config.num_hidden_layers
    _own_rotary(model, monkeypatch)
    assert not rotary_fused(model)
    ref = _forward_backward(model, device)
    calls = []
    real = fused._Rotary.apply
    monkeypatch.setattr(fused._Rotary, "apply", lambda *a: calls.append(1) or real(*a))
    assert fuse_rotary(model) == fuse_rotary(model) == layers  # idempotent
    assert rotary_fused(model)
    got = _forward_backward(model, device)
    assert len(calls) == layers  # the training forward only
    tol = 1e-5 if dtype == torch.float32 else 3e-2  # one float32 rounding, not three
    torch.testing.assert_close(got[0], ref[0], rtol=tol, atol=tol)
    torch.testing.assert_close(got[1], ref[1], rtol=tol, atol=tol)
    _inference_takes_the_fused_pass(model, device, ref, got, tol, monkeypatch)


@pytest.mark.parametrize("cos_batch", [1, 2])
def test_rotary_passes_equal_autograd_through_the_plain_formula(cos_batch):
    """On the attention's layout (q and k: transposed views of [B, T, heads, D]), with cos
    and sin per row or shared by the batch; the passes compiled for the CPU where they can be."""
    from lorapop.engine.fused import _Rotary

    gen = torch.Generator().manual_seed(2)
    q0 = torch.randn(2, 5, 3, 8, generator=gen).transpose(1, 2)  # [B, heads, T, D]
    k0 = torch.randn(2, 5, 1, 8, generator=gen).transpose(1, 2)
    cos, sin = torch.randn(cos_batch, 5, 8), torch.randn(cos_batch, 5, 8)
    gq, gk = torch.randn(2, 3, 5, 8), torch.randn(2, 1, 5, 8)

    def rotate_half(x):
        return torch.cat((-x[..., 4:], x[..., :4]), dim=-1)

    def run(fn):
        q, k = q0.clone().requires_grad_(), k0.clone().requires_grad_()
        out = fn(q, k)
        torch.autograd.backward(out, (gq, gk))
        return (*out, q.grad, k.grad)

    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    want = run(lambda q, k: (q * c + rotate_half(q) * s, k * c + rotate_half(k) * s))
    got = run(lambda q, k: _Rotary.apply(q, k, cos, sin))
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w)
    if shutil.which("cc") or shutil.which("gcc"):
        q3, k3, c3, s3 = torch.randn(10, 3, 8), torch.randn(10, 1, 8), *torch.randn(2, 10, 8)
        for fn in (_rope, _rope_grad):
            args = (q3, k3, c3, s3)
            torch.testing.assert_close(compiled_call(fn, *args), fn(*args))
        assert not compile_failures


def test_fused_rotary_leaves_other_calls_to_the_original(monkeypatch):
    """A call of another layout or signature (here [B, T, heads, D] with `unsqueeze_dim=2`)
    runs the model's own function, under grad too."""
    import transformers.models.qwen2.modeling_qwen2 as qwen2

    import lorapop.engine.fused as fused

    model = tiny_model("qwen2")
    _own_rotary(model, monkeypatch)
    fuse_rotary(model)
    calls = []
    real = fused._Rotary.apply
    monkeypatch.setattr(fused._Rotary, "apply", lambda *a: calls.append(1) or real(*a))
    q, k = torch.randn(2, 5, 3, 8, requires_grad=True), torch.randn(2, 5, 1, 8, requires_grad=True)
    cos, sin = torch.randn(2, 5, 8), torch.randn(2, 5, 8)
    got = qwen2.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=2)
    want = qwen2.apply_rotary_pos_emb.lorapop_original(q, k, cos, sin, unsqueeze_dim=2)
    assert not calls
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


def test_compiled_passes_compile_once_whatever_their_inputs_layout(monkeypatch):
    """An update hands the compiled passes views, transposed layouts (a batch of one's
    gradients) and, in a warm-up's `sum().backward()`, broadcast (stride-0) gradients. Each
    pass compiles one graph for all of them (sizes >= 2): a guard on a layout would recompile
    in the middle of an update (on an H200, ~1.3 s each, 7 in the paper step's first update).
    Only the token count is symbolic in it (see `compiled_call`)."""
    import lorapop.engine.fused as fused
    from lorapop.engine.logprobs import _logits_grad, _pick_and_lse

    graphs: dict[str, int] = {}
    symbolic: dict[str, int] = {}  # symbolic sizes past the first, by pass
    real_compile = torch.compile

    def counting_compile(fn, **kwargs):
        def backend(gm, example_inputs):
            graphs[fn.__qualname__] = graphs.get(fn.__qualname__, 0) + 1
            for node in gm.graph.find_nodes(op="placeholder"):
                value = node.meta.get("example_value")
                if isinstance(value, torch.Tensor):
                    symbolic[fn.__qualname__] = symbolic.get(fn.__qualname__, 0) + sum(
                        not isinstance(n, int) for n in value.shape[1:])
            return gm.forward
        return real_compile(fn, backend=backend, **kwargs)

    monkeypatch.setattr(torch, "compile", counting_compile)
    monkeypatch.setattr(fused, "_compiled", {})
    torch._dynamo.reset()
    heads, kv, dim, width, vocab = 3, 1, 8, 6, 11
    for offset, tokens in ((5, 5), (0, 9), (1, 4)):
        # the rotary tables: views of the batch's [1, tokens, dim] tensors, and slices of a
        # table at storage offsets 5, then 0 and 1 (which a guard tells from the others)
        cos = torch.randn(tokens * dim + offset)[offset:].view(tokens, dim)
        sin = torch.randn(2, 1, tokens, dim)[1].expand(1, tokens, dim).reshape(tokens, dim)
        q = torch.randn(tokens, heads, dim)
        lone = torch.randn(heads, tokens, dim).transpose(0, 1)  # a batch of one's layout
        for gq, gk in ((q, q[:, :kv]), (lone, lone[:, :kv]),  # (a size-1 dim's odd stride)
                       (torch.ones(()).expand(tokens, heads, dim), torch.ones(tokens, kv, dim))):
            torch.testing.assert_close(compiled_call(_rope_grad, gq, gk, cos, sin),
                                       _rope_grad(gq, gk, cos, sin))
        compiled_call(_rope, q, q[:, :kv].contiguous(), cos, sin)
        gate, up = torch.randn(2, tokens, width).unbind()
        for grad in (torch.randn(tokens, width), torch.ones(()).expand(tokens, width)):
            compiled_call(_silu_mul_grad, gate, up, grad)
        logits, target = torch.randn(1, tokens, vocab)[0], torch.randint(vocab, (tokens,))
        for _ in range(2):
            _, lse = compiled_call(_pick_and_lse, logits, target)
            logits = logits.clone()
        for g in (torch.randn(tokens), torch.ones(()).expand(tokens)):
            compiled_call(_logits_grad, logits, target, lse, g)
    assert not compile_failures
    passes = ("_rope_grad", "_rope", "_silu_mul_grad", "_pick_and_lse", "_logits_grad")
    assert graphs == dict.fromkeys(passes, 1)
    # only the token counts are symbolic: heads, head size, width and vocabulary are constants
    assert symbolic == dict.fromkeys(passes, 0)
