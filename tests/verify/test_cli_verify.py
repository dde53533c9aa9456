"""The `lorapop verify` contract: one JSON line per task, in order; exit 0 or 2."""

import json

from typer.testing import CliRunner

from lorapop.cli import app

TASKS = [
    json.dumps({"program": "def f(a, b):\n    return a * b", "input": "6, 7"}),
    "this is not json",
    json.dumps(["not", "an", "object"]),
    json.dumps({"program": "def f(x):\n    return x"}),
    json.dumps({"program": "def f(x):\n    return x", "input": "1), (__import__('os').getpid()"}),
    json.dumps(
        {"program": "def f(n):\n    return list({str(i) for i in range(n)})", "input": "30"}
    ),
    json.dumps({"program": "import random\ndef f(x):\n    return x", "input": "1"}),
    "",
    json.dumps({"program": "def f(s):\n    return s[::-1]", "input": "'abc'"}),
]


def run(args):
    return CliRunner().invoke(app, ["verify", *args])


def test_verify_contract(tmp_path):
    path = tmp_path / "tasks.jsonl"
    path.write_text("\n".join(TASKS) + "\n")
    result = run([str(path), "--workers", "2", "--timeout", "1"])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.output.splitlines()]
    assert [r["status"] for r in rows] == [
        "ok", "bad_request", "bad_request", "bad_request", "syntax_error",
        "nondeterministic", "banned", "bad_request", "ok",
    ]  # fmt: skip (the blank line too: output line n answers input line n)
    assert rows[7]["error"] == "blank line"
    assert rows[0]["output"] == "42" and rows[-1]["output"] == "'cba'"
    assert all(r["output"] is None for r in rows[1:-1])
    assert all({"status", "output", "error", "duration"} <= r.keys() for r in rows)


def test_missing_file_exits_2_with_one_line(tmp_path):
    result = run([str(tmp_path / "nope.jsonl")])
    assert result.exit_code == 2
    assert len(result.output.strip().splitlines()) == 1 and "cannot read" in result.output


def test_directory_exits_2(tmp_path):
    assert run([str(tmp_path)]).exit_code == 2


def test_bad_options_exit_2(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("")
    assert run([str(path), "--workers", "0"]).exit_code == 2


def test_undecodable_line_is_a_bad_request(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_bytes(b"\xff\xfe\x00garbage\n")
    result = run([str(path)])
    assert result.exit_code == 0
    assert json.loads(result.output)["status"] == "bad_request"


def test_demo_runs():
    result = CliRunner().invoke(app, ["sandbox-demo"])
    assert result.exit_code == 0, result.output
    assert "nondeterministic" in result.output and "timeout" in result.output


# --- attack class 7: every size is capped before it is parsed ------------------------------


def test_huge_input_is_refused_before_parsing(tmp_path):
    path = tmp_path / "t.jsonl"
    big = json.dumps({"program": "def f(x):\n    return x", "input": "[" + "1," * 75_000 + "1]"})
    ok = json.dumps({"program": "def f(x):\n    return x", "input": "7"})
    path.write_text(big + "\n" + ok + "\n")
    result = run([str(path)])
    rows = [json.loads(line) for line in result.output.splitlines()]
    assert result.exit_code == 0
    assert rows[0]["status"] == "syntax_error" and "longer than" in rows[0]["error"]
    assert rows[1]["output"] == "7"


def test_huge_lines_are_skipped_unread(tmp_path):
    """A 20 MB line (no JSON parse, not kept whole in memory) then a normal one."""
    from lorapop.verify.jsonl import MAX_LINE_BYTES, read_lines

    path = tmp_path / "t.jsonl"
    ok = json.dumps({"program": "def f(x):\n    return x", "input": "8"})
    with path.open("w") as fh:
        fh.write('{"program": "' + "x" * 20_000_000 + '"}\n' + ok + "\n")
    with path.open("rb") as fh:
        lines = list(read_lines(fh))
    assert [len(line) for line in lines] == [MAX_LINE_BYTES + 1, len(ok) + 1]
    rows = [json.loads(line) for line in run([str(path)]).output.splitlines()]
    assert rows[0]["status"] == "bad_request" and "longer than" in rows[0]["error"]
    assert rows[1]["output"] == "8"


def test_no_verdict_exits_3(tmp_path, monkeypatch):
    """A task left without a verdict (its server died twice) makes `lorapop verify` fail."""
    import lorapop.verify.sandbox as sandbox_module

    class Dying(sandbox_module.Sandbox):
        def run(self, jobs):  # noqa: ANN001, ANN202 - as if the server died on every job
            self.lost += len(jobs)
            return [sandbox_module.Verdict(sandbox_module.Status.CRASHED, None,
                                           sandbox_module.NO_VERDICT, 0.0) for _ in jobs]  # fmt: skip

    monkeypatch.setattr(sandbox_module, "Sandbox", Dying)
    path = tmp_path / "t.jsonl"
    path.write_text(TASKS[0] + "\n")
    result = run([str(path)])
    assert result.exit_code == 3
    assert "got no verdict" in result.output
