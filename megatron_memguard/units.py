"""Byte sizes: parsing ("80GiB", "79.1 GB") and formatting with a unit chosen per magnitude."""
from __future__ import annotations

import math
import re

from .errors import BadValueError
from .numbers import shown

KiB = 1024
MiB = 1024**2
GiB = 1024**3
TiB = 1024**4

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": KiB, "mib": MiB, "gib": GiB, "tib": TiB,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*$")


# Sizes memguard reads (GPU memory, buffer sizes) stay below 2**63 bytes (8 EiB), the int64 of
# torch.cuda.mem_get_info and every allocator counter.
MAX_BYTES = 2**63 - 1


def parse_bytes(text: str | int | float, key: str = "size") -> int:
    """Parse a byte size such as ``80GiB``, ``79.1 GiB``, ``85e9`` or ``80GB`` (SI)."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value: float | int = text
    else:
        m = _SIZE.match(str(text)) if len(str(text)) <= 100 else None
        if not m or m.group(2).lower() not in _UNITS:
            raise BadValueError(key, f"cannot read size {shown(str(text))}; write e.g. 80GiB, 79.1GiB or 85000000000")
        value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if not math.isfinite(value) or value > MAX_BYTES:
        raise BadValueError(key, f"must be a size below 8 EiB (2**63 bytes), got {shown(text)}")
    if value <= 0:
        raise BadValueError(key, f"must be a positive size, got {shown(text)}")
    return int(value)


def format_bytes(n: float, width: int = 0) -> str:
    """Binary units chosen per magnitude: 512 B, 3.2 KiB, 41.7 MiB, 12.34 GiB."""
    sign = "-" if n < 0 else ""
    n = abs(n)
    if n >= 2**80 or n != n:  # YiB and beyond, or nan: no job's memory; shown without overflowing a float
        s = f"{sign}{_huge(n)} B"
    elif n < KiB:
        s = f"{sign}{n:.0f} B"
    elif n < MiB:
        s = f"{sign}{n / KiB:.1f} KiB"
    elif n < GiB:
        s = f"{sign}{n / MiB:.1f} MiB"
    elif n < TiB:
        s = f"{sign}{n / GiB:.2f} GiB"
    else:
        s = f"{sign}{n / TiB:.2f} TiB"
    return s.rjust(width) if width else s


def _huge(n: float) -> str:
    if isinstance(n, int):
        return shown(n)
    return repr(n)


def byte_unit(n: float) -> tuple[str, int]:
    """The unit ``format_bytes`` would choose for ``n`` (name, bytes per unit), e.g. for a plot axis."""
    n = abs(n)
    for name, size in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= size:
            return name, size
    return "B", 1

