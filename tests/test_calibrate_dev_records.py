"""memguard calibrate on Megatron-LM's CI records, each platform a site (benchmarks/calibrate_dev_records.py):
the workspace constants fitted on half of a platform's clean records, tested on the other half.

memguard's defaults for these constants come from PyTorch's and Transformer Engine's sources and were checked
against these very records (docs/calibration.md), so there is little to gain: an oracle that sees the held-out
half could lower its median steady error by at most 0.18 percentage points without hurting its worst record.
What must hold: calibration loses no held-out record from the accuracy targets, makes no held-out median worse
and no held-out record worse by more than the leave-one-out guard (1 point); it improves the median where it
fits; on GB200 it keeps the defaults because the records disagree (ten tests sit 46 MiB below their twins)."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from calibrate_dev_records import evaluate  # noqa: E402

from megatron_memguard.calibrate.core import GUARD  # noqa: E402

ROWS = evaluate()


def test_no_held_out_record_is_lost_and_no_median_gets_worse():
    assert {p for p, _, _ in ROWS} == {"A100", "GB200", "H100"} and len(ROWS) == 6
    for plat, split, r in ROWS:
        for m in ("steady", "peak_allocated"):
            x = r[m]
            assert x["within_after"] >= x["within_before"], (plat, split, m)
            assert x["median_after"] <= x["median_before"] + 1e-12, (plat, split, m)
            assert x["worst_change"] <= GUARD, (plat, split, m, x["worst_change"])


def test_the_median_improves_where_constants_are_fitted():
    fitted = [(p, s, r) for p, s, r in ROWS if any(c.fitted for c in r["constants"])]
    assert fitted
    for plat, split, r in fitted:
        assert r["steady"]["median_before"] - r["steady"]["median_after"] >= 0.0005, (plat, split)  # >= 0.05 points
        assert r["peak_allocated"]["median_after"] < r["peak_allocated"]["median_before"], (plat, split)


def test_gb200_records_disagree_and_keep_the_defaults():
    for plat, split, r in ROWS:
        if plat == "GB200":
            cublas = next(c for c in r["constants"] if c.name == "cublas_workspace")
            assert cublas.status == "inconsistent" and "the runs disagree" in cublas.reason
            assert not any(c.fitted for c in r["constants"])


def test_the_defaults_are_within_a_fifth_of_a_point_of_the_best_workspaces():
    for plat, split, r in ROWS:
        assert r["ceiling"] < 0.002, (plat, split, r["ceiling"])
