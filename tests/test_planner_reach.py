"""The planner with this session's features (issue 17, 'where it must reach'): SOAP's preconditioners,
--freeze-all-layers and HSDP in the memory bound, and layouts the estimator refuses by name left out."""
import random
import shlex

from megatron_memguard.planner.bounds import memory_lower_bound, stage_factor_bytes
from megatron_memguard.planner.space import Constraints, enumerate_space

from conftest import LLAMA31_8B
from planner_util import make_planner


def _bound_below_estimate(P, cons, n=30):
    cands = enumerate_space(P.shape, P.cluster, P.gbs, cons)
    checked = 0
    for c in random.Random(3).sample(cands, min(n, len(cands))):
        try:
            est = P.estimate(P.layout(c))
        except Exception:          # a layout Megatron's rules reject (e.g. instances not dividing DP x CP)
            continue
        lb = memory_lower_bound(P.shape, c, P.timer.stage_params)
        assert lb <= est.peak_device_bytes, (c.name, lb, est.peak_device_bytes)
        checked += 1
    assert checked >= 5
    return checked


def test_soap_preconditioners_by_hand():
    """Llama-3.1-8B layer at TP 1: linear_qkv [4096 + 2 x 1024, 4096], linear_proj [4096, 4096],
    linear_fc1 [2 x 14336, 4096], linear_fc2 [4096, 14336]; SOAP keeps L [m, m], R [n, n], Q_L, Q_R in fp32
    (emerging_optimizers 0.3.0 soap/soap.py SOAP._init_group): 8 (m^2 + n^2) B per [m, n] weight."""
    P = make_planner(LLAMA31_8B + ["--optimizer", "soap"], 8, 4096, 32)
    shapes = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
    per_layer = sum(8 * (m * m + n * n) for m, n in shapes)
    assert P.shape.soap_factor_bytes(1) == per_layer
    # TP 2 splits linear_qkv and fc1 by rows, proj and fc2 by columns
    shapes2 = [(3072, 4096), (4096, 2048), (14336, 4096), (4096, 7168)]
    assert P.shape.soap_factor_bytes(2) == sum(8 * (m * m + n * n) for m, n in shapes2)


def test_soap_bound_counts_the_preconditioners_the_estimate_has():
    """Without the distributed optimizer every rank keeps its layers' factors: the bound's share equals the
    estimate's soap_preconditioners term; and the bound stays below the estimate everywhere."""
    P = make_planner(LLAMA31_8B + ["--optimizer", "soap"], 8, 4096, 32)
    c = next(c for c in enumerate_space(P.shape, P.cluster, 32, Constraints(dist_opt=(False,)))
             if c.pp == 2 and c.tp == 1)
    est = P.estimate(P.layout(c))
    term = next(t for t in est.stages[0].terms if t.name == "soap_preconditioners")
    assert stage_factor_bytes(P.shape, c, 0) == term.bytes == 16 * P.shape.soap_factor_bytes(1)
    # (before: SOAP counted as 8 B per parameter, under half the state of the 8B model)
    assert P.state_bound(c) >= 12 * P.timer.stage_params(c, 0) + term.bytes
    _bound_below_estimate(P, Constraints())


def test_frozen_layers_bound_stays_below_the_estimate():
    """--freeze-all-layers keeps weights only and no activations on the first stage: the bound counted the
    gradient buffer, optimizer state and warm-up activations and pruned layouts that fit."""
    P = make_planner(LLAMA31_8B + ["--freeze-all-layers"], 16, 4096, 64)
    _bound_below_estimate(P, Constraints())
    c = next(c for c in enumerate_space(P.shape, P.cluster, 64, Constraints(dist_opt=(False,))) if c.pp == 1)
    assert P.state_bound(c) == 2 * P.timer.stage_params(c, 0)          # bf16 weights, nothing else


def test_frozen_layers_plan_has_no_distributed_optimizer_twins():
    """validate_args turns the distributed optimizer off with frozen layers: each layout is listed once."""
    P = make_planner(LLAMA31_8B + ["--freeze-all-layers"], 16, 4096, 64)
    res = P.plan(top=6)
    names = [e.candidate.name for e in res.entries]
    assert len(set(names)) == len(names) == 6
    assert all(not e.layout.use_distributed_optimizer for e in res.entries)


def test_fsdp_refused_with_soap_or_frozen_layers_is_left_out_by_name():
    """Megatron-FSDP is not modelled with SOAP or frozen layers: the planner keeps the DDP layouts and says why
    (it stopped with a NotModelledError traceback before)."""
    for extra, key in ((["--optimizer", "soap"], "--use-megatron-fsdp"),
                       (["--freeze-all-layers"], "--freeze-all-layers")):
        P = make_planner(LLAMA31_8B + extra, 16, 4096, 64)
        res = P.plan(Constraints(fsdp=("optim",)), top=3)
        assert len(res.entries) == 3 and all(e.candidate.fsdp is None for e in res.entries)
        assert any(r.startswith(key) and "not modelled" in r for r in res.rejected)


def test_hsdp_is_planned():
    """--num-distributed-optimizer-instances 2 (HSDP under Megatron-FSDP, or two DDP optimizer instances): the
    one-GPU probe refused it before; each layout now resolves with it, the bound stays below the estimate."""
    for extra in (["--num-distributed-optimizer-instances", "2"],
                  ["--num-distributed-optimizer-instances", "2", "--outer-dp-sharding-strategy", "optim"]):
        P = make_planner(LLAMA31_8B + extra, 16, 4096, 64)
        assert P.shape.dist_opt_instances == 2
        res = P.plan(Constraints(fsdp=("optim_grads_params",)), top=4)
        assert res.entries and all(e.layout.num_distributed_optimizer_instances == 2 for e in res.entries)
        _bound_below_estimate(P, Constraints(fsdp=("optim_grads_params", "optim_grads")))


def test_kept_layouts_estimate_as_fitting_from_their_exported_flags():
    """The planner's property (tests/test_planner_search.py) with this session's features: paste the flags the
    planner prints onto the model and estimate again: the same layout, and it fits."""
    from megatron_memguard import estimate, layout_from_flags
    from megatron_memguard.planner.export import megatron_flags
    for extra, cons in ((["--optimizer", "soap", "--use-distributed-optimizer"], Constraints()),
                        (["--freeze-all-layers"], Constraints()),
                        (["--attention-output-gate", "--optimizer", "lion"], Constraints()),
                        (["--num-distributed-optimizer-instances", "2"], Constraints(fsdp=("optim_grads_params",)))):
        model = LLAMA31_8B + extra
        P = make_planner(model, 16, 4096, 64)
        res = P.plan(cons, top=4)
        assert res.entries, extra
        for e in res.entries:
            L = layout_from_flags(model + shlex.split(" ".join(megatron_flags(e.layout))), world_size=16)
            assert L == e.layout, (extra, e.candidate.name)
            est = estimate(L, gpu=P.cluster.gpu, threshold=0.8)
            assert est.verdict == "fits" and est.peak_device_bytes <= 0.8 * P.cluster.gpu_memory_bytes


def test_frozen_layers_have_no_gradient_reduction_or_optimizer_step_in_the_step_time():
    """Nothing requires grad: no DP gradient reduction and no optimizer step (they were charged as in training)."""
    P = make_planner(LLAMA31_8B + ["--freeze-all-layers"], 16, 4096, 64)
    T = make_planner(LLAMA31_8B, 16, 4096, 64)
    c = next(c for c in enumerate_space(P.shape, P.cluster, 64, Constraints(dist_opt=(False,))) if c.dp > 1)
    frozen, trained = P.timer.explain(c), T.timer.explain(c)
    f, t = dict(zip(frozen.names, frozen.values)), dict(zip(trained.names, trained.values))
    assert f["optimizer"] == 0 and f["dp_comm"] == 0 and t["optimizer"] > 0 and t["dp_comm"] > 0
    assert frozen.seconds < trained.seconds
