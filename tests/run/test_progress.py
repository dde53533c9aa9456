"""Progress as a batch log sees it: one plain line per step with a working ETA."""

import io

from rich.console import Console

from lorapop.run.progress import Eta, RunDisplay, duration, summary

ROW = {
    "step": 3,
    "members": {
        "T0": {"valid_rate": 0.5, "mu": 24.0, "role": "teacher"},
        "S0": {"solve_rate": 0.25, "mu": 26.0, "role": "student"},
    },
    "programs": {"code_o": {"ast_depth": 4.0, "coverage": 7}},
    "phase_s": {"proposal": 1.5, "verification": 0.25},
    "tokens_per_s": 120.0,
}


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_summary_line():
    assert summary(ROW) == "valid 0.50  solve 0.25  120 tok/s"


def test_eta_from_measured_steps():
    clock = Clock()
    eta = Eta(total=10, done=2, clock=clock)
    assert eta.remaining() is None
    clock.t += 30  # step 3 took 30 s
    assert eta.update(3) == 7 * 30
    clock.t += 10
    assert eta.update(4) == 6 * 20  # mean of the steps seen
    assert duration(eta.remaining()) == "0:02:00" and duration(None) == "-"


def test_plain_lines_when_not_a_terminal():
    out = io.StringIO()
    console = Console(file=io.StringIO(), force_terminal=False)
    with RunDisplay(total=5, done=2, console=console, stream=out) as display:
        display.update(ROW)
        display.update(ROW | {"step": 4})
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("step 3/5 | propose 1.5s verify 0.2s | valid 0.50  solve 0.25")
    assert "120 tok/s" in lines[0] and "s/step ETA 0:00:0" in lines[0]
    assert "\x1b" not in out.getvalue()  # no terminal control codes in a log file


def test_disabled_prints_nothing():
    out = io.StringIO()
    console = Console(file=io.StringIO(), force_terminal=False)
    with RunDisplay(total=5, enabled=False, console=console, stream=out) as display:
        display.update(ROW)
    assert out.getvalue() == ""


def test_terminal_bar_shows_eta():
    term = io.StringIO()
    console = Console(file=term, force_terminal=True, width=150)
    with RunDisplay(total=5, done=2, console=console, stream=io.StringIO()) as display:
        display.update(ROW)
    assert "ETA 0:00:0" in term.getvalue() and "valid 0.50" in term.getvalue()
