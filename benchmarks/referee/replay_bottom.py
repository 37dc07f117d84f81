"""A bottom layer's replay under full uniform recompute, measured on the installed megatron-core (0.16.1 or 0.19.2).

    python -m benchmarks.referee.replay_bottom [--out benchmarks/results/referee-replay-bottom-measured.json]

Two-layer models whose peak is the bottom layer's own backward (a wide FFN under a narrow layer), so that the layer
above pays nothing back: without recompute and with ``--recompute-granularity full --recompute-method uniform
--recompute-num-layers 1``. ``het_wide_bottom``: heterogeneous blocks (tests/data/heterogeneous/wide_bottom.json,
FFN x32 under FFN x1, h 512); ``moe_wide_bottom``: a dense layer (FFN 16384) under an MoE layer (2 experts of 128,
top-1, alltoall, EP1, h 256); ``moe_wide_bottom3``: the same under two such dense layers (three layers, the MoE one
on top), whose bottom layer's replay comes after the dense block above it freed its kept input while the MoE block's
stays. tests/test_referee_replay.py reads the file (test_a_bottom_layers_replay_raises_the_peak_by_what_it_holds).

    python -m benchmarks.referee.replay_bottom --only moe_wide_bottom3_none moe_wide_bottom3_u1   # keep the others
"""
from __future__ import annotations

import argparse
import json
import os
import platform

from .grid import COMMON, resolve_config
from .moe_grid import moe_settings
from .replay_grid import HET_FLAGS, _RECOMPUTE
from .run import FSDP_MEGATRON_CORES, run_referee

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VERSION = {"0.16.1": "0.16.1", "0.19.2": "0.19"}
HET_FILE = "tests/data/heterogeneous/wide_bottom.json"
_n = HET_FLAGS.index("--num-layers")
HET_BASE = HET_FLAGS[:_n + 1] + ["2"] + HET_FLAGS[_n + 2:] + ["--heterogeneous-layers-config-path", HET_FILE]
MOE_BASE = ("--num-layers 2 --hidden-size 256 --num-attention-heads 8 --group-query-attention --num-query-groups 4 "
            "--seq-length 256 --max-position-embeddings 256 --micro-batch-size 2 --global-batch-size 2 "
            "--vocab-size 128 --make-vocab-size-divisible-by 128 --ffn-hidden-size 16384 --swiglu "
            "--normalization RMSNorm --position-embedding-type rope --disable-bias-linear "
            "--untie-embeddings-and-output-weights --bf16 --num-experts 2 --moe-ffn-hidden-size 128 "
            "--moe-router-topk 1 --moe-router-pre-softmax --expert-model-parallel-size 1 "
            "--moe-token-dispatcher-type alltoall --moe-layer-freq [0,1]").split()
MOE3_BASE = [("3" if MOE_BASE[i - 1] == "--num-layers" else "[0,0,1]" if MOE_BASE[i - 1] == "--moe-layer-freq" else f)
             for i, f in enumerate(MOE_BASE)]


def configs() -> list[dict]:
    out = []
    for rec in ("none", "u1"):
        more = _RECOMPUTE[rec].split() if rec != "none" else []
        out.append({"name": f"het_wide_bottom_{rec}", "flags": COMMON + HET_BASE + more})
        out.append({"name": f"moe_wide_bottom_{rec}", "flags": COMMON + MOE_BASE + more})
        out.append({"name": f"moe_wide_bottom3_{rec}", "flags": COMMON + MOE3_BASE + more})
    return out


def flags_under(flags: list[str], root: str) -> list[str]:
    return [os.path.join(root, f) if f == HET_FILE else f for f in flags]


def settings_of(cfg: dict, version: str) -> dict:
    flags = flags_under(cfg["flags"], ROOT)
    if cfg["name"].startswith("moe_"):
        return moe_settings({"flags": flags, "world_size": 1}, version)[1]
    _, settings = resolve_config(flags, 1, version)
    settings["heterogeneous_layers_config_path"] = os.path.join(ROOT, HET_FILE)
    settings["no_persist_layer_norm"] = True
    return settings


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "referee-replay-bottom-measured.json"))
    p.add_argument("--only", nargs="*", default=None, help="measure these configurations, keep the file's others")
    args = p.parse_args()
    import megatron.core
    import torch
    core = megatron.core.__version__
    data = json.load(open(args.out)) if os.path.exists(args.out) else {}
    entries = []
    for cfg in [c for c in configs() if not args.only or c["name"] in args.only]:
        r = run_referee(settings_of(cfg, VERSION[core]), 1, timeout=900, cores=FSDP_MEGATRON_CORES)[0]
        entries.append({"name": cfg["name"], "flags": cfg["flags"], "peak_bytes": r["peak_bytes"],
                        "peak_phase": r["peak_phase"]})
        print(f"[ok] {cfg['name']}: {r['peak_bytes']} in {r['peak_phase']}", flush=True)
    if args.only and core in data:
        names = {e["name"] for e in entries}
        entries = [e for e in data[core]["configs"] if e["name"] not in names] + entries
    data[core] = {"environment": {"torch": torch.__version__, "megatron_core": core,
                                  "python": platform.python_version()}, "configs": entries}
    with open(args.out, "w") as fh:
        json.dump(data, fh, indent=1)


if __name__ == "__main__":
    main()
