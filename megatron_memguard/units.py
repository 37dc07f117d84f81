"""Byte sizes: parsing ("80GiB", "79.1 GB") and formatting with a unit chosen per magnitude."""
from __future__ import annotations

import re

from .errors import ConfigError

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


def parse_bytes(text: str | int | float, key: str = "size") -> int:
    """Parse a byte size such as ``80GiB``, ``79.1 GiB``, ``85e9`` or ``80GB`` (SI)."""
    if isinstance(text, (int, float)):
        if text <= 0:
            raise ConfigError(key, f"must be a positive size, got {text}")
        return int(text)
    m = _SIZE.match(str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ConfigError(key, f"cannot read size {text!r}; write e.g. 80GiB, 79.1GiB or 85000000000")
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if value <= 0:
        raise ConfigError(key, f"must be a positive size, got {text!r}")
    return int(value)


def format_bytes(n: float, width: int = 0) -> str:
    """Binary units chosen per magnitude: 512 B, 3.2 KiB, 41.7 MiB, 12.34 GiB."""
    sign = "-" if n < 0 else ""
    n = abs(n)
    if n < KiB:
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


def byte_unit(n: float) -> tuple[str, int]:
    """The unit ``format_bytes`` would choose for ``n`` (name, bytes per unit), e.g. for a plot axis."""
    n = abs(n)
    for name, size in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= size:
            return name, size
    return "B", 1

