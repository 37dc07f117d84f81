"""The framework-free runtime monitor with scripted sources (no torch, no Megatron)."""
import json

import pytest

from conftest import LLAMA31_8B
from megatron_memguard import estimate, layout_from_flags, lookup_gpu
from megatron_memguard.runtime import (CallbackSink, JsonlSink, MemoryMonitor, Prediction, Reading, Sink, StaticSource,
                                       WriterSink, suspect_term)
from megatron_memguard.units import GiB

EST = estimate(layout_from_flags(LLAMA31_8B + "--micro-batch-size 1 --tensor-model-parallel-size 2 "
                                 "--pipeline-model-parallel-size 2 --global-batch-size 16".split(), world_size=8),
               gpu=lookup_gpu("H100"))
PRED = Prediction.from_estimate(EST, 1)


def reading(scale=1.0, persistent_scale=1.0, reserved=None, device=None):
    alloc = int(PRED.persistent * persistent_scale)
    return Reading(allocated=alloc, max_allocated=int(PRED.peak_allocated * scale), reserved=alloc,
                   max_reserved=int(PRED.peak_reserved * (reserved or scale)), device_used=int(PRED.device_total * (device or scale)))


class Collect:
    def __init__(self):
        self.lines, self.records = [], []

    def emit(self, s):
        self.lines.append(s)

    def sink(self):
        return CallbackSink(self.records.append)


def monitor(source, c, **kw):
    return MemoryMonitor(source, PRED, rank=3, interval=kw.pop("interval", 10), sinks=[c.sink()], emit=c.emit,
                         emit_error=c.emit, **kw)


def test_samples_every_interval_and_summary():
    c = Collect()
    m = monitor(StaticSource(reading(0.9)), c, interval=10)
    m.start()
    for it in range(1, 31):
        m.step(it)
    s = m.finish()
    events = [r["event"] for r in c.records]
    assert events == ["start", "sample", "sample", "sample", "summary"]
    assert [r["iteration"] for r in c.records if r["event"] == "sample"] == [10, 20, 30]
    sample = c.records[1]
    assert sample["rank"] == 3 and sample["pp_rank"] == 1
    assert sample["predicted"]["peak_allocated"] == EST.stages[1].peak_allocated_bytes
    assert sample["ratio"]["max_allocated"] == pytest.approx(0.9, abs=1e-3)
    assert s["samples"] == 3 and s["warning"] is None and s["errors"] == 0
    assert c.records[0]["predicted"]["breakdown"]["parameters"] == EST.stages[1].breakdown["parameters"]
    assert m.finish() is None  # idempotent


def test_warns_once_above_tolerance_and_names_a_transient_term():
    c = Collect()
    m = monitor(StaticSource([reading(1.02), reading(1.10), reading(1.30)]), c, interval=1)
    for it in (1, 2, 3):
        m.step(it)
    warnings = [r for r in c.records if r["event"] == "warning"]
    assert len(warnings) == 1 and warnings[0]["iteration"] == 2
    assert warnings[0]["suspect"] in {t.name for t in PRED.terms if t.group in ("activations", "logits_loss", "transients")}
    assert len([line for line in c.lines if "WARNING" in line]) == 1
    assert "exceeds the predicted" in c.lines[-1] or any("exceeds the predicted" in l for l in c.lines)


def test_suspect_model_state_when_memory_between_iterations_is_too_high():
    term, why = suspect_term(PRED, reading(1.2, persistent_scale=1.2))
    assert term in {t.name for t in PRED.terms if t.group in ("weights", "gradients", "optimizer")}
    assert "between iterations" in why
    assert suspect_term(PRED, reading(1.0, reserved=1.3))[0] == "allocator_fragmentation"
    assert suspect_term(PRED, reading(1.0, reserved=1.0, device=1.4))[0] in ("cuda_context", "nccl_buffers")
    assert suspect_term(PRED, reading(1.0))[0] == "none"


def test_jsonl_is_flushed_each_write(tmp_path):
    path = JsonlSink.path_for(str(tmp_path / "logs"), 7)
    assert path.endswith("memguard-rank00007.jsonl")
    m = MemoryMonitor(StaticSource(reading(1.0)), PRED, rank=7, interval=1, sinks=[JsonlSink(path)], emit=lambda s: None)
    m.start()
    m.step(1)
    lines = open(path).read().splitlines()   # readable while the monitor still holds the file
    assert [json.loads(l)["event"] for l in lines] == ["start", "sample"]
    rec = json.loads(lines[1])
    assert rec["schema"] == "memguard.runtime/1" and rec["actual"]["max_allocated"] == int(PRED.peak_allocated)
    m.finish()
    assert json.loads(open(path).read().splitlines()[-1])["event"] == "summary"


def test_errors_are_logged_once_and_training_continues():
    class Broken(Sink):
        def write(self, record):
            raise OSError("disk full")

    class Flaky(StaticSource):
        def read(self):
            raise RuntimeError("driver hiccup")

    c = Collect()
    m = MemoryMonitor(StaticSource(reading(1.0)), PRED, interval=1, sinks=[Broken(), c.sink()], emit=c.emit, emit_error=c.emit)
    for it in range(1, 6):
        m.step(it)
    m.finish()
    errs = [l for l in c.lines if "internal error" in l]
    assert len(errs) == 1 and "disk full" in errs[0] and "training continues" in errs[0]
    assert m.errors >= 5 and len([r for r in c.records if r["event"] == "sample"]) == 5
    c2 = Collect()
    m2 = MemoryMonitor(Flaky(reading()), PRED, interval=1, sinks=[c2.sink()], emit=c2.emit, emit_error=c2.emit)
    for it in range(1, 4):
        m2.step(it)
    assert len([l for l in c2.lines if "driver hiccup" in l]) == 1
    assert m2.finish()["samples"] == 0


def test_gather_rows_give_one_line_per_stage_on_rank0():
    c = Collect()
    other = [1.0, 2 * GiB, 3 * GiB, -1.0, 2 * GiB, 3 * GiB, -1.0]
    calls = []

    def gather(vec):
        calls.append(vec)
        return [vec, other]

    m = MemoryMonitor(StaticSource(reading(0.5)), Prediction.from_estimate(EST, 0), rank=0, interval=5, emit=c.emit,
                      log_stages=True, stage_predictions=[Prediction.from_estimate(EST, i) for i in range(2)], gather=gather)
    for it in range(1, 11):
        m.step(it)
    assert len(calls) == 2 and calls[0][0] == 0.0
    lines = [l for l in c.lines if l.startswith("[memguard] iteration 10")]
    assert [l.split()[3] for l in lines] == ["pp0:", "pp1:"]
    assert "predicted" in lines[1] and "max reserved 3.00 GiB" in lines[1]
    m.finish()
    assert any(l.startswith("[memguard] summary pp1") for l in c.lines)


def test_gather_is_called_even_when_the_local_reading_fails():
    class Flaky(StaticSource):
        def read(self):
            raise RuntimeError("nope")

    calls = []
    m = MemoryMonitor(Flaky(reading()), PRED, interval=1, emit=lambda s: None, emit_error=lambda s: None,
                      gather=lambda v: calls.append(v) or [v])
    m.step(1)
    assert calls and calls[0][1:] == [-1.0] * 6


def test_gather_is_called_even_when_a_reading_is_not_a_number():
    calls, errors = [], []
    bad = Reading(allocated=1, max_allocated="lots", reserved=1, max_reserved=1, device_used=None)
    m = MemoryMonitor(StaticSource(bad), PRED, pp_rank=1, interval=1, emit=lambda s: None, emit_error=errors.append,
                      gather=lambda v: calls.append(v) or [v])
    m.step(1)
    m.step(2)
    assert calls == [[1.0] + [-1.0] * 6] * 2   # this rank took part in both all-gathers, with "no reading"
    assert m.gather is not None and m.errors >= 2 and len(errors) == 1


def test_reset_peak_after_each_sample():
    src = StaticSource(reading(0.5))
    m = MemoryMonitor(src, PRED, interval=2, reset_peak=True, emit=lambda s: None)
    for it in range(1, 7):
        m.step(it)
    assert src.resets == 3


def test_writer_sink_scalars():
    class TB:
        def __init__(self):
            self.scalars = []

        def add_scalar(self, tag, value, step):
            self.scalars.append((tag, value, step))

    class WB:
        def __init__(self):
            self.logged = []

        def log(self, values, step):
            self.logged.append((values, step))

    tb, wb = TB(), WB()
    m = MemoryMonitor(StaticSource(reading(1.0)), PRED, interval=1, sinks=[WriterSink(tb, wb)], emit=lambda s: None)
    m.start()
    m.step(5)
    tags = {t for t, _, _ in tb.scalars}
    assert {"memguard/max-allocated-bytes", "memguard/predicted-peak-allocated-bytes", "memguard/max-allocated-vs-predicted"} <= tags
    assert all(step == 5 for _, _, step in tb.scalars)
    assert wb.logged and wb.logged[0][1] == 5 and "memguard/device-used-bytes" in wb.logged[0][0]


def test_oom_message_carries_the_breakdown():
    c = Collect()
    m = monitor(StaticSource(reading()), c)
    m.on_oom(0, 2 * GiB, 70 * GiB, 1 * GiB)
    m.on_oom(0, 2 * GiB, 70 * GiB, 1 * GiB)  # printed once
    assert len(c.lines) == 1
    msg = c.lines[0]
    assert "rank 3 (pp1) ran out of GPU memory allocating 2.00 GiB" in msg
    assert "layer_activations" in msg and "= peak allocated" in msg
    assert [r["event"] for r in c.records] == ["oom"]


def test_no_prediction_still_logs_actuals():
    c = Collect()
    m = MemoryMonitor(StaticSource(reading()), None, pp_rank=0, interval=1, sinks=[c.sink()], emit=c.emit)
    m.step(1)
    assert c.records[0]["predicted"] is None and c.records[0]["actual"]["max_allocated"] > 0
    assert m.finish()["ratio"] is None


def test_errors_go_to_the_integrations_reporter():
    class Broken(Sink):
        def write(self, record):
            raise OSError("disk full")

    seen = []
    m = MemoryMonitor(StaticSource(reading()), PRED, interval=1, sinks=[Broken()], emit=lambda s: None,
                      emit_error=lambda s: seen.append(("printed", s)), on_error=lambda where, e: seen.append((where, str(e))))
    m.step(1)
    m.step(2)
    assert seen and all(kind != "printed" for kind, _ in seen) and seen[0][1] == "disk full"
    assert m.errors == len(seen)


def test_reserved_excess_names_a_cuda_graph_pool_when_it_is_the_largest_reserved_term():
    """--optimizer-cuda-graph / CUDA graphs: their private pools are reserved-only terms next to fragmentation; a
    reserved excess names the largest of them (it was always 'allocator_fragmentation')."""
    from megatron_memguard.estimator.result import Term
    from megatron_memguard.runtime import Reading
    GiB = 2**30
    pred = Prediction(pp_rank=0, peak_allocated=60 * GiB, peak_reserved=66 * GiB, device_total=70 * GiB,
                      persistent=30 * GiB,
                      terms=(Term("parameters", 30 * GiB, "weights", "allocated", ""),
                             Term("allocator_fragmentation", 1 * GiB, "allocator", "reserved", ""),
                             Term("optimizer_graph_pool", 5 * GiB, "allocator", "reserved", "")))
    r = Reading(allocated=30 * GiB, max_allocated=60 * GiB, reserved=30 * GiB, max_reserved=75 * GiB,
                device_used=70 * GiB)
    term, why = suspect_term(pred, r)
    assert term == "optimizer_graph_pool" and "CUDA graph" in why
    small = Prediction(**{**pred.__dict__, "terms": pred.terms[:2]})
    assert suspect_term(small, r)[0] == "allocator_fragmentation"
