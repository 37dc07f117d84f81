"""Sections: the model's shape (layers, hidden, heads, FFN, query groups), the sequence and position
embedding, and multi-latent attention's projection shape (validate_args, TransformerConfig)."""
from __future__ import annotations

import math
from typing import Any, Mapping

from packaging.version import Version

from ..errors import ConfigError, NotModelledError
from ..numbers import shown, to_int
from .args import Args, Context, Stop


def required(a: Args, kw: Mapping[str, Any], ctx: Context) -> dict[str, Any]:
    """Layers, hidden size and heads: without them there is no model (stop after reporting all three)."""
    if kw.get("hybrid_layer_pattern"):
        num_layers = kw["num_layers"]          # the pattern's layers (resolve/hybrid.py)
    else:
        num_layers = a.int_arg("num_layers", required=True)
    if num_layers is None and a.get("decoder_num_layers") is not None:
        num_layers = a.int_arg("decoder_num_layers", required=True)
    hidden = a.int_arg("hidden_size", required=True)
    heads = a.int_arg("num_attention_heads", required=True)
    if None in (num_layers, hidden, heads):
        raise Stop
    return dict(num_layers=num_layers, hidden_size=hidden, num_attention_heads=heads)


def sequence(a: Args, kw: Mapping[str, Any], ctx: Context) -> dict[str, Any]:
    """Sequence length, position embedding, and context parallelism's rules on them."""
    cp = kw["context_parallel_size"]
    seq = a.int_arg("seq_length")
    if seq is None:
        seq = a.int_arg("encoder_seq_length")
    if seq is None:
        a.fail("seq_length", "is required")
        raise Stop
    position = str(a.get("position_embedding_type", "learned_absolute"))
    if a.bool_arg("use_rotary_position_embeddings", False):
        position = "rope"
    if position not in ("learned_absolute", "rope", "yarn", "none", "mrope", "relative"):
        a.fail("position_embedding_type", f"unknown type {position!r}")
    max_pos = a.int_arg("max_position_embeddings")
    if max_pos is None:
        max_pos = seq
        if a.raw.megatron_command_line:
            # validate_args's required arguments (megatron/training/arguments.py: 0.19.2 line 1274, 0.18.2 line
            # 1265, 0.17.1 line 1087, and long before): the script stops before the model is built. A note, not an
            # error: the estimate (the table sized by --seq-length) is what a run with the flag added would use
            a.notes.append("--max-position-embeddings not given: Megatron-LM's validate_args requires it (the run "
                           "will not start without it); estimated as --seq-length")
        elif position == "learned_absolute":   # it sizes the position table; rotary models never read it
            a.notes.append("--max-position-embeddings not given: taken as --seq-length")
    elif max_pos < seq:
        a.fail("max_position_embeddings", f"({max_pos}) must be >= seq_length ({seq})")
    if cp > 1 and seq % (2 * cp):
        a.fail("seq_length", f"{seq} must be a multiple of 2 * context-parallel-size = {2 * cp}")
    _check_cp_comm(a, cp, kw.get("num_layers"))
    return dict(seq_length=seq, position_embedding_type=position, max_position_embeddings=max_pos)


# Transformer Engine's communication types for context parallelism (attn_forward_func_with_cp, TE 2.11 and 2.20.2:
# "Unsupported communication type" for any other)
CP_COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")


def _check_cp_comm(a: Args, cp: int, num_layers: int | None = None) -> None:
    """validate_args: hierarchical CP sizes multiply to CP; a2a+p2p needs them. With CP > 1, TransformerConfig's
    __post_init__ (megatron-core 0.16.1 and 0.19.2) takes one type per layer or a single string, and Transformer
    Engine only its four types (a word, a number, a list of the wrong length were read as p2p)."""
    comm_v = a.get("cp_comm_type")
    if cp > 1 and comm_v is not None:
        items = list(comm_v) if isinstance(comm_v, (list, tuple)) else [comm_v]
        if isinstance(comm_v, (list, tuple)) and len(items) != 1 and len(items) != num_layers:
            a.fail("cp_comm_type", f"gives {len(items)} communication types for {num_layers} layers (megatron-core's "
                   "TransformerConfig asserts one per layer, or a single type)")
            return
        bad = [c for c in items if not isinstance(c, str) or c not in CP_COMM_TYPES]
        if bad:
            # (Megatron's --help spells it 'allgather'; TE's name is 'all_gather')
            a.fail("cp_comm_type", f"unknown communication type {shown(bad[0])} (Transformer Engine takes "
                   f"{', '.join(CP_COMM_TYPES)})", "write all_gather" if bad[0] == "allgather" else None)
            return
    sizes = a.get("hierarchical_context_parallel_sizes")
    if sizes:
        key = a.key("hierarchical_context_parallel_sizes")
        try:
            sizes = [to_int(x, key) for x in (sizes if isinstance(sizes, (list, tuple)) else str(sizes).split())]
        except ConfigError as e:
            a.errors.append(e)
            return
        if math.prod(sizes) != cp:
            a.fail("hierarchical_context_parallel_sizes",
                   f"{sizes} multiply to {math.prod(sizes)}, not context-parallel-size {cp}")
    comm = a.get("cp_comm_type", ["p2p"])
    comm = comm if isinstance(comm, (list, tuple)) else [comm]
    if any("a2a+p2p" in str(c) for c in comm) and not sizes:
        a.fail("hierarchical_context_parallel_sizes", "must be set when --cp-comm-type is a2a+p2p")


def cp_attention(a: Args, kw: Mapping[str, Any], ctx: Context) -> dict[str, Any]:
    """Over how many CP ranks Transformer Engine's attention runs an all-to-all (``cp_a2a_size``): 1 for the p2p
    ring over all of them (and all_gather); CP for ``a2a`` (``AttnFuncWithCPAndQKVOA2A``); between, ``a2a+p2p``
    over two levels (``AttnFuncWithCPAndKVP2P`` with ``cp_group = [a2a group, p2p group]``, megatron-core's
    hierarchical CP groups in the order of ``--hierarchical-context-parallel-sizes``: parallel_state.py
    ``create_hierarchical_groups``, core 0.16.1 and 0.19.2). TE 2.11 and 2.20.2 ``context_parallel.py``
    ``attn_forward_func_with_cp``: an a2a+p2p whose p2p group has one rank runs the a2a function, one whose a2a
    group has one rank the ring; MLA (k and v head dims differ) runs only p2p or a2a+p2p; the all-to-all splits
    the heads of q and k over its ranks. Sized by estimator/layers/cp_attention.py (BF16) and fp8_attention.py."""
    cp = kw["context_parallel_size"]
    if cp == 1:
        return {}
    raw = a.get("cp_comm_type") or ["p2p"]
    items = list(raw) if isinstance(raw, (list, tuple)) else [raw]
    if len(items) not in (1, kw.get("num_layers")) or any(c not in CP_COMM_TYPES for c in items):
        return {}                                      # _check_cp_comm reports it
    if len(items) > 1 and ctx.version < Version("0.17"):
        # megatron-core 0.16.1 transformer_layer.py: "config.cp_comm_type[self.layer_number]" with layer numbers from 1
        # (transformer_block.py build_layer(layer_spec, i + 1)): each layer takes the next layer's type and the last
        # one's index is past the list's end; 0.17.0 reads cp_comm_type[self.layer_number - 1]
        a.fail("cp_comm_type", f"gives one type per layer, which megatron-core {ctx.version} cannot run (its "
               "TransformerLayer reads cp_comm_type[layer_number] with layer numbers from 1: the last layer's index is "
               "past the list's end; megatron-core 0.17 reads cp_comm_type[layer_number - 1])",
               "give one type for all layers, or run megatron-core 0.17 or later",
               fails_later="at model build (TransformerLayer.__init__ raises IndexError on the last layer)")
        return {}
    comm = set(items)
    if len(comm) == 1:
        return _one_cp_type(a, kw, items[0], cp) or {}
    # one communication type per layer (TransformerConfig.cp_comm_type as a list; TransformerLayer takes
    # cp_comm_type[layer_number - 1]): each layer is sized by its own (its kind's cp_comm, partition.py); the layout's
    # cp_a2a_size / cp_kv_all_gather are the first layer's
    settings = {c: _one_cp_type(a, kw, c, cp) for c in sorted(comm)}
    if any(v is None for v in settings.values()):
        return {}
    words = {c: _cp_word(c, v, cp) for c, v in settings.items()}
    layers = [words[c] for c in items]
    if len(set(layers)) == 1:                          # e.g. p2p next to an a2a+p2p with one all-to-all rank
        return settings[items[0]]
    return {**settings[items[0]], "cp_comm_layers": ",".join(layers)}


def _cp_word(comm: str, settings: Mapping[str, Any], cp: int) -> str:
    """A layer's word in ``cp_comm_layers`` (estimator/layers ``cp_comm_settings`` reads it back): the all-to-all
    over every rank, a two-level one with its all-to-all ranks, the all-gather path where FP8 attention may take it
    (BF16 attention sizes it as the ring), else the ring."""
    a2a = settings.get("cp_a2a_size", 1)
    if a2a > 1:
        return "a2a" if a2a == cp else f"a2a+p2p:{a2a}"
    return "all_gather" if settings.get("cp_kv_all_gather") else "p2p"


def _one_cp_type(a: Args, kw: Mapping[str, Any], comm: str, cp: int) -> dict[str, Any] | None:
    """cp_attention's settings for one communication type; None where a rule it breaks was reported."""
    if comm == "a2a":
        a2a = cp
    elif comm == "all_gather":
        # AttnFuncWithCPAndKVAllGather: BF16 attention is sized as the ring (the layout is unchanged); FP8 attention
        # there follows the run's TE (resolve/fp8.py _ring_attention, estimator/layers/fp8_attention.py)
        fp8_attn = a.bool_arg("fp8_dot_product_attention", False) or a.bool_arg("fp8_multi_head_attention", False)
        return dict(cp_kv_all_gather=True) if fp8_attn else {}
    elif comm == "a2a+p2p":
        sizes = a.get("hierarchical_context_parallel_sizes")
        try:
            sizes = [int(x) for x in (sizes if isinstance(sizes, (list, tuple)) else str(sizes or "").split())]
        except ValueError:
            return None                                # _check_cp_comm reports it
        if len(sizes) != 2:
            # attn_forward_func_with_cp: "CP implementation a2a+p2p requires cp_group = [a2a_cp_group, p2p_cp_group]!"
            if sizes:
                a.fail("hierarchical_context_parallel_sizes", "must give two sizes (the all-to-all ranks, then the "
                       "ring's) with --cp-comm-type a2a+p2p (Transformer Engine takes two CP groups)")
            return None
        a2a = sizes[0]
    else:
        return {}
    if a2a == 1:
        return {}
    if a2a == cp and a.bool_arg("multi_latent_attention", False) and (
            a.int_arg("qk_head_dim", 128) + a.int_arg("qk_pos_emb_head_dim", 64) != a.int_arg("v_head_dim", 128)):
        # attn_forward_func_with_cp (TE 2.11 and 2.20.2): "Context parallelism does not support MLA with
        # cp_comm_type='a2a'" (k's head dim differs from v's)
        a.fail("cp_comm_type", "a2a cannot be used with --multi-latent-attention (Transformer Engine's context "
                               "parallelism runs MLA only with p2p or a2a+p2p)")
        return None
    # flash_attn_a2a_communicate (TE 2.11 and 2.20.2) splits the heads of q and of k over the all-to-all ranks
    # (AttnFuncWithCPAndQKVOA2A asserts "The number of attention heads needs to be divisible by CP size!"); k has
    # max(1, g / TP) heads per rank: megatron-core replicates the KV heads when TP > query groups
    tp = kw.get("tensor_model_parallel_size", 1)
    heads = kw.get("num_attention_heads") or 0
    groups = kw.get("num_query_groups") or heads
    a_t, g_t = heads // tp, max(1, groups // tp)
    if a_t % a2a or g_t % a2a:
        a.fail("cp_comm_type", f"{'a2a' if a2a == cp else 'a2a+p2p'} needs the attention heads ({a_t}) and query "
                               f"groups ({g_t}) of a tensor-parallel rank to be multiples of the all-to-all's "
                               f"{a2a} ranks (Transformer Engine's all-to-all splits the heads over them)")
        return None
    return dict(cp_a2a_size=a2a)


def dense_shape(a: Args, kw: Mapping[str, Any], ctx: Context) -> dict[str, Any]:
    """Shape defaults (validate_args): activation, FFN size, head dim, query groups and their TP rules."""
    hidden, heads, tp = kw["hidden_size"], kw["num_attention_heads"], kw["tensor_model_parallel_size"]
    swiglu = a.bool_arg("swiglu", False)
    squared_relu = a.bool_arg("squared_relu", False)
    if swiglu and squared_relu:
        a.fail("squared_relu", "cannot be combined with --swiglu")
    gated = swiglu or a.bool_arg("quick_geglu", False) or a.bool_arg("gated_linear_unit", False)
    ffn = a.int_arg("ffn_hidden_size")
    if ffn is None:
        ffn = int((4 * hidden * 2 / 3) / 64) * 64 if swiglu else 4 * hidden
    kv = a.int_arg("kv_channels")
    if kv is None:
        if hidden % heads:
            a.fail("hidden_size", f"{hidden} is not divisible by num_attention_heads {heads} (or give --kv-channels)")
            raise Stop
        kv = hidden // heads
    gqa = a.bool_arg("group_query_attention", False)
    groups = a.int_arg("num_query_groups", 1) if gqa else heads
    if gqa and groups is not None and heads % groups:
        a.fail("num_query_groups", f"{groups} must divide num_attention_heads {heads}")
    if heads % tp:
        a.fail("num_attention_heads", f"{heads} is not divisible by tensor-model-parallel size {tp}")
    if groups % tp and tp % groups:
        a.fail("num_query_groups", f"{groups} must be a multiple or a divisor of tensor-model-parallel size {tp}")
    return dict(swiglu=swiglu, squared_relu=squared_relu, gated_linear_unit=gated, ffn_hidden_size=ffn,
                kv_channels=kv, group_query_attention=gqa, num_query_groups=groups)


def attention_variant(a: Args, kw: Mapping[str, Any], ctx: Context) -> dict[str, Any]:
    """Multi-latent attention or not; with it, its projection shape. Runs after the kernels section
    (it needs transformer_impl and apply_rope_fusion)."""
    mla = a.bool_arg("multi_latent_attention", False)
    gate = a.bool_arg("attention_output_gate", False)
    if gate and mla:
        # MLATransformerConfig.__post_init__ raises NotImplementedError (core 0.19.2)
        a.fail("attention_output_gate", "is not supported with --multi-latent-attention (MLATransformerConfig)")
    return dict(multi_latent_attention=mla, attention_output_gate=gate, **_post_proj_norms(a, kw, mla),
                **(_mla_shape(a, kw) if mla else {}))


def _post_proj_norms(a: Args, kw: Mapping[str, Any], mla: bool) -> dict[str, Any]:
    """Gemma 2 / 3's layer specs (set by the Bridge reader, not Megatron flags): TERowParallelLinearLayerNorm as
    linear_proj and linear_fc2 of TE's dense GPT layer (Megatron-Bridge 0.6.2 gemma3_provider.py gemma3_layer_spec,
    gemma2_provider.py gemma2_layer_spec), and Gemma 2's own core attention and output-layer softcap."""
    post = a.bool_arg("post_proj_norms", False)
    gemma2 = a.bool_arg("gemma2_attention", False)
    which = "Gemma 2's" if gemma2 else "Gemma 3's"
    if post or gemma2:
        if kw.get("add_bias_linear"):
            # TERowParallelLinearLayerNorm.forward raises ValueError on a bias (models/common/te_layers.py)
            a.fail("add_bias_linear", f"must be off with {which} layer spec: TERowParallelLinearLayerNorm refuses a "
                   "linear bias (Megatron-Bridge te_layers.py)", "set model.add_bias_linear false")
        if kw.get("transformer_impl") != "transformer_engine":
            a.fail("transformer_impl", f"must be transformer_engine with {which} layer spec (its modules are TE's)")
        if mla:
            a.fail("multi_latent_attention", f"is not part of {which} layer spec (it builds a standard self-attention)")
        if a.get("num_experts"):
            a.fail("num_experts", f"is not part of {which} layer spec (it builds a dense MLP)")
    if gemma2:
        _gemma2_attention(a, kw)
    cap = a.float_arg("final_logit_softcapping", 0.0)
    if cap < 0:
        a.fail("final_logit_softcapping", f"must be 0 (none) or positive, got {cap}")
    if (gemma2 or cap > 0) and (a.int_arg("mtp_num_layers", 0, minimum=0) or 0) > 0:
        from ..errors import NotModelledError
        # the MTP heads run the softcapping output layer and, with gemma2_layer_spec, Gemma 2's attention
        raise NotModelledError(a.key("mtp_num_layers"), "multi-token prediction with Gemma 2's layers (the MTP "
                               "heads' softcapped logits and FlexAttention layers)")
    return dict(post_proj_norms=post, rotary_tables=a.int_arg("rotary_tables", 1, minimum=1),
                gemma2_attention=gemma2, final_logit_softcapping=max(cap, 0.0))


def _gemma2_attention(a: Args, kw: Mapping[str, Any]) -> None:
    """Gemma2FlexDotProductAttention (Megatron-Bridge 0.6.2 gemma2_provider.py): its parent raises on context
    parallelism and on packed sequences; it runs FlexAttention only without an attention mask and without attention
    dropout, else its unfused parent (s x s scores, their tanh softcap and a sliding-window mask), which memguard
    does not model. ``--attention-backend local`` swaps it for megatron-core's DotProductAttention (gpt_provider.py
    provide), which is modelled."""
    if kw.get("attention_backend") == "local":
        return
    if (kw.get("context_parallel_size") or 1) > 1:
        a.fail("context_parallel_size", "must be 1 with Gemma 2's layer spec: Gemma2DotProductAttention raises "
               "'Context parallelism is only supported by TEDotProductAttention!' (gemma2_provider.py)")
    from ..errors import NotModelledError
    if a.bool_arg("create_attention_mask_in_dataloader", True):
        raise NotModelledError(a.key("create_attention_mask_in_dataloader"), GEMMA2_UNFUSED_WHAT + " (the data "
                               "loader hands an attention mask to every layer; Bridge skips it by default: "
                               "dataset.skip_getting_attention_mask_from_dataset true)")
    if a.float_arg("attention_dropout", 0.1) > 0:   # (megatron-core's default 0.1; the Bridge reader sets Gemma 2's 0.0)
        raise NotModelledError(a.key("attention_dropout"), GEMMA2_UNFUSED_WHAT + " (attention dropout is on; "
                               "Gemma2ModelProvider's default is 0.0)")


GEMMA2_UNFUSED_WHAT = ("Gemma 2's unfused attention fallback (Gemma2FlexDotProductAttention runs its parent "
                       "Gemma2DotProductAttention when a mask is passed or dropout is on: [b, a/TP, s, s] scores, their "
                       "tanh softcap and, on the sliding-window layers, another mask; gemma2_provider.py)")


def _mla_shape(a: Args, kw: Mapping[str, Any]) -> dict[str, Any]:
    """Multi-latent attention's projection ranks and head dims (Megatron's defaults and rules)."""
    gqa, impl = kw["group_query_attention"], kw["transformer_impl"]
    rope_fusion, position = kw["apply_rope_fusion"], kw["position_embedding_type"]
    if gqa:
        a.fail("group_query_attention", "is mutually exclusive with --multi-latent-attention")
    if position == "yarn":
        # GPTModel builds a yarn embedding and passes it on; MLASelfAttention asserts it gets none
        a.fail("position_embedding_type", "yarn cannot be combined with --multi-latent-attention "
               "(MLA applies its own rotary embedding)", "use --rope-type yarn")
    if a.bool_arg("rotary_interleaved", False):
        a.fail("rotary_interleaved", "does not work with --multi-latent-attention (TransformerConfig)")
    if a.bool_arg("qk_l2_norm", False):
        a.fail("qk_l2_norm", "is not supported with --multi-latent-attention (gpt_layer_specs)")
    if impl != "transformer_engine":
        # the local MLA spec splits the down projections over TP and gathers their outputs: a
        # different set of tensors that memguard has not modelled
        raise NotModelledError(a.key("transformer_impl"), "multi-latent attention with the local implementation")
    for dest in ("mla_down_proj_fusion", "cache_mla_latents"):
        if a.bool_arg(dest, False):
            raise NotModelledError(a.key(dest), dest.replace("_", "-"))
    rope_type = str(a.get("rope_type", "yarn"))
    if rope_type not in ("rope", "yarn"):
        a.fail("rope_type", f"must be rope or yarn, got {rope_type!r}")
    elif rope_fusion and rope_type != "yarn":
        a.fail("rope_type", "rope fusion for multi-latent attention works only with yarn (TransformerConfig)",
               "use --rope-type yarn or --no-rope-fusion")
    pe = a.int_arg("qk_pos_emb_head_dim", 64)
    if rope_fusion and pe % 4:
        a.fail("qk_pos_emb_head_dim", f"({pe}) must be a multiple of 4 for the fused MLA rope kernels")
    return dict(q_lora_rank=a.int_arg("q_lora_rank"), kv_lora_rank=a.int_arg("kv_lora_rank", 32),
                qk_head_dim=a.int_arg("qk_head_dim", 128), qk_pos_emb_head_dim=pe,
                v_head_dim=a.int_arg("v_head_dim", 128), rope_type=rope_type)


def tp_split(a: Args, kw: Mapping[str, Any], ctx: Context) -> dict[str, Any]:
    """The model build's tensor-parallel splits (megatron.core.utils.divide asserts, both eras): each linear
    layer split over TP (or, in the experts, ETP) needs its split dimension to divide evenly. Sources:
    ColumnParallelLinear / RowParallelLinear (tensor_parallel/layers.py, 0.19.2 lines 965 and 1328, 0.16.1
    lines 842 and 1166) and their Transformer Engine twins (extensions/transformer_engine.py, 0.19.2 lines
    1292, 1451, 1707, the experts' 1010-1012 and 2193-2195; 0.16.1 lines 854, 993, 1093, 615-617 and
    1525-1527), and Transformer Engine's own divide of a linear's split dimension by its tp_size."""
    tp, spec = kw["tensor_model_parallel_size"], kw.get("moe")
    ffn_key = "ffn_hidden_size" if a.given("ffn_hidden_size") else "hidden_size"
    # a heterogeneous config's dense MLPs have per-layer widths: heterogeneous.py checks each layer's
    dense = (spec is None or not all(spec.moe_layer_pattern)) and not kw.get("heterogeneous_layers")
    if dense and kw["ffn_hidden_size"] % tp:
        # MLP.linear_fc2 is a RowParallelLinear over the FFN width (transformer/mlp.py)
        a.fail(ffn_key, f"FFN width {kw['ffn_hidden_size']} must be divisible by tensor-model-parallel size {tp} "
                        "(MLP linear_fc2, megatron-core divide)")
    if spec is not None:
        etp, f = spec.expert_tensor_parallel_size, spec.moe_ffn_hidden_size
        if f % etp:
            key = "moe_ffn_hidden_size" if a.given("moe_ffn_hidden_size") else ffn_key
            # the experts' fc2 splits the expert FFN width over ETP (moe/experts.py, grouped or sequential)
            a.fail(key, f"expert FFN width {f} must be divisible by expert-tensor-parallel size {etp} "
                        "(expert linear_fc2, megatron-core divide)")
        fs = spec.moe_shared_expert_intermediate_size
        if fs and fs % tp:
            # SharedExpertMLP is an MLP over the dense TP group (moe/shared_experts.py)
            a.fail("moe_shared_expert_intermediate_size", f"{fs} must be divisible by tensor-model-parallel size "
                                                          f"{tp} (shared-expert linear_fc2, megatron-core divide)")
    if not kw["multi_latent_attention"]:
        # SelfAttention.linear_qkv: kv_channels x (heads [x 2 with the output gate] + 2 x query groups) columns
        # (transformer/attention.py, 0.19.2 line 1678, 0.16.1 line 1264); heads and groups are checked above
        heads, groups, kv = kw["num_attention_heads"], kw["num_query_groups"], kw["kv_channels"]
        out = kv * (heads * (2 if kw["attention_output_gate"] else 1) + 2 * groups)
        if out % tp and not heads % tp:
            a.fail("kv_channels" if a.given("kv_channels") else "hidden_size", f"the QKV projection's {out} columns (kv_channels {kv} x (heads + 2 x query groups)) "
                                  f"must be divisible by tensor-model-parallel size {tp} (megatron-core divide)")
    return {}
