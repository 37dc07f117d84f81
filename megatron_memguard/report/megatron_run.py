"""A Megatron training log as a run ``memguard report`` can show: each logged rank's memory lines next to
the prediction for its pipeline stage, exactly as for memguard's own JSONL (:mod:`.runlog`).

The configuration comes from the argument table Megatron prints at start-up (``_print_args``), or from
the user (``--config`` / flags). A rank's stage follows Megatron's rank order: ``tp-cp-ep-dp-pp`` (PP
outermost) by default, ``tp-cp-ep-pp-dp`` with ``--use-tp-pp-dp-mapping`` (megatron/training/initialize.py,
0.17 and 0.19). The global rank fixes the rank's whole position (:func:`rank_position`): its stage, its
slice of the distributed optimizer (the DP x CP group: CP ranks of DP rank 0 own different slices) and its
expert-data-parallel slice, and each rank is predicted at that position (``estimate --dp-rank``).
``report_memory`` prints on data-parallel rank 0 of each position; a log of other ranks is read the same way.
"""
from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any, Callable

from ..config import RawConfig
from ..errors import ReaderError
from ..estimator.result import Estimate
from ..layout import Layout
from ..layout.parallelism import ShardGroup
from ..runtime.monitor import Prediction
from .megatron_log import MegatronLog, skipped_memory_lines
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
    # 0.17+ validate_args copies the deprecated --hybrid-override-pattern into hybrid_layer_pattern without clearing
    # it (megatron/training/arguments.py, 0.19.2): a run launched with the old flag prints both, equal
    if out.get("hybrid_override_pattern") not in (None, "None") and \
            out.get("hybrid_override_pattern") == out.get("hybrid_layer_pattern"):
        out.pop("hybrid_override_pattern")
    return out


def tp_pp_dp_mapping(raw: RawConfig | None) -> bool:
    return bool(raw is not None and raw.args.get("use_tp_pp_dp_mapping"))


def pp_rank_of(rank: int, L: Layout, tp_pp_dp: bool = False) -> int:
    """The pipeline stage of global ``rank`` in Megatron's rank order (dense models: EP = 1)."""
    inner = L.tp * L.cp
    if tp_pp_dp:
        return (rank // inner) % L.pp
    return rank // (inner * L.dp)


@dataclass(frozen=True)
class RankPosition:
    """Where a global rank sits in megatron-core's process groups. ``optimizer_rank``: its index in its
    distributed-optimizer instance over the DP x CP group; ``expert_optimizer_rank``: the same in the
    expert-data-parallel group (None without experts)."""
    pp: int
    tp: int
    cp: int
    dp: int
    optimizer_rank: int
    expert_optimizer_rank: int | None


def rank_position(rank: int, L: Layout, tp_pp_dp: bool = False) -> RankPosition:
    """The position of global ``rank`` (< world size). megatron-core 0.16.1 and 0.19.2,
    parallel_state.initialize_model_parallel: the dense RankGenerator (EP 1) numbers ranks in the order
    tp-cp-ep-dp-pp (tp-cp-ep-pp-dp with --use-tp-pp-dp-mapping), the first axis fastest; the expert one
    (TP = ETP, CP 1, DP = world / (ETP x EP x PP)) in the same order. The DP x CP group lists its ranks
    with CP fastest (index cp + CP x dp) and each of --num-distributed-optimizer-instances takes a run of
    consecutive members (intra_partial_(expert_)data_parallel), hence the modulo of the shard size."""
    P = L.parallel
    tp, cp = rank % P.tp, rank // P.tp % P.cp
    inner = P.tp * P.cp
    pp = pp_rank_of(rank, L, tp_pp_dp)
    dp = rank // (inner * P.pp) if tp_pp_dp else rank // inner % P.dp
    opt = (cp + P.cp * dp) % L.dp_shard_size
    edp = None
    if L.moe is not None:
        e_inner = (P.expert_tensor_parallel_size or P.tp) * P.expert_model_parallel_size
        e_dp = max(1, P.world_size // (e_inner * P.pp))
        edp = (rank // (e_inner * P.pp) if tp_pp_dp else rank // e_inner % e_dp) % P.shard_size(ShardGroup.EXPERT_DP)
    return RankPosition(pp, tp, cp, dp, opt, edp)


def megatron_runlog(log: MegatronLog, est: Estimate | None, tp_pp_dp: bool = False, location: str = "",
                    at: Callable[[int, int | None], Estimate] | None = None) -> RunLog:
    """A RunLog (one RankRun per logged rank) with each rank's prediction at its own position
    (:func:`rank_position`); ReaderError for a log without memory lines. ``at(optimizer_rank,
    expert_optimizer_rank)``: the estimate for that optimizer position (None: ``est`` for every rank, as
    ``est`` was made); one estimate per distinct position."""
    if not log.memory:
        raise ReaderError(f"{', '.join(log.files[:3])}{' ...' if len(log.files) > 3 else ''}: no Megatron memory lines "
                          "('[Rank N] (after K iterations) memory (MB) | allocated: ...'); Megatron's report_memory "
                          "prints them at the first logged iterations on data-parallel rank 0 of each model-parallel "
                          "position, and every --log-memory-interval" + skipped_memory_lines(log))
    ranks: list[RankRun] = []
    notes = list(log.notes)
    world = est.layout.world_size if est is not None else None
    cache: dict[tuple[int, int | None], Estimate] = {}
    for rank in log.ranks:
        lines = log.rank_lines(rank)
        pos = rank_position(rank, est.layout, tp_pp_dp) if est is not None and (world is None or rank < world) else None
        pp = pos.pp if pos is not None else None
        pred: dict[str, Any] = {}
        if pos is not None and at is not None:
            # without the distributed optimizer every rank holds the whole state: one estimate serves all
            key = (pos.optimizer_rank, pos.expert_optimizer_rank) if est.layout.use_distributed_optimizer else (0, None)
            if key not in cache:
                cache[key] = at(*key)
            est_r = cache[key]
        else:
            est_r = est
        if est_r is not None and pp is not None:
            pred = Prediction.from_stage(est_r.stages[pp], device=est_r.device).values()
        rr = RankRun(rank=rank, path=lines[0].file, pp_rank=pp, source=SOURCE, tolerance=0.05, reset_peak=False)
        if est_r is not None and pp is not None and est_r.stages[pp].moe:
            # MoE: the stage's worst-case figures, where the monitor's start record carries them (moe_lines)
            rr.start = {"predicted": {"moe_worst_case": dict(est_r.stages[pp].moe["worst_case"])}}
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


__all__ = ["raw_from_log", "pp_rank_of", "rank_position", "RankPosition", "megatron_runlog", "tp_pp_dp_mapping", "SOURCE"]
