"""GTP weight shards (core 0.19 ModelParallelConfig.resolve_tensor_parallel_weight_shards): validate_args
fills --tensor-parallel-num-weight-shards in as TP when unset, so shards == TP is the no-GTP default and
must be estimated like no flag at all; more shards rematerialise weights (refused by name)."""
import pytest

from megatron_memguard import estimate, layout_from_flags
from megatron_memguard.errors import ConfigError, NotModelledError

BASE = ["--num-layers", "2", "--hidden-size", "256", "--num-attention-heads", "8", "--seq-length", "512",
        "--max-position-embeddings", "512", "--micro-batch-size", "1", "--global-batch-size", "8",
        "--vocab-size", "1024", "--tokenizer-type", "NullTokenizer", "--bf16", "--tensor-model-parallel-size", "2"]


def test_shards_equal_to_tp_is_the_default():
    plain = estimate(layout_from_flags(BASE, world_size=8)).stages[0].peak_allocated_bytes
    same = estimate(layout_from_flags(BASE + ["--tensor-parallel-num-weight-shards", "2"], world_size=8))
    assert same.stages[0].peak_allocated_bytes == plain


def test_more_shards_than_tp_is_refused_by_name():
    with pytest.raises(NotModelledError, match="--tensor-parallel-num-weight-shards"):
        layout_from_flags(BASE + ["--tensor-parallel-num-weight-shards", "4"], world_size=8)


def test_shards_not_a_multiple_of_tp_break_megatrons_rule():
    with pytest.raises(ConfigError, match="multiple of the TP size"):
        layout_from_flags(BASE + ["--tensor-parallel-num-weight-shards", "3"], world_size=8)
