"""Put the pieces together: per pipeline stage, persistent state plus the worst moment of the schedule.

For each stage, the pipeline schedule (``schedule.p2p_peak``, 1F1B in closed form) is evaluated with the activation
bytes each (micro-batch, chunk) forward leaves behind; the peak is the largest of
* a forward: what earlier micro-batches hold + this one's saved tensors + the transient at its end
  (the logits and the cross-entropy's fp32 copy on the last stage);
* a backward: everything held + the backward working set of the chunk's top layer (or the
  recomputed block under full recompute), and at the bottom the embedding's dense weight gradient;
* the optimizer step: model state + the fp32 copies of 16-bit gradients it makes (main_grad_copies).
Adam's moments are created at the first step, so the peak is that of the second iteration onwards.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from operator import mul
from functools import lru_cache, partial
from typing import Callable

from ..errors import NO_TE_BACKEND, ConfigError
from ..gpus import GpuSpec
from ..layout import Chunk, Layout
from ..partition import (DSA_MIXERS, MIXER_ATTENTION, MIXER_DSA, MIXER_DSA_SHARED, MIXER_GDN, MIXER_LINEAR, MIXER_MAMBA, MIXER_MLA, MIXER_NONE, MLP_DENSE, MLP_LINEAR,
                         MLP_MOE, MLP_NONE, LayerKind, after_mtp, mixed_mixers, model_kind_runs, uniform_kind)
from ..units import format_bytes
from ..schedule import p2p_peak, p2p_probes, p2p_walk_peak, peak_in_flight, walk_held, walk_passes, walk_peak
from .activations import LayerActivations, attention_kind, layer_activations, shapes
from .ddp_extras import fp32_local_accumulation_numel, rs_fp32_accumulation_bytes
from .fsdp_layout import fsdp_enabled, fsdp_stage_terms, fsdp_window_detail, split_fsdp_transients
from .layers import dsa as _dsa
from .layers import mixer_recipe
from .layers.base import selective_modules
from .layers.moe import expert_rows, layer_moe_activations, moe_activations, tokens_per_rank
from .layers.mla import MLA_YARN_ORIGINAL_MAX_POSITIONS, ROTARY_LRU_ENTRIES, mla_rotary_bytes  # noqa: F401
from .offload_layout import offload_enabled, offload_shard_numel, offload_terms
from .head import batch_items, deferred_wgrad_buffers, embedding_items, output_items, tied_wgrad_wait
from .attention_backend import explicit_blocked as explicit_attention_blocked
from .attention_backend import select as select_attention_backend
from .overheads import (dummy_wgrad_bytes, dummy_wgrad_shapes, gpu_fixed_terms, p2p_in_flight_bytes, p2p_tensor_bytes,
                        stage_fixed_terms)
from .cuda_graphs import layer_graphed
from .cuda_graphs import spec_of as cuda_graph_spec
from .cuda_graphs import stage_terms as cuda_graph_terms
from .offload_activations import effective_modules as offload_effective_modules
from .offload_activations import fine_grained_plan, fraction_kept, last_offload_group, ordered_sizes, pp_balance_kept
from .offload_activations import layer_groups as offload_layer_groups
from .mtp import last_stage_items as mtp_last_stage_items
from .mtp import standalone_block_items as mtp_standalone_block_items
from .mtp import block_activations as mtp_block_acts
from .mtp import spec_of as mtp_spec_of
from .mtp import standalone_loss_items as mtp_standalone_loss_items
from .mtp import layers_built as mtp_layers_built
from .mtp import checkpointed as mtp_checkpointed
from .params import holds_final_norm, holds_mtp, mtp_layer_kind, mtp_stack_runs
from .muon import EMERGING_OPTIMIZERS, MUON_OPTIMIZERS
from .muon import stage_state_terms as muon_state_terms
from .muon import stage_step_terms as muon_step_terms
from .params import layer_param_rows
from .result import Estimate, StageEstimate, Term, TermLevel, _MadeAtFirstRead, verdict_for
from .site import DEFAULT_SITE, SiteConstants
from .states import StageStates, bucket_size_for, stage_states

PROFILES = ("auto", "transformer_engine", "local", "fujii2024")
_ALLOCATED = TermLevel.ALLOCATED   # Term's default level, passed with a detail made at its first read
# what the last stage keeps per micro-batch for its final norm, output layer and loss, besides the softmax
OUTPUT_ITEMS = ("final_norm_input", "final_norm_stats", "output_layer_input", "loss_targets", "final_logit_softcap")
_FINAL_NORM_ITEMS = ("final_norm_input", "final_norm_stats")


@dataclass(frozen=True)
class ChunkActivations:
    """Bytes one micro-batch leaves on a chunk between its forward and its backward."""

    layers: int            # transformer layers (full activations or checkpoint inputs)
    layers_detail: str     # (may be given as a function making it: made at its first read)
    ends: dict[str, int]   # embedding / batch / output items kept per micro-batch
    fwd_extra: int         # transient at the end of this chunk's forward
    bwd_top_extra: int     # working set at the start of this chunk's backward
    bwd_bottom_extra: int  # working set at the end of the backward (embedding weight gradient)
    moe_layers: int = 0    # the part of ``layers`` the MoE halves of MoE layers keep (moe_layer_activations)
    offload_staging: int = 0   # fine-grained activation offloading: the groups moving to / from the host
    host_bytes: int = 0        # saved activations on the host per micro-batch in flight
    offload_groups: tuple[int, ...] = ()   # fine-grained offloading: one micro-batch's offloaded groups, forward order
    out_bwd_transient: int = 0  # the output layer's backward working set (the logits' gradient)
    out_wgrad_moment: int = 0   # the output layer's extra once its weight gradient is accumulated

    def __init__(self, layers: int, layers_detail: str, ends: dict[str, int], fwd_extra: int, bwd_top_extra: int,
                 bwd_bottom_extra: int, moe_layers: int = 0, offload_staging: int = 0, host_bytes: int = 0,
                 offload_groups: tuple[int, ...] = (), out_bwd_transient: int = 0, out_wgrad_moment: int = 0) -> None:
        # made per chunk shape of every cold estimate: the fields are stored directly (as Term's)
        d = self.__dict__
        d["layers"] = layers
        d["layers_detail" if layers_detail.__class__ is str else "_make_layers_detail"] = layers_detail
        d["ends"] = ends
        d["fwd_extra"] = fwd_extra
        d["bwd_top_extra"] = bwd_top_extra
        d["bwd_bottom_extra"] = bwd_bottom_extra
        d["moe_layers"] = moe_layers
        d["offload_staging"] = offload_staging
        d["host_bytes"] = host_bytes
        d["offload_groups"] = offload_groups
        d["out_bwd_transient"] = out_bwd_transient
        d["out_wgrad_moment"] = out_wgrad_moment

    @property
    def held(self) -> int:
        return self.layers + sum(self.ends.values())


def chunk_activations(L: Layout, c: Chunk) -> ChunkActivations:
    return _chunk_activations(L, c.kind_runs, c.has_embedding, c.has_output, holds_final_norm(L, c))


@lru_cache(maxsize=1024)
def _chunk_activations(L: Layout, runs: tuple[tuple[LayerKind, int], ...], has_embedding: bool,
                       has_output: bool, final_norm: bool | None = None,
                       has_mtp: bool | None = None, held_grad: bool = False) -> ChunkActivations:
    """One chunk with layers of the kinds ``runs`` ((kind, count), bottom to top). ``final_norm``: the chunk
    runs the decoder's final norm (None: with the loss; with MTP the chunk of the last decoder layer,
    params.holds_final_norm), so it keeps the norm's input and statistics. ``has_mtp``: it runs the MTP block
    (None: with the loss; a layout's 'm' on an earlier stage: Megatron's mtp_standalone, params.holds_mtp).
    ``held_grad``: the output gradient the chunk receives from the next stage is a tensor of its own, which
    backward_step (schedules.py, megatron-core 0.16.1 and 0.19.2) holds through the chunk's backward: beside the
    top layer's gradients once its residual gradients merged, and beside every layer below (not on a GPU, where
    p2p_buffers_in_flight counts the pipeline buffer NCCL holds, the last one received)."""
    if final_norm is None:
        final_norm = has_output
    mtp_depths = getattr(L, "mtp_num_layers", 0) or 0
    mtp_here = bool(mtp_depths) and (has_output if has_mtp is None else has_mtp)
    # (pretrain_gpt.py get_batch: the first and last stages read the batch, and a stage building the MTP block
    # before the loss's for the tokens and positions its block embeds, with the attention mask its layers use)
    has_batch = has_embedding or has_output or mtp_here
    # a chunk without layers still names the model's layer in its detail
    per_kind = [(layer_activations(L, has_batch, kind), k) for kind, k in runs] or [(layer_activations(L, has_batch), 0)]
    x = shapes(L)
    ckpt_input = x.T * x.h * x.r // (L.tp if L.distribute_saved_activations else 1)
    # a replay's output, kept by CheckpointFunction.backward with the output gradient it was handed (_replay); the
    # chunk's top block is handed the gradient the schedule received and holds (p2p buffers), unless the chunk runs
    # the final norm (or the MTP block), whose backward makes it
    replay_out = x.T * x.h * x.r
    held = replay_out if held_grad and not (final_norm or mtp_here) else 0
    top_grad = replay_out if (final_norm or mtp_here) else held
    # full block recompute: the first k layers checkpointed one by one, their replays composed layer by layer
    # (_block_replays; a chunk building MTP layers above its decoder layers (estimator/mtp.py) and activation
    # offloading keep the replay over everything the chunk holds: an upper bound)
    block = (L.recompute_granularity == "full" and L.recompute_method == "block" and not mtp_here
             and not L.cpu_offloading_num_layers and not L.fine_grained_activation_offloading)
    if len(per_kind) == 1:                        # a uniform chunk (the common case)
        la, n = per_kind[0]
        per_layer, fwd_transient, bwd_transient = la.total, la.fwd_transient, la.bwd_transient
        if held and n:
            bwd_transient = _held_top_run(la, n, held)
    else:
        n = sum(k for _, k in runs)
        per_layer = max(la.total for la, _ in per_kind)
        if L.recompute_granularity == "full" or L.cpu_offloading_num_layers or L.fine_grained_activation_offloading:
            # With layers of different kinds, the largest layer's saved bytes and working sets stand for
            # the one whose backward runs first (an upper bound; uniform's replays: _mixed_replays; fine-grained
            # offloading composes them below, once it knows what each layer keeps: _kept_transients).
            fwd_transient = max(la.fwd_transient for la, _ in per_kind)
            bwd_transient = max(la.bwd_transient for la, _ in per_kind)
        else:
            fwd_transient, bwd_transient = _mixed_transients(per_kind, held)
    if block and n:
        bwd_transient = _block_replays(per_kind, L.recompute_num_layers if L.recompute_num_layers is not None else 1,
                                       ckpt_input, replay_out, top_grad, held)
    recompute_group = 0
    if L.recompute_granularity == "full" and n:
        # block: the first k layers of the chunk are checkpointed, 0 = none (Megatron takes 0; resolve
        # refuses it for uniform, whose loop would not advance)
        k = L.recompute_num_layers if L.recompute_num_layers is not None else 1
        if L.recompute_method == "uniform":
            groups = -(-n // k)
            layers = groups * ckpt_input
            recompute_group = min(k, n)
            detail = f"{groups} checkpointed blocks of <= {k} layers x {format_bytes(ckpt_input)} input"
        else:  # block
            k = min(k, n)
            layers = k * ckpt_input + _layers_bytes(per_kind, k)
            recompute_group = 1 if k else 0
            detail = (f"{k} checkpointed layers x {format_bytes(ckpt_input)} + "
                      + _layers_detail(per_kind, k, mixed_mixers(L)))
    else:
        layers = _layers_bytes(per_kind, 0)
        detail = None                 # _layers_detail(per_kind, 0), made when first read
    more: list[str] = []              # what the detail adds (offloading, MTP layers)
    if recompute_group and (block or L.recompute_method == "uniform" and not L.cpu_offloading_num_layers):
        # (in the backward working set, _replay; the same words for every chunk, so that virtual chunks share them)
        more.append(f"; a replay saves its kept input again (- {format_bytes(ckpt_input)}) and holds its output and "
                    f"the gradient it is handed (+ {format_bytes(replay_out)} each; "
                    "a received gradient is the schedule's)")
    moe_layers = 0
    if L.moe is not None and n:
        # the MoE halves' share of the layers kept whole (checkpointed layers keep only their input)
        skip = 0 if L.recompute_granularity != "full" else (
            n if L.recompute_method == "uniform" else min(n, L.recompute_num_layers if L.recompute_num_layers is not None else 1))
        moe_layers = _layers_bytes(per_kind, skip, moe=True)
    staging = host = 0
    offload_groups: tuple[int, ...] = ()
    if L.cpu_offloading_num_layers and n:
        # TE's cpu_offload (PP = 1): the saved tensors of layers 0..N-1 go to the host; (L - N) layers stay
        host = _layers_bytes(per_kind, 0) - _layers_bytes(per_kind, min(L.cpu_offloading_num_layers, n - 1))
        layers -= host
        more.append(f"; {L.cpu_offloading_num_layers} layers' saved tensors offloaded ({format_bytes(host)} on the host)")
    elif L.fine_grained_activation_offloading and n and L.recompute_granularity != "full":
        names: set[str] = set()
        seq: list[int] = []
        leaving: list[list[int]] = []     # the groups each layer sends to the host, bottom to top (as seq)
        groups_of: list[dict[str, int]] = []
        for i, (la_k, k) in enumerate(per_kind):
            kind = runs[i][0] if i < len(runs) else None
            if kind is not None and kind.mixer == MIXER_MAMBA:
                # MambaLayer / MambaMixer open no offload group (core 0.18.2 and 0.19.2 ssm/): a Mamba layer keeps
                # every tensor it saves
                groups_of.append({})
                continue
            modules = offload_effective_modules(L.offload_modules, L.cuda_graph_impl, L.cuda_graph_modules,
                                                kind is not None and (kind.mlp == MLP_MOE if L.heterogeneous_layers
                                                                      else kind.mlp != MLP_DENSE))
            if kind is not None and kind.mixer in DSA_MIXERS:
                # AbsorbedMLASelfAttention and DSAttention open no offload group (absorbed_mla.py, dsa.py 0.19.2 call
                # no off_interface, unlike MLASelfAttention): qkv_linear, core_attn and attn_proj take nothing of a
                # DSA layer; TransformerLayer's attn_norm (the input norm is a module of its own) and its MLP's groups
                # act as in any layer
                modules = tuple(m for m in modules if m not in ("qkv_linear", "core_attn", "attn_proj"))
            outside = None
            if kind is not None and kind.mlp == MLP_MOE:
                from .layers.moe import offload_outside
                outside = offload_outside(L, set(selective_modules(L)))
            saved = la_k.saved
            if kind is not None and MIXER_LINEAR in (kind.mixer, kind.mlp):
                # a heterogeneous linear replacement (TELayerNormColumnParallelLinearGathered, the norm fused in) is
                # called by TransformerLayer outside any offload group, and its layer's input_layernorm /
                # pre_mlp_layernorm is IdentityOp, which _set_offload_modules skips (transformer_layer.py 0.16.1,
                # 0.18.2, 0.19.2): what it saves (its input, the norm's output and statistics) stays on the GPU
                drop = ({"layer_input", "qkv_input", "norm1_stats"} if kind.mixer == MIXER_LINEAR else set()) | (
                    {"mlp_norm_input", "fc1_input", "norm2_stats"} if kind.mlp == MLP_LINEAR else set())
                saved = {k: v for k, v in saved.items() if k not in drop}
            if kind is not None and kind.mixer == MIXER_GDN:
                # a GDN layer's input_layernorm is IdentityOp (the norm is fused into in_proj), which
                # _set_offload_modules skips for attn_norm, and GatedDeltaNet opens no offload group (qkv_linear,
                # core_attn, attn_proj are SelfAttention's; core 0.19.2 ssm/gated_delta_net/): its mixer keeps every
                # tensor it saves, the layer input in_proj keeps included; its MLP offloads as any layer's
                saved = {k: v for k, v in saved.items() if k != "layer_input"}
            groups_of.append(offload_layer_groups(saved, modules, L.act_bytes,
                                                  separate_input_norm=L.multi_latent_attention,
                                                  min_elements=L.min_offloaded_tensor_size, outside=outside))
        # the chunk's last group stays on the last stage: it belongs to the top layer that offloads any (a hybrid
        # chunk's top layers may be Mamba layers, a heterogeneous chunk's no-op layers, which offload none)
        top = (max((i for i, g in enumerate(groups_of) if any(g.values())), default=len(per_kind) - 1)
               if L.hybrid_layer_pattern or L.heterogeneous_layers else len(per_kind) - 1)
        for i, (la_k, k) in enumerate(per_kind):
            kind = runs[i][0] if i < len(runs) else None
            groups = groups_of[i]
            plan = fine_grained_plan(groups, k, has_output and i == top,
                                     getattr(L, "fine_grained_offloading_max_inflight_offloads", None))
            layers -= plan.offloaded
            # the MoE halves' share of what left (the expert groups), so moe_layer_activations stays on the GPU's side
            moe_groups = [g for g in ("expert_fc1", "moe_act", "fused_group_mlp") if groups.get(g)]
            if moe_groups:
                moe_off = k * sum(groups[g] for g in moe_groups)
                if plan.kept_last_group and last_offload_group(groups) in moe_groups:
                    moe_off -= plan.kept_last_group
                moe_layers -= moe_off
            host += plan.host_bytes
            staging = max(staging, plan.staging)
            names |= {g for g, b in groups.items() if b}
            sizes = ordered_sizes(groups)
            seq += sizes * k
            leaving += [list(sizes) for _ in range(k)]
            if plan.kept_last_group:
                seq.pop()
                leaving[-1].pop()
            if (L.delay_offload_until_cuda_graph and L.cuda_graph_impl == "transformer_engine" and sizes
                    and (kind is None or not L.hybrid_layer_pattern
                         or layer_graphed(L)(cuda_graph_spec(L), kind.mixer, kind.mlp))):
                # the offloads committed in a graph replay wait for its end: a layer's groups at once, and one
                # group reloaded ahead
                staging = max(staging, sum(sizes) + max(sizes))
        kept = fraction_kept(seq, L.activation_offload_fraction)
        if kept:
            layers += kept
            host -= kept
            more.append(f"; {format_bytes(kept)} kept by --activation-offload-fraction {L.activation_offload_fraction:g}")
        offload_groups = tuple(seq)
        if host:
            more.append(f"; {format_bytes(host)} offloaded to the host ({', '.join(sorted(names))})")
        if len(per_kind) > 1:
            # layers of different kinds: each one's working sets less what the layers above it keep on the GPU
            fwd_transient, bwd_transient = _kept_transients(per_kind, leaving, kept)

    ends: dict[str, int] = {}
    fwd_extra = fwd_transient if n else 0
    bwd_top = bwd_transient if n else 0
    if recompute_group:
        # Backward of a checkpointed block first replays its forward with grad enabled.
        bwd_top = recompute_group * per_layer + bwd_transient
        if L.recompute_method == "uniform" and not L.cpu_offloading_num_layers:
            # each block's own layers replayed (not k of the largest), over its kept input (_replay)
            bwd_top = (_mixed_replays(per_kind, recompute_group, ckpt_input, replay_out, top_grad) if len(per_kind) > 1
                       else _uniform_replays(per_kind[0][0], n, recompute_group, ckpt_input, replay_out, top_grad))
        elif block:
            # the replays are in the composed working set (_block_replays)
            bwd_top = bwd_transient
    bwd_bottom = 0
    if has_batch:
        b = batch_items(L, first=has_embedding, last=has_output)
        ends.update(b.saved)
        fwd_extra += b.fwd_transient
    if has_embedding:
        e = embedding_items(L)
        ends.update(e.saved)
        fwd_extra = max(fwd_extra, e.fwd_transient)
        # Dense weight gradient of the vocabulary-parallel embedding, added into main_grad afterwards.
        bwd_bottom = L.padded_vocab_size // L.tp * L.hidden_size * L.act_bytes
        if L.position_embedding_type == "learned_absolute":
            bwd_bottom += L.max_position_embeddings * L.hidden_size * L.act_bytes
        bwd_bottom += held            # (backward_step still holds the received output gradient)
    # tied weights on this chunk (PP 1): the output layer's weight gradient waits for the embedding's (head.py)
    tied_wait, tied_sum = tied_wgrad_wait(L, has_embedding, has_output)
    bwd_bottom += tied_sum
    if mtp_here and not has_output:
        # Megatron's mtp_standalone: the MTP block on a stage before the loss's, which it sends the concatenated
        # hidden states to (estimator/mtp.py); its layers as on the last stage
        d = L.mtp_num_layers
        mtp_la, kept, kept_moe = _mtp_layers(L, has_batch, ckpt_input)
        layers += kept
        moe_layers += kept_moe
        more.append(f" + {d} MTP layer(s)")
        block_saved, concat = mtp_standalone_block_items(L)
        if not n and not has_embedding:
            # a chunk of the MTP block only: its empty TransformerBlock returns hidden_states.clone() (no layer, no
            # final norm, not pre_process: transformer_block.py, megatron-core 0.16.1 and 0.19.2), which hnorm
            # keeps, while the schedule keeps the received tensor for the chunk's backward: one row more
            block_saved = {k: v + p2p_tensor_bytes(L) for k, v in block_saved.items()}
        ends.update(block_saved)
        fwd_extra = max(fwd_extra, concat)
        # the chunk's backward starts in the MTP layers (their working set, whose output gradient is the MTP final
        # norm's input gradient, beside the received gradient of the (1 + D)-fold output, which the schedule holds
        # until the chunk's backward ends: measured by the CPU referee on 'Et|m|L'; on a GPU that gradient is the
        # receive buffer the widened p2p_buffers_in_flight counts, the same tensor: _communicate's torch.empty,
        # p2p_communication.py, returned as backward_step's output_tensor_grad, megatron-core 0.16.1 and 0.19.2) and
        # ends the block in the embedding copy's dense weight gradient [V/TP, h]: after the chunk's decoder layers'
        # backward when it has none (the end of its backward), else before them, with the block's own tensors
        # released by then (the last depth's final norm is back-propagated first: its input and statistics are gone)
        held_concat = concat if held_grad else 0
        acts = mtp_block_acts(mtp_spec_of(L))   # (as without recompute: one depth's tensors are 1/d of each term)
        top = mtp_la.bwd_transient + held_concat - (acts.final_norm_inputs + acts.norm_stats // 3) // d
        if mtp_checkpointed(L):
            # full uniform recompute: the last depth kept only its checkpoint inputs (hidden_states, decoder_input), so
            # CheckpointFunction.backward (tensor_parallel/random.py) first replays _proj_and_transformer_layer
            # (multi_token_prediction.py, megatron-core 0.16.1 and 0.19.2): the layer's saved tensors, eh_proj's
            # concatenated input, the three norms' statistics, the final norm's input, and the replayed output it
            # holds until its torch.autograd.backward returns (one row more, as the final norm's input)
            top += mtp_la.total + (acts.eh_proj_inputs + 2 * acts.final_norm_inputs + acts.norm_stats) // d
        # that received (1 + D)-fold gradient stays beside the decoder layers' backward and the embedding's weight
        # gradient too: backward_step (schedules.py, 0.16.1 and 0.19.2) holds it until the chunk's backward returns
        # (the layers' own output gradient is the final norm's, a tensor of its own; on a GPU the widened
        # p2p_buffers_in_flight counts it)
        if n:
            # (the decoder layers' backward comes after the MTP block's and the final norm's: their saved tensors are
            # released by then)
            norm = sum(v for k, v in output_items(L).saved.items() if k in _FINAL_NORM_ITEMS) if final_norm else 0
            bwd_top += held_concat - kept - sum(block_saved.values()) - norm
        bwd_top = max(bwd_top, top)
        if has_embedding:
            bwd_bottom += held_concat
        else:
            # beside the embedding copy's dense gradient: the decoder output's gradient as it is made (hnorm's input
            # gradient and its sum with the concatenation's slice: two rows); at the end of an MTP-only chunk's
            # backward also, where the schedule's tensors are the chunk's own (held_grad: not a GPU's NCCL buffers),
            # the received input backward_step still references (CPU referee, 'Et|tm|L' and 'Et|m|L', core 0.16.1)
            wgrad = L.padded_vocab_size // L.tp * L.hidden_size * L.act_bytes
            row = p2p_tensor_bytes(L)
            if n:
                bwd_top = max(bwd_top, wgrad - kept - sum(block_saved.values()) + held_concat + 2 * row)
            else:
                bwd_bottom = wgrad + held_concat + 2 * row + (row if held_grad else 0)
    if has_output:
        o = output_items(L)
        o_saved = o.saved
        if not final_norm:
            # a layout string left the loss's stage no decoder layer (MTP): the norm ran on the stage of the
            # last decoder layer (TransformerBlock.has_final_layernorm_in_this_stage), which keeps its tensors
            o_saved = {k: v for k, v in o_saved.items() if k not in _FINAL_NORM_ITEMS}
        if mtp_depths and not mtp_here:
            # mtp_standalone's loss chunk: the heads' inputs are views of the received concatenation
            # (mtp_received_hidden), not a tensor of their own
            o_saved = {k: v for k, v in o_saved.items() if k != "output_layer_input"}
        ends.update(o_saved)
        mtp_saved, mtp_logits = mtp_last_stage_items(L) if mtp_here else (
            mtp_standalone_loss_items(L) if mtp_depths else ({}, 0))
        if mtp_saved and mtp_here:
            # the D MTP layers (the last decoder layer's kind; each checkpointed under full uniform recompute)
            d = L.mtp_num_layers
            _, kept, kept_moe = _mtp_layers(L, has_batch, ckpt_input)
            layers += kept
            moe_layers += kept_moe
            if L.hybrid_mtp_pattern:
                # a hybrid depth's layers need not be of the chunk's kinds: their working sets count too, composed
                # layer by layer over the D depths' HybridStacks (plain autograd: MultiTokenPredictionLayer
                # _proj_and_transformer_layer calls its mtp_model_layer, megatron-core 0.19.2), each layer's less
                # what the layers above it in the depths keep
                more.append(f" + {d} MTP depth(s) of '{L.hybrid_mtp_pattern}'")
                stack = [(layer_activations(L, has_batch, kind), k) for kind, k in mtp_stack_runs(L)]
                if mtp_checkpointed(L):
                    f, b = _checkpointed_hybrid_depth(L, stack, ckpt_input)
                elif _hybrid_depth_block(L):
                    f, b = _block_hybrid_depths(stack, d, _hybrid_depth_block(L), ckpt_input, replay_out)
                else:
                    f, b = _mixed_transients(stack * d)
                fwd_extra = max(fwd_extra, f)
                bwd_top = max(bwd_top, b)
            else:
                more.append(f" + {d} MTP layer(s)")
        ends.update(mtp_saved)
        # the last MTP depth's logits are still referenced while the main head computes its loss
        fwd_extra = max(fwd_extra, o.fwd_transient + mtp_logits)
        # The loss and output layer are back-propagated first; the layers' working set comes once the
        # output items are released.
        bwd_top = max(o.bwd_transient, bwd_top - sum(o_saved.values()) + tied_wait)
    elif final_norm:
        # the final norm of a stage without the loss (MTP with a layout string): its input and statistics
        ends.update({k: v for k, v in output_items(L).saved.items() if k in _FINAL_NORM_ITEMS})
    holder = _dsa_topk_holder(L, runs, mtp_here)
    if holder and has_batch and L.create_attention_mask_in_dataloader:
        # DSA top-k sharing: the computing layers' top-k hang on the batch's attention mask, alive until the
        # micro-batch's forward step returns (layers/dsa.py topk_holder_bytes; without the mask: _persistent_buffers)
        fwd_extra += holder
    if L.freeze_all_layers and has_embedding:
        # --freeze-all-layers: nothing of the first chunk of the first stage requires grad (its input is token ids),
        # so its forward records no graph and saves nothing, and its backward does not run. What training keeps
        # is a forward transient here: one layer's tensors while it runs (what it would save, and its working
        # set), or the output items at the loss; the batch and embedding items alongside. Later stages receive an
        # input that requires grad (p2p_communication.py) and are counted as in training.
        # (one layer at a time, nothing above it kept: the largest layer's working set, whatever its position)
        one_layer = (per_layer + max(la.fwd_transient for la, _ in per_kind)) if n else 0
        return ChunkActivations(layers=0, layers_detail="frozen: nothing saved for backward", ends={},
                                fwd_extra=sum(ends.values()) + max(fwd_extra, one_layer), bwd_top_extra=0,
                                bwd_bottom_extra=0)
    # (positional, in the fields' order: one per chunk shape of every cold estimate)
    merge = mixed_mixers(L)
    return ChunkActivations(layers, lambda: (_layers_detail(per_kind, 0, merge) if detail is None else detail)
                            + "".join(more),
                            ends, fwd_extra, bwd_top, bwd_bottom, moe_layers, staging, host, offload_groups,
                            o.bwd_transient if has_output else 0, o.bwd_wgrad_moment if has_output else 0)


ChunkActivations.layers_detail = _MadeAtFirstRead("layers_detail", "")  # type: ignore[assignment]


def _mtp_layers(L: Layout, has_batch: bool, ckpt_input: int) -> tuple[LayerActivations, int, int]:
    """The D MTP layers of the chunk that builds the MTP block (the last decoder layer's kind; each checkpointed
    under full uniform recompute, kept whole under block: estimator/mtp.py checkpointed): their activations, the
    bytes they keep, and the MoE part of those (an MoE MTP layer's MoE half is MoE activations like a decoder
    layer's: moe_layer_activations, which the worst-case routing scales)."""
    d = L.mtp_num_layers
    x = shapes(L)
    # under full uniform recompute each depth's checkpoint keeps decoder_input (the rolled tokens' embedding) whole:
    # with --distribute-saved-activations only its first input, hidden_states, is sharded (estimator/mtp.py), into a
    # new 1/TP buffer (split_tensor_into_1d_equal_chunks(new_buffer=True), tensor_parallel/utils.py 0.16.1 / 0.19.2)
    # while the tensor it shards, a viewless copy of a view of the decoder output (or of the received concatenation),
    # leaves that storage referenced: the shard is one more (one depth: two fail at the first forward); a hybrid
    # depth's MultiTokenPredictionLayer._checkpointed_forward is the same (core 0.18.2 / 0.19.2)
    whole = x.T * x.h * x.r
    kept = d * whole + whole // L.tp if L.distribute_saved_activations else d * ckpt_input
    if L.hybrid_mtp_pattern:
        # a hybrid depth: its HybridStack's layers, each kept as the decoder's of its kind; the layer with the
        # largest backward working set stands for the stack's
        per_kind = [(layer_activations(L, has_batch, kind), k) for kind, k in mtp_stack_runs(L)]
        la = max((a for a, _ in per_kind), key=lambda a: (a.bwd_transient, a.fwd_transient))
        if mtp_checkpointed(L):
            return la, kept, 0
        k = _hybrid_depth_block(L)
        if k:
            # block: each depth's HybridStack keeps the inputs of its first k layers and the others' saved tensors
            n = sum(c for _, c in per_kind)
            return (la, d * (min(k, n) * ckpt_input + _layers_bytes(per_kind, k)),
                    d * _layers_bytes(per_kind, k, moe=True))
        return la, d * sum(a.total * k for a, k in per_kind), d * sum(a.moe_total * k for a, k in per_kind)
    la = layer_activations(L, has_batch, mtp_layer_kind(L))
    if mtp_checkpointed(L):
        return la, kept, 0
    return la, d * la.total, d * la.moe_total


def _checkpointed_hybrid_depth(L: Layout, stack: list[tuple[LayerActivations, int]], ckpt_input: int) -> tuple[int, int]:
    """The working sets of a hybrid MTP depth under full uniform recompute (core 0.18.2 / 0.19.2): its forward runs
    inside the depth's checkpoint without grad, one layer at a time; its backward first replays the depth
    (CheckpointFunction.backward: enorm, hnorm, eh_proj's concatenated input, the final norm's input and the
    statistics), whose HybridStack checkpoints each of its layers again (hybrid_block.py checkpointed_forward, the
    model's recompute settings: one layer per checkpoint), so the replay keeps the stack's layer inputs and then
    replays one layer at a time in its backward: the largest layer's saved tensors and working set on top (an upper
    bound: the layer's own input counted twice)."""
    d = L.mtp_num_layers
    acts = mtp_block_acts(mtp_spec_of(L))                 # (without recompute: one depth's tensors are 1/d of each)
    outside = (acts.embedding_norm_inputs + acts.eh_proj_inputs + acts.final_norm_inputs + acts.norm_stats) // d
    layers = sum(k for _, k in stack)
    fwd = max(la.fwd_transient + la.total for la, _ in stack)
    bwd = outside + layers * ckpt_input + max(la.total + la.bwd_transient for la, _ in stack)
    return fwd, bwd


def _hybrid_depth_block(L: Layout) -> int:
    """The layers each hybrid MTP depth's HybridStack checkpoints under full ``block`` recompute (0: not block).
    MultiTokenPredictionLayer.forward (transformer/multi_token_prediction.py, megatron-core 0.18.2 and 0.19.2) warns
    "recompute_method == 'block' is not supported for MTP yet. Skipping recompute." and runs the depth plainly, but
    the depth's mtp_model_layer is a HybridStack with the model's config, whose forward (models/hybrid/hybrid_block.py)
    takes recompute.py checkpointed_forward: under block its first ``recompute_num_layers`` layers are checkpointed
    one by one (``layer_idx < recompute_num_layers``; its FP8 / FP4 skip of layers whose input needs no grad does not
    arise: a depth's stack input is eh_proj's output), the others run plainly."""
    if not (L.hybrid_mtp_pattern and L.recompute_granularity == "full" and L.recompute_method == "block"):
        return 0
    return L.recompute_num_layers if L.recompute_num_layers is not None else 1


def _block_hybrid_depths(stack: list[tuple[LayerActivations, int]], d: int, k: int, ckpt_input: int,
                         out: int) -> tuple[int, int]:
    """The forward and backward working sets of ``d`` hybrid MTP depths (bottom to top) whose HybridStacks each
    checkpoint their first ``k`` layers (_hybrid_depth_block), over what the chunk holds; composed layer by layer as
    ``_block_replays``: a checkpointed layer keeps its input and replays before its backward (``_replay``, handed a
    gradient of its own: the layer above's or the depth's final norm's), the others keep their saved tensors. In the
    forward a checkpointed layer runs without grad: its tensors live until it returns (an upper bound: its saved
    bytes on top of its working set, as _checkpointed_hybrid_depth)."""
    depth = [la for la, c in stack for _ in range(c)]
    layers = [(la, i < k) for _ in range(d) for i, la in enumerate(depth)]
    fwd = bwd = None
    above = 0
    for la, replayed in reversed(layers):
        f = la.fwd_transient + (la.total if replayed else 0) - above
        b = (_replay([la], ckpt_input, out, out) if replayed else la.bwd_transient) - above
        fwd = f if fwd is None else max(fwd, f)
        bwd = b if bwd is None else max(bwd, b)
        above += ckpt_input if replayed else la.total
    return fwd or 0, bwd or 0


def _mixed_transients(per_kind: list[tuple[LayerActivations, int]], held: int = 0) -> tuple[int, int]:
    """A chunk of layers of different kinds (bottom to top): its forward and backward working sets over the
    whole chunk's saved bytes. A layer's forward runs before the layers above it have saved anything, and its
    backward after their saved tensors are freed (autograd releases a node's saved tensors once its backward
    has run), so layer i adds its own working set less what the layers above it keep: the largest over the
    layers. Within a run of one kind its top layer is the largest. (A hybrid model's attention layer under its
    MLP layer: the attention's backward working set comes when the MLP layer above has freed its tensors.)
    ``held``: a received output gradient held through the backward (_chunk_activations): beside the top layer's
    steps after its residual merge (_replay_transient), and beside every layer below."""
    fwd = bwd = None
    above = 0
    top = True
    for la, k in reversed(per_kind):
        if k <= 0:
            continue
        f, b = la.fwd_transient - above, la.bwd_transient - above
        if held:
            b = _held_top_run(la, k, held) if top else b + held
        top = False
        fwd = f if fwd is None else max(fwd, f)
        bwd = b if bwd is None else max(bwd, b)
        above += k * la.total
    return fwd or 0, bwd or 0


def _held_top_run(la: LayerActivations, k: int, held: int) -> int:
    """The backward working set of a chunk's top run of ``k`` layers of one kind while a received output gradient
    ``held`` is held (_chunk_activations): the top layer's steps after its residual merge (_replay_transient), and
    the layer below it, which runs its backward after the top one freed its tensors."""
    return max(_replay_transient(la, held, True), la.bwd_transient + held - la.total if k > 1 else 0)


def _kept_transients(per_kind: list[tuple[LayerActivations, int]], leaving: list[list[int]],
                     kept_by_fraction: int) -> tuple[int, int]:
    """``_mixed_transients`` of a chunk whose layers send groups of saved tensors to the host (fine-grained
    activation offloading): the forward of a layer runs before the layers above it have saved anything, and its
    backward after they freed theirs, so each layer's working set comes over the chunk's kept bytes less what the
    layers above it keep on the GPU: their saved bytes less the groups they send (``leaving``, per layer bottom to
    top, forward order), of which the chunk's last ``kept_by_fraction`` bytes stay (--activation-offload-fraction
    keeps the chunk's last groups: offload_activations.fraction_kept). Subtracting a layer's whole saved bytes, as
    without offloading, would take off bytes that are on the host, not the GPU."""
    layers = [la for la, k in per_kind for _ in range(k)]
    sent = [sum(g) for g in leaving]
    # the fraction's groups are the last ones of the chunk: give them back to the top layers first
    back = kept_by_fraction
    for i in reversed(range(len(sent))):
        if back <= 0:
            break
        b = min(back, sent[i])
        sent[i] -= b
        back -= b
    fwd = bwd = None
    above = 0
    for la, off in zip(reversed(layers), reversed(sent)):
        f, b = la.fwd_transient - above, la.bwd_transient - above
        fwd = f if fwd is None else max(fwd, f)
        bwd = b if bwd is None else max(bwd, b)
        above += la.total - off
    return fwd or 0, bwd or 0


def _replay_transient(la: LayerActivations, grad: int, top: bool) -> int:
    """A replayed layer's backward working set over its saved bytes while CheckpointFunction.backward holds the
    output gradient it was handed (``args``, until ``torch.autograd.backward(outputs, args)`` returns;
    tensor_parallel/random.py, megatron-core 0.16.1 and 0.19.2; TE 2.11 and 2.20.2's reentrant
    ``_CheckpointFunction`` alike).
    In the block's top layer that tensor is the layer's own output gradient (each step's ``G``) until its residual
    gradients merge below the pre-MLP norm (the steps releasing ``mlp_norm_input``: the merge cannot reuse the held
    tensor in place, so it makes a new one); in the layers below it, it is one more tensor at every step. A top layer
    without a pre-MLP norm (a Mamba layer, an attention-only '*' layer, a heterogeneous block with a no-op MLP) has
    one residual branch, merged at its input norm's backward, its last step (whose working set covers the merge:
    the norm's input gradient, the sum and the held tensor): the held tensor is its output gradient throughout.
    (Its steps' release sets name ``mlp_norm_input`` all the same, which it never saved.) CPU referee,
    tests/test_referee_replay.py: an attention-only top layer replayed is within 0.0003% of its backward without
    a replay plus the replayed output."""
    if not top:
        return la.bwd_transient + grad
    get = la.saved.get
    steps = []
    merged = False
    has_mlp_norm = "mlp_norm_input" in la.saved
    for names, w in la.bwd_steps:
        merged = merged or (has_mlp_norm and "mlp_norm_input" in names)
        steps.append(w - sum(get(n, 0) for n in names) + (grad if merged else 0))
    return max(steps, default=0)   # (as LayerActivations.bwd_transient)


def _replay(block: list[LayerActivations], ckpt_input: int, out: int, grad: int) -> int:
    """Backward working set of one checkpointed block (its layers bottom to top) over what the chunk holds, its
    kept input included. CheckpointFunction.backward replays the block on ``detach_variable(inputs)`` (a new
    tensor object on the same storage, no copy): the first layer's norm saves that storage again
    (``layer_input``, or ``mlp_norm_input`` after a no-op attention), so the replay adds its layers' saved bytes
    less the kept input. (With --distribute-saved-activations the kept shard is swapped for the gathered input,
    which that layer saves: the shard is what is freed.) The replayed output (``outputs``) and the handed output
    gradient (``_replay_transient``; ``grad``: 0 when the schedule holds it anyway) stay referenced until the
    block's backward has run; each layer's working set comes after the layers above it freed their tensors
    (``_mixed_transients``)."""
    # (a layer that saves nothing is an identity, heterogeneous_layer_specs.py's no-op layer: the next one saves it;
    # identities above the block's top layer hand it the held gradient itself, so it is the top one)
    first = next((la.saved for la in block if la.saved), {})
    aliased = ckpt_input if ("layer_input" in first or "mlp_norm_input" in first) else 0
    top = _top_layer(block)
    best = None
    above = 0
    for j in range(len(block) - 1, -1, -1):
        la = block[j]
        b = _replay_transient(la, grad, j >= top) - above
        best = b if best is None else max(best, b)
        above += la.total
    return above - aliased + out + (best or 0)


def _top_layer(layers: list[LayerActivations]) -> int:
    """Index of the highest layer that saves anything: the identity layers above it (a heterogeneous block with
    both halves no-op returns its input: heterogeneous_layer_specs.py, megatron-core 0.16.1 / 0.19.2) pass the
    output gradient down unchanged, no autograd node in between."""
    return max((j for j, la in enumerate(layers) if la.saved), default=len(layers) - 1)


def _keeps_replay_graph(la: LayerActivations) -> bool:
    """Whether a replayed layer's graph outlives its block's backward: an MoE layer's token dispatcher keeps a
    tensor of the routing probabilities it was handed (alltoall ``self.probs``, allgather ``self.local_probs``,
    flex ``self.token_probs``; token_dispatcher.py, megatron-core 0.16.1 and 0.19.2) until its next forward, and
    that tensor's graph reaches the AccumulateGrad of CheckpointFunction.backward's detached input: the block's kept
    input (the same storage) and its gradient (the detached input's ``.grad``) stay allocated while the blocks
    below replay (CPU referee: benchmarks/referee/replay_bottom.py)."""
    return la.moe_total > 0


def _kept_above(blocks_above: list[list[LayerActivations]], ckpt_input: int, out: int) -> int:
    """What the replayed blocks above a block (bottom to top) still hold at its replay, less the kept inputs they
    freed: each freed its kept input unless its graph is kept (_keeps_replay_graph), which also keeps its input's
    gradient, a tensor of its own but for the block right above (the gradient it hands this block, _replay)."""
    held = 0
    for j, block in enumerate(blocks_above):
        if any(_keeps_replay_graph(la) for la in block):
            held += out if j else 0
        else:
            held -= ckpt_input
    return held


def _uniform_replays(la: LayerActivations, n: int, k: int, ckpt_input: int, out: int, top_grad: int) -> int:
    """Full uniform recompute of ``n`` layers of one kind in blocks of ``k``: the top block (``n % k`` layers when
    k does not divide n; handed the gradient ``top_grad``, _replay) replays first, a full block below it after the
    top block freed its kept input (an MoE layer's block keeps it, with its gradient: _kept_above, the lowest
    block's replay the largest)."""
    top = n % k
    if _keeps_replay_graph(la) and n > k:
        groups = -(-n // k)
        first = _replay([la] * (top or k), ckpt_input, out, top_grad)
        return max(first, _replay([la] * k, ckpt_input, out, out) + _kept_above([[la]] * (groups - 1), ckpt_input, out))
    if not top:
        best = _replay([la] * k, ckpt_input, out, top_grad)
        return best if n == k else max(best, _replay([la] * k, ckpt_input, out, out) - ckpt_input)
    return max(_replay([la] * top, ckpt_input, out, top_grad), _replay([la] * k, ckpt_input, out, out) - ckpt_input)


def _block_replays(per_kind: list[tuple[LayerActivations, int]], k: int, ckpt_input: int, out: int = 0,
                   top_grad: int = 0, held: int = 0) -> int:
    """Full ``block`` recompute of a chunk (bottom to top): its backward working set over what the chunk holds. The
    first ``k`` layers are checkpointed one by one (transformer_block.py _checkpointed_forward, megatron-core 0.16.1
    and 0.19.2: ``if l < recompute_num_layers: checkpoint(custom(l, l + 1))``), keeping their input; the layers
    above keep their saved tensors. Backward runs the top layers first and frees their tensors, then each
    checkpointed layer replays its forward (its saved bytes less its kept input, ``_replay``) before its own
    backward. Composed as ``_mixed_transients``: each layer's working set (a checkpointed one's with its replay) less
    what the layers above it keep. (All k layers checkpointed: ``_mixed_replays`` of blocks of one layer.) ``held``:
    a received output gradient held through the backward (_mixed_transients), beside the unreplayed layers."""
    bwd = None
    above = 0
    layers = [la for la, n in per_kind for _ in range(n)]
    top = _top_layer(layers)
    replayed_above: list[list[LayerActivations]] = []      # the checkpointed layers above, bottom to top
    for i in range(len(layers) - 1, -1, -1):
        la = layers[i]
        replayed = i < k
        # (a checkpointed layer under unreplayed identities is handed the chunk's top gradient itself; a replayed
        # identity's checkpoint returns a copy: AccumulateGrad clones the gradient its caller still holds)
        grad = top_grad if i >= top and (i == len(layers) - 1 or k <= top + 1) else out
        b = (_replay([la], ckpt_input, out, grad) if replayed
             else _replay_transient(la, held, i >= top) if held else la.bwd_transient) - above
        if replayed:
            # (``above`` took the checkpointed layers' kept inputs as freed)
            b += _kept_above(replayed_above, ckpt_input, out) + ckpt_input * len(replayed_above)
            replayed_above.insert(0, [la])
        bwd = b if bwd is None else max(bwd, b)
        above += ckpt_input if replayed else la.total
    return bwd or 0


def _mixed_replays(per_kind: list[tuple[LayerActivations, int]], k: int, ckpt_input: int, out: int = 0,
                   top_grad: int = 0) -> int:
    """Full uniform recompute of a chunk of layers of different kinds (bottom to top) in blocks of ``k``
    (recompute.py checkpointed_forward, megatron-core 0.19.2: TransformerBlock and HybridStack alike): the
    largest block replay in backward (``_replay``: its layers' saved bytes with the working set of its layers
    over what the chunk holds), less the checkpointed inputs of the blocks above it (freed when their backward
    has run; an MoE layer's block keeps it: _kept_above)."""
    layers = [la for la, n in per_kind for _ in range(n)]
    blocks = [layers[start:start + k] for start in range(0, len(layers), k)]
    # _kept_above(blocks[i + 1:]) for every i from suffix sums (a 10,000-layer hybrid chunk checkpointed layer by
    # layer made the pairs quadratic: a minute per estimate): the block right above adds 0 or -ckpt_input, each
    # higher one out or -ckpt_input
    keeps = [any(_keeps_replay_graph(la) for la in block) for block in blocks]
    higher = [0] * (len(blocks) + 1)
    for j in range(len(blocks) - 1, -1, -1):
        higher[j] = higher[j + 1] + (out if keeps[j] else -ckpt_input)
    best = None
    for i, block in enumerate(blocks):
        above = i + 1 < len(blocks)
        kept = ((0 if keeps[i + 1] else -ckpt_input) + higher[i + 2]) if above else 0
        v = _replay(block, ckpt_input, out, out if above else top_grad) + kept
        best = v if best is None else max(best, v)
    return best or 0


def _layers_bytes(per_kind: list[tuple[LayerActivations, int]], skip: int, moe: bool = False) -> int:
    """Saved bytes of the chunk's layers above its first ``skip`` (bottom to top); ``moe``: their MoE halves'
    (the ``moe_*`` items)."""
    total = 0
    for la, k in per_kind:
        kept = max(0, k - skip)
        skip = max(0, skip - k)
        total += kept * (la.moe_total if moe else la.total)
    return total


def _chunks_detail(details: list[str]) -> str:
    """The virtual chunks' layer details, the same one given once with its count."""
    if len(details) > 1 and len(set(details)) == 1:
        return f"{len(details)} chunks of {details[0]}"
    return "; ".join(details)


def _layers_detail(per_kind: list[tuple[LayerActivations, int]], skip: int, merge: bool = False) -> str:
    """'n layers x bytes' for the layers above the first ``skip``, one part per run of a kind (``merge``: one
    part per size, for a hybrid model's alternating Mamba / attention / MLP layers)."""
    parts = []
    counts: dict[int, int] = {}
    for la, k in per_kind:
        kept = max(0, k - skip)
        skip = max(0, skip - k)
        if merge:
            counts[la.total] = counts.get(la.total, 0) + kept
        elif kept or len(per_kind) == 1:
            parts.append(f"{kept} {'layer' if kept == 1 else 'layers'} x {format_bytes(la.total)}")
    if merge:
        parts = [f"{n} {'layer' if n == 1 else 'layers'} x {format_bytes(b)}" for b, n in counts.items() if n]
    return " + ".join(parts)


# a term as (name, bytes, group, level, detail): what a stage's totals read of its buffers (_persistent_buffers);
# its Term is made when a report reads it (_terms_of)
BufferRow = tuple[str, int, str, str, str]


@lru_cache(maxsize=1024)
def _dsa_topk_holder(L: Layout, runs: tuple[tuple[LayerKind, int], ...], mtp_here: bool) -> int:
    """The top-k a chunk's DSA layers hand over under top-k sharing (--dsa-indexer-topk-freq > 1): one per computing
    layer, its MTP depths' included (layers/dsa.py topk_holder_bytes); 0 without sharing."""
    if L.dsa_indexer_topk_freq <= 1:
        return 0
    n = sum(k for kind, k in runs if kind.mixer == MIXER_DSA)
    if mtp_here:
        n += mtp_layers_built(L) * sum(k for kind, k in mtp_stack_runs(L) if kind.mixer == MIXER_DSA)
    return _dsa.topk_holder_bytes(L, n) if n else 0


@lru_cache(maxsize=1024)
def _persistent_buffers(L: Layout, last: bool, receiving: int, stage_runs: tuple = (), mtp_here: bool | None = None,
                        received: int | None = None, input_folds: tuple[int, ...] = (),
                        moe_first_received: int = 0, batch_chunks: tuple[bool, ...] = ()) -> tuple[BufferRow, ...]:
    """Buffers created on first use and kept: megatron's GlobalMemoryBuffer, cached rotary tables, the
    retained pipeline inputs. ``receiving``: the stage's chunks that get their input from a previous stage;
    ``stage_runs``: the kind runs of each of its chunks (the mixer's rotary tables: MLA keeps one per layer);
    ``mtp_here``: it runs the MTP block (None: the last stage); ``received``: the activations its receiving chunks
    get, in [s/CP, b, h] units (None: ``receiving``; after a standalone MTP stage 1 + D each); ``input_folds``: the
    length of each of its chunks' inputs in sequences (1; 1 + D on a chunk after a standalone MTP stage; (): 1 each);
    ``moe_first_received``: its receiving chunks whose received input is the input of an MoE layer whose dispatcher
    keeps that input under the combined 1F1B schedule (_moe_buffers); ``batch_chunks``: whether each of its chunks
    reads the batch (the attention mask DSA top-k sharing hangs its top-k on; the others hang them on the config).

    megatron's own linear layers all-gather their sequence-parallel input into the GlobalMemoryBuffer
    ("mpu"), and its DotProductAttention takes the baddbmm input buffer [b*a, s, s] from the same
    entry; the buffer grows to the largest request and stays. With TE layers only the output layer
    (a megatron ColumnParallelLinear, on the last stage) uses it; TE gathers into temporaries. The entry is
    made on first use only (global_vars / parallel_state GlobalMemoryBuffer.get_tensor, megatron-core 0.16.1 and
    0.19.2): a stage without decoder or MTP layers (a loss-only stage such as the last of 'Et|L') has no
    attention to ask for the score buffer, and without sequence parallelism nothing else asks."""
    x = shapes(L)
    rows: list[BufferRow] = []
    sizes = []
    mtp = (last if mtp_here is None else mtp_here) and bool(getattr(L, "mtp_num_layers", 0))
    layers_here = any(n for runs in stage_runs for _, n in runs)
    if L.sequence_parallel and (last or L.transformer_impl == "local" and (layers_here or mtp)):
        sizes.append(x.Tf * x.h * x.e)          # all-gather of the sequence-parallel input
    cores = (MIXER_ATTENTION, MIXER_MLA)        # the mixers with a core attention
    attention_here = (mtp and any(kind.mixer in cores for kind, _ in mtp_stack_runs(L))
                      or any(n for runs in stage_runs for kind, n in runs if kind.mixer in cores))
    if attention_here and attention_kind(L).startswith("local"):
        sizes.append(x.b * x.a_t * x.s * x.s * x.e)  # baddbmm input buffer of megatron's attention
    if sizes:
        rows.append(("global_memory_buffer", max(sizes), "transients", "allocated",
                     "megatron's GlobalMemoryBuffer 'mpu': the larger of the SP all-gather and the attention score buffer"))
    if L.pp > 1 and receiving:
        # TransformerBlock.set_input_tensor keeps the last received activation of each chunk, and
        # with it its gradient (.grad, retained by the schedule), until that chunk's next input
        # arrives: two activation-sized tensors per receiving chunk after the schedule (measured by
        # the CPU referee on every pipeline rank past the first). During the schedule a chunk's pair
        # exists only before its first forward and after its last backward (_simulate).
        rows.append(("pipeline_inputs_retained", 2 * (receiving if received is None else received) * p2p_tensor_bytes(L),
                     "transients", "allocated",
                     f"last received input and its gradient of {receiving} chunk(s), kept by TransformerBlock.input_tensor"))
    if L.moe is not None:
        n_moe = sum(n for runs in stage_runs for kind, n in runs if kind.mlp == MLP_MOE)
        if (last if mtp_here is None else mtp_here) and L.mtp_num_layers:
            # MoE MTP layers have their own dispatchers (one depth's when repeated)
            n_moe += mtp_layers_built(L) * sum(k for kind, k in mtp_stack_runs(L) if kind.mlp == MLP_MOE)
        rows = _moe_buffers(L, rows, n_moe, moe_first_received * p2p_tensor_bytes(L))
    uniform = uniform_kind(L)
    mixer = uniform.mixer
    layers = sum(n for runs in stage_runs for kind, n in runs if kind.mixer == mixer)
    shared = sum(n for runs in stage_runs for kind, n in runs if kind.mixer == MIXER_DSA_SHARED)
    rotary = mixer_recipe(uniform).rotary_cache(L, layers, shared) if shared else mixer_recipe(uniform).rotary_cache(L, layers)
    folds = input_folds or (1,) * len(stage_runs)
    if rotary and mixer == MIXER_ATTENTION and sum(folds) > 1:
        # each model chunk is a GPTModel with its own RotaryEmbedding, whose forward's lru_cache is keyed on the
        # instance too (models/common/embeddings/rotary_pos_embedding.py, megatron-core 0.16.1 and 0.19.2): one table
        # per chunk under VPP (CPU referee moe_pp2_vpp2_a2a_overlap: two [s, 32] fp32 tables per rank after the step),
        # as long as the chunk's input (get_rotary_seq_len reads transformer.input_tensor.size(0)): (1 + D) s after a
        # standalone MTP stage. The MTP block makes none of its own: GPTModel hands it the chunk's table
        # (MultiTokenPredictionBlock.forward's rotary_pos_emb, 0.16.1 and 0.19.2)
        rotary = (rotary[0] * sum(folds), rotary[1] + f", one per model chunk ({len(folds)})"
                  + (f" of inputs {', '.join(f'{k} s' for k in folds)}" if set(folds) != {1} else ""))
    if rotary:
        rows.append(("rotary_cache", rotary[0], "transients", "allocated", rotary[1]))
    if mixer == MIXER_ATTENTION:
        from .layers.attention import flex_block_masks
        masks = flex_block_masks(L, layers)
        if masks:
            rows.append(("flex_block_masks", masks[0], "transients", "allocated", masks[1]))
    if L.dsa_indexer_topk_freq > 1:
        # the chunks whose forward has no attention mask hang the shared top-k on the TransformerConfig: each computing
        # layer's latest top-k stays there (DSAttention._get_index_share_carrier, dsa.py 0.19.2)
        batch = batch_chunks or (False,) * len(stage_runs)
        mtp = (last if mtp_here is None else mtp_here)
        held = sum(_dsa_topk_holder(L, runs, mtp and i == len(stage_runs) - 1) for i, (runs, b) in
                   enumerate(zip(stage_runs, batch)) if not (b and L.create_attention_mask_in_dataloader))
        if held:
            rows.append(("dsa_topk_holder", held, "transients", "allocated",
                         "the latest top-k of each DSA layer computing one, kept on the config for the layers reusing "
                         "it (--dsa-indexer-topk-freq)"))
    return tuple(rows)


@lru_cache(maxsize=256)
def _moe_layer_buffers(L: Layout) -> tuple[int, int, int]:
    """Per MoE layer: the dispatcher's held state and the router's buffers; and the allgather
    dispatcher's GlobalMemoryBuffer request (the same on every stage)."""
    from .layers import moe
    return moe.held_bytes(L), moe.router_buffer_bytes(L.moe), moe.global_buffer_request(L, L.moe)


def _moe_buffers(L: Layout, rows: list[BufferRow], n_moe: int, shared: int = 0) -> list[BufferRow]:
    """What MoE layers keep between iterations: their dispatchers' state, the routers' fp32 buffers,
    and the allgather dispatcher's request of the GlobalMemoryBuffer (the entry keeps the largest). ``shared``:
    bytes of the held state that are received inputs, counted with pipeline_inputs_retained."""
    if not n_moe:
        return rows
    per_layer, router, gb = _moe_layer_buffers(L)
    held = per_layer * n_moe
    if held:
        detail = (f"routing maps and probs the token dispatchers of {n_moe} MoE layer(s) keep until the layer's next "
                  "forward")
        if shared:
            # combined 1F1B: the held probs' graph ends in the first layer's detached input (held_bytes), which on a
            # receiving chunk is a view of the received tensor TransformerBlock keeps (ScheduleNode._forward detaches
            # without a copy, megatron-core 0.16.1 and 0.19.2); its gradient is a tensor of its own, apart from the
            # received tensor's .grad, which AccumulateGrad clones (CPU referee moe_pp2_vpp2_a2a_overlap: 3, not 4,
            # [s, b, h] tensors per receiving chunk after the step)
            held -= shared
            detail += f", less {format_bytes(shared)} of received inputs counted with pipeline_inputs_retained"
        rows.append(("moe_dispatcher_state", held, "transients", "allocated", detail))
    rb = router * n_moe
    if rb:
        rows.append(("moe_router_buffers", rb, "weights", "allocated",
                     f"fp32 expert-bias / token-count buffers of {n_moe} router(s)"
                     + (" (quantile balancing's qb_beta, qb_beta_accum, qb_beta_count)"
                        if L.moe is not None and L.moe.moe_router_load_balancing_type == "quantile_balancing" else "")))
    old = next((r for r in rows if r[0] == "global_memory_buffer"), None)
    if gb and (old is None or old[1] < gb):
        rows = [r for r in rows if r[0] != "global_memory_buffer"]
        rows.insert(0, ("global_memory_buffer", gb, "transients", "allocated",
                        "megatron's GlobalMemoryBuffer 'mpu': the MoE allgather dispatcher's gathered tokens "
                        "[T x ETP x EP, h]"))
    return rows


def _moe_first_received(L: Layout, receiving: list[int], stage_runs: tuple) -> int:
    """The chunks whose received [s/CP, b, h] input is the input of a first MoE layer whose alltoall dispatcher keeps
    it under the combined 1F1B schedule (--overlap-moe-expert-parallel-comm; layers.moe.held_bytes)."""
    m = L.moe
    if m is None or not m.overlap_moe_expert_parallel_comm or m.moe_token_dispatcher_type != "alltoall":
        return 0
    n = 0
    for r, runs in zip(receiving, stage_runs):
        first = next((kind for kind, k in runs if k), None)
        n += r == 1 and first is not None and first.mlp == MLP_MOE
    return n


def _terms_of(rows: tuple[BufferRow, ...] | list[BufferRow]) -> tuple[Term, ...]:
    """The Term of each (name, bytes, group, level, detail) row."""
    return tuple([Term(*r) for r in rows])


def _schedule_bytes(L: Layout, acts: list[ChunkActivations], receiving: list[bool],
                    solo: Callable[[], tuple] | None = None) -> tuple | None:
    """What the interleaved schedule's peak needs of a stage's chunks (None: one chunk, 1F1B): per chunk
    the bytes a micro-batch keeps, the forward's transient, the backward's at its start and at its end
    (its own micro-batch released), the larger of the two, the retained pipeline inputs, and whether the
    chunks are alike (one cached object: the middle of a pipeline). ``receiving``: which chunks get their
    input from a previous stage."""
    if len(acts) == 1:
        return None
    # the pipeline's own tensors at a pass (retained pairs, queued inputs and gradients) depend on the pass:
    # _simulate counts them at the peak from each chunk's received folds (schedule.p2p_tensors_at)
    retained = tuple([int(r) for r in receiving])
    sizes: list[int] = []
    fwd: list[int] = []
    top: list[int] = []
    bottom: list[int] = []
    larger: list[int] = []
    for a in acts:
        held = a.held
        t, b = a.bwd_top_extra, a.bwd_bottom_extra - held
        sizes.append(held)
        fwd.append(a.fwd_extra)
        top.append(t)
        bottom.append(b)
        larger.append(t if t >= b else b)
    # (solo: the combined 1F1B schedule's backwards without a forward beside them, made when a peak needs them)
    return sizes, fwd, top, bottom, larger, retained, all([a is acts[0] for a in acts]), solo


@lru_cache(maxsize=256)
def _solo_backwards(L: Layout, chunk_args: tuple) -> tuple[tuple[int, ...], ...]:
    """The combined 1F1B schedule's backwards that no forward runs beside (_without_paired_forward), per chunk made
    from its _chunk_activations arguments ``chunk_args``: the backward's top and bottom (as _schedule_bytes gives
    them), the larger of the two, and its bottom working set."""
    alone_L = _without_paired_forward(L)
    acts = [_chunk_activations(alone_L, *a) for a in chunk_args]
    top = tuple([a.bwd_top_extra for a in acts])
    bottom = tuple([a.bwd_bottom_extra - a.held for a in acts])
    return top, bottom, tuple([x if x >= y else y for x, y in zip(top, bottom)]), tuple([a.bwd_bottom_extra for a in acts])


def _without_paired_forward(L: Layout) -> Layout | None:
    """The layout whose layers' backward has no forward layer beside it, for the combined 1F1B schedule's backwards
    that run alone (None: not that schedule under PP). TransformerModelChunkSchedulePlan.run pairs a backward layer
    with a forward layer only in a steady step; a cool-down backward (and every backward when the warm-up takes all
    forwards) runs its layers by themselves (megatron-core 0.16.1 and 0.19.2 model_chunk_schedule_plan.py; CPU
    referee moe_pp2_vpp2_a2a_overlap*: such backwards of a chunk without the loss peak 1.9-2.9 MiB above their start,
    against 3.25 MiB alone and 9.78 MiB paired). Without pipelining only a single micro-batch's backward matters: it is
    the last one, which combined_1f1b_schedule_for_no_pipelining runs with no forward model (combined_1f1b.py, 0.16.1
    and 0.19.2); with more micro-batches the paired steps before it are larger."""
    m = L.moe
    if m is None or not m.overlap_moe_expert_parallel_comm or L.pp == 1 and L.num_microbatches > 1:
        return None
    # ('moe' recompute stays off: the combined schedule never runs the checkpointed MoELayer.forward)
    return replace(L, moe=replace(m, overlap_moe_expert_parallel_comm=False)).replace(
        recompute_modules=tuple([x for x in L.recompute_modules if x != "moe"]))


def _runs_alone(pp: int, vpp: int, m: int, group: int, pp_rank: int, receiving: tuple, overlap: bool,
                probe: tuple) -> bool:
    """Whether the combined 1F1B schedule's backward ``probe`` has no forward after it in the same step (a cool-down
    backward, or any when the warm-up takes every forward)."""
    passes = walk_passes(pp, vpp, m, group, pp_rank, receiving, overlap, True)
    # (a pass is its direction, chunk and ordinal: the held counts follow)
    i = next(i for i, p in enumerate(passes) if p[:3] == (probe[0], probe[1], probe[3]))
    return i == len(passes) - 1 or not passes[i + 1][0]


@lru_cache(maxsize=1024)
def _combined_walk_peak(pp: int, vpp: int, m: int, group: int, pp_rank: int, receiving: tuple, overlap: bool,
                        sizes: tuple, fwd_extra: tuple, bwd_extra: tuple, bwd_alone: tuple,
                        t: int) -> tuple[int, int, tuple, bool]:
    """schedule.p2p_walk_peak with a backward that no forward follows in the same step (cool-down, or all of them
    when the warm-up takes every forward) given ``bwd_alone`` instead of ``bwd_extra``: (the first pass with the
    most held bytes + transient + pipeline tensors, the pipeline tensors' bytes, its probe, whether it is such a
    backward)."""
    walk = walk_passes(pp, vpp, m, group, pp_rank, receiving, overlap, True)
    best, retained, i, solo = walk_peak(walk, vpp, sizes, fwd_extra, bwd_extra, t, bwd_alone)
    fwd, c, nth, _ = walk[i]
    return best, retained, (fwd, c, walk_held(walk, vpp, i), nth), solo


@lru_cache(maxsize=1024)
def _p2p_peak(pp: int, vpp: int, m: int, group: int, pp_rank: int, receiving: tuple, overlap: bool, sizes: tuple,
              fwd_extra: tuple, bwd_extra: tuple, t: int) -> tuple[int, int, tuple]:
    """The first pass of schedule.p2p_probes with the most held bytes plus pipeline tensors: (held bytes with the
    pass's transient, the pipeline tensors' bytes, its probe)."""
    got = p2p_peak(pp, vpp, m, group, pp_rank, receiving, overlap, sizes, fwd_extra, bwd_extra, t)
    if got is not None:                     # (the units counted only where they can still decide)
        return got[0] - got[1], got[1], got[2]
    best, retained, probe = -1, 0, None
    for p, units in p2p_probes(pp, vpp, m, group, pp_rank, receiving, overlap):
        v = sum(map(mul, p[2], sizes)) + (fwd_extra if p[0] else bwd_extra)[p[1]] + t * units
        if v > best:
            best, retained, probe = v, t * units, p
    return best - retained, retained, probe


def _simulate(L: Layout, pp_rank: int, acts: tuple[ChunkActivations, ...] | list[ChunkActivations],
              sched: tuple | None) -> tuple[int, str, int, dict[str, int]]:
    """The schedule's peak; return (activation peak, phase, in-flight count, terms at the peak).
    ``sched``: _schedule_bytes of the chunks (None for a single chunk).

    The interleaved schedule is evaluated at the passes where the held bytes plus the schedule's own tensors can
    first peak (schedule.p2p_peak; the combined 1F1B one pass by pass, schedule.p2p_walk_peak), which give the
    peak, pass and counts a replay of every pass gives (tests/test_schedule_p2p.py)."""
    if sched is None:
        return _peak_one_chunk(L, pp_rank, acts[0])
    sizes, fwd_extra, top_extra, bottom_extra, bwd_extra, receiving, alike, solo = sched
    # --overlap-moe-expert-parallel-comm runs the combined 1F1B schedule (schedule.py)
    combined = L.moe is not None and L.moe.overlap_moe_expert_parallel_comm
    group = L.microbatch_group_size_per_vp_stage or L.pp
    t = p2p_tensor_bytes(L)
    bottom_at = None                        # the backward's bottom working set per chunk at the peak (None: acts')
    if combined:
        # the combined 1F1B schedule's passes walked one by one with its own tensors (schedule.walk_passes)
        best, retained, probe = p2p_walk_peak(L.pp, L.vpp, L.num_microbatches, group, pp_rank, receiving,
                                              L.overlap_p2p_comm, True, tuple(sizes), tuple(fwd_extra),
                                              tuple(bwd_extra), t)
        if not probe[0] and solo is not None and _runs_alone(L.pp, L.vpp, L.num_microbatches, group, pp_rank,
                                                             receiving, L.overlap_p2p_comm, probe):
            # a peak at a backward no forward runs beside: walked again with such backwards at their own working set,
            # never larger (a forward or paired peak stays the first largest pass without the walk)
            bs = solo()
            best, retained, probe, alone = _combined_walk_peak(L.pp, L.vpp, L.num_microbatches, group, pp_rank,
                                                               receiving, L.overlap_p2p_comm, tuple(sizes),
                                                               tuple(fwd_extra), tuple(bwd_extra), bs[2], t)
            if alone:
                top_extra, bottom_extra, bottom_at = bs[0], bs[1], bs[3]
        best -= retained
    else:
        # the held bytes plus the pipeline's own tensors at each pass that can peak (schedule.p2p_probes)
        best, retained, probe = _p2p_peak(L.pp, L.vpp, L.num_microbatches, group, pp_rank, receiving,
                                          L.overlap_p2p_comm, tuple(sizes), tuple(fwd_extra), tuple(bwd_extra), t)
    in_flight = peak_in_flight(L.pp, L.vpp, L.num_microbatches, group, pp_rank, combined)
    fwd, ci, counts, nth = probe
    best += retained
    held = list(counts)
    if fwd:
        where, extra = "forward", fwd_extra[ci]
    elif top_extra[ci] >= bottom_extra[ci]:
        where, extra = "backward", top_extra[ci]
    else:                                   # its own micro-batch already released
        where, extra = "end of backward", acts[ci].bwd_bottom_extra if bottom_at is None else bottom_at[ci]
        held[ci] -= 1
    n = sum(held)
    phase = f"{where} of micro-batch {nth}, chunk {ci} ({n} held)"
    a = acts[0]
    if alike:                               # chunks alike (the middle of a pipeline): n micro-batches of one
        moe, layers = n * a.moe_layers, n * a.layers
        parts: dict[str, int] = {"layer_activations": layers - moe}
        if moe:
            parts["moe_layer_activations"] = moe
        if n:
            for k, v in a.ends.items():
                parts[k] = n * v
    else:
        moe = layers = 0
        for h, a in zip(held, acts):
            moe += h * a.moe_layers
            layers += h * a.layers
        parts = {"layer_activations": layers - moe}
        if moe:
            parts["moe_layer_activations"] = moe
        for h, a in zip(held, acts):
            if h:
                for k, v in a.ends.items():
                    parts[k] = parts.get(k, 0) + h * v
    parts["forward_transient" if fwd else "backward_transient"] = extra
    if retained:
        parts["pipeline_inputs_retained"] = retained
    return best, phase, in_flight, parts


def _peak_one_chunk(L: Layout, pp_rank: int, a: ChunkActivations) -> tuple[int, str, int, dict[str, int]]:
    """1F1B / no pipelining in closed form: k = min(PP - rank, m) micro-batches in flight at most; the
    peak is the k-th forward, the first backward's start, or its end (embedding weight gradient).

    On a receiving stage, 1F1B's locals keep the last backward's micro-batch alive a little longer
    (schedules.py forward_backward_pipelining_without_interleaving): its output, whose graph reaches the
    AccumulateGrad of its received input, until the next forward_step returns (the input and its
    gradient: two [s/CP, b, h] tensors), and its input gradient (input_tensor_grad) until the next
    backward_step returns (one). Both overlap passes with k micro-batches held only when a steady-state
    forward follows a backward, i.e. m >= warm-up + 2."""
    k = min(L.pp - pp_rank, L.num_microbatches)
    warm = min(L.pp - pp_rank - 1, L.num_microbatches)
    t = p2p_tensor_bytes(L) if pp_rank > 0 and L.num_microbatches >= warm + 2 else 0
    if t and after_mtp(L, pp_rank, 0):
        t *= 1 + L.mtp_num_layers       # mtp_standalone: its input is the (1 + D)-fold concatenation
    cands = [
        (k * a.held + a.fwd_extra + 2 * t, "forward", k, "forward_transient", a.fwd_extra, 2 * t),
        (k * a.held + a.bwd_top_extra + t, "backward", k, "backward_transient", a.bwd_top_extra, t),
        ((k - 1) * a.held + a.bwd_bottom_extra, "end of backward", k - 1, "backward_transient", a.bwd_bottom_extra, 0),
    ]
    best = max(cands, key=lambda c: c[0])
    peak, where, held, name, extra, kept = best
    mb = k if where == "forward" else 1
    if kept:
        mb = k + 1 if where == "forward" else 2   # the first pass with k held after an earlier backward
    parts: dict[str, int] = {"layer_activations": held * (a.layers - a.moe_layers)}
    if held * a.moe_layers:
        parts["moe_layer_activations"] = held * a.moe_layers
    for key, v in a.ends.items():
        parts[key] = held * v
    parts[name] = extra
    if kept:
        parts["pipeline_inputs_retained"] = kept
    return peak, f"{where} of micro-batch {mb} ({held} held)", k, parts


_END_GROUPS = {
    "loss_softmax_fp32": "logits_loss", "loss_targets": "logits_loss", "final_logit_softcap": "logits_loss",
    "final_norm_input": "activations", "final_norm_stats": "activations", "output_layer_input": "activations",
    "pipeline_inputs_retained": "transients",
    "mtp_block_activations": "activations", "mtp_received_hidden": "activations", "mtp_loss_buffers": "logits_loss", "offload_staging": "transients",
    "offload_pp_balance_kept": "activations",
    "fsdp_unsharded_parameters": "transients", "fsdp_unsharded_gradients": "transients",
}
# the parts at a schedule peak that _part_terms describes (with FSDP, its windows too); the others' terms
# have no detail
_DETAILED_PARTS = frozenset({"layer_activations", "moe_layer_activations", "mtp_block_activations", "mtp_loss_buffers",
                             "mtp_received_hidden",
                             "offload_staging", "offload_pp_balance_kept", "pipeline_inputs_retained"})


def _state_rows(L: Layout, st: StageStates) -> tuple[tuple[tuple[str, int, str], ...], tuple[tuple[str, int, str], ...]]:
    """(name, bytes, group) of a stage's model-state terms and of the terms the optimizer step adds: what its
    totals need (the Term objects, with their details, are made from them when a report reads them:
    _state_terms)."""
    state = [("parameters", st.param_bytes, "weights"), ("gradient_buffer", st.grad_bytes, "gradients")]
    if st.main_param_bytes:
        state.append(("main_parameters", st.main_param_bytes, "optimizer"))
    # 16-bit gradients are copied to fp32 for the step (main_grad.float()); the copies stay attached as .grad
    # of the main params until zero_grad at the start of the next iteration, so they count after the step but
    # not during forward and backward.
    step = (("main_grad_copies", st.main_grad_copy_bytes, "optimizer"),) if st.main_grad_copy_bytes else ()
    if L.optimizer == "adam":
        state.append(("adam_exp_avg", st.exp_avg_bytes, "optimizer"))
        state.append(("adam_exp_avg_sq", st.exp_avg_sq_bytes, "optimizer"))
    else:
        state.append(("sgd_momentum", st.exp_avg_bytes, "optimizer"))
    return tuple(state), step


def _state_detail(L: Layout, st: StageStates, name: str) -> str:
    shard = f" / {L.dp_shard_size} (distributed optimizer)" if L.use_distributed_optimizer else ""
    if name == "parameters":
        return f"{st.parameters:,} params x {L.param_bytes} B" + (" (padded param buffer)" if L.use_distributed_optimizer else "")
    if name == "gradient_buffer":
        return f"{st.buffer_numel:,} elements x {L.grad_bytes} B ({st.buffer_numel - st.buffer_numel_unpadded:,} padding)"
    if name == "fp32_local_main_grads":
        pats = " ".join(L.ddp_param_name_patterns_for_fp32_local_accumulation)
        return ("fp32 main_grad of each parameter matching --ddp-param-name-patterns-for-fp32-local-accumulation "
                f"({pats[:80]}), next to its slot in the 16-bit gradient buffer; the step's fp32 copies still count "
                "them (errs high)")
    return {"main_parameters": "fp32 master weights", "main_grad_copies": "fp32 copies of 16-bit gradients, from the "
            "step until the next zero_grad", "adam_exp_avg": f"{L.exp_avg_dtype} first moment",
            "adam_exp_avg_sq": f"{L.exp_avg_sq_dtype} second moment", "sgd_momentum": "fp32 momentum"}[name] + shard


@lru_cache(maxsize=1024)
def _state_terms(L: Layout, st: StageStates) -> tuple[tuple[Term, ...], tuple[Term, ...]]:
    """Model-state terms of a stage and the terms the optimizer step adds (shared by the stages whose
    states are equal: the middle of a pipeline), from _state_rows."""
    state, step = _state_rows(L, st)
    return _state_row_terms(L, st, state), _state_row_terms(L, st, step)


def _state_row_terms(L: Layout, st: StageStates, rows: tuple[tuple[str, int, str], ...]) -> tuple[Term, ...]:
    """The Term of each of _state_rows' rows (each detail made when read: a report that lists the terms without
    their details does not format them)."""
    return tuple([Term(n, b, g, _ALLOCATED, partial(_state_detail, L, st, n)) for n, b, g in rows])


@lru_cache(maxsize=256)
def _peft_state_terms(L: Layout, pp_rank: int, base_params: int) -> tuple[tuple[Term, ...], tuple[Term, ...]]:
    """PEFT's model-state terms of a stage and those its optimizer step adds (estimator/peft.py)."""
    from .peft import stage_peft_states, state_rows
    rows, step = state_rows(L, stage_peft_states(L, pp_rank, base_params))
    return (tuple(Term(n, b, g, _ALLOCATED, d) for n, b, g, d in rows),
            tuple(Term(n, b, g, _ALLOCATED, d) for n, b, g, d in step))


def _fp8_state_terms(L: Layout, chunks, gpu_name: str | None, state_terms: tuple[Term, ...]) -> tuple[Term, ...]:
    """FP8 / FP4: the weight terms of estimator.fp8_layers after the parameters, whose buffer holds primary
    quantized GEMM weights in 1 byte (1/2 for NVFP4; none for MXFP8, whose all-gather uses the gradient
    buffer)."""
    from .fp8_layers import stage_terms
    saving, extra = stage_terms(L, chunks, gpu_name)
    out: list[Term] = []
    for t in state_terms:
        if t.name == "parameters" and saving:
            t = replace(t, bytes=t.bytes - saving, detail=t.detail + f"; primary {L.fp8_spec.recipe} GEMM weights: "
                                                                      f"{saving:,} B less in the uint8 buffer")
        out.append(t)
    # after the last weights term (DDP's parameters, or Megatron-FSDP's weight buffers)
    at = max((i + 1 for i, t in enumerate(out) if t.group == "weights"), default=0)
    return tuple(out[:at] + list(extra) + out[at:])


@dataclass(frozen=True)
class _StageShape:
    """What a stage's schedule-independent terms depend on (``key``); equal keys share one _StagePrep.
    ``pp_rank``: the rank it was first built for (not compared)."""

    key: tuple
    pp_rank: int = field(compare=False)

    def __init__(self, key: tuple, pp_rank: int) -> None:
        d = self.__dict__   # one per stage of every cold estimate
        d["key"] = key
        d["pp_rank"] = pp_rank

    def __hash__(self) -> int:
        # the key nests every chunk's layer kinds; hashed once, it keys _stage_prep on every stage
        h = self.__dict__.get("_h")
        if h is None:
            h = hash(self.key)
            object.__setattr__(self, "_h", h)
        return h


@lru_cache(maxsize=256)
def _stage_shapes(L: Layout) -> tuple[_StageShape, ...]:
    """Each stage's shape. The middle stages of a deep pipeline share their chunk shapes, hence their states,
    buffers and fixed terms: only the schedule differs. FP8/FP4 (first/last layers in bf16), FSDP, Muon and
    look at the chunks' positions, so they are keyed by rank."""
    if (L.fp8 or L.fp4 or L.optimizer in EMERGING_OPTIMIZERS or fsdp_enabled(L)
            or (L.peft is not None and L.peft.layers is not None)):
        # (NeMo 1's LoRA layer_selection: a stage's adapters follow the layer numbers it holds)
        return tuple([_StageShape((r,), r) for r in range(L.pp)])
    by_stage, last = L._chunks_by_stage, L.pp - 1
    # bucket_size_for: None but for the first chunk of rank 0 with --overlap-grad-reduce
    first_bucket = bucket_size_for(L, by_stage[0][0]) if L.pp and by_stage.get(0) else None
    # stages with equal keys get the same object: later lookups (estimate's preps, _stage_prep's cache) match
    # it by identity instead of comparing the nested keys
    made: dict[tuple, _StageShape] = {}
    out = []
    mtp = getattr(L, "mtp_num_layers", 0)
    for r in range(L.pp):
        # a chunk's shape is its kind runs (they give its layer count) and, on the first and the last rank, its
        # embedding, output and tied copy (partition_layers: the first chunk of rank 0, the last of the last rank);
        # with MTP, which chunk builds the final norm (the chunk of the last decoder layer, maybe a middle stage's)
        cs = by_stage.get(r, ())
        key = (tuple([c.kind_runs for c in cs]), r == 0, r == last, first_bucket if r == 0 else None,
               tuple([(holds_final_norm(L, c), holds_mtp(L, c), after_mtp(L, c.pp_rank, c.vpp_rank)) for c in cs])
               if mtp else None)
        shape = made.get(key)
        if shape is None:
            shape = made[key] = _StageShape(key, r)
        out.append(shape)
    return tuple(out)


@dataclass(frozen=True)
class _StagePrep:
    """The terms of a stage that do not depend on where its schedule peaks."""

    parameters: int
    n_layers: int
    has_output: bool
    has_moe: bool              # a MoE layer on the stage (for its worst-case figure)
    acts: tuple[ChunkActivations, ...]
    sched: tuple | None        # _schedule_bytes
    ft: object
    state_terms: tuple[Term, ...]   # (these two may be given as functions making them: made when first read)
    step_terms: tuple[Term, ...]
    host_terms: tuple[Term, ...]
    host_bytes: int            # activation offloading: host bytes per micro-batch in flight
    buffers: tuple[Term, ...]        # (given as functions making them from _persistent_buffers' rows)
    retained: tuple[Term, ...]
    staging: int
    deferred: int
    fixed_alloc: tuple[Term, ...]
    device_only: tuple[Term, ...]  # device-level fixed terms (CUDA context, NCCL), outside the allocator
    device_bytes: int
    frag_detail: Callable[[], str]   # (the allocator term's detail, made when a report reads it)
    layers_detail: str               # (given as a function making it: made at its first read)
    base: int                  # state + buffers + fixed allocated terms (before CUDA graph terms)
    step_bytes: int
    finalize: int
    retained_bytes: int
    plain: bool                # none of the features whose terms follow the peak (FSDP, offloading, CUDA graphs, Muon)

    def __init__(self, parameters: int, n_layers: int, has_output: bool, has_moe: bool,
                 acts: tuple[ChunkActivations, ...], sched: tuple | None, ft: object,
                 state_terms: tuple[Term, ...] | Callable[[], tuple[Term, ...]],
                 step_terms: tuple[Term, ...] | Callable[[], tuple[Term, ...]], host_terms: tuple[Term, ...],
                 host_bytes: int, buffers: Callable[[], tuple[Term, ...]],
                 retained: Callable[[], tuple[Term, ...]], staging: int, deferred: int, fixed_alloc: tuple[Term, ...],
                 device_only: tuple[Term, ...], device_bytes: int, frag_detail: Callable[[], str],
                 layers_detail: Callable[[], str], base: int,
                 step_bytes: int, finalize: int, retained_bytes: int, plain: bool) -> None:
        # one per stage shape of every cold estimate: the fields are stored directly (as Term's)
        d = self.__dict__
        d["parameters"] = parameters
        d["n_layers"] = n_layers
        d["has_output"] = has_output
        d["has_moe"] = has_moe
        d["acts"] = acts
        d["sched"] = sched
        d["ft"] = ft
        # the state and step terms may come as functions making them (_stage_prep's common case): made when
        # first read (_MadeAtFirstRead)
        d["state_terms" if state_terms.__class__ is tuple else "_make_state_terms"] = state_terms
        d["step_terms" if step_terms.__class__ is tuple else "_make_step_terms"] = step_terms
        d["host_terms"] = host_terms
        d["host_bytes"] = host_bytes
        d["_make_buffers"] = buffers        # (functions making them: made when first read)
        d["_make_retained"] = retained
        d["staging"] = staging
        d["deferred"] = deferred
        d["fixed_alloc"] = fixed_alloc
        d["device_only"] = device_only
        d["device_bytes"] = device_bytes
        d["frag_detail"] = frag_detail
        d["_make_layers_detail"] = layers_detail
        d["base"] = base
        d["step_bytes"] = step_bytes
        d["finalize"] = finalize
        d["retained_bytes"] = retained_bytes
        d["plain"] = plain


_StagePrep.layers_detail = _MadeAtFirstRead("layers_detail", "")  # type: ignore[assignment]
_StagePrep.state_terms = _MadeAtFirstRead("state_terms", ())  # type: ignore[assignment]
_StagePrep.step_terms = _MadeAtFirstRead("step_terms", ())  # type: ignore[assignment]
_StagePrep.buffers = _MadeAtFirstRead("buffers", ())  # type: ignore[assignment]
_StagePrep.retained = _MadeAtFirstRead("retained", ())  # type: ignore[assignment]


@lru_cache(maxsize=1024)
def _stage_prep(L: Layout, shape: _StageShape, device: str, gpu_name: str | None, dp_rank: int | str,
                site: SiteConstants, expert_dp_rank: int | None = None) -> _StagePrep:
    pp_rank = shape.pp_rank
    st = stage_states(L, pp_rank, dp_rank, expert_dp_rank)
    chunks = L.stage_chunks(pp_rank)
    # what the stage needs of its chunks, in one pass (a stage has a few chunks)
    n_layers, has_output, final_norm = 0, False, False
    acts: list[ChunkActivations] = []
    runs_of: list[tuple[tuple[LayerKind, int], ...]] = []
    # per chunk, the input it gets from a previous stage, in [s/CP, b, h] units: 0 (the first chunk), 1, or 1 + D
    # after a standalone MTP stage (the (1 + D)-fold hidden states it sends on)
    receiving: list[int] = []
    batch_of: list[bool] = []                 # per chunk, whether it reads the batch (pretrain_gpt.py get_batch)
    mtp_here = False                          # the stage runs the MTP block
    depths = getattr(L, "mtp_num_layers", 0) or 0
    chunk_args: list[tuple] = []
    for c in chunks:
        n_layers += c.num_layers
        has_output = has_output or c.has_output
        norm_here = holds_final_norm(L, c)    # the chunk runs the decoder's final norm
        final_norm = final_norm or norm_here
        runs_of.append(c.kind_runs)
        first = c.pp_rank == 0 and c.vpp_rank == 0
        # (a chunk before the loss's receives its output gradient: a tensor of its own but on a GPU)
        held_grad = device != "gpu" and not c.has_output
        if depths:
            chunk_mtp = holds_mtp(L, c)
            mtp_here = mtp_here or chunk_mtp
            args = (c.kind_runs, c.has_embedding, c.has_output, norm_here, chunk_mtp, held_grad)
            receiving.append(0 if first else 1 + depths if after_mtp(L, c.pp_rank, c.vpp_rank) else 1)
            batch_of.append(c.has_embedding or c.has_output or chunk_mtp)
        else:
            args = (c.kind_runs, c.has_embedding, c.has_output, norm_here, None, held_grad)
            receiving.append(0 if first else 1)
            batch_of.append(c.has_embedding or c.has_output)
        acts.append(_chunk_activations(L, *args))
        chunk_args.append(args)
    if L.pp == 1 and L.num_microbatches == 1 and L.moe is not None and L.moe.overlap_moe_expert_parallel_comm:
        # the combined schedule's only backward runs alone (_without_paired_forward): its working set without the
        # paired forward layer's
        alone = _chunk_activations(_without_paired_forward(L), *chunk_args[0])
        acts = [replace(acts[0], bwd_top_extra=alone.bwd_top_extra, bwd_bottom_extra=alone.bwd_bottom_extra)]
    widened = 1 + depths
    stage_runs = tuple(runs_of)
    ft = None
    if fsdp_enabled(L):
        # FSDP replaces DDP's buffers; its unsharded windows ride on each chunk's forward / backward.
        # what has left, from the backward's top, when the first gradient bucket (the output layer's) is
        # allocated: the backward's top working set less the output layer's own at its weight gradient
        # (head.output_items); and when the first unit's is: the loss softmax, the output items and the
        # logits' gradient
        softmax = [a.ends.get("loss_softmax_fp32", 0) for a in acts]
        loss = [max(0, a.out_bwd_transient - a.out_wgrad_moment) if a.out_bwd_transient else x
                for a, x in zip(acts, softmax)]
        out = [x + sum(a.ends.get(k, 0) for k in OUTPUT_ITEMS) + a.out_bwd_transient for a, x in zip(acts, softmax)]
        ft = fsdp_stage_terms(L, chunks, [a.layers // max(1, c.num_layers) for a, c in zip(acts, chunks)],
                              loss, out, softmax)
        acts = [replace(a, fwd_extra=a.fwd_extra + f, bwd_top_extra=a.bwd_top_extra + b)
                for a, f, b in zip(acts, ft.fwd_extra, ft.bwd_extra)]
    host_terms: tuple[Term, ...] = ()
    state_terms: tuple[Term, ...] | partial
    step_terms: tuple[Term, ...] | partial
    if (ft is None and not L.freeze_all_layers and not (L.fp8 or L.fp4) and L.optimizer not in EMERGING_OPTIMIZERS
            and not offload_enabled(L) and L.peft is None):
        # the common case: the state terms as _state_rows lists them, their Term objects made when first read
        state_rows, step_rows = _state_rows(L, st)
        fp32_grads = 4 * fp32_local_accumulation_numel(L, pp_rank)
        if fp32_grads:
            state_rows = state_rows[:2] + (("fp32_local_main_grads", fp32_grads, "gradients"),) + state_rows[2:]
        state_bytes, step_bytes = sum([r[1] for r in state_rows]), sum([r[1] for r in step_rows])
        state_terms, step_terms = partial(_state_row_terms, L, st, state_rows), partial(_state_row_terms, L, st, step_rows)
    else:
        state_terms, step_terms = _state_terms(L, st) if ft is None else (ft.state_terms, ft.step_terms)
        if L.peft is not None:
            # LoRA / DoRA: the frozen base weights, then the adapters' buffers and optimizer shard (estimator/peft.py)
            state_terms, step_terms = _peft_state_terms(L, pp_rank, st.parameters)
        if L.freeze_all_layers:
            # no parameter requires grad: DDP builds no buffer (its weights stay the module's own tensors) and the
            # optimizer gets no parameter (training.py get_model, distributed_data_parallel.py)
            state_terms, step_terms = tuple(t for t in state_terms if t.group == "weights"), ()
        if L.fp8 or L.fp4:
            state_terms = _fp8_state_terms(L, chunks, gpu_name, state_terms)
        if L.optimizer in EMERGING_OPTIMIZERS and not L.freeze_all_layers:
            state_terms = muon_state_terms(L, pp_rank, state_terms)
        if offload_enabled(L):
            # The hybrid optimizer's GPU part replaces the distributed optimizer's terms; the rest is host memory.
            ot = offload_terms(L, offload_shard_numel(L, st))
            state_terms = tuple(t for t in state_terms if t.name not in ot.replaced) + ot.state_terms
            step_terms = tuple(t for t in step_terms if t.name not in ot.replaced) + ot.step_terms
            host_terms = ot.host_terms
        fp32_grads = 4 * fp32_local_accumulation_numel(L, pp_rank) if ft is None else 0
        if fp32_grads:
            at = max((i + 1 for i, t in enumerate(state_terms) if t.group == "gradients"), default=0)
            state_terms = (tuple(state_terms[:at]) + (Term("fp32_local_main_grads", fp32_grads, "gradients", _ALLOCATED,
                                                           partial(_state_detail, L, st, "fp32_local_main_grads")),)
                           + tuple(state_terms[at:]))
        state_terms, step_terms = tuple(state_terms), tuple(step_terms)
        state_bytes, step_bytes = sum([t.bytes for t in state_terms]), sum([t.bytes for t in step_terms])
    buffer_rows = _persistent_buffers(L, pp_rank == L.pp - 1, sum(map(bool, receiving)), stage_runs, mtp_here,
                                      sum(receiving), tuple([max(1, r) for r in receiving]),
                                      _moe_first_received(L, receiving, stage_runs), tuple(batch_of))
    # The retained pipeline inputs exist after the schedule (the step, finalize_model_grads, the steady
    # state); during it only where _simulate placed them.
    retained_rows = [r for r in buffer_rows if r[0] == "pipeline_inputs_retained"]
    if retained_rows:
        buffer_rows = [r for r in buffer_rows if r[0] != "pipeline_inputs_retained"]
    # a rank running an MoE layer (or the MoE MTP layers) allocates the MoE-only fixed terms (stage_fixed_terms)
    has_moe = any([kind.mlp == MLP_MOE and n for runs in stage_runs for kind, n in runs])
    moe_rank = L.moe is not None and (has_moe or (mtp_here and any(kind.mlp == MLP_MOE for kind, _ in mtp_stack_runs(L))))
    if device == "gpu":
        # (MoE models: the layer kinds this rank runs, whose GEMMs fill TE's placeholder-gradient cache)
        kinds = None
        if L.moe is not None:
            kinds = frozenset([kind for runs in stage_runs for kind, n in runs if n])
            if mtp_here:
                kinds |= {kind for kind, _ in mtp_stack_runs(L)}
        # (a standalone MTP stage's last P2P buffers are its (1 + D)-fold output or gradient, as are the later
        # stages')
        widen = widened if mtp_here and not has_output or receiving and receiving[-1] > 1 else 1
        fixed_alloc, fixed_bytes, device_only, device_bytes = _device_terms(L, gpu_name, site, has_output,
                                                                            n_layers > 0, moe_rank, kinds, widen,
                                                                            mtp_here)
    else:
        fixed_alloc, fixed_bytes, device_only, device_bytes = (), 0, (), 0
    base = state_bytes + sum([r[1] for r in buffer_rows]) + fixed_bytes
    host_bytes = max([a.host_bytes for a in acts])
    staging = max([a.offload_staging for a in acts])
    frozen_base = L.freeze_all_layers or L.peft is not None
    deferred = deferred_wgrad_buffers(L) if pp_rank == L.pp - 1 and not frozen_base else 0
    plain = (ft is None and not host_bytes and not staging and not deferred
             and not (L.delta_offload_bytes_across_pp_ranks and acts[-1].offload_groups)
             and not (device == "gpu" and (L.cuda_graph_impl != "none" or L.optimizer_cuda_graph))
             and not (L.optimizer in MUON_OPTIMIZERS and not L.freeze_all_layers))
    # (positional, in the fields' order: one per stage shape of every cold estimate)
    return _StagePrep(
        st.parameters, n_layers, has_output, has_moe, tuple(acts),
        _schedule_bytes(L, acts, receiving, partial(_solo_backwards, L, tuple(chunk_args))
                        if ft is None and L.moe is not None and L.moe.overlap_moe_expert_parallel_comm and L.pp > 1
                        else None), ft,
        state_terms, step_terms, host_terms, host_bytes, partial(_terms_of, buffer_rows),
        partial(_terms_of, retained_rows), staging, deferred, fixed_alloc, device_only, device_bytes,
        lambda: f"caching-allocator slack, {site.allocator_fragmentation:.0%} of peak allocated",  # frag_detail
        lambda: _chunks_detail([a.layers_detail for a in acts]),                                 # layers_detail
        base,
        # step_bytes: the step itself allocates nothing beyond main_grad_copies: fused Adam kernels (TE FusedAdam
        # / apex on GPUs, torch's fused CPU kernel in the referee) update in place
        step_bytes,
        # finalize
        replicated_grad_allreduce_bytes(L, stage_runs, has_output, final_norm, mtp_here)
        if not frozen_base else 0,
        sum([r[1] for r in retained_rows]), plain)


def _stage_estimate(L: Layout, pp_rank: int, pr: _StagePrep, device: str, site: SiteConstants) -> StageEstimate:
    """One stage from its shape's schedule-independent terms ``pr``: its schedule's peak and the terms there.
    Its MoE worst case is made when first read, from _moe_worst_inputs (the same for every stage)."""
    chunks = L.stage_chunks(pp_rank)
    acts, ft, n_layers = pr.acts, pr.ft, pr.n_layers
    act_peak, phase, in_flight, parts = _simulate(L, pp_rank, acts, pr.sched)
    if pr.plain:
        # none of the features below: the stage's terms are the state's, the buffers' and those at the peak
        return _stage_totals(L, pp_rank, pr, device, site, chunks, act_peak, phase, in_flight, parts,
                             pr.host_terms, pr.base, pr.fixed_alloc, (), (), pr.step_bytes)
    if ft is not None:
        parts = split_fsdp_transients(parts, ft)
    host_terms = pr.host_terms
    act_host = pr.host_bytes * in_flight
    if act_host:
        # activation offloading: the saved tensors on the host of every micro-batch in flight (pinned)
        how = ("layer-level (--cpu-offloading-num-layers)" if L.cpu_offloading_num_layers
               else "fine-grained (" + ", ".join(L.offload_modules) + ")")
        host_terms = host_terms + (Term("host_offloaded_activations", act_host, "host", "host",
                                        f"{how}; {in_flight} micro-batch(es) in flight"),)
    if pr.staging:
        # the offloaded groups in flight exist during the forward and backward passes
        parts = {**parts, "offload_staging": pr.staging}
        act_peak += pr.staging
    if L.delta_offload_bytes_across_pp_ranks and pp_rank and acts[-1].offload_groups:
        # pp_rank x delta bytes of whole groups stay on the GPU, from the first backward chunk (the stage's last
        # chunk, micro-batch 0) on: those micro-batches are in flight at the peak
        kept = pp_balance_kept(acts[-1].offload_groups, pp_rank * L.delta_offload_bytes_across_pp_ranks,
                               L.activation_offload_fraction, in_flight)
        if kept:
            parts = {**parts, "offload_pp_balance_kept": kept}
            act_peak += kept
    if pr.deferred:
        # held from the first micro-batches to the end of the schedule: present at any fwd/bwd peak
        parts = {**parts, "deferred_output_wgrad_buffers": pr.deferred}
        act_peak += pr.deferred
    fixed_alloc = pr.fixed_alloc
    base = pr.base
    graph_pool: list[Term] = []
    if device == "gpu" and L.cuda_graph_impl != "none":
        # graphed layers: the decoder layers of this stage and, on the last, the MTP layers (of the last
        # layer's kind); dense and MoE layers graph different parts (--cuda-graph-modules)
        het = bool(L.heterogeneous_layers)

        def sparse(kind: LayerKind) -> bool:   # (a heterogeneous config's "dense:FFN" is a dense layer)
            return kind.mlp == MLP_MOE if het else kind.mlp != MLP_DENSE
        moe = sum(k for c in chunks for kind, k in c.kind_runs if sparse(kind))
        mtp_here = any(holds_mtp(L, c) for c in chunks)
        if mtp_here:
            moe += L.mtp_num_layers * sum(k for kind, k in mtp_stack_runs(L) if sparse(kind))
        graphed = n_layers + (L.mtp_num_layers * sum(k for _, k in mtp_stack_runs(L)) if mtp_here else 0)
        kinds = (_hybrid_graph_kinds(L, chunks, mtp_here) if L.hybrid_layer_pattern else
                 _gdn_graph_kinds(L, chunks, mtp_here) if L.linear_attention_pattern else
                 _halved_graph_kinds(L, chunks, mtp_here) if het else None)
        if kinds is not None:
            # the pool's free blocks: the largest working memory of one graphed layer (of a kind the graphs take)
            spec = cuda_graph_spec(L)
            graphed_kind = layer_graphed(L)
            las = [layer_activations(L, True, kind) for kind, k in kinds.items()
                   if k and graphed_kind(spec, kind.mixer, kind.mlp)]
            region = max((max(la.fwd_transient, la.bwd_transient) for la in las), default=0)
            kinds = [(kind.mixer, kind.mlp, k) for kind, k in kinds.items()]
        else:
            la = layer_activations(L)
            region = max(la.fwd_transient, la.bwd_transient)
            if het:
                # dense layers of their blocks' widths (resolve/heterogeneous.py lets only whole layers be graphed per
                # layer): the widest sets the pool's free blocks, as the flags' dense layer does for a uniform model
                region = max([region] + [max(a.fwd_transient, a.bwd_transient) for a in
                                         (layer_activations(L, True, kind) for c in chunks for kind, _ in c.kind_runs
                                          if kind.mlp.startswith(MLP_DENSE + ":"))])
        fixed_alloc = list(fixed_alloc)
        for name, nbytes, group, level, det in cuda_graph_terms(
                L, graphed - moe, moe, in_flight, region, pr.step_bytes, len(chunks), kinds):
            t = Term(name, nbytes, group, level, det)
            if level == "allocated":
                fixed_alloc.append(t)
                base += nbytes
            else:
                graph_pool.append(t)

    # Muon's Newton-Schulz temporaries (one matrix at a time) exist during the step only: not in the
    # steady state (persistent_bytes below counts the step terms without them)
    step_only = muon_step_terms(L, pp_rank) if L.optimizer in MUON_OPTIMIZERS and not L.freeze_all_layers else ()
    if ft is not None and ft.step_only:
        # FSDP buckets gathered at the end of the step and released before the steady state (fsdp_layout.py)
        step_only = tuple(step_only) + ft.step_only
    step_bytes = pr.step_bytes + sum(t.bytes for t in step_only) if step_only else pr.step_bytes
    return _stage_totals(L, pp_rank, pr, device, site, chunks, act_peak, phase, in_flight, parts, host_terms,
                         base, fixed_alloc, graph_pool, step_only, step_bytes)


def _halved_graph_kinds(L: Layout, chunks: tuple[Chunk, ...], mtp_here: bool) -> dict[LayerKind, int] | None:
    """A heterogeneous stage's layers by kind for its per-layer CUDA graphs when some are no-op or linear-replacement
    halves (estimator/cuda_graphs.py heterogeneous_kind_graphed: which of them each implementation graphs), with the
    MTP depths' layers (full layers of the flags, graphed by both implementations); None when every layer of the
    model is a whole one (graphed as a uniform model's)."""
    if not any(kind.mixer in (MIXER_NONE, MIXER_LINEAR) or kind.mlp in (MLP_NONE, MLP_LINEAR)
               for kind, _ in model_kind_runs(L)):
        return None
    return _kinds_with_mtp(L, chunks, mtp_here)


def _kinds_with_mtp(L: Layout, chunks: tuple[Chunk, ...], with_mtp: bool) -> dict[LayerKind, int]:
    """The chunks' layers by kind and, when ``with_mtp``, the MTP depths' layers (each depth one stack of runs)."""
    out: dict[LayerKind, int] = {}
    for c in chunks:
        for kind, k in c.kind_runs:
            out[kind] = out.get(kind, 0) + k
    if with_mtp:
        for kind, k in mtp_stack_runs(L):
            out[kind] = out.get(kind, 0) + k * L.mtp_num_layers
    return out


def _hybrid_graph_kinds(L: Layout, chunks: tuple[Chunk, ...], mtp_here: bool) -> dict[LayerKind, int]:
    """A hybrid stage's layers by kind, for its CUDA graphs: the decoder layers of its chunks and, on the stage of the
    MTP block under the local implementation, the MTP depths' layers (each a GraphableMegatronModule with its own
    CudaGraphManager). TE's helper graphs none of them: it takes ``mtp.layers[i].mtp_model_layer``, a hybrid
    model's HybridStack, which is no GraphableMegatronModule (cuda_graphs.py _discover_layers, core 0.19.2)."""
    return _kinds_with_mtp(L, chunks, mtp_here and cuda_graph_spec(L).impl == "local")


def _gdn_graph_kinds(L: Layout, chunks: tuple[Chunk, ...], mtp_here: bool) -> dict[LayerKind, int]:
    """A GPT stage with gated delta net layers by kind, for its CUDA graphs: a GDN layer is a TransformerLayer whose
    self_attention is GatedDeltaNet, graphed as an attention layer (_layer_is_graphable: ``attn`` takes a layer whose
    self_attention is not an IdentityOp, ``mlp`` / ``moe`` its MLP) with the causal mask among its static inputs
    (TransformerLayer.get_layer_static_inputs, core 0.16.1 and 0.19.2); the MTP layers (0.19: the standard attention
    layer) are TransformerLayers that both implementations graph, as in a GPT model without GDN layers."""
    return _kinds_with_mtp(L, chunks, mtp_here)


def _stage_totals(L: Layout, pp_rank: int, pr: _StagePrep, device: str, site: SiteConstants,
                  chunks: tuple[Chunk, ...], act_peak: int, phase: str, in_flight: int, parts: dict[str, int],
                  host_terms: tuple[Term, ...], base: int, fixed_alloc: tuple[Term, ...] | list[Term],
                  graph_pool: tuple[Term, ...] | list[Term], step_only: tuple[Term, ...], step_bytes: int) -> StageEstimate:
    """The stage's totals at the largest of its schedule's peak, finalize_model_grads and the optimizer step,
    and its terms there (made when first read: _assemble_terms)."""
    finalize, retained_bytes = pr.finalize, pr.retained_bytes
    # --ddp-reduce-scatter-with-fp32-accumulation: finish_grad_sync, first in finalize_model_grads, reduces one
    # bucket at a time before the TP all-reduce of the replicated gradients (estimator/ddp_extras.py)
    rs_fp32 = rs_fp32_accumulation_bytes(L, pp_rank) if L.ddp_reduce_scatter_with_fp32_accumulation else 0
    finalize = max(finalize, rs_fp32)
    held_moe = 0                            # the moe_layer_activations bytes at the peak
    act_terms: list[Term] | None
    if finalize + retained_bytes > max(act_peak, step_bytes + retained_bytes):
        # after the last backward, before the step: nothing but the coalesced gradients is in flight
        if rs_fp32 and rs_fp32 == finalize:
            fin = Term("rs_fp32_accumulation_buffers", finalize, "transients",
                       detail=("the all-to-all outputs (gradient dtype) still outstanding in finish_grad_sync under "
                               "--overlap-grad-reduce and the largest fp32 shard sum" if L.overlap_grad_reduce else
                               "the largest bucket's all-to-all output (gradient dtype) and fp32 sum of this rank's "
                               "shard, reduce-scattered with fp32 accumulation by finish_grad_sync"))
        else:
            fin = Term("replicated_grad_allreduce", finalize, "transients",
                       detail="coalesced copy of the TP-replicated gradients (norms, row-parallel biases, "
                              "MLA down projections) all-reduced over TP by finalize_model_grads")
        act_terms = [*pr.retained, fin]
        peak_phase = "finalize_model_grads"
        peak_alloc = base + sum(t.bytes for t in act_terms)
    elif act_peak >= step_bytes + retained_bytes:
        act_terms = None                    # the terms of the parts (_part_terms)
        held_moe = parts.get("moe_layer_activations", 0)
        peak_phase = phase
        peak_alloc = base + sum(parts.values())    # the terms made of the parts (zeros left out)
    else:
        act_terms = [*pr.retained, *pr.step_terms, *step_only]
        peak_phase = "optimizer step"
        peak_alloc = base + sum(t.bytes for t in act_terms)
    step_bytes_graphed = pr.step_bytes             # the step terms' bytes
    if (device == "gpu" and L.optimizer_cuda_graph and step_bytes_graphed and peak_phase != "optimizer step"
            and cuda_graph_spec(L).impl != "full_iteration"):
        # OptimizerCudaGraphWrapper captures the step into a private pool (core 0.19.2 optimizer_cuda_graph.py):
        # its temporaries stay reserved there while forward and backward run (a full-iteration graph's pool
        # already counts them)
        graph_pool.append(Term("optimizer_graph_pool", step_bytes_graphed, "allocator", "reserved",
                               "the optimizer step's temporaries, kept by its CUDA graph's private pool"))
    frag = None
    if device == "gpu":
        frag = int(peak_alloc * site.allocator_fragmentation)
        peak_reserved = peak_alloc + frag
        if graph_pool:
            peak_reserved += sum(t.bytes for t in graph_pool)
        device_total = peak_reserved + pr.device_bytes
    else:
        peak_reserved = device_total = peak_alloc
    persistent = base + retained_bytes + pr.step_bytes
    # the terms and the MoE worst case, made when first read, as partial applications (not closures: a closure
    # makes a cell per variable it reads, two dozen objects per stage of every estimate for the collector)
    moe = None if L.moe is None else partial(_moe_worst_case, L, device, site, held_moe, pr.has_moe, peak_alloc,
                                             peak_reserved, device_total, peak_phase)
    terms = partial(_assemble_terms, L, pp_rank, pr, in_flight, parts, act_terms, fixed_alloc, frag, graph_pool)
    # (positional, in the fields' order: one per stage of every estimate)
    return StageEstimate(pp_rank, chunks, pr.n_layers, pr.parameters, persistent, peak_alloc, peak_reserved,
                         device_total, peak_phase, in_flight, terms, moe, host_terms)


def _assemble_terms(L: Layout, pp_rank: int, pr: _StagePrep, in_flight: int, parts: dict[str, int],
                    act_terms: list[Term] | None, fixed_alloc: tuple[Term, ...] | list[Term], frag: int | None,
                    graph_pool: tuple[Term, ...] | list[Term]) -> tuple[Term, ...]:
    """A stage's terms in report order: state, buffers, fixed, those at the peak (``act_terms``, or None: the
    schedule's parts), then on a GPU (``frag`` not None) the allocator's slack, graph pools and device terms.
    Made when a reader first asks (StageEstimate.terms): a planner ranking layouts reads the totals only."""
    terms = [*pr.state_terms, *pr.buffers, *fixed_alloc,
             *(act_terms if act_terms is not None else _part_terms(L, pp_rank, pr, in_flight, parts))]
    if frag is not None:
        terms.append(Term("allocator_fragmentation", frag, "allocator", "reserved", pr.frag_detail))
        if graph_pool:
            terms += graph_pool
        terms += pr.device_only
    return tuple(terms)


def _in_flight_detail(pr: _StagePrep, in_flight: int, moe: bool) -> str:
    det = pr.layers_detail + f"; {in_flight} micro-batch(es) in flight at most"
    if moe:
        det += "; the MoE layers' router, dispatcher and expert tensors in these sizes are counted in moe_layer_activations"
    return det


def _part_terms(L: Layout, pp_rank: int, pr: _StagePrep, in_flight: int, parts: dict[str, int]) -> list[Term]:
    """The terms of the schedule's parts at its peak (zeros left out), with their details."""
    ft = pr.ft
    act_terms: list[Term] = []
    add = act_terms.append
    for name, v in parts.items():
        if not v:
            continue
        group = _END_GROUPS.get(name) or ("transients" if name.endswith("transient") else "activations")
        if ft is None and name not in _DETAILED_PARTS:
            add(Term(name, v, group))
            continue
        det = ""
        if name == "layer_activations":
            # (made when the detail is read: the layers' detail is a chain of formatted sizes)
            det = partial(_in_flight_detail, pr, in_flight, bool(parts.get("moe_layer_activations")))
        elif name == "moe_layer_activations":
            det = ("router, token dispatcher and expert tensors of the MoE layers held (inside layer_activations' "
                   "per-layer sizes), at balanced routing; worst case: the MoE routing line (JSON moe.worst_case)")
        elif name == "mtp_block_activations":
            det = (f"{L.mtp_num_layers} MTP depth(s): enorm / eh_proj / final-norm inputs, norm statistics, rolled "
                   + ("ids, hnorm's input (the concatenation it sends on is freed after the send)"
                      + ("; without decoder layers the received hidden states too, which the empty decoder block "
                         "clones for hnorm" if not pr.n_layers else "")
                      if not pr.has_output else
                      f"ids, and the concatenated {1 + L.mtp_num_layers} hidden states the output layer keeps"))
        elif name == "mtp_received_hidden":
            det = (f"the {1 + L.mtp_num_layers}-fold concatenated hidden states received from the MTP stage "
                   "(mtp_standalone) and the empty decoder block's clone of them, whose chunks the output layer "
                   "keeps for each head")
        elif name == "mtp_loss_buffers":
            det = (f"{L.mtp_num_layers} extra head(s): fp32 softmax, targets, rolled labels and mask, per-token "
                   "loss; the last depth's logits are in forward_transient")
        elif name == "offload_staging":
            host = pr.host_bytes * in_flight
            cap = L.fine_grained_offloading_max_inflight_offloads
            det = (f"up to {cap} pending copies to the host of every offloaded module (the cap's bound) and one "
                   f"group reloaded ahead" if cap is not None and cap > 1 else
                   "two groups of the largest offloaded module in flight (one copy to the host pending, one "
                   "reloaded ahead)") + f"; host memory for {in_flight} micro-batch(es): {format_bytes(host)}"
        elif name == "offload_pp_balance_kept":
            det = (f"--delta-offload-bytes-across-pp-ranks: {pp_rank} x {L.delta_offload_bytes_across_pp_ranks:,} B "
                   "of whole offload groups kept on the GPU, from the first micro-batch in flight")
        elif name == "pipeline_inputs_retained" and L.vpp > 1:
            det = ("the schedule's own tensors at this pass: idle chunks' last input and gradient, the last input "
                   "gradient, the pair's forward output or received output gradient, inputs received ahead")
        elif name == "pipeline_inputs_retained":
            det = "last received input and its gradient of the chunks not started yet or already done"
        elif ft is not None and name.startswith("fsdp_"):
            det = fsdp_window_detail(ft, name)
        add(Term(name, v, group, _ALLOCATED, det))
    return act_terms


@lru_cache(maxsize=1024)
def replicated_grad_allreduce_bytes(L: Layout, stage_runs: tuple[tuple[tuple[LayerKind, int], ...], ...],
                                     has_output: bool, final_norm: bool | None = None,
                                     has_mtp: bool | None = None) -> int:
    """finalize_model_grads (_allreduce_non_tensor_model_parallel_grads) flattens the gradients of the
    parameters every TP rank holds whole into one new buffer before all-reducing them over TP: those
    marked sequence_parallel under SP (norm weights, row-parallel biases, MLA's duplicated down
    projections), and q/k norms with --qk-layernorm. Learned position embeddings are not among them.
    ``has_output``: the stage holds the loss (and the MTP block, whose layers' and enorm / hnorm / final norm's
    parameters are among them too); ``final_norm``: it holds the decoder's final norm (None: with the loss);
    ``has_mtp``: it holds the MTP block (None: with the loss; a standalone MTP stage's otherwise)."""
    if L.tp == 1:
        return 0
    # ``stage_runs``: the (kind, count) runs of each chunk of the stage
    counts: dict[LayerKind, int] = {}
    for runs in stage_runs:
        for kind, k in runs:
            counts[kind] = counts.get(kind, 0) + k
    # rows: (name, numel, tp_replicated, shared_embedding, expert, cols)
    layers = [(layer_param_rows(L, kind), k) for kind, k in counts.items()]
    # parameters: one layer with --mtp-use-repeated-layer
    mtp = mtp_layers_built(L) if (has_output if has_mtp is None else has_mtp) else 0
    norm = L.hidden_size * (2 if L.normalization == "LayerNorm" else 1)
    if mtp:
        # every model chunk's parameters are walked (finalize_model_grads.py), the MTP block's included
        layers += [(layer_param_rows(L, kind), mtp * k) for kind, k in mtp_stack_runs(L)]
    if L.sequence_parallel:
        n = sum(k * sum(r[1] for r in layer if r[2]) for layer, k in layers)
        if has_output if final_norm is None else final_norm:
            n += norm    # the decoder's final norm
        n += mtp * 3 * norm    # each MTP depth's enorm, hnorm and final norm
    elif L.qk_layernorm:
        n = sum(k * sum(r[1] for r in layer if "q_layernorm" in r[0] or "k_layernorm" in r[0]) for layer, k in layers)
    else:
        return 0
    return n * L.grad_bytes


@lru_cache(maxsize=256)
def _fixed_terms(L: Layout, gpu_name: str | None, site: SiteConstants = DEFAULT_SITE) -> tuple[Term, ...]:
    return tuple(gpu_fixed_terms(L, gpu_name, site))  # a tuple: the cached value is shared


@lru_cache(maxsize=1024)
def _device_terms(L: Layout, gpu_name: str | None, site: SiteConstants, has_output: bool, has_layers: bool,
                  moe_rank: bool, kinds: frozenset | None = None,
                  p2p_widen: int = 1, mtp: bool = False) -> tuple[tuple[Term, ...], int, tuple[Term, ...], int]:
    """A GPU stage's fixed terms, the same on every stage shape but for the placeholder weight gradients (which
    follow the output layer and the layers) and the MoE-only ones (``moe_rank``: the stage runs an MoE layer;
    overheads.stage_fixed_terms): the allocated ones with the pipeline buffers in flight and the placeholders,
    their bytes, the device-level ones (outside the allocator) and theirs."""
    fixed = stage_fixed_terms(L, _fixed_terms(L, gpu_name, site), moe_rank)
    fixed_alloc = [t for t in fixed if t.level == "allocated"]
    p2p, count = p2p_in_flight_bytes(L)
    p2p *= p2p_widen        # mtp_standalone: the (1 + D)-fold hidden states and their gradients
    if p2p:
        fixed_alloc.append(Term("p2p_buffers_in_flight", p2p, "transients", "allocated",
                                lambda: f"{count} pipeline send/receive buffers held by NCCL work objects"))
    # (weight gradients, real or placeholder, exist only for parameters that require grad)
    # (frozen weights: TE makes no placeholder weight gradient, module/linear.py backward runs it only with requires_wgrad;
    # PEFT adapters are megatron-core linears, whose placeholders are per call and adapter-sized)
    dummies = dummy_wgrad_bytes(L, has_output, has_layers, kinds, mtp) if not (L.freeze_all_layers or L.peft) else 0
    if dummies:
        fixed_alloc.append(Term("dummy_wgrads", dummies, "transients", "allocated",
                                lambda: f"{len(dummy_wgrad_shapes(L, has_output, has_layers, kinds, mtp))} placeholder weight "
                                        "gradients, one per weight shape, cached by Transformer Engine under "
                                        "gradient-accumulation fusion"))
    device_only = tuple([t for t in fixed if t.level == "device"])
    return tuple(fixed_alloc), sum(t.bytes for t in fixed_alloc), device_only, sum(t.bytes for t in device_only)


@lru_cache(maxsize=256)
def _moe_worst_inputs(L: Layout, device: str, site: SiteConstants) -> tuple:
    """What every stage's ``moe`` figure needs: the expert rows per MoE layer and micro-batch under
    balanced routing (what the estimate uses) and in the worst case the dispatcher allows (every token
    of the ETP x EP group to this rank's experts, or the capacity), a MoE layer's saved bytes at both,
    how much its working set grows, and the allocator's slack on top."""
    rows = expert_rows(L.moe, tokens_per_rank(L))
    mods = selective_modules(L)
    # at balanced routing the layer's own (its default rows), already made by its recipe
    bal = (layer_moe_activations(L, mods) if L.moe.routing != "worst"
           else moe_activations(L, L.moe, rows=rows.balanced, mods=mods))
    wst = moe_activations(L, L.moe, rows=rows.worst, mods=mods)
    d_work = max(wst.fwd_transient - bal.fwd_transient,
                 max((w for _, w in wst.bwd_steps), default=0) - max((w for _, w in bal.bwd_steps), default=0), 0)
    frag = site.allocator_fragmentation if device == "gpu" else 0.0
    return rows, bal.total, wst.total, d_work, frag


def _moe_worst_case(L: Layout, device: str, site: SiteConstants, held: int, has_moe: bool, peak_allocated: int,
                    peak_reserved: int, device_total: int, peak_phase: str, inputs: tuple | None = None) -> dict:
    """A stage's ``moe`` figure: its peak at the same moment of the schedule with the worst-case rows.
    The MoE layers in flight (``held``: their moe_layer_activations bytes) keep their worst-case bytes
    and the working set grows by the worst-case layer's (no second schedule evaluation)."""
    rows, bal_total, wst_total, d_work, frag = inputs or _moe_worst_inputs(L, device, site)
    grow = (held * wst_total // bal_total - held) if bal_total else 0
    if held:
        extra = grow + d_work
    elif has_moe:
        # checkpointed layers keep no MoE bytes, but the backward remakes one MoE layer at a time:
        # its saved tensors and working set at the worst-case rows
        extra = max(wst_total - bal_total, 0) + d_work
    else:
        extra = 0
    extra_reserved = extra + int(extra * frag)
    out = {"expert_rows_balanced": rows.balanced, "expert_rows_worst": rows.worst, "routing": rows.how,
           "worst_case": {"peak_allocated_bytes": peak_allocated + extra,
                          "peak_reserved_bytes": peak_reserved + extra_reserved,
                          "device_total_bytes": device_total + extra_reserved, "peak_phase": peak_phase}}
    biased = L.moe.moe_router_force_biased if L.moe is not None else None
    if biased is not None:
        # --moe-router-force-biased (Router.forward, core 0.19.2 moe_utils.apply_biased_logits): random logits
        # plus one N(0, std^2) bias per expert that every rank draws alike, so the same experts win on every
        # rank and the load does not balance; the dispatcher's limit (the rows above) is what bounds it
        out["routing"] = f"{rows.how}; forced biased routing (std {abs(biased):g}): not balanced, plan with this bound"
        out["worst_case"]["forced_biased_std"] = abs(biased)
    return out


def _with_eval_step(L: Layout, stages: tuple[StageEstimate, ...], preps: dict, device: str, site: SiteConstants,
                    notes: list[str]) -> tuple[StageEstimate, ...]:
    """Each stage with its evaluation step's figure (estimator/eval_step.py), or a note naming what keeps it out."""
    from .eval_step import eval_figure, eval_layout, eval_terms, in_flight_terms, unmodelled
    why = unmodelled(L)
    if why is not None:
        notes.append(f"--eval-micro-batch-size: the evaluation step is not estimated ({why} is not modelled)")
        return stages
    E = eval_layout(L)
    shapes_ = _stage_shapes(L)
    out = []
    for s in stages:
        pr = preps[shapes_[s.pp_rank]]
        chunks = L.stage_chunks(s.pp_rank)
        runs = tuple(c.kind_runs for c in chunks)
        nrecv = sum(1 for c in chunks if not (c.pp_rank == 0 and c.vpp_rank == 0))
        last = s.pp_rank == L.pp - 1
        # the persistent buffers grown to the eval micro-batch's requests (they keep their largest size); the
        # retained pipeline inputs are left out: the chunk's first received eval input replaces its pair
        # (TransformerBlock.set_input_tensor) and is counted as eval_received_input, the other chunks' as
        # eval_other_chunks_inputs
        batch = tuple(c.has_embedding or c.has_output or holds_mtp(L, c) for c in chunks)
        train_rows = {r[0]: r[1] for r in _persistent_buffers(L, last, nrecv, runs, batch_chunks=batch)}
        growth = {name: max(0, b - train_rows.get(name, 0)) for name, b, *_ in _persistent_buffers(E, last, nrecv, runs,
                                                                                                 batch_chunks=batch)
                  if name != "pipeline_inputs_retained"}
        # (on a GPU the pipeline buffer NCCL holds is the eval micro-batch's)
        fixed = in_flight_terms(L, s.pp_rank, pr.fixed_alloc) if device == "gpu" else pr.fixed_alloc
        static = (*pr.state_terms, *pr.buffers, *fixed)
        frag = site.allocator_fragmentation if device == "gpu" else None
        terms = eval_terms(L, s.pp_rank, static, growth, frag, pr.device_only if device == "gpu" else ())
        out.append(replace(s, eval_step=eval_figure(L, terms)))
    return tuple(out)


def estimate(
    layout: Layout,
    profile: str = "auto",
    device: str = "gpu",
    gpu: GpuSpec | None = None,
    gpu_memory: int | None = None,
    threshold: float = 0.8,
    dp_rank: int | str = "max",
    site: SiteConstants | None = None,
    expert_dp_rank: int | None = None,
) -> Estimate:
    """Per-stage peak memory of ``layout``. ``profile``: auto (by --transformer-impl), transformer_engine,
    local, or fujii2024 (the paper's closed form). ``device``: gpu, or cpu (no GPU-only terms). ``site``:
    the site constants (a ``memguard calibrate`` profile; None: memguard's defaults). ``expert_dp_rank``
    (MoE, with an index ``dp_rank``): the rank's own expert-data-parallel optimizer position when known (the
    runtime hook reads it from megatron-core); None: worked out from ``dp_rank`` for TP rank 0."""
    site = DEFAULT_SITE if site is None else site
    if profile not in PROFILES:
        raise ConfigError("--profile", f"unknown profile {profile!r}; choose from {', '.join(PROFILES)}")
    if dp_rank not in ("max", "last") and not (
            isinstance(dp_rank, int) and not isinstance(dp_rank, bool) and 0 <= dp_rank < layout.dp_shard_size):
        # A rank outside the optimizer's shard group would own no optimizer state at all.
        raise ConfigError("--dp-rank", f"must be max, last or a rank 0..{layout.dp_shard_size - 1} of the "
                                       f"distributed optimizer's DP x CP group, got {dp_rank!r}")
    notes = list(layout.notes)
    if site is not DEFAULT_SITE and site != DEFAULT_SITE and device == "gpu" and profile != "fujii2024":
        notes.append("site profile: " + site.describe())
    if profile == "fujii2024":
        if layout.heterogeneous_layers:
            # the paper's closed form has one layer shape
            from ..errors import NotModelledError
            raise NotModelledError("--profile", "the fujii2024 closed form for heterogeneous layer configs")
        if layout.hybrid_layer_pattern:
            from ..errors import NotModelledError
            raise NotModelledError("--profile", "the fujii2024 closed form for hybrid Mamba models")
        if layout.linear_attention_pattern:
            from ..errors import NotModelledError
            raise NotModelledError("--profile", "the fujii2024 closed form for gated delta net layers")
        from .fujii2024 import estimate_fujii2024
        return estimate_fujii2024(layout, gpu=gpu, gpu_memory=gpu_memory, threshold=threshold)
    L = layout
    if profile == "local" and layout.hybrid_layer_pattern:
        # megatron-core builds a hybrid model from its TE layer spec only (models/hybrid/hybrid_layer_specs.py)
        from ..errors import NotModelledError
        raise NotModelledError("--profile", "the local profile for a hybrid Mamba model (built from TE modules only)")
    if profile == "local" and layout.linear_attention_pattern:
        # the experimental attention variant spec builds TE modules only (_get_backend_spec_provider asserts it)
        from ..errors import NotModelledError
        raise NotModelledError("--profile", "the local profile for gated delta net layers (built from TE modules only)")
    if profile in ("transformer_engine", "local") and profile != layout.transformer_impl:
        L = layout.replace(transformer_impl=profile)
        notes.append(f"profile {profile} overrides --transformer-impl {layout.transformer_impl}")
    attention = select_attention_backend(L, gpu)
    blocked = explicit_attention_blocked(L, gpu)
    if blocked:
        # an explicit backend leaves TE no other kernel (attention_backend.explicit_blocked): Megatron stops at the
        # first forward step
        where = f" on {gpu.name}" if gpu is not None else ""
        raise ConfigError("--attention-backend", f"{L.attention_backend}{where} has no Transformer Engine kernel for "
                          f"this layer: {blocked}", "use --attention-backend auto", fails_later=NO_TE_BACKEND)
    modelled = attention.modelled_layout(L)
    if modelled is not L:
        # TE runs flash-attn (or, where neither flash-attn nor cuDNN can, its unfused attention) for auto on
        # this GPU: those terms (layers/attention.py) apply
        if attention.selected == "unfused" and L.cp > 1:
            # TE 2.11 / 2.20.2 get_attention_backend disables UnfusedDotProductAttention under context
            # parallelism, then DotProductAttention raises "No dot product attention backend is available"
            raise ConfigError("--context-parallel-size", f"must be 1 here (got {L.cp}): Transformer Engine has no "
                              "attention kernel for this layer under context parallelism; " + attention.why,
                              "use --context-parallel-size 1, or bf16/fp16 and a head dim flash-attn or cuDNN takes",
                              fails_later=NO_TE_BACKEND)
        L = modelled
    if attention.requested == "auto" and gpu is None and L.transformer_impl == "transformer_engine":
        notes.append("attention backend: " + attention.why)
    mem = gpu_memory if gpu_memory is not None else (gpu.memory_bytes if gpu else None)
    if gpu is not None and (layout.fp8 or layout.fp4):
        from .fp8 import gpu_violation
        bad = gpu_violation(layout.fp8_spec, gpu.name)
        if bad:
            raise ConfigError("--gpu", bad)
        # the GPU as data for the layers' quantized tensors (fp8_layers.py: Blackwell's Float8 storage, the experts'
        # GroupedLinear path under the op fuser)
        from .fp8_layers import fused_experts_gpu_path
        L = L.replace(fp8_gpu=gpu.name)
        split = fused_experts_gpu_path(L, gpu.name)
        if split:
            notes.append(split)
    gpu_name = gpu.name if gpu else None
    # one _StagePrep per distinct stage shape (the middle of a deep pipeline shares one), looked up here
    # rather than once per stage; only the schedule's peak and its terms are made per stage
    preps: dict[_StageShape, _StagePrep] = {}
    stages = []
    for r, shape in enumerate(_stage_shapes(L)):
        pr = preps.get(shape)
        if pr is None:
            pr = preps[shape] = _stage_prep(L, shape, device, gpu_name, dp_rank, site, expert_dp_rank)
        stages.append(_stage_estimate(L, r, pr, device, site))
    stages = tuple(stages)
    if L.eval_micro_batch_size is not None:
        stages = _with_eval_step(L, stages, preps, device, site, notes)
    if L.moe is not None and L.moe.moe_use_upcycling:
        # the start-up peak of upcycling (a dense model beside the MoE one), weighed with the training peak
        from .upcycling import startup_figure, startup_terms
        frag = site.allocator_fragmentation if device == "gpu" else 0.0
        stages = tuple(replace(s, startup=startup_figure(startup_terms(
            L, s.pp_rank, dp_rank, tuple(t for t in s.terms if t.level == "device"), frag))) for s in stages)
    totals = [s.required_device_bytes for s in stages]
    crit = totals.index(max(totals))        # the first stage with the largest total
    verdict = verdict_for(totals[crit], mem, threshold)
    return Estimate(layout=layout, profile=L.transformer_impl if profile == "auto" else profile, device=device,
                    gpu=gpu_name, gpu_memory_bytes=mem, threshold=threshold, stages=stages, verdict=verdict,
                    critical_stage=crit, notes=tuple(notes), site=site, attention=attention)
