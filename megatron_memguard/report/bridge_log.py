"""Read what a Megatron-Bridge or NeMo 2 (Lightning) run prints that Megatron-LM's logs do not: the memory report
in gigabytes, NeMo 2's progress lines, and the lines that give the world size.

From the libraries' sources:

* Megatron-Bridge 0.6.2 ``training/utils/train_utils.py`` ``training_log`` (l.1228-1233) prints, on data-parallel
  rank 0 of every model-parallel position, at the first logged iterations until one after the first (the
  optimizer state then exists)::

      [Rank 3] (after 10 iterations) memory (GB) | mem-allocated-gigabytes: 30.123 | mem-active-gigabytes: ... | mem-reserved-gigabytes: 47.0 | mem-max-allocated-gigabytes: 45.679 | ... | mem-max-reserved-gigabytes: 47.0 | mem-alloc-retires: 0 | mem-allocated-count: 1234

  ``report_memory`` (l.1245-1298) names each ``torch.cuda.memory_stats()`` key of ``MEMORY_KEYS`` (l.258-269)
  with "bytes" replaced by "gigabytes" and divides by 1e9, rounded to 5 significant digits (so GB is 10**9 bytes,
  not GiB; a ``logger.memory_keys`` of the user's may rename or drop fields). It is printed after the
  optimizer step, like Megatron's ``report_memory``. The iteration line of the same function is Megatron's
  (``iteration N/ M | ... | elapsed time per iteration (ms): X |``) and is read by :mod:`.megatron_log`.
* Bridge's ``initialize.py`` (l.788) with its own process groups: ``> initialized HyperCommGrid with tp=2, pp=1,
  cp=1, dp=4`` (rank 0); megatron-core's ``num_microbatches_calculator.py`` (l.292, logger.info on rank 0):
  ``setting number of microbatches to constant 8``.
* NeMo 2 (nemo_toolkit 2.4.0) ``lightning/pytorch/callbacks/progress_printer.py`` (l.139-142, format_string
  l.55-63) prints every ``log_interval`` steps, the metrics averaged over the interval at 4 significant digits::

      Training epoch 0, iteration 9/99 | lr: 0.0003 | global_batch_size: 32 | global_step: 9 | reduced_train_loss: 10.47 | train_step_timing in s: 1.234 | consumed_samples: 320

  ``train_step_timing in s`` is ``TimingCallback``'s wall time of one training step (``utils/exp_manager.py``).
  NeMo 2's ``MemoryMonitor`` (``memory_callback.py``) only logs its numbers to the experiment loggers, not to
  stdout. Lightning's strategies (``megatron_strategy.py`` l.587) log ``Initializing distributed: GLOBAL_RANK: 0,
  MEMBER: 1/8`` (the world size is the number after the slash).

Launcher prefixes and interleaved ranks are handled as in :mod:`.megatron_log` (every pattern is searched for
anywhere in a line). Pure Python.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Sequence

from .megatron_log import MemoryLine, _lines, find_log_files

GB = 10**9          # report_memory divides by 1.0e9
_NUM = r"[-+]?\d+(?:\.\d*)?(?:[eE][-+]?\d+)?"
# (each value must end the line or be followed by the next field: two ranks' prints merged into one line, or a line cut
# off inside a number, would otherwise read a number no rank printed)
MEMORY_GB_RE = re.compile(r"\[Rank (\d{1,9})\] \(after (\d{1,12}) iterations?\) memory \(GB\)((?: \| [A-Za-z0-9_.-]{1,64}: "
                          + _NUM + r"(?= \||\s*$))+)\s*$")
_FIELD = re.compile(r" \| ([A-Za-z0-9_.-]{1,64}): (" + _NUM + ")")
GRID_RE = re.compile(r"> initialized HyperCommGrid with tp=(\d{1,6}), pp=(\d{1,6}), cp=(\d{1,6}), dp=(\d{1,9})")
MICROBATCHES_RE = re.compile(r"setting number of microbatches to constant (\d{1,9})\b")
MEMBER_RE = re.compile(r"Initializing distributed: GLOBAL_RANK: \d{1,9}, MEMBER: \d{1,9}/(\d{1,9})")
NEMO_PROGRESS_RE = re.compile(r"\bTraining epoch \d{1,9}, iteration (\d{1,12})/(-?\d{1,12}) \|")
# Bridge's rank-0 line before each iteration line (train_utils.py l.1133-1135): the interval's seconds per iteration
STEP_TIME_RE = re.compile(r"\bStep Time : (\d{1,9}\.\d\d)s GPU utilization: (\d{1,9}\.\d)MODEL_TFLOP/s/GPU")
_STEP_TIMING = re.compile(r"\| train_step_timing in s: (" + _NUM + r")(?: \||$)")
MAX_LINES = 1_000_000    # memory / progress lines kept (a log_interval 1 run of 10**6 steps)


@dataclass(frozen=True, slots=True)
class GbMemoryLine:
    """One Bridge memory report (bytes; None: the field was not logged)."""

    rank: int
    iteration: int
    allocated: int | None
    reserved: int | None
    max_allocated: int | None
    max_reserved: int | None
    file: str
    line: int


@dataclass
class BridgeLog:
    files: list[str]
    memory: list[GbMemoryLine] = field(default_factory=list)
    # (iteration, ms per step averaged over the interval, None) of NeMo 2's progress lines: the shape of
    # MegatronLog.iteration_times, so the time fit reads both alike
    nemo_times: list[tuple[int, float, float | None]] = field(default_factory=list)
    nemo_lines: list[int] = field(default_factory=list)   # their line numbers
    # Bridge's 'Step Time' lines (rank 0), numbered 1, 2, ... in log order: (n, ms, TFLOP/s per GPU)
    step_times: list[tuple[int, float, float | None]] = field(default_factory=list)
    nemo_progress: int = 0          # NeMo 2 progress lines, with or without a step time
    grid: tuple[int, int, int, int] | None = None      # (tp, pp, cp, dp) of Bridge's HyperCommGrid line
    microbatches: int | None = None
    world_size: int | None = None   # Lightning's MEMBER line
    bad_lines: int = 0              # memory lines with numbers no GPU reports, cut off or merged with another line
    notes: list[str] = field(default_factory=list)

    @property
    def is_bridge(self) -> bool:
        return bool(self.memory or self.nemo_progress or self.grid or self.step_times)

    def by_rank(self) -> dict[int, list[GbMemoryLine]]:
        out: dict[int, list[GbMemoryLine]] = {}
        for m in self.memory:
            out.setdefault(m.rank, []).append(m)
        return out


def _gb(text: str) -> int | None:
    """Bytes of a gigabyte figure; None for what no GPU reports (negative, inf, 2**63 bytes and up)."""
    v = float(text) * GB
    return round(v) if math.isfinite(v) and 0 <= v < 2.0**63 else None


def _memory_line(m: re.Match, path: str, n: int) -> GbMemoryLine | None:
    fields = {k: v for k, v in _FIELD.findall(m.group(3))}
    vals = {}
    for key in ("mem-allocated-gigabytes", "mem-reserved-gigabytes", "mem-max-allocated-gigabytes",
                "mem-max-reserved-gigabytes"):
        if key in fields:
            b = _gb(fields[key])
            if b is None:
                return None
            vals[key] = b
    return GbMemoryLine(int(m.group(1)), int(m.group(2)), vals.get("mem-allocated-gigabytes"),
                        vals.get("mem-reserved-gigabytes"), vals.get("mem-max-allocated-gigabytes"),
                        vals.get("mem-max-reserved-gigabytes"), path, n)


def _ends_with_newline(path: str) -> bool:
    """Whether the file's last line is complete: a job killed mid-print leaves it cut off, and a number cut short
    reads as another number."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            if f.tell() == 0:
                return True
            f.seek(-1, 2)
            return f.read(1) in (b"\n", b"\r")
    except OSError:
        return True     # (_lines reports the error)


def read_bridge_logs(paths: str | Sequence[str]) -> BridgeLog:
    """The Bridge / NeMo 2 lines of the log files under ``paths`` (files, or directories of one run's logs)."""
    paths = [paths] if isinstance(paths, str) else list(paths)
    log = BridgeLog(files=find_log_files(paths))
    for path in log.files:
        n_mem, n_times, final = len(log.memory), len(log.nemo_times), 0
        for n, line in _lines(path):
            final = n
            # cheap substring tests first: a log has millions of lines, a few of them ours
            if "memory (GB)" in line:
                m = MEMORY_GB_RE.search(line)
                ml = _memory_line(m, path, n) if m is not None else None
                if ml is None and "[Rank " in line:
                    if not log.bad_lines:
                        log.notes.append(f"memory lines cut off, merged with another line or with numbers no GPU "
                                         f"reports are not read (first: {path} line {n})")
                    log.bad_lines += 1
                elif len(log.memory) < MAX_LINES:
                    log.memory.append(ml)
            elif "Training epoch" in line and (m := NEMO_PROGRESS_RE.search(line)) is not None:
                log.nemo_progress += 1
                t = _STEP_TIMING.search(line, m.end() - 1)
                if t is not None and len(log.nemo_times) < MAX_LINES:
                    s = float(t.group(1))
                    if math.isfinite(s) and 0 < s < 1e6:
                        log.nemo_times.append((int(m.group(1)), s * 1000.0, None))
                        log.nemo_lines.append(n)
            elif "Step Time" in line and (m := STEP_TIME_RE.search(line)) is not None:
                if len(log.step_times) < MAX_LINES:
                    log.step_times.append((len(log.step_times) + 1, float(m.group(1)) * 1000.0, float(m.group(2))))
            elif "HyperCommGrid" in line and (m := GRID_RE.search(line)) is not None:
                log.grid = tuple(int(x) for x in m.groups())  # type: ignore[assignment]
            elif "microbatches" in line and (m := MICROBATCHES_RE.search(line)) is not None:
                log.microbatches = int(m.group(1))
            elif "MEMBER" in line and (m := MEMBER_RE.search(line)) is not None:
                log.world_size = int(m.group(1))
        if not _ends_with_newline(path):     # the last line is cut off: what it read is not what the run printed
            if len(log.memory) > n_mem and log.memory[-1].line == final:
                log.memory.pop()
                log.bad_lines += 1
                log.notes.append(f"{path}: its last line is cut off (no newline): its memory report is not read")
            if len(log.nemo_times) > n_times and log.nemo_lines[-1] == final:
                log.nemo_times.pop()
    return log


def as_memory_lines(blog: BridgeLog) -> list[MemoryLine]:
    """The reports that carry all four counters, as Megatron's memory lines (what ``memguard report`` reads); a
    report without one of them (a ``logger.memory_keys`` of the user's) is left out."""
    return [MemoryLine(m.rank, f"(after {m.iteration} iterations)", m.iteration, m.allocated, m.max_allocated,
                       m.reserved, m.max_reserved, None, m.file, m.line)
            for m in blog.memory if None not in (m.allocated, m.max_allocated, m.reserved, m.max_reserved)]


__all__ = ["BridgeLog", "GbMemoryLine", "read_bridge_logs", "as_memory_lines", "GB"]
