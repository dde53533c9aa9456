"""The tiny tokenizer: exact round trips, determinism, loading through transformers."""

import random

import pytest
from transformers import AutoTokenizer

from lorapop.tasks.task import Task
from lorapop.tiny.grammar import LEVELS, generate_input, generate_program
from lorapop.tiny.tokenizer import (
    SPECIAL_TOKENS,
    corpus_texts,
    load_tokenizer,
    save_tokenizer,
    train_tokenizer,
)


def _tasks(n: int) -> list[Task]:
    """Tasks from the grammar with plainly computed outputs (our own, trusted programs)."""
    tasks = []
    for i in range(n):
        rng = random.Random(f"tok{i}")
        program = generate_program(rng, list(LEVELS)[i % len(LEVELS)])
        inputs = tuple(dict.fromkeys(generate_input(rng, program) for _ in range(4)))
        ns: dict = {}
        exec(program.source, ns)
        try:
            outputs = tuple(repr(eval(f"f({x})", ns)) for x in inputs)
        except Exception:
            continue
        kind = ("code_o", "code_i", "code_f")[i % 3]
        keep = len(inputs) if kind == "code_f" else 1
        tasks.append(Task(kind, program.source, inputs[:keep], outputs[:keep], "f takes x."))
    return tasks


@pytest.fixture(scope="module")
def corpus() -> list[str]:
    return list(corpus_texts(_tasks(150)))


@pytest.fixture(scope="module")
def tok(corpus: list[str]):
    return train_tokenizer(corpus, vocab_size=512)


def test_corpus_has_every_role(corpus: list[str]) -> None:
    heads = {text.split("\n", 1)[0].split(" n=")[0] for text in corpus}
    assert heads == {
        "propose code_o", "propose code_i", "propose code_f",
        "solve code_o", "solve code_i", "solve code_f",
    }  # fmt: skip


def test_round_trip_and_compression(tok, corpus: list[str]) -> None:
    samples = [*corpus[:50], "x , y ( )  \t\n\n  é 中文 🙂 <|eos|>-ish", ""]
    for text in samples:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == text
    chars = sum(len(t) for t in corpus[:50])
    tokens = sum(len(tok(t)["input_ids"]) for t in corpus[:50])
    assert chars / tokens > 2.0  # merges learnt on the corpus pay off


def test_same_corpus_same_tokenizer_size_respected(tok, corpus: list[str]) -> None:
    again = train_tokenizer(corpus, vocab_size=512)
    assert again.backend_tokenizer.to_str() == tok.backend_tokenizer.to_str()
    assert len(tok) == 512
    with pytest.raises(ValueError, match="vocab_size"):
        train_tokenizer(corpus, vocab_size=100)


def test_saves_and_loads_through_transformers(tok, tmp_path) -> None:
    path = save_tokenizer(tok, tmp_path / "tok")
    assert path.name == "tokenizer.json" and path.is_file()
    for loaded in (AutoTokenizer.from_pretrained(str(path.parent)), load_tokenizer(path)):
        assert (loaded.pad_token, loaded.bos_token, loaded.eos_token) == SPECIAL_TOKENS
        assert (loaded.pad_token_id, loaded.bos_token_id, loaded.eos_token_id) == (0, 1, 2)
        text = "def f(n: int):\n    return n + 1\n"
        ids = loaded(text)["input_ids"]
        assert ids == tok(text)["input_ids"] and loaded.decode(ids) == text
        assert loaded.decode([1, *ids, 2], skip_special_tokens=True) == text
    with pytest.raises(FileNotFoundError):
        load_tokenizer(tmp_path / "missing.json")


def test_single_chars_are_never_merged_and_qwen2_loading_agrees(corpus, tmp_path) -> None:
    from transformers import Qwen2Config

    chars = "abcdexyzABCDEXYZ"
    tok = train_tokenizer(corpus, vocab_size=512, single_chars=chars)
    merged = train_tokenizer(corpus, vocab_size=512)
    literal = "<i>'abxdcey'</i><o>'YECDXBA'</o>"
    pieces = [tok.decode([i]) for i in tok(literal)["input_ids"]]
    assert "".join(pieces) == literal
    assert all(len(p) == 1 for p in pieces if set(p) <= set(chars))
    assert any(len(p) > 1 and set(p) <= set(chars)
               for p in (merged.decode([i]) for i in merged(literal)["input_ids"]))  # fmt: skip
    save_tokenizer(tok, tmp_path)
    Qwen2Config(vocab_size=len(tok)).save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(str(tmp_path))  # rebuilt as a Qwen2 tokenizer
    for text in [literal, *corpus[:40]]:
        assert loaded(text)["input_ids"] == tok(text)["input_ids"]
