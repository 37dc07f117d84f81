"""The knob registry (megatron_memguard/knobs.py) against the real readers: every knob's Megatron flag
parses to its dest, and its NeMo 2 / Megatron-Bridge override keys, applied to the shared configs,
reach the same setting through the NeMo 2 and Bridge readers (shared/reference/nemo-bridge.md names
the keys; the configs are the real ones in shared/configs)."""
import os
import shlex

import pytest

from benchmarks.shared_data import CONFIGS
from megatron_memguard.knobs import BY_DEST, KNOBS, RECOMPUTE_LEVELS, flag_of, knob
from megatron_memguard.readers.detect import read_config_file
from megatron_memguard.readers.megatron_flags import flag_table, parse_megatron_flags

NEMO2 = os.path.join(CONFIGS, "nemo2/context_model.yaml")
BRIDGE = os.path.join(CONFIGS, "megatron-bridge/llama32_1b_pretrain_override.yaml")


def _value(k):
    """A value each knob can take that differs from the shared configs' own (3 is no config's size)."""
    if k.kind == "bool":
        return True
    if k.kind == "list":
        return ["moe_act", "layernorm"]
    if k.kind == "choice":
        # a value Megatron's argparse accepts for the flag (the parser refuses others since it checks choices)
        return {"recompute_method": "block", "fp8": "hybrid", "fp8_recipe": "tensorwise",
                "data_parallel_sharding_strategy": "optim_grads"}.get(k.dest, "full")
    if k.kind == "text":
        return "Et|(tt|)*2L"      # a pipeline layout: 4 stages, '|', '(' and '*' quoted through each spelling
    return 3


def _setting(raw, k):
    # NeMo 2 and Bridge set virtual stages per rank under Layout's name; Megatron under its flag's dest.
    return raw.args.get(k.dest, raw.args.get(k.field))


@pytest.mark.parametrize("k", KNOBS, ids=lambda k: k.dest)
def test_flag_parses_to_the_dest(k):
    assert flag_table()[k.flag][0] == k.dest         # the flag table is Megatron's own argparse dump
    v = _value(k)
    argv = [k.flag] if k.kind == "bool" else [k.flag, *v] if k.kind == "list" else [k.flag, str(v)]
    assert parse_megatron_flags(argv).args[k.dest] == v
    assert shlex.split(k.megatron(v)) == argv and flag_of(k.dest) == k.flag


@pytest.mark.parametrize("k", [k for k in KNOBS if k.nemo2], ids=lambda k: k.dest)
def test_nemo2_keys_reach_the_setting(k):
    v = _value(k)
    raw = read_config_file(NEMO2, overrides=k.overrides(k.nemo2, v))
    assert _setting(raw, k) == v
    assert raw.key(k.dest if k.dest in raw.args else k.field) in k.nemo2   # errors will name the key written


@pytest.mark.parametrize("k", [k for k in KNOBS if k.bridge], ids=lambda k: k.dest)
def test_bridge_keys_reach_the_setting(k):
    v = _value(k)
    raw = read_config_file(BRIDGE, overrides=k.overrides(k.bridge, v))
    assert _setting(raw, k) == v
    assert raw.key(k.dest if k.dest in raw.args else k.field) in k.bridge


def test_yaml_spelling_of_override_values():
    k = knob("use_distributed_optimizer")
    assert k.overrides(k.bridge, False) == ["ddp.use_distributed_optimizer=false", "optimizer.use_distributed_optimizer=false"]
    assert knob("virtual_pipeline_model_parallel_size").overrides(("x",), None) == ["x=null"]


def test_registry_is_one_row_per_dest_and_knows_the_planner_levels():
    assert len(BY_DEST) == len(KNOBS)
    assert knob("recompute_granularity").candidates == RECOMPUTE_LEVELS == ("none", "selective", "full")
    assert {k.short for k in KNOBS if k.short} >= {"tp", "pp", "vpp", "cp", "sp", "mbs", "dist_opt", "recompute"}


def test_autotune_changes_only_registered_knobs():
    # autotune's updates are pasted as flags (hook suggestion) and config keys: each must be a knob
    from megatron_memguard.autotune import _FULL
    from megatron_memguard.recompute_ladder import Rung
    changed = set(Rung(("moe_act",), "moe_act", 0, 0.0).updates()) | set(_FULL) | {"micro_batch_size", "pipeline_model_parallel_size", "global_batch_size",
                                              "recompute_activations"}
    assert changed <= set(BY_DEST)
