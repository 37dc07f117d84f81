"""Issue vppspeed4: the interleaved schedule's costs that grew like VPP**2 (docs/testing.md, the hostile20 group of
benchmarks/hostile_input.py): p2p_peak's sampled path with a partial last micro-batch group or without a steady state,
and the combined 1F1B walk (--overlap-moe-expert-parallel-comm, p2p_walk_peak). Counted in work, not timed: the
Python lines schedule.py runs (sys.settrace), the passes sampled, and the VPP-long tuples built (_held, walk_held:
one per peak, for the probe it returns). The peaks themselves are checked against the replay of megatron-core's
schedule (tests/schedule_reference.py, tests/test_schedule_p2p.py's pipeline_tensors) on small schedules of the same
two kinds."""
from __future__ import annotations

import random
import sys

import pytest

from megatron_memguard import schedule
from test_schedule_p2p import pipeline_tensors, probes_of, valid


def _clear() -> None:
    for fn in (schedule._p2p_ranges, schedule._sample_context, schedule._lingering, schedule._received_for,
               schedule._grad_received_for, schedule.walk_passes, schedule.p2p_passes):
        fn.cache_clear()


def _lines(fn, *args) -> tuple[int, object]:
    """(Lines of schedule.py run by fn(*args), its result), from cold caches."""
    count = [0]
    path = schedule.__file__

    def local(frame, event, arg):
        if event == "line":
            count[0] += 1
        return local

    def tracer(frame, event, arg):
        return local if frame.f_code.co_filename == path else None
    _clear()
    sys.settrace(tracer)
    try:
        got = fn(*args)
    finally:
        sys.settrace(None)
    return count[0], got


def _pipeline(vpp: int, rank: int) -> tuple:
    # a pipeline's chunks: alike but the first stage's first (embedding) and the last stage's last (output layer);
    # every chunk receives its input but the first stage's first
    sizes = [100] * vpp
    if rank == 0:
        sizes[0] = 130
    fwd, bwd = [7] * vpp, [11] * vpp
    recv = tuple(0 if rank == 0 and c == 0 else 1 for c in range(vpp))
    return recv, tuple(sizes), tuple(fwd), tuple(bwd), 3


# the hostile20 inputs' shapes: PP 8, groups of 12, 20 micro-batches (a partial last group of 8); PP 4, groups of 4, 4
# micro-batches (the first two ranks run every micro-batch in the warm-up: no steady state; the other two are whole
# groups with a steady state, which _steady_peak takes by periods)
SAMPLED = [(8, 20, 12, rank) for rank in (0, 3, 7)] + [(4, 4, 4, rank) for rank in (0, 1)]


@pytest.mark.parametrize("pp, m, group, rank", SAMPLED)
def test_sampled_peak_work_grows_linearly_with_vpp(pp, m, group, rank):
    """Doubling VPP at most doubles the lines p2p_peak runs (+10% for the sorts' logarithm and the ends), where the
    passes of a VPP-long tuple each made it grow like VPP**2 (hostile20: 0.4 s at VPP 125, 16.6 s at 1,250)."""
    counts = []
    for vpp in (24, 48, 96):
        recv, sizes, fwd, bwd, t = _pipeline(vpp, rank)
        n, got = _lines(schedule.p2p_peak, pp, vpp, m, group, rank, recv, True, sizes, fwd, bwd, t)
        assert got is not None and len(got[2][2]) == vpp
        counts.append(n)
    assert counts[1] <= 2.2 * counts[0] and counts[2] <= 2.2 * counts[1], counts


@pytest.mark.parametrize("pp, m, group, rank", SAMPLED)
def test_sampled_peak_builds_one_vpp_long_tuple(monkeypatch, pp, m, group, rank):
    """At VPP 1,250 (the hostile20 estimate) p2p_peak builds one VPP-long tuple, the probe it returns, and reads the
    held counts of at most a few passes per virtual stage: each stretch of one chunk is bounded by its two ends in
    closed form (_held_sums), at most 5 pieces whatever VPP."""
    vpp = 1250
    made, sums = [0], [0]
    held, held_sums = schedule._held, schedule._held_sums

    def counted_held(*a):
        made[0] += 1
        return held(*a)

    def counted_sums(*a):
        sums[0] += 1
        return held_sums(*a)
    monkeypatch.setattr(schedule, "_held", counted_held)
    monkeypatch.setattr(schedule, "_held_sums", counted_sums)
    _clear()
    recv, sizes, fwd, bwd, t = _pipeline(vpp, rank)
    got = schedule.p2p_peak(pp, vpp, m, group, rank, recv, True, sizes, fwd, bwd, t)
    assert got is not None and made[0] == 1
    ranges = schedule._p2p_ranges(pp, vpp, m, group, rank, True)
    # each stretch's first end, plus the few passes counted where their bound can still win (248 of the first stage's
    # 40,002 sampled passes, each a VPP-long tuple before)
    assert len(ranges) <= sums[0] <= len(ranges) + vpp // 4
    # a chunk changes every group (q = 8 in the partial one) of positions: O(m x VPP / q) stretches
    assert len(ranges) <= 2 * m * vpp // (m % group or group) + vpp


@pytest.mark.parametrize("combined", [True, False])
def test_walk_work_grows_linearly_with_vpp(combined):
    """The walked schedules (p2p_walk_peak; the combined 1F1B one of --overlap-moe-expert-parallel-comm): doubling VPP
    at most doubles the lines run, where every pass counted each chunk's TransformerBlock pair (hostile20: PP 8, EP 4,
    16 micro-batches: 1.15 s at VPP 125, 3.3 s at 250), and one VPP-long tuple is built, the probe's."""
    counts = []
    for vpp in (16, 32, 64):
        recv, sizes, fwd, bwd, t = _pipeline(vpp, 0)
        n, got = _lines(schedule.p2p_walk_peak, 8, vpp, 16, 8, 0, recv, True, combined, sizes, fwd, bwd, t)
        assert len(got[2][2]) == vpp
        counts.append(n)
    assert counts[1] <= 2.2 * counts[0] and counts[2] <= 2.2 * counts[1], counts
    # the passes: 2 x m x VPP, each as (forward?, chunk, ordinal, units)
    assert len(schedule.walk_passes(8, 64, 16, 8, 0, _pipeline(64, 0)[0], True, combined)) == 2 * 16 * 64


def _corner_schedules():
    """Schedules megatron-core runs with a partial last group or a rank without a steady state: PP 2-4, VPP 2-6."""
    for pp in range(2, 5):
        for vpp in range(2, 7):
            for group in range(pp, pp + 3):
                for m in range(group, 3 * group + 1):
                    for rank in range(pp):
                        no_steady = m * vpp <= (pp - rank - 1) * 2 + (vpp - 1) * group
                        for overlap in (True, False):
                            if valid(pp, m, group, overlap) and (m % group or no_steady):
                                yield pp, vpp, m, group, rank, overlap


def test_corner_peaks_are_the_replays():
    """With a partial last group or no steady state, p2p_peak's value is the replay's largest held bytes + transient +
    pipeline tensors over every pass, and its probe the first pass p2p_passes samples with that value (a replayed
    pass); p2p_walk_peak (combined 1F1B) is the replay's first largest pass."""
    rng = random.Random(20261130)
    cases = list(_corner_schedules())
    assert len(cases) > 300
    for pp, vpp, m, group, rank, overlap in rng.sample(cases, 300):
        recv = tuple(0 if rank == 0 and c == 0 else 1 for c in range(vpp))
        sizes = tuple(rng.randint(0, 9) for _ in range(vpp))
        fx = tuple(rng.randint(0, 9) for _ in range(vpp))
        bx = tuple(rng.randint(0, 9) for _ in range(vpp))
        t = rng.randint(1, 4)
        probes = probes_of(pp, vpp, m, group, rank)
        units = pipeline_tensors(pp, vpp, m, group, rank, overlap)
        values = [sum(h * s for h, s in zip(p[2], sizes)) + (fx if p[0] else bx)[p[1]] + t * u
                  for p, u in zip(probes, units)]
        got = schedule.p2p_peak(pp, vpp, m, group, rank, recv, overlap, sizes, fx, bx, t)
        case = (pp, vpp, m, group, rank, overlap, sizes, fx, bx, t)
        assert got[0] == max(values), case
        i = probes.index(got[2])
        assert values[i] == got[0] and t * units[i] == got[1], case
        sampled = [p for p, *_ in schedule.p2p_passes(pp, vpp, m, group, rank, overlap)]
        first = next(p for p in sampled if values[probes.index(p)] == got[0])
        assert got[2] == first, case
        if overlap:
            probes = probes_of(pp, vpp, m, group, rank, True)
            units = pipeline_tensors(pp, vpp, m, group, rank, overlap, 1, True)
            values = [sum(h * s for h, s in zip(p[2], sizes)) + (fx if p[0] else bx)[p[1]] + t * u
                      for p, u in zip(probes, units)]
            i = values.index(max(values))
            assert schedule.p2p_walk_peak(pp, vpp, m, group, rank, recv, overlap, True, sizes, fx, bx, t) == (
                values[i], t * units[i], probes[i]), case
