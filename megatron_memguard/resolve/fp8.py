"""Section: FP8 / FP4 (validate_args's FP8 / FP4 checks, TransformerConfig.__post_init__'s and the DDP
config's), into the precision part's FP8 fields. The byte formulas and the rules themselves live in
``megatron_memguard.estimator.fp8`` (pure); this section reads the flags, applies Megatron's defaults
and reports each broken rule naming the flag."""
from __future__ import annotations

from typing import Any, Mapping

from ..errors import NotModelledError
from .args import Args, Context


# Read and memory-neutral: the delayed recipe's numerics (margin, interval) and whether wgrad runs in FP8
# (TE 2.11's modules keep the same tensors either way; docs/assumptions.md); the transpose cache of
# Megatron-FSDP is its section's.
NEUTRAL = ("fp8_margin", "fp8_interval", "fp8_wgrad", "keep_fp8_transpose_cache")

# What a layout without FP8 / FP4 holds (Precision's defaults: every name given keeps Layout.from_flat fast).
_OFF: dict[str, Any] = dict(
    fp8=None, fp8_recipe="delayed", fp4=None, fp4_recipe="nvfp4", fp8_param_gather=False, fp4_param_gather=False,
    first_last_layers_bf16=False, num_layers_at_start_in_bf16=1, num_layers_at_end_in_bf16=1, fp8_amax_history_len=1,
    fp8_amax_compute_algo="most_recent", reuse_grad_buf_for_mxfp8_param_ag=False, disable_parameter_transpose_cache=False,
    activation_func_fp8_input_store=False)


def _word(v: Any) -> Any:
    """An enum member as Megatron's namespace or its printed arguments may hold it
    (``Fp8Recipe.tensorwise``) -> its value."""
    if v is None:
        return None
    v = getattr(v, "value", v)
    return v.split(".")[-1] if isinstance(v, str) and v.startswith(("Fp8Recipe.", "Fp4Recipe.")) else v


def fp8(a: Args, kw: Mapping[str, Any], ctx: Context) -> dict[str, Any]:
    from ..estimator.fp8 import not_modelled, rule_violations

    fmt = _word(a.get("fp8"))
    fmt = None if fmt in (False, "", "none", "None") else (str(fmt).lower() if fmt is not None else None)
    fp4 = _word(a.get("fp4"))
    fp4 = None if fp4 in (False, "", "none", "None") else (str(fp4).lower() if fp4 is not None else None)
    v = dict(
        fp8=fmt,
        fp8_recipe=str(_word(a.get("fp8_recipe", "delayed"))).lower(),
        fp4=fp4,
        fp4_recipe=str(_word(a.get("fp4_recipe", "nvfp4"))).lower(),
        # TransformerConfig's names (the config-container era, and core 0.16's fp4 dest) mean the same
        fp8_param_gather=a.bool_arg("fp8_param_gather", False) or a.bool_arg("fp8_param", False),
        fp4_param_gather=a.bool_arg("fp4_param_gather", False) or a.bool_arg("fp4_param", False),
        first_last_layers_bf16=a.bool_arg("first_last_layers_bf16", False),
        num_layers_at_start_in_bf16=a.int_arg("num_layers_at_start_in_bf16", 1, minimum=0),
        num_layers_at_end_in_bf16=a.int_arg("num_layers_at_end_in_bf16", 1, minimum=0),
        fp8_amax_history_len=a.int_arg("fp8_amax_history_len", 1),
        fp8_amax_compute_algo=str(a.get("fp8_amax_compute_algo", "most_recent")),
        reuse_grad_buf_for_mxfp8_param_ag=a.bool_arg("reuse_grad_buf_for_mxfp8_param_ag", False),
        disable_parameter_transpose_cache=a.bool_arg("disable_parameter_transpose_cache", False),
        activation_func_fp8_input_store=a.bool_arg("activation_func_fp8_input_store", False),
    )
    rules = dict(kw, **v, fp8_output_proj=a.bool_arg("fp8_output_proj", False),
               fp8_quantizer_factory=a.get("fp8_quantizer_factory"), fp4_quantizer_factory=a.get("fp4_quantizer_factory"),
               te_precision_config_file=a.get("te_precision_config_file"),
               fp8_dot_product_attention=a.bool_arg("fp8_dot_product_attention", False),
               use_megatron_fsdp=a.bool_arg("use_megatron_fsdp", False),
               use_torch_fsdp2=a.bool_arg("use_torch_fsdp2", False),
               optimizer_cpu_offload=a.bool_arg("optimizer_cpu_offload", False))
    for dest, rule in rule_violations(rules):
        a.fail(dest, rule)
    refused = not_modelled(rules)
    if refused:
        raise NotModelledError(a.key(refused[0]), refused[1])
    if not (fmt or fp4):
        # the FP8 details only act with --fp8-format / --fp4-format: the layout keeps the defaults
        return dict(_OFF)
    if str(a.get("transformer_impl", "transformer_engine")) == "local":
        a.notes.append(f"{a.key('fp8' if fmt else 'fp4')}: no effect with --transformer-impl local (only Transformer "
                       "Engine modules quantize): estimated in BF16")
    if rules.get("use_torch_fsdp2") and v["fp8_param_gather"]:
        # validate_args: FSDP2 with TE >= 2.0 turns --fp8-param-gather off (warning)
        a.notes.append(f"{a.key('fp8_param_gather')}: turned off by Megatron with torch FSDP2 (TE >= 2.0)")
        v["fp8_param_gather"] = False
    return v
