"""memguard estimate --plot: stacked bars per stage, read back from the figure and from the files written."""
import os

import pytest

pytest.importorskip("matplotlib")

from megatron_memguard import estimate, layout_from_flags, lookup_gpu  # noqa: E402
from megatron_memguard.cli.main import main  # noqa: E402
from megatron_memguard.estimator.result import GROUPS  # noqa: E402
from megatron_memguard.report.html import is_offline  # noqa: E402
from megatron_memguard.report.plots import estimate_figure, write_estimate_plot  # noqa: E402

from conftest import LLAMA31_8B, LLAMA31_70B  # noqa: E402
from plot_util import decode_png, extents, html_tables, ink_fraction, inside, overlaps, renderer_of  # noqa: E402

VPP_FLAGS = LLAMA31_8B + ["--micro-batch-size", "1", "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size",
                          "4", "--num-layers-per-virtual-pipeline-stage", "2", "--global-batch-size", "64",
                          "--use-distributed-optimizer", "--sequence-parallel"]


def vpp_estimate(gpu="H100-80GB"):
    return estimate(layout_from_flags(VPP_FLAGS, world_size=32), gpu=lookup_gpu(gpu))


def sixteen_stage_estimate(vpp=False):
    if vpp:  # 80 layers over 16 stages, 5 virtual stages of one layer each
        flags = LLAMA31_70B + ["--micro-batch-size", "1", "--tensor-model-parallel-size", "8", "--sequence-parallel",
                               "--pipeline-model-parallel-size", "16", "--num-layers-per-virtual-pipeline-stage", "1",
                               "--global-batch-size", "128", "--use-distributed-optimizer"]
        return estimate(layout_from_flags(flags, world_size=128), gpu=lookup_gpu("H100-80GB"))
    flags = LLAMA31_8B + ["--micro-batch-size", "1", "--pipeline-model-parallel-size", "16", "--global-batch-size", "64",
                          "--decoder-first-pipeline-num-layers", "1", "--decoder-last-pipeline-num-layers", "3"]
    return estimate(layout_from_flags(flags, world_size=16), gpu=lookup_gpu("A100-40GB"))


def bar_bytes(plot, group, n):
    div = plot.unit[1]
    if group not in plot.bars:
        return [0.0] * n
    return [p.get_height() * div for p in plot.bars[group].patches]


@pytest.mark.parametrize("make", [vpp_estimate, sixteen_stage_estimate], ids=["pp4-vpp4", "pp16-uneven"])
def test_bar_heights_are_the_terms_summed_per_group(make):
    est = make()
    plot = estimate_figure(est)
    n = len(est.stages)
    assert len(plot.ax.patches) == n * len(plot.bars)           # nothing else drawn as a patch
    for g in GROUPS:
        expected = [sum(t.bytes for t in s.terms if t.group == g) for s in est.stages]
        assert bar_bytes(plot, g, n) == pytest.approx(expected, rel=1e-12, abs=1)
    # The segments stack: each starts where the one below ends, and the bar's top is the device total.
    for i, s in enumerate(est.stages):
        top = 0.0
        for g in plot.bars:
            p = plot.bars[g].patches[i]
            assert p.get_y() == pytest.approx(top, abs=1e-9)
            top += p.get_height()
        assert top * plot.unit[1] == pytest.approx(s.device_total_bytes, rel=1e-12)
    # Peak allocated ticks, GPU capacity and threshold lines at the estimate's values.
    ticks = plot.lines["peak_allocated"].get_segments()
    assert [seg[0][1] * plot.unit[1] for seg in ticks] == pytest.approx([s.peak_allocated_bytes for s in est.stages])
    assert plot.lines["capacity"].get_ydata()[0] * plot.unit[1] == pytest.approx(est.gpu_memory_bytes)
    assert plot.lines["threshold"].get_ydata()[0] * plot.unit[1] == pytest.approx(est.gpu_memory_bytes * est.threshold)
    title = plot.fig.get_suptitle()
    assert title.startswith(est.verdict.upper()) and f"pp{est.critical_stage}" in title
    labels = [t.get_text() for t in plot.ax.get_xticklabels()]
    assert labels[est.critical_stage].startswith(f"pp{est.critical_stage}")
    assert plot.ax.get_xticklabels()[est.critical_stage].get_fontweight() == "bold"


def test_vpp_stages_are_labelled_with_their_chunks():
    est = vpp_estimate()
    plot = estimate_figure(est)
    labels = [t.get_text() for t in plot.ax.get_xticklabels()]
    assert labels == [f"pp{i}\n4\u00d72 layers" for i in range(4)]
    assert "virtual stages" in plot.ax.get_xlabel()


@pytest.mark.parametrize("vpp", [False, True], ids=["uneven", "vpp"])
def test_sixteen_stages_stay_readable(vpp):
    est = sixteen_stage_estimate(vpp)
    assert len(est.stages) == 16
    plot = estimate_figure(est)
    r = renderer_of(plot.fig)
    ticks = extents(plot.ax.get_xticklabels(), r)
    assert len(ticks) == 16
    assert overlaps(ticks) == []
    # The percentages above the bars do not collide either, and nothing runs off the figure.
    pcts = extents([t for t in plot.ax.texts], r)
    assert len(pcts) == 16 and overlaps(pcts) == []
    fig_box = plot.fig.bbox
    legend = plot.ax.get_legend().get_window_extent(r)
    assert inside(legend, fig_box)
    assert inside(plot.fig._suptitle.get_window_extent(r), fig_box)
    assert inside(plot.ax.title.get_window_extent(r), fig_box)
    # The legend sits beside the bars, not over them.
    assert legend.x0 >= plot.ax.get_window_extent(r).x1
    assert all(inside(b, fig_box) for _, b in ticks)


def test_png_file_has_the_figure_size_and_is_not_blank(tmp_path):
    est = vpp_estimate()
    path = str(tmp_path / "est.png")
    plot = write_estimate_plot(est, path)
    img = decode_png(path)
    w, h = plot.size_px
    assert img.shape[:2] == (h, w)
    assert ink_fraction(img) > 0.05
    # Bars in the group colours are really there: count pixels of the activations colour.
    import numpy as np
    act = np.array([0xdd, 0x84, 0x52]) / 255.0
    assert (np.abs(img[..., :3] - act).max(axis=-1) < 0.02).mean() > 0.01


def test_svg_and_html_files(tmp_path):
    est = vpp_estimate()
    svg = tmp_path / "est.svg"
    write_estimate_plot(est, str(svg))
    text = svg.read_text()
    assert "<svg" in text and "</svg>" in text
    page = tmp_path / "est.html"
    write_estimate_plot(est, str(page))
    doc = page.read_text()
    assert doc.count("<svg") == 1 and is_offline(doc)
    tables = html_tables(doc)
    header, rows = tables["stages"]
    assert len(rows) == 4
    col = {h: i for i, h in enumerate(header)}
    for s, row in zip(est.stages, rows):
        assert int(row[col["peak allocated"]][1]) == s.peak_allocated_bytes
        assert int(row[col["device total"]][1]) == s.device_total_bytes
        assert int(row[col["activations"]][1]) == s.group_bytes("activations")
        assert row[2][0] == ", ".join(f"pp{s.pp_rank}.v{v}: 2" for v in range(4))
    _, terms = tables["critical-terms"]
    assert sorted(int(r[3][1]) for r in terms) == sorted(t.bytes for t in est.critical.terms)


def test_cli_plot_option(tmp_path, capsys):
    path = tmp_path / "est.png"
    code = main(["estimate", "--world-size", "32", "--gpu", "H100-80GB", "--plot", str(path), "--", *VPP_FLAGS])
    out = capsys.readouterr()
    assert code == 0 and "verdict: FITS" in out.out and f"plot written to {path}" in out.err
    img = decode_png(str(path))
    w, h = estimate_figure(vpp_estimate()).size_px
    assert img.shape[:2] == (h, w) and ink_fraction(img) > 0.05
    # With --json the document stays alone on stdout.
    code = main(["estimate", "--world-size", "32", "--json", "--plot", str(tmp_path / "e.html"), "--", *VPP_FLAGS])
    out = capsys.readouterr()
    import json
    assert code == 0 and json.loads(out.out)["verdict"] == "fits" and os.path.exists(tmp_path / "e.html")


def test_cli_plot_does_not_fit_and_no_gpu(tmp_path, capsys):
    est_path = tmp_path / "big.png"
    big = LLAMA31_70B + ["--micro-batch-size", "1", "--tensor-model-parallel-size", "8"]
    assert main(["estimate", "--world-size", "8", "--plot", str(est_path), "--", *big]) == 1
    assert decode_png(str(est_path)).shape[0] > 100
    # CPU device without GPU memory: no lines, the title says so.
    est = estimate(layout_from_flags(VPP_FLAGS, world_size=32), device="cpu")
    plot = estimate_figure(est)
    assert "capacity" not in plot.lines and "no GPU memory" in plot.fig.get_suptitle()
    capsys.readouterr()


@pytest.mark.parametrize("name,msg", [("est.pdf", "cannot tell the format"), ("est", "cannot tell the format"),
                                      ("missing-dir/est.png", "does not exist"), ("a-dir.png", "is a directory")])
def test_cli_plot_bad_file_names(tmp_path, capsys, name, msg):
    (tmp_path / "a-dir.png").mkdir()
    code = main(["estimate", "--world-size", "32", "--plot", str(tmp_path / name), "--", *VPP_FLAGS])
    out = capsys.readouterr()
    assert code == 2 and out.out == ""
    assert out.err.startswith("memguard: error: --plot:") and msg in out.err and out.err.count("\n") == 1


def test_html_without_virtual_stages_has_no_chunk_column(tmp_path):
    est = estimate(layout_from_flags(LLAMA31_8B + ["--micro-batch-size", "1", "--tensor-model-parallel-size", "2",
                                                   "--pipeline-model-parallel-size", "2", "--global-batch-size", "64",
                                                   "--use-distributed-optimizer", "--sequence-parallel"], world_size=8),
                   gpu=lookup_gpu("H100-80GB"))
    write_estimate_plot(est, str(tmp_path / "e.html"))
    header, rows = html_tables((tmp_path / "e.html").read_text())["stages"]
    assert header[:3] == ["stage", "layers", "weights"] and all(len(r) == len(header) for r in rows)
    assert [int(r[1][1]) for r in rows] == [s.num_layers for s in est.stages]


def test_a_failed_write_is_one_line(tmp_path, capsys, monkeypatch):
    from megatron_memguard.report import plots

    def full_disk(self, path, fmt=None):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(plots.Plot, "save", full_disk)
    code = main(["estimate", "--world-size", "32", "--plot", str(tmp_path / "e.png"), "--", *VPP_FLAGS])
    out = capsys.readouterr()
    assert code == 2
    assert out.err == f"memguard: error: --plot: cannot write {tmp_path / 'e.png'}: No space left on device\n"
