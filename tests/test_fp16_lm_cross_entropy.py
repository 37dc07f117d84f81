"""`--fp16-lm-cross-entropy` changes no byte of a megatron-core model: GPTModel stores the flag and never reads it
(megatron/core/models/gpt/gpt_model.py), and _VocabParallelCrossEntropy.calculate_logits_max upcasts the logits
with `.float()` on every path (megatron/core/tensor_parallel/cross_entropy.py), in core 0.16.1 and 0.19.2 alike.
The CPU referee measures it (grid `fp16_lm_ce`)."""
import json
import os

import pytest

from megatron_memguard import estimate, layout_from_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MEASURED = os.path.join(ROOT, "benchmarks", "results", "referee-measured.json")

SMALL = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8", "--seq-length", "256",
         "--max-position-embeddings", "256", "--micro-batch-size", "2", "--global-batch-size", "8",
         "--vocab-size", "8000", "--make-vocab-size-divisible-by", "128", "--tokenizer-type", "NullTokenizer",
         "--fp16"]


@pytest.mark.parametrize("version", ["0.16", "0.19"])
@pytest.mark.parametrize("extra,world", [
    ([], 1),
    (["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--sequence-parallel"], 4),
    (["--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl", "native"], 2),
])
def test_the_flag_changes_no_estimate(extra, world, version):
    def stages(flags):
        est = estimate(layout_from_flags(SMALL + extra + flags, world_size=world, megatron_version=version))
        return [dict(s.breakdown) for s in est.stages]
    assert stages(["--fp16-lm-cross-entropy"]) == stages([])


def test_the_softmax_is_kept_in_fp32_with_the_flag():
    # 4 B x s x b x V_pad / TP: s 256, b 2, V 8000 padded to a multiple of 128 = 8064 (Megatron's
    # _vocab_size_with_padding); _VocabParallelCrossEntropy.forward keeps exp_logits (ctx.save_for_backward)
    est = estimate(layout_from_flags(SMALL + ["--fp16-lm-cross-entropy"], world_size=1))
    terms = est.stages[0].breakdown
    assert terms["loss_softmax_fp32"] == 4 * 256 * 2 * 8064
    assert "loss_softmax" not in terms


def test_the_referee_measures_the_same_bytes_with_and_without_the_flag():
    # real megatron-core 0.16.1 on CPU, one rank (benchmarks/referee/grid.py fp16 and fp16_lm_ce)
    configs = {c["name"]: c for c in json.load(open(MEASURED, encoding="utf-8"))["configs"]}
    with_flag, without = configs["fp16_lm_ce"]["ranks"][0], configs["fp16"]["ranks"][0]
    assert "--fp16-lm-cross-entropy" in configs["fp16_lm_ce"]["flags"]
    for key in ("num_params", "live_bytes_after_step", "peak_bytes"):
        assert with_flag[key] == without[key], key
