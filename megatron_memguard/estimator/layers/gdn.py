"""The gated delta net mixer (megatron-core GatedDeltaNet, TE spec): a GPT model's linear attention layers and a
hybrid model's 'G' layers.

Sources: megatron-core 0.19.2 ssm/gated_delta_net/common.py (_GDNBase.__init__, _prepare_input_for_gated_delta_rule,
_compute_g_and_beta, _apply_gated_norm) and gdn.py (GatedDeltaNet: its in_proj sections and forward; 0.18.2's ssm/gated_delta_net.py keeps the same
tensors); 0.16.1 and 0.17.1 ssm/gated_delta_net.py (the same module, with causal_conv1d's conv on a [b, d, s] copy,
an eager decay and no CP);
models/gpt/experimental_attention_variant_module_specs.py get_gated_delta_net_module_spec (in_proj =
TELayerNormColumnParallelLinear with the layer's input norm fused in, out_norm = TE norm over value_head_dim,
out_proj = TERowParallelLinear) and models/hybrid/hybrid_layer_specs.py (the same for 'G'). The kernels are
flash-linear-attention 0.4.2's (Megatron's pin ~=0.4.0): fla/ops/gated_delta_rule/chunk.py
ChunkGatedDeltaRuleFunction.forward saves q, k, v, g (the fp32 chunk-local cumsum), beta and A (the [T, H, 64]
WY matrix, bf16 after solve_tril) and recomputes the chunk states h in its backward; fla/modules/l2norm.py
L2NormFunction saves its output and fp32 rstd; fla/modules/conv/triton/ops.py CausalConv1dFunction saves its input
x as given (input_guard(no_guard_contiguous=["x"]): in 0.19.2 a strided view of in_proj's output, which it keeps
whole).

Shapes per TP rank (t), with Hk key heads of dim dk and Hv value heads of dim dv: in_proj's output packs
[q, k (Hk dk / t each), v, z (Hv dv / t each), beta, alpha (Hv / t each)]; the conv runs over q, k, v; q and k are
repeated to Hv heads for the kernel. Under CP (0.19.2) an all-to-all trades the sequence for heads: a rank holds the
whole sequence of Hv / (t cp) heads, the same number of elements as its s / cp tokens of Hv / t heads, which is what
``shapes(L).Tf`` x (features / t) counts.
"""
from __future__ import annotations

from math import ceil
from typing import Any

from packaging.version import Version

from .base import MixerActivations, Param, ParamRow, norm_rows, norm_stats, norms_per_layer_norm, param_objects
from .base import shapes, wgrad

CHUNK = 64      # the chunked delta-rule kernel's chunk (chunk_gated_delta_rule_fwd: chunk_size=64, fla 0.4.2)


def dims(L: Any) -> tuple[int, int, int, int, int]:
    """(key heads, value heads, key head dim, value head dim, conv kernel) of the whole layer (before TP)."""
    return (L.linear_num_key_heads, L.linear_num_value_heads, L.linear_key_head_dim, L.linear_value_head_dim,
            L.linear_conv_kernel_dim)


def widths(L: Any) -> tuple[int, int, int, int, int]:
    """Per TP rank: (q or k width, v or z width, value heads, in_proj's output width, the conv's channels)."""
    hk, hv, dk, dv, _ = dims(L)
    t = L.tp
    qk, v, heads = hk * dk // t, hv * dv // t, hv // t
    return qk, v, heads, 2 * qk + 2 * v + 2 * heads, 2 * qk + v


def linear_shapes(L: Any) -> dict[str, tuple[int, int]]:
    _, v, _, p, _ = widths(L)
    return {"in_proj": (p, L.hidden_size), "out_proj": (L.hidden_size, v)}


def param_rows(L: Any) -> list[ParamRow]:
    """In the order module.parameters() walks GatedDeltaNet (what the DDP buffer follows): its own dt_bias and A_log
    (one per value head), then its submodules as _GDNBase.__init__ builds them: in_proj (TE registers its fused
    norm first: layer_norm_weight, and layer_norm_bias for LayerNorm), conv1d (an nn.Conv1d [channels, 1, kernel],
    conv_bias=False: GatedDeltaNet's default, the specs pass none), out_norm (over value_head_dim, the same on every TP
    rank), out_proj. No linear biases (bias=False, the default the specs keep). 0.16.1 and 0.19.2 alike."""
    h = L.hidden_size
    _, _, _, dv, kc = dims(L)
    _, v, heads, p, conv = widths(L)
    in_proj = [(name.replace("layer_norm.", "layer_norm_"), *rest)
               for name, *rest in norm_rows("self_attention.in_proj.layer_norm", h, L)]
    return ([("self_attention.dt_bias", heads, False, False, False, 0),
             ("self_attention.A_log", heads, False, False, False, 0)]
            + in_proj + [("self_attention.in_proj.weight", p * h, False, False, False, h),
                         ("self_attention.conv1d.weight", conv * kc, False, False, False, 0)]
            + norm_rows("self_attention.out_norm", dv, L)
            + [("self_attention.out_proj.weight", h * v, False, False, False, v)])


def params(L: Any, prefix: str = "") -> list[Param]:
    return param_objects(param_rows(L), prefix)


def param_count(L: Any) -> int:
    """One GDN layer in the whole model (no TP split): 2 Hv (dt_bias, A_log) + the fused norm + in_proj
    h x (2 Hk dk + 2 Hv dv + 2 Hv) + conv (2 Hk dk + Hv dv) x kernel + out_norm + out_proj (Hv dv) x h."""
    h = L.hidden_size
    hk, hv, dk, dv, kc = dims(L)
    n = norms_per_layer_norm(L)
    return (2 * hv + n * h + h * (2 * hk * dk + 2 * hv * dv + 2 * hv) + (2 * hk * dk + hv * dv) * kc + n * dv
            + hv * dv * h)


def reads_batch_mask(L: Any) -> bool:
    return False   # GatedDeltaNet.forward ignores the attention mask


def _old(L: Any) -> bool:
    """megatron-core 0.16.1 / 0.17.1 (ssm/gated_delta_net.py with causal_conv1d's conv on a [b, d, s] copy, the
    decay eager); 0.18.2 moved to fla's conv on a view and torch.compile'd input preparation, as 0.19.2 has it."""
    return Version(str(L.megatron_version)) < Version("0.18")


def _chunk_states(L: Any) -> int:
    """Bytes of the kernel's chunk states h [b, chunks, Hv/t, dk, dv] in the activation dtype
    (chunk_gated_delta_rule_fwd_h: k.new_empty); made in the forward, made again in the backward (with dh)."""
    x = shapes(L)
    _, _, dk, dv, _ = dims(L)
    s_full = x.s * L.cp      # under CP a rank runs the whole sequence of its heads
    heads = L.linear_num_value_heads // L.tp // L.cp
    return x.b * ceil(s_full / CHUNK) * heads * dk * dv * x.e


def saved_items(L: Any, mods: set) -> dict[str, int]:
    """What one GDN mixer keeps for backward per micro-batch (TE spec, flash-linear-attention's kernels)."""
    x = shapes(L)
    T, Tf, h, e = x.T, x.Tf, x.h, x.e
    hk, hv, dk, dv, _ = dims(L)
    qk, v, heads, p, conv = widths(L)
    old = _old(L)
    items = {
        "norm1_stats": norm_stats(L, T),              # in_proj's fused norm: fp32 rstd (and mean) per token
        "gdn_in_proj_input": T * h * e,               # the norm output, kept by in_proj (local shard under SP)
    }
    if old:
        # 0.16.1 / 0.17.1: causal_conv1d_fn keeps its input, qkv.transpose(1, 2).contiguous() ([b, d, s]); in_proj's output
        # is freed (gate, beta and alpha are contiguous copies)
        items["gdn_conv_input"] = Tf * conv * e
    else:
        # 0.18.2 / 0.19.2: fla's causal_conv1d keeps x, a strided view of in_proj's output (after the CP all-to-all): the
        # whole [s, b, in_proj width] tensor stays, z, beta and alpha included
        items["gdn_in_proj_output"] = Tf * p * e
    # L2NormFunction on q and k (one call on [q, k] in 0.19.2, two in 0.16.1): output and fp32 rstd per head
    items["gdn_qk_l2norm"] = Tf * 2 * qk * e + Tf * 2 * (hk // L.tp) * 4
    repeated = hv != hk or not old
    # q and k for the kernel ([T, Hv, dk] each, contiguous): new tensors when repeated to the value heads, or (0.19.2)
    # contiguous copies of the halves of the normed [q, k]; 0.16.1 with Hv = Hk passes the norm outputs themselves
    items["gdn_q_k"] = 2 * Tf * heads * dk * e if repeated else 0
    items["gdn_v"] = Tf * v * e                   # value.contiguous(): a copy of the conv output's v part
    items["gdn_gate"] = Tf * v * e                # z (gate.contiguous()), kept for the gated norm's backward
    items["gdn_beta"] = Tf * heads * e            # beta.sigmoid(), kept by sigmoid and by the kernel
    # g = -exp(A_log) softplus(alpha + dt_bias): 0.19.2 runs it torch.compile'd (jit_fuser), keeping alpha (bf16);
    # 0.16.1 eagerly, keeping softplus's fp32 input and output
    items["gdn_decay_input"] = Tf * heads * (8 if old else e)
    items["gdn_kernel_g"] = Tf * heads * 4        # the kernel's chunk-local cumsum of g, fp32 (saved as g)
    items["gdn_kernel_A"] = Tf * heads * CHUNK * e   # A = (I + beta K K^T)^-1 per chunk, [T, Hv, 64], k's dtype
    items["gdn_core_output"] = Tf * v * e         # the kernel's output o, kept by out_norm
    if Version(str(L.megatron_version)) >= Version("0.19") and "gdn_norm_out" in mods:
        # CheckpointWithoutOutput around the gated norm (and the CP all-to-all): its inputs o and z stay (above),
        # its output is discarded after out_proj's forward and remade in the backward
        return items
    items["gdn_out_norm_stats"] = norm_stats(L, Tf * heads)   # out_norm's fp32 rstd per token and head
    items["gdn_out_norm_output"] = Tf * v * e     # norm(o), kept for the gate multiply's backward
    items["gdn_out_proj_input"] = Tf * v * e      # norm(o) * silu(z), transposed to [s, b]: kept by out_proj
    return items


def activations(L: Any, mods: set, has_batch_mask: bool, drop_norm: bool, after: frozenset,
                released: frozenset, G: int) -> MixerActivations:
    """The GDN mixer's saved tensors and working sets. Of the selective recompute modules only gdn_norm_out reaches
    it (0.19.2; 'core_attn' is the standard attention layers'); full recompute is applied per block by the caller."""
    x = shapes(L)
    T, Tf, h, e = x.T, x.Tf, x.h, x.e
    _, _, dk, dv, _ = dims(L)
    qk, v, heads, p, conv = widths(L)
    saved = saved_items(L, mods)
    states = _chunk_states(L)
    recomputed = "gdn_norm_out" in mods and Version(str(L.megatron_version)) >= Version("0.19")
    norm_names = frozenset({"gdn_out_norm_stats", "gdn_out_norm_output", "gdn_out_proj_input"})
    kernel_out = after | norm_names | {"gdn_core_output"}
    prep = kernel_out | {"gdn_qk_l2norm", "gdn_q_k", "gdn_v", "gdn_gate", "gdn_beta", "gdn_decay_input",
                         "gdn_kernel_g", "gdn_kernel_A"}
    g_in = Tf * heads * 4                           # g before the kernel's cumsum, fp32
    fwd_steps = (
        # the conv's output (and 0.19.2's contiguous copy of [q, k] before the l2 norm)
        (prep, Tf * conv * e + Tf * 2 * qk * e),
        # the kernel: A in fp32 before solve_tril's bf16 copy, then w, u, the chunk states h and v_new beside o
        (kernel_out, g_in + max(Tf * heads * CHUNK * 4, Tf * heads * (dk + 2 * dv) * e + states)),
    )
    norm_redo = (Tf * v * e * 2 + norm_stats(L, Tf * heads)) if recomputed else 0
    rel_proj = released | {"gdn_out_proj_input"}
    rel_norm = rel_proj | norm_names | {"gdn_core_output"}
    rel_kernel = rel_norm | {"gdn_q_k", "gdn_v", "gdn_beta", "gdn_kernel_g", "gdn_kernel_A", "gdn_decay_input"}
    rel_prep = rel_kernel | {"gdn_qk_l2norm", "gdn_gate", "gdn_conv_input", "gdn_in_proj_output"}
    bwd_steps = (
        (released, G + norm_redo + Tf * v * e + wgrad(L, h, v)),                                  # out_proj
        (rel_proj, G + norm_redo + 3 * Tf * v * e),                                               # gated norm
        # the kernel's backward: do and dz waiting, w, u, h and v_new again, dh, dv (twice), dq, dk, dw, dg
        (rel_norm, G + 2 * Tf * v * e + Tf * heads * (4 * dk + 4 * dv) * e + 2 * states + 2 * Tf * heads * 4),
        # l2 norm, repeat and conv backward into the gradient of in_proj's output
        (rel_kernel, G + Tf * p * e + 2 * Tf * conv * e),
        (rel_prep, G + Tf * p * e + Tf * h * e + wgrad(L, p, h)),                                 # in_proj
        (rel_prep | {"gdn_in_proj_input"}, G + Tf * h * e + T * h * e),                           # fused norm
    )
    return MixerActivations(saved=saved, fwd_steps=fwd_steps, bwd_steps=bwd_steps)


def bound_saved(L: Any, tp: int, b: int, seq: int, sp: bool, mods: set) -> int:
    """What a GDN layer surely keeps (the planner's lower bound): in_proj's input and the kernel's q, k, v."""
    e, h = L.act_bytes, L.hidden_size
    _, hv, dk, dv, _ = dims(L)
    Tf = b * seq
    T = Tf // tp if sp else Tf
    return T * h * e + Tf * (hv // tp) * (2 * dk + dv) * e
