"""Warm-start training of the tiny base, and the shipped model it produced."""

import json
import os
import pickle
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from lorapop.tasks import FormatError, Task, get_family
from lorapop.tiny import generate_tasks
from lorapop.tiny.evaluate import proposal_validity
from lorapop.tiny.pretrain import (
    ROLES,
    TINY_MODEL_DIR,
    ExamplePool,
    Examples,
    ModelSize,
    as_type,
    build_corpus,
    encode,
    pretrain_tiny,
    train,
)
from lorapop.verify import Sandbox

HERE = Path(__file__).parent
SMALL = ModelSize(hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64, max_positions=1024)


@pytest.fixture(scope="module")
def corpus(tiny_sandbox: Sandbox) -> list[Task]:
    return build_corpus(3, 0, tiny_sandbox, levels=(1, 2, 3))


def _family(kind: str, completion: str):
    n = max(2, completion.count("</i>"))
    return get_family(kind, template="compact", **({"n_inputs": n} if kind == "code_f" else {}))


def test_every_example_parses_as_its_role_expects(corpus: list[Task]) -> None:
    ex = Examples(corpus, random.Random(1))
    seen = set()
    for _ in range(200):
        role, prompt, completion = ex.draw()
        who, kind = role.split("/")
        fam = _family(kind, completion)
        if who == "student":
            parsed = fam.parse_answer(completion)
        else:
            parsed = fam.parse_proposal(completion, None)
        assert not isinstance(parsed, FormatError), (role, completion, parsed)
        assert prompt.startswith(("propose " if who == "teacher" else "solve ") + kind)
        seen.add(role)
    assert seen == set(ROLES)


def test_teacher_completions_recreate_their_task(corpus: list[Task], tiny_sandbox) -> None:
    """A teacher example verifies in the sandbox into the very task it was cut from."""
    t = corpus[0]
    for kind in ("code_o", "code_i"):
        task = as_type(t, kind, 1)
        fam = get_family(kind, template="compact")
        text = f"{task.program}</f><i>{task.input}</i>"
        (v,) = fam.verify([text], tiny_sandbox)
        assert v.valid and v.task is not None and v.task.output == task.output


def test_loss_covers_only_the_completion(corpus: list[Task], tiny_sandbox) -> None:
    tok = AutoTokenizer.from_pretrained(TINY_MODEL_DIR)
    pairs = [("solve code_o\n<f>x</f><i>1</i>\n<o>", "2</o>"), ("propose code_o\nnew\n<f>", "y")]
    ids, mask, labels = encode(tok, pairs, max_len=512)
    for row, (p, c) in enumerate(pairs):
        n_p = len(tok(p, add_special_tokens=False)["input_ids"])
        n_c = len(tok(c, add_special_tokens=False)["input_ids"]) + 1
        assert (labels[row, :n_p] == -100).all()
        assert labels[row, n_p : n_p + n_c].tolist() == ids[row, n_p : n_p + n_c].tolist()
        assert labels[row, n_p + n_c - 1] == tok.eos_token_id
        assert (labels[row, n_p + n_c :] == -100).all() and mask[row].sum() == n_p + n_c


def _rows(ids, mask, labels) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Each row's real tokens and trained labels."""
    return [(tuple(i[m.bool()].tolist()), tuple(y[y != -100].tolist()))
            for i, m, y in zip(ids, mask, labels, strict=True)]  # fmt: skip


def test_pool_batches_hold_the_encoded_rows_within_the_token_budget(corpus: list[Task]) -> None:
    """The GPU path's batches are `encode`'s rows (same ids, same labels), bounded in padded
    tokens, every row once per epoch, in an order fixed by the seed."""
    tok = AutoTokenizer.from_pretrained(TINY_MODEL_DIR)
    ex = Examples(corpus, random.Random(0), teacher_max_level=5, level_refs=True)
    pairs = [ex.draw()[1:] for _ in range(60)]

    def pool(seed: int) -> ExamplePool:
        return ExamplePool(tok, pairs, max_len=200, batch_tokens=800, seed=seed)

    got = []
    for batch in pool(3).batches(len(pool(3)._epoch())):
        assert batch[0].numel() <= 800 and batch[1][:, -1].any()  # no all-padding column
        got += _rows(*batch)
    assert sorted(got) == sorted(_rows(*encode(tok, pairs, max_len=200)))
    full = [len(tok(p, add_special_tokens=False)["input_ids"])
            + len(tok(c, add_special_tokens=False)["input_ids"]) + 1 for p, c in pairs]
    assert pool(3).cut == sum(n > 200 for n in full) > 0
    a, again, other = ([x[0] for x in pool(s).batches(3)] for s in (3, 3, 4))
    assert all(torch.equal(x, y) for x, y in zip(a, again, strict=True))
    assert not all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, other, strict=True))


def _run(tmp_path, corpus, seed: int, name: str) -> tuple[dict, dict]:
    rec = pretrain_tiny(tmp_path / name, seed=seed, steps=3, device="cpu", vocab_size=300,
                        size=SMALL, batch_size=4, corpus=corpus, log=None)  # fmt: skip
    return rec, load_file(tmp_path / name / "model.safetensors")


def test_the_kernel_probe_leaves_the_model_as_it_was() -> None:
    from lorapop.tiny.pretrain import build_model, kernel_probe

    model = build_model(AutoTokenizer.from_pretrained(TINY_MODEL_DIR), SMALL, seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for masks in (True, False):
        kernel_probe(model, torch.device("cpu"), attention_mask=masks)()
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_pretrain_is_deterministic_under_a_seed(tmp_path, corpus: list[Task], monkeypatch) -> None:
    import lorapop.tiny.pretrain as pretrain

    modes = []
    train = pretrain.train
    monkeypatch.setattr(pretrain, "train", lambda *a, **kw: modes.append(
        (torch.are_deterministic_algorithms_enabled(),
         torch.is_deterministic_algorithms_warn_only_enabled())) or train(*a, **kw))
    a, wa = _run(tmp_path, corpus, 7, "a")
    assert modes == [(True, False)]  # training runs on deterministic kernels, strictly
    b, wb = _run(tmp_path, corpus, 7, "b")
    c, _ = _run(tmp_path, corpus, 8, "c")
    assert a["loss_curve"] == b["loss_curve"] and a["final_loss"] == b["final_loss"]
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert a["final_loss"] != c["final_loss"]
    # two builds compare by their digest (on the GPU, deterministic kernels make them equal)
    assert a["deterministic_kernels"] and a["no_deterministic_kernel"] is None
    assert a["weights_sha256"] == b["weights_sha256"] != c["weights_sha256"]
    assert not torch.are_deterministic_algorithms_enabled()  # the caller's setting is back
    # the saved directory is a standard transformers model + tokenizer; next to a Qwen2 config
    # AutoTokenizer builds a Qwen2Tokenizer, which must encode exactly as tokenizer.json does
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "a")
    tok = AutoTokenizer.from_pretrained(tmp_path / "a")
    raw = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "a" / "tokenizer.json"))
    assert model.config.model_type == "qwen2" and model.config.vocab_size == len(tok)
    text = "solve code_o\n<f>def f(s):\n    return s  + 'é中🙂'</f><i>'x'</i>\n<o> <|eos|>-ish \t\n"
    assert tok(text)["input_ids"] == raw(text)["input_ids"]
    assert tok.decode(tok(text)["input_ids"]) == text and tok.eos_token_id == 2
    assert a["steps"] == 3 and a["seed"] == 7 and a["device"] == "cpu"


class _Diverging(torch.nn.Module):
    """A model whose loss turns NaN from its third forward on."""

    def __init__(self) -> None:
        super().__init__()
        self.w, self.calls = torch.nn.Parameter(torch.ones(1)), 0

    def forward(self, **_):
        self.calls += 1
        return type("Out", (), {"loss": (self.w**2).sum() * (float("nan") if self.calls > 2 else 1.0)})


def test_a_diverged_training_stops_with_the_step_instead_of_going_on() -> None:
    """A NaN loss is caught where the loss is read back anyway (`every` steps here, the last
    step when nothing else reads it), so a learning curve or a build never trains on NaN."""
    batch = (torch.zeros(1, 2, dtype=torch.long),) * 3
    scored: list[int] = []
    with pytest.raises(FloatingPointError, match=r"loss is nan at step 3 \(lr 0.001\)"):
        train(_Diverging(), [batch] * 6, 6, torch.device("cpu"), lr=1e-3, every=(2, scored.append))
    assert scored == [2]
    with pytest.raises(FloatingPointError, match="at step 5"):
        train(_Diverging(), [batch] * 6, 6, torch.device("cpu"), lr=1e-3)


def test_shipped_model_loads_and_proposes_a_valid_task_of_each_type(tiny_sandbox) -> None:
    tok = AutoTokenizer.from_pretrained(TINY_MODEL_DIR)
    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR, dtype=torch.float32).eval()
    size = sum(f.stat().st_size for f in TINY_MODEL_DIR.iterdir())
    assert size <= 20 * 2**20
    assert model.config.model_type == "qwen2" and model.generation_config.eos_token_id == 2
    buffer = {k: generate_tasks(k, 4, 1, "shipped-test", sandbox=tiny_sandbox, n_inputs=4)
              for k in ("code_o", "code_i", "code_f")}  # fmt: skip
    res = proposal_validity(model, tok, buffer, tiny_sandbox, n=8, seed=0, max_new_tokens=160)
    for kind, r in res.items():
        assert r["valid_rate"] > 0, (kind, r)


def _two_ranks(corpus_file: Path, out: Path, stop_at: int, *kw: str) -> None:
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                    "--nproc-per-node=2", str(HERE / "pretrain_driver.py"), str(corpus_file),
                    str(out), str(stop_at), *kw], check=True, timeout=300, cwd=HERE,
                   env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip


def _close(a: Path, b: Path) -> None:
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-4, atol=1e-5)
    ra, rb = (json.loads((d / "training.json").read_text()) for d in (a, b))
    assert ra["final_loss"] == pytest.approx(rb["final_loss"], rel=1e-5)


def test_two_ranks_pretrain_the_model_one_process_does_and_share_a_partial_build(
        tmp_path, corpus: list[Task]) -> None:  # fmt: skip
    """Under torchrun each rank trains on half of each batch and the gradients are summed:
    the same model as one process, to float rounding (weighted loss, whose normaliser is the
    whole batch's); a build stopped on two ranks goes on on one, as if never stopped."""
    from pretrain_driver import build

    corpus_file = tmp_path / "corpus.pkl"
    corpus_file.write_bytes(pickle.dumps(corpus))
    build(corpus, tmp_path / "one", 0, example_alpha=0.5)
    _two_ranks(corpus_file, tmp_path / "two", 0, "example_alpha=0.5")
    _close(tmp_path / "one", tmp_path / "two")
    rec = json.loads((tmp_path / "two" / "training.json").read_text())
    assert rec["ranks"] == 2 and rec["steps"] == 20 and not (tmp_path / "two" / "partial").exists()

    build(corpus, tmp_path / "plain", 0)
    _two_ranks(corpus_file, tmp_path / "split", 10)  # stops at step 10 (polled every 10)
    state = json.loads((tmp_path / "split" / "partial" / "state.json").read_text())
    assert state["step"] == 10 and not (tmp_path / "split" / "model.safetensors").exists()
    build(corpus, tmp_path / "split", 0)
    _close(tmp_path / "plain", tmp_path / "split")
    assert json.loads((tmp_path / "split" / "training.json").read_text())["resumed_at"] == [10]
