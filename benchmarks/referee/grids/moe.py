"""The referee's mixture-of-experts grid, as data: MoE GPT command lines (the dense grid's COMMON flags plus a small
Llama-style base) whose MoE flags are kept apart in ``moe_flags``, and ``moe_settings``, the worker settings memguard
resolves from them.

No torch, no megatron, no process: the runner (moe_grid.py) and the tests that read the definitions import this.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from .dense import COMMON, named, resolve_config

# A small Llama-style model: 4 layers, hidden 256, 8 heads (4 KV groups), SwiGLU, RMSNorm, RoPE, no
# biases (shared experts refuse biases), untied; s=256, b=2.
MOE_BASE = [
    "--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8",
    "--group-query-attention", "--num-query-groups", "4",
    "--seq-length", "256", "--max-position-embeddings", "256",
    "--micro-batch-size", "2", "--global-batch-size", "8",
    "--vocab-size", "8000", "--make-vocab-size-divisible-by", "128",
    "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
    "--disable-bias-linear", "--untie-embeddings-and-output-weights",
    "--bf16",
]

# 4 experts of width 512 (ffn_hidden_size of the dense layers stays Megatron's SwiGLU default 640),
# top-2, EP2, the default dispatcher (allgather), dropless, no aux loss.
MOE_DEFAULT = [
    "--num-experts", "4", "--moe-ffn-hidden-size", "512", "--moe-router-topk", "2",
    "--expert-model-parallel-size", "2",
]


def _moe(name: str, world_size: int, moe: List[str], dense: Optional[List[str]] = None, note: str = "",
         drop_common: tuple = ()):
    """A grid entry: COMMON + MOE_BASE + dense overrides, and the MoE flags (later flags win)."""
    common = [f for f in COMMON if f not in drop_common]
    dense_flags = common + MOE_BASE + list(dense or [])
    moe_flags = MOE_DEFAULT + list(moe)
    return {"name": name, "world_size": world_size, "flags": dense_flags + moe_flags,
            "dense_flags": dense_flags, "moe_flags": moe_flags, "ci": False, "note": note, "requires": []}


MOE_GRID: List[Dict[str, Any]] = [
    _moe("moe_ep1_e4", 1, ["--expert-model-parallel-size", "1", "--moe-token-dispatcher-type", "alltoall"],
         ["--global-batch-size", "4"], note="4 local experts on one rank (sort_chunks path of alltoall)"),
    _moe("moe_ep2_allgather", 2, [], note="EP2 = DP2, allgather dispatcher (the default)"),
    _moe("moe_ep2_alltoall", 2, ["--moe-token-dispatcher-type", "alltoall"]),
    # TransformerConfig (0.16.1) refuses top-1 with the softmax score function unless pre-softmax
    _moe("moe_ep2_top1", 2, ["--moe-token-dispatcher-type", "alltoall", "--moe-router-topk", "1",
                             "--moe-router-pre-softmax"], note="top-1 (needs --moe-router-pre-softmax)"),
    _moe("moe_ep2_aux_zloss", 2, ["--moe-token-dispatcher-type", "alltoall", "--moe-aux-loss-coeff", "1e-2",
                                  "--moe-z-loss-coeff", "1e-3"], note="aux loss and z-loss on"),
    _moe("moe_ep2_router_fp32", 2, ["--moe-token-dispatcher-type", "alltoall", "--moe-router-dtype", "fp32"]),
    _moe("moe_ep2_router_fp32_allgather", 2, ["--moe-router-dtype", "fp32"]),
    _moe("moe_ep2_shared", 2, ["--moe-token-dispatcher-type", "alltoall",
                               "--moe-shared-expert-intermediate-size", "384"]),
    _moe("moe_ep2_shared_jitter", 2, ["--moe-token-dispatcher-type", "alltoall",
                                      "--moe-shared-expert-intermediate-size", "384", "--moe-input-jitter-eps", "0.01"],
         note="the router's input jitter (noise and jittered input kept) beside shared experts"),
    _moe("moe_ep2_shared_gate", 2, ["--moe-token-dispatcher-type", "alltoall",
                                    "--moe-shared-expert-intermediate-size", "384", "--moe-shared-expert-gate"]),
    _moe("moe_ep2_shared_overlap", 2, ["--moe-token-dispatcher-type", "alltoall",
                                       "--moe-shared-expert-intermediate-size", "384", "--moe-shared-expert-overlap"],
         note="shared experts overlapped with the dispatch (TP 1: nothing gathered apart)"),
    _moe("moe_tp2_sp_ep2_shared_overlap", 4, ["--moe-token-dispatcher-type", "alltoall",
                                              "--moe-shared-expert-intermediate-size", "384",
                                              "--moe-shared-expert-overlap"],
         ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--global-batch-size", "4"],
         note="shared-expert overlap under TP2 SP: the shared experts' own all-gather of the input"),
    _moe("moe_pp2_freq2", 4, ["--moe-token-dispatcher-type", "alltoall", "--moe-layer-freq", "2"],
         ["--pipeline-model-parallel-size", "2"], note="--moe-layer-freq 2 over PP2: each stage one MoE, one dense"),
    _moe("moe_ep2_dense_first", 2, ["--moe-token-dispatcher-type", "alltoall",
                                    "--moe-layer-freq", "([0]*1+[1]*3)"], note="first layer dense"),
    _moe("moe_ep2_swiglu_fusion", 2, ["--moe-token-dispatcher-type", "alltoall"],
         drop_common=("--no-bias-swiglu-fusion",),
         note="weighted SwiGLU fusion on (emulated fused kernel, the GPU default)"),
    _moe("moe_ep2_capacity_pad", 2, ["--moe-token-dispatcher-type", "alltoall", "--moe-expert-capacity-factor",
                                     "1.0", "--moe-pad-expert-input-to-capacity"],
         note="drop-and-pad: N fixed by the capacity"),
    _moe("moe_ep2_a2a_overlap", 2, ["--moe-token-dispatcher-type", "alltoall", "--overlap-moe-expert-parallel-comm"],
         note="combined 1F1B expert all-to-all overlap (2 micro-batches; CUDA streams are no-ops on CPU)"),
    _moe("moe_ep2_a2a_overlap_recompute_moe", 2,
         ["--moe-token-dispatcher-type", "alltoall", "--overlap-moe-expert-parallel-comm"],
         ["--recompute-granularity", "selective", "--recompute-modules", "core_attn", "moe"],
         note="the overlap with 'moe' recompute (0.16 allows it): the peak equals core_attn alone"),
    _moe("moe_ep2_recompute_shared", 2, ["--moe-token-dispatcher-type", "alltoall",
                                         "--moe-shared-expert-intermediate-size", "384"],
         ["--recompute-granularity", "selective", "--recompute-modules", "shared_experts"],
         note="shared experts recomputed (their checkpoint keeps the norm output the router keeps anyway)"),
    _moe("moe_ep2_recompute_moe", 2, ["--moe-token-dispatcher-type", "alltoall"],
         ["--recompute-granularity", "selective", "--recompute-modules", "core_attn", "moe"]),
    _moe("moe_tp2_sp_ep2", 4, ["--moe-token-dispatcher-type", "alltoall"],
         ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--global-batch-size", "4"],
         note="TP2+SP, EP2, ETP = TP = 2: expert grid 2x2, EDP 1"),
    _moe("moe_tp2_sp_ep2_etp1", 4, ["--moe-token-dispatcher-type", "alltoall",
                                    "--expert-tensor-parallel-size", "1"],
         ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--global-batch-size", "4"],
         note="TP2+SP, EP2, ETP1: EDP 2"),
    _moe("moe_ep2_etp2", 4, ["--moe-token-dispatcher-type", "alltoall", "--expert-tensor-parallel-size", "2"],
         note="TP1, EP2, ETP2 > TP: expert grid 2x2, EDP 1, DP 4 (the tokens gathered over the ETP group)"),
    _moe("moe_tp2_sp_ep2_allgather", 4, [],
         ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--global-batch-size", "4"],
         note="allgather over the TPxEP group"),
    _moe("moe_pp2_ep2", 4, ["--moe-token-dispatcher-type", "alltoall"],
         ["--pipeline-model-parallel-size", "2", "--global-batch-size", "8"], note="PP2 DP2 EP2, 2 micro-batches"),
    _moe("moe_pp2_vpp2_a2a_overlap", 4,
         ["--moe-token-dispatcher-type", "alltoall", "--overlap-moe-expert-parallel-comm"],
         ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
          "--global-batch-size", "16"],
         note="combined 1F1B under PP2 x VPP2 (DP2, EP2, 4 micro-batches): the schedule's own tensors"),
    _moe("moe_pp2_vpp2_a2a_overlap_mb6", 4,
         ["--moe-token-dispatcher-type", "alltoall", "--overlap-moe-expert-parallel-comm"],
         ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
          "--global-batch-size", "24"],
         note="the same with 6 micro-batches: a steady phase of 4 combined steps on the first stage, 2 on the last"),
    _moe("moe_pp2_vpp2_a2a_overlap_mb2", 4,
         ["--moe-token-dispatcher-type", "alltoall", "--overlap-moe-expert-parallel-comm"],
         ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
          "--global-batch-size", "8"],
         note="the same with 2 micro-batches: the warm-up takes every forward, every backward runs alone"),
    _moe("moe_pp2_vpp2_l2_a2a_overlap", 4,
         ["--moe-token-dispatcher-type", "alltoall", "--overlap-moe-expert-parallel-comm"],
         ["--num-layers", "8", "--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "2",
          "--global-batch-size", "16"],
         note="combined 1F1B under PP2 x VPP2 with 2-layer chunks (8 layers, 4 micro-batches): the layers' overlap order"),
    _moe("moe_pp2_vpp2_l2_mixed_a2a_overlap", 4,
         ["--moe-token-dispatcher-type", "alltoall", "--overlap-moe-expert-parallel-comm", "--moe-layer-freq",
          "([0,1]*4)"],
         ["--num-layers", "8", "--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "2",
          "--global-batch-size", "16"],
         note="the same with each chunk a dense layer then an MoE layer (--moe-layer-freq)"),
    # (stored in benchmarks/results/referee-moe-combined-vpp.json, not referee-moe-measured.json: moe_check.py's hand
    # rows skip the combined schedule under PP, and tests/test_referee_moe_check.py wants every stored rank checked)
    _moe("moe_dp4_ep2_distopt", 4, ["--moe-token-dispatcher-type", "alltoall"],
         ["--use-distributed-optimizer", "--global-batch-size", "8"],
         note="distributed optimizer: dense state over DP4, expert state over EDP2"),
]

# MoeSpec fields that are not Megatron arguments (memguard's own bookkeeping).
_NOT_ARGS = ("moe_layer_pattern", "moe_recompute", "routing", "moe_flex_dispatcher_num_sms")


def moe_settings(entry: Dict[str, Any], megatron_version: Optional[str] = None) -> tuple:
    """Worker settings for an MoE entry: the flags resolved by memguard itself (its MoE section applies
    validate_args's MoE rules: ETP = TP, moe_ffn_hidden_size = ffn_hidden_size, --moe-layer-freq as a
    per-layer list), written back as Megatron's flat argument names for the worker."""
    layout, settings = resolve_config(entry["flags"], entry["world_size"],
                                      **({"megatron_version": megatron_version} if megatron_version else {}))
    moe = settings.pop("moe")
    settings.update({k: v for k, v in moe.items() if k not in _NOT_ARGS})
    settings["moe_layer_freq"] = [int(v) for v in moe["moe_layer_pattern"]]
    settings["expert_data_parallel_size"] = layout.world_size // (
        layout.moe.etp * layout.moe.ep * layout.pipeline_model_parallel_size)
    return layout, settings


def select(only: Optional[List[str]] = None) -> List[Dict[str, Any]]:
    return named(MOE_GRID, only)
