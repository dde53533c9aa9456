"""One typed config for every knob of a run, loaded from YAML and overridable by `key.path=value`.

Every section forbids unknown keys so that a typo fails loudly with the key's dotted path
instead of silently training with a default.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from lorapop.tasks.domain import InputDomain, WorldRules


class Section(BaseModel):
    # allow_inf_nan=False: `train.lr=.inf` or `sampling.temperature=.nan` is refused at load
    # (an infinite rate trains NaN adapters; an infinite temperature samples uniform noise)
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class ModelConfig(Section):
    name_or_path: str = "tiny-random"
    """A hub id, a local directory, or `tiny-random` (a random-weight Qwen2 built from a config)."""
    tokenizer: str | None = None
    """Tokenizer hub id or path (default: the model's); `byte` is a built-in byte-level one."""
    random_init: bool = False
    """Build the architecture of `name_or_path`'s config.json with random weights instead of
    loading weights: same speed and memory as the real model, for benchmarks."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    gradient_checkpointing: bool | Literal["auto"] = False
    """Recompute activations in the update's backward (less memory, 1.4-1.6x the time); `auto`
    decides at each update from the memory free on the GPU (`engine/memory.plan_update`)."""
    trust_remote_code: bool = False
    cudnn_attention: bool = False
    """Let SDPA choose cuDNN's attention kernel, process-wide. Off by default: cuDNN builds an
    execution plan for each new shape (120-240 ms on H100), and a loop step's prompt and
    completion lengths are new at every step, so its 1.7x faster kernel on long causal rows
    loses overall (the paper step at 128 tokens: 88.2 s with it, 73.9 s without)."""


class LoraConfig(Section):
    rank: int = Field(8, ge=1)
    alpha: float = Field(16.0, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: list[str] = [
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
    ]


class LeagueConfig(Section):
    mode: Literal["population", "single"] = "population"
    """`population` is PopuLoRA; `single` is the Absolute Zero Reasoner baseline (one adapter)."""
    teachers: int = Field(2, ge=1)
    students: int = Field(2, ge=1)
    students_per_teacher: int = Field(1, ge=1)
    pfsp: Literal["even", "hard", "uniform"] = "even"
    """PFSP weighting f(p): even = p(1-p), hard = (1-p)^k (AlphaStar), uniform = ablation."""
    hard_exponent: float = Field(2.0, gt=0)
    outcome_center: Literal["relative", "absolute"] = "relative"
    """A match is won by the side whose student solve rate is more than `draw_margin` off the
    center: relative = this step's mean match solve rate (ratings rank skill even when most
    answers fail), absolute = 0.5 (the earlier rule); see `lorapop.league.ratings`."""
    draw_margin: float = Field(0.1, ge=0, le=0.5)
    """Solve rates within this distance of the center are a draw."""


OPERATORS = (
    "spectral", "layer_noise", "mask", "noise", "dare", "layer_select", "subspace_mix",
    "extrapolate", "copy", "mean",
)
"""Names of `lorapop.lora.evolve.OPERATORS` (a test keeps the two equal; config imports no torch)."""
TWO_PARENT_OPERATORS = ("dare", "layer_select", "subspace_mix", "extrapolate", "mean")
"""The operators that need two parents (`n_parents == 2` in `lorapop.lora.evolve.INFO`)."""


def pool_split(n: int, fraction: float, parent_fraction: float) -> tuple[int, int]:
    """(targets, parents) of one replacement in a pool of `n` members."""
    targets = min(int(fraction * n), n - 1)
    return targets, min(max(1, int(parent_fraction * n)), n - targets)


class EvolveConfig(Section):
    every: int = Field(10, ge=0)
    """Replacement period in steps; 0 turns evolution off."""
    fraction: float = Field(0.25, ge=0, le=0.5)
    """Share of each sub-population replaced (at least one member when > 0)."""
    operators: dict[str, float] = {
        "spectral": 1.0, "layer_noise": 1.0, "dare": 1.0, "subspace_mix": 1.0,
    }
    """Operator name -> sampling weight (names from `lorapop.lora.evolve.OPERATORS`)."""
    parent_fraction: float = Field(0.5, gt=0, le=1)
    """Parents are drawn from this top share of the sub-population. With 2 members per pool
    there is one parent and one target, so each event copies the better over the worse."""
    protect_matches: int = Field(20, ge=0)
    """A child cannot be a replacement target until it has played this many matches (a
    teacher plays `league.students_per_teacher` a step; 20 spans two periods at every=10)."""
    child_rating: Literal["reset", "inherit"] = "inherit"
    sigma_scale: float = Field(2.0, ge=1.0)
    """With `inherit`, a child's sigma is its parents' largest sigma times this (capped at the
    prior; no longer floored at half the prior, which made every child rank last)."""

    @field_validator("operators")
    @classmethod
    def _known_operators(cls, ops: dict[str, float]) -> dict[str, float]:
        unknown = sorted(set(ops) - set(OPERATORS))
        if unknown:
            raise ValueError(f"unknown operator {unknown[0]!r}; known: {', '.join(OPERATORS)}")
        if any(not w >= 0 for w in ops.values()) or not sum(ops.values()) > 0:
            raise ValueError("weights must be >= 0 with a positive sum")
        return ops


class TasksConfig(Section):
    types: list[str] = ["code_o", "code_i", "code_f"]
    """Task families played, by their names in `lorapop.tasks.registry.FAMILIES`: the three
    code families, or any family a module registered (`register_family`) before the config
    is loaded."""
    template: Literal["azr", "compact", "chat"] = "compact"
    """`compact` for the tiny model, `azr` (R1 text) for base models, `chat` wraps the azr prompts
    in the tokenizer's chat template (Instruct/chat models)."""
    proposals_per_type: int = Field(1, ge=1)
    """Tasks each teacher proposes per task type and step."""
    references: int = Field(6, ge=0)
    answers_per_task: int = Field(2, ge=1)
    """Answers each matched student samples for each valid task (n)."""
    code_f_inputs: int = Field(10, ge=2)
    buffer_size: int = Field(1024, ge=1)
    seed_tasks: str | None = None
    """Optional JSONL of tasks that warm-start the buffers."""
    fill_from_buffer: bool = False
    """Top each teacher's valid tasks up from the buffer, so solving always runs at full size
    (for benchmarks and random-weight models; filled tasks give the teacher no reward)."""
    input_domain: InputDomain | None = None
    """Bounds on the values of a proposal's inputs (int_min, int_max, str_chars, items); one
    outside them is invalid. A world's rule (the tiny world's `narrow` table), None: any input."""
    output_domain: InputDomain | None = None
    """The same bounds on the outputs a proposal's program gives (code_o/code_i's gold, code_f's
    examples); None: any output."""
    live_code: bool = False
    """A code_o/code_i program with a dead statement (a no-op, a value stored and never read;
    `lorapop.tasks.liveness`) is invalid."""
    banned_calls: list[str] = []
    """Function and method names a proposal's program may not call (`["count"]`: neither
    `s.count(c)` nor `count(x)`); one that does is invalid. A world's rule (the tiny world's
    `nocount` table)."""

    @field_validator("types")
    @classmethod
    def _registered_types(cls, types: list[str]) -> list[str]:
        from lorapop.tasks.registry import FAMILIES

        for t in types:
            if t not in FAMILIES:
                raise ValueError(f"unknown task type {t!r}{_did_you_mean(t, FAMILIES)}; "
                                 f"registered: {', '.join(FAMILIES)}")
        if len(set(types)) != len(types) or not types:
            raise ValueError("list each task type once, at least one")
        return types

    def world_rules(self) -> WorldRules:
        return WorldRules(self.input_domain, self.output_domain, self.live_code,
                          tuple(self.banned_calls))


class VerifyConfig(Section):
    workers: int = Field(2, ge=1, le=999)
    timeout_s: float = Field(2.0, gt=0, le=86_400, allow_inf_nan=False)
    """Wall-clock limit per program (CPU limit: the next whole second)."""
    memory_mb: int = Field(1024, ge=64, le=1 << 20)
    isolate: bool | Literal["strict"] = True
    """true: every kernel layer the machine allows, a warning for the rest; strict: refuse to
    train when a required layer is missing (`lorapop.verify.kernel.REQUIRED`); false: rlimits
    only (trusted code)."""


class SamplingConfig(Section):
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    teacher_max_new_tokens: int = Field(256, ge=1)
    student_max_new_tokens: int = Field(128, ge=1)
    batch_size: int = Field(64, ge=1)
    """Most rows decoding at once; lowered (logged once) when their KV cache does not fit the
    free GPU memory. Finished rows are refilled with waiting prompts."""
    prefill_tokens: int = Field(8192, ge=1)
    """Most prompt tokens per prefill forward (long prompts are prefilled in chunks)."""
    admit_min: int = Field(0, ge=0)
    """Free rows that waiting prompts wait for before they are admitted (or until all that wait
    fit, or no row runs). Each admission is a prefill forward of its own: where rows end one by
    one (real answer lengths), a larger value makes fewer, larger prefills for a few idle
    row-steps. 1 admits at every host check; 0 once an eighth of the batch is free. A row's
    results do not depend on it."""
    ignore_eos: bool = False
    """Always generate max_new_tokens (fixed lengths for benchmarks)."""
    compile: bool = False
    """On CUDA, torch.compile the decode step: ~1.25x faster decode steps, but ~45 s of
    compilation per new batch/length bucket and padding to buckets; in the 7B 4v4 step it was
    slower overall and peaked 22 GB higher (docs/performance.md). Never used on CPU."""
    cuda_graph: bool = True
    """On CUDA, replay the decode step from CUDA graphs (captured per batch rows and attention
    width at each generation). Off: eager steps, for small models whose generations are
    shorter than their captures take (`generation` in metrics.jsonl shows capture_s)."""
    attention: Literal["auto", "sdpa"] = "auto"
    """Decode attention. auto: on CUDA in bf16/fp16 a Triton kernel that reads only each row's
    own cached positions (lorapop.engine.decode_attention); elsewhere, and with sdpa, SDPA over
    the batch's attention width with a per-row mask (the reference, for comparison)."""
    overlap: bool = True
    """One continuous batch for the proposal, verification and solving phases: proposals are
    verified (on the sandbox's workers) as they finish, and the answers of each valid one
    join the batch while other proposals still decode, so rows that would idle in the
    proposals' tail answer instead; once every proposal is verified the batch re-sizes its
    cache to the answers'. Each row's samples are those of the phases run one after the
    other (its own seed and key). Off: the phases in turn. Used alone on one process without
    kept decoders (`keep_decoders` 0, no torchrun); otherwise the phases run in turn."""
    keep_decoders: int = Field(0, ge=0)
    """Keep the decoders (KV caches and CUDA graphs) of this many generation shapes from one
    phase and step to the next, so each shape's graphs are captured once per run instead of at
    every generation: for small models, whose captures cost more than their decoding (a 77M
    world step: 0.7-0.8 s of 3.5-3.9 s; kept, ~0). Batch and cache length are then rounded up
    to a few buckets so shapes repeat. The kept caches hold their memory through the update:
    0 (off) at 7B."""


class TrainConfig(Section):
    steps: int = Field(200, ge=0)
    lr: float = Field(1e-5, gt=0)
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = Field(0.0, ge=0)
    max_grad_norm: float = Field(1.0, gt=0)
    micro_batch_size: int = Field(16, ge=1)
    """Most sequences per update forward; grouped by length (see micro_batch_tokens). Answers
    of one prompt and adapter form one sequence, the prompt computed once."""
    micro_batch_tokens: int = Field(16384, ge=1)
    """Most padded tokens (sequences x longest) per update forward; a longer one goes alone.
    `model.gradient_checkpointing=auto` lowers it to what fits without checkpointing."""
    memory_share: float | None = Field(None, gt=0, le=1)
    """With `model.gradient_checkpointing=auto`, the share of the GPU's free memory the update's
    micro-batches may fill. None: 0.95 under expandable allocator segments (lorapop's setting),
    0.9 under an allocator setting of your own (`engine/memory.update_budget`); lower it when
    other work shares the GPU."""
    micro_batch_by_slot: bool = True
    """Each update micro-batch holds one adapter's rows (its LoRA one plain GEMM pair): best when
    a micro-batch keeps the GPU busy, as at 7B. false: adapters' rows mix (the bank's grouped
    kernels) in fewer micro-batches, for small models, whose update is bound by kernel
    launches (8 adapters of a 77M model: 2x the single agent's update time by slot). Exact
    either way: the loss is per slot."""
    share_prompts: bool = True
    """Answers of one prompt under one adapter train as one sequence, the prompt computed once
    (exact; `engine/pack_attention`). false: every answer is its own sequence."""
    kl_rows: int = Field(0, ge=0)
    """Rollouts per step (a seeded subsample) on which each member's per-token KL between the
    policy before and after the update is measured and logged (`kl` in metrics.jsonl): two
    extra no-grad forwards of these rows. 0: off."""
    teacher_conversion: Literal["one_minus", "inverse"] = "one_minus"
    """A valid task's reward from its solve rate s, AZR's `generation_accuracy_convertion`:
    one_minus = 1-s if s > 0 else 0 (so 0 at s in {0,1}: PopuLoRA's rule), inverse = 1-s."""
    teacher_format_penalty: float | None = None
    """AZR's composite reward: a valid proposal whose converted reward is not positive gets
    this instead (AZR: -0.5). None (PopuLoRA) keeps the 0."""
    deterministic: bool = False
    """Run each update on deterministic kernels (`engine/determinism`).

    On GPU it guarantees: two runs of one config and seed, on the same GPU model, number of
    ranks, CUDA/cuDNN/torch/transformers versions and `sampling.batch_size`, give bit-identical
    metrics, samples and adapters, whatever `run.save_every` is and across `--resume`; when
    `run.json` records `deterministic_kernels: true` (if an op lacked such a kernel it names
    the op, and the update ran warn-only: that op may round differently). It does not
    guarantee equality across GPU models, driver or library versions, rank counts, or with a
    CPU run, nor that generation's kernels are deterministic in general: generation keeps the
    default kernels (sampling is seeded per row, and runs were observed to agree at their first
    step; sampling's float cumsum has no deterministic CUDA kernel), so a difference in a
    logit's last bit can still pick another token. Without it, GPU runs part from the second
    step, as the update's backward (attention, the bank's gathers and indexing) sums with
    atomics. Measured on an H200 (`benchmarks/deterministic_runs.py`): two runs repeated bit
    for bit, at a cost within the spread between runs.

    On CPU runs are deterministic with or without it: the same config, seed, torch version and
    machine give bit-identical metrics and samples whatever `run.save_every` is and however
    often the run is interrupted and resumed (tests/selfplay/test_repeat.py). The sandbox's wall-clock
    limit (`verify.timeout_s`) is the exception on both: a program that runs near the limit
    may time out on a loaded machine and not on an idle one."""
    nonfinite: Literal["stop"] = "stop"
    """What a non-finite loss, gradient or updated weight does: `stop` ends the run with a one-line
    error naming the step and the member, before anything of that step is written (no metrics
    row, rollouts or checkpoint), so the last checkpoint is the last good state. (The only
    policy: skipping the update would leave the optimizer and league out of step with the
    logged rewards.)"""


class DifficultyConfig(Section):
    """The difficulty of the teachers' tasks as a fixed solver sees it. A student's solve rate
    moves with the students it measures, and program complexity is a proxy; a solver that never
    trains turns "are the tasks getting harder?" into a curve. Logged as `difficulty` in
    metrics.jsonl; it reads the step's records and draws from its own seeds, so turning it on
    changes nothing else in the run (tested)."""

    every: int = Field(0, ge=0)
    """Measure at every step that is a multiple of this (0: off)."""
    solver: str = "base"
    """Who answers: `base`, the base model with no adapter (the bank's disabled routing), fixed
    for the whole run and alike in every arm, so arms' curves compare; or a member's name (T0,
    S1; A0 in the single agent): a copy of that member's adapter taken once, after the update of
    step `freeze_step`, and kept in the checkpoints (a baseline trained beside a population
    freezes its A0)."""
    freeze_step: int = Field(0, ge=0)
    """With a member as the solver, the step whose member is copied (0: the first measured
    step, `every`); no step before it is measured."""
    samples: int = Field(8, ge=0)
    """Valid tasks of each teacher's own proposals of the step the solver answers (drawn from
    the seed of (seed, step, 'difficulty')); 0: all of them."""
    answers: int = Field(4, ge=1)
    """Answers the solver samples per task (at `sampling.temperature`, within
    `sampling.student_max_new_tokens`); a task's solve rate is the share graded correct."""


class RunConfig(Section):
    save_every: int = Field(10, ge=1)
    with_baseline: bool = False
    """After a population run, train the single-agent baseline with the same per-adapter
    compute in RUN_DIR/baseline (the report then compares the two)."""
    tensorboard: bool = False
    """Log every metric, and the config as hyperparameters, to RUN_DIR/tensorboard."""
    wandb: bool = False
    """Log the same metrics to Weights & Biases (`WANDB_MODE=offline` works without a network)."""
    wandb_project: str = "lorapop"
    wandb_entity: str | None = None
    """W&B team or user (default: the logged-in user's)."""
    wandb_group: str | None = None
    """W&B group, which holds the population and its baseline together (default: the run
    directory's name); the population logs with job_type `population`, the baseline with
    `baseline`."""
    wandb_name: str | None = None
    """W&B run name (default: the run directory's name; the baseline's gets `-baseline`)."""
    progress: bool = True
    """A progress bar on a terminal; one plain line per step otherwise (batch logs)."""
    keep_last: int = Field(2, ge=1)
    """Checkpoints kept: the last `keep_last` ..."""
    keep_every: int = Field(0, ge=0)
    """... and every checkpoint whose step is a multiple of `keep_every` (0: none), for later eval."""
    rollouts: float = Field(1.0, ge=0, le=1)
    """Share of each step's rollouts saved to RUN_DIR/rollouts/step_N.jsonl.gz (0: none)."""
    check_every: int = Field(1, ge=0)
    """Under torchrun: every this many steps the ranks compare fingerprints of the adapter
    bank, the optimizer and the league, and stop with an error if they differ (0: never)."""


class Config(Section):
    seed: int = 0
    model: ModelConfig = ModelConfig()
    lora: LoraConfig = LoraConfig()
    league: LeagueConfig = LeagueConfig()
    evolve: EvolveConfig = EvolveConfig()
    tasks: TasksConfig = TasksConfig()
    verify: VerifyConfig = VerifyConfig()
    sampling: SamplingConfig = SamplingConfig()
    train: TrainConfig = TrainConfig()
    difficulty: DifficultyConfig = DifficultyConfig()
    run: RunConfig = RunConfig()

    @model_validator(mode="after")
    def _solver_is_a_member(self) -> Config:
        lg, name = self.league, self.difficulty.solver
        members = (["A0"] if lg.mode == "single" else
                   [f"T{i}" for i in range(lg.teachers)] + [f"S{i}" for i in range(lg.students)])
        if name != "base" and name not in members:
            raise ValueError(f"difficulty.solver: {name!r} is neither `base` nor a member "
                             f"({', '.join(members)})")
        return self

    @model_validator(mode="after")
    def _operators_fit_the_pools(self) -> Config:
        """A pool with one parent can only use one-parent operators: say so at load, not at
        the first replacement many steps in."""
        ev, lg = self.evolve, self.league
        if lg.mode != "population" or not ev.every:
            return self
        if all(op in TWO_PARENT_OPERATORS for op, w in ev.operators.items() if w > 0):
            for role, n in (("teacher", lg.teachers), ("student", lg.students)):
                targets, parents = pool_split(n, ev.fraction, ev.parent_fraction)
                if targets and parents < 2:
                    raise ValueError(
                        f"evolve.operators: the {role} pool ({n} members) has one parent per "
                        "replacement, but every operator with weight > 0 needs two; add a "
                        "one-parent operator (e.g. spectral) or raise evolve.parent_fraction")
        return self


SAFE_ON_RESUME = ("run.", "train.steps", "verify.workers", "model.device",
                  "sampling.batch_size", "sampling.prefill_tokens", "sampling.compile",
                  "sampling.cuda_graph", "sampling.keep_decoders", "sampling.overlap",
                  "sampling.admit_min", "train.kl_rows")
"""Keys (or `prefix.`es) a `--resume` may change: where files go and how often, how long to
train, and knobs that change speed or memory but not what is computed on CPU (a GPU run's
batch size may change its rounding). Any other difference from the checkpoint's config is
refused, naming each key: the checkpoint's state would not match it."""


def config_diff(old: Config, new: Config) -> dict[str, tuple[Any, Any]]:
    """Dotted key -> (old value, new value) for every leaf that differs."""
    out: dict[str, tuple[Any, Any]] = {}

    def walk(a: Any, b: Any, path: str) -> None:
        if isinstance(a, dict) and isinstance(b, dict) and path.count(".") < 1:
            for k in sorted(a.keys() | b.keys()):
                walk(a.get(k), b.get(k), f"{path}.{k}" if path else k)
        elif a != b:
            out[path] = (a, b)

    walk(old.model_dump(mode="json"), new.model_dump(mode="json"), "")
    return out


def unsafe_on_resume(diff: dict[str, Any]) -> list[str]:
    """The keys of `diff` a resume may not change (see SAFE_ON_RESUME)."""
    return [k for k in diff
            if not any(k == s or (s.endswith(".") and k.startswith(s)) for s in SAFE_ON_RESUME)]


def _did_you_mean(word: str, known: Any) -> str:
    close = difflib.get_close_matches(word, list(known), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _known_keys(loc: tuple[Any, ...]) -> list[str]:
    """The keys allowed where an unknown key sits (`loc` without its last part)."""
    model: Any = Config
    for part in loc[:-1]:
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return []
        model = field.annotation
    return list(getattr(model, "model_fields", {}))


class ConfigError(ValueError):
    """A bad config file, key or value; the message is one line fit for the terminal."""


_AZR_PENALTY = "train.teacher_conversion={} train.teacher_format_penalty=-0.5"
_REMOVED: dict[str, dict[Any, str] | str] = {
    # removed keys whose meaning moved elsewhere: value -> its replacement (or one text for all)
    "train.teacher_reward": {"zero": "train.teacher_conversion=one_minus",
                             "azr": _AZR_PENALTY.format("one_minus"),
                             "inverse": _AZR_PENALTY.format("inverse")},
    "league.teacher_win_below": "league.outcome_center and league.draw_margin "
                                "(the old 0.4/0.6 is outcome_center=absolute draw_margin=0.1)",
}
_REMOVED["league.student_win_above"] = _REMOVED["league.teacher_win_below"]


def _describe(error: ValidationError) -> str:
    first = error.errors()[0]
    key = ".".join(str(p) for p in first["loc"]) or "<root>"
    if first["type"] == "extra_forbidden":
        if key in _REMOVED:
            new = _REMOVED[key]
            if isinstance(new, dict):
                value = first["input"]
                new = new.get(value if isinstance(value, str) else "", " or ".join(new.values()))
            return f"'{key}' was removed; use {new}"
        hint = _did_you_mean(str(first["loc"][-1]), _known_keys(first["loc"]))
        return f"unknown key '{key}'{hint}"
    return f"bad value for '{key}': {first['msg']}"


def apply_override(data: dict[str, Any], override: str) -> None:
    """Set `a.b.c=value` in a nested dict; the value is parsed as YAML (numbers, lists, bools)."""
    path, sep, raw = override.partition("=")
    if not sep or not path:
        raise ConfigError(f"override '{override}' is not of the form key.path=value")
    keys = path.strip().split(".")
    node = data
    for k in keys[:-1]:
        node = node.setdefault(k, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override '{override}': '{k}' is not a section")
    try:
        node[keys[-1]] = yaml.safe_load(raw)
    except yaml.YAMLError as e:
        raise ConfigError(f"override '{override}': value is not valid YAML ({e.problem})") from e


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read a YAML config (or the defaults), apply overrides, validate; raise ConfigError."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        try:
            data = yaml.safe_load(p.read_text(encoding="utf-8"))
        except UnicodeDecodeError as e:
            raise ConfigError(f"{p}: not UTF-8 text (byte {e.start})") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"{p}: not valid YAML ({' '.join(str(e).split())})") from None
        if data is None:  # an empty file would silently train the defaults
            raise ConfigError(f"{p}: the config file is empty")
        if not isinstance(data, dict):
            raise ConfigError(f"{p}: top level must be a mapping of sections")
    for o in overrides:
        apply_override(data, o)
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_describe(e)) from None


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
