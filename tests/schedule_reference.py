"""megatron-core's interleaved and combined 1F1B schedules rebuilt from their rules, pass by pass: the
reference the estimator's fast schedule path (tests/test_schedule.py) and megatron-core's own schedule
table (tests/test_ep_overlap.py) are both compared with.

megatron/core/pipeline_parallel/schedules.py, forward_backward_pipelining_with_interleaving and
get_schedule_table: micro-batches in groups of G, each group run chunk by chunk; warm-up
(PP - rank - 1) * 2 + (VPP - 1) * G virtual micro-batches (one more with the combined schedule), capped
at m * VPP; then one forward / one backward, backwards in reverse chunk order; then the cool-down backwards.
"""
from __future__ import annotations


def megatron_passes(pp: int, vpp: int, m: int, group: int, rank: int,
                    combined: bool = False) -> list[tuple[bool, int, int]]:
    """(forward?, chunk, micro-batch) of every pass of one rank, straight from the schedule's rules.
    ``combined``: --overlap-moe-expert-parallel-comm's combined 1F1B schedule (get_pp_rank_microbatches:
    one more warm-up forward; combined_1f1b_schedule_for_interleaved_pipelining runs backward k with
    forward k + warm-up, the backward's release first in memory order)."""
    table = []
    for lo in range(0, m, group):
        hi = min(lo + group, m)
        table += [(mb, c) for c in range(vpp) for mb in range(lo, hi)]
    total = m * vpp
    warm = min((pp - rank - 1) * 2 + (vpp - 1) * group + combined, total)
    out = [(True, table[k][1], table[k][0]) for k in range(warm)]
    for k in range(total - warm):
        step = [(True, table[k + warm][1], table[k + warm][0]), (False, vpp - 1 - table[k][1], table[k][0])]
        out += step[::-1] if combined else step
    out += [(False, vpp - 1 - table[k][1], table[k][0]) for k in range(total - warm, total)]
    return out


def passes(pp: int, vpp: int, m: int, group: int, rank: int, combined: bool = False) -> tuple[tuple[bool, int], ...]:
    """(forward?, chunk) of every pass of one rank."""
    return tuple((f, c) for f, c, _ in megatron_passes(pp, vpp, m, group, rank, combined))
