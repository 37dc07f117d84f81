"""Regressions of issue hostile21 (benchmarks/hostile_input.py's hostile21 group).

Part 1: memguard calibrate's fit (calibrate/fit.py) runs its passes over the rows in C over merged columns; the
results equal the per-row path of before (tests/fit_reference.py, main 067b363's fit.py) to within rounding, and the
work is counted (rows merged, Row.error calls), not timed. Part 2: the breaks the round found, each with its exact line.
"""
from __future__ import annotations

import json
import random

import pytest

import fit_reference as ref
from fuzz_util import RUNLOG, run_memguard
from megatron_memguard.calibrate import calibrate, core
from megatron_memguard.calibrate import fit as F
from megatron_memguard.calibrate.fit import Row

MiB = 2.0**20


# ---- part 1: the fit, against the per-row path -----------------------------------------------------------------
def _old_path(monkeypatch) -> None:
    for name in ("guarded_fit", "unbounded", "within_guard", "identifiable"):
        monkeypatch.setattr(core, name, getattr(ref, name))


def _drawn_rows(seed: int, k: int, runs: int, ranks: int) -> list[Row]:
    """Runs of ``ranks`` ranks measuring fixed bytes plus ``k`` constants (0.3% scatter), a fifth of them 10-30% off
    (modelling gaps the cap must hold out), some ranks of a run alike (merged rows)."""
    rng = random.Random(seed)
    true = [600 * MiB, 96 * MiB, 20 * MiB][:k]
    rows = []
    for i in range(runs):
        a = tuple(float(rng.choice([1, 2, 3])) if j else 1.0 for j in range(k))
        b = rng.uniform(2, 40) * 2**30
        gap = rng.uniform(0.1, 0.3) if i % 5 == 4 else 0.0
        for r in range(ranks):
            noise = 1 + (rng.gauss(0, 0.003) if r % 2 else 0.0)
            y = (b + sum(x * t for x, t in zip(a, true))) * (1 + gap) * noise
            rows.append(Row(f"r{i}", y, b, a))
    return rows


@pytest.mark.parametrize("seed, k, runs, ranks", [(1, 1, 12, 4), (2, 2, 10, 3), (3, 2, 40, 2), (4, 1, 35, 8), (5, 3, 9, 2)])
def test_guarded_fit_equals_the_per_row_path_on_drawn_rows(seed, k, runs, ranks):
    rows = _drawn_rows(seed, k, runs, ranks)
    lo, hi = [0.0] * k, [4096 * MiB] * k
    start, scale = [512 * MiB, 64 * MiB, 16 * MiB][:k], [64 * MiB] * k
    new = F.guarded_fit(rows, lo, hi, start, scale, core.GUARD, core.GAP)
    old = ref.guarded_fit(rows, lo, hi, start, scale, core.GUARD, core.GAP)
    assert new.guarded == old.guarded
    # the same constants to within rounding: 1e-12 of the constants' scale (64 MiB: 7e-5 bytes; the fit's own step
    # tolerance is 1e-9 of it)
    for a, b in zip(new.theta + new.free, old.theta + old.free):
        assert a == pytest.approx(b, rel=1e-9, abs=1e-12 * 64 * MiB)
    assert F.fit(rows, lo, hi, start, scale) == pytest.approx(ref.fit(rows, lo, hi, start, scale), rel=1e-9,
                                                              abs=1e-12 * 64 * MiB)
    t = [s * 1.5 for s in start]
    assert F.within_guard(rows, start, t, core.GUARD, core.GAP) == pytest.approx(
        ref.within_guard(rows, start, t, core.GUARD, core.GAP), rel=1e-12)


def test_calibrate_report_equals_the_per_row_path(tmp_path, monkeypatch):
    # test_calibrate.py's runs (memguard's estimate under known constants, Megatron's log lines), two of them with a
    # steady-state gap: the printed report is the same text, every number of --json the same to within rounding
    from test_calibrate import A100, write_runs
    from megatron_memguard.calibrate.runs import read_runs
    from megatron_memguard.cli.calibrate import render

    def distort(i, v):
        return [v[0] * 1.3 if i in (2, 3) else v[0], *v[1:]]
    runs = read_runs([str(write_runs(tmp_path, distort=distort, noise=0.002, seed=4))], gpu=A100)
    kw = {"fit_only": ["te_workspace", "cublas_workspace", "cuda_context"]}
    new = calibrate(runs, **kw)
    _old_path(monkeypatch)
    old = calibrate(runs, **kw)
    assert render(new, None) == render(old, None)
    assert new.fitted.keys() == old.fitted.keys() and new.fitted
    for name, v in new.fitted.items():
        assert v == pytest.approx(old.fitted[name], rel=1e-9)
    for a, b in zip(new.levels, old.levels):
        assert a.held_out == pytest.approx(b.held_out, rel=1e-6, abs=1e-12)


def test_guarded_fit_merges_alike_rows_and_never_calls_row_error(monkeypatch):
    # 290 runs of 8 ranks whose ranks logged the same bytes (hostile20's 1 MB input: its allocated level): the fit's
    # passes run over 290 merged rows, and never through Row.error per row (the per-row path called it about 10**7
    # times: 28 s of CPU for the whole input)
    rows = [Row(f"r{i:03d}", (1024 + 600 * (1 + 0.004 * (i % 5 - 2))) * MiB, 1024 * MiB, (1.0,))
            for i in range(290) for _ in range(8)]
    assert len(F._columns(rows, F.run_weights(rows)).r0) == 5       # (five distinct measurements: merged across runs too)
    calls = [0]
    orig = Row.error

    def counted(self, theta):
        calls[0] += 1
        return orig(self, theta)
    monkeypatch.setattr(Row, "error", counted)
    g = F.guarded_fit(rows, [0.0], [4096 * MiB], [512 * MiB], [64 * MiB], core.GUARD, core.GAP)
    assert calls[0] == 0
    assert g.theta[0] == pytest.approx(600 * MiB, rel=1e-3)         # the median run's 600 MiB


# ---- part 2: the breaks, each with its line ---------------------------------------------------------------------
S = ("--num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 512 --max-position-embeddings 512 "
     "--micro-batch-size 1 --tokenizer-type NullTokenizer --vocab-size 1000 --bf16").split()


def test_a_te_release_of_5000_digits_is_refused_by_name():
    # packaging's Version converts each part with int(): over 4,300 digits Python refuses with a ValueError, which
    # escaped as an internal error (not an InvalidVersion)
    o = run_memguard(["estimate", "--world-size", "8", "--", *S], env={"MEMGUARD_TE_VERSION": "9" * 5000})
    assert o.code == 2 and not o.problems
    assert o.err.strip() == ("memguard: error: MEMGUARD_TE_VERSION: expects a Transformer Engine release such as 2.14.1, "
                             f"got '{'9' * 49}...{'9' * 49}' (5002 characters)")


def test_a_site_name_with_an_emoji_or_a_line_break_reads_back(tmp_path):
    # json.dumps wrote U+1F600 as the surrogate pair \ud83d\ude00, which YAML refuses: the profile calibrate wrote
    # did not load ("found invalid Unicode character escape code"); NEL inside quotes folded to a space
    from megatron_memguard.site_profile import dump_site_profile, load_site_profile
    for i, name in enumerate(("team \U0001F600", "a\x85b", "a\u2028b", "del\x7f", "tab\tand\x00nul")):
        p = tmp_path / f"s{i}.yaml"
        p.write_text(dump_site_profile({"cuda_context": 600 * 2**20}, name=name, gpu="H100-80GB"), encoding="utf-8")
        assert load_site_profile(str(p)).name == name


def test_a_site_name_of_bytes_that_are_not_utf8_is_refused():
    # a --name from bytes that are not UTF-8 arrives with surrogates (surrogateescape), which no YAML file holds
    o = run_memguard(["calibrate", "a.log", "b.log", "c.log", "--name", "x\udcff", "--out", "s.yaml"],
                     {"a.log": "x\n", "b.log": "x\n", "c.log": "x\n"})
    assert o.code == 2 and not o.problems
    assert o.err.strip() == "memguard: error: --name: holds bytes that are not UTF-8 text ('x\\udcff'); give the name in UTF-8"


def test_report_shows_the_iteration_range_of_a_log_whose_iterations_go_back():
    # a rank's samples in the file's order 100, 10, 50, 20, 90: the per-rank column said '5 (100-90)'
    recs = [RUNLOG[0]] + [dict(RUNLOG[1], iteration=i) for i in (100, 10, 50, 20, 90)]
    o = run_memguard(["report", "."], {"memguard-rank00000.jsonl": "\n".join(json.dumps(r) for r in recs) + "\n"})
    assert o.code == 0 and not o.problems
    row = next(line for line in o.out.splitlines() if line.startswith("0 "))
    assert row.split()[2:4] == ["5", "(10-100)"]
