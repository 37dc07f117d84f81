"""Megatron-Bridge ConfigContainer YAML: full ``run_config.yaml`` / ``save_config_filepath`` dumps and
partial override files (``--config-file``), plus ``KEY=VALUE`` overrides.

Read in Megatron-Bridge 0.6.2 (``training/config.py`` ConfigContainer and
``_validate_and_sync_distributed_optimizer_settings``, ``training/mixed_precision.py`` presets,
``models/gpt_provider.py`` GPTModelProvider, ``training/setup.py`` vocabulary handling).

* Both model layouts: flat ``model.<field>`` (GPTModelProvider, releases up to 0.6.x) and nested
  ``model.transformer.<field>`` (the builder config on main since mid-2026); a field is looked up in
  ``model.transformer`` first, then ``model`` (Bridge proxies attributes both ways, so overrides may
  use either spelling).
* dtypes as ``{_target_: torch.bfloat16, _call_: false}`` or strings (``bf16``, ``torch.bfloat16``,
  ``bf16-mixed``...); ``mixed_precision`` as a preset name or a MixedPrecisionConfig mapping, which
  overwrites the model / optimizer / DDP precision fields as Bridge's ``MixedPrecisionConfig.setup`` does.
* ``ddp.use_distributed_optimizer`` OR ``optimizer.use_distributed_optimizer`` (Bridge enables both
  when either is set); the same for ``overlap_param_gather``.
* Partial override files name no shape: the recipe comes from ``--model RECIPE`` (data/presets.yaml)
  and the file is merged over it.
* The world size is not in the file (``--gpus``); ``comm_overlap.data_parallel_size`` is used as a hint.
"""
from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any, Iterable, Mapping

from ..config import RawConfig
from ..errors import ConfigError, NotModelledError, ReaderError
from ..numbers import python_scalar, shown
from ..partition import parse_pipeline_layout
from ._common import (
    GPT_LEVEL_FIELDS, HYBRID_FIELDS, LEGACY_MCORE_FIELDS, ArgsBuilder, _member_name, as_bool, bridge_sections,
    config_fields, default_ffn_hidden_size, did_you_mean, dtype_name, emerging_optimizer, fsdp_and_offload_keys,
    group_query_attention, is_missing, layout_text, map_mcore_fields, mcore_model_fields, model_bool_fields,
    GEMMA2_WHAT, gemma_class_what, gemma_spec_what, peft_module_list, refuse_softcapping, refuse_unset_section_field,
    section_typed_field, set_vocab, target_name, true_or_false,
)

BRIDGE_SECTIONS = frozenset({
    "train", "model", "optimizer", "ddp", "dist", "validation", "scheduler", "dataset", "logger", "tokenizer",
    "checkpoint", "rng", "rerun_state_machine", "ft", "straggler", "nvrx_straggler", "profiling", "peft",
    "comm_overlap", "mixed_precision", "tensor_inspect", "inprocess_restart", "env_vars",
    "optimizer_config_override_provider", "_target_", "data_parallel_size",
})
# Bridge model-level keys that are neither megatron-core nor GPTModelProvider fields.
_MODEL_EXTRAS = frozenset({
    "_builder_", "transformer", "teacher", "kd_config", "generation_config", "pre_wrap_hooks", "hf_model_id",
    "hf_model_revision", "use_arbitrary_attention_mask", "restore_modelopt_state", "rope_scaling",
    "rope_scaling_factor", "rotary_scaling_factor", "seq_len_interpolation_factor", "mtp_enabled",
    "use_te_activation_func", "pipeline_dtype", "vocab_size", "should_pad_vocab", "seq_length",
    "share_embeddings_and_output_weights", "max_position_embeddings", "parallel_output",
    # HybridModelProvider (models/hybrid/hybrid_provider.py): its layer spec (the TE hybrid stack memguard models),
    # and the MTP layers' dtype under FP8 (resolve refuses FP8 with a hybrid model)
    "hybrid_stack_spec", "keep_mtp_spec_in_bf16",
}) | HYBRID_FIELDS   # and its hybrid fields, passed on as Megatron's flags (resolve/hybrid.py reads or refuses them)

# The model provider classes whose every field memguard knows (megatron-core's config fields, GPTModelProvider's,
# GPTModelConfig's and the extras above): those of memguard's recipes in Bridge 0.6.2 (gpt_provider.py,
# mla_provider.py, olmoe/olmoe_provider.py, hybrid/hybrid_provider.py; tests/test_bridge_real.py checks both). An
# unknown model.* key is then refused / warned as the other sections' are; other providers (Gemma,
# vision-language...) add fields of their own, so an unknown key there is only warned about.
_CHECKED_PROVIDERS = frozenset({"GPTModelProvider", "MLAModelProvider", "OlMoEModelProvider", "HybridModelProvider"})


def model_known_fields() -> frozenset[str]:
    """Every field name of a model section memguard knows (the providers of _CHECKED_PROVIDERS have no other)."""
    f = config_fields()
    return (mcore_model_fields() | LEGACY_MCORE_FIELDS | GPT_LEVEL_FIELDS | f.get("GPTModelProvider", frozenset())
            | f.get("GPTModelConfig", frozenset()) | _MODEL_EXTRAS)


def _model_checked(model: Mapping[str, Any]) -> bool:
    """Whether the model section's provider is one whose fields memguard knows (no _target_: a recipe's)."""
    target = model.get("_target_", (None,))[0]
    return not isinstance(target, str) or target.rsplit(".", 1)[-1] in _CHECKED_PROVIDERS


# training/mixed_precision.py presets (underscore and hyphen names): the fields they set that decide
# memory (Megatron-Bridge 0.6.2, training/mixed_precision.py, one function per preset).
_BF16 = {"bf16": True, "fp16": False, "params_dtype": "bf16", "grad_reduce_in_fp32": True}
_FP16 = {"bf16": False, "fp16": True, "params_dtype": "fp16", "grad_reduce_in_fp32": False}
_DELAYED = {"fp8": "hybrid", "fp8_recipe": "delayed", "fp8_margin": 0, "fp8_amax_history_len": 1024,
            "fp8_amax_compute_algo": "max", "fp8_param_gather": True}
_MXFP8 = {"fp8": "e4m3", "fp8_recipe": "mxfp8", "fp8_param_gather": True, "reuse_grad_buf_for_mxfp8_param_ag": True}
_CURRENT = {"fp8": "hybrid", "fp8_recipe": "tensorwise", "first_last_layers_bf16": True,
            "num_layers_at_start_in_bf16": 1, "num_layers_at_end_in_bf16": 1, "fp8_param_gather": True}
_SUBCHANNEL = {"fp8": "hybrid", "fp8_recipe": "blockwise", "fp8_param_gather": False}
_NVFP4 = {"fp8": None, "fp4": "e2m1", "fp4_recipe": "nvfp4", "fp8_param_gather": False, "fp4_param_gather": True}
MIXED_PRECISION_PRESETS: dict[str, dict[str, Any]] = {
    "bf16_mixed": _BF16,
    "fp16_mixed": _FP16,
    "bf16_with_fp8_delayed_scaling_mixed": {**_BF16, **_DELAYED},
    "fp16_with_fp8_delayed_scaling_mixed": {**_FP16, **_DELAYED},
    "bf16_with_mxfp8_mixed": {**_BF16, **_MXFP8},
    "fp16_with_mxfp8_mixed": {**_FP16, **_MXFP8},
    "bf16_with_fp8_current_scaling_mixed": {**_BF16, **_CURRENT},
    "nemotron_h_bf16_with_fp8_current_scaling_mixed": {**_BF16, **_CURRENT, "num_layers_at_start_in_bf16": 2,
                                                       "num_layers_at_end_in_bf16": 2},
    "nanov2_bf16_with_fp8_current_scaling_mixed": {**_BF16, **_CURRENT, "fp8_recipe": "blockwise",
                                                   "num_layers_at_start_in_bf16": 2, "num_layers_at_end_in_bf16": 2},
    "fp16_with_fp8_current_scaling_mixed": {**_FP16, **_CURRENT},
    "bf16_with_fp8_subchannel_scaling_mixed": {**_BF16, **_SUBCHANNEL},
    "fp16_with_fp8_subchannel_scaling_mixed": {**_FP16, **_SUBCHANNEL},
    "bf16_with_nvfp4_mixed": {**_BF16, **_NVFP4},
    "nemotron_3_super_bf16_with_nvfp4_mixed": {**_BF16, **_NVFP4, "first_last_layers_bf16": True,
                                               "num_layers_at_end_in_bf16": 14},
    "nemotron_3_ultra_bf16_with_nvfp4_mixed": {**_BF16, **_NVFP4, "first_last_layers_bf16": True,
                                               "num_layers_at_start_in_bf16": 0, "num_layers_at_end_in_bf16": 16},
}
# MixedPrecisionConfig defaults (a mapping overwrites these fields even where it does not write them).
# Bridge's FP8 defaults differ from Megatron's flags: recipe tensorwise (Megatron: delayed), no BF16
# layers at the ends (Megatron: 1 and 1 when --first-last-layers-bf16 is on).
_MP_FP8_DEFAULTS = {"fp8_recipe": "tensorwise", "first_last_layers_bf16": False, "fp8_margin": 0,
                    "fp8_amax_history_len": 1, "fp8_amax_compute_algo": "most_recent", "fp8_wgrad": True,
                    "fp8_param_gather": False, "fp4_recipe": "nvfp4", "fp4_param_gather": False,
                    "num_layers_at_start_in_bf16": 0, "num_layers_at_end_in_bf16": 0,
                    "reuse_grad_buf_for_mxfp8_param_ag": False}
_MP_DEFAULTS = {"bf16": False, "fp16": False, "params_dtype": None, "grad_reduce_in_fp32": True, "fp8": None, "fp4": None,
                "autocast_enabled": False, "autocast_dtype": None, **_MP_FP8_DEFAULTS}


def _graph_names(value: Any) -> set[str]:
    """CUDA graph module / scope names however a config holds them: "attn,mlp", a list of names, megatron-core's
    enum members or Bridge's dump of them ({_name_: attn, ...})."""
    if value is None:
        return set()
    items = value.split(",") if isinstance(value, str) else value if isinstance(value, (list, tuple)) else [value]
    return {str(_member_name(x)).rsplit(".", 1)[-1] for x in items if x not in ("", None)}


def bridge_truth(b: ArgsBuilder, value: Any, key: str) -> bool:
    """A bool field of Bridge's section dataclasses (optimizer, ddp, dist, rerun_state_machine) as Megatron-Bridge 0.6.2
    takes it: its override path (training/utils/omegaconf_utils.py: OmegaConf.create of a plain dict, Hydra's override
    grammar or OmegaConf.load, then setattr) checks no type, and the code that reads these fields tests their truth.
    So any value is taken; one that is not true / false / null is read as Python reads it, with a warning (the text
    'false' or 'no' given as an override is true there)."""
    value = python_scalar(value)
    if value is None or isinstance(value, bool):
        return bool(value)
    on = bool(value)
    b.warn(f"{key}: {shown(value)} is not true or false; Megatron-Bridge 0.6.2 sets it unchecked and its code tests the "
           f"value's truth, so it is {'on' if on else 'off'} (estimated so; write true or false)")
    return on


def _bridge_bools(b: ArgsBuilder, fields: dict[str, Field], names: Iterable[str],
                  overwritten: frozenset[str] = frozenset()) -> None:
    """In place: each of ``names`` (bool fields of a section's dataclass) holding another value than true / false / null
    / '???' is given that value's truth, as Megatron-Bridge 0.6.2 builds it (bridge_truth, with its warning): its
    override path and instantiate set the value unchecked (a model flag too: GPTModelProvider.finalize and
    TransformerConfig.__post_init__ keep it), and the code that reads the flag tests its truth. ``overwritten``:
    fields another section writes over (MixedPrecisionConfig.setup), whose own value changes nothing: no warning."""
    for name in names:
        f = fields.get(name)
        if f is None or is_missing(f[0]):
            continue
        value = python_scalar(f[0])
        if value is not None and not isinstance(value, bool):
            fields[name] = (bool(value) if name in overwritten else bridge_truth(b, value, f[1]), f[1])


def _identity_compared_model_flags(b: ArgsBuilder, model: Mapping[str, Field]) -> None:
    """Model flags megatron-core 0.19.2 compares with a bool (``==``, ``is``) rather than by truth where the model is
    built, read before _bridge_bools turns the value into its truth. Bridge's override path sets any value unchecked
    (bridge_truth), so a value whose truth alone would build stops Bridge there; each is a problem naming the key.
    SharedExpertMLP.__init__ (transformer/moe/shared_experts.py:124) asserts ``config.add_bias_linear == False`` in
    every MoE layer of a model with shared experts: 0 passes (0 == False), '' or [] (false, but not == False) fail.
    MLP.forward (transformer/mlp.py:306) asserts ``config.add_bias_linear is True`` on its fused bias-GeLU path
    (bias_activation_fusion, activation F.gelu, no gated linear unit, no TE activation function): there 1 or 'yes'
    build, then the first training step stops. TransformerConfig.__post_init__ (transformer_config.py:2645) raises for
    ``variable_seq_lengths is True`` with the allgather token dispatcher (its default, dense models too): true stops
    Bridge's finalize, 1 or 'yes' do not."""
    _add_bias_linear_is_true(b, model)
    _qk_l2_norm_is_false(b, model)
    f = model.get("variable_seq_lengths")
    disp = model.get("moe_token_dispatcher_type")
    if f is not None and python_scalar(f[0]) is True and (disp is None or disp[0] in (None, "allgather")):
        b.problem(f[1], "is True with the allgather token dispatcher (TransformerConfig's default): megatron-core "
                  "0.19.2's TransformerConfig raises \"allgather does not support variable sequence length\", so "
                  "Megatron-Bridge 0.6.2's finalize stops", "leave it false, or set "
                  "model.moe_token_dispatcher_type=alltoall")
    f, shared, experts = (model.get(n) for n in ("add_bias_linear", "moe_shared_expert_intermediate_size",
                                                   "num_moe_experts"))
    if f is None or shared is None or experts is None or any(is_missing(x[0]) for x in (f, shared, experts)):
        return
    value = python_scalar(f[0])
    if not python_scalar(shared[0]) or not python_scalar(experts[0]) or value is None or value or value == False:  # noqa: E712
        return   # (no shared experts; null: refused as null; a true value: refused with shared experts by resolve)
    b.problem(f[1], f"{shown(value)} is false but not == False: megatron-core 0.19.2's SharedExpertMLP asserts "
              "`add_bias_linear == False`, so Megatron-Bridge 0.6.2 fails building this model's shared experts "
              f"({shared[1]})", "write false")


def _add_bias_linear_is_true(b: ArgsBuilder, model: Mapping[str, Field]) -> None:
    """The ``add_bias_linear is True`` assertion of MLP.forward (_identity_compared_model_flags), where a model runs
    MLP.forward: a dense model without TE's operation fuser (TEFusedMLP), or MoE experts without grouped GEMM
    (SequentialMLP), or the dense layers of a MoE model (moe_layer_freq)."""
    def value(name: str, default: Any) -> Any:
        f = model.get(name)
        return default if f is None or is_missing(f[0]) else python_scalar(f[0])

    f = model.get("add_bias_linear")
    bias = value("add_bias_linear", None)
    act = target_name(value("activation_func", None)) or "gelu"   # (TransformerConfig: F.gelu)
    if (f is None or not bias or bias is True or not value("bias_activation_fusion", False) or act != "gelu"
            or value("gated_linear_unit", False) or value("use_te_activation_func", False)):
        return
    freq = value("moe_layer_freq", 1)
    dense_layers = (isinstance(freq, int) and freq > 1) or (isinstance(freq, (list, tuple)) and 0 in freq)
    fuser = value("use_transformer_engine_op_fuser", False)   # (TEFusedMLP for the dense MLPs)
    if not value("num_moe_experts", None):
        runs = not fuser
    else:
        runs = not value("moe_grouped_gemm", False) or (dense_layers and not fuser)
    if runs:
        b.problem(f[1], f"{shown(bias)} is true but not True: megatron-core 0.19.2's MLP.forward asserts "
                  "`add_bias_linear is True` on the fused bias-GeLU path (bias_activation_fusion with gelu and no gated "
                  "linear unit), so the model Megatron-Bridge 0.6.2 builds stops at the first training step",
                  "write true")


def _qk_l2_norm_is_false(b: ArgsBuilder, model: Mapping[str, Field]) -> None:
    """Bridge's mtp_block_spec (models/gpt_provider.py:373) re-derives the decoder layer specs with
    ``qk_l2_norm=config.qk_l2_norm`` when the MTP's pipeline stage builds no decoder layer, and megatron-core 0.19.2's
    MLA layer spec asserts ``qk_l2_norm is False`` (gpt_layer_specs.py:414): there 0 or '' stop the build, false
    does not (a true value is refused with MLA by truth, as QKNormConfigResolver refuses it)."""
    def value(name: str, default: Any) -> Any:
        g = model.get(name)
        return default if g is None or is_missing(g[0]) else python_scalar(g[0])

    f = model.get("qk_l2_norm")
    q = value("qk_l2_norm", None)
    if f is None or q is None or q is False or q or not value("multi_latent_attention", False) \
            or not value("mtp_num_layers", None):
        return
    layout, pp = value("pipeline_model_parallel_layout", None), value("pipeline_model_parallel_size", 1)
    try:
        if layout is not None:
            stages = parse_pipeline_layout(str(layout_text(layout, "model.pipeline_model_parallel_layout")), int(pp))
            empty = any("m" in st and "t" not in st for st in stages)
        else:   # (without virtual stages: the last stage, which holds the MTP, builds its count of layers)
            empty = int(pp) > 1 and value("num_layers_in_last_pipeline_stage", None) == 0 and \
                not value("virtual_pipeline_model_parallel_size", None)
    except (ConfigError, TypeError, ValueError):
        return   # (a layout or size that is not one: refused under its own key by resolve)
    if empty:
        b.problem(f[1], f"{shown(q)} is false but not False: the MTP's pipeline stage builds no decoder layer, so "
                  "Megatron-Bridge 0.6.2's mtp_block_spec passes it to megatron-core 0.19.2's multi-latent attention "
                  "layer spec, which asserts `qk_l2_norm is False`", "write false")


def _fsdp_checkpoint_format(b: ArgsBuilder, S: Mapping[str, Mapping[str, Field]], recipe: str | None) -> None:
    """ConfigContainer.validate (Megatron-Bridge 0.6.2 training/config.py, _validate_and_apply_megatron_fsdp_configs
    :1097-1101, and :1389-1394), when the job saves or loads a checkpoint: Megatron-FSDP asserts the fsdp_dtensor
    format, which asserts Megatron-FSDP. A recipe saves and loads (recipes/common.py: save = load = its checkpoint
    directory) unless overrides make both null."""
    def val(sec: str, name: str, default: Any = None) -> Any:
        f = S.get(sec, {}).get(name)
        return default if f is None or f[0] is None or is_missing(f[0]) else f[0]

    def flag(sec: str, name: str) -> bool:
        f = S.get(sec, {}).get(name)
        return bool(f) and bridge_truth(b, val(sec, name, False), f[1])

    ckpt = S.get("checkpoint", {})
    saves = any(val("checkpoint", n) is not None or (bool(recipe) and n not in ckpt) for n in ("save", "load"))
    if not saves:
        return
    where = ckpt["ckpt_format"][1] if "ckpt_format" in ckpt else "checkpoint.ckpt_format"
    fmt = str(val("checkpoint", "ckpt_format", "torch_dist"))
    megatron_fsdp = flag("ddp", "use_megatron_fsdp") or flag("dist", "use_megatron_fsdp")
    if megatron_fsdp and fmt != "fsdp_dtensor":
        b.problem(where, f"{fmt} with Megatron-FSDP: Megatron-Bridge asserts the fsdp_dtensor checkpoint format when "
                  "the job saves or loads a checkpoint (ConfigContainer.validate: \"Megatron-FSDP requires the "
                  "fsdp_dtensor checkpointing format!\")", "checkpoint.ckpt_format=fsdp_dtensor")
    elif fmt == "fsdp_dtensor" and (not megatron_fsdp or flag("dist", "use_torch_fsdp2")):
        b.problem(where, "fsdp_dtensor needs Megatron-FSDP (ddp.use_megatron_fsdp, not torch FSDP2): Megatron-Bridge "
                  "asserts it when the job saves or loads a checkpoint (ConfigContainer.validate)",
                  "ddp.use_megatron_fsdp=true, or checkpoint.ckpt_format=torch_dist")


def _bridge_local_graph_ok(modules: Any, scope: Any, inference_scope: Any) -> bool:
    """Whether Megatron-Bridge 0.6.2 takes ``cuda_graph_impl: local`` with these modules: only as the full-iteration
    graph, or an inference graph of layers / blocks with no module named (utils/cuda_graph.py
    validate_cuda_graph_configuration, which ConfigContainer.validate runs before the model is finalized)."""
    named = _graph_names(modules) | _graph_names(scope)
    if "full_iteration" in named:
        return True
    layer_modules = named - {"full_iteration_inference", "full"}
    return not layer_modules and bool(_graph_names(inference_scope) & {"layer", "block"})


def looks_like_bridge(doc: Mapping) -> bool:
    tgt = str(doc.get("_target_", ""))
    if tgt.endswith("ConfigContainer"):
        return True
    if "trainer" in doc:
        return False
    keys = set(doc)
    return bool(keys & (BRIDGE_SECTIONS - {"model", "_target_"})) and keys <= BRIDGE_SECTIONS | {"defaults"}


Field = tuple[Any, str]  # (value, key path as written)


def _section(d: Any, prefix: str, tag: str = "") -> dict[str, Field]:
    if not isinstance(d, Mapping):
        return {}
    return {str(k): (v, f"{prefix}.{k}{tag}") for k, v in d.items()}


def _model_fields(m: Any, tag: str = "") -> dict[str, Field]:
    """model.<f> and model.transformer.<f>, the nested one winning."""
    if not isinstance(m, Mapping):
        return {}
    out = {str(k): (v, f"model.{k}{tag}") for k, v in m.items() if k != "transformer"}
    tr = m.get("transformer")
    if isinstance(tr, Mapping):
        out.update({str(k): (v, f"model.transformer.{k}{tag}") for k, v in tr.items() if k != "_target_"})
    return out


def _set_nested(container: dict[str, Field], parts: list[str], value: Any, key: str, delete: bool) -> None:
    head = parts[0]
    if len(parts) == 1:
        if delete:
            container.pop(head, None)
        else:
            container[head] = (value, key)
        return
    cur = container.get(head, ({}, key))[0]
    cur = copy.deepcopy(cur) if isinstance(cur, dict) else {}
    node = cur
    for p in parts[1:-1]:
        nxt = node.get(p)
        if not isinstance(nxt, dict):
            nxt = {}
            node[p] = nxt
        node = nxt
    if delete:
        node.pop(parts[-1], None)
    else:
        node[parts[-1]] = value
    container[head] = (cur, container.get(head, (None, key))[1])


def read_bridge(doc: Mapping, path: str, overrides: list[tuple[str, str, Any]], recipe: str | None = None,
                sync_seq_length: str | None = None, recipe_peft: tuple[Mapping, str] | None = None) -> RawConfig:
    """``sync_seq_length``: the launcher (``run_recipe.py``) that copies ``dataset.seq_length`` into
    ``model.seq_length`` after the overrides, as Bridge's ``recipe_runner.sync_model_dataset_sequence_length``
    does; None for a config read as it is. ``recipe_peft``: (the PEFT object the recipe function builds for the
    launcher's ``peft_scheme``, the option that chose it), in place of the recipe's own."""
    from .models import recipe_doc, recipe_gpus, recipe_notes

    label = f"Megatron-Bridge config {path}" if path and not path.startswith("recipe ") else "Megatron-Bridge"
    b = ArgsBuilder(label)
    S: dict[str, dict[str, Field]] = {}
    top: dict[str, Field] = {}
    if recipe:
        rdoc, model_key, src = recipe_doc(recipe)
        tag = f" (recipe {recipe})"
        b.source = f"{label} on recipe {recipe}" if doc else f"Megatron-Bridge recipe {recipe}"
        for sec, val in rdoc.items():
            if sec == "model":
                S["model"] = _model_fields(val, tag)
            elif isinstance(val, Mapping):
                S[sec] = _section(val, sec, tag)
            else:
                top[sec] = (val, sec + tag)
        if recipe_peft is not None:
            S["peft"] = _section(recipe_peft[0], "peft", f" ({recipe_peft[1]})")
    for sec, val in doc.items():
        if sec in ("defaults", "_target_"):
            continue
        if sec == "model":
            S.setdefault("model", {}).update(_model_fields(val))
        elif isinstance(val, Mapping):
            if isinstance(top.get(sec, (None,))[0], str):
                top.pop(sec)  # a mapping replaces a preset name
            S.setdefault(sec, {}).update(_section(val, sec))
        else:
            top[sec] = (val, sec)
            S.pop(sec, None)
    # the key paths plain overrides wrote: an unknown one is an error, as in Bridge (a +key / ++key one is
    # added by Hydra, then skipped by Bridge with a warning: a warning here)
    given: set[str] = set()
    for op, key, value in overrides:
        parts = key.split(".")
        sec = parts[0]
        rest = parts[1:]
        if recipe and sec == "peft" and (op != "add" or not rest):
            # A recipe's PEFT object is callable: Bridge 0.6.2 leaves it out of the OmegaConf config it applies the
            # overrides to (training/utils/omegaconf_utils.py _is_omegaconf_problematic), so Hydra refuses a peft key
            # ("Could not override 'peft.dim'"); a +peft.FIELD one is added, then set on the object itself
            # (_apply_overrides), which is what tests/test_bridge_real.py sees run_recipe.py do
            raise ConfigError(key, "Megatron-Bridge cannot override the recipe's PEFT object (it is left out of the "
                              "override config: \"Could not override\")", f"write +{key}=VALUE (Hydra adds it and "
                              "Bridge sets it on the object), or choose LoRA / DoRA with run_recipe.py --mode")
        if recipe and sec == "peft":
            given.add(key)      # (set on the object: an unknown field fails there)
        if op == "set":
            given.update((key, sec))
        if (recipe and sec == "comm_overlap" and sec not in S and sec not in top and (rest or value is not None)
                and (not rest or rest[0] in bridge_sections()[sec][1])):    # (a typo is refused as one, below)
            # Bridge 0.6.2's recipes leave comm_overlap None unless they set one (recipes/common.py; memguard's recipe
            # table has the section exactly then, tests/test_bridge_real.py): Hydra refuses a field of None, and
            # +comm_overlap.FIELD or a whole mapping leaves a dict where CommOverlapConfig belongs, on which
            # runtime_config_update fails ("'dict' object has no attribute 'data_parallel_size'")
            raise ConfigError(key, f"recipe {recipe} has no comm_overlap section (None): Megatron-Bridge cannot start "
                              "with one made by an override (a field of None: \"Could not override\"; with + or a "
                              "mapping, a dict where CommOverlapConfig belongs)", "set cfg.comm_overlap = "
                              "CommOverlapConfig(...) in Python, or choose a recipe that has one")
        if sec == "model" and rest[:1] == ["transformer"]:
            rest = rest[1:]
        if not rest:
            if op == "del":
                top.pop(sec, None)
                S.pop(sec, None)
            elif isinstance(value, Mapping):
                S[sec] = _model_fields(value) if sec == "model" else _section(value, sec)
                if op == "set":
                    given.update(key for _, key in S[sec].values())
            elif sec == "model" and value is not None and op == "set":
                # (the model provider replaced by one value: every model field was lost, and the errors named
                # --num-layers; Bridge's OmegaConf refuses a value where its model object goes)
                raise ConfigError(key, f"is the model section; it takes model.FIELD=VALUE overrides, not the value "
                                       f"{shown(value)}")
            else:
                top[sec] = (value, key)
                S.pop(sec, None)
            continue
        if sec == "peft" and isinstance(top.get("peft", (None,))[0], str):
            # a scheme name (a recipe's peft_scheme: default_peft_config builds LoRA() / DoRA()) whose fields an override
            # sets: those fields of that object (they were dropped, e.g. peft.dim=8 estimated with rank 32)
            scheme, where = top["peft"]
            cls = {v: k for k, v in _PEFT_CLASSES.items()}.get(scheme.strip().lower())
            if cls is not None:
                top.pop("peft")
                S["peft"] = {"_target_": (f"megatron.bridge.peft.{cls.lower()}.{cls}", where)}
        if sec == "mixed_precision" and isinstance(top.get("mixed_precision", (None,))[0], str):
            # the section is a preset NAME (every 0.6.2 recipe's "bf16_mixed"): Hydra cannot set a field of a string
            # ("Could not override 'mixed_precision.FIELD'"), and with +/++ the section becomes a dict, on which
            # runtime_config_update's cfg.mixed_precision.finalize() fails (training/config.py 0.6.2; checked with
            # real Bridge in tests/test_bridge_real.py). memguard applied the field to the expanded preset.
            preset_name, where = top["mixed_precision"]
            raise ConfigError(key, f"mixed_precision is the preset name {preset_name!r} ({where}): Megatron-Bridge "
                              "cannot override a field of it (Hydra: \"Could not override\"; with + the section "
                              "becomes a dict that runtime_config_update cannot finalize)", "choose another preset "
                              "(mixed_precision=NAME), or set cfg.mixed_precision = "
                              "get_mixed_precision_config(NAME) in Python and change the field there")
        if sec == "mixed_precision" and "mixed_precision" in top:
            preset = _mp_values(top.pop("mixed_precision"))
            S["mixed_precision"] = {k: (v, "mixed_precision") for k, v in preset.items()}
        _set_nested(S.setdefault(sec, {}), rest, value, key, op == "del")
    if sync_seq_length:
        _sync_seq_length(b, S, sync_seq_length)
    env = _env_vars(S.pop("env_vars", {}), top.pop("env_vars", (None, "env_vars")))
    _unknown_keys(b, S, top, given)
    _map(b, S, top, has_target="_target_" in doc or bool(recipe), given=frozenset(given))
    _fsdp_checkpoint_format(b, S, recipe)
    if b.args.get("peft_scheme") is not None and "checkpoint" in S and S["checkpoint"].get(
            "pretrained_checkpoint", (None,))[0] is None:
        # ConfigContainer.validate (training/config.py 0.6.2): the adapters train on a loaded base model
        b.warn("checkpoint.pretrained_checkpoint is not set: Megatron-Bridge asserts \"PEFT requires a pretrained "
               "checkpoint path\" at start-up (run_recipe.py --pretrained_checkpoint PATH)")
    if recipe:
        for note in recipe_notes(recipe):
            b.warn(note)
    if recipe and recipe_gpus(recipe):
        # the GPU count in the recipe function's name (..._pretrain_8gpu_h100_bf16_config): not a world size
        # (Bridge takes that from the launcher), but what an error asking for one suggests
        b.origin["recipe_gpus"] = f"{recipe_gpus(recipe)} (the GPUs recipe {recipe} is written for)"
    raw = b.build()
    return replace(raw, env=env) if env else raw


def _env_vars(fields: dict[str, Field], whole: Field) -> dict[str, str]:
    """The memory-relevant ``env_vars`` of the container (every 0.6.2 recipe sets some; the deterministic ones
    CUBLAS_WORKSPACE_CONFIG). Bridge's ``apply_environment_variables`` (training/config.py, 0.6.2) puts each
    in the process environment with ``os.environ.setdefault(name, str(value))`` before the model is built:
    a launch that sets one itself keeps its own value (memguard check merges them that way)."""
    from ..config import memory_env

    value, key = whole
    if value is not None and not isinstance(value, Mapping):
        raise ConfigError(key, f"must be a mapping of environment variables, got {shown(value)}")
    merged = {**(value or {}), **{name: v for name, (v, _) in fields.items()}}
    bad = [k for k, v in merged.items() if v is not None and not isinstance(v, (str, int, float, bool))]
    if bad:
        raise ConfigError(f"env_vars.{bad[0]}", "must be a scalar (Bridge's apply_environment_variables refuses "
                          "anything else)")
    return memory_env({str(k): str(v) for k, v in merged.items() if v is not None})


def _unknown_keys(b: ArgsBuilder, S: dict[str, dict[str, Field]], top: dict[str, Field], given: set[str]) -> None:
    """A section or field Megatron-Bridge's ConfigContainer does not have (Bridge 0.6.2's dataclasses, as
    data/config_fields.json lists them). Bridge's own handling is matched (training/utils/omegaconf_utils.py):
    a ``KEY=VALUE`` override goes through Hydra with the config in struct mode, which raises on an unknown
    key -> a ConfigError here; a YAML file is merged without struct mode and the key is then skipped with a
    logged warning (``_apply_overrides``: "not found in config object ... Skipping") -> a warning here. The
    memguard recipe's own keys are not checked (tests/test_bridge_real.py compares them with Bridge)."""
    sections = bridge_sections()

    def report(key: str, what: str, hint: str) -> None:
        if key in given:
            raise ConfigError(key, f"{what}: Megatron-Bridge refuses this override", hint or None)
        b.warn(f"{key}: {what}; ignored" + (f" ({hint})" if hint else ""))

    # (ConfigContainer's own fields include private ones a dump carries: _checkpoint_load_required)
    top_known = BRIDGE_SECTIONS | config_fields().get("ConfigContainer", frozenset())
    for sec in list(S) + [s for s in top if s not in S]:
        if sec not in top_known:
            report(sec, "not a Megatron-Bridge ConfigContainer section",
                   did_you_mean(sec, {s for s in top_known if not s.startswith("_")}))
    if "model" in S and _model_checked(S["model"]):
        # Hydra in struct mode raises on model.<unknown> ("Could not override 'model.num_layer'", Bridge 0.6.2
        # omegaconf_utils.py OverridesError); a file's unknown model key is skipped with "not found in config
        # object GPTModelProvider. Skipping." (tests/test_bridge_real.py)
        known = model_known_fields()
        target = S["model"].get("_target_", (None,))[0]
        cls = target.rsplit(".", 1)[-1] if isinstance(target, str) else "GPTModelProvider"
        for name, (_, key) in S["model"].items():
            if name in known or name.startswith("_") or " (recipe " in key:
                continue
            report(key, f"not a field of Megatron-Bridge's model ({cls})", did_you_mean(name, known, "model."))
    for sec, fields in S.items():
        if sec not in sections or sec == "model":
            continue
        classes, known = sections[sec]
        target = fields.get("_target_", (None,))[0]
        if isinstance(target, str) and target.rsplit(".", 1)[-1] not in classes:
            continue   # a class of the user's own (a DatasetProvider subclass...): its fields are not known
        cls = target.rsplit(".", 1)[-1] if isinstance(target, str) else sorted(classes)[0] if len(classes) == 1 else ""
        for name, (_, key) in fields.items():
            if name in known or (name.startswith("_") and name.endswith("_")) or " (recipe " in key:
                continue
            report(key, f"not a field of Megatron-Bridge's {sec} section" + (f" ({cls})" if cls else ""),
                   did_you_mean(name, known, sec + "."))


def _sync_seq_length(b: ArgsBuilder, S: dict[str, dict[str, Field]], who: str) -> None:
    """model.seq_length = dataset.seq_length (or its sequence_length), when the dataset has one."""
    ds = S.get("dataset", {})
    f = next((ds[n] for n in ("seq_length", "sequence_length") if ds.get(n, (None,))[0] is not None), None)
    if f is None or "model" not in S:
        return
    old = S["model"].get("seq_length")
    if old is not None and old[0] is not None and old[0] != f[0] and " (recipe " not in old[1]:  # the user's own value
        b.warn(f"{old[1]} = {old[0]} is replaced by {f[1]} = {f[0]}: {who} copies dataset.seq_length into "
               "model.seq_length after the overrides (set dataset.seq_length, or -sl, instead)")
    S["model"]["seq_length"] = f


def _mp_values(f: Field) -> dict[str, Any]:
    """A mixed_precision preset name -> its fields."""
    value, key = f
    name = str(value).strip().replace("-", "_")
    if name not in MIXED_PRECISION_PRESETS:
        raise ConfigError(key, f"unknown mixed-precision recipe {value!r}",
                          "known: " + ", ".join(sorted(MIXED_PRECISION_PRESETS)))
    return {**_MP_DEFAULTS, **MIXED_PRECISION_PRESETS[name]}


# Bridge's PEFT classes memguard models (megatron/bridge/peft/lora.py LoRA, dora.py DoRA)
_PEFT_CLASSES = {"LoRA": "lora", "DoRA": "dora"}
# peft: fields -> the dests resolve/peft.py reads
_PEFT_FIELDS = {"dim": "peft_dim", "alpha": "peft_alpha", "dropout": "peft_dropout",
                "dropout_position": "peft_dropout_position", "target_modules": "peft_target_modules",
                "exclude_modules": "peft_exclude_modules",
                "sequence_parallel_input_regather": "peft_sp_input_regather"}
# fields typed with a value default in LoRA / DoRA (Bridge 0.6.2: dim 32, alpha 32 / 64, dropout 0.0, dropout_position
# 'pre'); target_modules / exclude_modules: _common.peft_module_list
_PEFT_NOT_NULL = frozenset({"dim", "alpha", "dropout", "dropout_position"})
# fields that change no memory of a dense model (initialisation, MoE-only options, checkpoint handling)
_PEFT_NEUTRAL = frozenset({"lora_A_init_method", "lora_B_init_method", "normalize_moe_lora", "share_expert_adapters",
                           "experts_shared_outer_loras", "params_to_save", "_target_"})


def _peft(b: ArgsBuilder, fields: dict[str, Field], top: Field | None, given: frozenset[str] = frozenset()) -> None:
    """The ``peft:`` section: a LoRA or DoRA object (its ``_target_``) or a scheme name, onto resolve/peft.py's
    dests; another PEFT class, or a field that changes memory memguard does not model, is refused by name.
    ``given``: the keys plain ``KEY=VALUE`` overrides wrote (an unknown one is an error there, as in Bridge)."""
    if top is not None:
        value, key = top
        if isinstance(value, str):
            b.set("peft_scheme", value, key)      # (resolve/peft.py: lora or dora)
            return
        raise ConfigError(key, f"must be a LoRA / DoRA object or a scheme name, got {shown(value)}")
    target = fields.get("_target_", (None, "peft._target_"))
    cls = str(target[0] or "").rsplit(".", 1)[-1]
    if target[0] is None or not str(target[0]).strip():
        raise ConfigError("peft._target_", "is missing: memguard cannot tell LoRA from DoRA",
                          "peft._target_: megatron.bridge.peft.lora.LoRA (or dora.DoRA)")
    if cls not in _PEFT_CLASSES:
        raise NotModelledError(target[1], f"PEFT class {cls} (memguard models LoRA and DoRA)")
    b.set("peft_scheme", _PEFT_CLASSES[cls], target[1])
    for name, (value, key) in fields.items():
        if value is None and name in _PEFT_NOT_NULL:
            # LoRA / DoRA (Bridge 0.6.2 peft/lora.py, dora.py) declare these with a value default; a null is passed to
            # the dataclass as None (instantiate / _apply_overrides), and the adapter's constructor fails on it
            # (peft/lora_layers.py: 'alpha / dim', 'if dropout > 0.0', 'assert dropout_position in ["pre", "post"]')
            raise ConfigError(key, f"is null: Megatron-Bridge's {cls} takes it as None, not its default, and cannot "
                              "build the adapters", f"set {key}=VALUE or drop the key")
        if name in ("target_modules", "exclude_modules"):
            v = peft_module_list(name, value, key, "Megatron-Bridge")
            if v is not None:
                b.set(_PEFT_FIELDS[name], v, key)
        elif name in _PEFT_FIELDS:
            if value is not None:
                b.set(_PEFT_FIELDS[name], value, key)
        elif name == "canonical_mapping":
            if value:
                raise NotModelledError(key, "PEFT targets given by a canonical_mapping")
        elif name == "lora_dtype":
            if value is not None:
                raise NotModelledError(key, "LoRA weights in a dtype other than the model's")
        elif name == "a2a_experimental":
            if value:
                raise NotModelledError(key, "LoRA's experimental all-to-all adapters")
        elif name not in _PEFT_NEUTRAL and key in given:
            # Hydra applies a KEY=VALUE override in struct mode and raises on a key the dataclass lacks (Bridge 0.6.2
            # omegaconf_utils.parse_hydra_overrides: OverridesError)
            raise ConfigError(key, f"not a field of Megatron-Bridge's {cls}: Megatron-Bridge refuses this override")
        elif name not in _PEFT_NEUTRAL:
            # a YAML file's unknown key is dropped with a warning: instantiate's LENIENT mode (megatron-core 0.19.2
            # training/config/instantiate_utils._filter_kwargs_for_target), or "not found in config object" in
            # omegaconf_utils._apply_overrides
            b.warn(f"{key}: not a field of Bridge's {cls}; ignored")


def _hybrid_stack_spec(field: Field | None) -> None:
    """HybridModelProvider.hybrid_stack_spec: unset (Bridge takes megatron-core's TE hybrid stack) or that stack named;
    a spec of the user's own builds layers of its own (it was taken as the default), another value builds nothing."""
    from ..resolve.refusals import HYBRID_STACK_SPECS

    value, key = field if field is not None else (None, "")
    if value is None or is_missing(value):
        return
    target = value.get("_target_") if isinstance(value, Mapping) else value
    if isinstance(target, str) and tuple(target.strip().rsplit(".", 1)) in HYBRID_STACK_SPECS:
        return
    if isinstance(target, str) and target.strip():
        raise NotModelledError(key, f"the hybrid stack spec {shown(target)} (memguard models megatron-core's "
                               "hybrid_stack_spec)")
    raise ConfigError(key, f"must name a layer spec ({{_target_: megatron.core.models.hybrid.hybrid_layer_specs."
                           f"hybrid_stack_spec}}) or be null, got {shown(value)}")


def _gemma_modules(b: ArgsBuilder, model: Mapping[str, Field]) -> frozenset[str]:
    """Read Gemma 2's and Gemma 3's layers and refuse by name a model section that builds Gemma 4's (or Gemma 3 VL's)
    own modules: a Gemma 4 / Gemma 3 VL provider (under its layer spec's key where the dump names one; Gemma 4's
    softcapping field is not its only difference), a Gemma 4 layer spec, or a softcapping value other than null / 0
    (Bridge tests ``if softcap`` / ``if scale``) under a provider other than Gemma2ModelProvider. A Gemma2ModelProvider
    is read by _gemma2_modules; gemma2_layer_spec under another provider is a problem. Gemma 3 (Gemma3ModelProvider or
    gemma3_layer_spec) sets ``post_proj_norms`` (the spec's TERowParallelLinearLayerNorm) and, with the provider,
    ``rotary_tables`` 4 (its Gemma3RotaryEmbedding). The providers memguard checks have no softcapping field: there
    Bridge skips the key (_unknown_keys warns)."""
    from ..errors import NotModelledError
    from ._common import GEMMA3_FIELDS, GEMMA3_VL_WHAT, is_gemma3_class

    target, key = model.get("_target_", (None, "model._target_"))
    cls_what = gemma_class_what(target) if isinstance(target, str) else None
    spec_value, spec_key = model.get("transformer_layer_spec", (None, ""))
    spec = target_name(spec_value) if spec_value is not None else None
    spec_what = gemma_spec_what(spec) if isinstance(spec, str) else None
    gemma3 = isinstance(target, str) and is_gemma3_class(target)
    gemma3_spec = isinstance(spec, str) and spec.strip().rsplit(".", 1)[-1] == "gemma3_layer_spec"
    if gemma3:
        vl, vl_key = model.get("is_vision_language", (None, "model.is_vision_language"))
        if bridge_truth(b, vl, vl_key) if vl is not None and not is_missing(vl) else False:
            # Gemma3SelfAttention / Gemma3TEDotProductAttention take the VL path (no mask, an attention bias)
            raise NotModelledError(vl_key, GEMMA3_VL_WHAT)
    if gemma3_spec or (gemma3 and spec is None):
        b.set("post_proj_norms", True, spec_key if gemma3_spec else key)
    if gemma3:
        # Gemma3RotaryEmbedding (gemma3_provider.py): the global and local tables, each cached by its
        # RotaryEmbedding.forward, and their torch.stack cached by _forward_cached
        b.set("rotary_tables", 4, key)
    if cls_what is not None and cls_what is not GEMMA2_WHAT:
        raise NotModelledError(spec_key if spec_what else key, spec_what or cls_what)
    gemma2 = cls_what is GEMMA2_WHAT
    gemma2_spec = spec_what is GEMMA2_WHAT
    if gemma2_spec and not gemma2:
        # Gemma2DotProductAttention.__init__ reads config.query_pre_attn_scalar, a field of Gemma2ModelProvider only
        b.problem(spec_key, "gemma2_layer_spec needs Gemma2ModelProvider: its Gemma2DotProductAttention reads "
                  "config.query_pre_attn_scalar, which this provider does not have (AttributeError at model build; "
                  "Megatron-Bridge 0.6.2 gemma2_provider.py)", "model._target_: "
                  "megatron.bridge.models.gemma.gemma2_provider.Gemma2ModelProvider")
        spec_what = None
    if gemma2:
        return _gemma2_modules(b, model, key, spec_key, gemma2_spec or spec is None, spec_what)
    if not _model_checked(model):
        refuse_softcapping(model)
    if spec_what is not None:
        raise NotModelledError(spec_key, spec_what)
    if cls_what is not None:
        raise NotModelledError(key, cls_what)
    return GEMMA3_FIELDS if gemma3 else frozenset()


# Gemma2ModelProvider's own fields (Megatron-Bridge 0.6.2 gemma2_provider.py): the attention softcap (FlexAttention's
# score_mod: no tensor of its own) and the query scale change no memory; the final softcap is read
GEMMA2_FIELDS = frozenset({"attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar"})


def _gemma2_modules(b: ArgsBuilder, model: Mapping[str, Field], key: str, spec_key: str, gemma2_spec: bool,
                    spec_what: str | None) -> frozenset[str]:
    """A Gemma2ModelProvider: its provide() turns the output layer into Gemma2OutputLayer (``final_logit_softcapping``,
    default 30.0; null / 0 softcaps nothing: ``if not scale``), and its default gemma2_layer_spec (or that spec named)
    brings Gemma2FlexDotProductAttention (``gemma2_attention``) and TERowParallelLinearLayerNorm (``post_proj_norms``).
    Another spec under it (a GPT one) keeps its own layers; a Gemma 4 spec is refused."""
    from ..errors import NotModelledError

    if spec_what is not None and not gemma2_spec:
        raise NotModelledError(spec_key, spec_what)
    if gemma2_spec:
        b.set("post_proj_norms", True, spec_key or key)
        b.set("gemma2_attention", True, spec_key or key)
    cap, cap_key = model.get("final_logit_softcapping", (30.0, key + " (Gemma2ModelProvider: 30.0)"))
    if cap is None or is_missing(cap):
        cap = 0.0
    b.set("final_logit_softcapping", cap, cap_key)
    for name in ("attention_dropout", "hidden_dropout"):   # Gemma2ModelProvider's 0.0 (the file's value wins)
        b.default(name, 0.0, f"{key} (Gemma2ModelProvider: 0.0)")
    return GEMMA2_FIELDS


def _map(b: ArgsBuilder, S: dict[str, dict[str, Field]], top: dict[str, Field], has_target: bool,  # noqa: C901
         given: frozenset[str] = frozenset()) -> None:
    def v(sec: str, name: str, default: Any = None) -> Any:
        f = S.get(sec, {}).get(name)
        return default if f is None or f[0] is None or is_missing(f[0]) else f[0]

    def k(sec: str, name: str) -> str:
        f = S.get(sec, {}).get(name)
        return f[1] if f else f"{sec}.{name}"

    def has(sec: str, name: str) -> bool:
        f = S.get(sec, {}).get(name)
        return f is not None and f[0] is not None and not is_missing(f[0])

    def on_off(sec: str, name: str, default: bool = False) -> bool:
        # a bool field of Bridge's section dataclasses, as Bridge takes it (bridge_truth)
        return bridge_truth(b, v(sec, name, default), k(sec, name))

    _refuse_unset_sections(S, top)
    # (Megatron-LM's validate_args rules that Bridge, which runs none of it, does not apply: resolve/optimizer.py)
    b.set("bridge_config", True, "Megatron-Bridge ConfigContainer")
    # flags given another value than true / false (model.sequence_parallel=1, =yes, ='false'): what Bridge builds
    mp_given = top.get("mixed_precision", (None,))[0] is not None or bool(S.get("mixed_precision"))
    _identity_compared_model_flags(b, S.get("model", {}))
    _bridge_bools(b, S.get("model", {}), model_bool_fields(), frozenset(_MP_BOOLS) if mp_given else frozenset())
    _bridge_bools(b, S.get("mixed_precision", {}), _MP_BOOLS)
    _bridge_bools(b, S.get("comm_overlap", {}), _COMM_OVERLAP_TRUTH)

    for sec, fields in S.items():
        for name, (val, key) in fields.items():
            if is_missing(val) and name in _NEEDED.get(sec, ()):
                raise ReaderError(f"{key}: is ??? (a mandatory value); set it with {key.split(' ')[0]}=VALUE")

    if top.get("peft", (None,))[0] is not None or S.get("peft"):
        _peft(b, S.get("peft", {}), top.get("peft"), given)

    # Model.
    model = S.get("model", {})
    _hybrid_stack_spec(model.get("hybrid_stack_spec"))
    gemma_fields = _gemma_modules(b, model)
    if b.args.get("gemma2_attention"):
        for name in ("enable_offline_packing", "enable_in_batch_packing"):
            if has("dataset", name) and bridge_truth(b, v("dataset", name), k("dataset", name)):
                # ConfigContainer.validate: either makes the batch THD (uses_thd), so the step hands packed_seq_params
                # to the core attention, which Gemma2DotProductAttention / its Flex subclass raise on
                b.problem(k("dataset", name), "packs sequences, which Gemma 2's attention refuses: "
                          "Gemma2FlexDotProductAttention raises 'Packed sequence is not supported by "
                          "DotProductAttention' (Megatron-Bridge 0.6.2 gemma2_provider.py)",
                          f"{k('dataset', name)}=false")
    gpt_fields = config_fields().get("GPTModelProvider", frozenset()) | config_fields().get("GPTModelConfig", frozenset())
    map_mcore_fields(b, model, extra_known=gpt_fields | _MODEL_EXTRAS | gemma_fields,   # (checked providers: _unknown_keys)
                     unknown_context=None if _model_checked(model) else "megatron-core / Megatron-Bridge model",
                     bridge=True)
    window, window_key = model.get("window_size", (None, "model.window_size"))
    if gemma_fields and isinstance(window, int) and not isinstance(window, bool) and window > 0:
        # Gemma3TEDotProductAttention: a local layer's window is (window_size - 1, 0), a global one's None; the FP8
        # attention rules (resolve/fp8.py) read the local layers' sliding window
        b.set("window_size", [window - 1, 0], window_key)
    group_query_attention(b, model)
    if not has("model", "ffn_hidden_size") and has("model", "hidden_size"):
        default_ffn_hidden_size(b, v("model", "hidden_size"), k("model", "hidden_size"))
    # GPTModelProvider / TransformerConfig defaults that differ from Megatron's argument defaults.
    b.default("bias_activation_fusion", False, "model.bias_activation_fusion")   # TransformerConfig: False
    b.default("bias_dropout_fusion", False, "model.bias_dropout_fusion")         # TransformerConfig: False
    b.default("apply_rope_fusion", False, "model.apply_rope_fusion")             # TransformerConfig: False
    b.default("cross_entropy_loss_fusion", True, "model.cross_entropy_loss_fusion")  # GPTModelProvider: True
    if as_bool(v("model", "overlap_p2p_comm", False)):
        b.set("overlap_p2p_comm", True, k("model", "overlap_p2p_comm"))
    elif "overlap_p2p_comm" in b.args:
        del b.args["overlap_p2p_comm"]  # memory-neutral; Megatron's PP>2 rule for it is not Bridge's
    if "teacher" in model and model["teacher"][0]:
        b.warn(f"{model['teacher'][1]}: a knowledge-distillation teacher is not counted; memguard estimates "
               "the student's training memory only (add the teacher's weights and forward activations)")

    if v("model", "cuda_graph_impl") == "local" and not _bridge_local_graph_ok(
            *(v("model", name) for name in ("cuda_graph_modules", "cuda_graph_scope", "inference_cuda_graph_scope"))):
        b.problem(k("model", "cuda_graph_impl"), "local is taken by Megatron-Bridge only for full-iteration CUDA graphs "
                  "(ConfigContainer.validate raises ValueError at start-up)", "model.cuda_graph_impl=transformer_engine "
                  "for graphs of layers or modules (attn, mlp, ...), or model.cuda_graph_impl=full_iteration")
    if v("model", "cuda_graph_scope") is not None and _graph_names(v("model", "cuda_graph_modules")) - {"full"}:
        # megatron-core 0.19.2 TransformerConfig.__post_init__: any cuda_graph_scope but None ('full', which the
        # Llama H100 recipes set, included) asserts cuda_graph_modules is empty
        b.problem(k("model", "cuda_graph_modules"), "cannot be set together with model.cuda_graph_scope (megatron-core's "
                  "TransformerConfig asserts it unless cuda_graph_scope is null)", "also set model.cuda_graph_scope=null")

    # RerunStateMachineConfig.check_for_nan_in_loss (default true): what the full-iteration CUDA graph needs off
    b.set("check_for_nan_in_loss_and_grad", on_off("rerun_state_machine", "check_for_nan_in_loss", True),
          k("rerun_state_machine", "check_for_nan_in_loss"))

    # Sequence length: model.seq_length (GPTModelProvider default 1024) must equal dataset.seq_length.
    ds_name = "seq_length" if has("dataset", "seq_length") else "sequence_length"
    if has("model", "seq_length"):
        if has("dataset", ds_name) and v("dataset", ds_name) != v("model", "seq_length"):
            b.problem(k("model", "seq_length"), f"{v('model', 'seq_length')} differs from {k('dataset', ds_name)} = "
                      f"{v('dataset', ds_name)} (Bridge asserts they match)", "make the two equal")
    elif has("dataset", ds_name):
        b.set("seq_length", v("dataset", ds_name), k("dataset", ds_name))
    elif has_target and "model" in S:
        b.set("seq_length", 1024, "model.seq_length")  # GPTModelProvider default

    # Batch.
    for name in ("micro_batch_size", "global_batch_size", "decrease_batch_size_if_needed", "empty_unused_memory_level"):
        if has("train", name):
            b.set(name, v("train", name), k("train", name))
    # the evaluation step (megatron-core 0.19.2 megatron/training/config/training_config.py ValidationConfig; older
    # Bridge releases keep them in train): its micro-batch is estimated as a second figure (estimator/eval_step.py)
    for name in ("eval_micro_batch_size", "eval_global_batch_size", "eval_iters"):
        for sec in ("validation", "train"):
            if has(sec, name):
                b.set(name, v(sec, name), k(sec, name))
                break
    if has("train", "rampup_batch_size"):
        b.warn(f"{k('train', 'rampup_batch_size')}: batch-size ramp-up is set; memguard estimates the final global batch size")

    # Mixed precision overwrites model / optimizer / DDP fields of the same names.
    mp: dict[str, Any] | None = None
    mp_key = "mixed_precision"
    if "mixed_precision" in top and top["mixed_precision"][0] is not None:
        mp, mp_key = _mp_values(top["mixed_precision"]), top["mixed_precision"][1]
    elif S.get("mixed_precision"):
        mp = dict(_MP_DEFAULTS)
        mp.update({name: val for name, (val, _) in S["mixed_precision"].items() if name != "_target_"})
        mp_key = "mixed_precision"
    if mp is not None:
        pd = dtype_name(mp.get("params_dtype"), mp_key + ".params_dtype") if mp.get("params_dtype") is not None else None
        bf16 = as_bool(mp.get("bf16")) or pd == "bf16"
        fp16 = as_bool(mp.get("fp16")) or pd == "fp16"
        b.set("bf16", bf16, mp_key)
        b.set("fp16", fp16, mp_key)
        if as_bool(mp.get("autocast_enabled")) and mp.get("autocast_dtype") is not None:
            b.set("autocast_dtype", dtype_name(mp["autocast_dtype"], mp_key + ".autocast_dtype"), mp_key)
        def mp_key_of(name: str) -> str:
            f = S.get("mixed_precision", {}).get(name)
            return f[1] if f and f[1] != "mixed_precision" else mp_key

        for flag in ("fp8", "fp4"):
            if mp.get(flag):
                b.set(flag, mp[flag], mp_key_of(flag))
            else:
                b.args.pop(flag, None)
        # fp8_param and fp8_param_gather are kept equal by MixedPrecisionConfig.__setattr__ (fp4 likewise)
        for alias, dest in (("fp8_param", "fp8_param_gather"), ("fp4_param", "fp4_param_gather")):
            if mp.get(alias) is not None:
                mp[dest] = mp[alias]
        for name in _MP_FP8_DEFAULTS:
            written = name in S.get("mixed_precision", {})
            if (mp.get("fp8") or mp.get("fp4") or written) and mp.get(name) is not None:
                b.set(name, mp[name], mp_key_of(name))
            else:
                b.args.pop(name, None)
    grad_fp32 = mp.get("grad_reduce_in_fp32") if mp is not None else v("ddp", "grad_reduce_in_fp32")
    grad_key = mp_key if mp is not None else k("ddp", "grad_reduce_in_fp32")
    if grad_fp32 is not None:
        if as_bool(grad_fp32):
            b.set("accumulate_allreduce_grads_in_fp32", True, grad_key)
        elif b.args.get("bf16"):
            b.set("grad_reduce_in_bf16", True, grad_key)
        else:
            b.set("accumulate_allreduce_grads_in_fp32", False, grad_key)

    # Optimizer and DDP.
    for name in ("use_distributed_optimizer", "overlap_param_gather"):
        on = [k(sec, name) for sec in ("ddp", "optimizer") if on_off(sec, name)]
        if on:
            b.set(name, True, on[0])
        elif has("ddp", name) or has("optimizer", name):
            b.set(name, False, k("ddp", name) if has("ddp", name) else k("optimizer", name))
    if has("optimizer", "optimizer"):
        emerging_optimizer(b, str(v("optimizer", "optimizer")), k("optimizer", "optimizer"),
                            on_off("optimizer", "use_layer_wise_distributed_optimizer"))
    for name in ("muon_scalar_optimizer", "optimizer_cuda_graph", "overlap_param_gather_with_optimizer_step"):
        if has("optimizer", name):
            b.set(name, v("optimizer", name), k("optimizer", name))
    for name in ("use_precision_aware_optimizer", "store_param_remainders", "optimizer_cpu_offload"):
        if has("optimizer", name):
            b.set(name, on_off("optimizer", name), k("optimizer", name))
    for name in ("main_grads_dtype", "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype"):
        if has("optimizer", name):
            b.set(name, dtype_name(v("optimizer", name), k("optimizer", name)), k("optimizer", name))
    for name, dest in (("overlap_grad_reduce", "overlap_grad_reduce"), ("num_distributed_optimizer_instances", None),
                       ("bucket_size", "ddp_bucket_size"), ("pad_buckets_for_high_nccl_busbw", "ddp_pad_buckets_for_high_nccl_busbw"),
                       ("use_megatron_fsdp", None), ("use_custom_fsdp", None), ("nccl_ub", None), ("delay_wgrad_compute", None)):
        if has("ddp", name):
            value = v("ddp", name)
            if name not in ("num_distributed_optimizer_instances", "bucket_size"):   # (the bool fields)
                value = on_off("ddp", name)
            b.set(dest or name, value, k("ddp", name))
    for name in ("use_megatron_fsdp", "use_torch_fsdp2"):
        if on_off("dist", name):
            b.set(name, True, k("dist", name))
    fsdp_and_offload_keys(b, v, k, "ddp", "optimizer")
    if "comm_overlap" in S:
        _comm_overlap_model_fields(b, S, v, k)
    tp_overlap, tp_overlap_key = python_scalar(v("comm_overlap", "tp_comm_overlap", False)), k("comm_overlap", "tp_comm_overlap")
    if bridge_truth(b, tp_overlap, tp_overlap_key):
        # CommOverlapConfig._get_model_comm_overlap_cfgs (Bridge 0.6.2) switches it off, with a warning, for
        # TP < 2 or without sequence parallelism, when it ``is True``; another true value (1, 'yes') skips that
        # check and _override_user_cfgs copies it into the model config, where its truth turns the overlap on
        try:
            tp = int(b.args.get("tensor_model_parallel_size") or 1)
        except (TypeError, ValueError):
            tp = 2   # (a bad value is reported by resolve)
        if (tp < 2 or not as_bool(b.args.get("sequence_parallel", False))) and tp_overlap is not True:
            b.problem(tp_overlap_key, f"{shown(tp_overlap)} is not true: Megatron-Bridge 0.6.2's CommOverlapConfig "
                      "switches TP communication overlap off at TP < 2 or without sequence parallelism only for a "
                      "value that `is True`, so it starts Transformer Engine's userbuffers here (TP "
                      f"{tp}{'' if as_bool(b.args.get('sequence_parallel', False)) else ', no sequence parallelism'}), "
                      "which Megatron-LM refuses and memguard does not model", "write true (Bridge switches it off) "
                      "or false")
            b.args.pop("tp_comm_overlap", None)
        elif tp < 2 or not as_bool(b.args.get("sequence_parallel", False)):
            b.warn(f"{tp_overlap_key}: Megatron-Bridge switches TP communication overlap off "
                   "with TP < 2 or without sequence parallelism")
            b.args.pop("tp_comm_overlap", None)
        else:
            b.set("tp_comm_overlap", True, k("comm_overlap", "tp_comm_overlap"))
            if v("comm_overlap", "tp_comm_overlap_cfg") is not None:   # TransformerLayerTPOverlapCfg, as a mapping
                b.set("tp_comm_overlap_cfg", v("comm_overlap", "tp_comm_overlap_cfg"),
                      k("comm_overlap", "tp_comm_overlap_cfg"))
    dp_hint = v("comm_overlap", "data_parallel_size") or (top.get("data_parallel_size", (None,))[0])
    if dp_hint:
        try:
            sizes = [int(b.args.get(n) or 1) for n in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size")]
            b.world_size = int(dp_hint) * sizes[0] * sizes[1] * sizes[2]
            b.origin["world_size"] = "comm_overlap.data_parallel_size x TP x PP x CP"
            b.warn(f"world size {b.world_size} taken from the data-parallel size the dump records ({dp_hint}) x TP x PP x CP")
        except (TypeError, ValueError, OverflowError):
            pass

    # Attention mask on the GPU: GPTDatasetConfig.create_attention_mask (True) unless the step skips it
    # (skip_getting_attention_mask_from_dataset, True by default in gpt_step.get_batch).
    cam = as_bool(v("dataset", "create_attention_mask", True)) and not as_bool(v("dataset", "skip_getting_attention_mask_from_dataset", True))
    b.set("create_attention_mask_in_dataloader", cam,
          k("dataset", "skip_getting_attention_mask_from_dataset") if has("dataset", "skip_getting_attention_mask_from_dataset")
          else "dataset.skip_getting_attention_mask_from_dataset")

    # Vocabulary (training/setup.py _validate_and_set_vocab_size): the tokenizer's size when
    # use_tokenizer_vocab_size or no model.vocab_size, padded to make_vocab_size_divisible_by x TP; else
    # model.vocab_size, padded only with model.should_pad_vocab.
    use_tok = as_bool(v("tokenizer", "use_tokenizer_vocab_size", False))
    if use_tok or not has("model", "vocab_size"):
        ttype = v("tokenizer", "tokenizer_type")
        if ttype:
            b.set("tokenizer_type", ttype, k("tokenizer", "tokenizer_type"))
        if has("tokenizer", "tokenizer_model"):
            b.set("tokenizer_model", v("tokenizer", "tokenizer_model"), k("tokenizer", "tokenizer_model"))
        if has("tokenizer", "vocab_size"):
            b.set("vocab_size", v("tokenizer", "vocab_size"), k("tokenizer", "vocab_size"))
            if not ttype:
                b.set("tokenizer_type", "HuggingFaceTokenizer", k("tokenizer", "vocab_size"))
        else:
            b.origin["vocab_size"] = k("tokenizer", "tokenizer_model") if has("tokenizer", "tokenizer_model") else k("tokenizer", "tokenizer_type")
            if not ttype and has("model", "vocab_size"):
                set_vocab(b, v("model", "vocab_size"), k("model", "vocab_size"), pad=True)
    else:
        set_vocab(b, v("model", "vocab_size"), k("model", "vocab_size"), pad=as_bool(v("model", "should_pad_vocab", False)))


# ConfigContainer sections Megatron-Bridge 0.6.2 declares without None that it still tests against None
# (config.py: ``if self.profiling is not None``): a null there is "no profiling", not an error
_NONEABLE_SECTIONS = frozenset({"profiling"})


def _refuse_unset_sections(S: dict[str, dict[str, Field]], top: dict[str, Field]) -> None:
    """'???' and null in the non-model sections, as Megatron-Bridge 0.6.2 treats them (refuse_unset_section_field;
    the model section: map_mcore_fields, peft: _peft). A whole section null where ConfigContainer declares it
    without None (train, optimizer, ddp, dataset, tokenizer, scheduler, checkpoint, ...) is an error: Bridge's
    validate fails on it (``'NoneType' object has no attribute ...``) or its setup does (the tokenizer)."""
    for sec, (value, key) in top.items():
        row = section_typed_field(sec, "")
        if row is None or " (recipe " in key:
            continue
        if is_missing(value):
            raise ConfigError(key, "is ??? (OmegaConf's missing marker): Megatron-Bridge passes the text '???' on, "
                                   f"where it needs a {row['class']}", f"give the {sec}: section")
        if value is None and row["default"] == "required" and sec not in _NONEABLE_SECTIONS:
            raise ConfigError(key, f"is null: Megatron-Bridge's ConfigContainer declares {row['class']} (not Optional) "
                                   "and fails on None", f"give the {sec}: section or drop the key")
        if value is not None and sec != "mixed_precision":
            # (mixed_precision alone takes a preset's name) a word or a list where the section's fields go: Bridge
            # fails on its attributes; read as absent it would give the section's defaults silently
            raise ConfigError(key, f"must be a mapping of {row['class']} fields, got {shown(value)}",
                              f"give the {sec}: section's fields or drop the key")
    for sec, fields in S.items():
        if sec in ("model", "peft", "env_vars"):
            continue
        target = fields.get("_target_", (None,))[0]
        own = section_typed_field(sec, "")
        # (another class than the table's, e.g. a fine-tuning dataset: only '???' is checked)
        typed = not (isinstance(target, str) and own is not None and not target.endswith(own["class"]))
        for name, f in fields.items():
            if name.startswith("_") or f[1] == sec:   # (_target_; a preset's own values, opened by an override)
                continue
            if typed or is_missing(f[0]):
                refuse_unset_section_field(sec, name, f, _NEEDED_SET.get(sec, ()))


# CommOverlapConfig fields that CommOverlapConfig.setup writes into the model config (Bridge 0.6.2
# training/comm_overlap.py _get_model_comm_overlap_cfgs: off unless the comm_overlap section sets them)
_COMM_OVERLAP_MODEL = ("overlap_moe_expert_parallel_comm", "delay_wgrad_compute", "defer_embedding_wgrad_compute",
                       "tp_comm_overlap")


def _comm_overlap_model_fields(b: ArgsBuilder, S: dict[str, dict[str, Field]], v, k) -> None:
    """With a comm_overlap section, Bridge's CommOverlapConfig.setup (run by ConfigContainer.validate) overwrites
    these model fields with the section's values, False where the section leaves them None: a model.* True is
    turned off (a warning), a comm_overlap.* True turns the feature on."""
    for name in _COMM_OVERLAP_MODEL:
        mine = python_scalar(v("comm_overlap", name))
        if mine is not None and (name != "tp_comm_overlap" or bool(mine)):   # (the others are bools: _bridge_bools)
            if name != "tp_comm_overlap":      # (tp_comm_overlap on: its TP / SP conditions are applied below)
                b.set(name, true_or_false(mine, k("comm_overlap", name)), k("comm_overlap", name))
            continue
        if as_bool(b.args.get(name, False)):
            b.warn(f"{b.origin.get(name, 'model.' + name)}: Megatron-Bridge's CommOverlapConfig.setup turns it off "
                   f"(comm_overlap.{name} is {'false' if mine is not None else 'not set'}); estimated without it")
        b.args.pop(name, None)
        b.origin.pop(name, None)
    if v("comm_overlap", "wgrad_deferral_limit") is not None:
        b.set("wgrad_deferral_limit", v("comm_overlap", "wgrad_deferral_limit"),
              k("comm_overlap", "wgrad_deferral_limit"))
    # _get_optimizer_overlap_cfgs, applied to the optimizer and DDP configs with the distributed optimizer: gradient
    # reduce and parameter gather overlapped, and 128 Mi-element buckets, iff the data-parallel size is > 1, whatever
    # ddp.* says, unless the section sets them. DP is known only with the world size: resolve/optimizer.py applies it.
    for name, dest in _COMM_OVERLAP_DDP:
        if v("comm_overlap", name) is not None:
            b.set(dest, v("comm_overlap", name), k("comm_overlap", name))
    b.set("bridge_comm_overlap_ddp", True, "comm_overlap")


# CommOverlapConfig's flags memguard reads but tp_comm_overlap (Bridge 0.6.2 comm_overlap.py: Optional[bool], copied into
# the model / DDP config by _override_user_cfgs whatever their value, and read there by their truth; the `is True` tests
# of overlap_moe_expert_parallel_comm and delay_wgrad_compute guard asserts that TransformerConfig repeats by truth)
_COMM_OVERLAP_TRUTH = ("overlap_moe_expert_parallel_comm", "delay_wgrad_compute", "defer_embedding_wgrad_compute",
                       "overlap_grad_reduce", "overlap_param_gather")
# MixedPrecisionConfig's bool fields (Bridge 0.6.2 training/mixed_precision.py; its setup copies each into the model,
# optimizer and DDP configs, which test their truth)
_MP_BOOLS = ("bf16", "fp16", "fp32", "grad_reduce_in_fp32", "autocast_enabled", "first_last_layers_bf16", "fp8_wgrad",
             "fp8_param_gather", "fp8_param", "fp4_param_gather", "fp4_param", "fp8_dot_product_attention",
             "fp8_multi_head_attention", "reuse_grad_buf_for_mxfp8_param_ag")


# CommOverlapConfig fields _get_optimizer_overlap_cfgs writes into the DDP config (Bridge 0.6.2 comm_overlap.py)
_COMM_OVERLAP_DDP = (("overlap_grad_reduce", "overlap_grad_reduce"), ("overlap_param_gather", "overlap_param_gather"),
                     ("bucket_size", "ddp_bucket_size"))


_NEEDED = {
    "model": {"num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "num_query_groups", "kv_channels",
              "tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size", "seq_length",
              "virtual_pipeline_model_parallel_size", "sequence_parallel", "vocab_size"},
    "train": {"micro_batch_size", "global_batch_size"},
    "dataset": {"seq_length"},
}
# of those, the non-model ones ConfigContainer.validate asserts are set although TrainingConfig declares them
# None-able (Bridge 0.6.2: "train.micro_batch_size must be set when eval_micro_batch_size is not explicitly configured")
_NEEDED_SET = {"train": frozenset({"micro_batch_size", "global_batch_size"})}


