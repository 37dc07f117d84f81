"""An ``argparse.Namespace`` as Megatron's ``parse_args`` / ``validate_args`` leave it."""
from __future__ import annotations

from typing import Any

from ..config import RawConfig
from ._common import dtype_name

# Derived by validate_args from other arguments; resolve() re-derives them, so they are not inputs.
_DERIVED = {"data_parallel_size", "transformer_pipeline_model_parallel_size", "params_dtype", "encoder_num_layers",
            "consumed_train_samples", "consumed_valid_samples"}


def raw_from_namespace(ns: Any) -> RawConfig:
    args = {k: v for k, v in vars(ns).items() if v is not None and k not in _DERIVED and not k.startswith("_")}
    for k in ("main_grads_dtype", "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype"):
        if k in args and not isinstance(args[k], str):
            args[k] = dtype_name(str(args[k]), "--" + k.replace("_", "-"))  # validate_args turns them into torch dtypes
    for k in ("megatron_fsdp_main_params_dtype", "megatron_fsdp_main_grads_dtype", "megatron_fsdp_grad_comm_dtype"):
        # validate_args maps these to torch dtypes, and "auto" to None (dropped above): put "auto" back
        if hasattr(ns, k) and getattr(ns, k) is None:
            args[k] = "auto"
        elif k in args and not isinstance(args[k], str):
            args[k] = dtype_name(str(args[k]), "--" + k.replace("_", "-"))
    for k in ("moe_router_load_balancing_type", "moe_aux_loss_coeff"):
        # nargs='+' in 0.19: validate_args turns a one-element list into its value (the hook reads the
        # arguments before validation)
        if isinstance(args.get(k), list) and len(args[k]) == 1:
            args[k] = args[k][0]
    if "attention_backend" in args and not isinstance(args["attention_backend"], str):
        args["attention_backend"] = getattr(args["attention_backend"], "name", str(args["attention_backend"]))
    world = getattr(ns, "world_size", None)
    return RawConfig(args=args, origin={}, source="Megatron argument namespace", world_size=world)
