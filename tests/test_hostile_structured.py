"""Regressions found by the structured-mutation fuzz (tests/test_fuzz_structured.py, issue hostile2): each is
the smallest input that broke the promise (a traceback, an internal error, a hang), with the one-line error
memguard now gives."""
from __future__ import annotations

from fuzz_util import run_memguard


def _one_error(o) -> str:
    assert not o.problems, o.describe()
    lines = [line for line in o.err.splitlines() if line.strip()]
    assert o.code == 2 and lines, (o.code, o.err)
    return lines[0]


def test_srun_with_a_lone_dash_as_its_program():
    # found in tests/data/launch/nemo_launcher_gpt3_5b.sbatch with '--no-container-mount-home -': srun's getopt
    # takes a lone '-' as the program (it is no option); memguard indexed its second character
    o = run_memguard(["check", "--file", "run.sh"], {"run.sh": "srun --ntasks 8 - pretrain_gpt.py --num-layers 2\n"})
    assert "cannot understand the launcher '-'" in _one_error(o)
