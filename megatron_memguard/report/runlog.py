"""Read the runtime JSONL files of a run (schema ``memguard.runtime/1``) and compare actual with predicted.

The Megatron hook (``--memguard-log-dir``) and the framework callbacks write one file per rank,
``memguard-rank{rank:05d}.jsonl``, one JSON object per line (events ``start``, ``sample``,
``warning``, ``oom``, ``summary``; docs/hook.md). A restarted job appends to the same files: each
``start`` record opens a new run segment, and the report shows the last one unless asked for all.

Pure Python (no torch, no matplotlib). Every problem names the file and the line.
"""
from __future__ import annotations

import glob
import json
import math
import os
from dataclasses import dataclass, field
from typing import IO, Any, Callable, Iterable, Iterator, Sequence

from ..errors import ReaderError
from .logfile import open_log
from ..files import json_int
from ..numbers import INT64_MAX, shown
from ..runtime.monitor import COMPARED
from ..runtime.sinks import SCHEMA

EVENTS = ("start", "sample", "warning", "oom", "summary")
FILE_GLOB = "memguard-rank*.jsonl"
METRICS = tuple(a for a, _ in COMPARED)          # max_allocated, max_reserved, device_used
PREDICTED_OF = dict(COMPARED)                      # actual field -> predicted field
MAX_LINE = 2**20                                   # characters of one record line (real ones: under 2 KiB)
METRIC_LABELS = {"max_allocated": "peak allocated", "max_reserved": "peak reserved", "device_used": "device used"}


@dataclass(frozen=True, slots=True)
class Sample:
    iteration: int
    actual: dict[str, int | None]
    predicted: dict[str, int | None]
    line: int

    def value(self, metric: str) -> int | None:
        return self.actual.get(metric)

    def prediction(self, metric: str) -> int | None:
        return self.predicted.get(PREDICTED_OF[metric])


@dataclass
class RankRun:
    """One rank's records of one run segment (or of all segments, with ``--run all``)."""

    rank: int
    path: str
    pp_rank: int | None = None
    source: str | None = None
    interval: int | None = None
    tolerance: float | None = None
    reset_peak: bool | None = None
    start: dict[str, Any] | None = None
    samples: list[Sample] = field(default_factory=list)
    warnings: list[dict[str, Any]] = field(default_factory=list)
    ooms: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] | None = None
    segments: int = 1          # run segments in the file
    segment: str = "last"      # which this is: "last" or "all"
    _memo: dict[tuple, Any] = field(default_factory=dict, repr=False, compare=False)

    # -- comparisons ------------------------------------------------------------------------------
    def predicted(self, metric: str) -> int | None:
        """The prediction compared with ``metric`` (the last sample's, else the start record's)."""
        for s in reversed(self.samples):
            v = s.prediction(metric)
            if v:
                return v
        p = (self.start or {}).get("predicted") or {}
        return p.get(PREDICTED_OF[metric]) or None

    def moe_worst_case(self) -> dict[str, Any] | None:
        """The MoE worst-case figures of the rank's stage (peak allocated / reserved / device total with
        the dispatcher's worst routing), from the start record's prediction; None for dense runs."""
        return ((self.start or {}).get("predicted") or {}).get("moe_worst_case")

    def peak(self, metric: str) -> int | None:
        """The largest actual value over the samples."""
        key = ("peak", metric, len(self.samples))
        if key not in self._memo:
            vals = [v for s in self.samples if (v := s.actual.get(metric)) is not None]
            self._memo[key] = max(vals) if vals else None
        return self._memo[key]

    def ratio(self, metric: str) -> float | None:
        """Largest actual / predicted over the samples (each sample against its own prediction)."""
        # remembered per number of samples: the report asks ~80 times, and a log may hold 10**6 samples
        key = ("ratio", metric, len(self.samples))
        if key not in self._memo:
            best, pk = None, PREDICTED_OF[metric]
            for s in self.samples:
                a, p = s.actual.get(metric), s.predicted.get(pk)
                if a is not None and p:
                    r = a / p
                    best = r if best is None or r > best else best
            self._memo[key] = best
        return self._memo[key]

    def error(self, metric: str) -> float | None:
        """Relative error of the prediction: actual peak / predicted - 1 (positive: under-predicted)."""
        r = self.ratio(metric)
        return None if r is None else r - 1.0

    @property
    def iterations(self) -> list[int]:
        return [s.iteration for s in self.samples]

    def exceeded(self, tolerance: float) -> list[str]:
        """The metrics whose actual exceeded the prediction by more than ``tolerance``."""
        return [m for m in METRICS if (self.ratio(m) or 0.0) > 1.0 + tolerance + 1e-12]

    def to_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank, "pp_rank": self.pp_rank, "file": self.path, "source": self.source,
            "interval": self.interval, "reset_peak": self.reset_peak, "segments": self.segments,
            "samples": len(self.samples),
            "first_iteration": self.samples[0].iteration if self.samples else None,
            "last_iteration": self.samples[-1].iteration if self.samples else None,
            **{f"predicted_{PREDICTED_OF[m]}": self.predicted(m) for m in METRICS},
            **{f"actual_{m}": self.peak(m) for m in METRICS},
            **{f"error_{m}": self.error(m) for m in METRICS},
            "warnings": self.warnings, "ooms": self.ooms,
            # MoE runs: the stage's peak allocated / reserved / device total with the dispatcher's worst routing
            **({"predicted_moe_worst_case": self.moe_worst_case()} if self.moe_worst_case() else {}),
        }


@dataclass
class RunLog:
    location: str
    ranks: list[RankRun]
    files: list[str]
    notes: list[str] = field(default_factory=list)
    skipped_lines: list[str] = field(default_factory=list)

    @property
    def stages(self) -> dict[int, list[RankRun]]:
        """Ranks per pipeline stage (ranks without a stage under -1)."""
        out: dict[int, list[RankRun]] = {}
        for r in self.ranks:
            out.setdefault(r.pp_rank if r.pp_rank is not None else -1, []).append(r)
        return dict(sorted(out.items()))

    @property
    def tolerance(self) -> float:
        tols = [r.tolerance for r in self.ranks if r.tolerance is not None]
        return max(tols) if tols else 0.05

    def rank(self, rank: int) -> RankRun:
        return next(r for r in self.ranks if r.rank == rank)

    def has(self, metric: str) -> bool:
        return any(r.peak(metric) is not None and r.predicted(metric) for r in self.ranks)

    def to_dict(self) -> dict[str, Any]:
        return {"schema": "memguard.report/1", "location": self.location, "files": self.files,
                "tolerance": self.tolerance, "ranks": [r.to_dict() for r in self.ranks], "notes": self.notes}


# ---- reading ----------------------------------------------------------------------------------------
def find_files(paths: Sequence[str]) -> list[str]:
    """The JSONL files of the run: ``memguard-rank*.jsonl`` in each directory (any ``*.jsonl`` when there
    is none), or the files given."""
    from .files import collect

    def in_dir(p: str) -> list[str]:
        def files(pattern: str) -> list[str]:   # (a named pipe or directory by that name would block or fail)
            return sorted(f for f in glob.glob(os.path.join(p, pattern)) if os.path.isfile(f))
        return files(FILE_GLOB) or files("*.jsonl")

    return collect(paths, in_dir, lambda p: f"{p}: no {FILE_GLOB} files in this directory (the hook writes them "
                   "with --memguard-log-dir DIR or MEMGUARD_LOG_DIR)", missing="no such directory")


def _huge(v: Any) -> bool:
    """An integer too long to hold (json_int kept its digits as text) or beyond 64 bits."""
    return (isinstance(v, str) and v.lstrip("-").isdigit()) or (isinstance(v, int) and abs(v) > INT64_MAX)


def _int(v: Any) -> int | None:
    if v is None:
        return None
    if _huge(v):  # counters are 64-bit (torch.cuda.memory_stats, iteration numbers)
        raise ValueError(f"expected a number below 2**63, got {shown(v)}")
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, float) and not math.isfinite(v)):
        raise ValueError(f"expected a number, got {shown(v)}")
    return int(v)


def _count(v: Any) -> int | None:
    """A byte count as torch reports it: a whole number >= 0 (a negative or fractional one is no reading memguard
    writes; the report would draw it)."""
    n = _int(v)
    if n is not None and (n < 0 or n != v):
        raise ValueError(f"expected a byte count (a whole number >= 0), got {shown(v)}")
    return n


def _field(rec: dict, key: str, check: Callable[[Any], Any]) -> Any:
    """``check(rec[key])`` (None when absent), the error naming the field."""
    try:
        return check(rec.get(key))
    except ValueError as e:
        raise ValueError(f"'{key}': {e}") from None


def _tolerance(v: Any) -> float | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise ValueError(f"expected a number >= 0, got {shown(v)}")
    return float(v)


def _text(v: Any) -> str | None:
    if v is not None and not isinstance(v, str):
        raise ValueError(f"expected a string, got {shown(v)}")
    return v


def _bytes_dict(d: Any, keys: Iterable[str], what: str) -> dict[str, int | None]:
    if not isinstance(d, dict):
        raise ValueError(f"'{what}' must be an object, got {type(d).__name__}")
    out = {}
    for k in keys:
        try:
            out[k] = _count(d.get(k))
        except ValueError as e:
            raise ValueError(f"'{what}.{k}': {e}") from None
    return out


_DECODER = json.JSONDecoder(parse_int=json_int)     # one for every line (json.loads builds one per call)


def _lines(f: IO[str], path: str = "") -> Iterator[str | None]:
    """The lines of ``f``; None for a line longer than MAX_LINE characters (read past, not kept). ReaderError
    naming ``path`` when a read fails (a file that opens but cannot be read: /proc/self/mem, a disk error)."""
    n = 0
    try:
        while True:
            line = f.readline(MAX_LINE + 1)
            if not line:
                return
            n += 1
            if len(line) > MAX_LINE:
                while line and not line.endswith("\n"):
                    line = f.readline(MAX_LINE)
                yield None
                continue
            yield line
    except OSError as e:
        raise ReaderError(f"{path or f.name}: cannot read line {n + 1} ({e.strerror or e})") from None


def read_file(path: str, run: str = "last", skip_bad_lines: bool = False,
              warn: Callable[[str], None] | None = None) -> RankRun | None:
    """One rank's file. ``run``: ``last`` (the last start-to-end segment) or ``all``. Returns None for a
    file without records."""
    segments: list[list[tuple[int, dict]]] = [[]]
    dropped = 0                  # earlier segments read past (run == "last")
    last_pred: Any = None
    rank: int | None = None
    try:
        f = open_log(path)  # binary garbage: a bad line, not a traceback (a sparse file's holes left out)
    except OSError as e:
        raise ReaderError(f"{path}: cannot read ({e.strerror or e})") from None

    def bad(n: int, why: str) -> None:
        msg = f"{path} line {n}: {why}"
        if not skip_bad_lines:
            raise ReaderError(msg + " (--skip-bad-lines skips such lines)")
        if warn:
            warn(msg + "; skipped")

    with f:
        for n, line in enumerate(_lines(f, path), 1):
            if line is None:
                bad(n, f"longer than {MAX_LINE:,} characters (a memguard record is under 2 KiB)")
                continue
            if not line.strip():
                continue
            try:
                rec = _DECODER.decode(line)
            except json.JSONDecodeError as e:
                bad(n, f"not valid JSON ({e.msg} at column {e.colno})")
                continue
            except RecursionError:
                bad(n, "not valid JSON (nested deeper than a record can be)")
                continue
            if not isinstance(rec, dict):
                bad(n, f"expected a JSON object, got {type(rec).__name__}")
                continue
            schema = rec.get("schema")
            if schema != SCHEMA:
                bad(n, f"not a {SCHEMA} record (schema {shown(schema)})" if schema else
                    f"not a memguard runtime record (no 'schema' field; expected {SCHEMA!r})")
                continue
            event = rec.get("event")
            if event not in EVENTS:
                bad(n, f"unknown event {shown(event)} (expected one of {', '.join(EVENTS)})")
                continue
            r = rec.get("rank")
            if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r <= INT64_MAX:
                bad(n, f"'rank' must be an integer in [0, 2**63), got {shown(r)}")
                continue
            if rank is None:
                rank = r
            elif r != rank:
                bad(n, f"rank {r} in the file of rank {rank} (one file per rank)")
                continue
            if event == "sample":
                it = rec.get("iteration")
                if isinstance(it, bool) or not isinstance(it, int) or abs(it) > INT64_MAX:
                    bad(n, f"sample without an integer 'iteration' below 2**63 (got {shown(it)})")
                    continue
                if not isinstance(rec.get("actual"), dict):
                    bad(n, "sample without an 'actual' object")
                    continue
            if event == "start" and segments[-1]:
                if run == "last":
                    segments[-1] = []     # (only the last segment is read: an earlier one is not kept)
                    dropped += 1
                else:
                    segments.append([])
            if event == "sample":
                # a file may hold 10**6 samples: keep what the report reads, with one copy of a prediction
                # that does not change (2.7 GB -> a few hundred MB)
                pred = rec.get("predicted")
                if pred is not None and pred == last_pred:
                    pred = last_pred
                last_pred = pred
                rec = {"event": "sample", "iteration": rec["iteration"], "actual": rec["actual"], "predicted": pred,
                       **({"pp_rank": rec["pp_rank"]} if "pp_rank" in rec else {})}
            segments[-1].append((n, rec))
    if rank is None:
        return None
    chosen = [x for seg in segments for x in seg] if run == "all" else segments[-1]
    out = RankRun(rank=rank, path=path, segments=len(segments) + dropped, segment=run)
    memo: tuple[Any, Any] = (None, None)      # (a prediction object read, its byte counts)
    for i, (n, rec) in enumerate(chosen):
        chosen[i] = None           # type: ignore[call-overload]  # (the raw record is read once: let it go)
        ev = rec["event"]
        try:
            pp_rank = _field(rec, "pp_rank", _int)
            if ev == "start":
                fields = (_field(rec, "source", _text), _field(rec, "interval", _int),
                          _field(rec, "tolerance", _tolerance))
                if rec.get("reset_peak") is not None and not isinstance(rec["reset_peak"], bool):
                    raise ValueError(f"'reset_peak': expected true or false, got {shown(rec['reset_peak'])}")
                # the report reads the start record's prediction (and its MoE worst case) as objects of byte counts
                if rec.get("predicted") is not None:
                    _bytes_dict(rec["predicted"], ("peak_allocated", "peak_reserved", "device_total", "persistent"),
                                "predicted")
                    worst = rec["predicted"].get("moe_worst_case")
                    if worst is not None:
                        _bytes_dict(worst, ("peak_allocated", "peak_reserved", "device_total"), "predicted.moe_worst_case")
                out.start = rec
                out.source, out.interval, out.tolerance = fields
                out.reset_peak = rec.get("reset_peak")
            elif ev == "sample":
                actual = _bytes_dict(rec["actual"], ("allocated", "reserved", *METRICS), "actual")
                pred = rec.get("predicted") or {}
                if pred is not memo[0]:
                    memo = (pred, _bytes_dict(pred, ("peak_allocated", "peak_reserved", "device_total", "persistent"),
                                              "predicted"))
                predicted = memo[1]
                out.samples.append(Sample(rec["iteration"], actual, predicted, n))
            elif ev in ("warning", "oom"):
                # the numbers the report draws and prints
                _field(rec, "iteration", _int)
                for k in ("actual_bytes", "predicted_bytes", "alloc_bytes"):
                    _field(rec, k, _count)
                (out.warnings if ev == "warning" else out.ooms).append(rec)
            elif ev == "summary":
                out.summary = rec
        except ValueError as e:
            bad(n, str(e))
            continue
        if pp_rank is not None:
            out.pp_rank = pp_rank
    return out


def read_run(paths: str | Sequence[str], run: str = "last", skip_bad_lines: bool = False,
             warn: Callable[[str], None] | None = None) -> RunLog:
    """Every rank's records from a log directory (or files). Raises ReaderError naming file and line."""
    if run not in ("last", "all"):
        raise ReaderError(f"--run: expected 'last' or 'all', got {run!r}")
    paths = [paths] if isinstance(paths, str) else list(paths)
    files = find_files(paths)
    ranks: dict[int, RankRun] = {}
    notes: list[str] = []
    empty: list[str] = []
    for path in files:
        rr = read_file(path, run=run, skip_bad_lines=skip_bad_lines, warn=warn)
        if rr is None:
            empty.append(path)
            continue
        if rr.rank in ranks:
            raise ReaderError(f"{path}: rank {rr.rank} is also in {ranks[rr.rank].path}; give the files of one run")
        ranks[rr.rank] = rr
    if not ranks:
        raise ReaderError(f"{', '.join(paths)}: no memguard records in {len(files)} file(s)"
                          + (" (all empty)" if empty else ""))
    if empty:
        notes.append(f"{len(empty)} file(s) without records: " + ", ".join(os.path.basename(p) for p in empty[:4])
                     + (" ..." if len(empty) > 4 else ""))
    restarted = [r for r in ranks.values() if r.segments > 1]
    if restarted:
        most = max(r.segments for r in restarted)
        notes.append(f"{len(restarted)} rank file(s) hold {most} runs (the job restarted and appended); "
                     + ("showing the last run (--run all shows every run)" if run == "last" else "showing every run"))
    nosample = [r.rank for r in ranks.values() if not r.samples]
    if nosample:
        notes.append(f"{len(nosample)} rank(s) without samples (did the run reach its first log interval?): "
                     + ", ".join(map(str, nosample[:8])) + (" ..." if len(nosample) > 8 else ""))
    location = paths[0] if len(paths) == 1 else f"{len(paths)} paths"
    return RunLog(location=location, ranks=[ranks[k] for k in sorted(ranks)], files=files, notes=notes)
