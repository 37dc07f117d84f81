"""Runtime memory monitoring, framework-free: a pluggable memory source, a per-rank monitor that
compares actual with predicted memory, and sinks (JSONL, TensorBoard / W&B writers).

Used by the Megatron hook (``megatron_memguard.megatron``) and meant for Bridge / Lightning callbacks:

    from megatron_memguard.runtime import CudaMemorySource, JsonlSink, MemoryMonitor, Prediction
    mon = MemoryMonitor(CudaMemorySource(), Prediction.from_estimate(est, pp_rank), rank=rank,
                        interval=100, sinks=[JsonlSink(JsonlSink.path_for(log_dir, rank))])
    mon.start()                     # after the model and optimizer exist
    mon.step(iteration)             # every iteration (samples every `interval`)
    mon.finish()                    # at the end: summary record

Importing this package does not import torch; the CUDA and live-bytes sources import it when used.
"""
from .monitor import MemoryMonitor, Prediction, suspect_term, torch_stage_gather
from .sinks import SCHEMA, CallbackSink, JsonlSink, Sink, WriterSink
from .sources import CudaMemorySource, LiveBytesSource, MemorySource, Reading, StaticSource

__all__ = [
    "CallbackSink", "CudaMemorySource", "JsonlSink", "LiveBytesSource", "MemoryMonitor", "MemorySource", "Prediction",
    "Reading", "SCHEMA", "Sink", "StaticSource", "WriterSink", "suspect_term", "torch_stage_gather",
]
