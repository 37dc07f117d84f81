"""The measured step times ``memguard calibrate`` fits the planner's time constants to, and the planner's
predictions of them.

Measured: Megatron's ``training_log`` line on the last rank (megatron/training/training.py, 0.8 to 0.19.2)::

     [2026-08-22 10:00:00.000000] iteration      100/    1000 | consumed samples: ... | elapsed time per iteration (ms): 1234.5 | throughput per GPU (TFLOP/s/GPU): 180.2 | ...

Each line gives the mean wall time per iteration over the interval since the previous line (``interval-time``,
reset at every log). The first logged line is left out: from megatron-core 0.12 it is iteration 1 alone
("to document initialization overhead", training.py), before that the first ``--log-interval`` iterations with
iteration 1 in them (CUDA and NCCL initialisation, the allocator's first growth, the first gradient buckets).
The run's step time is the median of the remaining intervals' means (robust to an interval with a checkpoint
save or an evaluation in it). The TFLOP/s field is read when the elapsed time is missing; it is converted with the
planner's model FLOPs per token, which follow Megatron's convention up to the vocabulary padding.

memguard's runtime JSONL stamps each record with the wall time but samples memory at the hook's own moments, not
once per iteration: it gives no step time, and its runs join only the memory fit.
"""
from __future__ import annotations

import dataclasses
import statistics
from typing import Any, Callable, Mapping

from ..errors import ConfigError, ConfigErrors, ReaderError
from ..time_constants import with_speeds
from .timefit import TimedRun


def measured_step(times: list[tuple[int, float, float | None]], where: str) -> tuple[float | None, float | None, int]:
    """(seconds per step from the elapsed times, TFLOP/s per GPU, intervals used) after the first logged line; a
    ReaderError when every line is the warm-up one."""
    seen: dict[int, tuple[float, float | None]] = {}
    for it, ms, tf in times:
        seen.setdefault(it, (ms, tf))            # (several files of one run may each hold the last rank's lines)
    order = sorted(seen)
    if not order:
        return None, None, 0
    used = order[1:]
    if not used:
        raise ReaderError(f"{where}: only the first logged iteration ({order[0]}) has a time: it holds the warm-up "
                          "(initialisation, first allocations), so the run gives no step time; log more iterations")
    ms = [seen[i][0] for i in used if seen[i][0] > 0]
    tf = [seen[i][1] for i in used if seen[i][1]]
    return (statistics.median(ms) / 1000 if ms else None), (statistics.median(tf) if tf else None), len(used)


def _recompute(args: Mapping[str, Any]) -> str:
    g = args.get("recompute_granularity")
    return g if g in ("selective", "full") else "none"


def run_predictor(raw: Any, gpu: Any, world: int, gpus_per_node: int | None = None,
                  tp_overlap: bool = True) -> tuple[Callable[[Mapping[str, float]], float], str, float]:
    """(the planner's step time of the run's own layout as a function of the time constants, its label, the model
    FLOPs per token) from the run's configuration (Megatron's argument table). ConfigError when the planner cannot
    time the layout."""
    from ..planner import Cluster, Planner
    from ..planner.space import make_candidate
    from ..planner.timing import TimeModel

    a = raw.args
    gpn = gpus_per_node or gpu.gpus_per_node
    # (as memguard plan: an NVL72 rack is one NVLink domain unless the node size is given)
    domain = gpu.nvlink_domain if gpu.nvlink_domain > gpu.gpus_per_node and not gpus_per_node else gpn
    cluster = Cluster(gpus=world, gpus_per_node=min(gpn, world), gpu=gpu, nvlink_domain=min(domain, world),
                      gpu_memory_bytes=gpu.memory_bytes)
    planner = Planner(raw, cluster)
    vpp = a.get("virtual_pipeline_model_parallel_size") or 1
    cand = make_candidate(planner.shape, cluster, planner.gbs, tp=a.get("tensor_model_parallel_size") or 1,
                          pp=a.get("pipeline_model_parallel_size") or 1, cp=a.get("context_parallel_size") or 1,
                          vpp=vpp, mbs=a.get("micro_batch_size") or 1, recompute=_recompute(a),
                          sp=bool(a.get("sequence_parallel")), dist_opt=bool(a.get("use_distributed_optimizer")),
                          first=a.get("decoder_first_pipeline_num_layers"),
                          last=a.get("decoder_last_pipeline_num_layers"),
                          ep=a.get("expert_model_parallel_size") or 1, etp=a.get("expert_tensor_parallel_size"))
    models: dict[tuple, TimeModel] = {}

    def predict(values: Mapping[str, float]) -> float:
        key = tuple(sorted(values.items()))
        tm = models.get(key)
        if tm is None:
            if len(models) > 64:
                models.clear()
            tm = models[key] = TimeModel(planner.shape, dataclasses.replace(cluster, gpu=with_speeds(gpu, values)),
                                         planner.gbs, tp_overlap=tp_overlap)
        return tm.step_time(cand).seconds

    return predict, cand.label, planner.timer.flops_per_token


def timed_run(name: str, raw: Any, gpu: Any, world: int, times: list[tuple[int, float, float | None]],
              gpus_per_node: int | None = None) -> tuple[TimedRun | None, str | None]:
    """(the run for the time fit, None) or (None, why it cannot join)."""
    try:
        seconds, tflops, n = measured_step(times, name)
    except ReaderError as e:         # (the run may still serve the memory fit)
        return None, str(e)
    if seconds is None and tflops is None:
        return None, f"{name}: no iteration line after the first has a positive time: no step time"
    try:
        predict, label, fpt = run_predictor(raw, gpu, world, gpus_per_node)
    except (ConfigError, ConfigErrors) as e:
        return None, f"{name}: its step time is not used: the planner cannot time its layout ({e})"
    if seconds is None:
        gbs, seq = raw.args.get("global_batch_size"), raw.args.get("seq_length")
        if not gbs or not seq:
            return None, f"{name}: only TFLOP/s per GPU logged, and no global batch size / sequence length to convert it"
        seconds = gbs * seq * fpt / (world * tflops * 1e12)
    return TimedRun(name, seconds, predict, label), None


__all__ = ["measured_step", "run_predictor", "timed_run"]
