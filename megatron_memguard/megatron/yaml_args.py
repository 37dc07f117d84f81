"""The ``--yaml-cfg`` namespace: where an autotune update goes, and the ``--memguard*`` settings of a YAML run.

``parse_args`` replaces the parsed command line by ``load_yaml(FILE)``: a SimpleNamespace with the
training arguments at the top level and the sections ``model_parallel`` / ``language_model`` as nested
namespaces (megatron-core 0.19.2 ``megatron/training/yaml_arguments.py``; the legacy era calls the same
``validate_yaml`` from ``initialize_megatron``). ``validate_yaml`` reads the pipeline size from
``args.model_parallel`` and the batch sizes from the top level, then merges both sections into a new
top-level namespace (``SimpleNamespace(**args, **section)``: a name in two places is a TypeError), which it
returns; ``core_transformer_config_from_yaml`` builds the model's TransformerConfig from
``language_model`` + ``model_parallel``. So an update is set, before ``validate_yaml`` runs, where
those functions read it; the merged namespace and the model config then both carry it.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Sequence

from ..errors import ConfigError
from .flags import FLAGS, add_arguments

# Where validate_yaml / core_transformer_config_from_yaml read the keys autotune changes (0.19.2):
# validate_yaml: args.model_parallel.pipeline_model_parallel_size, args.micro_batch_size, args.global_batch_size;
# core_transformer_config_from_yaml: TransformerConfig's recompute_* from the language_model section.
_SECTION_OF = {"pipeline_model_parallel_size": "model_parallel", "recompute_granularity": "language_model",
               "recompute_method": "language_model", "recompute_num_layers": "language_model"}
SECTIONS = ("model_parallel", "language_model")


def is_yaml_namespace(ns: Any) -> bool:
    """What ``load_yaml`` returns (before ``validate_yaml``): nested section namespaces and ``yaml_cfg``."""
    return bool(getattr(ns, "yaml_cfg", None)) and all(hasattr(getattr(ns, s, None), "__dict__") for s in SECTIONS)


def assign_yaml(ns: Any, key: str, value: Any) -> None:
    """Set ``key`` where Megatron's YAML path reads it: the section that already holds it, else the one
    validate_yaml / core_transformer_config_from_yaml read it from, else the top level."""
    for sec in SECTIONS:
        section = getattr(ns, sec, None)
        if section is not None and key in vars(section):
            setattr(section, key, value)
            return
    sec = _SECTION_OF.get(key)
    if sec is not None and key not in vars(ns):
        setattr(getattr(ns, sec), key, value)
        return
    setattr(ns, key, value)


def _given(flag: str, argv: Sequence[str]) -> bool:
    return any(tok == flag or tok.startswith(flag + "=") for tok in argv)


def yaml_settings_namespace(args: Any, argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The ``--memguard*`` values of a YAML run. ``load_yaml`` drops the parsed command line, so the
    flags are read again from ``argv`` (Megatron's parser, with the memguard group, already accepted
    them); a flag not on the command line takes a ``memguard*`` key of the YAML file, else its
    ``MEMGUARD_*`` variable, else its default."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = add_arguments(argparse.ArgumentParser(prog=os.path.basename(sys.argv[0] or "pretrain_gpt.py"),
                                                   add_help=False, allow_abbrev=False))
    ns, _ = parser.parse_known_args(argv)
    for spec in FLAGS:
        v = getattr(args, spec.dest, None)
        if v is None or _given(spec.flag, argv):
            continue
        try:
            v = v if isinstance(v, bool) and spec.boolean else spec.convert(str(v))
        except argparse.ArgumentTypeError as e:
            raise ConfigError(f"{spec.dest} (--yaml-cfg {getattr(args, 'yaml_cfg', '')})", str(e)) from None
        setattr(ns, spec.dest, v)
    return ns
