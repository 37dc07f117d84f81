"""Section: mixture of experts. Megatron's MoE rules, read from the user's settings into a ``MoeSpec``.

Mirrors ``validate_args`` (megatron/training/arguments.py: num_experts 0 means dense, moe_ffn_hidden_size
defaults to ffn_hidden_size, EP divides the experts, ETP defaults to TP), ``initialize_model_parallel``
(the world divides into ETP x EP x PP), ``TransformerConfig.__post_init__`` (top-1 softmax routing needs
pre-softmax, the capacity factor only with aux-loss or no balancing, pad-to-capacity needs a capacity,
shared-expert overlap only with alltoall/flex, moe_act recompute only with grouped GEMM, shared_experts
recompute not with overlap, router groups) and ``MoELayer.forward`` (training with TP > 1 needs
sequence parallelism); megatron-core 0.16.1 and 0.19.2 agree on all of them. Each broken rule is one
error naming the flag the user wrote.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping, Protocol

from packaging.version import Version

from ..errors import ConfigError, NotModelledError
from ..layout.moe import DISPATCHERS, MoeSpec, parse_moe_layer_freq
from ..estimator.layers.moe import deepep_ranks_supported
from .args import Args, Context
from ..numbers import upper_bound
from .parallel import weight_shards

# MoE settings whose memory memguard does not model: refused by name (dest, predicate, what).
NOT_MODELLED_MOE: list[tuple[str, Any, str]] = [
    # (the stash first: it needs the rank capacity factor, and is what the user turned on)
    ("moe_paged_stash", bool, "paged expert-activation stashing (--moe-paged-stash: its page buffers are sized from "
                              "the first iteration's routed token counts, over the hybridep / ncclep dispatchers)"),
    ("moe_expert_rank_capacity_factor", lambda v: v is not None, "per-rank expert capacity (HybridEP / NCCL-EP)"),
]
# memguard's bound on --moe-expert-capacity-factor (GShard / Switch use 1 to 2, Megatron's examples 1).
MAX_CAPACITY_FACTOR = 1_000
# Expert weight tensors memguard lists per rank: DeepSeek-V3 at EP 1 has (58 MoE layers + 1 MTP depth)
# x 256 experts x 2 = 30,208; the bound keeps the estimate of any accepted input within seconds.
MAX_EXPERT_TENSORS = 500_000
MAX_EXPERT_TENSORS_WHY = "16 x DeepSeek-V3's 30,208 at EP 1"
_LOAD_BALANCING = ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none")
_CAPACITY_BALANCING = ("aux_loss", "seq_aux_loss", "global_aux_loss", "none")


class Reader(Protocol):
    """What the resolver offers a section: typed reads of the user's settings and error reporting."""

    def get(self, dest: str, default: Any = None) -> Any: ...
    def key(self, dest: str) -> str: ...
    def fail(self, dest: str, rule: str, fix: str | None = None, *, fails_later: str | None = None) -> None: ...
    def int_arg(self, dest: str, default: int | None = None, required: bool = False, minimum: int = 1) -> int | None: ...
    def bool_arg(self, dest: str, default: bool) -> bool: ...
    def float_arg(self, dest: str, default: float) -> float: ...


def _paged_stash_rules(r: Reader) -> bool:
    """TransformerConfig.__post_init__ (core 0.19.2) on --moe-paged-stash; True when all hold. Its memory stays
    refused: the stash pages only the TE op-fuser grouped MLP's saved tensors, and the rank capacity it needs
    runs only over the hybridep / ncclep dispatchers, whose buffers memguard does not size."""
    ok = True
    if (r.get("cpu_offloading") is True or (r.get("cpu_offloading_num_layers") or 0) > 0):
        r.fail("moe_paged_stash", "cannot be used with --cpu-offloading-num-layers (TransformerConfig: \"moe_paged_stash "
                                  "cannot be enabled with cpu_offloading\")")
        ok = False
    if r.get("moe_expert_rank_capacity_factor") is None:
        r.fail("moe_paged_stash", "needs --moe-expert-rank-capacity-factor (TransformerConfig: \"there is no need to use "
                                  "paged stashing without it\")")
        ok = False
    mods = r.get("offload_modules") or ()
    clash = sorted({"expert_fc1", "moe_act", "fused_group_mlp"} & set(mods if isinstance(mods, (list, tuple)) else [mods]))
    if clash:
        r.fail("offload_modules", f"must not include {', '.join(clash)} with --moe-paged-stash (the stash covers those "
                                  "activations: TransformerConfig)")
        ok = False
    return ok


def _single_grouped_rules(r: Reader, *, add_bias_linear: bool, precision: Mapping[str, Any]) -> bool:
    """--moe-single-grouped-weight / --moe-single-grouped-bias (core 0.18+): TransformerConfig.__post_init__ (0.19.2
    transformer_config.py lines 1556-1587, with no num_moe_experts guard) needs grouped GEMM, the TE op fuser, high
    precision / MXFP8 / NVFP4 primary weights and biases for a single grouped bias. Returns whether all hold."""
    weight = r.bool_arg("moe_single_grouped_weight", False)
    bias = r.bool_arg("moe_single_grouped_bias", False)
    if not (weight or bias):
        return True
    key = "moe_single_grouped_weight" if weight else "moe_single_grouped_bias"
    ok = True
    if not r.bool_arg("moe_grouped_gemm", False):
        r.fail(key, "needs --moe-grouped-gemm (TransformerConfig)")
        ok = False
    if weight:
        if (precision.get("fp8") and precision.get("fp8_recipe") != "mxfp8") or \
                (precision.get("fp4") and precision.get("fp4_recipe") != "nvfp4"):
            recipe = (f"--fp8-recipe {precision.get('fp8_recipe')}" if precision.get("fp8")
                      and precision.get("fp8_recipe") != "mxfp8" else f"--fp4-recipe {precision.get('fp4_recipe')}")
            r.fail(key, f"works without FP8 / FP4 or with --fp8-recipe mxfp8 or --fp4-recipe nvfp4 only, not {recipe} "
                        "(TransformerConfig)")
            ok = False
        if not r.bool_arg("use_transformer_engine_op_fuser", False):
            r.fail(key, "needs --use-transformer-engine-op-fuser (TransformerConfig: TE's GroupedLinear without the op "
                        "fuser splits the grouped parameter per expert)")
            ok = False
    if bias and not add_bias_linear:
        r.fail("moe_single_grouped_bias", "needs biases (TransformerConfig: add_bias_linear=True; drop "
                                          "--disable-bias-linear)")
        ok = False
    return ok


def _every_model_rules(r: Reader, *, before_019: bool) -> bool:
    """TransformerConfig.__post_init__'s rules on the router's lists and the SM counts, which no ``num_moe_experts``
    guards (dense and MoE models alike); False when one broke."""
    ok = True
    lbt = r.get("moe_router_load_balancing_type")
    if isinstance(lbt, (list, tuple)):
        # core 0.16.1 transformer_config.py line 1097, 0.19.2 line 1652 (validate_args of 0.19.2 first makes a
        # one-element list its value: arguments.py line 1606; memguard's flag reader does the same)
        coeff = r.get("moe_aux_loss_coeff", 0.0)
        if not isinstance(coeff, (list, tuple)) or len(coeff) != len(lbt):
            got = f"{len(coeff)} values" if isinstance(coeff, (list, tuple)) else "one value"
            r.fail("moe_aux_loss_coeff", f"must be a list of as many values as --moe-router-load-balancing-type has "
                                         f"({len(lbt)}), got {got} (TransformerConfig: \"moe_aux_loss_coeff must be a "
                                         "list of the same length as moe_router_load_balancing_type\")")
            ok = False
    if not before_019 and r.get("moe_flex_dispatcher_num_sms") is None:
        # core 0.19.2 transformer_config.py line 1619: the deprecated per-backend SM counts route to
        # moe_flex_dispatcher_num_sms, and two different ones raise (0.16.1-0.18.2: plain fields, default 20)
        deprecated = {d: r.int_arg(d, None) for d in ("moe_deepep_num_sms", "moe_hybridep_num_sms")
                      if r.get(d) is not None}
        if len(set(deprecated.values())) > 1:
            r.fail("moe_hybridep_num_sms", f"{deprecated['moe_hybridep_num_sms']} conflicts with --moe-deepep-num-sms "
                                           f"{deprecated['moe_deepep_num_sms']}: both are deprecated and route to one "
                                           "SM count (TransformerConfig, megatron-core 0.19.2: \"Conflicting deprecated "
                                           "SM-count knobs\")", "give one --moe-flex-dispatcher-num-sms instead")
            ok = False
    return ok


def _flex_num_sms(r: Reader, *, before_019: bool) -> int:
    """The SMs DeepEP's buffers are sized for: --moe-flex-dispatcher-num-sms (0.19), else the deprecated
    --moe-deepep-num-sms or (0.19: routed there too) --moe-hybridep-num-sms; DeepEP's 20 by default."""
    flex = r.int_arg("moe_flex_dispatcher_num_sms", None)
    if flex:
        return flex
    deepep = r.int_arg("moe_deepep_num_sms", None)
    if deepep or before_019:
        return deepep or 20
    # (core 0.19.2 transformer_config.py line 1635 routes --moe-hybridep-num-sms to the flex dispatcher's count)
    return r.int_arg("moe_hybridep_num_sms", None) or 20


def _dense_rules(r: Reader, *, legacy: bool, before_019: bool, precision: Mapping[str, Any],
                 before_017: bool = True) -> None:
    """The rules of TransformerConfig.__post_init__ on MoE-only settings that no ``num_moe_experts`` guards, so
    that megatron-core stops a dense model that sets them (core 0.19.2 transformer_config.py lines 1538-1710,
    1904-1920, 2284-2360; core 0.16.1 lines 1058-1135, 1593-1660). The MoE branch of ``read_moe`` checks the
    same rules with the experts' own."""
    ffn = r.get("moe_ffn_hidden_size")
    if ffn is not None:
        freq = r.get("moe_layer_freq", 1)
        mixed = (isinstance(freq, (list, tuple)) and 0 in freq) or (isinstance(freq, int) and freq > 1) \
            or (isinstance(freq, str) and (freq.strip().isdigit() and int(freq) > 1 or "0" in freq.replace(" ", "")))
        if legacy or not mixed:
            # 0.16.1 asserts it with no exception; 0.19.2 lets a mixed --moe-layer-freq through (its dense layers)
            r.fail("moe_ffn_hidden_size", "needs --num-experts (TransformerConfig: \"moe_ffn_hidden_size is set but "
                                          "num_moe_experts is None\")", "remove --moe-ffn-hidden-size or add --num-experts")
    raw = getattr(r, "raw", None)
    if r.get("moe_latent_size") is not None and raw is not None and raw.megatron_command_line and not before_017:
        # validate_args (arguments.py: core 0.17.1 line 1599, 0.19.2 line 1899) asserts a positive size, then experts;
        # TransformerConfig has no such rule (a Bridge / NeMo dense config's latent size builds nothing). 0.16.1's
        # validate_args is not installed here to check, so its command lines are not held to it
        lat = r.int_arg("moe_latent_size", None, minimum=-(2**63))
        if lat is not None and lat <= 0:
            r.fail("moe_latent_size", f"must be greater than zero (validate_args), got {lat}")
        elif lat is not None:
            r.fail("moe_latent_size", "needs --num-experts (validate_args: \"MoE latent projections are applicable only "
                                      "for MoE models\")", "remove --moe-latent-size or add --num-experts")
    disp = str(r.get("moe_token_dispatcher_type", "allgather"))
    backend = str(r.get("moe_flex_dispatcher_backend", "deepep"))
    deepep = r.bool_arg("moe_enable_deepep", False)
    if deepep and disp != "flex":
        r.fail("moe_enable_deepep", "needs --moe-token-dispatcher-type flex (TransformerConfig: \"DeepEP backend is only "
                                    "supported with flex token dispatcher\")")
    elif deepep and backend == "hybridep":
        r.fail("moe_enable_deepep", "cannot be used with --moe-flex-dispatcher-backend hybridep (TransformerConfig: "
                                    "\"Only one backend is supported for flex token dispatcher\")")
    pad = r.bool_arg("moe_pad_expert_input_to_capacity", False)
    if disp == "flex" and pad and (deepep or backend == "deepep"):
        r.fail("moe_pad_expert_input_to_capacity", "is not supported by the flex dispatcher with DeepEP (TransformerConfig)")
    if backend == "ncclep" and disp != "flex":
        r.fail("moe_flex_dispatcher_backend", "ncclep needs --moe-token-dispatcher-type flex (TransformerConfig)")
    fs = r.get("moe_shared_expert_intermediate_size")
    if fs is not None:
        fs = r.int_arg("moe_shared_expert_intermediate_size", None, minimum=-(2**63))
        if fs is not None and fs <= 0:
            r.fail("moe_shared_expert_intermediate_size", f"must be positive (num_shared_experts x the shared expert's FFN "
                                                          f"size: TransformerConfig), got {fs}")
        elif fs is not None and r.bool_arg("moe_shared_expert_overlap", False) and disp not in ("alltoall", "flex"):
            r.fail("moe_shared_expert_overlap", "only works with the alltoall or flex token dispatcher (TransformerConfig)")
    cf = r.get("moe_expert_capacity_factor")
    cf = None if cf is None else r.float_arg("moe_expert_capacity_factor", -1.0)
    if cf is not None and cf < 0:
        cf = None   # TransformerConfig: a negative factor means dropless
    lbt = r.get("moe_router_load_balancing_type", "aux_loss")
    types = [str(t) for t in (lbt if isinstance(lbt, (list, tuple)) else [lbt])]
    if cf is not None and any(t not in _CAPACITY_BALANCING for t in types):
        r.fail("moe_expert_capacity_factor", "only works with aux_loss, seq_aux_loss, global_aux_loss or none load "
                                             "balancing (TransformerConfig)")
    if pad and cf is None:
        r.fail("moe_pad_expert_input_to_capacity", "needs --moe-expert-capacity-factor (TransformerConfig)")
    if not before_019 and r.get("moe_expert_rank_capacity_factor") is not None:
        if backend not in ("hybridep", "ncclep"):
            r.fail("moe_expert_rank_capacity_factor", "needs --moe-flex-dispatcher-backend hybridep or ncclep "
                                                      "(TransformerConfig, megatron-core 0.19.2)")
        elif backend == "hybridep" and not r.bool_arg("use_transformer_engine_op_fuser", False):
            r.fail("moe_expert_rank_capacity_factor", "with the hybridep backend needs --use-transformer-engine-op-fuser "
                                                      "(TransformerConfig, megatron-core 0.19.2)")
    if not before_019 and r.bool_arg("moe_paged_stash", False):
        _paged_stash_rules(r)
    score = str(r.get("moe_router_score_function", "softmax"))
    if r.bool_arg("moe_router_enable_expert_bias", False) and score not in (
            ("sigmoid",) if legacy else ("sigmoid", "sqrtsoftplus")):
        r.fail("moe_router_enable_expert_bias", "needs --moe-router-score-function sigmoid"
               + ("" if legacy else " or sqrtsoftplus") + " (TransformerConfig)")
    if r.bool_arg("moe_router_padding_for_quantization", False) or r.bool_arg("moe_router_padding_for_fp8", False):
        key = "moe_router_padding_for_quantization" if r.get("moe_router_padding_for_quantization") else \
            "moe_router_padding_for_fp8"
        if not precision.get("fp8") and not precision.get("fp4"):
            r.fail(key, "needs --fp8-format or --fp4-format (TransformerConfig)")
        elif disp in ("allgather", "alltoall_seq"):
            r.fail(key, f"is not supported by the {disp} token dispatcher (TransformerConfig)")
    k = r.int_arg("moe_router_topk", 2)
    if k == 1 and score == "softmax" and not r.bool_arg("moe_router_pre_softmax", False) and "sinkhorn" not in types:
        r.fail("moe_router_topk", "1 with the softmax score function needs --moe-router-pre-softmax (TransformerConfig "
                                  "checks it for dense models too)", "add --moe-router-pre-softmax or leave out --moe-router-topk")
    if r.int_arg("moe_router_group_topk", None):
        if not r.int_arg("moe_router_num_groups", None):
            r.fail("moe_router_group_topk", "needs --moe-router-num-groups (TransformerConfig)")
        else:
            # TransformerConfig computes num_moe_experts % moe_router_num_groups: None % groups raises TypeError
            r.fail("moe_router_group_topk", "needs --num-experts (TransformerConfig divides the experts into "
                                            "--moe-router-num-groups groups)")


def read_moe(r: Reader, *, num_layers: int, ffn_hidden_size: int, tp: int, pp: int, world_size: int,
             sequence_parallel: bool, add_bias_linear: bool, recompute_modules: tuple[str, ...],
             recompute_granularity: str | None, vpp: int | None = None, recompute_method: str | None = None,
             recompute_num_layers: int | None = None, half: bool = True, legacy: bool = False,
             before_019: bool | None = None, tokens: int | None = None,
             precision: Mapping[str, Any] | None = None, before_017: bool | None = None) -> MoeSpec | None:
    """The resolved MoE settings, or None for a dense model (and then no expert flag may be set).
    ``before_019`` / ``before_017``: the release predates megatron-core 0.19 / 0.17 (default: ``legacy``); ``tokens``: s x b, the
    tokens of one micro-batch over the TP x CP group (quantile balancing's rule); ``precision``: the flat
    names fp8, fp8_recipe, fp4, fp4_recipe, swiglu, transformer_impl (the fused shared expert's rules)."""
    before_019 = legacy if before_019 is None else before_019
    before_017 = legacy if before_017 is None else before_017
    n = r.int_arg("num_experts", None, minimum=0)
    ep = r.int_arg("expert_model_parallel_size", 1) or 1
    if not n:   # validate_args: --num-experts 0 is a dense model
        if ep > 1:
            r.fail("expert_model_parallel_size", "needs --num-experts (expert parallelism splits the experts)")
        # initialize_model_parallel builds the expert grid for dense models too (parallel_state.py, 0.16.1
        # line 792, 0.19.2 line 881), and TransformerConfig checks moe_act recompute without experts
        # (transformer_config.py, 0.16.1 line 1213, 0.19.2 line 1784)
        etp = r.int_arg("expert_tensor_parallel_size", None)
        if etp and world_size % (etp * pp):
            r.fail("expert_tensor_parallel_size", f"world size {world_size} must be divisible by expert tensor parallel "
                                                  f"{etp} x pipeline parallel {pp} (initialize_model_parallel)")
        if recompute_granularity == "selective" and "moe_act" in recompute_modules \
                and not r.bool_arg("moe_grouped_gemm", False):
            r.fail("recompute_modules", "moe_act is only supported with --moe-grouped-gemm")
        _every_model_rules(r, before_019=before_019)
        _dense_rules(r, legacy=legacy, before_019=before_019, precision=precision or {}, before_017=before_017)
        _single_grouped_rules(r, add_bias_linear=add_bias_linear, precision=precision or {})
        return None
    # a paged stash that breaks Megatron's own rules is the error Megatron stops on, not a refusal
    stash_ok = not r.bool_arg("moe_paged_stash", False) or _paged_stash_rules(r)
    for dest, pred, what in NOT_MODELLED_MOE if stash_ok else ():
        v = r.get(dest)
        if v is not None and pred(v):
            raise NotModelledError(r.key(dest), what)
    etp = r.int_arg("expert_tensor_parallel_size", None) or tp
    weight_shards(r, "expert_tensor_parallel_num_weight_shards", "expert_gtp_weight_remat_size", etp, "expert TP")
    k = r.int_arg("moe_router_topk", 2) or 2
    ok = _every_model_rules(r, before_019=before_019)
    if n % ep:
        r.fail("expert_model_parallel_size", f"must divide --num-experts {n}, got {ep}")
        ok = False
    if world_size % (etp * ep * pp):
        r.fail("expert_model_parallel_size", f"world size {world_size} must be divisible by expert tensor parallel "
                                             f"{etp} x expert parallel {ep} x pipeline parallel {pp}")
        ok = False
    if k > n:
        r.fail("moe_router_topk", f"must be at most --num-experts {n}, got {k}")
        ok = False
    if tp > 1 and not sequence_parallel:
        # (validate_args does not check it: MoELayer.forward raises ValueError in training, moe_layer.py 0.19.2 line
        # 629, 0.17.1 546, 0.16.1 379)
        r.fail("sequence_parallel", "is required for MoE training with tensor parallelism > 1 (MoELayer.forward)",
               "add --sequence-parallel", fails_later="at the first forward step (MoELayer.forward raises)")
        ok = False
    disp = str(r.get("moe_token_dispatcher_type", "allgather"))
    if disp not in DISPATCHERS:
        r.fail("moe_token_dispatcher_type", f"must be one of {', '.join(DISPATCHERS)}, got {disp[:60]!r}")
        ok = False
    num_sms = 20
    if r.bool_arg("moe_enable_deepep", False):
        disp = "flex"     # TransformerConfig: the deprecated --moe-enable-deepep means flex with DeepEP
    if disp == "flex":
        backend = str(r.get("moe_flex_dispatcher_backend", "deepep"))
        if backend == "hybridep":
            # fused_a2a.py init_hybrid_ep_buffer (0.19.2) passes the hidden size, T and E/EP to deep_ep's
            # HybridEPBuffer, which sizes its buffers in its own runtime (not in megatron-core nor in the
            # deep-ep package on PyPI): their bytes are unknown
            key = r.key("moe_flex_dispatcher_backend")
            raise NotModelledError(key, "the flex dispatcher's hybridep backend (HybridEPBuffer sizes its buffers inside "
                                   "DeepEP's hybrid-ep runtime)", _deepep_instead(key))
        if backend != "deepep":
            raise NotModelledError(r.key("moe_flex_dispatcher_backend"),
                                   f"the flex dispatcher's {backend[:20]} backend (its buffers)")
        if not deepep_ranks_supported(etp * ep):
            # deep_ep Buffer.get_dispatch_config asserts a tuned config for the group size (deep-ep 1.0.0)
            raise NotModelledError(r.key("expert_model_parallel_size"),
                                   f"DeepEP over {etp * ep} ranks (ETP x EP; its buffer configs cover up to 8 and 16, "
                                   "24, 32, 64, 128, 144, 160)")
        if r.bool_arg("moe_pad_expert_input_to_capacity", False):
            r.fail("moe_pad_expert_input_to_capacity", "is not supported by the flex dispatcher with DeepEP")
            ok = False
        num_sms = _flex_num_sms(r, before_019=before_019)
    lbt = r.get("moe_router_load_balancing_type", "aux_loss")
    types = [str(t) for t in (lbt if isinstance(lbt, (list, tuple)) else [lbt])]
    for t in types:
        if t == "quantile_balancing" and before_019:
            # the choice came with megatron-core 0.19 (router.py of 0.18.2 has no quantile balancing)
            r.fail("moe_router_load_balancing_type", "quantile_balancing needs megatron-core >= 0.19")
            ok = False
        elif t not in _LOAD_BALANCING and t != "quantile_balancing":
            r.fail("moe_router_load_balancing_type", f"must be one of {', '.join(_LOAD_BALANCING)}, got {t[:60]!r}")
            ok = False
    coeff = r.get("moe_aux_loss_coeff", 0.0)
    coeffs = coeff if isinstance(coeff, (list, tuple)) else [coeff]
    try:
        aux = sum(float(c) for c in coeffs)
    except (TypeError, ValueError):
        r.fail("moe_aux_loss_coeff", f"must be a number, got {str(coeff)[:60]!r}")
        aux, ok = 0.0, False
    score = str(r.get("moe_router_score_function", "softmax"))
    if score == "sqrtsoftplus" and legacy:
        # the third choice came with megatron-core 0.18 (moe_utils.py of 0.17.1 has softmax and sigmoid only)
        r.fail("moe_router_score_function", "sqrtsoftplus needs megatron-core >= 0.18")
        ok = False
    elif score not in ("softmax", "sigmoid", "sqrtsoftplus"):
        r.fail("moe_router_score_function", f"must be softmax, sigmoid or sqrtsoftplus, got {score[:60]!r}")
        ok = False
    if r.bool_arg("moe_router_enable_expert_bias", False) and score not in (
            ("sigmoid",) if legacy else ("sigmoid", "sqrtsoftplus")):
        # TransformerConfig.__post_init__: aux-loss-free expert bias needs sigmoid (0.16.1), or sqrtsoftplus (0.19.2)
        r.fail("moe_router_enable_expert_bias", "needs --moe-router-score-function sigmoid"
               + ("" if legacy else " or sqrtsoftplus"))
        ok = False
    if types == ["quantile_balancing"] and not before_019:
        ok = _quantile_balancing_rules(r, k=k, n=n, tokens=tokens) and ok
    pre = r.bool_arg("moe_router_pre_softmax", False)
    if k == 1 and score == "softmax" and not pre and "sinkhorn" not in types:
        r.fail("moe_router_topk", "1 with the softmax score function needs --moe-router-pre-softmax "
                                  "(a softmax over one choice has a zero gradient)", "add --moe-router-pre-softmax")
        ok = False
    cf_raw = r.get("moe_expert_capacity_factor")
    cf = None if cf_raw is None else r.float_arg("moe_expert_capacity_factor", -1.0)
    if cf is not None and cf < 0:
        cf = None   # TransformerConfig: a negative factor means dropless
    if cf is not None and cf > MAX_CAPACITY_FACTOR:
        r.fail("moe_expert_capacity_factor", f"must be <= {MAX_CAPACITY_FACTOR:,} (memguard's bound: published runs use "
                                             f"1 to 4, and the padded expert input grows with it), got {cf:g}")
        cf, ok = None, False
    if cf is not None and any(t not in _CAPACITY_BALANCING for t in types):
        r.fail("moe_expert_capacity_factor", "only works with aux_loss, seq_aux_loss, global_aux_loss or none load balancing")
        ok = False
    pad = r.bool_arg("moe_pad_expert_input_to_capacity", False)
    if pad and cf is None:
        r.fail("moe_pad_expert_input_to_capacity", "needs --moe-expert-capacity-factor")
        ok = False
    Fs = r.int_arg("moe_shared_expert_intermediate_size", None)
    overlap = r.bool_arg("moe_shared_expert_overlap", False)
    if Fs and overlap and disp not in ("alltoall", "flex"):
        r.fail("moe_shared_expert_overlap", "only works with the alltoall or flex token dispatcher")
        ok = False
    if Fs and add_bias_linear:
        r.fail("moe_shared_expert_intermediate_size", "shared experts do not support biases (SharedExpertMLP)",
               "add --disable-bias-linear")
        ok = False
    if add_bias_linear and etp != 1:
        # TransformerConfig.__post_init__ (core 0.16.1 and 0.19.2): "Bias in Moe is only supported when ETP==1"
        r.fail("expert_tensor_parallel_size", f"must be 1 with biases in MoE layers (TransformerConfig), got {etp}",
               "add --disable-bias-linear or --expert-tensor-parallel-size 1")
        ok = False
    grouped = r.bool_arg("moe_grouped_gemm", False)
    ok = _single_grouped_rules(r, add_bias_linear=add_bias_linear, precision=precision or {}) and ok
    mods = set(recompute_modules) if recompute_granularity == "selective" else set()
    if "moe_act" in mods and not grouped:
        r.fail("recompute_modules", "moe_act is only supported with --moe-grouped-gemm")
        ok = False
    fused_shared = r.bool_arg("use_grouped_gemm_for_shared_expert", False) and bool(Fs)
    if fused_shared:
        ok = _fused_shared_expert_rules(r, before_019=before_019, precision=precision or {}) and ok
    if "shared_experts" in mods and Fs and overlap:
        r.fail("recompute_modules", "shared_experts recompute cannot work with --moe-shared-expert-overlap")
        ok = False
    groups, gtopk = r.int_arg("moe_router_num_groups", None), r.int_arg("moe_router_group_topk", None)
    if gtopk:
        if not groups:
            r.fail("moe_router_group_topk", "needs --moe-router-num-groups")
            ok = False
        elif n % groups or gtopk > groups:
            r.fail("moe_router_num_groups", f"must divide --num-experts {n} and be at least --moe-router-group-topk {gtopk}")
            ok = False
        elif k // gtopk > n // groups:
            # group_limited_topk takes the top (topk // group_topk) scores of each group's n // groups experts:
            # torch.topk fails at the first forward (transformer/moe/moe_utils.py, 0.19.2 line 656, 0.16.1 line 554)
            r.fail("moe_router_group_topk", f"--moe-router-topk {k} // --moe-router-group-topk {gtopk} = {k // gtopk} "
                                            f"exceeds the {n // groups} experts of each of the {groups} groups")
            ok = False
    a2a_overlap = r.bool_arg("overlap_moe_expert_parallel_comm", False)
    if a2a_overlap:
        # TransformerConfig.__post_init__ (0.16.1 and 0.19.2): EP > 1, alltoall or flex, VPP when PP > 1,
        # no full recompute / recompute method / recompute layers, bf16 or fp16, no shared-expert overlap,
        # at most one MTP layer (0.16.1: exactly one, and then PP > 1); 0.17.1 to 0.19.2 also no 'moe' recompute
        mtp = r.int_arg("mtp_num_layers", 0, minimum=0) or 0
        if "moe" in mods and before_017:
            _moe_recompute_under_overlap_016(r)
        for bad_when, rule in ((ep == 1, "needs --expert-model-parallel-size > 1"),
                               (disp not in ("alltoall", "flex"), "needs the alltoall or flex token dispatcher"),
                               (pp > 1 and not vpp, "needs virtual pipeline stages when --pipeline-model-parallel-size > 1 "
                                                    "(--num-layers-per-virtual-pipeline-stage or a pipeline layout)"),
                               (recompute_granularity == "full", "cannot be used with full recompute"),
                               (recompute_method is not None, "cannot be used with --recompute-method"),
                               (recompute_num_layers is not None, "cannot be used with --recompute-num-layers"),
                               (not half, "needs --bf16 or --fp16"),
                               ("moe" in mods and not before_017, "cannot be used with 'moe' in --recompute-modules"),
                               (bool(Fs) and overlap, "cannot be used with --moe-shared-expert-overlap"),
                               (mtp > 1, "supports at most one MTP layer (--mtp-num-layers)"),
                               (legacy and mtp == 1 and pp == 1, "with an MTP layer needs --pipeline-model-parallel-size > 1 "
                                                                 "(megatron-core 0.16)")):
            if bad_when:
                r.fail("overlap_moe_expert_parallel_comm", rule)
                ok = False
    delay_wgrad = r.bool_arg("delay_wgrad_compute", False)
    if delay_wgrad and not a2a_overlap:
        # TransformerConfig.__post_init__ (0.16.1 and 0.19.2): only the combined 1F1B schedule calls backward_dw
        r.fail("delay_wgrad_compute", "needs --overlap-moe-expert-parallel-comm")
        ok = False
    if r.bool_arg("ep_overlap_early_attn_memory_release", False) and not a2a_overlap:
        # TransformerConfig.__post_init__ (0.19.2)
        r.fail("ep_overlap_early_attn_memory_release", "needs --overlap-moe-expert-parallel-comm")
        ok = False
    wgrad_beside_dispatch = r.bool_arg("overlap_dispatch_backward_with_experts_wgrad", False)
    if wgrad_beside_dispatch and a2a_overlap:
        # TransformerConfig.__post_init__ (0.19.2)
        r.fail("overlap_dispatch_backward_with_experts_wgrad", "cannot be used with --overlap-moe-expert-parallel-comm")
        ok = False
    elif wgrad_beside_dispatch and delay_wgrad:
        r.fail("overlap_dispatch_backward_with_experts_wgrad", "cannot be used with --delay-wgrad-compute")
        ok = False
    jitter = r.get("moe_input_jitter_eps")
    jitter = r.float_arg("moe_input_jitter_eps", 0.0) if jitter is not None else None
    biased = r.get("moe_router_force_biased")
    biased = r.float_arg("moe_router_force_biased", 0.0) if biased is not None else None
    rdtype = r.get("moe_router_dtype")
    if rdtype is not None and str(rdtype) not in ("fp32", "fp64"):
        r.fail("moe_router_dtype", f"must be fp32 or fp64, got {str(rdtype)[:60]!r}")
        ok = False
    try:
        pattern = parse_moe_layer_freq(r.get("moe_layer_freq", 1), num_layers, r.key("moe_layer_freq"))
    except ConfigError as e:
        r.fail("moe_layer_freq", e.rule)
        return None
    # memguard lists every local expert's weights of every MoE layer (and MTP depth) of a stage; its work
    # grows with their product, which --num-layers and --num-experts alone do not bound
    mtp = r.get("mtp_num_layers")      # (its own bound and type are checked where MTP is resolved)
    mtp = mtp if isinstance(mtp, int) and not isinstance(mtp, bool) and 0 <= mtp <= upper_bound("mtp_num_layers") else 0
    tensors = (sum(pattern) + mtp) * (n // max(ep, 1)) * (4 if add_bias_linear else 2)
    if tensors > MAX_EXPERT_TENSORS:
        r.fail("num_experts", f"{n // max(ep, 1):,} local experts (--num-experts / --expert-model-parallel-size) in "
                              f"{sum(pattern) + mtp:,} MoE layers make {tensors:,} expert weights per rank; memguard "
                              f"lists each and accepts at most {MAX_EXPERT_TENSORS:,} ({MAX_EXPERT_TENSORS_WHY})")
        ok = False
    probs_on_input = r.bool_arg("moe_apply_probs_on_input", False)
    if probs_on_input and k != 1:
        # TEGroupedMLP / SequentialMLP.forward assert it at the first forward (experts.py, 0.16.1 and 0.19.2)
        r.fail("moe_apply_probs_on_input", f"only works with --moe-router-topk 1, got {k} (the experts' forward)")
        ok = False
    latent = _latent_size(r, Fs=Fs, overlap=overlap, delay_wgrad=delay_wgrad, before_017=before_017)
    if latent == -1:
        latent, ok = None, False
    legacy_gg = grouped and r.bool_arg("moe_use_legacy_grouped_gemm", False)
    if legacy_gg and latent:
        # GroupedMLP.__init__ asserts it (core 0.16.1 experts.py)
        r.fail("moe_latent_size", "does not work with --moe-use-legacy-grouped-gemm (GroupedMLP)")
        ok = False
    if legacy_gg:
        ok = _legacy_grouped_mlp_rules(r, add_bias_linear=add_bias_linear, mods=mods, delay_wgrad=delay_wgrad,
                                       precision=precision or {}) and ok
    pad_align = _router_padding(r, disp=disp, precision=precision or {})
    if pad_align is None:
        ok = False
    if not ok:
        return None
    return MoeSpec(
        num_experts=n, moe_router_topk=k, moe_ffn_hidden_size=r.int_arg("moe_ffn_hidden_size", None) or ffn_hidden_size,
        moe_shared_expert_intermediate_size=Fs or None, moe_shared_expert_gate=r.bool_arg("moe_shared_expert_gate", False),
        moe_shared_expert_overlap=overlap, moe_grouped_gemm=grouped, moe_router_dtype=None if rdtype is None else str(rdtype),
        moe_token_dispatcher_type=disp, moe_permute_fusion=r.bool_arg("moe_permute_fusion", False),
        moe_router_fusion=r.bool_arg("moe_router_fusion", False), moe_expert_capacity_factor=cf,
        moe_pad_expert_input_to_capacity=pad, moe_layer_pattern=pattern, expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp, moe_router_load_balancing_type=",".join(types), moe_aux_loss_coeff=aux,
        moe_z_loss_coeff=(r.float_arg("moe_z_loss_coeff", 0.0) if r.get("moe_z_loss_coeff") is not None else None),
        moe_router_pre_softmax=pre, moe_router_score_function=score,
        moe_router_enable_expert_bias=r.bool_arg("moe_router_enable_expert_bias", False),
        moe_recompute=tuple(sorted(m for m in mods if m in ("moe", "moe_act", "shared_experts")
                                   and not (m == "moe" and a2a_overlap))),    # (0.16: not recomputed)
        overlap_moe_expert_parallel_comm=a2a_overlap, delay_wgrad_compute=delay_wgrad,
        overlap_dispatch_backward_with_experts_wgrad=wgrad_beside_dispatch, moe_flex_dispatcher_num_sms=num_sms,
        use_fused_weighted_squared_relu=r.bool_arg("use_fused_weighted_squared_relu", False),
        use_grouped_gemm_for_shared_expert=fused_shared, moe_input_jitter_eps=jitter,
        moe_router_force_biased=biased, moe_router_padding_align=pad_align or 0,
        moe_apply_probs_on_input=probs_on_input, moe_use_legacy_grouped_gemm=legacy_gg, moe_latent_size=latent,
    )


def _upcycling(a: Args, kw: Mapping[str, Any], ctx: Context, spec: MoeSpec) -> MoeSpec:
    """--moe-use-upcycling: megatron/training's setup_model_and_optimizer (training.py, 0.16) builds,
    after the MoE model and its optimizer, a DDP-wrapped dense model from the same arguments with num_experts None,
    EP 1 and ffn_hidden_size x --moe-upcycling-granularity, loads the dense checkpoint into it and converts it
    (upcycling_utils.load_and_upcycle_model): the start-up figure of estimator/upcycling.py. Megatron's rules are
    errors naming the flag (among them 0.17 to 0.19, where the start-up fails); the settings whose start-up was not
    read are refused by name."""
    if not a.bool_arg("moe_use_upcycling", False):
        return spec
    key = a.key("moe_use_upcycling")
    if ctx.version >= Version("0.17"):
        # training.py (core 0.17.1, 0.18.2, 0.19.2) loads the dense checkpoint with load_and_upcycle_model(
        # load_checkpoint, ..., load_kwargs={'model': ...}) while checkpointing.py's load_checkpoint names that
        # parameter ddp_model: a TypeError, seen on the real 0.19.2 code (tests/test_moe_upcycling_real.py). Before
        # it, 0.19.2's pretrain_gpt.py path builds the "dense" model MoE-shaped from cfg.model, and a model provider
        # (0.18.2, 0.19.2) fails at TransformerConfig (moe_ffn_hidden_size without num_moe_experts).
        a.fail("moe_use_upcycling", "does not work in megatron/training 0.17 to 0.19 (setup_model_and_optimizer "
                                    "calls load_checkpoint(model=...), whose parameter is ddp_model: TypeError "
                                    "at start-up)")
        return spec
    for dest, what in (("use_megatron_fsdp", "Megatron-FSDP"), ("use_torch_fsdp2", "torch FSDP2"),
                       ("optimizer_cpu_offload", "optimizer CPU offload")):
        if kw.get(dest):
            raise NotModelledError(key, f"upcycling under {what} (the dense model is wrapped as the MoE one)")
    if kw.get("fp8") or kw.get("fp4"):
        raise NotModelledError(key, "upcycling under FP8 / FP4 (the dense model's quantized weights at start-up)")
    g = a.int_arg("moe_upcycling_granularity", 1) or 1
    if a.raw.megatron_command_line and not a.given("save"):
        a.fail("moe_use_upcycling", "needs --save (validate_args)")
    if kw.get("virtual_pipeline_model_parallel_size"):
        # upcycling_utils.upcycle_state_dict (core 0.16.1 to 0.19.2) calls _convert_to_moe_state_dict(
        # dense_model[i].state_dict(), moe_model[i]) for several chunks: the arguments swapped, _get_config fails
        a.fail("moe_use_upcycling", "does not work with virtual pipeline stages (upcycle_state_dict passes each "
                                    "chunk's dense state dict where the MoE model belongs)")
    if not all(spec.moe_layer_pattern):
        # _expand_key_value expands every dense layer's mlp.linear_fc1/fc2 into expert keys, and
        # load_state_dict(strict=True) refuses them on the layers that stay dense
        a.fail("moe_layer_freq", "must make every layer MoE with --moe-use-upcycling (upcycling_utils expands every "
                                 "dense MLP into experts and loads the result strictly)")
    if spec.moe_use_legacy_grouped_gemm:
        a.fail("moe_use_legacy_grouped_gemm", "does not work with --moe-use-upcycling (upcycling_utils._get_config "
                                              "takes SequentialMLP or TEGroupedMLP experts)")
    dense_ffn = kw["ffn_hidden_size"] * g
    F = spec.moe_ffn_hidden_size
    if dense_ffn % F:
        a.fail("moe_upcycling_granularity", f"the dense FFN {kw['ffn_hidden_size']} x {g} must be divisible by "
                                            f"--moe-ffn-hidden-size {F} (upcycling_utils._get_config)")
    elif spec.num_experts % (dense_ffn // F):
        a.fail("num_experts", f"must be divisible by the upcycling granularity {dense_ffn // F} (dense FFN "
                              f"{dense_ffn} / --moe-ffn-hidden-size {F}; upcycling_utils._get_config)")
    return replace(spec, moe_use_upcycling=True, moe_upcycling_granularity=g)


def _latent_size(r: Reader, *, Fs: int | None, overlap: bool, delay_wgrad: bool, before_017: bool) -> int | None:
    """--moe-latent-size (core 0.16.1 and 0.19.2 MoELayer): the latent width, None when off, -1 after a reported
    error. validate_args: a positive size; MoELayer.preprocess asserts no shared-expert overlap in training.
    memguard models it in BF16 and FP8 / FP4 (the latent projections are quantized TELinears: estimator/fp8_layers.py,
    resolve/fp8_shapes.py) with every dispatcher (fc1_latent_proj runs before dispatch_preprocess in core 0.16.1
    and 0.19.2, so the alltoall, the allgather's gather into the GlobalMemoryBuffer and DeepEP's buffers all move
    latent-wide tokens; the flex dispatcher's HybridEP backend is refused on its own), under the expert-parallel
    overlap (the schedule's pre-dispatch node runs MoELayer.preprocess, its combine node postprocess:
    fine_grained_callables.py 0.16.1 and 0.19.2) and with delayed weight gradients from megatron-core 0.17
    (MoELayer.backward_dw runs the projections' deferred weight gradients: estimator/layers/moe.py activations,
    estimator/activations.py _delayed_wgrad_bytes)."""
    if r.get("moe_latent_size") is None:
        return None
    lat = r.int_arg("moe_latent_size", None, minimum=0)
    if not lat or lat < 1:
        r.fail("moe_latent_size", "must be greater than zero (validate_args)")
        return -1
    if Fs and overlap:
        r.fail("moe_shared_expert_overlap", "does not work with --moe-latent-size in training (MoELayer.preprocess)")
        return -1
    if delay_wgrad and before_017:
        # the latent projections are TELinears built with config.delay_wgrad_compute (TE puts each backward's input
        # and output gradient in its WeightGradStore queue), but 0.16.1's MoELayer.backward_dw runs only the experts'
        # and shared experts' backward_dw: the queue is never popped (0.17.1 added the projections' calls)
        r.fail("delay_wgrad_compute", "does not work with --moe-latent-size in megatron-core 0.16 (MoELayer.backward_dw "
               "never runs the latent projections' deferred weight gradients: they get none, and Transformer "
               "Engine's wgrad store keeps every micro-batch's inputs)", "use megatron-core 0.17 or later")
        return -1
    return lat


def _moe_recompute_under_overlap_016(r: Reader) -> None:
    """'moe' in --recompute-modules under --overlap-moe-expert-parallel-comm, megatron-core 0.16 (0.17.1 forbids the
    pair in TransformerConfig): the combined 1F1B schedule runs an MoE layer through the fine-grained callables
    (models/gpt/fine_grained_callables.py 0.16.1: mlp.route, preprocess, dispatch, routed_experts_compute, combine,
    postprocess), never MoELayer.forward, whose tensor_parallel.checkpoint is the 'moe' recompute (moe_layer.py
    ``moe_layer_recompute``): nothing is recomputed, estimated so (estimator/layers/base.py selective_modules) with a
    note. With CUDA graphs the partial-graph MoE layer recomputes its own way (MoETransformerLayer, local
    ``moe_router`` graphs): refused by name."""
    graphs = str(r.get("cuda_graph_impl") or "none") != "none" or r.bool_arg("enable_cuda_graph", False)
    if graphs:
        raise NotModelledError(r.key("recompute_modules"), "'moe' recompute under the expert-parallel all-to-all "
                               "overlap with CUDA graphs (megatron-core 0.16)")
    notes = getattr(r, "notes", None)
    if notes is not None:
        notes.append(f"{r.key('recompute_modules')}: 'moe' is not recomputed under --overlap-moe-expert-parallel-comm "
                     "(megatron-core 0.16's combined 1F1B schedule calls the MoE layer's parts, not the checkpointed "
                     "forward): estimated without it")


def _legacy_grouped_mlp_rules(r: Reader, *, add_bias_linear: bool, mods: set, delay_wgrad: bool,
                              precision: Mapping[str, Any]) -> bool:
    """GroupedMLP (megatron-core 0.16.1 transformer/moe/experts.py) asserts no bias at build and bf16 at the first
    forward, refuses moe_act recompute under FP8 / FP4 (ValueError), and TransformerConfig refuses it with
    --delay-wgrad-compute. Its grouped_gemm kernels run in BF16 whatever the FP8 / FP4 recipe: estimated so,
    with a note. Returns whether all rules hold."""
    key, ok = "moe_use_legacy_grouped_gemm", True
    if add_bias_linear:
        r.fail(key, "needs --disable-bias-linear (GroupedMLP: bias not supported in grouped GEMM)")
        ok = False
    if not precision.get("bf16"):
        r.fail(key, "needs --bf16 (GroupedMLP.forward: only bf16 is supported)")
        ok = False
    if delay_wgrad:
        r.fail("delay_wgrad_compute", "does not work with --moe-use-legacy-grouped-gemm (TransformerConfig)")
        ok = False
    quantized = precision.get("fp8") or precision.get("fp4")
    if quantized and "moe_act" in mods:
        r.fail(key, "cannot recompute moe_act under FP8 / FP4 (GroupedMLP)")
        ok = False
    elif quantized and ok:
        # GroupedMLP is no TE module: nothing in megatron-core 0.16.1 refuses it under FP8 / FP4 (only the moe_act
        # ValueError above; config.bf16 holds with --bf16 --fp8-format), and its gg.ops.gmm calls run in BF16 inside
        # the layer's FP8 autocast (estimator/fp8_layers.py layer_gemms leaves its GEMMs out)
        notes = getattr(r, "notes", None)
        if notes is not None:
            notes.append(f"{r.key(key)}: the legacy GroupedMLP runs its expert GEMMs in BF16 under FP8 / FP4 "
                         "(grouped_gemm's gmm is no Transformer Engine module): estimated so, the rest of each layer "
                         "(attention, router, shared experts) in FP8 / FP4")
    return ok


def router_padding_align(precision: Mapping[str, Any], op_fuser: bool = False) -> int:
    """get_align_size_for_quantization (transformer/moe/moe_utils.py, megatron-core 0.16.1 and 0.19.2):
    FP8 16, MXFP8 32 (fp8_utils.get_fp8_align_size), FP4 128 (fp4_utils.get_fp4_align_size, every recipe);
    0.19.2 first: 256 under --use-transformer-engine-op-fuser (the CUTLASS grouped GEMM's alignment)."""
    if op_fuser:
        return 256
    if precision.get("fp8"):
        return 32 if precision.get("fp8_recipe") == "mxfp8" else 16
    return 128 if precision.get("fp4") else 0


def _router_padding(r: Reader, *, disp: str, precision: Mapping[str, Any]) -> int | None:
    """--moe-router-padding-for-quantization (--moe-router-padding-for-fp8 is its alias: TransformerConfig sets
    the first from the second). TransformerConfig.__post_init__ (0.16.1 and 0.19.2) needs FP8 or FP4 and
    refuses the allgather dispatcher. Returns the alignment (0 when off), None after a reported error."""
    dest = next((d for d in ("moe_router_padding_for_quantization", "moe_router_padding_for_fp8")
                 if r.bool_arg(d, False)), None)
    if dest is None:
        return 0
    align = router_padding_align(precision)
    ok = True
    if not align:
        r.fail(dest, "needs --fp8-format or --fp4-format (TransformerConfig: fp8/fp4 must be specified)")
        ok = False
    if disp == "allgather":
        r.fail(dest, "does not work with the allgather token dispatcher (TransformerConfig)",
               "use --moe-token-dispatcher-type alltoall or flex")
        ok = False
    # with --moe-expert-capacity-factor pad_routing_map runs on the routing map the router already dropped to the
    # capacity: estimator/layers/moe.py expert_rows pads the dropped counts (padded to capacity: C rows an expert)
    return align if ok else None


def _quantile_balancing_rules(r: Reader, *, k: int, n: int, tokens: int | None) -> bool:
    """Router.quantile_balancing and qb_dual_update (megatron-core 0.19.2 router.py, moe_utils.py) assert
    these at the first forward; each broken one is an error naming the flag. Returns whether all hold."""
    ok = True
    if r.bool_arg("moe_router_fusion", False):
        r.fail("moe_router_fusion", "does not work with quantile_balancing routing (Router.quantile_balancing)")
        ok = False
    if r.get("moe_router_num_groups") is not None or r.get("moe_router_group_topk") is not None:
        r.fail("moe_router_num_groups", "group-limited routing does not work with quantile_balancing routing")
        ok = False
    if tokens and (tokens * k) % n:
        # qb_dual_update: the logits gathered over TP x CP (s x b rows) times top-k must split evenly over E
        r.fail("moe_router_topk", f"quantile_balancing needs (sequence x micro-batch) x top-k = {tokens:,} x {k} "
                                  f"divisible by --num-experts {n} (qb_dual_update)")
        ok = False
    return ok


def _fused_shared_expert_rules(r: Reader, *, before_019: bool, precision: Mapping[str, Any]) -> bool:
    """FusedSharedExpertMLP (megatron-core 0.19.2 transformer/moe/shared_experts.py) checks these when it
    is built or at its first forward: TE, a SwiGLU, the GLU interleave size, and an MXFP8 or NVFP4 recipe
    (its fused kernel runs under one). Returns whether all hold."""
    key = "use_grouped_gemm_for_shared_expert"
    if before_019:
        r.fail(key, "needs megatron-core >= 0.19 (the option came with 0.19.0)")
        return False
    ok = True
    if precision.get("transformer_impl", "transformer_engine") != "transformer_engine":
        r.fail(key, "needs --transformer-impl transformer_engine (FusedSharedExpertMLP runs TE ops)")
        ok = False
    if not precision.get("swiglu"):
        r.fail(key, "needs a SwiGLU activation (--swiglu; FusedSharedExpertMLP's fused kernel)")
        ok = False
    if r.get("moe_shared_expert_glu_interleave_size") is None:
        r.fail(key, "needs --moe-shared-expert-glu-interleave-size (FusedSharedExpertMLP)")
        ok = False
    mxfp8 = precision.get("fp8") and precision.get("fp8_recipe") == "mxfp8"
    nvfp4 = precision.get("fp4") and precision.get("fp4_recipe") == "nvfp4"
    if not (mxfp8 or nvfp4):
        r.fail(key, "needs --fp8-recipe mxfp8 or --fp4-recipe nvfp4 (FusedSharedExpertMLP's fused kernel runs under one)")
        ok = False
    return ok


def moe(a: Args, kw: Mapping[str, Any], ctx: Context) -> dict[str, Any]:
    """The ``moe`` part (None for a dense model) and the expert-parallel sizes of the parallel part."""
    tp = kw["tensor_model_parallel_size"]
    spec = read_moe(a, num_layers=kw["num_layers"], ffn_hidden_size=kw["ffn_hidden_size"], tp=tp,
                    pp=kw["pipeline_model_parallel_size"], world_size=kw["world_size"],
                    sequence_parallel=kw["sequence_parallel"], add_bias_linear=kw["add_bias_linear"],
                    recompute_modules=tuple(kw.get("recompute_modules") or ()),
                    recompute_granularity=kw.get("recompute_granularity"),
                    vpp=kw.get("virtual_pipeline_model_parallel_size"), recompute_method=kw.get("recompute_method"),
                    recompute_num_layers=kw.get("recompute_num_layers"),
                    half=bool(kw.get("bf16") or kw.get("fp16")), legacy=ctx.legacy,
                    before_019=ctx.version < Version("0.19"), before_017=ctx.version < Version("0.17"),
                    tokens=kw["seq_length"] * kw["micro_batch_size"], precision=kw)
    hybrid = kw.get("hybrid_layer_pattern")
    if spec is not None and hybrid:
        # a hybrid stack's 'E' layers are its MoE layers (--moe-layer-freq does not apply), built from
        # get_moe_module_spec(use_te=True, moe_grouped_gemm=True) whatever --moe-grouped-gemm says
        # (models/hybrid/hybrid_layer_specs.py 0.19.2, models/mamba/mamba_layer_specs.py 0.16.1)
        import dataclasses
        spec = dataclasses.replace(spec, moe_layer_pattern=tuple(sym == "E" for sym in hybrid if sym != "|"),
                                   moe_grouped_gemm=True)
    if spec is None:
        for dest in ("delay_wgrad_compute", "ep_overlap_early_attn_memory_release"):
            if not a.get("num_experts") and a.bool_arg(dest, False):
                a.fail(dest, "needs --overlap-moe-expert-parallel-comm (which needs experts)")
        return dict(moe=None, expert_model_parallel_size=1, expert_tensor_parallel_size=None)
    spec = _upcycling(a, kw, ctx, spec)
    lbt = spec.moe_router_load_balancing_type
    if "quantile_balancing" in lbt.split(",") and lbt != "quantile_balancing":
        # TopKRouter compares the type to the string: in a list it registers no QB state and routes by top-k
        a.notes.append(f"{a.key('moe_router_load_balancing_type')}: quantile_balancing in a list of types does not "
                       "route (TopKRouter applies it only as the single type, router.py 0.19.2): estimated as top-k")
    if (spec.use_fused_weighted_squared_relu and spec.moe_grouped_gemm and kw.get("squared_relu")
            and kw["add_bias_linear"]):
        # TEGroupedMLP.forward: "Bias is not supported with fused weighted squared relu." (core 0.19.2 experts.py)
        a.fail("use_fused_weighted_squared_relu", "does not work with biases", "add --disable-bias-linear")
    if spec.ep > 1 and not a.given("moe_token_dispatcher_type") and spec.moe_token_dispatcher_type == "allgather":
        # arguments.py (0.16.1, 0.19.2): --moe-token-dispatcher-type defaults to allgather; its buffers differ
        # from alltoall's and flex's (docs/terms/moe.md)
        a.notes.append("--moe-token-dispatcher-type not given: Megatron's default, allgather, is estimated (give "
                       "alltoall or flex if the run uses them)")
    inst = kw.get("num_distributed_optimizer_instances", 1) or 1
    edp = kw["world_size"] // (spec.etp * spec.ep * kw["pipeline_model_parallel_size"])
    if inst > 1 and edp % inst:
        # initialize_model_parallel (0.16.1 and 0.19.2): the expert DP group splits into the instances
        a.fail("num_distributed_optimizer_instances", f"{inst} must divide the expert data-parallel size {edp}")
        return dict(moe=None, expert_model_parallel_size=1, expert_tensor_parallel_size=None)
    if (kw.get("use_megatron_fsdp") and kw.get("outer_dp_sharding_strategy", "no_shard") != "no_shard"
            and ctx.version < Version("0.18")):
        # core 0.16.1 fails to build it on the CPU referee ("Data size mismatch"): its HSDP builds no expert
        # device mesh, so the experts get no outer group of their own; 0.18+ is sized (estimator/fsdp_layout.py)
        raise NotModelledError(a.key("outer_dp_sharding_strategy"),
                               f"experts under hybrid-sharded Megatron-FSDP with outer optimizer sharding in megatron-core "
                               f"{ctx.version} (no expert device mesh under HSDP; the CPU referee's 0.16.1 run fails "
                               "to build it)")
    if kw.get("use_megatron_fsdp") and spec.overlap_moe_expert_parallel_comm:
        before = len(a.errors)
        if ctx.version >= Version("0.19"):
            # MegatronFSDP adapter __init__ (mcore_fsdp_adapter.py, core 0.19.2) asserts both
            if a.bool_arg("fsdp_double_buffer", False):
                a.fail("fsdp_double_buffer", "cannot be used with --overlap-moe-expert-parallel-comm under Megatron-FSDP "
                                             "(\"1F1B overlap with FSDP does not support double buffer\")")
            graphs = str(a.get("cuda_graph_impl", "none") or "none")
            if graphs not in ("none", "full_iteration"):
                a.fail("cuda_graph_impl", f"{graphs[:20]} cannot be used with --overlap-moe-expert-parallel-comm under "
                                          "Megatron-FSDP (only none or full_iteration)")
            # the overlap schedule (model_chunk_schedule_plan.py TransformerLayerSchedulePlan.run) runs one layer's
            # forward and another layer's backward together; each sub-module gathers its own weights
            # (enable_fine_grained_param_gather_hook) and the schedule releases a layer's at the end of its pass
            # (set_fsdp_reshard_hooks): how many buckets are gathered at once depends on that interleaving.
            # Only optim_grads_params shards the compute weights: under no_shard / optim / optim_grads they are whole
            # on every rank (megatron_fsdp.py: "optim and optim_grads do not require FSDP units"), the adapter
            # builds no units and no backward unshard hooks, combined_1f1b.py wires no reshard hooks, and the
            # gradients reach their buckets through the per-parameter grad_acc hooks as without the overlap:
            # nothing is gathered, the estimate is the overlap's schedule over FSDP's buffers
            why = None
            if kw.get("data_parallel_sharding_strategy") == "optim_grads_params":
                why = ("the expert all-to-all overlap under Megatron-FSDP's optim_grads_params (the overlap schedule "
                       "holds a forward layer's and a backward layer's gathered weights at once, gathered per "
                       "sub-module: not sized; the no_shard / optim / optim_grads strategies, which gather no weights, "
                       "are)")
        else:
            # 0.16.1: the adapter installs no fine-grained hooks for the overlap and the schedule no release
            # hooks, while the schedule calls sub-modules directly (not TransformerLayer.forward, where the FSDP
            # unit's gather hook sits)
            why = (f"the expert all-to-all overlap under Megatron-FSDP in megatron-core {ctx.version} (its overlap "
                   "schedule bypasses the FSDP unit hooks; when weights are gathered is not read)")
        if len(a.errors) == before and why:   # (what Megatron stops on comes first)
            raise NotModelledError(a.key("overlap_moe_expert_parallel_comm"), why)
        if not why:
            a.notes.append(f"{a.key('overlap_moe_expert_parallel_comm')} under Megatron-FSDP's "
                           f"{kw.get('data_parallel_sharding_strategy')}: the compute weights are whole on every rank, "
                           "nothing is gathered per sub-module; estimated as the overlap's schedule over FSDP's buffers")
    if kw.get("use_megatron_fsdp"):
        a.notes.append(f"{a.key('use_megatron_fsdp')} with experts: after the step memguard counts the expert groups' "
                       "fp32 gradient copies as Megatron's source keeps them (main_grad_copies); Megatron's CI run of "
                       "this combination holds less (docs/assumptions.md). The peak assumes balanced "
                       "routing (moe_layer_activations): that run (top-2, aux loss) peaks 6-9% above it, below the "
                       "worst-case bound")
    if a.bool_arg("moe_use_legacy_grouped_gemm", False):
        key = a.key("moe_use_legacy_grouped_gemm")
        if ctx.version >= Version("0.17"):
            # GroupedMLP and the option are gone from megatron-core 0.17.0 (experts.py, transformer_config.py)
            a.fail("moe_use_legacy_grouped_gemm", "needs megatron-core < 0.17 (GroupedMLP was removed in 0.17.0)")
        elif not spec.moe_grouped_gemm:
            a.notes.append(f"{key}: no effect without --moe-grouped-gemm (the experts are SequentialMLP)")
        elif str(a.get("optimizer", "adam")) in ("muon", "adaptive_muon", "dist_muon"):
            raise NotModelledError(key, "Muon over the legacy GroupedMLP's merged expert weights")
    op_fuser = experts_op_fuser(a, kw, spec, ctx)
    if op_fuser and spec.moe_router_padding_align:
        spec = replace(spec, moe_router_padding_align=router_padding_align(kw, op_fuser=True))
    return dict(moe=spec, expert_model_parallel_size=spec.ep, expert_tensor_parallel_size=spec.etp,
                use_transformer_engine_op_fuser=op_fuser)


def experts_op_fuser(a: Args, kw: Mapping[str, Any], spec: MoeSpec, ctx: Context) -> bool:
    """Whether a MoE model's experts run TE's fused grouped MLP (--use-transformer-engine-op-fuser).

    megatron-core 0.19.2: get_gpt_decoder_block_spec builds the dense layers of a MoE model without the
    op fuser, SequentialMLP (no --moe-grouped-gemm) never reads it, and TEGroupedMLP.__init__ asserts
    ``_is_fused_impl_supported()`` (transformer/moe/experts.py): expert TP 1, no expert_fc1 / moe_act offload,
    a GLU of SiLU or quick GELU with NVTE_CUTEDSL_FUSED_GROUPED_MLP > 0 (or the fused weighted squared
    ReLU, refused), TE >= 2.14. megatron-core 0.16.1 has no such path (no TransformerConfig field);
    0.17 was not read and is taken as 0.16."""
    if not kw.get("use_transformer_engine_op_fuser"):
        return False
    key = a.key("use_transformer_engine_op_fuser")
    if ctx.legacy or not spec.moe_grouped_gemm:
        a.notes.append(f"{key}: no effect on this MoE model (its dense layers and "
                       + ("megatron-core < 0.18's experts" if ctx.legacy else "SequentialMLP experts") + " do not use it)")
        return False
    rule = "the experts' fused grouped MLP (TEGroupedMLP._is_fused_impl_supported, megatron-core 0.19.2) needs "
    if spec.etp > 1:
        a.fail("use_transformer_engine_op_fuser", rule + f"expert tensor parallel size 1, got {spec.etp}")
    if spec.moe_apply_probs_on_input:
        a.fail("use_transformer_engine_op_fuser", rule + "no --moe-apply-probs-on-input")
    offloaded = a.get("offload_modules") or ()
    offloaded = set([offloaded] if isinstance(offloaded, str) else offloaded)
    if a.bool_arg("fine_grained_activation_offloading", False) and {"expert_fc1", "moe_act"} & offloaded:
        a.fail("use_transformer_engine_op_fuser", rule + "no expert_fc1 / moe_act in --offload-modules")
    if not kw["gated_linear_unit"] or kw["squared_relu"]:
        a.fail("use_transformer_engine_op_fuser", rule + "a SwiGLU or quick-GEGLU activation")
    else:
        from ..estimator.fp8_layers import cutedsl_fused_grouped_mlp
        if not cutedsl_fused_grouped_mlp(a.raw.env):
            a.fail("use_transformer_engine_op_fuser", rule + "NVTE_CUTEDSL_FUSED_GROUPED_MLP=1 in the environment "
                   "with a GLU activation")
    _quantized_fused_experts(a, kw, spec)
    return True


def _quantized_fused_experts(a: Args, kw: Mapping[str, Any], spec: MoeSpec) -> None:
    """The experts' fused grouped MLP under FP8 / FP4, by recipe (TE 2.20.2 ops/fused/grouped_mlp.py
    fuse_grouped_mlp_ops, ops/basic/grouped_linear.py is_op_fuser_grouped_tensor_path_supported), sized by
    estimator/fp8_layers.py fused_experts_overrides: MXFP8 with E4M3 gradients and NVFP4 with its Hadamard transform
    (the CuTe-DSL fused kernel, SM 10), delayed scaling (always the split-quantize GroupedLinear path), and tensorwise,
    blockwise and MXFP8 with --fp8-format hybrid, whose path depends on the GPU and the cuBLASLt version: the
    grouped-tensor path (the one that keeps more) is sized, and a note gives what the other keeps less. Refused:
    custom recipes (TE takes their quantizers from the factory, arbitrary Python)."""
    key = a.key("use_transformer_engine_op_fuser")
    if kw.get("fp4"):
        if kw.get("fp4_recipe", "nvfp4") != "nvfp4":
            raise NotModelledError(key, "the experts' fused grouped MLP under a custom FP4 recipe (TE takes its "
                                        "quantizers from the factory, Python code whose tensors are known only when "
                                        "it runs)")
        return
    if not kw.get("fp8"):
        return
    recipe = kw.get("fp8_recipe", "delayed")
    if recipe == "custom":
        raise NotModelledError(key, "the experts' fused grouped MLP under a custom FP8 recipe (TE takes its "
                                    "quantizers from the factory, Python code whose tensors are known only when it runs)")
    if recipe == "delayed" and a.bool_arg("moe_single_grouped_weight", False):
        # TE 2.20.2 ops/basic/grouped_linear.py fuser_forward: delayed scaling never takes the grouped-tensor path,
        # which single grouped parameters require (RuntimeError at the first forward)
        a.fail("moe_single_grouped_weight", "the experts' fused grouped MLP (--use-transformer-engine-op-fuser) under "
               "delayed scaling cannot use one grouped weight (Transformer Engine's grouped-tensor path has no delayed "
               "scaling)")
    if recipe == "delayed" or (recipe == "mxfp8" and kw.get("fp8") == "e4m3"):
        return
    # is_op_fuser_grouped_tensor_path_supported (TE 2.20.2): which GPUs and cuBLASLt versions take the grouped-tensor
    # path; the rest run _fuser_forward_split_quantize, which keeps the weight copies column-wise only
    where = {"tensorwise": "on Blackwell (SM 10.x, 11.0) with cuBLASLt >= 13.3 and on Hopper with cuBLASLt >= 13.5; "
                           "on other GPUs (Ada) or older cuBLASLt it takes the split-quantize path",
             "blockwise": "only on Hopper with cuBLASLt >= 13.6; on Blackwell, or older cuBLASLt, it takes the "
                          "split-quantize path (an estimate for a Blackwell --gpu sizes that path)",
             "mxfp8": "on Blackwell with cuBLASLt >= 13.3 (the CuTe-DSL fused kernel declines E5M2 gradients); with an "
                      "older cuBLASLt it takes the split-quantize path"}[recipe]
    if not spec.local_experts or kw.get("fp8_param_gather"):
        less = ""       # primary FP8 weights are used as they are: no per-forward copy on either path
    else:
        from ..estimator.fp8_layers import fused_experts_rowwise_weight_bytes
        b = fused_experts_rowwise_weight_bytes(recipe, local_experts=spec.local_experts,
                                               ffn=spec.moe_ffn_hidden_size // spec.etp,
                                               width=spec.moe_latent_size or kw["hidden_size"],
                                               glu=bool(kw["gated_linear_unit"]))
        less = (f"; the split-quantize path keeps {b / 2**20:,.2f} MiB ({b:,} B) less per MoE layer and micro-batch in flight (the row-wise "
                "data of the experts' weight copies" + (", Hopper storage; none on Blackwell, where one Float8 copy "
                                                        "serves both usages)" if recipe == "tensorwise" else ")"))
    single = (" --moe-single-grouped-weight needs the grouped-tensor path (a RuntimeError on the split-quantize one)."
              if a.bool_arg("moe_single_grouped_weight", False) else "")
    a.notes.append(f"{key}: the experts' GroupedLinear ops under the {recipe} recipe"
                   + (" with --fp8-format hybrid" if recipe == "mxfp8" else "")
                   + f" take Transformer Engine 2.20.2's grouped-tensor path {where}. memguard cannot see the cuBLASLt "
                   f"version and sizes the grouped-tensor path, which keeps each weight copy with both usages{less}."
                   + single)


def _deepep_instead(key: str) -> str:
    """The workaround for a refused HybridEP backend, spelled as the input spells the key: the DeepEP
    backend, which memguard models (same dispatcher, its own buffers)."""
    path = key.split(" (", 1)[0]
    if path.startswith("--"):
        return f"{path} deepep estimates the run with DeepEP"
    if path.startswith(("language_model.", "model_parallel.")):   # Megatron's --yaml-cfg file
        return f"{path}: deepep in the file estimates the run with DeepEP"
    return f"--set {path}=deepep estimates the run with DeepEP"
