"""Does ``memguard calibrate`` generalise on a site's own runs? Megatron-LM's CI records, each platform a site.

    python benchmarks/calibrate_dev_records.py [--out benchmarks/results/calibrate-dev-records.md]

For each platform (H100, A100, GB200) the clean training records of
``shared/groundtruth/megatron-functional-dev.jsonl`` (the last global rank's allocated bytes after the
optimizer step and its peak allocated, per iteration) are split in two halves by record id (even / odd
positions). ``calibrate`` fits the workspace constants (the allocated level: cuBLAS default workspace,
Transformer Engine workspace) on one half; the other half is predicted with memguard's defaults and with
the fitted profile. Both directions are run. Printed per platform and direction: the fitted constants (or
why they were kept), and on the held-out half the median and largest absolute error of the steady value and
of the peak, the records within the accuracy targets (steady 3%, peak 5%), and the largest change of any
one held-out record's absolute error. The reserved and device levels are not in these records.

Two oracles that see the held-out half bound what any workspace pair (within 8 MiB of the defaults, 0.25 MiB
steps) could gain on its median steady error: without raising its largest steady or peak error, and without
making any record worse by more than calibrate's guard (records the defaults miss by more than 5%, modelling
gaps, aside).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from accuracy_megatron_ci import PLATFORM_GPU, PLATFORM_NAME, load_records, record_raw  # noqa: E402

from megatron_memguard import lookup_gpu  # noqa: E402
from megatron_memguard.calibrate import CalibrationRun, Observation, TooLittleData, calibrate  # noqa: E402
from megatron_memguard.calibrate.core import GAP, GUARD  # noqa: E402
from megatron_memguard.calibrate.model import allocated_rows, errors, explicit  # noqa: E402
from megatron_memguard.errors import MemguardError  # noqa: E402
from megatron_memguard.estimator.site import DEFAULT_SITE  # noqa: E402
from megatron_memguard.resolve import resolve  # noqa: E402

WORKSPACES = ("cublas_workspace", "te_workspace")
TARGET = {"steady": 0.03, "peak_allocated": 0.05}


def _numbers(series: dict) -> list[float]:
    return [float(v) for k, v in sorted(series.items(), key=lambda kv: int(kv[0])) if v not in ("nan", None)]


def record_run(r: dict) -> CalibrationRun | None:
    """A record as a calibration run: the last global rank (last stage, last DP rank) after the step and at its peak."""
    try:
        L = resolve(record_raw(r))
    except MemguardError:
        return None
    obs = Observation(rank=L.world_size - 1, pp_rank=L.pp - 1, dp_rank=L.dp_shard_size - 1,
                      steady=int(_numbers(r["mem_allocated_bytes"])[-1]),
                      peak_allocated=int(max(_numbers(r["mem_max_allocated_bytes"]))))
    return CalibrationRun(name=r["id"], layout=L, gpu=lookup_gpu(PLATFORM_GPU.get(r["platform"], "H100-80GB")),
                          observations=[obs], source="Megatron CI record")


def platforms() -> dict[str, list[CalibrationRun]]:
    out: dict[str, list[CalibrationRun]] = {}
    for r in load_records():
        run = record_run(r)
        if run is not None:
            out.setdefault(PLATFORM_NAME.get(r["platform"], str(r["platform"])), []).append(run)
    return {k: sorted(v, key=lambda x: x.name) for k, v in sorted(out.items())}


def held_out(train: list[CalibrationRun], test: list[CalibrationRun]) -> dict:
    """Fit the workspaces on ``train``; the errors of ``test`` with the defaults and with the fit."""
    try:
        res = calibrate(train, fit_only=WORKSPACES)
        site, constants = res.site, res.constants
        gaps = [n for g in res.gaps if g.metric == "steady" for n, _ in g.runs]
    except TooLittleData as e:
        site, constants, gaps = DEFAULT_SITE, [], []
        print("  ", e)
    out = {"constants": [c for c in constants if c.name in WORKSPACES], "site": site, "n": len(test), "gaps": gaps}
    for m in ("steady", "peak_allocated"):
        before = [abs(errors(r, DEFAULT_SITE, m)[0]) for r in test]
        after = [abs(errors(r, site, m)[0]) for r in test]
        out[m] = {"median_before": statistics.median(before), "median_after": statistics.median(after),
                  "max_before": max(before), "max_after": max(after),
                  "within_before": sum(e <= TARGET[m] for e in before), "within_after": sum(e <= TARGET[m] for e in after),
                  "worst_change": max(a - b for a, b in zip(after, before)),
                  "worse_than_guard": sum(a > b + GUARD for a, b in zip(after, before)),
                  "worse": sum(a > b + 1e-12 for a, b in zip(after, before))}
    return out


def ceiling(test: list[CalibrationRun], span_mib: float = 8, step_mib: float = 0.25) -> tuple[float, float]:
    """The most any pair of workspace values within +-``span_mib`` of the defaults could lower the held-out
    half's median absolute steady error (an oracle that sees the held-out half): (1) without raising its largest
    steady or peak error or losing a record from the targets; (2) without making any record (modelling gaps
    aside: beyond GAP with the defaults) worse by more than GUARD, steady or peak."""
    steady, peak = allocated_rows(test, DEFAULT_SITE, "steady"), allocated_rows(test, DEFAULT_SITE, "peak_allocated")
    t0 = [float(v) for v in (explicit(DEFAULT_SITE, test[0].gpu).cublas_workspace, explicit(DEFAULT_SITE, test[0].gpu).te_workspace)]

    def errs(rows, theta):
        return [abs(r.error(theta)) for r in rows]
    s0, p0 = errs(steady, t0), errs(peak, t0)
    m0 = statistics.median(s0)
    n = int(span_mib / step_mib)
    best = [0.0, 0.0]
    for i in range(-n, n + 1):
        for j in range(-n, n + 1):
            theta = [max(0.0, t0[0] + i * step_mib * 2**20), max(0.0, t0[1] + j * step_mib * 2**20)]
            s, p = errs(steady, theta), errs(peak, theta)
            gain = m0 - statistics.median(s)
            if gain <= min(best):
                continue
            if (max(s) <= max(s0) and sum(x <= TARGET["steady"] for x in s) >= sum(x <= TARGET["steady"] for x in s0)
                    and max(p) <= max(p0) and sum(x <= TARGET["peak_allocated"] for x in p) >= sum(x <= TARGET["peak_allocated"] for x in p0)):
                best[0] = max(best[0], gain)
            if all(a <= b + GUARD for a, b, g in zip(s, s0, s0) if g <= GAP) and \
                    all(a <= b + GUARD for a, b, g in zip(p, p0, s0) if g <= GAP):
                best[1] = max(best[1], gain)
    return best[0], best[1]


def evaluate(with_ceiling: bool = True) -> list[tuple[str, str, dict]]:
    rows = []
    for plat, runs in platforms().items():
        even, odd = runs[0::2], runs[1::2]
        for name, train, test in (("fit on even, test on odd", even, odd), ("fit on odd, test on even", odd, even)):
            r = held_out(train, test)
            r["ceiling"], r["ceiling_guard"] = ceiling(test) if with_ceiling else (None, None)
            rows.append((plat, name, r))
    return rows


def _fmt_constants(cs) -> str:
    if not cs:
        return "none"
    return "; ".join(f"{c.name} " + (f"{c.value / 2**20:.2f} MiB" if c.fitted else f"kept ({c.status})") for c in cs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "calibrate-dev-records.md"))
    ns = ap.parse_args(argv)
    lines = ["# memguard calibrate on Megatron-LM's CI records (each platform a site)", "",
             "Workspace constants fitted on one half of a platform's clean records, tested on the other half; "
             "absolute relative errors of the held-out half with memguard's defaults -> with the fitted profile. "
             f"Guard: no run {GUARD:.2%} (absolute) worse; modelling gaps: runs beyond {GAP:.0%}.", "",
             "| platform | split | held-out records | fitted | steady: median | steady: max | steady within 3% | "
             "peak: median | peak: max | peak within 5% | largest change of one record's error | "
             "held-out records worse by more than the guard | training runs reported as modelling gaps | "
             "oracle: most any workspaces could gain on the steady median (max not raised) | "
             "oracle: the same, no record worse than the guard |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    why, gaps = [], []
    for plat, split, r in evaluate():
        s, p = r["steady"], r["peak_allocated"]
        why += [f"- {plat}, {split}: {c.name}: {c.status}: {c.reason}" for c in r["constants"] if not c.fitted]
        if r["gaps"]:
            gaps.append(f"- {plat}, {split}: " + ", ".join(n.split("/")[1] for n in r["gaps"]))
        lines.append(
            f"| {plat} | {split} | {r['n']} | {_fmt_constants(r['constants'])} | "
            f"{s['median_before']:.3%} -> {s['median_after']:.3%} | {s['max_before']:.2%} -> {s['max_after']:.2%} | "
            f"{s['within_before']} -> {s['within_after']} | {p['median_before']:.3%} -> {p['median_after']:.3%} | "
            f"{p['max_before']:.2%} -> {p['max_after']:.2%} | {p['within_before']} -> {p['within_after']} | "
            f"steady {s['worst_change']:+.2%}, peak {p['worst_change']:+.2%} | "
            f"{s['worse_than_guard'] + p['worse_than_guard']} | {len(r['gaps'])} | {r['ceiling']:.3%} | {r['ceiling_guard']:.3%} |")
    lines += ["", "The oracles see the held-out half: the most any pair of workspace values (within 8 MiB of the "
              "defaults, 0.25 MiB steps) lowers its median steady error (1) without raising its largest steady or peak "
              "error or losing a record from the targets, (2) without making any record worse than the guard (steady or "
              "peak; records the defaults miss by more than 5% aside).", "",
              "Why constants were kept:", "", *why, "",
              "Training runs reported as modelling gaps (steady off by more than 5% after calibration; capped in the fit, "
              "so they neither move nor veto the constants):", "", *gaps]
    text = "\n".join(lines) + "\n"
    print(text)
    os.makedirs(os.path.dirname(ns.out), exist_ok=True)
    with open(ns.out, "w") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
