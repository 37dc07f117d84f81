"""Sections: the implementation and its fusions (Megatron's defaults: TE, fusions on), and the
numerics options (normalization, cross-entropy fusion, softmax precision)."""
from __future__ import annotations

from typing import Any, Mapping


from ..errors import NO_TE_BACKEND, NotModelledError
from ..estimator.te_release import MLA_FLASH_PAD_SINCE, te_at_least, te_version_text
from .args import _DTYPE_NAMES, Args, Context


SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")


def implementation(a: Args, kw: Mapping[str, Any], ctx: Context) -> dict[str, Any]:
    tp, cp, sp, seq = (kw["tensor_model_parallel_size"], kw["context_parallel_size"], kw["sequence_parallel"],
                       kw["seq_length"])
    impl = str(a.get("transformer_impl", "transformer_engine"))
    if impl not in ("transformer_engine", "local"):
        raise NotModelledError(a.key("transformer_impl"), f"transformer implementation {impl!r}")
    if impl == "local" and cp > 1:
        # megatron-core's DotProductAttention asserts context_parallel_size == 1 (only TE's
        # attention implements context parallelism).
        a.fail("context_parallel_size", "needs --transformer-impl transformer_engine (megatron's local "
               "attention has no context parallelism)")
    if sp and seq and (seq // cp) % tp:
        # The sequence-parallel scatter splits each rank's s/CP tokens over TP
        # (tensor_parallel.mappings._split_along_first_dim asserts it divides).
        a.fail("sequence_parallel", f"needs seq_length / context-parallel size = {seq // cp} divisible by "
               f"tensor-model-parallel size {tp}")
    backend = str(a.get("attention_backend", "auto")).replace("AttnBackend.", "")
    if backend not in ("auto", "flash", "fused", "unfused", "local"):
        a.fail("attention_backend", f"unknown backend {backend!r}")
    elif impl == "transformer_engine" and cp > 1 and backend in ("unfused", "local"):
        # unfused: TE's get_attention_backend disables UnfusedDotProductAttention under context parallelism and,
        # with flash and fused switched off by the backend's NVTE_* variables, DotProductAttention raises "No
        # dot product attention backend is available" (TE 2.11 attention/dot_product_attention/utils.py);
        # local: megatron-core's DotProductAttention asserts context_parallel_size == 1
        a.fail("attention_backend", f"{backend} has no context parallelism (context-parallel size {cp}): only "
               "Transformer Engine's flash and fused attention implement it", "use --attention-backend auto")
    elif impl == "transformer_engine" and backend in ("flash", "fused") and _act_dtype(a, kw) == "fp32" \
            and not kw.get("fp8_dot_product_attention"):
        # TE's get_attention_backend "Filter: Data type" drops flash-attn and FusedAttention for q/k/v other than
        # bf16/fp16 (TE 2.11.0 / 2.20.2 pytorch/attention/dot_product_attention/utils.py), the backend's NVTE_*
        # variables (language_module.py _set_attention_backend, core 0.16.1 / 0.19.2) switch the unfused one
        # off, and DotProductAttention.forward raises "No dot product attention backend is available" at the
        # first forward: no fallback
        a.fail("attention_backend", f"{backend} needs bf16 or fp16 activations (--bf16 / --fp16): Transformer "
               "Engine has no flash or fused attention for fp32 q/k/v", "use --attention-backend unfused or auto",
               fails_later=NO_TE_BACKEND)
    elif impl == "transformer_engine" and backend == "flash" and _mla_dims_differ(a) \
            and not te_at_least(a.raw.env, str(ctx.version), MLA_FLASH_PAD_SINCE) \
            and not kw.get("fp8_dot_product_attention"):
        # TE 2.11 to 2.16.1 get_attention_backend: "Disabling FlashAttention 2 as it does not support MLA"
        # (head_dim_qk != head_dim_v; TE 2.17+ pads instead), with fused and unfused switched off by the backend's
        # NVTE_* variables: DotProductAttention.forward raises at the first forward (megatron-core 0.16 pins TE < 2.12;
        # the run's TE: estimator/te_release.py)
        te = te_version_text(a.raw.env, str(ctx.version))
        a.fail("attention_backend", f"flash has no multi-latent attention kernel in Transformer Engine {te} "
               f"(megatron-core {ctx.version}): flash-attn 2 needs equal q/k and v head dims before TE 2.17",
               "use --attention-backend auto or fused",
               fails_later=NO_TE_BACKEND)
    elif backend == "local" and not ctx.legacy and a.key("attention_backend").startswith("--") and (
            not a.get("spec") or _first(a.get("spec")) != "local"):
        # core 0.19.2 megatron/training/arguments.py validate_args: ``assert args.spec[0] == 'local'``
        # (Bridge configs do not pass validate_args: its GPT provider swaps the core attention)
        a.fail("attention_backend", "local is only supported with --spec local (megatron-core 0.19 validate_args)")
    add_bias = a.bool_arg("add_bias_linear", True)
    add_qkv_bias = a.bool_arg("add_qkv_bias", False) or add_bias
    bias_gelu = a.bool_arg("bias_gelu_fusion", True) and add_bias
    bias_swiglu = a.bool_arg("bias_swiglu_fusion", True)
    bias_act_fusion = a.bool_arg("bias_activation_fusion", bias_swiglu if kw["swiglu"] else bias_gelu)
    if kw["squared_relu"]:
        bias_act_fusion = False
    elif bias_act_fusion and not add_bias and not kw["gated_linear_unit"]:
        # TransformerConfig.__post_init__ (core 0.19.2) raises it; a Bridge / YAML config can ask for it (Megatron's
        # flags cannot: without biases the bias-GeLU fusion is off)
        a.fail("bias_activation_fusion", "the fused bias-GeLU needs biases: with gelu and no gated linear unit, "
               "add_bias_linear must be true (TransformerConfig)", "set add_bias_linear true or bias_activation_fusion false")
    apply_rope_fusion = a.bool_arg("apply_rope_fusion", True) and kw["position_embedding_type"] == "rope"
    softmax_type = str(a.get("softmax_type") or "vanilla")
    if softmax_type not in SOFTMAX_TYPES:
        # TransformerConfig.softmax_type: Literal['vanilla', 'off-by-one', 'learnable'] (core 0.19.2; Megatron's
        # argparse choices), as TE 2.11's DotProductAttention takes it; it decides TE's attention kernel
        a.fail("softmax_type", f"must be one of {', '.join(SOFTMAX_TYPES)}, got {softmax_type!r}")
        softmax_type = "vanilla"
    fa_version = a.int_arg("flash_attention_version", None)
    if fa_version is not None and fa_version not in (2, 3, 4):
        # TransformerConfig.__post_init__ (core 0.19.2) asserts it
        a.fail("flash_attention_version", f"must be 2, 3 or 4, got {fa_version}")
    fuser = op_fuser(a, kw, impl)
    grouped = (fuser and not a.get("num_experts") and a.bool_arg("use_grouped_gemm_for_dense_mlp", False)
               and grouped_dense_mlp(a, kw))
    return dict(transformer_impl=impl, attention_backend=backend, add_bias_linear=add_bias, add_qkv_bias=add_qkv_bias,
                bias_activation_fusion=bias_act_fusion, apply_rope_fusion=apply_rope_fusion,
                use_transformer_engine_op_fuser=fuser, grouped_dense_mlp=grouped, softmax_type=softmax_type,
                flash_attention_version=fa_version)


def _mla_dims_differ(a: Args) -> bool:
    """Multi-latent attention whose q/k head dim (qk + rope dim) is not v's (resolve/shape.py's defaults)."""
    return a.bool_arg("multi_latent_attention", False) and \
        a.int_arg("qk_head_dim", 128) + a.int_arg("qk_pos_emb_head_dim", 64) != a.int_arg("v_head_dim", 128)


def _act_dtype(a: Args, kw: Mapping[str, Any]) -> str:
    """The activations' dtype: the autocast dtype where given, else the parameters' (layout Precision)."""
    v = a.a.get("autocast_dtype")
    name = str(v).replace("torch.", "").lower() if v is not None else ""
    # (an unknown name is the runtime section's error, once)
    return _DTYPE_NAMES.get(name, kw["params_dtype"])


def _first(v: Any) -> str:
    """The first word of a list flag given as a list or as text."""
    if isinstance(v, (list, tuple)):
        return str(v[0]) if v else ""
    return str(v).strip("[] ").split()[0] if str(v).strip("[] ") else ""


def op_fuser(a: Args, kw: Mapping[str, Any], impl: str) -> bool:
    """--use-transformer-engine-op-fuser: whether the TE spec builds its MLPs with TE's operation fuser.

    megatron-core 0.19.2 gpt_layer_specs.get_mlp_module_spec_for_backend gives a dense model's MLP as
    TEFusedMLP (norm, BasicLinear, activation, BasicLinear ops); the local spec never reads the flag.
    The experts' fused path (TEGroupedMLP._fused_forward) has its rules in resolve/moe.py."""
    if not a.bool_arg("use_transformer_engine_op_fuser", False):
        return False
    if impl != "transformer_engine":
        a.notes.append(f"{a.key('use_transformer_engine_op_fuser')}: no effect with --transformer-impl local "
                       "(only the Transformer Engine spec reads it)")
        return False
    # a MoE model's experts under FP8 / FP4: the recipes resolve/moe.py experts_op_fuser refuses by name;
    # --use-grouped-gemm-for-dense-mlp: grouped_dense_mlp (after this)
    if not a.get("num_experts") and (kw["squared_relu"] or a.bool_arg("quick_geglu", False)):
        # TEFusedMLP._make_activation_op (0.19.2) maps only GELU, SiLU, ReLU and their GLUs to TE ops
        a.fail("use_transformer_engine_op_fuser", "TEFusedMLP supports only the GELU, SiLU and ReLU activations "
               "and their GLUs (not squared ReLU or quick GEGLU)")
    return True


def grouped_dense_mlp(a: Args, kw: Mapping[str, Any]) -> bool:
    """--use-grouped-gemm-for-dense-mlp under the op fuser: whether a dense model's MLP runs as
    TEFusedMLPWithGroupedLinear's grouped ops (megatron-core 0.19.2 gpt_layer_specs.get_mlp_module_spec_for_backend,
    extensions/transformer_engine.py). Its __init__ needs a SwiGLU without biases (ValueError). With TP > 1 its
    forward and fused impl are TEFusedMLP's (``super().forward`` / ``super()._make_fused_impl``): False, sized as
    the op fuser's MLP. With TP 1 its forward runs the norm op in BF16, then GroupedLinear(1) -> ScaledSwiGLU ->
    GroupedLinear(1) under its own autocast with ``MXFP8BlockScaling()`` (E4M3; ``NVFP4BlockScaling()`` with
    FP4_RECIPE=nvfp4), whatever the model's precision: sized (True) where that is the model's own recipe on every
    layer and TE 2.20.2 fuses the three ops into the CuTe-DSL kernel (NVTE_CUTEDSL_FUSED_GROUPED_MLP=1), refused by
    name elsewhere."""
    key = "use_grouped_gemm_for_dense_mlp"
    if a.bool_arg("add_bias_linear", True):
        a.fail(key, "TEFusedMLPWithGroupedLinear (megatron-core 0.19.2) needs --disable-bias-linear (the CuTe-DSL fused "
               "kernel has no bias)")
    if not kw["gated_linear_unit"] or kw["squared_relu"] or a.bool_arg("quick_geglu", False):
        a.fail(key, "TEFusedMLPWithGroupedLinear (megatron-core 0.19.2) needs the SwiGLU activation (--swiglu)")
    if kw["tensor_model_parallel_size"] > 1:
        a.notes.append(f"{a.key(key)}: with tensor-parallel size > 1 TEFusedMLPWithGroupedLinear runs TEFusedMLP's "
                       "path (estimated as --use-transformer-engine-op-fuser alone)")
        return False
    env = a.raw.env
    why = ""
    if str(env.get("FP4_RECIPE", "")).strip() == "nvfp4":
        why = "its NVFP4 autocast (FP4_RECIPE=nvfp4)"
    elif not (kw.get("fp8") == "e4m3" and kw.get("fp8_recipe") == "mxfp8" and not kw.get("fp4")):
        why = "its own MXFP8 autocast inside a model of another precision (sized with --fp8-recipe mxfp8 --fp8-format e4m3)"
    elif kw.get("first_last_layers_bf16"):
        why = "its own MXFP8 autocast in the BF16 first / last layers (--first-last-layers-bf16)"
    else:
        from ..estimator.fp8_layers import cutedsl_fused_grouped_mlp
        if not cutedsl_fused_grouped_mlp(env):
            why = ("TE's unfused GroupedLinear ops without NVTE_CUTEDSL_FUSED_GROUPED_MLP=1 (their path, and so their "
                   "weight copies, depends on the cuBLASLt version)")
    if why:
        raise NotModelledError(a.key(key), f"grouped GEMM for the dense MLP with tensor-parallel size 1: "
                                           f"TEFusedMLPWithGroupedLinear under {why}")
    tokens = kw["seq_length"] // max(1, kw.get("context_parallel_size", 1)) * kw["micro_batch_size"]
    if tokens % 128:
        # TE 2.20.2 ops/fused/grouped_mlp.py fuser_forward: ValueError unless the rows are a multiple of 128
        a.fail(key, f"TE's fused grouped MLP kernel needs the tokens of a micro-batch (sequence / CP x micro-batch "
               f"size = {tokens}) to be a multiple of 128")
    return True


def numerics(a: Args, kw: Mapping[str, Any], ctx: Context) -> dict[str, Any]:
    normalization = str(a.get("normalization", "LayerNorm"))
    if normalization.lower() in ("layernorm", "layer_norm"):
        normalization = "LayerNorm"
    elif normalization.lower() in ("rmsnorm", "rms_norm"):
        normalization = "RMSNorm"
    else:
        a.fail("normalization", f"must be LayerNorm or RMSNorm, got {normalization!r}")
    ce_fusion = a.bool_arg("cross_entropy_loss_fusion", False)
    ce_impl = str(a.get("cross_entropy_fusion_impl", "native"))
    if ce_fusion and ce_impl == "te" and not ctx.legacy:
        a.fail("cross_entropy_fusion_impl", "te is rejected together with --cross-entropy-loss-fusion since core 0.18")
    softmax_fp32 = a.bool_arg("attention_softmax_in_fp32", False)
    qk_scaling = a.bool_arg("apply_query_key_layer_scaling", False)
    if qk_scaling and not softmax_fp32 and kw["fp16"]:
        softmax_fp32 = True  # TransformerConfig: layer scaling needs the softmax in fp32 under fp16
    return dict(normalization=normalization, cross_entropy_loss_fusion=ce_fusion, cross_entropy_fusion_impl=ce_impl,
                attention_softmax_in_fp32=softmax_fp32, apply_query_key_layer_scaling=qk_scaling)


def wgrad(a: Args, kw: Mapping[str, Any], ctx: Context) -> dict[str, Any]:
    """ModelParallelConfig.__post_init__ refuses deferral without a pipeline or without fused
    weight-gradient accumulation."""
    defer_wgrad = a.bool_arg("defer_embedding_wgrad_compute", False)
    grad_acc_fusion = a.bool_arg("gradient_accumulation_fusion", True)
    if defer_wgrad and kw["pipeline_model_parallel_size"] == 1:
        a.fail("defer_embedding_wgrad_compute", "needs pipeline-model-parallel size > 1")
    if defer_wgrad and not grad_acc_fusion:
        a.fail("defer_embedding_wgrad_compute", "cannot be used with --no-gradient-accumulation-fusion")
    return dict(defer_embedding_wgrad_compute=defer_wgrad, gradient_accumulation_fusion=grad_acc_fusion)
