"""The grammar alone (no sandbox): seeds, knobs, safety by construction."""

import ast
import random
import statistics

import pytest

from lorapop.tiny.grammar import LEVELS, Knobs, describe, generate_input, generate_program
from lorapop.verify.static import check


def _draw(seed: str, level: int | Knobs) -> tuple[str, str]:
    rng = random.Random(seed)
    program = generate_program(rng, level)
    return program.source, generate_input(rng, program)


def _depth(node: ast.AST) -> int:
    """Deepest nesting of statement blocks (a bare function body is 1)."""
    blocks = (ast.FunctionDef, ast.If, ast.For, ast.While)
    inner = [_depth(c) for c in ast.iter_child_nodes(node)]
    return (1 if isinstance(node, blocks) else 0) + max(inner, default=0)


def _stats(source: str) -> tuple[int, int]:
    tree = ast.parse(source)
    f = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "f")
    statements = sum(isinstance(n, ast.stmt) for n in ast.walk(f)) - 1
    return _depth(f), statements


def test_same_seed_same_program_and_input() -> None:
    for level in LEVELS:
        assert _draw(f"s{level}", level) == _draw(f"s{level}", level)


def test_seeds_give_different_programs() -> None:
    for level in LEVELS:
        programs = {_draw(f"seed-{i}", level)[0] for i in range(20)}
        assert len(programs) >= 18, level


def test_knobs_raise_depth_and_statements_on_average() -> None:
    means = []
    for level in LEVELS:
        stats = [_stats(_draw(f"k{level}/{i}", level)[0]) for i in range(60)]
        means.append(tuple(statistics.mean(s[k] for s in stats) for k in (0, 1)))
    depths, statements = zip(*means, strict=True)
    assert all(a < b for a, b in zip(statements, statements[1:], strict=False)), statements
    assert all(a <= b for a, b in zip(depths, depths[1:], strict=False)), depths
    assert depths[-1] > depths[0] + 1


def test_loops_helpers_and_params_follow_knobs() -> None:
    flat = Knobs(statements=6, depth=0, params=3, loops=True, helpers=0)
    for i in range(30):
        tree = ast.parse(_draw(f"flat{i}", flat)[0])
        assert not any(isinstance(n, ast.For | ast.While | ast.If) for n in ast.walk(tree))
        (f,) = tree.body
        assert len(f.args.args) == 3
    looped = Knobs(statements=8, depth=2, types=("int", "str", "list"), loops=True, helpers=1)
    sources = [_draw(f"loop{i}", looped)[0] for i in range(30)]
    assert all("def g(" in s and "g(" in s.split("def f(")[1] for s in sources)
    assert sum(("for " in s or "while " in s) for s in sources) >= 15


def test_programs_pass_static_checks_and_avoid_hash_order() -> None:
    for level in LEVELS:
        for i in range(40):
            source, inp = _draw(f"static{level}/{i}", level)
            assert check(source, f"f({inp})") is None
            names = {n.id for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Name)}
            assert not names & {"set", "hash", "id", "frozenset"}
            assert not any(
                isinstance(n, ast.Set | ast.SetComp) for n in ast.walk(ast.parse(source))
            )


def test_plain_runs_mostly_succeed_and_stay_short() -> None:
    """Safe by construction: almost every (program, input) runs without error (exec is fine
    here: these are our own programs)."""
    failures, long = 0, 0
    for level in LEVELS:
        for i in range(40):
            source, inp = _draw(f"run{level}/{i}", level)
            ns: dict = {}
            try:
                exec(source, ns)
                out = repr(eval(f"f({inp})", ns))
            except Exception:
                failures += 1
                continue
            long += len(out) > 60
    assert failures <= 4 and long <= 10, (failures, long)


def test_bad_settings_raise() -> None:
    with pytest.raises(ValueError, match="difficulty"):
        generate_program(random.Random(0), 6)
    with pytest.raises(ValueError, match="types"):
        Knobs(types=("float",))
    with pytest.raises(ValueError, match="params"):
        Knobs(params=0)


def test_describe_names_types_and_constructs() -> None:
    rng = random.Random(3)
    program = generate_program(rng, Knobs(statements=5, depth=1, loops=True, params=2))
    text = describe(program)
    assert text.startswith("f takes ") and text.endswith(".")
    assert text.count(" and ") >= 1
