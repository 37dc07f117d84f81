"""benchmarks/planner_round13.py's evaluation (issue 18, round 13): re-timing under a vector of constants gives the
planner's own step times at the defaults, a changed constant moves them by what the model's formula says, and the
targets' figures on tiny made-up sweeps are the ones worked out by hand."""
import dataclasses
import math
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
pq = pytest.importorskip("benchmarks.planner_quality")
r13 = pytest.importorskip("benchmarks.planner_round13")

# a small dense GPT (4 layers, hidden 1024, 16 heads): fits an A100-40GB at every layout below
TINY = ("--num-layers 4 --hidden-size 1024 --ffn-hidden-size 4096 --num-attention-heads 16 "
        "--max-position-embeddings 2048 --position-embedding-type rope --normalization RMSNorm --swiglu "
        "--disable-bias-linear --untie-embeddings-and-output-weights --tokenizer-type NullTokenizer "
        "--vocab-size 32000 --bf16").split()


def tiny_sweep(throughputs, world=2, gbs=8):
    """TP2 PP1 MBS1, TP2 PP1 MBS2, TP2 PP1 MBS1 full recompute on ``world`` A100-40GB (DP 1 at world 2), with the
    made-up measured ``throughputs`` (None: failed)."""
    cells = [(1, "none"), (2, "none"), (1, "full")]
    runs = tuple(pq.Run(tp=2, cp=1, pp=1, mbs=b, sp=True, recompute=rc, failed=t is None, throughput=t)
                 for (b, rc), t in zip(cells, throughputs))
    sw = pq.Sweep("fujii", "tiny", tuple(TINY), "A100-40GB", 8, 100.0, world, 2048, gbs, "0.8", runs)
    p = pq.planner_for(sw)
    return r13.Prepared(sw, p, pq.score(sw, p))


def with_value(name, v):
    th = list(r13.DEFAULT)
    th[r13.P_INDEX[name]] = v
    return tuple(th)


def test_default_vector_reproduces_the_planner():
    prep = tiny_sweep([1.0, 2.0, 0.5])
    assert all(s.verdict == "fits" for s in prep.scored)
    r13.check_default([prep])                       # raises on any difference
    for a, b in zip(prep.scored, r13.retime(prep, r13.DEFAULT)):
        assert b.seconds == pytest.approx(a.seconds, rel=1e-12)


def test_kernel_gap_moves_the_step_by_the_counted_kernels():
    # docs/planner.md section 2.4: 14 forward + 28 backward kernels a layer, 6 for the output layer and loss, per
    # micro-batch; TP2 PP1 MBS1 at DP 1 (nothing for the gaps to hide behind), GBS 8: 8 micro-batches
    prep = tiny_sweep([1.0, 2.0, 0.5])
    base = r13.retime(prep, r13.DEFAULT)[0].seconds
    slow = r13.retime(prep, with_value("kernel_gap", 7e-6))[0].seconds
    assert slow - base == pytest.approx(8 * (4 * (14 + 28) + 6) * 5e-6, rel=1e-9)


def test_constants_restored_after_an_evaluation():
    from megatron_memguard.planner import comm, kernels, timing
    before = (kernels.GEMM_TILE, kernels.wave_efficiency, timing.KERNEL_GAP, comm.P2P_LATENCY, timing.memory_seconds)
    r13.retime(tiny_sweep([1.0, 2.0, 0.5]), r13.sample(__import__("random").Random(1)))
    assert (kernels.GEMM_TILE, kernels.wave_efficiency, timing.KERNEL_GAP, comm.P2P_LATENCY,
            timing.memory_seconds) == before


def test_figures_on_a_made_up_sweep():
    # measured throughputs in the model's own order (1 / predicted step) and reversed: Spearman +1 and -1 (3 layouts,
    # no ties); with the window at 0 the first choice is the fastest predicted: the best (1.0) in the first case, in
    # the second the slowest measured, 1/3 of the best when the throughputs are 1, 2, 3
    prep = tiny_sweep([1.0, 2.0, 3.0])
    th = with_value("tie_window", 0.0)
    t = [s.seconds for s in r13.retime(prep, th)]
    order = sorted(range(3), key=lambda i: t[i])    # fastest predicted first
    same = [0.0] * 3
    rev = [0.0] * 3
    for rank, i in enumerate(order):
        same[i], rev[i] = 3.0 - rank, 1.0 + rank
    f = r13.figures([tiny_sweep(same)], th)
    assert f.rho[0] == pytest.approx(1.0) and f.first_rel[0] == 1.0 and f.best_gap[0] == 0.0
    f = r13.figures([tiny_sweep(rev)], th)
    assert f.rho[0] == pytest.approx(-1.0) and f.first_rel[0] == pytest.approx(1 / 3)
    # the measured best is the slowest predicted: log of its predicted step over the fastest's
    assert f.best_gap[0] == pytest.approx(math.log(t[order[2]] / t[order[0]]))


def made_up(first, rho, rho_rule, first_rule=None, families=("fujii", "fujii", "hagemann")):
    n = len(first)
    return r13.Figures(tuple(first), tuple(rho), tuple(rho_rule), tuple(first_rule or first), (0.0,) * n,
                       tuple(families))


def test_margins_and_penalty_by_hand():
    f = made_up([0.99, 0.95, 1.0], [0.9, math.nan, 0.8], [0.7, math.nan, 0.85])
    m = f.margins()
    assert m["first:0"] == pytest.approx(0.02) and m["first:1"] == pytest.approx(-0.02)
    assert "rule:1" not in m                          # the rule's Spearman is nan: nothing to compare
    assert m["rule:2"] == pytest.approx(-0.05, abs=1e-8)
    assert m["median:fujii"] == pytest.approx(0.9 - 0.85)     # the nan sweep left out of the median
    assert m["median:hagemann"] == pytest.approx(0.8 - 0.90)
    # shortfalls: first choice 0.02, the rule 0.05, the Hagemann median 3 x 0.10
    assert r13.penalty(f) == pytest.approx(0.02 + 0.05 + 0.30, abs=1e-8)
    assert r13.penalty(f, frozenset({"median:hagemann", "rule:2"})) == pytest.approx(0.02)
    assert r13.penalty(made_up([1.0, 1.0, 1.0], [0.9, 0.9, 0.95], [0.9, 0.9, 0.95])) == 0.0


def test_conflicting_pair_found():
    # target first:0 is met by the first vector, first:1 by the second, never both: one conflicting pair
    good = dict(rho=[0.9, 0.9, 0.95], rho_rule=[0.5, 0.5, 0.5])
    archive = r13.Archive()
    archive.add((0.0,), made_up([1.0, 0.9, 1.0], **good))
    archive.add((1.0,), made_up([0.9, 1.0, 1.0], **good))
    pairs = r13.conflicts([], archive)
    assert [(a, b) for _, a, b in pairs] == [("first:0", "first:1")]
    assert pairs[0][0] == pytest.approx(0.9 - 0.97)


def test_every_box_holds_its_default():
    for p in r13.PARAMS:
        assert p.lower <= p.default <= p.upper, p.name
        assert p.why
    assert dataclasses.is_dataclass(r13.Param)


def test_archive_round_trip(tmp_path):
    archive = r13.Archive()
    archive.add((0.5, 2e-6), made_up([1.0, 0.95, 1.0], [0.9, math.nan, 0.8], [0.7, math.nan, 0.85]))
    path = str(tmp_path / "a.jsonl")
    r13.save_archive(path, archive)
    back = r13.load_archive(path)
    assert back.rows[0][0] == (0.5, 2e-6)
    assert r13.penalty(back.rows[0][1]) == pytest.approx(r13.penalty(archive.rows[0][1]))
