"""The run report of an MoE run: the measured peak set between the balanced-routing estimate and the
worst-case bound (peaks move with routing). Runs written by the real MemoryMonitor and JsonlSink."""
from __future__ import annotations

from megatron_memguard.report.runlog import read_run
from megatron_memguard.report.runreport import moe_lines, render_text

from runlog_util import make_estimate, write_run

MOE = ["--num-experts", "8", "--moe-router-topk", "2", "--expert-model-parallel-size", "4", "--expert-tensor-parallel-size", "1",
       "--moe-token-dispatcher-type", "alltoall", "--moe-grouped-gemm"]


def test_moe_run_report_places_the_peak_between_estimate_and_bound(tmp_path):
    est = make_estimate(pp=2, tp=2, world=8, extra=MOE)
    # rank 0 (pp0) 3% above the estimate, rank 2 (pp1) at 97% of it
    write_run(tmp_path, est, ranks_per_stage=2, scales={0: 1.03, 1: 1.0, 2: 0.97, 3: 0.97})
    log = read_run(str(tmp_path))
    lines = moe_lines(log)
    assert lines[0].startswith("mixture of experts")
    pp0 = next(line for line in lines if line.startswith("pp0"))
    assert "above the balanced estimate, within the bound" in pp0 and "103% of the balanced-routing estimate" in pp0
    pp1 = next(line for line in lines if line.startswith("pp1"))
    assert "within the balanced estimate" in pp1
    assert "mixture of experts" in render_text(log, colour=False)
    # the bound is the estimate's worst case for the stage
    w = est.stages[0].moe["worst_case"]["peak_allocated_bytes"]
    assert w > est.stages[0].peak_allocated_bytes


def test_dense_run_report_has_no_moe_lines(tmp_path):
    write_run(tmp_path, make_estimate(pp=2, tp=2, world=8))
    assert moe_lines(read_run(str(tmp_path))) == []
