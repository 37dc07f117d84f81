"""An MoE user's walk through the CLI (issue 16): what `memguard estimate` and `memguard report` show a
user who trains Mixtral / Qwen3-MoE / DeepSeek-V3, checked against published figures and Megatron CI's
GPU measurements.

Published parameter counts:
* Mixtral-8x7B: 46,702,792,704 (the safetensors total of mistralai/Mixtral-8x7B-v0.1), "12.9B active"
  (Mistral AI, "Mixtral of experts", 2023-12-11); by hand, 6 unpicked experts of 3 x 4096 x 14336 in each
  of 32 layers: 46,702,792,704 - 32 x 6 x 176,160,768 = 12,879,925,248.
* Qwen3-30B-A3B: "30.5B total, 3.3B activated" (Qwen/Qwen3-30B-A3B model card); by hand
  30,532,122,624 - 48 layers x 120 x 3 x 2048 x 768 = 3,353,032,704.
* DeepSeek-V3: "671B total, 37B activated" (DeepSeek-V3 technical report, arXiv 2412.19437, without the
  MTP module); by hand 671,026,404,352 - 58 MoE layers x 248 x 3 x 7168 x 2048 = 37,552,282,624.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from shared_data import CONFIGS, MOE_RECORDS  # noqa: E402

MIXTRAL_YAML = os.path.join(CONFIGS, "nemo-launcher", "mixtral_mixtral_8x7b.yaml")
TRAIN = ["--micro-batch-size", "1", "--global-batch-size", "256", "--seq-length", "4096", "--bf16"]
# Mixtral on 64 GPUs, TP2 (ETP 2 by default) PP4 EP8: expert DP = 64 / (2 x 8 x 4) = 1
MIXTRAL_64 = TRAIN + ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--pipeline-model-parallel-size", "4",
                      "--expert-model-parallel-size", "8", "--use-distributed-optimizer", "--moe-grouped-gemm",
                      "--moe-token-dispatcher-type", "alltoall"]


def memguard(*argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ROOT}
    return subprocess.run([sys.executable, "-m", "megatron_memguard.cli.main", *argv], capture_output=True, text=True,
                          env=env, timeout=120, cwd=ROOT)


@pytest.mark.parametrize("model, total, active, shown", [
    ("mixtral-8x7b", 46_702_792_704, 12_879_925_248, "46.70B parameters, 12.88B active per token"),
    ("qwen3-30b-a3b", 30_532_122_624, 3_353_032_704, "30.53B parameters, 3.35B active per token"),
    ("deepseek-v3", 671_026_404_352, 37_552_282_624, "671.03B parameters, 37.55B active per token"),
])
def test_published_total_and_active_parameters(model, total, active, shown):
    # TP 1: Megatron pads no vocabulary row of these three (32000, 151936, 129280 are multiples of 128)
    p = memguard("estimate", "--model", model, "--world-size", "8", "--json", "--", *TRAIN)
    assert p.returncode in (0, 1), p.stderr
    assert json.loads(p.stdout)["model_parameters"] == {"total": total, "active": active}
    text = memguard("estimate", "--model", model, "--world-size", "8", "--", *TRAIN).stdout
    assert shown in text.splitlines()[2] and text.splitlines()[2].startswith("experts: ")


def test_dense_documents_and_text_unchanged():
    p = memguard("estimate", "--model", "llama-3.1-8b", "--world-size", "8", "--json", "--", *TRAIN)
    assert "model_parameters" not in json.loads(p.stdout)
    text = memguard("estimate", "--model", "llama-3.1-8b", "--world-size", "8", "--", *TRAIN).stdout
    assert "experts:" not in text and " EP" not in text.splitlines()[3]


@pytest.mark.skipif(not os.path.exists(MIXTRAL_YAML), reason="needs ../shared/configs")
def test_launcher_yaml_shows_the_expert_grid_and_a_padded_worst_case_within_the_threshold():
    out = memguard("estimate", "--config", MIXTRAL_YAML).stdout
    lines = out.splitlines()
    # the launcher file: 8 nodes x 8 GPUs, TP1 PP4 VPP8 EP8 (ETP follows TP): expert DP = 64 / (1 x 8 x 4) = 2
    assert lines[4].startswith("layout: TP1 PP4 (VPP 8) CP1 DP16 EP8 ETP1 (expert DP 2),")
    assert "46.70B parameters, 12.88B active per token" in lines[2]
    # moe_pad_expert_input_to_capacity: every step carries C E ETP rows, C = 4096 x 2 / 8 x 1.0 = 1024, so
    # the worst case is the estimate and no routing can exceed it
    moe = next(ln for ln in lines if ln.startswith("MoE routing:"))
    assert "8,192 token rows" in moe and "worst case (padded to a capacity of 1024" in moe
    assert "within the 80% threshold: no routing can run this stage out of memory" in moe


def test_dropless_worst_case_share_of_the_gpu_agrees_with_the_json():
    js = json.loads(memguard("estimate", "--model", "mixtral-8x7b", "--world-size", "64", "--json", "--",
                             *MIXTRAL_64).stdout)
    text = memguard("estimate", "--model", "mixtral-8x7b", "--world-size", "64", "--", *MIXTRAL_64).stdout
    assert "layout: TP2 PP4 CP1 DP8 EP8 ETP2 (expert DP 1)," in text
    crit = js["stages"][js["critical_stage"]]
    share = crit["moe"]["worst_case"]["device_total_bytes"] / js["gpu_memory_bytes"]
    # dropless: every token of the EP x ETP group may pick this rank's one expert: 4 x the balanced rows
    assert crit["moe"]["expert_rows_worst"] == 4 * crit["moe"]["expert_rows_balanced"]
    assert js["verdict"] == "fits" and share > 0.8
    moe = next(ln for ln in text.splitlines() if ln.startswith("MoE routing:"))
    assert f"= {share:.0%} of the GPU, over the 80% threshold: the stage relies on the router balancing its load" in moe


@pytest.mark.skipif(not os.path.exists(MIXTRAL_YAML), reason="needs ../shared/configs")
def test_detail_splits_moe_layers_and_names_virtual_chunks_once():
    js = json.loads(memguard("estimate", "--config", MIXTRAL_YAML, "--json").stdout)
    crit = js["stages"][js["critical_stage"]]
    terms = {t["name"]: t for t in crit["terms"]}
    la, moe = terms["layer_activations"], terms["moe_layer_activations"]
    assert la["detail"].startswith("8 chunks of 1 layer x ")       # VPP 8: one layer per chunk
    assert "counted in moe_layer_activations" in la["detail"] and "balanced routing" in moe["detail"]
    # the per-layer size covers both terms: layers in flight x per layer = layer_activations + moe_layer_activations
    per_layer_mib = float(la["detail"].split(" x ")[1].split(" MiB")[0])
    held = crit["in_flight"]
    assert abs(la["bytes"] + moe["bytes"] - held * per_layer_mib * 2**20) <= held * 0.05 * 2**20
    text = memguard("estimate", "--config", MIXTRAL_YAML, "--detail").stdout
    assert "8 chunks of 1 layer x" in text and "router, token dispatcher and expert tensors" in text


def test_rotary_models_get_no_max_position_note_learned_ones_do():
    rope = memguard("estimate", "--model", "mixtral-8x7b", "--world-size", "8", "--", *TRAIN).stdout
    assert "--max-position-embeddings not given" not in rope
    learned = memguard("estimate", "--world-size", "8", "--", *TRAIN, "--num-layers", "2", "--hidden-size", "256",
                       "--num-attention-heads", "4", "--vocab-size", "1024", "--tokenizer-type", "NullTokenizer").stdout
    # (a Megatron-LM command line without it: validate_args would not start, the note says so, rotary or not)
    assert "--max-position-embeddings not given: Megatron-LM's validate_args requires it" in learned


@pytest.mark.skipif(not os.path.exists(MOE_RECORDS), reason="needs ../shared/groundtruth")
def test_report_of_a_megatron_moe_log_shows_the_worst_case_bound(tmp_path):
    from megatron_logs import args_of, print_args, report_memory, training_log
    test = "gpt3_mcore_te_tp2_pp1_te_8experts2parallel_overlap_grad_reduce_param_gather_groupedGEMM"
    rec = next(r for r in map(json.loads, open(MOE_RECORDS)) if r["test"] == test and r["platform"] == "dgx_h100")
    flags = []
    for k, v in rec["model_args"].items():
        if v is True:
            flags.append(k)
        elif v not in (False, None):
            flags += [k, *str(v).split()]
    lines = print_args(args_of(flags, rec["world_size"]))
    peak, alloc = rec["mem_max_allocated_bytes"], rec["mem_allocated_bytes"]
    for it in ("10", "20", "50"):   # Megatron CI's H100 measurements of the last rank (7), iterations 10-50
        lines.append(training_log(int(it), 50, int(it) * 32, 32))
        lines.append(report_memory(7, f"(after {it} iterations)", int(alloc[it]), int(peak[it]), int(peak[it]),
                                   int(peak[it])))
    (tmp_path / "train.log").write_text("\n".join(lines) + "\n")
    p = memguard("report", str(tmp_path / "train.log"), "--env", "CUBLAS_WORKSPACE_CONFIG=:4096:8")
    assert p.returncode == 0, p.stdout + p.stderr
    moe = next(ln for ln in p.stdout.splitlines() if ln.startswith("pp0 MoE routing:"))
    # top-1 sinkhorn over 8 experts, EP 2: the measured 3,300,554,752 B lies between the balanced estimate
    # (1-2% below it) and the dropless bound
    assert "measured peak allocated 3.07 GiB" in moe and "(above the balanced estimate, within the bound)" in moe
    js = json.loads(memguard("report", str(tmp_path / "train.log"), "--env", "CUBLAS_WORKSPACE_CONFIG=:4096:8",
                             "--json").stdout)
    rank = js["ranks"][0]
    assert rank["predicted_peak_allocated"] < 3_300_554_752 < rank["predicted_moe_worst_case"]["peak_allocated_bytes"]


@pytest.mark.skipif(not os.path.exists(MIXTRAL_YAML), reason="needs ../shared/configs")
def test_launcher_overrides_as_the_launcher_spells_them():
    # NeMo-Framework-Launcher's main.py takes the training group's keys as training.model.x; on the training
    # file itself they are model.x: MBS 4 gives 256 / (4 x DP 16) = 4 micro-batches
    out = memguard("estimate", "--config", MIXTRAL_YAML, "--set", "training.model.micro_batch_size=4").stdout
    assert "batch:  seq 4096, MBS 4, GBS 256 (4 micro-batches)" in out
    # a section the file does not have is named, not silently dropped
    out = memguard("estimate", "--config", MIXTRAL_YAML, "--set", "foo.micro_batch_size=4").stdout
    assert "MBS 1, GBS 256 (16 micro-batches)" in out and "note: foo.micro_batch_size: the config has no 'foo' section; ignored" in out


def test_check_suggests_overrides_in_the_launchs_own_spelling():
    # Bridge's DeepSeek-V3 recipe on its 1,024 H100s is tight without recomputation; the fix (the recompute
    # ladder's first rung that fits: the norms and the expert activation, tests/test_recompute_ladder.py) is
    # given as the run_recipe.py overrides that set it, a YAML list for the modules
    launch = ["check", "--", "torchrun", "--nnodes", "128", "--nproc-per-node", "8", "scripts/training/run_recipe.py",
              "--recipe", "deepseek_v3_pretrain_config", "model.moe_flex_dispatcher_backend=deepep"]
    p = memguard(*launch)
    line = next(ln for ln in p.stdout.splitlines() if ln.startswith("a layout that fits:"))
    fix = "model.recompute_granularity=selective, model.recompute_modules=[layernorm,moe_act]"
    assert line.endswith(": " + fix) and "59.89 GiB (fits)" in line
    assert "--recompute" not in line and p.returncode == 1
    # the same launch with the suggested overrides is OK to launch, at the suggested peak
    again = memguard(*launch, *fix.split(", "))
    assert again.returncode == 0 and "critical stage pp1 needs 59.89 GiB" in again.stdout


def test_deepseek_recipes_say_they_train_with_a_null_tokenizer_vocabulary():
    # Bridge 0.6.2 recipes/deepseek/h100/deepseek_v3.py: cfg.tokenizer.vocab_size = DEFAULT_NULL_TOKENIZER_VOCAB_SIZE
    # (32000, recipes/utils/tokenizer_utils.py), padded to 1280 x TP 2 = 2560: 33,280 rows, not DeepSeek-V3's 129,280
    out = memguard("estimate", "--model", "deepseek_v3", "--gpus", "1024", "--set",
                   "model.moe_flex_dispatcher_backend=deepep").stdout
    assert ", vocab 33280" in out.splitlines()[1]
    assert "note: recipe deepseek_v3: the recipe trains with Bridge's NullTokenizer of 32,000 tokens" in out
    # with the model's own vocabulary (and the recipe's MTP layer): 671.03B + the MTP layer and its eh_proj/norms
    # + the padding of 129,280 to 130,560 rows (x 2: untied)
    out = memguard("estimate", "--model", "deepseek_v3", "--gpus", "1024", "--set", "model.moe_flex_dispatcher_backend=deepep",
                   "--set", "tokenizer.vocab_size=129280").stdout
    assert ", vocab 130560" in out.splitlines()[1]


def test_default_dispatcher_is_named_when_the_run_does_not_give_one():
    # megatron/training/arguments.py (0.16.1, 0.19.2): --moe-token-dispatcher-type defaults to allgather
    note = "--moe-token-dispatcher-type not given: Megatron's default, allgather, is"
    base = ["--model", "mixtral-8x7b", "--world-size", "64", "--", *TRAIN, "--pipeline-model-parallel-size", "4",
            "--expert-model-parallel-size", "8"]
    assert note + " estimated" in memguard("estimate", *base).stdout
    assert note not in memguard("estimate", *base, "--moe-token-dispatcher-type", "allgather").stdout
    assert note not in memguard("estimate", *base[:-1], "1").stdout          # EP 1: no dispatch between ranks
    plan = ["plan", "--gpus", "64", "--seq-length", "4096", "--global-batch-size", "256", "--model", "mixtral-8x7b",
            "--top", "1", "--", "--bf16"]
    assert note + " planned" in memguard(*plan).stdout
    assert note not in memguard(*plan, "--moe-token-dispatcher-type", "alltoall").stdout


def test_check_spells_a_recipes_own_keys_as_overrides():
    from megatron_memguard.cli.check import _spelled
    from megatron_memguard.readers.models import read_model
    raw = read_model("qwen3_30b_a3b_8gpu")     # origin: "model.pipeline_model_parallel_size (recipe ...)"
    assert _spelled(raw, "pipeline_model_parallel_size", 4) == "model.pipeline_model_parallel_size=4"
    assert _spelled(raw, "micro_batch_size", 1) == "train.micro_batch_size=1"
    flags = read_model("mixtral-8x7b")          # a preset: Megatron flags
    assert _spelled(flags, "micro_batch_size", 1) == "--micro-batch-size 1"
