"""Generation for evaluation in chunks, with a progress line after each: a long `lorapop eval`
shows how far it is and when it will end instead of printing nothing for half an hour."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

#: Rows per chunk when the caller gives no batch size.
CHUNK = 256


def generate_logged(
    model: Any, bank: Any, tokenizer: Any, prompts: Sequence[str], slots: Sequence[int],
    params: Any, *, seed: int = 0, batch_size: int | None = None,
    log: Callable[[str], None] | None = None, what: str = "generate",
) -> list[Any]:
    """`engine.generate` over chunks of similar-length prompts (longest first, as `generate`
    orders them), logging `what: done/total completions, elapsed, ETA` after each chunk."""
    from lorapop.engine.generate import GenerateSpec, generate

    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    size = batch_size or CHUNK
    out: list[Any] = [None] * len(prompts)
    t0 = time.perf_counter()
    for start in range(0, len(order), size):
        idx = order[start:start + size]
        gens = generate(model, bank, tokenizer, [prompts[i] for i in idx], [slots[i] for i in idx],
                        GenerateSpec(params=params, seed=seed, batch_size=batch_size))
        for i, g in zip(idx, gens, strict=True):
            out[i] = g
        done, elapsed = start + len(idx), time.perf_counter() - t0
        if log is not None:
            left = elapsed / done * (len(order) - done)
            log(f"{what}: {done}/{len(order)} completions, "
                f"{timedelta(seconds=round(elapsed))} elapsed, ETA {timedelta(seconds=round(left))}")
    return out
