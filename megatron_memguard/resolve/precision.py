"""Section: precision (validate_args: params dtype, gradient accumulation dtype, precision-aware
optimizer dtypes, the mixed-precision checks)."""
from __future__ import annotations

from typing import Any, Mapping

from .args import Args, Context


def precision(a: Args, kw: Mapping[str, Any], ctx: Context) -> dict[str, Any]:
    bf16, fp16 = a.bool_arg("bf16", False), a.bool_arg("fp16", False)
    if bf16 and fp16:
        a.fail("fp16", "cannot be combined with --bf16")
    params_dtype = "bf16" if bf16 else "fp16" if fp16 else "fp32"
    main_grads_dtype = a.dtype_arg("main_grads_dtype", "fp32")
    main_params_dtype = a.dtype_arg("main_params_dtype", "fp32")
    grad_reduce_in_bf16 = a.bool_arg("grad_reduce_in_bf16", False)
    accumulate_fp32 = a.bool_arg("accumulate_allreduce_grads_in_fp32", False)
    if bf16:
        if grad_reduce_in_bf16:
            accumulate_fp32 = False
        elif not accumulate_fp32 and main_grads_dtype == "fp32":
            accumulate_fp32 = True
    if params_dtype == "fp32":
        accumulate_fp32 = True  # the grad buffer takes the param dtype, fp32
    use_precision_aware = a.bool_arg("use_precision_aware_optimizer", False)
    exp_avg_dtype = a.dtype_arg("exp_avg_dtype", "fp32")
    exp_avg_sq_dtype = a.dtype_arg("exp_avg_sq_dtype", "fp32")
    if not use_precision_aware:
        for dest, val in (("main_grads_dtype", main_grads_dtype), ("main_params_dtype", main_params_dtype),
                          ("exp_avg_dtype", exp_avg_dtype), ("exp_avg_sq_dtype", exp_avg_sq_dtype)):
            if val != "fp32":
                a.fail(dest, "a non-fp32 dtype needs --use-precision-aware-optimizer")
    if use_precision_aware:
        if kw["optimizer"] != "adam":
            a.fail("use_precision_aware_optimizer", "works with Adam only")
        if main_grads_dtype == "bf16":
            accumulate_fp32 = False
    if fp16 and main_grads_dtype == "bf16":
        a.fail("main_grads_dtype", "bf16 main grads cannot be used with --fp16")
    # validate_args, "Mixed precision checks".
    fp16_lm_ce = a.bool_arg("fp16_lm_cross_entropy", False)
    if fp16_lm_ce and not fp16:
        a.fail("fp16_lm_cross_entropy", "needs --fp16")
    fp32_residual = a.bool_arg("fp32_residual_connection", False)
    if fp32_residual and not (fp16 or bf16):
        a.fail("fp32_residual_connection", "needs --fp16 or --bf16")
    return dict(bf16=bf16, fp16=fp16, params_dtype=params_dtype, main_grads_dtype=main_grads_dtype,
                main_params_dtype=main_params_dtype, grad_reduce_in_bf16=grad_reduce_in_bf16,
                accumulate_allreduce_grads_in_fp32=accumulate_fp32, use_precision_aware_optimizer=use_precision_aware,
                exp_avg_dtype=exp_avg_dtype, exp_avg_sq_dtype=exp_avg_sq_dtype, fp16_lm_cross_entropy=fp16_lm_ce,
                fp32_residual_connection=fp32_residual)
