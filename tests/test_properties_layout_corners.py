"""Layout corners over the feature space (MoE, MTP, FP8, offload, CUDA graphs, Megatron-FSDP: tests/property_space.py
feature_specs / moe_specs, derandomized): spellings the dense-only equivalence properties
(test_properties_equivalence.py) do not reach, and directions the physics fixes (TP, DP, micro-batch, sequence),
in both Megatron eras memguard models (megatron-core 0.16.1 and 0.19.2).
"""
from __future__ import annotations

import os

from hypothesis import HealthCheck, assume, given, reject, settings, strategies as st

from megatron_memguard import estimate, layout_from_flags
from megatron_memguard.errors import ConfigError, ConfigErrors, NotModelledError
from megatron_memguard.estimator.activations import layer_activations
from megatron_memguard.estimator.params import (chunk_expert_numels, chunk_numels, chunk_params, holds_mtp,
                                                total_parameters)
from megatron_memguard.estimator.states import stage_states

from conftest import CONTAINER_ERA
from property_space import FeatureSpec, feature_specs, moe_specs
from property_spelling import _drop, _numbers, bridge_run_config
from test_properties import _ckpt_input
from test_properties_corners import bridge_moe_config
from test_properties_equivalence import _chunk_counts
from test_properties_moe_identities import (Job, _layout, _mla_and_pipeline_flags, _mla_core, _owned,  # noqa: F401
                                            _padded_buffer, _pipeline, _with, core, corner_jobs)   # (core: the megatron-core builder fixture)

EXAMPLES = int(os.environ.get("MEMGUARD_PROPERTY_EXAMPLES", "200"))
PROPERTY = settings(derandomize=True, database=None, deadline=None, max_examples=max(1, EXAMPLES // 8),
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
ERA = st.sampled_from(["0.16", "0.19"])


def _est(flags, world: int, era: str):
    """The estimate, or the example dropped where memguard refuses the combination by name (the one-line
    refusals are checked by test_properties_features)."""
    try:
        return estimate(layout_from_flags(list(flags), world_size=world, megatron_version=era))
    except (ConfigError, ConfigErrors, NotModelledError):
        reject()


def _mtp(fs: FeatureSpec) -> int:
    x = fs.extra
    return int(x[x.index("--mtp-num-layers") + 1]) if "--mtp-num-layers" in x else 0


# ---------------------------------------------------------------------------------------------------
# The same job written two ways

@PROPERTY
@given(moe_specs(), st.integers(1, 4), ERA)
def test_moe_layer_freq_integer_is_its_list(fs, k, era):
    """--moe-layer-freq k makes layer i MoE when i % k == 0; the list [1, 0, ..] written out and the Python
    expression ([1]+[0]*(k-1))*n are the same pattern (megatron/training/arguments.py moe_freq_type;
    TransformerConfig.moe_layer_freq: an int or a list of 0/1 per layer)."""
    L = fs.base.layers
    flags = _drop(fs.flags(), "--moe-layer-freq")
    a = _est(flags + ["--moe-layer-freq", str(k)], fs.world, era)
    listed = "[" + ",".join("1" if i % k == 0 else "0" for i in range(L)) + "]"
    assert _numbers(_est(flags + ["--moe-layer-freq", listed], fs.world, era)) == _numbers(a)
    if L % k == 0:
        expr = f"([1]+[0]*{k - 1})*{L // k}"
        assert _numbers(_est(flags + ["--moe-layer-freq", expr], fs.world, era)) == _numbers(a)


def _layout_string(fs: FeatureSpec) -> str:
    """The drawn split as --pipeline-model-parallel-layout, virtual-stage-major, with the MTP layers ('m')
    where megatron-core builds them without a layout: on the last stage, before the loss ('L')
    (pipeline_parallel_layer_layout.py; mtp_on_this_rank)."""
    b = fs.base
    pp, v = b.pp, b.vpp or 1
    counts = _chunk_counts(b)
    out = []
    for c in range(v):
        for r in range(pp):
            s = ("E" if (r, c) == (0, 0) else "") + "t" * counts[(r, c)]
            if (r, c) == (pp - 1, v - 1):
                s += "m" * _mtp(fs) + "L"
            out.append(s)
    return "|".join(out)


@PROPERTY
@given(feature_specs(), ERA)
def test_pipeline_layout_string_equals_the_split_flags_with_every_feature(fs, era):
    """The even / uneven / interleaved split written as a layout string gives every stage the numbers of the
    split flags, with MoE (any --moe-layer-freq), MTP on the last stage, FP8, offload and CUDA graphs on."""
    b = fs.base
    assume(b.pp > 1)
    a = _est(fs.flags(), fs.world, era)
    flags = _drop(fs.flags(), "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers",
                  "--num-virtual-stages-per-pipeline-rank")
    m = _est(flags + ["--pipeline-model-parallel-layout", _layout_string(fs)], fs.world, era)
    assert _numbers(m) == _numbers(a)


@PROPERTY
@given(feature_specs(), ERA)
def test_virtual_stage_flags_are_one_setting_with_every_feature(fs, era):
    """--num-layers-per-virtual-pipeline-stage n and --num-virtual-stages-per-pipeline-rank (layers per rank
    / n) are one setting (validate_args), with MoE, MTP and the rest drawn."""
    b = fs.base
    assume(b.pp > 1 and b.first is None and b.last is None)
    if not b.vpp:
        # the largest interleaving the rank's layers allow (the interleaved schedule: micro-batches in groups of PP)
        v = max(d for d in _divisors(b.layers // b.pp))
        assume(v > 1)
        fs = fs.with_base(vpp=v, microbatches=b.pp * max(1, b.microbatches // b.pp))
        b = fs.base
    a = _est(fs.flags(), fs.world, era)
    flags = _drop(fs.flags(), "--num-virtual-stages-per-pipeline-rank")
    per = b.layers // b.pp // b.vpp
    assert _numbers(_est(flags + ["--num-layers-per-virtual-pipeline-stage", str(per)], fs.world, era)) == _numbers(a)


@PROPERTY
@given(feature_specs(), ERA)
def test_full_recompute_of_every_layer_is_one_setting(fs, era):
    """Full recompute of every layer, written as 'uniform' with 1 layer per checkpoint or as 'block' with
    as many layers as the largest chunk has, checkpoints each layer alone (megatron/core/transformer/
    transformer_block.py _checkpointed_forward: uniform runs chunks of recompute_num_layers layers; block
    checkpoints layer l of a chunk while l < recompute_num_layers): the same numbers at every stage."""
    b = fs.base
    # (MoE recompute modules and EP overlap do not combine with full recompute: TransformerConfig)
    assume(not b.recompute or b.recompute[0] == "full")
    assume("--overlap-moe-expert-parallel-comm" not in fs.extra)
    most = max(_chunk_counts(b).values())
    assume(most >= 1)
    a = _numbers(_est(fs.with_base(recompute=("full", "uniform", 1)).flags(), fs.world, era))
    m = _numbers(_est(fs.with_base(recompute=("full", "block", most)).flags(), fs.world, era))
    if _mtp(fs):
        # ... but not the MTP depths, on the last stage: MultiTokenPredictionLayer._checkpointed_forward
        # (transformer/multi_token_prediction.py, megatron-core 0.16.1 and 0.19.2) checkpoints each depth under
        # uniform and under block warns "not supported for MTP yet. Skipping recompute." and keeps it whole
        # (counted by hand in tests/test_mtp_recompute.py); the other stages hold no MTP layer
        a, m = a[:-1], m[:-1]
    assert m == a


# ---------------------------------------------------------------------------------------------------
# Directions

@PROPERTY
@given(feature_specs(), ERA)
def test_tensor_parallelism_never_raises_a_ranks_parameters(fs, era):
    """TP splits the column / row / vocabulary-parallel weights and leaves the replicated ones (norms, the
    router, position embeddings) whole: at a fixed model, doubling TP never raises any stage's parameters.
    (The vocabulary pads to 128 x TP: ceil(V / 256 TP) x 128 <= ceil(V / 128 TP) x 128 per rank.)"""
    b = fs.base
    assume(b.seq // b.cp % (2 * b.tp) == 0 and 2 * b.tp <= 16)
    assume(b.groups is None or (b.groups % (2 * b.tp) == 0 or (2 * b.tp) % b.groups == 0))
    assume((2 * (b.groups or b.heads) * b.kv_channels) % (2 * b.tp) == 0 and b.heads % (2 * b.tp) == 0)
    assume(b.ffn % (2 * b.tp) == 0 and fs.shared_ffn % (2 * b.tp) == 0)
    big = fs.with_base(tp=2 * b.tp, dp=2 * b.dp, sp=True, distribute_saved=False)
    La = layout_of(fs, era)
    Lb = layout_of(big, era)
    for p in range(La.pp):
        assert stage_states(Lb, p).parameters <= stage_states(La, p).parameters


def layout_of(fs: FeatureSpec, era: str):
    try:
        return layout_from_flags(fs.flags(), world_size=fs.world, megatron_version=era)
    except (ConfigError, ConfigErrors, NotModelledError):
        reject()


_OPTIMIZER_TERMS = ("main_parameters", "adam_exp_avg", "adam_exp_avg_sq", "sgd_momentum")


@PROPERTY
@given(feature_specs(), ERA)
def test_more_data_parallelism_never_raises_the_optimizer_state_per_rank(fs, era):
    """The distributed optimizer shards the fp32 state over DP x CP (experts over world / (ETP x EP x PP)):
    doubling DP (the micro-batch count kept) never raises a rank's main parameters or Adam / SGD state, and
    a rank's parameters stay what they are (distrib_optimizer.py _build_model_gbuf_range)."""
    fs = fs.with_base(dist_opt=True)
    two = fs.with_base(dp=2 * fs.base.dp)
    a, m = _est(fs.flags(), fs.world, era), _est(two.flags(), two.world, era)
    for x, y in zip(a.stages, m.stages):
        assert y.parameters == x.parameters
        for t in _OPTIMIZER_TERMS:
            assert y.breakdown.get(t, 0) <= x.breakdown.get(t, 0), t
        # Megatron-FSDP's sharded state too (its optimizer group, whatever the strategy)
        opt = lambda s: sum(t.bytes for t in s.terms if str(t.group) == "optimizer" and t.name != "main_grad_copies")  # noqa: E731
        assert opt(y) <= opt(x), ({t.name: t.bytes for t in x.terms if str(t.group) == "optimizer"},
                                  {t.name: t.bytes for t in y.terms if str(t.group) == "optimizer"})


@PROPERTY
@given(feature_specs(), st.integers(1, 4), ERA)
def test_a_larger_micro_batch_never_lowers_a_stage_peak(fs, extra, era):
    """Every activation, batch tensor and transient is [s, b, ...] (or grows with the tokens b x s): a larger
    micro-batch never lowers a stage's allocated peak, with MoE, FP8, MTP, offload and CUDA graphs drawn."""
    b = fs.base
    assume(b.impl == "transformer_engine")
    a = _est(fs.flags(), fs.world, era)
    m = _est(fs.with_base(mbs=b.mbs + extra).flags(), fs.world, era)
    for x, y in zip(a.stages, m.stages):
        assert y.peak_allocated_bytes >= x.peak_allocated_bytes, (x.pp_rank, x.peak_phase, y.peak_phase)


@PROPERTY
@given(feature_specs(), ERA)
def test_a_longer_sequence_never_lowers_a_stage_peak(fs, era):
    """Doubling the sequence (CP's and SP's divisibility rules still hold) grows every [s, ...] tensor."""
    b = fs.base
    a = _est(fs.flags(), fs.world, era)
    m = _est(fs.with_base(seq=2 * b.seq).flags(), fs.world, era)
    for x, y in zip(a.stages, m.stages):
        assert y.peak_allocated_bytes >= x.peak_allocated_bytes, (x.pp_rank, x.peak_phase, y.peak_phase)


# ---------------------------------------------------------------------------------------------------
# Dense models rank by rank against megatron-core's build (tests/e2e/moe_rank_params.py, both eras)


CORE = settings(PROPERTY, max_examples=max(1, EXAMPLES // 10))


@st.composite
def dense_corner_jobs(draw) -> Job:
    """Dense GPT jobs at the corners test_properties_moe_identities' MoE space leaves out: GQA (query groups a
    divisor or a multiple of TP: megatron-core replicates KV heads when groups < TP, attention.py) or MLA, MTP
    on the last stage or inside a layout string, tied / untied, uneven first / last stages, the embedding / loss
    counted in the split, VPP, CP; every rank's parameters as megatron-core builds them."""
    tp = draw(st.sampled_from([1, 2, 4]))
    cp = draw(st.sampled_from([1, 1, 2]))
    pp = draw(st.sampled_from([1, 2, 3, 4]))
    dp = draw(st.sampled_from([1, 2]))
    mtp = draw(st.sampled_from([0, 0, 1, 2]))
    pipe = draw(_pipeline(pp, mtp))
    layers = pipe["layers"]
    mla = draw(st.integers(0, 3)) == 0
    heads = tp * draw(st.sampled_from([1, 2]))
    groups = None
    if not mla:
        groups = draw(st.sampled_from([None] + [g for g in _divisors(heads) if g % tp == 0 or tp % g == 0]))
    kv, hidden = 16, 64
    bias = draw(st.booleans()) and not mla
    glu = draw(st.booleans())
    norm = draw(st.sampled_from(["RMSNorm", "LayerNorm"]))
    untied = draw(st.booleans())
    ffn = 32 * tp
    seq = 16 * max(2 * cp if cp > 1 else 1, tp * cp)
    v = pipe.get("vpp") or 1
    mbs = draw(st.integers(1, 2))
    gbs = mbs * dp * (pp * draw(st.integers(1, 2)) if v > 1 else draw(st.integers(1, 3)))
    f = ["--transformer-impl", "transformer_engine", "--num-layers", str(layers), "--hidden-size", str(hidden),
         "--num-attention-heads", str(heads), "--kv-channels", str(kv), "--ffn-hidden-size", str(ffn),
         "--seq-length", str(seq), "--max-position-embeddings", str(seq), "--micro-batch-size", str(mbs),
         "--global-batch-size", str(gbs), "--tensor-model-parallel-size", str(tp),
         "--pipeline-model-parallel-size", str(pp), "--context-parallel-size", str(cp),
         "--tokenizer-type", "NullTokenizer", "--vocab-size", str(draw(st.sampled_from([1000, 50257]))), "--bf16",
         "--position-embedding-type", "rope", "--normalization", norm, "--hidden-dropout", "0",
         "--attention-dropout", "0"]
    if tp > 1:
        f.append("--sequence-parallel")
    if glu:
        f.append("--swiglu")
    if not bias:
        f.append("--disable-bias-linear")
    if untied:
        f.append("--untie-embeddings-and-output-weights")
    if groups is not None:
        f += ["--group-query-attention", "--num-query-groups", str(groups)]
    if mtp:
        f += ["--mtp-num-layers", str(mtp)]
    if draw(st.booleans()):
        f.append("--use-distributed-optimizer")
    mla_core = draw(_mla_core()) if mla else None
    f += _mla_and_pipeline_flags(mla_core, pipe)
    core_job = dict(num_layers=layers, hidden_size=hidden, heads=heads, kv_channels=kv, groups=groups, ffn=ffn,
                    bias=bias, glu=glu, norm=norm, tp=tp, pp=pp, vpp=pipe.get("vpp"), ep=1, etp=1, experts=None,
                    moe_ffn=None, topk=2, freq=1, untied=untied, seq=seq, mtp=mtp, mla=mla_core,
                    first=pipe.get("first"), last=pipe.get("last"), acc_emb=pipe.get("acc_emb", False),
                    acc_loss=pipe.get("acc_loss", False), layout=pipe.get("layout"))
    return Job(flags=tuple(f), world=tp * cp * pp * dp, core=core_job)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@CORE
@given(dense_corner_jobs())
def test_dense_parameters_rank_by_rank_are_megatron_cores(core, job):
    """Every (pipeline rank, virtual stage, TP rank) of a dense model builds in megatron-core the decoder
    layers memguard places there, the MTP block only where mtp_on_this_rank says, and holds the parameters
    memguard counts (the tied output copy of a later stage included); the distinct ranks' parameters, the
    TP-split ones once per TP rank and the replicated ones once, add up to memguard's total; the stage sums
    are the stage's parameters. (The first and the last TP rank are built.)"""
    L = _layout(job, core.era)
    v = L.vpp if L.vpp and L.vpp > 1 else None
    # the first and the last TP rank (the TP-split weights are the same size on every TP rank: checked on these two)
    ranks = [[p, c, t, 0, 0] for p in range(L.pp) for c in (range(v) if v else [None]) for t in sorted({0, L.tp - 1})]
    recs = core.ranks(job, L, ranks)
    by_chunk: dict[tuple[int, int], list[dict]] = {}
    for r in recs:
        by_chunk.setdefault((r["rank"][0], r["rank"][1] or 0), []).append(r)
    weighted = 0
    mtp = L.mtp_num_layers or 0
    placed = 0
    for p in range(L.pp):
        for c in L.stage_chunks(p):
            rs = by_chunk[(p, c.vpp_rank)]
            r0 = rs[0]
            assert [x[0] for x in r0["layers"]] == [c.first_layer + i for i in range(c.num_layers)], (p, c.vpp_rank)
            assert not any(x[1] for x in r0["layers"])
            placed += c.num_layers
            assert r0["mtp"] == holds_mtp(L, c), (p, c.vpp_rank)
            n = sum(q.numel for q in chunk_params(L, c))
            for r in rs:
                assert r["params"] == n, (p, c.vpp_rank, r["rank"], r["tags"])
            assert len({r["tags"]["tp_split"] for r in rs}) == 1
            weighted += L.tp * r0["tags"]["tp_split"] + r0["tags"]["replicated"]
        assert stage_states(L, p).parameters == sum(r["params"] for r in recs if r["rank"][0] == p and r["rank"][2] == 0)
    assert placed == L.num_layers
    assert weighted == total_parameters(L)


# ---------------------------------------------------------------------------------------------------
# Context parallelism


# what a layer keeps outside its core attention: the residual stream and norms, the projections' inputs, the
# dropout masks, the MLP's (dense or MoE) tensors; under CP each is [s / CP, b, ...] (megatron-core splits the
# sequence before the embedding: get_batch_on_this_cp_rank), while the attention's own items change form
# between CP 1 and CP 2 (TE's ring attention keeps q and a K/V buffer instead of the qkv projection)
ATTENTION_ITEMS = {"qkv_output", "query_rope", "key_rope", "cp_kv_buffer", "softmax_stats", "attention_probs",
                   "attention_mask_dropout", "core_attn_output"}


@PROPERTY
@given(feature_specs(), ERA)
def test_context_parallelism_halves_what_a_layer_keeps_per_token(fs, era):
    """Doubling CP (the same world: DP halved) halves every tensor a layer keeps per micro-batch outside its
    core attention, exactly (the rank's tokens s / CP halve; dropless MoE's balanced rows T k ETP with them);
    from CP 2 on, the attention's (q, the ring's K/V buffer, the softmax statistics) halve too."""
    b = fs.base
    assume(b.dp % 2 == 0 and b.impl == "transformer_engine" and b.backend != "unfused")
    assume(fs.capacity is None)      # the capacity's rows round up per expert
    two = fs.with_base(cp=2 * b.cp, dp=b.dp // 2)
    big_seq = b.seq if b.seq % (2 * 2 * b.cp) == 0 and (b.seq // (2 * b.cp)) % b.tp == 0 else None
    assume(big_seq is not None)
    La, Lb = layout_of(fs, era), layout_of(two, era)
    seen = 0
    for p in range(La.pp):
        for ca, cb in zip(La.stage_chunks(p), Lb.stage_chunks(p)):
            assert ca.layer_kinds == cb.layer_kinds
            # (FP8 / FP4 copies pad their rows and scale blocks: TE's MXFP8 / NVFP4 tensors; not linear)
            for kind in {k for k in ca.layer_kinds if not k.quantized}:
                for mask in (True, False):
                    a = layer_activations(La, mask, kind).saved
                    m = layer_activations(Lb, mask, kind).saved
                    for name, v in a.items():
                        if name in ATTENTION_ITEMS and b.cp == 1:
                            continue
                        assert name in m, (name, sorted(m))
                        if name == "moe_permute_maps" and fs.dispatcher == "flex":
                            # DeepEP's received rows are a rounded-up expectation (layers/moe.py flex_rows)
                            assert m[name] <= v <= 2 * m[name], (name, v, m[name], kind)
                        else:
                            assert 2 * m[name] == v, (name, v, m[name], kind)
                        seen += 1
    if not seen:
        reject()


# ---------------------------------------------------------------------------------------------------
# Every rank role of the layout strings: empty chunks, the embedding or the loss alone, MTP before the loss



@CORE
@given(st.one_of(corner_jobs(), dense_corner_jobs()), st.sampled_from(["gpu", "cpu"]), ERA)
def test_every_rank_role_gets_a_sane_estimate(job, device, era):
    """A stage whose chunks hold no decoder layer (the embedding or the loss alone, an empty virtual stage),
    the MTP stage, a tied later stage, uneven EP-sharded MoE stages: every term a non-negative integer, the
    allocated terms summing to the peak, persistent <= peak allocated <= reserved <= device total, and the
    stage's layers those its chunks place (summing to --num-layers over the pipeline)."""
    L = _layout(job, era)
    est = estimate(L, device=device, gpu_memory=80 * 2**30)
    assert len(est.stages) == L.pp
    assert sum(s.num_layers for s in est.stages) == L.num_layers
    for s in est.stages:
        assert s.num_layers == sum(c.num_layers for c in L.stage_chunks(s.pp_rank))
        for t in s.terms:
            assert isinstance(t.bytes, int) and t.bytes >= 0, t
        assert sum(t.bytes for t in s.terms if str(t.level) == "allocated") == s.peak_allocated_bytes
        assert 0 < s.persistent_bytes <= s.peak_allocated_bytes <= s.peak_reserved_bytes <= s.device_total_bytes
        assert s.parameters == stage_states(L, s.pp_rank).parameters


@PROPERTY
@given(feature_specs(), ERA)
def test_checkpointing_one_more_layer_never_raises_what_layers_keep(fs, era):
    """--recompute-method block with n + 1 layers checkpointed instead of n: the layer that is now
    checkpointed keeps its input instead of its activations (transformer_block.py _checkpointed_forward),
    so no stage's activations grow."""
    b = fs.base
    assume(not b.recompute or b.recompute[0] == "full")
    assume("--overlap-moe-expert-parallel-comm" not in fs.extra)
    n = b.recompute[2] if b.recompute and b.recompute[1] == "block" else 0
    a = _est(fs.with_base(recompute=("full", "block", n) if n else ()).flags(), fs.world, era)
    flags = fs.with_base(recompute=("full", "block", n + 1)).flags()
    m = _est(flags, fs.world, era)
    ckpt = _ckpt_input(layout_from_flags(list(flags), world_size=fs.world, megatron_version=era))
    for x, y in zip(a.stages, m.stages):
        held = lambda s: sum(t.bytes for t in s.terms if str(t.group) == "activations")  # noqa: E731
        if x.peak_phase.split(" of ")[0] != y.peak_phase.split(" of ")[0] \
                and y.peak_allocated_bytes <= x.peak_allocated_bytes + ckpt:
            # a layer checkpointed at the top of its chunk is replayed beside its checkpointed input, so the
            # backward can grow by that one input and become the peak, where the activations then show
            # (test_properties.py test_recomputation_does_not_raise_the_peak: the same allowance)
            continue
        assert held(y) <= held(x), (x.pp_rank, {t.name: t.bytes for t in x.terms if str(t.group) == "activations"},
                                    {t.name: t.bytes for t in y.terms if str(t.group) == "activations"})


# ---------------------------------------------------------------------------------------------------
# The corner jobs as a Megatron-Bridge run_config.yaml

def bridge_corner_config(job: Job) -> dict:
    """A corner job (MoE or dense) as a Megatron-Bridge 0.6.2 run_config.yaml: the model as TransformerConfig
    fields (GPTModelProvider is a TransformerConfig: the same names tests/e2e/moe_rank_params.py gives
    megatron-core), the Bridge defaults that differ from Megatron-LM's flags written out as
    test_properties_equivalence.bridge_run_config does."""
    c = job.core
    f = list(job.flags)

    def flag(name: str, default=None):
        return f[f.index(name) + 1] if name in f else default
    gbs, mbs = int(flag("--global-batch-size")), int(flag("--micro-batch-size"))
    m = dict(num_layers=c["num_layers"], hidden_size=c["hidden_size"], ffn_hidden_size=c["ffn"],
             num_attention_heads=c["heads"], kv_channels=c["kv_channels"],
             num_query_groups=c["groups"] or c["heads"], seq_length=c["seq"], max_position_embeddings=c["seq"],
             vocab_size=int(flag("--vocab-size")), should_pad_vocab=True, make_vocab_size_divisible_by=128,
             tensor_model_parallel_size=c["tp"], pipeline_model_parallel_size=c["pp"],
             context_parallel_size=int(flag("--context-parallel-size")),
             virtual_pipeline_model_parallel_size=c["vpp"], num_layers_in_first_pipeline_stage=c["first"],
             num_layers_in_last_pipeline_stage=c["last"], pipeline_model_parallel_layout=c["layout"],
             account_for_embedding_in_pipeline_split=c["acc_emb"], account_for_loss_in_pipeline_split=c["acc_loss"],
             sequence_parallel=c["tp"] > 1, gated_linear_unit=c["glu"],
             activation_func={"_target_": "torch.nn.functional." + ("silu" if c["glu"] else "gelu"), "_call_": False},
             normalization=c["norm"], add_bias_linear=c["bias"], position_embedding_type="rope",
             share_embeddings_and_output_weights=not c["untied"], hidden_dropout=0.0, attention_dropout=0.0,
             transformer_impl="transformer_engine", attention_backend="auto",
             bias_activation_fusion=c["glu"] or c["bias"], bias_dropout_fusion=True, apply_rope_fusion=True,
             cross_entropy_loss_fusion=False, masked_softmax_fusion=True, gradient_accumulation_fusion=True,
             bf16=True, fp16=False, params_dtype={"_target_": "torch.bfloat16", "_call_": False},
             mtp_num_layers=c["mtp"] or None)
    if c["experts"]:
        m.update(num_moe_experts=c["experts"], moe_router_topk=c["topk"], expert_model_parallel_size=c["ep"],
                 expert_tensor_parallel_size=c["etp"], moe_ffn_hidden_size=c["moe_ffn"],
                 moe_token_dispatcher_type="alltoall", moe_grouped_gemm=False, moe_router_pre_softmax=c["topk"] == 1,
                 moe_layer_freq=c["freq"], moe_shared_expert_intermediate_size=c["shared_ffn"] or None,
                 moe_shared_expert_gate=c["shared_gate"], moe_router_enable_expert_bias=c["expert_bias"],
                 moe_router_score_function="sigmoid" if c["expert_bias"] else "softmax")
    if c["mla"]:
        x = c["mla"]
        m.update(multi_latent_attention=True, q_lora_rank=x["q_lora"], kv_lora_rank=x["kv_lora"],
                 qk_head_dim=x["qk"], qk_pos_emb_head_dim=x["pe"], v_head_dim=x["v"])
    dist = "--use-distributed-optimizer" in f
    inst = int(flag("--num-distributed-optimizer-instances", 1))
    return {"_target_": "megatron.bridge.training.config.ConfigContainer", "model": m,
            "train": {"micro_batch_size": mbs, "global_batch_size": gbs},
            "dataset": {"seq_length": c["seq"], "create_attention_mask": True,
                        "skip_getting_attention_mask_from_dataset": False},
            "optimizer": {"optimizer": "adam", "use_distributed_optimizer": dist},
            "ddp": {"use_distributed_optimizer": dist, "num_distributed_optimizer_instances": inst,
                    "overlap_grad_reduce": False, "grad_reduce_in_fp32": True},
            "tokenizer": {"tokenizer_type": "NullTokenizer", "vocab_size": int(flag("--vocab-size"))},
            "mixed_precision": "bf16_mixed"}


@CORE
@given(st.one_of(corner_jobs(), dense_corner_jobs()))
def test_bridge_corner_run_config_estimates_as_the_flags(tmp_path_factory, job):
    """Layout strings, uneven stages, the embedding / loss in the split, MTP, MLA, GQA, expert bias, dense-first
    --moe-layer-freq lists: the Bridge run_config.yaml of the job gives every stage the numbers of the flags."""
    import yaml
    from megatron_memguard import resolve
    from megatron_memguard.readers.detect import read_config_file
    # (the SP / overlap flags Bridge leaves at Megatron-LM's defaults: as the flags)
    a = estimate(_layout(job, "0.19"))
    p = tmp_path_factory.mktemp("cfg") / "run_config.yaml"
    p.write_text(yaml.safe_dump(bridge_corner_config(job)))
    b = estimate(resolve(read_config_file(str(p)), world_size=job.world, megatron_version="0.19"))
    assert _numbers(b) == _numbers(a)


# ---------------------------------------------------------------------------------------------------
# A DP rank's expert shard is that of its own expert-data-parallel rank



def expert_dp_index(tp: int, cp: int, etp: int, ep: int, edp: int, instances: int, r: int) -> int:
    """The index in its expert optimizer group of the rank at index ``r`` of the dense one (TP rank 0):
    megatron-core orders a stage's ranks tp-cp-(ep)-dp for the dense grid and etp-ep-dp for the expert grid
    (parallel_state.initialize_model_parallel, RankGenerator order "tp-cp-ep-dp-pp", both eras), and each
    distributed-optimizer instance takes a run of consecutive group members (intra_partial_*_data_parallel).
    So the dense index r is the global rank tp x r (instance 0) and that rank's expert-DP position is
    global // (etp x ep), taken within the instance."""
    g = tp * r
    return (g // (etp * ep)) % (edp // instances)


def test_expert_dp_index_follows_megatron_cores_rank_generator():
    """TP 2, EP 4, DP 4 (world 8, one stage): megatron-core 0.16.1's RankGenerator gives the DP x CP groups
    [[0, 2, 4, 6], [1, 3, 5, 7]] and the expert-DP groups [[0, 4], [1, 5], [2, 6], [3, 7]] (printed by
    RankGenerator(...).get_ranks("dp-cp") / ("dp")): dense index 1 is rank 2, expert index 0; 2 and 3 are
    ranks 4 and 6, expert index 1."""
    assert [expert_dp_index(2, 1, 1, 4, 2, 1, r) for r in range(4)] == [0, 0, 1, 1]
    # TP 1, EP 2, DP 4: dense [[0, 1, 2, 3]], expert [[0, 2], [1, 3]]
    assert [expert_dp_index(1, 1, 1, 2, 2, 1, r) for r in range(4)] == [0, 0, 1, 1]


@CORE
@given(corner_jobs(), ERA, st.data())
def test_each_dp_ranks_optimizer_state_is_its_own_dense_and_expert_shard(job, era, data):
    """--dp-rank r: the rank's fp32 state is the r-th slice of each dense buffer plus, for the routed experts,
    the slices of its own position in the expert-data-parallel group (distrib_optimizer.py
    _build_model_gbuf_range per buffer), worked out with test_properties_moe_identities' buffer padding."""
    flags = tuple(x for x in job.flags if x != "--use-distributed-optimizer") + ("--use-distributed-optimizer",)
    # more data parallelism: expert-DP groups of 4 and more, where the slices' gaps make the ranks differ
    k = data.draw(st.sampled_from([1, 2, 4]))
    job = _with(Job(flags=flags, world=job.world * k, core=job.core), "--global-batch-size",
                str(k * int(flags[flags.index("--global-batch-size") + 1])))
    L = _layout(job, era)
    inst = L.num_distributed_optimizer_instances
    dense = L.dp * L.cp // inst
    ep, etp = L.parallel.expert_model_parallel_size, L.moe.etp
    edp_all = job.world // (etp * ep * L.pp)
    edp = edp_all // inst
    r = data.draw(st.integers(0, dense - 1))
    e = expert_dp_index(L.tp, L.cp, etp, ep, edp_all, inst, r)
    for p in range(L.pp):
        want = 0
        for c in L.stage_chunks(p):
            for numels, group, i in ((chunk_numels(L, c), dense, r), (chunk_expert_numels(L, c), edp, e)):
                size, spans, ends = _padded_buffer(numels, group)
                want += _owned(spans, ends, group, i)
        assert stage_states(L, p, r).exp_avg_bytes == 4 * want, (p, r, e)


EP_JOB = ("--num-layers 1 --hidden-size 40 --num-attention-heads 2 --kv-channels 20 --ffn-hidden-size 32 "
          "--seq-length 16 --max-position-embeddings 16 --micro-batch-size 1 --global-batch-size 16 --vocab-size 1000 "
          "--tokenizer-type NullTokenizer --bf16 --transformer-impl transformer_engine --position-embedding-type rope "
          "--num-experts 4 --moe-router-topk 1 --moe-router-pre-softmax --expert-model-parallel-size 2 "
          "--expert-tensor-parallel-size 1 --moe-ffn-hidden-size 20 --use-distributed-optimizer").split()


def test_expert_shards_of_each_dp_rank_by_hand():
    """TP 1, EP 2, DP 8 (world 8), one MoE layer, 2 local experts of F 20, h 40, with biases. megatron-core's
    groups (RankGenerator, core 0.16.1): DP [[0..7]], expert DP [[0, 2, 4, 6], [1, 3, 5, 7]], so DP ranks
    0..7 sit at expert-DP positions 0, 0, 1, 1, 2, 2, 3, 3. The expert buffer (SequentialMLP, registered
    fc1.weight [20, 40], fc1.bias [20], fc2.weight [40, 20], fc2.bias [40] per expert; walked in reverse, each
    start aligned to 64, the end to lcm(4, 128): param_and_grad_buffer.py) spans fc2.b 0-40, fc2.w 64-864, fc1.b
    896-916, fc1.w 960-1760, then the other expert from 1792, 3,584 elements; four slices of 896 own 840, 820,
    840, 820 parameters. Ranks 1..6 own the same dense slice, so their Adam moments differ by the expert
    slice alone: 840, 820, 820, 840, 840, 820 elements (memguard took min(r, 3): 820, 840, 820, 820, 820, 820)."""
    L = layout_from_flags(EP_JOB, world_size=8, megatron_version="0.19")
    assert [L.parallel.expert_dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    moments = [stage_states(L, 0, r).exp_avg_bytes // 4 for r in range(1, 7)]
    assert [m - moments[0] for m in moments] == [0, -20, -20, 0, 0, -20]
    # the largest shard ("max") is an upper bound of every rank's
    assert stage_states(L, 0).exp_avg_bytes // 4 >= max(moments)


@CORE
@given(corner_jobs(), ERA)
def test_context_parallelism_halves_what_mla_and_moe_layers_keep(job, era):
    """The CP halving over test_properties_moe_identities' corners (MLA, MTP, expert bias, shared experts,
    layout strings): doubling CP (twice the world, DP kept) halves every tensor a layer keeps outside its core
    attention; from CP 2 on the attention's too."""
    cp = int(job.flags[job.flags.index("--context-parallel-size") + 1])
    tp = int(job.flags[job.flags.index("--tensor-model-parallel-size") + 1])
    seq = int(job.flags[job.flags.index("--seq-length") + 1])
    assume(seq % (4 * cp) == 0 and (seq // (2 * cp)) % tp == 0)
    La = _layout(job, era)
    Lb = _layout(_with(Job(flags=job.flags, world=2 * job.world, core=job.core), "--context-parallel-size", str(2 * cp)),
                 era)
    for p in range(La.pp):
        for ca, cb in zip(La.stage_chunks(p), Lb.stage_chunks(p)):
            assert ca.layer_kinds == cb.layer_kinds
            for kind in set(ca.layer_kinds):
                a = layer_activations(La, True, kind).saved
                m = layer_activations(Lb, True, kind).saved
                for name, v in a.items():
                    if name in ATTENTION_ITEMS and cp == 1:
                        continue
                    assert name in m, (name, sorted(m))
                    assert 2 * m[name] == v, (name, v, m[name], kind)


@CORE
@given(st.one_of(corner_jobs(), dense_corner_jobs()))
def test_nemo2_corner_export_estimates_as_the_flags(tmp_path_factory, job):
    """The corner jobs as a NeMo 2 `--to-yaml` export (GPTConfig fields under model.config, as the Bridge dump
    names them; the parallel sizes under trainer.strategy: test_properties_equivalence.nemo2_config's
    layout): every stage the numbers of the flags."""
    import yaml
    from megatron_memguard import resolve
    from megatron_memguard.readers.detect import read_config_file
    from test_properties_equivalence import _NEMO2_STRATEGY
    L = _layout(job, "0.19")
    a = estimate(L)
    b = bridge_corner_config(job)
    cfg = {k: v for k, v in b["model"].items() if k not in ("should_pad_vocab", "make_vocab_size_divisible_by",
                                                            "bf16", "fp16", "params_dtype")}
    cfg.update(vocab_size=L.padded_vocab_size, _target_="nemo.collections.llm.gpt.model.base.GPTConfig")
    strategy = {k: cfg.pop(k) for k in _NEMO2_STRATEGY}
    strategy.update(_target_="nemo.lightning.pytorch.strategies.megatron_strategy.MegatronStrategy", ddp={
        "_target_": "megatron.core.distributed.distributed_data_parallel_config.DistributedDataParallelConfig",
        **b["ddp"]})
    train = b["train"]
    doc = {"_target_": "nemo.collections.llm.api.pretrain",
           "model": {"_target_": "nemo.collections.llm.gpt.model.base.GPTModel", "config": cfg},
           "trainer": {"_target_": "nemo.lightning.pytorch.trainer.Trainer", "devices": job.world, "num_nodes": 1,
                       "strategy": strategy, "plugins": {
                           "_target_": "nemo.lightning.pytorch.plugins.mixed_precision.MegatronMixedPrecision",
                           "precision": "bf16-mixed", "grad_reduce_in_fp32": True}},
           "data": {"_target_": "nemo.collections.llm.gpt.data.mock.MockDataModule", "seq_length": cfg["seq_length"],
                    "global_batch_size": train["global_batch_size"], "micro_batch_size": train["micro_batch_size"],
                    "create_attention_mask": True},
           "optim": {"_target_": "nemo.lightning.pytorch.optim.megatron.MegatronOptimizerModule", "config": {
               "_target_": "megatron.core.optimizer.optimizer_config.OptimizerConfig", "optimizer": "adam",
               "use_distributed_optimizer": b["optimizer"]["use_distributed_optimizer"], "bf16": True, "fp16": False}}}
    p = tmp_path_factory.mktemp("cfg") / "nemo2.yaml"
    p.write_text(yaml.safe_dump(doc))
    n = estimate(resolve(read_config_file(str(p)), world_size=job.world, megatron_version="0.19"))
    assert _numbers(n) == _numbers(a)




@CONTAINER_ERA[0]
@CONTAINER_ERA[1]
@CORE
@given(st.one_of(corner_jobs(), dense_corner_jobs()))
def test_hook_estimates_the_corner_jobs_as_the_cli(job):
    """Layout strings (empty stages, MTP before the loss), uneven stages, the embedding / loss in the split,
    MLA, GQA, expert bias, dense-first --moe-layer-freq lists through Megatron-LM's own parse_and_validate_args
    (core 0.19.2) and the hook's namespace reader: the numbers of the CLI flags. (What Megatron's parser refuses
    for want of Transformer Engine on this machine is left out.)"""
    from test_properties_equivalence import TRAINING, _hook_equals_cli
    _layout(job, "0.19")
    _hook_equals_cli(list(job.flags) + TRAINING, job.world, te_checks=True)


SELECTIVE = ("core_attn", "mlp", "layernorm", "moe_act", "moe", "shared_experts")


@PROPERTY
@given(feature_specs(), st.sampled_from(SELECTIVE), ERA)
def test_one_more_recomputed_module_never_raises_what_layers_keep(fs, module, era):
    """Adding a module to --recompute-modules keeps less of it per layer (its checkpoint saves its inputs,
    which the layer keeps anyway, and drops what the module made): no stage's activations grow. (Under CP,
    'core_attn' keeps q, k and v where TE's ring attention alone keeps q and one K/V buffer:
    test_properties.test_recomputation_does_not_raise_the_peak documents that exception.)"""
    b = fs.base
    assume(not b.recompute or b.recompute[0] == "selective")
    assume(not (module == "core_attn" and b.cp > 1))
    mods = tuple(b.recompute[1]) if b.recompute else ()
    assume(module not in mods)
    a = _est(fs.flags(), fs.world, era)
    more = fs.with_base(recompute=("selective", mods + (module,)))
    if module == "moe_act":
        more = more.with_(grouped=True)       # (TransformerConfig: moe_act recompute needs the grouped GEMM)
        a = _est(fs.with_(grouped=True).flags(), fs.world, era)
    m = _est(more.flags(), fs.world, era)
    for x, y in zip(a.stages, m.stages):
        held = lambda s: sum(t.bytes for t in s.terms if str(t.group) == "activations")  # noqa: E731
        assert held(y) <= held(x), (x.pp_rank, {t.name: t.bytes for t in x.terms if str(t.group) == "activations"},
                                    {t.name: t.bytes for t in y.terms if str(t.group) == "activations"})


@PROPERTY
@given(feature_specs(), ERA)
def test_the_default_dp_rank_holds_the_largest_shard(fs, era):
    """--dp-rank max (the default) is the largest optimizer shard of any DP rank: each rank's dense shard is at
    most it, and one rank's equals it (largest_shard's closed form vs rank by rank); with MoE the dense and the
    expert largest shards are taken apart, an upper bound of every rank's sum. 'last' is the stage's last rank:
    the last index of the dense group and of the expert group."""
    fs = fs.with_base(dist_opt=True)
    L = layout_of(fs, era)
    n = L.dp_shard_size
    assume(n <= 16)
    for p in sorted({0, L.pp - 1}):
        top = stage_states(L, p).exp_avg_bytes
        each = [stage_states(L, p, r).exp_avg_bytes for r in range(n)]
        assert max(each) <= top
        if L.moe is None:
            assert max(each) == top
            assert stage_states(L, p, "last").exp_avg_bytes == each[-1]


@PROPERTY
@given(feature_specs())
def test_bridge_fp8_fp4_and_mtp_run_config_estimates_as_the_flags(tmp_path_factory, fs):
    """FP8 / FP4 recipes (with the param gather) and MTP written as Bridge writes them: a MixedPrecisionConfig
    mapping under mixed_precision (which overwrites the model's precision fields: training/mixed_precision.py,
    Bridge 0.6.2) and model.mtp_num_layers; dense or MoE. Every stage the numbers of the flags."""
    import yaml
    from megatron_memguard import resolve
    from megatron_memguard.readers.detect import read_config_file
    x = list(fs.extra)
    keep = {"--fp8-format", "--fp8-recipe", "--fp8-param-gather", "--fp4-format", "--fp4-recipe", "--fp4-param-gather",
            "--mtp-num-layers"}
    flags_extra, i = [], 0
    while i < len(x):          # only the FP8 / FP4 / MTP flags of the drawn extras
        if x[i] in keep:
            n = 0 if x[i].endswith("param-gather") else 1
            flags_extra += x[i:i + 1 + n]
            i += 1 + n
        else:
            i += 1
    assume(flags_extra and fs.base.precision != "fp32")
    fs = fs.with_(extra=tuple(flags_extra))
    a = _est(fs.flags(), fs.world, "0.19")
    doc = bridge_moe_config(fs) if fs.experts else bridge_run_config(fs.base)
    b = fs.base
    mp = {"bf16": b.precision == "bf16", "fp16": b.precision == "fp16", "params_dtype": b.precision,
          "grad_reduce_in_fp32": b.precision != "fp16"}

    def val(flag):
        return flags_extra[flags_extra.index(flag) + 1]
    if "--fp8-format" in flags_extra:
        mp.update(fp8=val("--fp8-format"), fp8_recipe=val("--fp8-recipe"), fp8_param_gather="--fp8-param-gather" in flags_extra,
                  fp8_amax_history_len=1, fp8_amax_compute_algo="most_recent")
    if "--fp4-format" in flags_extra:
        mp.update(fp4=val("--fp4-format"), fp4_recipe=val("--fp4-recipe"), fp4_param_gather="--fp4-param-gather" in flags_extra)
    doc["mixed_precision"] = mp
    if "--mtp-num-layers" in flags_extra:
        doc["model"]["mtp_num_layers"] = int(val("--mtp-num-layers"))
    p = tmp_path_factory.mktemp("cfg") / "run_config.yaml"
    p.write_text(yaml.safe_dump(doc))
    try:
        r = estimate(resolve(read_config_file(str(p)), world_size=fs.world, megatron_version="0.19"))
    except (ConfigError, ConfigErrors, NotModelledError) as e:
        raise AssertionError(f"the flags estimate but the Bridge file does not: {e}")
    assert _numbers(r) == _numbers(a)
