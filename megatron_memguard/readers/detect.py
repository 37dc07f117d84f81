"""Read any supported input file: detect its format and hand it to the right reader."""
from __future__ import annotations

import os
from typing import Mapping

from ..config import RawConfig, memory_env
from ..errors import ReaderError


def read_config_file(path: str, environ: Mapping[str, str] | None = None, overrides: list[str] | None = None,
                     model: str | None = None) -> RawConfig:
    """A Megatron functional-test YAML, a launch command / shell script, or NeMo 1, NeMo 2,
    Megatron-Bridge and Hugging Face configs. ``overrides`` (``KEY=VALUE``) apply to the latter;
    ``model`` (``--model``) names the recipe a Megatron-Bridge override file applies to."""
    if not os.path.exists(path):
        raise ReaderError(f"{path}: no such file")
    lower = path.lower()
    if lower.endswith(".nemo"):
        text = _nemo_archive_config(path)
        lower += "/model_config.yaml"
    else:
        try:
            with open(path, encoding="utf-8") as fh:
                text = fh.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ReaderError(f"{path}: cannot read ({e})") from None
    if lower.endswith(".json"):
        import json

        try:  # strict JSON: YAML would refuse a config.json indented with tabs
            doc = json.loads(text) if text.strip() else None
        except ValueError as e:
            where = f" line {e.lineno}, column {e.colno}" if isinstance(e, json.JSONDecodeError) else ""
            raise ReaderError(f"{path}:{where} JSON syntax error: {getattr(e, 'msg', e)}") from None
    elif lower.endswith((".yaml", ".yml")):
        import yaml

        try:
            doc = yaml.safe_load(text)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            raise ReaderError(f"{path}:{where} YAML syntax error: {getattr(e, 'problem', e)}") from None
    if lower.endswith((".yaml", ".yml", ".json")):
        from .megatron_yaml import is_functional_test_config, read_functional_test_config

        if is_functional_test_config(doc):
            _no_overrides(path, overrides)
            return read_functional_test_config(doc, path, environ)
        from .structured import read_structured_config

        return read_structured_config(doc, path, text=text, overrides=overrides or [], environ=environ, model=model)
    _no_overrides(path, overrides)
    from .launch_command import parse_launch_script, split_script_args
    from .megatron_flags import parse_megatron_flags

    try:
        cmd = parse_launch_script(text, environ)
        kind = split_script_args(cmd).kind
    except ReaderError as e:
        raise ReaderError(f"{path}: {e}") from None
    if kind != "megatron":
        raise ReaderError(f"{path}: this launch runs {cmd.script} with a {'NeMo 1 (Hydra)' if kind == 'hydra' else 'Megatron-Bridge'} "
                          f"config and overrides; check it with memguard check --file {path}")
    raw = parse_megatron_flags(cmd.script_args, env={**(environ or {}), **cmd.env}, source=f"launch command in {path}")
    return RawConfig(args=raw.args, origin=raw.origin, source=raw.source, world_size=cmd.world_size,
                     nodes=cmd.nnodes, gpus_per_node=cmd.nproc_per_node, env=memory_env(cmd.env),
                     warnings=raw.warnings + tuple(cmd.notes))


def _no_overrides(path: str, overrides: list[str] | None) -> None:
    if overrides:
        raise ReaderError(f"{path}: KEY=VALUE overrides ({overrides[0]} ...) apply to NeMo / Megatron-Bridge / NeMo 2 YAML; "
                          "for Megatron flags give the flag after --")


def _nemo_archive_config(path: str) -> str:
    """The model_config.yaml inside a NeMo 1 ``.nemo`` checkpoint (a tar archive)."""
    import tarfile

    try:
        with tarfile.open(path) as tar:
            for m in tar.getmembers():
                if m.isfile() and os.path.basename(m.name) == "model_config.yaml":
                    fh = tar.extractfile(m)
                    if fh is not None:
                        return fh.read().decode("utf-8")
    except (OSError, tarfile.TarError, UnicodeDecodeError) as e:
        raise ReaderError(f"{path}: cannot read the .nemo archive ({e})") from None
    raise ReaderError(f"{path}: no model_config.yaml in this .nemo archive")
