"""The CPU referee's ranks, forked from the fork server's state (tests/build_util.py run_referee_ranks).

    python tests/e2e/referee_ranks.py '{"cmds": [[python, "-m", "benchmarks.referee.worker", ...], ...],
                                        "logs": [path, ...]}'

Run through tests/e2e/build_server.py (torch and megatron-core imported once), this forks one child per rank
command, all at once, and each child runs its ``python -m MODULE ARG...`` as a new interpreter would: ``sys.argv``,
``sys.path`` (the current directory first, then PYTHONPATH's entries), its output and errors to its log, fresh seeds,
the server's environment and directory (the request's: benchmarks/referee/run.py's rank environment). Nothing of
a rank's run happened before the fork (no process group, no parallel state, no shims, no tracker), and no thread
pool had started. A rank that outlives this process is killed (PR_SET_PDEATHSIG), so a timeout that kills it
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


def _rank(cmd: list, log: str, launcher: int) -> None:
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
        assert cmd[1] == "-m", cmd
        # python -m MODULE: sys.path[0] is the current directory; the rest is this script's (PYTHONPATH, site)
        sys.path[:] = [os.getcwd(), *(p for p in sys.path[1:] if p != os.getcwd())]
        sys.argv = [cmd[2], *cmd[3:]]
        build_server._fresh_randomness()
        runpy.run_module(cmd[2], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        import traceback
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main() -> None:
    req = json.loads(sys.argv[1])
    sys.stdout.flush()
    sys.stderr.flush()
    me = os.getpid()
    pids = []
    for cmd, log in zip(req["cmds"], req["logs"]):
        pid = os.fork()
        if pid == 0:
            _rank(cmd, log, me)
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
