"""Runtime memory monitoring, framework-free: a pluggable memory source, a per-rank monitor that
compares actual with predicted memory, and sinks (JSONL, TensorBoard / W&B writers).

Used by the Megatron hook (``megatron_memguard.megatron``) and meant for Bridge / Lightning callbacks:

    from megatron_memguard.runtime import CudaMemorySource, JsonlSink, MemoryMonitor, Prediction
    mon = MemoryMonitor(CudaMemorySource(), Prediction.from_estimate(est, pp_rank), rank=rank,
                        interval=100, sinks=[JsonlSink(JsonlSink.path_for(log_dir, rank))])
    mon.start()                     # after the model and optimizer exist
    mon.step(iteration)             # every iteration (samples every `interval`)
    mon.finish()                    # at the end: summary record

Importing this package does not import torch; the CUDA and live-bytes sources import it when used. Those and
``torch_stage_gather`` live in ``torch_sources.py`` / ``torch_gather.py`` and load on first use of their names
(``__getattr__`` below), so that no torch import is anywhere in what the package imports: ``tests/framework_free.py``
reads that from the source and runs the tests that use the package once, not in every venv.
"""
from typing import Any

from .monitor import MemoryMonitor, Prediction, suspect_term
from .sinks import SCHEMA, CallbackSink, JsonlSink, Sink, WriterSink
from .sources import MemorySource, Reading, StaticSource

__all__ = [
    "CallbackSink", "CudaMemorySource", "JsonlSink", "LiveBytesSource", "MemoryMonitor", "MemorySource", "Prediction",
    "Reading", "SCHEMA", "Sink", "StaticSource", "WriterSink", "suspect_term", "torch_stage_gather",
]


def __getattr__(name: str) -> Any:
    if name in ("CudaMemorySource", "LiveBytesSource"):
        from .torch_sources import CudaMemorySource, LiveBytesSource
        return CudaMemorySource if name == "CudaMemorySource" else LiveBytesSource
    if name == "torch_stage_gather":
        from .torch_gather import torch_stage_gather
        return torch_stage_gather
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
