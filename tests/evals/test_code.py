"""The code-scoring path: canonical solutions pass, known-wrong programs fail, through the same
`codecheck.score` that scores models (a sample here; the full sets: the command in the README)."""

from pathlib import Path

import pytest

from lorapop.evals import codecheck, data

N = 15  # problems per benchmark in `make test`
FIXTURES = Path(__file__).parent / "fixtures"


def fenced(code: str) -> str:
    return f"<think>easy</think> <answer>\n```python\n{code}\n```\n</answer>"


def wrapped(p: data.Problem) -> str:
    """The canonical solution, but returning its answer inside a list: always a wrong output."""
    e = p.meta["entry_point"]
    return (p.meta["canonical"] + f"\n_ref = {e}\n\n\ndef {e}(*a, **k):\n    return [_ref(*a, **k)]\n")


@pytest.fixture(scope="module")
def problems(data_dir):
    return {b: data.load(b, data_dir, limit=N) for b in ("humanevalplus", "mbppplus")}


@pytest.fixture(scope="module")
def truth(problems, pool):
    rule = codecheck.TimeRule()
    return {b: codecheck.ground_truth(ps, pool, rule) for b, ps in problems.items()}


@pytest.mark.parametrize("bench", ["humanevalplus", "mbppplus"])
def test_canonical_solutions_score_100(bench, problems, truth, pool):
    ps = problems[bench]
    assert all(isinstance(t, list) and t for t in truth[bench].values())
    res = codecheck.score([(p, fenced(p.meta["canonical"])) for p in ps], pool, truth=truth[bench])
    assert [r["reason"] for r in res if not r["passed"]] == []
    n_tests = sum(len(c.args) for t in truth[bench].values() for c in t)
    assert n_tests > 10 * len(ps)  # the plus tests ran, not just the base ones


@pytest.mark.parametrize("bench", ["humanevalplus", "mbppplus"])
def test_known_wrong_solutions_score_0(bench, problems, truth, pool):
    ps = problems[bench]
    wrong = [(p, fenced(wrapped(p))) for p in ps]
    wrong += [(ps[0], fenced("def oops(:\n    pass")), (ps[1], fenced("def other():\n    return 1"))]
    wrong += [(ps[2], fenced(f"def {ps[2].meta['entry_point']}(*a):\n    while True:\n        pass"))]
    wrong += [(ps[3], "I cannot solve this.")]
    res = codecheck.score(wrong, pool, codecheck.TimeRule(min_s=1.0), truth=truth[bench])
    assert [r["passed"] for r in res] == [False] * len(wrong)
    reasons = [r["reason"] for r in res[-4:]]
    assert "syntax_error" in reasons[0] and "no_entry" in reasons[1] and "timeout" in reasons[2]


def test_sanitize_drops_example_calls():
    code = "import math\ndef f(x):\n    return math.sqrt(x)\n\nprint(f(4))\nif __name__ == '__main__':\n    input()\n"
    assert codecheck.sanitize(code) == "import math\ndef f(x):\n    return math.sqrt(x)\n"


def test_livecodebench_functional_and_stdin(pool):
    ps = data.load("livecodebench", source=str(FIXTURES / "lcb_code_generation_lite.jsonl"))
    good = [
        "class Solution:\n    def countPairs(self, nums, target):\n        n = len(nums)\n"
        "        return sum(nums[i] + nums[j] == target for i in range(n) for j in range(i + 1, n))",
        "a, b = map(int, input().split())\nprint(a + b)\nprint(a * b)",
    ]
    bad = ["class Solution:\n    def countPairs(self, nums, target):\n        return len(nums)",
           "a, b = map(int, input().split())\nprint(a + b)"]  # fmt: skip
    res = codecheck.score([(p, fenced(c)) for p, c in zip(ps, good + bad, strict=False)]
                          + [(p, fenced(c)) for p, c in zip(ps, bad, strict=True)], pool)
    assert [r["passed"] for r in res] == [True, True, False, False]
    # stdin solutions see LiveCodeBench's import header too, random and all
    uses = ("a, b = map(int, input().split())\nprint(a + b)\n"
            "print(reduce(operator.mul, [a, b]) + random.randint(0, 0))")  # fmt: skip
    (r,) = codecheck.score([(ps[1], fenced(uses))], pool)
    assert r["passed"], r["reason"]
    assert codecheck.stdout_matches("1.50 \n2\n", "1.5\n2")
    assert not codecheck.stdout_matches("1\n2\n", "1\n3\n")


def test_cruxeval_checks_like_code_o_and_code_i(data_dir, pool):
    o = data.load("cruxeval_o", data_dir, limit=5)
    i = data.load("cruxeval_i", data_dir, limit=5)
    gold = [(p, f"<answer>\n```output\n{p.answer}\n```\n</answer>") for p in o]
    gold += [(p, f"<answer>[ANSWER]f({p.answer})[/ANSWER]</answer>") for p in i]
    assert all(r["passed"] for r in codecheck.score(gold, pool))
    wrong = [(o[0], "<answer>```output\n[]\n```</answer>"), (i[0], "<answer>```input\n'zzz'\n```"),
             (o[1], "<answer>```output\n1) or (True\n```"),  # injection: not one expression
             (i[1], "<answer>```input\n1) or f(2\n```"), (o[2], "no idea")]  # fmt: skip
    assert not any(r["passed"] for r in codecheck.score(wrong, pool))


def test_canonicals_importing_random_and_hashlib_pass(data_dir, pool):
    """HumanEval/39 (random) and /162 (hashlib) need the sandbox's benchmark policy."""
    want = {"HumanEval/39", "HumanEval/162"}
    ps = [p for p in data.load("humanevalplus", data_dir) if p.id in want]
    assert {p.id for p in ps} == want
    res = codecheck.score([(p, fenced(p.meta["canonical"])) for p in ps], pool)
    assert [r["reason"] for r in res] == [None, None]


def test_pool_runs_each_job_under_its_own_limit(pool):
    from lorapop.verify import Job, Status

    assert pool.limit(0.37) == 0.37 and pool.limit(1e4) == pool.cap_s  # exact, capped
    sleep = "import time\ndef f(s):\n    time.sleep(s)\n    return s"
    jobs = [(Job(sleep, "f(2.0)"), 0.3), (Job(sleep, "f(0.05)"), 0.3), (Job(sleep, "f(1.2)"), 5.0)]
    a, b, c = pool.run(jobs)
    assert a.status is Status.TIMEOUT and a.error == "exceeded 0.3 s"
    assert b.ok and c.ok and c.output == "1.2"
