"""Sandboxed verification of untrusted Python programs (see `Sandbox`)."""

from lorapop.verify.sandbox import Sandbox
from lorapop.verify.verdict import Job, Status, Verdict

__all__ = ["Job", "Sandbox", "Status", "Verdict"]
