"""``memguard check -- <launch command>``: the pre-flight a launch wrapper runs before it submits or starts a job.

Takes the command the wrapper would run (``torchrun ... pretrain_gpt.py <flags>``, ``python -m
torch.distributed.run ...``, ``srun ... python ...``, a NeMo 1 launch with ``--config-path`` /
``--config-name`` and Hydra overrides, a Megatron-Bridge launch with ``--config-file`` / ``--recipe``
and ``KEY=VALUE`` overrides), or a whole script with ``--file``. The world size comes from the
launcher's own options (or SLURM_* / WORLD_SIZE, or the NeMo config's trainer.devices x num_nodes);
``--world-size`` overrides it. Prints the verdict on one screen. Never starts the job.

Exit codes, as ``memguard estimate``: 0 fits; 1 tight, will not fit, or the launch contradicts its
config; 2 the command cannot be understood or something memguard needs is missing.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from dataclasses import replace
from typing import TYPE_CHECKING, Mapping

from ..errors import ConfigError, ConfigErrors, MemguardError, ReaderError
from .main import EXIT_BAD_INPUT, EXIT_FITS, EXIT_PROBLEM, _Parser, add_target_options, load_raw, target_gpu, target_site

if TYPE_CHECKING:
    from ..config import RawConfig
    from ..readers.launch_command import LaunchCommand, ScriptArgs

MAX_NOTES = 6


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="memguard check",
                description="memguard check [options] -- <launch command>   |   memguard check [options] --file SCRIPT\n"
                            "Pre-flight a launch: estimate the job it would start and exit 0 (fits), 1 (tight / will not "
                            "fit) or 2 (cannot understand the command). The job is never started.",
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--file", "-f", help="a launch script (sbatch script, shell wrapper) holding one launch command")
    p.add_argument("--cwd", help="directory the job starts in (relative config paths), default: the current one")
    add_target_options(p)
    p.add_argument("--profile", default="auto", help="auto (by --transformer-impl), transformer_engine, local, fujii2024")
    p.add_argument("--json", action="store_true", help="machine-readable output: the estimate document plus 'launch'")
    p.add_argument("--full", action="store_true", help="the whole breakdown of the critical stage (more than a screen)")
    p.add_argument("--no-suggest", action="store_true", help="do not search for a layout that fits when it does not")
    p.set_defaults(threshold=None)  # None: not given, so the launch's --memguard-threshold applies (else 0.8)
    return p


def run(own_args: list[str], flags: list[str]) -> int:
    p = build_parser()
    ns = p.parse_args(own_args)
    if ns.config:
        print("memguard check: error: --config is for memguard estimate / validate; give the launch command after -- "
              "or a script with --file", file=sys.stderr)
        return EXIT_BAD_INPUT
    if ns.file and flags:
        print("memguard check: error: give the launch command either after -- or with --file, not both", file=sys.stderr)
        return EXIT_BAD_INPUT
    if not ns.file and not flags:
        print("memguard check: error: give the launch command after -- or a script with --file "
              "(memguard check --help describes the options)", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        return _check(ns, flags)
    except ConfigErrors as e:
        _fail(ns, [str(x) for x in e.errors], understood=True)
    except ReaderError as e:
        _fail(ns, [str(e)], understood=False)
    except MemguardError as e:
        _fail(ns, [str(e)], understood=True)
    return EXIT_BAD_INPUT


def _fail(ns, messages: list[str], understood: bool) -> None:
    if ns.json:
        print(json.dumps({"schema": "memguard.check/1", "understood": understood, "ok": False, "verdict": None,
                          "errors": messages}, indent=2))
    head = "error" if understood else "cannot understand the launch command"
    for m in messages:
        print(f"memguard check: {head}: {m}", file=sys.stderr)
    print("memguard check: DO NOT LAUNCH - not checked (exit 2)", file=sys.stderr)


def cli_world(ns: argparse.Namespace) -> tuple[int | None, str]:
    """The world size given on memguard's own command line (the launcher's environment does not count)."""
    if ns.world_size:
        return ns.world_size, "--world-size"
    if ns.gpus:
        return ns.gpus, "--gpus"
    if ns.nnodes and ns.nproc_per_node:
        return ns.nnodes * ns.nproc_per_node, "--nnodes x --nproc-per-node"
    if ns.nnodes or ns.nproc_per_node:
        raise ConfigError("--nnodes" if ns.nnodes else "--nproc-per-node", "needs the other one too",
                          "or give --world-size")
    return None, ""


def read_launch(ns: argparse.Namespace, flags: list[str], environ: Mapping[str, str] | None = None,
                ) -> tuple[LaunchCommand, ScriptArgs, RawConfig, list[str]]:
    """(LaunchCommand, ScriptArgs, RawConfig, notes) of the launch command or script ``ns`` names."""
    from ..config import memory_env
    from ..readers.launch_command import hydra_config_file, parse_launch_command, split_script_args
    from ..readers.megatron_flags import parse_megatron_flags
    from ..readers.models import find_recipe, recipes_named_in
    from ..readers.run_recipe import is_run_recipe

    environ = dict(os.environ if environ is None else environ)
    if ns.cwd is not None and not os.path.isdir(ns.cwd):   # (relative paths would be looked up under it)
        raise ConfigError("--cwd", f"{'is not a directory' if os.path.exists(ns.cwd) else 'no such directory'}: {ns.cwd!r}")
    if ns.file:
        from ..files import read_text
        try:
            text = read_text(ns.file)
        except ReaderError as e:   # the file, not its command, is the problem
            raise MemguardError(str(e)) from None
        try:
            cmd = parse_launch_command(text, environ)
            sa = None if is_run_recipe(cmd.script) else split_script_args(cmd)
        except ReaderError as e:
            raise ReaderError(f"{ns.file}: {e}") from None
    else:
        cmd = parse_launch_command(flags, environ)
        sa = None if is_run_recipe(cmd.script) else split_script_args(cmd)
    notes: list[str] = list(cmd.notes)
    if sa is None:
        return _read_run_recipe(ns, cmd, notes)
    if sa.unreadable:
        raise MemguardError(f"{cmd.script}: " + "; ".join(sa.unreadable) + " - memguard does not read these script "
                            "options; give them as KEY=VALUE overrides")
    job_env = {**environ, **cmd.env}
    cwd = ns.cwd or os.getcwd()

    def here(path: str) -> str:
        return path if os.path.isabs(path) or not ns.cwd else os.path.join(cwd, path)

    if not ns.site_profile and cmd.env.get("MEMGUARD_PROFILE"):  # the hook would read the launch's variable
        ns.site_profile = here(cmd.env["MEMGUARD_PROFILE"])
        ns.site_profile_key = "the launch's MEMGUARD_PROFILE"     # (its errors name where the path came from)
        notes.append(f"site profile {ns.site_profile} from the launch's MEMGUARD_PROFILE")

    if sa.kind == "megatron":
        if ns.set:
            raise ConfigError("--set", "KEY=VALUE overrides apply to NeMo / Megatron-Bridge configs; this launch passes "
                                       "Megatron flags (add the flag to the command instead)")
        flags_, hook = _hook_flags(sa.flags)
        if hook:
            notes.append("memguard hook flags on the launch: " + " ".join(f"{k} {v}" if v is not None else k
                                                                        for k, v in hook.items()))
            if ns.threshold is None and hook.get("--memguard-threshold"):
                try:
                    ns.threshold = float(hook["--memguard-threshold"])
                except ValueError:
                    ns.threshold = -1.0
                if not 0 < ns.threshold <= 1.5:
                    raise ConfigError("--memguard-threshold", f"must be a fraction of GPU memory in (0, 1.5], got "
                                                              f"{hook['--memguard-threshold']!r}")
                notes.append(f"threshold {ns.threshold} from the launch's --memguard-threshold")
            if not ns.gpu_memory and hook.get("--memguard-gpu-memory"):
                from ..units import parse_bytes
                parse_bytes(hook["--memguard-gpu-memory"], "--memguard-gpu-memory")  # its key in the error
                ns.gpu_memory = hook["--memguard-gpu-memory"]
            if not ns.site_profile and hook.get("--memguard-profile"):
                ns.site_profile = here(hook["--memguard-profile"])
                ns.site_profile_key = "the launch's --memguard-profile"
                notes.append(f"site profile {ns.site_profile} from the launch's --memguard-profile")
        raw = parse_megatron_flags(flags_, env=job_env, source=f"{os.path.basename(cmd.script)} flags",
                                   expand=False, kept=cmd.kept)
        if ns.model:
            from ..readers.models import read_model
            raw = read_model(ns.model).merged(raw)
        return cmd, sa, raw, notes
    if sa.ignored:
        notes.append(f"{os.path.basename(cmd.script)} options not read (no memory setting memguard knows): "
                     + " ".join(sa.ignored))
    sub = copy.copy(ns)
    sub.set = list(sa.overrides) + list(ns.set or [])
    recipe = ns.model
    if sa.kind == "hydra":
        sub.config = hydra_config_file(sa, cmd.script, cwd)
    else:
        sub.config = here(sa.config_file) if sa.config_file else None
        if not recipe and sa.recipe:
            recipe = sa.recipe
            if not find_recipe(recipe):
                raise ConfigError("--recipe", f"{recipe!r} is not a Megatron-Bridge recipe memguard has",
                                  "give the model shape with --model NAME or a full run_config.yaml")
        if not recipe and not _has_shape(sub.config):
            named = recipes_named_in(cmd.script)
            if named:
                recipe = named[0]
                notes.append(f"recipe {recipe} taken from the script name {os.path.basename(cmd.script)} (--model overrides it)")
        if not sub.config and not recipe:
            raise ConfigError(cmd.script, "this Megatron-Bridge launch names no --config-file and no recipe memguard knows",
                              "give --model RECIPE (or a full run_config.yaml with --config-file)")
    sub.model = recipe
    raw = _shell_checked(lambda: load_raw(sub, []), cmd, sub.set)
    if cmd.env:
        raw = replace(raw, env={**raw.env, **memory_env(cmd.env)})
    return cmd, sa, raw, notes


def _read_run_recipe(ns: argparse.Namespace, cmd: LaunchCommand, notes: list[str],
                     ) -> tuple[LaunchCommand, ScriptArgs, RawConfig, list[str]]:
    """A Megatron-Bridge scripts/training/run_recipe.py launch, read as the script reads its arguments
    (megatron_memguard/readers/run_recipe.py)."""
    from ..config import memory_env
    from ..readers.launch_command import ScriptArgs
    from ..readers.run_recipe import read_run_recipe

    if ns.model:
        raise ConfigError("--model", "run_recipe.py names its recipe itself (its --recipe, or --model and --mode after "
                                     "--); memguard's --model does not apply to it")
    rr, raw = _shell_checked(lambda: read_run_recipe(cmd.script_args, extra_overrides=ns.set), cmd,
                             [*cmd.script_args, *(ns.set or [])])
    if rr.ignored:
        notes.append("run_recipe.py settings that do not change memory: " + " ".join(rr.ignored))
    if cmd.env:  # the recipe's env_vars (and --deterministic's) are os.environ.setdefault: the launch's own win
        raw = replace(raw, env={**raw.env, **memory_env(cmd.env)})
    sa = ScriptArgs(kind="bridge", recipe=rr.recipe, overrides=list(rr.overrides), ignored=list(rr.ignored))
    return cmd, sa, raw, notes


def _shell_checked(read, cmd: LaunchCommand, overrides: list[str]):
    """``read()`` (a NeMo / Bridge reader of the launch's KEY=VALUE overrides), with an override whose value holds a
    command substitution (``model.tensor_model_parallel_size=$(nproc)``) named as the Megatron-flag case names one:
    its key, the construct and its line, when a rule reads it; a setting no rule needs is not an error (bash runs
    ``model.seed=$(date)``'s program, memguard needs no seed)."""
    from ..readers.megatron_flags import unevaluated_overrides
    shell = unevaluated_overrides(overrides, cmd.kept)
    if not shell:
        return read()
    try:
        out = read()
    except ConfigErrors as e:
        raise ConfigErrors([_shell_error(x, shell) for x in e.errors]) from None
    except ConfigError as e:
        raise _shell_error(e, shell) from None
    raw = out[1] if isinstance(out, tuple) else out
    # (resolve() reports the first read of such a value, as it does a Megatron flag's: RawConfig.unevaluated)
    raw = replace(raw, unevaluated={**raw.unevaluated, **{d: shell[k] for d, k in raw.origin.items() if k in shell}},
                  problems=tuple(_shell_error(p, shell) for p in raw.problems))
    return (out[0], raw) if isinstance(out, tuple) else raw


def _shell_error(e: ConfigError, shell: Mapping[str, str]) -> ConfigError:
    """``e`` about an override whose value is shell text memguard kept: the construct and its line instead of the
    reader's view of the text ("must be an integer, got '$(nproc)'")."""
    from ..readers.megatron_flags import unevaluated_fix
    if e.key not in shell or ("$(" not in e.rule and "`" not in e.rule):   # (a rule the key breaks whatever its value)
        return e
    return ConfigError(e.key, f"is {shell[e.key]}", unevaluated_fix(e.key))


def _has_shape(path: str | None) -> bool:
    if not path or not os.path.exists(path):
        return False
    from ..files import load_yaml, read_text
    try:
        doc = load_yaml(read_text(path), path)
    except MemguardError:  # unreadable here: load_raw reads it again and reports why
        return False
    model = doc.get("model") if isinstance(doc, dict) else None
    if not isinstance(model, dict):
        return False
    return "num_layers" in model or "num_layers" in (model.get("transformer") or {})


def _check(ns, flags: list[str]) -> int:
    from ..estimator import estimate
    from ..report.text import describe_layout, render, stage_summary, verdict_line
    from ..resolve import resolve
    from ..units import format_bytes

    cmd, sa, raw, notes = read_launch(ns, flags)
    if ns.threshold is None:
        ns.threshold = 0.8
    world, wsrc = cli_world(ns)
    problems: list[str] = [str(p) for p in raw.problems]  # rules of the config's format the job would break
    if world is None and cmd.world_size is not None:
        world, wsrc = cmd.world_size, cmd.world_size_from
    cfg_world = raw.world_size
    if cfg_world and world and cfg_world != world and wsrc:
        key = raw.origin.get("world_size", "the config's world size")
        problems.append(f"{key} = {cfg_world} but {wsrc} starts {world} ranks; the job would fail at start-up")
    if world is None and cfg_world:
        world, wsrc = cfg_world, raw.origin.get("world_size", "the config")
    if world is None:
        from ..readers.megatron_flags import unevaluated_fix, unevaluated_overrides
        shell = unevaluated_overrides([*sa.overrides, *(ns.set or [])], cmd.kept)
        for key in ("trainer.devices", "trainer.num_nodes"):   # (NeMo's world size: trainer.devices x num_nodes)
            if key in shell:
                raise ConfigError(key, f"is {shell[key]}; the number of GPUs is unknown",
                                  unevaluated_fix(key) + ", or give --world-size N")
        raise ConfigError("--world-size", f"the number of GPUs is unknown: {cmd.launcher} {os.path.basename(cmd.script)} "
                          "gives no --nnodes / --nproc-per-node (srun --ntasks / --nodes x --ntasks-per-node) and "
                          "WORLD_SIZE / SLURM_NTASKS are not set", "give --world-size N")
    layout = resolve(raw, world_size=world, megatron_version=ns.megatron_version, vocab_size=ns.vocab_size)
    gpu, mem = target_gpu(ns)
    est = estimate(layout, profile=ns.profile, gpu=gpu, gpu_memory=mem, threshold=ns.threshold, site=target_site(ns))
    fits = est.verdict in ("fits", "unknown") and not problems
    suggestion = None
    if est.verdict in ("tight", "will not fit") and not ns.no_suggest:
        suggestion = _suggest(raw, est, ns, world, gpu, mem)
    notes += [w for w in raw.warnings if w not in notes and w not in problems]
    notes += [n for n in layout.notes if n not in notes]

    what = {"megatron": "Megatron-LM flags", "hydra": "NeMo 1 Hydra config", "bridge": "Megatron-Bridge config"}[sa.kind]
    launch = {"launcher": cmd.launcher, "wrappers": list(cmd.wrappers), "script": cmd.script, "kind": sa.kind,
              "source": raw.source, "world_size": world, "world_size_from": wsrc,
              "config_file": getattr(sa, "config_file", None), "overrides": sa.overrides, "env": dict(cmd.env)}
    if ns.json:
        doc = est.to_dict()
        doc.update({"schema": "memguard.check/1", "understood": True, "launch": launch, "problems": problems,
                    "notes": notes, "ok": fits, "suggestion": suggestion})
        print(json.dumps(doc, indent=2, default=str))
        return EXIT_FITS if fits else EXIT_PROBLEM

    out = []
    wrap = " ".join(cmd.wrappers) + " " if cmd.wrappers else ""
    src = what if sa.kind == "megatron" else (raw.source if raw.source.startswith(("Megatron-Bridge", "NeMo")) else
                                              f"{what}: {raw.source}")
    out.append(f"memguard check: {wrap}{cmd.launcher} {os.path.basename(cmd.script)} ({src})")
    gpu_text = f"{est.gpu} ({format_bytes(est.gpu_memory_bytes)})" if est.gpu else format_bytes(est.gpu_memory_bytes)
    out.append(f"world:  {world} ranks ({wsrc}) on {gpu_text}")
    out.append(describe_layout(est))
    out.append("")
    out.append(stage_summary(est))
    out.append("")
    if ns.full:
        out.append(render(est, colour=False))
    else:
        c = est.critical
        top = sorted((t for t in c.terms if t.level == "allocated"), key=lambda t: -t.bytes)[:4]
        out.append(f"pp{c.pp_rank} peaks at {c.peak_phase}; largest terms: "
                   + ", ".join(f"{t.name} {format_bytes(t.bytes)}" for t in top))
        out.append(verdict_line(est))
    for pr in problems:
        out.append(f"problem: {pr}")
    if suggestion:
        out.append(suggestion)
    if notes:
        shown = notes[:MAX_NOTES]
        out += [f"note: {n}" for n in shown]
        if len(notes) > MAX_NOTES:
            out.append(f"note: ... {len(notes) - MAX_NOTES} more (--json lists them all)")
    out.append("memguard check: OK to launch" if fits else
               "memguard check: DO NOT LAUNCH - " + ("; ".join(problems) if problems and est.verdict == "fits" else
                                                   _verdict_words(est)))
    print("\n".join(out))
    return EXIT_FITS if fits else EXIT_PROBLEM


def _suggest(raw, est, ns, world, gpu, mem) -> str | None:
    """The smallest change of micro-batch / pipeline size / recomputation that fits, spelled as the
    launch spells its settings."""
    from ..autotune import autotune, describe_layout_choice
    from ..units import format_bytes

    try:
        r = autotune(raw, world_size=world, megatron_version=ns.megatron_version, vocab_size=ns.vocab_size,
                     gpu=gpu, gpu_memory=mem or est.gpu_memory_bytes,
                     threshold=ns.threshold, profile=ns.profile, allow_recompute=True, original=est)
    except Exception:  # the suggestion is an extra: a search that fails must not hide the verdict
        return None
    if r.chosen is None:  # nothing within these GPUs: what would fit (more GPUs), if anything
        return f"no micro-batch / pipeline / recompute change fits on {world} GPUs; it would fit {r.hints[-1]}" \
            if r.hints else None
    ch = ", ".join(_spelled(raw, k, new) for k, (_, new) in r.changes.items() if new is not None and new is not False)
    return (f"a layout that fits: {describe_layout_choice(r.chosen.layout)}, "
            f"{format_bytes(r.chosen.estimate.peak_device_bytes)} ({r.chosen.estimate.verdict}): {ch}")


def _spelled(raw, dest: str, value) -> str:
    """One change as the launch writes its settings: ``--flag value`` for Megatron flags, ``KEY=VALUE`` for
    the overrides of a NeMo / Bridge launch (a Bridge key its recipe leaves unset named as Bridge names it)."""
    from ..knobs import BY_DEST

    key = raw.origin.get(dest)
    if key is not None:
        key = key.split(" (")[0]    # "model.x (recipe NAME)": where a recipe's value came from
    if key is None and "Bridge" in (raw.source or "") and dest in BY_DEST and BY_DEST[dest].bridge:
        key = BY_DEST[dest].bridge[0]
    listed = isinstance(value, (list, tuple))
    if key is None or "--" in key or " " in key:
        return f"{raw.key(dest)} {' '.join(map(str, value)) if listed else value}"
    text = "true" if value is True else f"[{','.join(map(str, value))}]" if listed else str(value)
    return f"{key}={text}"


def _verdict_words(est) -> str:
    pct = f"{est.peak_device_bytes / est.gpu_memory_bytes:.0%}" if est.gpu_memory_bytes else "?"
    if est.verdict == "tight":
        return f"the critical stage is tight ({pct} of GPU memory, over the {est.threshold:.0%} threshold)"
    return f"the critical stage will not fit ({pct} of GPU memory)"


# The Megatron hook's flags (megatron_memguard/megatron/flags.py FLAGS; importing that package would
# install the hook): the switches, then those that take a value.
HOOK_SWITCHES = ("--memguard-reset-peak", "--memguard-allow-recompute")
HOOK_VALUE_FLAGS = ("--memguard", "--memguard-threshold", "--memguard-gpu-memory", "--memguard-log-interval",
                    "--memguard-log-dir", "--memguard-profile")


def _hook_flags(flags: list[str]) -> tuple[list[str], dict[str, str | None]]:
    """Split the Megatron hook's own --memguard* flags (docs/hook.md) from Megatron's. A flag the hook
    does not have, or one without its value, would stop the job at start-up: refused here too."""
    rest: list[str] = []
    hook: dict[str, str | None] = {}
    i = 0
    while i < len(flags):
        t = flags[i]
        i += 1
        if not t.startswith("--memguard"):
            rest.append(t)
            continue
        name, eq, val = t.partition("=")
        if name not in HOOK_SWITCHES and name not in HOOK_VALUE_FLAGS:
            raise ConfigError(name, "is not a flag of memguard's Megatron hook (docs/hook.md lists them)")
        if name in HOOK_VALUE_FLAGS and not eq:
            if i >= len(flags) or flags[i].startswith("--"):
                raise ConfigError(name, "expects a value")
            val, i = flags[i], i + 1
        hook[name] = val if (eq or name in HOOK_VALUE_FLAGS) else None
    return rest, hook
