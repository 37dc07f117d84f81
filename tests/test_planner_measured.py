"""The step-time model against Megatron-LM's measured throughput: Llama-3.1-8B at sequence 8192 on A100-40GB
(Fujii et al.'s draft tables, shared/groundtruth/throughput/fujii2024-draft-a100.csv, read from there;
benchmarks/planner_quality.py describes the sweeps and scores the whole ranking). Each test takes an
ordering Megatron measured and checks the model predicts it for every pair of layouts that ran."""
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import math  # noqa: E402
import statistics  # noqa: E402

from benchmarks.planner_quality import (FIRST_WITHIN, fujii_sweeps, hagemann_sweeps, planner_for, quality,  # noqa: E402
                                        score)
from megatron_memguard.planner.space import make_candidate  # noqa: E402

SWEEPS = fujii_sweeps()


def _pairs(sweep, a, b):
    """(run a, run b) for every cell pair that both ran, cells keyed by (tp, cp, pp, mbs)."""
    ran = {(r.tp, r.cp, r.pp, r.mbs): r for r in sweep.runs if not r.failed}
    for key, r in ran.items():
        other = b(*key)
        if a(*key) and other in ran:
            yield r, ran[other]


def _seconds(P, r):
    return P.step_time(make_candidate(P.shape, P.cluster, P.gbs, tp=r.tp, pp=r.pp, cp=r.cp, mbs=r.mbs)).seconds


def _disagreements(a, b, min_gap=0.03):
    """Pairs (world, label of a) where Megatron ran layout a more than ``min_gap`` faster than b and the
    model predicts a slower; also returns how many such pairs there are."""
    wrong, n = set(), 0
    for sw in SWEEPS:
        P = planner_for(sw)
        for x, y in _pairs(sw, a, b):
            if x.throughput > (1 + min_gap) * y.throughput:
                n += 1
                if _seconds(P, x) >= _seconds(P, y):
                    wrong.add((sw.world, x.label))
    return wrong, n


def test_tensor_parallelism_beats_context_parallelism_at_8k_on_a100():
    """Where Megatron ran TP4 CP2 more than 3% faster than TP2 CP4 (same PP, MBS, GPUs; 5-24% in 12 pairs),
    the model agrees with one sequence per micro-batch: the ring's per-step kernels on short blocks and
    their merges cost more than TP4's extra collectives on NVLink. With two sequences the model's margin
    is reversed (about 1%; Megatron's is 8-21%): the known misses, listed so that no new one slips in."""
    wrong, n = _disagreements(lambda tp, cp, pp, mbs: (tp, cp) == (4, 2), lambda tp, cp, pp, mbs: (2, 4, pp, mbs))
    assert n == 12
    assert wrong <= {(w, "TP4 CP2 PP2 MBS2 SP") for w in (32, 64, 128, 256)}


def test_two_sequences_per_micro_batch_beat_one():
    """Where Megatron ran MBS 2 more than 3% faster than MBS 1 (the same layout otherwise; 19 of 23 pairs), the
    model agrees (larger GEMMs and attention kernels fill the SMs better), except at 256 GPUs for TP4 PP2,
    where its 1F1B bubble over 16 micro-batches outweighs the gain (measured: +16%)."""
    wrong, n = _disagreements(lambda tp, cp, pp, mbs: mbs == 2, lambda tp, cp, pp, mbs: (tp, cp, pp, 1))
    assert n == 19
    assert wrong <= {(256, "TP4 CP1 PP2 MBS2 SP")}


@pytest.mark.parametrize("sweep", SWEEPS, ids=[s.name for s in SWEEPS])
def test_first_choice_is_within_3_percent_of_the_measured_best(sweep):
    """Restricted to the layouts the sweep ran and that the estimator says fit, the planner's first choice
    reaches at least 97% of the best measured throughput (issue 18's target)."""
    q = quality(sweep, score(sweep), "time")
    assert q.first_rel >= FIRST_WITHIN, (q.first, q.first_rel)


def _both_rules(sweeps):
    out = []
    for sw in sweeps:
        sc = score(sw)
        out.append((sw, quality(sw, sc, "time"), quality(sw, sc, "fujii2024")))
    return out


def _worse(t, f) -> bool:
    """The time rule does worse than Fujii et al.'s on a sweep: a slower first choice or a lower Spearman."""
    return t.first_rel < f.first_rel - 1e-9 or (not math.isnan(f.spearman) and t.spearman < f.spearman - 1e-9)


def test_megatron_sweeps_rank_at_least_as_well_as_fujii_rule():
    """Issue 18 on Megatron-LM's sweeps (8-256 A100-40GB): median Spearman of the ranking against the measured
    throughput >= 0.85 (reached: 0.94 with the 4% tie window; 0.90 without), and on no sweep a slower first
    choice or a lower Spearman than `--rule fujii2024` (three sweeps were worse without the tie window)."""
    rows = _both_rules(SWEEPS)
    rhos = [t.spearman for _, t, _ in rows if not math.isnan(t.spearman)]
    assert statistics.median(rhos) >= 0.93
    assert [sw.name for sw, t, f in rows if _worse(t, f)] == []


def test_hagemann_sweeps_first_choice_and_spearman():
    """Hagemann et al.'s sweeps (another framework, A100-80GB; the framework's own outcomes decide which layouts
    are ranked; read with synchronous TP collectives, benchmarks/planner_quality.py): median Spearman >= 0.90
    (reached 0.906), the first choice within 3% of the best in 9 of 10 sweeps (LLaMA-30B s2048 at 256 GPUs:
    95%, data-parallel traffic the model's network does not slow enough), worse than `--rule fujii2024` on at
    most LLaMA-13B s2048 at 32 GPUs (Spearman 0.67 against 0.69; it was two sweeps, four without the window;
    none of the physical candidates of `planner_quality.py --candidates` fixes it within the targets)."""
    rows = _both_rules(hagemann_sweeps())
    assert len(rows) == 10
    assert statistics.median(t.spearman for _, t, _ in rows) >= 0.90
    assert sum(t.first_ok for _, t, _ in rows) >= 9
    assert {sw.name for sw, t, f in rows if _worse(t, f)} <= {"LLaMA-13B s2048 32 x A100-80GB"}


def test_hagemann_other_kernels_never_worse_than_fujii_rule():
    """The same framework's sheets with other kernels (FlashAttention-2 without the fused RMSNorm, FlashAttention
    1.0.8; not targets, not looked at to set anything): on none does the time rule rank worse than
    `--rule fujii2024` (one sheet each was with Megatron's overlapped TP collectives), medians 0.78 and 0.84."""
    from benchmarks.planner_quality import other_kernel_sweeps
    rows = _both_rules(other_kernel_sweeps())
    assert len(rows) == 10
    assert [sw.name for sw, t, f in rows if _worse(t, f)] == []
    for fam, floor in (("hagemann-fa2", 0.78), ("hagemann-fa1", 0.83)):
        assert statistics.median(t.spearman for sw, t, _ in rows if sw.family == fam) >= floor


def test_hagemann_step_grows_with_tp_unless_collectives_are_synchronous():
    """Why the Hagemann sheets are read with synchronous TP collectives: with Megatron's overlap, measured /
    predicted step time grows with TP across all ten sheets (median at TP8 with SP 1.21 against 1.07 at TP1);
    with none overlapped the gap shrinks by more than half (1.12 against 1.07)."""
    import dataclasses

    def tp_ratio(overlap):
        by = {}
        for sw in hagemann_sweeps():
            sw = dataclasses.replace(sw, tp_overlap=overlap)
            P = planner_for(sw)
            for sc in score(sw, P):
                if sc.run.failed or sc.seconds is None:
                    continue
                meas = sw.gbs * sw.seq * P.timer.flops_per_token / (sw.world * sc.run.throughput * 312e12)
                by.setdefault((sc.run.tp, sc.run.sp), []).append(meas / sc.seconds)
        return {k: statistics.median(v) for k, v in by.items()}

    over, sync = tp_ratio(True), tp_ratio(False)
    assert over[(8, True)] - over[(1, False)] > 0.12
    assert sync[(8, True)] - sync[(1, False)] < 0.06
    for k in over:
        assert sync[k] <= over[k] + 1e-9


def _ratio(sweep_name, label):
    """Measured / predicted step time of one layout of a Hagemann sheet (measured from its MFU at 312 TFLOP/s)."""
    sw = next(s for s in hagemann_sweeps() if s.name == sweep_name)
    P = planner_for(sw)
    sc = next(s for s in score(sw, P) if s.run.label == label)
    return sw.gbs * sw.seq * P.timer.flops_per_token / (sw.world * sc.run.throughput * 312e12) / sc.seconds, sc, P


def test_hagemann_256_gpu_excess_is_not_set_by_the_data_parallel_group():
    """Why LLaMA-30B s2048 on 256 GPUs stays a miss (docs/planner.md section 5.2): LLaMA-13B TP1 PP1 MBS1 on 64
    GPUs and LLaMA-30B TP1 PP4 MBS1 on 256 reduce over the same group (DP 64, all 8 GPUs of a node, 8 nodes),
    the 13B one more bytes per GPU (13.0 B parameters against 8.1 B), at the same number of micro-batches (32).
    Measured, the 13B step is 5% shorter than modelled and the 30B step 32% longer: nothing that depends on the
    layout's data-parallel group, its bytes or its micro-batches (the candidates of --candidates) can give both."""
    r13, s13, P13 = _ratio("LLaMA-13B s2048 64 x A100-80GB", "TP1 CP1 PP1 MBS1")
    r30, s30, P30 = _ratio("LLaMA-30B s2048 256 x A100-80GB", "TP1 CP1 PP4 MBS1")
    for sc, P in ((s13, P13), (s30, P30)):
        c = sc.candidate
        assert (c.dp, P.timer.dpcp_per_domain(c.tp, c.dp), c.m) == (64, 8, 32)
    assert P13.timer.stage_params(s13.candidate, 0) > 1.5 * P30.timer.stage_params(s30.candidate, 0)
    assert r13 < 0.97 and r30 > 1.28


def test_candidate_bucket_latency_by_hand():
    """The alpha-beta candidate on LLaMA-30B TP4 PP1 at 256 GPUs: DP 64, 2 ranks per node over 32 nodes, so a ring
    pass has 1 NVLink step (3 us) and 31 network steps (8 us) = 251 us; the rank holds 60 x (4 x 6656^2 + 3 x 6656 x
    17920) / 4 + 2 x 32256 x 6656 / 4 + 121 x 6656 = 8,133,691,904 parameters (layers, embedding and output
    layer split over TP, the vocabulary padded to a multiple of 128 x TP as Megatron pads it, norms whole), 128 buckets of max(40M, 64 x 1M) elements: 2 x 127 extra passes = 63.8 ms."""
    from benchmarks.planner_quality import cand_bucket_latency
    _, sc, P = _ratio("LLaMA-30B s2048 256 x A100-80GB", "TP4 CP1 PP1 MBS1 noSP")
    assert P.timer.stage_params(sc.candidate, 0) == 8_133_691_904
    assert math.isclose(cand_bucket_latency(P, sc.candidate), 2 * 127 * 251e-6, rel_tol=1e-9)


def test_no_physical_candidate_reaches_the_30b_256_gpu_excess():
    """The largest candidate, the whole ZeRO-1 reduce-scatter and all-gather exposed (no overlap), adds under 10%
    to any layout of that sheet, while its slowest layout, TP4 PP1 MBS2, ran 1.9 x the model's step (1.22 x for
    the fastest, TP2 PP4 MBS1): the gap needs about ten times less network than the NICs give."""
    from benchmarks.planner_quality import cand_dp_exposed
    slow, sc, P = _ratio("LLaMA-30B s2048 256 x A100-80GB", "TP4 CP1 PP1 MBS2 noSP")
    fast, _, _ = _ratio("LLaMA-30B s2048 256 x A100-80GB", "TP2 CP1 PP4 MBS1 noSP")
    assert slow > 1.85 and fast < 1.25
    extra = cand_dp_exposed(P, sc.candidate)
    assert 0 < extra < 0.10 * sc.seconds
    assert slow * sc.seconds / (sc.seconds + extra) > 1.5 * fast


def test_hagemann_256_gpu_tp1_pp4_against_tp2_pp4_in_the_other_kernels():
    """The one first-choice miss (LLaMA-30B s2048, 256 GPUs: TP1 PP4 MBS1 at 95% of TP2 PP4 MBS1) is not what
    the same 256-GPU sheets with the other kernels measured: with FlashAttention-2 and with FlashAttention 1
    (unfused RMSNorm, full recomputation) TP1 PP4 MBS1 ran 9% and 14% faster than TP2 PP4 MBS1, and the model
    predicts TP1 PP4 the faster of the two there as in the target sheet."""
    from benchmarks.planner_quality import other_kernel_sweeps
    seen = 0
    for sw in other_kernel_sweeps():
        if sw.name != "LLaMA-30B s2048 256 x A100-80GB":
            continue
        by = {s.run.label: s for s in score(sw, planner_for(sw)) if not s.run.failed}
        a, b = by["TP1 CP1 PP4 MBS1 full-rc"], by["TP2 CP1 PP4 MBS1 noSP full-rc"]
        assert a.run.throughput > 1.08 * b.run.throughput
        assert a.seconds < b.seconds
        seen += 1
    assert seen == 2


# ---- Issue 18, the last two misses (benchmarks/planner_quality.py --bands; docs/planner.md section 5.2) ----
_TARGETS = None


def _targets():
    global _TARGETS
    if _TARGETS is None:
        _TARGETS = [(sw, score(sw)) for sw in SWEEPS + hagemann_sweeps()]
    return _TARGETS


def _sweep(name):
    return next((sw, sc) for sw, sc in _targets() if sw.name == name)


def test_hagemann_repeats_bound_the_noise_far_below_the_13b_miss():
    """The SP sheets ran every layout with SP on and off and SP does nothing at TP 1, so their TP 1 rows are repeats
    (with two cells run twice: 6 in all; LLaMA-13B on 32 GPUs TP1 PP1 MBS1: 53.99 and 53.81 s, 0.3% apart): at most
    1.2% apart, one trial's sd under 0.6%. With that noise a perfect ranking of LLaMA-13B s2048 on 32 GPUs reaches a
    Spearman of 0.97 or more, so its 0.67 is the model's, not the data's. Against Fujii et al.'s rule (0.69), though,
    the difference is a fifth of its jackknife standard error over the 13 layouts: the sweep cannot tell the two apart."""
    from benchmarks.planner_quality import noise_ceiling, repeated_cells, spearman_gap, trial_sd
    reps = repeated_cells()
    assert len(reps) == 6
    assert ("LLaMA-13B s2048 32 GPUs TP1 PP1 MBS1", 53.8062, 53.9891) in reps
    assert max(abs(math.log(a / b)) for _, a, b in reps) < 0.012
    sd = trial_sd(reps)
    assert sd < 0.006
    sw, sc = _sweep("LLaMA-13B s2048 32 x A100-80GB")
    ran = [s.run.throughput for s in sc if not s.run.failed]
    assert len(ran) == 13
    assert noise_ceiling(ran, sd) > 0.97
    diff, (se, loo) = spearman_gap(sw, sc)
    assert -0.05 < diff < 0
    assert abs(diff) < se / 4
    assert sum(d < 0 for d in loo) >= 9            # not one layout: below the rule without any one of them


def test_cluster_ranking_with_the_model_error_band_is_not_kept():
    """The ranking policy evaluated for the 13B miss: predicted times chained into clusters wherever consecutive times
    are closer than the model's error band, each cluster ordered by Fujii et al.'s key. The band from all target
    sweeps' pairs (probit: P(the layout predicted faster by d ran faster) = Phi(d / sigma)) is 5.2%, 3.9% fitted
    without the Hagemann sweeps: at either, LLaMA-30B s2048 on 64 GPUs chains into one cluster and its first choice
    falls to the rule's, TP4 PP1 MBS2 SP at 84.8% of the measured best, so the Hagemann sweeps reach 8 of 10."""
    from benchmarks.planner_quality import pair_sigma
    data = _targets()
    all_sigma = pair_sigma(data)
    meg_sigma = pair_sigma([x for x in data if x[0].family == "fujii"])
    assert 0.045 < all_sigma < 0.06 and 0.03 < meg_sigma < all_sigma
    sw, sc = _sweep("LLaMA-30B s2048 64 x A100-80GB")
    for band in (all_sigma, meg_sigma):
        q = quality(sw, sc, "time", window=band, policy="single")
        assert q.first == "TP4 CP1 PP1 MBS2 SP" and q.first_rel < 0.85
        assert sum(quality(h, hs, "time", window=band, policy="single").first_ok
                   for h, hs in data if h.family == "hagemann") <= 8       # the target is 9 of 10
    assert quality(sw, sc, "time").first_rel == 1.0                    # the planner's 4% window keeps the best


def test_micro_batch_gain_errors_run_opposite_ways_in_the_two_frameworks():
    """Why no per-micro-batch cost fixes the 13B pairs (the model's gain from MBS 2 and 4 that the 13B s2048 sheets
    do not show): over every pair of layouts that ran and differ only in MBS x 2, the measured minus predicted gain
    falls with the micro-batches per step in Megatron's sweeps (Spearman <= -0.7, 22 pairs) and rises with them in
    Hagemann's (>= +0.4, 49 pairs): a cost per micro-batch would correct one family and worsen the other."""
    from benchmarks.planner_quality import mbs_gain_errors
    e = mbs_gain_errors(_targets())
    assert e["fujii"][0] == 22 and e["fujii"][1] <= -0.7
    assert e["hagemann"][0] == 49 and e["hagemann"][1] >= 0.4


def test_candidate_eager_elementwise_by_hand():
    """PyTorch's eager rotary embedding and SwiGLU (the target sheets fuse only FlashAttention-2 and RMSNorm),
    LLaMA-13B TP1 PP1 MBS1 at sequence 2048 on 32 A100-80GB (GBS 2048: DP 32, 64 micro-batches): per layer
    and micro-batch (40 + 40 heads) x 128 x 2048 = 20,971,520 rotated q/k elements at 36 - 8 = 28 more bytes
    and 13,824 x 2048 = 28,311,552 SwiGLU elements at 36 - 16 = 20 more: 1,153,433,600 B at 80% of
    2.039 TB/s, and 20 more kernels of 2 us; x 40 layers x 64 micro-batches."""
    from benchmarks.planner_quality import cand_eager_elementwise
    _, sc, P = _ratio("LLaMA-13B s2048 32 x A100-80GB", "TP1 CP1 PP1 MBS1")
    assert (sc.candidate.m, sc.candidate.stage_layers) == (64, (40,))
    nbytes = 28 * 20_971_520 + 20 * 28_311_552
    assert nbytes == 1_153_433_600
    per_layer = nbytes / (0.8 * 2.039e12) + 20 * 2e-6
    assert math.isclose(cand_eager_elementwise(P, sc.candidate), 64 * 40 * per_layer, rel_tol=1e-9)


def test_hagemann_256_gpu_tp1_pp4_against_tp4_pp1_at_equal_data_parallel_groups():
    """LLaMA-30B s2048 on 256 GPUs (docs/planner.md section 5.2): TP1 PP4 MBS1 and TP4 PP1 MBS1 noSP reduce the
    same parameters per GPU over DP 64 (8 and 2 GPUs of the group per node). Measured, TP1 PP4 runs 33% faster;
    the model, with TP4's synchronous all-reduces and the 2-NIC ring, has under 10%. memguard estimates TP1 PP4
    MBS1 at 79.5% of the A100's 79.35 GiB with flash-attn's tensors (TE's `auto` on sm80; 81.5%, tight, with
    cuDNN's): it fits, as the run did, so `memguard plan` returns that first choice."""
    r1, s1, P = _ratio("LLaMA-30B s2048 256 x A100-80GB", "TP1 CP1 PP4 MBS1")
    r4, s4, _ = _ratio("LLaMA-30B s2048 256 x A100-80GB", "TP4 CP1 PP1 MBS1 noSP")
    c1, c4 = s1.candidate, s4.candidate
    assert c1.dp == c4.dp == 64
    assert (P.timer.dpcp_per_domain(1, 64), P.timer.dpcp_per_domain(4, 64)) == (8, 2)
    assert abs(P.timer.stage_params(c1, 0) / P.timer.stage_params(c4, 0) - 1) < 0.05
    assert s1.run.throughput / s4.run.throughput > 1.30
    assert 1.0 < s4.seconds / s1.seconds < 1.10
    assert s1.verdict == s4.verdict == "fits"
    est = P.estimate(P.layout(c1))
    assert est.attention.selected == "flash" and 0.78 < est.peak_device_bytes / est.gpu_memory_bytes < 0.80


def test_candidate_grad_reduce_scatter_every_micro_batch_by_hand():
    """ZeRO's per-micro-batch gradient reduction, synchronous, on LLaMA-30B TP4 PP1 MBS1 at 256 GPUs: DP 64, 2 ranks a
    node over 32 nodes, 8,133,691,904 parameters in bf16 = 16,267,383,808 B per reduce-scatter: half of it over NVLink
    (300 GB/s at 80%, 1 step of 3 us) and 31/32 of a half over the NIC (25 GB/s at 85%, 31 steps of 8 us); 31 more of
    them than the model's one per step (2048 / 64 = 32 micro-batches)."""
    from benchmarks.planner_quality import cand_grad_rs_per_microbatch, cand_grad_rs_per_microbatch_sync
    _, sc, P = _ratio("LLaMA-30B s2048 256 x A100-80GB", "TP4 CP1 PP1 MBS1 noSP")
    nbytes = 2 * 8_133_691_904
    rs = nbytes / 2 / (300e9 * 0.8) + 3e-6 + (31 / 32) / 2 * nbytes / (25e9 * 0.85) + 31 * 8e-6
    assert sc.candidate.m == 32
    assert math.isclose(cand_grad_rs_per_microbatch_sync(P, sc.candidate), 31 * rs, rel_tol=1e-9)
    assert 0 <= cand_grad_rs_per_microbatch(P, sc.candidate) < 31 * rs       # behind each micro-batch's backward


def test_failed_layouts_kept_as_fitting_each_have_a_reason_in_the_data():
    """Issue 18 (c): every layout that failed in a target sweep although memguard estimates it fits gets a reason read
    from the data, none unexplained. Megatron (Fujii et al.'s draft): no MBS 4 cell ran at any GPU count (a column
    failed whole, 23 cells, also where memguard estimates 67%), two failed only at their smallest count (both DP 1);
    TP2 CP2 PP2 MBS2, which failed at all six counts, is rejected at all six with flash-attn's CP output counted
    (TE's `auto` on the A100), as is TP4 CP2 PP2 MBS4 at 16 GPUs. Hagemann et al.: within its sheet and its (TP,
    SP) group memguard's estimate orders each one above every layout that ran (within 1 point for one), i.e. the
    framework's memory is higher than Megatron's at that TP, not ordered differently."""
    import csv

    from benchmarks.planner_quality import FUJII_CSV, failure_reason
    with open(FUJII_CSV, newline="") as f:
        mbs4 = [r["status"] for r in csv.DictReader(f) if r["micro_batch_size"] == "4" and r["status"] != "blank_not_run"]
    assert len(mbs4) == 24 and set(mbs4) == {"dash_failed_or_OOM"}      # one of them an impossible cell (8 GPUs)
    codes = {"fujii": [], "hagemann": []}
    data = _targets()
    for fam in codes:
        family = [(sw, sc) for sw, sc in data if sw.family == fam]
        for sw, sc in family:
            for x in sc:
                if x.run.failed and x.verdict == "fits":
                    codes[fam].append(failure_reason(sw, x, family)[0])
                    if fam == "hagemann":
                        group = [y.memory for y in sc if not y.run.failed and y.memory is not None
                                 and (y.run.tp, y.run.sp) == (x.run.tp, x.run.sp)]
                        assert max(group, default=0) <= x.memory + 0.01
    assert sorted(codes["fujii"]) == ["mbs-column"] * 4 + ["smallest-count"] * 2
    assert len(codes["hagemann"]) == 14 and "unexplained" not in codes["hagemann"]


def test_tie_groups_by_hand():
    """The tie-aware Spearman's groups: predicted 10.0, 10.3, 10.5, 10.9 and 12.0 s with the 4% window give
    {10.0, 10.3} (10.3 <= 10.4), {10.5, 10.9} (10.9 <= 10.92) and {12.0}; Fujii et al.'s key ties the same TP x CP x
    PP and MBS whatever the time."""
    from benchmarks.planner_quality import Run, Scored, tie_groups
    runs = [Scored(Run(tp, 1, 1, mbs, tp > 1, "none", False, 1.0), None, "fits", t)
            for tp, mbs, t in ((1, 1, 10.5), (2, 1, 10.0), (1, 1, 12.0), (2, 2, 10.9), (2, 1, 10.3))]
    g = tie_groups(runs, "time", 0.04)
    assert [g[id(s)] for s in runs] == [1, 0, 2, 1, 0]
    f = tie_groups(runs, "fujii2024")
    assert f[id(runs[0])] == f[id(runs[2])] and f[id(runs[1])] == f[id(runs[4])] != f[id(runs[3])]


def test_tie_aware_spearman_where_the_model_carries_the_ranking():
    """The tie-aware Spearman (each rule's ties share one rank: reported next to the plain one, not a target). Over the
    Hagemann sweeps the time rule's median stays well above Fujii et al.'s (reached 0.87 against 0.69): the model's
    times, not the tie-break, carry the ranking there. On LLaMA-13B s2048 on 32 GPUs it falls to 0.45 against the
    rule's 0.68: what ranks that sweep is the tie-break by Fujii et al.'s key, the model's times alone do not."""
    data = [(sw, quality(sw, sc, "time"), quality(sw, sc, "fujii2024")) for sw, sc in _targets()
            if sw.family == "hagemann"]
    assert statistics.median(t.spearman_ties for _, t, _ in data) >= 0.85
    assert statistics.median(f.spearman_ties for _, _, f in data) <= 0.70
    t13, f13 = next((t, f) for sw, t, f in data if sw.name == "LLaMA-13B s2048 32 x A100-80GB")
    assert t13.spearman_ties < 0.5 < f13.spearman_ties


# ---- Blind: the same draft's H100-94GB sweeps (TSUBAME 4.0, no measurements in the repository; issue 18 round 7) ----
def _blind(grid):
    """Per blind sweep: (sweep, planner, layouts memguard keeps)."""
    from benchmarks.planner_quality import blind_sweeps
    out = []
    for sw in blind_sweeps(grid):
        P = planner_for(sw)
        out.append((sw, P, [s for s in score(sw, P) if s.verdict == "fits"]))
    return out


@pytest.mark.parametrize("grid", ["a100", "paper"])
def test_blind_h100_never_predicts_a_smaller_micro_batch_faster(grid):
    """Published with the draft (shared/reference/paper-2411.06465.md section 4): on H100 as on A100, a larger MBS
    gives higher TFLOP/s when it fits. On every blind H100-94GB sweep, no layout is predicted faster than the same TP,
    CP and PP with a larger micro-batch by more than the tie window."""
    from benchmarks.planner_quality import _fujii_disagreements, disagreement_kind
    from megatron_memguard.planner.search import TIE_WINDOW
    kinds = [disagreement_kind(a.run, b.run) for _, _, kept in _blind(grid)
             for _, a, b in _fujii_disagreements(kept, TIE_WINDOW)]
    assert kinds and "smaller MBS" not in kinds


def test_blind_h100_first_choice_is_the_least_model_parallelism_that_fits():
    """The author's own search for H100-94GB (optimal_setting_search.py, reference section 4): the smallest TP x CP x
    PP that fits, then the largest micro-batch. Over Fujii et al.'s grid (TP x CP within a node of 4) the time rule's
    first choice is that layout at every GPU count from 4 to 128, and the two rules' orders agree (reached: median
    Spearman 0.99, none below 0.98)."""
    from benchmarks.planner_quality import rank, spearman
    rhos = []
    for sw, _, kept in _blind("paper"):
        t, f = rank(kept, "time"), rank(kept, "fujii2024")
        assert t[0] is f[0], sw.name
        least = min(s.run.tp * s.run.cp * s.run.pp for s in kept)
        assert t[0].run.tp * t[0].run.cp * t[0].run.pp == least
        pos = {id(s): i for i, s in enumerate(f)}
        rhos.append(spearman([float(i) for i in range(len(t))], [float(pos[id(s)]) for s in t]))
    assert len(rhos) == 6 and min(rhos) >= 0.98 and statistics.median(rhos) >= 0.99 - 0.005


def test_blind_h100_context_parallel_ring_across_4_gpu_nodes_by_hand():
    """The A100 table's TP2 CP4 cells on TSUBAME's 4-GPU nodes: the CP group (ranks tp-cp-dp: 0, 2, 4, 6) spans two
    nodes, so each ring step crosses the NIC, 200 Gb/s per GPU at 85%. Llama-3.1-8B at MBS 4, s/c = 2048: a K/V block
    is 2 x 4 x 2048 x (8 groups / TP 2) x 128 x 2 B = 16 MiB, 10 us + 16 MiB / 21.25 GB/s = 0.800 ms forward, twice the
    bytes (K/V and dK/dV) backward; three of the four steps overlap the attention of a ring step. On 16 GPUs (DP 2,
    1024 / (4 x 2) = 128 micro-batches, 32 layers) the exposed ring is 20.5 s of the step."""
    from megatron_memguard.planner.timing import ring_attention_steps
    sw, P, kept = next(x for x in _blind("a100") if x[0].world == 16)
    c = make_candidate(P.shape, P.cluster, P.gbs, tp=2, pp=1, cp=4, mbs=4)
    kv = 2 * 4 * 2048 * 4 * 128 * 2
    assert kv == 16 * 2 ** 20
    f, b = 10e-6 + kv / (25e9 * 0.85), 10e-6 + 2 * kv / (25e9 * 0.85)
    assert f == pytest.approx(0.800e-3, rel=1e-3)
    a_f, a_b, _ = ring_attention_steps(4, 16, 8192, 4, 128, 128, P.cluster.gpu)[0]
    assert a_f < f / 3 and a_b < b / 3           # the transfer dominates each step
    by_hand = 128 * 32 * 3 * ((f - a_f) + (b - a_b))
    assert P.step_time(c).term_seconds["cp_comm"] == pytest.approx(by_hand, rel=1e-9)
    assert by_hand == pytest.approx(20.5, abs=0.1)


# ---- Rank aggregation of the time rule and Fujii et al.'s key (evaluated, not kept; docs/planner.md section 5.2) ----
def test_rank_aggregation_by_hand():
    """Key ranks: TP1 MBS2 first (0), the two TP2 MBS1 layouts share 1.5 (ranks 1 and 2), TP4 MBS1 last (3). Borda's
    count with predicted 12, 10, 11 and 9 s (time ranks 3, 1, 2, 0): 1.5, 1.25, 1.75, 1.5; the tie of TP1 and TP4 at
    1.5 goes to the faster. The prior with weight 0.5 adds nothing to the model: the order of the times."""
    from benchmarks.planner_quality import Run, Scored, aggregate_order, key_ranks
    runs = [Scored(Run(tp, 1, 1, mbs, tp > 1, "none", False, 1.0), None, "fits", t)
            for tp, mbs, t in ((1, 2, 12.0), (2, 1, 10.0), (2, 1, 11.0), (4, 1, 9.0))]
    assert key_ranks(runs) == [0.0, 1.5, 1.5, 3.0]
    assert aggregate_order(runs, "borda") == [runs[1], runs[3], runs[0], runs[2]]
    assert aggregate_order(runs, "prior", 0.5, 0.05) == [runs[3], runs[1], runs[2], runs[0]]
    # a strong prior for the key overturns a 9% predicted gap only where the model is unsure (sigma 20%)
    assert aggregate_order(runs, "prior", 0.95, 0.20)[0] is runs[0]
    assert aggregate_order(runs, "prior", 0.95, 0.02)[0] is runs[3]


def test_rank_aggregation_is_not_kept():
    """Borda's count lowers the Hagemann median below its 0.90 target (reached 0.86, three sweeps worse than the rule);
    the key as a prior with its accuracy and the model's band taken from the other family (leave one family out) lowers
    the Megatron median below 0.93 (0.92, 256 GPUs worse than the rule) and the Hagemann median below 0.90 (0.88)."""
    from benchmarks.planner_quality import aggregate_order, key_accuracy, pair_sigma
    fams = {f: [x for x in _targets() if x[0].family == f] for f in ("fujii", "hagemann")}
    acc = {f: key_accuracy(d) for f, d in fams.items()}
    assert acc["fujii"] > 0.95 and 0.70 < acc["hagemann"] < 0.72

    def med(fam, order_by):
        rows = [(quality(sw, sc, "time", order_by=order_by), quality(sw, sc, "fujii2024")) for sw, sc in fams[fam]]
        worse = [t.sweep for t, f in rows if not math.isnan(f.spearman) and t.spearman < f.spearman - 1e-9]
        return statistics.median(t.spearman for t, _ in rows if not math.isnan(t.spearman)), worse

    m, worse = med("hagemann", lambda k: aggregate_order(k, "borda"))
    assert m < 0.87 and len(worse) >= 3
    w, s = acc["hagemann"], pair_sigma(fams["hagemann"])
    m, worse = med("fujii", lambda k: aggregate_order(k, "prior", w, s))
    assert m < 0.93 and "Llama-3.1-8B s8192 256 x A100-40GB" in worse
    w, s = acc["fujii"], pair_sigma(fams["fujii"])
    m, _ = med("hagemann", lambda k: aggregate_order(k, "prior", w, s))
    assert m < 0.89


def test_candidate_wgrad_unfused_by_hand():
    """Gradient accumulation without Megatron's fusion (the weight-gradient GEMM writes a fresh bf16 gradient, 2 B, a
    separate add reads it, 2 B, 4 B per weight element and micro-batch more than the fused GEMM's accumulation), on
    LLaMA-13B TP1 PP1 MBS1 at sequence 2048 on 32 A100-80GB (64 micro-batches): 40 x (4 x 5120^2 + 3 x 5120 x 13824 +
    2 x 5120) + 2 x 32000 x 5120 + 5120 = 13,015,864,320 weights at 80% of 2.039 TB/s, and 4 add kernels of 2 us per
    layer."""
    from benchmarks.planner_quality import cand_wgrad_unfused
    _, sc, P = _ratio("LLaMA-13B s2048 32 x A100-80GB", "TP1 CP1 PP1 MBS1")
    assert P.timer.stage_params(sc.candidate, 0) == 13_015_864_320
    per_mb = 13_015_864_320 * 4 / (0.8 * 2.039e12) + 4 * 40 * 2e-6
    assert math.isclose(cand_wgrad_unfused(P, sc.candidate), 64 * per_mb, rel_tol=1e-9)


def test_candidate_rank_order_pp_inner_by_hand():
    """Ranks ordered tp-pp-dp on LLaMA-30B TP1 PP4 MBS1 at 256 GPUs: a node holds 2 pipeline replicas of 4 stages, so
    the DP-64 group has 2 members a node (Megatron's order: 8) and the stage boundaries stay on NVLink. The transfers:
    2048 x 6656 x 2 = 27,262,976 B, 10 us + that at 85% of 25 GB/s on the NIC or at 80% of 300 GB/s on NVLink, 2 x 32
    micro-batches + 2 x 3 of the fill and drain; the reduction over fewer NICs can only take longer."""
    from benchmarks.planner_quality import _pp_inner_timer, cand_rank_order_pp_inner
    _, sc, P = _ratio("LLaMA-30B s2048 256 x A100-80GB", "TP1 CP1 PP4 MBS1")
    c = sc.candidate
    alt = _pp_inner_timer(P)
    dp_model, dp_alt = P.step_time(c).term_seconds["dp_comm"], alt.step_time(c).term_seconds["dp_comm"]
    assert (c.dp, c.m, P.timer.dpcp_per_domain(1, 64), alt.dpcp_per_domain(1, 64)) == (64, 32, 8, 2)
    assert dp_alt > dp_model
    nbytes = 2048 * 6656 * 2
    p2p = 70 * ((10e-6 + nbytes / (0.8 * 300e9)) - (10e-6 + nbytes / (0.85 * 25e9)))
    assert math.isclose(cand_rank_order_pp_inner(P, c), dp_alt - dp_model + p2p, rel_tol=1e-9)
    assert -0.09 < p2p < -0.08


def test_gemm_curves_trade_the_13b_miss_for_the_hagemann_median():
    """Exact waves with cuBLAS-like tile choice (the best of 256 x 128 and 128 x 128 at 0.9 of its rate, either
    orientation) lift LLaMA-13B s2048 on 32 GPUs above `--rule fujii2024` (0.74 against 0.69) but lower LLaMA-65B
    s2048 on 64 GPUs (0.93 -> 0.90) and the Hagemann median below its 0.90 target: not kept (docs/planner.md 5.2)."""
    from benchmarks.planner_quality import GEMM_CURVES
    from megatron_memguard.planner import kernels
    model = kernels.gemm_efficiency
    curve = GEMM_CURVES["exact waves, best of 256 x 128 and 128 x 128 (0.9)"]
    # a hand check of the curve: 2048 tokens x 7680 (LLaMA-13B's linear_qkv at TP2) on 108 SMs: 256 x 128 tiles give
    # 30 x 16 = 480 (4.44 waves, 480 / 540 busy), 128 x 128 give 960 (8.89 waves, 960 / 972 busy, x 0.9)
    gpu = planner_for(hagemann_sweeps()[0]).cluster.gpu
    assert gpu.sms == 108
    assert math.isclose(curve(2048, 7680, 5120, gpu), gpu.gemm_efficiency * (480 / 540) * 5120 / (5120 + 128))
    kernels.gemm_efficiency = curve
    try:
        rows = [(sw, quality(sw, score(sw), "time")) for sw in hagemann_sweeps()]
    finally:
        kernels.gemm_efficiency = model
    rho = {sw.name: q.spearman for sw, q in rows}
    assert rho["LLaMA-13B s2048 32 x A100-80GB"] > 0.69 + 0.04
    assert rho["LLaMA-65B s2048 64 x A100-80GB"] < 0.91
    assert statistics.median(rho.values()) < 0.90


def test_layouts_at_the_framework_memory_edge_are_not_slower_than_modelled():
    """Allocator pressure would slow the layouts whose doubled micro-batch failed in their sweep. Over the Hagemann
    sheets they sit where the others do (mean log(measured / predicted) about each sheet's mean within 0.01 of the
    others'); over Megatron's they ran faster than modelled, not slower."""
    from benchmarks.planner_quality import memory_edge_residuals
    edge = memory_edge_residuals(_targets())
    n_e, m_e, n_r, m_r = edge["hagemann"]
    assert n_e > 50 and n_r > 50 and abs(m_e - m_r) < 0.01
    n_e, m_e, n_r, m_r = edge["fujii"]
    assert n_e > 15 and m_e < m_r


def test_hagemann_256_gpu_excess_follows_the_gradient_bytes_a_node_holds():
    """LLaMA-30B s2048: for the layouts run at 64 and 256 GPUs, the step at 256 beyond the model scaled by the 64-GPU
    ratio grows with the bf16 gradient bytes the node's 8 GPUs hold (8 x parameters per GPU x 2 B: 33, 65 or 130 GB),
    whatever the group's span (8, 16 or 32 nodes) and members per node (2, 4 or 8): 0.056-0.067 s per GB for 8 of the
    10, 0.033-0.034 for TP1 PP4 MBS1 and TP2 PP4 MBS1 (the two fastest), i.e. about 16 GB/s a node. At that rate LLaMA-13B TP1 PP1 MBS1 on 64 GPUs (8 nodes, 208 GB a node) would lose over 10 s
    of its 26 s step; it ran 5% faster than modelled: a rate of the 256-GPU job's fabric, not of the layout."""
    per_gb, spans = [], set()
    sw256 = next(s for s in hagemann_sweeps() if s.name == "LLaMA-30B s2048 256 x A100-80GB")
    ran64 = {r.label for s in hagemann_sweeps() if s.name == "LLaMA-30B s2048 64 x A100-80GB" for r in s.runs
             if not r.failed}
    for r in sw256.runs:
        if r.failed or r.label not in ran64:
            continue
        r64, _, _ = _ratio("LLaMA-30B s2048 64 x A100-80GB", r.label)
        r256, sc, P = _ratio(sw256.name, r.label)
        c = sc.candidate
        node_gb = 8 * P.timer.stage_params(c, 0) * 2 / 1e9
        per_gb.append((r256 - r64) * sc.seconds / node_gb)
        spans.add((c.dp // (8 // c.tp), 8 // c.tp))
    assert len(per_gb) >= 9 and {n for n, _ in spans} == {8, 16, 32} and {k for _, k in spans} == {2, 4, 8}
    assert all(0.03 < x < 0.07 for x in per_gb) and sum(0.055 < x < 0.07 for x in per_gb) == 8
    r13, s13, P13 = _ratio("LLaMA-13B s2048 64 x A100-80GB", "TP1 CP1 PP1 MBS1")
    node_gb = 8 * P13.timer.stage_params(s13.candidate, 0) * 2 / 1e9
    assert node_gb > 200 and min(per_gb) * node_gb > 0.25 * s13.seconds and r13 < 1.05


def test_rmsnorm_kernel_saving_measures_the_256_gpu_sheets_noise():
    """Round 9 (benchmarks/planner_quality.py --round9). What the fused RMSNorm kernel saves in a cell (the step of the
    FlashAttention-2 sheet minus that of the FlashAttention-2 + RMS kernel sheet, same layout, no recomputation, no SP)
    is set by the elements a GPU normalises, 2 L h x tokens x TP / world: the same at any PP and MBS, twice at twice
    the TP. LLaMA-65B on 128 GPUs shows it cleanly (CSV: TP4 PP4 MBS1 101.97 - 86.61 = 15.35 s, TP4 PP8 15.36 s,
    TP8 PP2 31.82 s); one constant for all sheets, about 89 ps per element (145 B of HBM traffic at 80% of the
    A100-80GB's 2.039 TB/s: an eager fp32 norm against the fused one), predicts every cell; what is left is the two
    runs' noise (an upper bound: anything else the kernel changes adds to it): 0.5% a measurement on the 65B 128-GPU
    sheet, 3.9% on the LLaMA-30B 256-GPU sheet (2.2% without its largest residual, TP4 PP1 MBS1), where the first
    choice (TP1 PP4 MBS1) ran 5.2% below the best (TP2 PP4 MBS1 noSP): 0.9 to 1.7 standard deviations of the
    difference of two measurements there."""
    from benchmarks.planner_quality import norm_elements_per_gpu, rmsnorm_saving_probe
    # 2 x 80 layers x 8192 x 2048 x 2048 tokens x TP 4 / 128 GPUs, by hand
    assert norm_elements_per_gpu("LLaMA-65B", 4, 128) == 171_798_691_840
    kappa, cells, sheets = rmsnorm_saving_probe()
    saving = {(sh, lay): s for sh, lay, s, _, _ in cells}
    s65 = "LLaMA-65B s2048 128 x A100-80GB"
    assert abs(saving[(s65, "TP4 PP4 MBS1")] - 15.35) < 0.02 and abs(saving[(s65, "TP4 PP8 MBS1")] - 15.36) < 0.02
    assert 1.9 < saving[(s65, "TP8 PP2 MBS1")] / saving[(s65, "TP4 PP4 MBS1")] < 2.2
    assert 80e-12 < kappa < 95e-12 and 130 < kappa * 2.039e12 * 0.80 < 160
    assert sheets[s65][2] < 0.01
    s30 = "LLaMA-30B s2048 256 x A100-80GB"
    n, rms, noise, noise_1 = sheets[s30]
    assert n == 7 and noise > 0.035 and 0.02 < noise_1 < 0.03     # TP4 PP1 MBS1 (8.04 s against 4.67) the largest
    sw, sc = _sweep(s30)
    by = {s.run.label: s for s in sc if not s.run.failed}
    gap = by["TP2 CP1 PP4 MBS1 noSP"].run.throughput / by["TP1 CP1 PP4 MBS1"].run.throughput - 1
    assert 0.05 < gap < noise * math.sqrt(2)


def test_fabric_terms_cannot_split_the_256_gpu_first_choice_from_the_best():
    """Round 9. LLaMA-30B s2048 on 256 GPUs, TP1 PP4 MBS1 (the first choice) against TP2 PP4 MBS1 noSP (the best): the
    first stage holds 15 layers of 4h^2 + 3hf + 2h = 535,049,216 parameters and the 212,992,000 of the embedding,
    8,238,730,240 at TP1 (DP 64, 8 GPUs a node) and 4,119,464,960 at TP2 (the norms whole; DP 32, 4 a node): with bf16
    gradients 2,059,682,560 and 2,059,732,480 bytes per NIC and pass, both groups over 8 nodes. Any cost that acts on
    the NICs (bandwidth, an oversubscribed spine, rail crossings, NCCL's algorithm) charges both the same; the rest
    (the NVLink share, ring latencies) separates them by under 0.1 s even with every collective exposed, where the
    tie window needs TP1 PP4 predicted more than 4% slower than TP2 PP4 (a shift of 1.2 s) instead of 2.7% faster."""
    from benchmarks.planner_quality import cand_dp_exposed, dp_bytes_per_nic
    sw, sc = _sweep("LLaMA-30B s2048 256 x A100-80GB")
    P = planner_for(sw)
    by = {s.run.label: s for s in sc if not s.run.failed}
    a, b = by["TP1 CP1 PP4 MBS1"].candidate, by["TP2 CP1 PP4 MBS1 noSP"].candidate
    assert P.timer.stage_params(a, 0) == 15 * 535_049_216 + 212_992_000
    assert P.timer.stage_params(b, 0) == 15 * ((535_049_216 - 2 * 6656) // 2 + 2 * 6656) + 212_992_000 // 2
    assert dp_bytes_per_nic(P, a) == (2_059_682_560, 8) and dp_bytes_per_nic(P, b) == (2_059_732_480, 8)
    assert abs((cand_dp_exposed(P, a) + P.step_time(a).term_seconds["dp_comm"])
               - (cand_dp_exposed(P, b) + P.step_time(b).term_seconds["dp_comm"])) < 0.1
    assert P.step_time(a).seconds < P.step_time(b).seconds


def test_candidate_spine_by_hand():
    """Round 9, not in the model. An HDR leaf switch has 40 ports (QM8700); non-blocking, 20 face the nodes, so a
    rail-optimised leaf serves 20 nodes. At LLaMA-30B s2048 on 256 GPUs TP4 PP1 MBS1's DP group (64 ranks, 2 a node)
    spans 32 nodes and pays its reduce-scatter and all-gather at half the network bandwidth, exposed: the stage's 60
    layers of (4h^2 + 3hf) / 4 + 2h parameters, a quarter of the embedding and of the output layer, 2 B each, 1/2 through
    each of the 2 NICs a node in 31 of 32 steps at 100 Gb/s x 0.85, once for the gradients and once for the
    parameters; TP2 PP2 (16 nodes) pays nothing."""
    from benchmarks.planner_quality import cand_spine
    sw, sc = _sweep("LLaMA-30B s2048 256 x A100-80GB")
    P = planner_for(sw)
    by = {s.run.label: s for s in sc if not s.run.failed}
    a, b = by["TP4 CP1 PP1 MBS1 noSP"].candidate, by["TP2 CP1 PP2 MBS1 noSP"].candidate
    assert cand_spine(P, b) == 0.0
    # PP1: the embedding and the output layer of the vocabulary padded to 128 x TP (32000 -> 32256), the final norm
    psi = 60 * ((4 * 6656 ** 2 + 3 * 6656 * 17920) // 4 + 2 * 6656) + 2 * 32256 * 6656 // 4 + 6656
    assert P.timer.stage_params(a, 0) == psi
    net = 2 * (31 / 32 * psi * 2 / 2 / (100e9 / 8 * 0.85) + 31 * 8e-6)
    nvl = 2 * (1 / 2 * psi * 2 / (300e9 * 0.80) + 3e-6)
    assert cand_spine(P, a) == pytest.approx(net + nvl - P.step_time(a).term_seconds["dp_comm"], rel=1e-9)


def test_layouts_at_the_framework_edge_by_its_own_kernels_are_not_slower():
    """Round 9. A target layout that ran with the fused RMSNorm kernel and failed (OOM) in the same cell with
    FlashAttention-2 alone (which keeps the norm's fp32 intermediates) sits at that framework's own memory limit,
    e.g. LLaMA-30B s2048 TP1 PP4 MBS1 on 256 GPUs, the missed first choice. The 19 such layouts ran no slower than
    modelled relative to their sweeps (mean log residual within 0.01 of the other 111's); TP1 PP4 MBS1 ran 5% faster."""
    from benchmarks.planner_quality import kernel_edge_residuals
    edge, m_edge, n_other, m_other = kernel_edge_residuals()
    assert len(edge) == 19 and n_other == 111
    assert abs(m_edge - m_other) < 0.01
    tp1 = [x for name, lab, x in edge if name == "LLaMA-30B s2048 256 x A100-80GB" and lab == "TP1 CP1 PP4 MBS1"]
    assert len(tp1) == 1 and tp1[0] < -0.03


def test_13b_32_gpu_pairs_that_split_the_rules_turn_on_the_second_stage():
    """Round 10 (benchmarks/planner_quality.py --round10). LLaMA-13B s2048 on 32 GPUs, the one sweep where the time rule
    ranks below `--rule fujii2024`: of the pairs exactly one rule orders against the measurement, the time rule's four
    all set a PP 1 layout (or PP 2 MBS 1) against a PP 2 layout with a larger micro-batch, which the model predicts
    faster (MFU in the CSV: TP2 PP1 MBS1 SP 0.614 against TP2 PP2 MBS2 SP 0.575 and MBS4 SP 0.554, 6.8% and 10.8%;
    TP2 PP1 MBS1 noSP 0.603 against TP2 PP2 MBS4 noSP 0.546, 10.5%; TP2 PP2 MBS1 SP 0.565 against MBS4 noSP, 3.4%);
    the rule's two put TP2 PP1 MBS2 noSP (0.650, outside Fujii et al.'s space) behind SP layouts."""
    from benchmarks.planner_quality import rule_split_pairs
    sw, sc = _sweep("LLaMA-13B s2048 32 x A100-80GB")
    pairs = rule_split_pairs(sw, sc)
    time_wrong = [(a.run, b.run) for rule, a, b in pairs if rule == "time"]
    rule_wrong = [(a.run, b.run) for rule, a, b in pairs if rule == "fujii2024"]
    assert len(time_wrong) == 4 and len(rule_wrong) == 2
    assert all(b.pp == 2 and b.mbs > a.mbs for a, b in time_wrong)
    gaps = sorted(round(a.throughput / b.throughput - 1, 3) for a, b in time_wrong)
    assert gaps == pytest.approx([0.035, 0.068, 0.104, 0.108], abs=0.002)
    assert all(a.label == "TP2 CP1 PP1 MBS2 noSP" and b.sp for a, b in rule_wrong)


def test_second_stage_cost_is_not_the_layouts():
    """Round 10. What a second pipeline stage costs beyond the model (log(measured PP2 / PP1 step) - log(predicted), the
    same TP, SP and MBS): +5% to +13% in all 8 pairs of the two LLaMA-13B s2048 sheets, -5% to -7% in all 3 of LLaMA-30B
    s2048 on 64 GPUs, whose TP4 PP2 MBS1 has the same DP and micro-batches as 13B's TP2 PP2 MBS1 on 32 GPUs (64 / (4 x 2)
    = 32 / (2 x 2) = 8; 2048 / 8 = 256 micro-batches): same framework, GPUs and sequence. And in the 13B 64-GPU sheet
    itself, TP2 PP1 -> PP2 (CSV steps): with FlashAttention-2 (+ RMS kernel) 31.29 -> 34.84 s and 35.54 -> 39.64 s
    (+11%), with FlashAttention 1, fused softmax and plain attention (trial ids 977xx, another batch of runs)
    40.56 -> 40.25, 45.96 -> 43.36, 52.55 -> 49.35 s (-1% to -6%). A slower attention kernel adds work to both steps
    alike, which dilutes a pipeline cost and cannot turn it negative: the second stage's cost is the trials', not a
    cost of the layout a term could give. Where a layout effect is real, both batches show it (the control below)."""
    from benchmarks.planner_quality import second_stage_by_kernel, second_stage_excess
    for name in ("LLaMA-13B s2048 32 x A100-80GB", "LLaMA-13B s2048 64 x A100-80GB"):
        ex = [x for _, x in second_stage_excess(*_sweep(name))]
        assert len(ex) in (5, 3) and all(0.05 < x < 0.14 for x in ex)
    ex30 = [x for _, x in second_stage_excess(*_sweep("LLaMA-30B s2048 64 x A100-80GB"))]
    assert len(ex30) == 3 and all(-0.07 < x < -0.05 for x in ex30)
    _, sc13 = _sweep("LLaMA-13B s2048 32 x A100-80GB")
    _, sc30 = _sweep("LLaMA-30B s2048 64 x A100-80GB")
    a = next(s.candidate for s in sc13 if s.run.label == "TP2 CP1 PP2 MBS1 noSP")
    b = next(s.candidate for s in sc30 if s.run.label == "TP4 CP1 PP2 MBS1 noSP")
    assert (a.dp, a.m) == (b.dp, b.m) == (8, 256)
    rows = {(k, mbs): (s1, s2, ids) for k, mbs, s1, s2, ids in second_stage_by_kernel()}
    assert rows[("flash_attention2 + RMS kernel", 1)][:2] == pytest.approx((31.2859, 34.8416))
    assert rows[("flash_attentionv1.0.8", 1)][:2] == pytest.approx((40.5592, 40.2478))
    later = [s2 / s1 - 1 for (k, _), (s1, s2, ids) in rows.items() if min(ids) > 130_000]
    earlier = [s2 / s1 - 1 for (k, _), (s1, s2, ids) in rows.items() if max(ids) < 100_000]
    assert len(later) == 4 and all(x > 0.10 for x in later)
    assert len(earlier) == 4 and all(x < 0 for x in earlier)
    # the control: a real layout effect (LLaMA-30B s2048 on 256 GPUs, TP4 PP1 -> PP2 halves the DP bytes a node sends)
    # shows in both batches alike (CSV: 31.77 -> 26.94 s, trial ids 1322xx; 43.24 -> 32.42 s with FlashAttention 1, 9688x)
    ctl = second_stage_by_kernel("LLaMA-30B", 2048, 256, 4)
    assert len(ctl) == 4 and all(s2 / s1 - 1 < -0.15 for _, _, s1, s2, _ in ctl)
    assert {max(ids) < 100_000 for *_, ids in ctl} == {True, False}


def test_misses_re_measured_under_their_sheets_noise():
    """Round 10. Both rules' orders fixed, every layout measured again with a log-normal error a trial. LLaMA-30B s2048 on
    256 GPUs: the first choice ran 5.2% below the best, so at the SP sheets' repeat noise (0.57% a trial; the difference
    of two trials 0.8%, a 2.2-point swing is 2.7 of its standard deviations) it is almost never within 3%; at the sheet's
    own RMSNorm-probe noise, 3.9% a trial (5.5% the difference), P(Z > 2.2 / 5.5) = 0.34 by the normal approximation,
    a little less with the other layouts that may become the best. LLaMA-13B s2048 on 32 GPUs: at the repeat noise the
    measured order stands and the time rule stays below the rule (0.67 against 0.69) in nearly every draw."""
    from benchmarks.planner_quality import remeasured, repeated_cells, trial_sd
    sd = trial_sd(repeated_cells())
    assert 0.005 < sd < 0.0065
    w30, nw30 = remeasured(*_sweep("LLaMA-30B s2048 256 x A100-80GB"), sd)
    assert w30 < 0.02 and nw30 == 1.0
    w30, _ = remeasured(*_sweep("LLaMA-30B s2048 256 x A100-80GB"), 0.039)
    assert 0.2 < w30 < 0.36
    w13, nw13 = remeasured(*_sweep("LLaMA-13B s2048 32 x A100-80GB"), sd)
    assert w13 == 1.0 and nw13 < 0.05
