"""Figures: per-stage memory breakdown, predicted vs actual memory of a run, plan throughput vs memory.

matplotlib is an optional extra (``pip install 'megatron-memguard[plot]'``) and is imported only
when a figure is made; without it the commands that plot fail with one line saying how to get it.
Figures are made with ``matplotlib.figure.Figure`` directly (no pyplot, no GUI backend, no global
state). Each builder returns a :class:`Plot` that keeps the figure, its axes and the numbers drawn,
so callers (and tests) can read back exactly what is on the picture.
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING, Any, Callable, Sequence

from ..errors import ConfigError
from ..estimator.result import GROUPS
from ..units import byte_unit, format_bytes

if TYPE_CHECKING:
    from ..estimator.result import Estimate, StageEstimate
    from ..planner.search import PlanEntry
    from .runlog import RunLog

FORMATS = ("png", "svg", "html")
DPI = 100
MIN_MATPLOTLIB = (3, 7)     # figure legends placed "outside" the constrained layout

GROUP_LABELS = {
    "weights": "weights", "gradients": "gradients", "optimizer": "optimizer states", "activations": "activations",
    "logits_loss": "logits / loss", "transients": "transients", "fixed": "fixed costs", "allocator": "allocator slack",
}
GROUP_COLOURS = {
    "weights": "#4c72b0", "gradients": "#55a868", "optimizer": "#8172b3", "activations": "#dd8452",
    "logits_loss": "#c44e52", "transients": "#da8bc3", "fixed": "#8c8c8c", "allocator": "#ccb974",
}
VERDICT_COLOURS = {"fits": "#1b7f2a", "tight": "#b36b00", "will not fit": "#c0392b", "unknown": "#555555"}
METRIC_COLOURS = {"max_allocated": "#1f77b4", "max_reserved": "#ff7f0e", "device_used": "#2ca02c"}
CAPACITY_COLOUR, THRESHOLD_COLOUR = "#c0392b", "#b36b00"


class PlotUnavailable(ConfigError):
    """matplotlib is not installed."""

    def __init__(self, option: str = "--plot"):
        super().__init__(option, "needs matplotlib, which is not installed",
                         "pip install 'megatron-memguard[plot]'")


def require_matplotlib(option: str = "--plot") -> type:
    """The ``Figure`` class, or PlotUnavailable naming the ``plot`` extra."""
    try:
        import matplotlib
        from matplotlib.figure import Figure
    except ImportError:
        raise PlotUnavailable(option) from None
    version = tuple(int(x) for x in re.findall(r"\d+", matplotlib.__version__)[:2])
    if version < MIN_MATPLOTLIB:
        raise ConfigError(option, f"needs matplotlib >= {'.'.join(map(str, MIN_MATPLOTLIB))}, found {matplotlib.__version__}",
                          "pip install -U 'megatron-memguard[plot]'")
    return Figure


def output_format(path: str, option: str = "--plot", formats: Sequence[str] = FORMATS) -> str:
    """The format a file name asks for (``png``, ``svg``, ``html``); ConfigError if unknown or unwritable."""
    ext = os.path.splitext(path)[1].lower().lstrip(".")
    ext = "html" if ext == "htm" else ext
    if ext not in formats:
        raise ConfigError(option, f"cannot tell the format of {path!r}",
                          "give a file name ending in " + ", ".join("." + f for f in formats))
    d = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(d):
        raise ConfigError(option, f"directory {d} does not exist")
    if os.path.isdir(path):
        raise ConfigError(option, f"{path} is a directory", "give a file name")
    if not os.access(d, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise ConfigError(option, f"cannot write {path}: permission denied")
    return ext


@dataclass
class Plot:
    """A figure and what is drawn on it. Heights and values on the axes are in ``unit`` (name, bytes)."""

    fig: Any
    ax: Any
    unit: tuple[str, int]
    data: dict[str, Any] = field(default_factory=dict)
    bars: dict[str, Any] = field(default_factory=dict)      # estimate: group -> BarContainer (one bar per stage)
    lines: dict[Any, Any] = field(default_factory=dict)     # named Line2D objects
    axes: dict[int, Any] = field(default_factory=dict)      # report: pipeline stage -> Axes
    caption: str = ""

    def save(self, path: Any, fmt: str | None = None) -> None:
        """PNG or SVG to a path or a binary file (HTML pages are put together by the caller around the SVG)."""
        fmt = fmt or output_format(path, formats=("png", "svg"))
        self.fig.savefig(path, format=fmt, dpi=DPI, metadata=_metadata(fmt))

    @property
    def size_px(self) -> tuple[int, int]:
        w, h = self.fig.get_size_inches()
        return int(round(w * DPI)), int(round(h * DPI))


def _wrap(text: str, chars: float) -> str:
    """Wrap a title to about ``chars`` characters per line (its figure's width in characters)."""
    import textwrap
    return "\n".join(textwrap.wrap(text, max(30, int(chars)), break_on_hyphens=False))


def _metadata(fmt: str) -> dict:
    return {"Date": None} if fmt == "svg" else {}


def write(plot: Plot, path: str, fmt: str, html_page: Callable[[Plot], str], option: str = "--plot",
          stream: IO | None = None) -> None:
    """Write a plot as PNG / SVG, or as the HTML page ``html_page(plot)`` returns; into ``stream`` when the
    caller opened ``path`` already (files.open_pipe_early: a named pipe)."""
    from ..files import open_output

    doc = html_page(plot) if fmt == "html" else None     # (rendered before a regular file is truncated)
    try:
        with (stream if stream is not None else open_output(path, binary=doc is None)) as f:
            if doc is not None:   # (a named pipe nobody reads: an error from open_output, not a hang)
                f.write(doc)
            else:
                plot.save(f, fmt)
    except OSError as e:
        raise ConfigError(option, f"cannot write {path}: {e.strerror or e}") from None


def open_early(path: str, fmt: str, option: str = "--plot") -> IO | None:
    """``path`` opened before the figure is drawn when it is a named pipe (files.open_pipe_early): one nobody reads
    is refused in milliseconds, not after a second of rendering; ConfigError naming ``option``."""
    from ..files import open_pipe_early

    try:
        return open_pipe_early(path, binary=fmt != "html")
    except OSError as e:
        raise ConfigError(option, f"cannot write {path}: {e.strerror or e}") from None


def _widen_for_ticks(fig, ax, n: int, max_width: float = 40.0) -> None:
    """Make the figure wide enough that the x tick labels do not touch (measured with a renderer)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    for _ in range(4):
        canvas = FigureCanvasAgg(fig)
        r = canvas.get_renderer()
        fig.draw(r)   # runs the constrained layout
        widths = [t.get_window_extent(r).width for t in ax.get_xticklabels() if t.get_text()]
        if not widths:
            return
        slot = ax.get_window_extent(r).width / max(n, 1)
        need = max(widths) * 1.12 + 6
        w, h = fig.get_size_inches()
        if slot >= need or w >= max_width:
            return
        fig.set_size_inches(min(max_width, w + (need - slot) * n / fig.dpi * 1.05), h)


# ---- estimate: stacked bars per pipeline stage -------------------------------------------------------
def stage_label(s: StageEstimate, vpp: int) -> str:
    """Tick label of a stage: its name and layers (chunks x layers when interleaved)."""
    if vpp > 1 and s.chunks:
        per = {c.num_layers for c in s.chunks}
        layers = (f"{len(s.chunks)}\u00d7{per.pop()} layers" if len(per) == 1
                  else f"{s.num_layers} layers / {len(s.chunks)} ch")
    else:
        layers = f"{s.num_layers} layer" + ("" if s.num_layers == 1 else "s")
    return f"pp{s.pp_rank}\n{layers}"


def _groups_present(est) -> list[str]:
    extra = sorted({t.group for s in est.stages for t in s.terms} - set(GROUPS))
    return [g for g in (*GROUPS, *extra) if any(s.group_bytes(g) for s in est.stages)]


def estimate_figure(est: Estimate) -> Plot:
    """Stacked bars of every pipeline stage's terms by group; GPU capacity and threshold as lines."""
    Figure = require_matplotlib()
    from ..report.text import describe_layout

    stages = list(est.stages)
    n = len(stages)
    L = est.layout
    totals = [sum(t.bytes for t in s.terms) for s in stages]
    mem = est.gpu_memory_bytes
    unit, div = byte_unit(max(totals + ([mem] if mem else [])))
    compact = n > 24
    width = min(40.0, max(10.0, 4.2 + (0.32 if compact else 0.62) * n))
    fig = Figure(figsize=(width, 5.8), layout="constrained")
    ax = fig.add_subplot()
    xs = list(range(n))
    plot = Plot(fig, ax, (unit, div))
    bottom = [0] * n
    groups = _groups_present(est)
    for g in groups:
        vals = [s.group_bytes(g) for s in stages]
        plot.bars[g] = ax.bar(xs, [v / div for v in vals], bottom=[b / div for b in bottom], width=0.72,
                              color=GROUP_COLOURS.get(g, "#bbbbbb"), edgecolor="white", linewidth=0.4,
                              label=GROUP_LABELS.get(g, g.replace("_", " ")), zorder=2)
        bottom = [b + v for b, v in zip(bottom, vals)]
    plot.lines["peak_allocated"] = ax.hlines([s.peak_allocated_bytes / div for s in stages], [x - 0.36 for x in xs],
                                             [x + 0.36 for x in xs], colors="#111111", linewidth=1.3, zorder=3,
                                             label="peak allocated (max_memory_allocated)")
    top = max(totals) if totals else 0
    if mem:
        plot.lines["capacity"] = ax.axhline(mem / div, color=CAPACITY_COLOUR, linewidth=1.6, zorder=4,
                                            label=f"GPU capacity {format_bytes(mem)}")
        thr = mem * est.threshold
        plot.lines["threshold"] = ax.axhline(thr / div, color=THRESHOLD_COLOUR, linewidth=1.4, linestyle="--", zorder=4,
                                             label=f"threshold {est.threshold:.0%} = {format_bytes(thr)}")
        top = max(top, mem)
        if not compact:
            for x, t in zip(xs, totals):
                ax.text(x, t / div, f"{t / mem:.0%}", ha="center", va="bottom", fontsize=8, color="#333333", zorder=5)
    ax.set_ylim(0, top / div * 1.12 if top else 1)
    side = max(0.6, (3 - n) / 2 + 0.6)     # one or two bars stay bar-sized
    ax.set_xlim(-side, n - 1 + side)
    ax.set_xticks(xs)
    labels = ax.set_xticklabels([f"pp{s.pp_rank}" for s in stages] if compact else [stage_label(s, L.vpp) for s in stages],
                                fontsize=8 if compact else 9, rotation=90 if compact else 0)
    crit_colour = VERDICT_COLOURS.get(est.verdict, "#333333")
    if n > 1:
        labels[est.critical_stage].set_fontweight("bold")
        labels[est.critical_stage].set_color(crit_colour)
    ax.set_ylabel(f"memory per GPU ({unit})")
    ax.set_xlabel("pipeline stage" + (" (virtual stages: chunks \u00d7 layers each)" if L.vpp > 1 else "")
                  + ("; bold: critical stage" if n > 1 else ""))
    ax.grid(axis="y", color="#e5e5e5", zorder=0)
    ax.set_axisbelow(True)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    c = est.critical
    gpu = f"{est.gpu} " if est.gpu else ""
    if mem:
        need = c.required_device_bytes      # (an upcycling run's start-up figure when it is the larger)
        head = (f"{est.verdict.upper()}: critical stage pp{c.pp_rank} needs {format_bytes(need)}"
                + (" at upcycling start-up" if need > c.device_total_bytes else "")
                + f" = {need / mem:.0%} of the {gpu}{format_bytes(mem)} (threshold {est.threshold:.0%})")
    else:
        head = (f"{est.verdict.upper()} (no GPU memory given): critical stage pp{c.pp_rank} peaks at "
                f"{format_bytes(c.peak_allocated_bytes)} allocated")
    fig.suptitle(_wrap(head, width * 9.5), color=crit_colour, fontsize=12, fontweight="bold")
    # describe_layout's lines ("model: ...", "batch: ...", "layout: ..."), the layout first.
    lines = [ln.split(":", 1)[-1].strip() for ln in sorted(describe_layout(est).splitlines(),
                                                            key=lambda ln: not ln.startswith("layout:"))]
    ax.set_title(_wrap("; ".join(ln for ln in lines if ln), (width - 2.6) * 13), fontsize=8.5, color="#444444")
    # Stack order top-down in the legend, then the tick and the lines.
    handles = [plot.bars[g] for g in reversed(groups)] + [plot.lines[k] for k in ("peak_allocated", "threshold", "capacity")
                                                          if k in plot.lines]
    ax.legend(handles, [h.get_label() for h in handles], loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8,
              frameon=False, title="per GPU, at the stage's peak", title_fontsize=8)
    _widen_for_ticks(fig, ax, n)
    plot.data = {
        "verdict": est.verdict, "critical_stage": est.critical_stage, "gpu_memory_bytes": mem, "threshold": est.threshold,
        "groups": groups,
        "stages": [{"pp_rank": s.pp_rank, "label": stage_label(s, L.vpp), "groups": {g: s.group_bytes(g) for g in groups},
                    "total_bytes": t, "peak_allocated_bytes": s.peak_allocated_bytes,
                    "peak_reserved_bytes": s.peak_reserved_bytes, "device_total_bytes": s.device_total_bytes}
                   for s, t in zip(stages, totals)],
    }
    plot.caption = ("Each bar stacks one stage's predicted terms by group at the stage's peak; its height is the device "
                    "total (fixed costs include the CUDA context and NCCL buffers outside PyTorch's allocator). "
                    "The black tick is the predicted peak allocated (torch.cuda.max_memory_allocated).")
    return plot


def estimate_html(est: Estimate, plot: Plot) -> str:
    from . import html as H
    from .text import describe_layout, verdict_line

    groups = plot.data["groups"]
    mem = est.gpu_memory_bytes
    vpp = est.layout.vpp > 1
    rows = []
    for s in est.stages:
        row = [f"pp{s.pp_rank}" + (" (critical)" if s.pp_rank == est.critical_stage and len(est.stages) > 1 else ""),
               H.Cell(s.num_layers, s.num_layers)]
        if vpp:
            row.append(", ".join(f"{c.label}: {c.num_layers}" for c in s.chunks))
        row += [H.Cell(format_bytes(s.group_bytes(g)), s.group_bytes(g)) for g in groups]
        row += [H.Cell(format_bytes(v), v) for v in (s.peak_allocated_bytes, s.peak_reserved_bytes, s.device_total_bytes)]
        row.append(H.Cell(f"{s.device_total_bytes / mem:.0%}" if mem else "-",
                          round(s.device_total_bytes / mem, 6) if mem else None))
        rows.append(row)
    header = ["stage", "layers", *(["virtual stages (layers)"] if vpp else []),
              *(GROUP_LABELS.get(g, g) for g in groups), "peak allocated", "peak reserved", "device total", "of GPU"]
    c = est.critical
    terms = [[t.name, t.group, t.level, H.Cell(format_bytes(t.bytes), t.bytes), t.detail] for t in c.terms]
    body = [
        f"<h1 class=\"{H.css_class(est.verdict)}\">{H.esc(verdict_line(est))}</h1>",
        f"<p class=\"sub\">{H.esc(describe_layout(est))}</p>",
        H.figure(plot.fig, plot.caption),
        "<h2>Per stage</h2>", H.table(header, rows, "stages"),
        f"<h2>Critical stage pp{c.pp_rank} at its peak: {H.esc(c.peak_phase)}</h2>",
        H.table(["term", "group", "level", "bytes", "how"], terms, "critical-terms"),
        H.notes(list(est.notes)),
        "<p class=\"muted\">memguard estimate; terms are documented in docs/terms of megatron-memguard.</p>",
    ]
    return H.page(f"memguard estimate: {est.verdict}", body)


def write_estimate_plot(est: Estimate, path: str, stream: IO | None = None) -> Plot:
    fmt = output_format(path)
    plot = estimate_figure(est)
    write(plot, path, fmt, lambda p: estimate_html(est, p), stream=stream)
    return plot


# ---- report: predicted vs actual over iterations, one panel per stage ---------------------------------
def report_figure(log: RunLog, metrics: Sequence[str] = ("max_allocated", "max_reserved"),
                  table_rows: Sequence[Any] | None = None) -> Plot:
    """One panel per pipeline stage: each rank's actual peak allocated / reserved per sample (solid) and the
    prediction (dashed). ``table_rows`` (header, rows) adds a table under the panels (PNG / SVG)."""
    Figure = require_matplotlib("--out")
    from .runlog import METRIC_LABELS

    stages = log.stages
    n = max(1, len(stages))
    ncols = min(n, 4)
    nrows = math.ceil(n / ncols)
    values = [v for r in log.ranks for s in r.samples for m in metrics
              for v in (s.value(m), s.prediction(m)) if v]
    unit, div = byte_unit(max(values) if values else 1)
    panel_h = 3.0
    table_h = 0.0
    if table_rows is not None:
        table_h = 0.6 + 0.22 * (len(table_rows[1]) + 1)
    width = max(7.5, 4.3 * ncols + 0.8)
    if table_rows is not None:
        # the table's widest line at 8 pt (about 0.07 in per character, each cell padded): narrower, the
        # constrained layout collapsed (matplotlib's warning on stderr, the title and table cut off)
        header, rows = table_rows[0], table_rows[1]
        chars = sum(max([len(str(h))] + [len(str(r[j])) for r in rows if j < len(r)]) + 2 for j, h in enumerate(header))
        width = max(width, 0.07 * chars + 0.6)
    fig = Figure(figsize=(width, panel_h * nrows + 1.3 + table_h), layout="constrained")
    if table_rows is not None:
        top, bottom = fig.subfigures(2, 1, height_ratios=[panel_h * nrows + 1.3, table_h])
    else:
        top, bottom = fig, None
    axs = top.subplots(nrows, ncols, squeeze=False)
    plot = Plot(fig, axs[0][0], (unit, div))
    tol = log.tolerance
    for i, (pp, ranks) in enumerate(stages.items()):
        ax = axs[i // ncols][i % ncols]
        plot.axes[pp] = ax
        many = len(ranks) > 4
        preds_drawn: set = set()
        ymax = 0.0
        for r in ranks:
            its = r.iterations
            for m in metrics:
                ys = [s.value(m) for s in r.samples]
                if not any(v is not None for v in ys):
                    continue
                pts = [(x, y) for x, y in zip(its, ys) if y is not None]
                line, = ax.plot([p[0] for p in pts], [p[1] / div for p in pts], color=METRIC_COLOURS[m],
                                linewidth=1.0 if many else 1.5, alpha=0.55 if many else 1.0,
                                marker="o" if len(pts) <= 40 else None, markersize=2.5 if many else 3.5,
                                label=f"actual {METRIC_LABELS[m]}", zorder=3)
                plot.lines[(r.rank, m)] = line
                ymax = max(ymax, max(p[1] for p in pts))
                preds = [s.prediction(m) for s in r.samples]
                key = (m, tuple(its), tuple(preds))
                if any(preds) and key not in preds_drawn:
                    preds_drawn.add(key)
                    pl, = ax.plot(its, [p / div if p else math.nan for p in preds], color=METRIC_COLOURS[m],
                                  linestyle="--", linewidth=1.4, drawstyle="steps-post",
                                  label=f"predicted {METRIC_LABELS[m]}", zorder=2)
                    plot.lines[("predicted", r.rank, m)] = pl
                    ymax = max(ymax, max(p for p in preds if p))
            for w in r.warnings:
                if w.get("iteration") is not None and w.get("actual_bytes"):
                    ax.plot([w["iteration"]], [w["actual_bytes"] / div], marker="v", color="#c0392b", markersize=8,
                            linestyle="none", label="warning (> prediction + tolerance)", zorder=4)
            for o in r.ooms:
                if o.get("iteration") is not None:
                    ax.axvline(o["iteration"], color="#c0392b", linewidth=1.2, label="out of memory (after)", zorder=1)
        ax.set_ylim(0, (ymax / div) * 1.15 if ymax else 1)
        worst = {m: max((e for e in (r.error(m) for r in ranks) if e is not None), default=None) for m in metrics}
        bits = [f"{METRIC_LABELS[m].split()[-1]} {worst[m]:+.1%}" for m in metrics if worst[m] is not None]
        over = any(e is not None and e > tol for e in worst.values())
        ax.set_title(f"pp{pp}" if pp >= 0 else "no stage", fontsize=10, loc="left", fontweight="bold",
                     color="#c0392b" if over else "#222222")
        ax.set_title(f"{len(ranks)} rank{'s' if len(ranks) != 1 else ''}" + (", worst " + ", ".join(bits) if bits else ""),
                     fontsize=8.5, loc="right", color="#c0392b" if over else "#444444")
        ax.grid(color="#ececec")
        ax.tick_params(labelsize=8)
        if i % ncols == 0:
            ax.set_ylabel(unit)
        if i // ncols == nrows - 1 or i + ncols >= len(stages):
            ax.set_xlabel("iteration", fontsize=9)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
    for j in range(len(stages), nrows * ncols):
        axs[j // ncols][j % ncols].set_visible(False)
    # One legend for the figure: each kind of line once.
    seen: dict[str, Any] = {}
    for ax in plot.axes.values():
        for h, lab in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(lab, h)
    order = sorted(seen, key=lambda k: (not k.startswith(("actual", "predicted")), k.split()[-1], k))
    if seen:
        plot.data["legend"] = top.legend([seen[k] for k in order], order, loc="outside lower center", ncols=min(len(order), 5),
                   fontsize=8.5, frameon=False)
    its = [s.iteration for r in log.ranks for s in r.samples]
    span = f", iterations {min(its)}-{max(its)}" if its else ", no samples"
    plot.data["title"] = top.suptitle(f"memguard: predicted vs actual peak memory per rank - {len(log.ranks)} rank(s), "
                 f"{len(stages)} pipeline stage(s){span}", fontsize=11.5, fontweight="bold")
    if table_rows is not None:
        tax = bottom.subplots()
        tax.axis("off")
        header, rows, hot = (tuple(table_rows) + (set(),))[:3]
        t = tax.table(cellText=rows or [["-"] * len(header)], colLabels=header, loc="upper center", cellLoc="right",
                      colLoc="center")
        t.auto_set_font_size(False)
        t.set_fontsize(8)
        t.auto_set_column_width(list(range(len(header))))
        for (i, j) in hot:
            t[i + 1, j].get_text().set_color("#c0392b")
            t[i + 1, j].get_text().set_fontweight("bold")
        plot.data["table"] = t
    plot.data.update({"metrics": list(metrics), "stages": {pp: [r.rank for r in rs] for pp, rs in stages.items()}})
    plot.caption = ("Solid: each rank's actual peak (torch.cuda.max_memory_allocated / max_memory_reserved) at each "
                    "sample; dashed: memguard's prediction for that rank's stage. Peaks are since start unless the run "
                    "reset them per interval.")
    return plot


# ---- plan: throughput against memory -----------------------------------------------------------------
def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats: lower or equal memory (x) and higher or equal throughput
    (y), one of them strictly. Sorted by memory."""
    order = sorted(range(len(points)), key=lambda i: (points[i][0], -points[i][1]))
    front, best = [], -math.inf
    for i in order:
        if points[i][1] > best:
            front.append(i)
            best = points[i][1]
    return front


def plan_points(entries: Sequence[PlanEntry]) -> list[dict[str, Any]]:
    pts = [{"rank": e.rank, "name": e.candidate.name, "label": e.candidate.label, "tp": e.candidate.tp,
            "pp": e.candidate.pp, "peak_device_bytes": e.estimate.peak_device_bytes,
            "tokens_per_s_per_gpu": e.time.tokens_per_s_per_gpu, "mfu": e.time.mfu} for e in entries]
    for i in pareto_front([(p["peak_device_bytes"], p["tokens_per_s_per_gpu"]) for p in pts]):
        pts[i]["pareto"] = True
    for p in pts:
        p.setdefault("pareto", False)
    return pts


def plan_figure(points: Sequence[dict], gpu_memory: int, threshold: float, title: str, caption: str) -> Plot:
    """Predicted tokens/s/GPU against the critical stage's peak device memory, one point per layout."""
    Figure = require_matplotlib()
    unit, div = byte_unit(gpu_memory or max((p["peak_device_bytes"] for p in points), default=1))
    fig = Figure(figsize=(10.5, 6.4), layout="constrained")
    ax = fig.add_subplot()
    plot = Plot(fig, ax, (unit, div))
    tps = sorted({p["tp"] for p in points})
    cmap = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3", "#8c8c8c"]
    for k, tp in enumerate(tps):
        sel = [p for p in points if p["tp"] == tp]
        plot.lines[("tp", tp)] = ax.scatter([p["peak_device_bytes"] / div for p in sel],
                                            [p["tokens_per_s_per_gpu"] for p in sel], s=18, alpha=0.75,
                                            color=cmap[k % len(cmap)], label=f"TP{tp}", zorder=3, linewidths=0)
    front = sorted((p for p in points if p["pareto"]), key=lambda p: p["peak_device_bytes"])
    if front:
        xs = [p["peak_device_bytes"] / div for p in front]
        ys = [p["tokens_per_s_per_gpu"] for p in front]
        plot.lines["pareto"] = ax.plot(xs, ys, color="#222222", linewidth=1.2, drawstyle="steps-post", zorder=4,
                                       marker="o", markerfacecolor="none", markersize=9, markeredgewidth=1.3,
                                       label=f"Pareto front ({len(front)})")[0]
    if points:
        best = next((p for p in points if p["rank"] == 1), points[0])
        bx, by = best["peak_device_bytes"] / div, best["tokens_per_s_per_gpu"]
        plot.lines["chosen"] = ax.plot([bx], [by], marker="*", markersize=17, color="#f1c40f", markeredgecolor="#222222",
                                       linestyle="none", zorder=6, label="chosen (#1)")[0]
        plot.data["chosen_annotation"] = ax.annotate(
            f"#1 {best['label']}", (bx, by), xytext=(-14, 16), textcoords="offset points", ha="right", va="bottom",
            fontsize=9, fontweight="bold", arrowprops={"arrowstyle": "->", "color": "#222222", "linewidth": 1.0},
            bbox={"boxstyle": "round,pad=0.3", "fc": "#fffbe6", "ec": "#c9a800"}, zorder=7)
    if gpu_memory:
        plot.lines["threshold"] = ax.axvline(gpu_memory * threshold / div, color=THRESHOLD_COLOUR, linestyle="--",
                                             linewidth=1.4, label=f"threshold {threshold:.0%} = "
                                             f"{format_bytes(gpu_memory * threshold)}")
        plot.lines["capacity"] = ax.axvline(gpu_memory / div, color=CAPACITY_COLOUR, linewidth=1.6,
                                            label=f"GPU capacity {format_bytes(gpu_memory)}")
        ax.set_xlim(0, gpu_memory / div * 1.04)
    ys = [p["tokens_per_s_per_gpu"] for p in points] or [0.0, 1.0]
    lo, hi = min(ys), max(ys)
    pad = max(hi - lo, 0.02 * hi, 1e-9)
    ax.set_ylim(max(0.0, lo - 0.15 * pad), hi + 0.35 * pad)     # room above for the chosen layout's label
    ax.set_xlabel(f"predicted peak memory of the critical stage, device total ({unit})")
    ax.set_ylabel("predicted tokens / s / GPU")
    ax.grid(color="#ececec", zorder=0)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8.5, frameon=False)
    fig.suptitle(_wrap(title, 10.5 * 9.5), fontsize=11.5, fontweight="bold")
    ax.set_title(_wrap(caption, 8.0 * 13), fontsize=8.5, color="#444444")
    plot.caption = caption
    plot.data["points"] = list(points)
    return plot


def plan_html(plot: Plot, title: str, subtitle: str) -> str:
    from . import html as H

    pts = plot.data["points"]
    front = sorted((p for p in pts if p["pareto"]), key=lambda p: p["peak_device_bytes"])

    def row(p):
        return [H.Cell(p["rank"], p["rank"]), p["label"], p["name"],
                H.Cell(format_bytes(p["peak_device_bytes"]), p["peak_device_bytes"]),
                H.Cell(f"{p['tokens_per_s_per_gpu']:,.0f}", round(p["tokens_per_s_per_gpu"], 3)),
                H.Cell(f"{p['mfu']:.1%}", round(p["mfu"], 6)), "yes" if p["pareto"] else ""]

    header = ["#", "layout", "--explain", "peak memory", "tok/s/GPU", "MFU", "Pareto"]
    body = [f"<h1>{H.esc(title)}</h1>", f"<p class=\"sub\">{H.esc(subtitle)}</p>", H.figure(plot.fig, plot.caption),
            "<h2>Pareto front (less memory or more throughput than every other layout)</h2>",
            H.table(header, [row(p) for p in front], "pareto"),
            f"<h2>Every layout plotted ({len(pts)})</h2>", H.table(header, [row(p) for p in pts], "layouts")]
    return H.page(title, body)
