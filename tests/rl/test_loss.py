import math

import pytest
import torch

from lorapop.rl.loss import group_token_counts, policy_loss, row_losses

MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
ADV = torch.tensor([1.0, -0.5, 2.0])


def logprobs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return (-torch.rand(MASK.shape, generator=g) * 3).requires_grad_()


def test_reinforce_gradient_with_token_mean():
    lp = logprobs()
    loss, rows = policy_loss(lp, ADV, MASK)
    loss.backward()
    n = MASK.sum()
    assert torch.allclose(lp.grad, -ADV[:, None] * MASK / n)
    assert loss.item() == pytest.approx(-(ADV[:, None] * MASK * lp).sum().item() / n.item())
    assert rows.sum().item() == pytest.approx(loss.item()) and not rows.requires_grad


def test_masked_tokens_get_no_gradient_and_do_not_count():
    lp = logprobs()
    garbage = lp.detach().clone()
    garbage[~MASK] = 50.0
    loss, _ = policy_loss(lp, ADV, MASK)
    loss.backward()
    assert torch.all(lp.grad[~MASK] == 0)
    assert policy_loss(garbage, ADV, MASK)[0].item() == pytest.approx(loss.item())


def test_per_token_advantages_weigh_each_token():
    lp = logprobs()
    adv = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    policy_loss(lp, adv, MASK)[0].backward()
    assert torch.allclose(lp.grad, -adv * MASK / MASK.sum())


class TwoSlotPolicy(torch.nn.Module):
    """A per-slot linear policy: each row only touches its own slot's weights, like LoRA."""

    def __init__(self, slots=2, vocab=11, dim=6):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(slots, vocab, dim, generator=gen(0)))

    def forward(self, x, tokens, slots):
        logits = torch.einsum("btd,bvd->btv", x, self.w[slots])
        return torch.log_softmax(logits, -1).gather(-1, tokens[..., None])[..., 0]


def gen(seed):
    return torch.Generator().manual_seed(seed)


def rows(n, slot, seed, keep=8, t=8):
    """n rows of length t whose first `keep` tokens (at least 1, varying) are the response."""
    g = gen(seed)
    x = torch.randn(n, t, 6, generator=g)
    tokens = torch.randint(0, 11, (n, t), generator=g)
    lengths = torch.randint(1, keep + 1, (n,), generator=g)
    mask = torch.arange(t)[None, :] < lengths[:, None]
    adv = torch.randn(n, generator=g)
    slots = torch.full((n,), slot)
    return x, tokens, mask, adv, slots


def cat(*batches):
    return [torch.cat(parts) for parts in zip(*batches, strict=True)]


def grads(policy, batch, groups=True):
    x, tokens, mask, adv, slots = batch
    policy.zero_grad()
    lp = policy(x, tokens, slots)
    loss, _ = policy_loss(lp, adv, mask, groups=slots if groups else None)
    loss.backward()
    return policy.w.grad.clone()


def test_each_adapter_gets_the_gradient_it_would_get_alone():
    policy = TwoSlotPolicy()
    a = rows(3, slot=0, seed=1)
    b = rows(7, slot=1, seed=2, keep=4)  # more rows, shorter: would dilute a batch-wide mean
    alone_a = grads(policy, a)
    alone_b = grads(policy, b)
    joint = grads(policy, cat(a, b))
    assert torch.allclose(joint[0], alone_a[0], atol=1e-6)
    assert torch.allclose(joint[1], alone_b[1], atol=1e-6)
    assert alone_a[0].abs().sum() > 0
    # a single batch-wide aggregation does not have this property
    shared = grads(policy, cat(a, b), groups=False)
    assert not torch.allclose(shared[0], alone_a[0], atol=1e-6)


def test_micro_batches_with_whole_batch_token_counts_match_the_whole_batch():
    policy = TwoSlotPolicy()
    batch = cat(rows(3, 0, 1), rows(4, 1, 2), rows(2, 0, 3))
    whole = grads(policy, batch)
    x, tokens, mask, adv, slots = batch
    counts = group_token_counts(mask, slots)
    policy.zero_grad()
    for part in (slice(0, 4), slice(4, 9)):
        lp = policy(x[part], tokens[part], slots[part])
        loss, _ = policy_loss(lp, adv[part], mask[part], groups=slots[part], token_counts=counts)
        loss.backward()
    assert torch.allclose(policy.w.grad, whole, atol=1e-6)


def test_row_losses_sum_to_per_group_means():
    token_loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [6.0, 8.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0]])
    groups = torch.tensor([0, 1, 0])
    per_row = row_losses(token_loss, mask, groups)
    # group 0: (1+2+3+6+8) / 5 tokens; group 1: 4 / 1
    assert per_row.tolist() == pytest.approx([6 / 5, 4.0, 14 / 5])
    assert group_token_counts(mask, groups).tolist() == [5.0, 1.0]
    assert group_token_counts(mask, groups, n_groups=4).tolist() == [5.0, 1.0, 0.0, 0.0]


def test_bad_input():
    lp = logprobs()
    with pytest.raises(ValueError, match="differ in shape"):
        policy_loss(lp, ADV, MASK[:, :2])
    with pytest.raises(ValueError, match="groups"):
        policy_loss(lp, ADV, MASK, groups=torch.tensor([0, 1]))
    for counts in (None, torch.ones(2)):  # ids on the host are read whether counts are given
        with pytest.raises(ValueError, match=">= 0"):
            policy_loss(lp, ADV, MASK, groups=torch.tensor([0, -1, 0]), token_counts=counts)
    with pytest.raises(ValueError, match=">= 0"):  # ... and when the counts are made
        group_token_counts(MASK, torch.tensor([0, -1, 0]))
    loss, _ = policy_loss(lp, ADV, torch.zeros_like(MASK))
    assert loss.item() == 0.0 and math.isfinite(loss.item())
