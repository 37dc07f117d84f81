"""What a training script is given, sorted by kind: Megatron-LM flags, Hydra (NeMo 1) overrides, or a
Megatron-Bridge / NeMo 2 recipe's config file and ``KEY=VALUE`` overrides; and the YAML file a Hydra
launch reads. Works on a parsed ``LaunchCommand`` (``launch_command``).
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..errors import ReaderError

if TYPE_CHECKING:
    from .launch_command import LaunchCommand


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
