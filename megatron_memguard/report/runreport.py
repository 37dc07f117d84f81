"""``memguard report``: predicted vs actual memory of a run, as terminal tables, an HTML page or a figure.

The numbers come from :mod:`.runlog`; the error of a rank is its largest actual / predicted over the
samples, minus one (+3% means the rank used 3% more than predicted).
"""
from __future__ import annotations

from typing import Any, Sequence

from ..units import format_bytes
from .runlog import METRIC_LABELS, METRICS, PREDICTED_OF, RankRun, RunLog
from .text import _c, table, use_colour

MAX_TERMINAL_RANKS = 32
MAX_FIGURE_TABLE_RANKS = 16
SHORT = {"max_allocated": "alloc", "max_reserved": "reserved", "device_used": "device"}


def metrics_of(log: RunLog) -> list[str]:
    """The metrics this run can compare (device memory only with a source that reads it, on GPUs)."""
    return [m for m in METRICS if m != "device_used" or log.has(m)] or ["max_allocated"]


def fmt_err(e: float | None, tol: float, colour: bool = False) -> str:
    if e is None:
        return "-"
    s = f"{e:+.1%}"
    return _c(s, "31", colour) if e > tol else s


def _bytes(v: int | None) -> str:
    return format_bytes(v) if v is not None else "-"


def _range(vals: Sequence[int | None]) -> tuple[int | None, int | None]:
    vs = [v for v in vals if v is not None]
    return (min(vs), max(vs)) if vs else (None, None)


def _range_bytes(vals: Sequence[int | None]) -> str:
    lo, hi = _range(vals)
    if lo is None:
        return "-"
    return format_bytes(lo) if lo == hi or format_bytes(lo) == format_bytes(hi) else f"{format_bytes(lo)}..{format_bytes(hi)}"


def _flags(r: RankRun, tol: float) -> str:
    out = []
    if r.ooms:
        out.append("OOM")
    if r.warnings:
        w = r.warnings[0]
        out.append(f"warned at {w.get('iteration')} ({w.get('suspect')})")
    elif r.exceeded(tol):
        out.append("over")
    if not r.samples:
        out.append("no samples")
    return ", ".join(out)


# ---- rows ----------------------------------------------------------------------------------------------
def _samples(r: RankRun) -> str:
    its = r.iterations      # (in the file's order: a log whose iterations go back shows its range, not 100-90)
    return f"{len(its)} ({min(its)}-{max(its)})" if its else "0"


def rank_header(metrics: Sequence[str]) -> list[str]:
    h = ["rank", "stage", "samples (iterations)"]
    for m in metrics:
        h += [f"{SHORT[m]} predicted", "actual", "error"]
    return h + ["notes"]


def rank_row(r: RankRun, metrics: Sequence[str], tol: float, colour: bool = False) -> list[str]:
    row = [str(r.rank), f"pp{r.pp_rank}" if r.pp_rank is not None else "-", _samples(r)]
    for m in metrics:
        row += [_bytes(r.predicted(m)), _bytes(r.peak(m)), fmt_err(r.error(m), tol, colour)]
    return row + [_flags(r, tol)]


def stage_header(metrics: Sequence[str]) -> list[str]:
    h = ["stage", "ranks"]
    for m in metrics:
        h += [f"{SHORT[m]} predicted", "actual", "error"]
    return h


def _err_range(ranks: Sequence[RankRun], m: str, tol: float, colour: bool) -> str:
    es = [e for e in (r.error(m) for r in ranks) if e is not None]
    if not es:
        return "-"
    lo, hi = min(es), max(es)
    if f"{lo:+.1%}" == f"{hi:+.1%}":
        return fmt_err(hi, tol, colour)
    return f"{fmt_err(lo, tol, colour)}..{fmt_err(hi, tol, colour)}"


def stage_row(pp: int, ranks: Sequence[RankRun], metrics: Sequence[str], tol: float, colour: bool = False) -> list[str]:
    row = [f"pp{pp}" if pp >= 0 else "-", str(len(ranks))]
    for m in metrics:
        row += [_range_bytes([r.predicted(m) for r in ranks]), _range_bytes([r.peak(m) for r in ranks]),
                _err_range(ranks, m, tol, colour)]
    return row


def worst(log: RunLog, metrics: Sequence[str]) -> tuple[RankRun, str, float] | None:
    best = None
    for r in log.ranks:
        for m in metrics:
            e = r.error(m)
            if e is not None and (best is None or e > best[2]):
                best = (r, m, e)
    return best


def verdict(log: RunLog, metrics: Sequence[str]) -> dict[str, Any]:
    tol = log.tolerance
    over = [(r, m, r.error(m)) for r in log.ranks for m in r.exceeded(tol) if m in metrics]
    ooms = [r for r in log.ranks if r.ooms]
    w = worst(log, metrics)
    ok = not over and not ooms
    return {"ok": ok, "tolerance": tol, "over": over, "ooms": ooms, "worst": w,
            "sampled": any(r.samples for r in log.ranks)}


def result_line(log: RunLog, metrics: Sequence[str], colour: bool = False) -> str:
    v = verdict(log, metrics)
    tol = v["tolerance"]
    if not v["sampled"] and not v["ooms"]:
        return "result: " + _c("NO SAMPLES", "33", colour) + " - no rank recorded a sample; nothing to compare"
    parts = []
    if v["ooms"]:
        parts.append(f"{len(v['ooms'])} rank(s) ran out of memory (" + ", ".join(
            f"rank {r.rank} pp{r.pp_rank}" for r in v["ooms"][:4]) + ")")
    if v["over"]:
        by_rank: dict[int, list] = {}
        for r, m, e in sorted(v["over"], key=lambda x: -x[2]):
            by_rank.setdefault(r.rank, [r]).append((m, e))
        shown = [f"rank {x[0].rank} (pp{x[0].pp_rank}) " + ", ".join(f"{METRIC_LABELS[m]} {e:+.1%}" for m, e in x[1:])
                 for x in list(by_rank.values())[:3]]
        parts.append(f"{len(by_rank)} rank(s) exceeded their prediction by more than {tol:.0%}: " + "; ".join(shown)
                     + ("; ..." if len(by_rank) > 3 else ""))
    if parts:
        return "result: " + _c("OVER", "31", colour) + " - " + "; ".join(parts)
    if v["worst"] is None:
        return ("result: " + _c("NO PREDICTION", "33", colour) + " - the samples carry no prediction "
                "(the run's estimate failed or was not given); nothing to compare")
    r, m, e = v["worst"]
    return ("result: " + _c("OK", "32", colour) + f" - every rank stayed within its prediction +{tol:.0%} "
            f"(largest: {e:+.1%}, rank {r.rank} pp{r.pp_rank} {METRIC_LABELS[m]})")


def _headline(log: RunLog) -> str:
    stages = log.stages
    counts = sorted({len(r.samples) for r in log.ranks})
    its = [s.iteration for r in log.ranks for s in r.samples]
    samples = (f"{counts[0]}" if len(counts) == 1 else f"{counts[0]}-{counts[-1]}") + " sample(s) per rank"
    sources = sorted({r.source for r in log.ranks if r.source})
    resets = {r.reset_peak for r in log.ranks if r.reset_peak is not None}
    peaks = "per-interval peaks" if resets == {True} else ("peaks since start" if resets == {False} else "")
    bits = [f"{len(log.ranks)} rank(s) in {len(stages)} pipeline stage(s)", samples]
    if its:
        bits.append(f"iterations {min(its)}-{max(its)}")
    if sources:
        bits.append("source " + "/".join(sources))
    if peaks:
        bits.append(peaks)
    return f"memguard report - {log.location}: " + ", ".join(bits)


def _event_lines(log: RunLog, limit: int = 8) -> list[str]:
    out = []
    for r in log.ranks:
        for w in r.warnings:
            out.append(f"warning: rank {r.rank} (pp{r.pp_rank}) iteration {w.get('iteration')}: "
                       f"{str(w.get('metric', '')).replace('_', ' ')} {_bytes(w.get('actual_bytes'))} vs predicted "
                       f"{_bytes(w.get('predicted_bytes'))} (x{w.get('ratio')}); suspected term: {w.get('suspect')}")
        for o in r.ooms:
            out.append(f"oom: rank {r.rank} (pp{r.pp_rank}) after iteration {o.get('iteration')}"
                       + (f", allocating {_bytes(o.get('alloc_bytes'))}" if o.get("alloc_bytes") else ""))
    if len(out) > limit:
        out = out[:limit] + [f"... and {len(out) - limit} more (see --json)"]
    return out


def moe_lines(log: RunLog) -> list[str]:
    """MoE runs: per stage, the measured peak allocated against the balanced-routing estimate and the
    worst-case bound (routing moves MoE peaks; docs/terms/moe.md)."""
    out = []
    for pp, rs in log.stages.items():
        worst = next((r.moe_worst_case() for r in rs if r.moe_worst_case()), None)
        peaks = [r.peak("max_allocated") for r in rs if r.peak("max_allocated")]
        pred = next((r.predicted("max_allocated") for r in rs if r.predicted("max_allocated")), None)
        if not worst or not peaks or not pred:
            continue
        top, bound = max(peaks), worst["peak_allocated_bytes"]
        where = ("above the worst-case bound" if top > bound else "above the balanced estimate, within the bound"
                 if top > pred else "within the balanced estimate")
        out.append(f"pp{pp} MoE routing: measured peak allocated {format_bytes(top)} = {top / pred:.0%} of the "
                   f"balanced-routing estimate {format_bytes(pred)}, {top / bound:.0%} of the worst-case bound "
                   f"{format_bytes(bound)} ({where})")
    if out:
        out.insert(0, "mixture of experts (peaks move with routing):")
    return out


def render_text(log: RunLog, colour: bool | None = None, all_ranks: bool = False) -> str:
    colour = use_colour() if colour is None else colour
    metrics = metrics_of(log)
    tol = log.tolerance
    out = [_headline(log), ""]
    rows = [stage_row(pp, rs, metrics, tol, colour) for pp, rs in log.stages.items()]
    out.append("per pipeline stage (predicted and actual peaks; error = actual / predicted - 1, worst over the stage's ranks):")
    out.append(table(rows, stage_header(metrics), right=range(1, 2 + 3 * len(metrics))))
    out.append("")
    ranks = log.ranks
    title = "per rank:"
    if len(ranks) > MAX_TERMINAL_RANKS and not all_ranks:
        def key(r):
            return max((e for e in (r.error(m) for m in metrics) if e is not None), default=-1e9)
        ranks = sorted(ranks, key=key, reverse=True)[:10]
        title = f"the 10 of {len(log.ranks)} ranks with the largest error (--all-ranks lists every rank):"
    out.append(title)
    out.append(table([rank_row(r, metrics, tol, colour) for r in ranks], rank_header(metrics),
                     right=range(2, 3 + 3 * len(metrics))))
    moe = moe_lines(log)
    if moe:
        out.append("")
        out.extend(moe)
    events = _event_lines(log)
    if events:
        out.append("")
        out.extend(events)
    out.append("")
    out.append(result_line(log, metrics, colour))
    if log.notes:
        out.append("")
        out.extend(f"note: {n}" for n in log.notes)
    return "\n".join(out)


# ---- figure table and HTML -----------------------------------------------------------------------------
def figure_table(log: RunLog) -> tuple[list[str], list[list[str]], set[tuple[int, int]]]:
    """The table drawn under the panels of a PNG / SVG (per rank, or per stage for large runs), and the
    (row, column) cells to highlight: errors above the tolerance."""
    metrics = metrics_of(log)
    tol = log.tolerance
    if len(log.ranks) <= MAX_FIGURE_TABLE_RANKS:
        header, rows = rank_header(metrics), [rank_row(r, metrics, tol) for r in log.ranks]
    else:
        header, rows = stage_header(metrics), [stage_row(pp, rs, metrics, tol) for pp, rs in log.stages.items()]
    hot = set()
    for i, row in enumerate(rows):
        for j, h in enumerate(header):
            if h == "error":
                vals = [float(x.rstrip("%")) / 100 for x in row[j].split("..") if x not in ("-", "")]
                if vals and max(vals) > tol:
                    hot.add((i, j))
    return header, rows, hot


def report_html(log: RunLog, plot: Any) -> str:
    from . import html as H

    metrics = metrics_of(log)
    tol = log.tolerance

    def err_cell(e):
        return H.Cell(fmt_err(e, tol), None if e is None else round(e, 6), "over" if e is not None and e > tol else "")

    rows = []
    for r in log.ranks:
        its = r.iterations
        row = [H.Cell(r.rank, r.rank), f"pp{r.pp_rank}" if r.pp_rank is not None else "-",
               H.Cell(_samples(r), len(its))]
        for m in metrics:
            p, a = r.predicted(m), r.peak(m)
            row += [H.Cell(_bytes(p), p), H.Cell(_bytes(a), a), err_cell(r.error(m))]
        row.append(_flags(r, tol))
        rows.append(row)
    srows = []
    for pp, rs in log.stages.items():
        row = [f"pp{pp}" if pp >= 0 else "-", H.Cell(len(rs), len(rs))]
        for m in metrics:
            lo, hi = _range([r.predicted(m) for r in rs])
            alo, ahi = _range([r.peak(m) for r in rs])
            es = [e for e in (r.error(m) for r in rs) if e is not None]
            row += [H.Cell(_range_bytes([r.predicted(m) for r in rs]), hi),
                    H.Cell(_range_bytes([r.peak(m) for r in rs]), ahi), err_cell(max(es) if es else None)]
        srows.append(row)
    v = verdict(log, metrics)
    cls = "over" if not v["ok"] else "fits" if v["worst"] is not None else "tight"   # amber: nothing to compare
    events = _event_lines(log, limit=200)
    body = [f"<h1 class=\"{cls}\">{H.esc(result_line(log, metrics))}</h1>",
            f"<p class=\"sub\">{H.esc(_headline(log))}\nfiles: {H.esc(', '.join(log.files[:6]))}"
            + (H.esc(f" ... ({len(log.files)} files)") if len(log.files) > 6 else "") + "</p>",
            H.figure(plot.fig, plot.caption),
            "<h2>Relative error per rank</h2>",
            "<p class=\"sub\">error = largest actual / predicted over the samples - 1; red: above the tolerance "
            f"(+{tol:.0%}).</p>",
            H.table(rank_header(metrics), rows, "ranks"),
            "<h2>Per pipeline stage</h2>", H.table(stage_header(metrics), srows, "stages")]
    if events:
        body += ["<h2>Events</h2>", H.notes(events)]
    body.append(H.notes(log.notes))
    return H.page(f"memguard report: {log.location}", body)


def to_json(log: RunLog) -> dict[str, Any]:
    metrics = metrics_of(log)
    v = verdict(log, metrics)
    d = log.to_dict()
    d["metrics"] = metrics
    d["result"] = {"ok": v["ok"], "tolerance": v["tolerance"],
                   "over": [{"rank": r.rank, "pp_rank": r.pp_rank, "metric": m, "error": e} for r, m, e in v["over"]],
                   "oom_ranks": [r.rank for r in v["ooms"]]}
    d["stages"] = {str(pp): {"ranks": [r.rank for r in rs],
                             **{f"error_{m}": max((e for e in (r.error(m) for r in rs) if e is not None), default=None)
                                for m in metrics}} for pp, rs in log.stages.items()}
    return d


__all__ = ["render_text", "report_html", "figure_table", "to_json", "verdict", "metrics_of", "PREDICTED_OF"]
