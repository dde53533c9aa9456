"""The regime world's base-model recipes: `lorapop.tiny.pretrain`'s `small` recipe on shorter
level tables, with token budgets per role and level, and larger shapes.

`RECIPES` holds the package's sizes (`tiny`, `small`) and these; build one with
`pretrain_size(out_dir, name, sizes=RECIPES)` (what `world_experiment.py` does for a missing
base) or side by side with `world_recipes.py`.
"""

from __future__ import annotations

from lorapop.tiny.pretrain import SIZES, ModelSize, Recipe

RECIPES: dict[str, Recipe] = dict(SIZES)
# Regime-world candidates (built and measured side by side by world_recipes.py): `small`'s
# model and corpus size on the world's level table (levels 4-5 of ~250/~350 characters, not
# ~500/~1000) and a token budget per role and level instead of example weights, so many short
# student examples at levels 1-3 get the tokens that long teacher examples took; one reference
# per teacher prompt, of at most 600 characters. A pool of steps x batch_tokens tokens: one pass.
_WORLD = RECIPES["small"].__dict__ | {
    "levels": "world", "max_refs": 1, "ref_max_chars": 600, "max_len": 1024, "pool": 0,
    "role_weights": None, "student_level_weights": None,
    "token_shares": {"teacher/code_o": 0.12, "teacher/code_i": 0.12, "teacher/code_f": 0.06,
                     "student/code_o": 0.30, "student/code_i": 0.20, "student/code_f": 0.20},
    "token_levels": {"teacher": {1: 1, 2: 1, 3: 1, 4: 1, 5: 1},
                     "student": {1: 3, 2: 3, 3: 2, 4: 1, 5: 1}},
}  # fmt: skip
RECIPES |= {
    # the budget above
    "world": Recipe(**_WORLD),
    # students first: 80% of tokens, code_o (execution) above all, levels 1-2 heaviest; the
    # plain token mean (the budget already aims the tokens)
    "world-exec": Recipe(**_WORLD | {
        "example_alpha": 0.0,
        "token_shares": {"teacher/code_o": 0.08, "teacher/code_i": 0.08, "teacher/code_f": 0.04,
                         "student/code_o": 0.40, "student/code_i": 0.20, "student/code_f": 0.20},
        "token_levels": {"teacher": {1: 1, 2: 1, 3: 1, 4: 1, 5: 1},
                         "student": {1: 4, 2: 3, 3: 2, 4: 1, 5: 1}}}),
    # references copied: half of the code_o/code_i teacher examples extend a shown reference
    # (two shown), so what a teacher proposes depends on what it is shown
    "world-refs": Recipe(**_WORLD | {"variant_share": 0.5, "max_refs": 2}),
    # many small steps: the three above, 500 steps of 80k-token batches each (three builds
    # sharing one H100), came out with teachers mostly invalid (syntax errors) and students
    # solving under 10% even at level 1, the loss still falling: ~750 examples a batch, so
    # 400k examples made only 500 updates, of which level-1 student code_o steered ~15% (a 3.5M
    # model trained on that role alone answers 0.35-0.45 of level-1 tasks after 300-1200
    # updates, `tiny_execution.py`). Here 20k-token batches (~200 examples), 3000 updates at
    # lr 1e-3, and teachers back to 40% of the tokens (students 60%)
    "world-steps": Recipe(**_WORLD | {
        "steps": 3000, "batch_tokens": 20_480, "lr": 1e-3,
        "token_shares": {"teacher/code_o": 0.16, "teacher/code_i": 0.16, "teacher/code_f": 0.08,
                         "student/code_o": 0.25, "student/code_i": 0.15, "student/code_f": 0.20}}),
}  # fmt: skip
RECIPES |= {
    # tune the world, not the algorithm: `world-steps`' mix at 80k-token batches (as `small`)
    # on a level table whose every level is short (`grammar.SHORT_LEVELS`: level 5 is ~220
    # characters, like the standard level 3), since validity at temperature 1 falls with
    # program length (`small`: code_o .90 .75 .45 .25 .00 at 60 / 155 / 220 / 500 / 1000
    # characters) and students execute short programs best; 2000 steps (~150M tokens, ~8
    # minutes on an H100)
    "world-short": Recipe(**RECIPES["world-steps"].__dict__ | {
        "levels": "short", "steps": 2000, "batch_tokens": 81_920, "lr": 1.5e-3}),
}  # fmt: skip
# `world-short` on bounded inputs (`grammar.TABLE_RULES["narrow"]`: ints -5..9, strings of
# <= 4 characters, <= 4 items): on `world-short` the single agent's one-line programs stayed
# half unsolved through their values (two-digit products, counts over 7-letter strings), so
# its teacher found difficulty without complexity
RECIPES["world-narrow"] = Recipe(**RECIPES["world-short"].__dict__ | {"levels": "narrow"})
# `world-narrow` without dead statements (`grammar.TABLE_RULES["live"]`): on `world-narrow` the
# single agent padded its one-line programs with `x = x` chains and values never read and its
# own solve rate fell; this base never sees dead code
RECIPES["world-live"] = Recipe(**RECIPES["world-short"].__dict__ | {"levels": "live"})
# `world-live` on non-negative values (`grammar.TABLE_RULES["natural"]`): on `world-live` many
# of the single agent's unsolved tasks did arithmetic through negative values
RECIPES["world-natural"] = Recipe(**RECIPES["world-short"].__dict__ | {"levels": "natural"})
# `world-natural` on `grammar.DIRECT_LEVELS` (level 1: one `return` expression): on
# `world-natural` the single agent's student stayed at ~50% on such one-liners, rare in its base's
# corpus, and its teacher kept proposing them
RECIPES["world-direct"] = Recipe(**RECIPES["world-short"].__dict__ | {"levels": "direct"})
# `world-direct` with 1.35x the steps, most of them for students executing level-1 programs: on
# `world-direct` the single agent's code_o stayed at 0.5-0.6 on one-liners (its base answered 0.34
# of its own level-1 code_o tasks), while a model of its shape trained on that role alone, with
# as many examples, answered 0.61 of unseen ones at T=1, its loss still falling. ~2.3x the
# level-1 code_o tokens, more in every other cell; 2,700 steps (the build and its measurement:
# ~520 s on an H100)
RECIPES["world-direct-exec"] = Recipe(**RECIPES["world-direct"].__dict__ | {
    "steps": 2700,
    "token_shares": {"teacher/code_o": 0.14, "teacher/code_i": 0.14, "teacher/code_f": 0.07,
                     "student/code_o": 0.35, "student/code_i": 0.13, "student/code_f": 0.17},
    "token_levels": {"teacher": {1: 1, 2: 1, 3: 1, 4: 1, 5: 1},
                     "student": {1: 4, 2: 3, 3: 2, 4: 1, 5: 1}}})  # fmt: skip
# `world-direct-exec` without `count` calls (`grammar.TABLE_RULES["nocount"]`): on
# `world-direct-exec` 69% of one seed's unsolved code_o tasks counted characters, as 86% of one
# on `world-direct`
RECIPES["world-nocount"] = Recipe(**RECIPES["world-direct-exec"].__dict__ | {"levels": "nocount"})
# ... and without `join` (`TABLE_RULES["nojoin"]`): on `world-nocount` the seed whose solve
# rate fell had 91-96% of its unsolved code_o/code_i tasks on `''.join(map(str, xs))`
RECIPES["world-nojoin"] = Recipe(**RECIPES["world-direct-exec"].__dict__ | {"levels": "nojoin"})
# `world-nocount` three times larger (768 x 12, 77M parameters): on every 26M base the gate's
# single agent lost its solve rate to short programs its student executes wrongly, so a
# stronger student was the lever left. On it the gate holds in 2 of 3 seeds, though its loss
# ends above the 26M's (0.410 against 0.344). Built data parallel on 2 H100s (torchrun): 442 s
# of training; 154 MB in bf16
_SIZE_77M = ModelSize(hidden=768, layers=12, heads=12, kv_heads=4, intermediate=2048)
RECIPES["world-nocount-77m"] = Recipe(**RECIPES["world-nocount"].__dict__ | {"size": _SIZE_77M})
# `world-nojoin` at 77M: in the verdict arms on `world-nocount-77m` the single agent's
# solve rate fell back in 2 of 3 seeds, in seed 0 on `''.join(map(str, xs))` tasks (71% of its
# last steps' code_o/code_i tasks; its students solved 0.56 of their inverses). On it the gate
# holds in 3 of 3 seeds (2 ranks on H200s, final loss 0.422)
RECIPES["world-nojoin-77m"] = Recipe(**RECIPES["world-nojoin"].__dict__ | {"size": _SIZE_77M})
# `world-nojoin-77m` for a world of 3 code_f inputs (2 shown, 1 checking) and with more level-5
# teacher tokens: `world-nojoin-77m` passed 3 of the 5 regime checks. Its code_o/code_i proposals
# were valid 0.38 / 0.48 at level 5 (0.75-0.93 below it) and its code_f ones 0.72 at levels 1-4,
# nearly all for duplicate inputs (one argument of 0-9: 4 random draws repeat one half the
# time, 3 over a quarter of it), and it solved 0.087 of code_f (>= 0.1 asked). Level 5 gets 2.25x
# the teacher tokens of levels 1-3 (34% of them, from 20%); the shares per role stay
RECIPES["world-nojoin-f3-77m"] = Recipe(**RECIPES["world-nojoin-77m"].__dict__ | {
    "code_f_ns": (3,),
    "token_levels": {"teacher": {1: 1, 2: 1, 3: 1, 4: 1.25, 5: 2.25},
                     "student": RECIPES["world-nojoin-77m"].token_levels["student"]}})  # fmt: skip
# `world-nojoin-f3-77m` on twice the programs and steps (on 4 ranks, expected to build in about
# its parent's 2-rank time):
# it passed 4 of the 5 checks (code_f valid 0.83, solved 0.12), validity >= 0.8 still
# short for code_o / code_i (0.76 / 0.69: syntax and runtime errors, dead code). Its loss (0.450)
# ends above the 26M bases' (0.34), whose proposals were more often valid: 224M tokens are a
# small share of what 77M parameters can take in. Level 1's one-expression programs run short
# first: 45.6k distinct in its first 600k candidates (the corpus may draw 200 per program)
RECIPES["world-nojoin-f3-77m-2x"] = Recipe(**RECIPES["world-nojoin-f3-77m"].__dict__ | {
    "steps": 5400, "n_per_level": 48_000})
