"""The `lorapop` command line. Each command is a thin wrapper over a library function."""

from __future__ import annotations

import typer

app = typer.Typer(
    help="lorapop: population-based self-play RL of LLMs on LoRA adapters (PopuLoRA).",
    no_args_is_help=True,
    add_completion=False,
)


@app.callback()
def main() -> None:
    """Population-based self-play RL on LoRA adapters that share one frozen base model."""


@app.command()
def verify(
    tasks: str = typer.Argument(
        ..., help='JSON lines {"program": str, "input": str}; "-" for stdin.'
    ),
    workers: int = typer.Option(2, "--workers", help="Programs run at once."),
    timeout: float = typer.Option(2.0, "--timeout", help="Seconds per program."),
) -> None:
    """Validate teacher proposals: print one JSON verdict line per task, in order."""
    import json
    import sys

    from lorapop.verify import Sandbox
    from lorapop.verify.jsonl import verify_lines

    if not 1 <= workers <= 999 or timeout <= 0:
        typer.echo("error: --workers must be in 1..999 and --timeout > 0", err=True)
        raise typer.Exit(2)
    try:
        stream = sys.stdin.buffer if tasks == "-" else open(tasks, "rb")  # noqa: SIM115
        head = stream.peek(1) if hasattr(stream, "peek") else b""
        del head  # reading fails here (e.g. a directory) rather than mid-output
    except OSError as e:
        typer.echo(f"error: cannot read {tasks}: {e.strerror or e}", err=True)
        raise typer.Exit(2) from None
    with stream, Sandbox(workers=workers, timeout_s=timeout) as sandbox:
        for reply in verify_lines(stream, sandbox):
            sys.stdout.write(json.dumps(reply) + "\n")
            sys.stdout.flush()


@app.command()
def demo() -> None:
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
