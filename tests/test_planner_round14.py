"""benchmarks/planner_round14.py's helpers (issue 18, round 14): the grid, the runs of fixing points, and the
constants it may move (the planner's own, not round 13's extensions)."""
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
r13 = pytest.importorskip("benchmarks.planner_round13")
r14 = pytest.importorskip("benchmarks.planner_round14")


def test_intervals_are_the_runs_of_true_points():
    pts = [(1, False), (2, True), (3, True), (4, False), (5, True), (6, False), (7, True), (8, True)]
    assert r14.intervals(pts) == [(2, 3), (5, 5), (7, 8)]
    assert r14.intervals([(1, False), (2, False)]) == []


def test_grid_spans_the_box():
    # a log box 1e-6 .. 1e-4 in 3 points: 1e-6, 1e-5, 1e-4; a linear box 0.5 .. 0.9 in 5 points: steps of 0.1
    lat = r13.Param("x", 1e-5, 1e-6, 1e-4, True, "")
    assert r14.grid(lat, 3) == pytest.approx([1e-6, 1e-5, 1e-4], rel=1e-12)
    lin = r13.Param("y", 0.7, 0.5, 0.9, False, "")
    assert r14.grid(lin, 5) == pytest.approx([0.5, 0.6, 0.7, 0.8, 0.9])
    tile = r13.PARAMS[r13.P_INDEX["gemm_tile"]]
    assert r14.grid(tile, 25) == [0.0, 1.0, 2.0]      # every tile, whatever the point count


def test_only_planner_constants_are_moved():
    names = {p.name for p in r13.PARAMS}
    assert r14.NOT_ADOPTABLE <= names and set(r14.SOURCES) <= names
    assert not r14.NOT_ADOPTABLE & set(r14.SOURCES)
    # FlashAttention-2's backward at 63% of peak against 73% forward (Dao 2023): 5 / 2 matmuls x 73 / 63 = 2.897
    assert r14.SOURCES["attn_bwd_ratio"][0][0] == pytest.approx(2.897, abs=5e-4)
