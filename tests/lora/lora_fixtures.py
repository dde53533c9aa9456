"""Helpers for the lora tests: tiny random Qwen2 / Llama causal LMs built from a config (fp32, CPU, no downloads)."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

ARCHS = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM)}
VOCAB = 96


def tiny_model(arch: str = "qwen2", seed: int = 0) -> torch.nn.Module:
    """Same seed, same weights: call twice to get an independent copy of the base."""
    config_cls, model_cls = ARCHS[arch]
    config = config_cls(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return model_cls(config).eval()


def randomize_b(bank, seed: int = 1, scale: float = 0.3) -> None:
    """Give every slot a nonzero B so that slots differ from the base and from each other."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in bank.targets.values():
            t.b.copy_(torch.randn(t.b.shape, generator=gen) * scale)
