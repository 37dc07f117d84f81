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
WORK = ("gemm", "attention", "elementwise", "kernel_gaps", "input", "recompute", "tp_comm", "cp_comm")


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
def test_bubble_is_the_other_ranks_work_over_vpp(model, gpus, gbs):
    """m x the slowest rank's time plus (the other ranks' times) / VPP (Alpa, Zheng et al. 2022 section 5.2;
    Narayanan et al. 2021: (PP - 1) / (VPP m) of the stage's work when the ranks are equal)."""
    P = make_planner(model, gpus, 8192, gbs)
    cands = enumerate_space(P.shape, P.cluster, gbs, Constraints())
    checked = 0
    for c in cands:
        st = P.step_time(c)
        t, w = st.term_seconds, st.stage_seconds
        work = sum(t[k] for k in WORK)
        assert work == pytest.approx(c.m * max(w), rel=1e-12)
        assert t["bubble"] == pytest.approx((sum(w) - max(w)) / c.vpp, rel=1e-12, abs=1e-15)
        if len(set(w)) == 1:
            assert t["bubble"] == pytest.approx((c.pp - 1) / (c.vpp * c.m) * work, rel=1e-12)
        if c.pp > 1:
            checked += 1
    assert checked > 100


def test_bubble_by_hand_70b_tp8_pp4_vpp5():
    """1024 GPUs, GBS 1024, MBS 1: DP = 1024 / 32 = 32, m = 1024 / 32 = 32; with equal ranks the bubble would
    be 3 / (5 * 32) = 1.875% of the slowest rank's work. The last rank also runs the output layer and loss
    (its 128,256 x 8,192 weights are 1.2 of a layer's 856M / TP), so it is the slowest and the bubble is
    the three others' time / 5: ranks 1 and 2 hold 20 layers each, rank 0 the same plus the embedding."""
    P = make_planner(LLAMA31_70B, 1024, 8192, 1024)
    from megatron_memguard.planner.space import make_candidate
    c = make_candidate(P.shape, P.cluster, 1024, tp=8, pp=4, vpp=5, cp=1, mbs=1)
    assert (c.dp, c.m) == (32, 32)
    st = P.step_time(c)
    t, w = st.term_seconds, st.stage_seconds
    assert st.critical_stage == 3 and w[1] == w[2] < w[0] < w[3]
    work = sum(t[k] for k in WORK)
    assert t["bubble"] == pytest.approx((w[0] + w[1] + w[2]) / 5, rel=1e-12)
    assert 0.01875 * w[1] / w[3] < t["bubble"] / work < 0.01875


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
    every boundary is NVLink; on two nodes the stage 1 -> 2 boundary crosses nodes and paces the pipeline.
    Two blocking transfers per micro-batch, and 2 (PP - 1) more for the fill and the drain."""
    from megatron_memguard.planner.space import make_candidate
    from megatron_memguard.planner.comm import NETWORK_EFFICIENCY, NVLINK_EFFICIENCY, P2P_LATENCY
    nbytes = 8192 * 4096 * 2 // 2                  # MBS 1 x seq x hidden x bf16 / TP (SP)
    for gpus, link, eff in ((8, "nvlink_bytes_per_s", NVLINK_EFFICIENCY), (16, "network_bytes_per_s", NETWORK_EFFICIENCY)):
        P = make_planner(LLAMA31_8B, gpus, 8192, 64)
        c = make_candidate(P.shape, P.cluster, 64, tp=2, pp=4, mbs=1)
        bw = getattr(P.cluster.gpu, link) * eff
        assert P.step_time(c).term_seconds["pp_p2p"] == pytest.approx((2 * c.m + 2 * 3) * (P2P_LATENCY + nbytes / bw),
                                                                      rel=1e-12)
        assert ("NVLink" if gpus == 8 else "the network") in P.timer.explain(c).terms[TERM_NAMES.index("pp_p2p")].detail


def test_get_batch_by_hand():
    """Megatron's get_batch on A100 (PCIe 4.0 x16, 32 GB/s per direction, at 80%: 25.6 GB/s): one sequence of
    8192 tokens is tokens, labels, position ids (int64) and the loss mask (fp32), 28 B per token, plus the
    [1, 1, 8192, 8192] bool attention mask the data loader makes by default: 67,108,864 + 229,376 bytes copied
    to TP rank 0, broadcast to the other TP ranks over NVLink (the whole tensor over each link of the ring),
    and cut to 1/CP on each context-parallel rank (index_select: read and write 1/CP of it)."""
    from megatron_memguard.planner.comm import HOST_LINK_EFFICIENCY, NVLINK_EFFICIENCY, NVLINK_STEP_LATENCY
    from megatron_memguard.planner.kernels import HBM_EFFICIENCY
    P = make_planner(LLAMA31_8B, 16, 8192, 64, gpu="A100-40GB")
    g = P.cluster.gpu
    nbytes = 8192 * 8192 + 8192 * 28
    assert P.timer.batch_bytes(1) == nbytes == 67_338_240
    copy = nbytes / (32e9 * HOST_LINK_EFFICIENCY)
    assert P.timer.batch_seconds(1, 1, 1) == pytest.approx(copy, rel=1e-12)
    assert 2.5e-3 < copy < 2.7e-3
    bcast = nbytes / (g.nvlink_bytes_per_s * NVLINK_EFFICIENCY) + 3 * NVLINK_STEP_LATENCY
    cut = 2 * nbytes / 2 / (g.hbm_bytes_per_s * HBM_EFFICIENCY)
    assert P.timer.batch_seconds(4, 2, 1) == pytest.approx(copy + bcast + cut, rel=1e-12)
    # the input term is m x get_batch on a single stage (it is both the first and the last)
    from megatron_memguard.planner.space import make_candidate
    c = make_candidate(P.shape, P.cluster, 64, tp=4, pp=1, cp=2, mbs=1)
    assert P.step_time(c).term_seconds["input"] == pytest.approx(c.m * (copy + bcast + cut), rel=1e-12)
    # without the mask only the 28 B per token remain
    Q = make_planner(LLAMA31_8B + ["--no-create-attention-mask-in-dataloader"], 16, 8192, 64, gpu="A100-40GB")
    assert Q.timer.batch_bytes(2) == 2 * 8192 * 28


def test_dense_embedding_gradient_and_cross_entropy_bytes_by_hand():
    """The input embedding's weight gradient is dense every micro-batch: PyTorch zero-fills a [V/t, h] bf16
    gradient (2 B), Megatron's DDP hook adds it into the fp32 main_grad (read 2 B, read and write 4 + 4 B):
    12 B x 128256 x 4096 = 6,304,038,912 bytes at TP1 (the vocabulary is a multiple of 128 already; at TP4 it is
    padded to 128512, a multiple of 128 x 4). Megatron's unfused vocab-parallel cross entropy moves 52 B per logit (38 forward,
    14 backward), the fused one 24."""
    from megatron_memguard.planner.kernels import memory_seconds
    from megatron_memguard.planner.timing import CE_BYTES, CE_BYTES_FUSED
    P = make_planner(LLAMA31_8B, 8, 8192, 64, gpu="A100-40GB")
    assert P.shape.padded_vocab(1) == 128256 and P.shape.padded_vocab(4) == 128512
    assert P.timer.emb_grad_bytes(1) == 12 * 128256 * 4096 == 6_304_038_912
    assert P.timer.emb_grad_bytes(4) == 12 * 128512 // 4 * 4096
    ec = P.timer.ends_cost(1, 1, 1, False)
    assert ec.emb_bwd == pytest.approx(memory_seconds(12 * 8192 * 4096 + 6_304_038_912, P.cluster.gpu), rel=1e-12)
    assert ec.out_elem == pytest.approx(memory_seconds(52 * 8192 * 128256, P.cluster.gpu), rel=1e-12)
    F = make_planner(LLAMA31_8B + ["--cross-entropy-loss-fusion"], 8, 8192, 64, gpu="A100-40GB")
    assert F.timer.ends_cost(1, 1, 1, False).out_elem == pytest.approx(ec.out_elem * CE_BYTES_FUSED / CE_BYTES)


LLAMA1_30B = ("--num-layers 60 --hidden-size 6656 --ffn-hidden-size 17920 --num-attention-heads 52 "
              "--max-position-embeddings 2048 --position-embedding-type rope --normalization RMSNorm --swiglu "
              "--disable-bias-linear --untie-embeddings-and-output-weights --tokenizer-type NullTokenizer "
              "--vocab-size 32000 --bf16").split()


@pytest.mark.parametrize("sp", [True, False])
def test_synchronous_tp_collectives_by_hand(sp):
    """LLaMA-30B (h 6656), seq 2048, MBS 2, TP4 on one A100 node. Each collective moves S = 2 x 2048 x 6656 x 2 B
    = 54,525,952 B; an all-gather or reduce-scatter over 4 GPUs on NVLink takes 3/4 S / (300 GB/s x 0.8)
    + 3 x 3 us = 179.4 us, an all-reduce twice that. With synchronous collectives (tp_overlap=False: none hidden
    behind a GEMM, megatron-core's tensor_parallel/mappings.py pattern) a layer's backward pays, with SP, the
    all-gathers of both row-parallel output gradients, the re-gathers of both column-parallel inputs and the
    reduce-scatters of both input gradients (6 x 179.4 us), its forward 2 all-gathers + 2 reduce-scatters;
    without SP the backward's two all-reduces equal the forward's. Megatron's overlap (the default) hides part
    of the backward's behind the dgrad / wgrad GEMMs, never the forward's."""
    from megatron_memguard.planner.timing import TimeModel
    P = make_planner(LLAMA1_30B, 8, 2048, 64, gpu="A100-80GB")
    S = 2 * 2048 * 6656 * 2
    assert S == 54_525_952
    one = 0.75 * S / (300e9 * 0.8) + 3 * 3e-6
    assert one == pytest.approx(179.4e-6, rel=1e-3)
    sync = TimeModel(P.shape, P.cluster, 64, tp_overlap=False).layer_cost(4, 1, 2, sp)
    over = P.timer.layer_cost(4, 1, 2, sp)
    if sp:
        assert sync.tp_fwd == pytest.approx(4 * one, rel=1e-12)
        assert sync.tp_bwd == pytest.approx(6 * one, rel=1e-12)
    else:
        assert sync.tp_fwd == pytest.approx(4 * one, rel=1e-12)     # two all-reduces
        assert sync.tp_bwd == pytest.approx(4 * one, rel=1e-12)
    assert over.tp_fwd == sync.tp_fwd
    assert over.tp_bwd < sync.tp_bwd
    # everything else in the layer is the same
    assert (over.gemm_fwd, over.gemm_bwd, over.attn_fwd, over.elem_fwd) == (sync.gemm_fwd, sync.gemm_bwd,
                                                                            sync.attn_fwd, sync.elem_fwd)
    # the step's tp_comm term says so in --explain's sentence
    from megatron_memguard.planner.space import make_candidate
    c = make_candidate(P.shape, P.cluster, 64, tp=4, pp=1, cp=1, mbs=2, sp=sp)
    tm = TimeModel(P.shape, P.cluster, 64, tp_overlap=False)
    text = dict(zip(tm.explain(c).names, tm.explain(c).details))["tp_comm"]
    assert "synchronous TP collectives" in text
    assert "synchronous" not in dict(zip(P.timer.explain(c).names, P.timer.explain(c).details))["tp_comm"]
    assert tm.step_time(c).term_seconds["tp_comm"] > P.step_time(c).term_seconds["tp_comm"]
