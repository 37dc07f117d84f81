"""The hook on a --yaml-cfg run in the config-container era, for real: megatron-core 0.19.2's parse_args
(load_yaml replaces the command line), parse_and_validate_args -> yaml_arguments.validate_yaml (wrapped) ->
set_global_variables (micro-batch calculator, tokenizer). The YAML file is the Llama-3.1-8B job of
test_hook_container.py written in the layout of Megatron's examples/gpt3/gpt_config.yaml
(tests/yaml_cfg_dump.py), so the YAML run must decide exactly what the flag-built run decides."""
import contextlib
import io
import json
import sys

import pytest

from conftest import CONTAINER_ERA
from test_hook_container import BASE, DEFAULTS, as_rank0_of_16_h100, hook  # noqa: F401  (the same job; the installed hook fixture)

pytestmark = CONTAINER_ERA


@pytest.fixture
def run(hook, monkeypatch, tmp_path):
    """run(yaml_flags, *command_line): the job written as YAML from ``yaml_flags`` (Megatron flags), then
    started with ``--yaml-cfg FILE *command_line``. Returns (args, yaml path)."""
    from megatron.training import global_vars
    from megatron.training.arguments import parse_and_validate_args, parse_args
    from yaml_cfg_dump import write_yaml_cfg
    as_rank0_of_16_h100(hook, monkeypatch)

    def run(yaml_flags, *command_line, flags_run=False):
        monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *BASE, *[str(f) for f in yaml_flags]])
        if flags_run:   # the same job from flags, for comparison
            return parse_and_validate_args(args_defaults=DEFAULTS), None
        path = write_yaml_cfg(tmp_path / "gpt_config.yaml", parse_args())
        monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", "--yaml-cfg", path, *[str(f) for f in command_line]])
        return parse_and_validate_args(args_defaults=DEFAULTS), path
    yield run
    global_vars.unset_global_variables()


NOT_FITTING = ("--micro-batch-size", 4, "--tensor-model-parallel-size", 2)


def test_yaml_run_is_checked_with_the_terms_of_memguard_estimate(run, hook, capsys):
    from megatron_memguard.cli.main import main
    args, path = run(NOT_FITTING)   # --memguard warn by default
    out = capsys.readouterr().out
    assert "[memguard] WARNING" in out and "WILL NOT FIT" in out and "does not read YAML" not in out
    d = hook.STATE.decision
    assert d.action == "warned" and (args.micro_batch_size, args.pipeline_model_parallel_size) == (4, 1)
    # the same terms as `memguard estimate -- --yaml-cfg FILE` on 16 H100s
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        # exit code 1: does not fit
        assert main(["estimate", "--gpus", "16", "--gpu", "H100-80GB", "--json", "--", "--yaml-cfg", path]) == 1
    cli = json.loads(buf.getvalue())
    assert [s["breakdown"] for s in cli["stages"]] == [s.breakdown for s in d.estimate.stages]
    assert [s["peak_allocated_bytes"] for s in cli["stages"]] == [s.peak_allocated_bytes for s in d.estimate.stages]


def test_yaml_run_decides_as_the_flag_run(run, hook, capsys):
    from megatron.training import global_vars
    run(NOT_FITTING, "--memguard", "report")
    from_yaml = hook.STATE.decision.estimate
    global_vars.unset_global_variables()
    run(NOT_FITTING + ("--memguard", "report"), flags_run=True)
    from_flags = hook.STATE.decision.estimate
    assert [s.breakdown for s in from_yaml.stages] == [s.breakdown for s in from_flags.stages]


def test_yaml_abort(run, capsys):
    from megatron.training import global_vars
    from megatron_memguard.megatron import ABORT_EXIT_CODE
    with pytest.raises(SystemExit) as e:
        run(NOT_FITTING, "--memguard", "abort")
    assert e.value.code == ABORT_EXIT_CODE
    out = capsys.readouterr().out
    assert out.count("[memguard] ABORT: stage pp0 needs") == 1 and "[memguard] a layout that fits: MBS 1, PP" in out
    assert global_vars._GLOBAL_ARGS is None   # set_global_variables never ran


def test_yaml_autotune_reaches_what_megatron_uses_next(run, hook, capsys, monkeypatch):
    from megatron.core.num_microbatches_calculator import get_num_microbatches, get_micro_batch_size
    monkeypatch.setenv("MEMGUARD", "autotune")   # the variable works as for flag-built runs
    args, _ = run(NOT_FITTING)
    out = capsys.readouterr().out
    # Llama-3.1-8B, 8k tokens, TP2 on 16 H100s: docs/hook.md's autotune example (60.27 GiB = 76% on pp0)
    assert "[memguard] autotune changed micro_batch_size 4 -> 1, pipeline_model_parallel_size 1 -> 2" in out
    assert "global_batch_size (default) -> 32" in out
    # validate_yaml's merged namespace, the model_parallel section core_transformer_config_from_yaml reads,
    # and the micro-batch calculator set_global_variables built from them
    assert (args.micro_batch_size, args.pipeline_model_parallel_size, args.global_batch_size) == (1, 2, 32)
    assert args.model_parallel.pipeline_model_parallel_size == 2 and args.data_parallel_size == 4
    assert args.eval_micro_batch_size == 1 and args.transformer_pipeline_model_parallel_size == 2
    assert get_micro_batch_size() == 1 and get_num_microbatches() == 32 // 4
    assert hook.STATE.decision.estimate.layout.pp == 2


def test_yaml_autotune_recompute_goes_into_language_model(run, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")   # TP8 on 8 GPUs: no room for PP; MBS is 1 already
    args, _ = run(("--micro-batch-size", 1, "--tensor-model-parallel-size", 8, "--sequence-parallel",
                   "--seq-length", 65536, "--max-position-embeddings", 65536),
                  "--memguard", "autotune", "--memguard-allow-recompute")
    # the recompute ladder's first rung that fits this 64k-token job is selective recompute of the MLP
    # (tests/test_recompute_ladder.py: Llama-3.1-8B at 64k on TP8 frees ~22 GiB with `mlp`, no full recompute)
    lm = args.language_model
    assert (lm.recompute_granularity, lm.recompute_method, lm.recompute_num_layers,
            list(lm.recompute_modules)) == ("selective", None, None, ["mlp"])
    assert (args.recompute_granularity, list(args.recompute_modules)) == ("selective", ["mlp"])


def test_yaml_off(run, hook, capsys):
    run(NOT_FITTING, "--memguard", "off")
    assert hook.STATE.decision is None and "[memguard]" not in capsys.readouterr().out
