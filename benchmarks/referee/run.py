"""Launcher: one process per rank on 127.0.0.1 (gloo), results collected as JSON.

    python -m benchmarks.referee.run --world-size 2 --settings settings.json [--out result.json]

Python API: run_referee(settings, world_size, timeout=...) -> list of per-rank dicts sorted by
global rank. A failing rank makes the whole run fail loudly with that rank's traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# The shims and phase hooks in worker.py follow megatron-core 0.16.1's internals (schedules'
# backward_step signature, the local layer-spec provider); other versions fail in those hooks.
SUPPORTED_MEGATRON_CORE = "0.16.1"
# The Megatron-FSDP grid (fsdp_grid.py) also runs on core 0.19.2, whose Megatron-FSDP differs from 0.16.1's:
# the two places 0.19.2 needs (backward_step's signature, the adapter's TE check) are handled in worker.py and
# shims.py; the other grids are only checked on 0.16.1.
FSDP_MEGATRON_CORES = ("0.16.1", "0.19.2")


def unsupported_reason(cores: Sequence[str] = (SUPPORTED_MEGATRON_CORE,)) -> Optional[str]:
    """Why the referee cannot run in this environment (megatron-core not one of ``cores``), or None when it can."""
    from importlib import metadata

    try:
        version = metadata.version("megatron-core")
    except metadata.PackageNotFoundError:
        return "megatron-core is not installed (the referee runs megatron-core %s)" % SUPPORTED_MEGATRON_CORE
    if version not in cores:
        return ("the referee's CPU shims target megatron-core %s; this environment has %s"
                % (" or ".join(cores), version))
    return None


class RefereeError(RuntimeError):
    def __init__(self, msg: str, root_cause_known: bool = False):
        super().__init__(msg)
        self.root_cause_known = root_cause_known


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Errors of the loopback transport itself (a port taken by another job, a peer killed from outside);
# a run that fails with one of these is retried once on a fresh port.
_TRANSPORT_ERRORS = ("Connection reset by peer", "Connection closed by peer", "Address already in use",
                     "address already in use", "EADDRINUSE", "Connection refused", "Socket Timeout")


def run_referee(settings: Dict[str, Any], world_size: int, timeout: float = 600.0,
                python: Optional[str] = None, threads_per_rank: Optional[int] = None,
                retries: int = 1, cores: Sequence[str] = (SUPPORTED_MEGATRON_CORE,)) -> List[Dict[str, Any]]:
    """Run the referee for `settings` on `world_size` local processes; return per-rank results,
    sorted by global rank. Raises RefereeError with the failing rank's traceback. ``cores``: the
    megatron-core releases the configuration is checked on."""
    reason = unsupported_reason(cores)
    if reason:
        raise RefereeError(reason, root_cause_known=True)
    for attempt in range(retries + 1):
        try:
            return _run_once(settings, world_size, timeout, python, threads_per_rank)
        except RefereeError as e:
            transport = any(t in str(e) for t in _TRANSPORT_ERRORS) and not e.root_cause_known
            if attempt < retries and transport:
                continue
            raise


# Runs the rank commands (each [python, "-m", "benchmarks.referee.worker", ...], run in the repository with
# ``env``, output and errors to its log file) and returns the first failing rank, -1 on a timeout, None when all
# ended well. tests/conftest.py sets one that forks the ranks from tests/e2e/build_server.py (no new interpreter
# importing torch and megatron-core per rank).
RankLauncher = Callable[[List[List[str]], Dict[str, str], List[str], float], Optional[int]]
_rank_launcher: Optional[RankLauncher] = None


def set_rank_launcher(launcher: Optional[RankLauncher]) -> Optional[RankLauncher]:
    """Use ``launcher`` for the rank processes from now on (None: launch_processes); returns the previous one."""
    global _rank_launcher
    previous, _rank_launcher = _rank_launcher, launcher
    return previous


def launch_processes(cmds: List[List[str]], env: Dict[str, str], logs: List[str], timeout: float) -> Optional[int]:
    """The default RankLauncher: one new interpreter per rank."""
    procs = []
    for cmd, log_path in zip(cmds, logs):
        log = open(log_path, "w")
        procs.append((subprocess.Popen(cmd, cwd=_REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    deadline = time.time() + timeout
    failed = None
    try:
        while True:
            states = [p.poll() for p, _ in procs]
            bad = [r for r, s in enumerate(states) if s not in (None, 0)]
            if bad:
                failed = bad[0]
                # give the others a moment to fail too, then stop them
                time.sleep(2)
                break
            if all(s == 0 for s in states):
                break
            if time.time() > deadline:
                failed = -1
                break
            time.sleep(0.2)
    finally:
        for p, log in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            log.close()
    return failed


def _run_once(settings, world_size, timeout, python, threads_per_rank):
    python = python or sys.executable
    if threads_per_rank is None:
        threads_per_rank = max(1, (os.cpu_count() or 1) // world_size)
    with tempfile.TemporaryDirectory(prefix="referee-") as tmp:
        spath = os.path.join(tmp, "settings.json")
        with open(spath, "w") as f:
            json.dump(settings, f)
        port = _free_port()
        env = dict(os.environ)
        env["PYTHONPATH"] = _REPO_ROOT + os.pathsep + env.get("PYTHONPATH", "")
        env["REFEREE_THREADS"] = str(threads_per_rank)
        env["OMP_NUM_THREADS"] = str(threads_per_rank)
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        env["PYTHONWARNINGS"] = "ignore"
        cmds, logs, outs = [], [], []
        for r in range(world_size):
            outs.append(os.path.join(tmp, f"rank{r}.json"))
            logs.append(os.path.join(tmp, f"rank{r}.log"))
            cmds.append([python, "-m", "benchmarks.referee.worker", "--settings", spath, "--rank", str(r),
                         "--world-size", str(world_size), "--port", str(port), "--out", outs[r]])
        failed = (_rank_launcher or launch_processes)(cmds, env, logs, timeout)
        if failed is not None:
            # Report the rank whose error is not a consequence of another rank dying (a gloo
            # connection error), falling back to the first failing rank, then to log tails.
            errs = {}
            for r in range(world_size):
                errf = os.path.join(tmp, f"rank{r}.json.err")
                if os.path.exists(errf):
                    with open(errf) as f:
                        errs[r] = f.read()
            primary = [r for r, t in errs.items() if not any(x in t for x in _TRANSPORT_ERRORS)]
            msgs = []
            if primary:
                r = primary[0]
                msgs.append(f"--- rank {r} traceback ---\n{errs[r]}")
            elif errs:
                r = failed if failed in errs else sorted(errs)[0]
                msgs.append(f"--- rank {r} traceback ---\n{errs[r]}")
            else:
                r = failed if failed >= 0 else 0
                with open(os.path.join(tmp, f"rank{r}.log")) as f:
                    msgs.append(f"--- rank {r} log tail ---\n{f.read()[-4000:]}")
            what = "timed out" if failed == -1 else f"rank {failed} failed"
            raise RefereeError(f"referee run {what} (world size {world_size})\n" + "\n".join(msgs),
                               root_cause_known=bool(primary))
        results = []
        for out in outs:
            with open(out) as f:
                results.append(json.load(f))
    return sorted(results, key=lambda d: d["rank"])


def main(argv: Optional[List[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--settings", required=True, help="JSON file with resolved Megatron settings")
    p.add_argument("--out", default=None, help="write the per-rank results here (default: stdout)")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--summary", action="store_true", help="print a one-line summary per rank")
    a = p.parse_args(argv)
    with open(a.settings) as f:
        settings = json.load(f)
    res = run_referee(settings, a.world_size, timeout=a.timeout)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    if a.summary or not a.out:
        for r in res:
            print(summary_line(r))
    if not a.out and not a.summary:
        json.dump(res, sys.stdout, indent=1)


def summary_line(r: Dict[str, Any]) -> str:
    mib = 1024 ** 2
    return (f"rank {r['rank']} (tp{r['tp_rank']} pp{r['pp_rank']} dp{r['dp_rank']}): "
            f"params {r['num_params']:,}  after build {r['live_bytes_after_build'] / mib:.2f} MiB  "
            f"after step {r['live_bytes_after_step'] / mib:.2f} MiB  peak {r['peak_bytes'] / mib:.2f} MiB "
            f"[{r['peak_phase']}]  opt-step peak {r['optimizer_step_peak_bytes'] / mib:.2f} MiB")


if __name__ == "__main__":
    main()
