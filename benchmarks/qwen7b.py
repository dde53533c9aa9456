"""The 7B model all GPU benchmarks measure: Qwen2.5(-Coder)-7B's architecture, from the config
shipped in configs/models/, with random bf16 weights built directly on the device (the same
cost as the real weights)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "models" / "qwen2.5-coder-7b"
ARCH = json.loads((CONFIG / "config.json").read_text())


def build_qwen7b(layers: int | None = None, device: str = "cuda") -> Qwen2ForCausalLM:
    """Random-weight bf16 model (seed 0) in eval mode; `layers` truncates the stack."""
    config = Qwen2Config.from_pretrained(CONFIG)
    if layers is not None:
        config.num_hidden_layers = layers
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = Qwen2ForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    return model.eval()
