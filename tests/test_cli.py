"""memguard estimate end to end: exit codes, JSON document, input forms."""
import json
import os
import textwrap

from megatron_memguard import estimate, layout_from_flags, lookup_gpu
from megatron_memguard.cli.main import main
from megatron_memguard.readers.launch_command import parse_launch_script

from conftest import LLAMA31_8B, LLAMA31_70B

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_fits_and_does_not_fit_exit_codes(capsys):
    small = LLAMA31_8B + ["--micro-batch-size", "1", "--tensor-model-parallel-size", "2", "--sequence-parallel",
                          "--use-distributed-optimizer", "--global-batch-size", "64"]
    code, out, _ = run(capsys, "estimate", "--world-size", "16", "--gpu", "H100-80GB", "--", *small)
    assert code == 0 and "verdict: FITS" in out
    # 70B on 8 GPUs without sharding the optimizer cannot fit: 18 bytes/param of 70.5B / 8 ranks alone is 148 GiB.
    big = LLAMA31_70B + ["--micro-batch-size", "1", "--tensor-model-parallel-size", "8"]
    code, out, _ = run(capsys, "estimate", "--world-size", "8", "--gpu", "H100-80GB", "--", *big)
    assert code == 1 and "WILL NOT FIT" in out


def test_json_document(capsys):
    flags = LLAMA31_8B + ["--micro-batch-size", "2", "--global-batch-size", "64", "--tensor-model-parallel-size", "2",
                          "--pipeline-model-parallel-size", "4", "--num-layers-per-virtual-pipeline-stage", "2",
                          "--use-distributed-optimizer", "--sequence-parallel"]
    code, out, _ = run(capsys, "estimate", "--world-size", "32", "--gpu", "A100-80GB", "--json", "--", *flags)
    doc = json.loads(out)
    for key in ("world_size", "gpu_memory_bytes", "threshold", "verdict", "critical_stage", "layout", "stages"):
        assert key in doc
    lay = doc["layout"]
    assert lay["data_parallel_size"] == 4 and lay["tensor_model_parallel_size"] == 2
    assert lay["pipeline_model_parallel_size"] == 4 and lay["virtual_pipeline_model_parallel_size"] == 4
    assert lay["padded_vocab_size"] == 128256 and lay["num_query_groups"] == 8
    assert lay["global_batch_size"] == 64 and lay["num_microbatches"] == 8
    assert len(doc["stages"]) == 4
    for s in doc["stages"]:
        assert len(s["vpp_chunks"]) == 4 and s["num_layers"] == 8
        assert s["peak_allocated_bytes"] <= s["peak_reserved_bytes"] <= s["device_total_bytes"]
        allocated = sum(t["bytes"] for t in s["terms"] if t["level"] == "allocated")
        assert allocated == s["peak_allocated_bytes"]
    # The same content from Python.
    est = estimate(layout_from_flags(flags, world_size=32), gpu=lookup_gpu("A100-80GB"))
    assert est.to_dict()["stages"][0]["peak_allocated_bytes"] == doc["stages"][0]["peak_allocated_bytes"]


def test_flag_spellings_are_equivalent():
    base = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8", "--seq-length", "256",
            "--micro-batch-size", "2", "--tensor-model-parallel-size", "2"]
    a = layout_from_flags(base + ["--sequence-parallel", "--recompute-activations"], world_size=4)
    b = layout_from_flags([f.replace("-", "_").replace("__", "--") for f in base] +
                         ["--sequence_parallel=true", "--recompute-granularity=selective"], world_size=4)
    assert a == b and a.sequence_parallel and a.recompute_granularity == "selective"
    c = layout_from_flags(base + ["--sequence-parallel", "--no-sequence-parallel"], world_size=4)
    assert not c.sequence_parallel


def test_switch_with_a_value():
    import pytest
    from megatron_memguard.errors import ConfigError
    from megatron_memguard.readers.megatron_flags import parse_megatron_flags

    # a store_false flag given a value: =true switches it on (the dest off), =false leaves the dest on
    assert parse_megatron_flags(["--no-gradient-accumulation-fusion=true"]).args == {"gradient_accumulation_fusion": False}
    assert parse_megatron_flags(["--no-gradient-accumulation-fusion=false"]).args == {"gradient_accumulation_fusion": True}
    assert parse_megatron_flags(["--no-bf16=false"]).args == {"bf16": True}
    with pytest.raises(ConfigError, match="--bf16: is a switch: write --bf16 or --bf16=false, not --bf16=maybe"):
        parse_megatron_flags(["--bf16=maybe"])


def test_launch_script_with_arrays_and_continuations(tmp_path, capsys):
    # The example script uses bash arrays, "${ARR[@]}" and backslash continuations.
    code, out, _ = run(capsys, "estimate", "--json", "--config", os.path.join(ROOT, "examples", "llama3_8b_h100.sh"))
    doc = json.loads(out)
    assert doc["world_size"] == 16 and doc["layout"]["tensor_model_parallel_size"] == 2
    assert doc["layout"]["pipeline_model_parallel_size"] == 2 and doc["layout"]["data_parallel_size"] == 4
    script = textwrap.dedent("""\
        #!/bin/bash
        export CUDA_DEVICE_MAX_CONNECTIONS=1
        NODES=4   # four nodes
        CUBLAS_WORKSPACE_CONFIG=:4096:8 python -m torch.distributed.run --nproc_per_node=8 --nnodes ${NODES} \\
            --rdzv-backend c10d --rdzv-endpoint host:29500 pretrain_gpt.py \\
            --num-layers 8 --hidden-size 1024 --num-attention-heads 16 --seq-length 2048 \\
            --micro-batch-size 1 --data-path "a b" --pipeline-model-parallel-size 4 --lr 1e-4
        """)
    cmd = parse_launch_script(script)
    assert cmd.world_size == 32 and cmd.script == "pretrain_gpt.py"
    assert cmd.env == {"CUDA_DEVICE_MAX_CONNECTIONS": "1", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    assert "--data-path" in cmd.script_args and "a b" in cmd.script_args


def test_functional_test_yaml(tmp_path, capsys):
    cfg = tmp_path / "model_config.yaml"
    cfg.write_text(textwrap.dedent("""\
        ENV_VARS:
          CUDA_DEVICE_MAX_CONNECTIONS: 1
          CUBLAS_WORKSPACE_CONFIG: :4096:8
        MODEL_ARGS:
          --num-layers: 12
          --hidden-size: 512
          --num-attention-heads: 8
          --micro-batch-size: 4
          --global-batch-size: 32
          --seq-length: 1024
          --max-position-embeddings: 1024
          --save: ${CHECKPOINT_SAVE_PATH}
          --save-interval: 10000
          --tensor-model-parallel-size: 2
          --pipeline-model-parallel-size: 2
          --bf16: true
          --deterministic-mode: true
        TEST_TYPE: regular
        """))
    code, out, _ = run(capsys, "estimate", "--world-size", "8", "--json", "--config", str(cfg))
    doc = json.loads(out)
    assert doc["layout"]["data_parallel_size"] == 2 and doc["layout"]["padded_vocab_size"] == 50432
    assert doc["layout"]["deterministic_mode"] and doc["layout"]["env"]["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    # 8 x 4 MiB per workspace from CUBLAS_WORKSPACE_CONFIG, two of them (cuBLAS and cuBLASLt).
    assert doc["stages"][-1]["breakdown"]["cublas_workspaces"] == 2 * 8 * 4096 * 1024


def test_world_size_from_environment(capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    code, out, _ = run(capsys, "estimate", "--json", "--", "--num-layers", "2", "--hidden-size", "128",
                       "--num-attention-heads", "4", "--seq-length", "128", "--micro-batch-size", "1")
    assert code == 0 and json.loads(out)["layout"]["data_parallel_size"] == 4
