"""The README's command examples run exactly as written (each concrete `memguard ...` line of its code blocks;
lines with placeholders such as <flags>, [options] or ... are synopses). They run in a directory holding the
files they name: conf/megatron_gpt_config.yaml (NeMo's, from ../shared/configs), job.sbatch (the example sbatch
script), examples/ and runs/ (three Megatron training logs written by tests/test_calibrate.py's helper); globs are
expanded and comments dropped as a shell would."""
import os
import pathlib
import re
import shutil

import pytest

from benchmarks.shared_data import CONFIGS
from conftest import run_as_written

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def readme_commands() -> list[str]:
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    out, lang = [], None
    for raw in text.splitlines():
        if raw.startswith("```"):
            lang = None if lang is not None else raw[3:].strip()
            continue
        if lang not in ("", "bash"):
            continue
        line = raw.split(" && ")[-1].strip()          # the quick start: install && run
        line = re.sub(r"^\.venv/bin/", "", line)
        if line.startswith("memguard ") and not re.search(r"<|\[|\.\.\.|\|", line):
            out.append(line)
    return out


def test_the_readme_has_the_examples_this_file_runs():
    cmds = readme_commands()
    assert any("run_recipe.py --recipe llama3_8b_pretrain_config" in c for c in cmds)
    assert any("run_recipe.py --model llama3_8b --mode pretrain" in c for c in cmds)
    assert "memguard estimate --config examples/llama3_8b_h100.sh" in cmds and len(cmds) >= 7


@pytest.mark.parametrize("command", readme_commands())
def test_readme_command_runs_as_written(command, tmp_path):
    os.makedirs(tmp_path / "conf")
    shutil.copy(os.path.join(CONFIGS, "nemo1", "megatron_gpt_config.yaml"), tmp_path / "conf")
    shutil.copy(os.path.join(ROOT, "examples", "slurm_preflight.sbatch"), tmp_path / "job.sbatch")
    shutil.copytree(os.path.join(ROOT, "examples"), tmp_path / "examples")
    from test_calibrate import write_runs
    write_runs(pathlib.Path(tmp_path) / "runs")
    out = run_as_written(command, tmp_path)
    assert out.returncode in (0, 1), out.stderr     # 2 would be a command memguard cannot read
    assert "Traceback" not in out.stderr and out.stdout
    if " check " in command and "run_recipe.py" in command:
        assert out.returncode == 0 and out.stdout.rstrip().endswith("memguard check: OK to launch"), out.stdout
