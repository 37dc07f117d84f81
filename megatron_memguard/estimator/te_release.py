"""Which Transformer Engine release a run has, and the attention behaviour that follows from it.

megatron-core does not pin one TE: 0.16.1's ``dev`` extra asks for ``transformer-engine >=2.9.0a0,<2.12.0`` (the
newest it takes is 2.11), 0.19.2's ``te`` extra names no version. So memguard assumes, per core release, the TE it
was read against (``default_te_version``: 2.11 for core 0.16, 2.20.2 for later ones), and the run can say otherwise:
``MEMGUARD_TE_VERSION`` in its environment (a launch script's export, ``--env``, the shell of ``memguard
estimate``); inside a job the hook sets it from ``transformer_engine.__version__``.

What changes between the releases read (TE 2.11.0 to 2.20.2 wheels, ``attention/dot_product_attention``):

* 2.15.0 rewrote FP8 fused attention: the FP8 kernel keeps one fp32 softmax statistic per (token, head) instead of
  two (M and ZInv; ``cpp_extensions/fused_attn.py`` docstring "ZInv ... only allocated for T3HD path",
  ``context_parallel.py`` unpacks ``softmax_lse_per_step, rng_states = aux_ctx_tensors``); MXFP8 attention and
  ``NVTE_DPA_FP8_RECIPE=MXFP8BlockScaling`` appear; the CP ring casts its fp32 output to a BF16 ``out_part``
  before the all-to-all, and its backward exchanges dO alone (2.11 to 2.14.1: ``[out, dout]``); the all-gather
  CP path (``AttnFuncWithCPAndKVAllGather``) takes ``fp8`` and runs FP8 attention on FP8 q, k, v with the K/V
  gathered in FP8 (2.11 to 2.14.1: ``attn_forward_func_with_cp`` hands it no ``fp8``, the attention runs in BF16).
* 2.18: that all-gather forward also makes a zeroed BF16 output (``out = torch.zeros(o_shape, ...)``, THD's
  accumulator) whatever the format, alive to its end next to ``out_f16``.
* 2.20: the p2p ring keeps two K/V buffers and partial outputs (``p2p_comm_buffers = [None, None]``) instead of
  one per CP step (2.19.0 still keeps them all).
* 2.17: flash-attn 2 runs MLA on padded head dims (``_pad_qkv_head_dim``; 2.16.1 still drops it, "does not support
  MLA").
* The other attention-backend rules (estimator/attention_backend.py): the Python ones (determinism on Blackwell, a
  deterministic non-vanilla softmax) change at 2.12.0; the compiled cuDNN query was read in 2.11.0 and 2.20.2 only,
  and a release from 2.12 on is read with 2.20.2's.
"""
from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING, Mapping

if TYPE_CHECKING:   # (packaging is imported on first use: `import megatron_memguard` stays light)
    from packaging.version import Version

TE_VERSION_VAR = "MEMGUARD_TE_VERSION"
DPA_RECIPE_VAR = "NVTE_DPA_FP8_RECIPE"
TE_FOR_CORE_016 = "2.11"       # megatron-core 0.16.1 dev extra: transformer-engine <2.12.0
TE_FOR_LATER_CORES = "2.20.2"  # the release the later cores were read against

ONE_SOFTMAX_STAT_SINCE = "2.15"     # FP8 attention: one fp32 statistic (earlier: M and ZInv)
RING_OUT_PART_SINCE = "2.15"        # CP ring: the BF16 out_part, dO-only exchange
AG_FP8_SINCE = "2.15"               # CP all_gather: FP8 attention (earlier: BF16, no fp8 argument)
AG_OUT_ZEROS_SINCE = "2.18"         # CP all_gather: a BF16 ``out = torch.zeros(o_shape)`` (THD's) made for every format
RING_TWO_BUFFERS_SINCE = "2.20"     # CP ring: two K/V buffers / partial outputs in flight
BACKEND_RULES_2202_SINCE = "2.12"   # attention backend rules read in 2.20.2 (earlier: 2.11's)
MLA_FLASH_PAD_SINCE = "2.17"        # flash-attn 2 on MLA: head dims padded (earlier: flash dropped)

# NVTE_DPA_FP8_RECIPE (dot_product_attention.py, module level): "" (unset) keeps the autocast recipe
DPA_RECIPES = ("F16", "DelayedScaling", "Float8CurrentScaling", "MXFP8BlockScaling")


@lru_cache(maxsize=64)
def _version(text: str) -> Version | None:
    """``text`` as a version, None when it is none (cached: asked for per layer)."""
    from packaging.version import InvalidVersion, Version
    try:
        return Version(str(text).strip())
    except (InvalidVersion, ValueError):    # (a part of over 4,300 digits: int() refuses it with a ValueError)
        return None


def default_te_version(megatron_version: str) -> str:
    """The TE memguard assumes for a megatron-core release (its pin, or the release it was read against)."""
    v = _version(megatron_version)
    return TE_FOR_CORE_016 if v is not None and v < _version("0.17") else TE_FOR_LATER_CORES


def te_version_problem(text: str) -> str | None:
    """The rule ``MEMGUARD_TE_VERSION=text`` breaks, or None."""
    v = _version(text)
    if v is None or not str(text).strip()[:1].isdigit():
        return f"expects a Transformer Engine release such as 2.14.1, got {text!r}"
    if v.major < 2:
        return (f"expects Transformer Engine 2.x (megatron-core 0.16.1 asks for 2.9 or later), got {text!r}")
    return None


def te_version_text(env: Mapping[str, str], megatron_version: str) -> str:
    """The run's TE release as text: ``MEMGUARD_TE_VERSION`` when valid (resolve reports a bad one), else the
    core release's default."""
    given = str(env.get(TE_VERSION_VAR, "")).strip()
    if given and te_version_problem(given) is None:
        return given
    return default_te_version(megatron_version)


def te_at_least(env: Mapping[str, str], megatron_version: str, since: str) -> bool:
    """Whether the run's TE (``te_version_text``) is release ``since`` or later."""
    return _version(te_version_text(env, megatron_version)) >= _version(since)


def fp8_softmax_stats(env: Mapping[str, str], megatron_version: str) -> int:
    """fp32 softmax statistics per (token, head) the FP8 (delayed / tensorwise) kernel keeps: M and ZInv up to TE
    2.14.1, one from 2.15.0."""
    return 1 if te_at_least(env, megatron_version, ONE_SOFTMAX_STAT_SINCE) else 2


def dpa_recipe_problem(value: str) -> str | None:
    """The rule ``NVTE_DPA_FP8_RECIPE=value`` breaks, or None (TE itself ignores an unknown value silently)."""
    if value == "" or value in DPA_RECIPES:
        return None
    return f"must be one of {', '.join(DPA_RECIPES)} or unset (Transformer Engine's names, as written), got {value!r}"


def attention_recipe(linear: str | None, env: Mapping[str, str], megatron_version: str) -> str | None:
    """The recipe FP8 attention runs in (delayed | tensorwise | mxfp8; another linear recipe when the variable does
    not switch it: resolve/fp8.py refuses or drops those), None for BF16 attention, given the layer's
    linear recipe and ``NVTE_DPA_FP8_RECIPE`` (TE ``DotProductAttention.init_fp8_metadata``, 2.11 and 2.20.2: the
    attention's quantizers follow ``fp8_meta["local_recipes"][0]``). The switch keeps the linear recipe's fp8_dpa:
    with fp8_dpa off (recipes megatron-core builds without it) nothing changes. A bad value acts as unset here
    (resolve reports it)."""
    if linear is None:
        return None
    value = str(env.get(DPA_RECIPE_VAR, ""))
    new = te_at_least(env, megatron_version, ONE_SOFTMAX_STAT_SINCE)   # 2.15: MXFP8 attention and its branches
    if value == "F16":
        return None                                       # fp8_dpa = fp8_mha = False
    if value == "DelayedScaling" and (linear in ("tensorwise", "nvfp4") or (linear == "mxfp8" and new)):
        return "delayed"
    if value == "Float8CurrentScaling" and (linear in ("delayed", "tensorwise", "nvfp4")
                                            or (linear == "mxfp8" and new)):
        return "tensorwise"                               # CS for QKV, O, dO, dQKV (DS for S, dP: no tensor kept)
    if value == "MXFP8BlockScaling" and new and linear in ("delayed", "tensorwise", "nvfp4", "mxfp8"):
        return "mxfp8"
    return linear                                         # unset (or not a switch for this recipe): the linear one


def te_env_problems(env: Mapping[str, str]) -> list[tuple[str, str]]:
    """(variable, rule) for each bad ``MEMGUARD_TE_VERSION`` / ``NVTE_DPA_FP8_RECIPE`` in a run's environment."""
    out = []
    if str(env.get(TE_VERSION_VAR, "")).strip():       # (set empty: unset, the core release's default)
        rule = te_version_problem(str(env[TE_VERSION_VAR]))
        if rule:
            out.append((TE_VERSION_VAR, rule))
    if DPA_RECIPE_VAR in env:
        rule = dpa_recipe_problem(str(env[DPA_RECIPE_VAR]))
        if rule:
            out.append((DPA_RECIPE_VAR, rule))
    return out
