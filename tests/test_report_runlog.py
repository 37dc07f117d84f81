"""Reading a run's runtime JSONL files (written by the real monitor and JSONL sink), and the terminal report."""
import json
import os

import pytest

from megatron_memguard.cli.main import main
from megatron_memguard.errors import ReaderError
from megatron_memguard.report.runlog import read_run
from megatron_memguard.report.runreport import render_text, to_json
from megatron_memguard.report.text import visible_len

from runlog_util import make_estimate, write_run

EST = make_estimate(pp=4, world=16)


def raw_records(log_dir):
    """What is in the files, parsed independently of the reader."""
    out = {}
    for name in sorted(os.listdir(log_dir)):
        with open(os.path.join(log_dir, name)) as f:
            recs = [json.loads(line) for line in f if line.strip()]
        out[recs[0]["rank"]] = recs
    return out


@pytest.fixture
def run_dir(tmp_path):
    d = tmp_path / "logs"
    write_run(d, EST, ranks_per_stage=2, iterations=5, scales={3: 1.08})
    return d


def test_reader_returns_the_files_numbers(run_dir):
    log = read_run(str(run_dir))
    raw = raw_records(run_dir)
    assert [r.rank for r in log.ranks] == sorted(raw) == list(range(8))
    assert sorted(log.stages) == [0, 1, 2, 3] and all(len(v) == 2 for v in log.stages.values())
    for r in log.ranks:
        samples = [x for x in raw[r.rank] if x["event"] == "sample"]
        assert r.pp_rank == samples[0]["pp_rank"] == r.rank // 2
        assert r.iterations == [x["iteration"] for x in samples] == [10, 20, 30, 40, 50]
        for m, p in (("max_allocated", "peak_allocated"), ("max_reserved", "peak_reserved"), ("device_used", "device_total")):
            assert [s.value(m) for s in r.samples] == [x["actual"][m] for x in samples]
            assert r.predicted(m) == samples[-1]["predicted"][p] == getattr(EST.stages[r.pp_rank], p + "_bytes" if p != "device_total" else "device_total_bytes")
            assert r.peak(m) == max(x["actual"][m] for x in samples)
            assert r.error(m) == pytest.approx(max(x["actual"][m] / x["predicted"][p] for x in samples) - 1, abs=1e-12)
            # The monitor's own rounded ratio agrees.
            assert r.error(m) == pytest.approx(max(x["ratio"][m] for x in samples) - 1, abs=1e-4)
        assert r.summary is not None and r.source == "static" and r.interval == 10
    assert [len(r.warnings) for r in log.ranks] == [0, 0, 0, 1, 0, 0, 0, 0]
    assert log.rank(3).exceeded(0.05) == ["max_allocated", "max_reserved", "device_used"]


def test_terminal_summary_and_exit_codes(run_dir, tmp_path, capsys):
    assert main(["report", str(run_dir)]) == 1
    out = capsys.readouterr().out
    assert out.startswith(f"memguard report - {run_dir}: 8 rank(s) in 4 pipeline stage(s), 5 sample(s) per rank")
    assert "\033[" not in out                       # not a terminal: no colour
    assert "result: OVER - 1 rank(s) exceeded their prediction by more than 5%: rank 3 (pp1)" in out
    assert "warning: rank 3 (pp1) iteration 30" in out and "suspected term:" in out
    row = next(line for line in out.splitlines() if line.startswith("3 "))
    assert "+8.0%" in row and "warned at 30" in row
    ok = tmp_path / "ok"
    write_run(ok, EST, ranks_per_stage=1, iterations=3)
    assert main(["report", str(ok)]) == 0
    assert "result: OK - every rank stayed within its prediction +5% (largest: -2.0%" in capsys.readouterr().out


def test_colour_only_when_asked_and_tables_stay_aligned(run_dir):
    log = read_run(str(run_dir))
    plain, coloured = render_text(log, colour=False), render_text(log, colour=True)
    assert "\033[31m+8.0%\033[0m" in coloured and "\033[" not in plain
    assert [visible_len(x) for x in coloured.splitlines()] == [len(x) for x in plain.splitlines()]


def test_json_output(run_dir, capsys):
    assert main(["report", str(run_dir), "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema"] == "memguard.report/1" and len(doc["ranks"]) == 8
    assert doc["result"]["ok"] is False and {o["rank"] for o in doc["result"]["over"]} == {3}
    r3 = doc["ranks"][3]
    assert r3["actual_max_allocated"] == max(x["actual"]["max_allocated"] for x in raw_records(run_dir)[3]
                                             if x["event"] == "sample")
    assert doc == to_json(read_run(str(run_dir)))


def test_large_runs_list_the_worst_ranks(tmp_path, capsys):
    d = tmp_path / "big"
    write_run(d, make_estimate(pp=2, world=8), ranks_per_stage=20, iterations=2, scales={33: 1.2})
    assert main(["report", str(d)]) == 1
    out = capsys.readouterr().out
    assert "the 10 of 40 ranks with the largest error (--all-ranks lists every rank):" in out
    first = out.split("the 10 of 40")[1].splitlines()[3]
    assert first.startswith("33 ")
    main(["report", str(d), "--all-ranks"])
    assert "per rank:" in capsys.readouterr().out


# ---- restarts, partial files ---------------------------------------------------------------------------
def test_restarted_job_shows_the_last_run_unless_asked(tmp_path):
    d = tmp_path / "restart"
    write_run(d, EST, ranks_per_stage=1, iterations=3, restart=True)
    last = read_run(str(d))
    assert all(r.segments == 2 and len(r.samples) == 3 for r in last.ranks)
    assert any("hold 2 runs" in n and "--run all" in n for n in last.notes)
    allrun = read_run(str(d), run="all")
    assert all(len(r.samples) == 6 for r in allrun.ranks)
    # The first run's peaks were 0.8x, the last run's are the larger ones either way.
    assert last.ranks[0].peak("max_allocated") == allrun.ranks[0].peak("max_allocated")


def test_a_run_that_stopped_early(tmp_path, capsys):
    d = tmp_path / "crash"
    write_run(d, EST, ranks_per_stage=1, iterations=2, finish=False)
    log = read_run(str(d))
    assert all(r.summary is None and len(r.samples) == 2 for r in log.ranks)
    # A rank that never sampled, and an empty file.
    (d / "memguard-rank00009.jsonl").write_text(json.dumps({"schema": "memguard.runtime/1", "event": "start", "rank": 9,
                                                            "pp_rank": 0, "time": 1.0, "predicted": None}) + "\n")
    (d / "memguard-rank00010.jsonl").write_text("")
    log = read_run(str(d))
    assert [r.rank for r in log.ranks] == [0, 1, 2, 3, 9]
    assert any("without samples" in n and "9" in n for n in log.notes)
    assert any("1 file(s) without records" in n for n in log.notes)
    assert main(["report", str(d)]) == 0
    out = capsys.readouterr().out
    assert "no samples" in out


# ---- bad input: file and line named --------------------------------------------------------------------
def _err(capsys, *argv):
    code = main(["report", *argv])
    out = capsys.readouterr()
    assert code == 2 and out.out == ""
    assert out.err.count("\n") == 1 and out.err.startswith("memguard: error: ")
    return out.err


def test_missing_and_empty_directories(tmp_path, capsys):
    # the command also reads Megatron's log files, so a missing path may have been either
    assert "nope: no such file or directory" in _err(capsys, str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    assert "no memguard-rank*.jsonl files in this directory" in _err(capsys, str(tmp_path / "empty"))
    (tmp_path / "blank").mkdir()
    (tmp_path / "blank" / "memguard-rank00000.jsonl").write_text("\n")
    assert "no memguard records in 1 file(s)" in _err(capsys, str(tmp_path / "blank"))
    with pytest.raises(ReaderError):
        read_run(str(tmp_path / "nope"))


def _break_line(path, n, text):
    lines = open(path).read().splitlines()
    lines[n - 1] = text
    open(path, "w").write("\n".join(lines) + "\n")


@pytest.mark.parametrize("text,why", [
    ('{"schema":"memguard.runtime/1","event":"sample","rank":1,', "not valid JSON"),
    ("[1, 2]", "expected a JSON object, got list"),
    ('{"event":"sample","rank":1}', "no 'schema' field"),
    ('{"schema":"memguard.runtime/2","event":"sample","rank":1}', "not a memguard.runtime/1 record"),
    ('{"schema":"memguard.runtime/1","event":"bogus","rank":1}', "unknown event 'bogus'"),
    ('{"schema":"memguard.runtime/1","event":"sample","rank":2,"iteration":5,"actual":{}}', "rank 2 in the file of rank 1"),
    ('{"schema":"memguard.runtime/1","event":"sample","rank":1,"actual":{}}', "without an integer 'iteration'"),
    ('{"schema":"memguard.runtime/1","event":"sample","rank":1,"iteration":5,"actual":{"max_allocated":"12GB"}}',
     "'actual.max_allocated': expected a number"),
    ('{"schema":"memguard.runtime/1","event":"sample","rank":1,"pp_rank":"a","iteration":5,"actual":{}}',
     "'pp_rank': expected a number, got 'a'"),
    ('{"schema":"memguard.runtime/1","event":"start","rank":1,"tolerance":"5%"}', "'tolerance': expected a number >= 0"),
    ('{"schema":"memguard.runtime/1","event":"start","rank":1,"source":3}', "'source': expected a string, got 3"),
    ('{"schema":"memguard.runtime/1","event":"warning","rank":1,"iteration":5,"actual_bytes":"big"}',
     "'actual_bytes': expected a number, got 'big'"),
    ('{"schema":"memguard.runtime/1","event":"oom","rank":1,"iteration":[5]}', "'iteration': expected a number"),
])
def test_malformed_lines_name_the_file_and_line(run_dir, capsys, text, why):
    path = run_dir / "memguard-rank00001.jsonl"
    _break_line(path, 3, text)
    err = _err(capsys, str(run_dir))
    assert f"{path} line 3: " in err and why in err and "--skip-bad-lines" in err


def test_samples_without_a_prediction(tmp_path, capsys):
    """The monitor writes ``"predicted": null`` when the run had no estimate: nothing to compare, no traceback."""
    d = tmp_path / "nopred"
    d.mkdir()
    recs = [{"schema": "memguard.runtime/1", "event": "start", "rank": 0, "pp_rank": 0, "tolerance": 0.05},
            {"schema": "memguard.runtime/1", "event": "sample", "rank": 0, "pp_rank": 0, "iteration": 10,
             "actual": {"max_allocated": 3 << 30}, "predicted": None}]
    (d / "memguard-rank00000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert main(["report", str(d)]) == 0
    out = capsys.readouterr().out
    assert "result: NO PREDICTION - " in out and "3.00 GiB" in out
    assert to_json(read_run(str(d)))["ranks"][0]["error_max_allocated"] is None
    pytest.importorskip("matplotlib")
    assert main(["report", str(d), "--out", str(tmp_path / "r.html")]) == 0
    assert '<h1 class="tight">result: NO PREDICTION - ' in (tmp_path / "r.html").read_text()


def test_skip_bad_lines_warns_and_goes_on(run_dir, capsys):
    path = run_dir / "memguard-rank00001.jsonl"
    _break_line(path, 3, "garbage")
    assert main(["report", str(run_dir), "--skip-bad-lines"]) == 1
    out = capsys.readouterr()
    assert f"memguard: warning: {path} line 3: not valid JSON" in out.err and "skipped" in out.err
    assert len(read_run(str(run_dir), skip_bad_lines=True).rank(1).samples) == 4


def test_duplicate_rank_and_files_given_directly(run_dir, tmp_path, capsys):
    other = tmp_path / "other"
    other.mkdir()
    (other / "memguard-rank00001.jsonl").write_text((run_dir / "memguard-rank00001.jsonl").read_text())
    err = _err(capsys, str(run_dir), str(other))
    assert "rank 1 is also in" in err
    log = read_run([str(run_dir / "memguard-rank00000.jsonl"), str(run_dir / "memguard-rank00003.jsonl")])
    assert [r.rank for r in log.ranks] == [0, 3]


def test_report_takes_no_megatron_flags(run_dir, capsys):
    assert main(["report", str(run_dir), "--", "--num-layers", "2"]) == 2
    assert "takes no flags after --" in capsys.readouterr().err


def test_cpu_live_bytes_run(tmp_path):
    """A real CPU run: the live-bytes source around tensor work, no device memory, reserved = allocated."""
    torch = pytest.importorskip("torch")
    from megatron_memguard.runtime import JsonlSink, LiveBytesSource, MemoryMonitor, Prediction
    est = make_estimate(pp=2, world=8)
    src = LiveBytesSource()
    src.start()
    try:
        keep = [torch.zeros(1024, 256) for _ in range(4)]
        pred = Prediction(pp_rank=0, peak_allocated=6 * 1024 * 256 * 4, peak_reserved=6 * 1024 * 256 * 4, device_total=0,
                          persistent=4 * 1024 * 256 * 4, terms=tuple(est.stages[0].terms), device="cpu")
        mon = MemoryMonitor(src, pred, rank=0, interval=1, sinks=[JsonlSink(JsonlSink.path_for(str(tmp_path), 0))],
                            emit=lambda s: None, emit_error=lambda s: None)
        mon.start()
        for it in range(1, 4):
            tmp = torch.ones(1024, 256 * it)
            mon.step(it)
            del tmp
        mon.finish()
    finally:
        src.stop()
    del keep
    log = read_run(str(tmp_path))
    r = log.ranks[0]
    assert r.source == "cpu-live-bytes" and r.iterations == [1, 2, 3]
    assert r.peak("device_used") is None and r.predicted("device_used") is None
    assert r.peak("max_allocated") >= 4 * 1024 * 256 * 4 + 3 * 1024 * 256 * 4
    text = render_text(log, colour=False)
    assert "device predicted" not in text and "alloc predicted" in text


def test_binary_garbage_is_a_bad_line_not_a_traceback(run_dir, capsys):
    path = run_dir / "memguard-rank00002.jsonl"
    lines = path.read_bytes().splitlines(keepends=True)
    lines[1] = b"\xff\xfe\x00\x9c binary\n"     # not UTF-8: a truncated or overwritten file
    path.write_bytes(b"".join(lines))
    assert main(["report", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert f"{path} line 2: not valid JSON" in err and "Traceback" not in err
