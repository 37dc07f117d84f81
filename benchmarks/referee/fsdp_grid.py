"""The referee's Megatron-FSDP grid: the MoE grid's model under Megatron-FSDP (megatron-core 0.16.1, CPU, gloo).

    python -m benchmarks.referee.fsdp_grid [--list] [--only NAME ...] [--out benchmarks/results/referee-fsdp-measured.json]

It runs on megatron-core 0.16.1 (the Python 3.11 environment) and on 0.19.2 (the Python 3.12 one, whose
Megatron-FSDP is rewritten: results in benchmarks/results/referee-fsdp-measured-core019.json); the flags are
resolved with the installed release's defaults (``settings_of``).

Each entry is an MoE grid entry (moe_grid.py: 4 layers, hidden 256, 4 experts of 512, top-2, EP 2, alltoall)
on 4 ranks with ``--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params`` and the
distributed optimizer (0.16.1 does not switch it on): dense groups over DP 4, expert groups over expert
DP 2. The worker wraps the chunks in Megatron-FSDP's adapter (shims.megatron_fsdp) and counts a DTensor's
local shard (livebytes.py). Megatron-FSDP needs ``einops``; without it the run fails at the device mesh.
"""

from __future__ import annotations

import argparse
import os
import platform
from typing import List, Optional

from .grid import merge_results, run_grid, save_results
from .grids.fsdp import (FSDP, FSDP_ALL, FSDP_GRID, FSDP_MTP, FSDP_ONE_RANK, FSDP_OVERLAP, ZP_Z3_MOE, resolve_version,
                         select, settings_of, stored_rank_layouts)
from .run import FSDP_MEGATRON_CORES

# the definitions re-exported for the runners and tests that import them from here
__all__ = ["FSDP", "FSDP_ALL", "FSDP_GRID", "FSDP_MTP", "FSDP_ONE_RANK", "FSDP_OVERLAP", "ZP_Z3_MOE", "resolve_version",
           "select", "settings_of", "stored_rank_layouts", "main"]


def main(argv: Optional[List[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", nargs="*", default=None)
    p.add_argument("--list", action="store_true")
    p.add_argument("--out", default=None)
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--update", action="store_true",
                   help="replace only the configurations run now in an existing --out file (the others kept)")
    a = p.parse_args(argv)
    cfgs = select(a.only)
    if a.list:
        for c in cfgs:
            print(f"{c['name']:<32} ws={c['world_size']}  {c['note']}")
        return
    from importlib import metadata

    core = metadata.version("megatron-core")
    res = run_grid(cfgs, timeout=a.timeout, settings_of=lambda c: settings_of(c, core), cores=FSDP_MEGATRON_CORES)
    import megatron.core
    import torch

    res["environment"] = {"python": platform.python_version(), "torch": torch.__version__,
                          "megatron_core": megatron.core.__version__}
    if a.out and a.update and os.path.exists(a.out):
        res = merge_results(a.out, res, [c["name"] for c in FSDP_ALL])
    if a.out:
        save_results(res, a.out)


if __name__ == "__main__":
    main()
