"""Run a tests/e2e script as ``subprocess.run([python, script, *args])`` would, through a fork server of that
interpreter (tests/e2e/build_server.py) that has imported torch and megatron-core once.

Each script still runs in a process of its own (a child forked from the server), so the builds share no state;
what is saved is the import, most of a small build's time. One server per (interpreter, start-up environment)
per test process: pytest-xdist workers each start their own. MEMGUARD_E2E_FORK=0 runs every script in a fresh
interpreter instead (what tests/test_build_server.py compares against).

A caller whose scripts import more than megatron-core (the Bridge tests' PEFT scripts) can ask for a server that
has imported that too (``preload``), with directories put on its path first (``server_path``: a stand-in that a
new interpreter would find through PYTHONPATH before megatron-core's import looks for it); such a server is one of
its own.
"""
from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SERVER = os.path.join(HERE, "e2e", "build_server.py")
# variables an interpreter, torch or megatron-core read while starting or importing (and huggingface_hub and
# transformers, which a Bridge preload imports: their cache and offline constants): a request with other values gets
# a server started with them
_STARTUP = ("PYTHON", "OMP_", "MKL_", "KMP_", "TORCH", "CUDA", "NVTE_", "MEGATRON", "LD_", "HF_", "TRANSFORMERS_")

_servers: dict[tuple, subprocess.Popen] = {}
_pending: dict[int, bytearray] = {}     # per server: answer bytes read and not yet used
_tmp = None


def fork_enabled() -> bool:
    return os.environ.get("MEMGUARD_E2E_FORK", "1") != "0"


def _server(python: str, env: dict[str, str], server_path: tuple[str, ...] = (),
            preload: tuple[str, ...] = ()) -> subprocess.Popen:
    # (not PYTHONPATH: the child sets sys.path from the request's; nor TORCHINDUCTOR_*, which torch's compiler sets
    # in the test process when it first runs)
    key = (python, tuple(sorted((k, v) for k, v in env.items()
                                if k.startswith(_STARTUP) and k != "PYTHONPATH" and not k.startswith("TORCHINDUCTOR_"))),
           tuple(server_path), tuple(preload))
    proc = _servers.get(key)
    if proc is None or proc.poll() is not None:
        start_env = {k: v for k, v in env.items() if k != "PYTHONPATH"}
        # (read by build_server.py before its imports; a child's environment is its request's, without these)
        start_env.update(MEMGUARD_E2E_SERVER_PATH=os.pathsep.join(server_path), MEMGUARD_E2E_PRELOAD=",".join(preload))
        proc = subprocess.Popen([python, SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, env=start_env, cwd=HERE, text=True, bufsize=1,
                                start_new_session=True)
        _servers[key] = proc
    return proc


def start_server(python: str, env: dict[str, str], server_path: tuple[str, ...] = (),
                 preload: tuple[str, ...] = ()) -> None:
    """Start the fork server that run_script(..., env=env, server_path=..., preload=...) under ``python`` will use,
    without waiting for it: its imports run beside the caller's work (one that imports the same modules itself)."""
    if fork_enabled():
        _server(python, env, server_path, preload)


def _readline(proc: subprocess.Popen, deadline: float | None) -> str | None:
    """The server's next answer line; None past ``deadline``, "" when the server has ended."""
    buf = _pending.setdefault(proc.pid, bytearray())
    fd = proc.stdout.fileno()
    while b"\n" not in buf:
        wait = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not select.select([fd], [], [], wait)[0]:
            return None
        chunk = os.read(fd, 65536)
        if not chunk:
            return ""
        buf += chunk
    line, _, rest = bytes(buf).partition(b"\n")
    buf[:] = rest
    return line.decode()


def _stop(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)     # the server and a build it runs (one process group)
    except ProcessLookupError:
        pass
    proc.wait()
    _pending.pop(proc.pid, None)


@atexit.register
def _stop_all() -> None:
    for proc in _servers.values():
        if proc.poll() is None:
            proc.stdin.close()      # the server ends at the end of its input
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                _stop(proc)
    _servers.clear()


def run_script(cmd: list[str], *, env: dict[str, str] | None = None, cwd: str | None = None,
               timeout: float | None = None, server_path: tuple[str, ...] = (),
               preload: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)`` for ``cmd`` =
    [python, e2e script, arg, ...] or [python, "-c", code, arg, ...]: the same result (raises
    subprocess.TimeoutExpired the same way), the script run in a child of ``python``'s fork server. ``preload``:
    modules that server imports after torch and megatron-core, ``server_path``: directories first on its path for
    those imports (e.g. a stand-in the request's PYTHONPATH names); the child's path is the request's all the same."""
    if not fork_enabled():
        return subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    global _tmp
    if _tmp is None:
        _tmp = tempfile.TemporaryDirectory(prefix="memguard-e2e-fork-")
    python, argv = cmd[0], [str(a) for a in cmd[1:]]
    env = dict(os.environ if env is None else env)
    out, err = os.path.join(_tmp.name, "stdout"), os.path.join(_tmp.name, "stderr")
    proc = _server(python, env, server_path, preload)
    proc.stdin.write(json.dumps({"argv": argv, "env": env, "cwd": os.path.abspath(cwd or os.getcwd()), "stdout": out,
                                 "stderr": err}) + "\n")
    proc.stdin.flush()
    deadline = None if timeout is None else time.monotonic() + timeout
    started = _readline(proc, deadline)
    if started:
        line = _readline(proc, deadline)
        if line is None:        # as subprocess.run does: kill the script (the server lives on), then raise
            try:
                os.kill(json.loads(started)["pid"], signal.SIGKILL)
            except ProcessLookupError:
                pass
            if _readline(proc, None):
                raise subprocess.TimeoutExpired(cmd, timeout)
    if started is None:         # still importing (the server's first request)
        _stop(proc)
        raise subprocess.TimeoutExpired(cmd, timeout)
    if not started or not line:
        _stop(proc)
        raise RuntimeError(f"tests/e2e/build_server.py under {python} ended unexpectedly (running {argv[0]})")
    rc = json.loads(line)["rc"]
    with open(out, encoding="utf-8", errors="replace") as f_out, open(err, encoding="utf-8", errors="replace") as f_err:
        return subprocess.CompletedProcess(cmd, rc, f_out.read(), f_err.read())


RANKS = os.path.join(HERE, "e2e", "ranks.py")


def run_ranks(cmds: list[list[str]], logs: list[str], *, envs: list[dict[str, str]], cwd: str,
              timeout: float, server_path: tuple[str, ...] = (), preload: tuple[str, ...] = ()) -> int | None:
    """Run the ranks of one multi-process job at once, each command ([python, "-m", module, ...] or [python, script,
    ...]) with its environment, its output and errors to its log, as ``subprocess.Popen`` would start them, forked
    from the fork server of their interpreter (tests/e2e/ranks.py); the ranks' start-up environment (OMP_NUM_THREADS,
    ...) must be the same. Returns the first failing rank (after giving the others two seconds to fail too and
    stopping them), -1 past ``timeout``, None when all ended well. ``server_path``, ``preload``: as run_script's."""
    for log in logs:        # (each exists, even for a rank that never started)
        open(log, "w").close()
    try:
        r = run_script([cmds[0][0], RANKS, json.dumps({"cmds": cmds, "logs": logs, "envs": envs})], env=envs[0],
                       cwd=cwd, timeout=timeout, server_path=server_path, preload=preload)
    except subprocess.TimeoutExpired:
        return -1
    for line in r.stdout.splitlines():
        if line.startswith('{"failed"'):
            return json.loads(line)["failed"]
    with open(logs[0], "a") as f:       # tests/e2e/ranks.py itself failed: its output where the caller looks
        f.write(r.stdout + r.stderr)
    return 0


def run_referee_ranks(cmds: list[list[str]], env: dict[str, str], logs: list[str], timeout: float) -> int | None:
    """benchmarks/referee/run.py's RankLauncher (tests/conftest.py sets it): its ranks through run_ranks, each as
    ``python -m benchmarks.referee.worker`` would run; MEMGUARD_E2E_FORK=0: run.py's launch_processes, a new
    interpreter per rank."""
    from benchmarks.referee.run import _REPO_ROOT, launch_processes
    if not fork_enabled():
        return launch_processes(cmds, env, logs, timeout)
    return run_ranks(cmds, logs, envs=[env] * len(cmds), cwd=_REPO_ROOT, timeout=timeout)
