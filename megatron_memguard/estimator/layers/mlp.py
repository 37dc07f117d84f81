"""The dense MLP (megatron-core MLP: linear_fc1, the activation, linear_fc2), gated (SwiGLU) or not.

Recipe of the MLP ``dense`` (see ``base``). The pre-MLP norm is registered with it (a module of its
own in the local spec, fused into linear_fc1 as ``layer_norm_weight`` in the TE spec); its saved
tensors and backward step belong to the layer (``estimator.activations``).
"""
from __future__ import annotations

from ...layout import Layout
from .base import MlpActivations, Param, ParamRow, norm_rows, norms_per_layer_norm, param_objects, shapes, wgrad


def fc1_out_per_rank(L: Layout) -> int:
    return (2 if L.gated_linear_unit else 1) * L.ffn_hidden_size // L.tp


def linear_shapes(L: Layout) -> dict[str, tuple[int, int]]:
    """[out, in] per TP rank of linear_fc1 (column-parallel) and linear_fc2 (row-parallel)."""
    h = L.hidden_size
    return {"linear_fc1": (fc1_out_per_rank(L), h), "linear_fc2": (h, L.ffn_hidden_size // L.tp)}


def param_rows(L: Layout) -> list[ParamRow]:
    """(name, numel, tp_replicated, shared_embedding, expert, cols) of each parameter (base.ParamRow)."""
    h = L.hidden_size
    te = L.transformer_impl == "transformer_engine"
    fc1 = fc1_out_per_rank(L)
    fc2_in = L.ffn_hidden_size // L.tp
    rows = norm_rows("mlp.linear_fc1.layer_norm" if te else "pre_mlp_layernorm", h, L)
    rows.append(("mlp.linear_fc1.weight", fc1 * h, False, False, False, h))
    if L.add_bias_linear:
        rows.append(("mlp.linear_fc1.bias", fc1, False, False, False, 0))
    rows.append(("mlp.linear_fc2.weight", h * fc2_in, False, False, False, fc2_in))
    if L.add_bias_linear:
        rows.append(("mlp.linear_fc2.bias", h, True, False, False, 0))
    if getattr(L, "post_proj_norms", False):
        # TERowParallelLinearLayerNorm's post_layernorm (Gemma 3's post-MLP norm, after linear_fc2's weight)
        rows += norm_rows("mlp.linear_fc2.post_layernorm", h, L)
    return rows


def params(L: Layout, prefix: str = "") -> list[Param]:
    return param_objects(param_rows(L), prefix)


def param_count(L: Layout) -> int:
    """Parameters of one layer's MLP in the whole model: pre-MLP norm, linear_fc1, linear_fc2 (and biases)."""
    h, f = L.hidden_size, L.ffn_hidden_size
    g = 2 if L.gated_linear_unit else 1
    n = norms_per_layer_norm(L) * h + g * f * h + h * f
    if L.add_bias_linear:
        n += g * f + h
    if getattr(L, "post_proj_norms", False):
        n += norms_per_layer_norm(L) * h   # Gemma 3's post-MLP norm (TERowParallelLinearLayerNorm)
    return n


def one_activation_op(L: Layout) -> bool:
    """The activation is one autograd node keeping only its input: the fused bias-activation, or TE's
    activation op under the op fuser (TEFusedMLP, megatron-core 0.19.2 extensions/transformer_engine.py:
    TE 2.x ops/basic/activation.py saves its input only, whatever --bias-swiglu-fusion says). A MoE
    model's dense layers never use the op fuser (get_gpt_decoder_block_spec)."""
    return L.bias_activation_fusion or (L.use_transformer_engine_op_fuser and L.moe is None)


def activations(L: Layout, mods: set, G: int) -> MlpActivations:
    """fc1's output, the activation's inputs and fc2's input, and the backward from linear_fc2 to
    linear_fc1. ``mods``: the selectively recomputed modules ('mlp' drops them all and remakes them
    for the backward); ``G``: the gradient of the layer output.

    Under the op fuser (TEFusedMLP) the ops save the same tensors as the TE modules: the norm op its
    input and rstd, BasicLinear its (sequence-parallel local) input, the activation op its input, the
    second BasicLinear the activation's output (TE 2.11 ops/basic/{rmsnorm,layer_norm,basic_linear,
    activation}.py ``save_for_backward``); only the unfused GLU's extra factors go."""
    x = shapes(L)
    Tf, h, e, f_t = x.Tf, x.h, x.e, x.f_t
    fc1_w = (2 if L.gated_linear_unit else 1) * f_t
    fused_act = one_activation_op(L)
    mlp: dict[str, int] = {}
    if L.gated_linear_unit:
        mlp["fc1_output"] = Tf * fc1_w * e
        if not fused_act:
            # unfused glu (mlp.py): silu(x0) * (x1 + glu_linear_offset); the product keeps both factors
            mlp["activation_gate"] = Tf * f_t * e
            mlp["activation_linear"] = Tf * f_t * e
        mlp["fc2_input"] = Tf * f_t * e
    else:
        mlp["fc1_output"] = Tf * f_t * e
        mlp["fc2_input"] = Tf * f_t * e
    names = frozenset(mlp)
    recomputed = "mlp" in mods
    rel_mlp = frozenset({"fc2_input"})
    rel_act = rel_mlp | names

    def remade(released: frozenset) -> int:
        """MLP tensors recomputed for the backward ('mlp' recompute) and not yet released."""
        return sum(v for k, v in mlp.items() if k not in released) if recomputed else 0

    u = Tf * f_t * e          # one [s b, ffn/t] tensor: fc2's input gradient, each activation gradient
    if L.gated_linear_unit and not fused_act:
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
    bwd_steps = (
        (frozenset(), G + remade(frozenset()) + u + wgrad(L, h, f_t)),                            # fc2
        *act_steps,                                                                                # activation
        (rel_act, G + Tf * fc1_w * e + Tf * h * e + wgrad(L, fc1_w, h)),                          # fc1
    )
    return MlpActivations(saved={} if recomputed else mlp, names=names, bwd_steps=bwd_steps, released=rel_act)


def bound_saved(L: Layout, tp: int, b: int, seq: int, sp: bool, mods: set) -> int:
    """Bytes one layer's MLP surely keeps per micro-batch (the planner's memory lower bound): linear_fc1's
    input (unless the local spec recomputes the norm), fc1's output (the activation's input) and
    linear_fc2's input, unless 'mlp' is recomputed."""
    e, h = L.act_bytes, L.hidden_size
    Tf = b * seq
    T = Tf // tp if sp else Tf
    f_t = L.ffn_hidden_size // tp
    kept = 0 if ("layernorm" in mods and L.transformer_impl == "local") else T * h * e
    if "mlp" not in mods:
        kept += Tf * (2 if L.gated_linear_unit else 1) * f_t * e
        kept += Tf * f_t * e
    return kept
