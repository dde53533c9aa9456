"""DecodeCache: the one-token decode path equals the plain LoRA formula for any slot count."""

from __future__ import annotations

import warnings
from collections import Counter

import pytest
import torch
from lora_fixtures import VOCAB, randomize_b, tiny_model

from lorapop.engine import fused, merged
from lorapop.engine.merged import merge_projections
from lorapop.engine.patches import attach_lora, patch_base_model
from lorapop.lora import decode_kernel
from lorapop.lora.bank import AdapterBank
from lorapop.lora.routing import DecodeCache, Routing

RANK, SCALING = 4, 1.5  # scaling folded into the cached B; not 1 so a lost factor shows


def _groups(n: int, gen: torch.Generator) -> list[list[tuple[str, torch.Tensor, torch.Tensor]]]:
    """q/k/v (unequal outs: block-diagonal B), gate/up (equal outs: stacked B), o alone."""

    def ab(width: int, out: int) -> tuple[torch.Tensor, torch.Tensor]:
        a = torch.randn(n, RANK, width, generator=gen, dtype=torch.float64).float()
        return a, torch.randn(n, out, RANK, generator=gen, dtype=torch.float64).float()

    return [
        [("q", *ab(12, 12)), ("k", *ab(12, 4)), ("v", *ab(12, 4))],
        [("gate", *ab(12, 20)), ("up", *ab(12, 20))],
        [("o", *ab(12, 12))],
    ]


def _reference(
    a: torch.Tensor, b: torch.Tensor, x: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """SCALING * B[s] @ A[s] @ x per row, in float64."""
    a64, b64 = a.double()[ids], b.double()[ids]  # [B, r, in], [B, out, r]
    h = torch.einsum("bri,bi->br", a64, x.double()[:, 0])
    return SCALING * torch.einsum("bor,br->bo", b64, h)[:, None]


@pytest.mark.parametrize("n_slots", [1, 3])
@pytest.mark.parametrize("fuse_add", [False, True])
def test_add_delta_equals_the_lora_formula(n_slots: int, fuse_add: bool):
    gen = torch.Generator().manual_seed(n_slots)
    groups = _groups(n_slots, gen)
    cache = DecodeCache(groups, torch.float32, SCALING)
    cache.refresh_(0)
    rows = 7
    routing = Routing.empty(rows, n_slots, torch.device("cpu"))
    for ids in (torch.randint(0, n_slots, (rows,), generator=gen), torch.arange(rows) % n_slots):
        routing.fill_(ids, False)  # a second routing refills the cached masks in place
        for group in groups:
            x = torch.randn(rows, 1, group[0][1].shape[2], generator=gen)
            for name, a, b in group:  # members in order, one shared x: h (and d) reused
                out = torch.randn(rows, 1, b.shape[1], generator=gen)
                want = out.double() + _reference(a, b, x, ids)
                y = cache.add_delta(name, x, out, routing, True, fuse_add)
                torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5)
                # eager: added into the base output in place (no copy of it first)
                assert fuse_add or y.data_ptr() == out.data_ptr()
        assert all(m.group.x is None for m in cache.members.values())  # nothing held over


def test_refresh_follows_new_weights_and_keeps_buffers():
    gen = torch.Generator().manual_seed(0)
    groups = _groups(2, gen)
    cache = DecodeCache(groups, torch.float32, SCALING)
    cache.refresh_(0)
    ptrs = [m.b.data_ptr() for m in cache.members.values()]
    a, b = groups[0][1][1], groups[0][1][2]  # k's A and B (a block of the block-diagonal B)
    a.mul_(-2.0)
    b.add_(1.0)
    cache.refresh_(1)
    assert [m.b.data_ptr() for m in cache.members.values()] == ptrs  # graphs stay valid
    routing = Routing.empty(3, 2, torch.device("cpu"))
    ids = torch.tensor([1, 0, 1])
    routing.fill_(ids, False)
    x = torch.randn(3, 1, 12, generator=gen)
    out = torch.zeros(3, 1, 4)
    y = cache.add_delta("k", x, out, routing, False)  # unshared: k's own A rows only
    torch.testing.assert_close(y.double(), _reference(a, b, x, ids), rtol=1e-5, atol=1e-5)
    q_block = cache.members["q"].b  # the off-diagonal blocks stay zero
    assert q_block.shape == (2 * RANK, 12)
    big = cache.members["q"].group.b
    assert torch.count_nonzero(big[: 2 * RANK, 12:]) == 0



def test_a_kernel_failure_warns_once_and_the_plain_path_takes_over(monkeypatch):
    """Kernels that fail to build or launch leave the plain path in their place, with one
    warning naming why; the LoRA terms are still added."""
    class Broken:
        def __getitem__(self, grid):
            raise RuntimeError("no kernel here\nthe compiler's log")

    monkeypatch.setattr(decode_kernel, "failure", None)
    monkeypatch.setattr(decode_kernel, "_kernels", lambda: (Broken(), Broken(), Broken()))
    monkeypatch.setattr(decode_kernel, "usable", lambda x, out: decode_kernel.failure is None)
    gen = torch.Generator().manual_seed(1)
    groups = _groups(3, gen)
    cache = DecodeCache(groups, torch.float32, SCALING)
    cache.refresh_(0)
    routing = Routing.empty(5, 3, torch.device("cpu"))
    ids = torch.tensor([2, 0, 1, 2, 0])
    routing.fill_(ids, False)
    x = torch.randn(5, 1, 12, generator=gen)
    with pytest.warns(UserWarning, match="LoRA decode kernels unavailable .*no kernel here"):
        y = cache.add_delta("q", x, torch.zeros(5, 1, 12), routing, True)
    assert decode_kernel.failure == "RuntimeError: no kernel here"
    torch.testing.assert_close(y.double(), _reference(*groups[0][0][1:], x, ids),
                               rtol=1e-5, atol=1e-5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y = cache.add_delta("k", x, torch.zeros(5, 1, 4), routing, True)
    torch.testing.assert_close(y.double(), _reference(*groups[0][1][1:], x, ids),
                               rtol=1e-5, atol=1e-5)

KERNELS = torch.cuda.is_available() and decode_kernel._kernels() is not None


def _gpu_groups(n: int, rank: int, width: int, gen: torch.Generator):
    """q/k/v, gate/up and o of a model `width` wide, weights on the GPU (float32 masters)."""
    def ab(out: int, inp: int = width) -> tuple[torch.Tensor, torch.Tensor]:
        a = torch.randn(n, rank, inp, generator=gen) / inp**0.5
        return a.cuda(), (torch.randn(n, out, rank, generator=gen) / rank**0.5).cuda()

    return [[("q", *ab(width)), ("k", *ab(width // 4)), ("v", *ab(width // 4))],
            [("gate", *ab(3 * width)), ("up", *ab(3 * width))],
            [("o", *ab(width))], [("down", *ab(width, 3 * width))]]


def _deltas(cache: DecodeCache, groups, xs, routing: Routing) -> list[torch.Tensor]:
    """Every member's LoRA term as `add_delta` adds it into its base output (a column slice
    of the group's, as merged projections hand them over), members in order on one x."""
    deltas = []
    for group, x in zip(groups, xs, strict=True):
        widths = [b.shape[1] for _, _, b in group]
        merged = torch.randn(x.shape[0], 1, sum(widths), device="cuda").to(cache.dtype)
        base = merged.clone()
        for (name, _, _), out in zip(group, merged.split(widths, dim=-1), strict=True):
            y = cache.add_delta(name, x, out, routing, True)
            assert y.data_ptr() == out.data_ptr()  # in place into the base output
        deltas += (merged.float() - base.float()).split(widths, dim=-1)
    return deltas


@pytest.mark.skipif(not KERNELS, reason="the Triton kernels need a GPU")
@pytest.mark.parametrize("n_slots,rank,width,rows", [(1, 32, 256, 5), (3, 4, 300, 37),
                                                     (8, 32, 1200, 176), (8, 16, 512, 1),
                                                     (4, 32, 512, 40)])
def test_kernels_equal_the_plain_path(monkeypatch, n_slots, rank, width, rows):
    """Each row through its own slot's A and B only gives what every slot's masked GEMMs
    give (up to float32 summation order), and the LoRA formula: rows in any slot order,
    tiles cut mid-batch, ranks below the kernels' block, widths off their block."""
    gen = torch.Generator().manual_seed(rows)
    groups = _gpu_groups(n_slots, rank, width, gen)
    cache = DecodeCache(groups, torch.bfloat16, SCALING)
    cache.refresh_(0)
    routing = Routing.empty(rows, n_slots, torch.device("cuda"))
    ids = torch.randint(0, n_slots, (rows,), generator=gen)
    routing.fill_(ids.cuda(), False)
    xs = [torch.randn(rows, 1, group[0][1].shape[2], generator=gen).cuda().bfloat16()
          for group in groups]
    fast = _deltas(cache, groups, xs, routing)
    monkeypatch.setattr(decode_kernel, "ENABLED", False)
    plain = _deltas(cache, groups, xs, routing)
    assert decode_kernel.failure is None
    members = [(a.cpu(), b.cpu(), x.float().cpu()) for g, x in zip(groups, xs, strict=True)
               for _, a, b in g]
    for f, p, (a, b, x) in zip(fast, plain, members, strict=True):
        scale = p.abs().max().item() + 1e-3
        torch.testing.assert_close(f, p, atol=2e-2 * scale, rtol=0)
        torch.testing.assert_close(f.cpu().double(), _reference(a, b, x, ids),
                                   atol=3e-2 * scale, rtol=0)


@pytest.mark.skipif(not KERNELS, reason="the Triton kernels need a GPU")
def test_kernels_follow_the_routing_inside_a_cuda_graph():
    """A captured step reads the routing in place: re-routed rows get their new slots."""
    gen = torch.Generator().manual_seed(0)
    groups = _gpu_groups(4, 32, 512, gen)[:1]
    cache = DecodeCache(groups, torch.bfloat16, SCALING)
    cache.refresh_(0)
    rows = 40
    routing = Routing.empty(rows, 4, torch.device("cuda"))
    routing.fill_(torch.zeros(rows, dtype=torch.long, device="cuda"), False)
    x = torch.randn(rows, 1, 512, generator=gen).cuda().bfloat16()
    base = torch.randn(rows, 1, 768, generator=gen).cuda().bfloat16()
    out = base.clone()

    def step() -> None:
        out.copy_(base)
        for (name, _, _), o in zip(groups[0], out.split([512, 128, 128], dim=-1), strict=True):
            cache.add_delta(name, x, o, routing, True)

    step()  # warm-up (compiles the kernels)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    ids = torch.randint(0, 4, (rows,), generator=gen).cuda()
    routing.fill_(ids, False)
    graph.replay()
    want = torch.cat([_reference(a, b, x.float().cpu(), ids.cpu()).float()
                      for _, a, b in [(n, a.cpu(), b.cpu()) for n, a, b in groups[0]]], dim=-1)
    torch.testing.assert_close((out.float() - base.float()).cpu(), want, atol=3e-2, rtol=2e-2)


@pytest.mark.skipif(not KERNELS, reason="the Triton kernels need a GPU")
@pytest.mark.parametrize("n_slots,rank,width,rows,tokens", [(4, 32, 512, 5, 300),
                                                            (8, 16, 1200, 3, 77)])
def test_kernels_over_a_prefills_tokens_equal_the_lora_formula(n_slots, rank, width, rows,
                                                               tokens):
    """A prefill's rows in slot order, their tokens through the kernels (`add_delta_tokens`,
    tiles of `BM_TOKENS`, cut mid-slot): each token gets its row's slot's term, in place."""
    gen = torch.Generator().manual_seed(tokens)
    groups = _gpu_groups(n_slots, rank, width, gen)
    cache = DecodeCache(groups, torch.bfloat16, SCALING)
    cache.refresh_(0)
    ids = torch.randint(0, n_slots, (rows,), generator=gen).sort().values
    routing = Routing.empty(rows, n_slots, torch.device("cuda"))
    routing.fill_(ids.cuda(), True)
    perm = torch.arange(rows * tokens, device="cuda")
    for group in groups:
        x = torch.randn(rows, tokens, group[0][1].shape[2], generator=gen).cuda().bfloat16()
        flat = x.float().cpu().reshape(-1, 1, x.shape[-1])
        for name, a, b in group:
            out = torch.randn(rows, tokens, b.shape[1], generator=gen).cuda().bfloat16()
            base = out.clone()
            assert cache.add_delta_tokens(name, x, out, perm, routing.ends * tokens)
            want = _reference(a.cpu(), b.cpu(), flat, ids.repeat_interleave(tokens))
            got = (out.float() - base.float()).cpu().reshape(want.shape).double()
            scale = want.abs().max().item() + 1e-3
            torch.testing.assert_close(got, want, atol=3e-2 * scale, rtol=0)
    assert decode_kernel.failure is None


def _kernels_in_torch(calls: Counter):
    """`decode_kernel`'s shrink, expand and expand_group as torch ops (their formulas, any
    device): the decode cache's side of the kernel path (which h, which columns, which B
    layout, which members are skipped) runs where Triton does not."""

    def slots(perm: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        ids = torch.empty_like(perm)
        ids[perm] = torch.searchsorted(ends.long(), torch.arange(perm.numel()), right=True)
        return ids

    def shrink(x, a, n, r, perm, ends, bm=decode_kernel.BM):
        calls["shrink"] += 1
        a = a.view(a.shape[0] // (n * r), n, r, -1)[:, slots(perm, ends)]  # [G, B, r, in]
        return torch.einsum("bi,gbri->bgr", x.float(), a.float()).flatten(1)[None]

    def own(h, n, r, perm, ends, all_slots):
        """h [rows, members x r]: each row's own slot's columns (all_slots: a GEMM's h)."""
        h = h.sum(0).float()
        if not all_slots:
            return h
        rows = torch.arange(h.shape[0])
        return h.view(h.shape[0], -1, n, r)[rows, :, slots(perm, ends)].flatten(1)

    def add(h, b, out, perm, ends, r):  # out += h [B, r] @ b[slot] ([N * r, out] rows)
        b = b.unflatten(0, (-1, r))[slots(perm, ends)]
        out += torch.einsum("br,bro->bo", h.to(out.dtype).float(), b.float()).to(out.dtype)

    def expand(h, member, b, out, perm, ends, n, r, bm=decode_kernel.BM, all_slots=False):
        calls["expand"] += 1
        add(own(h, n, r, perm, ends, all_slots)[:, member * r : (member + 1) * r], b, out,
            perm, ends, r)
        return True

    def expand_group(h, b, out, perm, ends, n, r, col_member, all_slots=False):
        calls["expand_group"] += 1
        h = own(h, n, r, perm, ends, all_slots)
        for m in col_member.unique().tolist():
            blocks = (col_member == m).nonzero().flatten()
            bn = decode_kernel.BN
            cols = slice(int(blocks[0]) * bn, (int(blocks[-1]) + 1) * bn)
            b_m = b[m * n * r : (m + 1) * n * r, cols] if b.dim() == 2 else b[m]
            add(h[:, m * r : (m + 1) * r], b_m, out[:, cols], perm, ends, r)
        return True

    def expand_swiglu(h, b, gate, up, act, perm, ends, n, r, members, bm, all_slots=False):
        calls["expand_swiglu"] += 1
        h = own(h, n, r, perm, ends, all_slots)
        g, u = gate.clone(), up.clone()
        for out, m in ((g, members[0]), (u, members[1])):
            add(h[:, m * r : (m + 1) * r], b[m], out, perm, ends, r)
        act.copy_((torch.nn.functional.silu(g.float()) * u.float()).to(act.dtype))
        return True

    return shrink, expand, expand_group, expand_swiglu


def _run_kernels_in_torch(monkeypatch) -> Counter:
    """Route the decode cache's kernel path through `_kernels_in_torch` (any device); returns
    the counter of their calls."""
    calls: Counter = Counter()
    shrink, expand, expand_group, expand_swiglu = _kernels_in_torch(calls)
    monkeypatch.setattr(decode_kernel, "usable", lambda x, out: True)
    monkeypatch.setattr(decode_kernel, "shrink", shrink)
    monkeypatch.setattr(decode_kernel, "expand", expand)
    monkeypatch.setattr(decode_kernel, "expand_group", expand_group)
    monkeypatch.setattr(decode_kernel, "expand_swiglu", expand_swiglu)
    return calls


def test_the_kernel_path_adds_every_term_once_into_merged_outputs(monkeypatch):
    """With q/k/v and gate/up merged (`engine.merged`), the kernel path's group expand
    finds each group's whole output and its other members add nothing more; o and down
    expand alone. A decode forward then gives the plain path's logits."""
    monkeypatch.setattr(decode_kernel, "BN", 8)  # the tiny model's widths: 16, 32, 48
    model = tiny_model().requires_grad_(False)
    layers = model.config.num_hidden_layers
    assert merge_projections(model) == 2 * layers
    bank = AdapterBank(model, n_slots=3, rank=4, alpha=8.0)
    randomize_b(bank)
    ids = torch.randint(0, VOCAB, (7, 1), generator=torch.Generator().manual_seed(0))
    slots = [2, 0, 1, 2, 0, 1, 1]

    def logits() -> torch.Tensor:
        with torch.no_grad(), bank.route(slots):
            return model(ids, position_ids=torch.zeros_like(ids)).logits
    plain = logits()
    calls = _run_kernels_in_torch(monkeypatch)
    torch.testing.assert_close(logits(), plain, rtol=1e-5, atol=1e-5)
    assert calls == {"shrink": 4 * layers, "expand_group": 2 * layers, "expand": 2 * layers}


def test_a_prefill_in_slot_order_takes_the_kernels_over_its_tokens(monkeypatch):
    """Inside `prefill_weights`, rows of several tokens in slot order take the decode cache's
    kernels over their tokens: one shrink per group (q/k/v's h shared), one expand per
    projection, the plain path's logits, at every chunk width; rows out of slot order keep
    the batched path (the kernels' tiles need each slot's tokens together)."""
    model = tiny_model().eval()
    layers = model.config.num_hidden_layers
    bank = AdapterBank(model, n_slots=3, rank=4, alpha=8.0)
    randomize_b(bank)
    ids = torch.randint(0, VOCAB, (3, 9), generator=torch.Generator().manual_seed(0))

    def logits(slots: list[int], tokens: int) -> torch.Tensor:
        with torch.no_grad(), bank.route(slots), bank.prefill_weights(torch.float32):
            return model(ids[:, :tokens]).logits

    plain = {t: logits([0, 2, 2], t) for t in (9, 4)}
    calls = _run_kernels_in_torch(monkeypatch)
    for tokens, want in plain.items():
        calls.clear()
        got = logits([0, 2, 2], tokens)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert calls == {"shrink": 4 * layers, "expand": 7 * layers}
    with bank.route([0, 2, 2]):  # tokens in slot order: slot 0's 4, none of 1, 8 of slot 2
        perm, ends = bank._token_routing(bank._active, torch.empty(3, 4, 1))
    assert perm.tolist() == list(range(12)) and ends.tolist() == [4, 4, 12]
    calls.clear()
    logits([2, 0, 2], 9)
    assert calls == {}


@pytest.mark.parametrize("arch", ["qwen2", "llama"])  # q/k/v with biases and without
def test_lora_rows_give_a_decode_steps_shrink_from_its_gemm(monkeypatch, arch):
    """Attached through `patches.attach_lora`, a bank's decode cache keeps its A in extra
    rows of the merged projections' weights (o and down: groups of one), so a decode step's
    GEMMs give every slot's shrink and no shrink kernel runs: the logits of the same model
    without the rows, on the plain path and on the kernel path. Prefills and training
    forwards compute on the members' own rows, as before."""
    monkeypatch.setattr(decode_kernel, "BN", 8)  # the tiny model's widths: 16, 32, 48
    slots = [2, 0, 1, 2, 0, 1, 1]
    ids = torch.randint(0, VOCAB, (7, 5), generator=torch.Generator().manual_seed(0))

    def build(rows: bool):
        model = tiny_model(arch).requires_grad_(False)
        merge_projections(model)
        bank = (attach_lora if rows else AdapterBank)(model, 3, rank=4, alpha=8.0)
        randomize_b(bank)
        return model, bank

    def logits(model, bank, tokens: int = 1) -> torch.Tensor:
        with torch.no_grad(), bank.route(slots):
            return model(ids[:, :tokens], position_ids=torch.zeros(7, tokens, dtype=torch.long)
                         ).logits

    (plain_model, plain_bank), (model, bank) = build(False), build(True)
    layers = model.config.num_hidden_layers
    want = logits(plain_model, plain_bank)
    torch.testing.assert_close(logits(model, bank), want, rtol=1e-5, atol=1e-5)
    attn = model.model.layers[0].self_attn
    cache = bank.decode_cache(torch.float32)
    held = cache.members["model.layers.0.self_attn.q_proj"].group.a
    assert held.data_ptr() == attn.q_proj._lorapop_group.shrink.rows.data_ptr()
    assert held.shape == (3 * 3 * 4, attn.q_proj.in_features)  # k, q, v x 3 slots x rank 4
    assert attn.o_proj._lorapop_group.shrink.rows.shape == (3 * 4, attn.o_proj.in_features)
    calls = _run_kernels_in_torch(monkeypatch)
    torch.testing.assert_close(logits(model, bank), want, rtol=1e-5, atol=1e-5)
    assert calls == {"expand_group": 2 * layers, "expand": 2 * layers}
    calls.clear()
    monkeypatch.setattr(merged, "LORA_ROWS", False)  # the rows left out: the shrinks run
    torch.testing.assert_close(logits(model, bank), want, rtol=1e-5, atol=1e-5)
    assert calls == {"shrink": 4 * layers, "expand_group": 2 * layers, "expand": 2 * layers}
    monkeypatch.undo()
    torch.testing.assert_close(logits(model, bank, 5), logits(plain_model, plain_bank, 5),
                               rtol=1e-5, atol=1e-5)
    for m, b in ((model, bank), (plain_model, plain_bank)):
        with b.route(slots):
            m(ids).logits.float().square().mean().backward()
    torch.testing.assert_close(bank.grads, plain_bank.grads, rtol=1e-4, atol=1e-6)


@pytest.mark.skipif(not KERNELS, reason="the Triton kernels need a GPU")
@pytest.mark.parametrize("switch", ["LORA_ROWS", "SWIGLU"])
def test_generations_through_a_fast_path_equal_those_without(monkeypatch, switch):
    """Whole generations on the GPU (CUDA graphs, refills, the tail's shrinking), the decode
    GEMMs giving the LoRA shrinks (`merged.LORA_ROWS`) or the gate/up expand giving the
    SwiGLU (`decode_kernel.SWIGLU`), sample what the path without it samples, up to
    rounding at an inverse-CDF boundary, with its log-probs."""
    from lorapop.engine.byte_tokenizer import byte_tokenizer
    from lorapop.engine.generate import GenerateSpec, generate
    from lorapop.engine.patches import patch_base_model
    from lorapop.engine.sampling import SamplingParams

    tok = byte_tokenizer()
    model = tiny_model("qwen2", len(tok)).to("cuda", torch.bfloat16).requires_grad_(False)
    patch_base_model(model)
    bank = attach_lora(model, 3, rank=4, alpha=8.0)
    randomize_b(bank)
    prompts = [("def f(x):" * (1 + i % 7))[: 5 + 37 * i % 200] for i in range(20)]
    slots = [i % 3 for i in range(20)]
    params = SamplingParams(temperature=1.0, max_new_tokens=80, eos_token_ids=())
    runs = {}
    for rows in (True, False):
        monkeypatch.setattr(merged if switch == "LORA_ROWS" else decode_kernel, switch, rows)
        runs[rows] = generate(model, bank, tok, prompts, slots,
                              GenerateSpec(params=params, seed=3, batch_size=8))
    assert decode_kernel.failure is None
    diverged = 0
    for f, r in zip(runs[True], runs[False], strict=True):
        same = next((j for j, (a, b) in enumerate(zip(f.token_ids, r.token_ids, strict=True))
                     if a != b), len(f.token_ids))
        diverged += same < len(f.token_ids)
        if same < len(f.token_ids):  # the neighbouring token in vocabulary order
            assert abs(f.token_ids[same] - r.token_ids[same]) == 1
        torch.testing.assert_close(torch.tensor(f.logprobs[:same]),
                                   torch.tensor(r.logprobs[:same]), atol=5e-2, rtol=0)
    assert diverged <= len(prompts) // 4


def test_a_dropped_cache_leaves_the_gemms_as_they_were():
    """Clearing the bank's decode caches (or detaching it) stops the merged projections
    computing the LoRA rows; a new cache binds them again, and a bank of another shape
    attached later gets rows of its own."""
    model = tiny_model().requires_grad_(False)
    merge_projections(model)
    bank = attach_lora(model, 3, rank=4, alpha=8.0)
    group = model.model.layers[0].self_attn.o_proj._lorapop_group
    assert group.shrink.rows.shape[0] == 3 * 4 and not group.shrink.used
    bank.decode_cache(torch.float32)
    assert group.shrink.used
    bank.clear_caches()
    assert not group.shrink.used and group.shrink.h is None
    bank.decode_cache(torch.float32)
    bank.detach()
    assert not group.shrink.used
    assert model.model.layers[0].self_attn.q_proj._lorapop_group.shrink.rows.shape[0] == 3 * 3 * 4
    other = attach_lora(model, 2, rank=8, alpha=8.0)
    assert group.shrink.rows.shape[0] == 2 * 8
    cache = other.decode_cache(torch.float32)
    assert group.shrink.used
    assert cache.members["model.layers.0.self_attn.o_proj"].group.gemm is group.shrink


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_the_swiglu_epilogue_adds_the_gate_and_up_terms_once(monkeypatch, arch):
    """With the fused passes at inference (as on CUDA), a decode step's MLP and a prefill's
    in slot order take the gate/up group's expand with the SwiGLU as its epilogue: one
    `expand_swiglu` a layer in place of gate/up's expand, their hooks adding nothing more,
    and the plain path's logits. Off (`decode_kernel.SWIGLU`), the group's expand runs."""
    monkeypatch.setattr(decode_kernel, "BN", 8)  # the tiny model's widths: 16, 32, 48
    model = tiny_model(arch).requires_grad_(False)
    patch_base_model(model)
    bank = attach_lora(model, 3, rank=4, alpha=8.0)
    randomize_b(bank)
    layers = model.config.num_hidden_layers
    ids = torch.randint(0, VOCAB, (7, 5), generator=torch.Generator().manual_seed(0))

    def decode(slots=(2, 0, 1, 2, 0, 1, 1)) -> torch.Tensor:
        with torch.no_grad(), bank.route(list(slots)):
            return model(ids[:, :1], position_ids=torch.zeros(7, 1, dtype=torch.long)).logits

    def prefill(slots=(0, 0, 1, 1, 1, 2, 2)) -> torch.Tensor:
        with torch.no_grad(), bank.route(list(slots)), bank.prefill_weights(torch.float32):
            return model(ids).logits

    want = decode(), prefill()  # on a CPU: the hooks' plain path, no fused passes
    monkeypatch.setattr(fused, "_inference", lambda x: True)
    calls = _run_kernels_in_torch(monkeypatch)
    torch.testing.assert_close(decode(), want[0], rtol=1e-5, atol=1e-5)
    assert calls == {"expand_group": layers, "expand": 2 * layers, "expand_swiglu": layers}
    calls.clear()
    torch.testing.assert_close(prefill(), want[1], rtol=1e-5, atol=1e-5)
    assert calls == {"shrink": 4 * layers, "expand": 5 * layers, "expand_swiglu": layers}
    calls.clear()
    monkeypatch.setattr(decode_kernel, "SWIGLU", False)
    torch.testing.assert_close(decode(), want[0], rtol=1e-5, atol=1e-5)
    assert calls == {"expand_group": 2 * layers, "expand": 2 * layers}


def test_the_swiglu_epilogue_steps_aside_for_other_hooks_and_failures(monkeypatch):
    """A hook of the user's on a gate or up projection still sees its output (the MLP then
    runs its projections as usual), and a kernel that fails after the projections ran
    leaves the hooks' path to add the terms: the plain path's logits either way."""
    monkeypatch.setattr(decode_kernel, "BN", 8)
    model = tiny_model().requires_grad_(False)
    patch_base_model(model)
    bank = attach_lora(model, 3, rank=4, alpha=8.0)
    randomize_b(bank)
    ids = torch.randint(0, VOCAB, (4, 1), generator=torch.Generator().manual_seed(1))

    def logits() -> torch.Tensor:
        with torch.no_grad(), bank.route([1, 0, 2, 1]):
            return model(ids, position_ids=torch.zeros_like(ids)).logits

    want = logits()
    monkeypatch.setattr(fused, "_inference", lambda x: True)
    calls = _run_kernels_in_torch(monkeypatch)
    seen = []
    handle = model.model.layers[0].mlp.up_proj.register_forward_hook(
        lambda m, a, out: seen.append(out.shape))
    torch.testing.assert_close(logits(), want, rtol=1e-5, atol=1e-5)
    assert seen == [(4, 1, 48)] and calls["expand_swiglu"] == 1  # layer 1's MLP only
    handle.remove()
    calls.clear()
    monkeypatch.setattr(decode_kernel, "expand_swiglu", lambda *a, **k: False)
    torch.testing.assert_close(logits(), want, rtol=1e-5, atol=1e-5)
    assert calls["expand_group"] == 2 * model.config.num_hidden_layers  # q/k/v, gate/up


@pytest.mark.skipif(not KERNELS, reason="the Triton kernels need a GPU")
@pytest.mark.parametrize("n_slots,rank,width,rows,tokens", [(8, 32, 1024, 176, 1),
                                                            (3, 4, 300, 37, 1),
                                                            (4, 32, 512, 3, 300)])
def test_the_swiglu_kernel_equals_the_expand_and_the_swiglu_pass(n_slots, rank, width, rows,
                                                                  tokens):
    """`expand_swiglu` gives what the group's expand into gate and up, then silu(gate) * up
    in float32 rounded once, give: decode rows in any slot order, a prefill's tokens in slot
    order (tiles of `BM_TOKENS`), gate and up as column slices of one output."""
    gen = torch.Generator().manual_seed(rows)
    group = _gpu_groups(n_slots, rank, width, gen)[1]
    cache = DecodeCache([group], torch.bfloat16, SCALING)
    cache.refresh_(0)
    ids = torch.randint(0, n_slots, (rows,), generator=gen)
    routing = Routing.empty(rows, n_slots, torch.device("cuda"))
    if tokens > 1:
        ids = ids.sort().values
    routing.fill_(ids.cuda(), tokens > 1)
    perm, ends = ((routing.perm, routing.ends) if tokens == 1 else
                  (torch.arange(rows * tokens, device="cuda"), routing.ends * tokens))
    bm = decode_kernel.BM if tokens == 1 else decode_kernel.BM_TOKENS
    x = torch.randn(rows, tokens, width, generator=gen).cuda().bfloat16()
    both = torch.randn(rows, tokens, 6 * width + 8, generator=gen).cuda().bfloat16()
    gate, up = both[..., : 3 * width], both[..., 3 * width : 6 * width]
    got = cache.swiglu("gate", "up", x, gate, up, perm, ends, bm)
    assert got is not None and decode_kernel.failure is None
    added = both.clone()
    for name, out in (("gate", added[..., : 3 * width]), ("up", added[..., 3 * width : 6 * width])):
        if tokens == 1:
            cache.add_delta(name, x, out, routing, False)
        else:
            flat = out.reshape(-1, out.shape[-1])
            assert cache._kernel_add(cache.members[name], x, flat, perm, ends, False, bm)
    g, u = added[..., : 3 * width].float(), added[..., 3 * width : 6 * width].float()
    want = (torch.nn.functional.silu(g) * u).bfloat16()
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-3)
    assert (got == want).float().mean() > 0.99
