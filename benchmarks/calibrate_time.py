"""Learning the planner's time constants from a site's runs, checked on measured sweeps.

    python benchmarks/calibrate_time.py [--write]

The measured sweeps of ``shared/groundtruth/throughput`` (read as benchmarks/planner_quality.py reads them; never
copied) stand for a site's own runs: Fujii et al.'s Megatron-LM sweeps on ABCI's A100-40GB nodes (one sweep per
GPU count, 8-256; measured step = GBS x seq x the model FLOPs per token / (GPUs x TFLOP/s per GPU)), and Hagemann
et al.'s sheets on A100-80GB (one per model, sequence and GPU count; the sheet's mean step time, ``avg_step_time_s``,
of the FlashAttention-2 + fused RMSNorm rows). Per family, each sweep is held out in turn and the constants are
fitted (``memguard calibrate``'s time fit, megatron_memguard/calibrate/timefit.py) on the family's OTHER sweeps
only: the same cluster, never the held-out sweep. Printed per held-out sweep:

* the step-time error, median |log(measured / predicted)| over its layouts that ran, with the defaults and with
  the constants fitted on the other sweeps;
* the ranking figures of `memguard plan`'s time rule (first choice's measured throughput relative to the best,
  Spearman) with the defaults and calibrated (benchmarks/planner_quality.py's ``quality``).

Then the user story: fit on the Megatron sweeps at 8-32 GPUs, predict those at 64-256. ``--write`` writes the
tables to benchmarks/results/calibrate-time.md. The default planner (no profile) is not touched.
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import math
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import planner_quality as pq  # noqa: E402
from megatron_memguard.calibrate.timefit import TimedRun, TimeFit, fit_time_constants  # noqa: E402
from megatron_memguard.planner import Cluster, Planner  # noqa: E402
from megatron_memguard.planner.timing import TimeModel  # noqa: E402
from megatron_memguard.readers.megatron_flags import parse_megatron_flags  # noqa: E402
from megatron_memguard.time_constants import TIME_CONSTANTS, with_speeds  # noqa: E402

RESULTS = os.path.join(ROOT, "benchmarks", "results", "calibrate-time.md")


def hagemann_steps(path: str = pq.HAGEMANN_CSV) -> dict[tuple, float]:
    """(model, seq, world, tp, pp, mbs, sp, recompute) -> the mean measured step time (s) of the cell's runs."""
    cells: dict[tuple, list[float]] = {}
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            if r["kernel"] != pq.HAGEMANN_KERNEL or r["status"] != "ok" or not r["avg_step_time_s"]:
                continue
            tp = int(r["tp"])
            key = (r["model"], int(r["seq_len"]), int(r["world_size"]), tp, int(r["pp"]), int(r["micro_batch_size"]),
                   r["sequence_parallel"] == "1" and tp > 1,
                   "full" if r["activation_checkpointing"] == "every_layer" else "none")
            cells.setdefault(key, []).append(float(r["avg_step_time_s"]))
    return {k: statistics.fmean(v) for k, v in cells.items()}


def sweep_gpu(sweep: pq.Sweep):
    return pq.planner_for(sweep).cluster.gpu


def defaults_of(sweep: pq.Sweep) -> dict[str, float]:
    gpu = sweep_gpu(sweep)
    return {c.name: c.default(gpu) for c in TIME_CONSTANTS}


def timed_runs(sweep: pq.Sweep, steps: dict[tuple, float]) -> list[TimedRun]:
    """The sweep's layouts that ran, each with its measured step and the planner's step as a function of the
    time constants."""
    p = pq.planner_for(sweep)
    model = sweep.name.split()[0]
    models: dict[tuple, TimeModel] = {}

    def model_at(values) -> TimeModel:
        key = tuple(sorted(values.items()))
        if key not in models:
            models[key] = TimeModel(p.shape, dataclasses.replace(p.cluster, gpu=with_speeds(p.cluster.gpu, values)),
                                    p.gbs, tp_overlap=sweep.tp_overlap)
        return models[key]

    out = []
    for s in pq.score(sweep, p):
        r = s.run
        if r.failed or s.candidate is None:
            continue
        if sweep.family == "fujii":
            measured = sweep.gbs * sweep.seq * p.timer.flops_per_token / (sweep.world * r.throughput * 1e12)
        else:
            measured = steps.get((model, sweep.seq, sweep.world, r.tp, r.pp, r.mbs, r.sp, r.recompute))
            if measured is None:
                continue
        c = s.candidate
        out.append(TimedRun(f"{sweep.name}: {r.label}", measured, lambda v, c=c: model_at(v).step_time(c).seconds,
                            r.label))
    return out


def calibrated_planner(sweep: pq.Sweep, values: dict[str, float]) -> Planner:
    p = pq.planner_for(sweep)
    cl = p.cluster
    cluster = Cluster(gpus=cl.gpus, gpus_per_node=cl.gpus_per_node, gpu=with_speeds(cl.gpu, values),
                      nvlink_domain=cl.nvlink_domain, gpu_memory_bytes=cl.gpu_memory_bytes)
    return Planner(parse_megatron_flags(list(sweep.flags)), cluster, seq_length=sweep.seq, global_batch_size=sweep.gbs,
                   megatron_version=sweep.megatron_version, tp_overlap=sweep.tp_overlap)


def median_abs_log(runs: list[TimedRun], values: dict[str, float]) -> float:
    return statistics.median(abs(math.log(r.measured / r.predict(values))) for r in runs)


def fitted_text(fit: TimeFit) -> str:
    spec = {c.name: c for c in TIME_CONSTANTS}
    return ", ".join(f"{n} {spec[n].format(v)}" for n, v in fit.fitted.items()) or "none (defaults)"


def why_kept(fit: TimeFit) -> str:
    return "; ".join(f"{c.name}: {c.status}" for c in fit.constants if not c.fitted)


@dataclasses.dataclass(frozen=True)
class HeldOut:
    sweep: pq.Sweep
    fit: TimeFit
    err_default: float
    err_calibrated: float
    q_default: pq.Quality
    q_calibrated: pq.Quality


def held_out(sweep: pq.Sweep, train: list[TimedRun], test: list[TimedRun]) -> HeldOut:
    d = defaults_of(sweep)
    fit = fit_time_constants(train, d)
    values = {**d, **fit.fitted}
    q0 = pq.quality(sweep, pq.score(sweep), "time")
    q1 = pq.quality(sweep, pq.score(sweep, calibrated_planner(sweep, values)), "time") if fit.fitted else q0
    return HeldOut(sweep, fit, median_abs_log(test, d), median_abs_log(test, values), q0, q1)


def leave_one_sweep_out(family: str, sweeps: list[pq.Sweep], steps: dict[tuple, float]) -> list[HeldOut]:
    runs = {sw.name: timed_runs(sw, steps) for sw in sweeps}
    return [held_out(sw, [r for o in sweeps if o.name != sw.name for r in runs[o.name]], runs[sw.name])
            for sw in sweeps]


def table(rows: list[HeldOut]) -> str:
    lines = ["| held-out sweep | layouts | fitted on the other sweeps | step error: defaults | calibrated "
             "| first choice rel.: defaults | calibrated | Spearman: defaults | calibrated |",
             "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for h in rows:
        lines.append(f"| {h.sweep.name} | {h.q_default.ran} | {fitted_text(h.fit)} | {h.err_default:.1%} | "
                     f"{h.err_calibrated:.1%} | {h.q_default.first_rel:.1%} | {h.q_calibrated.first_rel:.1%} | "
                     f"{pq._fmt_rho(h.q_default.spearman)} | {pq._fmt_rho(h.q_calibrated.spearman)} |")
    med = statistics.median
    lines.append(f"| **median** | | | {med(h.err_default for h in rows):.1%} | {med(h.err_calibrated for h in rows):.1%} "
                 f"| {sum(h.q_default.first_ok for h in rows)} of {len(rows)} within 3% | "
                 f"{sum(h.q_calibrated.first_ok for h in rows)} of {len(rows)} | "
                 f"{pq._fmt_rho(med(h.q_default.spearman for h in rows))} | "
                 f"{pq._fmt_rho(med(h.q_calibrated.spearman for h in rows))} |")
    kept = sorted({why_kept(h.fit) for h in rows})
    lines.append("")
    lines.append("Kept at their defaults (per fit): " + " / ".join(k for k in kept if k))
    return "\n".join(lines)


def user_story(sweeps: list[pq.Sweep], steps: dict[tuple, float], small: int = 32) -> str:
    train_sw = [s for s in sweeps if s.world <= small]
    runs = [r for s in train_sw for r in timed_runs(s, steps)]
    d = defaults_of(sweeps[0])
    fit = fit_time_constants(runs, d)
    values = {**d, **fit.fitted}
    lines = [f"Fitted on the {len(runs)} layouts of the Megatron sweeps at {', '.join(str(s.world) for s in train_sw)} "
             f"GPUs: {fitted_text(fit)} (kept: {why_kept(fit)}); median error on them "
             f"{fit.median_before:.1%} -> {fit.median_after:.1%}; modelling gaps (off by more than 10% after the fit): "
             f"{len(fit.gaps)} of {len(runs)}.", "",
             "| predicted sweep | layouts | step error: defaults | calibrated | first choice rel.: defaults | calibrated "
             "| Spearman: defaults | calibrated |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for s in sweeps:
        if s.world <= small:
            continue
        test = timed_runs(s, steps)
        q0 = pq.quality(s, pq.score(s), "time")
        q1 = pq.quality(s, pq.score(s, calibrated_planner(s, values)), "time") if fit.fitted else q0
        lines.append(f"| {s.name} | {len(test)} | {median_abs_log(test, d):.1%} | {median_abs_log(test, values):.1%} | "
                     f"{q0.first_rel:.1%} | {q1.first_rel:.1%} | {pq._fmt_rho(q0.spearman)} | {pq._fmt_rho(q1.spearman)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--write", action="store_true", help=f"write {os.path.relpath(RESULTS, ROOT)}")
    ap.add_argument("--family", choices=("fujii", "hagemann"), help="only this family")
    ns = ap.parse_args(argv)
    steps = hagemann_steps()
    parts = []
    for fam, sweeps, title in (("fujii", pq.fujii_sweeps(), "Megatron-LM sweeps (Fujii et al. draft, A100-40GB, ABCI)"),
                               ("hagemann", pq.hagemann_sweeps(), "Hagemann et al. 2023 sheets (A100-80GB)")):
        if ns.family not in (None, fam):
            continue
        parts.append(f"### {title}: leave one sweep out\n\n" + table(leave_one_sweep_out(fam, sweeps, steps)))
        if fam == "fujii":
            parts.append("### The user story: calibrate on the small Megatron runs (8-32 GPUs), plan 64-256\n\n"
                         + user_story(sweeps, steps))
    text = "\n\n".join(parts)
    print(text)
    if ns.write:
        with open(RESULTS, "w") as f:
            f.write("# Time constants learned from a site's runs, against measured sweeps\n\n"
                    "`python benchmarks/calibrate_time.py --write` (the docstring says what is fitted and held out; "
                    "docs/planner.md section 5.2, round 11).\n\nStep error: median |log(measured / predicted step)| over "
                    "the held-out sweep's layouts that ran. First choice rel.: the measured throughput of `memguard "
                    "plan`'s first choice (time rule, 4% tie window) over the sweep's best.\n\n" + text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
