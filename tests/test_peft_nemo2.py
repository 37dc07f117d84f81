"""NeMo 2 PEFT (readers/nemo2.py _peft): ``llm.finetune(..., peft=llm.peft.LoRA(...))`` as a recipe's ``--to-yaml``
export writes it (top-level ``peft:``) and as a checkpoint's ``context/model.yaml`` keeps it (the model's
``model_transform``, api._setup's _set_with_io). NeMo 2.5.0 nemo/collections/llm/peft/lora.py LoRA (dim 32, alpha 32,
dropout 0.0 'pre'), dora.py DoRA (alpha 64), module_matcher.py / utils.py wildcard_match for '*' targets; the adapters
are built as Megatron-Bridge builds them (utils.py ParallelLinearAdapter), so the counts below are worked out by hand
from Llama-3-8B's shapes: h 4096, 32 layers, 32 heads of 128 in 8 query groups (qkv out 4096 + 2 x 1024 = 6144),
SwiGLU ffn 14336 (fc1 out 28672)."""
import textwrap

import pytest

from megatron_memguard.errors import ConfigError, NotModelledError
from megatron_memguard.estimator import estimate
from megatron_memguard.estimator.peft import adapter_param_count, layer_adapter_rows
from megatron_memguard.readers.detect import read_config_file
from megatron_memguard.resolve import resolve

# the shape of NeMo 2.5.0 recipes/llama3_8b.py finetune_recipe(peft_scheme='lora') exported with --to-yaml
# (finetune_default.py: 1 node of 8 GPUs, TP 1, SquadDataModule seq 2048 / GBS 128 / MBS 1, bf16-mixed; the LoRA
# branch sets dim 8, alpha 16, no distributed optimizer, no cross-entropy fusion)
LLAMA3_8B_LORA = """
_target_: nemo.collections.llm.api.finetune
_partial_: true
model:
  _target_: nemo.collections.llm.gpt.model.llama.LlamaModel
  config:
    _target_: nemo.collections.llm.gpt.model.llama.Llama3Config8B
    seq_length: 2048
    cross_entropy_loss_fusion: false
trainer:
  _target_: nemo.lightning.pytorch.trainer.Trainer
  devices: 8
  num_nodes: 1
  strategy:
    _target_: nemo.lightning.pytorch.strategies.megatron_strategy.MegatronStrategy
    tensor_model_parallel_size: 1
    pipeline_model_parallel_size: 1
    context_parallel_size: 1
    sequence_parallel: false
  plugins:
    _target_: nemo.lightning.pytorch.plugins.mixed_precision.MegatronMixedPrecision
    precision: bf16-mixed
data:
  _target_: nemo.collections.llm.gpt.data.squad.SquadDataModule
  seq_length: 2048
  global_batch_size: 128
  micro_batch_size: 1
optim:
  _target_: nemo.lightning.pytorch.optim.megatron.MegatronOptimizerModule
  config:
    _target_: megatron.core.optimizer.optimizer_config.OptimizerConfig
    optimizer: adam
    lr: 0.0001
    bf16: true
    use_distributed_optimizer: false
peft:
  _target_: nemo.collections.llm.peft.lora.LoRA
  dim: 8
  alpha: 16
"""
# per layer, (in + out) x r: qkv (4096 + 6144) + proj (4096 + 4096) + fc1 (4096 + 28672) + fc2 (14336 + 4096) = 69,632 x r
PER_LAYER_R1 = 69_632


def read(tmp_path, text, name="llama3_8b_finetune.yaml", world=8):
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return resolve(read_config_file(str(p)), world_size=world)


def test_a_finetune_export_with_lora(tmp_path):
    L = read(tmp_path, LLAMA3_8B_LORA)
    p = L.peft
    assert (p.scheme, p.dim, p.alpha, p.dropout, p.dropout_position) == ("lora", 8, 16, 0.0, "pre")
    assert p.target_modules == ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")   # LoRA's default
    # 32 layers x 69,632 x 8 = 17,825,792 trainable parameters (the fused qkv / fc1: HF's separate q, k, v, gate,
    # up adapters would be 20,971,520)
    assert adapter_param_count(L) == 32 * PER_LAYER_R1 * 8 == 17_825_792
    assert estimate(L).to_dict()["trainable_parameters"] == 17_825_792
    # TP 1: one rank holds every adapter of a layer
    assert sum(n for _, n, _ in layer_adapter_rows(L)) == PER_LAYER_R1 * 8
    assert not L.use_distributed_optimizer


def test_dora_and_its_defaults(tmp_path):
    L = read(tmp_path, LLAMA3_8B_LORA.replace("lora.LoRA\n  dim: 8\n  alpha: 16", "dora.DoRA"))
    assert (L.peft.scheme, L.peft.dim, L.peft.alpha) == ("dora", 32, 64)      # DoRA's defaults
    # DoRA adds the wrapped weights' output rows: 6144 + 4096 + 28672 + 4096 = 43,008 a layer
    assert adapter_param_count(L) == 32 * (PER_LAYER_R1 * 32 + 43_008)


def test_a_checkpoints_model_transform(tmp_path):
    # context/model.yaml: the model itself, with the transform api._setup set on it
    text = """
    _target_: nemo.collections.llm.gpt.model.llama.LlamaModel
    config:
      _target_: nemo.collections.llm.gpt.model.llama.Llama3Config8B
      seq_length: 2048
    model_transform:
      _target_: nemo.collections.llm.peft.lora.LoRA
      target_modules: [linear_qkv, linear_proj]
      dim: 16
      dropout: 0.1
    """
    p = tmp_path / "model.yaml"
    p.write_text(textwrap.dedent(text))
    L = resolve(read_config_file(str(p)).with_args(micro_batch_size=1, global_batch_size=64), world_size=8)
    assert (L.peft.dim, L.peft.alpha, L.peft.dropout) == (16, 32, 0.1)
    # qkv (4096 + 6144) 16 + proj (4096 + 4096) 16 = 294,912 a layer
    assert adapter_param_count(L) == 32 * 294_912


@pytest.mark.parametrize("targets, wrapped", [
    ("['*.linear_qkv', '*.linear_fc2']", ("linear_qkv", "linear_fc2")),   # every layer's: as the plain names
    ("['*linear_fc*']", ("linear_fc1", "linear_fc2")),
    ("['*.self_attention.linear_*']", ("linear_qkv", "linear_proj")),
])
def test_wildcards_that_wrap_a_linear_in_every_layer(tmp_path, targets, wrapped):
    L = read(tmp_path, LLAMA3_8B_LORA + f"  target_modules: {targets}\n")
    assert set(L.peft.target_modules) == set(wrapped)


@pytest.mark.parametrize("targets, match", [
    ("['*.layers.0.*.linear_qkv']", "in some layers"),          # the docstring's example: the first layer only
    ("['*.layers.1*.linear_qkv']", "in some layers"),           # 1, 10-19
    ("['*']", "matches 'the model'"),                                   # the model itself
    ("['*output_layer']", "output_layer"),
    ("['*.mlp']", "decoder.layers.0.mlp"),
    ("['decoder.layers.*.mlp.linear_fc1']", "module prefixes"),  # no leading '*': depends on the wrappers' names
    ("['*.linear_q']", "matches none"),
])
def test_wildcards_memguard_does_not_model_are_refused_by_name(tmp_path, targets, match):
    with pytest.raises(NotModelledError, match=r"peft\.target_modules.*" + match):
        read(tmp_path, LLAMA3_8B_LORA + f"  target_modules: {targets}\n")


@pytest.mark.parametrize("extra, key, exc", [
    ("  lora_dtype: {_target_: torch.float32, _call_: false}\n", "peft.lora_dtype", NotModelledError),
    ("  dropout_recompute: true\n", "peft.dropout_recompute", NotModelledError),
    ("  a2a_experimental: true\n", "peft.a2a_experimental", NotModelledError),
    # exclude_modules with LoRA's default target_modules: ModuleMatcher asserts exclude_modules is empty
    ("  exclude_modules: [linear_fc2]\n", "peft.exclude_modules: must be empty when target_modules is set", ConfigError),
    ("  dim: null\n", "peft.dim", ConfigError),
    # NeMo 2.5.0 peft/module_matcher.py ModuleMatcher.match: 'len(self.target_modules or []) > 0' is false for a null,
    # which then wraps every linear (the output layer too), not the default four; 'assert len(self.exclude_modules)
    # == 0' on a null exclude_modules is a TypeError; a string's characters match no module; '???' is that text
    ("  target_modules: null\n", "peft.target_modules", NotModelledError),
    ("  target_modules: linear_qkv\n", "peft.target_modules", ConfigError),
    ("  target_modules: '???'\n", "peft.target_modules", ConfigError),
    ("  exclude_modules: null\n", "peft.exclude_modules", ConfigError),
    ("  rank: 8\n", "peft.rank", ConfigError),
])
def test_unmodelled_or_bad_peft_fields_name_the_key(tmp_path, extra, key, exc):
    text = LLAMA3_8B_LORA.replace("  dim: 8\n", "") + extra
    with pytest.raises(exc, match=key.replace(".", r"\.")):
        read(tmp_path, text)


def test_other_transforms_are_refused_and_none_is_full_finetuning(tmp_path):
    with pytest.raises(NotModelledError, match=r"peft\._target_.*CanonicalLoRA"):
        read(tmp_path, LLAMA3_8B_LORA.replace("lora.LoRA", "canonical_lora.CanonicalLoRA"))
    full = read(tmp_path, LLAMA3_8B_LORA.split("peft:")[0] + "peft: none\n")
    assert full.peft is None
    assert read(tmp_path, LLAMA3_8B_LORA.split("peft:")[0] + "peft: dora\n").peft.scheme == "dora"
