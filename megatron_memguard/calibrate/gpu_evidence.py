"""Which GPU a run used, from what its files say (``memguard calibrate`` without ``--gpu``).

Each piece of evidence (a device name, a total memory, or both) narrows the GPU table (``gpus.py``) to the
entries it fits; a run's GPU is the one entry every piece fits. A name fits an entry when it holds the
entry's model as a word (``A100``, ``H100``, ``GB200``; ``GH200`` is not an ``H200``) and, when the name says
a size (``80GB``) or ``NVL``, that size; a memory figure fits when it lies within ``MEMORY_TOLERANCE`` of the
entry's ``total_memory``. A100-80GB and H100-80GB (79.35 and 79.11 GiB) are closer than that: a figure near
79 GiB alone names neither.

Evidence that fits no common entry is a conflict (an error naming both lines), as is evidence that
contradicts ``--gpu``, and runs whose files name two GPUs. Runs without evidence, or whose evidence leaves
several entries, take the GPU the other runs name (when it is one of those entries), else the fallback
(H100-80GB) with a note; a name outside the table, or evidence that leaves several entries none of which is
the fallback, is an error asking for ``--gpu``.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Sequence

from ..errors import MemguardError, ReaderError
from ..gpus import GPUS, GpuSpec, lookup_gpu
from ..report.device_mentions import DeviceMention

# nvidia-smi's board memory lies up to about 1% above the total_memory PyTorch reports (81559 MiB vs 79.11 GiB on H100
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


def jsonl_evidence(log: Any, path: str, decision: bool = True) -> list[Evidence]:
    """What a run's JSONL says about its GPU: each rank's measured device (the ``start`` record's ``gpu_device``,
    written since this version), else (``decision``) the GPU its pre-flight decision named (given by the user or
    read from the device); one piece per distinct statement."""
    seen: dict[tuple[Any, ...], Evidence] = {}
    for r in log.ranks:
        start = r.start or {}
        dev = start.get("gpu_device") if isinstance(start.get("gpu_device"), dict) else None
        name, total = (dev or {}).get("name"), _count((dev or {}).get("total_memory"))
        if isinstance(name, str) or total:
            key = ("device", name if isinstance(name, str) else None, total)
            where = f"the JSONL's device of rank {r.rank}"
            text = f"{where}: " + (f"'{name}'" if isinstance(name, str) else "") + \
                (f" {total / 2**30:.2f} GiB" if total else "") + f" ({path})"
            seen.setdefault(key, Evidence.of(key[1], total, text))
    if seen or not decision:
        return list(seen.values())
    for r in log.ranks:
        name = ((((r.start or {}).get("context") or {}).get("decision")) or {}).get("gpu")
        if isinstance(name, str) and name:
            try:
                spec = lookup_gpu(name)
            except MemguardError:
                raise ReaderError(f"{path}: the JSONL's decision names GPU {name!r}, which this memguard does not "
                                  "know; give --gpu") from None
            seen.setdefault(("decision", spec.name), Evidence(f"the JSONL's pre-flight decision: {spec.name} ({path})",
                                                               frozenset([spec.name]), spec.name))
    return list(seen.values())


def megatron_evidence(log: Any) -> list[Evidence]:
    """What a Megatron run's log files say about its GPU: lines naming it, PyTorch's out-of-memory capacity (one
    piece per distinct statement: nvidia-smi prints a row per GPU)."""
    seen: dict[tuple[Any, ...], Evidence] = {}
    for m in log.devices:
        seen.setdefault((m.what, m.name, m.total_bytes), from_mention(m))
    for ev in log.ooms:
        seen.setdefault(("oom", ev.capacity), from_capacity(ev.capacity, ev.file, ev.line))
    return list(seen.values())


def _count(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


def _list(names: frozenset[str]) -> str:
    return " or ".join(sorted(names))


@dataclass(frozen=True)
class Finding:
    """What one run's evidence settles: its GPU (or ``--gpu``) and how it was found, or, when several entries
    remain, the entries (``fits``) for :func:`settle` to choose among with the other runs."""

    gpu: GpuSpec | None
    note: str = ""
    fits: frozenset[str] = frozenset()
    said: str = ""


def infer_gpu(run: str, evidence: Sequence[Evidence], given: GpuSpec | None) -> Finding:
    """The run's GPU from ``evidence`` (``Finding(None)`` when there is none and ``--gpu`` is not given);
    ReaderError when its statements conflict, with each other or with ``--gpu``."""
    if not evidence:
        return Finding(given)
    if given is not None:
        against = [e for e in evidence if e.fits and given.name not in e.fits]
        if against:
            raise ReaderError(f"{run}: --gpu {given.name} conflicts with the run's own files: {against[0].text} is "
                              f"{_list(against[0].fits)}; give the GPU the run used")
        return Finding(given)
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
        return Finding(GPUS[name], f"GPU {name}, from {said}")
    return Finding(None, fits=common, said=said)


def settle(found: dict[str, Finding], given: GpuSpec | None) -> dict[str, tuple[GpuSpec, str]]:
    """Each run's (GPU, note), over all runs (``found``: each GPU run's finding, ``Finding(None)`` for a run whose
    files say nothing): one GPU type for all (ReaderError naming a run of each when their files name two); a run
    whose statements leave several entries, or none, takes the one the others name, else FALLBACK when it fits."""
    if given is not None:
        return {run: (given, "") for run in found}
    named: dict[str, str] = {}
    for run, f in found.items():
        if f.gpu is not None:
            named.setdefault(f.gpu.name, f.note)
    if len(named) > 1:
        raise ReaderError("the runs' files name " + " and ".join(f"{n} ({why})" for n, why in sorted(named.items()))
                          + ": a site profile holds one GPU type; calibrate each GPU's runs on their own")
    out: dict[str, tuple[GpuSpec, str]] = {}
    # one note for the runs whose files name the GPU: the first run's evidence, and how many more
    direct = [run for run, f in found.items() if f.gpu is not None]
    for run in direct:
        more = f", and the files of {len(direct) - 1} more run(s)" if len(direct) > 1 else ""
        out[run] = (found[run].gpu, found[direct[0]].note + more)
    other = next(iter(named), None)
    for run, f in found.items():
        if f.gpu is not None:
            continue
        if f.fits and other is not None:
            if other not in f.fits:
                raise ReaderError(f"{run}: {f.said} is {_list(f.fits)}, but the other runs' files name {other} "
                                  f"({named[other]}); calibrate each GPU's runs on their own, or give --gpu")
            out[run] = (GPUS[other], f"GPU {other}: {f.said} fits {_list(f.fits)}, and the other runs' files name {other}")
        elif f.fits:
            if FALLBACK not in f.fits:
                raise ReaderError(f"{run}: {f.said} fits {_list(f.fits)}, not one GPU; give --gpu")
            out[run] = (GPUS[FALLBACK], f"GPU not recorded: {f.said} fits {_list(f.fits)}; {FALLBACK} assumed "
                                        "(--gpu names it)")
        elif other is not None:
            out[run] = (GPUS[other], f"GPU not recorded in some runs: {other}, as the other runs' files name it")
        else:
            out[run] = (GPUS[FALLBACK], f"GPU not recorded: {FALLBACK} assumed (--gpu names it)")
    return out


__all__ = ["Evidence", "Finding", "infer_gpu", "settle", "from_mention", "from_capacity", "fits_name", "fits_memory",
           "MEMORY_TOLERANCE", "FALLBACK"]
