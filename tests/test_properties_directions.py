"""Directions of the MoE, FP8, FSDP and recompute knobs (hypothesis, derandomized): turning a knob the way that
needs more memory never gives less, except where the documented storage of Megatron / Transformer Engine
says so (each exception named below with its source).

MEMGUARD_PROPERTY_EXAMPLES sets the count (default 200; each property runs a fraction of it).
"""
from __future__ import annotations

import os

from hypothesis import HealthCheck, given, reject, settings, strategies as st

from megatron_memguard import estimate, layout_from_flags, lookup_gpu
from megatron_memguard.errors import ConfigError, ConfigErrors, NotModelledError
from megatron_memguard.estimator.activations import layer_activations
from megatron_memguard.estimator.params import chunk_params
from megatron_memguard.partition import layer_kinds

from property_space import FeatureSpec, moe_specs, specs

EXAMPLES = int(os.environ.get("MEMGUARD_PROPERTY_EXAMPLES", "200"))
SOME = settings(derandomize=True, database=None, deadline=None, max_examples=max(1, EXAMPLES // 4),
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
B200 = lookup_gpu("B200")     # runs every FP8 / FP4 recipe


def _layout(flags: list[str], world: int):
    """The Layout, or (a combination memguard refuses) the refusal checked to be one line naming a flag, and
    the example dropped."""
    try:
        return layout_from_flags(flags, world_size=world)
    except (ConfigError, ConfigErrors, NotModelledError) as e:
        for err in (e.errors if isinstance(e, ConfigErrors) else [e]):
            assert "\n" not in str(err) and str(err).startswith("--"), str(err)
        reject()


def _acts(stage) -> int:
    return sum(t.bytes for t in stage.terms if str(t.group) == "activations")


def _dense(s) -> FeatureSpec:
    return FeatureSpec(base=s.with_(impl="transformer_engine", backend="auto", rope=True, distribute_saved=False))


# ---------------------------------------------------------------------------------------------------
# MoE

@SOME
@given(moe_specs())
def test_fewer_expert_ranks_double_the_experts_a_rank_holds(fs):
    """EP e -> e / 2 on the same GPUs: each rank holds E / (e / 2) local experts instead of E / e (megatron-core
    MoELayer: num_local_experts = num_moe_experts / EP), so its routed-expert parameters double exactly, and the
    stage's parameter and gradient-buffer bytes never fall (the expert optimizer shard is over twice the expert
    DP ranks: it may stay)."""
    if fs.ep == 1:
        reject()
    La, Lb = _layout(fs.flags(), fs.world), _layout(fs.with_(ep=fs.ep // 2).flags(), fs.world)
    for p in range(La.pp):
        ea = sum(q.numel for c in La.stage_chunks(p) for q in chunk_params(La, c) if q.expert)
        eb = sum(q.numel for c in Lb.stage_chunks(p) for q in chunk_params(Lb, c) if q.expert)
        assert eb == 2 * ea, p
    for a, b in zip(estimate(La, gpu=B200).stages, estimate(Lb, gpu=B200).stages):
        for term in ("parameters", "gradient_buffer"):
            assert b.breakdown.get(term, 0) >= a.breakdown.get(term, 0), (a.pp_rank, term)


@SOME
@given(moe_specs())
def test_more_experts_per_token_never_lower_the_activations(fs):
    """top-k -> top-k + 1 (softmax placement kept: --moe-router-pre-softmax on both when the job has it, as top-1
    needs it): every token is dispatched to one more expert, so the dispatcher's and experts' saved rows grow
    and nothing shrinks: each stage's activations, MoE layer activations, dispatcher state and allocated peak."""
    if fs.topk >= fs.experts:
        reject()
    pre = ("--moe-router-pre-softmax",) if fs.topk == 1 else ()
    La = _layout(fs.flags(), fs.world)
    Lb = _layout(fs.with_(topk=fs.topk + 1, extra=fs.extra + pre).flags(), fs.world)
    for a, b in zip(estimate(La, gpu=B200).stages, estimate(Lb, gpu=B200).stages):
        assert b.peak_allocated_bytes >= a.peak_allocated_bytes, a.pp_rank
        if a.in_flight == b.in_flight:
            assert _acts(b) >= _acts(a), a.pp_rank
            for term in ("moe_layer_activations", "moe_dispatcher_state"):
                assert b.breakdown.get(term, 0) >= a.breakdown.get(term, 0), (a.pp_rank, term)


@SOME
@given(moe_specs(), st.sampled_from([(1.0, 2.0), (0.5, 1.0), (1.5, 4.0)]), st.booleans())
def test_a_larger_capacity_factor_never_lowers_the_moe_activations(fs, factors, pad):
    """--moe-expert-capacity-factor c < c' (alltoall): each expert takes at most c x (balanced share) tokens, the
    rest dropped (moe_utils.get_capacity); a larger capacity never keeps fewer rows, and
    --moe-pad-expert-input-to-capacity (every expert's input padded to its capacity) never keeps fewer than the
    unpadded run at the same capacity."""
    if fs.dispatcher != "alltoall":
        reject()
    lo, hi = factors
    est = {}
    for c in (lo, hi):
        for p in ((False, True) if pad else (False,)):
            est[c, p] = estimate(_layout(fs.with_(capacity=c, pad=p).flags(), fs.world), gpu=B200).stages
    for p in ((False, True) if pad else (False,)):
        for a, b in zip(est[lo, p], est[hi, p]):
            if a.in_flight == b.in_flight:
                assert b.breakdown.get("moe_layer_activations", 0) >= a.breakdown.get("moe_layer_activations", 0)
    if pad:
        for c in (lo, hi):
            for a, b in zip(est[c, False], est[c, True]):
                if a.in_flight == b.in_flight:
                    assert b.breakdown.get("moe_layer_activations", 0) >= a.breakdown.get("moe_layer_activations", 0)


# ---------------------------------------------------------------------------------------------------
# FP8

# Transformer Engine's quantized storage that may exceed the BF16 tensor it replaces or adds to (docs/terms/fp8.md):
# linear_proj's own quantized copy of the attention output next to the BF16 one the attention keeps; the
# quantized weights of a micro-batch without the transpose cache; the experts' rows padded to the recipe's
# alignment per local expert (16, mxfp8 32: Fp8Padding / the grouped GEMM's m-split alignment)
FP8_NEW = {"fp8_proj_input", "fp8_weight_copies"}
FP8_PADDED = {"moe_expert_input", "moe_expert_activations"}
# a quantized tensor is its data in one or two usages (row-wise, column-wise: a transpose on Hopper) and its
# scales, each a separate allocation the caching allocator rounds up to 512 bytes
FP8_ROUNDING = 3 * 512


@SOME
@given(st.one_of(moe_specs(), specs(max_layers=6).map(_dense)),
       st.sampled_from([("hybrid", "tensorwise"), ("hybrid", "delayed"), ("hybrid", "blockwise"), ("e4m3", "mxfp8")]))
def test_fp8_never_keeps_more_of_a_layers_saved_tensor_than_bf16(fs, recipe):
    """Per layer kind, one micro-batch: every saved tensor of the BF16 layer is, under an FP8 recipe, at most its
    BF16 bytes (a GEMM input kept quantized: 1 byte per element per usage, where BF16 keeps 2) plus the
    allocator's rounding of the quantized pieces, except the documented ones (FP8_NEW, FP8_PADDED); the layer's
    total is at most BF16's plus those."""
    La = _layout(fs.flags(), fs.world)
    Lb = _layout(fs.flags() + ["--fp8-format", recipe[0], "--fp8-recipe", recipe[1]], fs.world)
    kinds_b = {(k.mixer, k.mlp): k for k in layer_kinds(Lb)}
    # under delayed scaling the shared expert's fc1 keeps its own quantized copy of its input (the BF16 one is the
    # router's), inside moe_shared_experts (docs/terms/fp8.md): a new tensor as FP8_NEW's, [T, h] at one byte an
    # element (T: the layer's tokens, at most s b / CP) with its rounding
    new_in_shared = (La.seq_length * La.micro_batch_size // La.context_parallel_size * La.hidden_size + FP8_ROUNDING
                     if recipe[1] == "delayed" else 0)
    for k in dict.fromkeys(layer_kinds(La)):
        a = layer_activations(La, True, k).saved
        b = layer_activations(Lb, True, kinds_b[k.mixer, k.mlp]).saved
        assert set(b) - set(a) <= FP8_NEW, set(b) - set(a)
        for name, v in a.items():
            if name not in FP8_PADDED:
                assert b.get(name, 0) <= v + FP8_ROUNDING + (name == "moe_shared_experts") * new_in_shared, (
                    k, name, v, b.get(name))
        allowed = sum(b.get(n, 0) for n in FP8_NEW) + sum(max(0, b.get(n, 0) - a.get(n, 0)) for n in FP8_PADDED)
        allowed += new_in_shared if "moe_shared_experts" in a else 0
        assert sum(b.values()) <= sum(a.values()) + allowed + FP8_ROUNDING * len(a), k


def test_fp8_delayed_shared_expert_keeps_its_fc1_copy_by_hand():
    """The case MEMGUARD_PROPERTY_EXAMPLES=300 MEMGUARD_PROPERTY_SEED=20261201 drew for the property above (corners5):
    one MoE layer, h = 16, s = 8, b = 1, a shared expert of 16 (TP 1), delayed scaling. BF16: fc1's output (the GELU's
    input) and fc2's input, 8 x 16 x 2 B each = 512 B (fc1's input is the router's). Delayed: the GELU's input still
    BF16 (256 B); fc2's input quantized column-wise, 128 B of data and a 4-byte scale, each rounded to 512 B by the
    allocator (1,024 B); fc1's own quantized copy of its input [8, 16], the same 1,024 B: 2,304 B."""
    from megatron_memguard.partition import MLP_MOE
    from property_space import Spec
    fs = FeatureSpec(base=Spec(impl="transformer_engine", backend="auto", layers=1, heads=1, kv_channels=16, hidden=16,
                               ffn=8, seq=8, mbs=1, microbatches=1, vocab=1000, rope=True, bias=False),
                     experts=2, topk=1, ep=1, etp=1, moe_ffn=8, shared_ffn=16, dispatcher="allgather")
    flags = fs.flags()
    La = _layout(flags, fs.world)
    Lb = _layout(flags + ["--fp8-format", "hybrid", "--fp8-recipe", "delayed"], fs.world)
    moe_a = next(k for k in layer_kinds(La) if k.mlp == MLP_MOE)
    moe_b = next(k for k in layer_kinds(Lb) if k.mlp == MLP_MOE)
    assert layer_activations(La, True, moe_a).saved["moe_shared_experts"] == 2 * 8 * 16 * 2
    assert layer_activations(Lb, True, moe_b).saved["moe_shared_experts"] == 8 * 16 * 2 + 2 * (512 + 512)


# ---------------------------------------------------------------------------------------------------
# Megatron-FSDP

FSDP_ORDER = ("optim_grads_params", "optim_grads", "optim", "no_shard")     # most sharded first
FSDP_KINDS = {"weights": (("fsdp_parameters",), 4), "gradients": (("fsdp_gradients",), 4),
              "optimizer": (("main_parameters", "adam_exp_avg", "adam_exp_avg_sq"), 12)}


def _fsdp_padding(L, p: int) -> int:
    """Padding elements of the stage's FSDP groups: build_data_parallel_buffer_index pads each group's bucket to
    a multiple of shard x chunk for every strategy but no_shard (megatron_fsdp param_and_grad_buffer.py, core
    0.16.1 and 0.19.2; estimator/fsdp.py padded_numel)."""
    from megatron_memguard.estimator.fsdp import padded_numel
    from megatron_memguard.estimator.fsdp_layout import chunk_groups, fsdp_spec
    from megatron_memguard.estimator.params import holds_final_norm
    spec = fsdp_spec(L)
    return sum(padded_numel(spec, g) - g.numel for c in L.stage_chunks(p)
               for g in chunk_groups(L, c.kind_runs, c.has_embedding, c.has_output, c.has_tied_output_copy,
                                     holds_final_norm(L, c)))


@SOME
@given(specs(max_layers=8))
def test_more_fsdp_sharding_never_holds_more_state_than_its_padding(s):
    """--data-parallel-sharding-strategy optim_grads_params <= optim_grads <= optim <= no_shard: each stage's
    weights, gradients and optimizer state under a more sharded strategy are at most the less sharded one's plus
    the more sharded one's bucket padding (at most 4 bytes per padding element for weights and gradients, 12 for
    fp32 main weights and the two Adam moments); optim_grads and optim shard the optimizer alike (equal)."""
    s = s.with_(impl="transformer_engine", backend="auto", rope=True, distribute_saved=False, dist_opt=True,
                optimizer="adam")
    runs = {}
    for strategy in FSDP_ORDER:
        L = _layout(s.flags() + ["--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor",
                                 "--data-parallel-sharding-strategy", strategy], s.world)
        runs[strategy] = (L, estimate(L, gpu=B200))
    for more, less in zip(FSDP_ORDER, FSDP_ORDER[1:]):
        (Lm, em), (_, el) = runs[more], runs[less]
        for x, y in zip(em.stages, el.stages):
            pad = _fsdp_padding(Lm, x.pp_rank)
            for kind, (names, per) in FSDP_KINDS.items():
                bx = sum(x.breakdown.get(n, 0) for n in names)
                by = sum(y.breakdown.get(n, 0) for n in names)
                assert bx <= by + per * pad, (more, less, x.pp_rank, kind, bx - by, pad)
                if (more, less, kind) == ("optim_grads", "optim", "optimizer"):
                    assert bx == by


# ---------------------------------------------------------------------------------------------------
# recomputation

@SOME
@given(specs(max_layers=8), st.sampled_from(["core_attn", "mlp", "layernorm"]))
def test_recomputing_one_more_module_never_keeps_more(s, module):
    """Selective recomputation of one more module (--recompute-modules, Transformer Engine) never keeps more per
    layer and micro-batch, nor more activations per stage. The exception, documented in
    docs/terms/layer_activations.md: core_attn under context parallelism, whose checkpoint keeps q, k and v
    where Transformer Engine's ring attention (AttnFuncWithCPAndKVP2P) keeps only q and its last K/V buffer."""
    s = s.with_(impl="transformer_engine", backend="auto", rope=True, distribute_saved=False)
    if module == "core_attn" and s.cp > 1:
        reject()
    mods = s.recompute[1] if s.recompute[:1] == ("selective",) else ()
    if module in mods:
        reject()
    La = _layout(s.with_(recompute=("selective", mods) if mods else ()).flags(), s.world)
    Lb = _layout(s.with_(recompute=("selective", mods + (module,))).flags(), s.world)
    assert layer_activations(Lb).total <= layer_activations(La).total
    for a, b in zip(estimate(La, gpu=B200).stages, estimate(Lb, gpu=B200).stages):
        if a.in_flight == b.in_flight:
            assert _acts(b) <= _acts(a), a.pp_rank
