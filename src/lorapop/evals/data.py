"""Benchmark loaders for the official file formats.

Each loader turns one record into a `Problem`. Files are read from a data directory laid out as
in `shared/data/README.md` (`humanevalplus/HumanEvalPlus-v0.1.10.jsonl.gz`, ...), or from the
Hugging Face Hub through the optional `datasets` library (`hf:org/name[:split]`).
"""

from __future__ import annotations

import base64
import gzip
import io
import json
import pickle
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lorapop.evals.extract import last_boxed


class DataError(ValueError):
    """A benchmark cannot be found or read; the message is one line."""


@dataclass
class Problem:
    bench: str
    id: str
    kind: str  # "code" (evalplus) | "lcb" | "crux_o" | "crux_i" | "math"
    question: str  # the problem as shown to the model (before any prompt template)
    answer: Any = None  # math: gold answer (str); crux: gold output / input source
    meta: dict[str, Any] = field(default_factory=dict)


def _rows(path: Path) -> Iterator[dict[str, Any]]:
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            if path.suffix == ".json":
                yield from json.load(f)
                return
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        yield json.loads(line)
                    except json.JSONDecodeError as e:
                        raise DataError(f"{path}:{n}: not JSON ({e.msg})") from None
    except OSError as e:
        raise DataError(f"cannot read {path}: {e.strerror or e}") from None


# --- code generation (evalplus) ------------------------------------------------------------

#: evalplus' `mbpp_deserialize_inputs`: JSON has no tuples/sets/complex, MBPP+ needs them back.
_MBPP_TUPLE_ARGS = {2, 116, 132, 143, 222, 261, 273, 394, 399, 421, 424, 429, 470, 560, 579, 596,
                    616, 630, 726, 740, 744, 809}  # fmt: skip
_MBPP_TUPLE_LISTS = {63, 64, 70, 94, 120, 237, 272, 299, 400, 409, 417, 438, 473, 614, 780}
_MBPP_FIRST_TUPLE_LIST = {75, 413, 444, 753}
_MBPP_FIRST_TUPLE = {250, 405, 446, 617, 720, 763, 808}


def _deep_tuple(x: Any) -> Any:
    return tuple(_deep_tuple(i) for i in x) if isinstance(x, list) else x


def mbpp_inputs(task_id: str, inputs: list) -> list:
    """Restore the Python types of MBPP+ test inputs exactly as evalplus does."""
    n = int(task_id.split("/")[-1])
    if n in _MBPP_TUPLE_ARGS:
        return [[tuple(a) for a in inp] for inp in inputs]
    if n in _MBPP_TUPLE_LISTS:
        return [[[tuple(x) for x in a] for a in inp] for inp in inputs]
    if n in _MBPP_FIRST_TUPLE_LIST:
        return [[[tuple(x) for x in inp[0]], inp[1]] for inp in inputs]
    if n in (106, 750):
        return [[inp[0], tuple(inp[1])] for inp in inputs]
    if n == 115:
        return [[[set(x) if isinstance(x, list) and x else {} for x in inp[0]]] for inp in inputs]
    if n == 124:
        return [(float(inp[0]), complex(inp[1])) for inp in inputs]
    if n in _MBPP_FIRST_TUPLE:
        return [[tuple(inp[0]), *inp[1:]] for inp in inputs]
    if n in (259, 401, 445):
        return [[tuple(tuple(x) for x in a) for a in inp] for inp in inputs]
    if n == 278:
        return [[tuple(tuple(x) if isinstance(x, list) else x for x in inp[0])] for inp in inputs]
    if n == 307:
        return [[tuple(inp[0]), inp[1], inp[2]] for inp in inputs]
    if n == 722:
        return [[{k: tuple(v) for k, v in inp[0].items()}, *inp[1:]] for inp in inputs]
    if n == 252:
        return [[complex(inp[0])] for inp in inputs]
    if n in (580, 615, 791):
        return [_deep_tuple(inp) for inp in inputs]
    return inputs


def _evalplus(bench: str, mbpp: bool) -> Callable[[dict], Problem]:
    def make(r: dict) -> Problem:
        tid = r["task_id"]
        base, plus = r["base_input"], r["plus_input"] or []
        if mbpp:
            base, plus = mbpp_inputs(tid, base), mbpp_inputs(tid, plus)
        return Problem(
            bench, tid, "code", r["prompt"],
            meta={"entry_point": r["entry_point"], "canonical": r["prompt"] + r["canonical_solution"],
                  "base_input": base, "plus_input": plus, "atol": float(r.get("atol") or 0),
                  "dataset": "mbpp" if mbpp else "humaneval"},
        )  # fmt: skip

    return make


# --- LiveCodeBench (code_generation_lite) ---------------------------------------------------

#: release_v5 covers contests from 2023-05-01 to 2025-01-31 (880 problems).
LCB_V5_WINDOW = ("2023-05-01", "2025-01-31")


class _StrOnly(pickle.Unpickler):
    """LCB stores private tests as base64(zlib(pickle(json str))); allow no globals at all,
    so a hostile file cannot make unpickling run code."""

    def find_class(self, module: str, name: str) -> Any:
        raise DataError(f"refusing to unpickle {module}.{name}")


def lcb_tests(blob: str | list) -> list[dict[str, str]]:
    """Decode `public_test_cases` / `private_test_cases` (plain JSON or the compressed form)."""
    if isinstance(blob, list):
        return blob
    try:
        return json.loads(blob)
    except json.JSONDecodeError:
        raw = zlib.decompress(base64.b64decode(blob.encode()))
        text = _StrOnly(io.BytesIO(raw)).load()
        if not isinstance(text, str):
            raise DataError("private_test_cases does not decode to a JSON string") from None
        return json.loads(text)


def _lcb(bench: str) -> Callable[[dict], Problem]:
    def make(r: dict) -> Problem:
        meta = json.loads(r.get("metadata") or "{}")
        tests = lcb_tests(r["public_test_cases"]) + lcb_tests(r.get("private_test_cases") or "[]")
        return Problem(
            bench, str(r["question_id"]), "lcb", r["question_content"],
            meta={"starter_code": r.get("starter_code") or "", "func_name": meta.get("func_name"),
                  "tests": tests, "platform": r.get("platform"),
                  "contest_date": str(r.get("contest_date", ""))[:10],
                  "difficulty": r.get("difficulty")},
        )  # fmt: skip

    return make


# --- CRUXEval ---------------------------------------------------------------------------------


def _crux(bench: str, mode: str) -> Callable[[dict], Problem]:
    def make(r: dict) -> Problem:
        gold = r["output"] if mode == "o" else r["input"]
        return Problem(bench, r["id"], f"crux_{mode}", r["code"], gold,
                       meta={"input": r["input"], "output": r["output"]})  # fmt: skip

    return make


# --- math ---------------------------------------------------------------------------------------


def _num(x: Any) -> str:
    """AMC's `27.0` -> "27"; AIME's zero-padded "025" -> "25"."""
    if isinstance(x, float) and x.is_integer():
        return str(int(x))
    s = str(x).strip()
    return str(int(s)) if s.isdigit() else s


def _math(bench: str, q: str, gold: Callable[[dict], str]) -> Callable[[dict], Problem]:
    def make(r: dict) -> Problem:
        rid = next(r[k] for k in ("id", "unique_id", "idx", "_index") if r.get(k) is not None)
        question = r[q] if q in r else r.get("problem") or r["question"]
        if r.get("context"):
            question = f"{r['context']}\n\n{question}"
        return Problem(bench, str(rid), "math", question, gold(r))

    return make


def _gsm8k(r: dict) -> str:
    return r["answer"].split("####")[-1].strip().replace(",", "")


def _minerva(r: dict) -> str:
    boxed = last_boxed(r["solution"])
    if boxed is None:
        raise DataError("minerva record without \\boxed{} in its solution")
    return boxed


def _olympiad(r: dict) -> str:
    return ", ".join(a.strip().strip("$").strip() for a in r["final_answer"])


@dataclass(frozen=True)
class Bench:
    name: str
    group: str  # "code" | "math" | "crux" (reported, not in AZR's averages)
    path: str  # relative to the data dir
    make: Callable[[dict], Problem]


BENCHES: dict[str, Bench] = {
    b.name: b
    for b in [
        Bench("humanevalplus", "code", "humanevalplus/HumanEvalPlus-v0.1.10.jsonl.gz",
              _evalplus("humanevalplus", mbpp=False)),
        Bench("mbppplus", "code", "mbppplus/MbppPlus-v0.2.0.jsonl.gz",
              _evalplus("mbppplus", mbpp=True)),
        Bench("livecodebench", "code", "livecodebench", _lcb("livecodebench")),
        Bench("cruxeval_o", "crux", "cruxeval/cruxeval.jsonl", _crux("cruxeval_o", "o")),
        Bench("cruxeval_i", "crux", "cruxeval/cruxeval.jsonl", _crux("cruxeval_i", "i")),
        Bench("gsm8k", "math", "gsm8k/test.jsonl", _math("gsm8k", "question", _gsm8k)),
        Bench("math500", "math", "math500/test.jsonl",
              _math("math500", "problem", lambda r: r["answer"])),
        Bench("aime24", "math", "aime24/test.jsonl",
              _math("aime24", "problem", lambda r: _num(r["answer"]))),
        Bench("aime25", "math", "aime25/test.jsonl",
              _math("aime25", "problem", lambda r: _num(r["answer"]))),
        Bench("amc23", "math", "amc23/test.jsonl",
              _math("amc23", "question", lambda r: _num(r["answer"]))),
        Bench("minerva_math", "math", "minerva_math/test.jsonl",
              _math("minerva_math", "problem", _minerva)),
        Bench("olympiadbench", "math", "olympiadbench/test.jsonl",
              _math("olympiadbench", "question", _olympiad)),
    ]
}  # fmt: skip
CODE = ("humanevalplus", "mbppplus", "livecodebench")
MATH = ("aime24", "aime25", "amc23", "math500", "minerva_math", "olympiadbench", "gsm8k")


def _lcb_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    files = sorted(path.glob("*.jsonl")) + sorted(path.glob("*.jsonl.gz"))
    if not files:
        raise DataError(f"no LiveCodeBench *.jsonl files in {path}")
    return files


def _hub_rows(spec: str) -> Iterable[dict]:
    try:
        import datasets  # optional extra: pip install 'lorapop[datasets]'
    except ImportError:
        raise DataError("hub datasets need the optional extra: pip install 'lorapop[datasets]'") from None
    name, _, split = spec.partition(":")
    try:
        return datasets.load_dataset(name, split=split or "test")
    except Exception as e:  # network, missing id, bad split: one line
        raise DataError(f"cannot load hub dataset {spec!r}: {str(e).splitlines()[0]}") from None


def load(
    name: str,
    data_dir: str | Path | None = None,
    source: str | None = None,
    limit: int | None = None,
    window: tuple[str, str] = LCB_V5_WINDOW,
) -> list[Problem]:
    """Problems of benchmark `name`, from `source` (a file/dir path or `hf:org/name[:split]`)
    or from `data_dir/<default path>`; the first `limit` only when given."""
    if name not in BENCHES:
        raise DataError(f"unknown benchmark {name!r} (known: {', '.join(BENCHES)})")
    bench = BENCHES[name]
    if source and source.startswith("hf:"):
        rows: Iterable[dict] = _hub_rows(source[3:])
    else:
        if source is None and data_dir is None:
            raise DataError(f"{name}: give a data directory (--data-dir) or a source")
        path = Path(source) if source else Path(data_dir) / bench.path  # type: ignore[arg-type]
        if not path.exists():
            raise DataError(f"{name}: {path} does not exist")
        files = _lcb_files(path) if name == "livecodebench" else [path]
        rows = (r for f in files for r in _rows(f))
    out: list[Problem] = []
    for n, r in enumerate(rows):
        try:
            p = bench.make({**r, "_index": n})
        except (KeyError, TypeError, ValueError) as e:
            raise DataError(f"{name}: malformed record ({type(e).__name__}: {e})") from None
        if p.kind == "lcb" and not (window[0] <= p.meta["contest_date"] <= window[1]):
            continue
        out.append(p)
        if limit is not None and len(out) >= limit:
            break
    return out
