"""The hook in the config-container era (core >= 0.18), for real: megatron-core 0.19.2's megatron.training on
Python 3.12, through the real parse_and_validate_args (argparse, validate_args, set_global_variables with
the micro-batch calculator and tokenizer) and the config snapshot pretrain_gpt.py takes afterwards.
torch.cuda.get_device_properties answers with an H100's properties; nothing else needs a GPU."""
import sys

import pytest

from conftest import CONTAINER_ERA, LLAMA31_8B, H100


pytestmark = CONTAINER_ERA
BASE = LLAMA31_8B + "--lr 1e-4 --train-iters 10 --mock-data --no-rope-fusion".split()
DEFAULTS = {"tokenizer_type": "GPT2BPETokenizer"}   # what pretrain_gpt.py passes


@pytest.fixture(scope="module")
def hook():
    with pytest.MonkeyPatch.context() as mp:   # (restored after the module: later tests read the environment)
        mp.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
        import megatron_memguard.megatron as hook
        assert hook.install(quiet=True)
        yield hook


def as_rank0_of_16_h100(hook, monkeypatch) -> None:
    """Rank 0 of 16 on H100s (torch's device query faked), no MEMGUARD* variables, no earlier decision."""
    import torch
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i=None: H100)
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    for k in ("MEMGUARD", "MEMGUARD_THRESHOLD", "MEMGUARD_GPU_MEMORY", "MEMGUARD_ALLOW_RECOMPUTE"):
        monkeypatch.delenv(k, raising=False)
    hook.STATE.decision = None


@pytest.fixture
def run(hook, monkeypatch):
    from megatron.training import global_vars
    from megatron.training.arguments import parse_and_validate_args
    as_rank0_of_16_h100(hook, monkeypatch)

    def run(*flags):
        monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *BASE, *[str(f) for f in flags]])
        return parse_and_validate_args(extra_args_provider=None, args_defaults=DEFAULTS)
    yield run
    global_vars.unset_global_variables()


def test_era_and_targets(hook):
    assert hook.STATE.era == "config-container"
    targets = hook.wrapped_targets()
    for t in ("megatron.training.arguments.add_megatron_arguments", "megatron.training.arguments.validate_args",
              "megatron.training.training.setup_model_and_optimizer", "megatron.training.training.training_log",
              "megatron.training.training.train"):
        assert t in targets
    assert not any(t.startswith("megatron.training.initialize.") for t in targets)  # nothing to patch there any more
    assert hook.install(quiet=True) and hook.wrapped_targets() == targets          # idempotent


def test_warn_fits(run, capsys):
    args = run("--micro-batch-size", 1, "--tensor-model-parallel-size", 8)
    out = capsys.readouterr().out
    assert "[memguard] verdict: FITS" in out and "torch.cuda.get_device_properties(0)" in out
    assert out.count("------------------------ arguments ------------------------") == 1  # the dry run was silent
    assert args.memguard == "warn" and args.micro_batch_size == 1


def test_warn_not_fitting_changes_nothing(run, capsys):
    args = run("--micro-batch-size", 4, "--tensor-model-parallel-size", 2)
    out = capsys.readouterr().out
    assert "[memguard] WARNING" in out and "WILL NOT FIT" in out and "= peak allocated" in out
    assert (args.micro_batch_size, args.pipeline_model_parallel_size, args.global_batch_size) == (4, 1, 32)


def test_report(run, capsys):
    run("--micro-batch-size", 1, "--tensor-model-parallel-size", 2, "--pipeline-model-parallel-size", 2, "--memguard", "report")
    out = capsys.readouterr().out
    assert "memguard estimate - 16 ranks on H100-80GB" in out and "pp0 at its peak" in out and "pp1 at its peak" in out


def test_abort(run, capsys):
    from megatron.training import global_vars
    from megatron_memguard.megatron import ABORT_EXIT_CODE
    with pytest.raises(SystemExit) as e:
        run("--micro-batch-size", 4, "--tensor-model-parallel-size", 2, "--memguard", "abort")
    assert e.value.code == ABORT_EXIT_CODE
    out = capsys.readouterr().out
    assert out.count("[memguard] ABORT: stage pp0 needs") == 1
    assert "= peak allocated" in out and "layer_activations" in out
    assert "[memguard] a layout that fits: MBS 1, PP" in out and "--global-batch-size 32" in out
    assert global_vars._GLOBAL_ARGS is None   # set_global_variables never ran


def test_abort_on_other_ranks_is_silent(run, capsys, monkeypatch):
    monkeypatch.setenv("RANK", "7")
    monkeypatch.setenv("LOCAL_RANK", "7")
    with pytest.raises(SystemExit):
        run("--micro-batch-size", 4, "--tensor-model-parallel-size", 2, "--memguard", "abort")
    assert "[memguard]" not in capsys.readouterr().out


def test_autotune_then_config_snapshot(run, capsys):
    from megatron.core.num_microbatches_calculator import get_num_microbatches
    from megatron.training import argument_utils
    args = run("--micro-batch-size", 4, "--tensor-model-parallel-size", 2, "--memguard", "autotune")
    out = capsys.readouterr().out
    assert "[memguard] autotune changed micro_batch_size 4 -> 1, pipeline_model_parallel_size 1 -> " in out
    assert "global_batch_size (default) -> 32" in out
    assert args.micro_batch_size == 1 and args.pipeline_model_parallel_size in (2, 4, 8)
    assert args.global_batch_size == 32 and args.eval_micro_batch_size == 1
    assert args.data_parallel_size == 16 // (2 * args.pipeline_model_parallel_size)
    assert get_num_microbatches() == 32 // args.data_parallel_size
    # what pretrain_gpt.py freezes next carries the tuned layout. core_v0.19: GPTModelConfig
    # (gpt_config_from_args) inside the PretrainConfigContainer. core_v0.18: no GPTModelConfig yet (its
    # argument_utils.py builds HybridModelConfig only; PretrainConfigContainer.model "TODO: add support for
    # GPTModelConfig"), so the GPT model's TransformerConfig is built from the arguments when the model is built
    if hasattr(argument_utils, "gpt_config_from_args"):
        model_cfg = argument_utils.gpt_config_from_args(args)
        transformer = model_cfg.transformer
    else:
        model_cfg, transformer = None, argument_utils.core_transformer_config_from_args(args)
    container = argument_utils.pretrain_cfg_container_from_args(args, model_cfg)
    assert transformer.pipeline_model_parallel_size == args.pipeline_model_parallel_size
    assert container.train.micro_batch_size == 1 and container.train.global_batch_size == 32


def test_autotune_keeps_an_explicit_gbs_and_the_layout_flag(run, capsys):
    args = run("--micro-batch-size", 4, "--global-batch-size", 64, "--tensor-model-parallel-size", 2,
               "--memguard", "autotune")
    assert args.global_batch_size == 64 and 64 % (args.micro_batch_size * args.data_parallel_size) == 0
    capsys.readouterr()
    args2 = None
    from megatron.training import global_vars
    global_vars.unset_global_variables()
    args2 = run("--micro-batch-size", 4, "--global-batch-size", 64, "--tensor-model-parallel-size", 2,
                "--pipeline-model-parallel-size", 2, "--pipeline-model-parallel-layout", "Et*16|t*16L",
                "--memguard", "autotune")
    assert args2.pipeline_model_parallel_size == 2
    assert "encodes PP 2" in capsys.readouterr().out


def test_autotune_with_recompute_allowed_from_environment(run, monkeypatch):
    monkeypatch.setenv("MEMGUARD", "autotune")
    monkeypatch.setenv("MEMGUARD_ALLOW_RECOMPUTE", "1")
    monkeypatch.setenv("WORLD_SIZE", "8")   # TP8 on 8 GPUs: no room for PP; MBS is 1 already
    args = run("--micro-batch-size", 1, "--tensor-model-parallel-size", 8, "--sequence-parallel",
               "--seq-length", 65536, "--max-position-embeddings", 65536)
    assert args.memguard == "autotune" and args.memguard_allow_recompute is True
    # the recompute ladder's first rung that fits (tests/test_autotune.py counts what it frees), through
    # Megatron's validate_args and the TransformerConfig it builds next
    assert args.recompute_granularity == "selective" and args.recompute_modules == ["mlp"]
    assert args.recompute_method is None and args.recompute_num_layers is None
    assert _transformer_config(args).recompute_modules == ["mlp"]


def _transformer_config(args):
    """The TransformerConfig pretrain_gpt.py builds from the validated arguments: core 0.19's
    gpt_config_from_args; core 0.18.2 has none and builds it at model build with
    core_transformer_config_from_args (MLATransformerConfig for multi-latent attention)."""
    try:
        from megatron.training.argument_utils import gpt_config_from_args
    except ImportError:
        from megatron.core.transformer.transformer_config import MLATransformerConfig
        from megatron.training.arguments import core_transformer_config_from_args
        return core_transformer_config_from_args(args, MLATransformerConfig if args.multi_latent_attention else None)
    return gpt_config_from_args(args).transformer


def test_autotune_never_starts_a_tight_job(run, hook, monkeypatch, capsys):
    # Llama-3.1-8B on 8 H100s with MBS 4 (issue 20): MBS 1 on PP 8 is the lowest peak and it is tight, so every
    # rank aborts before allocating; allowed to recompute, Megatron's own validation takes the tuned layout.
    from megatron.training import global_vars
    from megatron_memguard.megatron import MemguardAbort
    monkeypatch.setenv("WORLD_SIZE", "8")
    with pytest.raises(MemguardAbort) as e:
        run("--micro-batch-size", 4, "--memguard", "autotune")
    assert e.value.code == 3
    out = capsys.readouterr().out
    d = hook.STATE.decision
    assert d.action == "abort" and d.autotune.chosen is None and 0.8 < d.autotune.nearest[0].fraction <= 1.0
    assert "[memguard]   nearest: MBS 1, PP 8 (DP 1), no recompute" in out
    assert "[memguard]   would fit with activation recomputation (--memguard-allow-recompute): " in out
    global_vars.unset_global_variables()
    args = run("--micro-batch-size", 4, "--memguard", "autotune", "--memguard-allow-recompute")
    d = hook.STATE.decision
    assert d.action == "tuned" and d.estimate.peak_device_bytes <= 0.8 * d.estimate.gpu_memory_bytes
    # a rung of the recompute ladder (selective modules) fits before full recomputation
    assert args.recompute_granularity == "selective" == d.layout.recompute_granularity
    assert tuple(args.recompute_modules) == d.layout.recompute_modules and args.micro_batch_size == d.layout.micro_batch_size
    assert args.pipeline_model_parallel_size == d.layout.pp


def test_threshold_and_gpu_memory_flags(run, capsys):
    run("--micro-batch-size", 1, "--tensor-model-parallel-size", 8, "--memguard-gpu-memory", "40GiB",
        "--memguard-threshold", "0.95")
    out = capsys.readouterr().out
    assert "threshold 95%, H100-80GB 40.00 GiB (--memguard-gpu-memory)" in out


def test_env_threshold_aborts(run, monkeypatch):
    monkeypatch.setenv("MEMGUARD", "abort")
    monkeypatch.setenv("MEMGUARD_THRESHOLD", "0.05")
    with pytest.raises(SystemExit) as e:
        run("--micro-batch-size", 1, "--tensor-model-parallel-size", 8)
    assert e.value.code == 3


@pytest.mark.parametrize("flags, env, text", [
    (["--memguard", "maybe"], {}, "argument --memguard: invalid choice: 'maybe'"),
    (["--memguard-threshold", "1.7"], {}, "argument --memguard-threshold: invalid value '1.7': must be in (0, 1.5]"),
    (["--memguard-gpu-memory", "80 apples"], {}, "argument --memguard-gpu-memory: invalid value '80 apples'"),
    ([], {"MEMGUARD_LOG_INTERVAL": "-3"}, "argument --memguard-log-interval: invalid value '-3' (from MEMGUARD_LOG_INTERVAL)"),
])
def test_bad_values(run, capsys, monkeypatch, flags, env, text):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(SystemExit) as e:
        run("--micro-batch-size", 1, *flags)
    assert e.value.code == 2
    assert f"pretrain_gpt.py: error: {text}" in capsys.readouterr().err


def test_megatron_keeps_its_own_errors(run, capsys):
    with pytest.raises(AssertionError, match="not divisible"):
        run("--micro-batch-size", 1, "--tensor-model-parallel-size", 3)
    assert "[memguard]" not in capsys.readouterr().out


def test_flags_on_megatrons_parser(hook):
    # (megatron-core 0.19.2's own --help crashes on a '%' in --moe-paged-stash-buffer-size-factor-cuda's help,
    # so the group is checked on the parser add_megatron_arguments builds rather than through --help)
    import argparse
    from megatron.training import arguments
    from megatron_memguard.megatron import FLAGS
    p = arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    for spec in FLAGS:
        assert spec.flag in p._option_string_actions
    group = next(g for g in p._action_groups if g.title == "memguard")
    assert [a.option_strings[0] for a in group._group_actions] == [f.flag for f in FLAGS]
    assert p.parse_args(["--memguard", "report"]).memguard == "report"


def test_multi_latent_attention_through_validate_args(hook, monkeypatch, capsys):
    # MLA's flags as Megatron's own parser and validate_args leave them (rope type, latent ranks)
    import torch
    from megatron.training import global_vars
    from megatron.training.arguments import parse_and_validate_args
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i=None: H100)
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    hook.STATE.decision = None
    argv = ("--num-layers 4 --hidden-size 512 --num-attention-heads 8 --multi-latent-attention --q-lora-rank 192 "
            "--kv-lora-rank 64 --qk-head-dim 16 --qk-pos-emb-head-dim 8 --v-head-dim 16 --seq-length 1024 "
            "--max-position-embeddings 1024 --micro-batch-size 4 --global-batch-size 32 --bf16 "
            "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --sequence-parallel "
            "--lr 1e-4 --train-iters 10 --mock-data --tokenizer-type NullTokenizer --vocab-size 50257 "
            "--memguard report").split()
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *argv])
    try:
        args = parse_and_validate_args(extra_args_provider=None, args_defaults=DEFAULTS)
    finally:
        global_vars.unset_global_variables()
    out = capsys.readouterr().out
    assert args.multi_latent_attention and "8 heads (MLA, q rank 192, kv rank 64)" in out and "pp1 at its peak" in out


def test_megatrons_argument_table_gives_the_same_layout(run, capsys, tmp_path):
    # the table 0.19.2's validate_args prints (_print_args), read back from a log by memguard report / calibrate
    from megatron_memguard import layout_from_flags
    from megatron_memguard.report.megatron_log import read_megatron_logs
    from megatron_memguard.report.megatron_run import raw_from_log
    from megatron_memguard.resolve import resolve
    flags = ["--micro-batch-size", "2", "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
             "--sequence-parallel", "--use-distributed-optimizer", "--recompute-granularity", "selective",
             "--memguard", "off"]
    run(*flags)
    log = tmp_path / "rank0.log"
    log.write_text(capsys.readouterr().out)
    parsed = read_megatron_logs(str(log))
    assert parsed.args["world_size"] == 16 and parsed.args["tensor_model_parallel_size"] == 2
    assert parsed.args["params_dtype"] == "torch.bfloat16" and parsed.args["recompute_granularity"] == "selective"
    raw = raw_from_log(parsed)
    got = resolve(raw, world_size=raw.world_size)
    want = layout_from_flags(BASE + flags[:-2], world_size=16, env={"CUDA_DEVICE_MAX_CONNECTIONS": "1"})
    assert got.to_dict() | {"notes": []} == want.to_dict() | {"notes": [], "env": got.to_dict()["env"]}


def test_cuda_graphs_and_mtp_through_the_real_validate_args(run, hook, capsys, monkeypatch):
    # after validate_args the namespace holds CudaGraphModule members and te_rng_tracker switched on;
    # the estimate counts the graphs' static buffers and the MTP block of the last stage (issue 17)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "")
    run("--micro-batch-size", 1, "--tensor-model-parallel-size", 8, "--cuda-graph-impl", "transformer_engine",
        "--cuda-graph-modules", "attn", "--mtp-num-layers", "1", "--memguard", "report")
    terms = {t.name for s in hook.STATE.decision.estimate.stages for t in s.terms}
    assert {"cuda_graph_static_io", "mtp_block_activations", "mtp_loss_buffers"} <= terms


# Mixture of experts: Llama-3.1-8B's shape with 8 experts of a quarter of its FFN width per layer, EP 8 on 16
# GPUs; 0.19's parser gives --moe-aux-loss-coeff as a list until validate_args (the hook reads it before).
MOE = ["--num-experts", 8, "--moe-router-topk", 2, "--moe-ffn-hidden-size", 3584, "--expert-model-parallel-size", 8,
       "--moe-grouped-gemm", "--moe-token-dispatcher-type", "alltoall", "--moe-aux-loss-coeff", "0.01",
       "--moe-router-load-balancing-type", "aux_loss"]


def test_moe_autotune_keeps_the_expert_grid(run, hook, capsys):
    args = run("--micro-batch-size", 4, "--global-batch-size", 64, *MOE, "--memguard", "autotune",
               "--memguard-allow-recompute")
    out = capsys.readouterr().out
    d = hook.STATE.decision
    assert d.action == "tuned" and d.estimate.verdict == "fits"
    assert args.pipeline_model_parallel_size in (1, 2)
    assert 16 % (args.expert_tensor_parallel_size * args.expert_model_parallel_size * args.pipeline_model_parallel_size) == 0
    assert "pipeline sizes 4, 8, 16 not tried" in out
    assert d.layout.expert_model_parallel_size == 8 and args.moe_aux_loss_coeff == 0.01


def test_moe_abort_names_a_layout_with_the_expert_grid(run, hook, capsys):
    from megatron_memguard.megatron import ABORT_EXIT_CODE
    with pytest.raises(SystemExit) as e:
        run("--micro-batch-size", 4, "--global-batch-size", 64, *MOE, "--memguard", "abort",
            "--memguard-allow-recompute")
    assert e.value.code == ABORT_EXIT_CODE
    out = capsys.readouterr().out
    assert "[memguard] ABORT" in out and "[memguard] a layout that fits:" in out
    assert "--pipeline-model-parallel-size 4" not in out


def test_moe_fits_logs_the_worst_case_after_the_verdict(run, hook, capsys):
    # fits with full recomputation; the verdict is the balanced estimate's, the second line the worst case's
    run("--micro-batch-size", 1, "--global-batch-size", 64, "--pipeline-model-parallel-size", 2, *MOE,
        "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", 1)
    out = capsys.readouterr().out
    d = hook.STATE.decision
    assert d.action == "fits"
    lines = [ln for ln in out.splitlines() if ln.startswith("[memguard] ")]
    i = next(k for k, ln in enumerate(lines) if ln.startswith("[memguard] verdict: FITS"))
    # the stage whose worst case needs the most device memory
    worst = max((s for s in d.estimate.stages if s.moe), key=lambda s: s.moe["worst_case"]["device_total_bytes"])
    w = worst.moe["worst_case"]["device_total_bytes"] / d.estimate.gpu_memory_bytes
    assert lines[i + 1].startswith(f"[memguard] pp{worst.pp_rank} MoE routing: balanced")
    assert f"= {w:.0%} of the GPU, " in lines[i + 1]


@pytest.mark.parametrize("extra", [(), ("--moe-shared-expert-overlap",)], ids=["dsv3-like", "shared-expert-overlap"])
def test_recompute_ladder_passes_megatrons_validation(hook, monkeypatch, capsys, extra):
    # autotune's recompute ladder (tests/test_recompute_ladder.py: a DeepSeek-V3-like MoE at 16k tokens on 64
    # GPUs, where only recomputation is left): the tuned command line passes the real parse_args +
    # validate_args and the TransformerConfig pretrain_gpt.py builds next (its recompute_modules rules)
    import torch
    from megatron.training import global_vars
    from megatron.training.arguments import parse_and_validate_args
    from test_recompute_ladder import DSV3_LIKE
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i=None: H100)
    monkeypatch.setenv("WORLD_SIZE", "64")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    hook.STATE.decision = None
    argv = [*DSV3_LIKE, "--seq-length", "16384", "--max-position-embeddings", "16384", "--lr", "1e-4",
            "--train-iters", "10", "--mock-data", "--no-rope-fusion", *extra,
            "--memguard", "autotune", "--memguard-allow-recompute"]
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *argv])
    try:
        args = parse_and_validate_args(extra_args_provider=None, args_defaults=DEFAULTS)
        cfg = _transformer_config(args)
    finally:
        global_vars.unset_global_variables()
    d = hook.STATE.decision
    assert d.action == "tuned" and d.estimate.verdict == "fits"
    assert args.recompute_granularity == "selective" and args.recompute_method is None
    assert tuple(args.recompute_modules) == d.layout.recompute_modules and "moe" in args.recompute_modules
    assert cfg.recompute_granularity == "selective" and list(cfg.recompute_modules) == list(args.recompute_modules)
    if extra:
        assert "shared_experts" not in args.recompute_modules
    out = capsys.readouterr().out
    assert "autotune changed recompute_granularity (default) -> selective, recompute_modules (default) -> layernorm " in out


def test_invalid_expert_grid_says_megatron_will_stop(run, hook, capsys):
    # TP2 PP4 EP4 ETP2 on 16 GPUs: validate_args accepts it, but initialize_model_parallel (parallel_state.py,
    # 0.19.2) needs the world to divide into ETP x EP x PP = 2 x 4 x 4 = 32; the hook must not say training goes on
    moe = [str(a) for a in MOE]
    moe[moe.index("--expert-model-parallel-size") + 1] = "4"
    args = run("--micro-batch-size", 1, "--global-batch-size", 64, "--tensor-model-parallel-size", 2, "--sequence-parallel",
               "--pipeline-model-parallel-size", 4, "--expert-tensor-parallel-size", 2, *moe)
    out = capsys.readouterr().out
    assert args.expert_model_parallel_size == 4 and hook.STATE.decision.action == "unsupported"
    line = next(ln for ln in out.splitlines() if "cannot estimate this configuration" in ln)
    assert "training continues unchecked" not in line
    assert ("Megatron's validate_args accepts it but the run will stop in initialize_model_parallel: world size 16 is "
            "not divisible by expert tensor parallel 2 x expert parallel 4 x pipeline parallel 4 = 32") in line


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
def test_moe_fp8_autotune_is_what_megatron_validates_and_builds(run, hook, capsys, monkeypatch, recipe):
    # MoE under FP8 (hybrid, delayed or current scaling) through the real parse_args + validate_args of this era
    # (0.18.2, 0.19.2): autotune's change is made before validate_args, which accepts it; the TransformerConfig
    # pretrain_gpt.py builds next takes it (fp8 and recompute_modules rules); and the validated namespace, read
    # back by memguard, is the layout the decision estimated (so the tuned job is the one that was checked)
    from megatron.training import argument_utils

    from megatron_memguard.readers.megatron_namespace import raw_from_namespace
    from megatron_memguard.resolve import resolve

    args = run("--micro-batch-size", 4, "--global-batch-size", 64, *MOE, "--fp8-format", "hybrid", "--fp8-recipe",
               recipe, "--memguard", "autotune", "--memguard-allow-recompute")
    out = capsys.readouterr().out
    d = hook.STATE.decision
    assert d.action == "tuned" and d.estimate.verdict == "fits" and "[memguard] autotune changed" in out
    assert (args.fp8, args.fp8_recipe, args.expert_model_parallel_size) == ("hybrid", recipe, 8)
    assert 16 % (args.expert_model_parallel_size * args.pipeline_model_parallel_size) == 0
    # (Transformer Engine is not installed here: TransformerConfig's MoE-FP8 check asks for TE >= 1.7, which every
    # TE that runs core 0.18 / 0.19 is)
    import megatron.core.transformer.transformer_config as tc
    monkeypatch.setattr(tc, "is_te_min_version", lambda *a, **k: True)
    transformer = (argument_utils.gpt_config_from_args(args).transformer if hasattr(argument_utils, "gpt_config_from_args")
                   else argument_utils.core_transformer_config_from_args(args))
    assert (transformer.fp8, transformer.num_moe_experts) == ("hybrid", 8)
    assert transformer.recompute_granularity == args.recompute_granularity
    L = resolve(raw_from_namespace(args), world_size=16, megatron_version=d.layout.megatron_version)
    # (vocab_size: the validated namespace keeps only the padded size, which is compared)
    skip = ("notes", "env", "vocab_size")
    assert L.padded_vocab_size == d.layout.padded_vocab_size == args.padded_vocab_size
    assert ({k: v for k, v in L.to_dict().items() if k not in skip}
            == {k: v for k, v in d.layout.to_dict().items() if k not in skip})


# Inputs megatron.training's validate_args (0.19.2) lets through but Megatron stops on later: the hook names where and
# what to change instead of "training continues unchecked" (decision.megatron_failure); the mode still decides
# whether it aborts, and on such an input the hook never does (no estimate).
def _refusal_line(out: str) -> str:
    return next(ln for ln in out.splitlines() if "cannot estimate this configuration" in ln)


def test_mtp_uniform_recompute_of_two_layers_says_megatron_will_stop(run, hook, capsys):
    # MultiTokenPredictionLayer._checkpointed_forward (transformer/multi_token_prediction.py, core 0.19.2) asserts
    # "recompute_num_layers must be 1 for MTP recompute" under uniform, at the first forward
    args = run("--micro-batch-size", 1, "--tensor-model-parallel-size", 8, "--mtp-num-layers", 1,
               "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", 2,
               "--memguard", "abort")
    line = _refusal_line(capsys.readouterr().out)
    assert hook.STATE.decision.action == "unsupported" and args.recompute_num_layers == 2
    assert "training continues unchecked" not in line
    assert line.endswith("Megatron's validate_args accepts it but the run will stop at the first forward step "
                         "(MultiTokenPredictionLayer._checkpointed_forward asserts) (change --recompute-num-layers)")


@pytest.mark.parametrize("gbs, vp", [(48, 2), (16, 2)])
def test_interleaved_micro_batch_groups_say_megatron_will_stop(run, hook, capsys, gbs, vp):
    # validate_args (0.19.2) does not check the interleaved schedule's micro-batch groups; the schedule raises at the
    # first training step (pipeline_parallel/schedules.py forward_backward_pipelining_with_interleaving, lines
    # 1133-1153): GBS 48 / (MBS 4 x DP 4) = 3 micro-batches in groups of PP 2 leave a last group of 1 < PP
    # (RuntimeError); GBS 16: 1 micro-batch < the group size 2 (ValueError)
    args = run("--micro-batch-size", 4, "--global-batch-size", gbs, "--tensor-model-parallel-size", 2,
               "--pipeline-model-parallel-size", 2, "--num-layers-per-virtual-pipeline-stage", vp, "--memguard", "autotune")
    line = _refusal_line(capsys.readouterr().out)
    assert hook.STATE.decision.action == "unsupported" and args.virtual_pipeline_model_parallel_size == 8
    assert "training continues unchecked" not in line
    assert line.endswith("Megatron's validate_args accepts it but the run will stop at the first training step (the "
                         "interleaved pipeline schedule raises on its micro-batch groups) (change --global-batch-size)")


def test_moe_with_tp_and_no_sequence_parallel_says_megatron_will_stop(run, hook, capsys):
    # validate_args (0.19.2) lets MoE with TP > 1 and no --sequence-parallel through; MoELayer.forward raises ValueError
    # in training (transformer/moe/moe_layer.py line 629)
    moe = [f for f in MOE if f != "--moe-grouped-gemm"]
    args = run("--micro-batch-size", 1, "--global-batch-size", 64, "--tensor-model-parallel-size", 2, *moe,
               "--expert-model-parallel-size", 4, "--memguard", "autotune")
    line = _refusal_line(capsys.readouterr().out)
    assert hook.STATE.decision.action == "unsupported" and not args.sequence_parallel
    assert line.endswith("Megatron's validate_args accepts it but the run will stop at the first forward step "
                         "(MoELayer.forward raises) (change --sequence-parallel)")


@pytest.mark.parametrize("extra, key", [(["--attention-backend", "flash"], "--attention-backend"),
                                        (["--context-parallel-size", 2], "--context-parallel-size")])
def test_fp32_attention_without_a_te_backend_says_megatron_will_stop(run, hook, capsys, monkeypatch, extra, key):
    # fp32 q/k/v: TE's get_attention_backend drops flash-attn and FusedAttention (TE 2.20.2 dot_product_attention/
    # utils.py); flash switches the unfused one off, and under CP TE disables it anyway (auto on an H100):
    # DotProductAttention raises "No dot product attention backend is available" at the first forward
    monkeypatch.setattr(sys.modules[__name__], "BASE", [f for f in BASE if f != "--bf16"])
    args = run("--micro-batch-size", 1, "--tensor-model-parallel-size", 4, *extra)
    line = _refusal_line(capsys.readouterr().out)
    assert not args.bf16 and hook.STATE.decision.action == "unsupported"
    assert "training continues unchecked" not in line
    assert line.endswith("Megatron's validate_args accepts it but the run will stop at the first forward step "
                         "(Transformer Engine's DotProductAttention raises \"No dot product attention backend is "
                         f"available\") (change {key})")


def test_a_refusal_of_memguard_alone_still_says_training_continues(run, capsys):
    # a custom layer spec: memguard does not model it, Megatron runs it
    run("--micro-batch-size", 1, "--tensor-model-parallel-size", 2, "--spec", "my_module", "my_spec")
    assert _refusal_line(capsys.readouterr().out).endswith("training continues unchecked")
