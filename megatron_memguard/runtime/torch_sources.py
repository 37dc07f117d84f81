"""The torch-backed memory sources (``runtime/sources.py`` describes all of them).

* ``CudaMemorySource``: ``torch.cuda.memory_allocated`` / ``max_memory_allocated`` / ``memory_reserved`` /
  ``max_memory_reserved`` of the current device, and the device memory in use.
* ``LiveBytesSource``: the CPU analogue of ``memory_allocated`` (a ``TorchDispatchMode``).

Kept apart from ``sources.py`` so that importing ``megatron_memguard.runtime`` reaches no torch import in its
source; torch itself is still imported only when a source is used.
"""
from __future__ import annotations

import threading
import weakref
from typing import Any, Callable

from .sources import MemorySource, Reading


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

    def describe(self) -> dict[str, Any] | None:
        """The device's name and total memory as PyTorch reports them (``memguard calibrate`` reads the GPU from
        them; Megatron's logs do not name it)."""
        import torch
        dev = self._dev()
        props = torch.cuda.get_device_properties(dev)
        return {"name": str(props.name), "total_memory": int(props.total_memory),
                "index": dev if isinstance(dev, int) else getattr(dev, "index", None)}

    def reset_peak(self) -> None:
        import torch
        torch.cuda.reset_peak_memory_stats(self._dev())


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
