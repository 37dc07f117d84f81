"""The hook in the legacy era (core <= 0.17: pretrain() parses and validates inside initialize_megatron).

Against the real megatron.training of megatron-core 0.17.x where it is installed (Python 3.12, tests/run.sh's
.venv312-core017), otherwise against stand-ins with core_v0.16.1's names, signatures and call order
(tests/legacy_standin, Python 3.11); conftest.legacy_training() makes the choice, the tests are the same."""
import collections
import importlib.util
import os
import sys

import pytest

from conftest import LEGACY_STANDIN as STANDIN, LLAMA31_8B, legacy_training

HERE = os.path.dirname(os.path.abspath(__file__))
LEGACY = legacy_training()   # "real", "standin" or None (a config-container-era megatron.training is installed)


def _real_megatron_training() -> bool:
    """A config-container-era megatron.training is installed: the legacy-era tests do not apply."""
    return LEGACY is None


pytestmark = ([pytest.mark.megatron_training] if LEGACY == "real" else []) + [
    pytest.mark.skipif(LEGACY is None, reason="a config-container-era megatron.training is installed; the legacy-era "
                       "tests run against megatron-core 0.17's real one or, where none is installed, the stand-ins"),
    pytest.mark.skipif(importlib.util.find_spec("torch") is None or importlib.util.find_spec("megatron.core") is None,
                       reason="needs torch and megatron-core"),
]

Props = collections.namedtuple("Props", "name major minor total_memory multi_processor_count")
H100 = Props("NVIDIA H100 80GB HBM3", 9, 0, 85028896768, 132)
BASE = LLAMA31_8B + ["--lr", "1e-4", "--train-iters", "10"]


def _fresh_process_state(monkeypatch) -> None:
    """What a new process starts without: the real initialize_megatron (core 0.17) sets up megatron-core's
    rerun state machine after set_global_variables and asserts it is not set up yet; the stand-in stops before."""
    import megatron.core.rerun_state_machine as rsm
    monkeypatch.setattr(rsm, "_GLOBAL_RERUN_STATE_MACHINE", None)


@pytest.fixture
def legacy(monkeypatch):
    import torch
    if LEGACY == "standin":   # megatron is a namespace package: the stand-in adds megatron.training to megatron.core
        sys.path.insert(0, STANDIN)
        for m in [k for k in sys.modules if k == "megatron.training" or k.startswith("megatron.training.")]:
            del sys.modules[m]
    import megatron.training.global_vars as gv
    import megatron.training.initialize as initialize
    import megatron.training.arguments as arguments
    import megatron.training.training as training
    import megatron_memguard.megatron as hook
    hook.uninstall()
    assert hook.install()
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i=None: H100)
    for k in ("MEMGUARD", "MEMGUARD_THRESHOLD", "MEMGUARD_GPU_MEMORY", "RANK"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("LOCAL_RANK", "0")

    class L:
        pass
    ns = L()
    ns.gv, ns.initialize, ns.arguments, ns.training, ns.hook = gv, initialize, arguments, training, hook

    def run(*flags):
        monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *BASE, *[str(f) for f in flags]])
        _fresh_process_state(monkeypatch)
        initialize.initialize_megatron(args_defaults={"tokenizer_type": "GPT2BPETokenizer"}, allow_no_cuda=True,
                                       skip_mpu_initialization=True)
        return gv.get_args()
    ns.run = run
    yield ns
    hook.uninstall()
    gv.unset_global_variables()
    if LEGACY == "standin":
        for m in [k for k in sys.modules if k == "megatron.training" or k.startswith("megatron.training.")]:
            del sys.modules[m]
        sys.path.remove(STANDIN)


def test_era_and_targets(legacy):
    assert legacy.hook.STATE.era == "legacy"
    targets = legacy.hook.wrapped_targets()
    for t in ("megatron.training.arguments.add_megatron_arguments", "megatron.training.initialize.validate_args",
              "megatron.training.arguments.validate_args", "megatron.training.initialize.validate_yaml",
              "megatron.training.training.setup_model_and_optimizer", "megatron.training.training.training_log",
              "megatron.training.training.train"):
        assert t in targets
    # installing again wraps nothing twice
    assert legacy.hook.install()
    v = legacy.initialize.validate_args
    assert getattr(v.__memguard_original__, "__memguard_original__", None) is None
    assert len(legacy.hook.wrapped_targets()) == len(targets)


def test_warn_fits_one_line_and_validation_runs_once_loudly(legacy, capsys):
    args = legacy.run("--micro-batch-size", 1, "--tensor-model-parallel-size", 8)
    out = capsys.readouterr().out
    assert "[memguard] verdict: FITS" in out
    assert out.count("------------------------ arguments ------------------------") == 1  # the dry run is silent
    assert args.micro_batch_size == 1 and args.memguard == "warn"
    # the vocabulary memguard predicted with is the one Megatron's tokenizer build padded to (Llama-3.1's 128256
    # with NullTokenizer: core 0.16 / 0.17 add an EOD token, 128257 -> the next multiple of 128 x TP 8 = 126 x 1024)
    assert legacy.hook.STATE.decision.layout.padded_vocab_size == args.padded_vocab_size == 129024


def test_warn_prints_breakdown_and_changes_nothing(legacy, capsys):
    args = legacy.run("--micro-batch-size", 4, "--tensor-model-parallel-size", 2)
    out = capsys.readouterr().out
    assert "[memguard] WARNING" in out and "= peak allocated" in out and "WILL NOT FIT" in out
    assert (args.micro_batch_size, args.pipeline_model_parallel_size, args.global_batch_size) == (4, 1, 32)


def test_report_prints_every_stage(legacy, capsys):
    legacy.run("--micro-batch-size", 1, "--tensor-model-parallel-size", 2, "--pipeline-model-parallel-size", 2,
               "--memguard", "report")
    out = capsys.readouterr().out
    assert "pp0 at its peak" in out and "pp1 at its peak" in out


def test_abort_exits_cleanly_on_every_rank_before_allocation(legacy, capsys, monkeypatch):
    from megatron_memguard.megatron import ABORT_EXIT_CODE, MemguardAbort
    with pytest.raises(MemguardAbort) as e:
        legacy.run("--micro-batch-size", 4, "--tensor-model-parallel-size", 2, "--memguard", "abort")
    assert isinstance(e.value, SystemExit) and e.value.code == ABORT_EXIT_CODE
    out = capsys.readouterr().out
    assert out.count("[memguard] ABORT") == 1 and "= peak allocated" in out and "a layout that fits" in out
    assert legacy.gv._GLOBAL_ARGS is None  # set_global_variables never ran: nothing initialised, nothing allocated
    # another rank: the same decision, silently
    monkeypatch.setenv("RANK", "5")
    with pytest.raises(MemguardAbort):
        legacy.run("--micro-batch-size", 4, "--tensor-model-parallel-size", 2, "--memguard", "abort")
    assert "[memguard]" not in capsys.readouterr().out


def test_abort_from_environment(legacy, monkeypatch):
    from megatron_memguard.megatron import MemguardAbort
    monkeypatch.setenv("MEMGUARD", "abort")
    with pytest.raises(MemguardAbort):
        legacy.run("--micro-batch-size", 4, "--tensor-model-parallel-size", 2)


def test_autotune_applies_before_the_real_validation(legacy, capsys):
    from megatron.core.num_microbatches_calculator import get_num_microbatches
    args = legacy.run("--micro-batch-size", 4, "--tensor-model-parallel-size", 2, "--memguard", "autotune")
    out = capsys.readouterr().out
    assert "[memguard] autotune changed micro_batch_size 4 -> " in out
    assert args.global_batch_size == 32                      # pinned: it defaulted to MBS 4 x DP 8
    assert args.micro_batch_size < 4
    assert args.data_parallel_size == 16 // (2 * args.pipeline_model_parallel_size)
    assert get_num_microbatches() == 32 // (args.micro_batch_size * args.data_parallel_size)
    d = legacy.hook.STATE.decision
    assert d.action == "tuned" and d.estimate.verdict == "fits"
    assert d.layout.micro_batch_size == args.micro_batch_size and d.layout.pp == args.pipeline_model_parallel_size


def test_autotune_vpp_keeps_megatrons_rules(legacy):
    args = legacy.run("--micro-batch-size", 2, "--global-batch-size", 64, "--tensor-model-parallel-size", 2,
                      "--pipeline-model-parallel-size", 2, "--num-layers-per-virtual-pipeline-stage", 2,
                      "--memguard", "autotune", "--memguard-threshold", "0.65")
    pp = args.pipeline_model_parallel_size
    assert (32 // pp) % 2 == 0
    m = 64 // (args.micro_batch_size * args.data_parallel_size)
    if args.virtual_pipeline_model_parallel_size:
        assert pp <= m and (m % pp == 0 or m % pp >= pp)


def test_autotune_never_starts_a_tight_job(legacy, monkeypatch, capsys):
    # Llama-3.1-8B on 8 H100s with MBS 4 (issue 20): the best micro-batch / pipeline size is tight (over 80%),
    # so autotune aborts on every rank before allocating, naming the nearest layouts and what would fit.
    from megatron_memguard.megatron import MemguardAbort
    monkeypatch.setenv("WORLD_SIZE", "8")
    with pytest.raises(MemguardAbort) as e:
        legacy.run("--micro-batch-size", 4, "--memguard", "autotune")
    assert e.value.code == 3
    out = capsys.readouterr().out
    d = legacy.hook.STATE.decision
    assert d.action == "abort" and d.autotune.status == "impossible" and d.autotune.chosen is None
    assert 0.8 < d.autotune.nearest[0].fraction <= 1.0
    assert "[memguard]   nearest: MBS 1, PP 8 (DP 1), no recompute" in out
    assert "[memguard]   would fit with activation recomputation (--memguard-allow-recompute): " in out
    assert "autotune found no layout within 80% of GPU memory; aborting on every rank" in out
    # allowed to recompute, it takes a layout within the threshold and Megatron's validation accepts it
    args = legacy.run("--micro-batch-size", 4, "--memguard", "autotune", "--memguard-allow-recompute")
    d = legacy.hook.STATE.decision
    assert d.action == "tuned" and d.estimate.peak_device_bytes <= 0.8 * d.estimate.gpu_memory_bytes
    # a rung of the recompute ladder (selective modules) fits before full recomputation
    assert args.recompute_granularity == "selective" == d.layout.recompute_granularity
    assert tuple(args.recompute_modules) == d.layout.recompute_modules and args.micro_batch_size == d.layout.micro_batch_size


def test_megatron_errors_are_megatrons(legacy, capsys):
    with pytest.raises(AssertionError, match="not divisible"):
        legacy.run("--micro-batch-size", 1, "--tensor-model-parallel-size", 3)
    assert "[memguard]" not in capsys.readouterr().out


def test_off_is_off(legacy, capsys):
    legacy.run("--micro-batch-size", 4, "--tensor-model-parallel-size", 2, "--memguard", "off")
    assert "[memguard]" not in capsys.readouterr().out
    assert legacy.hook.STATE.decision is None


def test_bad_flag_value_is_a_megatron_style_error(legacy, capsys):
    with pytest.raises(SystemExit) as e:
        legacy.run("--micro-batch-size", 1, "--memguard-threshold", "3")
    assert e.value.code == 2
    assert "pretrain_gpt.py: error: argument --memguard-threshold: invalid value '3'" in capsys.readouterr().err


def test_internal_error_is_reported_once_and_training_goes_on(legacy, capsys, monkeypatch):
    import megatron_memguard.megatron.preflight as pf

    def boom(*a, **k):
        raise ZeroDivisionError("estimator bug")
    monkeypatch.setattr(pf, "estimate", boom)
    args = legacy.run("--micro-batch-size", 4, "--tensor-model-parallel-size", 2, "--memguard", "abort")
    err = capsys.readouterr().err
    assert err.count("internal error") == 1 and "estimator bug" in err and "training continues" in err
    assert args.micro_batch_size == 4 and legacy.gv.get_args() is args


def test_unsupported_configuration_is_said_not_guessed(legacy, capsys):
    # (mixture of experts and FP8 are modelled since issues 16 and 17; a custom layer spec is not)
    args = legacy.run("--micro-batch-size", 1, "--tensor-model-parallel-size", 2, "--spec", "my_module", "my_spec",
                      "--memguard", "abort")
    out = capsys.readouterr().out
    assert "cannot estimate this configuration" in out and "not modelled" in out
    assert args.spec == ["my_module", "my_spec"]


def test_unknown_gpu_memory_is_said(legacy, capsys, monkeypatch):
    import torch

    def no_gpu(i=None):
        raise RuntimeError("Found no NVIDIA driver on your system")
    monkeypatch.setattr(torch.cuda, "get_device_properties", no_gpu)
    # TP 1: with TP > 1 the real validate_args (core 0.17.1 arguments.py, get_device_arch_version) reads the
    # device's properties itself and fails first
    legacy.run("--micro-batch-size", 4, "--memguard", "abort")
    out = capsys.readouterr().out
    assert "GPU memory unknown" in out and "--memguard-gpu-memory" in out
    assert legacy.hook.STATE.decision.action == "unknown"


def test_runtime_wrappers_survive_restart_and_report_oom(legacy, tmp_path, capsys):
    import json
    from megatron_memguard.megatron import hook as h
    from megatron_memguard.runtime import Reading, StaticSource
    legacy.run("--micro-batch-size", 1, "--tensor-model-parallel-size", 8, "--memguard-log-dir", tmp_path,
               "--memguard-log-interval", 2)
    pred = legacy.hook.STATE.decision.estimate.stages[0]
    src = StaticSource(Reading(allocated=pred.persistent_bytes, max_allocated=pred.peak_allocated_bytes,
                               reserved=pred.peak_reserved_bytes, max_reserved=pred.peak_reserved_bytes,
                               device_used=pred.device_total_bytes))
    legacy.hook.set_memory_source(src)
    setup = h._wrap_setup(lambda *a, **k: ("model", "optimizer", None))
    log = h._wrap_training_log(lambda *a, **k: "report_memory_flag")

    def train_ok():
        for it in range(1, 5):
            assert log({}, {}, 1e-4, it, 1.0, True, 0, 1.0, None, 0) == "report_memory_flag"
        return 4, 0

    def train_oom():
        log({}, {}, 1e-4, 2, 1.0, True, 0, 1.0, None, 0)
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monitors = []
    for train_fn in (train_ok, train_oom):        # an in-process restart re-enters setup and train
        assert setup(None, None) == ("model", "optimizer", None)
        monitors.append(legacy.hook.STATE.monitor)
        wrapped_train = h._wrap_train(train_fn)
        if train_fn is train_ok:
            assert wrapped_train() == (4, 0)
        else:
            with pytest.raises(RuntimeError, match="out of memory"):
                wrapped_train()
    assert monitors[0] is not monitors[1] and all(m.finished for m in monitors)
    recs = [json.loads(l) for l in open(tmp_path / "memguard-rank00000.jsonl")]
    assert [r["event"] for r in recs] == ["start", "sample", "sample", "summary", "start", "sample", "oom", "summary"]
    assert recs[1]["iteration"] == 2 and recs[2]["iteration"] == 4
    assert recs[1]["predicted"]["peak_allocated"] == pred.peak_allocated_bytes
    err = capsys.readouterr().err
    assert "rank 0 (pp0) ran out of GPU memory" in err and "= peak allocated" in err


def test_yaml_run_has_no_decision_left_from_an_earlier_run(legacy, monkeypatch, tmp_path, capsys):
    import argparse
    legacy.run("--micro-batch-size", 1, "--tensor-model-parallel-size", 8)
    assert legacy.hook.STATE.decision is not None
    legacy.gv.unset_global_variables()
    # a --yaml-cfg run in the same process (in-process restart, tests): its monitor must not predict from the old layout
    _yaml_run(legacy, monkeypatch, tmp_path, NOT_FITTING, "--memguard", "off")
    assert legacy.hook.STATE.decision is None
    # a namespace that is not what load_yaml returns: validate_yaml is left to report it, no decision
    ns = argparse.Namespace(rank=0, yaml_cfg=None)
    assert legacy.initialize.validate_yaml.__memguard_original__ is not None
    with pytest.raises(AttributeError):
        legacy.initialize.validate_yaml(ns, {})
    assert legacy.hook.STATE.decision is None


def test_site_profile_reaches_the_check(legacy, capsys, tmp_path, monkeypatch):
    from megatron_memguard.site_profile import dump_site_profile
    p = tmp_path / "site.yaml"
    p.write_text(dump_site_profile({"cuda_context": 3 * 2**30, "allocator_fragmentation": 0.2}))
    legacy.run("--micro-batch-size", 1, "--tensor-model-parallel-size", 8, "--memguard", "report", "--memguard-profile", p)
    est = legacy.hook.STATE.decision.estimate
    assert all(s.breakdown["cuda_context"] == 3 * 2**30 for s in est.stages)
    assert f"site profile {p}" in capsys.readouterr().out
    legacy.gv.unset_global_variables()
    # a bad file given with the flag: an argparse error, as Megatron reports bad flags
    p.write_text("schema: memguard.site/1\nconstants: {cuda_context: 1TiB}\n")
    with pytest.raises(SystemExit) as e:
        legacy.run("--micro-batch-size", 1, "--tensor-model-parallel-size", 8, "--memguard-profile", p)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "argument --memguard-profile:" in err and "constants.cuda_context" in err
    # the same file from MEMGUARD_PROFILE (set for a whole site): one error line, the job goes on with the
    # default constants (DEFAULT_SITE's, not the profile's)
    from megatron_memguard.estimator.site import DEFAULT_SITE
    monkeypatch.setenv("MEMGUARD_PROFILE", str(p))
    legacy.run("--micro-batch-size", 1, "--tensor-model-parallel-size", 8, "--memguard", "report")
    err = capsys.readouterr().err
    assert "[memguard] error: MEMGUARD_PROFILE=" in err and "constants.cuda_context" in err and "training continues" in err
    est = legacy.hook.STATE.decision.estimate
    assert all(s.breakdown["cuda_context"] == DEFAULT_SITE.cuda_context for s in est.stages)


# Mixture of experts (core_v0.16.1's MoE arguments in the stand-in): Llama-3.1-8B's shape with 8 experts per
# layer of a quarter of its FFN width (fine-grained experts), EP 8 on 16 GPUs.
MOE = ["--num-experts", 8, "--moe-router-topk", 2, "--moe-ffn-hidden-size", 3584, "--expert-model-parallel-size", 8,
       "--moe-grouped-gemm",
       "--moe-token-dispatcher-type", "alltoall", "--moe-aux-loss-coeff", "0.01"]


def test_moe_autotune_keeps_the_expert_grid(legacy, capsys):
    # 16 GPUs with EP 8: PP 4 and up leave no whole expert grid (initialize_model_parallel would raise after
    # validate_args); autotune applies a micro-batch / recompute change at PP 1 or 2, and Megatron accepts it
    args = legacy.run("--micro-batch-size", 4, "--global-batch-size", 64, *MOE, "--memguard", "autotune",
                      "--memguard-allow-recompute")
    out = capsys.readouterr().out
    d = legacy.hook.STATE.decision
    assert d.action == "tuned" and d.estimate.verdict == "fits"
    assert args.pipeline_model_parallel_size in (1, 2)
    assert 16 % (args.expert_tensor_parallel_size * args.expert_model_parallel_size * args.pipeline_model_parallel_size) == 0
    assert "pipeline sizes 4, 8, 16 not tried" in out
    assert d.layout.expert_model_parallel_size == 8


@pytest.mark.skipif(LEGACY != "real", reason="the stand-in's parser has no --fp8-recipe: core 0.17.1's real one")
@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
def test_moe_fp8_autotune_is_what_megatron_validates_and_builds(legacy, capsys, monkeypatch, recipe):
    # MoE under FP8 through the legacy era's initialize_megatron (core 0.17.1's real parse_args + validate_args):
    # autotune's change is made before validate_args, which accepts it; the TransformerConfig pretrain_gpt.py
    # builds next takes it; and the validated namespace, read back by memguard, is the layout the decision estimated
    from megatron_memguard.readers.megatron_namespace import raw_from_namespace
    from megatron_memguard.resolve import resolve

    args = legacy.run("--micro-batch-size", 4, "--global-batch-size", 64, *MOE, "--fp8-format", "hybrid",
                      "--fp8-recipe", recipe, "--no-rope-fusion",   # (TE's fused RoPE: no TE installed here)
                      "--memguard", "autotune", "--memguard-allow-recompute")
    out = capsys.readouterr().out
    d = legacy.hook.STATE.decision
    assert d.action == "tuned" and d.estimate.verdict == "fits" and "[memguard] autotune changed" in out
    assert (args.fp8, args.fp8_recipe, args.expert_model_parallel_size) == ("hybrid", recipe, 8)
    assert 16 % (args.expert_model_parallel_size * args.pipeline_model_parallel_size) == 0
    # (Transformer Engine is not installed here: TransformerConfig's MoE-FP8 check asks for TE >= 1.7)
    import megatron.core.transformer.transformer_config as tc
    monkeypatch.setattr(tc, "is_te_min_version", lambda *a, **k: True)
    transformer = legacy.arguments.core_transformer_config_from_args(args)
    assert (transformer.fp8, transformer.num_moe_experts) == ("hybrid", 8)
    assert transformer.recompute_granularity == args.recompute_granularity
    L = resolve(raw_from_namespace(args), world_size=16, megatron_version=d.layout.megatron_version)
    skip = ("notes", "env", "vocab_size")    # (the validated namespace keeps only the padded size, compared)
    assert L.padded_vocab_size == d.layout.padded_vocab_size == args.padded_vocab_size
    assert ({k: v for k, v in L.to_dict().items() if k not in skip}
            == {k: v for k, v in d.layout.to_dict().items() if k not in skip})


def test_moe_warn_shows_the_worst_case(legacy, capsys):
    legacy.run("--micro-batch-size", 1, "--global-batch-size", 64, "--pipeline-model-parallel-size", 2, *MOE)
    out = capsys.readouterr().out
    d = legacy.hook.STATE.decision
    assert d.layout.moe is not None and d.layout.expert_model_parallel_size == 8
    # fits or not, the log gives the worst case and its share of the GPU (the verdict is the balanced estimate's)
    # fits: the one-line log names the stage whose worst case needs the most; otherwise the critical stage's
    # breakdown carries it
    stage = max((s for s in d.estimate.stages if s.moe), key=lambda s: s.moe["worst_case"]["device_total_bytes"]) \
        if d.estimate.verdict == "fits" else d.estimate.critical
    w = stage.moe["worst_case"]["device_total_bytes"] / d.estimate.gpu_memory_bytes
    line = next(ln for ln in out.splitlines() if "MoE routing: balanced" in ln)
    assert f"= {w:.0%} of the GPU, " in line and ("within" if w <= 0.8 else "over") + " the 80% threshold" in line


# -- --yaml-cfg runs: initialize_megatron -> initialize.validate_yaml (wrapped) -> set_global_variables ----------
def _yaml_run(legacy, monkeypatch, tmp_path, yaml_flags, *command_line):
    """The job of ``yaml_flags`` written as a --yaml-cfg file (tests/yaml_cfg_dump.py), started with
    ``--yaml-cfg FILE *command_line``."""
    from yaml_cfg_dump import write_yaml_cfg
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *BASE, *[str(f) for f in yaml_flags]])
    path = write_yaml_cfg(tmp_path / "gpt_config.yaml", legacy.arguments.parse_args())
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", "--yaml-cfg", path, *[str(f) for f in command_line]])
    _fresh_process_state(monkeypatch)
    legacy.initialize.initialize_megatron(args_defaults={"tokenizer_type": "GPT2BPETokenizer"}, allow_no_cuda=True,
                                          skip_mpu_initialization=True)
    return legacy.gv.get_args(), path


NOT_FITTING = ("--micro-batch-size", 4, "--tensor-model-parallel-size", 2)


def test_yaml_run_warns_with_the_terms_of_memguard_estimate(legacy, monkeypatch, tmp_path, capsys):
    from megatron_memguard import estimate, layout_from_flags
    args, path = _yaml_run(legacy, monkeypatch, tmp_path, NOT_FITTING)
    out = capsys.readouterr().out
    assert "[memguard] WARNING" in out and "WILL NOT FIT" in out
    d = legacy.hook.STATE.decision
    assert d.action == "warned" and (args.micro_batch_size, args.pipeline_model_parallel_size) == (4, 1)
    # `memguard estimate --gpus 16 -- --yaml-cfg FILE` for the hook's era and GPU
    cli = estimate(layout_from_flags(["--yaml-cfg", path], world_size=16, megatron_version=d.megatron_version),
                   gpu=d.gpu, gpu_memory=d.gpu_memory)
    assert [s.breakdown for s in cli.stages] == [s.breakdown for s in d.estimate.stages]


def test_yaml_run_decides_as_the_flag_run(legacy, monkeypatch, tmp_path, capsys):
    _yaml_run(legacy, monkeypatch, tmp_path, NOT_FITTING, "--memguard", "report")
    from_yaml = legacy.hook.STATE.decision.estimate
    legacy.gv.unset_global_variables()
    legacy.run(*NOT_FITTING, "--memguard", "report")
    from_flags = legacy.hook.STATE.decision.estimate
    assert [s.breakdown for s in from_yaml.stages] == [s.breakdown for s in from_flags.stages]


def test_yaml_abort(legacy, monkeypatch, tmp_path, capsys):
    from megatron_memguard.megatron import ABORT_EXIT_CODE
    monkeypatch.setenv("MEMGUARD", "abort")
    with pytest.raises(SystemExit) as e:
        _yaml_run(legacy, monkeypatch, tmp_path, NOT_FITTING)
    assert e.value.code == ABORT_EXIT_CODE
    assert "[memguard] ABORT: stage pp0 needs" in capsys.readouterr().out
    assert legacy.gv._GLOBAL_ARGS is None


def test_yaml_autotune_reaches_what_megatron_uses_next(legacy, monkeypatch, tmp_path, capsys):
    from megatron.core.num_microbatches_calculator import get_micro_batch_size, get_num_microbatches
    args, _ = _yaml_run(legacy, monkeypatch, tmp_path, NOT_FITTING, "--memguard", "autotune")
    out = capsys.readouterr().out
    # Llama-3.1-8B, 8k tokens, TP2 on 16 H100s: docs/hook.md's autotune example
    assert "[memguard] autotune changed micro_batch_size 4 -> 1, pipeline_model_parallel_size 1 -> 2" in out
    assert (args.micro_batch_size, args.pipeline_model_parallel_size, args.global_batch_size) == (1, 2, 32)
    assert args.model_parallel.pipeline_model_parallel_size == 2 and args.data_parallel_size == 4
    assert get_micro_batch_size() == 1 and get_num_microbatches() == 8


def test_yaml_memguard_keys_in_the_file(legacy, monkeypatch, tmp_path, capsys):
    """A memguard key in the YAML file counts when the flag is not on the command line; a bad one is an
    argument error naming the key."""
    import yaml
    from yaml_cfg_dump import yaml_cfg_doc
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *BASE, *[str(f) for f in NOT_FITTING]])
    doc = yaml_cfg_doc(legacy.arguments.parse_args(), {"memguard": "abort", "memguard_threshold": 7})
    p = tmp_path / "cfg.yaml"
    p.write_text(yaml.safe_dump(doc))
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", "--yaml-cfg", str(p)])
    _fresh_process_state(monkeypatch)
    with pytest.raises(SystemExit) as e:
        legacy.initialize.initialize_megatron(allow_no_cuda=True, skip_mpu_initialization=True)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "error: memguard_threshold (--yaml-cfg" in err and "must be in (0, 1.5]" in err
    doc["memguard_threshold"] = 0.8
    p.write_text(yaml.safe_dump(doc))
    _fresh_process_state(monkeypatch)
    with pytest.raises(SystemExit) as e:
        legacy.initialize.initialize_megatron(allow_no_cuda=True, skip_mpu_initialization=True)
    assert e.value.code == 3 and "[memguard] ABORT" in capsys.readouterr().out   # memguard: abort from the file


def test_yaml_settings_bug_lets_the_run_go_on(legacy, monkeypatch, tmp_path, capsys):
    """Failure policy: an exception inside memguard while reading a YAML run's settings is reported once
    and training goes on unchecked."""
    import megatron_memguard.megatron.hook as hook_mod

    def broken(args, argv=None):
        raise RuntimeError("boom")
    monkeypatch.setattr(hook_mod, "yaml_settings_namespace", broken)
    monkeypatch.setattr(legacy.hook.STATE.error, "logged", False)   # reported once per process
    before = legacy.hook.STATE.errors
    args, _ = _yaml_run(legacy, monkeypatch, tmp_path, NOT_FITTING, "--memguard", "abort")
    assert args.micro_batch_size == 4 and legacy.hook.STATE.decision is None and legacy.hook.STATE.errors == before + 1
    assert "[memguard] internal error in reading the --memguard settings of a --yaml-cfg run" in capsys.readouterr().err


# Inputs validate_args lets through but Megatron stops on later: the hook names where and what to change instead of
# "training continues unchecked" (decision.megatron_failure); whether it aborts stays the user's mode.
MTP_UNIFORM_2 = ["--mtp-num-layers", 1, "--recompute-granularity", "full", "--recompute-method", "uniform",
                 "--recompute-num-layers", 2]


def test_mtp_uniform_recompute_of_two_layers_says_megatron_will_stop(legacy, capsys):
    # MultiTokenPredictionLayer._checkpointed_forward (transformer/multi_token_prediction.py, core 0.16.1) asserts
    # recompute_num_layers == 1 under uniform at the first forward; validate_args does not check it
    args = legacy.run("--micro-batch-size", 1, "--tensor-model-parallel-size", 8, *MTP_UNIFORM_2, "--memguard", "abort")
    line = next(ln for ln in capsys.readouterr().out.splitlines() if "cannot estimate this configuration" in ln)
    assert legacy.hook.STATE.decision.action == "unsupported" and args.recompute_num_layers == 2
    assert "training continues unchecked" not in line
    assert line.endswith("Megatron's validate_args accepts it but the run will stop at the first forward step "
                         "(MultiTokenPredictionLayer._checkpointed_forward asserts) (change --recompute-num-layers)")


def test_fp32_flash_attention_says_megatron_will_stop(legacy, capsys, monkeypatch):
    # fp32 q/k/v: TE's get_attention_backend drops flash-attn and FusedAttention, --attention-backend flash switches
    # the unfused one off, DotProductAttention raises at the first forward (TE 2.11 dot_product_attention/utils.py)
    monkeypatch.setattr(sys.modules[__name__], "BASE", [f for f in BASE if f != "--bf16"])
    args = legacy.run("--micro-batch-size", 1, "--tensor-model-parallel-size", 8, "--attention-backend", "flash")
    line = next(ln for ln in capsys.readouterr().out.splitlines() if "cannot estimate this configuration" in ln)
    assert not args.bf16 and "training continues unchecked" not in line
    assert line.endswith("the run will stop at the first forward step (Transformer Engine's DotProductAttention "
                         "raises \"No dot product attention backend is available\") (change --attention-backend)")


def test_interleaved_micro_batch_groups_say_megatron_will_stop(legacy, capsys):
    # validate_args does not check the interleaved schedule's micro-batch groups; the schedule raises at the first
    # training step (pipeline_parallel/schedules.py forward_backward_pipelining_with_interleaving, core 0.16.1 lines
    # 1006-1016, 0.17.1 1037-1047): GBS 48 / (MBS 4 x DP 4) = 3 micro-batches in groups of PP 2 leave a last group of 1
    args = legacy.run("--micro-batch-size", 4, "--global-batch-size", 48, "--tensor-model-parallel-size", 2,
                      "--pipeline-model-parallel-size", 2, "--num-layers-per-virtual-pipeline-stage", 2,
                      "--memguard", "autotune")
    line = next(ln for ln in capsys.readouterr().out.splitlines() if "cannot estimate this configuration" in ln)
    assert legacy.hook.STATE.decision.action == "unsupported" and args.virtual_pipeline_model_parallel_size == 8
    assert line.endswith("Megatron's validate_args accepts it but the run will stop at the first training step (the "
                         "interleaved pipeline schedule raises on its micro-batch groups) (change --global-batch-size)")


def test_moe_with_tp_and_no_sequence_parallel_says_megatron_will_stop(legacy, capsys):
    # validate_args lets MoE with TP > 1 and no --sequence-parallel through; MoELayer.forward raises ValueError in
    # training (transformer/moe/moe_layer.py, core 0.16.1 line 379, 0.17.1 546)
    args = legacy.run("--micro-batch-size", 1, "--global-batch-size", 64, "--tensor-model-parallel-size", 2,
                      "--num-experts", 8, "--moe-router-topk", 2, "--moe-ffn-hidden-size", 3584,
                      "--expert-model-parallel-size", 4, "--moe-token-dispatcher-type", "alltoall", "--memguard", "autotune")
    line = next(ln for ln in capsys.readouterr().out.splitlines() if "cannot estimate this configuration" in ln)
    assert legacy.hook.STATE.decision.action == "unsupported" and not args.sequence_parallel
    assert line.endswith("Megatron's validate_args accepts it but the run will stop at the first forward step "
                         "(MoELayer.forward raises) (change --sequence-parallel)")


def test_a_refusal_of_memguard_alone_still_says_training_continues(legacy, capsys):
    # a custom layer spec: memguard cannot model it, Megatron runs it
    legacy.run("--micro-batch-size", 1, "--tensor-model-parallel-size", 2, "--spec", "my_module", "my_spec")
    line = next(ln for ln in capsys.readouterr().out.splitlines() if "cannot estimate this configuration" in ln)
    assert line.endswith("training continues unchecked")
