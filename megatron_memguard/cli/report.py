"""``memguard report LOGDIR``: predicted vs actual memory of a run, from its runtime JSONL files.

    memguard report /path/to/memguard-logs                    # summary tables on the terminal
    memguard report /path/to/memguard-logs --out report.html  # one offline HTML page (figure + tables)
    memguard report /path/to/memguard-logs --out report.png   # the figure with the error table

LOGDIR is the ``--memguard-log-dir`` of the Megatron hook (or of the callbacks): one
``memguard-rankNNNNN.jsonl`` per rank. Files may be given instead of a directory.

Exit codes: 0 every rank within its prediction + tolerance; 1 a rank exceeded it or ran out of
memory; 2 bad input (missing or empty directory, a malformed line: file and line are named).
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

from ..errors import ConfigError
from .main import EXIT_BAD_INPUT, EXIT_FITS, EXIT_PROBLEM, _Parser


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="memguard report", description="Predicted vs actual peak memory per rank of a run, from the "
                "memguard-rankNNNNN.jsonl files the Megatron hook (--memguard-log-dir) or the callbacks write.")
    p.add_argument("logdir", nargs="+", metavar="LOGDIR", help="the run's log directory (or its JSONL files)")
    p.add_argument("--out", metavar="FILE", help="write the report: FILE.html (one offline page), FILE.png or FILE.svg "
                                                 "(needs matplotlib: pip install 'megatron-memguard[plot]')")
    p.add_argument("--run", choices=("last", "all"), default="last",
                   help="a restarted job appends to its files: show the last run (default) or all of them")
    p.add_argument("--all-ranks", action="store_true", help="list every rank on the terminal (default: at most 32)")
    p.add_argument("--skip-bad-lines", action="store_true", help="skip malformed lines with a warning instead of failing")
    p.add_argument("--json", action="store_true", help="the numbers as JSON (schema memguard.report/1)")
    return p


def run(own_args: Sequence[str], flags: list[str]) -> int:
    try:
        ns = build_parser().parse_args(list(own_args))
    except SystemExit as e:          # --help (0) or a usage error, already printed (2)
        return int(e.code or 0)
    if flags:
        raise ConfigError("--", f"memguard report takes no flags after -- (got {' '.join(flags)})")
    from ..report.runlog import read_run
    from ..report.runreport import figure_table, metrics_of, render_text, report_html, to_json, verdict

    fmt = None
    if ns.out:
        from ..report.plots import output_format, require_matplotlib
        fmt = output_format(ns.out, "--out")
        require_matplotlib("--out")        # before reading: fail fast, one line

    def warn(msg: str) -> None:
        print(f"memguard: warning: {msg}", file=sys.stderr)

    log = read_run(ns.logdir, run=ns.run, skip_bad_lines=ns.skip_bad_lines, warn=warn)
    if ns.json:
        print(json.dumps(to_json(log), indent=2))
    else:
        print(render_text(log, all_ranks=ns.all_ranks))
    if ns.out:
        from ..report.plots import report_figure, write
        metrics = [m for m in metrics_of(log) if m != "device_used"] or ["max_allocated"]
        plot = report_figure(log, metrics=metrics, table_rows=None if fmt == "html" else figure_table(log))
        write(plot, ns.out, fmt, lambda p: report_html(log, p), "--out")
        print(f"memguard: report written to {ns.out}", file=sys.stderr)
    return EXIT_FITS if verdict(log, metrics_of(log))["ok"] else EXIT_PROBLEM


__all__ = ["run", "build_parser", "EXIT_BAD_INPUT"]
