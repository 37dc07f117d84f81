"""Megatron CI's allgather / sinkhorn top-1 MoE layouts on the CPU referee (real megatron-core 0.16.1 on
CPU, gloo, 4 ranks; stored in benchmarks/results/referee-moe-ci-layouts.json by
benchmarks/referee/moe_ci_layouts.py) against memguard's estimate of the same flags (--device cpu, local
profile).

The GPU records of these layouts peak 1.8-2.0% above the estimate (docs/calibration.md, "The uniform -1.8%
to -2.0%"). On the referee, which sees every tensor megatron-core's Python code keeps, the estimate matches
the measured peak to a fraction of a per cent and the layout without experts is matched as closely: the
miss is not a term of the MoE layers that memguard leaves out."""
from __future__ import annotations

import json
import os

import pytest

from benchmarks.referee.compare import compare_entry
from benchmarks.referee.grids.moe_ci import CI_LAYOUTS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MEASURED = os.path.join(ROOT, "benchmarks", "results", "referee-moe-ci-layouts.json")

# What one MoE layer of the records misses on the GPU, per cent of the measured peak (the smallest group
# member, 3.7 MiB per layer of gpt3_mcore_tp2_pp2_ep2_etp2_te_4experts2parallel): on the referee's 4 layers
# of ci_tp4_ep2_etp2_e4_sinkhorn that would be 4 x 3.7 MiB = 1.6% of its 0.9 GB peak.
GPU_MISS_PER_LAYER = 3.7 * 2**20


def _entries():
    with open(MEASURED) as fh:
        by = {c["name"]: c for c in json.load(fh)["configs"] if c.get("status") == "ok"}
    return {c["name"]: by[c["name"]] for c in CI_LAYOUTS if c["name"] in by}


def test_every_layout_was_measured():
    assert set(_entries()) == {c["name"] for c in CI_LAYOUTS}


@pytest.mark.parametrize("name", [c["name"] for c in CI_LAYOUTS])
def test_estimate_matches_the_referee(name):
    rows = compare_entry(_entries()[name])
    for r in rows:
        assert r.params_predicted == r.params_measured
        assert abs(r.after_err) < 0.001, (r.rank, r.after_err)
        assert abs(r.peak_err) < 0.005, (r.rank, r.peak_err)


@pytest.mark.parametrize("name", ["ci_tp2_ep2_e8_sinkhorn", "ci_tp4_ep2_etp2_e4_sinkhorn"])
def test_no_per_layer_miss_of_the_gpu_size(name):
    """The largest shortfall on any rank is well under what the GPU records miss per MoE layer."""
    entry = _entries()[name]
    layers = int(entry["settings"]["num_layers"])
    short = max(r.peak_measured - r.peak_predicted for r in compare_entry(entry))
    assert short < 0.5 * layers * GPU_MISS_PER_LAYER
