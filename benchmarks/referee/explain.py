"""Print what is live at the peak for referee results.

    python -m benchmarks.referee.explain benchmarks/results/referee-measured.json [--config NAME] [--rank R]
"""

from __future__ import annotations

import argparse
import json

from .livebytes import LiveBytesTracker, format_bytes


def explain_rank(r: dict, top: int = 20) -> str:
    mib = 1024 ** 2
    lines = [
        f"rank {r['rank']} (tp{r['tp_rank']} pp{r['pp_rank']} dp{r['dp_rank']}), "
        f"{r['num_microbatches']} micro-batches, params {r['num_params']:,}",
        f"  after build {r['live_bytes_after_build'] / mib:.3f} MiB, after step "
        f"{r['live_bytes_after_step'] / mib:.3f} MiB, peak {r['peak_bytes'] / mib:.3f} MiB "
        f"(+{(r['peak_bytes'] - r['live_bytes_after_step']) / mib:.3f} over after-step) in [{r['peak_phase']}]",
        "  live at the peak by allocation phase:",
    ]
    for k, v in r["peak_live_by_phase_class"].items():
        lines.append(f"    {format_bytes(v):>12}  {k}")
    lines.append("  largest live storages at the peak:")
    lines.append("    " + LiveBytesTracker.format_dump(r["peak_top_storages"][:top]).replace("\n", "\n    "))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("results")
    p.add_argument("--config", nargs="*", default=None)
    p.add_argument("--rank", type=int, default=None, help="default: the rank with the largest peak")
    p.add_argument("--top", type=int, default=20)
    a = p.parse_args(argv)
    with open(a.results) as f:
        res = json.load(f)
    cfgs = res["configs"] if isinstance(res, dict) else [{"name": "run", "ranks": res, "status": "ok"}]
    for c in cfgs:
        if a.config and c["name"] not in a.config:
            continue
        print(f"=== {c['name']} ({c.get('status')})")
        if c.get("status") != "ok":
            continue
        ranks = c["ranks"]
        if a.rank is not None:
            sel = [r for r in ranks if r["rank"] == a.rank]
        else:
            sel = [max(ranks, key=lambda r: r["peak_bytes"])]
        for r in sel:
            print(explain_rank(r, a.top))


if __name__ == "__main__":
    main()
