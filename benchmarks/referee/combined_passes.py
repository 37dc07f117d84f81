"""The combined 1F1B schedule pass by pass: the referee's measured live bytes at each of its steps against memguard's
count at the same pass.

    python -m benchmarks.referee.combined_passes [benchmarks/results/referee-moe-combined-passes.json]

The measurement (``moe_grid --pass-trace``, worker.install_pass_trace) records, for every call of megatron-core's
``combined_1f1b_schedule_for_interleaved_pipelining`` of the last iteration, the live bytes at its entry, its exit and
its peak. A call is one warm-up forward, one steady step (a backward and a forward, run layer by layer together by
TransformerModelChunkSchedulePlan.run) or one cool-down backward. memguard walks the same passes
(schedule.p2p_every_pass: the steady step as its backward, then its forward); its value at a pass is the stage's
base (state, buffers) + the micro-batches held + the pass's transient + the schedule's own tensors at it, and a steady
step's is the larger of its two passes'.

Pure reading of a stored file plus memguard's estimator: no torch, no megatron.
"""

from __future__ import annotations

import json
import os
import sys
from operator import mul
from typing import Any, Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STORED = os.path.join(ROOT, "benchmarks", "results", "referee-moe-combined-passes.json")


def predicted_passes(L: Any, pp_rank: int) -> List[Dict[str, Any]]:
    """memguard's bytes at every pass of a stage's combined 1F1B schedule, grouped as Megatron's calls run them: one
    dict per call with its forward and backward probes ((fwd, chunk, held, nth), units) and its value."""
    from megatron_memguard.estimator.core import _stage_prep, _stage_shapes
    from megatron_memguard.estimator.overheads import p2p_tensor_bytes
    from megatron_memguard.estimator.site import DEFAULT_SITE
    from megatron_memguard.schedule import _warmup, p2p_every_pass

    shape = _stage_shapes(L)[pp_rank]
    pr = _stage_prep(L, shape, "cpu", None, "max", DEFAULT_SITE)
    sizes, fwd_extra, _, _, bwd_extra, receiving, _, solo = pr.sched
    group = L.microbatch_group_size_per_vp_stage or L.pp
    t = p2p_tensor_bytes(L)
    passes = p2p_every_pass(L.pp, L.vpp, L.num_microbatches, group, pp_rank, receiving, L.overlap_p2p_comm, True)
    last = len(passes) - 1
    # a backward that no forward follows in the same call runs alone (estimator.core._combined_walk_peak)
    alone = [not p[0] and (i == last or not passes[i + 1][0][0]) for i, (p, _) in enumerate(passes)]
    bwd_alone = solo()[2]
    values = [pr.base + sum(map(mul, p[2], sizes)) + (fwd_extra if p[0] else bwd_alone if a else bwd_extra)[p[1]]
              + t * u for (p, u), a in zip(passes, alone)]
    total = L.num_microbatches * L.vpp
    warm = _warmup(L.pp, L.vpp, group, pp_rank, L.num_microbatches, True)
    steady = total - warm
    calls: List[Dict[str, Any]] = [{"f": x, "b": None, "passes": [passes[x]], "value": values[x]} for x in range(warm)]
    for k in range(steady):                     # a steady step: backward k, then forward warm + k
        i = warm + 2 * k
        calls.append({"f": warm + k, "b": k, "passes": [passes[i], passes[i + 1]],
                      "value": max(values[i], values[i + 1])})
    for y in range(steady, total):              # the cool-down backwards
        i = warm + steady + y
        calls.append({"f": None, "b": y, "passes": [passes[i]], "value": values[i]})
    return calls


def compare_rank(cfg: Dict[str, Any], rank: Dict[str, Any], iteration: int = 2) -> List[Dict[str, Any]]:
    """One row per call of the rank's ``iteration``: measured peak, entry and exit bytes, memguard's value and the
    ratio."""
    from .grids.dense import resolve_config
    from .grids.moe import MOE_GRID

    entry = next(c for c in MOE_GRID if c["name"] == cfg["name"])
    L, _ = resolve_config(entry["flags"], entry["world_size"])
    pred = predicted_passes(L, rank["pp_rank"])
    measured = [p for p in rank["pass_trace"] if p["iter"] == iteration]
    if [(p["f"], p["b"]) for p in measured] != [(c["f"], c["b"]) for c in pred]:
        raise ValueError(f"{cfg['name']} rank {rank['rank']}: the measured calls {[(p['f'], p['b']) for p in measured]} "
                         f"are not memguard's {[(c['f'], c['b']) for c in pred]}")
    rows = []
    for m, c in zip(measured, pred):
        rows.append({"f": m["f"], "b": m["b"], "measured_peak": m["peak"], "measured_start": m["start"],
                     "measured_end": m["end"], "predicted": c["value"], "err": c["value"] / m["peak"] - 1,
                     "probes": c["passes"]})
    return rows


def main(argv: Optional[List[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    path = argv[0] if argv else STORED
    with open(path) as f:
        data = json.load(f)
    mib = 1024 * 1024
    for cfg in data["configs"]:
        for rank in cfg["ranks"]:
            print(f"{cfg['name']} rank {rank['rank']} (pp {rank['pp_rank']}, dp {rank['dp_rank']})")
            print(f"  {'call':<12} {'start':>9} {'peak':>9} {'end':>9} {'memguard':>9} {'error':>7}  memguard's passes")
            for r in compare_rank(cfg, rank):
                name = (f"F{r['f']}" if r["f"] is not None else "") + ("+" if r["f"] is not None and r["b"] is not None
                                                                      else "") + (f"B{r['b']}" if r["b"] is not None else "")
                probes = "; ".join(f"{'F' if p[0] else 'B'} c{p[1]} held {p[2]} units {u}" for p, u in r["probes"])
                print(f"  {name:<12} {r['measured_start'] / mib:9.2f} {r['measured_peak'] / mib:9.2f} "
                      f"{r['measured_end'] / mib:9.2f} {r['predicted'] / mib:9.2f} {r['err']:+7.2%}  {probes}")


if __name__ == "__main__":
    main()
