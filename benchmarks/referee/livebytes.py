"""Live tensor-storage byte tracker (the CPU analogue of torch.cuda.memory_allocated()).

`LiveBytesTracker` is a TorchDispatchMode. Every aten op that returns a tensor whose storage is
new (not shared with any tensor argument of the op and not already tracked) is recorded: the
storage's `nbytes()` is added to the current live total, and a `weakref.finalize` on the storage
subtracts it again when the storage dies. Storages are keyed by their C++ StorageImpl pointer
(`untyped_storage()._cdata`), which stays the same when a storage is resized in place; in-place
ops that resize a tracked storage (`resize_`, `set_`) are re-measured.

What is counted: the bytes of every storage created by an aten op while the mode is active
(forward, backward including recomputation, optimizer, collectives' outputs), without allocator
rounding. Not counted: storages that existed before the mode was entered, allocations made inside a
kernel (scratch buffers of a CPU kernel, gloo's internal buffers) and tensors created on other
threads (gloo work threads), because those do not pass through the Python dispatch key.

bf16 matrix products (mm, addmm, bmm, baddbmm) are computed in fp32 and rounded to bf16 by default: a CPU without
AVX-512 BF16 runs a bf16 GEMM about 40x slower than an fp32 one, and the product's storage (dtype, shape, the op
that made it) is the same either way; only the last bit of some values may differ, which moves nothing but
value-dependent choices (an MoE router's token counts per expert). MEMGUARD_REFEREE_EXACT_BF16=1 (or
``LiveBytesTracker(fp32_matmul=False)``) runs the bf16 kernels themselves.

Every allocation is logged with (sequence number of allocation, sequence number of free, nbytes,
creating op, dtype, shape, phase label). From this log the exact set of live storages at any moment
(e.g. the peak) is reconstructed afterwards, so no snapshot has to be taken while running.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from collections import defaultdict
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["Bf16MatmulsInFp32", "LiveBytesTracker", "format_bytes", "fp32_matmul_default"]

_aten = torch.ops.aten
# The bf16 matrix products computed in fp32 (the ops megatron-core's linear layers, attention and their backward
# reach on CPU; linear, matmul and einsum decompose into these before the dispatch mode sees them).
_FP32_MATMULS = frozenset((_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default))


def fp32_matmul_default() -> bool:
    """bf16 matrix products in fp32 unless MEMGUARD_REFEREE_EXACT_BF16=1 (the bf16 kernels' own arithmetic)."""
    value = os.environ.get("MEMGUARD_REFEREE_EXACT_BF16", "0")
    if value not in ("0", "1", ""):
        raise ValueError(f"MEMGUARD_REFEREE_EXACT_BF16={value!r}: use 1 (bf16 kernels) or 0 (fp32 products, the default)")
    return value != "1"


def _fp32_product(func, args, kwargs):
    """``func`` (a bf16 matrix product) computed in fp32, the result rounded once to bf16: a new contiguous
    storage of the bf16 kernel's dtype and shape. The fp32 operands are made here, where the mode is off, so they
    are not counted (a GPU's bf16 GEMM holds no fp32 copies either)."""
    up = [a.float() if isinstance(a, torch.Tensor) else a for a in args]
    return func(*up, **kwargs).to(torch.bfloat16)


def _is_bf16_product(func, args) -> bool:
    return func in _FP32_MATMULS and all(a.dtype == torch.bfloat16 for a in args if isinstance(a, torch.Tensor))


class Bf16MatmulsInFp32(TorchDispatchMode):
    """The tracker's fp32 arithmetic for bf16 matrix products on its own, for a run measured by another live-bytes
    counter (the hook's CPU e2e run, tests/e2e/pretrain_gpt_cpu.py). Enter it before the counter's mode: the counter
    then sees each product's bf16 result only, as it sees the bf16 kernel's."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _is_bf16_product(func, args):
            return _fp32_product(func, args, kwargs)
        return func(*args, **kwargs)


def format_bytes(n: float) -> str:
    """Human-readable MiB/KiB string (binary units)."""
    if abs(n) >= 1024 ** 2:
        return f"{n / 1024 ** 2:.2f} MiB"
    if abs(n) >= 1024:
        return f"{n / 1024:.1f} KiB"
    return f"{int(n)} B"


def _r512(n: int) -> int:
    return (n + 511) // 512 * 512


def _storage_of(t: torch.Tensor):
    # A DTensor (Megatron-FSDP's optimizer shards and their states) is a wrapper without memory of its
    # own; its local shard, made inside DTensor's dispatch where this mode is off, holds the bytes.
    local = getattr(t, "_local_tensor", None)
    if isinstance(local, torch.Tensor):
        t = local
    try:
        if t.is_meta or t.is_sparse or t.is_nested:
            return None
        return t.untyped_storage()
    except Exception:  # tensor subclasses / functional tensors without real storage
        return None


class _Region:
    __slots__ = ("name", "start_bytes", "peak", "peak_seq", "start_seq", "end_seq", "end_bytes",
                 "peak_r512")

    def __init__(self, name: str, current: int, seq: int, current_r512: int = 0):
        self.name = name
        self.peak_r512 = current_r512
        self.start_bytes = current
        self.peak = current
        self.peak_seq = seq
        self.start_seq = seq
        self.end_seq: Optional[int] = None
        self.end_bytes: Optional[int] = None


class LiveBytesTracker(TorchDispatchMode):
    """Tracks live tensor storage bytes; see module docstring.

    Use as a context manager (``with tracker: ...``). Phase labels are set with ``set_phase`` and
    are attached to each allocation. Named regions (``with tracker.region("iter1"):``) record their
    own peak (value and the moment it happened); regions can nest and overlap in time with others.
    """

    # Ops whose output aliases an input (views, in-place, out=) never create a new storage; this is
    # detected generically by comparing storages, so no op list is needed. Ops that may change the
    # size of an existing storage in place:
    _RESIZING_OPS = ("resize_", "set_", "resize_as_")

    def __init__(self, keep_log: bool = True, fp32_matmul: Optional[bool] = None):
        super().__init__()
        # see the module docstring; None: MEMGUARD_REFEREE_EXACT_BF16 decides
        self.fp32_matmul = fp32_matmul_default() if fp32_matmul is None else fp32_matmul
        self._lock = threading.RLock()
        self.current = 0
        self.peak = 0
        self.peak_seq = 0
        # The same accounting with every storage rounded up to the CUDA caching allocator's 512-byte
        # granularity (what torch.cuda.memory_allocated() would add per block, ignoring unsplit
        # remainders of large segments).
        self.current_r512 = 0
        self.peak_r512 = 0
        self.seq = 0  # increases on every allocation and every free
        self.phase = "init"
        self.keep_log = keep_log
        # key -> record index (live storages only)
        self._live: Dict[int, int] = {}
        # records: [alloc_seq, free_seq or None, nbytes, op, dtype, shape, phase]
        self.records: List[list] = []
        self._regions: Dict[str, _Region] = {}
        self._active: List[_Region] = []
        self.num_allocs = 0

    # ------------------------------------------------------------------ phases / regions
    def set_phase(self, phase: str) -> None:
        self.phase = phase

    @contextlib.contextmanager
    def region(self, name: str):
        """Record the peak of live bytes between entry and exit under `name`."""
        with self._lock:
            r = _Region(name, self.current, self.seq, self.current_r512)
            self._regions[name] = r
            self._active.append(r)
        try:
            yield r
        finally:
            with self._lock:
                r.end_seq = self.seq
                r.end_bytes = self.current
                self._active.remove(r)

    def region_result(self, name: str) -> Dict[str, Any]:
        r = self._regions[name]
        return {
            "start_bytes": r.start_bytes,
            "end_bytes": r.end_bytes,
            "peak_bytes": r.peak,
            "peak_seq": r.peak_seq,
            "peak_phase": self.phase_at(r.peak_seq),
            "peak_bytes_rounded512": r.peak_r512,
        }

    # ------------------------------------------------------------------ accounting
    def _on_alloc(self, key: int, nbytes: int, op: str, t: torch.Tensor, storage) -> None:
        with self._lock:
            self.seq += 1
            self.num_allocs += 1
            idx = len(self.records)
            self.records.append(
                [self.seq, None, nbytes, op, str(t.dtype).replace("torch.", ""), tuple(t.shape), self.phase]
            )
            token = object()
            self._live[key] = [idx, token]
            self.current += nbytes
            self.current_r512 += _r512(nbytes)
            self._update_peaks()
        weakref.finalize(storage, self._on_free, key, token)

    def _on_free(self, key: int, token) -> None:
        with self._lock:
            ent = self._live.get(key)
            if ent is None or ent[1] is not token:
                return
            del self._live[key]
            rec = self.records[ent[0]]
            self.seq += 1
            rec[1] = self.seq
            self.current -= rec[2]
            self.current_r512 -= _r512(rec[2])

    def _on_resize(self, key: int, nbytes: int) -> None:
        with self._lock:
            ent = self._live[key]
            rec = self.records[ent[0]]
            if rec[2] == nbytes:
                return
            # Model a resize as free of the old size + allocation of the new size.
            self.seq += 1
            rec[1] = self.seq
            new = list(rec)
            new[0] = self.seq
            new[1] = None
            new[2] = nbytes
            new[3] = rec[3] + "+resize"
            new[6] = self.phase
            self.current += nbytes - rec[2]
            self.current_r512 += _r512(nbytes) - _r512(rec[2])
            self.records.append(new)
            ent[0] = len(self.records) - 1
            self._update_peaks()

    def _on_storage_resize(self, storage) -> None:
        """A storage resized by its own ``resize_`` (``untyped_storage().resize_(0)``, TypedStorage ``_resize_``),
        which no aten op reports: megatron frees tensors that way while their Python objects live on (the
        combined 1F1B schedule's node inputs, pipeline_parallel/utils.py ScheduleNode; Megatron-FSDP's buckets,
        _free_storage / _alloc_storage; CheckpointWithoutOutput's output, tensor_parallel/random.py), as a GPU's
        caching allocator frees (or allocates) the block."""
        key = storage._cdata
        nbytes = storage.nbytes()
        with self._lock:
            if key in self._live:
                self._on_resize(key, nbytes)
                return
        if nbytes:
            # a storage created empty and grown in place: an allocation of its own
            self._on_alloc(key, nbytes, "storage_resize_", torch.empty(0, dtype=torch.uint8), storage)

    def __enter__(self):
        # (the storage method, called directly or through TypedStorage._resize_, bypasses the dispatcher)
        tracker, orig = self, torch.UntypedStorage.resize_
        self._storage_resize_orig = orig

        def resize_(storage, size):
            out = orig(storage, size)
            tracker._on_storage_resize(storage)
            return out

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            torch.UntypedStorage.resize_ = self._storage_resize_orig

    def _update_peaks(self) -> None:
        cur = self.current
        if self.current_r512 > self.peak_r512:
            self.peak_r512 = self.current_r512
        if cur > self.peak:
            self.peak = cur
            self.peak_seq = self.seq
        for r in self._active:
            if self.current_r512 > r.peak_r512:
                r.peak_r512 = self.current_r512
            if cur > r.peak:
                r.peak = cur
                r.peak_seq = self.seq

    def track(self, t: torch.Tensor, op: str = "manual") -> None:
        """Start tracking the storage of an already existing tensor (if not tracked yet)."""
        s = _storage_of(t)
        if s is None:
            return
        key = s._cdata
        if key in self._live or s.nbytes() == 0:
            return
        self._on_alloc(key, s.nbytes(), op, t, s)

    # ------------------------------------------------------------------ dispatch
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.fp32_matmul and _is_bf16_product(func, args):
            out = _fp32_product(func, args, kwargs)
        else:
            out = func(*args, **kwargs)
        flat_out, _ = tree_flatten(out)
        out_tensors = [o for o in flat_out if isinstance(o, torch.Tensor)]
        if not out_tensors:
            return out
        flat_in, _ = tree_flatten((args, kwargs))
        in_keys = set()
        for a in flat_in:
            if isinstance(a, torch.Tensor):
                s = _storage_of(a)
                if s is not None:
                    in_keys.add(s._cdata)
        name = None
        for o in out_tensors:
            s = _storage_of(o)
            if s is None:
                continue
            key = s._cdata
            if key in self._live:
                if key in in_keys:
                    if name is None:
                        name = func.__name__ if hasattr(func, "__name__") else str(func)
                    if name.split(".")[0] in self._RESIZING_OPS:
                        self._on_resize(key, s.nbytes())
                continue
            if key in in_keys:
                continue  # view / in-place on a storage that predates tracking
            nbytes = s.nbytes()
            if nbytes == 0:
                continue
            self._on_alloc(key, nbytes, str(func.overloadpacket.__name__) if hasattr(func, "overloadpacket") else str(func), o, s)
        return out

    # ------------------------------------------------------------------ queries
    def phase_at(self, seq: int) -> str:
        """Phase label of the most recent allocation at or before `seq`."""
        # records are appended in seq order of allocation
        lo, hi = 0, len(self.records) - 1
        ans = "init"
        while lo <= hi:
            mid = (lo + hi) // 2
            if self.records[mid][0] <= seq:
                ans = self.records[mid][6]
                lo = mid + 1
            else:
                hi = mid - 1
        return ans

    def live_at(self, seq: int) -> List[list]:
        """Records of storages live right after event `seq`."""
        return [r for r in self.records if r[0] <= seq and (r[1] is None or r[1] > seq)]

    def live_now(self) -> List[list]:
        with self._lock:
            return [self.records[e[0]] for e in self._live.values()]

    @staticmethod
    def group(records: List[list], top: Optional[int] = None, by_phase: bool = True) -> List[Dict[str, Any]]:
        """Group records by (op, dtype, shape[, phase]), largest total first."""
        groups: Dict[Tuple, List[int]] = defaultdict(lambda: [0, 0])
        for r in records:
            key = (r[3], r[4], r[5], r[6] if by_phase else "")
            g = groups[key]
            g[0] += 1
            g[1] += r[2]
        items = sorted(groups.items(), key=lambda kv: -kv[1][1])
        if top is not None:
            items = items[:top]
        return [
            {"op": k[0], "dtype": k[1], "shape": list(k[2]), "phase": k[3], "count": v[0], "bytes": v[1]}
            for k, v in items
        ]

    def dump(self, seq: Optional[int] = None, top: int = 25, by_phase: bool = True) -> List[Dict[str, Any]]:
        """Grouped live storages at moment `seq` (default: now)."""
        recs = self.live_now() if seq is None else self.live_at(seq)
        return self.group(recs, top=top, by_phase=by_phase)

    @staticmethod
    def format_dump(rows: List[Dict[str, Any]]) -> str:
        lines = []
        for g in rows:
            op = g["op"] if ":" in g["op"] else "aten." + g["op"]
            lines.append(
                f"{format_bytes(g['bytes']):>12}  {g['count']:>4}x {g['dtype']:<9} {str(g['shape']):<22} "
                f"from {op:<28} in phase {g['phase']}"
            )
        return "\n".join(lines)
