"""The planner with mixture-of-experts models: the expert grid (EP, ETP, expert DP) as Megatron builds
it, per-rank expert parameters, the dispatch and expert-GEMM pieces of the step time, and the
candidates the search enumerates (each one Megatron would accept)."""
import json
import math
import os

import pytest

from megatron_memguard.gpus import lookup_gpu
from megatron_memguard.planner.comm import NETWORK_EFFICIENCY, NVLINK_EFFICIENCY, P2P_LATENCY
from megatron_memguard.planner.kernels import gemm_seconds
from megatron_memguard.planner.moe import (
    MoeShape, all_to_all_seconds, balanced_rows, dispatch_seconds, edp_per_domain, ep_per_domain, expert_data_parallel_size,
    expert_grid_problem, expert_params_per_rank, grouped_gemm_seconds, moe_dense_params_per_rank, moe_shape_from_args,
    tokens_per_rank,
)
from megatron_memguard.planner.space import Cluster, Constraints, ModelShape, enumerate_space, make_candidate
from megatron_memguard.planner.timing import TERM_NAMES, TERM_NAMES_MOE, TimeModel

HERE = os.path.dirname(os.path.abspath(__file__))
REF = json.load(open(os.path.join(HERE, "data", "moe_reference_counts.json")))["models"]
H100 = lookup_gpu("H100-80GB")

# DeepSeek-V3 (its config.json, tests/data/hf/deepseek-v3.json): 61 layers, the first 3 dense, 256 routed
# experts of width 2048, top-8, one shared expert of width 2048, MLA.
V3_MOE = MoeShape(experts=256, topk=8, ffn=2048, pattern=(False,) * 3 + (True,) * 58, shared_ffn=2048,
                  dispatcher="alltoall", grouped_gemm=True)


def v3_shape(moe=V3_MOE, seq=4096):
    """DeepSeek-V3's shape (the deepseek-v3 preset, its dense part resolved at TP = PP = 1) with ``moe``."""
    from megatron_memguard import resolve
    from megatron_memguard.readers.models import read_model

    raw = read_model("deepseek-v3")
    dense = {k: v for k, v in raw.args.items() if not k.startswith("moe_") and k != "num_experts"}
    L = resolve(raw.__class__(args={**dense, "seq_length": seq, "micro_batch_size": 1, "bf16": True,
                                    "use_distributed_optimizer": True}, origin=raw.origin), world_size=1)
    return ModelShape(layout=L, moe=moe)


def cluster(gpus, gpu=H100):
    return Cluster(gpus=gpus, gpus_per_node=gpu.gpus_per_node, gpu=gpu, nvlink_domain=gpu.nvlink_domain,
                   gpu_memory_bytes=gpu.memory_bytes)


def test_expert_parameters_per_rank_match_transformers_counts():
    # routed experts / router / shared expert of all 58 MoE layers, as transformers builds DeepSeek-V3
    ref = REF["deepseek-v3"]["by_role"]
    assert expert_params_per_rank(V3_MOE, 7168, True, ep=1, etp=1) * 58 == ref["routed_experts"]
    assert moe_dense_params_per_rank(V3_MOE, 7168, True, tp=1) * 58 == ref["router"] + ref["shared_experts"]
    # EP 64: 4 experts per rank, each fc1 [2 x 2048, 7168] + fc2 [7168, 2048]
    assert expert_params_per_rank(V3_MOE, 7168, True, ep=64, etp=1) == 4 * 3 * 2048 * 7168
    assert expert_params_per_rank(V3_MOE, 7168, True, ep=8, etp=2) == 32 * 3 * 2048 * 7168 // 2


def test_the_whole_model_counts_as_transformers_builds_it():
    s = v3_shape()
    tm = TimeModel(s, cluster(8), 8)
    c = make_candidate(s, cluster(8), 8, tp=1, pp=1, ep=1, etp=1)
    total = tm.stage_params(c, 0) + tm.stage_expert_params(c, 0)
    # the planner's padded vocabulary equals DeepSeek-V3's (129280 = 1010 x 128)
    assert total == REF["deepseek-v3"]["num_parameters"]


def test_expert_grid_rules_are_megatrons():
    # initialize_model_parallel: world % (ETP x EP x PP); validate_args: experts % EP
    assert expert_grid_problem(1024, pp=16, ep=64, etp=1, experts=256) is None
    assert expert_data_parallel_size(1024, pp=16, ep=64, etp=1) == 1
    assert expert_data_parallel_size(1024, pp=8, ep=8, etp=1) == 16
    assert "not divisible by expert tensor parallel 1 x expert parallel 128 x pipeline parallel 16" in \
        expert_grid_problem(1024, pp=16, ep=128, etp=1, experts=256)
    assert "must divide --num-experts 256" in expert_grid_problem(1024, pp=1, ep=48, etp=1, experts=256)
    # EP ranks are ETP apart (rank order tp-ep-dp-pp): 8 GPUs per NVLink domain hold 4 EP ranks at ETP 2
    assert ep_per_domain(ep=64, etp=2, domain=8) == 4
    assert ep_per_domain(ep=4, etp=1, domain=8) == 4
    assert edp_per_domain(edp=16, ep=4, etp=1, domain=8) == 2


def test_tokens_and_rows_under_balanced_routing():
    # sequence parallel: b s / (TP CP) tokens per rank; local experts see T k ETP copies (moe-fp8.md 1.7)
    assert tokens_per_rank(b=1, seq=4096, tp=2, cp=1) == 2048
    assert balanced_rows(2048, topk=8, etp=2) == 32768


def test_all_to_all_time_by_hand():
    # 8 MB from each of 8 ranks in one NVLink domain: 7/8 of it over NVLink at 450 GB/s x 0.8
    t = all_to_all_seconds(8e6, n=8, per_domain=8, gpu=H100)
    assert t == pytest.approx(P2P_LATENCY + 8e6 * 7 / 8 / (450e9 * NVLINK_EFFICIENCY))
    # 64 ranks, 8 per node: 56/64 of it through the NIC (50 GB/s x 0.85) paces it
    t = all_to_all_seconds(8e6, n=64, per_domain=8, gpu=H100)
    assert t == pytest.approx(P2P_LATENCY + 8e6 * 56 / 64 / (50e9 * NETWORK_EFFICIENCY))
    assert all_to_all_seconds(8e6, n=1, per_domain=8, gpu=H100) == 0.0


def test_dispatchers():
    kw = dict(T=2048, N=2048 * 8, topk=8, hidden=7168, act_bytes=2, gpu=H100, domain=8)
    assert dispatch_seconds("allgather", ep=1, etp=1, **kw)[0] == 0.0
    a2a, text = dispatch_seconds("alltoall", ep=8, etp=1, **kw)
    assert a2a == pytest.approx(2 * all_to_all_seconds(2048 * 8 * 7168 * 2, 8, 8, H100))
    assert "EP 8" in text
    # the allgather dispatcher moves every token of the ETP x EP group to every rank: more than top-8 copies
    # only when the group is larger than k
    ag8 = dispatch_seconds("allgather", ep=8, etp=1, **kw)[0]
    ag64 = dispatch_seconds("allgather", ep=64, etp=1, **{**kw, "domain": 8})[0]
    assert ag64 > ag8 > 0


def test_flex_sends_a_token_once_per_destination_rank():
    from megatron_memguard.planner.moe import distinct_ranks
    # by hand: 8 experts on 8 ranks, top-2 distinct experts: always 2 ranks; 64 experts on 8 ranks, top-8:
    # 8 x (1 - C(56,8)/C(64,8)) = 8 x (1 - 0.3346...) = 5.32...
    assert distinct_ranks(8, 2, 8) == pytest.approx(2.0)
    assert distinct_ranks(64, 8, 8) == pytest.approx(8 * (1 - math.comb(56, 8) / math.comb(64, 8)))
    assert distinct_ranks(256, 8, 1) == 1.0
    kw = dict(T=2048, N=2048 * 8, topk=8, hidden=7168, act_bytes=2, gpu=H100, domain=8, ep=8, etp=1)
    flex = dispatch_seconds("flex", experts=64, **kw)[0]
    a2a = dispatch_seconds("alltoall", experts=64, **kw)[0]
    assert flex == pytest.approx(2 * all_to_all_seconds(2048 * distinct_ranks(64, 8, 8) * 7168 * 2, 8, 8, H100))
    assert flex < a2a


def test_grouped_gemm_is_never_slower_and_fills_sms_together():
    # 4 local experts of 512 rows: one grouped kernel (16 x 4 tiles) beats 4 kernels of 16 tiles each
    seq = grouped_gemm_seconds(4, 512, 4096, 7168, H100, grouped=False)
    grp = grouped_gemm_seconds(4, 512, 4096, 7168, H100, grouped=True)
    assert seq == pytest.approx(4 * gemm_seconds(512, 4096, 7168, H100))
    assert grp < seq
    assert grouped_gemm_seconds(1, 4096, 4096, 7168, H100, grouped=True) == pytest.approx(
        gemm_seconds(4096, 4096, 7168, H100))


def test_enumerated_candidates_are_layouts_megatron_accepts():
    s = v3_shape()
    cl = cluster(64)
    cands = enumerate_space(s, cl, 512, Constraints(recompute=("none",), dist_opt=(True,)))
    assert cands
    for c in cands:
        assert c.moe and 256 % c.ep == 0 and 64 % (c.etp * c.ep * c.pp) == 0
        assert c.tp == 1 or c.sp                          # MoELayer.forward: SP with TP > 1
        assert c.etp * c.ep <= 8 and 8 % (c.etp * c.ep) == 0   # EP inside the node by default
        assert c.etp in (1, c.tp)
        assert c.edp * c.etp * c.ep * c.pp == 64
        assert c.overrides(512, 4096)["expert_model_parallel_size"] == c.ep
    assert {c.ep for c in cands} == {1, 2, 4, 8}
    wide = enumerate_space(s, cl, 512, Constraints(recompute=("none",), dist_opt=(True,), allow_ep_across_nodes=True))
    assert max(c.ep for c in wide) == 64
    only = enumerate_space(s, cl, 512, Constraints(recompute=("none",), dist_opt=(True,), ep=(32,), etp=(1,)))
    assert {(c.ep, c.etp) for c in only} == {(32, 1)}


def test_moe_step_has_the_ep_comm_term_and_dense_steps_do_not():
    s = v3_shape()
    cl = cluster(64)
    tm = TimeModel(s, cl, 512)
    c8 = make_candidate(s, cl, 512, tp=1, pp=8, ep=8, etp=1)
    st = tm.explain(c8)
    assert st.names == TERM_NAMES_MOE and "ep_comm" in st.term_seconds
    assert st.term_seconds["ep_comm"] > 0
    assert "all-to-alls" in dict((t.name, t.detail) for t in st.terms)["ep_comm"]
    assert sum(st.term_seconds.values()) == pytest.approx(st.seconds)
    # EP 1: no token leaves the rank (alltoall over one rank)
    c1 = make_candidate(s, cl, 512, tp=1, pp=8, ep=1, etp=1)
    assert tm.step_time(c1).term_seconds["ep_comm"] == 0.0
    dense = TimeModel(v3_shape(moe=None), cl, 512)
    assert dense.step_time(make_candidate(v3_shape(moe=None), cl, 512, tp=1, pp=8)).names == TERM_NAMES


def test_model_flops_count_the_active_experts():
    s = v3_shape()
    tm = TimeModel(s, cluster(64), 512)
    # 6 x active matmul weights per token (+ attention): DeepSeek-V3's ~37B activated parameters
    active = s.matmul_params() + s.vocab * s.hidden
    assert 36e9 < active < 39e9
    assert tm.flops_per_token > 6 * active


def test_explain_rejects_an_expert_layout_megatron_would_not_build():
    s = v3_shape()
    with pytest.raises(Exception, match="not divisible by expert tensor parallel"):
        make_candidate(s, cluster(64), 512, tp=1, pp=2, ep=64, etp=1)
    with pytest.raises(Exception, match="no experts"):
        make_candidate(v3_shape(moe=None), cluster(64), 512, tp=1, pp=2, ep=8)


def test_moe_shape_from_megatron_args():
    ms = moe_shape_from_args({"num_experts": 8, "moe_router_topk": 2, "moe_layer_freq": [0, 1, 1, 1],
                              "moe_token_dispatcher_type": "alltoall", "moe_grouped_gemm": True}, 4, 1024)
    assert (ms.experts, ms.topk, ms.ffn, ms.pattern, ms.dispatcher, ms.grouped_gemm) == \
        (8, 2, 1024, (False, True, True, True), "alltoall", True)
    assert moe_shape_from_args({"num_experts": 0}, 4, 1024) is None
    assert moe_shape_from_args({"num_experts": 4, "moe_layer_freq": 2}, 4, 1024).pattern == (True, False, True, False)


# ---- end to end, with the MoE estimator ------------------------------------------------------------------

MIXTRAL_TRAIN = "--bf16 --moe-grouped-gemm --moe-token-dispatcher-type alltoall --tokenizer-type NullTokenizer --vocab-size 32000"


def mixtral_planner(gpus=64, seq=4096, gbs=256):
    from megatron_memguard.planner import Planner
    from megatron_memguard.readers.megatron_flags import parse_megatron_flags
    from megatron_memguard.readers.models import read_model
    raw = read_model("mixtral-8x7b").merged(parse_megatron_flags(MIXTRAL_TRAIN.split()))
    return Planner(raw, cluster(gpus), seq_length=seq, global_batch_size=gbs)


def test_plan_of_an_moe_model_searches_ep_and_writes_it_out():
    p = mixtral_planner()
    assert p.shape.moe is not None and p.shape.moe.experts == 8
    res = p.plan(Constraints(), top=3)
    assert res.entries and not res.rejected          # the enumerated expert layouts are all Megatron's
    for e in res.entries:
        c, L = e.candidate, e.layout
        assert (L.expert_model_parallel_size, L.expert_tensor_parallel_size) == (c.ep, c.etp)
        assert e.estimate.verdict == "fits" and "ep_comm" in e.time.term_seconds
        d = e.to_dict(8)
        assert f"--expert-model-parallel-size {c.ep}" in d["megatron_flags"]
        assert f"model.expert_model_parallel_size={c.ep}" in d["bridge_overrides"]
        assert f"trainer.strategy.expert_tensor_parallel_size={c.etp}" in d["nemo2_overrides"]


def test_memory_bound_stays_below_the_moe_estimate():
    """The planner prunes with a lower bound: on a spread of Mixtral layouts (EP, ETP, recompute, MBS,
    pipeline splits) it must stay below the estimator's device total, or a fitting layout could be lost."""
    from megatron_memguard.planner.bounds import memory_lower_bound
    p = mixtral_planner()
    cands = enumerate_space(p.shape, p.cluster, p.gbs, Constraints(allow_ep_across_nodes=True, etp=(1, 2)))
    checked = 0
    for c in cands[::max(1, len(cands) // 60)]:
        try:
            L = p.layout(c)
        except Exception:
            continue
        est = p.estimate(L)
        lb = memory_lower_bound(p.shape, c, p.timer.stage_params, p.timer.stage_expert_params, p.timer.moe_layers_on)
        assert lb <= max(s.device_total_bytes for s in est.stages), c.name
        checked += 1
    assert checked >= 30


def test_planner_expert_parameters_equal_the_estimators():
    # the planner's per-rank counts (its bound and optimizer term) against the estimator's parameters
    p = mixtral_planner()
    for ep, etp, tp, pp in ((8, 1, 1, 1), (4, 2, 2, 2), (2, 1, 2, 4)):
        c = make_candidate(p.shape, p.cluster, p.gbs, tp=tp, pp=pp, ep=ep, etp=etp)
        est = p.estimate(p.layout(c))
        for st in est.stages:
            assert p.timer.stage_params(c, st.pp_rank) + p.timer.stage_expert_params(c, st.pp_rank) == st.parameters, \
                (c.name, st.pp_rank)


def test_memoised_step_terms_equal_a_fresh_computation_under_vpp():
    """``explain`` recomputes every term (no memo); ``step_time`` reads the DP term from a memo. With DeepSeek-V3's
    3 dense layers first, a rank of the first stage holds no MoE layer at VPP 1 but MoE layers at VPP 2 (its second
    chunk is further up), so its expert gradients differ: the memo's key must hold VPP (it did not; the VPP 2
    candidates got the VPP 1 sibling's DP term, e.g. 0.0009 s for 0.396 s at PP16 on 256 GPUs)."""
    s = v3_shape()
    cl = cluster(256)
    tm = TimeModel(s, cl, 1024)
    cands = [c for c in enumerate_space(s, cl, 1024, Constraints(allow_ep_across_nodes=True))
             if c.pp == 16 and c.tp == 1 and c.cp == 1 and c.mbs == 1]
    assert {c.vpp for c in cands} >= {1, 2}
    assert {tm.moe_layers_on(c, 0) for c in cands if c.vpp == 1} == {0}
    assert all(tm.moe_layers_on(c, 0) > 0 for c in cands if c.vpp == 2)
    for c in cands:             # fill the memo in enumeration order, VPP 1 and VPP 2 siblings mixed
        tm.step_time(c)
    for c in cands:
        assert tm.step_time(c).values == pytest.approx(tm.explain(c).values, rel=1e-12), c.name


def test_enumerate_pruned_is_the_space_without_the_refused_groups():
    """enumerate_pruned asks once per group of candidates alike but for MBS, SP, recomputation and FP8 (Mixtral on
    64 GPUs, a limit at the median state bound so that about half the groups are refused), leaves out exactly the
    candidates whose own state bound is over the limit, in enumeration order, and counts them."""
    from megatron_memguard.planner.space import enumerate_pruned
    p = mixtral_planner()
    cons = Constraints(allow_ep_across_nodes=True, etp=(1, 2), fp8=(None, "tensorwise"), fsdp=("optim_grads",))
    full = enumerate_space(p.shape, p.cluster, p.gbs, cons)
    bounds = sorted(p.state_bound(c) for c in full)
    limit = bounds[len(bounds) // 2]
    asked = []

    def prune(c):
        asked.append(c)
        return p.state_bound(c) > limit
    kept, n = enumerate_pruned(p.shape, p.cluster, p.gbs, cons, prune=prune)
    want = [c for c in full if p.state_bound(c) <= limit]
    assert kept == want and n == len(full) - len(want) and 0 < n < len(full)
    groups = {(c.tp, c.cp, c.pp, c.stage_layers, c.first, c.last, c.pp_layout, c.vpp, c.ep, c.etp, c.dist_opt, c.fsdp)
              for c in full}
    assert len(asked) <= len(groups) < len(full) / 4
