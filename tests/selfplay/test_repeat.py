"""CPU runs repeat bit for bit: whatever `run.save_every` is and across interruption and
resume, the same config and seed give the same metrics rows and rollouts."""

import contextlib
import gzip
import json
import types
from pathlib import Path

import torch

from lorapop.config import load_config
from lorapop.selfplay.loop import SelfPlay
from lorapop.selfplay.records import without_timings

SMALL = ["tasks.types=[code_o, code_i]", "tasks.references=1", "tasks.proposals_per_type=1",
         "sampling.teacher_max_new_tokens=24", "sampling.student_max_new_tokens=8",
         "evolve.every=2", "evolve.protect_matches=0"]


def _cfg(*extra):
    return load_config(Path(__file__).parents[2] / "configs" / "tiny.yaml", [*SMALL, *extra])


def _repeated_index_grads(ctx) -> int:
    """How many of 7 repeats of a backward through an index with repeated entries (as packed
    prompts' keys are gathered) differ from the first."""
    torch.manual_seed(0)
    x = torch.randn(64, 512, requires_grad=True)
    idx, w = torch.randint(0, 64, (2048,)), torch.randn(2048, 512)
    out = []
    for _ in range(8):
        x.grad = None
        with ctx():
            (x[idx] * w).sum().backward()
        out.append(x.grad.clone())
    return sum(not torch.equal(out[0], g) for g in out[1:])


def test_cpu_update_kernels_sum_in_one_order():
    """The update's kernel mode on CPU makes a repeated-index backward exact on every thread
    count (without it torch adds from threads atomically: here the repeats differ)."""
    me = types.SimpleNamespace(cfg=_cfg(), parts=types.SimpleNamespace(model=torch.nn.Linear(2, 2)))
    assert _repeated_index_grads(lambda: SelfPlay._update_kernels(me)) == 0
    if torch.get_num_threads() > 1:  # the cause, shown where it can happen
        assert _repeated_index_grads(contextlib.nullcontext) > 0
    assert not torch.are_deterministic_algorithms_enabled()  # the caller's mode is back


def _record(run_dir: Path) -> tuple[list[str], dict[str, bytes]]:
    rows = [json.dumps(without_timings(json.loads(x)), sort_keys=True)
            for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    dumps = {p.name: gzip.decompress(p.read_bytes())
             for p in sorted((run_dir / "rollouts").glob("step_*.jsonl.gz"))}
    return rows, dumps


def _train(run_dir: Path, steps: int, *extra: str, resume: bool = False) -> None:
    sp = SelfPlay(_cfg(*extra), run_dir, resume=resume)
    try:
        sp.run(steps)
    finally:
        sp.close()


def test_runs_repeat_whatever_save_every_and_across_resume(tmp_path):
    _train(tmp_path / "every1", 3, "run.save_every=1")
    _train(tmp_path / "end", 3, "run.save_every=50")
    _train(tmp_path / "resumed", 1, "run.save_every=1")
    _train(tmp_path / "resumed", 3, "run.save_every=2", resume=True)
    want = _record(tmp_path / "every1")
    assert len(want[0]) == 3 and len(want[1]) == 3
    assert _record(tmp_path / "end") == want
    assert _record(tmp_path / "resumed") == want
