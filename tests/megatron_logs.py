"""Megatron-LM log text for the tests, printed as Megatron prints it (formats from its source).

* ``report_memory``: megatron-core 0.17.0 ``megatron/training/utils.py`` and 0.19.2
  ``megatron/training/utils/common_utils.py`` (f-strings with ``:.2f``, MiB = / (1024 * 1024)); before
  those, ``' | allocated: {}'.format(x)`` (``era="old"``: Python's float repr).
* ``_print_args``: ``megatron/training/arguments.py`` (0.17.0, 0.19.2): ``'  {} {} {}'.format(arg, '.' * (48 -
  len(arg)), value)``, sorted case-insensitively, between the two dashed lines.
* ``training_log``'s line: ``megatron/training/training.py`` (0.17.0, 0.19.2).
* PyTorch's CUDA out-of-memory message: c10/cuda/CUDACachingAllocator.cpp (torch 2.x) with its
  ``format_size`` (two decimals, bytes / KiB / MiB / GiB).
"""
from __future__ import annotations

import random
from typing import Any, Iterable, Sequence

MiB = 1024 * 1024


def print_args(args: dict[str, Any], title: str = "arguments", prefix: str = "") -> list[str]:
    out = [f"{prefix}------------------------ {title} ------------------------"]
    items = ['  {} {} {}'.format(k, '.' * (48 - len(k)), v) for k, v in args.items()]
    out += [prefix + s for s in sorted(items, key=lambda x: x.lower())]
    out.append(f"{prefix}-------------------- end of {title} ---------------------")
    return out


def report_memory(rank: int, name: str, allocated: int, max_allocated: int, reserved: int, max_reserved: int,
                  device_used: int | None = None, era: str = "0.19", prefix: str = "") -> str:
    mb = 1024.0 * 1024.0
    s = name + ' memory (MB)'
    if era == "old":
        s += ' | allocated: {}'.format(allocated / mb)
        s += ' | max allocated: {}'.format(max_allocated / mb)
        s += ' | reserved: {}'.format(reserved / mb)
        s += ' | max reserved: {}'.format(max_reserved / mb)
    else:
        s += f" | allocated: {allocated / mb:.2f}"
        s += f" | max allocated: {max_allocated / mb:.2f}"
        s += f" | reserved: {reserved / mb:.2f}"
        s += f" | max reserved: {max_reserved / mb:.2f}"
        if device_used is not None:
            s += f" | total device memory used: {device_used / mb:.2f}"
    return prefix + "[Rank {}] {}".format(rank, s)


def training_log(iteration: int, train_iters: int, consumed: int, gbs: int, loss: float = 10.5) -> str:
    s = " [2026-08-22 10:00:00.000000]"
    s += ' iteration {:8d}/{:8d} |'.format(iteration, train_iters)
    s += ' consumed samples: {:12d} |'.format(consumed)
    s += ' elapsed time per iteration (ms): {:.1f} |'.format(1234.5)
    s += f' learning rate: {1e-4:.6E} |'
    s += f' global batch size: {gbs:5d} |'
    s += ' {}: {:.6E} |'.format("lm loss", loss)
    s += f' loss scale: {1.0:.1f} |'
    s += f' grad norm: {3.14159:.3f} |'
    s += ' number of skipped iterations: {:3d} |'.format(0)
    s += ' number of nan iterations: {:3d} |'.format(0)
    return s


def format_size(size: int) -> str:
    if size <= 1024:
        return f"{size} bytes"
    if size <= 1048576:
        return f"{size / 1024.0:.2f} KiB"
    if size <= 1073741824:
        return f"{size / 1048576.0:.2f} MiB"
    return f"{size / 1073741824.0:.2f} GiB"


def oom_message(requested: int, capacity: int, free: int, process_used: int, allocated: int, reserved: int,
                device: int = 0) -> str:
    return ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate " + format_size(requested) + ". GPU "
            + str(device) + " has a total capacity of " + format_size(capacity) + " of which " + format_size(free)
            + " is free. Including non-PyTorch memory, this process has " + format_size(process_used)
            + " memory in use. Of the allocated memory " + format_size(allocated) + " is allocated by PyTorch, and "
            + format_size(reserved - allocated) + " is reserved by PyTorch but unallocated. If reserved but unallocated "
            "memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See "
            "documentation for Memory Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)")


def args_of(flags: Sequence[str], world_size: int) -> dict[str, Any]:
    """An argument table's content for Megatron ``flags``: the values memguard's flag reader takes, as
    ``str()`` prints them, with ``world_size`` and the rank order's switch as Megatron has them."""
    from megatron_memguard.readers.megatron_flags import parse_megatron_flags
    raw = parse_megatron_flags(list(flags))
    args = {k: (list(v) if isinstance(v, tuple) else v) for k, v in raw.args.items()}
    args.update(world_size=world_size, rank=0, use_tp_pp_dp_mapping=args.get("use_tp_pp_dp_mapping", False),
                data_path=["/data/text_document"], lr=1e-4, save="/ckpt", params_dtype="torch.bfloat16")
    return args


def dp0_ranks(tp: int, pp: int, dp: int, cp: int = 1) -> list[int]:
    """The ranks report_memory prints on (data-parallel rank 0), default order tp-cp-ep-dp-pp."""
    return [t + tp * (c + cp * dp * p) for p in range(pp) for c in range(cp) for t in range(tp)]


def interleave(*streams: Iterable[str], seed: int = 0) -> list[str]:
    """Lines of several ranks' streams in a random (seeded) order that keeps each stream's own order."""
    rng = random.Random(seed)
    its = [list(s) for s in streams]
    pos = [0] * len(its)
    out = []
    while any(p < len(s) for p, s in zip(pos, its)):
        i = rng.choice([k for k, (p, s) in enumerate(zip(pos, its)) if p < len(s)])
        out.append(its[i][pos[i]])
        pos[i] += 1
    return out


# nvidia-smi's summary table as drivers print it (the layout of NVIDIA's nvidia-smi; names and board memory of real
# parts): 550 (2024: full names, 3 rows per GPU) and 515 (2022: names cut to 18 characters)
NVIDIA_SMI_550 = """\
+-----------------------------------------------------------------------------------------+
| NVIDIA-SMI 550.54.15              Driver Version: 550.54.15      CUDA Version: 12.4     |
|-----------------------------------------+------------------------+----------------------+
| GPU  Name                 Persistence-M | Bus-Id          Disp.A | Volatile Uncorr. ECC |
| Fan  Temp   Perf          Pwr:Usage/Cap |           Memory-Usage | GPU-Util  Compute M. |
|                                         |                        |               MIG M. |
|=========================================+========================+======================|
|   0  NVIDIA H100 80GB HBM3          On  |   00000000:18:00.0 Off |                    0 |
| N/A   31C    P0             71W /  700W |       1MiB /  81559MiB |      0%      Default |
|                                         |                        |             Disabled |
+-----------------------------------------+------------------------+----------------------+
|   1  NVIDIA H100 80GB HBM3          On  |   00000000:2A:00.0 Off |                    0 |
| N/A   33C    P0             72W /  700W |       1MiB /  81559MiB |      0%      Default |
|                                         |                        |             Disabled |
+-----------------------------------------+------------------------+----------------------+"""
NVIDIA_SMI_515 = """\
+-----------------------------------------------------------------------------+
| NVIDIA-SMI 515.65.01    Driver Version: 515.65.01    CUDA Version: 11.7     |
|-------------------------------+----------------------+----------------------+
| GPU  Name        Persistence-M| Bus-Id        Disp.A | Volatile Uncorr. ECC |
| Fan  Temp  Perf  Pwr:Usage/Cap|         Memory-Usage | GPU-Util  Compute M. |
|                               |                      |               MIG M. |
|===============================+======================+======================|
|   0  NVIDIA A100-SXM...  On   | 00000000:07:00.0 Off |                    0 |
| N/A   30C    P0    61W / 400W |      0MiB / {board}MiB |      0%      Default |
|                               |                      |             Disabled |
+-------------------------------+----------------------+----------------------+"""


def lightning_tensor_cores(name: str) -> str:
    """Lightning's hint (lightning 2.6 ``fabric/accelerators/cuda.py``, ``_check_cuda_matmul_precision``), printed
    by NeMo 2 and Lightning jobs on a GPU with Tensor Cores; ``name`` is ``torch.cuda.get_device_name()``."""
    return (f"You are using a CUDA device ({name!r}) that has Tensor Cores. To properly utilize them, you should set "
            "`torch.set_float32_matmul_precision('medium' | 'high')` which will trade-off precision for performance. "
            "For more details, read https://pytorch.org/docs/stable/generated/torch.set_float32_matmul_precision.html#torch.set_float32_matmul_precision")
