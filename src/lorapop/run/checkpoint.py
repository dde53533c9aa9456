"""Atomic run checkpoints: a step's files are written to a temporary folder, then renamed.

A run killed at any moment leaves either the previous checkpoint or the new one, never a
half-written one; `LATEST` names the newest complete checkpoint. Each checkpoint lists its
files' sizes and CRC32s in `MANIFEST.json`, so a damaged one is found, and named, before
anything is loaded from it. Retention keeps the last `keep_last` checkpoints and every one
whose step is a multiple of `keep_every`.
"""

from __future__ import annotations

import json
import os
import shutil
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

MANIFEST = "MANIFEST.json"
T = TypeVar("T")


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed from; the message is one line naming the file."""


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (nothing of it is left); the message is one line."""


def _os_reason(e: BaseException, where: Path) -> str:
    """One line for a write failure: the OS's reason, or the free space when a library hid
    it (torch.save's "unexpected pos" on a full disk)."""
    if isinstance(e, OSError) and e.strerror:
        return e.strerror + (f": {e.filename}" if e.filename else "")
    try:
        free = shutil.disk_usage(where).free
    except OSError:
        free = -1
    first = (str(e).splitlines() or [type(e).__name__])[0][:200]
    return f"{first} ({free >> 20} MiB free)" if free >= 0 else first


def _write_failure(e: RuntimeError) -> bool:
    """torch.save's errors for a write that failed (a full disk shows as "unexpected pos")."""
    text = str(e)
    return any(k in text for k in ("unexpected pos", "PytorchStreamWriter", "file write failed"))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return crc


def step_of(folder: Path) -> int:
    return int(folder.name.split("_")[-1])


def save_checkpoint(run_dir: Path, step: int, write: Callable[[Path], None], keep_last: int = 2,
                    keep_every: int = 0) -> Path:
    """Call `write(folder)` on a fresh folder and publish it as the checkpoint of `step`.

    Any failure (a full disk, a read-only file system) removes the temporary folder and
    raises CheckpointWriteError naming the checkpoint and the cause; earlier checkpoints and
    `LATEST` are left as they were."""
    root = run_dir / "checkpoints"
    final = root / f"step_{step:06d}"
    tmp = root / f".tmp_step_{step:06d}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        write(tmp)
        files = {}
        for f in sorted(tmp.rglob("*")):
            if f.is_file():
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
                files[f.relative_to(tmp).as_posix()] = {"bytes": f.stat().st_size,
                                                        "crc32": _crc32(f)}
        (tmp / MANIFEST).write_text(json.dumps({"step": step, "files": files}, indent=0))
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError) or (isinstance(e, RuntimeError) and _write_failure(e)):
            # torch.save reports a full disk as RuntimeError ("unexpected pos ..."): say what
            raise CheckpointWriteError(f"cannot write the checkpoint of step {step} in {root}: "
                                       f"{_os_reason(e, root)}") from None
        raise
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    latest_tmp = root / "LATEST.tmp"
    latest_tmp.write_text(json.dumps({"step": step, "dir": final.name}))
    os.replace(latest_tmp, root / "LATEST")
    _fsync_dir(root)
    prune(run_dir, keep_last, keep_every)
    return final


def prune(run_dir: Path, keep_last: int, keep_every: int = 0) -> list[Path]:
    """Delete checkpoints other than the last `keep_last` and multiples of `keep_every`."""
    done = checkpoints(run_dir)
    last = set(done[-keep_last:]) if keep_last > 0 else set()
    gone = [p for p in done if p not in last and not (keep_every and step_of(p) % keep_every == 0)]
    for p in gone:
        shutil.rmtree(p, ignore_errors=True)
    return gone


def checkpoints(run_dir: Path) -> list[Path]:
    """The run's checkpoint folders, oldest first."""
    root = run_dir / "checkpoints"
    found = [p for p in root.glob("step_*") if p.is_dir() and p.name[5:].isdigit()]
    return sorted(found, key=step_of)


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The checkpoint `LATEST` names; the newest folder when LATEST is missing, unreadable or
    names a folder that is gone (so earlier checkpoints are never hidden)."""
    marker = run_dir / "checkpoints" / "LATEST"
    try:
        path = run_dir / "checkpoints" / json.loads(marker.read_text())["dir"]
        if path.is_dir():
            return path
    except (OSError, ValueError, KeyError, TypeError):
        pass
    done = checkpoints(run_dir)
    return done[-1] if done else None


def check_checkpoint(folder: Path) -> None:
    """Raise CheckpointError naming the first missing, truncated or altered file of `folder`
    (checkpoints from before manifests pass unchecked)."""
    manifest = folder / MANIFEST
    if not manifest.is_file():
        return
    try:
        files = json.loads(manifest.read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{manifest}: unreadable ({e})") from None
    for name, want in files.items():
        f = folder / name
        if not f.is_file():
            raise CheckpointError(f"{f}: missing")
        if f.stat().st_size != want["bytes"]:
            raise CheckpointError(f"{f}: {f.stat().st_size} bytes, {want['bytes']} written")
        if _crc32(f) != want["crc32"]:
            raise CheckpointError(f"{f}: contents changed since it was written (CRC32)")


def intact_before(run_dir: Path, folder: Path) -> Path | None:
    """The newest checkpoint older than `folder` that passes `check_checkpoint`."""
    for p in reversed([p for p in checkpoints(run_dir) if step_of(p) < step_of(folder)]):
        try:
            check_checkpoint(p)
        except CheckpointError:
            continue
        return p
    return None


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


def load_checkpoint(run_dir: Path, folder: Path, load: Callable[[Path], T]) -> T:
    """`load(folder)` after checking its manifest; any failure becomes one CheckpointError that
    names the damaged file (or the error) and the newest intact earlier checkpoint to use."""
    try:
        check_checkpoint(folder)
        return load(folder)
    except Exception as e:  # torch, safetensors, JSON, a missing key: the checkpoint is unusable
        reason = str(e) if isinstance(e, CheckpointError) else \
            f"{folder}: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"
        prev = intact_before(run_dir, folder)
        offer = (f"; {prev.name} is intact: `lorapop train --resume {run_dir} --from-step "
                 f"{step_of(prev)}`" if prev else "; no earlier checkpoint is intact")
        raise CheckpointError(f"cannot resume from {folder.name}: {reason}{offer}") from None


def resume_point(run_dir: Path, from_step: int | None = None) -> Path:
    """The checkpoint to resume from: the latest, or the one of `from_step`."""
    if from_step is None:
        ckpt = latest_checkpoint(run_dir)
        if ckpt is None:
            raise FileNotFoundError(f"no checkpoint to resume from in {run_dir}")
        return ckpt
    ckpt = run_dir / "checkpoints" / f"step_{from_step:06d}"
    if not ckpt.is_dir():
        have = ", ".join(str(step_of(p)) for p in checkpoints(run_dir)) or "none"
        raise FileNotFoundError(f"no checkpoint of step {from_step} in {run_dir} (steps: {have})")
    return ckpt
