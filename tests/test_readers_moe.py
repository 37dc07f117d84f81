"""Mixture of experts in the readers: Megatron flags (every MoE flag of arguments.py), --moe-layer-freq,
NeMo 1 / launcher, NeMo 2, Bridge, Megatron's functional-test records, Hugging Face config.json of
Mixtral, Qwen-MoE and DeepSeek, and the MoE presets. Checked at the RawConfig level: the arguments
Megatron would get. Parameter totals are checked against what transformers builds from the same
config.json (tests/data/moe_reference_counts.json) with the hand-written count of tests/moe_count_util.py."""
import json
import os

import pytest

from megatron_memguard.errors import ConfigError
from megatron_memguard.readers.hf import read_hf_config
from megatron_memguard.readers.megatron_flags import flags_from_mapping, parse_megatron_flags
from megatron_memguard.readers.models import presets, read_model
from megatron_memguard.readers.moe_freq import MAX_PATTERN_LENGTH, moe_layers, parse_moe_layer_freq

from benchmarks.shared_data import CONFIGS, GROUNDTRUTH
from moe_count_util import megatron_param_counts

HERE = os.path.dirname(os.path.abspath(__file__))
REF = json.load(open(os.path.join(HERE, "data", "moe_reference_counts.json")))["models"]
MOE_RECORDS = os.path.join(GROUNDTRUTH, "megatron-functional-moe-dev.jsonl")


def flags(text, **kw):
    return parse_megatron_flags(text.split(), **kw).args


# --------------------------------------------------------------------------------------------------
# --moe-layer-freq
# --------------------------------------------------------------------------------------------------
def test_layer_freq_examples_of_megatrons_help():
    # moe_freq_type's docstring (megatron/training/arguments.py): "([1]*3+[0]*1)*3" evaluates to
    # [1,1,1,0,1,1,1,0,1,1,1,0]; "([0]+[1]*23)" is one dense layer, then 23 expert layers.
    assert flags("--moe-layer-freq ([1]*3+[0]*1)*3")["moe_layer_freq"] == [1, 1, 1, 0] * 3
    assert flags("--moe-layer-freq ([0]+[1]*23)")["moe_layer_freq"] == [0] + [1] * 23
    # DeepSeek-V3 (moe-fp8.md 1.1): three dense layers, then 58 MoE layers
    p = flags("--moe-layer-freq=([0]*3+[1]*58)")["moe_layer_freq"]
    assert (len(p), p.index(1), sum(p)) == (61, 3, 58)
    assert flags("--moe-layer-freq 2")["moe_layer_freq"] == 2
    assert moe_layers(2, 5) == [True, False, True, False, True]  # i % N == 0 (get_gpt_decoder_layer_specs)
    assert parse_moe_layer_freq([0, 1, 1]) == [0, 1, 1]  # a YAML/JSON list is the pattern already
    assert flags_from_mapping({"--moe-layer-freq": [0, 1, 1]}) == ["--moe-layer-freq", "[0,1,1]"]
    assert parse_megatron_flags(flags_from_mapping({"--moe-layer-freq": [0, 1, 1]})).args["moe_layer_freq"] == [0, 1, 1]


@pytest.mark.parametrize("bad, why", [
    ("[1]*10**12", "not a list expression"),               # '*' twice: a power, which Megatron's eval allows
    ("[1]*100000000", "beyond any layer count"),
    ("([1]*1000)*1000", "longer than"),
    ("[2,1]", r"each entry is 0 \(dense\) or 1 \(MoE\)"),
    ("[1, 0]", "only digits"),                             # Megatron's _eval_pattern refuses the space
    ("(1,0)", "expects an int or a list expression"),
    ("[[1],[0]]", "flat list"),
    ("[1]+1", "adds a list and a number"),
    ("[1]*[1]", "multiplies two lists"),
    ("[]", "empty"),
    ("(" * 400 + "[1]" + ")" * 400, "list expression"),
    ("dense", "expects an int"),
])
def test_layer_freq_refusals_name_the_flag(bad, why):
    with pytest.raises(ConfigError, match=why) as e:
        parse_moe_layer_freq(bad, "--moe-layer-freq")
    assert str(e.value).startswith("--moe-layer-freq: ") and len(str(e.value)) < 400
    if " " not in bad:  # the same through the flag parser
        with pytest.raises(ConfigError, match=why):
            flags("--moe-layer-freq " + bad)


def test_layer_freq_cap_is_above_any_real_model():
    assert MAX_PATTERN_LENGTH >= 1000
    assert len(parse_moe_layer_freq(f"[1]*{MAX_PATTERN_LENGTH}")) == MAX_PATTERN_LENGTH


# --------------------------------------------------------------------------------------------------
# Megatron flags
# --------------------------------------------------------------------------------------------------
def test_moe_flags_types_and_validate_args_unwrapping():
    a = flags("--num-experts 64 --moe-router-topk 6 --moe-ffn-hidden-size 1408 --moe-shared-expert-intermediate-size 2816 "
              "--expert-model-parallel-size 8 --expert-tensor-parallel-size 1 --moe-grouped-gemm --moe-router-dtype fp32 "
              "--moe-token-dispatcher-type alltoall --moe-permute-fusion --moe-expert-capacity-factor 1.25 "
              "--moe-pad-expert-input-to-capacity --moe-shared-expert-overlap --moe-aux-loss-coeff 1e-3 "
              "--moe-z-loss-coeff 1e-3 --moe-router-load-balancing-type seq_aux_loss --moe-shared-expert-gate")
    assert a == {"num_experts": 64, "moe_router_topk": 6, "moe_ffn_hidden_size": 1408,
                 "moe_shared_expert_intermediate_size": 2816, "expert_model_parallel_size": 8,
                 "expert_tensor_parallel_size": 1, "moe_grouped_gemm": True, "moe_router_dtype": "fp32",
                 "moe_token_dispatcher_type": "alltoall", "moe_permute_fusion": True, "moe_expert_capacity_factor": 1.25,
                 "moe_pad_expert_input_to_capacity": True, "moe_shared_expert_overlap": True, "moe_aux_loss_coeff": 1e-3,
                 "moe_z_loss_coeff": 1e-3, "moe_router_load_balancing_type": "seq_aux_loss", "moe_shared_expert_gate": True}
    # 0.19's nargs='+': several values stay a list (validate_args unwraps a single one, 0.16.1 took one)
    assert flags("--moe-router-load-balancing-type aux_loss seq_aux_loss --moe-aux-loss-coeff 0.01 0.001") == {
        "moe_router_load_balancing_type": ["aux_loss", "seq_aux_loss"], "moe_aux_loss_coeff": [0.01, 0.001]}
    # megatron-core 0.16.1's legacy GroupedMLP switch is still read
    assert flags("--moe-use-legacy-grouped-gemm") == {"moe_use_legacy_grouped_gemm": True}


def _real_parser():
    pytest.importorskip("megatron.training.arguments", reason="needs the real megatron.training (Python 3.12 venv)")
    import argparse

    from megatron.training.arguments import add_megatron_arguments
    return add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))


def _sample(action):
    """A command-line value Megatron's parser accepts for ``action`` (None: a switch)."""
    if action.nargs == 0:
        return None
    if action.choices:
        return [str(next(iter(action.choices)))]
    t = getattr(action.type, "__name__", "")
    if t == "moe_freq_type":
        return ["([0]*2+[1]*6)"]
    if t == "int":
        return ["4"]
    if t == "float":
        return ["0.25"]
    return ["name"]


@pytest.mark.megatron_training
def test_every_moe_flag_parses_like_megatrons_parser():
    """For each MoE/expert option of the real arguments.py (0.19.2), memguard's value equals argparse's
    (after validate_args' one-element-list unwrapping); the dest is the same."""
    parser = _real_parser()
    checked = 0
    for action in parser._actions:
        opts = [o for o in action.option_strings if o.startswith("--")]
        if not opts or not any(w in action.dest for w in ("moe", "expert")) or action.dest.startswith("inference"):
            continue
        opt = opts[0]
        val = _sample(action)
        argv = [opt] + (val or [])
        if getattr(action.type, "__name__", "") == "moe_freq_type" or "layer_freq" in action.dest:
            argv = [opt, "([0]*2+[1]*6)"]
        want = vars(parser.parse_known_args(argv)[0])[action.dest]
        if isinstance(want, list) and len(want) == 1 and action.dest in ("moe_router_load_balancing_type", "moe_aux_loss_coeff"):
            want = want[0]
        got = parse_megatron_flags(argv).args
        assert got == {action.dest: want}, opt
        checked += 1
    assert checked >= 50


@pytest.mark.skipif(not os.path.exists(MOE_RECORDS), reason="shared groundtruth not available")
def test_functional_moe_records_read_with_no_unknown_flag():
    """All 96 MoE training records of Megatron's CI (megatron-functional-moe-dev.jsonl): every flag is
    known, the layer patterns have one entry per layer."""
    n = 0
    for line in open(MOE_RECORDS):
        r = json.loads(line)
        raw = parse_megatron_flags(flags_from_mapping(r["model_args"]), env={"DATA_PATH": "/d", "DATA_CACHE_PATH": "/c"})
        assert not any("not Megatron flags" in w for w in raw.warnings), (r["id"], raw.warnings)
        a = raw.args
        assert a["num_experts"] == r["model_args"]["--num-experts"]
        freq = a.get("moe_layer_freq", 1)
        assert isinstance(freq, int) or len(freq) == a["num_layers"], r["id"]
        n += 1
    assert n == 96


# --------------------------------------------------------------------------------------------------
# NeMo 1 / NeMo-Framework-Launcher, NeMo 2, Bridge
# --------------------------------------------------------------------------------------------------
MIXTRAL_FLAGS = (
    # launcher_scripts/conf/training/mixtral/mixtral_8x7b.yaml, written out as Megatron flags by hand
    "--num-experts 8 --moe-router-topk 2 --expert-model-parallel-size 8 --moe-token-dispatcher-type alltoall "
    "--moe-pad-expert-input-to-capacity --moe-expert-capacity-factor 1.0 --moe-aux-loss-coeff 0.01 "
    "--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336")


def test_launcher_mixtral_reads_every_moe_key():
    pytest.importorskip("omegaconf")
    from megatron_memguard.readers.detect import read_config_file

    raw = read_config_file(os.path.join(CONFIGS, "nemo-launcher/mixtral_mixtral_8x7b.yaml"))
    want = flags(MIXTRAL_FLAGS)
    moe = {k: v for k, v in want.items() if "moe" in k or "expert" in k}
    assert {k: raw.args.get(k) for k in moe} == moe
    assert raw.args["moe_grouped_gemm"] is False  # model.moe_grouped_gemm: false
    assert raw.origin["num_experts"] == "model.num_moe_experts"
    assert raw.origin["moe_expert_capacity_factor"] == "model.moe_expert_capacity_factor"
    # no key of the file is left unread with a warning
    assert not any("not a NeMo or megatron-core model setting" in w for w in raw.warnings)


def test_nemo1_moe_keys_pass_through(tmp_path):
    pytest.importorskip("omegaconf")
    from megatron_memguard.readers.detect import read_config_file

    p = tmp_path / "cfg.yaml"
    p.write_text("trainer: {devices: 8, num_nodes: 1, precision: bf16}\n"
                 "model:\n  mcore_gpt: true\n  num_layers: 4\n  hidden_size: 512\n  num_attention_heads: 8\n"
                 "  encoder_seq_length: 1024\n  micro_batch_size: 1\n  global_batch_size: 8\n"
                 "  num_moe_experts: 4\n  moe_router_topk: 1\n  moe_layer_freq: [0, 1, 1, 1]\n  moe_ffn_hidden_size: 256\n"
                 "  moe_shared_expert_intermediate_size: 512\n  moe_router_load_balancing_type: sinkhorn\n"
                 "  moe_z_loss_coeff: 0.001\n  moe_router_dtype: fp32\n  moe_permute_fusion: true\n"
                 "  expert_model_parallel_size: 4\n  expert_tensor_parallel_size: 1\n  moe_token_dispatcher_type: allgather\n")
    a = read_config_file(str(p)).args
    assert (a["num_experts"], a["moe_router_topk"], a["moe_layer_freq"], a["moe_ffn_hidden_size"],
            a["moe_shared_expert_intermediate_size"], a["moe_router_load_balancing_type"], a["moe_z_loss_coeff"],
            a["moe_router_dtype"], a["moe_permute_fusion"], a["expert_model_parallel_size"],
            a["expert_tensor_parallel_size"], a["moe_token_dispatcher_type"]) == \
        (4, 1, [0, 1, 1, 1], 256, 512, "sinkhorn", 0.001, "fp32", True, 4, 1, "allgather")


def test_bridge_dump_moe_keys(tmp_path):
    from megatron_memguard.readers.detect import read_config_file

    p = tmp_path / "run_config.yaml"
    # the keys nemo-bridge.md 3.1 lists for MoE, under a Bridge ConfigContainer dump
    p.write_text("model:\n  _target_: megatron.bridge.models.gpt_provider.GPTModelProvider\n  num_layers: 8\n"
                 "  hidden_size: 512\n  num_attention_heads: 8\n  ffn_hidden_size: 2048\n  seq_length: 1024\n"
                 "  vocab_size: 32000\n  num_moe_experts: 8\n  moe_ffn_hidden_size: 1024\n  moe_router_topk: 4\n"
                 "  moe_shared_expert_intermediate_size: 1024\n  moe_layer_freq: [0, 0, 1, 1, 1, 1, 1, 1]\n"
                 "  moe_token_dispatcher_type: alltoall\n  moe_grouped_gemm: true\n  moe_expert_capacity_factor: null\n"
                 "  expert_model_parallel_size: 4\n  expert_tensor_parallel_size: 1\n  tensor_model_parallel_size: 2\n"
                 "  sequence_parallel: true\n"
                 "train:\n  micro_batch_size: 1\n  global_batch_size: 8\n"
                 "optimizer:\n  _target_: megatron.core.optimizer.OptimizerConfig\n  use_distributed_optimizer: true\n")
    raw = read_config_file(str(p))
    a = raw.args
    assert (a["num_experts"], a["moe_ffn_hidden_size"], a["moe_router_topk"], a["moe_shared_expert_intermediate_size"],
            a["moe_layer_freq"], a["moe_token_dispatcher_type"], a["moe_grouped_gemm"], a["expert_model_parallel_size"],
            a["expert_tensor_parallel_size"]) == (8, 1024, 4, 1024, [0, 0, 1, 1, 1, 1, 1, 1], "alltoall", True, 4, 1)
    assert "moe_expert_capacity_factor" not in a  # null: dropless, Megatron's default
    assert raw.origin["num_experts"] == "model.num_moe_experts"


def test_nemo2_export_names_a_moe_config_class(tmp_path):
    from megatron_memguard.readers.detect import read_config_file

    p = tmp_path / "export.yaml"
    p.write_text("_target_: nemo.collections.llm.api.pretrain\n"
                 "model:\n  _target_: nemo.collections.llm.gpt.model.mixtral.MixtralModel\n"
                 "  config:\n    _target_: nemo.collections.llm.gpt.model.mixtral.MixtralConfig8x7B\n"
                 "trainer:\n  _target_: nemo.lightning.Trainer\n  devices: 8\n  num_nodes: 8\n"
                 "  strategy:\n    _target_: nemo.lightning.MegatronStrategy\n    expert_model_parallel_size: 8\n"
                 "    pipeline_model_parallel_size: 4\n"
                 "data:\n  _target_: nemo.collections.llm.gpt.data.mock.MockDataModule\n  seq_length: 4096\n"
                 "  micro_batch_size: 1\n  global_batch_size: 256\n")
    raw = read_config_file(str(p))
    a = raw.args
    assert (a["num_experts"], a["moe_router_topk"], a["moe_ffn_hidden_size"], a["expert_model_parallel_size"],
            a["num_layers"]) == (8, 2, 14336, 8, 32)


# --------------------------------------------------------------------------------------------------
# Hugging Face config.json and presets
# --------------------------------------------------------------------------------------------------
def _hf(name):
    path = os.path.join(HERE, "data", "hf", name + ".json")
    return read_hf_config(json.load(open(path)), path)


@pytest.mark.parametrize("name", sorted(REF))
def test_hf_moe_parameter_counts_equal_transformers(name):
    """Each role of the Megatron model read from the config.json has the parameters transformers
    builds for it on the meta device (scripts/hf_moe_param_counts.py); Mixtral-8x7B: 46,702,792,704."""
    counts = megatron_param_counts(_hf(name).args)
    assert counts == REF[name]["by_role"]
    assert sum(counts.values()) == REF[name]["num_parameters"]


def test_mixtral_total_is_the_published_one():
    assert sum(megatron_param_counts(_hf("mixtral-8x7b").args).values()) == 46_702_792_704


def test_hf_layer_patterns_are_transformers_moe_layers():
    for name, ref in REF.items():
        a = _hf(name).args
        got = [i for i, moe in enumerate(moe_layers(a["moe_layer_freq"], a["num_layers"])) if moe]
        assert got == ref["moe_layers"], name


def test_hf_moe_mappings():
    v3 = _hf("deepseek-v3")
    a = v3.args
    assert (a["multi_latent_attention"], a["q_lora_rank"], a["kv_lora_rank"], a["qk_head_dim"], a["qk_pos_emb_head_dim"],
            a["v_head_dim"], a["qk_layernorm"]) == (True, 1536, 512, 128, 64, 128, True)
    assert (a["num_experts"], a["moe_router_topk"], a["moe_ffn_hidden_size"], a["ffn_hidden_size"],
            a["moe_shared_expert_intermediate_size"], a["moe_router_score_function"], a["moe_router_enable_expert_bias"],
            a["moe_router_num_groups"], a["moe_router_group_topk"], a["moe_router_topk_scaling_factor"]) == \
        (256, 8, 2048, 18432, 2048, "sigmoid", True, 8, 4, 2.5)
    assert "group_query_attention" not in a  # MLA: Megatron refuses GQA with it
    assert any("--mtp-num-layers 1" in w for w in v3.warnings)
    lite = _hf("deepseek-v2-lite").args
    assert "q_lora_rank" not in lite and lite["moe_router_pre_softmax"] and "moe_router_num_groups" not in lite
    assert (lite["moe_router_load_balancing_type"], lite["moe_aux_loss_coeff"]) == ("seq_aux_loss", 0.001)
    q15 = _hf("qwen1.5-moe-a2.7b").args
    assert (q15["moe_shared_expert_gate"], q15["moe_shared_expert_intermediate_size"], q15["add_qkv_bias"],
            q15["moe_router_pre_softmax"]) == (True, 5632, True, True)
    q3 = _hf("qwen3-30b-a3b").args
    assert q3["qk_layernorm"] and "moe_router_pre_softmax" not in q3 and "moe_shared_expert_intermediate_size" not in q3
    assert _hf("qwen3-30b-a3b").origin["moe_ffn_hidden_size"] == "moe_intermediate_size"
    assert _hf("deepseek-v3").origin["num_experts"] == "n_routed_experts"


def test_qwen_sparse_step_and_mlp_only_layers():
    # Qwen2MoeDecoderLayer: sparse where (i + 1) % decoder_sparse_step == 0 and i not in mlp_only_layers
    doc = json.load(open(os.path.join(HERE, "data", "hf", "qwen3-30b-a3b.json")))
    doc.update(num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[5])
    assert read_hf_config(doc, "x").args["moe_layer_freq"] == [0, 1, 0, 1, 0, 0]


def test_hf_hostile_counts_are_refused_by_key():
    doc = json.load(open(os.path.join(HERE, "data", "hf", "deepseek-v3.json")))
    doc["num_hidden_layers"] = 10**12
    with pytest.raises(ConfigError, match="^num_hidden_layers: "):
        read_hf_config(doc, "x")
    doc = json.load(open(os.path.join(HERE, "data", "hf", "qwen3-30b-a3b.json")))
    doc["mlp_only_layers"] = "all"
    with pytest.raises(ConfigError, match="^mlp_only_layers: "):
        read_hf_config(doc, "x")


MOE_PRESETS = {"mixtral-8x7b": "mixtral-8x7b", "qwen1.5-moe-a2.7b": "qwen1.5-moe-a2.7b", "qwen2-57b-a14b": "qwen2-57b-a14b",
               "qwen3-30b-a3b": "qwen3-30b-a3b", "qwen3-235b-a22b": "qwen3-235b-a22b",
               "deepseek-v2-lite": "deepseek-v2-lite", "deepseek-v2": "deepseek-v2", "deepseek-v3": "deepseek-v3"}


@pytest.mark.parametrize("preset", sorted(MOE_PRESETS))
def test_moe_presets_are_the_config_json(preset):
    """A preset reads to the same Megatron arguments as the whole config.json it was copied from."""
    assert preset in presets()["models"]
    assert read_model(preset).args == _hf(MOE_PRESETS[preset]).args


def test_preset_spellings():
    for spelling, key in (("mistralai/Mixtral-8x7B-v0.1", "mixtral-8x7b"), ("Qwen/Qwen3-235B-A22B", "qwen3-235b-a22b"),
                          ("deepseek-ai/DeepSeek-V3", "deepseek-v3"), ("DeepSeek-V2-Lite", "deepseek-v2-lite")):
        assert read_model(spelling).source == f"model preset {key}"


def test_norm_topk_prob_defaults_of_transformers_config_classes():
    # Qwen2MoeConfig / Qwen3MoeConfig / DeepseekV2Config default norm_topk_prob=False, DeepseekV3Config True
    doc = json.load(open(os.path.join(HERE, "data", "hf", "qwen3-30b-a3b.json")))
    del doc["norm_topk_prob"]
    assert read_hf_config(doc, "x").args["moe_router_pre_softmax"] is True
    doc = json.load(open(os.path.join(HERE, "data", "hf", "deepseek-v3.json")))
    del doc["norm_topk_prob"]
    assert "moe_router_pre_softmax" not in read_hf_config(doc, "x").args


def test_hook_namespace_before_validate_args():
    # the hook reads Megatron's namespace before validate_args: 0.19's nargs='+' lists are still lists
    import types

    from megatron_memguard.readers.megatron_namespace import raw_from_namespace
    ns = types.SimpleNamespace(num_experts=8, moe_router_load_balancing_type=["aux_loss"], moe_aux_loss_coeff=[0.01],
                               moe_layer_freq=[0, 1], world_size=8)
    a = raw_from_namespace(ns).args
    assert (a["moe_router_load_balancing_type"], a["moe_aux_loss_coeff"], a["moe_layer_freq"]) == ("aux_loss", 0.01, [0, 1])


@pytest.mark.parametrize("preset", sorted(MOE_PRESETS))
def test_estimator_counts_the_presets_as_transformers_does(preset):
    """The estimator's total parameters of each MoE preset (resolved at TP = PP = EP = 1, vocabulary
    unpadded as config.json gives it) equal transformers' count from the same config.json."""
    from megatron_memguard import resolve
    from megatron_memguard.estimator.params import total_parameters
    raw = read_model(preset).with_args(seq_length=4096, micro_batch_size=1, bf16=True)
    L = resolve(raw, world_size=1)
    assert L.moe is not None and L.padded_vocab_size == raw.args["vocab_size"]
    assert total_parameters(L) == REF[MOE_PRESETS[preset]]["num_parameters"]


def test_hf_shared_expert_width_is_a_number():
    doc = json.load(open(os.path.join(HERE, "data", "hf", "deepseek-v3.json")))
    doc["moe_intermediate_size"] = "2048"   # a string times n_shared_experts would be a string, not a width
    with pytest.raises(ConfigError, match="^moe_intermediate_size: "):
        read_hf_config(doc, "x")
    doc["moe_intermediate_size"], doc["n_shared_experts"] = 2048, 10**12
    with pytest.raises(ConfigError, match="^n_shared_experts: "):
        read_hf_config(doc, "x")
