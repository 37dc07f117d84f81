"""A cheap lower bound of a candidate's peak device memory, to skip estimates that cannot fit.

The bound counts only what every pipeline stage certainly holds, a subset of the estimator's terms:

* model state: the stage's parameters on one rank (no DDP padding) x (weight bytes + gradient bytes)
  plus the optimizer state (fp32 main parameters and moments) / DP x CP with the distributed
  optimizer; the distributed optimizer's busiest rank holds at least the average shard, padding
  only adds;
* activations: the tensors a layer keeps for its backward whatever the kernels are (the residual
  stream at the two norms, the inputs of linear_qkv and linear_fc1, q/k/v, the attention output,
  the fc1 output and the input of linear_fc2, the s x s softmax output of unfused attention; less what selective recompute of 'mlp' or the local
  'layernorm' drops), or only the checkpointed layer inputs under full recompute, times the layers
  of the stage times the
  micro-batches in flight on the first stage when its first backward starts (min(PP, m) in 1F1B;
  2 (PP - 1) + (VPP - 1) PP + 1 chunks of layers / VPP layers in the interleaved schedule) and one on the last;
* on the last stage, one micro-batch's fp32 copy of the logits kept by the cross entropy;
* mixture of experts: the routed experts' state with the optimizer part sharded over expert DP, and
  for an MoE layer its token mixer's share as above plus what its MoE block keeps under balanced
  routing (the router's input; the dispatched rows, the experts' fc1 output and fc2 input unless the
  block or its activation is recomputed); dispatcher indices, router tensors and the shared expert
  are left out.

No workspace, CUDA context, NCCL buffer, transient or allocator slack is counted, so the bound
stays below the estimator's device total (tests/test_planner_search.py checks it on a grid). A
candidate whose bound exceeds threshold x GPU memory cannot be 'fits' and is not estimated.
"""
from __future__ import annotations

from typing import Callable

from ..estimator.layers import mixer_recipe, mlp_recipe
from ..partition import uniform_kind
from .space import Candidate, ModelShape


def stage_factor_bytes(shape: ModelShape, c: Candidate, stage: int,
                       moe_layers_on: Callable[[Candidate, int], int] | None = None) -> int:
    """SOAP's preconditioners of the stage's layers on one rank before DP sharding (0 for other optimizers)."""
    if shape.optimizer != "soap" or shape.gdn_pattern or shape.kinds:
        return 0      # (GDN layers, layers of several kinds: their factors are left out, which keeps the bound a bound)
    n_moe = moe_layers_on(c, stage) if moe_layers_on is not None else 0
    return ((c.stage_layers[stage] - n_moe) * shape.soap_factor_bytes(c.tp)
            + n_moe * shape.soap_factor_bytes(c.tp, moe_layer=True))


def stage_state_bytes(shape: ModelShape, c: Candidate, params: int, expert_params: int = 0,
                      factors: int = 0) -> float:
    """Model state on one rank of a stage with ``params`` (and routed-expert ``expert_params``) parameters;
    ``factors``: SOAP's preconditioner bytes of the stage (stage_factor_bytes), sharded like the optimizer
    state (the layer-wise distributed optimizer's busiest rank holds at least the average)."""
    if shape.layout.freeze_all_layers or shape.layout.peft is not None:
        # --freeze-all-layers: weights only (no DDP buffer, no optimizer state; estimator/core.py); PEFT: the frozen
        # base weights at least (the adapters' states come on top)
        return (params + expert_params) * shape.param_bytes
    if c.fsdp:
        # Megatron-FSDP (estimator/fsdp.py): what each strategy shards over DP x CP; gradients in the
        # parameter dtype (core 0.19) at least; groups kept whole and padding only add. Expert parameters
        # shard over the expert-data-parallel group instead.
        # HSDP (--num-distributed-optimizer-instances): weights and gradients over one replica's DP x CP / instances,
        # the optimizer state over that or (outer 'optim') all of DP x CP: the larger group keeps it a lower bound
        d = max(1, c.dp * c.cp)
        dw = max(1, d // shape.dist_opt_instances)
        w, g, o = shape.param_bytes, min(shape.grad_bytes, shape.param_bytes), shape.optimizer_state_bytes
        sharded = {"no_shard": 0, "optim": o, "optim_grads": g + o, "optim_grads_params": w + g + o}[c.fsdp]
        o_sh = o if c.fsdp != "no_shard" else 0
        return ((params + expert_params) * (w + g + o - sharded) + params * ((sharded - o_sh) / dw + o_sh / d)
                + expert_params * sharded / max(1, c.edp))
    per = shape.param_bytes + shape.grad_bytes
    shard = max(1, c.dp * c.cp // shape.dist_opt_instances) if c.dist_opt else 1
    out = params * per + (params * shape.optimizer_state_bytes + factors) / shard
    if expert_params:
        e_shard = max(1, c.edp // shape.dist_opt_instances) if c.dist_opt else 1
        out += expert_params * per + expert_params * shape.optimizer_state_bytes / e_shard
    return out


def layer_activation_bytes(shape: ModelShape, c: Candidate, mlp: bool = True, recompute: str | None = None) -> float:
    """Bytes one layer surely keeps per micro-batch until its backward: what the backward of its
    GEMMs, attention and activation function needs, in every implementation Megatron has. The
    residual stream at the two norms, plus what the recipes of the layer's kind (its token mixer and
    its MLP, ``estimator.layers``) say they surely keep. ``mlp=False``: an MoE layer (its MoE block
    instead of the dense MLP); ``recompute``: in place of the candidate's (replay_bytes)."""
    recompute = c.recompute if recompute is None else recompute
    seq = shape.seq_length // c.cp
    Tf = c.mbs * seq
    T = Tf // c.tp if c.sp else Tf
    e = shape.act_bytes
    h = shape.hidden
    if recompute == "full":
        return T * h * e                      # the checkpointed input of each layer (uniform, 1 layer)
    mods = set(shape.recompute_modules) if recompute == "selective" else set()
    if shape.kinds:
        return _mixed_layer_bytes(shape, c, mlp, mods, seq, T)
    kind = uniform_kind(shape.layout)
    kept = 2 * T * h * e                      # residual stream kept by the two norms
    if shape.layout.peft is not None:
        # LoRA / DoRA: an unwrapped frozen linear keeps no input (estimator/peft.py): the residual stream is what is sure
        return kept
    # FP8 / FP4 keeps GEMM inputs in 1 (FP4: 1/2 + scales) byte instead of 2: a quarter of the recipes'
    # bound stays a lower bound whatever they count
    quant = c.fp8 not in (None, "off") or (c.fp8 is None and shape.layout.fp8_spec.enabled)
    q = 0.25 if quant else 1
    mixer = mixer_recipe(kind).bound_saved(shape.layout, c.tp, c.mbs, seq, c.sp, mods)
    if shape.gdn_pattern:
        # GDN layers among attention layers: the lighter of the two mixers keeps the bound below every layer
        mixer = min(mixer, shape.gdn_activation_bound(c.tp, c.mbs, seq, c.sp, mods))
    kept += mixer * q
    if mlp:
        kept += mlp_recipe(kind).bound_saved(shape.layout, c.tp, c.mbs, seq, c.sp, mods) * q
    elif shape.moe is not None:
        # an MoE block under balanced routing (the estimate's): the router's input (the pre-MLP norm output)
        # and, unless the block is recomputed, the N = T k ETP dispatched rows kept by fc1, its output and
        # (unless 'moe_act' recomputes the activation) fc2's input
        ms = shape.moe
        if "layernorm" not in mods:
            kept += T * h * e * q             # (a recomputed pre-MLP norm's output is discarded)
        if "moe" not in mods:
            rows = T * ms.topk * c.etp
            f_e = ms.ffn // c.etp
            kept += (rows * h * e + rows * (2 if shape.gated else 1) * f_e * e) * q
            if "moe_act" not in mods:
                kept += rows * f_e * e * q
    return kept


def _mixed_layer_bytes(shape: ModelShape, c: Candidate, mlp: bool, mods: set, seq: int, T: int) -> float:
    """layer_activation_bytes of a model whose layers differ in kind (hybrid, heterogeneous): the lightest of its
    kinds (``mlp=False``: of its MoE layers, else of the others), so that every layer of a stage keeps at least
    that. A kind keeps the residual stream at the norm of each half it has (a hybrid layer has one, a no-op block
    none) and what its mixer's and MLP's recipes surely keep; an MoE block is bounded below by its router's input."""
    from ..partition import MIXER_NONE, MLP_MOE, MLP_NONE
    e, h = shape.act_bytes, shape.hidden
    quant = c.fp8 not in (None, "off") or (c.fp8 is None and shape.layout.fp8_spec.enabled)
    q = 0.25 if quant else 1
    peft = shape.layout.peft is not None
    out = None
    for kind in shape.kind_set:
        if (kind.mlp == MLP_MOE) == mlp:
            continue
        halves = (kind.mixer != MIXER_NONE) + (kind.mlp != MLP_NONE)
        kept = halves * T * h * e
        if not peft:       # (LoRA / DoRA: the residual stream is what is sure, as above)
            mix, dense = shape.kind_activation_bound(kind, c.tp, c.mbs, seq, c.sp, mods)
            kept += mix * q
            if kind.mlp == MLP_MOE:
                kept += 0 if "layernorm" in mods else T * h * e * q
            else:
                kept += dense * q
        out = kept if out is None else min(out, kept)
    return out or 0


# (candidate, mlp, recompute) -> layer_activation_bytes of that candidate (a caller's memo of it)
Activations = Callable[[Candidate, bool, "str | None"], float]


def replay_bytes(shape: ModelShape, c: Candidate, mlp: bool = True, activations: Activations | None = None) -> float:
    """Under full recompute, what a layer's replay adds before its backward: CheckpointFunction.backward reruns
    the layer's forward with grad enabled (tensor_parallel/random.py, megatron-core 0.16.1 / 0.19.2), which saves
    everything the layer keeps without recomputation, its checkpointed input (already counted) aside. Every stage
    runs a backward over the micro-batches it holds, so one replay sits on top of them (the estimator's
    ``_replay``). 0 without full recompute. ``mlp=False``: an MoE layer."""
    if c.recompute != "full" or shape.layout.peft is not None or shape.layout.freeze_all_layers:
        # (PEFT: layer_activation_bytes keeps the residual stream only either way; frozen layers: the first stage
        # runs no backward through its layers)
        return 0
    act = activations or (lambda c, mlp, recompute: layer_activation_bytes(shape, c, mlp, recompute))
    return max(0.0, act(c, mlp, "none") - act(c, mlp, None))


def first_stage_layers_held(c: Candidate) -> int:
    """Layer activations (x micro-batches) the first stage holds when its first backward starts: the
    warm-up forwards plus one. 1F1B: min(PP, m) micro-batches of all its layers. Interleaved (Megatron's
    schedule with micro-batch groups of PP): 2 (PP - 1) + (VPP - 1) PP + 1 chunk forwards, at most all
    m x VPP, each of layers / VPP layers."""
    n = c.stage_layers[0]
    if c.vpp == 1:
        return min(c.pp, c.m) * n
    if c.chunks:
        return rank_layers_held(c, 0)
    chunks = min(c.m * c.vpp, 2 * (c.pp - 1) + (c.vpp - 1) * c.pp + 1)
    return chunks * n // c.vpp


def rank_layers_held(c: Candidate, rank: int) -> int:
    """The same for any rank of a split with uneven virtual stages (``c.chunks``): Megatron's interleaved
    schedule runs 2 (PP - rank - 1) + (VPP - 1) PP warm-up forwards, then one more before the first backward,
    forward j on chunk (j // PP) % VPP (micro-batch groups of PP)."""
    k = min(c.m * c.vpp, 2 * (c.pp - rank - 1) + (c.vpp - 1) * c.pp + 1)
    return sum(c.chunks[((j // c.pp) % c.vpp) * c.pp + rank] for j in range(k))


def _heaviest_middle_rank(c: Candidate) -> int | None:
    """With uneven virtual stages the first rank may hold fewer layers than a middle one (a layout like
    'E|tt|..'): the middle rank with the most layers, the earliest of equals (more micro-batches in flight)."""
    if not c.chunks or c.pp < 3:
        return None
    mid = c.stage_layers[1:-1]
    r = 1 + mid.index(max(mid))
    return r if c.stage_layers[r] > c.stage_layers[0] else None


def memory_lower_bound(shape: ModelShape, c: Candidate, stage_params: Callable[[Candidate, int], int],
                       stage_expert_params: Callable[[Candidate, int], int] | None = None,
                       moe_layers_on: Callable[[Candidate, int], int] | None = None, replay: bool = False,
                       activations: Activations | None = None,
                       state_bytes: Callable[[Candidate, int], float] | None = None) -> float:
    """Lower bound of the critical stage's device total. ``stage_params(c, i)``: parameters on one
    rank of stage i (TimeModel.stage_params); for MoE models ``stage_expert_params`` and
    ``moe_layers_on`` (TimeModel's) give the routed-expert parameters and MoE layers of stage i.
    Each stage's term: its model state, the activations it holds when its first backward starts, and on
    top the larger of two moments that need not overlap: the last stage's logits (the forward's end) and,
    with ``replay`` under full recompute, one layer's replay (replay_bytes) in the backward. (The search
    checks the bound without the replay first: that one decides which layouts a plan estimates.)
    ``activations`` and ``state_bytes``: the caller's memos of layer_activation_bytes (candidate, mlp, recompute)
    and of a stage's model state (stage_state_bytes of stage i); None: computed here."""
    act = activations or (lambda c, mlp, recompute: layer_activation_bytes(shape, c, mlp, recompute))
    per_layer = act(c, True, None)
    replay_moe = replay_bytes(shape, c, False, act) if replay else 0
    replay = replay_bytes(shape, c, True, act) if replay else 0
    # --freeze-all-layers: the first stage keeps no activations (nothing before it requires grad; with virtual
    # stages its later chunks do, left out here)
    first_held = 0 if shape.layout.freeze_all_layers else first_stage_layers_held(c)
    moe = shape.moe is not None and stage_expert_params is not None and moe_layers_on is not None
    if moe:
        per_moe = act(c, False, None)

        def held(i: int, layers: int) -> float:
            n, n_moe = c.stage_layers[i], moe_layers_on(c, i)
            if c.vpp == 1 or layers == n:   # all of the stage's layers, each kind as often as it has them
                return layers / n * ((n - n_moe) * per_layer + n_moe * per_moe)
            return layers * (min(per_moe, per_layer) if n_moe else per_layer)   # chunks: the lighter kind

        def top(i: int, layers: int) -> float:
            # the replayed layer is one of the stage's: the lighter kind it has
            n, n_moe = c.stage_layers[i], moe_layers_on(c, i)
            if not layers:
                return 0
            return replay_moe if n_moe == n else replay if not n_moe else min(replay, replay_moe)

        def state(i: int) -> float:
            if state_bytes is not None:
                return state_bytes(c, i)
            return stage_state_bytes(shape, c, stage_params(c, i), stage_expert_params(c, i),
                                     stage_factor_bytes(shape, c, i, moe_layers_on))
    else:
        def held(i: int, layers: int) -> float:
            return layers * per_layer

        def top(i: int, layers: int) -> float:
            return replay if layers else 0

        def state(i: int) -> float:
            if state_bytes is not None:
                return state_bytes(c, i)
            return stage_state_bytes(shape, c, stage_params(c, i), factors=stage_factor_bytes(shape, c, i))

    first = state(0) + held(0, first_held) + top(0, first_held)
    r = _heaviest_middle_rank(c)
    if r is not None:
        held_r = 0 if shape.layout.freeze_all_layers else rank_layers_held(c, r)
        first = max(first, state(r) + held(r, held_r) + top(r, held_r))
    seq = shape.seq_length // c.cp
    v_t = shape.padded_vocab(c.tp) // c.tp
    logits = c.mbs * seq * v_t * (4 if shape.fp32_logits else shape.act_bytes)
    if c.pp == 1:
        # one stage holds everything (its term above without the replay, then the larger moment)
        last = state(0) + held(0, first_held) + max(logits, top(0, first_held))
    else:
        n_last = c.stage_layers[-1]
        last = state(c.pp - 1) + held(c.pp - 1, n_last) + max(logits, top(c.pp - 1, n_last))
    return max(first, last)
