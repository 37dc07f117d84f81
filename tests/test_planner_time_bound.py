"""The search's lower bound of a step time (TimeModel.step_time_bound): below every step time (also
tests/test_properties_planner_memo.py), and close enough that a large plan leaves most step times uncomputed."""
import math

from megatron_memguard.gpus import lookup_gpu
from megatron_memguard.planner import Cluster, Planner
from megatron_memguard.planner.space import Candidate, Constraints, enumerate_space
from megatron_memguard.readers.models import read_model

from conftest import LLAMA31_8B
from planner_util import make_planner


def test_the_bound_holds_the_dp_collectives_nothing_hides_and_the_optimizer_step():
    """Llama-3.1-8B at TP1 PP1 on 8,192 GPUs: Megatron's bucket of max(40M, 1M x DP) = 8,192M elements holds all
    8,030,261,248 parameters (Meta's model card: 8.03 B), so the reduce-scatter and all-gather are one bucket that no
    backward hides (the last bucket stays exposed): the step time's dp_comm is all of them, and the bound carries
    it, and the optimizer step, whole."""
    P = make_planner(LLAMA31_8B, 8192, 4096, 8192)
    tm = P.timer
    for dist_opt in (True, False):
        c = Candidate(1, 1, 1, 1, None, None, False, 1, "none", dist_opt, 8192, 1, (32,))
        assert tm.stage_params(c, 0) == 8_030_261_248
        terms = tm.step_time(c).term_seconds
        assert terms["dp_comm"] > 0.01                     # 8,192 ranks over 1,024 nodes: milliseconds of ring steps
        floor = tm.step_tail_floor(c)
        assert math.isclose(floor, terms["dp_comm"] + terms["optimizer"], rel_tol=1e-12), dist_opt
        assert floor < tm.step_time_bound(c) <= tm.step_time(c).seconds


def test_the_slowest_rank_of_an_uneven_split_holds_ceil_layers_over_pp():
    """32 layers on 3, 5, 6 or 7 pipeline ranks: whatever the split, one rank holds at least ceil(32 / PP) of them,
    so the bound is at least m x that many layers' work (a middle rank's work per layer: it holds layers only),
    and still below the step time. (With many micro-batches and a light output layer, m x all the work / PP is
    below that.)"""
    P = make_planner(LLAMA31_8B + ["--vocab-size", "32000"], 420, 4096, 16800)
    tm = P.timer
    cands = [c for c in enumerate_space(P.shape, P.cluster, 16800, Constraints(pp=(3, 5, 6, 7), mbs=(1,)))
             if c.first is not None or c.last is not None]
    assert {c.pp for c in cands} == {3, 5, 6, 7}
    for c in cands:
        st = tm.step_time(c)
        per_layer = st.stage_seconds[1] / c.stage_layers[1]     # one micro-batch on rank 1, all its chunks
        bound = tm.step_time_bound(c)
        assert bound >= c.m * math.ceil(32 / c.pp) * per_layer * (1 - 1e-6), c.name
        assert tm.step_time_work_bound(c) <= bound <= st.seconds, c.name    # (the search's first look, then this)


def test_a_plan_over_720720_gpus_times_few_of_its_layouts():
    """Mixtral 8x7B over 720,720 GPUs (the hostile-input plan, benchmarks/hostile_input.py): the bound with the DP
    collectives and the uneven splits' ranks leaves most step times and memory bounds uncomputed."""
    gpu = lookup_gpu("H100-80GB")
    cluster = Cluster(gpus=720720, gpus_per_node=gpu.gpus_per_node, gpu=gpu, nvlink_domain=gpu.nvlink_domain,
                      gpu_memory_bytes=gpu.memory_bytes)
    P = Planner(read_model("mixtral-8x7b"), cluster, seq_length=4096, global_batch_size=720720)
    res = P.plan(top=50)
    assert len(res.entries) == 50
    timed = len(P.timer._cache)
    assert res.considered > 15_000 and timed < res.considered / 8, (timed, res.considered)
