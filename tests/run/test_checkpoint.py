"""Atomic checkpoints: publication, retention, damage found and named, the intact earlier one
offered, and LATEST that names a missing folder."""

import contextlib
import json
import os

import pytest

from lorapop.run.checkpoint import (
    CheckpointError,
    check_checkpoint,
    latest_checkpoint,
    load_checkpoint,
    resume_point,
    save_checkpoint,
    truncate_jsonl,
)


def write(step):
    def fn(d):
        (d / "x.txt").write_text(str(step))
        (d / "sub").mkdir()
        (d / "sub" / "w.bin").write_bytes(bytes(range(256)) * 4)
    return fn


def steps(run):
    return sorted(int(p.name[5:]) for p in (run / "checkpoints").glob("step_*"))


def test_save_publishes_latest_and_keeps_last_two(tmp_path):
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, write(step))
    latest = latest_checkpoint(tmp_path)
    assert latest is not None and (latest / "x.txt").read_text() == "3"
    assert steps(tmp_path) == [2, 3]


@pytest.mark.parametrize(("keep_last", "keep_every", "kept"), [
    (1, 0, [10]), (3, 0, [8, 9, 10]), (1, 4, [4, 8, 10]), (2, 5, [5, 9, 10]),
])
def test_retention(tmp_path, keep_last, keep_every, kept):
    for step in range(1, 11):
        save_checkpoint(tmp_path, step, write(step), keep_last=keep_last, keep_every=keep_every)
    assert steps(tmp_path) == kept


def test_failed_write_leaves_previous_checkpoint(tmp_path):
    save_checkpoint(tmp_path, 1, write(1))

    def crash(d):
        (d / "x.txt").write_text("partial")
        raise RuntimeError("killed")

    with contextlib.suppress(RuntimeError):
        save_checkpoint(tmp_path, 2, crash)
    assert (latest_checkpoint(tmp_path) / "x.txt").read_text() == "1"


def test_latest_naming_a_missing_step_falls_back_to_the_newest(tmp_path):
    save_checkpoint(tmp_path, 1, write(1), keep_last=5)
    save_checkpoint(tmp_path, 2, write(2), keep_last=5)
    (tmp_path / "checkpoints" / "LATEST").write_text(json.dumps({"step": 3, "dir": "step_000003"}))
    assert latest_checkpoint(tmp_path).name == "step_000002"
    (tmp_path / "checkpoints" / "LATEST").write_text("garbage")
    assert latest_checkpoint(tmp_path).name == "step_000002"
    assert resume_point(tmp_path).name == "step_000002"
    assert resume_point(tmp_path, 1).name == "step_000001"
    with pytest.raises(FileNotFoundError, match=r"no checkpoint of step 7 .*\(steps: 1, 2\)"):
        resume_point(tmp_path, 7)


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete"])
def test_damage_is_found_and_named(tmp_path, damage):
    ckpt = save_checkpoint(tmp_path, 1, write(1))
    check_checkpoint(ckpt)
    f = ckpt / "sub" / "w.bin"
    if damage == "truncate":
        f.write_bytes(f.read_bytes()[:100])
    elif damage == "flip":
        data = bytearray(f.read_bytes())
        data[500] ^= 1
        f.write_bytes(bytes(data))
    else:
        os.remove(f)
    with pytest.raises(CheckpointError, match=r"sub/w\.bin"):
        check_checkpoint(ckpt)


def test_load_offers_the_intact_earlier_checkpoint(tmp_path):
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, write(step), keep_last=3)
    ck = tmp_path / "checkpoints"
    (ck / "step_000002" / "x.txt").write_text("2 but longer")  # damaged too
    (ck / "step_000003" / "sub" / "w.bin").write_bytes(b"")

    def load(folder):
        return int((folder / "x.txt").read_text())

    with pytest.raises(CheckpointError) as err:
        load_checkpoint(tmp_path, ck / "step_000003", load)
    msg = str(err.value)
    assert "step_000003" in msg and "w.bin" in msg and "\n" not in msg
    assert f"step_000001 is intact: `lorapop train --resume {tmp_path} --from-step 1`" in msg
    assert load_checkpoint(tmp_path, ck / "step_000001", load) == 1


def test_load_error_without_manifest_names_checkpoint_and_error(tmp_path):
    ckpt = save_checkpoint(tmp_path, 1, write(1))
    os.remove(ckpt / "MANIFEST.json")  # a checkpoint from before manifests

    def load(folder):
        raise RuntimeError("PytorchStreamReader failed reading zip archive\nmore lines")

    with pytest.raises(CheckpointError, match=r"step_000001: RuntimeError: PytorchStreamReader "
                       r"failed reading zip archive; no earlier checkpoint is intact$"):
        load_checkpoint(tmp_path, ckpt, load)


def test_truncate_drops_later_and_torn_lines(tmp_path):
    p = tmp_path / "m.jsonl"
    p.write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3)) + '{"step": 4, "x"')
    truncate_jsonl(p, 2)
    assert [json.loads(x)["step"] for x in p.read_text().splitlines()] == [1, 2]
