"""The update's log-prob pass: length-grouped micro-batches, a chunked LM head with the same
values and gradients."""

from __future__ import annotations

import shutil

import pytest
import torch

import lorapop.engine.logprobs as logprobs_mod
from lorapop.engine.fused import compile_failures, fast_pass
from lorapop.engine.load import use_checkpointing
from lorapop.engine.logprobs import sequence_logprobs, shared_prompt_packs
from lorapop.lora.bank import AdapterBank
from lorapop.rl.loss import group_token_counts, policy_loss
from tiny_models import tiny_model


def test_chunked_head_gives_the_same_logprobs_and_gradients():
    model = tiny_model()
    bank = AdapterBank(model, n_slots=2, rank=4, alpha=8.0)
    with torch.no_grad():
        bank.weights.normal_(0.0, 0.3, generator=torch.Generator().manual_seed(2))
    prompts, completions = [[5, 6, 7], [8], [9, 10]], [[11, 12], [13, 14, 15, 16], [17]]
    results = []
    for chunk in (1, 4096):
        bank.zero_grad()
        lp, mask = sequence_logprobs(model, bank, prompts, completions, [1, 0, 1], chunk)
        lp[mask].sum().backward()
        results.append((lp.detach(), bank.grads.clone()))
    torch.testing.assert_close(results[0][0], results[1][0])
    torch.testing.assert_close(results[0][1], results[1][1])
    assert results[0][1].abs().sum() > 0
    bank.zero_grad()


@pytest.mark.parametrize("shape", [(2, 5), (1, 1)])
def test_head_logprobs_recompute_the_logits_and_give_autograds_gradients(shape):
    """The head's own backward (logits recomputed, never kept) against autograd through the
    plain formula: values and gradients of the hidden states, weight and bias."""
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50)
    hidden = torch.randn(*shape, 16, requires_grad=True)
    target, g = torch.randint(0, 50, shape), torch.randn(*shape)
    grads = []
    for ours in (False, True):
        if ours:
            out = logprobs_mod.head_logprobs(head, hidden, target)
        else:
            logits = head(hidden).float()
            out = logits.gather(-1, target[..., None]).squeeze(-1) - logits.logsumexp(-1)
        (out * g).sum().backward()
        grads.append([out.detach(), *(x.grad.clone() for x in (hidden, head.weight, head.bias))])
        hidden.grad = head.weight.grad = head.bias.grad = None
    for plain, mine in zip(*grads, strict=True):
        torch.testing.assert_close(mine, plain)


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                    reason="torch.compile on CPU needs a C compiler")
def test_compiled_head_passes_equal_the_eager_ones_on_cpu(monkeypatch):
    """The compiled forward and gradient passes (`fast_pass`'s CUDA path, here compiled for
    the CPU) give the eager values and gradients, at several positions and at one."""
    from lorapop.engine.fused import compiled_call

    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50)
    for shape in [(2, 5), (1, 1)]:
        hidden = torch.randn(*shape, 16, requires_grad=True)
        target, g = torch.randint(0, 50, shape), torch.randn(*shape)
        runs = []
        for compiled in (False, True):
            monkeypatch.setattr(logprobs_mod, "fast_pass", compiled_call if compiled else
                                (lambda fn, *args: fn(*args)))
            out = logprobs_mod._HeadLogprobs.apply(hidden, head.weight, head.bias, target)
            (out * g).sum().backward()
            runs.append([out.detach(), *(x.grad.clone() for x in (hidden, head.weight, head.bias))])
            hidden.grad = head.weight.grad = head.bias.grad = None
        assert not compile_failures  # compiled, not fallen back to eager
        for eager, compiled in zip(*runs, strict=True):
            torch.testing.assert_close(compiled, eager)


def test_the_head_counts_as_compiled_on_cuda_only_and_until_its_compiler_fails(monkeypatch):
    from lorapop.engine.logprobs import head_compiled

    model = tiny_model()
    assert not head_compiled(model)  # CPU: eager passes
    param = next(model.parameters())
    monkeypatch.setattr(type(param), "is_cuda", property(lambda self: True))
    assert head_compiled(model)
    monkeypatch.setattr(logprobs_mod, "compile_failures", {"_logits_grad"})
    assert not head_compiled(model)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled head runs on CUDA only")
def test_the_compiled_head_needs_no_more_memory_than_the_plan_reserves():
    """`memory.update_fixed_bytes(..., compiled_head=True)` against the compiled passes' peak,
    forward and backward, at a vocabulary and chunk large enough to dwarf the rest."""
    from lorapop.engine.logprobs import head_logprobs
    from lorapop.engine.memory import update_fixed_bytes

    model = tiny_model(vocab=32_000).cuda().to(torch.bfloat16)
    head = model.get_output_embeddings()
    rows = 2048
    hidden = torch.randn(1, rows, head.in_features, device="cuda", dtype=torch.bfloat16,
                         requires_grad=True)
    target = torch.randint(0, head.out_features, (1, rows), device="cuda")
    head_logprobs(head, hidden, target).sum().backward()  # compiles
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    head_logprobs(head, hidden, target).sum().backward()
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - base <= 1.1 * update_fixed_bytes(model, rows, True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled head runs on CUDA only")
def test_compiled_head_gives_the_eager_logprobs_and_gradients(monkeypatch):
    """The LM head's compiled log-softmax: same values and bank gradients as eager, at
    changing shapes (no recompilation per shape), with and without grad."""
    model = tiny_model().cuda()
    bank = AdapterBank(model, n_slots=2, rank=4, alpha=8.0)
    with torch.no_grad():
        bank.weights.normal_(0.0, 0.3, generator=torch.Generator("cuda").manual_seed(2))
    cases = [([[5, 6, 7], [8], [9, 10]], [[11, 12], [13, 14, 15, 16], [17]], [1, 0, 1]),
             ([[5, 6]], [[7, 8, 9, 10, 11, 12, 13]], [0])]
    for prompts, completions, slots in cases:
        results = []
        for compiled in (False, True):  # the eager reference, then `fast_pass`'s CUDA path
            monkeypatch.setattr(logprobs_mod, "fast_pass", fast_pass if compiled else
                                (lambda fn, *args: fn(*args)))
            bank.zero_grad()
            lp, mask = sequence_logprobs(model, bank, prompts, completions, slots, 2)
            lp[mask].sum().backward()
            with torch.no_grad():
                lp_eval, _ = sequence_logprobs(model, bank, prompts, completions, slots)
            results.append((lp.detach(), bank.grads.clone(), lp_eval))
        assert not compile_failures  # did not fall back to eager
        for eager, compiled in zip(*results, strict=True):
            torch.testing.assert_close(compiled, eager, atol=1e-4, rtol=1e-4)
    bank.zero_grad()


@pytest.mark.parametrize("checkpointing", [False, True])
def test_shared_prompts_give_the_unpacked_logprobs_and_gradients(checkpointing):
    """Rows of one prompt and slot packed into one sequence score and train exactly as alone;
    the same prompt under another slot, and lone rows, are not packed with them. Under
    activation checkpointing the recomputed forward attends as the first one did."""
    model = tiny_model()
    use_checkpointing(model, checkpointing)
    model.train()
    bank = AdapterBank(model, n_slots=3, rank=4, alpha=8.0)
    with torch.no_grad():
        bank.weights.normal_(0.0, 0.3, generator=torch.Generator().manual_seed(3))
    shared = [5, 6, 7, 8, 9]
    prompts = [shared, shared, [3, 4], shared, shared, shared, [9]]
    completions = [[11, 12, 13], [14], [15, 16], [17, 18, 19, 20, 21], [22, 23], [24], [25, 26]]
    slots = [0, 0, 0, 0, 1, 1, 2]
    assert shared_prompt_packs(prompts, slots) == [[0, 1, 3], [2], [4, 5], [6]]
    weights = torch.linspace(-1.0, 2.0, 7)[:, None]
    results = []
    for share in (False, True):
        bank.zero_grad()
        lp, mask = sequence_logprobs(model, bank, prompts, completions, slots, 3, share)
        (lp * weights)[mask].sum().backward()
        results.append((lp.detach(), mask, bank.grads.clone()))
    torch.testing.assert_close(results[0][0], results[1][0], atol=1e-5, rtol=1e-5)
    assert torch.equal(results[0][1], results[1][1])
    torch.testing.assert_close(results[0][2], results[1][2], atol=1e-5, rtol=1e-5)
    assert results[1][2].abs().sum() > 0
    bank.zero_grad()


def test_the_update_forward_builds_no_mask_and_other_forwards_still_do(monkeypatch):
    """Packed prompts attend through their layout and lone rows causally, so the model's mask
    step builds nothing for them (building one reads the padding mask back to the host, a wait
    for the GPU), with the same log-probs either way; other forwards of the model, after the
    update installed its attention, still get SDPA's masks."""
    import lorapop.engine.pack_attention as pack_mod

    built = []
    real = pack_mod.sdpa_mask
    monkeypatch.setattr(pack_mod, "sdpa_mask", lambda *a, **k: built.append(1) or real(*a, **k))
    model = tiny_model()
    bank = AdapterBank(model, n_slots=2, rank=4, alpha=8.0)
    with torch.no_grad():
        bank.weights.normal_(0.0, 0.3, generator=torch.Generator().manual_seed(5))
    prompts, completions = [[5, 6, 7]] * 2 + [[8, 9]], [[11, 12], [13], [14, 15, 16]]
    packed, _ = sequence_logprobs(model, bank, prompts, completions, [0, 0, 1],
                                  share_prompts=True)
    alone, _ = sequence_logprobs(model, bank, prompts, completions, [0, 0, 1])
    assert built == []
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-5)
    ids = torch.tensor([[5, 6, 7, 13, 0], [8, 9, 14, 15, 16]])
    with bank.route([0, 1]):
        logits = model(input_ids=ids, attention_mask=torch.tensor([[1] * 4 + [0], [1] * 5])).logits
    assert built  # a forward outside the update: SDPA's own (padding) mask
    # ... which scores the real tokens as the update did
    lp = torch.log_softmax(logits.float(), -1)
    torch.testing.assert_close(lp[1, 2:4].gather(-1, ids[1, 3:5, None]).squeeze(-1),
                               alone[2, 1:], atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="host-device waits exist on CUDA only")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("share", [False, True])
def test_an_update_micro_batch_never_waits_for_the_gpu(share, dtype):
    """Given slot ids on the host, the forward, loss and backward of a micro-batch, as the
    loop runs them, queue their copies instead of waiting for the GPU, so the host lays out
    the next micro-batch while the GPU runs this one (torch raises on any synchronising call
    in "error" mode; the loss once read its device group ids back). In bf16 (rank 8:
    grouped_mm's alignment) the LoRA layers run grouped_mm where torch has its kernels
    (H100/H200); in fp32 its fallback would wait, so the bank gathers instead."""
    model = tiny_model().cuda().to(dtype)
    model.train()
    bank = AdapterBank(model, n_slots=2, rank=8, alpha=8.0)
    if torch.cuda.get_device_capability()[0] in (9, 10):  # torch's grouped_mm kernels
        assert bank._grouped_ok[torch.bfloat16] and not bank._grouped_ok[torch.float32]
    prompts = [[5, 6, 7]] * 3 + [[8, 9]]
    completions = [[11, 12], [13], [14, 15, 16], [17, 18]]
    slots = [0, 0, 0, 1]
    groups = torch.tensor(slots, device="cuda")  # the loop's per-update tensors
    advantages = torch.ones(len(slots), device="cuda")
    counts = group_token_counts(torch.ones(len(slots), 3, device="cuda"), groups, n_groups=2)

    def micro_batch() -> None:
        lp, mask = sequence_logprobs(model, bank, prompts, completions, slots,
                                     share_prompts=share)
        loss, _ = policy_loss(lp.float(), advantages, mask, groups=groups, token_counts=counts)
        loss.backward()

    micro_batch()  # compiles, allocates
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        micro_batch()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    bank.zero_grad()
