"""Megatron-LM functional-test ``model_config.yaml``: flags under MODEL_ARGS, environment under ENV_VARS.

Values are written as the launcher passes them (``true`` = a bare flag; a list flag's values as
``"[a b]"`` or as plain words ``a b``, which the shell splits); ``${VAR}`` placeholders are
filled from ENV_VARS and the caller's environment where possible; unresolved ones are harmless for
memory-neutral flags (paths) and an error for flags memguard reads.
"""
from __future__ import annotations

from typing import Any, Mapping

from ..config import RawConfig, memory_env
from ..errors import ReaderError
from .megatron_flags import flags_from_mapping, parse_megatron_flags


def is_functional_test_config(doc: Any) -> bool:
    return isinstance(doc, dict) and isinstance(doc.get("MODEL_ARGS"), dict)


def read_functional_test_config(doc: Mapping[str, Any], path: str = "", environ: Mapping[str, str] | None = None) -> RawConfig:
    model_args = doc.get("MODEL_ARGS")
    if not isinstance(model_args, dict):
        raise ReaderError(f"{path}: MODEL_ARGS must be a mapping of Megatron flags")
    env_vars = doc.get("ENV_VARS") or {}
    if not isinstance(env_vars, dict):
        raise ReaderError(f"{path}: ENV_VARS must be a mapping of environment variables, got a {type(env_vars).__name__}")
    env = {str(k): str(v) for k, v in env_vars.items()}
    fill = {**(environ or {}), **env}
    raw = parse_megatron_flags(flags_from_mapping(model_args), env=fill, source=f"Megatron functional-test config {path}")
    origin = {k: f"MODEL_ARGS.{v}" for k, v in raw.origin.items()}
    return RawConfig(args=raw.args, origin=origin, source=raw.source, env=memory_env(env), warnings=raw.warnings,
                     megatron_command_line=raw.megatron_command_line)
