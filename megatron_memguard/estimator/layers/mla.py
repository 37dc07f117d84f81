"""Multi-latent attention (DeepSeek-V2 style; megatron-core MLASelfAttention with the TE spec).

Recipe of the token mixer ``mla`` (see ``base``). The down projections are TE Linears in
"duplicated" mode, whole on every TP rank; the up projections and linear_proj are split like
column/row-parallel layers. The input norm is a TENorm of its own (both down projections read it).
"""
from __future__ import annotations

from functools import lru_cache

from ...layout import Layout
from .attention import (attention_kind, flash_attention_bwd, fused_attention_bwd, te_softmax_kernel,
                        te_torch_softmax_mask)
from .base import (MixerActivations, Param, ParamRow, Shapes, Step, norm_rows, norm_stats, norms_per_layer_norm,
                   param_objects, shapes, wgrad)


def linear_shapes(L: Layout) -> dict[str, tuple[int, int]]:
    """[out, in] per TP rank of multi-latent attention's projections."""
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


def param_rows(L: Layout) -> list[ParamRow]:
    """Registration order: input_layernorm (a separate TENorm: both down projections read its
    output), linear_proj (built by the MultiLatentAttention base), then the q and kv projections.
    With --qk-layernorm the up projections are TE LayerNormLinears holding the latent norms.
    Rows as base.ParamRow."""
    sh = linear_shapes(L)
    rows = norm_rows("input_layernorm", L.hidden_size, L)
    out, inp = sh["linear_proj"]
    rows.append(("self_attention.linear_proj.weight", out * inp, False, False, False, inp))
    if L.add_bias_linear:
        rows.append(("self_attention.linear_proj.bias", out, True, False, False, 0))
    for name in _PROJECTIONS:
        if name not in sh:
            continue
        out, inp = sh[name]
        if L.qk_layernorm and name.endswith("_up_proj"):
            rows += norm_rows(f"self_attention.{name}.layer_norm", inp, L)
        rows.append((_WEIGHT[name], out * inp, name.endswith("down_proj"), False, False, inp))
    return rows


_PROJECTIONS = ("linear_q_proj", "linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj")
_WEIGHT = {name: f"self_attention.{name}.weight" for name in _PROJECTIONS}


def params(L: Layout, prefix: str = "") -> list[Param]:
    return param_objects(param_rows(L), prefix)


def param_count(L: Layout) -> int:
    """Parameters of one layer's multi-latent attention in the whole model."""
    h, a = L.hidden_size, L.num_attention_heads
    norm = norms_per_layer_norm(L)
    qh, kv = L.qk_head_dim + L.qk_pos_emb_head_dim, L.kv_lora_rank
    n = norm * h + a * L.v_head_dim * h + (L.qk_pos_emb_head_dim + kv) * h + a * (L.qk_head_dim + L.v_head_dim) * kv
    n += a * qh * h if L.q_lora_rank is None else L.q_lora_rank * (h + a * qh)
    if L.add_bias_linear:
        n += h
    if L.qk_layernorm:
        n += norm * (kv + (L.q_lora_rank or 0))
    return n


def mla_attention_items(L: Layout, x: Shapes, recompute_core: bool,
                        recompute_up: bool) -> tuple[dict[str, int], int, int, bool, tuple[Step, ...]]:
    """Multi-latent attention (megatron-core MLASelfAttention, TE spec): saved bytes from the down
    projections to the core attention, the core's forward and backward working sets, whether s x s
    scores exist, and the backward steps of the up and down projections.

    The down projections (TE Linears, whole on every TP rank) keep the input norm's output; the up
    projections keep the latents [T, q_lora] and [T, kv_lora] (TE copies the kv slice of the down
    projection's output to contiguous memory); the core attention keeps query and key
    [s b, a/t, qk + rope dim] and value [s b, a/t, v] (new tensors: the rope'd concatenation, the
    fused kv rope kernel's outputs or a contiguous copy). With ``--recompute-modules mla_up_proj``
    megatron frees those three after the forward (CheckpointWithoutOutput) and remakes them just
    before the core attention's backward; the checkpoint keeps its inputs instead (the whole kv
    down-projection output through the slice, and the rope part gathered over TP under SP), and
    the remade tensors exist twice (copied back into the freed storage and kept by the checkpoint)
    until the core attention's backward is done."""
    kind = attention_kind(L)
    e, T, Tf, a_t = x.e, x.T, x.Tf, x.a_t
    qh = L.qk_head_dim + L.qk_pos_emb_head_dim
    pe, kvl, ql = L.qk_pos_emb_head_dim, L.kv_lora_rank, L.q_lora_rank
    q_b = Tf * a_t * qh * e
    v_b = Tf * a_t * L.v_head_dim * e
    kv_up = Tf * a_t * (L.qk_head_dim + L.v_head_dim) * e       # output of linear_kv_up_proj
    saved: dict[str, int] = {}
    if ql:
        saved["q_latent"] = T * ql * e
    if recompute_up:
        saved["kv_latent"] = T * (kvl + pe) * e
        if L.sequence_parallel and L.tp > 1:
            saved["k_rope_gathered"] = Tf * pe * e
    else:
        saved["kv_latent"] = T * kvl * e
    if L.qk_layernorm:
        # the up projections become LayerNormLinears: they keep the normalised latents and statistics
        stats = 4 * (2 if L.normalization == "LayerNorm" else 1)
        saved["latent_norms"] = T * ((ql or 0) + kvl) * e + (2 if ql else 1) * T * stats
    if not recompute_up:
        saved["query"] = q_b
        saved["key"] = q_b
        saved["value"] = v_b
    if not L.apply_rope_fusion:
        # unfused rope: cos and sin cast to the activation dtype, for q and for k
        saved["rope_cos_sin"] = 4 * x.s * pe * e
    scores = x.b * a_t * x.s * x.s
    if kind == "fused" and L.attention_backend == "flash" and not recompute_core and L.cp == 1:
        saved, core_fwd, core_bwd = _padded_flash_items(L, x, saved, q_b, v_b)
        unfused = False
    elif kind == "fused":
        stats = x.b * a_t * x.s * 4
        if not recompute_core:
            saved["softmax_stats"] = stats
        core_fwd = v_b                                          # the output being written
        # dO (v's head dim), dq, dk, dv (attention.fused_attention_bwd); with core_attn recomputed the checkpoint's
        # recomputed output and the replay's softmax statistics
        core_bwd = fused_attention_bwd(q_b, q_b, v_b, v_b, stats) + (v_b + stats if recompute_core else 0)
        unfused = False
    elif te_softmax_kernel(L, x):
        # TE's unfused attention with its fused softmax kernel (as for standard attention)
        probs = scores * e + (scores * (1 + e) if L.attention_dropout > 0 else 0)
        if not recompute_core:
            saved["attention_probs"] = probs
        core_fwd = 2 * scores * e
        core_bwd = 2 * scores * e + 2 * v_b + (2 * v_b if recompute_core else 0)   # as for standard attention
        unfused = True
    else:
        # TE's torch-softmax path (fp32 scores, s >= 16384, ...; attention.attention_items): fp32 probs, their cast
        # back to fp16/bf16 kept by the bmm (or the dropout's mask and output), and the [1, 1, s, s] mask kept by
        # masked_fill_ (MLA hands TE no batch mask)
        half = e != 4
        probs = scores * 4 + (scores * (1 + e) if L.attention_dropout > 0 else scores * e if half else 0)
        if not recompute_core:
            saved["attention_probs"] = probs
        mask = te_torch_softmax_mask(L, x, False)
        if not recompute_core:
            saved["causal_mask"] = mask                # made inside the core attention: a checkpoint drops it
        core_fwd = scores * e + (scores * 4 if half else 0) + x.s * x.s
        core_bwd = (scores * (2 * e + 8 if half else 4 * e) + 2 * v_b
                    + (2 * v_b + mask if recompute_core else 0))
        unfused = True
    remade = 2 * q_b + v_b if recompute_up else 0              # query, key and value made again
    core_bwd += 2 * remade
    rel_core = frozenset({"attention_probs", "softmax_stats", "causal_mask", "flash_qkv", "attention_output_bshd"})
    rel_up = rel_core | {"query", "key", "value", "rope_cos_sin"}
    rel_down = rel_up | {"q_latent", "kv_latent", "latent_norms", "k_rope_gathered"}
    latents = T * ((ql or 0) + kvl + pe) * e
    bwd_steps = (
        # rope and up projections: dq, dk, dv, the kv up projection's output gradient
        (rel_up, 2 * q_b + v_b + kv_up + remade + wgrad(L, a_t * qh, ql or x.h)
         + wgrad(L, a_t * (L.qk_head_dim + L.v_head_dim), kvl)),
        # down projections: the latents' gradients and the two gradients of the norm output
        (rel_down, latents + 2 * T * x.h * e + wgrad(L, kvl + pe, x.h) + (wgrad(L, ql, x.h) if ql else 0)),
    )
    return saved, core_fwd, core_bwd, unfused, bwd_steps



def _padded_flash_items(L: Layout, x: Shapes, saved: dict[str, int], q_b: int,
                        v_b: int) -> tuple[dict[str, int], int, int]:
    """flash-attn 2 on MLA (TE 2.20.2; TE 2.11 has none): DotProductAttention pads the smaller head dim to the larger,
    P (``_pad_qkv_head_dim``: ``F.pad`` of v, or of q and k), FlashAttention.forward (sbhd) copies q, k and v to
    contiguous [b, s, h, P] tensors, which flash-attn keeps for its backward with its [b, s, h, P] output and fp32
    log-sum-exp [b, a, s]; TE returns a ``transpose(0, 1).contiguous()`` copy [s, b, h P] of the output, which
    ``_trim_output`` slices back to v's head dim into a new [s, b, h v] tensor, linear_proj's input (``backends.py``,
    ``dot_product_attention.py``, TE 2.20.2). The rope'd query and key and the value copy megatron hands over are
    then kept by no one (``F.pad`` and the copies save nothing). Backward: the output gradient padded back to P
    (the slice's backward, a new [s, b, h P] tensor; the one handed in is freed with that node) or handed in as is,
    then flash_attention_bwd at P (no copy: flash-attn gets a transposed view with last stride 1)."""
    from ..attention_backend import flash_head_dim
    qh = L.qk_head_dim + L.qk_pos_emb_head_dim
    p = x.Tf * x.a_t * flash_head_dim(L) * x.e         # one [s b, a/t, P] tensor
    stats = x.b * x.a_t * x.s * 4
    originals = 2 * q_b + v_b                          # made in the forward even when mla_up_proj drops them after
    for n in ("query", "key", "value"):
        saved.pop(n, None)
    saved["flash_qkv"] = 3 * p
    saved["attention_output_bshd"] = p
    saved["softmax_stats"] = stats
    trimmed = qh > L.v_head_dim                        # the [s, b, h P] output is sliced to v's head dim
    pads = (p if L.v_head_dim < qh else 0) + (2 * p if qh < L.v_head_dim else 0)
    # the q, k, v handed over (alive until the call returns), the padded ones, TE's sbhd output (linear_proj's input,
    # or the padded copy and the trimmed one)
    core_fwd = originals + pads + (p + v_b if trimmed else p)
    core_bwd = flash_attention_bwd(x, p, p, stats)
    return saved, core_fwd, core_bwd


@lru_cache(maxsize=256)
def layer_attention_items(L: Layout, recompute_core: bool,
                          recompute_up: bool) -> tuple[dict[str, int], int, int, bool, tuple[Step, ...]]:
    """mla_attention_items at the layout's shapes, made once: the layers of every kind (dense and MoE MLPs)
    share their MLA attention."""
    return mla_attention_items(L, shapes(L), recompute_core, recompute_up)


def reads_batch_mask(L: Layout) -> bool:
    """MLA builds no attention mask, whatever the batch carries (mla_attention_items takes none)."""
    return False


def activations(L: Layout, mods: set, has_batch_mask: bool, drop_norm: bool, after: frozenset,
                released: frozenset, G: int) -> MixerActivations:
    """The input norm, the down and up projections, the core attention and linear_proj's input
    (arguments as for ``attention.activations``)."""
    x = shapes(L)
    T, Tf, h, e = x.T, x.Tf, x.h, x.e
    # MLA's TE spec keeps the input norm as a module of its own (both down projections read it), so
    # recomputing 'layernorm' drops its output and statistics; the pre-MLP norm stays inside fc1.
    drop_norm1 = drop_norm or "layernorm" in mods
    saved: dict[str, int] = {}
    if not drop_norm1:
        saved["norm1_stats"] = norm_stats(L, T)
        saved["qkv_input"] = T * h * e                        # norm output, kept by the down projections
    att, core_fwd, core_bwd, unfused, qkv_steps = layer_attention_items(L, "core_attn" in mods, "mla_up_proj" in mods)
    ctx_w = x.a_t * L.v_head_dim                              # width of the attention context
    saved.update(att)
    saved["proj_input"] = Tf * ctx_w * e                      # attention context, kept by linear_proj
    after_attn = after | {"proj_input"}
    # the kv up projection's output while key and value are made from it (and, on the unfused rope
    # path, the q up projection's output until the rope'd query is concatenated)
    q_up = 0 if L.apply_rope_fusion else Tf * x.a_t * (L.qk_head_dim + L.qk_pos_emb_head_dim) * e
    fwd_steps = ((after_attn, core_fwd),
                 (after_attn | {"attention_probs", "softmax_stats"}, Tf * x.a_t * (L.qk_head_dim + L.v_head_dim) * e + q_up))
    rel_proj = released | {"proj_input"}
    rel_softmax = rel_proj | {"attention_probs", "value_repeated"}
    # a recomputed input norm is remade when linear_proj's backward starts and exists twice (copied
    # back into the storage the down projections saved, and kept by the checkpoint) until then
    renorm = 2 * T * h * e + norm_stats(L, T) if drop_norm1 else 0
    rel_all = rel_proj | qkv_steps[-1][0]
    bwd_steps = (
        (released, G + Tf * ctx_w * e + wgrad(L, h, ctx_w) + renorm),                             # linear_proj
        (rel_softmax if unfused else rel_proj, G + core_bwd + renorm),                             # core attention
        *((rel_proj | names, G + w + renorm) for names, w in qkv_steps),                           # up, down projections
        (rel_all, G + T * h * e + T * h * e + renorm // 2),                                        # input norm
    )
    return MixerActivations(saved=saved, fwd_steps=fwd_steps, bwd_steps=bwd_steps)


def bound_saved(L: Layout, tp: int, b: int, seq: int, sp: bool, mods: set) -> int:
    """Bytes one layer's multi-latent attention surely keeps per micro-batch (the planner's memory
    lower bound; arguments as for ``attention.bound_saved``): the input norm's output (dropped by
    'layernorm' recompute: the norm is a module of its own), query, key and value as separate tensors
    (unless mla_up_proj is recomputed), the attention output and unfused attention's softmax output."""
    from .attention import _unfused
    e, h = L.act_bytes, L.hidden_size
    Tf = b * seq
    T = Tf // tp if sp else Tf
    a_t = L.num_attention_heads // tp
    qk, v = L.qk_head_dim + L.qk_pos_emb_head_dim, L.v_head_dim
    kept = 0 if "layernorm" in mods else T * h * e
    # FP8 attention (layers/fp8_attention.py) keeps q, k, v and, under delayed scaling, the output at 1 B/elem
    qkv_e = 1 if L.fp8_spec.fp8_dot_product_attention else e
    if "mla_up_proj" not in mods:
        kept += Tf * a_t * (2 * qk + v) * qkv_e
    kept += Tf * a_t * v * qkv_e
    if _unfused(L) and "core_attn" not in mods:
        kept += b * a_t * seq * seq * e
    return kept


def qkv_gemms(L: Layout, tp: int, M: int, tok: int) -> list[tuple[int, int, int]]:
    """(tokens, output width, input width) of the projections before the core attention on one TP
    rank (the planner's time model): the down projections are whole weights on the rank's own
    (sequence-parallel) tokens ``tok``; the up projections are split over TP on all ``M`` tokens."""
    h, a_t = L.hidden_size, L.num_attention_heads // tp
    ql, kvl, qk, pe, v = L.q_lora_rank or 0, L.kv_lora_rank, L.qk_head_dim, L.qk_pos_emb_head_dim, L.v_head_dim
    gemms = [(tok, kvl + pe, h), (M, a_t * (qk + v), kvl)]
    gemms += [(tok, ql, h), (M, a_t * (qk + pe), ql)] if ql else [(M, a_t * (qk + pe), h)]
    return gemms


def rope_elements(L: Layout, tp: int, M: int) -> int:
    """Elements MLA's rotary embedding rotates on one TP rank: the rope part of every query head and
    of the one shared key."""
    return M * (L.num_attention_heads // tp + 1) * L.qk_pos_emb_head_dim


# MLATransformerConfig.original_max_position_embeddings: Megatron's --yarn-original-max-position-
# embeddings does not reach MLA layers (argument_utils._apply_yarn_config_from_args returns early).
MLA_YARN_ORIGINAL_MAX_POSITIONS = 4096
# RotaryEmbedding.forward / YarnRotaryEmbedding.forward are functools.lru_cache(maxsize=32) methods.
ROTARY_LRU_ENTRIES = 32


def mla_rotary_bytes(L: Layout, layers: int) -> int:
    """Every MLA layer builds its own rotary embedding: its forward's cached [s/CP, 1, 1, rope dim]
    fp32 tables (one per layer, 32 at most in the process), and for yarn the cos/sin buffers, made at
    init for 4096 positions (cast to the param dtype with the model) and remade for s/CP positions
    in the activation dtype the first time the fused rope asks for them."""
    s, pe = L.seq_length // L.cp, L.qk_pos_emb_head_dim
    total = min(layers, ROTARY_LRU_ENTRIES) * s * pe * 4
    if L.rope_type == "yarn":
        rows, width = ((s, L.act_bytes) if L.apply_rope_fusion
                       else (MLA_YARN_ORIGINAL_MAX_POSITIONS // L.cp, L.param_bytes))
        total += layers * 2 * rows * pe * width
    return total


def rotary_cache(L: Layout, layers: int) -> tuple[int, str] | None:
    """The persistent rotary tables of ``layers`` MLA layers on a rank: (bytes, detail), or None."""
    if not layers:
        return None
    return mla_rotary_bytes(L, layers), f"{L.rope_type} rotary tables of {layers} MLA layer(s)"


def head_dims(L: Layout) -> tuple[int, int]:
    """(query/key, value) head dims: the content and rope parts of queries and keys, and v_head_dim."""
    return L.qk_head_dim + L.qk_pos_emb_head_dim, L.v_head_dim
