"""Task families (code_o, code_i, code_f): prompts, parsing, verification, checking, buffers,
program metrics. See docs/CONTRACTS.md, section lorapop.tasks."""

from lorapop.tasks.buffer import TaskBuffer
from lorapop.tasks.family import Runner, TaskFamily
from lorapop.tasks.metrics import Coverage, CoverageStep, ProgramMetrics, program_metrics, signature
from lorapop.tasks.prompts import TEMPLATES, Caps
from lorapop.tasks.registry import FAMILIES, get_family, register_family
from lorapop.tasks.task import Draft, FormatError, Grade, Outcome, Task, Validity

__all__ = [
    "FAMILIES",
    "TEMPLATES",
    "Caps",
    "Coverage",
    "CoverageStep",
    "FormatError",
    "Grade",
    "Outcome",
    "ProgramMetrics",
    "Draft",
    "Runner",
    "Task",
    "TaskBuffer",
    "TaskFamily",
    "Validity",
    "get_family",
    "program_metrics",
    "register_family",
    "signature",
]
