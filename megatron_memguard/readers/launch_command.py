"""Launch commands as people write them: torchrun / python -m torch.distributed.run / srun / python.

Takes a command line or a shell script: joins backslash continuations, applies ``VAR=value`` and
``export VAR=value`` assignments and bash arrays (``GPT_ARGS=( --num-layers 24 ... )`` used as
``"${GPT_ARGS[@]}"``, the style of Megatron-LM's example scripts), expands ``$VAR``, ``${VAR}``,
``${VAR:-default}``, then finds the launch line and splits it into launcher options, the training
script and its flags. The world size comes from the launcher's own options (``--nnodes`` x
``--nproc-per-node``; srun ``--ntasks`` or ``--nodes`` x ``--ntasks-per-node``) or from WORLD_SIZE /
SLURM variables. Anything it cannot understand is reported, never guessed.
"""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from typing import Mapping

from ..errors import ReaderError

_ASSIGN_TOKEN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_ASSIGN = re.compile(r"^(?:export\s+|declare\s+(?:-a\s+)?|local\s+)?([A-Za-z_][A-Za-z0-9_]*)=(.*)$", re.S)
_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(\[@\]|\[\*\])?(?::?-([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)")

# Launcher options that take a value (torch.distributed.run and its legacy launch module, srun, mpirun).
_TORCHRUN_VALUE_OPTS = {
    "--nnodes", "--nproc-per-node", "--nproc_per_node", "--node-rank", "--node_rank", "--master-addr", "--master_addr",
    "--master-port", "--master_port", "--rdzv-backend", "--rdzv_backend", "--rdzv-endpoint", "--rdzv_endpoint",
    "--rdzv-id", "--rdzv_id", "--rdzv-conf", "--rdzv_conf", "--max-restarts", "--max_restarts", "--monitor-interval",
    "--monitor_interval", "--start-method", "--start_method", "--role", "--log-dir", "--log_dir", "-r", "--redirects",
    "-t", "--tee", "--local-addr", "--local_addr", "--logs-specs", "--logs_specs", "--local-ranks-filter",
    "--local_ranks_filter", "--ft-param-rank_section_timeouts", "--ft-param-rank_heartbeat_timeout",
    "--ft-param-initial_rank_heartbeat_timeout", "--ft-param-rank_out_of_section_timeout", "--max-restarts",
    "--ft-restart-policy", "--ft-rank-section-timeouts", "--ft-rank-out-of-section-timeout",
    "--ft-initial-rank-heartbeat-timeout", "--ft-rank-heartbeat-timeout", "--ft-cfg-path",
    "--ft-enable-nic-healthcheck", "--ft-max-no-progress-restarts", "--omp-num-threads", "--ft-param-workload_check_interval",
}
_TORCHRUN_FLAG_OPTS = {"--standalone", "--no-python", "--no_python", "--run-path", "--run_path", "-m", "--module",
                       "--use-env", "--use_env", "--ft-ignore-missing-cfg"}
_SRUN_VALUE_OPTS = {"-N", "--nodes", "-n", "--ntasks", "--ntasks-per-node", "-c", "--cpus-per-task", "-p", "--partition",
                    "-A", "--account", "-t", "--time", "-J", "--job-name", "-o", "--output", "-e", "--error",
                    "--gpus-per-node", "--gres", "--container-image", "--container-mounts", "--container-name",
                    "--mpi", "--export", "-G", "--gpus", "--gpus-per-task", "--mem", "--exclusive", "-w", "--nodelist",
                    "--qos", "--reservation", "--container-workdir", "--cpu-bind", "--distribution", "-l"}
_SRUN_FLAG_OPTS = {"--exclusive", "-l", "--label", "--no-container-mount-home", "--container-remap-root", "--overlap",
                   "--unbuffered", "-u"}
_PYTHON_FLAG_OPTS = {"-u", "-O", "-OO", "-B", "-E", "-s", "-S", "-I", "-b", "-bb", "-q"}


@dataclass(frozen=True)
class LaunchCommand:
    launcher: str                  # torchrun | torch.distributed.run | srun | python | ...
    script: str                    # pretrain_gpt.py, or a module name
    script_args: list[str]
    env: dict[str, str] = field(default_factory=dict)
    nnodes: int | None = None
    nproc_per_node: int | None = None
    world_size: int | None = None
    notes: list[str] = field(default_factory=list)


_QUOTED_ARRAY = re.compile(r'"\$\{([A-Za-z_][A-Za-z0-9_]*)\[[@*]\]\}"')


def _expand(text: str, vars: Mapping[str, object]) -> str:
    def sub_array(m: re.Match) -> str:
        # "${ARR[@]}" expands to one word per element, each quoted for the later shlex split.
        val = vars.get(m.group(1))
        if isinstance(val, list):
            return " ".join(shlex.quote(v) for v in val)
        return m.group(0)

    text = _QUOTED_ARRAY.sub(sub_array, text)

    def sub(m: re.Match) -> str:
        name = m.group(1) or m.group(4)
        default = m.group(3)
        val = vars.get(name)
        if val is None:
            if default is not None:
                return default
            return m.group(0)
        if isinstance(val, list):
            return " ".join(shlex.quote(v) for v in val)
        return str(val)
    prev = None
    while prev != text:
        prev, text = text, _VAR.sub(sub, text)
    return text


def _logical_lines(text: str) -> list[str]:
    """Join continuations and multi-line array assignments; drop comments."""
    out: list[str] = []
    buf = ""
    depth = 0
    for raw in text.splitlines():
        line = raw.rstrip()
        stripped = line.strip()
        if not buf and (not stripped or stripped.startswith("#")):
            continue
        if depth and stripped.startswith("#"):
            continue
        cont = line.endswith("\\")
        if cont:
            line = line[:-1]
        # strip trailing comments outside quotes (rough but safe for flag lists)
        if " #" in line and "'" not in line and '"' not in line:
            line = line.split(" #", 1)[0]
        buf += (" " if buf else "") + line.strip()
        depth += line.count("(") - line.count(")")
        if cont or depth > 0:
            continue
        out.append(buf)
        buf, depth = "", 0
    if buf:
        out.append(buf)
    return out


def _is_launch_line(toks: list[str]) -> bool:
    for t in toks:
        base = t.rsplit("/", 1)[-1]
        if base in ("torchrun", "srun", "ft_launcher", "deepspeed", "mpirun") or base.endswith(".py"):
            return True
        if base.startswith("python") and "torch.distributed" in " ".join(toks):
            return True
    return False


def parse_launch_script(text: str, environ: Mapping[str, str] | None = None) -> LaunchCommand:
    """Parse a command line or a shell script holding one launch command."""
    vars: dict[str, object] = dict(environ or {})
    env_assigned: dict[str, str] = {}
    exported_env: dict[str, str] = {}
    launch: list[str] | None = None
    for line in _logical_lines(text):
        m = _ASSIGN.match(line)
        if m and m.group(2).strip().startswith("("):
            # bash array: NAME=( items ... )
            value = m.group(2).strip()
            if value.endswith(")"):
                vars[m.group(1)] = shlex.split(_expand(value[1:-1], vars), comments=True)
                continue
        try:
            toks = shlex.split(_expand(line, vars), comments=True)
        except ValueError as e:
            raise ReaderError(f"cannot parse line {line!r}: {e}") from None
        if not toks:
            continue
        if toks[0] in ("export", "declare", "local", "readonly"):
            exported = toks[0] == "export"
            toks = [t for t in toks[1:] if not t.startswith("-")]
            if all(_ASSIGN_TOKEN.match(t) for t in toks):
                for t in toks:
                    name, value = t.split("=", 1)
                    vars[name] = env_assigned[name] = value
                    if exported:
                        exported_env[name] = value
                continue
        if all(_ASSIGN_TOKEN.match(t) for t in toks):
            # plain assignments (VAR=value ...): shell variables for later lines
            for t in toks:
                name, value = t.split("=", 1)
                vars[name] = env_assigned[name] = value
            continue
        if _is_launch_line(toks):
            if launch is not None:
                raise ReaderError("found more than one launch command; give memguard the one to check")
            launch = toks
    if launch is None:
        raise ReaderError("no launch command found (expected torchrun, python -m torch.distributed.run, srun or python *.py)")
    cmd = parse_launch_tokens(launch, {**{k: str(v) for k, v in vars.items() if not isinstance(v, list)}, **env_assigned})
    # the job's environment: what the script exports, then the command's own VAR=value prefix
    return LaunchCommand(launcher=cmd.launcher, script=cmd.script, script_args=cmd.script_args,
                         env={**exported_env, **cmd.env}, nnodes=cmd.nnodes, nproc_per_node=cmd.nproc_per_node,
                         world_size=cmd.world_size, notes=cmd.notes)


def parse_launch_tokens(toks: list[str], environ: Mapping[str, str] | None = None) -> LaunchCommand:
    environ = dict(environ or {})
    env: dict[str, str] = {}
    i = 0
    # leading VAR=value assignments and `env` wrappers
    while i < len(toks):
        t = toks[i]
        if t == "env":
            i += 1
            continue
        m = re.match(r"^([A-Za-z_][A-Za-z0-9_]*)=(.*)$", t)
        if m:
            env[m.group(1)] = m.group(2)
            i += 1
            continue
        break
    environ.update(env)
    notes: list[str] = []
    nnodes = nproc = None
    launcher = "python"
    srun_tasks = srun_nodes = srun_per_node = None
    # srun / mpirun wrappers
    while i < len(toks) and toks[i].rsplit("/", 1)[-1] in ("srun", "mpirun", "numactl"):
        launcher = toks[i].rsplit("/", 1)[-1]
        i += 1
        while i < len(toks) and toks[i].startswith("-"):
            opt, val = toks[i], None
            if "=" in opt:
                opt, val = opt.split("=", 1)
            if val is None and (opt in _SRUN_VALUE_OPTS or opt in ("-np", "-npernode", "--map-by", "-x")) and opt not in _SRUN_FLAG_OPTS:
                i += 1
                val = toks[i] if i < len(toks) else None
            i += 1
            if opt in ("-n", "--ntasks", "-np"):
                srun_tasks = _int(val, opt)
            elif opt in ("-N", "--nodes"):
                srun_nodes = _int(str(val).split("-")[-1], opt)
            elif opt in ("--ntasks-per-node", "-npernode"):
                srun_per_node = _int(val, opt)
    if i >= len(toks):
        raise ReaderError("the launch command has no program to run")
    prog = toks[i].rsplit("/", 1)[-1]
    rest = toks[i + 1:]
    if prog in ("torchrun", "ft_launcher"):
        launcher = prog
        nnodes, nproc, rest = _torchrun_opts(rest, notes)
    elif prog.startswith("python"):
        j = 0
        while j < len(rest) and rest[j] in _PYTHON_FLAG_OPTS:
            j += 1
        if j + 1 < len(rest) and rest[j] == "-m" and rest[j + 1] in ("torch.distributed.run", "torch.distributed.launch"):
            launcher = rest[j + 1]
            nnodes, nproc, rest = _torchrun_opts(rest[j + 2:], notes)
        else:
            rest = rest[j:]
    else:
        if not prog.endswith(".py"):
            raise ReaderError(f"cannot understand the launcher {toks[i]!r}; memguard reads torchrun, "
                              "python -m torch.distributed.run, srun and python SCRIPT.py commands")
        rest = toks[i:]
    if not rest:
        raise ReaderError("the launch command names no training script")
    if rest[0] == "-m" and len(rest) > 1:
        script, args = rest[1], rest[2:]
    else:
        script, args = rest[0], rest[1:]
    world = None
    if nnodes is not None and nproc is not None:
        world = nnodes * nproc
    elif srun_tasks is not None:
        world = srun_tasks
    elif srun_nodes is not None and srun_per_node is not None:
        world = srun_nodes * srun_per_node
    elif nproc is not None:
        nn = _env_int(environ, "SLURM_NNODES") or _env_int(environ, "NNODES") or _env_int(environ, "NUM_NODES") or 1
        world = nn * nproc
        if nnodes is None:
            notes.append(f"--nnodes not given: {nn} node(s)")
    else:
        world = _env_int(environ, "WORLD_SIZE") or _env_int(environ, "SLURM_NTASKS")
        if world is None and _env_int(environ, "SLURM_NNODES") and _env_int(environ, "SLURM_NTASKS_PER_NODE"):
            world = _env_int(environ, "SLURM_NNODES") * _env_int(environ, "SLURM_NTASKS_PER_NODE")
    return LaunchCommand(launcher=launcher, script=script, script_args=args, env=env, nnodes=nnodes,
                         nproc_per_node=nproc, world_size=world, notes=notes)


def _int(val: object, opt: str) -> int:
    try:
        return int(str(val))
    except (TypeError, ValueError):
        raise ReaderError(f"launcher option {opt} expects a number, got {val!r}") from None


def _env_int(env: Mapping[str, str], name: str) -> int | None:
    v = env.get(name)
    if v is None:
        return None
    m = re.match(r"^\d+", str(v))
    return int(m.group(0)) if m else None


def _torchrun_opts(rest: list[str], notes: list[str]) -> tuple[int | None, int | None, list[str]]:
    nnodes = nproc = None
    i = 0
    while i < len(rest) and rest[i].startswith("-"):
        opt, val = rest[i], None
        if "=" in opt:
            opt, val = opt.split("=", 1)
        norm = opt.replace("_", "-")
        if opt in _TORCHRUN_FLAG_OPTS or norm in _TORCHRUN_FLAG_OPTS:
            i += 1
            continue
        if val is None:
            if i + 1 >= len(rest):
                raise ReaderError(f"launcher option {opt} expects a value")
            val = rest[i + 1]
            i += 2
        else:
            i += 1
        if norm not in _TORCHRUN_VALUE_OPTS and opt not in _TORCHRUN_VALUE_OPTS:
            notes.append(f"unknown launcher option {opt} {val} (taken to have a value)")
        if norm == "--nnodes":
            nnodes = _int(str(val).split(":")[-1], opt)
            if ":" in str(val):
                notes.append(f"elastic --nnodes {val}: using the maximum {nnodes}")
        elif norm == "--nproc-per-node":
            if str(val) in ("gpu", "auto", "cpu"):
                raise ReaderError(f"--nproc-per-node {val} depends on the machine; give a number")
            nproc = _int(val, opt)
    return nnodes, nproc, rest[i:]
