"""Where the runtime monitor reads memory from: a pluggable source.

A source returns a ``Reading``: bytes allocated now and at peak, reserved now and at peak (the
caching allocator), and the device memory in use (what ``nvidia-smi`` shows), each ``None`` when the
source cannot tell. ``start()`` is called before the model is built (a tracking source begins
counting there), ``reset_peak()`` after a sample when per-interval peaks were asked for, ``stop()``
at the end.

* ``CudaMemorySource``: ``torch.cuda.memory_allocated`` / ``max_memory_allocated`` /
  ``memory_reserved`` / ``max_memory_reserved`` of the current device, and the device memory in use
  from ``torch.cuda.device_memory_used`` (NVML) or else ``torch.cuda.mem_get_info`` (total - free,
  device-wide: other processes on the GPU count too).
* ``LiveBytesSource``: the CPU analogue of ``memory_allocated`` for tests and CPU runs: a
  ``TorchDispatchMode`` that adds the bytes of every new tensor storage and subtracts them when the
  storage is freed (no allocator, so reserved equals allocated and there is no device total).
* ``StaticSource``: fixed or scripted readings (benchmarks, unit tests).

The two torch-backed sources live in ``runtime/torch_sources.py`` and are loaded on first use of their name
(``__getattr__`` below), so that this module, like the package, has no torch import anywhere in it:
``tests/framework_free.py`` reads that from the source.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterable


@dataclass(frozen=True)
class Reading:
    allocated: int | None = None
    max_allocated: int | None = None
    reserved: int | None = None
    max_reserved: int | None = None
    device_used: int | None = None

    def to_dict(self) -> dict:
        return asdict(self)


class MemorySource:
    """Base class. ``device`` is "gpu" (compare with GPU estimates) or "cpu" (estimates without GPU-only terms)."""

    name = "abstract"
    device = "gpu"

    def start(self) -> None:
        """Begin measuring (called before the model is built)."""

    def read(self) -> Reading:
        raise NotImplementedError

    def describe(self) -> dict[str, Any] | None:
        """The device measured (name, total memory), for the run log's ``start`` record; None when not a GPU."""
        return None

    def reset_peak(self) -> None:
        """Make the next reading's peaks start from now."""

    def stop(self) -> None:
        """Stop measuring (called once training has ended)."""


class StaticSource(MemorySource):
    """Readings from a list (the last one repeats) or from a callable; for tests and benchmarks."""

    name = "static"

    def __init__(self, readings: Reading | Iterable[Reading] | Callable[[], Reading], device: str = "gpu"):
        self.device = device
        if callable(readings):
            self._fn = readings
        else:
            seq = [readings] if isinstance(readings, Reading) else list(readings)
            state = {"i": 0}

            def nxt() -> Reading:
                r = seq[min(state["i"], len(seq) - 1)]
                state["i"] += 1
                return r
            self._fn = nxt
        self.resets = 0

    def read(self) -> Reading:
        return self._fn()

    def reset_peak(self) -> None:
        self.resets += 1


# names served by torch_sources.py (tests/framework_free.py follows an import in this __getattr__ only for a file
# that names one of them)
def __getattr__(name: str) -> Any:
    if name in ("CudaMemorySource", "LiveBytesSource"):
        from .torch_sources import CudaMemorySource, LiveBytesSource
        return CudaMemorySource if name == "CudaMemorySource" else LiveBytesSource
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
