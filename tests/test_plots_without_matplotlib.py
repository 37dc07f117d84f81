"""Without matplotlib, --plot / --out exit 2 with one line naming the ``plot`` extra; the rest still works."""
import os
import subprocess
import sys

import pytest

from megatron_memguard.cli.main import main

from conftest import LLAMA31_8B
from runlog_util import make_estimate, write_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGS = LLAMA31_8B + ["--micro-batch-size", "1", "--tensor-model-parallel-size", "2", "--global-batch-size", "64",
                      "--pipeline-model-parallel-size", "2", "--use-distributed-optimizer", "--sequence-parallel"]
PLAN = ["plan", "--gpus", "16", "--seq-length", "8192", "--global-batch-size", "64", "--tp", "2", "--pp", "1,2",
        "--mbs", "1", "--model", "llama3.1-8b"]


@pytest.fixture
def no_matplotlib(monkeypatch):
    """Make every ``import matplotlib...`` fail, as on a machine without it."""
    for name in list(sys.modules):
        if name == "matplotlib" or name.startswith("matplotlib."):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)


def _one_line_naming_the_extra(err: str, option: str):
    assert err.count("\n") == 1, err
    assert err.startswith(f"memguard: error: {option}: needs matplotlib")
    assert "pip install 'megatron-memguard[plot]'" in err


def test_estimate_plot_without_matplotlib(no_matplotlib, tmp_path, capsys):
    path = tmp_path / "e.png"
    code = main(["estimate", "--world-size", "16", "--plot", str(path), "--", *FLAGS])
    out = capsys.readouterr()
    assert code == 2 and out.out == "" and not path.exists()
    _one_line_naming_the_extra(out.err, "--plot")
    # Without --plot nothing needs matplotlib.
    assert main(["estimate", "--world-size", "16", "--", *FLAGS]) == 0


def test_plan_plot_without_matplotlib(no_matplotlib, tmp_path, capsys):
    code = main([*PLAN, "--plot", str(tmp_path / "p.html")])
    out = capsys.readouterr()
    assert code == 2 and out.out == ""
    _one_line_naming_the_extra(out.err, "--plot")


def test_report_without_matplotlib(no_matplotlib, tmp_path, capsys):
    write_run(tmp_path / "logs", make_estimate(), ranks_per_stage=1, iterations=3)
    code = main(["report", str(tmp_path / "logs"), "--out", str(tmp_path / "r.png")])
    out = capsys.readouterr()
    assert code == 2 and out.out == ""
    _one_line_naming_the_extra(out.err, "--out")
    # The terminal summary does not need it.
    assert main(["report", str(tmp_path / "logs")]) == 0
    assert "result: OK" in capsys.readouterr().out


def test_plot_without_matplotlib_in_a_fresh_interpreter(tmp_path):
    """The same from the command line, where matplotlib cannot be imported at all."""
    code = ("import sys; sys.modules['matplotlib'] = None; "
            "from megatron_memguard.cli.main import main; sys.exit(main(sys.argv[1:]))")
    res = subprocess.run([sys.executable, "-c", code, "estimate", "--world-size", "16", "--plot",
                          str(tmp_path / "e.svg"), "--", *FLAGS], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert res.returncode == 2 and res.stdout == ""
    _one_line_naming_the_extra(res.stderr, "--plot")


def test_importing_the_report_modules_does_not_import_matplotlib():
    code = ("import sys; import megatron_memguard.report.plots, megatron_memguard.report.runlog, "
            "megatron_memguard.report.runreport, megatron_memguard.report.html, megatron_memguard.cli.report; "
            "print(','.join(m for m in sys.modules if m.split('.')[0] in ('matplotlib', 'torch', 'numpy')))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": ROOT}, check=True)
    assert res.stdout.strip() == ""
