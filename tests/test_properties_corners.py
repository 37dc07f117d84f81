"""Metamorphic properties at the corners of MoE, FP8, offload, CUDA graphs and MTP: two spellings of one job
give the same numbers, and a switch with a known effect moves exactly the terms it should
(tests/property_space.py moe_specs / feature_specs, derandomized; MEMGUARD_PROPERTY_EXAMPLES scales them).
Plus hand counts at the same corners: MXFP8 primary weights, and Megatron-FSDP's after-step bytes, whose
order across the sharding strategies the CPU referee measured."""
from __future__ import annotations

import json
import os

from hypothesis import HealthCheck, given, reject, settings, strategies as st

from megatron_memguard import estimate, layout_from_flags
from megatron_memguard.errors import ConfigError, ConfigErrors, NotModelledError

from property_space import FeatureSpec, Spec, feature_specs, moe_specs
from property_spelling import _drop, _numbers, _read, bridge_run_config

EXAMPLES = int(os.environ.get("MEMGUARD_PROPERTY_EXAMPLES", "200"))
PROPERTY = settings(derandomize=True, database=None, deadline=None, max_examples=max(1, EXAMPLES // 8),
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])

# both Megatron eras memguard models (megatron-core 0.16.1 and 0.19.2)
ERA = st.sampled_from(["0.16", "0.19"])

# what a rank keeps of its model: weights, gradients, optimizer state (result.py TermGroup)
STATE_GROUPS = ("weights", "gradients", "optimizer")


def _est(flags: list[str], world: int, version: str):
    """The estimate, or the example dropped where memguard refuses the combination by name (the one-line
    refusals are checked by test_properties_features)."""
    try:
        return estimate(layout_from_flags(flags, world_size=world, megatron_version=version))
    except (ConfigError, ConfigErrors, NotModelledError):
        reject()


def _changed(a, b) -> set[str]:
    """Names of the terms whose bytes differ on some stage."""
    out: set[str] = set()
    for x, y in zip(a.stages, b.stages):
        out |= {k for k in set(x.breakdown) | set(y.breakdown) if x.breakdown.get(k, 0) != y.breakdown.get(k, 0)}
    return out


def _states(stage) -> dict[str, int]:
    return {t.name: t.bytes for t in stage.terms if str(t.group) in STATE_GROUPS}


def _same_states(x, y) -> None:
    """Two stages keep the same parameters and state terms. A stage that peaks at the optimizer step shows
    the step's own state terms too (main_grad_copies: the step's fp32 gradient copies), which the other,
    peaking elsewhere, does not show; those are left out of the comparison."""
    sx, sy = _states(x), _states(y)
    for s, stage in ((set(sx) - set(sy), x), (set(sy) - set(sx), y)):
        assert not s or stage.peak_phase == "optimizer step", s
    assert x.parameters == y.parameters
    assert {k: sx[k] for k in set(sx) & set(sy)} == {k: sy[k] for k in set(sx) & set(sy)}


def _moe_plain(fs: FeatureSpec) -> FeatureSpec:
    """The job without the MoE-only recompute modules (a dense layer has none to recompute)."""
    rec = fs.base.recompute
    if rec[:1] == ("selective",):
        mods = tuple(m for m in rec[1] if m not in ("moe", "moe_act", "shared_experts"))
        fs = fs.with_base(recompute=("selective", mods) if mods else ())
    return fs.with_(capacity=None, pad=False)


# ---------------------------------------------------------------------------------------------------
# Mixture of experts

@PROPERTY
@given(moe_specs(), ERA)
def test_expert_tensor_parallel_unset_is_tensor_parallel(fs, era):
    """--expert-tensor-parallel-size left out is the tensor-parallel size (megatron/training/arguments.py:
    ``if args.expert_tensor_parallel_size is None: args.expert_tensor_parallel_size = args.tensor_model_
    parallel_size``, core 0.16.1 and 0.19.2): every stage's numbers equal ETP = TP written out."""
    tp = fs.base.tp
    fs = fs.with_(etp=tp, moe_ffn=tp * max(1, fs.moe_ffn // max(1, fs.etp)))
    a = _est(fs.flags(), fs.world, era)
    b = _est(_drop(fs.flags(), "--expert-tensor-parallel-size"), fs.world, era)
    assert _numbers(a) == _numbers(b)


@PROPERTY
@given(moe_specs(), ERA)
def test_expert_tensor_parallel_traded_for_expert_parallel_keeps_the_states(fs, era):
    """ETP t x EP e and ETP 1 x EP e t over the same ranks give each rank the same routed-expert elements
    ((E / e) experts split t ways vs E / (e t) whole experts: initialize_model_parallel's expert groups,
    experts.py); without biases (fc2's bias is whole on every ETP rank) and without the distributed
    optimizer (whose 64-element start padding counts tensors, not elements) every stage's weights,
    gradients and optimizer state are the same bytes. The expert GEMM shapes differ, so activations may."""
    if fs.etp == 1 or fs.experts % (fs.ep * fs.etp):
        reject()
    fs = fs.with_base(bias=False, dist_opt=False)
    a = _est(fs.flags(), fs.world, era)
    b = _est(fs.with_(ep=fs.ep * fs.etp, etp=1).flags(), fs.world, era)
    for x, y in zip(a.stages, b.stages):
        _same_states(x, y)


@PROPERTY
@given(moe_specs(), ERA)
def test_grouped_gemm_moves_only_its_workspaces(fs, era):
    """--moe-grouped-gemm (TEGroupedMLP) vs sequential experts (SequentialMLP): the same weights per local
    expert (TEGroupedLinear keeps one weight<i> per GEMM, as many tensors as SequentialMLP's fc1 / fc2), so
    parameters, gradients and optimizer state are equal; the experts save the same tensors per routed row;
    what differs is TE's multi-stream grouped-GEMM workspaces (te_grouped_gemm_workspaces) and the allocator
    slack on top. One exception, also Megatron's: the tensors come in another order (TE GroupedLinear
    registers weight0..N-1, then bias0..N-1; SequentialMLP each expert's fc1 and fc2 weight and bias), so
    with the distributed optimizer the 64-element start padding (param_and_grad_buffer.py) falls on other
    sides of the shard boundaries: a rank's fp32 optimizer shard may differ by up to 63 elements per expert
    tensor, 4 bytes each, per optimizer term."""
    if fs.base.recompute[:1] == ("selective",) and "moe_act" in fs.base.recompute[1]:
        reject()          # moe_act recompute needs the grouped GEMM (TransformerConfig)
    a = _est(fs.with_(grouped=False).flags(), fs.world, era)
    b = _est(fs.with_(grouped=True).flags(), fs.world, era)
    tensors = sum(fs.moe_pattern()) * (fs.experts // fs.ep) * (4 if fs.base.bias else 2)
    for x, y in zip(a.stages, b.stages):
        sx, sy = _states(x), _states(y)
        assert x.parameters == y.parameters and set(sx) == set(sy)
        for t in x.terms:
            if t.name not in sx:
                continue
            if str(t.group) == "optimizer" and fs.base.dist_opt:
                assert abs(sx[t.name] - sy[t.name]) <= 63 * 4 * tensors, t.name
            else:
                assert sx[t.name] == sy[t.name], t.name
    assert _changed(a, b) - {t.name for s in a.stages for t in s.terms if str(t.group) == "optimizer"} <= {
        "te_grouped_gemm_workspaces", "allocator_fragmentation"}
    assert not any("te_grouped_gemm_workspaces" in x.breakdown for x in a.stages)


@PROPERTY
@given(moe_specs(), ERA)
def test_token_dispatchers_keep_the_same_states(fs, era):
    """The allgather and alltoall token dispatchers move tokens, not weights (token_dispatcher.py): every
    stage's parameters, gradient buffers and optimizer state are the same; what they keep between layers
    (moe_dispatcher_state), their buffers and the saved activations may differ."""
    fs = fs.with_(capacity=None, pad=False)
    a = _est(fs.with_(dispatcher="allgather").flags(), fs.world, era)
    b = _est(fs.with_(dispatcher="alltoall").flags(), fs.world, era)
    for x, y in zip(a.stages, b.stages):
        _same_states(x, y)


@PROPERTY
@given(moe_specs(), ERA)
def test_moe_layer_freq_all_dense_is_the_dense_model(fs, era):
    """--moe-layer-freq [0]*L builds every layer with the dense MLP (get_gpt_decoder_block_spec picks the
    dense layer spec per 0 in the pattern): the model is the dense one, and no MoE-only term is left
    (no router, dispatcher, expert buffer or grouped-GEMM workspace). Every stage's numbers equal the same
    flags without --num-experts."""
    fs = _moe_plain(fs)
    n = fs.base.layers
    a = _est(fs.with_(freq=f"[0]*{n}").flags(), fs.world, era)
    b = _est(FeatureSpec(base=fs.base).flags(), fs.world, era)
    assert _numbers(a) == _numbers(b)


def bridge_moe_config(fs: FeatureSpec) -> dict:
    """The MoE job as a Megatron-Bridge run_config.yaml (Bridge 0.6.2 GPTModelProvider's MoE fields, named as
    TransformerConfig names them: num_moe_experts, moe_layer_freq as an int or a 0/1 list, ...)."""
    doc = bridge_run_config(fs.base)
    m = doc["model"]
    m.update(num_moe_experts=fs.experts, moe_router_topk=fs.topk, expert_model_parallel_size=fs.ep,
             expert_tensor_parallel_size=fs.etp, moe_ffn_hidden_size=fs.moe_ffn,
             moe_token_dispatcher_type=fs.dispatcher, moe_grouped_gemm=fs.grouped,
             moe_router_pre_softmax=fs.topk == 1)
    if fs.dispatcher == "flex":
        m["moe_flex_dispatcher_backend"] = "deepep"
    if fs.shared_ffn:
        m.update(moe_shared_expert_intermediate_size=fs.shared_ffn, moe_shared_expert_gate=fs.shared_gate)
    if fs.freq is not None:
        m["moe_layer_freq"] = int(fs.freq) if fs.freq.isdigit() else [int(x) for x in fs.moe_pattern()]
    if fs.capacity is not None:
        m.update(moe_expert_capacity_factor=fs.capacity, moe_pad_expert_input_to_capacity=fs.pad)
    return doc


@PROPERTY
@given(moe_specs())
def test_bridge_moe_run_config_estimates_as_the_flags(tmp_path_factory, fs):
    """A Megatron-Bridge run_config.yaml of the MoE job gives every stage the numbers of the flags."""
    a = _est(fs.flags(), fs.world, "0.19")
    b = _read(tmp_path_factory, bridge_moe_config(fs), "run_config.yaml", fs.world)
    assert _numbers(b) == _numbers(a)


# ---------------------------------------------------------------------------------------------------
# Zero-valued settings are the setting left out

@PROPERTY
@given(feature_specs(), ERA)
def test_mtp_zero_layers_is_no_mtp(fs, era):
    """--mtp-num-layers 0 builds no MTP block (core 0.19.2 gpt_model.py: ``if self.config.mtp_num_layers:``
    guards the MTP build and loss; 0 is falsy): every stage's numbers equal the flag left out."""
    if "--mtp-num-layers" in fs.extra:
        i = fs.extra.index("--mtp-num-layers")
        fs = fs.with_(extra=fs.extra[:i] + fs.extra[i + 2:])
    a = _est(fs.flags(), fs.world, era)
    assert _numbers(_est(fs.flags() + ["--mtp-num-layers", "0"], fs.world, era)) == _numbers(a)


@PROPERTY
@given(feature_specs(), ERA)
def test_cuda_graph_impl_none_and_full_scope_spellings(fs, era):
    """--cuda-graph-impl none graphs nothing whatever modules are named (arguments.py: the modules 'have no
    effect when --cuda-graph-impl=none'); with the TE implementation, the deprecated scope 'full' and an
    empty --cuda-graph-modules both capture the whole layer ('full scope is deprecated. Use empty
    cuda_graph_modules to capture the whole layer', core 0.19.2 arguments.py)."""
    if "--cuda-graph-impl" in fs.extra:
        i = fs.extra.index("--cuda-graph-impl")
        fs = fs.with_(extra=fs.extra[:i])   # the CUDA graph flags come last in feature_specs
    base = fs.flags()
    a = _est(base, fs.world, era)
    assert _numbers(_est(base + ["--cuda-graph-impl", "none"], fs.world, era)) == _numbers(a)
    te = base + ["--cuda-graph-impl", "transformer_engine"]
    whole = _est(te, fs.world, era)
    assert _numbers(_est(te + ["--cuda-graph-modules"], fs.world, era)) == _numbers(whole)
    assert _numbers(_est(te + ["--cuda-graph-modules", "full"], fs.world, era)) == _numbers(whole)


@PROPERTY
@given(feature_specs(), ERA)
def test_optimizer_offload_fraction_zero_is_the_fp32_distributed_optimizer(fs, era):
    """--optimizer-cpu-offload with fraction 0 still wraps the shards in HybridDeviceOptimizer, which moves
    nothing to the host (``offload_params_numel < offload_threshold`` never holds at threshold 0) and, with
    param_update_in_fp32=True, gives every 16-bit shard an fp32 clone on the GPU and FusedAdam fp32 state
    (optimizer/cpu_offloading/hybrid_optimizer.py, core 0.16.1 and 0.19.2). So it is not 'no offload' of
    the precision-aware optimizer (whose fp32 masters are stored as bf16 + 16-bit remainders); it is the
    plain distributed optimizer's fp32 main shard and fp32 moments, term for term, with no host bytes.
    (With fp16's 16-bit gradient buffer both cast the shard's gradients to fp32 at the step:
    fp32_param.grad = grad.to(fp32) in the hybrid optimizer, main_param.grad = model_grad.float() in
    distrib_optimizer.py, the same main_grad_copies.)"""
    if "--optimizer-cpu-offload" in fs.extra:
        i = fs.extra.index("--use-precision-aware-optimizer")
        fs = fs.with_(extra=fs.extra[:i] + fs.extra[i + 4:])
    fs = fs.with_base(dist_opt=True, optimizer="adam", precision="fp16" if fs.base.precision == "fp16" else "bf16",
                      fp32_residual=fs.base.fp32_residual and fs.base.precision != "fp32")
    plain = _est(fs.flags(), fs.world, era)
    off = _est(fs.flags() + ["--use-precision-aware-optimizer", "--optimizer-cpu-offload",
                             "--optimizer-offload-fraction", "0"], fs.world, era)
    assert _numbers(off) == _numbers(plain)
    assert off.host_bytes_per_rank == 0


# ---------------------------------------------------------------------------------------------------
# FP8

FP8_STATE_TERMS = {"fp8_scales", "allocator_fragmentation"}


@PROPERTY
@given(feature_specs(), ERA)
def test_delayed_and_tensorwise_fp8_store_the_same_weights(fs, era):
    """Delayed and per-tensor current scaling store the same Float8Tensor (1-byte data, a transpose on
    Hopper, one fp32 scale-inverse: TE tensor/float8_tensor.py), primary (--fp8-param-gather) or cached:
    every term is the same but the recipe's own state (fp8_scales: delayed scaling's amax histories and
    scales per TE module) and the allocator slack on top. (Shared experts are left out: under delayed
    scaling their fc1 keeps a quantized copy of its input besides the BF16 one, moe-fp8.md 1.9 / 2.5,
    fp8_layers.moe_saved_overrides, so their activations differ by that copy.) The saved activations may differ by
    linear_proj's input alone: megatron-core sets save_original_input on linear_proj for every recipe but delayed
    (attention.py, 0.16.1 and 0.19.2), so delayed keeps a 1-byte copy of the attention output where tensorwise
    keeps the BF16 tensor itself (estimator/fp8_layers.proj_saves_original_input). Under per-layer CUDA graphs
    the private pool (cuda_graph_pool) is the largest working memory of one graphed layer (cuda_graphs.pool_bytes),
    so it follows the layer's transients, which linear_proj's backward moves (the quantized copy of the BF16 input
    tensorwise makes, fp8_layers.proj_backward_input): test_fp8_recipe_moves_the_graph_pool_with_the_layer_by_hand."""
    if "--fp8-format" not in fs.extra:
        reject()
    if fs.shared_ffn:
        rec = fs.base.recompute
        if rec[:1] == ("selective",) and "shared_experts" in rec[1]:
            mods = tuple(m for m in rec[1] if m != "shared_experts")
            fs = fs.with_base(recompute=("selective", mods) if mods else ())
        fs = fs.with_(shared_ffn=0, shared_gate=False)
    i = fs.extra.index("--fp8-format")
    rec = fs.base.recompute
    if rec[:1] == ("selective",) and {"moe_act", "layernorm"} & set(rec[1]):
        reject()          # delayed scaling refuses these recompute modules (TransformerConfig)
    ex = list(fs.extra)
    ex[i + 1:i + 4] = ["hybrid", "--fp8-recipe", "delayed"]
    a = _est(fs.with_(extra=tuple(ex)).flags(), fs.world, era)
    ex[i + 3] = "tensorwise"
    b = _est(fs.with_(extra=tuple(ex)).flags(), fs.world, era)
    # linear_proj's input moves the activations and the backward step's requantized copy (proj_backward_input); where
    # that moves a stage's peak to another moment of the schedule, the terms held then differ (the micro-batches in
    # flight): those stages are left out (test_fp8_recipe_can_move_a_stages_peak_by_hand)
    assert _changed_at_the_same_moment(a, b) <= FP8_STATE_TERMS | {
        "layer_activations", "forward_transient", "backward_transient", "cuda_graph_pool"}


def _changed_at_the_same_moment(a, b) -> set[str]:
    """Names of the terms whose bytes differ on a stage whose peak comes at the same moment in both estimates."""
    out: set[str] = set()
    for x, y in zip(a.stages, b.stages):
        if x.peak_phase == y.peak_phase:
            out |= {k for k in set(x.breakdown) | set(y.breakdown) if x.breakdown.get(k, 0) != y.breakdown.get(k, 0)}
    return out


FP8_MOVED_PEAK = FeatureSpec(base=Spec(impl="transformer_engine", backend="auto", pp=4, layers=12, vpp=3, heads=1,
                                       kv_channels=32, hidden=32, ffn=8, seq=128, mbs=2, microbatches=4, vocab=30976,
                                       rope=True),
                             experts=4, topk=1, ep=1, etp=1, moe_ffn=24, shared_ffn=0, dispatcher="allgather",
                             extra=("--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"))


def test_fp8_recipe_can_move_a_stages_peak_by_hand():
    """The case MEMGUARD_PROPERTY_EXAMPLES=300 MEMGUARD_PROPERTY_SEED=20261130 drew for the property above (2026-11-30,
    core 0.16): PP 4 x VPP 3, one MoE layer per virtual stage, 4 micro-batches. Tensorwise's linear_proj keeps its
    BF16 input (a tensor kept anyway) where delayed keeps a 1-byte copy besides, so each layer keeps less and the
    first stage's forward with 12 layers held drops below its first backward's end (the embedding's gradient): the
    peak moves, and the micro-batches' terms held at it (embedding_indices, the MoE layers') with it. The other stages
    peak at the same forward under both recipes and differ only as the property says. (The seed drew a 32,000-word
    vocabulary; since the interleaved schedule's pipeline tensors are counted pass by pass, the first stage's last
    warm-up forward no longer carries its two receiving chunks' input and gradient pairs, and the two moments cross
    between 30,336 and 31,488 words: 30,976 here.)"""
    est = {}
    for recipe in ("delayed", "tensorwise"):
        ex = list(FP8_MOVED_PEAK.extra)
        ex[3] = recipe
        est[recipe] = estimate(layout_from_flags(FP8_MOVED_PEAK.with_(extra=tuple(ex)).flags(), world_size=4,
                                                 megatron_version="0.16"))
    a, b = est["delayed"].stages, est["tensorwise"].stages
    assert a[0].peak_phase.startswith("forward") and b[0].peak_phase.startswith("end of backward")
    assert a[0].breakdown["embedding_indices"] != b[0].breakdown["embedding_indices"]
    assert all(x.peak_phase == y.peak_phase for x, y in zip(a[1:], b[1:]))
    assert _changed_at_the_same_moment(est["delayed"], est["tensorwise"]) == {
        "layer_activations", "fp8_scales", "allocator_fragmentation"}


FP8_GRAPHED = FeatureSpec(base=Spec(impl="transformer_engine", backend="auto", layers=1, heads=1, kv_channels=16,
                                    hidden=16, ffn=8, seq=8, mbs=3, vocab=1000, rope=True, bias=False),
                          experts=2, topk=1, ep=1, etp=1, moe_ffn=8, shared_ffn=0, dispatcher="allgather",
                          extra=("--fp8-format", "hybrid", "--fp8-recipe", "tensorwise", "--cuda-graph-impl",
                                 "transformer_engine", "--cuda-graph-modules", "attn"))


def test_fp8_recipe_moves_the_graph_pool_with_the_layer_by_hand():
    """The case MEMGUARD_PROPERTY_EXAMPLES=300 with the new seed 20261130 drew for the property above (2026-11-30):
    one MoE layer, h = 16, s = 8, b = 3, TE's per-layer graphs of the attention. The graphs' private pool is the
    largest forward or backward working memory of the graphed layer (cuda_graphs.pool_bytes, an assumption of
    docs/assumptions.md); per-tensor current scaling's linear_proj saves its BF16 input and quantizes it again in
    its backward (TE 2.11 linear.py _Linear.backward; megatron-core attention.py sets save_original_input for every
    recipe but delayed), so that layer's working memory, and the pool with it, differs from delayed scaling's."""
    from megatron_memguard.estimator.activations import layer_activations
    pools, regions = [], []
    for recipe in ("delayed", "tensorwise"):
        ex = list(FP8_GRAPHED.extra)
        ex[3] = recipe
        L = layout_from_flags(FP8_GRAPHED.with_(extra=tuple(ex)).flags(), world_size=1, megatron_version="0.19")
        la = layer_activations(L)
        regions.append(max(la.fwd_transient, la.bwd_transient))
        pools.append(estimate(L).stages[0].breakdown["cuda_graph_pool"])
    assert pools == regions and pools[0] != pools[1]


# --fp8-param-gather trades the BF16 weights and TE's FP8 weight cache for primary FP8 weights: the terms
# that hold weights (result.py) and the slack on top move; gradients and optimizer state do not
PARAM_GATHER_TERMS = {"parameters", "fp8_weight_cache", "fp8_weight_columnwise", "fp8_primary_weights",
                      "allocator_fragmentation"}


@PROPERTY
@given(feature_specs(), ERA)
def test_fp8_param_gather_moves_only_weight_terms(fs, era):
    """--fp8-param-gather (--fp4-param-gather) with the distributed optimizer: the DDP parameter buffer holds the FP8 row-wise
    payload instead of BF16 (MXFP8: nothing, it all-gathers through the gradient buffer), TE keeps the rest
    of the primary weight instead of its per-iteration weight cache; the gradient buffer and every optimizer
    term stay (the fp32 main parameters are the same shards: distrib_optimizer.py). Not under Megatron-FSDP,
    where FP8 primary weights form "float8" dtype groups of their own, padded apart and with 16-bit
    gradients (megatron_fsdp param_and_grad_buffer.py; estimator/fsdp.py), so the shards move too."""
    fp4 = "--fp4-format" in fs.extra
    if not (fp4 or "--fp8-format" in fs.extra) or "--use-megatron-fsdp" in fs.extra:
        reject()
    gather = "--fp4-param-gather" if fp4 else "--fp8-param-gather"     # NVFP4: the same trade, half a byte
    fs = fs.with_base(dist_opt=True)
    ex = tuple(x for x in fs.extra if x != gather)
    a = _est(fs.with_(extra=ex).flags(), fs.world, era)
    b = _est(fs.with_(extra=ex + (gather,)).flags(), fs.world, era)
    assert _changed(a, b) <= PARAM_GATHER_TERMS


# ---------------------------------------------------------------------------------------------------
# Hand counts

MXFP8_JOB = ("--num-layers 1 --hidden-size 128 --num-attention-heads 4 --kv-channels 32 --ffn-hidden-size 256 "
             "--seq-length 128 --max-position-embeddings 128 --micro-batch-size 1 --global-batch-size 1 "
             "--vocab-size 1024 --make-vocab-size-divisible-by 128 --tokenizer-type NullTokenizer --bf16 "
             "--use-distributed-optimizer --transformer-impl transformer_engine --disable-bias-linear "
             "--normalization RMSNorm --position-embedding-type rope --fp8-format e4m3 --fp8-recipe mxfp8").split()


def _mxfp8_bytes(rows: int, cols: int) -> int:
    """One MXFP8Tensor with row- and column-wise usage (TE tensor/mxfp8_tensor.py, MXFP8Quantizer): 1-byte
    data per usage, one E8M0 scale per 32 elements per usage, the scales padded to [round128(rows),
    round4(cols / 32)] row-wise and [round4(rows / 32), round128(cols)] column-wise."""
    def up(x: int, m: int) -> int:
        return -(-x // m) * m
    return 2 * rows * cols + up(rows, 128) * up(cols // 32, 4) + up(rows // 32, 4) * up(cols, 128)


def test_mxfp8_primary_weights_by_hand():
    """One layer, h 128, 4 heads x 32, FFN 256, no biases, TP 1, DP 1 (core 0.19.2): the GEMM weights are
    linear_qkv [384, 128], linear_proj [128, 128], fc1 [256, 128], fc2 [128, 256]. Without
    --fp8-param-gather TE caches an MXFP8 copy of each next to the BF16 weights (fp8_weight_cache); with it
    the primary weights are MXFP8Tensors (fp8_weight_columnwise, 101,376 + 33,792 + 67,584 + 67,584 =
    270,336 bytes) and the DDP parameter buffer keeps only the BF16 embedding [1024, 128] and the three
    RMSNorm weights [128]: 2 x 131,456 bytes, where the BF16 run keeps 2 x 262,528 (the GEMMs' 131,072
    more). MXFP8 primary weights get no parameter buffer of their own: the all-gather reuses the gradient
    buffer (reuse_grad_buf_for_mxfp8_param_ag, param_and_grad_buffer.py), which keeps its fp32 size."""
    gemms = [(384, 128), (128, 128), (256, 128), (128, 256)]
    weights = sum(_mxfp8_bytes(r, c) for r, c in gemms)
    assert weights == 270_336
    gemm_numel = sum(r * c for r, c in gemms)
    other = 1024 * 128 + 3 * 128
    bf16 = estimate(layout_from_flags(MXFP8_JOB[:-4], world_size=1, megatron_version="0.19")).stages[0]
    cached = estimate(layout_from_flags(MXFP8_JOB, world_size=1, megatron_version="0.19")).stages[0]
    primary = estimate(layout_from_flags(MXFP8_JOB + ["--fp8-param-gather"], world_size=1,
                                         megatron_version="0.19")).stages[0]
    assert bf16.parameters == primary.parameters == gemm_numel + other
    assert bf16.breakdown["parameters"] == cached.breakdown["parameters"] == 2 * (gemm_numel + other)
    assert cached.breakdown["fp8_weight_cache"] == weights and "fp8_weight_columnwise" not in cached.breakdown
    assert primary.breakdown["parameters"] == 2 * other
    assert primary.breakdown["fp8_weight_columnwise"] == weights and "fp8_weight_cache" not in primary.breakdown
    assert primary.breakdown["gradient_buffer"] == bf16.breakdown["gradient_buffer"] == 4 * (gemm_numel + other)


def test_fsdp_optim_grads_params_holds_more_after_the_step_than_optim_grads():
    """Megatron-FSDP's persistent bytes are not monotone in the sharding strategy, and rightly: the CPU referee
    (real megatron-core 0.16.1, 4 ranks, benchmarks/results/referee-fsdp-measured.json) measured the same dense
    model holding 46,944,904 B after the optimizer step under optim_grads_params and 43,448,440 B under
    optim_grads. optim_grads_params keeps the sharded bf16 weights (3,447,296 B) and, besides them, the
    embedding and output-layer group outside the FSDP units whole (its all-gathered bucket, bf16 [4,129,792]:
    8,259,584 B) and the unit buckets start_param_sync re-gathers right after the step (four layers' bf16
    [691,200]: 5,529,600 B, the whole model being within the prefetch limit) until each unit's forward;
    optim_grads keeps the whole bf16 weights once (13,772,800 B). memguard counts these terms byte for byte
    (the storages the referee lists after the step) and its persistent bytes keep the measured order."""
    from benchmarks.referee.grids.fsdp import FSDP_GRID
    from benchmarks.referee.grids.dense import resolve_config
    from megatron_memguard.estimator.fsdp_layout import fsdp_stage_terms
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "benchmarks", "results", "referee-fsdp-measured.json")
    with open(path) as f:
        measured = {c["name"]: c["ranks"][0] for c in json.load(f)["configs"]}
    est = {}
    for cfg in FSDP_GRID:
        if cfg["name"] in ("fsdp_dense", "fsdp_dense_optim_grads"):
            L, _ = resolve_config(cfg["flags"], cfg["world_size"])
            est[cfg["name"]] = estimate(L, profile="local", device="cpu", dp_rank=0).stages[0]
            if cfg["name"] == "fsdp_dense":
                step = {t.name: t.bytes for t in fsdp_stage_terms(L, est[cfg["name"]].chunks, [0]).step_terms}
    params, grads = measured["fsdp_dense"], measured["fsdp_dense_optim_grads"]
    assert params["live_bytes_after_step"] - grads["live_bytes_after_step"] == 3_496_464
    live = {(d["dtype"], tuple(d["shape"])): d["bytes"] for d in params["after_step_top_storages"]}
    assert live[("bfloat16", (4129792,))] == 8_259_584 and live[("bfloat16", (691200,))] == 5_529_600
    p, g = est["fsdp_dense"].breakdown, est["fsdp_dense_optim_grads"].breakdown
    assert p["fsdp_non_unit_parameters"] == 8_259_584 and step["fsdp_gathered_after_step"] == 5_529_600
    assert p["fsdp_parameters"] == 3_447_296 and g["fsdp_parameters"] == 13_772_800
    assert est["fsdp_dense"].persistent_bytes - est["fsdp_dense_optim_grads"].persistent_bytes == 3_496_448


DENSE_FIRST = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --kv-channels 16 --ffn-hidden-size 128 "
               "--seq-length 128 --max-position-embeddings 128 --micro-batch-size 1 --global-batch-size 2 "
               "--vocab-size 1024 --make-vocab-size-divisible-by 128 --tokenizer-type NullTokenizer --bf16 "
               "--transformer-impl transformer_engine --disable-bias-linear --position-embedding-type rope "
               "--pipeline-model-parallel-size 2").split()


def test_placeholder_weight_gradients_follow_the_gemms_a_rank_runs():
    """TE's get_dummy_wgrad (transformer_engine/pytorch/module/base.py) caches one placeholder weight gradient
    per (shape, dtype) in the process, on the first backward of a GEMM of that shape: a rank holds only the
    shapes of the layers it runs. PP 2, --moe-layer-freq [0,1] (core 0.19.2): rank 0 runs the dense layer,
    linear_qkv [192, 64], linear_proj [64, 64], fc1 [128, 64], fc2 [64, 128]: 32,768 bf16 elements,
    65,536 bytes, as the dense model's rank 0; rank 1 runs the MoE layer, linear_qkv and linear_proj, the
    experts' fc1 [32, 64] and fc2 [64, 32], and the output layer [1024, 64]: 86,016 elements, 172,032 bytes
    (no dense fc1 / fc2, which it never runs). Before, every rank of an MoE model counted every kind's
    shapes (73,728 and 204,800 bytes)."""
    moe = "--num-experts 4 --moe-ffn-hidden-size 32 --moe-router-topk 2 --moe-layer-freq [0,1] --moe-grouped-gemm".split()
    dense = estimate(layout_from_flags(DENSE_FIRST, world_size=2, megatron_version="0.19"))
    mixed = estimate(layout_from_flags(DENSE_FIRST + moe, world_size=2, megatron_version="0.19"))
    assert dense.stages[0].breakdown["dummy_wgrads"] == mixed.stages[0].breakdown["dummy_wgrads"] == 2 * (
        192 * 64 + 64 * 64 + 128 * 64 + 64 * 128)
    assert mixed.stages[1].breakdown["dummy_wgrads"] == 2 * (192 * 64 + 64 * 64 + 32 * 64 + 64 * 32 + 1024 * 64)


@PROPERTY
@given(feature_specs(), ERA)
def test_a_dense_first_stage_is_the_dense_models_stage(fs, era):
    """--moe-layer-freq with the first stage's layers dense ([0]*k + [1]*(L - k), k layers per stage, no
    virtual stages): pipeline rank 0 builds, keeps and runs what the dense model's rank 0 does (the MoE-only
    terms belong to the ranks that run MoE layers), so its terms are the dense model's; its schedule is the
    same too. With the drawn FP8 / FP4, MTP, CUDA graph and offload flags on both."""
    b = fs.base
    if not fs.experts or b.pp == 1 or b.vpp or "--overlap-moe-expert-parallel-comm" in fs.extra:
        reject()
    per = b.layers // b.pp
    fs = _moe_plain(fs).with_(freq=f"([0]*{per}+[1]*{b.layers - per})")
    a = _est(fs.flags(), fs.world, era)
    d = _est(FeatureSpec(base=fs.base, extra=fs.extra).flags(), fs.world, era)
    assert _numbers(a)[0] == _numbers(d)[0]
