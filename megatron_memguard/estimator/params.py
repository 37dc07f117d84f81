"""Parameters each model chunk holds, in the order megatron-core registers them.

The order matters twice: the DDP buffer pads every parameter start to 64 elements and every bucket
end to ``lcm(DP*CP, 128)`` with the distributed optimizer, walking the parameters in reverse
registration order (``_ParamAndGradBuffer.__init__`` in megatron/core/distributed/
param_and_grad_buffer.py); and the distributed optimizer's fp32 shards follow those boundaries.

Shapes per rank (TP = t): column-parallel weights split their output dimension, row-parallel weights
their input dimension; row-parallel biases, norms and position embeddings are replicated; the word
embedding and output layer are vocabulary-parallel (V/t rows).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from ..layout import Chunk, Layout


@dataclass(frozen=True)
class Param:
    name: str
    numel: int
    tp_replicated: bool = False      # same values on every TP rank (norms, row-parallel biases)
    shared_embedding: bool = False   # tied embedding / output copy: its own DDP bucket with dist-opt


def qkv_out_per_rank(L: Layout) -> int:
    """Output width of linear_qkv on one TP rank: (heads + 2 * query groups) * head dim / TP."""
    return (L.num_attention_heads + 2 * L.num_query_groups) * L.kv_channels // L.tp


def fc1_out_per_rank(L: Layout) -> int:
    return (2 if L.gated_linear_unit else 1) * L.ffn_hidden_size // L.tp


def _norm(name: str, size: int, L: Layout) -> list[Param]:
    ps = [Param(name + ".weight", size, tp_replicated=True)]
    if L.normalization == "LayerNorm":
        ps.append(Param(name + ".bias", size, tp_replicated=True))
    return ps


def mla_linear_shapes(L: Layout) -> dict[str, tuple[int, int]]:
    """[out, in] per TP rank of multi-latent attention's projections (megatron-core's
    MLASelfAttention with the TE spec): the down projections are TE Linears in "duplicated" mode,
    whole on every TP rank; the up projections and linear_proj are split like column/row-parallel
    layers."""
    h, t, a = L.hidden_size, L.tp, L.num_attention_heads
    q_head = L.qk_head_dim + L.qk_pos_emb_head_dim
    shapes: dict[str, tuple[int, int]] = {}
    if L.q_lora_rank is None:
        shapes["linear_q_proj"] = (a * q_head // t, h)
    else:
        shapes["linear_q_down_proj"] = (L.q_lora_rank, h)
        shapes["linear_q_up_proj"] = (a * q_head // t, L.q_lora_rank)
    shapes["linear_kv_down_proj"] = (L.kv_lora_rank + L.qk_pos_emb_head_dim, h)
    shapes["linear_kv_up_proj"] = (a * (L.qk_head_dim + L.v_head_dim) // t, L.kv_lora_rank)
    shapes["linear_proj"] = (h, a * L.v_head_dim // t)
    return shapes


def layer_linear_shapes(L: Layout) -> dict[str, tuple[int, int]]:
    """[out, in] per TP rank of every linear weight of one transformer layer."""
    h, t = L.hidden_size, L.tp
    if L.multi_latent_attention:
        shapes = mla_linear_shapes(L)
    else:
        shapes = {"linear_qkv": (qkv_out_per_rank(L), h),
                  "linear_proj": (h, L.num_attention_heads * L.kv_channels // t)}
    shapes["linear_fc1"] = (fc1_out_per_rank(L), h)
    shapes["linear_fc2"] = (h, L.ffn_hidden_size // t)
    return shapes


def _mla_attention_params(L: Layout, prefix: str) -> list[Param]:
    """Registration order: input_layernorm (a separate TENorm: both down projections read its
    output), linear_proj (built by the MultiLatentAttention base), then the q and kv projections.
    With --qk-layernorm the up projections are TE LayerNormLinears holding the latent norms."""
    sh = mla_linear_shapes(L)
    ps = _norm(prefix + "input_layernorm", L.hidden_size, L)
    out, inp = sh["linear_proj"]
    ps.append(Param(prefix + "self_attention.linear_proj.weight", out * inp))
    if L.add_bias_linear:
        ps.append(Param(prefix + "self_attention.linear_proj.bias", out, tp_replicated=True))
    for name in ("linear_q_proj", "linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj"):
        if name not in sh:
            continue
        out, inp = sh[name]
        if name.endswith("_up_proj") and L.qk_layernorm:
            ps += _norm(prefix + f"self_attention.{name}.layer_norm", inp, L)
        ps.append(Param(prefix + f"self_attention.{name}.weight", out * inp, tp_replicated=name.endswith("down_proj")))
    return ps


def layer_params(L: Layout, prefix: str = "") -> list[Param]:
    """One transformer layer. Local spec order: input norm, linear_proj, linear_qkv, q/k norms,
    pre-MLP norm, fc1, fc2. The TE spec fuses the norms into linear_qkv/fc1
    (``layer_norm_weight``/``layer_norm_bias``); counts are the same, order differs slightly."""
    h, t = L.hidden_size, L.tp
    te = L.transformer_impl == "transformer_engine"
    if L.multi_latent_attention:
        return _mla_attention_params(L, prefix) + _mlp_params(L, prefix, te)
    proj_in = L.num_attention_heads * L.kv_channels // t
    qkv = qkv_out_per_rank(L)
    ps: list[Param] = []
    if not te:
        ps += _norm(prefix + "input_layernorm", h, L)
    ps.append(Param(prefix + "self_attention.linear_proj.weight", h * proj_in))
    if L.add_bias_linear:
        ps.append(Param(prefix + "self_attention.linear_proj.bias", h, tp_replicated=True))
    if te:
        ps += _norm(prefix + "self_attention.linear_qkv.layer_norm", h, L)
    ps.append(Param(prefix + "self_attention.linear_qkv.weight", qkv * h))
    if L.add_qkv_bias:
        ps.append(Param(prefix + "self_attention.linear_qkv.bias", qkv))
    if L.qk_layernorm:
        ps += _norm(prefix + "self_attention.q_layernorm", L.kv_channels, L)
        ps += _norm(prefix + "self_attention.k_layernorm", L.kv_channels, L)
    return ps + _mlp_params(L, prefix, te)


def _mlp_params(L: Layout, prefix: str, te: bool) -> list[Param]:
    h = L.hidden_size
    fc1 = fc1_out_per_rank(L)
    fc2_in = L.ffn_hidden_size // L.tp
    ps = _norm(prefix + ("mlp.linear_fc1.layer_norm" if te else "pre_mlp_layernorm"), h, L)
    ps.append(Param(prefix + "mlp.linear_fc1.weight", fc1 * h))
    if L.add_bias_linear:
        ps.append(Param(prefix + "mlp.linear_fc1.bias", fc1))
    ps.append(Param(prefix + "mlp.linear_fc2.weight", h * fc2_in))
    if L.add_bias_linear:
        ps.append(Param(prefix + "mlp.linear_fc2.bias", h, tp_replicated=True))
    return ps


@lru_cache(maxsize=256)
def _layer_numels(L: Layout) -> tuple[int, ...]:
    return tuple(p.numel for p in layer_params(L))


def chunk_numels(L: Layout, c: Chunk) -> list[tuple[int, bool]]:
    """(numel, shared_embedding) of every parameter of a chunk, in registration order (fast path)."""
    layer = _layer_numels(L)
    h, t = L.hidden_size, L.tp
    vocab_rows = L.padded_vocab_size // t
    tied_pp = (not L.untie_embeddings_and_output_weights) and L.pp > 1
    out: list[tuple[int, bool]] = []
    if c.has_embedding:
        out.append((vocab_rows * h, tied_pp))
        if L.position_embedding_type == "learned_absolute":
            out.append((L.max_position_embeddings * h, False))
    out.extend([(n, False) for n in layer] * c.num_layers)
    mtp = _mtp_params(L, c)
    if mtp:
        # the embedding copy is registered with the embedding (first), the MTP block after the decoder
        emb = [(n, shared) for name, n, shared in mtp if name.startswith("embedding.")]
        out = emb + out + [(n, shared) for name, n, shared in mtp if not name.startswith("embedding.")]
    if c.has_output:
        out.extend([(h, False)] * (2 if L.normalization == "LayerNorm" else 1))
        if L.untie_embeddings_and_output_weights or c.has_tied_output_copy:
            # with MTP on a later stage the embedding copy is the tied weight; the output layer keeps its own
            out.append((vocab_rows * h, c.has_tied_output_copy and not mtp))
    return out


def _mtp_params(L: Layout, c: Chunk) -> list[tuple[str, int, bool]]:
    """The MTP block's parameters when this chunk holds it (the last stage's last chunk)."""
    if not (c.has_output and getattr(L, "mtp_num_layers", 0)):
        return []
    from .mtp import chunk_params as mtp_chunk_params, spec_of
    return mtp_chunk_params(spec_of(L), [(p.name, p.numel) for p in layer_params(L)])


def chunk_params(L: Layout, c: Chunk) -> list[Param]:
    """All parameters of one model chunk, in ``named_parameters()`` order."""
    h, t = L.hidden_size, L.tp
    vocab_rows = L.padded_vocab_size // t
    tied_pp = (not L.untie_embeddings_and_output_weights) and L.pp > 1
    ps: list[Param] = []
    if c.has_embedding:
        ps.append(Param("embedding.word_embeddings.weight", vocab_rows * h, shared_embedding=tied_pp))
        if L.position_embedding_type == "learned_absolute":
            ps.append(Param("embedding.position_embeddings.weight", L.max_position_embeddings * h, tp_replicated=True))
    layer = layer_params(L)
    for i in range(c.num_layers):
        ps.extend(Param(f"decoder.layers.{i}." + p.name, p.numel, p.tp_replicated, p.shared_embedding) for p in layer)
    mtp = _mtp_params(L, c)
    if mtp:
        emb = [Param(name, n, shared_embedding=shared) for name, n, shared in mtp if name.startswith("embedding.")]
        ps = emb + ps + [Param(name, n, shared_embedding=shared) for name, n, shared in mtp
                         if not name.startswith("embedding.")]
    if c.has_output:
        ps += _norm("decoder.final_layernorm", h, L)
        if L.untie_embeddings_and_output_weights or c.has_tied_output_copy:
            ps.append(Param("output_layer.weight", vocab_rows * h, shared_embedding=c.has_tied_output_copy and not mtp))
    return ps


def total_parameters(L: Layout) -> int:
    """Parameters of the whole model (one copy of everything, tied embedding counted once)."""
    h, V = L.hidden_size, L.padded_vocab_size
    a, g, d, f = L.num_attention_heads, L.num_query_groups, L.kv_channels, L.ffn_hidden_size
    norm = 2 if L.normalization == "LayerNorm" else 1
    per_layer = (2 if L.gated_linear_unit else 1) * f * h + h * f + 2 * norm * h
    if L.add_bias_linear:
        per_layer += h + (2 if L.gated_linear_unit else 1) * f + h
    if L.multi_latent_attention:
        qh, kv = L.qk_head_dim + L.qk_pos_emb_head_dim, L.kv_lora_rank
        per_layer += a * L.v_head_dim * h + (L.qk_pos_emb_head_dim + kv) * h + a * (L.qk_head_dim + L.v_head_dim) * kv
        per_layer += a * qh * h if L.q_lora_rank is None else L.q_lora_rank * (h + a * qh)
        if L.qk_layernorm:
            per_layer += norm * (kv + (L.q_lora_rank or 0))
    else:
        per_layer += h * a * d + (a + 2 * g) * d * h
        if L.add_qkv_bias:
            per_layer += (a + 2 * g) * d
        if L.qk_layernorm:
            per_layer += 2 * norm * d
    total = L.num_layers * per_layer + norm * h + V * h
    # MTP depths: one layer each plus enorm, hnorm, final norm and eh_proj [h, 2h] (the embedding copy
    # of a later stage is a copy, not counted again)
    total += getattr(L, "mtp_num_layers", 0) * (per_layer + 3 * norm * h + 2 * h * h)
    if L.untie_embeddings_and_output_weights:
        total += V * h
    if L.position_embedding_type == "learned_absolute":
        total += L.max_position_embeddings * h
    return total
