"""Pretraining for a world: harder variants of a reference, reference-conditioned examples,
token budgets per role and level, stopped and resumed builds."""

import random

import pytest

from lorapop.tasks import FormatError, Task, get_family
from lorapop.tiny.generator import generate_variants
from lorapop.tiny.grammar import extend_program, generate_program
from lorapop.tiny.pretrain import SIZES, Examples, ModelSize, build_corpus, pretrain_size


@pytest.fixture(scope="module")
def corpus(tiny_sandbox) -> list[Task]:
    return build_corpus(4, 0, tiny_sandbox, levels=(1, 2, 3))


@pytest.fixture(scope="module")
def variants(corpus, tiny_sandbox) -> list[tuple[Task, Task]]:
    return generate_variants(corpus, 0, tiny_sandbox)


def test_extended_program_calls_the_reference_and_keeps_its_signature() -> None:
    for seed in range(20):
        ref = generate_program(random.Random(seed), 1 + seed % 3)
        var = extend_program(random.Random(seed), ref.source, ref.returns, 4)
        assert var == extend_program(random.Random(seed), ref.source, ref.returns, 4)
        head, _, body = var.source.partition("\n\ndef f(")
        assert head.strip() == ref.source.strip().replace("def f(", "def g(", 1)
        assert "def f(" + body.splitlines()[0] == ref.source.splitlines()[0]
        assert "g(" in body and var.params == ref.params and "helper" in var.features
        compile(var.source, "<variant>", "exec")
    with_helper = generate_program(random.Random(0), 5)
    with pytest.raises(ValueError):
        extend_program(random.Random(0), with_helper.source, with_helper.returns, 5)


def test_variants_are_verified_harder_train_programs_on_the_anchors_inputs(
    corpus, variants, tiny_sandbox
) -> None:
    assert len(variants) >= len(corpus) // 2
    for anchor, v in variants:
        assert v.inputs == anchor.inputs and len(set(v.outputs)) > 1
        assert v.meta["difficulty"] == anchor.meta["difficulty"] + 1
        assert v.meta["split"] == "train"
    anchor, v = variants[0]
    fam = get_family("code_o", template="compact")
    (verdict,) = fam.verify([f"{v.program}</f><i>{v.inputs[1]}</i>"], tiny_sandbox)
    assert verdict.valid and verdict.task.output == v.outputs[1]  # the sandbox's output


def test_reference_conditioned_examples_extend_a_shown_reference(corpus, variants) -> None:
    # with no variants (or share 0) the draws are exactly the shipped tiny model's recipe
    plain = Examples(corpus, random.Random(3))
    off = Examples(corpus, random.Random(3), variants=variants, variant_share=0.0)
    assert [plain.draw() for _ in range(50)] == [off.draw() for _ in range(50)]
    ex = Examples(corpus, random.Random(3), teacher_max_level=5, variants=variants,
                  variant_share=1.0)  # fmt: skip
    seen = 0
    for _ in range(200):
        role, prompt, completion = ex.draw()
        if role not in ("teacher/code_o", "teacher/code_i"):
            continue
        seen += 1
        program = completion.split("</f>")[0]
        shown = [r.split("</f>")[0] for r in prompt.split("<f>")[1:-1]]
        assert any(program.startswith(r.replace("def f(", "def g(", 1)) for r in shown)
        fam = get_family(role.split("/")[1], template="compact")
        assert not isinstance(fam.parse_proposal(completion, None), FormatError)
    assert seen > 20


def test_level_matched_references_are_of_the_completions_level(corpus, variants) -> None:
    level = {t.program: t.meta["difficulty"] for t in corpus}
    ex = Examples(corpus, random.Random(5), teacher_max_level=5, variants=variants,
                  variant_share=0.5, level_refs=True)  # fmt: skip
    checked = 0
    for _ in range(300):
        role, prompt, completion = ex.draw()
        if not role.startswith("teacher/code_o"):
            continue
        program = completion.split("</f>")[0]
        shown = [r.split("</f>")[0] for r in prompt.split("<f>")[1:-1]]
        target = level.get(program)
        if target is None:  # a variant: its references are of its anchor's level
            target = next(level[r] for r in shown
                          if program.startswith(r.replace("def f(", "def g(", 1)))
        levels = {level[r] for r in shown if r in level}  # (AZR's seed task has no level)
        assert levels <= {target}, (levels, target)
        checked += len(levels)
    assert checked > 20


def test_sizes_keep_tiny_as_shipped_and_reject_unknown(tmp_path) -> None:
    tiny = SIZES["tiny"]
    assert tiny.size == ModelSize() and (tiny.steps, tiny.n_per_level, tiny.lr) == (3000, 1000, 2e-3)
    assert (tiny.teacher_max_level, tiny.variant_share) == (3, 0.0)
    assert SIZES["small"].teacher_max_level == 5 and SIZES["small"].variant_share > 0
    with pytest.raises(ValueError, match="unknown size"):
        pretrain_size(tmp_path, "huge")


def test_pretrain_with_reference_conditioned_examples_records_its_variants(tmp_path, corpus) -> None:
    from lorapop.tiny.pretrain import pretrain_tiny

    size = ModelSize(hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64, max_positions=1024)
    rec = pretrain_tiny(tmp_path / "m", seed=1, steps=2, device="cpu", vocab_size=300, size=size,
                        batch_size=4, corpus=corpus, teacher_max_level=5, variant_share=0.5,
                        log=None)  # fmt: skip
    assert rec["variant_share"] == 0.5 and rec["variants"] > 0 and rec["teacher_max_level"] == 5
    assert (tmp_path / "m" / "model.safetensors").is_file()
    with pytest.raises(ValueError, match="variant_share"):
        pretrain_tiny(tmp_path / "x", steps=1, corpus=corpus, variant_share=1.5, log=None)


def test_role_and_student_level_weights_skew_the_mix(corpus) -> None:
    ex = Examples(corpus, random.Random(2), teacher_max_level=5,
                  role_weights=(0, 0, 0, 1, 0, 1), student_level_weights={1: 1})  # fmt: skip
    level1 = {t.program for t in corpus if t.meta["difficulty"] == 1}
    for _ in range(60):
        role, prompt, completion = ex.draw()
        assert role in ("student/code_o", "student/code_f")
        program = completion[: -len("</f>")] if role == "student/code_f" else (
            prompt.split("<f>")[1].split("</f>")[0])  # fmt: skip
        assert program in level1
    with pytest.raises(ValueError, match="role_weights"):
        Examples(corpus, random.Random(2), role_weights=(1, 1))


def test_example_weighted_loss_spans_token_mean_to_example_mean() -> None:
    import torch

    from lorapop.tiny.pretrain import example_weighted_loss

    logits = torch.randn(2, 6, 5, generator=torch.Generator().manual_seed(0))
    labels = torch.tensor([[-100, 1, 2, 3, 4, 0], [-100, -100, -100, -100, 2, -100]])
    ce = torch.nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), reduction="none", ignore_index=-100
    ).view(2, 5)  # fmt: skip
    long, short = ce[0, :].sum() / 5, ce[1, 3]
    token_mean = ce.sum() / 6
    assert example_weighted_loss(logits, labels, 0.0) == pytest.approx(float(token_mean), rel=1e-5)
    assert example_weighted_loss(logits, labels, 1.0) == pytest.approx(float((long + short) / 2),
                                                                       rel=1e-5)  # fmt: skip


def test_fast_recipe_pool_rows_do_not_depend_on_workers(tmp_path, corpus) -> None:
    """The pool path of a fast recipe: rows drawn by forked workers equal those drawn in one
    process, and a small end-to-end build records its settings."""
    from lorapop.tiny.pretrain import TINY_MODEL_DIR, draw_rows, pretrain_tiny
    from lorapop.tiny.tokenizer import load_tokenizer

    tok = load_tokenizer(TINY_MODEL_DIR)

    def rows(workers: int):
        ex = Examples(corpus, random.Random(0), teacher_max_level=5, level_refs=True)
        return draw_rows(ex, tok, 50, 300, "s", workers=workers, chunk=7)

    one, two = rows(1), rows(2)
    assert all((a == b).all() for a, b in zip(one[:3], two[:3], strict=True)) and one[3] == two[3]
    assert len(one[1]) == 50 and one[1].sum() == len(one[0]) and (one[2] <= one[1]).all()
    size = ModelSize(hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64, max_positions=1024)
    rec = pretrain_tiny(tmp_path / "m", seed=1, steps=2, device="cpu", vocab_size=300, size=size,
                        corpus=corpus, teacher_max_level=5, pool=40, batch_tokens=2048,
                        max_len=512, fast_corpus=True, variant_share=0.5, example_alpha=0.5,
                        role_weights=(1, 1, 1, 2, 1, 2), student_level_weights={1: 2, 2: 1},
                        tokenizer_programs=5, log=None)  # fmt: skip
    assert rec["variants"] > 0 and rec["pool"]["examples"] == 40 and rec["fast_corpus"]
    assert rec["example_alpha"] == 0.5 and rec["student_level_weights"] == {1: 2, 2: 1}


def test_budget_cells_split_role_shares_over_levels() -> None:
    from lorapop.tiny.pretrain import budget_cells

    cells = budget_cells({"teacher/code_o": 0.5, "student/code_o": 1.5},
                         {"student": {1: 2, 2: 1}, "teacher/code_o": {1: 1, 3: 1, 5: 1}},
                         (1, 2, 3, 4, 5), teacher_max_level=3)  # fmt: skip
    assert cells == pytest.approx({("teacher/code_o", 1): 0.125, ("teacher/code_o", 3): 0.125,
                                   ("student/code_o", 1): 0.5, ("student/code_o", 2): 0.25})
    even = budget_cells({"student/code_i": 1}, None, (1, 2, 3, 4))
    assert even == pytest.approx({("student/code_i", lv): 0.25 for lv in (1, 2, 3, 4)})
    for shares, levels in (({"teacher/code_x": 1}, None), ({"student/code_o": 1}, {"pupil": {}}),
                           ({"student/code_o": 0}, None), ({"student/code_o": -1}, None)):
        with pytest.raises(ValueError, match="token budget"):
            budget_cells(shares, levels, (1, 2))


def test_token_budget_gives_each_role_and_level_its_share_of_tokens(corpus, variants) -> None:
    """Drawn by budget, each (role, level) cell gets its planned share of the tokens (not of
    the examples): short student examples come many times more often than long teacher ones."""
    from collections import Counter

    from lorapop.tiny.pretrain import TINY_MODEL_DIR, budget_cells, tokenize_pairs
    from lorapop.tiny.tokenizer import load_tokenizer

    tok = load_tokenizer(TINY_MODEL_DIR)
    plan = budget_cells({"teacher/code_o": 0.3, "teacher/code_f": 0.1, "student/code_o": 0.6},
                        {"student": {1: 3, 2: 2, 3: 1}}, (1, 2, 3))  # fmt: skip

    def draws(seed: int) -> list[tuple[str, int, str, str]]:
        ex = Examples(corpus, random.Random(seed), teacher_max_level=5, level_refs=True,
                      variants=variants, variant_share=0.5)  # fmt: skip
        means = ex.budget(plan, tok, 1024)
        assert set(means) == set(plan) and all(m > 0 for m in means.values())
        return [ex.draw_cell() for _ in range(3000)]

    got = draws(0)
    assert got[:50] == draws(0)[:50] and got[:50] != draws(1)[:50]
    lengths = tokenize_pairs(tok, [(p, c) for *_, p, c in got], 1024)[1]
    tokens, count = Counter(), Counter()
    for (role, level, _, _), n in zip(got, lengths, strict=True):
        tokens[(role, level)] += int(n)
        count[(role, level)] += 1
    total = sum(tokens.values())
    for cell, share in plan.items():
        assert tokens[cell] / total == pytest.approx(share, abs=0.03), cell
    # the same tokens buy far more short level-1 student examples than teacher ones
    assert count[("student/code_o", 1)] > 4 * count[("teacher/code_o", 1)]
    with pytest.raises(ValueError, match="level 4"):
        Examples(corpus, random.Random(0)).budget({("student/code_o", 4): 1.0}, tok, 1024)


_SHARES = ("teacher/code_o", "teacher/code_i", "teacher/code_f",
           "student/code_o", "student/code_i", "student/code_f")


@pytest.mark.parametrize("batch_tokens, shares", [
    (81_920, (0.12, 0.12, 0.06, 0.30, 0.20, 0.20)),  # students' tokens first
    (20_480, (0.16, 0.16, 0.08, 0.25, 0.15, 0.20)),  # smaller batches, more for teachers
])  # fmt: skip
def test_budgeted_world_recipe_fills_one_pass_and_records_its_budget(tmp_path, corpus,
                                                                     batch_tokens, shares) -> None:  # fmt: skip
    from types import SimpleNamespace

    from lorapop.tiny.pretrain import pretrain_tiny
    from lorapop.tiny.world import world_of

    r = SimpleNamespace(batch_tokens=batch_tokens, token_shares=dict(zip(_SHARES, shares, strict=True)))
    size = ModelSize(hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64, max_positions=1024)
    batch_tokens = r.batch_tokens // 20  # the recipe's batches scaled down, 4096 or 1024 tokens
    rec = pretrain_tiny(tmp_path / "m", seed=1, steps=3, device="cpu", vocab_size=300, size=size,
                        corpus=corpus, teacher_max_level=5, batch_tokens=batch_tokens,
                        max_len=1024, fast_corpus=True, variant_share=0.25, level_refs=True,
                        levels="world", max_refs=1, token_shares=r.token_shares,
                        token_levels={"teacher": {1: 1, 2: 1, 3: 1}, "student": {1: 2, 2: 1, 3: 1}},
                        log=None)  # fmt: skip
    assert rec["levels"] == "world" and rec["max_refs"] == 1
    assert rec["pool"]["tokens"] == pytest.approx(3 * batch_tokens, rel=0.25)  # one pass
    assert rec["pool"]["batch_tokens"] == batch_tokens
    cells = rec["token_budget"]["cells"]
    assert sum(c["share"] for c in cells.values()) == pytest.approx(1.0, abs=1e-3)
    teachers = sum(c["share"] for k, c in cells.items() if k.startswith("teacher"))
    assert teachers == pytest.approx(sum(v for k, v in r.token_shares.items()
                                         if k.startswith("teacher")), abs=1e-3)  # fmt: skip
    assert cells["student/code_o@1"]["share"] == pytest.approx(
        r.token_shares["student/code_o"] * 2 / 4, abs=1e-3)
    assert world_of(tmp_path / "m") == {"levels": "world", "references": 1, "code_f_inputs": None}
    for bad, match in (({"levels": "moon"}, "level table"), ({"max_refs": 0}, "max_refs"),
                       ({"token_shares": {"teacher/code_x": 1.0}}, "token budget")):
        with pytest.raises(ValueError, match=match):
            pretrain_tiny(tmp_path / "x", steps=1, corpus=corpus, variant_share=0.5, log=None,
                          **bad)  # fmt: skip


@pytest.mark.parametrize("pool", [0, 40])  # batches drawn afresh (the tiny recipe) / a pool
def test_a_build_stopped_and_resumed_equals_one_built_in_one_go(tmp_path, corpus, pool) -> None:
    """A build told to stop early stops, keeps its state, and the same call goes on
    to the very model an uninterrupted build makes; another recipe does not take it over."""
    import torch
    from safetensors.torch import load_file

    from lorapop.tiny.pretrain import pretrain_tiny

    size = ModelSize(hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64, max_positions=1024)
    kw = dict(seed=1, steps=5, device="cpu", vocab_size=300, size=size, batch_size=4,
              corpus=corpus, teacher_max_level=5, pool=pool, batch_tokens=2048, max_len=512,
              log=None)  # fmt: skip
    whole = pretrain_tiny(tmp_path / "whole", **kw)
    first = pretrain_tiny(tmp_path / "parts", **kw, stop=lambda done: done == 2)
    assert first == {"stopped_at": 2, "steps": 5, "partial": str(tmp_path / "parts" / "partial")}
    assert not (tmp_path / "parts" / "model.safetensors").exists()
    # killed between saving's two renames: the last state waits under partial.old
    (tmp_path / "parts" / "partial").rename(tmp_path / "parts" / "partial.old")
    with pytest.raises(ValueError, match="partial build of other settings"):
        pretrain_tiny(tmp_path / "parts", **kw | {"lr": 1e-3})
    second = pretrain_tiny(tmp_path / "parts", **kw, stop=lambda done: done == 3)
    assert second["stopped_at"] == 3
    rec = pretrain_tiny(tmp_path / "parts", **kw)
    assert rec["resumed_at"] == [2, 3] and rec["loss_curve"] == whole["loss_curve"]
    assert rec["final_loss"] == whole["final_loss"]
    a, b = (load_file(tmp_path / d / "model.safetensors") for d in ("whole", "parts"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not any((tmp_path / "parts").glob("partial*"))


def test_a_recipe_s_code_f_input_count_sets_its_code_f_teacher_examples(corpus) -> None:
    """A world played with 3 code_f inputs (`tasks.code_f_inputs`) has a base pretrained on
    proposals of 3 (`Recipe.code_f_ns`), not of the default 4 or 6."""
    ex = Examples(corpus, random.Random(0), teacher_max_level=5,
                  role_weights=(0, 0, 1, 0, 0, 0), code_f_ns=(3,))  # fmt: skip
    for _ in range(20):
        role, prompt, completion = ex.draw()
        assert role == "teacher/code_f" and "propose code_f n=3" in prompt
        assert completion.count("</i>") == 3
    with pytest.raises(ValueError, match="code_f_ns"):
        Examples(corpus, random.Random(0), code_f_ns=(7,))
