"""The ranks of a multi-process run, forked together from the fork server's state (tests/build_util.py run_ranks:
the CPU referee's ranks, the hook's two-rank training run).

    python tests/e2e/ranks.py '{"cmds": [[python, "-m", MODULE, ...] or [python, SCRIPT, ...], ...],
                                "logs": [path, ...], "envs": [{...} or null, ...]}'

Run through tests/e2e/build_server.py (torch and megatron-core imported once), this forks one child per rank
command, all at once, and each child runs its ``python -m MODULE ARG...`` or ``python SCRIPT ARG...`` as a new
interpreter would: ``sys.argv``, ``sys.path`` (the current directory or the script's, then PYTHONPATH's entries),
its environment (its own, or this process's: the request's), its output and errors to its log, fresh seeds, the
request's directory. Nothing of a rank's run happened before the fork (no process group, no parallel state, no
shims, no tracker), and no thread pool had started. A rank that outlives this process is killed (PR_SET_PDEATHSIG), so a timeout that kills it
stops the ranks too. It prints {"failed": the first failing rank or null} and exits 1 when a rank failed, after
giving the others two seconds to fail too and stopping them, as benchmarks/referee/run.py's launch_processes does.
"""
import ctypes
import json
import os
import runpy
import signal
import sys
import time

import build_server

_PR_SET_PDEATHSIG = 1


def _rank(cmd: list, log: str, env, launcher: int) -> None:
    """The rank's process: never returns (the worker ends with os._exit)."""
    code = 1
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != launcher:        # the launcher died before the line above
            os._exit(1)
        f = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(f, 1)
        os.dup2(f, 2)
        os.close(f)
        if env is not None:
            os.environ.clear()
            os.environ.update(env)
        build_server._fresh_randomness()
        if cmd[1] == "-m":
            # python -m MODULE: sys.path[0] is the current directory; the rest is this script's (PYTHONPATH, site)
            sys.path[:] = [os.getcwd(), *(p for p in sys.path[1:] if p != os.getcwd())]
            sys.argv = [cmd[2], *cmd[3:]]
            runpy.run_module(cmd[2], run_name="__main__", alter_sys=True)
        else:
            script = os.path.abspath(cmd[1])
            sys.path[:] = build_server._path(os.path.dirname(script), os.environ.get("PYTHONPATH", ""))
            sys.argv = [script, *cmd[2:]]
            runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as e:
        code = build_server.exit_status(e)
    except BaseException:
        import traceback
        traceback.print_exc()
    finally:
        try:
            import atexit
            atexit._run_exitfuncs()     # (a script's exit handlers, as at an interpreter's end)
        except BaseException:
            pass
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main() -> None:
    req = json.loads(sys.argv[1])
    sys.stdout.flush()
    sys.stderr.flush()
    me = os.getpid()
    pids = []
    for cmd, log, env in zip(req["cmds"], req["logs"], req.get("envs") or [None] * len(req["cmds"])):
        pid = os.fork()
        if pid == 0:
            _rank(cmd, log, env, me)
        pids.append(pid)
    running, failed = set(pids), None
    while running:
        pid, status = os.wait()
        running.discard(pid)
        if os.waitstatus_to_exitcode(status) != 0:
            failed = pids.index(pid)
            time.sleep(2)
            for p in running:
                try:
                    os.kill(p, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            for p in running:
                os.waitpid(p, 0)
            break
    print(json.dumps({"failed": failed}))
    sys.exit(0 if failed is None else 1)


if __name__ == "__main__":
    main()
