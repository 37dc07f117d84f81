"""A pipeline stage with the loss and no decoder layer (a --pipeline-model-parallel-layout such as 'Et|L'): what
it keeps besides its model states, worked out by hand from megatron-core's source (0.16.1 and 0.19.2 alike)."""
import pytest

from megatron_memguard import estimate, layout_from_flags

H, HEADS, SEQ, MB, V = 128, 4, 64, 2, 1024


def _flags(layout: str, pp: int, *extra: str) -> list:
    return ["--transformer-impl", "local", "--no-masked-softmax-fusion", "--no-gradient-accumulation-fusion",
            "--num-layers", str(layout.count("t")), "--hidden-size", str(H), "--num-attention-heads", str(HEADS),
            "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ), "--micro-batch-size", str(MB),
            "--global-batch-size", str(2 * MB), "--pipeline-model-parallel-size", str(pp),
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000", "--bf16", "--position-embedding-type", "rope",
            "--pipeline-model-parallel-layout", layout, *extra]


@pytest.mark.parametrize("era", ["0.16", "0.19"])
def test_no_global_memory_buffer_without_attention_or_sp(era):
    """megatron's GlobalMemoryBuffer makes an entry on first get_tensor only (global_vars.py /
    parallel_state.py): DotProductAttention asks for its baddbmm input [b x heads, s, s], sequence-parallel
    linears for their all-gather. 'Et|L' without SP: stage 0 runs the attention, the loss stage asks for nothing
    (the CPU referee, megatron-core 0.16.1: 2,437,712 B live after the step there, 80 B of scalars above the
    model states, rotary table and retained pipeline pair; memguard's 64 KiB buffer had put it 2.7% high)."""
    est = estimate(layout_from_flags(_flags("Et|L", 2), world_size=2, megatron_version=era), device="cpu")
    first, loss = est.stages[0].breakdown, est.stages[1].breakdown
    assert first["global_memory_buffer"] == MB * HEADS * SEQ * SEQ * 2          # bf16 [b x a, s, s]
    assert "global_memory_buffer" not in loss
    # what the loss stage keeps after the step, by hand: V x h (tied output copy) + the final norm (LayerNorm
    # weight and bias, h each) x (2 bf16 + 4 fp32 grad + 4 fp32 main + 8 Adam) B; the rotary table [s, d] fp32;
    # the last received input and its gradient [s, b, h] bf16 (TransformerBlock.input_tensor)
    n = V * H + 2 * H
    assert est.stages[1].parameters == n
    assert est.stages[1].persistent_bytes == n * 18 + SEQ * (H // HEADS) * 4 + 2 * SEQ * MB * H * 2
    assert abs(est.stages[1].persistent_bytes / 2437712 - 1) < 1e-4


@pytest.mark.parametrize("era", ["0.16", "0.19"])
def test_loss_only_stage_under_sequence_parallelism_keeps_the_all_gather(era):
    """With SP the output layer (megatron's ColumnParallelLinear) all-gathers its input through the
    GlobalMemoryBuffer (tensor_parallel/layers.py linear_with_grad_accumulation_and_async_allreduce): [s, b, h]."""
    flags = _flags("Et|L", 2, "--tensor-model-parallel-size", "2", "--sequence-parallel")
    est = estimate(layout_from_flags(flags, world_size=4, megatron_version=era), device="cpu")
    assert est.stages[1].breakdown["global_memory_buffer"] == SEQ * MB * H * 2
    # stage 0: the larger of the all-gather and the attention's [b x a/TP, s, s]
    assert est.stages[0].breakdown["global_memory_buffer"] == max(SEQ * MB * H, MB * HEADS // 2 * SEQ * SEQ) * 2


@pytest.mark.parametrize("era", ["0.16", "0.19"])
def test_mtp_loss_stage_by_hand(era):
    """'Et|m|L', D = 1: the loss stage receives [(1 + D) s, b, h]. GPTModel's rotary table is as long as the
    chunk's input (RotaryEmbedding.get_rotary_seq_len: transformer.input_tensor.size(0)): [(1 + D) s, d] fp32;
    it has no attention and no SP, so no GlobalMemoryBuffer; per micro-batch it keeps the received concatenation
    and its empty block's clone (transformer_block.py ``hidden_states.clone()``), 2 x (1 + D) rows. The CPU referee
    (megatron-core 0.16.1) measures 2,506,832 B after the step there."""
    est = estimate(layout_from_flags(_flags("Et|m|L", 3, "--mtp-num-layers", "1"), world_size=3,
                                     megatron_version=era), device="cpu")
    s = est.stages[2]
    row = SEQ * MB * H * 2
    assert s.breakdown["rotary_cache"] == 2 * SEQ * (H // HEADS) * 4
    assert "global_memory_buffer" not in s.breakdown
    assert s.breakdown["mtp_received_hidden"] == s.in_flight * 2 * 2 * row
    assert s.parameters == V * H
    assert s.persistent_bytes == V * H * 18 + 2 * SEQ * (H // HEADS) * 4 + 2 * 2 * row
    assert abs(s.persistent_bytes / 2506832 - 1) < 1e-4
    # the MTP stage has no decoder layer but the MTP layer's attention asks for the score buffer, and it reads the
    # batch (pretrain_gpt.py get_batch: mtp_on_this_rank), whose bool [b, 1, s, s] mask the unfused softmax keeps
    m = est.stages[1]
    assert m.breakdown["global_memory_buffer"] == MB * HEADS * SEQ * SEQ * 2
    assert m.breakdown["attention_mask"] == m.in_flight * MB * SEQ * SEQ
