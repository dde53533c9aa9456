"""The report page from synthetic runs: lineage, replacements, old rows, samples, escaping."""

import base64
import gzip
import json
import re

import pytest

from lorapop.run import report


def member(role, step, slot, gen=None, **extra):
    m = {"slot": slot, "role": role, "mu": 25.0 + step * (1 if role == "teacher" else -1),
         "sigma": 8.0 - 0.1 * step, "grad_norm": 0.3, "entropy": 0.6,
         "response_tokens": 40.0 + step}
    if role == "teacher":
        m.update(valid_rate=0.5, teacher_reward=0.1, task_solve_rate=0.2)
    else:
        m.update(solve_rate=0.1 + 0.01 * step, student_reward=-0.2)
    if gen is not None:
        m["individual"] = f"{'T' if role == 'teacher' else 'S'}{slot % 2}.g{gen}"
    return {**m, **extra}


def rows(n=12, lineage=True, every=5):
    out = []
    for s in range(1, n + 1):
        gen = (s - 1) // every if lineage else None
        r = {
            "step": s,
            "members": {"T0": member("teacher", s, 0, gen), "T1": member("teacher", s, 1, 0 if lineage else None),
                        "S0": member("student", s, 2, 0 if lineage else None),
                        "S1": member("student", s, 3, gen)},
            "matchups": [{"teacher": "T0", "student": "S1", "answers": 4, "solve_rate": 0.06},
                         {"teacher": "T1", "student": "S0", "answers": 4, "solve_rate": 0.15}],
            "programs": {"code_o": {"valid": 3, "ast_depth": 5.0, "cyclomatic": 1.5, "loc": 4.0,
                                    "variables": 2.0, "coverage": 280 + s}},
            "phase_s": {"proposal": 1.0, "solving": 0.5, "update": 0.3},
            "tokens_per_s": 100.0, "replacements": [],
        }
        if s % every == 0:
            entry = {"target": "T0", "parents": ["T1.g0"] if lineage else ["T1"],
                     "operator": "dare", "seed": 7}
            if lineage:
                entry.update(replaced=f"T0.g{gen}", child=f"T0.g{gen + 1}",
                             parent_slots=["T1"], failed="spectral: svd did not converge")
            r["replacements"] = [entry]
        out.append(r)
    return out


def write_run(d, rs):
    d.mkdir(parents=True, exist_ok=True)
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rs))
    return d


def svgs(page):
    return [base64.b64decode(b).decode() for b in re.findall(r"svg\+xml;base64,([^']+)", page)]


def test_page_shows_individuals_replacements_and_curves(tmp_path):
    page = report.write_report(write_run(tmp_path / "run", rows())).read_text()
    figures = svgs(page)
    assert len(figures) == 7  # individuals, arms, ratings, matchups, task types, programs, phases
    curves = figures[0]
    for label in ("student solve rate", "valid proposals (teacher)", "gradient norm",
                  "entropy", "response length", "student reward", "teacher reward"):
        assert label in curves
    assert "T0.g0" in curves and "T0.g2" in curves  # one legend entry per individual
    # replacement table: step, slot, replaced, child, parents, operator, fallback
    table = page[page.index("id='replacements'"):]
    for cell in ("T0.g0", "T0.g1", "T1.g0", "dare", "spectral: svd did not converge"):
        assert f"<td>{cell}</td>" in table


def test_replacements_marked_on_every_time_plot(tmp_path):
    page = report.write_report(write_run(tmp_path / "run", rows(n=12, every=5))).read_text()
    figures = svgs(page)
    time_plots = [f for i, f in enumerate(figures) if i != 3]  # all but the heat map
    for svg in time_plots:
        # matplotlib writes each axvline as a path with the dotted dash style
        assert svg.count("stroke-dasharray: 0.9,1.485") >= 2, svg[:200]


def test_rows_without_lineage_keys(tmp_path):
    page = report.write_report(write_run(tmp_path / "run", rows(lineage=False))).read_text()
    assert "T0.g0" in svgs(page)[0]  # every slot counts as its first individual
    table = page[page.index("id='replacements'"):]
    assert "<td>T0</td>" in table and "<td>dare</td>" in table


def test_heat_map_scale_is_the_range_present(tmp_path):
    page = report.write_report(write_run(tmp_path / "run", rows())).read_text()
    heat = svgs(page)[3]
    assert "0.06–0.15 in this run" in heat
    assert "0.06" in heat and "0.15" in heat


def test_counts_print_as_integers(tmp_path):
    run = write_run(tmp_path / "run", rows())
    base = write_run(run / "baseline", rows())
    text = report.summary_table(run, base)
    assert re.search(r"^coverage\s+292\s+292$", text, re.M), text


def test_run_facts_and_config(tmp_path):
    from lorapop.run.runinfo import RunInfo

    run = write_run(tmp_path / "run", rows())
    (run / "config.yaml").write_text("seed: 3\n")
    info = RunInfo(run, "lorapop train configs/tiny.yaml --out run", 0)
    info({"step": 12})
    page = report.write_report(run).read_text()
    facts = page[page.index("id='facts'"):page.index("id='individuals'")]
    for text in ("lorapop train configs/tiny.yaml --out run", "0.1.0", "wall time",
                 "machine", "torch", "seed: 3", "started"):
        assert text in facts, text
    assert "update kernels" not in facts  # a run.json from before train.deterministic
    for kernels, shown in (({"deterministic_kernels": True, "no_deterministic_kernel": None},
                            "<pre>deterministic</pre>"),
                           ({"deterministic_kernels": False, "no_deterministic_kernel": "cumsum"},
                            "warn-only: no such kernel for cumsum"),
                           ({"deterministic_kernels": False, "no_deterministic_kernel": None},
                            "default (not bit-for-bit")):  # fmt: skip
        RunInfo(run, "lorapop train --resume run", 12, kernels)({"step": 13})
        # the section the page shows (above); each page would cost ~2 s of figures
        assert shown in report._facts(run, report.read_metrics(run)), kernels


def test_samples_from_rollout_dump_are_escaped(tmp_path):
    run = write_run(tmp_path / "run", rows())
    (run / "rollouts").mkdir()
    recs = [
        {"step": 12, "role": "teacher", "member": "T0", "individual": "T0.g2", "type": "code_o",
         "prompt": "propose", "completion": "<script>alert(1)</script>", "parsed": None,
         "verdict": "invalid: no f", "reward": -1.0, "advantage": -0.5},
        {"step": 12, "role": "student", "member": "S1", "individual": "S1.g2", "type": "code_o",
         "prompt": "solve", "completion": "<o>3</o>", "parsed": "3", "verdict": "correct",
         "reward": 1.0, "advantage": 0.7},
    ]
    with gzip.open(run / "rollouts" / "step_12.jsonl.gz", "wt") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in recs)
    page = report.write_report(run).read_text()
    samples = page[page.index("id='samples'"):]
    assert "<script>alert" not in page and "&lt;script&gt;alert(1)" in samples
    assert "T0.g2" in samples and "invalid: no f" in samples and "+0.700" in samples


@pytest.mark.parametrize("text", ["", "not json\n", '{"step": "x"}\n'])
def test_no_complete_step_is_a_clear_error(tmp_path, text):
    (tmp_path / "metrics.jsonl").write_text(text)
    with pytest.raises(ValueError, match="no complete step"):
        report.write_report(tmp_path)


def test_single_step_and_single_agent_run(tmp_path):
    r = rows(n=1)[0]
    r["members"] = {"A0": member("solo", 1, 0) | {"valid_rate": 0.5, "solve_rate": 0.2}}
    del r["members"]["A0"]["mu"], r["members"]["A0"]["sigma"]
    r["matchups"] = [{"teacher": "A0", "student": "A0", "answers": 2, "solve_rate": 0.5}]
    page = report.write_report(write_run(tmp_path / "run", [r])).read_text()
    assert "id='ratings'" not in page.split("</nav>")[1]  # no ratings without opponents
    assert len(svgs(page)) == 6


def test_importing_the_report_changes_no_global_matplotlib_state():
    import subprocess
    import sys

    code = ("import matplotlib; r = {k: matplotlib.rcParams[k] for k in ('font.size', "
            "'svg.fonttype')}; "
            "import lorapop.run.report; assert matplotlib.rcParams['font.size'] == r['font.size']; "
            "assert matplotlib.rcParams['svg.fonttype'] == r['svg.fonttype']; "
            "assert 'pyplot' not in ' '.join(__import__('sys').modules)")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_shared_metrics_are_split_by_role_not_mixed():
    from lorapop.run.report import role_series

    rows = [{"step": 1, "members": {
        "T0": {"role": "teacher", "entropy": 1.0, "valid_rate": 0.5},
        "T1": {"role": "teacher", "entropy": 3.0, "valid_rate": 0.7},
        "S0": {"role": "student", "entropy": 0.2},
    }}]
    assert role_series(rows, "entropy") == {" teachers": [(1, 2.0)], " students": [(1, 0.2)]}
    assert role_series(rows, "valid_rate") == {"": [(1, 0.6)]}
    solo = [{"step": 1, "members": {"A0": {"role": "solo", "entropy": 1.5}}}]
    assert role_series(solo, "entropy") == {"": [(1, 1.5)]}
