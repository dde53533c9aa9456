"""Fused stand-ins for the base model's small elementwise kernels (plain PyTorch), and the
compile-with-fallback helper the fused passes share.

Hugging Face's Llama-style RMSNorm runs ~8 elementwise kernels forward (cast up, square,
mean, add, rsqrt, multiply, cast down, weight) and more backward, on every token's hidden
state, 2 per layer: in the update's profile the elementwise kernels take ~40% of a
micro-batch, and at decode each is a launch. `F.rms_norm` computes the same normalisation in
one kernel each way on CUDA (`aten::_fused_rms_norm`; a composite on CPU), so the norms of
the families below are re-pointed at it, the weight inside the kernel: the result is the
original's up to the order of the fp32 sum and one rounding fewer in bf16 (the original
rounds the normalised states, then their product with the weight).
"""

from __future__ import annotations

import sys
import types
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# classes whose forward is x * rsqrt(mean(x^2) + eps), in fp32, cast back, times weight
# (Gemma's (1 + weight) norm is not one of them)
LLAMA_STYLE_NORMS = frozenset({
    "LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "Qwen2MoeRMSNorm",
    "Qwen3MoeRMSNorm",
})


def _fused_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """The weight goes into `F.rms_norm`'s kernel where it has the input's dtype: the weighted
    output rounded once, and no broadcast multiply of its own each way (at 7B on an H200 the
    update's rows ran 1.2-2.5% faster). A weight of another dtype (the original casts the
    states back before it multiplies) is applied after the kernel, as the original does."""
    shape = (hidden_states.shape[-1],)
    if self.weight.dtype == hidden_states.dtype:
        return F.rms_norm(hidden_states, shape, self.weight, self.variance_epsilon)
    normed = F.rms_norm(hidden_states, shape, eps=self.variance_epsilon)
    return self.weight * normed


def fuse_rms_norms(model: nn.Module) -> int:
    """Point every Llama-style RMSNorm of `model` at the fused kernel; returns how many."""
    n = 0
    for module in model.modules():
        if type(module).__name__ in LLAMA_STYLE_NORMS and hasattr(module, "variance_epsilon"):
            module.forward = types.MethodType(_fused_forward, module)
            n += 1
    return n


# ------------------------------------------------------------------ compiled passes
#: Names of the functions whose compilation failed (they run eagerly from then on).
compile_failures: set[str] = set()
#: Whether forwards without autograd on CUDA (decode steps, prefills, log-prob probes) take
#: the fused SwiGLU and rotary passes too: a decode step of a 7B runs ~10 small kernels a
#: layer fewer, and its log-probs are computed as the update's forward computes them (float32,
#: one rounding). Off: the model's own kernels at inference (benchmarks compare the two).
INFERENCE = True
_compiled: dict[str, Any] = {}


def _plain(t: torch.Tensor) -> torch.Tensor:
    """`t` detached (no view, no `requires_grad`), contiguous at storage offset 0, with the
    contiguous strides even on its size-1 dimensions (which `contiguous()` leaves as they
    were). A strided or offset input is copied: one read and write of a q- or gradient-sized
    tensor, against a pass that reads it anyway."""
    t = t.detach().contiguous()
    if t.storage_offset():  # a guard tells offsets 0 and 1 from the others
        t = t.clone(memory_format=torch.contiguous_format)
    strides, step = [], 1
    for n in reversed(t.shape):
        strides.append(step)
        step *= max(n, 1)
    strides.reverse()
    return t if t.stride() == tuple(strides) else t.as_strided(t.shape, strides).detach()


def compiled_call(fn: Any, *args: torch.Tensor, plain: bool = True) -> Any:
    """`fn(*args)` through torch.compile, compiled once per function for every size of the
    inputs' first dimension (rows or tokens); a compiler failure warns once and `fn` runs
    eagerly from then on. Out-of-memory errors are not compiler failures: they propagate.

    Only that first dimension is symbolic: the others (heads, head size, width, vocabulary)
    are constants in the kernels. With every size symbolic (`dynamic=True`), a kernel that
    broadcasts (the rotary tables over heads, a row's terms over the vocabulary) divides by
    runtime sizes for every element: in the update's profile at 7B the rotary passes took
    ~180 us each for ~160 MB of traffic, which an H200's bandwidth moves in ~35 us.

    The compiled graph guards on its inputs' strides, storage offsets, views' bases and
    `requires_grad`, and the passes get all kinds (a batch of one's transposed gradients,
    broadcast gradients, slices of the rotary tables): each new kind recompiled in the middle
    of an update (~1.3 s each on an H200, ~9 s of the 7B paper step's first update). So the
    graph sees `_plain` tensors only. `plain=False` (passes without autograd: inputs of a few
    fixed layouts, e.g. a decode step's column slices of one merged projection) compiles once
    per layout instead of copying each strided input."""
    name = fn.__qualname__
    if name not in compile_failures:
        try:
            if name not in _compiled:
                _compiled[name] = torch.compile(fn)
            inputs = [_plain(a) for a in args] if plain else [a.detach() for a in args]
            for t in inputs:
                if t.dim():
                    torch._dynamo.maybe_mark_dynamic(t, 0)
            return _compiled[name](*inputs)
        except torch.OutOfMemoryError:
            raise
        except Exception as e:  # noqa: BLE001 - any compiler failure: the eager pass
            warnings.warn(f"torch.compile of {name} failed, running it eagerly: "
                          f"{type(e).__name__}: {str(e).splitlines()[0][:300]}", stacklevel=2)
            compile_failures.add(name)
    return fn(*args)


def fast_pass(fn: Any, *args: torch.Tensor, plain: bool = True) -> Any:
    """`fn(*args)`, compiled on CUDA (`compiled_call`), eager elsewhere: the one place that
    chooses between the two paths of the fused passes (SwiGLU, rotary, the LM head's
    log-softmax). On CUDA a compiled pass is one kernel each way where the eager one runs
    several full-size elementwise kernels; on CPU the eager pass is the reference and compiling
    would need a C compiler for nothing. tests/engine/test_fused.py and test_logprobs.py compile
    the passes for the CPU and compare them with the eager ones."""
    return compiled_call(fn, *args, plain=plain) if args[0].is_cuda else fn(*args)


# ------------------------------------------------------------------ SwiGLU
#: MLPs computing down(silu(gate(x)) * up(x)) (when the config's hidden_act is "silu")
SWIGLU_MLPS = frozenset({"LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP", "Qwen2MoeMLP",
                         "Qwen3MoeMLP"})


def _silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return (F.silu(gate.float()) * up.float()).to(gate.dtype)


def _silu_mul_grad(gate: torch.Tensor, up: torch.Tensor, grad: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    g, u, d = gate.float(), up.float(), grad.float()
    sig = torch.sigmoid(g)
    return ((d * u * sig * (1 + g * (1 - sig))).to(gate.dtype), (d * g * sig).to(up.dtype))


class _SwiGLU(torch.autograd.Function):
    """silu(gate) * up keeping only gate and up for the backward, which recomputes the
    sigmoid: autograd through the plain formula also keeps silu(gate), an [tokens,
    intermediate] tensor per layer (a sixth of the update's activations at 7B), and runs
    ~5 full-size elementwise kernels where the compiled passes run one each way. Every
    pass computes in float32 and rounds once."""

    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return _swiglu_pass(_silu_mul, gate, up)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gate, up = ctx.saved_tensors
        return _swiglu_pass(_silu_mul_grad, gate, up, grad)


def _swiglu_pass(fn: Any, *args: torch.Tensor, plain: bool = True) -> Any:
    """`fn` over [tokens, intermediate] views: one compiled graph then serves every batch
    shape (a shared pack's [1, T, I], lone rows' [B, T, I]), where a size-1 batch would be a
    shape of its own to the compiler: a recompile in the middle of an update."""
    shape = args[0].shape
    flat = [a.reshape(-1, shape[-1]) for a in args]
    out = fast_pass(fn, *flat, plain=plain)
    return tuple(o.view(shape) for o in out) if isinstance(out, tuple) else out.view(shape)


def _inference(x: torch.Tensor) -> bool:
    """Whether a forward without autograd takes the fused passes (`INFERENCE`): on CUDA,
    outside a torch.compile trace (which fuses the model's kernels itself)."""
    return INFERENCE and x.is_cuda and not torch.compiler.is_compiling()


def _inference_swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return _swiglu_pass(_silu_mul, gate, up, plain=False)


def _swiglu_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    bank = getattr(self.gate_proj, "_lorapop_bank", None)
    if bank is not None and not torch.is_grad_enabled() and _inference(x):
        # decode steps and prefills: the LoRA terms' expand with the SwiGLU as its epilogue
        act = bank.fused_swiglu(self.gate_proj, self.up_proj, x, _inference_swiglu)
        if act is not None:
            return self.down_proj(act)
    gate, up = self.gate_proj(x), self.up_proj(x)
    if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
        return self.down_proj(_SwiGLU.apply(gate, up))
    if _inference(gate):
        return self.down_proj(_inference_swiglu(gate, up))
    return self.down_proj(self.act_fn(gate) * up)


def fuse_mlps(model: nn.Module) -> int:
    """Point every SwiGLU MLP of `model` at `_SwiGLU` for training forwards and at its
    forward pass at inference on CUDA (`INFERENCE`); returns how many."""
    n = 0
    for module in model.modules():
        act = getattr(getattr(module, "config", None), "hidden_act", None)
        if type(module).__name__ in SWIGLU_MLPS and act == "silu":
            module.forward = types.MethodType(_swiglu_forward, module)
            n += 1
    return n


def mlps_fused(model: nn.Module) -> bool:
    """Whether `model`'s SwiGLU MLPs run `_SwiGLU` (they then keep 3 intermediate-wide
    activations per token for the backward, not 4)."""
    return any("forward" in vars(m) and type(m).__name__ in SWIGLU_MLPS for m in model.modules())


# ------------------------------------------------------------------ rotary embedding
#: Attention classes whose module's `apply_rotary_pos_emb(q, k, cos, sin)` is the rotate-half
#: formula q * cos + rotate_half(q) * sin, called with q [B, heads, T, D] and cos [B, T, D].
ROTARY_ATTENTIONS = frozenset({
    "LlamaAttention", "MistralAttention", "Qwen2Attention", "Qwen3Attention",
    "Qwen2MoeAttention", "Qwen3MoeAttention",
})


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return (x.float() * cos + torch.cat((-x2, x1), dim=-1) * sin).to(x.dtype)


def _unrotate(grad: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The gradient of `_rotate` with respect to x: grad * cos + R^T(grad * sin), where
    R(x) = [-x2, x1] has the transpose R^T(y) = [y2, -y1]."""
    gs1, gs2 = (grad.float() * sin).chunk(2, dim=-1)
    return (grad.float() * cos + torch.cat((gs2, -gs1), dim=-1)).to(grad.dtype)


def _rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
          ) -> tuple[torch.Tensor, torch.Tensor]:
    c, s = cos.unsqueeze(1).float(), sin.unsqueeze(1).float()
    return _rotate(q, c, s), _rotate(k, c, s)


def _rope_grad(gq: torch.Tensor, gk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    c, s = cos.unsqueeze(1).float(), sin.unsqueeze(1).float()
    return _unrotate(gq, c, s), _unrotate(gk, c, s)


class _Rotary(torch.autograd.Function):
    """The rotary embedding of q and k in one pass each way. Autograd through the plain
    formula runs ~8 kernels forward over q- and k-sized tensors (two products with broadcast
    cos/sin, a negation, a concatenation and an add each) and more backward: in the update's
    profile at 7B they took ~5% of a micro-batch. Every pass computes in float32 and rounds
    once; cos and sin take no gradient."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch, _, tokens, dim = q.shape
        cos, sin = _flat_tables(cos, sin, batch, tokens, dim)
        ctx.save_for_backward(cos, sin)
        return _rotary_pass(_rope, q, k, cos, sin)

    @staticmethod
    def backward(ctx: Any, gq: torch.Tensor, gk: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, None, None]:
        cos, sin = ctx.saved_tensors
        dq, dk = _rotary_pass(_rope_grad, gq, gk, cos, sin)
        return dq, dk, None, None


def _flat_tables(cos: torch.Tensor, sin: torch.Tensor, batch: int, tokens: int, dim: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [1 or batch, tokens, dim] as [batch * tokens, dim] (a copy only where a
    table is shared by the batch)."""
    c, s = (t.expand(batch, tokens, dim).reshape(-1, dim) for t in (cos, sin))
    return c, s


def _rotary_pass(fn: Any, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, plain: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """`fn` over [batch * tokens, heads, dim] views (cos, sin: [batch * tokens, dim]). The
    attention's q and k are views of [batch, tokens, heads, dim] projections, so these are
    free, and one compiled graph serves every batch: a batch of one would be a shape of its
    own to the compiler (a recompile in the middle of an update)."""
    batch, heads, tokens, dim = q.shape
    q3, k3 = (t.transpose(1, 2).reshape(batch * tokens, t.shape[1], dim) for t in (q, k))
    out = fast_pass(fn, q3, k3, cos, sin, plain=plain)
    return tuple(o.reshape(batch, tokens, -1, dim).transpose(1, 2) for o in out)  # type: ignore[return-value]


def _fused_rotary(original: Any) -> Any:
    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):  # noqa: ANN001, ANN202
        """`_Rotary` for training forwards of the usual shapes, its forward pass at inference
        on CUDA (`INFERENCE`); anything else, the original."""
        usual = (not args and not kwargs and q.dim() == k.dim() == 4 and cos.dim() == 3
                 and k.shape[0] == q.shape[0] and k.shape[2:] == q.shape[2:]
                 and cos.shape == sin.shape and cos.shape[0] in (1, q.shape[0])
                 and cos.shape[1:] == q.shape[2:] and q.shape[-1] % 2 == 0
                 and not (cos.requires_grad or sin.requires_grad))
        if usual and torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
            return _Rotary.apply(q, k, cos, sin)
        if usual and _inference(q):
            batch, _, tokens, dim = q.shape
            return _rotary_pass(_rope, q, k, *_flat_tables(cos, sin, batch, tokens, dim),
                                plain=False)
        return original(q, k, cos, sin, *args, **kwargs)

    apply_rotary_pos_emb.lorapop_original = original  # type: ignore[attr-defined]
    return apply_rotary_pos_emb


def _rotary_sources(model: nn.Module) -> Iterator[tuple[types.ModuleType, Any]]:
    """For each attention module of the families above: the Python module its forward reads
    `apply_rotary_pos_emb` from, and that function as it stands."""
    for module in model.modules():
        if type(module).__name__ in ROTARY_ATTENTIONS:
            source = sys.modules[type(module).__module__]
            current = getattr(source, "apply_rotary_pos_emb", None)
            if current is not None:
                yield source, current


def fuse_rotary(model: nn.Module) -> int:
    """Point the rotary embedding of `model`'s attention families at `_Rotary` for training
    forwards and at its forward pass at inference on CUDA (`INFERENCE`; on CPU inference keeps
    the original kernels); returns how many attention modules use it.

    The attention forward calls its module's global `apply_rotary_pos_emb`, so that global is
    wrapped, once per module, for every model of the family in this process: the wrapper
    takes the fused pass only under grad, for the shapes above, and is the same function up
    to float32 rounding."""
    n = 0
    for source, current in _rotary_sources(model):
        if not hasattr(current, "lorapop_original"):
            source.apply_rotary_pos_emb = _fused_rotary(current)  # type: ignore[attr-defined]
        n += 1
    return n


def rotary_fused(model: nn.Module) -> bool:
    """Whether `model`'s attention modules rotate through `_Rotary` in training forwards."""
    return any(hasattr(current, "lorapop_original") for _, current in _rotary_sources(model))

