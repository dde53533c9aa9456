"""The tiny code world: a program grammar, verified tasks from it, the held-out benchmark and
the tokenizer of the embedded tiny model (`lorapop.tiny.tokenizer`, imported on its own because
it pulls in transformers)."""

from lorapop.tiny.generator import (
    KINDS,
    generate_tasks,
    generate_triples,
    normalize,
    program_split,
)
from lorapop.tiny.grammar import LEVELS, Knobs, Program, generate_input, generate_program
from lorapop.tiny.heldout import HELDOUT_SEED, build_heldout, fingerprint, load_jsonl, save_jsonl

__all__ = [
    "HELDOUT_SEED",
    "KINDS",
    "LEVELS",
    "Knobs",
    "Program",
    "build_heldout",
    "fingerprint",
    "generate_input",
    "generate_program",
    "generate_tasks",
    "generate_triples",
    "load_jsonl",
    "normalize",
    "program_split",
    "save_jsonl",
]
