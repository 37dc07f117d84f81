"""tests/build_util.py's run_script: an e2e script run through the fork server (tests/e2e/build_server.py) behaves
as ``subprocess.run([python, script, ...])`` does: its output, exit status, errors and timeout, and a state no
earlier script left behind (process group, megatron-core's parallel state, patched torch functions, seeds)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

import build_util
from build_util import run_script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _script(tmp_path, name: str, body: str) -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


@pytest.fixture(params=["fork", "fresh"])
def mode(request, monkeypatch):
    """Both ways run_script runs a script: the fork server, and MEMGUARD_E2E_FORK=0's fresh interpreter."""
    monkeypatch.setenv("MEMGUARD_E2E_FORK", "1" if request.param == "fork" else "0")
    return request.param


def test_output_exit_status_and_errors_as_a_subprocess_gives_them(tmp_path, mode):
    talk = _script(tmp_path, "talk.py", """
        import os, sys
        print("argv", sys.argv[1:], "cwd", os.path.basename(os.getcwd()), "env", os.environ["MEMGUARD_PROBE"])
        print("to stderr", file=sys.stderr)
        print("path0", sys.path[0] == os.path.dirname(os.path.abspath(__file__)), "main", __name__)
        sys.exit(int(sys.argv[1]))
    """)
    (tmp_path / "here").mkdir()
    env = dict(os.environ, MEMGUARD_PROBE="x1")
    r = run_script([sys.executable, talk, "3", "a b"], env=env, cwd=str(tmp_path / "here"), timeout=120)
    assert r.returncode == 3
    assert r.stdout.splitlines() == ["argv ['3', 'a b'] cwd here env x1", "path0 True main __main__"]
    assert r.stderr == "to stderr\n"
    assert run_script([sys.executable, talk, "0", ""], env=env, cwd=str(tmp_path), timeout=120).returncode == 0
    # an exception: status 1 and the traceback on stderr, as the interpreter gives them
    boom = _script(tmp_path, "boom.py", "raise ValueError('no such layer')\n")
    r = run_script([sys.executable, boom], cwd=str(tmp_path), timeout=120)
    assert r.returncode == 1 and r.stderr.strip().splitlines()[-1] == "ValueError: no such layer"
    assert r.stderr.startswith("Traceback (most recent call last):")
    # python -c CODE ARG: sys.argv[0] is "-c"
    r = run_script([sys.executable, "-c", "import sys; print(sys.argv)", "z"], timeout=120)
    assert (r.returncode, r.stdout) == (0, "['-c', 'z']\n")


def test_the_module_search_path_is_a_new_interpreters(tmp_path, monkeypatch):
    """sys.path under a PYTHONPATH of a relative entry, a repeated one and an empty one (the directory): the fork
    server's child and a new interpreter agree entry by entry."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(["rel", str(tmp_path), str(tmp_path), ROOT, ""]))
    show = ["-c", "import json, sys; print(json.dumps(sys.path))"]
    got = {}
    for fork in ("1", "0"):
        monkeypatch.setenv("MEMGUARD_E2E_FORK", fork)
        r = run_script([sys.executable, *show], env=env, cwd=str(tmp_path), timeout=120)
        assert r.returncode == 0, r.stderr
        got[fork] = json.loads(r.stdout)
    assert got["1"] == got["0"]
    assert got["0"][:4] == ["", str(tmp_path / "rel"), str(tmp_path), ROOT]


def test_a_script_that_outruns_its_timeout_raises_and_the_next_one_runs(tmp_path, mode):
    slow = _script(tmp_path, "slow.py", "import time\ntime.sleep(60)\n")
    with pytest.raises(subprocess.TimeoutExpired):
        run_script([sys.executable, slow], timeout=2)
    r = run_script([sys.executable, "-c", "print(6 * 7)"], timeout=120)
    assert (r.returncode, r.stdout) == (0, "42\n")


def test_no_script_sees_what_an_earlier_one_did(tmp_path, monkeypatch):
    """The first script starts a gloo group and megatron-core's model-parallel state, installs the referee's shims
    (torch.cuda.current_device returns "cpu"), seeds torch and imports a module of its own; the next, forked from
    the same server, finds none of it: what a new interpreter finds."""
    pytest.importorskip("megatron.core")
    monkeypatch.setenv("MEMGUARD_E2E_FORK", "1")
    dirty = _script(tmp_path, "dirty.py", """
        import sys, torch
        sys.path[:0] = [sys.argv[1], sys.argv[3]]
        from single_rank import start   # tests/e2e/single_rank.py: shims, gloo group, parallel_state, RNG
        start()
        torch.manual_seed(1234)
        import json
        open(sys.argv[2] + "/marker_mod.py", "w").write("X = 1\\n")
        sys.path.insert(0, sys.argv[2])
        import marker_mod
        from megatron.core import parallel_state
        print(json.dumps([torch.distributed.is_initialized(), parallel_state.model_parallel_is_initialized(),
                          torch.cuda.current_device(), "marker_mod" in sys.modules]))
    """)
    probe = _script(tmp_path, "probe.py", """
        import json, random, sys, torch
        from megatron.core import parallel_state
        print(json.dumps({
            "dist": torch.distributed.is_initialized(),
            "parallel_state": parallel_state.model_parallel_is_initialized(),
            "current_device_patched": torch.cuda.current_device.__module__ != "torch.cuda",
            "marker": "marker_mod" in sys.modules,
            "torch_seed": torch.initial_seed(),
            "random": random.random(),
        }))
    """)
    r = run_script([sys.executable, dirty, os.path.join(ROOT, "tests", "e2e"), str(tmp_path), ROOT], cwd=ROOT,
                   timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout.splitlines()[-1]) == [True, True, "cpu", True]
    seen = []
    for _ in range(2):
        r = run_script([sys.executable, probe], cwd=ROOT, timeout=600)
        assert r.returncode == 0, r.stderr[-2000:]
        seen.append(json.loads(r.stdout.splitlines()[-1]))
    for s in seen:
        assert {k: v for k, v in s.items() if k not in ("random", "torch_seed")} == {
            "dist": False, "parallel_state": False, "current_device_patched": False, "marker": False}
    # Python's and torch's generators seeded from the OS in each script, as in two new interpreters (torch seeds its
    # CPU generator at import): not the server's state twice, nor the first script's seed 1234
    assert seen[0]["random"] != seen[1]["random"]
    assert len({seen[0]["torch_seed"], seen[1]["torch_seed"], 1234}) == 3
    assert build_util.fork_enabled()


def test_run_ranks_starts_them_together_each_as_its_own_program(tmp_path):
    """tests/build_util.py run_ranks (the referee's and the hook e2e's ranks): the ranks run at the same time (each
    waits for the other's file), each with its own environment, argv, sys.path and log, ``-m`` as well as a script."""
    rank = _script(tmp_path, "rank.py", """
        import os, sys, time
        r, d = int(os.environ["RANK"]), sys.argv[1]
        open(os.path.join(d, f"up{r}"), "w").close()
        deadline = time.time() + 120
        while not os.path.exists(os.path.join(d, f"up{1 - r}")):
            if time.time() > deadline:
                sys.exit(5)
            time.sleep(0.05)
        print("rank", r, sys.argv[2:], sys.path[0] == os.path.dirname(os.path.abspath(__file__)), __name__)
        print("to stderr", r, file=sys.stderr)
    """)
    (tmp_path / "rankmod.py").write_text("import os, sys\nprint('module', os.environ['RANK'], sys.argv[1:], "
                                         "sys.path[0] == os.getcwd(), __name__)\n")
    envs = [dict(os.environ, RANK=str(r)) for r in range(2)]
    logs = [str(tmp_path / f"rank{r}.log") for r in range(2)]
    assert build_util.run_ranks([[sys.executable, rank, str(tmp_path), "a b"]] * 2, logs, envs=envs,
                                cwd=str(tmp_path), timeout=600) is None
    for r in range(2):
        assert open(logs[r]).read().splitlines() == [f"rank {r} ['a b'] True __main__", f"to stderr {r}"]
    assert build_util.run_ranks([[sys.executable, "-m", "rankmod", "z"]] * 2, logs, envs=envs, cwd=str(tmp_path),
                                timeout=120) is None
    assert [open(p).read() for p in logs] == [f"module {r} ['z'] True __main__\n" for r in range(2)]


def _gone(pid_file, within: float) -> bool:
    import time
    pid = int(open(pid_file).read())
    deadline = time.time() + within
    while time.time() < deadline:
        try:        # (a zombie not reaped yet has ended too)
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rpartition(")")[2].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.1)
    return False


def test_run_ranks_stops_the_others_when_one_fails_or_time_runs_out(tmp_path):
    """A failing rank is named (its traceback in its log) and the other stopped two seconds later, as
    benchmarks/referee/run.py's launch_processes does; past the timeout -1, and every rank is gone."""
    import time
    body = """
        import os, sys, time
        r = int(os.environ["RANK"])
        open(os.path.join(sys.argv[1], f"pid{r}"), "w").write(str(os.getpid()))
        if r == int(sys.argv[2]):
            raise ValueError("rank %d breaks" % r)
        time.sleep(600)
    """
    script = _script(tmp_path, "fail.py", body)
    envs = [dict(os.environ, RANK=str(r)) for r in range(3)]
    logs = [str(tmp_path / f"rank{r}.log") for r in range(3)]
    t = time.time()
    assert build_util.run_ranks([[sys.executable, script, str(tmp_path), "1"]] * 3, logs, envs=envs,
                                cwd=str(tmp_path), timeout=600) == 1
    assert time.time() - t < 300
    assert open(logs[1]).read().strip().splitlines()[-1] == "ValueError: rank 1 breaks"
    assert _gone(tmp_path / "pid0", 10) and _gone(tmp_path / "pid2", 10)
    # no rank fails: the timeout stops the launcher, and its ranks go with it (PR_SET_PDEATHSIG)
    for r in range(3):
        (tmp_path / f"pid{r}").unlink()
    assert build_util.run_ranks([[sys.executable, script, str(tmp_path), "9"]] * 3, logs, envs=envs,
                                cwd=str(tmp_path), timeout=20) == -1
    for r in range(3):
        assert (tmp_path / f"pid{r}").exists() and _gone(tmp_path / f"pid{r}", 30), r
    r = build_util.run_script([sys.executable, "-c", "print(6 * 7)"], timeout=120)     # the server lives on
    assert (r.returncode, r.stdout) == (0, "42\n")
