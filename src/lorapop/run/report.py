"""`lorapop report RUN_DIR`: the page a researcher opens first, as one self-contained HTML file.

From the top: run facts (command, config, version and commit, machine, start and wall time,
the update's kernels), the last steps' summary against the baseline, learning curves per
individual and per arm, ratings, the matchup heat map, program complexity, phase timings, the
replacement history, sampled tasks and answers from the rollout dumps, and `lorapop eval`
results.

Figures are SVG (embedded as data URIs, so the page can be mailed or attached); every time
plot shows the smoothed curve over the raw one drawn faint, and a dotted line at each
replacement. Rows of runs from before individuals were logged count every slot as
`<slot>.g0`. All model text is escaped: a proposal cannot write HTML into the page.
"""

from __future__ import annotations

import base64
import functools
import html
import io
import json
import math
import os
from collections import defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path
from statistics import fmean
from typing import Any

import matplotlib
from matplotlib.axes import Axes
from matplotlib.colors import Normalize
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from lorapop.run import rollouts, runinfo

PROGRAM_METRICS = ("ast_depth", "cyclomatic", "loc", "variables")
#: Per-member learning curves, in page order: key -> axis label. A key no row has is skipped.
CURVES = {
    "solve_rate": "student solve rate",
    "valid_rate": "valid proposals (teacher)",
    "task_solve_rate": "solve rate of own tasks (teacher)",
    "student_reward": "student reward",
    "teacher_reward": "teacher reward",
    "entropy": "entropy estimate (nats/token)",
    "kl": "KL to the base (nats/token)",
    "loss": "policy loss",
    "grad_norm": "gradient norm (before clip)",
    "response_tokens": "response length (tokens)",
    "answer_format_error_rate": "unparsable answers",
    "proposal_format_error_rate": "unparsable proposals",
}
PROGRAM_LABELS = {"ast_depth": "AST depth", "cyclomatic": "cyclomatic complexity",
                  "loc": "lines of code", "variables": "variables",
                  "coverage": "distinct structures (cumulative)"}
PHASES = ("matchmaking", "proposal", "verification", "solving", "update", "difficulty",
          "replacement")
COUNTS = frozenset({"coverage"})
SAMPLES_PER_ROLE = 3
SAMPLE_CHARS = 1200

#: The report's plot style, applied around each plot only (importing the module changes no
#: global matplotlib state: no backend, no rcParams; figures are plain `Figure` objects).
STYLE = {"svg.fonttype": "none", "font.size": 9, "axes.titlesize": 10,
         "axes.spines.top": False, "axes.spines.right": False}


def _styled(plot: Callable[..., str | None]) -> Callable[..., str | None]:
    @functools.wraps(plot)
    def run(*args: Any, **kwargs: Any) -> str | None:
        with matplotlib.rc_context(STYLE):
            return plot(*args, **kwargs)

    return run


# ---------------------------------------------------------------- reading a run
def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"no metrics.jsonl in {run_dir}")
    rows = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by a kill mid-write; resume rewrites the file
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            rows.append(row)
    return rows


def individual(slot: str, m: dict[str, Any]) -> str:
    """The individual a slot held at a step (rows from before lineage ids: `<slot>.g0`)."""
    return m.get("individual") or f"{slot}.g0"


def replacement_steps(rows: list[dict]) -> list[int]:
    return [r["step"] for r in rows if r.get("replacements")]


def smooth(values: list[float]) -> list[float]:
    """A centred moving average over ~1/10 of the points (at most 25), narrower at the ends."""
    half = min(12, len(values) // 20)
    out = []
    for i in range(len(values)):
        window = values[max(0, i - half): i + half + 1]
        out.append(sum(window) / len(window))
    return out


# ---------------------------------------------------------------- figure helpers
def _svg(fig: Figure) -> str:
    for ax in fig.axes:
        if ax.get_xlabel() == "step":
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    buf = io.BytesIO()
    fig.savefig(buf, format="svg", bbox_inches="tight")
    return base64.b64encode(buf.getvalue()).decode()


def _mark_replacements(ax: Axes, steps: Iterable[int]) -> None:
    for s in steps:
        ax.axvline(s, color="0.45", ls=":", lw=0.9, zorder=0)


def _line(ax: Axes, steps: list[int], values: list[float], **style: Any) -> None:
    """The smoothed curve over the raw values drawn faint."""
    if len(values) > 2:
        ax.plot(steps, values, color=style.get("color"), lw=0.8, alpha=0.3)
        values = smooth(values)
    ax.plot(steps, values, marker="o" if len(values) == 1 else None, ms=3, **style)


def _panels(n: int, ncols: int = 3, size: tuple[float, float] = (3.6, 2.5)):
    ncols = max(1, min(ncols, n))
    nrows = -(-n // ncols)
    fig = Figure(figsize=(size[0] * ncols, size[1] * nrows), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False)
    flat = list(axes.flat)
    for ax in flat[n:]:
        ax.set_visible(False)
    return fig, flat[:n]


def _segments(rows: list[dict], slot: str, key: str) -> list[tuple[str, list[int], list[float]]]:
    """A slot's values of `key` split where its individual changes: (id, steps, values)."""
    out: list[tuple[str, list[int], list[float]]] = []
    for r in rows:
        m = r.get("members", {}).get(slot)
        if m is None or not isinstance(m.get(key), (int, float)):
            continue
        ind = individual(slot, m)
        if not out or out[-1][0] != ind:
            out.append((ind, [], []))
        out[-1][1].append(r["step"])
        out[-1][2].append(float(m[key]))
    return out


def _slot_order(name: str) -> tuple[int, str]:
    """Teachers, then students, then others (the baseline's A0)."""
    return {"T": 0, "S": 1}.get(name[:1], 2), name


def _slots(rows: list[dict]) -> list[str]:
    return sorted({s for r in rows for s in r.get("members", {})}, key=_slot_order)


def _present(rows: list[dict], keys: Iterable[str]) -> list[str]:
    have = {k for r in rows for m in r.get("members", {}).values() for k, v in m.items()
            if isinstance(v, (int, float))}
    return [k for k in keys if k in have]


_STYLES = ("-", "--", ":", "-.")


def _colors(slots: list[str]) -> dict[str, Any]:
    cmap = matplotlib.colormaps.get_cmap("tab10" if len(slots) <= 10 else "tab20")
    return {s: cmap(i % cmap.N) for i, s in enumerate(slots)}


# ---------------------------------------------------------------- figures
@_styled
def plot_individuals(rows: list[dict]) -> str | None:
    """One panel per logged member metric; a line per individual, coloured by slot."""
    keys = _present(rows, CURVES)
    if not keys:
        return None
    slots = _slots(rows)
    colors = _colors(slots)
    events = replacement_steps(rows)
    per_individual = _per_individual(rows)
    fig, axes = _panels(len(keys))
    for ax, key in zip(axes, keys, strict=True):
        for slot in slots:
            for g, (ind, steps, vals) in enumerate(_segments(rows, slot, key)):
                _line(ax, steps, vals, color=colors[slot], lw=1.5,
                      ls=_STYLES[g % 4] if per_individual else "-",
                      label=ind if per_individual else slot)
        _mark_replacements(ax, events)
        ax.set(xlabel="step", ylabel=CURVES[key])
    fig.legend(*_unique(axes, by_slot=True), loc="outside right upper", fontsize=8,
               title="individual" if per_individual else "slot")
    return _svg(fig)


def arm_series(rows: list[dict], key: str, role: str | None = None) -> list[tuple[int, float]]:
    """Per step: the mean of a member metric over the members (of `role`) that logged it."""
    pts = []
    for r in rows:
        vals = [m[key] for m in r.get("members", {}).values()
                if isinstance(m.get(key), (int, float)) and (role is None or m.get("role") == role)]
        if vals:
            pts.append((r["step"], fmean(vals)))
    return pts


def role_series(rows: list[dict], key: str) -> dict[str, list[tuple[int, float]]]:
    """`arm_series` per role when teachers and students both log `key` (their means would
    mix two different policies' figures), else one series under ""."""
    roles = {m.get("role") for r in rows for m in r.get("members", {}).values()
             if isinstance(m.get(key), (int, float))}
    if {"teacher", "student"} <= roles:
        return {f" {role}s": arm_series(rows, key, role) for role in ("teacher", "student")}
    return {"": arm_series(rows, key)}


@_styled
def plot_arms(runs: dict[str, list[dict]]) -> str | None:
    """One panel per metric: the mean over each arm's members (population vs baseline), per
    role where both roles log the metric."""
    keys = _present([r for rows in runs.values() for r in rows], CURVES)
    return _arm_panels(runs, {k: CURVES[k] for k in keys}, role_series)


def _arm_panels(runs: dict[str, list[dict]], labels: dict[str, str],
                series: Callable[[list[dict], str], dict[str, list[tuple[int, float]]]],
                size: tuple[float, float] = (3.6, 2.5)) -> str | None:
    """One panel per key of `labels` (its y label), one line per run and series name from
    `series(rows, key)` (name "" for a run's only line; a second name is dashed)."""
    if not labels:
        return None
    fig, axes = _panels(len(labels), size=size)
    palette = matplotlib.colormaps.get_cmap("Dark2").colors
    line_style: dict[str, tuple[Any, str]] = {}  # each arm-and-role line its own colour and dash
    for ax, (key, ylabel) in zip(axes, labels.items(), strict=True):
        for label, rows in runs.items():
            for suffix, pts in series(rows, key).items():
                if pts:
                    name = label + suffix
                    if name not in line_style:
                        n = len(line_style)
                        line_style[name] = (palette[n % len(palette)], _STYLES[n % 4])
                    color, ls = line_style[name]
                    steps, vals = map(list, zip(*pts, strict=True))
                    _line(ax, steps, vals, color=color, lw=1.6, ls=ls, label=name)
            _mark_replacements(ax, replacement_steps(rows))
        ax.set(xlabel="step", ylabel=ylabel)
    fig.legend(*_unique(axes), loc="outside right upper", fontsize=8, title="arm")
    return _svg(fig)


def _unique(axes: list[Axes], by_slot: bool = False) -> tuple[list, list]:
    """Legend entries of all panels, once each (`by_slot`: T0.g0, T0.g2, T0.g10, T1.g0, ...)."""
    seen: dict[str, Any] = {}
    for ax in axes:
        for h, label in zip(*ax.get_legend_handles_labels(), strict=True):
            seen.setdefault(label, h)
    labels = sorted(seen, key=_individual_order) if by_slot else list(seen)
    return [seen[x] for x in labels], labels


def _individual_order(label: str) -> tuple[tuple[int, str], int]:
    slot, _, gen = label.partition(".g")
    return _slot_order(slot), int(gen) if gen.isdigit() else 0


#: Above this many individuals a legend lists slots and every individual of a slot is drawn
#: alike (the replacement lines show where one ends); below, each has its own line style.
MAX_LEGEND_INDIVIDUALS = 16


def _per_individual(rows: list[dict]) -> bool:
    ids = {individual(s, m) for r in rows for s, m in r.get("members", {}).items()}
    return len(ids) <= MAX_LEGEND_INDIVIDUALS


@_styled
def plot_ratings(rows: list[dict]) -> str | None:
    slots = [s for s in _slots(rows) if any(
        r["members"].get(s, {}).get("mu") is not None for r in rows)]
    if not slots:
        return None
    fig = Figure(figsize=(8, 3.6), layout="constrained")
    ax = fig.subplots()
    colors = _colors(slots)
    per_individual = _per_individual(rows)
    markers = "osD^v<>ph*"
    # thick lines first, thinner on top: members with equal ratings stay visible
    for i, slot in enumerate(slots):
        lw = 3.2 - 2.4 * i / max(1, len(slots) - 1)
        sigmas = _segments(rows, slot, "sigma")
        for g, (ind, steps, mu) in enumerate(_segments(rows, slot, "mu")):
            ax.plot(steps, mu, color=colors[slot], lw=lw,
                    ls=_STYLES[g % 4] if per_individual else "-",
                    marker=markers[i % len(markers)], ms=4, markevery=max(1, len(steps) // 8),
                    label=ind if per_individual else slot, alpha=0.9)
            sig = sigmas[g][2] if g < len(sigmas) else []
            if len(sig) == len(mu):
                ax.fill_between(steps, [m - s for m, s in zip(mu, sig, strict=True)],
                                [m + s for m, s in zip(mu, sig, strict=True)],
                                color=colors[slot], alpha=0.06)
    _mark_replacements(ax, replacement_steps(rows))
    ax.set(xlabel="step", ylabel="TrueSkill μ (band ±σ)")
    fig.legend(*_unique([ax], by_slot=True), loc="outside right upper", fontsize=8,
               title="individual" if per_individual else "slot")
    return _svg(fig)


@_styled
def plot_matchups(rows: list[dict]) -> str | None:
    solved: dict[tuple[str, str], list[float]] = defaultdict(list)
    for r in rows:
        for m in r.get("matchups", []):
            cell = solved[(m["teacher"], m["student"])]  # pairs without a valid task show "–"
            if isinstance(m.get("solve_rate"), (int, float)):
                cell.append(m["solve_rate"])
    teachers = sorted({t for t, _ in solved})
    students = sorted({s for _, s in solved})
    if not teachers:
        return None
    grid = [[float("nan")] * len(students) for _ in teachers]
    for (t, s), v in solved.items():
        if v:
            grid[teachers.index(t)][students.index(s)] = fmean(v)
    present = [v for row in grid for v in row if v == v]
    lo, hi = (min(present), max(present)) if present else (0.0, 1.0)
    if hi - lo < 0.02:  # one value (or nearly): a band around it keeps the colour meaningful
        lo, hi = max(0.0, lo - 0.05), min(1.0, hi + 0.05)
    norm = Normalize(lo, hi)
    fig = Figure(figsize=(2.2 + 0.9 * len(students), 1.2 + 0.6 * len(teachers)),
                 layout="constrained")
    ax = fig.subplots()
    im = ax.imshow(grid, norm=norm, cmap="viridis", aspect="auto")
    fig.colorbar(im, ax=ax, label=f"mean solve rate ({lo:.2f}–{hi:.2f} in this run)")
    for i, row in enumerate(grid):
        for j, v in enumerate(row):
            text, color = (f"{v:.2f}", "k" if norm(v) > 0.6 else "w") if v == v else ("–", "k")
            ax.text(j, i, text, ha="center", va="center", color=color, fontsize=9)
    ax.set_xticks(range(len(students)), students)
    ax.set_yticks(range(len(teachers)), teachers)
    ax.set(xlabel="student slot", ylabel="teacher slot")
    return _svg(fig)


def _program_series(rows: list[dict], key: str) -> list[tuple[int, float]]:
    """Per step: the mean of `key` over task types (coverage: the sum over types)."""
    pts = []
    for r in rows:
        vals = [m[key] for m in r.get("programs", {}).values()
                if isinstance(m.get(key), (int, float))]
        if vals:
            pts.append((r["step"], sum(vals) if key == "coverage" else fmean(vals)))
    return pts


@_styled
def plot_programs(runs: dict[str, list[dict]]) -> str | None:
    """Teacher program complexity and coverage over time, one line per run."""
    keys = [k for k in (*PROGRAM_METRICS, "coverage")
            if any(_program_series(rows, k) for rows in runs.values())]
    return _arm_panels(runs, {k: PROGRAM_LABELS[k] for k in keys},
                       lambda rows, k: {"": _program_series(rows, k)},
                       size=(3.4, 2.4))


def _difficulty_series(rows: list[dict], teacher: str | None = None) -> list[tuple[int, float]]:
    """Per measured step, the fixed solver's solve rate of the step's tasks (of `teacher`)."""
    pts = []
    for r in rows:
        d = r.get("difficulty") or {}
        v = d.get("solve_rate") if teacher is None else (d.get("by_teacher") or {}).get(teacher)
        if isinstance(v, (int, float)):
            pts.append((r["step"], float(v)))
    return pts


TYPE_CURVES = {"valid_rate": "valid proposals", "solve_rate": "student solve rate",
               "coverage": "distinct structures (cumulative)"}


def type_series(rows: list[dict], t: str, key: str) -> list[tuple[int, float]]:
    """Per step, one task type's valid rate (valid / proposed), solve rate or coverage."""
    pts = []
    for r in rows:
        m = r.get("programs", {}).get(t)
        if not isinstance(m, dict):
            continue
        v = (m["valid"] / m["proposed"] if key == "valid_rate" and m.get("proposed")
             else None if key == "valid_rate" else m.get(key))
        if isinstance(v, (int, float)):
            pts.append((r["step"], float(v)))
    return pts


@_styled
def plot_difficulty(runs: dict[str, list[dict]]) -> str | None:
    """The fixed solver's solve rate of the teachers' tasks (`difficulty` in metrics.jsonl):
    one line per arm, and one per teacher beside it. Falling: the tasks got harder."""
    if not any(_difficulty_series(rows) for rows in runs.values()):
        return None
    fig, axes = _panels(2, ncols=2, size=(4.6, 2.8))
    colors = dict(zip(runs, matplotlib.colormaps.get_cmap("Dark2").colors, strict=False))
    shades = matplotlib.colormaps.get_cmap("tab10").colors
    for k, (label, rows) in enumerate(runs.items()):
        pts = _difficulty_series(rows)
        if pts:
            steps, vals = map(list, zip(*pts, strict=True))
            _line(axes[0], steps, vals, color=colors[label], lw=1.6, label=label)
        teachers = sorted({t for r in rows for t in (r.get("difficulty") or {}).get("by_teacher", {})},
                          key=_slot_order)
        for i, t in enumerate(teachers):
            if pts := _difficulty_series(rows, t):
                steps, vals = map(list, zip(*pts, strict=True))
                _line(axes[1], steps, vals, color=shades[i % len(shades)], lw=1.2,
                      ls=("-", "--", ":", "-.")[k % 4], label=f"{label} {t}")
        for ax in axes:
            _mark_replacements(ax, replacement_steps(rows))
    solver = next((r["difficulty"].get("solver") for rows in runs.values() for r in rows
                   if r.get("difficulty")), "base")
    axes[0].set(xlabel="step", ylabel=f"{solver} solver's solve rate", title="per arm")
    axes[1].set(xlabel="step", ylabel=f"{solver} solver's solve rate", title="per teacher")
    for ax in axes:
        ax.legend(fontsize=7)
    return _svg(fig)


@_styled
def plot_task_types(runs: dict[str, list[dict]]) -> str | None:
    """Per task type: valid rate, solve rate and coverage, one line per arm and type."""
    types = sorted({t for rows in runs.values() for r in rows for t in r.get("programs", {})})
    keys = {k: v for k, v in TYPE_CURVES.items()
            if any(type_series(rows, t, k) for rows in runs.values() for t in types)}
    if not types or not keys:
        return None
    return _arm_panels(runs, keys, lambda rows, k: {f" {t}": type_series(rows, t, k)
                                                     for t in types})


@_styled
def plot_phases(rows: list[dict]) -> str | None:
    seen = {p for r in rows for p in r.get("phase_s", {})}
    if not seen:
        return None
    phases = [p for p in PHASES if p in seen] + sorted(seen - set(PHASES))
    fig = Figure(figsize=(8, 3), layout="constrained")
    ax = fig.subplots()
    steps = [r["step"] for r in rows]
    bottom = [0.0] * len(rows)
    for p in phases:
        vals = [float(r.get("phase_s", {}).get(p, 0.0)) for r in rows]
        ax.bar(steps, vals, bottom=bottom, label=p, width=0.85)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    _mark_replacements(ax, replacement_steps(rows))
    ax.set(xlabel="step", ylabel="seconds")
    fig.legend(loc="outside right upper", fontsize=8, title="phase")
    return _svg(fig)


# ---------------------------------------------------------------- text parts
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


def _cell(key: str, v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.0f}" if key in COUNTS else f"{v:.3f}"


def summary_table(run_dir: str | Path, baseline_dir: str | Path | None = None) -> str:
    """A plain-text comparison of a run (and its baseline) over the last steps."""
    runs = {"population": Path(run_dir)}
    if baseline_dir is not None:
        runs["baseline"] = Path(baseline_dir)
    stats = {k: summarize(read_metrics(d)) for k, d in runs.items()}
    keys = list(next(iter(stats.values())))
    lines = [f"{'last 5 steps':14s}" + "".join(f"{k:>12s}" for k in stats)]
    for key in keys:
        lines.append(f"{key:14s}" + "".join(f"{_cell(key, stats[k][key]):>12s}" for k in stats))
    return "\n".join(lines)


#: What the comparison table shows: key -> (label, higher is better).
COMPARED = {"solve_rate": ("student solve rate", True), "valid_rate": ("valid proposals", True),
            "coverage_per_task": ("distinct structures per proposed task", True),
            "coverage": ("distinct structures (cumulative)", True),
            "loc": ("lines of code", True), "cyclomatic": ("cyclomatic complexity", True)}


def _step_values(rows: list[dict], key: str) -> list[float]:
    """Per step of `rows`, the arm's value of a compared key."""
    if key in ("solve_rate", "valid_rate"):
        return [v for _, v in arm_series(rows, key)]
    if key == "coverage_per_task":
        out, proposed = [], 0
        for r in rows:
            progs = r.get("programs", {})
            proposed += sum(m.get("proposed") or 0 for m in progs.values())
            cov = [m["coverage"] for m in progs.values() if isinstance(m.get("coverage"), int)]
            if cov and proposed:
                out.append(sum(cov) / proposed)
        return out
    return [v for _, v in _program_series(rows, key)]


def _spread(vals: list[float]) -> tuple[float, float]:
    mean = fmean(vals)
    sd = math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)) if len(vals) > 1 else 0.0
    return mean, sd


def comparison_html(runs: dict[str, list[dict]], last: int = 5) -> str:
    """Population vs baseline at equal compute: each arm's mean ± sd over its last `last`
    steps (both arms train the same steps with the same per-adapter tokens; the generated
    tokens per adapter show it), with the direction of better and the difference."""
    names = list(runs)
    head = ["metric (last steps)", "better", *names, f"{names[0]} − {names[-1]}"]
    body = []
    for key, (label, up) in COMPARED.items():
        stats = {}
        for n, rows in runs.items():
            vals = _step_values(rows, key)
            vals = vals[-1:] if key == "coverage" else vals[-last:]
            if vals:
                stats[n] = _spread(vals)
        if not stats:
            continue
        cells = [f"{m:.3f} ± {sd:.3f}" if key != "coverage" else f"{m:.0f}"
                 for m, sd in (stats.get(n, (math.nan, 0.0)) for n in names)]
        diff = (stats[names[0]][0] - stats[names[-1]][0]
                if names[0] in stats and names[-1] in stats else math.nan)
        body.append([label, "↑ higher" if up else "↓ lower", *cells,
                     "–" if math.isnan(diff) else f"{diff:+.3f}"])
    tokens = []
    for rows in runs.values():
        adapters = max(1, len(rows[-1].get("members", {}))) if rows else 1
        tokens.append(f"{sum(r.get('generated_tokens') or 0 for r in rows) / adapters:,.0f}")
    body.append(["generated tokens per adapter (compute)", "equal", *tokens, ""])
    return (_table(head, body) + f"<p class='note'>Mean ± standard deviation over each arm's "
            f"last {last} steps of the per-step mean over its members (coverage: the last "
            "value; per proposed task: divided by the tasks the arm proposed so far).</p>")


def wilson(passed: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """The 95% Wilson score interval of a pass rate over n problems."""
    if n <= 0:
        return 0.0, 1.0
    centre = (passed + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(passed * (1 - passed) / n + z * z / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def eval_html(run_dir: Path) -> str | None:
    """`lorapop eval` results: pass@1 per member and benchmark with 95% intervals."""
    path = run_dir / "eval" / "eval.json"
    if path.is_file():
        try:
            result = json.loads(path.read_text())
            benches = result["benchmarks"]
        except (OSError, ValueError, KeyError, TypeError):
            benches = None
        if isinstance(benches, dict) and benches:
            members = list(result.get("members") or next(iter(benches.values()))["pass@1"])
            body = []
            for m in members:
                cells = []
                for b in benches.values():
                    p, n = b.get("pass@1", {}).get(m), int(b.get("n") or 0)
                    lo, hi = wilson(p, n) if p is not None else (0, 0)
                    cells.append("–" if p is None else f"{p:.3f} [{lo:.3f}, {hi:.3f}]")
                body.append([m, *cells])
            return (_table(["member", *(f"{b} (n={v.get('n')})" for b, v in benches.items())],
                           body)
                    + "<p class='note'>Greedy pass@1 [95% Wilson interval over the problems]."
                      "</p>")
    md = run_dir / "eval" / "eval.md"
    return markdown_table(md.read_text(errors="replace")) if md.is_file() else None


def _table(head: list[str], body: Iterable[Iterable[object]]) -> str:
    esc = html.escape
    return ("<table><tr>" + "".join(f"<th>{esc(h)}</th>" for h in head) + "</tr>"
            + "".join("<tr>" + "".join(f"<td>{esc(str(c))}</td>" for c in r) + "</tr>"
                      for r in body) + "</table>")


def _replacement_table(rows: list[dict]) -> str:
    items = [(r["step"], x) for r in rows for x in r.get("replacements", [])
             if isinstance(x, dict)]
    if not items:
        return "<p>No replacements in this run.</p>"
    head = ["step", "slot", "replaced", "child", "parents", "operator", "seed",
            "operator failed (fell back to copy)"]
    body = [[step, x.get("target", "?"), x.get("replaced") or "", x.get("child") or "",
             ", ".join(x.get("parents", [])), x.get("operator", ""), x.get("seed", ""),
             x.get("failed") or ""] for step, x in items]
    shown = [j for j in range(len(head)) if j < 2 or any(r[j] != "" for r in body)]
    return _table([head[j] for j in shown], ([r[j] for j in shown] for r in body))


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
            out.append(_table(head, [[c.strip("*") for c in r] for r in body]))
            rows = []
    return "".join(out)


def _facts(run_dir: Path, rows: list[dict]) -> str:
    sessions = runinfo.read(run_dir)
    facts: list[tuple[str, str]] = [("run directory", str(run_dir)),
                                    ("steps logged", f"{len(rows)} (last: {rows[-1]['step']})")]
    if sessions:
        first, last = sessions[0], sessions[-1]
        wall = runinfo.wall_seconds(sessions)
        m = last.get("machine", {})
        facts += [
            ("command", "\n".join(s.get("command", "?") for s in sessions)),
            ("lorapop", f"{last.get('lorapop', '?')} (commit {last.get('commit') or 'unknown'})"),
            ("started", first.get("start", "?")),
            ("last update", last.get("end", "?")),
            ("wall time", f"{wall / 3600:.2f} h ({len(sessions)} session"
                          f"{'s' if len(sessions) > 1 else ''})"),
            ("machine", ", ".join(str(x) for x in (
                m.get("host"), m.get("platform"), f"{m.get('cpus')} CPUs",
                "; ".join(m.get("gpus", [])) or "no GPU", f"Python {m.get('python')}",
                f"torch {m.get('torch')}") if x)),
        ]
        if "deterministic_kernels" in last:  # (`train.deterministic`; older runs lack it)
            op = last.get("no_deterministic_kernel")
            facts.append(("update kernels", "deterministic" if last["deterministic_kernels"] else
                          f"deterministic, but warn-only: no such kernel for {op}" if op else
                          "default (not bit-for-bit repeatable on GPU)"))
    else:
        facts.append(("command, machine, wall time", "not recorded (run from before run.json)"))
    body = "".join(f"<tr><th>{html.escape(k)}</th><td><pre>{html.escape(v)}</pre></td></tr>"
                   for k, v in facts)
    cfg = run_dir / "config.yaml"
    config = (f"<details><summary>config.yaml</summary><pre>"
              f"{html.escape(cfg.read_text(errors='replace'))}</pre></details>"
              if cfg.is_file() else "")
    return f"<table class='facts'>{body}</table>{config}"


# ---------------------------------------------------------------- rollout samples
def latest_rollouts(run_dir: Path) -> tuple[int, list[dict[str, Any]]] | None:
    files = []
    for p in (run_dir / "rollouts").glob("step_*.jsonl.gz"):
        digits = p.name[len("step_"):-len(".jsonl.gz")]
        if digits.isdigit():
            files.append((int(digits), p))
    for step, p in sorted(files, reverse=True):
        recs = rollouts.read(p)
        if recs:
            return step, recs
    return None


def pick_samples(recs: list[dict[str, Any]], role: str, k: int) -> list[dict[str, Any]]:
    """Up to k records of a role, spread over verdicts and task types (round robin)."""
    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for r in recs:
        if r.get("role") == role:
            groups[(str(r.get("verdict")), str(r.get("type")))].append(r)
    out: list[dict] = []
    queues = [groups[g] for g in sorted(groups)]
    while len(out) < k and any(queues):
        for q in queues:
            if q and len(out) < k:
                out.append(q.pop(0))
    return out


def _clip(text: object, n: int = SAMPLE_CHARS) -> str:
    s = text if isinstance(text, str) else json.dumps(text, indent=1)
    return s if len(s) <= n else s[:n] + f"\n… ({len(s) - n} more characters)"


def _sample_html(r: dict[str, Any]) -> str:
    esc = html.escape
    head = (f"<b>{esc(str(r.get('individual') or r.get('member')))}</b> · {esc(str(r.get('type')))}"
            f" · verdict <b>{esc(str(r.get('verdict')))}</b> · reward {_num(r.get('reward'))}"
            f" · advantage {_num(r.get('advantage'))}")
    parts = [f"<div class='sample'><p>{head}</p>"]
    for label, key in (("prompt", "prompt"), ("completion", "completion"),
                       ("parsed", "parsed")):
        if r.get(key) not in (None, ""):
            parts.append(f"<details{' open' if key != 'prompt' else ''}><summary>{label}"
                         f"</summary><pre>{esc(_clip(r[key]))}</pre></details>")
    return "".join(parts) + "</div>"


def _num(v: object) -> str:
    return f"{v:+.3f}" if isinstance(v, (int, float)) else "–"


def _samples(run_dir: Path) -> str:
    found = latest_rollouts(run_dir)
    if found is None:
        return ("<p>No rollouts saved (<code>run.rollouts=0</code>, or a run from before "
                "rollout dumps).</p>")
    step, recs = found
    roles = sorted({str(r.get("role")) for r in recs},
                   key=lambda x: ({"teacher": 0, "student": 1}.get(x, 2), x))
    out = [f"<p>From <code>rollouts/step_{step}.jsonl.gz</code> ({len(recs)} rollouts); "
           f"all steps' dumps lie in <code>{html.escape(str(run_dir / 'rollouts'))}</code>.</p>"]
    for role in roles:
        picked = pick_samples(recs, role, SAMPLES_PER_ROLE)
        out.append(f"<h3>{html.escape(role)}</h3>" + "".join(_sample_html(r) for r in picked))
    return "".join(out)


# ---------------------------------------------------------------- the page
CSS = """body{font-family:system-ui,sans-serif;max-width:1200px;margin:auto;padding:0 1em;
color:#222}h1{font-size:1.5em}h2{border-bottom:1px solid #ddd;padding-top:.5em}
table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ccc;padding:2px 8px;
text-align:left;vertical-align:top}table.facts th{white-space:nowrap}table.facts pre{margin:0;white-space:pre-wrap}
img{max-width:100%;height:auto}pre{white-space:pre-wrap;word-break:break-all;background:#f7f7f7;
padding:4px;margin:2px 0}.sample{border-left:3px solid #8ab;padding-left:8px;margin:8px 0}
nav a{margin-right:1em}p.note{color:#555;font-size:.9em}"""


def write_report(run_dir: str | Path, extra_html: str = "") -> Path:
    """Write RUN_DIR/report.html and return its path."""
    run_dir = Path(run_dir)
    rows = read_metrics(run_dir)
    if not rows:
        raise ValueError(f"{run_dir}/metrics.jsonl has no complete step yet")
    single = not (rows[-1].get("members", {}).keys() - {"A0"})
    runs = {"baseline" if single else "population": rows}
    baseline = run_dir / "baseline"
    comparison, top_nav = "", []
    if (baseline / "metrics.jsonl").is_file() and (base_rows := read_metrics(baseline)):
        runs["baseline (single agent)"] = base_rows
        comparison = ("<h2 id='summary'>Population vs baseline</h2>"
                      + comparison_html(runs))
        top_nav.append("<a href='#summary'>comparison</a>")
    evaluation = eval_html(run_dir)
    if evaluation:
        comparison += "<h2 id='eval'>Held-out evaluation (lorapop eval)</h2>" + evaluation
        top_nav.append("<a href='#eval'>held-out eval</a>")
    note = ("Thick line: smoothed (centred moving average); faint: raw per step. "
            "Dotted vertical lines: replacement events.")
    sections: list[tuple[str, str, Callable[[], str | None], str]] = [
        ("individuals", "Learning curves per individual", lambda: plot_individuals(rows),
         note + " Line style changes when a slot gets a new individual."),
        ("arms", "Learning curves per arm (mean over members; teachers and students apart "
                 "where both log a metric)", lambda: plot_arms(runs), note),
        ("ratings", "Ratings", lambda: plot_ratings(rows),
         "TrueSkill μ per individual, band ±σ."),
        ("matchups", "Solve rate per matchup", lambda: plot_matchups(rows),
         "Mean over the steps each pair played; the colour scale spans the range present."),
        ("types", "Per task type", lambda: plot_task_types(runs),
         note + " Valid rate: valid / proposed proposals of the type."),
        ("programs", "Valid teacher programs: complexity and coverage",
         lambda: plot_programs(runs),
         "Mean over task types; coverage: distinct program structures seen so far."),
        ("difficulty", "Difficulty seen by a fixed solver", lambda: plot_difficulty(runs),
         "The solve rate of a solver that never trains (difficulty.solver) on a sample of the "
         "step's valid tasks: falling means the teachers' tasks got harder. " + note),
        ("phases", "Wall time per phase", lambda: plot_phases(rows), ""),
    ]
    figs, nav = [], [*top_nav, "<a href='#facts'>run</a>"]
    for anchor, title, plot, caption in sections:
        svg = plot()
        if svg is not None:
            nav.append(f"<a href='#{anchor}'>{anchor}</a>")
            figs.append(f"<h2 id='{anchor}'>{title}</h2><p class='note'>{caption}</p>"
                        f"<img alt='{html.escape(title)}' src='data:image/svg+xml;base64,{svg}'/>")
    nav += ["<a href='#replacements'>replacements</a>", "<a href='#samples'>samples</a>"]
    page = f"""<!doctype html><html><head><meta charset="utf-8">
<title>lorapop report: {html.escape(run_dir.name)}</title><style>{CSS}</style></head>
<body><h1>lorapop run: {html.escape(str(run_dir))}</h1>
<nav>{" ".join(nav)}</nav>
{comparison}<h2 id='facts'>Run</h2>{_facts(run_dir, rows)}{"".join(figs)}
<h2 id='replacements'>Replacement history</h2>{_replacement_table(rows)}
<h2 id='samples'>Sampled tasks and answers</h2>{_samples(run_dir)}{extra_html}</body></html>"""
    out = run_dir / "report.html"
    tmp = out.with_name(f".report.html.{os.getpid()}.tmp")
    try:  # atomic: a full disk leaves the previous report, not an empty one
        tmp.write_text(page)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out
