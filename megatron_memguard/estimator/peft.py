"""LoRA / DoRA fine-tuning: the adapters' parameters and states, and what a frozen base keeps for backward.

Megatron-Bridge 0.6.2 (megatron/bridge/peft/base.py, lora.py, dora.py, utils.py ParallelLinearAdapter):

* every base parameter gets ``requires_grad = False``; megatron-core's DDP puts only parameters that require a
  gradient in its buffers (distributed/distributed_data_parallel.py), so the base weights stay the modules' own
  16-bit tensors: no gradient, no fp32 main copy, no optimizer state, no padding;
* each wrapped linear gets ``linear_in`` and ``linear_out``. Column-parallel targets (linear_qkv, linear_fc1):
  ``linear_in`` = ColumnParallelLinear(in, r), [r/TP, in] per rank, ``linear_out`` = ColumnParallelLinear(r, out),
  [out/TP, r]. Row-parallel targets (linear_proj, linear_fc2): ``linear_in`` = RowParallelLinear(in, r), [r, in/TP],
  ``linear_out`` = ColumnParallelLinear(r, out), [out/TP, r]. So (in + out) x r / TP per target and rank.
  DoRA adds ``weight_magnitude``, the norms of the wrapped weight's local rows: out/TP (column), out (row);
* activations (TE 2.11 module/linear.py ``backward_needs_input = weight.requires_grad``; layernorm_linear.py keeps
  its norm output when ``return_layernorm_output``, which Bridge sets on wrapped LayerNormLinears;
  megatron-core's LinearWithFrozenWeight keeps only the weight): a frozen linear keeps no input for a weight
  gradient. An adapter's ``linear_in`` keeps its input (the base's, shared, unless dropout made a copy), its
  ``linear_out`` keeps the [s b, r] intermediate.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from ..layout import Layout, ShardGroup, TensorKind
from ..layout.peft import COLUMN_TARGETS, SCHEME_NAMES
from ..partition import MIXER_ATTENTION, MIXER_GDN, MIXER_MAMBA, MLP_DENSE, LayerKind
from .layers.base import shapes

# registration order inside a layer: SelfAttention registers linear_proj before linear_qkv (attention.py), then the MLP
_ORDER = ("linear_proj", "linear_qkv", "linear_fc1", "linear_fc2")


def _kind_has(kind: LayerKind | None, name: str) -> bool:
    """Whether a layer of ``kind`` has the linear ``name`` (None: a GPT layer, attention and MLP). A hybrid model's
    layers have half of them: '*' linear_qkv / linear_proj, '-' linear_fc1 / linear_fc2; a Mamba layer's in_proj /
    out_proj are none of Bridge's target names (peft/module_matcher.py matches the module's own name exactly)."""
    if kind is None:
        return True
    if name in ("linear_qkv", "linear_proj"):
        return kind.mixer == MIXER_ATTENTION
    return kind.mlp.split(":", 1)[0] == MLP_DENSE


@lru_cache(maxsize=256)
def target_shapes(L: Layout, kind: LayerKind | None = None) -> dict[str, tuple[int, int]]:
    """[out, in] per TP rank of each wrapped linear of a layer of ``kind`` (the layer recipes' linear_shapes)."""
    from .layers import attention, mlp
    shapes_ = {**attention.linear_shapes(L), **mlp.linear_shapes(L)}
    return {t: shapes_[t] for t in _ORDER if t in L.peft.target_modules and _kind_has(kind, t)}


def column_adapters(L: Layout, name: str, out: int) -> tuple[tuple[str, int], ...]:
    """(name prefix, output rows per TP rank) of the adapters on a column-parallel target whose local output is
    ``out``: one (fused), or NeMo 1's canonical variant's unfused ones (nemo_toolkit 2.2.1
    nemo/collections/nlp/modules/common/megatron/adapters/parallel_adapters.py): LoraUnfusedKQVAdapter's q_adapter
    (out_features = in_features = hidden), k_adapter and v_adapter (kv_channels x num_query_groups each), and
    LoraUnfusedHto4HAdapter's gate_adapter and up_adapter (half of fc1's output each). Each is a
    ParallelLinearAdapter: linear_in ColumnParallelLinear(in, r), linear_out ColumnParallelLinear(r, its out)."""
    if L.peft.variant != "canonical" or name not in COLUMN_TARGETS:
        return ((f"{name}.adapter.", out),)
    t = L.tp
    if name == "linear_qkv":
        kv = (out - L.num_attention_heads * L.kv_channels // t) // 2     # k's (= v's) rows of the fused output
        return ((f"{name}.adapter.q_adapter.", L.hidden_size // t), (f"{name}.adapter.k_adapter.", kv),
                (f"{name}.adapter.v_adapter.", kv))
    return ((f"{name}.adapter.gate_adapter.", out // 2), (f"{name}.adapter.up_adapter.", out // 2))


@lru_cache(maxsize=256)
def layer_adapter_rows(L: Layout, kind: LayerKind | None = None) -> tuple[tuple[str, int, bool], ...]:
    """(name, numel per rank, tp_replicated) of one layer's adapter parameters in registration order."""
    p, t = L.peft, L.tp
    r = p.dim
    rows: list[tuple[str, int, bool]] = []
    for name, (out, inp) in target_shapes(L, kind).items():
        if name in COLUMN_TARGETS:
            # linear_in ColumnParallelLinear(in, r): [r/TP, in]; linear_out ColumnParallelLinear(r, out): [out/TP, r]
            for prefix, o in column_adapters(L, name, out):
                rows.append((f"{prefix}linear_in.weight", (r // t) * inp, False))
                rows.append((f"{prefix}linear_out.weight", o * r, False))
            if p.scheme == "dora":
                rows.append((f"{name}.adapter.weight_magnitude", out, False))
        else:
            # linear_in RowParallelLinear(in, r): [r, in/TP]; linear_out ColumnParallelLinear(r, out): [out/TP, r]
            rows.append((f"{name}.adapter.linear_in.weight", r * inp, False))
            rows.append((f"{name}.adapter.linear_out.weight", (out // t) * r, False))
            if p.scheme == "dora":
                # the norms of the local [out, in/TP] rows: out values, the same size on every TP rank
                rows.append((f"{name}.adapter.weight_magnitude", out, True))
    return tuple(rows)


def adapter_param_count(L: Layout) -> int:
    """Trainable parameters of the whole model (every layer, no TP split): (in + out) x r per target, plus
    DoRA's magnitude (the wrapped weight's output rows)."""
    from ..partition import model_kind_runs
    p = L.peft
    total = 0
    start = 0
    for kind, n in model_kind_runs(L):
        per_layer = 0
        for name, (out, inp) in target_shapes(L, _target_kind(L, kind)).items():
            out_full, in_full = (out * L.tp, inp) if name in COLUMN_TARGETS else (out, inp * L.tp)
            if name in COLUMN_TARGETS:
                # (canonical: each unfused adapter has its own linear_in [r, in] and its share of the outputs)
                per_layer += sum(in_full + o * L.tp for _, o in column_adapters(L, name, out)) * p.dim
            else:
                per_layer += (in_full + out_full) * p.dim
            per_layer += out_full if p.scheme == "dora" else 0
        # (NeMo 1's layer_selection: the run's selected layers only)
        total += p.adapted_layers(start, n) * per_layer
        start += n
    return total


def _target_kind(L: Layout, kind: LayerKind) -> LayerKind | None:
    """The kind whose linears a layer has: a hybrid layer's own, a GPT model's GDN layer its MLP's (its mixer has
    in_proj / out_proj, no linear_qkv / linear_proj), any other GPT layer all four (None)."""
    return kind if L.hybrid_layer_pattern or kind.mixer == MIXER_GDN else None


@dataclass(frozen=True)
class PeftStates:
    """Element counts of a stage's model state under PEFT (one rank, the largest distributed-optimizer shard)."""
    base_params: int          # frozen base parameters on this rank
    adapter_params: int       # adapter parameters on this rank
    param_elems: int          # adapter weights held (the padded param buffer with dist-opt)
    buffer_numel: int         # adapter gradient buffer (padded)
    buffer_unpadded: int
    main_elems: int           # adapter elements this rank's optimizer owns


@lru_cache(maxsize=256)
def stage_peft_states(L: Layout, pp_rank: int, base_params: int) -> PeftStates:
    """The adapters' DDP buffers (one per model chunk, as megatron-core wraps each chunk) and this rank's
    optimizer shard; ``base_params``: the stage's parameter count without adapters (stage_states)."""
    from .states import _buffer_gaps, bucket_size_for, build_buffer, largest_shard
    shard = L.parallel.shard_size(ShardGroup.DENSE_DP)
    dist = L.use_distributed_optimizer
    numel = unpadded = 0
    parts = []
    for c in L.stage_chunks(pp_rank):
        # each layer's adapters in order (a hybrid layer has those of its kind only; NeMo 1's layer_selection: the
        # chunk's selected layers only)
        plist = []
        start = c.first_layer
        for kind, k in c.kind_runs:
            rows = [n for _, n, _ in layer_adapter_rows(L, _target_kind(L, kind))]
            plist += [(n, False) for n in rows] * L.peft.adapted_layers(start, k)
            start += k
        if not plist:
            continue
        buf = build_buffer(L, plist, bucket_size_for(L, c), ShardGroup.DENSE_DP)
        numel += buf.numel
        unpadded += buf.numel_unpadded
        if dist:
            parts.append(_buffer_gaps(buf, shard))
    main = largest_shard(parts, shard) if dist and parts else unpadded
    return PeftStates(base_params, unpadded, numel if dist else unpadded, numel, unpadded, main)


def state_rows(L: Layout, ps: PeftStates) -> tuple[tuple[tuple[str, int, str, str], ...],
                                                   tuple[tuple[str, int, str, str], ...]]:
    """(name, bytes, group, detail) of the stage's state terms and of those the optimizer step adds."""
    nb = L.precision.byte_sizes()
    p_b, g_b = nb[TensorKind.PARAM], nb[TensorKind.MAIN_GRAD]
    shard = f" / {L.dp_shard_size} (distributed optimizer)" if L.use_distributed_optimizer else ""
    scheme = SCHEME_NAMES[L.peft.scheme]
    rows = [("parameters", ps.base_params * p_b, "weights",
             f"{ps.base_params:,} frozen base params x {p_b} B (requires_grad False: the modules' own tensors, "
             "outside DDP's buffers)"),
            ("peft_adapters", ps.param_elems * p_b, "weights",
             f"{ps.adapter_params:,} {scheme} adapter params x {p_b} B"
             + (" (padded param buffer)" if L.use_distributed_optimizer else "")),
            ("gradient_buffer", ps.buffer_numel * g_b, "gradients",
             f"adapters only: {ps.buffer_numel:,} elements x {g_b} B "
             f"({ps.buffer_numel - ps.buffer_unpadded:,} padding)")]
    main = ps.main_elems
    if L.params_dtype != "fp32":
        if (L.use_precision_aware_optimizer and L.store_param_remainders and L.params_dtype == "bf16"
                and L.main_params_dtype == "fp32"):
            rows.append(("main_parameters", 2 * main, "optimizer", "fp32 master weights' low halves" + shard))
        else:
            rows.append(("main_parameters", nb[TensorKind.MAIN_PARAM] * main, "optimizer",
                         "fp32 master weights of the adapters" + shard))
    if L.optimizer == "adam":
        rows.append(("adam_exp_avg", nb[TensorKind.EXP_AVG] * main, "optimizer", f"{L.exp_avg_dtype} first moment" + shard))
        rows.append(("adam_exp_avg_sq", nb[TensorKind.EXP_AVG_SQ] * main, "optimizer",
                     f"{L.exp_avg_sq_dtype} second moment" + shard))
    else:
        rows.append(("sgd_momentum", nb[TensorKind.MOMENTUM] * main, "optimizer", "fp32 momentum" + shard))
    step: list[tuple[str, int, str, str]] = []
    if g_b == 2 and L.params_dtype != "fp32" and not L.use_precision_aware_optimizer:
        step.append(("main_grad_copies", nb[TensorKind.MAIN_PARAM] * main, "optimizer",
                     "fp32 copies of the adapters' 16-bit gradients, from the step until the next zero_grad" + shard))
    return tuple(rows), tuple(step)


# the saved items of the layer recipes each adapter ties its own items to (created and released with them)
_TIES = {"lora_qkv_input": "qkv_input", "lora_proj_input": "proj_input", "lora_fc1_input": "fc1_input",
         "lora_fc2_input": "fc2_input"}
_BASE_INPUT = {"linear_qkv": "qkv_input", "linear_proj": "proj_input", "linear_fc1": "fc1_input",
               "linear_fc2": "fc2_input"}
_LORA_INPUT = {"linear_qkv": "lora_qkv_input", "linear_proj": "lora_proj_input", "linear_fc1": "lora_fc1_input",
               "linear_fc2": "lora_fc2_input"}


def layer_items(L: Layout, saved: dict[str, int], mods: set,
                kind: LayerKind | None = None) -> tuple[dict[str, int], int]:
    """A dense attention layer's saved tensors under PEFT, and DoRA's forward working set (bytes).

    * an unwrapped frozen linear keeps no input: linear_qkv's / linear_fc1's norm output (TE LayerNormLinear
      clears it), linear_fc2's input, linear_proj's input (unless the core attention keeps it);
    * a wrapped column-parallel linear (linear_qkv, linear_fc1) still keeps its local norm output (TE, for
      ``return_layernorm_output``); the adapter's ColumnParallelLinear keeps the whole-sequence copy TE gathers
      for it under sequence parallelism (``return_layernorm_output_gathered``), [s b, h] (``lora_*_input``);
    * a wrapped row-parallel linear (linear_proj, linear_fc2): the adapter's RowParallelLinear keeps the base's
      input (the same tensor);
    * dropout before the adapter (p > 0): a new [tokens, in] copy and its bool mask replace the shared input;
      after it: the bool mask of the adapter's output;
    * each adapter keeps its [s b, r] intermediate (``linear_out``'s input, gathered / all-reduced);
    * DoRA: ``mag_norm_scale * (base + adapter)`` keeps the sum, the wrapped linear's output;
    * with 'mlp' recomputed the MLP's adapters are recomputed with it and keep nothing;
    * a hybrid Mamba layer (never wrapped): its frozen in_proj keeps no norm output, its frozen out_proj no input
      (the same TE rule); the conv1d / scan and the gated norm keep theirs (they pass input gradients down); a gated
      delta net mixer (never wrapped) the same: in_proj's norm output and out_proj's input go.
    """
    p = L.peft
    x = shapes(L)
    Tf, T, h, e = x.Tf, x.T, x.h, x.e
    kind = _target_kind(L, kind) if kind is not None else None
    tg = target_shapes(L, kind)
    out = dict(saved)
    if kind is not None and kind.mixer == MIXER_MAMBA:
        out.pop("mamba_in_proj_input", None)
        out.pop("mamba_out_proj_input", None)
    if kind is not None and kind.mixer == MIXER_GDN:
        # GatedDeltaNet's frozen in_proj (TE LayerNormColumnParallelLinear) keeps no norm output, its frozen out_proj
        # (TERowParallelLinear) no input; the conv, l2 norms, kernel and gated norm keep theirs (input gradients)
        out.pop("gdn_in_proj_input", None)
        out.pop("gdn_out_proj_input", None)
    mlp_recomputed = "mlp" in mods
    inter = 0
    masks = 0
    dora = 0
    dora_fwd = 0
    # the core attention keeps linear_proj's input for its own backward (cuDNN FusedAttention and its p2p ring under
    # CP save the output they return); the flash backend's sbhd copy, the output gate's product and a recomputed
    # core attention leave linear_proj the only holder (layers.attention.attention_keeps_proj_input)
    from .layers.attention import attention_keeps_proj_input
    core_keeps_proj_input = attention_keeps_proj_input(saved)
    for name in _ORDER:
        base = _BASE_INPUT[name]
        in_mlp = name in ("linear_fc1", "linear_fc2")
        if name not in tg:
            if name == "linear_proj" and core_keeps_proj_input:
                continue
            out.pop(base, None)
            continue
        if in_mlp and mlp_recomputed:
            continue
        o, i = tg[name]
        column = name in COLUMN_TARGETS
        pre = p.dropout > 0 and p.dropout_position == "pre"
        # NeMo 1's canonical variant: q / k / v (gate / up) adapters read the same input, each through its own
        # dropout and linear_in, and each keeps its own [s b, r] intermediate
        n_sub = len(column_adapters(L, name, o)) if column else 1
        if column:
            if pre:
                out[_LORA_INPUT[name]] = n_sub * Tf * i * (e + 1)    # dropped [s b, h] copies + their bool masks
            elif L.sequence_parallel:
                out[_LORA_INPUT[name]] = Tf * i * e                  # TE's gathered norm output, kept by linear_in
        elif pre:
            out[_LORA_INPUT[name]] = Tf * i * (e + 1)
            if not (name == "linear_proj" and core_keeps_proj_input):
                out.pop(base, None)                                  # the base input is no longer kept
        inter += n_sub * Tf * p.dim * e
        if p.dropout > 0 and p.dropout_position == "post":
            masks += Tf * sum(oo for _, oo in column_adapters(L, name, o)) if column else T * h
        if p.scheme == "dora":
            dora += (Tf * o if column else T * h) * e
            # _get_weight_norm: W0 + s B A, [out, in] per rank, made (and its product) and detached in the forward
            dora_fwd = max(dora_fwd, 2 * o * i * e)
    if inter:
        out["lora_intermediates"] = inter
    if masks:
        out["lora_dropout_masks"] = masks
    if dora:
        out["dora_scaled_outputs"] = dora
    return out, dora_fwd


def tie_steps(steps: tuple, saved: dict[str, int]) -> tuple:
    """Steps naming a recipe item also name the adapter item tied to it (made and released with it)."""
    extra = [(k, v) for k, v in _TIES.items() if k in saved]
    if not extra:
        return steps
    return tuple((names | {k for k, v in extra if v in names}, w) for names, w in steps)


def backward_steps(L: Layout, mlp_bwd: tuple, mixer_bwd: tuple,
                   kind: LayerKind | None = None) -> tuple[tuple, tuple]:
    """The dense MLP's and the attention's backward steps with each adapter's working set added at its linear's
    step (linear_fc2: the MLP's first, linear_fc1: its last; linear_proj: the mixer's first, linear_qkv: the one
    before the input norm): the gradient of the adapter's input ([s b, in], next to the base's; twice with dropout
    before the adapter: the dropout's backward makes another) and of its [s b, r] intermediate, twice."""
    p = L.peft
    x = shapes(L)
    e, Tf = x.e, x.Tf
    pre = 2 if p.dropout > 0 and p.dropout_position == "pre" else 1
    tg = target_shapes(L, _target_kind(L, kind) if kind is not None else None)
    # (canonical: each unfused adapter's intermediate gradient; their input gradients add into one)
    extra = {name: Tf * i * e * pre + 2 * Tf * p.dim * e * len(column_adapters(L, name, o))
             for name, (o, i) in tg.items()}

    def plus(steps: tuple, at: dict[int, int]) -> tuple:
        n = len(steps)
        add = {k % n: v for k, v in at.items() if v}
        return tuple((names, w + add.get(i, 0)) for i, (names, w) in enumerate(steps))

    if len(mlp_bwd) >= 2:
        mlp_bwd = plus(mlp_bwd, {0: extra.get("linear_fc2", 0), -1: extra.get("linear_fc1", 0)})
    if len(mixer_bwd) >= 3:
        mixer_bwd = plus(mixer_bwd, {0: extra.get("linear_proj", 0), -2: extra.get("linear_qkv", 0)})
    return mlp_bwd, mixer_bwd
