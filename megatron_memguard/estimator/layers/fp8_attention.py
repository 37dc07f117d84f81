"""FP8 core attention (``fp8_dot_product_attention``): what Transformer Engine 2.11's FusedAttention keeps
and holds when an FP8 layer runs its dot-product attention in FP8 (the delayed and tensorwise recipes, the only
ones TE 2.11's DotProductAttention accepts; the mxfp8 recipe as TE 2.20.2 runs it: ``mxfp8_attention`` and, under
CP, ``mxfp8_ring_attention`` (p2p, a2a+p2p), ``mxfp8_all_gather`` and layers/cp_attention.py (a2a), at the end;
resolve/fp8.py refuses or drops the others).

Source: TE 2.11 ``attention/dot_product_attention/backends.py`` ``FusedAttnFunc`` (forward and backward),
``utils.py`` ``combine_and_quantize``, ``csrc/extensions/attention.cpp`` ``fused_attn_fwd`` (aux tensors):

* q, k, v are concatenated (a BF16 copy) and quantized as one Float8Tensor [tokens, (a + 2 g) d]; the
  forward saves that FP8 copy instead of the BF16 q, k, v: the rope'd q and k and the qkv output (whose view
  v is) are no longer kept by the attention (the qk norms keep the qkv output with ``--qk-layernorm``).
* The FP8 kernel returns fp32 softmax statistics per (token, head): two up to TE 2.14.1 (M and ZInv), one from
  2.15.0 as BF16 attention (estimator/te_release.py ``fp8_softmax_stats``; the run's TE: core 0.16 2.11, later
  cores 2.20.2, or ``MEMGUARD_TE_VERSION``).
* The recipe is the attention's (``attention_recipe``): the layer's, or the one ``NVTE_DPA_FP8_RECIPE`` switches
  to (TE ``DotProductAttention.init_fp8_metadata``).
* delayed: the output comes out in FP8; it is saved (1 B/elem) and dequantized into the BF16 tensor
  linear_proj reads, which nothing keeps (linear_proj keeps its own quantized copy, ``fp8_proj_input``).
  tensorwise (``NVTE_DPA_FP8CS_O_in_F16=1``, TE's default): the output stays BF16 and is saved as such.
* backward (``NVTE_FP8_DPA_BWD=1``, the default): the output gradient is quantized (1 B/elem), and under
  delayed scaling dq, dk, dv come out in FP8 and are dequantized into BF16 ones.
* ``--attention-output-gate``: the gate keeps its two inputs (layers/attention.py), so the BF16 output stays
  saved (``gate_attention_output``) and, under delayed scaling, the FP8 one is kept next to it
  (``fp8_attention_output``; linear_proj reads the gated product);
  a gate that is a view of the qkv output keeps that output alive.

Not counted: the recipe state of DotProductAttention's quantizers (a few KB per layer) and cuDNN's
workspace (not counted for BF16 attention either). With ``core_attn`` recompute the checkpoint keeps the
BF16 q, k, v it replays from: the saved tensors do not change, the replay's FP8 tensors join the core
attention's backward step (docs/terms/fp8.md)."""
from __future__ import annotations

from typing import Mapping

from ...layout import Layout
from ..fp8 import _alloc, quantized_tensor
from ..te_release import AG_OUT_ZEROS_SINCE, attention_recipe, fp8_softmax_stats, te_at_least
from .attention import _gated
from .base import MixerActivations, Shapes, shapes
from .cp_attention import a2a_peak


def dpa_recipe(L: Layout) -> str | None:
    """The recipe the core attention runs in: the layer's, or the one NVTE_DPA_FP8_RECIPE switches to."""
    return attention_recipe(L.fp8_spec.recipe, L.env_dict, L.megatron_version)


# the BF16 tensors of q, k, v that only the core attention kept
_BF16_INPUTS = ("query_rope", "key_rope", "query_norm", "key_norm")
# multi-latent attention's: query, key [Tf, a, qk + rope dim] and value [Tf, a, v], made contiguous by
# MLASelfAttention for TE (layers/mla.py)
_MLA_BF16_INPUTS = ("query", "key", "value")


def _bf16_dropped(L: Layout, x: Shapes, saved: Mapping[str, int], mla: bool, gated: bool) -> dict[str, int]:
    """The BF16 tensors FP8 attention no longer keeps (it saves its own quantized q, k, v): the rope / norm outputs
    (MLA: q, k, v), and the qkv output unless the q/k norms' saved inputs, or a gate that is a view of it, hold it."""
    dropped = {n: saved[n] for n in (_MLA_BF16_INPUTS if mla else _BF16_INPUTS) if n in saved}
    gate_view = gated and (x.g_t == 1 or x.a_t == x.g_t)
    if "qkv_output" in saved and not (L.qk_layernorm or gate_view):
        dropped["qkv_output"] = saved["qkv_output"]
    return dropped


def _bf16_output_kept(L: Layout, gated: bool) -> bool:
    """Whether another module keeps the BF16 attention output next to the FP8 one delayed-scaling attention saves:
    the output gate, or linear_proj when its linear recipe is not delayed (``set_save_original_input``,
    fp8_layers.py ``proj_saves_original_input``; delayed attention under other linears: ``NVTE_DPA_FP8_RECIPE``)."""
    from ..fp8_layers import proj_saves_original_input
    return gated or proj_saves_original_input(L.fp8_spec)


def _replayed_at(mixer: MixerActivations, core: int, replay: int) -> MixerActivations:
    """core_attn recompute: the saved tensors do not change; the replay's quantized tensors join backward step
    ``core`` (the core attention's)."""
    return mixer._replace(bwd_steps=tuple((rel, w + replay if i == core else w)
                                          for i, (rel, w) in enumerate(mixer.bwd_steps)))


def fp8_attention(L: Layout, mixer: MixerActivations, mla: bool = False) -> MixerActivations:
    """The standard attention mixer (or, ``mla``, multi-latent attention's) of an FP8 layer with its core
    attention in FP8. Multi-latent attention goes through the same FusedAttnFunc path: one FP8 buffer of
    q, k ``[Tf, a, qk + rope dim]`` and v ``[Tf, a, v]`` (``combine_and_quantize``, qkv layout sbhd_sbhd_sbhd),
    an output of v's width."""
    if L.cp > 1:
        # the all-to-all over every CP rank (a2a), or the ring (p2p; a2a+p2p over two levels: the ring with a2a ranks)
        a2a = L.cp_a2a_size
        if dpa_recipe(L) == "mxfp8":
            if a2a == L.cp:
                # AttnFuncWithCPAndQKVOA2A: BF16 q, k, v exchanged, then quantized (layers/cp_attention.py)
                from .cp_attention import cp_a2a_attention
                return cp_a2a_attention(L, mixer, mxfp8=True)
            if L.cp_kv_all_gather:
                return fp8_all_gather_attention(L, mixer)
            return mxfp8_ring_attention(L, mixer, a2a)
        if a2a == L.cp:
            return fp8_a2a_attention(L, mixer)
        if L.cp_kv_all_gather:                        # resolve/fp8.py keeps FP8 here from TE 2.15 only
            return fp8_all_gather_attention(L, mixer)
        return fp8_ring_attention(L, mixer, a2a)
    recipe = dpa_recipe(L)
    if recipe == "mxfp8":
        return mxfp8_attention(L, mixer, mla)
    saved = mixer.saved
    x = shapes(L)
    e, Tf, d = x.e, x.Tf, x.d
    n_stats = fp8_softmax_stats(L.env_dict, L.megatron_version)
    if mla:
        width = x.a_t * (2 * (L.qk_head_dim + L.qk_pos_emb_head_dim) + L.v_head_dim)
        ctx_w = x.a_t * L.v_head_dim
    else:
        width = (x.a_t + 2 * x.g_t) * d                # q, k, v of the rank's heads
        ctx_w = x.a_t * d
    qkv8 = quantized_tensor(recipe, Tf, width, rowwise=True, columnwise=False).allocated
    out8 = quantized_tensor(recipe, Tf, ctx_w, rowwise=True, columnwise=False).allocated
    gated = _gated(L) == 2
    delayed = recipe == "delayed"
    core = 2 if gated else 1                           # the core attention's backward step
    if "softmax_stats" not in saved:
        # core_attn recompute: the checkpoint keeps the BF16 q, k, v (saved tensors unchanged); its replay in the
        # backward makes what the FP8 forward keeps (FP8 q, k, v, a second fp32 statistic up to TE 2.14, delayed:
        # the FP8 output), alive through the core attention's backward with the FP8 output gradient (and FP8
        # dq/dk/dv)
        replay = qkv8 + (n_stats - 1) * x.b * x.a_t * x.s * 4 + out8 + (qkv8 + out8 if delayed else 0)
        return _replayed_at(mixer, core, replay)
    dropped = _bf16_dropped(L, x, saved, mla, gated)
    new: dict[str, int] = {}
    for name, b in saved.items():
        if name in dropped:
            continue
        if name == "softmax_stats":
            new["fp8_attention_qkv"] = qkv8
            b = n_stats * x.b * x.a_t * x.s * 4        # M and ZInv (TE <= 2.14), or one; fp32 [b, a, s, 1]
        elif name == "proj_input" and delayed:
            if _bf16_output_kept(L, gated):
                # the gate (gate_attention_output) or linear_proj (proj_input) keeps the BF16 output
                new["fp8_attention_output"] = out8
            else:
                b = out8                               # the FP8 output the attention keeps
        new[name] = b
    bf16_inputs = sum(dropped.values())
    (names, _), *rest = mixer.fwd_steps
    out_bf16 = Tf * ctx_w * e
    fwd = (
        # combine_and_quantize: the BF16 q, k, v, their concatenation and its FP8 copy
        (names | {"fp8_attention_qkv", "softmax_stats"}, bf16_inputs + Tf * width * e + qkv8),
        # the kernel's output (delayed: FP8, then dequantized for linear_proj)
        (names | {"fp8_attention_output"}, bf16_inputs + out_bf16 + (out8 if delayed else 0)),
    )
    # backward at the core attention (after linear_proj's step and the gate's): the quantized output gradient;
    # delayed: FP8 dq, dk, dv before their dequantized BF16 copies, and, when it is proj_input (released at that
    # step), the FP8 output the attention still holds
    core_extra = out8 + (qkv8 + (0 if _bf16_output_kept(L, gated) else out8) if delayed else 0)
    bwd = []
    for i, (rel, w) in enumerate(mixer.bwd_steps):
        if i == core:
            w += core_extra
        elif "softmax_stats" in rel:
            rel = rel | {"fp8_attention_qkv", "fp8_attention_output"}
        bwd.append((rel, w))
    return MixerActivations(saved=new, fwd_steps=fwd + tuple(rest), bwd_steps=tuple(bwd))


# the BF16 q the ring attention kept (attention.py _cp_attention_items): FP8 ring attention keeps FP8 q instead
_BF16_RING_INPUTS = ("query_rope", "query", "query_norm")


def fp8_ring_attention(L: Layout, mixer: MixerActivations, a2a: int = 1) -> MixerActivations:
    """FP8 attention under context parallelism with cp_comm_type p2p (a2a: ``fp8_a2a_attention``):
    Transformer Engine's ``AttnFuncWithCPAndKVP2P`` with ``fp8`` (TE 2.11 ``context_parallel.py``; TE 2.20.2, for
    megatron-core >= 0.17, holds two ring buffers instead of one per step (from TE 2.20) and casts the fp32 output to
    BF16 twice (from TE 2.15): ``out_part`` (2255), which it saves, and the returned ``out_f16`` (2298); the run's TE:
    estimator/te_release.py).

    Saved (forward's end, ``ctx.fp8``): ``q_fp8`` (a view of combine_and_quantize's one FP8 buffer of q, k, v:
    the whole ``[Tf, (a + 2 g) d]`` stays), ``kv_fp8`` (the last ring buffer, FP8 K and V), the merged fp32
    log-sum-exp ``[b, a, s]`` (one statistic: only M of each step's M / ZInv is kept), and the output: FP8 under
    delayed scaling (``O_quantizer(out_f16)``), the BF16 one under tensorwise (``NVTE_DPA_FP8CS_O_in_F16=1``): in
    TE 2.11 the returned tensor linear_proj keeps too, in TE 2.20.2 ``out_part``, a second BF16 copy
    (``cp_a2a_attention_output``; under delayed scaling a forward transient). The BF16 q the BF16 ring kept is not
    saved.

    Forward working set at the output correction: each step's partial output dequantized to fp32 ``[Tf, a d]``
    and its fp32 statistic (TE 2.11: every step's, kept in ``out_per_step``; TE 2.20.2: two), the ring buffers
    other than the saved one (TE 2.11: all of them; 2.20.2: two in flight), the fp32 corrected output, its BF16
    cast and (delayed) its FP8 copy; v made contiguous (``FusedAttention.forward``) throughout.

    Backward working set (``backward``, FP8 branch): dO in FP8, the BF16 dO handed in, the receive buffer of K/V,
    ``dkv_send_buffer`` / ``dkv_recv_buffer`` of ``cp x`` FP8 dK/dV each, and delayed: ``dq_buffer`` of ``cp x`` FP8
    dq, every step's FP8 dq/dk/dv collected and, at the end, ``combine_and_dequantize`` of the ``cp`` steps'
    results to fp32 and their sum (fp32, then BF16); tensorwise: fp32 dq and dK/dV accumulators, each step's
    BF16 dq/dk/dv and their fp32 casts, and the BF16 casts of the fp32 gradients returned.

    ``a2a`` > 1: ``--cp-comm-type a2a+p2p`` over two levels: an all-to-all over ``a2a`` ranks around a ring over
    ``CP / a2a``. The saved tensors keep their bytes (the exchange trades sequence for heads); the ring's working
    sets count ``CP / a2a`` steps, and the exchanges add theirs (``a2a_peak``): forward, megatron's BF16 q, k, v
    exchanged before they are quantized (the exchanged BF16 q stays until the forward returns, ``q_f16``), the fp32
    corrected output exchanged before its BF16 cast; backward, the gradients (BF16 under delayed scaling, the fp32
    accumulators under tensorwise) exchanged after the ring. Before the ring's backward, TE 2.11 exchanges the saved
    output and the FP8 dO together ([out, dout]). TE 2.20.2 (megatron-core >= 0.17) instead casts the fp32 output
    to a BF16 copy before its exchange (``out_part = out.to(fwd_nominal_dtype)``), alive to the forward's end and
    saved under tensorwise (``NVTE_DPA_FP8CS_O_in_F16``: ``f16_tensors = (None, None, out_f16)`` with ``out_f16 =
    out_part``; ``cp_a2a_attention_output``, next to the BF16 output linear_proj reads), and its backward
    quantizes dO first and exchanges only dO's FP8 bytes (the saved output is in the ring's layout already)."""
    from .attention import _cp_attention_items, _te_keeps_every_cp_step, _te_ring_out_part, qkv_out_per_rank
    saved = mixer.saved
    x = shapes(L)
    e, Tf, d, cp = x.e, x.Tf, x.d, L.cp // a2a         # cp: the ring's ranks
    recipe = dpa_recipe(L)
    delayed = recipe == "delayed"
    gated = _gated(L) == 2
    core = 2 if gated else 1                           # the core attention's backward step
    Q = Tf * x.a_t * d                                 # q (and the output) elements
    KV = 2 * Tf * x.g_t * d                            # k and v elements: one ring buffer in FP8 bytes
    W = Q + KV
    stats = x.b * x.a_t * x.s * 4
    qkv8 = quantized_tensor(recipe, Tf, W // Tf, rowwise=True, columnwise=False).allocated
    out8 = quantized_tensor(recipe, Tf, Q // Tf, rowwise=True, columnwise=False).allocated
    q, kv1 = Q * e, Tf * x.g_t * d * e
    rope = L.position_embedding_type in ("rope", "yarn")
    _, _, bf16_ring_bwd, _ = _cp_attention_items(L, x, {}, q, kv1, qkv_out_per_rank(L), rope)
    te211 = _te_keeps_every_cp_step(L)
    n_ring, n_out = (cp - 1, cp) if te211 else (2, 2)
    # TE 2.20.2 (context_parallel.py 2255, 2298, 2321-2326): the fp32 output is cast twice to BF16, out_part (made
    # before the a2a exchange, if any) and out_f16 (returned): two copies even without an all-to-all. out_part is
    # the one saved under tensorwise (NVTE_DPA_FP8CS_O_in_F16), next to the returned one linear_proj keeps; under
    # delayed scaling (the FP8 output saved) it is a forward transient. TE 2.11 saves the returned out_f16 itself.
    # The backward exchanges dO only (the saved output is in the ring's layout already)
    out_part = _te_ring_out_part(L)                   # TE >= 2.15
    part_saved = out_part and not delayed
    combine = W * e + qkv8                             # combine_and_quantize: BF16 concatenation, its FP8 copy
    # a2a+p2p: the exchanged BF16 q, k, v combine_and_quantize reads; the exchanged q kept to the forward's end
    a2a_in, a2a_q = (W * e, q) if a2a > 1 else (0, 0)
    # the output correction: partial outputs in fp32 with their statistics, the other ring buffers, the fp32
    # output, its BF16 cast and (delayed) the FP8 output
    out_end = 4 * Q + e * Q + (out8 if delayed else 0)
    if out_part and a2a > 1:
        # TE 2.20.2: out_part (BF16) first, then the fp32 output exchanged, its BF16 cast and (delayed) FP8 copy
        out_end = e * Q + max(4 * Q + a2a_peak((4 * Q,), False), out_end)
    elif out_part:
        # TE 2.20.2, no exchange: out_part next to the fp32 output, its second BF16 cast and (delayed) FP8 copy
        out_end = e * Q + out_end
    elif a2a > 1:
        # the fp32 output exchanged (send copy, receive buffer, reordered copy) before its casts
        out_end = max(4 * Q + a2a_peak((4 * Q,), False), out_end)
    correction = n_ring * KV + n_out * (4 * Q + stats) + out_end
    common = out8 + e * Q + KV + 2 * cp * KV + stats // 2   # dO in FP8, dO, K/V receive, dK/dV send and receive
    ob = 1 if delayed else e                           # bytes per element of the saved output
    # a2a+p2p: the saved output and the FP8 dO exchanged before the ring, kept through it (TE 2.20.2: dO only)
    kept_a2a = (Q if out_part else ob * Q + Q) if a2a > 1 else 0
    if delayed:
        # each step: FP8 dq/dk/dv and contiguous halves of q, out, dO; the end: the steps' FP8 results
        # (dK/dV made contiguous), concatenated and dequantized to fp32, then summed over the steps one tensor
        # at a time (an fp32 sum next to the BF16 casts made so far: dq's, or dv's after dq's and dk's)
        end = max(cp * KV + cp * W + 4 * cp * W, 4 * cp * W + max(6 * Q, 2 * Q + 4 * KV))
        phases = [kept_a2a + max(W + 3 * Q // 2, end)]
        if a2a > 1:
            # the BF16 dq, dk, dv exchanged after the ring
            phases.append(kept_a2a + W * e + a2a_peak((e * Q, e * KV // 2, e * KV // 2), False))
        ring_bwd = common + cp * Q
    else:
        # fp32 dq and dK/dV accumulators; each step: BF16 dq/dk/dv, their fp32 casts and the halves of q, out
        # (BF16), dO; the fp32 gradients returned are cast to BF16 by autograd
        phases = [kept_a2a + max(6 * W + 2 * Q, 2 * W)]
        if a2a > 1:
            # the fp32 accumulators' dq, dk, dv exchanged after the ring
            phases.append(kept_a2a + a2a_peak((4 * Q, 2 * KV, 2 * KV), False))
        ring_bwd = common + 4 * W
    if a2a > 1:
        # the exchange of the saved output and dO (TE 2.20.2: of dO's FP8 bytes only)
        phases.append(a2a_peak((Q,), True) if out_part else a2a_peak((ob * Q, Q), True))
    ring_bwd += max(phases)
    (names, _), *rest = mixer.fwd_steps
    if "softmax_stats" not in saved:
        # core_attn recompute: the checkpoint keeps the BF16 q, k, v (saved tensors unchanged); its no-grad
        # forward makes the ring's transients, and the backward's replay keeps the ring's saved tensors (and
        # the BF16 output it returns) through the ring's backward
        kept = qkv8 + KV + stats + e * Q + (out8 if delayed else 0) + (e * Q if part_saved else 0)
        bf16 = bf16_ring_bwd + 2 * kv1 + stats + q       # attention_items' recompute step under CP
        fwd = ((names, kv1 + combine + a2a_in), (names, kv1 + qkv8 + KV + stats + correction + a2a_q))
        if a2a > 1:
            fwd = ((names, kv1 + a2a_peak((q, kv1, kv1), True)),) + fwd
        return _replayed_at(mixer._replace(fwd_steps=fwd + tuple(rest)), core, kept + ring_bwd - bf16)
    dropped = {n: saved[n] for n in _BF16_RING_INPUTS if n in saved}
    new: dict[str, int] = {}
    for name, b in saved.items():
        if name in dropped:
            continue
        if name == "cp_kv_buffer":
            new["fp8_attention_qkv"] = qkv8
            b = KV                                     # the last ring buffer, FP8
        elif name == "proj_input" and delayed:
            if _bf16_output_kept(L, gated):
                # the gate (gate_attention_output) or linear_proj (proj_input) keeps the BF16 output
                new["fp8_attention_output"] = out8
            else:
                b = out8
        new[name] = b
    if part_saved:
        new["cp_a2a_attention_output"] = e * Q         # TE 2.20.2's out_part (counted in out_end while made)
    alive = sum(dropped.values()) + kv1                # + v made contiguous
    first = names | {"fp8_attention_qkv", "cp_kv_buffer", "softmax_stats", "fp8_attention_output",
                     "cp_a2a_attention_output"}
    fwd = (
        (first, alive + combine + a2a_in),
        (names | {"fp8_attention_output", "cp_a2a_attention_output"}, alive + correction + a2a_q),
    )
    if a2a > 1:
        fwd = ((first, alive + a2a_peak((q, kv1, kv1), True)),) + fwd   # megatron's BF16 q, k, v exchanged
    bwd = []
    for i, (rel, w) in enumerate(mixer.bwd_steps):
        if i == core:
            w += ring_bwd - bf16_ring_bwd
        elif "softmax_stats" in rel:
            rel = rel | {"fp8_attention_qkv", "fp8_attention_output", "cp_kv_buffer", "cp_a2a_attention_output"}
        bwd.append((rel, w))
    return MixerActivations(saved=new, fwd_steps=fwd + tuple(rest), bwd_steps=tuple(bwd))


def fp8_all_gather_attention(L: Layout, mixer: MixerActivations) -> MixerActivations:
    """FP8 attention (delayed / tensorwise) under context parallelism with ``--cp-comm-type all_gather``: Transformer
    Engine's ``AttnFuncWithCPAndKVAllGather`` with ``fp8``, which ``attn_forward_func_with_cp`` hands it from TE 2.15.0
    (2.11 to 2.14.1: no ``fp8`` argument, BF16 attention; resolve/fp8.py ``_ring_attention``). Read in the TE 2.15.0
    and 2.20.2 wheels (the same FP8 branches; 2.18 / 2.19 add THD and load-balancing options around them).

    Saved (``ctx.fp8``): q, k, v in FP8 (``q_fp8_save`` etc. wrap ``q_fp8._data``: views of combine_and_quantize's one
    FP8 buffer ``[Tf, (a + 2 g) d]``, layout sbhd_sbhd_sbhd; k and v are already sequence-first, ``contiguous()``
    copies nothing: ``fp8_attention_qkv``), one fp32 statistic per step (two steps of s/(2 CP) query tokens: the
    ring's ``[b, a, s]`` bytes, ``softmax_stats``), and the output: FP8 under delayed scaling (``out_fp8 =
    O_quantizer(out_f16)``), the BF16 one returned (linear_proj's ``proj_input``) under tensorwise
    (``NVTE_DPA_FP8CS_O_in_F16=1``). Neither the gathered K/V nor the BF16 q are saved: no ``cp_kv_buffer``.

    Forward working set: combine_and_quantize (BF16 concatenation and its FP8 copy), then K and V gathered over CP
    in FP8 (``gather_along_first_dim``, then ``index_select`` for the chunk order: ``cp x`` the local K/V, 1.5 times
    that while the second copy is made), kept to the function's end; per step (two, on two streams) both steps' BF16
    partial outputs (delayed: each first in FP8) and ``out_f16``; from TE 2.18 also a zeroed BF16 output (``out =
    torch.zeros(o_shape)``, THD's accumulator, made for sbhd too: ``AG_OUT_ZEROS_SINCE``). A step's half of q and
    K/V slice cost nothing in Megatron's sbhd: ``q.select(0, i)`` of the ``[2, s/2, b, h, d]`` view and
    ``k_ag[start:end]`` (``movedim(0, 0)``) are dim-0 slices of contiguous FP8 data, so ``.contiguous()`` returns
    them as they are (TE 2.20.2 context_parallel.py 3629, 3647-3651; 2.15.0 3154, 3178) and ``Float8Tensor.make_like``
    only wraps them (3657-3662).

    Backward working set: dO handed in (BF16) and its FP8 copy, BF16 dq and the gathered BF16 dK/dV accumulators
    (``torch.zeros((k_shape[0] * cp_size, ...))``), K/V gathered again in FP8; per step each step's BF16 dq/dk/dv
    kept in ``dq_per_step`` etc. to the end (delayed: FP8 first, then dequantized); at the end the chunk reorder of
    dK/dV (``index_select``, one at a time) and their reduce-scatter. The halves of q, out, dO and the K/V slice are
    views again (4217-4232: dim-0 selects of the saved FP8 q, ``out_fp8._data`` or the saved ``out_f16``, and
    ``dO_quantizer(dout)._data``, all contiguous).

    MXFP8 (TE 2.20.2, ``fp8_recipe.mxfp8()``): nothing is quantized up front (3432-3437); K and V are gathered in
    BF16 and each step quantizes its own half of q and slice of the gathered K/V (``combine_and_quantize``, 3657-3670:
    used_in_forward only, q and k rowwise, v columnwise); saved (3906-3916, ``f16_tensors = (q, k, v, out_f16)``):
    the BF16 q (a view of Megatron's), the local BF16 k and v (``.contiguous()``: v's copy) and the output returned,
    with the steps' statistics: the ring's bytes, so the BF16 ring's saved tensors stand (``mxfp8_all_gather``)."""
    from .attention import _cp_attention_items, qkv_out_per_rank
    saved = mixer.saved
    x = shapes(L)
    e, Tf, d, cp = x.e, x.Tf, x.d, L.cp
    recipe = dpa_recipe(L)
    if recipe == "mxfp8":
        return mxfp8_all_gather(L, mixer)
    delayed = recipe == "delayed"
    gated = _gated(L) == 2
    core = 2 if gated else 1                           # the core attention's backward step
    Q = Tf * x.a_t * d                                 # q (and the output) elements
    KV = 2 * Tf * x.g_t * d                            # local k and v elements (FP8: bytes)
    W = Q + KV
    stats = fp8_softmax_stats(L.env_dict, L.megatron_version) * x.b * x.a_t * x.s * 4   # one from TE 2.15
    qkv8 = quantized_tensor(recipe, Tf, W // Tf, rowwise=True, columnwise=False).allocated
    out8 = quantized_tensor(recipe, Tf, Q // Tf, rowwise=True, columnwise=False).allocated
    q, kv1 = Q * e, Tf * x.g_t * d * e
    rope = L.position_embedding_type in ("rope", "yarn")
    _, _, bf16_ring_bwd, _ = _cp_attention_items(L, x, {}, q, kv1, qkv_out_per_rank(L), rope)
    gathered = cp * KV                                 # k_ag, v_ag in FP8 (index_select'ed copies)
    gather_peak = gathered + gathered // 2             # the gathered v and its reordered copy next to k's
    step_kv = cp * KV                                  # the widest step's K/V slice (chunk 2 CP - 1)
    # forward: both BF16 partial outputs, out_f16 (delayed: a step's FP8 output before its dequantization), the
    # statistics; the steps' inputs (q half, K/V slice) are views of q and k_ag (sbhd: no copy)
    zeros = e * Q if te_at_least(L.env_dict, L.megatron_version, AG_OUT_ZEROS_SINCE) else 0   # TE >= 2.18: ``out``
    fwd_steps = gathered + e * Q + e * Q + zeros + stats + (Q // 2 if delayed else 0)
    fwd_end = gathered + 2 * e * Q + zeros + stats + (out8 if delayed else 0)
    # backward: dO (BF16, FP8), dq (BF16) and the gathered dK/dV (BF16) held throughout
    held = e * Q + Q + e * Q + e * gathered
    # each step's BF16 dq/dk/dv collected to the end: dq's halves, and the two steps' K/V slices (chunks r and
    # 2 CP - r - 1: (2 CP + 1) / 2 local K/V together, every rank)
    collected = e * Q + e * (2 * cp + 1) * KV // 2
    # the halves of q, out, dO and the K/V slice are views (sbhd: no copy); delayed: the step's FP8 dq/dk/dv before
    # their dequantization
    step_fp8 = (Q // 2 + step_kv) if delayed else 0
    ag_bwd = held + max(gather_peak,
                        gathered + collected + step_fp8,
                        # the end: dK's reordered copy (the gathered one freed), dV's next to its gathered one;
                        # reduce_scatter's outputs (e KV) are no more than half of that
                        gathered + collected + e * gathered // 2)
    (names, _), *rest = mixer.fwd_steps
    combine = W * e + qkv8                             # combine_and_quantize: BF16 concatenation, its FP8 copy
    if "softmax_stats" not in saved:
        # core_attn recompute: the checkpoint keeps the BF16 q, k, v (saved tensors unchanged); the backward's replay
        # keeps what the FP8 forward saves (and the BF16 output it returns) through the function's backward
        kept = qkv8 + stats + e * Q + (out8 if delayed else 0)
        bf16 = bf16_ring_bwd + 2 * kv1 + stats + q       # attention_items' recompute step under CP
        fwd = ((names, kv1 + combine), (names, kv1 + qkv8 + max(gather_peak, fwd_steps, fwd_end)))
        return _replayed_at(mixer._replace(fwd_steps=fwd + tuple(rest)), core, kept + ag_bwd - bf16)
    dropped = {n: saved[n] for n in _BF16_RING_INPUTS if n in saved}
    new: dict[str, int] = {}
    for name, b in saved.items():
        if name in dropped:
            continue
        if name == "cp_kv_buffer":
            new["fp8_attention_qkv"] = qkv8            # the ring's K/V buffer: none here
            continue
        if name == "softmax_stats":
            b = stats
        elif name == "proj_input" and delayed:
            if _bf16_output_kept(L, gated):
                # the gate (gate_attention_output) or linear_proj (proj_input) keeps the BF16 output
                new["fp8_attention_output"] = out8
            else:
                b = out8
        new[name] = b
    alive = sum(dropped.values()) + kv1                # + v made contiguous (FusedAttention.forward)
    first = names | {"fp8_attention_qkv", "softmax_stats", "fp8_attention_output"}
    fwd = (
        (first, alive + combine),
        (names | {"fp8_attention_output"}, alive + max(gather_peak, fwd_steps, fwd_end)),
    )
    bwd = []
    for i, (rel, w) in enumerate(mixer.bwd_steps):
        if i == core:
            w += ag_bwd - bf16_ring_bwd
        elif "softmax_stats" in rel:
            rel = rel | {"fp8_attention_qkv", "fp8_attention_output"}
        bwd.append((rel, w))
    return MixerActivations(saved=new, fwd_steps=fwd + tuple(rest), bwd_steps=tuple(bwd))


def fp8_a2a_attention(L: Layout, mixer: MixerActivations) -> MixerActivations:
    """FP8 attention under context parallelism with ``--cp-comm-type a2a``: Transformer Engine's
    ``AttnFuncWithCPAndQKVOA2A`` with ``fp8`` (TE 2.11 ``context_parallel.py``; megatron-core 0.16.1 and 0.19.2
    build no FP8 q, k, v, so ``is_input_fp8`` is False). The all-to-alls move FP8 bytes: q, k, v are quantized
    first (``combine_and_quantize``: one FP8 buffer of q, k, v) and their uint8 data is exchanged, turning
    [s/CP, all the rank's heads] into [s, heads/CP]; the output goes back the same way (FP8 under delayed
    scaling, BF16 under tensorwise, ``NVTE_DPA_FP8CS_O_in_F16=1``).

    Saved (``ctx.fp8``): the exchanged FP8 q, k, v (three tensors of the one buffer's bytes: ``fp8_attention_qkv``,
    sharing its scale), the FP8 kernel's M and ZInv (fp32 ``[b, a/CP, s]`` each: two statistics of the rank's
    ``[b, a, s/CP]`` size) and the output before its all-to-all: FP8 under delayed scaling (``proj_input`` at
    1 B/elem, or ``fp8_attention_output`` next to the gate's BF16 output), BF16 under tensorwise, a tensor
    other than the returned one linear_proj keeps (``cp_a2a_attention_output``). No ring buffer.

    Forward working sets: the BF16 concatenation of q, k, v and its FP8 copy; the all-to-all of q, k, v next to
    that FP8 buffer (alive until the forward returns); the kernel's output and its all-to-all (delayed: then the
    exchanged FP8 output and its BF16 dequantization, which linear_proj reads). Backward: the BF16 output gradient
    handed in and its FP8 copy, then its all-to-all (FP8); the kernel's dq, dk, dv (delayed: FP8; tensorwise:
    BF16) and their all-to-all; delayed: ``combine_and_dequantize`` (the exchanged FP8 gradients concatenated,
    dequantized to BF16) while the kernel's FP8 gradients are still held."""
    from .attention import _cp_attention_items, qkv_out_per_rank
    saved = mixer.saved
    x = shapes(L)
    e, Tf, d = x.e, x.Tf, x.d
    recipe = dpa_recipe(L)
    delayed = recipe == "delayed"
    n_stats = fp8_softmax_stats(L.env_dict, L.megatron_version)
    gated = _gated(L) == 2
    core = 2 if gated else 1                           # the core attention's backward step
    Q = Tf * x.a_t * d                                 # q (and the output) elements: the same before and after
    K = Tf * x.g_t * d                                 # k (and v) elements
    W = Q + 2 * K
    stats = x.b * x.a_t * x.s * 4                      # one fp32 statistic [b, a/CP, s] = [b, a, s/CP] elements
    scale = _alloc(4)                                  # a Float8Tensor's fp32 scale-inverse
    qkv8 = quantized_tensor(recipe, Tf, W // Tf, rowwise=True, columnwise=False).allocated
    out8 = quantized_tensor(recipe, Tf, Q // Tf, rowwise=True, columnwise=False).allocated
    fp8_qkv = _alloc(Q) + 2 * _alloc(K) + scale        # the exchanged q, k, v (the buffer's scale shared)
    saved_out = out8 if delayed else Q * e             # the output saved before its all-to-all
    q, kv1 = Q * e, K * e
    rope = L.position_embedding_type in ("rope", "yarn")
    _, _, bf16_ring_bwd, _ = _cp_attention_items(L, x, {}, q, kv1, qkv_out_per_rank(L), rope)
    combine = W * e + qkv8                             # combine_and_quantize: BF16 concatenation, its FP8 copy
    qkv_a2a = qkv8 + a2a_peak((Q, K, K), True)         # the exchange of q, k, v next to the FP8 buffer
    if delayed:
        # the FP8 output's all-to-all, then the exchanged FP8 output and its BF16 dequantization
        out_a2a = max(a2a_peak((Q,), False), Q + e * Q)
    else:
        out_a2a = a2a_peak((e * Q,), False)            # its last copy is the BF16 output returned
    # backward (ctx.fp8): the BF16 dO handed in and its FP8 copy; the exchange of dO (FP8); with the exchanged dO:
    # the kernel's dq, dk, dv, their exchange, and (delayed) combine_and_dequantize: the FP8 gradients' one byte
    # concatenation and its BF16 dequantization next to the kernel's FP8 gradients and the exchanged ones
    dqkv = W if delayed else W * e
    sizes = (Q, K, K) if delayed else (Q * e, K * e, K * e)
    a2a_bwd = e * Q + out8 + max(a2a_peak((Q,), True), Q + dqkv + a2a_peak(sizes, False),
                                 Q + 3 * W + W * e if delayed else 0)
    (names, _), *rest = mixer.fwd_steps
    out_names = {"fp8_attention_output", "cp_a2a_attention_output"}
    if "softmax_stats" not in saved:
        # core_attn recompute: the checkpoint keeps the BF16 q, k, v (saved tensors unchanged); its no-grad forward
        # makes the transients, and the backward's replay keeps the saved tensors (and the BF16 output it returns)
        # through the attention's backward
        kept = fp8_qkv + n_stats * stats + saved_out + e * Q
        bf16 = bf16_ring_bwd + 2 * kv1 + stats + q       # attention_items' recompute step under CP
        fwd = ((names, kv1 + combine),
               (names, kv1 + max(qkv_a2a, qkv8 + fp8_qkv + n_stats * stats + saved_out + out_a2a)))
        return _replayed_at(mixer._replace(fwd_steps=fwd + tuple(rest)), core, kept + a2a_bwd - bf16)
    dropped = {n: saved[n] for n in _BF16_RING_INPUTS if n in saved}
    new: dict[str, int] = {}
    for name, b in saved.items():
        if name in dropped:
            continue
        if name == "cp_kv_buffer":
            new["fp8_attention_qkv"] = fp8_qkv         # in place of the ring's K/V buffer: no ring here
            continue
        if name == "softmax_stats":
            b = n_stats * stats                        # M and ZInv (TE <= 2.14), or one
            if not delayed:
                new[name] = b
                new["cp_a2a_attention_output"] = saved_out
                continue
        elif name == "proj_input" and delayed:
            if _bf16_output_kept(L, gated):
                # the gate (gate_attention_output) or linear_proj (proj_input) keeps the BF16 output
                new["fp8_attention_output"] = out8
            else:
                b = out8                               # the FP8 output the attention keeps
        new[name] = b
    alive = sum(dropped.values()) + kv1                # + v made contiguous
    first = names | {"fp8_attention_qkv", "softmax_stats"} | out_names
    fwd = (
        (first, alive + combine),
        (first, alive + qkv_a2a),
        # the kernel's output: delayed, the saved FP8 one (proj_input / fp8_attention_output, not yet counted) and
        # its exchange; tensorwise, the saved BF16 one (cp_a2a_attention_output) and its exchange to proj_input
        (names | {"fp8_attention_output"}, alive + qkv8 + (out8 if delayed else 0) + out_a2a),
    )
    bwd = []
    for i, (rel, w) in enumerate(mixer.bwd_steps):
        if i == core:
            w += a2a_bwd - bf16_ring_bwd
        elif "softmax_stats" in rel:
            rel = rel | {"fp8_attention_qkv", "cp_kv_buffer"} | out_names
        bwd.append((rel, w))
    return MixerActivations(saved=new, fwd_steps=fwd + tuple(rest), bwd_steps=tuple(bwd))


def _round(n: int, m: int) -> int:
    return -(-n // m) * m


def mxfp8_attention_tensors(Tf: int, heads_dims: tuple[tuple[int, int], ...]) -> int:
    """Allocated bytes of ``mxfp8_quantize_fast_path`` (TE 2.20.2 ``dot_product_attention/utils.py``) on
    ``[s, b, heads, dim]`` tensors of ``Tf = s*b`` tokens, quantized rowwise and columnwise (training:
    ``combine_and_quantize`` with used_in_forward and used_in_backward sets neither usage branch, so the
    quantizer's own stay: ``get_attention_quantizers`` turns columnwise on for MXFP8). Per tensor of E
    elements: its row and column FP8 data (E bytes each, ``mxfp8_quantize_only``); then the E8M0 scales are
    re-laid into two buffers shared by the tensors (``mxfp8_transpose_swizzle`` ``_build_outputs``): rowwise
    ``[b, h, s, align4(dim/32)]``, columnwise ``[b, h, s/32, align128(dim)]``, one byte each."""
    return mxfp8_usage_tensors(Tf, tuple((h, dim, True, True) for h, dim in heads_dims))


def mxfp8_usage_tensors(Tf: int, items: tuple[tuple[int, int, bool, bool], ...]) -> int:
    """``mxfp8_quantize_fast_path`` on tensors ``(heads, dim, rowwise, columnwise)`` of ``Tf`` tokens, each with
    only the usages its quantizer asks for (``combine_and_quantize``'s used_in_forward / used_in_backward
    branches): per usage E data bytes; the row scales ``[b, h, s, align4(dim/32)]`` of the rowwise tensors share
    one buffer, the column scales ``[b, h, s/32, align128(dim)]`` of the columnwise ones another (``_build_outputs``
    makes none when no tensor has that usage)."""
    return mxfp8_token_tensors(tuple((Tf, h, dim, row, col) for h, dim, row, col in items))


def mxfp8_token_tensors(items: tuple[tuple[int, int, int, bool, bool], ...]) -> int:
    """``mxfp8_usage_tensors`` for tensors of their own token counts, ``(tokens, heads, dim, rowwise,
    columnwise)``: the all-gather path quantizes half of q next to a slice of the gathered K/V in one call."""
    data = sum((row + col) * _alloc(t * h * dim) for t, h, dim, row, col in items)
    rows = sum(t * h * _round(dim // 32, 4) for t, h, dim, row, _ in items if row)
    cols = sum(t // 32 * h * _round(dim, 128) for t, h, dim, _, col in items if col)
    return data + (_alloc(rows) if rows else 0) + (_alloc(cols) if cols else 0)


def mxfp8_attention(L: Layout, mixer: MixerActivations, mla: bool = False) -> MixerActivations:
    """FP8 attention under the mxfp8 recipe (megatron-core >= 0.17 with TE 2.20.2), without context parallelism
    (under CP: ``mxfp8_ring_attention``, ``mxfp8_all_gather``, layers/cp_attention.py ``cp_a2a_attention``).
    ``DotProductAttention`` keeps the MXFP8 recipe for the attention (``NVTE_DPA_FP8_RECIPE`` unset; or switches to
    it, ``MXFP8BlockScaling``, TE >= 2.15) and ``FusedAttnFunc`` (backends.py) runs cuDNN's MXFP8 kernel:

    * forward: q, k, v are made contiguous where they are views (``get_qkv_layout``) and quantized one by one (no
      concatenation: ``combine_and_quantize``'s MXFP8 fast path for sbhd_sbhd_sbhd), each rowwise and columnwise
      (``mxfp8_attention_tensors``); the output stays BF16 (``FusedAttnSpec``: O in model precision) and is the
      tensor returned, saved once (``saved_from``);
    * saved: the MXFP8 q, k, v (``fp8_tensors = (q_fp8, k_fp8, v_fp8, None)``) instead of the BF16 ones, the
      BF16 output (``proj_input``, unchanged) and one fp32 softmax statistic ``[b, a, s, 1]`` (backends.py
      ``softmax_stats, rng_state, *aux = aux_ctx_tensors``: the BF16 attention's, unchanged);
    * backward: the BF16 output gradient quantized to MXFP8 rowwise and columnwise (``dO_quantizer``); dq, dk,
      dv come out in BF16 as in BF16 attention.

    Not counted, as for the other recipes: cuDNN's workspace and the quantizers' state; the scale tensors the
    quantizer makes before their re-layout (``mxfp8_quantize_only``: 1/32 of the data, freed at once)."""
    saved = mixer.saved
    x = shapes(L)
    e, Tf, d = x.e, x.Tf, x.d
    if mla:
        dqk = L.qk_head_dim + L.qk_pos_emb_head_dim
        qkv = ((x.a_t, dqk), (x.a_t, dqk), (x.a_t, L.v_head_dim))
        out = ((x.a_t, L.v_head_dim),)
    else:
        qkv = ((x.a_t, d), (x.g_t, d), (x.g_t, d))
        out = ((x.a_t, d),)
    qkv8 = mxfp8_attention_tensors(Tf, qkv)
    do8 = mxfp8_attention_tensors(Tf, out)
    gated = _gated(L) == 2
    core = 2 if gated else 1                           # the core attention's backward step
    if "softmax_stats" not in saved:
        # core_attn recompute: the checkpoint keeps the BF16 q, k, v; the backward's replay makes the MXFP8 q, k,
        # v, alive through the core attention's backward with the MXFP8 output gradient
        return _replayed_at(mixer, core, qkv8 + do8)
    dropped = _bf16_dropped(L, x, saved, mla, gated)
    new: dict[str, int] = {}
    for name, b in saved.items():
        if name in dropped:
            continue
        if name == "softmax_stats":
            new["fp8_attention_qkv"] = qkv8
        new[name] = b
    # get_qkv_layout (TE 2.20.2 utils.py run_iteratively): v, a strided view of the qkv output, matches no packed
    # layout next to a separate q and k, so q, k, v are made contiguous (sbhd_sbhd_sbhd, which the MXFP8 fast path
    # needs): a copy of v, and of q and k where neither rope nor the q/k norms made new ones (MLA's are contiguous)
    copies = 0 if mla else Tf * x.g_t * d * e
    if not mla and not any(n in saved for n in ("query_rope", "query_norm")):
        copies += Tf * (x.a_t + x.g_t) * d * e
    bf16_inputs = sum(dropped.values()) + copies
    (names, _), *rest = mixer.fwd_steps
    ctx_w = sum(h * dim for h, dim in out)
    fwd = (
        # the BF16 q, k, v next to their MXFP8 copies
        (names | {"fp8_attention_qkv", "softmax_stats"}, bf16_inputs + qkv8),
        # the kernel's BF16 output
        (names, bf16_inputs + Tf * ctx_w * e),
    )
    bwd = []
    for i, (rel, w) in enumerate(mixer.bwd_steps):
        if i == core:
            w += do8
        elif "softmax_stats" in rel:
            rel = rel | {"fp8_attention_qkv"}
        bwd.append((rel, w))
    return MixerActivations(saved=new, fwd_steps=fwd + tuple(rest), bwd_steps=tuple(bwd))


def mxfp8_ring_attention(L: Layout, mixer: MixerActivations, a2a: int = 1) -> MixerActivations:
    """MXFP8 attention under context parallelism with cp_comm_type p2p: Transformer Engine 2.20.2's
    ``AttnFuncWithCPAndKVP2P`` with ``fp8`` and ``fp8_recipe.mxfp8()`` (``context_parallel.py``; TE >= 2.15, the
    first release with MXFP8 attention; 2.15 to 2.19 keep every ring step's buffer and partial output,
    ``_te_keeps_every_cp_step``). Unlike the per-tensor recipes nothing is quantized up front: q, k, v stay BF16
    (1735-1752: no ``combine_and_quantize`` for MXFP8), the ring passes BF16 K/V, and every step quantizes its own
    q, k, v parts (``cp_p2p_fwd_fused_attn``, 1066-1075) and, in the backward, its q, k, v and dO parts
    (``cp_p2p_bwd_fused_attn``, 1370-1397).

    Saved (2313-2343, ``f16_tensors = (q, kv, out_f16)`` with ``out_f16 = out_part``): the BF16 q, the last BF16 ring
    buffer and the fp32 log-sum-exp ``[b, a, s]``, as the BF16 ring keeps them, and ``out_part`` (2255: the fp32
    output cast to BF16), a second BF16 output next to the returned one (2298) linear_proj keeps
    (``cp_a2a_attention_output``). No MXFP8 tensor is saved.

    Forward working set, on top of v made contiguous (backends.py 2530): the ring buffers in flight (BF16), the
    partial outputs cast to fp32 (2162-2165) with their fp32 statistics, the fp32 output accumulator (2170-2176),
    and either two steps' MXFP8 q, k, v (one per stream, ``flash_attn_streams``; ``combine_and_quantize`` with
    used_in_forward only, utils.py 3407-3413: q and k rowwise, v columnwise; counted at full size, the causal
    off-diagonal steps quantize half of q or of K/V) or, at the end, ``out_part`` and the returned BF16 output.

    Backward working set (2540-2610, 2862-2877, 3075-3077): the BF16 dO handed in, ``kv_recv_buffer``
    (``empty_like(kv)``: BF16), ``dkv_send_buffer`` / ``dkv_recv_buffer`` of ``[cp, K+V]`` uint8 each, the fp32 ``dq_buffer``
    and ``dkv_buffer``, the second half of the statistics made contiguous; per step: the BF16 halves of q, out and
    dO, their MXFP8 copies (used_in_backward, utils.py 3414-3420: q and k both ways, v rowwise; dO rowwise and
    columnwise), the kernel's BF16 dq, dk, dv and their fp32 casts (2875-2876); at the end the fp32 gradients
    returned, cast to BF16 by autograd.

    ``a2a`` > 1: ``--cp-comm-type a2a+p2p`` over two levels (``cp_size_a2a`` > 1): Megatron's BF16 q, k, v are
    exchanged over the ``a2a`` ranks first (1703-1722: no quantization before it for MXFP8) and the MXFP8 ring runs
    over ``CP / a2a`` ranks on the exchanged ones (``a2a`` x the tokens, heads / ``a2a``: the same elements), so it
    saves what the BF16 two-level path of TE 2.20.2 saves (the exchanged q, the last ring buffer, the statistic,
    ``out_part``). Forward: Megatron's q stays alive (the caller's) next to the exchanged q, and the exchanged k
    and v stay referenced to the forward's end (no FP8 rebinding of ``q, k, v`` as for the per-tensor recipes);
    at the end ``out_part`` is cast from the fp32 output (2255), the fp32 output is exchanged back (2257-2268) and
    cast to the BF16 output returned (2298). Backward: dO is exchanged in BF16 after the ring's buffers are made
    (2632-2645) and kept through the ring as its dO; the fp32 dq and dK/dV (``dq_buffer``, views of
    ``dkv_buffer``) are exchanged after it (3129-3147)."""
    from .attention import _cp_attention_items, _te_keeps_every_cp_step, qkv_out_per_rank
    saved = mixer.saved
    x = shapes(L)
    e, Tf, d, cp = x.e, x.Tf, x.d, L.cp // a2a         # cp: the ring's ranks
    gated = _gated(L) == 2
    core = 2 if gated else 1                           # the core attention's backward step
    Q = Tf * x.a_t * d                                 # q (and the output) elements
    KV = 2 * Tf * x.g_t * d                            # k and v elements: one ring buffer
    W = Q + KV
    stats = x.b * x.a_t * x.s * 4
    q, kv1 = Q * e, Tf * x.g_t * d * e
    rope = L.position_embedding_type in ("rope", "yarn")
    _, _, bf16_ring_bwd, _ = _cp_attention_items(L, x, {}, q, kv1, qkv_out_per_rank(L), rope)
    n_ring, n_out = (cp - 1, cp) if _te_keeps_every_cp_step(L) else (2, 2)
    tok = a2a * Tf                                     # the ring's tokens (after the all-to-all, if any)
    heads = ((x.a_t // a2a, d), (x.g_t // a2a, d), (x.g_t // a2a, d))
    fwd8 = mxfp8_usage_tensors(tok, tuple((h, dim, u, not u) for (h, dim), u in zip(heads, (True, True, False))))
    bwd8 = mxfp8_usage_tensors(tok, tuple((h, dim, True, c) for (h, dim), c in zip(heads, (True, True, False))))
    do8 = mxfp8_usage_tensors(tok, ((x.a_t // a2a, d, True, True),))
    # the ring: buffers in flight, fp32 partial outputs and statistics, the fp32 output; then two steps' MXFP8
    # q, k, v (two streams) or the end's two BF16 casts of the output (out_part, out_f16); a2a+p2p: out_part, then
    # the fp32 output's exchange (send copy, receive buffer, reordered copy) and the BF16 cast of the exchanged one
    ring = n_ring * KV * e + n_out * (4 * Q + stats) + 4 * Q
    end = e * Q + max(a2a_peak((4 * Q,), False), 4 * Q + e * Q) if a2a > 1 else 2 * e * Q
    ring_fwd = ring + max(2 * fwd8, end)
    # backward: dO, the K/V receive buffer, dK/dV send and receive [cp, K+V] uint8, half the statistics, the fp32
    # dq and dK/dV accumulators; each step's BF16 halves of q, out, dO, their MXFP8 copies, BF16 dq/dk/dv and
    # their fp32 casts; or the BF16 casts of the fp32 gradients returned (a2a+p2p: the exchanged dO kept through
    # the ring; before it dO's exchange, after it the fp32 gradients')
    common = e * Q + e * KV + 2 * cp * KV + stats // 2 + 4 * W
    step = 3 * e * Q // 2 + bwd8 + do8 + e * W + 4 * W
    if a2a > 1:
        ring_bwd = common + max(a2a_peak((e * Q,), True), e * Q + step,
                                e * Q + a2a_peak((4 * Q, 2 * KV, 2 * KV), False))
    else:
        ring_bwd = common + max(step, e * W)
    # a2a+p2p: Megatron's BF16 q, k, v exchanged (the results included), then Megatron's q alive next to the
    # exchanged one the ring saves, and the exchanged k, v referenced to the forward's end
    extra = q + 2 * kv1 if a2a > 1 else 0
    (names, _), *rest = mixer.fwd_steps
    if "softmax_stats" not in saved:
        # core_attn recompute: the checkpoint keeps the BF16 q, k, v (saved unchanged); its no-grad forward makes
        # the ring's transients, and the backward's replay keeps the ring's saved tensors (the last BF16 ring
        # buffer, the statistics, out_part; a2a+p2p: the exchanged q) and the BF16 output it returns through the
        # ring's backward
        kept = e * KV + stats + 2 * e * Q + (q if a2a > 1 else 0)
        bf16 = bf16_ring_bwd + 2 * kv1 + stats + q       # attention_items' recompute step under CP
        fwd = ((names, kv1 + extra + ring_fwd),)
        if a2a > 1:
            fwd = ((names, kv1 + a2a_peak((q, kv1, kv1), True)),) + fwd
        return _replayed_at(mixer._replace(fwd_steps=fwd + tuple(rest)), core, kept + ring_bwd - bf16)
    new = dict(saved)
    new["cp_a2a_attention_output"] = e * Q             # out_part (counted in the forward's end while made)
    fwd = ((names | {"cp_a2a_attention_output"}, kv1 + extra + ring_fwd),)
    if a2a > 1:
        # (the q saved, query_rope's bytes, is Megatron's at this step)
        fwd = ((names | {"cp_kv_buffer", "softmax_stats", "cp_a2a_attention_output"},
                kv1 + a2a_peak((q, kv1, kv1), True)),) + fwd
    bwd = []
    for i, (rel, w) in enumerate(mixer.bwd_steps):
        if i == core:
            w += ring_bwd - bf16_ring_bwd
        elif "softmax_stats" in rel:
            rel = rel | {"cp_a2a_attention_output"}
        bwd.append((rel, w))
    return MixerActivations(saved=new, fwd_steps=fwd + tuple(rest), bwd_steps=tuple(bwd))


def mxfp8_all_gather(L: Layout, mixer: MixerActivations) -> MixerActivations:
    """MXFP8 attention under ``--cp-comm-type all_gather``: TE 2.20.2's ``AttnFuncWithCPAndKVAllGather`` with
    ``fp8_recipe.mxfp8()`` (``context_parallel.py``; saved tensors: ``fp8_all_gather_attention``). On ``mixer``, the
    BF16 ring's (whose saved tensors have the same bytes: q, the local K/V, one statistic, the output).

    Forward working set: K and V gathered over CP in BF16 (``gather_along_first_dim``, then ``index_select`` for the
    chunk order: ``cp x`` the local K/V, 1.5 times that while the second copy is made), kept to the function's end;
    at a step (3629-3670) the MXFP8 copies of its half of q and of the K/V slice it sees (both views, no BF16 copy:
    FusedAttention.forward made q, k, v contiguous under CP, backends.py 2531, and ``q.select(0, i)`` / the slice of
    the sequence-first gathered K/V are dim-0 slices; the widest, chunk 2 CP - 1, is the whole gathered K/V), the
    BF16 partial outputs, ``out_f16`` and, from TE 2.18, the zeroed ``out``; the statistics.

    Backward working set (4035-4300): dO handed in (BF16), BF16 dq and the gathered BF16 dK/dV accumulators, K/V
    gathered again in BF16; per step the MXFP8 copies of the halves of q and dO and of the K/V slice (the halves of
    q, out and dO are dim-0 views of contiguous tensors, 4217-4232: no BF16 copy; ``used_in_backward`` only: q and k
    rowwise and columnwise, v rowwise; dO both ways, ``dO_quantizer``), each step's BF16 dq/dk/dv kept to the end;
    at the end dK/dV's reorder copy and reduce-scatter."""
    from .attention import _cp_attention_items, qkv_out_per_rank
    saved = mixer.saved
    x = shapes(L)
    e, Tf, d, cp = x.e, x.Tf, x.d, L.cp
    core = 2 if _gated(L) == 2 else 1                  # the core attention's backward step
    Q = Tf * x.a_t * d                                 # q (and the output) elements
    KV = 2 * Tf * x.g_t * d                            # local k and v elements
    stats = x.b * x.a_t * x.s * 4
    q, kv1 = Q * e, Tf * x.g_t * d * e
    rope = L.position_embedding_type in ("rope", "yarn")
    _, _, bf16_ring_bwd, _ = _cp_attention_items(L, x, {}, q, kv1, qkv_out_per_rank(L), rope)
    gathered = e * cp * KV                             # k_ag, v_ag (index_select'ed copies)
    gather_peak = gathered + gathered // 2             # the gathered v and its reordered copy next to k's
    half, wide = Tf // 2, cp * Tf                      # a step's q tokens, the widest step's K/V tokens
    fwd8 = mxfp8_token_tensors(((half, x.a_t, d, True, False), (wide, x.g_t, d, True, False),
                                (wide, x.g_t, d, False, True)))
    bwd8 = mxfp8_token_tensors(((half, x.a_t, d, True, True), (wide, x.g_t, d, True, True),
                                (wide, x.g_t, d, True, False)))
    do8 = mxfp8_token_tensors(((half, x.a_t, d, True, True),))
    zeros = e * Q if te_at_least(L.env_dict, L.megatron_version, AG_OUT_ZEROS_SINCE) else 0   # TE >= 2.18: ``out``
    # forward: a step's MXFP8 copies (its q half and K/V slice are views), both BF16 partial outputs, out_f16 (the
    # returned proj_input, not yet made); the end: the partial outputs and out_f16 (the statistics are the saved ones)
    fwd_steps = gathered + fwd8 + 2 * e * Q + zeros
    fwd_end = gathered + 2 * e * Q + zeros
    # backward: dO, dq (BF16) and the gathered dK/dV (BF16) held throughout; each step's BF16 dq/dk/dv collected
    # to the end (dq's halves and the two steps' K/V slices, chunks r and 2 CP - r - 1: (2 CP + 1) / 2 local K/V)
    held = e * Q + e * Q + gathered
    collected = e * Q + e * (2 * cp + 1) * KV // 2
    step = bwd8 + do8                                  # the MXFP8 copies (the halves of q, out, dO: views)
    ag_bwd = held + max(gather_peak, gathered + collected + step, gathered + collected + gathered // 2)
    (names, _), *rest = mixer.fwd_steps
    if "softmax_stats" not in saved:
        # core_attn recompute: the checkpoint keeps the BF16 q, k, v (saved tensors unchanged); the backward's
        # replay keeps what the forward saves that is new (v made contiguous, the statistics, the BF16 output)
        # through the function's backward
        kept = kv1 + stats + e * Q
        bf16 = bf16_ring_bwd + 2 * kv1 + stats + q       # attention_items' recompute step under CP
        return _replayed_at(mixer._replace(fwd_steps=((names, kv1 + max(gather_peak, fwd_steps, fwd_end)),) + tuple(rest)),
                            core, kept + ag_bwd - bf16)
    # (v's contiguous copy is the saved v: cp_kv_buffer's bytes)
    fwd = ((names, max(gather_peak, fwd_steps, fwd_end)),)
    bwd = tuple((rel, w + ag_bwd - bf16_ring_bwd if i == core else w) for i, (rel, w) in enumerate(mixer.bwd_steps))
    return MixerActivations(saved=dict(saved), fwd_steps=fwd + tuple(rest), bwd_steps=bwd)
