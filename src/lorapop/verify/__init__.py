"""Sandboxed verification of untrusted Python programs (see `Sandbox`).

`Sandbox` is imported lazily: the fork server imports this package too, and the caller side
(logging, subprocess, threading) would cost every forked job extra copy-on-write faults and
at-fork hooks.
"""

from typing import TYPE_CHECKING

from lorapop.verify.verdict import Job, Status, Verdict

if TYPE_CHECKING:
    from lorapop.verify.sandbox import Sandbox

__all__ = ["Job", "Sandbox", "Status", "Verdict"]


def __getattr__(name: str) -> object:
    if name == "Sandbox":
        from lorapop.verify.sandbox import Sandbox

        return Sandbox
    raise AttributeError(f"module 'lorapop.verify' has no attribute {name!r}")
