"""Opening a run's log file (Megatron's text logs, memguard's JSONL) as text, line by line, whatever it holds.

Two things a log file can hold that the readers should not spend seconds on or misread:

* **holes**: a sparse file (a job that died after its file was extended, ``truncate -s 2G``) reads as NUL bytes
  where no data was written. The readers drop NULs (a lost write's padding), so the holes are left out without
  being read: ``lseek(SEEK_DATA / SEEK_HOLE)`` finds the data, and a 2 GiB sparse file is read in milliseconds
  (it took 2-8 s of CPU). Only files of SPARSE_MIN bytes and more: a /proc file says size 0 and holds data.
* **UTF-16 / UTF-32 text** with its byte-order mark (Windows PowerShell's ``>`` writes UTF-16): decoded in that
  encoding (read as UTF-8, dropping the NULs beside each character kept its ASCII characters only).

Anything else is UTF-8, undecodable bytes replaced (binary garbage is a bad line, not an exception).
"""
from __future__ import annotations

import errno
import io
import os
import stat
from typing import IO

BUFFER = 1 << 20     # bytes per read: two lseek calls per MiB, nothing next to reading it
# files from this size on are read around their holes; smaller ones as they are (a /proc or /sys file has size 0 and
# data, which SEEK_DATA would call a hole)
SPARSE_MIN = 16 << 20


class _DataOnly(io.RawIOBase):
    """A regular file's bytes without its holes (``lseek``'s SEEK_DATA / SEEK_HOLE; where the file system cannot
    tell, every byte is data)."""

    def __init__(self, fd: int):
        super().__init__()
        self._fd = fd
        self._pos = 0

    def readable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._fd

    def readinto(self, b) -> int:  # type: ignore[override]
        start, end = self._pos, None
        try:
            start = os.lseek(self._fd, self._pos, os.SEEK_DATA)
            end = os.lseek(self._fd, start, os.SEEK_HOLE)
        except OSError as e:
            if e.errno == errno.ENXIO:    # a hole from here to the end of the file
                return 0
        want = len(b) if end is None else max(1, min(len(b), end - start))
        data = os.pread(self._fd, want, start)
        b[:len(data)] = data
        self._pos = start + len(data)
        return len(data)

    def close(self) -> None:
        if not self.closed:
            os.close(self._fd)
        super().close()


def _encoding(head: bytes) -> str:
    """The file's encoding by its byte-order mark (UTF-32's mark starts as UTF-16's: tested first)."""
    if head.startswith((b"\xff\xfe\x00\x00", b"\x00\x00\xfe\xff")):
        return "utf-32"
    if head.startswith((b"\xff\xfe", b"\xfe\xff")):
        return "utf-16"
    return "utf-8"


def open_log(path: str) -> IO[str]:
    """``path`` as text lines (universal newlines, as ``open`` gives them); OSError as ``open`` raises it."""
    if not hasattr(os, "SEEK_DATA"):      # (not Linux / macOS: read it whole)
        return open(path, encoding="utf-8", errors="replace")
    # (O_NONBLOCK: opening a named pipe nobody writes to would wait forever; the readers take regular files only)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
    except BaseException:
        os.close(fd)
        raise
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        return open(path, encoding="utf-8", errors="replace")
    try:
        os.set_blocking(fd, True)
        try:
            enc = _encoding(os.pread(fd, 4, 0))
        except OSError:      # (a file that opens but cannot be read: the readers name the line the read fails at)
            enc = "utf-8"
        raw: io.RawIOBase = _DataOnly(fd) if st.st_size >= SPARSE_MIN else io.FileIO(fd, "r", closefd=True)
    except BaseException:
        os.close(fd)
        raise
    return io.TextIOWrapper(io.BufferedReader(raw, BUFFER), encoding=enc, errors="replace")


__all__ = ["open_log"]
