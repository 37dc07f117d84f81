"""``memguard calibrate LOGS... --out site.yaml``: fit a site's physical constants from its own runs.

    memguard calibrate runs/*/ --out site.yaml                   # each directory one run (JSONL or Megatron logs)
    memguard calibrate logs/*.log --gpu A100-80GB --out a100.yaml  # Megatron logs with their argument tables
    memguard calibrate run1.log run2.log run3.log --config job.sh  # one configuration for every run

Fits only named, bounded site constants (CUDA context, NCCL buffers per communicator, the cuBLAS default and
Transformer Engine workspaces, the caching allocator's slack), each from the runs that show it, with a
leave-one-out check; prints before / after errors per run and per level; never fits modelled terms (runs they
leave off are listed as modelling gaps). From the step times Megatron logs (``elapsed time per iteration``) it
also fits `memguard plan`'s time constants (GEMM and attention efficiency, network Gb/s per GPU;
calibrate/timefit.py), written to the profile's ``time:`` section. Exit codes: 0 a profile with at least one fitted constant; 1 nothing
to change (the defaults hold, or the runs disagree); 2 bad input or too little data.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Sequence

from ..errors import ConfigError
from .main import EXIT_FITS, EXIT_PROBLEM, _Parser, file_name, path_text, add_target_options, load_raw, resolve_world


def build_parser() -> argparse.ArgumentParser:
    from ..calibrate import MIN_RUNS
    from ..estimator.site import SPEC
    from ..time_constants import TIME_SPEC

    p = _Parser(prog="memguard calibrate", description="Fit the site constants (CUDA context, NCCL buffers, workspaces, "
                "allocator slack) from runs' memory logs: memguard's JSONL or Megatron's own logs.")
    p.add_argument("logs", nargs="+", metavar="RUN", help="one run each: a log file, or a directory of one run's files "
                                                          "(a directory of directories: each subdirectory a run)")
    p.add_argument("--out", metavar="FILE", help="write the site profile here (YAML, schema memguard.site/1)")
    p.add_argument("--name", default="", help="a name for the site, kept in the profile")
    p.add_argument("--fit", metavar="NAMES", help="fit only these constants (comma-separated: " + ", ".join(SPEC)
                   + "; time constants: " + ", ".join(TIME_SPEC) + ")")
    p.add_argument("--min-runs", type=int, default=MIN_RUNS,
                   help=f"runs that must show a constant before it is fitted (default {MIN_RUNS}; at least 2)")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="the jobs' memory-relevant environment (CUBLAS_WORKSPACE_CONFIG, NCCL_BUFFSIZE, ...), which "
                        "Megatron's argument table does not show")
    p.add_argument("--device", choices=["gpu", "cpu"], default="gpu", help="cpu: runs on CPU (no GPU-only terms)")
    p.add_argument("--json", action="store_true", help="the results as JSON (schema memguard.calibrate/1)")
    add_target_options(p)
    for a in p._actions:   # (calibrate reads the GPU from the runs' files first: docs/calibrate.md)
        if a.dest == "gpu":
            a.help = ("GPU model from the table (memguard gpus); default: the one the runs' files name (nvidia-smi, "
                      "device names, OOM capacity, the JSONL's device), else H100-80GB")
    return p


def _pct(e: float | None) -> str:
    return "-" if e is None else f"{e:+.1%}"


def render(res, out: str | None) -> str:
    from ..calibrate.core import FOLDS, LOO_MAX, held_out_scheme
    from ..calibrate.model import METRIC_LABELS
    from ..estimator.site import SPEC
    from ..report.text import table

    runs = res.runs
    gpus = sorted({r.gpu.name for r in runs if r.gpu is not None}) or ["cpu"]
    sources = sorted({r.source for r in runs})
    lines = [f"memguard calibrate: {len(runs)} run(s), {sum(len(r.observations) for r in runs)} logged rank(s), "
             f"{', '.join(gpus)}; from {', '.join(sources)}", ""]
    rows = []
    levels = {lv.level: lv.summary() for lv in res.levels}
    for c in res.constants:
        s = SPEC[c.name]
        sm = levels[c.level]
        err = (f"{sm['median_error_before']:.2%} -> {sm['median_error_held_out']:.2%}"
               if c.fitted and sm["median_error_held_out"] is not None else "-")
        rows.append([c.name, c.level, str(c.runs), s.format(c.default), s.format(c.value) if c.fitted else "-", err,
                     "fitted" if c.fitted else f"{c.status}: {c.reason}"])
    # (leave-one-out up to LOO_MAX runs at a level, k-fold beyond: the scheme each level's held-out errors used)
    scheme = " / ".join(sorted({held_out_scheme(len(lv.runs)) for lv in res.levels})) or "leave-one-out"
    lines.append("constants (runs that show each; defaults -> fitted; the median run's error at its level, defaults -> "
                 f"{scheme}):")
    lines.append(table(rows, ["constant", "level", "runs", "default", "fitted", "error", "status"], right=(2, 3, 4, 5)))
    lines.append("")
    rows = []
    for lv in res.levels:
        sm = lv.summary()

        def mm(med, mx):
            return "-" if med is None else f"{med:.2%} / {mx:.2%}"
        rows.append([lv.level, METRIC_LABELS[lv.metric], str(sm["runs"]),
                     mm(sm["median_error_before"], sm["max_error_before"]),
                     mm(sm["median_error_fitted"], max(lv.fitted.values(), default=None)),
                     mm(sm["median_error_held_out"], sm["max_error_held_out"])])
    without = "without it" if scheme == "leave-one-out" else \
        f"without it (more than {LOO_MAX} runs: without its tenth of the runs, {FOLDS}-fold)"
    lines.append("levels (median / largest absolute error over runs: defaults, fitted on all runs, each run fitted "
                 f"{without}):")
    lines.append(table(rows, ["level", "compared with", "runs", "defaults", "fitted", scheme], right=(2, 3, 4, 5)))
    lines.append("")
    rows = []
    metrics = [m for m in ("steady", "peak_allocated", "peak_reserved", "device_used")
               if any(res.before[r.name][m] is not None for r in runs)]
    for r in runs:
        b, a = res.before[r.name], res.after[r.name]
        rows.append([os.path.basename(r.name.rstrip("/")) or r.name, str(len(r.observations))]
                    + [f"{_pct(b[m])} -> {_pct(a[m])}" for m in metrics])
    heads = {"steady": "after the step", "peak_allocated": "peak allocated", "peak_reserved": "peak reserved",
             "device_used": "device used"}
    lines.append("per run (median error, predicted / measured - 1: defaults -> calibrated):")
    lines.append(table(rows, ["run", "ranks", *[heads[m] for m in metrics]], right=range(1, 2 + len(metrics))))
    if res.gaps:
        lines.append("")
        lines.append("modelling gaps (terms memguard models and never fits; see docs/calibrate.md):")
        lines.extend(f"  {g.text()}" for g in res.gaps)
    notes = list(res.notes) + sorted({n for r in runs for n in r.notes})
    if notes:
        lines.append("")
        lines.extend(f"note: {n}" for n in notes)
    lines.append("")
    if res.fitted:
        lines.append(f"result: {len(res.fitted)} constant(s) fitted: " + ", ".join(
            f"{k} {SPEC[k].format(v)}" for k, v in res.fitted.items())
            + (f"; written to {out} (use it with --site-profile {out}, --memguard-profile {out} or MEMGUARD_PROFILE)"
               if out else "; give --out FILE to write the profile"))
    else:
        lines.append("result: no constant changed - the defaults hold for these runs, or the runs disagree (see the "
                     "status column); no profile written")
    return "\n".join(lines)


def render_time(tf, runs_without: list[str]) -> str:
    """The time constants' part of the output: fitted values, the runs' step-time errors before / after, the gaps."""
    from ..report.text import table
    from ..time_constants import TIME_SPEC

    lines = [f"time constants (memguard plan's step-time model; {len(tf.before)} run(s) with measured step times; "
             "runs that show each):"]
    rows = [[c.name, str(c.runs), TIME_SPEC[c.name].format(c.default), TIME_SPEC[c.name].format(c.value) if c.fitted
             else "-", "fitted" if c.fitted else f"{c.status}: {c.reason}"] for c in tf.constants]
    lines.append(table(rows, ["constant", "runs", "default", "fitted", "status"], right=(1, 2, 3)))
    lines.append("")
    def rel(r: float) -> str:      # (the fit's residual is log(measured / predicted); shown as memory's are)
        return f"{math.exp(-r) - 1:+.1%}"
    lines.append(f"per run (step time, predicted / measured - 1: defaults -> calibrated; median |log(measured / "
                 f"predicted)| {tf.median_before:.3f} -> {tf.median_after:.3f}):")
    rows = [[os.path.basename(n.rstrip("/")) or n, tf.labels.get(n, ""), f"{rel(tf.before[n])} -> {rel(tf.after[n])}"]
            for n in tf.before]
    lines.append(table(rows, ["run", "layout", "step time"], right=(2,)))
    if tf.gaps:
        from ..calibrate.timefit import GAP
        lines.append("")
        lines.append(f"modelling gaps (step time off by more than {GAP:.0%} after calibration: a cost the step-time "
                     "model does not have, not a constant; docs/planner.md section 5.2):")
        lines.append("  " + ", ".join(f"{os.path.basename(n.rstrip('/')) or n} {rel(tf.after[n])}" for n in tf.gaps))
    if runs_without:
        lines.append("")
        lines.extend(f"note: {n}" for n in runs_without)
    return "\n".join(lines)


def fit_times(runs, base_time: dict, fit_only: list[str] | None, min_runs: int, gpus_per_node: int | None):
    """(the time fit or None, notes): the runs with Megatron's iteration times against the planner's model of each."""
    from ..calibrate.timefit import fit_time_constants
    from ..calibrate.timeruns import timed_run
    from ..time_constants import TIME_CONSTANTS

    notes: list[str] = []
    timed = []
    for r in runs:
        if not r.iteration_times or r.raw is None or r.gpu is None:
            continue
        t, why = timed_run(r.name, r.raw, r.gpu, r.layout.world_size, r.iteration_times, gpus_per_node)
        if why:
            notes.append(why)
        if t is not None:
            timed.append(t)
    if not timed:
        return None, notes
    # (the GPU assumed or read from the files: the time constants are that GPU's, so the output says so again)
    notes.extend(sorted({n for r in runs if r.iteration_times for n in r.notes if n.startswith("GPU ")}))
    if len(timed) < min_runs:
        notes.append(f"time constants: {len(timed)} run(s) with measured step times; at least {min_runs} needed")
        return None, notes
    gpu = timed and next(r.gpu for r in runs if r.iteration_times and r.gpu is not None)
    defaults = {c.name: base_time.get(c.name, c.default(gpu)) for c in TIME_CONSTANTS}
    asked = None if fit_only is None else [n for n in fit_only if n in defaults]
    return fit_time_constants(timed, defaults, min_runs=min_runs, fit_only=asked), notes


def profile_fit_section(res) -> dict:
    return {"runs": len(res.runs), "ranks": sum(len(r.observations) for r in res.runs),
            "levels": {lv.level: {k: (round(v, 5) if isinstance(v, float) else v) for k, v in lv.summary().items()
                                  if k != "level"} for lv in res.levels if lv.accepted}}


def run(own_args: Sequence[str], flags: list[str]) -> int:
    try:
        ns = build_parser().parse_args(list(own_args))
    except SystemExit as e:
        return int(e.code or 0)
    from ..calibrate import calibrate
    from ..calibrate.runs import read_runs
    from ..gpus import lookup_gpu
    from ..site_profile import dump_site_profile, name_problem
    from .report import job_env

    if ns.min_runs < 2:
        raise ConfigError("--min-runs", f"must be at least 2 (a leave-one-out check needs two runs), got {ns.min_runs}")
    fit_only = [x.strip() for x in ns.fit.split(",") if x.strip()] if ns.fit else None
    if ns.name and name_problem(ns.name):
        raise ConfigError("--name", name_problem(ns.name))
    file_name(ns.out, "--out")
    if ns.out:
        parent = os.path.dirname(os.path.abspath(ns.out))
        if not os.path.isdir(parent):
            raise ConfigError("--out", f"directory {parent} does not exist")
    given = bool(ns.config or ns.model or flags or ns.set)
    raw = load_raw(ns, flags) if given else None
    runs = read_runs(ns.logs, gpu=lookup_gpu(ns.gpu) if ns.gpu is not None else None, device=ns.device, raw=raw,
                     env=job_env(ns.env), resolve_kw={"world_size": resolve_world(ns),
                                                     "megatron_version": ns.megatron_version,
                                                     "vocab_size": ns.vocab_size})
    from ..calibrate.core import TooLittleData
    from ..estimator.site import SPEC
    from ..site_profile import site_from
    from ..time_constants import TIME_SPEC

    unknown = [n for n in fit_only or () if n not in SPEC and n not in TIME_SPEC]
    if unknown:
        raise ConfigError("--fit", f"unknown constant(s) {', '.join(unknown)} (known: {', '.join([*SPEC, *TIME_SPEC])})")
    prof = site_from(file_name(getattr(ns, "site_profile", None), "--site-profile"))
    base = prof.constants if prof is not None else None
    gpus = sorted({r.gpu.name for r in runs if r.gpu is not None})
    base_time = dict(prof.time) if prof is not None and prof.time and (not gpus or prof.gpu == gpus[0]) else {}
    mem_only = None if fit_only is None else [n for n in fit_only if n in SPEC]
    mem_runs = [r for r in runs if r.observations]
    tf, time_notes = fit_times(runs, base_time, fit_only, ns.min_runs, ns.nproc_per_node) if len(gpus) <= 1 else (None, [])
    res = None
    if mem_runs and mem_only != []:
        try:
            res = calibrate(mem_runs, **({"base": base} if base is not None else {}), fit_only=mem_only,
                            min_runs=ns.min_runs)
        except TooLittleData:
            if tf is None:
                raise
            time_notes.append("memory constants: too little data in the runs' memory lines (see docs/calibrate.md)")
    elif tf is None:
        raise TooLittleData(f"too little data: {len(runs)} run(s) with " + ("no memory lines and " if not mem_runs else "")
                            + f"fewer than {ns.min_runs} measured step times ('elapsed time per iteration (ms)' after "
                            "the first logged iteration) that the planner can time"
                            + (f" ({len(time_notes)} not used; first: {time_notes[0]})" if time_notes else ""))
    mem_fitted = res.fitted if res is not None else {}
    time_fitted = tf.fitted if tf is not None else {}
    if ns.out and (mem_fitted or time_fitted):
        text = dump_site_profile({**(base.changed() if base is not None else {}), **mem_fitted}, name=ns.name,
                                 gpu=gpus[0] if len(gpus) == 1 else None,
                                 fit={**(profile_fit_section(res) if res is not None else {}),
                                      **({"time": {"runs": len(tf.before),
                                                   "median_abs_log_error": [round(tf.median_before, 4),
                                                                            round(tf.median_after, 4)]}}
                                         if time_fitted else {})},
                                 time={**base_time, **time_fitted} if len(gpus) == 1 else None)
        from ..files import open_output
        try:
            with open_output(ns.out) as f:
                f.write(text)
        except OSError as e:
            raise ConfigError("--out", f"cannot write {path_text(ns.out)}: {e.strerror or e}") from None
    written = bool(ns.out and (mem_fitted or time_fitted))
    if ns.json:
        doc = res.to_dict() if res is not None else {"schema": "memguard.calibrate/1", "fitted": {}}
        doc["time"] = tf.to_dict() if tf is not None else None
        doc["time_fitted"] = time_fitted
        doc["profile"] = ns.out if written else None
        doc.setdefault("notes", [])
        doc["notes"] = list(doc["notes"]) + time_notes
        print(json.dumps(doc, indent=2))
    else:
        parts = [render(res, ns.out if mem_fitted else None)] if res is not None else []
        if tf is not None or time_notes:
            parts.append(render_time(tf, time_notes) if tf is not None else "\n".join(f"note: {n}" for n in time_notes))
        if time_fitted:
            parts.append("result: time constant(s) fitted: " + ", ".join(
                f"{k} {TIME_SPEC[k].format(v)}" for k, v in time_fitted.items())
                + (f"; written to {ns.out} (memguard plan --site-profile {ns.out} uses them; its options win)" if ns.out
                   else "; give --out FILE to write the profile"))
        elif tf is not None:
            parts.append("result: no time constant changed (see the status column)")
        print("\n\n".join(parts))
    if written:
        print(f"memguard: site profile written to {path_text(ns.out)}", file=sys.stderr)
    return EXIT_FITS if (mem_fitted or time_fitted) else EXIT_PROBLEM



__all__ = ["run", "build_parser", "render"]
