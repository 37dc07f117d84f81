"""What one transformer layer keeps for backward, per micro-batch, op by op, and its working sets.

Two implementation tables, chosen by ``--transformer-impl``:

* ``local``: megatron-core's local spec (ColumnParallelLinear/RowParallelLinear, unfused
  DotProductAttention, the norm modules, the bias-dropout-add functions, the MLP's activation),
  with and without each fusion. This is what the CPU referee runs and measures.
* ``transformer_engine``: TE's LayerNormLinear modules and fused/flash attention (no s x s scores,
  fp32 softmax statistics instead), megatron's fused activation functions.

Shapes per TP rank: ``T`` tokens of the sequence-sharded stream (``s*b/t`` with sequence
parallelism, else ``s*b``), ``Tf = s*b`` tokens inside the tensor-parallel region, ``s`` already
divided by CP. Bytes follow the dtype of each tensor (activations in the autocast dtype when one is
set, else the param dtype).

Besides the saved tensors, a layer's backward runs as a sequence of steps (MLP first, then
attention); at each step some saved tensors are already released and a working set of gradients
is alive. ``bwd_steps`` lists them as (names released so far, working bytes); the backward peak of
a layer is the largest ``working - released``. The forward is treated the same way with the names
not yet created.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property, lru_cache

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


Step = tuple[frozenset, int]   # (saved names released / not yet created, working bytes)


@dataclass(frozen=True)
class LayerActivations:
    saved: dict[str, int] = field(default_factory=dict)   # kept until this layer's backward
    fwd_steps: tuple[Step, ...] = ()
    bwd_steps: tuple[Step, ...] = ()

    @property
    def total(self) -> int:
        return sum(self.saved.values())

    def _peak(self, steps: tuple[Step, ...]) -> int:
        return max((w - sum(self.saved.get(n, 0) for n in names) for names, w in steps), default=0)

    @cached_property
    def fwd_transient(self) -> int:
        """Largest extra over the layer's saved bytes during its forward (with later items not yet made)."""
        return self._peak(self.fwd_steps)

    @cached_property
    def bwd_transient(self) -> int:
        """Largest extra over the layer's saved bytes during its backward (with released items gone)."""
        return self._peak(self.bwd_steps)


def _norm_stats(L: Layout, n_tokens: int) -> int:
    # fp32 mean and rstd per token (LayerNorm), rstd only (RMSNorm)
    return n_tokens * 4 * (2 if L.normalization == "LayerNorm" else 1)


def _wgrad(L: Layout, rows: int, cols: int) -> int:
    """A weight gradient materialised before it is added to main_grad (no fused accumulation)."""
    return 0 if L.fused_wgrad else rows * cols * L.act_bytes


def attention_kind(L: Layout) -> str:
    """Which core attention runs: local_unfused (megatron DotProductAttention, torch softmax),
    local_fused_softmax (its fused scale-mask-softmax kernel), te_unfused (TE's
    UnfusedDotProductAttention) or fused (flash / cuDNN: no s x s tensors)."""
    x = shapes(L)
    if L.transformer_impl == "local":
        kernel = (L.masked_softmax_fusion and L.params_dtype in ("bf16", "fp16") and 16 < x.s <= 4096
                  and x.s % 4 == 0 and (x.b * x.a_t) % 4 == 0)
        return "local_fused_softmax" if kernel else "local_unfused"
    if L.attention_backend in ("unfused", "local"):
        return "te_unfused"
    return "fused"


def _te_keeps_every_cp_step(L: Layout) -> bool:
    """Transformer Engine up to 2.11 (megatron-core 0.16 pins TE < 2.12) keeps every ring step's K/V
    buffer and partial output until the forward's end; TE 2.20.2 keeps two of each (double buffering).
    Later megatron-core versions are assumed to run the newer TE."""
    from packaging.version import Version
    return Version(L.megatron_version) < Version("0.17")


def _cp_attention_items(L: Layout, x: "Shapes", saved: dict[str, int], q: int, kv1: int, qkv_w: int,
                        rope: bool) -> tuple[dict[str, int], int, int, bool]:
    """Context parallelism's ring attention (TE AttnFuncWithCPAndKVP2P, cp_comm_type p2p, read in TE
    2.11 and 2.20.2 context_parallel.py): the K/V of this rank are concatenated into the first ring
    buffer and passed around; the function keeps q as it receives it (the rope'd query, a contiguous
    copy, or with the flash backend a [b, s, h, d] copy), the last received K/V buffer
    [2, s/CP, b, g/t, d], its output and the merged fp32 softmax statistics. So megatron's qkv
    projection output and rope'd key die after the forward (unless q/k norms keep views of the qkv
    output). The flash backend also keeps its [b, s, h, d] output next to the [s, b, h] copy that
    linear_proj keeps."""
    e, Tf = x.e, x.Tf
    stats = x.b * x.a_t * x.s * 4
    saved.pop("key_norm", None)                       # consumed into the ring buffer
    if L.qk_layernorm:
        saved["qkv_output"] = Tf * qkv_w * e          # the norms' saved inputs are views of it
    if rope:
        saved["query_rope"] = q
    elif "query_norm" not in saved:
        saved["query"] = q
    saved["cp_kv_buffer"] = 2 * kv1
    saved["softmax_stats"] = stats
    if L.attention_backend == "flash":
        saved["attention_output_bshd"] = q
    cp = L.cp
    if _te_keeps_every_cp_step(L):
        # the output, every step's partial output (the last CP rank's are all full size) and the
        # ring buffers other than the one kept
        core_fwd = q + cp * q + (cp - 1) * 2 * kv1
    else:
        # the output, two partial outputs and two more ring buffers in flight
        core_fwd = 3 * q + 2 * 2 * kv1
    # backward: dq buffer, two [2, K/V] ring buffers of K/V and dK/dV, the step's dq/dk/dv and, on the
    # upper-triangle steps of the early CP ranks, contiguous halves of q, the output and its gradient
    core_bwd = 3 * q + 10 * kv1 + stats
    return saved, core_fwd, core_bwd, False


def attention_items(L: Layout, x: "Shapes", recompute_core: bool, has_batch_mask: bool) -> tuple[dict[str, int], int, int, bool]:
    """Saved bytes of q/k/v handling and the core attention, its forward working set at the softmax
    and its backward working set (with the probs already released), and whether s x s scores exist."""
    kind = attention_kind(L)
    e, Tf, a_t, g_t, d = x.e, x.Tf, x.a_t, x.g_t, x.d
    qkv_w = (L.num_attention_heads + 2 * L.num_query_groups) * d // L.tp
    rope = L.position_embedding_type in ("rope", "yarn")
    gqa = a_t > g_t or L.num_query_groups < L.tp
    q = Tf * a_t * d * e
    kv1 = Tf * g_t * d * e
    scores = x.b * a_t * x.s * x.s
    saved: dict[str, int] = {}
    if L.qk_layernorm:
        # q_layernorm / k_layernorm keep fp32 statistics per (token, head); without rope their outputs
        # are what the attention keeps (new tensors next to the qkv output)
        heads = a_t + g_t
        saved["qk_norm_stats"] = Tf * heads * 4 * (2 if L.normalization == "LayerNorm" else 1)
        if not rope and not (gqa and kind != "fused"):
            saved["query_norm"] = q
            saved["key_norm"] = kv1
    if kind == "fused" and L.cp > 1 and not recompute_core:
        return _cp_attention_items(L, x, saved, q, kv1, qkv_w, rope)
    if kind == "fused":
        # Flash / cuDNN fused attention keeps q, k, v (v a view of the qkv output, q and k new after
        # rope), the output O (the same storage linear_proj keeps as its input) and fp32 softmax
        # statistics [b, a, s, 1] (TE FusedAttnFunc / FlashAttention autograd functions).
        stats = x.b * a_t * x.s * 4
        saved["qkv_output"] = Tf * qkv_w * e
        if rope:
            saved["query_rope"] = q
            saved["key_rope"] = kv1
        if not recompute_core:
            saved["softmax_stats"] = stats
        core_fwd = q                                   # the output being written
        core_bwd = 3 * q + stats + (q if recompute_core else 0)   # dq, dk, dv (+ recomputed O)
        if recompute_core and L.cp > 1:
            # the checkpoint replays the ring forward (its K/V buffer, output and statistics kept) and
            # runs the ring backward; it holds the recomputed output and the gradient handed to it
            _, cp_fwd, cp_bwd, _ = _cp_attention_items(L, x, {}, q, kv1, qkv_w, rope)
            core_bwd = cp_bwd + 2 * kv1 + stats + 2 * q
        return saved, core_fwd, core_bwd, False
    # Unfused: the s x s scores and probs exist per layer.
    if recompute_core:
        # tensor_parallel.checkpoint keeps its inputs: q (a copy under GQA or after rope), k and v
        # (views of the qkv output unless rope copied k) -> the qkv output stays alive through v.
        saved["qkv_output"] = Tf * qkv_w * e
        if gqa and not rope:
            saved["query"] = q
        if rope:
            saved["query_rope"] = q
            saved["key_rope"] = kv1
    elif gqa:
        # query reshaped (a copy) or rope'd; key/value repeated to every head (repeat_interleave).
        saved["query"] = q
        saved["key_repeated"] = q
        saved["value_repeated"] = q
    else:
        saved["qkv_output"] = Tf * qkv_w * e          # q, k, v are views; the bmm keeps v
        if rope:
            saved["query_rope"] = q
            saved["key_rope"] = kv1
    fused_softmax = kind in ("local_fused_softmax", "te_unfused")
    soft32 = L.attention_softmax_in_fp32 and not fused_softmax
    # the softmax keeps its output (fp32 with the fp32 softmax); the bmm keeps what it multiplies: the
    # cast back to the activation dtype, or the dropout output (then the cast is not kept, the dropout
    # keeps its bool mask instead)
    probs = scores * (4 if soft32 else e)
    if L.attention_dropout > 0:
        probs += scores * (1 + e)
    elif soft32:
        probs += scores * e
    if not recompute_core:
        saved["attention_probs"] = probs
    mask_made = kind == "local_unfused" and not (has_batch_mask and L.create_attention_mask_in_dataloader)
    if mask_made:
        saved["causal_mask"] = x.s * x.s               # bool mask kept by masked_fill_
    # forward at the softmax: the raw scores (+ fp32 copy, + the mask being built; TE's unfused
    # path also holds its preallocated output buffer) next to the probs being made
    core_fwd = scores * e + (scores * 4 if soft32 else 0) + (8 * x.s * x.s if mask_made else 0)
    if kind == "te_unfused":
        core_fwd += scores * e
    # backward just after the softmax's (the probs are released by then): grads of probs and
    # scores, the masked grad, the bmm's grad buffer, and the grads of the context and of v
    if kind == "local_unfused":
        core_bwd = scores * (4 * e if not soft32 else 2 * e + 8) + 2 * q
    else:
        core_bwd = 2 * scores * e + 2 * q
    if recompute_core:
        # The recomputed forward makes the probs again, but the softmax's backward has consumed them
        # by this step; CheckpointFunction.backward still holds the recomputed context and the
        # gradient handed to it (measured by the CPU referee: recompute core_attn on a PP2 first stage),
        # and under GQA the recomputed repeat of K that the scores' backward still needs.
        core_bwd += 2 * q + (q if gqa else 0)
    return saved, core_fwd, core_bwd, True


def mla_attention_items(L: Layout, x: "Shapes", recompute_core: bool,
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
    if kind == "fused":
        stats = x.b * a_t * x.s * 4
        if not recompute_core:
            saved["softmax_stats"] = stats
        core_fwd = v_b                                          # the output being written
        core_bwd = 2 * q_b + v_b + stats + (v_b if recompute_core else 0)
        unfused = False
    else:
        # TE's unfused attention with its fused softmax kernel (as for standard attention)
        probs = scores * e + (scores * (1 + e) if L.attention_dropout > 0 else 0)
        if not recompute_core:
            saved["attention_probs"] = probs
        core_fwd = 2 * scores * e
        core_bwd = 2 * scores * e + 2 * v_b + (2 * v_b if recompute_core else 0)   # as for standard attention
        unfused = True
    remade = 2 * q_b + v_b if recompute_up else 0              # query, key and value made again
    core_bwd += 2 * remade
    rel_core = frozenset({"attention_probs", "softmax_stats"})
    rel_up = rel_core | {"query", "key", "value", "rope_cos_sin"}
    rel_down = rel_up | {"q_latent", "kv_latent", "latent_norms", "k_rope_gathered"}
    latents = T * ((ql or 0) + kvl + pe) * e
    bwd_steps = (
        # rope and up projections: dq, dk, dv, the kv up projection's output gradient
        (rel_up, 2 * q_b + v_b + kv_up + remade + _wgrad(L, a_t * qh, ql or x.h)
         + _wgrad(L, a_t * (L.qk_head_dim + L.v_head_dim), kvl)),
        # down projections: the latents' gradients and the two gradients of the norm output
        (rel_down, latents + 2 * T * x.h * e + _wgrad(L, kvl + pe, x.h) + (_wgrad(L, ql, x.h) if ql else 0)),
    )
    return saved, core_fwd, core_bwd, unfused, bwd_steps


@lru_cache(maxsize=512)
def layer_activations(L: Layout, has_batch_mask: bool = True) -> LayerActivations:
    """One layer, one micro-batch, no full recompute (applied per block by the caller)."""
    x = shapes(L)
    mods = set(L.recompute_modules) if L.recompute_granularity == "selective" else set()
    recompute_core = "core_attn" in mods
    te = L.transformer_impl == "transformer_engine"
    T, Tf, h, e, r = x.T, x.Tf, x.h, x.e, x.r
    a_t, d, f_t = x.a_t, x.d, x.f_t
    qkv_w = (L.num_attention_heads + 2 * L.num_query_groups) * d // L.tp
    fc1_w = (2 if L.gated_linear_unit else 1) * f_t
    rope = L.position_embedding_type in ("rope", "yarn")
    drop_norm = "layernorm" in mods and not te
    mla = L.multi_latent_attention
    # MLA's TE spec keeps the input norm as a module of its own (both down projections read it), so
    # recomputing 'layernorm' drops its output and statistics; the pre-MLP norm stays inside fc1.
    drop_norm1 = drop_norm or ("layernorm" in mods and mla)

    saved: dict[str, int] = {}
    saved["layer_input"] = T * h * r                          # residual stream, kept by the input norm
    if not (drop_norm1 and mla):
        saved["norm1_stats"] = _norm_stats(L, T)
    if not drop_norm1:
        saved["qkv_input"] = T * h * e                        # norm output, kept by linear_qkv (local shard under SP)

    # --- q, k, v and the core attention -------------------------------------------------------
    if mla:
        att, core_fwd, core_bwd, unfused, qkv_steps = mla_attention_items(L, x, recompute_core, "mla_up_proj" in mods)
        ctx_w = a_t * L.v_head_dim                            # width of the attention context
    else:
        att, core_fwd, core_bwd, unfused = attention_items(L, x, recompute_core, has_batch_mask)
        ctx_w = a_t * d
    saved.update(att)
    if rope and not L.apply_rope_fusion and not te and not mla:
        # unfused rope (rope_utils._apply_rotary_pos_emb_bshd) casts cos and sin to the activation
        # dtype for q and for k; the products keep them: 4 x [s, 1, 1, rotary dim] per layer
        saved["rope_cos_sin"] = 4 * x.s * int(d * L.rotary_percent) * e
    saved["proj_input"] = Tf * ctx_w * e                      # attention context, kept by linear_proj
    if L.hidden_dropout > 0:
        saved["dropout_masks"] = 2 * T * h                    # bool masks after attention and after the MLP
    saved["mlp_norm_input"] = T * h * r
    saved["norm2_stats"] = _norm_stats(L, T)
    if not drop_norm:
        saved["fc1_input"] = T * h * e

    # --- MLP ------------------------------------------------------------------------------------
    mlp: dict[str, int] = {}
    if L.gated_linear_unit:
        mlp["fc1_output"] = Tf * fc1_w * e
        if not L.bias_activation_fusion:
            # unfused glu (mlp.py): silu(x0) * (x1 + glu_linear_offset); the product keeps both factors
            mlp["activation_gate"] = Tf * f_t * e
            mlp["activation_linear"] = Tf * f_t * e
        mlp["fc2_input"] = Tf * f_t * e
    else:
        mlp["fc1_output"] = Tf * f_t * e
        mlp["fc2_input"] = Tf * f_t * e
    mlp_names = frozenset(mlp)
    if "mlp" not in mods:
        saved.update(mlp)

    G = T * h * e   # gradient of the layer output (received or from the layer above)
    # Forward steps: (saved names not created yet, working bytes)
    after_attn = frozenset({"proj_input", "mlp_norm_input", "norm2_stats", "fc1_input", "dropout_masks"}) | mlp_names
    fwd_steps = (
        (after_attn, core_fwd),
        (frozenset(), T * h * r),                             # the layer's output (next layer's input)
    )
    if mla:
        # the kv up projection's output while key and value are made from it (and, on the unfused rope
        # path, the q up projection's output until the rope'd query is concatenated)
        q_up = 0 if L.apply_rope_fusion else Tf * a_t * (L.qk_head_dim + L.qk_pos_emb_head_dim) * e
        fwd_steps += ((after_attn | {"attention_probs", "softmax_stats"},
                       Tf * a_t * (L.qk_head_dim + L.v_head_dim) * e + q_up),)
    # Backward steps: (saved names released, working bytes)
    rel_mlp = frozenset({"fc2_input"})
    rel_act = rel_mlp | mlp_names
    rel_fc1 = rel_act | {"fc1_input"}
    rel_norm2 = rel_fc1 | {"mlp_norm_input", "norm2_stats", "dropout_masks"}
    rel_proj = rel_norm2 | {"proj_input"}
    # by the softmax's backward the bmm with V has run its backward: the probs and V's repeated copy are gone
    rel_softmax = rel_proj | {"attention_probs", "value_repeated"}
    rel_core = rel_proj | {"attention_probs", "softmax_stats", "causal_mask"}
    rel_qkv = rel_core | {"qkv_output", "query", "key_repeated", "value_repeated", "query_rope", "key_rope",
                          "rope_cos_sin", "query_norm", "key_norm", "qk_norm_stats"}

    def remade(released: frozenset) -> int:
        """MLP tensors recomputed for the backward ('mlp' recompute) and not yet released."""
        return sum(v for k, v in mlp.items() if k not in released) if "mlp" in mods else 0

    u = Tf * f_t * e          # one [s b, ffn/t] tensor: fc2's input gradient, each activation gradient
    if L.gated_linear_unit and not L.bias_activation_fusion:
        # unfused glu, op by op: the product's backward makes the gradients of both factors next to
        # fc2's input gradient (fc2_input released); silu's backward adds the gate's input gradient
        # (the product's saved factors released, fc2's input gradient consumed); the chunk's backward
        # concatenates the two halves' gradients into fc1's output gradient (fc1_output released).
        rel_mul = rel_mlp | {"activation_gate", "activation_linear"}
        act_steps = (
            (rel_mlp, G + remade(rel_mlp) + 3 * u),                                                # mul
            (rel_mul, G + remade(rel_mul) + 3 * u),                                                # silu
            (rel_act, G + 2 * u + Tf * fc1_w * e),                                                 # chunk
        )
    else:
        # one activation node (fused bias-activation, or a plain activation): fc1's output gradient
        # next to fc2's input gradient
        act_steps = ((rel_mlp, G + remade(rel_mlp) + u + Tf * fc1_w * e),)
    steps_to_core = (
        (frozenset(), G + remade(frozenset()) + u + _wgrad(L, h, f_t)),                           # fc2
        *act_steps,                                                                                # activation
        (rel_act, G + Tf * fc1_w * e + Tf * h * e + _wgrad(L, fc1_w, h)),                         # fc1
        (rel_fc1, G + Tf * h * e + T * h * e + (T * h * e if drop_norm else 0)),                  # pre-MLP norm
        (rel_norm2, G + Tf * ctx_w * e + _wgrad(L, h, ctx_w)),                                     # linear_proj
        (rel_softmax if unfused else rel_proj, G + core_bwd),                                      # core attention
    )
    if mla:
        # a recomputed input norm is remade when linear_proj's backward starts and exists twice (copied
        # back into the storage the down projections saved, and kept by the checkpoint) until then
        renorm = 2 * T * h * e + _norm_stats(L, T) if drop_norm1 else 0
        attn = tuple((names, w + renorm) for names, w in steps_to_core[-2:])
        rel_all = rel_proj | qkv_steps[-1][0]
        bwd_steps = steps_to_core[:-2] + attn + tuple((rel_proj | names, G + w + renorm) for names, w in qkv_steps) + (
            (rel_all, G + T * h * e + T * h * e + renorm // 2),                                    # input norm
        )
        return LayerActivations(saved=saved, fwd_steps=fwd_steps, bwd_steps=bwd_steps)
    bwd_steps = steps_to_core + (
        (rel_core, G + Tf * qkv_w * e + Tf * h * e + _wgrad(L, qkv_w, h)),                        # linear_qkv
        (rel_qkv, G + Tf * h * e + T * h * e + (T * h * e if drop_norm else 0)),                  # input norm
    )
    return LayerActivations(saved=saved, fwd_steps=fwd_steps, bwd_steps=bwd_steps)
