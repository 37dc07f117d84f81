"""Regressions of issue hostile16 (benchmarks/hostile_input.py's hostile16 group): bash's pattern, case and indirection
operators in launch scripts (checked against GNU bash's own argv), command substitutions memguard cannot run, and
MoE-only settings megatron-core checks on every model. Each is the smallest input of its class, with what the real tool
does and what memguard does now."""
from __future__ import annotations

import time

import pytest

from fuzz_util import run_memguard
from test_hostile15 import RUN, S, _bash_argv, _megatron_version, real_config_stops, validate_stops

VARS = "X=hello_world_hello\nP=ab/cd/ef.txt\nA=(one two three)\nN=X\nY='l*'\nXY_A=1\nXY_B=2\nU=mIxEd\n"

# -- bash's operators, read as bash runs them --------------------------------------------------------------------------
OPERATORS = [
    "${X/hello/bye}", "${X//hello/bye}", "${X/#hello/bye}", "${X/%hello/bye}", "${X/o}", "${X//o}", "${X/l*o/Z}",
    "${X/%l*o/Z}", "${X//[lo]/_}", "${X//[!l]/.}", "${X//[[:alpha:]]/.}", "${X//?/x}", "${X/*/all}", "${X/#/pre}",
    "${X/%/suf}", "${X//}", "${P//\\//-}", "${X/hello/a&b}", '"${X/hello/a\\&b}"', '${X/hello/"&"}', "${X/hello/a b}",
    '"${X/hello/a b}"', "${X/${Y}/z}", '${X/"l"*/Q}', "${X/'l*'/Q}", "${X#$Y}", '${X#"$Y"}',
    "${P#*/}", "${P##*/}", "${P%/*}", "${P%%/*}", "${P%.txt}", "${P##*.}",
    "${X^}", "${X^^}", "${U,}", "${X,,}", "${U~~}", "${X^^[lo]}",
    "${A[@]/o/0}", '"${A[@]/o/0}"', '"${A[*]/o/0}"', "${A[@]^^}", "${A[@]#t}",
    "${!N}", "${!N/e/E}", "${!A[@]}", '"${!XY_@}"', "${!XY_*}",
]


@pytest.mark.parametrize("form", OPERATORS)
def test_a_pattern_case_or_indirection_operator_is_read_as_bash_runs_it(form):
    # memguard kept each of these as written ('${X/hello/bye}' reached Megatron's flag as its value); bash's own argv
    # of the launch line (torchrun a function printing it) is the reference
    from megatron_memguard.readers.launch_command import parse_launch_script
    script = f"{VARS}{RUN}--save {form} --save-interval 1\n"
    want = _bash_argv(script)
    if want is None:
        pytest.skip("needs bash")
    assert parse_launch_script(script).script_args == want


def test_a_pattern_that_would_backtrack_for_hours_is_read_in_linear_steps():
    # a backtracking regular expression takes O(n**4) steps for '*a*a*a*b' on n 'a's; bash (and memguard, segment by
    # segment) find no match: the value stays as it is
    from megatron_memguard.readers.launch_command import parse_launch_script
    script = "X=" + "a" * 100_000 + f"\n{RUN}{S} --save ${{X//*a*a*a*b/}} --save-interval 1\n"
    t0 = time.process_time()
    args = parse_launch_script(script).script_args
    assert args[args.index("--save") + 1] == "a" * 100_000
    assert time.process_time() - t0 < 2.0


@pytest.mark.parametrize("script, text", [
    ('N="1 2"\n' + RUN + S + " --save ${!N}\n", "line 2: cannot parse"),
    (RUN + S + " --save ${!UNSET_N}\n", "UNSET_N: invalid indirect expansion"),
])
def test_an_indirection_bash_refuses_is_one_error_naming_the_line(script, text):
    # bash: "1 2: invalid variable name" / "N: invalid indirect expansion", and the command does not run
    o = run_memguard(["estimate", "--config", "run.sh"], {"run.sh": script})
    lines = [line for line in o.err.splitlines() if line.strip()]
    assert o.code == 2 and not o.problems and len(lines) == 1 and text in lines[0], o.describe()


# -- command substitutions ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("script, flag, construct, line", [
    (f"{RUN}{S} \\\n  --micro-batch-size $(nproc)\n", "--micro-batch-size", "'$(nproc)'", 2),
    (f"MBS=$(nproc)\n\n{RUN}{S} --micro-batch-size $MBS\n", "--micro-batch-size", "'$(nproc)'", 1),
    (f"{RUN}{S} --tensor-model-parallel-size `nproc`\n", "--tensor-model-parallel-size", "'`nproc`'", 1),
    (f"{RUN}{S} --tensor-model-parallel-size $((8 / $(nproc)))\n", "--tensor-model-parallel-size",
     "'$((8 / $(nproc)))'", 1),
    (f"{RUN}{S} --recompute-granularity $(echo \"full)\")\n", "--recompute-granularity", "'$(echo \"full)\")'", 1),
    (f"{RUN}{S} --recompute-modules $(echo core_attn) mlp\n", "--recompute-modules", "'$(echo core_attn)'", 1),
    (f"N=1\n{RUN}{S} --eval-iters $((N++))\n", "--eval-iters", "'$((N++))'", 2),
])
def test_a_command_substitution_a_rule_reads_is_one_error_naming_line_flag_and_construct(script, flag, construct, line):
    # bash runs the program when the job starts; memguard cannot, so a flag whose value it needs is one error (it said
    # "must be an integer, got '$(nproc)'", naming neither the line nor what the text is)
    o = run_memguard(["estimate", "--config", "run.sh"], {"run.sh": script})
    lines = [x for x in o.err.splitlines() if x.strip()]
    assert o.code == 2 and not o.problems and len(lines) == 1, o.describe()
    assert f"{flag}: is {construct} (line {line})" in lines[0], lines[0]
    assert f"memguard estimate --config SCRIPT -- {flag} VALUE" in lines[0], lines[0]


def test_a_command_substitution_memguard_ignores_does_not_break_the_read():
    # --seed / --lr / --data-path / --save change no memory: Megatron gets the program's output, memguard needs none
    # (it stopped at "--seed: must be an integer, got '$(date +%s)'")
    script = (f"{RUN}{S} --seed $(date +%s) --lr `echo 1e-4` --data-path $(cat files.txt) --save $(pwd)/ckpt "
              "--save-interval 10 --load $(cat last)\n")
    o = run_memguard(["estimate", "--config", "run.sh"], {"run.sh": script})
    assert o.code == 0 and not o.problems, o.describe()


def test_a_refused_feature_named_by_a_command_substitution_is_the_refusal():
    # the refusal holds whatever the directory's name is (a value given); it is not the unevaluated-value error
    o = run_memguard(["estimate", "--config", "run.sh"], {"run.sh": f"{RUN}{S} --logits-load-dir $(cat dir.txt)\n"})
    assert o.code == 2 and not o.problems and "--logits-load-dir" in o.err and "distillation from stored logits" in o.err \
        and "command substitution" not in o.err, o.describe()


def test_the_value_given_after_the_double_dash_replaces_the_command_substitution():
    script = f"{RUN}{S} --micro-batch-size $(nproc)\n"
    o = run_memguard(["estimate", "--config", "run.sh", "--", "--micro-batch-size", "2"], {"run.sh": script})
    assert o.code == 0 and not o.problems and "MBS 2" in o.out, o.describe()


def test_a_launcher_option_from_a_command_substitution_names_the_line():
    o = run_memguard(["check", "--file", "run.sh"],
                     {"run.sh": f"# 8 GPUs\ntorchrun --nproc-per-node $(nvidia-smi -L | wc -l) pretrain_gpt.py {S}\n"})
    assert o.code == 2 and not o.problems, o.describe()
    assert "line 2: launcher option --nproc-per-node is '$(nvidia-smi -L | wc -l)', which memguard cannot evaluate" in o.err


@pytest.mark.parametrize("text", [
    "$(( $(nproc) * 2 ))", "$( \"a)\" )", "$(echo \"$(echo \")\")\")", "$((", "$(" * 5000, "`" + "x" * 5000,
    "$((1 + `nproc`))", "${X//$(nproc)/y}", "${X/#$(a)/$(b)}", "\"$(echo ')')\"", "${!A[@]/$(x)}",
])
def test_nested_substitutions_and_quotes_end_in_no_traceback_and_no_hang(text):
    o = run_memguard(["estimate", "--config", "run.sh"], {"run.sh": f"X=abc\nA=(a b)\n{RUN}{S} --num-layers {text}\n"})
    assert not o.problems and o.code in (0, 1, 2) and o.cpu < 2.0, o.describe()


# -- MoE-only settings megatron-core checks on every model -------------------------------------------------------------
MOE = "--num-experts 8 --moe-router-topk 2"
RULES = [
    # (flags, the flag named, the rule's words, TransformerConfig's fields, releases where it holds)
    ("--moe-router-load-balancing-type aux_loss seq_aux_loss --moe-aux-loss-coeff 0.01", "--moe-aux-loss-coeff",
     "must be a list of as many values as --moe-router-load-balancing-type has (2), got one value",
     dict(moe_router_load_balancing_type=["aux_loss", "seq_aux_loss"], moe_aux_loss_coeff=0.01), ("0.16.1", "0.19.2")),
    (f"{MOE} --moe-router-load-balancing-type aux_loss seq_aux_loss --moe-aux-loss-coeff 0.1 0.2 0.3",
     "--moe-aux-loss-coeff", "got 3 values",
     dict(num_moe_experts=8, moe_router_topk=2, moe_router_load_balancing_type=["aux_loss", "seq_aux_loss"],
          moe_aux_loss_coeff=[0.1, 0.2, 0.3]), ("0.16.1", "0.19.2")),
    ("--moe-deepep-num-sms 20 --moe-hybridep-num-sms 24", "--moe-hybridep-num-sms",
     "24 conflicts with --moe-deepep-num-sms 20", dict(moe_deepep_num_sms=20, moe_hybridep_num_sms=24), ("0.19.2",)),
]


@pytest.mark.parametrize("flags, flag, rule, fields, releases", RULES, ids=[c[0][:50] for c in RULES])
def test_a_rule_megatron_core_checks_on_every_model_is_an_error(flags, flag, rule, fields, releases):
    # TransformerConfig.__post_init__ checks the lists' lengths (core 0.16.1 line 1097, 0.19.2 line 1652) and the
    # deprecated SM counts (0.19.2 line 1619) with no num_moe_experts guard; memguard accepted them
    validate_stops(flags, flag, rule, releases)
    real_config_stops(fields, releases, (ValueError, AssertionError))


def test_settings_megatron_core_lets_through_are_accepted():
    # equal lengths; the deprecated SM counts before 0.19 (plain fields, default 20) or beside the flex count
    for version, extra in (("0.19.2", "--moe-router-load-balancing-type aux_loss seq_aux_loss --moe-aux-loss-coeff 0.1 0.2"),
                           ("0.16.1", "--moe-router-load-balancing-type aux_loss seq_aux_loss --moe-aux-loss-coeff 0.1 0.2"),
                           ("0.16.1", "--moe-deepep-num-sms 20 --moe-hybridep-num-sms 24"),
                           ("0.19.2", "--moe-deepep-num-sms 20 --moe-hybridep-num-sms 24 --moe-flex-dispatcher-num-sms 8")):
        o = run_memguard(["validate", "--world-size", "8", "--megatron-version", version, "--", *S.split(), *extra.split()])
        assert o.code == 0 and not o.problems, o.describe()
    have = _megatron_version()
    from megatron.core.transformer.transformer_config import TransformerConfig
    TransformerConfig(num_layers=4, hidden_size=256, num_attention_heads=8,
                      moe_router_load_balancing_type=["aux_loss", "seq_aux_loss"], moe_aux_loss_coeff=[0.1, 0.2])
    if have == "0.19.2":
        c = TransformerConfig(num_layers=4, hidden_size=256, num_attention_heads=8, moe_deepep_num_sms=20,
                              moe_hybridep_num_sms=24, moe_flex_dispatcher_num_sms=8)
        assert c.moe_flex_dispatcher_num_sms == 8


def test_a_latent_size_on_a_dense_model_breaks_validate_args():
    # validate_args (core 0.19.2 arguments.py line 1899; 0.17.1 line 1599) asserts a positive size, then experts
    o = run_memguard(["validate", "--world-size", "8", "--megatron-version", "0.19.2", "--", *S.split(),
                      "--moe-latent-size", "64"])
    assert o.code == 1 and "--moe-latent-size: needs --num-experts (validate_args" in o.out, o.describe()
    o = run_memguard(["validate", "--world-size", "8", "--megatron-version", "0.19.2", "--", *S.split(),
                      "--moe-latent-size", "-3"])
    assert o.code == 1 and "--moe-latent-size: must be greater than zero (validate_args), got -3" in o.out, o.describe()
    try:
        import inspect

        from megatron.training.arguments import validate_args
    except ImportError:
        pytest.skip("needs megatron.training (venv312)")
    src = inspect.getsource(validate_args)
    assert ('assert args.num_experts is not None, "MoE latent projections are applicable only for MoE models."'
            in src)


def test_the_deprecated_hybridep_sm_count_sizes_deepeps_buffers_on_0_19():
    # core 0.19.2 routes --moe-hybridep-num-sms to moe_flex_dispatcher_num_sms, which the DeepEP backend's buffers
    # take (fused_a2a.py); memguard sized them for 20 SMs
    from megatron_memguard import layout_from_flags
    flags = [*S.split(), "--num-experts", "8", "--moe-router-topk", "2", "--moe-token-dispatcher-type", "flex",
             "--moe-grouped-gemm", "--expert-model-parallel-size", "8"]
    L = layout_from_flags([*flags, "--moe-hybridep-num-sms", "24"], world_size=8, megatron_version="0.19.2")
    assert L.moe.moe_flex_dispatcher_num_sms == 24
    L = layout_from_flags([*flags, "--moe-hybridep-num-sms", "24"], world_size=8, megatron_version="0.16.1")
    assert L.moe.moe_flex_dispatcher_num_sms == 20      # (0.16.1: the DeepEP count alone, default 20)
