"""Properties of the estimate over this round's features (MoE with EP / ETP / dispatchers / capacity /
MoE recompute modules, FP8 recipes, Megatron-FSDP strategies, optimizer offload, CUDA graphs, MTP, EP
overlap with virtual stages), drawn where Megatron accepts them (tests/property_space.py moe_specs and
feature_specs). What memguard's resolver still refuses must be one line naming a flag.

Derandomized; MEMGUARD_PROPERTY_EXAMPLES sets the count (default 200; the MoE-only properties use half).
"""
from __future__ import annotations

import json
import math
import os

from hypothesis import HealthCheck, given, reject, settings, strategies as st

from megatron_memguard import estimate, layout_from_flags
from megatron_memguard.errors import ConfigError, ConfigErrors, NotModelledError
from megatron_memguard.estimator.params import total_parameters
from megatron_memguard.estimator.result import GROUPS, LEVELS
from megatron_memguard.estimator.layers.moe import experts_use_expert_buffer
from megatron_memguard.estimator.states import _chunk_buffer, bucket_size_for, stage_states
from megatron_memguard.layout import ShardGroup
from megatron_memguard.report.text import render
from megatron_memguard.units import format_bytes

from property_space import FeatureSpec, feature_specs, moe_specs

EXAMPLES = int(os.environ.get("MEMGUARD_PROPERTY_EXAMPLES", "200"))
PROPERTY = settings(derandomize=True, database=None, deadline=None, max_examples=EXAMPLES,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
HALF = settings(PROPERTY, max_examples=max(1, EXAMPLES // 2))


def layout(fs: FeatureSpec, version: str = "0.19"):
    """The Layout, or (for a combination memguard refuses) a check that the refusal is one line naming a
    flag, and the example dropped (any spec with flags() and world: also tests/test_properties_hybrid.py's)."""
    try:
        return layout_from_flags(fs.flags(), world_size=fs.world, megatron_version=version)
    except (ConfigError, ConfigErrors, NotModelledError) as e:
        errors = e.errors if isinstance(e, ConfigErrors) else [e]
        for err in errors:
            text = str(err)
            assert "\n" not in text and text.startswith("--") and len(text) < 400, text
        reject()


# ---------------------------------------------------------------------------------------------------
# Every estimate

@PROPERTY
@given(feature_specs(), st.sampled_from(["gpu", "cpu"]))
def test_every_feature_estimate_sums_its_terms_and_orders_its_levels(fs, device):
    """Every term a non-negative integer of a known group and level; the allocated terms sum to the peak;
    peak allocated <= reserved <= device total; host terms non-negative; the JSON is the same numbers; and
    the text report (--detail, every stage) shows each term and total as the JSON does; and the MoE worst case (every token of the ETP x EP group to this rank's experts, or the capacity) is
    never below the balanced-routing estimate at any level."""
    L = layout(fs)
    est = estimate(L, device=device, gpu_memory=80 * 2**30)
    doc = json.loads(json.dumps(est.to_dict(), allow_nan=False))
    text = render(est, detail=True, colour=False, all_stages=True)
    assert len(doc["stages"]) == len(est.stages) == L.pp
    for s, d in zip(est.stages, doc["stages"]):
        for t in s.terms:
            assert isinstance(t.bytes, int) and t.bytes >= 0, t
            assert str(t.group) in GROUPS and str(t.level) in LEVELS, t
        alloc = sum(t.bytes for t in s.terms if str(t.level) == "allocated")
        assert alloc == s.peak_allocated_bytes
        assert 0 < s.persistent_bytes <= s.peak_allocated_bytes <= s.peak_reserved_bytes <= s.device_total_bytes
        assert d["peak_allocated_bytes"] == s.peak_allocated_bytes and d["device_total_bytes"] == s.device_total_bytes
        assert d["breakdown"] == s.breakdown
        assert all(t.bytes >= 0 for t in s.host_terms)
        # the text report (memguard estimate --detail, every stage) shows the same terms and totals
        block = text.split(f"pp{s.pp_rank} at its peak: ", 1)[1].split("\npp", 1)[0]
        for t in s.terms:
            assert any(r.split()[:1] == [t.name] and format_bytes(t.bytes) in r for r in block.splitlines()), t.name
        assert "= peak allocated" in block and format_bytes(s.peak_allocated_bytes) in block
        if L.moe is not None:
            assert format_bytes(s.moe["worst_case"]["peak_allocated_bytes"]) in block
            w = s.moe["worst_case"]
            assert w["peak_allocated_bytes"] >= s.peak_allocated_bytes
            assert w["peak_reserved_bytes"] >= s.peak_reserved_bytes
            assert w["device_total_bytes"] >= s.device_total_bytes
            assert s.moe["expert_rows_worst"] >= s.moe["expert_rows_balanced"] >= 0


# ---------------------------------------------------------------------------------------------------
# Parameters over EP x ETP x PP x TP

def _moe_counts(fs: FeatureSpec, L) -> tuple[int, int, int]:
    """(parameters one TP x EP x ETP rank holds, summed over the pipeline stages; of the whole model;
    routed-expert parameters of the whole model), counted from megatron-core's GPT/MoE spec by hand:
    attention (linear_qkv column-parallel, linear_proj row-parallel, its bias and the norm replicated),
    dense MLP (fc1 (2 if gated) f x h, fc2 h x f, fc2's bias replicated), MoE MLP (pre_mlp_layernorm
    and the router's [E, h] weight (and [E] bias) replicated over TP (router.py), E / EP local experts
    each with fc1 [g F / ETP, h] and fc2 [h, F / ETP] (TEGroupedLinear / SequentialMLP, biases g F / ETP
    and h: fc2's bias is whole on every ETP rank), shared experts [g Fs / TP, h] and [h, Fs / TP]
    (SharedExpertMLP, no bias) and their gate [h] replicated), the vocabulary-parallel embedding and
    output layer, the final norm."""
    b = fs.base
    h, a, d, g_ = b.hidden, b.heads, b.kv_channels, b.groups or b.heads
    tp, gl = b.tp, 2 if b.swiglu else 1
    norm = h * (1 if b.rmsnorm else 2)
    attn_sharded = (a + 2 * g_) * d * h + h * a * d + ((a + 2 * g_) * d if b.bias else 0)
    attn_repl = norm + (h if b.bias else 0)
    dense_sharded = gl * b.ffn * h + h * b.ffn + (gl * b.ffn if b.bias else 0)
    dense_repl = norm + (h if b.bias else 0)
    E, F, ep, etp = fs.experts, fs.moe_ffn, fs.ep, fs.etp
    moe_repl = norm + E * h + (E if b.bias else 0) + (h if fs.shared_gate else 0)
    moe_sharded = gl * fs.shared_ffn * h + h * fs.shared_ffn
    expert_split = gl * F * h + h * F + (gl * F if b.bias else 0)     # divided over ETP
    expert_whole = h if b.bias else 0                                 # fc2 bias: whole on each ETP rank
    pattern = fs.moe_pattern()
    n_moe = sum(pattern)
    n_dense = b.layers - n_moe
    V = L.padded_vocab_size
    emb = V * h * (2 if b.untied else 1)
    tied_copy = V * h if (not b.untied and b.pp > 1) else 0
    per_rank = (b.layers * (attn_sharded // tp + attn_repl) + n_dense * (dense_sharded // tp + dense_repl)
                + n_moe * (moe_sharded // tp + moe_repl + (E // ep) * (expert_split // etp + expert_whole))
                + norm + (emb + tied_copy) // tp)
    routed = n_moe * E * (expert_split + expert_whole)
    total = (b.layers * (attn_sharded + attn_repl) + n_dense * (dense_sharded + dense_repl)
             + n_moe * (moe_sharded + moe_repl) + routed + norm + emb)
    return per_rank, total, routed


@HALF
@given(moe_specs())
def test_moe_parameters_over_tp_ep_etp_and_pp_ranks_add_up(fs):
    """One rank of each pipeline stage holds its stage's dense weights / TP and its MoE layers' routed
    experts / (EP x ETP) (ETP x EP ranks hold every expert exactly once; only fc2's bias is whole on each
    ETP rank); the model's total is the same count with TP = EP = ETP = 1. Both against a hand count of
    megatron-core's modules (exact)."""
    L = layout(fs)
    per_rank, total, routed = _moe_counts(fs, L)
    assert total_parameters(L) == total
    assert sum(stage_states(L, p).parameters for p in range(L.pp)) == per_rank
    # the experts of all ETP x EP ranks are the model's routed experts (plus fc2's bias per ETP rank)
    b = fs.base
    per_rank_experts = sum(fs.moe_pattern()) * (fs.experts // fs.ep) * (
        ((2 if b.swiglu else 1) * fs.moe_ffn * b.hidden + b.hidden * fs.moe_ffn
         + ((2 if b.swiglu else 1) * fs.moe_ffn if b.bias else 0)) // fs.etp + (b.hidden if b.bias else 0))
    assert per_rank_experts * fs.ep * fs.etp == routed + (fs.etp - 1) * sum(fs.moe_pattern()) * fs.experts * (
        b.hidden if b.bias else 0)


@HALF
@given(moe_specs())
def test_expert_optimizer_shards_partition_the_expert_state(fs):
    """The distributed optimizer shards each chunk's expert buffer over the expert-data-parallel group,
    EDP = world / (ETP x EP x PP) (parallel_state.initialize_model_parallel): the EDP ranks' shards add up
    to the rank's routed-expert parameters exactly (the padding holds none), each rank's shard is at most
    its 1 / EDP slice, and the padding is bounded by the documented rule: parameter starts aligned to 64
    elements, each bucket's end to lcm(EDP, 128) (param_and_grad_buffer.py, megatron-core 0.19)."""
    fs = fs.with_base(dist_opt=True)
    L = layout(fs)
    edp = fs.world // (fs.etp * fs.ep * fs.base.pp)
    assert L.parallel.shard_size(ShardGroup.EXPERT_DP) == edp
    b = fs.base
    per_layer = (fs.experts // fs.ep) * (((2 if b.swiglu else 1) * fs.moe_ffn * b.hidden + b.hidden * fs.moe_ffn
                                         + ((2 if b.swiglu else 1) * fs.moe_ffn if b.bias else 0)) // fs.etp
                                        + (b.hidden if b.bias else 0))
    pattern = fs.moe_pattern()
    separate = experts_use_expert_buffer(L.moe, L.tp, L.megatron_version)
    for p in range(L.pp):
        for c in L.stage_chunks(p):
            buf, pieces = _chunk_buffer(L, c.kind_runs, False, c.has_output, False, bucket_size_for(L, c),
                                        tuple(range(edp)), ShardGroup.EXPERT_DP)
            moe_layers = sum(pattern[c.first_layer:c.first_layer + c.num_layers])
            assert buf.params == (moe_layers * per_layer if separate else 0)
            if not buf.params:
                continue
            assert sum(sum(x) for x in pieces) == buf.params
            assert buf.numel % edp == 0 and max(sum(x) for x in pieces) <= buf.numel // edp
            n_params = 2 * moe_layers * (fs.experts // fs.ep) * (2 if b.bias else 1)
            bound = len(buf.buckets) * (math.lcm(edp, 128) - 1) + 63 * n_params
            assert 0 <= buf.numel - buf.numel_unpadded <= bound


# ---------------------------------------------------------------------------------------------------
# Directions

def _peaks(fs: FeatureSpec, **kw) -> list[int]:
    return [s.peak_allocated_bytes for s in estimate(layout(fs), **kw).stages]


@PROPERTY
@given(feature_specs())
def test_fp8_never_stores_weights_below_their_primary_bytes(fs):
    """FP8 / FP4 GEMMs keep the BF16 weights (TE quantizes a cache next to them) unless --fp8-param-gather
    (--fp4-param-gather) makes the primary weights FP8 (1 byte each, Float8Tensor; NVFP4 half a byte): the
    parameter term is never below that per parameter of the rank, and without the param gather it equals
    the BF16 run's."""
    fp4 = "--fp4-format" in fs.extra
    if not fp4 and "--fp8-format" not in fs.extra:
        fs = fs.with_(extra=fs.extra + ("--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"))
    L = layout(fs)
    i = fs.extra.index("--fp4-format" if fp4 else "--fp8-format")
    gather = "--fp4-param-gather" if fp4 else "--fp8-param-gather"
    plain = fs.with_(extra=tuple(x for k, x in enumerate(fs.extra) if k not in (i, i + 1, i + 2, i + 3) and x != gather))
    L0 = layout(plain)
    per_param = 2 if fp4 else 1     # primary NVFP4 weights: half a byte each
    # Megatron-FSDP's optim_grads_params keeps 1 / (DP x CP) of the weights outside the gathered units
    shard = fs.base.dp * fs.base.cp if "optim_grads_params" in fs.extra else 1
    for p, (s, s0) in enumerate(zip(estimate(L).stages, estimate(L0).stages)):
        params = stage_states(L, p).parameters
        weights = s.breakdown.get("parameters", 0) + s.breakdown.get("fsdp_parameters", 0)
        # MXFP8 primary weights keep no bytes in the parameter buffer (its all-gather reuses the gradient
        # buffer): TE stores their row- and column-wise data outside it, in fp8_weight_columnwise
        stored = weights + s.breakdown.get("fp8_weight_columnwise", 0)
        assert stored * shard * per_param >= params
        if gather not in fs.extra:
            assert weights == s0.breakdown.get("parameters", 0) + s0.breakdown.get("fsdp_parameters", 0)


@PROPERTY
@given(feature_specs())
def test_more_micro_batches_never_lower_a_stage_peak(fs):
    """More micro-batches per step (GBS grows) never lower a stage's peak: the 1F1B warm-up keeps
    min(PP - rank, M) micro-batches in flight (interleaved: groups of PP), so more never hold fewer."""
    b = fs.base
    more = fs.with_base(microbatches=b.microbatches + (b.pp if b.vpp else 1))
    for a, m in zip(_peaks(fs), _peaks(more)):
        assert m >= a


@PROPERTY
@given(feature_specs(), st.sampled_from([0.25, 0.5, 1.0]))
def test_optimizer_offload_never_raises_the_allocated_peak(fs, fraction):
    """--optimizer-cpu-offload moves the fraction's fp32 state to the host (HybridDeviceOptimizer): the
    GPU's allocated peak never grows, and the host figure grows instead."""
    if "--optimizer-cpu-offload" not in fs.extra:
        # (validate_args: the distributed optimizer and the precision-aware optimizer, Adam only)
        fs = fs.with_base(dist_opt=True, optimizer="adam").with_(extra=fs.extra + (
            "--use-precision-aware-optimizer", "--optimizer-cpu-offload", "--optimizer-offload-fraction", str(fraction)))
    i = fs.extra.index("--optimizer-cpu-offload")
    on = layout(fs)
    off = layout(fs.with_(extra=fs.extra[:i] + fs.extra[i + 3:]))
    a, b = estimate(off), estimate(on)
    for s_off, s_on in zip(a.stages, b.stages):
        assert s_on.peak_allocated_bytes <= s_off.peak_allocated_bytes
    assert b.host_bytes_per_rank >= a.host_bytes_per_rank


@HALF
@given(moe_specs(), st.sampled_from(["attn_norm", "mlp_norm", "expert_fc1", "moe_act", "core_attn"]))
def test_activation_offload_never_raises_the_allocated_peak(fs, module):
    """Fine-grained activation offloading moves the named modules' saved tensors to the host and keeps
    only the groups in flight (offload_staging): the allocated peak never grows."""
    fs = fs.with_base(recompute=())
    base = layout(fs)
    on = layout(fs.with_(extra=("--fine-grained-activation-offloading", "--offload-modules", module)))
    for s0, s1 in zip(estimate(base).stages, estimate(on).stages):
        assert s1.peak_allocated_bytes <= s0.peak_allocated_bytes


@HALF
@given(moe_specs(), st.sampled_from([("moe",), ("moe_act",), ("shared_experts",), ("moe", "core_attn")]))
def test_moe_recompute_never_raises_what_moe_layers_keep(fs, mods):
    """Recomputing the MoE block, its activation or the shared experts (tensor_parallel.checkpoint /
    CheckpointWithoutOutput) keeps less per MoE layer, never more: the MoE layers' held activations do
    not grow."""
    if "shared_experts" in mods and not fs.shared_ffn:
        reject()
    base = fs.with_base(recompute=())
    rec = fs.with_base(recompute=("selective", mods)).with_(grouped=fs.grouped or "moe_act" in mods)
    for s0, s1 in zip(estimate(layout(base.with_(grouped=rec.grouped))).stages, estimate(layout(rec)).stages):
        assert s1.breakdown.get("moe_layer_activations", 0) <= s0.breakdown.get("moe_layer_activations", 0)
