"""Helpers for the lora tests: tiny random Qwen2 / Llama causal LMs built from a config (fp32, CPU, no downloads)."""

from __future__ import annotations

import torch

from tiny_models import ARCHS, VOCAB, tiny_model

__all__ = ["ARCHS", "VOCAB", "randomize_b", "tiny_model"]


def randomize_b(bank, seed: int = 1, scale: float = 0.3) -> None:
    """Give every slot a nonzero B so that slots differ from the base and from each other."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in bank.targets.values():
            t.b.copy_(torch.randn(t.b.shape, generator=gen) * scale)
