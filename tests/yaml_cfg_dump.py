"""Write a ``--yaml-cfg`` file in the layout of Megatron-LM's examples/gpt3/gpt_config.yaml from a parsed
Megatron command line: ModelParallelConfig fields under ``model_parallel:``, the other TransformerConfig
fields under ``language_model:``, the training arguments at the top level, and megatron-core's dataclass
defaults for config fields that no flag sets (validate_yaml reads several of them, e.g.
``language_model.num_moe_experts``). The same job can then be run from flags and from YAML."""
import dataclasses
import enum

import yaml


def _plain(v):
    if isinstance(v, enum.Enum):
        return v.name
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (list, tuple)) and all(isinstance(x, (bool, int, float, str)) for x in v):
        return list(v)
    raise TypeError


def yaml_cfg_doc(args, extra_top=None):
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.transformer import TransformerConfig

    mp_fields = {f.name: f for f in dataclasses.fields(ModelParallelConfig)}
    tc_fields = {f.name: f for f in dataclasses.fields(TransformerConfig) if f.name not in mp_fields}
    doc = {"model_parallel": {}, "language_model": {}}
    for sec, fields in (("model_parallel", mp_fields), ("language_model", tc_fields)):
        for name, f in fields.items():
            if f.default is not dataclasses.MISSING:
                try:
                    doc[sec][name] = _plain(f.default)
                except TypeError:
                    pass
    for k, v in vars(args).items():
        if k.startswith(("_", "memguard")) or k in ("yaml_cfg", "rank", "world_size"):  # memguard's flags: not Megatron's
            continue
        try:
            v = _plain(v)
        except TypeError:
            continue
        sec = "model_parallel" if k in mp_fields else "language_model" if k in tc_fields else None
        (doc[sec] if sec else doc)[k] = v
    # Megatron's flag name for the expert count differs from TransformerConfig's (num_experts / num_moe_experts)
    doc["language_model"]["num_moe_experts"] = doc.pop("num_experts", None)
    doc["language_model"]["activation_func"] = "swiglu" if getattr(args, "swiglu", False) else "gelu"
    for k in ("bias_swiglu_fusion",):   # Megatron arguments core_transformer_config_from_yaml reads from the section
        if k in doc:
            doc["language_model"][k] = doc.pop(k)
    # 0.19.2's validate_yaml reads it at the top level (and merges the sections into the top level after):
    # it can be in only one place
    doc["account_for_embedding_in_pipeline_split"] = doc["language_model"].pop("account_for_embedding_in_pipeline_split", False)
    doc.update(extra_top or {})
    return doc


def write_yaml_cfg(path, args, extra_top=None):
    with open(path, "w") as fh:
        yaml.safe_dump(yaml_cfg_doc(args, extra_top), fh, sort_keys=False)
    return str(path)
