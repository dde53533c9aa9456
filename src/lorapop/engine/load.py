"""Load the frozen base model and its tokenizer from a hub id or a local path.

`tiny-random` builds a small Qwen2 with random weights from a config: enough to exercise every
code path on a laptop without downloading anything.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

from lorapop.engine.memory import configure_allocator
from lorapop.engine.patches import patch_base_model

hf_logging.disable_progress_bar()  # a 3 MB model's "Loading weights" bar is noise in run logs

TINY_RANDOM = "tiny-random"
TINY = "tiny"
#: The tiny code world's base model, shipped with the package (`lorapop pretrain-tiny` remakes it).
TINY_DIR = Path(__file__).resolve().parents[1] / "assets" / "tiny"


class ModelLoadError(RuntimeError):
    """The model named in the config cannot be loaded; the message is one line."""


def resolve_device(device: str) -> torch.device:
    """The model's device; on CUDA, the allocator is configured first (`configure_allocator`)."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ModelLoadError("model.device is 'cuda' but no CUDA device is visible")
        configure_allocator()
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, dtype)


def random_qwen2(
    tokenizer: PreTrainedTokenizerBase,
    seed: int,
    *,
    hidden: int,
    intermediate: int,
    layers: int,
    heads: int,
    kv_heads: int,
    max_positions: int,
    dtype: torch.dtype | None = None,
) -> torch.nn.Module:
    """A Qwen2 with tied embeddings sized to the tokenizer, initialised from `seed` (the
    global RNG is left as it was)."""
    config = AutoConfig.for_model(
        "qwen2",
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    extra = {} if dtype is None else {"dtype": dtype}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config, **extra)


def tiny_random_model(tokenizer: PreTrainedTokenizerBase, seed: int = 0) -> torch.nn.Module:
    """A ~1M-parameter Qwen2 with random weights sized to the tokenizer."""
    return random_qwen2(
        tokenizer, seed, hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2,
        max_positions=2048,
    )  # fmt: skip


def use_checkpointing(model: Any, on: bool) -> None:
    """Turn the model's activation checkpointing on or off (transformers >= 5.24 renamed the
    methods `activation_checkpointing_*`; 5.17 has only `gradient_checkpointing_*`)."""
    new = hasattr(model, "activation_checkpointing_enable")
    if on == (model.is_activation_checkpointing if new else model.is_gradient_checkpointing):
        return
    if not on:
        (model.activation_checkpointing_disable if new else model.gradient_checkpointing_disable)()
    elif new:
        model.activation_checkpointing_enable({"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def _resolve(name_or_path: str) -> str:
    return str(TINY_DIR) if name_or_path == TINY else name_or_path


def load_tokenizer(name_or_path: str) -> PreTrainedTokenizerBase:
    """A hub id or path; `tiny` is the shipped tiny model's; `tiny-random` and `byte` give the
    built-in byte-level tokenizer."""
    name_or_path = _resolve(name_or_path)
    if name_or_path in (TINY_RANDOM, "byte"):
        from lorapop.engine.byte_tokenizer import byte_tokenizer

        return byte_tokenizer()
    _check_exists(name_or_path)
    try:
        tok = AutoTokenizer.from_pretrained(name_or_path)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot load tokenizer '{name_or_path}': {_first_line(e)}") from None
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


def load_base_model(
    name_or_path: str,
    tokenizer: PreTrainedTokenizerBase,
    device: str = "auto",
    dtype: str = "auto",
    seed: int = 0,
    trust_remote_code: bool = False,
    random_init: bool = False,
) -> torch.nn.Module:
    """The frozen base: every parameter has requires_grad False; adapters are added later.
    Patched by `engine/patches.patch_base_model` (fused norms, SwiGLU and rotary; merged
    projections in decode steps): the table in `engine/patches.py` lists every change.

    `random_init` builds the architecture from the config alone, directly on the device.
    """
    name_or_path = _resolve(name_or_path)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    if name_or_path == TINY_RANDOM:
        model = tiny_random_model(tokenizer, seed)
    elif random_init:
        _check_exists(name_or_path)
        try:
            config = AutoConfig.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"cannot load config '{name_or_path}': {_first_line(e)}") from None
        torch.manual_seed(seed)
        with dev:
            model = AutoModelForCausalLM.from_config(config, dtype=dt)
    else:
        _check_exists(name_or_path)
        try:
            model = AutoModelForCausalLM.from_pretrained(
                name_or_path, dtype=dt, trust_remote_code=trust_remote_code
            )
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"cannot load model '{name_or_path}': {_first_line(e)}") from None
    model.to(device=dev, dtype=dt)
    model.requires_grad_(False)
    model.eval()
    patch_base_model(model)
    return model


def _check_exists(name_or_path: str) -> None:
    """A path-like name that does not exist gets a clear error instead of a hub lookup; a hub
    id neither local nor cached fails at once offline (HF_HUB_OFFLINE) and after one quick
    look-up otherwise, instead of a minute of download retries."""
    looks_local = name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") > 1
    if looks_local and not Path(name_or_path).expanduser().is_dir():
        raise ModelLoadError(f"model path not found: {name_or_path}")
    if not looks_local and not Path(name_or_path).is_dir():
        _check_hub(name_or_path)


@functools.cache
def _check_hub(repo: str) -> None:
    import os

    import huggingface_hub as hub
    from huggingface_hub.errors import RepositoryNotFoundError

    if isinstance(hub.try_to_load_from_cache(repo, "config.json"), str):
        return
    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in {"1", "ON", "YES", "TRUE"}
    if offline or hub.constants.HF_HUB_OFFLINE:
        raise ModelLoadError(f"model '{repo}' is not a local directory nor in the Hugging Face "
                             "cache, and HF_HUB_OFFLINE is set: download it first or give a path")
    try:
        hub.model_info(repo, timeout=10)
    except RepositoryNotFoundError:
        raise ModelLoadError(f"no model '{repo}' on the Hugging Face hub (nor a local "
                             "directory of that name)") from None
    except hub.errors.HfHubHTTPError:
        return  # gated or private: loading says what it needs
    except Exception as e:  # noqa: BLE001 (network errors of several libraries)
        raise ModelLoadError(f"cannot reach the Hugging Face hub for '{repo}' ({_first_line(e)}); "
                             "download it first or give a local path") from None


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
