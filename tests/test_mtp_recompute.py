"""Full recompute with multi-token prediction, as MultiTokenPredictionLayer._checkpointed_forward
(megatron/core/transformer/multi_token_prediction.py) runs it in megatron-core 0.16.1, 0.17.1, 0.18.2 and 0.19.2:
under ``--recompute-method uniform`` each depth is checkpointed and ``recompute_num_layers == 1`` is asserted at
the first forward; under ``block`` the depths are not recomputed at all ("not supported for MTP yet. Skipping
recompute."), whatever ``--recompute-num-layers``, which counts decoder layers only (TransformerBlock).

The model is the CPU referee's of tests/test_referee_mtp.py (h 128, s 64, b 2, local spec, PP 2: one decoder
layer per stage), whose layer keeps 578 KiB when not recomputed (counted by hand there) and its 32 KiB input
[128 rows, 128] bf16 when checkpointed."""
import pytest

from megatron_memguard import estimate, layout_from_flags
from megatron_memguard.errors import ConfigError

FLAGS = ("--transformer-impl local --no-masked-softmax-fusion --no-bias-gelu-fusion --no-bias-dropout-fusion "
         "--no-gradient-accumulation-fusion --hidden-dropout 0 --attention-dropout 0 --tokenizer-type NullTokenizer "
         "--num-layers 2 --hidden-size 128 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 "
         "--micro-batch-size 2 --global-batch-size 4 --pipeline-model-parallel-size 2 --vocab-size 1000 --bf16").split()
LAYER_KEPT = 578 * 1024          # one local-spec layer's saved tensors (tests/test_referee_mtp.py, by hand)
CKPT_INPUT = 128 * 128 * 2       # a checkpointed layer's input: s*b rows x h, bf16
INSIDE_CKPT = (32 + 64 + 32) * 1024 + 3 * 128 * 8   # an MTP depth's enorm/eh_proj/final-norm inputs and norm stats


def _last(extra: str, version: str = "0.16"):
    L = layout_from_flags(FLAGS + extra.split(), world_size=2, megatron_version=version)
    return estimate(L, device="cpu").stages[-1]


def _full(method: str, n: int = 1) -> str:
    return f"--recompute-granularity full --recompute-method {method} --recompute-num-layers {n}"


@pytest.mark.parametrize("depth", [1, 2])
def test_block_recomputes_the_decoder_layer_and_keeps_the_mtp_layers_whole(depth):
    mtp = f"--mtp-num-layers {depth}"
    none, block, uniform = _last(mtp).peak_allocated_bytes, _last(f"{mtp} {_full('block')}").peak_allocated_bytes, \
        _last(f"{mtp} {_full('uniform')}").peak_allocated_bytes
    # block checkpoints the stage's one decoder layer only: 578 KiB - 32 KiB less than without recompute
    assert none - block == LAYER_KEPT - CKPT_INPUT == 559_104
    # uniform checkpoints the decoder layer and each MTP depth's _proj_and_transformer_layer as well: its layer
    # and the block's tensors inside the checkpoint (enorm's input 32 KiB, eh_proj's [128, 2 * 128] input 64 KiB,
    # final_layernorm's input 32 KiB, the three LayerNorms' fp32 mean and rstd 3 * 128 rows * 8 B), which only
    # keeps its inputs (multi_token_prediction.py _checkpointed_forward, megatron-core 0.16.1 and 0.19.2)
    assert block - uniform == depth * (LAYER_KEPT - CKPT_INPUT + INSIDE_CKPT)
    # without MTP the two methods keep the same on this stage (one decoder layer, checkpointed by both)
    assert _last(_full("block")).peak_allocated_bytes == _last(_full("uniform")).peak_allocated_bytes


def test_block_recompute_num_layers_counts_decoder_layers_only():
    # PP 1, 4 decoder layers: block with 4 checkpoints all of them; the MTP layer stays whole either way, so each
    # decoder layer more that block checkpoints saves one layer's 546 KiB and nothing else moves
    flags = "--pipeline-model-parallel-size 1 --num-layers 4 --mtp-num-layers 1"
    kept = [_last(f"{flags} {_full('block', n)}").terms for n in (2, 4)]
    acts = [{t.name: t.bytes for t in k}["layer_activations"] for k in kept]
    assert acts[0] - acts[1] == 2 * (LAYER_KEPT - CKPT_INPUT)
    # 4 checkpointed inputs + the MTP layer kept whole
    assert acts[1] == 4 * CKPT_INPUT + LAYER_KEPT


def test_block_zero_is_no_recompute_with_mtp():
    assert (_last(f"--mtp-num-layers 1 {_full('block', 0)}").peak_allocated_bytes
            == _last("--mtp-num-layers 1").peak_allocated_bytes)


@pytest.mark.parametrize("version", ["0.16", "0.17", "0.18", "0.19"])
def test_uniform_with_more_than_one_layer_per_checkpoint_is_megatrons_assertion(version):
    pos = "" if version == "0.16" else "--position-embedding-type rope"   # (0.17+: MTP needs rope or none)
    with pytest.raises(ConfigError) as e:
        _last(f"--mtp-num-layers 1 {pos} {_full('uniform', 2)}", version)
    text = str(e.value)
    assert text.startswith("--recompute-num-layers: must be 1 with --mtp-num-layers under --recompute-method uniform")
    assert "got 2" in text and "\n" not in text
    # the same flags without MTP, and MTP with one layer per checkpoint, are estimated -- but on 0.16, where
    # TransformerBlock's uniform loop reads a layer past a stage of one layer in groups of 2 (IndexError at the
    # first forward, transformer_block.py 0.16.1; 0.17.1 ends the group at the stage's end), it is refused by name
    if version == "0.16":
        with pytest.raises(ConfigError) as e:
            _last(f"{pos} {_full('uniform', 2)}", version)
        assert "does not divide a model chunk of 1 layers" in str(e.value)
    else:
        assert _last(f"{pos} {_full('uniform', 2)}", version).peak_allocated_bytes > 0
    assert _last(f"--mtp-num-layers 1 {pos} {_full('uniform', 1)}", version).peak_allocated_bytes > 0


def test_block_with_mtp_says_the_mtp_layers_are_not_recomputed():
    L = layout_from_flags(FLAGS + f"--mtp-num-layers 2 {_full('block', 2)}".split(), world_size=2,
                          megatron_version="0.16")
    assert any("does not recompute the 2 MTP layer(s)" in n for n in L.notes)


def test_uniform_keeps_the_checkpoint_inputs_of_each_depth_by_hand():
    # MultiTokenPredictionLayer.forward (multi_token_prediction.py, megatron-core 0.16.1 and 0.19.2): the embedding
    # of the rolled ids runs outside the checkpoint, _proj_and_transformer_layer inside it, checkpointed with its
    # inputs hidden_states and decoder_input. Per depth the block then keeps the rolled token and position ids
    # (int64, 128 tokens each: 2 KiB) and, from depth 2, depth 1's output [128, 128] bf16 (32 KiB; hnorm's input,
    # the checkpoint's hidden_states); once the concatenation of the main and the D outputs, (1 + D) x 32 KiB.
    # decoder_input (32 KiB per depth) is the depth's checkpointed input, in layer_activations.
    for depth in (1, 2):
        terms = {t.name: t.bytes for t in _last(f"--mtp-num-layers {depth} {_full('uniform')}").terms}
        assert terms["mtp_block_activations"] == depth * 2 * 1024 + (depth - 1) * 32 * 1024 + (1 + depth) * 32 * 1024


def _terms(extra: str, version: str = "0.16", world: int = 4) -> dict[str, int]:
    L = layout_from_flags(FLAGS + extra.split(), world_size=world, megatron_version=version)
    return {t.name: t.bytes for t in estimate(L, device="cpu").stages[-1].terms}


@pytest.mark.parametrize("version", ["0.16", "0.19"])
def test_distributed_saved_activations_keep_mtps_embedding_input_whole_by_hand(version):
    # CheckpointFunction.forward (tensor_parallel/random.py, megatron-core 0.16.1 and 0.19.2) shards only its first
    # input: for MTP depth 1 that is hidden_states (a viewless copy of the decoder output's chunk view, while
    # GPTModel.forward's frame still holds the decoder output: output_layer_input stays 32 KiB, and the shard is a new
    # 16 KiB buffer, split_tensor_into_1d_equal_chunks(new_buffer=True), tensor_parallel/utils.py); decoder_input, the
    # second input, stays whole (the MTP layer's 32 KiB checkpointed input); the decoder layer's own halves (16 KiB)
    pos = "" if version == "0.16" else "--position-embedding-type rope"
    tp2 = f"--tensor-model-parallel-size 2 --mtp-num-layers 1 {pos} {_full('uniform')}"
    whole, sharded = _terms(tp2, version), _terms(f"{tp2} --distribute-saved-activations", version)
    assert whole["output_layer_input"] == sharded["output_layer_input"] == CKPT_INPUT
    assert whole["layer_activations"] == 2 * CKPT_INPUT
    assert sharded["layer_activations"] == CKPT_INPUT // 2 + CKPT_INPUT + CKPT_INPUT // 2
    assert whole["mtp_block_activations"] == sharded["mtp_block_activations"]


# CPU referee (benchmarks/referee/run.py, real megatron-core 0.16.1, 4 ranks: TP 2 x PP 2) of COMMON + these FLAGS with
# --tensor-model-parallel-size 2, uniform full recompute of 1 layer and --mtp-num-layers 1: the last stage's peak
# (forward of its one micro-batch, at the loss) is 7,507,764 B with and without --distribute-saved-activations
REFEREE_LAST_STAGE_PEAK = 7_507_764


def test_distributed_saved_activations_with_mtp_against_the_referee():
    from benchmarks.referee.grids.dense import COMMON, resolve_config
    flags = [f for f in FLAGS if f not in ("--transformer-impl", "local", "--no-masked-softmax-fusion",
                                           "--no-bias-gelu-fusion", "--no-bias-dropout-fusion",
                                           "--no-gradient-accumulation-fusion", "--hidden-dropout", "0",
                                           "--attention-dropout", "0", "--tokenizer-type", "NullTokenizer")]
    flags = list(COMMON) + flags + ("--tensor-model-parallel-size 2 --mtp-num-layers 1 " + _full("uniform")).split()
    peaks = []
    for extra in ([], ["--distribute-saved-activations"]):
        L, _ = resolve_config(flags + extra, 4)
        peaks.append(estimate(L, profile="local", device="cpu").stages[-1].peak_allocated_bytes)
    # -0.10% (-7,860 B) both: with the flag the decoder layer's input shard frees 16 KiB and the depth's hidden_states
    # shard, a new buffer beside the decoder output, takes 16 KiB (before it was counted: -0.32%, 16 KiB low)
    assert peaks[0] == peaks[1]
    assert abs(peaks[0] / REFEREE_LAST_STAGE_PEAK - 1) < 0.002, peaks


def test_distributed_saved_activations_with_two_depths_is_megatrons_failure():
    # from depth 2 the checkpoint's first input is depth 1's output itself, an entry of MultiTokenPredictionBlock's
    # hidden_states_list: sharded to 1-D, torch.cat fails ("Tensors must have same number of dimensions: got 3 and
    # 1", reproduced with megatron-core 0.16.1's and 0.19.2's CheckpointFunction on CPU)
    tp2 = f"--tensor-model-parallel-size 2 --distribute-saved-activations {_full('uniform')}"
    for version, pos in (("0.16", ""), ("0.19", "--position-embedding-type rope")):
        with pytest.raises(ConfigError) as e:
            _terms(f"--mtp-num-layers 2 {pos} {tp2}", version)
        text = str(e.value)
        assert text.startswith("--distribute-saved-activations: does not work with 2 MTP depths") and "\n" not in text
    # 0.16.1 under FP8: te_checkpoint gets every MTP input as a keyword, so TE's checkpoint has no first input
    with pytest.raises(ConfigError, match="--distribute-saved-activations: does not work with --mtp-num-layers"):
        layout_from_flags([("transformer_engine" if f == "local" else f) for f in FLAGS] + ["--fp8-format", "hybrid"]
                          + f"--mtp-num-layers 1 {tp2}".split(), world_size=4, megatron_version="0.16")
    # without MTP, and under block (the MTP depths are not checkpointed), it is estimated
    for extra in (tp2, f"--mtp-num-layers 2 {tp2.replace('uniform', 'block')}"):
        assert _terms(extra)["layer_activations"] > 0
