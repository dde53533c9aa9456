"""Attack class 10: absurd or non-finite limits are refused with one line, everywhere."""

import json

import pytest
from typer.testing import CliRunner

from lorapop.cli import app
from lorapop.config import ConfigError, load_config
from lorapop.verify import Job, Sandbox
from lorapop.verify.sandbox import SandboxError

BAD = ["inf", "-inf", "nan", "1e300", "0", "-1", "86401"]


@pytest.mark.parametrize("bad", BAD)
def test_cli_verify_rejects_bad_timeouts(tmp_path, bad):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"program": "def f(x):\n    return x", "input": "1"}) + "\n")
    result = CliRunner().invoke(app, ["verify", str(path), "--timeout", bad])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "--timeout must be a number of seconds" in lines[0]
    assert "Traceback" not in result.output


@pytest.mark.parametrize("bad", [*BAD, "abc"])
def test_config_rejects_bad_timeouts(bad):
    with pytest.raises(ConfigError, match="verify.timeout_s") as e:
        load_config(None, [f"verify.timeout_s={bad}"])
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "override", ["verify.workers=0", "verify.workers=5000", "verify.memory_mb=1e30",
                 "verify.memory_mb=-1", "verify.isolate=maybe"],
)  # fmt: skip
def test_config_rejects_other_bad_verify_fields(override):
    with pytest.raises(ConfigError, match=override.split("=")[0]):
        load_config(None, [override])


def test_config_accepts_strict_isolation():
    assert load_config(None, ["verify.isolate=strict"]).verify.isolate == "strict"
    assert load_config(None, ["verify.isolate=false"]).verify.isolate is False


@pytest.mark.parametrize(
    "kwargs",
    [{"timeout_s": float("inf")}, {"timeout_s": float("nan")}, {"timeout_s": 1e300},
     {"timeout_s": 0}, {"timeout_s": True}, {"memory_mb": -5}, {"memory_mb": 1 << 40},
     {"workers": 0}, {"max_output_chars": 0}, {"isolate": "yes"}],
)  # fmt: skip
def test_sandbox_rejects_bad_limits_before_starting(kwargs):
    with pytest.raises(ValueError) as e:
        Sandbox(**kwargs)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("bad", [1e300, float("inf"), float("nan"), 86_401.0, -2.0])
def test_job_rejects_bad_limits(bad):
    with pytest.raises(ValueError, match="Job.timeout_s must be a number of seconds"):
        Job("def f():\n    return 1", "f()", timeout_s=bad)


def test_the_largest_limit_runs(sandbox):
    """A day is accepted end to end (RLIMIT_CPU 86401 s) and a quick job still ends at once."""
    (v,) = sandbox.run([Job("def f():\n    return 3", "f()", timeout_s=86_400.0)])
    assert v.ok and v.output == "3"


def test_strict_refuses_a_sandbox_without_its_layers(monkeypatch):
    """isolate="strict" raises one line naming what is missing (here Landlock, which a
    machine with a private mount namespace does not use, is made a requirement)."""
    import lorapop.verify.sandbox as sandbox_module

    monkeypatch.setattr(sandbox_module, "REQUIRED", (*sandbox_module.REQUIRED, "landlock"))
    with pytest.raises(SandboxError, match="isolate=strict: this machine lacks") as e:
        Sandbox(workers=1, isolate="strict")
    assert "landlock" in str(e.value) and "\n" not in str(e.value)
    monkeypatch.undo()
    with Sandbox(workers=1, isolate="strict") as sb:  # everything required is here
        assert sb.run([Job("def f():\n    return 1", "f()")])[0].output == "1"
