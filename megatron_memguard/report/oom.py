"""Out-of-memory forensics: which stage and term the estimate blames for a CUDA OOM, and how far off it was.

PyTorch's message gives, at the failed allocation: what the process had allocated (A), what the caching
allocator held on top (reserved but unallocated, U), what the whole process used on the device (P,
with the CUDA context and NCCL's buffers), what other processes used, the request (X) and the GPU's
capacity. Compared level by level with the prediction for the rank's pipeline stage:

* allocated: the run needed at least A + X (it died before its peak, so its real peak is no lower):
  over the predicted peak allocated means the prediction was low by at least that much; the term
  blamed is a model-state term when the run died before finishing an iteration and A + X exceeds what
  the model state alone should hold, otherwise the largest activation / transient term;
* reserved: U beyond the predicted allocator slack means fragmentation (``expandable_segments`` helps);
* device: P - (A + U) beyond the predicted CUDA context and NCCL buffers means memory outside PyTorch;
  other processes on the GPU are named as such.
When the prediction itself exceeded the GPU, the estimate foresaw the OOM: its verdict was "will not fit".
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..estimator.result import Estimate, StageEstimate, Term
from ..units import format_bytes
from .megatron_log import OomEvent

_STATE = ("weights", "gradients", "optimizer")
_TRANSIENT = ("activations", "logits_loss", "transients")


@dataclass(frozen=True)
class OomBlame:
    event: OomEvent
    pp_rank: int | None
    stage: StageEstimate | None
    level: str                # allocated | reserved | device | other-processes | predicted
    term: str
    why: str
    needed_error: float | None        # (A + X) / predicted peak allocated - 1: the prediction was low by at least this
    predicted_fits: bool | None       # the prediction's device total within the GPU's capacity

    def lines(self) -> list[str]:
        e, s = self.event, self.stage
        who = (f"rank {e.rank}" if e.rank is not None else f"GPU {e.device} (rank unknown)") + \
            (f" (pp{self.pp_rank})" if self.pp_rank is not None else "")
        when = f" after iteration {e.iteration}" if e.iteration is not None else " before the first logged iteration"
        out = [f"out of memory on {who}{when} ({e.file}:{e.line}): tried to allocate {format_bytes(e.requested)} with "
               f"{format_bytes(e.allocated)} allocated by PyTorch"
               + (f", {format_bytes(e.reserved_unallocated)} reserved but unallocated" if e.reserved_unallocated is not None else "")
               + (f", {format_bytes(e.process_used)} used by the process" if e.process_used is not None else "")
               + f"; GPU capacity {format_bytes(e.capacity)}, {format_bytes(e.free)} free"]
        if s is not None:
            out.append(f"  memguard predicted for pp{s.pp_rank}: peak allocated {format_bytes(s.peak_allocated_bytes)}, "
                       f"peak reserved {format_bytes(s.peak_reserved_bytes)}, device total "
                       f"{format_bytes(s.device_total_bytes)} (peaking at {s.peak_phase})")
            if self.needed_error is not None:
                out.append(f"  the run needed at least {format_bytes(e.needed)} allocated: the prediction was "
                           + (f"low by at least {self.needed_error:+.1%}" if self.needed_error > 0 else
                              f"{-self.needed_error:.1%} above what it had reached when it failed"))
        out.append(f"  blamed: {self.term} ({self.level}) - {self.why}")
        return out

    def to_dict(self) -> dict[str, Any]:
        e = self.event
        return {"file": e.file, "line": e.line, "rank": e.rank, "device": e.device, "iteration": e.iteration,
                "requested_bytes": e.requested, "allocated_bytes": e.allocated,
                "reserved_unallocated_bytes": e.reserved_unallocated, "process_used_bytes": e.process_used,
                "other_processes_bytes": e.other_processes, "capacity_bytes": e.capacity, "free_bytes": e.free,
                "pp_rank": self.pp_rank, "level": self.level, "term": self.term, "why": self.why,
                "needed_error": self.needed_error, "predicted_fits": self.predicted_fits,
                "predicted": None if self.stage is None else {
                    "peak_allocated": self.stage.peak_allocated_bytes, "peak_reserved": self.stage.peak_reserved_bytes,
                    "device_total": self.stage.device_total_bytes, "persistent": self.stage.persistent_bytes}}


def _largest(stage: StageEstimate, groups: tuple[str, ...], level: str | None = "allocated") -> Term | None:
    pool = [t for t in stage.terms if t.group in groups and (level is None or t.level == level)]
    return max(pool, key=lambda t: t.bytes) if pool else None


def blame(event: OomEvent, est: Estimate | None, pp_rank: int | None, started_training: bool,
          tolerance: float = 0.05) -> OomBlame:
    """Blame a stage and a term for ``event``. ``pp_rank``: the failing rank's stage (None: unknown, the
    critical stage is blamed); ``started_training``: the log shows a finished iteration before the OOM."""
    if est is None:
        return OomBlame(event, pp_rank, None, "allocated", "unknown", "no estimate to compare with", None, None)
    if pp_rank is None:
        pp_rank = est.critical_stage
        assumed = f" (the failing rank is unknown: the critical stage pp{pp_rank} is assumed)"
    else:
        assumed = ""
    s = est.stages[pp_rank]
    e = event
    err = e.needed / s.peak_allocated_bytes - 1 if s.peak_allocated_bytes else None
    fits = s.device_total_bytes <= e.capacity
    frag = s.breakdown.get("allocator_fragmentation", 0)
    # CUDA graphs' private pools (cuda_graph_pool, optimizer_graph_pool) are reserved and not allocated between
    # their replays, like the fragmentation slack
    pools = sum(t.bytes for t in s.terms if t.level == "reserved" and t.name != "allocator_fragmentation")
    outside_pred = sum(t.bytes for t in s.terms if t.level == "device")
    if not fits:
        t = s.dominant_term
        return OomBlame(e, pp_rank, s, "predicted", t.name,
                        f"the estimate foresaw it: stage pp{pp_rank} needs {format_bytes(s.device_total_bytes)}, more than "
                        f"the GPU's {format_bytes(e.capacity)} (verdict: will not fit); its largest term is {t.name} "
                        f"({format_bytes(t.bytes)})" + assumed, err, fits)
    candidates: list[tuple[float, str, str, str]] = []   # (excess bytes, level, term, why)
    if e.other_processes:
        candidates.append((e.other_processes, "other-processes", "other_processes",
                           f"other processes hold {format_bytes(e.other_processes)} on the same GPU"))
    if err is not None and err > tolerance:
        if not started_training and e.needed > s.persistent_bytes * (1 + tolerance):
            t = _largest(s, _STATE)
            why = (f"it failed before the first iteration finished, needing {format_bytes(e.needed)} where the model "
                   f"state and buffers should hold {format_bytes(s.persistent_bytes)}: weights, gradients or optimizer "
                   "state (or an allocation memguard does not model at build / checkpoint load)")
        else:
            t = _largest(s, _TRANSIENT)
            why = (f"the run needed {format_bytes(e.needed - s.peak_allocated_bytes)} more than the predicted peak "
                   f"allocated during training: the largest activation / transient term"
                   + (f" at the predicted peak ({s.peak_phase})" if s.peak_phase else ""))
        candidates.append((e.needed - s.peak_allocated_bytes, "allocated", t.name if t else "unknown", why))
    if e.reserved_unallocated is not None and e.reserved_unallocated > (frag + pools) * (1 + tolerance) + 2 * 2**20:
        candidates.append((e.reserved_unallocated - frag - pools, "reserved", "allocator_fragmentation",
                           f"the caching allocator held {format_bytes(e.reserved_unallocated)} reserved but unallocated "
                           f"(predicted slack {format_bytes(frag)}"
                           + (f", CUDA graph pools {format_bytes(pools)}" if pools else "") + "): fragmentation; "
                           "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True reduces it"))
    if e.process_used is not None and e.reserved_unallocated is not None:
        outside = e.process_used - e.allocated - e.reserved_unallocated
        if outside > outside_pred * (1 + tolerance):
            t = max((t for t in s.terms if t.level == "device"), key=lambda t: t.bytes, default=None)
            candidates.append((outside - outside_pred, "device", t.name if t else "outside_pytorch",
                               f"{format_bytes(outside)} of the process's memory is outside PyTorch's allocator "
                               f"(predicted {format_bytes(outside_pred)}: CUDA context and NCCL buffers)"))
    if not candidates:
        t = _largest(s, _TRANSIENT) or s.dominant_term
        return OomBlame(e, pp_rank, s, "allocated", t.name,
                        "each level is within the prediction at the moment of failure; the request itself "
                        f"({format_bytes(e.requested)}) did not fit next to the rest - the largest transient term at "
                        "the peak is the nearest suspect" + assumed, err, fits)
    excess, level, term, why = max(candidates, key=lambda c: c[0])
    return OomBlame(e, pp_rank, s, level, term, why + assumed, err, fits)


__all__ = ["OomBlame", "blame"]
