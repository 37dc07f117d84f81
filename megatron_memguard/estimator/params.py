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


def layer_params(L: Layout, prefix: str = "") -> list[Param]:
    """One transformer layer. Local spec order: input norm, linear_proj, linear_qkv, q/k norms,
    pre-MLP norm, fc1, fc2. The TE spec fuses the norms into linear_qkv/fc1
    (``layer_norm_weight``/``layer_norm_bias``); counts are the same, order differs slightly."""
    h, t = L.hidden_size, L.tp
    proj_in = L.num_attention_heads * L.kv_channels // t
    qkv = qkv_out_per_rank(L)
    fc1 = fc1_out_per_rank(L)
    fc2_in = L.ffn_hidden_size // t
    ps: list[Param] = []
    te = L.transformer_impl == "transformer_engine"
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
    if not te:
        ps += _norm(prefix + "pre_mlp_layernorm", h, L)
    else:
        ps += _norm(prefix + "mlp.linear_fc1.layer_norm", h, L)
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
    if c.has_output:
        out.extend([(h, False)] * (2 if L.normalization == "LayerNorm" else 1))
        if L.untie_embeddings_and_output_weights or c.has_tied_output_copy:
            out.append((vocab_rows * h, c.has_tied_output_copy))
    return out


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
    if c.has_output:
        ps += _norm("decoder.final_layernorm", h, L)
        if L.untie_embeddings_and_output_weights or c.has_tied_output_copy:
            ps.append(Param("output_layer.weight", vocab_rows * h, shared_embedding=c.has_tied_output_copy))
    return ps


def total_parameters(L: Layout) -> int:
    """Parameters of the whole model (one copy of everything, tied embedding counted once)."""
    h, V = L.hidden_size, L.padded_vocab_size
    a, g, d, f = L.num_attention_heads, L.num_query_groups, L.kv_channels, L.ffn_hidden_size
    norm = 2 if L.normalization == "LayerNorm" else 1
    per_layer = h * a * d + (a + 2 * g) * d * h + (2 if L.gated_linear_unit else 1) * f * h + h * f
    per_layer += 2 * norm * h
    if L.add_bias_linear:
        per_layer += h + (2 if L.gated_linear_unit else 1) * f + h
    if L.add_qkv_bias:
        per_layer += (a + 2 * g) * d
    if L.qk_layernorm:
        per_layer += 2 * norm * d
    total = L.num_layers * per_layer + norm * h + V * h
    if L.untie_embeddings_and_output_weights:
        total += V * h
    if L.position_embedding_type == "learned_absolute":
        total += L.max_position_embeddings * h
    return total
