"""Hostile files at every path argument: a named pipe nobody writes to (or reads), /dev/zero, a
directory, a symlink loop, UTF-16 text. Each is one error line naming the file and exit 2 within a
second (a FIFO stopped memguard forever at open(): `estimate --config`, `--site-profile`,
`MEMGUARD_PROFILE`, `--yaml-cfg`, `--tp-comm-overlap-cfg`, `validate`, `check --file`, a .nemo path,
a memguard-rank*.jsonl in a report directory, and the output files of --out / --plot)."""
import os

import pytest

from fuzz_util import SMALL, run_memguard

import megatron_memguard.files as files
from megatron_memguard.errors import ReaderError

MOE = [*SMALL, "--num-experts", "8", "--moe-router-topk", "2", "--expert-model-parallel-size", "2", "--sequence-parallel"]


def entry_points(p: str):
    """(label, argv, env, prefix of the error line) for every argument that names an input file."""
    yield "estimate --config", ["estimate", "--config", p, "--world-size", "8"], {}, "memguard: error: "
    yield "estimate --site-profile", ["estimate", "--site-profile", p, "--world-size", "8", "--", *SMALL], {}, \
        "memguard: error: --site-profile: cannot read site profile: "
    yield "MEMGUARD_PROFILE", ["estimate", "--world-size", "8", "--", *SMALL], {"MEMGUARD_PROFILE": p}, \
        "memguard: error: MEMGUARD_PROFILE: cannot read site profile: "
    yield "--yaml-cfg", ["estimate", "--world-size", "8", "--", "--yaml-cfg", p], {}, "memguard: error: --yaml-cfg: "
    yield "--tp-comm-overlap-cfg", ["estimate", "--world-size", "8", "--", *MOE, "--tp-comm-overlap",
                                    "--tp-comm-overlap-cfg", p], {}, "memguard: error: --tp-comm-overlap-cfg: "
    yield "--heterogeneous-layers-config-path", ["estimate", "--world-size", "8", "--", *SMALL,
                                                 "--heterogeneous-layers-config-path", p], {}, \
        "memguard: error: --heterogeneous-layers-config-path: "
    yield "validate FILE", ["validate", p, "--gpus", "8"], {}, "memguard validate: error: "
    yield "check --file", ["check", "--file", p], {}, "memguard check: error: "
    yield "plan --config", ["plan", "--config", p, "--gpus", "8", "--seq-length", "512", "--global-batch-size", "16"], {}, \
        "memguard: error: "


@pytest.fixture
def hostile(tmp_path, monkeypatch):
    monkeypatch.setattr(files, "PIPE_WAIT", 0.2)
    os.mkfifo(tmp_path / "pipe.yaml")
    os.mkfifo(tmp_path / "ckpt.nemo")
    os.symlink(tmp_path / "b.yaml", tmp_path / "a.yaml")
    os.symlink(tmp_path / "a.yaml", tmp_path / "b.yaml")
    (tmp_path / "dir.yaml").mkdir()
    (tmp_path / "utf16.yaml").write_bytes("schema: memguard.site/1\n".encode("utf-16"))
    return tmp_path


@pytest.mark.parametrize("name, words", [
    ("pipe.yaml", "a named pipe with nothing written to it for 0.2 s; give a regular file"),
    ("/dev/zero", "larger than 1 MiB"),
    ("dir.yaml", "is a directory, not a file"),
    ("a.yaml", "cannot read (Too many levels of symbolic links)"),
    ("utf16.yaml", "UTF-16 text (a byte-order mark 0xff 0xfe); save it as UTF-8"),
])
def test_every_input_path_refuses_a_hostile_file_in_one_line(hostile, name, words):
    p = name if name.startswith("/") else str(hostile / name)
    for label, argv, env, prefix in entry_points(p):
        o = run_memguard(argv, env=env, wall_limit=20, cpu_limit=2.0)
        lines = o.err.strip().splitlines()
        assert not o.problems and o.code == 2, (label, o.describe())
        assert lines[0].startswith(prefix) and f"{p}" in lines[0] and words in lines[0], (label, o.err)
        assert o.wall < 2, (label, o.wall)


def test_a_named_pipe_as_a_nemo_checkpoint(hostile):
    o = run_memguard(["validate", str(hostile / "ckpt.nemo"), "--gpus", "8"], wall_limit=20)
    assert o.code == 2 and "ckpt.nemo: not a regular file (a .nemo checkpoint is a tar file)" in o.err, o.describe()


def test_a_pipe_that_is_written_is_read(tmp_path):
    # process substitution (--config <(generate)) is a pipe with a writer: read as a file
    r, w = os.pipe()
    os.write(w, b"a: 1\r\nb: 2\n")
    os.close(w)
    assert files.read_text(f"/dev/fd/{r}") == "a: 1\r\nb: 2\n"
    os.close(r)


def test_report_directory_with_a_named_pipe(hostile):
    d = hostile / "run"
    d.mkdir()
    os.mkfifo(d / "memguard-rank00000.jsonl")
    o = run_memguard(["report", str(d)], wall_limit=20)
    assert o.code == 2 and "no memguard-rank*.jsonl files in this directory" in o.err, o.describe()


@pytest.mark.parametrize("argv", [
    ["estimate", "--world-size", "8", "--plot", "{out}", "--", *SMALL],
    ["report", "{run}", "--out", "{out}"],
])
def test_output_to_a_named_pipe_nobody_reads(hostile, argv):
    pytest.importorskip("matplotlib")
    import json
    run = hostile / "run"
    run.mkdir()
    start = {"schema": "memguard.runtime/1", "event": "start", "rank": 0, "predicted": {"peak_allocated": 100}}
    sample = {"schema": "memguard.runtime/1", "event": "sample", "rank": 0, "iteration": 1,
              "actual": {"max_allocated": 90}, "predicted": {"peak_allocated": 100}}
    (run / "memguard-rank00000.jsonl").write_text(json.dumps(start) + "\n" + json.dumps(sample) + "\n")
    out = hostile / "out.html"
    os.mkfifo(out)
    o = run_memguard([a.format(out=out, run=run) for a in argv], wall_limit=20)
    assert o.code == 2 and f"cannot write {out}: a named pipe that nobody reads" in o.err, o.describe()


def test_runtime_jsonl_to_a_named_pipe_does_not_stall_training(tmp_path):
    from megatron_memguard.runtime.sinks import JsonlSink
    os.mkfifo(tmp_path / "memguard-rank00000.jsonl")
    with pytest.raises(OSError, match="a named pipe that nobody reads"):   # (build_monitor reports it, once)
        JsonlSink(str(tmp_path / "memguard-rank00000.jsonl"))
    # a reader that stops reading: a full pipe is a failed write, not a blocked training step
    fd = os.open(tmp_path / "memguard-rank00000.jsonl", os.O_RDONLY | os.O_NONBLOCK)
    sink = JsonlSink(str(tmp_path / "memguard-rank00000.jsonl"))
    with pytest.raises(BlockingIOError):
        for _ in range(100_000):          # 64 KiB of pipe buffer: full after ~1,000 records
            sink.write({"schema": "memguard.runtime/1", "event": "sample", "rank": 0, "padding": "x" * 64})
    os.close(fd)


def test_read_bytes_bounds_a_device():
    with pytest.raises(ReaderError, match="^/dev/urandom: larger than 1 MiB"):
        files.read_text("/dev/urandom")


@pytest.mark.parametrize("cwd, words", [("pipe.yaml", "--cwd: is not a directory"), ("missing", "--cwd: no such directory")])
def test_check_cwd_that_is_not_a_directory(hostile, cwd, words):
    # was ignored (exit 0) whenever the launch named no relative file
    o = run_memguard(["check", "--cwd", str(hostile / cwd), "--", "torchrun", "--nproc-per-node", "8", "pretrain_gpt.py",
                      *SMALL], wall_limit=20)
    assert not o.problems and o.code == 2 and words in o.err.splitlines()[0], o.describe()


def test_memguard_log_dir_variable_that_is_a_file(tmp_path, monkeypatch, capsys):
    # the hook's flags: MEMGUARD_LOG_DIR naming a file is one error line (rank 0) and no JSONL, not an abort
    import argparse
    from megatron_memguard.megatron.flags import add_arguments
    (tmp_path / "f").write_text("")
    monkeypatch.delenv("RANK", raising=False)
    ns = add_arguments(argparse.ArgumentParser(prog="pretrain_gpt.py"), environ={"MEMGUARD_LOG_DIR": str(tmp_path / "f")}
                       ).parse_args([])
    assert ns.memguard_log_dir is None
    lines = [x for x in capsys.readouterr().err.splitlines() if "MEMGUARD_LOG_DIR" in x]
    assert len(lines) == 1 and lines[0].startswith("[memguard] error: MEMGUARD_LOG_DIR=") and \
        lines[0].endswith("exists and is not a directory; no JSONL files are written (training continues)"), lines
