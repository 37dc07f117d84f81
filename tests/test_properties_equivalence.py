"""Metamorphic properties: two ways of writing the same job give the same numbers, and a layout change
with a known effect moves exactly the terms it should (tests/property_space.py, derandomized)."""
from __future__ import annotations

import math
import os
import re

from hypothesis import HealthCheck, assume, given, reject, settings, strategies as st

from megatron_memguard import estimate, layout_from_flags
from megatron_memguard.errors import ConfigError, ConfigErrors, NotModelledError
from megatron_memguard.estimator.activations import layer_activations
from megatron_memguard.estimator.core import chunk_activations
from megatron_memguard.estimator.layers.attention import attention_kind
from megatron_memguard.estimator.params import chunk_numels
from megatron_memguard.estimator.states import _chunk_buffer, bucket_size_for, stage_states

from conftest import CONTAINER_ERA
from property_space import FeatureSpec, Spec, feature_specs, moe_specs, specs
from property_spelling import _drop, _numbers, _read, bridge_run_config
from test_properties import flash_rope_core_attn_excess, repeat_core_attn_excess

EXAMPLES = int(os.environ.get("MEMGUARD_PROPERTY_EXAMPLES", "200"))
PROPERTY = settings(derandomize=True, database=None, deadline=None, max_examples=max(1, EXAMPLES // 4),
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


def _est(flags: list[str], world: int):
    return estimate(layout_from_flags(flags, world_size=world, megatron_version="0.19"))


def layout(spec):
    return layout_from_flags(spec.flags(), world_size=spec.world, megatron_version="0.19")


def _chunk_counts(spec: Spec) -> dict[tuple[int, int], int]:
    """Layers of each (pipeline rank, virtual stage), as megatron-core's get_num_layers_to_build splits
    them: the first / last rank's layers, the rest evenly over the middle ranks, each rank's layers evenly
    over its virtual stages (transformer_block.py / transformer_config.py)."""
    pp, v = spec.pp, spec.vpp or 1
    per = [spec.layers // pp] * pp
    if spec.first is not None or spec.last is not None:
        rest, n = spec.layers, pp
        for x in (spec.first, spec.last):
            if x is not None:
                rest, n = rest - x, n - 1
        per = [rest // n if n else 0] * pp
        if spec.first is not None:
            per[0] = spec.first
        if spec.last is not None:
            per[-1] = spec.last
    return {(r, c): per[r] // v for r in range(pp) for c in range(v)}


def layout_string(spec: Spec) -> str:
    """The same split written as --pipeline-model-parallel-layout: stages listed virtual-stage-major
    (all ranks' first chunk, then all ranks' second, ...), 'E' on the first, 'L' on the last
    (megatron/core/transformer/pipeline_parallel_layer_layout.py)."""
    pp, v = spec.pp, spec.vpp or 1
    counts = _chunk_counts(spec)
    stages = []
    for c in range(v):
        for r in range(pp):
            s = "t" * counts[(r, c)]
            if (r, c) == (0, 0):
                s = "E" + s
            if (r, c) == (pp - 1, v - 1):
                s += "L"
            stages.append(s)
    return "|".join(stages)


# ---------------------------------------------------------------------------------------------------
# The same job written two ways

@PROPERTY
@given(specs())
def test_pipeline_layout_string_equals_the_split_flags(spec):
    """--pipeline-model-parallel-layout spelling out the even / uneven (first/last) / interleaved split
    gives every stage the same numbers as the split flags."""
    assume(spec.pp > 1)
    flags = _drop(spec.flags(), "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers",
                  "--num-virtual-stages-per-pipeline-rank")
    a = _est(spec.flags(), spec.world)
    b = _est(flags + ["--pipeline-model-parallel-layout", layout_string(spec)], spec.world)
    assert _numbers(a) == _numbers(b)


@PROPERTY
@given(specs())
def test_first_last_flags_equal_to_the_even_split_change_nothing(spec):
    """--decoder-first/last-pipeline-num-layers equal to the even share is the even split."""
    assume(spec.pp > 2 and spec.first is None and spec.last is None)
    per = spec.layers // spec.pp
    a = _est(spec.flags(), spec.world)
    for kw in (dict(first=per), dict(last=per), dict(first=per, last=per)):
        assert _numbers(_est(spec.with_(**kw).flags(), spec.world)) == _numbers(a)


@PROPERTY
@given(specs())
def test_virtual_stage_flags_are_one_setting(spec):
    """--num-layers-per-virtual-pipeline-stage n and --num-virtual-stages-per-pipeline-rank
    (layers per rank / n) are one setting (validate_args); one virtual stage is no interleaving."""
    assume(spec.first is None and spec.last is None)
    flags = _drop(spec.flags(), "--num-virtual-stages-per-pipeline-rank")
    per = spec.layers // spec.pp
    v = spec.vpp or 1
    a = _est(spec.flags(), spec.world)
    assert _numbers(_est(flags + ["--num-layers-per-virtual-pipeline-stage", str(per // v)], spec.world)) == _numbers(a)
    if spec.vpp is None:
        assert _numbers(_est(flags + ["--num-virtual-stages-per-pipeline-rank", "1"], spec.world)) == _numbers(a)


@PROPERTY
@given(specs())
def test_default_sizes_written_out_change_nothing(spec):
    """TP, PP, CP 1 written or left out; --num-query-groups equal to the heads (MHA as GQA);
    --expert-model-parallel-size 1 without experts."""
    a = _numbers(_est(spec.flags(), spec.world))
    flags = spec.flags()
    for name in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--context-parallel-size"):
        i = flags.index(name)
        if flags[i + 1] == "1":
            assert _numbers(_est(flags[:i] + flags[i + 2:], spec.world)) == a, name
    if spec.groups is None:
        assert _numbers(_est(spec.with_(groups=spec.heads).flags(), spec.world)) == a
    assert _numbers(_est(flags + ["--expert-model-parallel-size", "1"], spec.world)) == a


@PROPERTY
@given(moe_specs())
def test_moe_layer_freq_every_layer_written_four_ways(fs):
    """--moe-layer-freq unset, 1, [1]*L and the list written out are one pattern: every layer MoE
    (megatron/training/arguments.py moe_freq_type; TransformerConfig.moe_layer_freq)."""
    assume(fs.freq is None)
    n = fs.base.layers
    a = _numbers(_est(fs.flags(), fs.world))
    for f in ("1", f"[1]*{n}", f"([1]*{n})", "[" + ",".join(["1"] * n) + "]"):
        assert _numbers(_est(fs.with_(freq=f).flags(), fs.world)) == a, f


# ---------------------------------------------------------------------------------------------------
# A change with a known effect moves exactly the terms it should

@PROPERTY
@given(specs(), st.integers(1, 5))
def test_global_batch_size_without_pipelining_moves_nothing(spec, more):
    """With PP = 1 the schedule runs one micro-batch at a time (forward_backward_no_pipelining): more
    micro-batches per step (a larger GBS) accumulate into the same main_grad buffer and hold no more at
    any moment, so every term and level is the same."""
    spec = spec.with_(pp=1, first=None, last=None, vpp=None)
    a = _est(spec.with_(microbatches=1).flags(), spec.world)
    b = _est(spec.with_(microbatches=1 + more).flags(), spec.world)
    assert _numbers(a) == _numbers(b)


@PROPERTY
@given(specs())
def test_recompute_orders_what_a_layer_keeps(spec):
    """Per micro-batch, the layers of a chunk keep: full recompute of every layer (uniform, 1 layer per
    group: only each layer's input, tensor_parallel.checkpoint) == full block recompute of all layers
    <= any selective module set <= no recompute. (Under CP, recomputing 'core_attn' keeps q, k, v that TE's
    ring attention would not; test_properties documents that exception, so CP 1 here.) Exception, as Megatron
    does it: under TE's flash backend with rope, a set with 'core_attn' keeps K minus flash-attn's fp32
    log-sum-exp more per layer than no recompute (its checkpoint holds the qkv projection and the rope'd q and k,
    where flash-attn alone keeps its contiguous q, k, v, output and the log-sum-exp: test_properties.py
    test_recomputation_does_not_raise_the_peak), allowed per layer of the chunk
    (test_recompute_orders_core_attn_under_flash_and_rope_by_hand); and so does it, by up to 3 K - Q, where the
    attention repeats K and V for grouped queries (megatron-core's DotProductAttention, TE's unfused attention)
    with rope: the checkpoint's v is a view of the qkv projection (Q + 2 K), held whole with the rope'd q and k,
    where without it the repeated K and V (Q each) and the probs are kept and the projection is freed
    (repeat_core_attn_excess; test_recompute_orders_core_attn_under_gqa_and_rope_by_hand)."""
    spec = spec.with_(distribute_saved=False, cp=1, seq=spec.seq // spec.cp, instances=1)
    none = layout(spec.with_(recompute=()))
    full = layout(spec.with_(recompute=("full", "uniform", 1)))
    block = layout(spec.with_(recompute=("full", "block", spec.layers)))
    sels = [layout(spec.with_(recompute=("selective", m)))
            for m in (("core_attn",), ("mlp",), ("layernorm",), ("core_attn", "mlp", "layernorm"))]
    for cn, cf, cb, *cs in zip(none.chunks, full.chunks, block.chunks, *[s.chunks for s in sels]):
        kept_none = chunk_activations(none, cn).layers
        kept_full = chunk_activations(full, cf).layers
        assert chunk_activations(block, cb).layers == kept_full
        # one checkpointed input per layer: [s, b, h] in the residual dtype (/TP under SP)
        split = spec.tp if spec.sp else 1
        assert kept_full == cf.num_layers * (spec.seq * spec.mbs * spec.hidden * (
            4 if spec.fp32_residual or spec.precision == "fp32" else 2)) // split
        for L, c in zip(sels, cs):
            excess = c.num_layers * (flash_rope_core_attn_excess(L) + repeat_core_attn_excess(L))
            assert kept_full <= chunk_activations(L, c).layers <= kept_none + excess


ONE_GQA_ROPE_LAYER = Spec(impl="local", layers=1, heads=2, groups=1, kv_channels=64, hidden=128, ffn=8, seq=16, mbs=1,
                          vocab=8, precision="fp32", rope=True, bias=False)


def test_recompute_orders_core_attn_under_gqa_and_rope_by_hand():
    """The corner the derandomized run drew for the property above (2026-11-30): the local spec, one layer,
    h = 128, 2 heads of d = 64 in one key group, s = 16, b = 1, fp32, rope. Q = 16 x 2 x 64 x 4 = 8,192 B, K = V =
    4,096 B. Without recompute megatron-core's DotProductAttention keeps the rope'd q (8,192 B), K and V repeated
    to both heads (8,192 B each) and the fp32 probs [1, 2, 16, 16] (2,048 B): 26,624 B, the qkv projection freed
    (rope and repeat_interleave make new tensors). Recomputing core_attn, the checkpoint keeps the rope'd q and k
    (8,192 + 4,096 B) and v, a view of the projection Q + 2 K = 16,384 B: 28,672 B. So 2,048 B more
    (68,864 -> 70,912 B per layer), within 3 K - Q = 4,096 B."""
    none = layout(ONE_GQA_ROPE_LAYER)
    core = layout(ONE_GQA_ROPE_LAYER.with_(recompute=("selective", ("core_attn",))))
    a, b = layer_activations(none).saved, layer_activations(core).saved
    assert a["query"] + a["key_repeated"] + a["value_repeated"] + a["attention_probs"] == 3 * 8192 + 2048
    assert b["qkv_output"] + b["query_rope"] + b["key_rope"] == 16384 + 8192 + 4096
    kept_none, kept_core = (chunk_activations(x, x.chunks[0]).layers for x in (none, core))
    assert (kept_none, kept_core) == (68864, 70912)
    assert kept_core - kept_none <= repeat_core_attn_excess(core) == 3 * 4096 - 8192


def test_recompute_orders_core_attn_with_fewer_groups_than_tp_by_hand():
    """The corner props8's sweep drew for the property above (seed 2026113001, 400 examples): the local spec, one
    layer, h 64, 2 heads of d 32 in 1 key group, TP 2, s 16, b 1, fp32, rope. With fewer groups than TP ranks,
    Attention all-gathers linear_qkv's output into the whole projection, (2 + 2 x 1) x 32 = 128 wide, and slices
    its rank's group from it (get_query_key_value_tensors); the core attention, built for one group per rank, does
    not repeat K and V for its one head (DotProductAttention.forward; megatron-core 0.16.1 and 0.19.2). Rope makes q
    and k new (16 x 32 x 4 = 2,048 B each); v is a view of the gathered projection (16 x 128 x 4 = 8,192 B), kept by
    the bmm with the fp32 probs [1, 1, 16, 16] (1,024 B), or by core_attn's checkpoint, which drops only the probs.
    memguard counted K and V repeated (2,048 B each) and no projection: 7,168 B without recompute against 8,192 B
    with it (the checkpoint's projection 4,096 B, the rank's own output). The CPU referee measured the same corner
    at h 256 (mqa_h2_tp2_rope, tests/test_referee_stored.py)."""
    spec = Spec(impl="local", tp=2, layers=1, heads=2, groups=1, kv_channels=32, hidden=64, ffn=16, seq=16, mbs=1,
                vocab=8, precision="fp32", rope=True, bias=False)
    none = layer_activations(layout(spec)).saved
    core = layer_activations(layout(spec.with_(recompute=("selective", ("core_attn",))))).saved
    for saved in (none, core):
        assert (saved["qkv_output"], saved["query_rope"], saved["key_rope"]) == (8_192, 2_048, 2_048)
        assert "key_repeated" not in saved and "value_repeated" not in saved
    assert none["attention_probs"] == 1_024
    assert {k: v for k, v in none.items() if k != "attention_probs"} == core


def _one_group_over_four_ranks(kv_channels: int, hidden: int, rope: bool):
    """One local layer, 8 heads in 1 key group over TP 4, s 16, b 1, bf16, without and with core_attn recompute:
    (saved without, saved with, the chunk's layer bytes without and with, the property's excess bound)."""
    spec = Spec(impl="local", tp=4, layers=1, heads=8, groups=1, kv_channels=kv_channels, hidden=hidden, ffn=32,
                seq=16, mbs=1, vocab=8, rope=rope, bias=False)
    none = layout(spec)
    core = layout(spec.with_(recompute=("selective", ("core_attn",))))
    kept = [chunk_activations(x, x.chunks[0]).layers for x in (none, core)]
    return layer_activations(none).saved, layer_activations(core).saved, kept, repeat_core_attn_excess(core)


def test_recompute_orders_core_attn_with_a_group_over_four_ranks_by_hand():
    """The corner the property above drew next (props8, seed 2026113001, 400 examples): the local spec, one layer,
    h 64, 8 heads of d 8 in 1 key group over TP 4 (2 heads a rank), s 16, b 1, bf16, rope. Without recompute the
    core attention repeats K and V to the rank's 2 heads: q, k and v 16 x 2 x 8 x 2 = 512 B each, and the bf16 probs
    [1, 2, 16, 16] 1,024 B; the gathered projection is freed. Recomputing core_attn, the checkpoint keeps the rope'd q
    (512 B) and k (256 B) and v, a view of the whole gathered projection, (8 + 2 x 1) x 8 = 80 wide: 2,560 B. So
    768 B more per layer (12,032 -> 12,800 B), within P + K - 2 Q = 2,560 + 256 - 1,024 = 1,792 B."""
    a, b, kept, excess = _one_group_over_four_ranks(8, 64, rope=True)
    assert (a["query"], a["key_repeated"], a["value_repeated"], a["attention_probs"]) == (512, 512, 512, 1_024)
    assert (b["qkv_output"], b["query_rope"], b["key_rope"]) == (2_560, 512, 256)
    assert kept == [12_032, 12_800] and kept[1] - kept[0] <= excess == 1_792


def test_recompute_orders_core_attn_with_a_group_over_four_ranks_without_rope_by_hand():
    """CI's derandomized draw of the property above, changed with its text (props8): the same layer as the test above
    at h 128, d 16, without rope. Without recompute the core attention copies q (the reshape of a view, 16 x 2 x 16 x 2
    = 1,024 B) and repeats K and V (1,024 B each), the bf16 probs 1,024 B. Recomputing core_attn, the checkpoint's q,
    k and v are all views of the gathered projection, (8 + 2) x 16 = 160 wide: 5,120 B. So 1,024 B more
    (22,272 -> 23,296 B), within P - 3 Q = 5,120 - 3,072 = 2,048 B."""
    a, b, kept, excess = _one_group_over_four_ranks(16, 128, rope=False)
    assert (a["query"], a["key_repeated"], a["value_repeated"], a["attention_probs"]) == (1_024, 1_024, 1_024, 1_024)
    assert b["qkv_output"] == 5_120 and "query" not in b
    assert kept == [22_272, 23_296] and kept[1] - kept[0] <= excess == 2_048


ONE_FLASH_ROPE_LAYER = Spec(backend="flash", layers=1, heads=1, kv_channels=8, hidden=8, ffn=8, seq=16, mbs=1, vocab=8,
                            rope=True, bias=False)


def test_recompute_orders_core_attn_under_flash_and_rope_by_hand():
    """The corner MEMGUARD_PROPERTY_EXAMPLES=300 with seed 20261130 drew for the property above (2026-11-30): one
    layer, h = 8, one head of d = 8, s = 16, b = 1, bf16, GELU, rope, --attention-backend flash. Each [s, b, 8]
    bf16 tensor is 16 x 8 x 2 = 256 B. Without recompute the attention keeps flash-attn's contiguous q, k, v
    (TE 2.11 backends.py FlashAttention.forward, 3 x 256 B), its output (256 B) and the fp32 log-sum-exp [1, 1, 16]
    (64 B): 1088 B; recomputing core_attn, the checkpoint keeps the qkv projection [16, 1, 24] through v's view
    (768 B) and the rope'd q and k (2 x 256 B): 1280 B, so the layer keeps 192 B more (3136 -> 3328 B) and
    every other selective set keeps no more than without recompute."""
    none = layout(ONE_FLASH_ROPE_LAYER)
    core = layout(ONE_FLASH_ROPE_LAYER.with_(recompute=("selective", ("core_attn",))))
    a, b = layer_activations(none).saved, layer_activations(core).saved
    assert a["flash_qkv"] + a["attention_output_bshd"] + a["softmax_stats"] == 3 * 256 + 256 + 64
    assert b["qkv_output"] + b["query_rope"] + b["key_rope"] == 768 + 2 * 256
    kept_none, kept_core = (chunk_activations(x, x.chunks[0]).layers for x in (none, core))
    assert (kept_none, kept_core) == (3136, 3328) and kept_core - kept_none == flash_rope_core_attn_excess(core) == 192
    for mods in (("mlp",), ("layernorm",)):
        sel = layout(ONE_FLASH_ROPE_LAYER.with_(recompute=("selective", mods)))
        assert chunk_activations(sel, sel.chunks[0]).layers <= kept_none


@PROPERTY
@given(specs())
def test_untying_adds_the_output_layer_only_without_pipelining(spec):
    """--untie-embeddings-and-output-weights: with PP = 1 the output layer's [V/TP, h] weight is added to
    the stage; with PP > 1 the last stage held a tied copy of the embedding already (language_module.py
    setup_embeddings_and_output_layer), so every stage keeps its count."""
    a, b = layout(spec.with_(untied=False)), layout(spec.with_(untied=True))
    pa = [stage_states(a, p).parameters for p in range(a.pp)]
    pb = [stage_states(b, p).parameters for p in range(b.pp)]
    if spec.pp == 1:
        pa[-1] += a.padded_vocab_size * spec.hidden // spec.tp
    assert pa == pb


@PROPERTY
@given(specs())
def test_fp32_parameters_double_the_weights_and_drop_the_main_copy(spec):
    """fp32 vs bf16 training: the weights take 4 bytes instead of 2 (the same buffer), the gradient buffer
    is fp32 in both (bf16 accumulates and reduces in fp32: validate_args), and fp32 has no separate
    fp32 main parameters (FP32Optimizer)."""
    spec = spec.with_(fp32_residual=False)
    if spec.impl == "transformer_engine" and spec.backend in ("flash", "fused"):
        # TE has no flash or fused attention for fp32 q/k/v (refused on --attention-backend): its unfused one in both
        spec = spec.with_(backend="unfused")
    if spec.cp > 1 and spec.impl == "transformer_engine" and spec.backend in ("auto", "unfused"):
        # fp32 auto runs TE's unfused attention, which has no context parallelism (refused): compare at CP 1
        spec = spec.with_(cp=1, seq=spec.seq // spec.cp, instances=1)
    a, b = _est(spec.with_(precision="bf16").flags(), spec.world), _est(spec.with_(precision="fp32").flags(), spec.world)
    for sa, sb in zip(a.stages, b.stages):
        assert 2 * sa.breakdown["parameters"] == sb.breakdown["parameters"]
        assert sa.breakdown["gradient_buffer"] == sb.breakdown["gradient_buffer"]
        assert sb.breakdown.get("main_parameters", 0) == 0


@PROPERTY
@given(specs(max_layers=12), st.integers(1, 2))
def test_mtp_layers_go_to_the_last_stage_only(spec, depth):
    """--mtp-num-layers builds its layers on the last pipeline stage (mtp_on_this_rank without a layout):
    every earlier stage keeps each term. The last stage gains, per MTP layer (multi_token_prediction.py,
    core 0.19.2), enorm, hnorm and final_layernorm, eh_proj [h / TP, 2 h] (column-parallel, no bias) and one
    transformer layer; and with PP > 1 its own embedding [V / TP, h] (gpt_model.py builds it where
    mtp_process; the output layer keeps its weight off the first stage, tied or not)."""
    spec = spec.with_(impl="transformer_engine", rope=True)
    if spec.recompute and spec.recompute[:2] == ("full", "uniform"):
        # MultiTokenPredictionLayer._checkpointed_forward asserts recompute_num_layers == 1 (0.16.1-0.19.2)
        spec = spec.with_(recompute=("full", "uniform", 1))
        if depth > 1:
            # and from the second depth on, --distribute-saved-activations shards the depth before's output, which
            # MultiTokenPredictionBlock then concatenates (torch.cat fails at the first forward; refused by name,
            # resolve/mtp.py _distributed_checkpoint; tests/test_mtp_recompute.py)
            spec = spec.with_(distribute_saved=False)
    base = FeatureSpec(base=spec)
    a = _est(base.flags(), spec.world)
    b = _est(base.flags() + ["--mtp-num-layers", str(depth)], spec.world)
    # except the first stage's embedding buffer: with MTP even an untied first-stage embedding is marked
    # shared_embedding (language_module.py setup_embeddings_and_output_layer, core 0.16.1 / 0.19.2), so under the
    # distributed optimizer it gets a bucket of its own and the optimizer's shards move
    first = 1 if spec.untied and spec.pp > 1 and spec.dist_opt else 0
    assert _numbers(a)[first:-1] == _numbers(b)[first:-1]
    if first:
        assert a.stages[0].parameters == b.stages[0].parameters
    h, heads, d, tp = spec.hidden, spec.heads, spec.kv_channels, spec.tp
    g = spec.groups or heads
    norm = h * (1 if spec.rmsnorm else 2)
    fc1 = (2 if spec.swiglu else 1) * spec.ffn
    sharded = (heads + 2 * g) * d * h + h * heads * d + fc1 * h + h * spec.ffn + (
        (heads + 2 * g) * d + fc1 if spec.bias else 0)
    layer = sharded // tp + 2 * norm + (2 * h if spec.bias else 0)
    embedding = a.layout.padded_vocab_size * h // tp if spec.pp > 1 else 0
    assert b.stages[-1].parameters - a.stages[-1].parameters == depth * (3 * norm + 2 * h * h // tp + layer) + embedding


@PROPERTY
@given(specs())
def test_micro_batches_in_flight_follow_megatrons_warmup(spec):
    """The most (micro-batch, chunk) forwards a rank holds: 1F1B warms up PP - rank - 1 and runs one more,
    min(PP - rank, M); the interleaved schedule warms up (PP - rank - 1) x 2 + (VPP - 1) x PP chunks
    (microbatch group size PP) and runs one more unless the warm-up is all M x VPP of them
    (pipeline_parallel/schedules.py get_pp_rank_microbatches / forward_backward_pipelining_*)."""
    est = _est(spec.flags(), spec.world)
    m, p, v = spec.microbatches, spec.pp, spec.vpp or 1
    for s in est.stages:
        if v == 1:
            assert s.in_flight == min(p - s.pp_rank, m)
        else:
            warm = min((p - s.pp_rank - 1) * 2 + (v - 1) * p, m * v)
            assert s.in_flight == warm + (warm < m * v)


@PROPERTY
@given(specs(), st.sampled_from([(True, False), (False, True), (True, True)]))
def test_embedding_and_loss_slots_equal_their_layout_string(spec, slots):
    """--account-for-embedding/loss-in-pipeline-split count the embedding (loss) as one layer of the split and
    build one transformer layer fewer on the first (last) virtual stage (transformer_block.py
    get_num_layers_to_build): the same as the layout string that puts the layers there."""
    emb, loss = slots
    assume(spec.pp > 1 and spec.first is None and spec.last is None)
    n = spec.layers - emb - loss                  # transformer layers; n + slots is the even split
    assume(n >= 1)
    v = spec.vpp or 1
    s = spec.with_(layers=n)
    flags = s.flags() + (["--account-for-embedding-in-pipeline-split"] if emb else []) + (
        ["--account-for-loss-in-pipeline-split"] if loss else [])
    per = spec.layers // spec.pp // v
    stages = []
    for c in range(v):
        for r in range(spec.pp):
            k = per - (emb and (r, c) == (0, 0)) - (loss and (r, c) == (spec.pp - 1, v - 1))
            stages.append(("E" if (r, c) == (0, 0) else "") + "t" * k + ("L" if (r, c) == (spec.pp - 1, v - 1) else ""))
    other = _drop(s.flags(), "--num-virtual-stages-per-pipeline-rank") + [
        "--pipeline-model-parallel-layout", "|".join(stages)]
    assert _numbers(_est(flags, spec.world)) == _numbers(_est(other, spec.world))


# ---------------------------------------------------------------------------------------------------
# The same job through the readers

def nemo1_config(s: Spec, padded_vocab: int) -> dict:
    """The job as a NeMo 1 megatron_gpt_config.yaml (NeMo 2.5.0's keys: docs/readers.md), with NeMo's
    defaults that differ from Megatron-LM's written out; the vocabulary as override_vocab_size (padded)."""
    m = dict(mcore_gpt=True, transformer_engine=s.impl == "transformer_engine", num_layers=s.layers,
             hidden_size=s.hidden, ffn_hidden_size=s.ffn, num_attention_heads=s.heads, kv_channels=s.kv_channels,
             num_query_groups=s.groups, encoder_seq_length=s.seq, max_position_embeddings=s.seq,
             micro_batch_size=s.mbs, global_batch_size=s.mbs * s.dp * s.microbatches,
             tensor_model_parallel_size=s.tp, pipeline_model_parallel_size=s.pp, context_parallel_size=s.cp,
             virtual_pipeline_model_parallel_size=s.vpp, sequence_parallel=s.sp,
             activation="swiglu" if s.swiglu else "gelu", normalization="rmsnorm" if s.rmsnorm else "layernorm",
             bias=s.bias, position_embedding_type="rope" if s.rope else "learned_absolute",
             share_embeddings_and_output_weights=not s.untied, make_vocab_size_divisible_by=128,
             hidden_dropout=s.dropout, attention_dropout=s.dropout, fp32_residual_connection=s.fp32_residual,
             megatron_amp_O2=s.precision != "fp32", bias_activation_fusion=s.swiglu or s.bias,
             bias_dropout_add_fusion=True, masked_softmax_fusion=True, cross_entropy_loss_fusion=False,
             apply_rope_fusion=True, get_attention_mask_from_fusion=False, gradient_accumulation_fusion=True,
             overlap_p2p_comm=bool(s.vpp), override_vocab_size=padded_vocab,
             tokenizer={"library": "megatron", "type": "NullTokenizer"},
             optim={"name": "mcore_distributed_optim" if s.dist_opt else ("fused_adam" if s.optimizer == "adam" else "sgd"),
                    "overlap_grad_sync": s.overlap_grad_reduce, "num_distributed_optimizer_instances": s.instances})
    if s.first is not None:
        m["num_layers_in_first_pipeline_stage"] = s.first
    if s.last is not None:
        m["num_layers_in_last_pipeline_stage"] = s.last
    if s.recompute:
        m["activations_checkpoint_granularity"] = s.recompute[0]
        if s.recompute[0] == "selective":
            m["recompute_modules"] = list(s.recompute[1])
        else:
            m["activations_checkpoint_method"], m["activations_checkpoint_num_layers"] = s.recompute[1], s.recompute[2]
    return {"trainer": {"devices": s.world, "num_nodes": 1, "precision": {"bf16": "bf16-mixed", "fp16": "16-mixed",
                                                                           "fp32": 32}[s.precision]}, "model": m}


_NEMO2_STRATEGY = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                   "virtual_pipeline_model_parallel_size", "sequence_parallel")


def nemo2_config(s: Spec, padded_vocab: int) -> dict:
    """The job as a NeMo 2 `--to-yaml` export (NeMo 2.5: GPTConfig fields under model.config, the parallel sizes
    and DDP config under trainer.strategy, MegatronMixedPrecision under trainer.plugins, batch under data,
    OptimizerConfig under optim.config); the GPTConfig fields as in the Bridge dump, the vocabulary padded
    (NeMo 2 takes config.vocab_size as it is)."""
    b = bridge_run_config(s)
    cfg = {k: v for k, v in b["model"].items() if k not in ("should_pad_vocab", "make_vocab_size_divisible_by",
                                                            "bf16", "fp16", "params_dtype")}
    cfg.update(vocab_size=padded_vocab, _target_="nemo.collections.llm.gpt.model.base.GPTConfig")
    strategy = {k: cfg.pop(k) for k in _NEMO2_STRATEGY}
    strategy.update(_target_="nemo.lightning.pytorch.strategies.megatron_strategy.MegatronStrategy", ddp={
        "_target_": "megatron.core.distributed.distributed_data_parallel_config.DistributedDataParallelConfig",
        **b["ddp"]})
    return {"_target_": "nemo.collections.llm.api.pretrain",
            "model": {"_target_": "nemo.collections.llm.gpt.model.base.GPTModel", "config": cfg},
            "trainer": {"_target_": "nemo.lightning.pytorch.trainer.Trainer", "devices": s.world, "num_nodes": 1,
                        "strategy": strategy, "plugins": {
                            "_target_": "nemo.lightning.pytorch.plugins.mixed_precision.MegatronMixedPrecision",
                            "precision": {"bf16": "bf16-mixed", "fp16": "16-mixed", "fp32": "32"}[s.precision],
                            "grad_reduce_in_fp32": s.precision != "fp16"}},
            "data": {"_target_": "nemo.collections.llm.gpt.data.mock.MockDataModule", "seq_length": s.seq,
                     "global_batch_size": s.mbs * s.dp * s.microbatches, "micro_batch_size": s.mbs,
                     "create_attention_mask": True},
            "optim": {"_target_": "nemo.lightning.pytorch.optim.megatron.MegatronOptimizerModule", "config": {
                "_target_": "megatron.core.optimizer.optimizer_config.OptimizerConfig", "optimizer": s.optimizer,
                "use_distributed_optimizer": s.dist_opt, "bf16": s.precision == "bf16", "fp16": s.precision == "fp16"}}}


@PROPERTY
@given(specs())
def test_bridge_run_config_estimates_as_the_flags(tmp_path_factory, spec):
    """A Megatron-Bridge run_config.yaml of the job gives every stage the numbers of the flags."""
    b = _read(tmp_path_factory, bridge_run_config(spec), "run_config.yaml", spec.world)
    assert _numbers(b) == _numbers(_est(spec.flags(), spec.world))


# values Python reads as true / false that are not bools (a YAML number; text is left out: how a string reaches
# Bridge depends on its override path, docs/readers.md)
TRUE_VALUES, FALSE_VALUES = (1, 2, -1, 0.5, 1e9), (0, 0.0)


@PROPERTY
@given(specs(), st.data())
def test_bridge_bool_fields_are_read_by_their_truth(tmp_path_factory, spec, data):
    """A bool field of the Bridge run_config (model, ddp, optimizer sections) given a number instead of true / false
    gives the numbers of the bool Python reads it as: Megatron-Bridge 0.6.2 sets such a field unchecked and its code
    tests the value's truth (readers/bridge.py bridge_truth), so 0 / 0.0 are off and any other number on."""
    doc = bridge_run_config(spec)
    fields = [(sec, k) for sec in ("model", "ddp", "optimizer") for k, v in doc[sec].items() if isinstance(v, bool)]
    chosen = data.draw(st.lists(st.sampled_from(fields), min_size=1, max_size=6, unique=True))
    for sec, k in chosen:
        doc[sec][k] = data.draw(st.sampled_from(TRUE_VALUES if doc[sec][k] else FALSE_VALUES))
    a = _read(tmp_path_factory, bridge_run_config(spec), "run_config.yaml", spec.world)
    b = _read(tmp_path_factory, doc, "run_config.yaml", spec.world)
    assert _numbers(b) == _numbers(a), chosen


@PROPERTY
@given(specs())
def test_nemo1_config_estimates_as_the_flags(tmp_path_factory, spec):
    """A NeMo 1 config of the job gives every stage the numbers of the flags. NeMo has no DDP overlap without
    its distributed optimizer, no --distribute-saved-activations (build_transformer_config sets it off) and
    no attention_backend key of its own; gradient accumulation fusion as NeMo switches it."""
    if spec.optimizer == "sgd" and spec.dist_opt:
        spec = spec.with_(optimizer="adam")
    spec = spec.with_(backend="auto", distribute_saved=False,
                      overlap_grad_reduce=spec.overlap_grad_reduce and spec.dist_opt)
    if spec.precision == "fp32" and spec.cp > 1 and spec.impl == "transformer_engine":
        # fp32 auto runs TE's unfused attention, which has no context parallelism (refused): compare at CP 1
        spec = spec.with_(cp=1, seq=spec.seq // spec.cp, instances=1)
    # NeMo switches gradient accumulation fusion off without O2, and at PP 1 with DP > 1 without its
    # distributed optimizer (megatron_base_model.py, NeMo 2.5.0)
    gaf_off = spec.precision == "fp32" or (not spec.dist_opt and spec.pp == 1 and spec.dp > 1)
    flags = spec.flags() + (["--no-gradient-accumulation-fusion"] if gaf_off else [])
    a = _est(flags, spec.world)
    n = _read(tmp_path_factory, nemo1_config(spec, a.layout.padded_vocab_size), "megatron_gpt_config.yaml", spec.world)
    assert _numbers(n) == _numbers(a)


# ---------------------------------------------------------------------------------------------------
# The same job through the Megatron hook (megatron-core 0.19.2's own argument parser)

HOOK = settings(PROPERTY, max_examples=max(1, EXAMPLES // 8))


def _megatron_args(flags: list[str], world: int):
    """Megatron-LM's parse_and_validate_args on ``flags`` (pretrain_gpt.py's start-up), or the exception it
    raises; torch.cuda reports an H100 (what the hook reads for the GPU)."""
    import contextlib
    import io
    import sys
    from unittest import mock

    import torch
    from megatron.training import global_vars
    from megatron.training.arguments import parse_and_validate_args

    from conftest import H100
    env = {"WORLD_SIZE": str(world), "RANK": "0", "LOCAL_RANK": "0",
           # Megatron-FSDP asserts CUDA_DEVICE_MAX_CONNECTIONS != 1
           "CUDA_DEVICE_MAX_CONNECTIONS": "8" if "--use-megatron-fsdp" in flags else "1"}
    global_vars.unset_global_variables()
    try:
        with mock.patch.dict(os.environ, env), mock.patch.object(sys, "argv", ["pretrain_gpt.py", *flags]), \
                mock.patch.object(torch.cuda, "get_device_properties", lambda i=None: H100), \
                contextlib.redirect_stdout(io.StringIO()):
            return parse_and_validate_args(extra_args_provider=None, args_defaults={})
    finally:
        global_vars.unset_global_variables()


def _hook_equals_cli(flags: list[str], world: int, te_checks: bool = False) -> None:
    from megatron_memguard import resolve
    from megatron_memguard.readers.megatron_namespace import raw_from_namespace
    try:
        args = _megatron_args(flags, world)
    except (AssertionError, ValueError) as e:
        # this machine has no Transformer Engine: Megatron's checks of its version fail here, not on a GPU node
        if te_checks and re.search(r"(TE|Transformer Engine) >=", str(e)):
            reject()
        raise
    live = estimate(resolve(raw_from_namespace(args), world_size=world))
    assert _numbers(live) == _numbers(_est(flags, world))


TRAINING = ["--lr", "1e-4", "--train-iters", "10", "--mock-data"]


@CONTAINER_ERA[0]
@CONTAINER_ERA[1]
@HOOK
@given(specs())
def test_megatron_accepts_the_dense_space_and_the_hook_estimates_as_the_cli(spec):
    """Every drawn dense layout passes Megatron-LM's own parse_and_validate_args (core 0.19.2): the space
    holds only jobs Megatron starts. The layout the hook reads from that validated namespace estimates,
    stage by stage and term by term, as the same flags through the CLI reader."""
    _hook_equals_cli(spec.flags() + TRAINING, spec.world)


@CONTAINER_ERA[0]
@CONTAINER_ERA[1]
@HOOK
@given(feature_specs())
def test_hook_estimates_the_feature_space_as_the_cli(fs):
    """MoE, FP8, MTP, Megatron-FSDP, offload, CUDA graphs through the hook as through the CLI. (What this
    machine's Megatron cannot parse, a Transformer Engine version check without TE installed, is left out; what memguard
    refuses by name, e.g. TransformerConfig's rules that parse_and_validate_args does not run, too.)"""
    flags = fs.flags() + TRAINING
    try:
        _est(flags, fs.world)
    except (ConfigError, ConfigErrors, NotModelledError):
        reject()
    _hook_equals_cli(flags, fs.world, te_checks=True)


@PROPERTY
@given(specs(), st.sampled_from([2, 4, 8]))
def test_tensor_and_sequence_parallelism_divide_every_saved_tensor_of_a_layer(spec, tp):
    """TP t with sequence parallelism: every tensor a layer keeps for its backward is split t ways, the
    column/row-parallel outputs by heads / TP and ffn / TP, the residual stream, norms and dropout masks by
    the SP scatter of the sequence (megatron-core's SP regions; the scores per head). So each saved item of
    TP 1 is exactly t times that of TP t, for every attention kind, recompute setting and dtype drawn (the
    shape scaled so that TP 8 divides heads, groups, ffn and s / CP)."""
    from megatron_memguard.estimator.layers.attention import attention_kind, te_softmax_kernel
    from megatron_memguard.estimator.layers.base import shapes
    g = None if spec.groups is None else 8 * spec.groups
    one = spec.with_(tp=1, sp=False, distribute_saved=False, heads=8 * spec.heads, groups=g, ffn=8 * spec.ffn,
                     seq=8 * spec.seq)
    La, Lb = layout(one), layout(one.with_(tp=tp, sp=True))
    a, b = dict(layer_activations(La).saved), dict(layer_activations(Lb).saved)
    if attention_kind(La) == "te_unfused":
        # TE's fused softmax kernel needs b x heads / TP % 4 == 0 (softmax.py is_kernel_available): TP may switch
        # TE between it and torch's softmax, whose bool mask [b or 1, 1, s, s] is whole on every TP rank
        assume(te_softmax_kernel(La, shapes(La)) == te_softmax_kernel(Lb, shapes(Lb)))
        assert a.pop("causal_mask", None) == b.pop("causal_mask", None)
    assert set(a) == set(b)
    assert {k: v for k, v in a.items()} == {k: tp * v for k, v in b.items()}


@PROPERTY
@given(specs())
def test_distributed_optimizer_padding_is_within_megatrons_alignment(spec):
    """The distributed optimizer's param/grad buffer pads each parameter's start to 64 elements and each
    bucket's end to lcm(DP x CP / instances, 128) (param_and_grad_buffer.py, core 0.19.2): per chunk the padding
    is at most 63 per parameter plus lcm - 1 per bucket, and the padded buffer divides over the ranks."""
    L = layout(spec.with_(dist_opt=True))
    n = L.dp_shard_size
    for p in range(L.pp):
        for c in L.stage_chunks(p):
            buf, _ = _chunk_buffer(L, c.kind_runs, c.has_embedding, c.has_output, c.has_tied_output_copy,
                                   bucket_size_for(L, c), (0,))
            params = chunk_numels(L, c)
            assert buf.params == sum(x for x, _ in params)
            assert buf.numel % n == 0
            assert 0 <= buf.numel - buf.numel_unpadded <= len(buf.buckets) * (math.lcm(n, 128) - 1) + 63 * len(params)


@PROPERTY
@given(specs())
def test_distributed_optimizer_without_data_parallelism_adds_only_its_padding(spec):
    """With DP x CP = 1 the distributed optimizer's one shard is the whole state (distrib_optimizer.py): the
    fp32 main parameters and moments are those of the plain optimizer; what changes is the padding of the
    param and grad buffers (the padded elements times 2 or 4 bytes each) and the allocator slack on top."""
    spec = spec.with_(dp=1, cp=1, seq=spec.seq // spec.cp, instances=1)
    off, on = _est(spec.with_(dist_opt=False).flags(), spec.world), _est(spec.with_(dist_opt=True).flags(), spec.world)
    L = on.layout
    for p, (a, b) in enumerate(zip(off.stages, on.stages)):
        st = stage_states(L, p)
        pad = st.buffer_numel - st.buffer_numel_unpadded
        assert b.breakdown["parameters"] - a.breakdown["parameters"] == pad * L.param_bytes
        assert b.breakdown["gradient_buffer"] - a.breakdown["gradient_buffer"] == pad * L.grad_bytes
        same = set(a.breakdown) - {"parameters", "gradient_buffer", "allocator_fragmentation"}
        assert {k: a.breakdown[k] for k in same} == {k: b.breakdown.get(k) for k in same}
        assert a.peak_phase == b.peak_phase


@PROPERTY
@given(feature_specs(), st.integers(1, 3))
def test_micro_batches_beyond_the_warmup_move_nothing(fs, more):
    """Once the micro-batches fill the pipeline's warm-up, more of them (a larger GBS) hold no more at any
    moment: 1F1B keeps min(PP - rank, M) forwards in flight, so every M >= PP is the same; the interleaved
    schedule warms up (PP - rank - 1) x 2 + (VPP - 1) x PP chunk forwards (schedules.py, group size PP), within
    2 PP micro-batches' VPP chunks. Every stage's terms, levels and phase are those of M = PP (2 PP)."""
    b = fs.base
    assume(b.pp > 1)
    m = 2 * b.pp if b.vpp else b.pp
    try:
        a = _est(fs.with_base(microbatches=m).flags(), fs.world)
    except (ConfigError, ConfigErrors, NotModelledError):
        reject()
    c = _est(fs.with_base(microbatches=m + more * b.pp).flags(), fs.world)
    if not b.vpp:
        assert _numbers(c) == _numbers(a)
        return
    # Interleaved: the held micro-batches are the same, but a longer steady state reaches passes where more of the
    # schedule's own tensors coexist (an idle chunk's input and gradient with the warm-up's last receive released
    # and the previous input gradient: forward_backward_pipelining_with_interleaving, core 0.16.1 / 0.19.2; the
    # replay of tests/test_schedule_p2p.py), so the peak may grow by those tensors (pipeline_inputs_retained) and
    # nothing else (the case seed 20261201 drew: test_longer_steady_state_keeps_one_tensor_more_by_hand)
    for x, y in zip(a.stages, c.stages):
        grow = y.breakdown.get("pipeline_inputs_retained", 0) - x.breakdown.get("pipeline_inputs_retained", 0)
        assert y.peak_allocated_bytes - x.peak_allocated_bytes == grow >= 0, (x.pp_rank, x.peak_phase, y.peak_phase)
        skip = {"pipeline_inputs_retained", "allocator_fragmentation"}
        assert ([(t.name, t.bytes) for t in x.terms if t.name not in skip]
                == [(t.name, t.bytes) for t in y.terms if t.name not in skip]), x.pp_rank
        assert (x.parameters, x.persistent_bytes, x.in_flight) == (y.parameters, y.persistent_bytes, y.in_flight)


def test_longer_steady_state_keeps_one_tensor_more_by_hand():
    """The case MEMGUARD_PROPERTY_EXAMPLES=300 MEMGUARD_PROPERTY_SEED=20261201 drew for the property above (corners5):
    PP 3 x VPP 2 (groups of 3), the middle stage, whose peak is a backward of chunk 0 with 6 micro-batches held. With 6
    micro-batches it is chunk 0's second backward: the warm-up's last receive (chunk 1's micro-batch 2, kept by the
    loop's input_tensor) and its gradient, the previous backward's input gradient, the steady forward's output and
    the next forward's input received ahead (overlap): 5 [s, b, h] tensors. With 9 the same holding comes again at
    chunk 0's fourth backward with chunk 1 idle: its last input and gradient (the previous backward's gradient
    among them), the warm-up's last receive and gradient, the forward output, the next input: 6. A tensor is
    s b h x 2 B = 16 x 16 x 2 = 512 B here."""
    from property_space import Spec
    fs = FeatureSpec(base=Spec(impl="transformer_engine", backend="auto", pp=3, layers=6, last=2, vpp=2, heads=1,
                               kv_channels=16, hidden=16, ffn=16, seq=16, mbs=1, microbatches=3, vocab=8, rope=True,
                               bias=False),
                     experts=0, topk=2, moe_ffn=64, dispatcher="alltoall", extra=("--fp4-format", "e2m1", "--fp4-recipe",
                                                                                  "nvfp4"))
    six, nine = (_est(fs.with_base(microbatches=n).flags(), fs.world).stages[1] for n in (6, 9))
    assert six.breakdown["pipeline_inputs_retained"] == 5 * 512
    assert nine.breakdown["pipeline_inputs_retained"] == 6 * 512
    assert nine.peak_allocated_bytes - six.peak_allocated_bytes == 512


@PROPERTY
@given(specs(), st.sampled_from(["uniform", "block"]), st.integers(0, 6))
def test_full_recompute_keeps_what_its_method_says(spec, method, n):
    """Full recompute per model chunk of k layers (megatron/core/recompute.py, core 0.19.2): 'uniform' with
    n checkpoints each run of n layers (the last run clamped), keeping ceil(k / n) checkpoint inputs; 'block'
    with n checkpoints the first min(n, k) layers and keeps the other layers' activations whole. A checkpoint
    input is [s/CP, b, h] in the residual dtype, /TP under SP."""
    n = max(n, 1) if method == "uniform" else n
    spec = spec.with_(distribute_saved=False)
    none, rec = layout(spec.with_(recompute=())), layout(spec.with_(recompute=("full", method, n)))
    ckpt = spec.seq // spec.cp * spec.mbs * spec.hidden * (
        4 if spec.fp32_residual or spec.precision == "fp32" else 2) // (spec.tp if spec.sp else 1)
    for cn, cr in zip(none.chunks, rec.chunks):
        k = cr.num_layers
        whole = layer_activations(none, cn.has_embedding or cn.has_output).total
        assert chunk_activations(none, cn).layers == k * whole
        want = min(n, k) * ckpt + max(0, k - n) * whole if method == "block" else -(-k // n) * ckpt
        assert chunk_activations(rec, cr).layers == want


@PROPERTY
@given(specs())
def test_nemo2_export_estimates_as_the_flags(tmp_path_factory, spec):
    """A NeMo 2 export of the job gives every stage the numbers of the flags."""
    a = _est(spec.flags(), spec.world)
    n = _read(tmp_path_factory, nemo2_config(spec, a.layout.padded_vocab_size), "nemo2.yaml", spec.world)
    assert _numbers(n) == _numbers(a)


@PROPERTY
@given(feature_specs(), st.data())
def test_one_more_layer_on_a_stage_moves_that_stage_only(fs, data):
    """One more transformer layer placed on one (rank, virtual stage) by --pipeline-model-parallel-layout:
    the other ranks build, keep and schedule what they did (every term equal), and that rank's peak does not
    drop (its chunk keeps one more layer's activations, states and buffers)."""
    b = fs.base
    assume(b.pp > 1 and "--mtp-num-layers" not in fs.extra and fs.freq is None)
    v = b.vpp or 1
    counts = _chunk_counts(b)
    rank, chunk = data.draw(st.integers(0, b.pp - 1)), data.draw(st.integers(0, v - 1))
    more = {**counts, (rank, chunk): counts[(rank, chunk)] + 1}

    def written(c: dict) -> str:
        return "|".join(("E" if (r, k) == (0, 0) else "") + "t" * c[(r, k)] + ("L" if (r, k) == (b.pp - 1, v - 1) else "")
                        for k in range(v) for r in range(b.pp))
    flags = _drop(fs.flags(), "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers",
                  "--num-virtual-stages-per-pipeline-rank", "--num-layers")
    try:
        a = _est(flags + ["--num-layers", str(b.layers), "--pipeline-model-parallel-layout", written(counts)], fs.world)
    except (ConfigError, ConfigErrors, NotModelledError):
        reject()
    m = _est(flags + ["--num-layers", str(b.layers + 1), "--pipeline-model-parallel-layout", written(more)], fs.world)
    for r, (x, y) in enumerate(zip(_numbers(a), _numbers(m))):
        if r == rank:
            assert y[4] >= x[4]
        else:
            assert x == y
