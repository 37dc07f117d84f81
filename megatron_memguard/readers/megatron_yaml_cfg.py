"""Megatron-LM's own YAML arguments (``--yaml-cfg FILE``), read the way megatron-core 0.19.2's
``megatron/training/yaml_arguments.py`` reads them.

``parse_args`` replaces every command-line argument by ``load_yaml(FILE)`` (``yaml.safe_load``: no
``${VAR}`` substitution, PyYAML registers Megatron's ``!pathex`` resolver on the full loaders only):
training settings at the top level, megatron-core's ModelParallelConfig fields under
``model_parallel:`` and TransformerConfig fields under ``language_model:``. ``validate_yaml`` then
merges the two sections into the top level (``SimpleNamespace(**args, **section)``: a name given twice
is a TypeError), derives the virtual pipeline size from ``num_layers_per_virtual_pipeline_stage`` and
``core_transformer_config_from_yaml`` builds the model's config from ``language_model`` with
``activation_func`` one of ``swiglu`` / ``squaredrelu`` / ``gelu``.
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping

from ..config import RawConfig, memory_env
from ..errors import ConfigError, ReaderError
from ._common import (
    _MISSING_RULE, ArgsBuilder, _number, as_bool, is_missing, map_mcore_fields, mcore_model_fields, megatron_dests,
    memory_neutral_dests, yaml_cfg_arg_default,
)

SECTIONS = ("model_parallel", "language_model")
CARRIER = "Megatron's --yaml-cfg"
ACTIVATIONS = ("swiglu", "squaredrelu", "gelu")
# set by load_yaml / parse_args themselves, or derived by validate_yaml: not inputs
_NOT_INPUTS = frozenset({"yaml_cfg", "rank", "world_size", "data_parallel_size", "num_experts",
                         "transformer_pipeline_model_parallel_size", "consumed_train_samples",
                         "consumed_valid_samples", "encoder_num_layers", "encoder_seq_length"})


def is_yaml_cfg(doc: Any) -> bool:
    return isinstance(doc, Mapping) and all(isinstance(doc.get(s), Mapping) for s in SECTIONS)


def read_yaml_cfg(doc: Any, path: str, env: Mapping[str, str] | None = None,
                  ignored_flags: Iterable[str] = ()) -> RawConfig:
    """A ``--yaml-cfg`` document as Megatron's arguments. ``ignored_flags``: the other command-line
    flags given with ``--yaml-cfg`` (Megatron ignores them: one warning names them)."""
    if not is_yaml_cfg(doc):
        raise ReaderError(f"{path}: a --yaml-cfg file needs the mappings model_parallel: and language_model: "
                          "(megatron/training/yaml_arguments.py reads args.model_parallel.* and args.language_model.*)")
    b = ArgsBuilder(f"Megatron --yaml-cfg file {path}")
    ignored = [f for f in ignored_flags]
    if ignored:
        b.warn(f"--yaml-cfg: Megatron reads every argument from {path} and ignores the other flags ("
               + " ".join(ignored[:8]) + (" ..." if len(ignored) > 8 else "") + ")")
    top = {str(k): v for k, v in doc.items() if k not in SECTIONS}
    fields: dict[str, tuple[Any, str]] = {}
    for sec in SECTIONS:
        for k, v in doc[sec].items():
            k = str(k)
            if k in top or k in fields:
                where = "at the top level" if k in top else f"under {fields[k][1].split('.')[0]}"
                b.problem(f"{sec}.{k}", f"is also set {where}; validate_yaml merges the sections into one "
                          "namespace and fails on a name given twice", "keep one")
                continue
            fields[k] = (v, f"{sec}.{k}")
    dests = megatron_dests()
    for k, v in top.items():
        if k in _NOT_INPUTS or k.startswith("_"):
            continue
        if k in dests:
            _refuse_unset_arg(k, v, k)
            if v is not None and not isinstance(v, Mapping):
                b.set(k, _number(v), k)
        else:
            b.warn(f"{k}: not a Megatron argument; ignored")
    # validate_yaml sets model_parallel.virtual_pipeline_model_parallel_size from the top level's
    # num_layers_per_virtual_pipeline_stage (None without it), whatever the section says
    vpp = fields.pop("virtual_pipeline_model_parallel_size", (None, ""))
    if vpp[0] is not None:
        b.warn(f"{vpp[1]}: ignored (validate_yaml derives it from num_layers_per_virtual_pipeline_stage)")
    # a section's Megatron arguments that are no megatron-core field (bias_swiglu_fusion, rotary_base):
    # after the merge the training code reads them as top-level arguments
    core = mcore_model_fields()
    args_only = {k for k in fields if k in dests and k not in core}
    for k in sorted(args_only):
        v, key = fields[k]
        _refuse_unset_arg(k, v, key)
        if v is not None and not isinstance(v, Mapping):
            b.set(k, _number(v), key)
    map_mcore_fields(b, fields, extra_known=args_only, unknown_context="megatron-core",
                     skip={"activation_func", "gated_linear_unit", "bias_activation_fusion"} | args_only, provider=False,
                     carrier=CARRIER)
    _activation(b, fields, top)
    if fields.get("num_query_groups", (None,))[0] is not None:
        # TransformerConfig takes num_query_groups as given; Megatron's flags read it only with
        # --group-query-attention
        b.set("group_query_attention", True, fields["num_query_groups"][1])
    raw = b.build()
    return RawConfig(args=raw.args, origin=raw.origin, source=raw.source, warnings=raw.warnings,
                     problems=raw.problems, env=memory_env(env))


def _refuse_unset_arg(dest: str, value: Any, key: str) -> None:
    """A Megatron argument given null or '???' in a --yaml-cfg file: load_yaml's namespace is the YAML itself
    (megatron-core 0.19.2 yaml_arguments.py: yaml.safe_load, no argparse defaults), so a null is None and '???' the
    text, where memguard would take the argument's default. Refused where that default is neither None nor False
    (None is falsy: a store_true flag's false) and the argument is one memguard reads (not memory-neutral)."""
    if dest in memory_neutral_dests():
        return
    if is_missing(value):
        raise ConfigError(key, f"is ??? (OmegaConf's missing marker): {_MISSING_RULE[CARRIER]}", f"set {key}: VALUE")
    default = yaml_cfg_arg_default(dest)
    if value is None and default is not None:
        raise ConfigError(key, f"is null: {CARRIER} passes None on (load_yaml reads the file with yaml.safe_load, no "
                               f"argparse defaults), where Megatron's default is {default} (the default is not taken)",
                          f"set {key}: VALUE or drop the key")


def _activation(b: ArgsBuilder, fields: Mapping[str, tuple[Any, str]], top: Mapping[str, Any]) -> None:
    """core_transformer_config_from_yaml (0.19.2): swiglu is SiLU with gated_linear_unit and
    bias_activation_fusion = bias_swiglu_fusion; gelu keeps gated_linear_unit as written, with
    bias_activation_fusion off when add_bias_linear; squaredrelu the squared ReLU."""
    act, key = fields.get("activation_func", (None, "language_model.activation_func"))
    act = str(act).lower() if act is not None else None
    if act not in ACTIVATIONS:
        b.problem(key, f"must be one of {', '.join(ACTIVATIONS)} (core_transformer_config_from_yaml asserts it), "
                       f"got {act!r}")
        return

    def val(name: str, default: Any = None) -> Any:
        return fields[name][0] if name in fields and fields[name][0] is not None else default

    def where(name: str) -> str:
        return fields[name][1] if name in fields else key

    b.set("swiglu", act == "swiglu", key)
    b.set("squared_relu", act == "squaredrelu", key)
    for flag in ("swiglu", "squared_relu"):
        if flag in top and top[flag] is not None and as_bool(top[flag]) != b.args[flag]:
            b.warn(f"{flag}: {top[flag]!r} is not what builds the model; {key} ({act}) does")
    if act == "swiglu":
        b.set("bias_activation_fusion", as_bool(val("bias_swiglu_fusion", True)), where("bias_swiglu_fusion"))
        return
    if act == "gelu" and as_bool(val("gated_linear_unit", False)):
        b.set("gated_linear_unit", True, where("gated_linear_unit"))
    if act == "gelu" and as_bool(val("add_bias_linear", True)):
        b.set("bias_activation_fusion", False, where("add_bias_linear"))
    elif val("bias_activation_fusion") is not None:
        b.set("bias_activation_fusion", as_bool(val("bias_activation_fusion")), where("bias_activation_fusion"))
