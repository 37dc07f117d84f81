"""What one transformer layer keeps for backward, per micro-batch, op by op.

Two implementation tables, chosen by ``--transformer-impl``:

* ``local``: megatron-core's local spec (ColumnParallelLinear/RowParallelLinear, unfused
  DotProductAttention, the norm modules, the bias-dropout-add functions, the MLP's activation),
  with and without each fusion. This is what the CPU referee runs and measures.
* ``transformer_engine``: TE's LayerNormLinear modules and fused/flash attention (no s x s scores,
  fp32 softmax statistics instead), megatron's fused activation functions.

Shapes per TP rank: ``T`` tokens of the sequence-sharded stream (``s*b/t`` with sequence
parallelism, else ``s*b``), ``Tf = s*b`` tokens inside the tensor-parallel region, ``s`` already
divided by CP. Bytes follow the dtype of each tensor (activations in the param dtype).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from ..layout import Layout


@dataclass(frozen=True)
class Shapes:
    s: int          # sequence length on this CP rank
    b: int          # micro-batch size
    T: int          # tokens of the sequence-sharded residual stream on this rank
    Tf: int         # tokens inside the tensor-parallel region (s*b)
    h: int
    a_t: int        # attention heads on this rank
    g_t: int        # query groups on this rank (at least 1)
    d: int          # head dim (kv_channels)
    f_t: int        # ffn hidden on this rank
    e: int          # bytes per activation element
    r: int          # bytes per residual-stream element (fp32 with --fp32-residual-connection)


@lru_cache(maxsize=256)
def shapes(L: Layout) -> Shapes:
    s = L.seq_length // L.cp
    b = L.micro_batch_size
    t = L.tp
    return Shapes(
        s=s, b=b, T=s * b // (t if L.sequence_parallel else 1), Tf=s * b, h=L.hidden_size,
        a_t=L.num_attention_heads // t, g_t=max(1, L.num_query_groups // t), d=L.kv_channels,
        f_t=L.ffn_hidden_size // t, e=L.act_bytes, r=4 if L.fp32_residual_connection else L.act_bytes,
    )


@dataclass(frozen=True)
class LayerActivations:
    saved: dict[str, int] = field(default_factory=dict)   # kept until this layer's backward
    fwd_transient: int = 0     # extra bytes alive at the worst point of this layer's forward
    bwd_transient: int = 0     # extra bytes alive at the worst point of this layer's backward
    recompute_note: str = ""

    @property
    def total(self) -> int:
        return sum(self.saved.values())


def uses_unfused_attention(L: Layout) -> bool:
    """Local spec always materialises the s x s scores; TE only with --attention-backend unfused."""
    return L.transformer_impl == "local" or L.attention_backend in ("unfused", "local")


def _norm_stats(L: Layout, n_tokens: int) -> int:
    # fp32 mean and rstd per token (LayerNorm), rstd only (RMSNorm)
    return n_tokens * 4 * (2 if L.normalization == "LayerNorm" else 1)


def attention_core(L: Layout, x: Shapes, recompute_core: bool) -> tuple[dict[str, int], int, int]:
    """Saved bytes, forward transient and backward transient of q/k/v handling and core attention."""
    saved: dict[str, int] = {}
    a_t, g_t, d, e, Tf = x.a_t, x.g_t, x.d, x.e, x.Tf
    qkv_w = (L.num_attention_heads + 2 * L.num_query_groups) * d // L.tp
    rope = L.position_embedding_type in ("rope", "yarn")
    gqa = a_t > g_t or L.num_query_groups < L.tp
    q = Tf * a_t * d * e
    kv1 = Tf * g_t * d * e            # one of k or v before repetition
    scores = x.b * a_t * x.s * x.s    # elements of one s x s tensor per rank
    unfused = uses_unfused_attention(L)
    te = L.transformer_impl == "transformer_engine"

    fwd_t = bwd_t = 0
    if unfused:
        if recompute_core:
            # tensor_parallel.checkpoint keeps its inputs: q (copy under GQA, rope output), k and v (views
            # of the qkv output unless rope made a copy of k) -> the qkv output stays alive through v.
            saved["qkv_output"] = Tf * qkv_w * e
            if gqa and not rope:
                saved["query"] = q
            if rope:
                saved["query_rope"] = q
                saved["key_rope"] = kv1
        elif gqa:
            # query reshaped (copy) or rope'd; key/value repeated to every head (repeat_interleave copies).
            saved["query"] = q
            saved["key_repeated"] = q
            saved["value_repeated"] = q
        else:
            saved["qkv_output"] = Tf * qkv_w * e      # q, k, v are views; v is saved by the bmm
            if rope:
                saved["query_rope"] = q
                saved["key_rope"] = kv1
        probs = scores * e
        if L.attention_softmax_in_fp32:
            probs += scores * 4       # fp32 softmax output kept by softmax, bf16 copy kept by the bmm
        if L.attention_dropout > 0:
            probs += scores * (1 + e)  # dropout mask and dropped-out probs
        if recompute_core:
            # Recomputed in backward: the probs exist again, one layer at a time.
            bwd_t += probs
        else:
            saved["attention_probs"] = probs
        # Forward: the raw scores (and their fp32 copy) live next to the probs while softmax runs.
        fwd_t = scores * e + (scores * 4 if L.attention_softmax_in_fp32 else 0) + (probs if recompute_core else 0)
        # Backward: grad of probs and grad of scores next to the probs (softmax backward).
        bwd_t += 2 * scores * e + (2 * scores * 4 if L.attention_softmax_in_fp32 else 0)
    else:
        # Fused/flash attention keeps q, k, v, the output and fp32 softmax statistics [b, a, s].
        stats = x.b * a_t * x.s * 4
        if recompute_core:
            saved["qkv_output"] = Tf * qkv_w * e
            bwd_t += Tf * a_t * d * e + stats
        else:
            if te:
                saved["qkv_output"] = Tf * qkv_w * e
                if rope:
                    saved["query_rope"] = q
                    saved["key_rope"] = kv1
            else:
                saved["qkv_output"] = Tf * qkv_w * e
            saved["attention_out"] = Tf * a_t * d * e
            saved["softmax_stats"] = stats
        fwd_t = Tf * a_t * d * e
        bwd_t += 3 * Tf * a_t * d * e
    return saved, fwd_t, bwd_t


def mlp_items(L: Layout, x: Shapes) -> tuple[dict[str, int], int, int]:
    """Saved bytes of fc1 output, the activation and fc2 input; transients of the MLP."""
    Tf, f_t, e = x.Tf, x.f_t, x.e
    saved: dict[str, int] = {}
    if L.gated_linear_unit:
        saved["fc1_output"] = Tf * 2 * f_t * e
        if not L.bias_activation_fusion:
            saved["activation_gate"] = Tf * f_t * e   # silu(x0), kept by the product
        saved["fc2_input"] = Tf * f_t * e
        fwd_t = Tf * f_t * e
        bwd_t = Tf * 2 * f_t * e + 2 * Tf * f_t * e
    else:
        saved["fc1_output"] = Tf * f_t * e
        saved["fc2_input"] = Tf * f_t * e
        fwd_t = Tf * f_t * e
        bwd_t = 2 * Tf * f_t * e
    return saved, fwd_t, bwd_t


@lru_cache(maxsize=256)
def layer_activations(L: Layout) -> LayerActivations:
    """One layer, one micro-batch, no full recompute (that is applied per block by the caller)."""
    x = shapes(L)
    mods = set(L.recompute_modules) if L.recompute_granularity == "selective" else set()
    te = L.transformer_impl == "transformer_engine"
    saved: dict[str, int] = {}
    T, h, e, r = x.T, x.h, x.e, x.r

    saved["layer_input"] = T * h * r
    saved["norm_stats"] = 2 * _norm_stats(L, T)
    if not ("layernorm" in mods and not te):
        saved["qkv_input"] = T * h * e          # norm output, kept by linear_qkv (local shard under SP)
    att, att_fwd, att_bwd = attention_core(L, x, recompute_core="core_attn" in mods)
    saved.update(att)
    saved["proj_input"] = x.Tf * x.a_t * x.d * e    # attention context, kept by linear_proj
    if L.hidden_dropout > 0:
        saved["dropout_masks"] = 2 * T * h         # bool masks after attention and after the MLP
    saved["mlp_norm_input"] = T * h * r
    if not ("layernorm" in mods and not te):
        saved["fc1_input"] = T * h * e
    mlp, mlp_fwd, mlp_bwd = mlp_items(L, x)
    if "mlp" in mods:
        mlp_bwd += sum(mlp.values())
        mlp = {}
    saved.update(mlp)
    if "layernorm" in mods and not te:
        att_bwd += T * h * e
    fwd_t = max(att_fwd, mlp_fwd) + x.Tf * h * e    # + the layer's output before the residual add
    bwd_t = max(att_bwd, mlp_bwd) + 2 * T * h * e   # + incoming and outgoing activation grads
    return LayerActivations(saved=saved, fwd_transient=fwd_t, bwd_transient=bwd_t)
