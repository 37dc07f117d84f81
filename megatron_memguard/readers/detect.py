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
    from ..files import load_json, load_yaml, read_text

    lower = path.lower()
    if lower.endswith(".nemo"):
        text = _nemo_archive_config(path)
        lower += "/model_config.yaml"
        where = f"{path}/model_config.yaml"
    else:
        text = read_text(path)
        where = path
    if lower.endswith(".json"):
        # strict JSON: YAML would refuse a config.json indented with tabs
        doc = load_json(text, where) if text.strip() else None
    elif lower.endswith((".yaml", ".yml")):
        doc = load_yaml(text, where)
    if lower.endswith((".yaml", ".yml", ".json")):
        from .megatron_yaml import is_functional_test_config, read_functional_test_config

        if is_functional_test_config(doc):
            _no_overrides(path, overrides)
            return read_functional_test_config(doc, path, environ)
        from .megatron_yaml_cfg import is_yaml_cfg, read_yaml_cfg

        if is_yaml_cfg(doc):   # Megatron's own --yaml-cfg file
            _no_overrides(path, overrides)
            return read_yaml_cfg(doc, path, environ)
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
    raw = parse_megatron_flags(cmd.script_args, env={**(environ or {}), **cmd.env}, source=f"launch command in {path}",
                               expand=False, kept=cmd.kept)
    return RawConfig(args=raw.args, origin=raw.origin, source=raw.source, world_size=cmd.world_size,
                     nodes=cmd.nnodes, gpus_per_node=cmd.nproc_per_node, env=memory_env(cmd.env),
                     warnings=raw.warnings + tuple(cmd.notes), megatron_command_line=raw.megatron_command_line,
                     unevaluated=raw.unevaluated)


def _no_overrides(path: str, overrides: list[str] | None) -> None:
    if overrides:
        raise ReaderError(f"{path}: KEY=VALUE overrides ({overrides[0]} ...) apply to NeMo / Megatron-Bridge / NeMo 2 YAML; "
                          "for Megatron flags give the flag after --")


# members read before giving up on finding model_config.yaml: NeMo's SaveRestoreConnector writes the config,
# the tokenizer files and the weights (a torch_dist checkpoint: a file per shard, hundreds for the largest models)
MAX_NEMO_MEMBERS = 10_000


def _nemo_archive_config(path: str) -> str:
    """The model_config.yaml inside a NeMo 1 ``.nemo`` checkpoint (a tar archive)."""
    import tarfile

    from ..files import MAX_FILE_BYTES, decode

    if not os.path.exists(path):
        raise ReaderError(f"{path}: no such file")
    if not os.path.isfile(path):     # tarfile would wait forever on a named pipe nobody writes to
        raise ReaderError(f"{path}: not a regular file (a .nemo checkpoint is a tar file)")
    try:
        with tarfile.open(path) as tar:
            for k, m in enumerate(tar):
                if k >= MAX_NEMO_MEMBERS:   # a compressed tar of empty members: a few KiB for millions of them
                    raise ReaderError(f"{path}: no model_config.yaml in the first {MAX_NEMO_MEMBERS:,} members of this "
                                      ".nemo archive (a .nemo checkpoint holds its config, tokenizer and weight files)")
                if m.isfile() and os.path.basename(m.name) == "model_config.yaml":
                    fh = tar.extractfile(m)
                    if fh is not None:
                        return decode(fh.read(MAX_FILE_BYTES + 1), f"{path}/model_config.yaml")
    except tarfile.ReadError:
        raise ReaderError(f"{path}: not a .nemo archive (a .nemo checkpoint is a tar file)") from None
    except (OSError, EOFError, tarfile.TarError, ValueError) as e:
        raise ReaderError(f"{path}: cannot read the .nemo archive ({e})") from None
    raise ReaderError(f"{path}: no model_config.yaml in this .nemo archive")
