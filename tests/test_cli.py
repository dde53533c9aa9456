"""The command line as a user drives it: train, report, export, eval, and its errors."""

import html
import json
import os
import stat
from pathlib import Path

import pytest
from typer.testing import CliRunner

from lorapop.cli import app
from lorapop.config import load_config

TINY = str(Path(__file__).parents[1] / "configs" / "tiny.yaml")
FAST = ["tasks.types=[code_o]", "sampling.teacher_max_new_tokens=8",
        "sampling.student_max_new_tokens=4", "run.progress=false"]
BACKENDS = ["run.tensorboard=true", "run.wandb=true", "run.progress=true"]
KEEP = ["run.save_every=1", "run.keep_last=1"]


def run(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def test_help_lists_commands():
    result = run("--help")
    assert result.exit_code == 0
    for cmd in ("train", "report", "export", "eval", "verify"):
        assert cmd in result.output


@pytest.mark.parametrize("cmd", [[], ["train"], ["export"], ["eval"]])
def test_help_shows_no_type_for_flags(cmd):
    result = run(*cmd, "--help")
    assert result.exit_code == 0 and "<bool>" not in result.output
    assert "--help" in result.output


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 2-step population run with its baseline, TensorBoard and W&B (offline) on, and
    progress on while stdout is not a terminal."""
    out = tmp_path_factory.mktemp("run")
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        result = run("train", TINY, "--steps", 2, "--out", out, *FAST, *BACKENDS, *KEEP,
                     "run.with_baseline=true")
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    assert result.exit_code == 0, result.output
    return out, result.output


@pytest.fixture(scope="module")
def run_dir(trained):
    return trained[0]


def test_batch_log_has_one_plain_line_per_step(trained):
    _, output = trained
    lines = [x for x in output.splitlines() if x.startswith("step ")]
    assert [x.split(" |")[0] for x in lines] == ["step 1/2", "step 2/2"] * 2  # run + baseline
    assert all("propose" in x and "tok/s" in x and "ETA 0:" in x for x in lines)
    assert "\x1b" not in output


def test_backends_and_run_facts_written(run_dir):
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert (run_dir / "wandb_id").is_file() and list((run_dir / "wandb").glob("offline-run-*"))
    info = json.loads((run_dir / "run.json").read_text())["sessions"]
    assert len(info) == 1 and info[0]["command"].startswith("lorapop train")
    assert info[0]["last_step"] == 2 and info[0]["end_unix"] >= info[0]["start_unix"]
    assert not info[0]["deterministic_kernels"] and info[0]["no_deterministic_kernel"] is None
    page = (run_dir / "report.html").read_text()
    assert "wall time" in page and html.escape(info[0]["command"]) in page


def test_train_with_baseline_writes_runs_and_report(run_dir):
    assert (run_dir / "report.html").is_file()
    assert (run_dir / "baseline" / "metrics.jsonl").read_text().count("\n") == 2
    page = (run_dir / "report.html").read_text()
    assert "Population vs baseline" in page


def test_export_member_as_peft_dir(run_dir, tmp_path):
    result = run("export", run_dir, "S1", tmp_path / "s1")
    assert result.exit_code == 0, result.output
    files = {p.name: p for p in (tmp_path / "s1").iterdir()}
    assert set(files) >= {"adapter_config.json", "adapter_model.safetensors"}
    for f in files.values():  # others on a shared cluster can read it
        assert f.stat().st_mode & stat.S_IROTH, f
    bad = run("export", run_dir, "S9", tmp_path / "s9")
    assert bad.exit_code == 2 and "no member 'S9'" in bad.output and "S1" in bad.output


def test_checkpoint_adapters_are_readable_by_others(run_dir):
    weights = list((run_dir / "checkpoints").glob("step_*/adapters/*/adapter_model.safetensors"))
    assert weights and all(w.stat().st_mode & stat.S_IROTH for w in weights)


def test_exported_adapter_loads_with_auto_peft(run_dir, tmp_path):
    from peft import AutoPeftModelForCausalLM

    assert run("export", run_dir, "T0", tmp_path / "t0").exit_code == 0
    cfg = json.loads((tmp_path / "t0" / "adapter_config.json").read_text())
    assert Path(cfg["base_model_name_or_path"]).is_dir()  # not the lorapop-only name "tiny"
    model = AutoPeftModelForCausalLM.from_pretrained(tmp_path / "t0")
    assert model.peft_config["default"].r == 8


def test_export_baseline_member_a0(run_dir, tmp_path):
    result = run("export", run_dir, "A0", tmp_path / "a0")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "a0" / "adapter_model.safetensors").is_file()


@pytest.mark.parametrize("member", ["..", ".", "../checkpoints", ""])
def test_export_rejects_paths_as_members(run_dir, tmp_path, member):
    result = run("export", run_dir, member, tmp_path / "x")
    assert result.exit_code == 2 and "no member" in result.output
    assert not (tmp_path / "x").exists()


def test_eval_run_dir_scores_members_and_baseline(run_dir):
    data = Path(__file__).parent / "fixtures" / "data"  # two hand-written gsm8k-format problems
    result = run("eval", run_dir, "--bench", "gsm8k", "--data-dir", data, "--limit", 2,
                 "--max-new-tokens", 4)
    assert result.exit_code == 0, result.output
    header = next(line for line in result.output.splitlines() if line.startswith("| benchmark"))
    for name in ("T0", "T1", "S0", "S1", "baseline"):
        assert name in header
    assert (run_dir / "eval" / "eval.md").is_file()
    assert run("report", run_dir).exit_code == 0
    page = (run_dir / "report.html").read_text()
    assert "Held-out evaluation (lorapop eval)" in page and "<a href='#eval'>" in page


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["train", TINY, "lora.rnak=3"], "unknown key 'lora.rnak'"),
        (["train", TINY, "league.pfsp=best"], "bad value for 'league.pfsp'"),
        (["train", "missing.yaml"], "config file not found"),
        (["train", TINY, "model.name_or_path=./no/such/model"], "model path not found"),
        (["train", "--resume", "/nonexistent-run"], "--resume /nonexistent-run: no such directory"),
        (["report", "/nonexistent-run"], "no metrics.jsonl"),
        (["train", TINY, "--out", "EXISTING"], "already holds a run"),
        (["train", TINY, "--steps", "-5"], "bad value for 'train.steps'"),
        (["train", "LATIN1"], "not UTF-8 text"),
        (["train", "EMPTY"], "the config file is empty"),
        (["pretrain-tiny"], "give --out DIR"),
        (["train", TINY, "tasks.template=chat"], "needs a tokenizer with a chat template"),
        (["train", TINY, "--from-step", "1"], "--from-step goes with --resume"),
        (["eval", "/nonexistent-run", "--bench", "tiny"], "not found"),
    ],
)
def test_errors_are_one_line(tmp_path, run_dir, args, message):
    (tmp_path / "latin1.yaml").write_bytes("seed: 0  # r\xe9sum\xe9\n".encode("latin-1"))
    (tmp_path / "empty.yaml").write_text("# nothing\n")
    files = {"EXISTING": run_dir, "LATIN1": tmp_path / "latin1.yaml",
             "EMPTY": tmp_path / "empty.yaml"}
    args = [str(files.get(a, a)) for a in args]
    needs_out = args[0] == "train" and "--resume" not in args and "--out" not in args
    result = run(*args, "--out", tmp_path / "r") if needs_out else run(*args)
    assert result.exit_code == 2
    assert message in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_pretrain_tiny_refuses_a_bad_size_and_never_overwrites_the_shipped_model():
    bad = run("pretrain-tiny", "--size", "huge", "--out", "x")
    assert bad.exit_code != 0 and "unknown --size 'huge'" in bad.output
    no_out = run("pretrain-tiny", "--size", "small")
    assert no_out.exit_code != 0 and "give --out DIR" in no_out.output
    device = run("pretrain-tiny", "--size", "small", "--out", "x", "--device", "gpu")
    assert device.exit_code == 2 and device.output.startswith("error: --device 'gpu': Expected one")
    assert len(device.output.strip().splitlines()) == 1


def test_pretrain_tiny_refuses_a_batch_the_cpu_cannot_hold_before_any_work(monkeypatch, tmp_path):
    """A GPU recipe on a laptop: one line before the corpus is made, where the kernel would
    otherwise kill the build mid-way without a word."""
    import lorapop.tiny.pretrain as pretrain

    monkeypatch.setattr(pretrain, "host_free_memory", lambda: 16 * 2**30)
    monkeypatch.setattr(pretrain, "generate_corpus", _raising(AssertionError("work began")))
    result = run("pretrain-tiny", "--size", "small", "--out", tmp_path / "m", "--device", "cpu")
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines()[-1] == (
        "error: one batch of 81,920 tokens needs ~29 GiB to train this model on the CPU, and 16 "
        "GiB are free: build it on a GPU (--device cuda)")
    assert not (tmp_path / "m").exists()


def _raising(error):
    def fail(*args, **kwargs):
        raise error

    return fail


@pytest.mark.parametrize("error", [MemoryError(), RuntimeError("DefaultCPUAllocator: can't "
                                   "allocate memory: you tried to allocate 83853312 bytes"),
                                   RuntimeError("CUDA out of memory. Tried to allocate 2 GiB")])
def test_pretrain_tiny_out_of_memory_is_one_line_that_names_the_way_out(monkeypatch, tmp_path, error):
    """A GPU recipe started on a CPU runs out of memory in its first batches: one line that
    says so, not a traceback; other errors are not disguised as memory."""
    import lorapop.tiny.pretrain as pretrain

    monkeypatch.setattr(pretrain, "pretrain_size", _raising(error))
    result = run("pretrain-tiny", "--size", "small", "--out", tmp_path / "m", "--device", "cpu")
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        "warning: --size small is made for a GPU; on a CPU it may run out of memory or "
        "take hours",
        "error: out of memory pretraining --size small on --device cpu (sizes other than "
        "tiny are made for a GPU: --device cuda)"]
    monkeypatch.setattr(pretrain, "pretrain_size", _raising(RuntimeError("shape mismatch")))
    other = run("pretrain-tiny", "--size", "small", "--out", tmp_path / "m")
    assert isinstance(other.exception, RuntimeError) and "shape mismatch" in str(other.exception)


def test_pretrain_tiny_stop_after_stops_a_build_and_says_how_to_go_on(monkeypatch, tmp_path):
    import lorapop.tiny.pretrain as pretrain

    def build(out, size, *, stop, **kw):  # the build asks `stop` after each step
        if stop is not None and stop(1):
            return {"stopped_at": 1, "steps": 5, "partial": f"{out}/partial"}
        return {"final_loss": 0.5, "weights_sha256": "0123abcd"}

    monkeypatch.setattr(pretrain, "pretrain_size", build)
    stopped = run("pretrain-tiny", "--out", tmp_path / "m", "--stop-after", 0)
    assert stopped.exit_code == 0
    assert stopped.output.strip() == ("stopped at step 1 of 5 (--stop-after): the same command "
                                      "goes on from there")
    done = run("pretrain-tiny", "--out", tmp_path / "m", "--stop-after", 3600)
    assert done.exit_code == 0 and done.output.strip() == (f"saved {tmp_path / 'm'} (final loss "
                                                         "0.500, weights 0123abcd)")
    monkeypatch.setattr(pretrain, "pretrain_size", _raising(ValueError(
        "m/partial holds a partial build of other settings; remove it or build into another "
        "directory")))
    other = run("pretrain-tiny", "--out", tmp_path / "m")
    assert other.exit_code == 2 and other.output.startswith("error: m/partial holds a partial")


def test_train_on_a_world_base_plays_under_its_rules(tmp_path):
    """A base pretrained for a world with rules (its training.json's level table) brings them
    to `lorapop train`; a rule the command line sets stays as set."""
    import shutil

    from lorapop.engine.load import TINY_DIR
    from lorapop.tiny.grammar import TABLE_RULES

    base = tmp_path / "base"
    shutil.copytree(TINY_DIR, base)
    record = json.loads((base / "training.json").read_text())
    (base / "training.json").write_text(json.dumps({**record, "levels": "nojoin"}))
    out = tmp_path / "run"
    result = run("train", TINY, "--steps", 1, "--out", out, *FAST, f"model.name_or_path={base}",
                 "tasks.live_code=false", "--no-report")
    assert result.exit_code == 0, result.output
    assert "level table 'nojoin'" in result.output and "tasks.banned_calls" in result.output
    rules = load_config(out / "config.yaml").tasks.world_rules()
    want = TABLE_RULES["nojoin"]
    assert rules.banned_calls == want.banned_calls == ("count", "join")
    assert (rules.inputs, rules.outputs) == (want.inputs, want.outputs) and not rules.live_code


@pytest.mark.parametrize("missing", [None, "foo_cuda does not have a deterministic implementation"])
def test_deterministic_training_is_recorded_and_an_op_without_a_kernel_warns(
        tmp_path, monkeypatch, missing):
    """`train.deterministic=true`: run.json records whether the update's kernels were
    deterministic; an op the probe finds without one is named in one line and in run.json, and
    the update goes on warning instead of failing."""
    import torch

    from lorapop.selfplay.loop import SelfPlay
    from lorapop.selfplay.update import PolicyUpdate

    def probe(self) -> None:
        raise RuntimeError(f"{missing}, but you set 'torch.use_deterministic_algorithms(True)'\n.")

    if missing:
        monkeypatch.setattr(PolicyUpdate, "kernel_probe", probe)
    warn_only, update = [], SelfPlay.update
    monkeypatch.setattr(SelfPlay, "update", lambda self, *a: warn_only.append(
        torch.is_deterministic_algorithms_warn_only_enabled()) or update(self, *a))
    result = run("train", TINY, "--steps", 1, "--out", tmp_path, *FAST, "train.deterministic=true",
                 "--no-report")
    assert result.exit_code == 0, result.output
    (session,) = json.loads((tmp_path / "run.json").read_text())["sessions"]
    assert session["deterministic_kernels"] is (missing is None)
    assert warn_only == [missing is not None] and not torch.are_deterministic_algorithms_enabled()
    if missing:
        assert session["no_deterministic_kernel"] == f"{missing}, but you set " \
            "'torch.use_deterministic_algorithms(True)'"
        (line,) = [x for x in result.output.splitlines() if "no deterministic kernel" in x]
        assert "foo_cuda" in line and "warn-only" in line
    else:
        assert session["no_deterministic_kernel"] is None
        assert "deterministic kernel" not in result.output


def test_rollouts_dumped_every_step_and_shown(run_dir):
    from lorapop.run.rollouts import read

    for step in (1, 2):
        recs = read(run_dir / "rollouts" / f"step_{step}.jsonl.gz")
        # 2 teachers x the config's code_o proposals (8-token proposals rarely make a valid task)
        per_type = load_config(TINY).tasks.proposals_per_type
        assert sum(r["role"] == "teacher" for r in recs) == 2 * per_type
        assert {r["individual"] for r in recs} <= {"T0.g0", "T1.g0", "S0.g0", "S1.g0"}
        for r in recs:
            assert r["step"] == step and r["prompt"] and isinstance(r["reward"], float)
            assert r["verdict"] and "advantage" in r and "parsed" in r
    page = (run_dir / "report.html").read_text()
    assert "rollouts/step_2.jsonl.gz" in page and "verdict" in page


def test_checkpoints_kept_by_run_keep_last(run_dir):
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")) == ["step_000002"]


def test_resume_from_damaged_checkpoint_names_the_file(run_dir, tmp_path):
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns("wandb", "tensorboard"))
    ck = copy / "checkpoints"
    shutil.copytree(ck / "step_000002", ck / "step_000001")  # an intact earlier one
    weights = ck / "step_000002" / "adapters" / "S0" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    result = run("train", "--resume", copy, "--steps", 3)
    assert result.exit_code == 2
    line = result.output.strip()
    assert len(line.splitlines()) == 1 and "adapters/S0/adapter_model.safetensors" in line
    assert f"step_000001 is intact: `lorapop train --resume {copy} --from-step 1`" in line
    # LATEST naming a folder that is gone: the newest one there is used, not "no checkpoint"
    shutil.rmtree(ck / "step_000002")
    result = run("train", "--resume", copy, "--steps", 2, "--no-report")
    assert result.exit_code == 0, result.output


def test_chat_template_run(tmp_path):
    from transformers import AutoTokenizer

    from lorapop.engine.load import TINY_DIR
    from lorapop.run.rollouts import read

    tok = AutoTokenizer.from_pretrained(TINY_DIR)
    tok.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
                         "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
    tok.save_pretrained(tmp_path / "tok")
    result = run("train", TINY, "--steps", 1, "--out", tmp_path / "run", *FAST,
                 "tasks.template=chat", f"model.tokenizer={tmp_path / 'tok'}", "--no-report")
    assert result.exit_code == 0, result.output
    recs = read(tmp_path / "run" / "rollouts" / "step_1.jsonl.gz")
    assert recs and all(r["prompt"].startswith("<|user|>First reason step by step") for r in recs)


def test_pretrain_tiny_names_where_the_regime_recipes_went(tmp_path):
    result = run("pretrain-tiny", "--size", "world-short", "--out", tmp_path / "m")
    assert result.exit_code == 2
    assert result.output.strip().splitlines()[-1] == (
        "error: unknown --size 'world-short'; known: tiny, small (the regime world's recipes: "
        "experiments/regime/regime_recipes.py)")
