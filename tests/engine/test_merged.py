"""q/k/v and gate/up as one GEMM in decode steps: the same outputs, fewer GEMMs."""

from __future__ import annotations

import pytest
import torch
from torch import profiler

from lorapop.engine.byte_tokenizer import byte_tokenizer
from lorapop.engine.generate import GenerateSpec, generate
from lorapop.engine.merged import merge_projections
from lorapop.engine.sampling import SamplingParams
from lorapop.lora.bank import AdapterBank
from tiny_models import ARCHS, VOCAB, tiny_model

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _pair(arch: str, vocab: int = VOCAB, device: str = "cpu", bank: bool = True):
    """The same tiny model twice, the second merged, each with the same 3-slot bank."""
    models = []
    for merge in (False, True):
        model = tiny_model(arch, vocab).to(device).requires_grad_(False)
        if merge:
            assert merge_projections(model) == 2 * model.config.num_hidden_layers
        if bank:
            b = AdapterBank(model, n_slots=3, rank=4, alpha=8.0)
            gen = torch.Generator().manual_seed(1)
            with torch.no_grad():
                for t in b.targets.values():
                    t.b.copy_(torch.randn(t.b.shape, generator=gen).to(device) * 0.5)
            models.append((model, b))
        else:
            models.append((model, None))
    return models


def _linears(model, ids) -> int:
    with profiler.profile(activities=[profiler.ProfilerActivity.CPU]) as prof, torch.no_grad():
        model(ids)
    return sum(e.name == "aten::linear" for e in prof.events())


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_one_gemm_for_each_group_of_projections_in_a_decode_step(arch):
    (plain, _), (merged_model, _) = _pair(arch, bank=False)
    ids = torch.randint(0, VOCAB, (2, 5))
    layers = plain.config.num_hidden_layers
    assert _linears(plain, ids[:, :1]) == 7 * layers + 1  # the head too
    assert _linears(merged_model, ids[:, :1]) == 4 * layers + 1
    assert _linears(merged_model, ids) == 7 * layers + 1  # several tokens a row: a prefill
    q = merged_model.model.layers[0].self_attn
    assert q.q_proj.weight.untyped_storage().data_ptr() == \
        q.v_proj.weight.untyped_storage().data_ptr()  # views of one tensor: no memory added


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch", sorted(ARCHS))  # qwen2's q/k/v have biases, llama's none
def test_merged_model_gives_the_same_logits_and_gradients(arch, device):
    (plain, pb), (mm, mb) = _pair(arch, device=device)
    ids = torch.randint(0, VOCAB, (3, 7), generator=torch.Generator().manual_seed(0)).to(device)
    tol = 1e-5 if device == "cpu" else 1e-4
    with pb.route([0, 1, 2]), mb.route([0, 1, 2]), torch.no_grad():
        a, b = plain(ids).logits, mm(ids).logits  # prefill-like: many tokens a row
        a1, b1 = plain(ids[:, :1]).logits, mm(ids[:, :1]).logits  # one token a row
    torch.testing.assert_close(b, a, atol=tol, rtol=tol)
    torch.testing.assert_close(b1, a1, atol=tol, rtol=tol)
    grads = []
    for model, bank in ((plain, pb), (mm, mb)):
        bank.zero_grad()
        with bank.route([2, 0, 1]):
            model(ids).logits.float().square().mean().backward()
        grads.append(bank.grads.clone())
    assert torch.equal(grads[0], grads[1])  # under grad each projection runs its own GEMM


@pytest.mark.parametrize("device", DEVICES)  # on CUDA the decode steps replay CUDA graphs
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_generation_equals_the_separate_projections_and_each_row_alone(arch, device):
    tok = byte_tokenizer()
    (plain, pb), (mm, mb) = _pair(arch, len(tok), device)
    prompts = ["def f(x):", "a", "assert f(3) ==", "hello world, this is long"]
    slots = [0, 2, 1, 2]
    params = SamplingParams(temperature=1.0, max_new_tokens=10, eos_token_ids=())
    ref = generate(plain, pb, tok, prompts, slots, GenerateSpec(params=params, seed=3))
    out = generate(mm, mb, tok, prompts, slots, GenerateSpec(params=params, seed=3))
    assert [r.token_ids for r in out] == [r.token_ids for r in ref]
    for r, q in zip(out, ref, strict=True):
        torch.testing.assert_close(torch.tensor(r.logprobs), torch.tensor(q.logprobs),
                                   atol=1e-5, rtol=1e-5)
    for i in range(len(prompts)):  # a row's tokens do not depend on its batch
        alone = generate(mm, mb, tok, [prompts[i]], [slots[i]], GenerateSpec(params=params, seed=3),
                         row_keys=[i])
        assert alone[0].token_ids == out[i].token_ids


def test_with_a_replaced_weight_each_projection_runs_its_own():
    (plain, _), (mm, _) = _pair("qwen2", bank=False)
    ids = torch.randint(0, VOCAB, (2, 1))
    for model in (plain, mm):  # a weight replaced after merging (a load, a move) is the one used
        attn = model.model.layers[1].self_attn
        attn.k_proj.weight = torch.nn.Parameter(torch.ones_like(attn.k_proj.weight),
                                                requires_grad=False)
    with torch.no_grad():
        torch.testing.assert_close(mm(ids).logits, plain(ids).logits)
    assert _linears(mm, ids) == 4 * mm.config.num_hidden_layers + 1 + 1  # layer 1's k alone


def test_a_projection_called_again_on_its_input_gets_a_fresh_output():
    """The LoRA hooks add into a projection's output in place: a second call must not return
    the output the first call handed out."""
    (_, _), (mm, _) = _pair("llama", bank=False)
    attn = mm.model.layers[0].self_attn
    x = torch.randn(2, 1, mm.config.hidden_size)
    with torch.no_grad():
        q = attn.q_proj(x)
        expected = q.clone()
        q.add_(1.0)
        again = attn.q_proj(x)
        k = attn.k_proj(x)
    torch.testing.assert_close(again, expected)
    torch.testing.assert_close(k, torch.nn.functional.linear(x, attn.k_proj.weight))
