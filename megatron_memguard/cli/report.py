"""``memguard report LOGS...``: predicted vs actual memory of a run, from memguard's runtime JSONL files or
from Megatron's own training logs.

    memguard report /path/to/memguard-logs                    # summary tables on the terminal
    memguard report /path/to/memguard-logs --out report.html  # one offline HTML page (figure + tables)
    memguard report /path/to/memguard-logs --out report.png   # the figure with the error table
    memguard report train.log [rank*.log ...]                  # Megatron's stdout / stderr of any ranks
    memguard report logs/ --config run.sh --gpu A100-80GB      # the configuration from a launch script

A directory with ``memguard-rankNNNNN.jsonl`` files (the hook's / callbacks' ``--memguard-log-dir``) is read
as memguard's own log, with the predictions it recorded. Any other log is read as Megatron's output: the
``[Rank N] (after K iterations) memory (MB) | ...`` lines of ``report_memory``, compared with the
prediction for each rank's pipeline stage; the configuration comes from ``--config`` / flags after ``--``,
else from the argument table Megatron prints at start-up; the GPU from --gpu, else from what the log's own lines
say (calibrate/gpu_evidence.py, as ``memguard calibrate`` reads it), else H100-80GB. A CUDA out-of-memory error in
the log gets its forensics: the stage and term the estimate blames and how far off it was.

Exit codes: 0 every rank within its prediction + tolerance; 1 a rank exceeded it or ran out of
memory; 2 bad input (missing or empty directory, a malformed line, a log without memory lines).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Sequence

from ..errors import ConfigError
from .main import (EXIT_BAD_INPUT, file_name, path_text, EXIT_FITS, EXIT_PROBLEM, _Parser, add_target_options, load_raw, resolve_world,
                   target_gpu, target_site)

FORMATS = ("auto", "jsonl", "megatron")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="memguard report", description="Predicted vs actual peak memory per rank of a run, from the "
                "memguard-rankNNNNN.jsonl files the Megatron hook (--memguard-log-dir) or the callbacks write, or from "
                "Megatron's own training logs.")
    p.add_argument("logdir", nargs="+", metavar="LOGS", help="the run's log directory, its JSONL files, or Megatron log "
                                                              "files / directories")
    p.add_argument("--out", metavar="FILE", help="write the report: FILE.html (one offline page), FILE.png or FILE.svg "
                                                 "(needs matplotlib: pip install 'megatron-memguard[plot]')")
    p.add_argument("--format", choices=FORMATS, default="auto",
                   help="jsonl: memguard's runtime files; megatron: Megatron's text logs; auto (default): jsonl when the "
                        "logs hold memguard-rank*.jsonl files")
    p.add_argument("--run", choices=("last", "all"), default="last",
                   help="a restarted job appends to its JSONL files: show the last run (default) or all of them")
    p.add_argument("--all-ranks", action="store_true", help="list every rank on the terminal (default: at most 32)")
    p.add_argument("--skip-bad-lines", action="store_true", help="skip malformed JSONL lines with a warning instead of failing")
    p.add_argument("--json", action="store_true", help="the numbers as JSON (schema memguard.report/1)")
    m = p.add_argument_group("Megatron logs (the prediction)")
    m.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="the job's environment where it changes memory (CUBLAS_WORKSPACE_CONFIG, NCCL_BUFFSIZE, ...); "
                        "Megatron's argument table does not show it")
    m.add_argument("--device", choices=["gpu", "cpu"], default="gpu", help="cpu: a run on CPU (no GPU-only terms)")
    add_target_options(p)
    return p


def is_jsonl_run(paths: Sequence[str]) -> bool:
    """Whether ``paths`` are memguard's runtime files (a .jsonl file, or a directory holding some)."""
    import glob
    for p in paths:
        if os.path.isdir(p):
            if glob.glob(os.path.join(p, "memguard-rank*.jsonl")) or glob.glob(os.path.join(p, "*.jsonl")):
                return True
        elif p.endswith(".jsonl"):
            return True
    return False


def job_env(pairs: Sequence[str]) -> dict[str, str]:
    env = {}
    for kv in pairs:
        k, eq, v = kv.partition("=")
        if not eq or not k:
            raise ConfigError("--env", f"expects KEY=VALUE, got {kv!r}")
        env[k] = v
    return env


def megatron_era(ns: argparse.Namespace, log: Any) -> tuple[str | None, str]:
    """(the Megatron version whose rules apply, why): --megatron-version, else what the log's argument
    table tells (report/megatron_era.py), else memguard's default."""
    from ..report.megatron_era import era_of_table
    from ..resolve import DEFAULT_MEGATRON_VERSION

    if ns.megatron_version:
        return ns.megatron_version, f"megatron-core {ns.megatron_version} rules (--megatron-version)"
    guess = era_of_table(log.args, log.args_complete)
    if guess.version is not None:
        return guess.version, (f"megatron-core {guess.version} rules assumed: {guess.reason} "
                               "(--megatron-version overrides)")
    return None, (f"megatron-core {DEFAULT_MEGATRON_VERSION} rules assumed (the default): {guess.reason}; "
                  "give --megatron-version for an older run")


def run_gpu(ns: argparse.Namespace, evidence: Sequence[Any], where: str) -> tuple[Any, Any, str]:
    """(GPU table entry, --gpu-memory in bytes, how the GPU was found) for a run whose files give ``evidence``
    (calibrate/gpu_evidence.py, as ``memguard calibrate`` reads it): --gpu when given (a ReaderError naming the
    file when the files contradict it), else the one entry the files name, else the default (H100-80GB) when the
    files name nothing or fit it among others; --gpu-memory alone keeps its figure."""
    from ..calibrate.gpu_evidence import FALLBACK, infer_gpu
    from ..errors import ReaderError
    from ..gpus import GPUS

    gpu, mem = target_gpu(ns)
    if ns.gpu is not None:
        infer_gpu(where, evidence, gpu)         # (raises on a contradiction)
        return gpu, mem, ""
    if ns.gpu_memory is not None or not evidence:
        return gpu, mem, ""
    found = infer_gpu(where, evidence, None)
    if found.gpu is not None:
        return found.gpu, mem, found.note
    if FALLBACK in found.fits:
        return GPUS[FALLBACK], mem, f"{found.said} fits {' or '.join(sorted(found.fits))}; {FALLBACK} assumed"
    raise ReaderError(f"{where}: {found.said} fits {' or '.join(sorted(found.fits))}, not one GPU; give --gpu")


def _bridge_run(ns: argparse.Namespace, flags: list[str], mlog: Any) -> Any:
    """A Megatron-Bridge log (its memory reports in GB, report/bridge_log.py): its reports join ``mlog`` as
    memory lines; the configuration (with the world size) from --config / flags, else the run's run_config.yaml
    (calibrate/bridge_runs.py). None: not a Bridge log."""
    from ..calibrate.bridge_runs import bridge_config
    from ..report.bridge_log import as_memory_lines, read_bridge_logs

    blog = read_bridge_logs(ns.logdir)
    lines = as_memory_lines(blog)
    if not lines:
        return None
    mlog.memory.extend(lines)
    mlog.notes.extend(blog.notes)
    given = bool(ns.config or ns.model or flags or ns.set)
    raw, _ = bridge_config(ns.logdir[0], blog, load_raw(ns, flags) if given else None, None, resolve_world(ns))
    return raw


def megatron_prediction(ns: argparse.Namespace, flags: list[str], log: Any,
                        bridge_raw: Any = None) -> tuple[Any, Any, bool, Any]:
    """(raw config, estimate at DP rank 0, tp-pp-dp rank order, the estimate at an (optimizer rank, expert
    optimizer rank) position) for a Megatron log: the configuration from --config / --model / flags, else from
    the log's argument table; ``bridge_raw``: a Megatron-Bridge run's (:func:`_bridge_run`)."""
    import dataclasses

    from ..estimator import estimate
    from ..report.megatron_run import raw_from_log, tp_pp_dp_mapping
    from ..resolve import resolve

    given = bool(ns.config or ns.model or flags or ns.set)
    raw = bridge_raw if bridge_raw is not None else load_raw(ns, flags) if given else raw_from_log(log)
    env = job_env(ns.env)
    if env:
        raw = dataclasses.replace(raw, env={**raw.env, **env})
    version, why = megatron_era(ns, log)
    log.notes.append(why)
    layout = resolve(raw, world_size=resolve_world(ns) or raw.world_size, megatron_version=version,
                     vocab_size=ns.vocab_size)
    from ..calibrate.gpu_evidence import megatron_evidence
    gpu, mem, found = (run_gpu(ns, megatron_evidence(log), ", ".join(ns.logdir)) if ns.device == "gpu"
                       else (*target_gpu(ns), ""))
    if found:
        log.notes.append(found)
    site = target_site(ns)
    est = estimate(layout, device=ns.device, gpu=gpu, gpu_memory=mem, threshold=ns.threshold, dp_rank=0, site=site)

    def at(dp_rank: int, expert_dp_rank: int | None) -> Any:
        return estimate(layout, device=ns.device, gpu=gpu, gpu_memory=mem, threshold=ns.threshold, dp_rank=dp_rank,
                        site=site, expert_dp_rank=expert_dp_rank)
    return raw, est, tp_pp_dp_mapping(raw), at


def run(own_args: Sequence[str], flags: list[str]) -> int:
    try:
        ns = build_parser().parse_args(list(own_args))
    except SystemExit as e:          # --help (0) or a usage error, already printed (2)
        return int(e.code or 0)
    from ..report.runreport import figure_table, metrics_of, render_text, report_html, to_json, verdict

    fmt, stream = None, None
    file_name(ns.out, "--out")
    if ns.out:
        from ..report.plots import open_early, output_format, require_matplotlib
        fmt = output_format(ns.out, "--out")
        stream = open_early(ns.out, fmt, "--out")   # a named pipe: opened now (nobody reading it: refused at once)
        require_matplotlib("--out")        # before reading: fail fast, one line

    def warn(msg: str) -> None:
        print(f"memguard: warning: {msg}", file=sys.stderr)

    kind = ns.format if ns.format != "auto" else ("jsonl" if is_jsonl_run(ns.logdir) else "megatron")
    forensics: list[Any] = []
    if kind == "jsonl":
        if flags:
            raise ConfigError("--", f"memguard report takes no flags after -- for memguard's JSONL files (got "
                                    f"{' '.join(flags)}); the files carry their predictions")
        _no_prediction_options(ns)
        from ..report.runlog import read_run
        log = read_run(ns.logdir, run=ns.run, skip_bad_lines=ns.skip_bad_lines, warn=warn)
        log.notes.extend(_jsonl_gpu(ns, log))
    else:
        from ..report.megatron_log import read_megatron_logs
        from ..report.megatron_run import megatron_runlog, rank_position
        from ..report.oom import blame

        mlog = read_megatron_logs(ns.logdir)
        bridge_raw = _bridge_run(ns, flags, mlog) if not mlog.memory else None
        if not mlog.memory and not mlog.ooms:
            megatron_runlog(mlog, None)    # the one-line error naming the files
        raw, est, tp_pp_dp, at = megatron_prediction(ns, flags, mlog, bridge_raw)
        for ev in mlog.ooms:
            pp = mlog.memguard_oom_ranks.get(ev.rank) if ev.rank is not None else None
            ev_est = est
            if ev.rank is not None and ev.rank < est.layout.world_size:
                pos = rank_position(ev.rank, est.layout, tp_pp_dp)
                pp = pos.pp if pp is None else pp
                if est.layout.use_distributed_optimizer:     # the failing rank's own optimizer slices
                    ev_est = at(pos.optimizer_rank, pos.expert_optimizer_rank)
            started = bool(mlog.iterations) or any(m.iteration for m in mlog.memory)
            forensics.append(blame(ev, ev_est, pp, started))
        if not mlog.memory:      # only an out-of-memory error: the forensics are the report
            return _oom_only(ns, mlog, forensics)
        log = megatron_runlog(mlog, est, tp_pp_dp, at=at)
        named = any(n.startswith("GPU ") for n in mlog.notes)     # (run_gpu's note: the files named it)
        where = "a CPU run" if ns.device == "cpu" else (
            f"{est.gpu or 'GPU'}" + ("" if ns.gpu or ns.gpu_memory or named
                                     else " (the default; --gpu names the run's GPU)"))
        log.notes.append(f"prediction from {raw.source}; {where}")
    if ns.json:
        doc = to_json(log)
        if kind == "megatron":
            doc["oom_forensics"] = [f.to_dict() for f in forensics]
        print(json.dumps(doc, indent=2))
    else:
        print(render_text(log, all_ranks=ns.all_ranks))
        for f in forensics:
            print()
            print("\n".join(f.lines()))
    if ns.out:
        from ..report.plots import report_figure, write
        metrics = [m for m in metrics_of(log) if m != "device_used"] or ["max_allocated"]
        plot = report_figure(log, metrics=metrics, table_rows=None if fmt == "html" else figure_table(log))
        write(plot, ns.out, fmt, lambda p: report_html(log, p), "--out", stream=stream)
        print(f"memguard: report written to {path_text(ns.out)}", file=sys.stderr)
    return EXIT_FITS if verdict(log, metrics_of(log))["ok"] and not forensics else EXIT_PROBLEM


# the options that shape a Megatron log's prediction (add_target_options, --env): None / [] when not given
_PREDICTION_OPTIONS = (("config", "--config"), ("model", "--model"), ("set", "--set"), ("site_profile", "--site-profile"),
                       ("gpu_memory", "--gpu-memory"), ("world_size", "--world-size"), ("gpus", "--gpus"),
                       ("nnodes", "--nnodes"), ("nproc_per_node", "--nproc-per-node"), ("vocab_size", "--vocab-size"),
                       ("megatron_version", "--megatron-version"), ("env", "--env"))


def _no_prediction_options(ns: argparse.Namespace, options: tuple = _PREDICTION_OPTIONS) -> None:
    """memguard's JSONL files carry the predictions the hook made at run time: an option that would change a Megatron
    log's prediction (a site profile, the GPU, the model) would be ignored without a word, so it is an error. (--gpu
    is checked against the device the files record, ``_jsonl_gpu``; with none recorded it is refused the same way.)"""
    for dest, flag in options:
        if getattr(ns, dest, None) not in (None, []):
            raise ConfigError(flag, "applies to Megatron logs (the prediction memguard report makes); memguard's JSONL "
                                    "files carry the predictions made at run time, which it does not change",
                              f"leave {flag} out; at run time the hook takes --memguard-* flags and MEMGUARD_* variables")


def _jsonl_gpu(ns: argparse.Namespace, log: Any) -> list[str]:
    """Notes on the GPU of a run read from memguard's JSONL, whose predictions were made on the device the hook
    saw: the measured device of its start records (``gpu_device``) against --gpu (an error naming the file when
    they disagree) and against the GPU the recorded predictions assumed (a note when they differ)."""
    from ..calibrate.gpu_evidence import infer_gpu, jsonl_evidence

    from ..errors import MemguardError
    from ..gpus import lookup_gpu

    evidence = jsonl_evidence(log, log.location, decision=False)
    if ns.gpu is not None and not evidence:
        _no_prediction_options(ns, (("gpu", "--gpu"),))       # (no recorded device to check it against)
    if ns.gpu is not None:
        infer_gpu(log.location, evidence, lookup_gpu(ns.gpu))      # (raises on a contradiction)
        return []
    if not evidence:
        return []
    found = infer_gpu(log.location, evidence, None)
    fits = frozenset([found.gpu.name]) if found.gpu is not None else found.fits
    out = [found.note] if found.note else []
    decided = set()
    for r in log.ranks:
        d = ((((r.start or {}).get("context") or {}).get("decision")) or {}).get("gpu")
        try:
            decided.add(lookup_gpu(d).name)
        except (MemguardError, TypeError, ValueError, AttributeError):   # (none recorded, or outside the table)
            continue
    for d in sorted(decided):
        if d not in fits:
            out.append(f"the recorded predictions assumed {d}, but the run's device is {' or '.join(sorted(fits))} "
                       f"({evidence[0].text}): its capacity and terms are those of {d}")
    return out


def _oom_only(ns: argparse.Namespace, mlog: Any, forensics: list[Any]) -> int:
    if ns.out:
        raise ConfigError("--out", "the log holds an out-of-memory error but no memory lines to draw")
    if ns.json:
        print(json.dumps({"schema": "memguard.report/1", "location": mlog.files[0] if len(mlog.files) == 1 else
                          f"{len(mlog.files)} log files", "files": mlog.files, "ranks": [],
                          "oom_forensics": [f.to_dict() for f in forensics], "notes": mlog.notes}, indent=2))
    else:
        print(f"memguard report - {', '.join(mlog.files[:3])}: no memory lines; {len(forensics)} out-of-memory error(s)")
        for f in forensics:
            print()
            print("\n".join(f.lines()))
        print()
        print("result: OOM")
    return EXIT_PROBLEM


__all__ = ["run", "build_parser", "EXIT_BAD_INPUT", "is_jsonl_run", "job_env", "megatron_era", "megatron_prediction"]
