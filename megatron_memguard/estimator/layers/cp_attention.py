"""BF16 core attention under context parallelism with an all-to-all: ``--cp-comm-type a2a`` (Transformer Engine's
``AttnFuncWithCPAndQKVOA2A``) and ``a2a+p2p`` over two levels (``AttnFuncWithCPAndKVP2P`` with an all-to-all over
``cp_a2a_size`` ranks around a ring over the others). A pass over the p2p ring's mixer (layers/attention.py
``_cp_attention_items``), as FP8 attention's is (layers/fp8_attention.py, which shares ``a2a_peak``).

Source: TE 2.11 (megatron-core 0.16) and TE 2.20.2 (later releases) ``attention/dot_product_attention/
context_parallel.py`` and ``backends.py`` (FusedAttention / FlashAttention ``forward`` under CP).

Sizes per layer, this CP rank: ``Q`` bytes of q (and of the output), ``[b s/CP, a/TP, d]``; ``K`` of k (and of v),
``[b s/CP, g/TP, d]``; ``W = Q + 2 K``. The all-to-all turns ``[s/CP, heads]`` into ``[s, heads/CP]``: the same bytes.

* ``a2a`` (both TE versions; the BF16 tensors saved are the same): the function saves the exchanged q, k, v (three
  new tensors, ``cp_a2a_qkv`` = W), the kernel's fp32 softmax statistic (``[b, a/CP, s]``: the ring's bytes) and
  its output BEFORE the exchange back (``cp_a2a_attention_output`` = Q): a tensor other than the exchanged one it
  returns, which linear_proj keeps (``proj_input``). No ring buffer; Megatron's rope'd q (the ring kept it) is
  kept by no one. Flash backend: the same, the pre-exchange output being flash-attn's ``[b, s, h, d]`` one (the ring's
  ``attention_output_bshd``). Against the ring's estimate the fused backend keeps Q more per layer.
* ``a2a+p2p`` over two levels: the ring's saved tensors keep their bytes (its q is the exchanged one). TE 2.11: the
  output exchanged back is the one returned and saved (linear_proj's, as in the ring); TE 2.20.2 saves the ring's
  output before its exchange (``out_part``): ``cp_a2a_attention_output`` = Q next to linear_proj's (flash: in place of
  ``attention_output_bshd``). The ring's working sets count ``CP / cp_a2a_size`` steps.

MXFP8 attention (``mxfp8``, TE 2.20.2 with ``fp8_recipe.mxfp8()``): the BF16 q, k, v are exchanged as above
(4725-4733: no quantization before it) and then quantized (4790-4800: ``combine_and_quantize`` with
``used_in_backward`` on: q, k, v rowwise and columnwise, re-laid E8M0 scales). ``a2a`` saves those MXFP8 copies
(``fp8_attention_qkv`` in place of ``cp_a2a_qkv``; 4974-4979: ``fp8_tensors = (q_part, k_part, v_part, None)``) and
``out_part``, the kernel's BF16 output before its exchange, as in BF16; the exchanged BF16 q, k, v stay referenced
(the ``q, k, v`` locals) to the forward's end. Its backward (5083-5190) exchanges dO in BF16, keeps the exchanged dO
(``aux_ctx_tensors.append(dout)``) next to its MXFP8 copy (both ways), and exchanges the kernel's BF16 dq, dk, dv.
The two-level MXFP8 path is the MXFP8 ring's (layers/fp8_attention.py ``mxfp8_ring_attention``).

Not counted: the rng state (a few bytes), cuDNN's workspace (not counted without CP either), Megatron's rope'd k
and its qkv output alive through the forward (not counted for the ring either)."""
from __future__ import annotations

from ...layout import Layout
from .base import MixerActivations, shapes

# the q the ring kept (attention.py _cp_attention_items): under a2a the function keeps its exchanged copy instead
_RING_Q = ("query_rope", "query", "query_norm")
# names the all-to-all's saved tensors go by (released with the core attention's backward)
_A2A_NAMES = frozenset({"cp_a2a_qkv", "cp_a2a_attention_output"})


def a2a_peak(sizes: tuple[int, ...], before_attn: bool) -> int:
    """Peak bytes ``flash_attn_a2a_communicate`` (TE 2.11 and 2.20.2 ``context_parallel.py``) holds for tensors
    of ``sizes`` bytes, its callers' tensors not included; what it returns (one tensor per input) is part of it.

    Per tensor it makes a send copy (``movedim(-3, 0).contiguous()`` before the attention; after it the chunk
    reorder: ``movedim(...).contiguous()`` then ``index_select``, two copies, the first freed), an
    ``all_to_all_single`` receive buffer (``empty_like``), and the reordered result (before the attention: the
    chunk reorder of the received buffer, two copies; after it one ``contiguous()`` copy), which replaces the
    received buffer. The send copies live in the caller's list until the function returns. The loop runs
    ``len(sizes) + 2`` times: receive buffer ``i - 1``, then (before the attention) reorder of ``i - 2`` and
    send copy ``i``; (after it) send copy ``i``, then the copy of ``i - 2``."""
    n = len(sizes)
    sent = recv = peak = 0
    for i in range(n + 2):
        if 0 < i < n + 1:
            recv += sizes[i - 1]
            peak = max(peak, sent + recv)
        if before_attn:
            if i > 1:
                peak = max(peak, sent + recv + 2 * sizes[i - 2])
            if i < n:
                sent += sizes[i]
                peak = max(peak, sent + recv)
        else:
            if i < n:
                peak = max(peak, sent + recv + 2 * sizes[i])
                sent += sizes[i]
            if i > 1:
                peak = max(peak, sent + recv + sizes[i - 2])
    return peak


def cp_a2a_attention(L: Layout, mixer: MixerActivations, mxfp8: bool = False) -> MixerActivations:
    """The BF16 attention mixer of a layer whose CP attention runs an all-to-all (``L.cp_a2a_size`` > 1), from the
    p2p ring's mixer ``mixer`` (fused or flash backend; with or without ``core_attn`` recompute). ``mxfp8``: the
    all-to-all over every CP rank running MXFP8 attention (the FP8 layers' core attention, TE 2.20.2)."""
    from .attention import _cp_attention_items, _gated, _te_ring_out_part, qkv_out_per_rank
    x = shapes(L)
    e = x.e
    qkv8 = do8 = 0
    if mxfp8:
        # the exchanged q, k, v ([s, b, heads / CP, d]) and dO in MXFP8, both usages each
        from .fp8_attention import mxfp8_attention_tensors
        n, tok = L.cp_a2a_size, L.cp_a2a_size * x.Tf
        qkv8 = mxfp8_attention_tensors(tok, ((x.a_t // n, x.d), (x.g_t // n, x.d), (x.g_t // n, x.d)))
        do8 = mxfp8_attention_tensors(tok, ((x.a_t // n, x.d),))
    Q = x.Tf * x.a_t * x.d * e
    K = x.Tf * x.g_t * x.d * e
    W = Q + 2 * K
    stats = x.b * x.a_t * x.s * 4                      # fp32 [b, a/CP, s] = the ring's [b, a, s/CP]
    flash = L.attention_backend == "flash"
    rope = L.position_embedding_type in ("rope", "yarn")
    a2a = L.cp_a2a_size
    two_level = a2a < L.cp
    ring = L.cp // a2a
    _, ring_fwd, ring_bwd, _ = _cp_attention_items(L, x, {}, Q, K, qkv_out_per_rank(L), rope, ring)
    core = 2 if _gated(L) == 2 else 1                  # the core attention's backward step
    qkv_in = a2a_peak((Q, K, K), True)                 # Megatron's q, k, v exchanged (the results included)
    out_a2a = a2a_peak((Q,), False)                    # the output exchanged back (the result included)
    # the output saved before its exchange, apart from linear_proj's: a2a, and TE >= 2.15's two-level path
    out_part = not two_level or _te_ring_out_part(L)
    if not two_level:
        # backward: dO handed in; its exchange; the kernel's dq, dk, dv (with the exchanged dO; MXFP8: next to its
        # MXFP8 copy) and their exchange
        bwd = Q + max(a2a_peak((Q,), True), Q + do8 + W + a2a_peak((Q, K, K), False))
    else:
        # TE 2.11 exchanges the saved output with dO ([out, dout]) before the ring, TE 2.20.2 dO alone; both are kept
        # through the ring, whose dO is the exchanged one (ring_bwd counts a dO: the one in ``held``); then the ring's
        # dq, dk, dv exchanged
        held = Q if out_part else 2 * Q
        first = a2a_peak((Q,), True) if out_part else a2a_peak((Q, Q), True)
        bwd = Q + max(first, held + ring_bwd - Q, held + W + a2a_peak((Q, K, K), False))
    (names, _), *rest = mixer.fwd_steps
    saved = mixer.saved
    if "softmax_stats" not in saved:
        # core_attn recompute: the checkpoint keeps Megatron's q, k, v (saved tensors unchanged); its no-grad forward
        # makes the transients, and the backward's replay keeps what the function saves (and the output it returns)
        # through its backward. v made contiguous (FusedAttention.forward; flash: q, k, v copied to [b, s, h, d])
        # throughout
        if not two_level:
            # (MXFP8: the exchanged BF16 q, k, v next to their saved MXFP8 copies)
            kept = (qkv8 if mxfp8 else W) + stats + Q + Q
            fwd = max(qkv_in, W + qkv8 + stats + Q + out_a2a)
        else:
            kept = Q + 2 * K + stats + Q + (Q if out_part else 0)   # exchanged q, last K/V buffer, statistic, output
            fwd = max(qkv_in, Q + ring_fwd, Q + 2 * K + stats + Q + out_a2a)
        recomputed = ring_bwd + 2 * K + stats + Q       # attention_items' recompute step under CP (the ring's)
        steps = tuple((rel, w + kept + bwd - recomputed if i == core else w)
                      for i, (rel, w) in enumerate(mixer.bwd_steps))
        return mixer._replace(fwd_steps=((names, (W if flash else K) + fwd),) + tuple(rest), bwd_steps=steps)
    new: dict[str, int] = {}
    dropped = 0
    for name, b in saved.items():
        if not two_level and name in _RING_Q:
            dropped += b                               # Megatron's q: alive through the forward only
            continue
        if name == "attention_output_bshd" and out_part:
            continue                                   # flash: the output before the exchange is the one kept
        if name == "cp_kv_buffer" and not two_level:
            # the exchanged q, k, v in place of the ring's buffer (MXFP8: their MXFP8 copies)
            new["fp8_attention_qkv" if mxfp8 else "cp_a2a_qkv"] = qkv8 if mxfp8 else W
            continue
        new[name] = b
        if name == "softmax_stats" and out_part:
            new["cp_a2a_attention_output"] = Q
    # inputs alive through the forward: Megatron's q (two levels: the ring keeps the exchanged one), v made
    # contiguous by FusedAttention (flash: q, k, v copied to [b, s, h, d] by FlashAttention.forward)
    alive = (dropped if not two_level else Q) + (W if flash else K)
    made = {"cp_a2a_qkv", "cp_kv_buffer", "softmax_stats", "attention_output_bshd", *_RING_Q} | _A2A_NAMES
    if not two_level:
        fwd = ((names | made, alive + qkv_in),
               # the kernel's output (saved) and its exchange back into proj_input (flash: a copy of it)
               (names | {"attention_output_bshd"}, alive + out_a2a))
        if mxfp8:
            # the exchanged BF16 q, k, v (not saved: the q, k, v locals, to the forward's end) quantized, their MXFP8
            # copies counted here while made; then the output's exchange next to them
            made |= {"fp8_attention_qkv"}
            fwd = ((names | made, alive + qkv_in), (names | made, alive + W + qkv8),
                   (names | {"attention_output_bshd"}, alive + W + out_a2a))
    else:
        ring_names = {"cp_kv_buffer", "softmax_stats", "attention_output_bshd"} | _A2A_NAMES
        fwd = ((names | made, alive + qkv_in),
               # the ring over CP / a2a ranks next to the exchanged q it keeps
               (names | ring_names, alive + ring_fwd),
               # the ring's output (TE 2.11: BF16, not saved; TE 2.20.2: saved, out_part) exchanged back
               (names | {"attention_output_bshd"}, alive + (0 if out_part else Q) + out_a2a))
    steps = []
    for i, (rel, w) in enumerate(mixer.bwd_steps):
        if i == core:
            w += bwd - ring_bwd
        elif "softmax_stats" in rel:
            rel = rel | _A2A_NAMES | ({"fp8_attention_qkv"} if mxfp8 else set())
        steps.append((rel, w))
    return MixerActivations(saved=new, fwd_steps=fwd + tuple(rest), bwd_steps=tuple(steps))
