"""Standard self-attention (megatron-core SelfAttention: linear_qkv, core attention, linear_proj),
with grouped-query attention, rotary embeddings, q/k norms and context parallelism's ring attention.

Recipe of the token mixer ``attention`` (see ``base`` for what a recipe gives). Registration order of
the parameters: local spec: input norm, linear_proj, linear_qkv, q/k norms; the TE spec fuses the
input norm into linear_qkv (``layer_norm_weight``/``layer_norm_bias``): counts are the same.
"""
from __future__ import annotations

from typing import Mapping

from ...layout import Layout
from .base import (MixerActivations, Param, ParamRow, Shapes, norm_rows, norm_stats, norms_per_layer_norm, param_objects,
                   shapes, wgrad)


def qkv_out_per_rank(L: Layout) -> int:
    """Output width of linear_qkv on one TP rank: (heads + 2 * query groups) * head dim / TP; with
    --attention-output-gate one more head dim per query head, the gate (SelfAttention.__init__:
    linear_qkv_out_dim += kv_channels * num_attention_heads, core 0.16.1 and 0.19.2)."""
    return (_gated(L) * L.num_attention_heads + 2 * L.num_query_groups) * L.kv_channels // L.tp


def qkv_kept_per_rank(L: Layout) -> int:
    """Width of the tensor q, k and v are split from on one TP rank, which a kept view of any of them keeps whole:
    linear_qkv's output, or with fewer query groups than TP ranks the whole projection, (heads + 2 groups) x head
    dim, which Attention all-gathers from the TP ranks before it slices the rank's group
    (get_query_key_value_tensors: all_gather_last_dim_from_tensor_parallel_region, a new contiguous tensor;
    megatron-core 0.16.1 and 0.19.2)."""
    return qkv_out_per_rank(L) * (L.tp if L.num_query_groups < L.tp else 1)


def _gated(L: Layout) -> int:
    """2 with the output gate (a gate per query head next to the query), else 1."""
    return 2 if getattr(L, "attention_output_gate", False) else 1


def linear_shapes(L: Layout) -> dict[str, tuple[int, int]]:
    """[out, in] per TP rank of linear_qkv (column-parallel) and linear_proj (row-parallel)."""
    return {"linear_qkv": (qkv_out_per_rank(L), L.hidden_size),
            "linear_proj": (L.hidden_size, L.num_attention_heads * L.kv_channels // L.tp)}


def param_rows(L: Layout) -> list[ParamRow]:
    """(name, numel, tp_replicated, shared_embedding, expert, cols) of each parameter (base.ParamRow)."""
    h, t = L.hidden_size, L.tp
    te = L.transformer_impl == "transformer_engine"
    proj_in = L.num_attention_heads * L.kv_channels // t
    qkv = qkv_out_per_rank(L)
    rows: list[ParamRow] = []
    if not te:
        rows += norm_rows("input_layernorm", h, L)
    rows.append(("self_attention.linear_proj.weight", h * proj_in, False, False, False, proj_in))
    if L.add_bias_linear:
        rows.append(("self_attention.linear_proj.bias", h, True, False, False, 0))
    if getattr(L, "post_proj_norms", False):
        # TERowParallelLinearLayerNorm's post_layernorm (a TENorm child, registered after linear_proj's weight)
        rows += norm_rows("self_attention.linear_proj.post_layernorm", h, L)
    if te:
        rows += norm_rows("self_attention.linear_qkv.layer_norm", h, L)
    rows.append(("self_attention.linear_qkv.weight", qkv * h, False, False, False, h))
    if L.add_qkv_bias:
        rows.append(("self_attention.linear_qkv.bias", qkv, False, False, False, 0))
    if L.qk_layernorm:
        rows += norm_rows("self_attention.q_layernorm", L.kv_channels, L)
        rows += norm_rows("self_attention.k_layernorm", L.kv_channels, L)
    return rows


def params(L: Layout, prefix: str = "") -> list[Param]:
    return param_objects(param_rows(L), prefix)


def param_count(L: Layout) -> int:
    """Parameters of one layer's attention in the whole model: input norm, linear_proj (and its bias),
    linear_qkv (and its bias), q/k norms, Gemma 3's post-attention norm."""
    h, a, g, d = L.hidden_size, L.num_attention_heads, L.num_query_groups, L.kv_channels
    norm = norms_per_layer_norm(L)
    n = norm * h + h * a * d + (_gated(L) * a + 2 * g) * d * h
    if L.add_bias_linear:
        n += h
    if L.add_qkv_bias:
        n += (_gated(L) * a + 2 * g) * d
    if L.qk_layernorm:
        n += 2 * norm * d
    if getattr(L, "post_proj_norms", False):
        n += norm * h                 # the post-attention norm (TERowParallelLinearLayerNorm)
    return n


def attention_kind(L: Layout) -> str:
    """Which core attention runs: local_unfused (megatron DotProductAttention, torch softmax),
    local_fused_softmax (its fused scale-mask-softmax kernel), te_unfused (TE's
    UnfusedDotProductAttention), fused (flash / cuDNN: no s x s tensors) or flex (Gemma 2's
    Gemma2FlexDotProductAttention: PyTorch FlexAttention, no s x s tensors either)."""
    x = shapes(L)
    # --attention-backend local swaps the TE spec's core attention for megatron-core's own
    # DotProductAttention (core 0.19.2 training/models/gpt.py; Megatron-Bridge 0.6.2 gpt_provider.py
    # does the same; NeMo 2.5 does not, and its reader refuses the pair) and sets
    # NVTE_FLASH/FUSED/UNFUSED_ATTN=0 (language_module.py), so it keeps what the local spec's
    # attention keeps, not what TE's UnfusedDotProductAttention keeps
    if L.transformer_impl == "local" or L.attention_backend == "local":
        kernel = (L.masked_softmax_fusion and L.params_dtype in ("bf16", "fp16") and 16 < x.s <= 4096
                  and x.s % 4 == 0 and (x.b * x.a_t) % 4 == 0)
        return "local_fused_softmax" if kernel else "local_unfused"
    if getattr(L, "gemma2_attention", False):
        # gemma2_layer_spec's own core attention, whatever TE backend is asked for (Megatron-Bridge 0.6.2
        # gemma2_provider.py); its unfused fallback (a mask or dropout) is refused (resolve/shape.py)
        return "flex"
    if L.attention_backend == "unfused":
        return "te_unfused"
    return "fused"


def te_softmax_kernel(L: Layout, x: Shapes) -> bool:
    """Whether TE's UnfusedDotProductAttention runs its fused scale-mask-softmax kernel (it then keeps only the
    probs) rather than torch's softmax. ``FusedScaleMaskSoftmax.is_kernel_available`` (TE 2.11 and 2.20.2
    ``pytorch/attention/dot_product_attention/softmax.py``), for a causal self-attention: NVTE_MASKED_SOFTMAX_FUSION
    not 0, fp16/bf16 scores, 16 < s < 16384, s % 8 == 0 (so sq % 4 == 0), b x heads % 4 == 0 and s a multiple of
    ``get_batch_per_block(s)`` (128 threads per block / the warp width, two rows per warp up to s = 128)."""
    if str(dict(L.env).get("NVTE_MASKED_SOFTMAX_FUSION", "1")).strip() == "0" or x.e == 4:
        return False
    s = x.s
    if not (16 < s < 16384 and s % 8 == 0 and (x.b * x.a_t) % 4 == 0):
        return False
    pow2 = 1 << (s - 1).bit_length()
    per_block = (128 // min(pow2, 32)) * (2 if pow2 <= 128 else 1)
    return s % per_block == 0


def te_torch_softmax_mask(L: Layout, x: Shapes, has_batch_mask: bool) -> int:
    """Bytes of the bool mask TE's torch-softmax path keeps per layer (``masked_fill_`` saves it for backward):
    ``get_full_mask`` ORs its [1, 1, s, s] window mask with the mask megatron hands over (the data loader's
    [b, 1, s, s] one when it makes one), and ``forward_torch_softmax`` ORs the result with the cached causal mask
    into a new tensor (TE 2.11 and 2.20.2 ``utils.py`` / ``softmax.py``)."""
    rows = x.b if has_batch_mask and L.create_attention_mask_in_dataloader else 1
    return rows * x.s * x.s


def _te_keeps_every_cp_step(L: Layout) -> bool:
    """Transformer Engine up to 2.19 keeps every ring step's K/V buffer and partial output until the forward's
    end; TE 2.20 keeps two of each (double buffering). The run's TE: estimator/te_release.py (core 0.16: 2.11)."""
    from ..te_release import RING_TWO_BUFFERS_SINCE, te_at_least
    return not te_at_least(L.env_dict, L.megatron_version, RING_TWO_BUFFERS_SINCE)


def _te_ring_out_part(L: Layout) -> bool:
    """TE 2.15 and later: the CP ring casts its fp32 output to a BF16 ``out_part`` (saved under a2a+p2p and FP8
    tensorwise) and its two-level backward exchanges dO alone; up to 2.14.1 it saves the returned output and
    exchanges [out, dout]."""
    from ..te_release import RING_OUT_PART_SINCE, te_at_least
    return te_at_least(L.env_dict, L.megatron_version, RING_OUT_PART_SINCE)


def _cp_attention_items(L: Layout, x: Shapes, saved: dict[str, int], q: int, kv1: int, qkv_w: int,
                        rope: bool, ring: int | None = None) -> tuple[dict[str, int], int, int, bool]:
    """Context parallelism's ring attention (TE AttnFuncWithCPAndKVP2P, cp_comm_type p2p, read in TE
    2.11 and 2.20.2 context_parallel.py): the K/V of this rank are concatenated into the first ring
    buffer and passed around; the function keeps q as it receives it (the rope'd query, a contiguous
    copy, or with the flash backend a [b, s, h, d] copy), the last received K/V buffer
    [2, s/CP, b, g/t, d], its output and the merged fp32 softmax statistics. So megatron's qkv
    projection output and rope'd key die after the forward (unless q/k norms keep views of the qkv
    output). The flash backend also keeps its [b, s, h, d] output next to the [s, b, h] copy that
    linear_proj keeps. ``ring``: the ring's ranks (default CP; ``CP / a2a`` under a two-level a2a+p2p)."""
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
    cp = ring or L.cp
    if _te_keeps_every_cp_step(L):
        # the output, every step's partial output (the last CP rank's are all full size) and the
        # ring buffers other than the one kept
        core_fwd = q + cp * q + (cp - 1) * 2 * kv1
    else:
        # the output, two partial outputs and two more ring buffers in flight
        core_fwd = 3 * q + 2 * 2 * kv1
    # backward (AttnFuncWithCPAndKVP2P.backward, TE 2.11 and 2.20.2 context_parallel.py), at an upper-triangle step
    # of an early CP rank: the output gradient dO handed in (held by the backward's arguments and read by every
    # step, as under a2a: cp_attention.py), the dq buffer (empty_like(q)), two [2, K/V] ring buffers of K/V and
    # dK/dV, contiguous halves of q, the output and dO, the step's half dq and its dk/dv (4 q + 10 K/V + stats): the
    # non-CP kernel's terms (dO, dq as the buffer, the step's dk/dv, stats) and the ring's own
    core_bwd = fused_attention_bwd(q, kv1, kv1, q, stats) + 2 * 2 * 2 * kv1 + 3 * q // 2 + q // 2
    return saved, core_fwd, core_bwd, False


def _flash_attention_items(L: Layout, x: Shapes, saved: dict[str, int], q: int, kv1: int, qkv_w: int,
                           rope: bool) -> tuple[dict[str, int], int, int, bool]:
    """``--attention-backend flash`` without context parallelism: TE 2.11's FlashAttention (``backends.py``
    FlashAttention.forward, sbhd) copies q, k and v to contiguous [b, s, h, d] tensors (``transpose(0, 1)
    .contiguous()``, or one [3, b, s, h, d] buffer by ``_PrepareQKVForFA``), which flash-attn keeps for its backward
    with its own [b, s, h, d] output and the fp32 log-sum-exp [b, a, s]; TE returns a ``transpose(0, 1)
    .contiguous()`` copy of that output in sbhd, which linear_proj keeps (``proj_input``). The rope'd q and k, the
    q/k norms' outputs and megatron's qkv output (v was a view of it) are then kept by no one (the q/k norms keep
    the qkv output with ``--qk-layernorm``). Backward: flash_attention_bwd."""
    e, Tf = x.e, x.Tf
    stats = x.b * x.a_t * x.s * 4
    originals = sum(saved.pop(n, 0) for n in ("query_norm", "key_norm"))
    if rope:
        originals += q + kv1                          # the rope'd q and k, consumed into the copies
    if L.qk_layernorm:
        saved["qkv_output"] = Tf * qkv_w * e          # the norms' saved inputs are views of it
    else:
        originals += Tf * qkv_w * e
    saved["flash_qkv"] = q + 2 * kv1
    saved["attention_output_bshd"] = q
    saved["softmax_stats"] = stats
    core_fwd = originals + q                          # the inputs the copies came from, the sbhd output copy
    core_bwd = flash_attention_bwd(x, q, kv1, stats)
    return saved, core_fwd, core_bwd, False


def fused_attention_bwd(q: int, k: int, v: int, d_out: int, stats: int) -> int:
    """Working set of TE's cuDNN FusedAttention backward without context parallelism, next to what the core
    attention saved (q, k, v, the output, the softmax statistics): the output gradient ``d_out`` handed in
    (linear_proj's input gradient, held by the backward's argument through the kernel; ``d_out.contiguous()`` is
    a no-op on it), dq, dk, dv shaped like q, k, v (``fused_attn_bwd``: [s, b, g/t, d] for K/V under GQA) and the
    kernel's fp32 softmax-sum scratch [b, a/t, s] (``stats``) (TE 2.11 and 2.20.2 ``backends.py``
    FusedAttnFunc.backward). The same terms as the CP paths' (ring and all-to-all: dO handed in, dq, dk, dv)."""
    return d_out + q + k + v + stats


def flash_attention_bwd(x: Shapes, q: int, kv1: int, stats: int) -> int:
    """Working set of flash-attn 2's backward (TE 2.11 / 2.20.2 FlashAttention, sbhd, without CP) next to what it
    saved: the output gradient handed in (a transposed view of linear_proj's input gradient: its last stride is 1,
    so flash_attn_interface's ``maybe_contiguous`` copies nothing), dq, dk, dv (``empty_like`` q, k, v: K/V with
    g/t heads), and from ``mha_bwd`` (flash-attn 2.7.4.post1 csrc/flash_attn/flash_api.cpp, lines 883-903): the fp32 dq accumulator
    [b, s, a/t, d], the fp32 ``softmax_d`` [b, a/t, s] and, under GQA, dk and dv expanded to every query head
    ([b, s, a/t, d] each, summed into dk, dv after the kernel)."""
    expanded = 2 * q if kv1 < q else 0
    return fused_attention_bwd(q, kv1, kv1, q, stats) + q * 4 // x.e + expanded


def attention_items(L: Layout, x: Shapes, recompute_core: bool, has_batch_mask: bool) -> tuple[dict[str, int], int, int, bool]:
    """Saved bytes of q/k/v handling and the core attention, its forward working set at the softmax
    and its backward working set (with the probs already released), and whether s x s scores exist."""
    kind = attention_kind(L)
    e, Tf, a_t, g_t, d = x.e, x.Tf, x.a_t, x.g_t, x.d
    qkv_w = qkv_kept_per_rank(L)
    rope = L.position_embedding_type in ("rope", "yarn")
    # K and V repeated to the rank's query heads: with fewer groups than TP ranks the core attention is built for
    # one group per rank (Attention.__init__ gives it num_query_groups = TP), so one query head per rank repeats
    # nothing (DotProductAttention.forward: repeat_interleave only where heads / groups > 1)
    gqa = a_t > g_t
    replicated = L.num_query_groups < L.tp
    q = Tf * a_t * d * e
    kv1 = Tf * g_t * d * e
    scores = x.b * a_t * x.s * x.s
    saved: dict[str, int] = {}
    if L.qk_layernorm:
        # q_layernorm / k_layernorm keep fp32 statistics per (token, head); without rope their outputs
        # are what the attention keeps (new tensors next to the qkv output)
        heads = a_t + g_t
        saved["qk_norm_stats"] = Tf * heads * 4 * (2 if L.normalization == "LayerNorm" else 1)
        if not rope and not (gqa and kind not in ("fused", "flex")):
            saved["query_norm"] = q
            saved["key_norm"] = kv1
    if kind == "fused" and L.cp > 1 and not recompute_core:
        return _cp_attention_items(L, x, saved, q, kv1, qkv_w, rope)
    if kind == "fused" and L.attention_backend == "flash" and not recompute_core:
        return _flash_attention_items(L, x, saved, q, kv1, qkv_w, rope)
    if kind in ("fused", "flex"):
        # Flash / cuDNN fused attention keeps q, k, v (v a view of the qkv output, q and k new after
        # rope), the output O (the same storage linear_proj keeps as its input) and fp32 softmax
        # statistics [b, a, s, 1] (TE FusedAttnFunc / FlashAttention autograd functions).
        # Gemma 2's torch.compile'd FlexAttention keeps the same: FlexAttentionAutogradOp saves q, k, v (permuted
        # views, K/V not repeated under enable_gqa), its output and the fp32 logsumexp [b, a/t, s] (torch 2.14
        # _higher_order_ops/flex_attention.py; max_scores is saved too but unused by the backward, so the compiled
        # graph drops it); inductor lays the output out in the query's stride order ([s, b, a, d], kernel/flex/
        # flex_attention.py ``infer_dense_strides``), so Gemma2FlexDotProductAttention's ``.permute(2, 0, 1, 3)
        # .contiguous()`` copies nothing and linear_proj keeps that storage. Its backward allocates dq, dk, dv (K/V
        # heads) and the fp32 ``delta`` [b, a/t, s] next to dO: fused_attention_bwd's terms.
        stats = x.b * a_t * x.s * 4
        saved["qkv_output"] = Tf * qkv_w * e
        if rope:
            saved["query_rope"] = q
            saved["key_rope"] = kv1
        if not recompute_core:
            saved["softmax_stats"] = stats
        core_fwd = q                                   # the output being written
        core_bwd = fused_attention_bwd(q, kv1, kv1, q, stats)
        if recompute_core:
            # CheckpointFunction.backward holds the recomputed output (the gradient it hands on is d_out); the
            # replayed FusedAttnFunc saved its softmax statistics again
            core_bwd += q + stats
        if recompute_core and L.cp > 1:
            # the checkpoint replays the ring forward (its K/V buffer, output and statistics kept) and
            # runs the ring backward (which counts the gradient handed to it); it holds the recomputed output
            _, cp_fwd, cp_bwd, _ = _cp_attention_items(L, x, {}, q, kv1, qkv_w, rope)
            core_bwd = cp_bwd + 2 * kv1 + stats + q
        return saved, core_fwd, core_bwd, False
    # Unfused: the s x s scores and probs exist per layer.
    if recompute_core:
        # tensor_parallel.checkpoint keeps its inputs: q (a copy under GQA or after rope), k and v
        # (views of the qkv output unless rope copied k) -> the qkv output stays alive through v.
        saved["qkv_output"] = Tf * qkv_w * e
        if gqa and not rope and not replicated:
            # (the replicated group's query is a view: its one group's heads reshaped, then sliced)
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
    # TE's unfused attention falls back to torch's softmax where its kernel cannot run (fp32 scores, s >= 16384,
    # ...): that path casts fp16/bf16 scores to fp32 first whatever --attention-softmax-in-fp32 says
    # (UnfusedDotProductAttention builds FusedScaleMaskSoftmax with softmax_in_fp32=True) and keeps its mask
    te_torch = kind == "te_unfused" and not te_softmax_kernel(L, x)
    fused_softmax = kind == "local_fused_softmax" or (kind == "te_unfused" and not te_torch)
    soft32 = (e != 4) if te_torch else L.attention_softmax_in_fp32 and not fused_softmax
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
    te_mask = te_torch_softmax_mask(L, x, has_batch_mask) if te_torch else 0
    if te_mask and not recompute_core:
        saved["causal_mask"] = te_mask                 # made inside the core attention: a checkpoint drops it
    # forward at the softmax: the raw scores (+ fp32 copy, + the mask being built; TE's unfused
    # path also holds its preallocated output buffer) next to the probs being made
    core_fwd = scores * e + (scores * 4 if soft32 else 0) + (8 * x.s * x.s if mask_made else 0)
    if kind == "te_unfused" and not te_torch:
        core_fwd += scores * e
    elif te_torch:
        # get_full_mask's window mask, alive through the forward (the preallocated buffer is gone by the softmax)
        core_fwd += x.s * x.s
    # backward just after the softmax's (the probs are released by then): grads of probs and
    # scores, the masked grad, the bmm's grad buffer, and the grad of v, which waits for the scores' backward
    # (TE's torch-softmax path runs the same torch ops as megatron's unfused one). The context's gradient is
    # gone by then: the bmm's backward read it (a contiguous copy: the context was permuted) and freed it (CPU
    # referee: the attention-only top layer's peak, tests/test_referee_replay.py)
    if kind == "local_unfused" or te_torch:
        core_bwd = scores * (4 * e if not soft32 else 2 * e + 8) + q
    else:
        core_bwd = 2 * scores * e + 2 * q
    if recompute_core:
        # The recomputed forward makes the probs again, but the softmax's backward has consumed them
        # by this step; CheckpointFunction.backward still holds the recomputed context and the
        # gradient handed to it (measured by the CPU referee: recompute core_attn on a PP2 first stage),
        # and under GQA the recomputed repeat of K that the scores' backward still needs.
        core_bwd += 2 * q + (q if gqa else 0) + te_mask   # (TE's torch path: and the remade mask)
    return saved, core_fwd, core_bwd, True


def attention_keeps_proj_input(saved: Mapping[str, int]) -> bool:
    """Whether the BF16 tensor linear_proj reads (``proj_input``) is also saved by the core attention, from a
    layer's saved names: TE's FusedAttention (``FusedAttnFunc`` saves ``out`` and returns it, viewed) and its p2p
    ring under context parallelism (``AttnFuncWithCPAndKVP2P`` saves and returns ``out_f16``) keep it when they
    run with autograd (their softmax statistics are saved) (TE 2.11 ``backends.py``, ``context_parallel.py``).
    Nothing else keeps it: unfused attention (its context is a new tensor the bmm does not save), ``core_attn``
    recompute (the checkpoint runs the attention without autograd), the output gate (linear_proj reads the gated
    product), the flash backend with or without CP (linear_proj reads a ``.contiguous()`` sbhd copy of the
    ``attention_output_bshd`` flash-attn or the ring keeps), the CP all-to-all (``a2a``, TE 2.20.2's two-level
    ``a2a+p2p``, FP8 attention's ``a2a`` under tensorwise scaling: it keeps the output before its exchange,
    ``cp_a2a_attention_output``; layers/cp_attention.py, layers/fp8_attention.py)."""
    return "softmax_stats" in saved and not ("gate_attention_output" in saved or "attention_output_bshd" in saved
                                             or "cp_a2a_attention_output" in saved)


def reads_batch_mask(L: Layout) -> bool:
    """Whether ``has_batch_mask`` changes the layer's tensors: megatron's unfused local attention builds (and
    keeps) a causal mask when the data loader made none, TE's torch-softmax path keeps a mask as wide as the
    batch's (attention_items)."""
    if not L.create_attention_mask_in_dataloader:
        return False
    kind = attention_kind(L)
    return kind == "local_unfused" or (kind == "te_unfused" and not te_softmax_kernel(L, shapes(L)))


def activations(L: Layout, mods: set, has_batch_mask: bool, drop_norm: bool, after: frozenset,
                released: frozenset, G: int) -> MixerActivations:
    """The input norm, q/k/v, the core attention and linear_proj's input. ``after``: names of the
    layer made after linear_proj; ``released``: names released before linear_proj's backward; ``G``:
    the gradient of the layer output, alive through the whole backward."""
    x = shapes(L)
    te = L.transformer_impl == "transformer_engine"
    T, Tf, h, e, d = x.T, x.Tf, x.h, x.e, x.d
    recompute_core = "core_attn" in mods
    qkv_w = qkv_out_per_rank(L)
    rope = L.position_embedding_type in ("rope", "yarn")
    saved: dict[str, int] = {"norm1_stats": norm_stats(L, T)}
    if not drop_norm:
        saved["qkv_input"] = T * h * e                        # norm output, kept by linear_qkv (local shard under SP)
    att, core_fwd, core_bwd, unfused = attention_items(L, x, recompute_core, has_batch_mask)
    ctx_w = x.a_t * d                                         # width of the attention context
    saved.update(att)
    ctx = Tf * ctx_w * e
    gated = _gated(L) == 2
    if gated:
        # --attention-output-gate: x * sigmoid(gate) in a torch.compile'd function (_apply_output_gate,
        # megatron.core.jit: jit_fuser = torch.compile from torch 2.2), which keeps its two inputs (checked
        # with torch.compile on CPU): the attention output, and the gate. get_query_key_value_tensors reshapes
        # the gate [s, b, groups, heads/group * d] to [s, b, heads, d]: a view of linear_qkv's output (which then
        # stays alive whole) with one query group or one head per group on the rank, a copy otherwise.
        # linear_proj keeps the gated product, a new tensor
        if x.g_t == 1 or x.a_t == x.g_t:
            saved["qkv_output"] = Tf * qkv_kept_per_rank(L) * e
        else:
            saved["output_gate"] = ctx
        saved["gate_attention_output"] = ctx
    if rope and not L.apply_rope_fusion and not te:
        # unfused rope (rope_utils._apply_rotary_pos_emb_bshd) casts cos and sin to the activation
        # dtype for q and for k; the products keep them: 4 x [s, 1, 1, rotary dim] per layer
        saved["rope_cos_sin"] = 4 * x.s * int(d * L.rotary_percent) * e
    saved["proj_input"] = Tf * ctx_w * e                      # attention context, kept by linear_proj
    fwd_steps = ((after | {"proj_input"}, core_fwd),)
    rel_proj = released | {"proj_input"}
    gate_steps: tuple = ()
    if gated:
        # at the core attention's forward the gate's saved output does not exist yet; in the backward the
        # gate's step holds the output gradient and the gradients of its two inputs, and the gate's
        # gradient waits for linear_qkv's backward (the split's) through the core attention's
        fwd_steps = ((after | {"proj_input", "gate_attention_output"}, core_fwd),)
        gate_steps = ((rel_proj, G + 3 * ctx),)
        rel_proj = rel_proj | {"gate_attention_output", "output_gate"}
        core_bwd += ctx
    # by the softmax's backward the bmm with V has run its backward: the probs and V's repeated copy are gone
    rel_softmax = rel_proj | {"attention_probs", "value_repeated"}
    core_steps: tuple = ()
    if (attention_kind(L) == "local_unfused" and not recompute_core and not gated and not L.qk_layernorm
            and "qkv_output" in att and "query_rope" in att):
        # megatron's unfused attention without GQA: rope made q and k new tensors, so linear_qkv's output is kept
        # only through v, a view the bmm with the probs saves (dot_product_attention.py, megatron-core 0.16.1 and
        # 0.19.2). The bmm's backward (its saved probs and v, the probs' gradient, the context's gradient and v's)
        # frees it before the softmax's (CPU referee: a heterogeneous block with its own 8 query groups,
        # tests/test_heterogeneous.py)
        rel_softmax = rel_softmax | {"qkv_output"}
        core_steps = ((rel_proj, G + x.b * x.a_t * x.s * x.s * e + 2 * Tf * ctx_w * e),)
    # (the core attention's autograd node frees what it saved: flash-attn's q, k, v copies and output, the ring's
    # last K/V buffer)
    rel_core = rel_proj | {"attention_probs", "softmax_stats", "causal_mask", "flash_qkv", "attention_output_bshd",
                           "cp_kv_buffer"}
    rel_qkv = rel_core | {"qkv_output", "query", "key_repeated", "value_repeated", "query_rope", "key_rope",
                          "rope_cos_sin", "query_norm", "key_norm", "qk_norm_stats"}
    bwd_steps = (
        (released, G + Tf * ctx_w * e + wgrad(L, h, ctx_w)),                                       # linear_proj
        *gate_steps,                                                                               # output gate
        *core_steps,                                                                               # the bmm with v
        (rel_softmax if unfused else rel_proj, G + core_bwd),                                      # core attention
        (rel_core, G + Tf * qkv_w * e + Tf * h * e + wgrad(L, qkv_w, h)),                         # linear_qkv
        (rel_qkv, G + Tf * h * e + T * h * e + (T * h * e if drop_norm else 0)),                  # input norm
    )
    return MixerActivations(saved=saved, fwd_steps=fwd_steps, bwd_steps=bwd_steps)


def bound_saved(L: Layout, tp: int, b: int, seq: int, sp: bool, mods: set) -> int:
    """Bytes one layer's attention surely keeps per micro-batch whatever the kernels (the planner's
    memory lower bound, before any layout is resolved): linear_qkv's input (unless the local spec
    recomputes the norm), q/k/v (or their larger repeated / rotated copies, which selective recompute
    keeps as the checkpoint's inputs), the attention output that linear_proj keeps, and the s x s
    softmax output of unfused attention. ``L``: the model (any TP); ``seq``: tokens per CP rank."""
    e, h = L.act_bytes, L.hidden_size
    Tf = b * seq
    T = Tf // tp if sp else Tf
    a_t = L.num_attention_heads // tp
    kept = 0 if ("layernorm" in mods and L.transformer_impl == "local") else T * h * e
    # FP8 attention (layers/fp8_attention.py) keeps q, k, v and, under delayed scaling, the output at 1 B/elem
    qkv_e = 1 if L.fp8_spec.fp8_dot_product_attention else e
    kept += Tf * ((L.num_attention_heads + 2 * L.num_query_groups) * L.kv_channels // tp) * qkv_e
    kept += Tf * a_t * L.kv_channels * qkv_e
    if _unfused(L) and "core_attn" not in mods:
        kept += b * a_t * seq * seq * e
    return kept


def _unfused(L: Layout) -> bool:
    """The s x s scores are materialised (local spec, or --attention-backend unfused; not Gemma 2's FlexAttention,
    which runs whatever TE backend is asked for)."""
    if getattr(L, "gemma2_attention", False) and L.transformer_impl != "local":
        return L.attention_backend == "local"
    return L.transformer_impl == "local" or L.attention_backend in ("unfused", "local")


def qkv_gemms(L: Layout, tp: int, M: int, tok: int) -> list[tuple[int, int, int]]:
    """(tokens, output width, input width) of the GEMMs before the core attention on one TP rank, for
    the planner's time model: linear_qkv on the gathered tokens ``M`` (KV heads replicated when
    TP > query groups). ``tok``: the sequence-parallel tokens of the rank."""
    a_t, g_t = L.num_attention_heads // tp, max(1, L.num_query_groups // tp)
    return [(M, (_gated(L) * a_t + 2 * g_t) * L.kv_channels, L.hidden_size)]


def rope_elements(L: Layout, tp: int, M: int) -> int:
    """Elements the rotary embedding rotates on one TP rank (q and k), 0 without rope."""
    if L.position_embedding_type not in ("rope", "yarn"):
        return 0
    return M * (L.num_attention_heads // tp + max(1, L.num_query_groups // tp)) * L.kv_channels


def rotary_cache(L: Layout, layers: int) -> tuple[int, str] | None:
    """The persistent rotary table of a rank, (bytes, detail), or None without rope: one per process
    whatever the layers (``layers`` is not needed)."""
    if L.position_embedding_type not in ("rope", "yarn"):
        return None
    rot = int(L.kv_channels * L.rotary_percent)
    # RotaryEmbedding.forward (lru_cache) returns this CP rank's rows: get_pos_emb_on_this_cp_rank
    # index_selects its two s/(2 CP) chunks into a new tensor; the full table is a temporary
    one = L.seq_length // L.cp * rot * 4
    tables = getattr(L, "rotary_tables", 1)
    if tables > 1:
        # Gemma3RotaryEmbedding: the global table (its own RotaryEmbedding.forward, lru_cache) and the local one
        # (rope_local.forward, lru_cache); Megatron-Bridge 0.6.2 (gemma3_provider.py) also caches their torch.stack
        # (_forward_cached: 4 tables' bytes), NeMo 2.5.0 (gemma3.py) returns the two as a tuple (2)
        return tables * one, f"cached fp32 rotary frequencies, {tables} x [s/CP, 1, 1, d] (local and global tables)"
    return one, "cached fp32 rotary frequencies [s/CP, 1, 1, d]"


FLEX_BLOCK = 128   # torch.nn.attention.flex_attention _DEFAULT_SPARSE_BLOCK_SIZE (create_block_mask's BLOCK_SIZE)


def flex_block_masks(L: Layout, layers: int) -> tuple[int, str] | None:
    """The BlockMask each of ``layers`` Gemma 2 attention layers caches (Gemma2FlexDotProductAttention
    ``_flex_block_mask_cache``, one per layer instance and sequence length; Megatron-Bridge 0.6.2 gemma2_provider.py),
    or None: create_block_mask with B = H = None keeps four int32 block counts [1, 1, n] and four int32 block-index
    tables [1, 1, n, n] (kv, full kv, q, full q), n = ceil(s / 128) (measured on torch 2.13 and 2.14: 16,896 B at
    s = 4096), local and global layers alike."""
    if attention_kind(L) != "flex" or not layers:
        return None
    n = -(-L.seq_length // FLEX_BLOCK)
    return (layers * 4 * 4 * (n * n + n),
            f"FlexAttention block masks of {layers} layer(s), 4 x [1, 1, {n}, {n}] + 4 x [1, 1, {n}] int32 each")


def head_dims(L: Layout) -> tuple[int, int]:
    """(query/key, value) head dims: both kv_channels."""
    return L.kv_channels, L.kv_channels
