"""What memguard's runtime logging costs per training iteration.

Measures, on this machine:
  1. the hook's training_log wrapper on an iteration that is not sampled (the common case);
  2. one sample: read the source, build the record, JSONL write + flush, TensorBoard scalars, rank 0's
     per-stage lines (8 stages) - with a constant source (no device calls) and, where a GPU exists, with
     the CUDA source (torch.cuda.* allocator counters + device memory in use);
  3. the per-stage all-gather (gloo, one process) that rank 0's pipeline group runs at each sample;
  4. with --step, for scale, a real training step of a tiny megatron-core GPT on this CPU (the test
     driver tests/e2e/pretrain_gpt_cpu.py, one rank, --memguard off).
and prints the amortised cost per iteration for sampling intervals 1, 10 and 100, and the shortest
training step for which that stays under 0.1%.

    python benchmarks/monitor_overhead.py [--samples 2000] [--step]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_memguard import estimate, layout_from_flags, lookup_gpu  # noqa: E402
from megatron_memguard.runtime import (JsonlSink, MemoryMonitor, Prediction, Reading, StaticSource,  # noqa: E402
                                       WriterSink)

FLAGS = ("--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 --group-query-attention "
         "--num-query-groups 8 --seq-length 8192 --max-position-embeddings 8192 --position-embedding-type rope "
         "--normalization RMSNorm --swiglu --disable-bias-linear --untie-embeddings-and-output-weights "
         "--tokenizer-type NullTokenizer --vocab-size 128256 --bf16 --micro-batch-size 1 --global-batch-size 128 "
         "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 8").split()


class _TB:
    def add_scalar(self, tag, value, step):
        pass


def _per_call(fn, n: int, repeat: int = 5) -> float:
    """Median seconds per call over `repeat` batches of n calls."""
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        for i in range(n):
            fn(i)
        times.append((time.perf_counter() - t) / n)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=2000)
    ap.add_argument("--step", action="store_true", help="also time a CPU training step of a tiny megatron-core GPT")
    ns = ap.parse_args()
    est = estimate(layout_from_flags(FLAGS, world_size=128), gpu=lookup_gpu("H100"))
    preds = [Prediction.from_estimate(est, i) for i in range(est.layout.pp)]
    r = Reading(allocated=40 << 30, max_allocated=60 << 30, reserved=62 << 30, max_reserved=63 << 30, device_used=65 << 30)
    rows = {i: [float(i), 6e10, 6.2e10, 6.5e10, 6e10, 6.2e10, 6.5e10] for i in range(8)}
    out: dict[str, float] = {}

    # 1. The wrapper on an iteration that is not sampled.
    from megatron_memguard.megatron import hook as hookmod
    mon = MemoryMonitor(StaticSource(r), preds[0], interval=10**9, emit=lambda s: None)
    hookmod.STATE.monitor = mon
    wrapped = hookmod._wrap_training_log(lambda *a, **k: True)
    args = (None, None, 1e-4, 0, 1.0, True, 0, 1.0, None, 0)
    out["not sampled (wrapper + interval check)"] = _per_call(
        lambda i: wrapped(None, None, 1e-4, i + 1, 1.0, True, 0, 1.0, None, 0), ns.samples * 20)
    hookmod.STATE.monitor = None
    del args

    # 2. One sample.
    with tempfile.TemporaryDirectory() as d:
        sink = JsonlSink(os.path.join(d, "memguard-rank00000.jsonl"))
        mon = MemoryMonitor(StaticSource(r), preds[0], rank=0, interval=1, sinks=[sink, WriterSink(_TB())],
                            emit=lambda s: None, log_stages=True, stage_predictions=preds)
        mon.stage_rows = rows
        out["sample: constant source + JSONL + TB + 8 stage lines"] = _per_call(lambda i: mon.sample(i + 1), ns.samples)
        mon.finish()
        quiet = MemoryMonitor(StaticSource(r), preds[3], rank=3, interval=1,
                              sinks=[JsonlSink(os.path.join(d, "memguard-rank00003.jsonl"))], emit=lambda s: None)
        out["sample on other ranks: constant source + JSONL"] = _per_call(lambda i: quiet.sample(i + 1), ns.samples)
        quiet.finish()

    try:
        import torch
        if torch.cuda.is_available():
            from megatron_memguard.runtime import CudaMemorySource
            src = CudaMemorySource()
            out["CUDA source read (allocator counters + device memory used)"] = _per_call(lambda i: src.read(), ns.samples)
        else:
            print("(no GPU here: the CUDA source's torch.cuda.* reads are not measured)")
        # 3. The per-stage all-gather (gloo, world of one).
        import torch.distributed as dist
        from megatron_memguard.runtime import torch_stage_gather
        if not dist.is_initialized():
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", "29591")
            dist.init_process_group("gloo", rank=0, world_size=1)
        g = torch_stage_gather(None, None)
        vec = [0.0, 6e10, 6.2e10, 6.5e10, 6e10, 6.2e10, 6.5e10]
        out["per-stage all-gather (gloo, 1 process)"] = _per_call(lambda i: g(vec), ns.samples // 4)
        dist.destroy_process_group()
    except ImportError:
        print("(torch not installed: gather not measured)")

    print(f"{'what':<62} {'per call':>12}")
    for k, v in out.items():
        print(f"{k:<62} {v * 1e6:>9.2f} us")
    not_sampled = out["not sampled (wrapper + interval check)"]
    sample = out["sample: constant source + JSONL + TB + 8 stage lines"] + out.get("per-stage all-gather (gloo, 1 process)", 0)
    sample += out.get("CUDA source read (allocator counters + device memory used)", 0)
    print()
    print("amortised per iteration (rank 0, the most expensive rank):")
    for interval in (1, 10, 100):
        per_iter = not_sampled + sample / interval
        print(f"  --memguard-log-interval {interval:>3}: {per_iter * 1e6:8.2f} us/iteration -> under 0.1% of any step longer "
              f"than {per_iter * 1000 * 1e3:.1f} ms")

    if ns.step:
        step = cpu_step_seconds()
        if step:
            per_iter = not_sampled + sample
            print(f"\ntiny GPT (4 layers, hidden 256, 4 micro-batches of 2 x 128 tokens) on this CPU: {step * 1e3:.0f} ms/iteration;"
                  f" memguard at interval 1 adds {per_iter / step:.4%} of it")


def cpu_step_seconds(iters: int = 6) -> float | None:
    import re
    import subprocess
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, os.path.join(root, "tests"))
    from test_hook_runtime_cpu import MODEL  # the same tiny model as the end-to-end test
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29593",
               PYTHONPATH=root, MEMGUARD="off")
    cmd = [sys.executable, os.path.join(root, "tests", "e2e", "pretrain_gpt_cpu.py"), *MODEL, "--distributed-backend", "gloo",
           "--train-iters", str(iters), "--lr", "1e-4", "--log-interval", "1000"]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    m = re.search(r"train: (\d+) iterations in ([0-9.]+) s", p.stdout)
    if not m:
        print("(the CPU training step could not be timed: needs megatron-core 0.16 and the legacy stand-in)")
        return None
    return float(m.group(2)) / int(m.group(1))


if __name__ == "__main__":
    main()
