"""Rollout dump files: atomic gzip JSON lines, a reproducible sampled share, tolerant reading."""

import gzip

from lorapop import rollouts

RECS = [{"step": 3, "member": "T0", "completion": f"<f>def f(x): return {i}</f>", "n": i}
        for i in range(20)]


def test_write_and_read_back(tmp_path):
    out = rollouts.write(tmp_path, 3, RECS)
    assert out == tmp_path / "rollouts" / "step_3.jsonl.gz"
    assert rollouts.read(out) == RECS
    assert not list((tmp_path / "rollouts").glob("*.tmp"))


def test_sampled_share_is_reproducible():
    a = rollouts.sample(RECS, 0.25, seed=11)
    assert len(a) == 5 and a == rollouts.sample(RECS, 0.25, seed=11)
    assert [r["n"] for r in a] == sorted(r["n"] for r in a)  # kept in order
    assert a != rollouts.sample(RECS, 0.25, seed=12)
    assert rollouts.sample(RECS, 1.0, 0) == RECS and rollouts.sample(RECS, 0.0, 0) == []
    assert len(rollouts.sample(RECS, 0.01, 0)) == 1


def test_torn_file_reads_what_parses(tmp_path):
    p = tmp_path / "step_1.jsonl.gz"
    with gzip.open(p, "wt") as fh:
        fh.write('{"a": 1}\nnot json\n[1]\n{"b": 2')
    assert rollouts.read(p) == [{"a": 1}]
    (tmp_path / "bad.gz").write_bytes(b"not gzip")
    assert rollouts.read(tmp_path / "bad.gz") == []
