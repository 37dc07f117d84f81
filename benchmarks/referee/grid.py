"""The referee grid's runner: runs configurations given as pretrain_gpt.py command lines.

    python -m benchmarks.referee.grid [--ci] [--only NAME ...] [--out benchmarks/results/referee-measured.json]

The entries (name, world size, the Megatron flags exactly as pretrain_gpt.py would take them, whether it belongs
to the CI subset) and `resolve_config`, which turns the flags into the resolved settings the worker takes with
memguard's own reader and rules, are data in grids/dense.py, re-exported here for the other runners.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from typing import Any, Dict, List, Optional

from .grids.dense import BASE, COMMON, GRID, LLAMA, REFEREE_MEGATRON_VERSION, named, resolve_config, select

# the definitions re-exported for the runners and tests that import them from here
__all__ = ["BASE", "COMMON", "GRID", "LLAMA", "REFEREE_MEGATRON_VERSION", "named", "resolve_config", "select",
           "run_grid", "main", "merge_results", "save_results"]


def run_grid(cfgs: List[Dict[str, Any]], timeout: float = 900.0, verbose: bool = True,
             settings_of=None, cores: Optional[tuple] = None) -> Dict[str, Any]:
    """Run each configuration; `settings_of(cfg)` gives its worker settings (default: resolve_config);
    ``cores``: the megatron-core releases the grid runs on (default: run.py's SUPPORTED_MEGATRON_CORE)."""
    from .run import RefereeError, run_referee, summary_line

    out = {"configs": []}
    t_all = time.time()
    for c in cfgs:
        if settings_of is None:
            settings = resolve_config(c["flags"], c["world_size"])[1]
        else:
            settings = settings_of(c)
        t0 = time.time()
        entry = {"name": c["name"], "world_size": c["world_size"], "ci": c["ci"], "note": c["note"],
                 "flags": c["flags"], "settings": settings}
        import importlib.util

        missing = [m for m in c.get("requires", []) if importlib.util.find_spec(m) is None]
        try:
            if missing:
                entry["status"] = "skipped"
                entry["error"] = f"missing Python module(s) {missing} needed by megatron-core"
            else:
                ranks = run_referee(settings, c["world_size"], timeout=timeout,
                                    **({"cores": cores} if cores else {}))
                entry["ranks"] = ranks
                entry["status"] = "ok"
        except RefereeError as e:
            entry["status"] = "failed"
            entry["error"] = str(e)[-6000:]
        entry["run_time_s"] = round(time.time() - t0, 2)
        out["configs"].append(entry)
        if verbose:
            print(f"[{entry['status']}] {c['name']} (ws {c['world_size']}) {entry['run_time_s']:.1f}s",
                  flush=True)
            if entry["status"] == "ok":
                for r in entry["ranks"]:
                    print("    " + summary_line(r), flush=True)
            else:
                print(entry["error"][-3000:], flush=True)
    out["total_run_time_s"] = round(time.time() - t_all, 2)
    return out


def main(argv: Optional[List[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ci", action="store_true", help="run only the CI subset")
    p.add_argument("--only", nargs="*", default=None, help="run only these configuration names")
    p.add_argument("--list", action="store_true")
    p.add_argument("--out", default=None, help="write all measurements to this JSON file")
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--update", action="store_true",
                   help="replace only the configurations run now in an existing --out file (the others kept)")
    a = p.parse_args(argv)
    cfgs = select(a.ci, a.only)
    if a.list:
        for c in cfgs:
            print(f"{c['name']:<32} ws={c['world_size']} ci={c['ci']}")
        return
    res = run_grid(cfgs, timeout=a.timeout)
    import torch
    import megatron.core

    res["environment"] = {
        "torch": torch.__version__, "megatron_core": megatron.core.__version__,
        "python": platform.python_version(), "cpus": os.cpu_count(),
        "subset": "ci" if a.ci else ("only" if a.only else "full"),
    }
    n_fail = sum(1 for c in res["configs"] if c["status"] == "failed")
    print(f"grid: {len(res['configs'])} configurations, {n_fail} failed, "
          f"total {res['total_run_time_s']:.1f}s")
    if a.out and a.update and os.path.exists(a.out):
        res = merge_results(a.out, res)
    if a.out:
        save_results(res, a.out)
    if n_fail:
        sys.exit(1)


def merge_results(path: str, res: Dict[str, Any], order: Optional[List[str]] = None) -> Dict[str, Any]:
    """The stored results at ``path`` with the configurations of ``res`` replaced or added, in the grid's order
    (``order``: the names, default GRID's); the stored environment kept (the new runs' is in ``res``)."""
    with open(path) as f:
        old = json.load(f)
    order = order or [c["name"] for c in GRID]
    merged = {c["name"]: c for c in old["configs"]}
    merged.update({c["name"]: c for c in res["configs"]})
    out = dict(old)
    out["configs"] = sorted(merged.values(), key=lambda c: order.index(c["name"]) if c["name"] in order else len(order))
    out["total_run_time_s"] = round(sum(c.get("run_time_s", 0) for c in out["configs"]), 2)
    out.setdefault("updates", []).append({"configs": [c["name"] for c in res["configs"]],
                                          "environment": res.get("environment", {})})
    return out


def save_results(res: Dict[str, Any], path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
