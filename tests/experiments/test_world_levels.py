"""The regime world's own level table: used alike by its corpus, variants, held-out sets and
measurement, while the shared `LEVELS` (shipped model, held-out benchmark) stays as it was."""

import hashlib
import json
import re
import statistics

import pytest

from lorapop.tasks import program_metrics
from lorapop.tasks.liveness import dead_statement
from lorapop.tiny.corpus import generate_corpus, generate_variants_fast
from lorapop.tiny.generator import candidate
from lorapop.tiny.grammar import (
    LEVELS,
    SHORT_LEVELS,
    TABLE_RULES,
    WORLD_LEVELS,
    Knobs,
    Level,
    table_level,
    table_levels,
)
from lorapop.tiny.heldout import build_heldout
from lorapop.tiny.pretrain import budget_cells
from lorapop.tiny.world import base_rule_overrides, world_of
from regime_recipes import RECIPES as SIZES


def test_standard_levels_and_the_tiny_and_small_recipes_are_unchanged() -> None:
    assert LEVELS[4] == Knobs(statements=8, depth=2, params=2, types=("int", "str", "list", "dict"),
                              loops=True, conditionals=True, helpers=1, expr_depth=2)  # fmt: skip
    assert LEVELS[5].statements == 12 and LEVELS[5].helpers == 2
    assert table_levels("standard") == [1, 2, 3, 4, 5]  # plain numbers: the same programs
    assert SIZES["tiny"].levels == SIZES["small"].levels == "standard"
    assert all(SIZES[s].levels == "world" for s in ("world", "world-exec", "world-refs", "world-steps"))
    # world-short is world-steps on the short table, at small's batches and lr
    changed = {"levels": "short", "steps": 2000, "batch_tokens": 81_920, "lr": 1.5e-3}
    assert SIZES["world-short"].__dict__ == SIZES["world-steps"].__dict__ | changed
    # the 2x base is its parent on twice the programs and steps, nothing else (one pass each)
    parent = SIZES["world-nojoin-f3-77m"]
    assert SIZES["world-nojoin-f3-77m-2x"].__dict__ == parent.__dict__ | {
        "steps": 2 * parent.steps, "n_per_level": 2 * parent.n_per_level}


def test_world_table_shares_levels_1_to_3_and_asks_for_its_own_4_and_5() -> None:
    assert table_levels("world") == [1, 2, 3, Level(4, WORLD_LEVELS[4]), Level(5, WORLD_LEVELS[5])]
    with pytest.raises(ValueError, match="unknown level table"):
        table_level(1, "nope")
    with pytest.raises(ValueError, match="no level 6"):
        table_level(6, "world")


def test_world_corpus_is_labelled_by_level_and_shorter_at_4_and_5() -> None:
    std = generate_corpus(16, "lv/0", levels=table_levels("standard"), workers=1)
    world = generate_corpus(16, "lv/0", levels=table_levels("world"), workers=1)
    by = {n: {lv: [t for t in c if t.meta["difficulty"] == lv] for lv in LEVELS}
          for n, c in (("std", std), ("world", world))}  # fmt: skip
    for lv in (1, 2, 3):
        assert by["world"][lv] == by["std"][lv]
    chars = {n: {lv: statistics.fmean(len(t.program) for t in ts) for lv, ts in d.items()}
             for n, d in by.items()}  # fmt: skip
    for lv in (4, 5):
        assert len(by["world"][lv]) == 16 and chars["world"][lv] < 0.8 * chars["std"][lv]
        assert not any("def g(" in t.program for t in by["world"][lv])  # no helpers at 4-5
    assert chars["world"][3] < chars["world"][5]  # still harder than level 3
    # variants one level up follow the table: same above a level-1 anchor (level 2 is shared),
    # another program above a level-3 one
    anchors = [t for t in std if t.meta["difficulty"] in (1, 3)]
    vs = {n: dict(generate_variants_fast(anchors, "lv/0", workers=1, table=n))
          for n in ("standard", "world")}  # fmt: skip
    for a in anchors:
        s, w = vs["standard"].get(a), vs["world"].get(a)
        if s is not None and w is not None:
            assert (s == w) == (a.meta["difficulty"] == 1)
            assert w.meta["difficulty"] == a.meta["difficulty"] + 1


def test_world_heldout_keeps_levels_1_to_3_and_the_heldout_side(tiny_sandbox) -> None:
    std = build_heldout(2, kinds=("code_o",), sandbox=tiny_sandbox)
    world = build_heldout(2, kinds=("code_o",), sandbox=tiny_sandbox, table="world")
    assert [t.meta["difficulty"] for t in world] == [t.meta["difficulty"] for t in std]
    assert world[:6] == std[:6] and world[6:] != std[6:]
    assert all(t.meta["split"] == "heldout" for t in world)


def test_world_of_a_model_reads_its_training_record(tmp_path) -> None:
    none = {"code_f_inputs": None}
    assert world_of(tmp_path) == {"levels": "standard", "references": 2} | none  # no record
    (tmp_path / "training.json").write_text(json.dumps({"levels": "world", "max_refs": 1}))
    assert world_of(tmp_path) == {"levels": "world", "references": 1} | none
    (tmp_path / "training.json").write_text(json.dumps({"levels": "world", "max_refs": 0,
                                                        "code_f_ns": [4, 6]}))
    assert world_of(tmp_path) == {"levels": "world", "references": 2} | none
    # a base whose code_f examples all asked for 3 inputs is played with 3, unless set
    (tmp_path / "training.json").write_text(json.dumps({"levels": "nojoin", "code_f_ns": [3]}))
    assert world_of(tmp_path)["code_f_inputs"] == 3
    assert base_rule_overrides(tmp_path, ())[1][-1] == "tasks.code_f_inputs=3"
    assert "tasks.code_f_inputs=3" not in base_rule_overrides(tmp_path, {"code_f_inputs"})[1]
    (tmp_path / "training.json").write_text(json.dumps({"levels": "moon"}))
    with pytest.raises(ValueError, match="level table 'moon'"):
        world_of(tmp_path)
    (tmp_path / "training.json").write_text("{not json")
    assert world_of(tmp_path)["levels"] == "standard"


def test_a_base_made_for_a_world_brings_the_rules_its_config_leaves_unset(tmp_path) -> None:
    """`lorapop train` on a world base plays under its table's rules, except where the config
    sets a rule itself; a hub id or a base with no table brings none."""
    from lorapop.config import load_config

    assert base_rule_overrides("Qwen/Qwen2.5-Coder-7B", ()) == ("standard", [])
    assert base_rule_overrides(tmp_path, ()) == ("standard", [])  # no training.json
    (tmp_path / "training.json").write_text(json.dumps({"levels": "nojoin"}))
    table, extra = base_rule_overrides(tmp_path, ())
    assert table == "nojoin"
    assert load_config(None, extra).tasks.world_rules() == TABLE_RULES["nojoin"]
    given = load_config(None, ["tasks.banned_calls=[]", "tasks.references=1"]).tasks
    _, extra = base_rule_overrides(tmp_path, given.model_fields_set)
    rules = load_config(None, ["tasks.banned_calls=[]", *extra]).tasks.world_rules()
    assert rules.banned_calls == () and rules.inputs == TABLE_RULES["nojoin"].inputs
    (tmp_path / "training.json").write_text(json.dumps({"levels": "short"}))  # a table, no rules
    assert base_rule_overrides(tmp_path, ()) == ("short", [])
    (tmp_path / "training.json").write_text(json.dumps({"levels": "moon"}))
    with pytest.raises(ValueError, match="level table 'moon'"):
        base_rule_overrides(tmp_path, ())


def test_short_table_keeps_every_level_short_and_complexity_rising() -> None:
    assert table_levels("short")[0] == 1  # level 1 is the standard one: the same programs
    assert table_levels("short")[1:] == [Level(lv, SHORT_LEVELS[lv]) for lv in (2, 3, 4, 5)]
    corpus = generate_corpus(40, "short/0", levels=table_levels("short"), workers=1)
    by = {lv: [t for t in corpus if t.meta["difficulty"] == lv] for lv in LEVELS}
    assert all(len(ts) == 40 for ts in by.values())
    chars = {lv: statistics.fmean(len(t.program) for t in ts) for lv, ts in by.items()}
    cyclo = {lv: statistics.fmean(program_metrics(t.program).cyclomatic for t in ts)
             for lv, ts in by.items()}  # fmt: skip
    assert chars[1] < chars[2] < chars[3] < chars[5] < 300  # standard level 5: ~1000
    assert cyclo[1] < cyclo[3] < cyclo[5]  # a collapse toward easy tasks stays visible
    assert not any("def g(" in t.program or "dict(" in t.program for t in corpus)
    with pytest.raises(ValueError, match="no level 6"):
        table_level(6, "short")


def test_narrow_table_draws_every_input_inside_its_domain(tiny_sandbox) -> None:
    """`narrow` is `short`'s programs on bounded inputs: corpus and held-out tasks lie inside the
    domain the loop enforces, and the world-narrow recipe differs from world-short by it alone."""
    domain = TABLE_RULES["narrow"].inputs
    assert SIZES["world-narrow"].__dict__ == SIZES["world-short"].__dict__ | {"levels": "narrow"}
    assert table_levels("narrow") == [Level(lv, SHORT_LEVELS[lv], TABLE_RULES["narrow"]) for lv in LEVELS]
    corpus = generate_corpus(30, "narrow/0", levels=table_levels("narrow"), workers=1)
    held = build_heldout(2, sandbox=tiny_sandbox, table="narrow")
    for t in corpus + held:
        assert all(domain.problem(x) is None for x in t.inputs), (t.program, t.inputs)
    short = generate_corpus(30, "narrow/0", levels=table_levels("short"), workers=1)
    outside = [x for t in short for x in t.inputs if domain.problem(x)]
    assert len(outside) > len(short)  # the short table's inputs often leave it
    assert {t.meta["difficulty"] for t in corpus} == set(LEVELS)


def test_world_direct_exec_gives_students_executing_level_1_most_of_its_extra_tokens() -> None:
    """The recipe after the session-15 gate: world-direct's table and rules, more steps, and a
    budget whose level-1 student code_o cell grows most (so a build of it is a test of that)."""
    direct, exec_ = SIZES["world-direct"], SIZES["world-direct-exec"]
    kept = {k: v for k, v in exec_.__dict__.items() if k not in ("steps", "token_shares", "token_levels")}
    assert kept == {k: v for k, v in direct.__dict__.items() if k in kept}

    def tokens(r, cell):  # the cell's tokens, in batches: steps x its share of each batch
        return r.steps * budget_cells(r.token_shares, r.token_levels, LEVELS)[cell]

    growth = {c: tokens(exec_, c) / tokens(direct, c)
              for c in budget_cells(direct.token_shares, direct.token_levels, LEVELS)}
    assert growth[("student/code_o", 1)] > 2.2
    assert max(growth, key=growth.get) == ("student/code_o", 1)
    assert min(growth.values()) > 1.0  # every other cell gets more too


@pytest.mark.parametrize("table", ["live", "natural", "direct"])
def test_live_tables_have_no_dead_code_and_keep_outputs_inside_their_bounds(table, tiny_sandbox) -> None:
    """`live` is `narrow` without dead statements, `natural` that on non-negative values,
    `direct` those rules with a level 1 of one-liners: their corpus, variants and held-out
    tasks keep the world's rules (`TABLE_RULES`) that the loop enforces on proposals, and their
    levels still differ in complexity."""
    rules = TABLE_RULES[table]
    assert rules.live_code and rules.outputs
    assert table != "live" or rules.inputs == TABLE_RULES["narrow"].inputs
    assert SIZES[f"world-{table}"].__dict__ == SIZES["world-short"].__dict__ | {"levels": table}
    corpus = generate_corpus(30, f"{table}/0", levels=table_levels(table), workers=1)
    variants = [v for _, v in generate_variants_fast(corpus, f"{table}/0", workers=1, table=table)]
    held = build_heldout(2, sandbox=tiny_sandbox, table=table)
    assert variants and {t.meta["difficulty"] for t in corpus} == set(LEVELS)
    for t in corpus + variants + held:
        assert dead_statement(t.program) is None, t.program
        assert not any(rules.input_problem(k, x) for k, x in enumerate(t.inputs)), t.inputs
        assert not any(rules.output_problem(y) for y in t.outputs), (t.program, t.outputs)
    cyclo = {lv: statistics.mean(program_metrics(t.program).cyclomatic for t in corpus
                                 if t.meta["difficulty"] == lv) for lv in LEVELS}  # fmt: skip
    assert cyclo[1] < cyclo[3] < cyclo[5]


@pytest.mark.parametrize("table, digest", [
    ("short", "5b4bc5c5"), ("narrow", "35ddd125"), ("live", "1f7e1f61"), ("natural", "fe314e46"),
    ("direct", "6bc516a1"),
])  # fmt: skip
def test_a_tables_program_stream_stays_what_its_base_was_built_on(table, digest) -> None:
    """Bases are rebuilt from a seed: the candidates a level table yields must not move when
    the code around them changes (a field added to `Knobs` once moved every stream)."""
    h = hashlib.sha256()
    for lv in LEVELS:
        for i in range(12):
            c = candidate(table_level(lv, table), "pretrain/0", "train", 6, i)
            h.update(repr(None if c is None else (c.program.source, c.inputs)).encode())
    assert h.hexdigest()[:8] == digest


def test_the_direct_tables_level_1_is_one_return_expression_and_its_other_levels_are_shorts() -> None:
    """The programs the single agent's teacher settled on in the natural world (`return n + 7`)
    are the direct table's whole level 1, on natural's rules; levels 2-5 are short's 1-4."""
    assert TABLE_RULES["direct"] == TABLE_RULES["natural"]
    assert [lv.knobs for lv in table_levels("direct")[1:]] == [SHORT_LEVELS[lv] for lv in (1, 2, 3, 4)]
    corpus = generate_corpus(40, "direct/0", levels=table_levels("direct")[:1], workers=1)
    assert len(corpus) == 40
    for t in corpus:
        lines = t.program.strip().splitlines()
        assert len(lines) == 2 and lines[1].lstrip().startswith("return "), t.program
    assert any(re.fullmatch(r"def f\((\w+): int\):\n    return .*\1 [-+*%] \d+.*", t.program.strip())
               for t in corpus)  # int arithmetic on a constant, as the teacher wrote it


@pytest.mark.parametrize("table, banned", [("nocount", ("count",)), ("nojoin", ("count", "join"))])
def test_tables_without_calls_are_the_direct_stream_less_those_calls(table, banned, tiny_sandbox) -> None:
    """`nocount` leaves out the calls its students never learned (`s.count('y')`), `nojoin`
    also `join`: their corpus, variants and held-out tasks call none of them, each of their
    candidates is `direct`'s candidate of the same index (or none where that one calls one),
    and their recipe is world-direct-exec's on the table."""
    rules = TABLE_RULES[table]
    assert rules.banned_calls == banned and rules.inputs == TABLE_RULES["direct"].inputs
    assert SIZES[f"world-{table}"].__dict__ == SIZES["world-direct-exec"].__dict__ | {"levels": table}
    dropped = 0
    for lv in LEVELS:
        for i in range(40):
            ours = candidate(table_level(lv, table), "pretrain/0", "train", 6, i)
            theirs = candidate(table_level(lv, "direct"), "pretrain/0", "train", 6, i)
            if theirs is not None and rules.call_problem(theirs.program.source):
                dropped += 1
                assert ours is None
            else:
                assert ours == theirs
    assert dropped > 0
    corpus = generate_corpus(30, f"{table}/0", levels=table_levels(table), workers=1)
    variants = [v for _, v in generate_variants_fast(corpus, f"{table}/0", workers=1, table=table)]
    held = build_heldout(2, sandbox=tiny_sandbox, table=table)
    assert variants and held
    assert not any(f".{name}(" in t.program for t in corpus + variants + held for name in banned)


@pytest.mark.parametrize("table", ["nocount", "nojoin"])
def test_a_77m_world_base_is_its_26m_recipe_three_times_larger(table: str) -> None:
    """The larger base differs from its 26M recipe in its shape alone (so a gate on it tests
    the student's size), at ~77M parameters."""
    from lorapop.engine.load import TINY_DIR, load_tokenizer
    from lorapop.tiny.pretrain import build_model

    big, base = SIZES[f"world-{table}-77m"], SIZES[f"world-{table}"]
    assert big.levels == table
    assert {k: v for k, v in big.__dict__.items() if k != "size"} == \
        {k: v for k, v in base.__dict__.items() if k != "size"}
    tok = load_tokenizer(str(TINY_DIR))
    params = [sum(p.numel() for p in build_model(tok, r.size, 0).parameters()) for r in (big, base)]
    assert 70e6 < params[0] < 80e6 and params[0] > 2.8 * params[1]
