"""Joint training of a bank equals training each adapter alone (PEFT + torch AdamW as oracle)."""

from __future__ import annotations

import pytest
import torch
from peft import PeftModel

from lorapop.engine.optim import BankOptimizer
from lorapop.lora import AdapterBank
from lorapop.lora.peft_io import export_slot
from tiny_models import ARCHS, VOCAB, tiny_model


def make_bank(arch: str = "qwen2", n: int = 3) -> AdapterBank:
    bank = AdapterBank(tiny_model(arch).train(), n_slots=n, rank=4, alpha=8, seed=7)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for t in bank.targets.values():
            t.b.copy_(torch.randn(t.b.shape, generator=gen) * 0.1)
    return bank


def row_losses(model, ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of each row: [batch]."""
    logits = model(ids).logits[:, :-1]
    ce = torch.nn.functional.cross_entropy(
        logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1), reduction="none"
    )
    return ce.view(ids.shape[0], -1).mean(1)


def joint_loss(model, bank: AdapterBank, ids: torch.Tensor, slots: list[int]) -> torch.Tensor:
    """Sum over slots of each slot's mean loss: every adapter gets its own-loss gradient."""
    with bank.route(slots):
        losses = row_losses(model, ids)
    total = losses.new_zeros(())
    for s in sorted(set(slots)):
        total = total + losses[[b for b, x in enumerate(slots) if x == s]].mean()
    return total


SLOTS = [0, 1, 2, 0, 2, 1]
LRS = [1e-2, 3e-3, 2e-2]
CLIP = [0.05, None, 1e3]


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_joint_training_equals_each_adapter_alone(arch, tmp_path):
    bank = make_bank(arch)
    model = bank.model
    starts = [export_slot(bank, s, tmp_path / f"s{s}") for s in range(3)]
    opt = BankOptimizer(bank, lr=LRS, betas=(0.9, 0.99), weight_decay=0.1, max_grad_norm=CLIP)
    gen = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, VOCAB, (6, 8), generator=gen) for _ in range(3)]
    norms = []
    for ids in batches:
        opt.zero_grad()
        joint_loss(model, bank, ids, SLOTS).backward()
        norms.append(opt.step())
    assert all(n[0] > CLIP[0] for n in norms)  # slot 0's clipping binds at every step
    assert all(n[2] < CLIP[2] for n in norms)

    for s in range(3):
        peft = PeftModel.from_pretrained(tiny_model(arch).train(), starts[s], is_trainable=True).train()
        params = [p for p in peft.parameters() if p.requires_grad]
        ref_opt = torch.optim.AdamW(params, lr=LRS[s], betas=(0.9, 0.99), weight_decay=0.1)
        rows = [b for b, x in enumerate(SLOTS) if x == s]
        for ids in batches:
            ref_opt.zero_grad()
            row_losses(peft, ids[rows]).mean().backward()
            if CLIP[s] is not None:
                torch.nn.utils.clip_grad_norm_(params, CLIP[s])
            ref_opt.step()
        mine = bank.slot_state(s)
        for name, ab in mine.items():
            mod = peft.base_model.model.get_submodule(name)
            torch.testing.assert_close(ab["A"], mod.lora_A["default"].weight, rtol=1e-4, atol=2e-6)
            torch.testing.assert_close(ab["B"], mod.lora_B["default"].weight, rtol=1e-4, atol=2e-6)


def test_gradient_checkpointing_gives_the_same_gradients_after_rerouting():
    bank = make_bank()
    model = bank.model
    ids = torch.randint(0, VOCAB, (6, 8), generator=torch.Generator().manual_seed(0))
    bank.zero_grad()
    joint_loss(model, bank, ids, SLOTS).backward()
    plain = bank.grads.clone()

    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    bank.zero_grad()
    loss = joint_loss(model, bank, ids, SLOTS)
    with torch.no_grad(), bank.route([2, 2, 2, 1, 1, 1]):  # e.g. a reference pass in between
        model(ids)
    loss.backward()  # recomputation runs outside route(), after another routing
    assert plain.abs().sum() > 0
    torch.testing.assert_close(bank.grads, plain, rtol=1e-5, atol=1e-7)


def test_absent_slot_is_not_stepped_and_replaced_grads_are_picked_up():
    bank = make_bank()
    opt = BankOptimizer(bank, lr=1e-2, weight_decay=0.1)
    ids = torch.randint(0, VOCAB, (4, 8))
    before = bank.weights.clone()
    for p in bank.parameters_of_bank():
        p.grad = None  # as a foreign zero_grad(set_to_none=True) would do
    joint_loss(bank.model, bank, ids, [0, 1, 1, 0]).backward()
    opt.step()
    assert torch.equal(bank.weights[2], before[2])
    assert (bank.weights[:2] != before[:2]).any(dim=1).all()
    assert opt.steps.tolist() == [1.0, 1.0, 0.0]


def test_optimizer_slot_reset_copy_and_checkpoint_resume():
    bank = make_bank()
    opt = BankOptimizer(bank, lr=[1e-2, 2e-2, 5e-3], max_grad_norm=0.5)
    gen = torch.Generator().manual_seed(5)
    batches = [torch.randint(0, VOCAB, (6, 8), generator=gen) for _ in range(3)]
    for ids in batches[:2]:
        opt.zero_grad()
        joint_loss(bank.model, bank, ids, SLOTS).backward()
        opt.step()
    saved_bank, saved_opt = bank.state_dict(), opt.state_dict()

    opt.zero_grad()
    joint_loss(bank.model, bank, batches[2], SLOTS).backward()
    opt.step()
    after = bank.weights.clone()

    bank2 = make_bank()
    opt2 = BankOptimizer(bank2)
    bank2.load_state_dict(saved_bank)
    opt2.load_state_dict(saved_opt)
    opt2.zero_grad()
    joint_loss(bank2.model, bank2, batches[2], SLOTS).backward()
    opt2.step()
    torch.testing.assert_close(bank2.weights, after, rtol=0, atol=0)

    opt.copy_slot(0, 2)
    assert torch.equal(opt.exp_avg[2], opt.exp_avg[0]) and opt.steps[2] == opt.steps[0]
    opt.reset_slot(1)
    assert opt.exp_avg[1].abs().max() == 0 and opt.exp_avg_sq[1].abs().max() == 0
    assert opt.steps[1] == 0
    # after a reset the slot's next step is a first AdamW step again (bias correction restarts)
    bank.copy_slot(1, 0)
    fresh = BankOptimizer(bank, lr=[2e-2, 2e-2, 2e-2], max_grad_norm=0.5)
    start = bank.weights[1].clone()
    opt.zero_grad()
    joint_loss(bank.model, bank, batches[0], [1] * 6).backward()
    opt.step()
    mine = bank.weights[1].clone()
    bank.weights[1].copy_(start)
    fresh.step(slots=[1])  # same gradients, still in bank.grads
    torch.testing.assert_close(bank.weights[1], mine, rtol=0, atol=0)


def test_bad_hyper_parameters_are_rejected():
    bank = make_bank()
    with pytest.raises(ValueError, match="2 values for 3 slots"):
        BankOptimizer(bank, lr=[1e-3, 1e-3])
    with pytest.raises(ValueError, match="invalid AdamW"):
        BankOptimizer(bank, lr=-1.0)


def test_non_finite_gradient_skips_only_its_slot():
    bank = make_bank()
    opt = BankOptimizer(bank, lr=1e-2)
    before = bank.weights.detach().clone()
    bank.grads.fill_(0.1)
    bank.grads[1, 0] = float("inf")
    bank.grads[2, 3] = float("nan")
    norms = opt.step()
    assert torch.equal(bank.weights[1], before[1]) and torch.equal(bank.weights[2], before[2])
    assert not torch.equal(bank.weights[0], before[0])
    assert torch.isfinite(bank.weights).all()
    assert norms[0] > 0
