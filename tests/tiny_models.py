"""Tiny random Qwen2 / Llama causal LMs built from a config (fp32, CPU, no downloads)."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

ARCHS = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM)}
VOCAB = 96


def tiny_model(arch: str = "qwen2", vocab: int = VOCAB, seed: int = 0) -> torch.nn.Module:
    """Same seed, same weights: call twice to get an independent copy of the base (eval mode)."""
    config_cls, model_cls = ARCHS[arch]
    config = config_cls(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return model_cls(config).eval()
