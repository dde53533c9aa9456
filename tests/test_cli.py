"""The command line as a user drives it: train, report, export, eval, and its errors."""

from pathlib import Path

import pytest
from typer.testing import CliRunner

from lorapop.cli import app

TINY = str(Path(__file__).parents[1] / "configs" / "tiny.yaml")
FAST = ["tasks.types=[code_o]", "sampling.teacher_max_new_tokens=8",
        "sampling.student_max_new_tokens=4", "run.progress=false"]


def run(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def test_help_lists_commands():
    result = run("--help")
    assert result.exit_code == 0
    for cmd in ("train", "report", "export", "eval", "verify"):
        assert cmd in result.output


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    result = run("train", TINY, "--steps", 2, "--out", out, *FAST, "run.with_baseline=true")
    assert result.exit_code == 0, result.output
    return out


def test_train_with_baseline_writes_runs_and_report(run_dir):
    assert (run_dir / "report.html").is_file()
    assert (run_dir / "baseline" / "metrics.jsonl").read_text().count("\n") == 2
    page = (run_dir / "report.html").read_text()
    assert "Population vs baseline" in page


def test_export_member_as_peft_dir(run_dir, tmp_path):
    result = run("export", run_dir, "S1", tmp_path / "s1")
    assert result.exit_code == 0, result.output
    assert {p.name for p in (tmp_path / "s1").iterdir()} >= {
        "adapter_config.json", "adapter_model.safetensors"}
    bad = run("export", run_dir, "S9", tmp_path / "s9")
    assert bad.exit_code == 2 and "no member 'S9'" in bad.output and "S1" in bad.output


def test_eval_run_dir_scores_members_and_baseline(run_dir):
    data = Path(__file__).parent / "fixtures" / "data"  # two hand-written gsm8k-format problems
    result = run("eval", run_dir, "--bench", "gsm8k", "--data-dir", data, "--limit", 2,
                 "--max-new-tokens", 4)
    assert result.exit_code == 0, result.output
    header = next(line for line in result.output.splitlines() if line.startswith("| benchmark"))
    for name in ("T0", "T1", "S0", "S1", "baseline"):
        assert name in header
    assert (run_dir / "eval" / "eval.md").is_file()
    assert run("report", run_dir).exit_code == 0
    assert "Benchmarks (lorapop eval)" in (run_dir / "report.html").read_text()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["train", TINY, "lora.rnak=3"], "unknown key 'lora.rnak'"),
        (["train", TINY, "league.pfsp=best"], "bad value for 'league.pfsp'"),
        (["train", "missing.yaml"], "config file not found"),
        (["train", TINY, "model.name_or_path=./no/such/model"], "model path not found"),
        (["train", "--resume", "/nonexistent-run"], "config file not found"),
        (["report", "/nonexistent-run"], "no metrics.jsonl"),
        (["train", TINY, "--out", "EXISTING"], "already holds a run"),
    ],
)
def test_errors_are_one_line(tmp_path, run_dir, args, message):
    args = [str(run_dir) if a == "EXISTING" else a for a in args]
    needs_out = args[0] == "train" and "--resume" not in args and "--out" not in args
    result = run(*args, "--out", tmp_path / "r") if needs_out else run(*args)
    assert result.exit_code == 2
    assert message in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_pretrain_tiny_refuses_a_bad_size_and_never_overwrites_the_shipped_model():
    bad = run("pretrain-tiny", "--size", "huge", "--out", "x")
    assert bad.exit_code != 0 and "unknown --size 'huge'" in bad.output
    no_out = run("pretrain-tiny", "--size", "small")
    assert no_out.exit_code != 0 and "--out is needed" in no_out.output
