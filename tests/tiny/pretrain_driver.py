"""Pretrain a small model on a pickled corpus (run by the data-parallel pretraining test,
under torchrun): `python pretrain_driver.py CORPUS.pkl OUT_DIR STOP_AT key=value...`
(STOP_AT 0: no stop; values are Python literals)."""

import ast
import pickle
import sys
from pathlib import Path

from lorapop import dist
from lorapop.tiny.pretrain import ModelSize, pretrain_tiny

SIZE = ModelSize(hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64, max_positions=1024)


def build(corpus, out: Path, stop_at: int, world: dist.World = dist.SINGLE, **kw) -> dict:
    return pretrain_tiny(out, seed=3, steps=20, device="cpu", vocab_size=300, size=SIZE,
                         pool=96, batch_tokens=2048, corpus=corpus, log=None, world=world,
                         stop=(lambda s: s >= stop_at) if stop_at else None, **kw)  # fmt: skip


if __name__ == "__main__":
    corpus_file, out, stop_at, *pairs = sys.argv[1:]
    kw = {k: ast.literal_eval(v) for k, v in (p.split("=", 1) for p in pairs)}
    world = dist.init("cpu")
    build(pickle.loads(Path(corpus_file).read_bytes()), Path(out), int(stop_at), world, **kw)
    dist.close(world)
