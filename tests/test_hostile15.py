"""Regressions of issue hostile15 (benchmarks/hostile_input.py's hostile15 group): MoE-only settings on a dense
model, launch-script forms that ended in imprecise errors, Bridge's bool overrides. Each is the smallest input of its
class, with what the real tool does and what memguard does now."""
from __future__ import annotations


import pytest

from fuzz_util import run_memguard

S = ("--num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 512 --max-position-embeddings 512 "
     "--micro-batch-size 1 --global-batch-size 16 --tokenizer-type NullTokenizer --vocab-size 1000 --bf16")
RUN = "torchrun --nproc-per-node 8 pretrain_gpt.py "


# -- MoE-only settings on a dense model ------------------------------------------------------------------------------
# (flags, the flag memguard names, the rule's words, TransformerConfig's fields, releases whose argparse has the flags)
DENSE_MOE = [
    ("--moe-paged-stash", "--moe-paged-stash", "needs --moe-expert-rank-capacity-factor",
     dict(moe_paged_stash=True), ("0.19.2",)),
    ("--moe-expert-rank-capacity-factor 1.5", "--moe-expert-rank-capacity-factor",
     "needs --moe-flex-dispatcher-backend hybridep or ncclep", dict(moe_expert_rank_capacity_factor=1.5), ("0.19.2",)),
    ("--moe-expert-rank-capacity-factor 1.5 --moe-flex-dispatcher-backend hybridep", "--moe-expert-rank-capacity-factor",
     "needs --use-transformer-engine-op-fuser",
     dict(moe_expert_rank_capacity_factor=1.5, moe_flex_dispatcher_backend="hybridep"), ("0.19.2",)),
    ("--moe-ffn-hidden-size 512", "--moe-ffn-hidden-size", "needs --num-experts", dict(moe_ffn_hidden_size=512),
     ("0.16.1", "0.19.2")),
    ("--moe-enable-deepep", "--moe-enable-deepep", "needs --moe-token-dispatcher-type flex", dict(moe_enable_deepep=True),
     ("0.16.1", "0.19.2")),
    ("--moe-shared-expert-intermediate-size 512 --moe-shared-expert-overlap", "--moe-shared-expert-overlap",
     "only works with the alltoall or flex token dispatcher",
     dict(moe_shared_expert_intermediate_size=512, moe_shared_expert_overlap=True), ("0.16.1", "0.19.2")),
    ("--moe-expert-capacity-factor 1.0 --moe-router-load-balancing-type sinkhorn", "--moe-expert-capacity-factor",
     "only works with aux_loss", dict(moe_expert_capacity_factor=1.0, moe_router_load_balancing_type="sinkhorn"),
     ("0.16.1", "0.19.2")),
    ("--moe-pad-expert-input-to-capacity", "--moe-pad-expert-input-to-capacity", "needs --moe-expert-capacity-factor",
     dict(moe_pad_expert_input_to_capacity=True), ("0.16.1", "0.19.2")),
    ("--moe-router-enable-expert-bias", "--moe-router-enable-expert-bias", "needs --moe-router-score-function sigmoid",
     dict(moe_router_enable_expert_bias=True), ("0.16.1", "0.19.2")),
    ("--moe-router-padding-for-quantization", "--moe-router-padding-for-quantization", "needs --fp8-format or --fp4-format",
     dict(moe_router_padding_for_quantization=True), ("0.16.1", "0.19.2")),
    ("--moe-router-topk 1", "--moe-router-topk", "needs --moe-router-pre-softmax", dict(moe_router_topk=1),
     ("0.16.1", "0.19.2")),
    ("--moe-router-group-topk 2 --moe-router-num-groups 2", "--moe-router-group-topk", "needs --num-experts",
     dict(moe_router_group_topk=2, moe_router_num_groups=2), ("0.16.1", "0.19.2")),
    ("--moe-single-grouped-weight", "--moe-single-grouped-weight", "needs --moe-grouped-gemm",
     dict(moe_single_grouped_weight=True), ("0.19.2",)),
]


def validate_stops(flags: str, flag: str, rule: str, releases: tuple[str, ...]) -> None:
    """`memguard validate` on each release ends in exit 1 with one line naming `flag` and the rule's words."""
    for version in releases:
        o = run_memguard(["validate", "--world-size", "8", "--megatron-version", version, "--", *S.split(), *flags.split()])
        assert o.code == 1 and not o.problems, o.describe()
        assert any(line.strip().startswith(f"{flag}: ") and rule in line for line in o.out.splitlines()), o.out


def _megatron_version() -> str | None:
    try:
        from megatron.core.package_info import __version__
    except ImportError:
        return None
    return __version__


def real_config_stops(fields: dict, releases: tuple[str, ...], errors: tuple[type[Exception], ...]) -> None:
    """This venv's real TransformerConfig refuses `fields` on the tests' dense model (skipped where its release
    is not one of `releases`)."""
    have = _megatron_version()
    if have is None or have not in releases:
        pytest.skip("the real megatron-core of this venv does not have this rule")
    from megatron.core.transformer.transformer_config import TransformerConfig
    with pytest.raises(errors):
        TransformerConfig(num_layers=4, hidden_size=256, num_attention_heads=8, **fields)


@pytest.mark.parametrize("flags, flag, rule, fields, releases", DENSE_MOE, ids=[c[0][:50] for c in DENSE_MOE])
def test_moe_only_settings_on_a_dense_model_break_megatrons_rule(flags, flag, rule, fields, releases):
    # TransformerConfig.__post_init__ checks these with no num_moe_experts guard (core 0.19.2 transformer_config.py
    # lines 1538-1710, 1904-1920, 2284-2360; 0.16.1 lines 1058-1135, 1593-1660), so megatron-core stops a dense
    # model that sets them; memguard accepted every one (its MoE rules ran only with --num-experts)
    validate_stops(flags, flag, rule, releases)
    # the real rule, on the same dense model (an error of any kind stops the run: group-limited routing divides
    # num_moe_experts None and raises TypeError)
    real_config_stops(fields, releases, (ValueError, AssertionError, TypeError))


def test_a_dense_model_with_satisfied_moe_settings_is_accepted():
    # the same settings that megatron-core lets through on a dense model change nothing: no error
    o = run_memguard(["validate", "--world-size", "8", "--megatron-version", "0.19.2", "--", *S.split(),
                      "--moe-router-topk", "1", "--moe-router-pre-softmax", "--moe-expert-capacity-factor", "1.0"])
    assert o.code == 0 and not o.problems, o.describe()
    # 0.19.2 lets --moe-ffn-hidden-size through when --moe-layer-freq leaves dense layers (transformer_config.py 1538)
    o = run_memguard(["validate", "--world-size", "8", "--megatron-version", "0.19.2", "--", *S.split(),
                      "--moe-ffn-hidden-size", "512", "--moe-layer-freq", "[0,1,0,1]"])
    assert o.code == 0 and not o.problems, o.describe()


# -- launch-script forms, read as bash runs them -----------------------------------------------------------------------
ARGV = S.split()
FORMS = [
    f'set -- {S}\n{RUN}"$@"\n',
    f'set -- {S}\n{RUN}$@ --save-interval $#\n',
    f'set -- x y {S}\nshift 2\n{RUN}"$@"\n',
    f'set -- {S}\n{RUN}"${{@:3}}" "$1" 8\n',
    f'ARGS=({S})\n{RUN}"${{ARGS[@]:0:4}}" "${{ARGS[@]:4}}"\n',
    f'X=abc\n{RUN}{S} --save-interval ${{#X}}\n',
    f'ARGS=({S})\n{RUN}"${{ARGS[@]}}" --save-interval ${{#ARGS[@]}} --eval-iters ${{#UNSET_X}}\n',
    f'X=abcdef\n{RUN}{S} --save ${{X:1:3}}/${{X: -2}}/${{X:0:-4}} --save-interval 1\n',
    f'N=2\n{RUN}{S} --num-layers $((N*2)) --save-interval $(( (N+1)**2 % 5 )) --eval-iters $((${{N}}<<3 | 1))\n',
    f'{RUN}{S} --save-interval $((2**64 + 7)) --eval-iters $(( -7 / 2 ))\n',
    f'ARGS=({S})\nrun() {{ {RUN}"${{ARGS[@]}}" "$@"; }}\nrun --num-layers 8\n',
    f'function run {{\n  {RUN}"$@"\n}}\nrun {S} --num-layers 8\n',
    f'launch() {{\n  local n=$1\n  shift\n  {RUN}"$@" --num-layers $n\n}}\nlaunch 6 {S}\n',
    f'CMD="{RUN}{S}"\neval "$CMD" --num-layers 8\n',
    f'export A=1 B=2 C\n{RUN}{S}\n',
    f'{RUN}{S} <<< "a here-string"\n',
]


def _bash_argv(script: str) -> list[str] | None:
    """The arguments bash itself passes to pretrain_gpt.py: torchrun is a function printing them."""
    import shutil
    import subprocess
    bash = shutil.which("bash")
    if bash is None:
        return None
    stub = "torchrun() { shift 3; printf '%s\\0' \"$@\"; }\n"
    out = subprocess.run([bash, "-c", stub + script], capture_output=True, text=True, timeout=30, env={"PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    return out.stdout.split("\0")[:-1]


@pytest.mark.parametrize("script", FORMS, ids=[f"form{i}" for i in range(len(FORMS))])
def test_a_launch_script_form_is_read_as_bash_runs_it(script):
    # memguard's words of the launch line against bash's own (GNU bash runs the script with torchrun a function that
    # prints its arguments). These ended in "no model given", a stray '$@' that was ignored, '${#X}' or '$((N*2))' as
    # a flag's value, or (a function) the launch found with its arguments dropped
    from megatron_memguard.readers.launch_command import parse_launch_script
    got = parse_launch_script(script).script_args
    want = _bash_argv(script)
    if want is None:
        pytest.skip("needs bash")
    assert got == want


@pytest.mark.parametrize("script, text", [
    (f'{RUN}{S} "$@"\n', "line 1: $@ is the script's own arguments, which memguard does not know"),
    (f'# run\n\n{RUN}{S} $*\n', "line 3: $* is the script's own arguments, which memguard does not know"),
    (f'main() {{\n  {RUN}{S} "$@"\n}}\nmain "$@"\n', "line 2: $@ is the script's own arguments"),
    (f'{RUN}--num-layers 4 \\ \n  --hidden-size 256\n', "line 1: the backslash is followed by spaces, so it does not "
                                                        "continue the line"),
    (f'A=1\n{RUN}{S} \\\n  --bf16 \\\t\n  --num-layers 8\n', "line 3: the backslash is followed by spaces"),
    (f'run() {{ {RUN}{S}; }}\n', "no launch command found (expected torchrun, python -m torch.distributed.run, srun, "
                                 "mpirun or python SCRIPT.py); the function run (line 1) holds one but the script never "
                                 "calls it"),
    (f'f() {{ f; }}\nf\n{RUN}{S}\n', "line 1: f nests calls deeper than 16 levels"),
    (f'run() {{\n  {RUN}{S}\n', "line 1: the function's '{' is never closed by a '}'"),
])
def test_a_launch_script_form_memguard_does_not_follow_is_one_error_naming_the_line(script, text):
    # the script's own arguments (bash: the words the script is run with) are unknown to memguard; a backslash followed
    # by a space is an escaped space, not a continuation (bash ends the command there: the next line's flags never
    # reach Megatron); a function that is never called runs nothing
    o = run_memguard(["estimate", "--config", "run.sh"], {"run.sh": script})
    assert not o.problems, o.describe()
    lines = [line for line in o.err.splitlines() if line.strip()]
    assert o.code == 2 and len(lines) == 1 and text in lines[0], o.err


def test_a_sourced_file_is_noted():
    o = run_memguard(["check", "--file", "run.sh"], {"run.sh": f"source ./env.sh\n{RUN}{S}\n"})
    assert o.code == 0 and "the script sources ./env.sh (line 1), which memguard does not read" in o.out, o.describe()


def test_an_unset_variable_word_is_noted_as_bash_reads_it():
    # bash expands an unset $EXTRA_ARGS to no word at all; memguard said "ignored stray argument '$EXTRA_ARGS'"
    o = run_memguard(["check", "--file", "run.sh"], {"run.sh": f"{RUN}{S} $EXTRA_ARGS ${{MORE}}\n"})
    assert o.code == 0 and not o.problems, o.describe()
    assert ("'$EXTRA_ARGS', '${MORE}' not set in the script or its environment: read as nothing, as bash expands an "
            "unset variable") in o.out, o.out
    assert "stray" not in o.out


def test_a_single_grouped_weight_needs_grouped_gemm_in_a_moe_model_too():
    # TransformerConfig.__post_init__ (core 0.19.2 lines 1556-1585) checks it whatever the experts: the MoE model with
    # the op fuser and no --moe-grouped-gemm was accepted as well
    o = run_memguard(["validate", "--world-size", "8", "--megatron-version", "0.19.2", "--", *S.split(), "--num-experts", "8",
                      "--moe-router-topk", "2", "--moe-single-grouped-weight", "--use-transformer-engine-op-fuser",
                      "--disable-bias-linear", "--swiglu"])
    assert o.code == 1 and not o.problems, o.describe()
    assert "--moe-single-grouped-weight: needs --moe-grouped-gemm (TransformerConfig)" in o.out, o.out
