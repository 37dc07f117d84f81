"""This session's features through the Megatron-LM hook in both eras (issue 17, 'where it must reach'): the
layout memguard reads from Megatron's own validated namespace gives the same estimate, term for term, as the
same flags given to the CLI reader.

Core 0.18.2 / 0.19.2 (Python 3.12): the real megatron.training parse_and_validate_args. Core 0.17.1 (Python 3.12):
the real legacy-era initialize_megatron; core 0.16.1 (Python 3.11): the legacy-era stand-ins of tests/legacy_standin;
both driven through the installed hook (test_hook_legacy's fixture)."""
import os
import sys

import pytest

from conftest import CONTAINER_ERA, H100, LLAMA31_8B, legacy_training, megatron_core_version
from test_hook_legacy import _real_megatron_training, legacy  # noqa: F401 (the legacy-era fixture)

BASE = LLAMA31_8B + "--lr 1e-4 --train-iters 10 --mock-data --no-rope-fusion --micro-batch-size 1".split()
MOE = ("--num-experts 8 --moe-router-topk 2 --expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall "
       "--moe-grouped-gemm").split()
FSDP = "--use-megatron-fsdp --ckpt-format fsdp_dtensor".split()

# one flag set per feature of the session; the term each must bring into the estimate (None: a change of an
# existing term, checked by the equality alone)
CASES = {
    "lion": ("--optimizer lion --use-distributed-optimizer".split(), "lion_exp_avg"),
    "soap": ("--optimizer soap --use-distributed-optimizer".split(), "soap_preconditioners"),
    "muon-lion": ("--optimizer muon --muon-scalar-optimizer lion --use-distributed-optimizer".split(), "muon_momentum"),
    "freeze": ("--freeze-all-layers --use-distributed-optimizer".split(), None),
    "gate": ("--attention-output-gate".split(), None),
    "optimizer-graph": ("--optimizer-cuda-graph --use-distributed-optimizer".split(), None),
    "symmetric-ar": ("--symmetric-ar-type two_shot --tensor-model-parallel-size 2".split(), "symmetric_ar_buffer"),
    "tp-comm-overlap": ("--tp-comm-overlap --tensor-model-parallel-size 2 --sequence-parallel".split(),
                        "tp_comm_userbuffers"),
    "offload-tuning": (("--fine-grained-activation-offloading --offload-modules attn_norm core_attn "
                        "--activation-offload-fraction 0.5 --delta-offload-bytes-across-pp-ranks 1000000 "
                        "--pipeline-model-parallel-size 2").split(), None),
    "delay-wgrad": (MOE + "--delay-wgrad-compute --overlap-moe-expert-parallel-comm --use-distributed-optimizer".split(),
                    None),
    "ep-overlap-pp": (MOE + ("--overlap-moe-expert-parallel-comm --pipeline-model-parallel-size 2 "
                             "--num-layers-per-virtual-pipeline-stage 8 --global-batch-size 16").split(), None),
    "fp8-output-proj": ("--fp8-format e4m3 --fp8-recipe mxfp8 --fp8-output-proj".split(), None),
    "mtp-fp8": ("--mtp-num-layers 1 --fp8-format e4m3 --fp8-recipe tensorwise".split(), None),
    "hsdp": (FSDP + "--num-distributed-optimizer-instances 2".split(), "fsdp_parameters"),
    "hfsdp": (FSDP + "--num-distributed-optimizer-instances 2 --outer-dp-sharding-strategy optim".split(),
              "fsdp_parameters"),
    "fsdp-fine-grained": (FSDP + ["--megatron-fsdp-enable-fine-grained-param-gather"], "fsdp_parameters"),
    "fsdp-moe": (FSDP + MOE, "fsdp_parameters"),
    "keep-fp8-transpose": (FSDP + "--fp8-format e4m3 --fp8-recipe tensorwise --fp8-param-gather "
                                  "--keep-fp8-transpose-cache".split(), None),
}


# the first megatron-core release whose parser has a case's flags (checked in the 0.17.1, 0.18.2 and 0.19.2
# wheels' megatron/training/arguments.py); the others are in 0.18.2's
SINCE = {"freeze": (0, 19), "offload-tuning": (0, 19)}


def _terms(est):
    return [{t.name: t.bytes for t in s.terms} for s in est.stages]


@CONTAINER_ERA[0]
@CONTAINER_ERA[1]
@pytest.mark.parametrize("name", list(CASES))
def test_live_019_namespace_estimates_as_the_cli(name, monkeypatch):
    import torch
    from megatron.training import global_vars
    from megatron.training.arguments import parse_and_validate_args

    from megatron_memguard import estimate, layout_from_flags, resolve
    from megatron_memguard.readers.megatron_namespace import raw_from_namespace
    flags, term = CASES[name]
    installed = megatron_core_version()
    if installed < SINCE.get(name, (0, 18)):
        pytest.skip(f"megatron-core {'.'.join(map(str, installed))}'s parser has no {' '.join(flags)}")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i=None: H100)
    # Megatron-FSDP asserts CUDA_DEVICE_MAX_CONNECTIONS != 1; TP communication overlap wants 1
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8" if "--use-megatron-fsdp" in flags else "1")
    for k, v in (("WORLD_SIZE", "8"), ("RANK", "0"), ("LOCAL_RANK", "0")):
        monkeypatch.setenv(k, v)
    global_vars.unset_global_variables()
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *BASE, *flags])
    try:
        args = parse_and_validate_args(extra_args_provider=None, args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
    finally:
        global_vars.unset_global_variables()
    version = ".".join(map(str, installed))   # the release whose rules the hook applies (STATE.megatron_version)
    live = estimate(resolve(raw_from_namespace(args), world_size=8, megatron_version=version))
    cli = estimate(layout_from_flags(BASE + flags, world_size=8, megatron_version=version))
    assert _terms(live) == _terms(cli)
    if term:
        assert any(d.get(term, 0) > 0 for d in _terms(live)), term


LEGACY = [
    pytest.mark.megatron_training if legacy_training() == "real" else pytest.mark.legacy_standin,
    pytest.mark.skipif(_real_megatron_training(), reason="a config-container-era megatron.training is installed; "
                       "these run against core 0.17's real one or the legacy-era stand-ins (core 0.16.1)"),
    pytest.mark.skipif(megatron_core_version() is None, reason="needs megatron-core"),
]


@LEGACY[0]
@LEGACY[1]
@LEGACY[2]
@pytest.mark.parametrize("flags, term", [
    # core_v0.16.1 and core_v0.17.1 have dist_muon (ping-pong over whole parameters) and TE userbuffers
    (["--optimizer", "dist_muon"], "muon_momentum"),
    (["--tensor-model-parallel-size", 2, "--sequence-parallel", "--tp-comm-overlap"], "tp_comm_userbuffers"),
])
def test_legacy_hook_estimates_as_the_cli(legacy, capsys, flags, term):
    from megatron_memguard import estimate, layout_from_flags
    legacy.run("--micro-batch-size", 1, *flags, "--memguard", "report")
    d = legacy.hook.STATE.decision
    assert d is not None and d.estimate is not None, capsys.readouterr()
    assert str(d.megatron_version) == ".".join(map(str, megatron_core_version()))   # the installed release
    cli = estimate(layout_from_flags(BASE[:len(LLAMA31_8B)] + ["--lr", "1e-4", "--train-iters", "10",
                                     "--micro-batch-size", "1", *[str(f) for f in flags]],
                                     world_size=16, megatron_version=d.megatron_version), gpu=d.gpu,
                   gpu_memory=d.gpu_memory)
    a, b = _terms(d.estimate), _terms(cli)
    assert a == b, [{k: (x.get(k), y.get(k)) for k in set(x) | set(y) if x.get(k) != y.get(k)} for x, y in zip(a, b)]
    assert any(x.get(term, 0) > 0 for x in _terms(d.estimate))
    assert term in capsys.readouterr().out          # the report names the term
