"""The referee's Megatron-FSDP grid, as data: MoE grid entries (grids/moe.py) under Megatron-FSDP's flags, the one-rank
expert group, the MTP and overlap entries, and the worker settings memguard resolves from them for a megatron-core
release (``settings_of``, ``stored_rank_layouts``); the runner, fsdp_grid.py, tells what the worker does with them.

No torch, no megatron, no process: the runner and the tests that read the definitions import this.
"""

from __future__ import annotations

import json
from typing import Any, Dict, List, Optional, Tuple

from .dense import COMMON, REFEREE_MEGATRON_VERSION, named, resolve_config
from .moe import MOE_BASE, _moe, moe_settings
from .moe_ci import CI_BASE

FSDP = ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params",
        "--use-distributed-optimizer", "--ckpt-format", "fsdp_dtensor", "--global-batch-size", "8"]

ZP_Z3_MOE = ["--num-experts", "8", "--expert-model-parallel-size", "2", "--moe-router-topk", "2",
             "--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff", "0.01"]

FSDP_GRID: List[Dict[str, Any]] = [
    _moe("fsdp_moe_ep2", 4, ["--moe-token-dispatcher-type", "alltoall"], FSDP,
         note="optim_grads_params, DP 4, expert DP 2; 0.16.1 grads in fp32 (--accumulate-allreduce-grads-in-fp32)"),
    _moe("fsdp_moe_ep2_bf16_grads", 4, ["--moe-token-dispatcher-type", "alltoall"], FSDP + ["--grad-reduce-in-bf16"],
         note="bf16 gradient buckets: the step casts the shards to fp32 (main_grad_copies)"),
    _moe("fsdp_moe_ep2_hsdp", 4, ["--moe-token-dispatcher-type", "alltoall"],
         FSDP + ["--num-distributed-optimizer-instances", "2"],
         note="HSDP: 2 replicas, FSDP over 2 ranks (experts: 1), gradient shards all-reduced across replicas"),
    # the schedule shape and the topology of Megatron CI's zp_z3 record (moe/gpt3_mcore_te_tp2_zp_z3_..._top2router):
    # 2 micro-batches per iteration, the allgather dispatcher, top-2 aux-loss routing, bf16 gradient buckets
    _moe("fsdp_moe_ep2_2mb_allgather_aux", 4,
         ["--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff", "0.01"],
         FSDP + ["--grad-reduce-in-bf16", "--global-batch-size", "16"],
         note="2 micro-batches, allgather dispatcher, top-2 aux loss, bf16 gradient buckets"),
    _moe("fsdp_moe_tp2_sp_ep2_etp2_2mb", 8,
         ["--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff", "0.01"],
         FSDP + ["--grad-reduce-in-bf16", "--global-batch-size", "16", "--tensor-model-parallel-size", "2",
                 "--sequence-parallel"],
         note="zp_z3's topology: TP 2 + SP, EP 2, ETP = TP (expert DP 2), DP 4; 2 micro-batches, allgather, aux loss"),
    # zp_z3 in the record's own shapes (moe_ci_layouts.CI_BASE: hidden 512, 8 heads, seq 1024, micro-batch 4, GPT-2
    # vocabulary), 4 of its 12 layers: 8 experts top-2 aux loss, TP 2 + SP, EP 2, DP 4, 2 micro-batches
    {"name": "fsdp_zp_z3_shape", "world_size": 8, "ci": False, "requires": [],
     "flags": COMMON + CI_BASE + FSDP + ["--grad-reduce-in-bf16", "--global-batch-size", "32",
                                        "--tensor-model-parallel-size", "2", "--sequence-parallel"] + ZP_Z3_MOE,
     "dense_flags": COMMON + CI_BASE, "moe_flags": ZP_Z3_MOE,
     "note": "zp_z3's shapes and topology on 4 layers: TP 2 + SP, EP 2, 8 experts top-2 aux loss, DP 4, 2 micro-batches"},
    {"name": "fsdp_dense", "world_size": 4, "flags": COMMON + MOE_BASE + FSDP, "ci": False, "requires": [],
     "note": "the same model without experts: every group over DP 4"},
    {"name": "fsdp_dense_hfsdp", "world_size": 4, "ci": False, "requires": [],
     "flags": COMMON + MOE_BASE + FSDP + ["--num-distributed-optimizer-instances", "2", "--outer-dp-sharding-strategy",
                                         "optim"],
     "note": "HFSDP: weights and gradients over a replica's 2 ranks, main weights and Adam over all 4"},
    {"name": "fsdp_dense_optim_grads", "world_size": 4, "ci": False, "requires": [],
     "flags": COMMON + MOE_BASE + FSDP + ["--data-parallel-sharding-strategy", "optim_grads"],
     "note": "optim_grads: whole weights, no units, the group's full gradient bucket through the backward"},
]

# a one-rank expert group: EP 4 on 4 ranks leaves expert DP 1, whose model-weight buffer is not distributed (every
# release); its ranks' peaks follow their routing, so it is scored apart (tests/test_referee_fsdp_stored.py, stored in
# benchmarks/results/referee-fsdp-onerank-measured.json, both cores)
FSDP_ONE_RANK = _moe("fsdp_moe_ep4_onerank", 4, ["--moe-token-dispatcher-type", "alltoall",
                                                 "--expert-model-parallel-size", "4"], FSDP,
                     note="EP 4 on 4 ranks: expert DP 1 (one-rank expert FSDP group), no HSDP")

# --mtp-use-repeated-layer (core 0.17+; run on 0.19.2 only, stored in benchmarks/results/referee-fsdp-mtp-core019.json,
# tests/test_mtp_repeated.py): fsdp_moe_ep2 with 2 MTP depths, as 2 layers and as one layer applied twice (one unit)
FSDP_MTP = [
    _moe("fsdp_moe_ep2_mtp2", 4, ["--moe-token-dispatcher-type", "alltoall"], FSDP + ["--mtp-num-layers", "2"],
         note="fsdp_moe_ep2 with 2 MTP depths (2 MTP units)"),
    _moe("fsdp_moe_ep2_mtp2_repeated", 4, ["--moe-token-dispatcher-type", "alltoall"],
         FSDP + ["--mtp-num-layers", "2", "--mtp-use-repeated-layer"],
         note="one MTP layer (one unit) applied at both depths (core 0.17+)"),
]

# --overlap-moe-expert-parallel-comm under optim_grads (core 0.19.2 only, stored in
# benchmarks/results/referee-fsdp-overlap-core019.json, tests/test_fsdp_moe.py): whole weights, nothing gathered per
# sub-module; with and without the overlap (2 micro-batches per iteration: global batch 8 over DP 4)
_OPTIM_GRADS = [x if x != "optim_grads_params" else "optim_grads" for x in FSDP]
FSDP_OVERLAP = [
    _moe("fsdp_moe_ep2_optim_grads", 4, ["--moe-token-dispatcher-type", "alltoall"], _OPTIM_GRADS,
         note="optim_grads: whole weights, sharded gradients and optimizer state"),
    _moe("fsdp_moe_ep2_optim_grads_overlap", 4,
         ["--moe-token-dispatcher-type", "alltoall", "--overlap-moe-expert-parallel-comm"], _OPTIM_GRADS,
         note="the same with the combined 1F1B expert all-to-all overlap (CUDA streams are no-ops on CPU)"),
]

FSDP_ALL = FSDP_GRID + [FSDP_ONE_RANK] + FSDP_MTP + FSDP_OVERLAP   # every entry, in the stored files' order
for _c in FSDP_ALL:
    _c["requires"] = ["einops"]     # Megatron-FSDP's device-mesh helpers (mcore_fsdp_adapter.py)


def select(only: Optional[List[str]] = None) -> List[Dict[str, Any]]:
    return named(FSDP_ALL, only) if only else named(FSDP_GRID, only)


def resolve_version(core: str) -> str:
    """The Megatron version memguard resolves a grid entry's flags with, for the installed megatron-core
    release ``core`` (its defaults, its NullTokenizer): "0.16.1", or "0.19" for 0.19.2."""
    return REFEREE_MEGATRON_VERSION if core == REFEREE_MEGATRON_VERSION else ".".join(core.split(".")[:2])


def stored_rank_layouts(path: str, configs: List[Dict[str, Any]]) -> Tuple[str, Dict[str, Any], List[Tuple]]:
    """A stored measurement file of ``configs``: its megatron-core release, its ok configs by name, and per config
    and rank (config, rank record, memguard's layout of the config's flags under that release)."""
    with open(path) as f:
        res = json.load(f)
    core = res["environment"]["megatron_core"]
    by = {c["name"]: c for c in res["configs"] if c.get("status") == "ok"}
    if set(by) != {c["name"] for c in configs}:
        raise ValueError(f"{path}: holds {sorted(by)}, not the configs {sorted(c['name'] for c in configs)}")
    rows = []
    for cfg in configs:
        layout, _ = resolve_config(cfg["flags"], cfg["world_size"], resolve_version(core))
        rows += [(cfg, r, layout) for r in by[cfg["name"]]["ranks"]]
    return core, by, rows


def settings_of(entry: Dict[str, Any], core: str = REFEREE_MEGATRON_VERSION) -> Dict[str, Any]:
    """The worker settings of ``entry``: its flags resolved by memguard with the defaults of ``core``."""
    version = resolve_version(core)
    if entry.get("moe_flags"):
        return moe_settings(entry, version)[1]
    return resolve_config(entry["flags"], entry["world_size"], version)[1]
