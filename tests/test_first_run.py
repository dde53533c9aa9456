"""A new user's run: bad input and failing disks give one line, nothing broken is saved or
left behind, SIGTERM checkpoints, resume checks the config, the report leads with the
comparison."""

import errno
import json
import math
import os
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from lorapop.cli import app
from lorapop.config import ConfigError, load_config
from lorapop.run import report

TINY = str(Path(__file__).parents[1] / "configs" / "tiny.yaml")
FAST = ["tasks.types=[code_o]", "tasks.proposals_per_type=1", "tasks.references=1",
        "sampling.teacher_max_new_tokens=16", "sampling.student_max_new_tokens=4",
        "run.progress=false"]


def run(*args, **kw):
    return CliRunner().invoke(app, [str(a) for a in args], **kw)


def one_line_error(result, code: int = 2) -> str:
    assert result.exit_code == code, result.output
    lines = [x for x in result.output.splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    return lines[0]


@pytest.fixture
def unwritable(tmp_path) -> Path:
    """A folder nothing can be created in (a read-only place for root too)."""
    if os.geteuid() != 0:
        d = tmp_path / "ro"
        d.mkdir(mode=0o500)
        return d / "out"
    if os.path.isdir("/sys") and not os.access("/sys/lorapop-probe", os.F_OK):
        try:
            os.mkdir("/sys/lorapop-probe")
        except OSError:
            return Path("/sys/lorapop-probe/out")
    pytest.skip("no unwritable folder for root here")


class FakeWandb(types.ModuleType):
    def __init__(self):
        super().__init__("wandb")
        self.inits = []

    def init(self, **kw):
        self.inits.append(kw)
        return types.SimpleNamespace(log=lambda *a, **k: None, finish=lambda: None)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One step of a population and its baseline, logged to a stand-in W&B."""
    out = tmp_path_factory.mktemp("run")
    fake = FakeWandb()
    saved = sys.modules.get("wandb")
    sys.modules["wandb"] = fake
    try:
        result = run("train", TINY, "--steps", 1, "--out", out, *FAST, "run.with_baseline=true",
                     "run.wandb=true", "run.wandb_entity=lab", "run.save_every=1")
    finally:
        sys.modules.pop("wandb")
        if saved is not None:
            sys.modules["wandb"] = saved
    assert result.exit_code == 0, result.output
    return out, result.output, fake.inits


# ------------------------------------------------------------------ config values and flags
@pytest.mark.parametrize("override", ["train.lr=.inf", "sampling.temperature=.inf",
                                      "train.max_grad_norm=.nan", "train.betas=[0.9, .inf]"])
def test_non_finite_values_are_refused(override):
    with pytest.raises(ConfigError, match=f"bad value for '{override.split('=')[0]}"):
        load_config(TINY, [override])
    assert "finite" in one_line_error(run("train", TINY, override, "--print-config"))


def test_typos_get_a_suggestion():
    assert "did you mean --steps" in one_line_error(run("train", TINY, "--step", 1))
    assert "did you mean 'rank'" in one_line_error(run("train", TINY, "lora.rnak=4"))


def test_version_and_printed_config(tmp_path):
    import lorapop

    assert run("--version").output.strip() == f"lorapop {lorapop.__version__}"
    result = run("train", TINY, "lora.rank=4", "--out", tmp_path / "x", "--print-config")
    assert result.exit_code == 0 and "rank: 4" in result.output
    assert not (tmp_path / "x").exists()


def test_banner_and_wandb_grouping(trained):
    out, output, inits = trained
    banner = [x for x in output.splitlines() if x.startswith("lorapop: tiny | population")]
    assert banner and "trainable parameters" in banner[0] and str(out) in banner[0]
    assert [(i["group"], i["job_type"], i["entity"]) for i in inits] == [
        (out.name, "population", "lab"), (out.name, "baseline", "lab")]
    assert inits[0]["name"] != inits[1]["name"]


# ------------------------------------------------------------------ never save a broken model
def test_non_finite_update_stops_before_anything_is_written(tmp_path, monkeypatch):
    from lorapop.selfplay.update import PolicyUpdate

    step, calls = PolicyUpdate.step, []

    def poisoned(self, rollouts, rewards):
        calls.append(1)
        if len(calls) == 2:  # the second step's update
            with torch.no_grad():
                self.parts.bank.weights[0].fill_(float("nan"))
        return step(self, rollouts, rewards)

    monkeypatch.setattr(PolicyUpdate, "step", poisoned)
    out = tmp_path / "run"
    line = one_line_error(run("train", TINY, "--steps", 3, "--out", out, *FAST,
                              "run.save_every=1"))
    assert "step 2: member T0" in line and "last checkpoint is intact" in line
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 1
    assert [p.name for p in (out / "checkpoints").iterdir() if p.is_dir()] == ["step_000001"]
    assert sorted(p.name for p in (out / "rollouts").iterdir()) == ["step_1.jsonl.gz"]
    from safetensors.torch import load_file

    for f in (out / "checkpoints" / "step_000001" / "adapters").rglob("*.safetensors"):
        assert all(torch.isfinite(t).all() for t in load_file(f).values())


# ------------------------------------------------------------------ failing disks
def test_full_disk_while_checkpointing_is_one_line_and_leaves_no_temp(tmp_path, monkeypatch):
    import lorapop.selfplay.loop

    def full(parts, step, folder):
        (folder / "state.pt").write_bytes(b"x" * 100)
        raise RuntimeError("[enforce fail at inline_container.cc:626] . unexpected pos 1920 "
                           "vs 1814")

    monkeypatch.setattr(lorapop.selfplay.loop, "save_state", full)
    out = tmp_path / "run"
    line = one_line_error(run("train", TINY, "--steps", 1, "--out", out, *FAST))
    assert "cannot write the checkpoint of step 1" in line and "unexpected pos" in line
    assert not list((out / "checkpoints").glob(".tmp*"))


def test_unwritable_outputs_are_one_line_before_any_work(unwritable, trained):
    out, _, _ = trained
    assert "cannot write to" in one_line_error(run("train", TINY, "--out", unwritable, *FAST))
    assert "cannot write to" in one_line_error(run("export", out, "T0", unwritable))
    t0 = time.monotonic()
    assert "cannot write to" in one_line_error(
        run("eval", out, "--bench", "tiny", "--out", unwritable))
    assert time.monotonic() - t0 < 10


def test_report_on_a_full_disk_keeps_the_old_report(trained, monkeypatch):
    out, _, _ = trained
    before = (out / "report.html").read_text()
    real = Path.write_text

    def full(self, *a, **k):
        if self.name.endswith(".tmp"):
            real(self, "<partial")
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, *a, **k)

    monkeypatch.setattr(Path, "write_text", full)
    assert "No space left on device" in one_line_error(run("report", out))
    assert (out / "report.html").read_text() == before
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]


# ------------------------------------------------------------------ eval options
@pytest.mark.parametrize(("args", "message"), [
    (["--workers", "0"], "--workers must be at least 1"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be at least 1"),
    (["--limit", "-1"], "--limit must be at least 1"),
    (["--limit", "-3", "--bench", "tiny"], "--limit must be at least 1"),
    (["--limit", "3", "--bench", "tiny"], "--limit does not apply to --bench tiny"),
])
def test_eval_options_are_checked(args, message):
    bench = [] if "--bench" in args else ["--bench", "gsm8k"]
    assert message in one_line_error(run("eval", "tiny-random", *bench, *args))


# ------------------------------------------------------------------ resume
def test_resume_names_the_changed_keys(trained, tmp_path):
    out, _, _ = trained
    line = one_line_error(run("train", "--resume", out, "lora.rank=16", "seed=3"))
    assert "lora.rank 8 -> 16" in line and "seed 0 -> 3" in line and "damaged" not in line
    from lorapop.cli import _check_resume

    cfg = load_config(out / "config.yaml", ["run.save_every=3", "train.steps=9"])
    assert _check_resume(out, None, cfg) == ["run.save_every 1 -> 3", "train.steps 1 -> 9"]
    assert "no such directory" in one_line_error(run("train", "--resume", tmp_path / "nope"))
    assert "not a lorapop run directory" in one_line_error(run("train", "--resume", tmp_path))


def test_sigterm_checkpoints_the_step_and_says_how_to_resume(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "lorapop", "train", TINY, "--steps", "50", "--out", str(out),
         "--no-report", *FAST, "run.save_every=50"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.time() + 300
    while not ((out / "metrics.jsonl").is_file() and (out / "metrics.jsonl").read_text()):
        assert proc.poll() is None and time.time() < deadline, proc.stderr.read()
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 143, err
    steps = len((out / "metrics.jsonl").read_text().splitlines())
    assert f"stopped by SIGTERM after step {steps}, checkpointed" in err
    assert f"lorapop train --resume {out}" in err
    assert (out / "checkpoints" / f"step_{steps:06d}").is_dir()


# ------------------------------------------------------------------ hub model offline
def test_unknown_hub_model_offline_fails_at_once_leaving_nothing(tmp_path, monkeypatch):
    from lorapop.engine import load as model

    model._check_hub.cache_clear()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "run"
    t0 = time.monotonic()
    line = one_line_error(run("train", TINY, "model.name_or_path=nobody/no-such-model",
                              "--out", out, *FAST))
    assert "HF_HUB_OFFLINE" in line and time.monotonic() - t0 < 10
    assert not out.exists()


# ------------------------------------------------------------------ the report
def test_report_leads_with_the_comparison_and_the_held_out_eval(trained, monkeypatch):
    out, _, _ = trained
    (out / "eval").mkdir(exist_ok=True)
    (out / "eval" / "eval.json").write_text(json.dumps({
        "members": {"T0": "member", "base": "base"},
        "benchmarks": {"gsm8k": {"n": 20, "pass@1": {"T0": 0.5, "base": 0.25}}}}))
    lines = []
    monkeypatch.setattr(report, "_line", lambda ax, s, v, **st: lines.append(
        (st["label"], st["color"], st["ls"])))
    page = report.write_report(out).read_text()
    nav = page[page.index("<nav>"):page.index("</nav>")]
    assert nav.index("#summary") < nav.index("#eval") < nav.index("#facts")
    assert page.index("id='summary'") < page.index("id='eval'") < page.index("id='facts'")
    assert "↑ higher" in page and "±" in page and "per proposed task" in page
    lo, hi = report.wilson(0.5, 20)
    assert f"0.500 [{lo:.3f}, {hi:.3f}]" in page
    assert "id='types'" in page
    lines.clear()
    report.plot_arms({"population": report.read_metrics(out),
                      "baseline (single agent)": report.read_metrics(out / "baseline")})
    styles = {}
    for label, color, ls in lines:
        styles.setdefault(label, (color, ls))
    assert len(set(styles.values())) == len(styles)  # every arm line looks different
    assert {"population teachers", "population students"} <= set(styles)
    assert math.isclose(report.wilson(1.0, 10)[1], 1.0)


def test_license_is_the_apache_2_text_pyproject_names():
    root = Path(__file__).parents[1]
    text = (root / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text
    assert "Apache-2.0" in (root / "pyproject.toml").read_text()
