import json
import random

import pytest

from lorapop.tasks import Task, TaskBuffer, get_family


def task(k: int, type: str = "code_o") -> Task:
    return Task(
        type, f"def f(a):\n    return a + {k}", (str(k),), (str(2 * k),), teacher="t0", step=k
    )


def test_seed_is_azr_identity():
    buf = TaskBuffer("code_o", seeds=get_family("code_o").seed_tasks())
    [seed] = list(buf)
    assert seed.program == "def f(a):\n    return a"
    assert seed.inputs == ("'Hello World'",) and seed.outputs == ("'Hello World'",)


def test_dedup_identical_program_and_inputs():
    buf = TaskBuffer("code_o")
    assert buf.add(task(1))
    # same program and input, other provenance and trailing whitespace: a duplicate
    dup = Task("code_o", task(1).program + "\n  \n", (" 1 ",), ("2",), teacher="t9", step=99)
    assert not buf.add(dup)
    assert buf.add(Task("code_o", task(1).program, ("5",), ("10",)))  # another input: new
    assert len(buf) == 2


def test_bound_evicts_oldest_and_keeps_new():
    buf = TaskBuffer("code_o", capacity=3, seeds=get_family("code_o").seed_tasks())
    assert buf.add_all(task(k) for k in range(5)) == 5
    assert len(buf) == 3
    assert [t.step for t in buf] == [2, 3, 4]  # the seed and tasks 0, 1 were evicted


def test_random_eviction_is_seeded():
    def run(seed):
        buf = TaskBuffer("code_o", capacity=4, eviction="random", seed=seed)
        buf.add_all(task(k) for k in range(20))
        return [t.step for t in buf]

    assert run(1) == run(1)
    assert len(run(1)) == 4 and 19 in run(1)  # the newest task is always kept
    assert any(run(1) != run(s) for s in range(2, 6))


def test_sample_is_uniform_distinct_and_reproducible():
    buf = TaskBuffer("code_o")
    buf.add_all(task(k) for k in range(10))
    a = buf.sample(6, random.Random(3))
    assert a == buf.sample(6, random.Random(3))
    assert len({t.key for t in a}) == 6
    assert len(buf.sample(50, random.Random(0))) == 10
    counts = {k: 0 for k in range(10)}
    rng = random.Random(0)
    for _ in range(3000):
        for t in buf.sample(1, rng):
            counts[t.step] += 1
    assert min(counts.values()) > 240 and max(counts.values()) < 360


def test_wrong_type_and_bad_settings_are_refused():
    with pytest.raises(ValueError):
        TaskBuffer("code_o").add(task(1, "code_i"))
    with pytest.raises(ValueError):
        TaskBuffer("code_o", capacity=0)
    with pytest.raises(ValueError):
        TaskBuffer("code_o", eviction="lifo")


def test_save_load_round_trip(tmp_path):
    buf = TaskBuffer("code_f", seeds=get_family("code_f").seed_tasks())
    buf.add(
        Task(
            "code_f",
            "def f(a):\n    return 'é' * a",
            ("1", "2"),
            ("'é'", "'éé'"),
            "repeat",
            "t2",
            5,
            {"solve_rate": 0.5},
        )
    )
    path = tmp_path / "buf.jsonl"
    buf.save(path)
    back = TaskBuffer.load(path, "code_f")
    assert list(back) == list(buf)
    assert list(back)[1].meta == {"solve_rate": 0.5}
    assert len(path.read_text(encoding="utf-8").splitlines()) == 2


def test_load_names_the_bad_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    good = json.dumps(task(1).to_json())
    for bad in [
        "{not json",
        json.dumps({"type": "code_o"}),
        json.dumps(task(1, "code_i").to_json()),
    ]:
        path.write_text(good + "\n\n" + bad + "\n", encoding="utf-8")
        with pytest.raises(ValueError, match=r"bad.jsonl:3: "):
            TaskBuffer.load(path, "code_o")


def test_task_json_validation():
    t = task(3)
    assert Task.from_json(json.loads(t.dumps())) == t
    old = {k: v for k, v in t.to_json().items() if k != "teacher"} | {"proposer": "t0"}
    assert Task.from_json(old) == t  # buffers saved before `proposer` was named `teacher`
    for bad in [
        [],
        {"type": "code_o", "program": "x", "inputs": ["1"], "outputs": []},
        {"type": "code_o", "program": 5, "inputs": ["1"], "outputs": ["1"]},
    ]:
        with pytest.raises(ValueError):
            Task.from_json(bad)
