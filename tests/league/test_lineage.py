import json

import pytest

from lorapop.league import Lineage, Replacement, individual_id

SCHEMA = {"target", "replaced", "child", "parents", "parent_slots", "operator", "seed"}


def test_ids_follow_individuals_through_replacements():
    lin = Lineage(["T0", "T1", "T2"])
    assert [lin.individual(s) for s in ("T0", "T1")] == ["T0.g0", "T1.g0"]
    first = lin.replace([Replacement("T2", ("T0",), "dare", 7)])
    assert first == [{"target": "T2", "replaced": "T2.g0", "child": "T2.g1",
                      "parents": ["T0.g0"], "parent_slots": ["T0"], "operator": "dare",
                      "seed": 7}]
    # T2.g1 is now the best; T1 and T0 are replaced by children of it in one plan
    second = lin.replace([Replacement("T1", ("T2",), "spectral", 1),
                          Replacement("T0", ("T2", "T1"), "subspace_mix", 2)])
    assert [set(e) for e in second] == [SCHEMA, SCHEMA]
    assert second[1]["parents"] == ["T2.g1", "T1.g0"]  # read before T1 advances
    assert [e["child"] for e in second] == ["T1.g1", "T0.g1"]
    assert lin.individual("T2") == "T2.g1" == individual_id("T2", 1)
    assert json.loads(json.dumps(second)) == second


def test_round_trip_and_bad_state():
    lin = Lineage(["S0", "S1"])
    lin.replace([Replacement("S1", ("S0",), "copy", 0)])
    back = Lineage.from_dict(json.loads(json.dumps(lin.to_dict())), ["S0", "S1"])
    assert back.individual("S1") == "S1.g1"
    assert Lineage.from_dict({}, ["S0"]).individual("S0") == "S0.g0"  # older runs: g0
    with pytest.raises(ValueError, match="slot"):
        Lineage.from_dict({"X9": 1}, ["S0"])
    with pytest.raises(ValueError, match="generation"):
        Lineage.from_dict({"S0": -1}, ["S0"])
    with pytest.raises(KeyError, match="unknown slot"):
        lin.individual("T7")
