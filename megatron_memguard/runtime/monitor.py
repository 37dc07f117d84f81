"""Predicted vs actual memory of one rank while training runs (framework-free).

The monitor holds this rank's prediction (one pipeline stage of an ``Estimate``), reads a
``MemorySource`` every ``interval`` iterations and writes a ``sample`` record to its sinks. It warns
once when an actual value exceeds its prediction by more than ``tolerance`` (5%), naming the term
most likely responsible; on an out-of-memory error it prints the rank's predicted breakdown; at the
end it writes a summary. Integrations (the Megatron hook, Bridge / Lightning callbacks) create it
after the model and optimizer exist and call ``step(iteration)`` once per iteration.

It never raises: every error inside the monitor is reported once (``errors`` counts the rest) and
training goes on. The only collective it may run is the optional ``gather`` (given by the
integration), called at the same iterations on every participating rank whatever happened locally,
so that one rank's local failure cannot leave the others waiting.
"""
from __future__ import annotations

import numbers
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

from ..estimator.result import Estimate, StageEstimate, Term
from ..units import format_bytes
from .reporting import ErrorReporter
from .sinks import SCHEMA, Sink
from .sources import MemorySource, Reading

# actual field -> predicted field compared with it
COMPARED = (("max_allocated", "peak_allocated"), ("max_reserved", "peak_reserved"), ("device_used", "device_total"))
_STATE_GROUPS = ("weights", "gradients", "optimizer")
_TRANSIENT_GROUPS = ("activations", "logits_loss", "transients")


@dataclass(frozen=True)
class Prediction:
    """What one rank (its pipeline stage) is predicted to need."""

    pp_rank: int
    peak_allocated: int
    peak_reserved: int
    device_total: int
    persistent: int
    peak_phase: str = ""
    terms: tuple[Term, ...] = ()
    device: str = "gpu"
    stage: StageEstimate | None = None

    @classmethod
    def from_stage(cls, stage: StageEstimate, device: str = "gpu") -> "Prediction":
        return cls(pp_rank=stage.pp_rank, peak_allocated=stage.peak_allocated_bytes, peak_reserved=stage.peak_reserved_bytes,
                   device_total=stage.device_total_bytes, persistent=stage.persistent_bytes, peak_phase=stage.peak_phase,
                   terms=tuple(stage.terms), device=device, stage=stage)

    @classmethod
    def from_estimate(cls, est: Estimate, pp_rank: int) -> "Prediction":
        return cls.from_stage(est.stages[pp_rank], device=est.device)

    def values(self) -> dict[str, int]:
        return {"peak_allocated": self.peak_allocated, "peak_reserved": self.peak_reserved,
                "device_total": self.device_total if self.device == "gpu" else None, "persistent": self.persistent}

    def to_dict(self, terms: bool = True) -> dict[str, Any]:
        d: dict[str, Any] = {"pp_rank": self.pp_rank, **self.values(), "peak_phase": self.peak_phase, "device": self.device}
        if terms:
            d["breakdown"] = {t.name: t.bytes for t in self.terms}
        if self.stage is not None and self.stage.moe:
            # MoE: the peak moves with routing; the report sets the measured peak between the balanced
            # estimate and this bound
            d["moe_worst_case"] = dict(self.stage.moe["worst_case"])
        return d


def suspect_term(pred: Prediction, r: Reading, tolerance: float = 0.05) -> tuple[str, str]:
    """The predicted term most likely responsible for actual > predicted, and why it is suspected."""
    def largest(groups: Sequence[str] | None = None, level: str | None = None) -> Term | None:
        pool = [t for t in pred.terms if (groups is None or t.group in groups) and (level is None or t.level == level)]
        return max(pool, key=lambda t: t.bytes) if pool else None

    over = lambda a, p: a is not None and p and a > p * (1 + tolerance)  # noqa: E731
    if over(r.max_allocated, pred.peak_allocated):
        if r.allocated is not None and over(r.allocated, pred.persistent):
            t = largest(_STATE_GROUPS)
            why = (f"memory held between iterations ({format_bytes(r.allocated)}) already exceeds the predicted model state "
                   f"and buffers ({format_bytes(pred.persistent)})")
        else:
            t = largest(_TRANSIENT_GROUPS, "allocated")
            why = ("memory held between iterations matches the predicted model state, so the excess is transient "
                   "(activations, logits, step temporaries; the peak since start also covers model build and checkpoint load)")
        if t is not None:
            return t.name, why
        return "unknown", why
    if over(r.max_reserved, pred.peak_reserved):
        # reserved-only terms: fragmentation, and the private pools CUDA graphs keep reserved (cuda_graph_pool,
        # optimizer_graph_pool); the largest predicted one is named
        t = largest(("allocator",), "reserved")
        if t is None or t.name == "allocator_fragmentation":
            return "allocator_fragmentation", ("allocated memory is as predicted but the caching allocator reserves "
                                               "more (fragmentation)")
        return t.name, ("allocated memory is as predicted but the caching allocator reserves more: the largest "
                        "reserved-only term is a CUDA graph's private memory pool")
    if over(r.device_used, pred.device_total):
        t = largest(level="device")
        return (t.name if t else "outside_pytorch",
                "memory outside PyTorch's allocator (CUDA context, NCCL buffers) or other processes on the same GPU")
    return "none", "actual is within the prediction"


_BYTES_BOUND = 2**63   # (torch's allocator counters are int64)


def checked_reading(r: Any) -> Reading | None:
    """``r`` if every field is None or a byte count (an int, or a whole float, from 0 to 2**63), else an error naming
    the field: a source's NaN, inf, negative or boolean value gave warnings such as 'nan B exceeds the predicted ...' and
    a negative or NaN peak in the summary."""
    if r is None:
        return None
    if not isinstance(r, Reading):
        raise TypeError(f"the memory source returned {type(r).__name__}, not a Reading")
    out: dict[str, int | None] = {}
    for name in ("allocated", "max_allocated", "reserved", "max_reserved", "device_used"):
        v = getattr(r, name)
        if v is not None:
            ok = isinstance(v, numbers.Real) and not isinstance(v, bool)
            if ok and not isinstance(v, numbers.Integral):
                ok = v == v and abs(v) != float("inf") and float(v).is_integer()
            if not ok or not 0 <= v < _BYTES_BOUND:
                raise ValueError(f"the memory source's {name} is {repr(v)[:40]}, not a byte count (0 to 2**63)")
            v = int(v)
        out[name] = v
    return Reading(**out)


class MemoryMonitor:
    def __init__(
        self,
        source: MemorySource,
        prediction: Prediction | None = None,
        *,
        rank: int = 0,
        pp_rank: int | None = None,
        interval: int = 100,
        tolerance: float = 0.05,
        reset_peak: bool = False,
        sinks: Iterable[Sink] = (),
        emit: Callable[[str], None] | None = None,
        emit_error: Callable[[str], None] | None = None,
        log_stages: bool = False,
        stage_predictions: Sequence[Prediction] | None = None,
        gather: Callable[[list[float]], list[list[float]] | None] | None = None,
        print_warnings: bool = True,
        context: Mapping[str, Any] | None = None,
        on_error: Callable[[str, BaseException], None] | None = None,
    ):
        self.source = source
        self.prediction = prediction
        self.rank = rank
        self.pp_rank = pp_rank if pp_rank is not None else (prediction.pp_rank if prediction else None)
        self.interval = max(1, int(interval))
        self.tolerance = tolerance
        self.reset_peak = reset_peak
        self.sinks = list(sinks)
        self.emit = emit or (lambda s: print(s, flush=True))
        self.emit_error = emit_error or (lambda s: print(s, file=sys.stderr, flush=True))
        self.log_stages = log_stages
        self.stage_predictions = {p.pp_rank: p for p in (stage_predictions or ())}
        if prediction is not None:
            self.stage_predictions.setdefault(prediction.pp_rank, prediction)
        self.gather = gather
        self.print_warnings = print_warnings
        self.context = dict(context or {})
        self.on_error = on_error
        self.samples = 0
        self.errors = 0
        self.warned: dict[str, Any] | None = None
        self.running: dict[str, int | None] = {k: None for k, _ in COMPARED}
        self.last: Reading | None = None
        self.last_iteration: int | None = None
        self.stage_rows: dict[int, list[float]] = {}
        self.oom_reported = False
        self.finished = False
        self._reporter = ErrorReporter(lambda s: self.emit_error(s), prefix=f"[memguard] rank {rank}:")

    # -- robustness ------------------------------------------------------------------------------
    def _error(self, where: str, exc: BaseException) -> None:
        self.errors += 1
        try:
            # the integration's reporter (once per process), or the monitor's own
            (self.on_error or self._reporter)(where, exc)
        except Exception:
            pass

    def _write(self, record: Mapping[str, Any]) -> None:
        for s in self.sinks:
            try:
                s.write(record)
            except Exception as e:  # a full disk must not stop training
                self._error(f"sink {type(s).__name__}", e)

    def _base(self, event: str, **fields) -> dict[str, Any]:
        return {"schema": SCHEMA, "event": event, "time": round(time.time(), 3), "rank": self.rank,
                "pp_rank": self.pp_rank, **fields}

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        """Write the header record (prediction with its breakdown) and a first reading (after model build)."""
        try:
            first = checked_reading(self.source.read())
        except Exception as e:
            self._error("source read", e)
            first = None
        try:   # the GPU, read once here; optional: a source that cannot tell (or fails to) leaves it out, silently
            describe = getattr(self.source, "describe", None)
            device = describe() if describe is not None else None
        except Exception:
            device = None
        try:
            self._write(self._base("start", source=self.source.name, interval=self.interval, tolerance=self.tolerance,
                                   reset_peak=self.reset_peak,
                                   predicted=self.prediction.to_dict() if self.prediction else None,
                                   actual=first.to_dict() if first else None, context=self.context,
                                   **({"gpu_device": device} if device else {})))
        except Exception as e:
            self._error("start", e)

    def step(self, iteration: int | None) -> None:
        """Call once per iteration; samples every ``interval`` iterations. An iteration that is not a whole
        number (a framework's counter of another type) is reported once and skipped."""
        if iteration is None:
            return
        try:
            if isinstance(iteration, bool) or not isinstance(iteration, numbers.Integral):
                raise TypeError(f"iteration must be an integer, got {type(iteration).__name__}")
            iteration = int(iteration)
        except Exception as e:
            self._error("step", e)
            return
        if iteration % self.interval:
            return
        self.sample(iteration)

    def sample(self, iteration: int) -> dict[str, Any] | None:
        reading: Reading | None = None
        record = None
        try:
            reading = checked_reading(self.source.read())
        except Exception as e:
            self._error("source read", e)
        if reading is not None:
            try:
                record = self._sample_record(iteration, reading)
                self._write(record)
                self._check(iteration, reading, record)
            except Exception as e:
                self._error("sample", e)
        try:
            vec = self._vector(reading)
        except Exception as e:  # e.g. a source's value that is not a number: "no reading", and still gather
            self._error("sample", e)
            reading, vec = None, self._vector(None)
        if self.gather is not None:
            try:
                rows = self.gather(vec)  # a collective: reached whatever happened above
            except Exception as e:
                self._error("gather", e)
                self.gather = None
                rows = None
            if rows:
                self.stage_rows = {int(r[0]): list(r) for r in rows if r and r[0] >= 0}
        elif reading is not None and self.pp_rank is not None:
            self.stage_rows = {self.pp_rank: vec}
        if self.log_stages:
            try:
                for line in self.stage_lines(iteration):
                    self.emit(line)
            except Exception as e:
                self._error("stage lines", e)
        if self.reset_peak and reading is not None:
            try:
                self.source.reset_peak()
            except Exception as e:
                self._error("reset peak", e)
        return record

    def _sample_record(self, iteration: int, r: Reading) -> dict[str, Any]:
        self.samples += 1
        self.last, self.last_iteration = r, iteration
        for k, _ in COMPARED:
            v = getattr(r, k)
            if v is not None:
                cur = self.running[k]
                self.running[k] = v if cur is None else max(cur, v)
        pred = self.prediction.values() if self.prediction else None
        return self._base("sample", iteration=iteration, actual=r.to_dict(), predicted=pred,
                          ratio=self._ratios(r), peak_reset=self.reset_peak)

    def _ratios(self, r: Reading) -> dict[str, float | None] | None:
        if self.prediction is None:
            return None
        p = self.prediction.values()
        out: dict[str, float | None] = {}
        for a, b in COMPARED:
            av, pv = getattr(r, a), p.get(b)
            out[a] = round(av / pv, 4) if av is not None and pv else None
        return out

    def _check(self, iteration: int, r: Reading, record: Mapping[str, Any]) -> None:
        if self.warned is not None or self.prediction is None:
            return
        ratios = record.get("ratio") or {}
        worst = max(((k, v) for k, v in ratios.items() if v is not None), key=lambda kv: kv[1], default=None)
        if worst is None or worst[1] <= 1 + self.tolerance:
            return
        term, why = suspect_term(self.prediction, r, self.tolerance)
        metric = worst[0]
        pred_field = dict(COMPARED)[metric]
        actual, predicted = getattr(r, metric), getattr(self.prediction, pred_field)
        t = next((x for x in self.prediction.terms if x.name == term), None)
        msg = (f"[memguard] WARNING rank {self.rank} (pp{self.pp_rank}), iteration {iteration}: {metric.replace('_', ' ')} "
               f"{format_bytes(actual)} exceeds the predicted {format_bytes(predicted)} by {worst[1] - 1:.1%}; "
               f"biggest suspected term: {term}" + (f" (predicted {format_bytes(t.bytes)})" if t else "") + f" - {why}")
        self.warned = {"iteration": iteration, "metric": metric, "ratio": worst[1], "suspect": term, "why": why}
        self._write(self._base("warning", iteration=iteration, metric=metric, actual_bytes=actual, predicted_bytes=predicted,
                               ratio=worst[1], suspect=term, why=why))
        if self.print_warnings:
            self.emit(msg)

    # -- the per-stage view (rank 0) ---------------------------------------------------------------
    def _vector(self, r: Reading | None) -> list[float]:
        def f(v):
            return float(v) if v is not None else -1.0
        if r is None:
            return [float(self.pp_rank if self.pp_rank is not None else -1)] + [-1.0] * 6
        return [float(self.pp_rank if self.pp_rank is not None else -1), f(r.max_allocated), f(r.max_reserved),
                f(r.device_used), f(self.running["max_allocated"]), f(self.running["max_reserved"]),
                f(self.running["device_used"])]

    def _stage_line(self, head: str, pp: int, values: Sequence[float]) -> str:
        pred = self.stage_predictions.get(pp)
        parts = []
        for (name, pfield), v in zip((("max allocated", "peak_allocated"), ("max reserved", "peak_reserved"),
                                      ("device used", "device_total")), values):
            if v is None or v < 0:
                continue
            pv = pred.values().get(pfield) if pred else None
            if pv:
                parts.append(f"{name} {format_bytes(v)} / predicted {format_bytes(pv)} ({v / pv:.0%})")
            else:
                parts.append(f"{name} {format_bytes(v)}")
        return f"[memguard] {head} pp{pp}: " + (", ".join(parts) if parts else "no reading")

    def stage_lines(self, iteration: int) -> list[str]:
        return [self._stage_line(f"iteration {iteration}", pp, row[1:4]) for pp, row in sorted(self.stage_rows.items())]

    # -- out of memory ---------------------------------------------------------------------------------
    def oom_message(self, alloc: int | None = None, device_allocated: int | None = None, device_free: int | None = None) -> str:
        head = f"[memguard] rank {self.rank} (pp{self.pp_rank}) ran out of GPU memory"
        if alloc:
            head += f" allocating {format_bytes(alloc)}"
        if device_allocated is not None and device_free is not None:
            head += f" ({format_bytes(device_allocated)} allocated on the device, {format_bytes(device_free)} free)"
        if self.prediction is None:
            return head + "; no prediction for this rank"
        p = self.prediction
        lines = [head + f". memguard predicted for this rank: peak allocated {format_bytes(p.peak_allocated)}, "
                 f"peak reserved {format_bytes(p.peak_reserved)}, device total {format_bytes(p.device_total)}"
                 + (f", peaking at {p.peak_phase}" if p.peak_phase else "") + ":"]
        if p.stage is not None:
            from ..report.text import breakdown
            lines.append(breakdown(p.stage))
        else:
            lines.extend(f"  {t.name}: {format_bytes(t.bytes)}" for t in p.terms)
        return "\n".join(lines)

    def on_oom(self, device: int | None = None, alloc: int | None = None, device_allocated: int | None = None,
               device_free: int | None = None) -> None:
        """An out-of-memory observer (torch.cuda's signature): print the prediction next to PyTorch's error."""
        if self.oom_reported:
            return
        self.oom_reported = True
        try:
            self.emit_error(self.oom_message(alloc, device_allocated, device_free))
            self._write(self._base("oom", iteration=self.last_iteration, alloc_bytes=alloc, device_allocated_bytes=device_allocated,
                                   device_free_bytes=device_free, predicted=self.prediction.to_dict() if self.prediction else None))
        except Exception as e:
            self._error("oom report", e)

    # -- end ---------------------------------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        pred = self.prediction.values() if self.prediction else None
        ratio = None
        if pred:
            ratio = {a: (round(self.running[a] / pred[b], 4) if self.running[a] is not None and pred.get(b) else None)
                     for a, b in COMPARED}
        return self._base("summary", samples=self.samples, last_iteration=self.last_iteration, max=dict(self.running),
                          predicted=pred, ratio=ratio, warning=self.warned, errors=self.errors)

    def finish(self) -> dict[str, Any] | None:
        if self.finished:
            return None
        self.finished = True
        rec = None
        try:
            rec = self.summary()
            self._write(rec)
            if self.log_stages and self.stage_rows:
                self.emit(f"[memguard] summary after {self.samples} sample(s) (peaks over the run):")
                for pp, row in sorted(self.stage_rows.items()):
                    self.emit(self._stage_line("summary", pp, row[4:7]))
        except Exception as e:
            self._error("summary", e)
        for s in self.sinks:
            try:
                s.close()
            except Exception as e:
                self._error("sink close", e)
        try:
            self.source.stop()
        except Exception as e:
            self._error("source stop", e)
        return rec


# torch_stage_gather lives in torch_gather.py (loaded on first use of the name, see runtime/__init__.py)
def __getattr__(name: str) -> Any:
    if name == "torch_stage_gather":
        from .torch_gather import torch_stage_gather
        return torch_stage_gather
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
