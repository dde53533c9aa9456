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
