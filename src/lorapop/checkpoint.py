"""Atomic run checkpoints: a step's files are written to a temporary folder, then renamed.

A run killed at any moment leaves either the previous checkpoint or the new one, never a
half-written one; `LATEST` names the newest complete checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(run_dir: Path, step: int, write: Callable[[Path], None], keep: int = 2) -> Path:
    """Call `write(folder)` on a fresh folder and publish it as the checkpoint of `step`."""
    root = run_dir / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:06d}"
    tmp = root / f".tmp_step_{step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    write(tmp)
    for f in tmp.rglob("*"):
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    latest_tmp = root / "LATEST.tmp"
    latest_tmp.write_text(json.dumps({"step": step, "dir": final.name}))
    os.replace(latest_tmp, root / "LATEST")
    _fsync_dir(root)
    done = sorted(p for p in root.glob("step_*") if p.is_dir())
    for old in done[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(run_dir: Path) -> Path | None:
    marker = run_dir / "checkpoints" / "LATEST"
    if not marker.is_file():
        return None
    path = run_dir / "checkpoints" / json.loads(marker.read_text())["dir"]
    return path if path.is_dir() else None


def truncate_jsonl(path: Path, last_step: int) -> None:
    """Drop lines logged after `last_step` (and any line cut by a kill), so a resumed run
    appends exactly where its checkpoint stands."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if row.get("step", 0) <= last_step:
            kept.append(line)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(k + "\n" for k in kept))
    os.replace(tmp, path)
