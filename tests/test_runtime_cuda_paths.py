"""The CUDA-only paths of the runtime monitor, with torch.cuda's functions stood in for: the memory
source reads the caching allocator's counters of the current device, and the out-of-memory observer
prints the rank's prediction next to PyTorch's error. (No GPU here; the stand-ins return fixed bytes.)"""
import sys

import pytest

torch = pytest.importorskip("torch")

from megatron_memguard import _integration  # noqa: E402
from megatron_memguard.runtime import CallbackSink, MemoryMonitor, Prediction  # noqa: E402
from megatron_memguard.runtime.sources import CudaMemorySource  # noqa: E402

from test_runtime_monitor import EST  # noqa: E402

MiB = 2**20


@pytest.fixture
def fake_cuda(monkeypatch):
    calls = {"reset": []}
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d=None: 100 * MiB)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d=None: 300 * MiB)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d=None: 400 * MiB)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda d=None: 500 * MiB)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda d=None: calls["reset"].append(d))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (20 * 1024 * MiB, 80 * 1024 * MiB))
    return calls


def test_reads_the_allocator_counters_of_the_current_device(fake_cuda, monkeypatch):
    seen = []

    def used(d):
        seen.append(d)
        return 700 * MiB
    monkeypatch.setattr(torch.cuda, "device_memory_used", used, raising=False)
    src = CudaMemorySource()
    r = src.read()
    assert (r.allocated, r.max_allocated, r.reserved, r.max_reserved, r.device_used) == (
        100 * MiB, 300 * MiB, 400 * MiB, 500 * MiB, 700 * MiB)
    assert set(seen) == {3}
    src.reset_peak()
    assert fake_cuda["reset"] == [3]


def test_device_memory_falls_back_to_mem_get_info(fake_cuda, monkeypatch):
    def no_nvml(d):
        raise RuntimeError("pynvml is not installed")
    monkeypatch.setattr(torch.cuda, "device_memory_used", no_nvml, raising=False)
    r = CudaMemorySource(device=1).read()
    assert r.device_used == 60 * 1024 * MiB          # total 80 GiB - free 20 GiB
    assert CudaMemorySource(device_used=False).read().device_used is None


def test_oom_observer_prints_the_prediction_once(monkeypatch):
    observers = []
    monkeypatch.setattr(torch._C, "_cuda_attach_out_of_memory_observer", observers.append, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(_integration._OOM, "attached", False)
    lines, records = [], []
    m = MemoryMonitor(None, Prediction.from_estimate(EST, 1), rank=5, interval=10, sinks=[CallbackSink(records.append)],
                      emit=lines.append, emit_error=lines.append)
    _integration.attach_oom_observer(m)
    assert len(observers) == 1 and "torch" in sys.modules
    observers[0](0, 2 * 1024 * MiB, 70 * 1024 * MiB, 1 * 1024 * MiB)     # device, alloc, device_alloc, device_free
    observers[0](0, 2 * 1024 * MiB, 70 * 1024 * MiB, 1 * 1024 * MiB)
    text = "\n".join(lines)
    assert text.count("ran out of GPU memory") == 1
    assert "rank 5 (pp1) ran out of GPU memory allocating 2.00 GiB (70.00 GiB allocated on the device, 1.00 GiB free)" in text
    assert "memguard predicted for this rank: peak allocated" in text and "parameters" in text
    oom = [r for r in records if r["event"] == "oom"]
    assert len(oom) == 1 and oom[0]["alloc_bytes"] == 2 * 1024 * MiB
    assert oom[0]["predicted"]["peak_allocated"] == EST.stages[1].peak_allocated_bytes
    # a second attach only swaps the monitor; the observer stays single
    _integration.attach_oom_observer(m)
    assert len(observers) == 1


def test_is_oom():
    assert _integration.is_oom(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert _integration.is_oom(RuntimeError("CUDA error: out of memory"))
    assert not _integration.is_oom(RuntimeError("shape mismatch"))
