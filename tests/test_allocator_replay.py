"""The caching-allocator replay (benchmarks/referee/allocator_replay.py) follows the block rules of
PyTorch's c10/cuda/CUDACachingAllocator.cpp (2.x): 512-byte rounding, 2 MiB small segments, 20 MiB
segments for 1-10 MiB requests, and a large block split only when more than 1 MiB (kSmallSize) is left;
otherwise the request is charged the whole block. Each expected number below follows from those rules
by hand."""
from __future__ import annotations

from benchmarks.referee.allocator_replay import CachingAllocator, replay

MiB = 1 << 20


def test_small_requests_round_to_512_bytes_in_a_2_mib_segment():
    a = CachingAllocator()
    a.malloc(100)
    a.malloc(513)
    assert a.allocated == 512 + 1024
    assert a.reserved == 2 * MiB


def test_a_large_block_with_at_most_1_mib_left_is_handed_out_whole():
    a = CachingAllocator()
    x = a.malloc(3 * MiB)        # new 20 MiB segment, split: 3 MiB + 17 MiB free
    a.malloc(17 * MiB)           # takes the 17 MiB rest exactly
    assert a.reserved == 20 * MiB
    a.free(x)                    # a free 3 MiB block between nothing free
    y = a.malloc(5 * MiB // 2)   # 2.5 MiB: 0.5 MiB would be left, not split
    assert y.size == 3 * MiB and a.allocated == 20 * MiB
    a.free(y)
    z = a.malloc(3 * MiB // 2)   # 1.5 MiB: 1.5 MiB would be left, split
    assert z.size == 3 * MiB // 2 and a.allocated == 17 * MiB + 3 * MiB // 2


def test_freed_neighbours_merge_into_one_block():
    a = CachingAllocator()
    x = a.malloc(3 * MiB)
    y = a.malloc(3 * MiB)        # 3 + 3 + 14 MiB free in one segment
    a.free(x)
    a.free(y)                    # merges with both neighbours: one free 20 MiB block
    z = a.malloc(19 * MiB + MiB // 2)  # 0.5 MiB left: the whole 20 MiB block
    assert z.size == 20 * MiB and a.reserved == 20 * MiB


def test_replay_of_a_log_charges_the_unsplit_block():
    # [alloc seq, free seq, bytes, op, dtype, shape, phase] as the referee's tracker keeps them
    records = [
        [1, 3, 3 * MiB, "empty", "bfloat16", (3 * MiB // 2,), "it1 fwd mb0"],
        [2, None, 17 * MiB, "empty", "bfloat16", (17 * MiB // 2,), "it1 fwd mb0"],
        [4, None, 5 * MiB // 2, "empty", "bfloat16", (5 * MiB // 4,), "it2 fwd mb0"],
    ]
    peaks = {p.label: p for p in replay(records)}
    assert peaks["it1"].allocated == peaks["it1"].requested == 20 * MiB
    assert peaks["it2"].requested == 17 * MiB + 5 * MiB // 2
    assert peaks["it2"].allocated == 20 * MiB and peaks["it2"].slack == MiB // 2
