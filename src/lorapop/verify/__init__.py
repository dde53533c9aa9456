"""Sandboxed verification of untrusted Python programs (see `Sandbox`).

`Sandbox` and `Policy` are imported lazily: the fork server imports this package too, and the
caller side (logging, subprocess, threading, ast) would cost every forked job extra
copy-on-write faults and at-fork hooks.
"""

from typing import TYPE_CHECKING

from lorapop.verify.verdict import Job, Status, Verdict

if TYPE_CHECKING:
    from lorapop.verify.policy import POLICIES, Policy
    from lorapop.verify.sandbox import Sandbox

__all__ = ["POLICIES", "Job", "Policy", "Sandbox", "Status", "Verdict"]


def __getattr__(name: str) -> object:
    if name == "Sandbox":
        from lorapop.verify.sandbox import Sandbox

        return Sandbox
    if name in ("Policy", "POLICIES"):
        from lorapop.verify import policy

        return getattr(policy, name)
    raise AttributeError(f"module 'lorapop.verify' has no attribute {name!r}")
