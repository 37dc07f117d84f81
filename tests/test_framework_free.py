"""tests/framework_free.py: which test files the 3.12 run skips (MEMGUARD_SKIP_FRAMEWORK_FREE=1, tests/run.sh).

The rule is checked on small files written for it (each way a file can depend on its venv) and on suite files whose
imports are known by reading them; then by a real measurement: a fresh interpreter that imports every file the rule
calls framework-free has loaded no torch, megatron or other package outside the allowed ones. This file starts
processes, so it is not framework-free itself: it runs in both main venvs (with megatron.training in .venv312).
"""
import json
import os
import subprocess
import sys

import pytest

import framework_free
from framework_free import ALLOWED_THIRD_PARTY, ROOT, framework_reason


def _reason(tmp_path, source: str) -> str | None:
    path = tmp_path / "test_written.py"
    path.write_text(source)
    return framework_reason(str(path))


@pytest.mark.parametrize("source, why", [
    ("import torch\n", "imports torch"),
    ("def test_x():\n    from megatron.core import parallel_state\n", "imports megatron"),
    ("import matplotlib.pyplot as plt\n", "imports matplotlib"),          # .venv312 has no matplotlib
    ("import pytest\ntorch = pytest.importorskip('torch')\n", "imports torch"),
    ("import subprocess\n", "imports subprocess"),
    ("import sys\ncmd = [sys.executable, '-c', 'pass']\n", "uses .executable"),
    ("import os\nos.system('true')\n", "uses .system"),
    ("import sys\nOLD = sys.version_info < (3, 12)\n", "uses .version_info"),
    ("import importlib\nimportlib.import_module(NAME)\n", "calls import_module with a computed name"),
    ("import importlib.util\n", "imports importlib.util"),
    ("from importlib import metadata\n", "imports importlib.metadata"),
    ("from conftest import CONTAINER_ERA\npytestmark = CONTAINER_ERA\n", "uses CONTAINER_ERA"),
    ("import pytest\n@pytest.mark.megatron_training\ndef test_x():\n    pass\n", "is marked megatron_training"),
    # through a project module's lazy name (runtime/sources.py's __getattr__ imports torch_sources.py, whose
    # methods import torch), whichever way the name is looked up
    ("from megatron_memguard.runtime.sources import LiveBytesSource\n",
     "megatron_memguard/runtime/torch_sources.py imports torch"),
    ("import megatron_memguard.runtime as rt\nsrc = rt.CudaMemorySource()\n",
     "megatron_memguard/runtime/torch_sources.py imports torch"),
    ("from megatron_memguard import runtime\ngather = getattr(runtime, 'torch_stage_gather')\n",
     "megatron_memguard/runtime/torch_gather.py imports torch"),
    # a name computed at run time, or every name: either torch-backed module may be the one reported
    ("from megatron_memguard import runtime\nthing = getattr(runtime, NAME)\n", "imports torch"),
    ("from megatron_memguard.runtime import *\n", "imports torch"),
    # through a tests/ helper that starts the fork server's processes
    ("import build_util\n", "tests/build_util.py imports subprocess"),
    # the referee's runners: fsdp_grid.py reads the installed megatron-core release, moe_grid.py imports megatron in main
    ("from benchmarks.referee.fsdp_grid import FSDP_GRID\n", "benchmarks/referee/fsdp_grid.py imports importlib.metadata"),
    ("from benchmarks.referee.moe_grid import MOE_GRID\n", "benchmarks/referee/moe_grid.py imports megatron"),
])
def test_a_file_that_depends_on_its_venv_is_not_framework_free(tmp_path, source, why):
    reason = _reason(tmp_path, source)
    assert reason is not None and reason.endswith(why), reason


@pytest.mark.parametrize("source", [
    # the estimator core and the readers import neither torch nor megatron (docs/architecture.md)
    "from megatron_memguard import estimate, layout_from_flags, lookup_gpu\n",
    "from megatron_memguard.readers.megatron_flags import parse_megatron_flags\n",
    "import pytest\nimport yaml\nfrom hypothesis import given, strategies as st\n",
    "import pytest\nOmegaConf = pytest.importorskip('omegaconf').OmegaConf\n",   # both venvs install omegaconf>=2.1
    "from conftest import LLAMA31_8B\n",   # a name from conftest.py, which every test process imports anyway
    # the runtime monitor without its torch-backed names (those load through the package's __getattr__)
    "from megatron_memguard.runtime import JsonlSink, MemoryMonitor, Prediction, StaticSource\n",
    # the referee's grid definitions without their runners (benchmarks/referee/grids/)
    "from benchmarks.referee.grids.fsdp import FSDP_GRID, stored_rank_layouts\n",
    "from benchmarks.referee.grids.moe import MOE_GRID, moe_settings\n",
    "from benchmarks.referee.grids.moe_ci import CI_LAYOUTS\n",
])
def test_a_file_of_the_project_and_pure_packages_is_framework_free(tmp_path, source):
    assert _reason(tmp_path, source) is None


def test_a_file_that_reaches_an_optional_extra_through_the_package_runs_without_it(tmp_path):
    """The CLI imports matplotlib only for --plot (megatron_memguard/report/plots.py): a file using the CLI is
    framework-free with matplotlib hidden; a file or tests/ helper that imports it itself is not."""
    path = tmp_path / "test_written.py"
    path.write_text("from megatron_memguard.cli.main import main\n")
    assert framework_reason(str(path)) is None
    assert framework_free.hidden_extras(str(path)) == {"matplotlib"}
    helper = tmp_path / "test_helper.py"   # (another name: the reading is cached by path)
    helper.write_text("import plot_util\n")
    assert framework_reason(str(helper)) == "tests/plot_util.py imports matplotlib"
    assert framework_free.hidden_extras(os.path.join(ROOT, "tests", "test_fp8.py")) == frozenset()


def test_a_without_extras_test_meets_no_matplotlib_and_the_next_file_meets_it_again(tmp_path):
    """tests/conftest.py (as a plugin) runs a written framework-free file's test, fixtures included, with matplotlib
    unimportable: the project's plot path then refuses as without the plot extra; a later file that is not
    framework-free imports matplotlib as before (where it is installed)."""
    (tmp_path / "test_a_cli.py").write_text(
        "import pytest\n"
        "from megatron_memguard.report.plots import PlotUnavailable, require_matplotlib\n"
        "@pytest.fixture(scope='module')\n"
        "def refused():\n"
        "    with pytest.raises(PlotUnavailable):\n"
        "        require_matplotlib()\n"
        "def test_plot_refused(request, refused):\n"
        "    assert request.node.get_closest_marker('without_extras').args == ('matplotlib',)\n"
        "    with pytest.raises(PlotUnavailable):\n"
        "        require_matplotlib()\n")
    (tmp_path / "test_b_plots.py").write_text(
        "import pytest\n"
        "def test_matplotlib_back(request):\n"
        "    assert request.node.get_closest_marker('without_extras') is None\n"
        "    pytest.importorskip('matplotlib.figure')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(ROOT, "tests"), ROOT]),
           "MEMGUARD_SKIP_FRAMEWORK_FREE": "0"}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "conftest", "-o",
                          "addopts=", "test_a_cli.py", "test_b_plots.py"],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "2 passed" in out.stdout or "1 passed, 1 skipped" in out.stdout, out.stdout[-1000:]


@pytest.mark.parametrize("name, free", [
    ("test_bridge_real.py", False),        # Megatron-Bridge itself
    ("test_hook_container.py", False),     # the real megatron.training (CONTAINER_ERA)
    ("test_referee_ci.py", False),         # the CPU referee's torch training runs
    ("test_fp8.py", True),                 # the estimator's fp8 terms by hand
    ("test_properties.py", True),          # hypothesis over the pure estimator
    ("test_properties_corners.py", True),  # the same, with the referee's grid definitions (benchmarks/referee/grids/)
    ("test_properties_equivalence.py", False),   # its hook properties run megatron.training (CONTAINER_ERA)
    ("test_referee_moe_stored.py", True),  # stored referee measurements against the pure estimator
    ("test_planner_search.py", True),      # the planner (pure Python: test_planner_is_pure_python)
    ("test_cli.py", True),                 # the CLI in-process (matplotlib hidden; the monitor without torch)
    ("test_runtime_monitor.py", True),     # the runtime monitor with StaticSource readings
    ("test_report_runlog.py", False),      # LiveBytesSource: torch's dispatch mode
])
def test_suite_files_are_classified_by_what_they_import(name, free):
    assert (framework_reason(os.path.join(ROOT, "tests", name)) is None) is free


# what pytest, hypothesis, yaml and omegaconf import themselves (their own dependencies; a C extension's runtime)
DEPENDENCIES = {"py", "pluggy", "iniconfig", "pygments", "exceptiongroup", "tomli", "sortedcontainers", "attr", "attrs",
                "typing_extensions", "antlr4", "cython_runtime"}


def _framework_free_files() -> list[str]:
    tests = os.path.join(ROOT, "tests")
    return sorted(f for f in os.listdir(tests) if f.startswith("test_") and f.endswith(".py")
                  and framework_free.is_framework_free(os.path.join(tests, f)))


def test_importing_the_framework_free_files_loads_no_framework():
    """A measurement of what the rule reads from the source: the modules a fresh interpreter has loaded after
    importing every framework-free test file (with tests/conftest.py, which pytest imports first) are the standard
    library's, the project's and the allowed packages' only."""
    files = _framework_free_files()
    assert len(files) >= 20, files   # (the rule must not have stopped matching: 52 files at its introduction)
    code = ("import json, sys; sys.path[:0] = [sys.argv[1], sys.argv[2]]; import conftest\n"
            "for f in sys.argv[3:]: __import__(f[:-3])\n"
            "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))")
    out = subprocess.run([sys.executable, "-c", code, os.path.join(ROOT, "tests"), ROOT, *files],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    loaded = set(json.loads(out.stdout.strip().splitlines()[-1]))
    project = {f[:-3] for f in os.listdir(os.path.join(ROOT, "tests")) if f.endswith(".py")}
    project |= {"megatron_memguard", "benchmarks"}
    others = sorted(m for m in loaded - set(sys.stdlib_module_names) - project - ALLOWED_THIRD_PARTY - DEPENDENCIES
                    if not m.startswith("_"))   # (__main__, the editable install's finder, C runtimes' modules)
    assert "torch" not in loaded and "megatron" not in loaded, others
    assert others == [], others


def test_the_skip_deselects_exactly_the_framework_free_files():
    """What tests/run.sh's 3.12 run collects with MEMGUARD_SKIP_FRAMEWORK_FREE=1: a framework-free file's tests are
    deselected, a framework file's kept (collected only: nothing runs)."""
    free, framework = "tests/test_fp8.py", "tests/test_hook_container.py"
    env = {**os.environ, "MEMGUARD_SKIP_FRAMEWORK_FREE": "1", "PYTHONPATH": ROOT}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only", "-o",
                          "addopts=", free, framework], capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    ids = [line for line in out.stdout.splitlines() if "::" in line]
    assert ids and all(i.startswith(framework + "::") for i in ids), ids
    assert "deselected" in out.stdout.splitlines()[-1]
