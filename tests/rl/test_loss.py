import math

import pytest
import torch

from lorapop.rl.loss import group_normalizers, policy_loss, row_losses

MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
ADV = torch.tensor([1.0, -0.5, 2.0])


def logprobs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return (-torch.rand(MASK.shape, generator=g) * 3).requires_grad_()


def test_first_step_is_reinforce_with_token_mean():
    lp = logprobs()
    loss, stats = policy_loss(lp, lp.detach(), ADV, MASK)
    loss.backward()
    n = MASK.sum()
    expected = -ADV[:, None] * MASK / n
    assert torch.allclose(lp.grad, expected)
    assert stats["ratio_mean"] == pytest.approx(1.0)
    assert stats["clip_frac"] == 0.0 and stats["approx_kl"] == pytest.approx(0.0)
    assert loss.item() == pytest.approx(-(ADV[:, None] * MASK).sum().item() / n.item())


def test_seq_mean_token_mean_weighs_sequences_equally():
    lp = logprobs()
    loss, _ = policy_loss(lp, lp.detach(), ADV, MASK, agg="seq-mean-token-mean")
    loss.backward()
    lengths = MASK.sum(1, keepdim=True)
    assert torch.allclose(lp.grad, -ADV[:, None] * MASK / lengths / 3)


def test_clipping_cases():
    old = torch.zeros(1, 5)
    ratios = torch.tensor([[1.5, 0.5, 1.5, 0.5, 1.25]])
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0, 1.0]])
    lp = torch.log(ratios).requires_grad_()
    mask = torch.ones(1, 5)
    loss, stats = policy_loss(lp, old, adv, mask, clip_eps=0.2, clip_eps_high=0.28)
    loss.backward()
    # A>0, r=1.5: clipped at 1.28, no gradient. A>0, r=0.5: unclipped (pessimistic min).
    # A<0, r=1.5: unclipped. A<0, r=0.5: clipped at 0.8, no gradient. r=1.25 < 1.28: free.
    per_token = torch.tensor([-1.28, -0.5, 1.5, 0.8, -1.25])
    assert loss.item() == pytest.approx(per_token.mean().item())
    grad = -(adv * ratios) / 5
    grad[0, 0] = grad[0, 3] = 0.0
    assert torch.allclose(lp.grad, grad)
    assert stats["clip_frac"] == pytest.approx(2 / 5)


def test_masked_tokens_get_no_gradient_and_do_not_count():
    lp = logprobs()
    old = lp.detach().clone()
    old[~MASK] = 50.0  # garbage on padding
    loss, stats = policy_loss(lp, old, ADV, MASK)
    loss.backward()
    assert torch.all(lp.grad[~MASK] == 0)
    assert stats["ratio_mean"] == pytest.approx(1.0)


def test_entropy_stat_is_a_masked_mean():
    lp = logprobs()
    ent = torch.full(MASK.shape, 7.0)
    ent[MASK] = 2.0
    _, stats = policy_loss(lp, lp.detach(), ADV, MASK, entropy=ent)
    assert stats["entropy"] == pytest.approx(2.0)


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
    old = torch.randn(n, t, generator=g) * 0.1  # off-policy, so clipping is exercised
    slots = torch.full((n,), slot)
    return x, tokens, mask, adv, old, slots


def cat(*batches):
    return [torch.cat(parts) for parts in zip(*batches, strict=True)]


def grads(policy, batch, groups=True, agg="token-mean"):
    x, tokens, mask, adv, old, slots = batch
    policy.zero_grad()
    lp = policy(x, tokens, slots)
    old = lp.detach() + old
    loss, _ = policy_loss(lp, old, adv, mask, groups=slots if groups else None, agg=agg)
    loss.backward()
    return policy.w.grad.clone()


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_each_adapter_gets_the_gradient_it_would_get_alone(agg):
    policy = TwoSlotPolicy()
    a = rows(3, slot=0, seed=1)
    b = rows(7, slot=1, seed=2, keep=4)  # more rows, shorter: would dilute a batch-wide mean
    alone_a = grads(policy, a, agg=agg)
    alone_b = grads(policy, b, agg=agg)
    joint = grads(policy, cat(a, b), agg=agg)
    assert torch.allclose(joint[0], alone_a[0], atol=1e-6)
    assert torch.allclose(joint[1], alone_b[1], atol=1e-6)
    assert alone_a[0].abs().sum() > 0
    # a single batch-wide aggregation does not have this property
    shared = grads(policy, cat(a, b), groups=False, agg=agg)
    assert not torch.allclose(shared[0], alone_a[0], atol=1e-6)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_micro_batches_with_whole_batch_normalizers_match_the_whole_batch(agg):
    policy = TwoSlotPolicy()
    batch = cat(rows(3, 0, 1), rows(4, 1, 2), rows(2, 0, 3))
    whole = grads(policy, batch, agg=agg)
    x, tokens, mask, adv, old, slots = batch
    norms = group_normalizers(mask, slots, agg)
    policy.zero_grad()
    for part in (slice(0, 4), slice(4, 9)):
        lp = policy(x[part], tokens[part], slots[part])
        loss, _ = policy_loss(
            lp,
            lp.detach() + old[part],
            adv[part],
            mask[part],
            groups=slots[part],
            agg=agg,
            normalizers=norms,
        )
        loss.backward()
    assert torch.allclose(policy.w.grad, whole, atol=1e-6)


def test_row_losses_sum_to_per_group_means():
    token_loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [6.0, 8.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0]])
    groups = torch.tensor([0, 1, 0])
    per_row = row_losses(token_loss, mask, groups)
    # group 0: (1+2+3+6+8) / 5 tokens; group 1: 4 / 1
    assert per_row.tolist() == pytest.approx([6 / 5, 4.0, 14 / 5])
    seq = row_losses(token_loss, mask, groups, agg="seq-mean-token-mean")
    assert seq.tolist() == pytest.approx([2.0 / 2, 4.0, 7.0 / 2])
    assert group_normalizers(mask, groups).tolist() == [5.0, 1.0]


def test_bad_input():
    lp = logprobs()
    with pytest.raises(ValueError, match="same shape"):
        policy_loss(lp, lp.detach()[:, :2], ADV, MASK)
    with pytest.raises(ValueError, match="aggregation"):
        policy_loss(lp, lp.detach(), ADV, MASK, agg="sum")
    with pytest.raises(ValueError, match="groups"):
        policy_loss(lp, lp.detach(), ADV, MASK, groups=torch.tensor([0, 1]))
    loss, _ = policy_loss(lp, lp.detach(), ADV, torch.zeros_like(MASK))
    assert loss.item() == 0.0 and math.isfinite(loss.item())
