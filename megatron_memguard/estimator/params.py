"""Parameters each model chunk holds, in the order megatron-core registers them.

The order matters twice: the DDP buffer pads every parameter start to 64 elements and every bucket
end to ``lcm(DP*CP, 128)`` with the distributed optimizer, walking the parameters in reverse
registration order (``_ParamAndGradBuffer.__init__`` in megatron/core/distributed/
param_and_grad_buffer.py); and the distributed optimizer's fp32 shards follow those boundaries.

Shapes per rank (TP = t): column-parallel weights split their output dimension, row-parallel weights
their input dimension; row-parallel biases, norms and position embeddings are replicated; the word
embedding and output layer are vocabulary-parallel (V/t rows).

A layer's parameters come from the recipes of its kind (``estimator.layers``: the token mixer's,
then the MLP's, which registers the pre-MLP norm).
"""
from __future__ import annotations

from collections import Counter
from functools import lru_cache

from ..layout import Chunk, Layout
from ..partition import HYBRID_KINDS, MIXER_ATTENTION, MIXER_DSA, MIXER_DSA_SHARED, MIXER_MLA, MLP_DENSE, MLP_MOE, LayerKind, kind_runs, layer_kinds, uniform_kind
from .layers import kind_layout, mixer_recipe, mlp_recipe
from .layers.attention import qkv_out_per_rank  # noqa: F401
from .layers.base import Param, ParamRow, param_objects
from .layers.moe import experts_use_expert_buffer
from .layers.base import norm_params as _norm
from .layers.mla import linear_shapes as mla_linear_shapes  # noqa: F401
from .layers.mlp import fc1_out_per_rank  # noqa: F401

__all__ = ["Param", "active_parameters", "chunk_expert_numels", "chunk_numels", "chunk_params", "holds_final_norm",
           "layer_linear_shapes", "layer_param_rows", "layer_params", "mtp_stack_layers", "mtp_stack_runs",
           "total_parameters"]


def layer_linear_shapes(L: Layout, kind: LayerKind | None = None) -> dict[str, tuple[int, int]]:
    """[out, in] per TP rank of every linear weight of one transformer layer (default: the model's
    uniform kind)."""
    kind = uniform_kind(L) if kind is None else kind
    L = kind_layout(L, kind)
    return {**mixer_recipe(kind).linear_shapes(L), **mlp_recipe(kind).linear_shapes(L)}


def layer_param_rows(L: Layout, kind: LayerKind | None = None) -> list[ParamRow]:
    """One transformer layer of ``kind`` (default: the model's uniform kind) as its recipes list it
    (layers.base.ParamRow): the mixer's parameters, then the MLP's. Local spec order: input norm,
    linear_proj, linear_qkv, q/k norms, pre-MLP norm, fc1, fc2. The TE spec fuses the norms into
    linear_qkv/fc1 (``layer_norm_weight``/``layer_norm_bias``); counts are the same, order differs slightly."""
    kind = uniform_kind(L) if kind is None else kind
    L = kind_layout(L, kind)
    return mixer_recipe(kind).param_rows(L) + mlp_recipe(kind).param_rows(L)


def layer_params(L: Layout, prefix: str = "", kind: LayerKind | None = None) -> list[Param]:
    """layer_param_rows as Param objects, their names after ``prefix``."""
    return param_objects(layer_param_rows(L, kind), prefix)


@lru_cache(maxsize=256)
def _layer_numels(L: Layout, kind: LayerKind, expert: bool = False) -> tuple[int, ...]:
    """Numels of one layer's parameters in the dense DDP buffer, or (``expert``) in the expert buffer:
    routed experts get their own buffer when megatron-core reduces them over the expert-data-parallel
    group (layers/moe.py experts_use_expert_buffer), else they stay with the dense parameters."""
    if L.moe is None or not experts_use_expert_buffer(L.moe, L.tp, L.megatron_version):
        return () if expert else _layer_numel_split(L, kind)[0]
    return _layer_numel_split(L, kind)[2 if expert else 1]


@lru_cache(maxsize=256)
def _layer_numel_split(L: Layout, kind: LayerKind) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """Numels of one layer's parameters: all of them, those outside the routed experts, the routed
    experts' (one recipe call serves both DDP buffers)."""
    rows = layer_param_rows(L, kind)        # (name, numel, tp_replicated, shared_embedding, expert, cols)
    return (tuple([r[1] for r in rows]), tuple([r[1] for r in rows if not r[4]]), tuple([r[1] for r in rows if r[4]]))


def holds_mtp(L: Layout, c: Chunk) -> bool:
    """Whether chunk ``c`` builds the MTP block (mtp_on_this_rank): the last chunk, or the chunk whose layout
    stage holds the 'm' entries (Megatron's mtp_standalone: a stage before the loss's)."""
    if not getattr(L, "mtp_num_layers", 0):
        return False
    return c.has_output if c.has_mtp is None else c.has_mtp


def holds_final_norm(L: Layout, c: Chunk) -> bool:
    """Whether chunk ``c`` builds the decoder's final norm: the chunk of the loss, or with MTP the chunk of the
    model's last decoder layer (TransformerBlock.has_final_layernorm_in_this_stage, core 0.16.1 and 0.19.2:
    "for model with MTPLayer, the final layernorm is set in the stage which has the last layer of the
    decoder"), another chunk when a --pipeline-model-parallel-layout leaves the loss's stage no decoder layer."""
    if not getattr(L, "mtp_num_layers", 0) or L.hybrid_layer_pattern:
        # (a hybrid model's HybridStack builds its final norm on the last stage, post_process, with or without MTP
        # and layers there: hybrid_block.py, megatron-core 0.17.1 to 0.19.2)
        return c.has_output
    return c.num_layers > 0 and c.first_layer + c.num_layers == L.num_layers


def _first_embedding_shared(L: Layout) -> bool:
    """Whether the first stage's word embedding is marked ``shared_embedding`` (its own DDP bucket with the
    distributed optimizer): with PP > 1 when the output layer is tied to it or MTP keeps a copy of it on the last
    stage, untied too (LanguageModule.setup_embeddings_and_output_layer, core 0.16.1 and 0.19.2: it returns early
    only without tying and without mtp_num_layers)."""
    return L.pp > 1 and (not L.untie_embeddings_and_output_weights or bool(getattr(L, "mtp_num_layers", 0)))


def chunk_numels(L: Layout, c: Chunk, final_norm: bool | None = None) -> list[tuple[int, bool]]:
    """(numel, shared_embedding) of every parameter of a chunk, in registration order (fast path).
    ``final_norm``: whether it builds the final norm (None: holds_final_norm)."""
    h, t = L.hidden_size, L.tp
    vocab_rows = L.padded_vocab_size // t
    tied_pp = _first_embedding_shared(L)
    out: list[tuple[int, bool]] = []
    if c.has_embedding:
        out.append((vocab_rows * h, tied_pp))
        if L.position_embedding_type == "learned_absolute":
            out.append((L.max_position_embeddings * h, False))
    for kind, n in c.kind_runs:
        out.extend([(numel, False) for numel in _layer_numels(L, kind)] * n)
    mtp = _mtp_params(L, c)
    if mtp:
        # the embedding copy is registered with the embedding (first), the MTP block after the decoder
        emb = [(n, shared) for name, n, shared in mtp if name.startswith("embedding.")]
        out = emb + out + [(n, shared) for name, n, shared in mtp if not name.startswith("embedding.")]
    if holds_final_norm(L, c) if final_norm is None else final_norm:
        out.extend([(h, False)] * (2 if L.normalization == "LayerNorm" else 1))
    if c.has_output:
        if L.untie_embeddings_and_output_weights or c.has_tied_output_copy:
            # with MTP on a later stage the embedding copy is the tied weight; the output layer keeps its own
            out.append((vocab_rows * h, c.has_tied_output_copy and not mtp))
    return out


def chunk_expert_numels(L: Layout, c: Chunk) -> list[tuple[int, bool]]:
    """(numel, False) of the chunk's parameters in megatron-core's expert DDP buffer (the routed
    experts of its MoE layers, when they are reduced over the expert-data-parallel group), in
    registration order."""
    if L.moe is None:
        return []
    out: list[tuple[int, bool]] = []
    for kind, n in c.kind_runs:
        out.extend([(numel, False) for numel in _layer_numels(L, kind, True)] * n)
    if holds_mtp(L, c):
        # the MTP layers (after the decoder) take the last decoder layer's kind
        from .mtp import layers_built
        depth = [numel for _, kind in mtp_stack_layers(L) for numel in _layer_numels(L, kind, True)]
        out.extend([(numel, False) for numel in depth] * layers_built(L))
    return out
def _mtp_params(L: Layout, c: Chunk) -> list[tuple[str, int, bool]]:
    """The MTP block's parameters when this chunk holds it (holds_mtp)."""
    if not holds_mtp(L, c):
        return []
    from .mtp import chunk_params as mtp_chunk_params, spec_of
    # an MoE MTP layer's routed experts go to the expert buffer like the decoder's (chunk_expert_numels)
    sep = L.moe is not None and experts_use_expert_buffer(L.moe, L.tp, L.megatron_version)
    return mtp_chunk_params(spec_of(L), [(prefix + name, numel) for prefix, kind in mtp_stack_layers(L)
                                         for name, numel, _tp, _shared, expert, _cols in layer_param_rows(L, kind)
                                         if not (sep and expert)],
                            embedding_copy=not c.has_embedding, layer_prefix="")


def _mtp_param_records(L: Layout, c: Chunk) -> list[Param]:
    """The MTP block's parameters with their tags (chunk_params): each layer's as the layer recipe tags them,
    its routed experts included whichever DDP buffer holds them (a real-model test: MTP + MoE with EP 2 built
    by megatron-core 0.16.1 holds them on the last stage, tests/test_properties_moe_identities.py); enorm,
    hnorm and the final norm whole on every TP rank; eh_proj a column-parallel [h / TP, 2h] matrix
    (multi_token_prediction.py MultiTokenPredictionLayer)."""
    if not holds_mtp(L, c):
        return []
    from .mtp import chunk_params as mtp_chunk_params, spec_of
    layer = [p for prefix, kind in mtp_stack_layers(L) for p in layer_params(L, prefix, kind)]
    by_name = {p.name: p for p in layer}
    h = L.hidden_size
    out: list[Param] = []
    for name, n, shared in mtp_chunk_params(spec_of(L), [(p.name, p.numel) for p in layer],
                                            embedding_copy=not c.has_embedding, layer_prefix=""):
        rel = name.split(".", 3)[-1]            # (mtp.layers.{d}.<the layer's name>)
        if name.startswith("mtp.") and rel in by_name:
            q = by_name[rel]
            out.append(Param(name, n, q.tp_replicated, shared, q.expert, q.cols))
        elif name.startswith("embedding."):
            out.append(Param(name, n, tp_replicated="position" in name, shared_embedding=shared, cols=h))
        elif name.endswith("eh_proj.weight"):
            out.append(Param(name, n, shared_embedding=shared, cols=2 * h))
        else:
            out.append(Param(name, n, tp_replicated=True, shared_embedding=shared))
    return out


def mtp_layer_kind(L: Layout) -> LayerKind:
    """MTP layers take the spec of the global last decoder layer (MultiTokenPredictionLayer.__init__; an MoE
    layer on a chunk without decoder layers in megatron-core 0.19's builder, ``mtp_moe_on_empty_chunk``),
    and run in the global FP8 context whatever ``--first-last-layers-bf16`` keeps in BF16 (``layer_no``
    -1 in ``get_fp8_context``), FP4 not at all (multi_token_prediction.py ``_proj_and_transformer_layer``:
    "MTP only use global fp8 context", "currently ignoring FP4 in MTP layers"; core 0.16.1 and 0.19.2)."""
    kind = layer_kinds(L)[-1]
    if kind.mixer == MIXER_DSA_SHARED:
        # the spec is the same for every DSA layer: DSAttention decides by its layer number, and an MTP depth numbers
        # its layer 1, 2, ... (multi_token_prediction.py): the first depth computes its top-k (resolve/dsa.py refuses
        # the later depths that would reuse one)
        kind = kind._replace(mixer=MIXER_DSA)
    if L.heterogeneous_layers:
        # megatron/training 0.19.2 models/gpt.py mtp_block_spec takes get_gpt_decoder_layer_specs(...)[-1], the
        # MoE / dense spec of the model's config (not the heterogeneous block spec), and MultiTokenPredictionLayer
        # builds it with the model's config, not get_config_for_layer's: full attention and an MoE or dense MLP
        # of the flags' widths, whatever the last block is
        moe = L.moe is not None and L.moe.moe_layer_pattern[-1]
        kind = LayerKind(MIXER_ATTENTION, MLP_MOE if moe else MLP_DENSE)
    if getattr(L, "linear_attention_pattern", None):
        # the same builder with --experimental-attention-variant gated_delta_net (resolve/gdn.py lets MTP through from
        # 0.19 only): get_gpt_decoder_layer_specs(...)[-1] is the standard GPT layer spec, attention (or MLA) with the
        # last layer's MLP, whether the last decoder layer is a GDN layer or not
        moe = L.moe is not None and L.moe.moe_layer_pattern[-1]
        kind = LayerKind(MIXER_MLA if L.multi_latent_attention else MIXER_ATTENTION, MLP_MOE if moe else MLP_DENSE)
    if getattr(L, "mtp_moe_on_empty_chunk", False) and L.moe is not None and kind.mlp != MLP_MOE and \
            not any(n for c in L.chunks if c.has_mtp for _, n in c.kind_runs):
        # megatron-core 0.19's GPT builder: the MTP layer on a chunk without decoder layers (a layout ending
        # '|mL') gets the MoE layer spec (Shape.mtp_moe_on_empty_chunk, resolve/mtp.py)
        kind = kind._replace(mlp=MLP_MOE)
    spec = L.fp8_spec
    quantized = spec.fp8_recipe if spec.fp8 and L.transformer_impl == "transformer_engine" else None
    return kind if kind.quantized == quantized else kind._replace(quantized=quantized)


def mtp_stack_layers(L: Layout) -> tuple[tuple[str, LayerKind], ...]:
    """The layers of one MTP depth, bottom to top, as (name prefix in the depth, kind). A hybrid model's MTP
    pattern (``hybrid_mtp_pattern``): MultiTokenPredictionLayer builds a HybridStack of one layer per symbol,
    without a final norm (``mtp_model_layer``, post_layer_norm=False; megatron-core 0.17.1 to 0.19.2
    multi_token_prediction.py); else the one transformer layer of mtp_layer_kind."""
    pattern = getattr(L, "hybrid_mtp_pattern", None)
    if pattern:
        return _hybrid_mtp_layers(pattern)
    return (("transformer_layer.", mtp_layer_kind(L)),)


@lru_cache(maxsize=64)
def _hybrid_mtp_layers(pattern: str) -> tuple[tuple[str, LayerKind], ...]:
    return tuple((f"mtp_model_layer.layers.{i}.", LayerKind(*HYBRID_KINDS[sym])) for i, sym in enumerate(pattern))


def mtp_stack_runs(L: Layout) -> tuple[tuple[LayerKind, int], ...]:
    """mtp_stack_layers' kinds as (kind, count) runs."""
    return kind_runs(tuple(kind for _, kind in mtp_stack_layers(L)))


def chunk_params(L: Layout, c: Chunk, layers: bool = True) -> list[Param]:
    """All parameters of one model chunk, in ``named_parameters()`` order (``layers=False``: all but its
    transformer layers')."""
    h, t = L.hidden_size, L.tp
    vocab_rows = L.padded_vocab_size // t
    tied_pp = _first_embedding_shared(L)
    ps: list[Param] = []
    if c.has_embedding:
        ps.append(Param("embedding.word_embeddings.weight", vocab_rows * h, shared_embedding=tied_pp, cols=h))
        if L.position_embedding_type == "learned_absolute":
            ps.append(Param("embedding.position_embeddings.weight", L.max_position_embeddings * h, tp_replicated=True,
                            cols=h))
    rows = {kind: layer_param_rows(L, kind) for kind, _ in c.kind_runs} if layers else {}
    for i, kind in enumerate(c.layer_kinds if layers else ()):
        ps += param_objects(rows[kind], f"decoder.layers.{i}.")
    mtp = _mtp_param_records(L, c)
    if mtp:
        emb = [p for p in mtp if p.name.startswith("embedding.")]
        ps = emb + ps + [p for p in mtp if not p.name.startswith("embedding.")]
    if holds_final_norm(L, c):
        ps += _norm("decoder.final_layernorm", h, L)
    if c.has_output:
        if L.untie_embeddings_and_output_weights or c.has_tied_output_copy:
            ps.append(Param("output_layer.weight", vocab_rows * h, shared_embedding=c.has_tied_output_copy and not mtp,
                            cols=h))
    return ps


def total_parameters(L: Layout) -> int:
    """Parameters of the whole model (one copy of everything, tied embedding counted once): each
    layer's from the recipes of its kind, plus the final norm and the embedding (and output layer)."""
    h, V = L.hidden_size, L.padded_vocab_size
    norm = 2 if L.normalization == "LayerNorm" else 1
    total = sum(n * (mixer_recipe(k).param_count(kind_layout(L, k)) + mlp_recipe(k).param_count(kind_layout(L, k)))
                for k, n in Counter(layer_kinds(L)).items())
    total += norm * h + V * h
    # MTP depths: one layer of the last decoder layer's kind each, plus enorm, hnorm, final norm and
    # eh_proj [h, 2h] (the embedding copy of a later stage is a copy, not counted again)
    from .mtp import layers_built
    d = layers_built(L)            # one with --mtp-use-repeated-layer
    if d:
        stack = 0
        for _, kind in mtp_stack_layers(L):
            KL = kind_layout(L, kind)
            stack += mixer_recipe(kind).param_count(KL) + mlp_recipe(kind).param_count(KL)
        total += d * (stack + 3 * norm * h + 2 * h * h)
    if L.untie_embeddings_and_output_weights:
        total += V * h
    if L.position_embedding_type == "learned_absolute":
        total += L.max_position_embeddings * h
    return total


def active_parameters(L: Layout) -> int:
    """Parameters one token passes through: the whole model (``total_parameters``) less the routed
    experts its router does not pick, E - k of the E experts of every MoE layer (MTP depths included).
    Shared experts, the router and everything else count whole. Equal to the total for dense models."""
    kinds = Counter(layer_kinds(L))
    if getattr(L, "mtp_num_layers", 0):
        from .mtp import layers_built
        for _, kind in mtp_stack_layers(L):
            kinds[kind] += layers_built(L)
    unpicked = 0
    for kind, n in kinds.items():
        if kind.mlp != MLP_MOE:
            continue
        KL = kind_layout(L, kind)
        m, h, g = KL.moe, KL.hidden_size, (2 if KL.gated_linear_unit else 1)
        F = m.moe_ffn_hidden_size
        # one routed expert: fc1 [g F, h] and fc2 [h, F] (+ their biases), as layers/moe.py param_count counts it
        expert = (g + 1) * F * h + ((g * F + h) if KL.add_bias_linear else 0)
        unpicked += n * (m.num_experts - m.moe_router_topk) * expert
    return total_parameters(L) - unpicked
