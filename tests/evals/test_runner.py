"""End to end on CPU: a tiny random model, a run directory with two members and a baseline,
5 problems of every benchmark, greedy decoding, scored and tabulated."""

import json
from pathlib import Path

import pytest
import torch

from lorapop.evals import data, table
from lorapop.evals.runner import EvalError, find_members, run_eval

FIXTURES = Path(__file__).parent / "fixtures"
LCB = str(FIXTURES / "lcb_code_generation_lite.jsonl")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    from lorapop.engine.load import load_base_model, load_tokenizer
    from lorapop.lora.bank import AdapterBank
    from lorapop.lora.peft_io import export_slot

    run = tmp_path_factory.mktemp("run")
    tok = load_tokenizer("tiny-random")
    bank = AdapterBank(load_base_model("tiny-random", tok, device="cpu"), n_slots=3, rank=4)
    g = torch.Generator().manual_seed(0)
    for i, rel in enumerate(["members/m0", "members/m1", "baseline"]):
        state = bank.slot_state(i)
        bank.load_slot(i, {k: {n: torch.randn(t.shape, generator=g) for n, t in ab.items()}
                           for k, ab in state.items()})  # fmt: skip
        export_slot(bank, i, run / rel, "tiny-random")
    return run


def test_members_are_found(run_dir):
    members, base = find_members(run_dir)
    assert base == "tiny-random"
    assert [(m.name, m.role) for m in members] == [
        ("baseline", "baseline"), ("members/m0", "member"), ("members/m1", "member")]
    one, _ = find_members(run_dir / "members" / "m0")
    assert [m.name for m in one] == ["m0"]


def test_population_end_to_end(run_dir, data_dir, tmp_path):
    benches = list(data.BENCHES)
    res = run_eval(run_dir, benches, data_dir, tmp_path, sources={"livecodebench": LCB},
                   limit=5, max_new_tokens=4, device="cpu", template="azr",
                   include_base=False)  # fmt: skip
    saved = json.loads((tmp_path / "eval.json").read_text())
    assert saved["members"] == {"baseline": "baseline", "members/m0": "member",
                                "members/m1": "member"}  # fmt: skip
    for b in benches:
        n = 2 if b == "livecodebench" else 5
        recs = saved["benchmarks"][b]["problems"]
        assert len(recs) == 3 * n and {r["member"] for r in recs} == set(saved["members"])
        assert all(isinstance(r["completion"], str) and r["finish"] in ("eos", "length") for r in recs)
        assert set(saved["benchmarks"][b]["pass@1"]) == set(saved["members"])
    md = (tmp_path / "eval.md").read_text()
    assert md == res["table"]
    head = md.splitlines()[0]
    for col in ("members/m0", "members/m1", "pop. mean", "best (", "weakest (", "baseline"):
        assert col in head
    assert all(row in md for row in ("**code avg**", "**math avg**", "**overall**", "cruxeval_i"))


def test_base_slot_matches_the_plain_model(run_dir, data_dir):
    kw = {"limit": 2, "max_new_tokens": 6, "device": "cpu", "template": "azr"}
    pop = run_eval(run_dir, ["gsm8k"], data_dir, **kw)["benchmarks"]["gsm8k"]["problems"]
    alone = run_eval("tiny-random", ["gsm8k"], data_dir, **kw)["benchmarks"]["gsm8k"]["problems"]
    assert [r["completion"] for r in pop if r["member"] == "base"] == [
        r["completion"] for r in alone]
    m0 = [r["completion"] for r in pop if r["member"] == "members/m0"]
    assert m0 != [r["completion"] for r in alone]  # the adapter is really applied


def test_bad_targets_and_options_are_one_line_errors(data_dir, tmp_path):
    with pytest.raises(EvalError, match="not found|cannot load") as e:
        run_eval(tmp_path / "no" / "model", ["gsm8k"], data_dir, limit=1, device="cpu")
    assert "\n" not in str(e.value)
    with pytest.raises(EvalError, match="unknown benchmarks"):
        run_eval("tiny-random", ["humaneval++"], data_dir)
    with pytest.raises(EvalError, match="data directory"):
        run_eval("tiny-random", ["gsm8k"])


def test_table_averages_like_azr():
    scores = {"humanevalplus": {"a": 0.5, "b": 0.3, "baseline": 0.2, "base": 0.1},
              "mbppplus": {"a": 0.7, "b": 0.1, "baseline": 0.2, "base": 0.1},
              "gsm8k": {"a": 0.2, "b": 0.6, "baseline": 0.4, "base": 0.3},
              "cruxeval_o": {"a": 1.0, "b": 1.0, "baseline": 1.0, "base": 1.0}}  # fmt: skip
    roles = {"a": "member", "b": "member", "baseline": "baseline", "base": "base"}
    s = table.summarize(scores, roles)
    rows = s["rows"]
    assert rows["code avg"]["a"] == pytest.approx(0.6) and rows["math avg"]["a"] == 0.2
    assert rows["overall"]["a"] == pytest.approx(0.4) and rows["overall"]["b"] == pytest.approx(0.4)
    assert rows["overall"]["pop. mean"] == pytest.approx(0.4)
    assert rows["humanevalplus"]["pop. mean"] == pytest.approx(0.4)
    assert "cruxeval_o" not in ("code avg", "math avg") and rows["code avg"]["baseline"] == 0.2
    md = table.markdown(s, roles)
    assert "| **overall** | 40.0 | 40.0 | 40.0 |" in md


def test_prompt_templates(data_dir):
    from lorapop.engine.load import load_tokenizer
    from lorapop.evals import prompts

    tok = load_tokenizer("tiny-random")
    p = data.load("gsm8k", data_dir, limit=1)[0]
    assert prompts.resolve("auto", tok) == "azr"  # no chat template: AZR's R1 template
    text = prompts.render(p, "azr", tok)
    assert text.startswith("A conversation between User and Assistant.")
    assert text.endswith(p.question + "\nAssistant: <think>")
    with pytest.raises(ValueError, match="chat template"):
        prompts.resolve("chat", tok)
    tok.chat_template = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}<|assistant|>"
    assert prompts.resolve("auto", tok) == "chat"
    chat = prompts.render(p, "chat", tok)
    assert chat.startswith("<|user|>" + p.question) and chat.endswith("\\boxed{}.<|assistant|>")
    code = data.load("humanevalplus", data_dir, limit=1)[0]
    assert "```python\n" + code.question.strip() + "\n```" in prompts.render(code, "azr", tok)


def test_interrupted_eval_keeps_its_results_and_resumes(run_dir, data_dir, tmp_path, monkeypatch):
    """Results are appended as each chunk is scored: Ctrl-C keeps them, and the same call
    goes on from there to the results of an uninterrupted evaluation."""
    from lorapop.evals import progress, runner

    kw = dict(limit=3, max_new_tokens=4, device="cpu", template="azr", include_base=False)
    monkeypatch.setattr(runner, "CHUNK_ROWS", 4)
    want = run_eval(run_dir, ["gsm8k"], data_dir, tmp_path / "straight", **kw)
    real, calls = progress.generate_logged, []

    def interrupted(*a, **k):
        calls.append(len(a[3]))
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(progress, "generate_logged", interrupted)
    out = tmp_path / "resumed"
    with pytest.raises(runner.EvalInterrupted, match="4 results are kept in .*eval.partial.jsonl"):
        run_eval(run_dir, ["gsm8k"], data_dir, out, **kw)
    assert not (out / "eval.json").exists()
    got = run_eval(run_dir, ["gsm8k"], data_dir, out, **kw)
    assert calls[2:] == [4, 1]  # only what was left: 3 members x 3 problems, 4 kept
    assert not (out / runner.PARTIAL).exists()
    strip = [{k: r[k] for k in ("member", "id", "passed", "completion")}
             for r in want["benchmarks"]["gsm8k"]["problems"]]
    assert [{k: r[k] for k in ("member", "id", "passed", "completion")}
            for r in got["benchmarks"]["gsm8k"]["problems"]] == strip
    with pytest.raises(EvalError, match="results of another evaluation"):
        (out / runner.PARTIAL).write_text(json.dumps({"settings": {"seed": 9}}) + "\n")
        run_eval(run_dir, ["gsm8k"], data_dir, out, **kw)
