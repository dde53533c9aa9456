"""Sampling parameters and the per-step token sampler.

Randomness comes from one uniform number per row and step, drawn up front from a generator
seeded by (seed, row key) — the row's index in the caller's prompt list. A row's samples
therefore do not depend on which other rows share its batch, on the batch size, or on the
device, and the sampler is a pure tensor function that a CUDA graph can replay. Tokens are
drawn by inverse-CDF: the first token whose cumulative probability exceeds u.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lorapop.engine import sampling_kernel


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. `temperature == 0` is greedy decoding.

    `stop`: strings that end a row; the text is cut before the first one (kept when
    `include_stop`), and token ids / logprobs run through the token that completed it.
    `eos_token_ids`: None takes them from the tokenizer and the model's generation config;
    an empty tuple disables stopping on EOS.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 256
    stop: tuple[str, ...] = ()
    eos_token_ids: tuple[int, ...] | None = None
    include_stop: bool = False

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if isinstance(self.stop, str) or any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop must be a tuple of non-empty strings")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def row_seed(seed: int, key: int) -> int:
    """A 63-bit seed for one row, stable across platforms and Python versions."""
    digest = hashlib.blake2b(f"{seed}/{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def row_uniforms(seed: int, keys: Sequence[int], steps: int) -> torch.Tensor:
    """[len(keys), steps] float32 uniforms in [0, 1); row i depends only on (seed, keys[i])."""
    out = torch.empty(len(keys), steps, dtype=torch.float32)
    for i, key in enumerate(keys):
        gen = torch.Generator().manual_seed(row_seed(seed, key))
        out[i] = torch.rand(steps, generator=gen)
    return out


def sample(
    logits: torch.Tensor, u: torch.Tensor, temperature: float, top_p: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next tokens [B] and their log-probabilities [B] from logits [B, V] and uniforms u [B].

    The log-probability is that of the policy itself (temperature 1, full softmax), whatever
    temperature and top-p shaped the draw: it is what a policy-gradient loss needs. On CUDA
    with top-p 1 one Triton kernel draws the same tokens (`sampling_kernel`); this function's
    torch code is its reference.
    """
    if sampling_kernel.usable(logits, temperature, top_p):
        drawn = sampling_kernel.sample(logits, u, temperature)
        if drawn is not None:
            return drawn
    logits = logits.float()
    logprobs = torch.log_softmax(logits, dim=-1)
    if temperature == 0:
        tokens = logits.argmax(dim=-1)
    else:
        scaled = logits / temperature
        if top_p < 1:
            scaled, order = scaled.sort(dim=-1, descending=True)
        probs = torch.softmax(scaled, dim=-1)
        if top_p < 1:
            before = probs.cumsum(dim=-1) - probs  # mass of strictly more likely tokens
            probs = probs.masked_fill(before >= top_p, 0.0)  # the top token always stays
        cdf = probs.cumsum(dim=-1)
        total = cdf[:, -1:]
        # u < 1, but u * total can round up to total; stay strictly below the last step
        target = torch.minimum(u.to(cdf.device).unsqueeze(-1) * total, total * (1 - 1e-6))
        idx = torch.searchsorted(cdf, target, right=True).clamp_(max=cdf.shape[-1] - 1)
        tokens = order.gather(-1, idx).squeeze(-1) if top_p < 1 else idx.squeeze(-1)
    return tokens, logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
