"""Module policies ("azr" vs "benchmark") and per-job time limits.

The benchmark policy lets benchmark programs import random, hashlib, time, ...; everything the
OS confines (uid, namespaces, rlimits, timeouts) must hold exactly as under the azr policy.
"""

import pytest
from test_hostile import TOKEN, hostile_cases

from conftest import BENCHMARK_FFI, left_behind
from lorapop.verify import POLICIES, Job, Policy, Sandbox, Status
from lorapop.verify.policy import BASE_MODULES

S = Status

# The patterns of HumanEval/39 (random in a Miller-Rabin test) and HumanEval/162 (hashlib).
PRIME_FIB = """
def prime_fib(n: int):
    import random
    def miller_rabin(n, k=10):
        if n < 2:
            return False
        if n == 2 or n == 3:
            return True
        if n % 2 == 0:
            return False
        r, d = 0, n - 1
        while d % 2 == 0:
            r += 1
            d //= 2
        for _ in range(k):
            a = random.randint(2, n - 2)
            x = pow(a, d, n)
            if x == 1 or x == n - 1:
                continue
            for _ in range(r - 1):
                x = pow(x, 2, n)
                if x == n - 1:
                    break
            else:
                return False
        return True
    c_prime = 0
    a, b = 0, 1
    while c_prime < n:
        a, b = b, a + b
        if miller_rabin(b):
            c_prime += 1
    return b
"""
MD5 = """
def string_to_md5(text):
    if text == "": return None
    import hashlib
    m = hashlib.md5()
    m.update(text.encode("utf-8"))
    return m.hexdigest()
"""
CANONICALS = [
    Job(PRIME_FIB, "[prime_fib(n) for n in range(1, 8)]", entry="prime_fib"),
    Job(MD5, "[string_to_md5('Hello world'), string_to_md5('')]", entry="string_to_md5"),
]
WANT = ["[2, 3, 5, 13, 89, 233, 1597]", "['3e25960a79dbc69b674cd4ec67a72c62', None]"]


@pytest.fixture(scope="module")
def bench():
    with Sandbox(
        workers=2, timeout_s=1.0, memory_mb=512, max_output_chars=20_000, policy="benchmark"
    ) as sb:
        yield sb


def test_benchmark_canonicals_run(bench):
    assert [v.output for v in bench.run(CANONICALS)] == WANT


def test_azr_refuses_them(sandbox):
    verdicts = sandbox.run(CANONICALS)
    assert [(v.status, v.error) for v in verdicts] == [
        (S.BANNED, "banned: random"),
        (S.BANNED, "banned: hashlib"),
    ]


def test_benchmark_imports_the_azr_banned_modules(bench, sandbox):
    prog = (
        "import random, hashlib, hmac, time, datetime, calendar, secrets, sys, io\n"
        "def f():\n"
        "    random.seed(3)\n"
        "    return (random.randint(0, 10**6), hashlib.sha256(b'x').hexdigest()[:8],\n"
        "            datetime.date(2024, 2, 29).isoformat(), calendar.isleap(2024),\n"
        "            type(time.time()).__name__, len(secrets.token_hex(4)))"
    )
    (v,) = bench.run([Job(prog, "f()")])
    import random

    random.seed(3)
    assert v.ok, v.error
    assert v.output == repr((random.randint(0, 10**6), "2d711642", "2024-02-29", True, "float", 8))
    # azr hides them at run time too, where the static check cannot see the name
    (v,) = sandbox.run([Job("def f():\n    return __import__('ran' + 'dom').random()", "f()")])
    assert v.status is S.RUNTIME_ERROR and "No module named 'random'" in v.error


def test_benchmark_has_no_static_rules(bench):
    jobs = [
        Job("import sys\ndef f():\n    sys.exit(3)", "f()"),
        Job("def f():\n    return input()", "f()"),
        Job("import os\ndef f():\n    return os.path.join('a', 'b')", "f()"),
    ]
    got = [(v.status, v.output) for v in bench.run(jobs)]
    assert got == [(S.RUNTIME_ERROR, None), (S.RUNTIME_ERROR, None), (S.OK, "'a/b'")]


def test_benchmark_hides_the_sandbox_itself(bench):
    (v,) = bench.run([Job("def f():\n    return __import__('lorapop')", "f()")])
    assert v.status is S.RUNTIME_ERROR and "No module named 'lorapop'" in v.error


def test_policies_by_name_and_explicit():
    assert set(POLICIES) == {"azr", "benchmark"}
    with pytest.raises(ValueError, match="unknown sandbox policy 'lax'"):
        Sandbox(policy="lax")
    mine = Policy("mine", banned=("math",), ban_input=False, modules=BASE_MODULES,
                  hidden=("lorapop",))  # fmt: skip
    with Sandbox(workers=1, timeout_s=1.0, policy=mine) as sb:
        jobs = [Job("import math\ndef f():\n    return 1", "f()"),
                Job("import heapq\ndef f():\n    return input()", "f()")]  # fmt: skip
        assert [v.status for v in sb.run(jobs)] == [S.BANNED, S.RUNTIME_ERROR]


# --- isolation is the same under the benchmark policy ----------------------------------------

EXTRA = [
    ("subprocess", Job("def f():\n    return __import__('subprocess').run(['id'])", "f()"),
     {S.RUNTIME_ERROR}),
    ("sleep past the limit", Job("import time\ndef f():\n    time.sleep(30)", "f()"),
     {S.TIMEOUT}),
    ("raise own rlimits", Job("import resource as r\ndef f():\n"
                              "    r.setrlimit(r.RLIMIT_AS, (-1, -1))", "f()"), {S.RUNTIME_ERROR}),
    ("raise own cpu limit", Job("import resource as r\ndef f():\n"
                                "    r.setrlimit(r.RLIMIT_CPU, (-1, -1))", "f()"), {S.RUNTIME_ERROR}),
    ("wall clock in days", Job("import time\ndef f():\n    return time.monotonic() // 86400",
                               "f()", deterministic=True), {S.NONDETERMINISTIC}),
]  # fmt: skip


@pytest.fixture(scope="module")
def hostile(canaries):
    """Every kernel-level case of test_hostile (classes 1-6, 8, 9), and EXTRA, under the
    benchmark policy with ctypes granted (the kernel probes hold libc)."""
    cases = [(c.name, c.job, c.want) for c in hostile_cases(canaries) if c.cls not in (0, 7)]
    cases += EXTRA
    with Sandbox(
        workers=2, timeout_s=1.0, memory_mb=512, max_output_chars=20_000, policy=BENCHMARK_FFI
    ) as sb:
        return cases, sb.run([job for _, job, _ in cases])


def test_benchmark_hostile_statuses(hostile):
    cases, verdicts = hostile
    wrong = [(n, v.status.value, v.error) for (n, _, want), v in zip(cases, verdicts, strict=True)
             if v.status not in want]  # fmt: skip
    assert not wrong


def test_benchmark_host_untouched(hostile, canaries, bench, sandbox):
    for p in canaries:
        assert p.read_text() == "precious"
    assert not left_behind(TOKEN)
    assert bench.isolation["layers"] == sandbox.isolation["layers"]  # same layers as azr
    assert bench.run([Job("def f():\n    return 7", "f()")])[0].output == "7"


# --- per-job time limits ---------------------------------------------------------------------

SLEEP = "import time\ndef f(s):\n    time.sleep(s)\n    return s"


def test_job_limit_longer_than_the_default(bench):
    jobs = [Job(SLEEP, "f(1.5)", timeout_s=6.0), Job(SLEEP, "f(1.5)")]  # default: 1 s
    (a, b) = bench.run(jobs)
    assert a.ok and a.output == "1.5"
    assert b.status is S.TIMEOUT and b.error == "exceeded 1 s"


def test_job_limit_shorter_than_the_default():
    with Sandbox(workers=2, timeout_s=20.0, policy="benchmark") as sb:
        a, b = sb.run([Job(SLEEP, "f(1.5)", timeout_s=0.3), Job(SLEEP, "f(0.1)", timeout_s=0.3)])
    assert a.status is S.TIMEOUT and a.error == "exceeded 0.3 s" and a.duration < 1.5
    assert b.ok


def test_job_limit_sets_the_cpu_rlimit():
    """(resource is the server's own module: a policy that lists it lets jobs import it.)"""
    mine = Policy("rl", (), False, ("resource",), ("lorapop",))
    prog = "import resource as r\ndef f():\n    return r.getrlimit(r.RLIMIT_CPU)"
    jobs = [Job(prog, "f()", timeout_s=7.5), Job(prog, "f()"), Job(prog, "f()", timeout_s=0.2)]
    with Sandbox(workers=2, timeout_s=1.0, policy=mine) as sb:
        assert [v.output for v in sb.run(jobs)] == ["(8, 9)", "(2, 3)", "(1, 2)"]


def test_job_limit_on_cpu_bound_and_deterministic_jobs(sandbox):
    spin = "def f():\n    while True:\n        pass"
    (v,) = sandbox.run([Job(spin, "f()", deterministic=True, timeout_s=0.25)])
    assert v.status is S.TIMEOUT and v.error == "exceeded 0.25 s" and v.duration < 1.0


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), "2", True])
def test_bad_job_limit_is_a_clear_error(bad):
    with pytest.raises(ValueError, match="Job.timeout_s must be a number of seconds"):
        Job("def f():\n    return 1", "f()", timeout_s=bad)
