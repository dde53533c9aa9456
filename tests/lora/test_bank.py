"""AdapterBank: identity at init, slot operations, routing rules, kernels agree."""

from __future__ import annotations

import contextlib

import pytest
import torch
from lora_fixtures import VOCAB, randomize_b, tiny_model

from lorapop.lora import DEFAULT_TARGETS, AdapterBank
from lorapop.lora.routing import GROUPED_MM


def _logits(model, ids, **kw):
    with torch.no_grad():
        return model(ids, **kw).logits


def test_fresh_bank_is_identity_and_targets_all_projections(arch):
    model = tiny_model(arch)
    ids = torch.randint(0, VOCAB, (3, 6))
    base = _logits(model, ids)
    bank = AdapterBank(model, n_slots=3, rank=4, alpha=8)
    assert len(bank.targets) == 2 * len(DEFAULT_TARGETS)
    assert not any(p.requires_grad for p in model.parameters())
    assert all(p.requires_grad for p in bank.parameters_of_bank())
    with bank.route([2, 0, 1]):
        torch.testing.assert_close(_logits(model, ids), base, rtol=0, atol=0)
    # B is zero and A is PEFT's kaiming-uniform(a=sqrt(5)): U(-1/sqrt(in), 1/sqrt(in))
    t = bank.targets["model.layers.0.mlp.down_proj"]
    assert t.b.abs().max() == 0
    bound = 1 / t.module.in_features**0.5
    assert 0.5 * bound < t.a.abs().max() <= bound


def test_slot_ops_copy_reset_load_and_views():
    bank = AdapterBank(tiny_model(), n_slots=3, rank=4, alpha=8, seed=5)
    randomize_b(bank)
    s0 = bank.slot_state(0)
    bank.copy_slot(0, 2)
    for name, ab in bank.slot_state(2).items():
        assert torch.equal(ab["A"], s0[name]["A"]) and torch.equal(ab["B"], s0[name]["B"])
    bank.reset_slot(1, seed=11)
    first = bank.slot_state(1)
    bank.load_slot(1, s0)
    bank.reset_slot(1, seed=11)
    again = bank.slot_state(1)
    for name in first:
        assert torch.equal(first[name]["A"], again[name]["A"])
        assert again[name]["B"].abs().max() == 0
    # slot_state returns copies; parameters are views of the flat storage
    s0[next(iter(s0))]["A"].add_(1.0)
    assert not torch.equal(bank.slot_state(0)[next(iter(s0))]["A"], s0[next(iter(s0))]["A"])
    bank.weights[0].zero_()
    assert all(p[0].abs().max() == 0 for p in bank.parameters_of_bank())


def test_bad_input_gives_clear_errors():
    model = tiny_model()
    bank = AdapterBank(model, n_slots=2, rank=4)
    ids = torch.randint(0, VOCAB, (2, 5))
    with pytest.raises(RuntimeError, match="no routing"):
        model(ids)
    with pytest.raises(ValueError, match=r"slot ids must lie in \[0, 2\)"), bank.route([0, 2]):
        pass
    with pytest.raises(ValueError, match="3 slot ids"), bank.route([0, 1, 1]):
        model(ids)
    with torch.no_grad(), pytest.raises(ValueError, match="3 slot ids"), bank.route([1, 1, 1]):
        model(ids)  # rows in runs of one slot: the addmm path checks too
    state = bank.slot_state(0)
    name = next(iter(state))
    state[name]["A"] = state[name]["A"][:2]
    with pytest.raises(ValueError, match="expected shape"):
        bank.load_slot(1, state)
    with pytest.raises(IndexError):
        bank.copy_slot(0, 5)
    with pytest.raises(ValueError, match="already has an AdapterBank"):
        AdapterBank(model, n_slots=1)
    with pytest.raises(ValueError, match="no nn.Linear"):
        AdapterBank(tiny_model(), n_slots=1, target_modules=["nope"])


def test_route_restores_previous_routing_disabled_and_detach():
    model = tiny_model()
    ids = torch.randint(0, VOCAB, (2, 5))
    base = _logits(model, ids)
    bank = AdapterBank(model, n_slots=2, rank=4)
    randomize_b(bank)
    with bank.route([0, 1]):
        outer = _logits(model, ids)
        with bank.route([1, 1]):
            assert not torch.allclose(_logits(model, ids), outer)
        torch.testing.assert_close(_logits(model, ids), outer, rtol=0, atol=0)
        with bank.disabled():
            torch.testing.assert_close(_logits(model, ids), base, rtol=0, atol=0)
    bank.detach()
    torch.testing.assert_close(_logits(model, ids), base, rtol=0, atol=0)


@pytest.mark.parametrize("tokens", [1, 6])
def test_kernels_agree_on_unsorted_mixed_batch(tokens):
    model = tiny_model()
    bank = AdapterBank(model, n_slots=4, rank=4, alpha=8)
    randomize_b(bank)
    ids = torch.randint(0, VOCAB, (5, tokens))
    slots = [3, 0, 3, 1, 0]  # slot 2 unused, rows out of slot order
    kernels = ["gather", "dense"] + (["grouped"] if GROUPED_MM is not None else [])
    outs = {}
    for k in kernels:
        bank.kernel = bank.decode_kernel = k
        with bank.route(slots):
            outs[k] = _logits(model, ids)
    for k in kernels[1:]:
        torch.testing.assert_close(outs[k], outs["gather"], rtol=1e-5, atol=1e-5)
    # sorted rows take the grouped kernel's no-gather path: same per-row result
    order = sorted(range(5), key=lambda b: slots[b])
    with bank.route([slots[b] for b in order]):
        torch.testing.assert_close(_logits(model, ids[order]), outs["gather"][order])


def test_runs_of_one_slot_add_the_delta_in_the_expand_gemm(monkeypatch):
    """Rows routed in slot order take the addmm path (no delta tensor): logits and gradients
    equal the gather kernel's; several runs with grad take the batched kernels. (One run under
    grad takes the "one_slot" path: test_one_input_gradient_gives_the_same_gradients.)"""
    import lorapop.lora.bank as bank_mod

    model = tiny_model().train()
    bank = AdapterBank(model, n_slots=3, rank=4, alpha=8)
    randomize_b(bank)
    ids = torch.randint(0, VOCAB, (4, 6))
    taken = []
    real = bank_mod.add_delta_by_runs
    monkeypatch.setattr(bank_mod, "add_delta_by_runs",
                        lambda *a: taken.append(len(a[3])) or real(*a))

    def run(kernel, slots, grad):
        bank.kernel = kernel
        bank.zero_grad()
        with bank.route(slots), torch.set_grad_enabled(grad):
            out = model(ids).logits
            if grad:
                (out * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
        return out.detach(), bank.grads.clone()

    for slots, grad in (([1, 1, 1, 1], False), ([0, 0, 2, 2], False), ([0, 1, 1, 2], True)):
        taken.clear()
        want = run("gather", slots, grad)
        assert not taken
        got = run("auto", slots, grad)
        assert set(taken) == (set() if grad else {len(set(slots))})
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
        peak = float(want[1].abs().max())  # fp32 rounding: the scaling moves between GEMMs
        assert (peak > 0) == grad
        torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5 * peak)
    # an unsorted batch has no runs: the batched kernels as before
    taken.clear()
    run("auto", [2, 0, 2, 1], False)
    assert not taken


@pytest.mark.parametrize("checkpointing", [False, True])
def test_one_input_gradient_gives_the_same_gradients(checkpointing, monkeypatch):
    """The "one_slot" path: a one-slot batch's projections form their input's gradient as one
    tensor (base and LoRA in one accumulate). The logits, every slot's gradients and the
    input's gradient are those of the batched reference kernel ("gather"), also under
    checkpointing; batches of several slots take the batched kernels."""
    import lorapop.lora.bank as bank_mod

    model = tiny_model().train()
    bank = AdapterBank(model, n_slots=3, rank=4, alpha=8)
    randomize_b(bank)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    calls = []
    real = bank_mod.add_delta_frozen_linear
    monkeypatch.setattr(bank_mod, "add_delta_frozen_linear",
                        lambda *a: calls.append(1) or real(*a))
    embeds = torch.randn(4, 6, model.config.hidden_size, generator=torch.Generator().manual_seed(1))

    def step(fused: bool, slots: list[int]) -> tuple[torch.Tensor, ...]:
        bank.kernel = "auto" if fused else "gather"
        bank.zero_grad()
        x = embeds.clone().requires_grad_()
        with bank.route(slots):
            out = model(inputs_embeds=x).logits
        (out * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
        return out.detach(), bank.grads.clone(), x.grad

    per_forward = 7 * model.config.num_hidden_layers * (2 if checkpointing else 1)
    for slots, fused_calls in (([2, 2, 2, 2], per_forward), ([0, 1, 1, 2], 0)):
        want = step(False, slots)
        assert not calls
        got = step(True, slots)
        assert len(calls) == fused_calls
        calls.clear()
        for g, w in zip(got, want, strict=True):
            peak = float(w.abs().max())
            assert peak > 0
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5 * peak)


def test_set_slot_ids_reuses_buffers_in_place():
    """A CUDA graph captured once must see later routings of the same batch size."""
    bank = AdapterBank(tiny_model(), n_slots=3, rank=4)
    bank.set_slot_ids_(torch.tensor([0, 2, 1, 2]))
    first = bank._active
    ptrs = [first.ids.data_ptr(), first.perm.data_ptr(), first.ends.data_ptr()]
    bank.set_slot_ids_(torch.tensor([1, 1, 0, 2]))
    assert bank._active is first
    assert [first.ids.data_ptr(), first.perm.data_ptr(), first.ends.data_ptr()] == ptrs
    assert first.ids.tolist() == [1, 1, 0, 2]
    assert first.ids[first.perm].tolist() == [0, 1, 1, 2]
    assert first.ends.tolist() == [1, 3, 4]
    assert first.perm[first.inv].tolist() == [0, 1, 2, 3]


def test_dropout_on_lora_input_only_in_training_mode():
    model = tiny_model()
    bank = AdapterBank(model, n_slots=2, rank=4, dropout=0.5)
    randomize_b(bank)
    ids = torch.randint(0, VOCAB, (2, 5))
    with bank.route([0, 1]):
        a, b = _logits(model, ids), _logits(model, ids)
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        model.train()
        torch.manual_seed(0)
        c = _logits(model, ids)
        torch.manual_seed(0)
        torch.testing.assert_close(_logits(model, ids), c, rtol=0, atol=0)
        assert not torch.allclose(a, c)
        with bank.disabled():  # base path has no dropout
            torch.testing.assert_close(_logits(model, ids), _logits(model, ids))


def test_kernels_give_the_same_gradients_on_unsorted_rows():
    model = tiny_model().train()
    bank = AdapterBank(model, n_slots=3, rank=4, alpha=8)
    randomize_b(bank)
    ids = torch.randint(0, VOCAB, (4, 6))
    grads = {}
    kernels = ["gather", "dense"] + (["grouped"] if GROUPED_MM is not None else [])
    for k in kernels:
        bank.kernel = k
        bank.zero_grad()
        with bank.route([2, 0, 2, 1]):
            model(ids, labels=ids).loss.backward()
        grads[k] = bank.grads.clone()
    assert grads["gather"].abs().sum() > 0
    for k in kernels[1:]:
        torch.testing.assert_close(grads[k], grads["gather"], rtol=1e-5, atol=1e-7)


@pytest.mark.skipif(GROUPED_MM is None, reason="no grouped_mm in this torch build")
def test_grouped_probe_is_independent_of_grad_mode():
    with torch.no_grad():
        bank = AdapterBank(tiny_model(), n_slots=2, rank=4)
    assert bank._grouped_ok[torch.float32]


def test_fused_decode_cache_matches_dense_and_follows_weight_changes():
    """One-token no-grad forwards read a cached copy; every kind of weight write reaches it."""
    model = tiny_model()
    bank = AdapterBank(model, n_slots=4, rank=4, alpha=8)
    randomize_b(bank)
    ids = torch.randint(0, VOCAB, (5, 1))
    slots = [3, 0, 3, 1, 0]

    def both() -> tuple[torch.Tensor, torch.Tensor]:
        out = []
        for k in ("auto", "dense"):
            bank.decode_kernel = k
            with bank.route(slots):
                out.append(_logits(model, ids))
        return out[0], out[1]

    fused, dense = both()
    assert len(bank._caches) == 1  # "auto" decoded through the cache
    torch.testing.assert_close(fused, dense, rtol=1e-5, atol=1e-5)
    before = fused
    state = bank.state_dict()
    changes = [
        lambda: bank.copy_slot(1, 3),
        lambda: bank.load_slot(0, bank.slot_state(2)),
        lambda: bank.reset_slot(1, seed=3),
        lambda: bank.load_state_dict(state),
        lambda: bank.targets["model.layers.1.mlp.down_proj"].b.data.mul_(3),  # untracked
    ]
    for change in changes:
        change()
        if change is changes[-1]:
            bank.invalidate_caches()
        fused, dense = both()
        torch.testing.assert_close(fused, dense, rtol=1e-5, atol=1e-5)
        assert not torch.equal(fused, before)
        before = fused
    with torch.no_grad():  # an optimizer-style in-place update of the flat storage
        bank.weights.mul_(0.5)
    fused, dense = both()
    torch.testing.assert_close(fused, dense, rtol=1e-5, atol=1e-5)
    # q/k/v and gate/up share one A GEMM: 4 input groups per layer
    assert len({id(m.group) for m in bank._caches[torch.float32].members.values()}) == 8


def test_fused_decode_in_bf16_from_an_fp32_bank():
    model = tiny_model().to(torch.bfloat16)
    bank = AdapterBank(model, n_slots=3, rank=4, alpha=8)  # fp32 master weights
    randomize_b(bank)
    ids = torch.randint(0, VOCAB, (4, 1))
    out = {}
    for k in ("fused", "dense"):
        bank.decode_kernel = k
        with bank.route([2, 0, 1, 2]):
            out[k] = _logits(model, ids).float()
    assert list(bank._caches) == [torch.bfloat16]
    torch.testing.assert_close(out["fused"], out["dense"], rtol=0.05, atol=0.02)
    one = AdapterBank(tiny_model(), n_slots=1, rank=4)  # one slot: the mask is a broadcast
    with torch.no_grad():
        one.weights.normal_()
    out = []
    for batch in ([0, 0, 0, 0], [0, 0, 0, 0]):  # the second route refills the cached mask
        with one.route(batch):
            out.append(_logits(one.model, ids))
    torch.testing.assert_close(out[0], out[1], rtol=0, atol=0)
    with pytest.raises(ValueError, match="unknown decode kernel"):
        AdapterBank(tiny_model(), n_slots=1, decode_kernel="fast")


def test_held_copy_gives_the_cast_results_and_follows_weight_changes():
    """A bf16 model on an fp32 bank: inside `held_copy` the forwards and the gradients of the
    master weights are exactly those of casting per forward, for rows of several slots (the
    batched kernels) and of one (the slot's gradient added straight into its row); a weight
    change is picked up."""
    model = tiny_model().to(torch.bfloat16).train()
    bank = AdapterBank(model, n_slots=3, rank=4, alpha=8)  # fp32 master weights
    randomize_b(bank)
    ids = torch.randint(0, VOCAB, (4, 6), generator=torch.Generator().manual_seed(0))

    for slots in ([0, 0, 1, 2], [1, 1, 1, 1]):
        def step(slots=slots) -> tuple[torch.Tensor, torch.Tensor]:
            bank.zero_grad()
            with bank.route(slots):
                out = model(ids).logits
            (out.float() * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
            return out.detach(), bank.grads.clone()

        cast = step()
        with bank.held_copy(torch.bfloat16):
            assert bank._held is not None and bank._held.flat.dtype == torch.bfloat16
            held = step()
            with torch.no_grad():
                bank.weights.mul_(1.5)  # e.g. an optimizer step
            held_after = step()
        assert bank._held is None  # freed on exit
        for a, b in zip(cast, held, strict=True):
            assert torch.equal(a, b)
        assert held[1][sorted(set(slots))].abs().sum(-1).min() > 0
        assert held[1][[s for s in range(3) if s not in slots]].abs().sum() == 0
        after = step()
        for a, b in zip(after, held_after, strict=True):
            assert torch.equal(a, b)
        assert not torch.equal(after[0], cast[0])
    with bank.held_copy(torch.float32):  # the bank's own dtype: nothing to hold
        assert bank._held is None


@pytest.mark.parametrize("grad", [True, False])
def test_one_slot_forwards_add_the_lora_term_without_copying_the_output(grad):
    """A one-slot batch's projections add their LoRA term into the frozen linear's output in
    place (under grad: the "one_slot" path): an out-of-place addmm first copies that output
    whole, a full-width tensor per projection (13 ms of a 7B student micro-batch)."""
    model = tiny_model().train()
    bank = AdapterBank(model, n_slots=3, rank=4, alpha=8)
    randomize_b(bank)
    ids = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(0))
    with bank.route([1, 1]), torch.set_grad_enabled(grad):
        bank.kernel = "gather"
        want = model(ids).logits
        bank.kernel = "auto"
        with torch.profiler.profile(record_shapes=True) as prof:
            got = model(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the LoRA's expands (their first factor is [tokens, rank]): in place, none out of place
    expands = [e.name for e in prof.events() if e.name in ("aten::addmm", "aten::addmm_")
               and e.input_shapes[1] == [ids.numel(), bank.rank]]
    assert expands and set(expands) == {"aten::addmm_"}


def test_prefills_take_the_decode_caches_weights_without_casting():
    """Forwards of several tokens a row without grad inside `prefill_weights` (a decoder's
    prefills) take the decode cache's compute-dtype A and scaled B, made fresh there: no cast
    of a slot's factors per projection and run (1,570 of a 7B prefill's 4,427 kernels), the
    weights the decode steps use, logits as the batched reference's. Outside the block, and
    with a batched decode kernel asked for, the bank's own weights are cast as before."""
    model = tiny_model().to(torch.bfloat16).eval()
    bank = AdapterBank(model, n_slots=3, rank=4, alpha=8)
    randomize_b(bank)
    ids = torch.randint(0, VOCAB, (3, 6), generator=torch.Generator().manual_seed(0))

    def forward(kernel: str, prefill: bool = True) -> tuple[torch.Tensor, int]:
        """The logits, and the casts of a [r, in] or [out, r] factor."""
        bank.kernel = kernel
        weights = bank.prefill_weights(torch.bfloat16) if prefill else contextlib.nullcontext()
        with (bank.route([0, 2, 2]), torch.no_grad(), weights,
              torch.profiler.profile(record_shapes=True) as prof):
            out = model(ids).logits.float()
        return out, sum(e.name == "aten::_to_copy" and len(e.input_shapes[0]) == 2
                        and bank.rank in e.input_shapes[0]
                        for e in prof.events() if e.input_shapes)

    _, casts = forward("auto", prefill=False)
    assert casts >= 2 * len(bank.targets)  # a cast of each factor per projection and run
    for _ in range(2):  # the second time with the cache made the first time gone stale
        want, _ = forward("gather")
        got, casts = forward("auto")
        assert casts == 0
        torch.testing.assert_close(got, want, rtol=0.02, atol=0.02 * float(want.abs().max()))
        with torch.no_grad():
            bank.weights.mul_(1.5)
    bank.decode_kernel = "gather"
    assert forward("auto")[1] >= 2 * len(bank.targets)


def test_the_hook_names_the_path_each_forward_takes(monkeypatch):
    """`AdapterBank._path`, the one dispatch: one token a row without grad takes the decode
    cache, with grad the dense kernel; one slot under grad the frozen-linear path; runs of one
    slot the addmm path (under grad only as one run); anything else, or a kernel asked for by
    name, the batched kernels."""
    model = tiny_model().train()
    bank = AdapterBank(model, n_slots=3, rank=4, alpha=8)
    seen: list[str] = []
    real = bank._path
    monkeypatch.setattr(bank, "_path", lambda *a: seen.append(real(*a)) or seen[-1])
    ids = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(0))

    def paths(slots, grad, tokens=5, kernel="auto"):
        seen.clear()
        bank.kernel = bank.decode_kernel = kernel
        with bank.route(slots), torch.set_grad_enabled(grad):
            model(ids[:, :tokens])
        return set(seen)

    batched = {"grouped", "gather"}
    assert paths([1, 1], True) == {"one_slot"}
    assert paths([0, 1], True) <= batched and len(paths([0, 1], True)) == 1
    assert paths([0, 1], False) == paths([1, 1], False) == {"runs"}
    assert paths([1, 0], False) == {"gather"}  # not in slot order: no runs, no grouped kernel
    assert paths([1, 0], True, tokens=1) == {"dense"}
    assert paths([1, 0], False, tokens=1) == {"decode_cache"}
    assert paths([1, 1], True, kernel="gather") == {"gather"}
    assert paths([1, 0], False, tokens=1, kernel="dense") == {"dense"}


def test_a_swapped_slot_runs_other_weights_and_gets_its_own_back_bit_for_bit():
    model = tiny_model()
    bank = AdapterBank(model, n_slots=3, rank=4, alpha=8, seed=5)
    randomize_b(bank, seed=1)
    ids = torch.randint(0, VOCAB, (1, 6))
    own, other = bank.weights[1].detach().clone(), bank.weights[2].detach().clone()
    with torch.no_grad(), bank.route([2]):
        want = model(ids).logits
    with bank.swapped(1, other), torch.no_grad(), bank.route([1]):
        assert torch.equal(model(ids).logits, want)
    assert torch.equal(bank.weights[1], own)
