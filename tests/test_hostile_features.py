"""Hostile input to this round's features, found by the property suite and the fuzz
(tests/test_fuzz_cli.py test_new_feature_inputs_with_hostile_values): each exits 2 with one error line
naming the flag and the rule, within a CPU bound far below the fuzz's hang guard."""
import pytest

from fuzz_util import SMALL, run_memguard

MOE = SMALL + ["--num-experts", "8", "--moe-router-topk", "2", "--expert-model-parallel-size", "2", "--sequence-parallel",
               "--position-embedding-type", "rope"]


def one_error(o, *needles):
    assert not o.problems, o.describe()
    lines = o.err.strip().splitlines()
    assert o.code == 2 and len(lines) == 1 and lines[0].startswith("memguard: error: "), o.err
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


# Megatron's argparse refuses a value outside a flag's choices at start-up, even with the feature off
# (megatron/training/arguments.py, core 0.19.2); these were estimated as if the flag were absent.
@pytest.mark.parametrize("flag, value, choices", [
    ("--fp8-recipe", "x", "tensorwise, delayed, mxfp8, blockwise, custom"),
    ("--fp4-recipe", "x", "nvfp4, custom"),
    ("--data-parallel-sharding-strategy", "", "no_shard, optim, optim_grads, optim_grads_params"),
    ("--moe-flex-dispatcher-backend", "x", "deepep, hybridep, ncclep"),
    ("--moe-token-drop-policy", "0", "probs, position"),
    ("--moe-router-score-function", "x", "softmax, sigmoid, sqrtsoftplus"),
    ("--optimizer", "x", "adam, sgd, muon, dist_muon, lion, soap, adaptive_muon"),
])
def test_values_outside_megatrons_choices(flag, value, choices):
    o = run_memguard(["estimate", "--world-size", "8", "--", *MOE, flag, value])
    one_error(o, f"{flag}: must be one of {choices} (Megatron's choices), got {value!r}")


# Megatron's newer choices (were refused as not modelled, tests/test_moe_router_variants.py models them): an
# older --megatron-version names the release that added them (sqrtsoftplus: 0.18; quantile balancing: 0.19)
@pytest.mark.parametrize("flag, value, version, rule", [
    ("--moe-router-load-balancing-type", "quantile_balancing", "0.18", "quantile_balancing needs megatron-core >= 0.19"),
    ("--moe-router-score-function", "sqrtsoftplus", "0.17", "sqrtsoftplus needs megatron-core >= 0.18"),
])
def test_megatron_choices_of_newer_releases(flag, value, version, rule):
    ok = run_memguard(["estimate", "--world-size", "8", "--", *MOE, "--disable-bias-linear", flag, value])
    assert ok.code in (0, 1) and not ok.err.strip(), ok.err
    one_error(run_memguard(["estimate", "--world-size", "8", "--megatron-version", version, "--", *MOE,
                            "--disable-bias-linear", flag, value]), f"{flag}: {rule}")


def test_mtp_depth_is_bounded():
    # `memguard plan ... --mtp-num-layers 10000` ran past the fuzz's 90 s (the MTP block is listed per depth
    # for every layout tried); 4,000 took 4.4 s
    argv = ["plan", "--gpus", "8", "--seq-length", "512", "--global-batch-size", "16", "--", *MOE, "--mtp-num-layers", "10000"]
    o = run_memguard(argv)
    one_error(o, "--mtp-num-layers: must be <= 100")
    assert o.cpu < 5


def test_expert_weights_per_rank_are_bounded():
    # 10,000 layers of 65,536 experts (each within its own bound) ran past 60 s: 1.3 billion expert weights
    # (fc1 and fc2 of each expert, no biases)
    flags = [*SMALL, "--num-layers", "10000", "--num-experts", "65536", "--moe-router-topk", "2", "--sequence-parallel",
             "--disable-bias-linear"]   # (experts with biases need ETP 1: TransformerConfig)
    o = run_memguard(["estimate", "--world-size", "8", "--", *flags])
    one_error(o, "--num-experts: 65,536 local experts", "make 1,310,720,000 expert weights per rank", "at most 500,000")
    assert o.cpu < 5


@pytest.mark.parametrize("model, words", [
    # a Bridge recipe memguard refuses: the refusal, not "overrides need --model RECIPE" (it was one)
    ("deepseek_v4_flash_pretrain_config", "--model: the Megatron-Bridge recipe 'deepseek_v4_flash_pretrain_config'"),
    ("qwen3_30b_a3b_x", "--model: unknown model 'qwen3_30b_a3b_x'"),
    ("gpt3-126m", "--set: KEY=VALUE overrides need --config FILE"),
])
def test_overrides_with_a_model_that_is_not_a_recipe(model, words):
    o = run_memguard(["estimate", "--model", model, "--gpus", "8", "--set", "model.num_moe_experts=4"])
    line = one_error(o, words)
    if model == "gpt3-126m":
        assert "(--model 'gpt3-126m' is a model preset, not a recipe)" in line


@pytest.mark.parametrize("flag", ["--expert-tensor-parallel-size", "--expert-model-parallel-size", "--moe-ffn-hidden-size"])
def test_plan_reads_moe_counts_with_their_bounds(flag):
    # memguard plan converted the raw value with int(): a 5000-digit value was an internal error
    argv = ["plan", "--gpus", "8", "--seq-length", "512", "--global-batch-size", "16", "--", *MOE, flag, "1" * 5000]
    one_error(run_memguard(argv), f"{flag}: must be <= 2147483647, got '1111", "(5000 characters)")


# Found by benchmarks/hostile_input.py at the end of the session: a 100 KB '$($(...' layout took 20 s of CPU
# in the layout's regular expression (it now refuses the character first), and a start record whose
# 'predicted' is not an object was an internal error in `memguard report`.
@pytest.mark.parametrize("layout, bad", [("$(" * 50_000, "$"), ("(" * 100_000, "("), ("(t" * 50_000, "(")])
def test_hostile_pipeline_layout_is_refused_quickly(layout, bad):
    o = run_memguard(["estimate", "--world-size", "8", "--", *SMALL, "--pipeline-model-parallel-size", "2",
                      "--pipeline-model-parallel-layout", layout], cpu_limit=2.0)
    one_error(o, f"--pipeline-model-parallel-layout: unknown layer character {bad!r}")


@pytest.mark.parametrize("predicted", ['"1000"', "1000", "[1]", '{"peak_allocated": 1, "moe_worst_case": 5}'])
def test_report_start_record_with_a_prediction_that_is_not_an_object(predicted):
    start = ('{"schema": "memguard.runtime/1", "event": "start", "rank": 0, "source": "static", '
             f'"interval": 10, "tolerance": 0.05, "predicted": {predicted}}}')
    o = run_memguard(["report", "."], {"memguard-rank0.jsonl": start + "\n"})
    one_error(o, "memguard-rank0.jsonl line 1: 'predicted", "must be an object")
