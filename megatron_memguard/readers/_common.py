"""Pieces the structured-config readers share: KEY=VALUE overrides, dtype spellings, ``_target_``
objects, and the mapping of megatron-core config field names onto Megatron argument names.

No torch, NeMo or Megatron is imported here: megatron-core's field names come from
``data/config_fields.json`` (generated at development time by ``scripts/gen_config_fields.py``).
"""
from __future__ import annotations

import copy
import enum
import json
import math
import re
from functools import lru_cache
from importlib import resources
from typing import Any, Iterable, Mapping

from ..config import RawConfig
from ..errors import ConfigError, NotModelledError, ReaderError
from ..numbers import python_scalar, shown

MISSING = "???"  # OmegaConf / Hydra's mandatory-value marker


# --------------------------------------------------------------------------------------------------
# Known field names
# --------------------------------------------------------------------------------------------------
@lru_cache(maxsize=1)
def _config_fields_doc() -> dict[str, Any]:
    return json.loads(resources.files("megatron_memguard").joinpath("data/config_fields.json").read_text())


@lru_cache(maxsize=1)
def config_fields() -> dict[str, frozenset[str]]:
    return {k: frozenset(v) for k, v in _config_fields_doc().items() if isinstance(v, list)}


@lru_cache(maxsize=1)
def bridge_sections() -> dict[str, tuple[frozenset[str], frozenset[str]]]:
    """Megatron-Bridge ConfigContainer section -> (its config class names, their field names)."""
    return {sec: (frozenset(d["classes"]), frozenset(d["fields"]))
            for sec, d in _config_fields_doc().get("BridgeSections", {}).items()}


def did_you_mean(name: str, known: Iterable[str], prefix: str = "") -> str:
    """'did you mean PREFIX.NAME?' for the closest known name (difflib), else ''."""
    import difflib

    if len(name) > 100:   # difflib's matching is quadratic in the length: no hint for a run-away key
        return ""
    close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.6)
    return f"did you mean {prefix}{close[0]}?" if close else ""


def mcore_model_fields() -> frozenset[str]:
    """Every megatron-core TransformerConfig / MLATransformerConfig / ModelParallelConfig field name."""
    f = config_fields()
    return f["ModelParallelConfig"] | f["TransformerConfig"] | f["MLATransformerConfig"]


@lru_cache(maxsize=1)
def megatron_dests() -> frozenset[str]:
    from .megatron_flags import flag_table
    return frozenset(v[0] for v in flag_table().values())


# Field names of older megatron-core releases that NeMo 2 checkpoints (and older Bridge dumps) still
# carry; megatron-core 0.16.1 dropped or renamed them. Accepted silently.
LEGACY_MCORE_FIELDS = frozenset({
    "first_pipeline_num_layers", "last_pipeline_num_layers", "pipeline_model_parallel_split_rank",
    "moe_layer_recompute", "activation_func_fp8_input_store", "memory_efficient_layer_norm",
    "num_microbatches_with_partial_activation_checkpoints", "tp_comm_overlap_disable_qkv",
    "tp_comm_overlap_disable_fc1", "moe_extended_tp", "moe_token_dropping", "encoder_num_layers",
    "encoder_pipeline_model_parallel_size", "encoder_tensor_model_parallel_size", "use_te_rng_tracker",
    "disable_parameter_transpose_cache", "enable_autocast", "autocast_dtype", "external_cuda_graph",
    "config_logger_dir", "barrier_with_L1_time",
})


# --------------------------------------------------------------------------------------------------
# Values
# --------------------------------------------------------------------------------------------------
def parse_scalar(text: str) -> Any:
    """A KEY=VALUE value as Hydra reads it: YAML scalars/lists (4, true, null, [1,2]), else the string."""
    from ..files import load_yaml
    if text.lstrip()[:1] in ("|", ">"):
        # YAML's block-scalar indicators ('model.hybrid_layer_pattern=|M*' read as '' or an error): Hydra's
        # override grammar takes such a value as text
        return text
    try:
        v = load_yaml(text, "--set")
    except ReaderError:  # not YAML (or beyond the nesting / size limits): the text itself
        return text
    t = text.strip()
    if isinstance(v, bool) and t.lower() not in ("true", "false"):
        # Hydra's override grammar has true / false only: yes, no, on, off (YAML 1.1 bools) stay words
        return t
    if isinstance(v, str):
        # a quoted value is a string in Hydra's grammar ('1' stays the text '1'); an unquoted one may be a number
        return v if t[:1] in ("'", '"') and t[-1:] == t[:1] else _number(v)
    return v


_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


def _number(v: Any) -> Any:
    """PyYAML reads ``1e-5`` as a string (YAML 1.1 wants a dot); OmegaConf reads it as a float. A
    number too long to hold stays text (resolve() refuses it under its key)."""
    if isinstance(v, str) and len(v) <= 400 and _NUMBER.fullmatch(v.strip()):
        t = v.strip()
        if "e" not in t.lower() and "." not in t:
            return int(t) if len(t.lstrip("+-")) <= 40 else v
        f = float(t)
        return f if math.isfinite(f) else v
    return v


# Gemma 2's own modules (Megatron-Bridge 0.6.2 models/gemma/gemma2_provider.py, which NeMo 2's Gemma2Config
# builds alike): gemma2_layer_spec's core attention is Gemma2FlexDotProductAttention (PyTorch FlexAttention with the
# softcap as a score_mod; its unfused parent when FlexAttention is missing, a padding mask is passed or attention
# dropout is on, which keeps the [b, a/TP, s, s] scores, their tanh softcap and a sliding-window mask), and
# Gemma2OutputLayer softcaps the [s, b, V/TP] logits. The Bridge reader estimates a Gemma2ModelProvider
# (readers/bridge.py _gemma2_modules: the FlexAttention path and the softcap); this reason refuses what is left: NeMo 2's
# Gemma2Config (its defaults not bundled) and a softcapping key under another provider.
GEMMA2_WHAT = ("Gemma 2's attention logit softcapping and final logit softcapping (Megatron-Bridge's "
               "Gemma2FlexDotProductAttention, FlexAttention or an unfused fallback keeping the [b, a, s, s] scores, and "
               "Gemma2OutputLayer, models/gemma/gemma2_provider.py)")
# Gemma 3 (Megatron-Bridge 0.6.2 models/gemma/gemma3_provider.py, NeMo 2.5.0 llm/gpt/model/gemma3.py): gemma3_layer_spec
# is a GPT layer whose linear_proj and linear_fc2 are TERowParallelLinearLayerNorm (Bridge's models/common/te_layers.py,
# NeMo's gemma2.py), a TENorm on each projection's output, and Gemma3RotaryEmbedding caches a local and a global
# rotary table: the readers set ``post_proj_norms`` and ``rotary_tables`` for them (estimator/activations.py
# post_proj_norm_items). The rest changes no saved tensor: the sliding window is TE's window_size (the same q, k, v,
# output and softmax statistics) and the embedding scale multiplies by a constant.
# NeMo 2.5.0's Gemma3Config builds the same layers (its gemma3_layer_spec, TERowParallelLinearLayerNorm from gemma2.py;
# Gemma3RotaryEmbedding returns the two cached tables as a tuple); its classes' defaults are bundled (presets.yaml
# nemo2_classes) and read by readers/nemo2.py. A Gemma 3 class NeMo 2.5.0 does not have is refused by name.
GEMMA3_NEMO2_WHAT = ("a NeMo 2 Gemma 3 config class memguard has not bundled (NeMo 2.5.0's Gemma3Config, Gemma3Config1B, "
                     "4B, 12B and 27B are; give the Bridge run_config.yaml)")
GEMMA3_VL_WHAT = ("Gemma 3 VL's vision encoder and image-aware attention bias (Megatron-Bridge's "
                  "models/gemma_vl/gemma3_vl_provider.py)")
# Gemma 3's own config fields (Bridge's Gemma3ModelProvider, NeMo 2's Gemma3Config) that decide no memory beyond
# post_proj_norms / rotary_tables / window_size: the local layers' pattern, the VL switch (refused when true),
# decode-only flash, the rope scale
GEMMA3_FIELDS = frozenset({"interleaved_attn_pattern", "is_vision_language", "flash_decode", "rope_scaling_factor"})


def is_gemma3_class(cls: str) -> bool:
    """A Gemma 3 text model class (Bridge's ``Gemma3ModelProvider...``, NeMo 2's ``Gemma3Config1B``...), not VL."""
    name = cls.strip().rsplit(".", 1)[-1]
    return name.startswith("Gemma3") and not name.startswith("Gemma3VL")


# Gemma 4 (models/gemma/gemma4_provider.py, modeling_gemma4.py): layers of its own beyond Gemma 3's post-norms.
GEMMA4_WHAT = ("Gemma 4's own layers (Megatron-Bridge's modeling_gemma4.py: per-layer embeddings and key/value "
               "shared across layers in the dense models, global-attention heads of another width, a custom MoE "
               "forward, post-attention RMSNorms and Gemma4OutputLayer's final logit softcapping)")
# the model classes / layer specs (last dotted part) whose modules memguard does not model, by class-name prefix
_GEMMA_WHAT = {"Gemma2": GEMMA2_WHAT, "Gemma3VL": GEMMA3_VL_WHAT, "Gemma4": GEMMA4_WHAT}
_GEMMA_SPECS = {"gemma2_layer_spec": GEMMA2_WHAT,
                "get_gemma4_layer_spec": GEMMA4_WHAT, "_gemma4_block_spec": GEMMA4_WHAT}
SOFTCAPPING_FIELDS = ("attn_logit_softcapping", "final_logit_softcapping")


def gemma_class_what(cls: str) -> str | None:
    """Why a Gemma 2 / 3 VL / 4 model class (Bridge's provider, NeMo 2's config: ``...Gemma4ModelProvider``,
    ``Gemma2Config9B``) is not modelled, else None. Gemma (1) is a GPT with a scaled embedding, Gemma 3 is read
    (is_gemma3_class): not listed."""
    name = cls.strip().rsplit(".", 1)[-1]
    return next((what for prefix, what in _GEMMA_WHAT.items() if name.startswith(prefix)), None)


def gemma_spec_what(spec: str) -> str | None:
    """Why a Gemma 2 / 4 layer spec (its function's name, dotted or not) is not modelled, else None."""
    return _GEMMA_SPECS.get(spec.strip().rsplit(".", 1)[-1])


def refuse_softcapping(fields: Mapping[str, tuple[Any, str]]) -> None:
    """Refuse a softcapping field other than null / 0 under its key (Bridge tests ``if softcap`` / ``if scale``);
    megatron-core has no such field: only a model class that declares it (Gemma 2's) reads it."""
    from ..errors import NotModelledError

    for name in SOFTCAPPING_FIELDS:
        value, key = fields.get(name, (None, name))
        if value is not None and not is_missing(value) and value not in (0, 0.0, False, "0", "0.0"):
            raise NotModelledError(key, GEMMA2_WHAT)


def target_name(v: Any) -> str | None:
    """``{_target_: torch.nn.functional.silu, _call_: false}`` -> ``silu``; a dotted string -> its last part."""
    if isinstance(v, Mapping):
        v = v.get("_target_")
    if v is None:
        return None
    return str(v).rsplit(".", 1)[-1]


_DTYPES = {
    "bf16": "bf16", "bfloat16": "bf16", "bf16-mixed": "bf16", "bf16_mixed": "bf16", "bf16-true": "bf16",
    "16": "fp16", "fp16": "fp16", "float16": "fp16", "half": "fp16", "16-mixed": "fp16", "16_mixed": "fp16",
    "fp16-mixed": "fp16", "fp16_mixed": "fp16", "16-true": "fp16",
    "32": "fp32", "fp32": "fp32", "float32": "fp32", "float": "fp32", "32-true": "fp32", "fp32-true": "fp32",
    "fp8": "fp8", "uint8": "fp8", "float8_e4m3fn": "fp8", "float8_e5m2": "fp8",
}


def dtype_name(v: Any, key: str) -> str | None:
    """Every way configs spell a dtype or a precision -> fp32 | bf16 | fp16 | fp8 (None stays None).

    Accepts ``{_target_: torch.bfloat16, _call_: false}``, ``torch.bfloat16``, ``bf16``, ``bf16-mixed``,
    ``16``, ``16-mixed``, ``32``, ``32-true``, as int or string (Lightning, NeMo and Bridge's DTYPE_MAP)."""
    if v is None:
        return None
    if isinstance(v, Mapping):
        v = v.get("_target_")
    if isinstance(v, bool):
        raise ConfigError(key, f"expects a dtype or precision (bf16, 16-mixed, 32, ...), got {v!r}")
    name = str(v).strip().lower()
    if name.startswith("torch."):
        name = name[len("torch."):]
    if name in _DTYPES:
        return _DTYPES[name]
    raise ConfigError(key, f"unknown dtype or precision {v!r}",
                      "use bf16, bf16-mixed, 16, 16-mixed, 32, 32-true, or torch.bfloat16 / torch.float16 / torch.float32")


def as_bool(v: Any) -> bool:
    if isinstance(v, str):
        return v.strip().lower() in ("1", "true", "yes", "on")
    return bool(v)


def true_or_false(v: Any, key: str) -> bool:
    """A true/false setting of a config, strictly (None or absent: false): ``as_bool`` reads any other word as
    false and ``bool()`` any mapping or list as true, where Bridge's and NeMo's typed configs stop."""
    v = python_scalar(v)
    if v is None or isinstance(v, bool):
        return bool(v)
    if isinstance(v, str) and v.strip().lower() in ("1", "true", "yes", "on", "0", "false", "no", "off", "", "none", "null"):
        return as_bool(v)
    if isinstance(v, (int, float)) and v in (0, 1):
        return bool(v)
    raise ConfigError(key, f"must be true or false, got {shown(v)}")


def is_missing(v: Any) -> bool:
    return isinstance(v, str) and v.strip() == MISSING


# --------------------------------------------------------------------------------------------------
# KEY=VALUE overrides (Hydra / Bridge style)
# --------------------------------------------------------------------------------------------------
_OVERRIDE = re.compile(r"^(\+{0,2}|~)([A-Za-z_][A-Za-z0-9_.\-]*)(?:=(.*))?$", re.S)


def is_override_token(tok: str) -> bool:
    """``model.tensor_model_parallel_size=4``, ``+train.x=1``, ``~model.teacher`` (not ``--flag=x``)."""
    if tok.startswith("-"):
        return False
    m = _OVERRIDE.match(tok)
    return bool(m) and (m.group(3) is not None or m.group(1) == "~")


def parse_overrides(tokens: Iterable[str]) -> list[tuple[str, str, Any]]:
    """``KEY=VALUE`` tokens -> (op, dotted key, value); op is ``set``, ``add`` (Hydra's ``+key`` / ``++key``,
    which may add a key the config lacks) or ``del`` (Hydra's ``~key``)."""
    out: list[tuple[str, str, Any]] = []
    for tok in tokens:
        m = _OVERRIDE.match(str(tok).strip())
        if not m or (m.group(3) is None and m.group(1) != "~"):
            raise ConfigError("--set", f"cannot read override {tok!r}", "write KEY=VALUE, e.g. model.tensor_model_parallel_size=4")
        if m.group(1) == "~":
            out.append(("del", m.group(2), None))
        else:
            out.append(("add" if m.group(1) else "set", m.group(2), parse_scalar(m.group(3))))
    return out


def apply_overrides(doc: dict, overrides: list[tuple[str, str, Any]], strip_prefix: str | None = None) -> dict:
    """A deep copy of ``doc`` with the overrides applied (intermediate mappings are created)."""
    doc = copy.deepcopy(doc)
    for op, key, value in overrides:
        path = key
        if strip_prefix and path.startswith(strip_prefix + "."):
            path = path[len(strip_prefix) + 1:]
        parts = path.split(".")
        node = doc
        for i, p in enumerate(parts[:-1]):
            nxt = node.get(p)
            if not isinstance(nxt, dict):
                if op == "del":
                    node = None
                    break
                if isinstance(nxt, (str, int, float, bool)):
                    # OmegaConf refuses a key below a value; replacing the value by a section dropped it silently
                    raise ConfigError(key, f"{'.'.join(parts[:i + 1])} is the value {shown(nxt)}, not a section "
                                           f"with keys")
                nxt = {}
                node[p] = nxt
            node = nxt
        if node is None:
            continue
        if op == "del":
            node.pop(parts[-1], None)
        else:
            node[parts[-1]] = value
    return doc


# --------------------------------------------------------------------------------------------------
# Building a RawConfig
# --------------------------------------------------------------------------------------------------
class ArgsBuilder:
    """Collects Megatron args with the key path each came from, plus warnings and format problems."""

    def __init__(self, source: str):
        self.source = source
        self.args: dict[str, Any] = {}
        self.origin: dict[str, str] = {}
        self.warnings: list[str] = []
        self.problems: list[ConfigError] = []
        self.world_size: int | None = None
        self.nodes: int | None = None
        self.gpus_per_node: int | None = None
        self.best_effort = False

    def set(self, dest: str, value: Any, key: str) -> None:
        self.args[dest] = value
        self.origin[dest] = key

    def default(self, dest: str, value: Any, key: str) -> None:
        """Set ``dest`` unless already set (a format default that differs from Megatron's)."""
        if dest not in self.args:
            self.set(dest, value, key)

    def warn(self, text: str) -> None:
        if text not in self.warnings:
            self.warnings.append(text)

    def trainer_world(self, devices: Any, nodes: Any) -> None:
        """The world size from a Lightning trainer's ``devices`` x ``num_nodes`` (NeMo 1 and NeMo 2)."""
        def count(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool) and v > 0

        if count(devices) and count(nodes):
            self.world_size, self.nodes, self.gpus_per_node = devices * nodes, nodes, devices
            self.origin["world_size"] = "trainer.devices x trainer.num_nodes"
        elif devices is not None:
            self.warn(f"trainer.devices is {devices!r}: the number of GPUs is not known from the file (give --gpus N)")

    def problem(self, key: str, rule: str, fix: str | None = None) -> None:
        self.problems.append(ConfigError(key, rule, fix))
        self.warn(f"{key}: {rule}" + (f" ({fix})" if fix else ""))

    def build(self) -> RawConfig:
        return RawConfig(args=dict(self.args), origin=dict(self.origin), source=self.source,
                         world_size=self.world_size, nodes=self.nodes, gpus_per_node=self.gpus_per_node,
                         warnings=tuple(self.warnings), best_effort=self.best_effort, problems=tuple(self.problems))


# Activation names (NeMo 2 / Bridge ``activation_func`` targets and Bridge's short names).
_SILU = {"silu", "swish", "fast_silu"}
_GELU = {"gelu", "fast_gelu", "openai_gelu", "erf_gelu", "approx_gelu"}


def _attention_backend(v: Any) -> str | None:
    if isinstance(v, Mapping):
        args = v.get("_args_") or []
        if not isinstance(args, (list, tuple)):
            args = [args]
        v = args[0] if args else v.get("value")
    if isinstance(v, int) and not isinstance(v, bool):
        return {1: "flash", 2: "fused", 3: "unfused", 4: "local", 5: "auto"}.get(v)
    if v is None:
        return None
    return str(v).replace("AttnBackend.", "")


# GPT-model-level settings (GPTModel / GPTConfig / GPTModelProvider) that are Megatron arguments too.
# HybridModelProvider's fields that are Megatron arguments (or were: the ratios of megatron-core 0.16)
HYBRID_FIELDS = frozenset({"hybrid_layer_pattern", "hybrid_override_pattern", "hybrid_attention_ratio",
                           "hybrid_mlp_ratio", "mamba_chunk_size"})
GPT_LEVEL_FIELDS = frozenset({"make_vocab_size_divisible_by", "position_embedding_type", "rotary_percent",
                              "rotary_base", "fp16_lm_cross_entropy"})
_HANDLED = frozenset({
    "gated_linear_unit", "activation_func", "num_moe_experts", "cpu_offloading", "cpu_offloading_num_layers",
    "num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage", "first_pipeline_num_layers",
    "last_pipeline_num_layers", "params_dtype", "bf16", "fp16", "autocast_dtype", "enable_autocast",
    "bias_activation_fusion", "attention_backend", "cross_entropy_fusion_impl", "fp8", "fp4",
    "share_embeddings_and_output_weights", "transformer_layer_spec", "use_transformer_engine_full_layer_spec",
    "seq_length", "vocab_size", "should_pad_vocab", "virtual_pipeline_model_parallel_size", "pipeline_dtype",
    "bias_dropout_add_fusion", "pipeline_model_parallel_layout",
})

# megatron-core's LayerType names in a list-form pipeline layout, and the character its string form uses
# (core 0.16.1 / 0.19.2 transformer/pipeline_parallel_layer_layout.py, parse_str_to_list).
_LAYOUT_CHARS = {"embedding": "E", "loss": "L", "decoder": "t", "mtp": "m"}


# megatron-core fields holding a list of enum members once TransformerConfig.__post_init__ has run (core 0.19
# cuda_graph_config.py turns cuda_graph_scope into CudaGraphModule members): Bridge dumps each as
# {_target_: megatron.core.transformer.enums.CudaGraphModule, _name_: moe_router, _args_: [4], _call_: true}
_ENUM_LISTS = frozenset({"cuda_graph_modules", "cuda_graph_scope"})


def _member_name(x: Any) -> Any:
    if isinstance(x, Mapping) and isinstance(x.get("_name_"), str):
        return x["_name_"]
    if isinstance(x, enum.Enum):
        return x.name
    return x


def layout_text(value: Any, key: str) -> Any:
    """A pipeline layout given as megatron-core's list of stages (``[["embedding", "decoder"], ...,
    ["decoder", "mtp", "loss"]]``, what Bridge dumps) in Megatron's string syntax (``Et|...|tmL``); a
    string is returned as it is. After Bridge's runtime_config_update the model holds megatron-core's
    PipelineParallelLayerLayout object (its ``input_data`` is what was given), which a ConfigContainer read as an
    object (the pre-flight) carries as that object or its attributes."""
    if hasattr(value, "input_data") and not isinstance(value, (str, list, tuple, Mapping)):
        value = value.input_data
    elif isinstance(value, Mapping) and "input_data" in value:
        value = value["input_data"]
    if not isinstance(value, (list, tuple)):
        return value
    stages = []
    for stage in value:
        if not isinstance(stage, (list, tuple)):
            raise ConfigError(key, f"must be a string or a list of lists of layer names, got an entry {shown(stage)}")
        chars = []
        for name in stage:
            n = str(getattr(name, "name", name)).strip().removeprefix("LayerType.")
            ch = _LAYOUT_CHARS.get(n, n if n in _LAYOUT_CHARS.values() else None)
            if ch is None:
                raise ConfigError(key, f"unknown layer type {shown(name)}; use " + ", ".join(_LAYOUT_CHARS))
            chars.append(ch)
        stages.append("".join(chars))
    return "|".join(stages)


@lru_cache(maxsize=1)
def typed_defaults() -> dict[str, dict[str, Any]]:
    """Model-config fields typed int / float / bool whose dataclass default is a value, not None (megatron-core
    0.16.1 / 0.19.2, Megatron-Bridge 0.6.2; data/typed_defaults.json, made by scripts/gen_typed_defaults.py)."""
    return _typed_defaults_doc()["fields"]


@lru_cache(maxsize=1)
def _typed_defaults_doc() -> dict[str, Any]:
    return json.loads(resources.files("megatron_memguard").joinpath("data/typed_defaults.json").read_text())


def model_bool_fields() -> frozenset[str]:
    """Model-config fields annotated ``bool`` or ``Optional[bool]`` in megatron-core 0.16.1 / 0.19.2 and Megatron-Bridge
    0.6.2's providers, whatever their default (data/typed_defaults.json ``bool_fields``)."""
    return frozenset(_typed_defaults_doc().get("bool_fields", ()))


def section_typed_field(section: str, name: str) -> dict[str, Any] | None:
    """A Megatron-Bridge 0.6.2 non-model section field typed int / float / bool / str / torch.dtype whose default is
    a value or that has none ('required'): {type, default, class}; None for a None-able or unknown field
    (data/typed_defaults.json ``sections``, made by scripts/gen_typed_defaults.py --sections)."""
    return _typed_defaults_doc().get("sections", {}).get(section, {}).get(name)


@lru_cache(maxsize=1)
def memory_neutral_dests() -> frozenset[str]:
    """Megatron argument dests memguard neither reads nor refuses (data/memory_neutral_flags.json ``neutral``)."""
    doc = json.loads(resources.files("megatron_memguard").joinpath("data/memory_neutral_flags.json").read_text())
    return frozenset(doc["neutral"])


def yaml_cfg_arg_default(dest: str) -> Any:
    """Megatron's argparse default of ``dest`` where it is neither None nor False (megatron-core 0.19.2
    arguments.py; data/typed_defaults.json ``yaml_cfg_arg_defaults``), else None."""
    return _typed_defaults_doc().get("yaml_cfg_arg_defaults", {}).get(dest)


def refuse_unset_section_field(section: str, name: str, field: tuple[Any, str] | None, needed: Iterable[str] = (),
                               carrier: str = "Megatron-Bridge") -> None:
    """'???' and null on a Megatron-Bridge non-model section field memguard reads (train, optimizer, ddp, dist,
    mixed_precision, dataset, tokenizer, comm_overlap, ...): Bridge hands both on as they are (omegaconf_utils
    _apply_overrides / instantiate: no type check), so neither is the default. Refused: '???' always; null where the
    dataclass declares int / float / str / torch.dtype with a value default or none, or bool defaulting to true (a
    None-able field keeps None's meaning, a bool defaulting to false reads None as false, its default), and on
    ``needed`` fields ConfigContainer.validate asserts are set (train.micro_batch_size, global_batch_size). A
    value a built-in recipe carries (its key tagged '(recipe ...)') is Bridge's own, not checked. ``carrier``: NeMo 2,
    whose OptimizerConfig / DistributedDataParallelConfig are megatron-core's, as Bridge's sections are."""
    if field is None or " (recipe " in field[1]:
        return
    value, key = field
    where = key.split(" ")[0]
    if is_missing(value):
        raise ConfigError(key, f"is ??? (OmegaConf's missing marker): {_MISSING_RULE[carrier]}",
                          f"set {where}=VALUE")
    if value is not None:
        return
    if name in needed:
        raise ConfigError(key, "is null: Megatron-Bridge's ConfigContainer.validate asserts it is set (no default)",
                          f"set {where}=VALUE")
    f = section_typed_field(section, name)
    if f is None or (f["type"] == "bool" and f["default"] is not True):
        return
    declared = "with no default" if f["default"] == "required" else f"with default {f['default']}"
    raise ConfigError(key, f"is null: {carrier} passes None on, where {f['class']} declares {f['type']} "
                           f"{declared} (the default is not taken)", f"set {where}=VALUE or drop the key")


def null_not_default(name: str) -> bool:
    """A null on this field is not its default: an int or float (None fails in arithmetic and comparisons), or a
    bool whose default is true (None is false wherever Megatron tests it). A bool defaulting to false reads None as
    its default; a None-able field (Optional, or defaulting to None) is not in the table: None has its meaning."""
    f = typed_defaults().get(name)
    return f is not None and (f["type"] != "bool" or f["default"] is True)


# What each framework does with OmegaConf's '???' and with a null on a model-config field memguard reads
# (``refuse_unset``'s ``carrier``): the sentence naming it in the error.
_MISSING_RULE = {
    # Bridge 0.6.2 omegaconf_utils.py: OmegaConf.to_container leaves '???' as the text
    "Megatron-Bridge": "Megatron-Bridge passes the text '???' on, not a default",
    # NeMo 1 (NeMo 2.5 nlp/models/language_modeling/megatron_base_model.py build_transformer_config): cfg[field.name]
    # of OmegaConf.to_container(self.cfg, resolve=True), which keeps '???' as text (throw_on_missing=False)
    "NeMo": "NeMo copies the text '???' into TransformerConfig (build_transformer_config), not a default",
    # NeMo 2's io exports are plain YAML rebuilt by fiddle: the text '???' is the value
    "NeMo 2": "NeMo 2 rebuilds the config with the text '???' as the value, not a default",
    # megatron-core 0.19.2 megatron/training/yaml_arguments.py load_yaml: yaml.safe_load, no OmegaConf
    "Megatron's --yaml-cfg": "Megatron's --yaml-cfg reads it with yaml.safe_load as the text '???', not a default",
}


def refuse_unset(fields: Mapping[str, tuple[Any, str]], marker_names: frozenset[str], read: frozenset[str],
                 carrier: str) -> None:
    """'???' and null are what the framework (``carrier``) keeps, not the default memguard would otherwise take.
    Megatron-Bridge keeps what the YAML says: OmegaConf's missing marker '???' stays the text '???' (OmegaConf.to_container
    leaves it, Bridge 0.6.2 omegaconf_utils.py) and a null stays None (omegaconf_utils _apply_overrides / instantiate
    set the attribute, no type check); NeMo 1 copies a null into TransformerConfig (build_transformer_config), NeMo 2
    and --yaml-cfg build the dataclass from it. Refused: '???' on ``marker_names``, a null on a field memguard reads
    (``read``) where ``null_not_default`` (the mamba_* sizes only for a hybrid model, the one that reads them; an
    emptied pattern is refused by map_mcore_fields as a hybrid model without one)."""
    hybrid = any(fields.get(n, (None,))[0] not in (None, "") and not is_missing(fields.get(n, (None,))[0])
                 for n in ("hybrid_layer_pattern", "hybrid_override_pattern"))
    for name, (value, path) in fields.items():
        if is_missing(value) and name in marker_names and "pattern" not in name:
            raise ConfigError(path, f"is ??? (OmegaConf's missing marker): {_MISSING_RULE[carrier]}",
                              f"set {path.split(' ')[0]}=VALUE")
        if value is None and name in read and null_not_default(name) and (hybrid or not name.startswith("mamba_")):
            f = typed_defaults()[name]
            if name.startswith("mamba_"):
                rule = f"is null: {carrier} passes None to the hybrid model, which needs an integer (its default is not taken)"
            else:
                rule = (f"is null: {carrier} passes None on, where {f['classes'][0]} declares {f['type']} with "
                        f"default {f['default']} (the default is not taken)")
            raise ConfigError(path, rule, f"set {path.split(' ')[0]}=VALUE or drop the key")


def model_fields_read() -> frozenset[str]:
    """The model-config field names map_mcore_fields reads (passes on or translates)."""
    return _HANDLED | HYBRID_FIELDS | (megatron_dests() & (mcore_model_fields() | LEGACY_MCORE_FIELDS | GPT_LEVEL_FIELDS))


def map_mcore_fields(b: ArgsBuilder, fields: Mapping[str, tuple[Any, str]], extra_known: Iterable[str] = (),
                     unknown_context: str | None = None, skip: Iterable[str] = (), provider: bool = True,
                     bridge: bool = False, carrier: str | None = None) -> None:
    """Map megatron-core config fields (``{name: (value, key path)}``) onto Megatron args.

    Fields whose name is also a Megatron argument ``dest`` pass through; the handful whose name or
    meaning differs are translated (num_moe_experts, gated_linear_unit + activation_func, params_dtype,
    cpu_offloading, first/last pipeline stage layers, ...); other megatron-core fields do not change
    memory and pass silently. Names that are neither megatron-core fields nor in ``extra_known`` get a
    warning naming ``unknown_context`` (None: no warnings). ``provider``: the fields are a model provider's or
    config class's (only hybrid ones have the pattern fields), not Megatron's flat argument names. ``bridge``: the
    fields are a Megatron-Bridge YAML's, where '???' and a null are passed on as they are (``refuse_unset``);
    ``carrier``: the framework whose '???' and null ``refuse_unset`` refuses on the fields read (bridge: Megatron-Bridge)."""
    dests = megatron_dests()
    passthrough = mcore_model_fields() | LEGACY_MCORE_FIELDS | GPT_LEVEL_FIELDS
    known = passthrough | frozenset(extra_known)
    skip = set(skip)
    fields = {n: v for n, v in fields.items() if n not in skip}
    if bridge:
        refuse_unset(fields, passthrough | HYBRID_FIELDS, model_fields_read(), "Megatron-Bridge")
    elif carrier is not None:
        refuse_unset(fields, model_fields_read(), model_fields_read(), carrier)

    def val(name: str) -> Any:
        return fields[name][0] if name in fields else None

    def key(name: str) -> str:
        return fields[name][1]

    def on(name: str) -> bool:
        return true_or_false(fields[name][0], fields[name][1]) if name in fields else False

    patterns = [n for n in ("hybrid_layer_pattern", "hybrid_override_pattern") if n in fields]
    if provider and patterns and all(val(n) in (None, "") or is_missing(val(n)) for n in patterns):
        # a hybrid provider whose pattern was emptied (model.hybrid_layer_pattern=null): Bridge 0.6.2's
        # HybridModelProvider then allocates the layers from hybrid_attention_ratio / hybrid_mlp_ratio (all Mamba at
        # 0), where the layers estimated as GPT layers silently
        raise NotModelledError(key(patterns[0]), "a hybrid model without a layer pattern (Megatron-Bridge then "
                               "allocates its layers from hybrid_attention_ratio / hybrid_mlp_ratio)")
    for name, (value, path) in fields.items():
        if name in _HANDLED or name.startswith("_"):
            continue
        if name in HYBRID_FIELDS:
            # HybridModelProvider / HybridModelConfig (Bridge 0.6.2, core 0.19.2 training/models/hybrid.py): the
            # pattern under its flag's dest; the deprecated ratios only when set (resolve refuses them by name); the
            # chunk size whenever given (finalize raises below 1: resolve refuses 0 by name)
            if is_missing(value) or value is None:
                continue
            if name == "mamba_chunk_size" or (name in ("hybrid_layer_pattern", "hybrid_override_pattern") and value != ""):
                b.set(name, value, path)      # (a chunk size of 0 or '', a pattern of 0: refused by name, not dropped)
            elif value not in ("", 0, 0.0):
                b.set(name, value, path)
            continue
        # (cuda_graph_scope: TransformerConfig's deprecated field, which megatron-core 0.19's cuda_graph_config.py
        # migrates to cuda_graph_modules; the 0.19 parser's dest is cuda_graph_scope_deprecated, so it is no dest)
        if (name in dests or name == "cuda_graph_scope") and name in passthrough:
            # (an object spec, ``{_target_: ...}``, is code Megatron calls, not a value; any other mapping is kept
            # so that resolve() refuses it under its key instead of the default being taken silently)
            if value is None or (isinstance(value, Mapping) and "_target_" in value) or is_missing(value):
                continue
            if name in _ENUM_LISTS and isinstance(value, (list, tuple)):
                value = [_member_name(x) for x in value]
            b.set(name, _number(value), path)
        elif name not in known and unknown_context is not None:
            b.warn(f"{path}: not a {unknown_context} setting; ignored")

    # Activation: gated MLP and its function.
    act = target_name(val("activation_func")) if "activation_func" in fields else None
    act = (act or "gelu").lower()
    gated = on("gated_linear_unit")
    gkey = key("gated_linear_unit") if "gated_linear_unit" in fields else (key("activation_func") if "activation_func" in fields else None)
    if gated:
        if act in _SILU:
            b.set("swiglu", True, gkey)
        elif act == "quick_gelu":
            b.set("quick_geglu", True, gkey)
        else:
            b.set("gated_linear_unit", True, gkey)
    elif act in ("squared_relu",):
        b.set("squared_relu", True, key("activation_func"))
    elif "gated_linear_unit" in fields:
        b.set("swiglu", False, gkey)

    if val("num_moe_experts"):
        b.set("num_experts", val("num_moe_experts"), key("num_moe_experts"))
    if as_bool(val("cpu_offloading")) and val("cpu_offloading_num_layers"):
        b.set("cpu_offloading_num_layers", val("cpu_offloading_num_layers"), key("cpu_offloading_num_layers"))
    for names, dest in ((("num_layers_in_first_pipeline_stage", "first_pipeline_num_layers"), "decoder_first_pipeline_num_layers"),
                        (("num_layers_in_last_pipeline_stage", "last_pipeline_num_layers"), "decoder_last_pipeline_num_layers")):
        for n in names:
            if val(n) is not None:
                b.set(dest, val(n), key(n))
                break
    if val("pipeline_model_parallel_layout") is not None:
        b.set("pipeline_model_parallel_layout",
              layout_text(val("pipeline_model_parallel_layout"), key("pipeline_model_parallel_layout")),
              key("pipeline_model_parallel_layout"))
    vpp = val("virtual_pipeline_model_parallel_size")
    if vpp is not None:
        b.set("virtual_pipeline_model_parallel_size", vpp, key("virtual_pipeline_model_parallel_size"))
    # Precision: bf16 / fp16 flags, else the params dtype.
    for flag in ("bf16", "fp16"):
        if flag in fields and val(flag) is not None:
            b.set(flag, on(flag), key(flag))
    if "params_dtype" in fields and val("params_dtype") is not None:
        pd = dtype_name(val("params_dtype"), key("params_dtype"))
        if pd in ("bf16", "fp16") and not any(on(f) for f in ("bf16", "fp16")):
            b.set(pd, True, key("params_dtype"))
    if on("enable_autocast") and val("autocast_dtype") is not None:
        ad = dtype_name(val("autocast_dtype"), key("autocast_dtype"))
        b.set("autocast_dtype", ad, key("autocast_dtype"))
    if val("bias_activation_fusion") is not None:
        b.set("bias_activation_fusion", on("bias_activation_fusion"), key("bias_activation_fusion"))
    if val("bias_dropout_add_fusion") is not None and "bias_dropout_fusion" not in fields:
        b.set("bias_dropout_fusion", on("bias_dropout_add_fusion"), key("bias_dropout_add_fusion"))
    if val("attention_backend") is not None:
        ab = _attention_backend(val("attention_backend"))
        if ab:
            b.set("attention_backend", ab, key("attention_backend"))
        else:   # (a mapping that is no AttnBackend, or an enum number AttnBackend lacks, was dropped: auto)
            raise ConfigError(key("attention_backend"), f"expects an AttnBackend (flash, fused, unfused, local, auto), "
                              f"got {shown(val('attention_backend'))}")
    for flag in ("fp8", "fp4"):
        v = val(flag)
        if v not in (None, False, "", "none", "None"):
            b.set(flag, v, key(flag))
    # TransformerConfig's names for FP8 settings whose flag is spelled otherwise (fp8_param is what
    # --fp8-param-gather sets) or that have no flag at all (kept under the config name)
    for name, dest in (("fp8_param", "fp8_param_gather"), ("fp4_param", "fp4_param_gather"),
                       ("disable_parameter_transpose_cache", "disable_parameter_transpose_cache"),
                       ("activation_func_fp8_input_store", "activation_func_fp8_input_store"),
                       ("fp8_dot_product_attention", "fp8_dot_product_attention"),
                       ("fp8_multi_head_attention", "fp8_multi_head_attention")):
        if on(name):
            b.set(dest, True, key(name))
    if val("share_embeddings_and_output_weights") is not None:
        b.set("untie_embeddings_and_output_weights", not on("share_embeddings_and_output_weights"),
              key("share_embeddings_and_output_weights"))
    spec = target_name(val("transformer_layer_spec"))
    if spec and "local" in spec.lower():
        b.set("transformer_impl", "local", key("transformer_layer_spec"))
    if val("seq_length") is not None:
        b.set("seq_length", val("seq_length"), key("seq_length"))
    # cross_entropy_fusion_impl is deliberately not passed: Megatron-LM's arguments.py rejects "te" with
    # --cross-entropy-loss-fusion since core 0.18, but Bridge and NeMo 2 recipes use that pair (and it
    # does not change memory).


def group_query_attention(b: ArgsBuilder, fields: Mapping[str, tuple[Any, str]]) -> None:
    """A config's ``num_query_groups`` means grouped-query attention, except with multi-latent attention:
    Bridge's and NeMo 2's MLA providers carry num_query_groups (= heads) although MLA attention never
    reads it (megatron-core 0.19.2 transformer/multi_latent_attention.py), while Megatron's
    --group-query-attention is refused with --multi-latent-attention."""
    f = fields.get("num_query_groups")
    if f is None or f[0] is None or is_missing(f[0]):
        return
    if as_bool((fields.get("multi_latent_attention") or (False,))[0]):
        b.args.pop("num_query_groups", None)
        return
    b.set("group_query_attention", True, f[1])


def default_ffn_hidden_size(b: ArgsBuilder, hidden: Any, key: str) -> None:
    """megatron-core's TransformerConfig.__post_init__ default, 4 x hidden_size (also for gated MLPs,
    unlike Megatron's --swiglu default of 8/3 h). A hidden size that is not an integer is left for
    resolve() to report against its key."""
    h = _number(hidden)
    if isinstance(h, int) and not isinstance(h, bool):
        b.set("ffn_hidden_size", 4 * h, key)


def set_vocab(b: ArgsBuilder, vocab_size: Any, vocab_key: str, pad: bool) -> None:
    """A vocabulary size written in the config. ``pad``: Megatron's padding to a multiple of
    make_vocab_size_divisible_by x TP applies (else the size is used as is, Bridge/NeMo 2's preset vocab)."""
    if vocab_size is None:
        return
    if pad:
        # A named tokenizer type that memguard's table does not know makes resolve() use vocab_size.
        b.default("tokenizer_type", "HuggingFaceTokenizer", vocab_key)
        b.set("vocab_size", vocab_size, vocab_key)
    else:
        b.set("padded_vocab_size", vocab_size, vocab_key)
        b.set("vocab_size", vocab_size, vocab_key)


# Megatron-FSDP and optimizer-offload fields of megatron-core's DistributedDataParallelConfig and
# OptimizerConfig, under their Megatron args names. Where the dataclass default differs from the
# CLI's, the dataclass default is what a config container runs with: data_parallel_sharding_strategy
# "no_shard" (DistributedDataParallelConfig, 0.16.1 and 0.19.2; the CLI's is optim_grads_params in
# 0.19.2) and optimizer_offload_fraction 0.0 (OptimizerConfig; the CLI's is 1.0).
_FSDP_DDP_KEYS = (("data_parallel_sharding_strategy", None), ("fsdp_double_buffer", None),
                  ("suggested_communication_unit_size", None), ("outer_dp_sharding_strategy", None),
                  ("keep_fp8_transpose_cache", None), ("megatron_fsdp_main_params_dtype", None),
                  ("megatron_fsdp_main_grads_dtype", None), ("megatron_fsdp_grad_comm_dtype", None),
                  ("megatron_fsdp_max_pool_double_buffer", None), ("fsdp_db_use_persist_buf_on_alloc_fail", None),
                  ("preserve_fp32_weights", None), ("torch_fsdp2_reshard_after_forward", None),
                  ("reshard_after_forward", "torch_fsdp2_reshard_after_forward"),
                  ("megatron_fsdp_enable_fine_grained_param_gather", None), ("megatron_fsdp_cuda_graph_mode", None),
                  ("megatron_fsdp_use_decoupled_grad", None), ("fsdp_all_gather_in_start_param_sync", None),
                  # DDP's fp32 gradient options (resolve/optimizer.py), under the Megatron flags' dests
                  ("reduce_scatter_with_fp32_accumulation", "ddp_reduce_scatter_with_fp32_accumulation"),
                  ("param_name_patterns_for_fp32_local_accumulation", "ddp_param_name_patterns_for_fp32_local_accumulation"))
_OFFLOAD_OPTIMIZER_KEYS = ("optimizer_offload_fraction", "overlap_cpu_optimizer_d2h_h2d",
                           "use_torch_optimizer_for_cpu_offload", "pin_cpu_grads", "pin_cpu_params")


def fsdp_and_offload_keys(b: ArgsBuilder, val, key, ddp_sec: str, opt_sec: str) -> None:
    """Copy the Megatron-FSDP keys of the DDP section and the offload keys of the optimizer section
    (``val(sec, name)`` is None when absent) and apply the dataclass defaults named above."""
    for name, dest in _FSDP_DDP_KEYS:
        value = val(ddp_sec, name)
        if value is None:
            continue
        if name.endswith("_dtype") and str(value).strip().lower() not in ("auto", "none"):
            value = dtype_name(value, key(ddp_sec, name))
        b.set(dest or name, value, key(ddp_sec, name))
    for name in _OFFLOAD_OPTIMIZER_KEYS:
        value = val(opt_sec, name)
        if value is not None:
            b.set(name, value, key(opt_sec, name))
    if as_bool(b.args.get("use_megatron_fsdp", False)) or as_bool(b.args.get("use_custom_fsdp", False)):
        b.default("data_parallel_sharding_strategy", "no_shard",
                  f"{ddp_sec} (DistributedDataParallelConfig default)")
    if as_bool(b.args.get("optimizer_cpu_offload", False)):
        b.default("optimizer_offload_fraction", 0.0, f"{opt_sec} (OptimizerConfig default)")


def emerging_optimizer(b: ArgsBuilder, name: str, key: str, layer_wise_key: bool) -> None:
    """An OptimizerConfig's ``optimizer`` as Bridge 0.6.2 (training/optim.py setup_optimizer) and NeMo 2
    (MegatronOptimizerModule) hand it to get_megatron_optimizer (megatron-core 0.19
    ``_get_megatron_emerging_optimizer``): a ``dist_`` name (``dist_muon``, ``dist_lion``, ``dist_soap``...) or
    ``use_layer_wise_distributed_optimizer`` selects the layer-wise distributed optimizer. Unlike Megatron-LM's
    validate_args, neither turns ``use_distributed_optimizer`` into it: without a layer-wise
    request the emerging optimizer's state stays whole on every rank (the non-layer-wise chain), and a layer-wise
    request without DDP's distributed-optimizer buffers takes core 0.19's legacy ping-pong path."""
    opt = name.strip().lower()
    bare = opt[len("dist_"):] if opt.startswith("dist_") else opt
    if bare not in ("muon", "adaptive_muon", "lion", "soap"):
        b.set("optimizer", name, key)
        return
    layer_wise = opt != bare or layer_wise_key
    dist = as_bool(b.args.get("use_distributed_optimizer", False))
    if layer_wise and not dist:
        raise NotModelledError(key, f"{opt}'s layer-wise optimizer without use_distributed_optimizer (megatron-core "
                                    "0.19's legacy ping-pong sharding of every parameter)")
    if dist and not layer_wise:
        raise NotModelledError(key, f"{opt} with use_distributed_optimizer but no layer-wise optimizer (megatron-core's "
                                    "non-layer-wise emerging-optimizer chain over distributed-optimizer buffers; use "
                                    f"dist_{bare} or use_layer_wise_distributed_optimizer)")
    # dist_muon is the one spelling both megatron-core 0.16 and 0.19 take for Muon's layer-wise optimizer
    b.set("optimizer", "dist_muon" if bare == "muon" and layer_wise else bare, key)
    if layer_wise:
        b.set("use_layer_wise_distributed_optimizer", True, key)


def peft_module_list(name: str, value: Any, key: str, carrier: str) -> Any:
    """A LoRA / DoRA ``target_modules`` or ``exclude_modules`` value as ModuleMatcher.match reads it (Megatron-Bridge
    0.6.2 and NeMo 2.5.0 peft/module_matcher.py, alike): the list to hand resolve/peft.py, or None for nothing to set.
    target_modules: ``len(self.target_modules or []) > 0`` then ``for pattern in self.target_modules``, so a null or
    '' wraps every linear module (as an empty list: [], which resolve/peft.py refuses) and a string's characters match
    no module. exclude_modules: ``len(self.exclude_modules)`` / ``name not in self.exclude_modules`` on every module,
    so a null stops the adapters' build (TypeError); an empty list excludes nothing. '???' is the text, not a default."""
    if is_missing(value):
        raise ConfigError(key, f"is ??? (OmegaConf's missing marker): {carrier} passes the text '???' on, not a default",
                          f"set {key}=[...]")
    if name == "exclude_modules":
        if value is None:
            raise ConfigError(key, f"is null: {carrier}'s ModuleMatcher takes len() of it for every module (TypeError "
                              "when the adapters are built), its default [] is not taken", f"drop {key} or give []")
        return value or None
    if value is None or isinstance(value, str):
        if value:
            raise ConfigError(key, f"must be a list of module names, got the string {shown(value)} ({carrier}'s "
                              "ModuleMatcher iterates its characters: no module matches)", f"{key}=[{value}]")
        return []
    return value
