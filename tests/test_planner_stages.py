"""Uneven pipeline stages in the step-time model (issue 18): each rank's time from the layers it holds, the
slowest rank paces the steady state, the others make the fill and drain.

The closed form (planner/timing.py ``pipeline_seconds``) is checked against a step-by-step run of the 1F1B
schedule written here: Megatron's order of operations per rank (``forward_backward_pipelining_without_
interleaving``: PP - rank - 1 warm-up forwards, then one forward and one backward, then the cool-down
backwards), each operation starting when its rank is free and its input has arrived."""
import random

import pytest

from megatron_memguard.planner.space import Constraints, enumerate_space, make_candidate
from megatron_memguard.planner.timing import pipeline_seconds

from conftest import LLAMA2_7B
from planner_util import make_planner


def one_f_one_b(fwd, bwd, m):
    """Makespan of Megatron's 1F1B schedule for per-rank forward / backward times (no transfers)."""
    p = len(fwd)
    order = []
    for r in range(p):
        warm = min(p - r - 1, m)
        ops, nf, nb = [("F", j) for j in range(warm)], warm, 0
        while nb < m:
            if nf < m:
                ops.append(("F", nf))
                nf += 1
            ops.append(("B", nb))
            nb += 1
        order.append(ops)
    done, clock, nxt = {}, [0.0] * p, [0] * p
    moved = True
    while moved:
        moved = False
        for r in range(p):
            while nxt[r] < len(order[r]):
                kind, j = order[r][nxt[r]]
                if kind == "F":
                    ready = done.get(("F", r - 1, j)) if r else 0.0
                else:
                    ready = done.get(("B", r + 1, j)) if r < p - 1 else done.get(("F", r, j))
                if ready is None:
                    break
                clock[r] = max(clock[r], ready) + (fwd[r] if kind == "F" else bwd[r])
                done[(kind, r, j)] = clock[r]
                nxt[r] += 1
                moved = True
    return max(clock)


def _with_layers(flags, n):
    out = list(flags)
    out[out.index("--num-layers") + 1] = str(n)
    return out


def test_closed_form_equals_1f1b_when_ranks_are_equal():
    """Narayanan et al. 2021: (m + p - 1) stage times (bubble (p - 1) / m)."""
    for p, m in ((2, 4), (4, 8), (8, 16)):
        steady, fill = pipeline_seconds([3.0] * p, m)
        assert steady + fill == (m + p - 1) * 3.0 == one_f_one_b([1.0] * p, [2.0] * p, m)


def test_3_to_4_stages_by_hand():
    """Two stages with 3 and 4 layers (a layer 1 s forward, 2 s backward): the steady state is the
    slower stage's 4 x 3 = 12 s per micro-batch, the fill and drain the faster one's 9 s once:
    m = 8 gives 8 x 12 + 9 = 105 s, where equal-stage accounting (m + p - 1) x 12 says 108 s."""
    assert pipeline_seconds([9.0, 12.0], 8) == (96.0, 9.0)
    assert one_f_one_b([3.0, 4.0], [6.0, 8.0], 8) == 105.0
    assert pipeline_seconds([12.0, 9.0], 8) == (96.0, 9.0)
    # the heavy rank first: its second warm-up forward runs while micro-batch 0 goes through rank 1, so the
    # schedule takes 102 s; the closed form's 105 s is then an upper bound
    assert one_f_one_b([4.0, 3.0], [8.0, 6.0], 8) == 102.0


def test_closed_form_is_exact_with_the_slowest_rank_last_and_an_upper_bound_otherwise():
    rnd = random.Random(18)
    exact = bound = 0
    for _ in range(300):
        p = rnd.choice((2, 3, 4, 8))
        m = p * rnd.choice((1, 2, 4))
        w = [rnd.uniform(1.0, 1.5) for _ in range(p)]
        sim = one_f_one_b([x / 3 for x in w], [2 * x / 3 for x in w], m)
        got = sum(pipeline_seconds(w, m))
        if max(w) == w[-1]:
            assert got == pytest.approx(sim, rel=1e-12)
            exact += 1
        else:
            assert got >= sim - 1e-9
            bound += 1
    assert exact > 20 and bound > 100


@pytest.fixture(scope="module")
def llama12():
    """LLaMA-2-7B's shape with 12 layers on 32 H100s (TP 8, PP 4: DP 1, GBS 64 = 64 micro-batches)."""
    return make_planner(_with_layers(LLAMA2_7B, 12), 32, 4096, 64)


WORK = ("gemm", "attention", "elementwise", "kernel_gaps", "input", "recompute", "tp_comm", "cp_comm")


def test_a_slow_middle_rank_sets_the_pace(llama12):
    """Layout 'Ettt|ttt|tttt|ttL': ranks of 3, 3, 4 and 2 layers. Ranks 1 and 2 hold only layers, so their
    times are 3:4; rank 2 is the slowest (rank 0 adds the embedding to 3 layers, rank 3 the output layer
    and loss to 2: LLaMA-2's 32,000 x 4,096 output layer is 0.64 of a layer's 202M weights). Before issue 18
    the model looked at ranks 0, 1 and 3 only."""
    P = llama12
    c = make_candidate(P.shape, P.cluster, 64, tp=8, pp=4, layout="Ettt|ttt|tttt|ttL")
    assert c.stage_layers == (3, 3, 4, 2) and c.m == 64
    st = P.step_time(c)
    w = st.stage_seconds
    assert w[1] / w[2] == pytest.approx(3 / 4, rel=1e-9)
    assert st.critical_stage == 2 and max(w) == w[2]
    t = st.term_seconds
    assert sum(t[k] for k in WORK) == pytest.approx(64 * w[2], rel=1e-12)
    assert t["bubble"] == pytest.approx(w[0] + w[1] + w[3], rel=1e-12)
    assert t["bubble"] < 3 * w[2]


def test_bubble_is_the_other_ranks_work_over_vpp():
    """Over a whole space: bubble = (sum of the ranks' times - the slowest) / VPP, never more than the
    equal-stage (PP - 1) / (VPP m) of the slowest stage's work, and the slowest rank's work is m x its time."""
    P = make_planner(_with_layers(LLAMA2_7B, 14), 32, 4096, 64)
    checked = 0
    for c in enumerate_space(P.shape, P.cluster, 64, Constraints(mbs=(1,), recompute=("none", "full"))):
        st = P.step_time(c)
        t, w = st.term_seconds, st.stage_seconds
        assert len(w) == c.pp
        assert sum(t[k] for k in WORK) == pytest.approx(c.m * max(w), rel=1e-12)
        assert t["bubble"] == pytest.approx((sum(w) - max(w)) / c.vpp, rel=1e-12, abs=1e-15)
        assert t["bubble"] <= (c.pp - 1) / c.vpp * max(w) * (1 + 1e-12)
        checked += c.pp > 1
    assert checked > 50


def test_balanced_split_beats_the_mirror():
    """14 layers on PP 4: (3,4,4,3) keeps 4 layers on the ranks with the embedding and the output layer off,
    (4,3,3,4) puts them there: its slowest rank is 4 layers + the output layer, the other's 4 layers."""
    P = make_planner(_with_layers(LLAMA2_7B, 14), 32, 4096, 64)
    a = make_candidate(P.shape, P.cluster, 64, tp=8, pp=4, first=3, last=3)
    b = make_candidate(P.shape, P.cluster, 64, tp=8, pp=4, first=4, last=4)
    assert (a.stage_layers, b.stage_layers) == ((3, 4, 4, 3), (4, 3, 3, 4))
    sa, sb = P.step_time(a), P.step_time(b)
    assert sa.critical_stage in (1, 2) and sb.critical_stage == 3
    assert max(sa.stage_seconds) < max(sb.stage_seconds) and sa.seconds < sb.seconds


def test_mtp_depth_runs_on_the_last_rank(llama12):
    """--mtp-num-layers 1: the last rank runs one more transformer layer, eh_proj ([2h -> h] / TP), the output
    layer and the loss again, and embeds the shifted tokens (multi_token_prediction.py, core 0.16.1).
    So its time grows by more than a layer plus the output layer's GEMMs and less than twice that; the
    other ranks do not change."""
    P0 = llama12
    P1 = make_planner(_with_layers(LLAMA2_7B, 12) + ["--mtp-num-layers", "1"], 32, 4096, 64)
    c0 = make_candidate(P0.shape, P0.cluster, 64, tp=8, pp=4, layout="Ettt|ttt|tttt|ttL")
    c1 = make_candidate(P1.shape, P1.cluster, 64, tp=8, pp=4, layout="Ettt|ttt|tttt|ttmL")
    w0, w1 = P0.step_time(c0).stage_seconds, P1.step_time(c1).stage_seconds
    assert w0[:3] == w1[:3]
    lc = P0.timer.layer_cost(8, 1, 1, True)
    ec = P0.timer.ends_cost(8, 1, 1, True)
    lower = sum(lc.per_layer) + ec.out_gemm_fwd + ec.out_gemm_bwd
    assert lower < w1[3] - w0[3] < 2 * lower
    assert P1.step_time(c1).critical_stage == 3          # 2 layers + output + a depth (layer + output) > 4 layers
    # the optimizer steps the depth's weights too: layer + eh_proj 2 h^2 / TP + 3 norms + the stage's own embedding
    # (32,000 rows padded to a multiple of 128 x TP = 1,024: 32,768, a 1/8 shard per rank)
    s = P1.shape
    extra = s.layer_params_per_rank(8) + 2 * 4096 * 4096 // 8 + 3 * 4096 + 32768 // 8 * 4096
    assert P1.timer.mtp_params(c1) == (extra, 0)


def test_explain_lists_every_rank(llama12):
    P = llama12
    c = make_candidate(P.shape, P.cluster, 64, tp=8, pp=4, layout="Ettt|ttt|tttt|ttL")
    ex = P.timer.explain(c)
    bubble = dict((t.name, t.detail) for t in ex.terms)["bubble"]
    assert "ranks 0..3" in bubble and bubble.count(",") >= 3
    assert ex.values == P.step_time(c).values
    assert ex.to_dict()["stage_seconds_per_micro_batch"] == list(ex.stage_seconds)


def test_uneven_vpp_search_prefers_the_split_whose_slowest_rank_is_lightest():
    """14 layers on PP 4 x VPP 2 (tests/test_planner_vpp.py lists the three splits Megatron accepts): first 2 /
    last 4 leaves 4 layers beside the output layer on the last rank; first 4 / last 2 puts 4 beside the
    embedding; the embedding and loss slots give 3, 4, 4, 3, whose slowest rank holds 4 layers and nothing
    else (LLaMA-2's output layer and loss are less than a layer). The step ranks them in that order."""
    P = make_planner(_with_layers(LLAMA2_7B, 14), 32, 4096, 64)
    cands = enumerate_space(P.shape, P.cluster, 64, Constraints(pp=(4,), vpp=(2,), tp=(8,), mbs=(1,),
                                                                   recompute=("none",), dist_opt=(True,)))
    by = {c.stage_layers: P.step_time(c) for c in cands}
    assert set(by) == {(2, 4, 4, 4), (4, 4, 4, 2), (3, 4, 4, 3)}
    bal, first4, last4 = by[(3, 4, 4, 3)], by[(4, 4, 4, 2)], by[(2, 4, 4, 4)]
    assert bal.critical_stage == 1 and first4.critical_stage == 0 and last4.critical_stage == 3
    assert max(bal.stage_seconds) < max(first4.stage_seconds) < max(last4.stage_seconds)
    assert bal.seconds < first4.seconds < last4.seconds
