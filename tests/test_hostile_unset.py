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
            # (a Literal of strings is a str: 'moe_token_dispatcher_type: Literal['allgather', 'alltoall', 'flex']')
            declared = "str" if src[name][0].startswith("Literal[") and f["type"] == "str" else src[name][0]
            assert declared == f["type"], name
    assert (table["moe_token_dispatcher_type"]["type"], table["moe_token_dispatcher_type"]["default"]) == ("str", "allgather")
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
    # TransformerConfig 'moe_token_dispatcher_type: Literal['allgather', 'alltoall', 'flex'] = "allgather"': None is
    # none of them (MoELayer raises); 'normalization: Literal['LayerNorm', 'RMSNorm'] = "LayerNorm"'
    ("moe_token_dispatcher_type", "declares str with default allgather"),
    ("normalization", "declares str with default LayerNorm"),
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


# --- issue hostile8: the non-model sections of Megatron-Bridge and --yaml-cfg's top level ------------------------
@pytest.mark.parametrize("override, rule", [
    # megatron-core 0.19.2 distributed/distributed_data_parallel_config.py: 'num_distributed_optimizer_instances: int = 1'
    ("ddp.num_distributed_optimizer_instances=null",
     "ddp.num_distributed_optimizer_instances: is null: Megatron-Bridge passes None on, where DistributedDataParallelConfig "
     "declares int with default 1 (the default is not taken)"),
    # megatron-core 0.19.2 optimizer/optimizer_config.py: 'optimizer: str = 'adam'' (get_megatron_optimizer raises on None)
    ("optimizer.optimizer=null", "optimizer.optimizer: is null: Megatron-Bridge passes None on, where OptimizerConfig "
                                 "declares str with default adam"),
    # 'store_param_remainders: bool = True': None is false, the remainders are not kept
    ("optimizer.store_param_remainders=null", "optimizer.store_param_remainders: is null: Megatron-Bridge passes None on, "
                                              "where OptimizerConfig declares bool with default True"),
    # FLAT's mixed_precision is the preset name bf16_mixed: Hydra cannot override a field of a string ("Could not
    # override 'mixed_precision.grad_reduce_in_fp32'", Bridge 0.6.2 process_config_with_overrides; real Bridge in
    # tests/test_bridge_real.py); the null rule for a MixedPrecisionConfig mapping is the test below
    ("mixed_precision.grad_reduce_in_fp32=null", "mixed_precision.grad_reduce_in_fp32: mixed_precision is the preset "
                                                 "name 'bf16_mixed'"),
    # megatron-core 0.19.2 datasets/gpt_dataset.py GPTDatasetConfig: 'create_attention_mask: bool = True'
    ("dataset.create_attention_mask=null", "dataset.create_attention_mask: is null: Megatron-Bridge passes None on, "
                                           "where GPTDatasetConfig declares bool with default True"),
    # megatron-core BlendedMegatronDatasetConfig 'sequence_length: int' (no default); Bridge's GPTDatasetConfig
    # 'seq_length': ConfigContainer.validate asserts it equals model.seq_length
    ("dataset.seq_length=null", "dataset.seq_length: is null: Megatron-Bridge passes None on, where GPTDatasetConfig "
                                "declares int with no default"),
    # ConfigContainer.validate: "train.micro_batch_size must be set when eval_micro_batch_size is not explicitly
    # configured" (TrainingConfig declares it 'int | None = None')
    ("train.micro_batch_size=null", "train.micro_batch_size: is null: Megatron-Bridge's ConfigContainer.validate "
                                    "asserts it is set"),
    ("train.global_batch_size=null", "train.global_batch_size: is null: Megatron-Bridge's ConfigContainer.validate "
                                     "asserts it is set"),
    # megatron.training SchedulerConfig 'lr_warmup_iters: int = 0': validate multiplies it (TypeError on None)
    ("scheduler.lr_warmup_iters=null", "scheduler.lr_warmup_iters: is null: Megatron-Bridge passes None on, where "
                                       "SchedulerConfig declares int with default 0"),
    # OmegaConf.to_container keeps '???' as the text (Bridge 0.6.2 omegaconf_utils.py): truthy, not False
    ("ddp.overlap_grad_reduce='???'", "ddp.overlap_grad_reduce: is ??? (OmegaConf's missing marker): Megatron-Bridge "
                                      "passes the text '???' on, not a default"),
    ("checkpoint.save='???'", "checkpoint.save: is ??? (OmegaConf's missing marker)"),
    # a whole section null: ConfigContainer declares TrainingConfig (validate: 'NoneType' object has no attribute)
    ("train=null", "train: is null: Megatron-Bridge's ConfigContainer declares TrainingConfig (not Optional) and fails "
                   "on None"),
    ("tokenizer=null", "tokenizer: is null: Megatron-Bridge's ConfigContainer declares TokenizerConfig"),
    ("optimizer='???'", "optimizer: is ??? (OmegaConf's missing marker): Megatron-Bridge passes the text '???' on, where "
                        "it needs a OptimizerConfig"),
])
def test_a_bridge_unset_value_in_a_non_model_section_is_refused(tmp_path, override, rule):
    with pytest.raises(ConfigError) as e:
        _read(tmp_path, FLAT, override)
    assert str(e.value).startswith(rule), str(e.value)


def test_a_null_field_of_a_mixed_precision_mapping_is_refused(tmp_path):
    # Bridge 0.6.2 training/mixed_precision.py 'grad_reduce_in_fp32: bool = True', copied into ddp by setup(): None
    # reduces in bf16 where the default reduces in fp32 (a MixedPrecisionConfig mapping: Hydra can set its fields)
    text = FLAT.replace("mixed_precision: bf16_mixed\n", "mixed_precision: {bf16: true, params_dtype: bf16}\n")
    assert text != FLAT
    with pytest.raises(ConfigError) as e:
        _read(tmp_path, text, "mixed_precision.grad_reduce_in_fp32=null")
    assert str(e.value).startswith("mixed_precision.grad_reduce_in_fp32: is null: Megatron-Bridge passes None on, "
                                   "where MixedPrecisionConfig declares bool with default True"), str(e.value)


def test_a_bridge_unset_value_in_a_non_model_section_of_the_file_is_refused(tmp_path):
    text = FLAT.replace("ddp: {use_distributed_optimizer: true,", "ddp: {use_distributed_optimizer: true, "
                        "num_distributed_optimizer_instances: null,")
    with pytest.raises(ConfigError, match=r"^ddp\.num_distributed_optimizer_instances: is null"):
        _read(tmp_path, text)
    with pytest.raises(ConfigError, match=r"^train: is null"):
        _read(tmp_path, FLAT.replace("train: {micro_batch_size: 2, global_batch_size: 32}", "train: null"))


def test_bridge_non_model_nulls_with_a_meaning_are_accepted(tmp_path):
    base = _read(tmp_path, FLAT)
    # ddp.bucket_size 'Optional[int] = None' (None: Megatron's size), tokenizer.vocab_size 'int = None', a bool
    # defaulting to false (None is false: ddp.overlap_param_gather), profiling (ConfigContainer: 'if self.profiling is
    # not None'), comm_overlap / mixed_precision (Optional sections), logger.log_throughput (bool, default false)
    raw = _read(tmp_path, FLAT, "ddp.bucket_size=null", "ddp.overlap_param_gather=null", "profiling=null",
                "comm_overlap=null", "logger.log_throughput=null", "train.rampup_batch_size=null")
    assert raw.args == base.args
    # ddp.use_distributed_optimizer: null with optimizer.use_distributed_optimizer false is off (Bridge syncs the two
    # with 'or'; None is false), as memguard reads it
    raw = _read(tmp_path, FLAT, "ddp.use_distributed_optimizer=null")
    assert raw.args["use_distributed_optimizer"] is False and base.args["use_distributed_optimizer"] is True
    # an Optional section null: no mixed-precision recipe (the model's own bf16: true stays)
    assert _read(tmp_path, FLAT, "mixed_precision=null").args["bf16"] is True


def test_a_recipes_own_values_are_not_checked():
    # the recipe's own values are Bridge's (its recipe function built them): only what the user wrote is checked
    from megatron_memguard.readers._common import parse_overrides
    from megatron_memguard.readers.bridge import read_bridge
    raw = read_bridge({}, "recipe llama32_1b", parse_overrides([]), recipe="llama32_1b")
    assert raw.args["micro_batch_size"] == 1
    with pytest.raises(ConfigError, match=r"^ddp\.num_distributed_optimizer_instances: is null"):
        read_bridge({}, "recipe llama32_1b", parse_overrides(["ddp.num_distributed_optimizer_instances=null"]),
                    recipe="llama32_1b")


def test_the_section_table_holds_bridges_declarations():
    from megatron_memguard.readers._common import section_typed_field
    # (Bridge 0.6.2 / megatron-core 0.19.2 declarations, named in the tests above)
    assert section_typed_field("ddp", "num_distributed_optimizer_instances") == {
        "type": "int", "default": 1, "class": "DistributedDataParallelConfig"}
    assert section_typed_field("mixed_precision", "grad_reduce_in_fp32")["default"] is True
    assert section_typed_field("optimizer", "optimizer")["default"] == "adam"
    # None-able: not in the table (Optional[int] = None / int | None = None / int = None)
    for sec, name in (("ddp", "bucket_size"), ("train", "micro_batch_size"), ("tokenizer", "vocab_size"),
                      ("comm_overlap", "overlap_grad_reduce")):
        assert section_typed_field(sec, name) is None, (sec, name)
    assert section_typed_field("train", "")["default"] == "required"
    assert section_typed_field("comm_overlap", "")["default"] == "optional"


def _yaml_cfg(tmp_path, **top):
    import yaml
    doc = yaml.safe_load(open(YAML_CFG))
    doc.update(top)
    p = tmp_path / "cfg.yaml"
    p.write_text(yaml.safe_dump(doc))
    return read_config_file(str(p))


@pytest.mark.parametrize("key, default", [
    ("optimizer", "adam"),                         # arguments.py: '--optimizer', default='adam'
    ("make_vocab_size_divisible_by", "128"),       # '--make-vocab-size-divisible-by', default=128
    ("bias_swiglu_fusion", "True"),                # '--no-bias-swiglu-fusion', action='store_false'
])
def test_a_yaml_cfg_top_level_null_is_refused(tmp_path, key, default):
    # megatron-core 0.19.2 yaml_arguments.py load_yaml: the namespace is yaml.safe_load's document (no argparse
    # defaults), so a null stays None where the flags would give the default
    with pytest.raises(ConfigError) as e:
        _yaml_cfg(tmp_path, **{key: None})
    assert str(e.value).startswith(f"{key}: is null: Megatron's --yaml-cfg passes None on (load_yaml reads the file with "
                                   f"yaml.safe_load, no argparse defaults), where Megatron's default is {default} "
                                   "(the default is not taken)"), str(e.value)


def test_a_yaml_cfg_top_level_missing_marker_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"^micro_batch_size: is \?\?\? \(OmegaConf's missing marker\): Megatron's "
                                          r"--yaml-cfg reads it with yaml\.safe_load as the text '\?\?\?', not a default"):
        _yaml_cfg(tmp_path, micro_batch_size="???")


def test_yaml_cfg_top_level_nulls_with_a_meaning_are_accepted(tmp_path):
    base = _yaml_cfg(tmp_path)
    # default None (global_batch_size: MBS x DP), a store_true flag (None is false: its default), a memory-neutral
    # argument memguard does not read (log_interval)
    raw = _yaml_cfg(tmp_path, global_batch_size=None, log_interval=None, use_distributed_optimizer=None)
    assert "global_batch_size" not in raw.args and base.args["global_batch_size"] == 64
    assert not raw.args.get("use_distributed_optimizer") and base.args["use_distributed_optimizer"]


# --- issue nemonulls: NeMo 1's and NeMo 2's non-model sections ------------------------------------------------------
@pytest.mark.parametrize("override, message", [
    # NeMo 2.5.0 nlp/parts/megatron_trainer_builder.py: Trainer(**self.cfg.trainer) and 'self.cfg.trainer.precision in'
    ("trainer.devices=???", "trainer.devices: is ??? (a mandatory value left to the command line): NeMo builds "
                            "Trainer(**cfg.trainer), which raises MissingMandatoryValue on it"),
    ("trainer.precision=???", "trainer.precision: is ??? (a mandatory value left to the command line)"),
    # Lightning 2.5.2 trainer/connectors/accelerator_connector.py: "`num_nodes` must be a positive integer"
    ("trainer.num_nodes=null", "trainer.num_nodes: is null: Lightning's Trainer raises '`num_nodes` must be a positive "
                               "integer', its default 1 is not taken"),
    # Lightning 2.5.2 accelerators/cuda.py get_parallel_devices: '[torch.device("cuda", i) for i in devices]'
    ("trainer.devices=null", "trainer.devices: is null: Lightning's GPU accelerator rejects None"),
    # megatron_gpt_model.py: 'if self.trainer.accumulate_grad_batches > 1' (None > 1 is a TypeError)
    ("trainer.accumulate_grad_batches=null", "trainer.accumulate_grad_batches: is null: NeMo compares it with 1"),
    # megatron_init.py initialize_model_parallel_for_nemo: 'if global_batch_size and micro_batch_size is not None'
    ("model.micro_batch_size=null", "model.micro_batch_size: is null: NeMo builds no micro-batch calculator from None"),
    # megatron_base_model.py __init__: 'cfg.optim.get('name')'
    ("model.optim=null", "model.optim: is null: NeMo reads cfg.optim.get('name')"),
    ("model.optim=???", "model.optim: is ??? (a mandatory value left to the command line): NeMo reads cfg.optim"),
    # modelPT.py setup_optimization: OmegaConf.to_container(optim_config, resolve=True) keeps '???', then get_optimizer
    ("model.optim.name=???", "model.optim.name: is ??? (a mandatory value left to the command line): NeMo looks up an "
                             "optimizer named '???'"),
    # megatron_gpt_model.py build_train_valid_test_datasets: 'sequence_length': self.cfg.data.seq_length
    ("model.data.seq_length=null", "model.data.seq_length: is null: NeMo builds the dataset from it, there is no default"),
])
def test_a_nemo1_unset_non_model_key_is_refused(tmp_path, override, message):
    omegaconf = pytest.importorskip("omegaconf")
    with pytest.raises(omegaconf.errors.MissingMandatoryValue):    # what Trainer(**cfg.trainer) meets
        dict(**omegaconf.OmegaConf.create({"devices": "???"}))
    assert _read(tmp_path, NEMO1).world_size == 16                 # (the file is good as it is)
    with pytest.raises(ConfigError) as e:
        _read(tmp_path, NEMO1, override)
    assert str(e.value).startswith(message), str(e.value)


def test_lightning_refuses_the_null_trainer_keys():
    # the installed Lightning (2.6.6 in the py3.11 venv) on what a NeMo trainer section's null becomes
    lp = pytest.importorskip("lightning.pytorch")
    from lightning.pytorch.accelerators.cuda import CUDAAccelerator
    with pytest.raises(ValueError, match="`num_nodes` must be a positive integer"):
        lp.Trainer(num_nodes=None, logger=False)
    with pytest.raises(TypeError):
        CUDAAccelerator.get_parallel_devices(CUDAAccelerator.parse_devices(None))


def test_nemo1_grad_sync_dtype_null_is_refused_where_mcore_reads_it(tmp_path):
    # megatron_gpt_model.py setup_mcore_distributed_parallel (mcore_distributed_optim only):
    # grad_reduce_in_fp32=(self.cfg.optim.get('grad_sync_dtype', 'fp32') == 'fp32'): None is False, a bf16 reduction
    pytest.importorskip("omegaconf")
    with pytest.raises(ConfigError, match=r"^model\.optim\.grad_sync_dtype: is null: NeMo sets grad_reduce_in_fp32 = "
                                          r"\(grad_sync_dtype == 'fp32'\)"):
        _read(tmp_path, NEMO1, "model.optim.name=mcore_distributed_optim", "model.optim.grad_sync_dtype=null")
    # apex DistributedFusedAdam (and the non-distributed optimizers) take None as their default: accepted
    raw = _read(tmp_path, NEMO1, "model.optim.name=distributed_fused_adam", "model.optim.grad_sync_dtype=null")
    assert raw.args["use_distributed_optimizer"] is True


def test_nemo1_trainer_precision_null_is_lightnings_fp32(tmp_path):
    # megatron_trainer_builder.py: None is not in [16, '16', 'bf16', ...]: no half-precision plugin; Lightning 2.5
    # Trainer(precision=None) is 32-true. BASE's bf16 (megatron_amp_O2) parameters become fp32 ones.
    pytest.importorskip("omegaconf")
    assert _read(tmp_path, NEMO1).args.get("bf16") is True
    raw = _read(tmp_path, NEMO1, "trainer.precision=null")
    assert not raw.args.get("bf16") and not raw.args.get("fp16") and "autocast_dtype" not in raw.args


NEMO2_EXPORT = NEMO2.replace("trainer: {_target_: nemo.lightning.pytorch.trainer.Trainer, devices: 8, num_nodes: 1}\n", """\
trainer:
  _target_: nemo.lightning.pytorch.trainer.Trainer
  devices: 8
  num_nodes: 1
  strategy: {_target_: nemo.lightning.pytorch.strategies.megatron_strategy.MegatronStrategy, tensor_model_parallel_size: 2,
             sequence_parallel: true, ddp: {use_distributed_optimizer: true, grad_reduce_in_fp32: true}}
  plugins: {_target_: nemo.lightning.pytorch.plugins.mixed_precision.MegatronMixedPrecision, precision: bf16-mixed}
data: {_target_: nemo.collections.llm.gpt.data.mock.MockDataModule, micro_batch_size: 1, global_batch_size: 8, seq_length: 1024}
optim: {config: {optimizer: adam, use_distributed_optimizer: true}}
""")


@pytest.mark.parametrize("override, message", [
    ("trainer.num_nodes=???", "trainer.num_nodes: is ??? (OmegaConf's missing marker): NeMo 2 rebuilds the config with "
                              "the text '???' as the value"),
    ("trainer.num_nodes=null", "trainer.num_nodes: is null: Lightning's Trainer raises '`num_nodes` must be a positive"),
    # NeMo 2.5.0 lightning/pytorch/strategies/megatron_strategy.py: 'tensor_model_parallel_size: int = 1'
    ("trainer.strategy.tensor_model_parallel_size=null", "trainer.strategy.tensor_model_parallel_size: is null: NeMo 2 "
     "passes None on, where MegatronStrategy declares int with default 1 (the default is not taken)"),
    ("trainer.strategy.ddp=null", "trainer.strategy.ddp: is null: MegatronStrategy raises 'Invalid DDP type: None'"),
    # collections/llm/gpt/data/mock.py MockDataModule: 'micro_batch_size: int = 4', 'seq_length: int = 2048'
    ("data.micro_batch_size=null", "data.micro_batch_size: is null: NeMo 2 passes None on, where PreTrainingDataModule "
                                   "declares int with default 4"),
    ("data.seq_length=???", "data.seq_length: is ??? (OmegaConf's missing marker)"),
    # lightning/pytorch/plugins/mixed_precision.py MegatronMixedPrecision: 'grad_reduce_in_fp32: bool = True'
    ("trainer.plugins.grad_reduce_in_fp32=null", "trainer.plugins.grad_reduce_in_fp32: is null: NeMo 2 passes None on, "
     "where MegatronMixedPrecision declares bool with default True"),
    # megatron-core optimizer_config.py: 'store_param_remainders: bool = True', 'optimizer: str = 'adam''
    ("optim.config.store_param_remainders=null", "optim.config.store_param_remainders: is null: NeMo 2 passes None on, "
     "where OptimizerConfig declares bool with default True"),
    ("optim.config.optimizer=null", "optim.config.optimizer: is null: NeMo 2 passes None on, where OptimizerConfig "
                                    "declares str with default adam"),
    ("optim=???", "optim: is ??? (OmegaConf's missing marker)"),
])
def test_a_nemo2_unset_non_model_key_is_refused(tmp_path, override, message):
    base = _read(tmp_path, NEMO2_EXPORT)
    assert (base.world_size, base.args["tensor_model_parallel_size"], base.args["micro_batch_size"]) == (8, 2, 1)
    with pytest.raises(ConfigError) as e:
        _read(tmp_path, NEMO2_EXPORT, override)
    assert str(e.value).startswith(message), str(e.value)


def test_nemo2_nulls_with_a_meaning_are_accepted(tmp_path):
    # bool arguments defaulting to false read None as false (MegatronStrategy 'sequence_parallel: bool = False'),
    # Optional ones keep None ('virtual_pipeline_model_parallel_size: Optional[int] = None')
    raw = _read(tmp_path, NEMO2_EXPORT, "trainer.strategy.sequence_parallel=null",
                "trainer.strategy.virtual_pipeline_model_parallel_size=null", "data.create_attention_mask=null")
    assert not raw.args.get("sequence_parallel") and raw.args.get("virtual_pipeline_model_parallel_size") is None
    # a null precision is MegatronMixedPrecision's '32-true' (DtypeConfig: neither bf16 nor fp16)
    raw = _read(tmp_path, NEMO2_EXPORT, "trainer.plugins.precision=null")
    assert raw.args["bf16"] is False and raw.args["fp16"] is False
    # no optimizer (null or absent): GPTModel keeps its own, 'MegatronOptimizerModule(config=OptimizerConfig(lr=1e-4,
    # use_distributed_optimizer=True))' (NeMo 2.5.0 collections/llm/gpt/model/base.py); the file's wins when given
    raw = _read(tmp_path, NEMO2_EXPORT.replace("optim: {config: {optimizer: adam, use_distributed_optimizer: true}}\n",
                                               "optim: {config: {optimizer: adam, use_distributed_optimizer: false}}\n"))
    assert raw.args["use_distributed_optimizer"] is False
    for override in ("optim=null", "~optim"):
        assert _read(tmp_path, NEMO2_EXPORT, override).args["use_distributed_optimizer"] is True
