"""Megatron-Bridge 0.6.2 mixture-of-experts recipes (`--model RECIPE`, run_recipe.py command lines) and the
MoE keys of Bridge ConfigContainer YAML. tests/test_bridge_real.py checks every recipe against the real
Bridge function (same resolved layout) and a real run_config.yaml dump field by field; here, without
Bridge: parameter counts against transformers' counts, the recipes' own settings as the recipe source
writes them, and the readers' handling of what Bridge dumps."""
import json
import os

import pytest
import yaml

from megatron_memguard.cli.main import main
from megatron_memguard.errors import ConfigError, NotModelledError
from megatron_memguard.estimator.params import total_parameters
from megatron_memguard.readers._common import layout_text, parse_overrides
from megatron_memguard.readers.bridge import read_bridge
from megatron_memguard.readers.models import find_model, find_recipe, presets, read_model
from megatron_memguard.readers.run_recipe import read_run_recipe
from megatron_memguard.resolve import resolve

HERE = os.path.dirname(os.path.abspath(__file__))
# transformers' parameter counts of the published config.json files (tests/data/moe_reference_counts.json)
REF = json.load(open(os.path.join(HERE, "data", "moe_reference_counts.json")))["models"]


def recipe(key, *overrides, world=None):
    raw = read_bridge({}, f"recipe {key}", parse_overrides(list(overrides)), recipe=key)
    return resolve(raw, world_size=world or presets()["recipes"][key]["gpus"])


# The model a recipe trains, as transformers counts it from the published config.json: the recipe's
# NullTokenizer vocabulary replaced by the model's own (padded to make_vocab_size_divisible_by x TP, so
# TP 1), without the MTP module transformers does not build, with the all-to-all dispatcher (the
# count does not depend on it; HybridEP is refused).
SAME_MODEL = [
    ("qwen3_30b_a3b_8gpu", "qwen3-30b-a3b", []),
    ("qwen3_30b_a3b", "qwen3-30b-a3b", []),
    ("qwen3_235b_a22b", "qwen3-235b-a22b", []),
    ("deepseek_v2_lite", "deepseek-v2-lite", ["tokenizer.vocab_size=102400"]),
    ("deepseek_v2", "deepseek-v2", ["tokenizer.vocab_size=102400"]),
    ("deepseek_v3", "deepseek-v3", ["tokenizer.vocab_size=129280", "model.mtp_num_layers=null",
                                    "model.pipeline_model_parallel_layout=null", "model.pipeline_model_parallel_size=1"]),
    ("deepseek_v3_32nodes", "deepseek-v3", ["tokenizer.vocab_size=129280", "model.mtp_num_layers=null",
                                            "model.pipeline_model_parallel_layout=null",
                                            "model.pipeline_model_parallel_size=1"]),
]


@pytest.mark.parametrize("key, model, extra", SAME_MODEL)
def test_recipe_parameter_count_is_transformers_count_of_the_model(key, model, extra):
    L = recipe(key, "model.tensor_model_parallel_size=1", "model.sequence_parallel=false",
               "model.moe_token_dispatcher_type=alltoall", *extra)
    assert total_parameters(L) == REF[model]["num_parameters"]   # DeepSeek-V3: 671,026,404,352


def test_olmoe_count_is_transformers_less_the_full_width_qk_norms():
    # 6,919,161,856: transformers 5.12.1 OlmoeForCausalLM on the meta device with OlMoEModelProvider's
    # shape (vocab 50304, hidden 2048, 16 layers, 64 experts of 1024, 16 heads); OLMoE's q/k norms span
    # the 2048-wide projections, megatron-core's per-head ones 128: 16 x 2 x (2048 - 128) = 61,440 fewer.
    assert total_parameters(recipe("olmoe_7b")) == 6_919_161_856 - 16 * 2 * (2048 - 128)
    assert any("61,440" in w for w in read_model("olmoe_7b").warnings)


def test_recipes_keep_their_own_layout_and_precision():
    # recipes/qwen/h100/qwen3_moe.py qwen3_30b_a3b_pretrain_8gpu_h100_bf16_config: TP 4, PP 2, EP 4, SP,
    # full uniform recompute of 1 layer, flex dispatcher with DeepEP (apply_flex_dispatcher_backend),
    # _pretrain_common's MBS 2 / GBS 32 and bf16_mixed with fp32 gradient reduction
    L = recipe("qwen3_30b_a3b_8gpu")
    m = L.moe
    assert (L.tensor_model_parallel_size, L.pipeline_model_parallel_size, m.expert_model_parallel_size,
            m.expert_tensor_parallel_size, L.sequence_parallel) == (4, 2, 4, 1, True)
    assert (L.recompute_granularity, L.recompute_method, L.recompute_num_layers) == ("full", "uniform", 1)
    assert (m.moe_token_dispatcher_type, m.moe_grouped_gemm, m.moe_permute_fusion, m.num_experts,
            m.moe_router_topk, m.moe_ffn_hidden_size) == ("flex", True, True, 128, 8, 768)
    assert (L.micro_batch_size, L.global_batch_size, L.seq_length, L.bf16) == (2, 32, 4096, True)
    assert L.accumulate_allreduce_grads_in_fp32
    # recipes/deepseek/h100/deepseek_v3.py: TP 2, PP 16 with set_deepseek_v3_pipeline_model_parallel_layout's
    # (16, 1) layout (4 layers a stage, the embedding first, 1 layer + MTP + loss last), EP 64, MTP 1,
    # bf16 gradients and Adam moments with the precision-aware optimizer; HybridEP is refused by name
    with pytest.raises(NotModelledError, match="hybridep"):
        recipe("deepseek_v3")
    L = recipe("deepseek_v3", "model.moe_token_dispatcher_type=alltoall")
    assert (L.tensor_model_parallel_size, L.pipeline_model_parallel_size, L.moe.expert_model_parallel_size,
            L.mtp_num_layers) == (2, 16, 64, 1)
    assert L.pipeline_model_parallel_layout == "Etttt|" + "tttt|" * 14 + "tmL"
    assert (L.exp_avg_dtype, L.main_grads_dtype, L.main_params_dtype) == ("bf16", "bf16", "fp32")
    assert L.moe.moe_layer_pattern == (False,) * 3 + (True,) * 58
    # NullTokenizer 32000 padded to make_vocab_size_divisible_by 1280 (DeepSeekV3Bridge) x TP 2 = 33280
    assert L.padded_vocab_size == 33280
    # recipes/deepseek/h100/deepseek_v2.py: the flex backend is named but never applied: all-to-all
    L = recipe("deepseek_v2_lite")
    assert (L.moe.moe_token_dispatcher_type, L.moe.expert_model_parallel_size, L.moe.moe_shared_expert_intermediate_size,
            L.moe.moe_router_dtype) == ("alltoall", 8, 2 * 1408, "fp32")


def test_recipe_names_and_model_names_stay_apart():
    assert find_recipe("qwen3_30b_a3b") == "qwen3_30b_a3b"                          # Bridge's spelling
    assert find_recipe("qwen3_30b_a3b_pretrain_config") == "qwen3_30b_a3b"          # its function
    assert find_recipe("qwen3_30b_a3b_pretrain_16gpu_h100_bf16_config") == "qwen3_30b_a3b"
    assert find_recipe("qwen3_30b_a3b_pretrain_8gpu_h100_bf16_config") == "qwen3_30b_a3b_8gpu"
    assert find_recipe("Qwen/Qwen3-30B-A3B") is None and find_model("Qwen/Qwen3-30B-A3B") == "qwen3-30b-a3b"
    assert find_recipe("deepseek-v3") is None and find_recipe("deepseek_v3") == "deepseek_v3"
    assert "context_parallel_size" not in read_model("deepseek-v3").args          # the preset: shape only


def test_every_recipe_function_is_a_bridge_export_once():
    names = [f for r in presets()["recipes"].values() for f in r["functions"]]
    assert len(names) == len(set(names))
    assert all("_pretrain_" in f or "_peft_" in f for f in names)    # (the Llama PEFT recipes: run_recipe --mode lora)


@pytest.mark.parametrize("name, why", [
    ("kimi_k2_pretrain_config", "Kimi-K2"),
    ("qwen3_next_80b_a3b_pretrain_config", "Gated DeltaNet"),
    ("deepseek_v4_flash_pretrain_config", "DeepSeek-V4"),
    ("nemotron_3_nano_pretrain_config", "Mamba"),
    ("nemotronh_47b_pretrain_config", "Nemotron-H"),           # dense hybrid Mamba (recipes/nemotronh/h100; 8b has an entry)
    ("nemotron_nano_9b_v2_pretrain_config", "Nemotron Nano v2"),
    ("gpt_oss_20b_pretrain_config", "gpt-oss-20b"),
    ("qwen3_30b_a3b_pretrain_8gpu_gb200_fp8mx_functional_config", "HybridEP"),
])
def test_recipes_memguard_lacks_are_refused_with_the_reason(name, why, capsys):
    assert main(["estimate", "--model", name, "--gpus", "8"]) == 2
    err = capsys.readouterr().err
    assert f"the Megatron-Bridge recipe '{name}'" in err and why in err and "not modelled" in err
    with pytest.raises(NotModelledError, match=why):
        read_run_recipe(["--recipe", name])


def test_missing_world_size_suggests_the_recipes_gpus(capsys):
    assert main(["estimate", "--model", "deepseek_v2_lite"]) == 2
    assert "--gpus 8 (the GPUs recipe deepseek_v2_lite is written for)" in capsys.readouterr().err
    assert main(["estimate", "--model", "deepseek_v2_lite", "--gpus", "8"]) in (0, 1)


def test_run_recipe_command_line_of_a_moe_recipe():
    rr, raw = read_run_recipe(["--recipe", "qwen3_235b_a22b_pretrain_config", "-ep", "4", "-mb", "1",
                               "model.moe_router_dtype=fp32"])
    L = resolve(raw, world_size=256)
    assert (L.moe.expert_model_parallel_size, L.moe.moe_router_dtype, L.context_parallel_size) == (4, "fp32", 2)
    # account_for_embedding/loss_in_pipeline_split: 94 layers + 2 slots over PP 16 = 6 a stage
    assert (L.account_for_embedding_in_pipeline_split, L.account_for_loss_in_pipeline_split) == (True, True)


# --------------------------------------------------------------------------------------------------
# What Bridge dumps of a MoE model (ConfigContainer.to_yaml of the recipes, Megatron-Bridge 0.6.2)
# --------------------------------------------------------------------------------------------------
def test_list_form_pipeline_layout_is_megatrons_string_form():
    # megatron-core PipelineParallelLayerLayout takes a list of stages of LayerType names
    # (core 0.16.1 / 0.19.2 transformer/pipeline_parallel_layer_layout.py): E, t, m, L in the string form
    stages = [["embedding", "decoder", "decoder"], ["decoder", "decoder", "mtp", "loss"]]
    assert layout_text(stages, "model.pipeline_model_parallel_layout") == "Ett|ttmL"
    assert layout_text("Ett|ttmL", "k") == "Ett|ttmL"
    with pytest.raises(ConfigError, match="model.pipeline_model_parallel_layout: unknown layer type 'encoder'"):
        layout_text([["embedding", "encoder"]], "model.pipeline_model_parallel_layout")
    with pytest.raises(ConfigError, match="a list of lists"):
        layout_text(["Ett"], "model.pipeline_model_parallel_layout")


def _dump(tmp_path, model, **sections):
    doc = {"_target_": "megatron.bridge.training.config.ConfigContainer", "model": model,
           "train": {"micro_batch_size": 1, "global_batch_size": 64}, "dataset": {"seq_length": 4096},
           "tokenizer": {"tokenizer_type": "NullTokenizer", "vocab_size": 32000},
           "ddp": {"use_distributed_optimizer": True}, "mixed_precision": "bf16_mixed", **sections}
    p = tmp_path / "run_config.yaml"
    p.write_text(yaml.safe_dump(doc))
    from megatron_memguard.readers.detect import read_config_file
    return read_config_file(str(p))


MLA_MODEL = {"num_layers": 4, "hidden_size": 1024, "num_attention_heads": 16, "num_query_groups": 16,
             "ffn_hidden_size": 2816, "kv_channels": 64, "seq_length": 4096, "multi_latent_attention": True,
             "q_lora_rank": None, "kv_lora_rank": 512, "qk_head_dim": 128, "qk_pos_emb_head_dim": 64,
             "v_head_dim": 128, "qk_layernorm": True, "normalization": "RMSNorm", "gated_linear_unit": True,
             "add_bias_linear": False, "position_embedding_type": "rope",
             "num_moe_experts": 8, "moe_router_topk": 2, "moe_ffn_hidden_size": 704,
             "moe_shared_expert_intermediate_size": 1408, "moe_layer_freq": [0, 1, 1, 1],
             "moe_token_dispatcher_type": "alltoall", "moe_grouped_gemm": True, "moe_permute_fusion": True,
             "moe_router_dtype": "fp32", "expert_model_parallel_size": 4, "expert_tensor_parallel_size": 1,
             "pipeline_model_parallel_size": 2, "mtp_num_layers": 1,
             "pipeline_model_parallel_layout": [["embedding", "decoder", "decoder"], ["decoder", "decoder", "mtp", "loss"]],
             "recompute_granularity": "selective", "recompute_modules": ["moe_act", "mla_up_proj"]}


def test_moe_dump_keys_are_read_exactly(tmp_path):
    raw = _dump(tmp_path, MLA_MODEL)
    L = resolve(raw, world_size=8)
    m = L.moe
    assert (m.num_experts, m.moe_router_topk, m.moe_ffn_hidden_size, m.moe_shared_expert_intermediate_size) == \
        (8, 2, 704, 1408)
    assert m.moe_layer_pattern == (False, True, True, True)
    assert (m.moe_token_dispatcher_type, m.moe_grouped_gemm, m.moe_permute_fusion, m.moe_router_dtype) == \
        ("alltoall", True, True, "fp32")
    assert (m.expert_model_parallel_size, m.expert_tensor_parallel_size, L.mtp_num_layers) == (4, 1, 1)
    assert L.pipeline_model_parallel_layout == "Ett|ttmL" and L.multi_latent_attention
    assert L.recompute_modules == ("moe_act", "mla_up_proj")
    # the MLA provider's num_query_groups (= heads) is not grouped-query attention
    assert not L.group_query_attention and raw.origin["num_experts"] == "model.num_moe_experts"


def test_tp_comm_overlap_is_off_where_bridge_turns_it_off(tmp_path):
    # training/comm_overlap.py CommOverlapConfig.setup (0.6.2): TP < 2, or no sequence parallelism
    model = {k: v for k, v in MLA_MODEL.items() if k not in ("pipeline_model_parallel_layout", "mtp_num_layers")}
    raw = _dump(tmp_path, {**model, "pipeline_model_parallel_size": 1}, comm_overlap={"tp_comm_overlap": True})
    assert "tp_comm_overlap" not in raw.args and any("switches TP communication overlap off" in w for w in raw.warnings)
    raw = _dump(tmp_path, {**model, "pipeline_model_parallel_size": 1, "tensor_model_parallel_size": 2,
                           "sequence_parallel": True}, comm_overlap={"tp_comm_overlap": True})
    assert raw.args["tp_comm_overlap"] is True
