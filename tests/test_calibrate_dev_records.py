"""memguard calibrate on Megatron-LM's CI records, each platform a site (benchmarks/calibrate_dev_records.py):
the workspace constants fitted on half of a platform's clean records, tested on the other half.

The issue's target: no held-out record worse (beyond calibrate's guard, a quarter point), no held-out median
worse, modelling gaps reported and not fitted. memguard's defaults for these constants come from PyTorch's and
Transformer Engine's sources and were checked against these very records (docs/calibration.md): what one half
asks for is within its own scatter (two bootstrap standard errors), confounded with a setting (H100: only CP 2 runs
leave CUBLAS_WORKSPACE_CONFIG unset in the even half), or contradicted by its own runs (GB200: the 46 MiB group),
so every half keeps the defaults. The previous fit moved H100's cuBLAS workspace to 33 MiB from the even half and
made an odd record 0.80 points worse (1.15% -> 1.95%)."""
import functools
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from calibrate_dev_records import evaluate, platforms  # noqa: E402

from megatron_memguard.calibrate.core import GAP, GUARD  # noqa: E402
from megatron_memguard.calibrate.model import errors  # noqa: E402
from megatron_memguard.estimator.overheads import cublas_config_bytes  # noqa: E402
from megatron_memguard.estimator.site import DEFAULT_SITE  # noqa: E402

PLATFORMS = platforms()


@functools.lru_cache(maxsize=None)
def rows() -> list:
    """evaluate()'s rows, fitted once per test process when a test first asks: not at import, where every xdist worker
    collecting the file paid the fits (16 s of CPU) whether or not it ran the file."""
    return evaluate()


def _train(plat: str, split: str):
    runs = PLATFORMS[plat]
    return runs[0::2] if split.startswith("fit on even") else runs[1::2]


def test_no_held_out_record_gets_worse_than_the_guard_and_no_median_worse():
    assert {p for p, _, _ in rows()} == {"A100", "GB200", "H100"} and len(rows()) == 6
    for plat, split, r in rows():
        for m in ("steady", "peak_allocated"):
            x = r[m]
            assert x["worse_than_guard"] == 0 and x["worst_change"] <= GUARD, (plat, split, m, x["worst_change"])
            assert x["median_after"] <= x["median_before"] + 1e-12, (plat, split, m)
            assert x["within_after"] >= x["within_before"], (plat, split, m)


def test_gb200_gap_records_are_reported_and_neither_move_nor_veto_the_constants():
    for plat, split, r in rows():
        if plat != "GB200":
            continue
        train = _train(plat, split)
        off = [run.name for run in train if abs(errors(run, DEFAULT_SITE, "steady")[0]) > GAP]
        assert len(off) >= 4 and sorted(r["gaps"]) == sorted(off), (split, r["gaps"])
        cublas = next(c for c in r["constants"] if c.name == "cublas_workspace")
        assert not cublas.fitted and cublas.status == "inconsistent", (split, cublas.status)
    # in the odd half the gap runs are most of the runs that show the cuBLAS default, yet the default stays
    odd = _train("GB200", "fit on odd")
    shows = [run for run in odd if cublas_config_bytes(run.layout) is None]
    gaps = [run for run in shows if abs(errors(run, DEFAULT_SITE, "steady")[0]) > GAP]
    assert 2 * len(gaps) > len(shows)


def test_h100_even_cublas_default_is_confounded_with_context_parallelism():
    r = next(r for p, s, r in rows() if p == "H100" and s.startswith("fit on even"))
    cublas = next(c for c in r["constants"] if c.name == "cublas_workspace")
    assert cublas.status == "not identifiable" and "CP 2" in cublas.reason
    shows = [run for run in _train("H100", "fit on even") if cublas_config_bytes(run.layout) is None]
    assert shows and all(run.layout.context_parallel_size == 2 for run in shows)


def test_kept_constants_say_why_and_the_oracles_bound_what_was_left():
    for plat, split, r in rows():
        for c in r["constants"]:
            if not c.fitted:
                assert c.status in ("within noise", "inconsistent", "not identifiable") and c.reason, (plat, split, c.name)
                if c.status == "within noise":
                    assert "standard error" in c.reason
        # an oracle that sees the held-out half and keeps every record within the guard gains under a fifth of a point
        assert 0.0 <= r["ceiling_guard"] < 0.002, (plat, split, r["ceiling_guard"])
        assert 0.0 <= r["ceiling"] < 0.002, (plat, split, r["ceiling"])
