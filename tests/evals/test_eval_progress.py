"""`lorapop eval` reports progress while it generates, and chunking changes no answer."""

from lorapop.engine.generate import GenerateSpec, SamplingParams, generate
from lorapop.engine.load import load_base_model, load_tokenizer
from lorapop.evals.progress import generate_logged


def test_chunks_log_progress_and_keep_order():
    tok = load_tokenizer("tiny")
    model = load_base_model("tiny", tok, "cpu", "float32", 0)
    prompts = [f"solve code_o\n<f>def f(x):\n    return x * {k}</f><i>{k}</i>\n<o>" + " " * (k % 3)
               for k in range(7)]
    params = SamplingParams(temperature=0.0, max_new_tokens=6)
    lines: list[str] = []
    got = generate_logged(model, None, tok, prompts, [0] * 7, params, batch_size=3,
                          log=lines.append, what="code_o")
    want = generate(model, None, tok, prompts, [0] * 7, GenerateSpec(params=params))
    assert [g.text for g in got] == [g.text for g in want]
    assert [x.split(",")[0] for x in lines] == [
        "code_o: 3/7 completions", "code_o: 6/7 completions", "code_o: 7/7 completions"]
    assert all("elapsed, ETA" in x for x in lines) and lines[-1].endswith("ETA 0:00:00")
