"""Rollout dump files: atomic gzip JSON lines, a reproducible sampled share, tolerant reading."""

import gzip

from lorapop.run import rollouts

RECS = [{"step": 3, "member": "T0", "completion": f"<f>def f(x): return {i}</f>", "n": i}
        for i in range(20)]


def test_write_and_read_back(tmp_path):
    out = rollouts.write_records(tmp_path, 3, RECS)
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


def test_step_records_from_a_step():
    from selfplay.test_records import record  # tests/ is on sys.path (conftest)

    rec = record()
    row = {"members": {"T0": {"individual": "T0.g3"}, "S0": {}},
           "replacements": [{"target": "T0", "replaced": "T0.g2", "child": "T0.g3"}]}
    out = rollouts.step_records(rec, row, lambda ids: f"<{len(ids)} prompt tokens>", 1.0, 0)
    assert len(out) == 6  # 2 proposals, then 4 answers
    valid, invalid = out[0], out[1]
    assert valid["role"] == "teacher" and valid["verdict"] == "valid"
    assert valid["parsed"]["program"].startswith("def f(a)") and valid["parsed"]["outputs"] == ["2"]
    assert invalid["verdict"] == "format: no block" and invalid["parsed"] is None
    assert (valid["reward"], valid["advantage"], invalid["advantage"]) == (0.5, 0.7, -0.7)
    # T0 wrote them before it was replaced this step; S0's rows predate lineage ids
    assert valid["individual"] == "T0.g2" and out[2]["individual"] == "S0.g0"
    answers = out[2:]
    assert [a["verdict"] for a in answers] == ["correct", "wrong", "format_error", "correct"]
    assert [a["advantage"] for a in answers] == [1.1, -0.2, -0.9, None]
    assert answers[0]["prompt"] == "<2 prompt tokens>" and answers[0]["tokens"] == 3
    assert all(r["step"] == 7 for r in out)
    assert len(rollouts.step_records(rec, row, str, 0.5, 1)) == 3
