"""The `lorapop` command line. Each command is a thin wrapper over a library function."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer

if TYPE_CHECKING:
    from lorapop.config import Config
    from lorapop.dist import World

app = typer.Typer(
    help="lorapop: population-based self-play RL of LLMs on LoRA adapters (PopuLoRA).",
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode=None,  # plain help: no `<bool>` beside flags, no boxes in log files
)


def _version(value: bool) -> None:
    if value:
        import lorapop

        typer.echo(f"lorapop {lorapop.__version__}")
        raise typer.Exit()


@app.callback()
def main(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                      help="Print the version and exit.")) -> None:
    """Population-based self-play RL on LoRA adapters that share one frozen base model."""


def _write_problem(path: Path) -> str | None:
    """Why files cannot be written at or under `path` (None: they can), found by creating and
    removing a file in the nearest existing folder, so nothing is left behind."""
    import tempfile

    anc = path
    while not anc.exists() and anc != anc.parent:
        anc = anc.parent
    if not anc.is_dir():
        return f"{anc} is not a directory"
    try:
        with tempfile.TemporaryFile(dir=anc):
            pass
    except OSError as e:
        return f"cannot write to {path}: {e.strerror or e}"
    return None


TRAIN_FLAGS = ("--steps", "--out", "--resume", "--from-step", "--report", "--no-report",
               "--print-config", "--help")


@app.command()
def verify(
    tasks: str = typer.Argument(
        ..., help='JSON lines {"program": str, "input": str}; "-" for stdin.'
    ),
    workers: int = typer.Option(2, "--workers", help="Programs run at once."),
    timeout: float = typer.Option(2.0, "--timeout", help="Seconds per program (at most a day)."),
    strict: bool = typer.Option(
        False, "--strict", help="Refuse to run unless every required kernel layer is active."
    ),
) -> None:
    """Validate teacher proposals: print one JSON verdict line per task, in order.

    Exits 2 on bad arguments or an unreadable file, 3 when a task got no verdict (its sandbox
    server died twice running it)."""
    import json
    import sys

    from lorapop.verify import Sandbox
    from lorapop.verify.jsonl import read_lines, verify_lines
    from lorapop.verify.sandbox import SandboxError
    from lorapop.verify.verdict import check_timeout

    try:
        check_timeout(timeout, "--timeout")
    except ValueError as e:
        raise _fail(str(e)) from None
    if not 1 <= workers <= 999:
        raise _fail("--workers must be in 1..999")
    try:
        stream = sys.stdin.buffer if tasks == "-" else open(tasks, "rb")  # noqa: SIM115
        head = stream.peek(1) if hasattr(stream, "peek") else b""
        del head  # reading fails here (e.g. a directory) rather than mid-output
    except OSError as e:
        typer.echo(f"error: cannot read {tasks}: {e.strerror or e}", err=True)
        raise typer.Exit(2) from None
    try:
        sandbox = Sandbox(workers=workers, timeout_s=timeout, isolate="strict" if strict else True)
    except SandboxError as e:
        stream.close()
        raise _fail(str(e)) from None
    with stream, sandbox:
        for reply in verify_lines(read_lines(stream), sandbox):
            sys.stdout.write(json.dumps(reply) + "\n")
            sys.stdout.flush()
    if sandbox.lost:
        typer.echo(f"error: {sandbox.lost} task(s) got no verdict (the sandbox server died)", err=True)
        raise typer.Exit(3)


@app.command("sandbox-demo")
def sandbox_demo() -> None:
    """A short verifier demo: honest and hostile programs and their verdicts."""
    from rich.console import Console
    from rich.table import Table

    from lorapop.verify.demo import run_demo

    table = Table(title="lorapop sandbox: verdicts")
    for col in ("program", "status", "output / error", "ms"):
        table.add_column(col)
    for name, _, v in run_demo():
        shown = v.output if v.ok else v.error
        text = (shown or "")[:60]
        color = "green" if v.ok else "red"
        table.add_row(name, f"[{color}]{v.status.value}[/]", text, f"{v.duration * 1e3:.1f}")
    Console().print(table)


def _fail(message: str, world: World | None = None) -> typer.Exit:
    where = f"rank {world.rank}: " if world is not None and world.distributed else ""
    typer.echo(f"error: {where}{message}", err=True)
    return typer.Exit(2)


def _run(cfg: Config, run_dir: Path, resume: bool, command: str, world: World,
         from_step: int | None = None, note: str = "") -> int:
    """Train one run with progress, run.json and the logging backends; return steps done.
    Ctrl-C stops it; `--resume` continues from the last checkpoint (`run.save_every`).
    Under torchrun every rank trains; rank 0 alone shows progress, logs and writes files."""
    import signal

    from lorapop.dist import DivergenceError
    from lorapop.engine.load import ModelLoadError
    from lorapop.engine.memory import GenerationMemoryError
    from lorapop.run.backends import TensorBoardLog, WandbLog
    from lorapop.run.checkpoint import CheckpointWriteError, latest_checkpoint, step_of
    from lorapop.run.progress import RunDisplay
    from lorapop.run.runinfo import RunInfo
    from lorapop.selfplay.loop import NonFiniteError, SelfPlay, Stopped

    try:
        sp = SelfPlay(cfg, run_dir, resume=resume, from_step=from_step, world=world)
    except (ModelLoadError, FileNotFoundError, ValueError, RuntimeError) as e:
        raise _fail(str(e), world) from None
    except OSError as e:
        raise _fail(f"{e.strerror or e}: {e.filename or run_dir}", world) from None
    if world.main:
        typer.echo(_banner(sp, run_dir, world), err=True)
        if note:
            typer.echo(note, err=True)
    if sp.no_deterministic_kernel and world.main:
        typer.echo(f"train.deterministic: an update op has no deterministic kernel "
                   f"({sp.no_deterministic_kernel}); the update goes on in warn-only mode, "
                   "so runs may differ in rounding", err=True)
    hooks: list = [RunInfo(run_dir, command, sp.step_done, sp.kernels)] if world.main else []
    config = cfg.model_dump(mode="json")
    try:
        if cfg.run.tensorboard and world.main:
            hooks.append(TensorBoardLog(run_dir / "tensorboard", config))
        if cfg.run.wandb and world.main:
            rc = cfg.run
            baseline = cfg.league.mode == "single" and run_dir.name == "baseline"
            home = run_dir.parent if baseline else run_dir
            hooks.append(WandbLog(
                run_dir, config, rc.wandb_project, entity=rc.wandb_entity,
                group=rc.wandb_group or home.name,
                name=(rc.wandb_name or home.name) + ("-baseline" if baseline else ""),
                job_type="baseline" if cfg.league.mode == "single" else "population"))
    except RuntimeError as e:  # a backend's package is missing
        sp.close()
        raise _fail(str(e)) from None
    def on_term(signum: int, frame: object) -> None:  # a scheduler's preemption
        sp.request_stop("SIGTERM")

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        with RunDisplay(cfg.train.steps, sp.step_done,
                        enabled=cfg.run.progress and world.main) as display:
            hooks.append(display.update)
            sp.run(on_step=lambda row: [h(row) for h in hooks])
    except (DivergenceError, GenerationMemoryError, NonFiniteError) as e:  # memory: before decode
        raise _fail(str(e), world) from None
    except Stopped as e:
        if world.main:
            typer.echo(f"stopped by {e} after step {sp.step_done}, checkpointed; "
                       f"`lorapop train --resume {run_dir}` continues", err=True)
        raise typer.Exit(143) from None
    except CheckpointWriteError as e:
        raise _fail(f"{e}; {_kept(run_dir)}", world) from None
    except OSError as e:  # metrics, rollouts, run.json: a full or read-only disk
        raise _fail(f"cannot write in {run_dir}: {e.strerror or e}"
                    f"{f': {e.filename}' if e.filename else ''}; {_kept(run_dir)}", world) from None
    except KeyboardInterrupt:
        if not world.main:
            raise typer.Exit(130) from None
        last = latest_checkpoint(run_dir)
        where = f"its checkpoint of step {step_of(last)}" if last \
            else "the start (no checkpoint yet)"
        typer.echo(f"interrupted in step {sp.step_done + 1}; `lorapop train --resume {run_dir}` "
                   f"continues from {where}", err=True)
        raise typer.Exit(130) from None
    finally:
        signal.signal(signal.SIGTERM, previous)
        sp.close()
        for h in hooks:
            if hasattr(h, "close"):
                h.close()
    if world.main:
        typer.echo(f"run: {run_dir} ({sp.step_done} steps, {cfg.league.mode}"
                   f"{f', {world.size} ranks' if world.distributed else ''})")
    return sp.step_done


def _kept(run_dir: Path) -> str:
    from lorapop.run.checkpoint import latest_checkpoint, step_of

    last = latest_checkpoint(run_dir)
    return (f"the checkpoint of step {step_of(last)} is intact: free space, then "
            f"`lorapop train --resume {run_dir}`" if last else "no checkpoint was written")


def _banner(sp: object, run_dir: Path, world: World) -> str:
    """One line: what trains, where and on what."""
    p = sp.parts  # type: ignore[attr-defined]
    cfg = p.cfg
    trainable = p.bank.weights.numel()
    dev = next(p.model.parameters()).device
    devices = f"{world.size} x {dev.type}" if world.distributed else str(dev)
    return (f"lorapop: {cfg.model.name_or_path} | {cfg.league.mode}: {', '.join(p.members)} | "
            f"{trainable:,} trainable parameters ({trainable // max(1, len(p.slot)):,} per "
            f"member) | {devices} | out: {run_dir}")


def _check_resume(run_dir: Path, from_step: int | None, cfg: Config) -> list[str]:
    """Compare the resumed config with the checkpoint's: raise for an unsafe change, return
    one line per safe one."""
    from lorapop.config import ConfigError, config_diff, load_config, unsafe_on_resume
    from lorapop.run.checkpoint import resume_point

    try:
        ckpt = resume_point(run_dir, from_step)
    except FileNotFoundError as e:
        raise _fail(str(e)) from None
    saved_path = ckpt / "config.yaml"
    try:
        saved = load_config(saved_path if saved_path.is_file() else run_dir / "config.yaml")
    except ConfigError as e:
        raise _fail(f"the checkpoint's config: {e}") from None
    diff = config_diff(saved, cfg)
    shown = [f"{k} {a!r} -> {b!r}" for k, (a, b) in diff.items()]
    bad = unsafe_on_resume(diff)
    if bad:
        raise _fail(f"cannot resume {run_dir}: these keys differ from its checkpoint "
                    f"{ckpt.name}: {'; '.join(s for s, k in zip(shown, diff, strict=True) if k in bad)} "
                    "(a resume may change only run.*, train.steps and speed knobs: "
                    "lorapop.config.SAFE_ON_RESUME); start a new run with --out")
    return shown


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def train(
    ctx: typer.Context,
    config: str = typer.Argument(
        None, help="YAML config (e.g. configs/tiny.yaml); omit with --resume."
    ),
    steps: int = typer.Option(None, "--steps", help="Train until this many steps are done."),
    out: str = typer.Option(None, "--out", help="Run directory (default runs/<config name>)."),
    resume: str = typer.Option(
        None, "--resume", help="Continue the run in this directory from its last checkpoint."
    ),
    from_step: int = typer.Option(
        None, "--from-step", help="With --resume: continue from the checkpoint of this step "
        "instead of the last (e.g. when the last is damaged)."),
    report: bool = typer.Option(True, help="Write report.html when training ends."),
    print_config: bool = typer.Option(
        False, "--print-config", help="Print the resolved config (YAML) and exit."),
) -> None:
    """Run population self-play (or the single-agent baseline) and checkpoint as it goes.

    Extra arguments `key.path=value` override the config, e.g. `lora.rank=16 league.pfsp=hard`.
    With `run.with_baseline=true` the single-agent baseline trains next, in RUN_DIR/baseline,
    with the same per-adapter compute. On several GPUs launch it through torchrun:
    `torchrun --nproc-per-node 8 -m lorapop train CONFIG` (README: "Several GPUs and nodes").
    A base that `lorapop pretrain-tiny` made for a world with rules (the level table in its
    training.json) plays under them (`tasks.input_domain`, `output_domain`, `live_code`,
    `banned_calls`) where the config does not set them.
    """

    import difflib
    import shlex

    from lorapop import dist
    from lorapop.config import ConfigError, load_config
    from lorapop.run.report import write_report

    overrides = list(ctx.args)
    for o in overrides:
        if o.startswith("-"):
            flag = o.split("=")[0]
            close = difflib.get_close_matches(flag, TRAIN_FLAGS, n=1, cutoff=0.6)
            raise _fail(f"no such option {flag}" + (f" (did you mean {close[0]}?)" if close
                                                    else "; see `lorapop train --help`"))
    flags = {"--steps": steps, "--out": out, "--resume": resume, "--from-step": from_step}
    command = shlex.join(["lorapop", "train", *([config] if config else []),
                          *(x for k, v in flags.items() if v is not None for x in (k, str(v))),
                          *overrides, *([] if report else ["--no-report"])])
    if config is not None and "=" in config and not Path(config).is_file():
        overrides.insert(0, config)  # `--resume DIR key=value`: no CONFIG was given
        config = None
    if resume:
        run_dir = Path(resume)
        if not run_dir.is_dir():
            raise _fail(f"--resume {resume}: no such directory")
        if not (run_dir / "config.yaml").is_file() and not (run_dir / "checkpoints").is_dir():
            raise _fail(f"--resume {resume}: not a lorapop run directory (no config.yaml "
                        "or checkpoints/)")
        if config is None:  # the resumed checkpoint's config: a safe change made at an
            # earlier resume (e.g. train.steps) holds until changed again
            from lorapop.run.checkpoint import resume_point

            try:
                saved = resume_point(run_dir, from_step) / "config.yaml"
            except FileNotFoundError as e:
                raise _fail(str(e)) from None
            config = str(saved if saved.is_file() else run_dir / "config.yaml")
    elif config is None:
        raise _fail("give a CONFIG file, or --resume RUN_DIR")
    else:
        run_dir = Path(out) if out else Path("runs") / Path(config).stem
    if steps is not None:
        overrides.append(f"train.steps={steps}")  # validated like any other value
    try:
        cfg = load_config(config, overrides)
    except ConfigError as e:
        raise _fail(str(e)) from None
    if from_step is not None and not resume:
        raise _fail("--from-step goes with --resume RUN_DIR")
    changed: list[str] = []
    if resume and not print_config:
        changed = _check_resume(run_dir, from_step, cfg)
    if not print_config and (problem := _write_problem(run_dir)):
        raise _fail(problem)
    rules_note = ""
    if not resume:  # a resumed run's config.yaml has them already
        from lorapop.tiny.world import base_rule_overrides

        try:
            table, extra = base_rule_overrides(cfg.model.name_or_path, cfg.tasks.model_fields_set)
        except ValueError as e:
            raise _fail(str(e)) from None
        if extra:
            cfg = load_config(config, [*overrides, *extra])
            rules_note = (f"the base was pretrained for level table {table!r}: its world rules "
                          f"apply (set these keys to change them): {' '.join(extra)}")
    if print_config:
        from lorapop.config import dump_config

        typer.echo(dump_config(cfg), nl=False)
        return
    try:
        world = dist.init(cfg.model.device)
    except (RuntimeError, ValueError) as e:
        raise _fail(f"cannot join the torchrun process group: {e}") from None
    if rules_note and world.main:
        typer.echo(rules_note)
    try:
        done = _run(cfg, run_dir, bool(resume), command, world, from_step,
                    f"resuming with changed settings: {'; '.join(changed)}" if changed else "")
        baseline_dir = run_dir / "baseline"
        if cfg.run.with_baseline and cfg.league.mode == "population":
            base = cfg.model_copy(deep=True)
            base.league.mode = "single"
            base.run.with_baseline = False
            if base.difficulty.solver != "base":  # a member solver: the baseline's own member
                base.difficulty.solver = "A0"
            _run(base, baseline_dir, bool(resume) and (baseline_dir / "checkpoints").is_dir(),
                 command, world)
    finally:
        dist.close(world)
    if report and done and world.main:
        from lorapop.run.report import summary_table

        typer.echo(summary_table(run_dir, baseline_dir if baseline_dir.is_dir() else None))
        try:
            typer.echo(f"report: {write_report(run_dir)}")
        except OSError as e:
            raise _fail(f"cannot write {run_dir / 'report.html'}: {e.strerror or e}") from None


@app.command()
def report(run_dir: str = typer.Argument(..., help="A run directory written by `lorapop train`.")) -> None:
    """Write RUN_DIR/report.html: run facts, learning curves per individual and arm, ratings,
    matchups, program complexity, timings, replacements, sampled rollouts (works mid-run)."""
    from lorapop.run.report import write_report

    try:
        typer.echo(str(write_report(run_dir)))
    except (FileNotFoundError, ValueError) as e:
        raise _fail(str(e)) from None
    except OSError as e:  # a read-only run or a full disk: the old report (if any) is kept
        raise _fail(f"cannot write {Path(run_dir) / 'report.html'}: {e.strerror or e}") from None


@app.command()
def export(
    run_dir: str = typer.Argument(..., help="A run directory written by `lorapop train`."),
    member: str = typer.Argument(
        ..., help="Member name, e.g. T0 or S1; A0 is the single-agent baseline (from "
        "RUN_DIR/baseline when the run trained one)."),
    out_dir: str = typer.Argument(..., help="Where to write the PEFT adapter directory."),
) -> None:
    """Copy one member of the last checkpoint out as a standard PEFT LoRA adapter directory
    (files readable by others; the base model recorded so that PEFT's Auto classes load it)."""
    from lorapop.run.checkpoint import latest_checkpoint

    run = Path(run_dir)
    ckpt = latest_checkpoint(run)
    if member == "A0" and not (ckpt and (ckpt / "adapters" / "A0").is_dir()):
        ckpt = latest_checkpoint(run / "baseline") or ckpt
    if ckpt is None:
        raise _fail(f"no checkpoint in {run_dir}")
    known = sorted(p.name for p in (ckpt / "adapters").iterdir() if p.is_dir())
    if member not in known:
        raise _fail(f"no member {member!r} in {ckpt}; members: {', '.join(known)}")
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise _fail(f"{out_dir} exists and is not an empty directory")
    if problem := _write_problem(out):
        raise _fail(problem)
    try:
        _copy_adapter(ckpt / "adapters" / member, out)
    except OSError as e:
        raise _fail(f"cannot write {out_dir}: {e.strerror or e}") from None
    typer.echo(f"{member} -> {out_dir} (load with peft.PeftModel.from_pretrained)")


def _copy_adapter(src: Path, out: Path) -> None:
    """Copy an adapter directory with default file modes (checkpoint files may be 0600) and
    the base model as a name PEFT can load (`tiny` becomes the shipped model's path)."""
    import json
    import shutil

    from lorapop.engine.load import TINY, TINY_DIR

    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file():
            shutil.copyfile(f, out / f.name)  # new files: the user's umask, not the source's mode
    cfg_path = out / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    base = cfg.get("base_model_name_or_path")
    if base:
        path = TINY_DIR if base == TINY else Path(base)
        cfg["base_model_name_or_path"] = str(path.resolve()) if path.is_dir() else base
        cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True))


@app.command("eval")
def evaluate(
    target: str = typer.Argument(
        ..., help="A run directory (all members + baseline), a PEFT adapter directory, "
        "or a base model (hub id, local path, tiny-random)."
    ),
    bench: str = typer.Option(
        ..., "--bench",
        help="Comma-separated benchmarks, e.g. humanevalplus,mbppplus,gsm8k; or `tiny`, the "
        "tiny world's held-out set (5 levels x code_o/code_i/code_f).",
    ),
    data_dir: str = typer.Option(None, "--data-dir", help="Folder holding the benchmark files."),
    out: str = typer.Option(
        None, "--out", help="Write eval.json and eval.md here (default for a run: RUN_DIR/eval)."
    ),
    source: list[str] = typer.Option(
        [], "--source", help="BENCH=PATH or BENCH=hf:DATASET_ID for one benchmark's data."
    ),
    base_model: str = typer.Option(None, "--base-model", help="Override the adapters' base."),
    template: str = typer.Option("auto", help="Prompt: auto, azr (R1 template) or chat."),
    max_new_tokens: int = typer.Option(2048, help="Generation length per answer."),
    batch_size: int = typer.Option(None, help="Rows decoded together (default: all)."),
    limit: int = typer.Option(None, help="Only the first N problems of each benchmark."),
    device: str = typer.Option("auto", help="auto, cpu or cuda."),
    workers: int = typer.Option(2, help="Sandbox processes for code scoring."),
    base: bool = typer.Option(True, help="Also score the base model without adapters."),
) -> None:
    """Greedy pass@1 of every member on the paper's code and math benchmarks, in shared batches."""

    from lorapop.evals import EvalError, run_eval
    from lorapop.evals.runner import EvalInterrupted
    from lorapop.run.checkpoint import latest_checkpoint

    for flag, value in (("--workers", workers), ("--max-new-tokens", max_new_tokens),
                        ("--batch-size", batch_size), ("--limit", limit)):
        if value is not None and value < 1:
            raise _fail(f"{flag} must be at least 1 (got {value})")
    if workers > 999:
        raise _fail("--workers must be in 1..999")
    if out is None and latest_checkpoint(Path(target)) is not None:
        out = str(Path(target) / "eval")  # `lorapop report` shows it with the run
    if out is not None and (problem := _write_problem(Path(out))):
        raise _fail(problem)  # before any evaluation, not after it
    benches = [b.strip() for b in bench.split(",") if b.strip()]
    if "tiny" in benches:
        if benches != ["tiny"]:
            raise _fail("--bench tiny (the tiny world's held-out set) runs on its own")
        for flag, value, default in (("--limit", limit, None), ("--batch-size", batch_size, None),
                                     ("--max-new-tokens", max_new_tokens, 2048)):
            if value != default:
                raise _fail(f"{flag} does not apply to --bench tiny (its held-out set and "
                            "lengths are fixed)")
        _eval_tiny(target, out, device, workers, base_model)
        return
    sources = {}
    for s in source:
        name, sep, value = s.partition("=")
        if not sep:
            raise _fail(f"--source {s!r} is not BENCH=PATH")
        sources[name] = value
    try:
        result = run_eval(
            target, benches, data_dir, out,
            sources=sources, base_model=base_model, include_base=base, template=template,
            max_new_tokens=max_new_tokens, batch_size=batch_size, limit=limit, device=device,
            workers=workers, log=lambda m: typer.echo(m, err=True),
        )
    except EvalInterrupted as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(130) from None
    except EvalError as e:
        raise _fail(str(e)) from None
    except OSError as e:
        raise _fail(f"cannot write {out}: {e.strerror or e}; results scored so far are in "
                    f"{out}/eval.partial.jsonl if it could be written") from None
    typer.echo(result["table"])


def _eval_tiny(target: str, out: str | None, device: str, workers: int, base: str | None) -> None:
    import json

    from lorapop.evals import EvalError
    from lorapop.tiny.evaluate import evaluate_run, markdown

    try:
        result = evaluate_run(target, base_model=base, device=device, workers=workers,
                              log=lambda m: typer.echo(m, err=True))
    except EvalError as e:
        raise _fail(str(e)) from None
    table = markdown(result)
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "tiny_eval.json").write_text(json.dumps(result, indent=1))
        (Path(out) / "eval.md").write_text(table + "\n")
    typer.echo(table)


@app.command("pretrain-tiny")
def pretrain_tiny(
    out: str = typer.Option(
        None, "--out", help="Model directory to write (required: the shipped model is not "
        "overwritten by accident; name its directory to replace it)."),
    size: str = typer.Option(
        "tiny", help="tiny (the shipped 3.5M model) or small (~26M: all five levels for "
        "teachers, reference-conditioned examples; GPU). The regime world's recipes are built "
        "by experiments/regime/."
    ),
    seed: int = typer.Option(0, help="Seed for the corpus, tokenizer and training."),
    steps: int = typer.Option(None, help="Optimizer steps (default: the size's)."),
    device: str = typer.Option("auto", help="auto, cpu or cuda."),
    n_per_level: int = typer.Option(None, help="Programs per difficulty level (default: the size's)."),
    workers: int = typer.Option(2, help="Processes making the corpus (the sandbox's, or worker "
                                "processes for the larger sizes) and the example pool."),
    stop_after: float = typer.Option(
        None, help="Seconds after which training stops and keeps its state in OUT/partial; the "
        "same command again goes on from there to the model an uninterrupted build makes."),
) -> None:
    """Re-make the tiny world's base model: corpus, tokenizer, supervised warm start.

    Data parallel under torchrun (`torchrun --standalone --nproc-per-node N -m lorapop
    pretrain-tiny ...`, one rank per GPU): the same model, to float rounding, in about 1/N of
    the training time; rank 0 makes the corpus and writes the files."""
    import sys
    import time

    from lorapop import dist
    from lorapop.engine.load import ModelLoadError, resolve_device
    from lorapop.tiny.pretrain import SIZES, TINY_MODEL_DIR, pretrain_size

    if size not in SIZES:
        hint = " (the regime world's recipes: experiments/regime/regime_recipes.py)" \
            if size.startswith("world") else ""
        raise _fail(f"unknown --size {size!r}; known: {', '.join(SIZES)}{hint}")
    if out is None:
        raise _fail(f"give --out DIR (to replace the shipped model: --out {TINY_MODEL_DIR})")
    try:
        dev = resolve_device(device)
        world = dist.init(device)
    except (ModelLoadError, RuntimeError) as e:
        raise _fail(f"--device {device!r}: {str(e).splitlines()[0]}") from e
    if size != "tiny" and dev.type == "cpu" and world.main:
        typer.echo(f"warning: --size {size} is made for a GPU; on a CPU it may run out of memory "
                   "or take hours", err=True)
    end = None if stop_after is None else time.monotonic() + stop_after
    try:
        record = pretrain_size(out, size, seed=seed, steps=steps, device=device,
                               n_per_level=n_per_level, workers=workers, command=" ".join(sys.argv),
                               stop=None if end is None else lambda _: time.monotonic() >= end,
                               world=world, log=print if world.main else None)
    except (MemoryError, RuntimeError) as e:  # torch.OutOfMemoryError is a RuntimeError
        if not isinstance(e, MemoryError) and "out of memory" not in str(e).lower() \
                and "can't allocate memory" not in str(e):
            raise
        hint = "" if size == "tiny" else " (sizes other than tiny are made for a GPU: --device cuda)"
        raise _fail(f"out of memory pretraining --size {size} on --device {device}{hint}") from e
    except (ValueError, FloatingPointError) as e:  # a partial build of other settings, divergence
        raise _fail(str(e)) from e
    dist.close(world)
    if not world.main:
        return
    if "stopped_at" in record:
        typer.echo(f"stopped at step {record['stopped_at']} of {record['steps']} (--stop-after): "
                   f"the same command goes on from there")
        return
    typer.echo(f"saved {out} (final loss {record['final_loss']:.3f}, "
               f"weights {record['weights_sha256']})")
