"""End-to-end runs of the self-play loop on a random-weight tiny model (CPU)."""

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from lorapop.config import load_config
from lorapop.engine.logprobs import sequence_logprobs
from lorapop.rl import trr_advantages
from lorapop.run.checkpoint import latest_checkpoint
from lorapop.run.report import write_report
from lorapop.selfplay.loop import SelfPlay, _Clock
from lorapop.selfplay.records import without_timings
from lorapop.tasks.code import ProgramInputFamily
from lorapop.tasks.code_f import CodeF
from lorapop.tasks.task import Outcome, Task, Validity

FAST = [
    "tasks.types=[code_o, code_i, code_f]", "tasks.code_f_inputs=4", "tasks.references=1",
    "sampling.teacher_max_new_tokens=12", "sampling.student_max_new_tokens=6",
    "tasks.proposals_per_type=2",
    "train.micro_batch_size=64", "evolve.every=2", "evolve.protect_matches=0", "run.save_every=2",
    "verify.timeout_s=5",
]


def _cfg(*extra):
    return load_config(Path(__file__).parents[2] / "configs" / "tiny.yaml", [*FAST, *extra])


def _rows(run_dir):
    rows = [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [without_timings(r) for r in rows]


def _run(cfg, run_dir, steps: int) -> list[dict]:
    sp = SelfPlay(cfg, run_dir)
    try:
        sp.run(steps)
    finally:
        sp.close()
    return _rows(run_dir)


def test_population_run_three_steps_and_report(tmp_path):
    rows = _run(_cfg(), tmp_path, 3)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert set(rows[0]["members"]) == {"T0", "T1", "S0", "S1"}
    for r in rows:
        students = {s for _, s in (tuple(m.values())[:2] for m in r["matchups"])}
        assert students == {"S0", "S1"}  # every student plays every step
        assert r["programs"]["code_o"]["proposed"] == 2 * 2  # teachers x proposals_per_type
    # replacement ran at step 2 only: the weaker half of each pool, children of the other half
    assert not rows[0]["replacements"] and not rows[2]["replacements"]
    reps = rows[1]["replacements"]
    assert sorted(x["target"][0] for x in reps) == ["S", "T"]
    for x in reps:
        assert x["operator"] and x["parents"] and x["target"] not in x["parent_slots"]
        assert all(p[0] == x["target"][0] for p in x["parent_slots"])  # from its own pool
        # individuals: the target's g0 is replaced by its g1, made from the parents' g0
        assert (x["replaced"], x["child"]) == (f"{x['target']}.g0", f"{x['target']}.g1")
        assert x["parents"] == [f"{s}.g0" for s in x["parent_slots"]]
        assert rows[0]["members"][x["target"]]["individual"] == x["replaced"]
        assert rows[1]["members"][x["target"]]["individual"] == x["child"]  # read after it
        assert rows[2]["members"][x["target"]]["individual"] == x["child"]
    # complexity and coverage count only programs the teachers wrote, not code_f's copies
    assert all(rows[0]["programs"]["code_f"][k] is None for k in ("loc", "coverage"))
    assert latest_checkpoint(tmp_path).name == "step_000003"
    page = write_report(tmp_path).read_text()
    # individuals, arms, ratings, matchups, task types, programs, phases; replacements, samples
    assert page.count("<img") == 7 and "Replacement history" in page
    assert "rollouts/step_3.jsonl.gz" in page


def test_replacement_writes_children_into_slots(tmp_path):
    sp = SelfPlay(_cfg("evolve.operators={copy: 1.0}", "evolve.protect_matches=1"), tmp_path)
    try:
        assert sp.replacement(step=2) == []  # nobody has played a match: all protected
        ratings = sp.parts.ratings
        for name in sp.parts.slot:
            ratings.set(name, ratings.get(name).mu, ratings.get(name).sigma, played=1)
        for i in sp.parts.slot.values():  # make members distinguishable
            sp.parts.bank.reset_slot(i, seed=i)
            state = sp.parts.bank.slot_state(i)
            for m in state.values():
                m["B"].normal_(generator=torch.Generator().manual_seed(i))
            sp.parts.bank.load_slot(i, state)
        log = sp.replacement(step=2)
        for rep in log:
            child = sp.parts.bank.slot_state(sp.parts.slot[rep["target"]])
            parent = sp.parts.bank.slot_state(sp.parts.slot[rep["parent_slots"][0]])
            for k in child:
                assert torch.equal(child[k]["B"], parent[k]["B"])
            assert rep["target"] not in rep["parent_slots"]
            assert sp.parts.ratings.played(rep["target"]) == 0  # a new individual
        assert log
    finally:
        sp.close()


def test_single_agent_baseline_three_steps(tmp_path, monkeypatch):
    """... with eager decode steps when asked (`sampling.cuda_graph`), and where each
    generation phase's time went in the metrics."""
    import lorapop.selfplay.loop

    graphs, real = [], lorapop.selfplay.loop.generate
    monkeypatch.setattr(lorapop.selfplay.loop, "generate",
                        lambda *a, **k: graphs.append(a[5].cuda_graph) or real(*a, **k))
    rows = _run(_cfg("league.mode=single", "sampling.cuda_graph=false"), tmp_path, 3)
    assert graphs and not any(graphs)
    timing = [json.loads(x)["generation"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    for t in timing:  # proposals and answers in one batch (`sampling.overlap`)
        assert set(t) == {"rollouts"}
        p = t["rollouts"]
        assert set(p) == {"prefill_s", "prefill_tokens", "capture_s", "decode_s", "steps",
                          "feed_s", "regrids"}
        assert p["steps"] > 0 and p["capture_s"] == 0 and min(p.values()) >= 0  # CPU: no graphs
        assert p["prefill_tokens"] > 0
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert set(rows[0]["members"]) == {"A0"}
    assert rows[0]["matchups"][0] == {**rows[0]["matchups"][0], "teacher": "A0", "student": "A0"}
    assert all(not r["replacements"] for r in rows)


@pytest.mark.slow
def test_sigkill_mid_step_then_resume_matches_uninterrupted(tmp_path):
    steps = 4
    straight = tmp_path / "straight"
    _run(_cfg(), straight, steps)

    killed = tmp_path / "killed"
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text((straight / "config.yaml").read_text())
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "lorapop", "train", str(cfg_path), "--steps", str(steps),
           "--out", str(killed), "--no-report", "run.progress=false"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 300
    while time.time() < deadline:  # wait for the step-2 checkpoint, then kill inside step 3
        ckpt = latest_checkpoint(killed)
        if ckpt is not None and ckpt.name == "step_000002":
            break
        assert proc.poll() is None, proc.stderr.read().decode()
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert len(_rows(killed)) < steps

    # the resume through the command line's entry point, in this process (a child would cost
    # ~5 s of imports; test_loop_dist resumes killed runs in fresh processes)
    from lorapop.cli import app

    with pytest.raises(SystemExit) as resumed:
        app(["train", "--resume", str(killed), "--steps", str(steps), "--no-report",
             "run.progress=false"], prog_name="lorapop")  # fmt: skip
    assert resumed.value.code == 0
    for got, want in zip(_rows(killed), _rows(straight), strict=True):
        assert _difference(got, want) is None, _difference(got, want)


def _difference(got, want, path="row"):
    """None when equal: exactly, except floats to 1e-4 relative (multi-threaded CPU reductions
    may sum in another order in another process); else where and how they differ."""
    if isinstance(got, dict) and isinstance(want, dict):
        if got.keys() != want.keys():
            return f"{path}: keys {sorted(got)} != {sorted(want)}"
        diffs = (_difference(got[k], want[k], f"{path}.{k}") for k in sorted(got))
    elif isinstance(got, list) and isinstance(want, list) and len(got) == len(want):
        pairs = enumerate(zip(got, want, strict=True))
        diffs = (_difference(g, w, f"{path}[{i}]") for i, (g, w) in pairs)
    elif isinstance(got, float) and isinstance(want, float):
        same = got == pytest.approx(want, rel=1e-4, abs=1e-6)
        diffs = iter([None if same else f"{path}: resumed {got!r} != uninterrupted {want!r}"])
    else:
        diffs = iter([None if got == want else f"{path}: resumed {got!r} != uninterrupted {want!r}"])
    return next((d for d in diffs if d is not None), None)


def test_failing_operator_falls_back_to_copy_and_is_logged(tmp_path, monkeypatch):
    from lorapop.lora import evolve

    def broken(parents, seed):
        raise ValueError("did not converge")

    monkeypatch.setitem(evolve.OPERATORS, "spectral", broken)
    sp = SelfPlay(_cfg("evolve.operators={spectral: 1.0}"), tmp_path)
    try:
        log = sp.replacement(step=2)
    finally:
        sp.close()
    assert log and all(x["operator"] == "copy" and "did not converge" in x["failed"] for x in log)


def test_one_update_step_moves_each_adapter_with_its_advantages(tmp_path):
    """Rewards are wired end to end: one real update on the tiny model raises the
    log-probability of each adapter's positive-advantage rollouts and lowers its negative
    ones, and adapters without rollouts are left exactly as they were. Proposals, verdicts and
    answers are the model's and the sandbox's; the answers' grades alternate right / wrong
    (the tiny model rarely solves anything), so the students' rewards differ. With
    `train.kl_rows` covering every rollout, the logged KL is each member's mean per-token
    k3 estimate between the policy before and after the update."""
    cfg = _cfg("tasks.types=[code_o, code_i]", "sampling.teacher_max_new_tokens=64",
               "sampling.student_max_new_tokens=8", "train.lr=1e-3", "seed=1",
               "train.kl_rows=1000")
    sp = SelfPlay(cfg, tmp_path)
    p = sp.parts
    try:
        clock = _Clock()
        pairs = [x for x in sp.matchmaking(1) if x[0] == "T0"]  # T1 and its student sit out
        proposals = [x for x in sp.proposal(1, clock) if x.teacher == "T0"]
        validities = sp.verification(1, proposals).validities
        attempts = [replace(a, grade=replace(a.grade, outcome=(Outcome.CORRECT, Outcome.WRONG)[i % 2]))
                    for i, a in enumerate(sp.solving(1, pairs, proposals, validities, clock))]
        rollouts = [x.rollout for x in proposals] + [a.rollout for a in attempts]
        idle = set(p.slot) - {r.member for r in rollouts}
        assert len(idle) == 2 and "T1" in idle

        def logprobs() -> tuple[torch.Tensor, torch.Tensor]:
            with torch.no_grad():
                lp, mask = sequence_logprobs(p.model, p.bank, [r.prompt_ids for r in rollouts],
                                             [r.token_ids for r in rollouts],
                                             [p.slot[r.member] for r in rollouts])
            return lp.float() * mask, mask

        before_lp, mask = logprobs()
        before = {m: p.bank.slot_state(p.slot[m]) for m in idle}
        update = sp.update(pairs, proposals, validities, attempts)
        after_lp, _ = logprobs()
        moved = (after_lp - before_lp).sum(1)
        d = after_lp - before_lp
        k3 = torch.expm1(d) - d
        for member in {r.member for r in rollouts if r.token_ids}:
            rows = [i for i, r in enumerate(rollouts) if r.member == member]
            assert update.kl[member] == pytest.approx(float(k3[rows][mask[rows]].mean()),
                                                      rel=1e-3, abs=1e-7)
            assert update.kl[member] > 0
        assert set(update.kl) & idle == set()
        for m, state in before.items():
            after = p.bank.slot_state(p.slot[m])
            assert all(torch.equal(after[k][w], state[k][w]) for k in state for w in state[k])
        rewards = update.teacher_rewards + update.student_rewards
        advs = trr_advantages([((r.member, r.role, r.type), x)
                               for r, x in zip(rollouts, rewards, strict=True)])
        for member in {r.member for r in rollouts}:
            mine = [(a, float(d)) for r, a, d in zip(rollouts, advs, moved, strict=True)
                    if r.member == member]
            ups = [d for a, d in mine if a > 0]
            downs = [d for a, d in mine if a < 0]
            assert ups and downs, member  # both signs, or the check says nothing
            assert min(ups) > 0 > max(downs), (member, ups, downs)
    finally:
        sp.close()


def test_auto_checkpointing_follows_the_free_memory(tmp_path, monkeypatch):
    """`model.gradient_checkpointing=auto`: the update keeps its activations when a micro-batch
    of the longest sequence fits the free memory, with micro-batches sized to it; micro-batches
    larger than what fits checkpoint, and shared-prompt packs too wide go in parts that fit."""
    import lorapop.selfplay.update as update_mod
    from lorapop.engine.logprobs import HEAD_CHUNK
    from lorapop.engine.memory import update_bytes_per_token, update_fixed_bytes

    sp = SelfPlay(_cfg("model.gradient_checkpointing=auto", "train.micro_batch_tokens=500"),
                  tmp_path)
    model = sp.parts.model
    try:
        fixed, per_token = update_fixed_bytes(model, HEAD_CHUNK), update_bytes_per_token(model)
        for tokens, keep, cap in ((99, 0, 500), (300, 300, 300), (10**6, 10**6, 500)):
            monkeypatch.setattr(update_mod, "update_budget",
                                lambda m, share, t=tokens: fixed + t * per_token)
            assert sp.policy.memory_plan(100) == (keep, cap)
        shares = []  # `train.memory_share` reaches the budget (None: the allocator decides)
        monkeypatch.setattr(update_mod, "update_budget",
                            lambda m, share: shares.append(share) or fixed + 300 * per_token)
        sp.policy.memory_plan(100)
        sp.cfg.train.memory_share = 0.5
        sp.policy.memory_plan(100)
        assert shares == [None, 0.5]
        sp.cfg.train.memory_share = None

        def checkpointed() -> bool:
            return any(getattr(m, "gradient_checkpointing", False) for m in model.modules())

        seen = []  # per micro-batch: (longest sequence, checkpointing on)
        logprobs = update_mod.sequence_logprobs

        def spy(model_, bank, prompts, comps, *a, **kw):
            longest = max(len(x) + len(y) for x, y in zip(prompts, comps, strict=True))
            seen.append((longest, checkpointed()))
            return logprobs(model_, bank, prompts, comps, *a, **kw)

        monkeypatch.setattr(update_mod, "sequence_logprobs", spy)
        monkeypatch.setattr(update_mod, "update_budget", lambda m, share: fixed + 60 * per_token)
        sp.run(1)  # the tiny config's sequences are longer than 60 tokens: all checkpoint
        assert seen and all(ckpt for _, ckpt in seen)
        seen.clear()
        monkeypatch.setattr(update_mod, "update_budget", lambda m, share: fixed + 10**6 * per_token)
        sp.run(2)
        assert seen and not any(ckpt for _, ckpt in seen)
        # room for the shorter sequences only: packs wider than the room go in parts that fit,
        # so only a row longer than the room (alone) checkpoints
        widths = sorted(w for w, _ in seen)
        room = widths[len(widths) // 2]
        seen.clear()
        monkeypatch.setattr("lorapop.engine.memory.MIN_KEEP_TOKENS", 1)
        monkeypatch.setattr(update_mod, "update_budget", lambda m, share: fixed + room * per_token)
        sp.run(3)
        assert not all(ckpt for _, ckpt in seen)
        assert all(ckpt == (longest > room) for longest, ckpt in seen)
    finally:
        sp.close()


def test_packed_answers_and_mixed_adapter_micro_batches_train_like_separate_rows(
        tmp_path, monkeypatch):
    """`train.share_prompts` and `train.micro_batch_by_slot=false` are exact: a step with packed
    answers, or with every adapter's rows in shared micro-batches, leaves every adapter where
    the same step with one sequence per answer, one adapter per micro-batch, leaves it (fp32)."""
    import lorapop.selfplay.update as update

    banks, counts = [], []
    packer = update.pack_micro_batches
    monkeypatch.setattr(update, "pack_micro_batches", lambda *a: counts.append(len(packer(*a)))
                        or packer(*a))
    for share, by_slot in ((True, True), (False, True), (True, False)):
        cfg = _cfg(f"train.share_prompts={str(share).lower()}", "tasks.answers_per_task=3",
                   f"train.micro_batch_by_slot={str(by_slot).lower()}", "evolve.every=0",
                   "train.lr=1e-3")
        sp = SelfPlay(cfg, tmp_path / f"{share}{by_slot}")
        try:
            sp.run(1)
            banks.append(sp.parts.bank.weights.detach().clone())
        finally:
            sp.close()
    assert counts[2] < counts[0]  # mixing the adapters' rows made fewer micro-batches
    assert not torch.equal(banks[0], torch.zeros_like(banks[0]))
    for other in banks[1:]:
        torch.testing.assert_close(banks[0], other, rtol=1e-4, atol=1e-6)


def test_deterministic_runs_repeat_and_leave_the_settings_as_they_were(tmp_path, monkeypatch):
    """`train.deterministic`: every update runs on strict deterministic kernels (on CPU the
    probe finds one for each op), two runs of one seed give the same rows and adapters, and the
    same as a run without it (CPU kernels are deterministic anyway: the probe changes nothing);
    torch's settings are the caller's again after each run."""
    from torch.utils import deterministic

    modes, update = [], SelfPlay.update  # (deterministic, warn only) while each update runs
    monkeypatch.setattr(SelfPlay, "update", lambda self, *a: modes.append(
        (torch.are_deterministic_algorithms_enabled(),
         torch.is_deterministic_algorithms_warn_only_enabled())) or update(self, *a))
    runs = []
    for name, on in (("a", True), ("b", True), ("off", False)):
        cfg = _cfg("tasks.types=[code_o, code_i]", "sampling.teacher_max_new_tokens=48",
                   "sampling.student_max_new_tokens=8", "seed=1",  # (valid tasks: updates move)
                   f"train.deterministic={str(on).lower()}")
        sp = SelfPlay(cfg, tmp_path / name)
        try:
            sp.run(2)
            runs.append((_rows(tmp_path / name), sp.parts.bank.weights.detach().clone(), sp.kernels))
        finally:
            sp.close()
        assert not torch.are_deterministic_algorithms_enabled()
        assert deterministic.fill_uninitialized_memory
    assert modes == [(True, False)] * 4 + [(True, True)] * 2  # off: on CPU warn-only
    (a, wa, ka), (b, wb, kb), (off, woff, koff) = runs
    assert ka == kb == {"deterministic_kernels": True, "no_deterministic_kernel": None}
    assert koff == {"deterministic_kernels": False, "no_deterministic_kernel": None}
    assert a == b == off and torch.equal(wa, wb) and torch.equal(wa, woff)
    assert any(m["grad_norm"] for r in a for m in r["members"].values())  # (the updates moved)


def test_kept_decoders_leave_the_run_as_it_was(tmp_path):
    """Generation shapes kept from step to step (their graphs captured once on a GPU) change
    no sample, reward or update of the run."""
    want = _run(_cfg(), tmp_path / "fresh", 2)
    sp = SelfPlay(_cfg("sampling.keep_decoders=3"), tmp_path / "kept")
    try:
        sp.run(2)
        assert sp.decoders.reused > 0 and len(sp.decoders.decoders) <= 3
    finally:
        sp.close()
    for got, ref in zip(_rows(tmp_path / "kept"), want, strict=True):
        assert _difference(got, ref) is None, _difference(got, ref)


def _verify_by_length(self, texts, runner, *, bases=None, teachers=None, step=None):
    """A verdict from the text alone (a random model writes no valid task): even lengths give
    an identity task on inputs drawn from the text."""
    who = teachers or [None] * len(texts)
    out = []
    for t, w in zip(texts, who, strict=True):
        ins = tuple(repr(len(t) + k) for k in range(2 if self.name == "code_f" else 1))
        task = Task(self.name, "def f(x):\n    return x", ins, ins, "It returns its input.", w, step)
        out.append(Validity(True, task=task) if len(t) % 2 == 0 else Validity(False, "odd"))
    return out


def test_overlapped_rollouts_equal_the_phases_in_turn(tmp_path, monkeypatch):
    """One continuous batch for proposals and answers (the answers to a valid proposal start
    once it is verified, the buffer's at the end, the cache re-sized to the answers' then)
    gives the records of the phases run one after the other: proposals, verdicts, buffers,
    answers, grades, update. The step keeps its five phases; the rollouts' generation
    reports its re-grids."""
    for cls in (ProgramInputFamily, CodeF):
        monkeypatch.setattr(cls, "verify", _verify_by_length)
    cfg = ["sampling.teacher_max_new_tokens=24", "sampling.student_max_new_tokens=24",
           "tasks.answers_per_task=4", "tasks.fill_from_buffer=true"]
    want = _run(_cfg(*cfg, "sampling.overlap=false"), tmp_path / "phases", 2)
    assert all(m["answers"] for r in want for m in r["matchups"])  # own tasks were answered
    sp = SelfPlay(_cfg(*cfg), tmp_path / "overlap")
    try:
        assert sp._overlaps()
        sp.run(2)
    finally:
        sp.close()
    raw = [json.loads(x) for x in (tmp_path / "overlap" / "metrics.jsonl").read_text().splitlines()]
    for row in raw:
        assert {"matchmaking", "proposal", "verification", "solving", "update"} <= set(row["phase_s"])
        assert set(row["generation"]) == {"rollouts"}
        assert row["generation"]["rollouts"]["regrids"] >= 1  # to the answers' batch
    for got, ref in zip(_rows(tmp_path / "overlap"), want, strict=True):
        assert _difference(got, ref) is None, _difference(got, ref)


def test_a_verification_error_during_overlapped_rollouts_stops_the_step(tmp_path, monkeypatch):
    """An error in the verifying thread reaches the step (nothing of it is written), and the
    thread is gone."""
    import threading

    def broken(self, texts, runner, **kw):
        raise RuntimeError("sandbox exploded")

    monkeypatch.setattr(ProgramInputFamily, "verify", broken)
    sp = SelfPlay(_cfg(), tmp_path)
    try:
        with pytest.raises(RuntimeError, match="sandbox exploded"):
            sp.step()
        assert sp.step_done == 0 and not (tmp_path / "metrics.jsonl").exists()
        assert not [t for t in threading.enumerate() if t.name.startswith("verify")]
    finally:
        sp.close()
