"""How fast is an estimate? Targets (issue 2): one estimate < 1 ms, a cold `memguard estimate` < 0.3 s;
(issue 16) a cold estimate of the DeepSeek-V3 layout below (61 layers, MLA, 256 experts top-8 + 1 shared,
3 dense first layers, PP16 with VPP, EP 64) < 1 ms.

    python benchmarks/estimate_speed.py

Prints the median time of ``estimate()`` for a few layouts, in wall time and in CPU time of the calling
thread (the figure to compare on a machine other jobs load: waiting for a core does not count), and the
wall time of a cold ``memguard estimate`` process (new interpreter, as a user runs it).
"""
from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.cold_start import cold_process_seconds  # noqa: E402
from megatron_memguard import estimate, layout_from_flags  # noqa: E402

LLAMA_70B = ("--num-layers 80 --hidden-size 8192 --ffn-hidden-size 28672 --num-attention-heads 64 "
             "--group-query-attention --num-query-groups 8 --seq-length 8192 --max-position-embeddings 8192 "
             "--position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear "
             "--untie-embeddings-and-output-weights --tokenizer-type NullTokenizer --vocab-size 128256 --bf16 "
             "--micro-batch-size 1 --global-batch-size 1024 --use-distributed-optimizer --sequence-parallel").split()
# DeepSeek-V3's shape (61 layers, MLA, 256 experts top-8 + 1 shared, the first 3 layers dense) on 1,024
# GPUs: PP16 with two virtual stages per rank (Megatron's DeepSeek-V3 layout without its MTP layer), EP 64.
DEEPSEEK_V3 = ("--num-layers 61 --hidden-size 7168 --ffn-hidden-size 18432 --num-attention-heads 128 "
               "--multi-latent-attention --q-lora-rank 1536 --kv-lora-rank 512 --qk-head-dim 128 --qk-pos-emb-head-dim 64 "
               "--v-head-dim 128 --swiglu --normalization RMSNorm --disable-bias-linear --untie-embeddings-and-output-weights "
               "--position-embedding-type rope --num-experts 256 --moe-router-topk 8 --moe-ffn-hidden-size 2048 "
               "--moe-shared-expert-intermediate-size 2048 --moe-router-score-function sigmoid --moe-router-enable-expert-bias "
               "--moe-grouped-gemm --moe-token-dispatcher-type alltoall --moe-layer-freq ([0]*3+[1]*58) "
               "--pipeline-model-parallel-size 16 --pipeline-model-parallel-layout Et|(tt|)*30L --expert-model-parallel-size 64 "
               "--seq-length 4096 --max-position-embeddings 4096 --micro-batch-size 1 --global-batch-size 8192 --bf16 "
               "--use-distributed-optimizer --tokenizer-type NullTokenizer --vocab-size 129280").split()
CASES = {
    "70B TP8 PP1 DP128": (LLAMA_70B + ["--tensor-model-parallel-size", "8"], 1024),
    "70B TP8 PP4 DP32": (LLAMA_70B + ["--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "4"], 1024),
    "70B TP8 PP4 VPP5 DP32": (LLAMA_70B + ["--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "4",
                                           "--num-layers-per-virtual-pipeline-stage", "4"], 1024),
    "70B TP4 PP16 DP16": (LLAMA_70B + ["--tensor-model-parallel-size", "4", "--pipeline-model-parallel-size", "16"], 1024),
    "DeepSeek-V3 PP16 VPP2 EP64": (DEEPSEEK_V3, 1024),
}


def _clear_caches() -> None:
    """Forget the per-layout tables so that every call pays the whole estimate (a planner sees new
    layouts all the time)."""
    from megatron_memguard import partition, schedule
    from megatron_memguard.estimator import activations, core, overheads, params, states
    from megatron_memguard.estimator.layers import mla, moe
    for fn in (activations.shapes, activations.layer_activations, params._layer_numels, params._layer_numel_split,
               states._stage_states, states._chunk_buffer, states._chunk_totals, *([states._chunk_totals_max] if hasattr(states, "_chunk_totals_max") else []), core._fixed_terms, core._device_terms,
               core._chunk_activations, core._state_terms, core._persistent_buffers,
               core.replicated_grad_allreduce_bytes, core._stage_shapes, core._stage_prep, core._moe_worst_inputs,
               core._moe_layer_buffers, overheads.dummy_wgrad_shapes, overheads.dummy_wgrad_bytes,
               schedule.p2p_probes, schedule.p2p_passes, schedule._p2p_ranges, schedule._sample_context, schedule.walk_passes,
               schedule._lingering, schedule._received_for,
               schedule._grad_received_for, core._p2p_peak, core._combined_walk_peak, partition.model_kind_runs, moe.layer_moe_activations, mla.layer_attention_items):
        fn.cache_clear()


def _forget_cached_properties(layout: Any) -> None:
    """Drop what the layout object has cached of itself (its chunks, chunks by stage, derived sizes): a cold
    estimate of a new layout pays for them too."""
    import dataclasses
    import functools
    for obj in [layout] + [getattr(layout, f.name) for f in dataclasses.fields(layout)]:
        for klass in type(obj).__mro__:
            for name, attr in vars(klass).items():
                # functools.cached_property and layout.py's _derived both keep their value in the instance
                if isinstance(attr, functools.cached_property) or type(attr).__name__ == "_derived":
                    getattr(obj, "__dict__", {}).pop(name, None)


def time_estimate(layout: Any, repeat: int = 200, cold: bool = True, clock: Any = time.perf_counter,
                  read_terms: bool = False) -> float:
    """``read_terms``: also read every stage's term list and MoE figures, which ``estimate()`` builds at
    their first read (a planner never reads them; `memguard estimate --detail` and the JSON do)."""
    times = []
    for _ in range(repeat):
        if cold:
            _clear_caches()
            _forget_cached_properties(layout)
        t = clock()
        est = estimate(layout)
        if read_terms:
            for stage in est.stages:
                stage.terms, stage.moe
        times.append(clock() - t)
    return statistics.median(times)


def main() -> None:
    print("estimate() median over 200 calls, cold (caches cleared before each call) and warm; wall time "
          "(CPU time of this thread); the target is read on the estimate's numbers (every stage's peak, levels, "
          "phase and verdict), its term lists being built at their first read:")
    for name, (flags, world) in CASES.items():
        layout = layout_from_flags(flags, world_size=world)
        estimate(layout)
        cold, cold_cpu = time_estimate(layout), time_estimate(layout, clock=time.thread_time)
        warm, warm_cpu = time_estimate(layout, cold=False), time_estimate(layout, cold=False, clock=time.thread_time)
        read_cpu = time_estimate(layout, clock=time.thread_time, read_terms=True)
        print(f"  {name:27s} cold {cold * 1e3:6.3f} ms ({cold_cpu * 1e3:6.3f})   warm {warm * 1e3:6.3f} ms "
              f"({warm_cpu * 1e3:6.3f})   target < 1 ms cold: {'met' if min(cold, cold_cpu) < 1e-3 else 'MISSED'}"
              f"   cold with every stage's terms read: ({read_cpu * 1e3:6.3f})")
    cmd = [sys.executable, "-m", "megatron_memguard.cli.main", "estimate", "--config",
           os.path.join(ROOT, "examples", "llama3_8b_h100.sh")]
    walls = cold_process_seconds(cmd, 5, ROOT)
    print(f"cold `memguard estimate --config examples/llama3_8b_h100.sh`: median {statistics.median(walls):.3f} s "
          f"over 5 runs (target < 0.3 s)")


if __name__ == "__main__":
    main()
