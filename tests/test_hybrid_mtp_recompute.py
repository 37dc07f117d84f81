"""Full uniform recompute of a hybrid model's MTP depths (megatron-core 0.18.2 / 0.19.2): each depth's
_proj_and_transformer_layer runs inside one checkpoint (MultiTokenPredictionLayer._checkpointed_forward,
transformer/multi_token_prediction.py: recompute_num_layers must be 1), which keeps its inputs only; its replay in
backward runs the depth's HybridStack, whose checkpointed_forward (models/hybrid/hybrid_block.py, recompute.py)
checkpoints each of its layers again. The small model of tests/test_mamba.py: seq 128, MBS 1, h 256, bf16."""
from __future__ import annotations

from megatron_memguard import estimate
from megatron_memguard.estimator.activations import layer_activations
from megatron_memguard.estimator.core import _checkpointed_hybrid_depth
from megatron_memguard.partition import LayerKind
from test_mamba import _layout

T, H = 128, 256
ROW = T * H * 2                 # one [s, b, h] bf16 tensor: a checkpoint's input
UNIFORM = "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1"


def _terms(pattern: str, extra: str = UNIFORM) -> dict:
    return {t.name: t.bytes for t in estimate(_layout(pattern, extra)).critical.terms}


def test_each_depth_keeps_its_checkpoint_input():
    # 4 decoder layers and 1 or 2 depths, each one checkpoint keeping its [s, b, h] input (decoder_input; hidden_states
    # is the decoder's output, counted by the MTP block terms)
    assert _terms("M*M-")["layer_activations"] == 4 * ROW == 262_144
    assert _terms("M*M-/MM")["layer_activations"] == (4 + 1) * ROW
    assert _terms("M*M-/*-/*-")["layer_activations"] == (4 + 2) * ROW
    # without recompute the depth keeps its two Mamba layers whole: more than a checkpoint input
    plain = _terms("M*M-/MM", "")["layer_activations"] - _terms("M*M-", "")["layer_activations"]
    mamba = layer_activations(_layout("M*M-/MM"), True, LayerKind("mamba", "none")).total
    assert plain == 2 * mamba > ROW


def test_the_depths_replay():
    # the replay of a depth of two Mamba layers: enorm's input, eh_proj's [s, b, 2h] input, the final norm's input and
    # three norms' fp32 rstd (RMSNorm), the stack's two checkpoint inputs, then one Mamba layer replayed: its saved
    # tensors and its backward working set (test_mamba.py works both out by hand)
    L = _layout("M*M-/MM", UNIFORM)
    la = layer_activations(L, True, LayerKind("mamba", "none"))
    outside = ROW + 2 * ROW + ROW + 3 * T * 4
    fwd, bwd = _checkpointed_hybrid_depth(L, [(la, 2)], ROW)
    assert bwd == outside + 2 * ROW + la.total + la.bwd_transient
    assert fwd == la.fwd_transient + la.total
    # by hand at MBS 1 (mamba_ssm 2.2.6 as tests/test_mamba.py reads it): the Mamba layer keeps 808,448 B (its input and
    # in_proj's input 65,536 each, zxbcdt 128 x 1104 x 2, the scan output, the gated norm's input and out_proj's input
    # 128 x 512 x 2 each, fp32 statistics 512 + 1,024); its backward at the scan 707,584 B (the output gradient 65,536,
    # dy 131,072, dzxbcdt 282,624, the conv output and its gradient 2 x 128 x 576 x 2, the states 8,192 x 6, fp32 C^T B
    # 2 x 128^2 x 4, dt's 16,384, less the released norm and out_proj tensors 263,168)
    assert (la.total, la.bwd_transient) == (808_448, 707_584)
    assert outside == 263_680 and bwd == 263_680 + 131_072 + 808_448 + 707_584 == 1_910_784
    # the replay raises the last stage's backward working set above the decoder's own (one layer replayed)
    with_mtp = {t.name: t.bytes for t in estimate(L).critical.terms}["backward_transient"]
    without = {t.name: t.bytes for t in estimate(_layout("M*M-", UNIFORM)).critical.terms}["backward_transient"]
    assert with_mtp > without


def test_block_recompute_checkpoints_the_first_layers_of_each_depths_stack():
    # under block MultiTokenPredictionLayer.forward (multi_token_prediction.py, megatron-core 0.19.2) warns and runs
    # the depth plainly, while its HybridStack (models/hybrid/hybrid_block.py, the model's config) takes recompute.py
    # checkpointed_forward: its first --recompute-num-layers layers keep their [s, b, h] input, the others everything
    block = "--recompute-granularity full --recompute-method block --recompute-num-layers "
    mamba = 808_448             # one Mamba layer's saved bytes at MBS 1 (test_the_depths_replay, by hand)
    for k, per_depth in ((1, ROW + mamba), (2, 2 * ROW), (5, 2 * ROW)):
        base = _terms("M*M-", block + str(k))["layer_activations"]
        assert _terms("M*M-/MM", block + str(k))["layer_activations"] - base == per_depth
        assert _terms("M*M-/MM/MM", block + str(k))["layer_activations"] - base == 2 * per_depth
    assert ROW + mamba == 873_984
    # the depth keeps its own tensors (enorm, eh_proj and final norm inputs: not checkpointed) as without recompute
    assert (_terms("M*M-/MM", block + "1")["mtp_block_activations"] == _terms("M*M-/MM", "")["mtp_block_activations"])


def test_block_recompute_depth_working_sets():
    # two depths of 'MM' with one checkpointed layer each, top to bottom: the plain Mamba layer's backward working set
    # (707,584 by hand, test_the_depths_replay); then the checkpointed one replays over its kept input
    # (CheckpointFunction.backward, tensor_parallel/random.py 0.19.2): its saved 808,448 less the kept input its norm
    # saves again (65,536) and the replayed output (65,536) beside its working set 707,584, less the plain layer
    # above, already back-propagated (808,448); the gradient it was handed (65,536, held until its backward returns) is
    # the output gradient that working set already holds: a Mamba layer has one residual branch, merged at its last
    # step (no pre-MLP norm: measured for such layers on the CPU referee, tests/test_referee_replay.py); the depth
    # below the same less what the top depth still keeps
    from megatron_memguard.estimator.core import _block_hybrid_depths
    L = _layout("M*M-/MM/MM", "--recompute-granularity full --recompute-method block --recompute-num-layers 1")
    la = layer_activations(L, True, LayerKind("mamba", "none"))
    fwd, bwd = _block_hybrid_depths([(la, 2)], 2, 1, ROW, ROW)
    assert bwd == max(707_584, 808_448 - 65_536 + 65_536 + 707_584 - 808_448) == 707_584
    # the forward, over the whole chunk's saved bytes (the layers above have not saved yet): the top depth's layers,
    # the checkpointed one with its own tensors live until it returns (an upper bound) but not the plain layer's above
    assert fwd == la.fwd_transient


def test_distributed_checkpoint_keeps_the_depths_decoder_input_whole():
    # --distribute-saved-activations at TP 2: CheckpointFunction.forward shards only its first input
    # (tensor_parallel/random.py, megatron-core 0.19.2), a decoder layer's hidden_states (4 layers x ROW / 2) and an MTP
    # depth's hidden_states, not the depth's decoder_input (MultiTokenPredictionLayer._checkpointed_forward hands it
    # second), which stays one whole [s, b, h] bf16 tensor per depth, as for a GPT depth (estimator/mtp.py); the depth's
    # hidden_states shard is a new 1/TP buffer (split_tensor_into_1d_equal_chunks(new_buffer=True)) while the decoder
    # output it shards stays referenced: ROW / 2 more
    extra = UNIFORM + " --tensor-model-parallel-size 2 --distribute-saved-activations"

    def acts(pattern: str) -> int:
        return {t.name: t.bytes for t in estimate(_layout(pattern, extra, world=2)).critical.terms}["layer_activations"]
    assert acts("M*M-") == 4 * ROW // 2 == 131_072
    assert acts("M*M-/MM") - acts("M*M-") == ROW + ROW // 2 == 98_304
