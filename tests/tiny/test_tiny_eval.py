"""Held-out scoring: the table's shape, gold answers score 100%, garbage 0%, and a mixed batch
of adapter slots scores each slot as it would alone."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lorapop.evals import EvalError
from lorapop.lora.bank import AdapterBank
from lorapop.lora.peft_io import export_slot
from lorapop.tasks import Task
from lorapop.tiny import KINDS, LEVELS, build_heldout
from lorapop.tiny.evaluate import evaluate_run, evaluate_tiny, score
from lorapop.tiny.pretrain import TINY_MODEL_DIR, completion


@pytest.fixture(scope="module")
def heldout(tiny_sandbox) -> list[Task]:
    return build_heldout(1, sandbox=tiny_sandbox)


def _gold(task: Task) -> str:
    return completion(f"student/{task.type}", task)


def test_gold_answers_score_100_and_garbage_0(heldout: list[Task], tiny_sandbox) -> None:
    texts = {
        "gold": [_gold(t) for t in heldout],
        "garbage": ["lorem ipsum" for _ in heldout],
        "wrong": [_gold(heldout[(i + 1) % len(heldout)]) for i in range(len(heldout))],
    }
    table = score(heldout, texts, tiny_sandbox)
    levels = [str(lv) for lv in LEVELS]
    for member in texts:
        row = table["members"][member]
        assert row["n"] == len(heldout) == len(KINDS) * len(LEVELS)
        assert set(row["by_type"]) == set(KINDS) and list(row["by_level"]) == levels
        assert all(list(row["cells"][k]) == levels for k in KINDS)
    gold, garbage = table["members"]["gold"], table["members"]["garbage"]
    assert gold["pass@1"] == 1.0 and all(v == 1.0 for c in gold["cells"].values() for v in c.values())
    assert garbage["pass@1"] == 0.0 and all(v == 0.0 for v in garbage["by_level"].values())
    assert table["members"]["wrong"]["pass@1"] < 0.5  # another task's answer rarely fits
    assert table["summary"]["best"] == "gold" and table["summary"]["worst"] == "garbage"


def test_mixed_slots_score_as_separate_runs(heldout: list[Task], tiny_sandbox) -> None:
    tok = AutoTokenizer.from_pretrained(TINY_MODEL_DIR)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR, dtype=torch.float32).eval()
    tasks = [t for t in heldout if t.meta["difficulty"] <= 2]
    budget = {"code_o": 24, "code_i": 24, "code_f": 64}
    plain = evaluate_tiny(model, tok, tasks, tiny_sandbox, max_new_tokens=budget,
                          keep_texts=True)  # no bank yet  # fmt: skip
    bank = AdapterBank(model, n_slots=2, rank=4, alpha=8)
    bank.reset_slot(0, seed=0)  # B = 0: slot 0 is the base model
    state = bank.slot_state(0)
    gen = torch.Generator().manual_seed(0)
    for mod in state.values():
        mod["B"] = torch.randn(mod["B"].shape, generator=gen) * 0.05
    bank.load_slot(1, state)  # slot 1 differs from the base
    both = evaluate_tiny(model, tok, tasks, tiny_sandbox, bank=bank, slots={"a": 0, "b": 1},
                         max_new_tokens=budget, keep_texts=True)  # fmt: skip
    alone_b = evaluate_tiny(model, tok, tasks, tiny_sandbox, bank=bank, slots={"b": 1},
                            max_new_tokens=budget, keep_texts=True)  # fmt: skip
    assert set(both["members"]) == {"a", "b"} and plain["members"]["base"]["n"] == len(tasks)
    assert both["members"]["b"] == alone_b["members"]["b"]
    assert both["texts"]["b"] == alone_b["texts"]["b"]
    assert both["members"]["a"] == plain["members"]["base"]
    assert both["texts"]["a"] == plain["texts"]["base"] != both["texts"]["b"]
    with bank.disabled():
        again = evaluate_tiny(model, tok, tasks, tiny_sandbox, max_new_tokens=budget,
                              keep_texts=True)  # fmt: skip
    assert again["texts"]["base"] == plain["texts"]["base"]


def test_evaluate_run_scores_every_adapter_and_the_base(tmp_path) -> None:
    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR, dtype=torch.float32).eval()
    bank = AdapterBank(model, n_slots=2, rank=4, alpha=8)
    bank.reset_slot(0, seed=1)
    state = bank.slot_state(0)
    for mod in state.values():
        mod["B"] = torch.full(mod["B"].shape, 0.02)
    bank.load_slot(1, state)
    export_slot(bank, 0, tmp_path / "baseline")  # B = 0: computes exactly the base model
    export_slot(bank, 1, tmp_path / "S0")
    res = evaluate_run(tmp_path, base_model=str(TINY_MODEL_DIR), per_level=1, device="cpu",
                       max_new_tokens={"code_o": 16, "code_i": 16, "code_f": 48})  # fmt: skip
    assert set(res["members"]) == {"S0", "baseline", "base"}
    assert res["members"]["baseline"] == res["members"]["base"]
    assert res["summary"]["population_mean"] == res["members"]["S0"]["pass@1"]
    assert res["summary"]["baseline_pass@1"] == res["members"]["baseline"]["pass@1"]
    assert res["heldout"]["n_per_level"] == 1 and res["members"]["S0"]["n"] == 15
    with pytest.raises(EvalError):
        evaluate_run(tmp_path / "S0" / "adapter_model.safetensors", device="cpu")
