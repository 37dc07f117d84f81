"""memguard plan --plot: throughput against peak memory of the fitting layouts, Pareto front, chosen layout."""
import random
import re

import pytest

pytest.importorskip("matplotlib")

from megatron_memguard.cli.main import main  # noqa: E402
from megatron_memguard.cli.plan import _constraints, build_parser, make_planner, plot_plan  # noqa: E402
from megatron_memguard.report.html import is_offline  # noqa: E402
from megatron_memguard.report.plots import pareto_front, plan_points  # noqa: E402

from plot_util import decode_png, extents, html_tables, ink_fraction, overlaps, renderer_of  # noqa: E402

BASE = ["--gpus", "64", "--seq-length", "8192", "--global-batch-size", "512", "--model", "llama3.1-8b"]
SMALL = BASE + ["--tp", "1,2,4", "--pp", "1,2", "--cp", "1,2", "--mbs", "1,2"]   # a search that finishes quickly


def brute_front(points):
    return sorted(i for i, (x, y) in enumerate(points)
                  if not any((x2 <= x and y2 >= y) and (x2 < x or y2 > y) for x2, y2 in points))


def test_pareto_front_matches_brute_force():
    rng = random.Random(7)
    for _ in range(200):
        pts = [(rng.randint(1, 20), rng.randint(1, 20)) for _ in range(rng.randint(1, 25))]
        # Equal points: the brute force keeps all copies, the front keeps one; compare as sets of coordinates.
        assert {pts[i] for i in pareto_front(pts)} == {pts[i] for i in brute_front(pts)}
        xs = [pts[i][0] for i in pareto_front(pts)]
        assert xs == sorted(xs)


def same_points(a, b, rel=1e-9):
    a, b = sorted(a), sorted(b)
    return len(a) == len(b) and all(x1 == pytest.approx(x2, rel=rel) and y1 == pytest.approx(y2, rel=rel)
                                    for (x1, y1), (x2, y2) in zip(a, b))


def plan_and_plot(tmp_path, args, name="plan.png"):
    ns = build_parser().parse_args(args)
    planner = make_planner(ns, [])
    res = planner.plan(_constraints(ns), top=ns.plot_layouts or 10**9)
    path = str(tmp_path / name)
    plot = plot_plan(planner, res, path, name.rsplit(".", 1)[1])
    return res, plot, path


def test_points_front_and_chosen_come_from_the_plan(tmp_path):
    res, plot, path = plan_and_plot(tmp_path, SMALL + ["--plot-layouts", "all"])
    assert res.visited == res.considered and len(res.entries) > 10
    div = plot.unit[1]
    drawn = []
    for key, coll in plot.lines.items():
        if isinstance(key, tuple) and key[0] == "tp":
            drawn += [(round(x * div), y) for x, y in coll.get_offsets()]
    expected = [(e.estimate.peak_device_bytes, e.time.tokens_per_s_per_gpu) for e in res.entries]
    assert same_points(drawn, expected)
    # Every layout that fits is below the threshold line.
    assert all(x <= res.threshold * res.cluster.gpu_memory_bytes for x, _ in expected)
    front = plot.lines["pareto"]
    on_front = sorted(zip((x * div for x in front.get_xdata()), front.get_ydata()))
    assert same_points(on_front, {expected[i] for i in brute_front(expected)})
    best = res.entries[0]
    ann = plot.data["chosen_annotation"]
    assert ann.get_text() == f"#1 {best.candidate.label}"
    assert ann.xy[0] * div == pytest.approx(best.estimate.peak_device_bytes)
    assert ann.xy[1] == pytest.approx(best.time.tokens_per_s_per_gpu)
    # The fastest layout is always on the front.
    assert any(same_points([p], [(best.estimate.peak_device_bytes, best.time.tokens_per_s_per_gpu)]) for p in on_front)
    assert plot.caption.startswith(f"all {len(res.entries)} layouts that fit")
    img = decode_png(path)
    assert img.shape[:2] == plot.size_px[::-1] and ink_fraction(img) > 0.03
    r = renderer_of(plot.fig)
    assert overlaps(extents(plot.ax.get_xticklabels(), r)) == []
    assert plot.ax.get_legend().get_window_extent(r).x0 >= plot.ax.get_window_extent(r).x1


def test_top_n_caption_and_html(tmp_path):
    res, plot, path = plan_and_plot(tmp_path, BASE + ["--plot-layouts", "40"], "plan.html")
    assert len(res.entries) == 40 and res.visited < res.considered
    assert plot.caption.startswith("the 40 fastest layouts that fit (the search stopped there")
    doc = open(path).read()
    assert is_offline(doc) and doc.count("<svg") == 1
    tables = html_tables(doc)
    _, rows = tables["layouts"]
    assert [int(r[0][1]) for r in rows] == [e.rank for e in res.entries]
    assert [int(r[3][1]) for r in rows] == [e.estimate.peak_device_bytes for e in res.entries]
    pts = plan_points(res.entries)
    _, front = tables["pareto"]
    assert sorted(r[2][0] for r in front) == sorted(p["name"] for p in pts if p["pareto"])


def _table_rows(text):
    return [line for line in text.splitlines() if re.match(r"^\d+\s+TP", line)]


def test_cli_plot_keeps_the_table(tmp_path, capsys):
    assert main(["plan", *BASE]) == 0
    plain = capsys.readouterr().out
    path = tmp_path / "plan.svg"
    assert main(["plan", *BASE, "--plot", str(path), "--plot-layouts", "30"]) == 0
    out = capsys.readouterr()
    assert _table_rows(out.out) == _table_rows(plain) and len(_table_rows(plain)) == 5
    assert f"plot written to {path}" in out.err and "<svg" in path.read_text()


@pytest.mark.parametrize("extra,msg", [(["--explain", "tp=2,pp=1,vpp=1,cp=1,mbs=1,recompute=none"], "--explain"),
                                       (["--plot-layouts", "0"], "positive integer or 'all'")])
def test_cli_plot_errors(tmp_path, capsys, extra, msg):
    code = main(["plan", *BASE, "--plot", str(tmp_path / "p.png"), *extra])
    err = capsys.readouterr().err
    assert code == 2 and msg in err


def test_no_layout_fits(tmp_path, capsys):
    path = tmp_path / "none.png"
    code = main(["plan", "--gpus", "2", "--seq-length", "8192", "--global-batch-size", "64", "--model", "llama3.1-70b",
                 "--plot", str(path)])
    out = capsys.readouterr()
    assert code == 1 and "no layout fits." in out.out and path.exists()
    assert decode_png(str(path)).shape[0] > 100
