"""Lines of a training log that say which GPU the job ran on (``memguard calibrate`` reads them).

Megatron's logs do not name the device, but what else a job prints often does:

* ``nvidia-smi``'s table (a row ``|   0  NVIDIA H100 80GB HBM3   On  |   00000000:18:00.0 Off |``, the next
  row's ``1MiB /  81559MiB``: the board's memory; drivers before 2023 cut the name to ``NVIDIA A100-SXM...``,
  before 2021 without ``NVIDIA``), and ``nvidia-smi -L`` (``GPU 0: NVIDIA A100-SXM4-80GB (UUID: GPU-...)``);
* Lightning's Tensor Core hint, which NeMo 2 and the Lightning callbacks print (lightning 2.6
  ``fabric/accelerators/cuda.py``: ``You are using a CUDA device ('NVIDIA H100 80GB HBM3') that has Tensor
  Cores``), Megatron's GPU sniff test (0.19 ``training/gpu_sniff_test.py``: ``CUDA device: NAME``), and lines
  that print ``torch.cuda.get_device_name()`` after ``device name:`` or the call itself;
* memguard's own pre-flight line when it read the device (the Megatron hook's ``[memguard] mode warn, threshold
  90%, H100-80GB 79.11 GiB (torch.cuda.get_device_properties(0))``, the callbacks' ``[memguard] Lightning
  pre-flight: mode ...``).

PyTorch's out-of-memory message gives the device's total memory (``report/megatron_log.py`` reads it). Each
pattern is bounded in length so a 64 KiB line costs time linear in it. Pure Python.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

MiB = 1024 * 1024
GiB = 1024 * MiB
_NAME = r"([A-Za-z][A-Za-z0-9 ._()/-]{1,47}?)"
# nvidia-smi's device row: index, name (padded), persistence mode, PCI bus id
SMI_ROW = re.compile(r"\|\s{1,8}(\d{1,3})\s{1,8}([A-Za-z][^|]{1,40}?)\s{1,40}(?:On|Off)\s{1,8}\|\s{1,8}"
                     r"[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-9A-Fa-f]\s")
SMI_MEMORY = re.compile(r"\|\s{0,40}\d{1,9}MiB\s{0,4}/\s{0,40}(\d{1,9})MiB\s{0,40}\|")
SMI_LIST = re.compile(r"\bGPU (\d{1,3}): " + _NAME + r" \(UUID: GPU-")
LIGHTNING = re.compile(r"You are using a CUDA device \('" + _NAME + r"'\) that has Tensor Cores")
NAMED = re.compile(r"(?:\bCUDA device|[Dd]evice[ _]name|get_device_name\([^)]{0,24}\))\s{0,4}[:=]\s{0,4}['\"]?" + _NAME
                   + r"['\"]?\s*$")
MEMGUARD = re.compile(r"\[memguard\] (?:[A-Za-z -]{1,32}: )?mode \w{1,12}, threshold \d{1,3}%, ([A-Za-z0-9-]{2,16}) "
                      r"([\d.]{1,10}) (GiB|TiB) \((torch\.cuda\.get_device_properties\(\d{1,3}\)|NVML device \d{1,3})\)")


@dataclass(frozen=True)
class DeviceMention:
    """A GPU a log line names (``name``) and / or its memory (``total_bytes``; ``board``: nvidia-smi's figure,
    a little above the ``total_memory`` PyTorch reports)."""

    file: str
    line: int
    what: str                    # "nvidia-smi", "nvidia-smi -L", "Lightning", "device name", "memguard", "out-of-memory"
    name: str | None = None
    total_bytes: int | None = None
    board: bool = False

    def where(self) -> str:
        return f"{self.file}:{self.line}"

    def text(self) -> str:
        parts = [f"'{self.name}'"] if self.name else []
        if self.total_bytes:
            parts.append(f"{self.total_bytes / GiB:.2f} GiB" + (" on the board" if self.board else " total"))
        return f"{self.what} {', '.join(parts)} ({self.where()})"


# what a device name starts with: a vendor's word, or a model number (nvidia-smi before 2021: ``A100-SXM4-40GB``);
# ``device_name = None`` or ``device name: cuda`` name no GPU
GPU_NAME = re.compile(r"(?:NVIDIA|Tesla|Quadro|GeForce|AMD|Radeon)\b|[A-Z]{1,3}\d{2,4}")


def device_mention(text: str, file: str, line: int) -> DeviceMention | None:
    """The GPU a log line names, if it is one of the lines above (cheap substring tests first)."""
    m = _device_mention(text, file, line)
    return m if m is None or m.name is None or GPU_NAME.match(m.name) else None


def _device_mention(text: str, file: str, line: int) -> DeviceMention | None:
    if "|" in text and ("On " in text or "Off " in text) and (m := SMI_ROW.search(text)) is not None:
        return DeviceMention(file, line, "nvidia-smi", name=m.group(2).strip())
    if "(UUID: GPU-" in text and (m := SMI_LIST.search(text)) is not None:
        return DeviceMention(file, line, "nvidia-smi -L", name=m.group(2).strip())
    if "Tensor Cores" in text and (m := LIGHTNING.search(text)) is not None:
        return DeviceMention(file, line, "Lightning", name=m.group(1).strip())
    if ("CUDA device" in text or "evice name" in text or "evice_name" in text) and (m := NAMED.search(text)) is not None:
        return DeviceMention(file, line, "device name", name=m.group(1).strip())
    if "[memguard]" in text and (m := MEMGUARD.search(text)) is not None:
        scale = GiB if m.group(3) == "GiB" else GiB * 1024
        name = None if m.group(1) == "GPU" else m.group(1)     # ('GPU': a device outside memguard's table)
        return DeviceMention(file, line, "memguard", name=name, total_bytes=int(float(m.group(2)) * scale))
    return None


def smi_board_memory(text: str) -> int | None:
    """The board memory of nvidia-smi's row under a device row (``1MiB /  81559MiB``), in bytes."""
    m = SMI_MEMORY.search(text) if "MiB" in text else None
    return int(m.group(1)) * MiB if m else None


__all__ = ["DeviceMention", "device_mention", "smi_board_memory"]
