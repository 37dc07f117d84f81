"""Why memguard's peak misses the Muon MoE records of Megatron CI: the evidence, record by record.

    PYTHONPATH=. python benchmarks/muon_peak_evidence.py

For each record of ``gpt3_moe_mcore_te_ep8_resume_torch_dist*muon*`` in
shared/groundtruth/megatron-functional-moe-dev.jsonl (all flags and quality flags; the measured rank is the
last one) it prints, in MiB:

* the measured peak of iteration 1, of iteration 2 and over all iterations, and the steady value after the
  step (flat to 0.2 MiB over the 100 iterations);
* ``lazy``: memguard's optimizer state that the first step creates (Muon's momentum, ``OrthogonalizedOptimizer
  ._init_group``; the fallback Adam's moments). Iteration 1's forward runs without it, iteration 2's with it,
  so the measured jump it2 - it1 is that state plus whatever else grew;
* ``act``: the bytes the peak holds above the steady state without that state: measured
  ``it1 - (steady - lazy)``, memguard ``peak - persistent`` (the same for every record: balanced routing);
* ``rows x``: the expert rows per layer, as a multiple of the balanced ``T * k``, that memguard's per-row
  slope (from its balanced and worst-case estimates) needs to reach the measured max peak;
* the worst-case bound memguard prints (every token of the EP group on this rank's experts) and the
  optimizer step's own working set (Newton-Schulz on the largest matrix).

Taking ``act`` from iteration 1 and the measured steady value removes every optimizer-state term: what is
left is activations and transients.
"""
from __future__ import annotations

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.accuracy_megatron_ci import PLATFORM_GPU, _numbers, record_raw  # noqa: E402
from benchmarks.shared_data import MOE_RECORDS  # noqa: E402
from megatron_memguard import estimate, lookup_gpu  # noqa: E402
from megatron_memguard.estimator.muon import step_working_set  # noqa: E402
from megatron_memguard.resolve import resolve  # noqa: E402

LAZY = ("muon_momentum", "adam_exp_avg", "adam_exp_avg_sq", "lion_exp_avg")
MiB = 2 ** 20


def rows(path: str = MOE_RECORDS) -> list[dict]:
    out = []
    with open(path) as fh:
        for line in fh:
            r = json.loads(line)
            if "muon" not in r["test"] or r.get("is_second_run"):
                continue
            L = resolve(record_raw(r))
            st = estimate(L, gpu=lookup_gpu(PLATFORM_GPU[r["platform"]]), dp_rank="last").stages[-1]
            peaks = _numbers(r["mem_max_allocated_bytes"])
            steady = _numbers(r["mem_allocated_bytes"])
            lazy = sum(st.breakdown.get(k, 0) for k in LAZY)
            worst = st.moe["worst_case"]["peak_allocated_bytes"]
            n_bal, n_worst = st.moe["expert_rows_balanced"], st.moe["expert_rows_worst"]
            per_row = (worst - st.peak_allocated_bytes) / (n_worst - n_bal)
            out.append(dict(
                id=r["id"], platform=r["platform"], ep=L.moe.ep, dist=L.use_distributed_optimizer,
                it1=peaks[0], it2=peaks[1], peak=max(peaks), steady=steady[-1],
                steady_range=max(steady[1:]) - min(steady[1:]), lazy=lazy,
                act_measured=peaks[0] - (steady[-1] - lazy), act_est=st.peak_allocated_bytes - st.persistent_bytes,
                est_peak=st.peak_allocated_bytes, est_steady=st.persistent_bytes, worst=worst,
                rows_x=1 + (max(peaks) - st.peak_allocated_bytes) / per_row / n_bal,
                step_ws=step_working_set(L, L.pp - 1).bytes))
    return out


def main() -> int:
    rs = rows()
    print("| record | platform | EP | dist-opt | it1 | it2 | max | steady | lazy | it2-it1 | act measured | act memguard "
          "| peak err | rows x | worst bound | step working set |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rs:
        name = r["id"].split("/")[1].replace("gpt3_moe_mcore_te_ep8_resume_torch_dist_", "")
        print(f"| {name} | {r['platform']} | {r['ep']} | {'yes' if r['dist'] else 'no'} | {r['it1'] / MiB:.0f} | "
              f"{r['it2'] / MiB:.0f} | {r['peak'] / MiB:.0f} | {r['steady'] / MiB:.0f} | {r['lazy'] / MiB:.0f} | "
              f"{(r['it2'] - r['it1']) / MiB:.0f} | {r['act_measured'] / MiB:.0f} | {r['act_est'] / MiB:.0f} | "
              f"{(r['est_peak'] - r['peak']) / r['peak']:+.1%} | {r['rows_x']:.2f} | {r['worst'] / MiB:.0f} | "
              f"{r['step_ws'] / MiB:.1f} |")
    groups: dict[tuple, list[float]] = {}
    for r in rs:
        groups.setdefault((r["platform"], r["ep"]), []).append(r["act_measured"] / MiB)
    print("\nactivation bytes at the peak by (platform, EP), both optimizer layouts together:")
    for k, v in sorted(groups.items()):
        print(f"  {k[0]} EP{k[1]}: " + ", ".join(f"{x:.0f}" for x in v) + " MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
