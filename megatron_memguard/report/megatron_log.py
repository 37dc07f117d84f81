"""Read Megatron-LM's own training logs: memory lines, the argument table, iterations and out-of-memory errors.

What Megatron prints, from its source (megatron-core 0.17.0 ``megatron/training/utils.py`` and 0.19.2
``megatron/training/utils/common_utils.py``, ``training.py``, ``arguments.py``; the same text since
core_v0.16):

* ``report_memory(name)`` on data-parallel rank 0 of every (TP, PP, CP) position, from ``training_log``
  at the first logged iterations (until the second, once the optimizer state exists), every
  ``--log-memory-interval`` and around the first checkpoint saves::

      [Rank 3] (after 2 iterations) memory (MB) | allocated: 1234.56 | max allocated: 2345.67 | reserved: 2400.00 | max reserved: 2400.00

  "MB" is MiB (``/ (1024 * 1024)``); ``--log-device-memory-used`` appends ``| total device memory used:
  ...`` (NVML). Older Megatron printed the same fields unformatted (``allocated: 1234.5678...``).
* ``_print_args`` on rank 0 at start-up: every argument after ``validate_args``, one per line
  (``  name ......... value``, dots up to column 48) between ``---- arguments ----`` and
  ``---- end of arguments ----``.
* ``training_log``'s iteration line on the last rank (`` iteration   2/  10 | consumed samples: ...``)
  and, on rank 0 with the first memory report, ``Theoretical memory footprints: weight and optimizer=...
  MB, activation=... MB, total=... MB`` (Megatron's own estimate).
* PyTorch's out-of-memory error (c10/cuda/CUDACachingAllocator.cpp since torch 2.1: ``CUDA out of
  memory. Tried to allocate X. GPU 0 has a total capacity of X of which X is free. ... this process has X
  memory in use. Of the allocated memory X is allocated by PyTorch, and X is reserved by PyTorch but
  unallocated.``; torch 1.x / 2.0: ``(GPU 0; X total capacity; X already allocated; X free; X reserved
  in total by PyTorch)``), and memguard's own ``[memguard] rank N (ppK) ran out of GPU memory`` line.
* Lines of other tools that name the GPU (nvidia-smi's table, Lightning's hint, ...: ``report/device_mentions.py``).

Lines may carry launcher prefixes (``[default3]:``, ``3:``, ``[1,3]<stdout>:``), timestamps, and be
interleaved with other ranks' output, warnings and progress bars: every pattern is searched for
anywhere in a line. Pure Python; problems name the file.
"""
from __future__ import annotations

import ast
import dataclasses
import glob
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from ..errors import ReaderError
from .device_mentions import DeviceMention, device_mention, smi_board_memory

MiB = 1024 * 1024
MAX_LINE = 1 << 16                 # longer lines (a progress bar without newlines) are cut, not read whole
# Terminal colour / cursor codes (ESC [ ... letter) and NULs: a logger that colours its lines, or the NUL
# bytes a file system leaves where a crashed node's writes were lost. A value that keeps them
# (``None\x1b[0m``) no longer reads as the value it is.
_NOISE = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b[@-Z\\-_]")
MAX_OOMS = 64                      # out-of-memory messages analysed (a job ends at its ranks' first; launchers repeat them)
# memory lines kept per rank: past them, only a line that raises one of the rank's peaks, and its last steady and last
# checkpoint lines (a --log-memory-interval 1 run of 10**6 iterations held 590 MB of lines; what report and calibrate
# read of a rank is its first lines, its peaks and its last lines)
MAX_LINES_PER_RANK = 100_000
# ranks whose memory lines are read: Megatron prints them on data-parallel rank 0 of each model-parallel position (TP x
# PP x CP; 65,536 is TP 8 x PP 128 x CP 64); a log of 10**6 ranks' lines took 1.7 GB in report
MAX_RANKS = 65_536
MAX_DEVICE_LINES = 256            # lines naming the GPU kept (nvidia-smi prints one row per GPU of each node)
LOG_SUFFIXES = (".log", ".out", ".err", ".txt", ".stdout", ".stderr")

_NUM = r"([-+]?\d+(?:\.\d*)?(?:[eE][-+]?\d+)?)"
MEMORY_RE = re.compile(
    r"\[Rank (\d+)\] (.*?) ?memory \(MB\) \| allocated: " + _NUM + r" \| max allocated: " + _NUM
    + r" \| reserved: " + _NUM + r" \| max reserved: " + _NUM + r"(?: \| total device memory used: " + _NUM + ")?")
_AFTER_IT = re.compile(r"after (\d+) iterations?")
_SAVE = re.compile(r"(before|after) save_checkpoint for iteration (\d+)")
# (written to match in time linear in the line: a run of dashes is entered at its first dash only, and a value is
# taken to the end of the line and stripped after; '(.*?)\s*$' and '^\s*...\s+' were quadratic in a line of
# spaces, tens of seconds for one 64 KiB line)
ARGS_START = re.compile(r"(?<!-)-{8,} arguments -{8,}")
ARGS_END = re.compile(r"(?<!-)-{8,} end of arguments -{8,}")
_ARG = re.compile(r"(?:^|[\s:>\]])([A-Za-z_][A-Za-z0-9_]*) (\.+) (.*)$")
_ARG_LONG = re.compile(r"^(?:\s*\S*[:>\]])?\s+([A-Za-z_][A-Za-z0-9_]{47,})  (.*)$")   # names >= 48: no dots
ITERATION_RE = re.compile(r"\biteration\s+(\d+)/\s*(\d+) \|")
# training_log's timing fields (megatron/training/training.py, 0.8 to 0.19.2): the interval's mean wall time per
# iteration, and with --log-throughput the model TFLOP/s per GPU over it
ELAPSED_RE = re.compile(r"\| elapsed time per iteration \(ms\): ([0-9]{1,12}(?:\.[0-9]{1,6})?) \|")
TFLOPS_RE = re.compile(r"\| throughput per GPU \(TFLOP/s/GPU\): ([0-9]{1,9}(?:\.[0-9]{1,6})?) \|")
THEORY_RE = re.compile(r"Theoretical memory footprints: weight and optimizer=" + _NUM + r" MB, activation=" + _NUM
                       + r" MB, total=" + _NUM + " MB")
_SIZE = r"([\d.]+) (bytes|KiB|MiB|GiB|TiB)"
OOM_RE = re.compile(r"CUDA out of memory\. Tried to allocate " + _SIZE + r"\. GPU (\d+) has a total capacity of " + _SIZE
                    + r" of which " + _SIZE + r" is free\.(.*?)Of the allocated memory " + _SIZE
                    + r" is allocated by PyTorch, (?:with " + _SIZE + r" allocated in private pools \(e\.g\., CUDA Graphs\), )?"
                    + r"and " + _SIZE + r" is reserved by PyTorch but unallocated")
OOM_OLD_RE = re.compile(r"CUDA out of memory\. Tried to allocate " + _SIZE + r" \(GPU (\d+); " + _SIZE
                        + r" total capacity; " + _SIZE + r" already allocated; " + _SIZE + r" free; " + _SIZE
                        + r" reserved in total by PyTorch\)")
_PROC = re.compile(r"Including non-PyTorch memory, this process has " + _SIZE + r" memory in use")
_OTHER_PROC = re.compile(r"Process (\d+) has " + _SIZE + r" memory in use")
MEMGUARD_OOM_RE = re.compile(r"\[memguard\] rank (\d+) \(pp(-?\d+|None)\) ran out of GPU memory")
_PREFIX_RANK = (re.compile(r"^\[default(\d+)\]:"), re.compile(r"^(\d+): "), re.compile(r"^\[\d+,(\d+)\]<std(?:out|err)>:"),
                re.compile(r"^\[rank(\d+)\]:"))
_FILE_RANK = re.compile(r"rank[_-]?0*(\d+)", re.IGNORECASE)
_UNITS = {"bytes": 1, "KiB": 1024, "MiB": MiB, "GiB": 1024 * MiB, "TiB": 1024 ** 4}


def _bytes(num: str, scale: int) -> int:
    """``num`` x ``scale`` bytes; ValueError for what no GPU reports (``1.2.3``, ``1e400``, 2**63 bytes and up)."""
    v = float(num) * scale
    if not math.isfinite(v) or abs(v) >= 2**63:
        raise ValueError(f"{num} x {scale} bytes is out of range")
    return int(round(v))


def _size(num: str, unit: str) -> int:
    return _bytes(num, _UNITS[unit])


_LIMIT = float(2**63)               # _bytes' bound, for _values' inlined check


def _values(m: re.Match) -> tuple[int | None, ...] | None:
    """The five byte counts of a memory line whose rank and numbers a real run prints; None for a
    5000-digit rank, 1e400 MB or a negative count (skipped: torch.cuda's counters are never below zero, and a
    calibration or a report fed -1 MB reads a measurement no run made). Each number is parsed once (a log may hold
    10**6 such lines)."""
    if len(m.group(1)) > 19:
        return None
    out: list[int | None] = []
    for g in m.group(3, 4, 5, 6, 7):
        if g is None:
            out.append(None)
            continue
        v = float(g) * MiB          # (_NUM matched: float() takes it)
        if not 0 <= v < _LIMIT:    # also inf and nan: what _bytes refuses; and below zero
            return None
        out.append(round(v))
    return tuple(out)


@dataclass(frozen=True, slots=True)
class MemoryLine:
    """One ``report_memory`` line (bytes)."""

    rank: int
    name: str
    iteration: int | None      # "after K iterations", or the checkpoint's iteration
    allocated: int
    max_allocated: int
    reserved: int
    max_reserved: int
    device_used: int | None
    file: str
    line: int

    @property
    def at_checkpoint(self) -> bool:
        return "save_checkpoint" in self.name


@dataclass(frozen=True)
class OomEvent:
    """A CUDA out-of-memory error as PyTorch reports it (bytes; None where the message does not say)."""

    file: str
    line: int
    rank: int | None
    device: int
    requested: int
    capacity: int
    free: int
    allocated: int               # allocated by PyTorch (incl. private pools)
    reserved_unallocated: int | None
    process_used: int | None     # "this process has X memory in use" (incl. non-PyTorch memory)
    other_processes: int         # other processes on the same GPU
    reserved: int | None         # torch 1.x's "reserved in total"
    iteration: int | None        # the last iteration the log reached before it

    @property
    def needed(self) -> int:
        """Allocated memory the failed allocation would have brought the process to."""
        return self.allocated + self.requested


@dataclass
class MegatronLog:
    files: list[str]
    memory: list[MemoryLine] = field(default_factory=list)
    args: dict[str, Any] = field(default_factory=dict)
    args_text: dict[str, str] = field(default_factory=dict)
    args_file: str | None = None
    args_tables: int = 0
    args_complete: bool = True    # False: the table is cut off (no 'end of arguments' line)
    iterations: list[int] = field(default_factory=list)
    # (iteration, ms per iteration over the interval ending there, TFLOP/s per GPU or None) of training_log's lines
    iteration_times: list[tuple[int, float, float | None]] = field(default_factory=list)
    train_iters: int | None = None
    theoretical_mib: tuple[float, float, float] | None = None
    ooms: list[OomEvent] = field(default_factory=list)
    oom_messages: int = 0        # "CUDA out of memory" lines, analysed or not (MAX_OOMS are)
    memguard_oom_ranks: dict[int, int | None] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    devices: list[DeviceMention] = field(default_factory=list)   # lines naming the GPU (report/device_mentions.py)
    _index: dict[int, list[MemoryLine]] | None = field(default=None, repr=False, compare=False)
    skipped_ranks: int = 0      # memory lines of ranks past MAX_RANKS, not read
    bad_memory_lines: int = 0   # memory lines with numbers no GPU prints (_values), not read
    _counts: dict[int, int] = field(default_factory=dict, repr=False, compare=False)   # memory lines kept per rank
    _peaks: dict[int, tuple[int, int, int]] = field(default_factory=dict, repr=False, compare=False)
    _index_of: int = field(default=-1, repr=False, compare=False)

    @property
    def ranks(self) -> list[int]:
        return sorted(self.by_rank())

    def rank_lines(self, rank: int) -> list[MemoryLine]:
        return self.by_rank().get(rank, [])

    def by_rank(self) -> dict[int, list[MemoryLine]]:
        """Each rank's memory lines, in log order, grouped in one pass (a scan per rank was quadratic:
        20,000 ranks of one line each took 8 s)."""
        if self._index is None or self._index_of != len(self.memory):
            index: dict[int, list[MemoryLine]] = {}
            for m in self.memory:
                index.setdefault(m.rank, []).append(m)
            self._index, self._index_of = index, len(self.memory)
        return self._index

    @property
    def last_iteration(self) -> int | None:
        its = self.iterations + [m.iteration for m in self.memory if m.iteration is not None and not m.at_checkpoint]
        return max(its) if its else None


# ---- values of the argument table ------------------------------------------------------------------
def arg_value(text: str) -> Any:
    """A value as ``_print_args`` printed it (``str(value)``) back to Python: numbers, booleans, None,
    lists, tuples and dicts by ``ast.literal_eval``; ``torch.bfloat16`` stays a string; an enum member
    (``AttnBackend.auto``) becomes its name; anything else (paths, names) is the text itself."""
    t = text.strip()
    if not t:
        return ""
    try:
        return ast.literal_eval(t)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        pass
    m = re.fullmatch(r"<?([A-Z][A-Za-z0-9]*)\.([A-Za-z_][A-Za-z0-9_]*)(?::\s*[^>]*)?>?", t)
    if m and not t.startswith("torch."):
        return m.group(2)
    return t


def _rank_of_prefix(line: str) -> int | None:
    for rx in _PREFIX_RANK:
        m = rx.match(line)
        if m:
            return int(m.group(1))
    return None


# ---- reading -----------------------------------------------------------------------------------------
def find_log_files(paths: Sequence[str]) -> list[str]:
    """The log files among ``paths``: files as given; in a directory, its files ending in .log, .out, .err,
    .txt (any file when there are none)."""
    from .files import collect

    def in_dir(p: str) -> list[str]:
        every = sorted(f for f in glob.glob(os.path.join(p, "*")) if os.path.isfile(f))
        return [f for f in every if f.endswith(LOG_SUFFIXES)] or [f for f in every if not f.endswith(".jsonl")]

    return collect(paths, in_dir, lambda p: f"{p}: no memguard-rank*.jsonl files in this directory, nor Megatron log "
                   "files (the hook writes the first with --memguard-log-dir DIR or MEMGUARD_LOG_DIR)")


def _lines(path: str) -> Iterable[tuple[int, str]]:
    from .logfile import open_log
    try:
        f = open_log(path)     # (a sparse file's holes left out; UTF-16 by its byte-order mark)
    except OSError as e:
        raise ReaderError(f"{path}: cannot read ({e.strerror or e})") from None
    with f:
        n = 0
        while True:
            try:
                line = f.readline(MAX_LINE)
            except OSError as e:   # (a file that opens but fails to read: /proc/self/mem, a disk error mid-file)
                raise ReaderError(f"{path}: cannot read line {n + 1} ({e.strerror or e})") from None
            if not line:
                return
            n += 1
            if "\x00" in line:
                line = line.replace("\x00", "")
            if "\x1b" in line:
                line = _NOISE.sub("", line)
            # progress bars rewrite one line with carriage returns: each piece is a line of its own
            for piece in line.rstrip("\n").split("\r"):
                yield n, piece


def read_megatron_logs(paths: str | Sequence[str]) -> MegatronLog:
    """Parse Megatron training logs (stdout / stderr of any ranks, several files or directories)."""
    paths = [paths] if isinstance(paths, str) else list(paths)
    files = find_log_files(paths)
    log = MegatronLog(files=files)
    for path in files:
        _read_one(path, log)
    last = log.last_iteration          # an OOM ends the job: the last iteration any rank logged came before it
    log.ooms = [dataclasses.replace(ev, iteration=last) for ev in log.ooms]
    if log.oom_messages > MAX_OOMS:
        log.notes.append(f"{log.oom_messages:,} out-of-memory messages: the first {MAX_OOMS} are analysed")
    return log


def _read_one(path: str, log: MegatronLog) -> None:
    in_args = False
    table: dict[str, str] = {}
    file_ranks: set[int] = set()
    names: dict[str, str] = {}
    ooms: list[tuple[int, str, int | None]] = []
    later: dict[tuple[int, bool], MemoryLine] = {}   # a rank's last line past MAX_LINES_PER_RANK not yet kept
    smi_row = -1                                      # line of the last nvidia-smi device row (its memory is on the next)
    for n, line in _lines(path):
        if in_args:
            cut_off = "memory (MB)" in line and MEMORY_RE.search(line) is not None   # training began: the table ended
            if cut_off or ARGS_END.search(line):
                in_args = False
                log.args_text = table
                log.args = {k: arg_value(v) for k, v in table.items()}
                log.args_file = path
                log.args_complete = not cut_off
                if cut_off:
                    log.notes.append(f"{path}: the argument table has no 'end of arguments' line before line {n}; "
                                     "read up to there")
                else:
                    continue
            else:
                m = _ARG.search(line)
                if m and len(m.group(1)) + len(m.group(2)) == 48:    # _print_args pads name + dots to 48
                    table[m.group(1)] = m.group(3).rstrip()
                elif (m := _ARG_LONG.search(line)) is not None:
                    table[m.group(1)] = m.group(2).rstrip()
                continue
        # cheap substring tests first: a log has millions of lines, a few of them ours
        if "arguments --" in line and ARGS_START.search(line):
            in_args, table = True, {}
            log.args_tables += 1
        elif "memory (MB)" in line:
            m = MEMORY_RE.search(line)
            v = _values(m) if m else None
            if v is not None:
                name = m.group(2).strip()
                if len(names) < 10_000:   # (one string per distinct name; 'after K iterations' never repeats)
                    name = names.setdefault(name, name)
                it = _AFTER_IT.search(name) or _SAVE.search(name)
                it = it if it and len(it.group(it.lastindex)) <= 19 else None
                rank = int(m.group(1))
                file_ranks.add(rank)
                _keep(log, MemoryLine(rank, name, int(it.group(it.lastindex)) if it else None, *v, path, n), later)
            elif m is not None:
                if not log.bad_memory_lines:
                    log.notes.append(f"memory lines with numbers no GPU reports (a negative or out-of-range count, a "
                                     f"20-digit rank) are not read (first: {path} line {n})")
                log.bad_memory_lines += 1
        elif "iteration" in line and (m := ITERATION_RE.search(line)) is not None and len(m.group(0)) < 64:
            log.iterations.append(int(m.group(1)))
            log.train_iters = int(m.group(2))
            if (t := ELAPSED_RE.search(line)) is not None and len(log.iteration_times) < 100_000:
                tf = TFLOPS_RE.search(line)
                log.iteration_times.append((int(m.group(1)), float(t.group(1)), float(tf.group(1)) if tf else None))
        elif "Theoretical memory" in line and (m := THEORY_RE.search(line)) is not None:
            log.theoretical_mib = (float(m.group(1)), float(m.group(2)), float(m.group(3)))
        elif "ran out of GPU memory" in line and (m := MEMGUARD_OOM_RE.search(line)) is not None and len(m.group(0)) < 80:
            pp = m.group(2)
            log.memguard_oom_ranks[int(m.group(1))] = None if pp == "None" else int(pp)
        elif "CUDA out of memory" in line:
            log.oom_messages += 1
            if len(ooms) + len(log.ooms) < MAX_OOMS:
                ooms.append((n, line, _rank_of_prefix(line)))
        elif smi_row == n - 1 and (board := smi_board_memory(line)) is not None:
            log.devices[-1] = dataclasses.replace(log.devices[-1], total_bytes=board, board=True)
        elif len(log.devices) < MAX_DEVICE_LINES and (d := device_mention(line, path, n)) is not None:
            log.devices.append(d)
            smi_row = n if d.what == "nvidia-smi" else -1
    log.memory.extend(sorted(later.values(), key=lambda m: m.line))
    if later:
        log.notes.append(f"{path}: more than {MAX_LINES_PER_RANK:,} memory lines of a rank: past them only those that "
                         "raise a peak, and the last, are read")
    if in_args:
        log.notes.append(f"{path}: the argument table is cut off (no 'end of arguments' line); read as far as it goes")
        log.args_complete = False
        log.args_text, log.args, log.args_file = table, {k: arg_value(v) for k, v in table.items()}, path
    m = _FILE_RANK.search(os.path.basename(path))
    file_rank = next(iter(file_ranks)) if len(file_ranks) == 1 else (int(m.group(1)) if m else None)
    for n, text, prefix_rank in ooms:
        ev = parse_oom(text, path, n, prefix_rank if prefix_rank is not None else file_rank)
        if ev is not None:
            log.ooms.append(ev)


def skipped_memory_lines(log: MegatronLog) -> str:
    """What an error about a log without memory lines adds when it had some, all with numbers no GPU prints."""
    n = log.bad_memory_lines
    return (f" ({n:,} memory line(s) with numbers no GPU reports, a negative or out-of-range count, were not read)"
            if n else "")


def _keep(log: MegatronLog, m: MemoryLine, later: dict[tuple[int, bool], MemoryLine]) -> None:
    """Append ``m`` unless its rank has MAX_LINES_PER_RANK lines already and it raises none of the rank's peaks
    (max allocated, max reserved, device memory used); such a line waits in ``later`` as the rank's last."""
    counts, peaks = log._counts, log._peaks
    k = counts.get(m.rank, 0)
    if not k and len(counts) >= MAX_RANKS:
        if log.skipped_ranks == 0:
            log.notes.append(f"memory lines of more than {MAX_RANKS:,} ranks: those of further ranks are not read "
                             f"(first skipped: rank {m.rank})")
        log.skipped_ranks += 1
        return
    top = peaks.get(m.rank, (0, 0, 0))
    now = (m.max_allocated, m.max_reserved, m.device_used or 0)
    peaks[m.rank] = tuple(max(a, b) for a, b in zip(top, now))
    if k < MAX_LINES_PER_RANK or any(b > a for a, b in zip(top, now)):
        counts[m.rank] = k + 1
        later.pop((m.rank, m.at_checkpoint), None)    # (a kept line is later than the one waiting)
        log.memory.append(m)
    else:
        later[(m.rank, m.at_checkpoint)] = m


def parse_oom(text: str, file: str = "", line: int = 0, rank: int | None = None,
              iteration: int | None = None) -> OomEvent | None:
    """The numbers of a PyTorch CUDA out-of-memory message (None if ``text`` holds none, or numbers no GPU has)."""
    try:
        return _parse_oom(text, file, line, rank, iteration)
    except ValueError:
        return None


def _parse_oom(text: str, file: str, line: int, rank: int | None, iteration: int | None) -> OomEvent | None:
    m = OOM_RE.search(text)
    if m:
        g = m.groups()
        middle = g[7]
        proc = _PROC.search(middle)
        others = sum(_size(x.group(2), x.group(3)) for x in _OTHER_PROC.finditer(middle))
        allocated = _size(g[8], g[9])
        return OomEvent(file=file, line=line, rank=rank, device=int(g[2]), requested=_size(g[0], g[1]),
                        capacity=_size(g[3], g[4]), free=_size(g[5], g[6]), allocated=allocated,
                        reserved_unallocated=_size(g[12], g[13]), process_used=_size(proc.group(1), proc.group(2)) if proc
                        else None, other_processes=others, reserved=None, iteration=iteration)
    m = OOM_OLD_RE.search(text)
    if m:
        g = m.groups()
        allocated, reserved = _size(g[5], g[6]), _size(g[9], g[10])
        return OomEvent(file=file, line=line, rank=rank, device=int(g[2]), requested=_size(g[0], g[1]),
                        capacity=_size(g[3], g[4]), free=_size(g[7], g[8]), allocated=allocated,
                        reserved_unallocated=reserved - allocated, process_used=None, other_processes=0,
                        reserved=reserved, iteration=iteration)
    return None


__all__ = ["MegatronLog", "MemoryLine", "OomEvent", "read_megatron_logs", "parse_oom", "arg_value", "find_log_files"]
