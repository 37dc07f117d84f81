"""Parameter counts: published model sizes and per-rank splits."""
import pytest

from megatron_memguard import layout_from_flags
from megatron_memguard.estimator.params import chunk_params, total_parameters
from megatron_memguard.estimator.states import stage_states

from conftest import LLAMA2_7B, LLAMA31_70B, LLAMA31_8B

NEW = ["--megatron-version", "0.19"]


def flags(base, *extra):
    return base + ["--micro-batch-size", "1"] + list(extra)


@pytest.mark.parametrize("model, expected", [
    (LLAMA31_8B, 8_030_261_248),    # Llama-3.1-8B model card / HF safetensors total
    (LLAMA31_70B, 70_553_706_496),  # Llama-3.1-70B
    (LLAMA2_7B, 6_738_415_616),     # Llama-2-7B
])
def test_published_model_sizes(model, expected):
    L = layout_from_flags(flags(model), world_size=1)
    assert total_parameters(L) == expected
    # The one-rank inventory (every parameter in registration order) agrees with the closed form.
    assert stage_states(L, 0).parameters == expected


@pytest.mark.parametrize("tp, pp", [(2, 1), (4, 2), (8, 4), (1, 8)])
def test_rank_counts_add_up(tp, pp):
    L = layout_from_flags(flags(LLAMA31_70B, "--tensor-model-parallel-size", str(tp),
                                "--pipeline-model-parallel-size", str(pp)), world_size=tp * pp)
    per_stage = [stage_states(L, r).parameters for r in range(pp)]
    # One DP replica holds every parameter once per TP rank for sharded weights, and TP copies of the
    # replicated ones: RMSNorm weights (2 per layer + final norm), here h each.
    h = 8192
    replicated = (2 * 80 + 1) * h
    assert sum(per_stage) * tp == total_parameters(L) + (tp - 1) * replicated
    # Even split: every stage has 80/pp layers; the first adds the embedding, the last the final
    # norm and the untied output layer (V/t rows each).
    V = L.padded_vocab_size  # 128256 padded to a multiple of 128 * TP
    assert V == -(-128256 // (128 * tp)) * 128 * tp
    layer = (total_parameters(L) - 2 * V * h - h) // 80
    assert per_stage[0] - per_stage[-1] == (0 if pp == 1 else -h)
    assert per_stage[0] == (80 // pp) * (layer - 2 * h) // tp + (80 // pp) * 2 * h + V * h // tp + (
        (V * h // tp + h) if pp == 1 else 0)


def test_tied_embedding_copy_on_last_stage():
    base = [f for f in LLAMA2_7B if f != "--untie-embeddings-and-output-weights"]
    L = layout_from_flags(flags(base, "--pipeline-model-parallel-size", "2"), world_size=2)
    last = [p for p in chunk_params(L, L.chunks[-1]) if p.name == "output_layer.weight"]
    first = [p for p in chunk_params(L, L.chunks[0]) if p.name.startswith("embedding.word")]
    # Megatron keeps a copy of the tied weight on the last stage, flagged shared_embedding.
    assert last and first and last[0].numel == first[0].numel == 32000 * 4096
    assert last[0].shared_embedding and first[0].shared_embedding
    L1 = layout_from_flags(flags(base), world_size=1)
    assert not [p for p in chunk_params(L1, L1.chunks[0]) if p.name == "output_layer.weight"]


def test_vocab_padding_per_tp():
    # Megatron pads to a multiple of make_vocab_size_divisible_by * TP: 50257 -> 50304 (TP1), 50432 (TP4).
    base = "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 128 --micro-batch-size 1".split()
    assert layout_from_flags(base, world_size=1).padded_vocab_size == 50304
    assert layout_from_flags(base + ["--tensor-model-parallel-size", "4"], world_size=4).padded_vocab_size == 50688
    null = base + ["--tokenizer-type", "NullTokenizer", "--vocab-size", "131072"]
    # NullTokenizer: one extra EOD token before core 0.18 (Megatron commit c9dfe34798), none after.
    assert layout_from_flags(null, world_size=1, megatron_version="0.16").vocab_size == 131073
    assert layout_from_flags(null, world_size=1, megatron_version="0.19").vocab_size == 131072


def test_default_bucket_size_scales_with_dp_times_cp():
    # megatron/training/training.py (core 0.18.2 get_model, 0.19.2 resolve_ddp_bucket_size):
    # max(40M, 1M x size of the DP x CP group) elements; DP = 32, CP = 2 -> 64M (DP alone would give 40M).
    from megatron_memguard.estimator.states import bucket_size_for
    L = layout_from_flags(flags(LLAMA2_7B, "--context-parallel-size", "2", "--overlap-grad-reduce",
                                "--use-distributed-optimizer"), world_size=64)
    assert (L.data_parallel_size, L.context_parallel_size) == (32, 2)
    assert bucket_size_for(L, L.chunks[0]) == 64_000_000


@pytest.mark.parametrize("tp, pp", [(8, 1), (1, 4)])
def test_distributed_optimizer_with_dp_cp_one_holds_the_state_once(tp, pp):
    # A 12-layer Llama-3-70B shape on one 8-GPU node (TP8) or 4 GPUs (PP4): DP x CP = 1, so the
    # distributed optimizer's only rank owns every parameter of its stage once
    # (megatron/core/optimizer/distrib_optimizer.py _build_model_gbuf_range: one shard of the whole
    # bucket per DP x CP rank; main params exclude the bucket padding).
    shape = [a if a != "80" else "12" for a in LLAMA31_70B]
    L = layout_from_flags(flags(shape, "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size",
                                str(pp), "--use-distributed-optimizer", "--sequence-parallel" if tp > 1 else "--bf16")
                          + NEW, world_size=tp * pp)
    assert L.data_parallel_size * L.context_parallel_size == 1
    st = stage_states(L, 0)
    if tp == 8:
        # per TP8 rank: 12 layers x (qkv (64 + 2*8)*128*8192/8 + proj 8192^2/8 + fc1 2*28672*8192/8
        # + fc2 28672*8192/8 + 2 RMSNorm 8192) + embedding and output 129024/8*8192 each + final norm
        layer = 10_485_760 + 8_388_608 + 58_720_256 + 29_360_128 + 16_384
        assert st.parameters == 12 * layer + 2 * 132_120_576 + 8192 == 1_547_902_976
    # fp32 master weights and both Adam moments: 4 bytes per parameter each, not 8
    assert st.main_param_bytes == st.exp_avg_bytes == st.exp_avg_sq_bytes == 4 * st.parameters
    # the same as without the distributed optimizer, where every rank keeps the whole stage's state
    L0 = layout_from_flags(flags(shape, "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size",
                                 str(pp), "--sequence-parallel" if tp > 1 else "--bf16") + NEW, world_size=tp * pp)
    assert stage_states(L0, 0).main_param_bytes == st.main_param_bytes


def test_distributed_optimizer_alone_in_its_group_holds_the_whole_state_once():
    """DP x CP = 1: the distributed optimizer's one rank owns every element once, as the plain optimizer
    does: fp32 master weights and two Adam moments, 4 B each per element of the (padded) buffer. Found on
    Fujii et al.'s TP4 PP2 run on 8 A100-40GB (DP 1), which ran while a doubled state would not fit."""
    args = flags(LLAMA31_8B, "--tensor-model-parallel-size", "4", "--pipeline-model-parallel-size", "2",
                 "--sequence-parallel", "--use-distributed-optimizer")
    st = stage_states(layout_from_flags(args, world_size=8), 0)
    assert st.main_param_bytes == st.exp_avg_bytes == st.exp_avg_sq_bytes == 4 * st.buffer_numel
    plain = stage_states(layout_from_flags([a for a in args if a != "--use-distributed-optimizer"], world_size=8), 0)
    assert st.parameters == plain.parameters and st.buffer_numel - plain.parameters < 1_000_000


def test_one_bucket_sums_by_hand():
    """Two parameters [100, 10] walked in reverse (param_and_grad_buffer.py, core 0.19.2): the 10 at [0, 10),
    the 100 at [64, 164) (starts 64-aligned), the end padded to lcm(2, 128) = 256; rank 0 owns [0, 128):
    10 + 64 elements, rank 1 owns [128, 256): 36."""
    from megatron_memguard.estimator.states import _one_bucket_sums
    assert _one_bucket_sums([100, 10], 128, 2, (0, 1)) == (256, (74, 36))
    # one rank: the whole buffer, padding aside
    assert _one_bucket_sums([100, 10], 128, 1, (0,)) == (256, (110,))


@pytest.mark.parametrize("shard", [1, 2, 3, 8, 64, 1000])
def test_one_bucket_sums_match_the_buffer_walk(shard):
    """The arithmetic shortcut gives build_buffer's padded size and shard_pieces' sums (the replica of
    megatron's index arithmetic) for every rank, on parameter lists of awkward sizes."""
    import math
    import random
    from megatron_memguard.estimator.states import _one_bucket_sums, build_buffer, shard_pieces
    L = layout_from_flags(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                           "--seq-length", "128", "--max-position-embeddings", "128", "--micro-batch-size", "1",
                           "--vocab-size", "1000", "--use-distributed-optimizer", "--bf16"], world_size=shard)
    assert L.dp_shard_size == shard
    rng = random.Random(shard)
    divisor = math.lcm(shard, 128)
    for _ in range(30):
        numels = [rng.choice([1, 63, 64, 65, 127, 4096, rng.randint(1, 10**6)]) for _ in range(rng.randint(1, 25))]
        buf = build_buffer(L, [(n, False) for n in numels], None)
        ranks = tuple(range(shard)) if shard <= 64 else (0, 1, shard // 2, shard - 1)
        padded, sums = _one_bucket_sums(numels, divisor, shard, ranks)
        assert padded == buf.numel
        assert sums == tuple(sum(shard_pieces(buf, shard, r)) for r in ranks)
        if shard <= 64:
            assert sum(sums) == sum(numels)
