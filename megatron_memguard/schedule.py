"""The order in which a pipeline rank runs forward and backward passes, as megatron-core schedules them.

``forward_backward_no_pipelining`` (PP=1): forward then backward, one micro-batch at a time.
``forward_backward_pipelining_without_interleaving`` (1F1B): ``min(PP - rank - 1, m)`` warm-up
forwards, then one forward / one backward, then the cool-down backwards (the estimator's
_peak_one_chunk takes its peak in closed form).
``forward_backward_pipelining_with_interleaving``: warm-up ``(PP - rank - 1) * 2 + (VPP - 1) * G``
virtual micro-batches (G = micro-batches per group, default PP), capped at m x VPP; chunks visited
group by group (``get_schedule_table`` in megatron/core/pipeline_parallel/schedules.py), backward in
reverse chunk order. With ``--overlap-moe-expert-parallel-comm`` the interleaved schedule is the
combined 1F1B one (``get_pp_rank_microbatches``, ``combined_1f1b_schedule_for_interleaved_pipelining``,
megatron-core 0.16.1 / 0.19.2): one more warm-up forward, and each steady step runs the backward of
micro-batch k and the forward of k + warm-up together, which in memory order is the backward first.
The estimator takes the interleaved peak of the bytes held plus the schedule's own activation-sized tensors
(``p2p_tensors_at``) at any number of virtual stages from ``p2p_passes``: the runs over which a pass's chunk stays
the same and the held counts move evenly (``_runs``), sampled where those tensors change, without visiting all
m x VPP x 2 passes (tests/test_schedule.py checks the samples against a replay of every pass of
tests/schedule_reference.py, which tests/test_ep_overlap.py checks against megatron-core's own schedule table;
tests/test_schedule_p2p.py replays the tensors pass by pass). ``p2p_peak`` takes their first peak counting the
tensors only at the samples whose bound (``p2p_units_bound``) can still win; for the schedules Megatron runs with
whole groups of micro-batches, ``_steady_peak`` takes the same pass by steady-state periods, elsewhere (a partial
last group, no steady state) the samples are bounded stretch by stretch (``_p2p_ranges``) with their held counts as
at most five pieces (``_held_sums``), never as VPP-long tuples. The combined 1F1B schedule's peak is taken from every
pass (``walk_passes``, ``p2p_walk_peak``), its tensors kept as they change. Each costs O(m x VPP) per rank
(tests/test_schedule_speed.py counts the work).
"""
from __future__ import annotations

from functools import lru_cache
from itertools import compress
from operator import mul, not_, sub


# One probe: (forward?, chunk, micro-batches held per chunk at that pass, the pass's ordinal among the
# passes of its direction on its chunk). A forward's held counts include its own micro-batch; a
# backward's include the one it is about to release.
Probe = tuple[bool, int, tuple[int, ...], int]

def _warmup(pp: int, vpp: int, group: int, pp_rank: int, m: int, combined: bool = False) -> int:
    return min((pp - pp_rank - 1) * 2 + (vpp - 1) * group + combined, m * vpp)


def _counts(a: int, vpp: int, m: int, group: int) -> list[int]:
    """Forwards of each chunk among the first ``a`` positions of the forward table (built with list repetition from
    _shape: a comprehension over the chunks costs more at many virtual stages)."""
    hi, d, mid, lo = _shape(a, vpp, m, group)
    if d >= vpp:                            # past the last full group, or the last position: every micro-batch
        return [hi] * vpp
    return [hi] * d + [mid] + [lo] * (vpp - d - 1)


def _runs(pp: int, vpp: int, m: int, group: int, pp_rank: int) -> list[tuple[int, int, int, int, int]]:
    """The runs of one rank's passes over which a pass's chunk stays the same and the held counts move
    by a constant step, in schedule order: (section, k0, n, forward chunk, backward chunk).
    Section 0: warm-up forwards of table positions k0 .. k0+n-1; 1: steady pairs k (the forward of
    position k + warm-up, then the backward of position k); 2: cool-down backwards of positions k.

    The forward table repeats every VPP x G positions within the full groups, and so does the steady
    state: a steady pair a period after another one has the same chunks and held counts, hence the
    same values, and comes later, so it is never the first peak; only the first period and the pairs
    that reach the last (partial) group are listed."""
    P = vpp * group
    total = m * vpp
    full = (m // group) * P                 # table positions in full groups (the periodic part)
    q = m - (m // group) * group            # micro-batches of the last, partial group (0: none)
    warm = _warmup(pp, vpp, group, pp_rank, m)
    steady = total - warm
    top = vpp - 1
    # chunk of table position x: (x % P) // group in the full groups, (x - full) // q after them;
    # the next position where the chunk changes: (x // group + 1) * group, or full + ((x - full) // q + 1) * q
    out = []
    add = out.append
    k = 0
    while k < warm:
        if k < full:
            c = (k % P) // group
            k1 = (k // group + 1) * group
        else:
            c = (k - full) // q
            k1 = full + ((k - full) // q + 1) * q
        if k1 > warm:
            k1 = warm
        add((0, k, k1 - k, c, -1))
        k = k1
    for lo, hi in ((0, min(steady, P)), (max(P, full - warm), steady)):
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
            add((1, k, k1 - k, cf, cb))
            k = k1
    k = steady
    while k < total:
        if k < full:
            cb = top - (k % P) // group
            k1 = (k // group + 1) * group
        else:
            cb = top - (k - full) // q
            k1 = full + ((k - full) // q + 1) * q
        if k1 > total:
            k1 = total
        add((2, k, k1 - k, -1, cb))
        k = k1
    return out


def _in_flight(warm: int, total: int, combined: bool = False) -> int:
    """Most micro-batches in flight: the warm-up's, plus the steady state's first forward if any (the
    combined schedule releases one before each steady forward)."""
    return warm + 1 if total > warm and not combined else warm


def _left_t(a: int, vpp: int, m: int, group: int) -> tuple[int, ...]:
    """The micro-batches each chunk still holds after the backwards of the first ``a`` positions: m less _counts(a),
    reversed (backwards run the chunks last first)."""
    return _held(m * vpp, a, vpp, m, group)


def _held(a: int, b: int, vpp: int, m: int, group: int) -> tuple[int, ...]:
    """The micro-batches each chunk holds after the forwards of the first ``a`` forward-table positions and the
    backwards of the first ``b``: _counts(a) less _counts(b) reversed (a VPP-long tuple: the probe a peak returns)."""
    return tuple(map(sub, _counts(a, vpp, m, group), reversed(_counts(b, vpp, m, group))))


def _shape(a: int, vpp: int, m: int, group: int) -> tuple[int, int, int, int]:
    """_counts(a) as (hi, d, mid, lo): hi at the chunks before d, mid at chunk d, lo after it (d = VPP: all hi)."""
    P = vpp * group
    full = (m // group) * P
    if a <= full:
        j, o = divmod(a, P)
        base, size = j * group, group
    else:
        q = m - (m // group) * group
        if not q:
            return m, vpp, 0, 0
        o = a - full
        base, size = m - q, q
    d, r = divmod(o, size)
    if d >= vpp:
        return base + size, vpp, 0, 0
    return base + size, d, base + r, base


def _held_of(a: int, b: int, vpp: int, m: int, group: int):
    """Chunk c's held count after the forwards of the first ``a`` table positions and the backwards of the first
    ``b`` (_counts(a)[c] less _counts(b)[VPP - 1 - c]), as a function of c."""
    ha, da, ma, la = _shape(a, vpp, m, group)
    hb, db, mb, lb = _shape(b, vpp, m, group)
    eb = vpp - 1 - db                       # (the backwards' chunk order is the forwards' reversed)

    def of(c: int) -> int:
        return (ha if c < da else ma if c == da else la) - (lb if c < eb else mb if c == eb else hb)
    return of


def _held_sums(a: int, b: int, vpp: int, m: int, group: int, S: list[int], R: list[int]) -> tuple[int, int]:
    """For the held counts of _held_of(a, b): (sum_c held_c x sizes[c], the sum of receiving over the chunks holding
    none), from the prefix sums S of the sizes and R of the receiving counts, piece by piece (at most five)."""
    ha, da, ma, la = _shape(a, vpp, m, group)
    if not b:                               # (no backward yet: the forwards' pieces alone)
        if da == vpp:
            return ha * S[vpp], (R[vpp] if not ha else 0)
        v = ha * S[da] + ma * (S[da + 1] - S[da]) + la * (S[vpp] - S[da + 1])
        u = (0 if ha else R[da]) + (0 if ma else R[da + 1] - R[da]) + (0 if la else R[vpp] - R[da + 1])
        return v, u
    hb, db, mb, lb = _shape(b, vpp, m, group)
    eb = vpp - 1 - db
    v = u = x = 0
    for y in sorted((da, da + 1, eb, eb + 1, vpp)):
        if y > vpp:
            y = vpp
        if y > x:
            h = (ha if x < da else ma if x == da else la) - (lb if x < eb else mb if x == eb else hb)
            if h:
                v += h * (S[y] - S[x])
            else:
                u += R[y] - R[x]
            x = y
    return v, u


def _count_of(a: int, vpp: int, m: int, group: int, c: int) -> int:
    """_counts(a)[c] without building the list."""
    hi, d, mid, lo = _shape(a, vpp, m, group)
    return hi if c < d else mid if c == d else lo


def _table_position(vpp: int, m: int, group: int, chunk: int, nth: int) -> int:
    """The forward-table position of the ``nth`` (1-based) forward of ``chunk`` (get_schedule_table: groups of
    ``group`` micro-batches per chunk, the last group of m % group)."""
    j = nth - 1
    whole = (m // group) * group
    if j < whole:
        g, o = divmod(j, group)
        return g * vpp * group + chunk * group + o
    q = m - whole
    return (m // group) * vpp * group + chunk * q + (j - whole)


def _chunk_at(vpp: int, m: int, group: int, x: int) -> int:
    """The chunk of forward-table position ``x``."""
    P = vpp * group
    full = (m // group) * P
    return (x % P) // group if x < full else (x - full) // (m - (m // group) * group)


def p2p_tensors_at(pp: int, vpp: int, m: int, group: int, pp_rank: int, probe: Probe, receiving: tuple[int, ...],
                   overlap: bool) -> int:
    """The pipeline's own activation-sized tensors live at the probe's pass besides the held micro-batches' inputs
    and the backward's received output gradient, in [s/CP, b, h] units (a chunk's input counted ``receiving[c]``
    times, 0 for the first stage's first chunk), in megatron-core's interleaved schedule (0.16.1 and 0.19.2,
    forward_backward_pipelining_with_interleaving, not the combined one):

    - TransformerBlock.set_input_tensor keeps a chunk's last input, with the .grad backward_step retained, until
      its next forward: a pair for each receiving chunk holding no micro-batch (not started in this iteration:
      the previous one's, or done);
    - the loop's ``input_tensor_grad`` keeps the last backward's input gradient until the next backward returns
      (after the first backward of the iteration);
    - a steady forward runs with its pair's output gradient already received (post_backward / the warm-up's last
      receive), unless that backward is the last stage's last chunk;
    - a steady backward runs with its pair's forward output not yet deallocated (deallocate_output_tensor in the
      next pre-forward, or after the send without overlap), unless that chunk is the last stage's last one, and,
      with ``overlap_p2p_comm`` (Megatron's default under VPP), the next forward's input already received
      (pp_post_forward), unless the pair is the last steady one."""
    fwd, c, held, nth = probe
    recv = receiving.__getitem__
    n = len(receiving)
    idle = sum([recv(ch) for ch, h in enumerate(held) if h == 0 and ch < n])
    return _tensors_at(pp, vpp, m, group, pp_rank, fwd, c, nth, idle, held.__getitem__, receiving, overlap)


def _tensors_at(pp: int, vpp: int, m: int, group: int, pp_rank: int, fwd: bool, c: int, nth: int, idle: int,
                held_of, receiving: tuple[int, ...], overlap: bool) -> int:
    """p2p_tensors_at of the pass (fwd, c, nth) given the inputs its idle chunks received (``idle``: the sum of
    receiving over the chunks holding no micro-batch) and its held counts as a function of the chunk (``held_of``):
    no VPP-long tuple needed."""
    warm, lw, cw, nw, yw = _lingering(pp, vpp, m, group, pp_rank, overlap)
    total = m * vpp
    steady = total - warm

    def recv(ch: int) -> int:
        return receiving[ch] if 0 <= ch < len(receiving) else 0

    def bwd_chunk(y: int) -> int:
        return vpp - 1 - _chunk_at(vpp, m, group, y)

    def queued(done: int, steps: int) -> int:
        # inputs received after the first ``steps`` forward steps for forwards past the first ``done`` positions
        # (done >= steps; a receive brings the input of a position at most ``group`` ahead on the first stage, the
        # next one on the others)
        n = 0
        for s in range(max(0, steps - (group + 1 if pp_rank == 0 else 1)), steps):
            x = _received_for(pp, vpp, m, group, pp_rank, s)
            if x >= done:
                n += recv(_chunk_at(vpp, m, group, x))
        return n

    def grads_queued(done: int, steps: int) -> int:
        # output gradients received after the first ``steps`` backward steps (and at the warm-up's end, for the
        # first backward) for backwards from position ``done`` on
        n = 1 if done == 0 and steady > 0 and pp_rank != pp - 1 else 0
        for s in range(max(0, steps - (group + 1 if pp_rank == pp - 1 else 1)), steps):
            if _grad_received_for(pp, vpp, m, group, pp_rank, s) >= done:
                n += 1
        return n

    def units(fwd: bool, k: int, section: int) -> int:
        # k: the steady pair (section 1), the backward position (2) or the forward position (0)
        n = 2 * idle
        if section == 0:
            return n + queued(k + 1, k)
        if section == 1:
            # a steady pair's receive follows its forward (pp_post_forward), or both its passes without overlap;
            # the last steady pair receives nothing
            n += queued(warm + k + 1, warm + k + (overlap and not fwd and k < steady - 1))
        y = k                               # the pass's backward position (the pair's for a steady forward)
        lingering = cw >= 0 and yw < y and recv(cw) and not (
            held_of(cw) == 0 and (m if section == 2 else _count_of(k + warm + 1, vpp, m, group, cw)) == nw)
        if lingering:
            n += 2 * recv(cw)
        if y >= 1:
            p = bwd_chunk(y - 1)
            if held_of(p) != 0 and not (lingering and y - 1 == yw):
                n += recv(p)
        # output gradients received ahead: a steady forward's include its pair's (counted in the backward's
        # working set once that backward runs)
        n += grads_queued(k if fwd else k + 1, y)
        if section == 2 or fwd:
            return n
        cf = _chunk_at(vpp, m, group, k + warm)
        return n + (0 if pp_rank == pp - 1 and cf == vpp - 1 else 1)

    if fwd:
        x = _table_position(vpp, m, group, c, nth)
        if x < warm:
            return units(True, x, 0)
        k, section = x - warm, 1
    else:
        y = _table_position(vpp, m, group, vpp - 1 - c, nth)
        k, section = y, (1 if y < steady else 2)
    return units(fwd, k, section)


def steady_pass(pp: int, vpp: int, m: int, group: int, pp_rank: int, k: int, fwd: bool) -> Probe | None:
    """The forward (``fwd``) or backward pass of steady pair ``k`` of the interleaved schedule as a probe; None when
    there is no such pair."""
    warm = _warmup(pp, vpp, group, pp_rank, m)
    if not 0 <= k < m * vpp - warm:
        return None
    held = _held(k + warm + 1, k, vpp, m, group)
    if fwd:
        cf = _chunk_at(vpp, m, group, k + warm)
        return (True, cf, held, _count_of(k + warm + 1, vpp, m, group, cf))
    c = _chunk_at(vpp, m, group, k)
    return (False, vpp - 1 - c, held, _count_of(k, vpp, m, group, c) + 1)


def steady_index(pp: int, vpp: int, m: int, group: int, pp_rank: int, probe: Probe) -> int:
    """The steady pair of a probe's pass (-1 in the warm-up or the cool-down)."""
    fwd, c, _, nth = probe
    warm = _warmup(pp, vpp, group, pp_rank, m)
    if fwd:
        k = _table_position(vpp, m, group, c, nth) - warm
    else:
        k = _table_position(vpp, m, group, vpp - 1 - c, nth)
    return k if 0 <= k < m * vpp - warm else -1


@lru_cache(maxsize=4096)
def _grad_received_for(pp: int, vpp: int, m: int, group: int, pp_rank: int, s: int) -> int:
    """The backward position whose output gradient the receive after backward step ``s`` brings (-1: none): the next
    one's on an earlier stage; on the last, the first stage's input gradient of pp - 1 steps before, for the previous
    chunk (recv_tensor_from_previous_stage(forward=False), megatron-core 0.16.1 / 0.19.2). None after the last."""
    total = m * vpp
    if not 0 <= s < total - 1:
        return -1
    if pp_rank != pp - 1:
        return s + 1
    if s < pp - 1:
        return -1
    x = s - pp + 1
    c = _chunk_at(vpp, m, group, x)         # the forward-table chunk of that position: backward chunk vpp - 1 - c
    if c == vpp - 1:                         # backward chunk 0 sends nothing back to this stage
        return -1
    return _table_position(vpp, m, group, c + 1, _count_of(x + 1, vpp, m, group, c))


@lru_cache(maxsize=1024)
def _lingering(pp: int, vpp: int, m: int, group: int, pp_rank: int, overlap: bool) -> tuple[int, int, int, int, int]:
    """(warm-up, and with overlap_p2p_comm the warm-up's last receive, which the loop's ``input_tensor`` keeps to the
    schedule's end (the steady and cool-down loops receive into other buffers): its forward position, chunk, ordinal
    in the chunk and backward position; -1, -1, 0, m x VPP without it)."""
    warm = _warmup(pp, vpp, group, pp_rank, m)
    total = m * vpp
    lw = _received_for(pp, vpp, m, group, pp_rank, warm - 1) if overlap and total > warm else -1
    if lw < 0:
        return warm, -1, -1, 0, total
    cw = _chunk_at(vpp, m, group, lw)
    nw = _count_of(lw + 1, vpp, m, group, cw)
    return warm, lw, cw, nw, _table_position(vpp, m, group, vpp - 1 - cw, nw)


@lru_cache(maxsize=4096)
def _received_for(pp: int, vpp: int, m: int, group: int, pp_rank: int, s: int) -> int:
    """The forward position whose input the receive after forward step ``s`` brings (-1: none): the next one's on
    a later stage; on the first, the output the last stage made pp - 1 steps before, for the next chunk
    (recv_tensor_from_previous_stage, megatron-core 0.16.1 / 0.19.2). None after the last step."""
    total = m * vpp
    if not 0 <= s < total - 1:
        return -1
    if pp_rank:
        return s + 1
    if s < pp - 1:
        return -1
    c = _chunk_at(vpp, m, group, s - pp + 1)
    if c == vpp - 1:
        return -1
    return _table_position(vpp, m, group, c + 1, _count_of(s - pp + 2, vpp, m, group, c))


def lingering_backward(pp: int, vpp: int, m: int, group: int, pp_rank: int) -> int:
    """The backward position of the micro-batch whose input the warm-up's last receive got (-1: none)."""
    warm = _warmup(pp, vpp, group, pp_rank, m)
    x = _received_for(pp, vpp, m, group, pp_rank, warm - 1) if m * vpp > warm else -1
    if x < 0:
        return -1
    c = _chunk_at(vpp, m, group, x)
    return _table_position(vpp, m, group, vpp - 1 - c, _count_of(x + 1, vpp, m, group, c))

@lru_cache(maxsize=512)
def p2p_probes(pp: int, vpp: int, m: int, group: int, pp_rank: int, receiving: tuple[int, ...],
               overlap: bool) -> tuple[tuple[Probe, int], ...]:
    """The interleaved (not combined) schedule's passes where the bytes held plus the pipeline's own tensors
    (p2p_tensors_at, in [s/CP, b, h] units) can first peak, each with its units, in schedule order: of the sampled
    passes (p2p_passes), those with the same direction, chunk and held counts differ only in their units, so the
    first with the most stands for them."""
    best: dict = {}
    for i, (p, *_) in enumerate(p2p_passes(pp, vpp, m, group, pp_rank, overlap)):
        u = p2p_tensors_at(pp, vpp, m, group, pp_rank, p, receiving, overlap)
        key = p[:3]
        if key not in best or u > best[key][2]:
            best[key] = (i, p, u)
    return tuple((p, u) for _, p, u in sorted(best.values()))


@lru_cache(maxsize=512)
def p2p_passes(pp: int, vpp: int, m: int, group: int, pp_rank: int,
               overlap: bool) -> tuple[tuple[Probe, int, int, int, int, int], ...]:
    """The interleaved (not combined) schedule's passes sampled for the pipeline's own tensors, in schedule order,
    each as (probe, section, k, a, l, c): section 0, a warm-up forward of table position k; 1, a pass of steady pair
    k; 2, a cool-down backward of position k; a, l, c: its p2p_units_bound's terms (_bound_terms). p2p_peak reads
    them stretch by stretch (_p2p_ranges, _sampled_at) without the held counts' tuples."""
    ctx = _sample_context(pp, vpp, m, group, pp_rank, overlap)
    out = []
    for section, ks in _p2p_ranges(pp, vpp, m, group, pp_rank, overlap):
        for k in ks:
            for fwd in ((True, False) if section == 1 else (not section,)):
                _, fwd, c, nth, a, b = _sampled_at(ctx, section, k, fwd)
                out.append(((fwd, c, _held(a, b, vpp, m, group), nth), section, k, *_bound_terms(ctx, section, k, fwd)))
    return tuple(out)


@lru_cache(maxsize=512)
def _p2p_ranges(pp: int, vpp: int, m: int, group: int, pp_rank: int,
                overlap: bool) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """The passes p2p_passes samples, in schedule order, by stretch: (section, the positions sampled in ascending
    order) of a section (0: warm-up forwards of table positions; 1: both passes of steady pairs; 2: cool-down
    backwards) within a stretch of one chunk (section 1: one forward chunk and one backward chunk), so that between
    its first and last position the held counts move by one constant step and no chunk falls idle or starts: the held
    bytes are linear in the position.

    Along one of _runs' runs the held bytes change evenly and the units stay the same but at its first two and
    last two passes and around the warm-up's last input's release (lingering_backward): those passes are
    sampled. The steady state's skipped periods repeat the first one's passes, with the previous backward's
    gradient and, once past its release, without the warm-up's last input: the first period's samples are also taken
    one period later and the first period after the release. The first stage's warm-up and cool-down (at most about
    2 x PP + VPP x group passes each, its queue of inputs received ahead changing pass by pass) are taken whole."""
    warm = _warmup(pp, vpp, group, pp_rank, m)
    total = m * vpp
    steady = total - warm
    P = vpp * group
    full = (m // group) * P
    q = m - (m // group) * group
    yw = lingering_backward(pp, vpp, m, group, pp_rank) if overlap else -1
    out: list[tuple[int, tuple[int, ...]]] = []
    pairs: set[int] = set()                 # the steady pairs sampled

    def near(k: int, n: int) -> tuple[int, ...]:
        return tuple(sorted({j for j in (k, k + 1, k + n - 2, k + n - 1, yw, yw + 1, yw + 2) if k <= j < k + n}))

    def starts(x: int) -> bool:
        # a table position whose chunk is not its predecessor's: groups of ``group`` in the full groups, of the
        # partial group's q after them
        return x % group == 0 if x < full else (x - full) % q == 0

    def steady_stretches() -> None:
        # the steady pairs sampled, split where a pair's forward or backward chunk changes (the copies a period on
        # join other runs')
        if not pairs:
            return
        ks = sorted(pairs)
        pairs.clear()
        now = [ks[0]]
        for j in ks[1:]:
            if any(starts(x + warm) or starts(x) for x in range(now[-1] + 1, j + 1)):
                out.append((1, tuple(now)))
                now = [j]
            else:
                now.append(j)
        out.append((1, tuple(now)))

    for section, k, n, _cf, _cb in _runs(pp, vpp, m, group, pp_rank):
        if section == 0:
            # (a later stage's warm-up units are the idle chunks' pairs: the same along a run)
            out.append((0, tuple(range(k, k + n)) if pp_rank == 0 or n <= 2 else (k, k + n - 1)))
        elif section == 1:
            js = set(near(k, n))
            # near the last (partial) group the first stage's queued receives change pass by pass: every pair there
            js.update(range(max(k, full - group - pp - warm), k + n))
            if pp_rank in (0, pp - 1):
                # the first stage's queue of inputs received ahead (the last stage's of output gradients) grows and
                # shrinks evenly between the group boundaries of its receives (pp - 1 steps behind) and of its
                # passes: both ends of each stretch
                edge = (0, 1, group - 1)
                js.update([j for j in range(k, k + n)
                           if (j + warm) % group in edge or (j + warm - pp + 1) % group in edge])
            for j in list(js):
                if j < P:
                    # one period later (after a first backward), the first period after the warm-up's last input
                    # is released
                    # (and the period after: until the warm-up's last input's chunk runs a later forward, that
                    # input is also its TransformerBlock's, counted once)
                    for jj in (j + P, j + 2 * P) + (((yw + 1 - j) // P + 1) * P + j,) * (j <= yw + 1):
                        if jj < steady and jj + warm < full:
                            js.add(jj)
            pairs |= js
        else:
            steady_stretches()              # (the steady pairs come before the cool-down)
            out.append((2, tuple(range(k, k + n)) if pp_rank in (0, pp - 1) else near(k, n)))
    steady_stretches()
    return tuple(out)


@lru_cache(maxsize=512)
def _sample_context(pp: int, vpp: int, m: int, group: int, pp_rank: int, overlap: bool) -> tuple:
    """What _sampled_at and _bound_terms read of a schedule."""
    warm, _, cw, _, yl = _lingering(pp, vpp, m, group, pp_rank, overlap)
    total = m * vpp
    return pp, vpp, m, group, pp_rank == 0, pp_rank == pp - 1, warm, total - warm, total, overlap, cw, yl


def _sampled_at(ctx: tuple, section: int, k: int, fwd: bool) -> tuple[int, bool, int, int, int, int]:
    """A p2p_passes pass as (its ordinal in the schedule, forward?, chunk, ordinal among its chunk's passes of its
    direction, a, b): it holds the micro-batches of the first ``a`` forwards less the first ``b`` backwards."""
    pp, vpp, m, group, first, last, warm, steady, total, overlap, cw, yl = ctx
    if section == 0:
        c = _chunk_at(vpp, m, group, k)
        return k, True, c, _count_of(k + 1, vpp, m, group, c), k + 1, 0
    if section == 2:
        c = _chunk_at(vpp, m, group, k)
        return warm + steady + k, False, vpp - 1 - c, _count_of(k, vpp, m, group, c) + 1, total, k
    if fwd:
        c = _chunk_at(vpp, m, group, k + warm)
        return warm + 2 * k, True, c, _count_of(k + warm + 1, vpp, m, group, c), k + warm + 1, k
    c = _chunk_at(vpp, m, group, k)
    return warm + 2 * k + 1, False, vpp - 1 - c, _count_of(k, vpp, m, group, c) + 1, k + warm + 1, k


def _bound_terms(ctx: tuple, section: int, k: int, fwd: bool) -> tuple[int, int, int]:
    """The a, l, c of a p2p_passes pass: its p2p_units_bound less its idle chunks' pairs is a x max(receiving) + l x 2
    x receiving[the warm-up's last input's chunk] + c, the terms of p2p_tensors_at, each at its largest (the pass's
    section and direction leave some out):
    - inputs queued: a later stage receives one, for the next position, only after a steady backward with
      overlap_p2p_comm (the last steady one excepted); the first stage at most one per step of its window (group + 1);
    - the warm-up's last input only past its release (lingering_backward); the previous backward's gradient;
    - output gradients queued: an earlier stage than the last holds one before a steady forward (none before a
      backward), the last stage at most one per step of its window (group + 1);
    - a steady backward's pair output.
    (The first stage's receives and the last stage's gradient receives bring nothing in their first pp - 1 steps.)
    Along a range of _p2p_ranges each term grows with k, but a steady backward's a at the last steady pair."""
    pp, vpp, m, group, first, last, warm, steady, total, overlap, cw, yl = ctx
    g1 = group + 1
    if section == 0:
        if first:
            a = k - pp + 1
            return 0 if a < 0 else g1 if a > g1 else a, 0, 0
        return 0, 0, 0
    bwd1 = section == 1 and not fwd
    # (overlap_p2p_comm's receive after a steady backward, the last steady one excepted)
    q = 1 if bwd1 and overlap and k < steady - 1 else 0
    if first:
        if section == 1:
            a = warm + k + q - pp + 1
            a = 0 if a < 0 else g1 if a > g1 else a
        else:
            a = 0
    else:
        a = q
    if last:
        c = k - pp + 1
        c = 0 if c < 0 else g1 if c > g1 else c
    else:
        c = 0 if bwd1 or section == 2 else 1
    return a + (k >= 1), 1 if cw >= 0 and yl < k else 0, c + bwd1


def p2p_units_bound(entry: tuple, receiving: tuple[int, ...], lingering_chunk: int) -> int:
    """An upper bound on p2p_tensors_at at one of p2p_passes (``lingering_chunk``: _lingering's chunk of the warm-up's
    last input, -1 for none): the idle chunks' pairs as they are, the other terms at their largest."""
    p, _, _, a, l, c = entry
    r = max(receiving, default=0)
    rl = 2 * receiving[lingering_chunk] if 0 <= lingering_chunk < len(receiving) else 0
    return 2 * sum([x for h, x in zip(p[2], receiving) if not h]) + a * r + l * rl + c


def _steady_peak(pp: int, vpp: int, m: int, group: int, pp_rank: int, receiving: tuple[int, ...], overlap: bool,
                 sizes: tuple[int, ...], fwd_extra: tuple[int, ...], bwd_extra: tuple[int, ...],
                 t: int) -> tuple[int, int, Probe] | None:
    """p2p_peak for a schedule Megatron runs whose micro-batches fill whole groups (m a multiple of G, PP <= G, PP > 2
    or overlap_p2p_comm) and whose bytes are not negative, by periods instead of sampled passes; None when it does not
    apply or when a warm-up or cool-down pass might reach the steady state's peak (p2p_peak then samples the passes).

    In the steady state the held counts of pair j repeat with j mod (VPP x G) (_counts: a period later every chunk
    has G more forwards and G more backwards), so one walk over a period gives each pair's held bytes (a forward adds
    its chunk's, a backward releases its chunk's) and idle chunks; with the other terms of p2p_units_bound at their
    largest that bounds every pair of the same phase. The phases p2p_passes samples are taken by that bound, the
    largest (then the earliest) first; within one, the pairs p2p_passes samples (the phase in the first period, one
    and two periods later, the first period after the warm-up's last input is released) have their pipeline tensors
    counted (p2p_tensors_at's terms, in closed form within whole groups) where their own bound can still win: the
    first sampled pass with the most, as p2p_peak's scan picks (the same candidates: a pass p2p_passes does not sample
    may tie with it earlier, so no other is taken; benchmarks/p2p_peak_equivalence.py --whole-groups). A warm-up
    pass holds at most the bytes of its run's last pass and a cool-down pass those of its run's first (each run: one
    chunk): their bounds must stay below the peak found (a warm-up pass comes first: equal is not enough)."""
    G = group
    n = len(sizes)
    if not (2 <= pp <= G <= m and vpp >= 2 and m % G == 0 and (overlap or pp > 2)
            and n == vpp == len(receiving) == len(fwd_extra) == len(bwd_extra)):
        return None
    if min(sizes) < 0 or min(fwd_extra) < 0 or min(bwd_extra) < 0 or min(receiving) < 0:
        return None
    P = vpp * G
    total = m * vpp
    warm, _, cw, nw, yw = _lingering(pp, vpp, m, G, pp_rank, overlap)
    steady = total - warm
    if steady <= 0:
        return None
    first, last = pp_rank == 0, pp_rank == pp - 1
    top = vpp - 1
    g1 = G + 1
    r = max(receiving)
    rl = 2 * receiving[cw] if cw >= 0 else 0
    # the largest a x r + l x rl + c of p2p_units_bound over the steady pairs, forward and backward passes
    cap_f = ((g1 if first else 0) + 1) * r + rl + (g1 if last else 1)
    cap_b = ((g1 if first else 1 if overlap else 0) + 1) * r + rl + (g1 + 1 if last else 1)

    # the steady pairs p2p_passes samples (whole groups: _runs' steady runs are those of the first period, split
    # where the forward's or the backward's chunk changes), by phase
    span = P if steady > P else steady
    ys = yw if cw >= 0 else -1              # (p2p_passes' lingering_backward)
    edge = (0, 1, G - 1)
    cuts = sorted({0, span, *range(0, span, G), *range((G - warm) % G, span, G)})
    base = {j for j in (ys, ys + 1, ys + 2) if 0 <= j < span}
    base.update(range(steady - G - pp if steady > G + pp else 0, span))
    for k, e in zip(cuts, cuts[1:]):
        base.update((k, e - 1))
        if e - k > 2:
            base.update((k + 1, e - 2))
    if first or last:
        base.update([j for j in range(span) if (j + warm) % G in edge or (j + warm - pp + 1) % G in edge])

    # one period of pairs: pair u holds _counts(u + warm + 1) less the backwards' reversed _counts(u)
    held = _counts(warm + 1, vpp, m, G)
    h = sum(map(mul, held, sizes))
    idle = sum([x for c, x in zip(held, receiving) if not c])
    phases = []
    add = phases.append
    cf = (warm % P) // G
    # (the warm-up's last pass holds pair 0's micro-batches but its forward's, a cool-down pass at most the last pair's)
    h_warm = h - sizes[cf]
    u_last = (steady - 1) % P
    h_cool = h
    for u in range(span):
        cb = top - u // G
        if u == u_last:
            h_cool = h
        if u in base:
            add((-(h + fwd_extra[cf] + t * (2 * idle + cap_f)), 2 * u, u, True, cf, h, idle))
            add((-(h + bwd_extra[cb] + t * (2 * idle + cap_b)), 2 * u + 1, u, False, cb, h, idle))
        # the pair's backward releases a micro-batch of its chunk, the next pair's forward adds one of its chunk
        held[cb] -= 1
        h -= sizes[cb]
        if not held[cb]:
            idle += receiving[cb]
        cf = ((u + 1 + warm) % P) // G
        if not held[cf]:
            idle -= receiving[cf]
        held[cf] += 1
        h += sizes[cf]
    phases.sort()

    best, at, retained, probe = -1, -1, 0, None
    for bound, o, u, fwd, c, h, idle in phases:
        if -bound < best or (-bound == best and o + warm > at):
            break
        # its pairs sampled: a period and two later, the first period after the warm-up's last input is released
        js = [u, u + P, u + 2 * P]
        if u <= ys + 1:
            j = ((ys + 1 - u) // P + 1) * P + u
            if j not in js:
                js.append(j)
                js.sort()
        v0 = h + (fwd_extra[c] if fwd else bwd_extra[c]) + t * 2 * idle
        for k in js:
            if k >= steady:
                break
            order = warm + 2 * k + (not fwd)
            # p2p_passes' a, l and c of the pass (p2p_units_bound)
            q = 1 if not fwd and overlap and k < steady - 1 else 0
            if first:
                a = warm + k + q - pp + 1
                a = 0 if a < 0 else g1 if a > g1 else a
            else:
                a = q
            if k >= 1:
                a += 1
            if last:
                cc = k - pp + 1
                cc = 0 if cc < 0 else g1 if cc > g1 else cc
            else:
                cc = 1 if fwd else 0
            if not fwd:
                cc += 1
            b = v0 + t * (a * r + (rl if cw >= 0 and yw < k else 0) + cc)
            if b < best or (b == best and order > at):
                continue
            # p2p_tensors_at of the pass, its steady terms beside the idle pairs. Within whole groups a receive after
            # step s brings position s - PP + 1 + G (its next chunk's, the same ordinal) on the first stage, likewise
            # the last stage's output gradients (_received_for, _grad_received_for), none for the last chunk's
            x = warm + k                    # the pair's forward position
            units = 2 * idle
            if first:                       # inputs received ahead (up to G + 1 steps back)
                steps = x + q
                for s in range(steps - g1 if steps > g1 else 0, steps if steps < total - 1 else total - 1):
                    z = s - pp + 1
                    if z >= 0 and z + G > x:
                        cz = (z % P) // G
                        if cz != top:
                            units += receiving[cz + 1]
            elif q:                         # the next forward's input, received after this backward
                units += receiving[((x + 1) % P) // G]
            # the warm-up's last input, past its release (once only if it is also its idle chunk's block input);
            # chunk c's held count after x + 1 forwards and k backwards: _counts(x + 1)[c] - _counts(k)[top - c]
            linger = False
            if cw >= 0 and yw < k and receiving[cw]:
                o = (x + 1) % P - cw * G
                after_w = ((x + 1) // P) * G + (0 if o < 0 else G if o > G else o)
                o = k % P - (top - cw) * G
                linger = not (after_w == nw and after_w == (k // P) * G + (0 if o < 0 else G if o > G else o))
                if linger:
                    units += rl
            if k >= 1:                      # the previous backward's input gradient
                tc = ((k - 1) % P) // G
                pc = top - tc
                o = (x + 1) % P - pc * G
                o2 = k % P - tc * G
                if (((x + 1) // P) * G + (0 if o < 0 else G if o > G else o) != (k // P) * G
                        + (0 if o2 < 0 else G if o2 > G else o2)) and not (linger and k - 1 == yw):
                    units += receiving[pc]
            if last:                        # output gradients received ahead
                done = k if fwd else k + 1
                for s in range(k - g1 if k > g1 else 0, k if k < total - 1 else total - 1):
                    z = s - pp + 1
                    if z >= 0 and z + G >= done and (z % P) // G != top:
                        units += 1
                if not fwd and (x % P) // G != top:
                    units += 1              # the pair's forward output
            else:
                units += 1                  # the pair's output gradient received (forward) or forward output (backward)
            units *= t
            v = v0 - t * 2 * idle + units
            if v > best or (v == best and order < at):
                best, at, retained, probe = v, order, units, (k, fwd)

    # the warm-up's runs (one chunk each; the idle chunks the same after its first pass): its last pass's held bytes,
    # the first stage's queued inputs at their largest
    held = [0] * vpp
    h, idle = 0, sum(receiving)
    q = g1 * r if first else 0
    x = 0 if h_warm + max(fwd_extra) + t * (2 * idle + q) >= best else warm   # (all of them below: none to walk)
    while x < warm:
        c = (x % P) // G
        x1 = (x // G + 1) * G
        if x1 > warm:
            x1 = warm
        if not held[c]:
            idle -= receiving[c]
        held[c] += x1 - x
        h += (x1 - x) * sizes[c]
        if h + fwd_extra[c] + t * (2 * idle + q) >= best:
            return None
        x = x1
    # the cool-down's runs: its first pass's held bytes, the other terms at their largest
    q = r + rl + (g1 if last else 0)
    if h_cool + max(bwd_extra) + t * (2 * sum(receiving) + q) <= best:
        return best, retained, steady_pass(pp, vpp, m, G, pp_rank, probe[0], probe[1])
    before = _counts(steady, vpp, m, G)
    held = [m - d for d in reversed(before)]
    h = sum(map(mul, held, sizes))
    idle = sum([x for c, x in zip(held, receiving) if not c])
    y = steady
    while y < total:
        cb = top - (y % P) // G
        y1 = (y // G + 1) * G
        if y1 > total:
            y1 = total
        if h + bwd_extra[cb] + t * (2 * idle + q) > best:
            return None
        held[cb] -= y1 - y
        h -= (y1 - y) * sizes[cb]
        if not held[cb]:
            idle += receiving[cb]
        y = y1
    return best, retained, steady_pass(pp, vpp, m, G, pp_rank, probe[0], probe[1])


def p2p_peak(pp: int, vpp: int, m: int, group: int, pp_rank: int, receiving: tuple[int, ...], overlap: bool,
             sizes: tuple[int, ...], fwd_extra: tuple[int, ...], bwd_extra: tuple[int, ...],
             t: int) -> tuple[int, int, Probe] | None:
    """The first of p2p_probes with the most sum_c held_c * sizes[c] + (fwd_extra or bwd_extra)[chunk] + t x units:
    (that value, t x units, the probe); None when t <= 0 (then the probes' own choice between equal passes stands).

    With t > 0 that is the first sampled pass (p2p_passes) with the most. Units are counted only where they can still
    matter: the sampled passes of one direction in one stretch of _p2p_ranges are taken by the largest of their
    p2p_units_bound (the held bytes linear along the stretch: at one of its ends), the largest (then the earliest)
    first, until it can no longer beat the best found; within them, only the passes whose own bound can. The held
    counts are read piece by piece (_held_sums); only the returned probe's are made a tuple. (Any order of the
    passes gives the same first largest pass: a pass is passed over only when its bound cannot beat, or only tie
    later than, the best found.)"""
    if t <= 0:
        return None
    got = _steady_peak(pp, vpp, m, group, pp_rank, receiving, overlap, sizes, fwd_extra, bwd_extra, t)
    if got is not None:
        return got
    ctx = _sample_context(pp, vpp, m, group, pp_rank, overlap)
    cw = ctx[10]
    r = max(receiving, default=0)
    rl = 2 * receiving[cw] if 0 <= cw < len(receiving) else 0
    if len(sizes) == vpp and len(receiving) == vpp:
        # sum_c held_c x sizes[c] and the idle chunks' received inputs piece by piece of the held counts, from prefix
        # sums (the same integers)
        S = [0]
        R = [0]
        for x, y in zip(sizes, receiving):
            S.append(S[-1] + x)
            R.append(R[-1] + y)

        def weigh(a: int, b: int) -> tuple[int, int]:
            return _held_sums(a, b, vpp, m, group, S, R)
    else:
        def weigh(a: int, b: int) -> tuple[int, int]:
            held = _held(a, b, vpp, m, group)
            return sum(map(mul, held, sizes)), sum(compress(receiving, map(not_, held)))

    # each stretch's passes of one direction bounded together: along a stretch the held bytes are linear in k and the
    # idle chunks the same (_p2p_ranges), so their largest is at an end; the other terms at their largest there too
    # (_bound_terms: at its last pass, at its last two for steady backwards), unless a receiving count is negative:
    # then taken pass by pass
    monotone = r >= 0 and rl >= 0
    linear = len(sizes) == vpp
    scored = []
    add = scored.append
    for i, (section, ks) in enumerate(_p2p_ranges(pp, vpp, m, group, pp_rank, overlap)):
        k0, k1 = ks[0], ks[-1]
        x0, _, c0, _, a, b = _sampled_at(ctx, section, k0, True)
        v, u = weigh(a, b)
        top = v + t * 2 * u
        if k1 > k0:
            # the other end: a step adds a micro-batch of the forward chunk and releases one of the backward chunk
            if not linear:
                v, u = weigh(*_sampled_at(ctx, section, k1, True)[4:])
            elif section == 0:
                v += (k1 - k0) * sizes[c0]
            else:
                cb = vpp - 1 - _chunk_at(vpp, m, group, k0)
                v += (k1 - k0) * ((sizes[c0] if section == 1 else 0) - sizes[cb])
            if v + t * 2 * u > top:
                top = v + t * 2 * u
        for fwd in ((True, False) if section == 1 else (not section,)):
            if not fwd and section == 1:
                x0 += 1
                c0 = vpp - 1 - _chunk_at(vpp, m, group, k0)
            if monotone:
                a, l, c = _bound_terms(ctx, section, k1, fwd)
                more = a * r + l * rl + c
                if k1 > k0 and section == 1 and not fwd:
                    a2, l2, c2 = _bound_terms(ctx, section, ks[-2], fwd)
                    more = (a if a > a2 else a2) * r + (l if l > l2 else l2) * rl + (c if c > c2 else c2)
            else:
                more = max([a * r + l * rl + c for a, l, c in (_bound_terms(ctx, section, k, fwd) for k in ks)])
            add((-(top + (fwd_extra if fwd else bwd_extra)[c0] + t * more), x0, i, fwd))
    scored.sort()
    best, at, retained, probe = -1, -1, 0, None
    ranges = _p2p_ranges(pp, vpp, m, group, pp_rank, overlap)
    for bound, x0, i, fwd in scored:
        # (sorted by bound, then schedule order: passes that can at most tie with an earlier best cannot win)
        if -bound < best or (-bound == best and x0 > at):
            break
        section, ks = ranges[i]
        for k in ks:
            x, _, c, nth, a, b = _sampled_at(ctx, section, k, fwd)
            ta, tl, tc = _bound_terms(ctx, section, k, fwd)
            v, u = weigh(a, b)
            v += (fwd_extra if fwd else bwd_extra)[c]
            most = v + t * (2 * u + ta * r + tl * rl + tc)        # (its p2p_units_bound)
            if most < best or (most == best and x > at):
                continue
            units = t * _tensors_at(pp, vpp, m, group, pp_rank, fwd, c, nth, u, _held_of(a, b, vpp, m, group),
                                    receiving, overlap)
            if v + units > best or (v + units == best and x < at):
                best, at, retained, probe = v + units, x, units, (fwd, c, a, b, nth)
    if at < 0:
        return None
    fwd, c, a, b, nth = probe
    return best, retained, (fwd, c, _held(a, b, vpp, m, group), nth)


def peak_in_flight(pp: int, vpp: int, m: int, group: int, pp_rank: int, combined: bool = False) -> int:
    """The most micro-batches in flight on a rank of the interleaved (``combined``: combined 1F1B) schedule."""
    return _in_flight(_warmup(pp, vpp, group, pp_rank, m, combined), m * vpp, combined)


def p2p_every_pass(pp: int, vpp: int, m: int, group: int, pp_rank: int, receiving: tuple[int, ...], overlap: bool,
                   combined: bool = False) -> tuple[tuple[Probe, int], ...]:
    """Every pass of one rank's interleaved schedule, in order, with the pipeline's own activation-sized tensors live
    at it (in [s/CP, b, h] units, as p2p_tensors_at counts them). Used for the combined 1F1B schedule
    (``combined``: --overlap-moe-expert-parallel-comm), whose order p2p_passes does not sample.

    The combined schedule keeps the interleaved one's tensors (TransformerBlock pairs of idle chunks, the loop's
    input gradient, the queues of received inputs and output gradients, the warm-up's last receive with
    overlap_p2p_comm) with three differences, megatron-core 0.16.1 / 0.19.2 (schedules.py
    forward_backward_pipelining_with_interleaving's steady loop; combined_1f1b.py
    combined_1f1b_schedule_for_interleaved_pipelining / combined_forward_backward_step;
    model_chunk_schedule_plan.py TransformerModelChunkSchedulePlan.run):
    - combined_forward_backward_step calls set_input_tensor with the step's forward input before the backward runs,
      so that chunk's previous pair is gone at the step's backward (its new input counted as received, not held);
    - no forward output is live at a pass: pp_pre_forward deallocates the previous step's before the step's backward
      (overlap_p2p_comm), or it is deallocated after the step's send;
    - the backward's input (the local b_input_tensor) and its .grad live until the step returns, through its forward;
      the next input and output gradient are received after both passes.
    Each probe's held counts are a tuple per chunk: cost O(m x VPP x VPP); the estimator reads walk_passes (the same
    passes without them, O(m x VPP)), the tests' replays this."""
    held = [0] * vpp
    out = []
    for fwd, c, nth, u in walk_passes(pp, vpp, m, group, pp_rank, receiving, overlap, combined):
        if fwd:
            held[c] += 1
            out.append(((True, c, tuple(held), nth), u))
        else:
            out.append(((False, c, tuple(held), nth), u))
            held[c] -= 1
    return tuple(out)


def walk_held(walk: tuple[tuple[bool, int, int, int], ...], vpp: int, i: int) -> tuple[int, ...]:
    """The held counts per chunk at pass ``i`` of walk_passes' passes (p2p_every_pass' probe's)."""
    held = [0] * vpp
    for fwd, c, _, _ in walk[:i]:
        held[c] += 1 if fwd else -1
    if walk[i][0]:
        held[walk[i][1]] += 1
    return tuple(held)


@lru_cache(maxsize=256)
def walk_passes(pp: int, vpp: int, m: int, group: int, pp_rank: int, receiving: tuple[int, ...], overlap: bool,
          combined: bool = False) -> tuple[tuple[bool, int, int, int], ...]:
    """p2p_every_pass' passes as (forward?, chunk, ordinal, units), without the held counts: each pass's tensors
    kept up to date as the walk goes (a chunk's TransformerBlock pair changes only at its own passes), so that the
    cost is O(m x VPP) per rank (cached per schedule shape)."""
    total = m * vpp
    warm = _warmup(pp, vpp, group, pp_rank, m, combined)
    steady = total - warm
    last = pp_rank == pp - 1
    recv = [receiving[c] if c < len(receiving) else 0 for c in range(vpp)]
    chunk = [_chunk_at(vpp, m, group, x) for x in range(total)]
    nth = [0] * total                       # 1-based ordinal of position x among its chunk's positions
    seen = [0] * vpp
    for x in range(total):
        seen[chunk[x]] += 1
        nth[x] = seen[chunk[x]]
    top = vpp - 1
    # the forward position of backward position y's micro-batch: chunk top - chunk[y], ordinal nth[y]
    fpos = [_table_position(vpp, m, group, top - chunk[y], nth[y]) for y in range(total)]
    fdone = [0] * vpp

    queue: set[int] = set()                 # forward positions received ahead, not yet forwarded
    block = [-1] * vpp                      # TransformerBlock.input_tensor per chunk (-1: the previous iteration's)
    bdone = [0] * vpp
    grads: set[int] = set()                 # backward positions whose output gradient is received, not yet used
    lg = wi = sl = -1                       # the loop's input gradient, the warm-up's last receive, the step's input
    out_alive = False
    out: list[tuple[bool, int, int, int]] = []
    add = out.append
    # the received inputs queued, and the chunks whose TransformerBlock pair (input and gradient) is live: a receiving
    # chunk whose block input is the previous iteration's or done; both sums kept as they change
    paired = [bool(r) for r in recv]
    sums = [0, 2 * sum([r for r in recv if r])]

    def done(x: int) -> bool:
        return nth[x] <= bdone[chunk[x]]

    def refresh(c: int) -> None:
        x = block[c]
        now = bool(recv[c]) and (x < 0 or nth[x] <= bdone[c])
        if now != paired[c]:
            paired[c] = now
            sums[1] += 2 * recv[c] if now else -2 * recv[c]

    def enqueue(x: int) -> None:
        if x not in queue:
            queue.add(x)
            sums[0] += recv[chunk[x]]

    def covered(x: int) -> bool:
        # a position whose input and gradient a chunk's pair counts
        c = chunk[x]
        return paired[c] and block[c] == x

    def units(cur: int) -> int:
        # cur: the backward position of a backward pass (its output gradient is in its working set), -1 for a forward
        u = sums[0] + sums[1]
        extra = set()                       # (kind, position) of the other references, each tensor once
        if lg >= 0 and not covered(lg):
            extra.add((1, lg))
        for x in (wi, sl):
            if x >= 0 and not covered(x) and done(x):
                extra.add((0, x))
                extra.add((1, x))
        if extra:
            u += sum([recv[chunk[x]] for _, x in extra])
        return u + out_alive + len(grads) - (cur in grads)

    def set_block(c: int, x: int) -> None:
        block[c] = x
        refresh(c)

    def forward(x: int) -> None:
        c = chunk[x]
        if x in queue:
            queue.discard(x)
            sums[0] -= recv[c]
        fdone[c] += 1
        if recv[c]:
            set_block(c, x)
        add((True, c, fdone[c], units(-1)))

    def backward(y: int) -> int:
        b = top - chunk[y]
        add((False, b, bdone[b] + 1, units(y)))
        bdone[b] += 1
        refresh(b)
        grads.discard(y)
        return fpos[y] if recv[b] else -1

    for x in range(warm):
        forward(x)
        r = _received_for(pp, vpp, m, group, pp_rank, x)
        if r >= 0:
            enqueue(r)
            if x == warm - 1 and steady > 0 and overlap:
                wi = r
        if x == warm - 1 and steady > 0 and not last:
            grads.add(0)                    # the first backward's output gradient, received with the last warm-up send
    for k in range(steady):
        x = warm + k
        if combined:
            if recv[chunk[x]]:
                set_block(chunk[x], x)      # set_input_tensor before the backward
            sl = backward(k)
            forward(x)
            lg, sl = sl, -1
        else:
            if overlap:
                out_alive = False           # pp_pre_forward: the previous output deallocated
            forward(x)
            out_alive = not (last and chunk[x] == top)
            if overlap and k != steady - 1:
                r = _received_for(pp, vpp, m, group, pp_rank, x)
                if r >= 0:
                    enqueue(r)
            lg = backward(k)
            if not overlap or k == steady - 1:
                out_alive = False
        if (combined or not overlap) and k != steady - 1:
            r = _received_for(pp, vpp, m, group, pp_rank, x)
            if r >= 0:
                enqueue(r)
        g = _grad_received_for(pp, vpp, m, group, pp_rank, k)
        if g >= 0:
            grads.add(g)
    for y in range(steady, total):
        lg = backward(y)
        g = _grad_received_for(pp, vpp, m, group, pp_rank, y)
        if g >= 0:
            grads.add(g)
    return tuple(out)


def p2p_walk_peak(pp: int, vpp: int, m: int, group: int, pp_rank: int, receiving: tuple[int, ...], overlap: bool,
                  combined: bool, sizes: tuple[int, ...], fwd_extra: tuple[int, ...], bwd_extra: tuple[int, ...],
                  t: int) -> tuple[int, int, Probe]:
    """The first pass of p2p_every_pass with the most sum_c held_c * sizes[c] + (fwd_extra or bwd_extra)[chunk] +
    t x units: (that value, t x units, its probe)."""
    walk = walk_passes(pp, vpp, m, group, pp_rank, receiving, overlap, combined)
    best, retained, i, _ = walk_peak(walk, vpp, sizes, fwd_extra, bwd_extra, t)
    fwd, c, nth, _ = walk[i]
    return best, retained, (fwd, c, walk_held(walk, vpp, i), nth)


def walk_peak(walk: tuple[tuple[bool, int, int, int], ...], vpp: int, sizes: tuple[int, ...],
              fwd_extra: tuple[int, ...], bwd_extra: tuple[int, ...], t: int,
              bwd_alone: tuple[int, ...] | None = None) -> tuple[int, int, int, bool]:
    """The first of walk_passes' passes with the most sum_c held_c * sizes[c] + (fwd_extra or bwd_extra)[chunk] + t x
    units, the held bytes kept as the walk goes: (that value, t x units, its index, whether it is a backward that no
    forward follows in the same step). With ``bwd_alone``, such backwards (the last pass, or one before a backward)
    take it instead of ``bwd_extra``."""
    sizes = tuple(sizes[:vpp]) + (0,) * (vpp - len(sizes))     # (chunks without a size hold nothing)
    best, retained, at, solo = -1, 0, -1, False
    h = 0
    last = len(walk) - 1
    for i, (fwd, c, _, u) in enumerate(walk):
        if fwd:
            h += sizes[c]
            v = h + fwd_extra[c] + t * u
            alone = False
        else:
            alone = bwd_alone is not None and (i == last or not walk[i + 1][0])
            v = h + (bwd_alone if alone else bwd_extra)[c] + t * u
            h -= sizes[c]
        if v > best or at < 0:
            best, retained, at, solo = v, t * u, i, alone
    return best, retained, at, solo
