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


def _uniform(k: int, *extra: str) -> list[str]:
    return ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", str(k),
            *extra]


GPT4 = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8", "--seq-length", "256",
        "--max-position-embeddings", "256", "--micro-batch-size", "2", "--global-batch-size", "4",
        "--vocab-size", "8000", "--bf16"]


def test_uniform_groups_past_a_chunks_layers_are_refused_on_core_016():
    """megatron-core 0.16.1's TransformerBlock._checkpointed_forward (uniform) checkpoints custom(i, i + k) for
    i = 0, k, 2k, ... < the chunk's layers and reads self.layers[index] for every index of the group: 4 layers in
    groups of 3 read layer 4. The CPU referee ran it (the grid's base model, uniform 3, core 0.16.1, 2026-11-30):
    ``IndexError: index 4 is out of range`` at the first forward (transformer_block.py _get_layer). 0.17.1 ends
    the group at min(i + k, layers) (transformer_block.py; recompute.py from 0.18), so 0.19 estimates it."""
    with pytest.raises(ConfigError) as e:
        layout_from_flags(GPT4 + _uniform(3), world_size=1, megatron_version="0.16")
    assert e.value.key == "--recompute-num-layers" and "chunk of 4 layers" in str(e.value)
    assert estimate(layout_from_flags(GPT4 + _uniform(3), world_size=1, megatron_version="0.19")).stages
    # a divisor of the chunk's layers runs on 0.16 (the referee's recomp_full_uniform2)
    assert layout_from_flags(GPT4 + _uniform(2), world_size=1, megatron_version="0.16").recompute_num_layers == 2


def test_uniform_groups_are_checked_per_model_chunk_on_core_016():
    """The loop runs per TransformerBlock, i.e. per pipeline stage and virtual stage: uniform 2 over PP 2 with
    --decoder-first-pipeline-num-layers 1 leaves a 1-layer first stage (group [0, 2) past it), and 8 layers over
    PP 2 x 2 virtual stages leave chunks of 2, which groups of 2 fill; groups of 4 do not."""
    pp2 = ["--pipeline-model-parallel-size", "2", "--global-batch-size", "8"]
    with pytest.raises(ConfigError) as e:
        layout_from_flags(GPT4 + pp2 + ["--num-layers", "5", "--decoder-first-pipeline-num-layers", "1"] + _uniform(2),
                          world_size=2, megatron_version="0.16")
    assert "chunk of 1 layers" in str(e.value)
    vpp = GPT4 + pp2 + ["--num-layers", "8", "--num-virtual-stages-per-pipeline-rank", "2"]
    assert layout_from_flags(vpp + _uniform(2), world_size=2, megatron_version="0.16").vpp == 2
    with pytest.raises(ConfigError):
        layout_from_flags(vpp + _uniform(4), world_size=2, megatron_version="0.16")
