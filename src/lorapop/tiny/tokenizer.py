"""A small byte-level BPE tokenizer for the tiny model, trained with `tokenizers`.

Byte-level, so any NFC-normalised text (a teacher's odd output included) encodes and decodes
back exactly; BPE merges learnt on generated programs and compact-format prompts keep sequences
short for a model of a few million parameters. Saved with `save_pretrained` (tokenizer.json plus the
transformers config) so `AutoTokenizer.from_pretrained(dir)` gives it back with its bos, eos and
pad tokens. No post-processor: callers add bos/eos where their format wants them.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from lorapop.tasks import prompts
from lorapop.tasks.task import Task

PAD, BOS, EOS = "<|pad|>", "<|bos|>", "<|eos|>"
SPECIAL_TOKENS = (PAD, BOS, EOS)  # ids 0, 1, 2
_BYTES = 256
#: Qwen2's pre-tokenizer split. `AutoTokenizer` loads a tokenizer saved next to a Qwen2 config
#: as `Qwen2Tokenizer`, which rebuilds the pipeline as NFC + this split + ByteLevel; training with
#: the same pipeline makes that class and tokenizer.json encode every text identically.
SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def train_tokenizer(
    texts: Iterable[str], vocab_size: int = 1024, min_frequency: int = 2, single_chars: str = ""
) -> PreTrainedTokenizerFast:
    """Train byte-level BPE on `texts`; the same texts give the same tokenizer.

    `single_chars`: merges whose result is made only of these characters are dropped, so a
    run of them is one token per character. With the grammar's string alphabet, a literal
    like 'abxdcey' is seven tokens, not 'abx' 'dc' 'ey', and a student can reverse, count or
    slice it character by character. Only the merge list changes (the split and byte-level
    steps are Qwen2's), so `AutoTokenizer`'s Qwen2Tokenizer still encodes exactly alike."""
    if vocab_size < _BYTES + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must be >= {_BYTES + len(SPECIAL_TOKENS)}, got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])  # fmt: skip
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    if single_chars:
        spec = json.loads(tok.to_str())
        keep = set(single_chars)
        spec["model"]["merges"] = [m for m in spec["model"]["merges"]
                                   if not set("".join(m)) <= keep]  # fmt: skip
        tok = Tokenizer.from_str(json.dumps(spec))
    return wrap(tok)


def wrap(tok: Tokenizer) -> PreTrainedTokenizerFast:
    """A transformers tokenizer around `tok` with the special tokens set.

    `clean_up_tokenization_spaces=False`: the clean-up rewrites " ," and the like, which would
    break the exact round trip that program text needs. `unk_token=EOS` (byte-level BPE never
    emits it) stops `Qwen2Tokenizer` from adding its default `<|endoftext|>` as a new token.
    """
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=EOS,
        clean_up_tokenization_spaces=False,
        model_max_length=4096,
    )


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, out_dir: str | Path) -> Path:
    """Write tokenizer.json and the transformers config files into `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(out))
    return out / "tokenizer.json"


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerFast:
    """Load from a directory written by `save_tokenizer` or from a bare tokenizer.json."""
    p = Path(path)
    if p.is_dir():
        return PreTrainedTokenizerFast.from_pretrained(str(p))
    if not p.is_file():
        raise FileNotFoundError(f"no tokenizer at {p}")
    return wrap(Tokenizer.from_file(str(p)))


def corpus_texts(tasks: Iterable[Task]) -> Iterator[str]:
    """Compact-format prompts with their answers, for every role a task can appear in.

    The teacher of code_o/code_i writes `<program></f><i><input></i>`; students answer the
    opened tag; the code_f teacher writes inputs and a message for a given program.
    """
    caps = prompts.Caps()
    for t in tasks:
        if t.type == "code_f":
            yield prompts.teacher_f([], t, len(t.inputs), "compact", caps) + (
                "</i><i>".join(t.inputs) + f"</i><m>{t.message}</m>"
            )
            shown = list(zip(t.inputs, t.outputs, strict=True))[0::2]
            yield prompts.student_f(shown, t.message, "compact") + f"{t.program}</f>"
            continue
        yield prompts.teacher_io(t.type, [], "compact", caps) + f"{t.program}</f><i>{t.input}</i>"
        yield prompts.student_o(t, "compact") + f"{t.output}</o>"
        yield prompts.student_i(t, "compact") + f"{t.input}</i>"
