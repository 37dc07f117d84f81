"""The layouts of Megatron CI's MoE records on the CPU referee (real megatron-core 0.16.1).

    python -m benchmarks.referee.moe_ci_layouts [--list] [--only NAME ...] [--out benchmarks/results/referee-moe-ci-layouts.json]
    python -m benchmarks.referee.moe_ci_layouts --compare [benchmarks/results/referee-moe-ci-layouts.json]

Megatron CI's MoE records (shared/groundtruth/megatron-functional-moe-dev.jsonl) with the allgather
dispatcher and sinkhorn top-1 routing peak 1.8-2.0% above memguard's estimate on every GPU
(docs/calibration.md, "The MoE under-count"). Each entry here runs one of those layouts as the record's
flags give it (GPT-2 shape: hidden 512, 8 heads, GeLU, LayerNorm, learned positions, tied embeddings,
seq 1024, micro-batch 4, dropout 0.1, no biases, bf16; experts, routing, TP / EP / ETP as the record),
with fewer layers and at most 4 ranks, the local spec (`SequentialMLP` experts) and the referee's usual
fusions-off flags. ``--compare`` sets memguard's estimate (``--device cpu``, profile local) of every
rank against the stored measurement. ``referee_allocation_log`` keeps every allocation for
``allocator_replay.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Dict, List, Optional

from .grid import COMMON, named, resolve_config, run_grid, save_results
from .moe_grid import moe_settings

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


def compare(path: str) -> List[str]:
    """One line per rank: measured peak and after-step bytes against memguard's estimate."""
    from .compare import compare_entry

    with open(path) as fh:
        res = json.load(fh)
    lines = []
    for e in res["configs"]:
        if e.get("status") != "ok":
            continue
        for c in compare_entry(e):
            lines.append(f"{e['name']} rank {c.rank}: peak {c.peak_measured:,} measured, {c.peak_predicted:,} "
                         f"estimated ({c.peak_err:+.2%}); after the step {c.after_err:+.2%}")
    return lines


def main(argv: Optional[List[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", nargs="*", default=None)
    p.add_argument("--list", action="store_true")
    p.add_argument("--out", default=None)
    p.add_argument("--allocation-log", default=None, help="directory for the per-rank allocation logs")
    p.add_argument("--compare", nargs="?", const="benchmarks/results/referee-moe-ci-layouts.json", default=None)
    p.add_argument("--timeout", type=float, default=3000.0)
    a = p.parse_args(argv)
    if a.compare:
        print("\n".join(compare(a.compare)))
        return
    cfgs = named(CI_LAYOUTS, a.only)
    if a.list:
        for c in cfgs:
            print(f"{c['name']:<32} ws={c['world_size']}  {c['note']}")
        return
    res = run_grid(cfgs, timeout=a.timeout, settings_of=lambda c: settings_of(c, allocation_log=a.allocation_log))
    import megatron.core
    import torch

    res["environment"] = {"torch": torch.__version__, "megatron_core": megatron.core.__version__}
    if a.out:
        save_results(res, a.out)
    if any(c["status"] != "ok" for c in res["configs"]):
        sys.exit(1)


if __name__ == "__main__":
    main()
