"""The interleaved schedule's passes as schedule.py walks them (p2p_passes' samples, _runs / _counts / _warmup beneath
them; p2p_every_pass for the combined 1F1B schedule) against a full replay.

The reference (tests/schedule_reference.py) rebuilds megatron-core's interleaved schedule from its rules
(checked against megatron-core's own schedule table in tests/test_ep_overlap.py) and replays every pass
with the bytes of each chunk. Each sampled pass must be the replay's pass at its place (direction, chunk, held counts,
micro-batch ordinal), and the samples must hold the replay's first peak of the held bytes: value, pass, chunk, held
counts, micro-batch ordinal, and most in flight, for any bytes (zeros and ties included).
"""
from __future__ import annotations

import itertools
import os
import random

from hypothesis import HealthCheck, given, settings, strategies as st

from megatron_memguard.schedule import _warmup, p2p_every_pass, p2p_passes, peak_in_flight
from schedule_reference import megatron_passes

EXAMPLES = int(os.environ.get("MEMGUARD_PROPERTY_EXAMPLES", "200"))
PROPERTY = settings(derandomize=True, database=None, deadline=None, max_examples=EXAMPLES,
                    suppress_health_check=[HealthCheck.too_slow])


def replay(passes, sizes, fwd_extra, top_extra, bottom_extra):
    """Every pass in order; the first strict maximum, each pass's probe and the most in flight. A backward's value is
    the larger of its start (top_extra) and its end (bottom_extra, with its own micro-batch released)."""
    held = [0] * len(sizes)
    done = {}                       # (direction, chunk) -> passes so far
    best = None
    in_flight = 0
    probes = []
    for fwd, c, _mb in passes:
        done[fwd, c] = done.get((fwd, c), 0) + 1
        if fwd:
            held[c] += 1
            in_flight = max(in_flight, sum(held))
            v = sum(h * s for h, s in zip(held, sizes)) + fwd_extra[c]
            kind = "F"
        else:
            base = sum(h * s for h, s in zip(held, sizes))
            top, bottom = base + top_extra[c], base + bottom_extra[c] - sizes[c]
            v, kind = (top, "B") if top >= bottom else (bottom, "Bend")
        probes.append((fwd, c, tuple(held), done[fwd, c]))
        if best is None or v > best[0]:
            best = (v, kind, c, tuple(held), done[fwd, c])
        if not fwd:
            held[c] -= 1
    return best, in_flight, probes


def ordinal(pp, vpp, m, group, rank, section, k, fwd):
    """The place of p2p_passes' (section, k) pass in the schedule: a warm-up forward of table position k, the forward
    then the backward of steady pair k, a cool-down backward of position k."""
    warm = _warmup(pp, vpp, group, rank, m)
    if section == 0:
        return k
    if section == 1:
        return warm + 2 * k + (not fwd)
    return warm + 2 * (m * vpp - warm) + (k - (m * vpp - warm))


def sampled_peak(pp, vpp, m, group, rank, sizes, fwd_extra, top_extra, bottom_extra, overlap, probes):
    """The first of p2p_passes' samples with the most held bytes plus transient (the estimator's held part, its
    backward value the larger of start and end), each sample checked against the replay's pass at its place."""
    bottom = [b - s for b, s in zip(bottom_extra, sizes)]
    bwd = [max(t, b) for t, b in zip(top_extra, bottom)]
    best = at = None
    order = -1
    for p, section, k, *_ in p2p_passes(pp, vpp, m, group, rank, overlap):
        x = ordinal(pp, vpp, m, group, rank, section, k, p[0])
        assert x > order and probes[x] == p, (pp, vpp, m, group, rank, overlap, section, k, p)
        order = x
        v = sum(h * s for h, s in zip(p[2], sizes)) + (fwd_extra if p[0] else bwd)[p[1]]
        if best is None or v > best:
            best, at = v, p
    fwd, c, held, nth = at
    kind = "F" if fwd else ("B" if top_extra[c] >= bottom[c] else "Bend")
    return best, kind, c, held, nth


def bytes_for(rng: random.Random, vpp: int, zeros: bool) -> tuple[list[int], ...]:
    """Per-chunk bytes: held, forward transient, backward start and end working sets. Small ranges so
    that ties happen; zeros (empty chunks) when asked."""
    lo = 0 if zeros else 1
    sizes = [rng.randint(lo, 6) for _ in range(vpp)]
    return sizes, [rng.randint(0, 8) for _ in range(vpp)], [rng.randint(0, 8) for _ in range(vpp)], \
        [rng.randint(0, 12) for _ in range(vpp)]


def check(pp, vpp, m, group, rank, b, combined=False):
    ref, in_flight, probes = replay(megatron_passes(pp, vpp, m, group, rank, combined), *b)
    assert peak_in_flight(pp, vpp, m, group, rank, combined) == in_flight, (pp, vpp, m, group, rank, combined)
    if combined:                    # the combined schedule is walked pass by pass (p2p_every_pass)
        recv = (1,) * vpp
        assert [p for p, _ in p2p_every_pass(pp, vpp, m, group, rank, recv, True, True)] == probes
        return
    for overlap in (True, False):
        got = sampled_peak(pp, vpp, m, group, rank, *b, overlap, probes)
        assert got == ref, (pp, vpp, m, group, rank, b, overlap)


def test_grid_every_rank_small_schedules():
    """Every rank of every schedule with PP 2-5, VPP 2-4, m 1-13, G 1-6 (m < PP, m not a multiple of
    G or of PP, G < PP, which Megatron refuses but the samples must still get right), three byte draws."""
    rng = random.Random(16)
    for pp, vpp, m, group in itertools.product(range(2, 6), range(2, 5), range(1, 14), range(1, 7)):
        for rank in range(pp):
            for zeros, combined in ((False, False), (True, False), (False, True), (True, True)):
                check(pp, vpp, m, group, rank, bytes_for(rng, vpp, zeros), combined)


@PROPERTY
@given(pp=st.integers(2, 16), vpp=st.integers(2, 12), m=st.integers(1, 96), group=st.integers(1, 24),
       rank_frac=st.floats(0, 1), seed=st.integers(0, 2**32 - 1), zeros=st.booleans(), combined=st.booleans())
def test_samples_match_replay(pp, vpp, m, group, rank_frac, seed, zeros, combined):
    rank = min(pp - 1, int(rank_frac * pp))
    check(pp, vpp, m, group, rank, bytes_for(random.Random(seed), vpp, zeros), combined)


@PROPERTY
@given(pp=st.integers(2, 16), vpp=st.integers(2, 4), groups=st.integers(1, 40), extra=st.integers(0, 30),
       more=st.integers(0, 16), rank_frac=st.floats(0, 1), seed=st.integers(0, 2**32 - 1), zeros=st.booleans(),
       combined=st.booleans())
def test_long_schedules_megatron_accepts(pp, vpp, groups, extra, more, rank_frac, seed, zeros, combined):
    """Up to 40 groups (the periodic stretch the samples skip is long), for the schedules Megatron accepts:
    PP <= G <= m and a last group of 0 or >= PP micro-batches (resolve/pipeline.py)."""
    group = pp + more
    m = groups * group + (pp + extra % (group - pp + 1) if extra and group > pp else 0)
    if m % group and m % group < pp:
        m -= m % group
    rank = min(pp - 1, int(rank_frac * pp))
    check(pp, vpp, m, group, rank, bytes_for(random.Random(seed), vpp, zeros), combined)


def test_many_virtual_stages():
    """200 virtual stages (400 layers at PP 2, one per virtual stage): the samples and the combined schedule's walk
    are still the replay's."""
    rng = random.Random(200)
    for m, group in ((2, 2), (4, 2), (5, 2), (6, 3)):
        for rank in range(2):
            for combined in (False, True):
                check(2, 200, m, group, rank, bytes_for(rng, 200, False), combined)


def test_sample_count_does_not_grow_with_microbatches():
    """The point of the samples: DeepSeek-V3's PP16 VPP2 schedule costs the same for 128 or 8,192
    micro-batches (the steady state repeats every VPP x G passes; 164 samples on the first rank, whose warm-up and
    cool-down are taken whole: 2 x 46 passes)."""
    for rank in range(16):
        for overlap in (True, False):
            n = len(p2p_passes(16, 2, 128, 16, rank, overlap))
            assert len(p2p_passes(16, 2, 8192, 16, rank, overlap)) == n <= 164


def first_held_peak(pp, vpp, m, group, rank, sizes):
    """The first of p2p_passes' samples with the most held bytes (no transients): (value, probe)."""
    best = at = None
    for p, *_ in p2p_passes(pp, vpp, m, group, rank, True):
        v = sum(h * s for h, s in zip(p[2], sizes))
        if best is None or v > best:
            best, at = v, p
    return best, at


def test_deepseek_v3_schedule_by_hand():
    """PP16 VPP2, G 16, rank 0: warm-up 2 x 15 + 16 = 46 forwards, so 47 micro-batches in flight. The
    table runs mb 0-15 on chunk 0, mb 0-15 on chunk 1, mb 16-31 on chunk 0, ...; the warm-up ends at
    position 45 (chunk 0, mb 29), the first steady pairs run the forwards of positions 46 and 47 (chunk 0,
    mb 30 and 31) while their backwards release chunk 1 (backward chunk = 1 - chunk of position k), so
    chunk 0 first holds 32 micro-batches at the forward of its 32nd micro-batch; chunk-0 backwards start
    at k = 16, from when it never holds more. With 1 byte per chunk-0 micro-batch, 0 on chunk 1, no
    transients: peak 32 there."""
    assert peak_in_flight(16, 2, 128, 16, 0) == 46 + 1
    v, (fwd, c, held, nth) = first_held_peak(16, 2, 128, 16, 0, [1, 0])
    assert (v, fwd, c, held[0], nth) == (32, True, 0, 32, 32)
    assert held[0] + held[1] == 47
    # the middle ranks: rank 7's warm-up is 2 x 8 + 16 = 32 forwards (positions 0-31: 16 on chunk 0, 16 on chunk 1),
    # the first steady forward is position 32 (chunk 0, its 17th micro-batch): 17 + 16 = 33 held, 1 byte each
    assert first_held_peak(16, 2, 128, 16, 7, [1, 1]) == (33, (True, 0, (17, 16), 17))


def test_peak_in_the_last_partial_group_names_its_micro_batch():
    """Last stage of PP2 x VPP2, G 4, m 22 (five full groups and one of 2 micro-batches), the output
    layer on chunk 1. In the full groups each chunk-1 forward finds 4 micro-batches held on chunk 0 and
    none but its own on chunk 1; in the last group the forward of micro-batch 21 on chunk 1 still finds
    micro-batch 20 there (3 + 2 held, counted by hand from the schedule table): the peak is the 22nd
    forward of chunk 1. (A replay capped at 4 groups plus the remainder called it the 18th.)"""
    from megatron_memguard import estimate, layout_from_flags
    flags = ("--num-layers 8 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024 "
             "--max-position-embeddings 1024 --micro-batch-size 1 --global-batch-size 22 "
             "--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 2 "
             "--microbatch-group-size-per-virtual-pipeline-stage 4 --untie-embeddings-and-output-weights "
             "--tokenizer-type NullTokenizer --vocab-size 32000 --bf16 --use-distributed-optimizer").split()
    stage = estimate(layout_from_flags(flags, world_size=2)).stages[1]
    assert stage.peak_phase == "forward of micro-batch 22, chunk 1 (5 held)"


def test_uniform_chunks():
    """Ranks whose chunks keep equal bytes (the middle of a deep pipeline): against the replay for every rank of PP
    2-6, VPP 2-4, m 1-19, G 1-7, with the forward or the backward transient larger, or equal."""
    for pp, vpp, m, group in itertools.product(range(2, 7), range(2, 5), range(1, 20), range(1, 8)):
        for rank in range(pp):
            for size, f, top, bottom in ((1, 0, 0, 0), (2, 3, 1, 0), (3, 1, 4, 2), (1, 0, 0, 9), (5, 2, 2, 7)):
                check(pp, vpp, m, group, rank, ([size] * vpp, [f] * vpp, [top] * vpp, [bottom] * vpp))
