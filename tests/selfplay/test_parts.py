"""A run's parts: built from the config, and one checkpoint structure saved and restored."""

from pathlib import Path

import pytest
import torch

from lorapop.config import load_config
from lorapop.league import Replacement
from lorapop.selfplay.parts import build, load_state, save_state
from lorapop.tasks.task import Task

TINY = Path(__file__).parents[2] / "configs" / "tiny.yaml"


@pytest.fixture
def cfg():
    return load_config(TINY, ["tasks.types=[code_o, code_i]", "verify.workers=1"])


def touch(p):
    """Move every piece of training state away from a fresh build's."""
    for i in p.slot.values():
        state = p.bank.slot_state(i)
        for m in state.values():
            m["B"].normal_(generator=torch.Generator().manual_seed(i))
        p.bank.load_slot(i, state)
    p.opt.exp_avg.add_(1.0)
    p.opt.steps += 3
    p.ratings.set("S1", 31.0, 2.5, played=4)
    p.lineage.replace([Replacement("T1", ("T0",), "copy", 0)])
    p.buffers["code_i"].add(Task("code_i", "def f(a):\n    return -a", ("4",), ("-4",)))
    p.coverage["code_o"].update(["def f(a):\n    return a * 2"])
    torch.manual_seed(123)


def test_save_then_load_restores_the_training_state(cfg, tmp_path):
    saved, fresh = build(cfg), build(cfg)
    try:
        touch(saved)
        folder = tmp_path / "ckpt"
        folder.mkdir()
        save_state(saved, 7, folder)
        assert {f.name for f in folder.iterdir()} == {"adapters", "buffers", "state.pt",
                                                      "config.yaml"}
        assert {d.name for d in (folder / "adapters").iterdir()} == set(saved.slot)
        want_rng = torch.get_rng_state()
        torch.manual_seed(0)
        assert load_state(fresh, folder) == 7
        assert torch.equal(torch.get_rng_state(), want_rng)
        for i in saved.slot.values():
            for k, m in saved.bank.slot_state(i).items():
                assert torch.equal(fresh.bank.slot_state(i)[k]["B"], m["B"])
        assert torch.equal(fresh.opt.exp_avg, saved.opt.exp_avg)
        assert torch.equal(fresh.opt.steps, saved.opt.steps)
        assert fresh.ratings.to_dict() == saved.ratings.to_dict()
        assert fresh.ratings.played("S1") == 4
        assert fresh.lineage.individual("T1") == "T1.g1"
        assert [t.key for t in fresh.buffers["code_i"]] == [t.key for t in saved.buffers["code_i"]]
        assert fresh.coverage["code_o"].seen == saved.coverage["code_o"].seen != set()
    finally:
        saved.close()
        fresh.close()


def test_load_refuses_other_members_and_old_layouts(cfg, tmp_path):
    p = build(cfg)
    other = build(cfg.model_copy(update={"league": cfg.league.model_copy(update={"students": 3})}))
    try:
        folder = tmp_path / "ckpt"
        folder.mkdir()
        save_state(p, 1, folder)
        with pytest.raises(ValueError, match="differ from the config's"):
            load_state(other, folder)
        (folder / "state.pt").unlink()
        with pytest.raises(FileNotFoundError, match="no state.pt"):
            load_state(p, folder)
    finally:
        p.close()
        other.close()


def test_cudnn_attention_follows_the_config(cfg):
    """model.cudnn_attention keeps SDPA off cuDNN's kernel for the whole process unless set;
    the default is off (its per-shape plans cost more than its kernel saves in the loop)."""
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        build(cfg).close()
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        for on in (False, True):
            build(cfg.model_copy(update={"model": cfg.model.model_copy(update={"cudnn_attention": on})})).close()
            assert torch.backends.cuda.cudnn_sdp_enabled() is on
    finally:
        torch.backends.cuda.enable_cudnn_sdp(True)
