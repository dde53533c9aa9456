"""The PopuLoRA self-play loop: five phases per step, replacement every `evolve.every` steps.

    matchmaking -> proposal -> verification -> solving -> update   (-> replacement)

Each phase takes what it needs and returns frozen records (pairs -> proposals -> validities
-> graded attempts -> update statistics); `step()` gathers them into the step's record, from
which the metrics row is computed. A *member* is a name bound to an adapter slot. In
`population` mode teachers T0.. and students S0.. are separate members; in `single` mode (the
Absolute Zero Reasoner baseline) one member A0 proposes and solves its own tasks through the
same code. Every random choice of step s draws from generators seeded by (seed, s, phase), so
a resumed run replays exactly what an uninterrupted one does. The update's policy step (packing,
memory plan, loss, all-reduce) is `lorapop.selfplay.update`.
"""

from __future__ import annotations

import hashlib
import json
import random
import time
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lorapop import dist
from lorapop.config import Config, dump_config
from lorapop.engine.determinism import (
    deterministic_algorithms,
    fix_cublas_workspace,
    missing_kernel,
)
from lorapop.engine.generate import GenerateSpec, Generation, KeptDecoders, SamplingParams, generate
from lorapop.league import Role, match, match_results, plan_replacement, rate_children
from lorapop.lora import evolve
from lorapop.rl import RewardScheme, solve_rate, solve_rates, student_reward, teacher_reward
from lorapop.run.checkpoint import load_checkpoint, resume_point, save_checkpoint, truncate_jsonl
from lorapop.run.rollouts import step_records, write_records
from lorapop.selfplay.overlap import AnswerAsk, AnswerFeed, answer_key
from lorapop.selfplay.parts import build, derive_seed, load_state, save_state
from lorapop.selfplay.records import (
    Attempt,
    Difficulty,
    MemberInfo,
    Proposal,
    Rollout,
    SolverAnswer,
    StepRecord,
    Update,
    Verification,
    step_metrics,
)
from lorapop.selfplay.update import PolicyUpdate, nonfinite
from lorapop.tasks.task import Grade, Task, Validity


class NonFiniteError(RuntimeError):
    """A step's loss, gradient or updated adapter is not finite (`train.nonfinite`): the run
    stops before anything of the step is written; the message is one line."""


class Stopped(Exception):  # noqa: N818 (a request, not an error)
    """`request_stop()` was honoured: the run checkpointed the step it finished and returned
    control (raised out of `run`, so callers tell it from reaching `train.steps`)."""


class SelfPlay:
    """A run: its parts (`lorapop.selfplay.parts`), `run()` trains and checkpoints, `step()` does one step.

    Under torchrun (`world` from `dist.init`) every rank builds the same SelfPlay: rows are
    split across ranks and their results gathered, so every rank holds the same records,
    league and bank; only rank 0 writes the run directory.
    """

    def __init__(self, cfg: Config, run_dir: str | Path, resume: bool = False,
                 from_step: int | None = None, world: dist.World = dist.SINGLE) -> None:
        """`resume` continues from the last checkpoint, or from the one of `from_step`."""
        self.cfg = cfg
        self.world = world
        keep = cfg.sampling.keep_decoders
        self.decoders = KeptDecoders(keep) if keep else None  # generation shapes kept
        if world.distributed and cfg.lora.dropout > 0:
            warnings.warn("lora.dropout > 0 under torchrun: dropout masks depend on how rows are "
                          "split across ranks, so results depend on the number of ranks",
                          stacklevel=2)
        self.run_dir = Path(run_dir)
        self.metrics_path = self.run_dir / "metrics.jsonl"
        if not resume and self.metrics_path.exists():
            raise ValueError(f"{self.run_dir} already holds a run: --resume it or pick another --out")
        ckpt = resume_point(self.run_dir, from_step) if resume else None
        self.stop_requested = ""  # why a stop was asked for (a signal's name); "" none
        if cfg.train.deterministic:
            fix_cublas_workspace()  # before the model first touches CUDA
        # built before the run directory exists: a model that cannot load leaves nothing behind
        self.parts = build(cfg)
        self.policy = PolicyUpdate(self.parts, cfg, world)
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        except OSError:
            self.parts.close()
            raise
        self.rewards = RewardScheme(teacher_conversion=cfg.train.teacher_conversion,
                                    teacher_format_penalty=cfg.train.teacher_format_penalty)
        self.step_done = 0
        try:
            if ckpt is not None:
                self.step_done = load_checkpoint(self.run_dir, ckpt,
                                                 lambda folder: load_state(self.parts, folder))
            self.check_ranks("after loading", base=dist.fingerprint(self.parts.model.parameters()))
            #: the first line of the error of an update op without a deterministic kernel
            self.no_deterministic_kernel = (missing_kernel(self.policy.kernel_probe)
                                            if cfg.train.deterministic else None)
        except BaseException:
            self.parts.close()
            raise
        if world.main:
            if ckpt is None:
                (self.run_dir / "config.yaml").write_text(dump_config(cfg))
            truncate_jsonl(self.metrics_path, self.step_done)

    # ------------------------------------------------------------------ the loop
    def run(self, steps: int | None = None, on_step: Callable[[dict], None] | None = None) -> None:
        """Train until `steps` (default cfg.train.steps) steps are done, checkpointing."""
        total = self.cfg.train.steps if steps is None else steps
        while self.step_done < total:
            row = self.step()
            if on_step is not None:
                on_step(row)
            if self.world.distributed:  # a signal may reach some ranks a step before others:
                # stop together, or the rest would wait for them in the next step's collectives
                self.stop_requested = next((w for w in dist.all_gather(self.stop_requested,
                                                                        self.world) if w), "")
            if self.step_done % self.cfg.run.save_every == 0 or self.step_done == total \
                    or self.stop_requested:
                self.save()
            if self.stop_requested and self.step_done < total:
                raise Stopped(self.stop_requested)

    def request_stop(self, why: str) -> None:
        """Ask `run` to stop at the end of the running step, after checkpointing it (safe to
        call from a signal handler: it only sets a flag)."""
        self.stop_requested = why

    def step(self, before_replacement: Callable[[int], None] | None = None) -> dict[str, Any]:
        """One step; `before_replacement(step)` runs after the update when the step ends with a
        replacement, before it (to score members as they trained, the replaced ones too)."""
        s = self.step_done + 1
        clock = _Clock()
        with clock.phase("matchmaking"):
            pairs = self.matchmaking(s)
        if self._overlaps():
            proposals, verification, attempts = self.rollouts(s, pairs, clock)
        else:
            with clock.phase("proposal"):
                proposals = self.proposal(s, clock)
            with clock.phase("verification"):
                verification = self.verification(s, proposals)
            with clock.phase("solving"):
                attempts = self.solving(s, pairs, proposals, verification.validities, clock)
        with clock.phase("update"), self._update_kernels():
            update = self.update(pairs, proposals, verification.validities, attempts)
        difficulty = None
        if self._measures_difficulty(s):
            with clock.phase("difficulty"):
                difficulty = self.difficulty(s, proposals, verification.validities, clock)
        replacements: list[dict[str, Any]] = []
        if self.cfg.evolve.every and not self.parts.single and s % self.cfg.evolve.every == 0:
            if before_replacement is not None:
                before_replacement(s)
            with clock.phase("replacement"):
                replacements = self.replacement(s)
        self.step_done = s
        if self.cfg.run.check_every and s % self.cfg.run.check_every == 0:
            self.check_ranks(f"after step {s}")
        rec = StepRecord(s, pairs, proposals, verification, attempts, update, replacements,
                         clock.phase_s, clock.generated_tokens, clock.generation_s,
                         clock.generation, difficulty)
        row = step_metrics(rec, self.league_summary())
        if self.world.distributed:
            row.update(ranks=self.world.size, allreduce_s=round(self.policy.allreduce_s, 4))
        if self.world.main:  # every rank holds the same records
            with open(self.metrics_path, "a") as fh:
                fh.write(json.dumps(row) + "\n")
            if self.cfg.run.rollouts > 0:
                write_records(self.run_dir, s, step_records(
                    rec, row, self.parts.tokenizer.decode, self.cfg.run.rollouts,
                    derive_seed(self.cfg.seed, s, "rollouts")))
        return row

    # ------------------------------------------------------------------ phases
    def matchmaking(self, step: int) -> list[tuple[str, str]]:
        """PFSP: every teacher draws its students; every student plays."""
        if self.parts.ratings is None:
            return [("A0", "A0")]
        lg = self.cfg.league
        return match(
            self.parts.ratings, _rng(self.cfg.seed, step, "match"),
            per_teacher=lg.students_per_teacher, mode=lg.pfsp, exponent=lg.hard_exponent,
        )

    def proposal(self, step: int, clock: _Clock) -> list[Proposal]:
        """Each teacher writes `proposals_per_type` tasks of each type, shown K references."""
        asks, prompts = self._proposal_asks(step)
        gens = self._generate(prompts, [teacher for teacher, _, _ in asks],
                              self.cfg.sampling.teacher_max_new_tokens,
                              derive_seed(self.cfg.seed, step, "proposal"), clock)
        return _proposals(asks, gens)

    def _proposal_asks(self, step: int) -> tuple[list[tuple[str, str, Task | None]], list[str]]:
        """(teacher, type, base) and the prompt of each proposal to write."""
        rng = _rng(self.cfg.seed, step, "proposal")
        asks, prompts = [], []  # (teacher, type, base) of each proposal to write
        for teacher in self.parts.teachers:
            for t, fam in self.parts.families.items():
                for _ in range(self.cfg.tasks.proposals_per_type):
                    refs = self.parts.buffers[t].sample(self.cfg.tasks.references, rng)
                    base = self._base_program(t, rng) if fam.needs_base else None
                    asks.append((teacher, t, base))
                    prompts.append(fam.teacher_prompt(refs, base))
        return asks, prompts

    def verification(self, step: int, proposals: list[Proposal]) -> Verification:
        """The sandbox judges every proposal; valid tasks enter their type's buffer and, where
        the teacher wrote the program (not code_f's, from the buffer), its coverage count."""
        return self._admit_tasks([p.type for p in proposals],
                                 self._verdicts(step, dict(enumerate(proposals))))

    def _verdicts(self, step: int, proposals: dict[int, Proposal]) -> dict[int, Validity]:
        """Each proposal's verdict, by its index (a proposal's verdict depends on it alone)."""
        validity: dict[int, Validity] = {}
        for t, fam in self.parts.families.items():
            mine = [i for i, p in proposals.items() if p.type == t]
            if mine:
                verdicts = self._split(
                    [proposals[i] for i in mine], lambda ps, fam=fam: fam.verify(
                        [p.rollout.text for p in ps], self.parts.sandbox, step=step,
                        bases=[p.base for p in ps], teachers=[p.teacher for p in ps]))
                validity.update(zip(mine, verdicts, strict=True))
        return validity

    def _admit_tasks(self, types: list[str], validity: dict[int, Validity]) -> Verification:
        """The valid tasks (of proposals of `types`) enter their type's buffer (in proposal
        order, type by type) and the coverage counts."""
        coverage = {}
        for t in self.parts.families:
            mine = [i for i, type_ in enumerate(types) if type_ == t]
            tasks = [v.task for i in mine if (v := validity[i]).valid and v.task is not None]
            for task in tasks:
                self.parts.buffers[t].add(task)
            cov = self.parts.coverage.get(t)
            coverage[t] = None if cov is None else cov.update(task.program for task in tasks)
        return Verification([validity[i] for i in range(len(types))], coverage,
                            {t: len(b) for t, b in self.parts.buffers.items()})

    def solving(self, step: int, pairs: list[tuple[str, str]], proposals: list[Proposal],
                validities: list[Validity], clock: _Clock) -> list[Attempt]:
        """Each matched student answers each valid task of its teacher n times."""
        asks = self._answer_asks(step, pairs, [p.teacher for p in proposals], validities)
        gens = self._generate([a.prompt for a in asks], [a.student for a in asks],
                              self.cfg.sampling.student_max_new_tokens,
                              derive_seed(self.cfg.seed, step, "solving"), clock,
                              keys=[a.key for a in asks])
        return self._attempts(asks, gens)

    def _answer_asks(self, step: int, pairs: list[tuple[str, str]], teachers: list[str],
                     validities: list[Validity]) -> list[AnswerAsk]:
        """The answers to write, in the step's order: pair by pair, its teacher's valid tasks
        in proposal order and then those filled from the buffer, n answers each. Each keeps a
        key of (pair, task, n) alone (`answer_key`), so its sample does not depend on the
        other answers (nor on when it starts)."""
        rng = _rng(self.cfg.seed, step, "solving")
        per_teacher: dict[str, list[tuple[Task, int | None]]] = defaultdict(list)
        for i, (teacher, v) in enumerate(zip(teachers, validities, strict=True)):
            if v.valid and v.task is not None:
                per_teacher[teacher].append((v.task, i))
        if self.cfg.tasks.fill_from_buffer:
            want = self.cfg.tasks.proposals_per_type
            for teacher in self.parts.teachers:
                for t in self.parts.families:
                    have = sum(task.type == t for task, _ in per_teacher[teacher])
                    fill = self.parts.buffers[t].sample(max(0, want - have), rng)
                    per_teacher[teacher].extend((task, None) for task in fill)
        asks = []
        for pair, (teacher, student) in enumerate(pairs):
            filled = 0
            for task, proposal in per_teacher[teacher]:
                index = proposal if proposal is not None else len(teachers) + filled
                filled += proposal is None
                asks += self._answers(pair, (teacher, student), task, index, len(teachers),
                                      own=proposal is not None)
        return asks

    def _answers(self, pair: int, match: tuple[str, str], task: Task, index: int,
                 proposals: int, own: bool) -> list[AnswerAsk]:
        """The n answers of pair `pair` (teacher, student) to a task: the step's proposal
        `index`'s, or with `index` = proposals + j the j-th filled from the buffer."""
        prompt = self.parts.families[task.type].student_prompt(task)
        n = self.cfg.tasks.answers_per_task
        return [AnswerAsk(*match, task, own, prompt, answer_key(pair, index, j, proposals, n))
                for j in range(n)]

    def _attempts(self, asks: list[AnswerAsk], gens: list[Generation]) -> list[Attempt]:
        """The answers graded (the sandbox runs what a type's check needs)."""
        grade: dict[int, Grade] = {}  # answer index -> its grade
        for t, fam in self.parts.families.items():
            mine = [i for i, a in enumerate(asks) if a.task.type == t]
            if mine:
                grades = self._split(mine, lambda ix, fam=fam: fam.check(
                    [asks[i].task for i in ix], [gens[i].text for i in ix], self.parts.sandbox))
                grade.update(zip(mine, grades, strict=True))
        return [Attempt(a.teacher, a.student, a.task, a.own,
                        _rollout(a.student, "student", a.task.type, g), grade[i])
                for i, (a, g) in enumerate(zip(asks, gens, strict=True))]

    def rollouts(self, step: int, pairs: list[tuple[str, str]], clock: _Clock
                 ) -> tuple[list[Proposal], Verification, list[Attempt]]:
        """`proposal`, `verification` and `solving` as one continuous batch
        (`lorapop.selfplay.overlap`): the same records, each row the same samples. The clock
        keeps the three phases: proposal up to the last proposal's end, verification up to
        the last verdict, solving the rest (grading included); the generation's own timing
        is under `rollouts`."""
        sp = self.cfg.sampling
        asks, prompts = self._proposal_asks(step)
        teachers = [teacher for teacher, _, _ in asks]

        def verify(done: dict[int, Generation]) -> dict[int, Validity]:
            return self._verdicts(step, dict(zip(done, _proposals([asks[i] for i in done],
                                                                  list(done.values())),
                                                 strict=True)))

        def answers_of(i: int, v: Validity) -> list[AnswerAsk]:
            if not v.valid or v.task is None:
                return []
            return [a for pair, match in enumerate(pairs) if match[0] == teachers[i]
                    for a in self._answers(pair, match, v.task, i, len(asks), own=True)]

        verification: list[Verification] = []

        def all_answers(verdicts: dict[int, Validity]) -> list[AnswerAsk]:
            verification.append(self._admit_tasks([t for _, t, _ in asks], verdicts))
            return self._answer_asks(step, pairs, teachers, verification[0].validities)

        feed = AnswerFeed(len(asks), verify, answers_of, all_answers, self.parts.slot.__getitem__,
                          derive_seed(self.cfg.seed, step, "solving"), sp.student_max_new_tokens)
        clock.current = "rollouts"
        t0 = time.perf_counter()
        try:
            gens = self._generate(prompts, teachers, sp.teacher_max_new_tokens,
                                  derive_seed(self.cfg.seed, step, "proposal"), clock, feed=feed)
        finally:
            feed.close()
        proposals = _proposals(asks, gens[: len(asks)])
        by_key = dict(zip(feed.fed, gens[len(asks):], strict=True))
        assert feed.asks is not None
        attempts = self._attempts(feed.asks, [by_key[a.key] for a in feed.asks])
        end = _synced_now()
        clock.phase_s.update(proposal=feed.times["proposals"] - t0,
                             verification=feed.times["verified"] - feed.times["proposals"],
                             solving=end - feed.times["verified"])
        return proposals, verification[0], attempts

    def update(self, pairs: list[tuple[str, str]], proposals: list[Proposal],
               validities: list[Validity], attempts: list[Attempt]) -> Update:
        """Rewards, TRR++ advantages, one joint policy-gradient step, rating updates."""
        rates = solve_rates(((a.teacher, a.task.key), a.grade.outcome) for a in attempts if a.own)
        student_rewards = [student_reward(a.grade.outcome, self.rewards) for a in attempts]
        teacher_rewards = [
            teacher_reward(v.valid, rates.get((p.teacher, v.task.key)) if v.task else None,
                           self.rewards)
            for p, v in zip(proposals, validities, strict=True)
        ]
        rollouts = [p.rollout for p in proposals] + [a.rollout for a in attempts]
        probe = self._kl_rows(rollouts)
        before = self.policy.token_logprobs(probe)
        losses, grad_norms, advs = self.policy.step(rollouts, teacher_rewards + student_rewards)
        if bad := nonfinite(self.parts, losses, grad_norms):
            step = self.step_done + 1
            raise NonFiniteError(
                f"step {step}: {bad}; stopped before writing anything of step {step} (the last "
                "checkpoint is intact): lower train.lr or train.max_grad_norm, or check the "
                "model's dtype")
        kl = self.policy.kl(probe, before)
        if self.parts.ratings is not None:
            lg = self.cfg.league
            match_rates = [solve_rate(a.grade.outcome for a in attempts
                                      if a.teacher == teacher and a.student == student and a.own)
                           for teacher, student in pairs]
            results = match_results(match_rates, lg.draw_margin, lg.outcome_center)
            for (teacher, student), result in zip(pairs, results, strict=True):
                self.parts.ratings.record(teacher, student, result)
        n = len(proposals)
        return Update(teacher_rewards, student_rewards, losses, grad_norms, advs[:n], advs[n:],
                      kl)

    def _overlaps(self) -> bool:
        """Whether the step's rollouts run as one continuous batch (`sampling.overlap`)."""
        return self.cfg.sampling.overlap and not self.world.distributed and self.decoders is None

    def _measures_difficulty(self, step: int) -> bool:
        """Whether the fixed solver measures at `step`, after the update. A member solver is
        copied here once, at its `freeze_step` (kept in checkpoints), and measures from then."""
        dc, p = self.cfg.difficulty, self.parts
        if not dc.every:
            return False
        if dc.solver != "base" and p.solver is None:
            if step < (dc.freeze_step or dc.every):
                return False
            p.solver = p.bank.weights[p.slot[dc.solver]].detach().clone()
        return step % dc.every == 0

    def difficulty(self, step: int, proposals: list[Proposal], validities: list[Validity],
                   clock: _Clock) -> Difficulty:
        """The fixed solver (`cfg.difficulty`: the base model with no adapter, or a copy of a
        member taken once) answers a sample of each teacher's valid tasks of the step. Its
        draws come from seeds of (seed, step, 'difficulty') and it changes no training state:
        the run trains as it would without it."""
        dc = self.cfg.difficulty
        rng = _rng(self.cfg.seed, step, "difficulty")
        picked: list[tuple[str, Task]] = []
        for teacher in self.parts.teachers:
            mine = [v.task for p, v in zip(proposals, validities, strict=True)
                    if p.teacher == teacher and v.valid and v.task is not None]
            if dc.samples and len(mine) > dc.samples:
                mine = rng.sample(mine, dc.samples)
            picked += [(teacher, task) for task in mine]
        asks = [(teacher, task) for teacher, task in picked for _ in range(dc.answers)]
        prompts = [self.parts.families[task.type].student_prompt(task) for _, task in asks]
        seed = derive_seed(self.cfg.seed, step, "difficulty")
        if dc.solver == "base":
            gens = self._generate(prompts, [teacher for teacher, _ in asks],
                                  self.cfg.sampling.student_max_new_tokens, seed, clock,
                                  adapters=False, training=False)
        else:
            with self.parts.bank.swapped(self.parts.slot[dc.solver], self.parts.solver):
                gens = self._generate(prompts, [dc.solver] * len(asks),
                                      self.cfg.sampling.student_max_new_tokens, seed, clock,
                                      training=False)
        grade: dict[int, Grade] = {}
        for t, fam in self.parts.families.items():
            mine = [i for i, (_, task) in enumerate(asks) if task.type == t]
            if mine:
                grades = self._split(mine, lambda ix, fam=fam: fam.check(
                    [asks[i][1] for i in ix], [gens[i].text for i in ix], self.parts.sandbox))
                grade.update(zip(mine, grades, strict=True))
        return Difficulty(dc.solver, [SolverAnswer(teacher, task, grade[i])
                                      for i, (teacher, task) in enumerate(asks)])

    def _kl_rows(self, rollouts: list[Rollout]) -> list[Rollout]:
        """`train.kl_rows` of the step's non-empty rollouts, drawn from the step's own seed
        (so probing the KL changes nothing else in the run)."""
        rows = [r for r in rollouts if r.token_ids]
        k = min(self.cfg.train.kl_rows, len(rows))
        return _rng(self.cfg.seed, self.step_done + 1, "kl").sample(rows, k) if k else []

    def replacement(self, step: int) -> list[dict[str, Any]]:
        """The weakest members of each sub-population become children of the strongest; the
        log names slots and individuals (`lorapop.league.lineage`)."""
        ev, p = self.cfg.evolve, self.parts
        assert p.ratings is not None  # the baseline never evolves
        crossovers = {n for n, info in evolve.INFO.items() if info.n_parents == 2}
        rng = _rng(self.cfg.seed, step, "replacement")
        log = []
        for role in ("teacher", "student"):
            plan = plan_replacement(p.ratings, role, rng, ev.operators, crossovers,
                                    fraction=ev.fraction, parent_fraction=ev.parent_fraction,
                                    protect_matches=ev.protect_matches)
            for r, entry in zip(plan, p.lineage.replace(plan), strict=True):
                parents = [p.bank.slot_state(p.slot[name]) for name in r.parents]
                try:
                    child = evolve.OPERATORS[r.operator](parents, r.seed)
                except (ValueError, RuntimeError) as e:  # numerics must not end a long run
                    child = evolve.OPERATORS["copy"](parents[:1], r.seed)
                    entry.update(operator="copy", failed=f"{r.operator}: {e}"[:200])
                p.bank.load_slot(p.slot[r.target], child)
                p.opt.reset_slot(p.slot[r.target])
                log.append(entry)
            rate_children(p.ratings, plan, ev.child_rating, sigma_scale=ev.sigma_scale)
        if self.world.distributed:  # operators may round differently on another GPU: rank 0's
            log = dist.broadcast(log, self.world)
            for entry in log:
                dist.broadcast_tensor(p.bank.weights[p.slot[entry["target"]]], self.world)
            p.bank.invalidate_caches()
        return log

    # ------------------------------------------------------------------ helpers
    def league_summary(self) -> dict[str, MemberInfo]:
        """Each member's slot, role, rating and individual, as the metrics row shows them."""
        p = self.parts
        if p.ratings is None:
            return {name: MemberInfo(i, p.role(name), individual=p.lineage.individual(name))
                    for name, i in p.slot.items()}
        ratings = {name: p.ratings.get(name) for name in p.slot}
        return {name: MemberInfo(i, p.role(name), ratings[name].mu, ratings[name].sigma,
                                 p.lineage.individual(name))
                for name, i in p.slot.items()}

    def _generate(self, prompts: list[str], members: list[str], max_new: int, seed: int,
                  clock: _Clock, adapters: bool = True, training: bool = True,
                  keys: list[int] | None = None, feed: AnswerFeed | None = None
                  ) -> list[Generation]:
        """Rows split over ranks by expected tokens, copies of one prompt under one member
        together (they share a prefill); each row keyed by `keys` (default: its index in
        `prompts`), so its sample does not depend on the number of ranks. `adapters=False`:
        the base model alone on every row. `training=False` (the fixed solver's generation):
        decoders of its own (kept ones captured the training's adapters), left out of the
        step's tokens. `feed` (one process only) adds rows as the call runs; they are
        returned after `prompts`'."""
        sp, p = self.cfg.sampling, self.parts
        params = SamplingParams(temperature=sp.temperature, top_p=sp.top_p,
                                max_new_tokens=max_new, eos_token_ids=() if sp.ignore_eos else None)
        ids = [list(p.tokenizer(x)["input_ids"]) for x in prompts]
        slots = [p.slot[m] for m in members]
        idx_keys = list(range(len(prompts))) if keys is None else keys

        def run(idx: list[int]) -> list[Generation]:
            t0, timing = time.perf_counter(), {}
            with nullcontext() if adapters else p.bank.disabled():
                out = generate(p.model, p.bank if adapters else None, p.tokenizer,
                               [ids[i] for i in idx], [slots[i] for i in idx],
                               GenerateSpec(params=params, seed=seed, batch_size=sp.batch_size,
                                            compile=None if sp.compile else False,
                                            prefill_tokens=sp.prefill_tokens,
                                            admit_min=sp.admit_min,
                                            cuda_graph=sp.cuda_graph,
                                            attention=sp.attention,
                                            decoders=self.decoders if training else None),
                               row_keys=[idx_keys[i] for i in idx], timing=timing, feed=feed)
            if training:  # tokens_per_s is the training's; the solver's time is its phase's
                clock.generation_s += time.perf_counter() - t0
            acc = clock.generation.setdefault(clock.current, {})
            for k in ("prefill_s", "prefill_tokens", "capture_s", "decode_s", "steps",
                      *(("feed_s", "regrids") if feed is not None else ())):
                acc[k] = acc.get(k, 0) + timing.get(k, 0)
            return out

        if feed is not None:  # the feed's rows come back after these
            gens = run(list(range(len(prompts))))
        else:
            gens = dist.sharded([len(x) + max_new for x in ids], run, self.world,
                                together=[(s, x) for s, x in zip(slots, prompts, strict=True)])
        if training:
            clock.generated_tokens += sum(len(g.token_ids) for g in gens)
        return gens

    def _split(self, items: list, fn: Callable[[list], list]) -> list:
        """`fn` over this rank's share of `items` (each the same work: a sandbox run), every
        rank's results in the order of `items`."""
        return dist.sharded([1.0] * len(items), lambda idx: fn([items[i] for i in idx]),
                            self.world)

    @property
    def kernels(self) -> dict[str, Any]:
        """What `run.json` records of the update's kernels: deterministic (strict), and the op
        that lacked a deterministic kernel (the update then ran warning: runs may differ)."""
        op = self.no_deterministic_kernel
        return {"deterministic_kernels": self.cfg.train.deterministic and op is None,
                "no_deterministic_kernel": op}

    def _update_kernels(self) -> AbstractContextManager[None]:
        """The update's kernel mode: deterministic with `train.deterministic`, strictly unless
        the probe found an op without such a kernel (generation keeps the default kernels:
        see the config's docstring). On CPU always (warn-only without the option): with more
        than one thread, torch's CPU backward of an index with repeated entries (a packed
        prompt's keys gathered for each answer, `engine/pack_attention`) adds floats from
        several threads atomically, in whatever order they come, unless deterministic
        algorithms are on; its serial kernel costs little next to the update."""
        if not self.cfg.train.deterministic:
            on_cpu = next(self.parts.model.parameters()).device.type == "cpu"
            return deterministic_algorithms(warn_only=True) if on_cpu else nullcontext()
        return deterministic_algorithms(warn_only=self.no_deterministic_kernel is not None)

    def _base_program(self, type_: str, rng: random.Random) -> Task | None:
        """code_f writes inputs for a program taken from the other buffers (AZR)."""
        buffers = self.parts.buffers
        pool = [b for t, b in buffers.items() if t != type_ and len(b)] or [buffers[type_]]
        picked = pool[rng.randrange(len(pool))].sample(1, rng)
        return picked[0] if picked else None

    def check_ranks(self, where: str, **extra: Any) -> None:
        """Fail loudly if any rank's bank, optimizer or league differs from rank 0's."""
        if not self.world.distributed:
            return
        p = self.parts
        league = json.dumps([p.ratings.to_dict() if p.ratings else None, p.lineage.to_dict(),
                             self.step_done,
                             {t: [task.key for task in b] for t, b in p.buffers.items()}])
        dist.check_same({
            "adapter weights": dist.fingerprint(p.bank.weights),
            "optimizer state": dist.fingerprint([p.opt.exp_avg, p.opt.exp_avg_sq, p.opt.steps]),
            "league and buffers": hashlib.sha256(league.encode()).hexdigest(),
            **extra,
        }, self.world, where)

    def save(self) -> Path | None:
        """Rank 0 writes the checkpoint (the others hold the same state)."""
        if not self.world.main:
            return None
        rc = self.cfg.run
        return save_checkpoint(self.run_dir, self.step_done,
                               lambda folder: save_state(self.parts, self.step_done, folder),
                               keep_last=rc.keep_last, keep_every=rc.keep_every)

    def close(self) -> None:
        self.parts.close()


def _proposals(asks: list[tuple[str, str, Task | None]], gens: list[Generation]
               ) -> list[Proposal]:
    return [Proposal(teacher, t, base, _rollout(teacher, "teacher", t, g))
            for (teacher, t, base), g in zip(asks, gens, strict=True)]


def _rollout(member: str, role: Role, type_: str, g: Generation) -> Rollout:
    return Rollout(member, role, type_, g.prompt_ids, g.token_ids, g.logprobs, g.text)


def _rng(seed: int, step: int, phase: str) -> random.Random:
    return random.Random(derive_seed(seed, step, phase))


def _synced_now() -> float:
    """The time once the GPU's queued work is done (a phase ends with its kernels)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


@dataclass
class _Clock:
    """Wall-clock time of a step's phases and of its generation."""

    phase_s: dict[str, float] = field(default_factory=dict)
    generated_tokens: int = 0
    generation_s: float = 0.0
    generation: dict[str, dict[str, float]] = field(default_factory=dict)  # phase -> timing
    current: str = ""  # the phase running

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        self.current = name
        yield
        self.phase_s[name] = _synced_now() - t0
