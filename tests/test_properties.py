"""Properties of the estimate over the whole layout space Megatron accepts (issue 13).

Layouts come from tests/property_space.py (hypothesis, derandomized: the same examples on every run;
MEMGUARD_PROPERTY_EXAMPLES raises the count for a deeper local search). Each invariant names the
Megatron rule it follows.
"""
from __future__ import annotations

import json
import math
import os
import re

from hypothesis import HealthCheck, assume, given, reject, settings, strategies as st

from megatron_memguard import estimate, layout_from_flags
from megatron_memguard.errors import ConfigError, ConfigErrors, NotModelledError
from megatron_memguard.estimator.activations import attention_kind
from megatron_memguard.estimator.attention_backend import select
from megatron_memguard.estimator.layers.attention import qkv_kept_per_rank, te_softmax_kernel
from megatron_memguard.estimator.layers.base import shapes
from megatron_memguard.estimator.params import total_parameters
from megatron_memguard.estimator.result import GROUPS, LEVELS
from megatron_memguard.estimator.states import stage_states

from property_space import Spec, specs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = int(os.environ.get("MEMGUARD_PROPERTY_EXAMPLES", "200"))
PROPERTY = settings(derandomize=True, database=None, deadline=None, max_examples=EXAMPLES,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


def layout(spec: Spec):
    return layout_from_flags(spec.flags(), world_size=spec.world, megatron_version="0.19")


def _stages(L) -> list[int]:
    return sorted({0, L.pp // 2, L.pp - 1})


# ---------------------------------------------------------------------------------------------------
# Optimizer state

@PROPERTY
@given(specs())
def test_distributed_optimizer_shards_partition_the_stage_state(spec):
    """megatron/core/optimizer/distrib_optimizer.py (_build_model_gbuf_range): each bucket of the
    (padded) DDP buffer is cut into DP x CP / instances equal slices, one per rank of the optimizer's
    group; a rank's fp32 state covers the parameter ranges inside its slice. So the ranks' shards add
    up to the stage's parameters (the padding holds none), the slices to the padded buffer, and no rank
    holds more than its slice. Without the distributed optimizer every rank keeps the whole stage's
    state (Float16OptimizerWithFloat16Params / FP32Optimizer)."""
    L = layout(spec.with_(dist_opt=True))
    L0 = layout(spec.with_(dist_opt=False, instances=1))
    n = L.dp_shard_size
    assert n == L.dp * L.cp // L.num_distributed_optimizer_instances
    for p in _stages(L):
        # exp_avg (Adam) or momentum (SGD): 4 bytes per element of the rank's shard
        shards = [stage_states(L, p, r).exp_avg_bytes // 4 for r in range(n)]
        st = stage_states(L, p)
        assert sum(shards) == st.parameters
        assert st.buffer_numel % n == 0
        share = st.buffer_numel // n
        assert max(shards) <= share
        # the default ("max") is the largest rank's shard, wherever that rank sits (a middle rank can own
        # up to 64 elements more per bucket than the first and the last: tests/test_largest_shard.py)
        default = st.exp_avg_bytes // 4
        assert default == max(shards) <= share
        if n == 1:
            assert default == st.parameters
        whole = stage_states(L0, p)
        assert whole.parameters == st.parameters
        for r in {0, L0.dp_shard_size - 1}:
            assert stage_states(L0, p, r).exp_avg_bytes == 4 * st.parameters
        if L.params_dtype != "fp32":
            assert stage_states(L0, p).main_param_bytes == 4 * st.parameters
            assert st.main_param_bytes == 4 * default


# ---------------------------------------------------------------------------------------------------
# Parameters

def _model_count(spec: Spec, L) -> tuple[int, int]:
    """(parameters of one copy of the model, parameters every TP rank holds whole), counted from the
    module shapes of megatron-core's GPT spec: ColumnParallelLinear linear_qkv ((a + 2g) d x h, bias
    with --add-qkv-bias / biases), RowParallelLinear linear_proj (h x a d, bias replicated), the MLP's fc1
    ((2 if gated) f x h) and fc2 (h x f, bias replicated), two norms per layer and the final norm
    (replicated), the vocabulary-parallel embedding and output layer (padded vocabulary), and the learned
    position embedding (replicated)."""
    h, a, d, f = spec.hidden, spec.heads, spec.kv_channels, spec.ffn
    g = spec.groups or spec.heads
    norm = h * (1 if spec.rmsnorm else 2)
    fc1 = (2 if spec.swiglu else 1) * f
    sharded = (a + 2 * g) * d * h + h * a * d + fc1 * h + h * f
    replicated = 2 * norm
    if spec.bias:
        sharded += (a + 2 * g) * d + fc1
        replicated += 2 * h
    V = L.padded_vocab_size
    whole = spec.layers * replicated + norm + (0 if spec.rope else spec.seq * h)
    total = spec.layers * sharded + whole + V * h * (2 if spec.untied else 1)
    return total, whole


@PROPERTY
@given(specs())
def test_parameters_over_the_tp_and_pp_ranks_add_up(spec):
    """Every parameter lives on one pipeline stage (the tied output copy on the last one too when PP > 1:
    megatron's shared embedding); TP ranks split the column/row-parallel and vocabulary-parallel weights
    and each hold the replicated ones whole. The vocabulary is padded to a multiple of
    --make-vocab-size-divisible-by x TP (megatron/training/tokenizer _vocab_size_with_padding)."""
    L = layout(spec)
    V = L.padded_vocab_size
    assert V % (128 * spec.tp) == 0 and spec.vocab <= V < spec.vocab + 128 * spec.tp
    total, whole = _model_count(spec, L)
    assert total_parameters(L) == total
    per_rank = sum(stage_states(L, p).parameters for p in range(L.pp))
    tied_copy = V * spec.hidden if (not spec.untied and spec.pp > 1) else 0
    assert per_rank * spec.tp == total + (spec.tp - 1) * whole + tied_copy


# ---------------------------------------------------------------------------------------------------
# Data parallelism

def _dp_terms(L) -> set[str]:
    """Terms DP may change: the sharded optimizer state (and its step copies), the padded param and grad
    buffers of the distributed optimizer (bucket ends padded to lcm(DP x CP, 128)), the DP-CP
    communicator's NCCL buffers, and the allocator slack that follows the peak."""
    names = {"main_parameters", "adam_exp_avg", "adam_exp_avg_sq", "sgd_momentum", "main_grad_copies",
             "nccl_buffers", "allocator_fragmentation"}
    if L.use_distributed_optimizer:
        names |= {"parameters", "gradient_buffer"}
    return names


@PROPERTY
@given(specs(), st.sampled_from([1, 2, 3, 4, 8, 16]))
def test_data_parallel_size_changes_only_sharded_state_and_dp_buffers(spec, dp):
    """DP replicates the model: per rank it changes only what the distributed optimizer shards over
    DP x CP and the DP communicator. The micro-batch count is kept (GBS scales with DP)."""
    assume(dp != spec.dp and (spec.instances == 1 or (dp * spec.cp) % spec.instances == 0))
    a, b = estimate(layout(spec)), estimate(layout(spec.with_(dp=dp)))
    skip = _dp_terms(a.layout)
    for sa, sb in zip(a.stages, b.stages):
        assert sa.parameters == sb.parameters
        ta = {k: v for k, v in sa.breakdown.items() if k not in skip}
        tb = {k: v for k, v in sb.breakdown.items() if k not in skip}
        if sa.peak_phase == sb.peak_phase:
            assert ta == tb
        else:
            # the peak moved between the schedule and the optimizer step, whose fp32 gradient copies are
            # sharded: the terms present in both are equal
            # (and pipeline_inputs_retained: a pair after the schedule, fewer during it)
            assert "optimizer step" in (sa.peak_phase, sb.peak_phase)
            assert all(ta[k] == tb[k] for k in set(ta) & set(tb) if k != "pipeline_inputs_retained")


# ---------------------------------------------------------------------------------------------------
# Monotonicity

def _peaks(spec: Spec) -> list[int]:
    return [s.peak_allocated_bytes for s in estimate(layout(spec)).stages]


@PROPERTY
@given(specs(), st.integers(1, 8))
def test_peak_does_not_decrease_with_micro_batch_size(spec, extra):
    """A larger micro-batch makes every activation, batch tensor and transient larger (Megatron's shapes
    are [s, b, ...]); nothing shrinks. Exception: the local implementation's fused softmax kernel
    applies only when b x heads/TP is a multiple of 4 (megatron fused_softmax.is_kernel_available), so
    a larger b can switch the unfused torch softmax to the kernel; such pairs are skipped. The same holds for
    Transformer Engine's UnfusedDotProductAttention (--attention-backend unfused): its FusedScaleMaskSoftmax
    kernel needs b x heads/TP a multiple of 4 too (TE 2.11 / 2.20.2 softmax.py is_kernel_available, memguard's
    te_softmax_kernel), and where it runs it keeps only the bf16 probs instead of torch's fp32 softmax, its cast
    and its mask (test_te_unfused_softmax_kernel_at_a_larger_micro_batch_by_hand)."""
    big = spec.with_(mbs=spec.mbs + extra)
    Ls, Lb = layout(spec), layout(big)
    assume(attention_kind(Ls) == attention_kind(Lb))
    assume(te_softmax_kernel(Ls, shapes(Ls)) == te_softmax_kernel(Lb, shapes(Lb)))
    for small_peak, big_peak in zip(_peaks(spec), _peaks(big)):
        assert big_peak >= small_peak


TE_UNFUSED_MBS3 = Spec(backend="unfused", layers=1, heads=1, kv_channels=8, hidden=8, ffn=8, seq=64, mbs=3,
                       vocab=8, bias=False)


def test_te_unfused_softmax_kernel_at_a_larger_micro_batch_by_hand():
    """The corner MEMGUARD_PROPERTY_EXAMPLES=300 with the new seed 20261130 drew for the property above
    (2026-11-30): TE's unfused attention, one head, s = 64, bf16, micro-batch 3 -> 4. TE's FusedScaleMaskSoftmax
    runs its kernel only when b x heads/TP is a multiple of 4 (TE 2.11 / 2.20.2 softmax.py is_kernel_available):
    at b = 3 it falls back to torch's softmax in fp32 (UnfusedDotProductAttention builds it with
    softmax_in_fp32=True) and keeps the fp32 probs, their bf16 cast and the OR'd bool mask of the data loader's
    [b, 1, s, s] mask: 3 x 64 x 64 x (4 + 2) = 73,728 B and 3 x 64 x 64 = 12,288 B; at b = 4 the kernel keeps
    only the bf16 probs, 4 x 64 x 64 x 2 = 32,768 B, so the larger micro-batch's layer keeps less."""
    from megatron_memguard.estimator.activations import layer_activations
    small, big = layout(TE_UNFUSED_MBS3), layout(TE_UNFUSED_MBS3.with_(mbs=4))
    assert not te_softmax_kernel(small, shapes(small)) and te_softmax_kernel(big, shapes(big))
    a, b = layer_activations(small).saved, layer_activations(big).saved
    assert (a["attention_probs"], a["causal_mask"]) == (3 * 64 * 64 * 6, 3 * 64 * 64)
    assert b["attention_probs"] == 4 * 64 * 64 * 2 and "causal_mask" not in b
    assert layer_activations(big).total < layer_activations(small).total


@PROPERTY
@given(specs())
def test_peak_does_not_decrease_with_sequence_length(spec):
    """Doubling the sequence (the divisibility rules of CP and SP still hold) grows every [s, ...]
    tensor and the rotary tables. Exception: the local fused softmax kernel works up to s = 4096 only;
    beyond it the torch softmax takes over (more memory, so the direction holds anyway)."""
    long = spec.with_(seq=2 * spec.seq)
    for short_peak, long_peak in zip(_peaks(spec), _peaks(long)):
        assert long_peak >= short_peak


@st.composite
def interleaved_specs(draw) -> Spec:
    """A drawn job re-split as an interleaved pipeline: PP 2-6 ranks of 2-4 virtual stages of 1-3 layers each,
    whole groups of PP micro-batches (the interleaved schedule refuses a partial last group), even split."""
    spec = draw(specs())
    pp, v, per = draw(st.integers(2, 6)), draw(st.integers(2, 4)), draw(st.integers(1, 3))
    layers = pp * v * per
    rec = spec.recompute
    if rec and rec[0] == "full":
        rec = (rec[0], rec[1], min(rec[2], per))   # (at most a chunk's layers)
    return spec.with_(pp=pp, vpp=v, layers=layers, first=None, last=None, recompute=rec,
                      microbatches=pp * draw(st.integers(1, 3)))


def _peaks_or_reject(spec: Spec) -> list[int]:
    try:
        return _peaks(spec)
    except (ConfigError, ConfigErrors, NotModelledError):
        reject()


# (an interleaved layout holds up to 72 layers: half the common count)
INTERLEAVED = settings(PROPERTY, max_examples=max(1, EXAMPLES // 2))


@INTERLEAVED
@given(interleaved_specs(), st.integers(1, 8))
def test_every_interleaved_ranks_peak_does_not_decrease_with_micro_batch_size(spec, extra):
    """test_peak_does_not_decrease_with_micro_batch_size on interleaved layouts only, rank by rank: the
    interleaved schedule's pipeline tensors, counted pass by pass (schedule.py p2p), are [s, b, h] each, so a
    larger b grows every one of them and changes no pass's count (the schedule depends on PP, VPP and the number
    of micro-batches only). The same exceptions: the fused softmax kernels' b x heads/TP rule."""
    big = spec.with_(mbs=spec.mbs + extra)
    small_peaks = _peaks_or_reject(spec)
    Ls, Lb = layout(spec), layout(big)
    assume(attention_kind(Ls) == attention_kind(Lb))
    assume(te_softmax_kernel(Ls, shapes(Ls)) == te_softmax_kernel(Lb, shapes(Lb)))
    for rank, (small_peak, big_peak) in enumerate(zip(small_peaks, _peaks(big))):
        assert big_peak >= small_peak, rank


@INTERLEAVED
@given(interleaved_specs())
def test_every_interleaved_ranks_peak_does_not_decrease_with_sequence_length(spec):
    """test_peak_does_not_decrease_with_sequence_length on interleaved layouts only, rank by rank: every
    pipeline tensor of the interleaved schedule is [s/CP(/TP under SP), b, h], so doubling s grows each of them at
    every pass."""
    short = _peaks_or_reject(spec)
    for rank, (short_peak, long_peak) in enumerate(zip(short, _peaks(spec.with_(seq=2 * spec.seq)))):
        assert long_peak >= short_peak, rank


def _ckpt_input(L) -> int:
    """One checkpointed layer input: [s/CP, b, h] in the residual dtype, /TP under SP or
    --distribute-saved-activations (tensor_parallel.random.CheckpointFunction)."""
    split = L.tp if (L.sequence_parallel or L.distribute_saved_activations) else 1
    return L.seq_length // L.cp * L.micro_batch_size * L.hidden_size * (
        4 if L.fp32_residual_connection else L.act_bytes) // split


@PROPERTY
@given(specs())
def test_sequence_parallelism_does_not_raise_the_peak(spec):
    """Sequence parallelism splits the residual stream, the norms and the dropout masks over TP
    (megatron-core's SP regions). Exception, as Megatron does it: the column-parallel linears that
    all-gather their SP input into megatron's GlobalMemoryBuffer (the local implementation's layers, the
    output layer) grow that persistent buffer to one [s/CP, b, h] tensor, which shows where the peak is
    not in the activations (e.g. the embedding's weight gradient at the end of the backward)."""
    assume(spec.tp > 1 and not spec.distribute_saved)
    gathered = layout(spec).seq_length // spec.cp * spec.mbs * spec.hidden * layout(spec).act_bytes
    for off, on in zip(_peaks(spec.with_(sp=False)), _peaks(spec.with_(sp=True))):
        assert on <= off + gathered


@PROPERTY
@given(specs())
def test_the_distributed_optimizer_does_not_raise_the_peak_beyond_its_padding(spec):
    """The distributed optimizer shards the fp32 state over DP x CP; what it adds is the padding of its
    param and grad buffers (parameter starts aligned to 64 elements, bucket ends to lcm(DP x CP, 128):
    param_and_grad_buffer.py). With DP x CP = 1 that padding is all it changes."""
    assume(spec.instances == 1)
    off, on = layout(spec.with_(dist_opt=False)), layout(spec.with_(dist_opt=True))
    for p, (a, b) in enumerate(zip(estimate(off).stages, estimate(on).stages)):
        st = stage_states(on, p)
        padding = (st.buffer_numel - st.buffer_numel_unpadded) * (on.param_bytes + on.grad_bytes)
        assert b.peak_allocated_bytes <= a.peak_allocated_bytes + padding


@PROPERTY
@given(specs(), st.sampled_from([("selective", ("core_attn",)), ("selective", ("core_attn", "mlp")),
                                 ("full", "uniform", 1), ("full", "block", 1)]))
def test_recomputation_does_not_raise_the_peak(spec, recompute):
    """Recomputation keeps less per layer than it would otherwise keep. Exceptions, as Megatron does it
    (tensor_parallel.random.CheckpointFunction.backward holds the recomputed output and the gradient
    handed to it while the replayed part runs its backward): a fully recomputed block is replayed next
    to its saved input, so with one micro-batch and one layer in flight the peak can grow by one
    checkpoint input and the replayed block's output and its gradient; recomputing 'core_attn' can grow the attention's backward by what its checkpoint
    holds there: its inputs (the q, k, v projection, where without recompute GQA's repeated V is gone
    by then), the recomputed context and its gradient, and K repeated again under GQA (flash attention
    drops only the softmax statistics, and short sequences have small probs); recomputing 'mlp' by the MLP's output and its
    gradient (2 x [s, b, h], /TP under SP). And under context parallelism recomputing 'core_attn' keeps
    more per layer, not less: the checkpoint saves q, k and v (the qkv projection through v's view and
    the rope'd q and k) where TE's ring attention alone keeps q and one K/V buffer; those are skipped.
    So it can with TE's flash backend and rope, by K minus the softmax statistics per layer held: the
    checkpoint keeps the qkv projection (q + 2 K) and the rope'd q and k, where flash-attn alone keeps
    TE's contiguous [b, s, h, d] copies of q, k, v (TE 2.11 backends.py FlashAttention.forward:
    ``x.transpose(0, 1).contiguous()``), its output and the fp32 log-sum-exp: 2q + 3K against 2q + 2K + lse;
    that is allowed for each layer the stage holds at its peak (MHA: K = q > lse once d x bytes > 4)."""
    assume(not spec.distribute_saved)
    assume(not (spec.cp > 1 and recompute[0] == "selective" and "core_attn" in recompute[1]))
    base, rec = spec.with_(recompute=()), spec.with_(recompute=recompute)
    Lb, Lr = layout(base), layout(rec)
    tokens = Lr.seq_length // Lr.cp * Lr.micro_batch_size
    allowance = 0
    if recompute[0] == "full":
        # the kept input, and the replayed output and the gradient handed to it (CheckpointFunction.backward,
        # megatron-core 0.16.1 / 0.19.2; measured by the CPU referee: tests/test_referee_replay.py)
        allowance = _ckpt_input(Lr) + 2 * tokens * Lr.hidden_size * Lr.act_bytes // (Lr.tp if Lr.sequence_parallel else 1)
    else:
        if "core_attn" in recompute[1]:
            # the checkpoint's inputs (q, k, v: the whole qkv projection through its views, and the rope'd
            # q and k), the recomputed context and its gradient, and K repeated again under GQA
            gqa = Lr.num_query_groups < Lr.num_attention_heads
            # (with fewer key groups than TP ranks the projection is the whole one Attention all-gathers)
            q = tokens * Lr.num_attention_heads // Lr.tp * Lr.kv_channels * Lr.act_bytes
            k = tokens * max(1, Lr.num_query_groups // Lr.tp) * Lr.kv_channels * Lr.act_bytes
            qkv = tokens * qkv_kept_per_rank(Lr) * Lr.act_bytes
            rope_qk = q + k if Lr.position_embedding_type == "rope" else 0
            allowance += qkv + rope_qk + (3 if gqa else 2) * q
        if "mlp" in recompute[1]:
            allowance += 2 * tokens * Lr.hidden_size * Lr.act_bytes // (Lr.tp if Lr.sequence_parallel else 1)
    per_layer = flash_rope_core_attn_excess(Lr) + repeat_core_attn_excess(Lr)
    for a, b in zip(estimate(Lb).stages, estimate(Lr).stages):
        held = b.in_flight * max(c.num_layers for c in b.chunks)
        assert b.peak_allocated_bytes <= a.peak_allocated_bytes + allowance + held * per_layer


def flash_rope_core_attn_excess(L) -> int:
    """What recomputing 'core_attn' keeps per layer beyond no recompute under TE's flash backend at CP 1
    (test_recomputation_does_not_raise_the_peak's docstring): the checkpoint's q, k, v, views of a projection P (the
    rope'd q and k new beside it), against flash-attn's contiguous copies of q, k, v, its output and the fp32
    log-sum-exp [b, a/TP, s] (flash_attn_interface.py _flash_attn_forward): with rope K minus the log-sum-exp where P
    is the rank's qkv output Q + 2 K; with fewer key groups than TP ranks P is the whole projection Attention
    all-gathers, (heads + 2 groups) x head dim per token (get_query_key_value_tensors; layers/attention.py
    qkv_kept_per_rank), so P + (Q + K with rope) - 2 Q - 2 K - log-sum-exp (one rank's key groups; megatron-core
    replicates a group under TP > groups); 0 where that recompute is off or another backend runs."""
    rope = L.position_embedding_type == "rope"
    if not (L.recompute_granularity == "selective" and "core_attn" in L.recompute_modules and L.cp == 1
            and (rope or L.num_query_groups < L.tp) and select(L, None).selected == "flash"):
        return 0
    tokens = L.seq_length // L.cp * L.micro_batch_size
    e = L.act_bytes
    q = tokens * L.num_attention_heads // L.tp * L.kv_channels * e
    k = tokens * max(1, L.num_query_groups // L.tp) * L.kv_channels * e
    p = tokens * qkv_kept_per_rank(L) * e
    lse = L.micro_batch_size * L.num_attention_heads // L.tp * L.seq_length * 4
    return max(0, p + (q + k if rope else 0) - 2 * q - 2 * k - lse)


def repeat_core_attn_excess(L) -> int:
    """The bound of what recomputing 'core_attn' keeps per layer beyond no recompute where K and V are repeated for
    grouped queries (one rank's heads and key groups; a group replicated under TP > groups) and the checkpoint holds
    them as views of a projection P without the repeat: P + K - 2 Q where rope makes q and k new tensors, P - 3 Q
    without rope under replicated groups (q, k and v all views of P); the probs the checkpoint drops only lower it; 0
    elsewhere. P is the rank's qkv output Q + 2 K (so 3 K - Q with rope), or with fewer groups than TP ranks the whole
    projection Attention all-gathers, (heads + 2 groups) x head dim per token (get_query_key_value_tensors;
    layers/attention.py qkv_kept_per_rank; CPU referee gqa2_tp4_sp_recomp_core)."""
    rope = L.position_embedding_type == "rope"
    replicated = L.num_query_groups < L.tp
    if not (L.recompute_granularity == "selective" and "core_attn" in L.recompute_modules and (rope or replicated)
            and (attention_kind(L).startswith("local") or select(L, None).selected == "unfused")):
        return 0
    tokens = L.seq_length // L.cp * L.micro_batch_size
    heads, groups = L.num_attention_heads // L.tp, max(1, L.num_query_groups // L.tp)
    if groups >= heads:
        return 0
    q, k = tokens * heads * L.kv_channels * L.act_bytes, tokens * groups * L.kv_channels * L.act_bytes
    p = tokens * qkv_kept_per_rank(L) * L.act_bytes
    return max(0, p + k - 2 * q if rope else p - 3 * q)


FLASH_ROPE = Spec(backend="flash", pp=3, layers=9, vpp=3, heads=1, kv_channels=8, hidden=8, ffn=8, seq=16,
                  microbatches=6, vocab=8, rope=True, bias=False)


def test_recomputing_core_attn_keeps_more_under_flash_and_rope_by_hand():
    """The corner MEMGUARD_PROPERTY_EXAMPLES=1000 drew for the property above (2026-11-30): one layer per
    virtual stage, h = 8, one head of d = 8, s = 16, b = 1, bf16, rope, --attention-backend flash.
    Recomputing core_attn, the checkpoint keeps its inputs (megatron-core attention.py
    _checkpointed_attention_forward -> CheckpointFunction.forward's save_for_backward): the rope'd q and k
    (16 x 8 x 2 B = 256 B each) and v, a view of the qkv projection [16, 1, 24] (768 B): 1280 B. Without it,
    flash-attn keeps TE's contiguous copies of q, k, v (TE 2.11 backends.py FlashAttention.forward,
    ``transpose(0, 1).contiguous()``: 3 x 256 B), its [b, s, h, d] output (256 B) and the fp32 log-sum-exp
    [1, 1, 16] (64 B): 1088 B. So 192 B more per layer, and stage 0 of PP 3 x VPP 3 over 6 micro-batches
    holds 11 layers when its peak comes (schedules.py: (3 - 0 - 1) x 2 + (3 - 1) x 3 = 10 warm-up forwards
    of one layer each, then the 11th): 11 x 192 = 2112 B."""
    from megatron_memguard.estimator.activations import layer_activations
    base, rec = layout(FLASH_ROPE), layout(FLASH_ROPE.with_(recompute=("selective", ("core_attn",))))
    assert layer_activations(rec).total - layer_activations(base).total == 1280 - 1088
    a, b = estimate(base).stages[0], estimate(rec).stages[0]
    assert a.in_flight == b.in_flight == 11 and b.peak_phase == a.peak_phase
    assert b.peak_allocated_bytes - a.peak_allocated_bytes == 11 * 192


# ---------------------------------------------------------------------------------------------------
# Every estimate

def _schema_tables() -> tuple[dict[str, str], dict[str, str]]:
    """(top-level fields, stage fields) -> their type, from the tables of docs/json-schema.md."""
    text = open(os.path.join(ROOT, "docs", "json-schema.md")).read()
    tables = []
    for block in re.split(r"\n\s*\n", text):
        rows = re.findall(r"^\| `(\w+)` \| ([^|]+) \|", block, flags=re.M)
        if rows:
            tables.append({k: t.strip() for k, t in rows})
    return tables[0], tables[1]


_TYPES = {"string": (str,), "int": (int,), "float": (float, int), "object": (dict,), "list": (list,),
          "list of strings": (list,)}


def _check(doc: dict, fields: dict[str, str]) -> None:
    # "int, optional": written only when a feature is on (e.g. host memory with optimizer offload)
    required = {k for k, t in fields.items() if not t.endswith(", optional")}
    assert required <= set(doc), required - set(doc)
    for k, t in fields.items():
        if k not in doc:
            continue
        t = t.replace(", optional", "")
        nullable = t.endswith(" or null")
        kinds = _TYPES[t.replace(" or null", "")]
        v = doc[k]
        assert (v is None and nullable) or (isinstance(v, kinds) and not isinstance(v, bool)), (k, t, v)


@PROPERTY
@given(specs(), st.sampled_from(["gpu", "cpu"]))
def test_every_estimate_is_finite_positive_and_valid_json(spec, device):
    """Whatever Megatron accepts, memguard estimates: every term a non-negative integer, the three levels
    ordered, the peak at least what persists, and the JSON document as docs/json-schema.md gives it."""
    top, stage = _schema_tables()
    est = estimate(layout(spec), device=device, gpu_memory=80 * 2**30)
    doc = json.loads(json.dumps(est.to_dict(), allow_nan=False))
    _check(doc, top)
    assert doc["schema"] == "memguard.estimate/1" and doc["verdict"] in ("fits", "tight", "will not fit")
    assert len(doc["stages"]) == spec.pp
    for s in doc["stages"]:
        _check(s, stage)
        assert 0 < s["persistent_bytes"] <= s["peak_allocated_bytes"] <= s["peak_reserved_bytes"] <= s["device_total_bytes"]
        for t in s["terms"]:
            assert set(t) == {"name", "bytes", "group", "level", "detail"}
            assert isinstance(t["bytes"], int) and t["bytes"] >= 0 and t["group"] in GROUPS and t["level"] in LEVELS
        alloc = sum(t["bytes"] for t in s["terms"] if t["level"] == "allocated")
        assert alloc == s["peak_allocated_bytes"]
        assert s["breakdown"] == {t["name"]: t["bytes"] for t in s["terms"]}
        assert math.isfinite(s["peak_allocated_bytes"] / 2**30)
    for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
              "data_parallel_size", "micro_batch_size", "num_microbatches", "padded_vocab_size"):
        assert isinstance(doc["layout"][k], int) and doc["layout"][k] >= 1
