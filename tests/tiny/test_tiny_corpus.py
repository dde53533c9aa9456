"""The fast corpus: grammar programs run by worker processes give the sandbox's corpus."""

import pytest

from lorapop.tiny.corpus import (
    TrustedRunner,
    _limit_memory,
    _pool,
    generate_corpus,
    generate_variants_fast,
)
from lorapop.tiny.generator import generate_tasks, generate_variants
from lorapop.verify import Job, Status


def test_fast_corpus_and_variants_equal_the_sandbox_ones(tiny_sandbox) -> None:
    fast = generate_corpus(12, "c/0", levels=(1, 4), workers=2)
    slow = [t for lv in (1, 4) for t in generate_tasks("code_f", 12, lv, "c/0", sandbox=tiny_sandbox)]
    assert fast == slow
    assert fast == generate_corpus(12, "c/0", levels=(1, 4), workers=1, chunk=5)  # any split
    anchors = [t for t in fast if t.meta["difficulty"] == 1]
    variants = generate_variants_fast(anchors, "c/0", workers=2, chunk=5)
    assert variants == generate_variants(anchors, "c/0", tiny_sandbox) and variants


def _run_limited(jobs: list[Job]) -> list[Status]:
    _limit_memory()
    return [v.status for v in TrustedRunner(timeout_s=0.3).run(jobs)]


def test_trusted_runner_drops_programs_that_loop_raise_or_blow_up() -> None:
    jobs = [
        Job("def f(n):\n    return [n] * 3\n", "f(2)"),
        Job("def f(n):\n    while True:\n        n += 1\n", "f(0)"),
        Job("def f(n):\n    return 1 // n\n", "f(0)"),
        Job("def f(n):\n    return len('ab' * n)\n", "f(10**9)"),  # 2 GB: over the worker's limit
    ]
    with _pool(1) as pool:
        got = pool.submit(_run_limited, jobs).result()
    assert got == [Status.OK, Status.TIMEOUT, Status.RUNTIME_ERROR, Status.MEMORY]
    (ok,) = TrustedRunner().run(jobs[:1])
    assert ok.output == "[2, 2, 2]"  # the repr, as the sandbox reports it


def test_fast_corpus_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError):
        generate_corpus(0, "c/0")
