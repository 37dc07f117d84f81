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

A layer is composed from the recipes of its kind (``estimator.layers``): the token mixer (input
norm to linear_proj's input), the pre-MLP norm and residual stream kept here, and the MLP.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from itertools import repeat

from ..layout import Layout
from ..layout.layout import _derived
from ..partition import DSA_MIXERS, MIXER_ATTENTION, MIXER_NONE, MLP_DENSE, MLP_MOE, MLP_NONE, LayerKind, uniform_kind
from .layers import kind_layout, mixer_recipe, mlp_recipe
from .layers.attention import _cp_attention_items, _te_keeps_every_cp_step, attention_items, attention_kind  # noqa: F401
from .layers.base import Shapes, Step, shapes  # noqa: F401
from .layers.base import norm_stats as _norm_stats
from .layers.base import selective_modules
from .layers.base import wgrad as _wgrad  # noqa: F401
from .layers.mla import mla_attention_items  # noqa: F401
from .te_release import attention_recipe


@dataclass(frozen=True)
class LayerActivations:
    saved: dict[str, int] = field(default_factory=dict)   # kept until this layer's backward
    fwd_steps: tuple[Step, ...] = ()
    bwd_steps: tuple[Step, ...] = ()

    def __init__(self, saved: dict[str, int] | None = None, fwd_steps: tuple[Step, ...] = (),
                 bwd_steps: tuple[Step, ...] = ()) -> None:
        # one per layer kind of every cold estimate: the fields are stored directly (as Term's)
        d = self.__dict__
        d["saved"] = {} if saved is None else saved
        d["fwd_steps"] = fwd_steps
        d["bwd_steps"] = bwd_steps

    # (_derived: functools.cached_property without its lock; every cold estimate makes these objects anew)
    @_derived
    def total(self) -> int:
        return sum(self.saved.values())

    @_derived
    def moe_total(self) -> int:
        """The MoE half of the saved bytes (its ``moe_*`` items)."""
        return sum(v for k, v in self.saved.items() if k.startswith("moe_"))

    def _peak(self, steps: tuple[Step, ...]) -> int:
        get = self.saved.get
        return max([w - sum(map(get, names, repeat(0))) for names, w in steps], default=0)

    @_derived
    def fwd_transient(self) -> int:
        """Largest extra over the layer's saved bytes during its forward (with later items not yet made)."""
        return self._peak(self.fwd_steps)

    @_derived
    def bwd_transient(self) -> int:
        """Largest extra over the layer's saved bytes during its backward (with released items gone)."""
        return self._peak(self.bwd_steps)


@lru_cache(maxsize=512)
def layer_activations(L: Layout, has_batch_mask: bool = True, kind: LayerKind | None = None) -> LayerActivations:
    """One layer of ``kind`` (default: the model's uniform kind), one micro-batch, no full recompute
    (applied per block by the caller)."""
    if kind is None:
        # one entry per kind: the default kind's is the one a chunk of that kind asks for
        return layer_activations(L, has_batch_mask, uniform_kind(L))
    if not has_batch_mask and not mixer_recipe(kind).reads_batch_mask(L):
        # the mixer makes the same tensors whether the batch carries a mask or not: one entry serves both
        return layer_activations(L, True, kind)
    L = kind_layout(L, kind)   # a heterogeneous layer's own ffn size
    x = shapes(L)
    mods = set(selective_modules(L))
    te = L.transformer_impl == "transformer_engine"
    T, Tf, h, e, r = x.T, x.Tf, x.h, x.e, x.r
    drop_norm = "layernorm" in mods and not te
    # the MoE layer's pre-MLP norm is a module of its own in the TE spec too: 'layernorm' recompute discards its output
    drop_norm2 = drop_norm or ("layernorm" in mods and kind.mlp == MLP_MOE and _moe_pre_mlp_norm_recomputed(L))
    G = T * h * e   # gradient of the layer output (received or from the layer above)

    mlp = mlp_recipe(kind).activations(L, mods, G)
    # names made after the mixer's forward, and released before its backward
    after = frozenset({"mlp_norm_input", "norm2_stats", "fc1_input", "dropout_masks"}) | mlp.names
    rel_fc1 = mlp.released | {"fc1_input"}
    rel_norm2 = rel_fc1 | {"mlp_norm_input", "norm2_stats", "dropout_masks"}
    mixer = mixer_recipe(kind).activations(L, mods, has_batch_mask, drop_norm, after, rel_norm2, G)
    fp8_done = False
    if kind.quantized and L.fp8_spec.fp8_dot_product_attention and attention_recipe(
            kind.quantized, L.env_dict, L.megatron_version) in ("delayed", "tensorwise", "mxfp8"):
        from ..partition import MIXER_ATTENTION, MIXER_MLA
        if kind.mixer in (MIXER_ATTENTION, MIXER_MLA) and attention_kind(L) == "fused":
            # the core attention in FP8 (TE FusedAttention, MXFP8 under TE 2.20.2, or its CP functions: the p2p ring,
            # a2a, a2a+p2p, all_gather; resolve/fp8.py refuses MLA under CP)
            from .layers.fp8_attention import fp8_attention
            mixer = fp8_attention(L, mixer, mla=kind.mixer == MIXER_MLA)
            fp8_done = True
    if L.cp > 1 and L.cp_a2a_size > 1 and not fp8_done:
        from ..partition import MIXER_ATTENTION
        if kind.mixer == MIXER_ATTENTION and attention_kind(L) == "fused":
            # BF16 attention under an all-to-all CP (a2a, a2a+p2p over two levels): TE's functions keep other tensors
            # than the p2p ring the attention recipe sizes (MLA under CP keeps its CP-less model)
            from .layers.cp_attention import cp_a2a_attention
            mixer = cp_a2a_attention(L, mixer)

    # a heterogeneous layer's no-op half (heterogeneous_layer_specs.py, 0.19.2): its norm, block and
    # bias-dropout-add are identities, so it keeps nothing (layers/noop.py) and neither does the layer for it
    no_mixer, no_mlp = kind.mixer == MIXER_NONE, kind.mlp == MLP_NONE
    if no_mixer and no_mlp:
        return LayerActivations()                               # the layer returns its input
    saved: dict[str, int] = {} if no_mixer else {"layer_input": T * h * r}   # residual stream, kept by the input norm
    saved.update(mixer.saved)
    if L.hidden_dropout > 0:
        # bool masks after attention and after the MLP
        saved["dropout_masks"] = (2 - no_mixer - no_mlp) * T * h
    if not no_mlp:
        saved["mlp_norm_input"] = T * h * r                     # (the layer input itself after a no-op attention)
        saved["norm2_stats"] = _norm_stats(L, T)
        if not drop_norm2:
            saved["fc1_input"] = T * h * e
    saved.update(mlp.saved)
    # Forward steps: (saved names not created yet, working bytes)
    fwd_steps = mixer.fwd_steps + mlp.fwd_steps + ((frozenset(), T * h * r),)  # the layer's output (next layer's input)
    # Backward steps: (saved names released, working bytes): the MLP, the pre-MLP norm, the mixer
    mlp_bwd, mixer_bwd = mlp.bwd_steps, mixer.bwd_steps
    if getattr(L, "peft", None) is not None:
        from .peft import backward_steps
        mlp_bwd, mixer_bwd = backward_steps(L, mlp_bwd, mixer_bwd, kind)
    if kind.quantized:
        mlp_bwd, mixer_bwd = _quantized_grad_outputs(L, kind, mlp_bwd, mixer_bwd)
        mixer_bwd = _requantized_proj_input(L, kind, mixer_bwd)
        mixer_bwd = _requantized_down_proj_input(L, kind, mods, mixer_bwd)
    if _has_post_proj_norms(L, kind):
        post = post_proj_norm_items(L, mods)
        saved.update(post)
        fwd_steps, mlp_bwd, mixer_bwd = _post_proj_norm_steps(L, kind, mods, post, fwd_steps, mlp_bwd, mixer_bwd,
                                                              after, G)
    norm2_step = () if no_mlp else (
        (rel_fc1, G + Tf * h * e + T * h * e + (T * h * e if drop_norm2 else 0)),                 # pre-MLP norm
    )
    bwd_steps = mlp_bwd + norm2_step + mixer_bwd
    if L.moe is not None and L.moe.delay_wgrad_compute:
        bwd_steps += ((frozenset(saved), G + _delayed_wgrad_bytes(L, kind, T, Tf, e)),)
    if getattr(L, "peft", None) is not None:
        # LoRA / DoRA: frozen linears keep no input for a weight gradient, the adapters keep theirs (estimator/peft.py)
        from .peft import layer_items, tie_steps
        saved, dora_fwd = layer_items(L, saved, mods, kind)
        fwd_steps = tie_steps(fwd_steps, saved) + (((frozenset(), dora_fwd),) if dora_fwd else ())
        bwd_steps = tie_steps(bwd_steps, saved)
    if kind.quantized:
        saved, fwd_steps, bwd_steps = _quantized(L, kind, saved, fwd_steps, bwd_steps)
    return LayerActivations(saved=saved, fwd_steps=fwd_steps, bwd_steps=bwd_steps)


def _has_post_proj_norms(L: Layout, kind: LayerKind) -> bool:
    """Gemma 3's layer spec: a standard attention and dense MLP layer with TERowParallelLinearLayerNorm."""
    return getattr(L, "post_proj_norms", False) and kind.mixer == MIXER_ATTENTION and kind.mlp == MLP_DENSE


POST_ATTN_NORM = frozenset({"post_attn_norm_input", "post_attn_norm_stats"})
POST_MLP_NORM = frozenset({"post_mlp_norm_input", "post_mlp_norm_stats"})


def post_proj_norm_items(L: Layout, mods: set | frozenset = frozenset()) -> dict[str, int]:
    """What Gemma 3's two post-projection norms keep per micro-batch (Megatron-Bridge 0.6.2
    TERowParallelLinearLayerNorm: a TENorm on linear_proj's and linear_fc2's outputs). Each norm runs on the
    row-parallel linear's output, reduce-scattered to [s/TP, b, h] under sequence parallelism and all-reduced to
    [s, b, h] without (TE's Linear, TE 2.11 / 2.20.2 module/linear.py): T tokens either way. TE's RMSNorm /
    LayerNorm op saves its input and the fp32 rstd (and mean) per token (TE 2.11 / 2.20.2
    ``ops/basic/rmsnorm.py`` op_forward: ``ctx.save_for_backward(x, rstdevs)``; ``layer_norm.py``: ``x, means,
    rstdevs``); the input is the linear's BF16 output, and the standalone op has no next op to quantize for
    (``next_op_input_quantizer`` None): its output feeds the residual add in BF16 under FP8 too. 'mlp' recompute
    checkpoints the whole MLP, linear_fc2 and its norm with it."""
    x = shapes(L)
    items = {"post_attn_norm_input": x.T * x.h * x.e, "post_attn_norm_stats": _norm_stats(L, x.T)}
    if "mlp" not in mods:
        items.update(post_mlp_norm_input=x.T * x.h * x.e, post_mlp_norm_stats=_norm_stats(L, x.T))
    return items


def _post_proj_norm_steps(L: Layout, kind: LayerKind, mods: set, post: dict[str, int], fwd_steps: tuple,
                          mlp_bwd: tuple, mixer_bwd: tuple, after: frozenset, G: int) -> tuple[tuple, tuple, tuple]:
    """The steps of the two post-projection norms. Forward: each norm's [T, h] output beside its saved input
    (the post-attention one before any MLP tensor exists). Backward: each norm's input gradient [T, h] beside the
    layer's output gradient G (the residual's, still alive) -- the first step of the MLP's backward and of the
    mixer's; that gradient then stays until linear_fc2's / linear_proj's backward (their first step) consumes it.
    With 'mlp' recompute the checkpoint's re-forward has remade the MLP's tensors and the norm's saved ones when
    the norm's backward runs."""
    x = shapes(L)
    out = x.T * x.h * x.e
    fwd_steps = ((after | POST_MLP_NORM, out), (frozenset(), out)) + fwd_steps
    remade = 0
    if "mlp" in mods:
        full = mlp_recipe(kind).activations(L, set(mods) - {"mlp"}, G).saved
        remade = sum(full.values()) + sum(post_proj_norm_items(L).values()) - sum(post.values())
    first_mlp = ((frozenset(), G + out + remade),)
    mlp_bwd = first_mlp + tuple((n | POST_MLP_NORM, w + (out if i == 0 else 0)) for i, (n, w) in enumerate(mlp_bwd))
    if mixer_bwd:
        rel = mixer_bwd[0][0] | POST_MLP_NORM
        mixer_bwd = ((rel, G + out),) + tuple((n | POST_MLP_NORM | POST_ATTN_NORM, w + (out if i == 0 else 0))
                                               for i, (n, w) in enumerate(mixer_bwd))
    return fwd_steps, mlp_bwd, mixer_bwd


def _moe_pre_mlp_norm_recomputed(L: Layout) -> bool:
    """Whether 'layernorm' recompute reaches an MoE layer's pre-MLP norm (a TENorm / its own module in every spec):
    TransformerLayer.__init__ (core 0.16.1 and 0.19.2) runs it in CheckpointWithoutOutput, whose output is discarded
    after the MLP's forward and remade in its backward (the router, the shared experts' fc1 -- under FP8 / FP4 made
    to save that BF16 output, ``set_for_recompute_pre_mlp_layernorm`` -- and a checkpoint keep it only as storage
    that is freed), unless TE CUDA graphs capture the router (``can_recompute_pre_mlp_layernorm_for_cudagraph``):
    then only with the preprocess captured too, the alltoall dispatcher or latent MoE, and no shared-expert overlap."""
    modules = set(L.cuda_graph_modules)
    if "moe_router" not in modules or L.cuda_graph_impl == "local":
        return True
    m = L.moe
    if m.moe_shared_expert_intermediate_size and m.moe_shared_expert_overlap:
        return False
    return "moe_preprocess" in modules and (m.moe_token_dispatcher_type == "alltoall" or bool(m.moe_latent_size))


def _delayed_wgrad_bytes(L: Layout, kind: LayerKind, T: int, Tf: int, e: int) -> int:
    """--delay-wgrad-compute: at the end of a layer's backward, TE's wgrad store still holds the input and
    the output gradient of each linear outside the routed experts (attention, shared experts, a dense
    MLP) until the schedule's backward_dw of that layer (TransformerLayerSchedulePlan.run, core 0.19.2).
    Each taken as [Tf, in] + [Tf, out] of its per-rank weight: the sequence-parallel input is gathered
    for the weight gradient, the row-parallel output gradient too (an upper bound where it is not). Latent MoE
    (core 0.17.1 to 0.19.2): fc1_latent_proj's wgrad runs with the shared experts' (_BackwardDWWrapper, the
    pre-dispatch node's backward_dw at the layer's end), [T, h] in + [T, latent] out ("duplicated": the
    sequence-parallel tokens, not gathered); fc2_latent_proj's ran earlier with the experts' (layers/moe.py)."""
    shapes = {**mixer_recipe(kind).linear_shapes(L), **mlp_recipe(kind).linear_shapes(L)}
    return sum(e * (T if name == "fc1_latent_proj" else Tf) * (o + i) for name, (o, i) in shapes.items()
               if not name.startswith("experts.") and name != "fc2_latent_proj")
def _quantized_grad_outputs(L: Layout, kind: LayerKind, mlp_bwd: tuple, mixer_bwd: tuple) -> tuple[tuple, tuple]:
    """An FP8 / FP4 layer's backward: each quantized GEMM quantizes its output gradient (row-wise for dgrad,
    column-wise for wgrad) into a new tensor next to the BF16 one autograd handed it
    (``TransformerEngineBaseModule.grad_output_preprocess``, TE 2.11 module/base.py; row-parallel GEMMs under
    sequence parallelism quantize, then all-gather the quantized tensor). Added at the step of each GEMM:
    [s b, h] for linear_fc2 and linear_proj, [s b, out/TP] for linear_fc1 and linear_qkv (Hopper storage, as
    the saved inputs). The dense MLP, standard attention, Mamba and GDN recipes only: MLA and the MoE MLP keep their
    BF16 working sets (docs/assumptions.md)."""
    from ..partition import MIXER_ATTENTION, MLP_DENSE
    from ..partition import MIXER_GDN, MIXER_LINEAR, MIXER_MAMBA, MLP_LINEAR
    dense = kind.mlp.split(":", 1)[0] == MLP_DENSE and len(mlp_bwd) >= 2   # (a heterogeneous "dense:FFN" too)
    attention = kind.mixer == MIXER_ATTENTION and len(mixer_bwd) >= 3
    # a heterogeneous config's linear replacement (TELayerNormColumnParallelLinearGathered): one column-parallel GEMM
    # whose [s b, h/TP] output gradient is quantized in its backward step (the first of its role's steps)
    lin_mixer, lin_mlp = kind.mixer == MIXER_LINEAR and mixer_bwd, kind.mlp == MLP_LINEAR and mlp_bwd
    # a Mamba mixer (layers/mamba.py): out_proj's step first ([s b, h]), in_proj's the fourth ([s b, in_proj out/TP])
    mamba = kind.mixer == MIXER_MAMBA and len(mixer_bwd) >= 4
    # a GDN mixer (layers/gdn.py): out_proj's step first ([s b, h]), in_proj's the one after the conv's backward
    # ([s b, in_proj out/TP]); the conv1d, the l2 norms, the kernel and the gated norm are not TE GEMMs
    gdn_mixer = kind.mixer == MIXER_GDN and len(mixer_bwd) >= 5
    if not (dense or attention or lin_mixer or lin_mlp or mamba or gdn_mixer):
        return mlp_bwd, mixer_bwd
    from .fp8 import quantized_tensor
    from .fp8_layers import layer_gemms
    x = shapes(L)
    r = L.fp8_spec.recipe
    g = {gm.name: gm for gm in layer_gemms(L, kind)}

    def q(width: int) -> int:
        return quantized_tensor(r, x.Tf, width, rowwise=True, columnwise=True).allocated

    def plus(steps: tuple, extra: dict[int, int]) -> tuple:
        return tuple((n, w + extra.get(i, 0)) for i, (n, w) in enumerate(steps))

    if dense:
        mlp_bwd = plus(mlp_bwd, {0: q(x.h), len(mlp_bwd) - 1: q(g["linear_fc1"].rows)})
    if attention:
        mixer_bwd = plus(mixer_bwd, {0: q(x.h), 2: q(g["linear_qkv"].rows)})
    if lin_mixer:
        mixer_bwd = plus(mixer_bwd, {0: q(g["linear_attn"].rows)})
    if mamba:
        # in_proj's step: the last with the scan's tensors released and in_proj's input still kept
        in_proj = max(i for i, (rel, _) in enumerate(mixer_bwd)
                      if "mamba_zxbcdt" in rel and "mamba_in_proj_input" not in rel)
        mixer_bwd = plus(mixer_bwd, {0: q(x.h), in_proj: q(g["mixer.in_proj"].rows)})
    if gdn_mixer:
        # in_proj's step: the last with the l2 norms' tensors released and in_proj's input still kept
        in_proj = max(i for i, (rel, _) in enumerate(mixer_bwd)
                      if "gdn_qk_l2norm" in rel and "gdn_in_proj_input" not in rel)
        mixer_bwd = plus(mixer_bwd, {0: q(x.h), in_proj: q(g["in_proj"].rows)})
    if lin_mlp:
        mlp_bwd = plus(mlp_bwd, {0: q(g["linear_mlp"].rows)})
    return mlp_bwd, mixer_bwd


def _requantized_proj_input(L: Layout, kind: LayerKind, mixer_bwd: tuple) -> tuple:
    """linear_proj saving its BF16 input (every recipe but delayed, and FP4: ``fp8_layers.proj_saves_original_input``)
    quantizes it again in its backward for the weight gradient: that copy joins linear_proj's step (the mixer's
    first backward step, standard and multi-latent attention)."""
    from ..partition import MIXER_ATTENTION, MIXER_MLA
    from .fp8_layers import layer_gemms, proj_backward_input, proj_saves_original_input
    spec = L.fp8_spec
    if kind.mixer not in (MIXER_ATTENTION, MIXER_MLA, *DSA_MIXERS) or not mixer_bwd or not proj_saves_original_input(spec):
        return mixer_bwd
    proj = next((g for g in layer_gemms(L, kind) if g.name == "linear_proj"), None)
    if proj is None:
        return mixer_bwd
    (rel, w), *rest = mixer_bwd
    return ((rel, w + proj_backward_input(spec, proj.tokens, proj.cols)), *rest)


def _recomputed_mla_norm(L: Layout, kind: LayerKind, mods: set) -> bool:
    """Multi-latent attention with 'layernorm' recompute in an FP8 / FP4 layer: its input norm is a module of its
    own, whose output CheckpointWithoutOutput discards after the forward; megatron-core then calls
    ``set_for_recompute_input_layernorm`` (``multi_latent_attention.py``, core 0.16.1 and 0.19.2, also 0.19.2's
    ``absorbed_mla.py``): ``set_save_original_input`` on linear_q_down_proj (with ``--q-lora-rank``) and
    linear_kv_down_proj, which keep that BF16 output (discarded: nothing) instead of a quantized copy. Delayed
    scaling is refused with it (TransformerConfig)."""
    from ..partition import MIXER_MLA
    return (kind.mixer == MIXER_MLA or kind.mixer in DSA_MIXERS) and "layernorm" in mods


def _requantized_down_proj_input(L: Layout, kind: LayerKind, mods: set, mixer_bwd: tuple) -> tuple:
    """The down projections that saved the (recomputed) BF16 norm output quantize it again in their backward for
    the weight gradient (TE 2.11 ``linear.py`` ``_Linear.backward``; one [T, h] copy at a time, freed after each
    weight gradient): added to the down projections' step (the mixer's step before the input norm's)."""
    if not _recomputed_mla_norm(L, kind, mods) or len(mixer_bwd) < 2:
        return mixer_bwd
    from .fp8_layers import proj_backward_input
    x = shapes(L)
    *head, (rel, w), last = mixer_bwd
    return (*head, (rel, w + proj_backward_input(L.fp8_spec, x.T, x.h)), last)


def _quantized(L: Layout, kind: LayerKind, saved: dict[str, int], fwd_steps: tuple, bwd_steps: tuple) -> tuple:
    """An FP8 / FP4 layer: the GEMM inputs its TE modules keep at their quantized size
    (``estimator.fp8_layers.saved_overrides``); linear_proj's quantized copy of the attention output (delayed
    scaling) lives and dies with ``proj_input``, which stays only where the core attention keeps it too
    (``layers.attention.attention_keeps_proj_input``). The working sets of the steps are those of the BF16 layer plus the quantized
    output gradients (``_quantized_grad_outputs``; docs/assumptions.md, FP8 and FP4)."""
    from .layers.attention import attention_keeps_proj_input
    from .fp8 import non_tn_gpu
    from .fp8_layers import layer_gemms, module_gemms, moe_saved_overrides, saved_overrides
    e = shapes(L).e
    # the GPU estimate() was given (None: Hopper storage): on Blackwell one Float8 copy serves both usages
    non_tn = non_tn_gpu(getattr(L, "fp8_gpu", None) or "")
    over = saved_overrides(L.fp8_spec, module_gemms(L, layer_gemms(L, kind)), saved, act_bytes=e,
                           fc1_output_elements=saved.get("fc1_output", 0) // e, non_tn=non_tn)
    if kind.mixer in DSA_MIXERS:
        # DSA's separate latent norms, its indexer's linears, a checkpointed core's BF16 inputs (fp8_layers.py)
        from .fp8_layers import dsa_saved_overrides
        over.update(dsa_saved_overrides(L.fp8_spec, L, layer_gemms(L, kind), saved, act_bytes=e, non_tn=non_tn))
    saved = {**saved, **over, **moe_saved_overrides(L.fp8_spec, L, saved, act_bytes=e, non_tn=non_tn)}
    if "fp8_proj_input" in saved and "proj_input" in saved and not attention_keeps_proj_input(saved):
        # delayed scaling: linear_proj keeps only its quantized copy (TE 2.11 linear.py saves the quantized
        # inputmat, not inp) and nothing else keeps the BF16 output it read
        del saved["proj_input"]
    mods = set(selective_modules(L))
    if _recomputed_mla_norm(L, kind, mods) and "qkv_input" not in saved:
        # without --q-lora-rank, linear_q_proj (not made to save its original input) still keeps its quantized
        # copy of the norm output: the one part of qkv_input that outlives the recompute's discard
        from .fp8 import saved_input
        q = next((g for g in layer_gemms(L, kind) if g.name == "linear_q_proj"), None)
        if q is not None:
            saved["qkv_input"] = saved_input(L.fp8_spec, q.tokens, q.cols, sp_gathered=q.sp_gathered).allocated

    def tie(names: frozenset) -> frozenset:
        # linear_proj's quantized copy goes with proj_input; the op fuser's weight copies with fc1's input (fc1's
        # backward is the MLP's last; the experts' fc1 keeps moe_expert_input)
        names = names | {"fp8_proj_input"} if "proj_input" in names else names
        # a checkpointed DSA core's BF16 inputs go with the query it keeps (layers/dsa.py)
        names = names | {"dsa_core_inputs"} if "dsa_query" in names else names
        return names | {"fp8_op_fuser_weights", "dense_mlp_scales"} if {"fc1_input", "moe_expert_input"} & names \
            else names

    return saved, tuple((tie(n), w) for n, w in fwd_steps), tuple((tie(n), w) for n, w in bwd_steps)

