"""FP8 core attention (``fp8_dot_product_attention``): what Transformer Engine 2.11's FusedAttention keeps
and holds when an FP8 layer runs its dot-product attention in FP8 (the delayed and tensorwise recipes,
the only ones TE's DotProductAttention accepts; resolve/fp8.py refuses or drops the others).

Source: TE 2.11 ``attention/dot_product_attention/backends.py`` ``FusedAttnFunc`` (forward and backward),
``utils.py`` ``combine_and_quantize``, ``csrc/extensions/attention.cpp`` ``fused_attn_fwd`` (aux tensors):

* q, k, v are concatenated (a BF16 copy) and quantized as one Float8Tensor [tokens, (a + 2 g) d]; the
  forward saves that FP8 copy instead of the BF16 q, k, v: the rope'd q and k and the qkv output (whose view
  v is) are no longer kept by the attention (the qk norms keep the qkv output with ``--qk-layernorm``).
* The FP8 kernel returns two fp32 softmax statistics per (token, head): M and ZInv (BF16 attention: one).
* delayed: the output comes out in FP8; it is saved (1 B/elem) and dequantized into the BF16 tensor
  linear_proj reads, which nothing keeps (linear_proj keeps its own quantized copy, ``fp8_proj_input``).
  tensorwise (``NVTE_DPA_FP8CS_O_in_F16=1``, TE's default): the output stays BF16 and is saved as such.
* backward (``NVTE_FP8_DPA_BWD=1``, the default): the output gradient is quantized (1 B/elem), and under
  delayed scaling dq, dk, dv come out in FP8 and are dequantized into BF16 ones.
* ``--attention-output-gate``: the gate keeps its two inputs (layers/attention.py), so the BF16 output stays
  saved (``proj_input``) and, under delayed scaling, the FP8 one is kept next to it (``fp8_attention_output``);
  a gate that is a view of the qkv output keeps that output alive.

Not counted: the recipe state of DotProductAttention's quantizers (a few KB per layer) and cuDNN's
workspace (not counted for BF16 attention either). With ``core_attn`` recompute the checkpoint keeps the
BF16 q, k, v it replays from: the saved tensors do not change, the replay's FP8 tensors join the core
attention's backward step (docs/terms/fp8.md)."""
from __future__ import annotations

from ...layout import Layout
from ..fp8 import quantized_tensor
from .attention import _gated
from .base import MixerActivations, shapes

# the BF16 tensors of q, k, v that only the core attention kept
_BF16_INPUTS = ("query_rope", "key_rope", "query_norm", "key_norm")


def fp8_attention(L: Layout, mixer: MixerActivations) -> MixerActivations:
    """The standard attention mixer of an FP8 layer with its core attention in FP8."""
    saved = mixer.saved
    x = shapes(L)
    e, Tf, d = x.e, x.Tf, x.d
    recipe = L.fp8_spec.recipe
    width = (x.a_t + 2 * x.g_t) * d                    # q, k, v of the rank's heads
    ctx_w = x.a_t * d
    qkv8 = quantized_tensor(recipe, Tf, width, rowwise=True, columnwise=False).allocated
    out8 = quantized_tensor(recipe, Tf, ctx_w, rowwise=True, columnwise=False).allocated
    gated = _gated(L) == 2
    delayed = recipe == "delayed"
    core = 2 if gated else 1                           # the core attention's backward step
    if "softmax_stats" not in saved:
        # core_attn recompute: the checkpoint keeps the BF16 q, k, v (saved tensors unchanged); its replay in the
        # backward makes what the FP8 forward keeps (FP8 q, k, v, a second fp32 statistic, delayed: the FP8
        # output), alive through the core attention's backward with the FP8 output gradient (and FP8 dq/dk/dv)
        replay = qkv8 + x.b * x.a_t * x.s * 4 + out8 + (qkv8 + out8 if delayed else 0)
        return mixer._replace(bwd_steps=tuple((rel, w + replay if i == core else w)
                                              for i, (rel, w) in enumerate(mixer.bwd_steps)))
    dropped = {n: saved[n] for n in _BF16_INPUTS if n in saved}
    # the qkv output stays alive through the q/k norms' saved inputs, or a gate that is a view of it
    gate_view = gated and (x.g_t == 1 or x.a_t == x.g_t)
    if "qkv_output" in saved and not (L.qk_layernorm or gate_view):
        dropped["qkv_output"] = saved["qkv_output"]
    new: dict[str, int] = {}
    for name, b in saved.items():
        if name in dropped:
            continue
        if name == "softmax_stats":
            new["fp8_attention_qkv"] = qkv8
            b = 2 * x.b * x.a_t * x.s * 4              # M and ZInv, fp32 [b, a, s, 1] each
        elif name == "proj_input" and delayed:
            if gated:
                new["fp8_attention_output"] = out8     # the gate keeps the BF16 output (proj_input)
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
    core_extra = out8 + (qkv8 + (0 if gated else out8) if delayed else 0)
    bwd = []
    for i, (rel, w) in enumerate(mixer.bwd_steps):
        if i == core:
            w += core_extra
        elif "softmax_stats" in rel:
            rel = rel | {"fp8_attention_qkv", "fp8_attention_output"}
        bwd.append((rel, w))
    return MixerActivations(saved=new, fwd_steps=fwd + tuple(rest), bwd_steps=tuple(bwd))
