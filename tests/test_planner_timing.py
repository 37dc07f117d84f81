"""The step-time model: facts checkable by hand (FLOP count, bubble) and the orderings it must keep."""
import pytest

from megatron_memguard import layout_from_flags
from megatron_memguard.estimator.params import total_parameters
from megatron_memguard.planner.space import Constraints, enumerate_space
from megatron_memguard.gpus import lookup_gpu
from megatron_memguard.planner.kernels import attention_seconds, gemm_efficiency, wave_efficiency
from megatron_memguard.planner.timing import TERM_NAMES, ring_attention_steps

from conftest import LLAMA31_70B, LLAMA31_8B
from planner_util import key_of, make_planner

TiB = 2**40
# what the pipeline bubble idles: the stage's own work and its exposed TP / CP communication
WORK = ("gemm", "attention", "elementwise", "kernel_gaps", "recompute", "tp_comm", "cp_comm")


def test_model_flops_per_token_llama31_8b():
    """6N + 12*L*h*s (Narayanan et al. 2021 eq. 3; PaLM appendix B), attention counted fully (no causal
    halving), N = the weights that multiply an activation: every layer weight and the output layer, not
    the input embedding (a lookup) nor the norm weights.

    Llama-3.1-8B: N_total = 8,030,261,248 (model card); embedding table 128256 x 4096 = 525,336,576;
    RMSNorm weights (2 x 32 + 1) x 4096 = 266,240. N = 7,504,658,432; 6N = 45,027,950,592;
    12 x 32 x 4096 x 8192 = 12,884,901,888; sum 57,912,852,480 FLOPs per token."""
    P = make_planner(LLAMA31_8B, 8, 8192, 8)
    assert P.timer.flops_per_token == 57_912_852_480
    L = layout_from_flags(LLAMA31_8B + ["--micro-batch-size", "1"], world_size=1)
    n = total_parameters(L) - 128256 * 4096 - (2 * 32 + 1) * 4096
    assert n == 7_504_658_432
    assert P.timer.flops_per_token == 6 * n + 12 * 32 * 4096 * 8192


def test_model_flops_llama31_70b():
    P = make_planner(LLAMA31_70B, 8, 8192, 8)
    L = layout_from_flags(LLAMA31_70B + ["--micro-batch-size", "1"], world_size=1)
    n = total_parameters(L) - 128256 * 8192 - (2 * 80 + 1) * 8192
    assert P.timer.flops_per_token == 6 * n + 12 * 80 * 8192 * 8192


@pytest.mark.parametrize("model, gpus, gbs", [(LLAMA31_8B, 64, 512), (LLAMA31_70B, 256, 512)])
def test_bubble_is_pp_minus_1_over_vpp_m_of_the_stage_work(model, gpus, gbs):
    P = make_planner(model, gpus, 8192, gbs)
    cands = enumerate_space(P.shape, P.cluster, gbs, Constraints())
    checked = 0
    for c in cands:
        t = P.step_time(c).term_seconds
        work = sum(t[k] for k in WORK)
        assert t["bubble"] == pytest.approx((c.pp - 1) / (c.vpp * c.m) * work, rel=1e-12)
        if c.pp > 1:
            checked += 1
    assert checked > 100


def test_bubble_by_hand_70b_tp8_pp4_vpp5():
    """1024 GPUs, GBS 1024, MBS 1: DP = 1024 / 32 = 32, m = 1024 / 32 = 32; bubble = 3 / (5 * 32) = 1.875%."""
    P = make_planner(LLAMA31_70B, 1024, 8192, 1024)
    from megatron_memguard.planner.space import make_candidate
    c = make_candidate(P.shape, P.cluster, 1024, tp=8, pp=4, vpp=5, cp=1, mbs=1)
    assert (c.dp, c.m) == (32, 32)
    t = P.step_time(c).term_seconds
    work = sum(t[k] for k in WORK)
    assert t["bubble"] / work == pytest.approx(0.01875)


def test_terms_add_up_and_explain_agrees():
    P = make_planner(LLAMA31_70B, 1024, 8192, 1024)
    for c in enumerate_space(P.shape, P.cluster, 1024, Constraints(tp=(8,), pp=(4,)))[:50]:
        st = P.step_time(c)
        ex = P.timer.explain(c)
        assert [t.name for t in ex.terms] == list(TERM_NAMES)
        assert st.seconds == pytest.approx(sum(st.values), rel=1e-12)
        assert ex.values == st.values and all(t.detail for t in ex.terms)
        assert 0 < st.mfu < 1
        assert st.tokens_per_s_per_gpu == pytest.approx(1024 * 8192 / st.seconds / 1024)


def test_recompute_never_makes_a_layout_faster():
    for model, gpus, gbs in ((LLAMA31_8B, 64, 512), (LLAMA31_70B, 1024, 1024)):
        P = make_planner(model, gpus, 8192, gbs)
        cands = enumerate_space(P.shape, P.cluster, gbs, Constraints())
        by_key = {key_of(c): c for c in cands}
        n = 0
        for c in cands:
            if c.recompute != "none":
                base = by_key[key_of(c, recompute="none")]
                assert P.step_time(base).seconds < P.step_time(c).seconds
                n += 1
        assert n > 1000


def test_pp_never_raises_throughput_at_the_same_dp():
    """The same TP, CP, DP, MBS and settings with PP = k on k times the GPUs: never more tokens/s per GPU
    (the bubble, the p2p transfers and the unbalanced output layer only add; DP traffic and the
    optimizer step shrink with the stage, per GPU exactly as much as the GPUs grow)."""
    gbs = 512
    base = make_planner(LLAMA31_8B, 64, 8192, gbs, gpu_memory=TiB)
    n = 0
    for k in (2, 4):
        big = make_planner(LLAMA31_8B, 64 * k, 8192, gbs, gpu_memory=TiB)
        cands = enumerate_space(big.shape, big.cluster, gbs, Constraints(pp=(k,)))
        flat = {key_of(c, pp=1, vpp=1, first=None, last=None): c
                for c in enumerate_space(base.shape, base.cluster, gbs, Constraints(pp=(1,)))}
        for c in cands:
            b = flat.get(key_of(c, pp=1, vpp=1, first=None, last=None))
            if b is None or b.dp != c.dp:
                continue
            assert big.step_time(c).tokens_per_s_per_gpu <= base.step_time(b).tokens_per_s_per_gpu
            n += 1
    assert n > 100


def test_pp_never_ranks_higher_in_the_documented_example():
    """Llama-3.1-8B, 64 H100 (8 nodes), seq 8192, GBS 512, with enough memory for everything: every
    layout with PP > 1 is slower than the same layout with PP = 1 (docs/planner.md, 'Orderings')."""
    P = make_planner(LLAMA31_8B, 64, 8192, 512, gpu_memory=TiB)
    cands = enumerate_space(P.shape, P.cluster, 512, Constraints())
    by_key = {key_of(c): c for c in cands}
    n = 0
    for c in cands:
        if c.pp > 1:
            b = by_key.get(key_of(c, pp=1, vpp=1, first=None, last=None))
            if b is not None:
                assert P.step_time(b).seconds < P.step_time(c).seconds, (c.name, b.name)
                n += 1
    assert n > 1000
    res = P.plan(top=40)
    names = [e.candidate for e in res.entries]
    for i, c in enumerate(names):
        for j, d in enumerate(names):
            if c.pp > 1 and key_of(d) == key_of(c, pp=1, vpp=1, first=None, last=None):
                assert j < i


def test_gemm_efficiency_by_hand():
    """A100 (108 SMs, large-GEMM efficiency 0.78), 8192 x 8192 x 8192: 32 x 64 = 2048 output tiles of 256 x 128
    = 18.96 waves, at 18.96 / 19.46 of the full rate (the last wave half full on average); the reduction of
    8192 runs at 8192 / (8192 + 128)."""
    a100 = lookup_gpu("A100-80GB")
    w = 2048 / 108
    assert gemm_efficiency(8192, 8192, 8192, a100) == pytest.approx(0.78 * w / (w + 0.5) * 8192 / 8320, rel=1e-12)
    # half a wave keeps half the SMs busy; two waves lose a quarter wave's worth on average
    assert wave_efficiency(54, 108) == pytest.approx(0.5) and wave_efficiency(216, 108) == pytest.approx(0.8)
    # edge tiles count whole: 200 x 100 fills one 256 x 128 tile to 61%
    assert gemm_efficiency(200, 100, 1024, a100) == pytest.approx(
        0.78 * (1 / 108) * (200 * 100 / (256 * 128)) * 1024 / 1152, rel=1e-12)
    e = [gemm_efficiency(n, n, n, a100) for n in (256, 1024, 4096, 16384)]
    assert e == sorted(e) and 0.76 < e[-1] < 0.78
    P = make_planner(LLAMA31_70B, 64, 8192, 64)
    effs = [P.timer.layer_cost(tp, 1, 1, True).gemm_eff for tp in (1, 2, 4, 8)]
    assert effs == sorted(effs, reverse=True)


def test_attention_flops_by_hand_and_the_context_parallel_ring():
    """Causal attention of 8192 tokens, 32 heads of 128: QK^T and PV are 2 x 2 x 8192 x 8192 x 32 x 128 FLOPs,
    half of it unmasked: 5.498e11. Megatron's load-balanced ring splits it over CP ranks exactly (each rank:
    1/CP of it, in CP steps), with kernels on shorter blocks that run at a lower rate."""
    h100 = lookup_gpu("H100-80GB")
    fwd, bwd, flops = attention_seconds(1, 32, 8192, 8192, True, 128, 128, h100)
    assert flops == 2 * 2 * 8192 * 8192 * 32 * 128 / 2 == 549_755_813_888
    assert bwd == pytest.approx(2.5 * fwd)
    for cp in (2, 4, 8):
        steps = ring_attention_steps(1, 32, 8192, cp, 128, 128, h100)
        assert len(steps) == cp
        assert sum(x[2] for x in steps) == pytest.approx(flops / cp, rel=1e-12)
        assert sum(x[0] for x in steps) > fwd / cp


def test_tp_across_nodes_costs_more_than_inside():
    P = make_planner(LLAMA31_70B, 1024, 8192, 1024)
    S = 8192 * 8192 * 2
    inside = P.timer.collective("ag", S, 8, 8)
    across = P.timer.collective("ag", S, 16, 8)
    assert across > inside
    # one member per node: every byte goes through the NIC (50 GB/s on H100 nodes)
    assert P.timer.collective("ag", S, 8, 1) > 5 * inside


def test_pipeline_transfers_use_nvlink_only_when_the_pipeline_stays_in_a_node():
    """PP is the outermost rank dimension: stage i holds ranks [4i, 4i+4) for TP2 DP2 below. On one 8-GPU node
    every boundary is NVLink; on two nodes the stage 1 -> 2 boundary crosses nodes and paces the pipeline."""
    from megatron_memguard.planner.space import make_candidate
    from megatron_memguard.planner.comm import NETWORK_EFFICIENCY, NVLINK_EFFICIENCY, P2P_LATENCY
    nbytes = 8192 * 4096 * 2 // 2                  # MBS 1 x seq x hidden x bf16 / TP (SP)
    for gpus, link, eff in ((8, "nvlink_bytes_per_s", NVLINK_EFFICIENCY), (16, "network_bytes_per_s", NETWORK_EFFICIENCY)):
        P = make_planner(LLAMA31_8B, gpus, 8192, 64)
        c = make_candidate(P.shape, P.cluster, 64, tp=2, pp=4, mbs=1)
        bw = getattr(P.cluster.gpu, link) * eff
        assert P.step_time(c).term_seconds["pp_p2p"] == pytest.approx(2 * c.m * (P2P_LATENCY + nbytes / bw), rel=1e-12)
        assert ("NVLink" if gpus == 8 else "the network") in P.timer.explain(c).terms[TERM_NAMES.index("pp_p2p")].detail
