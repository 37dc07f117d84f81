"""The concrete `memguard ...` command lines of docs/*.md run exactly as written, as tests/test_readme.py runs the
README's (lines with placeholders such as <flags>, [options], ... or /path/to/ are synopses). They run in a
directory holding the files they name: runs/ (one Megatron training log per run, tests/test_calibrate.py's helper:
argument table, training_log and report_memory lines), logs/*.log and train.log (those logs as files), and
run.sh (examples/llama3_8b_h100.sh, the launch script a log without an argument table is read with)."""
import glob
import os
import pathlib
import re
import shlex
import shutil

import pytest

from conftest import run_as_written

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLACEHOLDER = re.compile(r"<|\[|\.\.\.|\||/path/to/")


def doc_commands() -> list[tuple[str, str]]:
    """(page, command) for each concrete memguard line in a fenced block of docs/*.md (comments dropped)."""
    out = []
    for path in sorted(glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True)):
        lang = None
        for raw in open(path, encoding="utf-8").read().splitlines():
            if raw.startswith("```"):
                lang = None if lang is not None else raw[3:].strip()
                continue
            if lang not in ("", "bash", "sh"):
                continue
            line = raw.strip()
            if line.startswith("memguard ") and " " in line[9:] and not PLACEHOLDER.search(line.split("#")[0]):
                # (a line of memguard's own output, "memguard predicted for pp1: ...", names no subcommand)
                if line.split()[1] in ("estimate", "validate", "check", "plan", "report", "calibrate", "gpus"):
                    out.append((os.path.relpath(path, ROOT), line))
    return out


def test_the_docs_have_the_examples_this_file_runs():
    pages = {p for p, _ in doc_commands()}
    assert {"docs/calibrate.md", "docs/planner.md", "docs/reports.md"} <= pages


def _workdir(tmp_path: pathlib.Path) -> pathlib.Path:
    from test_calibrate import write_runs
    runs = write_runs(tmp_path / "runs")
    (tmp_path / "logs").mkdir()
    for d in sorted(runs.iterdir()):
        shutil.copy(d / "stdout.log", tmp_path / "logs" / f"{d.name}.log")
    shutil.copy(runs / "run0" / "stdout.log", tmp_path / "train.log")
    shutil.copy(os.path.join(ROOT, "examples", "llama3_8b_h100.sh"), tmp_path / "run.sh")
    return tmp_path


@pytest.mark.parametrize("page, command", doc_commands())
def test_doc_command_runs_as_written(page, command, tmp_path):
    out = run_as_written(command, _workdir(tmp_path))
    assert out.returncode in (0, 1), (page, out.stderr)     # 2 would be a command memguard cannot read
    assert "Traceback" not in out.stderr and out.stdout


def test_planner_pages_numbers_are_what_its_plan_command_prints(capsys):
    # docs/planner.md: "the planner predicts 49.0% MFU for Llama-3.1-70B on 1024 H100s (seq 8192, GBS 1024)", and
    # "the best layouts are TP4 PP4 CP2 with VPP (MBS 1, SP, distributed optimizer)": what its first command prints
    from megatron_memguard.cli.main import main
    text = open(os.path.join(ROOT, "docs", "planner.md"), encoding="utf-8").read()
    command = next(c for p, c in doc_commands() if p == "docs/planner.md" and "llama3.1-70b" in c)
    mfu = re.search(r"predicts ([\d.]+%) MFU for Llama-3\.1-70B on 1024 H100s", text).group(1)
    assert "best layouts are TP4 PP4 CP2 with VPP (MBS 1,\n  SP, distributed optimizer)" in text
    assert main(shlex.split(command)[1:]) == 0
    out = capsys.readouterr().out
    chosen = next(line for line in out.splitlines() if line.startswith("1  "))
    assert chosen.split()[1:3] == ["TP4", "PP4x20v"] and "CP2" in chosen and "MBS1 SP" in chosen
    assert f" {mfu} " in chosen
    assert "--use-distributed-optimizer" in out
