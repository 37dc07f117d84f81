"""Launch commands as people write them: torchrun / python -m torch.distributed.run / srun / mpirun / python.

Takes a command line or a shell script. The script is read the way bash reads it, as far as a launch
line needs: backslash continuations, quotes spanning lines (``bash -c "..."`` blocks of NeMo launcher
scripts), comments, ``;`` / ``&&`` / ``|`` separated commands, redirections (dropped), ``VAR=value``,
``export VAR=value`` and bash arrays (``GPT_ARGS=( --num-layers 24 ... )`` used as ``"${GPT_ARGS[@]}"``,
the style of Megatron-LM's example scripts), ``$VAR``, ``${VAR}``, ``${VAR:-default}``, and ``#SBATCH``
directives (they give the SLURM_* values the job will see, unless the environment has them). Then it
finds the launch line and splits it into wrappers (``env``, ``srun``, ``mpirun``, ``numactl``,
``bash -c "..."``, ``exec``, ``timeout``...), launcher options, the training script and its arguments.

The world size comes from the launcher's own options: torchrun's ``--nnodes`` x ``--nproc-per-node``
(or their ``PET_*`` variables, or torchrun's defaults, each noted), srun's ``--ntasks`` or ``--nodes`` x
``--ntasks-per-node`` (or the SLURM_* variables / #SBATCH directives), mpirun's ``-np``; for a bare
``python script.py``, WORLD_SIZE. Launcher options are taken from the launchers' own option tables
(torch.distributed.run of torch 2.13 with argparse's unique-prefix abbreviations, srun with the pyxis
container options, mpirun, numactl), so an option's value is never mistaken for the program. An
option that is not in the table is taken to have a value only when the value cannot be the program
(a note says so). Anything else memguard cannot understand is reported (ReaderError), never guessed.
"""
from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from ..errors import ReaderError
from .shell import expand_word, words

_ASSIGN_TOKEN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_ASSIGN = re.compile(r"^(?:export\s+|declare\s+(?:-a\s+)?|local\s+)?([A-Za-z_][A-Za-z0-9_]*)=(.*)$", re.S)

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
_NUMACTL_VALUE_OPTS = frozenset({"-C", "--physcpubind", "-N", "--cpunodebind", "-m", "--membind", "-p", "--preferred",
                                 "-i", "--interleave", "-P", "--preferred-many", "-w", "--weighted-interleave"})
_NUMACTL_FLAG_OPTS = frozenset({"-l", "--localalloc", "-a", "--all", "-b", "--balancing", "-s", "--show", "-H",
                                "--hardware"})
_PYTHON_FLAG_OPTS = frozenset({"-u", "-O", "-OO", "-B", "-E", "-s", "-S", "-I", "-b", "-bb", "-q", "-P", "-d", "-v", "-R"})
_PYTHON_VALUE_OPTS = frozenset({"-X", "-W", "--check-hash-based-pycs"})

_LAUNCHERS = ("torchrun", "ft_launcher")
_DISTRIBUTED_MODULES = ("torch.distributed.run", "torch.distributed.launch")
_WRAPPERS = ("srun", "mpirun", "mpiexec", "numactl")
_TRANSPARENT = ("exec", "time", "nohup", "command", "builtin", "stdbuf", "taskset", "timeout", "nice", "ionice")
_UNSUPPORTED = {"deepspeed": "DeepSpeed's launcher", "accelerate": "Hugging Face accelerate", "nsys": "Nsight Systems",
                "ncu": "Nsight Compute", "nemo": "the NeMo-Run CLI (nemo llm ...)", "jsrun": "jsrun", "aprun": "aprun",
                "horovodrun": "horovodrun", "colossalai": "ColossalAI's launcher"}


@dataclass(frozen=True)
class LaunchCommand:
    launcher: str                  # torchrun | torch.distributed.run | srun | mpirun | python | ...
    script: str                    # pretrain_gpt.py, or a module name
    script_args: list[str]
    env: dict[str, str] = field(default_factory=dict)
    nnodes: int | None = None
    nproc_per_node: int | None = None
    world_size: int | None = None
    notes: list[str] = field(default_factory=list)
    world_size_from: str = ""      # how the world size was found ("torchrun --nnodes 2 x --nproc-per-node 8")
    wrappers: tuple[str, ...] = ()  # srun, numactl, bash -c, ... around the launcher
    module: bool = False            # the script is a module (python -m / torchrun -m)


# --------------------------------------------------------------------------------------------------
# Shell text
# --------------------------------------------------------------------------------------------------
_HEREDOC = re.compile(r"""<<(-?)[ \t]*(?:'([^']*)'|"([^"]*)"|([^\s;&|<>()'"]+))""")


def _logical_lines(text: str) -> list[str]:
    """Bash's logical lines: continuations joined, comments dropped, quotes and ``( ... )`` arrays may
    span lines (a newline inside quotes is kept, one inside an array becomes a space), here-document
    bodies (``cat > hosts <<EOF ... EOF``) dropped: they are a command's input, not commands."""
    out: list[str] = []
    buf: list[str] = []
    quote: str | None = None
    depth = 0
    heredocs: list[tuple[str, bool]] = []   # (delimiter, <<- strips leading tabs) waiting for the line's end
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if quote:
            if c == "\\" and quote == '"' and i + 1 < n:
                if text[i + 1] == "\n":   # continuation inside double quotes
                    i += 2
                    continue
                buf.append(text[i:i + 2])
                i += 2
                continue
            buf.append(c)
            if c == quote:
                quote = None
            i += 1
            continue
        if c == "\\" and i + 1 < n:
            if text[i + 1] == "\n":
                i += 2
                continue
            buf.append(text[i:i + 2])
            i += 2
            continue
        if c in "'\"`":
            quote = c
            buf.append(c)
            i += 1
            continue
        if c == "#" and (not buf or buf[-1][-1:] in (" ", "\t", "\n", ";", "(")):
            while i < n and text[i] != "\n":
                i += 1
            continue
        if text.startswith("<<<", i):      # a here-string: one word of input, no body
            buf.append("<<<")
            i += 3
            continue
        if c == "<" and not depth and text.startswith("<<", i):
            m = _HEREDOC.match(text, i)
            if m:
                heredocs.append((m.group(2) or m.group(3) or m.group(4), bool(m.group(1))))
                buf.append(m.group(0))   # the operator and its word, dropped later as a redirection
                i = m.end()
                continue
        if c == "(":
            depth += 1
        elif c == ")" and depth:
            depth -= 1
        if c == "\n":
            if depth:
                buf.append(" ")
            else:
                line = "".join(buf).strip()
                if line:
                    out.append(line)
                buf = []
            i += 1
            for delim, strip_tabs in heredocs:
                while i < n:
                    end = text.find("\n", i)
                    end = n if end < 0 else end
                    body = text[i:end].rstrip("\r")
                    i = end + 1
                    if (body.lstrip("\t") if strip_tabs else body) == delim:
                        break
            heredocs = []
            continue
        buf.append(c)
        i += 1
    if quote:
        raise ReaderError(f"unterminated {quote} quote in the launch command")
    line = "".join(buf).strip()
    if line:
        out.append(line)
    return out


def _simple_commands(line: str) -> list[str]:
    """Split a logical line on unquoted ``;``, ``&&``, ``||``, ``|`` and ``&``; drop redirections
    (``> log 2>&1``, ``|& tee``...). ``$( ... )`` and quotes are kept whole."""
    cmds: list[str] = []
    cur: list[str] = []
    quote: str | None = None
    sub = 0
    i, n = 0, len(line)

    def flush():
        s = "".join(cur).strip()
        if s:
            cmds.append(s)
        cur.clear()

    while i < n:
        c = line[i]
        if quote:
            cur.append(c)
            if c == "\\" and quote == '"' and i + 1 < n:
                cur.append(line[i + 1])
                i += 2
                continue
            if c == quote:
                quote = None
            i += 1
            continue
        if c == "\\" and i + 1 < n:
            cur.append(line[i:i + 2])
            i += 2
            continue
        if c in "'\"`":
            quote = c
            cur.append(c)
            i += 1
            continue
        if c == "$" and line[i + 1:i + 2] == "(":
            sub += 1
            cur.append("$(")
            i += 2
            continue
        if sub:
            if c == "(":
                sub += 1
            elif c == ")":
                sub -= 1
            cur.append(c)
            i += 1
            continue
        if c in "<>" or (c == "&" and line[i + 1:i + 2] == ">"):
            # a redirection: drop an attached fd number, the operator and its target word
            while cur and cur[-1].isdigit():
                cur.pop()
            while i < n and line[i] in "<>&|":
                i += 1
            while i < n and line[i] in " \t":
                i += 1
            q = None
            while i < n and (q or line[i] not in " \t;|&"):
                if q is None and line[i] in "'\"":
                    q = line[i]
                elif q == line[i]:
                    q = None
                i += 1
            continue
        if c in ";|&":
            flush()
            while i < n and line[i] in ";|&":
                i += 1
            continue
        cur.append(c)
        i += 1
    flush()
    return cmds


def _sbatch_env(text: str) -> dict[str, str]:
    """The SLURM_* values that a job gets from the script's ``#SBATCH`` directives."""
    out: dict[str, str] = {}
    nodes = per_node = ntasks = gpus_per_node = None
    for raw in text.splitlines():
        s = raw.strip()
        if not s.startswith("#SBATCH"):
            continue
        try:
            toks = shlex.split(s[len("#SBATCH"):], comments=True)
        except ValueError:
            continue
        i = 0
        while i < len(toks):
            t = toks[i]
            opt, val = (t.split("=", 1) + [None])[:2] if t.startswith("--") else (t[:2], t[2:] or None)
            if val is None and i + 1 < len(toks) and not toks[i + 1].startswith("-"):
                val = toks[i + 1]
                i += 1
            i += 1
            if opt in ("-N", "--nodes"):
                nodes = str(val).split("-")[-1]
            elif opt == "--ntasks-per-node":
                per_node = val
            elif opt in ("-n", "--ntasks"):
                ntasks = val
            elif opt == "--gpus-per-node":
                gpus_per_node = str(val).split(":")[-1]
    if nodes:
        out["SLURM_NNODES"] = out["SLURM_JOB_NUM_NODES"] = str(nodes)
    if per_node:
        out["SLURM_NTASKS_PER_NODE"] = str(per_node)
    if ntasks:
        out["SLURM_NTASKS"] = out["SLURM_NPROCS"] = str(ntasks)
    elif nodes and per_node and str(nodes).isdigit() and str(per_node).isdigit():
        out["SLURM_NTASKS"] = out["SLURM_NPROCS"] = str(int(nodes) * int(per_node))
    if gpus_per_node:
        out["SLURM_GPUS_PER_NODE"] = str(gpus_per_node)
    return out


# --------------------------------------------------------------------------------------------------
# Finding the launch line
# --------------------------------------------------------------------------------------------------
def _base(tok: str) -> str:
    return tok.rsplit("/", 1)[-1]


def _command_word(toks: Sequence[str]) -> tuple[str, list[str]]:
    """The program a simple command runs (after assignments, ``env``, ``exec`` ...) and the rest."""
    i = 0
    while i < len(toks):
        t = toks[i]
        if _ASSIGN_TOKEN.match(t):
            i += 1
            continue
        b = _base(t)
        if b == "env":
            i += 1
            while i < len(toks) and toks[i].startswith("-"):
                i += 2 if toks[i] in ("-u", "--unset", "-C", "--chdir", "-S") else 1
            continue
        if b in _TRANSPARENT:
            i += 1
            while i < len(toks) and toks[i].startswith("-"):
                i += 1
            if b in ("timeout", "taskset") and i < len(toks):
                i += 1  # the duration / the CPU mask
            continue
        return b, list(toks[i + 1:])
    return "", []


def _launch_kind(toks: Sequence[str]) -> str | None:
    """'distributed' (torchrun, srun, mpirun, python -m torch.distributed.*), 'python' (python x.py,
    x.py), 'shell' (bash -c "..."), 'unsupported', or None (not a launch line)."""
    word, rest = _command_word(toks)
    if word in _LAUNCHERS or word in ("srun", "mpirun", "mpiexec"):
        return "distributed"
    if word == "numactl":
        return "distributed" if any(_base(t) in _LAUNCHERS or _base(t).startswith("python") for t in rest) else None
    if word.startswith("python") and re.fullmatch(r"python[0-9.]*", word):
        if "-c" in rest[:3]:
            return None
        if any(t in _DISTRIBUTED_MODULES for t in rest[:4]):
            return "distributed"
        j = 0
        while j < len(rest) and rest[j].startswith("-") and rest[j] != "-m":
            j += 2 if rest[j] in _PYTHON_VALUE_OPTS else 1
        if j < len(rest) and (rest[j] == "-m" or rest[j].endswith(".py")):
            if rest[j] == "-m" and j + 1 < len(rest) and (rest[j + 1] in ("pip", "venv", "ensurepip", "site")
                                                         or rest[j + 1].startswith("megatron_memguard")):
                return None
            return "python"
        return None
    if word.endswith(".py"):
        return "python"
    if word in ("bash", "sh") and "-c" in rest[:2]:
        inner = rest[rest.index("-c") + 1] if rest.index("-c") + 1 < len(rest) else ""
        try:
            return "shell" if any(_launch_kind(words(c, {}))
                                  for line in _logical_lines(inner) for c in _simple_commands(line)) else None
        except (ValueError, ReaderError):
            return None
    if word in _UNSUPPORTED:
        return "unsupported"
    return None


def parse_launch_script(text: str, environ: Mapping[str, str] | None = None) -> LaunchCommand:
    """Parse a command line or a shell script holding one launch command."""
    vars: dict[str, object] = dict(environ or {})
    sbatch = _sbatch_env(text)
    sbatch_used = {k: v for k, v in sbatch.items() if k not in vars}
    vars.update(sbatch_used)
    env_assigned: dict[str, str] = {}
    exported_env: dict[str, str] = {}
    found: list[tuple[str, list[str]]] = []
    skipped_python: list[str] = []
    for line in _logical_lines(text):
        m = _ASSIGN.match(line)
        if m and m.group(2).strip().startswith("("):
            # bash array: NAME=( items ... )
            value = m.group(2).strip()
            if value.endswith(")"):
                try:
                    vars[m.group(1)] = words(value[1:-1], vars)
                except ValueError as e:
                    raise ReaderError(f"cannot parse the array {m.group(1)}: {e}") from None
                continue
        for cmd in _simple_commands(line):
            try:
                toks = words(cmd, vars)   # one expansion, as bash: an expanded value is not expanded again
            except ValueError as e:
                raise ReaderError(f"cannot parse line {cmd!r}: {e}") from None
            if not toks:
                continue
            if toks[0] in ("export", "declare", "local", "readonly", "typeset"):
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
            kind = _launch_kind(toks)
            if kind is not None:
                found.append((kind, toks))
    launches = [f for f in found if f[0] != "python"] or [f for f in found if f[0] == "python"]
    if found and len(launches) < len(found):
        skipped_python = [" ".join(t[:3]) for k, t in found if k == "python"]
    if not launches:
        raise ReaderError("no launch command found (expected torchrun, python -m torch.distributed.run, srun, mpirun "
                          "or python SCRIPT.py)")
    if len(launches) > 1:
        shown = "; ".join(" ".join(t[:4]) + " ..." for _, t in launches[:3])
        raise ReaderError(f"found {len(launches)} launch commands ({shown}); give memguard the one to check")
    kind, toks = launches[0]
    if kind == "unsupported":
        word, _ = _command_word(toks)
        raise ReaderError(f"cannot understand the launcher {word!r} ({_UNSUPPORTED[word]}); memguard reads torchrun, "
                          "python -m torch.distributed.run, srun, mpirun and python SCRIPT.py commands")
    shell_vars = {k: str(v) for k, v in vars.items() if not isinstance(v, list)}
    cmd = parse_launch_tokens(toks, {**shell_vars, **env_assigned})
    notes = list(cmd.notes)
    if skipped_python:
        notes.append("the script also runs " + ", ".join(skipped_python) + " ...; checked the distributed launch")
    if sbatch_used and any(k in cmd.world_size_from for k in sbatch_used):
        notes.append("SLURM values from the script's #SBATCH directives: " +
                     ", ".join(f"{k}={v}" for k, v in sorted(sbatch_used.items()) if k in ("SLURM_NNODES", "SLURM_NTASKS_PER_NODE", "SLURM_NTASKS")))
    # the job's environment: what the script exports, then the command's own VAR=value prefix
    return LaunchCommand(launcher=cmd.launcher, script=cmd.script, script_args=cmd.script_args,
                         env={**exported_env, **cmd.env}, nnodes=cmd.nnodes, nproc_per_node=cmd.nproc_per_node,
                         world_size=cmd.world_size, notes=notes, world_size_from=cmd.world_size_from,
                         wrappers=cmd.wrappers, module=cmd.module)


def parse_launch_command(command: str | Sequence[str], environ: Mapping[str, str] | None = None) -> LaunchCommand:
    """A launch command given as one string (a command line or a whole script) or as argv tokens (as
    a shell has already split and expanded them: ``memguard check -- torchrun ...``)."""
    if isinstance(command, str):
        return parse_launch_script(command, environ)
    toks = list(command)
    if not toks:
        raise ReaderError("no launch command given")
    if len(toks) == 1 and re.search(r"\s", toks[0]):
        return parse_launch_script(toks[0], environ)
    kind = _launch_kind(toks)
    if kind == "unsupported":
        word, _ = _command_word(toks)
        raise ReaderError(f"cannot understand the launcher {word!r} ({_UNSUPPORTED[word]}); memguard reads torchrun, "
                          "python -m torch.distributed.run, srun, mpirun and python SCRIPT.py commands")
    # The caller's shell has expanded the words already; what is left of $VAR was quoted on purpose.
    try:
        toks = [expand_word(t, environ or {}) if "$" in t else t for t in toks]
    except ValueError as e:
        raise ReaderError(str(e)) from None
    return parse_launch_tokens(toks, environ)


# --------------------------------------------------------------------------------------------------
# One launch command
# --------------------------------------------------------------------------------------------------
def _int(val: object, opt: str) -> int:
    try:
        return int(str(val))
    except (TypeError, ValueError):
        if isinstance(val, str) and val.startswith(("$", "`")):
            raise ReaderError(f"launcher option {opt} is {val!r}, which memguard cannot evaluate (an unset variable or "
                              "a command substitution); set the variable in the environment or give --world-size") from None
        raise ReaderError(f"launcher option {opt} expects a number, got {val!r}") from None


def _env_int(env: Mapping[str, str], name: str) -> int | None:
    v = env.get(name)
    if v is None:
        return None
    m = re.match(r"^\d+", str(v))
    return int(m.group(0)) if m else None


def _looks_like_program(tok: str) -> bool:
    b = _base(tok)
    return (b in _LAUNCHERS or b in _WRAPPERS or b in _TRANSPARENT or b in ("env", "bash", "sh") or b.endswith(".py")
            or bool(re.fullmatch(r"python[0-9.]*", b)) or "/" in tok and not tok.startswith("-") and "=" not in tok)


@dataclass
class _Srun:
    name: str
    tasks: int | None = None
    nodes: int | None = None
    per_node: int | None = None


def _srun_opts(toks: list[str], i: int, notes: list[str], name: str) -> tuple[_Srun, int]:
    s = _Srun(name)
    while i < len(toks) and toks[i].startswith("-") and toks[i] != "--":
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


def _mpi_opts(toks: list[str], i: int, notes: list[str], name: str) -> tuple[_Srun, int]:
    s = _Srun(name)
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


def _torchrun_opts(rest: list[str], notes: list[str], who: str) -> tuple[dict[str, str], list[str]]:
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


def parse_launch_tokens(toks: list[str], environ: Mapping[str, str] | None = None) -> LaunchCommand:
    environ = dict(environ or {})
    env: dict[str, str] = {}
    notes: list[str] = []
    wrappers: list[str] = []
    outer: _Srun | None = None
    i = 0
    while True:
        # VAR=value prefixes, `env`, exec / time / nohup ...
        while i < len(toks):
            t = toks[i]
            m = re.match(r"^([A-Za-z_][A-Za-z0-9_]*)=(.*)$", t, re.S)
            if m:
                env[m.group(1)] = m.group(2)
                i += 1
                continue
            b = _base(t)
            if b == "env":
                i += 1
                while i < len(toks) and toks[i].startswith("-"):
                    if toks[i] in ("-u", "--unset"):
                        env.pop(toks[i + 1] if i + 1 < len(toks) else "", None)
                        i += 2
                    else:
                        i += 2 if toks[i] in ("-C", "--chdir", "-S") else 1
                continue
            if b in _TRANSPARENT:
                i += 1
                while i < len(toks) and toks[i].startswith("-"):
                    i += 2 if toks[i] in ("-n", "-c", "-s", "-k", "-o", "-e", "-i") and b != "time" else 1
                if b in ("timeout", "taskset") and i < len(toks):
                    i += 1
                continue
            break
        if i >= len(toks):
            raise ReaderError("the launch command has no program to run")
        b = _base(toks[i])
        if b == "srun":
            if outer is not None:
                raise ReaderError("srun inside srun: give memguard the inner command")
            outer, i = _srun_opts(toks, i + 1, notes, "srun")
            wrappers.append("srun")
            continue
        if b in ("mpirun", "mpiexec"):
            if outer is not None:
                raise ReaderError(f"{b} inside {outer.name}: give memguard the inner command")
            outer, i = _mpi_opts(toks, i + 1, notes, b)
            wrappers.append(b)
            continue
        if b == "numactl":
            i += 1
            while i < len(toks) and toks[i].startswith("-"):
                opt = toks[i].split("=", 1)[0]
                i += 2 if opt in _NUMACTL_VALUE_OPTS and "=" not in toks[i] and len(toks[i]) <= len(opt) else 1
            wrappers.append("numactl")
            continue
        break
    environ.update(env)
    prog = _base(toks[i])
    rest = toks[i + 1:]

    if prog in ("bash", "sh"):
        if "-c" not in rest[:2]:
            raise ReaderError(f"cannot understand {prog} {' '.join(rest[:1])}: memguard reads the command a job runs, "
                              f"not another script it calls (give memguard that script with --file)")
        k = rest.index("-c")
        if k + 1 >= len(rest):
            raise ReaderError(f"{prog} -c without a command")
        inner = parse_launch_script(rest[k + 1], environ)
        notes.extend(inner.notes)
        return _finish(inner.launcher, inner.script, inner.script_args, {**env, **inner.env}, inner.nnodes,
                       inner.nproc_per_node, outer, environ, notes, wrappers + [f"{prog} -c"] + list(inner.wrappers),
                       inner.module, inner_world=(inner.world_size, inner.world_size_from))

    launcher = "python"
    topts: dict[str, str] | None = None
    module = False
    if prog in _LAUNCHERS:
        launcher = prog
        topts, rest = _torchrun_opts(rest, notes, prog)
        module = "-m" in topts or "--module" in topts
    elif re.fullmatch(r"python[0-9.]*", prog):
        j = 0
        while j < len(rest) and rest[j].startswith("-") and rest[j] != "-m":
            if rest[j] == "-c":
                raise ReaderError("python -c runs inline code, not a training script; memguard cannot read it")
            j += 2 if rest[j] in _PYTHON_VALUE_OPTS else 1
        if j + 1 < len(rest) and rest[j] == "-m" and rest[j + 1] in _DISTRIBUTED_MODULES:
            launcher = rest[j + 1]
            topts, rest = _torchrun_opts(rest[j + 2:], notes, launcher)
            module = "-m" in topts or "--module" in topts
        else:
            rest = rest[j:]
            if rest[:1] == ["-m"]:
                module = True
                rest = rest[1:]
    elif prog.endswith(".py"):
        rest = toks[i:]
    elif prog in _UNSUPPORTED:
        raise ReaderError(f"cannot understand the launcher {toks[i]!r} ({_UNSUPPORTED[prog]}); memguard reads torchrun, "
                          "python -m torch.distributed.run, srun, mpirun and python SCRIPT.py commands")
    else:
        raise ReaderError(f"cannot understand the launcher {toks[i]!r}; memguard reads torchrun, "
                          "python -m torch.distributed.run, srun, mpirun and python SCRIPT.py commands")
    if not rest:
        raise ReaderError("the launch command names no training script")
    script, args = rest[0], rest[1:]
    if topts is not None and "--no-python" in topts and not script.endswith(".py"):
        raise ReaderError(f"{launcher} --no-python runs {script!r}, not a Python training script; memguard cannot read it")

    nnodes = nproc = None
    if topts is not None:
        nnodes, nproc = _torchrun_world(topts, environ, notes, launcher, outer)
    return _finish(launcher, script, args, env, nnodes, nproc, outer, environ, notes, wrappers, module)


def _torchrun_world(opts: Mapping[str, str], environ: Mapping[str, str], notes: list[str], who: str,
                    outer: _Srun | None) -> tuple[int, int]:
    # --nproc-per-node (PET_NPROC_PER_NODE, default 1); "gpu"/"auto" need the node's GPU count.
    val = opts.get("--nproc-per-node")
    src = "--nproc-per-node"
    if val is None and environ.get("PET_NPROC_PER_NODE"):
        val, src = environ["PET_NPROC_PER_NODE"], "PET_NPROC_PER_NODE"
    if val is None:
        nproc = 1
        notes.append(f"{who} without --nproc-per-node starts 1 process per node (its default)")
    elif str(val) in ("gpu", "auto", "cuda", "xpu"):
        g = _env_int(environ, "SLURM_GPUS_ON_NODE") or _env_int(environ, "SLURM_GPUS_PER_NODE")
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
                nn = _env_int(environ, name)
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


def _finish(launcher, script, args, env, nnodes, nproc, outer: _Srun | None, environ, notes, wrappers, module,
            inner_world: tuple[int | None, str] | None = None) -> LaunchCommand:
    world: int | None = None
    src = ""
    if nnodes is not None and nproc is not None:
        world, src = nnodes * nproc, f"{launcher} --nnodes {nnodes} x --nproc-per-node {nproc}"
    elif inner_world is not None and inner_world[0] is not None and inner_world[1] and not inner_world[1].startswith("WORLD_SIZE"):
        world, src = inner_world
    elif outer is not None:
        world, src = _outer_world(outer, environ)
    else:
        w = _env_int(environ, "WORLD_SIZE")
        if w:
            world, src = w, "WORLD_SIZE"
    return LaunchCommand(launcher=launcher if outer is None or nnodes is not None else outer.name, script=script,
                         script_args=list(args), env=env, nnodes=nnodes, nproc_per_node=nproc, world_size=world,
                         notes=notes, world_size_from=src, wrappers=tuple(wrappers), module=module)


def _outer_world(s: _Srun, environ: Mapping[str, str]) -> tuple[int | None, str]:
    if s.tasks is not None:
        return s.tasks, f"{s.name} --ntasks {s.tasks}" if s.name == "srun" else f"{s.name} -np {s.tasks}"
    nodes, nsrc = s.nodes, "--nodes"
    if nodes is None:
        for name in ("SLURM_NNODES", "SLURM_JOB_NUM_NODES"):
            nodes = _env_int(environ, name)
            if nodes:
                nsrc = name
                break
    per, psrc = s.per_node, "--ntasks-per-node"
    if per is None and s.name == "srun":
        per, psrc = _env_int(environ, "SLURM_NTASKS_PER_NODE"), "SLURM_NTASKS_PER_NODE"
    if nodes and per:
        return nodes * per, f"{s.name} {nsrc} {nodes} x {psrc} {per}"
    if s.name == "srun":
        for name in ("SLURM_NTASKS", "SLURM_NPROCS"):
            t = _env_int(environ, name)
            if t:
                return t, name
        if nodes and s.per_node is None:
            return None, ""
    return None, ""


# --------------------------------------------------------------------------------------------------
# What the training script is given
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ScriptArgs:
    """A training script's arguments, sorted by kind.

    ``kind``: ``megatron`` (Megatron-LM flags: pretrain_gpt.py and friends), ``hydra`` (NeMo 1 scripts:
    ``--config-path`` / ``--config-name`` and Hydra overrides), ``bridge`` (Megatron-Bridge recipe
    scripts: ``--config-file`` and/or ``--recipe``, ``KEY=VALUE`` overrides)."""

    kind: str
    flags: list[str] = field(default_factory=list)         # Megatron flags
    config_file: str | None = None                          # Bridge --config-file
    config_path: str | None = None                          # Hydra --config-path / --config-dir
    config_name: str | None = None                          # Hydra --config-name
    recipe: str | None = None                               # Bridge --recipe
    overrides: list[str] = field(default_factory=list)      # KEY=VALUE
    ignored: list[str] = field(default_factory=list)        # script options memguard does not read
    unreadable: list[str] = field(default_factory=list)     # script options that change memory but memguard cannot read


_HYDRA_OPTS = {"--config-path": "config_path", "-cp": "config_path", "--config-dir": "config_path", "-cd": "config_path",
               "--config-name": "config_name", "-cn": "config_name"}
_BRIDGE_OPTS = {"--config-file": "config_file", "--config_file": "config_file", "--config": "config_file",
                "--recipe": "recipe"}
# Megatron-Bridge run_recipe.py shortcuts for parallel sizes and batch: they change memory, but
# memguard does not take their meaning on trust: the user writes the override instead.
_BRIDGE_SHORTCUTS = {"-tp": "model.tensor_model_parallel_size", "-pp": "model.pipeline_model_parallel_size",
                     "-cp": "model.context_parallel_size", "-vp": "model.virtual_pipeline_model_parallel_size",
                     "-ep": "model.expert_model_parallel_size", "-etp": "model.expert_tensor_parallel_size",
                     "-mb": "train.micro_batch_size", "-gb": "train.global_batch_size", "-sl": "model.seq_length"}
_HYDRA_FLAGS = ("--multirun", "-m", "--cfg", "-c", "--resolve", "--info", "-i", "--shell-completion", "-sc", "--help",
                "-h", "--hydra-help", "--version")


def split_script_args(cmd: LaunchCommand) -> ScriptArgs:
    """Sort the training script's arguments: Megatron flags, or a NeMo 1 (Hydra) / Megatron-Bridge
    config file with ``KEY=VALUE`` overrides."""
    from ._common import is_override_token

    args = list(cmd.script_args)
    found: dict[str, str] = {}
    overrides: list[str] = []
    rest: list[str] = []
    # -cp is Hydra's --config-path, but run_recipe.py's context-parallel shortcut in a Bridge launch.
    bridge = any(t.split("=", 1)[0] in _BRIDGE_OPTS for t in args)
    i = 0
    while i < len(args):
        t = args[i]
        opt, val = (t.split("=", 1) + [None])[:2] if t.startswith("-") else (t, None)
        if (opt in _HYDRA_OPTS or opt in _BRIDGE_OPTS) and not (bridge and opt in _BRIDGE_SHORTCUTS):
            if val is None:
                if i + 1 >= len(args):
                    raise ReaderError(f"{cmd.script} option {opt} expects a value")
                val = args[i + 1]
                i += 1
            found[(_HYDRA_OPTS.get(opt) or _BRIDGE_OPTS[opt])] = val
            found.setdefault("_kind", "hydra" if opt in _HYDRA_OPTS else "bridge")
        elif is_override_token(t):
            overrides.append(t)
        else:
            rest.append(t)
        i += 1
    kind = found.get("_kind")
    if kind is None and overrides and not any(t.startswith("--") for t in rest):
        # bare KEY=VALUE overrides: NeMo 1 (trainer. / model. keys) or Bridge sections
        keys = {o.lstrip("+~").split(".", 1)[0] for o in overrides}
        kind = "hydra" if "trainer" in keys else "bridge"
    if kind is None:
        return ScriptArgs(kind="megatron", flags=args)
    ignored: list[str] = []
    unreadable: list[str] = []
    j = 0
    while j < len(rest):
        t = rest[j]
        opt = t.split("=", 1)[0]
        if kind == "bridge" and opt in _BRIDGE_SHORTCUTS:
            val = t.split("=", 1)[1] if "=" in t else (rest[j + 1] if j + 1 < len(rest) else "")
            unreadable.append(f"{opt} {val}".strip() + f" (write {_BRIDGE_SHORTCUTS[opt]}={val or 'N'})")
            j += 1 if "=" in t else 2
            continue
        if kind == "hydra" and t in _HYDRA_FLAGS:
            if t in ("--multirun", "-m"):
                unreadable.append(f"{t} (a Hydra sweep launches several jobs; check each one)")
            ignored.append(t)
            j += 1
            continue
        ignored.append(t)
        j += 1
    recipe = found.get("recipe")
    return ScriptArgs(kind=kind, config_file=found.get("config_file"), config_path=found.get("config_path"),
                      config_name=found.get("config_name"), recipe=recipe, overrides=overrides, ignored=ignored,
                      unreadable=unreadable)


_HYDRA_DECORATOR = re.compile(r"@(?:hydra_runner|hydra\.main|main)\s*\(([^)]*)\)", re.S)


def hydra_defaults(script_path: str) -> tuple[str | None, str | None]:
    """(config_path, config_name) of a script's ``@hydra_runner(...)`` / ``@hydra.main(...)`` decorator,
    if the script can be read (None where it cannot)."""
    from ..files import read_text
    try:
        text = read_text(script_path)
    except ReaderError:
        return None, None
    m = _HYDRA_DECORATOR.search(text)
    if not m:
        return None, None

    def kw(name: str) -> str | None:
        k = re.search(rf"{name}\s*=\s*(['\"])(.*?)\1", m.group(1))
        return k.group(2) if k else None
    return kw("config_path"), kw("config_name")


def hydra_config_file(sa: ScriptArgs, script: str, cwd: str | None = None) -> str:
    """The YAML file a Hydra (NeMo 1) launch reads: ``--config-path`` (relative to the script's
    directory, as Hydra resolves it, else to the working directory) / ``--config-name``, with the
    script's decorator defaults where an option is missing."""
    cwd = cwd or os.getcwd()
    script_path = script if os.path.isabs(script) else os.path.join(cwd, script)
    dflt_path, dflt_name = (None, None)
    if sa.config_path is None or sa.config_name is None:
        dflt_path, dflt_name = hydra_defaults(script_path)
    cpath = sa.config_path if sa.config_path is not None else dflt_path
    cname = sa.config_name if sa.config_name is not None else dflt_name
    if cname is None or cpath is None:
        missing = " and ".join(x for x, v in (("--config-path", cpath), ("--config-name", cname)) if v is None)
        raise ReaderError(f"{script}: the launch gives no {missing} and memguard cannot read the script's @hydra_runner "
                          f"default ({script_path} is not readable here); add {missing} to the command")
    if not cname.endswith((".yaml", ".yml")):
        cname += ".yaml"
    cands = [os.path.join(cpath, cname)] if os.path.isabs(cpath) else [
        os.path.join(os.path.dirname(script_path), cpath, cname), os.path.join(cwd, cpath, cname)]
    for c in cands:
        if os.path.exists(c):
            return c
    dirs = dict.fromkeys(os.path.dirname(c) for c in cands)
    raise ReaderError(f"{script}: the Hydra config {cname} is not in {' nor '.join(dirs)}")
