"""memguard check: launch commands as wrappers run them (Megatron-LM example scripts, NeMo launcher sbatch
scripts, Megatron-Bridge run_recipe launches, srun with --ntasks-per-node), exit codes, never guessing."""
import importlib.util
import json
import os
import shutil
import textwrap

import pytest

from megatron_memguard import estimate, layout_from_flags, lookup_gpu
from megatron_memguard.cli.main import main
from megatron_memguard.readers.launch_command import parse_launch_command, parse_launch_script, split_script_args

from conftest import LLAMA31_8B, LLAMA31_70B

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
LAUNCH = os.path.join(HERE, "data", "launch")
from benchmarks.shared_data import CONFIGS  # noqa: E402
needs_omegaconf = pytest.mark.skipif(importlib.util.find_spec("omegaconf") is None,
                                     reason="reading NeMo YAML needs omegaconf")

SMALL = LLAMA31_8B + ["--micro-batch-size", "1", "--global-batch-size", "64", "--tensor-model-parallel-size", "2",
                      "--sequence-parallel", "--use-distributed-optimizer"]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for k in list(os.environ):
        if k.startswith(("SLURM_", "PET_", "MEMGUARD")) or k in ("WORLD_SIZE", "NNODES", "NUM_NODES"):
            monkeypatch.delenv(k)


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def check_json(capsys, *argv):
    code, out, err = run(capsys, "check", "--json", *argv)
    return code, json.loads(out), err


# --------------------------------------------------------------------------------------------------
# Megatron-LM launches
# --------------------------------------------------------------------------------------------------
def test_torchrun_fits_and_prints_one_screen(capsys):
    code, out, _ = run(capsys, "check", "--", "torchrun", "--nnodes", "2", "--nproc-per-node", "8", "pretrain_gpt.py", *SMALL)
    assert code == 0
    assert "world:  16 ranks (torchrun --nnodes 2 x --nproc-per-node 8)" in out
    assert "verdict: FITS" in out and out.rstrip().endswith("memguard check: OK to launch")
    assert len(out.splitlines()) <= 25  # one screen
    # the same numbers as memguard estimate for that layout
    est = estimate(layout_from_flags(SMALL, world_size=16), gpu=lookup_gpu("H100-80GB"))
    code, doc, _ = check_json(capsys, "--", "torchrun", "--nnodes", "2", "--nproc-per-node", "8", "pretrain_gpt.py", *SMALL)
    assert doc["stages"][0]["device_total_bytes"] == est.stages[0].device_total_bytes
    assert doc["launch"]["world_size"] == 16 and doc["launch"]["kind"] == "megatron" and doc["ok"] is True


def test_will_not_fit_exits_1_with_a_suggestion(capsys):
    big = LLAMA31_70B + ["--micro-batch-size", "4", "--global-batch-size", "256", "--tensor-model-parallel-size", "8",
                         "--use-distributed-optimizer", "--sequence-parallel"]
    code, out, _ = run(capsys, "check", "--", "torchrun", "--nnodes=8", "--nproc_per_node=8", "pretrain_gpt.py", *big)
    assert code == 1 and "WILL NOT FIT" in out
    assert "a layout that fits: MBS" in out and "--micro-batch-size" in out
    assert out.rstrip().splitlines()[-1].startswith("memguard check: DO NOT LAUNCH - the critical stage will not fit")


def test_python_m_torch_distributed_run_and_launch(capsys):
    for mod in ("torch.distributed.run", "torch.distributed.launch"):
        code, doc, _ = check_json(capsys, "--", "python3", "-u", "-m", mod, "--nproc_per_node=4", "--nnodes=2",
                                  "--use-env" if mod.endswith("launch") else "--standalone", "pretrain_gpt.py", *SMALL)
        assert code == 0 and doc["launch"]["world_size"] == 8 and doc["launch"]["launcher"] == mod


def test_megatron_example_script_style(capsys):
    # Megatron-LM's examples/gpt3/train_gpt3_175b_distributed.sh: arrays expanded unquoted, comments inside
    # arrays, $1..$5, $((arithmetic)).
    code, doc, _ = check_json(capsys, "--vocab-size", "50257", "--file", os.path.join(LAUNCH, "train_gpt3_175b_distributed.sh"))
    lay = doc["layout"]
    assert doc["launch"]["world_size"] == 128 and lay["tensor_model_parallel_size"] == 8
    assert lay["pipeline_model_parallel_size"] == 8 and lay["data_parallel_size"] == 2 and lay["num_layers"] == 96
    assert lay["env"]["CUDA_DEVICE_MAX_CONNECTIONS"] == "1" and lay["attention_backend"] == "auto"
    assert code in (0, 1)


def test_bundled_example_still_works(capsys):
    code, out, _ = run(capsys, "check", "--file", os.path.join(ROOT, "examples", "llama3_8b_h100.sh"))
    assert code == 0 and "16 ranks" in out


def test_environment_assignments_quoting_and_continuations(capsys):
    script = textwrap.dedent("""\
        #!/bin/bash
        set -euo pipefail
        cd "$(dirname "$0")"   # the launcher's directory
        echo "starting pretrain_gpt.py (attempt 1)"
        MODEL="--num-layers 32 --hidden-size 4096"
        CUDA_DEVICE_MAX_CONNECTIONS=1 NVTE_FUSED_ATTN=0 exec env -u PYTHONPATH torchrun \\
            --nproc-per-node=8 --nnodes 2 --rdzv-backend=c10d --rdzv-endpoint "${MASTER_ADDR:-node001}:29500" \\
            pretrain_gpt.py $MODEL --ffn-hidden-size 14336 --num-attention-heads 32 --group-query-attention \\
            --num-query-groups 8 --seq-length 8192 --max-position-embeddings 8192 --swiglu \\
            --untie-embeddings-and-output-weights --normalization RMSNorm --disable-bias-linear \\
            --position-embedding-type rope --tokenizer-type NullTokenizer --vocab-size 128256 --bf16 \\
            --micro-batch-size 1 --global-batch-size 64 --tensor-model-parallel-size 2 --sequence-parallel \\
            --use-distributed-optimizer --data-path "/data/my corpus_text_document" \\
            --wandb-exp-name 'run; with && odd | chars' 2>&1 | tee "logs/run $(date +%s).log"
        """)
    cmd = parse_launch_script(script, environ={})
    assert cmd.world_size == 16 and cmd.script == "pretrain_gpt.py"
    assert cmd.env == {"CUDA_DEVICE_MAX_CONNECTIONS": "1", "NVTE_FUSED_ATTN": "0"}
    assert "/data/my corpus_text_document" in cmd.script_args
    assert "run; with && odd | chars" in cmd.script_args
    assert cmd.script_args[-1] == "run; with && odd | chars"  # the redirection and the pipe to tee are gone
    i = cmd.script_args.index("--num-layers")
    assert cmd.script_args[i + 1] == "32"


def test_unknown_launcher_options(capsys):
    # An option not in torchrun's table: followed by the program -> a flag; followed by a word that cannot be
    # the program -> its value. Both noted; the world size is still torchrun's.
    cmd = parse_launch_command(["torchrun", "--nnodes", "2", "--nproc-per-node", "8", "--future-flag",
                                "pretrain_gpt.py", "--num-layers", "2"], {})
    assert cmd.world_size == 16 and cmd.script == "pretrain_gpt.py"
    assert any("--future-flag" in n and "flag" in n for n in cmd.notes)
    cmd = parse_launch_command(["torchrun", "--future-opt", "value", "--nproc_per_node", "4", "train.py"], {})
    assert cmd.script == "train.py" and cmd.world_size == 4 and any("'value'" in n for n in cmd.notes)
    # argparse prefixes: --nproc is torchrun's --nproc-per-node
    assert parse_launch_command(["torchrun", "--nproc", "4", "--nn", "3", "x.py"], {}).world_size == 12
    # srun options with values never taken for the program; unknown ones with = are fine
    cmd = parse_launch_command(["srun", "-N", "2", "--ntasks-per-node=8", "--mpi", "pmix", "-l", "--kill-on-bad-exit=1",
                                "--container-image", "nvcr.io/nvidia/pytorch:25.01-py3", "--some-new-opt=3", "-K",
                                "python", "-u", "pretrain_gpt.py", "--num-layers", "4"], {})
    assert cmd.world_size == 16 and cmd.script == "pretrain_gpt.py" and cmd.launcher == "srun"
    assert cmd.world_size_from == "srun --nodes 2 x --ntasks-per-node 8"


def test_srun_world_sizes(capsys):
    flags = " ".join(SMALL)
    assert parse_launch_script(f"srun -n 32 python pretrain_gpt.py {flags}", {}).world_size == 32
    assert parse_launch_script(f"srun -N2 --ntasks-per-node 8 python pretrain_gpt.py {flags}", {}).world_size == 16
    # inside an allocation: srun without sizes takes the job's
    env = {"SLURM_NNODES": "4", "SLURM_NTASKS_PER_NODE": "8(x4)"}
    assert parse_launch_script(f"srun python pretrain_gpt.py {flags}", env).world_size == 32
    assert parse_launch_script(f"srun python pretrain_gpt.py {flags}", {"SLURM_NTASKS": "24"}).world_size == 24
    # srun starting one torchrun per node
    cmd = parse_launch_script(
        "srun --nodes=4 --ntasks-per-node=1 bash -c 'torchrun --nnodes $SLURM_NNODES --nproc-per-node 8 "
        "--rdzv-endpoint $MASTER_ADDR:29500 --rdzv-backend c10d pretrain_gpt.py --num-layers 2'", {"SLURM_NNODES": "4"})
    assert cmd.world_size == 32 and cmd.launcher == "torchrun" and cmd.wrappers == ("srun", "bash -c")
    # mpirun
    assert parse_launch_script(f"mpirun -np 16 --map-by ppr:8:node -x NCCL_DEBUG python pretrain_gpt.py {flags}",
                               {}).world_size == 16


def test_sbatch_script_with_ntasks_per_node(capsys, tmp_path, monkeypatch):
    script = tmp_path / "job.sbatch"
    script.write_text(textwrap.dedent(f"""\
        #!/bin/bash
        #SBATCH --job-name=llama3-8b
        #SBATCH --nodes=4
        #SBATCH --ntasks-per-node=8      # one task per GPU
        #SBATCH --gpus-per-node=8
        #SBATCH --exclusive
        ARGS=({' '.join(SMALL)})
        srun --container-image nvcr.io/nvidia/pytorch:25.01-py3 --container-mounts "/lustre:/lustre" \\
             --no-container-mount-home --mpi=pmix -l \\
             python -u pretrain_gpt.py "${{ARGS[@]}}" 2>&1 | tee log.txt
        """))
    code, doc, _ = check_json(capsys, "--file", str(script))
    assert code == 0 and doc["launch"]["world_size"] == 32
    assert doc["launch"]["world_size_from"] == "srun SLURM_NNODES 4 x SLURM_NTASKS_PER_NODE 8"
    assert any("#SBATCH" in n for n in doc["notes"])
    # inside the job the allocation's variables win over the directives
    monkeypatch.setenv("SLURM_NNODES", "2")
    code, doc, _ = check_json(capsys, "--file", str(script))
    assert doc["launch"]["world_size"] == 16


def test_world_size_sources(capsys, monkeypatch):
    # python SCRIPT.py: WORLD_SIZE; --world-size wins over everything
    code, doc, _ = check_json(capsys, "--", "python", "pretrain_gpt.py", *SMALL)
    assert code == 2 and "number of GPUs is unknown" in doc["errors"][0]
    monkeypatch.setenv("WORLD_SIZE", "8")
    code, doc, _ = check_json(capsys, "--", "python", "pretrain_gpt.py", *SMALL)
    assert code == 0 and doc["launch"]["world_size"] == 8 and doc["launch"]["world_size_from"] == "WORLD_SIZE"
    code, doc, _ = check_json(capsys, "--world-size", "32", "--", "torchrun", "--nproc-per-node", "8", "pretrain_gpt.py", *SMALL)
    assert doc["launch"]["world_size"] == 32 and doc["launch"]["world_size_from"] == "--world-size"
    # torchrun's PET_* variables are its options' defaults
    monkeypatch.setenv("PET_NNODES", "4")
    cmd = parse_launch_command(["torchrun", "--nproc-per-node", "8", "pretrain_gpt.py"], dict(os.environ))
    assert cmd.world_size == 32


def test_nproc_per_node_gpu_takes_slurms_gpu_count():
    # docs/integrations.md: --nproc-per-node gpu|auto needs SLURM_GPUS_ON_NODE / SLURM_GPUS_PER_NODE. Slurm's
    # SLURM_GPUS_PER_NODE repeats --gpus-per-node as given, with the GPU type when the job names one
    # (sbatch --gpus-per-node=h100:8), as the #SBATCH line memguard reads itself may
    argv = ["torchrun", "--nnodes", "2", "--nproc-per-node", "gpu", "pretrain_gpt.py"]
    for env in ({"SLURM_GPUS_ON_NODE": "8"}, {"SLURM_GPUS_PER_NODE": "8"}, {"SLURM_GPUS_PER_NODE": "h100:8"},
                {"SLURM_GPUS_PER_NODE": "nvidia_h100_80gb_hbm3:8"}):
        assert parse_launch_command(argv, env).world_size == 16, env
    from megatron_memguard.errors import ReaderError
    with pytest.raises(ReaderError, match="depends on the machine"):
        parse_launch_command(argv, {"SLURM_GPUS_PER_NODE": "h100"})


def test_a_single_quoted_command_string(capsys):
    line = "CUDA_DEVICE_MAX_CONNECTIONS=1 torchrun --nproc-per-node 8 --nnodes 2 pretrain_gpt.py " + " ".join(SMALL)
    code, doc, _ = check_json(capsys, "--", line)
    assert code == 0 and doc["launch"]["world_size"] == 16 and doc["launch"]["env"] == {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}


# --------------------------------------------------------------------------------------------------
# Not understood: exit 2, never a guess
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv,needle", [
    (["deepspeed", "--num_gpus", "8", "train.py"], "deepspeed"),
    (["bash", "run.sh"], "not another script"),
    (["python", "-c", "import torch"], "inline code"),
    (["torchrun", "--nproc-per-node", "gpu", "pretrain_gpt.py"], "depends on the machine"),
    (["torchrun", "--nnodes", "$NNODES", "--nproc-per-node", "8", "pretrain_gpt.py"], "cannot evaluate"),
    (["torchrun", "--nnodes", "$(scontrol show hostnames | wc -l)", "--nproc-per-node", "8", "pretrain_gpt.py"], "cannot evaluate"),
    (["nsys", "profile", "-o", "x", "torchrun", "pretrain_gpt.py"], "Nsight"),
    (["torchrun", "--n", "8", "pretrain_gpt.py"], "ambiguous"),
    (["my_launcher", "--gpus", "8"], "cannot understand the launcher"),
])
def test_not_understood_exits_2(capsys, argv, needle):
    code, out, err = run(capsys, "check", "--", *argv)
    assert code == 2 and out == ""
    assert "cannot understand the launch command" in err and needle in err and "DO NOT LAUNCH" in err


def test_two_launch_commands_are_not_guessed(capsys, tmp_path):
    script = tmp_path / "two.sh"
    script.write_text("torchrun --nproc-per-node 8 pretrain_gpt.py --num-layers 2\n"
                      "torchrun --nproc-per-node 8 pretrain_gpt.py --num-layers 4\n")
    code, _, err = run(capsys, "check", "--file", str(script))
    assert code == 2 and "found 2 launch commands" in err
    # a data-preprocessing python next to the distributed launch is not the job
    script.write_text("python tools/preprocess_data.py --input x.json\n"
                      f"torchrun --nproc-per-node 8 pretrain_gpt.py {' '.join(SMALL)}\n")
    code, doc, _ = check_json(capsys, "--file", str(script))
    assert code == 0 and doc["launch"]["script"] == "pretrain_gpt.py"
    assert any("preprocess_data.py" in n for n in doc["notes"])


def test_here_documents_are_input_not_commands(capsys, tmp_path):
    # an apostrophe in a heredoc body is not an open quote; a launch line in a body is not the job
    script = tmp_path / "job.sh"
    script.write_text("cat > notes.txt <<EOF\nit's the 8B run\ntorchrun --nproc-per-node 2 other.py\nEOF\n"
                      "cat <<-'END' >> notes.txt\n\ttorchrun --nproc-per-node 4 old.py\n\tEND\n"
                      f"torchrun --nproc-per-node 8 pretrain_gpt.py {' '.join(SMALL)} <<< \"it's\"\n")
    code, doc, _ = check_json(capsys, "--file", str(script))
    assert code == 0 and doc["launch"]["script"] == "pretrain_gpt.py" and doc["launch"]["world_size"] == 8


def test_usage_errors(capsys, tmp_path):
    assert run(capsys, "check")[0] == 2
    assert run(capsys, "check", "--file", str(tmp_path / "missing.sh"))[0] == 2
    code, _, err = run(capsys, "check", "--config", "x.yaml")
    assert code == 2 and "--file" in err
    code, _, err = run(capsys, "check", "--set", "a.b=1", "--", "torchrun", "--nproc-per-node", "8", "pretrain_gpt.py", *SMALL)
    assert code == 2 and "KEY=VALUE" in err


# --------------------------------------------------------------------------------------------------
# NeMo 1 (Hydra) launches
# --------------------------------------------------------------------------------------------------
@pytest.fixture
def nemo_tree(tmp_path):
    """A NeMo checkout's examples/nlp/language_modeling: the script with its @hydra_runner and conf/."""
    d = tmp_path / "language_modeling"
    (d / "conf").mkdir(parents=True)
    shutil.copy(os.path.join(CONFIGS, "nemo1", "megatron_gpt_config.yaml"), d / "conf")
    (d / "megatron_gpt_pretraining.py").write_text(
        'from nemo.core.config import hydra_runner\n\n\n@hydra_runner(config_path="conf", config_name="megatron_gpt_config")\n'
        "def main(cfg) -> None:\n    ...\n")
    return d


@needs_omegaconf
def test_nemo1_launch_uses_the_scripts_hydra_defaults(capsys, nemo_tree):
    script = str(nemo_tree / "megatron_gpt_pretraining.py")
    code, doc, _ = check_json(capsys, "--", "python", script, "trainer.devices=8", "trainer.num_nodes=2",
                              "model.tensor_model_parallel_size=2", "model.global_batch_size=64")
    assert code == 0 and doc["launch"]["kind"] == "hydra"
    assert doc["launch"]["world_size"] == 16 and doc["launch"]["world_size_from"] == "trainer.devices x trainer.num_nodes"
    assert doc["layout"]["tensor_model_parallel_size"] == 2 and doc["layout"]["global_batch_size"] == 64
    # --config-path is relative to the script (as Hydra resolves it), --config-name may have .yaml
    code, doc2, _ = check_json(capsys, "--", "python", script, "--config-path", "conf", "--config-name=megatron_gpt_config.yaml",
                               "trainer.devices=8", "trainer.num_nodes=2", "model.tensor_model_parallel_size=2",
                               "model.global_batch_size=64")
    assert doc2["stages"] == doc["stages"]


@needs_omegaconf
def test_nemo1_world_size_contradiction_is_a_problem(capsys, nemo_tree):
    code, out, _ = run(capsys, "check", "--", "torchrun", "--nproc-per-node", "4", str(nemo_tree / "megatron_gpt_pretraining.py"),
                       "trainer.devices=8", "model.global_batch_size=64")
    assert code == 1 and "problem: trainer.devices x trainer.num_nodes = 8 but torchrun" in out


@needs_omegaconf
def test_nemo1_format_problem_stops_the_launch(capsys, nemo_tree):
    code, out, _ = run(capsys, "check", "--", "python", str(nemo_tree / "megatron_gpt_pretraining.py"),
                       "trainer.devices=8", "model.global_batch_size=64", "trainer.accumulate_grad_batches=2")
    assert code == 1 and "problem: trainer.accumulate_grad_batches: must be 1 for NeMo Megatron models, got 2" in out
    assert "DO NOT LAUNCH" in out


def test_nemo1_missing_config_is_reported(capsys, tmp_path):
    code, _, err = run(capsys, "check", "--", "python", str(tmp_path / "nowhere" / "megatron_gpt_pretraining.py"),
                       "trainer.devices=8")
    assert code == 2 and "--config-path and --config-name" in err


@needs_omegaconf
def test_nemo_launcher_sbatch_script(capsys, tmp_path, monkeypatch):
    # The sbatch script NeMo-Framework-Launcher writes: #SBATCH sizes, srun with pyxis options and a multi-line
    # bash -c "..." whose python3 reads the resolved <run>_hydra.yaml.
    shutil.copy(os.path.join(CONFIGS, "nemo-launcher", "gpt3_5b.yaml"), tmp_path / "gpt3_5b_hydra.yaml")
    monkeypatch.setenv("RESULTS_DIR", str(tmp_path))
    code, doc, _ = check_json(capsys, "--file", os.path.join(LAUNCH, "nemo_launcher_gpt3_5b.sbatch"))
    assert doc["launch"]["kind"] == "hydra" and doc["launch"]["wrappers"] == ["srun", "bash -c"]
    assert doc["launch"]["world_size"] == 128 and doc["launch"]["script"].endswith("megatron_gpt_pretraining.py")
    assert doc["problems"] == [] and code == 0
    assert doc["layout"]["env"]["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    assert doc["layout"]["env"]["TORCH_NCCL_AVOID_RECORD_STREAMS"] == "1"


# --------------------------------------------------------------------------------------------------
# Megatron-Bridge launches
# --------------------------------------------------------------------------------------------------
def test_bridge_run_recipe_with_overrides(capsys):
    code, doc, _ = check_json(capsys, "--", "torchrun", "--nproc_per_node=8", "--nnodes=2", "scripts/training/run_recipe.py",
                              "--recipe", "llama3_8b_pretrain_config", "model.tensor_model_parallel_size=2",
                              "model.sequence_parallel=true", "train.global_batch_size=128")
    assert code == 0 and doc["launch"]["kind"] == "bridge" and doc["launch"]["world_size"] == 16
    lay = doc["layout"]
    assert lay["tensor_model_parallel_size"] == 2 and lay["sequence_parallel"] and lay["global_batch_size"] == 128
    assert lay["num_layers"] == 32 and lay["hidden_size"] == 4096


def test_bridge_config_file_with_recipe_from_script_name(capsys):
    override = os.path.join(CONFIGS, "megatron-bridge", "llama32_1b_pretrain_override.yaml")
    code, doc, _ = check_json(capsys, "--", "python", "-m", "torch.distributed.run", "--nproc_per_node", "8",
                              "examples/recipes/llama/pretrain_llama32_1b.py", "--config-file", override,
                              "train.micro_batch_size=2", "train.global_batch_size=32")
    assert code == 0 and doc["launch"]["config_file"] == override
    assert doc["layout"]["micro_batch_size"] == 2 and doc["layout"]["seq_length"] == 4096
    assert any("taken from the script name" in n for n in doc["notes"])
    # without a recipe anywhere the override file has no shape: reported, with the hint from its name
    code, _, err = run(capsys, "check", "--", "torchrun", "--nproc_per_node", "8", "run.py", "--config-file", override)
    assert code == 2 and "--model llama32_1b" in err


def test_bridge_shortcuts_of_other_scripts_are_not_taken_on_trust(capsys):
    # a script other than run_recipe.py: its -tp may mean anything, so the user writes the override
    code, _, err = run(capsys, "check", "--", "torchrun", "--nproc_per_node=8", "scripts/my_pretrain.py",
                       "--recipe", "llama3_8b", "-tp", "4")
    assert code == 2 and "model.tensor_model_parallel_size=4" in err
    # -cp is the context-parallel shortcut here, not Hydra's --config-path, wherever it stands
    for args in (["--recipe", "llama3_8b", "-cp", "4"], ["-cp=4", "--recipe", "llama3_8b"]):
        code, _, err = run(capsys, "check", "--", "torchrun", "--nproc_per_node=8", "my_pretrain.py", *args)
        assert code == 2 and "-cp 4 (write model.context_parallel_size=4)" in err, err


# --------------------------------------------------------------------------------------------------
# Megatron-Bridge scripts/training/run_recipe.py (v0.6.0 and main), read as the script reads its arguments
# --------------------------------------------------------------------------------------------------
RUN_RECIPE = ["--", "torchrun", "--nnodes", "2", "--nproc-per-node", "8", "scripts/training/run_recipe.py"]


def rr_layout(capsys, *args):
    code, doc, err = check_json(capsys, *RUN_RECIPE, *args)
    return code, doc["layout"], doc


@pytest.mark.parametrize("args, needle", [
    # run_recipe.py cannot infer the mode of a name without _pretrain_ / _sft_ / _peft_, and
    # megatron.bridge.recipes exports no function named llama3_8b
    (["--recipe", "llama3_8b", "model.tensor_model_parallel_size=4"],
     "--mode: run_recipe.py cannot infer the training mode from --recipe llama3_8b (run_recipe.py takes the recipe "
     "function's full name: --recipe llama3_8b_pretrain_config, or --model llama3_8b --mode pretrain)"),
    (["--recipe", "llama3_8b", "--mode", "pretrain"], "run_recipe.py would stop with \"Recipe 'llama3_8b' not found\""),
    (["--model", "llama3_8b"], "--mode: run_recipe.py needs --mode with --model"),
    (["--recipe", "llama3_8b_pretrain_config", "--mode", "sft"], "--mode: sft is incompatible with recipe"),
    (["--model", "qwen3_8b", "--mode", "lora"], "--mode lora: the Megatron-Bridge PEFT recipe qwen3_8b_peft_config"),
    (["--model", "llama3_8b", "--mode", "lora", "--dataset", "mock"], "Mode 'lora' is incompatible with dataset 'mock'"),
    (["--recipe", "llama3_8b_pretrain_config", "--micro", "8"], "--micro: Unknown option of run_recipe.py"),
    (["--recipe", "llama3_8b_pretrain_config", "--config-file", "a.yaml"], "--config-file: Unknown option"),
    (["--recipe", "llama3_8b_pretrain_config", "8"], "8: run_recipe.py expects overrides in KEY=VALUE form"),
    (["--recipe", "llama3_8b_pretrain_config", "-mb", "two"], "argument -mb/--micro_batch_size: invalid int value"),
    (["--recipe", "llama3_8b_pretrain_config", "--dataset", "squad"], "incompatible with dataset 'squad'"),
    (["--recipe", "x_pretrain_config", "--model", "llama3_8b"], "not allowed with argument"),
])
def test_run_recipe_launches_that_cannot_start_exit_2(capsys, args, needle):
    code, _, err = run(capsys, "check", *RUN_RECIPE, *args)
    assert code == 2 and needle in err, err
    assert "OK to launch" not in err and "Traceback" not in err


def test_run_recipe_recipe_name_forms_load_the_same_recipe(capsys):
    forms = [["--recipe", "llama3_8b_pretrain_config"], ["--model", "llama3_8b", "--mode", "pretrain"],
             ["--recipe", "llama3_8b_pretrain_2gpu_h100_bf16_config", "--mode", "pretrain"],
             ["--recipe=llama3_8b_pretrain_config", "--dataset", "mock", "--dry-run"]]
    layouts = [rr_layout(capsys, *f)[1] for f in forms]
    assert all(L == layouts[0] for L in layouts)
    # the recipe: Llama 3 8B, CP 2, 8k tokens, MBS 1, GBS 512 (Bridge 0.6.2 llama3_8b_pretrain_2gpu_h100_bf16_config)
    L = layouts[0]
    assert (L["num_layers"], L["hidden_size"], L["context_parallel_size"], L["seq_length"]) == (32, 4096, 2, 8192)
    assert (L["micro_batch_size"], L["global_batch_size"], L["num_microbatches"]) == (1, 512, 512 // 8)


def test_run_recipe_options_change_memory_as_their_overrides(capsys):
    # --micro_batch_size 8 is train.micro_batch_size=8: 16 GPUs at CP 2 give DP 8, so 512 / (8 x 8) = 8 micro-batches
    _, opt, doc_opt = rr_layout(capsys, "--recipe", "llama3_8b_pretrain_config", "--micro_batch_size", "8")
    _, ovr, doc_ovr = rr_layout(capsys, "--recipe", "llama3_8b_pretrain_config", "train.micro_batch_size=8")
    assert opt == ovr and opt["micro_batch_size"] == 8 and opt["num_microbatches"] == 8
    assert doc_opt["verdict"] == doc_ovr["verdict"] == "will not fit" and doc_opt["ok"] is False
    short = ["-mb", "2", "-gb", "256", "-tp", "2", "-pp", "2", "-cp", "1", "-sl", "4096"]
    long = ["--micro_batch_size=2", "--global_batch_size", "256", "--tensor_model_parallel_size", "2",
            "--pipeline_model_parallel_size", "2", "--context_parallel_size", "1", "--seq_length", "4096"]
    keys = ["train.micro_batch_size=2", "train.global_batch_size=256", "model.tensor_model_parallel_size=2",
            "model.pipeline_model_parallel_size=2", "model.context_parallel_size=1", "dataset.seq_length=4096"]
    a, b, c = (rr_layout(capsys, "--recipe", "llama3_8b_pretrain_config", *x)[1] for x in (short, long, keys))
    assert a == b == c
    assert (a["tensor_model_parallel_size"], a["pipeline_model_parallel_size"], a["context_parallel_size"]) == (2, 2, 1)
    assert (a["micro_batch_size"], a["global_batch_size"], a["seq_length"], a["num_microbatches"]) == (2, 256, 4096, 32)
    # the options come first, the trailing KEY=VALUE overrides after them: the override wins
    _, L, doc = rr_layout(capsys, "--recipe", "llama3_8b_pretrain_config", "-mb", "2", "train.micro_batch_size=4")
    assert L["micro_batch_size"] == 4
    assert doc["launch"]["overrides"] == ["train.micro_batch_size=2", "train.micro_batch_size=4"]
    # options that do not change memory are named as such, not as unread
    _, _, doc = rr_layout(capsys, "--recipe", "llama3_8b_pretrain_config", "--lr", "3e-4", "-ms", "10")
    assert any(n.startswith("run_recipe.py settings that do not change memory: ") and "optimizer.lr=0.0003" in n
               for n in doc["notes"])
    assert not any("not read" in n for n in doc["notes"])


def test_run_recipe_sequence_length_follows_the_dataset(capsys):
    # sync_model_dataset_sequence_length copies dataset.seq_length into model.seq_length after the overrides
    for args in (["-sl", "4096"], ["dataset.seq_length=4096"]):
        _, L, doc = rr_layout(capsys, "--recipe", "llama3_8b_pretrain_config", *args)
        assert L["seq_length"] == 4096 and doc["problems"] == [] and doc["ok"] is True
    _, L, doc = rr_layout(capsys, "--recipe", "llama3_8b_pretrain_config", "model.seq_length=4096")
    assert L["seq_length"] == 8192 and doc["problems"] == []
    assert any(n.startswith("model.seq_length = 4096 is replaced by dataset.seq_length (recipe llama3_8b) = 8192: "
                            "run_recipe.py copies") for n in doc["notes"])
    # --dataset mock: a new dataset of the recipe model's length (before the overrides), so -sl still applies
    _, L, _ = rr_layout(capsys, "--recipe", "llama3_8b_pretrain_config", "--dataset", "mock", "-sl", "2048")
    assert L["seq_length"] == 2048


def test_run_recipe_deterministic(capsys):
    _, L, _ = rr_layout(capsys, "--recipe", "llama3_8b_pretrain_config", "--deterministic")
    _, base, _ = rr_layout(capsys, "--recipe", "llama3_8b_pretrain_config")
    # determinism_utils.apply_determinism_overrides: model.cross_entropy_loss_fusion=False and CUBLAS_WORKSPACE_CONFIG
    assert base["cross_entropy_loss_fusion"] is True and L["cross_entropy_loss_fusion"] is False
    assert L["env"]["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"


def test_split_script_args_kinds():
    def kind(*args):
        return split_script_args(parse_launch_command(["torchrun", "--nproc-per-node", "8", *args], {}))
    assert kind("pretrain_gpt.py", "--num-layers", "2").kind == "megatron"
    sa = kind("run.py", "--config-file", "a.yaml", "+train.x=1", "~model.teacher", "--dataset", "mock")
    assert sa.kind == "bridge" and sa.config_file == "a.yaml" and sa.overrides == ["+train.x=1", "~model.teacher"]
    assert sa.ignored == ["--dataset", "mock"]
    sa = kind("megatron_gpt_pretraining.py", "-cn", "x", "-cp", "conf", "trainer.devices=2")
    assert sa.kind == "hydra" and (sa.config_name, sa.config_path) == ("x", "conf")
    assert kind("run.py", "model.tensor_model_parallel_size=2").kind == "bridge"
    assert kind("run.py", "trainer.devices=2", "model.x=1").kind == "hydra"


def test_the_hooks_own_flags_are_read_not_reported_as_unknown(capsys):
    code, doc, _ = check_json(capsys, "--", "torchrun", "--nproc-per-node", "8", "--nnodes", "2", "pretrain_gpt.py", *SMALL,
                              "--memguard", "abort", "--memguard-threshold", "0.5", "--memguard-reset-peak",
                              "--memguard-gpu-memory=40GiB", "--memguard-log-dir", "logs")
    assert doc["threshold"] == 0.5 and doc["gpu_memory_bytes"] == 40 * 2**30
    assert not any("not Megatron flags" in n and "--memguard" in n for n in doc["notes"])
    assert any("--memguard abort" in n and "--memguard-reset-peak" in n for n in doc["notes"])
    # memguard's own options win
    code, doc, _ = check_json(capsys, "--threshold", "0.9", "--", "torchrun", "--nproc-per-node", "8", "pretrain_gpt.py",
                              *SMALL, "--memguard-threshold", "0.5")
    assert doc["threshold"] == 0.9
    code, doc, _ = check_json(capsys, "--threshold", "0.8", "--", "torchrun", "--nproc-per-node", "8", "pretrain_gpt.py",
                              *SMALL, "--memguard-threshold", "0.5")
    assert doc["threshold"] == 0.8


@pytest.mark.parametrize("hook, needle", [
    (["--memguard-threshold", "abc"], "--memguard-threshold: must be a fraction of GPU memory in (0, 1.5], got 'abc'"),
    (["--memguard-threshold", "7"], "--memguard-threshold: must be a fraction of GPU memory in (0, 1.5], got '7'"),
    (["--memguard-threshold"], "--memguard-threshold: expects a value"),
    (["--memguard-gpu-memory", "lots"], "--memguard-gpu-memory: cannot read size 'lots'"),
    (["--memguard-bogus", "1"], "--memguard-bogus: is not a flag of memguard's Megatron hook"),
])
def test_bad_hook_flags_on_the_launch_exit_2(capsys, hook, needle):
    code, _, err = run(capsys, "check", "--", "torchrun", "--nproc-per-node", "8", "pretrain_gpt.py", *SMALL, *hook)
    assert code == 2 and needle in err, err
    assert "Traceback" not in err


def test_hook_flag_table_matches_the_hook():
    from megatron_memguard.cli.check import HOOK_SWITCHES, HOOK_VALUE_FLAGS
    from megatron_memguard.megatron.flags import FLAGS

    assert set(HOOK_SWITCHES) == {f.flag for f in FLAGS if f.boolean}
    assert set(HOOK_VALUE_FLAGS) == {f.flag for f in FLAGS if not f.boolean}
