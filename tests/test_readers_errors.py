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
    # one line, FILE:LINE:COL where the parser stopped (the end of the file) and where the list began
    assert code == 2 and "cfg.yaml:3:1: YAML syntax error: did not find expected ',' or ']'" in err
    assert "(while parsing a flow sequence at 2:15)" in err and len(err.strip().splitlines()) == 1


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


BRIDGE = ("_target_: megatron.bridge.training.config.ConfigContainer\n"
          "model: {num_layers: 2, hidden_size: 64, num_attention_heads: 4, vocab_size: 128}\n"
          "train: {micro_batch_size: 1, global_batch_size: 8}\n")
NEMO1 = ("trainer: {devices: 8, num_nodes: 1, precision: bf16}\nmodel:\n  micro_batch_size: 1\n  global_batch_size: 8\n"
         "  encoder_seq_length: 128\n  num_layers: 2\n  hidden_size: 64\n  num_attention_heads: 4\n"
         "  tokenizer: {library: megatron, type: GPT2BPETokenizer}\n")
NEMO2 = ("_target_: nemo.collections.llm.api.pretrain\n"
         "model: {_target_: nemo.collections.llm.GPTModel, config: {_target_: nemo.collections.llm.GPTConfig, "
         "num_layers: 2, hidden_size: 64, num_attention_heads: 4, vocab_size: 128}}\n"
         "trainer: {devices: 8}\ndata: {micro_batch_size: 1, global_batch_size: 8, seq_length: 128}\n")


@pytest.mark.parametrize("text, needle", [
    # a value of the wrong type where memguard derives a default from it
    (BRIDGE.replace("hidden_size: 64", "hidden_size: abc"), "model.hidden_size: must be an integer, got 'abc'"),
    (NEMO1.replace("hidden_size: 64", "hidden_size: [64]"), "model.hidden_size: must be an integer, got [64]"),
    (NEMO2.replace("hidden_size: 64", "hidden_size: abc"), "model.config.hidden_size: must be an integer, got 'abc'"),
    (NEMO1 + "  optim: {name: [1]}\n", "model.optim.name: expects an optimizer name"),
    ("MODEL_ARGS: {--num-layers: 2}\nENV_VARS: [1]\n", "ENV_VARS must be a mapping of environment variables, got a list"),
])
def test_wrongly_typed_values_name_the_key(capsys, tmp_path, text, needle):
    code, err = run(capsys, tmp_path, text)
    assert code == 2 and needle in err, err


def test_attention_backend_args_not_a_list(tmp_path):
    from megatron_memguard.readers.detect import read_config_file

    p = tmp_path / "cfg.yaml"
    p.write_text(BRIDGE.replace("vocab_size: 128", "vocab_size: 128, attention_backend: {_args_: 5}"))
    assert read_config_file(str(p)).args["attention_backend"] == "auto"


def test_config_json_indented_with_tabs(capsys, tmp_path):
    text = ('{\n\t"model_type": "llama",\n\t"num_hidden_layers": 2,\n\t"hidden_size": 64,\n\t"num_attention_heads": 4,\n'
            '\t"intermediate_size": 128,\n\t"vocab_size": 100,\n\t"rms_norm_eps": 1e-05\n}\n')
    code, err = run(capsys, tmp_path, text, "--", "--micro-batch-size", "1", "--seq-length", "128", name="config.json")
    assert code == 0, err
    code, err = run(capsys, tmp_path, '{"model_type": "llama",}', name="config.json")
    assert code == 2 and "config.json:1:24: JSON syntax error" in err


@pytest.mark.parametrize("text, needle", [
    ("", "empty.sh: no launch command found"),
    ('torchrun --nproc-per-node 8 pretrain_gpt.py --num-layers "2\n', 'empty.sh: unterminated " quote'),
    # (hostile16: a launch script's errors name the line)
    ("torchrun --nproc-per-node 8\n", "empty.sh: line 1: the launch command names no training script"),
])
def test_launch_script_errors_name_the_file(capsys, tmp_path, text, needle):
    code, err = run(capsys, tmp_path, text, name="empty.sh")
    assert code == 2 and needle in err, err
    assert main(["check", "--file", str(tmp_path / "empty.sh")]) == 2
    assert needle in capsys.readouterr().err


def test_model_directory_without_config_json(capsys, tmp_path):
    assert main(["estimate", "--model", str(tmp_path), "--gpus", "1"]) == 2
    assert f"{tmp_path}: a directory without config.json" in capsys.readouterr().err


def test_a_scalar_file_is_not_a_config(capsys, tmp_path):
    code, err = run(capsys, tmp_path, "42\n")
    assert code == 2 and "the file is a number, not a mapping of settings" in err


def test_estimate_refuses_a_config_that_breaks_its_formats_rules(capsys, tmp_path):
    # NeMo would fail at start-up; memguard validate lists it as a problem, estimate does not estimate it as fp32
    code, err = run(capsys, tmp_path, NEMO1.replace("precision: bf16", "precision: bf17"))
    assert code == 2 and "memguard: error: trainer.precision: unknown dtype or precision 'bf17'" in err
    assert main(["validate", str(tmp_path / "cfg.yaml"), "--gpus", "8"]) == 1
    assert "trainer.precision: unknown dtype or precision 'bf17'" in capsys.readouterr().out
