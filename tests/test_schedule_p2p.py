"""The interleaved schedule's own activation-sized tensors (schedule.p2p_tensors_at, p2p_probes) against a replay that
follows megatron-core's objects pass by pass.

The replay (``pipeline_tensors``) keeps the references forward_backward_pipelining_with_interleaving keeps
(megatron-core 0.16.1 and 0.19.2, overlap_p2p_comm with and without, no warm-up flush):
* received inputs queued in ``input_tensors`` before their forward (recv_tensor_from_previous_stage: the first stage
  receives the last stage's output of pp - 1 steps before, for the next chunk; a later stage the next position's);
* TransformerBlock.input_tensor: each chunk's latest forward input, with the .grad backward_step retained once that
  micro-batch's backward ran;
* the loop's ``input_tensor_grad`` (the last backward's, until the next backward returns);
* a steady pair's forward output until the next forward (deallocate_output_tensor in pp_pre_forward, or after the
  send without overlap) and the output gradient its backward will use, received before its forward;
* with overlap, the warm-up's last receive in ``input_tensor`` to the schedule's end.
The tensors counted in the held micro-batches (their inputs) and in the backward's working set (its output gradient)
are left out. The CPU referee measures the same tensors on real megatron-core 0.16.1 runs
(tests/test_referee_stored.py: every interleaved rank within 0.02%).
"""
from __future__ import annotations

import itertools
import os
import random

from hypothesis import HealthCheck, given, settings, strategies as st

from megatron_memguard.schedule import (_lingering, _steady_peak, p2p_every_pass, p2p_passes, p2p_peak, p2p_probes,
                                       p2p_tensors_at, p2p_units_bound, p2p_walk_peak)
from schedule_reference import megatron_passes

EXAMPLES = int(os.environ.get("MEMGUARD_PROPERTY_EXAMPLES", "200"))


def _table(vpp: int, m: int, group: int) -> list[tuple[int, int]]:
    out = []
    for lo in range(0, m, group):
        out += [(mb, c) for c in range(vpp) for mb in range(lo, min(lo + group, m))]
    return out


def pipeline_tensors(pp: int, vpp: int, m: int, group: int, rank: int, overlap: bool, folds: int = 1,
                     combined: bool = False) -> list[int]:
    """Per pass of megatron_passes: the pipeline tensors live besides the held inputs and the backward's output
    gradient, in [s, b, h] units (a received input and its gradient ``folds`` units, as after a standalone MTP stage;
    the first stage's chunk 0 receives nothing).

    ``combined``: --overlap-moe-expert-parallel-comm's combined 1F1B schedule (megatron-core 0.16.1 / 0.19.2
    schedules.py forward_backward_pipelining_with_interleaving's steady loop calling
    combined_1f1b.py combined_1f1b_schedule_for_interleaved_pipelining, model_chunk_schedule_plan.py
    TransformerModelChunkSchedulePlan.run). A steady step is its backward, then its forward (memory order), and:
    * pp_pre_forward (overlap) deallocates the previous step's output before either pass, and without overlap it is
      deallocated after the step's send: no forward output is live at a pass;
    * combined_forward_backward_step calls set_input_tensor with the forward's input before the backward runs: the
      forward's chunk's TransformerBlock pair is replaced (that input counted as received, not yet held);
    * the backward's input (the local b_input_tensor) and its .grad stay until the step returns: live at the forward;
    * both the next input and the next backward's output gradient are received after both passes (post_forward /
      post_backward, or send_forward_backward_recv_forward_backward): none ahead at the forward."""
    table = _table(vpp, m, group)
    total = m * vpp
    warm = min((pp - rank - 1) * 2 + (vpp - 1) * group + combined, total)
    steady = total - warm
    first, last = rank == 0, rank == pp - 1

    def receives(c: int) -> bool:
        return not (first and c == 0)

    def received(step: int) -> tuple[int, int] | None:
        # recv_tensor_from_previous_stage(step, forward=True): the (chunk, micro-batch) whose input arrives
        if first:
            if step < pp - 1:
                return None
            mb, c = table[step - (pp - 1)]
            return None if c == vpp - 1 else (c + 1, mb)
        if step + 1 >= total:
            return None
        mb, c = table[step + 1]
        return (c, mb)

    def grad_received(step: int) -> tuple[int, int] | None:
        # recv_tensor_from_previous_stage(step, forward=False): the (chunk, micro-batch) whose output gradient
        # arrives after backward step ``step`` (the last stage leads the backward: the first stage's input gradient of
        # pp - 1 steps before, for the previous chunk)
        if step + 1 >= total:
            return None
        if last:
            if step < pp - 1:
                return None
            mb, c = table[step - (pp - 1)]
            return None if vpp - 1 - c == 0 else (vpp - 2 - c, mb)
        mb, c = table[step + 1]
        return (vpp - 1 - c, mb)

    queue: set = set()                       # received inputs not yet forwarded
    block = {c: ("prev", c) for c in range(vpp) if receives(c)}   # TransformerBlock.input_tensor per chunk
    done_bwd: set = set()                    # (chunk, mb) whose backward ran (their input has its .grad)
    loop_grad = None                         # the loop's input_tensor_grad
    warm_input = None                        # overlap: the warm-up's last receive, kept in ``input_tensor``
    out_alive = None                         # a steady pair's forward output
    grads: set = set()                       # received output gradients not yet used
    in_flight: set = set()
    step_local = None                        # combined: the backward's input (and .grad) until the step returns
    out: list[int] = []

    def live(fwd: bool, cur: tuple[int, int]) -> int:
        ids = set()
        for x in queue:
            ids.add(("X", x))
        for c, x in block.items():
            if x[0] == "prev" or x in done_bwd:
                ids |= {("X", x), ("dX", x)}
        if loop_grad is not None:
            ids.add(("dX", loop_grad))
        if warm_input is not None:
            ids.add(("X", warm_input))
            if warm_input in done_bwd:
                ids.add(("dX", warm_input))
        if out_alive is not None:
            ids.add(("O", out_alive))
        ids |= {("G", g) for g in grads}
        ids -= {("X", x) for x in in_flight}
        if not fwd:
            ids.discard(("G", cur))
        if step_local is not None:
            ids |= {("X", step_local), ("dX", step_local)}
        return sum(folds if kind in ("X", "dX") else 1 for kind, _ in ids)

    passes = megatron_passes(pp, vpp, m, group, rank, combined)
    k_f = 0                                  # forward steps done
    k_b = 0                                  # backward steps done
    i = 0
    while i < len(passes):
        fwd, c, mb = passes[i]
        if combined and not fwd and k_b < steady:
            # a combined steady step: the backward, then the forward, then the step's receives
            _, cf, mbf = passes[i + 1]
            if receives(cf):
                block[cf] = (cf, mbf)          # set_input_tensor before the backward runs
            out.append(live(False, (c, mb)))
            in_flight.discard((c, mb))
            grads.discard((c, mb))
            done_bwd.add((c, mb))
            if receives(c):
                step_local = (c, mb)
            queue.discard((cf, mbf))
            in_flight.add((cf, mbf))
            out.append(live(True, (cf, mbf)))
            step_local = None
            loop_grad = (c, mb) if receives(c) else None
            s = k_b
            k_f += 1
            k_b += 1
            r = received(warm + s) if s != steady - 1 else None
            if r is not None:
                queue.add(r)
            g = grad_received(s)
            if g is not None:
                grads.add(g)
            i += 2
            continue
        if fwd:
            # pre-forward (steady, overlap): the previous steady forward's output is deallocated
            if overlap:
                out_alive = None
            queue.discard((c, mb))
            in_flight.add((c, mb))
            if receives(c):
                block[c] = (c, mb)
            out.append(live(True, (c, mb)))
            step = k_f
            k_f += 1
            if step < warm:
                r = received(step) if step != total - 1 else None
                if r is not None:
                    queue.add(r)
                    if step == warm - 1 and steady > 0 and overlap:
                        warm_input = r
                if step == warm - 1 and steady > 0 and not last:
                    grads.add((vpp - 1, table[0][0]))          # the first backward's output gradient
            else:
                if not (last and c == vpp - 1):
                    out_alive = (c, mb)
                if overlap:
                    r = received(step) if step - warm != steady - 1 else None
                    if r is not None:
                        queue.add(r)
        else:
            out.append(live(False, (c, mb)))
            in_flight.discard((c, mb))
            grads.discard((c, mb))
            done_bwd.add((c, mb))
            loop_grad = (c, mb) if receives(c) else None
            step = k_b
            k_b += 1
            if step < steady:
                if not overlap:
                    out_alive = None
                    r = received(warm + step) if step != steady - 1 else None
                    if r is not None:
                        queue.add(r)
                if step == steady - 1:
                    out_alive = None                 # deallocated after the steady loop
            g = grad_received(step)                  # post_backward, the steady comm or the cool-down's receive
            if g is not None:
                grads.add(g)
        i += 1
    return out


def probes_of(pp: int, vpp: int, m: int, group: int, rank: int, combined: bool = False):
    """The probe (forward?, chunk, held counts, ordinal) of every pass, in order."""
    held = [0] * vpp
    seen: dict = {}
    out = []
    for fwd, c, _mb in megatron_passes(pp, vpp, m, group, rank, combined):
        seen[fwd, c] = seen.get((fwd, c), 0) + 1
        if fwd:
            held[c] += 1
        out.append((fwd, c, tuple(held), seen[fwd, c]))
        if not fwd:
            held[c] -= 1
    return out


def valid(pp: int, m: int, group: int, overlap: bool) -> bool:
    """The schedules megatron-core runs: PP <= G <= m, a last partial group of at least PP (schedules.py raises
    otherwise), PP > 2 without overlap_p2p_comm (validate_args)."""
    return pp <= group <= m and (m % group == 0 or m % group >= pp) and (overlap or pp > 2)


def small_schedules(micro_batches):
    """(pp, vpp, m, group, rank, receiving chunks, overlap) of every valid schedule with PP 2-4, VPP 2-3, groups
    from PP to PP + 2, with and without overlap_p2p_comm (the first rank's first chunk receives nothing)."""
    for pp, vpp, m, extra in itertools.product(range(2, 5), range(2, 4), micro_batches, range(3)):
        group = pp + extra
        for rank in range(pp):
            recv = tuple(0 if rank == 0 and c == 0 else 1 for c in range(vpp))
            for overlap in (True, False):
                if valid(pp, m, group, overlap):
                    yield pp, vpp, m, group, rank, recv, overlap


def test_pipeline_tensors_every_pass_small_schedules():
    """Every pass of every rank with PP 2-4, VPP 2-3, m up to 12, G from PP to PP + 2, with and without
    overlap_p2p_comm: p2p_tensors_at equals the replay."""
    for pp, vpp, m, group, rank, recv, overlap in small_schedules(range(2, 13)):
        ref = pipeline_tensors(pp, vpp, m, group, rank, overlap)
        got = [p2p_tensors_at(pp, vpp, m, group, rank, p, recv, overlap) for p in probes_of(pp, vpp, m, group, rank)]
        assert got == ref, (pp, vpp, m, group, rank, overlap)


def test_p2p_probes_find_the_replays_peak():
    """The sampled passes (p2p_probes) reach the same largest value as every pass, for random bytes per chunk and an
    activation-sized tensor of 3 (small, so that the pipeline tensors decide between passes)."""
    rng = random.Random(5)
    for pp, vpp, m, group, rank, recv, overlap in small_schedules((3, 4, 6, 8, 11, 16)):
        sizes = [rng.randint(0, 5) for _ in range(vpp)]
        fx = [rng.randint(0, 6) for _ in range(vpp)]
        bx = [rng.randint(0, 6) for _ in range(vpp)]
        units = pipeline_tensors(pp, vpp, m, group, rank, overlap)
        full = max(sum(h * s for h, s in zip(p[2], sizes)) + (fx if p[0] else bx)[p[1]] + 3 * u
                   for p, u in zip(probes_of(pp, vpp, m, group, rank), units))
        fast = max(sum(h * s for h, s in zip(p[2], sizes)) + (fx if p[0] else bx)[p[1]] + 3 * u
                   for p, u in p2p_probes(pp, vpp, m, group, rank, recv, overlap))
        assert fast == full, (pp, vpp, m, group, rank, overlap, sizes, fx, bx)


def test_pipeline_tensors_by_hand_pp4_vpp2_rank2():
    """vpp_pp4_v2's third rank (PP 4, VPP 2, 8 micro-batches, groups of 4; the CPU referee's measured peak, the
    backward of chunk 0's micro-batch 1 in steady pair 5), from megatron-core 0.16.1's schedule by hand: chunk 1 is
    idle (its 4 micro-batches done), so its TransformerBlock keeps micro-batch 3's input and gradient (2); the warm-up's
    last receive (chunk 1 micro-batch 2's input) and its gradient stay in the loop's ``input_tensor`` (2); the loop's
    input gradient of chunk 0 micro-batch 0 (1); the pair's forward output, chunk 0 micro-batch 7 (1); chunk 1 micro-
    batch 4's input received after that forward (1): 7 tensors (measured: 7 [256, 2, 256] bf16 storages beyond the
    held inputs and the output gradient, benchmarks/results/referee-measured.json)."""
    probe = (False, 0, (7, 0), 2)
    assert p2p_tensors_at(4, 2, 8, 4, 2, probe, (1, 1), True) == 7
    # without overlap_p2p_comm the next input is received after the backward and the loop's input_tensor is replaced
    assert p2p_tensors_at(4, 2, 8, 4, 2, probe, (1, 1), False) == 4


@settings(derandomize=True, database=None, deadline=None, max_examples=EXAMPLES // 2,
          suppress_health_check=[HealthCheck.too_slow])
@given(pp=st.integers(2, 8), vpp=st.integers(2, 5), groups=st.integers(1, 6), extra=st.integers(0, 6),
       more=st.integers(0, 8), rank_frac=st.floats(0, 1), seed=st.integers(0, 2**32 - 1), overlap=st.booleans(),
       folds=st.integers(1, 3))
def test_p2p_probes_match_replay_property(pp, vpp, groups, extra, more, rank_frac, seed, overlap, folds):
    """Any schedule Megatron runs (G = PP + extra, m a multiple of G plus a last group of PP or more): the sampled
    passes reach the replay's largest value, with random bytes and a chunk's input counted ``folds`` times."""
    group = pp + extra
    m = groups * group + (pp + more if pp + more < group else 0)
    if not valid(pp, m, group, overlap):
        return
    rank = min(pp - 1, int(rank_frac * pp))
    rng = random.Random(seed)
    recv = tuple(0 if rank == 0 and c == 0 else 1 for c in range(vpp))
    sizes = [rng.randint(0, 9) for _ in range(vpp)]
    fx = [rng.randint(0, 9) for _ in range(vpp)]
    bx = [rng.randint(0, 9) for _ in range(vpp)]
    t = rng.randint(1, 4)
    units = pipeline_tensors(pp, vpp, m, group, rank, overlap, folds)
    full = max(sum(h * s for h, s in zip(p[2], sizes)) + (fx if p[0] else bx)[p[1]] + t * u
               for p, u in zip(probes_of(pp, vpp, m, group, rank), units))
    fast = max(sum(h * s for h, s in zip(p[2], sizes)) + (fx if p[0] else bx)[p[1]] + t * u
               for p, u in p2p_probes(pp, vpp, m, group, rank, tuple(folds * r for r in recv), overlap))
    assert fast == full, (pp, vpp, m, group, rank, overlap, sizes, fx, bx, t, folds)


def test_p2p_units_bound_holds_at_every_sampled_pass():
    """p2p_units_bound (p2p_peak skips the passes whose bound cannot win) is at least p2p_tensors_at, which equals the
    replay on every pass (test_pipeline_tensors_every_pass_small_schedules), at every sampled pass of PP 2-5, VPP 2-4,
    m up to 16, with a chunk's input counted once or twice; and it is reached somewhere (not a vacuous bound)."""
    reached = 0
    for pp, vpp, m, extra in itertools.product(range(2, 6), range(2, 5), range(2, 17), range(3)):
        group = pp + extra
        for rank in range(pp):
            for overlap in (True, False):
                if not valid(pp, m, group, overlap):
                    continue
                cw = _lingering(pp, vpp, m, group, rank, overlap)[2]
                for folds in (1, 2):
                    recv = tuple(0 if rank == 0 and c == 0 else folds for c in range(vpp))
                    for entry in p2p_passes(pp, vpp, m, group, rank, overlap):
                        units = p2p_tensors_at(pp, vpp, m, group, rank, entry[0], recv, overlap)
                        bound = p2p_units_bound(entry, recv, cw)
                        assert bound >= units, (pp, vpp, m, group, rank, overlap, folds, entry, units)
                        reached += bound == units
    assert reached > 1000


def test_p2p_peak_is_the_probes_first_peak():
    """p2p_peak (the units counted only where they can still win) picks what a scan of every p2p_probes probe picks
    (the first with the largest value: the estimator's choice before), and its value is the replay's largest, for
    random bytes, transients and tensor sizes (some alike chunks, as in the middle of a pipeline)."""
    rng = random.Random(11)
    for pp, vpp, m, extra in itertools.product(range(2, 5), range(2, 4), (3, 4, 6, 8, 11, 16), range(3)):
        group = pp + extra
        for rank in range(pp):
            for overlap in (True, False):
                if not valid(pp, m, group, overlap):
                    continue
                for trial in range(3):
                    folds = rng.randint(1, 2)
                    recv = tuple(0 if rank == 0 and c == 0 else folds for c in range(vpp))
                    if trial == 0:                          # alike chunks
                        sizes, fx, bx = [rng.randint(0, 9)] * vpp, [rng.randint(0, 9)] * vpp, [rng.randint(0, 9)] * vpp
                    else:
                        sizes = [rng.randint(0, 9) for _ in range(vpp)]
                        fx = [rng.randint(0, 9) for _ in range(vpp)]
                        bx = [rng.randint(0, 9) for _ in range(vpp)]
                    t = rng.randint(1, 4)
                    want, want_u, want_p = -1, 0, None
                    for p, u in p2p_probes(pp, vpp, m, group, rank, recv, overlap):
                        v = sum(h * s for h, s in zip(p[2], sizes)) + (fx if p[0] else bx)[p[1]] + t * u
                        if v > want:
                            want, want_u, want_p = v, t * u, p
                    got = p2p_peak(pp, vpp, m, group, rank, recv, overlap, tuple(sizes), tuple(fx), tuple(bx), t)
                    assert got == (want, want_u, want_p), (pp, vpp, m, group, rank, overlap, sizes, fx, bx, t)
                    units = pipeline_tensors(pp, vpp, m, group, rank, overlap, folds)
                    assert got[0] == max(sum(h * s for h, s in zip(p[2], sizes)) + (fx if p[0] else bx)[p[1]] + t * u
                                         for p, u in zip(probes_of(pp, vpp, m, group, rank), units))


def test_every_pass_walk_equals_the_replay_both_schedules():
    """p2p_every_pass (the estimator's count for the combined 1F1B schedule) gives every pass's probe and pipeline
    tensors as the replay, for the combined schedule (--overlap-moe-expert-parallel-comm) and the plain interleaved
    one, PP 2-4, VPP 2-3, m up to 12, G from PP to PP + 2, with and without overlap_p2p_comm, a chunk's input counted
    once or twice."""
    for combined in (True, False):
        for pp, vpp, m, group, rank, recv, overlap in small_schedules(range(2, 13)):
            for folds in (1, 2):
                ref = pipeline_tensors(pp, vpp, m, group, rank, overlap, folds, combined)
                got = p2p_every_pass(pp, vpp, m, group, rank, tuple(folds * r for r in recv), overlap, combined)
                assert [p for p, _ in got] == probes_of(pp, vpp, m, group, rank, combined)
                assert [u for _, u in got] == ref, (combined, pp, vpp, m, group, rank, overlap, folds)


def test_combined_schedule_tensors_by_hand_pp2_vpp2_rank0():
    """PP 2, VPP 2, 4 micro-batches in groups of 2, the first rank, combined 1F1B with overlap_p2p_comm (warm-up 5:
    chunk 0's micro-batches 0-2 and chunk 1's 0-1; tests/test_ep_overlap.py's hand-derived table). Only chunk 1
    receives (from the last stage, one step behind: chunk 1's micro-batches 0 and 1 arrive after forward steps 1 and 2
    and are forwarded at steps 2 and 3; nothing is queued at the warm-up's end).
    Step 0: the backward of chunk 1's micro-batch 0 has nothing besides its own tensors (0), its forward (chunk 0's
    micro-batch 3) runs with that backward's input and its .grad still referenced by combined_forward_backward_step's
    b_input_tensor (2). Step 1: the backward of chunk 1's micro-batch 1 runs with chunk 1's micro-batch 2's input
    received after step 0 (1) and the loop's input_tensor_grad of step 0 (1): 2."""
    got = p2p_every_pass(2, 2, 4, 2, 0, (0, 1), True, True)
    assert got[5] == ((False, 1, (3, 2), 1), 0)
    assert got[6] == ((True, 0, (4, 1), 4), 2)
    assert got[7] == ((False, 1, (4, 1), 2), 2)


def test_combined_walk_peak_is_the_replays_first_peak():
    """p2p_walk_peak picks the replay's first pass with the largest held bytes + transient + tensors, for random
    bytes (the combined schedule)."""
    rng = random.Random(17)
    for pp, vpp, m, group, rank, recv, overlap in small_schedules((3, 4, 6, 8, 11)):
        sizes = tuple(rng.randint(0, 9) for _ in range(vpp))
        fx = tuple(rng.randint(0, 9) for _ in range(vpp))
        bx = tuple(rng.randint(0, 9) for _ in range(vpp))
        t = rng.randint(1, 4)
        units = pipeline_tensors(pp, vpp, m, group, rank, overlap, 1, True)
        values = [sum(h * s for h, s in zip(p[2], sizes)) + (fx if p[0] else bx)[p[1]] + t * u
                  for p, u in zip(probes_of(pp, vpp, m, group, rank, True), units)]
        i = values.index(max(values))
        got = p2p_walk_peak(pp, vpp, m, group, rank, recv, overlap, True, sizes, fx, bx, t)
        assert got == (values[i], t * units[i], probes_of(pp, vpp, m, group, rank, True)[i])


def test_more_than_eight_virtual_stages():
    """Beyond 8 virtual stages (the estimator used to count every receiving chunk's pair there) the sampled count is
    the replay's: p2p_tensors_at at every pass and p2p_peak's value, VPP 9-11, PP 2-4, m up to 16."""
    rng = random.Random(9)
    for pp, vpp, m, extra in itertools.product(range(2, 5), range(9, 12), (4, 6, 9, 12, 16), range(2)):
        group = pp + extra
        for rank in range(pp):
            for overlap in (True, False):
                if not valid(pp, m, group, overlap):
                    continue
                recv = tuple(0 if rank == 0 and c == 0 else 1 for c in range(vpp))
                ref = pipeline_tensors(pp, vpp, m, group, rank, overlap)
                probes = probes_of(pp, vpp, m, group, rank)
                assert [p2p_tensors_at(pp, vpp, m, group, rank, p, recv, overlap) for p in probes] == ref
                sizes = tuple(rng.randint(0, 9) for _ in range(vpp))
                fx = tuple(rng.randint(0, 9) for _ in range(vpp))
                bx = tuple(rng.randint(0, 9) for _ in range(vpp))
                t = rng.randint(1, 4)
                want = max(sum(h * s for h, s in zip(p[2], sizes)) + (fx if p[0] else bx)[p[1]] + t * u
                           for p, u in zip(probes, ref))
                assert p2p_peak(pp, vpp, m, group, rank, recv, overlap, sizes, fx, bx, t)[0] == want


def test_steady_peak_by_periods_is_the_samples_first_peak():
    """_steady_peak (schedules Megatron runs with whole groups of micro-batches, counted by steady-state periods)
    picks what a scan of every p2p_probes probe picks: value, tensors and probe, for PP 2-5, VPP 2-4 and 9-10, 1-6
    groups of PP to PP + 2, every rank, with and without overlap_p2p_comm, a chunk's input received once or twice.
    Bytes per micro-batch large beside the tensor (a chunk's activations against one [s/CP, b, h] tensor, where it
    applies: the warm-up and cool-down stay below the steady state's peak) or small (where it often leaves the choice
    to the samples); it must apply to most of the large ones."""
    rng = random.Random(23)
    taken = large = 0
    for pp, vpp, groups, extra in itertools.product(range(2, 6), (2, 3, 4, 9, 10), range(1, 7), range(3)):
        group = pp + extra
        m = groups * group
        for rank in range(pp):
            for overlap in (True, False):
                if not valid(pp, m, group, overlap):
                    continue
                folds = rng.randint(1, 2)
                recv = tuple(0 if rank == 0 and c == 0 else folds for c in range(vpp))
                for big in (True, False):
                    lo, hi = (200, 260) if big else (0, 9)
                    sizes = tuple(rng.randint(lo, hi) for _ in range(vpp))
                    fx = tuple(rng.randint(0, 9) for _ in range(vpp))
                    bx = tuple(rng.randint(0, 9) for _ in range(vpp))
                    t = rng.randint(1, 4)
                    got = _steady_peak(pp, vpp, m, group, rank, recv, overlap, sizes, fx, bx, t)
                    large += big
                    if got is None:
                        continue
                    taken += big
                    want, want_u, want_p = -1, 0, None
                    for p, u in p2p_probes(pp, vpp, m, group, rank, recv, overlap):
                        v = sum(h * s for h, s in zip(p[2], sizes)) + (fx if p[0] else bx)[p[1]] + t * u
                        if v > want:
                            want, want_u, want_p = v, t * u, p
                    assert got == (want, want_u, want_p), (pp, vpp, m, group, rank, overlap, sizes, fx, bx, t)
    assert taken > 0.9 * large, (taken, large)
