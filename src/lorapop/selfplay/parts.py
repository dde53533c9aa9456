"""What a run is made of, built from its config apart from the loop that uses it (the
torchtune recipe's set-up): base model, adapter bank and optimiser, league, task buffers,
sandbox. `save_state` and `load_state` write and read its training state, one checkpoint
structure:

    adapters/<member>/     PEFT adapter directories (`lorapop export` and `eval` read these)
    buffers/<type>.jsonl   the task buffers
    state.pt               step, member slots, optimiser, ratings, lineage, coverage, RNG states
    config.yaml            the run's config
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lorapop.config import Config, dump_config
from lorapop.engine.load import load_base_model, load_tokenizer, use_checkpointing
from lorapop.engine.optim import BankOptimizer
from lorapop.engine.patches import attach_lora
from lorapop.league import Lineage, Ratings
from lorapop.lora.bank import AdapterBank
from lorapop.lora.peft_io import export_slot, import_slot
from lorapop.tasks import TaskFamily, get_family
from lorapop.tasks.buffer import TaskBuffer
from lorapop.tasks.metrics import Coverage
from lorapop.tasks.prompts import chat_format
from lorapop.tasks.task import Task
from lorapop.verify import Sandbox


@dataclass
class Parts:
    """Everything the loop works on; the fields a checkpoint holds are the training state."""

    cfg: Config
    tokenizer: Any
    model: torch.nn.Module
    bank: AdapterBank
    opt: BankOptimizer
    teachers: list[str]
    students: list[str]  # in the single-agent baseline both are ["A0"]
    slot: dict[str, int]  # member name -> adapter slot
    ratings: Ratings | None  # None: the baseline has no opponents, hence no ratings
    lineage: Lineage  # which individual holds each slot (`T0.g3`)
    families: dict[str, TaskFamily]
    buffers: dict[str, TaskBuffer]
    coverage: dict[str, Coverage]  # distinct program shapes the teachers wrote so far, per
    # task type (not code_f's, whose programs come from the buffer)
    sandbox: Sandbox
    solver: torch.Tensor | None = None  # a member's adapter weights frozen as the difficulty
    # solver (`cfg.difficulty.solver`), once copied: one row of `bank.weights`

    @property
    def members(self) -> list[str]:
        return list(self.slot)

    @property
    def single(self) -> bool:
        return self.ratings is None

    def role(self, name: str) -> str:
        """"teacher" or "student"; "solo" for the baseline's A0, which plays both."""
        if self.single:
            return "solo"
        return "teacher" if name in self.teachers else "student"

    def close(self) -> None:
        self.sandbox.close()


def build(cfg: Config) -> Parts:
    """Load the base model and build every part of a fresh run (adapters seeded per member)."""
    torch.manual_seed(cfg.seed)
    mc = cfg.model
    tokenizer = load_tokenizer(mc.tokenizer or mc.name_or_path)
    model = load_base_model(mc.name_or_path, tokenizer, mc.device, mc.dtype, cfg.seed,
                            mc.trust_remote_code, mc.random_init)
    use_checkpointing(model, mc.gradient_checkpointing is True)  # `auto`: at each update
    torch.backends.cuda.enable_cudnn_sdp(mc.cudnn_attention)
    single = cfg.league.mode == "single"
    if single:
        teachers, students = ["A0"], ["A0"]
    else:
        teachers = [f"T{i}" for i in range(cfg.league.teachers)]
        students = [f"S{i}" for i in range(cfg.league.students)]
    slot = {name: i for i, name in enumerate(dict.fromkeys(teachers + students))}
    bank = attach_lora(model, n_slots=len(slot), rank=cfg.lora.rank, alpha=cfg.lora.alpha,
                       dropout=cfg.lora.dropout, target_modules=cfg.lora.target_modules)
    for name, i in slot.items():
        bank.reset_slot(i, seed=derive_seed(cfg.seed, "init", name))
    tc = cfg.train
    opt = BankOptimizer(bank, lr=tc.lr, betas=tc.betas, weight_decay=tc.weight_decay,
                        max_grad_norm=tc.max_grad_norm)
    chat = chat_format(tokenizer) if cfg.tasks.template == "chat" else None
    families = {
        t: get_family(t, template=cfg.tasks.template, chat=chat, rules=cfg.tasks.world_rules(),
                      **({"n_inputs": cfg.tasks.code_f_inputs} if t == "code_f" else {}))
        for t in cfg.tasks.types
    }
    buffers = {
        t: TaskBuffer(t, capacity=cfg.tasks.buffer_size, seed=cfg.seed, seeds=f.seed_tasks())
        for t, f in families.items()
    }
    if cfg.tasks.seed_tasks:
        _add_seed_tasks(buffers, Path(cfg.tasks.seed_tasks))
    vc = cfg.verify
    sandbox = Sandbox(workers=vc.workers, timeout_s=vc.timeout_s, memory_mb=vc.memory_mb,
                      isolate=vc.isolate)
    return Parts(
        cfg=cfg, tokenizer=tokenizer, model=model, bank=bank, opt=opt, teachers=teachers,
        students=students, slot=slot, ratings=None if single else Ratings(teachers, students),
        lineage=Lineage(list(slot)), families=families, buffers=buffers,
        coverage={t: Coverage() for t, f in families.items() if not f.needs_base},
        sandbox=sandbox,
    )


def save_state(p: Parts, step: int, folder: Path) -> None:
    """Write the training state after `step` into an empty `folder` (see the module doc)."""
    for name, i in p.slot.items():
        export_slot(p.bank, i, folder / "adapters" / name, p.cfg.model.name_or_path)
    (folder / "buffers").mkdir()
    for t, b in p.buffers.items():
        b.save(folder / "buffers" / f"{t}.jsonl")
    torch.save({
        "step": step,
        "slots": p.slot,
        "optimizer": p.opt.state_dict(),
        "ratings": None if p.ratings is None else p.ratings.to_dict(),
        "lineage": p.lineage.to_dict(),
        "coverage": {t: sorted(c.seen) for t, c in p.coverage.items()},
        "difficulty_solver": None if p.solver is None else p.solver.cpu(),
        "rng": {"torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None},
    }, folder / "state.pt")
    (folder / "config.yaml").write_text(dump_config(p.cfg))


def load_state(p: Parts, folder: Path) -> int:
    """Restore the training state saved in `folder` into `p`; return its step."""
    if not (folder / "state.pt").is_file():
        raise FileNotFoundError(f"{folder}: no state.pt (a checkpoint of an older lorapop?)")
    state = torch.load(folder / "state.pt", weights_only=True)
    if state["slots"] != p.slot:
        raise ValueError(f"{folder}: members {state['slots']} differ from the config's")
    for name, i in p.slot.items():
        import_slot(p.bank, i, folder / "adapters" / name)
    p.opt.load_state_dict(state["optimizer"])
    if p.ratings is not None:
        p.ratings = Ratings.from_dict(state["ratings"])
    p.lineage = Lineage.from_dict(state.get("lineage", {}), p.members)
    for t, b in p.buffers.items():
        p.buffers[t] = TaskBuffer.load(folder / "buffers" / f"{t}.jsonl", type=t,
                                       capacity=b.capacity, seed=p.cfg.seed)
    for t, seen in state["coverage"].items():
        if t in p.coverage:
            p.coverage[t].seen = set(seen)
    p.solver = state.get("difficulty_solver")
    torch.set_rng_state(state["rng"]["torch"])
    if state["rng"]["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["rng"]["cuda"])
    return state["step"]


def derive_seed(*parts: object) -> int:
    """A stable 63-bit seed from any parts (Python's hash() is salted per process)."""
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def _add_seed_tasks(buffers: dict[str, TaskBuffer], path: Path) -> None:
    if not path.is_file():
        raise FileNotFoundError(f"tasks.seed_tasks: no such file {path}")
    for line in path.read_text().splitlines():
        if line.strip():
            task = Task.from_json(json.loads(line))
            if task.type in buffers:
                buffers[task.type].add(task)
