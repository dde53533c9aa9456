"""Summaries and the markdown table: per benchmark, each member, population mean / best /
weakest, baseline and base; code, math and overall averages as AZR reports them (code: mean of
HumanEval+, MBPP+, LiveCodeBench; math: mean of the math benchmarks run; overall: mean of the
two). CRUXEval rows are shown but stay out of the averages, as in AZR.
"""

from __future__ import annotations

from typing import Any

from lorapop.evals.data import CODE, MATH

BASE = "base"
BASELINE = "baseline"


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def summarize(scores: dict[str, dict[str, float]], roles: dict[str, str]) -> dict[str, Any]:
    """scores: bench -> member -> pass@1 in [0, 1]; roles: member -> "member"|"baseline"|"base".

    Returns rows (bench or average name -> member -> score), the population columns and the
    names of the best and weakest members (by overall average)."""
    rows: dict[str, dict[str, float]] = {b: dict(s) for b, s in scores.items()}
    names = list(roles)
    for avg, group in (("code avg", CODE), ("math avg", MATH)):
        benches = [b for b in group if b in scores]
        if benches:
            rows[avg] = {m: _mean([scores[b][m] for b in benches]) for m in names}  # type: ignore[misc]
    parts = [rows[a] for a in ("code avg", "math avg") if a in rows]
    if parts:
        rows["overall"] = {m: _mean([p[m] for p in parts]) for m in names}  # type: ignore[misc]
    pop = [m for m in names if roles[m] == "member"]
    rank_row = rows.get("overall") or (rows[next(iter(scores))] if scores else {})
    best = max(pop, key=lambda m: rank_row[m]) if pop and rank_row else None
    weakest = min(pop, key=lambda m: rank_row[m]) if pop and rank_row else None
    for row in rows.values():
        if pop:
            row["pop. mean"] = _mean([row[m] for m in pop])  # type: ignore[assignment]
    return {"rows": rows, "population": pop, "best": best, "weakest": weakest}


def markdown(summary: dict[str, Any], roles: dict[str, str]) -> str:
    """A GitHub markdown table of pass@1 (%)."""
    rows, pop = summary["rows"], summary["population"]
    cols: list[tuple[str, str]] = [(m, m) for m in pop]
    if pop:
        cols += [("pop. mean", "pop. mean"), (f"best ({summary['best']})", summary["best"]),
                 (f"weakest ({summary['weakest']})", summary["weakest"])]  # fmt: skip
    cols += [(m, m) for m in roles if roles[m] == BASELINE]
    cols += [(m, m) for m in roles if roles[m] == BASE]
    order = [b for b in (*CODE, "code avg", *MATH, "math avg", "overall") if b in rows]
    order += [b for b in rows if b not in order]
    lines = ["| benchmark | " + " | ".join(c for c, _ in cols) + " |",
             "|---|" + "---:|" * len(cols)]  # fmt: skip
    for b in order:
        cells = []
        for _, key in cols:
            v = rows[b].get(key)
            cells.append("–" if v is None else f"{100 * v:.1f}")
        name = f"**{b}**" if b in ("code avg", "math avg", "overall") else b
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
