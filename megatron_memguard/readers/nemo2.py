"""NeMo 2 YAML, best effort (NeMo 2's LLM collection is deprecated in favour of Megatron-Bridge).

Two kinds of file, both written by NeMo-Run's YAML serializer (``_target_`` dotted paths, functions
and torch dtypes as ``{_target_: ..., _call_: false}``):

* a checkpoint's ``context/model.yaml`` (``IOMixin.io_dump``): the model with every GPTConfig field
  filled in under ``config:``, the optimizer config, the tokenizer; no batch sizes, no world size;
* a ``--to-yaml`` export / ``<task>_config.yaml`` of a recipe (``_target_: ...api.pretrain``): trainer
  (devices, num_nodes, ``strategy`` with the parallel sizes, ``plugins`` with the precision), data
  (batch sizes, sequence length), optim; the model config often only names its class
  (``Llama3Config8B``) because fiddle keeps explicitly set arguments only. The class's shape comes from
  the presets (data/presets.yaml ``nemo2:``).

Defaults read in NeMo 2.5.0: ``nemo/collections/llm/gpt/model/base.py`` GPTConfig (and its
``configure_model`` vocabulary handling), ``nemo/lightning/pytorch/strategies/megatron_strategy.py``,
``nemo/collections/llm/gpt/data/{mock,pre_training}.py`` (create_attention_mask=False).
"""
from __future__ import annotations

from typing import Any, Mapping

from ..config import RawConfig
from ..errors import ConfigError, NotModelledError, ReaderError
from ._common import (
    GEMMA2_WHAT, GEMMA3_FIELDS, GEMMA3_NEMO2_WHAT, ArgsBuilder, apply_overrides, as_bool, config_fields, default_ffn_hidden_size,
    dtype_name, emerging_optimizer, fsdp_and_offload_keys, gemma_class_what, group_query_attention, is_gemma3_class,
    is_missing, map_mcore_fields, model_fields_read, refuse_softcapping, refuse_unset, peft_module_list, refuse_unset_section_field, set_vocab,
    target_name,
    _FSDP_DDP_KEYS, _MISSING_RULE, _OFFLOAD_OPTIMIZER_KEYS,
)

_GPTCONFIG_EXTRAS = frozenset({
    "forward_step_fn", "data_step_fn", "generation_config", "tp_comm_overlap_cfg", "transformer_layer_spec",
    "use_transformer_engine_full_layer_spec", "vocab_size", "seq_length", "scatter_embedding_sequence_parallel",
    "parallel_output", "share_embeddings_and_output_weights", "seq_len_interpolation_factor", "_target_",
    "num_moe_experts", "scale_factor", "low_freq_factor", "high_freq_factor", "old_context_len",
})
_STRATEGY_KEYS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
                  "context_parallel_size", "sequence_parallel", "expert_model_parallel_size", "expert_tensor_parallel_size",
                  "num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage",
                  "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split",
                  "pipeline_model_parallel_layout", "microbatch_group_size_per_vp_stage")


def _is_nemo_target(v: Any) -> bool:
    return isinstance(v, Mapping) and str(v.get("_target_", "")).startswith("nemo.")


def looks_like_nemo2(doc: Mapping) -> bool:
    return str(doc.get("_target_", "")).startswith("nemo.") or _is_nemo_target(doc.get("config")) or _is_nemo_target(doc.get("model"))


def read_nemo2(doc: Mapping, path: str, overrides: list[tuple[str, str, Any]]) -> RawConfig:
    from .hf import hf_to_provider
    from .models import model_hf, nemo2_class_fields, nemo2_model

    doc = apply_overrides(dict(doc), overrides)
    b = ArgsBuilder(f"NeMo 2 config {path} (best effort)")
    b.best_effort = True
    if "config" in doc and "model" not in doc:      # context/model.yaml: the model itself
        model, mprefix = doc, ""
    else:
        model, mprefix = doc.get("model") or {}, "model."
    if not isinstance(model, Mapping):
        raise ReaderError(f"{path}: {mprefix or 'the file'}: not a NeMo 2 model mapping")
    cfg = model.get("config") or {}
    if not isinstance(cfg, Mapping):
        raise ReaderError(f"{path}: {mprefix}config: not a mapping")
    ckey = f"{mprefix}config"
    cls = target_name(cfg) or "GPTConfig"
    fields: dict[str, tuple[Any, str]] = {}
    preset = nemo2_model(cls)
    # Gemma3Config* (NeMo 2.5.0 llm/gpt/model/gemma3.py): the whole class is bundled (nemo2_classes), shape included
    gemma3 = dict(nemo2_class_fields(cls)) if is_gemma3_class(cls) else {}
    if gemma3:
        for name, value in gemma3.items():
            fields[name] = (value, f"{ckey}._target_ ({cls})")
    elif preset:
        # The class's own defaults (its shape) under what the file sets explicitly.
        for name, value in {**hf_to_provider(model_hf(preset)), **nemo2_class_fields(cls)}.items():
            if name not in ("seq_length",):
                fields[name] = (value, f"{ckey}._target_ ({cls})")
        if "num_layers" not in cfg:
            b.warn(f"{ckey}: the export names only {cls}; its shape is taken from memguard's preset {preset}")
    elif "num_layers" not in cfg:
        b.warn(f"{ckey}: {cls} is not a class memguard knows and the file has no shape; give --model NAME")
    given = {str(name): (value, f"{ckey}.{name}") for name, value in cfg.items() if name != "_target_"}
    refuse_unset(given, model_fields_read(), model_fields_read(), "NeMo 2")   # the file's '???' / null, not the preset's
    # a Gemma 3 class memguard has not bundled by its class, before Gemma2Config's softcapping defaults
    # (gemma2_layer_spec) by the key the file sets
    gemma_what = (GEMMA3_NEMO2_WHAT if not gemma3 else None) if is_gemma3_class(cls) else gemma_class_what(cls)
    if gemma_what is not None and gemma_what is not GEMMA2_WHAT:
        raise NotModelledError(f"{ckey}._target_", gemma_what)
    refuse_softcapping(given)
    if gemma_what is not None:
        raise NotModelledError(f"{ckey}._target_", gemma_what)
    for name, (value, key) in given.items():
        if not is_missing(value):
            fields[name] = (value, key)
    extra = config_fields().get("GPTModelProvider", frozenset()) | _GPTCONFIG_EXTRAS
    if gemma3:
        extra |= GEMMA3_FIELDS | {"softmax_scale"}
        _gemma3_layers(b, fields, f"{ckey}._target_ ({cls})")
    map_mcore_fields(b, fields, extra_known=extra, unknown_context="megatron-core / NeMo 2 GPTConfig")
    if gemma3:
        # gemma3_layer_spec builds the q / k TENorms whatever qk_layernorm says (a checkpoint's model.yaml writes
        # GPTConfig's False)
        b.set("qk_layernorm", True, f"{ckey}.transformer_layer_spec (gemma3_layer_spec)")
        window, wkey = fields.get("window_size", (None, ""))
        if isinstance(window, int) and not isinstance(window, bool) and window > 0:
            # NeMo's Gemma3TEDotProductAttention: a local layer's window is (window_size, 0) (Bridge's: window_size - 1)
            b.set("window_size", [window, 0], wkey)
    group_query_attention(b, fields)
    if fields.get("ffn_hidden_size", (None,))[0] is None and fields.get("hidden_size", (None,))[0] is not None:
        default_ffn_hidden_size(b, fields["hidden_size"][0], fields["hidden_size"][1])
    # GPTConfig / TransformerConfig defaults that differ from Megatron's argument defaults.
    b.default("bias_activation_fusion", False, f"{ckey}.bias_activation_fusion")
    b.default("bias_dropout_fusion", False, f"{ckey}.bias_dropout_fusion")
    b.default("apply_rope_fusion", False, f"{ckey}.apply_rope_fusion")
    b.default("cross_entropy_loss_fusion", True, f"{ckey}.cross_entropy_loss_fusion")
    if not as_bool(b.args.get("overlap_p2p_comm", False)):
        b.args.pop("overlap_p2p_comm", None)
    if "seq_length" not in b.args:
        b.set("seq_length", 1024, f"{ckey}.seq_length")  # GPTConfig default (the data module's wins below)

    # Trainer: world size, strategy (parallel sizes, DDP), precision plugin.
    trainer = doc.get("trainer") or {}
    _refuse_unset_sections(doc)
    if isinstance(trainer, Mapping):
        b.trainer_world(trainer.get("devices"), trainer.get("num_nodes", 1))
        strategy = trainer.get("strategy") or {}
        if isinstance(strategy, Mapping):
            for name in _STRATEGY_KEYS:
                if strategy.get(name) is not None:
                    dest = {"num_layers_in_first_pipeline_stage": "decoder_first_pipeline_num_layers",
                            "num_layers_in_last_pipeline_stage": "decoder_last_pipeline_num_layers"}.get(name, name)
                    b.set(dest, strategy[name], f"trainer.strategy.{name}")
            if strategy.get("num_distributed_optimizer_instances") is not None:
                b.set("num_distributed_optimizer_instances", strategy["num_distributed_optimizer_instances"],
                      "trainer.strategy.num_distributed_optimizer_instances")
            ddp = strategy.get("ddp")
            if isinstance(ddp, Mapping):
                _ddp(b, ddp, "trainer.strategy.ddp")
            if strategy.get("fsdp"):
                b.set("use_torch_fsdp2", True, "trainer.strategy.fsdp")
        plugins = trainer.get("plugins")
        for i, plug in enumerate(plugins if isinstance(plugins, list) else [plugins] if plugins else []):
            pkey = "trainer.plugins" + (f"[{i}]" if isinstance(plugins, list) else "")
            if isinstance(plug, Mapping) and "MixedPrecision" in str(plug.get("_target_", "")):
                _precision(b, plug, pkey)
            elif isinstance(plug, Mapping) and not plug.get("_target_"):
                # only overrides (trainer.plugins.fp8=hybrid on a file that does not write the plugin):
                # their FP8 keys, as the recipe's MegatronMixedPrecision would take them
                _fp8_keys(b, plug, pkey)

    # Data module: batch sizes and sequence length.
    data = doc.get("data") or {}
    if isinstance(data, Mapping):
        for name in ("micro_batch_size", "global_batch_size"):
            if data.get(name) is not None:
                b.set(name, data[name], f"data.{name}")
        if data.get("seq_length") is not None:
            if "seq_length" in cfg and cfg["seq_length"] != data["seq_length"]:
                b.problem(f"{ckey}.seq_length", f"{cfg['seq_length']} differs from data.seq_length = {data['seq_length']}",
                          "make the two equal")
            b.set("seq_length", data["seq_length"], "data.seq_length")
        b.set("create_attention_mask_in_dataloader", as_bool(data.get("create_attention_mask", False)),
              "data.create_attention_mask")
    else:
        b.set("create_attention_mask_in_dataloader", False, "data.create_attention_mask")

    # Optimizer.
    optim = doc.get("optim") or model.get("optim") or {}
    oprefix = "optim" if doc.get("optim") else f"{mprefix}optim"
    ocfg = optim.get("config") if isinstance(optim, Mapping) else None
    if isinstance(ocfg, Mapping):
        okey = f"{oprefix}.config"
        if ocfg.get("optimizer") is not None:
            b.set("optimizer", ocfg["optimizer"], f"{okey}.optimizer")
        for name in ("use_distributed_optimizer", "use_precision_aware_optimizer", "store_param_remainders",
                     "overlap_param_gather", "optimizer_cpu_offload"):
            if ocfg.get(name) is not None:
                if name == "overlap_param_gather" and not as_bool(ocfg[name]):
                    continue
                b.set(name, as_bool(ocfg[name]), f"{okey}.{name}")
        for name in ("main_grads_dtype", "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype"):
            if ocfg.get(name) is not None:
                b.set(name, dtype_name(ocfg[name], f"{okey}.{name}"), f"{okey}.{name}")

    elif doc.get("optim") is None and model.get("optim") is None:
        # no optimizer (absent or null): the model keeps its own, GPTModel.__init__'s 'optim or
        # MegatronOptimizerModule(config=OptimizerConfig(lr=1e-4, use_distributed_optimizer=True))' (NeMo 2.5.0
        # collections/llm/gpt/model/base.py; api.py _setup connects a given optim only)
        b.default("use_distributed_optimizer", True, "optim")

    # Megatron-FSDP (trainer.strategy.ddp) and optimizer offload (optim.config) keys.
    tstrat = trainer.get("strategy") if isinstance(trainer, Mapping) else None
    secs = {"ddp": (tstrat.get("ddp") if isinstance(tstrat, Mapping) else None, "trainer.strategy.ddp"),
            "optim": (ocfg, f"{oprefix}.config")}

    def sec_val(sec: str, name: str) -> Any:
        d = secs[sec][0]
        return d.get(name) if isinstance(d, Mapping) else None

    fsdp_and_offload_keys(b, sec_val, lambda sec, name: f"{secs[sec][1]}.{name}", "ddp", "optim")
    if isinstance(ocfg, Mapping):
        okey = f"{oprefix}.config"
        if ocfg.get("optimizer") is not None:
            # MegatronOptimizerModule passes the OptimizerConfig to get_megatron_optimizer as it is
            emerging_optimizer(b, str(ocfg["optimizer"]), f"{okey}.optimizer",
                               as_bool(ocfg.get("use_layer_wise_distributed_optimizer", False)))
        for name in ("muon_scalar_optimizer", "optimizer_cuda_graph", "overlap_param_gather_with_optimizer_step"):
            if ocfg.get(name) is not None:
                b.set(name, ocfg[name], f"{okey}.{name}")

    # Vocabulary: GPTConfig.vocab_size is used as is; else the tokenizer's, padded (get_vocab_size).
    vocab = cfg.get("vocab_size") if not is_missing(cfg.get("vocab_size")) else None
    if vocab:
        set_vocab(b, vocab, f"{ckey}.vocab_size", pad=False)
    elif gemma3.get("vocab_size"):
        set_vocab(b, gemma3["vocab_size"], f"{ckey}._target_ ({cls})", pad=False)
    else:
        tok, tkey = None, None
        for cand, key in ((doc.get("tokenizer"), "tokenizer"), (model.get("tokenizer"), f"{mprefix}tokenizer"),
                          (data.get("tokenizer") if isinstance(data, Mapping) else None, "data.tokenizer")):
            if isinstance(cand, Mapping):
                tok, tkey = cand, key
                break
        if tok is not None:
            name = tok.get("pretrained_model_name") or tok.get("model_name") or tok.get("model_path")
            if name:
                b.set("tokenizer_type", "HuggingFaceTokenizer", f"{tkey}._target_")
                b.set("tokenizer_model", name, f"{tkey}.pretrained_model_name")
            else:
                b.set("tokenizer_type", target_name(tok) or "NeMoTokenizer", f"{tkey}._target_")
            if tok.get("vocab_size"):
                b.set("vocab_size", tok["vocab_size"], f"{tkey}.vocab_size")
        elif preset:
            set_vocab(b, model_hf(preset).get("vocab_size"), f"{ckey}._target_ ({cls})", pad=True)
        else:
            b.set("tokenizer_type", "NeMoTokenizer", "tokenizer")
            b.origin["vocab_size"] = "tokenizer"
    _grad_reduce_dtype(b)
    if gemma3:
        _gemma3_parallelism(b, cls)
    _peft(b, doc, model, mprefix)
    if b.args.get("attention_backend") == "local" and b.args.get("transformer_impl", "transformer_engine") != "local":
        # NeMo 2.5's GPTConfig keeps the TE spec's core attention (it does not swap in megatron-core's
        # DotProductAttention as Megatron-Bridge does), and LanguageModule sets NVTE_FLASH/FUSED/UNFUSED_ATTN=0
        # for the local backend (language_module.py, 0.16.1 and 0.19.2): TE's DotProductAttention then has no
        # backend and raises at the first forward (TE 2.11 dot_product_attention.py)
        b.problem(b.origin.get("attention_backend", "attention_backend"),
                  "local needs the local layer spec in NeMo 2 (Transformer Engine's attention finds no backend "
                  "with NVTE_*_ATTN=0)", "use attention_backend unfused, or the local transformer_layer_spec")
    return b.build()


def _gemma3_layers(b: ArgsBuilder, fields: Mapping[str, tuple[Any, str]], class_key: str) -> None:
    """NeMo 2.5.0's Gemma 3 layers (llm/gpt/model/gemma3.py): gemma3_layer_spec's two TERowParallelLinearLayerNorm
    projections (gemma2.py: a TENorm on each output) and q / k TENorms (built whatever qk_layernorm says), and
    Gemma3RotaryEmbedding, whose lru_cached forward returns the local and the global table as a tuple (two tables,
    no stack: Bridge's stacks them). ``is_vision_language`` (the 4B / 12B / 27B classes' default) is refused."""
    vl, vl_key = fields.get("is_vision_language", (False, class_key))
    if not is_missing(vl) and as_bool(vl):
        raise NotModelledError(vl_key, "NeMo 2's Gemma 3 with is_vision_language (Gemma3Config4B / 12B / 27B's default: "
                               "Gemma3TEDotProductAttention takes an arbitrary attention mask, the VL model's)",
                               "set model.config.is_vision_language: false for the text model")
    spec = fields.get("transformer_layer_spec", (None, ""))[0]
    name = (target_name(spec) or str(spec)) if spec is not None else "gemma3_layer_spec"
    if name.strip().rsplit(".", 1)[-1] != "gemma3_layer_spec":
        raise NotModelledError(fields["transformer_layer_spec"][1], f"a Gemma3Config with the layer spec {name!r} "
                               "(memguard reads gemma3_layer_spec's layers)")
    b.set("post_proj_norms", True, class_key)
    b.set("rotary_tables", 2, class_key)


def _gemma3_parallelism(b: ArgsBuilder, cls: str) -> None:
    """Gemma3Config.configure_model (NeMo 2.5.0): a ValueError for context parallelism, an assertion for virtual
    pipeline stages."""
    cp = b.args.get("context_parallel_size")
    if isinstance(cp, int) and cp > 1:
        b.problem(b.origin.get("context_parallel_size", "context_parallel_size"), f"must be 1 with {cls} (Gemma3Config."
                  "configure_model raises ValueError: Context Parallel is not supported for Gemma3 model)",
                  "trainer.strategy.context_parallel_size=1")
    vpp = b.args.get("virtual_pipeline_model_parallel_size")
    if isinstance(vpp, int) and vpp > 1:
        b.problem(b.origin.get("virtual_pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size"),
                  f"must be null with {cls} (Gemma3Config.configure_model asserts: Virtual pipeline model parallel "
                  "size is not yet supported for Gemma3 model)", "trainer.strategy.virtual_pipeline_model_parallel_size=null")


# '???' and null outside the model config. NeMo 2 builds each section's class from the YAML as it is (fiddle): '???' is
# the text, a null is None handed to the class, never its default. A null is refused where the class declares an int
# with a value default (None fails in arithmetic) or a bool defaulting to true; a bool defaulting to false reads None
# as false, its default, and Optional arguments keep None's meaning (NeMo 2.5.0 sources named per section).
_NULL_INT = "NeMo 2 passes None on, where {cls} declares int with default {default} (the default is not taken)"
_NEMO2_SECTIONS: tuple[tuple[str, str, dict[str, str | None]], ...] = (
    # Lightning 2.5 Trainer: accelerator_connector.py raises "`num_nodes` must be a positive integer"; accelerators/
    # cuda.py parse_devices / get_parallel_devices refuse None (devices' default is 'auto')
    ("trainer", "", {"devices": "Lightning's GPU accelerator rejects None as its device list (TypeError), its default "
                                "'auto' is not taken",
                     "num_nodes": "Lightning's Trainer raises '`num_nodes` must be a positive integer', its default 1 "
                                  "is not taken"}),
    # lightning/pytorch/strategies/megatron_strategy.py MegatronStrategy.__init__
    ("trainer.strategy", "MegatronStrategy", {
        **{n: _NULL_INT.format(cls="MegatronStrategy", default=1)
           for n in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                     "expert_model_parallel_size", "num_distributed_optimizer_instances")},
        **{n: None for n in ("virtual_pipeline_model_parallel_size", "sequence_parallel", "expert_tensor_parallel_size",
                             "num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage",
                             "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split",
                             "pipeline_model_parallel_layout", "microbatch_group_size_per_vp_stage", "fsdp")},
        # 'ddp: Union[DDPLiteral, DistributedDataParallelConfig] = "megatron"': any other value raises "Invalid DDP type"
        "ddp": "MegatronStrategy raises 'Invalid DDP type: None', its default 'megatron' is not taken"}),
    # collections/llm/gpt/data/pre_training.py PreTrainingDataModule, mock.py MockDataModule: seq_length: int = 2048,
    # micro_batch_size: int = 4, global_batch_size: int = 8, create_attention_mask: bool = False
    ("data", "PreTrainingDataModule", {
        "micro_batch_size": _NULL_INT.format(cls="PreTrainingDataModule", default=4),
        "global_batch_size": _NULL_INT.format(cls="PreTrainingDataModule", default=8),
        "seq_length": _NULL_INT.format(cls="PreTrainingDataModule", default=2048),
        "create_attention_mask": None}),
)
# lightning/pytorch/plugins/mixed_precision.py MegatronMixedPrecision: 'grad_reduce_in_fp32: bool = True' goes to the
# DDP config as it is (update_config_with_dtype_overrides): None reduces in the parameter dtype. A null precision is
# its '32-true' (DtypeConfig: neither fp16 nor bf16), as memguard reads it.
_PLUGIN_NULL = {"grad_reduce_in_fp32": "NeMo 2 passes None on, where MegatronMixedPrecision declares bool with default "
                                       "True: None reaches the DDP config and reduces gradients in the parameter "
                                       "dtype, not in fp32"}
_PLUGIN_READ = ("precision", "params_dtype", "bf16", "fp16", "fp8", "fp4", "grad_reduce_in_fp32")
# the optimizer (megatron-core OptimizerConfig) and DDP (DistributedDataParallelConfig) fields the reader takes
_OPTIM_READ = ("optimizer", "use_distributed_optimizer", "use_precision_aware_optimizer", "store_param_remainders",
               "overlap_param_gather", "optimizer_cpu_offload", "main_grads_dtype", "main_params_dtype", "exp_avg_dtype",
               "exp_avg_sq_dtype", "use_layer_wise_distributed_optimizer", "muon_scalar_optimizer",
               "optimizer_cuda_graph", "overlap_param_gather_with_optimizer_step") + _OFFLOAD_OPTIMIZER_KEYS
_DDP_READ = ("use_distributed_optimizer", "overlap_grad_reduce", "overlap_param_gather", "num_distributed_optimizer_instances",
             "bucket_size", "use_megatron_fsdp", "use_custom_fsdp", "delay_wgrad_compute", "nccl_ub",
             "grad_reduce_in_fp32") + tuple(n for n, _ in _FSDP_DDP_KEYS)


def _refuse_unset(value: Any, key: str, null_rule: str | None) -> None:
    if is_missing(value):
        raise ConfigError(key, f"is ??? (OmegaConf's missing marker): {_MISSING_RULE['NeMo 2']}", f"set {key}=VALUE")
    if value is None and null_rule:
        raise ConfigError(key, f"is null: {null_rule}", f"set {key}=VALUE or drop the key")


def _refuse_unset_sections(doc: Mapping) -> None:
    """'???' and null on the trainer / strategy / data / precision-plugin / optimizer / DDP keys the reader takes."""
    for path, _cls, rules in _NEMO2_SECTIONS:
        sec: Any = doc
        for part in path.split("."):
            sec = sec.get(part) if isinstance(sec, Mapping) else None
        if not isinstance(sec, Mapping):
            continue
        for name, rule in rules.items():
            if name in sec:
                _refuse_unset(sec[name], f"{path}.{name}", rule)
    if is_missing(doc.get("optim")):
        # api.py _setup: 'if optim: optim.connect(model)' on the text '???' (a null keeps the model's own optimizer)
        raise ConfigError("optim", f"is ??? (OmegaConf's missing marker): {_MISSING_RULE['NeMo 2']}", "set optim=VALUE")
    trainer = doc.get("trainer")
    if not isinstance(trainer, Mapping):
        return
    plugins = trainer.get("plugins")
    for i, plug in enumerate(plugins if isinstance(plugins, list) else [plugins]):
        if isinstance(plug, Mapping):
            pkey = "trainer.plugins" + (f"[{i}]" if isinstance(plugins, list) else "")
            for name in _PLUGIN_READ + tuple(_FP8_PLUGIN_KEYS):
                if name in plug:
                    _refuse_unset(plug[name], f"{pkey}.{name}", _PLUGIN_NULL.get(name))
    strategy = trainer.get("strategy")
    ddp = strategy.get("ddp") if isinstance(strategy, Mapping) else None
    if isinstance(ddp, Mapping):
        for name in _DDP_READ:
            if name in ddp:
                refuse_unset_section_field("ddp", name, (ddp[name], f"trainer.strategy.ddp.{name}"), carrier="NeMo 2")
    for optim, oprefix in ((doc.get("optim"), "optim"), ((doc.get("model") or {}).get("optim")
                                                         if isinstance(doc.get("model"), Mapping) else None, "model.optim")):
        ocfg = optim.get("config") if isinstance(optim, Mapping) else None
        if isinstance(ocfg, Mapping):
            for name in _OPTIM_READ:
                if name in ocfg:
                    refuse_unset_section_field("optimizer", name, (ocfg[name], f"{oprefix}.config.{name}"),
                                               carrier="NeMo 2")


def _grad_reduce_dtype(b: ArgsBuilder) -> None:
    """``grad_reduce_in_fp32: false`` reduces in the parameter dtype (megatron-core
    distributed_data_parallel.py: ``torch.float if grad_reduce_in_fp32 else param.dtype``, 0.16.1 and
    0.19.2). Read before the dtype is known it stands as --grad-reduce-in-bf16; on an fp16 / fp32 job it
    is the absence of fp32 accumulation, not a bf16 reduction."""
    if b.args.get("grad_reduce_in_bf16") and not as_bool(b.args.get("bf16", False)):
        key = b.origin.pop("grad_reduce_in_bf16", "grad_reduce_in_fp32")
        b.args.pop("grad_reduce_in_bf16")
        b.set("accumulate_allreduce_grads_in_fp32", False, key)


def _ddp(b: ArgsBuilder, ddp: Mapping, key: str) -> None:
    for name, dest in (("use_distributed_optimizer", None), ("overlap_grad_reduce", None), ("overlap_param_gather", None),
                       ("num_distributed_optimizer_instances", None), ("bucket_size", "ddp_bucket_size"),
                       ("use_megatron_fsdp", None), ("use_custom_fsdp", None), ("delay_wgrad_compute", None),
                       ("nccl_ub", None)):
        if ddp.get(name) is not None:
            b.set(dest or name, ddp[name], f"{key}.{name}")
    if ddp.get("grad_reduce_in_fp32") is not None:
        if as_bool(ddp["grad_reduce_in_fp32"]):
            b.set("accumulate_allreduce_grads_in_fp32", True, f"{key}.grad_reduce_in_fp32")
        else:
            b.set("grad_reduce_in_bf16", True, f"{key}.grad_reduce_in_fp32")


# NeMo 2.5.3 nemo/lightning/pytorch/plugins/mixed_precision.py, MegatronMixedPrecision.__init__: the
# precision strings that make DtypeConfig.bf16 / .fp16 true.
_NEMO_BF16 = ("bf16", "bf16-mixed")
_NEMO_FP16 = ("fp16", "fp16-mixed", "16", "16-mixed")


def _precision(b: ArgsBuilder, plug: Mapping, key: str) -> None:
    """The precision plugin. NeMo's MegatronMixedPrecision as NeMo applies it: ``bf16`` / ``fp16`` from the
    precision string (or the plugin's DtypeConfig); ``convert_module`` then wraps the model in megatron-core's
    Float16Module, which casts every parameter to that dtype, so ``params_dtype`` (default fp32) only decides
    the dtype parameters are created in; ``grad_reduce_in_fp32`` defaults to True and overrides the DDP config
    (``update_config_with_dtype_overrides`` in MegatronStrategy.connect). Other plugins: the dtype of
    ``params_dtype``, else of the precision."""
    if "MegatronMixedPrecision" in str(plug.get("_target_", "")) or "bf16" in plug or "fp16" in plug:
        _megatron_mixed_precision(b, plug, key)
        return
    prec = plug.get("precision")
    dt = dtype_name(prec, f"{key}.precision") if prec is not None else None
    pd = dtype_name(plug.get("params_dtype"), f"{key}.params_dtype") if plug.get("params_dtype") is not None else None
    for flag in ("bf16", "fp16"):
        b.set(flag, (pd or dt) == flag, f"{key}.precision")
    _fp8_keys(b, plug, key)
    _grad_reduce(b, plug.get("grad_reduce_in_fp32"), pd or dt, key)


def _megatron_mixed_precision(b: ArgsBuilder, plug: Mapping, key: str) -> None:
    prec = str(plug.get("precision", "32")).strip().lower()
    bf16 = as_bool(plug["bf16"]) if plug.get("bf16") is not None else prec in _NEMO_BF16
    fp16 = as_bool(plug["fp16"]) if plug.get("fp16") is not None else prec in _NEMO_FP16
    pd = dtype_name(plug.get("params_dtype"), f"{key}.params_dtype") if plug.get("params_dtype") is not None else None
    if not (bf16 or fp16) and pd in ("bf16", "fp16"):
        from ..errors import NotModelledError
        raise NotModelledError(f"{key}.params_dtype", f"{pd} parameters without mixed precision (precision {prec})")
    b.set("bf16", bf16, f"{key}.precision")
    b.set("fp16", fp16, f"{key}.precision")
    _plugin_fp8(b, plug, key)
    g = plug.get("grad_reduce_in_fp32")
    _grad_reduce(b, True if g is None else g, "bf16" if bf16 else "fp16" if fp16 else "fp32", key)


# FP8 / FP4 keys of the precision plugin (MegatronMixedPrecision's arguments, copied onto the
# TransformerConfig / DDP config fields of the same names): Megatron's dest for each. Keys the plugin does
# not write keep megatron-core's defaults (assumption: NeMo 2 passes None for them).
_FP8_PLUGIN_KEYS = {
    "fp8_recipe": "fp8_recipe", "fp8_margin": "fp8_margin", "fp8_amax_history_len": "fp8_amax_history_len",
    "fp8_amax_compute_algo": "fp8_amax_compute_algo", "fp8_wgrad": "fp8_wgrad",
    "fp8_params": "fp8_param_gather", "fp8_param": "fp8_param_gather", "fp8_param_gather": "fp8_param_gather",
    "first_last_layers_bf16": "first_last_layers_bf16", "num_layers_at_start_in_bf16": "num_layers_at_start_in_bf16",
    "num_layers_at_end_in_bf16": "num_layers_at_end_in_bf16",
    "reuse_grad_buf_for_mxfp8_param_ag": "reuse_grad_buf_for_mxfp8_param_ag",
    "fp4_recipe": "fp4_recipe", "fp4_param": "fp4_param_gather", "fp4_param_gather": "fp4_param_gather",
}


# NeMo 2.5.3 (and 2.7.3) MegatronMixedPrecision.__init__'s defaults of the DtypeConfig FP8 fields: fp8_param_gather
# False unless fp8_params / fp8_param_gather is given (plugins/mixed_precision.py:128-138), fp8_recipe "delayed" (:109).
# MegatronStrategy.connect (strategies/megatron_strategy.py:459-462, :477-479) writes every DtypeConfig field onto the
# model config and the DDP config (update_config_with_dtype_overrides, mixed_precision.py:281-297), so the model
# config's own fp8 / fp8_recipe / fp8_param ... give way to the plugin's, written or default. (fp4 is no DtypeConfig
# field in 2.5.3: the model config's stays.)
_NEMO_PLUGIN_FP8 = {"fp8": None, "fp8_recipe": "delayed", "fp8_param_gather": False, "first_last_layers_bf16": False,
                    "num_layers_at_start_in_bf16": 0, "num_layers_at_end_in_bf16": 0, "fp8_margin": 0,
                    "fp8_amax_history_len": 1, "fp8_amax_compute_algo": "most_recent", "fp8_wgrad": True,
                    "fp8_dot_product_attention": False, "fp8_multi_head_attention": False,
                    "reuse_grad_buf_for_mxfp8_param_ag": False}


def _plugin_fp8(b: ArgsBuilder, plug: Mapping, key: str) -> None:
    """MegatronMixedPrecision's FP8 fields over the model config's: the plugin's value, else its default."""
    given = {dest: (plug[name], f"{key}.{name}") for name, dest in _FP8_PLUGIN_KEYS.items()
             if plug.get(name) is not None and dest in _NEMO_PLUGIN_FP8}
    for name in ("fp8", "fp8_dot_product_attention", "fp8_multi_head_attention"):
        if plug.get(name) is not None:
            given[name] = (plug[name], f"{key}.{name}")
    if not given.get("fp8", (None,))[0]:
        # FP8 off whatever the model config says: its FP8 keys are dropped (Megatron's defaults, as without FP8)
        for dest in _NEMO_PLUGIN_FP8:
            if dest in b.args and dest not in given:
                b.args.pop(dest)
                b.origin.pop(dest, None)
        for dest, (value, where) in given.items():
            b.set(dest, value, where)
        _fp8_keys(b, {k: v for k, v in plug.items() if k.startswith("fp4")}, key)
        return
    for dest, default in _NEMO_PLUGIN_FP8.items():
        value, where = given.get(dest, (default, f"{key} (MegatronMixedPrecision's default {dest}={default!r})"))
        b.set(dest, value, where)
    _fp8_keys(b, {k: v for k, v in plug.items() if k.startswith("fp4")}, key)


def _fp8_keys(b: ArgsBuilder, plug: Mapping, key: str) -> None:
    for flag in ("fp8", "fp4"):
        if plug.get(flag):
            b.set(flag, plug[flag], f"{key}.{flag}")
    for name, dest in _FP8_PLUGIN_KEYS.items():
        if plug.get(name) is not None:
            b.set(dest, plug[name], f"{key}.{name}")


def _grad_reduce(b: ArgsBuilder, g: Any, dtype: str | None, key: str) -> None:
    if g is None:
        return
    if as_bool(g):
        b.set("accumulate_allreduce_grads_in_fp32", True, f"{key}.grad_reduce_in_fp32")
        b.args.pop("grad_reduce_in_bf16", None)
    elif dtype == "bf16":
        b.set("grad_reduce_in_bf16", True, f"{key}.grad_reduce_in_fp32")


# NeMo 2.5.0 nemo/collections/llm/peft/lora.py LoRA, dora.py DoRA (the classes llm.peft.PEFT_STR2CLS names 'lora' /
# 'dora'); canonical_lora.py CanonicalLoRA (separate q / k / v and gate / up adapters) is another layout
_NEMO2_PEFT = {"LoRA": "lora", "DoRA": "dora"}
_NEMO2_PEFT_FIELDS = {"dim": "peft_dim", "alpha": "peft_alpha", "dropout": "peft_dropout",
                      "dropout_position": "peft_dropout_position", "target_modules": "peft_target_modules",
                      "exclude_modules": "peft_exclude_modules"}
# fields with no memory effect on a dense model: initialisation of A and B
_NEMO2_PEFT_NEUTRAL = frozenset({"_target_", "lora_A_init_method", "lora_B_init_method"})


def _peft(b: ArgsBuilder, doc: Mapping, model: Mapping, mprefix: str) -> None:
    """NeMo 2's PEFT: ``llm.finetune(..., peft=llm.peft.LoRA(...))`` writes it as the recipe's top-level ``peft:``
    (a ``--to-yaml`` export); ``api._setup`` sets it as the model's ``model_transform`` (``_set_with_io``), which a
    checkpoint's ``context/model.yaml`` keeps. NeMo 2.5's LoRA / DoRA build the same adapters as Megatron-Bridge's
    (nemo/collections/llm/peft/utils.py ParallelLinearAdapter, get_adapter_attributes_from_linear), so they go to the
    same dests (resolve/peft.py). Fiddle writes only the arguments given: the rest are the class's defaults."""
    pairs = ((doc.get("peft"), "peft"), (model.get("model_transform"), f"{mprefix}model_transform"))
    for v, k in pairs:
        if is_missing(v):   # (read as no PEFT: a full fine-tuning estimate of a LoRA run)
            raise ConfigError(k, f"is ??? (OmegaConf's missing marker): {_MISSING_RULE['NeMo 2']}",
                              f"set {k}=lora (or dora, none)")
    found = [(v, k) for v, k in pairs if v is not None]
    if not found:
        return
    value, key = found[0]
    if isinstance(value, str):
        # a scheme name, as the recipes' peft_scheme (PEFT_STR2CLS: 'lora', 'dora'; 'none' is full fine-tuning)
        if value.strip().lower() != "none":
            b.set("peft_scheme", value, key)
        return
    if not isinstance(value, Mapping):
        raise ReaderError(f"{key}: must be a LoRA / DoRA config (_target_: nemo.collections.llm.peft.lora.LoRA), "
                          f"got {value!r}")
    target = str(value.get("_target_") or "")
    cls = target.rsplit(".", 1)[-1]
    if not target:
        raise ReaderError(f"{key}._target_: is missing: memguard cannot tell LoRA from DoRA "
                          "(_target_: nemo.collections.llm.peft.lora.LoRA, or dora.DoRA)")
    if not target.startswith("nemo.collections.llm.peft.") or cls not in _NEMO2_PEFT:
        raise NotModelledError(f"{key}._target_", f"the model transform {target} (memguard models NeMo 2's LoRA and "
                               "DoRA: CanonicalLoRA, other PEFT classes and other transforms are not modelled)")
    b.set("peft_scheme", _NEMO2_PEFT[cls], f"{key}._target_")
    for name, v in value.items():
        fkey = f"{key}.{name}"
        if name in ("target_modules", "exclude_modules"):
            listed = peft_module_list(name, v, fkey, "NeMo 2")
            if listed is not None:
                b.set(_NEMO2_PEFT_FIELDS[name], listed, fkey)
        elif name in _NEMO2_PEFT_FIELDS:
            if is_missing(v):   # (said 'is null')
                raise ConfigError(fkey, f"is ??? (OmegaConf's missing marker): {_MISSING_RULE['NeMo 2']}, and {cls} "
                                  "cannot build the adapters with it", f"drop {fkey} or give a value")
            if v is None:
                raise ConfigError(fkey, f"is null: NeMo 2's {cls} takes it as None, not its default, and cannot "
                                  "build the adapters", f"drop {fkey} or give a value")
            b.set(_NEMO2_PEFT_FIELDS[name], v, fkey)
        elif name == "canonical_mapping":
            if v:
                raise NotModelledError(fkey, "PEFT targets given by a canonical_mapping")
        elif name == "lora_dtype":
            if v is not None:
                raise NotModelledError(fkey, "LoRA weights in a dtype other than the model's")
        elif name == "a2a_experimental":
            if as_bool(v):
                raise NotModelledError(fkey, "LoRA's experimental all-to-all adapters")
        elif name == "dropout_recompute":
            if as_bool(v):
                # lora.py: thunder.jit on the adapter's dropout, recomputed in backward instead of keeping its mask
                raise NotModelledError(fkey, "LoRA's dropout_recompute (Thunder-compiled dropout)")
        elif name not in _NEMO2_PEFT_NEUTRAL:
            # fiddle builds the class with this keyword: NeMo would fail on an argument LoRA / DoRA do not take
            raise ConfigError(fkey, f"not an argument of NeMo 2's {cls}")

