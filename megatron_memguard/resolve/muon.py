"""Section: the emerging optimizers (``--optimizer muon``, ``adaptive_muon``, deprecated ``dist_muon``; core 0.18's
``lion`` and ``soap``), with the
rules of megatron-core's optimizer factory: 0.16.1 ``get_megatron_muon_optimizer`` (optimizer/muon.py: no fp16,
no ``--use-distributed-optimizer``, ``dist_muon`` for the layer-wise optimizer; 0.17.1 alike), 0.18.2 and 0.19.2
``_get_megatron_emerging_optimizer`` (optimizer/__init__.py: no fp16; ``muon`` with
``--use-distributed-optimizer`` is the layer-wise optimizer, which does not overlap the param gather with the
step and takes one distributed-optimizer instance)."""
from __future__ import annotations

from typing import Any, Mapping

from packaging.version import Version

from ..errors import NotModelledError
from .args import Args, Context

MUON_OPTIMIZERS = ("muon", "adaptive_muon", "dist_muon")
EMERGING_OPTIMIZERS = MUON_OPTIMIZERS + ("lion", "soap")
# The emerging-optimizer factory of 0.19.2 (optimizer/emerging_optimizers.py, the layer-wise optimizer over the DDP
# parameter layout of optimizer/param_layout.py, dist_muon deprecated into muon + --use-distributed-optimizer) is
# in the megatron-core 0.18.2 wheel already, with the same validate_args block and --optimizer choices. The 0.17.1
# wheel still has 0.16.1's muon / dist_muon (optimizer/muon.py, layer_wise_optimizer.py without a parameter
# layout), and adds --optimizer lion and --muon-scalar-optimizer lion to it, which memguard does not model there.
EMERGING_SINCE = Version("0.18")
NEW_IN_0_18 = ("adaptive_muon", "soap")
LION_SINCE = Version("0.17")


def muon(a: Args, kw: Mapping[str, Any], ctx: Context) -> dict[str, Any]:
    opt = kw["optimizer"]
    if opt not in EMERGING_OPTIMIZERS:
        return dict(muon_scalar_optimizer="adam")
    new = ctx.version >= EMERGING_SINCE
    for dest in ("use_megatron_fsdp", "use_torch_fsdp2", "use_custom_fsdp"):
        if a.bool_arg(dest, False):
            raise NotModelledError(a.key(dest), f"{opt} with fully sharded data parallelism")
    if opt in NEW_IN_0_18 and not new:
        a.fail("optimizer", f"{opt} needs megatron-core 0.18 (0.16 offers adam, sgd, muon, dist_muon; 0.17 also lion)")
    if opt == "lion" and not new:
        _old_lion(a, "optimizer", ctx)
    if a.bool_arg("moe_single_grouped_weight", False):
        # one grouped parameter per expert linear (TE's GroupedLinear single_grouped_weight, core 0.19): its
        # shape (not read) decides whether Muon (2-D) or the fallback (_is_nonlinear_or_embedding) updates it
        raise NotModelledError(a.key("moe_single_grouped_weight"), f"{opt} with the experts' weights as one grouped "
                               "parameter (the emerging optimizer or its fallback, by its shape)")
    if kw.get("fp16"):
        a.fail("optimizer", f"{opt} does not work with --fp16 (the emerging-optimizer factory refuses it)")
    # lion and soap hand the other parameters to Adam (emerging_optimizers.py _default_param_overrides_factory);
    # only the Muon family reads --muon-scalar-optimizer (_get_megatron_emerging_optimizer)
    scalar = str(a.get("muon_scalar_optimizer", "adam")).lower() if opt in MUON_OPTIMIZERS else "adam"
    if scalar not in ("adam", "lion"):
        a.fail("muon_scalar_optimizer", f"must be adam or lion, got {scalar!r}")
        scalar = "adam"
    elif scalar == "lion" and not new:
        _old_lion(a, "muon_scalar_optimizer", ctx)
    dist = kw["use_distributed_optimizer"]
    if not new and opt == "muon" and dist:
        a.fail("use_distributed_optimizer", "does not work with --optimizer muon in megatron-core 0.16 "
               "(\"muon with dist optimizer is not supported\")", "use --optimizer dist_muon")
    layer_wise = opt == "dist_muon" or (new and dist)
    if new and layer_wise:
        if a.bool_arg("overlap_param_gather_with_optimizer_step", False):
            a.fail("overlap_param_gather_with_optimizer_step", "does not work with the layer-wise distributed "
                   f"optimizer of {opt}")
        if dist and kw.get("num_distributed_optimizer_instances", 1) > 1:
            a.fail("num_distributed_optimizer_instances", f"must be 1 with {opt} and --use-distributed-optimizer "
                   "(the layer-wise + distributed optimizer split)")
        if new and dist and not a.bool_arg("use_layer_wise_param_layout", True):
            raise NotModelledError(a.key("use_layer_wise_param_layout"), f"{opt}'s legacy layer-wise sharding in core >= 0.18")
    if opt == "soap":
        a.notes.append(f"{a.key('optimizer')} soap: the step's temporaries (the fp32 gradient, its projections onto the "
                       "eigenbases, the eigendecomposition's workspace) are not counted")
    return dict(muon_scalar_optimizer=scalar, **_orthogonalize_settings(a, new))


def _old_lion(a: Args, dest: str, ctx: Context) -> None:
    """Lion before the emerging-optimizer factory: not in 0.16's choices; 0.17's own path is not modelled."""
    if ctx.version < LION_SINCE:
        a.fail(dest, "lion needs megatron-core 0.17")
    else:
        raise NotModelledError(a.key(dest), "lion in megatron-core 0.17 (its optimizer factory before 0.18's "
                               "emerging-optimizer one)")


def _orthogonalize_settings(a: Args, new: bool) -> dict[str, Any]:
    """How the step orthogonalises: only its temporaries depend on these (estimator/muon.py
    step_working_set). Defaults of megatron-core's OptimizerConfig (0.16.1 and 0.19.2); 0.16.1 names the
    Nesterov switch ``muon_use_nesterov``."""
    tp_mode = str(a.get("muon_tp_mode", "blockwise")).lower()
    if tp_mode not in ("blockwise", "duplicated", "distributed"):
        a.fail("muon_tp_mode", f"must be blockwise, duplicated or distributed, got {tp_mode!r}")
        tp_mode = "blockwise"
    prec = str(a.get("muon_fp32_matmul_prec", "medium")).lower()
    if prec not in ("medium", "high", "highest"):
        a.fail("muon_fp32_matmul_prec", f"must be medium, high or highest, got {prec!r}")
        prec = "medium"
    nesterov = a.bool_arg("muon_nesterov", False) or (not new and a.bool_arg("muon_use_nesterov", False))
    return dict(muon_split_qkv=a.bool_arg("muon_split_qkv", True), muon_tp_mode=tp_mode,
                muon_fp32_matmul_prec=prec, muon_nesterov=nesterov)
