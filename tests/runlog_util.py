"""Write runtime JSONL logs the way a run does: the real MemoryMonitor and JsonlSink, a scripted source."""
from __future__ import annotations

from megatron_memguard import estimate, layout_from_flags, lookup_gpu
from megatron_memguard.runtime import JsonlSink, MemoryMonitor, Prediction, Reading, StaticSource

from conftest import LLAMA31_8B


def make_estimate(pp=2, tp=2, world=8, gpu="H100-80GB", extra=()):
    flags = LLAMA31_8B + ["--micro-batch-size", "1", "--tensor-model-parallel-size", str(tp),
                          "--pipeline-model-parallel-size", str(pp), "--global-batch-size", "64",
                          "--use-distributed-optimizer", "--sequence-parallel", *extra]
    return estimate(layout_from_flags(flags, world_size=world), gpu=lookup_gpu(gpu))


def scripted_readings(pred: Prediction, iterations, scale):
    """One reading per sample: the peak grows towards ``scale(rank-independent)`` x the prediction."""
    out = []
    for k, _ in enumerate(iterations):
        f = scale * (0.9 + 0.1 * (k + 1) / len(iterations))
        alloc = int(pred.persistent)
        out.append(Reading(allocated=alloc, max_allocated=int(pred.peak_allocated * f), reserved=int(alloc * 1.02),
                           max_reserved=int(pred.peak_reserved * f * 1.01),
                           device_used=int(pred.device_total * f * 1.01)))
    return out


def write_run(log_dir, est, ranks_per_stage=2, interval=10, iterations=5, scales=None, restart=False, finish=True):
    """One JSONL file per rank (rank = pp * ranks_per_stage + i); ``scales[rank]`` scales its actual peaks.
    Returns {rank: [records written]}."""
    from megatron_memguard.runtime import CallbackSink
    written = {}
    its = [interval * (k + 1) for k in range(iterations)]
    for pp in range(len(est.stages)):
        pred = Prediction.from_estimate(est, pp)
        for i in range(ranks_per_stage):
            rank = pp * ranks_per_stage + i
            scale = (scales or {}).get(rank, 0.97)
            recs = []
            for attempt in range(2 if restart else 1):
                sink = JsonlSink(JsonlSink.path_for(str(log_dir), rank))
                mon = MemoryMonitor(StaticSource(scripted_readings(pred, its, scale * (0.8 if restart and not attempt else 1))),
                                    pred, rank=rank, interval=interval, sinks=[sink, CallbackSink(recs.append)],
                                    emit=lambda s: None, emit_error=lambda s: None)
                mon.start()
                for it in range(1, its[-1] + 1):
                    mon.step(it)
                if finish:
                    mon.finish()
                else:
                    sink.close()
            written[rank] = recs
    return written
