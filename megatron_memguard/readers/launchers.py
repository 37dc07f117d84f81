"""Launcher option tables and the walkers over a launcher's options: torchrun / torch.distributed.run,
srun, mpirun / mpiexec, numactl, python, and the world size each implies.

The tables are the launchers' own (torch.distributed.run of torch 2.13 with argparse's unique-prefix
abbreviations, srun with the pyxis container options, mpirun, numactl), so an option's value is never
mistaken for the program. An option that is not in the table is taken to have a value only when the
value cannot be the program (a note says so). Used by ``launch_command``.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping

from ..errors import ReaderError

# torch.distributed.run (torch 2.13, get_args_parser()): options with a value, and flags. Each reads
# PET_<DEST> from the environment when not given. argparse accepts unique prefixes (allow_abbrev).
_TORCHRUN_VALUE_OPTS = frozenset({
    "--duplicate-stderr-filters", "--duplicate-stdout-filters", "--event-log-handler", "--local-addr",
    "--local-ranks-filter", "--log-dir", "--logs-specs", "--master-addr", "--master-port", "--max-restarts",
    "--monitor-interval", "--nnodes", "--node-rank", "--nproc-per-node", "--numa-binding", "--rdzv-backend",
    "--rdzv-conf", "--rdzv-endpoint", "--rdzv-id", "--redirects", "--role", "--shutdown-timeout",
    "--signals-to-handle", "--start-method", "--tee", "-r", "-t",
    # nvidia-resiliency-ext's ft_launcher (a torchrun with fault-tolerance options)
    "--ft-param-rank-section-timeouts", "--ft-param-rank-heartbeat-timeout", "--ft-param-initial-rank-heartbeat-timeout",
    "--ft-param-rank-out-of-section-timeout", "--ft-restart-policy", "--ft-rank-section-timeouts",
    "--ft-rank-out-of-section-timeout", "--ft-initial-rank-heartbeat-timeout", "--ft-rank-heartbeat-timeout",
    "--ft-cfg-path", "--ft-enable-nic-healthcheck", "--ft-max-no-progress-restarts", "--omp-num-threads",
    "--ft-param-workload-check-interval", "--ft-workload-check-interval", "--ft-node-health-check-interval",
    "--ft-safety-factor", "--ft-log-level", "--ft-enable-dist-storage-healthcheck", "--ft-storage-healthcheck-paths",
    "--ft-use-infra-group-rank",
})
_TORCHRUN_FLAG_OPTS = frozenset({"--standalone", "--no-python", "--run-path", "-m", "--module", "--virtual-local-rank",
                                 "--use-env", "--ft-ignore-missing-cfg", "-h", "--help"})
_TORCHRUN_LONG = sorted(o for o in _TORCHRUN_VALUE_OPTS | _TORCHRUN_FLAG_OPTS if o.startswith("--"))

# srun (Slurm 24/25 man page) and the pyxis container plugin. Options with an optional argument
# (--exclusive[=...], -K/--kill-on-bad-exit[=...], ...) take it only as --opt=value: flags here.
_SRUN_VALUE_SHORT = frozenset("AbcdDeGiJLmMnNopqrStTwWxBC")
_SRUN_FLAG_SHORT = frozenset("EHIkKlOQsuvXZhV")
_SRUN_VALUE_LONG = frozenset({
    "--account", "--acctg-freq", "--bb", "--bbf", "--begin", "--chdir", "--cluster-constraint", "--clusters",
    "--comment", "--constraint", "--container", "--container-id", "--context", "--core-spec", "--cores-per-socket",
    "--cpu-bind", "--cpu-freq", "--cpus-per-gpu", "--cpus-per-task", "--deadline", "--delay-boot", "--dependency",
    "--distribution", "--epilog", "--error", "--exclude", "--export", "--extra-node-info", "--gid", "--gpu-bind",
    "--gpu-freq", "--gpus", "--gpus-per-node", "--gpus-per-socket", "--gpus-per-task", "--gres", "--gres-flags",
    "--het-group", "--hint", "--input", "--job-name", "--jobid", "--licenses", "--mail-type", "--mail-user",
    "--mcs-label", "--mem", "--mem-bind", "--mem-per-cpu", "--mem-per-gpu", "--mincpus", "--mpi", "--network",
    "--nodefile", "--nodelist", "--nodes", "--ntasks", "--ntasks-per-core", "--ntasks-per-gpu", "--ntasks-per-node",
    "--ntasks-per-socket", "--open-mode", "--output", "--partition", "--power", "--prefer", "--priority", "--profile",
    "--prolog", "--qos", "--reservation", "--segment", "--signal", "--slurmd-debug", "--sockets-per-node",
    "--switches", "--task-epilog", "--task-prolog", "--thread-spec", "--threads", "--threads-per-core", "--time",
    "--time-min", "--tmp", "--tres-bind", "--tres-per-task", "--uid", "--wait", "--wckey", "--relative",
    # pyxis
    "--container-image", "--container-mounts", "--container-workdir", "--container-name", "--container-save",
    "--container-env",
})
_SRUN_FLAG_LONG = frozenset({
    "--exact", "--exclusive", "--label", "--unbuffered", "--overlap", "--overcommit", "--no-kill", "--quiet",
    "--verbose", "--preserve-env", "--hold", "--immediate", "--multi-prog", "--pty", "--quit-on-interrupt",
    "--disable-status", "--no-allocate", "--test-only", "--use-min-nodes", "--contiguous", "--reboot", "--spread-job",
    "--send-libs", "--whole", "--external-launcher", "--kill-on-bad-exit", "--bcast", "--nice", "--propagate",
    "--resv-ports", "--x11", "--oversubscribe", "--help", "--usage", "--version",
    # pyxis
    "--container-mount-home", "--no-container-mount-home", "--container-remap-root", "--no-container-remap-root",
    "--container-entrypoint", "--no-container-entrypoint", "--container-writable", "--container-readonly",
    "--container-entrypoint-log",
})
# Open MPI / MPICH mpirun, mpiexec.
_MPI_VALUE_OPTS = frozenset({"-np", "-n", "--np", "-N", "-npernode", "--npernode", "-c", "-x", "-H", "--host", "-host",
                             "--hostfile", "-hostfile", "--machinefile", "-machinefile", "--map-by", "-map-by", "--bind-to",
                             "-bind-to", "--rank-by", "-rank-by", "-ppn", "--ppn", "-wdir", "--wdir", "-env", "-genv",
                             "--output-filename", "--prefix", "-f"})
_MPI_TWO_VALUE_OPTS = frozenset({"--mca", "-mca", "-gmca", "--gmca", "-env", "-genv"})
_MPI_FLAG_OPTS = frozenset({"--allow-run-as-root", "--oversubscribe", "--report-bindings", "--tag-output",
                            "--timestamp-output", "-q", "--quiet", "-v", "--verbose", "--display-map", "-bind-to-core",
                            "-l", "-prepend-rank"})
NUMACTL_VALUE_OPTS = frozenset({"-C", "--physcpubind", "-N", "--cpunodebind", "-m", "--membind", "-p", "--preferred",
                                 "-i", "--interleave", "-P", "--preferred-many", "-w", "--weighted-interleave"})
_NUMACTL_FLAG_OPTS = frozenset({"-l", "--localalloc", "-a", "--all", "-b", "--balancing", "-s", "--show", "-H",
                                "--hardware"})
_PYTHON_FLAG_OPTS = frozenset({"-u", "-O", "-OO", "-B", "-E", "-s", "-S", "-I", "-b", "-bb", "-q", "-P", "-d", "-v", "-R"})
PYTHON_VALUE_OPTS = frozenset({"-X", "-W", "--check-hash-based-pycs"})

LAUNCHERS = ("torchrun", "ft_launcher")
DISTRIBUTED_MODULES = ("torch.distributed.run", "torch.distributed.launch")
_WRAPPERS = ("srun", "mpirun", "mpiexec", "numactl")
TRANSPARENT = ("exec", "time", "nohup", "command", "builtin", "stdbuf", "taskset", "timeout", "nice", "ionice")
UNSUPPORTED = {"deepspeed": "DeepSpeed's launcher", "accelerate": "Hugging Face accelerate", "nsys": "Nsight Systems",
                "ncu": "Nsight Compute", "nemo": "the NeMo-Run CLI (nemo llm ...)", "jsrun": "jsrun", "aprun": "aprun",
                "horovodrun": "horovodrun", "colossalai": "ColossalAI's launcher"}


def program_base(tok: str) -> str:
    return tok.rsplit("/", 1)[-1]


def _int(val: object, opt: str) -> int:
    try:
        return int(str(val))
    except (TypeError, ValueError):
        if isinstance(val, str) and val.startswith(("$", "`")):
            # (the launch line is read before memguard's --world-size could stand in for it: write the number)
            raise ReaderError(f"launcher option {opt} is {val!r}, which memguard cannot evaluate (an unset variable or "
                              "a command substitution, whose program bash runs when the job starts); write the number "
                              "into the script or set the variable in the environment") from None
        raise ReaderError(f"launcher option {opt} expects a number, got {val!r}") from None


def env_int(env: Mapping[str, str], name: str) -> int | None:
    v = env.get(name)
    if v is None:
        return None
    m = re.match(r"^\d+", str(v))
    return int(m.group(0)) if m else None


def _looks_like_program(tok: str) -> bool:
    b = program_base(tok)
    return (b in LAUNCHERS or b in _WRAPPERS or b in TRANSPARENT or b in ("env", "bash", "sh") or b.endswith(".py")
            or bool(re.fullmatch(r"python[0-9.]*", b)) or "/" in tok and not tok.startswith("-") and "=" not in tok)


@dataclass
class OuterOpts:
    name: str
    tasks: int | None = None
    nodes: int | None = None
    per_node: int | None = None


def srun_opts(toks: list[str], i: int, notes: list[str], name: str) -> tuple[OuterOpts, int]:
    s = OuterOpts(name)
    # a lone "-" is no option to srun's getopt: it is the program's place, as "--" ends the options
    while i < len(toks) and toks[i].startswith("-") and toks[i] not in ("-", "--"):
        t = toks[i]
        if t.startswith("--"):
            opt, val = (t.split("=", 1) + [None])[:2]
            if val is None and opt in _SRUN_VALUE_LONG:
                if i + 1 >= len(toks):
                    raise ReaderError(f"srun option {opt} expects a value")
                val = toks[i + 1]
                i += 1
            elif val is None and opt not in _SRUN_FLAG_LONG:
                i = _unknown_option(toks, i, notes, "srun")
                continue
        else:
            opt = t[:2]
            val = t[2:] or None
            if opt[1] in _SRUN_VALUE_SHORT:
                if val is None:
                    if i + 1 >= len(toks):
                        raise ReaderError(f"srun option {opt} expects a value")
                    val = toks[i + 1]
                    i += 1
                elif val.startswith("="):
                    val = val[1:]
            elif opt[1] not in _SRUN_FLAG_SHORT:
                i = _unknown_option(toks, i, notes, "srun")
                continue
        i += 1
        if opt in ("-n", "--ntasks"):
            s.tasks = _int(val, opt)
        elif opt in ("-N", "--nodes"):
            s.nodes = _int(str(val).split("-")[-1], opt)
            if "-" in str(val):
                notes.append(f"srun {opt} {val}: a node range; using the maximum {s.nodes}")
        elif opt == "--ntasks-per-node":
            s.per_node = _int(val, opt)
    if i < len(toks) and toks[i] == "--":
        i += 1
    return s, i


def mpi_opts(toks: list[str], i: int, notes: list[str], name: str) -> tuple[OuterOpts, int]:
    s = OuterOpts(name)
    while i < len(toks) and toks[i].startswith("-"):
        t = toks[i]
        opt, val = (t.split("=", 1) + [None])[:2] if t.startswith("--") else (t, None)
        if opt in _MPI_TWO_VALUE_OPTS:
            i += 3
            continue
        if val is None and opt in _MPI_VALUE_OPTS:
            if i + 1 >= len(toks):
                raise ReaderError(f"{name} option {opt} expects a value")
            val = toks[i + 1]
            i += 2
        elif val is None and opt not in _MPI_FLAG_OPTS:
            i = _unknown_option(toks, i, notes, name)
            continue
        else:
            i += 1
        if opt in ("-np", "-n", "--np"):
            s.tasks = _int(val, opt)
        elif opt in ("-N", "-npernode", "--npernode", "-ppn", "--ppn"):
            s.per_node = _int(val, opt)
    return s, i


def _unknown_option(toks: list[str], i: int, notes: list[str], who: str) -> int:
    """An option not in the launcher's table, written without ``=``: a flag when the next word is
    an option or can be the program; otherwise its value (the next word cannot be the program:
    memguard would not understand that program). Returns the index after it."""
    opt = toks[i]
    nxt = toks[i + 1] if i + 1 < len(toks) else None
    if nxt is None or nxt.startswith("-") or _looks_like_program(nxt):
        notes.append(f"unknown {who} option {opt} (taken as a flag: {nxt or 'nothing'} follows)")
        return i + 1
    notes.append(f"unknown {who} option {opt} {nxt} (taken to have the value {nxt!r}: it cannot be the program)")
    return i + 2


def _torchrun_option(opt: str) -> str | None:
    """torchrun's canonical (dash) spelling of ``opt``, accepting underscores and unique prefixes."""
    norm = opt.replace("_", "-") if opt.startswith("--") else opt
    if norm in _TORCHRUN_VALUE_OPTS or norm in _TORCHRUN_FLAG_OPTS:
        return norm
    if norm.startswith("--") and len(norm) > 2:
        cands = [o for o in _TORCHRUN_LONG if o.startswith(norm)]
        if len(cands) == 1:
            return cands[0]
        if len(cands) > 1:
            raise ReaderError(f"launcher option {opt} is ambiguous (could be {', '.join(cands)}); torchrun rejects it too")
    return None


def torchrun_opts(rest: list[str], notes: list[str], who: str) -> tuple[dict[str, str], list[str]]:
    """torchrun options -> {canonical option: value} (flags map to ""), and the rest (script + args)."""
    opts: dict[str, str] = {}
    i = 0
    while i < len(rest) and rest[i].startswith("-"):
        tok = rest[i]
        if tok == "--":
            i += 1
            break
        opt, val = (tok.split("=", 1) + [None])[:2] if tok.startswith("--") else (tok[:2], tok[2:] or None)
        canon = _torchrun_option(opt)
        if canon is None:
            if val is not None:
                notes.append(f"unknown {who} option {opt}={val}")
                i += 1
                continue
            i = _unknown_option(rest, i, notes, who)
            continue
        if canon in _TORCHRUN_FLAG_OPTS:
            opts[canon] = ""
            i += 1
            if canon in ("-m", "--module"):
                break  # the module name follows
            continue
        if val is None:
            if i + 1 >= len(rest):
                raise ReaderError(f"launcher option {opt} expects a value")
            val = rest[i + 1]
            i += 2
        else:
            i += 1
        opts[canon] = val
    return opts, rest[i:]


def torchrun_world(opts: Mapping[str, str], environ: Mapping[str, str], notes: list[str], who: str,
                    outer: OuterOpts | None) -> tuple[int, int]:
    # --nproc-per-node (PET_NPROC_PER_NODE, default 1); "gpu"/"auto" need the node's GPU count.
    val = opts.get("--nproc-per-node")
    src = "--nproc-per-node"
    if val is None and environ.get("PET_NPROC_PER_NODE"):
        val, src = environ["PET_NPROC_PER_NODE"], "PET_NPROC_PER_NODE"
    if val is None:
        nproc = 1
        notes.append(f"{who} without --nproc-per-node starts 1 process per node (its default)")
    elif str(val) in ("gpu", "auto", "cuda", "xpu"):
        # SLURM_GPUS_PER_NODE repeats --gpus-per-node, which may name the type ("h100:8"), as #SBATCH lines do
        typed = re.fullmatch(r"(?:[\w.-]+:)?(\d+)", environ.get("SLURM_GPUS_PER_NODE", "").strip())
        g = (env_int(environ, "SLURM_GPUS_ON_NODE") or env_int(environ, "SLURM_GPUS_PER_NODE")
             or (int(typed.group(1)) if typed else None))
        if g is None:
            raise ReaderError(f"{src} {val} depends on the machine's GPU count; give a number (or --world-size)")
        nproc = g
        notes.append(f"{src} {val}: {g} GPUs per node from SLURM_GPUS_ON_NODE / SLURM_GPUS_PER_NODE")
    else:
        nproc = _int(val, src)
    # --nnodes (PET_NNODES, default 1:1); MIN:MAX elastic ranges use the maximum.
    val = opts.get("--nnodes")
    src = "--nnodes"
    if val is None and environ.get("PET_NNODES"):
        val, src = environ["PET_NNODES"], "PET_NNODES"
    if val is None:
        if "--standalone" in opts:
            nn = 1
        else:
            nn = None
            for name in ("SLURM_NNODES", "SLURM_JOB_NUM_NODES", "NNODES", "NUM_NODES"):
                nn = env_int(environ, name)
                if nn:
                    notes.append(f"{who} without --nnodes: {nn} node(s) from {name}")
                    break
            if not nn:
                nn = 1
                notes.append(f"{who} without --nnodes runs on 1 node (its default)")
    else:
        nn = _int(str(val).split(":")[-1], src)
        if ":" in str(val):
            notes.append(f"elastic {src} {val}: using the maximum {nn}")
    if outer is not None and outer.per_node not in (None, 1):
        notes.append(f"{outer.name} starts {outer.per_node} {who} per node, each with {nproc} processes; memguard counts "
                     f"{who}'s --nnodes x --nproc-per-node")
    return nn, nproc


def outer_world(s: OuterOpts, environ: Mapping[str, str]) -> tuple[int | None, str]:
    if s.tasks is not None:
        return s.tasks, f"{s.name} --ntasks {s.tasks}" if s.name == "srun" else f"{s.name} -np {s.tasks}"
    nodes, nsrc = s.nodes, "--nodes"
    if nodes is None:
        for name in ("SLURM_NNODES", "SLURM_JOB_NUM_NODES"):
            nodes = env_int(environ, name)
            if nodes:
                nsrc = name
                break
    per, psrc = s.per_node, "--ntasks-per-node"
    if per is None and s.name == "srun":
        per, psrc = env_int(environ, "SLURM_NTASKS_PER_NODE"), "SLURM_NTASKS_PER_NODE"
    if nodes and per:
        return nodes * per, f"{s.name} {nsrc} {nodes} x {psrc} {per}"
    if s.name == "srun":
        for name in ("SLURM_NTASKS", "SLURM_NPROCS"):
            t = env_int(environ, name)
            if t:
                return t, name
        if nodes and s.per_node is None:
            return None, ""
    return None, ""
