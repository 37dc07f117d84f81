"""Full recompute's replay measured on the installed megatron-core (0.16.1 or 0.19.2).

    python -m benchmarks.referee.replay_grid [--out benchmarks/results/referee-replay-measured.json]

Runs the grid's configurations with a 128-word vocabulary whose peak lies in the backward (REPLAY below:
recomputed blocks' replays and the unrecomputed reference), the flags resolved with the installed release's
defaults, and writes them under that release's key of the output file (the other release's entries are kept).
tests/test_referee_replay.py reads the file.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
from typing import Any, Dict

from .grid import resolve_config, select
from .run import FSDP_MEGATRON_CORES, run_referee

REPLAY = ["recomp_full_block1_of4_bwd", "recomp_full_block1_of4_tp2_sp_bwd", "recomp_full_uniform1_bwd",
          "recomp_full_uniform2_bwd", "recomp_full_block3_of4_bwd", "recomp_full_uniform1_tp2_sp_bwd",
          "recomp_full_uniform1_distributed_bwd"]
VERSION = {"0.16.1": "0.16.1", "0.19.2": "0.19"}   # megatron-core release -> memguard's --megatron-version
# what tests/test_referee_replay.py reads of a rank (the largest 30 live storages at the peak)
KEEP = ("rank", "world_size", "tp_rank", "pp_rank", "dp_rank", "tp_size", "pp_size", "dp_size", "num_params",
        "live_bytes_after_build", "live_bytes_after_step", "peak_bytes", "peak_phase", "peak_live_by_phase_class",
        "peak_top_storages")


def measure(core: str, timeout: float) -> list[Dict[str, Any]]:
    out = []
    for cfg in select(False, REPLAY):
        _, settings = resolve_config(cfg["flags"], cfg["world_size"], VERSION[core])
        ranks = run_referee(settings, cfg["world_size"], timeout=timeout, cores=FSDP_MEGATRON_CORES)
        slim = [{k: r[k] for k in KEEP if k in r} for r in ranks]
        for r in slim:
            r["peak_top_storages"] = sorted(r["peak_top_storages"], key=lambda s: -s["bytes"])[:30]
        out.append({"name": cfg["name"], "world_size": cfg["world_size"], "note": cfg["note"], "flags": cfg["flags"],
                    "status": "ok", "ranks": slim})
        print(f"[ok] {cfg['name']}: peak {[r['peak_bytes'] for r in slim]} in {[r['peak_phase'] for r in slim]}")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "results",
                                                 "referee-replay-measured.json"))
    p.add_argument("--timeout", type=float, default=900.0)
    a = p.parse_args()
    import megatron.core
    import torch
    core = megatron.core.__version__
    if core not in VERSION:
        raise SystemExit(f"megatron-core {core}: the replay grid runs on {' or '.join(VERSION)}")
    data = json.load(open(a.out)) if os.path.exists(a.out) else {}
    data[core] = {"environment": {"torch": torch.__version__, "megatron_core": core,
                                  "python": platform.python_version()},
                  "configs": measure(core, a.timeout)}
    with open(a.out, "w") as fh:
        json.dump(data, fh, indent=1)


if __name__ == "__main__":
    main()
