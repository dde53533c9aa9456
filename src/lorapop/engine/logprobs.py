"""Teacher-forced log-probabilities of completions: what the policy-gradient loss needs.

Each row is laid out as [prompt, completion, right padding] with position ids 0..n-1, exactly
as `generate` cached it, so a row scores the same as it would alone and as it did while it
was sampled. Padding only ever follows a row's real tokens, so plain causal attention needs no
padding mask: SDPA takes its fused causal kernel (FlashAttention on CUDA). Only the final
hidden states of the completion positions go through the LM head, a chunk of positions at a
time under activation checkpointing: the [tokens, vocabulary] logits never exist whole, in
the forward or the backward.

`micro_batches` cuts rows into length-grouped micro-batches of a bounded padded-token count,
so the update wastes little compute on padding and runs as few forwards as memory allows.

Prompt sharing: a student answers each task several times under one adapter, so several rows
share their prompt and slot. With `share_prompts` such rows go through the model as one
sequence [prompt, c1, ..., ck] (position ids restart after the prompt for each completion) in
which each completion sees the prompt and its own earlier tokens only (`pack_attention`: fused
SDPA kernels piecewise, no mask): the same log-probs and gradients, with the prompt computed
once. Rows sharing nothing keep the plain causal path.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from lorapop.engine import pack_attention
from lorapop.engine.decoder import route
from lorapop.engine.fused import compile_failures, compiled_call
from lorapop.engine.transfer import host_to_device

HEAD_CHUNK = 2048  # positions whose logits are formed at once (memory.update_fixed_bytes)


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


def shared_prompt_packs(prompt_ids: Sequence[Sequence[int]],
                        slot_ids: Sequence[int]) -> list[list[int]]:
    """Row indices grouped by identical (prompt, slot), groups in order of first appearance."""
    packs: dict[tuple, list[int]] = {}
    for i, (p, s) in enumerate(zip(prompt_ids, slot_ids, strict=True)):
        packs.setdefault((int(s), tuple(p)), []).append(i)
    return list(packs.values())


def pack_widths(packs: Sequence[Sequence[int]], prompt_ids: Sequence[Sequence[int]],
                completion_ids: Sequence[Sequence[int]]) -> list[int]:
    """Tokens of each pack's sequence: its prompt once plus every completion."""
    return [len(prompt_ids[g[0]]) + sum(len(completion_ids[i]) for i in g) for g in packs]


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
                completion_ids: Sequence[Sequence[int]], limit: int) -> list[list[int]]:
    """Packs wider than `limit` tokens cut into consecutive parts of at most `limit` (each
    part repeats the prompt; a row wider than `limit` alone stays alone): a part whose
    activations fit costs one more prompt forward, where the whole pack, checkpointed, costs a
    second forward of everything."""
    out: list[list[int]] = []
    for g in packs:
        prompt = len(prompt_ids[g[0]])
        part: list[int] = []
        width = prompt
        for i in g:
            n = len(completion_ids[i])
            if part and width + n > limit:
                out.append(part)
                part, width = [], prompt
            part.append(i)
            width += n
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


def _pick_and_lse(logits: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each position's target logit and log-sum-exp, in float32."""
    x = logits.float()
    return x.gather(-1, target[..., None]).squeeze(-1), torch.logsumexp(x, dim=-1)


def _logits_grad(logits: torch.Tensor, target: torch.Tensor, lse: torch.Tensor,
                 g: torch.Tensor) -> torch.Tensor:
    """d(sum g * log_softmax(logits)[target]) / d logits = g * (onehot(target) - softmax)."""
    vocab = torch.arange(logits.shape[-1], device=logits.device)
    onehot = (vocab == target[..., None]).float()
    return ((onehot - torch.exp(logits.float() - lse[..., None])) * g[..., None]).to(logits.dtype)


#: On CUDA the two passes over [positions, vocabulary] go through torch.compile: eager, the
#: float32 cast, the log-sum-exp and its gradient each make full-size copies (~15% of an
#: update micro-batch at 7B with a 152k vocabulary); compiled, the forward is one reduction
#: and the gradient one elementwise kernel. CPU stays eager (no compiler needed).
COMPILE_HEAD = True


def head_compiled(model: Any) -> bool:
    """Whether `model`'s LM-head passes run compiled (on CUDA, unless the compiler failed on
    them): `memory.update_fixed_bytes` then reserves a quarter of the eager passes' memory."""
    on_cuda = next(model.parameters()).is_cuda
    failed = {_pick_and_lse.__qualname__, _logits_grad.__qualname__} & compile_failures
    return on_cuda and COMPILE_HEAD and not failed


def _pass(fn: Any, compiled: bool, *args: torch.Tensor) -> Any:
    return compiled_call(fn, *args) if compiled and COMPILE_HEAD else fn(*args)


class _HeadLogprobs(torch.autograd.Function):
    """log pi(target) through the LM head without keeping the [positions, vocabulary] logits:
    the backward recomputes them from the hidden states (activation checkpointing by hand,
    so the compiled passes run in the backward too; torch's checkpoint recomputes with the
    compiler off)."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                target: torch.Tensor, compiled: bool) -> torch.Tensor:
        # [positions, h]: one dynamic dimension, so the compiled passes rarely recompile
        h, y = hidden.reshape(-1, hidden.shape[-1]), target.reshape(-1)
        picked, lse = _pass(_pick_and_lse, compiled, F.linear(h, weight, bias), y)
        ctx.save_for_backward(h, weight, bias, y, lse)
        ctx.compiled, ctx.shape = compiled, hidden.shape
        return (picked - lse).view(target.shape)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        h, weight, bias, y, lse = ctx.saved_tensors
        grad = _pass(_logits_grad, ctx.compiled, F.linear(h, weight, bias), y, lse, g.reshape(-1))
        need = ctx.needs_input_grad
        return ((grad @ weight).view(ctx.shape) if need[0] else None,
                grad.T @ h if need[1] else None,
                grad.sum(0) if need[2] else None, None, None)


def head_logprobs(head: torch.nn.Module, hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """log pi(target) [..] from final hidden states [.., h] through the LM head (a Linear);
    compiled on CUDA (`COMPILE_HEAD`)."""
    return _HeadLogprobs.apply(hidden, head.weight, getattr(head, "bias", None), target,
                               hidden.is_cuda)


def sequence_logprobs(
    model: Any,
    bank: Any,
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Sequence[Sequence[int]],
    slot_ids: Sequence[int] | torch.Tensor,
    chunk_size: int = HEAD_CHUNK,
    share_prompts: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """log pi(completion token | prefix) per token, each row under its adapter slot.

    Returns `(logprobs, mask)`, both [B, T] with T the longest completion; column j is
    completion token j and `mask` marks real tokens (padding has logprob 0). Differentiable
    when called with grad enabled. `chunk_size` bounds how many positions' logits (over all
    rows) are formed at once. `share_prompts` packs rows of one prompt and slot together.
    Given `slot_ids` on the host (a list), the call never waits for the GPU, so a loop of
    micro-batches keeps it busy; a device tensor of ids is read back first.
    """
    b = len(prompt_ids)
    if len(completion_ids) != b or len(slot_ids) != b:
        raise ValueError("prompt_ids, completion_ids and slot_ids must have the same length")
    if any(len(p) == 0 for p in prompt_ids):
        raise ValueError("every prompt needs at least one token")
    dev = next(model.parameters()).device
    t = max((len(c) for c in completion_ids), default=0)
    if b == 0 or t == 0:
        empty = torch.zeros(b, t, device=dev)
        return empty, empty.bool()
    slot_list = slot_ids.tolist() if isinstance(slot_ids, torch.Tensor) else list(slot_ids)
    packs = shared_prompt_packs(prompt_ids, slot_list) if share_prompts else [[i] for i in range(b)]
    shared = any(len(g) > 1 for g in packs)
    width = max(pack_widths(packs, prompt_ids, completion_ids))
    n = len(packs)
    ids = torch.zeros(n, width, dtype=torch.long)
    pos = torch.zeros(n, width, dtype=torch.long)
    target = torch.zeros(b, t, dtype=torch.long)
    at = torch.zeros(b, t, dtype=torch.long)  # flat position whose output predicts column j
    mask = torch.zeros(b, t, dtype=torch.bool)
    for s, g in enumerate(packs):
        p = prompt_ids[g[0]]
        ids[s, : len(p)] = torch.as_tensor(list(p), dtype=torch.long)
        pos[s, : len(p)] = torch.arange(len(p))
        start = len(p)
        for i in g:
            c = completion_ids[i]
            end = start + len(c)
            ids[s, start:end] = torch.as_tensor(list(c), dtype=torch.long)
            pos[s, start:end] = torch.arange(len(p), len(p) + len(c))
            target[i, : len(c)] = torch.as_tensor(list(c), dtype=torch.long)
            at[i, : len(c)] = s * width + torch.arange(start - 1, end - 1)
            at[i, 0] = s * width + len(p) - 1  # the first token follows the prompt
            mask[i, : len(c)] = True
            start = end
    # queued copies: the host lays out the next micro-batch while the GPU runs this one
    ids, target, at, mask = (host_to_device(x, dev) for x in (ids, target, at, mask))
    # no mask step (`maskless`): the all-ones padding mask only stops transformers searching
    # the position ids for packed sequences; packs attend through their layout, lone rows
    # causally (padding only follows real tokens)
    pack_attention.install(model)
    extra: dict[str, Any] = {"attention_mask": torch.ones(n, width, dtype=torch.long, device=dev)}
    if shared:
        extra["pack_layout"] = pack_attention.PackLayout.build(
            [len(prompt_ids[g[0]]) for g in packs],
            [[len(completion_ids[i]) for i in g] for g in packs], width, dev)
        pos = host_to_device(pos, dev)
    else:  # one row per sequence: positions run on into the padding, as generated
        pos = torch.arange(width, device=dev).expand(n, -1)
    # slot ids on the host: route checks them there and queues their copy
    slots = torch.as_tensor([slot_list[g[0]] for g in packs], dtype=torch.long)
    with route(bank, slots), pack_attention.maskless():
        hidden = model.get_decoder()(
            input_ids=ids, position_ids=pos, use_cache=False, **extra,
        ).last_hidden_state
    hidden = hidden.flatten(0, 1)[at]  # [B, T, h]
    head = model.get_output_embeddings()
    rows = max(1, chunk_size // b)  # positions per chunk, so a chunk holds ~chunk_size rows
    parts = [head_logprobs(head, hidden[:, s : s + rows], target[:, s : s + rows])
             for s in range(0, t, rows)]
    return torch.cat(parts, dim=1).masked_fill(~mask, 0.0), mask
