"""Module policies: which modules a job may import, and which names are refused statically.

The OS-level confinement (uid, namespaces, rlimits, clean env, timeouts) is the same under every
policy; a policy only decides what Python a job sees. Children cannot import anything new (the
import system is off), so `modules` is exactly what a job can import, pre-imported once by the
fork server (an import is then a dict lookup in the child).

- `azr`: Absolute Zero Reasoner's validity rules for self-play tasks: its banned list is refused
  before running, and the banned modules are hidden from jobs at run time too.
- `benchmark`: scoring benchmark programs as evalplus / LiveCodeBench run them: canonical and
  model solutions import random, hashlib, time, ..., so nothing is refused statically and
  only the sandbox's own package is hidden.
"""

from __future__ import annotations

from dataclasses import dataclass

from lorapop.verify.static import BANNED

#: Pure-compute stdlib modules every job may import (AZR's allowed set, roughly).
BASE_MODULES: tuple[str, ...] = (
    "abc", "array", "base64", "binascii", "bisect", "cmath", "collections", "collections.abc",
    "contextlib", "copy", "dataclasses", "decimal", "difflib", "enum", "fractions", "functools",
    "graphlib", "heapq", "itertools", "json", "keyword", "math", "numbers", "operator", "pprint",
    "re", "reprlib", "statistics", "string", "struct", "textwrap", "types", "typing",
    "unicodedata", "zlib", "encodings.ascii", "encodings.latin_1", "encodings.utf_16",
    "encodings.utf_32", "encodings.cp1252", "encodings.idna", "encodings.unicode_escape",
    "encodings.raw_unicode_escape", "encodings.punycode", "encodings.hex_codec",
    "encodings.base64_codec", "encodings.rot_13",
)  # fmt: skip

#: What benchmark solutions import beyond that (HumanEval/39 random, /162 hashlib; LiveCodeBench's
#: header: datetime, random, io, sys). No threading/logging/queue: their at-fork hooks would
#: cost every job, and threads cannot start anyway (RLIMIT_NPROC).
BENCHMARK_EXTRA: tuple[str, ...] = (
    "ast", "calendar", "datetime", "hashlib", "hmac", "io", "random", "secrets", "time",
)  # fmt: skip

#: Top-level names the server loads for its own work; hidden from azr jobs (banned or pointless).
AZR_HIDDEN: tuple[str, ...] = (
    "lorapop", "subprocess", "_posixsubprocess", "selectors", "threading", "multiprocessing",
    "logging", "ctypes", "_ctypes", "socket", "_socket", "random", "time", "datetime",
    "hashlib", "hmac", "calendar", "resource", "shutil",
)  # fmt: skip


@dataclass(frozen=True)
class Policy:
    """banned: dotted names refused before running (static, `lorapop.verify.static`);
    ban_input: refuse calls of `input()`; modules: pre-imported, the only ones a job can import;
    hidden: top-level package names removed from the job's `sys.modules` (a prefix match on the
    first dotted component, so hiding `random` also hides what `modules` imported of it)."""

    name: str
    banned: tuple[str, ...]
    ban_input: bool
    modules: tuple[str, ...]
    hidden: tuple[str, ...]


AZR = Policy("azr", BANNED, True, BASE_MODULES, AZR_HIDDEN)
BENCHMARK = Policy("benchmark", (), False, BASE_MODULES + BENCHMARK_EXTRA, ("lorapop",))
POLICIES: dict[str, Policy] = {p.name: p for p in (AZR, BENCHMARK)}


def resolve(policy: str | Policy) -> Policy:
    """A policy by name (or itself); ValueError for an unknown name."""
    if isinstance(policy, Policy):
        return policy
    try:
        return POLICIES[policy]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown sandbox policy {policy!r} (known: {', '.join(POLICIES)})"
        ) from None
