"""data/config_fields.json knows every field of the installed megatron-core's config dataclasses (0.16.1 under
Python 3.11, 0.19.2 under 3.12; scripts/gen_config_fields.py reads 0.14 to 0.19 and Bridge 0.6.x), so a
Bridge / NeMo 2 config written by any supported release gets no "not a setting; ignored" note for a field
that exists."""
import dataclasses

import pytest

from megatron_memguard.readers._common import config_fields, mcore_model_fields

mc = pytest.importorskip("megatron.core")


def _classes():
    from megatron.core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
    from megatron.core.optimizer.optimizer_config import OptimizerConfig
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig
    return TransformerConfig, MLATransformerConfig, OptimizerConfig, DistributedDataParallelConfig


def test_every_field_of_the_installed_release_is_known():
    tc, mla, opt, ddp = _classes()
    names = lambda c: {f.name for f in dataclasses.fields(c)}  # noqa: E731
    assert names(tc) | names(mla) <= mcore_model_fields(), sorted((names(tc) | names(mla)) - mcore_model_fields())
    assert names(opt) <= config_fields()["OptimizerConfig"], sorted(names(opt) - config_fields()["OptimizerConfig"])
    assert names(ddp) <= config_fields()["DistributedDataParallelConfig"]
    assert f"megatron-core {mc.__version__.split('+')[0]}" in config_fields_versions()


def config_fields_versions():
    import json
    from importlib import resources
    return json.loads(resources.files("megatron_memguard").joinpath("data/config_fields.json").read_text())["versions"]


def test_a_bridge_config_of_the_installed_release_reads_without_unknown_field_notes():
    from megatron_memguard._integration import to_plain
    from megatron_memguard.bridge import raw_config
    tc, _, opt, ddp = _classes()
    model = tc(num_layers=2, hidden_size=64, num_attention_heads=4)
    raw = raw_config({"model": to_plain(model), "optimizer": to_plain(opt()), "ddp": to_plain(ddp()),
                      "train": {"micro_batch_size": 1, "global_batch_size": 8}, "dataset": {"seq_length": 128}})
    noise = [w for w in raw.warnings if "not a megatron-core" in w]
    assert noise == []
    assert raw.args["num_layers"] == 2 and raw.args["hidden_size"] == 64
