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

import re
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from ..errors import ReaderError
from .launchers import (
    DISTRIBUTED_MODULES, LAUNCHERS, NUMACTL_VALUE_OPTS, PYTHON_VALUE_OPTS, TRANSPARENT, UNSUPPORTED, OuterOpts, env_int,
    mpi_opts, outer_world, program_base, srun_opts, torchrun_opts, torchrun_world,
)
from .script_args import ScriptArgs, hydra_config_file, hydra_defaults, split_script_args  # noqa: F401 (re-exported)
from .shell import expand_word, logical_lines, sbatch_env, simple_commands, words

_ASSIGN_TOKEN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\+?=")
_ASSIGN = re.compile(r"^(?:export\s+|declare\s+(?:-a\s+)?|local\s+)?([A-Za-z_][A-Za-z0-9_]*)(\+?)=(.*)$", re.S)


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
    # the command substitutions / arithmetic expansions memguard kept as written, with the line each is written on
    kept: dict[str, int] = field(default_factory=dict)


# --------------------------------------------------------------------------------------------------
# Finding the launch line
# --------------------------------------------------------------------------------------------------
def _command_word(toks: Sequence[str]) -> tuple[str, list[str]]:
    """The program a simple command runs (after assignments, ``env``, ``exec`` ...) and the rest."""
    i = 0
    while i < len(toks):
        t = toks[i]
        if _ASSIGN_TOKEN.match(t):
            i += 1
            continue
        b = program_base(t)
        if b == "env":
            i += 1
            while i < len(toks) and toks[i].startswith("-"):
                i += 2 if toks[i] in ("-u", "--unset", "-C", "--chdir", "-S") else 1
            continue
        if b in TRANSPARENT:
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
    if word in LAUNCHERS or word in ("srun", "mpirun", "mpiexec"):
        return "distributed"
    if word == "numactl":
        return "distributed" if any(program_base(t) in LAUNCHERS or program_base(t).startswith("python") for t in rest) else None
    if word.startswith("python") and re.fullmatch(r"python[0-9.]*", word):
        if "-c" in rest[:3]:
            return None
        if any(t in DISTRIBUTED_MODULES for t in rest[:4]):
            return "distributed"
        j = 0
        while j < len(rest) and rest[j].startswith("-") and rest[j] != "-m":
            j += 2 if rest[j] in PYTHON_VALUE_OPTS else 1
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
                                  for line in logical_lines(inner) for c in simple_commands(line)) else None
        except (ValueError, ReaderError):
            return None
    if word in UNSUPPORTED:
        return "unsupported"
    return None


def _assigned(token: str, vars: Mapping[str, object]) -> tuple[str, str | list[str]]:
    """(name, value) of ``NAME=value``, or of ``NAME+=value`` appended to the variable's value as bash does (an
    array's element 0)."""
    name, value = token.split("=", 1)
    if not name.endswith("+"):
        return name, value
    name = name[:-1]
    old = vars.get(name)
    if isinstance(old, list):
        return name, [(old[0] if old else "") + value, *old[1:]]
    return name, ("" if old is None else str(old)) + value


_FUNCTION = re.compile(r"^(?:function\s+([A-Za-z_][\w-]*)\s*(?:\(\s*\))?|([A-Za-z_][\w-]*)\s*\(\s*\))\s*\{(.*)$", re.S)
_BACKSLASH_SPACE = re.compile(r"(?<!\\)\\[ \t]+\r?$")
MAX_CALLS = 16      # nested function calls / evals (a recursive function would never end in bash)


@dataclass
class _Run:
    """What reading a script has gathered so far: its variables (positional parameters under "@"), the environment it
    exports, its functions, the launch-line candidates (kind, words, line, the script arguments they use)."""
    vars: dict
    env_assigned: dict = field(default_factory=dict)
    exported_env: dict = field(default_factory=dict)
    found: list = field(default_factory=list)
    functions: dict = field(default_factory=dict)
    sourced: list = field(default_factory=list)
    calls: int = 0          # function calls and evals so far
    kept: dict = field(default_factory=dict)   # $(...) / `...` / $((...)) kept as written -> the line written on
    depth: int = 0          # nested ones now


def _numbered(text: str) -> list[tuple[int, str]]:
    """Each logical line with the number of the physical line it starts on."""
    starts: list[int] = []
    lines = logical_lines(text, starts)
    return list(zip(starts, lines))


def _function_body(lines: list[tuple[int, str]], k: int, rest: str) -> tuple[list[tuple[int, str]], int]:
    """The body of a function whose ``{`` opened on lines[k] (``rest``: what follows it there) and the index after it."""
    n = lines[k][0]
    if rest.rstrip().endswith("}"):
        return [(n, rest.rstrip()[:-1])], k + 1           # name() { ...; } on one line
    body = [(n, rest)] if rest.strip() else []
    depth, j = 1, k + 1
    while j < len(lines):
        num, line = lines[j]
        depth += len(re.findall(r"(?:^|\s)\{(?:\s|$)", line)) - (line.strip() == "}" or line.rstrip().endswith(" }")
                                                                 or line.rstrip().endswith(";}"))
        if depth <= 0:
            tail = line.rstrip()[:-1].rstrip()
            if tail:
                body.append((num, tail))
            return body, j + 1
        body.append((num, line))
        j += 1
    raise ReaderError(f"line {n}: the function's '{{' is never closed by a '}}'")


def _run_lines(lines: list[tuple[int, str]], st: _Run) -> None:
    """Read ``lines`` as bash runs them, gathering variables, functions and launch-line candidates into ``st``."""
    k = 0
    while k < len(lines):
        num, line = lines[k]
        k += 1
        fm = _FUNCTION.match(line)
        if fm:
            body, k = _function_body(lines, k - 1, fm.group(3))
            st.functions[fm.group(1) or fm.group(2)] = (num, body)
            continue
        m = _ASSIGN.match(line)
        if m and m.group(3).strip().startswith("("):
            # bash array: NAME=( items ... ), or NAME+=( items ... ) appending to it (a scalar is its element 0)
            value = m.group(3).strip()
            if value.endswith(")"):
                kept: list[str] = []
                try:
                    items = words(value[1:-1], st.vars, kept=kept)
                    st.kept.update(dict.fromkeys(kept, num))
                except ValueError as e:
                    raise ReaderError(f"line {num}: cannot parse the array {m.group(1)}: {e}") from None
                old = st.vars.get(m.group(1)) if m.group(2) else None
                st.vars[m.group(1)] = (old if isinstance(old, list) else [] if old is None else [str(old)]) + items
                continue
        for cmd in simple_commands(line):
            unknown: list[str] = []
            kept: list[str] = []
            try:
                toks = words(cmd, st.vars, unknown, kept)   # one expansion, as bash: an expanded value is not expanded again
            except ValueError as e:
                raise ReaderError(f"line {num}: cannot parse {cmd!r}: {e}") from None
            st.kept.update(dict.fromkeys(kept, num))    # (written again later: the later line, nearer the launch)
            if not toks:
                continue
            if toks[0] in ("export", "declare", "local", "readonly", "typeset"):
                exported = toks[0] == "export"
                names = [t for t in toks[1:] if not t.startswith("-")]
                if all(_ASSIGN_TOKEN.match(t) or _NAME_TOKEN.match(t) for t in names):
                    for t in names:
                        if not _ASSIGN_TOKEN.match(t):      # export NAME: the variable set before, exported
                            if exported and isinstance(st.vars.get(t), str):
                                st.exported_env[t] = st.vars[t]
                            continue
                        name, value = _assigned(t, st.vars)
                        st.vars[name] = value
                        if isinstance(value, str):
                            st.env_assigned[name] = value
                            if exported:
                                st.exported_env[name] = value
                    continue
            if all(_ASSIGN_TOKEN.match(t) for t in toks):
                # plain assignments (VAR=value ...): shell variables for later lines
                for t in toks:
                    name, value = _assigned(t, st.vars)
                    st.vars[name] = value
                    if isinstance(value, str):
                        st.env_assigned[name] = value
                continue
            if toks[0] == "set":
                if "--" in toks:       # set -- words: the positional parameters ("$@")
                    st.vars["@"] = toks[toks.index("--") + 1:]
                elif len(toks) > 1 and not toks[1].startswith(("-", "+")):
                    st.vars["@"] = toks[1:]
                continue
            if toks[0] == "shift":
                args = st.vars.get("@")
                count = toks[1] if len(toks) > 1 else "1"
                if isinstance(args, list) and count.isdigit() and int(count) <= len(args):
                    st.vars["@"] = args[int(count):]
                continue
            if toks[0] in ("source", "."):
                st.sourced.append(f"{toks[1] if len(toks) > 1 else 'nothing'} (line {num})")
                continue
            if toks[0] == "eval":
                # eval joins its words and reads them as a command line (bash(1), eval)
                _call(st, num, "eval", [(num, x) for x in logical_lines(" ".join(toks[1:]))], None)
                continue
            if toks[0] in st.functions:
                _, body = st.functions[toks[0]]
                # (a call passing the script's own "$@" gives the function arguments memguard does not know either)
                _call(st, num, toks[0], body, None if unknown else toks[1:], unknown_args=bool(unknown))
                continue
            kind = _launch_kind(toks)
            if kind is not None:
                st.found.append((kind, toks, num, sorted(set(unknown))))


def _call(st: _Run, num: int, what: str, body: list[tuple[int, str]], args: list[str] | None,
          unknown_args: bool = False) -> None:
    """Run ``body`` (a function's, with ``args`` as its positional parameters, or an eval's text)."""
    st.calls += 1
    if st.calls > MAX_CALLS * 64:
        raise ReaderError(f"line {num}: more than {MAX_CALLS * 64} function calls / evals; memguard stops there")
    if st.depth >= MAX_CALLS:
        raise ReaderError(f"line {num}: {what} nests calls deeper than {MAX_CALLS} levels (a function that calls itself "
                          "never ends in bash)")
    saved = st.vars.get("@", _NO_ARGS)
    if args is not None:
        st.vars["@"] = list(args)
    elif unknown_args:
        st.vars.pop("@", None)
    st.depth += 1
    try:
        _run_lines(body, st)
    finally:
        st.depth -= 1
        if args is not None or unknown_args:
            if saved is _NO_ARGS:
                st.vars.pop("@", None)
            else:
                st.vars["@"] = saved


_NO_ARGS = object()
_NAME_TOKEN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def parse_launch_script(text: str, environ: Mapping[str, str] | None = None) -> LaunchCommand:
    """Parse a command line or a shell script holding one launch command."""
    vars: dict[str, object] = dict(environ or {})
    vars.pop("@", None)      # (not an environment variable: the positional parameters)
    sbatch = sbatch_env(text)
    sbatch_used = {k: v for k, v in sbatch.items() if k not in vars}
    vars.update(sbatch_used)
    st = _Run(vars=vars)
    lines = _numbered(text)
    _run_lines(lines, st)
    env_assigned, exported_env, skipped_python = st.env_assigned, st.exported_env, []
    found = [(kind, toks) for kind, toks, _, _ in st.found]
    where = {id(toks): (num, unknown) for _, toks, num, unknown in st.found}
    launches = [f for f in found if f[0] != "python"] or [f for f in found if f[0] == "python"]
    if found and len(launches) < len(found):
        skipped_python = [" ".join(t[:3]) for k, t in found if k == "python"]
    if not launches:
        held = [f"{name} (line {num})" for name, (num, body) in st.functions.items()
                if any(_launch_kind(_safe_words(line)) for _, line in body)]
        raise ReaderError("no launch command found (expected torchrun, python -m torch.distributed.run, srun, mpirun "
                          "or python SCRIPT.py)" + (f"; the function {held[0]} holds one but the script never calls it"
                                                    if held else ""))
    if len(launches) > 1:
        shown = "; ".join(" ".join(t[:4]) + " ..." for _, t in launches[:3])
        raise ReaderError(f"found {len(launches)} launch commands ({shown}); give memguard the one to check")
    kind, toks = launches[0]
    num, unknown = where[id(toks)]
    if unknown:
        raise ReaderError(f"line {num}: {unknown[0]} is the script's own arguments, which memguard does not know (bash "
                          "passes the words the script is run with); write them into the script with set -- WORDS, or "
                          "give memguard the launch command itself")
    nxt = min((n for n, _ in lines if n > num), default=text.count("\n") + 2)
    cut = [i + 1 for i, raw in enumerate(text.split("\n")[num - 1:nxt - 1], start=num - 1) if _BACKSLASH_SPACE.search(raw)]
    if cut:
        raise ReaderError(f"line {cut[0]}: the backslash is followed by spaces, so it does not continue the line: bash "
                          "ends the launch command there and runs the next line as a command of its own; remove the "
                          "spaces after the backslash")
    if kind == "unsupported":
        word, _ = _command_word(toks)
        raise ReaderError(f"cannot understand the launcher {word!r} ({UNSUPPORTED[word]}); memguard reads torchrun, "
                          "python -m torch.distributed.run, srun, mpirun and python SCRIPT.py commands")
    shell_vars = {k: str(v) for k, v in vars.items() if not isinstance(v, list)}
    try:
        cmd = parse_launch_tokens(toks, {**shell_vars, **env_assigned})
    except ReaderError as e:     # (a launcher option it cannot read: the line it is on)
        raise ReaderError(str(e) if str(e).startswith("line ") else f"line {num}: {e}") from None
    notes = list(cmd.notes)
    if skipped_python:
        notes.append("the script also runs " + ", ".join(skipped_python) + " ...; checked the distributed launch")
    if st.sourced:
        notes.append(f"the script sources {st.sourced[0]}, which memguard does not read: a variable it sets is unknown "
                     "here (an unset $VAR is kept as written)")
    if sbatch_used and any(k in cmd.world_size_from for k in sbatch_used):
        notes.append("SLURM values from the script's #SBATCH directives: " +
                     ", ".join(f"{k}={v}" for k, v in sorted(sbatch_used.items()) if k in ("SLURM_NNODES", "SLURM_NTASKS_PER_NODE", "SLURM_NTASKS")))
    # the job's environment: what the script exports, then the command's own VAR=value prefix
    return LaunchCommand(launcher=cmd.launcher, script=cmd.script, script_args=cmd.script_args,
                         env={**exported_env, **cmd.env}, nnodes=cmd.nnodes, nproc_per_node=cmd.nproc_per_node,
                         world_size=cmd.world_size, notes=notes, world_size_from=cmd.world_size_from,
                         wrappers=cmd.wrappers, module=cmd.module, kept=_physical_lines(text, st.kept))


def _physical_lines(text: str, kept: Mapping[str, int]) -> dict[str, int]:
    """``kept`` with each construct's own line: where it is written in or after its logical line's first one (a
    continued launch line spans many); the first 1,000 (the others keep their logical line's)."""
    import bisect
    starts = [0] + [m.end() for m in re.finditer("\n", text)]
    out = dict(kept)
    for c, num in list(kept.items())[:1000]:
        k = text.find(c, starts[num - 1]) if 0 < num <= len(starts) else -1
        if k >= 0:
            out[c] = bisect.bisect_right(starts, k)
    return out


def _safe_words(line: str) -> list[str]:
    try:
        return words(line, {})
    except ValueError:
        return []


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
        raise ReaderError(f"cannot understand the launcher {word!r} ({UNSUPPORTED[word]}); memguard reads torchrun, "
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
def parse_launch_tokens(toks: list[str], environ: Mapping[str, str] | None = None) -> LaunchCommand:
    environ = dict(environ or {})
    env: dict[str, str] = {}
    notes: list[str] = []
    wrappers: list[str] = []
    outer: OuterOpts | None = None
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
            b = program_base(t)
            if b == "env":
                i += 1
                while i < len(toks) and toks[i].startswith("-"):
                    if toks[i] in ("-u", "--unset"):
                        env.pop(toks[i + 1] if i + 1 < len(toks) else "", None)
                        i += 2
                    else:
                        i += 2 if toks[i] in ("-C", "--chdir", "-S") else 1
                continue
            if b in TRANSPARENT:
                i += 1
                while i < len(toks) and toks[i].startswith("-"):
                    i += 2 if toks[i] in ("-n", "-c", "-s", "-k", "-o", "-e", "-i") and b != "time" else 1
                if b in ("timeout", "taskset") and i < len(toks):
                    i += 1
                continue
            break
        if i >= len(toks):
            raise ReaderError("the launch command has no program to run")
        b = program_base(toks[i])
        if b == "srun":
            if outer is not None:
                raise ReaderError("srun inside srun: give memguard the inner command")
            outer, i = srun_opts(toks, i + 1, notes, "srun")
            wrappers.append("srun")
            continue
        if b in ("mpirun", "mpiexec"):
            if outer is not None:
                raise ReaderError(f"{b} inside {outer.name}: give memguard the inner command")
            outer, i = mpi_opts(toks, i + 1, notes, b)
            wrappers.append(b)
            continue
        if b == "numactl":
            i += 1
            while i < len(toks) and toks[i].startswith("-"):
                opt = toks[i].split("=", 1)[0]
                i += 2 if opt in NUMACTL_VALUE_OPTS and "=" not in toks[i] and len(toks[i]) <= len(opt) else 1
            wrappers.append("numactl")
            continue
        break
    environ.update(env)
    prog = program_base(toks[i])
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
    if prog in LAUNCHERS:
        launcher = prog
        topts, rest = torchrun_opts(rest, notes, prog)
        module = "-m" in topts or "--module" in topts
    elif re.fullmatch(r"python[0-9.]*", prog):
        j = 0
        while j < len(rest) and rest[j].startswith("-") and rest[j] != "-m":
            if rest[j] == "-c":
                raise ReaderError("python -c runs inline code, not a training script; memguard cannot read it")
            j += 2 if rest[j] in PYTHON_VALUE_OPTS else 1
        if j + 1 < len(rest) and rest[j] == "-m" and rest[j + 1] in DISTRIBUTED_MODULES:
            launcher = rest[j + 1]
            topts, rest = torchrun_opts(rest[j + 2:], notes, launcher)
            module = "-m" in topts or "--module" in topts
        else:
            rest = rest[j:]
            if rest[:1] == ["-m"]:
                module = True
                rest = rest[1:]
    elif prog.endswith(".py"):
        rest = toks[i:]
    elif prog in UNSUPPORTED:
        raise ReaderError(f"cannot understand the launcher {toks[i]!r} ({UNSUPPORTED[prog]}); memguard reads torchrun, "
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
        nnodes, nproc = torchrun_world(topts, environ, notes, launcher, outer)
    return _finish(launcher, script, args, env, nnodes, nproc, outer, environ, notes, wrappers, module)


def _finish(launcher, script, args, env, nnodes, nproc, outer: OuterOpts | None, environ, notes, wrappers, module,
            inner_world: tuple[int | None, str] | None = None) -> LaunchCommand:
    world: int | None = None
    src = ""
    if nnodes is not None and nproc is not None:
        world, src = nnodes * nproc, f"{launcher} --nnodes {nnodes} x --nproc-per-node {nproc}"
    elif inner_world is not None and inner_world[0] is not None and inner_world[1] and not inner_world[1].startswith("WORLD_SIZE"):
        world, src = inner_world
    elif outer is not None:
        world, src = outer_world(outer, environ)
    else:
        w = env_int(environ, "WORLD_SIZE")
        if w:
            world, src = w, "WORLD_SIZE"
    return LaunchCommand(launcher=launcher if outer is None or nnodes is not None else outer.name, script=script,
                         script_args=list(args), env=env, nnodes=nnodes, nproc_per_node=nproc, world_size=world,
                         notes=notes, world_size_from=src, wrappers=tuple(wrappers), module=module)
