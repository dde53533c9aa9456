"""A large pretraining corpus, fast: grammar programs generated and run by worker processes.

The sandbox (`lorapop.verify`) exists for model text; at ~1k runs a second it bounds a corpus to
thousands of programs. The programs here are our grammar's own output (`generator.candidate`,
`grammar.extend_program`), never model text, so worker processes run them directly: each run
under a wall-clock timer and the worker under an address-space limit, so a program that loops,
grows without bound or raises is dropped, as the sandbox would drop it (the grammar rules out
hash-seed dependence, so one run per input stands for the sandbox's two). Workers are forked
(callers need no `__main__` guard) and run pure Python, never torch or CUDA; results are ordered
by candidate index, so the corpus is a function of the arguments whatever the number of workers.

`generate_corpus` gives what `build_corpus` would (code_f tasks of the train split, first `n`
distinct passing candidates per level); `generate_variants_fast` what `generate_variants` would.
"""

from __future__ import annotations

import resource
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from multiprocessing import get_context
from typing import Any

from lorapop.tasks.task import Task
from lorapop.tiny.generator import (
    acceptable,
    candidate,
    generate_variants,
    make_task,
    normalize,
)
from lorapop.tiny.grammar import Level, level_number
from lorapop.verify import Job, Status, Verdict

#: Address space a worker may add to what it holds after start (bytes).
WORKER_MEMORY = 1 << 30


class _Timeout(Exception):
    pass


def _alarm(signum: int, frame: object) -> None:
    raise _Timeout


class TrustedRunner:
    """Runs grammar programs in this process with a timer per job: for worker processes only.

    The `Runner` interface of the sandbox (`run(jobs) -> verdicts`), without its isolation: it
    must never see model text. Jobs' `deterministic` flag is ignored (see module doc)."""

    def __init__(self, timeout_s: float = 1.0, max_output_chars: int = 100_000) -> None:
        self.timeout_s, self.max_output_chars = timeout_s, max_output_chars
        self._code: tuple[str, Any] = ("", None)  # the last program compiled (jobs come grouped)
        signal.signal(signal.SIGALRM, _alarm)

    def run(self, jobs: Sequence[Job]) -> list[Verdict]:
        return [self._one(j) for j in jobs]

    def _one(self, job: Job) -> Verdict:
        t0 = time.perf_counter()
        signal.setitimer(signal.ITIMER_REAL, job.timeout_s or self.timeout_s)
        try:
            if self._code[0] != job.program:
                self._code = (job.program, compile(job.program, "<grammar>", "exec"))
            ns: dict[str, Any] = {}
            exec(self._code[1], ns)  # noqa: S102 - grammar output only (class doc)
            text = repr(eval(job.expr, ns))  # noqa: S307
            status, error = Status.OK, None
        except _Timeout:
            status, text, error = Status.TIMEOUT, None, "timer"
        except MemoryError:
            status, text, error = Status.MEMORY, None, "MemoryError"
        except Exception as e:  # the program raised: rejected, as in the sandbox
            status, text, error = Status.RUNTIME_ERROR, None, type(e).__name__
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        if text is not None and len(text) > self.max_output_chars:
            status, text, error = Status.OUTPUT_TOO_LARGE, None, "long repr"
        return Verdict(status, text, error, time.perf_counter() - t0)


def _limit_memory() -> None:
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    hard = resource.getrlimit(resource.RLIMIT_AS)[1]
    soft = vm + WORKER_MEMORY
    resource.setrlimit(resource.RLIMIT_AS, (soft if hard < 0 else min(soft, hard), hard))


def _corpus_chunk(
    level: int | Level, seed: str, start: int, stop: int, n_inputs: int, max_output_chars: int,
    timeout_s: float,
) -> list[tuple[str, Task]]:  # fmt: skip
    """(normalised program, code_f task) of candidates start..stop-1 that pass."""
    runner, out = TrustedRunner(timeout_s), []
    for i in range(start, stop):
        cand = candidate(level, seed, "train", n_inputs, i)
        if cand is None:
            continue
        vs = runner.run([Job(cand.program.source, f"f({x})") for x in cand.inputs])
        if acceptable(vs, max_output_chars, level):
            task = make_task("code_f", cand, [v.output or "" for v in vs], seed, "train")
            out.append((normalize(task.program), task))
    return out


def _variant_chunk(anchors: list[Task], seed: str, offset: int, timeout_s: float,
                   table: str) -> list[tuple[Task, Task]]:  # fmt: skip
    return generate_variants(anchors, seed, TrustedRunner(timeout_s), offset=offset, table=table)


def _pool(workers: int) -> ProcessPoolExecutor:
    return ProcessPoolExecutor(workers, mp_context=get_context("fork"), initializer=_limit_memory)


def _ordered(pool: ProcessPoolExecutor, calls: Iterator[tuple[Callable, tuple]],
             window: int) -> Iterator[Any]:  # fmt: skip
    """Results of `calls` in order, at most `window` in flight; stop early by closing it."""
    pending: list[Future] = []
    try:
        for fn, args in calls:
            pending.append(pool.submit(fn, *args))
            if len(pending) >= window:
                yield pending.pop(0).result()
        while pending:
            yield pending.pop(0).result()
    finally:
        for f in pending:
            f.cancel()


def generate_corpus(
    n_per_level: int, seed: str, *, levels: Sequence[int | Level] = (1, 2, 3, 4, 5),
    workers: int = 2,
    n_inputs: int = 6, max_output_chars: int = 60, timeout_s: float = 1.0, chunk: int = 256,
    log: Callable[[str], None] | None = None,
) -> list[Task]:  # fmt: skip
    """`n_per_level` code_f tasks per level: the first distinct passing candidates of stream
    `seed`, the candidates `generate_tasks("code_f", ..., seed)` draws."""
    if n_per_level < 1 or workers < 1 or chunk < 1:
        raise ValueError("n_per_level, workers and chunk must be >= 1")
    out: list[Task] = []
    chunk = max(8, min(chunk, n_per_level // (2 * workers)))  # little waste for a small corpus
    with _pool(workers) as pool:
        for level in levels:
            seen: set[str] = set()
            got: list[Task] = []
            starts = range(0, 200 * n_per_level, chunk)  # as generate_tasks' 100 * n, with room
            calls = ((_corpus_chunk, (level, seed, s, s + chunk, n_inputs, max_output_chars,
                                      timeout_s)) for s in starts)  # fmt: skip
            results = _ordered(pool, calls, 4 * workers)
            for part in results:
                for key, task in part:
                    if key not in seen and len(got) < n_per_level:
                        seen.add(key)
                        got.append(task)
                if len(got) == n_per_level:
                    results.close()  # cancels the chunks not started
                    break
            if len(got) < n_per_level:
                raise RuntimeError(f"level {level_number(level)}: only {len(got)} of "
                                   f"{n_per_level} programs")  # fmt: skip
            if log:
                log(f"corpus level {level_number(level)}: {len(got)} programs")
            out += got
    return out


def generate_variants_fast(
    anchors: Sequence[Task], seed: str, *, workers: int = 2, timeout_s: float = 1.0,
    chunk: int = 512, table: str = "standard",
) -> list[tuple[Task, Task]]:  # fmt: skip
    """`generate_variants(anchors, seed, ..., table=table)` computed by worker processes, in
    anchor order."""
    anchors = list(anchors)
    with _pool(workers) as pool:
        calls = ((_variant_chunk, (anchors[s : s + chunk], seed, s, timeout_s, table))
                 for s in range(0, len(anchors), chunk))  # fmt: skip
        return [pair for part in _ordered(pool, calls, 4 * workers) for pair in part]
