"""The CPU referee with multi-token prediction (real megatron-core 0.16.1 on CPU, gloo, 2 ranks, PP 2).

A 2-layer GPT (h 128, 4 heads, LayerNorm, GELU, biases, learned positions over 64, tied embeddings,
NullTokenizer 1000 + 1 EOD padded to 1024) with --mtp-num-layers 1. What is checked is what a reader can
redo by hand and what the reference could not pin down: the last stage builds a second word embedding for
MTP and, tied or not, keeps its own output-layer weight too (GPTModel.__init__: skip_weight_param_allocation
= pre_process and share_embeddings_and_output_weights), so both are parameters of that rank.
"""
import functools

import pytest

pytest.importorskip("megatron.core")

from benchmarks.referee.run import unsupported_reason  # noqa: E402

pytestmark = pytest.mark.skipif(unsupported_reason() is not None, reason=str(unsupported_reason()))

from benchmarks.referee.grid import COMMON, resolve_config  # noqa: E402
from benchmarks.referee.run import run_referee  # noqa: E402
from megatron_memguard.estimator.mtp import MtpSpec, extra_params  # noqa: E402

FLAGS = COMMON + ("--num-layers 2 --hidden-size 128 --num-attention-heads 4 --seq-length 64 "
                  "--max-position-embeddings 64 --micro-batch-size 2 --global-batch-size 4 "
                  "--pipeline-model-parallel-size 2 --vocab-size 1000 --bf16").split()
H, V, POS = 128, 1024, 64
LAYER = 2 * 2 * H + (H * 3 * H + 3 * H) + (H * H + H) + (H * 4 * H + 4 * H) + (4 * H * H + H)  # norms, QKV, proj, fc1, fc2


@functools.lru_cache(maxsize=None)
def measured() -> list:
    _, settings = resolve_config(FLAGS, 2)   # memguard refuses MTP today: the dense part, then the MTP switch
    settings["mtp_num_layers"] = 1
    return run_referee(settings, 2, timeout=900)


def test_mtp_stage_parameters_by_hand():
    assert LAYER == 198_272
    first, last = measured()
    assert first["num_params"] == V * H + POS * H + LAYER                       # MTP changes nothing there
    mtp = MtpSpec(mtp_num_layers=1, hidden_size=H, padded_vocab_size=V, seq_length=64, micro_batch_size=2,
                  pipeline_model_parallel_size=2, max_position_embeddings=POS)
    # enorm, hnorm, final norm (LayerNorm: 2h each) + eh_proj [h, 2h]; the embedding copy [V, h] + positions
    assert extra_params(mtp) == 3 * 2 * H + H * 2 * H + V * H + POS * H == 172_800
    # the stage's own layer, final norm and output-layer weight; the MTP layer; the MTP extras
    assert last["num_params"] == LAYER + 2 * H + V * H + LAYER + 172_800 == 700_672
