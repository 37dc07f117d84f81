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
import sys
from typing import List, Optional

from .grid import named, run_grid, save_results
from .grids.moe_ci import CI_BASE, CI_LAYOUTS, SINKHORN_TOP1, _ci, settings_of

# the definitions re-exported for the runners and tests that import them from here
__all__ = ["CI_BASE", "CI_LAYOUTS", "SINKHORN_TOP1", "_ci", "settings_of", "compare", "main"]


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
