"""Properties of pipeline splits the other property files do not draw (hypothesis, derandomized): the dense layout
space of tests/property_space.py re-split over PP 2-6 ranks of 1-3 virtual stages in the three ways Megatron
takes besides the even split, in both Megatron eras memguard models (megatron-core 0.16.1 and 0.19.2):

- --pipeline-model-parallel-layout strings with 0-3 decoder layers a stage (empty stages, a rank with none) and
  the MTP block before the loss or on an earlier rank's last virtual stage (Megatron's mtp_standalone);
- --account-for-embedding/loss-in-pipeline-split, interleaved or not;
- uneven --decoder-first/last-pipeline-num-layers under virtual stages;

with --mtp-num-layers 0-2. The invariants: the ranks' parameters add up to the model's hand count, each stage's
distributed-optimizer shards partition its state, a larger micro-batch or a longer sequence never lowers a rank's
peak, DP moves only what it shards; and --microbatch-group-size-per-virtual-pipeline-stage sets the interleaved
schedule's warm-up as megatron-core's get_pp_rank_microbatches does.

Derandomized; MEMGUARD_PROPERTY_EXAMPLES sets the count (default 200, these use a quarter: each example resolves and
estimates two to four layouts).
"""
from __future__ import annotations

import os

from hypothesis import HealthCheck, assume, given, reject, settings, strategies as st

from megatron_memguard import estimate, layout_from_flags
from megatron_memguard.errors import ConfigError, ConfigErrors, NotModelledError
from megatron_memguard.estimator.activations import attention_kind
from megatron_memguard.estimator.layers.attention import te_softmax_kernel
from megatron_memguard.estimator.layers.base import shapes
from megatron_memguard.estimator.params import total_parameters
from megatron_memguard.estimator.states import stage_states

from property_space import FeatureSpec, Spec, moe_specs, specs
from property_spelling import _numbers
from test_properties import _dp_terms, _model_count
from test_properties_features import _moe_counts, layout as feature_layout

EXAMPLES = int(os.environ.get("MEMGUARD_PROPERTY_EXAMPLES", "200"))
QUARTER = settings(derandomize=True, database=None, deadline=None, max_examples=max(1, EXAMPLES // 4),
                   suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


class Split:
    """A dense job (a Spec without its own split) and the split flags that place its layers."""

    def __init__(self, spec: Spec, split: tuple, stages: tuple | None, mtp: int, era: str):
        self.spec, self.split, self.stages, self.mtp, self.era = spec, split, stages, mtp, era

    def flags(self, **kw) -> list[str]:
        return self.spec.with_(**kw).flags() + list(self.split)

    def layout(self, **kw):
        """The Layout, or the example dropped where memguard refuses the combination by name (the one-line refusals
        are checked by test_properties_features)."""
        s = self.spec.with_(**kw)
        try:
            return layout_from_flags(self.flags(**kw), world_size=s.world, megatron_version=self.era)
        except (ConfigError, ConfigErrors, NotModelledError):
            reject()

    def __repr__(self) -> str:
        return f"Split({self.spec!r}, {self.split!r}, era={self.era!r})"


def _layout_stages(draw, pp: int, v: int, mtp: int) -> tuple[list[str], int]:
    """A --pipeline-model-parallel-layout, virtual-stage-major (pp x v stages): 0-3 decoder layers each, 'E' first and
    'L' last, the D MTP layers together in one rank's last virtual stage with no decoder layer after them
    (PipelineParallelLayerLayout.validate_layer_layout, core 0.16.1 to 0.19.2: the first rank only in its last virtual
    stage)."""
    n = pp * v
    counts = [draw(st.integers(0, 3)) for _ in range(n)]
    at = n - 1
    if mtp and draw(st.booleans()):
        at = (v - 1) * pp + draw(st.integers(0, pp - 2))          # mtp_standalone: before the loss's rank
        counts[at + 1:] = [0] * (n - at - 1)
    if not sum(counts):
        counts[0] = 1
    stages = [("E" if i == 0 else "") + "t" * k + ("m" * mtp if mtp and i == at else "") + ("L" if i == n - 1 else "")
              for i, k in enumerate(counts)]
    return stages, sum(counts)


def _split(draw, pp: int, v: int, mtp: int) -> tuple[int, list[str], list[str] | None]:
    """(decoder layers, split flags, the layout string's stages or None) of one of the three splits."""
    kind = draw(st.sampled_from(["layout", "account", "uneven"]))
    flags: list[str] = []
    stages = None
    if kind == "layout":
        stages, layers = _layout_stages(draw, pp, v, mtp)
        flags = ["--pipeline-model-parallel-layout", "|".join(stages)]
    elif kind == "account":
        # the embedding (loss) counts as one layer of the even split: PP x VPP divides layers + slots
        # (get_num_layers_to_build, transformer_block.py)
        emb, loss = draw(st.sampled_from([(True, False), (False, True), (True, True)]))
        layers = pp * v * draw(st.integers(1, 3)) - emb - loss
        if layers < 1:
            layers += pp * v
        flags = (["--account-for-embedding-in-pipeline-split"] if emb else []) + (
            ["--account-for-loss-in-pipeline-split"] if loss else [])
    else:
        # TransformerConfig: first/last stage layers > 0, each a multiple of VPP, the rest even over the middle ranks;
        # with VPP a middle rank at least (megatron-core's interleaved layer offset divides by their count)
        per = v * draw(st.integers(1, 3))
        first = v * draw(st.integers(1, 4)) if draw(st.booleans()) else None
        last = v * draw(st.integers(1, 4)) if (first is None or draw(st.booleans())) else None
        middle = pp - (first is not None) - (last is not None)
        if v > 1 and not middle:
            last, middle = None, 1
        layers = (first or 0) + (last or 0) + middle * per
        flags = (["--decoder-first-pipeline-num-layers", str(first)] if first is not None else []) + (
            ["--decoder-last-pipeline-num-layers", str(last)] if last is not None else [])
    if v > 1 and kind != "layout":
        flags += ["--num-virtual-stages-per-pipeline-rank", str(v)]
    return layers, flags, stages


@st.composite
def split_jobs(draw, interleaved: bool = False) -> Split:
    """``interleaved``: 2-3 virtual stages a rank (else 1-3)."""
    spec = draw(specs(max_layers=12))
    pp, v = draw(st.integers(2, 6)), draw(st.sampled_from([2, 3] if interleaved else [1, 1, 2, 3]))
    mtp = draw(st.sampled_from([0, 0, 1, 2]))
    layers, flags, stages = _split(draw, pp, v, mtp)
    rec = spec.recompute
    if rec[:1] == ("full",):
        rec = ("full", rec[1], min(rec[2], layers))
    spec = spec.with_(pp=pp, layers=layers, first=None, last=None, vpp=None, recompute=rec, impl="transformer_engine",
                      # the interleaved schedule takes micro-batches in groups of PP
                      microbatches=pp * draw(st.integers(1, 2)) if v > 1 else spec.microbatches)
    if mtp:
        # validate_args: MTP needs rope (or no position embedding); MultiTokenPredictionLayer's checkpointed forward
        # asserts recompute_num_layers == 1 under full recompute (the drawn full recompute dropped)
        spec = spec.with_(rope=True)
        if spec.recompute[:1] == ("full",):
            spec = spec.with_(recompute=(), distribute_saved=False)
        flags += ["--mtp-num-layers", str(mtp)]
    return Split(spec, tuple(flags), tuple(stages) if stages else None, mtp, draw(st.sampled_from(["0.16", "0.19"])))


# ---------------------------------------------------------------------------------------------------
# Parameters

def _rank_sum(job: Split, L) -> int:
    """Parameters of one TP rank of every pipeline stage together, by hand from megatron-core's GPT modules: each
    decoder layer once (its column/row-parallel weights / TP, norms and row-parallel biases whole), the final norm
    once, the learned position embedding with the first stage's embedding, the vocabulary-parallel word embedding
    [V / TP, h] on every chunk that embeds (the first, pre_process, and the MTP block's when it is another chunk:
    GPTModel builds its embedding when pre_process or mtp_process, gpt_model.py, 0.16.1 / 0.19.2), and the output
    layer [V / TP, h] on the last stage unless it is tied on the same chunk (PP > 1 here: a tied output keeps its own
    copy); per MTP depth enorm, hnorm and final_layernorm, eh_proj [h / TP, 2 h] and one decoder layer
    (multi_token_prediction.py)."""
    s, t = job.spec, job.spec.tp
    h, a, d, g = s.hidden, s.heads, s.kv_channels, s.groups or s.heads
    norm = h * (1 if s.rmsnorm else 2)
    fc1 = (2 if s.swiglu else 1) * s.ffn
    sharded = (a + 2 * g) * d * h + h * a * d + fc1 * h + h * s.ffn + ((a + 2 * g) * d + fc1 if s.bias else 0)
    layer = sharded // t + 2 * norm + (2 * h if s.bias else 0)
    word = L.padded_vocab_size * h // t
    out = s.layers * layer + norm + (0 if s.rope else s.seq * h) + 2 * word
    if job.mtp:
        out += job.mtp * (3 * norm + 2 * h * h // t + layer)
        # the MTP block's own embedding unless it sits on the first chunk (a layout 'E...m|...|L' at VPP 1)
        if not (job.stages and "m" in job.stages[0]):
            out += word
    return out


@QUARTER
@given(split_jobs())
def test_parameters_of_any_split_add_up_to_the_hand_count(job):
    """Every decoder layer, the final norm and the MTP depths live on exactly one chunk, whatever the split; what is
    there twice is a copy Megatron keeps in sync (the tied output weight on the last stage, the MTP block's word
    embedding): one TP rank of all stages together holds _rank_sum, and the model's total is test_properties'
    hand count (no copy) plus the MTP depths whole. A rank whose stages of a layout string hold no decoder layer, no
    'E', 'm' or 'L' holds no parameter."""
    L = job.layout()
    s = job.spec
    total, _ = _model_count(s, L)
    h, a, d, g = s.hidden, s.heads, s.kv_channels, s.groups or s.heads
    norm = h * (1 if s.rmsnorm else 2)
    fc1 = (2 if s.swiglu else 1) * s.ffn
    layer = ((a + 2 * g) * d * h + h * a * d + fc1 * h + h * s.ffn + ((a + 2 * g) * d + fc1 if s.bias else 0)
             + 2 * norm + (2 * h if s.bias else 0))
    assert total_parameters(L) == total + job.mtp * (3 * norm + 2 * h * h + layer)
    assert sum(stage_states(L, p).parameters for p in range(L.pp)) == _rank_sum(job, L)
    if job.stages:
        v = len(job.stages) // s.pp
        for p in range(s.pp):
            mine = [job.stages[c * s.pp + p] for c in range(v)]
            assert sum(x.count("t") for x in mine) == sum(c.num_layers for c in L.chunks if c.pp_rank == p)
            if not any(mine):
                assert stage_states(L, p).parameters == 0, (p, mine)


@st.composite
def moe_split_jobs(draw) -> tuple[FeatureSpec, tuple, str]:
    """A job of tests/property_space.py's moe_specs re-split over PP 2-4 (the world still divides into ETP x EP x PP:
    moe_specs draws DP for TP x CP x DP to hold ETP x EP), its --moe-layer-freq rewritten for the new layer count."""
    fs = draw(moe_specs())
    pp, v = draw(st.integers(2, 4)), draw(st.sampled_from([1, 1, 2]))
    layers, flags, _ = _split(draw, pp, v, 0)
    b = fs.base
    rec = b.recompute
    if rec[:1] == ("full",):
        rec = ("full", rec[1], min(rec[2], layers))
    freq = fs.freq
    if freq is not None and not freq.isdigit():
        freq = f"([0]*1+[1]*{layers - 1})" if layers > 1 else None
    fs = fs.with_(freq=freq).with_base(pp=pp, layers=layers, vpp=None, first=None, last=None, recompute=rec,
                                       microbatches=pp * draw(st.integers(1, 2)) if v > 1 else b.microbatches)
    return fs, tuple(flags), draw(st.sampled_from(["0.16", "0.19"]))


@QUARTER
@given(moe_split_jobs())
def test_moe_parameters_of_any_split_add_up_to_the_hand_count(job):
    """test_properties_features' MoE hand count over TP x EP x ETP x PP, whatever the split: one TP x EP x ETP rank of
    every stage together holds the same parameters however the layers, dense or MoE, are placed (layout strings with
    empty stages, embedding / loss slots, uneven first / last stages, interleaved or not), and the model's total is
    the same count with TP = EP = ETP = 1."""
    fs, split, era = job
    written = fs.with_(extra=fs.extra + split)
    L = feature_layout(written, era)
    per_rank, total, _ = _moe_counts(fs, L)
    assert total_parameters(L) == total
    assert sum(stage_states(L, p).parameters for p in range(L.pp)) == per_rank


def test_an_mtp_block_on_the_first_rank_and_an_empty_rank_by_hand():
    """One corner the property above draws, counted by hand: layout 'Ettm||L' (PP 3, VPP 1), h 64, 4 heads of 16,
    FFN 128, RMSNorm, no biases, tied, rope, vocabulary 1000 padded to 1024 (TP 1). The first stage embeds and holds
    both decoder layers and the MTP depth (no embedding copy: pre_process and mtp_process on one chunk); the middle
    rank holds nothing; the last holds the loss's tied output copy [1024, 64] only (the final norm is on the stage of
    the last decoder layer: TransformerBlock.has_final_layernorm_in_this_stage, 0.16.1 / 0.19.2).
    A layer: 2 norms 128 + qkv 3 x 64 x 64 = 12,288 + proj 4,096 + fc1 128 x 64 = 8,192 + fc2 8,192 = 32,896.
    The MTP depth: enorm, hnorm, final_layernorm 3 x 64 + eh_proj 64 x 128 = 8,192 + a layer = 41,280."""
    spec = Spec(layers=2, pp=3, heads=4, kv_channels=16, hidden=64, ffn=128, seq=64, rmsnorm=True, rope=True,
                bias=False)
    flags = spec.flags() + ["--pipeline-model-parallel-layout", "Ettm||L", "--mtp-num-layers", "1"]
    for era in ("0.16", "0.19"):
        L = layout_from_flags(flags, world_size=3, megatron_version=era)
        assert L.padded_vocab_size == 1024
        layer = 2 * 64 + 3 * 64 * 64 + 64 * 64 + 128 * 64 + 64 * 128
        assert layer == 32_896
        depth = 3 * 64 + 64 * 128 + layer
        assert depth == 41_280
        # stage 0: word embedding 65,536 + 2 layers + the final norm 64 + the MTP depth
        assert [stage_states(L, p).parameters for p in range(3)] == [65_536 + 2 * layer + 64 + depth, 0, 65_536]
        assert total_parameters(L) == 65_536 + 2 * layer + 64 + depth == 172_672


# ---------------------------------------------------------------------------------------------------
# Optimizer state

@QUARTER
@given(split_jobs())
def test_distributed_optimizer_shards_of_any_split_partition_each_stage(job):
    """test_properties' shard rule on every split: each stage's DDP buffer (its chunks' buckets, the MTP block's and
    the embedding copies' included) is cut into DP x CP / instances equal slices; the ranks' fp32 shards add up to the
    stage's parameters and none exceeds its slice (distrib_optimizer.py _build_model_gbuf_range). An empty rank
    holds none."""
    L = job.layout(dist_opt=True)
    n = L.dp_shard_size
    for p in range(L.pp):
        st_ = stage_states(L, p)
        shards = [stage_states(L, p, r).exp_avg_bytes // 4 for r in range(n)]
        assert sum(shards) == st_.parameters, p
        assert st_.buffer_numel % n == 0 and max(shards) <= st_.buffer_numel // n, p


@QUARTER
@given(split_jobs(), st.sampled_from([1, 2, 3, 4, 8]))
def test_data_parallelism_moves_only_what_it_shards_on_any_split(job, dp):
    """test_properties' DP rule on every split: DP replicates each stage, so per rank it changes only what the
    distributed optimizer shards over DP x CP and the DP communicator (the micro-batch count kept)."""
    s = job.spec
    assume(dp != s.dp and (s.instances == 1 or (dp * s.cp) % s.instances == 0))
    a, b = estimate(job.layout()), estimate(job.layout(dp=dp))
    skip = _dp_terms(a.layout)
    for sa, sb in zip(a.stages, b.stages):
        assert sa.parameters == sb.parameters
        ta = {k: v for k, v in sa.breakdown.items() if k not in skip}
        tb = {k: v for k, v in sb.breakdown.items() if k not in skip}
        if sa.peak_phase == sb.peak_phase:
            assert ta == tb, sa.pp_rank
        else:
            # the peak moved between the schedule and the optimizer step (test_properties' exception)
            assert "optimizer step" in (sa.peak_phase, sb.peak_phase)
            assert all(ta[k] == tb[k] for k in set(ta) & set(tb) if k != "pipeline_inputs_retained")


# ---------------------------------------------------------------------------------------------------
# Directions

@QUARTER
@given(split_jobs(), st.integers(1, 4))
def test_a_larger_micro_batch_never_lowers_a_peak_of_any_split(job, extra):
    """Every activation, pipeline tensor and transient is [s, b, ...]; the schedule depends on PP, VPP and the
    number of micro-batches only, so on any split (empty stages, a standalone MTP rank, embedding / loss slots) a
    larger micro-batch lowers no rank's peak. The same exceptions as test_properties': TE's and the local fused
    softmax kernels' b x heads / TP rule."""
    Ls, Lb = job.layout(), job.layout(mbs=job.spec.mbs + extra)
    assume(attention_kind(Ls) == attention_kind(Lb))
    assume(te_softmax_kernel(Ls, shapes(Ls)) == te_softmax_kernel(Lb, shapes(Lb)))
    for x, y in zip(estimate(Ls).stages, estimate(Lb).stages):
        assert y.peak_allocated_bytes >= x.peak_allocated_bytes, (x.pp_rank, x.peak_phase, y.peak_phase)


@QUARTER
@given(split_jobs())
def test_a_longer_sequence_never_lowers_a_peak_of_any_split(job):
    """Doubling the sequence (CP's and SP's divisibility rules still hold) grows every [s, ...] tensor on every rank
    of any split."""
    Ls, Ll = job.layout(), job.layout(seq=2 * job.spec.seq)
    assume(attention_kind(Ls) == attention_kind(Ll))
    for x, y in zip(estimate(Ls).stages, estimate(Ll).stages):
        assert y.peak_allocated_bytes >= x.peak_allocated_bytes, (x.pp_rank, x.peak_phase, y.peak_phase)


# ---------------------------------------------------------------------------------------------------
# The interleaved schedule's micro-batch groups

@QUARTER
@given(split_jobs(interleaved=True), st.integers(0, 4), st.data())
def test_micro_batch_group_size_sets_the_interleaved_warmup(job, extra_m, data):
    """--microbatch-group-size-per-virtual-pipeline-stage G (PP <= G <= M, a last partial group of PP or more:
    forward_backward_pipelining_with_interleaving) runs (PP - rank - 1) x 2 + (VPP - 1) x G warm-up forwards, all M x
    VPP at most, and one more unless the warm-up took them all (get_pp_rank_microbatches, schedules.py 0.16.1 /
    0.19.2): the most (micro-batch, chunk) forwards a rank holds. G = PP is Megatron's default (the flag's None)."""
    pp = job.spec.pp
    m = job.spec.microbatches + extra_m * pp
    g = data.draw(st.sampled_from([g for g in range(pp, m + 1) if m % g == 0 or m % g >= pp]))
    s = job.spec.with_(microbatches=m)
    plain = Split(s, job.split, job.stages, job.mtp, job.era)
    L = plain.layout()
    v = L.vpp
    grouped = Split(s, job.split + ("--microbatch-group-size-per-virtual-pipeline-stage", str(g)), job.stages,
                    job.mtp, job.era)
    for st_ in estimate(grouped.layout()).stages:
        warm = min((pp - st_.pp_rank - 1) * 2 + (v - 1) * g, m * v)
        assert st_.in_flight == warm + (warm < m * v), (st_.pp_rank, g, m)
    default = Split(s, job.split + ("--microbatch-group-size-per-virtual-pipeline-stage", str(pp)), job.stages,
                    job.mtp, job.era)
    assert _numbers(estimate(default.layout())) == _numbers(estimate(L))


def test_micro_batch_groups_of_four_over_two_ranks_by_hand():
    """PP 2 x VPP 2, 8 micro-batches (the property above's rule by hand): with Megatron's default groups of PP = 2 the
    first rank warms up (2 - 0 - 1) x 2 + (2 - 1) x 2 = 4 forwards and runs a fifth before its first backward, the last
    rank 0 + 2 = 2 and a third; with --microbatch-group-size-per-virtual-pipeline-stage 4, (2 - 1) x 4 replaces
    (2 - 1) x 2: 6 + 1 = 7 and 4 + 1 = 5 (schedules.py get_pp_rank_microbatches, 0.16.1 / 0.19.2). A larger group
    keeps more micro-batches' activations in flight, so each rank's peak rises."""
    spec = Spec(layers=4, pp=2, vpp=2, microbatches=8, heads=4, kv_channels=16, hidden=64, ffn=128, seq=64)
    for era in ("0.16", "0.19"):
        default = estimate(layout_from_flags(spec.flags(), world_size=2, megatron_version=era))
        four = estimate(layout_from_flags(spec.flags() + ["--microbatch-group-size-per-virtual-pipeline-stage", "4"],
                                          world_size=2, megatron_version=era))
        assert [s.in_flight for s in default.stages] == [5, 3]
        assert [s.in_flight for s in four.stages] == [7, 5]
        assert all(b.peak_allocated_bytes > a.peak_allocated_bytes for a, b in zip(default.stages, four.stages))
