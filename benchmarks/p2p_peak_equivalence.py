"""Does a faster schedule.p2p_peak pick the same pass with the same value as an earlier revision's? A speed change
to the interleaved schedule's pipeline-tensor peak must leave every number as it was: this compares the working
tree's p2p_peak (and p2p_passes, which it reads) with a git revision's on a random grid of schedules, and the combined
1F1B walk's (p2p_walk_peak, p2p_every_pass; --overlap-moe-expert-parallel-comm) and the plain schedule's walked pass
by pass on the same cases.

    python benchmarks/p2p_peak_equivalence.py [--rev main] [--cases 20000] [--seed 1] [--whole-groups | --corners]

The grid: PP 2-8, VPP 2-24, 1-64 micro-batches, groups of PP..PP+3 micro-batches per virtual stage, any rank,
overlap_p2p_comm on and off (``--whole-groups``: only schedules Megatron runs whose micro-batches fill whole groups,
1-8 groups, overlap_p2p_comm off only beyond PP 2, the ones p2p_peak takes by steady-state periods; ``--corners``: a
partial last group (m not a multiple of the group) or no steady state (m x VPP within the warm-up), the ones p2p_peak
samples), uneven receiving counts (0-2 per chunk, or a pipeline's: the first stage's first chunk
none), bytes per chunk all random or mostly alike (a pipeline's chunks), random transients and tensor sizes.
Exits non-zero at the first case that differs.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import random
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_memguard import schedule  # noqa: E402


def _reference(rev: str):
    """schedule.py as it is at ``rev`` (a standalone module: it imports only the standard library)."""
    source = subprocess.run(["git", "-C", ROOT, "show", f"{rev}:megatron_memguard/schedule.py"], check=True,
                            capture_output=True, text=True).stdout
    with tempfile.TemporaryDirectory(prefix="memguard-p2p-ref-") as tmp:
        path = os.path.join(tmp, "schedule_ref.py")
        with open(path, "w") as f:
            f.write(source)
        spec = importlib.util.spec_from_file_location("schedule_ref", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)     # (the file is no longer needed once executed)
    return module


def _case(rng: random.Random, whole_groups: bool = False, corners: bool = False) -> tuple:
    pp = rng.randint(2, 8)
    vpp = rng.randint(2, 24)
    m = rng.randint(1, 64)
    group = rng.randint(pp, pp + 3)
    rank = rng.randrange(pp)
    overlap = rng.random() < 0.5
    if whole_groups:
        m = group * rng.randint(1, 8)
        overlap = overlap or pp == 2
    elif corners:
        if rng.random() < 0.5:              # a partial last group
            m = group * rng.randint(0, 6) + rng.randint(1, group - 1)
        else:                               # every micro-batch within the warm-up of this rank
            m = rng.randint(1, max(1, ((pp - rank - 1) * 2 + (vpp - 1) * group) // vpp))
    if rng.random() < 0.5:
        receiving = tuple(rng.choice((0, 1, 1, 2)) for _ in range(vpp))
    else:                                   # a pipeline's: every chunk receives but the first stage's first
        receiving = tuple(0 if rank == 0 and c == 0 else 1 for c in range(vpp))
    if rng.random() < 0.5:
        sizes = tuple(rng.choice((0, rng.randint(1, 1000))) for _ in range(vpp))
    else:                                   # mostly alike, a few chunks apart (embedding, output, dense layers)
        base = rng.randint(0, 1000)
        sizes = tuple(base if rng.random() < 0.85 else rng.randint(0, 1000) for _ in range(vpp))
    fwd = tuple(rng.randint(0, 300) for _ in range(vpp))
    bwd = tuple(rng.randint(0, 300) for _ in range(vpp))
    t = rng.choice((0, 1, rng.randint(1, 500)))
    return pp, vpp, m, group, rank, receiving, overlap, sizes, fwd, bwd, t


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rev", default="main", help="git revision to compare with (default main)")
    parser.add_argument("--cases", type=int, default=20000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--whole-groups", action="store_true",
                        help="only schedules Megatron runs with whole groups of micro-batches")
    parser.add_argument("--corners", action="store_true",
                        help="only schedules with a partial last group or without a steady state")
    args = parser.parse_args()
    ref = _reference(args.rev)
    rng = random.Random(args.seed)
    spent = {"working tree": 0.0, args.rev: 0.0}
    walk = {"working tree": 0.0, args.rev: 0.0}
    for n in range(args.cases):
        pp, vpp, m, group, rank, receiving, overlap, sizes, fwd, bwd, t = case = _case(rng, args.whole_groups,
                                                                                       args.corners)
        got = []
        for name, module in (("working tree", schedule), (args.rev, ref)):
            start = time.thread_time()
            got.append(module.p2p_peak(pp, vpp, m, group, rank, receiving, overlap, sizes, fwd, bwd, t))
            spent[name] += time.thread_time() - start
            got.append(module.p2p_passes(pp, vpp, m, group, rank, overlap))   # (after: p2p_peak may read it)
            # the schedules walked pass by pass: combined 1F1B on every case, the plain one on every fourth
            for combined in (True, False)[:1 + (n % 4 == 0)]:
                start = time.thread_time()
                got.append(module.p2p_walk_peak(pp, vpp, m, group, rank, receiving, overlap, combined, sizes, fwd,
                                                bwd, t))
                walk[name] += time.thread_time() - start
                if n % 16 == 0:
                    got.append(module.p2p_every_pass(pp, vpp, m, group, rank, receiving, overlap, combined))
        half = len(got) // 2
        got = [got[:half], got[half:]]
        if got[0] != got[1]:
            print(f"case {n} differs: (pp, vpp, m, group, rank, receiving, overlap, sizes, fwd, bwd, t) = {case}")
            return 1
    kind = " of whole groups" if args.whole_groups else " with a partial group or no steady state" if args.corners else ""
    print(f"{args.cases} cases{kind} identical to {args.rev} (p2p_passes and p2p_peak; p2p_walk_peak, every 16th "
          f"p2p_every_pass); CPU time, caches warm within the run: p2p_peak "
          + ", ".join(f"{k} {v:.2f} s" for k, v in spent.items()) + "; walks "
          + ", ".join(f"{k} {v:.2f} s" for k, v in walk.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
