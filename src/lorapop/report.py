"""`lorapop report RUN_DIR`: one self-contained HTML page of plots from a run's metrics.jsonl.

Plots are PNGs embedded as base64 so the page can be mailed or attached to a paper draft.
"""

from __future__ import annotations

import base64
import html
import io
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

PROGRAM_METRICS = ("ast_depth", "cyclomatic", "loc", "variables")


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"no metrics.jsonl in {run_dir}")
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut by a kill mid-write; resume rewrites the file
    return rows


def _png(fig: plt.Figure) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def plot_ratings(rows: list[dict]) -> str:
    fig, ax = plt.subplots(figsize=(7, 3.5))
    series: dict[str, list[tuple[int, float, float]]] = defaultdict(list)
    for r in rows:
        for name, m in r.get("members", {}).items():
            if m.get("mu") is not None:
                series[name].append((r["step"], m["mu"], m["sigma"]))
    for name, pts in sorted(series.items()):
        steps, mu, sigma = zip(*pts, strict=True)
        line = ax.plot(steps, mu, label=name, ls="-" if name.startswith("T") else "--")[0]
        lo = [m - s for m, s in zip(mu, sigma, strict=True)]
        hi = [m + s for m, s in zip(mu, sigma, strict=True)]
        ax.fill_between(steps, lo, hi, color=line.get_color(), alpha=0.1)
    ax.set(xlabel="step", ylabel="TrueSkill μ (band ±σ)", title="Ratings per member")
    if series:
        ax.legend(fontsize=7, ncol=2)
    return _png(fig)


def plot_matchups(rows: list[dict]) -> str:
    solved: dict[tuple[str, str], list[float]] = defaultdict(list)
    for r in rows:
        for m in r.get("matchups", []):
            cell = solved[(m["teacher"], m["student"])]  # pairs without a valid task show "–"
            if m.get("solve_rate") is not None:
                cell.append(m["solve_rate"])
    teachers = sorted({t for t, _ in solved})
    students = sorted({s for _, s in solved})
    fig, ax = plt.subplots(figsize=(1.2 + 0.8 * max(1, len(students)), 1 + 0.6 * max(1, len(teachers))))
    grid = [[float("nan")] * len(students) for _ in teachers]
    for (t, s), v in solved.items():
        if v:
            grid[teachers.index(t)][students.index(s)] = sum(v) / len(v)
    if teachers and students:
        im = ax.imshow(grid, vmin=0, vmax=1, cmap="viridis")
        fig.colorbar(im, ax=ax, label="mean solve rate")
        for i, row in enumerate(grid):
            for j, v in enumerate(row):
                label, color = (f"{v:.2f}", "w") if v == v else ("–", "k")
                ax.text(j, i, label, ha="center", va="center", color=color, fontsize=8)
    ax.set_xticks(range(len(students)), students)
    ax.set_yticks(range(len(teachers)), teachers)
    ax.set(xlabel="student", ylabel="teacher", title="Solve rate per matchup")
    return _png(fig)


def _program_series(rows: list[dict], key: str) -> list[tuple[int, float]]:
    """Per step: the mean of `key` over task types (coverage: the sum over types)."""
    pts = []
    for r in rows:
        vals = [m[key] for m in r.get("programs", {}).values() if m.get(key) is not None]
        if vals:
            pts.append((r["step"], sum(vals) if key == "coverage" else sum(vals) / len(vals)))
    return pts


def plot_programs(runs: dict[str, list[dict]]) -> str:
    """Teacher program complexity and coverage over time, one line per run."""
    keys = (*PROGRAM_METRICS, "coverage")
    fig, axes = plt.subplots(1, len(keys), figsize=(3 * len(keys), 2.8))
    for ax, key in zip(axes, keys, strict=True):
        for label, rows in runs.items():
            pts = _program_series(rows, key)
            if pts:
                ax.plot(*zip(*pts, strict=True), label=label)
        ax.set(title=key, xlabel="step")
    if axes[0].get_legend_handles_labels()[0]:
        axes[0].legend(fontsize=7)
    fig.suptitle("Valid teacher programs: mean over task types (coverage: distinct signatures)")
    return _png(fig)


def summarize(rows: list[dict], last: int = 5) -> dict[str, float | None]:
    """Means over the last `last` steps: what the demo prints and the experiment compares."""
    tail = rows[-last:]

    def mean(vals: list) -> float | None:
        vals = [v for v in vals if v is not None]
        return sum(vals) / len(vals) if vals else None

    members = [m for r in tail for m in r["members"].values()]
    out = {
        "valid_rate": mean([m.get("valid_rate") for m in members]),
        "solve_rate": mean([m.get("solve_rate") for m in members]),
    }
    for key in PROGRAM_METRICS:
        out[key] = mean([v for _, v in _program_series(tail, key)])
    cov = _program_series(rows, "coverage")
    out["coverage"] = cov[-1][1] if cov else None
    return out


def summary_table(run_dir: str | Path, baseline_dir: str | Path | None = None) -> str:
    """A plain-text comparison of a run (and its baseline) over the last steps."""
    runs = {"population": Path(run_dir)}
    if baseline_dir is not None:
        runs["baseline"] = Path(baseline_dir)
    stats = {k: summarize(read_metrics(d)) for k, d in runs.items()}
    keys = list(next(iter(stats.values())))
    lines = [f"{'last 5 steps':14s}" + "".join(f"{k:>12s}" for k in stats)]
    for key in keys:
        cells = "".join(
            f"{v:12.3f}" if (v := stats[k][key]) is not None else f"{'-':>12s}" for k in stats
        )
        lines.append(f"{key:14s}{cells}")
    return "\n".join(lines)


def plot_phases(rows: list[dict]) -> str:
    order = ("matchmaking", "proposal", "verification", "solving", "update", "replacement")
    seen = {p for r in rows for p in r.get("phase_s", {})}
    phases = [p for p in order if p in seen] + sorted(seen - set(order))
    fig, ax = plt.subplots(figsize=(7, 3))
    steps = [r["step"] for r in rows]
    bottom = [0.0] * len(rows)
    for p in phases:
        vals = [r.get("phase_s", {}).get(p, 0.0) for r in rows]
        ax.bar(steps, vals, bottom=bottom, label=p)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax.set(xlabel="step", ylabel="seconds", title="Wall time per phase")
    if phases:
        ax.legend(fontsize=7)
    return _png(fig)


def _replacement_table(rows: list[dict]) -> str:
    items = [(r["step"], x) for r in rows for x in r.get("replacements", [])]
    if not items:
        return "<p>No replacements yet.</p>"
    body = "".join(
        f"<tr><td>{s}</td><td>{html.escape(x['target'])}</td>"
        f"<td>{html.escape(', '.join(x['parents']))}</td><td>{html.escape(x['operator'])}</td></tr>"
        for s, x in items
    )
    return f"<table><tr><th>step</th><th>replaced</th><th>parents</th><th>operator</th></tr>{body}</table>"


def markdown_table(text: str) -> str:
    """The pipe tables of a markdown text as HTML tables (other lines are dropped)."""
    out, rows = [], []
    for line in [*text.splitlines(), ""]:
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if not all(set(c) <= set("-: ") for c in cells):
                rows.append(cells)
        elif rows:
            head, *body = rows
            out.append("<table><tr>" + "".join(f"<th>{html.escape(c)}</th>" for c in head)
                       + "</tr>" + "".join("<tr>" + "".join(
                           f"<td>{html.escape(c.strip('*'))}</td>" for c in r) + "</tr>"
                           for r in body) + "</table>")
            rows = []
    return "".join(out)


def write_report(run_dir: str | Path, extra_html: str = "") -> Path:
    """Write RUN_DIR/report.html and return its path."""
    run_dir = Path(run_dir)
    rows = read_metrics(run_dir)
    if not rows:
        raise ValueError(f"{run_dir}/metrics.jsonl has no complete step yet")
    runs = {"population" if rows[-1]["members"].keys() - {"A0"} else "baseline": rows}
    baseline = run_dir / "baseline"
    if (baseline / "metrics.jsonl").is_file():
        runs["baseline (single agent)"] = read_metrics(baseline)
        extra_html = (f"<h2>Population vs baseline</h2><pre>"
                      f"{html.escape(summary_table(run_dir, baseline))}</pre>{extra_html}")
    evaluation = run_dir / "eval" / "eval.md"
    if evaluation.is_file():
        extra_html += "<h2>Benchmarks (lorapop eval)</h2>" + markdown_table(evaluation.read_text())
    figures = [
        ("Ratings", plot_ratings(rows)),
        ("Matchups", plot_matchups(rows)),
        ("Program complexity and coverage", plot_programs(runs)),
        ("Phase timings", plot_phases(rows)),
    ]
    last = rows[-1]
    imgs = "".join(
        f"<h2>{t}</h2><img src='data:image/png;base64,{b}'/>" for t, b in figures
    )
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>lorapop report</title>
<style>body{{font-family:sans-serif;max-width:1100px;margin:auto}}
table{{border-collapse:collapse}}td,th{{border:1px solid #ccc;padding:2px 6px}}</style></head>
<body><h1>lorapop run: {html.escape(str(run_dir))}</h1>
<p>{len(rows)} steps logged; last step {last['step']}.</p>{imgs}
<h2>Replacement history</h2>{_replacement_table(rows)}{extra_html}</body></html>"""
    out = run_dir / "report.html"
    out.write_text(page)
    return out
