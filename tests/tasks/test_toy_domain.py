"""A new task domain is a registered family: the config accepts its name and the loop plays
it, with nothing else changed (docs/CONTRACTS.md, lorapop.tasks)."""

from pathlib import Path

import pytest

from lorapop.config import ConfigError, load_config
from lorapop.tasks import FAMILIES, register_family
from lorapop.tasks.code_o import CodeO


class Toy(CodeO):
    """A toy domain: code_o's rules under another name."""

    name = "toy"


@pytest.fixture
def toy():
    register_family("toy", Toy)
    yield
    FAMILIES.pop("toy")


def test_unregistered_type_is_refused_with_the_registered_ones():
    with pytest.raises(ConfigError, match="unknown task type 'toy'.*registered: code_o"):
        load_config(None, ["tasks.types=[toy]"])
    with pytest.raises(ConfigError, match="did you mean 'code_o'"):
        load_config(None, ["tasks.types=[code_0]"])


def test_a_registered_domain_runs_a_loop_step(toy, tmp_path):
    from lorapop.selfplay.loop import SelfPlay

    cfg = load_config(Path(__file__).parents[2] / "configs" / "tiny.yaml",
                      ["tasks.types=[toy, code_o]", "tasks.references=1",
                       "sampling.teacher_max_new_tokens=16", "sampling.student_max_new_tokens=4"])
    assert cfg.tasks.types == ["toy", "code_o"]
    sp = SelfPlay(cfg, tmp_path)
    try:
        row = sp.step()
    finally:
        sp.close()
    assert row["programs"]["toy"]["proposed"] == 2 * 3  # teachers x proposals_per_type
