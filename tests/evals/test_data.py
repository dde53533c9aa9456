import base64
import json
import pickle
import zlib
from pathlib import Path

import pytest

from lorapop.evals import data

FIXTURES = Path(__file__).parent / "fixtures"

COUNTS = {"humanevalplus": 164, "mbppplus": 378, "cruxeval_o": 800, "cruxeval_i": 800,
          "gsm8k": 1319, "math500": 500, "aime24": 30, "aime25": 30, "amc23": 40,
          "minerva_math": 272, "olympiadbench": 675}  # fmt: skip


def test_official_files_load(data_dir):
    for name, n in COUNTS.items():
        ps = data.load(name, data_dir)
        assert len(ps) == n and len({p.id for p in ps}) == n, name
    assert {p.answer for p in data.load("aime24", data_dir)} >= {"25", "204"}  # "025" unpadded
    assert data.load("amc23", data_dir)[0].answer == "27"  # 27.0 in the file
    assert data.load("minerva_math", data_dir)[0].answer == "1.6"  # from \boxed{} of solution
    assert data.load("gsm8k", data_dir)[0].answer == "18"
    mbpp2 = data.load("mbppplus", data_dir, limit=1)[0]
    assert mbpp2.id == "Mbpp/2" and isinstance(mbpp2.meta["base_input"][0][0], tuple)


def test_bad_input_is_a_one_line_error(tmp_path):
    with pytest.raises(data.DataError, match="unknown benchmark"):
        data.load("nope", tmp_path)
    with pytest.raises(data.DataError, match="does not exist"):
        data.load("gsm8k", tmp_path)
    with pytest.raises(data.DataError, match="data directory"):
        data.load("gsm8k")
    (tmp_path / "gsm8k").mkdir()
    (tmp_path / "gsm8k" / "test.jsonl").write_text('{"question": 1}\n{oops\n')
    with pytest.raises(data.DataError, match="not JSON|malformed"):
        data.load("gsm8k", tmp_path)


def test_livecodebench_loader_on_a_file_in_the_official_format():
    ps = data.load("livecodebench", source=str(FIXTURES / "lcb_code_generation_lite.jsonl"))
    assert [p.id for p in ps] == ["9001", "abc900_a"]  # the 2022 problem is outside release_v5
    fn, io = ps
    assert fn.meta["func_name"] == "countPairs" and len(fn.meta["tests"]) == 3  # public + private
    assert io.meta["tests"][1] == {"input": "10 -4\n", "output": "6\n-40\n", "testtype": "stdin"}
    wide = data.load("livecodebench", source=str(FIXTURES), window=("2000-01-01", "2099-01-01"))
    assert len(wide) == 3


def test_livecodebench_private_tests_never_unpickle_objects():
    evil = base64.b64encode(zlib.compress(pickle.dumps(print))).decode()
    with pytest.raises(data.DataError, match="refusing"):
        data.lcb_tests(evil)
    ok = base64.b64encode(zlib.compress(pickle.dumps(json.dumps([{"input": "1"}])))).decode()
    assert data.lcb_tests(ok) == [{"input": "1"}]
