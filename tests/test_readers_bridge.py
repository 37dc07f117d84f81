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



@pytest.mark.parametrize("graph, problem", [
    ("cuda_graph_impl: local", True),                                        # whole layers: Bridge refuses
    ("cuda_graph_impl: local\n  cuda_graph_modules: [attn]", True),         # scoped local graphs: Bridge refuses
    ("cuda_graph_impl: local\n  cuda_graph_scope: full_iteration", False),  # the full-iteration graph
    ("cuda_graph_impl: local\n  cuda_graph_scope: [{_target_: megatron.core.transformer.enums.CudaGraphScope, "
     "_name_: full_iteration, _call_: true}]", False),                      # the same as Bridge dumps the enum
    ("cuda_graph_impl: full_iteration", False),
    ("cuda_graph_impl: transformer_engine\n  cuda_graph_modules: [attn]", False),
])
def test_a_local_cuda_graph_of_layers_is_a_problem_as_bridge_refuses_it(tmp_path, graph, problem):
    # Megatron-Bridge 0.6.2 utils/cuda_graph.py validate_cuda_graph_configuration (ConfigContainer.validate):
    # 'supports model.cuda_graph_impl="local" only for full-iteration CUDA graphs' (tests/test_bridge_real.py runs it)
    raw = read(tmp_path, FLAT.replace("  bf16: true\n", f"  bf16: true\n  {graph}\n", 1))
    assert [p.key for p in raw.problems] == (["model.cuda_graph_impl"] if problem else [])


def test_the_deprecated_cuda_graph_scope_is_read_as_the_modules(tmp_path):
    # TransformerConfig.cuda_graph_scope, which megatron-core 0.19.2's cuda_graph_config.py migrates to
    # cuda_graph_modules (it was dropped: whole layers were estimated for a graph of attention only)
    def graphs(text):
        L = resolve(read(tmp_path, FLAT.replace("  bf16: true\n", f"  bf16: true\n  {text}\n", 1)), world_size=8)
        return L.cuda_graph_impl, tuple(L.cuda_graph_modules or ())
    assert graphs("cuda_graph_impl: transformer_engine\n  cuda_graph_scope: [attn]") == ("transformer_engine", ("attn",))
    assert graphs("cuda_graph_impl: transformer_engine\n  cuda_graph_modules: [attn]") == ("transformer_engine", ("attn",))
    assert graphs("cuda_graph_impl: transformer_engine") == ("transformer_engine", ())
    # megatron-core 0.19.2 TransformerConfig.__post_init__ asserts the modules empty under any cuda_graph_scope but
    # None ('full' included, which Bridge's Llama H100 recipes set)
    both = FLAT.replace("  bf16: true\n", "  bf16: true\n  cuda_graph_impl: transformer_engine\n  cuda_graph_scope: full\n"
                        "  cuda_graph_modules: [attn]\n", 1)
    assert [p.key for p in read(tmp_path, both).problems] == ["model.cuda_graph_modules"]


def test_the_full_iteration_graph_needs_bridges_nan_check_off(tmp_path):
    # Bridge 0.6.2 ConfigContainer.validate: 'check_for_nan_in_loss must be disabled when using full_iteration CUDA
    # graph. Set rerun_state_machine.check_for_nan_in_loss=False.' (RerunStateMachineConfig default: true)
    graph = FLAT.replace("  bf16: true\n", "  bf16: true\n  cuda_graph_impl: full_iteration\n", 1)
    with pytest.raises(ConfigError, match=r"^model.cuda_graph_impl: full_iteration needs "
                                          r"rerun_state_machine.check_for_nan_in_loss=false"):
        resolve(read(tmp_path, graph), world_size=8)
    off = graph + "rerun_state_machine: {check_for_nan_in_loss: false}\n"
    assert resolve(read(tmp_path, off), world_size=8).cuda_graph_impl == "full_iteration"


@pytest.mark.parametrize("override", ["comm_overlap.tp_comm_overlap=true", "+comm_overlap.tp_comm_overlap=true",
                                      "comm_overlap={tp_comm_overlap: true}"])
def test_an_override_that_makes_a_recipes_missing_comm_overlap_is_refused(override):
    # Bridge 0.6.2 recipes/common.py leave comm_overlap None: run_recipe.py stops on each form (Hydra's "Could not
    # override 'comm_overlap.tp_comm_overlap'"; the others: "'dict' object has no attribute 'data_parallel_size'" in
    # runtime_config_update), as tests/test_bridge_real.py sees
    from megatron_memguard.readers._common import parse_overrides
    from megatron_memguard.readers.bridge import read_bridge
    tp = ["model.tensor_model_parallel_size=2", "model.sequence_parallel=true"]
    with pytest.raises(ConfigError, match=r"^comm_overlap(\.tp_comm_overlap)?: recipe llama3_8b has no comm_overlap"):
        read_bridge({}, "recipe llama3_8b", parse_overrides([*tp, override]), recipe="llama3_8b")
    # a recipe with the section (llama3_70b: CommOverlapConfig(tp_comm_overlap=True)) takes the override
    raw = read_bridge({}, "recipe llama3_70b", parse_overrides(["comm_overlap.tp_comm_overlap=false"]), recipe="llama3_70b")
    assert resolve(raw, world_size=64).tp_comm_overlap is False

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


def test_peft_is_read(tmp_path):
    # (the estimate: tests/test_peft.py)
    raw = read(tmp_path, FLAT + "peft:\n  _target_: megatron.bridge.peft.lora.LoRA\n  dim: 8\n")
    assert (raw.args["peft_scheme"], raw.args["peft_dim"], raw.origin["peft_dim"]) == ("lora", 8, "peft.dim")
    with pytest.raises(NotModelledError, match="peft._target_"):
        read(tmp_path, FLAT + "peft:\n  _target_: megatron.bridge.peft.canonical_lora.CanonicalLoRA\n")


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


# --------------------------------------------------------------------------------------------------
# A typo in a ConfigContainer section is never silently ignored: an override is refused (Bridge's Hydra
# overrides run with the config in struct mode and raise, training/utils/omegaconf_utils.py 0.6.2), a file key
# is a warning (Bridge merges a YAML file without struct mode and skips the key with a logged warning)
# --------------------------------------------------------------------------------------------------
def _typo(name, known):
    """``name`` with its last two letters swapped (or a letter doubled), not itself a known field."""
    for cand in (name[:-2] + name[-1] + name[-2], name + name[-1], name[:-1]):
        if cand not in known:
            return cand
    raise AssertionError(name)


def _bridge_sections():
    from megatron_memguard.readers._common import bridge_sections
    return sorted(bridge_sections())


# Fields each section's class declares (read by hand in Megatron-Bridge 0.6.2 training/config.py,
# training/comm_overlap.py, training/mixed_precision.py, training/tokenizers/config.py and in
# megatron-core 0.19.2 megatron/training/config/*.py, optimizer/optimizer_config.py,
# distributed/distributed_data_parallel_config.py, datasets/gpt_dataset.py)
KNOWN_FIELD = {"train": "micro_batch_size", "dataset": "seq_length", "optimizer": "use_distributed_optimizer",
               "ddp": "overlap_grad_reduce", "scheduler": "lr_warmup_iters", "checkpoint": "save_interval",
               "logger": "log_interval", "tokenizer": "tokenizer_type", "mixed_precision": "grad_reduce_in_fp32",
               "comm_overlap": "tp_comm_overlap", "profiling": "use_pytorch_profiler", "rng": "seed",
               "dist": "distributed_backend", "validation": "eval_iters"}


def test_the_field_list_has_every_section_memguard_reads_with_known_fields():
    from megatron_memguard.readers._common import bridge_sections
    S = bridge_sections()
    for sec, name in KNOWN_FIELD.items():
        assert name in S[sec][1], (sec, name)
    assert S["train"][0] == {"TrainingConfig"} and {"GPTDatasetConfig", "MockGPTDatasetConfig"} <= S["dataset"][0]
    assert "model" not in S and "peft" not in S   # read by map_mcore_fields / by readers/bridge.py _peft


@pytest.mark.parametrize("sec", _bridge_sections())
def test_an_override_typo_in_each_section_is_refused_with_the_key_named(sec):
    from megatron_memguard.readers._common import bridge_sections, parse_overrides
    from megatron_memguard.readers.bridge import read_bridge

    known = bridge_sections()[sec][1]
    name = KNOWN_FIELD.get(sec, sorted(n for n in known if not n.startswith("_"))[0])
    typo = _typo(name, known)
    # (the recipe's mixed_precision is the preset name bf16_mixed, whose fields no override sets: a file's
    # MixedPrecisionConfig mapping replaces it here)
    doc = {"mixed_precision": {"bf16": True}} if sec == "mixed_precision" else {}
    with pytest.raises(ConfigError) as e:
        read_bridge(doc, "recipe llama32_1b", parse_overrides([f"{sec}.{typo}=4"]), recipe="llama32_1b")
    msg = str(e.value)
    assert msg.startswith(f"{sec}.{typo}: not a field of Megatron-Bridge's {sec} section") and "\n" not in msg
    assert "did you mean " in msg


@pytest.mark.parametrize("override, hint", [
    ("train.micro_batchsize=4", "did you mean train.micro_batch_size?"),
    ("train.global_batch_sise=512", "did you mean train.global_batch_size?"),
    ("dataset.seq_lenght=4096", "did you mean dataset.seq_length?"),
    ("optimizer.use_distributed_optimiser=true", "did you mean optimizer.use_distributed_optimizer?"),
    ("trian.micro_batch_size=4", "did you mean train?"),
])
def test_a_memory_changing_typo_is_refused_with_a_hint(override, hint):
    ns = build_parser().parse_args(["estimate", "--model", "llama3_8b", "--gpus", "16"])
    with pytest.raises(ConfigError, match="Megatron-Bridge refuses this override") as e:
        load_raw(ns, [override])
    assert str(e.value).endswith(f"({hint})")


def test_a_whole_section_override_is_checked_too():
    from megatron_memguard.readers._common import parse_overrides
    from megatron_memguard.readers.bridge import read_bridge

    with pytest.raises(ConfigError, match=r"^train\.micro_batchsize: .*did you mean train\.micro_batch_size"):
        read_bridge({}, "recipe llama32_1b", parse_overrides(["train={micro_batchsize: 4}"]), recipe="llama32_1b")


def test_a_file_typo_warns_with_a_hint_and_the_value_is_not_used(tmp_path):
    raw = read(tmp_path, FLAT.replace("train: {micro_batch_size: 2,", "train: {micro_batchsize: 4, micro_batch_size: 2,")
               + "logger: {log_intervall: 10}\n")
    assert ("train.micro_batchsize: not a field of Megatron-Bridge's train section (TrainingConfig); ignored "
            "(did you mean train.micro_batch_size?)") in raw.warnings
    assert any(w.startswith("logger.log_intervall: ") and "logger.log_interval?" in w for w in raw.warnings)
    assert resolve(raw, world_size=8).micro_batch_size == 2


def test_a_dataset_class_of_the_users_own_is_not_checked(tmp_path):
    """A DatasetProvider subclass of the user's: its fields are not in the list, so none is reported; Bridge's
    own MockGPTDatasetConfig is checked."""
    own = read(tmp_path, FLAT.replace("dataset: {seq_length: 1024}",
                                      "dataset: {_target_: my_pkg.data.MyDatasetConfig, seq_length: 1024, shards: 4}"))
    assert not any("dataset." in w for w in own.warnings)
    mock = read(tmp_path, FLAT.replace(
        "dataset: {seq_length: 1024}",
        "dataset: {_target_: megatron.bridge.training.config.MockGPTDatasetConfig, seq_length: 1024, shards: 4}"))
    assert any(w.startswith("dataset.shards: not a field") for w in mock.warnings)


def test_known_keys_of_every_section_give_no_warning(tmp_path):
    raw = read(tmp_path, FLAT + "scheduler: {lr_warmup_iters: 10}\ncheckpoint: {save_interval: 100}\n"
               "logger: {log_interval: 1}\nrng: {seed: 1234}\nprofiling: {use_pytorch_profiler: false}\n")
    assert not any("not a field" in w or "not a Megatron-Bridge" in w for w in raw.warnings)


def test_a_dump_s_private_container_field_is_not_a_typo(tmp_path):
    """ConfigContainer._checkpoint_load_required (Bridge 0.6.2 training/config.py) is in every to_yaml dump."""
    raw = read(tmp_path, FLAT + "_checkpoint_load_required: false\n")
    assert not any("_checkpoint_load_required" in w for w in raw.warnings)
    raw = read(tmp_path, FLAT + "mixed_precison: bf16_mixed\n")
    assert ("mixed_precison: not a Megatron-Bridge ConfigContainer section; ignored (did you mean mixed_precision?)"
            in raw.warnings)


def test_a_hydra_plus_override_of_an_unknown_key_warns():
    """+key / ++key: Hydra adds the key, then Bridge skips it with a warning (tests/test_bridge_real.py)."""
    from megatron_memguard.readers._common import parse_overrides
    from megatron_memguard.readers.bridge import read_bridge

    for tok in ("+train.micro_batchsize=4", "++train.micro_batchsize=4"):
        raw = read_bridge({}, "recipe llama32_1b", parse_overrides([tok]), recipe="llama32_1b")
        assert any(w.startswith("train.micro_batchsize: ") and "did you mean train.micro_batch_size?" in w
                   for w in raw.warnings)
    raw = read_bridge({}, "recipe llama32_1b", parse_overrides(["++train.micro_batch_size=4"]), recipe="llama32_1b")
    assert raw.args["micro_batch_size"] == 4 and raw.warnings == read_bridge({}, "recipe llama32_1b", [],
                                                                             recipe="llama32_1b").warnings


@pytest.mark.parametrize("override, hint", [
    ("model.num_layer=4", "did you mean model.num_layers?"),
    ("model.tensor_model_paralel_size=2", "did you mean model.tensor_model_parallel_size?"),
    ("model.recompute_granularty=full", "did you mean model.recompute_granularity?"),
])
def test_a_model_override_typo_is_refused_as_bridge_refuses_it(override, hint):
    """Bridge 0.6.2 (omegaconf_utils.py, Hydra in struct mode) raises OverridesError "Could not override
    'model.num_layer'" on a recipe (tests/test_bridge_real.py): refused with the key named, as the other sections."""
    ns = build_parser().parse_args(["estimate", "--model", "llama3_8b", "--gpus", "16"])
    with pytest.raises(ConfigError, match="Megatron-Bridge refuses this override") as e:
        load_raw(ns, [override])
    msg = str(e.value)
    assert msg.startswith(override.split("=")[0] + ": not a field of Megatron-Bridge's model (GPTModelProvider)")
    assert msg.endswith(f"({hint})") and "\n" not in msg


def test_a_model_file_typo_warns_and_other_providers_keep_the_old_warning(tmp_path):
    """A file's unknown model key is skipped by Bridge with a warning ("not found in config object GPTModelProvider.
    Skipping."): a warning with the hint; a provider whose own fields memguard does not list (Gemma 2 adds
    fields of its own) keeps the plain warning, and a +model.KEY override is a warning too."""
    from megatron_memguard.readers._common import parse_overrides
    from megatron_memguard.readers.bridge import read_bridge

    gpt = "  _target_: megatron.bridge.models.gpt_provider.GPTModelProvider\n"
    raw = read(tmp_path, FLAT.replace(gpt, gpt + "  num_layer: 4\n", 1))
    assert ("model.num_layer: not a field of Megatron-Bridge's model (GPTModelProvider); ignored "
            "(did you mean model.num_layers?)") in raw.warnings
    raw = read_bridge({}, "recipe llama32_1b", parse_overrides(["+model.num_layer=4"]), recipe="llama32_1b")
    assert any(w.startswith("model.num_layer: not a field") and "model.num_layers?" in w for w in raw.warnings)
    # (Gemma 2's own softcapping fields are refused instead: test_a_gemma2_model_is_refused_naming_the_key)
    other = read(tmp_path, FLAT.replace(gpt, "  _target_: my_models.MyProvider\n  frobnicate: 1\n", 1))
    assert "model.frobnicate: not a megatron-core / Megatron-Bridge model setting; ignored" in other.warnings


@pytest.mark.parametrize("recipe, extra, problem", [
    ("llama3_8b", [], True),                                          # dense: MLP (gpt_layer_specs, core 0.19.2)
    ("llama3_8b", ["model.use_transformer_engine_op_fuser=true"], False),   # dense: TEFusedMLP, no MLP.forward
    ("qwen3_30b_a3b", [], False),                                     # every layer MoE, grouped GEMM: TEGroupedMLP
    ("qwen3_30b_a3b", ["model.moe_grouped_gemm=false"], True),        # SequentialMLP: an MLP per expert
    ("qwen3_30b_a3b", ["model.moe_layer_freq=2"], True),              # its dense layers: MLP
])
def test_add_bias_linear_is_true_where_mlp_forward_runs(recipe, extra, problem):
    """MLP.forward asserts ``add_bias_linear is True`` on the fused bias-GeLU path (megatron-core 0.19.2 mlp.py:306;
    against real Bridge: tests/test_bridge_real.py); memguard names the key only where the model runs MLP.forward."""
    from megatron_memguard.readers._common import parse_overrides
    from megatron_memguard.readers.bridge import read_bridge

    overrides = ["model.activation_func=gelu", "model.gated_linear_unit=false", "model.bias_activation_fusion=true",
                 "model.add_bias_linear=1", *extra]
    raw = read_bridge({}, f"recipe {recipe}", parse_overrides(overrides), recipe=recipe)
    assert [p.key for p in raw.problems] == (["model.add_bias_linear"] if problem else []), raw.problems


# Gemma 2 (Megatron-Bridge 0.6.2 models/gemma/gemma2_provider.py): Gemma2ModelProvider defaults to
# attn_logit_softcapping 50.0 and final_logit_softcapping 30.0; its default gemma2_layer_spec brings
# Gemma2FlexDotProductAttention and TERowParallelLinearLayerNorm, and provide() makes the output layer a
# Gemma2OutputLayer (``if not scale: return logits``): read, each to its layout field
GEMMA2 = FLAT.replace("megatron.bridge.models.gpt_provider.GPTModelProvider",
                      "megatron.bridge.models.gemma.gemma2_provider.Gemma2ModelProvider", 1)
_GEMMA2_SPEC = ("  transformer_layer_spec:\n    _target_: megatron.bridge.models.gemma.gemma2_provider.gemma2_layer_spec\n"
                "    _call_: false\n")


@pytest.mark.parametrize("extra, flex, cap", [
    ("  attn_logit_softcapping: 50.0\n  final_logit_softcapping: 30.0\n", True, 30.0),
    ("", True, 30.0),                                                     # the provider's default final softcap
    ("  attn_logit_softcapping: 0.0\n  final_logit_softcapping: null\n" + _GEMMA2_SPEC, True, 0.0),
    # a GPT layer spec under the provider: TE's attention, no post-projection norms; the output layer still softcaps
    ("  final_logit_softcapping: 20.0\n  transformer_layer_spec:\n    _target_: "
     "megatron.core.models.gpt.gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec\n    _call_: false\n",
     False, 20.0),
])
def test_a_gemma2_model_is_read(tmp_path, extra, flex, cap):
    L = resolve(read(tmp_path, GEMMA2.replace("  bf16: true\n", "  bf16: true\n" + extra, 1)), world_size=8)
    assert (L.gemma2_attention, L.post_proj_norms, L.final_logit_softcapping) == (flex, flex, cap)


@pytest.mark.parametrize("extra, overrides, key, error", [
    # Gemma2DotProductAttention.__init__ raises on CP > 1
    ("", ["model.context_parallel_size=2"], "model.context_parallel_size", ConfigError),
    # a mask from the data loader, or attention dropout: the unfused fallback (not modelled)
    ("", ["dataset.skip_getting_attention_mask_from_dataset=false"],
     "dataset.skip_getting_attention_mask_from_dataset", NotModelledError),
    ("  attention_dropout: 0.1\n", [], "model.attention_dropout", NotModelledError),
])
def test_gemma2_attention_refusals_name_the_key(tmp_path, extra, overrides, key, error):
    with pytest.raises(error, match=rf"{key}: "):
        resolve(read(tmp_path, GEMMA2.replace("  bf16: true\n", "  bf16: true\n" + extra, 1), overrides=overrides),
                world_size=16)


@pytest.mark.parametrize("packing", ["enable_offline_packing", "enable_in_batch_packing"])
def test_gemma2_with_packed_sequences_is_a_problem(tmp_path, packing):
    # ConfigContainer.validate (Bridge 0.6.2 training/config.py): either packing makes the batch THD, and the
    # Gemma 2 attention raises on packed_seq_params (gemma2_provider.py)
    text = GEMMA2.replace("dataset: {seq_length: 1024}", f"dataset: {{seq_length: 1024, {packing}: true}}", 1)
    assert [p.key for p in read(tmp_path, text).problems] == [f"dataset.{packing}"]
    assert read(tmp_path, text.replace(": true}", ": false}", 1)).problems == ()
    # a GPT (TE attention) takes them
    assert read(tmp_path, FLAT.replace("dataset: {seq_length: 1024}", f"dataset: {{seq_length: 1024, {packing}: true}}",
                                       1)).problems == ()


def test_gemma2_layer_spec_needs_its_provider(tmp_path):
    # under GPTModelProvider Gemma2DotProductAttention's config.query_pre_attn_scalar does not exist
    raw = read(tmp_path, FLAT.replace("  bf16: true\n", "  bf16: true\n" + _GEMMA2_SPEC, 1))
    assert [p.key for p in raw.problems] == ["model.transformer_layer_spec"]
    assert "Gemma2ModelProvider" in str(raw.problems[0])


def test_a_softcapping_key_under_gpt_provider_is_skipped_as_bridge_skips_it(tmp_path):
    # GPTModelProvider has no such field: Bridge's _apply_overrides skips a file's key with a warning (the estimate
    # is then a GPT's, as Bridge's model is) and Hydra refuses it as an override
    raw = read(tmp_path, FLAT.replace("  bf16: true\n", "  bf16: true\n  attn_logit_softcapping: 50.0\n", 1))
    assert any(w.startswith("model.attn_logit_softcapping: not a field") for w in raw.warnings)
    with pytest.raises(ConfigError, match=r"^model\.attn_logit_softcapping: not a field"):
        read(tmp_path, FLAT, overrides=["model.attn_logit_softcapping=50.0"])


# Gemma 3 (Megatron-Bridge 0.6.2 models/gemma/gemma3_provider.py): gemma3_layer_spec's linear_proj and linear_fc2 are
# TERowParallelLinearLayerNorm (models/common/te_layers.py), an RMSNorm on each projection's output, and the provider's
# Gemma3RotaryEmbedding caches two tables and their stack: read as post_proj_norms / rotary_tables 4. Gemma 3 VL and Gemma 4
# (gemma4_provider.py, modeling_gemma4.py) have layers of their own; Gemma 4's final_logit_softcapping field
# (default 30.0) is one of them, so its refusal names Gemma 4, not Gemma 2's softcapping.
_GEMMA = "megatron.bridge.models.gemma."
_SPEC = "  transformer_layer_spec:\n    _target_: {}\n    _call_: false\n"
_G3 = _GEMMA + "gemma3_provider.Gemma3ModelProvider"
_G3_FIELDS = ("  window_size: 512\n  interleaved_attn_pattern:\n  - 5\n  - 1\n  is_vision_language: false\n"
              "  rotary_base:\n  - 10000\n  - 1000000\n")


@pytest.mark.parametrize("target, extra, post, rope", [
    (_G3, _SPEC.format(_GEMMA + "gemma3_provider.gemma3_layer_spec") + _G3_FIELDS, True, 4),
    (_G3, _G3_FIELDS, True, 4),      # the provider's default spec is gemma3_layer_spec
    # a GPT provider given Gemma 3's layer spec builds Gemma 3's layers, with megatron-core's one rotary table
    ("megatron.bridge.models.gpt_provider.GPTModelProvider",
     _SPEC.format(_GEMMA + "gemma3_provider.gemma3_layer_spec"), True, 1),
])
def test_a_gemma3_model_is_read_with_its_post_norms(tmp_path, target, extra, post, rope):
    text = FLAT.replace("megatron.bridge.models.gpt_provider.GPTModelProvider", target, 1)
    raw = read(tmp_path, text.replace("  bf16: true\n", "  bf16: true\n" + extra, 1))
    assert raw.args["post_proj_norms"] is post and raw.args.get("rotary_tables", 1) == rope
    # Gemma3ModelProvider's own fields are known (no warning); a local layer's window is (window_size - 1, 0)
    assert not any(w.startswith(("model.interleaved_attn_pattern", "model.is_vision_language"))
                   for w in raw.warnings)
    if target == _G3:
        assert raw.args["window_size"] == [511, 0]


@pytest.mark.parametrize("target, extra, key, what", [
    (_G3, "  is_vision_language: true\n", "model.is_vision_language", "Gemma 3 VL's vision encoder"),
    ("megatron.bridge.models.gemma_vl.gemma3_vl_provider.Gemma3VLModelProvider", "", "model._target_",
     "Gemma 3 VL's vision encoder"),
    (_GEMMA + "gemma4_provider.Gemma4DenseProvider", "  final_logit_softcapping: 30.0\n", "model._target_",
     "Gemma 4's own layers"),
    (_GEMMA + "gemma4_provider.Gemma4ModelProvider", "  final_logit_softcapping: 30.0\n  transformer_layer_spec:\n"
     "    _target_: " + _GEMMA + "modeling_gemma4._gemma4_block_spec\n    _partial_: true\n",
     "model.transformer_layer_spec", "Gemma 4's own layers"),
])
def test_a_gemma3_vl_or_gemma4_model_is_refused_naming_the_key(tmp_path, target, extra, key, what):
    text = FLAT.replace("megatron.bridge.models.gpt_provider.GPTModelProvider", target, 1)
    with pytest.raises(NotModelledError, match=rf"^{key}: {what}"):
        read(tmp_path, text.replace("  bf16: true\n", "  bf16: true\n" + extra, 1))


def test_gemma_1_stays_a_gpt(tmp_path):
    # GemmaModelProvider (models/gemma/gemma_provider.py) is a GPT whose embedding is scaled by sqrt(h) (modules.py
    # EmbeddingScalingMixin, no tensor saved): read as before, its fields warned about, not refused
    raw = read(tmp_path, FLAT.replace("megatron.bridge.models.gpt_provider.GPTModelProvider",
                                      _GEMMA + "gemma_provider.GemmaModelProvider", 1))
    assert raw.args["num_layers"] == SHAPE["num_layers"]


@pytest.mark.parametrize("recipe, what", [
    ("gemma3_vl_4b_sft_1gpu_h100_bf16_config", "vision-language models .*gemma3_vl_provider.py"),
    ("gemma4_e4b_pretrain_2gpu_h100_bf16_config", "Gemma 4's own layers"),
    ("gemma4_vl_26b_sft_8gpu_h100_bf16_config", "vision-language models .*Gemma 4's own layers"),
])
def test_the_gemma3_and_gemma4_recipes_are_refused_for_the_same_reason_as_their_dump(recipe, what):
    # the recipe function names of Bridge 0.6.2 recipes/gemma/h100, gemma3_vl, gemma4_vl
    from megatron_memguard.readers.models import read_model

    with pytest.raises(NotModelledError, match=rf"^--model: the Megatron-Bridge recipe '{recipe}' \({what}.*; its "
                       r"run_config.yaml dump is refused for the same reason\)"):
        read_model(recipe)


@pytest.mark.parametrize("name", ["gemma3_1b_pretrain_config", "gemma3_1b_pretrain_1gpu_h100_bf16_config"])
def test_the_gemma3_pretraining_recipe_is_read_by_name(name):
    # Bridge 0.6.2 recipes/gemma/h100/gemma3.py gemma3_1b_pretrain_1gpu_h100_bf16_config (recipes/gemma/gemma3.py
    # aliases it as gemma3_1b_pretrain_config): Gemma3ModelProvider(num_layers=26, hidden_size=1152, ...,
    # window_size=512, seq_length=32768), GBS 512, MBS 1, NullTokenizer of DEFAULT_NULL_TOKENIZER_VOCAB_SIZE 32000
    from megatron_memguard.readers.models import read_model
    from megatron_memguard.resolve import resolve

    raw = read_model(name)
    L = resolve(raw, world_size=1)
    assert (L.num_layers, L.hidden_size, L.ffn_hidden_size, L.num_attention_heads, L.num_query_groups, L.kv_channels) == \
        (26, 1152, 6912, 4, 1, 256)
    assert (L.seq_length, L.micro_batch_size, L.global_batch_size, L.padded_vocab_size) == (32768, 1, 512, 32000)
    # the provider's gemma3_layer_spec and Gemma3RotaryEmbedding; the local window (512 - 1, 0)
    assert L.post_proj_norms and L.rotary_tables == 4 and L.qk_layernorm and raw.args["window_size"] == [511, 0]


@pytest.mark.parametrize("name", ["gemma3_1b_sft_config", "gemma3_1b_peft_1gpu_h100_bf16_config"])
def test_a_gemma3_finetuning_recipe_points_to_its_run_config(name):
    # its layers are modelled, but the recipe reads google/gemma-3-1b-pt's config.json: the dump can be read (above)
    from megatron_memguard.readers.models import read_model

    with pytest.raises(NotModelledError, match=rf"^--model: the Megatron-Bridge recipe '{name}' \(a Gemma 3 recipe memguard "
                       r"has no entry for .*; its run_config.yaml dump can be read with --config\)"):
        read_model(name)


# Bridge 0.6.2 recipes/gemma/h100/gemma2.py (recipes/gemma/gemma2.py aliases each as gemma2_*_pretrain_config): the
# provider AutoBridge makes of google/gemma-2-*'s config.json (Gemma2Bridge.provider_bridge), seq 4096, TE, MBS 2 /
# GBS 32 (_pretrain_common), TP 2 / 8 / 8, PP 1 / 1 / 2
@pytest.mark.parametrize("name, gpus, shape, tp, pp", [
    ("gemma2_2b_pretrain_2gpu_h100_bf16_config", 2, (26, 2304, 9216, 8, 4, 256), 2, 1),
    ("gemma2_9b_pretrain_config", 8, (42, 3584, 14336, 16, 8, 256), 8, 1),
    ("gemma2_27b_pretrain_16gpu_h100_bf16_config", 16, (46, 4608, 36864, 32, 16, 128), 8, 2),
])
def test_the_gemma2_pretraining_recipes_are_read_by_name(name, gpus, shape, tp, pp):
    from megatron_memguard.readers.models import read_model

    L = resolve(read_model(name), world_size=gpus)
    assert (L.num_layers, L.hidden_size, L.ffn_hidden_size, L.num_attention_heads, L.num_query_groups,
            L.kv_channels) == shape
    assert (L.tp, L.pp, L.seq_length, L.micro_batch_size, L.global_batch_size, L.padded_vocab_size) == \
        (tp, pp, 4096, 2, 32, 256_000)
    # gemma2_layer_spec (FlexAttention, post-projection norms), Gemma2OutputLayer's 30.0, no dropout, no mask
    assert (L.gemma2_attention, L.post_proj_norms, L.final_logit_softcapping) == (True, True, 30.0)
    assert (L.attention_dropout, L.hidden_dropout, L.create_attention_mask_in_dataloader) == (0.0, 0.0, False)


def test_a_gemma2_finetuning_recipe_points_to_its_run_config():
    from megatron_memguard.readers.models import read_model

    with pytest.raises(NotModelledError, match=r"^--model: the Megatron-Bridge recipe 'gemma2_9b_sft_config' \(a Gemma 2 "
                       r"recipe memguard has no entry for .*; its run_config.yaml dump can be read with --config\)"):
        read_model("gemma2_9b_sft_config")
