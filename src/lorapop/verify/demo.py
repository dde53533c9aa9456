"""A short showcase of the sandbox: honest and hostile programs with their verdicts."""

from __future__ import annotations

from lorapop.verify.sandbox import Sandbox
from lorapop.verify.verdict import Job, Verdict

EXAMPLES: list[tuple[str, Job]] = [
    ("sum of squares", Job("def f(n):\n    return sum(i * i for i in range(n))", "f(10)", deterministic=True)),
    ("helper + class", Job(
        "from collections import Counter\nclass Box:\n    def __init__(self, s):\n"
        "        self.c = Counter(s)\ndef top(b):\n    return b.c.most_common(2)\n"
        "def f(s):\n    return top(Box(s))",
        "f('mississippi')", deterministic=True)),
    ("recursion", Job("def f(n):\n    return 1 if n < 2 else n * f(n - 1)", "f(20)", deterministic=True)),
    ("division by zero", Job("def f(x):\n    return x / 0", "f(1)")),
    ("banned import", Job("import subprocess\ndef f():\n    return subprocess.run(['id'])", "f()")),
    ("no entry", Job("def g():\n    return 1", "g()")),
    ("infinite loop", Job("def f():\n    while True:\n        pass", "f()")),
    ("memory hog", Job("def f():\n    return bytearray(1 << 34)", "f()")),
    ("set order", Job("def f(n):\n    return list({str(i) for i in range(n)})", "f(30)", deterministic=True)),
    ("read /etc/shadow", Job("def f():\n    return open('/etc/shadow').read()", "f()")),
    ("fork via __import__", Job("def f():\n    return __import__('os').fork()", "f()")),
    ("os.system", Job("import os\ndef f():\n    return os.system('touch /pwned')", "f()")),
    ("kill every process", Job("import os\ndef f():\n    os.kill(-1, 9)", "f()")),
    ("look at the host", Job("import os\ndef f():\n    return os.listdir('/')", "f()")),
    ("the server's frames", Job("import sys\ndef f():\n    return sys._getframe(2).f_globals['time']", "f()")),
    ("an address", Job("def f():\n    return id(object()) // 16", "f()", deterministic=True)),
    ("huge output", Job("def f():\n    return 'x' * 10**6", "f()")),
]  # fmt: skip


def run_demo(sandbox: Sandbox | None = None) -> list[tuple[str, Job, Verdict]]:
    """Verdicts for EXAMPLES (starting a sandbox with a 1 s timeout if none is given)."""
    own = sandbox is None
    sb = sandbox or Sandbox(timeout_s=1.0)
    try:
        verdicts = sb.run([job for _, job in EXAMPLES])
    finally:
        if own:
            sb.close()
    return [(name, job, v) for (name, job), v in zip(EXAMPLES, verdicts, strict=True)]
