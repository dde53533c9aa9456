"""Data-parallel self-play on two gloo ranks (CPU) against one rank: same samples, verdicts,
rewards, ratings and replacements; a run killed on one world size resumes on another."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_loop import _difference

from lorapop.run.checkpoint import latest_checkpoint
from lorapop.selfplay.records import without_timings
from script_env import run_main

HERE = Path(__file__).parent
TINY = HERE.parents[1] / "configs" / "tiny.yaml"
FAST = [
    "tasks.code_f_inputs=4", "tasks.references=1", "tasks.proposals_per_type=1",
    "tasks.fill_from_buffer=true", "sampling.teacher_max_new_tokens=48",
    "sampling.student_max_new_tokens=12", "train.micro_batch_size=4", "evolve.every=2",
    "evolve.protect_matches=0", "run.save_every=1", "run.progress=false", "verify.workers=1",
    "verify.timeout_s=5",
    "difficulty.every=1", "difficulty.samples=1", "difficulty.answers=2",  # split over ranks too
]
STEPS = 2  # replacement runs at step 2
PER_RANK = ("ranks", "allreduce_s")  # beside the wall times


def _launch(ranks: int, args: list[str]) -> list[str]:
    if ranks == 1:
        return [sys.executable, *args]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={ranks}", *args]


def _train(ranks: int, *args: object) -> list[str]:
    return _launch(ranks, ["-m", "lorapop", "train", *map(str, args), "--steps", str(STEPS),
                           "--no-report"])


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


def _rows(run_dir: Path) -> list[dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [without_timings(r, also=PER_RANK) for r in rows]


def _adapters(run_dir: Path) -> dict[str, torch.Tensor]:
    ckpt = latest_checkpoint(run_dir)
    return {f"{m.name}/{k}": v for m in sorted((ckpt / "adapters").iterdir())
            for k, v in load_file(m / "adapter_model.safetensors").items()}


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory) -> Path:
    """The reference run on one rank, with what each step sampled and decided: the driver in
    this process (not started by torchrun, so rank 0 of 1), on one thread as the ranks run."""
    import dist_driver

    out = tmp_path_factory.mktemp("one")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert run_main(dist_driver.main, HERE / "dist_driver.py", str(out), str(STEPS), *FAST) == 0
    finally:
        torch.set_num_threads(threads)
    return out


def test_two_ranks_sample_and_decide_exactly_as_one_and_stop_together(one_rank, tmp_path):
    """... with `train.deterministic` on the two ranks (each probes its kernels; on CPU the
    mode changes nothing). Asked for one more step than the reference, the run is stopped
    after the last compared one: SIGTERM from a scheduler may reach one rank a step before
    another (here rank 1 alone asks), and the ranks agree at the step's end, so all checkpoint
    it and stop (one that went on alone would wait forever for the others in its next step's
    collectives)."""
    cmd = _launch(2, [str(HERE / "dist_driver.py"), str(tmp_path), str(STEPS + 1), *FAST,
                      "train.deterministic=true"])
    done = subprocess.run(cmd, env={**_env(), "STOP_RANK1_AT": str(STEPS)}, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    stopped = torch.load(tmp_path / "outcomes.pt", weights_only=False)
    assert stopped["stopped_after"] == STEPS and len(stopped["steps"]) == STEPS
    assert latest_checkpoint(tmp_path).name == f"step_{STEPS:06d}"
    want, got = torch.load(one_rank / "outcomes.pt"), stopped
    answers = sum(len(s["answers"]) for s in want["steps"])
    valid = sum(p[4] for s in want["steps"] for p in s["proposals"])
    assert answers and valid and want["steps"][-1]["replacements"]  # every path was taken
    for s, (g, w) in enumerate(zip(got["steps"], want["steps"], strict=True), 1):
        for key in ("pairs", "proposals", "answers", "ratings", "replacements"):
            assert g[key] == w[key], f"step {s}: {key} differ"
    torch.testing.assert_close(got["weights"], want["weights"], rtol=1e-5, atol=1e-7)
    assert "after a drift: adapter weights on ranks [1]" in got["divergence"]
    assert sum(r["difficulty"]["tasks"] for r in _rows(tmp_path)) > 0  # the solver answered
    assert _rows(tmp_path) == _rows(one_rank) or all(
        _difference(g, w) is None for g, w in zip(_rows(tmp_path), _rows(one_rank), strict=True))


@pytest.mark.slow
@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 2)])
def test_killed_mid_step_resumes_on_another_number_of_ranks(one_rank, tmp_path, before, after):
    proc = subprocess.Popen(_train(before, TINY, "--out", tmp_path, *FAST), env=_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)  # torchrun and its ranks: one group
    deadline = time.time() + 300
    while latest_checkpoint(tmp_path) is None:  # step 1 is saved: kill inside step 2
        assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
        assert time.time() < deadline
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert len(_rows(tmp_path)) < STEPS

    resumed = subprocess.run(_train(after, "--resume", tmp_path), env=_env(),
                             capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    for got, want in zip(_rows(tmp_path), _rows(one_rank), strict=True):
        assert _difference(got, want) is None, _difference(got, want)
    got, want = _adapters(tmp_path), _adapters(one_rank)
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-7, msg=k)
