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


def test_state_bound_memo_keeps_fsdp_apart_from_ddp():
    """The MoE pre-filter's state bound was memoised without the FSDP strategy: an optim_grads layout got its DDP
    sibling's model state and could be pruned. 8 GPUs, TP = PP = EP = 1 (DP = expert DP = 8), bf16 weights,
    fp32 main gradients, Adam: DDP with the distributed optimizer keeps 2 + 4 + 12 / 8 = 7.5 B per parameter;
    optim_grads keeps the weights whole and the bf16 gradients (core 0.19) and the optimizer state sharded,
    2 + (2 + 12) / 8 = 3.75 B (bounds.stage_state_bytes), over all the model's parameters on one rank."""
    from megatron_memguard.estimator.params import total_parameters
    moe = ("--num-layers 12 --hidden-size 1024 --num-attention-heads 8 --group-query-attention --num-query-groups 2 "
           "--max-position-embeddings 4096 --bf16 --normalization RMSNorm --swiglu --disable-bias-linear "
           "--ffn-hidden-size 2816 --position-embedding-type rope --untie-embeddings-and-output-weights "
           "--num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 512").split()
    P = make_planner(moe, 8, 4096, 32)
    ddp = make_candidate(P.shape, P.cluster, 32, ep=1, etp=1)
    fsdp = make_candidate(P.shape, P.cluster, 32, ep=1, etp=1, fsdp="optim_grads")
    n = total_parameters(P.layout(ddp))
    assert P.state_bound(ddp) == 7.5 * n     # filled first, as enumerate_space orders them
    assert P.state_bound(fsdp) == 3.75 * n
