"""Full recompute's replay measured on the installed megatron-core (0.16.1 or 0.19.2).

    python -m benchmarks.referee.replay_grid [--out benchmarks/results/referee-replay-measured.json]

    python -m benchmarks.referee.replay_grid --only het_top_attention_only_u1 ...   # replace those entries only

Runs the grid's configurations with a 128-word vocabulary whose peak lies in the backward (REPLAY below:
recomputed blocks' replays and the unrecomputed reference), the flags resolved with the installed release's
defaults, and writes them under that release's key of the output file (the other release's entries are kept).
HET: heterogeneous layer configs (tests/data/heterogeneous/top_*.json) whose top layer has no pre-MLP norm (an
attention-only block over MLP-only blocks), no attention (an MLP-only block over attention-only ones) or is an identity
(both halves no-op, over an attention-only block), each block replayed alone, in pairs, and not replayed.
tests/test_referee_replay.py reads the file.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
from typing import Any, Dict, Optional

from .grid import COMMON, resolve_config, select
from .run import FSDP_MEGATRON_CORES, run_referee

REPLAY = ["recomp_full_block1_of4_bwd", "recomp_full_block1_of4_tp2_sp_bwd", "recomp_full_uniform1_bwd",
          "recomp_full_uniform2_bwd", "recomp_full_block3_of4_bwd", "recomp_full_uniform1_tp2_sp_bwd",
          "recomp_full_uniform1_distributed_bwd"]
# (name, tests/data/heterogeneous file, recompute flags): block 3 of 4 leaves the top layer unreplayed (the reference)
# run on 0.19.2 only: megatron-core 0.16.1's uniform loop reads a layer past the chunk for these (IndexError)
REPLAY_019 = ["recomp_full_uniform3_of4_bwd"]
HET_FLAGS = ("--num-layers 4 --hidden-size 512 --num-attention-heads 8 --group-query-attention --num-query-groups 2 "
             "--ffn-hidden-size 1024 --swiglu --normalization RMSNorm --position-embedding-type rope "
             "--use-rope-scaling --use-rotary-position-embeddings --rotary-base 500000 "
             "--untie-embeddings-and-output-weights --disable-bias-linear --seq-length 256 --max-position-embeddings 256 "
             "--micro-batch-size 2 --bf16 --vocab-size 128 --global-batch-size 2").split()
_RECOMPUTE = {"u1": "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1",
              "u2": "--recompute-granularity full --recompute-method uniform --recompute-num-layers 2",
              "b3": "--recompute-granularity full --recompute-method block --recompute-num-layers 3",
              "b4": "--recompute-granularity full --recompute-method block --recompute-num-layers 4"}
HET = [(f"het_{blocks}_{r}", f"tests/data/heterogeneous/{blocks}.json", _RECOMPUTE[r])
       for blocks in ("top_attention_only", "top_mlp_only", "top_identity") for r in ("b3", "u1", "b4", "u2")]
# blocks with their own query groups (small_blocks.json with block 0's attention of 1 group and block 2's of 8, over
# an identity), without recompute: the peak is block 2's unfused softmax backward
HET.append(("het_own_query_groups", "tests/data/heterogeneous/own_query_groups.json", ""))
VERSION = {"0.16.1": "0.16.1", "0.19.2": "0.19"}   # megatron-core release -> memguard's --megatron-version
# what tests/test_referee_replay.py reads of a rank (the largest 30 live storages at the peak)
KEEP = ("rank", "world_size", "tp_rank", "pp_rank", "dp_rank", "tp_size", "pp_size", "dp_size", "num_params",
        "live_bytes_after_build", "live_bytes_after_step", "peak_bytes", "peak_phase", "peak_live_by_phase_class",
        "peak_top_storages")


def het_configs() -> list[Dict[str, Any]]:
    """The HET configurations as grid entries (flags with the config file relative to the repository root)."""
    return [{"name": name, "world_size": 1, "note": f"heterogeneous {path}, {rec or 'no recompute'}",
             "flags": COMMON + HET_FLAGS + ["--heterogeneous-layers-config-path", path] + rec.split()}
            for name, path, rec in HET]


def het_flags(flags: list[str], root: str) -> list[str]:
    """A stored HET entry's flags with its config file under ``root`` (the repository)."""
    return [os.path.join(root, f) if f.startswith("tests/data/heterogeneous/") else f for f in flags]


def measure(core: str, timeout: float, only: Optional[list[str]] = None) -> list[Dict[str, Any]]:
    out = []
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cfgs = select(False, REPLAY + (REPLAY_019 if core == "0.19.2" else [])) + het_configs()
    for cfg in [c for c in cfgs if not only or c["name"] in only]:
        flags = het_flags(cfg["flags"], root)
        _, settings = resolve_config(flags, cfg["world_size"], VERSION[core])
        if cfg["name"].startswith("het_"):
            # (the worker builds HeterogeneousTransformerConfig and get_gpt_heterogeneous_layer_spec from the path,
            # as tests/test_heterogeneous.py's referee run)
            settings["heterogeneous_layers_config_path"] = flags[flags.index("--heterogeneous-layers-config-path") + 1]
            settings["no_persist_layer_norm"] = True
        ranks = run_referee(settings, cfg["world_size"], timeout=timeout, cores=FSDP_MEGATRON_CORES)
        slim = [{k: r[k] for k in KEEP if k in r} for r in ranks]
        for r in slim:
            r["peak_top_storages"] = sorted(r["peak_top_storages"], key=lambda s: -s["bytes"])[:30]
        out.append({"name": cfg["name"], "world_size": cfg["world_size"], "note": cfg["note"], "flags": cfg["flags"],
                    "status": "ok", "ranks": slim})
        print(f"[ok] {cfg['name']}: peak {[r['peak_bytes'] for r in slim]} in {[r['peak_phase'] for r in slim]}")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "results",
                                                 "referee-replay-measured.json"))
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--only", nargs="*", default=None, help="measure these configurations, keep the file's others")
    a = p.parse_args()
    import megatron.core
    import torch
    core = megatron.core.__version__
    if core not in VERSION:
        raise SystemExit(f"megatron-core {core}: the replay grid runs on {' or '.join(VERSION)}")
    data = json.load(open(a.out)) if os.path.exists(a.out) else {}
    new = measure(core, a.timeout, a.only)
    if a.only and core in data:
        names = {c["name"] for c in new}
        new = [c for c in data[core]["configs"] if c["name"] not in names] + new
    data[core] = {"environment": {"torch": torch.__version__, "megatron_core": core,
                                  "python": platform.python_version()},
                  "configs": new}
    with open(a.out, "w") as fh:
        json.dump(data, fh, indent=1)


if __name__ == "__main__":
    main()
