"""FP8 / FP4 per layer and per pipeline stage: a layer's TE GEMMs (from the layer recipes' weight
shapes), the saved tensors of an FP8 layer that change size (by the estimator's names), and a stage's
FP8 terms. The per-tensor bytes are ``estimator/fp8.py``'s."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Mapping

from .fp8 import (Fp8Spec, grouped_saved_input, non_tn_gpu, param_buffer_bytes_per_element, primary_weight,
                  recipe_state_bytes, saved_input, uncached_weight_copies, weight_workspace)

@dataclass(frozen=True)
class Gemm:
    """One TE GEMM module of a layer on one rank: its weight [rows, cols] (``count`` of them for a
    grouped linear, one per local expert, each cached on its own: ``cache_name="weight{i}"``) and the
    input it saves for backward ([tokens, cols]; ``tokens`` is the local shard when ``sp_gathered``)."""

    name: str
    rows: int
    cols: int
    tokens: int = 0
    sp_gathered: bool = False
    count: int = 1
    # run by Transformer Engine's operation fuser (TEFusedMLP's BasicLinear ops), not by its TE module
    op_fused: bool = False
    # the op keeps its weight copy with both usages (TEFusedMLPWithGroupedLinear's fused grouped MLP kernel)
    op_keeps_both: bool = False


def op_fuser_weight(spec: Fp8Spec, g: Gemm, *, non_tn: bool = False, both_usages: bool = False) -> int:
    """What an op-fused GEMM (``TEFusedMLP``'s ``BasicLinear``, TE 2.20.2 ``ops/basic/basic_linear.py``
    ``_functional_forward``) keeps of its weight per micro-batch: with a BF16 weight it quantizes a fresh copy
    each forward (``weight_quantizer(w)``, no workspace cache: "workspace freshly created each forward pass") and
    saves it column-wise only (``update_usage(rowwise_usage=False, columnwise_usage=True)``); a primary quantized
    weight is used as it is (nothing new). ``both_usages``: the experts' fused grouped MLP kernel and TE's
    grouped-tensor GroupedLinear path keep the copy as quantized, row-wise and column-wise (TE 2.20.2
    ``ops/fused/grouped_mlp.py`` ``fuser_forward``, ``ops/basic/grouped_linear.py`` ``_fuser_forward_grouped_tensor``:
    no ``update_usage`` on the weights they save)."""
    r = spec.recipe
    if r is None or spec.primary_weights_quantized or not g.op_fused:
        return 0
    from .fp8 import quantized_tensor
    return g.count * quantized_tensor(r, g.rows, g.cols, rowwise=both_usages or g.op_keeps_both, columnwise=True,
                                      non_tn=non_tn,
                                      block_2d=r == "blockwise").allocated


def op_fuser_saved_input(spec: Fp8Spec, g: Gemm, *, non_tn: bool = False) -> int:
    """What an op-fused GEMM keeps of its quantized input: the norm (or activation) op before it quantizes its
    output with the GEMM's input quantizer, set for both usages in training (``BasicLinear.pre_fuser_forward``);
    the GEMM then keeps the column-wise data, except a Float8 input all-gathered over TP (delayed / tensorwise,
    column-parallel with sequence parallelism: "FP8 does not support all-gather of transpose data"), which keeps
    the local shard as quantized: row-wise data and, on Hopper, its transpose (TE 2.20.2 ``basic_linear.py``)."""
    r = spec.recipe
    if r in ("delayed", "tensorwise") and g.sp_gathered:
        from .fp8 import quantized_tensor
        return g.count * quantized_tensor(r, g.tokens, g.cols, rowwise=True, columnwise=True, non_tn=non_tn).allocated
    return g.count * saved_input(spec, g.tokens, g.cols, sp_gathered=g.sp_gathered, non_tn=non_tn).allocated


def dense_layer_gemms(*, hidden_size: int, ffn_hidden_size: int, num_attention_heads: int,
                      num_query_groups: int, kv_channels: int, gated_linear_unit: bool,
                      tensor_model_parallel_size: int = 1, sequence_parallel: bool = False,
                      seq_length: int = 0, micro_batch_size: int = 0, context_parallel_size: int = 1) -> tuple[Gemm, ...]:
    """The four TE GEMMs of a standard (MHA / GQA) transformer layer on one TP rank, from Megatron's
    flat argument names: linear_qkv and linear_fc1 (``TELayerNormColumnParallelLinear``, their input
    all-gathered over TP with sequence parallelism), linear_proj and linear_fc2
    (``TERowParallelLinear``, input already split)."""
    t = tensor_model_parallel_size
    h = hidden_size
    tokens_full = seq_length // context_parallel_size * micro_batch_size
    local = tokens_full // t if sequence_parallel else tokens_full
    sp = sequence_parallel and t > 1
    qkv = (num_attention_heads + 2 * num_query_groups) * kv_channels // t
    ctx = num_attention_heads * kv_channels // t
    f = ffn_hidden_size // t
    return (
        Gemm("linear_qkv", qkv, h, local, sp),
        Gemm("linear_proj", h, ctx, tokens_full),
        Gemm("linear_fc1", (2 if gated_linear_unit else 1) * f, h, local, sp),
        Gemm("linear_fc2", h, f, tokens_full),
    )


def weight_cache_bytes(spec: Fp8Spec, gemms: tuple[Gemm, ...], *, non_tn: bool = False) -> int:
    """``fp8_weight_cache``: the cached quantized copies of one layer's GEMM weights (payload and scale
    tensors), 0 when the weights are primary FP8/FP4 or caching is disabled."""
    return sum(g.count * weight_workspace(spec, g.rows, g.cols, non_tn=non_tn).allocated for g in gemms
               if not g.op_fused)   # TE's op fuser caches no workspace (op_fuser_weight)


def primary_weight_extra_bytes(spec: Fp8Spec, gemms: tuple[Gemm, ...], *, non_tn: bool = False,
                               distributed_optimizer: bool = True) -> int:
    """``fp8_weight_columnwise``: what primary quantized weights keep in TE storage outside the DDP
    parameter buffer (transposes on Hopper, column-wise copies, scales)."""
    return sum(g.count * primary_weight(spec, g.rows, g.cols, non_tn=non_tn,
                                        distributed_optimizer=distributed_optimizer).te_storage for g in gemms)


def primary_weight_scale_bytes(spec: Fp8Spec, gemms: tuple[Gemm, ...], *, non_tn: bool = False) -> int:
    """The scale tensors alone of one layer's primary quantized weights (what stays outside Megatron-FSDP's
    buffers)."""
    from .fp8 import quantized_tensor
    r = spec.recipe
    if r is None or not spec.primary_weights_quantized:
        return 0
    return sum(g.count * quantized_tensor(r, g.rows, g.cols, rowwise=True, columnwise=True, non_tn=non_tn,
                                          block_2d=r == "blockwise").scale_bytes for g in gemms)


def layer_recipe_state_bytes(spec: Fp8Spec, gemms: tuple[Gemm, ...]) -> int:
    """``fp8_scales``: the recipe state of one layer's TE modules (a grouped linear is one module of
    ``count`` GEMMs); an op-fused GEMM's ``BasicLinear`` has 2 forward and 1 backward quantizers (input, weight;
    grad output: ``num_quantizers``, TE 2.20.2 ``ops/basic/basic_linear.py``; its TE module never runs)."""
    return sum(recipe_state_bytes(spec, g.count, forward=2, backward=1) if g.op_fused else
               recipe_state_bytes(spec, g.count) for g in gemms)


def saved_inputs(spec: Fp8Spec, gemms: tuple[Gemm, ...], *, non_tn: bool = False) -> dict[str, int]:
    """Bytes each GEMM keeps of its quantized input for backward, by GEMM name (one micro-batch); 0 for a
    linear_proj that keeps its BF16 input (``proj_saves_original_input``)."""
    return {g.name: 0 if g.name == "linear_proj" and proj_saves_original_input(spec) else
            g.count * saved_input(spec, g.tokens, g.cols, sp_gathered=g.sp_gathered, non_tn=non_tn).allocated
            for g in gemms}


# GEMMs whose input is all-gathered over TP inside the module with sequence parallelism (column-parallel
# TE linears), those that take the whole sequence already split over TP (row-parallel) and MLA's down
# projections (TE Linears in "duplicated" mode on the local sequence shard).
_COLUMN = frozenset({"linear_qkv", "linear_fc1", "linear_q_proj", "linear_q_up_proj", "linear_kv_up_proj",
                     "linear_attn", "linear_mlp",   # (these two: a heterogeneous config's linear replacements)
                     "mixer.in_proj",               # a Mamba layer's TELayerNormColumnParallelLinear (layers/mamba.py)
                     "in_proj"})                    # a GDN layer's (layers/gdn.py)
# (out_proj: a Mamba layer's TERowParallelLinear, and a GDN layer's)
_ROW = frozenset({"linear_proj", "linear_fc2", "mixer.out_proj", "out_proj"})


def gemms_from_shapes(shapes: Mapping[str, tuple[int, int]], *, T: int, Tf: int, tp: int,
                      sequence_parallel: bool) -> tuple[Gemm, ...]:
    """GEMM descriptors from a layer's linear weight shapes ``{name: (out, in)}`` per rank (the
    estimator's ``layer_linear_shapes``), with ``T`` tokens of the sequence-sharded stream and ``Tf``
    inside the TP region."""
    sp = sequence_parallel and tp > 1
    out: list[Gemm] = []
    for name, (rows, cols) in shapes.items():
        if name in _COLUMN:
            out.append(Gemm(name, rows, cols, T, sp))
        elif name in _ROW:
            out.append(Gemm(name, rows, cols, Tf))
        else:
            # MLA's down projections and any other TE linear on the local sequence shard
            out.append(Gemm(name, rows, cols, T))
    return tuple(out)


def proj_saves_original_input(spec: Fp8Spec) -> bool:
    """Whether linear_proj keeps its BF16 input for backward instead of a quantized copy: megatron-core calls
    ``set_save_original_input(self.linear_proj)`` for FP8 with any recipe but delayed (TE >= 2.6) and for FP4
    (TE >= 2.7) (``attention.py`` SelfAttention/Attention ``__init__``, ``multi_latent_attention.py``, core
    0.16.1 and 0.19.2; also 0.19.2's ``absorbed_mla.py``). memguard models TE 2.11 (0.16.1 pins ``>= 2.9``),
    so the TE gates always hold. Delayed scaling cannot (TE 2.11 ``linear.py`` asserts no ``Float8Quantizer``
    with ``save_original_input``)."""
    return bool(spec.fp4) or bool(spec.fp8 and spec.fp8_recipe != "delayed")


def proj_backward_input(spec: Fp8Spec, tokens: int, width: int, *, non_tn: bool = False) -> int:
    """Bytes of the quantized copy linear_proj makes of its BF16 input in backward when it saved the original
    (TE 2.11 ``linear.py`` ``_Linear.backward``, "Prepare input tensor": ``quantizer(inputmat)``), alive through
    its weight-gradient GEMM. Per-tensor current scaling (``supports_only_rowwise_all_gather``) asks for both
    usages (row-parallel: no gather), so Hopper makes data and transpose; the block recipes column-wise only."""
    from .fp8 import quantized_tensor
    r = spec.recipe
    return quantized_tensor(r, tokens, width, rowwise=r in ("delayed", "tensorwise"), columnwise=True,
                            non_tn=non_tn).allocated


def saved_overrides(spec: Fp8Spec, gemms: tuple[Gemm, ...], saved: Mapping[str, int], *, act_bytes: int,
                    non_tn: bool = False, fc1_output_elements: int = 0) -> dict[str, int]:
    """The saved tensors of one FP8 layer that change size, by the estimator's names
    (``estimator/activations.py``), for one micro-batch. ``saved`` is the BF16 layer's dict (only
    names in it are changed; what a recompute option drops stays dropped).

    * ``qkv_input`` / ``fc1_input``: the norm output TE's LayerNormLinear keeps is quantized (TE
      quantizes inside the norm kernel, ``with_quantized_norm``); under MLA the norm output feeds both
      down projections (or linear_q_proj), each keeping its own quantized copy.
    * ``fc2_input``: the activation's output, kept by fc2 only, quantized.
    * Mamba ``mamba_in_proj_input`` / ``mamba_out_proj_input``: in_proj's fused norm output and out_proj's input
      (the gated norm's output, kept by out_proj only), quantized; the mixer's other tensors stay BF16 (the
      conv1d, the chunk scan and the gated norm are mamba_ssm kernels outside TE); a GDN layer's
      ``gdn_in_proj_input`` / ``gdn_out_proj_input`` alike (its conv1d, l2 norms, chunked delta-rule kernel and
      gated norm are torch / flash-linear-attention code outside TE and stay BF16).
    * ``fp8_proj_input`` (new, delayed scaling only): linear_proj quantizes the attention output and keeps
      that copy; the BF16 output stays saved (``proj_input``) only where the core attention keeps it
      (``layers.attention.attention_keeps_proj_input``; the caller drops it elsewhere). Every other recipe and FP4 keep the BF16
      input itself (``proj_saves_original_input``): ``proj_input`` as in BF16, nothing new.
    * MLA ``q_latent`` / ``kv_latent``: kept by the up projections, quantized; with ``--qk-layernorm``
      the up projections are LayerNormLinears and the normalised latents inside ``latent_norms`` are
      quantized instead (the latents stay BF16 as the norms' inputs).
    * ``fc1_output`` with ``activation_func_fp8_input_store``: one byte per element
      (``fc1_output_elements`` of them).
    * ``fp8_weight_copies`` (new) with ``disable_parameter_transpose_cache``: the quantized weights of
      this micro-batch (row-wise and column-wise)."""
    g = {x.name: x for x in gemms}

    def q(name: str) -> int:
        x = g[name]
        if x.op_fused:
            return op_fuser_saved_input(spec, x, non_tn=non_tn)
        return x.count * saved_input(spec, x.tokens, x.cols, sp_gathered=x.sp_gathered, non_tn=non_tn).allocated

    out: dict[str, int] = {}
    if "qkv_input" in saved:
        readers = [n for n in ("linear_qkv", "linear_q_proj", "linear_q_down_proj", "linear_kv_down_proj",
                               "linear_attn") if n in g]
        if readers:
            out["qkv_input"] = sum(q(n) for n in readers)
    for name, gemm in (("fc1_input", "linear_fc1"), ("fc1_input", "linear_mlp"), ("fc2_input", "linear_fc2"),
                       # a Mamba layer: in_proj keeps its fused norm's quantized output, out_proj a quantized
                       # copy of the gated norm's output (MambaMixer makes neither save its original input,
                       # 0.19.2 mamba_mixer.py)
                       ("mamba_in_proj_input", "mixer.in_proj"), ("mamba_out_proj_input", "mixer.out_proj"),
                       # a GDN layer the same (GatedDeltaNet sets no save_original_input, core 0.16.1 and 0.19.2):
                       # in_proj's fused norm output, out_proj's input norm(o) silu(z), quantized
                       ("gdn_in_proj_input", "in_proj"), ("gdn_out_proj_input", "out_proj")):
        if name in saved and gemm in g:
            out[name] = q(gemm)
    if "linear_proj" in g and not proj_saves_original_input(spec):
        out["fp8_proj_input"] = q("linear_proj")
    ups = [(n, lat) for n, lat in (("linear_q_up_proj", "q_latent"), ("linear_kv_up_proj", "kv_latent")) if n in g]
    if "latent_norms" in saved and ups:
        bf16 = sum(g[n].tokens * g[n].cols * act_bytes for n, _ in ups)
        out["latent_norms"] = saved["latent_norms"] - bf16 + sum(q(n) for n, _ in ups)
    elif ups:
        for n, lat in ups:
            # with mla_up_proj recompute the checkpoint keeps the whole BF16 kv down-projection output
            if lat in saved and saved[lat] == g[n].tokens * g[n].cols * act_bytes:
                out[lat] = q(n)
    if spec.activation_func_fp8_input_store and "fc1_output" in saved and fc1_output_elements:
        out["fc1_output"] = fc1_output_elements
    if spec.disable_parameter_transpose_cache:
        # no workspace cache: each GEMM saves the weight copy it quantized for this micro-batch
        out["fp8_weight_copies"] = sum(x.count * uncached_weight_copies(spec, x.rows, x.cols, non_tn=non_tn).allocated
                                       for x in gemms if not x.op_fused)
    if "fc2_input" in saved:
        # TEFusedMLP's BasicLinear ops: the column-wise weight copies of this micro-batch (none with primary weights)
        ops = sum(op_fuser_weight(spec, x, non_tn=non_tn) for x in gemms)
        if ops:
            out["fp8_op_fuser_weights"] = ops
        fc2 = g.get("linear_fc2")
        if fc2 is not None and fc2.op_keeps_both:
            # TEFusedMLPWithGroupedLinear.forward: the activation's scales, torch.ones(tokens) in the activation
            # dtype, kept by the fused grouped MLP kernel with its inputs
            out["dense_mlp_scales"] = fc2.tokens * act_bytes
    return out


# ----- a Layout's layers and stages (lazy imports: the layer recipes import the layout) -------------

def layer_gemms(L: Any, kind: Any) -> tuple[Gemm, ...]:
    """The TE GEMMs of one layer of ``kind`` on one rank of layout ``L``, from its recipes'
    ``linear_shapes``."""
    from .layers import kind_layout, mixer_recipe, mlp_recipe
    from .layers.base import shapes
    L = kind_layout(L, kind)     # a heterogeneous layer's own MLP width
    x = shapes(L)
    sh = {**mixer_recipe(kind).linear_shapes(L), **mlp_recipe(kind).linear_shapes(L)}
    gemms = gemms_from_shapes(sh, T=x.T, Tf=x.Tf, tp=L.tensor_model_parallel_size,
                              sequence_parallel=L.sequence_parallel)
    from ..partition import DSA_MIXERS
    if kind.mixer in DSA_MIXERS:
        gemms = dsa_gemms(gemms, x.Tf)
    moe = getattr(L, "moe", None)
    if moe is not None and moe.moe_use_legacy_grouped_gemm:
        # the legacy GroupedMLP (core 0.16.1 experts.py) runs grouped_gemm's gmm on its BF16 weight1 / weight2: no TE
        # module, so no quantized copy, recipe state or primary FP8 weight for the experts (resolve/moe.py)
        gemms = tuple(g for g in gemms if not g.name.startswith("experts."))
    elif moe is not None:
        # a grouped linear's shape is one expert's: TE caches one workspace per local expert ("weight{i}"); under
        # the op fuser the experts run as TE's GroupedLinear ops instead (resolve/moe.py experts_op_fuser), which
        # cache no workspace (fused_experts_overrides)
        fused = bool(getattr(L, "use_transformer_engine_op_fuser", False))
        gemms = tuple(replace(g, count=moe.local_experts, op_fused=fused) if g.name.startswith("experts.") else g
                      for g in gemms)
    elif getattr(L, "use_transformer_engine_op_fuser", False):
        # --use-transformer-engine-op-fuser (core 0.19.2 gpt_layer_specs): a dense model's MLP is TEFusedMLP, whose
        # fc1 / fc2 run as TE BasicLinear ops (resolve/kernels.py op_fuser)
        # with --use-grouped-gemm-for-dense-mlp at TP 1 (resolve/kernels.py grouped_dense_mlp) they are
        # TEFusedMLPWithGroupedLinear's GroupedLinear(1) ops under the fused grouped MLP kernel, which keeps its
        # weight copies with both usages (ops/fused/grouped_mlp.py, TE 2.20.2)
        both = bool(getattr(L, "grouped_dense_mlp", False))
        gemms = tuple(replace(g, op_fused=True, op_keeps_both=both) if g.name in ("linear_fc1", "linear_fc2") else g
                      for g in gemms)
    return gemms


def dsa_gemms(gemms: tuple[Gemm, ...], Tf: int) -> tuple[Gemm, ...]:
    """A DSA layer's TE GEMMs (megatron-core 0.19.2 get_dsa_module_spec_for_backend, absorbed_mla.py, dsa.py):
    AbsorbedMLA never runs linear_kv_up_proj as a module (its weight goes into the einsums, _get_kv_up_weights), so it
    has no weight workspace, recipe state or saved input; the indexer's duplicated linears (linear_wq_b, linear_wk,
    linear_weights_proj) take x and qr already gathered over TP by DSAIndexer (all Tf tokens, no gather inside)."""
    return tuple(replace(g, tokens=Tf, sp_gathered=False) if g.name.startswith("indexer_") else g
                 for g in gemms if g.name != "linear_kv_up_proj")


def dsa_primary_weights(L: Any, kind: Any) -> tuple[Gemm, ...]:
    """A DSA layer's linear_kv_up_proj under primary quantized weights (``--fp8-param-gather``): never run as a module
    (``dsa_gemms``), yet built under fp8_model_init like every TE linear (TE 2.20.2 module/linear.py: its __init__
    calls init_fp8_metadata and reset_parameters makes the weight a quantized tensor), so its weight takes the
    parameter buffer's bytes, TE storage and recipe state of any primary weight (no saved input, no workspace)."""
    from ..partition import DSA_MIXERS
    if kind.mixer not in DSA_MIXERS or not L.fp8_spec.primary_weights_quantized:
        return ()
    from .layers import mixer_recipe
    rows, cols = mixer_recipe(kind).linear_shapes(L)["linear_kv_up_proj"]
    return (Gemm("linear_kv_up_proj", rows, cols),)


def dsa_k_up_weight(spec: Fp8Spec, L: Any, act_bytes: int) -> int:
    """``dsa_k_up_weight``: under primary quantized weights AbsorbedMLA's einsum folding K's up projection into the
    query reads a quantized weight (_get_kv_up_weights: a view and a slice of linear_kv_up_proj's); TE's
    QuantizedTensor.__torch_dispatch__ (TE 2.20.2 quantized_tensor.py) dequantizes it for the ops it does not handle,
    and the einsum's bmm keeps that BF16 copy for the query's gradient, per micro-batch. Float8Tensor (delayed,
    tensorwise) slices its FP8 data (float8_tensor.py), so the copy is K's [heads/TP, qk, kv_lora]; MXFP8 and blockwise
    tensors only pass whole slices, so the slice itself dequantizes the whole per-head weight [heads/TP, qk + v,
    kv_lora], which the kept slice holds. (V's up weight: DSAttention's contiguous copy is dequantized in turn, the same
    BF16 bytes as with BF16 weights, ``dsa_v_up_weight``.)"""
    if not spec.primary_weights_quantized:
        return 0
    from .layers.base import shapes
    width = L.qk_head_dim + (L.v_head_dim if spec.recipe in ("mxfp8", "blockwise") else 0)
    return shapes(L).a_t * width * L.kv_lora_rank * act_bytes


def dsa_saved_overrides(spec: Fp8Spec, L: Any, gemms: tuple[Gemm, ...], saved: Mapping[str, int], *,
                        act_bytes: int, non_tn: bool = False) -> dict[str, int]:
    """A DSA layer's saved tensors that differ from ``saved_overrides``' MLA reading (estimator/layers/dsa.py names):

    * ``latent_norms`` stays BF16: the latent norms are TENorms of their own (DSA's spec does not fuse them into the
      up projections), keeping their BF16 inputs; q_up_proj keeps a quantized copy of the q norm's output
      (``q_latent``, quantized whatever --qk-layernorm says).
    * ``indexer_inputs`` (the indexer loss trains the indexer, core_attn not recomputed): linear_wq_b keeps a
      quantized copy of qr, linear_wk and linear_weights_proj one of x each (TE quantizes each module's BF16 input),
      on all Tf tokens (DSAIndexer gathers them under sequence parallelism); with or without SP.
    * ``dsa_core_inputs`` (core_attn recomputed): tensor_parallel.checkpoint keeps DSAttention's inputs x (the input
      norm's output, unless 'layernorm' recompute discards it) and qr (q_compressed) in BF16, which the quantizing
      projections no longer keep (qr is x without --q-lora-rank).
    * ``dsa_k_up_weight`` (primary quantized weights): the dequantized K up-projection weight the absorption's einsum
      keeps (``dsa_k_up_weight``)."""
    from .layers.base import selective_modules, shapes
    g = {x.name: x for x in gemms}

    def q(name: str) -> int:
        x = g[name]
        return x.count * saved_input(spec, x.tokens, x.cols, sp_gathered=x.sp_gathered, non_tn=non_tn).allocated

    out: dict[str, int] = {}
    if "latent_norms" in saved:
        out["latent_norms"] = saved["latent_norms"]
    if "q_latent" in saved and "linear_q_up_proj" in g:
        out["q_latent"] = q("linear_q_up_proj")
    mods = selective_modules(L)
    if L.dsa_indexer_loss_coeff > 0 and "core_attn" not in mods and "indexer_linear_wk" in g:   # (own indexer)
        out["indexer_inputs"] = sum(q(n) for n in ("indexer_linear_wq_b", "indexer_linear_wk",
                                                   "indexer_linear_weights_proj"))
    if spec.primary_weights_quantized:
        out["dsa_k_up_weight"] = dsa_k_up_weight(spec, L, act_bytes)
    if "core_attn" in mods:
        x = shapes(L)
        ql = L.q_lora_rank
        out["dsa_core_inputs"] = (x.T * x.h * act_bytes if "qkv_input" in saved else 0) + (x.T * ql * act_bytes
                                                                                           if ql else 0)
    return out


def moe_saved_overrides(spec: Fp8Spec, L: Any, saved: Mapping[str, int], *, act_bytes: int,
                        non_tn: bool = False) -> dict[str, int]:
    """An FP8 / FP4 MoE layer's expert GEMM inputs (``estimator/layers/moe.py``'s names): the
    dispatched tokens fc1 keeps (``moe_expert_input``) and fc2's input inside
    ``moe_expert_activations`` are quantized per expert, padded to ``moe_align_size`` tokens
    (``TEGroupedLinear``, ``tex.split_quantize``); the shared expert's fc2 input is quantized, its fc1
    keeps the router's BF16 input (``set_save_original_input``) except under delayed scaling, where it
    keeps a quantized copy too (moe-fp8.md 1.9, 2.5). Latent MoE: the experts' inputs are latent-wide and both
    latent projections keep quantized inputs (``moe_latent_projections``)."""
    if "moe_expert_input" not in saved and "moe_shared_experts" not in saved:
        return {}
    if L.moe.moe_use_legacy_grouped_gemm:
        # the legacy GroupedMLP's gmm keeps its BF16 inputs (no TE module, no Fp8Padding): only the shared experts
        # and latent projections below are TE modules
        saved = {k: v for k, v in saved.items() if k not in ("moe_expert_input", "moe_expert_activations")}
    from .layers.base import selective_modules
    from .layers.moe import expert_rows, router_bytes, tokens_per_rank
    m = L.moe
    e, h = act_bytes, L.hidden_size
    hx = m.moe_latent_size or h     # latent MoE: the experts' input width
    T = tokens_per_rank(L)
    er = expert_rows(m, T)
    N = er.worst if m.routing == "worst" else er.balanced
    El, Fr = m.local_experts, m.moe_ffn_hidden_size // m.etp
    out: dict[str, int] = {}
    if "moe_expert_input" in saved:
        out["moe_expert_input"] = grouped_saved_input(spec, N, hx, El, non_tn=non_tn) + router_bytes(m, e) * N
    if m.moe_latent_size and "moe_latent_projections" in saved:
        # the latent projections are TELinear "duplicated" modules (MoELayer.__init__, core 0.16.1 and 0.19.2) on the
        # local token shard [T, .], inside the layer's FP8 / FP4 autocast, and nothing makes them save their original
        # input (set_for_recompute_pre_mlp_layernorm reaches only the shared experts' fc1): fc2_latent_proj keeps a
        # quantized copy of the combined tokens [T, latent] instead of the BF16 tensor, and fc1_latent_proj one of
        # the pre-MLP norm's output [T, h] beside the BF16 one the router keeps (with 'layernorm' recompute too)
        out["moe_latent_projections"] = (saved_input(spec, T, hx, non_tn=non_tn).allocated
                                         + saved_input(spec, T, h, non_tn=non_tn).allocated)
    if L.use_transformer_engine_op_fuser:
        out.update(fused_experts_overrides(spec, L, saved, N=N, non_tn=non_tn))
        N = 0       # the routed experts are done; the shared experts below are TE modules as without the fuser
    mods = set(selective_modules(L))
    if N and "moe_expert_activations" in saved and "moe_act" not in mods | set(m.moe_recompute):
        out["moe_expert_activations"] = (saved["moe_expert_activations"] - e * N * Fr
                                         + grouped_saved_input(spec, N, Fr, El, non_tn=non_tn))
    Fs = m.moe_shared_expert_intermediate_size
    if Fs and "moe_shared_experts" in saved:
        Tf = T * L.tp if L.sequence_parallel else T
        fs = Fs // L.tp
        b = saved["moe_shared_experts"] - e * Tf * fs + saved_input(spec, Tf, fs, non_tn=non_tn).allocated
        if m.use_grouped_gemm_for_shared_expert:
            # FusedSharedExpertMLP (core 0.19.2) all-gathers the input itself (gather_from_sequence_parallel_region)
            # and runs TE's GroupedLinear -> ScaledSwiGLU -> GroupedLinear ops (TE 2.14 ops/basic/grouped_linear.py,
            # swiglu.py; on Blackwell with NVTE_CUTEDSL_FUSED_GROUPED_MLP the fused ops/fused/forward_grouped_mlp.py):
            # fc1 keeps its quantized column-wise input [Tf, h], the SwiGLU its BF16 input, fc2 its quantized
            # column-wise input; and each GroupedLinear quantizes its BF16 weight every forward and keeps that copy
            # (column-wise; the fused kernel both usages) instead of TE's cached workspace (shared_expert_gemms)
            b += saved_input(spec, Tf, h, non_tn=non_tn).allocated
            if not spec.primary_weights_quantized:
                from .fp8 import quantized_tensor
                both = spec.recipe == "mxfp8" and cutedsl_fused_grouped_mlp(getattr(L, "env_dict", None))
                b += sum(quantized_tensor(spec.recipe, rows, cols, rowwise=both, columnwise=True,
                                          non_tn=non_tn).allocated for rows, cols in ((2 * fs, h), (h, fs)))
        elif spec.recipe == "delayed":
            b += saved_input(spec, T, h, sp_gathered=L.sequence_parallel and L.tp > 1, non_tn=non_tn).allocated
        out["moe_shared_experts"] = b
    return out


# TEGroupedMLP.__init__ (megatron-core 0.19.2 transformer/moe/experts.py): under the fused impl, FP8 / FP4 pad each
# expert's tokens to 256 (Fp8Padding(align_size=256)), the router's padding being 256 too (router_padding_align)
FUSED_EXPERTS_ALIGN = 256


def fused_experts_overrides(spec: Fp8Spec, L: Any, saved: Mapping[str, int], *, N: int,
                            non_tn: bool = False) -> dict[str, int]:
    """The routed experts' saved tensors under TE's operation fuser in FP8 / FP4 (TEGroupedMLP._fused_forward,
    megatron-core 0.19.2; TE 2.20.2): GroupedLinear -> ScaledSwiGLU / ScaledClampedQGeGLU -> GroupedLinear on the
    ``N`` routed rows, each expert's padded to 256 (``FUSED_EXPERTS_ALIGN``).

    * MXFP8 (E4M3 gradients) and NVFP4 (``NVFP4BlockScaling()``, Hadamard transform on) run the CuTe-DSL fused
      kernel (``ops/fused/grouped_mlp.py`` ``fuse_grouped_mlp_ops``; NVTE_CUTEDSL_FUSED_GROUPED_MLP=1 is required
      anyway, resolve/moe.py): it saves fc1's grouped quantized input, the BF16 GLU input ``c_tensor`` [Np, 2F],
      the probs, fc2's grouped quantized input, and the weight copies it quantized (both usages). MXFP8 drops the
      inputs' row-wise data and scales ("MXFP8 wgrad only needs columnwise tiles"); NVFP4 keeps the whole grouped
      tensors ("NVFP4 generic GEMM fallbacks need the full grouped tensor state").
    * delayed scaling: no fused kernel and no grouped-tensor path (``is_op_fuser_grouped_tensor_path_supported``):
      ``_fuser_forward_split_quantize`` keeps each expert's quantized input and weight copy column-wise only
      (``update_usage(rowwise_usage=False, columnwise_usage=True)``); ScaledSwiGLU keeps its BF16 input.
    * tensorwise, blockwise, and MXFP8 with E5M2 gradients (no fused kernel): the GroupedLinear ops take the
      grouped-tensor path where the GPU and cuBLASLt allow it (``is_op_fuser_grouped_tensor_path_supported``:
      tensorwise on Blackwell with cuBLASLt >= 13.3 or Hopper with >= 13.5, blockwise on Hopper with >= 13.6, MXFP8
      on Blackwell with >= 13.3), else the split-quantize path. memguard sees no cuBLASLt version: the grouped-tensor
      path is sized, the one that keeps more (``_fuser_forward_grouped_tensor`` saves the weight copies with both
      usages, no ``update_usage``; the inputs column-wise, ``grouped_x.rowwise_data = None``); the split-quantize
      path keeps ``fused_experts_rowwise_weight_bytes`` less (resolve/moe.py says so in a note).

    Names: ``moe_expert_input`` (fc1's quantized input and the padded probs), ``moe_expert_activations`` (the GLU
    input and fc2's quantized input), ``fp8_op_fuser_weights`` (the weight copies of one micro-batch; none with
    primary quantized weights, used as they are: ``is_quantized_tensor(weight)``)."""
    from .fp8 import quantized_tensor
    from .layers.moe import router_bytes
    m = L.moe
    r = spec.recipe
    e = L.act_bytes
    hx = m.moe_latent_size or L.hidden_size
    El, Fr = m.local_experts, m.moe_ffn_hidden_size // m.etp
    g = 2 if L.gated_linear_unit else 1
    if El <= 0 or N <= 0:
        return {}
    per = -(-N // El)
    per = -(-per // FUSED_EXPERTS_ALIGN) * FUSED_EXPERTS_ALIGN
    Np = El * per
    both = r == "nvfp4"       # NVFP4 keeps the grouped inputs whole; MXFP8 and delayed column-wise only

    def x(width: int) -> int:
        return El * quantized_tensor(r, per, width, rowwise=both, columnwise=True, non_tn=non_tn).allocated

    out: dict[str, int] = {}
    if "moe_expert_input" in saved:
        out["moe_expert_input"] = x(hx) + router_bytes(m, e) * Np
    if "moe_expert_activations" in saved:
        # the BF16 part without the fuser's padding: g F_r (the GLU input) + F_r (fc2's input) per row
        out["moe_expert_activations"] = (saved["moe_expert_activations"] - e * N * (g + 1) * Fr
                                         + e * Np * g * Fr + x(Fr))
    # the split-quantize path: delayed scaling always; the other recipes where estimate()'s GPU rules the
    # grouped-tensor path out (fused_experts_gpu_path)
    gpu = getattr(L, "fp8_gpu", None)
    split = r == "delayed" or (gpu is not None and fused_experts_gpu_path(L, gpu) is not None)
    w = sum(op_fuser_weight(spec, Gemm(n, rows, cols, count=El, op_fused=True), non_tn=non_tn,
                            both_usages=not split)
            for n, (rows, cols) in (("experts.linear_fc1", (g * Fr, hx)), ("experts.linear_fc2", (hx, Fr))))
    if w and "moe_expert_input" in saved:
        out["fp8_op_fuser_weights"] = w
    return out


def fused_experts_gpu_path(L: Any, gpu_name: str) -> str | None:
    """Where the GPU alone sends the experts' GroupedLinear ops (the op fuser, no CuTe-DSL fused kernel) to TE
    2.20.2's split-quantize path: a note saying so, or None where the grouped-tensor path stays sized (the GPU
    allows it and only the cuBLASLt version, unseen, decides). ``ops/basic/grouped_linear.py``
    ``is_op_fuser_grouped_tensor_path_supported`` (TE 2.20.2, lines 106-125): ``float8_block_scaling`` returns
    ``device_capability < (10, 0) and cublaslt_version >= 130600``, so blockwise on Blackwell (SM 10.x) always
    takes the split-quantize path. Tensorwise (SM 9.0 with cuBLASLt >= 13.5, SM 10.x / 11.0 with >= 13.3) and MXFP8
    with E5M2 gradients (SM 10.x with >= 13.3) depend on the cuBLASLt version on every GPU that can run them; FP8
    below SM 8.9 is refused (``fp8.gpu_violation``). Pure: the caller passes the GPU's name as data."""
    from .fp8 import non_tn_gpu
    moe = getattr(L, "moe", None)
    if (moe is None or moe.moe_use_legacy_grouped_gemm or moe.local_experts <= 0
            or not getattr(L, "use_transformer_engine_op_fuser", False)):
        return None
    spec = L.fp8_spec
    if spec.fp4 or spec.recipe != "blockwise" or not non_tn_gpu(gpu_name):
        return None
    return (f"{gpu_name}: the experts' GroupedLinear ops under the blockwise recipe take Transformer Engine 2.20.2's "
            "split-quantize path on Blackwell (the grouped-tensor path needs Hopper with cuBLASLt >= 13.6): each "
            "expert's weight copy is kept column-wise only; --moe-single-grouped-weight would stop at the first "
            "forward (RuntimeError)")


def fused_experts_rowwise_weight_bytes(recipe: str, *, local_experts: int, ffn: int, width: int, glu: bool,
                                      non_tn: bool = False) -> int:
    """What the grouped-tensor GroupedLinear path keeps more than the split-quantize path per MoE layer and
    micro-batch (TE 2.20.2 ``ops/basic/grouped_linear.py``): the row-wise data (and scales) of each local expert's fc1
    [g F, width] and fc2 [width, F] weight copies, which ``_fuser_forward_split_quantize`` drops
    (``update_usage(rowwise_usage=False)``); 0 where one copy serves both usages (Float8 on Blackwell)."""
    from .fp8 import quantized_tensor
    g = 2 if glu else 1
    block_2d = recipe == "blockwise"
    return local_experts * sum(
        quantized_tensor(recipe, rows, cols, rowwise=True, columnwise=True, non_tn=non_tn, block_2d=block_2d).allocated
        - quantized_tensor(recipe, rows, cols, rowwise=False, columnwise=True, non_tn=non_tn,
                           block_2d=block_2d).allocated
        for rows, cols in ((g * ffn, width), (width, ffn)))


def cutedsl_fused_grouped_mlp(env: Mapping[str, Any] | None) -> bool:
    """TE's fused grouped MLP kernel (ForwardGroupedMLP_CuTeGEMMSwiGLU_MXFP8.is_supported, TE 2.14): asked for by
    NVTE_CUTEDSL_FUSED_GROUPED_MLP > 0 in the run's environment (it also needs an SM 10 GPU, which MXFP8 training
    has); a value that is no integer asks for nothing."""
    try:
        return int(str((env or {}).get("NVTE_CUTEDSL_FUSED_GROUPED_MLP", "0")).strip() or 0) > 0
    except ValueError:
        return False


def module_gemms(L: Any, gemms: tuple[Gemm, ...]) -> tuple[Gemm, ...]:
    """The GEMMs TE modules run (their cached weight workspaces, or per-forward copies without the cache):
    FusedSharedExpertMLP never runs its linear_fc1 / linear_fc2 modules (their weights go through TE's
    GroupedLinear ops, which keep a copy per forward instead: moe_saved_overrides)."""
    moe = getattr(L, "moe", None)
    if moe is None or not moe.use_grouped_gemm_for_shared_expert:
        return gemms
    return tuple(g for g in gemms if not g.name.startswith("shared_experts."))


def output_proj_gemm(L: Any) -> Gemm | None:
    """``--fp8-output-proj`` (core 0.19.2): the LM head is ``TELMHeadColumnParallelLinear``, a TE linear
    run under MXFP8 (``gpt_model.py``, ``fp8_utils.is_mxfp8_output_proj_active``): weight [V/TP, h], input
    the final norm's output, all-gathered over TP inside the module with sequence parallelism. None
    otherwise (the BF16 ``ColumnParallelLinear``)."""
    spec = L.fp8_spec
    if not (spec.fp8_output_proj and spec.recipe == "mxfp8"):
        return None
    from .layers.base import shapes
    x = shapes(L)
    return Gemm("output_layer", L.padded_vocab_size // L.tp, L.hidden_size, x.T, L.sequence_parallel and L.tp > 1)


def mtp_gemms(L: Any) -> tuple[Gemm, ...]:
    """The TE GEMMs of one MTP depth when it runs in FP8 (empty otherwise): its transformer layer's and
    ``eh_proj``, a column-parallel [h/TP, 2h] linear on the concatenated [rows, 2h] input (gathered over TP
    with sequence parallelism). The whole depth is built under ``get_fp8_context(config, is_init=True)``, so
    with ``--fp8-param-gather`` eh_proj's weight is a primary FP8 weight too (multi_token_prediction.py)."""
    from .params import mtp_layer_kind
    kind = mtp_layer_kind(L)
    if not kind.quantized:
        return ()
    from .layers.base import shapes
    x = shapes(L)
    h, t = L.hidden_size, L.tp
    return (layer_gemms(L, kind) + dsa_primary_weights(L, kind)
            + (Gemm("eh_proj", h // t, 2 * h, x.T, L.sequence_parallel and t > 1),))


def _cached_elements(gemms: tuple[Gemm, ...]) -> int:
    """Weight elements of the GEMMs whose TE module caches a workspace (not the op fuser's)."""
    return sum(x.count * x.rows * x.cols for x in gemms if not x.op_fused)


def stage_terms(L: Any, chunks: Any, gpu_name: str | None) -> tuple[int, list[Any]]:
    """FP8 / FP4 persistent terms of one pipeline rank's chunks, and the bytes the DDP parameter
    buffer holds less because primary quantized weights take ``param_buffer_bytes_per_element`` (1,
    1/2 or 0 bytes) instead of the parameter dtype's (distributed optimizer; Megatron-FSDP sizes its
    own buffers).

    Terms: ``fp8_weight_cache`` (BF16 weights), ``fp8_weight_columnwise`` (primary weights),
    ``fp8_scales`` (recipe state); Hopper or Blackwell storage from ``gpu_name`` (None: Hopper)."""
    from .result import Term, TermGroup
    spec = L.fp8_spec
    if not spec.enabled:
        return 0, []
    non_tn = non_tn_gpu(gpu_name or "")
    # Megatron-FSDP sizes its own (uint8) buffers for primary FP8 weights and drops TE's transposes after
    # each use: only the scales stay outside its buffers; with --keep-fp8-transpose-cache each weight's
    # whole transpose (delayed, tensorwise) or column-wise data with its scales (blockwise) stays too
    # (megatron_fsdp.py release_module_parameters, mixed_precision.py fp8_discard_transpose_cache), as
    # outside FSDP; MXFP8's column-wise data are Megatron-FSDP's transpose buffers: the flag leaves them
    megatron_fsdp = bool(getattr(L, "use_megatron_fsdp", False))
    keep = megatron_fsdp and bool(getattr(L, "keep_fp8_transpose_cache", False)) and spec.recipe != "mxfp8"
    fsdp = megatron_fsdp and not keep
    dist = L.use_distributed_optimizer and not megatron_fsdp
    cache = colw = scales = layers = elements = cached = 0
    for c in chunks:
        for kind, n in c.kind_runs:
            if not kind.quantized:
                continue
            g = layer_gemms(L, kind)
            if not g:
                continue          # a heterogeneous layer of two no-op halves: no TE module
            layers += n
            cache += n * weight_cache_bytes(spec, module_gemms(L, g), non_tn=non_tn)
            cached += n * _cached_elements(module_gemms(L, g))
            g = g + dsa_primary_weights(L, kind)
            colw += n * (primary_weight_scale_bytes(spec, g, non_tn=non_tn) if fsdp else
                         primary_weight_extra_bytes(spec, g, non_tn=non_tn, distributed_optimizer=dist or keep))
            scales += n * layer_recipe_state_bytes(spec, g)
            elements += n * sum(x.count * x.rows * x.cols for x in g)
    from .mtp import layers_built
    mtp = layers_built(L)          # per-module weight caches: one module with --mtp-use-repeated-layer
    from .params import holds_mtp
    if mtp and any(holds_mtp(L, c) for c in chunks):
        # the MTP depths on their chunk, in FP8 with --fp8-format (mtp_layer_kind)
        g = mtp_gemms(L)
        if g:
            layers += mtp
            cache += mtp * weight_cache_bytes(spec, g, non_tn=non_tn)
            cached += mtp * _cached_elements(g)
            colw += mtp * (primary_weight_scale_bytes(spec, g, non_tn=non_tn) if fsdp else
                           primary_weight_extra_bytes(spec, g, non_tn=non_tn, distributed_optimizer=dist))
            scales += mtp * layer_recipe_state_bytes(spec, g)
            elements += mtp * sum(x.count * x.rows * x.cols for x in g)
    head = output_proj_gemm(L) if any(c.has_output for c in chunks) else None
    if head is not None:
        # the LM head's BF16 weight (built outside fp8_model_init, so never a primary FP8 weight) gets TE's
        # cached MXFP8 copy like any TE linear; MXFP8 quantizers keep no recipe state
        bf16_weights = replace(spec, fp8_param_gather=False, fp4_param_gather=False)
        cache += weight_cache_bytes(bf16_weights, (head,), non_tn=non_tn)
    saving = 0
    if spec.primary_weights_quantized and dist:
        saving = int(elements * (L.param_bytes - param_buffer_bytes_per_element(spec)))
    r = spec.recipe
    if r in ("delayed", "tensorwise"):
        arch = (f"{gpu_name}: one FP8 copy serves both layouts" if non_tn else
                f"{gpu_name or 'Hopper assumed'}: FP8 data + transpose")
    else:
        arch = f"{r}: separate row-wise and column-wise data with their scales"
    terms = []
    if cache:
        lm = f" and the output layer's [{head.rows}, {head.cols}] (--fp8-output-proj)" if head is not None else ""
        terms.append(Term("fp8_weight_cache", cache, TermGroup.WEIGHTS,
                          detail=f"{r} copies of {cached:,} GEMM weight elements of {layers} FP8 layers{lm}, row-wise + "
                                 f"column-wise ({arch}); kept across micro-batches (TE _fp8_workspaces)"))
    if colw:
        where = ("scale tensors outside Megatron-FSDP's buffers (its transposes are dropped after each use)" if fsdp
                 else f"transposes Megatron-FSDP keeps (--keep-fp8-transpose-cache) and scales ({arch})" if keep
                 else f"TE storage outside the parameter buffer ({arch})")
        terms.append(Term("fp8_weight_columnwise", colw, TermGroup.WEIGHTS,
                          detail=f"{r} primary weights of {layers} layers: {where}"))
    if scales:
        terms.append(Term("fp8_scales", scales, TermGroup.WEIGHTS,
                          detail=f"{r} recipe state of {layers} FP8 layers"
                                 + (f" (amax history {spec.fp8_amax_history_len})" if r == "delayed" else "")))
    return saving, terms
