"""The layouts of Megatron CI's MoE records on the CPU referee, as data: each a record's flags (GPT-2 shape, its experts,
routing, TP / EP / ETP) on fewer layers and at most 4 ranks, and ``settings_of``, the worker settings memguard
resolves from them (the runner: moe_ci_layouts.py, whose docstring tells why these layouts).

No torch, no megatron, no process: the runner and the tests that read the definitions import this.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional

from .dense import COMMON, resolve_config
from .moe import moe_settings

# The records' GPT-2 shape (model_args of gpt3_mcore_*_8experts2parallel_* / *_4experts2parallel*) and the
# GPT-2 vocabulary size (NullTokenizer adds the EOD token: 50258, padded like 50257 for TP <= 4). Dropout
# stays off (COMMON) although the records keep Megatron's 0.1: on CPU, torch's dropout keeps its mask in
# the activation dtype (`empty_like(x).bernoulli_()`), on a GPU `native_dropout` keeps a bool mask, so a
# CPU run with dropout holds 1 byte per masked element more than the GPU. Measured with dropout 0.1:
# ci_tp2_ep2_e8_sinkhorn 75.2 MiB over the estimate (attention 4 x 16 MiB, hidden 4 x 2 x 1 MiB, embedding
# 1 MiB: 73 MiB), ci_tp4_ep2_etp2_e4_sinkhorn 36.1 MiB and ci_tp4_dense 36.7 MiB (36.5 MiB by the same count):
# the MoE layers add nothing there either.
CI_BASE = [
    "--num-layers", "4", "--hidden-size", "512", "--num-attention-heads", "8",
    "--seq-length", "1024", "--max-position-embeddings", "1024", "--micro-batch-size", "4",
    "--vocab-size", "50257", "--disable-bias-linear", "--bf16",
]

SINKHORN_TOP1 = ["--moe-router-load-balancing-type", "sinkhorn", "--moe-router-topk", "1"]


def _ci(name: str, record: str, world_size: int, dense: List[str], moe: List[str]) -> Dict[str, Any]:
    dense_flags = COMMON + CI_BASE + dense
    return {"name": name, "world_size": world_size, "flags": dense_flags + moe, "dense_flags": dense_flags,
            "moe_flags": moe, "ci": False, "note": f"layout of {record}", "requires": [], "record": record}


CI_LAYOUTS: List[Dict[str, Any]] = [
    # gpt3_mcore_te_tp2_pp1_te_8experts2parallel_{ddp_average_in_collective,overlap_grad_reduce_...}:
    # TP2 SP, EP2, ETP = TP = 2 (allgather over TP x EP = 4 ranks), 8 experts; DP2 instead of DP4
    _ci("ci_tp2_ep2_e8_sinkhorn", "gpt3_mcore_te_tp2_pp1_te_8experts2parallel_*", 4,
        ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--global-batch-size", "16"],
        ["--num-experts", "8", "--expert-model-parallel-size", "2"] + SINKHORN_TOP1),
    # gpt3_mcore_tp2_pp2_ep2_etp2_te_4experts2parallel: TP4 SP, EP2, ETP2, 4 experts; PP1 instead of PP2
    _ci("ci_tp4_ep2_etp2_e4_sinkhorn", "gpt3_mcore_tp2_pp2_ep2_etp2_te_4experts2parallel", 4,
        ["--tensor-model-parallel-size", "4", "--sequence-parallel", "--global-batch-size", "8"],
        ["--num-experts", "4", "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "2"]
        + SINKHORN_TOP1),
    # the same layout without experts: what the caching allocator does with a dense run of these shapes
    _ci("ci_tp4_dense", "ci_tp4_ep2_etp2_e4_sinkhorn without experts", 4,
        ["--tensor-model-parallel-size", "4", "--sequence-parallel", "--global-batch-size", "8"], []),
]


def settings_of(entry: Dict[str, Any], iterations: int = 3, allocation_log: Optional[str] = None) -> Dict[str, Any]:
    if entry["moe_flags"]:
        s = moe_settings(entry)[1]
    else:
        s = resolve_config(entry["flags"], entry["world_size"])[1]
    s["num_iterations"] = iterations  # iteration 3 reuses blocks cached in iteration 2
    if allocation_log:
        s["referee_allocation_log"] = os.path.join(allocation_log, entry["name"])
    return s
