import pytest

from lorapop import config
from lorapop.config import Config, ConfigError, dump_config, load_config


def test_defaults_validate():
    cfg = load_config()
    assert isinstance(cfg, Config)
    assert cfg.league.mode == "population"


def test_yaml_and_overrides(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("seed: 3\nlora:\n  rank: 4\n")
    cfg = load_config(p, ["lora.rank=16", "tasks.types=[code_o]", "league.pfsp=hard"])
    assert (cfg.seed, cfg.lora.rank, cfg.tasks.types, cfg.league.pfsp) == (3, 16, ["code_o"], "hard")


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("lora.rnak=4", "unknown key 'lora.rnak'"),
        ("lora.rank=0", "bad value for 'lora.rank'"),
        ("league.pfsp=fancy", "bad value for 'league.pfsp'"),
        ("tasks.types=[code_x]", "bad value for 'tasks.types': Value error, unknown task type "
         "'code_x'"),
        ("norank", "not of the form key.path=value"),
        ("evolve.operators={spectrall: 1.0}", "bad value for 'evolve.operators': Value error, "
         "unknown operator 'spectrall'; known: spectral,"),
        ("evolve.operators={copy: 0.0}", "bad value for 'evolve.operators'"),
        ("evolve.operators={copy: -1.0, mean: 2.0}", "weights must be >= 0"),
        ("train.clip_eps=0.2", "unknown key 'train.clip_eps'"),
        ("train.deterministic=maybe", "bad value for 'train.deterministic'"),
        ("train.deterministic=2", "bad value for 'train.deterministic'"),
    ],
)
def test_bad_keys_and_values_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("[", r"\[")):
        load_config(None, [override])


def test_deterministic_kernels_are_off_unless_asked():
    assert not load_config().train.deterministic
    assert load_config(None, ["train.deterministic=true"]).train.deterministic is True


def test_operator_names_are_the_evolve_operators():
    from lorapop.lora.evolve import OPERATORS

    assert set(config.OPERATORS) == set(OPERATORS)


def test_two_parent_operators_are_evolves():
    from lorapop.lora.evolve import INFO

    assert set(config.TWO_PARENT_OPERATORS) == {n for n, i in INFO.items() if i.n_parents == 2}


def test_two_parent_operators_only_fail_at_load_when_a_pool_has_one_parent():
    two_only = "evolve.operators={dare: 1.0, mean: 1.0}"
    with pytest.raises(ConfigError, match="teacher pool .2 members. has one parent"):
        load_config(None, ["league.mode=population", "league.teachers=2", "league.students=4",
                           "evolve.every=5", "evolve.fraction=0.5", two_only])
    load_config(None, ["league.mode=population", "league.teachers=4", "league.students=4",
                       "evolve.every=5", "evolve.fraction=0.5", two_only])  # two parents per pool: fine
    load_config(None, ["league.mode=population", "league.teachers=2", "league.students=2",
                       "evolve.every=0", two_only])  # no evolution: nothing to check


def test_missing_file_is_one_line():
    with pytest.raises(ConfigError, match="config file not found"):
        load_config("/nonexistent.yaml")


def test_dump_round_trips(tmp_path):
    cfg = load_config(None, ["seed=7", "evolve.every=3"])
    p = tmp_path / "c.yaml"
    p.write_text(dump_config(cfg))
    assert load_config(p) == cfg


@pytest.mark.parametrize(
    ("override", "replacement"),
    [
        ("train.teacher_reward=zero", "use train.teacher_conversion=one_minus"),
        ("train.teacher_reward=azr",
         "use train.teacher_conversion=one_minus train.teacher_format_penalty=-0.5"),
        ("train.teacher_reward=inverse",
         "use train.teacher_conversion=inverse train.teacher_format_penalty=-0.5"),
        ("league.teacher_win_below=0.4", "league.outcome_center and league.draw_margin"),
        ("league.student_win_above=0.6", "league.outcome_center and league.draw_margin"),
    ],
)
def test_removed_keys_name_their_replacement(override, replacement):
    """An old config must not train with a silently changed meaning: one line, what to use."""
    with pytest.raises(ConfigError, match="was removed") as err:
        load_config(None, [override])
    assert replacement in str(err.value) and "\n" not in str(err.value)
