"""Fused stand-ins for the base model's small elementwise kernels (plain PyTorch).

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
    for module in model.modules():
        if "forward" in vars(module) and type(module).__name__ in LLAMA_STYLE_NORMS:
            del module.forward
