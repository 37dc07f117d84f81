"""Regressions of issue hostile7: OmegaConf's '???' and a null on a model-config key memguard reads were read as the
default in Megatron-Bridge, NeMo 1, NeMo 2 and Megatron --yaml-cfg files, where each framework carries the text
'???' or None on (or raises). Each is now an error naming the key; a null that has a meaning stays accepted."""
from __future__ import annotations

import ast
import importlib.util
import os
import textwrap

import pytest

from megatron_memguard.errors import ConfigError
from megatron_memguard.readers._common import model_fields_read, null_not_default, typed_defaults
from megatron_memguard.readers.detect import read_config_file
from test_readers_bridge import FLAT
from test_readers_nemo1 import BASE as NEMO1
from test_yaml_cfg import SMALL as YAML_CFG


def _read(tmp_path, text, *overrides, name="c.yaml"):
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return read_config_file(str(p), overrides=list(overrides))


# --- the table: data/typed_defaults.json against the installed megatron-core's source ---------------------------
def _installed_transformer_config() -> dict[str, tuple[str, object]]:
    spec = importlib.util.find_spec("megatron")          # (a namespace package: nothing of megatron-core is run)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("megatron-core is not installed")
    path = os.path.join(list(spec.submodule_search_locations)[0], "core", "transformer", "transformer_config.py")
    if not os.path.exists(path):
        pytest.skip("megatron-core is not installed")
    out = {}
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.ClassDef) and node.name == "TransformerConfig":
            for s in node.body:
                if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name):
                    d = s.value
                    if isinstance(d, ast.Call) and d.keywords:   # field(default=...)
                        d = {k.arg: k.value for k in d.keywords}.get("default", d)
                    out[s.target.id] = (ast.unparse(s.annotation), ast.literal_eval(d) if isinstance(d, ast.Constant) else d)
    return out


def test_the_table_is_the_installed_transformer_config():
    # megatron-core 0.16.1 (py3.11) / 0.19.2 (py3.12) transformer/transformer_config.py: e.g. 'hidden_size: int = 0',
    # 'add_bias_linear: bool = True', 'moe_router_topk: int = 2', 'rotary_percent' is GPTModelProvider's (float 1.0)
    src = _installed_transformer_config()
    table = typed_defaults()
    assert (table["hidden_size"]["type"], table["hidden_size"]["default"]) == ("int", 0) == src["hidden_size"]
    assert src["add_bias_linear"] == ("bool", True) and table["add_bias_linear"]["default"] is True
    assert src["moe_router_topk"] == ("int", 2) == (table["moe_router_topk"]["type"], table["moe_router_topk"]["default"])
    for name, f in table.items():
        if "TransformerConfig" in f["classes"] and name in src:
            assert src[name][0] == f["type"], name
    # None-able fields are not in it: 'num_query_groups: Optional[int] = None', 'ffn_hidden_size: Optional[int] = None'
    # (0.19.2; 'int = None' in 0.16.1); MLATransformerConfig's 'q_lora_rank: int = 512' is tested 'is None' in
    # multi_latent_attention.py (DeepSeek-V2-Lite's null: no query compression)
    assert not {"num_query_groups", "ffn_hidden_size", "kv_channels", "q_lora_rank"} & set(table)
    # bools defaulting to false read None as false (their default): accepted
    assert not null_not_default("gated_linear_unit") and null_not_default("share_embeddings_and_output_weights")


# --- Megatron-Bridge -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("field, declared", [
    ("hidden_size", "declares int with default 0"),                      # TransformerConfig: None * ... fails
    ("add_bias_linear", "declares bool with default True"),              # None: no biases, not the default
    ("share_embeddings_and_output_weights", "declares bool with default True"),  # None: untied output layer
    ("tensor_model_parallel_size", "declares int with default 1"),       # ModelParallelConfig
    ("rotary_percent", "declares float with default 1.0"),               # GPTModelProvider
])
def test_a_bridge_null_on_a_typed_field_is_refused(tmp_path, field, declared):
    # Bridge 0.6.2 omegaconf_utils._apply_overrides / instantiate set the dataclass attribute to None (no type check)
    with pytest.raises(ConfigError, match=rf"model\.{field}: is null: Megatron-Bridge passes None on, where \w+ {declared}"):
        _read(tmp_path, FLAT, f"model.{field}=null")
    # the file spelling too
    with pytest.raises(ConfigError, match=rf"model\.{field}: is null"):
        _read(tmp_path, FLAT.replace("  bf16: true\n", f"  bf16: true\n  {field}: null\n", 1))


def test_bridge_nulls_with_a_meaning_are_accepted(tmp_path):
    base = _read(tmp_path, FLAT)
    raw = _read(tmp_path, FLAT, "model.num_query_groups=null", "model.q_lora_rank=null", "model.gated_linear_unit=null",
                "model.beta_fast=null")   # (MLA rope scaling beta_fast: float = 32, memguard does not read it)
    assert "group_query_attention" not in raw.args and raw.args["hidden_size"] == base.args["hidden_size"] == 512
    assert not raw.args.get("swiglu")


# --- NeMo 1 --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("line, key", [
    ("moe_router_topk: ???", "model.moe_router_topk"),           # a megatron-core field: was dropped
    ("fp8_margin: ???", "model.fp8_margin"),
])
def test_a_nemo1_missing_marker_on_a_copied_field_is_refused(tmp_path, line, key):
    # NeMo 2.5 nlp/models/language_modeling/megatron_base_model.py build_transformer_config copies cfg[field.name] of
    # cfg = OmegaConf.to_container(self.cfg, resolve=True), which keeps '???' as the text (throw_on_missing=False)
    omegaconf = pytest.importorskip("omegaconf")
    assert omegaconf.OmegaConf.to_container(omegaconf.OmegaConf.create({"k": "???"}))["k"] == "???"
    with pytest.raises(ConfigError, match=rf"{key}: is \?\?\? .*NeMo copies the text"):
        _read(tmp_path, NEMO1 + f"  {line}\n")


def test_a_nemo1_missing_marker_read_with_get_is_the_default(tmp_path):
    # megatron_gpt_model.py: share_embeddings_and_output_weights=self.cfg.get('share_embeddings_and_output_weights',
    # True): DictConfig.get returns the default for '???' (attribute access would raise MissingMandatoryValue).
    # memguard read '???' as false: an untied output layer.
    omegaconf = pytest.importorskip("omegaconf")
    c = omegaconf.OmegaConf.create({"k": "???"})
    assert c.get("k", True) is True
    with pytest.raises(omegaconf.errors.MissingMandatoryValue):
        c.k
    raw = _read(tmp_path, NEMO1 + "  share_embeddings_and_output_weights: ???\n")
    assert raw.args["untie_embeddings_and_output_weights"] is False


@pytest.mark.parametrize("line, key", [("bias: null", "model.bias"), ("tensor_model_parallel_size: null",
                                                                       "model.tensor_model_parallel_size"),
                                       ("hidden_dropout: null", "model.hidden_dropout")])
def test_a_nemo1_null_on_a_typed_field_is_refused(tmp_path, line, key):
    # build_transformer_config: add_bias_linear = self.cfg.get('bias', True) is None for a null key (the .get default
    # is for an absent key); megatron-core fields are copied as cfg[name]
    pytest.importorskip("omegaconf")
    NEMO1_ = NEMO1.replace("  tensor_model_parallel_size: 2\n", "") if "tensor" in line else NEMO1
    with pytest.raises(ConfigError, match=rf"{key}: is null: NeMo passes None on"):
        _read(tmp_path, NEMO1_ + f"  {line}\n")


# --- NeMo 2 export -------------------------------------------------------------------------------------------------
NEMO2 = """
_target_: nemo.collections.llm.api.pretrain
model:
  _target_: nemo.collections.llm.gpt.model.base.GPTModel
  config:
    _target_: nemo.collections.llm.gpt.model.base.GPTConfig
    num_layers: 4
    hidden_size: 512
    num_attention_heads: 8
    seq_length: 1024
    vocab_size: 32000
trainer: {_target_: nemo.lightning.pytorch.trainer.Trainer, devices: 8, num_nodes: 1}
"""


@pytest.mark.parametrize("line, rule", [("hidden_dropout: ???", r"is \?\?\? .*NeMo 2 rebuilds the config"),
                                        ("add_bias_linear: null", "is null: NeMo 2 passes None on"),
                                        ("tensor_model_parallel_size: null", "is null: NeMo 2 passes None on")])
def test_a_nemo2_export_unset_value_is_refused(tmp_path, line, rule):
    # NeMo 2's io exports are YAML rebuilt into the GPTConfig dataclass (fiddle): '???' and None are its values
    assert _read(tmp_path, NEMO2).args["hidden_size"] == 512
    with pytest.raises(ConfigError, match=rf"model\.config\.{line.split(':')[0]}: {rule}"):
        _read(tmp_path, NEMO2.replace("    vocab_size: 32000\n", f"    vocab_size: 32000\n    {line}\n"))


# --- Megatron --yaml-cfg ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("old, new, rule", [
    ("  hidden_dropout: 0.0", "  hidden_dropout: ???", r"is \?\?\? .*yaml\.safe_load as the text"),
    ("  add_bias_linear: false", "  add_bias_linear: null", "is null: Megatron's --yaml-cfg passes None on"),
])
def test_a_yaml_cfg_unset_value_is_refused(tmp_path, old, new, rule):
    # megatron-core 0.19.2 megatron/training/yaml_arguments.py: load_yaml is yaml.safe_load ('???' is text, null None)
    # and core_transformer_config_from_yaml builds TransformerConfig(**language_model) from them
    text = open(YAML_CFG).read()
    assert old + "\n" in text
    with pytest.raises(ConfigError, match=rf"language_model\.{new.split(':')[0].strip()}: {rule}"):
        _read(tmp_path, text.replace(old + "\n", new + "\n"))


def test_the_fields_read_are_the_mapped_ones():
    # (the rule covers exactly what map_mcore_fields passes on: a field it drops cannot change the estimate)
    assert {"hidden_size", "add_bias_linear", "tensor_model_parallel_size"} <= model_fields_read()
    assert "beta_fast" not in model_fields_read()
