"""The order in which a pipeline rank runs forward and backward passes, as megatron-core schedules them.

``forward_backward_no_pipelining`` (PP=1): forward then backward, one micro-batch at a time.
``forward_backward_pipelining_without_interleaving`` (1F1B): ``min(PP - rank - 1, m)`` warm-up
forwards, then one forward / one backward, then the cool-down backwards.
``forward_backward_pipelining_with_interleaving``: warm-up ``(PP - rank - 1) * 2 + (VPP - 1) * G``
virtual micro-batches (G = micro-batches per group, default PP), chunks visited group by group
(``get_schedule_table`` in megatron/core/pipeline_parallel/schedules.py), backward in reverse chunk order.
"""
from __future__ import annotations

from .layout import Layout

Event = tuple[str, int]   # ("F" | "B", chunk index on this rank)


def _schedule_table(m: int, vpp: int, group: int) -> list[tuple[int, int]]:
    table: list[tuple[int, int]] = []
    for lo in range(0, m, group):
        hi = m if lo + group >= m else lo + group
        table.extend((mb, chunk) for chunk in range(vpp) for mb in range(lo, hi))
    return table


def effective_microbatches(L: Layout) -> int:
    """Micro-batches worth simulating: the in-flight pattern repeats after warm-up, so a few groups
    past it give the same peak as the full count (kept with the same remainder for the last group)."""
    m = L.num_microbatches
    if L.vpp == 1:
        return min(m, L.pp + 2)
    g = L.microbatch_group_size_per_vp_stage or L.pp
    cap = 4 * g + (m % g)
    return m if m <= cap else cap


def rank_events(L: Layout, pp_rank: int) -> list[Event]:
    m = effective_microbatches(L)
    pp, vpp = L.pp, L.vpp
    if pp == 1:
        return [ev for _ in range(m) for ev in (("F", 0), ("B", 0))]
    if vpp == 1:
        warm = min(pp - pp_rank - 1, m)
        ev: list[Event] = [("F", 0)] * warm
        for _ in range(m - warm):
            ev += [("F", 0), ("B", 0)]
        return ev + [("B", 0)] * warm
    group = L.microbatch_group_size_per_vp_stage or pp
    table = _schedule_table(m, vpp, group)
    total = m * vpp
    warm = min((pp - pp_rank - 1) * 2 + (vpp - 1) * group, total)
    ev = [("F", table[k][1]) for k in range(warm)]
    for k in range(total - warm):
        ev.append(("F", table[k + warm][1]))
        ev.append(("B", vpp - 1 - table[k][1]))
    ev += [("B", vpp - 1 - table[k][1]) for k in range(total - warm, total)]
    return ev


def max_in_flight(L: Layout, pp_rank: int) -> int:
    """Largest number of (micro-batch, chunk) forwards held at once on this rank."""
    held = best = 0
    for kind, _ in rank_events(L, pp_rank):
        held += 1 if kind == "F" else -1
        best = max(best, held)
    return best
