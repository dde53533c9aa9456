"""A bank slot <-> a standard PEFT LoRA directory (adapter_config.json + safetensors).

This is how a trained member leaves lorapop (PEFT, vLLM, merges) and how an existing PEFT
adapter enters a slot. Key names are exactly those PEFT writes:
``base_model.model.<module>.lora_A.weight`` [r, in] and ``...lora_B.weight`` [out, r].
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch
from peft import LoraConfig
from safetensors.torch import load_file, save

from lorapop.lora.bank import AdapterBank

WEIGHTS_NAME = "adapter_model.safetensors"
CONFIG_NAME = "adapter_config.json"
_KEY = re.compile(r"^base_model\.model\.(.+)\.lora_([AB])(?:\.[^.]+)?\.weight$")


def export_slot(
    bank: AdapterBank,
    i: int,
    out_dir: str | Path,
    base_model_name_or_path: str | None = None,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write slot i as a PEFT LoRA directory; returns the directory."""
    state = bank.slot_state(i)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if base_model_name_or_path is None:
        base_model_name_or_path = getattr(getattr(bank.model, "config", None), "_name_or_path", "")
    alpha = int(bank.alpha) if float(bank.alpha).is_integer() else bank.alpha
    config = LoraConfig(
        r=bank.rank,
        lora_alpha=alpha,
        lora_dropout=bank.dropout,
        target_modules=sorted({n.rsplit(".", 1)[-1] for n in state}),
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=base_model_name_or_path or None,
    )
    config.save_pretrained(str(out))
    # PEFT keeps target_modules as a set and writes it in hash order, different in every
    # process: sorted, two exports of the same adapter are the same files
    path = out / CONFIG_NAME
    saved = json.loads(path.read_text())
    saved["target_modules"] = sorted(saved["target_modules"])
    path.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")
    tensors = {}
    for name, ab in state.items():
        for key in ("A", "B"):
            t = ab[key] if dtype is None else ab[key].to(dtype)
            tensors[f"base_model.model.{name}.lora_{key}.weight"] = t.contiguous().cpu()
    # through bytes: save_file's temporary file leaves mode 0600, unreadable to a shared cluster
    (out / WEIGHTS_NAME).write_bytes(save(tensors, metadata={"format": "pt"}))
    return out


def import_slot(bank: AdapterBank, i: int, in_dir: str | Path) -> None:
    """Load a PEFT LoRA directory into slot i; rank and target modules must match the bank.

    A different alpha (or rsLoRA scaling) is folded into B, so the slot computes the same
    function as the adapter did under PEFT.
    """
    src = Path(in_dir)
    cfg_path, w_path = src / CONFIG_NAME, src / WEIGHTS_NAME
    if not cfg_path.is_file() or not w_path.is_file():
        raise ValueError(f"{src} is not a PEFT LoRA directory ({CONFIG_NAME} + {WEIGHTS_NAME})")
    cfg = json.loads(cfg_path.read_text())
    if cfg.get("peft_type") != "LORA":
        raise ValueError(f"{src}: peft_type {cfg.get('peft_type')!r} is not LORA")
    for flag in ("use_dora", "fan_in_fan_out"):
        if cfg.get(flag):
            raise ValueError(f"{src}: {flag}=true is not supported by the bank")
    if cfg.get("bias", "none") != "none" or cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        raise ValueError(f"{src}: LoRA bias, rank_pattern or alpha_pattern are not supported")
    rank = int(cfg.get("r", -1))
    if rank != bank.rank:
        raise ValueError(f"{src}: adapter rank {rank} != bank rank {bank.rank}")
    alpha = float(cfg.get("lora_alpha", rank))
    file_scaling = alpha / (math.sqrt(rank) if cfg.get("use_rslora") else rank)
    state: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(str(w_path)).items():
        match = _KEY.match(key)
        if match is None:
            raise ValueError(f"{src}: unexpected tensor {key!r} in {WEIGHTS_NAME}")
        state.setdefault(match.group(1), {})[match.group(2)] = tensor
    extra = sorted(set(state) - set(bank.targets))
    missing = sorted(set(bank.targets) - set(state))
    if extra or missing:
        raise ValueError(
            f"{src}: target modules differ from the bank "
            f"(adapter only: {extra[:2]}, bank only: {missing[:2]})"
        )
    ratio = file_scaling / bank.scaling
    for ab in state.values():
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{src}: a module lacks lora_A or lora_B")
        if ratio != 1.0:
            ab["B"] = ab["B"].float() * ratio
    bank.load_slot(i, state)
