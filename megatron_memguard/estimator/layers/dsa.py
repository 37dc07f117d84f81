"""DeepSeek sparse attention (DSA, DeepSeek-V3.2 style; ``--experimental-attention-variant dsa``).

Recipe of the token mixer ``dsa`` (see ``base``), after megatron-core 0.19.2: AbsorbedMLASelfAttention
(experimental_attention_variant/absorbed_mla.py) around DSAttention and its lightning indexer DSAIndexer
(experimental_attention_variant/dsa.py), built by get_dsa_module_spec_for_backend
(models/gpt/experimental_attention_variant_module_specs.py). Modelled: the PyTorch path of ``--dsa-kernel-backend
none`` (the default), which materialises the "sparse" attention densely: fp32 scores [b, heads/TP, s, s] plus an
additive top-k mask, a masked softmax whose autograd keeps two fp32 and three bool copies of that size, and the
probabilities cast back for the value matmul (``_unfused_absorbed_dsa_fn``); with ``--dsa-indexer-loss-coeff`` > 0 the
indexer loss (``FusedDSAIndexerLoss``) keeps the indexer's q, k, weights, the query, the key and the top-k indices,
and recomputes everything in its backward. The byte counts of the core were measured on CPU with the real module
(benchmarks/referee/dsa_probe.py, tests/test_dsa.py).

The absorbed MLA around the core: the query's up projection stays per head and K's up projection is folded into
it (an einsum that keeps the q up projection's output), the core attention runs as MQA on the latent key
[s, b, 1, kv_lora + rope], and V's up projection follows the core (DSAttention consumes it: ``up_v_weight``).
"""
from __future__ import annotations

from functools import lru_cache

from ...layout import Layout
from . import mla
from .base import (MixerActivations, Param, ParamRow, Step, norm_rows, norm_stats, norms_per_layer_norm, param_objects,
                   shapes, wgrad)

INDEXER = "self_attention.core_attention.indexer."


def latent_norms(L: Layout) -> bool:
    """Whether the q and kv latents have norms: --qk-layernorm in the GPT spec; never in a hybrid model's 'D' layer
    (hybrid_layer_specs.py dsa_layer: q_layernorm and kv_layernorm IdentityOp)."""
    return L.qk_layernorm and not L.hybrid_layer_pattern


def computes_topk(L: Layout) -> bool:
    """Whether the layer runs its own indexer: not a layer that reuses an earlier layer's top-k under
    --dsa-indexer-topk-freq > 1 (DSAttention.skip_topk builds no indexer, dsa.py 0.19.2)."""
    return not L.dsa_skip_topk


def indexer_loss(L: Layout) -> bool:
    """Whether the layer trains its indexer on the KL loss: a coefficient > 0 and an indexer of its own
    (DSAttention.forward: use_indexer_loss needs computes_topk)."""
    return L.dsa_indexer_loss_coeff > 0 and computes_topk(L)


# --dsa-kernel-backend tilelang (megatron-core 0.19.2 ops/tilelang_dsa.py): fused_sparse_mla_absorbed runs its SparseMLA
# kernels only for DeepSeek-V3.2's absorbed dims (query and key [..., 576], 512 value channels), bf16, a power-of-two
# number of heads of at least 16 after padding the rank's heads to 16, and a top-k that is a multiple of 64; else it
# returns None and DSAttention takes the PyTorch path. The fused indexer runs on bf16 q and k in blocks of query rows
# (DSAttention's fused_indexer_block_size, 8192 unless set).
TILELANG_DIMS = (512, 64)
TILELANG_MIN_HEADS = 16
TILELANG_INDEXER_BLOCK = 8192


def tilelang_heads(a_t: int) -> int:
    """The heads SparseMLA runs: the rank's, padded to at least 16 (fused_sparse_mla_absorbed)."""
    return max(a_t, TILELANG_MIN_HEADS)


def tilelang_sparse(L: Layout, a_t: int, topk: int) -> bool:
    """Whether the TileLang SparseMLA kernels run the sparse attention (else the PyTorch path)."""
    hp = tilelang_heads(a_t)
    return (L.dsa_kernel_backend == "tilelang" and L.bf16 and (L.kv_lora_rank, L.qk_pos_emb_head_dim) == TILELANG_DIMS
            and hp & (hp - 1) == 0 and topk % 64 == 0)


def _qr_width(L: Layout) -> int:
    """The indexer query's input width: q_lora_rank, or the hidden size without a query latent (DSAIndexer)."""
    return L.q_lora_rank if L.q_lora_rank is not None else L.hidden_size


def linear_shapes(L: Layout) -> dict[str, tuple[int, int]]:
    """[out, in] per TP rank: MLA's projections and the indexer's, which are duplicated (whole on every TP rank)."""
    sh = mla.linear_shapes(L)
    if not computes_topk(L):
        return sh
    nh, hd = L.dsa_indexer_n_heads, L.dsa_indexer_head_dim
    sh["indexer_linear_wq_b"] = (nh * hd, _qr_width(L))
    sh["indexer_linear_wk"] = (hd, L.hidden_size)
    sh["indexer_linear_weights_proj"] = (nh, L.hidden_size)
    return sh


def param_rows(L: Layout) -> list[ParamRow]:
    """Registration order of AbsorbedMLASelfAttention: the input norm (a separate TENorm, as for MLA), the core
    attention's indexer (built before linear_proj), linear_proj, the q and kv projections, then the latent norms
    q_layernorm / kv_layernorm (modules of their own with --qk-layernorm, IdentityOp without). The indexer: wq_b
    [heads x head dim, q_lora], wk [head dim, h], k_norm (a LayerNorm whatever --normalization: DSAIndexer sets it),
    weights_proj [heads, h]; all duplicated over TP (parallel_mode 'duplicated', gradients averaged over TP)."""
    sh = linear_shapes(L)
    rows = norm_rows("input_layernorm", L.hidden_size, L)
    if computes_topk(L):           # (a layer reusing a top-k builds no indexer)
        for name in ("linear_wq_b", "linear_wk"):
            out, inp = sh["indexer_" + name]
            rows.append((INDEXER + name + ".weight", out * inp, True, False, False, inp))
        hd = L.dsa_indexer_head_dim
        rows += [(INDEXER + "k_norm.weight", hd, True, False, False, 0),
                 (INDEXER + "k_norm.bias", hd, True, False, False, 0)]
        out, inp = sh["indexer_linear_weights_proj"]
        rows.append((INDEXER + "linear_weights_proj.weight", out * inp, True, False, False, inp))
    out, inp = sh["linear_proj"]
    rows.append(("self_attention.linear_proj.weight", out * inp, False, False, False, inp))
    for name in ("linear_q_proj", "linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj"):
        if name in sh:
            out, inp = sh[name]
            rows.append((f"self_attention.{name}.weight", out * inp, name.endswith("down_proj"), False, False, inp))
    if latent_norms(L):
        if L.q_lora_rank is not None:
            rows += norm_rows("self_attention.q_layernorm", L.q_lora_rank, L)
        rows += norm_rows("self_attention.kv_layernorm", L.kv_lora_rank, L)
    return rows


def params(L: Layout, prefix: str = "") -> list[Param]:
    return param_objects(param_rows(L), prefix)


def kvl_q(L: Layout) -> int:
    """The latent norms' width: kv_lora_rank and q_lora_rank (MLA's param_count counts them with --qk-layernorm)."""
    return L.kv_lora_rank + (L.q_lora_rank or 0)


def indexer_param_count(L: Layout) -> int:
    """Parameters of one layer's lightning indexer: wq_b, wk, k_norm (weight and bias), weights_proj (none in a layer
    reusing another's top-k)."""
    if not computes_topk(L):
        return 0
    nh, hd, h = L.dsa_indexer_n_heads, L.dsa_indexer_head_dim, L.hidden_size
    return nh * hd * _qr_width(L) + hd * h + 2 * hd + nh * h


def param_count(L: Layout) -> int:
    """Parameters of one layer's DSA attention in the whole model: MLA's (the same projections and norms; DSA
    takes no linear bias) and the indexer's."""
    n = mla.param_count(L) + indexer_param_count(L)
    if L.qk_layernorm and not latent_norms(L):
        n -= norms_per_layer_norm(L) * (kvl_q(L))
    return n


def core_items(s: int, b: int, a_t: int, kvl: int, pe: int, v: int, nh: int, hd: int, topk: int, e: int,
               loss: bool, recompute_core: bool, k_norm_fp32: bool = False,
               s_k: int | None = None, indexer: bool = True, tl_indexer: bool = False,
               tl_sparse: bool = False) -> tuple[dict[str, int], dict[str, int], int, int, int, int, int, int]:
    """DSAttention of one micro-batch on one TP rank (CP 1), PyTorch path, counted from megatron-core 0.19.2's
    dsa.py and dsa_masking.py and checked against the module on CPU (benchmarks/referee/dsa_probe.py).

    Returns (saved, locals, indexer working set, loss forward working set, sparse forward working set, sparse
    backward working set, sparse forward without autograd, the loss backward's indexer working set): ``saved`` what the core keeps for the backward (in creation order), ``locals`` the
    tensors DSAttention.forward holds without autograd until it returns (the indexer's outputs and top-k without
    the loss). Shapes: s query tokens, s_k key tokens (s, or the whole sequence gathered over CP: the allgather
    path), b micro-batch, a_t heads, D = kv_lora + rope the absorbed head dim, N = b a_t s s_k score elements,
    I = b s s_k index-score elements. ``indexer`` False: a layer reusing another's top-k (no indexer, no loss; the
    top-k it reads is the source layer's, counted by ``topk_holder_bytes``). ``tl_indexer`` / ``tl_sparse``: the TileLang
    indexer top-k (without the loss) and SparseMLA kernels (--dsa-kernel-backend tilelang, ``tilelang_sparse``)."""
    s_k = s if s_k is None else s_k
    if not indexer:
        nh = hd = topk = 0
        loss = False
    Tf, D = s * b, kvl + pe
    N, I = b * a_t * s * s_k, b * s * s_k
    saved: dict[str, int] = {}
    held: dict[str, int] = {}
    # the indexer (forward_before_topk): q [s b, heads, head dim] after its rope, k [s b, head dim] after k_norm and
    # rope, weights [s b, heads]; with the loss they are made with autograd and the loss function keeps them, with
    # k_norm's input and statistics and the rope's cos/sin cast to bf16 (for q and for k)
    # (under CP the indexer's k is gathered over the CP ranks and put in sequence order: [s_k b, head dim])
    idx = (Tf * (nh * hd + nh) + b * s_k * hd) * e
    tl_indexer = tl_indexer and indexer and not loss
    topk_b = b * s * topk * (4 if tl_indexer else 8)   # int64 [b, s, topk] (the TileLang indexer's: int32)
    if loss and not recompute_core:
        # k_norm's input: the wk output, or its fp32 copy with --dsa-indexer-k-norm-fp32
        saved["indexer_qkw"] = idx + Tf * hd * (4 if k_norm_fp32 else e) + Tf * 8 + 4 * s * pe * e
        saved["indexer_topk"] = topk_b
        # the loss function keeps the (detached) query; the latent key it keeps is the one the value view keeps
        saved["dsa_query"] = Tf * a_t * D * e
    elif indexer:
        # (a checkpointed core's forward runs without autograd: DSAttention computes no indexer loss there, its
        # replay does)
        held["indexer_qkw"] = idx
        held["indexer_topk"] = topk_b
    # the indexer's scores (_compute_index_scores, fp32): the einsum of q and k cast to fp32 into X = [s, b, heads, s],
    # then its ReLU and the head weighting, each a new X while the previous one lives (2 X); topk's outputs are small
    X = 4 * b * nh * s * s_k
    indexer_ws = max(2 * X, X + 4 * hd * (Tf * nh + b * s_k)) + b * s * topk * (4 + 8) if indexer else 0
    if tl_indexer:
        # fused_qk_topk_lighting (ops/tilelang_dsa.py): per batch element the weights in fp32 [s, heads] (q and k made
        # contiguous for b > 1), per block of query rows the fp32 logits [rows, s_k] (indexer_fwd_interface) and
        # torch.topk's fp32 scores and int64 indices [rows, top-k], cast to int32 into the [b, s, top-k] output
        rows = min(s, TILELANG_INDEXER_BLOCK)
        indexer_ws = (4 * s * nh + ((s * nh + s_k) * hd * e if b > 1 else 0) + 4 * rows * s_k + 16 * rows * topk
                      + (topk_b if tl_sparse else 0))
    # the loss backward (bwd_fused_indexer_loss_naive) remakes the scores [s, b, heads, s] for the gradients: scores
    # with ReLU, its bool mask, the weighted product, the score gradient and the mask cast to fp32 (3.25 X); then
    # the gradients of q and k (einsums): the score gradient and its permuted copy (2 X), q in fp32, its permuted
    # copy and q's fp32 gradient [s b, heads, head dim]; beside the [b, s, s] gradients of the index logits
    loss_bwd_indexer = max(13 * X // 4, 2 * X + 12 * Tf * nh * hd) + 8 * I if loss else 0
    # the loss forward (compute_dsa_indexer_loss): the fp32 index scores [b, s, s] (masked), the top-k mask, the
    # validity masks, and the [b, a_t, s, s] fp32 attention scores through masked_softmax (scores, masked logits,
    # the shifted logits and their exp alive at once, with the bool mask): 17 N
    loss_ws = 17 * N + 14 * I if loss else 0
    if recompute_core:
        # tensor_parallel.checkpoint keeps the core's inputs (query, key, x, qr); the query is otherwise dropped
        saved["dsa_query"] = Tf * a_t * D * e
    elif tl_sparse:
        return _tilelang_core(saved, held, s, b, a_t, kvl, D, topk, e, loss, s_k, v, indexer_ws, loss_ws,
                              loss_bwd_indexer, topk_b if tl_indexer else 0)
    else:
        # _unfused_absorbed_dsa_fn: matmul keeps q.float() [b, a_t, s, D] and k.float() [b, 1, D, s]; masked_softmax
        # keeps its exp and its division's input (fp32) and three ~valid_mask bool tensors, with small row
        # statistics (any, max indices, sums); the value matmul keeps the probabilities cast to bf16; V's up
        # projection (einsum) keeps the core's contiguous latent output [s, b, a_t, kv_lora]
        # torch.matmul folds the broadcast [b, 1, ...] key (and value) into a view for b = 1, and copies it over the
        # heads for b > 1 (its expand + reshape): the copy is what the bmm keeps
        saved["dsa_qk_fp32"] = 4 * Tf * a_t * D + 4 * D * s_k * (b * a_t if b > 1 else 1)
        saved["dsa_masks"] = 3 * N
        saved["dsa_softmax_fp32"] = 8 * N + b * a_t * s * (1 + 8 + 4 + 4)
        saved["dsa_probs"] = N * e
        if b > 1:
            saved["dsa_value_copy"] = b * a_t * s_k * kvl * e
        saved["dsa_latent_output"] = Tf * a_t * kvl * e
        # DSAttention.forward makes the V up-projection weight (a strided view of linear_kv_up_proj's) contiguous:
        # a copy [a_t, v, kv_lora] per micro-batch, kept by the einsum
        saved["dsa_v_up_weight"] = a_t * v * kvl * e
    # at the masked softmax's last step: the scores plus mask, the masked logits, the division's output and its
    # masked copy (fp32, 16 N), the top-k index mask [b, s, s] fp32 and its validity (bool)
    sparse_fwd = 16 * N + 5 * I
    # its backward: five fp32 [b, a_t, s, s] gradients of the softmax chain at once, less the bool mask and the bf16
    # probabilities already freed (released names), the key's gradient through the value slice
    sparse_bwd = 19 * N + b * s_k * D * e
    # without autograd (the checkpointed core's forward), at masked_softmax's last masked_fill: the scores, the
    # masked logits, the probabilities and their masked copy (fp32) with one bool mask, the index mask and its
    # validity, the row statistics (row_has_valid, bool, and row_max, fp32), DSAttention's contiguous V up-weight
    # copy and the query rows' int64 positions and bounds (3 [s]); the fp32 q and k are freed after the score matmul
    nograd_fwd = 17 * N + 5 * I + 5 * b * a_t * s + a_t * v * kvl * e + 24 * s
    return saved, held, indexer_ws, loss_ws, sparse_fwd, sparse_bwd, nograd_fwd, loss_bwd_indexer


def _tilelang_core(saved: dict[str, int], held: dict[str, int], s: int, b: int, a_t: int, kvl: int, D: int, topk: int,
                   e: int, loss: bool, s_k: int, v: int, indexer_ws: int, loss_ws: int, loss_bwd_indexer: int,
                   topk_int32: int) -> tuple:
    """The sparse attention through TileLang's SparseMLA (ops/tilelang_dsa.py fused_sparse_mla_absorbed, ops/sparse_mla.py,
    ops/tilelang_sparse_mla_fwd.py / _bwd.py, 0.19.2; sequence a multiple of the kernels' 256-row bucket, top-k of 64:
    no padded copies). Its autograd function keeps q, kv, the int32 indices and the valid-head mask, not its output or
    log-sum-exp (remade in the backward): no dense score tensor. Hp = the rank's heads padded to 16.

    * q: the query permuted to [b, s, Hp, D] and made contiguous: the absorbed query itself for b = 1 without head
      padding (``dsa_query``, which the indexer loss keeps too), else a copy (``dsa_tl_query``);
    * kv: the key, a view for b = 1, a contiguous copy for b > 1 of the same size (``dsa_key``; the original then lives
      through the forward);
    * indices: the TileLang indexer's int32 top-k itself, or an int32 copy of the indexer loss's int64 one
      (``dsa_tl_indices``); the valid-head mask, bool [b, s, Hp] (``dsa_tl_valid_heads``).

    Forward: the kernel's bf16 output [b, s, Hp, 512] and fp32 log-sum-exp, and their masked copies (torch.where).
    Backward: the output gradient and its masked copy, the remade log-sum-exp and delta (fp32), the key gradient
    accumulated in fp32 [b, s_k, 1, D] and cast to bf16, the query gradient [b, s, Hp, D]."""
    hp = tilelang_heads(a_t)
    Tf = s * b
    if b > 1 or hp != a_t:
        saved["dsa_tl_query"] = b * s * hp * D * e
    elif not loss:
        saved["dsa_query"] = Tf * a_t * D * e
    if loss:
        saved["dsa_tl_indices"] = 4 * b * s * topk
    else:
        saved["dsa_tl_indices"] = topk_int32
        held.pop("indexer_topk", None)
    saved["dsa_tl_valid_heads"] = b * s * hp
    saved["dsa_latent_output"] = Tf * a_t * kvl * e
    saved["dsa_v_up_weight"] = a_t * v * kvl * e
    out = b * s * hp * kvl * e
    sparse_fwd = 2 * out + 8 * b * s * hp + (b * s_k * D * e if b > 1 else 0)
    sparse_bwd = 2 * out + 8 * b * s * hp + 4 * b * s_k * D + b * s * hp * D * e + b * s_k * D * e
    return saved, held, indexer_ws, loss_ws, sparse_fwd, sparse_bwd, 0, loss_bwd_indexer


@lru_cache(maxsize=256)
def layer_items(L: Layout, recompute_core: bool) -> tuple:
    x = shapes(L)
    loss = indexer_loss(L)
    # fused_qk_topk_naive (dsa.py, 0.19.2) takes min(index_topk, key length) indices: a top-k above the sequence
    # (CP 1: the key is the whole sequence) keeps [b, s, s], not [b, s, topk]
    # under CP (the allgather path) the key is the whole sequence, gathered over the CP ranks
    s_k = x.s * L.cp
    topk = min(L.dsa_indexer_topk, s_k)
    tl = L.dsa_kernel_backend == "tilelang" and L.bf16
    return core_items(x.s, x.b, x.a_t, L.kv_lora_rank, L.qk_pos_emb_head_dim, L.v_head_dim, L.dsa_indexer_n_heads,
                      L.dsa_indexer_head_dim, topk, x.e, loss, recompute_core, L.dsa_indexer_k_norm_fp32, s_k,
                      computes_topk(L), tl, tilelang_sparse(L, x.a_t, topk))


CORE_NAMES = frozenset({"dsa_qk_fp32", "dsa_masks", "dsa_softmax_fp32", "dsa_probs", "dsa_value_copy", "dsa_latent_output",
                        "dsa_v_up_weight", "dsa_tl_query", "dsa_tl_indices", "dsa_tl_valid_heads"})
# made at the value matmul and V's up projection, after the masked softmax; the first freed by the backward
LATE = frozenset({"dsa_probs", "dsa_value_copy", "dsa_latent_output", "dsa_v_up_weight"})
# made after the masked softmax (the V up-weight copy is made when DSAttention.forward starts)
AFTER_SOFTMAX = LATE - {"dsa_v_up_weight"}
LOSS_NAMES = frozenset({"indexer_qkw", "indexer_topk", "dsa_query", "indexer_inputs"})


def reads_batch_mask(L: Layout) -> bool:
    """DSAttention builds its causal bounds itself (attn_mask_type causal): the batch's mask is not read."""
    return False


def activations(L: Layout, mods: set, has_batch_mask: bool, drop_norm: bool, after: frozenset,
                released: frozenset, G: int) -> MixerActivations:
    """The input norm, the absorbed MLA's projections, DSAttention (indexer, indexer loss, sparse attention), V's up
    projection and linear_proj's input (arguments as for ``attention.activations``)."""
    x = shapes(L)
    T, Tf, h, e, a_t = x.T, x.Tf, x.h, x.e, x.a_t
    ql, kvl, pe = L.q_lora_rank, L.kv_lora_rank, L.qk_pos_emb_head_dim
    D = kvl + pe
    recompute_core = "core_attn" in mods
    loss = indexer_loss(L)
    sp = L.sequence_parallel and L.tp > 1
    drop_norm1 = drop_norm or "layernorm" in mods
    saved: dict[str, int] = {}
    if not drop_norm1:
        saved["norm1_stats"] = norm_stats(L, T)
        saved["qkv_input"] = T * h * e                       # norm output, kept by the down projections
    stats = 4 * (2 if L.normalization == "LayerNorm" else 1)
    if latent_norms(L):
        # q_layernorm / kv_layernorm are TENorms of their own: each keeps its input (the kv one a view of the kv down
        # projection's [T, kv_lora + rope] output) and statistics
        saved["latent_norms"] = T * ((ql or 0) + kvl + pe) * e + (2 if ql else 1) * T * stats
    if ql:
        saved["q_latent"] = T * ql * e                       # q_up_proj's input (the normalised latent)
    # the q up projection's output [s b, a_t, qk + rope]: the einsum folding K's up projection into the query keeps
    # its q_no_pe view
    saved["query_up"] = Tf * a_t * (L.qk_head_dim + pe) * e
    if not L.apply_rope_fusion:
        # the unfused rope (DSA forbids rope fusion; a hybrid 'D' layer may fuse it): cos, sin cast for q and for k.
        # The fused path (absorbed_mla.py 556-597) concatenates the absorbed query and the key with their rope parts
        # and rotates them in place (fused_mla_yarn_rope_apply.py ApplyMLARotaryEmbQ: saves the cached cos / sin)
        saved["rope_cos_sin"] = 4 * x.s * pe * e
    # the latent key [s b, 1, kv_lora + rope]: the value is its first kv_lora channels, kept by the value matmul
    # (under CP the value matmul keeps the key gathered over the CP ranks, [s_k b, 1, D], for b = 1; for b > 1 it
    # keeps its copy over the heads, dsa_value_copy, and without the indexer loss (which keeps the key too) the
    # gathered key lives through the core's forward only; the local key lives through the core's forward too)
    gathered_key_kept = not (L.cp > 1 and x.b > 1 and not loss)
    # the gathered key and the int64 sequence order of it [s_k] its index_select keeps (CP only)
    cp_gathered = (Tf * L.cp * D * e if gathered_key_kept else 0) + 8 * x.s * L.cp if L.cp > 1 else 0
    if recompute_core:
        # tensor_parallel.checkpoint keeps the core's inputs: the rank's own key; the gather over CP and the
        # index_select run inside the core (without autograd in its forward: the gathered key and order are transient)
        saved["dsa_key"] = Tf * D * e
        cp_live = Tf * L.cp * D * e + 8 * x.s * L.cp if L.cp > 1 else 0
    else:
        if gathered_key_kept:
            saved["dsa_key"] = Tf * L.cp * D * e
        if L.cp > 1:
            saved["dsa_cp_key_order"] = 8 * x.s * L.cp
        # the rank's own key, and the gathered one when nothing keeps it, alive through the core's forward
        cp_live = Tf * D * e + (0 if gathered_key_kept else Tf * L.cp * D * e) if L.cp > 1 else 0
    core_saved, held, indexer_ws, loss_ws, sparse_fwd, sparse_bwd, nograd_fwd, loss_bwd_ix = layer_items(L, recompute_core)
    # the indexer's inputs gathered over TP under sequence parallelism (x [s b, h] and qr [s b, q_lora]): kept by
    # its linears when the loss trains it, else freed after the indexer's forward
    gathered = Tf * (h + _qr_width(L)) * e if sp and computes_topk(L) else 0
    if gathered and loss and not recompute_core:
        saved["indexer_inputs"] = gathered
    saved.update(core_saved)
    ctx_w = a_t * L.v_head_dim
    saved["proj_input"] = Tf * ctx_w * e                     # V up projection's output, kept by linear_proj
    after_attn = after | {"proj_input"}
    held_b = sum(held.values())
    query_b = Tf * a_t * D * e                                # the absorbed query (alive through the core's forward)
    # --recompute-modules mla_up_proj: the query and key are made under CheckpointWithoutOutput and freed after the
    # core (up_proj_checkpoint); remade before V's up projection's backward, they live until the checkpoint's backward
    # (the saved key is the checkpoint's output at CP 1 or when a checkpointed core keeps it; else the gathered one)
    local_key = "dsa_key" in saved and (L.cp == 1 or recompute_core)
    remade, key_live, up_fwd = up_proj_checkpoint(L, saved, local_key) if "mla_up_proj" in mods else (0, 0, 0)
    query_live = 0 if "dsa_query" in saved else query_b
    core_names = CORE_NAMES | LOSS_NAMES
    query_live += key_live + cp_live
    fwd_steps: tuple[Step, ...] = (
        # the absorbed query being made: the einsum's output [a_t, s b, kv_lora] and its contiguous copy
        (after_attn | core_names, 2 * Tf * a_t * kvl * e + Tf * a_t * pe * e + up_fwd),
        # the indexer's scores and top-k (the gathered inputs, its q, k, weights alive)
        (after_attn | (core_names - {"indexer_qkw", "dsa_query", "indexer_inputs"}),
         query_live + (0 if loss and not recompute_core else gathered) + held_b + indexer_ws),
    )
    if recompute_core:
        # the checkpointed core's forward runs without autograd: its tensors are transient
        fwd_steps += ((after_attn, query_live + held_b + nograd_fwd),)
    else:
        if loss:
            fwd_steps += ((after_attn | CORE_NAMES, loss_ws),)
        fwd_steps += ((after_attn | AFTER_SOFTMAX, query_live + held_b + sparse_fwd),)
    rel_proj = released | {"proj_input"}
    renorm = 2 * T * h * e + norm_stats(L, T) if drop_norm1 else 0
    bwd_steps: tuple[Step, ...] = (
        (released, G + Tf * ctx_w * e + wgrad(L, h, ctx_w) + renorm),                   # linear_proj
    )
    if remade:
        # the checkpoint's replay, run by the hook on linear_proj's input gradient: the forward's first step again
        # beside that gradient, with the query and key it makes
        bwd_steps += ((rel_proj, G + Tf * ctx_w * e + renorm + remade + 2 * Tf * a_t * kvl * e + Tf * a_t * pe * e),)
    if recompute_core:
        bwd_steps += core_replay_steps(L, rel_proj, G + renorm + remade, gathered if loss else 0,
                                       cp_gathered, gathered)
    else:
        bwd_steps += (
            (rel_proj, G + Tf * a_t * kvl * e + renorm + remade),                       # V's up projection
            (rel_proj | LATE, G + sparse_bwd + renorm + remade),                        # sparse attention
        )
    rel_core = rel_proj | CORE_NAMES
    if loss and not recompute_core:
        # FusedDSAIndexerLoss.backward (after the sparse attention's: made earlier, it runs later): the index
        # scores again, then the attention scores' softmax as in its forward
        bwd_steps += ((rel_core, G + max(loss_bwd_ix, loss_ws) + remade),)
    rel_all = rel_core | LOSS_NAMES
    # the absorbed query's and the key's gradients, the q up projection's and the latents'
    qh = L.qk_head_dim + pe
    up = Tf * a_t * D * e + Tf * D * e + Tf * a_t * qh * e + Tf * (kvl + pe) * e
    up_names = {"query_up", "rope_cos_sin", "dsa_key", "q_latent", "latent_norms", "up_checkpoint_inputs",
                "dsa_k_up_weight"}
    bwd_steps += (
        (rel_all, G + up + renorm + remade + wgrad(L, a_t * qh, ql or h)
         + wgrad(L, a_t * (L.qk_head_dim + L.v_head_dim), kvl)),
        (rel_all | up_names,
         G + T * ((ql or 0) + kvl + pe) * e + 2 * T * h * e + renorm + wgrad(L, kvl + pe, h)
         + (wgrad(L, ql, h) if ql else 0)),                                             # down projections
        (rel_all | up_names | {"qkv_input"}, G + 2 * T * h * e + renorm // 2),          # input norm
    )
    return MixerActivations(saved=saved, fwd_steps=fwd_steps, bwd_steps=bwd_steps)


def core_replay_steps(L: Layout, names: frozenset, base: int, indexer_inputs: int, cp_gathered: int,
                      gathered: int) -> tuple[Step, ...]:
    """``--recompute-modules core_attn``: the backward of tensor_parallel.checkpoint around DSAttention
    (CheckpointFunction.backward, random.py 0.19.2). It replays the core with autograd (the indexer loss too) beside
    linear_proj's input gradient (its argument, alive throughout), then runs the replay's backward holding the
    replay's output: the steps of the core's forward and backward (``activations``) over the checkpoint's inputs,
    which ``base`` (the bytes above the kept tensors) does not count again. The replay keeps what the core keeps
    without the checkpoint (``core_items``) less the query (the indexer loss's detached query is the input's
    storage), with the indexer's TP-gathered inputs under the loss (``indexer_inputs``) and, under CP, the gathered
    key and its order (``cp_gathered``); ``gathered`` are the indexer's TP-gathered inputs alive in its forward."""
    x = shapes(L)
    Tf, e = x.Tf, x.e
    loss = indexer_loss(L)
    full, held, indexer_ws, loss_ws, sparse_fwd, sparse_bwd, _, loss_bwd_ix = layer_items(L, False)
    rep = {k: v for k, v in full.items() if k != "dsa_query"}
    held_b = sum(held.values())
    idx = rep.get("indexer_qkw", 0) + indexer_inputs
    late = sum(rep.get(k, 0) for k in LATE)
    after_softmax = sum(rep.get(k, 0) for k in AFTER_SOFTMAX)
    total = sum(rep.values()) + indexer_inputs + cp_gathered
    grad_in = Tf * x.a_t * L.v_head_dim * e       # linear_proj's input gradient, the checkpoint's argument
    out = grad_in                                  # the replay's output, held through the replay's backward
    b0 = base + grad_in + cp_gathered
    steps: tuple[Step, ...] = (
        # the replay's forward: the indexer, the indexer loss, the masked softmax (as ``activations``' forward)
        (names, b0 + (0 if loss else gathered) + held_b + idx + indexer_ws),
    )
    if loss:
        steps += ((names, b0 + idx + rep.get("indexer_topk", 0) + loss_ws),)
    steps += (
        (names, b0 + total - cp_gathered - after_softmax + held_b + sparse_fwd),
        # the replay's backward: V's up projection, the sparse attention, the indexer loss
        (names, base + grad_in + out + total + Tf * x.a_t * L.kv_lora_rank * e),
        (names, base + grad_in + out + total - late + sparse_bwd),
    )
    if loss:
        steps += ((names, base + grad_in + out + idx + rep.get("indexer_topk", 0) + cp_gathered
                   + max(loss_bwd_ix, loss_ws)),)
    return steps


def up_proj_checkpoint(L: Layout, saved: dict[str, int], local_key_saved: bool = True) -> tuple[int, int, int]:
    """``--recompute-modules mla_up_proj`` (megatron-core 0.19.2 absorbed_mla.py: qkv_up_proj_and_rope_apply under
    tensor_parallel.CheckpointWithoutOutput, its outputs' storage freed after V's up projection and shared with the
    replay's outputs, random.py ``share_storage``: the remade tensors exist once). Changes ``saved`` in place: the up
    projection's output, the rope tables and the latent key (and the query the indexer loss or a checkpointed core
    keeps) go; the checkpoint keeps its inputs instead (``up_checkpoint_inputs``): the kv latent and the key's rope
    part, gathered over TP under sequence parallelism, else the kv down projection's output (views of it; with
    --qk-layernorm its kv part is the norm's new output, the rest kept by the norm already). The q latent it keeps is
    q_up_proj's input, counted already. Returns (the bytes the replay makes again, alive from it to the checkpoint's
    backward; the key, alive through the core's forward; the up projection's output and rope tables, alive while the
    query is made)."""
    x = shapes(L)
    Tf, e, a_t, kvl, pe = x.Tf, x.e, x.a_t, L.kv_lora_rank, L.qk_pos_emb_head_dim
    query = saved.pop("dsa_query", 0) or Tf * a_t * (kvl + pe) * e
    graph = saved.pop("query_up") + saved.pop("rope_cos_sin", 0)
    key = Tf * (kvl + pe) * e
    # under CP the key the value matmul (or the indexer loss) keeps is the one gathered over CP inside DSAttention,
    # not the checkpoint's output: it stays; the local key (the output, freed and remade) lives through the core's
    # forward as without the checkpoint, counted there
    key_live = key if local_key_saved else 0
    if local_key_saved:
        saved.pop("dsa_key")
    if L.sequence_parallel and L.tp > 1:
        saved["up_checkpoint_inputs"] = Tf * (kvl + pe) * e
    else:
        saved["up_checkpoint_inputs"] = x.T * (kvl if latent_norms(L) else kvl + pe) * e
    return graph + query + key, key_live, graph


def bound_saved(L: Layout, tp: int, b: int, seq: int, sp: bool, mods: set) -> int:
    """Bytes one layer's DSA attention surely keeps per micro-batch (the planner's lower bound): the input norm's
    output, the latent key, and (core_attn not recomputed) the dense score-sized tensors of the PyTorch path:
    three bool masks, two fp32 softmax tensors and the bf16 probabilities, 11 + e bytes per score."""
    e, h = L.act_bytes, L.hidden_size
    a_t = L.num_attention_heads // tp
    kept = 0 if "layernorm" in mods else (b * seq // tp if sp else b * seq) * h * e
    kept += b * seq * (L.kv_lora_rank + L.qk_pos_emb_head_dim) * e
    if "core_attn" not in mods and not tilelang_sparse(L, a_t, min(L.dsa_indexer_topk, seq)):
        kept += b * a_t * seq * seq * (11 + e)
    return kept


def qkv_gemms(L: Layout, tp: int, M: int, tok: int) -> list[tuple[int, int, int]]:
    """MLA's projections and the indexer's (whole on every TP rank, on all M tokens under SP)."""
    nh, hd = L.dsa_indexer_n_heads, L.dsa_indexer_head_dim
    return mla.qkv_gemms(L, tp, M, tok) + [(M, nh * hd, _qr_width(L)), (M, hd, L.hidden_size), (M, nh, L.hidden_size)]


def rope_elements(L: Layout, tp: int, M: int) -> int:
    """MLA's rope elements and the indexer's (its q heads and its one key, over the rope part)."""
    return mla.rope_elements(L, tp, M) + M * (L.dsa_indexer_n_heads + 1) * L.qk_pos_emb_head_dim


def rotary_cache(L: Layout, layers: int, shared: int = 0) -> tuple[int, str] | None:
    """The attention's rotary embedding and the indexer's own (DSAIndexer builds one like the attention's): two per
    layer, MLA's tables and buffers (mla.mla_rotary_bytes) for twice the layers; one in each of the ``shared`` layers
    that reuse another's top-k (no indexer)."""
    if not layers + shared:
        return None
    more = f" and {shared} reusing a top-k" if shared else ""
    detail = f"{L.rope_type} rotary tables of {layers} DSA layer(s) and their indexers{more}"
    if L.apply_rope_fusion:
        # (a hybrid 'D' layer; fusion needs yarn) AbsorbedMLA's fused path asks its embedding only for
        # get_cached_cos_sin (absorbed_mla.py 428-437): its yarn cos / sin remade for s/CP positions in the activation
        # dtype, no forward table; the indexer's embedding runs its forward (the lru table) and keeps the buffers
        # made at init (mla.mla_rotary_bytes)
        s, pe = L.seq_length // L.cp, L.qk_pos_emb_head_dim
        attention = (layers + shared) * 2 * s * pe * L.act_bytes
        indexers = (min(layers, mla.ROTARY_LRU_ENTRIES) * s * pe * 4
                    + layers * 2 * (mla.MLA_YARN_ORIGINAL_MAX_POSITIONS // L.cp) * pe * L.param_bytes)
        return attention + indexers, detail + " (fused rope)"
    return mla.mla_rotary_bytes(L, 2 * layers + shared), detail


def topk_holder_bytes(L: Layout, layers: int) -> int:
    """Under top-k sharing (--dsa-indexer-topk-freq > 1) every computing layer puts its int64 top-k [b, s/CP,
    min(top-k, s)] in a dict its forward hands to the later layers (DSAttention._get_index_share_topk_holder, dsa.py
    0.19.2), keyed by layer: ``layers`` such entries. The dict hangs on the forward's attention mask (the batch's,
    dropped when the micro-batch's forward step returns) or, without one, on the TransformerConfig, where each layer's
    latest entry stays until the next forward overwrites it."""
    x = shapes(L)
    return 8 * x.b * x.s * min(L.dsa_indexer_topk, x.s * L.cp) * layers


def head_dims(L: Layout) -> tuple[int, int]:
    return mla.head_dims(L)
