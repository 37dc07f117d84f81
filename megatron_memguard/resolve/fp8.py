"""Section: FP8 / FP4 (validate_args's FP8 / FP4 checks, TransformerConfig.__post_init__'s and the DDP
config's), into the precision part's FP8 fields. This section reads the flags, applies Megatron's
defaults and reports each broken rule naming the flag (``rule_violations``, pure, on flat names); the
bytes are ``megatron_memguard.estimator.fp8``'s."""
from __future__ import annotations

import re
from typing import Any, Mapping

from packaging.version import Version

from ..errors import NO_TE_BACKEND, NotModelledError
from ..numbers import shown
from ..estimator.te_release import (AG_FP8_SINCE, DPA_RECIPE_VAR, ONE_SOFTMAX_STAT_SINCE, TE_VERSION_VAR,
                                    attention_recipe, dpa_recipe_problem, te_at_least, te_version_text)
from .args import Args, Context
from .shape import CP_COMM_TYPES

# argparse choices of core 0.19.2 (--fp8-recipe custom needs a quantizer factory: refused below)
FP8_FORMATS = ("e4m3", "hybrid")
FP8_RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8", "custom")
FP4_FORMATS = ("e2m1",)
FP4_RECIPES = ("nvfp4", "custom")


# Read and memory-neutral: the delayed recipe's numerics (margin, interval) and whether wgrad runs in FP8
# (TE 2.11's modules keep the same tensors either way; docs/assumptions.md); the transpose cache of
# Megatron-FSDP is its section's.
NEUTRAL = ("fp8_margin", "fp8_interval", "fp8_wgrad", "keep_fp8_transpose_cache")

# What a layout without FP8 / FP4 holds (Precision's defaults: every name given keeps Layout.from_flat fast).
_OFF: dict[str, Any] = dict(
    fp8=None, fp8_recipe="delayed", fp4=None, fp4_recipe="nvfp4", fp8_param_gather=False, fp4_param_gather=False,
    first_last_layers_bf16=False, num_layers_at_start_in_bf16=1, num_layers_at_end_in_bf16=1, fp8_amax_history_len=1,
    fp8_amax_compute_algo="most_recent", reuse_grad_buf_for_mxfp8_param_ag=False, disable_parameter_transpose_cache=False,
    activation_func_fp8_input_store=False, fp8_output_proj=False, fp8_dot_product_attention=False)


# --te-precision-config-file (core 0.19.2 core/quantization/quant_config.py, extensions/transformer_engine.py
# TEQuantizationParams): glob matchers over module paths pick a recipe per TE module; memguard sizes one recipe
PER_MODULE_RECIPES = ("per-module Transformer Engine precision recipes (--te-precision-config-file matches recipes "
                      "to modules by glob; memguard sizes one recipe for every GEMM: for an estimate give the recipe "
                      "most GEMMs use as --fp8-recipe / --fp4-recipe, or --first-last-layers-bf16 if the file keeps "
                      "the end layers in BF16)")


def _word(v: Any) -> Any:
    """An enum member as Megatron's namespace or its printed arguments may hold it
    (``Fp8Recipe.tensorwise``) -> its value."""
    if v is None:
        return None
    v = getattr(v, "value", v)
    return v.split(".")[-1] if isinstance(v, str) and v.startswith(("Fp8Recipe.", "Fp4Recipe.")) else v


def fp8(a: Args, kw: Mapping[str, Any], ctx: Context) -> dict[str, Any]:
    v = _fp8(a, kw, ctx)
    if kw.get("cp_kv_all_gather") and not (v.get("fp8_dot_product_attention")
                                           and te_at_least(a.raw.env, str(ctx.version), AG_FP8_SINCE)):
        # shape.py marks the all-gather CP path where FP8 attention is asked for; where it is not kept (no FP8, TE
        # before 2.15, NVTE_DPA_FP8_RECIPE=F16) the layout says so too (with one type per layer FP8 attention stays
        # for the other layers: the first layer's all_gather runs BF16 before TE 2.15)
        v = {**v, "cp_kv_all_gather": False}
    words = kw.get("cp_comm_layers")
    if words and "all_gather" in words and not v.get("fp8_dot_product_attention"):
        # per-layer types: BF16 attention sizes the all_gather layers as the ring (the p2p layers' kind)
        words = ",".join("p2p" if w == "all_gather" else w for w in words.split(","))
        v = {**v, "cp_comm_layers": words if len(set(words.split(","))) > 1 else None}
    return v


def _fp8(a: Args, kw: Mapping[str, Any], ctx: Context) -> dict[str, Any]:
    # formats and recipes are compared as written: megatron-core tests them with == (fp8_utils.get_fp8_recipe: 'E4M3
    # and HYBRID are the only supported FP8 formats' for 'HYBRID'; fp4_utils.get_fp4_recipe), so 'HYBRID' or
    # 'Delayed' fail at start-up and are refused here (rule_violations), not read as the lower-case value
    fmt = _word(a.get("fp8"))
    fmt = None if fmt in (False, "", "none", "None") else (str(fmt) if fmt is not None else None)
    fp4 = _word(a.get("fp4"))
    fp4 = None if fp4 in (False, "", "none", "None") else (str(fp4) if fp4 is not None else None)
    v = dict(
        fp8=fmt,
        fp8_recipe=str(_word(a.get("fp8_recipe", "delayed"))),
        fp4=fp4,
        fp4_recipe=str(_word(a.get("fp4_recipe", "nvfp4"))),
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
        fp8_output_proj=a.bool_arg("fp8_output_proj", False),
    )
    rules = dict(kw, **v, defer_embedding_wgrad_compute=a.bool_arg("defer_embedding_wgrad_compute", False),
               untie_embeddings_and_output_weights=a.bool_arg("untie_embeddings_and_output_weights", False),
               fp8_quantizer_factory=a.get("fp8_quantizer_factory"), fp4_quantizer_factory=a.get("fp4_quantizer_factory"),
               te_precision_config_file=a.get("te_precision_config_file"),
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
        _dot_product_attention(a, kw, ctx, v)   # (its note)
        return dict(_OFF)
    if str(a.get("transformer_impl", "transformer_engine")) == "local":
        a.notes.append(f"{a.key('fp8' if fmt else 'fp4')}: no effect with --transformer-impl local (only Transformer "
                       "Engine modules quantize): estimated in BF16")
    if rules.get("use_torch_fsdp2") and v["fp8_param_gather"]:
        # validate_args: FSDP2 with TE >= 2.0 turns --fp8-param-gather off (warning)
        a.notes.append(f"{a.key('fp8_param_gather')}: turned off by Megatron with torch FSDP2 (TE >= 2.0)")
        v["fp8_param_gather"] = False
    v["fp8_dot_product_attention"] = _dot_product_attention(a, kw, ctx, v)
    return v


# Where FP8 attention is sized (estimator/layers/fp8_attention.py): TE 2.11's FusedAttention (cuDNN) with the
# per-tensor recipes, TE 2.20.2's with mxfp8 (megatron-core >= 0.17; under CP the p2p ring only); everything else it
# touches is refused by name below
_DPA_RECIPES = ("delayed", "tensorwise", "mxfp8")


def _dot_product_attention(a: Args, kw: Mapping[str, Any], ctx: Context, v: dict[str, Any]) -> bool:
    """fp8_dot_product_attention / fp8_multi_head_attention (TransformerConfig only, no Megatron flag): whether
    the FP8 layers' core attention runs TE's FP8 FusedAttention. Which recipe carries ``fp8_dpa`` is megatron-core's
    (fp8_utils.get_fp8_recipe, fp4_utils.get_fp4_recipe, TEDelayedScaling); what TE accepts is TE 2.11's
    (DotProductAttention.init_fp8_metadata, dot_product_attention/utils.py get_attention_backend)."""
    dpa = a.bool_arg("fp8_dot_product_attention", False)
    mha = a.bool_arg("fp8_multi_head_attention", False)
    if not (dpa or mha):
        return False
    dest = "fp8_dot_product_attention" if dpa else "fp8_multi_head_attention"
    key = a.key(dest)
    new = ctx.version >= Version("0.17")
    if not (v["fp8"] or v["fp4"]):
        # the flags only reach TE through the FP8 / FP4 recipe object (get_fp8_recipe / get_fp4_recipe)
        a.notes.append(f"{key}: no effect without --fp8-format (the flag only travels in the FP8 recipe)")
        return False
    recipe = v["fp4_recipe"] if v["fp4"] else v["fp8_recipe"]
    if mha and recipe != "delayed":
        # only TEDelayedScaling passes fp8_mha on (fp8_utils.py, transformer_engine.py; 0.16.1 and 0.19.2)
        a.notes.append(f"{a.key('fp8_multi_head_attention')}: no effect with the {recipe} recipe (megatron-core passes "
                       "fp8_mha to the delayed recipe only)")
        mha = False
        if not dpa:
            return False
    # recipes whose object megatron-core builds without fp8_dpa
    if recipe == "blockwise" or (recipe in ("mxfp8", "nvfp4") and not new):
        a.notes.append(f"{key}: no effect with the {recipe} recipe (megatron-core {ctx.version} builds that recipe without "
                       "fp8_dpa): attention is estimated in BF16")
        return False
    recipe = _switched_recipe(a, key, recipe, ctx)
    if recipe is None:
        return False
    te = te_version_text(a.raw.env, str(ctx.version))
    if recipe == "nvfp4":
        # TE 2.20.2 get_attention_backend (utils.py 792-794): "Disabling FusedAttention for NVFP4BlockScaling"; with
        # fp8_dpa FlashAttention and the unfused backend are off too (718-744): no backend
        a.fail(dest, "is not supported with the nvfp4 recipe (Transformer Engine 2.20.2 has no attention backend for "
                     "FP8 attention under NVFP4BlockScaling)",
               f"set {DPA_RECIPE_VAR} to DelayedScaling, Float8CurrentScaling or MXFP8BlockScaling to run the "
               "attention in that recipe, or F16")
        return False
    if recipe == "mxfp8" and not te_at_least(a.raw.env, str(ctx.version), ONE_SOFTMAX_STAT_SINCE):
        # MXFP8 attention (combine_and_quantize's MXFP8 path, the MXFP8 fused kernel) first ships in TE 2.15.0
        a.fail(dest, f"needs Transformer Engine 2.15 or later under the mxfp8 recipe (Transformer Engine {te} has no "
                     "MXFP8 attention)", f"set {DPA_RECIPE_VAR}=Float8CurrentScaling or DelayedScaling, or "
                     f"{TE_VERSION_VAR} to the release the run has")
        return False
    if mha:
        # fp8_mha reaches TE only in the delayed recipe object. TE 2.11 DotProductAttention.forward forces fp8_dpa
        # on with it; the FP8 output (FusedAttnFunc is_output_fp8) and linear_qkv's FP8 output are asked for only
        # by TE's own MultiheadAttention (multi_head_attention.py qkv_fp8_output / dpa_fp8_output), never by
        # megatron-core's SelfAttention / TEDotProductAttention (no fp8_output argument in 0.16.1 or 0.19.2): the
        # attention runs, and keeps, what fp8_dot_product_attention gives
        a.notes.append(f"{a.key('fp8_multi_head_attention')}: estimated as fp8_dot_product_attention (Transformer "
                       "Engine turns fp8_dpa on with it; megatron-core never asks for the FP8 attention output or "
                       "an FP8 linear_qkv output, which only TE's own MultiheadAttention does)")
    if str(a.get("transformer_impl", "transformer_engine")) == "local" or str(
            a.get("attention_backend", "auto")).replace("AttnBackend.", "") == "local":
        a.notes.append(f"{key}: no effect with megatron-core's own core attention (--transformer-impl local / "
                       "--attention-backend local): estimated in BF16")
        return False
    backend = str(a.get("attention_backend", "auto")).replace("AttnBackend.", "")
    if backend in ("flash", "unfused"):
        # get_attention_backend (TE 2.11): FP8 training disables FlashAttention 2 and 3 and the unfused
        # backend (without NVTE_UnfusedDPA_Emulate_FP8); Megatron's flash / unfused settings switch fused off
        a.fail(dest, f"needs --attention-backend fused or auto (Transformer Engine runs FP8 attention only in its "
                    f"fused cuDNN backend, not {backend})", fails_later=NO_TE_BACKEND)
        return False
    # get_attention_backend (TE 2.11): FP8 attention turns FusedAttention off for a non-vanilla softmax and for a
    # sliding window (left != -1 or right not in (-1, 0)); FlashAttention and the unfused backend do not run FP8
    softmax = str(a.get("softmax_type") or "vanilla")
    window = [int(w) for w in re.findall(r"-?\d+", str(a.get("window_size") or ""))]
    sliding = len(window) == 2 and (window[0] != -1 or window[1] not in (-1, 0))
    if recipe == "mxfp8" and (softmax != "vanilla" or sliding):
        # TE 2.20.2 get_attention_backend (utils.py 1222-1232, 1440-1450) keeps FusedAttention for FP8 with a
        # non-vanilla softmax or a sliding window on SM >= 10.0 with cuDNN >= 9.21, where MXFP8 attention runs anyway
        what = " and ".join(w for w, on in ((f"--softmax-type {softmax}", softmax != "vanilla"),
                                            ("a sliding --window-size", sliding)) if on)
        a.notes.append(f"{key}: MXFP8 attention with {what} is estimated as Transformer Engine 2.20.2's FP8 "
                       "FusedAttention (allowed on Blackwell with cuDNN 9.21 or later); if cuDNN has no MXFP8 kernel "
                       "for it Transformer Engine stops with 'no dot product attention backend'")
    elif softmax != "vanilla":
        a.fail(dest, f"cannot be used with --softmax-type {softmax} (Transformer Engine 2.11 has no FP8 attention "
                     "backend for a non-vanilla softmax)")
        return False
    elif sliding:
        a.fail(dest, f"cannot be used with --window-size {window[0]},{window[1]} (Transformer Engine 2.11 has no FP8 "
                     "attention backend for sliding-window attention)")
        return False
    mla = a.bool_arg("multi_latent_attention", False)
    if recipe == "mxfp8" and not _mxfp8_attention(a, dest, kw, mla):
        return False
    if kw.get("context_parallel_size", 1) > 1:
        if not _ring_attention(a, dest, kw, mla, ctx):
            return False
    if mla:
        # get_attention_backend (TE 2.11, Python) lets FP8 MLA through to FusedAttention with separate q, k, v
        # (qkv layout sbhd_sbhd_sbhd); whether cuDNN has an FP8 kernel for these head dims is decided in TE's C++
        # (nvte_get_fused_attn_backend, not in the Python wheel)
        a.notes.append(f"{key}: FP8 multi-latent attention is estimated as Transformer Engine's FP8 FusedAttention "
                       "with separate q, k, v; if cuDNN has no FP8 kernel for these head dims Transformer Engine stops "
                       "with 'no dot product attention backend'")
    if recipe == "tensorwise":
        a.notes.append(f"{key}: FP8 attention with the tensorwise recipe runs only on Blackwell (sm100) with cuDNN "
                       "9.14 or later (Transformer Engine 2.11); it keeps the attention output in BF16 "
                       "(NVTE_DPA_FP8CS_O_in_F16, default 1)")
    return True


_RECIPE_NAMES = {"delayed": "DelayedScaling", "tensorwise": "Float8CurrentScaling", "mxfp8": "MXFP8BlockScaling",
                 "nvfp4": "NVFP4BlockScaling"}


def _switched_recipe(a: Args, key: str, recipe: str, ctx: Context) -> str | None:
    """The recipe the core attention runs in under ``NVTE_DPA_FP8_RECIPE`` (estimator/te_release.py
    ``attention_recipe``: TE 2.11 / 2.20.2 ``DotProductAttention.init_fp8_metadata``), None for BF16 attention
    (``F16``), with a note when the variable acts or does nothing. A bad value is runtime's error (resolve/runtime.py)
    and acts as unset here."""
    env = a.raw.env
    value = str(env.get(DPA_RECIPE_VAR, ""))
    if not value or dpa_recipe_problem(value):
        return recipe
    switched = attention_recipe(recipe, env, str(ctx.version))
    if switched is None:
        a.notes.append(f"{key}: {DPA_RECIPE_VAR}=F16 turns FP8 attention off (Transformer Engine clears fp8_dpa): "
                       "attention is estimated in BF16")
    elif switched != recipe:
        a.notes.append(f"{key}: {DPA_RECIPE_VAR}={value}: the core attention runs in {_RECIPE_NAMES[switched]} "
                       f"next to the {recipe} linear layers (estimated as FP8 attention under {switched})")
    elif value != _RECIPE_NAMES.get(recipe):
        te = te_version_text(env, str(ctx.version))
        a.notes.append(f"{key}: {DPA_RECIPE_VAR}={value} does not switch the {recipe} recipe under Transformer Engine "
                       f"{te} (no such branch in DotProductAttention.init_fp8_metadata): attention stays {recipe}")
    return switched


def _mxfp8_attention(a: Args, dest: str, kw: Mapping[str, Any], mla: bool) -> bool:
    """FP8 attention under the mxfp8 recipe (megatron-core >= 0.17, paired with TE 2.20.2): whether it is sized
    (estimator/layers/fp8_attention.py ``mxfp8_attention``). TE 2.20.2 keeps the MXFP8 recipe for the attention
    (dot_product_attention.py ``init_fp8_metadata``, ``NVTE_DPA_FP8_RECIPE`` unset) and runs it in cuDNN only on
    SM 10.x with cuDNN >= 9.21 (not 9.23.0 / 9.23.1), not for THD (``get_attention_backend``, utils.py 774-791)."""
    key = a.key(dest)
    cp = kw.get("context_parallel_size", 1)
    if isinstance(cp, int) and cp > 1:
        # context_parallel.py (TE 2.20.2) has its own MXFP8 path in each CP type (attn_forward_func_with_cp refuses
        # none of them; estimator/layers/fp8_attention.py): the p2p ring (cp_p2p_fwd_fused_attn) and the all-gather
        # path (AttnFuncWithCPAndKVAllGather) quantize each step's q / K/V part, the all-to-all
        # (AttnFuncWithCPAndQKVOA2A) the exchanged whole sequence, a two-level a2a+p2p its ring's parts of s/P tokens.
        # combine_and_quantize asserts s_q % 128 == 0 and s_kv % 128 == 0; under the causal mask a ring (or
        # all-gather) step takes half of a rank's s/ranks tokens
        ranks, what = _mxfp8_step_ranks(a, cp)
        seq = kw.get("seq_length")
        if ranks > 1 and isinstance(seq, int) and seq % (256 * ranks):
            a.fail(dest, f"needs --seq-length divisible by 256 x {what} ({256 * ranks}) under the mxfp8 recipe with "
                         "context parallelism (Transformer Engine 2.20.2 quantizes each ring or all-gather step's "
                         f"half of a rank's tokens in blocks of 128), got {seq}")
            return False
    # combine_and_quantize (utils.py): "MXFP8 quantization requires s_q % 128 == 0, s_kv % 128 == 0, d_qk % 32 == 0,
    # d_v % 32 == 0" (an assertion at the first step)
    seq = kw.get("seq_length")
    if isinstance(seq, int) and seq % 128:
        a.fail(dest, f"needs --seq-length divisible by 128 under the mxfp8 recipe (Transformer Engine 2.20.2 quantizes "
                     f"q, k, v in blocks of 128 tokens), got {seq}")
        return False
    if mla:
        qk = a.int_arg("qk_head_dim", 128) + a.int_arg("qk_pos_emb_head_dim", 64)
        dims = {"qk_head_dim + qk_pos_emb_head_dim": qk, "v_head_dim": a.int_arg("v_head_dim", 128)}
    else:
        dims = {"kv_channels": kw.get("kv_channels")}
    for name, dim in dims.items():
        if isinstance(dim, int) and dim % 32:
            a.fail(dest, f"needs a head dim divisible by 32 under the mxfp8 recipe (Transformer Engine 2.20.2 "
                         f"quantizes q, k, v in blocks of 32 along it), got {name} {dim}")
            return False
    a.notes.append(f"{key}: MXFP8 attention (Transformer Engine 2.20.2) runs only on Blackwell (SM 10.x) with cuDNN "
                   "9.21 or later (not 9.23.0 / 9.23.1) and not with packed (THD) sequences; it keeps q, k, v in MXFP8 "
                   "(rowwise and columnwise) and the attention output in BF16")
    return True


def _mxfp8_step_ranks(a: Args, cp: int) -> tuple[int, str]:
    """Over how many ranks an MXFP8 attention step splits a sequence's tokens (with the flag that sets them): CP for
    the p2p ring and the all-gather path, the ring's level of a two-level a2a+p2p, none (1) for the all-to-all over
    every rank; the largest over per-layer types. A malformed value gives 1 (resolve/shape.py reports it)."""
    raw = a.get("cp_comm_type") or ["p2p"]
    comm = set(raw) if isinstance(raw, (list, tuple)) else {raw}
    best = (1, "")
    for c in comm:
        if c in ("p2p", "all_gather"):
            best = max(best, (cp, "--context-parallel-size"))
        elif c == "a2a+p2p":
            sizes = a.get("hierarchical_context_parallel_sizes")
            try:
                sizes = [int(x) for x in (sizes if isinstance(sizes, (list, tuple)) else str(sizes or "").split())]
            except ValueError:
                continue
            if len(sizes) == 2 and sizes[0] < cp:      # an a2a level over every rank is the all-to-all (no ring)
                best = max(best, (sizes[1], "the ring's size in --hierarchical-context-parallel-sizes"))
    return best


def _ring_attention(a: Args, dest: str, kw: Mapping[str, Any], mla: bool, ctx: Context) -> bool:
    """FP8 attention with context parallelism: whether Transformer Engine runs it in FP8 (False: BF16). Its
    all-to-all ranks are the BF16 attention's (``cp_a2a_size``, resolve/shape.py ``cp_attention``, with TE's heads
    rule); sized by estimator/layers/fp8_attention.py. TE 2.11 ``context_parallel.py`` ``attn_forward_func_with_cp``
    hands ``fp8`` to the p2p and a2a paths only (from TE 2.15.0 to the all_gather path too: ``AG_FP8_SINCE``);
    ``utils.py`` ``get_attention_backend`` has no backend for FP8 MLA under CP."""
    key = a.key(dest)
    raw = a.get("cp_comm_type") or ["p2p"]
    items = list(raw) if isinstance(raw, (list, tuple)) else [raw]
    if len(items) not in (1, kw.get("num_layers")) or any(not isinstance(c, str) or c not in CP_COMM_TYPES for c in items):
        # a word Transformer Engine does not take ('P2P', 'allgather', 1) or a list of the wrong length: the error
        # resolve/shape.py's _check_cp_comm reports, not a refusal of per-layer types
        return False
    comm = set(items)
    if mla:
        # FusedAttention: "does not support context parallelism with FP8 MLA attention"; FlashAttention: no FP8
        # with CP; UnfusedDotProductAttention: no CP: TE finds no backend
        a.fail(dest, "cannot be used with multi-latent attention under context parallelism (Transformer Engine 2.11 "
                    "has no attention backend for FP8 MLA with CP)")
        return False
    if "all_gather" in comm:
        te = te_version_text(a.raw.env, str(ctx.version))
        if not te_at_least(a.raw.env, str(ctx.version), AG_FP8_SINCE):
            # TE 2.11 to 2.14.1: AttnFuncWithCPAndKVAllGather takes no fp8 argument, its kernels run in BF16; with one
            # type per layer the other layers keep FP8 attention (estimator/layers kind_layout: the all_gather
            # layers' kind turns it off)
            if comm == {"all_gather"}:
                a.notes.append(f"{key}: no effect with --cp-comm-type all_gather under Transformer Engine {te} (its "
                               "all-gather context parallelism runs BF16 attention before 2.15): attention is "
                               "estimated in BF16")
                return False
            a.notes.append(f"{key}: the --cp-comm-type all_gather layers run BF16 attention under Transformer Engine "
                           f"{te} (its all-gather context parallelism takes no FP8 before 2.15); the others FP8")
        else:
            # TE 2.15.0 on (to 2.20.2): attn_forward_func_with_cp hands fp8 to AttnFuncWithCPAndKVAllGather, which
            # gathers the FP8 K/V (estimator/layers/fp8_attention.py fp8_all_gather_attention)
            a.notes.append(f"{key}: with --cp-comm-type all_gather Transformer Engine {te} runs FP8 attention on the "
                           "K/V gathered in FP8 (from 2.15; before it, BF16; MXFP8 gathers them in BF16 and quantizes "
                           "each step's slice)")
    # a2a+p2p over two levels: TE 2.11's (core 0.16) and TE 2.20.2's (core >= 0.17) AttnFuncWithCPAndKVP2P with
    # cp_size_a2a > 1 are both sized (estimator/layers/fp8_attention.py fp8_ring_attention); one type per layer: each
    # layer's kind carries its own (resolve/shape.py cp_attention)
    return True


def rule_violations(a: Mapping[str, Any]) -> list[tuple[str, str]]:
    """Megatron's start-up rules for the FP8 / FP4 settings in ``a`` (flat argument names, after
    defaults), as (argument name, one-line rule). Sources: ``megatron/training/arguments.py``
    ``validate_args`` (core 0.16.1 and 0.19.2), ``TransformerConfig.__post_init__``,
    ``DistributedDataParallelConfig.__post_init__``. Recipes memguard cannot size are not listed here
    (``not_modelled``)."""
    out: list[tuple[str, str]] = []
    fp8, fp4 = a.get("fp8"), a.get("fp4")
    if fp8 is not None and fp8 not in FP8_FORMATS:
        out.append(("fp8", f"must be one of {', '.join(FP8_FORMATS)} (as written), got {shown(fp8)}"))
    if fp8 and a.get("fp8_recipe", "delayed") not in FP8_RECIPES:
        out.append(("fp8_recipe", f"must be one of {', '.join(FP8_RECIPES)} (as written), got {shown(a.get('fp8_recipe'))}"))
    if fp4 is not None and fp4 not in FP4_FORMATS:
        out.append(("fp4", f"must be one of {', '.join(FP4_FORMATS)} (as written), got {shown(fp4)}"))
    if fp4 and a.get("fp4_recipe", "nvfp4") not in FP4_RECIPES:
        out.append(("fp4_recipe", f"must be one of {', '.join(FP4_RECIPES)} (as written), got {shown(a.get('fp4_recipe'))}"))
    if fp8 and fp4:
        out.append(("fp4", "--fp4-format and --fp8-format cannot be used together"))
    # TransformerConfig.__post_init__ (core 0.19.2): a custom recipe names its factory
    if fp8 and a.get("fp8_recipe", "delayed") == "custom" and not a.get("fp8_quantizer_factory"):
        out.append(("fp8_quantizer_factory", "must be given with --fp8-recipe custom (a Python import path, "
                                             "package.module.quantizer_factory)"))
    if fp4 and a.get("fp4_recipe", "nvfp4") == "custom" and not a.get("fp4_quantizer_factory"):
        out.append(("fp4_quantizer_factory", "must be given with --fp4-recipe custom (a Python import path, "
                                             "package.module.quantizer_factory)"))
    if a.get("fp4_param_gather") and not fp4:
        out.append(("fp4_param_gather", "needs --fp4-format"))
    if a.get("fp8_param_gather"):
        if not fp8:
            out.append(("fp8_param_gather", "needs --fp8-format (TransformerConfig: fp8_param must be used together with fp8)"))
        elif not (a.get("use_distributed_optimizer") or a.get("use_megatron_fsdp") or a.get("use_torch_fsdp2")):
            out.append(("fp8_param_gather", "needs --use-distributed-optimizer, Megatron-FSDP or torch FSDP2"))
        if a.get("optimizer_cpu_offload") and a.get("fp8_recipe", "delayed") != "delayed":
            out.append(("fp8_param_gather", "with --optimizer-cpu-offload needs --fp8-recipe delayed"))
    if fp8 and a.get("first_last_layers_bf16"):
        if a.get("fp8_recipe", "delayed") == "delayed":
            out.append(("first_last_layers_bf16", "is not supported with --fp8-recipe delayed"))
        num_layers, pp = a.get("num_layers"), a.get("pipeline_model_parallel_size") or 1
        if num_layers:
            top = num_layers // pp
            for name in ("num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16"):
                n = a.get(name, 1)
                if n is not None and not 0 <= n <= top:
                    out.append((name, f"must be between 0 and the layers per pipeline stage ({top})"))
    if a.get("reuse_grad_buf_for_mxfp8_param_ag") and not a.get("fp8_param_gather") and not a.get("use_megatron_fsdp"):
        out.append(("reuse_grad_buf_for_mxfp8_param_ag", "needs --fp8-param-gather (DDP config: reuse the grad "
                                                          "buffer only when keeping params in MXFP8)"))
    if a.get("fp8_output_proj"):
        if not fp8 or a.get("fp8_recipe", "delayed") != "mxfp8":
            out.append(("fp8_output_proj", "needs --fp8-format with --fp8-recipe mxfp8"))
        # TELMHeadColumnParallelLinear (core 0.19.2 extensions/transformer_engine.py) raises on a shared
        # weight (skip_weight_param_allocation: the embedding and the output layer in one model, PP 1) and
        # on the deferred-wgrad buffers
        if not a.get("untie_embeddings_and_output_weights") and (a.get("pipeline_model_parallel_size") or 1) == 1:
            out.append(("fp8_output_proj", "needs --untie-embeddings-and-output-weights when one pipeline stage holds "
                                           "the embedding and the output layer (the TE output projection cannot share "
                                           "the embedding's weight)"))
        if a.get("defer_embedding_wgrad_compute"):
            out.append(("fp8_output_proj", "cannot be used with --defer-embedding-wgrad-compute"))
    if fp8 and a.get("fp8_recipe", "delayed") == "delayed" and a.get("recompute_granularity") == "selective":
        mods = set(a.get("recompute_modules") or ())
        if mods & {"moe_act", "layernorm"}:
            out.append(("recompute_modules", "moe_act and layernorm recompute are not supported with --fp8-recipe delayed"))
    if a.get("activation_func_fp8_input_store") and not a.get("swiglu"):
        out.append(("activation_func_fp8_input_store", "is supported only for SwiGLU"))
    return out


def not_modelled(a: Mapping[str, Any]) -> tuple[str, str] | None:
    """(argument, what) for FP8 / FP4 settings whose bytes cannot be known from the flags."""
    # a factory is Python code run by TE's CustomRecipe: which quantized tensors (and scales) it creates is
    # known only when it runs, so there is no storage class to size; the built-in recipe of the same storage is
    # the estimate a user can ask for
    # (without a factory Megatron stops first: rule_violations reports it)
    if a.get("fp8") and a.get("fp8_recipe") == "custom" and a.get("fp8_quantizer_factory"):
        return ("fp8_quantizer_factory",
                "a custom FP8 recipe (its quantizer factory is Python code whose tensors are known only when it runs; "
                "for an estimate give the built-in recipe with the same storage: --fp8-recipe tensorwise, blockwise or "
                "mxfp8)")
    if a.get("fp4") and a.get("fp4_recipe") == "custom" and a.get("fp4_quantizer_factory"):
        return ("fp4_quantizer_factory",
                "a custom FP4 recipe (its quantizer factory is Python code whose tensors are known only when it runs; "
                "for an estimate give the built-in recipe with the same storage: --fp4-recipe nvfp4)")
    if a.get("te_precision_config_file"):
        return "te_precision_config_file", PER_MODULE_RECIPES
    return None
