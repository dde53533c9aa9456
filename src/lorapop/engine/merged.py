"""Frozen projections that read the same input (q/k/v, gate/up) as one GEMM in decode steps.

A decode step multiplies a few dozen rows by every weight of the model, so each GEMM is
bound by reading its weight, and a GEMM with a narrow output (a 7B's k and v: 512 columns
against 3,584 inputs) leaves most of the GPU idle while it does. `merge_projections` lays
each group's weights out as row blocks of one [sum of outputs, in] tensor, the modules'
weights becoming views of it (no memory added). In a decode step (one token a row, no
autograd) the group's first call computes every member's output in one GEMM and hands the
others theirs when they are called with the very same input. Measured at 7B on an H200
(`docs/performance.md`): decode steps 3.3% faster at 48 rows, 0.7% at 192. A prefill merged
the same way was 5% slower (the members' outputs are strided column slices, which what
follows reads more slowly), so forwards of several tokens a row, training's, and
torch.compile's traces run each module's own `F.linear` on its view.

A member's output is a column slice of the group's [..., sum of outputs] result: strided,
not contiguous. The LoRA hooks add into it in place or out of place, the attention splits
its last dimension into heads, and the MLP reads it elementwise: all take strides.

`reserve_lora_rows` (once an `AdapterBank` is attached) appends to each group's weight, and
to each other LoRA target's that reads an input of its own (o_proj, down_proj: groups of
one), rows for the bank's A factors of every member and slot, and hands them to the bank
(`AdapterBank.keep_decode_a`), whose decode cache then keeps its A there instead of in a
tensor of its own. A decode step's GEMM then also computes every slot's LoRA shrink
`x @ A^T` (`GemmShrink`): ~4% more GEMM bytes at 8 slots of rank 32 instead of a shrink
kernel per group, each costing its launch more than its bytes at a decode step's few hundred
rows. `LORA_ROWS` off leaves the rows out of the GEMM (before/after measurements).
"""

from __future__ import annotations

import itertools
import types
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lorapop.lora.bank import SHARED_INPUT, AdapterBank
from lorapop.lora.routing import GemmShrink, tensor_version

#: False: decode steps' GEMMs leave out the LoRA rows (`reserve_lora_rows`): the decode cache
#: then runs its own shrink (a switch for before/after measurements)
LORA_ROWS = True


@dataclass(eq=False)
class _Group:
    weight: Tensor  # [sum of outs (+ lora), in]; the members' weights are its first row blocks
    bias: Tensor | None
    outs: list[int]
    ptrs: list[int]  # where each member's weight starts in `weight`
    x: Tensor | None = None  # the input of the outputs held, and its version then
    version: int = -1
    parts: tuple[Tensor, ...] = ()
    taken: set[int] = field(default_factory=set)
    shrink: GemmShrink | None = None  # the rows after the members' (`reserve_lora_rows`)


def _forward(self: nn.Linear, x: Tensor) -> Tensor:
    g: _Group = self._lorapop_group
    i: int = self._lorapop_index
    one_token = x.dim() >= 2 and x.shape[-2] == 1
    if (not one_token or torch.is_grad_enabled() or torch.compiler.is_compiling()
            or self.weight.data_ptr() != g.ptrs[i]):
        return F.linear(x, self.weight, self.bias)
    version = tensor_version(x)
    if g.x is not x or g.version != version or i in g.taken:
        # a member called twice on one input gets a fresh output: the first may have been
        # written in place (the LoRA hooks add into it)
        shrink = g.shrink
        if shrink is not None and shrink.used and LORA_ROWS:
            *g.parts, h = F.linear(x, g.weight, g.bias).split(
                [*g.outs, shrink.rows.shape[0]], dim=-1)
            shrink.put(x, h)
        else:
            n = sum(g.outs)
            bias = None if g.bias is None else g.bias[:n]
            g.parts = F.linear(x, g.weight[:n], bias).split(g.outs, dim=-1)
        g.x, g.version, g.taken = x, version, set()
    g.taken.add(i)
    out = g.parts[i]
    if len(g.taken) == len(g.outs):  # every member has its output: hold nothing
        g.x, g.parts = None, ()
    return out


def reserve_lora_rows(model: nn.Module, bank: AdapterBank) -> int:
    """Append rows for the bank's A factors (every slot's, per member) to every merged group
    whose members are all its targets, and make every other frozen plain `nn.Linear` target
    that reads an input of its own (o_proj, down_proj) a group of one with such rows; hand
    them to the bank (`keep_decode_a`). Returns how many groups have them. The members'
    weights stay views of the (new) weight's first rows, so everything but a decode step
    computes as before."""
    shared = set().union(*SHARED_INPUT)
    groups: dict[int, tuple[_Group, list[tuple[str, nn.Module]]]] = {}
    for name, target in bank.targets.items():
        module = target.module
        g = getattr(module, "_lorapop_group", None)
        if g is None and (type(module) is nn.Linear and not module.weight.requires_grad
                          and name.rpartition(".")[2] not in shared):
            g = _Group(module.weight, module.bias, [module.out_features],
                       [module.weight.data_ptr()])
            module._lorapop_group, module._lorapop_index = g, 0
            module.forward = types.MethodType(_forward, module)
        if g is not None:
            groups.setdefault(id(g), (g, []))[1].append((name, module))
    n = 0
    for g, members in groups.values():
        if len(members) != len(g.outs):
            continue
        members.sort(key=lambda m: m[1]._lorapop_index)
        lora, outs = len(members) * bank.n_slots * bank.rank, sum(g.outs)
        if g.shrink is None or g.shrink.rows.shape[0] != lora:  # (another bank's: replaced)
            with torch.no_grad():
                g.weight = torch.cat([g.weight[:outs], g.weight.new_zeros(lora, g.weight.shape[1])])
                if g.bias is not None:
                    g.bias = torch.cat([g.bias[:outs], g.bias.new_zeros(lora)])
            _point(g, [m for _, m in members])
        g.shrink = GemmShrink(g.weight[outs:])
        bank.keep_decode_a([name for name, _ in members], g.shrink)
        n += 1
    return n


def _point(g: _Group, members: list[nn.Module]) -> None:
    """Make each member's weight (and bias) a view of its rows of the group's."""
    starts = [0, *itertools.accumulate(g.outs[:-1])]
    g.ptrs = [g.weight[s].data_ptr() for s in starts]
    for m, start, out in zip(members, starts, g.outs, strict=True):
        rows = slice(start, start + out)
        m.weight = nn.Parameter(g.weight[rows], requires_grad=False)
        if g.bias is not None:
            m.bias = nn.Parameter(g.bias[rows], requires_grad=False)


def merge_projections(model: nn.Module) -> int:
    """Merge each group of sibling projections of `model` (same input width, dtype and device,
    frozen weights; bias on all or none); returns how many groups. Call it after the model is
    placed: a member whose weight is later moved or replaced runs its own GEMM again."""
    n = 0
    for parent in model.modules():
        for names in SHARED_INPUT:
            mods = [getattr(parent, name, None) for name in sorted(names)]
            if not all(type(m) is nn.Linear for m in mods):
                continue
            w0 = mods[0].weight
            if any(m.weight.requires_grad or m.weight.shape[1] != w0.shape[1]
                   or m.weight.dtype != w0.dtype or m.weight.device != w0.device
                   or (m.bias is None) != (mods[0].bias is None) for m in mods):
                continue
            with torch.no_grad():
                weight = torch.cat([m.weight for m in mods])
                bias = torch.cat([m.bias for m in mods]) if mods[0].bias is not None else None
            group = _Group(weight, bias, [m.out_features for m in mods], [])
            _point(group, mods)
            for i, m in enumerate(mods):
                m._lorapop_group, m._lorapop_index = group, i
                m.forward = types.MethodType(_forward, m)
            n += 1
    return n
