"""Regressions of issue hostile5: hostile input to the hybrid Mamba, PEFT, MTP-stage, latent-MoE and attention-backend
surfaces (tests/test_fuzz_cli.py test_hybrid_peft_and_mtp_inputs_with_hostile_values draws from the same values). Each is
the smallest input that broke the promise (a setting silently dropped or a real run's log refused), with what
memguard does now."""
from __future__ import annotations

import json

import pytest

from fuzz_util import run_memguard

GiB = 2**30
NEMOTRON = ["estimate", "--json", "--model", "nemotronh_8b", "--gpus", "8"]
# Megatron-Bridge 0.6.2 recipes/nemotronh/h100/nemotronh.py: HybridModelProvider(hybrid_layer_pattern=<52 symbols>,
# num_layers=52, ...)
PATTERN_52 = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"


def one_error(o, *needles) -> str:
    assert not o.problems, o.describe()
    lines = [line for line in o.err.splitlines() if line.strip()]
    assert o.code == 2 and len(lines) == 1 and lines[0].startswith("memguard: error: "), (o.code, o.err)
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


def _json(o) -> dict:
    assert not o.problems and o.code in (0, 1), o.describe()
    return json.loads(o.out)


# --- report / calibrate: a Megatron log of a run launched with the deprecated flag ------------------------------
def _log(args: dict) -> str:
    from megatron_logs import print_args, report_memory
    lines = print_args(args) + [report_memory(0, "(after 10 iterations)", GiB, 3 * GiB, 4 * GiB, 4 * GiB)]
    return "\n".join(lines) + "\n"


def test_log_of_a_run_with_the_deprecated_hybrid_flag_is_read():
    # megatron-core 0.19.2 validate_args copies --hybrid-override-pattern into hybrid_layer_pattern and leaves it set
    # (megatron/training/arguments.py: 'args.hybrid_layer_pattern = args.hybrid_override_pattern'), so the argument
    # table prints both, equal; report refused the log with "cannot be given with --hybrid-layer-pattern"
    from megatron_logs import args_of

    from test_mamba import SMALL
    args = args_of(SMALL + ["--hybrid-layer-pattern", "M*M-"], 8)
    args.update(num_layers=4, hybrid_override_pattern="None")
    both = dict(args, hybrid_override_pattern="M*M-")
    new, old = (run_memguard(["report", "--json", "run.log", "--megatron-version", "0.19.2"], {"run.log": _log(a)},
                             cpu_limit=2.0) for a in (args, both))
    new, old = _json(new), _json(old)
    assert [r["predicted_peak_allocated"] for r in old["ranks"]] == [r["predicted_peak_allocated"] for r in new["ranks"]]
    assert old["ranks"][0]["actual_max_allocated"] == 3 * GiB
    # two different patterns are still the assert they are
    other = dict(args, hybrid_override_pattern="MM**")
    one_error(run_memguard(["report", "run.log", "--megatron-version", "0.19.2"], {"run.log": _log(other)}),
              "--hybrid-override-pattern: cannot be given with --hybrid-layer-pattern")


# --- Megatron-Bridge's HybridModelProvider (the nemotronh_8b recipe) -----------------------------------------------
@pytest.mark.parametrize("value", ["null", "''"])
def test_a_hybrid_provider_without_its_pattern_is_refused(value):
    # Bridge 0.6.2 HybridModelProvider.finalize: no pattern -> the layers come from hybrid_attention_ratio /
    # hybrid_mlp_ratio (all Mamba at 0.0); memguard dropped the pattern and estimated 52 attention + MLP layers
    one_error(run_memguard([*NEMOTRON, "--set", f"model.hybrid_layer_pattern={value}"], cpu_limit=2.0),
              "model.hybrid_layer_pattern: a hybrid model without a layer pattern", "is not modelled yet")


@pytest.mark.parametrize("value, rule", [("0", "must be >= 1, got 0"), ("''", "must be an integer, got ''"),
                                         ("|", "must be an integer, got '|'")])
def test_mamba_chunk_size_below_one_is_refused(value, rule):
    # HybridModelProvider.finalize raises 'mamba_chunk_size must be at least 1.'; the reader dropped 0 and '' (so the
    # recipe's 128 was estimated), and '|' read as YAML's block scalar, ''
    one_error(run_memguard([*NEMOTRON, "--set", f"model.mamba_chunk_size={value}"], cpu_limit=2.0),
              f"model.mamba_chunk_size: {rule}")


def test_num_layers_that_disagrees_with_the_pattern_is_refused_for_bridge():
    # HybridModelProvider.finalize asserts num_layers == the pattern's layer count when both are set; the recipe sets
    # num_layers=52, so overriding only the pattern stops Bridge (memguard noted "--num-layers 52 ignored")
    one_error(run_memguard([*NEMOTRON, "--set", "model.hybrid_layer_pattern=M*M-"], cpu_limit=2.0),
              "model.num_layers (recipe nemotronh_8b): is 52 but model.hybrid_layer_pattern has 4 layers",
              "set model.num_layers=4")
    one_error(run_memguard([*NEMOTRON, "--set", "model.num_layers=50"], cpu_limit=2.0), "model.num_layers: is 50")
    both = _json(run_memguard([*NEMOTRON, "--set", "model.hybrid_layer_pattern=M*M-", "--set", "model.num_layers=4"],
                              cpu_limit=2.0))
    assert both["layout"]["num_layers"] == 4
    # Megatron-LM's validate_args takes the count from the pattern and ignores --num-layers: a note, not an error
    from test_mamba import SMALL
    o = run_memguard(["estimate", "--world-size", "1", "--", *SMALL, "--hybrid-layer-pattern", "M*M-", "--num-layers", "7"],
                     cpu_limit=2.0)
    assert not o.problems and o.code == 0 and "--num-layers 7 ignored" in o.out, o.describe()


@pytest.mark.parametrize("pp, vpp", [(2, 2), (1, 3)])
def test_bridge_virtual_pipeline_with_a_hybrid_pattern_is_refused(pp, vpp):
    # HybridModelProvider.provide asserts virtual_pipeline_model_parallel_size is None ('Virtual pipeline model
    # parallelism is temporarily unsupported in Hybrid models'); at PP 2 memguard estimated an interleaved schedule
    one_error(run_memguard([*NEMOTRON, "--set", f"model.pipeline_model_parallel_size={pp}", "--set",
                            f"model.virtual_pipeline_model_parallel_size={vpp}"], cpu_limit=2.0),
              "model.virtual_pipeline_model_parallel_size: cannot be used with model.hybrid_layer_pattern")


def test_an_override_value_starting_with_a_bar_is_text():
    # YAML reads '|' / '>' as block-scalar indicators ('' or an error); Hydra's override grammar keeps the text, so a
    # pattern whose first pipeline segment is empty keeps its 52 layers (2 segments: PP 1 cannot interleave them)
    one_error(run_memguard([*NEMOTRON, "--set", f"model.hybrid_layer_pattern=|{PATTERN_52}"], cpu_limit=2.0),
              "(2 virtual pipeline stages)")
    one_error(run_memguard([*NEMOTRON, "--set", "model.hybrid_layer_pattern=|"], cpu_limit=2.0),
              "model.hybrid_layer_pattern: has no layers")


# a HybridModelProvider run_config.yaml (Bridge 0.6.2 models/hybrid/hybrid_provider.py field names)
HYBRID_YAML = """_target_: megatron.bridge.training.config.ConfigContainer
model:
  _target_: megatron.bridge.models.hybrid.hybrid_provider.HybridModelProvider
  hybrid_layer_pattern: M*M-
  hybrid_override_pattern: null
  num_layers: 4
  hidden_size: 256
  ffn_hidden_size: 512
  num_attention_heads: 4
  num_query_groups: 2
  kv_channels: 64
  mamba_state_dim: 16
  mamba_head_dim: 32
  mamba_num_groups: 2
  mamba_chunk_size: 128
  normalization: RMSNorm
  add_bias_linear: false
  seq_length: 128
  bf16: true
  params_dtype: bf16
train: {micro_batch_size: 1, global_batch_size: 8}
dataset: {seq_length: 128}
optimizer: {optimizer: adam, use_distributed_optimizer: true, bf16: true}
ddp: {use_distributed_optimizer: true, grad_reduce_in_fp32: true}
tokenizer: {tokenizer_type: NullTokenizer, vocab_size: 1024}
mixed_precision: bf16_mixed
"""


def _hybrid_yaml(*overrides: str):
    return run_memguard(["estimate", "--json", "--config", "c.yaml", "--gpus", "8", *[x for o in overrides for x in ("--set", o)]],
                        {"c.yaml": HYBRID_YAML}, cpu_limit=2.0)


def test_a_pattern_of_the_wrong_kind_is_refused_not_dropped():
    plain = _json(_hybrid_yaml())
    assert plain["layout"]["num_layers"] == 4 and plain["layout"]["hybrid_layer_pattern"] == "M*M-"
    # YAML's 0 is False to Python ('v in (None, "", False)'): the pattern was dropped and 4 GPT layers estimated
    one_error(_hybrid_yaml("model.hybrid_layer_pattern=0"), "model.hybrid_layer_pattern: '0' is not a layer symbol")
    one_error(_hybrid_yaml("model.hybrid_layer_pattern=null"), "model.hybrid_layer_pattern: a hybrid model without a layer "
              "pattern")
    # the deprecated field alone is Bridge's pattern (finalize copies it over)
    legacy = _json(_hybrid_yaml("model.hybrid_layer_pattern=null", "model.hybrid_override_pattern=M*M-"))
    assert legacy["layout"]["hybrid_layer_pattern"] == "M*M-"


@pytest.mark.parametrize("option, rule", [("--gpu", "--gpu: unknown GPU ''"), ("--gpu-memory", "--gpu-memory: cannot read size ''")])
def test_an_empty_gpu_option_is_refused(option, rule):
    # 'if ns.gpu' took --gpu '' as absent: the H100-80GB default was estimated without a word
    from fuzz_util import SMALL
    one_error(run_memguard(["estimate", "--world-size", "8", option, "", "--", *SMALL], cpu_limit=2.0), rule)


# --- LoRA / DoRA ---------------------------------------------------------------------------------------------------
def _bridge_lora(peft: str):
    from test_readers_bridge import FLAT
    return run_memguard(["estimate", "--json", "--config", "c.yaml", "--gpus", "8"],
                        {"c.yaml": FLAT + "peft:\n" + peft}, cpu_limit=2.0)


def test_lora_target_names_are_matched_as_bridge_matches_them():
    # Bridge 0.6.2 ModuleMatcher: 'name == pattern or wildcard_match(pattern, full_name)': ' linear_qkv ' wraps no
    # module; memguard stripped it and counted linear_qkv's adapters
    one_error(_bridge_lora("  _target_: megatron.bridge.peft.lora.LoRA\n  target_modules: [' linear_qkv ']\n"),
              "peft.target_modules: PEFT of ' linear_qkv '")
    # a name given twice wraps the linear once (FLAT: h 512, qkv out 768, rank 8, TP 2: linear_in [8/2, 512] + linear_out
    # [768/2, 8] = 5,120 a layer and rank, 4 layers = 20,480 bf16 parameters, 40,960 bytes)
    for t in ("[linear_qkv]", "[linear_qkv, linear_qkv]"):
        doc = _json(_bridge_lora(f"  _target_: megatron.bridge.peft.lora.LoRA\n  dim: 8\n  target_modules: {t}\n"))
        assert [x["bytes"] for x in doc["stages"][0]["terms"] if x["name"] == "peft_adapters"] == [40_960], t
    one_error(_bridge_lora("  _target_: ''\n"), "peft._target_: is missing")


def test_nemo1_lora_settings_of_the_wrong_shape():
    from fuzz_util import YAML_SEEDS
    nemo = dict((n, t) for n, t, _ in YAML_SEEDS)["nemo1_llama.yaml"]

    def run(block: str):
        text = nemo.replace("\nmodel:\n", "\nmodel:\n  peft:\n    peft_scheme: lora\n" + block, 1)
        return run_memguard(["estimate", "--config", "c.yaml", "--gpus", "4", "--vocab-size", "32000", "--set",
                             "model.global_batch_size=256"], {"c.yaml": text}, cpu_limit=2.0)
    # 'lora_tuning: 3' was read as no settings (rank 32 on linear_qkv)
    one_error(run("    lora_tuning: 3\n"), "model.peft.lora_tuning: must be a mapping of LoRA settings, got 3")
    # nemo_toolkit 2.2.1 peft_config.py: variant 'canonical' builds unfused q / k / v and gate / up adapters, estimated
    # (tests/test_peft_nemo1_corners.py counts them by hand)
    for variant in ("nemo", "canonical"):
        o = run(f"    lora_tuning:\n      variant: {variant}\n")
        assert not o.problems and o.code in (0, 1), o.describe()


@pytest.mark.parametrize("spec, rule", [
    ("{_target_: my_pkg.specs.my_hybrid_spec}", "the hybrid stack spec 'my_pkg.specs.my_hybrid_spec'"),
    ("3", "must name a layer spec"),
])
def test_a_hybrid_stack_spec_of_the_users_own_is_refused(spec, rule):
    # HybridModelProvider._resolve_hybrid_stack_spec builds the layers from hybrid_stack_spec when it is set: any value
    # was taken as megatron-core's TE hybrid stack (Bridge 0.6.2 models/hybrid/hybrid_provider.py)
    one_error(_hybrid_yaml(f"model.hybrid_stack_spec={spec}"), f"model.hybrid_stack_spec: {rule}")
    default = _json(_hybrid_yaml("model.hybrid_stack_spec={_target_: megatron.core.models.hybrid.hybrid_layer_specs."
                                 "hybrid_stack_spec, _call_: false}"))
    assert default["stages"] == _json(_hybrid_yaml())["stages"]


def test_run_recipe_with_the_short_nemotron_name():
    # run_recipe.py loads megatron.bridge.recipes.<--recipe> and stops with "Recipe 'nemotronh_8b' not found": memguard
    # said the recipe 'nemotronh_8b' was one it "has no entry for (nemotronh_8b is one...)" (the 'nemotronh_' prefix of
    # the unmodelled Nemotron-H recipes matched first)
    launch = "torchrun --nproc-per-node 8 scripts/training/run_recipe.py --recipe {} --mode pretrain\n"
    check_error(launch.format("nemotronh_8b"), "--recipe nemotronh_8b: is not a recipe function of megatron.bridge.recipes",
                "--recipe nemotronh_8b_pretrain_config")
    o = run_memguard(["check", "--file", "run.sh"], {"run.sh": launch.format("nemotronh_8b_pretrain_config")}, cpu_limit=2.0)
    assert not o.problems and o.code == 0, o.describe()
    check_error(launch.format("nemotronh_4b_pretrain_config"), "a Nemotron-H recipe memguard has no entry for")


def check_error(script: str, *needles) -> None:
    """memguard check's refusal: the error line naming the key, then its DO NOT LAUNCH line (exit 2)."""
    o = run_memguard(["check", "--file", "run.sh"], {"run.sh": script}, cpu_limit=2.0)
    assert not o.problems and o.code == 2, o.describe()
    first, *rest = o.err.strip().splitlines()
    assert first.startswith("memguard check: error: ") and rest == ["memguard check: DO NOT LAUNCH - not checked (exit 2)"], o.err
    for n in needles:
        assert n in first, first
