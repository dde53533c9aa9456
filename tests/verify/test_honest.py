"""Honest programs: the sandbox must give exactly what plain execution gives."""

import pytest

from lorapop.verify import Job, Status

HONEST: list[tuple[str, str]] = [
    ("def f(s):\n    return s[::-1]", "f('hello world')"),
    ("def f(s):\n    return s.upper().split()", "f('a b  c')"),
    ("def f(a, b):\n    return a + b", "f(2, 3)"),
    ("def f(xs):\n    return sorted(xs, key=lambda x: (-x, x))", "f([3, 1, 2, 3])"),
    ("def f(xs):\n    return [x * x for x in xs if x % 2]", "f(list(range(10)))"),
    ("def f(d):\n    return {k: v * 2 for k, v in sorted(d.items())}", "f({'b': 1, 'a': 2})"),
    ("def f(n):\n    return 1 if n < 2 else n * f(n - 1)", "f(25)"),
    ("def f(n):\n    return n if n < 2 else f(n - 1) + f(n - 2)", "f(18)"),
    ("def g(x):\n    return x + 1\n\ndef f(x):\n    return g(g(x))", "f(5)"),
    (
        "class Stack:\n    def __init__(self):\n        self.items = []\n"
        "    def push(self, x):\n        self.items.append(x)\n"
        "    def pop(self):\n        return self.items.pop()\n\n"
        "def f(xs):\n    s = Stack()\n    for x in xs:\n        s.push(x)\n"
        "    return [s.pop() for _ in xs]",
        "f([1, 2, 3])",
    ),
    ("import math\ndef f(x):\n    return math.gcd(x, 36), math.isqrt(x), math.factorial(6)", "f(48)"),
    ("import math\ndef f(x):\n    return round(math.sin(x) ** 2 + math.cos(x) ** 2, 12)", "f(0.7)"),
    ("from collections import Counter\ndef f(s):\n    return Counter(s).most_common(3)", "f('abracadabra')"),
    ("from collections import deque\ndef f(xs):\n    d = deque(xs)\n    d.rotate(2)\n    return list(d)", "f([1, 2, 3, 4, 5])"),
    ("from collections import defaultdict\ndef f(ws):\n    g = defaultdict(list)\n    for w in ws:\n        g[len(w)].append(w)\n    return dict(g)", "f(['a', 'bb', 'cc', 'd'])"),
    ("import itertools\ndef f(xs):\n    return list(itertools.permutations(xs, 2))", "f([1, 2, 3])"),
    ("from itertools import accumulate, groupby\ndef f(xs):\n    return list(accumulate(xs)), [k for k, _ in groupby(sorted(xs))]", "f([3, 1, 3, 2])"),
    ("from functools import reduce, lru_cache\n@lru_cache(None)\ndef c(n):\n    return n if n < 2 else c(n-1) + c(n-2)\ndef f(n):\n    return reduce(lambda a, b: a * b, range(1, n)), c(80)", "f(8)"),
    ("import re\ndef f(s):\n    return re.findall(r'\\d+', s), re.sub(r'\\s+', '-', s)", "f('a 12  b 345 c')"),
    ("import heapq\ndef f(xs):\n    h = list(xs)\n    heapq.heapify(h)\n    return [heapq.heappop(h) for _ in range(3)], heapq.nlargest(2, xs)", "f([5, 1, 8, 3, 9])"),
    ("import bisect\ndef f(xs, x):\n    i = bisect.bisect_left(xs, x)\n    bisect.insort(xs, x)\n    return i, xs", "f([1, 3, 5, 7], 4)"),
    ("def f(m):\n    return [list(r) for r in zip(*m)]", "f([[1, 2, 3], [4, 5, 6]])"),
    ("def f(s):\n    seen = set()\n    out = []\n    for c in s:\n        if c not in seen:\n            seen.add(c)\n            out.append(c)\n    return ''.join(out)", "f('mississippi')"),
    ("def f(n):\n    return sorted({i % 7 for i in range(n)})", "f(100)"),
    ("def f(ws):\n    return sorted(set(ws))", "f(['pear', 'apple', 'fig', 'apple'])"),
    ("def f(x):\n    return divmod(x, 7), x ** 0.5, -x // 3, x % -4", "f(50)"),
    ("def f(s):\n    return {c: s.count(c) for c in sorted(set(s))}", "f('banana')"),
    ("from fractions import Fraction\ndef f(a, b):\n    return Fraction(a, b) + Fraction(1, 3)", "f(1, 6)"),
    ("import string\ndef f(s):\n    return ''.join(c for c in s if c in string.ascii_lowercase)", "f('Hello, World!')"),
    ("from dataclasses import dataclass\n@dataclass\nclass P:\n    x: int\n    y: int\ndef f(a, b):\n    p = P(a, b)\n    return (p.x + p.y, repr(p).split('(')[1])", "f(1, 2)"),
    ("def f(n):\n    grid = [[0] * n for _ in range(n)]\n    for i in range(n):\n        grid[i][i] = 1\n    return grid", "f(3)"),
    ("def f(xs):\n    try:\n        return xs[10]\n    except IndexError:\n        return None", "f([1])"),
    ("def f(s):\n    return s.encode('utf-16').hex()[:20], len(s.encode('utf-8'))", "f('héllo')"),
    ("import json\ndef f(d):\n    return json.dumps(d, sort_keys=True)", "f({'b': [1, 2], 'a': None})"),
    ("def f(t):\n    a, *rest = t\n    return {'head': a, 'rest': tuple(rest), 'frozen': frozenset([1, 2])}", "f((1, 2, 3))"),
    ("def f(x):\n    return [print(x), 'printed']", "f(3)"),
    ("f = lambda x: x * 3", "f('ab')"),
]  # fmt: skip


def plain(program: str, expr: str) -> str:
    """Plain execution in this process: fine here because these programs are our own."""
    ns: dict = {"__name__": "__main__"}
    exec(program, ns)
    return repr(eval(expr, ns))


FILE_IO: list[tuple[str, str]] = [
    ("def f(xs):\n    with open('data.txt', 'w') as fh:\n        fh.write('\\n'.join(map(str, xs)))\n"
     "    with open('data.txt') as fh:\n        return [int(line) * 2 for line in fh]", "f([1, 2, 3])"),
    ("import os\ndef f(n):\n    os.makedirs('a/b', exist_ok=True)\n    for i in range(n):\n"
     "        open(f'a/b/{i}', 'w').write(str(i))\n    return sorted(os.listdir('a/b')), os.stat('a/b/3').st_size",
     "f(5)"),
]  # fmt: skip


def test_file_io_in_the_jobs_own_directory(sandbox, tmp_path, monkeypatch):
    """A job may use files in its own (private, small) directory, as a script would."""
    monkeypatch.chdir(tmp_path)
    verdicts = sandbox.run([Job(p, e, deterministic=True) for p, e in FILE_IO])
    assert [(v.status, v.output) for v in verdicts] == [
        (Status.OK, plain(p, e)) for p, e in FILE_IO
    ]


@pytest.mark.parametrize("deterministic", [False, True])
def test_outputs_equal_plain_execution(sandbox, deterministic):
    jobs = [Job(p, e, deterministic=deterministic) for p, e in HONEST]
    verdicts = sandbox.run(jobs)
    for (program, expr), v in zip(HONEST, verdicts, strict=True):
        assert v.status is Status.OK, (program, v)
        assert v.output == plain(program, expr), program
        assert v.error is None and v.duration >= 0


def test_large_output_kept_in_full_below_cap(sandbox):
    (v,) = sandbox.run([Job("def f(n):\n    return list(range(n))", "f(3000)")])
    assert v.ok and v.output == repr(list(range(3000)))


def test_program_without_entry_when_entry_is_none(sandbox):
    (v,) = sandbox.run([Job("", "[1, 2] + [3]", entry=None)])
    assert v.ok and v.output == "[1, 2, 3]"


def test_empty_batch(sandbox):
    assert sandbox.run([]) == []
