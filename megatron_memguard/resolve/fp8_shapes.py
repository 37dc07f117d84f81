"""The GEMM shapes Transformer Engine runs in FP8 / FP4: a layout whose quantized GEMMs have a dimension TE
refuses is a run that stops at its first forward step (or at model build for primary FP8 / FP4 weights), so
resolve refuses it naming the flag. Pure, on a resolved Layout (checked after ``Layout.from_flat``, since the
GEMM shapes come from the layer recipes: ``estimator/fp8_layers.layer_gemms``).

Read in Transformer Engine 2.11.0 (``transformer_engine/pytorch``; megatron-core 0.16.1 pins TE >= 2.9,
< 2.12; 0.19.2 leaves TE unpinned and tests with the same calls) and megatron-core 0.16.1 / 0.19.2:

* every recipe, ``Linear`` / ``LayerNormLinear`` forward (``module/linear.py``, ``layernorm_linear.py``)
  calls ``utils.assert_dim_for_fp8_exec(inputmat, weight)``: the product of all dimensions but the last
  divisible by 8 and the last by 16, for the input [tokens, in] and the weight [out, in] of this TP rank.
  ``GroupedLinear`` (MoE experts) does not call it.
* mxfp8 / nvfp4: every quantized tensor (weights, GEMM inputs, output gradients) needs both flattened
  dimensions divisible by the scaling block, 32 (``MXFP8_BLOCK_SCALING_SIZE``) or 16
  (``NVFP4_BLOCK_SCALING_SIZE``): ``csrc/quantizer.cpp`` ``MXFP8Quantizer::create_tensor`` /
  ``NVFP4Quantizer::create_tensor`` (NVTE_CHECK), ``tensor/mxfp8_tensor.py`` / ``nvfp4_tensor.py``
  ``make_empty`` (assert).
* blockwise: the sequence-parallel all-gather of a column-parallel input in FP8
  (``with_input_all_gather_nccl``: no userbuffers overlap) asserts ``Float8BlockQuantizer.is_quantizable``
  on the local shard (``utils.assert_dim_for_all_gather``): both dimensions divisible by 128 (``block_len``).

Token dimensions: megatron-core pads only the tokens of each expert (``Fp8Padding`` in ``TEGroupedMLP`` or
``--moe-router-padding-for-quantization``, to ``get_align_size_for_quantization``: 16, mxfp8 32, nvfp4 32 /
128), a multiple of every block above, so expert GEMM tokens always pass and are not checked here. The dense
stream (sequence / CP x micro-batch, / TP with sequence parallelism) is never padded for FP8 (neither
``fp8_utils.py`` nor the GPT model pads it), so a token count TE refuses is refused by name.
"""
from __future__ import annotations

from typing import Any

# the scaling block of the recipes whose quantizers need every dimension divisible by it (TE 2.11 constants.py)
BLOCK = {"mxfp8": 32, "nvfp4": 16}
BLOCKWISE_LEN = 128     # Float8BlockQuantizer.block_len (TE 2.11 tensor/float8_blockwise_tensor.py)
ROWS_MULTIPLE, LAST_MULTIPLE = 8, 16    # utils.assert_dim_for_fp8_exec (TE 2.11)


def _recipe_flag(L: Any) -> str:
    return "fp4_recipe" if L.fp8_spec.recipe == "nvfp4" else "fp8_recipe"


def _weight_flag(L: Any, name: str, value: int, unsharded_hidden: bool) -> str:
    """The flag that sets one weight dimension of GEMM ``name``."""
    if unsharded_hidden and value == L.hidden_size:
        return "hidden_size"
    lat = L.moe.moe_latent_size if getattr(L, "moe", None) is not None else None
    if lat and value == lat and (name.startswith("experts.") or name.endswith("_latent_proj")):
        return "moe_latent_size"    # the latent side of the latent projections and of the routed experts
    if name.startswith("experts."):
        return "moe_ffn_hidden_size"
    if name.startswith("shared_experts."):
        return "moe_shared_expert_intermediate_size"
    if "fc1" in name or "fc2" in name:
        return "ffn_hidden_size"
    if name == "indexer_linear_wq_b" and value == L.q_lora_rank:
        return "q_lora_rank"        # a DSA indexer's wq_b [heads x head dim, q_lora]
    if name in ("indexer_linear_wq_b", "indexer_linear_weights_proj"):
        return "dsa_indexer_n_heads"
    if name == "indexer_linear_wk":
        return "dsa_indexer_head_dim"
    if name in ("linear_q_down_proj", "linear_q_up_proj"):
        return "q_lora_rank"
    if name in ("linear_kv_down_proj", "linear_kv_up_proj"):
        return "kv_lora_rank"
    if name == "output_layer":
        # [padded vocabulary / TP, hidden]: the vocabulary pads to --make-vocab-size-divisible-by x TP
        return "make_vocab_size_divisible_by"
    if name.startswith("mixer."):
        # a Mamba layer's in_proj [(2 d_inner + 2 G N + heads) / TP, h] and out_proj [h, d_inner / TP]
        return "mamba_num_heads"
    if name in ("in_proj", "out_proj"):
        # a GDN layer's in_proj [(2 Hk dk + 2 Hv dv + 2 Hv) / TP, h] and out_proj [h, Hv dv / TP]
        return "linear_num_value_heads"
    if name in ("eh_proj", "linear_attn", "linear_mlp"):   # (a linear replacement's [h / TP, h])
        return "hidden_size"
    return "kv_channels"


def _gemms(L: Any) -> list[tuple[Any, bool]]:
    """The model's quantized GEMMs, each with whether a heterogeneous block's own MLP width ("dense:FFN", from the
    JSON, not --ffn-hidden-size) or own query groups (the QKV projection's width) sets it."""
    from ..estimator.fp8_layers import layer_gemms, mtp_gemms, output_proj_gemm
    from ..partition import model_kind_runs
    out: list[tuple[Any, bool]] = []
    seen = set()
    for kind, _n in model_kind_runs(L):
        if kind.quantized and kind not in seen:
            seen.add(kind)
            out += [(g, ":" in kind.mlp and g.name in ("linear_fc1", "linear_fc2")
                     or bool(kind.query_groups) and g.name == "linear_qkv") for g in layer_gemms(L, kind)]
    if getattr(L, "mtp_num_layers", 0):
        out += [(g, False) for g in mtp_gemms(L)]
    head = output_proj_gemm(L)
    if head is not None:
        out.append((head, False))
    return out


def _tokens_rule(L: Any, tokens: int, multiple: int, why: str) -> tuple[str, str]:
    sp = L.sequence_parallel and L.tp > 1
    split = " / ".join(x for x in ("--context-parallel-size" if L.cp > 1 else "",
                                   "--tensor-model-parallel-size (sequence parallel)" if sp else "") if x)
    how = "--seq-length x --micro-batch-size" + (f" / ({split})" if split else "")
    return ("seq_length", f"with --{_recipe_flag(L).replace('_', '-')} {L.fp8_spec.recipe}: {how} = {tokens} tokens per "
                          f"GEMM input is not a multiple of {multiple} ({why}; Megatron pads only MoE expert tokens)")


def shape_violations(L: Any) -> list[tuple[str, str]]:
    """(flag, one-line rule) for each flag whose value gives a quantized GEMM a shape Transformer Engine
    refuses (first problem per flag); empty without FP8 / FP4 or with ``--transformer-impl local``."""
    spec = L.fp8_spec
    if not spec.enabled or L.transformer_impl != "transformer_engine":
        return []
    r = spec.recipe
    rflag = f"--{_recipe_flag(L).replace('_', '-')} {r}"
    block = BLOCK.get(r)
    found: dict[str, str] = {}

    def weight(g: Any, side: str, value: int, multiple: int, why: str, own: bool = False) -> None:
        # rows are the output features (hidden for row-parallel / down GEMMs), cols the input features
        flag = ("heterogeneous_layers_config_path" if own and value != L.hidden_size
                else _weight_flag(L, g.name, value, True))
        experts = g.name.startswith("experts.")
        tp_note = (" on one expert-tensor-parallel rank" if experts and L.moe.etp > 1 else
                   " on one tensor-parallel rank" if not experts and L.tp > 1 else "")
        found.setdefault(flag, f"with {rflag}: {g.name}'s weight is [{g.rows}, {g.cols}]{tp_note}, its {side} "
                               f"({value}) are not a multiple of {multiple} ({why})")

    tp_overlap = bool(getattr(L, "tp_comm_overlap", False))
    for g, own in _gemms(L):
        grouped = g.name.startswith("experts.")
        if block:
            why = f"Transformer Engine's {r} quantizer needs every dimension divisible by its {block}-element block"
            for side, v in (("input features", g.cols), ("output features", g.rows)):
                if v % block:
                    weight(g, side, v, block, why, own)
            if not grouped and g.tokens and g.tokens % block and "seq_length" not in found:
                found["seq_length"] = _tokens_rule(L, g.tokens, block, why)[1]
        if not grouped:
            why = "Transformer Engine's FP8 GEMM (assert_dim_for_fp8_exec) needs input features divisible by 16, output features by 8"
            if g.cols % LAST_MULTIPLE:
                weight(g, "input features", g.cols, LAST_MULTIPLE, why, own)
            if g.rows % ROWS_MULTIPLE:
                weight(g, "output features", g.rows, ROWS_MULTIPLE, why, own)
            if g.tokens and g.tokens % ROWS_MULTIPLE and "seq_length" not in found:
                found["seq_length"] = _tokens_rule(L, g.tokens, ROWS_MULTIPLE,
                                                   "Transformer Engine's FP8 GEMM (assert_dim_for_fp8_exec)")[1]
        if r == "blockwise" and g.sp_gathered and not tp_overlap and not grouped:
            why = "the sequence-parallel all-gather of a blockwise FP8 input needs both dimensions divisible by 128"
            if g.cols % BLOCKWISE_LEN:
                weight(g, "input features", g.cols, BLOCKWISE_LEN, why, own)
            if g.tokens % BLOCKWISE_LEN and "seq_length" not in found:
                found["seq_length"] = _tokens_rule(L, g.tokens, BLOCKWISE_LEN, why)[1]
    return list(found.items())
