"""Bad input: one line naming the flag and the rule, exit code 2, no traceback."""
import pytest

from megatron_memguard.cli.main import main

BASE = "--num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 512 --max-position-embeddings 512 --micro-batch-size 2".split()


@pytest.mark.parametrize("opts, extra, flag, rule", [
    (["--world-size", "6"], ["--tensor-model-parallel-size", "4"], "--world-size", "not divisible by TP*PP*CP"),
    (["--world-size", "3"], ["--pipeline-model-parallel-size", "3"], "--num-layers", "not divisible by pipeline-model-parallel size 3"),
    (["--world-size", "8"], ["--pipeline-model-parallel-size", "4", "--num-layers-per-virtual-pipeline-stage", "2", "--global-batch-size", "16"],
     "--num-layers-per-virtual-pipeline-stage", "does not divide"),
    (["--world-size", "4"], ["--global-batch-size", "10"], "--global-batch-size", "not divisible by micro-batch size x DP"),
    (["--world-size", "3"], ["--tensor-model-parallel-size", "3"], "--num-attention-heads", "not divisible by tensor-model-parallel size 3"),
    (["--world-size", "2"], ["--tensor-model-parallel-size", "2", "--group-query-attention", "--num-query-groups", "3", "--num-attention-heads", "6", "--hidden-size", "384"],
     "--num-query-groups", "multiple or a divisor"),
    (["--world-size", "1", "--gpu", "V100"], [], "--gpu", "unknown GPU"),
    (["--world-size", "1"], ["--hidden-size", "-5"], "--hidden-size", "must be >= 1"),
    (["--world-size", "1"], ["--micro-batch-size", "x"], "--micro-batch-size", "must be an integer"),
    ([], [], "--world-size", "number of GPUs is unknown"),
    (["--world-size", "1"], ["--mtp-num-layers", "2", "--mtp-use-repeated-layer", "--position-embedding-type", "rope",
                             "--cuda-graph-impl", "transformer_engine"], "--mtp-use-repeated-layer",
     "does not work with --cuda-graph-impl transformer_engine"),
    # Rules of validate_args / TransformerConfig / ModelParallelConfig / OptimizerConfig (megatron-core 0.19.2)
    (["--world-size", "1"], ["--fp16-lm-cross-entropy", "--bf16"], "--fp16-lm-cross-entropy", "needs --fp16"),
    (["--world-size", "1"], ["--fp32-residual-connection"], "--fp32-residual-connection", "needs --fp16 or --bf16"),
    (["--world-size", "1"], ["--recompute-granularity", "selective", "--recompute-num-layers", "1"],
     "--recompute-num-layers", "must not be given with selective recompute"),
    (["--world-size", "2"], ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--recompute-granularity", "full",
                             "--recompute-method", "uniform", "--recompute-num-layers", "1", "--distribute-saved-activations"],
     "--distribute-saved-activations", "cannot be combined with --sequence-parallel"),
    (["--world-size", "1"], ["--bf16", "--use-precision-aware-optimizer"], "--use-precision-aware-optimizer",
     "needs --use-distributed-optimizer"),
    # DP = 2 with the distributed optimizer: ranks 0 and 1 only (rank 5 would own no optimizer state)
    (["--world-size", "2", "--dp-rank", "5"], ["--use-distributed-optimizer"], "--dp-rank", "a rank 0..1"),
    (["--world-size", "1"], ["--defer-embedding-wgrad-compute"], "--defer-embedding-wgrad-compute",
     "needs pipeline-model-parallel size > 1"),
    # megatron-core asserts at model build: local DotProductAttention has CP == 1; the SP scatter needs
    # TP | s/CP (tensor_parallel.mappings._split_along_first_dim). 520 / 2 = 260 is not divisible by 8.
    (["--world-size", "2"], ["--context-parallel-size", "2", "--transformer-impl", "local"], "--context-parallel-size",
     "needs --transformer-impl transformer_engine"),
    (["--world-size", "16"], ["--tensor-model-parallel-size", "8", "--context-parallel-size", "2", "--sequence-parallel",
                              "--seq-length", "520", "--max-position-embeddings", "520"],
     "--sequence-parallel", "seq_length / context-parallel size = 260 divisible by tensor-model-parallel size 8"),
    # validate_args: hierarchical CP sizes multiply to CP, and a2a+p2p needs them
    (["--world-size", "4"], ["--context-parallel-size", "4", "--hierarchical-context-parallel-sizes", "2", "4"],
     "--hierarchical-context-parallel-sizes", "multiply to 8, not context-parallel-size 4"),
    (["--world-size", "4"], ["--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p"],
     "--hierarchical-context-parallel-sizes", "must be set when --cp-comm-type is a2a+p2p"),
    # multi-latent attention excludes GQA (validate_args)
    (["--world-size", "1"], ["--multi-latent-attention", "--group-query-attention", "--num-query-groups", "2"],
     "--group-query-attention", "mutually exclusive with --multi-latent-attention"),
    (["--world-size", "1"], ["--multi-latent-attention", "--position-embedding-type", "yarn"],
     "--position-embedding-type", "yarn cannot be combined with --multi-latent-attention"),
    (["--world-size", "1"], ["--multi-latent-attention", "--rotary-interleaved"],
     "--rotary-interleaved", "does not work with --multi-latent-attention"),
    (["--world-size", "1"], ["--recompute-granularity", "selective", "--recompute-modules", "mla_up_proj"],
     "--recompute-modules", "mla_up_proj needs --multi-latent-attention"),
    # get_dsa_module_spec_for_backend asserts MLA (megatron-core 0.19.2)
    (["--world-size", "1"], ["--experimental-attention-variant", "dsa"], "--experimental-attention-variant",
     "dsa needs --multi-latent-attention"),
])
def test_bad_input(capsys, opts, extra, flag, rule):
    code = main(["estimate", *opts, "--", *BASE, *extra])
    err = capsys.readouterr().err
    assert code == 2
    lines = [l for l in err.splitlines() if l.strip()]
    assert any(flag in l and rule in l for l in lines), err
    assert "Traceback" not in err


def test_missing_required_flag(capsys):
    code = main(["estimate", "--world-size", "1", "--", "--num-layers", "2"])
    err = capsys.readouterr().err
    assert code == 2 and "--hidden-size: is required" in err


def test_all_errors_reported_at_once(capsys):
    code = main(["estimate", "--world-size", "4", "--", *BASE, "--num-attention-heads", "6", "--hidden-size", "384",
                 "--tensor-model-parallel-size", "4", "--global-batch-size", "3"])
    err = capsys.readouterr().err
    assert code == 2
    assert "--global-batch-size" in err


@pytest.mark.parametrize("dest, value, rule", [
    ("bf16", "maybe", "must be true or false, got 'maybe'"),
    ("bias_activation_fusion", "perhaps", "must be true or false"),
    ("recompute_modules", 5, "must be a list of module names, got 5"),
])
def test_bad_values_from_config_files_name_the_key(dest, value, rule):
    # Readers hand over YAML values as written; a value resolve cannot read is a ConfigError, not a traceback.
    from megatron_memguard.config import RawConfig
    from megatron_memguard.errors import ConfigError
    from megatron_memguard.resolve import resolve
    args = dict(num_layers=4, hidden_size=256, num_attention_heads=8, seq_length=512, micro_batch_size=2)
    args[dest] = value
    with pytest.raises(ConfigError, match=f"model.{dest}: {rule}"):
        resolve(RawConfig(args=args, origin={dest: f"model.{dest}"}), world_size=1)


@pytest.mark.parametrize("argv, needle", [
    (["estimate", "--gpus", "0"], "argument --gpus: must be a positive integer, got '0'"),
    (["estimate", "--world-size", "-4"], "argument --world-size: must be a positive integer, got '-4'"),
    (["estimate", "--world-size", "1", "--vocab-size", "0"], "argument --vocab-size: must be a positive integer, got '0'"),
    (["estimate", "--world-size", "2", "--dp-rank", "abc"], "argument --dp-rank: expects a data-parallel rank index"),
    (["check", "--nnodes", "x"], "argument --nnodes/--nodes: expects a positive integer, got 'x'"),
    (["plan", "--gpus", "2", "--seq-length", "0"], "argument --seq-length: must be a positive integer, got '0'"),
])
def test_zero_negative_or_non_numeric_counts_are_refused(capsys, argv, needle):
    try:
        code = main([*argv, "--", *BASE])
    except SystemExit as e:       # argparse's usage error (memguard estimate's own parser)
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and needle in err, err
    assert "Traceback" not in err


def test_dp_rank_beyond_the_layout_is_refused(capsys):
    code = main(["estimate", "--world-size", "2", "--dp-rank", "2", "--", *BASE])
    err = capsys.readouterr().err
    assert code == 2 and "--dp-rank: must be max, last or a rank 0..1 of the distributed optimizer's DP x CP group" in err
    assert main(["estimate", "--world-size", "2", "--dp-rank", "1", "--", *BASE]) == 0


@pytest.mark.parametrize("before", [[], ["--config", "examples/llama3_8b_h100.sh"], ["--model", "llama3.1-8b"]])
def test_a_key_value_override_among_megatron_flags_is_refused(capsys, monkeypatch, before):
    # README: bare KEY=VALUE tokens after -- override a NeMo / Bridge config's keys. Megatron flags take none (its
    # argparse rejects a stray word): the override is refused by name, not estimated without it
    import os
    monkeypatch.chdir(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    flags = [] if before else BASE
    assert main(["estimate", "--world-size", "16", *before, "--", *flags, "train.micro_batch_size=4"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "train.micro_batch_size=4: a KEY=VALUE override applies to" in err, err
    # a word that is no override stays a note, as before
    assert main(["estimate", "--world-size", "16", "--", *BASE, "stray"]) == 0
    assert "ignored stray argument 'stray'" in capsys.readouterr().out
