"""Section: DeepSeek sparse attention (``--experimental-attention-variant dsa``, DeepSeek-V3.2 style).

Mirrors megatron-core 0.19.2: TransformerConfig.__post_init__ (transformer/transformer_config.py lines 1383-1398: no
linear bias, top-k frequency >= 1, skip offset >= 0; line 2837: no RoPE fusion, CP only with the allgather
communication), get_dsa_module_spec_for_backend (models/gpt/experimental_attention_variant_module_specs.py: MLA only,
no qk_l2_norm) and AbsorbedMLASelfAttention.__init__ (experimental_attention_variant/absorbed_mla.py: sequence
parallelism when TP > 1, no MLA latent cache). What memguard models is the PyTorch path of ``--dsa-kernel-backend
none`` (the default; estimator/layers/dsa.py), with top-k sharing (``--dsa-indexer-topk-freq`` > 1); the rest is refused
by name.
"""
from __future__ import annotations

from typing import Any, Mapping

from packaging.version import Version

from ..errors import NotModelledError
from ..numbers import shown
from ..partition import dsa_skips_topk
from .args import Args, Context

VARIANT = "experimental_attention_variant"
# megatron-core 0.19.2 TransformerConfig.experimental_attention_variant: Literal['gated_delta_net', 'dsa']
VARIANTS = ("gated_delta_net", "dsa")


def dsa(a: Args, kw: Mapping[str, Any], ctx: Context) -> dict[str, Any]:
    """The DSA settings, checked as megatron-core 0.19.2 checks them. Runs after the attention variant (MLA)."""
    variant = a.get(VARIANT)
    # (None, or a YAML's 'None' / false, is no variant; any other value is compared as written: megatron-core tests
    # it with ==, so 'DSA' or ' dsa' builds no DSA and get_experimental_attention_variant_module_spec raises)
    variant = None if variant in (None, False, "None") else str(variant)
    if variant is not None and variant not in VARIANTS:
        a.fail(VARIANT, f"must be one of {', '.join(VARIANTS)} (TransformerConfig's Literal, compared as written), "
                        f"got {shown(variant)}")
        return {}
    # a hybrid model's 'D' layers (hybrid_layer_specs.py dsa_layer: AbsorbedMLASelfAttention with DSAttention, its
    # latent norms IdentityOp) read the same dsa_* settings; the variant's TransformerConfig rules need the flag
    hybrid_d = "D" in (kw.get("hybrid_layer_pattern") or "") + (kw.get("hybrid_mtp_pattern") or "")
    if variant != "dsa" and not hybrid_d:
        return {}        # (the other variant is refused in refusals.py)
    key = VARIANT if variant == "dsa" else "hybrid_layer_pattern"
    # (RoPE fusion in a hybrid model's 'D' layers: TransformerConfig forbids it only with the variant flag, below;
    # without it AbsorbedMLA takes its fused path, estimated in estimator/layers/dsa.py; MLA's rules ask for yarn)
    if ctx.version < Version("0.19"):
        # 0.16.1 builds DSA on MLASelfAttention with a different sparse path (dsa.py unfused_dsa_fn over [b*heads,
        # s, s] scores, no absorbed latent); memguard models 0.19.2's
        raise NotModelledError(a.key(key), "DSA before megatron-core 0.19 (MLASelfAttention with its first sparse "
                               "attention path; memguard models 0.19.2's AbsorbedMLASelfAttention)",
                               "give --megatron-version 0.19 or later")
    if not kw.get("multi_latent_attention"):
        a.fail(key, "dsa needs --multi-latent-attention (get_dsa_module_spec_for_backend asserts it; a hybrid "
                    "model's 'D' layers read MLATransformerConfig's latent sizes)")
    heads = a.int_arg("dsa_indexer_n_heads", required=True)
    head_dim = a.int_arg("dsa_indexer_head_dim", required=True)
    topk = a.int_arg("dsa_indexer_topk", required=True)
    pe = kw.get("qk_pos_emb_head_dim", 64)
    if head_dim is not None and head_dim < pe:
        # DSAIndexer._apply_rope splits the head into [rope dim, head dim - rope dim]
        a.fail("dsa_indexer_head_dim", f"({head_dim}) must be at least --qk-pos-emb-head-dim {pe} (the indexer "
                                       "splits its head into the rotary part and the rest)")
    freq = a.int_arg("dsa_indexer_topk_freq", 1, minimum=-(10 ** 9))
    if freq is not None and freq < 1:
        a.fail("dsa_indexer_topk_freq", f"must be positive, got {freq} (TransformerConfig)")
    offset = a.int_arg("dsa_indexer_skip_topk_offset", 0, minimum=-(10 ** 9))
    if offset is not None and offset < 0:
        a.fail("dsa_indexer_skip_topk_offset", f"must be non-negative, got {offset} (TransformerConfig)")
    if freq and freq > 1:
        _topk_sharing(a, kw, freq, max(0, offset or 0))
    backend = str(a.get("dsa_kernel_backend", "none"))
    if backend not in ("none", "tilelang", "cudnn"):
        # (compared as written: dsa_kernels.py tests the Literal with ==)
        a.fail("dsa_kernel_backend", f"must be one of none, tilelang, cudnn, got {shown(backend)}")
    elif backend == "cudnn" and kw.get("attention_backend") != "unfused":
        # dsa_kernels.use_fused_dsa_kernels: a fused backend unless --attention-backend unfused. The cuDNN backend runs
        # FlashMLA / cuDNN's compiled kernels (dsa_cudnn_kernels.py: indexer, sparse attention and loss fused), whose
        # workspaces the Python wrappers do not show
        raise NotModelledError(a.key("dsa_kernel_backend"), "the cudnn DSA kernels (FlashMLA / cuDNN's compiled "
                               "workspaces; memguard models the PyTorch path and the tilelang kernels)")
    elif backend == "tilelang" and kw.get("attention_backend") != "unfused":
        _tilelang(a, kw, freq or 1)
    if kw.get("add_bias_linear"):
        a.fail("add_bias_linear", "must be off with DSA: AbsorbedMLASelfAttention takes no linear bias "
                                  "(TransformerConfig, AbsorbedMLASelfAttention.__init__)", "add --disable-bias-linear")
    if variant == "dsa" and kw.get("apply_rope_fusion"):
        a.fail("apply_rope_fusion", "RoPE fusion is not supported for DSAttention (TransformerConfig)",
               "add --no-rope-fusion")
    if kw.get("tensor_model_parallel_size", 1) > 1 and not kw.get("sequence_parallel"):
        a.fail("sequence_parallel", "AbsorbedMLA (DSA) requires --sequence-parallel when "
                                    "tensor-model-parallel size > 1", "add --sequence-parallel")
    mods = kw.get("recompute_modules") or ()
    if kw.get("context_parallel_size", 1) > 1:
        _context_parallel(a, kw, mods)
    quantized = "fp8" if kw.get("fp8") else "fp4" if kw.get("fp4") else None
    if kw.get("recompute_granularity") == "selective" and "mla_up_proj" in mods and quantized:
        # AbsorbedMLASelfAttention.get_query_key_value_tensors asserts it at the first forward (absorbed_mla.py)
        a.fail("recompute_modules", f"mla_up_proj does not work with DSA under --{quantized}-format (AbsorbedMLA "
                                    "asserts \"FP8/FP4 is not supported for AbsorbedMLA\" when it recomputes the up "
                                    "projections)", "drop mla_up_proj from --recompute-modules")
    elif quantized:
        # estimated (estimator/fp8_layers.py dsa_saved_overrides): the TE linears quantize, the einsums and DSAttention
        # stay BF16; with primary FP8 weights the einsums read linear_kv_up_proj's quantized weight, which TE
        # dequantizes (dsa_k_up_weight, dsa_primary_weights)
        if quantized == "fp4" and kw.get("fp4_param_gather"):
            # AbsorbedMLA._get_kv_up_weights slices the [heads, qk + v, kv_lora] view of the weight; TE 2.20.2's
            # NVFP4Tensor.__torch_dispatch__ raises NotImplementedError on a partial slice (nvfp4_tensor.py)
            a.fail("fp4_param_gather", "does not work with DSA: AbsorbedMLA slices linear_kv_up_proj's weight into K "
                                       "and V up projections, and Transformer Engine's NVFP4Tensor raises \"does not "
                                       "support partial slicing\" (NVFP4 primary weights)",
                   "drop --fp4-param-gather")
        if kw.get("fp8_dot_product_attention"):
            # get_dsa_module_spec_for_backend builds DSAttention whatever the backend: no TE DotProductAttention
            a.notes.append(f"{a.key('fp8_dot_product_attention')}: no effect on DSA layers (DSAttention is PyTorch "
                           "code, not Transformer Engine's attention): their attention is estimated in BF16")
    coeff = a.float_arg("dsa_indexer_loss_coeff", 0.0)
    if coeff < 0:
        a.fail("dsa_indexer_loss_coeff", f"must be non-negative, got {coeff}")
    if not a.bool_arg("dsa_indexer_scoring_relu", True):
        a.notes.append(f"{a.key('dsa_indexer_scoring_relu')}: estimated with the indexer's ReLU (its loss backward's "
                       "ReLU mask and its fp32 copy are counted: errs high)")
    return dict(experimental_attention_variant=variant, dsa_indexer_n_heads=heads or 0,
                dsa_indexer_topk_freq=max(1, freq or 1), dsa_indexer_skip_topk_offset=max(0, offset or 0),
                dsa_kernel_backend="tilelang" if backend == "tilelang" and kw.get("attention_backend") != "unfused"
                else "none",
                dsa_indexer_head_dim=head_dim or 0, dsa_indexer_topk=topk or 0,
                dsa_indexer_loss_coeff=max(0.0, coeff),
                dsa_indexer_use_sparse_loss=a.bool_arg("dsa_indexer_use_sparse_loss", False),
                dsa_indexer_k_norm_fp32=a.bool_arg("dsa_indexer_k_norm_fp32", False))


def _context_parallel(a: Args, kw: Mapping[str, Any], mods: Any) -> None:
    """DSA under context parallelism: TransformerConfig asserts the allgather communication (each rank's query
    against the whole key, gathered over CP and put in sequence order: DSAttention.forward, dsa.py 0.19.2), which
    estimator/layers/dsa.py sizes, with or without the indexer loss. The recomputed core or up projections under CP
    were not measured: refused by name."""
    comm = a.get("cp_comm_type", "p2p")
    if any(str(c).replace("_", "").lower() != "allgather" for c in (comm if isinstance(comm, (list, tuple)) else [comm])):
        a.fail("cp_comm_type", "must be all_gather for DSA with context parallelism (TransformerConfig: \"DSAttention "
                               "context parallelism currently supports cp_comm_type=allgather only\")",
               "add --cp-comm-type all_gather")
        return


def _topk_sharing(a: Args, kw: Mapping[str, Any], freq: int, offset: int) -> None:
    """``--dsa-indexer-topk-freq`` > 1 (megatron-core 0.19.2 dsa.py is_dsa_skip_topk_layer): the layers between two
    computing layers reuse the last one's top-k, handed over in a dict on the forward's attention mask (or the
    config). Estimated (estimator/layers/dsa.py topk_holder_bytes, partition.py); the pipeline split and the replays
    of recomputed layers are checked where the layers are placed (partition.check_dsa_topk_sharing). Refused by name
    where MTP depths past the first would reuse one (their own layer numbering)."""
    depths = int(a.int_arg("mtp_num_layers", 0) or 0) if not a.bool_arg("mtp_use_repeated_layer", False) else 1
    if any(dsa_skips_topk(d, offset, freq) for d in range(2, depths + 1)) or "D" in (kw.get("hybrid_mtp_pattern") or ""):
        # MultiTokenPredictionLayer numbers its layers 1, 2, ... (multi_token_prediction.py): depth 2 on reuse a top-k
        raise NotModelledError(a.key("dsa_indexer_topk_freq"), "DSA top-k sharing in MTP depths past the first (they "
                               "number their layers 1, 2, ... and reuse the first depth's top-k)")


# sparse_mla_fwd_interface / sparse_mla_bwd (ops/tilelang_sparse_mla_*.py, 0.19.2): MCORE_DSA_TILELANG_SEQ_BUCKET's default
TILELANG_SEQ_BUCKET = 256


def _tilelang(a: Args, kw: Mapping[str, Any], freq: int) -> None:
    """``--dsa-kernel-backend tilelang`` (dsa_tilelang_kernels.py, ops/tilelang_dsa.py, 0.19.2): the TileLang indexer
    top-k and SparseMLA kernels, estimated in estimator/layers/dsa.py where their Python wrappers show every tensor.
    Refused by name where memguard has not followed them: the streaming sparse indexer loss, a recomputed core or up
    projection, context parallelism, top-k sharing, and a sequence the kernels pad to their bucket."""
    key = a.key("dsa_kernel_backend")
    mods = kw.get("recompute_modules") or ()
    if a.bool_arg("dsa_indexer_use_sparse_loss", False) and a.float_arg("dsa_indexer_loss_coeff", 0.0) > 0:
        raise NotModelledError(key, "the tilelang kernels with the sparse indexer loss (its streaming top-k KL, "
                               "fused_qk_topk_lighting_with_streaming_sparse_kl)")
    for what, on in (("a recomputed core or layer (core_attn, full recompute)", kw.get("recompute_granularity") == "full"
                      or kw.get("recompute_granularity") == "selective" and "core_attn" in mods),
                     ("the recomputed up projections (mla_up_proj)",
                      kw.get("recompute_granularity") == "selective" and "mla_up_proj" in mods),
                     ("context parallelism", kw.get("context_parallel_size", 1) > 1),
                     ("top-k sharing (--dsa-indexer-topk-freq > 1)", freq > 1)):
        if on:
            raise NotModelledError(key, f"the tilelang DSA kernels with {what}")
    seq = kw.get("seq_length") or 0
    if seq % TILELANG_SEQ_BUCKET:
        raise NotModelledError(key, f"the tilelang DSA kernels with a sequence ({seq}) they pad to a multiple of "
                               f"{TILELANG_SEQ_BUCKET} (MCORE_DSA_TILELANG_SEQ_BUCKET)")
