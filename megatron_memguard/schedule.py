"""The order in which a pipeline rank runs forward and backward passes, as megatron-core schedules them.

``forward_backward_no_pipelining`` (PP=1): forward then backward, one micro-batch at a time.
``forward_backward_pipelining_without_interleaving`` (1F1B): ``min(PP - rank - 1, m)`` warm-up
forwards, then one forward / one backward, then the cool-down backwards (the estimator's
_peak_one_chunk takes its peak in closed form).
``forward_backward_pipelining_with_interleaving``: warm-up ``(PP - rank - 1) * 2 + (VPP - 1) * G``
virtual micro-batches (G = micro-batches per group, default PP), capped at m x VPP; chunks visited
group by group (``get_schedule_table`` in megatron/core/pipeline_parallel/schedules.py), backward in
reverse chunk order. ``peak_probes`` lists the passes of one rank at which the bytes held can first
peak, whatever each chunk's bytes are, without visiting all m x VPP x 2 passes (tests/test_schedule.py
checks it against a replay of every pass).
"""
from __future__ import annotations

from functools import lru_cache
from operator import mul, sub



# One probe: (forward?, chunk, micro-batches held per chunk at that pass, the pass's ordinal among the
# passes of its direction on its chunk). A forward's held counts include its own micro-batch; a
# backward's include the one it is about to release.
Probe = tuple[bool, int, tuple[int, ...], int]


@lru_cache(maxsize=512)
def peak_probes(pp: int, vpp: int, m: int, group: int, pp_rank: int) -> tuple[tuple[Probe, ...], int]:
    """The passes of an interleaved schedule (PP > 1, VPP > 1) where the bytes held can first reach
    their maximum, in schedule order, and the most micro-batches in flight.

    Whatever bytes b_c a micro-batch keeps on chunk c and whatever transient each chunk's forward or
    backward adds, the value at a pass is sum_c held_c * b_c + (the pass's transient), so:
    * the passes split into runs over which the pass's chunk stays the same and the held counts move by
      a constant step (warm-up forwards of one chunk; steady one-forward-one-backward pairs with both
      chunks fixed; cool-down backwards of one chunk). A value linear along a run first reaches its
      largest at the run's first or last pass: those two are probed.
    * the forward table repeats every VPP x G positions within the full groups, and so does the steady
      state: a steady pair a period after another one has the same chunks and held counts, hence the
      same values, and comes later, so it is never the first peak; only the first period and the pairs
      that reach the last (partial) group are probed.
    The cost does not grow with m."""
    P = vpp * group
    total = m * vpp
    full = (m // group) * P                 # table positions in full groups (the periodic part)
    q = m - (m // group) * group            # micro-batches of the last, partial group (0: none)
    warm = min((pp - pp_rank - 1) * 2 + (vpp - 1) * group, total)
    steady = total - warm
    top = vpp - 1
    # chunk of table position x: (x % P) // group in the full groups, (x - full) // q after them;
    # the next position where the chunk changes: (x // group + 1) * group, or full + ((x - full) // q + 1) * q

    def counts(a: int) -> list[int]:        # forwards of each chunk among the first a positions
        if a <= full:
            j, o = divmod(a, P)
            return [j * group + min(max(o - c * group, 0), group) for c in range(vpp)]
        o = a - full
        return [m - q + min(max(o - c * q, 0), q) for c in range(vpp)]

    probes: list[Probe] = []
    add = probes.append
    fc = [0] * vpp                          # forwards done per chunk
    k = 0
    while k < warm:                         # warm-up forwards
        if k < full:
            c = (k % P) // group
            k1 = (k // group + 1) * group
        else:
            c = (k - full) // q
            k1 = full + ((k - full) // q + 1) * q
        if k1 > warm:
            k1 = warm
        fc[c] += 1
        add((True, c, tuple(fc), fc[c]))
        if k1 - 1 > k:
            fc[c] += k1 - 1 - k
            add((True, c, tuple(fc), fc[c]))
        k = k1
    bc = [0] * vpp                          # backwards done per chunk
    # steady pairs k: the forward of position k + warm, then the backward of position k
    for lo, hi in ((0, min(steady, P)), (max(P, full - warm), steady)):
        if lo >= hi:
            continue
        if k != lo:                         # after the periodic stretch: counts afresh
            fc = counts(lo + warm)
            bc = counts(lo)[::-1]
        k = lo
        while k < hi:
            x = k + warm
            if x < full:
                cf = (x % P) // group
                k1 = (x // group + 1) * group - warm
            else:
                cf = (x - full) // q
                k1 = full + ((x - full) // q + 1) * q - warm
            if k < full:
                cb = top - (k % P) // group
                kb = (k // group + 1) * group
            else:
                cb = top - (k - full) // q
                kb = full + ((k - full) // q + 1) * q
            if kb < k1:
                k1 = kb
            if hi < k1:
                k1 = hi
            fc[cf] += 1
            h = tuple(map(sub, fc, bc))
            add((True, cf, h, fc[cf]))
            add((False, cb, h, bc[cb] + 1))
            n = k1 - 1 - k
            if n:
                fc[cf] += n
                bc[cb] += n
                h = tuple(map(sub, fc, bc))
                add((True, cf, h, fc[cf]))
                add((False, cb, h, bc[cb] + 1))
            bc[cb] += 1
            k = k1
    if k != steady:
        fc = [m] * vpp                      # every forward done
        bc = counts(steady)[::-1]
    k = steady
    while k < total:                        # cool-down backwards
        if k < full:
            cb = top - (k % P) // group
            k1 = (k // group + 1) * group
        else:
            cb = top - (k - full) // q
            k1 = full + ((k - full) // q + 1) * q
        if k1 > total:
            k1 = total
        add((False, cb, tuple(map(sub, fc, bc)), bc[cb] + 1))
        if k1 - 1 > k:
            bc[cb] += k1 - 1 - k
            add((False, cb, tuple(map(sub, fc, bc)), bc[cb] + 1))
        bc[cb] += 1
        k = k1
    return tuple(probes), (warm + 1 if steady else warm)


def first_peak(probes: tuple[Probe, ...], sizes: list[int], fwd_extra: list[int],
               bwd_extra: list[int]) -> tuple[int, Probe]:
    """The first probe with the largest sum_c held_c * sizes[c] + (fwd_extra or bwd_extra)[chunk], and
    that value: the first pass of the schedule where the bytes held peak."""
    best, at = -1, probes[0]
    if len(sizes) == 2:                     # the common case (VPP 2), without the generic dot product
        s0, s1 = sizes
        for p in probes:
            h = p[2]
            v = h[0] * s0 + h[1] * s1 + (fwd_extra if p[0] else bwd_extra)[p[1]]
            if v > best:
                best, at = v, p
        return best, at
    for p in probes:
        v = sum(map(mul, p[2], sizes)) + (fwd_extra if p[0] else bwd_extra)[p[1]]
        if v > best:
            best, at = v, p
    return best, at

