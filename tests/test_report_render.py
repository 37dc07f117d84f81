"""memguard report --out: the figure's lines and the page's tables carry the JSONL's numbers."""
import json
import os

import pytest

pytest.importorskip("matplotlib")

from megatron_memguard.cli.main import main  # noqa: E402
from megatron_memguard.report.html import is_offline  # noqa: E402
from megatron_memguard.report.plots import report_figure  # noqa: E402
from megatron_memguard.report.runlog import read_run  # noqa: E402
from megatron_memguard.report.runreport import figure_table  # noqa: E402

from plot_util import decode_png, extents, html_tables, ink_fraction, inside, overlaps, renderer_of  # noqa: E402
from runlog_util import make_estimate, write_run  # noqa: E402

PAIRS = (("max_allocated", "peak_allocated"), ("max_reserved", "peak_reserved"), ("device_used", "device_total"))


def samples_of(log_dir):
    out = {}
    for name in sorted(os.listdir(log_dir)):
        with open(os.path.join(log_dir, name)) as f:
            recs = [json.loads(line) for line in f if line.strip()]
        out[recs[0]["rank"]] = [r for r in recs if r["event"] == "sample"]
    return out


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("run") / "logs"
    write_run(d, make_estimate(pp=4, world=16), ranks_per_stage=2, iterations=6, scales={3: 1.08, 6: 0.9})
    return d


def test_html_report_tables_equal_the_jsonl(run_dir, tmp_path, capsys):
    out = tmp_path / "report.html"
    assert main(["report", str(run_dir), "--out", str(out)]) == 1
    assert f"report written to {out}" in capsys.readouterr().err
    doc = out.read_text()
    assert is_offline(doc) and doc.count("<svg") == 1 and "result: OVER" in doc
    header, rows = html_tables(doc)["ranks"]
    col = {}
    for i, h in enumerate(header):
        col.setdefault(h, []).append(i)
    raw = samples_of(run_dir)
    assert [int(r[0][1]) for r in rows] == sorted(raw)
    for row in rows:
        samples = raw[int(row[0][1])]
        assert int(row[col["samples (iterations)"][0]][1]) == len(samples)
        for k, (a, p) in enumerate(PAIRS):
            pred_i = col[[h for h in header if h.endswith(" predicted")][k]][0]
            assert int(row[pred_i][1]) == samples[-1]["predicted"][p]
            assert int(row[pred_i + 1][1]) == max(s["actual"][a] for s in samples)
            err = max(s["actual"][a] / s["predicted"][p] for s in samples) - 1
            assert float(row[pred_i + 2][1]) == pytest.approx(err, abs=1e-6)
            assert row[pred_i + 2][0] == f"{err:+.1%}"
    # The stage table: worst error of each stage.
    _, srows = html_tables(doc)["stages"]
    assert [r[0][0] for r in srows] == ["pp0", "pp1", "pp2", "pp3"]
    worst_pp1 = max(s["actual"]["max_allocated"] / s["predicted"]["peak_allocated"] for r in (2, 3) for s in raw[r]) - 1
    assert float(srows[1][4][1]) == pytest.approx(worst_pp1, abs=1e-6)


def test_figure_lines_are_the_samples(run_dir):
    log = read_run(str(run_dir))
    plot = report_figure(log)
    div = plot.unit[1]
    raw = samples_of(run_dir)
    assert sorted(plot.axes) == [0, 1, 2, 3]
    for rank, samples in raw.items():
        for m in ("max_allocated", "max_reserved"):
            line = plot.lines[(rank, m)]
            assert list(line.get_xdata()) == [s["iteration"] for s in samples]
            assert [round(y * div) for y in line.get_ydata()] == [s["actual"][m] for s in samples]
            assert line.axes is plot.axes[samples[0]["pp_rank"]]
    # One dashed prediction per stage and metric (the stage's ranks share it), at the predicted bytes.
    preds = {k: v for k, v in plot.lines.items() if k[0] == "predicted"}
    assert len(preds) == 4 * 2
    for (_, rank, m), line in preds.items():
        p = dict(PAIRS)[m]
        assert {round(y * div) for y in line.get_ydata()} == {raw[rank][-1]["predicted"][p]}
        assert line.get_linestyle() == "--"
    # The stage with the over-predicted rank is flagged in its title.
    assert "+8.0%" in plot.axes[1].get_title(loc="right")
    assert plot.axes[1].get_title(loc="left") == "pp1"


def test_png_report(run_dir, tmp_path):
    out = tmp_path / "report.png"
    assert main(["report", str(run_dir), "--out", str(out)]) == 1
    img = decode_png(str(out))
    log = read_run(str(run_dir))
    plot = report_figure(log, table_rows=figure_table(log))
    assert img.shape[:2] == plot.size_px[::-1]
    assert ink_fraction(img) > 0.03
    # The table under the panels holds one row per rank, the over-tolerance errors in red.
    t = plot.data["table"]
    cells = t.get_celld()
    nrows = max(i for i, _ in cells)
    assert nrows == 8
    header = [cells[0, j].get_text().get_text() for j in range(len(figure_table(log)[0]))]
    err_col = header.index("error")
    assert cells[4, err_col].get_text().get_text() == "+8.0%"        # row 4 = rank 3
    assert cells[4, err_col].get_text().get_color() == "#c0392b"
    svg = tmp_path / "report.svg"
    assert main(["report", str(run_dir), "--out", str(svg)]) == 1
    assert "<svg" in svg.read_text()


def test_sixteen_stage_report_is_readable(tmp_path):
    d = tmp_path / "pp16"
    est = make_estimate(pp=16, tp=1, world=16, extra=["--num-layers", "32"])
    write_run(d, est, ranks_per_stage=1, iterations=4, scales={5: 1.1})
    log = read_run(str(d))
    plot = report_figure(log, table_rows=figure_table(log))
    r = renderer_of(plot.fig)
    texts = [plot.data["title"]]
    for ax in plot.axes.values():
        texts += [ax.title, ax._left_title, ax._right_title, ax.xaxis.label, ax.yaxis.label]
    boxes = extents(texts, r)
    assert len(plot.axes) == 16 and len(boxes) == 1 + 16 * 2 + 4 + 4   # titles; x labels on the bottom row, y on the left
    assert overlaps(boxes) == []
    fig_box = plot.fig.bbox
    assert all(inside(b, fig_box) for _, b in boxes)
    for ax in plot.axes.values():
        assert overlaps(extents(ax.get_xticklabels(), r)) == []
        assert overlaps(extents(ax.get_yticklabels(), r)) == []
    legend = plot.data["legend"].get_window_extent(r)
    assert all(not overlaps([("legend", legend), ("ax", ax.get_window_extent(r))]) for ax in plot.axes.values())
