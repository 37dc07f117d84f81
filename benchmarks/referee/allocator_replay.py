"""Replay a referee allocation log through a model of PyTorch's CUDA caching allocator.

    python -m benchmarks.referee.allocator_replay LOG.rank0.json [LOG.rank1.json ...]

The referee counts the bytes each storage asks for. On a GPU, `torch.cuda.max_memory_allocated()` counts
the blocks the caching allocator hands out, and a block can be larger than the request: a cached block
is split only when the rest is worth keeping. This replays the log (written by the worker with the
setting ``referee_allocation_log``) under the rules of ``c10/cuda/CUDACachingAllocator.cpp`` (PyTorch
2.x defaults: no expandable segments, no ``max_split_size``, one stream) and prints, per iteration, the
peak of allocated blocks next to the peak of requested bytes. What it leaves out: other streams, the
allocations kernels make themselves (cuBLAS / TE workspaces), and the order in which a GPU frees memory
of tensors used on a side stream.
"""

from __future__ import annotations

import bisect
import json
import sys
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

# CUDACachingAllocator.cpp (PyTorch 2.x) constants
MIN_BLOCK = 512            # kMinBlockSize: every request rounds up to a multiple of 512 bytes
SMALL_SIZE = 1 << 20       # kSmallSize: requests up to 1 MiB use the small pool
SMALL_BUFFER = 2 << 20     # kSmallBuffer: small-pool segments are 2 MiB
LARGE_BUFFER = 20 << 20    # kLargeBuffer: requests between 1 and 10 MiB get a 20 MiB segment
MIN_LARGE_ALLOC = 10 << 20  # kMinLargeAlloc
ROUND_LARGE = 2 << 20      # kRoundLarge: larger segments round up to 2 MiB


def round_size(n: int) -> int:
    """The size a request is served with (``round_size``)."""
    return MIN_BLOCK if n < MIN_BLOCK else MIN_BLOCK * ((n + MIN_BLOCK - 1) // MIN_BLOCK)


def segment_size(n: int) -> int:
    """The size of a new segment for a rounded request (``get_allocation_size``)."""
    if n <= SMALL_SIZE:
        return SMALL_BUFFER
    if n < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return ROUND_LARGE * ((n + ROUND_LARGE - 1) // ROUND_LARGE)


def should_split(block_size: int, size: int, small: bool) -> bool:
    """``shouldSplit``: a small-pool block splits off any 512-byte rest, a large-pool block only a rest
    of more than 1 MiB; otherwise the request gets (and ``allocated_bytes`` counts) the whole block."""
    rest = block_size - size
    return rest >= MIN_BLOCK if small else rest > SMALL_SIZE


class _Block:
    __slots__ = ("ptr", "size", "free", "prev", "next", "small")

    def __init__(self, ptr: int, size: int, small: bool):
        self.ptr, self.size, self.free, self.small = ptr, size, True, small
        self.prev: Optional[_Block] = None
        self.next: Optional[_Block] = None


class CachingAllocator:
    """Best fit from the free blocks of the pool (smallest size, then lowest address), a new segment
    when none fits, splitting by ``should_split``, merging a freed block with free neighbours of its
    segment; segments are never returned (no out-of-memory retries)."""

    def __init__(self) -> None:
        self._pools: Dict[bool, List[Tuple[int, int, _Block]]] = {True: [], False: []}
        self._next_ptr = 0
        self.allocated = 0
        self.reserved = 0
        self.peak_allocated = 0

    def _insert(self, b: _Block) -> None:
        bisect.insort(self._pools[b.small], (b.size, b.ptr, b))

    def _remove(self, b: _Block) -> None:
        pool = self._pools[b.small]
        i = bisect.bisect_left(pool, (b.size, b.ptr))
        assert pool[i][2] is b
        del pool[i]

    def malloc(self, nbytes: int) -> _Block:
        size = round_size(nbytes)
        small = size <= SMALL_SIZE
        pool = self._pools[small]
        i = bisect.bisect_left(pool, (size, -1))
        if i < len(pool):
            b = pool.pop(i)[2]
        else:
            seg = segment_size(size)
            b = _Block(self._next_ptr, seg, small)
            self._next_ptr += seg
            self.reserved += seg
        if should_split(b.size, size, small):
            rest = _Block(b.ptr + size, b.size - size, small)
            rest.prev, rest.next = b, b.next
            if b.next is not None:
                b.next.prev = rest
            b.next = rest
            b.size = size
            self._insert(rest)
        b.free = False
        self.allocated += b.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return b

    def free(self, b: _Block) -> None:
        self.allocated -= b.size
        b.free = True
        prev, nxt = b.prev, b.next
        if prev is not None and prev.free:
            self._remove(prev)
            prev.size += b.size
            prev.next = b.next
            if b.next is not None:
                b.next.prev = prev
            b = prev
        if nxt is not None and nxt.free:
            self._remove(nxt)
            b.size += nxt.size
            b.next = nxt.next
            if nxt.next is not None:
                nxt.next.prev = b
        self._insert(b)


@dataclass(frozen=True)
class IterationPeak:
    label: str
    allocated: int   # peak of allocated blocks (what max_memory_allocated shows)
    requested: int   # peak of requested bytes (what the referee reports)
    phase: str       # the phase of the allocation that set the allocated peak

    @property
    def slack(self) -> int:
        return self.allocated - self.requested


def replay(records: List[list]) -> List[IterationPeak]:
    """Records as the tracker keeps them: [alloc seq, free seq or None, bytes, op, dtype, shape, phase]."""
    events = []
    for i, r in enumerate(records):
        events.append((r[0], 1, i))
        if r[1] is not None:
            events.append((r[1], 0, i))
    events.sort()
    alloc = CachingAllocator()
    blocks: Dict[int, _Block] = {}
    requested = 0
    peaks: Dict[str, list] = {}
    for _, is_alloc, i in events:
        r = records[i]
        if is_alloc:
            blocks[i] = alloc.malloc(r[2])
            requested += r[2]
        else:
            alloc.free(blocks.pop(i))
            requested -= r[2]
        label = r[6].split()[0] if r[6].startswith("it") else "build"
        p = peaks.setdefault(label, [0, 0, ""])
        if alloc.allocated > p[0]:
            p[0], p[2] = alloc.allocated, r[6]
        p[1] = max(p[1], requested)
    return [IterationPeak(k, v[0], v[1], v[2]) for k, v in peaks.items()]


def main(argv: Optional[List[str]] = None) -> None:
    for path in (argv if argv is not None else sys.argv[1:]):
        with open(path) as fh:
            recs = json.load(fh)
        print(path)
        for p in replay(recs):
            print(f"  {p.label:<6} allocated blocks {p.allocated:>13,}  requested {p.requested:>13,}  "
                  f"slack {p.slack / 2**20:7.2f} MiB  ({p.phase})")


if __name__ == "__main__":
    main()
