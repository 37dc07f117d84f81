"""How fast is `memguard plan`? Target (issue 6): Llama-3.1-70B, sequence 8192, GBS 1024 on 1024 H100s
in under 2 s on this machine.

    python benchmarks/plan_speed.py

Prints, for the planner called in-process (median of 5 runs, each on a fresh Planner so nothing is
cached between runs) and for a cold `memguard plan` process, the measured time and how many layouts
were considered (enumerated and timed), visited, bounded out, estimated and found to fit.
"""
from __future__ import annotations

import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.cold_start import cold_process_seconds  # noqa: E402
from megatron_memguard.gpus import lookup_gpu  # noqa: E402
from megatron_memguard.planner import Cluster, Constraints, Planner, PlanResult  # noqa: E402
from megatron_memguard.readers.megatron_flags import parse_megatron_flags  # noqa: E402

# Llama-3.1-70B (Meta's config.json): 80 layers, h 8192, ffn 28672, 64 heads, 8 KV groups, vocab 128256,
# untied embeddings, RMSNorm, SwiGLU, rope, no biases, no dropout; bf16.
LLAMA31_70B = ("--num-layers 80 --hidden-size 8192 --ffn-hidden-size 28672 --num-attention-heads 64 "
               "--group-query-attention --num-query-groups 8 --max-position-embeddings 8192 "
               "--position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear "
               "--untie-embeddings-and-output-weights --hidden-dropout 0 --attention-dropout 0 "
               "--tokenizer-type NullTokenizer --vocab-size 128256 --bf16").split()
GPUS, SEQ, GBS, TOP = 1024, 8192, 1024, 5
TARGET_S = 2.0


def plan_once() -> tuple[float, PlanResult]:
    gpu = lookup_gpu("H100-80GB")
    t = time.perf_counter()
    raw = parse_megatron_flags(LLAMA31_70B)
    cluster = Cluster(gpus=GPUS, gpus_per_node=gpu.gpus_per_node, gpu=gpu, nvlink_domain=gpu.nvlink_domain,
                      gpu_memory_bytes=gpu.memory_bytes)
    planner = Planner(raw, cluster, seq_length=SEQ, global_batch_size=GBS)
    res = planner.plan(Constraints(), top=TOP)
    return time.perf_counter() - t, res


def main() -> None:
    runs = [plan_once() for _ in range(5)]
    times = [t for t, _ in runs]
    res = runs[-1][1]
    sd = res.search_dict()
    med = statistics.median(times)
    print(f"Llama-3.1-70B, seq {SEQ}, GBS {GBS}, {GPUS} x H100-80GB, top {TOP}, rule time")
    print(f"in-process plan(): median {med:.3f} s over 5 runs (min {min(times):.3f}, max {max(times):.3f}); "
          f"target < {TARGET_S:.0f} s: {'met' if med < TARGET_S else 'MISSED'}")
    print(f"layouts: {sd['considered']:,} considered, {sd['visited']:,} visited, "
          f"{sd['pruned_by_memory_bound']:,} bounded out, {sd['rejected_by_megatron_rules']:,} rejected by rules, "
          f"{sd['estimated']:,} estimated, {sd['fitting']:,} fitting ({sd['tight']} tight, {sd['will_not_fit']} will not fit)")
    best = res.entries[0]
    print(f"best: {best.candidate.label} ({best.candidate.name}): {best.time.seconds:.2f} s/step, "
          f"{best.time.tokens_per_s_per_gpu:,.0f} tokens/s/GPU, MFU {best.time.mfu:.1%}, "
          f"peak {best.estimate.peak_device_bytes / 2**30:.1f} GiB")
    cmd = [sys.executable, "-m", "megatron_memguard.cli.main", "plan", "--gpus", str(GPUS), "--gpu", "H100-80GB",
           "--seq-length", str(SEQ), "--global-batch-size", str(GBS), "--top", str(TOP), "--", *LLAMA31_70B]
    walls = cold_process_seconds(cmd, 3, ROOT)
    print(f"cold `memguard plan` process (interpreter start, imports, output): median {statistics.median(walls):.3f} s "
          f"over 3 runs")


if __name__ == "__main__":
    main()
