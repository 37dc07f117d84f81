"""Stand-in for megatron/training/utils.py (core_v0.16.1 / 0.17): ``report_memory`` as Megatron prints it
(megatron-core 0.17.0 wheel, megatron/training/utils.py report_memory: MiB with two decimals, on
data-parallel rank 0 of each model-parallel position)."""
import torch

from megatron.core import mpu
from megatron.training.global_vars import get_args


def report_memory(name):
    """Simple GPU memory report."""
    args = get_args()
    mega_bytes = 1024.0 * 1024.0
    string = name + ' memory (MB)'
    string += f" | allocated: {torch.cuda.memory_allocated() / mega_bytes:.2f}"
    string += f" | max allocated: {torch.cuda.max_memory_allocated() / mega_bytes:.2f}"
    string += f" | reserved: {torch.cuda.memory_reserved() / mega_bytes:.2f}"
    string += f" | max reserved: {torch.cuda.max_memory_reserved() / mega_bytes:.2f}"
    if getattr(args, "log_device_memory_used", False):
        string += f" | total device memory used: {torch.cuda.device_memory_used() / mega_bytes:.2f}"
    if mpu.get_data_parallel_rank() == 0:
        print("[Rank {}] {}".format(torch.distributed.get_rank(), string), flush=True)
