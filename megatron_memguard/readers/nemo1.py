"""NeMo 1.x Hydra YAML: ``megatron_gpt_config.yaml`` and its siblings, a ``.nemo`` checkpoint's
``model_config.yaml`` (the ``model:`` subtree alone), and NeMo-Framework-Launcher training fragments
(``launcher_scripts/conf/training/<family>/<size>.yaml``), which interpolate keys of the launcher's
parent config (``${base_results_dir}``, ``${data_dir}``, ``${training.model...}``) and load as they are.

What NeMo does with each key was read in NeMo 2.5.0 (the last release with the NeMo 1 LLM code):
``nemo/collections/nlp/models/language_modeling/megatron_base_model.py`` (``build_transformer_config``,
``build_model_parallel_config``, ``setup_optimization``, ``configure_optimizers``,
``_validate_and_override_config``) and ``megatron_gpt_model.py`` (``setup_mcore_distributed_parallel``,
``get_specs``). NeMo reads most keys with ``cfg.get(name, default)``; where its default differs from
Megatron's, the reader writes NeMo's default explicitly (each place says so). Every other
megatron-core TransformerConfig / ModelParallelConfig field name in ``model:`` is copied by NeMo into
the megatron-core config, so those names pass through; anything else gets a warning.

OmegaConf is needed (``pip install megatron-memguard[readers]``): interpolations, NeMo's and the
launcher's resolvers (``multiply``, ``sum``, ``divide_ceil``, ``divide_floor``, ``gpu_name``), ``???``.
Only the keys memguard reads are resolved, one at a time, so a path that cannot be resolved only
matters when memguard needs it.
"""
from __future__ import annotations

import copy
import inspect
import math
from typing import Any, Mapping

from ..config import RawConfig
from ..errors import ConfigError, NotModelledError, ReaderError
from ..numbers import shown
from ._common import (
    MISSING, ArgsBuilder, apply_overrides, as_bool, default_ffn_hidden_size, dtype_name, is_missing, map_mcore_fields,
    null_not_default, true_or_false, typed_defaults, _number,
)

# NeMo 1 ``model.*`` keys that are not megatron-core field names (read by NeMo itself, or harmless
# bookkeeping). Collected from NeMo 2.5.0's GPT model code and the reference configs.
NEMO1_MODEL_KEYS = frozenset("""
activation activations_checkpoint_granularity activations_checkpoint_layers_per_pipeline activations_checkpoint_method
activations_checkpoint_num_layers apex_transformer_log_level apply_embedding_scaling async_grad_allreduce attention_type
bias bias_dropout_add_fusion data dist_ckpt_assume_constant_structure dist_ckpt_format dist_ckpt_load_on_device
dist_ckpt_load_strictness dist_ckpt_parallel_dist_opt dist_ckpt_parallel_load dist_ckpt_parallel_save
dist_ckpt_parallel_save_within_dp dist_ckpt_torch_dist_multiproc do_layer_norm_weight_decay drop_layers
enable_megatron_timers encoder_seq_length ffn_dropout fp16_lm_cross_entropy fp8_e4m3 fp8_hybrid fp8_params fsdp
fsdp_cpu_offload fsdp_grad_reduce_dtype fsdp_limit_all_gathers fsdp_sharded_checkpoint fsdp_sharding_strategy
fsdp_use_orig_params gc_interval get_attention_mask_from_fusion global_batch_size grad_allreduce_chunk_size_mb
grad_div_ar_fusion gradient_as_bucket_view headscale hidden_steps hysteresis hyena make_vocab_size_divisible_by
max_position_embeddings mcore_bert mcore_customization_config mcore_gpt megatron_amp_O2 megatron_legacy
megatron_timer_kwargs memory_profile micro_batch_size moe_dropout moe_frequency name native_amp_growth_interval
native_amp_init_scale nccl_communicator_config_path normalize_attention_scores nsys_profile
num_micro_batches_with_partial_activation_checkpoints onnx_safe openai_gelu optim override_vocab_size peft
position_embedding_type post_process pre_process precision qkv_bias rampup_batch_size reduce_amax reset_lr
reset_lr_steps restore_from_ckpt restore_from_path resume_from_checkpoint rotary_percentage scale_factor
scale_positional_embedding seed seq_len_interpolation_factor share_embeddings_and_output_weights sharp skip_train
sync_batch_comm tensor_model_parallel_world_size tokenizer transformer_block_type transformer_engine
ub_tp_comm_bootstrap_backend ub_tp_comm_overlap ub_tp_comm_overlap_cfg use_cpu_initialization use_emha
use_flash_attention use_loss_mask use_scaled_init_method use_tp_pp_dp_mapping validation_drop_last
validation_param_sync_overlap with_fp32_embedding_grads low_freq_factor high_freq_factor old_context_len
mcore_t5 position_interpolation_factor
""".split())

# megatron-core fields that NeMo's build_transformer_config sets from its own keys (its config_mapping
# wins over a same-named model.* key), so a model.<mcore name> key for these has no effect.
_NEMO_OVERRIDDEN = frozenset({
    "apply_query_key_layer_scaling", "apply_residual_connection_post_layernorm", "layernorm_zero_centered_gamma",
    "add_bias_linear", "add_qkv_bias", "gated_linear_unit", "activation_func", "normalization", "init_method",
    "output_layer_init_method", "attention_softmax_in_fp32", "bias_activation_fusion", "bias_dropout_fusion",
    "apply_rope_fusion", "recompute_granularity", "recompute_method", "recompute_num_layers",
    "distribute_saved_activations", "fp8", "rotary_interleaved", "deallocate_pipeline_outputs", "tp_only_amax_red",
    "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split", "attention_backend",
    # build_model_parallel_config's mapping (used when model.* lacks the key; handled explicitly here)
    "bf16", "fp16", "params_dtype", "autocast_dtype", "enable_autocast", "pipeline_dtype", "tp_comm_overlap",
})
# Keys the launcher's parent config provides to training fragments (stubbed so fragments resolve).
_LAUNCHER_ROOT_KEYS = ("base_results_dir", "data_dir", "launcher_scripts_path", "container", "container_mounts")
_ACTIVATIONS = ("gelu", "geglu", "reglu", "swiglu", "squared-relu", "fast-geglu", "fast-swiglu", "fast-reglu", "approx-gelu")
_ADAM = {"fused_adam", "adam", "adamw", "megatron_fused_adam", "distributed_fused_adam", "mcore_distributed_optim"}
_NEMO_MARKERS = {"encoder_seq_length", "megatron_amp_O2", "activations_checkpoint_granularity", "mcore_gpt", "optim"}


def looks_like_nemo1(doc: Mapping) -> bool:
    m = doc.get("model")
    if isinstance(m, Mapping) and ("trainer" in doc or "exp_manager" in doc or _NEMO_MARKERS & set(m)):
        return True
    return False


def looks_like_nemo1_model_config(doc: Mapping) -> bool:
    """A ``.nemo`` checkpoint's model_config.yaml: the model subtree at top level."""
    return "num_layers" in doc and "hidden_size" in doc and bool(_NEMO_MARKERS & set(doc)) and "model" not in doc


def omegaconf_module() -> Any:
    """omegaconf's OmegaConf class, or None when the readers extra is not installed."""
    try:
        from omegaconf import OmegaConf
    except ImportError:
        return None
    return OmegaConf


def _register_resolvers(OmegaConf) -> None:
    """NeMo's (hydra_runner.py) and the launcher's (main.py) resolvers, unless already registered.

    omegaconf's API flipped: 2.1-2.3 have ``register_new_resolver`` (their ``register_resolver`` is the
    legacy string-argument API that breaks on nested interpolations); 2.4 deprecates
    ``register_new_resolver`` and re-designs ``register_resolver(name, fn, *, replace, use_cache,
    annotation_validation)``. Pick by the signature, which also covers the version numbers."""
    fns = {
        "multiply": lambda x, y: _number(x) * _number(y),
        "sum": lambda *args: sum(_number(a) for a in args),
        "divide_ceil": lambda x, y: int(math.ceil(_number(x) / _number(y))),
        "divide_floor": lambda x, y: int(math.floor(_number(x) / _number(y))),
        "gpu_name": lambda *args: "gpu",
    }
    try:
        params = inspect.signature(OmegaConf.register_resolver).parameters
    except (TypeError, ValueError):
        params = {}
    for name, fn in fns.items():
        if OmegaConf.has_resolver(name):
            continue
        if "annotation_validation" in params:          # omegaconf >= 2.4
            OmegaConf.register_resolver(name, fn, annotation_validation="off")
        elif hasattr(OmegaConf, "register_new_resolver"):  # omegaconf 2.1 - 2.3
            OmegaConf.register_new_resolver(name, fn)
        else:                                            # omegaconf 2.0: legacy, string arguments
            OmegaConf.register_resolver(name, fn)


class _Tree:
    """Lazy access to an OmegaConf tree: resolve one key at a time, name the key when it fails."""

    def __init__(self, cfg, path: str, OmegaConf, prefix_strip: str | None):
        from omegaconf import errors as oe

        self.cfg = cfg
        self.path = path
        self.OmegaConf = OmegaConf
        self.oe = oe
        self.prefix_strip = prefix_strip

    def shown(self, key: str) -> str:
        """The key as the user's file spells it (model_config.yaml has no ``model.`` prefix)."""
        if self.prefix_strip and key.startswith(self.prefix_strip + "."):
            return key[len(self.prefix_strip) + 1:]
        return key

    def has(self, key: str) -> bool:
        parent, _, leaf = key.rpartition(".")
        node = self.cfg
        if parent:
            try:
                node = self.OmegaConf.select(self.cfg, parent, throw_on_missing=False)
            except Exception:
                return False
        try:
            # ``leaf in node`` is False for a ``???`` value; keys() lists it.
            return node is not None and hasattr(node, "keys") and leaf in list(node.keys())
        except Exception:
            return False

    def get(self, key: str, default: Any = None, needed: bool = False) -> Any:
        """The resolved value, ``default`` if absent, MISSING for ``???``. ``needed``: a value that
        cannot be resolved is an error naming the key (else it reads as absent, with a warning)."""
        if not self.has(key):
            return default
        try:
            v = self.OmegaConf.select(self.cfg, key, throw_on_missing=True)
        except self.oe.MissingMandatoryValue:
            return MISSING
        except Exception as e:  # InterpolationKeyError, InterpolationResolutionError, GrammarParseError ...
            msg = str(e).splitlines()[0]
            if needed:
                raise ReaderError(f"{self.path}: {self.shown(key)}: cannot resolve its value ({msg})") from None
            self.unresolved.append(f"{self.shown(key)}: cannot resolve ({msg}); ignored")
            return default
        if self.OmegaConf.is_config(v):  # (a resolver such as oc.decode may return a plain list or dict)
            v = self.OmegaConf.to_container(v, resolve=False)
        return _number(v) if isinstance(v, str) else v

    unresolved: list[str]


def read_nemo1(doc: Mapping, path: str, overrides: list[tuple[str, str, Any]], model_only: bool = False) -> RawConfig:
    OmegaConf = omegaconf_module()
    if OmegaConf is None:
        raise ReaderError(f"{path}: this is a NeMo YAML config; reading it needs omegaconf "
                          "(pip install 'megatron-memguard[readers]', or pip install omegaconf)")
    _register_resolvers(OmegaConf)
    plain = {k: v for k, v in doc.items() if k not in ("defaults", "hydra")}  # Hydra-only header
    if model_only:
        plain = {"model": plain}
        overrides = [(op, k if k.startswith("model.") else "model." + k, v) for op, k, v in overrides]
    # A launcher fragment is the launcher's `training:` group: its command line spells the keys
    # training.model.x (NeMo-Framework-Launcher main.py), which are this file's model.x.
    launcher = not model_only and _mentions(plain, "training.")
    ignored = [k for op, k, _ in overrides if op != "del" and k.split(".")[0] not in plain
               and not (launcher and k.startswith("training.")) and k.split(".")[0] not in ("trainer", "model", "hydra")]
    plain = apply_overrides(plain, [o for o in overrides if o[1] not in ignored],
                            strip_prefix="training" if launcher else None)
    if not isinstance(plain.get("model"), Mapping):  # (an override such as model=3)
        raise ReaderError(f"{path}: model: must be a mapping of the model's settings, got {shown(plain.get('model'))}")
    root = dict(plain)
    if _mentions(plain, "training."):  # launcher fragments interpolate ${training.<key>} (a copy doubles OmegaConf's work)
        root["training"] = copy.deepcopy(plain)
    for k in _LAUNCHER_ROOT_KEYS:
        root.setdefault(k, "")
    try:
        cfg = OmegaConf.create(root)
    except Exception as e:
        raise ReaderError(f"{path}: cannot load as an OmegaConf config ({str(e).splitlines()[0]})") from None
    t = _Tree(cfg, path, OmegaConf, "model" if model_only else None)
    t.unresolved = []
    kind = "NeMo model_config.yaml" if model_only else "NeMo 1 config"
    b = ArgsBuilder(f"{kind} {path}")
    _map(t, b, model_only)
    for w in t.unresolved:
        b.warn(w)
    for k in ignored:   # Hydra refuses them unless '+'-prefixed, and memguard reads no such section
        b.warn(f"{k}: the config has no '{k.split('.')[0]}' section; ignored")
    return b.build()


def _mentions(doc: Any, text: str) -> bool:
    """Whether a string anywhere in ``doc`` (keys and values) contains ``text``."""
    stack = [doc]
    while stack:
        node = stack.pop()
        if isinstance(node, str):
            if text in node:
                return True
        elif isinstance(node, Mapping):
            stack.extend(node.keys())
            stack.extend(node.values())
        elif isinstance(node, (list, tuple)):
            stack.extend(node)
    return False


def _map(t: _Tree, b: ArgsBuilder, model_only: bool) -> None:  # noqa: C901 (one table, read top to bottom)
    def k(name: str) -> str:
        return t.shown(name)

    def get(name: str, default: Any = None, needed: bool = False) -> Any:
        # NeMo reads these keys as self.cfg.get(key, default) on its DictConfig, which returns the default for a '???'
        # value (omegaconf 2.4.0; not MissingMandatoryValue, which attribute access raises: ``need``)
        v = t.get(name, default, needed)
        return default if is_missing(v) else v

    def need(name: str, what: str = "") -> Any:
        v = t.get(name, needed=True)
        if is_missing(v):
            raise ReaderError(f"{t.path}: {k(name)}: is ??? (a mandatory value left to the command line)"
                              f"{'; ' + what if what else ''}; set it with --set {k(name)}=VALUE")
        return v

    def put(dest: str, name: str, needed: bool = True, conv=None) -> Any:
        if not t.has(name):
            return None
        v = need(name) if needed else get(name)
        if v is None and null_not_default(dest):
            # build_transformer_config copies cfg.get(key, default) into TransformerConfig: a null is None there
            f = typed_defaults()[dest]
            raise ConfigError(k(name), f"is null: NeMo passes None on, where {f['classes'][0]} declares {f['type']} "
                              f"with default {f['default']} (the default is not taken)",
                              f"set {k(name)}=VALUE or drop the key")
        if v is None or is_missing(v):
            return None
        b.set(dest, conv(v) if conv else v, k(name))
        return v

    # World size: trainer.devices x trainer.num_nodes.
    if not model_only:
        _refuse_unset_trainer(t)
        b.trainer_world(get("trainer.devices"), get("trainer.num_nodes", 1))
        agb = get("trainer.accumulate_grad_batches", 1)
        if agb not in (None, 1):
            b.problem("trainer.accumulate_grad_batches", f"must be 1 for NeMo Megatron models, got {agb!r}",
                      "NeMo accumulates gradients itself: GBS / (MBS x DP) micro-batches")

    # Parallelism and batch.
    for dest in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                 "expert_model_parallel_size", "micro_batch_size", "global_batch_size"):
        if dest.endswith("batch_size") and t.has("model." + dest) and t.get("model." + dest) is None:
            # megatron_init.py initialize_model_parallel_for_nemo: 'if global_batch_size and micro_batch_size is not
            # None' sets up the micro-batch calculator; a null leaves none (there is no default batch size)
            raise ConfigError(k("model." + dest), "is null: NeMo builds no micro-batch calculator from None "
                              "(initialize_model_parallel_for_nemo), there is no default", f"set {k('model.' + dest)}=VALUE")
        put(dest, "model." + dest)
    vpp = get("model.virtual_pipeline_model_parallel_size", needed=True)
    if vpp is not None and not is_missing(vpp):
        # NeMo treats 1 as no interleaving.
        b.set("virtual_pipeline_model_parallel_size", None if vpp == 1 else vpp, k("model.virtual_pipeline_model_parallel_size"))
    if get("model.rampup_batch_size") not in (None, []):
        b.warn(f"{k('model.rampup_batch_size')}: batch-size ramp-up is set; memguard estimates the final global batch size")
    tp = b.args.get("tensor_model_parallel_size", 1)
    sp = get("model.sequence_parallel")
    if sp is not None and not is_missing(sp):
        if as_bool(sp) and tp == 1:
            # _validate_and_override_config: "Sequence parallel should only be used with tensor parallel size > 1"
            b.set("sequence_parallel", False, k("model.sequence_parallel"))
            b.warn(f"{k('model.sequence_parallel')}: NeMo switches sequence parallelism off at "
                   f"tensor_model_parallel_size 1")
        else:
            b.set("sequence_parallel", as_bool(sp), k("model.sequence_parallel"))

    # Shape.
    for dest in ("num_layers", "hidden_size", "num_attention_heads"):
        put(dest, "model." + dest)
    put("seq_length", "model.encoder_seq_length")
    put("max_position_embeddings", "model.max_position_embeddings")
    if put("ffn_hidden_size", "model.ffn_hidden_size") is None and "hidden_size" in b.args:
        default_ffn_hidden_size(b, b.args["hidden_size"], k("model.hidden_size"))
    put("kv_channels", "model.kv_channels")
    groups = get("model.num_query_groups", needed=True)
    if groups is not None and not is_missing(groups):
        b.set("group_query_attention", True, k("model.num_query_groups"))
        b.set("num_query_groups", groups, k("model.num_query_groups"))
    activation = get("model.activation", "gelu")  # build_transformer_config: cfg.get('activation', 'gelu')
    if activation not in _ACTIVATIONS:
        b.problem(k("model.activation"), f"unknown activation {activation!r}", "NeMo accepts " + ", ".join(_ACTIVATIONS))
    else:
        akey = k("model.activation") if t.has("model.activation") else "model.activation"
        if activation.endswith("glu"):  # gated_linear_unit = activation.endswith('glu')
            if activation.endswith("swiglu"):
                b.set("swiglu", True, akey)
            else:
                b.set("gated_linear_unit", True, akey)
        elif activation == "squared-relu":
            b.set("squared_relu", True, akey)
    norm = get("model.normalization")
    if norm is not None:
        n = str(norm).lower()
        # layernorm1p is LayerNorm with zero-centred gamma: same parameters.
        b.set("normalization", "RMSNorm" if n == "rmsnorm" else "LayerNorm" if n in ("layernorm", "layernorm1p") else norm,
              k("model.normalization"))
    put("add_bias_linear", "model.bias", conv=as_bool)
    put("add_qkv_bias", "model.qkv_bias", conv=as_bool)
    put("position_embedding_type", "model.position_embedding_type")
    put("rotary_percent", "model.rotary_percentage")
    share = get("model.share_embeddings_and_output_weights", True)  # NeMo's .get default: tied
    b.set("untie_embeddings_and_output_weights", not as_bool(share),
          k("model.share_embeddings_and_output_weights") if t.has("model.share_embeddings_and_output_weights")
          else "model.share_embeddings_and_output_weights")
    put("make_vocab_size_divisible_by", "model.make_vocab_size_divisible_by")
    put("hidden_dropout", "model.hidden_dropout")
    put("attention_dropout", "model.attention_dropout")
    _tokenizer(t, b)

    # Recompute (activations_checkpoint_* map one-to-one to megatron-core recompute_*).
    gran = get("model.activations_checkpoint_granularity")
    if gran is not None:
        b.set("recompute_granularity", gran, k("model.activations_checkpoint_granularity"))
        if gran == "full":
            put("recompute_method", "model.activations_checkpoint_method")
            put("recompute_num_layers", "model.activations_checkpoint_num_layers")
        elif get("model.activations_checkpoint_method") is not None:
            # NeMo accepts a method with selective recompute (it is ignored); Megatron's flags refuse it.
            b.warn(f"{k('model.activations_checkpoint_method')}: ignored with selective recompute")
    # Without a granularity NeMo (megatron-core) ignores activations_checkpoint_method / _num_layers.
    for name in ("model.num_micro_batches_with_partial_activation_checkpoints", "model.activations_checkpoint_layers_per_pipeline"):
        if get(name) is not None and gran == "full":
            raise NotModelledError(k(name), "partial activation checkpointing per micro-batch / pipeline stage")

    # Precision: model.precision, copied from trainer.precision when absent (MegatronBaseModel.__init__);
    # params in half precision only with megatron_amp_O2, else fp32 params under autocast.
    prec_key = "model.precision" if get("model.precision") is not None else "trainer.precision"
    prec = get(prec_key)
    o2 = as_bool(get("model.megatron_amp_O2", False))
    dtype = None
    if prec is not None and not is_missing(prec):
        try:
            dtype = dtype_name(prec, k(prec_key))
        except ConfigError as e:
            b.problem(e.key, e.rule, e.fix)
    elif not model_only:
        b.warn("trainer.precision is not set: Lightning's default, fp32")
    o2_key = k("model.megatron_amp_O2") if t.has("model.megatron_amp_O2") else k(prec_key)
    if dtype in ("bf16", "fp16"):
        if o2:
            b.set(dtype, True, o2_key)
        else:
            b.set("autocast_dtype", dtype, k(prec_key))
    fp16 = dtype == "fp16"
    qk = as_bool(get("model.apply_query_key_layer_scaling", False))
    if qk:
        # build_transformer_config: layer scaling (and the fp32 softmax it needs) only under fp16.
        b.set("apply_query_key_layer_scaling", fp16, k("model.apply_query_key_layer_scaling"))
        if fp16:
            b.set("attention_softmax_in_fp32", True, k("model.apply_query_key_layer_scaling"))
    put("fp32_residual_connection", "model.fp32_residual_connection", conv=as_bool)
    put("fp16_lm_cross_entropy", "model.fp16_lm_cross_entropy", conv=as_bool)

    # Implementation and fusions.
    te = as_bool(get("model.transformer_engine", False))  # get_specs: local spec unless transformer_engine
    b.set("transformer_impl", "transformer_engine" if te else "local",
          k("model.transformer_engine") if t.has("model.transformer_engine") else "model.transformer_engine")
    if t.has("model.mcore_gpt") and not as_bool(get("model.mcore_gpt")):
        b.warn(f"{k('model.mcore_gpt')}: NeMo's legacy (non-megatron-core) GPT model is estimated as the megatron-core one")
    if as_bool(get("model.fp8", False)):
        b.set("fp8", "hybrid" if as_bool(get("model.fp8_hybrid", False)) else "e4m3", k("model.fp8"))
        # NeMo 1 passes these keys to megatron-core's TransformerConfig, whose recipe is then delayed
        # scaling (no fp8_recipe key; the shipped YAMLs set history 1024, algorithm max); absent keys
        # keep TransformerConfig's defaults. model.fp8_params creates FP8 primary weights
        # (fp8_model_init), as Megatron's --fp8-param-gather does.
        b.set("fp8_recipe", "delayed", k("model.fp8"))
        for name in ("fp8_amax_history_len", "fp8_amax_compute_algo", "fp8_margin"):
            if t.has("model." + name):
                b.set(name, get("model." + name), k("model." + name))
        if as_bool(get("model.fp8_params", False)):
            b.set("fp8_param_gather", True, k("model.fp8_params"))
    if as_bool(get("model.fsdp", False)):
        raise NotModelledError(k("model.fsdp"), "torch FSDP (model.fsdp)")
    peft = get("model.peft.peft_scheme")
    if peft not in (None, "none", "None"):
        _nemo1_lora(b, get, k, str(peft))
    ub = as_bool(get("model.ub_tp_comm_overlap", False))
    if ub:
        if b.args.get("sequence_parallel"):
            b.set("tp_comm_overlap", True, k("model.ub_tp_comm_overlap"))
            if get("model.ub_tp_comm_overlap_cfg") is not None:   # a YAML path or the mapping itself
                b.set("tp_comm_overlap_cfg", get("model.ub_tp_comm_overlap_cfg"), k("model.ub_tp_comm_overlap_cfg"))
        else:  # _validate_and_override_config switches it off without sequence parallelism
            b.warn(f"{k('model.ub_tp_comm_overlap')}: NeMo switches TP communication overlap off without sequence parallelism")
    for name, dest in (("model.bias_activation_fusion", "bias_activation_fusion"),
                       ("model.bias_dropout_add_fusion", "bias_dropout_fusion"),
                       ("model.masked_softmax_fusion", "masked_softmax_fusion"),
                       ("model.cross_entropy_loss_fusion", "cross_entropy_loss_fusion")):
        put(dest, name, conv=as_bool)
    # NeMo defaults that differ from Megatron's: rope fusion off (cfg.get('apply_rope_fusion', False)),
    # no attention mask from the dataloader (get_attention_mask_from_fusion defaults True),
    # gradient-accumulation fusion off by default (below).
    rope_fusion = get("model.apply_rope_fusion", False)
    b.set("apply_rope_fusion", as_bool(rope_fusion), k("model.apply_rope_fusion") if t.has("model.apply_rope_fusion") else "model.apply_rope_fusion")
    mask_fusion = as_bool(get("model.get_attention_mask_from_fusion", True))
    b.set("create_attention_mask_in_dataloader", not mask_fusion,
          k("model.get_attention_mask_from_fusion") if t.has("model.get_attention_mask_from_fusion") else "model.get_attention_mask_from_fusion")
    # overlap_p2p_comm does not change memory; passed only when on (Megatron's validate_args refuses the
    # interleaved schedule at PP <= 2 without it, which NeMo does not).
    if as_bool(get("model.overlap_p2p_comm", False)):
        b.set("overlap_p2p_comm", True, k("model.overlap_p2p_comm"))

    # Optimizer (model.optim.name decides Adam vs distributed optimizer).
    _refuse_unset_optim(t, k)
    gaf = as_bool(get("model.gradient_accumulation_fusion", False))
    gaf_key = k("model.gradient_accumulation_fusion") if t.has("model.gradient_accumulation_fusion") else "model.gradient_accumulation_fusion"
    name = get("model.optim.name", "fused_adam")
    okey = k("model.optim.name") if t.has("model.optim.name") else "model.optim.name"
    if not isinstance(name, str):
        raise ConfigError(okey, f"expects an optimizer name (fused_adam, distributed_fused_adam, ...), got {name!r}")
    distributed = name in ("distributed_fused_adam", "mcore_distributed_optim")
    ndoi = "model.optim.num_distributed_optimizer_instances"
    if t.has(ndoi) and t.get(ndoi) is None:
        # MegatronBaseModel.__init__ passes cfg.optim.get(key, 1) (None for a null) to initialize_model_parallel_for_nemo
        # with every optimizer, and megatron-core's initialize_model_parallel fails on (DP x CP) % None (NeMo 2.5.0
        # megatron_base_model.py; megatron-core 0.16.1 parallel_state.py)
        raise ConfigError(k(ndoi), "is null: NeMo passes None to megatron-core's initialize_model_parallel, which fails "
                          "at start-up ((DP x CP) % None), not its default 1", f"set {k(ndoi)}=1 or drop the key")
    if name in _ADAM:
        b.set("optimizer", "adam", okey)
    elif name == "sgd":
        b.set("optimizer", "sgd", okey)
    elif name.strip().lower() in ("muon", "adaptive_muon", "dist_muon", "lion", "soap"):
        # megatron-core's emerging optimizers are not in NeMo 1's registry (nemo/core/optim/optimizers.py
        # AVAILABLE_OPTIMIZERS: sgd, adam, adamw, adadelta, adamax, adagrad, rmsprop, rprop, novograd, adafactor and
        # the fused / distributed Adams): NeMo stops with "Cannot resolve optimizer"
        raise ConfigError(okey, f"{name!r} is not a NeMo 1 optimizer (megatron-core's emerging optimizers are "
                                "reached through Megatron-LM, NeMo 2 or Megatron-Bridge)")
    else:
        b.set("optimizer", name, okey)  # resolve() refuses optimizers it does not model
    if distributed:
        b.set("use_distributed_optimizer", True, okey)
        # (strictly true / false: NeMo hands the value to DistributedDataParallelConfig as it is, where any word or list
        # reads as true; as_bool read them as false)
        if get("model.optim.overlap_grad_sync") is not None:
            b.set("overlap_grad_reduce", true_or_false(get("model.optim.overlap_grad_sync"), k("model.optim.overlap_grad_sync")),
                  k("model.optim.overlap_grad_sync"))
        ops = true_or_false(get("model.optim.overlap_param_sync", False), k("model.optim.overlap_param_sync"))
        if ops:
            if b.args.get("overlap_grad_reduce"):
                b.set("overlap_param_gather", True, k("model.optim.overlap_param_sync"))
            else:
                b.warn(f"{k('model.optim.overlap_param_sync')}: estimated without param-gather overlap "
                       "(Megatron's needs overlap_grad_sync too)")
        put("num_distributed_optimizer_instances", "model.optim.num_distributed_optimizer_instances")
        put("ddp_bucket_size", "model.optim.ddp_bucket_size")
        # grad_sync_dtype: the gradient buffer's dtype (mcore: grad_reduce_in_fp32 = grad_sync_dtype == fp32;
        # apex DistributedFusedAdam: defaults to the optimizer dtype, fp32).
        gsd_key = "model.optim.grad_sync_dtype"
        gsd = get(gsd_key)
        if gsd is None and t.has(gsd_key) and name == "mcore_distributed_optim":
            # megatron_gpt_model.py setup_mcore_distributed_parallel (NeMo 2.5.0):
            # grad_reduce_in_fp32=(cfg.optim.get('grad_sync_dtype', 'fp32') == 'fp32'): None reduces in the model dtype
            raise ConfigError(k(gsd_key), "is null: NeMo sets grad_reduce_in_fp32 = (grad_sync_dtype == 'fp32'), so None "
                              "reduces gradients in the model dtype, not in its default fp32",
                              f"set {k(gsd_key)}=fp32 (or bf16) or drop the key")
        try:
            gsd = dtype_name(gsd, k(gsd_key)) if gsd is not None else None
        except ConfigError as e:
            b.problem(e.key, e.rule, e.fix)
            gsd = None
        if gsd in ("bf16", "fp16") and o2 and dtype in ("bf16", "fp16"):
            b.set("grad_reduce_in_bf16" if dtype == "bf16" else "accumulate_allreduce_grads_in_fp32",
                  True if dtype == "bf16" else False, k(gsd_key))
        if name == "distributed_fused_adam":
            _apex_dist_adam(t, b, k, o2, dtype)
    elif gaf and (b.world_size or 0) > 1:
        # "gradient accumulation fusion can only be used with distributed_fused_adam" when PP == 1 and DP > 1
        pp, cp = b.args.get("pipeline_model_parallel_size", 1), b.args.get("context_parallel_size", 1)
        try:
            dp = b.world_size // (int(tp) * int(pp) * int(cp))
        except (TypeError, ValueError, ZeroDivisionError, OverflowError):
            dp = 1
        if dp > 1 and pp == 1:
            gaf = False
            b.warn(f"{gaf_key}: NeMo switches it off without pipeline parallelism or a distributed optimizer")
    if gaf and not o2:
        gaf = False
        b.warn(f"{gaf_key}: NeMo switches it off without megatron_amp_O2")
    b.set("gradient_accumulation_fusion", gaf, gaf_key)
    if o2 and dtype == "fp16" and not distributed:
        b.problem(k("model.megatron_amp_O2"), "fp16 training with megatron_amp_O2 needs a distributed optimizer in NeMo",
                  "set model.optim.name=distributed_fused_adam, or megatron_amp_O2=false")

    # CPU offloading only counts when switched on (cpu_offloading_num_layers has a default either way).
    # Every other model.* key: megatron-core field names pass through (NeMo copies them), others warn.
    model = t.get("model", {}) or {}
    fields = {}
    for name in model:
        if name in _NEMO_OVERRIDDEN:
            continue
        full = "model." + name
        fields[name] = (t.get(full), k(full))   # ('???' and null: refused by name where read, refuse_unset)
    explicit = {"tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                "expert_model_parallel_size", "micro_batch_size", "global_batch_size", "virtual_pipeline_model_parallel_size",
                "sequence_parallel", "num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "kv_channels",
                "num_query_groups", "hidden_dropout", "attention_dropout", "make_vocab_size_divisible_by",
                "fp32_residual_connection", "fp16_lm_cross_entropy", "masked_softmax_fusion", "cross_entropy_loss_fusion",
                "gradient_accumulation_fusion", "overlap_p2p_comm", "share_embeddings_and_output_weights",
                "position_embedding_type", "max_position_embeddings", "fp8", "transformer_engine"}
    map_mcore_fields(b, fields, extra_known=NEMO1_MODEL_KEYS, unknown_context="NeMo or megatron-core model",
                     skip=explicit, carrier="NeMo")
    # Conflicts NeMo does not catch but that change what trains.
    if t.has("model.data.seq_length") and t.get("model.data.seq_length") in (None, MISSING):
        # megatron_gpt_model.py build_train_valid_test_datasets: sequence_length=self.cfg.data.seq_length (attribute
        # access raises MissingMandatoryValue on '???'; None reaches GPTDatasetConfig, which has no default)
        v = t.get("model.data.seq_length")
        raise ConfigError(k("model.data.seq_length"), ("is ??? (a mandatory value left to the command line)" if v is MISSING
                          else "is null") + ": NeMo builds the dataset from it, there is no default",
                          f"set {k('model.data.seq_length')}=${{model.encoder_seq_length}}")
    ds = get("model.data.seq_length")
    if ds is not None and not is_missing(ds) and "seq_length" in b.args and ds != b.args["seq_length"]:
        b.problem(k("model.data.seq_length"), f"{ds} differs from {k('model.encoder_seq_length')} = {b.args['seq_length']}",
                  "the model is built for encoder_seq_length; make the two equal")


# '???' and null on the trainer keys memguard reads. MegatronTrainerBuilder (NeMo 2.5.0
# nlp/parts/megatron_trainer_builder.py) reads cfg.trainer.precision by attribute and builds
# Trainer(**cfg.trainer): a '???' raises MissingMandatoryValue. A null reaches Lightning (2.5.2, 2.6.6) as None:
_TRAINER_NULL_RULES = {
    # accelerators/cuda.py: parse_devices(None) raises (2.6.6: _check_data_type) or get_parallel_devices iterates None
    "devices": "Lightning's GPU accelerator rejects None as its device list (TypeError), its default 'auto' is not taken",
    # trainer/connectors/accelerator_connector.py: "`num_nodes` must be a positive integer"
    "num_nodes": "Lightning's Trainer raises '`num_nodes` must be a positive integer', its default 1 is not taken",
    # megatron_gpt_model.py: 'if self.trainer.accumulate_grad_batches > 1' (TypeError on None)
    "accumulate_grad_batches": "NeMo compares it with 1 (a TypeError on None), Lightning's default 1 is not taken",
    # null precision: Trainer(precision=None) is Lightning's default, 32-true (read as fp32, a note)
    "precision": None,
}


def _refuse_unset_trainer(t: _Tree) -> None:
    for name, null_rule in _TRAINER_NULL_RULES.items():
        key = "trainer." + name
        if not t.has(key):
            continue
        v = t.get(key)
        if is_missing(v):
            raise ConfigError(key, "is ??? (a mandatory value left to the command line): NeMo builds "
                              "Trainer(**cfg.trainer), which raises MissingMandatoryValue on it", f"set {key}=VALUE")
        if v is None and null_rule:
            raise ConfigError(key, f"is null: {null_rule}", f"set {key}=VALUE or drop the key")


def _refuse_unset_optim(t: _Tree, k) -> None:
    """model.optim and model.optim.name: NeMo reads cfg.optim.get('name') in MegatronBaseModel.__init__ (NeMo 2.5.0
    megatron_base_model.py): a null section fails there, a '???' section raises MissingMandatoryValue. ModelPT's
    setup_optimization looks the name up after OmegaConf.to_container(resolve=True), which keeps '???' as the text:
    no optimizer of that name (the default fused_adam is not taken)."""
    if t.has("model.optim"):
        v = t.get("model.optim")
        if is_missing(v) or v is None:
            what = "is ??? (a mandatory value left to the command line)" if v is not None else "is null"
            raise ConfigError(k("model.optim"), f"{what}: NeMo reads cfg.optim.get('name') (megatron_base_model.py), "
                              "there is no default optimizer section", f"set {k('model.optim')}.name=fused_adam")
    if t.has("model.optim.name") and is_missing(t.get("model.optim.name")):
        raise ConfigError(k("model.optim.name"), "is ??? (a mandatory value left to the command line): NeMo looks up "
                          "an optimizer named '???' (modelPT.py setup_optimization keeps the text), not fused_adam",
                          f"set {k('model.optim.name')}=fused_adam")


def _apex_dist_adam(t: _Tree, b: ArgsBuilder, k, o2: bool, dtype: str | None) -> None:
    """Apex DistributedFusedAdam as NeMo sets it up (setup_optimization): the optimizer state is
    sharded over DP like Megatron's distributed optimizer; its dtype is model.optim.dtype (fp32).
    With a bf16 model and fp32 optimizer NeMo sets store_params=False, store_param_remainders=True: the
    master weight is the bf16 param plus a 16-bit remainder. memguard models that as Megatron's
    precision-aware distributed optimizer with store_param_remainders (2 bytes per sharded element)."""
    okey = "model.optim.dtype"
    try:
        opt_dtype = dtype_name(t.get(okey), k(okey)) if t.get(okey) is not None else "fp32"
    except ConfigError as e:
        b.problem(e.key, e.rule, e.fix)
        opt_dtype = "fp32"
    model_dtype = dtype if (o2 and dtype in ("bf16", "fp16")) else "fp32"
    name_key = k("model.optim.name")
    if model_dtype == "fp32":
        if opt_dtype != "fp32":
            b.set("use_precision_aware_optimizer", True, k(okey))
            b.set("exp_avg_dtype", opt_dtype, k(okey))
            b.set("exp_avg_sq_dtype", opt_dtype, k(okey))
        return
    fp8_params = as_bool(t.get("model.fp8_params", False))
    if fp8_params or (opt_dtype == "fp32" and model_dtype == "fp16"):
        return  # store_params=True: a full fp32 master copy, as Megatron's distributed optimizer keeps
    b.set("use_precision_aware_optimizer", True, name_key)
    if opt_dtype == "fp32" and model_dtype == "bf16":
        b.set("main_params_dtype", "fp32", name_key)
        b.set("store_param_remainders", True, name_key)
    else:
        # optimizer dtype == model dtype: apex keeps no master copy at all; memguard counts a 16-bit one.
        b.set("main_params_dtype", opt_dtype, k(okey) if t.has(okey) else name_key)
        b.set("store_param_remainders", False, name_key)
        b.warn(f"{k(okey)}: apex keeps no master weights when the optimizer dtype equals the model dtype; "
               "memguard counts a 16-bit copy (over-estimates by 2 bytes per sharded parameter)")
    if opt_dtype != "fp32":
        b.set("exp_avg_dtype", opt_dtype, k(okey))
        b.set("exp_avg_sq_dtype", opt_dtype, k(okey))
    if b.args.get("grad_reduce_in_bf16") is None and b.args.get("accumulate_allreduce_grads_in_fp32") is None:
        b.set("accumulate_allreduce_grads_in_fp32", True, name_key)


def _tokenizer(t: _Tree, b: ArgsBuilder) -> None:
    """model.tokenizer.{library,type,model}: NeMo pads the tokenizer's vocabulary like Megatron does
    (_vocab_size_with_padding: a multiple of make_vocab_size_divisible_by x TP)."""
    k = t.shown
    override = t.get("model.override_vocab_size")
    if override not in (None, MISSING):
        b.set("padded_vocab_size", override, k("model.override_vocab_size"))
        return
    if not t.has("model.tokenizer"):
        b.set("tokenizer_type", "NeMoTokenizer", "model.tokenizer")
        b.origin["vocab_size"] = "model.tokenizer"
        return
    library = str(t.get("model.tokenizer.library", "") or "").lower()
    ttype = t.get("model.tokenizer.type")
    tmodel = t.get("model.tokenizer.model")
    if is_missing(ttype):
        ttype = None
    if is_missing(tmodel):
        b.warn(f"{k('model.tokenizer.model')}: is ??? (a mandatory value left to the command line); "
               "the vocabulary size is unknown without --vocab-size")
        tmodel = None
    tv = t.get("model.tokenizer.vocab_size")
    if library == "megatron" and ttype:
        b.set("tokenizer_type", ttype, k("model.tokenizer.type"))
    elif library == "huggingface":
        b.set("tokenizer_type", "HuggingFaceTokenizer", k("model.tokenizer.library"))
        if ttype:
            b.set("tokenizer_model", ttype, k("model.tokenizer.type"))
    elif library == "sentencepiece":
        b.set("tokenizer_type", "SentencePieceTokenizer", k("model.tokenizer.library"))
        if tmodel:
            b.set("tokenizer_model", tmodel, k("model.tokenizer.model"))
    else:
        b.set("tokenizer_type", ttype or (library or "NeMoTokenizer"), k("model.tokenizer.type" if ttype else "model.tokenizer.library"))
        if tmodel:
            b.set("tokenizer_model", tmodel, k("model.tokenizer.model"))
    if tv not in (None, MISSING):
        b.set("vocab_size", tv, k("model.tokenizer.vocab_size"))
    else:
        # Where an error about the vocabulary should point.
        b.origin["vocab_size"] = k("model.tokenizer.model") if library == "sentencepiece" else k("model.tokenizer.type") \
            if t.has("model.tokenizer.type") else k("model.tokenizer.library")


# NeMo 1's LoRA target names -> megatron-core's linears (nemo/collections/nlp/parts/peft_config.py LoraPEFTConfig:
# attention = qkv + dense, mlp = fc1 + fc2, all = the four)
_NEMO1_TARGETS = {"attention_qkv": ("linear_qkv",), "attention_dense": ("linear_proj",), "mlp_fc1": ("linear_fc1",),
                  "mlp_fc2": ("linear_fc2",), "attention": ("linear_qkv", "linear_proj"),
                  "mlp": ("linear_fc1", "linear_fc2"), "all": ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")}


def _nemo1_lora(b: Any, get: Any, k: Any, scheme: str) -> None:
    """``model.peft`` with ``peft_scheme: lora`` and its ``lora_tuning`` block onto resolve/peft.py's dests; the
    other schemes (adapter, ia3, ptuning) and the LoRA options that change which layers get adapters are refused."""
    key = k("model.peft.peft_scheme")
    if scheme.strip().lower() != "lora":
        raise NotModelledError(key, f"NeMo 1 PEFT scheme {scheme!r} (memguard models lora)")
    b.set("peft_scheme", "lora", key)
    lt = "model.peft.lora_tuning."
    block = get("model.peft.lora_tuning")
    if block is not None and not isinstance(block, Mapping):
        raise ConfigError(k("model.peft.lora_tuning"), f"must be a mapping of LoRA settings, got {shown(block)}")
    variant = get(lt + "variant")
    if variant == "canonical":
        # LoraPEFTConfig (nemo_toolkit 2.2.1 nemo/collections/nlp/parts/peft_config.py: 'lora_cfg.get("variant",
        # "nemo") == "canonical"'): separate q / k / v (and fc1 gate / up) adapters, each with its own linear_in
        # (adapters/parallel_adapters.py LoraUnfusedKQVAdapter, LoraUnfusedHto4HAdapter; estimator/peft.py)
        b.set("peft_variant", "canonical", k(lt + "variant"))
    # (any other value builds the fused adapters, as LoraPEFTConfig's test above does)
    targets = get(lt + "target_modules")
    if targets is not None:
        if not isinstance(targets, (str, list, tuple)):
            # (an int or a mapping: list() raised or took the mapping's keys as target names)
            raise ConfigError(k(lt + "target_modules"), f"must be a target name or a list of them, got {shown(targets)}")
        names = [targets] if isinstance(targets, str) else list(targets)
        if not names:
            # LoraPEFTConfig adds one adapter per listed module (no Bridge-style 'every linear' for an empty list):
            # nothing would be trained
            raise ConfigError(k(lt + "target_modules"), "is empty: NeMo 1's LoraPEFTConfig adds an adapter per listed "
                              "module, so no parameter would be trained", "name the modules, e.g. [attention_qkv]")
        out: list[str] = []
        for t in names:
            if str(t) not in _NEMO1_TARGETS:
                raise NotModelledError(k(lt + "target_modules"), f"LoRA target {t!r} (memguard models "
                                       + ", ".join(_NEMO1_TARGETS) + ")")
            out += [m for m in _NEMO1_TARGETS[str(t)] if m not in out]
        b.set("peft_target_modules", out, k(lt + "target_modules"))
    else:
        # LoraPEFTConfig's default when the block names none: attention_qkv
        b.set("peft_target_modules", ["linear_qkv"], k(lt + "target_modules"))
    for name, dest in (("adapter_dim", "peft_dim"), ("alpha", "peft_alpha"), ("adapter_dropout", "peft_dropout"),
                       ("dropout_position", "peft_dropout_position")):
        if get(lt + name) is not None:
            b.set(dest, get(lt + name), k(lt + name))
    if get(lt + "adapter_dropout") not in (None, 0, 0.0) and get(lt + "dropout_position") is None:
        raise NotModelledError(k(lt + "adapter_dropout"), "NeMo 1 LoRA dropout without a dropout_position")
    if get(lt + "layer_selection") is not None:
        # PEFTConfig reads it from the lora_tuning block (peft_config.py: peft_cfg.get("layer_selection", None))
        sel = get(lt + "layer_selection")
        b.set("peft_layers", list(sel) if isinstance(sel, (list, tuple)) else sel, k(lt + "layer_selection"))
    if get(lt + "weight_tying"):
        # nemo_toolkit 2.2.1 peft_config.py LoraPEFTConfig._create_lora_config: with weight_tying it adds
        # num_position_embeddings / dim_position_embeddings / position_embedding_strategy to the arguments of the LoRA
        # adapter config (LoraKQVAdapterConfig and the others: ParallelLinearAdapterConfig dataclasses without those
        # fields; the weight-tying config classes are imported, never chosen for LoRA), so building the model raises
        # TypeError (an unknown position_embedding_strategy a RuntimeError before it): NeMo cannot run it
        raise ConfigError(k(lt + "weight_tying"), "NeMo 1 cannot build tied LoRA adapters: LoraPEFTConfig passes "
                          "num_position_embeddings, dim_position_embeddings and position_embedding_strategy to the LoRA "
                          "adapter configs, which have no such fields (TypeError at model setup, nemo_toolkit 2.2.1 "
                          "peft_config.py _create_lora_config)", "set weight_tying: false")
