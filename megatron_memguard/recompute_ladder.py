"""The recomputation ladder autotune climbs: selective ``--recompute-modules`` sets, cheapest per byte first,
then full uniform recomputation of every layer.

A Megatron MoE user first recomputes the cheap pieces that hold many bytes (the norms and the expert
activation function, then MLA's up-projections and the shared experts) before the whole MoE block or the
whole layer. Each module's place is its extra forward work divided by the bytes it frees, both memguard's
own figures:

* bytes: the job's peak (the largest stage peak) with the module added to the rungs below, against the
  peak without it; the ladder is built greedily, so a module that only helps a stage that is not the
  critical one (``mlp`` on the stage holding DeepSeek-V3's dense layers) waits until that stage is;
* work: the forward FLOPs per token of the recomputed part over the layers it applies to (``_flops``
  below; Megatron's module semantics from TransformerConfig.recompute_modules' docstring, megatron-core
  0.16.1 and 0.19.2). The norms and the activation function are element-wise: counted at one FLOP per
  element read, negligible next to a GEMM, so they come first whenever they free anything.

A module is a candidate only when Megatron accepts it for this job: resolve() applies the rules
(``moe_act`` needs grouped GEMM and is refused with delayed FP8 scaling like ``layernorm``; ``mla_up_proj``
needs MLA; ``shared_experts`` not with ``--moe-shared-expert-overlap``; ``moe`` not with
``--overlap-moe-expert-parallel-comm``; no recompute inside a CUDA graph with dropout or around TE's
``moe_router`` graph: resolve/runtime.py ``graphed_recompute``),
and a module that frees nothing (``moe_act`` on a dense model, ``core_attn`` under a fused attention kernel
that saves no scores) is left out. Each rung adds one module
to the previous rung's set; ``moe`` replaces ``moe_act`` and ``shared_experts`` (its checkpoint wraps the
whole MoE block, so the inner checkpoints would only recompute twice). Full recomputation is the last
rung unless Megatron refuses it for the run (autotune decides that).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from .layout import Layout

# The modules both megatron-core 0.16.1 and 0.19.2 accept (TransformerConfig.__post_init__'s allowed set;
# 0.19.2's gdn_norm_out belongs to the gated-delta-net attention variant memguard does not model).
LADDER_MODULES = ("layernorm", "moe_act", "core_attn", "mla_up_proj", "shared_experts", "mlp", "moe")
# 'moe' checkpoints the whole MoE block: the finer MoE checkpoints inside it are dropped when it is added.
_SUBSUMED_BY_MOE = ("moe_act", "shared_experts")


@dataclass(frozen=True)
class Rung:
    """One step of the ladder: the selective module set, and why each module earned its place."""

    modules: tuple[str, ...]
    added: str                 # the module this rung adds
    saved_bytes: int           # what adding the module takes off the job's peak (the largest stage peak)
    flops_per_token: float     # its extra forward FLOPs per token (all layers it applies to)

    def updates(self) -> dict[str, Any]:
        return {"recompute_granularity": "selective", "recompute_modules": list(self.modules),
                "recompute_method": None, "recompute_num_layers": None}


def _flops(L: Layout, module: str) -> float:
    """Forward FLOPs per token of ``module`` summed over the layers it applies to (2 per multiply-add;
    element-wise ops at one per element)."""
    h, n = L.hidden_size, L.num_layers
    moe = L.moe
    n_moe = moe.num_moe_layers if moe is not None else 0
    n_dense = n - n_moe
    gated = 3 if (L.swiglu or L.gated_linear_unit) else 2         # fc1 doubles for a gated unit
    heads = L.num_attention_heads
    if module == "layernorm":
        return 2.0 * h * n                                          # input and pre-MLP norm
    if module == "moe_act":
        return float(moe.moe_router_topk * moe.moe_ffn_hidden_size * 2 * n_moe) if moe else 0.0
    if module == "core_attn":
        if L.multi_latent_attention:
            qk, v = L.qk_head_dim + L.qk_pos_emb_head_dim, L.v_head_dim
        else:
            qk = v = L.kv_channels
        # QK^T and PV over the causal half of the sequence (per token of the model, before CP splits it)
        return 2.0 * heads * (qk + v) * (L.seq_length / 2) * n
    if module == "mla_up_proj":
        qk = L.qk_head_dim + L.qk_pos_emb_head_dim
        q_in = L.q_lora_rank if L.q_lora_rank else h
        return 2.0 * (q_in * heads * qk + L.kv_lora_rank * heads * (L.qk_head_dim + L.v_head_dim)) * n
    if module == "mlp":
        return 2.0 * gated * h * L.ffn_hidden_size * n_dense
    if module == "shared_experts":
        fs = (moe.moe_shared_expert_intermediate_size or 0) if moe else 0
        return 2.0 * gated * h * fs * n_moe
    if module == "moe":
        fs = moe.moe_shared_expert_intermediate_size or 0
        routed = moe.moe_router_topk * moe.moe_ffn_hidden_size
        return 2.0 * (gated * h * (routed + fs) + h * moe.num_experts) * n_moe   # experts + router
    raise KeyError(module)


def _with(mods: tuple[str, ...], m: str) -> tuple[str, ...]:
    if m == "moe":
        mods = tuple(x for x in mods if x not in _SUBSUMED_BY_MOE)
    return (*mods, m)


def ladder(L0: Layout, peaks: Callable[[dict[str, Any]], tuple[int, ...] | str]) -> tuple[tuple[Rung, ...], tuple[str, ...]]:
    """The selective rungs for a job at layout ``L0`` (weakest first) and notes on the modules left out.

    ``peaks(updates)`` estimates the job with the argument updates and returns each stage's device peak,
    or the rule Megatron would break (a string). Greedy: each rung adds the module with the least extra
    forward work per byte it takes off the job's peak (the largest stage peak) given the rungs below it,
    so a module that only helps a stage that is not the critical one waits until that stage is."""
    def sel(mods: tuple[str, ...]) -> dict[str, Any]:
        return {"recompute_granularity": "selective", "recompute_modules": list(mods),
                "recompute_method": None, "recompute_num_layers": None}

    base = tuple(L0.recompute_modules) if L0.recompute_granularity == "selective" else ()
    got = peaks(sel(base)) if base else peaks({})
    if isinstance(got, str):
        return (), (f"selective recomputation not tried: {got}",)
    top = max(got)
    # the modules Megatron accepts for this job, each alone on top of the base set
    pool: list[str] = []
    skipped_rule: list[str] = []
    for m in LADDER_MODULES:
        if m in base or (m in _SUBSUMED_BY_MOE and "moe" in base):
            continue
        if m in ("moe", "moe_act", "shared_experts") and L0.moe is None:
            continue
        if m == "mla_up_proj" and not L0.multi_latent_attention:
            continue
        alone = peaks(sel(_with(base, m)))
        if isinstance(alone, str):
            skipped_rule.append(f"{m} ({alone})")
        else:
            pool.append(m)
    notes = ("recompute modules not tried: " + "; ".join(skipped_rule),) if skipped_rule else ()
    rungs: list[Rung] = []
    mods = base
    while pool:
        best: tuple[float, int, str, int] | None = None
        for m in pool:
            after = peaks(sel(_with(mods, m)))
            saved = top - max(after) if not isinstance(after, str) else 0
            if saved > 0:
                key = (_flops(L0, m) / saved, LADDER_MODULES.index(m), m, saved)
                best = key if best is None or key < best else best
        if best is None:        # nothing left lowers the peak: full recomputation is the next step
            break
        _, _, m, saved = best
        mods = _with(mods, m)
        pool = [x for x in pool if x != m and not (m == "moe" and x in _SUBSUMED_BY_MOE)]
        top -= saved
        rungs.append(Rung(mods, m, saved, _flops(L0, m)))
    return tuple(rungs), notes
