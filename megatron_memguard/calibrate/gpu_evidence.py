"""Which GPU a run used, from what its files say (``memguard calibrate`` without ``--gpu``).

Each piece of evidence (a device name, a total memory, or both) narrows the GPU table (``gpus.py``) to the
entries it fits; a run's GPU is the one entry every piece fits. A name fits an entry when it holds the
entry's model as a word (``A100``, ``H100``, ``GB200``; ``GH200`` is not an ``H200``) and, when the name says
a size (``80GB``) or ``NVL``, that size; a memory figure fits when it lies within ``MEMORY_TOLERANCE`` of the
entry's ``total_memory``. A100-80GB and H100-80GB (79.35 and 79.11 GiB) are closer than that: a figure near
79 GiB alone names neither.

Evidence that fits no common entry is a conflict (an error naming both lines), as is evidence that
contradicts ``--gpu``. Runs without evidence take the GPU the other runs name, else the fallback
(H100-80GB) with a note; a name outside the table, or evidence that leaves several entries none of which is
the fallback, is an error asking for ``--gpu``.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

from ..errors import ReaderError
from ..gpus import GPUS, GpuSpec
from ..report.device_mentions import DeviceMention

# nvidia-smi's board memory lies 0.4-1.0% above the total_memory PyTorch reports (81559 MiB vs 79.11 GiB on H100
# 80GB, 81920 MiB vs 79.35 GiB on A100 80GB); drivers and ECC move PyTorch's figure by a few hundred MiB. The
# closest entries the tolerance must keep apart: B200 and GB200, 3.1%.
MEMORY_TOLERANCE = 0.015
FALLBACK = "H100-80GB"


def _model(spec: GpuSpec) -> str:
    return spec.name.split("-")[0].upper()


def fits_name(name: str, spec: GpuSpec) -> bool:
    """``name`` (as nvidia-smi or torch.cuda.get_device_name print it) names the table entry ``spec``."""
    up = name.upper()
    if not re.search(r"(?<![A-Z0-9])" + re.escape(_model(spec)) + r"(?![0-9])", up):
        return False
    sizes = [int(s) for s in re.findall(r"(?<![0-9])(\d{2,3}) ?GB\b", up)]
    if sizes:   # 'A100-SXM4-40GB', 'H100 80GB HBM3': the nominal size is within 6% of total_memory in GiB
        return any(abs(s - spec.memory_bytes / 2**30) <= 0.06 * s for s in sizes)
    if re.search(r"\bNVL\b", up):   # 'NVIDIA H100 NVL' is the 94 GB part
        return "NVL" in spec.nominal.upper()
    return True


def fits_memory(total: int, spec: GpuSpec) -> bool:
    return abs(spec.memory_bytes - total) <= MEMORY_TOLERANCE * total


@dataclass(frozen=True)
class Evidence:
    """One statement about a run's GPU and the table entries it fits."""

    text: str                    # what it says and where ('nvidia-smi 'NVIDIA A100-SXM4-80GB' (run/out.log:12)')
    fits: frozenset[str]
    name: str | None = None      # the device name, when it gave one

    @classmethod
    def of(cls, name: str | None, total: int | None, text: str) -> "Evidence":
        fits = frozenset(g.name for g in GPUS.values()
                         if (name is None or fits_name(name, g)) and (total is None or fits_memory(total, g)))
        return cls(text, fits, name)


def from_mention(m: DeviceMention) -> Evidence:
    return Evidence.of(m.name, m.total_bytes, m.text())


def from_capacity(capacity: int, file: str, line: int) -> Evidence:
    return Evidence.of(None, capacity, f"out-of-memory message: total capacity {capacity / 2**30:.2f} GiB ({file}:{line})")


def _list(names: frozenset[str]) -> str:
    return " or ".join(sorted(names))


def infer_gpu(run: str, evidence: Sequence[Evidence], given: GpuSpec | None) -> tuple[GpuSpec | None, str]:
    """(the run's GPU, a note saying how it was found) from ``evidence``: None when there is none and ``--gpu`` is
    not given; ReaderError on a conflict."""
    if not evidence:
        return given, ""
    if given is not None:
        against = [e for e in evidence if e.fits and given.name not in e.fits]
        if against:
            raise ReaderError(f"{run}: --gpu {given.name} conflicts with the run's own files: {against[0].text} is "
                              f"{_list(against[0].fits)}; give the GPU the run used")
        return given, ""
    unknown = [e for e in evidence if not e.fits]
    if unknown:
        raise ReaderError(f"{run}: {unknown[0].text}: a GPU memguard's table does not have ({', '.join(GPUS)}); give "
                          "--gpu with the nearest entry")
    common = frozenset(GPUS)
    for i, e in enumerate(evidence):
        if not common & e.fits:
            other = next((o for o in evidence[:i] if not o.fits & e.fits), evidence[0])
            raise ReaderError(f"{run}: the files disagree on the GPU: {other.text} is {_list(other.fits)}, {e.text} is "
                              f"{_list(e.fits)}; calibrate each GPU's runs on their own, or give --gpu")
        common &= e.fits
    said = evidence[0].text + (f" and {len(evidence) - 1} more line(s)" if len(evidence) > 1 else "")
    if len(common) == 1:
        name = next(iter(common))
        return GPUS[name], f"GPU {name}, from {said}"
    if FALLBACK in common:
        return GPUS[FALLBACK], f"GPU not recorded: {said} fits {_list(common)}; {FALLBACK} assumed (--gpu names it)"
    raise ReaderError(f"{run}: {said} fits {_list(common)}, not one GPU; give --gpu")


__all__ = ["Evidence", "infer_gpu", "from_mention", "from_capacity", "fits_name", "fits_memory",
           "MEMORY_TOLERANCE", "FALLBACK"]
