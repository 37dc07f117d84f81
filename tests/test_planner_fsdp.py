"""The planner's Megatron-FSDP dimension (--fsdp): candidates, Megatron's rules, the memory bound and
the exported flags. Memory of each candidate comes from the estimator (docs/terms/fsdp.md)."""
import random

from megatron_memguard.cli.main import main
from megatron_memguard.planner.bounds import memory_lower_bound
from megatron_memguard.planner.space import Constraints, enumerate_space, make_candidate

from conftest import LLAMA31_8B
from planner_util import make_planner

ALL = ("optim_grads_params", "optim_grads", "optim", "no_shard")


def test_fsdp_is_searched_only_when_asked():
    P = make_planner(LLAMA31_8B, 16, 4096, 64)
    plain = enumerate_space(P.shape, P.cluster, 64, Constraints())
    assert not any(c.fsdp for c in plain)
    both = enumerate_space(P.shape, P.cluster, 64, Constraints(fsdp=("optim_grads_params",)))
    fs = [c for c in both if c.fsdp]
    # one FSDP candidate per (layout, recompute), with the distributed optimizer (validate_args)
    assert len(fs) == len({(c.tp, c.pp, c.cp, c.vpp, c.first, c.last, c.sp, c.mbs, c.recompute) for c in plain})
    assert all(c.dist_opt and c.fsdp == "optim_grads_params" for c in fs)


def test_fsdp_bound_stays_below_the_estimate():
    P = make_planner(LLAMA31_8B, 16, 4096, 64)
    cands = [c for c in enumerate_space(P.shape, P.cluster, 64, Constraints(fsdp=ALL)) if c.fsdp]
    for c in random.Random(1).sample(cands, 60):
        L = P.layout(c)
        assert L.use_megatron_fsdp and L.data_parallel_sharding_strategy == c.fsdp
        est = P.estimate(L)
        assert memory_lower_bound(P.shape, c, P.timer.stage_params) <= est.peak_device_bytes, c.name


def test_sharding_lowers_the_model_state():
    # the same layout: optim_grads_params holds less than the distributed optimizer over DDP buffers
    P = make_planner(LLAMA31_8B, 16, 4096, 64)
    ddp = make_candidate(P.shape, P.cluster, 64, tp=1, mbs=1)
    ogp = make_candidate(P.shape, P.cluster, 64, tp=1, mbs=1, fsdp="optim_grads_params")
    a, b = (P.estimate(P.layout(c)).stages[0].persistent_bytes for c in (ddp, ogp))
    assert b < a
    assert ogp.name.endswith(",fsdp=optim_grads_params") and "FSDP-ogp" in ogp.label


def test_plan_cli_exports_the_fsdp_flags(capsys, monkeypatch):
    # the 3.12 run sets CUDA_DEVICE_MAX_CONNECTIONS=1 for megatron.training; FSDP needs it unset or > 1
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    flags = LLAMA31_8B[:]
    assert main(["plan", "--gpus", "16", "--seq-length", "4096", "--global-batch-size", "64", "--top", "3",
                 "--fsdp", "optim_grads_params", "--tp", "1", "--pp", "1", "--cp", "1", "--", *flags]) == 0
    out = capsys.readouterr().out
    assert "--use-megatron-fsdp" in out and "--data-parallel-sharding-strategy optim_grads_params" in out
    assert "--ckpt-format fsdp_dtensor" in out and "ddp.use_megatron_fsdp=true" in out


def test_bad_fsdp_option_is_one_line(capsys):
    assert main(["plan", "--gpus", "16", "--fsdp", "zero3", "--", *LLAMA31_8B]) == 2
    err = capsys.readouterr().err
    assert "--fsdp" in err and "optim_grads_params" in err and len(err.strip().splitlines()) == 1
