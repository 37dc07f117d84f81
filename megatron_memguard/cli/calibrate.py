"""``memguard calibrate LOGS... --out site.yaml``: fit a site's physical constants from its own runs.

    memguard calibrate runs/*/ --out site.yaml                   # each directory one run (JSONL or Megatron logs)
    memguard calibrate logs/*.log --gpu A100-80GB --out a100.yaml  # Megatron logs with their argument tables
    memguard calibrate run1.log run2.log run3.log --config job.sh  # one configuration for every run

Fits only named, bounded site constants (CUDA context, NCCL buffers per communicator, the cuBLAS default and
Transformer Engine workspaces, the caching allocator's slack), each from the runs that show it, with a
leave-one-out check; prints before / after errors per run and per level; never fits modelled terms (runs they
leave off are listed as modelling gaps). Exit codes: 0 a profile with at least one fitted constant; 1 nothing
to change (the defaults hold, or the runs disagree); 2 bad input or too little data.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Sequence

from ..errors import ConfigError
from .main import EXIT_FITS, EXIT_PROBLEM, _Parser, file_name, path_text, add_target_options, load_raw, resolve_world, target_site


def build_parser() -> argparse.ArgumentParser:
    from ..calibrate import MIN_RUNS
    from ..estimator.site import SPEC

    p = _Parser(prog="memguard calibrate", description="Fit the site constants (CUDA context, NCCL buffers, workspaces, "
                "allocator slack) from runs' memory logs: memguard's JSONL or Megatron's own logs.")
    p.add_argument("logs", nargs="+", metavar="RUN", help="one run each: a log file, or a directory of one run's files "
                                                          "(a directory of directories: each subdirectory a run)")
    p.add_argument("--out", metavar="FILE", help="write the site profile here (YAML, schema memguard.site/1)")
    p.add_argument("--name", default="", help="a name for the site, kept in the profile")
    p.add_argument("--fit", metavar="NAMES", help="fit only these constants (comma-separated: " + ", ".join(SPEC) + ")")
    p.add_argument("--min-runs", type=int, default=MIN_RUNS,
                   help=f"runs that must show a constant before it is fitted (default {MIN_RUNS}; at least 2)")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="the jobs' memory-relevant environment (CUBLAS_WORKSPACE_CONFIG, NCCL_BUFFSIZE, ...), which "
                        "Megatron's argument table does not show")
    p.add_argument("--device", choices=["gpu", "cpu"], default="gpu", help="cpu: runs on CPU (no GPU-only terms)")
    p.add_argument("--json", action="store_true", help="the results as JSON (schema memguard.calibrate/1)")
    add_target_options(p)
    return p


def _pct(e: float | None) -> str:
    return "-" if e is None else f"{e:+.1%}"


def render(res, out: str | None) -> str:
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
    lines.append("constants (runs that show each; defaults -> fitted; the median run's error at its level, defaults -> "
                 "leave-one-out):")
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
    lines.append("levels (median / largest absolute error over runs: defaults, fitted on all runs, each run fitted "
                 "without it):")
    lines.append(table(rows, ["level", "compared with", "runs", "defaults", "fitted", "leave-one-out"], right=(2, 3, 4, 5)))
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
    from ..site_profile import dump_site_profile
    from .report import job_env

    if ns.min_runs < 2:
        raise ConfigError("--min-runs", f"must be at least 2 (a leave-one-out check needs two runs), got {ns.min_runs}")
    fit_only = [x.strip() for x in ns.fit.split(",") if x.strip()] if ns.fit else None
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
    base = target_site(ns)
    res = calibrate(runs, **({"base": base} if base is not None else {}), fit_only=fit_only, min_runs=ns.min_runs)
    if ns.out and res.fitted:
        gpus = sorted({r.gpu.name for r in runs if r.gpu is not None})
        text = dump_site_profile({**(base.changed() if base is not None else {}), **res.fitted}, name=ns.name,
                                 gpu=gpus[0] if len(gpus) == 1 else None, fit=profile_fit_section(res))
        from ..files import open_output
        try:
            with open_output(ns.out) as f:
                f.write(text)
        except OSError as e:
            raise ConfigError("--out", f"cannot write {path_text(ns.out)}: {e.strerror or e}") from None
    if ns.json:
        doc = res.to_dict()
        doc["profile"] = ns.out if ns.out and res.fitted else None
        print(json.dumps(doc, indent=2))
    else:
        print(render(res, ns.out))
    if ns.out and res.fitted:
        print(f"memguard: site profile written to {path_text(ns.out)}", file=sys.stderr)
    return EXIT_FITS if res.fitted else EXIT_PROBLEM


__all__ = ["run", "build_parser", "render"]
