"""Megatron-FSDP / torch FSDP2 for a resolved layout: its spec, and the parameter groups of a stage.

The bytes themselves are computed by ``fsdp.py`` from a spec and groups; this module only reads
the layout (flat Megatron names) and the per-rank parameter shapes of the layer recipes.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

from .fsdp import (MIXED_PRECISION_POLICY_SINCE, FsdpGroup, FsdpSpec, FsdpStates, FsdpWindow, StageFsdp, stage_fsdp,
                   stage_groups, version_tuple)
from ..layout import ShardGroup
from .params import holds_final_norm, holds_mtp, layer_linear_shapes, layer_params
from .result import Term


def _flag(L: Any, name: str, default: Any = None) -> Any:
    return getattr(L, name, default)


def fsdp_enabled(L: Any) -> bool:
    return bool(_flag(L, "use_megatron_fsdp", False) or _flag(L, "use_torch_fsdp2", False))


@lru_cache(maxsize=256)
def fsdp_spec(L: Any) -> FsdpSpec:
    """The FsdpSpec of a layout that has Megatron-FSDP or torch FSDP2 on."""
    return FsdpSpec.from_flat(
        megatron_version=L.megatron_version, use_megatron_fsdp=bool(_flag(L, "use_megatron_fsdp", False)),
        use_torch_fsdp2=bool(_flag(L, "use_torch_fsdp2", False)),
        data_parallel_sharding_strategy=_flag(L, "data_parallel_sharding_strategy"),
        params_dtype=L.params_dtype, accumulate_allreduce_grads_in_fp32=L.accumulate_allreduce_grads_in_fp32,
        megatron_fsdp_main_params_dtype=_flag(L, "megatron_fsdp_main_params_dtype", "fp32") or "auto",
        megatron_fsdp_main_grads_dtype=_flag(L, "megatron_fsdp_main_grads_dtype", "auto") or "auto",
        use_precision_aware_optimizer=L.use_precision_aware_optimizer, optimizer=L.optimizer,
        exp_avg_dtype=L.exp_avg_dtype, exp_avg_sq_dtype=L.exp_avg_sq_dtype,
        fp8_param_gather=bool(_flag(L, "fp8_param_gather", False)),
        fsdp_double_buffer=bool(_flag(L, "fsdp_double_buffer", False)), nccl_ub=bool(_flag(L, "nccl_ub", False)),
        megatron_fsdp_cuda_graph_mode=bool(_flag(L, "megatron_fsdp_cuda_graph_mode", False)),
        megatron_fsdp_grad_comm_dtype=_flag(L, "megatron_fsdp_grad_comm_dtype", "auto") or "auto",
        suggested_communication_unit_size=_flag(L, "suggested_communication_unit_size"),
        ddp_bucket_size=L.ddp_bucket_size, overlap_grad_reduce=L.overlap_grad_reduce,
        overlap_param_gather=L.overlap_param_gather, data_parallel_size=L.data_parallel_size,
        context_parallel_size=L.context_parallel_size,
        torch_fsdp2_reshard_after_forward=bool(_flag(L, "torch_fsdp2_reshard_after_forward", True)))


@lru_cache(maxsize=256)
def _layer_shapes(L: Any, kind: Any) -> tuple[tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]]:
    """(dense, expert) per-rank shapes of one layer of ``kind`` in registration order: [out, in] for
    the recipe's linear weights, 1-D for norms and biases; parameters named ``.experts.`` are the
    routed experts (Megatron-FSDP's expert groups), their fc1 [rows, h] and fc2 [h, cols]."""
    linear = layer_linear_shapes(L, kind)
    # the routed experts' model width: the latent width with --moe-latent-size (fc1 [g F, latent], fc2 [latent, F]:
    # experts.py / mlp.py, core 0.16.1 and 0.19.2)
    h = (getattr(L.moe, "moe_latent_size", None) if getattr(L, "moe", None) is not None else None) or L.hidden_size
    dense: list[tuple[int, ...]] = []
    experts: list[tuple[int, ...]] = []
    for p in layer_params(L, kind=kind):
        parts = p.name.split(".")
        name = parts[-2] if len(parts) >= 2 and parts[-1] == "weight" else None
        if ".experts." in p.name:
            is_fc2 = "linear_fc2.weight" in p.name
            experts.append((h, p.numel // h) if is_fc2 and p.numel % h == 0 else
                           (p.numel // h, h) if "weight" in parts[-1] and p.numel % h == 0 else (p.numel,))
        elif name in linear and linear[name][0] * linear[name][1] == p.numel:
            dense.append(tuple(linear[name]))
        else:
            dense.append((p.numel,))
    return tuple(dense), tuple(experts)


def _expert_shard(L: Any) -> int:
    """Ranks the experts' groups shard over: the expert data-parallel group when the layout knows
    it (mixture of experts), else DP x CP. With HSDP (more than one optimizer instance) core 0.19
    takes one replica's part of the expert DP group (mcore_fsdp_adapter._init_dist_index: intra_expt_dp; the same in
    0.17.1 and 0.18.2); core 0.16.1 builds no expert mesh then, and its expert groups shard over the dense partial DP x CP
    group (measured on the CPU referee, benchmarks/referee/fsdp_grid.py fsdp_moe_ep2_hsdp)."""
    if (getattr(L, "num_distributed_optimizer_instances", 1) or 1) > 1 and \
            version_tuple(L.megatron_version) < MIXED_PRECISION_POLICY_SINCE:
        return L.parallel.shard_size(ShardGroup.DENSE_DP)
    group = getattr(ShardGroup, "EXPERT_DP", None)
    if group is not None:
        try:
            return L.parallel.shard_size(group)
        except (ValueError, AttributeError):
            pass
    return max(1, L.data_parallel_size * L.context_parallel_size)


def chunk_groups(L: Any, kind_runs: tuple, has_embedding: bool, has_output: bool,
                 tied_copy: bool, final_norm: bool | None = None, has_mtp: bool | None = None) -> tuple[FsdpGroup, ...]:
    """The FSDP parameter groups of one model chunk on one rank. ``final_norm``: the chunk builds the decoder's
    final norm (None: with the output layer; with MTP the chunk of the last decoder layer, params.holds_final_norm);
    ``has_mtp``: it builds the MTP block (None: with the output layer, params.holds_mtp)."""
    spec = fsdp_spec(L)
    h, t = L.hidden_size, L.tensor_model_parallel_size
    rows = L.padded_vocab_size // t
    before: list[tuple[int, ...]] = []
    if has_embedding:
        before.append((rows, h))
        if L.position_embedding_type == "learned_absolute":
            before.append((L.max_position_embeddings, h))
    after: list[tuple[int, ...]] = []
    if has_output if final_norm is None else final_norm:
        # decoder.final_layernorm: outside the units, with the output layer's buckets or alone
        after += [(h,)] * (2 if L.normalization == "LayerNorm" else 1)
    if has_output:
        if L.untie_embeddings_and_output_weights or tied_copy:
            after.append((rows, h))
    per_layer = []
    for kind, count in kind_runs:
        dense, experts = _layer_shapes(L, kind)
        per_layer += [(list(dense), list(experts))] * count
    depths = getattr(L, "mtp_num_layers", 0) or 0
    if (has_output if has_mtp is None else has_mtp) and depths:
        # The MTP block on its chunk (estimator/mtp.py chunk_params): on any but the first chunk its embedding copy,
        # registered with the embedding; per depth enorm, hnorm, eh_proj [h / TP, 2h], a TransformerLayer of
        # the last decoder layer's kind (an FSDP unit like the decoder's) and its final norm.
        from .mtp import layers_built
        from .params import mtp_layer_kind
        # --mtp-use-repeated-layer: one layer (one FSDP unit) built for the D depths
        depths = layers_built(L)
        if not has_embedding:
            before.append((rows, h))
            if L.position_embedding_type == "learned_absolute":
                before.append((L.max_position_embeddings, h))
        norms = 2 if L.normalization == "LayerNorm" else 1
        if getattr(L, "hybrid_mtp_pattern", None):
            # a hybrid depth's HybridStack: each of its layers (MambaLayer, TransformerLayer and its subclasses) is an
            # FSDP unit of its own (mcore_fsdp_adapter.py fsdp_unit_modules, 0.17.1 to 0.19.2); enorm, hnorm, eh_proj
            # and the final norm stay outside the units, as a GPT depth's
            from .params import mtp_stack_runs
            depth = [(list(d), list(e)) for kind, count in mtp_stack_runs(L) for d, e in [_layer_shapes(L, kind)]
                     for _ in range(count)]
            per_layer += depth * depths
        else:
            dense, experts = _layer_shapes(L, mtp_layer_kind(L))
            per_layer += [(list(dense), list(experts))] * depths
        after += [(h,)] * (3 * norms * depths) + [(h // t, 2 * h)] * depths
    # Megatron-FSDP shards dense groups over get_fsdp_group(): DP x CP, or with HSDP
    # (--num-distributed-optimizer-instances > 1) the partial DP x CP group of one replica
    # (mcore_fsdp_adapter._init_dist_index), the distributed optimizer's group in both cases
    dense_shard = L.parallel.shard_size(ShardGroup.DENSE_DP)
    outer = (getattr(L, "num_distributed_optimizer_instances", 1) or 1) \
        if _flag(L, "outer_dp_sharding_strategy", "no_shard") == "optim" else 1
    # HFSDP's expert groups (core 0.18+, mcore_fsdp_adapter._init_dist_index): the expert device mesh takes the
    # same outer (inter-instance) group as the dense one, and ParamAndGradBuffer builds their helper buffers over
    # get_outer_fsdp_group(is_expert_parallel=True) (param_and_grad_buffer.py, 0.19.2): weights and gradients
    # over one replica's expert DP group, main weights and optimizer state over the instances too
    expert_outer = outer if version_tuple(L.megatron_version) >= MIXED_PRECISION_POLICY_SINCE else 1
    return stage_groups(spec, per_layer=per_layer, before=before, after=after, dense_shard=dense_shard,
                        expert_shard=_expert_shard(L), outer=outer, expert_outer=expert_outer)


@lru_cache(maxsize=1024)
def chunk_fsdp(L: Any, kind_runs: tuple, has_embedding: bool, has_output: bool, tied_copy: bool,
               act_per_layer: int, final_norm: bool | None = None, has_mtp: bool | None = None) -> StageFsdp:
    """States, windows and the after-step gather of one model chunk (Megatron wraps each chunk in
    its own FSDP module)."""
    return stage_fsdp(fsdp_spec(L), chunk_groups(L, kind_runs, has_embedding, has_output, tied_copy, final_norm,
                                                 has_mtp),
                      act_per_layer, first_outside_units=has_embedding)


@dataclass(frozen=True)
class FsdpStageTerms:
    """What a stage's estimate takes from FSDP: state terms (replacing the DDP ones), the terms the
    optimizer step leaves, and per chunk the extra of its forward and backward windows."""

    state_terms: tuple[Term, ...]
    step_terms: tuple[Term, ...]
    fwd_extra: tuple[int, ...]
    bwd_extra: tuple[int, ...]
    fwd_windows: tuple[FsdpWindow, ...]
    bwd_windows: tuple[FsdpWindow, ...]
    # alive at the end of the step but released before Megatron logs memory (not in the steady state)
    step_only: tuple[Term, ...] = ()


def fsdp_stage_terms(L: Any, chunks: Any, act_per_layer: list[int] | tuple[int, ...],
                     loss_release: list[int] | tuple[int, ...] = (),
                     output_release: list[int] | tuple[int, ...] = (),
                     forward_release: list[int] | tuple[int, ...] = ()) -> FsdpStageTerms:
    """FSDP terms of one pipeline rank whose chunks save ``act_per_layer[i]`` bytes per layer and
    micro-batch (what each unit's backward releases).

    The backward's first gradients come after the loss: the buckets outside units (the output layer's
    weight gradient) are allocated once the cross entropy has freed its softmax and the output layer's
    backward its logits' gradient (``loss_release[i]``: what has left by then, from the backward's top),
    the first unit's once the output layer's items are gone too (``output_release[i]``, from the top).
    The gradient buckets of the window are counted only above what has left by then (the CPU referee's
    runs under Megatron-FSDP hold no gradient bucket at the backward's top, where the loss buffers and
    the logits' gradient peak).

    From core 0.18 the units are not gathered at the loss (``FsdpSpec.units_gathered_at_loss``) once a backward has
    run: the first unit's weights of the backward are counted above ``output_release`` as its gradient bucket is,
    and the forward window (a moment inside the last layers) above ``forward_release[i]``, what the end of the
    forward holds that the last layer's forward does not (the loss's fp32 softmax). The run's first micro-batch
    still gathers them at its loss, when the optimizer states do not exist yet (the first step makes them) unless
    a checkpoint load has made them already (``fsdp_optimizer_states_at_start``): that moment counts too."""
    spec = fsdp_spec(L)
    after = double = 0
    fwd, bwd, fw, bw = [], [], [], []
    n = len(chunks)
    loss = tuple(loss_release) + (0,) * (n - len(tuple(loss_release)))
    rest = tuple(output_release) + (0,) * (n - len(tuple(output_release)))
    at_end = tuple(forward_release) + (0,) * (n - len(tuple(forward_release)))
    rs = [chunk_fsdp(L, c.kind_runs, c.has_embedding, c.has_output, c.has_tied_output_copy, int(a),
                     holds_final_norm(L, c), holds_mtp(L, c)) for c, a in zip(chunks, act_per_layer)]
    total: FsdpStates = rs[0].states
    for r in rs[1:]:
        total = total + r.states
    # what the run's first micro-batch lacks of the steady state: the optimizer states, unless loaded before it
    absent = 0 if _flag(L, "fsdp_optimizer_states_at_start", False) else sum(total.states)
    for r, a, rel, more, end in zip(rs, act_per_layer, loss, rest, at_end):
        # (fsdp_all_gather_in_start_param_sync off: start_param_sync gathers nothing, megatron_fsdp.py core 0.17+)
        after += r.after_step if _flag(L, "fsdp_all_gather_in_start_param_sync", True) else 0
        double = max(double, r.double_buffer)
        fw.append(r.forward)
        back = r.backward
        extra = max(0, back.total - back.step * int(a))
        if rel and back.grads and back.step == 0:
            outside = min(back.grads, r.non_unit_grad_numel * spec.bucket_grad_bytes)
            grads = max(0, outside - rel, back.grads - more)
            back = replace(back, grads=grads)
            extra = back.total
            if not spec.units_gathered_at_loss and back.weights and more:
                # core 0.18+: after the first backward nothing re-gathers the units before the loss
                # (UNITS_REGATHERED_BEFORE_LOSS_UNTIL); the last unit's pre-backward hook gathers them with the first
                # unit's gradient bucket, once the output layer's items have gone: counted above those, as that
                # bucket is; or a later unit's moment (the output layer's items gone by then too)
                first, later = back, r.backward_later
                at_units = r.backward.weights + r.backward.grads - more
                if at_units > 0 and at_units >= outside - rel:
                    w = min(r.backward.weights, at_units)
                    back = replace(back, weights=w, grads=at_units - w)
                else:                       # the output layer's gradient bucket alone, before any unit's
                    back = replace(back, weights=0, grads=max(0, outside - rel))
                extra = back.total
                if later.total - later.step * int(a) - more > extra:
                    back, extra = later, later.total - later.step * int(a) - more
                # the run's first micro-batch: the units gathered at its loss as before 0.18, the optimizer states
                # not there yet (``absent``)
                if first.total - absent > extra:
                    back, extra = replace(first, detail=(
                        f"the run's first micro-batch, whose loss still finds every prefetched unit gathered, before "
                        f"the first step makes the optimizer states ({absent:,} B less than the steady state)"
                        if absent else "the run's first micro-batch, whose loss still finds every prefetched unit "
                        "gathered (the optimizer states made before it by the checkpoint load)")), first.total - absent
        bw.append(back)
        f = max(0, r.forward.weights - r.forward.step * int(a))
        if not spec.units_gathered_at_loss and end:
            # core 0.18+: the units are released (_post_forward) before the loss; the window's moment lacks the loss's;
            # but the run's first micro-batch has them at its loss (the backward's first units), without ``absent``
            f = max(0, f - end, r.backward.weights - absent if r.backward.step == 0 else 0)
        fwd.append(f)
        bwd.append(max(0, extra))
    impl = "torch FSDP2" if spec.impl == "torch_fsdp2" else f"Megatron-FSDP {spec.strategy}"
    dense = L.parallel.shard_size(ShardGroup.DENSE_DP)
    inst = getattr(L, "num_distributed_optimizer_instances", 1) or 1
    d = f"{dense} FSDP ranks (DP x CP{f' / {inst} HSDP replicas' if inst > 1 else ''})"
    if inst > 1 and _flag(L, "outer_dp_sharding_strategy", "no_shard") == "optim":
        d += f", main weights and optimizer state over all {dense * inst}"
    if getattr(L, "moe", None) is not None and spec.impl == "megatron_fsdp":
        d += f", expert groups over {_expert_shard(L)} (expert DP)"
        if inst > 1 and _flag(L, "outer_dp_sharding_strategy", "no_shard") == "optim":
            d += f", their main weights and optimizer state over {_expert_shard(L) * inst}"
    opt = total.optimizer_numel
    st = [Term("fsdp_parameters", total.weights, "weights",
               detail=f"{impl}: compute weights kept between uses, {spec.param_bytes} B per element; {d}"),
          Term("fsdp_gradients", total.grads, "gradients",
               detail=f"{impl}: main-gradient buffer, {spec.grad_bytes} B per element")]
    if total.non_unit_weights:
        st.append(Term("fsdp_non_unit_parameters", total.non_unit_weights, "weights",
                       detail="whole embedding / final norm / output-layer buckets kept gathered"))
    if total.main_params:
        st.append(Term("main_parameters", total.main_params, "optimizer",
                       detail=f"{spec.main_param_bytes} B main weights on {opt:,} optimizer elements ({impl})"))
    names = ("adam_exp_avg", "adam_exp_avg_sq") if L.optimizer == "adam" else ("sgd_momentum",)
    for name, b, nb in zip(names, total.states, spec.state_bytes):
        st.append(Term(name, b, "optimizer", detail=f"{nb} B x {opt:,} optimizer elements ({impl})"))
    if double:
        how = "--use-nccl-ub: in the NCCL memory pool" if _flag(L, "nccl_ub", False) else "--fsdp-double-buffer"
        st.append(Term("fsdp_double_buffers", double, "transients",
                       detail=f"two unit-sized weight and gradient pools ({how})"))
    step = []
    if total.step_grad_copy and spec.cuda_graph_mode:
        # megatron_fsdp param_and_grad_buffer.py zero_grad (core 0.19.2): in the CUDA-graph-safe mode the
        # optimizer's gradient shards are not dereferenced, so the copy update_main_grads cast lives on
        st.append(Term("main_grad_copies", total.step_grad_copy, "optimizer",
                       detail=f"gradients cast to {spec.main_param_bytes} B for the step on {opt:,} elements, kept "
                              "through the next iteration: Megatron-FSDP's CUDA-graph-safe mode keeps the "
                              "references zero_grad would drop"))
    elif total.step_grad_copy:
        step.append(Term("main_grad_copies", total.step_grad_copy, "optimizer",
                         detail=f"gradients cast to {spec.main_param_bytes} B for the step on {opt:,} elements, "
                                "kept until the next zero_grad"))
    only = []
    if after:
        detail = ("unit weights all-gathered by start_param_sync after the step (the first bucket and those its "
                  "prefetch reaches: half the communication unit)")
        if params_norm_releases_units(L, spec):
            only.append(Term("fsdp_gathered_after_step", after, "transients",
                             detail=detail + "; released by --log-params-norm's calc_params_l2_norm before "
                                             "Megatron logs memory"))
        else:
            step.append(Term("fsdp_gathered_after_step", after, "transients", detail=detail))
    return FsdpStageTerms(tuple(st), tuple(step), tuple(fwd), tuple(bwd), tuple(fw), tuple(bw), tuple(only))


def params_norm_releases_units(L: Any, spec: FsdpSpec) -> bool:
    """Whether the unit buckets start_param_sync re-gathers after the step are gone again when Megatron logs
    memory. With --log-params-norm, train() calls calc_params_l2_norm after every step; under Megatron-FSDP it
    calls each chunk's stop_communication() first, whose synchronize_param_gather() resets the all-gather
    pipeline: every unit bucket is released, the buckets outside units are kept (reset(preserve_non_fsdp_units=
    True)); megatron-core 0.19.2 training/utils/common_utils.py and megatron_fsdp.py; 0.17.1's calc_params_l2_norm
    (training/utils.py) does the same, its reset() releasing the buckets outside units too, which the next forward
    gathers again as it does the units. Core 0.16.1's training loop is not read here: kept as before."""
    return (spec.impl == "megatron_fsdp" and bool(_flag(L, "log_params_norm", False))
            and version_tuple(L.megatron_version) >= MIXED_PRECISION_POLICY_SINCE)


def split_window_terms(kind: str, extra: int, window: FsdpWindow) -> dict[str, int]:
    """The FSDP share of a peak's transient, by term: ``kind`` "F" (forward) or "B" (backward),
    ``extra`` the bytes the window added to that peak."""
    if extra <= 0:
        return {}
    if kind == "F":
        return {"fsdp_unsharded_parameters": extra}
    w = min(window.weights, extra)
    out = {"fsdp_unsharded_parameters": w} if w else {}
    if extra - w:
        out["fsdp_unsharded_gradients"] = extra - w
    return out


def split_fsdp_transients(parts: dict[str, int], ft: FsdpStageTerms) -> dict[str, int]:
    """Name the FSDP share of the peak's transient (the stage's chunk with the largest window)."""
    out = dict(parts)
    for key, kind, extras, wins in (("forward_transient", "F", ft.fwd_extra, ft.fwd_windows),
                                    ("backward_transient", "B", ft.bwd_extra, ft.bwd_windows)):
        if key in out and extras:
            i = max(range(len(extras)), key=lambda j: extras[j])
            share = min(extras[i], out[key])
            out[key] -= share
            out.update(split_window_terms(kind, share, wins[i]))
    return out


def fsdp_window_detail(ft: FsdpStageTerms, name: str) -> str:
    """How the FSDP window at a peak came about (for --detail)."""
    if not ft.bwd_windows:
        return ""
    b = max(ft.bwd_windows, key=lambda w: w.total)
    f = max(ft.fwd_windows, key=lambda w: w.weights)
    if any(t.name == "fsdp_double_buffers" for t in ft.state_terms):
        return ("the buckets outside units; the units' buckets come out of the double-buffer pools"
                if name == "fsdp_unsharded_gradients" else "")
    if name == "fsdp_unsharded_parameters":
        return (f"all-gathered unit weights: {b.units_weights} unit(s) at the backward's worst moment "
                f"({b.step} unit(s) done), {f.units_weights} at the forward's" + (f"; {b.detail}" if b.detail else ""))
    if name == "fsdp_unsharded_gradients":
        return (f"{b.units_grads} unit(s) of full gradient buckets queued for reduce-scatter, with the buckets "
                "outside units")
    return ""
