"""--moe-apply-probs-on-input: the experts multiply their dispatched tokens by the routing probabilities before
fc1 and pass ones to the activation (TEGroupedMLP / SequentialMLP.forward, transformer/moe/experts.py,
megatron-core 0.16.1 and 0.19.2). The multiply keeps the dispatched tokens [N, h] and the probs; fc1 keeps the
scaled copy; the activation keeps ``ones_like(probs)`` and, unfused, no longer the activation's output (the ones
need no gradient). Megatron asserts top-1 at the first forward, and 0.19.2's fused grouped MLP
(``_is_fused_impl_supported``) refuses it.

The first test measures megatron-core's own SequentialMLP on CPU (tests/e2e/moe_probs_on_input.py) in the
running interpreter's Megatron era and compares both totals with memguard's terms for the same shapes.
"""
from __future__ import annotations

import json
import os
import sys

import pytest

from build_util import run_script   # tests/e2e scripts through a fork server (torch and megatron imported once)

from megatron_memguard import layout_from_flags
from megatron_memguard.errors import ConfigError, ConfigErrors
from megatron_memguard.estimator.layers.moe import moe_activations

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the probe's shapes: N = 96 tokens top-1 over 2 experts, h 64, F 128, unfused SwiGLU, fp32, one rank
FLAGS = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 128 --seq-length 96 "
         "--max-position-embeddings 96 --micro-batch-size 1 --global-batch-size 1 --num-experts 2 --moe-router-topk 1 "
         "--moe-router-pre-softmax --moe-token-dispatcher-type alltoall --disable-bias-linear --swiglu "
         "--no-bias-swiglu-fusion --tokenizer-type NullTokenizer --vocab-size 1000").split()
N, H, F = 96, 64, 128
ON = ["--moe-apply-probs-on-input"]


def _experts_saved(extra, version=None) -> dict[str, int]:
    L = layout_from_flags(FLAGS + extra, world_size=1, megatron_version=version)
    a = moe_activations(L, L.moe)
    assert a.rows == N
    return {k: v for k, v in a.saved.items() if k in ("moe_expert_input", "moe_probs_on_input", "moe_expert_activations")}


def test_by_hand():
    plain, on = _experts_saved([]), _experts_saved(ON)
    # the multiply keeps the dispatched tokens and the probs (fp32: 4 N h + 4 N); the unfused product no longer
    # keeps silu x linear [N, F] for the probs' gradient
    assert on["moe_probs_on_input"] == 4 * N * H + 4 * N == 24_960
    assert plain["moe_expert_activations"] - on["moe_expert_activations"] == 4 * N * F
    assert sum(on.values()) - sum(plain.values()) == 4 * N * H + 4 * N - 4 * N * F == -24_192


def test_megatrons_sequential_mlp_keeps_what_memguard_counts():
    pytest.importorskip("torch")
    pytest.importorskip("megatron.core.transformer.moe.experts")
    import megatron.core
    out = run_script([sys.executable, os.path.join(ROOT, "tests", "e2e", "moe_probs_on_input.py")],
                     timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    measured = json.loads(out.stdout.strip().splitlines()[-1])
    era = "0.16" if megatron.core.__version__.startswith("0.16") else "0.19"
    # measured (both eras): 319,872 bytes without the flag, 295,680 with it
    assert measured["plain"] == sum(_experts_saved([], era).values())
    assert measured["probs_on_input"] == sum(_experts_saved(ON, era).values())


def test_fused_swiglu_keeps_its_input_either_way():
    # weighted_bias_swiglu_impl saves its input and the probs whatever they are: only the multiply's bytes add
    fused = [f for f in FLAGS if f != "--no-bias-swiglu-fusion"] + ["--bf16"]
    L0 = layout_from_flags(fused, world_size=1)
    L1 = layout_from_flags(fused + ON, world_size=1)
    a0, a1 = moe_activations(L0, L0.moe).saved, moe_activations(L1, L1.moe).saved
    assert a1["moe_expert_activations"] == a0["moe_expert_activations"]
    assert a1["moe_probs_on_input"] == 2 * N * H + 2 * N           # bf16 tokens, bf16 probs


@pytest.mark.parametrize("era", ["0.16", "0.19"])
def test_top1_only(era):
    flags = [f for f in FLAGS if f != "--moe-router-pre-softmax"]
    i = flags.index("--moe-router-topk")
    flags[i + 1] = "2"
    with pytest.raises((ConfigError, ConfigErrors)) as e:
        layout_from_flags(flags + ON, world_size=1, megatron_version=era)
    assert str(e.value).startswith("--moe-apply-probs-on-input: only works with --moe-router-topk 1")


def test_not_with_the_fused_grouped_mlp():
    flags = FLAGS + ON + ["--moe-grouped-gemm", "--use-transformer-engine-op-fuser", "--bf16"]
    with pytest.raises((ConfigError, ConfigErrors)) as e:
        layout_from_flags([f for f in flags if f != "--no-bias-swiglu-fusion"], world_size=1, megatron_version="0.19",
                          env={"NVTE_CUTEDSL_FUSED_GROUPED_MLP": "1"})
    assert "--use-transformer-engine-op-fuser" in str(e.value) and "--moe-apply-probs-on-input" in str(e.value)
