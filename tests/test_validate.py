"""memguard validate: every problem at once with the key that causes it, exit codes, --json."""
import json
import os

import pytest

from megatron_memguard.cli.main import main

pytest.importorskip("omegaconf")
from benchmarks.shared_data import CONFIGS as DATA  # noqa: E402
LLAMA8B = os.path.join(DATA, "nemo-launcher", "llama_llama3_1_8b.yaml")
GPT = os.path.join(DATA, "nemo1", "megatron_gpt_config.yaml")
BRIDGE = os.path.join(DATA, "megatron-bridge", "llama32_1b_pretrain_override.yaml")


def test_valid_config_exits_0(capsys):
    assert main(["validate", GPT]) == 0
    out = capsys.readouterr().out
    assert "result: OK" in out and "FITS" in out


def test_every_problem_at_once_with_keys_and_fixes(capsys):
    code = main(["validate", LLAMA8B, "model.tensor_model_parallel_size=3", "model.global_batch_size=100",
                 "model.context_parallel_size=3", "model.data.seq_length=4096"])
    out = capsys.readouterr().out
    assert code == 1
    for key in ("trainer.devices x trainer.num_nodes", "model.global_batch_size", "model.encoder_seq_length",
                "model.num_attention_heads", "model.num_query_groups", "model.data.seq_length",
                "model.ffn_hidden_size"):   # (14336 = 2^11 x 7: no TP 3 split of MLP linear_fc2)
        assert f"  {key}:" in out, key
    assert "problems (7)" in out and "fix: use a multiple of" in out


def test_memory_verdict_is_a_problem(capsys):
    code = main(["validate", LLAMA8B])  # 91% of an H100: tight
    out = capsys.readouterr().out
    assert code == 1 and "memory: tight" in out
    assert main(["validate", LLAMA8B, "--gpu", "H200-141GB"]) == 0


def test_sp_at_tp1_is_a_note_not_a_problem(capsys):
    code = main(["validate", GPT, "model.sequence_parallel=true"])
    out = capsys.readouterr().out
    assert code == 0 and "notes:" in out and "model.sequence_parallel" in out


def test_needs_input_exits_2(capsys):
    code = main(["validate", BRIDGE, "--model", "llama32_1b"])
    out = capsys.readouterr().out
    assert code == 2 and "needs input" in out and "number of GPUs is unknown" in out


def test_unreadable_input_exits_2(capsys, tmp_path):
    p = tmp_path / "x.yaml"
    p.write_text("a: [\n")
    assert main(["validate", str(p)]) == 2
    assert "YAML syntax error" in capsys.readouterr().err


def test_not_modelled_exits_2(capsys):
    # Mixtral-8x7B (mixture of experts) validates since MoE is modelled, with FP8 too (issue 17), and with latent
    # MoE projections; paged expert-activation stashing on top of it is still refused
    mixtral = os.path.join(DATA, "nemo-launcher", "mixtral_mixtral_8x7b.yaml")
    assert main(["validate", mixtral]) == 0
    assert main(["validate", mixtral, "model.fp8=True"]) == 0
    assert main(["validate", mixtral, "model.moe_latent_size=128"]) == 0
    capsys.readouterr()
    assert main(["validate", mixtral, "model.moe_paged_stash=True", "model.moe_expert_rank_capacity_factor=1.5"]) == 2
    assert "not modelled" in capsys.readouterr().err
    # without the rank capacity factor it breaks TransformerConfig's rule (core 0.19.2): exit 1, the rule named
    assert main(["validate", mixtral, "model.moe_paged_stash=True"]) == 1
    assert "model.moe_paged_stash: needs" in capsys.readouterr().out
    # delayed weight-gradient computation is modelled; without the expert all-to-all overlap it breaks
    # TransformerConfig's rule (exit 1, the problem listed)
    assert main(["validate", mixtral, "model.delay_wgrad_compute=True"]) == 1
    assert "model.delay_wgrad_compute: needs --overlap-moe-expert-parallel-comm" in capsys.readouterr().out


def test_bridge_rules_and_key_value_after_dashdash(capsys):
    code = main(["validate", BRIDGE, "--model", "llama32_1b", "--gpus", "8", "--", "dataset.seq_length=2048",
                 "train.global_batch_size=12"])
    out = capsys.readouterr().out
    assert code == 1
    assert "  model.seq_length: 4096 differs from dataset.seq_length = 2048" in out
    assert "  train.global_batch_size: 12 is not divisible" in out


def test_json_has_the_estimate_objects_and_problems(capsys):
    code = main(["validate", LLAMA8B, "--json", "model.global_batch_size=2047"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 1 and doc["schema"] == "memguard.validate/1" and doc["valid"] is False
    assert doc["problems"][0] == {"key": "model.global_batch_size",
                                  "rule": "2047 is not divisible by micro-batch size x DP = 1*64 = 64",
                                  "fix": "use a multiple of 64"}
    assert doc["layout"] is None and doc["stages"] == []
    main(["validate", GPT, "--json"])
    ok = json.loads(capsys.readouterr().out)
    main(["estimate", "--config", GPT, "--json"])
    est = json.loads(capsys.readouterr().out)
    assert ok["valid"] is True and ok["problems"] == []
    for key in ("layout", "stages", "verdict", "critical_stage"):
        if key == "layout":
            assert {k: v for k, v in ok[key].items() if k not in ("env", "notes")} == \
                {k: v for k, v in est[key].items() if k not in ("env", "notes")}
        else:
            assert ok[key] == est[key]


def test_megatron_flags_validate_too(capsys):
    code = main(["validate", "--world-size", "8", "--", "--num-layers", "4", "--hidden-size", "384",
                 "--num-attention-heads", "6", "--tensor-model-parallel-size", "4", "--seq-length", "512",
                 "--micro-batch-size", "1", "--global-batch-size", "3"])
    out = capsys.readouterr().out
    assert code == 1 and "--num-attention-heads" in out and "--global-batch-size" in out
