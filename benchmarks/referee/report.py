"""Regenerate benchmarks/results/referee.md: the referee's measurements against memguard's estimate.

    python -m benchmarks.referee.report            # run the whole grid (minutes), then compare
    python -m benchmarks.referee.report --ci       # only the CI subset
    python -m benchmarks.referee.report --measured benchmarks/results/referee-measured.json
                                                   # compare stored measurements (no runs)

One table row per configuration and rank: parameters, live bytes after the optimizer step and peak
live bytes during the iterations, measured and predicted, with the relative error; a summary line
with the max and median errors. Exits 1 when a bound of compare.BOUNDS is broken.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from .compare import BOUNDS, compare_entry, summary

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS = os.path.join(ROOT, "benchmarks", "results")


def _mib(n: int) -> str:
    return f"{n / 2**20:,.3f}"


def render(entries: list[dict], source: str) -> tuple[str, dict]:
    rows = []
    lines = ["| config | rank | pp | params | after step MiB (meas / pred) | err | peak MiB (meas / pred) | err | peak (measured phase / predicted phase) |",
             "|---|---|---|---|---|---|---|---|---|"]
    skipped = []
    for e in entries:
        if e.get("status") != "ok":
            skipped.append(f"{e['name']} ({e.get('status')}: {str(e.get('error', ''))[:120]})")
            continue
        for r in compare_entry(e):
            rows.append(r)
            params = f"{r.params_measured:,}" + ("" if r.params_predicted == r.params_measured else f" vs {r.params_predicted:,}")
            lines.append(f"| {r.config} | {r.rank} | {r.pp_rank} | {params} | {_mib(r.after_measured)} / {_mib(r.after_predicted)} | "
                         f"{r.after_err:+.3%} | {_mib(r.peak_measured)} / {_mib(r.peak_predicted)} | {r.peak_err:+.2%} | "
                         f"{r.peak_phase_measured} / {r.peak_phase_predicted} |")
    s = summary(rows)
    head = [
        "# CPU referee: real megatron-core training steps against memguard's estimate", "",
        f"Measurements: {source}. Estimate: `memguard estimate --device cpu --profile local` for the rank's "
        "stage and distributed-optimizer shard. Bounds: parameters exact, after-step within "
        f"{BOUNDS['after_step']:.0%}, peak within {BOUNDS['peak']:.0%}.", "",
        f"**Summary: {s['configs']} configurations, {s['ranks']} ranks; parameters exact on {s['params_exact']}/{s['ranks']}; "
        f"after-step error max {s['after_max']:.4%}, median {s['after_median']:.4%}; peak error max {s['peak_max']:.2%}, "
        f"median {s['peak_median']:.3%}; default estimate (largest distributed-optimizer shard of the stage) against the "
        f"stage's largest measured rank: after-step error max {s['default_after_max']:.4%}, peak error max "
        f"{s['default_peak_max']:.2%}; {s['failures']} rank(s) outside the bounds.**", "",
    ]
    if skipped:
        head += ["Not compared: " + "; ".join(skipped), ""]
    return "\n".join(head + lines) + "\n", s


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--measured", help="compare these stored measurements instead of running the grid")
    ap.add_argument("--ci", action="store_true", help="run only the CI subset")
    ap.add_argument("--only", nargs="*", help="run only these configurations")
    ap.add_argument("--out", default=os.path.join(RESULTS, "referee.md"))
    ap.add_argument("--save-measured", default=None,
                    help="also write the fresh measurements here (default: benchmarks/results/referee-measured.json "
                         "for a whole-grid run)")
    ns = ap.parse_args(argv)
    if ns.measured:
        with open(ns.measured) as fh:
            data = json.load(fh)
        source = os.path.relpath(ns.measured, ROOT)
    else:
        from .grid import run_grid, select
        data = run_grid(select(ci=ns.ci, only=ns.only))
        source = "a fresh run of " + ("the CI subset" if ns.ci else "the selected configurations" if ns.only else "the whole grid")
        save = ns.save_measured or (os.path.join(RESULTS, "referee-measured.json") if not (ns.ci or ns.only) else None)
        if save:
            with open(save, "w") as fh:
                json.dump(data, fh, indent=1)
    text, s = render(data["configs"], source)
    os.makedirs(os.path.dirname(ns.out), exist_ok=True)
    with open(ns.out, "w") as fh:
        fh.write(text)
    print(text.splitlines()[4])
    return 1 if s["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
