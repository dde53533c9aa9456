"""The PopuLoRA self-play loop: five phases per step, replacement every `evolve.every` steps.

    matchmaking -> proposal -> verification -> solving -> update   (-> replacement)

A *member* is a name bound to an adapter slot. In `population` mode teachers T0.. and students
S0.. are separate members; in `single` mode (the Absolute Zero Reasoner baseline) one member A0
proposes and solves its own tasks through the same code. Every random choice of step s draws
from generators seeded by (seed, s, phase), so a resumed run replays exactly what an
uninterrupted one does.
"""

from __future__ import annotations

import hashlib
import json
import random
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from lorapop.checkpoint import latest_checkpoint, save_checkpoint, truncate_jsonl
from lorapop.config import Config, dump_config
from lorapop.engine.generate import SamplingParams, generate
from lorapop.engine.logprobs import sequence_logprobs
from lorapop.engine.model import load_base_model, load_tokenizer
from lorapop.engine.step import BankOptimizer
from lorapop.league import Ratings, match, match_outcome, plan_replacement, rate_children
from lorapop.lora import evolve
from lorapop.lora.bank import AdapterBank
from lorapop.lora.peft_io import export_slot, import_slot
from lorapop.rl import RewardScheme, solve_rate, student_reward, teacher_reward, trr_advantages
from lorapop.rl.loss import group_normalizers, policy_loss
from lorapop.steplog import (
    Attempt,
    ProposalSlot,
    Rollout,
    StepRecord,
    solve_rates,
    step_metrics,
)
from lorapop.tasks import get_family
from lorapop.tasks.buffer import TaskBuffer
from lorapop.tasks.metrics import Coverage
from lorapop.tasks.task import Task
from lorapop.verify import Sandbox


class SelfPlay:
    """Holds everything a run needs; `run()` trains and checkpoints, `step()` does one step."""

    def __init__(self, cfg: Config, run_dir: str | Path, resume: bool = False) -> None:
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        if not resume and (self.run_dir / "metrics.jsonl").exists():
            raise ValueError(f"{self.run_dir} already holds a run: --resume it or pick another --out")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(cfg.seed)
        mc = cfg.model
        self.tokenizer = load_tokenizer(mc.tokenizer or mc.name_or_path)
        self.model = load_base_model(mc.name_or_path, self.tokenizer, mc.device, mc.dtype,
                                     cfg.seed, mc.trust_remote_code, mc.random_init)
        if cfg.model.gradient_checkpointing:
            self.model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        self.single = cfg.league.mode == "single"
        if self.single:
            self.teachers, self.students = ["A0"], ["A0"]
        else:
            self.teachers = [f"T{i}" for i in range(cfg.league.teachers)]
            self.students = [f"S{i}" for i in range(cfg.league.students)]
        self.members = list(dict.fromkeys(self.teachers + self.students))
        self.slot = {name: i for i, name in enumerate(self.members)}
        self.bank = AdapterBank(
            self.model, n_slots=len(self.members), rank=cfg.lora.rank, alpha=cfg.lora.alpha,
            dropout=cfg.lora.dropout, target_modules=cfg.lora.target_modules,
        )
        for name, i in self.slot.items():
            self.bank.reset_slot(i, seed=_seed(cfg.seed, "init", name))
        self.opt = BankOptimizer(
            self.bank, lr=cfg.train.lr, betas=cfg.train.betas,
            weight_decay=cfg.train.weight_decay, max_grad_norm=cfg.train.max_grad_norm,
        )
        # the baseline has no opponents, hence no ratings
        self.ratings = None if self.single else Ratings(self.teachers, self.students)
        self.families = {
            t: get_family(t, template=cfg.tasks.template,
                          **({"n_inputs": cfg.tasks.code_f_inputs} if t == "code_f" else {}))
            for t in cfg.tasks.types
        }
        self.buffers = {
            t: TaskBuffer(t, capacity=cfg.tasks.buffer_size, seed=cfg.seed, seeds=f.seed_tasks())
            for t, f in self.families.items()
        }
        if cfg.tasks.seed_tasks:
            self._load_seed_tasks(Path(cfg.tasks.seed_tasks))
        self.coverage = {t: Coverage() for t in self.families}
        self.rewards = RewardScheme(teacher_rule=cfg.train.teacher_reward)
        self.step_done = 0
        self.sandbox = Sandbox(
            workers=cfg.verify.workers, timeout_s=cfg.verify.timeout_s,
            memory_mb=cfg.verify.memory_mb, isolate=cfg.verify.isolate,
        )
        if resume:
            self._load(self.run_dir)
        else:
            (self.run_dir / "config.yaml").write_text(dump_config(cfg))
        self.metrics_path = self.run_dir / "metrics.jsonl"
        truncate_jsonl(self.metrics_path, self.step_done)

    # ------------------------------------------------------------------ the loop
    def run(self, steps: int | None = None, on_step: Callable[[dict], None] | None = None) -> None:
        """Train until `steps` (default cfg.train.steps) steps are done, checkpointing."""
        total = self.cfg.train.steps if steps is None else steps
        while self.step_done < total:
            row = self.step()
            if on_step is not None:
                on_step(row)
            if self.step_done % self.cfg.run.save_every == 0 or self.step_done == total:
                self.save()

    def step(self) -> dict[str, Any]:
        s = self.step_done + 1
        rec = StepRecord(step=s)
        with _timed(rec.phase_s, "matchmaking"):
            rec.pairs = self.matchmaking(s)
        with _timed(rec.phase_s, "proposal"):
            rec.proposals = self.proposal(s, rec)
        with _timed(rec.phase_s, "verification"):
            self.verification(s, rec.proposals)
        with _timed(rec.phase_s, "solving"):
            rec.attempts = self.solving(s, rec)
        with _timed(rec.phase_s, "update"):
            self.update(rec)
        if self.cfg.evolve.every and not self.single and s % self.cfg.evolve.every == 0:
            with _timed(rec.phase_s, "replacement"):
                rec.replacements = self.replacement(s)
        self.step_done = s
        row = step_metrics(self, rec)
        with open(self.metrics_path, "a") as fh:
            fh.write(json.dumps(row) + "\n")
        return row

    # ------------------------------------------------------------------ phases
    def matchmaking(self, step: int) -> list[tuple[str, str]]:
        """PFSP: every teacher draws its students; every student plays."""
        if self.single:
            return [("A0", "A0")]
        lg = self.cfg.league
        return match(
            self.ratings, _rng(self.cfg.seed, step, "match"), per_teacher=lg.students_per_teacher,
            mode=lg.pfsp, exponent=lg.hard_exponent,
        )

    def proposal(self, step: int, rec: StepRecord) -> list[ProposalSlot]:
        """Each teacher writes `proposals_per_type` tasks of each type, shown K references."""
        rng = _rng(self.cfg.seed, step, "proposal")
        slots, prompts = [], []
        for teacher in self.teachers:
            for t, fam in self.families.items():
                for _ in range(self.cfg.tasks.proposals_per_type):
                    refs = self.buffers[t].sample(self.cfg.tasks.references, rng)
                    base = self._base_program(t, rng) if fam.needs_base else None
                    slots.append(ProposalSlot(teacher, t, base))
                    prompts.append(fam.teacher_prompt(refs, base))
        sp = self.cfg.sampling
        gens = self._generate(prompts, [p.teacher for p in slots], sp.teacher_max_new_tokens,
                              _seed(self.cfg.seed, step, "proposal"), rec)
        for p, g in zip(slots, gens, strict=True):
            p.rollout = Rollout(p.teacher, "teacher", p.type, g.prompt_ids, g.token_ids,
                                g.logprobs, g.text)
        return slots

    def verification(self, step: int, proposals: list[ProposalSlot]) -> None:
        """The sandbox judges every proposal; valid tasks enter their type's buffer."""
        for t, fam in self.families.items():
            mine = [p for p in proposals if p.type == t]
            if not mine:
                continue
            verdicts = fam.verify(
                [p.rollout.text for p in mine], self.sandbox, bases=[p.base for p in mine],
                proposers=[p.teacher for p in mine], step=step,
            )
            for p, v in zip(mine, verdicts, strict=True):
                p.validity = v
                if v.valid and v.task is not None:
                    self.buffers[t].add(v.task)

    def solving(self, step: int, rec: StepRecord) -> list[Attempt]:
        """Each matched student answers each valid task of its teacher n times."""
        rng = _rng(self.cfg.seed, step, "solving")
        per_teacher: dict[str, list[tuple[Task, bool]]] = defaultdict(list)
        for p in rec.proposals:
            if p.validity is not None and p.validity.valid and p.validity.task is not None:
                per_teacher[p.teacher].append((p.validity.task, True))
        if self.cfg.tasks.fill_from_buffer:
            want = self.cfg.tasks.proposals_per_type
            for teacher in self.teachers:
                for t in self.families:
                    have = sum(task.type == t for task, _ in per_teacher[teacher])
                    fill = self.buffers[t].sample(max(0, want - have), rng)
                    per_teacher[teacher].extend((task, False) for task in fill)
        attempts, prompts = [], []
        for teacher, student in rec.pairs:
            for task, own in per_teacher[teacher]:
                prompt = self.families[task.type].student_prompt(task)
                for _ in range(self.cfg.tasks.answers_per_task):
                    attempts.append(Attempt(teacher, student, task, own, None))  # type: ignore[arg-type]
                    prompts.append(prompt)
        gens = self._generate(prompts, [a.student for a in attempts],
                              self.cfg.sampling.student_max_new_tokens,
                              _seed(self.cfg.seed, step, "solving"), rec)
        for a, g in zip(attempts, gens, strict=True):
            a.rollout = Rollout(a.student, "student", a.task.type, g.prompt_ids, g.token_ids,
                                g.logprobs, g.text)
        for t, fam in self.families.items():
            mine = [a for a in attempts if a.task.type == t]
            if mine:
                grades = fam.check([a.task for a in mine], [a.rollout.text for a in mine],
                                   self.sandbox)
                for a, grade in zip(mine, grades, strict=True):
                    a.grade = grade
        return attempts

    def update(self, rec: StepRecord) -> None:
        """Rewards, TRR++ advantages, one joint policy-gradient step, rating updates."""
        rates = solve_rates(rec.attempts)
        for a in rec.attempts:
            a.rollout.reward = student_reward(a.grade.outcome, self.rewards)
        for p in rec.proposals:
            valid = bool(p.validity and p.validity.valid)
            key = p.validity.task.key if valid and p.validity.task else None
            p.rollout.reward = teacher_reward(valid, rates.get((p.teacher, key)), self.rewards)
        rollouts = [p.rollout for p in rec.proposals] + [a.rollout for a in rec.attempts]
        self._policy_step(rollouts, rec)
        if not self.single:
            lg = self.cfg.league
            for teacher, student in rec.pairs:
                answers = [a.grade.outcome for a in rec.attempts
                           if a.teacher == teacher and a.student == student and a.own]
                self.ratings.record(teacher, student, match_outcome(
                    solve_rate(answers), lg.teacher_win_below, lg.student_win_above))

    def replacement(self, step: int) -> list[dict[str, Any]]:
        """The weakest members of each sub-population become children of the strongest."""
        ev = self.cfg.evolve
        crossovers = {n for n, info in evolve.INFO.items() if info.n_parents == 2}
        rng = _rng(self.cfg.seed, step, "replacement")
        log = []
        for role in ("teacher", "student"):
            plan = plan_replacement(self.ratings, role, rng, ev.operators, crossovers,
                                    fraction=ev.fraction, parent_fraction=ev.parent_fraction)
            for r in plan:
                parents = [self.bank.slot_state(self.slot[p]) for p in r.parents]
                entry = {"target": r.target, "parents": list(r.parents), "operator": r.operator,
                         "seed": r.seed}
                try:
                    child = evolve.OPERATORS[r.operator](parents, r.seed)
                except (ValueError, RuntimeError) as e:  # numerics must not end a long run
                    child = evolve.OPERATORS["copy"](parents[:1], r.seed)
                    entry.update(operator="copy", failed=f"{r.operator}: {e}"[:200])
                self.bank.load_slot(self.slot[r.target], child)
                self.opt.reset_slot(self.slot[r.target])
                log.append(entry)
            rate_children(self.ratings, plan, ev.child_rating, sigma_scale=ev.sigma_scale)
        return log

    # ------------------------------------------------------------------ helpers
    def _generate(self, prompts: list[str], members: list[str], max_new: int, seed: int,
                  rec: StepRecord):
        sp = self.cfg.sampling
        params = SamplingParams(temperature=sp.temperature, top_p=sp.top_p,
                                max_new_tokens=max_new, eos_token_ids=() if sp.ignore_eos else None)
        t0 = time.perf_counter()
        gens = generate(self.model, self.bank, self.tokenizer, prompts,
                        [self.slot[m] for m in members], params, seed=seed,
                        batch_size=sp.batch_size, compile=None if sp.compile else False)
        rec.generation_s += time.perf_counter() - t0
        rec.generated_tokens += sum(len(g.token_ids) for g in gens)
        return gens

    def _policy_step(self, rollouts: list[Rollout], rec: StepRecord) -> None:
        # slot order lets the bank use grouped matmuls (advantages are computed per group)
        rollouts = sorted((r for r in rollouts if r.token_ids), key=lambda r: self.slot[r.member])
        if not rollouts:
            return
        advs = trr_advantages([((r.member, r.role, r.type), r.reward) for r in rollouts])
        dev = next(self.model.parameters()).device
        slots = torch.tensor([self.slot[r.member] for r in rollouts], device=dev)
        lengths = torch.tensor([len(r.token_ids) for r in rollouts], device=dev)
        full_mask = torch.arange(int(lengths.max()), device=dev)[None, :] < lengths[:, None]
        norms = group_normalizers(full_mask, slots, n_groups=len(self.members))
        self.model.train()
        self.opt.zero_grad()
        mb = self.cfg.train.micro_batch_size
        for start in range(0, len(rollouts), mb):
            part = rollouts[start:start + mb]
            idx = slice(start, start + len(part))
            logprobs, mask = sequence_logprobs(
                self.model, self.bank, [r.prompt_ids for r in part],
                [r.token_ids for r in part], slots[idx],
            )
            # One update per batch is on-policy: the ratio is exactly 1 against the policy's own
            # detached log-probs (the sampler's bf16 values differ by rounding, which would
            # make PPO clip on noise).
            old = logprobs.detach()
            adv = torch.tensor(advs[start:start + len(part)], device=dev, dtype=torch.float32)
            loss, _ = policy_loss(logprobs.float(), old, adv, mask, groups=slots[idx],
                                  clip_eps=self.cfg.train.clip_eps, normalizers=norms)
            loss.backward()
        norms_by_slot = self.opt.step()
        self.opt.zero_grad()
        self.model.eval()
        rec.grad_norms = {m: float(norms_by_slot.get(self.slot[m], 0.0)) for m in self.members}

    def _base_program(self, type_: str, rng: random.Random) -> Task | None:
        """code_f writes inputs for a program taken from the other buffers (AZR)."""
        pool = [b for t, b in self.buffers.items() if t != type_ and len(b)] or [self.buffers[type_]]
        picked = pool[rng.randrange(len(pool))].sample(1, rng)
        return picked[0] if picked else None

    def _load_seed_tasks(self, path: Path) -> None:
        if not path.is_file():
            raise FileNotFoundError(f"tasks.seed_tasks: no such file {path}")
        for line in path.read_text().splitlines():
            if line.strip():
                task = Task.from_json(json.loads(line))
                if task.type in self.buffers:
                    self.buffers[task.type].add(task)

    # ------------------------------------------------------------------ checkpoints
    def save(self) -> Path:
        def write(d: Path) -> None:
            for name, i in self.slot.items():
                export_slot(self.bank, i, d / "adapters" / name, self.cfg.model.name_or_path)
            torch.save(self.opt.state_dict(), d / "optimizer.pt")
            if self.ratings is not None:
                (d / "ratings.json").write_text(json.dumps(self.ratings.to_dict()))
            (d / "buffers").mkdir()
            for t, b in self.buffers.items():
                b.save(d / "buffers" / f"{t}.jsonl")
            (d / "coverage.json").write_text(json.dumps(
                {t: sorted(c.seen) for t, c in self.coverage.items()}))
            torch.save({"torch": torch.get_rng_state(),
                        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available()
                        else None}, d / "rng.pt")
            (d / "state.json").write_text(json.dumps({"step": self.step_done,
                                                      "slots": self.slot}))
            (d / "config.yaml").write_text(dump_config(self.cfg))

        return save_checkpoint(self.run_dir, self.step_done, write)

    def _load(self, run_dir: Path) -> None:
        ckpt = latest_checkpoint(run_dir)
        if ckpt is None:
            raise FileNotFoundError(f"no checkpoint to resume from in {run_dir}")
        state = json.loads((ckpt / "state.json").read_text())
        if state["slots"] != self.slot:
            raise ValueError(f"{ckpt}: members {state['slots']} differ from the config's")
        for name, i in self.slot.items():
            import_slot(self.bank, i, ckpt / "adapters" / name)
        self.opt.load_state_dict(torch.load(ckpt / "optimizer.pt", weights_only=False))
        if self.ratings is not None:
            self.ratings = Ratings.from_dict(json.loads((ckpt / "ratings.json").read_text()))
        for t, b in self.buffers.items():
            self.buffers[t] = TaskBuffer.load(ckpt / "buffers" / f"{t}.jsonl", type=t,
                                              capacity=b.capacity, seed=self.cfg.seed)
        for t, seen in json.loads((ckpt / "coverage.json").read_text()).items():
            if t in self.coverage:
                self.coverage[t].seen = set(seen)
        rng = torch.load(ckpt / "rng.pt", weights_only=False)
        torch.set_rng_state(rng["torch"])
        if rng["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
        self.step_done = state["step"]

    def role(self, name: str) -> str:
        if self.single:
            return "solo"
        return "teacher" if name in self.teachers else "student"

    def close(self) -> None:
        self.sandbox.close()


def _seed(*parts: object) -> int:
    """A stable 63-bit seed from any parts (Python's hash() is salted per process)."""
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def _rng(seed: int, step: int, phase: str) -> random.Random:
    return random.Random(_seed(seed, step, phase))


@contextmanager
def _timed(into: dict[str, float], phase: str) -> Iterator[None]:
    t0 = time.perf_counter()
    yield
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    into[phase] = time.perf_counter() - t0
