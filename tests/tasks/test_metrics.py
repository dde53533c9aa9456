from lorapop.tasks import Coverage, ProgramMetrics, program_metrics, signature

FIB = """
def f(n):
    # memoised fibonacci
    memo = {}

    def go(k):
        if k < 2:
            return k
        if k not in memo:
            memo[k] = go(k - 1) + go(k - 2)
        return memo[k]

    return go(n)
"""

LOOPS = """
def f(xs, t):
    total = 0
    for i, x in enumerate(xs):
        if x > t and i % 2 == 0:
            total += x
        elif x < 0:
            continue
    return [y for y in xs if y] or total
"""


def test_identity():
    m = program_metrics("def f(a):\n    return a")
    assert (m.ast_depth, m.cyclomatic, m.loc, m.variables) == (5, 1, 2, 1)
    # Module > FunctionDef > Return > Name > Load


def test_known_programs():
    fib = program_metrics(FIB)
    assert fib.cyclomatic == 3  # two ifs
    assert fib.loc == 9  # comment and blank lines do not count
    assert fib.variables == 3  # n, memo, k (go is a function, not a variable)
    loops = program_metrics(LOOPS)
    # for, if, and, elif, comprehension for, comprehension if, or
    assert loops.cyclomatic == 8
    assert loops.variables == 6  # xs, t, total, i, x, y
    assert loops.ast_depth > program_metrics("def f(a):\n    return a").ast_depth


def test_never_raises_on_bad_text():
    for bad in ["def f(:", "(" * 10_000, "x" * 200_000, "\x00", "  indented = 1", None]:
        assert program_metrics(bad) is None
        assert signature(bad) is None
    assert program_metrics("") == ProgramMetrics(1, 1, 0, 0)  # an empty module is a program


def test_deep_nesting_does_not_overflow():
    def nested(n):
        return "def f(a):\n    return " + "-" * n + "a"

    # Module, FunctionDef, Return, n UnaryOps, Name, its Load context
    assert program_metrics(nested(300)).ast_depth == 305
    assert program_metrics(nested(5000)) is None  # past the parser's nesting limit: no crash
    assert signature(nested(5000)) is None


def test_signature_abstracts_names_and_constants():
    a = signature("def f(a):\n    return a + 1")
    assert a == signature("def g(x):\n    return x + 7")
    assert a == signature("def f(a):\n    # comment\n    return (a + 1)")
    assert a != signature("def f(a):\n    return a - 1")  # another operator
    assert a != signature("def f(a):\n    return a + 'x'")  # another constant type
    assert a != signature("def f(a, b):\n    return a + 1")


def test_coverage_over_a_stream():
    cov = Coverage()
    s1 = cov.update(["def f(a):\n    return a", "def g(b):\n    return b", "def f(:"])
    assert (s1.batch, s1.parsed, s1.batch_distinct, s1.new, s1.total_distinct) == (3, 2, 1, 1, 1)
    s2 = cov.update(["def f(a):\n    return a", "def f(a):\n    return -a"])
    assert (s2.batch_distinct, s2.new, s2.total_distinct) == (2, 1, 2)
    assert cov.update([]).to_json() == {
        "batch": 0,
        "parsed": 0,
        "batch_distinct": 0,
        "new": 0,
        "total_distinct": 2,
    }
