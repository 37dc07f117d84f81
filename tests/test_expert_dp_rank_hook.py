"""The runtime hook's expert-data-parallel optimizer position on any TP rank: megatron-core's own
(parallel_state.get_expert_data_parallel_rank(partial_expert_data_parallel=True), core 0.16.1 and 0.19.2), else
worked out from the process's dense optimizer rank and TP rank in megatron-core's rank order
(Parallelism.expert_dp_rank), checked here against megatron-core's RankGenerator itself."""
import sys
import types

import pytest

from megatron_memguard import estimate, layout_from_flags
from megatron_memguard._integration import expert_optimizer_rank, parallel_ranks
from megatron_memguard.estimator.states import stage_states
from megatron_memguard.layout.parallelism import ShardGroup

# TP 4, EP 2, ETP 1 on 16 GPUs (one stage): dense DP 4, expert DP 16 / (1 x 2) = 8, so TP > ETP x EP
MOE = ("--num-layers 2 --hidden-size 256 --num-attention-heads 8 --ffn-hidden-size 512 --seq-length 256 "
       "--max-position-embeddings 256 --micro-batch-size 1 --global-batch-size 16 --vocab-size 1000 --bf16 "
       "--tensor-model-parallel-size 4 --sequence-parallel --num-experts 4 --moe-router-topk 2 "
       "--expert-model-parallel-size 2 --expert-tensor-parallel-size 1 --moe-ffn-hidden-size 200 "
       "--use-distributed-optimizer").split()


@pytest.fixture(scope="module")
def L():
    return layout_from_flags(MOE, world_size=16, megatron_version="0.19")


def test_rank_order_matches_megatron_cores_rank_generator(L):
    """Every global rank's expert-DP index from megatron-core's own RankGenerator (order "tp-cp-ep-dp-pp", the
    dense generator with EP 1 and the expert one with TP = ETP: parallel_state.initialize_model_parallel) equals
    Parallelism.expert_dp_rank of its dense DP x CP index and TP rank. TP rank 0 of dense index r is global 4r
    (expert index 2r); TP ranks 2 and 3 of it are global 4r + 2, 4r + 3, expert index 2r + 1: one further."""
    ps = pytest.importorskip("megatron.core.parallel_state")
    dense = ps.RankGenerator(tp=4, ep=1, dp=4, pp=1, cp=1, order="tp-cp-ep-dp-pp")
    expert = ps.RankGenerator(tp=1, ep=2, dp=8, pp=1, cp=1, order="tp-cp-ep-dp-pp")
    dense_index = {g: i for grp in dense.get_ranks("dp-cp") for i, g in enumerate(grp)}
    expert_index = {g: i for grp in expert.get_ranks("dp") for i, g in enumerate(grp)}
    tp_index = {g: i for grp in dense.get_ranks("tp") for i, g in enumerate(grp)}
    assert L.parallel.shard_size(ShardGroup.EXPERT_DP) == 8
    for g in range(16):
        assert L.parallel.expert_dp_rank(dense_index[g], tp_index[g]) == expert_index[g], g
    # the hand count of the docstring
    assert [expert_index[g] for g in (4, 5, 6, 7)] == [2, 2, 3, 3]
    assert [L.parallel.expert_dp_rank(1, t) for t in range(4)] == [2, 2, 3, 3]


def _mpu(tp_rank, optimizer_rank, expert_rank=None):
    ns = dict(model_parallel_is_initialized=lambda: True, get_pipeline_model_parallel_rank=lambda: 0,
              get_pipeline_model_parallel_world_size=lambda: 1, get_tensor_model_parallel_rank=lambda: tp_rank,
              get_data_parallel_rank=lambda with_context_parallel=False, partial_data_parallel=False: optimizer_rank,
              get_context_parallel_rank=lambda: 0)
    if expert_rank is not None:
        ns["get_expert_data_parallel_rank"] = (
            lambda partial_expert_data_parallel=False, **_: expert_rank if partial_expert_data_parallel else -1)
    return types.SimpleNamespace(**ns)


def test_hook_takes_the_expert_rank_from_parallel_state(L, monkeypatch):
    monkeypatch.setitem(sys.modules, "megatron.core.parallel_state", _mpu(3, 1, expert_rank=3))
    ranks = parallel_ranks()
    assert ranks["expert_optimizer_rank"] == 3      # the partial group's rank, not the full group's (-1 here)
    assert expert_optimizer_rank(L, ranks) == 3


def test_hook_works_it_out_from_the_tp_rank_without_it(L, monkeypatch):
    # an mpu without get_expert_data_parallel_rank: dense index 1 on TP rank 3 is global 7, expert index 3
    monkeypatch.setitem(sys.modules, "megatron.core.parallel_state", _mpu(3, 1))
    ranks = parallel_ranks()
    assert "expert_optimizer_rank" not in ranks
    assert expert_optimizer_rank(L, ranks) == 3
    dense = MOE[:MOE.index("--num-experts")] + ["--use-distributed-optimizer"]
    assert expert_optimizer_rank(layout_from_flags(dense, world_size=16), ranks) is None


def test_the_given_expert_rank_picks_that_expert_shard(L):
    """The estimate's expert state for (dense rank 3, expert rank 7) is the stage's last rank in both groups:
    the "last" path of stage_states (dense slice shard - 1, expert slice eshard - 1), while TP rank 0 of dense
    rank 3 sits at expert index 6."""
    shard, eshard = L.parallel.shard_size(ShardGroup.DENSE_DP), L.parallel.shard_size(ShardGroup.EXPERT_DP)
    assert (shard, eshard) == (4, 8) and L.parallel.expert_dp_rank(3) == 6
    assert stage_states(L, 0, 3, expert_dp_rank=7) == stage_states(L, 0, "last")
    a = estimate(L, device="cpu", dp_rank=3, expert_dp_rank=7).stages[0]
    b = estimate(L, device="cpu", dp_rank="last").stages[0]
    assert a.device_total_bytes == b.device_total_bytes


def test_the_monitor_predicts_its_own_expert_shard(L):
    """build_monitor (the Megatron hook's, Bridge's and Lightning's) on TP rank 3 of dense optimizer rank 1,
    no expert rank from megatron-core: global rank 7, expert index 3 (not TP rank 0's 2, whose shard differs by
    the padding in its slice)."""
    from megatron_memguard._integration import build_monitor
    result = types.SimpleNamespace(layout=L, gpu=None, gpu_memory=None, estimate=None, to_dict=lambda: {})
    source = types.SimpleNamespace(device="cpu")
    ranks = {"rank": 7, "world_size": 16, "pp_rank": 0, "pp_size": 1, "tp_rank": 3, "dp_rank": 1, "cp_rank": 0,
             "optimizer_rank": 1}
    m = build_monitor(source, result, ranks=ranks, interval=100, log_dir=None)
    own = estimate(L, device="cpu", dp_rank=1, expert_dp_rank=3).stages[0].device_total_bytes
    tp0 = estimate(L, device="cpu", dp_rank=1).stages[0].device_total_bytes
    assert own != tp0
    assert m.prediction.device_total == own
