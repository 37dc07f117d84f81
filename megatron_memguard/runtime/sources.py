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

Nothing here imports torch until a torch-backed source is used.
"""
from __future__ import annotations

import threading
import weakref
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

    def reset_peak(self) -> None:
        """Make the next reading's peaks start from now."""

    def stop(self) -> None:
        """Stop measuring (called once training has ended)."""


class CudaMemorySource(MemorySource):
    name = "cuda"
    device = "gpu"

    def __init__(self, device: Any = None, device_used: bool = True):
        self._device = device
        self._want_device_used = device_used
        self._device_used_fn: Callable[[], int | None] | None = None

    def _dev(self):
        import torch
        return torch.cuda.current_device() if self._device is None else self._device

    def _pick_device_used(self) -> Callable[[], int | None]:
        import torch
        dev = self._dev()
        fn = getattr(torch.cuda, "device_memory_used", None)
        if fn is not None:
            try:
                fn(dev)
                return lambda: int(fn(dev))
            except Exception:
                pass

        def via_mem_get_info() -> int | None:
            free, total = torch.cuda.mem_get_info(dev)
            return int(total - free)
        return via_mem_get_info

    def read(self) -> Reading:
        import torch
        dev = self._dev()
        used = None
        if self._want_device_used:
            if self._device_used_fn is None:
                self._device_used_fn = self._pick_device_used()
            try:
                used = self._device_used_fn()
            except Exception:
                used = None
        return Reading(
            allocated=int(torch.cuda.memory_allocated(dev)),
            max_allocated=int(torch.cuda.max_memory_allocated(dev)),
            reserved=int(torch.cuda.memory_reserved(dev)),
            max_reserved=int(torch.cuda.max_memory_reserved(dev)),
            device_used=used,
        )

    def reset_peak(self) -> None:
        import torch
        torch.cuda.reset_peak_memory_stats(self._dev())


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


class LiveBytesSource(MemorySource):
    """Bytes of live tensor storages created while started (CPU analogue of memory_allocated).

    Storages are keyed by their C++ StorageImpl and released through ``weakref.finalize`` on the
    storage object; views and in-place results share their input's storage and are not counted
    twice. Not counted: storages that existed before ``start()`` (``track()`` adds them), memory a
    kernel allocates internally, tensors created on other threads outside the dispatch mode.
    """

    name = "cpu-live-bytes"
    device = "cpu"

    def __init__(self):
        self.current = 0
        self.peak = 0
        self.allocations = 0
        self._live: dict[int, tuple[object, int]] = {}
        self._lock = threading.RLock()
        self._mode = None

    # -- accounting ------------------------------------------------------------------------------
    def _add(self, storage) -> None:
        key = storage._cdata
        nbytes = int(storage.nbytes())
        with self._lock:
            ent = self._live.get(key)
            if ent is not None:
                if ent[1] != nbytes:  # resized in place
                    self.current += nbytes - ent[1]
                    self._live[key] = (ent[0], nbytes)
                    self.peak = max(self.peak, self.current)
                return
            if nbytes == 0:
                return
            token = object()
            self._live[key] = (token, nbytes)
            self.current += nbytes
            self.allocations += 1
            if self.current > self.peak:
                self.peak = self.current
        weakref.finalize(storage, self._free, key, token)

    def _free(self, key: int, token: object) -> None:
        with self._lock:
            ent = self._live.get(key)
            if ent is None or ent[0] is not token:
                return
            del self._live[key]
            self.current -= ent[1]

    def track(self, *tensors) -> None:
        """Count tensors that existed before ``start()``."""
        for t in tensors:
            s = _storage(t)
            if s is not None:
                self._add(s)

    # -- MemorySource ----------------------------------------------------------------------------
    def start(self) -> None:
        if self._mode is not None:
            return
        self._mode = _live_bytes_mode(self)
        self._mode.__enter__()

    def stop(self) -> None:
        if self._mode is not None:
            mode, self._mode = self._mode, None
            mode.__exit__(None, None, None)

    def read(self) -> Reading:
        with self._lock:
            return Reading(allocated=self.current, max_allocated=self.peak, reserved=self.current,
                           max_reserved=self.peak, device_used=None)

    def reset_peak(self) -> None:
        with self._lock:
            self.peak = self.current


def _storage(t):
    try:
        if t.is_meta or t.is_sparse or t.is_nested:
            return None
        return t.untyped_storage()
    except Exception:
        return None


def _live_bytes_mode(src: LiveBytesSource):
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class _LiveBytesMode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
            if not outs:
                return out
            inputs = set()
            for a in tree_flatten((args, kwargs))[0]:
                if isinstance(a, torch.Tensor):
                    s = _storage(a)
                    if s is not None:
                        inputs.add(s._cdata)
            for o in outs:
                s = _storage(o)
                if s is None:
                    continue
                key = s._cdata
                if key in inputs and key not in src._live:
                    continue  # a view of / in-place on a storage made before start()
                src._add(s)
            return out

    return _LiveBytesMode()
