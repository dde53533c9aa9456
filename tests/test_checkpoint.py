import contextlib
import json

from lorapop.checkpoint import latest_checkpoint, save_checkpoint, truncate_jsonl


def test_save_publishes_latest_and_keeps_last_two(tmp_path):
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, lambda d, s=step: (d / "x.txt").write_text(str(s)))
    latest = latest_checkpoint(tmp_path)
    assert latest is not None and (latest / "x.txt").read_text() == "3"
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*")) == [
        "step_000002", "step_000003"]


def test_failed_write_leaves_previous_checkpoint(tmp_path):
    save_checkpoint(tmp_path, 1, lambda d: (d / "x.txt").write_text("1"))

    def crash(d):
        (d / "x.txt").write_text("partial")
        raise RuntimeError("killed")

    with contextlib.suppress(RuntimeError):
        save_checkpoint(tmp_path, 2, crash)
    assert (latest_checkpoint(tmp_path) / "x.txt").read_text() == "1"


def test_truncate_drops_later_and_torn_lines(tmp_path):
    p = tmp_path / "m.jsonl"
    p.write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3)) + '{"step": 4, "x"')
    truncate_jsonl(p, 2)
    assert [json.loads(x)["step"] for x in p.read_text().splitlines()] == [1, 2]
