"""The layout space: constraints, TP inside nodes, uneven pipeline splits, Megatron's rules."""
import random

import pytest

from megatron_memguard.planner.space import Constraints, enumerate_space, layer_splits

from conftest import LLAMA31_70B, LLAMA31_8B
from planner_util import make_planner


def test_tp_stays_inside_a_node_unless_allowed():
    # H100-94GB nodes of 4 GPUs (TSUBAME 4.0): TP 8 would span two nodes
    P = make_planner(LLAMA31_70B, 64, 8192, 512, gpu="H100-94GB")
    assert P.cluster.gpus_per_node == 4
    tps = {c.tp for c in enumerate_space(P.shape, P.cluster, 512, Constraints())}
    assert tps == {1, 2, 4}
    tps = {c.tp for c in enumerate_space(P.shape, P.cluster, 512, Constraints(allow_tp_across_nodes=True))}
    assert tps == {1, 2, 4, 8, 16, 32, 64}          # divisors of 64 that also divide the 64 heads (groups 8 | TP)
    P2 = make_planner(LLAMA31_70B, 64, 8192, 512, gpus_per_node=2)
    assert {c.tp for c in enumerate_space(P2.shape, P2.cluster, 512, Constraints())} == {1, 2}


def test_tp_groups_never_straddle_nodes():
    # nodes of 6 GPUs: TP 4 would put some groups on two nodes, TP 8 and 16 are not whole nodes either
    P = make_planner(LLAMA31_70B, 48, 8192, 96, gpus_per_node=6)
    for allow in (False, True):
        cands = enumerate_space(P.shape, P.cluster, 96, Constraints(allow_tp_across_nodes=allow))
        assert {c.tp for c in cands} == {1, 2}


def test_sequence_parallel_only_where_tp_divides_the_tokens():
    """megatron-core scatters the [s/CP, b, h] activations along s over TP and asserts that it divides."""
    P = make_planner(LLAMA31_8B, 64, 4100, 64)          # 4100 = 4 x 1025; per CP=2 rank 2050 = 2 x 1025
    cands = enumerate_space(P.shape, P.cluster, 64, Constraints())
    sp = {(c.tp, c.cp) for c in cands if c.sp}
    assert sp == {(2, 1), (4, 1), (2, 2)}
    assert {(c.tp, c.cp) for c in cands if c.tp > 1} >= {(8, 1), (4, 2), (8, 2)}
    from megatron_memguard.errors import ConfigError
    from megatron_memguard.planner.space import make_candidate
    assert not make_candidate(P.shape, P.cluster, 64, tp=8).sp
    with pytest.raises(ConfigError, match="must divide"):
        make_candidate(P.shape, P.cluster, 64, tp=8, sp=True)


def test_max_tp_and_lists():
    P = make_planner(LLAMA31_70B, 256, 8192, 512)
    cands = enumerate_space(P.shape, P.cluster, 512, Constraints(max_tp=4, pp=(2, 4), mbs=(1,), recompute=("none",),
                                                                  dist_opt=(True,), cp=(1, 2)))
    assert cands
    assert {c.tp for c in cands} == {1, 2, 4}
    assert {c.pp for c in cands} == {2, 4}
    assert {c.mbs for c in cands} == {1} and {c.recompute for c in cands} == {"none"}
    assert {c.dist_opt for c in cands} == {True} and {c.cp for c in cands} == {1, 2}


@pytest.mark.parametrize("layers, pp", [(80, 3), (80, 6), (80, 7), (32, 3), (32, 5), (126, 4), (61, 2)])
def test_uneven_splits_keep_the_largest_stage_minimal(layers, pp):
    splits = layer_splits(layers, pp)
    assert splits
    for first, last, stages in splits:
        assert sum(stages) == layers and len(stages) == pp
        assert max(stages) == -(-layers // pp)
        assert stages[0] == first and stages[-1] == last
        assert len(set(stages[1:-1])) <= 1            # Megatron: the middle stages are even


def test_even_split_when_layers_divide():
    assert layer_splits(80, 4) == [(None, None, (20, 20, 20, 20))]
    assert layer_splits(80, 32) == []                 # no split with at most ceil(80/32) = 3 layers per stage


def test_uneven_split_resolves_as_megatron_builds_it():
    P = make_planner(LLAMA31_70B, 48, 8192, 96)
    cands = [c for c in enumerate_space(P.shape, P.cluster, 96, Constraints(pp=(3, 6), tp=(8,), mbs=(1,),
                                                                             recompute=("none",), dist_opt=(True,)))
             if c.first is not None]
    assert cands
    for c in cands:
        L = P.layout(c)
        per_rank = [sum(ch.num_layers for ch in L.stage_chunks(r)) for r in range(L.pp)]
        assert tuple(per_rank) == c.stage_layers
        assert L.decoder_first_pipeline_num_layers == c.first and L.decoder_last_pipeline_num_layers == c.last


def test_every_candidate_keeps_megatrons_rules():
    """A sample of the space resolves without error: the enumeration already keeps every rule resolve checks."""
    for model, gpus, gbs in ((LLAMA31_70B, 1024, 1024), (LLAMA31_8B, 96, 480), (LLAMA31_70B, 48, 96)):
        P = make_planner(model, gpus, 8192, gbs)
        cands = enumerate_space(P.shape, P.cluster, gbs, Constraints())
        rng = random.Random(6)
        for c in rng.sample(cands, min(150, len(cands))):
            L = P.layout(c)
            assert (L.tp, L.pp, L.cp, L.dp, L.vpp, L.micro_batch_size) == (c.tp, c.pp, c.cp, c.dp, c.vpp, c.mbs)
            assert L.num_microbatches == c.m and L.sequence_parallel == c.sp
            assert L.use_distributed_optimizer == c.dist_opt
            assert (L.recompute_granularity or "none") == c.recompute


def test_interleaving_needs_whole_microbatch_groups():
    P = make_planner(LLAMA31_70B, 256, 8192, 96)
    for c in enumerate_space(P.shape, P.cluster, 96, Constraints()):
        if c.vpp > 1:
            assert c.m >= c.pp and c.m % c.pp == 0
            if c.acc_emb or c.acc_loss or c.pp_layout:
                # the embedding / loss slots or the layout's stages: each rank's chunks, not its layers, divide
                assert len(c.chunks) == c.pp * c.vpp and sum(c.chunks) == 80
                assert tuple(sum(c.chunks[r::c.pp]) for r in range(c.pp)) == c.stage_layers
            else:
                assert all(n % c.vpp == 0 for n in c.stage_layers)


def test_fujii_space():
    P = make_planner(LLAMA31_8B, 64, 8192, 512)
    cands = enumerate_space(P.shape, P.cluster, 512, Constraints(), rule="fujii2024")
    assert cands
    for c in cands:
        assert c.vpp == 1 and c.recompute == "none" and c.dist_opt and c.first is None
        assert c.sp == (c.tp > 1) and c.tp * c.cp <= 8


def test_no_context_parallelism_with_megatrons_local_attention():
    """megatron-core's DotProductAttention asserts context_parallel_size == 1; only TE's attention does CP."""
    local = make_planner(LLAMA31_8B + ["--transformer-impl", "local"], 64, 8192, 512)
    assert {c.cp for c in enumerate_space(local.shape, local.cluster, 512, Constraints())} == {1}
    assert any("context parallelism is left out" in n for n in local.notes)
    te = make_planner(LLAMA31_8B, 64, 8192, 512)
    assert {c.cp for c in enumerate_space(te.shape, te.cluster, 512, Constraints())} == {1, 2, 4, 8}
    from megatron_memguard.errors import ConfigError
    from megatron_memguard.planner.space import make_candidate
    with pytest.raises(ConfigError, match="context parallelism needs Transformer Engine's flash or fused attention"):
        make_candidate(local.shape, local.cluster, 512, tp=2, cp=2)
    # TE's unfused attention has no CP either (TE 2.11 get_attention_backend; resolve/kernels.py refuses it)
    unfused = make_planner(LLAMA31_8B + ["--attention-backend", "unfused"], 64, 8192, 512)
    assert {c.cp for c in enumerate_space(unfused.shape, unfused.cluster, 512, Constraints())} == {1}
    assert any("--attention-backend unfused: context parallelism is left out" in n for n in unfused.notes)
