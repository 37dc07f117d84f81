"""The referee's mixture-of-experts grid: MoE GPT models on real megatron-core 0.16.1 (CPU, gloo).

    python -m benchmarks.referee.moe_grid [--list] [--only NAME ...] [--out benchmarks/results/referee-moe-measured.json]

Each entry is a pretrain_gpt.py command line (the dense grid's COMMON flags plus a small Llama-style
base) whose MoE flags are kept apart in ``moe_flags``. Per rank the worker measures what it measures
for dense runs (parameters, live bytes after build / after the step / at the peak, the dump at the
peak) plus the routing the run produced (``routing``: tokens per expert per MoE layer and
micro-batch, see worker.py).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from typing import List, Optional

from .grid import REFEREE_MEGATRON_VERSION, merge_results, run_grid, save_results
from .grids.moe import MOE_BASE, MOE_DEFAULT, MOE_GRID, _moe, moe_settings, select

# the definitions re-exported for the runners and tests that import them from here
__all__ = ["MOE_BASE", "MOE_DEFAULT", "MOE_GRID", "_moe", "moe_settings", "select", "main"]


def main(argv: Optional[List[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", nargs="*", default=None, help="run only these configuration names")
    p.add_argument("--list", action="store_true")
    p.add_argument("--out", default=None, help="write all measurements to this JSON file")
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--update", action="store_true",
                   help="replace only the configurations run now in an existing --out file")
    p.add_argument("--pass-trace", action="store_true",
                   help="record the live bytes at every pass of the combined 1F1B schedule (worker.install_pass_trace)")
    a = p.parse_args(argv)
    cfgs = select(a.only)
    if a.list:
        for c in cfgs:
            print(f"{c['name']:<32} ws={c['world_size']}  {c['note']}")
        return
    def settings_of(c):
        s = moe_settings(c)[1]
        return {**s, "referee_pass_trace": True} if a.pass_trace else s

    res = run_grid(cfgs, timeout=a.timeout, settings_of=settings_of)
    import megatron.core
    import torch

    res["environment"] = {
        "torch": torch.__version__, "megatron_core": megatron.core.__version__,
        "python": platform.python_version(), "cpus": os.cpu_count(),
        "subset": "only" if a.only else "full", "referee_megatron_version": REFEREE_MEGATRON_VERSION,
    }
    n_fail = sum(1 for c in res["configs"] if c["status"] == "failed")
    print(f"moe grid: {len(res['configs'])} configurations, {n_fail} failed, total {res['total_run_time_s']:.1f}s")
    if a.out and a.update and os.path.exists(a.out):
        res = merge_results(a.out, res, [c["name"] for c in MOE_GRID])
    if a.out:
        save_results(res, a.out)
    if n_fail:
        sys.exit(1)


if __name__ == "__main__":
    main()
