"""The thirteen reproductions of issue 14 (hostile input): each exits 2 with one error line naming the
flag or key and the rule, no traceback (check adds its 'DO NOT LAUNCH - not checked' line), or, for
the launch script bash runs fine, gives the verdict. Their run time is printed by
benchmarks/hostile_input.py (each well under 2 s); here a run over 60 s fails as a hang."""
import json
import os

import pytest

from fuzz_util import alias_bomb, run_memguard

from benchmarks.shared_data import CONFIGS

S = ("--num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 512 --max-position-embeddings 512 "
     "--micro-batch-size 1 --tokenizer-type NullTokenizer --vocab-size 1000 --bf16").split()
DIGITS = "1" * 5000
NEMO_LLAMA = os.path.join(CONFIGS, "nemo1", "megatron_llama_config.yaml")


def error_lines(o, prefix="memguard"):
    assert not o.problems, o.describe()
    lines = o.err.strip().splitlines()
    assert all(l.startswith(prefix) for l in lines), o.err
    return lines


def one_error(o, *needles, prefix="memguard: error: "):
    """Exit 2, exactly one stderr line, starting with ``prefix`` and holding every needle."""
    lines = error_lines(o)
    assert o.code == 2 and len(lines) == 1 and lines[0].startswith(prefix), o.err
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


def check_error(o, *needles):
    """memguard check: one error line, then its 'DO NOT LAUNCH - not checked (exit 2)' verdict line."""
    lines = error_lines(o)
    assert o.code == 2 and len(lines) == 2 and lines[1] == "memguard check: DO NOT LAUNCH - not checked (exit 2)", o.err
    for n in needles:
        assert n in lines[0], lines[0]


def nemo_with(value: str) -> str:
    with open(NEMO_LLAMA, encoding="utf-8") as f:
        text = f.read()
    assert "  num_layers: 32 " in text
    return text.replace("  num_layers: 32 ", f"  num_layers: {value} ", 1)


# 1. Integer flags given inf, 1e309, nan or a 5000-digit number (estimate, validate, check, plan).
@pytest.mark.parametrize("value, rule", [
    ("inf", "must be an integer, got 'inf'"),
    ("nan", "must be an integer, got 'nan'"),
    # Megatron's argparse (type=int) refuses a number written with an exponent (issue hostile6)
    ("1e309", "must be an integer, got '1e309' (Megatron's argparse reads it with type=int"),
    # out of range: the bound on --num-layers (numbers.py) names its reason
    (DIGITS, "must be <= 10000 (10 x the deepest published Transformer (DeepNet, 1,000 layers))"),
])
def test_1_integer_flags_inf_nan_huge(value, rule):
    line = one_error(run_memguard(["estimate", "--world-size", "1", "--", *S, "--num-layers", value]), "--num-layers: ", rule)
    if value == DIGITS:  # the value is cut, with its length
        assert "(5000 characters)" in line and len(line) < 250


@pytest.mark.parametrize("argv", [
    ["validate", "--world-size", "1", "--", *S, "--num-layers", "inf"],
    ["plan", "--gpus", "8", "--seq-length", "512", "--global-batch-size", "8", "--", *S, "--num-layers", "inf"],
])
def test_1_integer_flags_in_validate_and_plan(argv):
    prefix = "memguard validate: error: " if argv[0] == "validate" else "memguard: error: "
    one_error(run_memguard(argv), "--num-layers: must be an integer, got 'inf'", prefix=prefix)


def test_1_integer_flags_in_check():
    o = run_memguard(["check", "--", "torchrun", "--nproc-per-node", "1", "pretrain_gpt.py", *S, "--num-layers", "1e309"])
    check_error(o, "--num-layers: must be an integer, got '1e309'")


# 2. --gpu-memory 1e400 (estimate) and --memguard-gpu-memory 1e400GiB on a launch (check).
def test_2_gpu_memory_1e400():
    one_error(run_memguard(["estimate", "--world-size", "8", "--gpu-memory", "1e400", "--", *S]),
              "--gpu-memory: must be a size below 8 EiB (2**63 bytes), got '1e400'")
    o = run_memguard(["check", "--", "torchrun", "--nproc-per-node", "8", "pretrain_gpt.py", *S,
                      "--memguard-gpu-memory", "1e400GiB"])
    check_error(o, "--memguard-gpu-memory: must be a size below 8 EiB (2**63 bytes), got '1e400GiB'")


# 3. A valid-looking huge size is refused by a sanity rule.
def test_3_num_layers_1e30():
    # (written 1e30, argparse's type=int refuses it first: issue hostile6; 10**30 in digits is an int to argparse)
    one_error(run_memguard(["estimate", "--world-size", "1", "--", *S, "--num-layers", "1" + "0" * 30]),
              "--num-layers: must be <= 10000", "got '1000000000000000000000000000000'")


# 4. A NeMo YAML with num_layers: .inf through memguard validate.
def test_4_nemo_num_layers_inf():
    o = run_memguard(["validate", "cfg.yaml"], {"cfg.yaml": nemo_with(".inf")})
    one_error(o, "model.num_layers: must be an integer, got inf", prefix="memguard validate: error: ")


# 5. 100,000 '[' as a YAML config.
def test_5_yaml_nested_100000_deep():
    o = run_memguard(["estimate", "--config", "d.yaml"], {"d.yaml": "[" * 100_000 + "\n"})
    one_error(o, "d.yaml:1:65: YAML error: nested deeper than 64 levels")


# 6. memguard report on a JSONL line of 100,000 '[' or with a 5000-digit integer.
START = {"schema": "memguard.runtime/1", "event": "start", "rank": 0}


def test_6_report_deep_line_and_huge_integer():
    o = run_memguard(["report", "."], {"memguard-rank00000.jsonl": "[" * 100_000 + "\n"})
    one_error(o, "memguard-rank00000.jsonl line 1: not valid JSON (nested deeper than a record can be)")
    o = run_memguard(["report", "."], {"memguard-rank00000.jsonl": json.dumps(START).replace('"rank": 0', f'"rank": {DIGITS}')})
    one_error(o, "line 1: 'rank' must be an integer in [0, 2**63)", "(5000 characters)")


# 7. A warning event whose actual_bytes is 1 followed by 400 zeros.
def test_7_report_warning_with_a_401_digit_byte_count():
    warning = {"schema": "memguard.runtime/1", "event": "warning", "rank": 0, "iteration": 1, "actual_bytes": 1,
               "predicted_bytes": 100}
    text = json.dumps(START) + "\n" + json.dumps(warning).replace('"actual_bytes": 1', '"actual_bytes": 1' + "0" * 400)
    o = run_memguard(["report", "."], {"memguard-rank00000.jsonl": text + "\n"})
    one_error(o, "line 2: 'actual_bytes': expected a number below 2**63", "(401 characters)")


# 8. A 5000-digit override of a recipe.
def test_8_recipe_override_with_5000_digits():
    o = run_memguard(["estimate", "--model", "llama32_1b", "--gpus", "8", "--set", f"model.num_layers={DIGITS}"])
    one_error(o, "model.num_layers: must be <= 10000", "(5000 characters)")


# 9. A NeMo key set to "${oc.decode:'[1,2]'}" (OmegaConf returns a plain list).
def test_9_nemo_oc_decode():
    o = run_memguard(["validate", "cfg.yaml"], {"cfg.yaml": nemo_with("\"${oc.decode:'[1,2]'}\"")})
    one_error(o, "model.num_layers: must be an integer, got [1, 2]", prefix="memguard validate: error: ")


# 10. validate megatron_llama_config.yaml model=3
def test_10_nemo_model_overridden_by_a_number():
    o = run_memguard(["validate", NEMO_LLAMA, "model=3"])
    one_error(o, "model: must be a mapping of the model's settings, got 3", prefix="memguard validate: error: ")


# 11. plan with a 31-digit global batch size or GPU count (the planner factorises; both are bounded).
@pytest.mark.parametrize("opt, value, rule", [
    ("--global-batch-size", "1" + "0" * 30, "must be <= 2147483647"),
    ("--gpus", "1" + "0" * 30, "must be <= 1048576 (10 x the largest GPU clusters built)"),
])
def test_11_plan_with_huge_counts(opt, value, rule):
    argv = ["plan", "--gpus", "8", "--seq-length", "4096", "--global-batch-size", "64", "--model", "llama-3.2-1b"]
    argv[argv.index(opt) + 1] = value
    one_error(run_memguard(argv), f"argument {opt}: {rule}")


def test_11_plan_largest_bounded_counts_finish():
    # a prime global batch size at the bound and 2**20 GPUs: divisors from the factorisation
    o = run_memguard(["plan", "--gpus", "1048576", "--seq-length", "4096", "--global-batch-size", "2147483647",
                      "--model", "llama-3.2-1b"])
    assert not o.problems and o.code == 1 and "no layout fits" in o.out, o.describe()


# 12. A launch script whose variable holds '$A$A' and doubles 20 times: bash expands each line once.
def test_12_self_referencing_variable_is_expanded_once():
    # (--save-interval: validate_args asserts one with --save, megatron-core >= 0.17)
    script = "A='$A$A'\n" + "A=$A$A\n" * 20 + 'torchrun --nproc-per-node 8 pretrain_gpt.py ' + " ".join(S) + \
        ' --save-interval 100 --save "$A"\n'
    o = run_memguard(["check", "--json", "--file", "s.sh"], {"s.sh": script})
    assert not o.problems and o.code == 0, o.describe()
    from megatron_memguard.readers.launch_command import parse_launch_script
    args = parse_launch_script(script, {}).script_args
    # bash: the literal '$A$A' (4 characters) doubled by 20 lines: 4 * 2**20 characters of '$A'
    assert args[-1] == "$A" * 2 * 2**20


def test_12_a_value_doubled_40_times_is_refused():
    # 4 * 2**40 characters: bash would fill the memory; memguard stops at 16 MiB of expansion (readers/shell.py): line 23,
    # the 22nd doubling, would expand to 2 + 4 * 2**22 = 16 MiB + 2 characters
    script = "A='$A$A'\n" + "A=$A$A\n" * 40 + 'torchrun --nproc-per-node 8 pretrain_gpt.py ' + " ".join(S) + ' --save "$A"\n'
    o = run_memguard(["check", "--file", "s.sh"], {"s.sh": script})
    lines = error_lines(o)
    assert o.code == 2 and "s.sh: line 23: cannot parse 'A=$A$A': the command expands to more than 16 MiB" in lines[0], o.err


# 13. An alias bomb of about 1 KB used as a NeMo value.
@pytest.mark.parametrize("levels", [4, 5])
def test_13_alias_bomb(levels):
    bomb = alias_bomb(levels)
    assert len(bomb) < 1100
    o = run_memguard(["validate", "cfg.yaml"], {"cfg.yaml": nemo_with(bomb)})
    one_error(o, "cfg.yaml:", "YAML error: more than 10,000 values (after expanding aliases)",
              prefix="memguard validate: error: ")


def test_no_command_is_one_error_line():
    o = run_memguard([])
    one_error(o, "no command given; choose one of estimate, validate, check, plan, report, calibrate, gpus")
    assert o.out == ""


def test_the_no_command_error_names_every_subcommand_of_the_help():
    # the choices `memguard --help` lists (argparse's subparsers), each named in the error's list
    import argparse
    from megatron_memguard.cli.main import COMMANDS, build_parser
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert sorted(COMMANDS) == sorted(sub.choices)
