"""PEFT as the oracle: per-row equivalence in a mixed batch, and lossless export/import."""

from __future__ import annotations

import json

import pytest
import torch
from lora_fixtures import VOCAB, randomize_b, tiny_model
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict
from safetensors.torch import load_file

from lorapop.lora import AdapterBank
from lorapop.lora.peft_io import export_slot, import_slot


def test_mixed_batch_rows_equal_peft_with_that_adapter(arch, tmp_path):
    model = tiny_model(arch)
    bank = AdapterBank(model, n_slots=3, rank=4, alpha=8)
    randomize_b(bank)
    ids = torch.randint(0, VOCAB, (5, 7))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # a left-padded row
    slots = [2, 0, 1, 2, 0]
    with torch.no_grad(), bank.route(slots):
        mixed = model(ids, attention_mask=mask).logits
    for s in range(3):
        peft = PeftModel.from_pretrained(tiny_model(arch), export_slot(bank, s, tmp_path / str(s)))
        rows = [b for b, slot in enumerate(slots) if slot == s]
        with torch.no_grad():
            ref = peft(ids[rows], attention_mask=mask[rows]).logits
        torch.testing.assert_close(mixed[rows], ref, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(ref, tiny_model(arch)(ids[rows]).logits, atol=1e-3)


def test_export_writes_peft_keys_and_round_trips_exactly(arch, tmp_path):
    bank = AdapterBank(tiny_model(arch), n_slots=2, rank=4, alpha=16)
    randomize_b(bank)
    base_dir = tmp_path / "base"
    bank.model.config.save_pretrained(base_dir)  # a local base: PEFT looks nothing up remotely
    out = export_slot(bank, 1, tmp_path / "a", base_model_name_or_path=str(base_dir))
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 4, 16)
    assert config["base_model_name_or_path"] == str(base_dir)
    # the same file from every process (PEFT alone writes its module set in hash order)
    assert config["target_modules"] == sorted(config["target_modules"])
    assert export_slot(bank, 1, tmp_path / "a2", base_model_name_or_path=str(base_dir)
                       ).joinpath("adapter_config.json").read_bytes() == (
        out / "adapter_config.json").read_bytes()  # fmt: skip
    native = get_peft_model(
        tiny_model(arch), LoraConfig(r=4, target_modules=config["target_modules"])
    )
    assert set(load_file(out / "adapter_model.safetensors")) == set(
        get_peft_model_state_dict(native)
    )

    peft = PeftModel.from_pretrained(tiny_model(arch), out)
    again = tmp_path / "b"
    peft.save_pretrained(again)  # PEFT writes the directory itself this time
    before = bank.slot_state(1)
    bank.reset_slot(1, seed=3)
    bank.reset_slot(0, seed=4)
    import_slot(bank, 0, again)
    for name, ab in bank.slot_state(0).items():
        assert torch.equal(ab["A"], before[name]["A"])
        assert torch.equal(ab["B"], before[name]["B"])


def test_import_folds_a_different_alpha_into_b(tmp_path):
    src = AdapterBank(tiny_model(), n_slots=1, rank=4, alpha=4)
    randomize_b(src)
    export_slot(src, 0, tmp_path)
    dst = AdapterBank(tiny_model(), n_slots=1, rank=4, alpha=8)
    import_slot(dst, 0, tmp_path)
    ids = torch.randint(0, VOCAB, (2, 5))
    with torch.no_grad(), src.route([0, 0]):
        want = src.model(ids).logits
    with torch.no_grad(), dst.route([0, 0]):
        torch.testing.assert_close(dst.model(ids).logits, want, rtol=1e-5, atol=1e-5)


def test_import_rejects_mismatched_adapters_with_one_line_errors(tmp_path):
    bank = AdapterBank(tiny_model(), n_slots=1, rank=4)
    other_rank = AdapterBank(tiny_model(), n_slots=1, rank=8)
    export_slot(other_rank, 0, tmp_path / "r8")
    fewer = AdapterBank(tiny_model(), n_slots=1, rank=4, target_modules=["q_proj", "v_proj"])
    export_slot(fewer, 0, tmp_path / "qv")
    cases = [
        (tmp_path / "r8", "adapter rank 8 != bank rank 4"),
        (tmp_path / "qv", "target modules differ"),
        (tmp_path / "missing", "not a PEFT LoRA directory"),
    ]
    for path, message in cases:
        with pytest.raises(ValueError, match=message) as err:
            import_slot(bank, 0, path)
        assert "\n" not in str(err.value)
