"""Properties of hybrid Mamba models (--hybrid-layer-pattern: resolve/hybrid.py, estimator/layers/mamba.py), drawn
where megatron-core 0.19.2 builds them (tests/property_space_newest.py hybrid_specs): the parameters of every
pipeline stage counted by hand from megatron-core's modules, the '|' segments as the stages, the MTP depths of the
'/' parts (tests/property_space_newest.py hybrid_mtp_specs), the directions a Megatron user expects, and the pattern
of only attention + MLP pairs against the plain GPT model.

Derandomized; MEMGUARD_PROPERTY_EXAMPLES sets the count (default 200, these use a quarter: each example
resolves and estimates a few layouts).
"""
from __future__ import annotations

import os

from hypothesis import HealthCheck, given, reject, settings, strategies as st

from megatron_memguard import estimate, layout_from_flags
from megatron_memguard.errors import ConfigError, ConfigErrors, NotModelledError
from megatron_memguard.estimator.params import total_parameters
from megatron_memguard.estimator.states import stage_states

from property_space_newest import HybridSpec, hybrid_mtp_specs, hybrid_specs
from property_spelling import _numbers
from test_properties_features import layout   # the Layout, or the refusal checked and the example dropped

EXAMPLES = int(os.environ.get("MEMGUARD_PROPERTY_EXAMPLES", "200"))
QUARTER = settings(derandomize=True, database=None, deadline=None, max_examples=max(1, EXAMPLES // 4),
                   suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


def layer_params(hs: HybridSpec, sym: str, t: int) -> int:
    """One layer of the symbol on one TP rank of t, by hand from megatron-core 0.19.2's hybrid TE spec
    (models/hybrid/hybrid_layer_specs.py): every layer's norm is fused into its first linear (TELayerNorm-
    ColumnParallelLinear: weight h, and bias h for LayerNorm), replicated over TP; the MoE layer keeps its
    pre_mlp_layernorm apart (a norm module, the same size)."""
    h = hs.hidden
    norm = h * (1 if hs.rmsnorm else 2)
    if sym == "M":
        # ssm/mamba_mixer.py: d_inner = 2 h (expand 2), heads = d_inner / head_dim, in_proj out = 2 d_inner +
        # 2 groups N + heads, conv1d over d_inner + 2 groups N channels of width 4 with a bias, dt_bias / A_log / D
        # per head, the gated RMSNorm over d_inner, out_proj [h, d_inner]; no linear biases (asserts bias=False)
        di, nh, g, n = 2 * h, hs.mamba_heads, hs.mamba_groups, hs.state
        conv = di + 2 * g * n
        return norm + (2 * di + 2 * g * n + nh) * h // t + conv * 5 // t + 3 * nh // t + di // t + h * di // t
    if sym == "*":
        a, g, d = hs.heads, hs.groups or hs.heads, hs.kv
        qkv = (a + 2 * g) * d
        return norm + qkv * h // t + h * a * d // t + ((qkv // t + h) if hs.bias else 0)
    if sym == "-":
        f = hs.ffn        # squared ReLU or GeLU: one fc1 (not gated)
        return norm + 2 * f * h // t + ((f // t + h) if hs.bias else 0)
    if sym == "E":
        # router [E, h] replicated; E / EP local experts of fc1 [F / ETP, h], fc2 [h, F / ETP] (ETP = TP)
        return norm + hs.experts * h + (hs.experts // hs.ep) * 2 * hs.moe_ffn * h // t
    raise AssertionError(sym)


def stage_segments(hs: HybridSpec) -> list[list[str]]:
    """The pattern's layers of each pipeline rank: segment i on rank i % PP (select_pipeline_segment, 0.19.2);
    without '|', PP equal slices."""
    if len(hs.segments) > 1 or hs.pp == 1:
        segs = hs.segments
    else:
        n = hs.layers // hs.pp
        segs = tuple(hs.segments[0][i * n:(i + 1) * n] for i in range(hs.pp))
    return [[s for i, s in enumerate(segs) if i % hs.pp == r] for r in range(hs.pp)]


def _stage_by_hand(hs: HybridSpec, V: int, r: int, segs) -> int:
    """Rank r's parameters on one TP rank, by hand: its segments' layers, the embedding on the first rank, the final
    norm and the output layer on the last (a tied output a copy of the embedding when PP > 1)."""
    h, t = hs.hidden, hs.tp
    want = sum(layer_params(hs, sym, t) for seg in segs for sym in seg)
    if r == 0:
        want += V * h // t
    if r == hs.pp - 1:
        want += h * (1 if hs.rmsnorm else 2) + (V * h // t if hs.untied or hs.pp > 1 else 0)
    return want


@QUARTER
@given(hybrid_specs(symbols="M*-E"))
def test_hybrid_parameters_stage_by_stage_are_megatron_cores(hs):
    """Each pipeline rank holds the layers of its '|' segments (rank i % PP), and the first one the embedding, the
    last the final norm and the output layer (a tied output a copy of the embedding when PP > 1): each stage's
    per-rank count equals the hand count of megatron-core's modules / TP, and the model total (no TP split, the
    tied weight once) is the sum over the pattern (exact)."""
    L = layout(hs)
    h = hs.hidden
    V = L.padded_vocab_size
    norm = h * (1 if hs.rmsnorm else 2)
    for r, segs in enumerate(stage_segments(hs)):
        assert stage_states(L, r).parameters == _stage_by_hand(hs, V, r, segs), (r, segs)
    total = sum(layer_params(hs, sym, 1) for sym in hs.pattern if sym != "|") + norm + V * h * (2 if hs.untied else 1)
    # a routed expert is counted once in the total: EP ranks split them (layer_params(t=1) counted E / EP)
    total += hs.pattern.count("E") * (hs.experts - hs.experts // hs.ep) * 2 * hs.moe_ffn * h
    assert total_parameters(L) == total


def _mtp_depth(hs: HybridSpec, t: int) -> int:
    """One MTP depth on one TP rank of t, by hand (multi_token_prediction.py, 0.17.1 to 0.19.2): enorm, hnorm and
    final_layernorm (replicated), eh_proj [h / t, 2 h] (column-parallel, no bias), and a HybridStack of the depth's
    pattern without a final norm (each layer as layer_params counts it)."""
    norm = hs.hidden * (1 if hs.rmsnorm else 2)
    return 3 * norm + 2 * hs.hidden * hs.hidden // t + sum(layer_params(hs, sym, t) for sym in hs.mtp)


@QUARTER
@given(hybrid_mtp_specs())
def test_hybrid_mtp_depths_stage_by_stage_are_megatron_cores(hs):
    """The '/' parts of the pattern build one MTP depth each (one for all with --mtp-use-repeated-layer) on the last
    pipeline stage (HybridModel's mtp_process: mtp_on_this_rank without a layout, the last virtual stage too), which
    also builds its own word embedding [V / TP, h] when PP > 1 (``pre_process or mtp_process``, hybrid_model.py
    0.19.2); every other stage keeps test_hybrid_parameters_stage_by_stage_are_megatron_cores' count, and the model's
    total gains the depths' layers whole (a routed expert of an 'E' depth once)."""
    L = layout(hs)
    h, t = hs.hidden, hs.tp
    V = L.padded_vocab_size
    norm = h * (1 if hs.rmsnorm else 2)
    built = 1 if hs.mtp_repeated else hs.mtp_depths
    for r, segs in enumerate(stage_segments(hs)):
        want = _stage_by_hand(hs, V, r, segs)
        if r == hs.pp - 1:
            want += built * _mtp_depth(hs, t) + (V * h // t if hs.pp > 1 else 0)
        assert stage_states(L, r).parameters == want, (r, segs)
    experts_elsewhere = (hs.experts - hs.experts // hs.ep) * 2 * hs.moe_ffn * h
    total = sum(layer_params(hs, sym, 1) for sym in hs.pattern if sym != "|") + norm + V * h * (2 if hs.untied else 1)
    total += (hs.pattern.count("E") + built * hs.mtp.count("E")) * experts_elsewhere
    assert total_parameters(L) == total + built * _mtp_depth(hs, 1)


@QUARTER
@given(hybrid_mtp_specs(), st.sampled_from(["mbs", "seq"]))
def test_a_larger_micro_batch_or_sequence_never_lowers_a_hybrid_mtp_stage_peak(hs, what):
    """test_a_larger_micro_batch_or_sequence_never_lowers_a_hybrid_stage_peak with the MTP depths on the last stage:
    each depth's stack, eh_proj's input and its loss grow with the tokens of a micro-batch. And the distributed
    optimizer's shards of a stage without routed experts add up to its parameters, none over its slice of the
    padded buffer (distrib_optimizer.py _build_model_gbuf_range; the MTP block's buffer included)."""
    bigger = hs.with_(mbs=hs.mbs + 1) if what == "mbs" else hs.with_(seq=2 * hs.seq)
    for a, b in zip(_peaks(hs), _peaks(bigger)):
        assert b >= a
    if not hs.experts:
        D = layout(hs.with_(dist_opt=True))
        n = D.dp_shard_size
        for p in range(D.pp):
            st_ = stage_states(D, p)
            shards = [stage_states(D, p, r).exp_avg_bytes // 4 for r in range(n)]
            assert sum(shards) == st_.parameters and max(shards) <= st_.buffer_numel // n, p


@st.composite
def pair_specs(draw) -> HybridSpec:
    """A hybrid job whose pattern is only attention + MLP pairs ('*-'), the same number in every '|' segment."""
    hs = draw(hybrid_specs(symbols="M*-"))
    k = draw(st.integers(1, 3))
    n_segs = len(hs.segments) if len(hs.segments) > 1 else 1
    segs = ("*-" * k,) * n_segs if n_segs > 1 else ("*-" * (k * hs.pp),)
    rec = hs.recompute
    if rec:
        # uniform: blocks of 2 j hybrid layers are blocks of j GPT layers (recompute.py checkpointed_forward,
        # 0.19.2, shared by TransformerBlock and HybridStack); block checkpoints layer by layer, each layer's input
        # kept, so 2 j hybrid layers keep 2 j inputs where j GPT layers keep j: not the same model state
        # (blocks that divide each chunk: the GPT estimate counts a partial top block as a whole one)
        rec = ("full", "uniform", 2 * draw(st.sampled_from([j for j in range(1, k + 1) if k % j == 0])))
    return hs.with_(segments=segs, recompute=rec, experts=0)


def gpt_flags(hs: HybridSpec) -> list[str]:
    """The same model as a GPT model: one TransformerLayer per '*-' pair; the segments as virtual stages."""
    f = hs.flags()
    f.remove("--hybrid-layer-pattern=" + hs.pattern)
    for flag in ("--mamba-state-dim", "--mamba-head-dim", "--mamba-num-groups"):
        i = f.index(flag)
        del f[i:i + 2]
    f += ["--num-layers", str(hs.layers // 2)]
    if len(hs.segments) > hs.pp:
        f += ["--num-virtual-stages-per-pipeline-rank", str(len(hs.segments) // hs.pp)]
    if hs.recompute:
        i = f.index("--recompute-num-layers")
        f[i + 1] = str(hs.recompute[2] // 2)
    return f


@QUARTER
@given(pair_specs())
def test_attention_mlp_pairs_are_the_gpt_model(hs):
    """A pattern of only '*-' pairs builds, per pair, the modules of one GPT TransformerLayer (megatron-core 0.19.2
    hybrid_layer_specs.py: the attention layer's norm fused into linear_qkv, the MLP layer's into linear_fc1, as
    the GPT TE spec fuses them): the same parameters on every stage, the same model total, and every term of every
    stage the same. The activations too: a '*' layer and the '-' layer above it keep what one GPT layer keeps, and
    the attention's backward runs once the MLP layer above has freed its tensors, as in the GPT layer
    (core._mixed_transients; before it, the hybrid chunk added its largest layer's working set on top of every
    layer, 0.6% of a stage here)."""
    H = layout(hs)
    try:
        G = layout_from_flags(gpt_flags(hs), world_size=hs.world, megatron_version="0.19")
    except (ConfigError, ConfigErrors, NotModelledError) as e:
        raise AssertionError(f"the GPT form of {hs.pattern} is refused: {e}")
    assert total_parameters(H) == total_parameters(G)
    eh, eg = estimate(H), estimate(G)
    for p, (sh, sg) in enumerate(zip(eh.stages, eg.stages)):
        assert stage_states(H, p).parameters == stage_states(G, p).parameters
        assert sh.breakdown == sg.breakdown, p
        assert (sh.peak_allocated_bytes, sh.device_total_bytes) == (sg.peak_allocated_bytes, sg.device_total_bytes)


def _peaks(hs: HybridSpec) -> list[int]:
    return [s.peak_allocated_bytes for s in estimate(layout(hs)).stages]


@QUARTER
@given(hybrid_specs(symbols="M*-E"), st.sampled_from(["mbs", "seq"]))
def test_a_larger_micro_batch_or_sequence_never_lowers_a_hybrid_stage_peak(hs, what):
    """Every saved tensor and working set of a Mamba, attention, MLP or MoE layer grows with the tokens of a
    micro-batch (the chunk states and C^T B per chunk of 128 tokens too): one more sequence per micro-batch, or
    twice the sequence, never lowers a stage's peak; and the terms of every stage are documented names
    (docs/terms/NAME.md)."""
    bigger = hs.with_(mbs=hs.mbs + 1) if what == "mbs" else hs.with_(seq=2 * hs.seq)
    est = estimate(layout(hs))
    for a, b in zip([s.peak_allocated_bytes for s in est.stages], _peaks(bigger)):
        assert b >= a
    docs = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "terms")
    for s in est.stages:
        for t in (*s.terms, *s.host_terms):
            assert os.path.exists(os.path.join(docs, t.name + ".md")), t.name


@QUARTER
@given(hybrid_specs(symbols="M*-E"))
def test_full_recompute_of_every_layer_never_raises_a_hybrid_stage_peak(hs):
    """Full uniform recompute of one layer per block keeps each layer's input only and replays one layer at a
    time (recompute.py checkpointed_forward, 0.19.2, HybridStack's forward): with at least two layers on every
    chunk it raises a stage's peak by at most the replayed layer's output and the gradient handed to it, two
    [s, b, h] tensors (/TP under SP). CheckpointFunction.backward (tensor_parallel/random.py, megatron-core 0.16.1
    and 0.19.2) holds both (``outputs``, ``args``) until ``torch.autograd.backward`` returns; a layer above the
    replayed one pays them back with what it would have kept (at least two tensors of its input's size), but when
    the chunk's peak is its bottom layer's own backward (a Mamba layer under a smaller MoE layer, 'ME' on a stage),
    the layers above have freed their tensors by then in both runs: nothing pays them back. CPU referee
    (tests/test_referee_replay.py::test_a_bottom_layers_replay_raises_the_peak_by_what_it_holds): a wide dense layer
    under an MoE layer, full uniform recompute of each layer, peaks two [s, b, h] tensors higher than without (the
    replayed output, and the MoE block's kept input, which its dispatcher's routing probabilities keep alive)."""
    if any(len(seg) < 2 for seg in hs.segments) or (len(hs.segments) == 1 and hs.layers // hs.pp < 2):
        reject()
    plain = hs.with_(recompute=())
    rec = hs.with_(recompute=("full", "uniform", 1))
    L = layout(rec)
    tokens = L.seq_length // L.cp * L.micro_batch_size
    held = 2 * tokens * L.hidden_size * L.act_bytes // (L.tp if L.sequence_parallel else 1)
    for a, b in zip(_peaks(plain), _peaks(rec)):
        assert b <= a + held


@QUARTER
@given(hybrid_specs(symbols="M*-E"))
def test_a_pattern_cut_evenly_by_bars_is_the_pattern_without_them(hs):
    """A pattern without '|' is split evenly over PP at build time (select_pipeline_segment, 0.19.2): writing the same
    even split with '|' (one segment a rank) estimates alike, term by term."""
    if len(hs.segments) > 1:
        flat = "".join(hs.segments)
        if len(flat) % hs.pp:
            reject()
        hs = hs.with_(segments=(flat,), microbatches=max(1, hs.microbatches))
    n = hs.layers // hs.pp
    cut = hs.with_(segments=tuple(hs.segments[0][i * n:(i + 1) * n] for i in range(hs.pp)))
    if hs.pp == 1:
        reject()
    a, b = estimate(layout(hs)), estimate(layout(cut))
    for sa, sb in zip(a.stages, b.stages):
        assert sa.breakdown == sb.breakdown


@st.composite
def uneven_hybrid_jobs(draw) -> tuple[HybridSpec, int | None, int | None, tuple[str, ...]]:
    """A hybrid job (with or without '/' MTP depths) whose pattern has no '|', split over PP 2-4 by
    --decoder-first/last-pipeline-num-layers (1-4 layers each, the middle ranks even), and the same split as '|'
    segments. Full recompute of one layer per checkpoint (a chunk of one layer takes no more)."""
    hs = draw(st.one_of(hybrid_specs(symbols="M*-E"), hybrid_mtp_specs()))
    pp = draw(st.integers(2, 4))
    first = draw(st.integers(1, 4)) if draw(st.booleans()) else None
    last = draw(st.integers(1, 4)) if (first is None or draw(st.booleans())) else None
    middle = pp - (first is not None) - (last is not None)
    per = draw(st.integers(1, 3)) if middle else 0
    counts = ([first] if first is not None else []) + [per] * middle + ([last] if last is not None else [])
    pattern = draw(st.text(alphabet="M*-" + ("E" if hs.experts else ""), min_size=sum(counts), max_size=sum(counts)))
    cut = tuple(pattern[sum(counts[:i]):sum(counts[:i + 1])] for i in range(pp))
    rec = ("full", hs.recompute[1], 1) if hs.recompute else ()
    return hs.with_(segments=(pattern,), pp=pp, recompute=rec), first, last, cut


@QUARTER
@given(uneven_hybrid_jobs())
def test_uneven_first_last_stages_of_a_hybrid_pattern_are_its_bar_segments(job):
    """A pattern without '|' over PP ranks takes --decoder-first/last-pipeline-num-layers as the first / last rank's
    layers, the rest even over the middle ranks (select_pipeline_segment's uneven branch, hybrid_layer_allocation.py
    0.19.2; validate_args passes them as num_layers_in_first/last_pipeline_stage): the same split written as '|'
    segments estimates alike on every stage, term by term, MTP depths included."""
    hs, first, last, cut = job
    flags = hs.flags() + (["--decoder-first-pipeline-num-layers", str(first)] if first is not None else []) + (
        ["--decoder-last-pipeline-num-layers", str(last)] if last is not None else [])
    try:
        a = layout_from_flags(flags, world_size=hs.world, megatron_version="0.19")
    except (ConfigError, ConfigErrors, NotModelledError):
        reject()
    b = layout(hs.with_(segments=cut))
    assert [s.num_layers for s in estimate(a).stages] == [len(seg) for seg in cut]
    assert _numbers(estimate(a)) == _numbers(estimate(b))
