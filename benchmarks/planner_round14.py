"""Issue 18, round 14: the smallest move of the planner's default constants that fixes LLaMA-13B s2048 on 32 GPUs?

    python benchmarks/planner_round14.py [--write]

Round 13 found that sweep's miss (the time rule's Spearman 0.67 against ``--rule fujii2024``'s 0.69) is where the
defaults sit. This scans the constants the planner has (round 13's boxes, without the extension-only overlap shares,
element-wise scale and the Hagemann cluster's network, which are not planner defaults): each alone over its box, then
each together with the GEMM efficiency at the values the frameworks' own runs fit (round 11, A100: 0.63-0.69). A move
"fixes" when that sweep's Spearman reaches the rule's and every target that holds at the defaults still holds. For
each constant with an independent value (a paper's or vendor's measurement) it says whether that value fixes. It also
prints the two ratios of predicted steps the sweep's figure turns on (the tie window's edge, docs/planner.md section
5.2, round 14). Evaluation as round 13's (``planner_round13.figures``); nothing here is in the planner.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from typing import Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import planner_round13 as r13  # noqa: E402

RESULTS = os.path.join(ROOT, "benchmarks", "results", "planner-round14.md")
# round 13's variables that are not constants of the planner (the script's extensions or a sweep's description)
NOT_ADOPTABLE = frozenset({"elementwise_scale", "tp_overlap_megatron", "tp_overlap_hagemann", "cp_overlap",
                           "dp_overlap", "hagemann_network_gbps"})
# values measured independently of the sweeps' rankings: constant -> ((value, source), ...)
SOURCES: dict[str, tuple[tuple[float, str], ...]] = {
    "gemm_efficiency": ((0.64, "round 11: both frameworks' runs fit 0.63-0.64 (Hagemann) / 0.64-0.69 (Megatron)"),
                        (0.69, "round 11: the Megatron folds' upper end")),
    "attention_efficiency": ((0.50, "FlashAttention-2 on A100: 50-73% of peak (Dao 2023, arXiv 2307.08691)"),
                             (0.73, "the same, its forward peak")),
    "attn_bwd_ratio": (
        (2.5 * 73 / 63, "FlashAttention-2 on A100 up to 73% of peak forward, 63% backward (Dao 2023): 2.5 x 73 / 63"),),
    "kernel_gap": ((1e-6, "about 1 us between back-to-back kernels (NVIDIA's CUDA Graphs post, 2019)"),),
}
ROUND11_GEMM = (0.64, 0.665, 0.69)
# the sweep's pairs at the tie window's edge (labels of planner_quality's runs): (slower, faster)
EDGE_PAIRS = (("TP2 CP1 PP2 MBS1 SP", "TP2 CP1 PP2 MBS2 noSP"), ("TP2 CP1 PP1 MBS1 SP", "TP2 CP1 PP2 MBS4 noSP"))


def grid(p: r13.Param, n: int) -> list[float]:
    """``n`` points over the constant's box (log-spaced for the log ones; every choice of a categorical one)."""
    if p.choices:
        return [float(i) for i in range(len(p.choices))]
    if p.log:
        lo, hi = math.log(p.lower), math.log(p.upper)
        return [math.exp(lo + (hi - lo) * i / (n - 1)) for i in range(n)]
    return [p.lower + (p.upper - p.lower) * i / (n - 1) for i in range(n)]


def intervals(points: Sequence[tuple[float, bool]]) -> list[tuple[float, float]]:
    """The runs of consecutive ``True`` grid points as (first, last) values, in the order given."""
    out: list[tuple[float, float]] = []
    start = last = None
    for v, ok in points:
        if ok:
            start = v if start is None else start
            last = v
        elif start is not None:
            out.append((start, last))
            start = None
    if start is not None:
        out.append((start, last))
    return out


class Evaluator:
    """Round 13's figures for vectors that move a few constants from the defaults, judged against the targets that
    hold at the defaults."""

    def __init__(self) -> None:
        self.preps = r13.prepare()
        r13.check_default(self.preps)
        self.i13 = next(i for i, p in enumerate(self.preps) if p.sweep.name == r13.MISS_13B)
        self.base = r13.figures(self.preps, r13.DEFAULT)
        self.held = frozenset(k for k, m in self.base.margins().items() if m >= 0)
        self.count = 0

    def theta(self, moves: dict[str, float]) -> tuple[float, ...]:
        th = list(r13.DEFAULT)
        for k, v in moves.items():
            th[r13.P_INDEX[k]] = v
        return tuple(th)

    def judge(self, moves: dict[str, float]) -> tuple[float, list[str]]:
        """(the 13B sweep's Spearman less the rule's, the targets held at the defaults that break)."""
        self.count += 1
        fig = r13.figures(self.preps, self.theta(moves))
        m = fig.margins()
        broken = [r13.target_label(k, self.preps) for k in sorted(self.held) if m[k] < 0]
        return fig.rho[self.i13] - fig.rho_rule[self.i13], broken

    def edge_ratios(self, moves: dict[str, float]) -> list[float]:
        prep = self.preps[self.i13]
        secs = {s.run.label: s.seconds for s in r13.retime(prep, self.theta(moves)) if s.seconds is not None}
        return [secs[a] / secs[b] for a, b in EDGE_PAIRS]


def _fmt(name: str, v: float) -> str:
    p = r13.PARAMS[r13.P_INDEX[name]]
    if p.choices:
        return str(p.choices[int(round(v))])
    if "latency" in name or name == "kernel_gap":
        return f"{v * 1e6:.3g} us"
    if name == "ddp_min_bucket":
        return f"{v / 1e6:.0f}M"
    return f"{v:.4g}"


def _fmt_intervals(name: str, iv: list[tuple[float, float]]) -> str:
    if not iv:
        return "none"
    return ", ".join(_fmt(name, a) if a == b else f"{_fmt(name, a)} - {_fmt(name, b)}" for a, b in iv)


def one_constant(ev: Evaluator, n: int) -> list[str]:
    lines = ["## One constant moved (each over its round-13 box)", "",
             f"{n} grid points a constant (log-spaced for the scale-like ones). `fixes`: the sweep's Spearman reaches "
             "the rule's with every target that holds at the defaults still held; the best gain over the rule in "
             "brackets.", "",
             "| constant | default | fixes at | gain | independent value: fixes? |", "| --- | --- | --- | --- | --- |"]
    fine: dict[str, tuple[float, float] | None] = {}
    for p in r13.PARAMS:
        if p.name in NOT_ADOPTABLE:
            continue
        pts, gain = [], -math.inf
        for v in grid(p, n):
            d, broken = ev.judge({p.name: v})
            ok = d >= -1e-9 and not broken
            pts.append((v, ok))
            if ok:
                gain = max(gain, d)
        src = []
        for v, why in SOURCES.get(p.name, ()):
            d, broken = ev.judge({p.name: v})
            src.append(f"{_fmt(p.name, v)} ({why}): {'yes' if d >= -1e-9 and not broken else f'no, {d:+.3f}'}"
                       + (f", breaks {'; '.join(broken)}" if broken else ""))
        lines.append(f"| {p.name} | {_fmt(p.name, p.default)} | {_fmt_intervals(p.name, intervals(pts))} | "
                     f"{'+%.3f' % gain if gain > -math.inf else '-'} | {'<br>'.join(src) or '-'} |")
        if not p.choices:
            fine[p.name] = _fine_span(p, pts)
    lines += ["", f"Finer ({FINE} points between the grid points around the fixes; the tie window around its default):",
              ""]
    for name, span in fine.items():
        if span is None:
            continue
        lo, hi = span
        pts = []
        for i in range(FINE):
            v = lo + (hi - lo) * i / (FINE - 1)
            d, broken = ev.judge({name: v})
            pts.append((v, d >= -1e-9 and not broken))
        lines.append(f"- {name} {_fmt(name, lo)} - {_fmt(name, hi)}: fixes at {_fmt_intervals(name, intervals(pts))}")
    return lines


FINE = 41


def _fine_span(p: r13.Param, pts: list[tuple[float, bool]]) -> tuple[float, float] | None:
    """The grid points just outside the fixing ones (the tie window: 3.5-4.5% around its 4%)."""
    if p.name == "tie_window":
        return (0.035, 0.045)
    idx = [i for i, (_, ok) in enumerate(pts) if ok]
    if not idx:
        return None
    return pts[max(0, idx[0] - 1)][0], pts[min(len(pts) - 1, idx[-1] + 1)][0]


def two_constants(ev: Evaluator, n: int) -> list[str]:
    lines = ["", "## The GEMM efficiency at the frameworks' fitted values (round 11) and one more constant", "",
             "| GEMM efficiency | alone | with one more constant: fixes at |", "| --- | --- | --- |"]
    for g in ROUND11_GEMM:
        d0, b0 = ev.judge({"gemm_efficiency": g})
        found = []
        for p in r13.PARAMS:
            if p.name in NOT_ADOPTABLE or p.name == "gemm_efficiency":
                continue
            pts = []
            for v in grid(p, n):
                d, broken = ev.judge({"gemm_efficiency": g, p.name: v})
                pts.append((v, d >= -1e-9 and not broken))
            iv = intervals(pts)
            if iv:
                found.append(f"{p.name} {_fmt_intervals(p.name, iv)}")
        alone = f"{d0:+.3f}" + (f", breaks {'; '.join(b0)}" if b0 else "")
        lines.append(f"| {g:g} | {alone} | {'; '.join(found) or 'none'} |")
    windows = (0.045, 0.0475, 0.05, 0.0525)
    lines += ["", "The GEMM efficiency with the tie window (Spearman - rule's; `xN`: N held targets broken):", "",
              "| GEMM efficiency | " + " | ".join(f"window {w:.2%}" for w in windows) + " |",
              "| --- |" + " --- |" * len(windows)]
    for g in (0.62, 0.64, 0.66, 0.68, 0.69):
        cells = []
        for w in windows:
            d, broken = ev.judge({"gemm_efficiency": g, "tie_window": w})
            cells.append(f"{d:+.3f}" + (f" x{len(broken)}" if broken else ""))
        lines.append(f"| {g:g} | " + " | ".join(cells) + " |")
    return lines


def edge(ev: Evaluator) -> list[str]:
    pairs = " and ".join(f"{a} / {b}" for a, b in EDGE_PAIRS)
    lines = ["", "## The tie window's edge", "",
             f"Predicted step ratios of {pairs} (the window: {r13.value(r13.DEFAULT, 'tie_window'):.2f}); the "
             "sweep ties the rule when the first exceeds 1 + window and the second does not.", "",
             "| vector | ratios | Spearman - rule's |", "| --- | --- | --- |"]
    for moves in ({}, {"gemm_efficiency": 0.7275}, {"gemm_efficiency": 0.73}, {"gemm_efficiency": 0.7575},
                  {"gemm_efficiency": 0.76}):
        d, _ = ev.judge(moves)
        label = ", ".join(f"{k}={v:g}" for k, v in moves.items()) or "defaults"
        lines.append(f"| {label} | {' / '.join(f'{x:.5f}' for x in ev.edge_ratios(moves))} | {d:+.3f} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--points", type=int, default=25, help="grid points a constant alone (default 25)")
    ap.add_argument("--points2", type=int, default=17, help="grid points of the second constant (default 17)")
    ap.add_argument("--write", action="store_true", help=f"write {os.path.relpath(RESULTS, ROOT)}")
    ns = ap.parse_args(argv)
    t0 = time.process_time()
    ev = Evaluator()
    d, _ = ev.judge({})
    head = [f"At the defaults: {r13.MISS_13B} Spearman {ev.base.rho[ev.i13]:.3f} against "
            f"the rule's {ev.base.rho_rule[ev.i13]:.3f}; {len(ev.held)} of {len(ev.base.margins())} targets hold.", ""]
    body = head + one_constant(ev, ns.points) + two_constants(ev, ns.points2) + edge(ev)
    body.append(f"\n{ev.count} evaluations, {time.process_time() - t0:.0f} s CPU.")
    text = "\n".join(body)
    print(text)
    if ns.write:
        with open(RESULTS, "w") as fh:
            fh.write("# Planner round 14 (issue 18)\n\nWritten by `python benchmarks/planner_round14.py --write`; "
                     "docs/planner.md section 5.2.\n\n" + text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
