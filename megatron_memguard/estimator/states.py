"""Weights, gradient buffers, main parameters and optimizer states of one pipeline rank.

megatron-core wraps every model chunk in its own DistributedDataParallel with one contiguous buffer
per (param dtype, grad dtype). Without the distributed optimizer only the gradient buffer is
allocated and nothing is padded; with it, parameters move into a padded param buffer, each parameter
start is aligned to 64 elements and each bucket end to ``lcm(DP*CP, 128)`` (or
``lcm(DP*CP, 128, 2**16)`` with ``--ddp-pad-buckets-for-high-nccl-busbw``), and each DP rank's
optimizer owns one equal slice of every bucket (megatron/core/distributed/param_and_grad_buffer.py,
megatron/core/optimizer/distrib_optimizer.py). Buckets exist only with ``--overlap-grad-reduce``,
on pipeline rank 0, for the first model chunk (training.py get_model: later chunks get one bucket).
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from functools import lru_cache

from ..layout import Chunk, Layout, ShardGroup, TensorKind
from .params import _layer_numels, chunk_expert_numels, chunk_numels, holds_final_norm, holds_mtp


@dataclass(frozen=True)
class Bucket:
    start: int
    end: int                       # padded end
    spans: tuple[tuple[int, int], ...]  # (start, end) of each parameter inside the buffer

    def __init__(self, start: int, end: int, spans: tuple[tuple[int, int], ...]) -> None:
        # made per chunk shape of every cold estimate: the fields are stored directly (as Term's)
        d = self.__dict__
        d["start"] = start
        d["end"] = end
        d["spans"] = spans


@dataclass(frozen=True)
class ChunkBuffer:
    numel: int                     # padded size of the contiguous buffer
    numel_unpadded: int
    buckets: tuple[Bucket, ...]
    params: int                    # parameter count of the chunk

    def __init__(self, numel: int, numel_unpadded: int, buckets: tuple[Bucket, ...], params: int) -> None:
        # made per chunk shape of every cold estimate: the fields are stored directly (as Term's)
        d = self.__dict__
        d["numel"] = numel
        d["numel_unpadded"] = numel_unpadded
        d["buckets"] = buckets
        d["params"] = params


# what build_buffer makes of no parameters, whatever the bucket size and the optimizer
_NO_BUFFER = ChunkBuffer(numel=0, numel_unpadded=0, buckets=(), params=0)


def bucket_size_for(L: Layout, chunk: Chunk) -> int | None:
    """Bucket size in elements, as DDP and get_model decide it (None: one bucket)."""
    if not L.overlap_grad_reduce or chunk.pp_rank > 0 or chunk.vpp_rank > 0:
        return None
    # get_model's default scales with the DP x CP group, not DP alone
    # (megatron/training/training.py resolve_ddp_bucket_size, core 0.19.2: 1M x dp_cp size).
    return L.ddp_bucket_size or max(40_000_000, 1_000_000 * L.data_parallel_size * L.context_parallel_size)


def build_buffer(L: Layout, params: list[tuple[int, bool]], bucket_size: int | None,
                 group: ShardGroup = ShardGroup.DENSE_DP) -> ChunkBuffer:
    """Replicates ``_ParamAndGradBuffer``'s index arithmetic; ``params`` are (numel, shared_embedding)
    in registration order, walked in reverse as megatron does; ``group``: the ranks the buffer is
    reduced and sharded over (the expert buffer pads its buckets to its own group's size)."""
    dist = L.use_distributed_optimizer
    unpadded = sum(n for n, _ in params)
    if not dist and bucket_size is None:
        return ChunkBuffer(numel=unpadded, numel_unpadded=unpadded, buckets=(), params=unpadded)
    shard = L.parallel.shard_size(group)
    divisor = math.lcm(shard, 128, 2**16) if L.ddp_pad_buckets_for_high_nccl_busbw else math.lcm(shard, 128)

    def pad_end(i: int) -> int:
        return -(-i // divisor) * divisor if dist else i

    buckets: list[Bucket] = []
    spans: list[tuple[int, int]] = []
    start = bucket_start = end = 0
    for numel, shared in reversed(params):
        if dist:
            start = -(-start // 64) * 64
        if shared and dist and spans:
            # The shared embedding gets a bucket of its own (close the current one first).
            start = pad_end(start)
            buckets.append(Bucket(bucket_start, start, tuple(spans)))
            bucket_start, spans = start, []
        end = start + numel
        spans.append((start, end))
        if (bucket_size is not None and end - bucket_start >= bucket_size) or (shared and dist):
            start = pad_end(end)
            buckets.append(Bucket(bucket_start, start, tuple(spans)))
            bucket_start, spans = start, []
        else:
            start = end
    if spans:
        buckets.append(Bucket(bucket_start, pad_end(end), tuple(spans)))
    numel = buckets[-1].end if buckets else 0
    return ChunkBuffer(numel=numel, numel_unpadded=unpadded, buckets=tuple(buckets), params=unpadded)


def shard_pieces(buf: ChunkBuffer, shard: int, rank: int) -> list[int]:
    """Sizes of the fp32 main-parameter shards that DP rank ``rank`` owns (one per parameter range)."""
    pieces = []
    for b in buf.buckets:
        size = (b.end - b.start) // shard
        lo, hi = b.start + rank * size, b.start + (rank + 1) * size
        spans = b.spans
        i = max(0, bisect.bisect_right(spans, (lo, lo)) - 1)
        while i < len(spans) and spans[i][0] < hi:
            s, e = spans[i]
            n = min(e, hi) - max(s, lo)
            if n > 0:
                pieces.append(n)
            i += 1
    return pieces


@lru_cache(maxsize=1024)
def _chunk_buffer(L: Layout, kind_runs: tuple, has_embedding: bool, has_output: bool, tied_copy: bool,
                  bucket_size: int | None, ranks: tuple[int, ...],
                  group: ShardGroup = ShardGroup.DENSE_DP,
                  final_norm: bool | None = None,
                  has_mtp: bool | None = None) -> tuple[ChunkBuffer, tuple[tuple[int, ...], ...]]:
    """Buffer and per-rank shard pieces of one chunk shape (the chunks of a deep pipeline mostly
    share one shape); ``group`` EXPERT_DP: the chunk's expert buffer (its MoE layers' routed experts);
    ``final_norm``: whether the chunk builds the final norm (None: with the output, params.holds_final_norm);
    ``has_mtp``: whether it builds the MTP block (None: with the output, params.holds_mtp)."""
    c = Chunk(-1, 0, 0, sum(n for _, n in kind_runs), has_embedding, has_output, tied_copy, 1, kind_runs, has_mtp)
    fn = has_output if final_norm is None else final_norm
    plist = chunk_expert_numels(L, c) if group is ShardGroup.EXPERT_DP else chunk_numels(L, c, fn)
    if not plist:                   # no parameter in this buffer (a dense chunk's expert buffer): no bucket
        return _NO_BUFFER, ((),) * len(ranks) if L.use_distributed_optimizer else ()
    buf = build_buffer(L, plist, bucket_size, group)
    if not L.use_distributed_optimizer:
        return buf, ()
    shard = L.parallel.shard_size(group)
    pieces = tuple([tuple(shard_pieces(buf, shard, r)) for r in ranks])
    return buf, pieces


def _one_bucket_sums(numels: list[int], divisor: int, shard: int,
                     ranks: tuple[int, ...]) -> tuple[int, tuple[int, ...]]:
    """build_buffer's padded size and shard_pieces' sum per rank in ``ranks`` for the common case (the
    distributed optimizer, one bucket, no shared embedding), without the spans and bucket objects:
    ``numels`` in registration order, each start aligned to 64 elements walking them in reverse, the
    end padded to ``divisor``, rank r owning [r * size, (r + 1) * size) of it."""
    starts = []
    add = starts.append
    start = end = 0
    for numel in reversed(numels):
        start = -(-start // 64) * 64
        add(start)
        end = start + numel
        start = end
    padded = -(-end // divisor) * divisor
    if shard == 1:                          # one rank owns the whole buffer
        return padded, tuple([sum(numels) if r == 0 else 0 for r in ranks])
    size = padded // shard
    sizes = numels[::-1]
    sums = []
    n = len(starts)
    for r in ranks:
        lo, hi = r * size, (r + 1) * size
        # the spans are sorted and disjoint: those overlapping [lo, hi) are a run found by bisection
        i = max(0, bisect.bisect_right(starts, lo) - 1)
        total = 0
        while i < n and starts[i] < hi:
            s = starts[i]
            e = s + sizes[i]
            k = (e if e < hi else hi) - (s if s > lo else lo)
            if k > 0:
                total += k
            i += 1
        sums.append(total)
    return padded, tuple(sums)


def _plain_numels(L: Layout, kind_runs: tuple, has_embedding: bool, has_output: bool, tied_copy: bool,
                  group: ShardGroup, final_norm: bool | None, has_mtp: bool | None = None) -> list[int] | None:
    """The chunk's parameter sizes in registration order when its buffer is one plain bucket's (no shared
    embedding: the distributed optimizer without buckets), else None."""
    expert = group is ShardGroup.EXPERT_DP
    fn = has_output if final_norm is None else final_norm
    if not has_embedding and not has_output and not fn and not has_mtp:
        # layers only (most chunks): their parameter sizes, layer after layer (chunk_numels, without the
        # (size, shared) pairs: no layer parameter is a shared embedding)
        numels: list[int] = []
        for kind, n in kind_runs:
            numels += _layer_numels(L, kind, expert) * n
        return numels
    c = Chunk(-1, 0, 0, sum(n for _, n in kind_runs), has_embedding, has_output, tied_copy, 1, kind_runs, has_mtp)
    plist = chunk_expert_numels(L, c) if expert else chunk_numels(L, c, fn)
    if any([shared for _, shared in plist]):
        return None
    return [n for n, _ in plist]


def _divisor(L: Layout, shard: int) -> int:
    return math.lcm(shard, 128, 2**16) if L.ddp_pad_buckets_for_high_nccl_busbw else math.lcm(shard, 128)


@lru_cache(maxsize=1024)
def _chunk_totals(L: Layout, kind_runs: tuple, has_embedding: bool, has_output: bool, tied_copy: bool,
                  bucket_size: int | None, ranks: tuple[int, ...],
                  group: ShardGroup = ShardGroup.DENSE_DP,
                  final_norm: bool | None = None, has_mtp: bool | None = None) -> tuple[int, int, int, tuple[int, ...]]:
    """What _stage_states needs of _chunk_buffer: the parameter count, the padded and unpadded buffer
    sizes and, with the distributed optimizer, the elements each rank of ``ranks`` owns (the sum of
    its shard pieces; else ()). The common case (one bucket, no shared embedding) is worked out from
    the parameter sizes alone (_one_bucket_sums); the others from the buffer's buckets."""
    dist = L.use_distributed_optimizer
    if dist and bucket_size is None:
        numels = _plain_numels(L, kind_runs, has_embedding, has_output, tied_copy, group, final_norm, has_mtp)
        if numels is not None and not numels:
            return 0, 0, 0, (0,) * len(ranks)
        if numels is not None:
            shard = L.parallel.shard_size(group)
            padded, sums = _one_bucket_sums(numels, _divisor(L, shard), shard, ranks)
            unpadded = sum(numels)
            return unpadded, padded, unpadded, sums
    buf, pieces_of = _chunk_buffer(L, kind_runs, has_embedding, has_output, tied_copy, bucket_size, ranks, group,
                                   final_norm, has_mtp)
    return buf.params, buf.numel, buf.numel_unpadded, tuple([sum(p) for p in pieces_of]) if dist else ()


# The largest shard in closed form. Rank r owns slice r of every bucket ([start + r size, start + (r + 1) size),
# size = bucket / shard): the slice's size less the gaps in it, the 64-element alignment holes before parameter
# starts and the padding of the bucket's end. So what the ranks own differs only by the gaps, and the largest
# shard is the sum of the slices less the fewest gap elements any rank holds: the gaps are mapped to ranks as
# "ranks [a, b) hold v gap elements each" runs (each gap touches one run of whole slices and at most two
# partial ones), and their sum, constant between run edges, is smallest at one of the edges or at rank 0.
# O(gaps) for any DP size; test_largest_shard_is_the_brute_force_max checks it against every rank.

GapRuns = tuple[tuple[int, int, int], ...]


def _gap_runs(gaps: list[tuple[int, int]], size: int, out: list[tuple[int, int, int]]) -> None:
    """Append to ``out`` the (first rank, end rank, gap elements per rank) runs of the gap intervals ``gaps``
    (bucket-relative [g0, g1)) of a bucket whose slices hold ``size`` elements."""
    for g0, g1 in gaps:
        r0, r1 = g0 // size, (g1 - 1) // size
        if r0 == r1:
            out.append((r0, r0 + 1, g1 - g0))
            continue
        out.append((r0, r0 + 1, (r0 + 1) * size - g0))
        if r1 > r0 + 1:
            out.append((r0 + 1, r1, size))
        out.append((r1, r1 + 1, g1 - r1 * size))


def _one_bucket_gaps(numels: list[int], divisor: int, shard: int) -> tuple[int, int, GapRuns]:
    """(padded size, slice size, gap runs) of _one_bucket_sums' buffer: the parameters walked in reverse, each
    start aligned to 64 elements, the end padded to ``divisor``."""
    gaps = []
    start = 0
    for numel in reversed(numels):
        s = -(-start // 64) * 64
        if s != start:
            gaps.append((start, s))
        start = s + numel
    padded = -(-start // divisor) * divisor
    if padded != start:
        gaps.append((start, padded))
    size = padded // shard
    out: list[tuple[int, int, int]] = []
    if size:
        _gap_runs(gaps, size, out)
    return padded, size, tuple(out)


def _buffer_gaps(buf: ChunkBuffer, shard: int) -> tuple[int, GapRuns]:
    """(sum of the slice sizes, gap runs) of a buffer's buckets (build_buffer's)."""
    total = 0
    out: list[tuple[int, int, int]] = []
    for b in buf.buckets:
        size = (b.end - b.start) // shard
        if not size:
            continue
        total += size
        gaps = []
        at = b.start
        for s, e in b.spans:
            if s > at:
                gaps.append((at - b.start, s - b.start))
            at = e
        if b.end > at:
            gaps.append((at - b.start, b.end - b.start))
        _gap_runs(gaps, size, out)
    return total, tuple(out)


@lru_cache(maxsize=1024)
def _chunk_totals_max(L: Layout, kind_runs: tuple, has_embedding: bool, has_output: bool, tied_copy: bool,
                      bucket_size: int | None, group: ShardGroup = ShardGroup.DENSE_DP,
                      final_norm: bool | None = None, has_mtp: bool | None = None) -> tuple[int, int, int, int, GapRuns]:
    """_chunk_totals for the largest shard under the distributed optimizer: the parameter count, the padded and
    unpadded buffer sizes, the sum of a rank's slice sizes and the buffer's gap runs (largest_shard)."""
    shard = L.parallel.shard_size(group)
    if bucket_size is None:
        numels = _plain_numels(L, kind_runs, has_embedding, has_output, tied_copy, group, final_norm, has_mtp)
        if numels is not None:
            if not numels:
                return 0, 0, 0, 0, ()
            padded, size, runs = _one_bucket_gaps(numels, _divisor(L, shard), shard)
            unpadded = sum(numels)
            return unpadded, padded, unpadded, size, runs
    buf, _ = _chunk_buffer(L, kind_runs, has_embedding, has_output, tied_copy, bucket_size, (), group, final_norm,
                           has_mtp)
    size, runs = _buffer_gaps(buf, shard)
    return buf.params, buf.numel, buf.numel_unpadded, size, runs


def largest_shard(parts: list[tuple[int, GapRuns]], shard: int) -> int:
    """The most elements any rank of ``shard`` owns over the buffers ``parts`` ((slice total, gap runs) each)."""
    total = sum(t for t, _ in parts)
    delta: dict[int, int] = {0: 0}
    for _, runs in parts:
        for a, b, v in runs:
            delta[a] = delta.get(a, 0) + v
            delta[b] = delta.get(b, 0) - v
    fewest = None
    held = 0
    for r in sorted(delta):
        if r >= shard:
            break
        held += delta[r]
        if fewest is None or held < fewest:
            fewest = held
            if not held:
                break
    return total - (fewest or 0)


@dataclass(frozen=True)
class StageStates:
    """Persistent bytes of model state on one rank of a pipeline stage (sums over its chunks)."""

    parameters: int                # count on this rank (before padding)
    param_bytes: int               # model weights (padded param buffer with dist-opt)
    grad_bytes: int                # DDP gradient buffer
    main_param_bytes: int          # fp32 (or remainder) master weights
    exp_avg_bytes: int             # Adam first moment / SGD momentum
    exp_avg_sq_bytes: int          # Adam second moment
    main_grad_copy_bytes: int      # fp32 copies of 16-bit grads made at the optimizer step
    buffer_numel: int
    buffer_numel_unpadded: int

    def __init__(self, parameters: int, param_bytes: int, grad_bytes: int, main_param_bytes: int, exp_avg_bytes: int,
                 exp_avg_sq_bytes: int, main_grad_copy_bytes: int, buffer_numel: int, buffer_numel_unpadded: int) -> None:
        # one per stage shape of every cold estimate: the fields are stored directly (as Term's)
        d = self.__dict__
        d["parameters"] = parameters
        d["param_bytes"] = param_bytes
        d["grad_bytes"] = grad_bytes
        d["main_param_bytes"] = main_param_bytes
        d["exp_avg_bytes"] = exp_avg_bytes
        d["exp_avg_sq_bytes"] = exp_avg_sq_bytes
        d["main_grad_copy_bytes"] = main_grad_copy_bytes
        d["buffer_numel"] = buffer_numel
        d["buffer_numel_unpadded"] = buffer_numel_unpadded


def stage_states(L: Layout, pp_rank: int, dp_rank: int | str = "max",
                 expert_dp_rank: int | None = None) -> StageStates:
    """Model-state bytes for one rank of ``pp_rank``. ``dp_rank``: an index, "last", or "max" (the
    largest distributed-optimizer shard of any DP rank, largest_shard; only the distributed optimizer makes
    the ranks differ). ``expert_dp_rank``: with an index ``dp_rank``, the rank's own position in the
    expert-data-parallel optimizer group when the caller knows it (a running process: megatron-core's
    parallel_state); None: worked out for TP rank 0 (``Parallelism.expert_dp_rank``)."""
    chunks = L.stage_chunks(pp_rank)
    # Stages with the same chunk shapes (the middle of a pipeline) have the same states.
    sig = tuple((c.kind_runs, c.has_embedding, c.has_output, c.has_tied_output_copy,
                 bucket_size_for(L, c), holds_final_norm(L, c), holds_mtp(L, c)) for c in chunks)
    return _stage_states(L, sig, dp_rank, expert_dp_rank)


@lru_cache(maxsize=1024)
def _stage_states(L: Layout, sig: tuple, dp_rank: int | str, expert_dp_rank: int | None = None) -> StageStates:
    shard = L.parallel.shard_size(ShardGroup.DENSE_DP)
    nbytes = L.precision.byte_sizes()       # bytes per element of each tensor kind (Precision.bytes_of)
    p_bytes = nbytes[TensorKind.PARAM]
    g_bytes = nbytes[TensorKind.MAIN_GRAD]
    dist = L.use_distributed_optimizer
    params = numel = unpadded = 0
    # "max": the largest shard of any DP rank, in closed form from the buckets' gaps (largest_shard)
    top = dist and dp_rank == "max"
    ranks = () if dp_rank == "max" else (shard - 1,) if dp_rank == "last" else (int(dp_rank),)
    owned = [0] * len(ranks)                # elements of the optimizer's shard of each rank in ``ranks``
    parts = []
    for runs, has_embedding, has_output, tied, bsize, final_norm, has_mtp in sig:
        if top:
            n_params, n, n_unpadded, size, gaps = _chunk_totals_max(L, runs, has_embedding, has_output, tied, bsize,
                                                                    ShardGroup.DENSE_DP, final_norm, has_mtp)
            parts.append((size, gaps))
        else:
            n_params, n, n_unpadded, sums = _chunk_totals(L, runs, has_embedding, has_output, tied, bsize, ranks,
                                                          ShardGroup.DENSE_DP, final_norm, has_mtp)
            for i, x in enumerate(sums):
                owned[i] += x
        params += n_params
        numel += n
        unpadded += n_unpadded
    if dist:
        # The rank with the most optimizer state is the peak one.
        main_elems = largest_shard(parts, shard) if top else owned[0]
        param_elems = numel                 # the padded param buffer
    else:
        main_elems = param_elems = params
    if L.moe is not None:
        # megatron-core's expert DDP buffers (one per chunk) and the one expert DistributedOptimizer over
        # all chunks, sharded over the expert-data-parallel group: the position in that group of the rank the
        # dense DP rank asked for is (Parallelism.expert_dp_rank; "last": the stage's last rank, last in both)
        # ("max": the expert group's largest shard, taken apart from the dense one's: an upper bound when the
        # two peak on different ranks)
        eshard = L.parallel.shard_size(ShardGroup.EXPERT_DP)
        if expert_dp_rank is not None and ranks and dp_rank != "last":
            eranks: tuple[int, ...] = (expert_dp_rank % eshard,)
        else:
            eranks = tuple(sorted({L.parallel.expert_dp_rank(r) if dp_rank != "last" else eshard - 1 for r in ranks}))
        eowned = [0] * len(eranks)
        eparts = []
        e_params = e_numel = 0
        for runs, has_embedding, has_output, tied, bsize, _, has_mtp in sig:
            # has_mtp: the MTP chunk's layers (MoE like the last decoder layer) add their routed experts
            if top:
                n_params, n, n_unpadded, size, gaps = _chunk_totals_max(L, runs, False, has_output, False, bsize,
                                                                        ShardGroup.EXPERT_DP, None, has_mtp)
                eparts.append((size, gaps))
            else:
                n_params, n, n_unpadded, sums = _chunk_totals(L, runs, False, has_output, False, bsize, eranks,
                                                              ShardGroup.EXPERT_DP, None, has_mtp)
                for i, x in enumerate(sums):
                    eowned[i] += x
            if not n_params:
                continue
            e_params += n_params
            e_numel += n
            unpadded += n_unpadded
        params += e_params
        numel += e_numel
        if dist:
            param_elems += e_numel
            if e_params:
                main_elems += largest_shard(eparts, eshard) if top else eowned[0]
        else:
            param_elems += e_params
            main_elems += e_params
    grad_bytes = numel * g_bytes
    param_bytes = param_elems * p_bytes

    # Master weights: fp32 clones of 16-bit params; fp32 params are their own master weights.
    if L.params_dtype == "fp32":
        main_bytes = 0
    elif (L.use_precision_aware_optimizer and L.store_param_remainders and L.params_dtype == "bf16"
          and L.main_params_dtype == "fp32"):
        main_bytes = 2 * main_elems  # TE FusedAdam keeps the low 16 bits (the bf16 param is the high half)
    else:
        main_bytes = nbytes[TensorKind.MAIN_PARAM] * main_elems
    if L.optimizer == "adam":
        m1 = nbytes[TensorKind.EXP_AVG] * main_elems
        m2 = nbytes[TensorKind.EXP_AVG_SQ] * main_elems
    else:  # SGD with momentum: one buffer
        m1, m2 = nbytes[TensorKind.MOMENTUM] * main_elems, 0
    # 16-bit gradients are copied to the master weights' dtype, fp32, for the step
    # (``main_grad.float()``); fp32 ones are viewed.
    grad_copy = 0
    if g_bytes == 2 and L.params_dtype != "fp32" and not L.use_precision_aware_optimizer:
        grad_copy = nbytes[TensorKind.MAIN_PARAM] * main_elems
    # (positional, in the fields' order: parameters, param_bytes, grad_bytes, main_param_bytes, exp_avg_bytes,
    # exp_avg_sq_bytes, main_grad_copy_bytes, buffer_numel, buffer_numel_unpadded)
    return StageStates(params, param_bytes, grad_bytes, main_bytes, m1, m2, grad_copy, numel, unpadded)
