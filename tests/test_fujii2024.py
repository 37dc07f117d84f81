"""The paper's closed form reproduces the first author's published test values to 4 decimals (GiB).

Source: tools/memory_estimate/tests_memory_consumption_estimator.py in github:okoge-kaz/Megatron-LM
(4 Dec 2024), via shared/reference/paper-2411.06465.md §1.7: Llama-3.1-8B, s=8192, bf16, fp32 grads,
distributed optimizer, flash attention, SP, untied, V=128256.
"""
import pytest

from megatron_memguard import estimate, layout_from_flags

from conftest import LLAMA31_8B


@pytest.mark.parametrize("tp, cp, pp, mbs, dp, weights, acts", [
    (2, 1, 1, 1, 2, 44.8726, 22.6445),
    (1, 2, 1, 1, 2, 67.3089, 22.6445),
    (2, 1, 2, 1, 32, 11.9193, 20.75),
    (2, 2, 1, 2, 32, 23.1374, 22.6445),
])
def test_published_values(tp, cp, pp, mbs, dp, weights, acts):
    world = tp * cp * pp * dp
    L = layout_from_flags(LLAMA31_8B + [
        "--tensor-model-parallel-size", str(tp), "--context-parallel-size", str(cp),
        "--pipeline-model-parallel-size", str(pp), "--micro-batch-size", str(mbs),
        "--global-batch-size", str(mbs * dp * 8), "--sequence-parallel", "--use-distributed-optimizer",
        "--make-vocab-size-divisible-by", "1"], world_size=world)
    est = estimate(L, profile="fujii2024")
    b = est.stages[0].breakdown
    assert round(b["weights_and_optimizer"] / 2**30, 4) == weights
    assert round(b["activations"] / 2**30, 4) == acts
    assert est.stages[0].device_total_bytes == b["weights_and_optimizer"] + b["activations"]
