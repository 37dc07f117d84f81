"""The estimator's fast schedule path (schedule.peak_probes + first_peak) against a full replay.

The reference (tests/schedule_reference.py) rebuilds megatron-core's interleaved schedule from its rules
(checked against megatron-core's own schedule table in tests/test_ep_overlap.py) and replays every pass
with the bytes of each chunk. The fast path must find the same first peak: value, pass, chunk, held counts,
micro-batch ordinal and most in flight, for any bytes (zeros and ties included).
"""
from __future__ import annotations

import itertools
import os
import random

from hypothesis import HealthCheck, given, settings, strategies as st

from megatron_memguard.schedule import first_peak, peak_probes, peak_walk, schedule_peak, uniform_peak
from schedule_reference import megatron_passes

EXAMPLES = int(os.environ.get("MEMGUARD_PROPERTY_EXAMPLES", "200"))
PROPERTY = settings(derandomize=True, database=None, deadline=None, max_examples=EXAMPLES,
                    suppress_health_check=[HealthCheck.too_slow])


def replay(passes, sizes, fwd_extra, top_extra, bottom_extra):
    """Every pass in order; the first strict maximum. A backward's value is the larger of its start
    (top_extra) and its end (bottom_extra, with its own micro-batch released)."""
    held = [0] * len(sizes)
    done = {}                       # (direction, chunk) -> passes so far
    best = None
    in_flight = 0
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
        if best is None or v > best[0]:
            best = (v, kind, c, tuple(held), done[fwd, c])
        if not fwd:
            held[c] -= 1
    return best, in_flight


def fast(pp, vpp, m, group, rank, sizes, fwd_extra, top_extra, bottom_extra, combined=False):
    """Both fast paths (the probes kept per rank, the walk for many virtual stages) and the estimator's
    choice between them must agree; returns their common answer."""
    bottom = [b - s for b, s in zip(bottom_extra, sizes)]
    bwd = [max(t, b) for t, b in zip(top_extra, bottom)]
    probes, in_flight = peak_probes(pp, vpp, m, group, rank, combined)
    v, at = first_peak(probes, sizes, fwd_extra, bwd)
    assert peak_walk(pp, vpp, m, group, rank, sizes, fwd_extra, bwd, combined) == (v, at, in_flight)
    assert schedule_peak(pp, vpp, m, group, rank, sizes, fwd_extra, bwd, combined) == (v, at, in_flight)
    fwd, c, held, nth = at
    kind = "F" if fwd else ("B" if top_extra[c] >= bottom[c] else "Bend")
    return (v, kind, c, held, nth), in_flight


def bytes_for(rng: random.Random, vpp: int, zeros: bool) -> tuple[list[int], ...]:
    """Per-chunk bytes: held, forward transient, backward start and end working sets. Small ranges so
    that ties happen; zeros (empty chunks) when asked."""
    lo = 0 if zeros else 1
    sizes = [rng.randint(lo, 6) for _ in range(vpp)]
    return sizes, [rng.randint(0, 8) for _ in range(vpp)], [rng.randint(0, 8) for _ in range(vpp)], \
        [rng.randint(0, 12) for _ in range(vpp)]


def check(pp, vpp, m, group, rank, b, combined=False):
    ref = replay(megatron_passes(pp, vpp, m, group, rank, combined), *b)
    got = fast(pp, vpp, m, group, rank, *b, combined=combined)
    assert got == ref, (pp, vpp, m, group, rank, b, combined)


def test_grid_every_rank_small_schedules():
    """Every rank of every schedule with PP 2-5, VPP 2-4, m 1-13, G 1-6 (m < PP, m not a multiple of
    G or of PP, G < PP, which Megatron refuses but the probes must still get right), three byte draws."""
    rng = random.Random(16)
    for pp, vpp, m, group in itertools.product(range(2, 6), range(2, 5), range(1, 14), range(1, 7)):
        for rank in range(pp):
            for zeros, combined in ((False, False), (True, False), (False, True), (True, True)):
                check(pp, vpp, m, group, rank, bytes_for(rng, vpp, zeros), combined)


@PROPERTY
@given(pp=st.integers(2, 16), vpp=st.integers(2, 12), m=st.integers(1, 96), group=st.integers(1, 24),
       rank_frac=st.floats(0, 1), seed=st.integers(0, 2**32 - 1), zeros=st.booleans(), combined=st.booleans())
def test_probes_match_replay(pp, vpp, m, group, rank_frac, seed, zeros, combined):
    rank = min(pp - 1, int(rank_frac * pp))
    check(pp, vpp, m, group, rank, bytes_for(random.Random(seed), vpp, zeros), combined)


@PROPERTY
@given(pp=st.integers(2, 16), vpp=st.integers(2, 4), groups=st.integers(1, 40), extra=st.integers(0, 30),
       more=st.integers(0, 16), rank_frac=st.floats(0, 1), seed=st.integers(0, 2**32 - 1), zeros=st.booleans(),
       combined=st.booleans())
def test_long_schedules_megatron_accepts(pp, vpp, groups, extra, more, rank_frac, seed, zeros, combined):
    """Up to 40 groups (the periodic stretch the probes skip is long), for the schedules Megatron accepts:
    PP <= G <= m and a last group of 0 or >= PP micro-batches (resolve/pipeline.py)."""
    group = pp + more
    m = groups * group + (pp + extra % (group - pp + 1) if extra and group > pp else 0)
    if m % group and m % group < pp:
        m -= m % group
    rank = min(pp - 1, int(rank_frac * pp))
    check(pp, vpp, m, group, rank, bytes_for(random.Random(seed), vpp, zeros), combined)


def test_many_virtual_stages_walk_the_schedule():
    """Beyond PROBE_MAX_VPP schedule_peak walks the schedule for the held bytes alone (a probe holds VPP counts:
    memory would grow as VPP squared; the estimator's count with the pipeline tensors is p2p_peak's, checked beyond
    8 virtual stages in tests/test_schedule_p2p.py). 200 virtual stages (400 layers at PP 2, one per virtual
    stage)."""
    rng = random.Random(200)
    for m, group in ((2, 2), (4, 2), (5, 2), (6, 3)):
        for rank in range(2):
            for combined in (False, True):
                check(2, 200, m, group, rank, bytes_for(rng, 200, False), combined)


def test_probe_count_does_not_grow_with_microbatches():
    """The point of the probes: DeepSeek-V3's PP16 VPP2 schedule costs the same for 64 or 8,192
    micro-batches (the steady state repeats every VPP x G passes)."""
    for rank in range(16):
        assert len(peak_probes(16, 2, 8192, 16, rank)[0]) == len(peak_probes(16, 2, 64, 16, rank)[0]) <= 32


def test_deepseek_v3_schedule_by_hand():
    """PP16 VPP2, G 16, rank 0: warm-up 2 x 15 + 16 = 46 forwards, so 47 micro-batches in flight. The
    table runs mb 0-15 on chunk 0, mb 0-15 on chunk 1, mb 16-31 on chunk 0, ...; the warm-up ends at
    position 45 (chunk 0, mb 29), the first steady pairs run the forwards of positions 46 and 47 (chunk 0,
    mb 30 and 31) while their backwards release chunk 1 (backward chunk = 1 - chunk of position k), so
    chunk 0 first holds 32 micro-batches at the forward of its 32nd micro-batch; chunk-0 backwards start
    at k = 16, from when it never holds more. With 1 byte per chunk-0 micro-batch, 0 on chunk 1, no
    transients: peak 32 there."""
    probes, in_flight = peak_probes(16, 2, 128, 16, 0)
    assert in_flight == 46 + 1
    v, (fwd, c, held, nth) = first_peak(probes, [1, 0], [0, 0], [0, 0])
    assert (v, fwd, c, held[0], nth) == (32, True, 0, 32, 32)
    assert held[0] + held[1] == 47


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


def test_uniform_chunks_closed_form():
    """Ranks whose chunks keep equal bytes (the middle of a deep pipeline) take schedule.uniform_peak's closed
    form: the first steady pair holds warm-up + 1 micro-batches, more than any other pass (or, with no steady
    state, every micro-batch at the last warm-up forward / first cool-down backward). Against the replay for
    every rank of PP 2-6, VPP 2-4, m 1-19, G 1-7, with the forward or the backward transient larger, or equal."""
    for pp, vpp, m, group in itertools.product(range(2, 7), range(2, 5), range(1, 20), range(1, 8)):
        for rank in range(pp):
            for size, f, top, bottom in ((1, 0, 0, 0), (2, 3, 1, 0), (3, 1, 4, 2), (1, 0, 0, 9), (5, 2, 2, 7)):
                b = ([size] * vpp, [f] * vpp, [top] * vpp, [bottom] * vpp)
                bwd = max(top, bottom - size)
                assert uniform_peak(pp, vpp, m, group, rank, size, f, bwd) is not None
                check(pp, vpp, m, group, rank, b)
    # DeepSeek-V3's middle ranks by hand: rank 7 of PP16 VPP2, G 16, 128 micro-batches, 1 byte each: the
    # warm-up is 2 x 8 + 16 = 32 forwards (positions 0-31: 16 on chunk 0, 16 on chunk 1), the first steady
    # forward is position 32 (chunk 0, its 17th micro-batch): 17 + 16 = 33 held
    assert uniform_peak(16, 2, 128, 16, 7, 1, 0, 0) == (33, (True, 0, (17, 16), 17), 33)
