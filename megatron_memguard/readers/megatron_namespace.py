"""An ``argparse.Namespace`` as Megatron's ``parse_args`` / ``validate_args`` leave it."""
from __future__ import annotations

from typing import Any

from ..config import RawConfig

# Derived by validate_args from other arguments; resolve() re-derives them, so they are not inputs.
_DERIVED = {"data_parallel_size", "transformer_pipeline_model_parallel_size", "params_dtype", "encoder_num_layers",
            "consumed_train_samples", "consumed_valid_samples"}


def raw_from_namespace(ns: Any) -> RawConfig:
    args = {k: v for k, v in vars(ns).items() if v is not None and k not in _DERIVED and not k.startswith("_")}
    for k in ("main_grads_dtype", "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype"):
        if k in args and not isinstance(args[k], str):
            args[k] = str(args[k]).replace("torch.", "").replace("float32", "fp32").replace("bfloat16", "bf16") \
                .replace("float16", "fp16").replace("uint8", "fp8")
    if "attention_backend" in args and not isinstance(args["attention_backend"], str):
        args["attention_backend"] = getattr(args["attention_backend"], "name", str(args["attention_backend"]))
    world = getattr(ns, "world_size", None)
    return RawConfig(args=args, origin={}, source="Megatron argument namespace", world_size=world)
