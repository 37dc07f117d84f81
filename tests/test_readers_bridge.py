"""Megatron-Bridge ConfigContainer YAML: flat and nested model layouts, dtype spellings, mixed_precision
presets, the OR of the two use_distributed_optimizer keys, KEY=VALUE overrides, recipes."""
import textwrap

import pytest

from megatron_memguard import resolve
from megatron_memguard.cli.main import build_parser, load_raw, main
from megatron_memguard.errors import ConfigError, NotModelledError
from megatron_memguard.readers.detect import read_config_file

SHAPE = dict(num_layers=4, hidden_size=512, ffn_hidden_size=1536, num_attention_heads=8, num_query_groups=2,
             tensor_model_parallel_size=2, pipeline_model_parallel_size=1, context_parallel_size=1, sequence_parallel=True,
             gated_linear_unit=True, normalization="RMSNorm", add_bias_linear=False, position_embedding_type="rope",
             share_embeddings_and_output_weights=False, seq_length=1024, vocab_size=32000)


def _yaml_map(d, indent):
    return "\n".join(" " * indent + f"{k}: {v if not isinstance(v, bool) else str(v).lower()}" for k, v in d.items())


FLAT = f"""
_target_: megatron.bridge.training.config.ConfigContainer
model:
  _target_: megatron.bridge.models.gpt_provider.GPTModelProvider
{_yaml_map(SHAPE, 2)}
  activation_func:
    _target_: torch.nn.functional.silu
    _call_: false
  params_dtype:
    _target_: torch.bfloat16
    _call_: false
  bf16: true
train: {{micro_batch_size: 2, global_batch_size: 32}}
dataset: {{seq_length: 1024}}
optimizer: {{optimizer: adam, use_distributed_optimizer: false, bf16: true}}
ddp: {{use_distributed_optimizer: true, grad_reduce_in_fp32: true, overlap_grad_reduce: true}}
tokenizer: {{tokenizer_type: NullTokenizer, vocab_size: 32000}}
mixed_precision: bf16_mixed
"""

_OUTER = ("seq_length", "vocab_size", "share_embeddings_and_output_weights", "position_embedding_type")
NESTED = f"""
_target_: megatron.bridge.training.config.ConfigContainer
model:
  _target_: megatron.bridge.models.gpt.model_config.BridgeGPTModelConfig
  _builder_: megatron.training.models.gpt.GPTModelBuilder
{_yaml_map({k: v for k, v in SHAPE.items() if k in _OUTER}, 2)}
  transformer:
    _target_: megatron.bridge.models.transformer_config.TransformerConfig
{_yaml_map({k: v for k, v in SHAPE.items() if k not in _OUTER}, 4)}
    activation_func: silu
    bf16: true
train: {{micro_batch_size: 2, global_batch_size: 32}}
dataset: {{seq_length: 1024}}
optimizer: {{optimizer: adam, use_distributed_optimizer: true}}
ddp: {{use_distributed_optimizer: false, grad_reduce_in_fp32: true, overlap_grad_reduce: true}}
tokenizer: {{tokenizer_type: NullTokenizer, vocab_size: 32000}}
mixed_precision: bf16-mixed
"""


def read(tmp_path, text, overrides=(), model=None):
    p = tmp_path / "run_config.yaml"
    p.write_text(textwrap.dedent(text))
    return read_config_file(str(p), overrides=list(overrides), model=model)


def test_flat_and_nested_layouts_give_the_same_layout(tmp_path):
    a = resolve(read(tmp_path, FLAT), world_size=8)
    b = resolve(read(tmp_path, NESTED), world_size=8)
    assert a == b
    assert (a.tp, a.dp, a.sequence_parallel, a.num_query_groups, a.swiglu, a.untie_embeddings_and_output_weights) == \
        (2, 4, True, 2, True, True)
    assert (a.params_dtype, a.use_distributed_optimizer, a.padded_vocab_size) == ("bf16", True, 32000)


def test_nested_layout_origin_names_the_transformer_key(tmp_path):
    raw = read(tmp_path, NESTED)
    assert raw.origin["num_layers"] == "model.transformer.num_layers"
    assert raw.origin["seq_length"] == "model.seq_length"


def test_overrides_use_either_spelling_in_the_nested_layout(tmp_path):
    raw = read(tmp_path, NESTED, overrides=["model.tensor_model_parallel_size=4", "model.transformer.num_layers=8"])
    assert (raw.args["tensor_model_parallel_size"], raw.args["num_layers"]) == (4, 8)


@pytest.mark.parametrize("ddp, opt, expect", [(True, False, True), (False, True, True), (False, False, False)])
def test_distributed_optimizer_keys_are_or_ed(tmp_path, ddp, opt, expect):
    text = FLAT.replace("use_distributed_optimizer: false, bf16", f"use_distributed_optimizer: {str(opt).lower()}, bf16")
    text = text.replace("ddp: {use_distributed_optimizer: true", f"ddp: {{use_distributed_optimizer: {str(ddp).lower()}")
    assert resolve(read(tmp_path, text), world_size=8).use_distributed_optimizer is expect


@pytest.mark.parametrize("spelling", ["bf16", "torch.bfloat16", "bfloat16", "bf16-mixed",
                                      "{_target_: torch.bfloat16, _call_: false}"])
def test_dtype_spellings(tmp_path, spelling):
    text = FLAT.replace("optimizer: {optimizer: adam,",
                        f"optimizer: {{optimizer: adam, use_precision_aware_optimizer: true, exp_avg_dtype: {spelling},")
    L = resolve(read(tmp_path, text), world_size=8)
    assert L.exp_avg_dtype == "bf16"


@pytest.mark.parametrize("preset, bf16, fp16, grad_fp32", [
    ("bf16_mixed", True, False, True), ("bf16-mixed", True, False, True), ("fp16_mixed", False, True, False),
    ("fp16-mixed", False, True, False)])
def test_mixed_precision_presets(tmp_path, preset, bf16, fp16, grad_fp32):
    L = resolve(read(tmp_path, FLAT.replace("mixed_precision: bf16_mixed", f"mixed_precision: {preset}")), world_size=8)
    assert (L.bf16, L.fp16, L.accumulate_allreduce_grads_in_fp32) == (bf16, fp16, grad_fp32)


def test_fp8_preset_resolves(tmp_path):
    # bf16_with_fp8_current_scaling_mixed (Bridge 0.6.2): tensorwise, first/last layer BF16, FP8 primary weights
    L = resolve(read(tmp_path, FLAT.replace("bf16_mixed", "bf16_with_fp8_current_scaling_mixed")), world_size=8)
    assert (L.fp8, L.fp8_recipe, L.first_last_layers_bf16, L.fp8_param_gather) == ("hybrid", "tensorwise", True, True)


def test_unknown_preset_names_the_key(tmp_path):
    with pytest.raises(ConfigError, match="mixed_precision: unknown mixed-precision recipe"):
        read(tmp_path, FLAT.replace("bf16_mixed", "bf17_mixed"))


def test_mixed_precision_mapping_overwrites_grad_reduce(tmp_path):
    text = FLAT.replace("mixed_precision: bf16_mixed", "mixed_precision:\n  bf16: true\n  params_dtype: bf16\n"
                                                      "  grad_reduce_in_fp32: false")
    L = resolve(read(tmp_path, text), world_size=8)
    assert L.bf16 and L.grad_reduce_in_bf16 and not L.accumulate_allreduce_grads_in_fp32


def test_seq_length_mismatch_is_a_problem(tmp_path):
    raw = read(tmp_path, FLAT.replace("dataset: {seq_length: 1024}", "dataset: {seq_length: 2048}"))
    assert [p.key for p in raw.problems] == ["model.seq_length"]


def test_preset_vocab_is_not_padded_unless_should_pad_vocab(tmp_path):
    text = FLAT.replace("vocab_size: 32000\n", "vocab_size: 32001\n").replace(
        "tokenizer: {tokenizer_type: NullTokenizer, vocab_size: 32000}", "tokenizer: {tokenizer_type: HuggingFaceTokenizer}")
    assert resolve(read(tmp_path, text), world_size=8).padded_vocab_size == 32001
    padded = text.replace("  bf16: true\n", "  bf16: true\n  should_pad_vocab: true\n", 1)
    assert resolve(read(tmp_path, padded), world_size=8).padded_vocab_size == 32256


def test_unknown_keys_warn(tmp_path):
    raw = read(tmp_path, FLAT.replace("  bf16: true\n", "  bf16: true\n  moe_router_topk: 2\n  frobnicate: 1\n", 1)
               .replace("ddp: {", "ddp: {bogus_knob: 1, "))
    assert any("model.frobnicate" in w for w in raw.warnings)
    assert any("ddp.bogus_knob" in w for w in raw.warnings)
    assert not any("moe_router_topk" in w for w in raw.warnings)


def test_peft_is_refused(tmp_path):
    with pytest.raises(NotModelledError, match="peft"):
        read(tmp_path, FLAT + "peft:\n  _target_: megatron.bridge.peft.lora.LoRA\n  dim: 8\n")


def test_comm_overlap_data_parallel_size_gives_the_world(tmp_path):
    raw = read(tmp_path, FLAT + "comm_overlap: {tp_comm_overlap: true, data_parallel_size: 4}\n")
    assert raw.world_size == 8 and raw.args["tp_comm_overlap"] is True


def test_override_file_without_model_asks_for_the_recipe(tmp_path, capsys):
    p = tmp_path / "llama32_1b_pretrain.yaml"
    p.write_text("train: {global_batch_size: 8}\nmodel: {tensor_model_parallel_size: 1}\n")
    code = main(["estimate", "--config", str(p), "--gpus", "8"])
    err = capsys.readouterr().err
    assert code == 2 and "--model" in err and "suggests --model llama32_1b" in err and "Traceback" not in err


def test_set_and_bare_key_value_overrides(tmp_path):
    p = tmp_path / "override.yaml"
    p.write_text("train: {global_batch_size: 16}\n")
    ns = build_parser().parse_args(["estimate", "--config", str(p), "--model", "llama32_1b", "--gpus", "8",
                                    "--set", "model.tensor_model_parallel_size=2"])
    raw = load_raw(ns, ["train.micro_batch_size=2", "model.sequence_parallel=true", "--seq-length", "2048"])
    L = resolve(raw, world_size=8)
    assert (L.tp, L.micro_batch_size, L.global_batch_size, L.sequence_parallel, L.seq_length) == (2, 2, 16, True, 2048)
    assert raw.origin["micro_batch_size"] == "train.micro_batch_size"


def test_recipe_with_overrides_and_no_file():
    ns = build_parser().parse_args(["estimate", "--model", "llama3_8b", "--gpus", "16"])
    raw = load_raw(ns, ["model.context_parallel_size=1", "train.global_batch_size=64"])
    L = resolve(raw, world_size=16)
    assert (L.cp, L.dp, L.global_batch_size, L.seq_length, L.padded_vocab_size) == (1, 16, 64, 8192, 32000)


def test_overrides_are_refused_for_megatron_flag_configs(tmp_path, capsys):
    p = tmp_path / "run.sh"
    p.write_text("torchrun --nproc-per-node 8 pretrain_gpt.py --num-layers 2\n")
    code = main(["estimate", "--config", str(p), "--set", "model.x=1"])
    assert code == 2 and "KEY=VALUE overrides" in capsys.readouterr().err


def test_comm_overlap_tp_overlap_cfg_is_read(tmp_path):
    raw = read(tmp_path, FLAT + "comm_overlap:\n  tp_comm_overlap: true\n  data_parallel_size: 4\n  tp_comm_overlap_cfg:\n"
                                "    _target_: megatron.bridge.training.comm_overlap.TransformerLayerTPOverlapCfg\n"
                                "    fc2_fprop: {method: ring_exchange, num_sm: 1}\n    qkv_fprop: null\n")
    assert raw.args["tp_comm_overlap_cfg"]["fc2_fprop"]["method"] == "ring_exchange"


def test_comm_overlap_is_switched_off_without_sequence_parallelism(tmp_path):
    # Bridge 0.6.2 CommOverlapConfig._get_model_comm_overlap_cfgs: TP < 2 or no SP disables it with a warning
    text = FLAT.replace("sequence_parallel: true", "sequence_parallel: false")
    raw = read(tmp_path, text + "comm_overlap: {tp_comm_overlap: true, data_parallel_size: 4}\n")
    assert "tp_comm_overlap" not in raw.args and any("comm_overlap.tp_comm_overlap" in w for w in raw.warnings)
