"""Sections: run-time options (determinism, dropout, the environment), and the options read only
once every rule above passed."""
from __future__ import annotations

from typing import Any, Mapping

from packaging.version import Version

from ..errors import ConfigError
from .args import Args, Context


def runtime(a: Args, kw: Mapping[str, Any], ctx: Context) -> dict[str, Any]:
    deterministic = a.bool_arg("deterministic_mode", False)
    cublas = a.raw.env.get("CUBLAS_WORKSPACE_CONFIG")
    if deterministic and cublas and cublas not in (":4096:8", ":16:8") and ctx.version >= Version("0.19"):
        # megatron/training/determinism.py (0.19): ACCEPTED_ENV_VAR_VALUES
        a.fail("deterministic_mode", f"needs CUBLAS_WORKSPACE_CONFIG :4096:8 or :16:8, got {cublas!r}")
    checkpoint_saving(a, ctx)
    from ..estimator.overheads import env_size_problems
    from ..estimator.te_release import te_env_problems
    env = {str(k): str(v) for k, v in a.raw.env.items()}
    for var, rule in env_size_problems(env) + te_env_problems(env):
        # (a variable of the job's environment: the error names it, as it names a flag)
        a.errors.append(ConfigError(var, rule))
    hidden_dropout = a.float_arg("hidden_dropout", 0.1)
    attention_dropout = a.float_arg("attention_dropout", 0.1)
    graphed_recompute(a, kw, attention_dropout, hidden_dropout)
    env = tuple(sorted((str(k), str(v)) for k, v in a.raw.env.items()))
    return dict(deterministic_mode=deterministic, hidden_dropout=hidden_dropout, attention_dropout=attention_dropout,
                env=env)


def checkpoint_saving(a: Args, ctx: Context) -> None:
    """A Megatron-LM command line with ``--save`` and no save interval never starts: validate_args asserts
    ``args.save_interval is not None`` (megatron/training/arguments.py, core 0.17.1 line 1129, 0.19.2 line 1322;
    0.16.1's wheel ships no megatron.training to check, so older releases are left alone). Bridge and NeMo
    configs carry their own checkpoint defaults and are not Megatron command lines."""
    if not (a.raw.megatron_command_line and a.given("save") and ctx.version >= Version("0.17")):
        return
    if a.given("save_interval"):
        a.int_arg("save_interval")    # (validate_args: > 0; int_arg records a value below 1)
    else:
        a.fail("save_interval", "is required with --save (validate_args asserts it)",
               "give --save-interval N, the iterations between checkpoints")


def graphed_recompute(a: Args, kw: Mapping[str, Any], attention_dropout: float, hidden_dropout: float) -> None:
    """A recomputed module inside a CUDA graph draws no new random numbers: TransformerConfig.__post_init__
    (transformer_config.py, 0.16.1 and 0.19.2) refuses dropout in a graphed, selectively recomputed
    module, and 'moe' recompute under TE's moe_router graph. The whole layer is graphed when no module
    is named (or with the full-iteration graph)."""
    impl, graphed = kw.get("cuda_graph_impl", "none"), set(kw.get("cuda_graph_modules") or ())
    if impl == "none" or kw.get("recompute_granularity") != "selective":
        return
    mods = set(kw.get("recompute_modules") or ())
    whole = impl == "full_iteration" or not graphed
    if impl == "transformer_engine" and "moe" in mods and "moe_router" in graphed:
        a.fail("recompute_modules", "'moe' recompute does not work with the moe_router CUDA graph of "
               "--cuda-graph-impl transformer_engine (TransformerConfig)")
    if attention_dropout and "core_attn" in mods and (whole or "attn" in graphed):
        a.fail("attention_dropout", f"{attention_dropout:g} does not work with core_attn recompute inside a CUDA graph "
               "(TransformerConfig)", "give --attention-dropout 0, or graph or recompute other modules")
    for module, graph in (("mlp", "mlp"), ("moe", "moe")):
        if hidden_dropout and module in mods and (whole or graph in graphed):
            a.fail("hidden_dropout", f"{hidden_dropout:g} does not work with {module} recompute inside a CUDA graph "
                   "(TransformerConfig)", "give --hidden-dropout 0, or graph or recompute other modules")
            break
    if a.get("moe_input_jitter_eps") is not None and "moe" in mods and (whole or "moe" in graphed):
        # the router's input jitter draws random numbers too (same check, 0.16.1 and 0.19.2)
        a.fail("moe_input_jitter_eps", "does not work with moe recompute inside a CUDA graph (TransformerConfig)",
               "drop --moe-input-jitter-eps, or graph or recompute other modules")


def late_options(a: Args, kw: Mapping[str, Any], ctx: Context) -> dict[str, Any]:
    """Options without a rule of their own, read after the checks: a bad value here is reported only
    when everything else is right (as it always was: keeps the error lists users see unchanged)."""
    return dict(
        qk_layernorm=a.bool_arg("qk_layernorm", False),
        rotary_percent=a.float_arg("rotary_percent", 1.0),
        untie_embeddings_and_output_weights=a.bool_arg("untie_embeddings_and_output_weights", False),
        autocast_dtype=a.dtype_arg("autocast_dtype", kw["params_dtype"]) if "autocast_dtype" in a.a else None,
        store_param_remainders=a.bool_arg("store_param_remainders", True),
        ddp_pad_buckets_for_high_nccl_busbw=a.bool_arg("ddp_pad_buckets_for_high_nccl_busbw", False),
        masked_softmax_fusion=a.bool_arg("masked_softmax_fusion", True),
        bias_dropout_fusion=a.bool_arg("bias_dropout_fusion", True),
        create_attention_mask_in_dataloader=a.bool_arg("create_attention_mask_in_dataloader", True),
        calculate_per_token_loss=a.bool_arg("calculate_per_token_loss", False),
        empty_unused_memory_level=a.int_arg("empty_unused_memory_level", 0, minimum=0),
        # ModelParallelConfig.__post_init__ refuses a negative limit only with the deferral on (megatron-core
        # 0.16.1 / 0.19.2 model_parallel_config.py); Bridge's CommOverlapConfig writes -1 with it off
        wgrad_deferral_limit=a.int_arg("wgrad_deferral_limit", 0,
                                       minimum=0 if kw.get("defer_embedding_wgrad_compute") else -1),
    )
