"""The order in which a pipeline rank runs forward and backward passes, as megatron-core schedules them.

``forward_backward_no_pipelining`` (PP=1): forward then backward, one micro-batch at a time.
``forward_backward_pipelining_without_interleaving`` (1F1B): ``min(PP - rank - 1, m)`` warm-up
forwards, then one forward / one backward, then the cool-down backwards.
``forward_backward_pipelining_with_interleaving``: warm-up ``(PP - rank - 1) * 2 + (VPP - 1) * G``
virtual micro-batches (G = micro-batches per group, default PP), chunks visited group by group
(``get_schedule_table`` in megatron/core/pipeline_parallel/schedules.py), backward in reverse chunk order.
"""
from __future__ import annotations

from functools import lru_cache

from .layout import Layout


@lru_cache(maxsize=128)
def _schedule_table(m: int, vpp: int, group: int) -> tuple[tuple[int, int], ...]:
    """(micro-batch, chunk) in the order every rank runs its forwards (the same on all ranks)."""
    table: list[tuple[int, int]] = []
    for lo in range(0, m, group):
        hi = m if lo + group >= m else lo + group
        table.extend((mb, chunk) for chunk in range(vpp) for mb in range(lo, hi))
    return tuple(table)


def effective_microbatches(L: Layout) -> int:
    """Micro-batches worth simulating: the in-flight pattern repeats after warm-up, so a few groups
    past it give the same peak as the full count (kept with the same remainder for the last group)."""
    m = L.num_microbatches
    if L.vpp == 1:
        return min(m, L.pp + 2)
    g = L.microbatch_group_size_per_vp_stage or L.pp
    cap = 4 * g + (m % g)
    return m if m <= cap else cap


def schedule_key(L: Layout, pp_rank: int) -> tuple[int, int, int, int, int]:
    """What the schedule of one rank depends on: (PP, VPP, micro-batches simulated, group size, rank)."""
    return (L.pp, L.vpp, effective_microbatches(L), L.microbatch_group_size_per_vp_stage or L.pp, pp_rank)


@lru_cache(maxsize=512)
def key_events(pp: int, vpp: int, m: int, group: int, pp_rank: int) -> tuple[tuple[bool, int], ...]:
    """The forward (True) and backward (False) passes of one rank, in order, with the chunk each runs
    on. A function of five integers, so layouts that differ elsewhere (a planner's sweep over TP, MBS,
    recomputation) share it."""
    if pp == 1:
        return ((True, 0), (False, 0)) * m
    if vpp == 1:
        warm = min(pp - pp_rank - 1, m)
        return ((True, 0),) * warm + ((True, 0), (False, 0)) * (m - warm) + ((False, 0),) * warm
    table = _schedule_table(m, vpp, group)
    total = m * vpp
    warm = min((pp - pp_rank - 1) * 2 + (vpp - 1) * group, total)
    ev = [(True, table[k][1]) for k in range(warm)]
    for k in range(total - warm):
        ev.append((True, table[k + warm][1]))
        ev.append((False, vpp - 1 - table[k][1]))
    ev += [(False, vpp - 1 - table[k][1]) for k in range(total - warm, total)]
    return tuple(ev)


@lru_cache(maxsize=512)
def combined_key_events(pp: int, vpp: int, m: int, group: int, pp_rank: int) -> tuple[tuple[bool, int], ...]:
    """``key_events`` under ``--overlap-moe-expert-parallel-comm`` (the combined 1F1B schedule).

    megatron-core 0.16.1 / 0.19.2 ``get_pp_rank_microbatches`` adds one warm-up forward to the interleaved
    schedule, and each steady-state step runs forward ``k + warm-up`` and backward ``k`` together
    (``combined_1f1b_schedule_for_interleaved_pipelining``); ``TransformerModelChunkSchedulePlan.run``
    back-propagates the backward's loss / output layer before the forward's first layer, pairs the
    forward's layer i with the backward's layer L-1-i (the backward releases a layer while the forward
    adds one), and runs the forward's output layer and loss after the backward's last layer. In memory
    order a step is therefore the backward, then the forward; the layer that both hold at once is the
    MoE recipe's overlap term. PP = 1 is the same with no warm-up beyond one forward."""
    if pp == 1:
        return ((True, 0),) + ((False, 0), (True, 0)) * (m - 1) + ((False, 0),)
    if vpp == 1:
        raise ValueError("the combined 1F1B schedule needs virtual pipeline stages when PP > 1")
    table = _schedule_table(m, vpp, group)
    total = m * vpp
    warm = min((pp - pp_rank - 1) * 2 + (vpp - 1) * group + 1, total)
    ev = [(True, table[k][1]) for k in range(warm)]
    for k in range(total - warm):
        ev.append((False, vpp - 1 - table[k][1]))
        ev.append((True, table[k + warm][1]))
    ev += [(False, vpp - 1 - table[k][1]) for k in range(total - warm, total)]
    return tuple(ev)
