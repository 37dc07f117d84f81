"""An ``argparse.Namespace`` as Megatron's ``parse_args`` / ``validate_args`` leave it."""
from __future__ import annotations

from typing import Any

from ..config import RawConfig
from ..numbers import python_scalar
from ._common import dtype_name

# Derived by validate_args from other arguments; resolve() re-derives them, so they are not inputs.
_DERIVED = {"data_parallel_size", "transformer_pipeline_model_parallel_size", "params_dtype", "encoder_num_layers",
            "consumed_train_samples", "consumed_valid_samples"}


def raw_from_namespace(ns: Any) -> RawConfig:
    if getattr(ns, "yaml_cfg", None) and all(hasattr(getattr(ns, s, None), "__dict__") for s in ("model_parallel", "language_model")):
        return _from_yaml_namespace(ns)
    # NumPy scalars (a launcher that computed a size with NumPy) read as the numbers they hold
    args = {k: python_scalar(v) for k, v in vars(ns).items() if v is not None and k not in _DERIVED and not k.startswith("_")}
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
    world = python_scalar(getattr(ns, "world_size", None))
    return RawConfig(args=args, origin={}, source="Megatron argument namespace", world_size=world,
                     megatron_command_line=True)


def _from_yaml_namespace(ns: Any) -> RawConfig:
    """The namespace ``load_yaml`` returns for ``--yaml-cfg`` (sections as nested namespaces; after
    validate_yaml their fields are merged into the top level too): read as the file is."""
    from .megatron_yaml_cfg import SECTIONS, read_yaml_cfg

    sections = {s: {k: python_scalar(v) for k, v in vars(getattr(ns, s)).items()} for s in SECTIONS}
    merged = {k for sec in sections.values() for k in sec}
    doc: dict[str, Any] = {k: python_scalar(v) for k, v in vars(ns).items() if k not in SECTIONS and k not in merged}
    doc.update(sections)
    raw = read_yaml_cfg(doc, str(ns.yaml_cfg))
    return RawConfig(args=raw.args, origin=raw.origin, source=raw.source, warnings=raw.warnings,
                     problems=raw.problems, world_size=python_scalar(getattr(ns, "world_size", None)))
