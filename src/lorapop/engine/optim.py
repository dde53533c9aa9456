"""AdamW over an AdapterBank with per-slot semantics, vectorised over the slot axis.

Each slot behaves as if it had its own `torch.optim.AdamW` and its own
`clip_grad_norm_`: its own learning rate, its own clipping threshold applied to the norm of
its gradient over every layer, its own moments and step count (so bias correction restarts
when a slot is reset). The math runs on the bank's flat [N, P] tensors, so one step is a
handful of kernels whatever N is.

A slot whose gradient is exactly zero (absent from the batch) is not stepped: no weight
decay, no moment decay, no step count, as if its own optimizer had not been called.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from lorapop.lora.bank import AdapterBank

_CHUNK = 1 << 26  # elements per update chunk: bounds the temporaries at 7B scale


def _per_slot(value: float | Sequence[float] | None, n: int, name: str) -> list[float]:
    if value is None:
        return [float("inf")] * n
    if isinstance(value, int | float):
        return [float(value)] * n
    out = [float("inf") if v is None else float(v) for v in value]
    if len(out) != n:
        raise ValueError(f"{name} has {len(out)} values for {n} slots")
    return out


class BankOptimizer:
    """AdamW with per-slot lr, per-slot grad-norm clipping and per-slot state."""

    def __init__(
        self,
        bank: AdapterBank,
        lr: float | Sequence[float] = 1e-5,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        max_grad_norm: float | Sequence[float | None] | None = 1.0,
    ) -> None:
        n, dev = bank.n_slots, bank.device
        lrs = _per_slot(lr, n, "lr")
        if any(v < 0 for v in lrs) or not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"invalid AdamW hyper-parameters: lr={lrs}, betas={betas}")
        self.bank = bank
        self.betas = (float(betas[0]), float(betas[1]))
        self.eps = float(eps)
        self.weight_decay = float(weight_decay)
        self.lr = torch.tensor(lrs, dtype=torch.float32, device=dev)
        self.max_grad_norm = torch.tensor(
            _per_slot(max_grad_norm, n, "max_grad_norm"), dtype=torch.float32, device=dev
        )
        self.exp_avg = torch.zeros(bank.weights.shape, dtype=torch.float32, device=dev)
        self.exp_avg_sq = torch.zeros_like(self.exp_avg)
        self.steps = torch.zeros(n, dtype=torch.float32, device=dev)

    def zero_grad(self) -> None:
        self.bank.zero_grad()

    @torch.no_grad()
    def step(self, slots: Sequence[int] | Tensor | None = None) -> dict[int, float]:
        """Clip each slot's gradient and apply one AdamW update to the stepped slots.

        `slots`: which slots to update (default: every slot with a nonzero gradient).
        Returns each slot's gradient norm before clipping.
        """
        bank = self.bank
        bank.bind_grads_()  # picks up grads that something outside replaced or dropped
        w, g, m, v = bank.weights, bank.grads, self.exp_avg, self.exp_avg_sq
        norms = torch.linalg.vector_norm(g.float(), dim=1)
        finite = torch.isfinite(norms)  # a non-finite gradient skips its slot's update
        if slots is None:
            active = finite & (norms > 0)
        else:
            active = torch.zeros(bank.n_slots, dtype=torch.bool, device=bank.device)
            active[torch.as_tensor(slots, dtype=torch.long, device=bank.device)] = True
            active &= finite
        on = active.float()
        clip = torch.clamp(self.max_grad_norm / (norms + 1e-6), max=1.0).nan_to_num_(0.0)
        self.steps += on
        b1, b2 = self.betas
        step = self.steps.clamp(min=1.0)
        lr = self.lr * on
        decay = (1.0 - lr * self.weight_decay)[:, None]
        grad_scale = (clip * on)[:, None]
        m_keep = torch.where(active, b1, 1.0)[:, None]
        v_keep = torch.where(active, b2, 1.0)[:, None]
        step_size = (lr / (1.0 - b1**step))[:, None]
        bc2_sqrt = torch.sqrt(1.0 - b2**step)[:, None]
        for c in range(0, w.shape[1], max(1, _CHUNK // w.shape[0])):
            cols = slice(c, c + max(1, _CHUNK // w.shape[0]))
            gc = torch.where(active[:, None], g[:, cols].float() * grad_scale, 0.0)
            mc, vc = m[:, cols], v[:, cols]
            mc.mul_(m_keep).add_(gc * (1.0 - b1))
            vc.mul_(v_keep).addcmul_(gc, gc, value=1.0 - b2)
            denom = (vc.sqrt() / bc2_sqrt).add_(self.eps)
            upd = (mc / denom).mul_(step_size)
            wc = w[:, cols]
            if self.weight_decay:
                wc.mul_(decay.to(wc.dtype))
            wc.sub_(upd.to(wc.dtype))
        return dict(enumerate(norms.tolist()))

    @torch.no_grad()
    def reset_slot(self, i: int) -> None:
        """Forget slot i's moments and step count (after its weights were replaced)."""
        self.exp_avg[i].zero_()
        self.exp_avg_sq[i].zero_()
        self.steps[i] = 0.0

    @torch.no_grad()
    def copy_slot(self, src: int, dst: int) -> None:
        """Give slot dst the moments and step count of slot src (lr stays per slot)."""
        self.exp_avg[dst].copy_(self.exp_avg[src])
        self.exp_avg_sq[dst].copy_(self.exp_avg_sq[src])
        self.steps[dst] = self.steps[src]

    def state_dict(self) -> dict:
        return {
            "exp_avg": self.exp_avg.clone(),
            "exp_avg_sq": self.exp_avg_sq.clone(),
            "steps": self.steps.clone(),
            "lr": self.lr.clone(),
            "max_grad_norm": self.max_grad_norm.clone(),
            "betas": self.betas,
            "eps": self.eps,
            "weight_decay": self.weight_decay,
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        if tuple(state["exp_avg"].shape) != tuple(self.exp_avg.shape):
            raise ValueError(
                f"optimizer checkpoint has state {tuple(state['exp_avg'].shape)}, "
                f"expected {tuple(self.exp_avg.shape)}"
            )
        for key in ("exp_avg", "exp_avg_sq", "steps", "lr", "max_grad_norm"):
            getattr(self, key).copy_(state[key])
        self.betas = tuple(state["betas"])  # type: ignore[assignment]
        self.eps = float(state["eps"])
        self.weight_decay = float(state["weight_decay"])
