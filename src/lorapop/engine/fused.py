"""Fused stand-ins for the base model's small elementwise kernels (plain PyTorch), and the
compile-with-fallback helper the fused passes share.

Hugging Face's Llama-style RMSNorm runs ~8 elementwise kernels forward (cast up, square,
mean, add, rsqrt, multiply, cast down, weight) and more backward, on every token's hidden
state, 2 per layer: in the update's profile the elementwise kernels take ~40% of a
micro-batch, and at decode each is a launch. `F.rms_norm` computes the same normalisation in
one kernel each way on CUDA (`aten::_fused_rms_norm`; a composite on CPU), so the norms of
the families below are re-pointed at it. The weight is applied afterwards, as in the
original, to the normalised states already cast back to the input dtype: the result is the
original's up to the order of the fp32 sum.
"""

from __future__ import annotations

import types
import warnings
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
    normed = F.rms_norm(hidden_states, (hidden_states.shape[-1],), eps=self.variance_epsilon)
    return self.weight * normed


def fuse_rms_norms(model: nn.Module) -> int:
    """Point every Llama-style RMSNorm of `model` at the fused kernel; returns how many."""
    n = 0
    for module in model.modules():
        if type(module).__name__ in LLAMA_STYLE_NORMS and hasattr(module, "variance_epsilon"):
            module.forward = types.MethodType(_fused_forward, module)
            n += 1
    return n


def unfuse_rms_norms(model: nn.Module) -> None:
    """Back to the classes' own forward (for side-by-side benchmarks)."""
    _unfuse(model, LLAMA_STYLE_NORMS)


def _unfuse(model: nn.Module, classes: frozenset[str]) -> None:
    for module in model.modules():
        if "forward" in vars(module) and type(module).__name__ in classes:
            del module.forward


# ------------------------------------------------------------------ compiled passes
#: Names of the functions whose compilation failed (they run eagerly from then on).
compile_failures: set[str] = set()
_compiled: dict[str, Any] = {}


def compiled_call(fn: Any, *args: torch.Tensor) -> Any:
    """`fn(*args)` through torch.compile (dynamic shapes, compiled once per function); a
    compiler failure warns once and `fn` runs eagerly from then on. Out-of-memory errors are
    not compiler failures: they propagate."""
    name = fn.__qualname__
    if name not in compile_failures:
        try:
            if name not in _compiled:
                _compiled[name] = torch.compile(fn, dynamic=True)
            return _compiled[name](*args)
        except torch.OutOfMemoryError:
            raise
        except Exception as e:  # noqa: BLE001 - any compiler failure: the eager pass
            warnings.warn(f"torch.compile of {name} failed, running it eagerly: "
                          f"{type(e).__name__}: {str(e).splitlines()[0][:300]}", stacklevel=2)
            compile_failures.add(name)
    return fn(*args)


# ------------------------------------------------------------------ SwiGLU
#: MLPs computing down(silu(gate(x)) * up(x)) (when the config's hidden_act is "silu")
SWIGLU_MLPS = frozenset({"LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP", "Qwen2MoeMLP",
                         "Qwen3MoeMLP"})
#: On CUDA the SwiGLU's two passes are compiled, each one kernel (see `_SwiGLU`).
COMPILE_SWIGLU = True


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


def _swiglu_pass(fn: Any, *args: torch.Tensor) -> Any:
    """`fn` over [tokens, intermediate] views: one compiled graph then serves every batch
    shape (a shared pack's [1, T, I], lone rows' [B, T, I]), where a size-1 batch would be a
    shape of its own to the compiler: a recompile in the middle of an update."""
    shape = args[0].shape
    flat = [a.reshape(-1, shape[-1]) for a in args]
    out = compiled_call(fn, *flat) if args[0].is_cuda and COMPILE_SWIGLU else fn(*flat)
    return tuple(o.view(shape) for o in out) if isinstance(out, tuple) else out.view(shape)


def _swiglu_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    gate, up = self.gate_proj(x), self.up_proj(x)
    if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
        return self.down_proj(_SwiGLU.apply(gate, up))
    return self.down_proj(self.act_fn(gate) * up)  # inference: the plain kernels


def fuse_mlps(model: nn.Module) -> int:
    """Point every SwiGLU MLP of `model` at `_SwiGLU` for training forwards; returns how many."""
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


def unfuse_mlps(model: nn.Module) -> None:
    """Back to the classes' own forward (for side-by-side benchmarks)."""
    _unfuse(model, SWIGLU_MLPS)
