"""Check the scoring path on the benchmarks' own answers: every canonical HumanEval+/MBPP+
solution and every math gold answer must score 100% through the code that scores models.

    python -m lorapop.evals.selfcheck --data-dir ../shared/data [--limit N] [--bench NAME ...]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from lorapop.evals import codecheck, data
from lorapop.evals.pool import Pool


def check_code(bench: str, data_dir: str, limit: int | None, workers: int) -> list[str]:
    ps = data.load(bench, data_dir, limit=limit)
    with Pool(workers=workers) as pool:
        items = [(p, f"```python\n{p.meta['canonical']}\n```") for p in ps]
        res = codecheck.score(items, pool)
    return [f"{p.id}: {r['reason']}" for p, r in zip(ps, res, strict=True) if not r["passed"]]


def check_math(bench: str, data_dir: str, limit: int | None) -> list[str]:
    from lorapop.evals.mathcheck import check

    ps = data.load(bench, data_dir, limit=limit)
    text = "<think>...</think> <answer>\\boxed{{{}}}</answer>"
    return [f"{p.id}: {p.answer!r}" for p in ps if not check(text.format(p.answer), p.answer).correct]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--bench", nargs="*", default=["humanevalplus", "mbppplus", *data.MATH])
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args(argv)
    report = {}
    for b in args.bench:
        t = time.perf_counter()
        try:
            if data.BENCHES[b].group == "math":
                bad = check_math(b, args.data_dir, args.limit)
            else:
                bad = check_code(b, args.data_dir, args.limit, args.workers)
        except (data.DataError, KeyError) as e:
            print(f"{b}: {e}", file=sys.stderr)
            return 2
        report[b] = bad
        print(f"{b}: {len(bad)} failing, {time.perf_counter() - t:.1f}s", flush=True)
        for line in bad:
            print("   ", line)
    print(json.dumps({b: len(v) for b, v in report.items()}))
    return 1 if any(report.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
