"""Unreadable input: a clear one-line message naming the file / key path, exit code 2, no traceback."""
import pytest

from megatron_memguard.cli.main import main

pytest.importorskip("omegaconf")


def run(capsys, tmp_path, text, *opts, name="cfg.yaml"):
    p = tmp_path / name
    p.write_text(text)
    code = main(["estimate", "--config", str(p), "--gpus", "8", *opts])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err


def test_yaml_syntax_error(capsys, tmp_path):
    code, err = run(capsys, tmp_path, "model:\n  num_layers: [1, 2\n")
    assert code == 2 and "YAML syntax error" in err and "line" in err


def test_not_a_training_config(capsys, tmp_path):
    code, err = run(capsys, tmp_path, "services:\n  web:\n    image: nginx\n")
    assert code == 2 and "not a training config" in err and "services" in err


def test_empty_file(capsys, tmp_path):
    code, err = run(capsys, tmp_path, "")
    assert code == 2 and "empty" in err


def test_missing_mandatory_value_names_the_key(capsys, tmp_path):
    text = ("trainer: {devices: 8, num_nodes: 1, precision: bf16}\nmodel:\n  micro_batch_size: 1\n  global_batch_size: 8\n"
            "  encoder_seq_length: 1024\n  num_layers: 2\n  hidden_size: ???\n  num_attention_heads: 4\n"
            "  tokenizer: {library: megatron, type: GPT2BPETokenizer}\n")
    code, err = run(capsys, tmp_path, text)
    assert code == 2 and "model.hidden_size: is ???" in err and "--set model.hidden_size=VALUE" in err
    # ... and the override fills it in
    code, err = run(capsys, tmp_path, text, "--set", "model.hidden_size=256")
    assert code == 0, err


def test_bad_override_syntax(capsys, tmp_path):
    code, err = run(capsys, tmp_path, "train: {micro_batch_size: 1}\n", "--set", "novalue")
    assert code == 2 and "--set: cannot read override 'novalue'" in err


def test_bad_key_value_is_reported_with_its_key(capsys, tmp_path):
    text = ("trainer: {devices: 8, num_nodes: 1, precision: bf16}\nmodel:\n  micro_batch_size: 1\n  global_batch_size: 8\n"
            "  encoder_seq_length: 1024\n  num_layers: 2\n  hidden_size: 256\n  num_attention_heads: 4\n"
            "  tensor_model_parallel_size: 3\n  tokenizer: {library: megatron, type: GPT2BPETokenizer}\n")
    code, err = run(capsys, tmp_path, text)
    assert code == 2 and "model.num_attention_heads: 4 is not divisible by tensor-model-parallel size 3" in err
    assert "--world-size: 8 GPUs is not divisible" in err   # --gpus 8 on the command line


def test_no_such_model_file(capsys):
    assert main(["estimate", "--config", "/nonexistent.yaml"]) == 2
    assert "no such file" in capsys.readouterr().err
