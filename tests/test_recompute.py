"""Full recomputation with --recompute-num-layers 0 (issue 13): what megatron-core takes and does."""
import pytest

from megatron_memguard import ConfigError, estimate, layout_from_flags

from conftest import LLAMA31_8B

FLAGS = LLAMA31_8B + ["--micro-batch-size", "1", "--tensor-model-parallel-size", "2", "--sequence-parallel",
                      "--pipeline-model-parallel-size", "2", "--global-batch-size", "8"]
BLOCK0 = ["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "0"]


def test_megatron_takes_zero_layers():
    # TransformerConfig.__post_init__ (megatron-core 0.16.1 here; the same test in 0.19.2) refuses only
    # recompute_num_layers=None under full recompute.
    tc = pytest.importorskip("megatron.core.transformer.transformer_config")
    for method in ("block", "uniform"):
        cfg = tc.TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, recompute_granularity="full",
                                   recompute_method=method, recompute_num_layers=0)
        assert cfg.recompute_num_layers == 0


def test_block_with_zero_layers_checkpoints_none():
    # TransformerBlock._checkpointed_forward (0.16.1) / core/recompute.py checkpointed_forward (0.19.2), block:
    # layer i is checkpointed iff i < recompute_num_layers, so with 0 every layer keeps its activations,
    # exactly as without recomputation (the CPU referee measures recomp_full_block0 at tp1_base's peak).
    L = layout_from_flags(FLAGS + BLOCK0, world_size=8)
    assert (L.recompute_granularity, L.recompute_method, L.recompute_num_layers) == ("full", "block", 0)
    assert any("checkpoints no layer" in n for n in L.notes)
    off = layout_from_flags(FLAGS, world_size=8)
    e0, e1 = estimate(L), estimate(off)
    for s0, s1 in zip(e0.stages, e1.stages):
        assert s0.breakdown["layer_activations"] == s1.breakdown["layer_activations"]
        assert s0.peak_allocated_bytes == s1.peak_allocated_bytes
    # one checkpointed layer per stage keeps less
    one = layout_from_flags(FLAGS + BLOCK0[:-1] + ["1"], world_size=8)
    assert estimate(one).stages[0].breakdown["layer_activations"] < e0.stages[0].breakdown["layer_activations"]


def test_uniform_with_zero_layers_is_refused():
    # checkpointed_forward's uniform loop advances by recompute_num_layers: with 0 it never ends.
    with pytest.raises(ConfigError) as e:
        layout_from_flags(FLAGS + ["--recompute-granularity", "full", "--recompute-method", "uniform",
                                   "--recompute-num-layers", "0"], world_size=8)
    assert e.value.key == "--recompute-num-layers" and "uniform" in str(e.value)
