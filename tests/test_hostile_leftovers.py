"""Regressions of issue hostile6: input Megatron or Megatron-Bridge refuse at start-up that memguard read as a default
(an empty hybrid pattern, integer flags argparse's type=int rejects, Bridge nulls and OmegaConf's '???', unknown PEFT
override keys). Each case names where the rule comes from; each is the one-line error (exit 2) memguard gives now,
next to the nearest input that is accepted."""
from __future__ import annotations

import json

import pytest

from fuzz_util import SMALL, run_memguard
from test_hostile_hybrid import _hybrid_yaml, _json, one_error

_WS8 = ["estimate", "--json", "--world-size", "8"]


def _flags(*extra: str, pre: tuple[str, ...] = ()):
    return run_memguard([*_WS8, *pre, "--", *SMALL, *extra], cpu_limit=2.0)


# --- 1. --hybrid-layer-pattern '' -----------------------------------------------------------------------------------
@pytest.mark.parametrize("flag", ["--hybrid-layer-pattern", "--hybrid-override-pattern"])
def test_an_empty_hybrid_pattern_is_refused(flag):
    # megatron-core 0.19.2 megatron/training/arguments.py validate_args: 'if args.hybrid_layer_pattern is not None'
    # (the deprecated flag is copied into it first): '' is a pattern, and num_layers = get_hybrid_total_layer_count('')
    # = 0. memguard took '' for "no pattern" and estimated 4 GPT layers.
    rule = "is empty: validate_args takes the layer count from the pattern (0 layers)"
    one_error(_flags(flag, ""), f"{flag}: {rule}")
    one_error(_flags(f"{flag}="), f"{flag}: {rule}")
    # the nearest accepted input: a 4-symbol pattern is a 4-layer hybrid model
    layout = _json(_flags(flag, "M*M-"))["layout"]
    assert layout["hybrid_layer_pattern"] == "M*M-" and layout["num_layers"] == 4


def test_an_empty_hybrid_pattern_in_megatron_016():
    # megatron-core 0.16.1 ssm/mamba_hybrid_layer_allocation.py _allocate_override: the pattern must have
    # --num-layers (4) symbols ("The hybrid override pattern is the wrong length")
    one_error(_flags("--hybrid-override-pattern", "", pre=("--megatron-version", "0.16.1")),
              "--hybrid-override-pattern: is empty: megatron-core 0.16 asserts the pattern has --num-layers symbols")


# --- 4. integer flags: argparse's type=int ---------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["4.0", "4e0", "1e-400", "1e309", "0x4"])
def test_an_integer_flag_takes_what_int_takes(value):
    # megatron/training/arguments.py (core 0.19.2): parser.add_argument('--num-layers', type=int): argparse calls
    # int(value), which raises on each of these, and Megatron exits at start-up. '1e-400' read as 0 before.
    with pytest.raises(ValueError):
        int(value)
    one_error(_flags("--num-layers", value), f"--num-layers: must be an integer, got '{value}' (Megatron's argparse")


@pytest.mark.parametrize("value, layers", [(" 4", 4), ("+4", 4), ("0_4", 4), ("\u0664", 4)])
def test_an_integer_flag_int_accepts_is_read(value, layers):
    # what int() accepts argparse accepts: spaces, a sign, underscores between digits, Unicode digits (U+0664 is 4)
    assert int(value) == layers
    assert _json(_flags("--num-layers", value))["layout"]["num_layers"] == layers


def test_a_float_flag_keeps_floats():
    # --lr is type=float: 1e-400 is float('1e-400') == 0.0 to argparse, and memory-neutral
    o = _flags("--lr", "1e-400")
    assert not o.problems and o.code in (0, 1), o.describe()


# --- 2. Bridge YAML null / '???' -------------------------------------------------------------------------------------
@pytest.mark.parametrize("field", ["mamba_state_dim", "mamba_head_dim", "mamba_num_groups", "mamba_chunk_size"])
def test_a_null_mamba_size_of_a_bridge_hybrid_model_is_refused(field):
    # megatron-core 0.19.2 TransformerConfig: mamba_state_dim: int = 128, mamba_head_dim: int = 64, mamba_num_groups:
    # int = 8; Bridge 0.6.2 HybridModelProvider: mamba_chunk_size: int = 128. Bridge's omegaconf_utils._apply_overrides
    # sets the attribute to None (a null is not "the default"); memguard took the default.
    one_error(_hybrid_yaml(f"model.{field}=null"), f"model.{field}: is null: Megatron-Bridge passes None")
    one_error(_hybrid_yaml(f"model.{field}=???"), f"model.{field}: is ??? (OmegaConf's missing marker)")


def test_nulls_that_are_bridge_defaults_are_accepted():
    # TransformerConfig: mamba_num_heads: Optional[int] = None (hidden * expand / head dim: 2 * 256 / 32 = 16 heads);
    # num_query_groups: Optional[int] = None (= the 4 attention heads)
    layout = _json(_hybrid_yaml("model.mamba_num_heads=null", "model.num_query_groups=null"))["layout"]
    assert layout["mamba_num_heads"] == 16 and layout["num_query_groups"] == 4


def _lora(extra: str = "", *sets: str):
    from test_readers_bridge import FLAT
    peft = "peft:\n  _target_: megatron.bridge.peft.lora.LoRA\n  dim: 8\n  target_modules: [linear_qkv]\n" + extra
    return run_memguard(["estimate", "--json", "--config", "c.yaml", "--gpus", "8",
                         *[x for s in sets for x in ("--set", s)]], {"c.yaml": FLAT + peft}, cpu_limit=2.0)


@pytest.mark.parametrize("field", ["dim", "alpha", "dropout", "dropout_position"])
def test_a_null_lora_setting_is_refused(field):
    # Bridge 0.6.2 peft/lora.py LoRA: dim: int = 32, alpha: int = 32, dropout: float = 0.0, dropout_position = 'pre';
    # a null is passed on as None (instantiate / _apply_overrides) and ParallelLinearAdapter.__init__ fails on it
    # (peft/lora_layers.py: 'alpha / dim', 'if dropout > 0.0', 'assert dropout_position in ["pre", "post"]').
    # memguard took rank 32.
    rule = f"peft.{field}: is null: Megatron-Bridge's LoRA takes it as None"
    one_error(_lora("", f"peft.{field}=null"), rule)
    one_error(_lora(f"  {field}: null\n" if field != "dim" else "  alpha: 16\n", *(["peft.dim=null"] if field == "dim" else [])),
              rule)


# --- 3. unknown LoRA fields ------------------------------------------------------------------------------------------
def test_an_unknown_lora_key_is_refused_as_an_override_and_warned_in_a_file():
    # A KEY=VALUE override: Bridge 0.6.2 omegaconf_utils.parse_hydra_overrides sets the config to struct mode, and
    # Hydra raises on a key LoRA lacks (OverridesError).
    one_error(_lora("", "peft.rank=8"), "peft.rank: not a field of Megatron-Bridge's LoRA: Megatron-Bridge refuses")
    # In a YAML file: instantiate's LENIENT mode (megatron-core 0.19.2 training/config/instantiate_utils.py
    # _filter_kwargs_for_target) drops it with a logged warning, so memguard warns; FLAT's LoRA (h 512, qkv out 768,
    # TP 2, rank 8, 4 layers): (8/2 x 512 + 768/2 x 8) x 4 = 20,480 bf16 parameters = 40,960 bytes, as without it.
    doc = _json(_lora("  rank: 64\n"))
    assert any("peft.rank: not a field of Bridge's LoRA; ignored" in w for w in doc["notes"])
    assert [x["bytes"] for x in doc["stages"][0]["terms"] if x["name"] == "peft_adapters"] == [40_960]
    assert json.dumps(doc["stages"]) == json.dumps(_json(_lora())["stages"])
