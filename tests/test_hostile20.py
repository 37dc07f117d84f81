"""Regressions of issue hostile20 (benchmarks/hostile_input.py's hostile20 group): memguard calibrate over many runs.
Leave-one-out refits once per run and the bootstrap 64 times, each refit costing in proportion to the runs: the work
grew with their square (80 runs over 60 s). Above LOO_MAX runs the held-out errors come from FOLDS folds and the
bootstrap draws fewer resamples. Counted in refits (guarded_fit calls), not timed."""
from __future__ import annotations

import pytest

from megatron_memguard.calibrate import core
from megatron_memguard.calibrate.fit import Row


def _rows(n: int) -> list[Row]:
    # one rank per run, each measuring 1 GiB of fixed bytes plus a CUDA context of 600 MiB (+-0.4%): every run
    # is explained by the fit (an inlier), so the bootstrap resamples them all
    mib = 2.0**20
    return [Row(f"r{i:03d}", 1024 * mib + 600 * mib * (1 + 0.004 * ((i % 5) - 2)), 1024 * mib, (1.0,))
            for i in range(n)]


def _count_fits(monkeypatch, n: int) -> tuple[int, core._Trial]:
    calls = [0]
    orig = core.guarded_fit

    def counted(*a, **k):
        calls[0] += 1
        return orig(*a, **k)
    monkeypatch.setattr(core, "guarded_fit", counted)
    rows = _rows(n)
    before = {r.run: abs(r.error([512 * 2.0**20])) for r in rows}
    trial = core._trial(rows, ["cuda_context"], [512 * 2.0**20], [0], before)
    return calls[0], trial


@pytest.mark.parametrize("n, fits", [
    (3, 1 + 3 + 64),                    # the fit on all runs, one per run held out, 64 bootstrap resamples
    (30, 1 + 30 + 64),                  # LOO_MAX: still leave-one-out (the results below it are unchanged)
    (31, 1 + 10 + 64 * 30 // 31),       # 10 folds; resamples cut to 64 x 30 // 31 = 61
    (80, 1 + 10 + 64 * 30 // 80),       # 24 resamples (was 1 + 80 + 64 = 145 refits)
    (290, 1 + 10 + 8),                  # a 1 MB input's ~290 runs: BOOTSTRAP_MIN resamples (was 355 refits)
])
def test_calibrate_refits_are_bounded(monkeypatch, n, fits):
    got, trial = _count_fits(monkeypatch, n)
    assert got == fits
    assert sorted(trial.held_out) == [f"r{i:03d}" for i in range(n)]    # every run still gets a held-out error


def test_held_out_scheme_is_named():
    assert core.held_out_scheme(30) == "leave-one-out"
    assert core.held_out_scheme(31) == "10-fold"
    # every run in exactly one fold, folds of sorted names taken every tenth
    names = [f"r{i:03d}" for i in range(45)]
    folds = core._folds(names)
    assert len(folds) == 10 and sorted(x for f in folds for x in f) == names
    assert folds[0] == ["r000", "r010", "r020", "r030", "r040"]
    assert core._folds(names[:30]) == [[x] for x in names[:30]]


def test_left_t_is_the_micro_batches_still_held():
    from megatron_memguard import schedule
    # VPP 3, groups of 2, m = 5 (get_schedule_table: chunk 0 takes micro-batches 0-1, chunk 1 0-1, chunk 2 0-1, then
    # 2-3 likewise, then the partial group of 1); backwards take the chunks last first. Per chunk, after the backwards
    # of the first 2 positions chunk 2 has released 2 of its 5; after 7, chunks 2, 1, 0 released micro-batches 0-1
    # and chunk 2 also 2; after 13, all but micro-batch 4 and chunk 2 that one too; after all 15 none is held
    assert schedule._left_t(0, 3, 5, 2) == (5, 5, 5)
    assert schedule._left_t(2, 3, 5, 2) == (5, 5, 3)
    assert schedule._left_t(7, 3, 5, 2) == (3, 3, 2)
    assert schedule._left_t(13, 3, 5, 2) == (1, 1, 0)
    assert schedule._left_t(15, 3, 5, 2) == (0, 0, 0)
    for a in range(16):                 # and m less _counts, reversed, everywhere
        assert schedule._left_t(a, 3, 5, 2) == tuple(5 - c for c in reversed(schedule._counts(a, 3, 5, 2)))
