"""Megatron-Bridge and NeMo 2 log lines, written with the libraries' own format strings.

* Megatron-Bridge 0.6.2 ``megatron/bridge/training/utils/train_utils.py``: ``report_memory`` (l.1245-1298, its
  ``MEMORY_KEYS`` l.258-269: bytes / 1e9 rounded to 5 significant digits), the memory line of ``training_log``
  (l.1228-1233) and its iteration line (l.1170-1225, the fields of a run without energy monitor, MTP or
  max-attention logit); ``initialize.py`` l.788 (HyperCommGrid).
* megatron-core ``num_microbatches_calculator.py`` l.292.
* NeMo 2 (nemo_toolkit 2.4.0) ``nemo/lightning/pytorch/callbacks/progress_printer.py`` l.55-63 and l.139-142;
  ``nemo/lightning/pytorch/strategies/megatron_strategy.py`` l.587 (Lightning's MEMBER line).
"""
from __future__ import annotations

import math

# MEMORY_KEYS of train_utils.py l.258-269, in order (torch.cuda.memory_stats() name -> logged name)
MEMORY_KEYS = {
    "allocated_bytes.all.current": "mem-allocated-bytes",
    "active_bytes.all.current": "mem-active-bytes",
    "inactive_split_bytes.all.current": "mem-inactive-bytes",
    "reserved_bytes.all.current": "mem-reserved-bytes",
    "allocated_bytes.all.peak": "mem-max-allocated-bytes",
    "active_bytes.all.peak": "mem-max-active-bytes",
    "inactive_split_bytes.all.peak": "mem-max-inactive-bytes",
    "reserved_bytes.all.peak": "mem-max-reserved-bytes",
    "num_alloc_retries": "mem-alloc-retires",
    "allocation.all.current": "mem-allocated-count",
}


def report_memory(memory_stats: dict, memory_keys: dict | None = None) -> dict:
    """train_utils.py report_memory, on a given memory_stats() dict."""
    memory_report = {}
    for torch_name, name in (memory_keys or MEMORY_KEYS).items():
        if torch_name in memory_stats:
            if "bytes" in torch_name:
                gigabytes = memory_stats[torch_name] / 1.0e9
                if gigabytes != 0:
                    order_of_magnitude = int(math.floor(math.log10(abs(gigabytes))))
                    gigabytes = round(gigabytes, -order_of_magnitude + 4)
                memory_report[name.replace("bytes", "gigabytes")] = gigabytes
            else:
                memory_report[name] = memory_stats[torch_name]
    return memory_report


def memory_stats(allocated: int, max_allocated: int, reserved: int, max_reserved: int) -> dict:
    """A memory_stats() of these four counters (active = allocated, nothing inactive, 4,000 blocks)."""
    return {"allocated_bytes.all.current": allocated, "active_bytes.all.current": allocated,
            "inactive_split_bytes.all.current": reserved - allocated, "reserved_bytes.all.current": reserved,
            "allocated_bytes.all.peak": max_allocated, "active_bytes.all.peak": max_allocated,
            "inactive_split_bytes.all.peak": max_reserved - max_allocated, "reserved_bytes.all.peak": max_reserved,
            "num_alloc_retries": 0, "allocation.all.current": 4000}


def memory_line(rank: int, iteration: int, stats: dict, memory_keys: dict | None = None) -> str:
    """training_log l.1228-1233."""
    memory_string = f"(after {iteration} iterations) memory (GB)"
    for metric, value in report_memory(stats, memory_keys).items():
        memory_string += f" | {metric}: {value}"
    return "[Rank {}] {}".format(rank, memory_string)


def iteration_line(iteration: int, train_iters: int, consumed: int, ms: float, gbs: int, tflops: float | None = None,
                   loss: float = 10.5) -> str:
    """training_log l.1170-1225 (print_rank_last)."""
    log_string = " [2026-08-22 10:00:00]"
    log_string += " iteration {:8d}/{:8d} |".format(iteration, train_iters)
    log_string += " consumed samples: {:12d} |".format(consumed)
    log_string += " elapsed time per iteration (ms): {:.1f} |".format(ms)
    if tflops is not None:
        log_string += f" throughput per GPU (TFLOP/s/GPU): {tflops:.1f} |"
    log_string += f" learning rate: {3e-4:.6E} |"
    log_string += f" global batch size: {gbs:5d} |"
    log_string += " {}: {:.6E} |".format("lm loss", loss)
    log_string += f" loss scale: {1.0:.1f} |"
    log_string += f" grad norm: {1.234:.3f} |"
    log_string += " number of skipped iterations: {:3d} |".format(0)
    log_string += " number of nan iterations: {:3d} |".format(0)
    return log_string


def step_time_line(elapsed_time_per_iteration: float, per_gpu_tf: float) -> str:
    """training_log l.1133-1135 (print_rank_0, before the iteration line)."""
    return f"Step Time : {elapsed_time_per_iteration:.2f}s GPU utilization: {per_gpu_tf:.1f}MODEL_TFLOP/s/GPU"


def grid_line(tp: int, pp: int, cp: int, dp: int) -> str:
    return f"> initialized HyperCommGrid with tp={tp}, pp={pp}, cp={cp}, dp={dp}"


def microbatches_line(n: int) -> str:
    return f"INFO:megatron.core.num_microbatches_calculator:setting number of microbatches to constant {n}"


def member_line(world: int) -> str:
    return f"Initializing distributed: GLOBAL_RANK: 0, MEMBER: 1/{world}"


def nemo_progress_line(n: int, total: int, metrics: dict) -> str:
    """ProgressPrinter.on_train_batch_end (n: trainer.strategy.current_epoch_step) with format_string."""
    log_string = "Training" + f" epoch 0, iteration {n - 1}/{total - 1}"
    for metric, val in metrics.items():
        if isinstance(val, (float)) and val.is_integer():
            val = int(val)
            log_string += f" | {metric}: {val}"
        else:
            log_string += f" | {metric}: {val:.4}"
    return log_string
