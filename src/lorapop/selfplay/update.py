"""The policy update: one REINFORCE step with TRR++ advantages for every adapter at once.

    rollouts, rewards -> advantages (per adapter, role and task type)
      -> packs: rows of one prompt and adapter (a student's answers to a task) as one sequence
      -> this rank's packs, shared out by cost (tokens and attended pairs)
      -> memory plan: micro-batch size, and which micro-batches checkpoint their activations
      -> per micro-batch: teacher-forced log-probs (`engine.logprobs`), the loss (`rl.loss`),
         backward
      -> the bank's gradients summed over ranks -> the optimizer step (`engine.optim`)

The loss is a sum over rows normalised by the whole batch's per-slot token counts, so summing
the ranks' gradients gives the whole batch's. Beside the step: the update's KL on a few rows
(`token_logprobs` before, `kl` after) and a probe of the update's kernels for deterministic
mode (`kernel_probe`).
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Sequence

import torch

from lorapop import dist
from lorapop.config import Config
from lorapop.engine.load import use_checkpointing
from lorapop.engine.logprobs import (
    HEAD_CHUNK,
    head_compiled,
    pack_width,
    pack_widths,
    sequence_logprobs,
    shared_prompt_packs,
)
from lorapop.engine.memory import pack_overhead, plan_update, update_budget
from lorapop.engine.transfer import host_to_device
from lorapop.rl import trr_advantages
from lorapop.rl.loss import group_token_counts, policy_loss
from lorapop.selfplay.parts import Parts
from lorapop.selfplay.records import Rollout

# -- packing rows into micro-batches ----------------------------------------------------------


def micro_batches(lengths: Sequence[int], max_tokens: int, max_rows: int,
                  slots: Sequence[int] | None = None) -> list[list[int]]:
    """Row indices grouped by length: each group's rows x longest row <= `max_tokens` (a
    longer row goes alone) and at most `max_rows` rows; rows keep their order in a group.
    With `slots`, a group holds rows of one slot only: its LoRA is then one plain GEMM pair
    with the add in the expand (`routing.add_delta_by_runs`), not the batched kernels."""
    if max_tokens < 1 or max_rows < 1:
        raise ValueError(f"max_tokens and max_rows must be >= 1, got {max_tokens}, {max_rows}")
    key = (lambda i: (0, -lengths[i])) if slots is None else (lambda i: (slots[i], -lengths[i]))
    order = sorted(range(len(lengths)), key=key)
    groups: list[list[int]] = []
    for i in order:
        same = slots is None or (groups and slots[groups[-1][0]] == slots[i])
        if groups and same and len(groups[-1]) < max_rows:
            widest = lengths[groups[-1][0]]
            if (len(groups[-1]) + 1) * widest <= max_tokens:
                groups[-1].append(i)
                continue
        groups.append([i])
    return [sorted(g) for g in groups]


def pack_costs(packs: Sequence[Sequence[int]], prompt_ids: Sequence[Sequence[int]],
               completion_ids: Sequence[Sequence[int]], pair_weight: float) -> list[float]:
    """Each pack's forward-backward cost in tokens' worth of weight FLOPs: its tokens plus its
    causal attention's (query, key) pairs times `pair_weight` (`attention_pair_weight`). Ranks
    given equal tokens are not given equal work when one holds the long-context rows (a
    teacher's long prompt and its completion), so the update is shared out by this cost."""
    out = []
    for g, width in zip(packs, pack_widths(packs, prompt_ids, completion_ids), strict=True):
        p = len(prompt_ids[g[0]])
        # the prompt attends causally; each completion to the prompt and to its own prefix
        pairs = p * (p + 1) / 2 + sum(c * p + c * (c + 1) / 2
                                      for c in (len(completion_ids[i]) for i in g))
        out.append(width + pair_weight * pairs)
    return out


def attention_pair_weight(model: torch.nn.Module) -> float:
    """FLOPs of one attention (query, key) pair over those of one token through the weights:
    scores and values cost 4 x hidden per pair and layer, the weights 2 x parameters per
    token (forward; the backward scales both alike). ~2.6e-5 for a 7B Qwen2; 0 (tokens
    alone) for a config without layers and width."""
    cfg = getattr(model, "config", None)
    layers, hidden = getattr(cfg, "num_hidden_layers", 0), getattr(cfg, "hidden_size", 0)
    params = sum(p.numel() for p in model.parameters())
    return 4 * layers * hidden / (2 * params) if layers and hidden and params else 0.0


def split_packs(packs: Sequence[Sequence[int]], prompt_ids: Sequence[Sequence[int]],
                completion_ids: Sequence[Sequence[int]], limit: int,
                overhead: tuple[float, float] | None = None) -> list[list[int]]:
    """Packs wider than `limit` tokens (as `pack_widths` counts them with `overhead`) cut into
    consecutive parts of at most `limit` (each part repeats the prompt; a row wider than
    `limit` alone stays alone): a part whose activations fit costs one more prompt forward,
    where the whole pack, checkpointed, costs a second forward of everything."""
    out: list[list[int]] = []
    for g in packs:
        prompt = len(prompt_ids[g[0]])
        part: list[int] = []
        lengths: list[int] = []
        for i in g:
            n = len(completion_ids[i])
            if part and pack_width(prompt, [*lengths, n], overhead) > limit:
                out.append(part)
                part, lengths = [], []
            part.append(i)
            lengths.append(n)
        out.append(part)
    return out


def pack_micro_batches(packs: Sequence[Sequence[int]], widths: Sequence[int], max_tokens: int,
                       max_rows: int, slots: Sequence[int] | None = None
                       ) -> list[tuple[list[int], int]]:
    """Length-grouped micro-batches of whole packs (`micro_batches` over pack widths,
    `max_rows` sequences; with rows' `slots`, one slot per micro-batch), each as (row
    indices, padded tokens: sequences x the widest); shared packs and lone rows never share
    a micro-batch, so the lone rows keep the causal kernel."""
    out = []
    for shared in (True, False):
        units = [j for j, g in enumerate(packs) if (len(g) > 1) == shared]
        keys = None if slots is None else [slots[packs[j][0]] for j in units]
        for group in micro_batches([widths[j] for j in units], max_tokens, max_rows, keys):
            rows = sorted(i for j in group for i in packs[units[j]])
            out.append((rows, len(group) * max(widths[units[j]] for j in group)))
    return out


# -- the step ---------------------------------------------------------------------------------


class PolicyUpdate:
    """The policy step of a run's parts; `allreduce_s` is the last step's gradient all-reduce
    (with the wait for the slowest rank)."""

    def __init__(self, parts: Parts, cfg: Config, world: dist.World = dist.SINGLE) -> None:
        self.parts, self.cfg, self.world = parts, cfg, world
        self.allreduce_s = 0.0

    def step(self, rollouts: list[Rollout], rewards: list[float]
             ) -> tuple[dict[str, float], dict[str, float], list[float | None]]:
        """One step for every adapter at once; returns each member's loss and gradient norm
        (before clipping), and each rollout's advantage (None for an empty completion, which is
        not trained on)."""
        p, tc = self.parts, self.cfg.train
        # slot order lets the bank use grouped matmuls (advantages are computed per group)
        batch = sorted(((i, r, rew) for i, (r, rew) in enumerate(zip(rollouts, rewards, strict=True))
                        if r.token_ids), key=lambda x: p.slot[x[1].member])
        per_rollout: list[float | None] = [None] * len(rollouts)
        if not batch:
            return {}, {}, per_rollout
        advs = trr_advantages([((r.member, r.role, r.type), rew) for _, r, rew in batch])
        for (i, _, _), a in zip(batch, advs, strict=True):
            per_rollout[i] = a
        rollouts = [r for _, r, _ in batch]
        dev = next(p.model.parameters()).device
        slots = torch.tensor([p.slot[r.member] for r in rollouts], device=dev)
        # on the device once: a host-to-device copy inside the micro-batch loop waits for the
        # GPU to finish the forward before the loss and backward can be queued
        adv_all = torch.tensor(advs, device=dev, dtype=torch.float32)
        lengths = torch.tensor([len(r.token_ids) for r in rollouts], device=dev)
        full_mask = torch.arange(int(lengths.max()), device=dev)[None, :] < lengths[:, None]
        token_counts = group_token_counts(full_mask, slots, n_groups=len(p.slot))
        slot_loss = torch.zeros(len(p.slot), device=dev)
        p.model.train()
        p.opt.zero_grad()
        prompts, comps = [r.prompt_ids for r in rollouts], [r.token_ids for r in rollouts]
        slot_list = slots.tolist()
        packs = (shared_prompt_packs(prompts, slot_list) if tc.share_prompts
                 else [[i] for i in range(len(rollouts))])
        overhead = pack_overhead(p.model)  # memory widths: what a shared pack's attention keeps
        widths = pack_widths(packs, prompts, comps, overhead)
        costs = pack_costs(packs, prompts, comps, attention_pair_weight(p.model))
        mine = dist.shard(costs, self.world.size)[self.world.rank]  # this rank's packs, whole
        with p.bank.held_copy(p.model.dtype):  # one cast of the bank for the whole update
            keep, max_tokens = self.memory_plan(max(widths))  # (the copy is not free memory)
            my_packs = [packs[j] for j in mine]
            if keep:  # a pack too wide to keep its activations goes in parts that fit
                my_packs = split_packs(my_packs, prompts, comps, keep, overhead)
            for rows, padded in pack_micro_batches(
                    my_packs, pack_widths(my_packs, prompts, comps, overhead), max_tokens,
                    tc.micro_batch_size, slot_list if tc.micro_batch_by_slot else None):
                if keep is not None:  # checkpoint only what does not fit with activations kept
                    use_checkpointing(p.model, padded > keep)
                part = [rollouts[i] for i in rows]
                # host ids and queued copies: nothing here waits for the GPU, which runs the
                # last micro-batch's backward while this one is laid out
                idx = host_to_device(torch.tensor(rows), dev)
                row_slots = slots[idx]
                logprobs, mask = sequence_logprobs(
                    p.model, p.bank, [r.prompt_ids for r in part], [r.token_ids for r in part],
                    [slot_list[i] for i in rows], share_prompts=tc.share_prompts,
                )
                loss, row_loss = policy_loss(logprobs.float(), adv_all[idx], mask, groups=row_slots,
                                             token_counts=token_counts)
                loss.backward()
                slot_loss.index_add_(0, row_slots, row_loss)
        if self.world.distributed:
            p.bank.bind_grads_()
            t0 = time.perf_counter()
            dist.all_reduce_sum(p.bank.grads, self.world)
            if p.bank.grads.is_cuda:
                torch.cuda.synchronize()
            self.allreduce_s = time.perf_counter() - t0
            dist.all_reduce_sum(slot_loss, self.world)
        norms = p.opt.step()
        p.opt.zero_grad()
        p.model.eval()
        trained = set(slot_list)
        losses = {m: float(slot_loss[i]) for m, i in p.slot.items() if i in trained}
        return losses, {m: float(norms.get(i, 0.0)) for m, i in p.slot.items()}, per_rollout

    def memory_plan(self, longest: int) -> tuple[int | None, int]:
        """`(keep_tokens, micro_batch_tokens)`: with `auto`, micro-batches of at most
        `keep_tokens` padded tokens run without activation checkpointing, larger ones with it
        (`engine/memory.plan_update`); otherwise keep_tokens is None (the config decides)."""
        mode, max_tokens = self.cfg.model.gradient_checkpointing, self.cfg.train.micro_batch_tokens
        if mode != "auto":
            return None, max_tokens
        model = self.parts.model
        return plan_update(model, longest, max_tokens, HEAD_CHUNK,
                           update_budget(model, self.cfg.train.memory_share),
                           head_compiled(model))

    # -- the update's KL ----------------------------------------------------------------------
    @torch.no_grad()
    def token_logprobs(self, rows: list[Rollout]) -> list[torch.Tensor]:
        """Each row's completion-token log-probs under its member's current adapter."""
        p, tc = self.parts, self.cfg.train
        out: list[torch.Tensor] = [torch.empty(0)] * len(rows)
        widths = [len(r.prompt_ids) + len(r.token_ids) for r in rows]
        for group in micro_batches(widths, tc.micro_batch_tokens, tc.micro_batch_size):
            part = [rows[i] for i in group]
            lp, mask = sequence_logprobs(p.model, p.bank, [r.prompt_ids for r in part],
                                         [r.token_ids for r in part],
                                         [p.slot[r.member] for r in part])
            for i, row, m in zip(group, lp.float(), mask, strict=True):
                out[i] = row[m]
        return out

    def kl(self, rows: list[Rollout], before: list[torch.Tensor]) -> dict[str, float]:
        """Per member, the mean per-token KL(before || after) of the update on `rows`: the
        k3 estimator exp(r) - 1 - r, r = log pi_after - log pi_before, on tokens sampled from
        the policy before the update (unbiased and never negative)."""
        per: dict[str, list[torch.Tensor]] = defaultdict(list)
        for r, old, new in zip(rows, before, self.token_logprobs(rows), strict=True):
            d = new - old
            per[r.member].append(torch.expm1(d) - d)
        return {m: float(torch.cat(v).mean()) for m, v in per.items()}

    # -- deterministic mode -------------------------------------------------------------------
    def kernel_probe(self) -> None:
        """One forward and backward of `step`'s kernels on made-up tokens: rows of two slots
        together (the bank's grouped routing) and of one slot (its plain one), answers packed on
        a shared prompt when the config packs them, the loss. Gradients are dropped; weights,
        optimizer and random state (LoRA dropout draws on it) are left as they were."""
        p, tc = self.parts, self.cfg.train
        dev = next(p.model.parameters()).device
        prompts, comps = [[1, 2, 3]] * 3 + [[4, 5]], [[6, 7], [8], [9], [10, 11]]
        slots = torch.tensor([0, 0, 0, len(p.slot) - 1], device=dev)
        p.model.train()
        with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []), \
                p.bank.held_copy(p.model.dtype):
            for rows in ([0, 1, 2, 3], [0, 1, 2]):
                idx = torch.tensor(rows, device=dev)
                logprobs, mask = sequence_logprobs(
                    p.model, p.bank, [prompts[i] for i in rows], [comps[i] for i in rows],
                    slots[idx], share_prompts=tc.share_prompts)
                counts = group_token_counts(mask, slots[idx], n_groups=len(p.slot))
                loss, _ = policy_loss(logprobs.float(), torch.ones(len(rows), device=dev), mask,
                                      groups=slots[idx], token_counts=counts)
                loss.backward()
        p.opt.zero_grad()
        p.model.eval()


def nonfinite(parts: Parts, losses: dict[str, float], norms: dict[str, float]) -> str | None:
    """The first member whose loss, gradient norm or updated adapter is not finite, with
    what is (`train.nonfinite`: the loop stops before anything of the step is written)."""
    ok = torch.isfinite(parts.bank.weights.detach().flatten(1)).all(dim=1).tolist()
    for m, i in parts.slot.items():
        what = ("loss", losses.get(m, 0.0)), ("gradient norm", norms.get(m, 0.0))
        bad = [f"{name} {v}" for name, v in what if not math.isfinite(v)]
        if not ok[i]:
            bad.append("adapter weights not finite after the update")
        if bad:
            return f"member {m}: {', '.join(bad)}"
    return None
