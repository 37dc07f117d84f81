"""A Megatron training log as a run ``memguard report`` can show: each logged rank's memory lines next to
the prediction for its pipeline stage, exactly as for memguard's own JSONL (:mod:`.runlog`).

The configuration comes from the argument table Megatron prints at start-up (``_print_args``), or from
the user (``--config`` / flags). A rank's stage follows Megatron's rank order: ``tp-cp-ep-dp-pp`` (PP
outermost) by default, ``tp-cp-ep-pp-dp`` with ``--use-tp-pp-dp-mapping`` (megatron/training/initialize.py,
0.17 and 0.19). ``report_memory`` prints on data-parallel rank 0 of each position, so a rank's optimizer
shard is DP rank 0's.
"""
from __future__ import annotations

import types
from typing import Any

from ..config import RawConfig
from ..errors import ReaderError
from ..estimator.result import Estimate
from ..layout import Layout
from ..runtime.monitor import Prediction
from .megatron_log import MegatronLog
from .runlog import RankRun, RunLog, Sample

SOURCE = "megatron report_memory"


def raw_from_log(log: MegatronLog) -> RawConfig:
    """The configuration in the log's argument table (ReaderError when the log has none)."""
    from ..readers.megatron_namespace import raw_from_namespace

    if not log.args:
        raise ReaderError(f"{', '.join(log.files[:3])}: no Megatron argument table ('---- arguments ----', printed on "
                          "rank 0 at start-up); give the run's configuration with --config FILE or its flags after --")
    raw = raw_from_namespace(types.SimpleNamespace(**post_validation(log.args)))
    return RawConfig(args=raw.args, origin={}, source=f"the argument table of {log.args_file}",
                     world_size=raw.world_size, env=raw.env)


def post_validation(args: dict[str, Any]) -> dict[str, Any]:
    """The table shows the arguments after validate_args, which fills some from others; those that only
    restate a default are dropped so that they do not read as settings. 0.19's validate_args sets
    --tensor-parallel-num-weight-shards to TP (x gtp_weight_remat_size, 1 without GTP:
    megatron/core/model_parallel_config.py resolve_tensor_parallel_weight_shards)."""
    out = dict(args)
    for shards, tp, remat in (("tensor_parallel_num_weight_shards", "tensor_model_parallel_size", "gtp_weight_remat_size"),
                              ("expert_tensor_parallel_num_weight_shards", "expert_tensor_parallel_size",
                               "expert_gtp_weight_remat_size")):
        if out.get(remat, 1) in (1, None) and out.get(shards) in (None, out.get(tp)):
            out.pop(shards, None)
            out.pop(remat, None)
    return out


def tp_pp_dp_mapping(raw: RawConfig | None) -> bool:
    return bool(raw is not None and raw.args.get("use_tp_pp_dp_mapping"))


def pp_rank_of(rank: int, L: Layout, tp_pp_dp: bool = False) -> int:
    """The pipeline stage of global ``rank`` in Megatron's rank order (dense models: EP = 1)."""
    inner = L.tp * L.cp
    if tp_pp_dp:
        return (rank // inner) % L.pp
    return rank // (inner * L.dp)


def megatron_runlog(log: MegatronLog, est: Estimate | None, tp_pp_dp: bool = False, location: str = "") -> RunLog:
    """A RunLog (one RankRun per logged rank) with each rank's stage prediction; ReaderError for a log
    without memory lines."""
    if not log.memory:
        raise ReaderError(f"{', '.join(log.files[:3])}{' ...' if len(log.files) > 3 else ''}: no Megatron memory lines "
                          "('[Rank N] (after K iterations) memory (MB) | allocated: ...'); Megatron's report_memory "
                          "prints them at the first logged iterations on data-parallel rank 0 of each model-parallel "
                          "position, and every --log-memory-interval")
    ranks: list[RankRun] = []
    notes = list(log.notes)
    world = est.layout.world_size if est is not None else None
    for rank in log.ranks:
        lines = log.rank_lines(rank)
        pp = pp_rank_of(rank, est.layout, tp_pp_dp) if est is not None and (world is None or rank < world) else None
        pred: dict[str, Any] = {}
        if est is not None and pp is not None:
            pred = Prediction.from_stage(est.stages[pp], device=est.device).values()
        rr = RankRun(rank=rank, path=lines[0].file, pp_rank=pp, source=SOURCE, tolerance=0.05, reset_peak=False)
        if est is not None and pp is not None and est.stages[pp].moe:
            # MoE: the stage's worst-case figures, where the monitor's start record carries them (moe_lines)
            rr.start = {"predicted": {"moe_worst_case": dict(est.stages[pp].moe["worst_case"])}}
        for m in lines:
            actual = {"allocated": m.allocated, "max_allocated": m.max_allocated, "reserved": m.reserved,
                      "max_reserved": m.max_reserved, "device_used": m.device_used}
            rr.samples.append(Sample(m.iteration if m.iteration is not None else -1, actual, pred, m.line))  # (pred: shared, read-only)
        ranks.append(rr)
    if est is not None and world is not None and any(r >= world for r in log.ranks):
        notes.append(f"ranks beyond the configuration's world size ({world}) have no prediction: "
                     + ", ".join(str(r) for r in log.ranks if r >= world)[:80])
    by_rank = {r.rank: r for r in ranks}
    for ev in log.ooms:
        target = by_rank.get(ev.rank) if ev.rank is not None else None
        rec = {"iteration": ev.iteration, "alloc_bytes": ev.requested, "file": ev.file, "line": ev.line}
        if target is not None:
            target.ooms.append(rec)
        else:
            notes.append(f"out of memory in {ev.file} line {ev.line}"
                         + (f" (rank {ev.rank}, which logged no memory line)" if ev.rank is not None else
                            " (the failing rank is not named)"))
    if log.args_tables > 1:
        notes.append(f"{log.args_tables} argument tables (a restarted job?): the last one is used")
    if log.theoretical_mib is not None and est is not None:
        w, a, t = log.theoretical_mib
        notes.append(f"Megatron's own estimate (report_theoretical_memory, first stage): weights and optimizer {w:.0f} MiB, "
                     f"activations {a:.0f} MiB, total {t:.0f} MiB; memguard's pp0 peak allocated "
                     f"{est.stages[0].peak_allocated_bytes / 2**20:.0f} MiB")
    loc = location or (log.files[0] if len(log.files) == 1 else f"{len(log.files)} log files")
    return RunLog(location=loc, ranks=ranks, files=list(log.files), notes=notes)


__all__ = ["raw_from_log", "pp_rank_of", "megatron_runlog", "tp_pp_dp_mapping", "SOURCE"]
