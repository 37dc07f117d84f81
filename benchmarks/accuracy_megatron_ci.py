"""How close is memguard to the GPU memory Megatron-LM's own CI measured?

    python benchmarks/accuracy_megatron_ci.py [--all] [--verbose] [--records dense|moe|FILE] [--out ...]

Feeds each record of ``shared/groundtruth/megatron-functional-dev.jsonl`` (flags, environment, world size
of a Megatron functional test; ``torch.cuda.memory_stats()`` of the last global rank per iteration on
H100 80GB, A100 80GB and GB200) to the estimator with its default profile, predicts the measured rank
(the last global rank: last pipeline stage, last TP and DP rank) and compares
* the peak: max over iterations of ``mem_max_allocated_bytes`` with the estimate's peak allocated;
* the steady value after the optimizer step (last ``mem_allocated_bytes``) with its persistent bytes.
By default only records with empty ``quality_flags`` count (``--all`` shows every record).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_memguard import estimate, lookup_gpu  # noqa: E402
from megatron_memguard.config import RawConfig  # noqa: E402
from megatron_memguard.errors import MemguardError  # noqa: E402
from megatron_memguard.readers.megatron_flags import flags_from_mapping, parse_megatron_flags  # noqa: E402
from megatron_memguard.resolve import resolve  # noqa: E402

from benchmarks.shared_data import DENSE_RECORDS as DATA, MOE_RECORDS  # noqa: E402
PLATFORM_GPU = {"dgx_h100": "H100-80GB", "dgxh100_dgxc": "H100-80GB", "dgx_a100": "A100-80GB",
                "dgxa100_dracooci": "A100-80GB", "dgxa100_dracooci-ord": "A100-80GB", "dgx_gb200": "GB200", None: "A100-80GB"}
PLATFORM_NAME = {"dgx_h100": "H100", "dgxh100_dgxc": "H100", "dgx_a100": "A100", "dgxa100_dracooci": "A100",
                 "dgxa100_dracooci-ord": "A100", "dgx_gb200": "GB200", None: "A100?"}


@dataclass
class Row:
    id: str
    platform: str
    flags: list[str]
    measured_peak: float
    measured_steady: float
    est_peak: float | None = None
    est_steady: float | None = None
    error: str | None = None
    phase: str = ""
    layout: object = None           # the resolved Layout (records with equal layouts get equal estimates)

    @property
    def peak_err(self) -> float | None:
        return None if self.est_peak is None else (self.est_peak - self.measured_peak) / self.measured_peak

    @property
    def steady_err(self) -> float | None:
        return None if self.est_steady is None else (self.est_steady - self.measured_steady) / self.measured_steady


def _numbers(series: dict) -> list[float]:
    return [float(v) for k, v in sorted(series.items(), key=lambda kv: int(kv[0])) if v not in ("nan", None)]


def load_records(path: str = DATA, include_flagged: bool = False) -> list[dict]:
    out = []
    with open(path) as fh:
        for line in fh:
            r = json.loads(line)
            if r.get("category") != "training" or r.get("mem_metric_kind") != "per_iteration":
                continue
            if not include_flagged and r["quality_flags"]:
                continue
            if r.get("world_size") is None:
                continue
            out.append(r)
    return out


def record_raw(r: dict) -> RawConfig:
    env = {str(k): str(v) for k, v in {**(r.get("recipe_extra_env") or {}), **(r.get("env_vars") or {})}.items()}
    raw = parse_megatron_flags(flags_from_mapping(r["model_args"]), env=env, source=r["id"])
    return RawConfig(args=raw.args, origin=raw.origin, source=raw.source, env=env, world_size=r["world_size"])


def evaluate(r: dict) -> Row:
    peak = max(_numbers(r["mem_max_allocated_bytes"]))
    steady = _numbers(r["mem_allocated_bytes"])[-1]
    row = Row(id=r["id"], platform=PLATFORM_NAME.get(r["platform"], str(r["platform"])),
              flags=flags_from_mapping(r["model_args"]), measured_peak=peak, measured_steady=steady)
    try:
        layout = resolve(record_raw(r))
        est = estimate(layout, gpu=lookup_gpu(PLATFORM_GPU.get(r["platform"], "H100-80GB")), dp_rank="last")
    except MemguardError as e:
        row.error = str(e)
        return row
    last = est.stages[-1]
    row.est_peak = last.peak_allocated_bytes
    row.est_steady = last.persistent_bytes
    row.phase = last.peak_phase
    row.layout = layout
    return row


def summarise(rows: list[Row]) -> list[str]:
    lines = []
    for plat in sorted({r.platform for r in rows}):
        rs = [r for r in rows if r.platform == plat]
        ok = [r for r in rs if r.peak_err is not None]
        if not ok:
            lines.append(f"| {plat} | {len(rs)} | 0 | - | - | - | - | - |")
            continue
        pe = [abs(r.peak_err) for r in ok]
        se = [abs(r.steady_err) for r in ok]
        lines.append(
            f"| {plat} | {len(rs)} | {len(ok)} | {statistics.median(pe):.2%} | "
            f"{sum(e <= 0.05 for e in pe) / len(rs):.0%} | {sum(e <= 0.10 for e in pe) / len(rs):.0%} | "
            f"{statistics.median(se):.2%} | {sum(e <= 0.03 for e in se) / len(rs):.0%} |")
    return lines


def overall(rows: list[Row]) -> str:
    """The shares over all records (a refused record counts as a miss)."""
    peak = sum(r.peak_err is not None and abs(r.peak_err) <= 0.05 for r in rows)
    steady = sum(r.steady_err is not None and abs(r.steady_err) <= 0.03 for r in rows)
    n = len(rows)
    return (f"All platforms: peak within 5% on {peak}/{n} ({peak / n:.1%}), "
            f"steady within 3% on {steady}/{n} ({steady / n:.1%}) records.")


def indistinguishable(rows: list[Row], spread: float = 0.03) -> list[list[Row]]:
    """Groups of records on one platform whose flags and environment resolve to the same layout (so
    memguard, or any model of the flags, predicts the same bytes) but whose measured steady or peak
    values differ by more than ``spread``: the measurements themselves bound the achievable accuracy."""
    groups: dict[tuple, list[Row]] = {}
    for r in rows:
        if r.layout is not None:
            groups.setdefault((r.platform, r.layout), []).append(r)
    out = []
    for g in groups.values():
        for vals in ([r.measured_steady for r in g], [r.measured_peak for r in g]):
            if len(g) > 1 and (max(vals) - min(vals)) / min(vals) > spread:
                out.append(sorted(g, key=lambda r: r.id))
                break
    return sorted(out, key=lambda g: g[0].id)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--all", action="store_true", help="include records with quality flags")
    ap.add_argument("--verbose", action="store_true", help="print every record")
    ap.add_argument("--records", default="dense",
                    help="dense (megatron-functional-dev.jsonl), moe (megatron-functional-moe-dev.jsonl) or a JSONL path")
    ap.add_argument("--out", default=None, help="default benchmarks/results/megatron-ci[-moe].md")
    ns = ap.parse_args(argv)
    path = {"dense": DATA, "moe": MOE_RECORDS}.get(ns.records, ns.records)
    if ns.out is None:
        ns.out = os.path.join(ROOT, "benchmarks", "results", "megatron-ci-moe.md" if ns.records == "moe" else "megatron-ci.md")
    rows = [evaluate(r) for r in load_records(path, include_flagged=ns.all)]
    head = ["| platform | records | estimated | median abs peak error | peak within 5% | peak within 10% | "
            "median abs steady error | steady within 3% |",
            "|---|---|---|---|---|---|---|---|"]
    summary = head + summarise(rows) + ["", overall(rows)]
    table = ["| record | measured peak GiB | est peak GiB | peak err | measured steady GiB | est steady GiB | steady err | est peak phase |",
             "|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r.platform, -abs(r.peak_err or 9))):
        if r.error:
            table.append(f"| {r.id} | {r.measured_peak / 2**30:.3f} | - | - | {r.measured_steady / 2**30:.3f} | - | - | not estimated: {r.error} |")
        else:
            table.append(f"| {r.id} | {r.measured_peak / 2**30:.3f} | {r.est_peak / 2**30:.3f} | {r.peak_err:+.1%} | "
                         f"{r.measured_steady / 2**30:.3f} | {r.est_steady / 2**30:.3f} | {r.steady_err:+.1%} | {r.phase} |")
    worst = sorted((r for r in rows if r.peak_err is not None), key=lambda r: -abs(r.peak_err))[:8]
    twins = indistinguishable(rows)
    twin_lines = []
    for g in twins:
        twin_lines += [f"- {g[0].platform}, estimate steady {g[0].est_steady / 2**30:.3f} GiB, peak {g[0].est_peak / 2**30:.3f} GiB:"]
        twin_lines += [f"  - {r.id}: measured steady {r.measured_steady / 2**30:.3f} GiB ({r.steady_err:+.1%}), "
                       f"peak {r.measured_peak / 2**30:.3f} GiB ({r.peak_err:+.1%})" for r in g]
    text = ["# memguard vs Megatron-LM CI measurements", "",
            f"{len(rows)} training records ({'all' if ns.all else 'empty quality_flags only'}); "
            "the last global rank; default profile (transformer_engine unless the record says local).", "",
            *summary, "", "Worst peak errors:", "",
            *[f"- {r.id}: {r.peak_err:+.1%} (measured {r.measured_peak / 2**30:.3f} GiB)" for r in worst], "",
            "## Records memguard cannot tell apart", "",
            f"{len(twins)} groups of records whose flags and environment resolve to the same layout on the same "
            "platform (so they get the same estimate) but whose measurements differ by more than 3%:", "",
            *twin_lines, "",
            "## Every record", "", *table, ""]
    print("\n".join(summary))
    print("worst:", *[f"{r.id} {r.peak_err:+.1%}" for r in worst], sep="\n  ")
    print(f"same layout, measurements more than 3% apart: {len(twins)} groups, {sum(len(g) for g in twins)} records")
    if ns.verbose:
        print("\n".join(table))
    os.makedirs(os.path.dirname(ns.out), exist_ok=True)
    with open(ns.out, "w") as fh:
        fh.write("\n".join(text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
