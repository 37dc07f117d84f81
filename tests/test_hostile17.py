"""Regressions of issue hostile17 (benchmarks/hostile_input.py's hostile17 group): NeMo / Megatron-Bridge overrides of a
launch line that hold a command substitution, files that are no regular UTF-8 file (a sparse file, UTF-16 / UTF-32
text), site profiles with schemas and GPUs no memguard wrote, and a memguard bug in each entry point of the hook and
the Bridge wrapper (reported once, training goes on). Each is the smallest input of its class."""
from __future__ import annotations

import importlib
import os
import sys
import time

import pytest

from fuzz_util import MEGATRON_LOG, YAML_SEEDS, run_memguard

NEMO = dict((n, t) for n, t, _ in YAML_SEEDS)["nemo1_llama.yaml"]     # NeMo 1's megatron_llama_config.yaml
HYDRA = "torchrun --nproc-per-node 8 megatron_gpt_pretraining.py --config-path=conf --config-name=c "
RECIPE = "torchrun --nproc-per-node 8 run_recipe.py --recipe llama32_1b_pretrain_config "


def _one_error(o) -> str:
    lines = [x for x in o.err.splitlines() if x.strip() and "DO NOT LAUNCH" not in x]
    assert o.code == 2 and not o.problems and len(lines) == 1, o.describe()
    return lines[0]


# -- NeMo / Bridge overrides holding a command substitution (hostile16's leftover) ------------------------------------
@pytest.mark.parametrize("script, key, construct, line", [
    (HYDRA + "\\\n  trainer.devices=8 \\\n  model.tensor_model_parallel_size=$(nproc)\n",
     "model.tensor_model_parallel_size", "'$(nproc)'", 3),
    ("TP=`nproc`\n\n" + HYDRA + "model.tensor_model_parallel_size=$TP\n", "model.tensor_model_parallel_size", "'`nproc`'", 1),
    (RECIPE + "train.micro_batch_size=$(( $(nproc) / 2 ))\n", "train.micro_batch_size", "'$(( $(nproc) / 2 ))'", 1),
    ("# 8 GPUs\n" + RECIPE + "model.tensor_model_parallel_size=$(nproc)\n", "model.tensor_model_parallel_size",
     "'$(nproc)'", 2),
    (HYDRA + "+model.micro_batch_size=$(echo 2)\n", "model.micro_batch_size", "'$(echo 2)'", 1),
])
def test_an_override_holding_a_command_substitution_names_line_key_and_construct(script, key, construct, line):
    # bash runs the program when the job starts; memguard said "must be an integer, got '$(nproc)'", without the line
    # or what the text is (the Megatron-flag case has named them since hostile16)
    o = run_memguard(["check", "--file", "run.sh", "--vocab-size", "32000"], {"run.sh": script, "conf/c.yaml": NEMO})
    err = _one_error(o)
    assert f"{key}: is {construct} (line {line}), a command substitution" in err, err
    assert f"memguard check --file SCRIPT --set {key}=VALUE" in err, err


def test_nemo_trainer_devices_from_a_command_substitution_names_it_where_the_world_size_is_needed():
    # python (no launcher option) leaves trainer.devices x num_nodes the only world size; it said "--world-size: the
    # number of GPUs is unknown" without naming the override that held it
    script = "python megatron_gpt_pretraining.py --config-path=conf --config-name=c \\\n  trainer.devices=$(nproc)\n"
    err = _one_error(run_memguard(["check", "--file", "run.sh", "--vocab-size", "32000"],
                                  {"run.sh": script, "conf/c.yaml": NEMO}))
    assert "trainer.devices: is '$(nproc)' (line 2), a command substitution" in err and "--world-size N" in err, err


@pytest.mark.parametrize("script", [
    HYDRA + "trainer.devices=8 model.global_batch_size=32 model.seed=$(date +%s) exp_manager.name=$(hostname)\n",
    RECIPE + "rng.seed=$(date +%s) checkpoint.save=$(pwd)/ckpt\n",
])
def test_an_override_memguard_does_not_need_may_hold_a_command_substitution(script):
    o = run_memguard(["check", "--file", "run.sh", "--vocab-size", "32000"], {"run.sh": script, "conf/c.yaml": NEMO})
    assert o.code in (0, 1) and not o.problems and "command substitution" not in o.err, o.describe()


def test_set_replaces_the_override_holding_a_command_substitution():
    script = RECIPE + "model.tensor_model_parallel_size=$(nproc)\n"
    o = run_memguard(["check", "--file", "run.sh", "--set", "model.tensor_model_parallel_size=2"], {"run.sh": script})
    assert o.code in (0, 1) and not o.problems and "command substitution" not in o.err, o.describe()
    assert "TP2" in o.out or "TP 2" in o.out or "tp=2" in o.out.lower(), o.out


# -- files that are no regular UTF-8 file ---------------------------------------------------------------------------
def test_a_2_gib_sparse_log_is_read_past_its_holes_in_well_under_2_s(tmp_path):
    # truncate -s 2G: 2 GiB of holes (NULs, which the readers drop); reading them took 2-8 s of CPU
    path = tmp_path / "run.log"
    with open(path, "wb") as f:
        f.truncate(2 * 2**30)
    for args in (["report", str(path)], ["report", "--format", "jsonl", "--skip-bad-lines", str(path)],
                 ["calibrate", str(path)]):
        o = run_memguard(args)
        assert o.code == 2 and not o.problems and o.cpu < 1.0, o.describe()


def test_a_sparse_log_with_lines_between_its_holes_reads_those_lines(tmp_path):
    path = tmp_path / "run.log"
    with open(path, "wb") as f:
        f.seek(2**30)
        f.write(MEGATRON_LOG.encode())
        f.seek(2**31)
        f.write(b"\n")
    want = run_memguard(["report", "--json", "run.log"], {"run.log": MEGATRON_LOG})
    got = run_memguard(["report", "--json", str(path)])
    assert got.code == want.code == 1 and got.cpu < 1.0, got.describe()
    assert got.out.replace(str(path), "run.log") == want.out


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-be-bom", "utf-32"])
def test_a_megatron_log_in_utf16_or_utf32_is_read_by_its_byte_order_mark(encoding):
    # Windows PowerShell's '>' writes UTF-16 (dropping the NULs beside each character read its ASCII; now decoded)
    data = b"\xfe\xff" + MEGATRON_LOG.encode("utf-16-be") if encoding == "utf-16-be-bom" else MEGATRON_LOG.encode(encoding)
    want = run_memguard(["report", "--json", "run.log"], {"run.log": MEGATRON_LOG})
    got = run_memguard(["report", "--json", "run.log"], {"run.log": data})
    assert got.code == want.code == 1 and got.out == want.out, got.describe()


@pytest.mark.parametrize("data, text", [
    ("schema: memguard.site/1\n".encode("utf-16-le"), "UTF-16 text without a byte-order mark (little-endian"),
    ("schema: memguard.site/1\n".encode("utf-16-be"), "UTF-16 text without a byte-order mark (big-endian"),
    ("schema: memguard.site/1\n".encode("utf-32"), "UTF-32 text (a byte-order mark 0xff 0xfe 0x00 0x00)"),
])
def test_a_config_in_utf32_or_utf16_without_a_mark_is_named(data, text):
    # YAML said "unacceptable character #x0000", JSON "Expecting value"; UTF-32 was called UTF-16
    for args in (["estimate", "--site-profile", "p.yaml", "--model", "llama32_1b", "--gpus", "8"],
                 ["validate", "p.yaml"], ["estimate", "--model", "p.json", "--gpus", "8"]):
        err = _one_error(run_memguard(args, {"p.yaml": data, "p.json": data}))
        assert text in err and "save it as UTF-8" in err, err


def test_a_named_pipe_nobody_writes_to_as_a_site_profile_does_not_hang(tmp_path):
    import megatron_memguard.files as mg_files
    fifo = str(tmp_path / "p.yaml")
    os.mkfifo(fifo)
    old, mg_files.PIPE_WAIT = mg_files.PIPE_WAIT, 0.2
    try:
        for args, env in ((["plan", "--site-profile", fifo, "--gpus", "8", "--seq-length", "512", "--global-batch-size",
                            "64", "--model", "llama-3.2-1b"], None),
                          (["estimate", "--model", "llama32_1b", "--gpus", "8"], {"MEMGUARD_PROFILE": fifo})):
            t0 = time.perf_counter()
            err = _one_error(run_memguard(args, env=env, wall_limit=10))
            assert "a named pipe with nothing written to it" in err and time.perf_counter() - t0 < 5, err
    finally:
        mg_files.PIPE_WAIT = old


@pytest.mark.parametrize("record, field, value", [
    (1, "allocated", "-1"), (1, "max_reserved", "8.5"), (0, "peak_allocated", "-4096"), (2, "actual_bytes", "-1"),
    (4, "alloc_bytes", "0.5"),
])
def test_a_runtime_record_with_a_negative_or_fractional_byte_count_is_refused_by_its_field(record, field, value):
    # torch.cuda.memory_stats counts whole bytes >= 0; the report drew -1 B and 8.5 B as readings
    import json

    from fuzz_util import RUNLOG
    lines = [json.dumps(r) for r in RUNLOG]
    lines[record] = lines[record].replace(f'"{field}": ', f'"{field}": {value}, "_{field}": ', 1)
    err = _one_error(run_memguard(["report", "."], {"memguard-rank00000.jsonl": "\n".join(lines) + "\n"}))
    assert f"line {record + 1}: '" in err and f"{field}': expected a byte count (a whole number >= 0), got {value}" in err, err
    o = run_memguard(["report", ".", "--skip-bad-lines"], {"memguard-rank00000.jsonl": "\n".join(lines) + "\n"})
    assert o.code in (0, 1) and not o.problems and "skipped" in o.err, o.describe()


# -- site profiles no memguard wrote --------------------------------------------------------------------------------
@pytest.mark.parametrize("text, key, rule", [
    ("schema: memguard.site/0\n", "schema", "no memguard wrote that schema"),
    ("schema: memguard.site/02\n", "schema", "no memguard wrote that schema"),
    ("schema: memguard.site/2\ngpu: Z9000\ntime: {gemm_efficiency: 0.7}\n", "gpu", "'Z9000' is not a GPU memguard knows"),
])
def test_a_site_profile_schema_or_gpu_no_memguard_wrote_is_refused_by_its_key(text, key, rule):
    # /0 and /02 were read as /1 and /2; a time section's unknown GPU was "--gpu: unknown GPU" in memguard plan (the
    # user gave no --gpu) and accepted by the other commands (docs/calibrate.md: time constants apply to the GPU's row)
    for args in (["plan", "--site-profile", "p.yaml", "--gpus", "8", "--seq-length", "512", "--global-batch-size", "64",
                  "--model", "llama-3.2-1b"], ["estimate", "--site-profile", "p.yaml", "--model", "llama32_1b", "--gpus", "8"]):
        err = _one_error(run_memguard(args, {"p.yaml": text}))
        assert f"--site-profile p.yaml: {key}: " in err and rule in err, err


@pytest.mark.parametrize("option", [["--site-profile", "p.yaml"], ["--config", "nothere.yaml"], ["--gpu", "H200-141GB"],
                                    ["--model", "llama32_1b"], ["--set", "model.num_layers=2"], ["--env", "NCCL_BUFFSIZE=1"]])
def test_report_of_runtime_jsonl_refuses_the_options_of_a_megatron_log_prediction(option):
    # they were ignored without a word (a broken --site-profile, a --config that does not exist): the JSONL files carry
    # the predictions the hook made at run time, as the flags after -- were already refused
    import json

    from fuzz_util import RUNLOG
    files = {"memguard-rank00000.jsonl": "\n".join(json.dumps(r) for r in RUNLOG) + "\n",
             "p.yaml": "schema: memguard.site/1\n"}
    err = _one_error(run_memguard(["report", ".", *option], files))
    assert err.startswith(f"memguard: error: {option[0]}: applies to Megatron logs") and "run time" in err, err


@pytest.mark.parametrize("launch, key", [
    ("MEMGUARD_PROFILE=p.yaml {run}", "the launch's MEMGUARD_PROFILE"),
    ("{run} --memguard-profile p.yaml", "the launch's --memguard-profile"),
])
def test_a_launch_s_own_site_profile_is_named_by_where_the_launch_gives_it(launch, key):
    # it was named "--site-profile", an option the user did not give
    from test_hostile15 import RUN, S
    run = RUN + S + " --global-batch-size 16"
    err = _one_error(run_memguard(["check", "--file", "run.sh"], {
        "run.sh": launch.format(run=run) + "\n", "p.yaml": "schema: memguard.site/2\ngpu: H100-80GB\ntime: {network_gbps: x}\n"}))
    assert f"{key} p.yaml: time.network_gbps: expects a number" in err, err


# -- a memguard bug in each entry point: reported once, training goes on -----------------------------------------------
def _boom(*a, **k):
    raise RuntimeError("injected memguard bug")


@pytest.fixture
def hook_state(monkeypatch, capsys):
    """The hook's state with its once-per-process error report re-armed (restored after the test)."""
    import megatron_memguard.megatron.hook as hook
    monkeypatch.setattr(hook.STATE.error, "logged", False)
    monkeypatch.setattr(hook.STATE.error, "errors", 0)
    monkeypatch.setattr(hook.STATE, "monitor", None)
    monkeypatch.setattr(hook.STATE, "decision", None)
    monkeypatch.setattr(hook.STATE, "settings", None)
    monkeypatch.setattr(hook.STATE, "source_factory", None)
    yield hook
    capsys.readouterr()


def _reported(capsys, hook, where: str) -> None:
    err = capsys.readouterr().err
    assert err.count("[memguard] internal error") == 1 and f"internal error in {where} (RuntimeError: injected memguard bug)" in err, err
    assert "training continues" in err and hook.STATE.errors == 1


def test_the_one_import_in_pretrain_gpt_survives_a_bug_while_installing(hook_state, monkeypatch, capsys):
    # 'import megatron_memguard.megatron' ran install() unguarded: a bug there raised out of pretrain_gpt.py's import
    import megatron_memguard
    monkeypatch.setattr(hook_state, "_import", _boom)
    monkeypatch.setattr(megatron_memguard, "megatron", sys.modules["megatron_memguard.megatron"])   # (restored after)
    monkeypatch.delitem(sys.modules, "megatron_memguard.megatron")
    mod = importlib.import_module("megatron_memguard.megatron")
    assert mod.STATE is hook_state.STATE
    _reported(capsys, hook_state, "installing the hook")


def test_the_flag_wrapper_survives_a_bug(hook_state, monkeypatch, capsys):
    monkeypatch.setattr(hook_state, "add_arguments", _boom)
    parser = object()
    assert hook_state._wrap_flags(lambda p: p)(parser) is parser
    _reported(capsys, hook_state, "adding --memguard flags")


def test_validate_args_survives_a_bug_in_the_decision(hook_state, monkeypatch, capsys):
    import argparse
    calls = []
    monkeypatch.setattr(hook_state, "decide", _boom)
    args = argparse.Namespace(memguard="abort")     # (abort asked: a memguard bug still does not abort)
    assert hook_state._wrap_validate(lambda a, d=None: calls.append(a) or a)(args, {}) is args
    assert calls == [args] and hook_state.STATE.decision is None
    _reported(capsys, hook_state, "the pre-allocation check")


def test_validate_yaml_survives_a_bug_reading_its_namespace(hook_state, monkeypatch, capsys):
    import argparse
    monkeypatch.setattr(hook_state, "is_yaml_namespace", _boom)
    args = argparse.Namespace()
    assert hook_state._wrap_validate_yaml(lambda a, d=None: a)(args, {}) is args
    _reported(capsys, hook_state, "reading a --yaml-cfg namespace")


def test_setup_model_and_optimizer_survives_a_bug_in_the_memory_source(hook_state, monkeypatch, capsys):
    monkeypatch.setattr(hook_state.STATE, "source_factory", _boom)
    assert hook_state._wrap_setup(lambda *a, **k: ("model", "optimizer", "scheduler"))() == ("model", "optimizer",
                                                                                             "scheduler")
    assert hook_state.STATE.monitor is None
    _reported(capsys, hook_state, "setting up the runtime monitor")


class _BrokenMonitor:
    oom_reported = finished = False
    step = finish = on_oom = staticmethod(_boom)


def test_training_log_and_train_survive_a_bug_in_the_monitor(hook_state, monkeypatch, capsys):
    monkeypatch.setattr(hook_state.STATE, "monitor", _BrokenMonitor())
    assert hook_state._wrap_training_log(lambda *a, **k: "logged")(None, None, None, 10) == "logged"
    _reported(capsys, hook_state, "the runtime sample")
    assert hook_state._wrap_train(lambda *a, **k: 7)() == 7       # the summary's bug: counted, not raised
    assert hook_state.STATE.errors == 2
    with pytest.raises(ZeroDivisionError):                      # training's own error leaves as it came
        hook_state._wrap_train(lambda: 1 / 0)()
    hook_state._at_exit()


@pytest.mark.skipif(sys.version_info < (3, 10), reason="bridge stand-in")
def test_the_bridge_wrapper_survives_a_bug_making_its_callback(monkeypatch, capsys):
    from test_integration_bridge import STANDIN, tiny_cpu_config
    monkeypatch.syspath_prepend(STANDIN)
    for m in [m for m in sys.modules if m.startswith("megatron.bridge")]:
        monkeypatch.delitem(sys.modules, m)
    import megatron.bridge.training.pretrain as pt    # noqa: F401 (Bridge 0.6.2's stand-in: tests/bridge_standin)

    from megatron_memguard import bridge as mb
    monkeypatch.setattr(mb.MemguardCallback, "start_source", _boom)
    seen = []
    monkeypatch.setattr(pt, "pretrain", lambda cfg, fs, callbacks=None, **k: seen.append(callbacks) or "state")
    assert mb.pretrain(tiny_cpu_config(), None, world_size=1, gpu_memory="2GiB") == "state"
    assert seen == [None]          # Bridge's pretrain, without memguard's callback
    err = capsys.readouterr().err
    assert "[memguard] internal error in setting up the runtime monitor (RuntimeError: injected memguard bug)" in err, err
    for m in [m for m in sys.modules if m.startswith("megatron.bridge")]:
        del sys.modules[m]


def test_the_lightning_callback_survives_a_bug_in_each_of_its_hooks(monkeypatch):
    pytest.importorskip("lightning.pytorch")
    torch = pytest.importorskip("torch")
    import types

    import megatron_memguard.lightning as ml
    from e2e.recording import RecordingSource
    lines: list[str] = []
    cb = ml.MemguardCallback(source=RecordingSource(), world_size=1, gpu_memory="1GiB", emit=lines.append)
    trainer = types.SimpleNamespace(world_size=1, global_rank=0, log_every_n_steps=1, loggers=[], global_step=1,
                                    strategy=object())
    module = torch.nn.Linear(2, 2)
    monkeypatch.setattr(ml, "raw_config", _boom)                 # reading the trainer: the pre-flight's internal error
    cb.setup(trainer, module, "fit")
    assert cb.result.action == "skipped" and "internal error" in lines[-1] and "training continues" in lines[-1]
    monkeypatch.setattr(ml, "build_monitor", _boom)              # the runtime monitor
    cb.on_train_start(trainer, module)
    assert cb.monitor is None and cb.report.errors == 1
    cb.monitor = _BrokenMonitor()                                  # a sample, the summary
    cb.on_train_batch_end(trainer, module, None, None, 0)
    cb.on_exception(trainer, module, RuntimeError("training's own"))
    assert cb.report.errors == 3
