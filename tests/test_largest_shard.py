"""The distributed optimizer's largest shard ("max", the estimate's default DP rank) in closed form
(estimator/states.py largest_shard) against a brute force over every DP rank of megatron-core's bucket
layout (param_and_grad_buffer.py, replicated by build_buffer / shard_pieces: 64-element parameter starts,
bucket ends at lcm(DP x CP, 128), each rank one equal slice of every bucket)."""
from __future__ import annotations

import math
from types import SimpleNamespace

from hypothesis import given, settings, strategies as st

from megatron_memguard import layout_from_flags
from megatron_memguard.estimator.states import (_buffer_gaps, _one_bucket_gaps, build_buffer, largest_shard,
                                                shard_pieces, stage_states)
from megatron_memguard.layout import ShardGroup


def _fake_layout(shard: int, pad_high: bool) -> SimpleNamespace:
    # build_buffer reads these four attributes only
    return SimpleNamespace(use_distributed_optimizer=True, ddp_pad_buckets_for_high_nccl_busbw=pad_high,
                           parallel=SimpleNamespace(shard_size=lambda group: shard))


def _brute(bufs, shard: int) -> int:
    return max(sum(sum(shard_pieces(b, shard, r)) for b in bufs) for r in range(shard))


# parameter sizes around the 64-element alignment (norms, odd biases, small matrices) and a few large ones
NUMELS = st.one_of(st.integers(1, 200), st.sampled_from([64, 127, 128, 129, 4096, 4097, 10_000, 70_000]))


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(chunks=st.lists(st.lists(st.tuples(NUMELS, st.booleans()), min_size=1, max_size=12), min_size=1, max_size=3),
       shard=st.one_of(st.integers(1, 40), st.sampled_from([64, 96, 128, 250, 384, 1000])),
       bucket=st.one_of(st.none(), st.integers(50, 5000)), pad_high=st.booleans())
def test_largest_shard_is_the_brute_force_max(chunks, shard, bucket, pad_high):
    """Over every DP rank: buckets cut at a bucket size or not, shared embeddings in buckets of their own, one
    to three chunks (the ranks' shards add up over a stage's chunks before the max)."""
    L = _fake_layout(shard, pad_high)
    bufs = [build_buffer(L, params, bucket) for params in chunks]
    assert largest_shard([_buffer_gaps(b, shard) for b in bufs], shard) == _brute(bufs, shard)


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(numels=st.lists(NUMELS, min_size=1, max_size=20), shard=st.integers(1, 600), pad_high=st.booleans())
def test_the_one_bucket_shortcut_has_the_buffers_gaps(numels, shard, pad_high):
    """The parameter-size shortcut (one bucket, no shared embedding) gives build_buffer's slices and gaps."""
    L = _fake_layout(shard, pad_high)
    buf = build_buffer(L, [(n, False) for n in numels], None)
    divisor = math.lcm(shard, 128, 2**16) if pad_high else math.lcm(shard, 128)
    padded, size, runs = _one_bucket_gaps(numels, divisor, shard)
    assert padded == buf.numel
    assert largest_shard([(size, runs)], shard) == _brute([buf], shard)


def test_a_middle_rank_can_own_the_largest_shard():
    """By hand: parameters of 100 and 10 elements (walked in reverse: the 10 at [0, 10), the 100 at the next
    64-element start [64, 164)), padded to lcm(4, 128) = 128 x 2 = 256, DP 4: slices of 64. Rank 0 owns 10,
    rank 1 [64, 128) = 64, rank 2 [128, 164) = 36, rank 3 nothing: the largest is rank 1's, neither end's."""
    L = _fake_layout(4, False)
    buf = build_buffer(L, [(100, False), (10, False)], None)
    assert [sum(shard_pieces(buf, 4, r)) for r in range(4)] == [10, 64, 36, 0]
    assert largest_shard([_buffer_gaps(buf, 4)], 4) == 64


DENSE = ("--num-layers 4 --hidden-size 72 --num-attention-heads 3 --ffn-hidden-size 100 --seq-length 32 "
         "--max-position-embeddings 32 --micro-batch-size 1 --global-batch-size {gbs} --vocab-size 1000 "
         "--tokenizer-type NullTokenizer --bf16 --use-distributed-optimizer --normalization LayerNorm").split()


def test_stage_states_max_is_the_largest_rank():
    """Real layouts (odd sizes so that alignment holes appear, 1 or 2 stages, DP 3 to 24, overlap-grad-reduce
    buckets or not): "max" equals the largest of stage_states over every DP rank."""
    for world, pp, extra in ((3, 1, []), (24, 1, []), (12, 2, []), (16, 2, ["--overlap-grad-reduce", "--ddp-bucket-size", "3000"]),
                             (10, 1, ["--overlap-grad-reduce", "--ddp-bucket-size", "5000"])):
        dp = world // pp
        flags = [f.format(gbs=dp * 2) for f in DENSE] + ["--pipeline-model-parallel-size", str(pp)] + extra
        L = layout_from_flags(flags, world_size=world, megatron_version="0.16")
        assert L.parallel.shard_size(ShardGroup.DENSE_DP) == dp
        for p in range(pp):
            every = [stage_states(L, p, r).main_param_bytes for r in range(dp)]
            assert stage_states(L, p, "max").main_param_bytes == max(every), (world, pp, extra, p)
