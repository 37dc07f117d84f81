"""The Mamba mixer of a hybrid model's 'M' layers (megatron-core MambaLayer + MambaMixer, TE spec).

Sources: megatron-core 0.19.2 ssm/mamba_mixer.py (MambaMixer.__init__ and _ssm_training), ssm/mamba_layer.py,
models/hybrid/hybrid_layer_specs.py (in_proj = TELayerNormColumnParallelLinear with the layer's norm fused in,
out_proj = TERowParallelLinear, the MambaLayer's own norm left IdentityOp); mamba_ssm 2.2.6
ops/triton/ssd_combined.py (MambaSplitConv1dScanCombinedFn: what the fused conv + chunked scan keeps for
backward) and ops/triton/layernorm_gated.py (the gated RMSNorm's LayerNormFn). megatron-core 0.16.1 to 0.18.2
build the same tensors (their conv1d is an nn.Conv1d: parameters ``conv1d.weight`` / ``conv1d.bias``).

Shapes per TP rank (t): d_inner = heads x head_dim (heads = 2 h / head_dim unless --mamba-num-heads), heads
and groups split over TP; in_proj's output packs [z, x, B, C, dt] = 2 d_inner + 2 groups N + heads
(N = --mamba-state-dim). The layer's parameters keep the model dtype (Float16Module casts A_log and D too).
"""
from __future__ import annotations

from math import ceil
from typing import Any

from .base import MixerActivations, Param, ParamRow, norm_rows, norm_stats, norms_per_layer_norm, param_objects
from .base import shapes, wgrad

D_CONV = 4      # MambaMixer's d_conv default (the causal conv1d's width)


def dims(L: Any) -> tuple[int, int, int, int, int]:
    """(d_inner, heads, groups, state, head_dim) of the whole layer (before TP)."""
    heads, hd = L.mamba_num_heads, L.mamba_head_dim
    return heads * hd, heads, L.mamba_num_groups, L.mamba_state_dim, hd


def in_proj_out(L: Any) -> int:
    """in_proj's output width per TP rank: z, x (d_inner/t each), B, C (groups/t x N each), dt (heads/t)."""
    di, nh, g, n, _ = dims(L)
    t = L.tp
    return (2 * di + 2 * g * n + nh) // t


def linear_shapes(L: Any) -> dict[str, tuple[int, int]]:
    di, *_ = dims(L)
    return {"mixer.in_proj": (in_proj_out(L), L.hidden_size), "mixer.out_proj": (L.hidden_size, di // L.tp)}


def param_rows(L: Any) -> list[ParamRow]:
    """In the order module.parameters() walks MambaMixer (what the DDP buffer follows): its own parameters
    first, in registration order, then its submodules'. 0.19.2: conv1d_weight [conv_dim, 1, 4], conv1d_bias,
    dt_bias, A_log, D (one per head), then in_proj (TE registers its fused norm first), the gated RMSNorm's
    weight, out_proj. 0.16.1 to 0.18.2: dt_bias, A_log, D, then in_proj, conv1d (an nn.Conv1d), norm, out_proj
    (the conv1d became the mixer's own conv1d_weight / conv1d_bias in 0.19). All but the fused norm are TP-sharded;
    no biases on in_proj / out_proj (MambaMixer asserts bias=False)."""
    h, t = L.hidden_size, L.tp
    di, nh, g, n, _ = dims(L)
    conv = (di + 2 * g * n) // t
    own = [("mixer.dt_bias", nh // t, False, False, False, 0),
           ("mixer.A_log", nh // t, False, False, False, 0),
           ("mixer.D", nh // t, False, False, False, 0)]
    # TE's LayerNormColumnParallelLinear names its norm layer_norm_weight (and layer_norm_bias for LayerNorm)
    in_proj = [(name.replace("layer_norm.", "layer_norm_"), *rest)
               for name, *rest in norm_rows("mixer.in_proj.layer_norm", h, L)] + [
        ("mixer.in_proj.weight", in_proj_out(L) * h, False, False, False, h)]
    tail = [("mixer.norm.weight", di // t, False, False, False, 0),
            ("mixer.out_proj.weight", h * (di // t), False, False, False, di // t)]
    from packaging.version import Version
    if Version(str(L.megatron_version)) < Version("0.19"):
        conv_rows = [("mixer.conv1d.weight", conv * D_CONV, False, False, False, 0),
                     ("mixer.conv1d.bias", conv, False, False, False, 0)]
        return own + in_proj + conv_rows + tail
    conv_rows = [("mixer.conv1d_weight", conv * D_CONV, False, False, False, 0),
                 ("mixer.conv1d_bias", conv, False, False, False, 0)]
    return conv_rows + own + in_proj + tail


def params(L: Any, prefix: str = "") -> list[Param]:
    return param_objects(param_rows(L), prefix)


def param_count(L: Any) -> int:
    """One Mamba layer in the whole model (no TP split)."""
    h = L.hidden_size
    di, nh, g, n, _ = dims(L)
    conv = di + 2 * g * n
    return (norms_per_layer_norm(L) * h + (2 * di + 2 * g * n + nh) * h + conv * (D_CONV + 1) + 3 * nh + di
            + h * di)


def reads_batch_mask(L: Any) -> bool:
    return False


def scan_split(L: Any) -> tuple[int, int, int, int, int]:
    """What the conv1d and the chunk scan of one rank see: (sequence length, heads, groups, d_inner, zxbcdt width).

    Without context parallelism the rank's sequence and its heads / groups over TP. With CP, MambaContextParallel
    (megatron-core 0.16.1 and 0.19.2 ssm/mamba_context_parallel.py, ``pre_conv_ssm``) all-to-alls in_proj's output
    from [s/CP, b, .] to [s, b, ./CP]: the whole sequence, heads / (TP x CP), and groups / (TP x CP), or one group
    repeated when a TP rank holds fewer groups than CP (``group_repeat_count``)."""
    x = shapes(L)
    di, nh, g, n, _ = dims(L)
    t, cp = L.tp, L.cp
    nh_s, di_s = nh // t // cp, di // t // cp
    g_s = max(1, g // t // cp)
    return x.s * cp, nh_s, g_s, di_s, 2 * di_s + 2 * g_s * n + nh_s


def _chunk_states(L: Any) -> int:
    """Elements of the SSD kernel's per-chunk states [b, chunks, heads/t, head_dim, N]: made in fp32
    (_chunk_state_fwd with states_in_fp32), passed along the chunks into a copy in the activation dtype
    (_state_passing_fwd's out_dtype=C.dtype), mamba_ssm 2.2.6 ssd_combined.py; again in the backward. Under CP:
    the whole sequence, heads / (TP x CP) (``scan_split``)."""
    x = shapes(L)
    _, _, _, n, hd = dims(L)
    seq, nh_s, *_ = scan_split(L)
    return x.b * ceil(seq / L.mamba_chunk_size) * nh_s * hd * n


def _chunk_scores(L: Any) -> int:
    """C^T B per chunk [b, chunks, groups/t, chunk, chunk] in fp32 (_bmm_chunk_fwd, ssd_combined.py); chunk
    128 by default (MambaMixer's chunk_size)."""
    x = shapes(L)
    seq, _, g_s, _, _ = scan_split(L)
    c = L.mamba_chunk_size
    return x.b * ceil(seq / c) * g_s * c * c * 4


def saved_items(L: Any) -> dict[str, int]:
    """What one Mamba layer's mixer keeps for backward per micro-batch, TE spec, memory-efficient path."""
    x = shapes(L)
    T, Tf, h, e = x.T, x.Tf, x.h, x.e
    di, _, g, _, _ = dims(L)
    di_t = di // L.tp
    seq, _, _, di_s, P_s = scan_split(L)
    Ts = x.b * seq          # the scan's tokens: Tf, or the whole sequence under CP
    return {
        "norm1_stats": norm_stats(L, T),               # in_proj's fused norm: fp32 rstd (and mean) per token
        "mamba_in_proj_input": T * h * e,              # the norm output, kept by in_proj (local shard under SP)
        "mamba_zxbcdt": Ts * P_s * e,                  # in_proj's output as the fused scan's (b, l, d) copy
        "mamba_scan_output": Ts * di_s * e,            # out_x: the scan output before the z gate
        # (under CP the scan's output is all-to-all'ed back to [s/CP, b, d_inner/TP] before the gated norm)
        "mamba_norm_input": Tf * di_t * e,             # the gated output, kept by the gated RMSNorm
        "mamba_norm_stats": Tf * (g // L.tp) * 4,      # its fp32 rstd per token and group
        "mamba_out_proj_input": Tf * di_t * e,         # the norm output, kept by out_proj
    }


def activations(L: Any, mods: set, has_batch_mask: bool, drop_norm: bool, after: frozenset,
                released: frozenset, G: int) -> MixerActivations:
    """The Mamba mixer's saved tensors and working sets. Selective recompute modules do not reach it
    (MambaLayer checks none); full recompute is applied per block by the caller."""
    x = shapes(L)
    T, Tf, h, e = x.T, x.Tf, x.h, x.e
    di, nh, g, n, _ = dims(L)
    t = L.tp
    di_t, P = di // t, in_proj_out(L)
    saved = saved_items(L)
    states, scores = _chunk_states(L), _chunk_scores(L)
    seq, nh_s, g_s, di_s, P_s = scan_split(L)
    Ts, conv_s = x.b * seq, di_s + 2 * g_s * n       # the scan's tokens and conv channels (CP: scan_split)
    dt_fp32 = 2 * Ts * nh_s * 4                       # dt after softplus and dA's cumulative sum, fp32
    # (with one sequence per micro-batch the [l, b] -> [b, l] rearrange is a view: no second copy)
    orig = Ts * P_s * e if x.b > 1 else 0
    base = orig + Ts * conv_s * e + dt_fp32           # in_proj's [l, b] output, the conv output, dt, dA_cumsum
    later = after | {"mamba_norm_input", "mamba_norm_stats", "mamba_out_proj_input"}
    cp_fwd: tuple = ()
    if L.cp > 1:
        # pre_conv_ssm: in_proj's output [s/CP, b, P/TP], its five pieces all-to-all'ed ([s, b, ./CP] each), their
        # concatenation and its reordering out of the attention load balancing (_undo_attention_load_balancing: a
        # new tensor, which the scan keeps); none of it is saved for backward (all_to_all_sp2hp, cat and split keep
        # no tensor), in_proj's output is freed when pre_conv_ssm returns
        cp_fwd = ((later | {"mamba_scan_output", "mamba_zxbcdt"}, Tf * P * e + 3 * Ts * P_s * e),)
    fwd_steps = cp_fwd + (
        (later | {"mamba_scan_output"}, base + states * (4 + e)),                  # the states passed along
        (later, base + states * e + scores + Ts * di_s * e),                       # the scan: C^T B, gated output
    )
    rel_out = released | {"mamba_out_proj_input"}
    rel_norm = rel_out | {"mamba_norm_input", "mamba_norm_stats"}
    rel_scan = rel_norm | {"mamba_zxbcdt", "mamba_scan_output"}
    cp_bwd: tuple = ()
    if L.cp > 1:
        # pre_conv_ssm's backward: the reordered gradient [s, b, P_s], the five pieces all-to-all'ed back to
        # [s/CP, b, .] and their concatenation as in_proj's output gradient [s/CP, b, P/TP]
        cp_bwd = ((rel_scan, G + Ts * P_s * e + 2 * Tf * P * e),)
    bwd_steps = (
        (released, G + Tf * di_t * e + wgrad(L, h, di_t)),                                       # out_proj
        (rel_out, G + 2 * Tf * di_t * e),                                                         # gated norm
        # the scan's backward: dzxbcdt, the recomputed conv output and its gradient, the states again, dt's
        (rel_norm, G + Ts * di_s * e + Ts * P_s * e + 2 * Ts * conv_s * e + states * (4 + e) + scores + dt_fp32),
        *cp_bwd,
        (rel_scan, G + Tf * P * e + Tf * h * e + wgrad(L, P, h)),                                # in_proj
        (rel_scan | {"mamba_in_proj_input"}, G + Tf * h * e + T * h * e),                         # fused norm
    )
    return MixerActivations(saved=saved, fwd_steps=fwd_steps, bwd_steps=bwd_steps)


def bound_saved(L: Any, tp: int, b: int, seq: int, sp: bool, mods: set) -> int:
    """What a Mamba layer surely keeps (the planner's lower bound): in_proj's input and output copy."""
    e, h = L.act_bytes, L.hidden_size
    di, nh, g, n, _ = dims(L)
    Tf = b * seq
    T = Tf // tp if sp else Tf
    return T * h * e + Tf * ((2 * di + 2 * g * n + nh) // tp) * e
