"""The whole-rank figures of the CPU referee's MoE grid (real megatron-core 0.16.1 on CPU, stored in
benchmarks/results/referee-moe-measured.json by benchmarks/referee/moe_grid.py) against memguard's
estimate of the same flags (--device cpu, local profile, balanced routing): parameters exact on every
rank, live bytes after the optimizer step within 1%, peak within 3% (the referee's bounds, compare.py).
The runs' routing was not balanced (N / balanced up to 1.43, MOE-NOTES.md); the peaks still agree within
the bound because the expert terms are a part of each rank's peak."""
from __future__ import annotations

import json
import os

import pytest

from benchmarks.referee.grids.dense import resolve_config
from benchmarks.referee.grids.moe import MOE_GRID
from megatron_memguard import estimate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MEASURED = os.path.join(ROOT, "benchmarks", "results", "referee-moe-measured.json")


def _configs():
    with open(MEASURED) as f:
        by = {c["name"]: c for c in json.load(f)["configs"] if c.get("status") == "ok"}
    return [(cfg, by[cfg["name"]]) for cfg in MOE_GRID if cfg["name"] in by]


@pytest.mark.parametrize("cfg,measured", _configs(), ids=lambda x: x["name"] if isinstance(x, dict) and "flags" in x else "")
def test_each_rank_of_the_moe_grid(cfg, measured):
    L, _ = resolve_config(cfg["flags"], cfg["world_size"])
    for r in measured["ranks"]:
        dp_rank = r["dp_rank"] if L.use_distributed_optimizer else "max"
        st = estimate(L, profile="local", device="cpu", dp_rank=dp_rank).stages[r["pp_rank"]]
        assert st.parameters == r["num_params"], r["rank"]
        after = st.persistent_bytes / r["live_bytes_after_step"] - 1
        # --recompute-modules moe: the after-step state is counted per layer (moe_dispatcher_state)
        assert abs(after) <= 0.01, (r["rank"], after)
        peak = st.peak_allocated_bytes / r["peak_bytes"] - 1
        assert abs(peak) <= 0.03, (r["rank"], peak)


def test_the_alltoall_dispatchers_mapping_is_held_until_the_next_forward():
    """MoEAlltoAllTokenDispatcher.dispatch_preprocess (token_dispatcher.py, megatron-core 0.16.1 and 0.19.2) keeps
    the permute's int64 mapping [T k] as ``self.reversed_local_input_permutation_mapping`` beside ``self.probs`` and
    ``self.routing_map`` until the layer's next forward (benchmarks/referee/MOE-NOTES.md: 57,344 B after the step =
    4 layers x [(p + 1) T E + 8 T k]). memguard counted it only as a saved tensor, released by the layer's backward:
    after the step moe_ep2_alltoall (T = s b = 512, k = 2, 4 MoE layers) was 4 x 8 x 512 x 2 = 32,768 B low
    (-33,272 B measured); now within 1 KiB (scalars), the top-1 run's 16,384 B likewise, and the moe_dispatcher_state
    term holds it by hand."""
    by = {c["name"]: c for c in json.load(open(MEASURED))["configs"] if c.get("status") == "ok"}
    for name, k in (("moe_ep2_alltoall", 2), ("moe_ep2_top1", 1), ("moe_ep2_capacity_pad", 2)):
        cfg = next(c for c in MOE_GRID if c["name"] == name)
        L, _ = resolve_config(cfg["flags"], cfg["world_size"])
        for r in by[name]["ranks"]:
            st = estimate(L, profile="local", device="cpu").stages[r["pp_rank"]]
            assert abs(st.persistent_bytes - r["live_bytes_after_step"]) < 1024, (name, r["rank"])
        T, E, p = 512, 4, 2          # tokens per rank, experts, bf16 router probs
        state = next(t.bytes for t in estimate(L, profile="local", device="cpu").stages[0].terms
                     if t.name == "moe_dispatcher_state")
        # capacity factor 1 with padding: the mapping is the int64 [E C] token indices, E C = T k here
        assert state == 4 * ((p + 1) * T * E + 8 * T * k), name


def test_the_allgather_dispatchers_local_probs_are_held_until_the_next_forward():
    """MoEAllGatherTokenDispatcher.dispatch_postprocess (token_dispatcher.py, megatron-core 0.16.1 and 0.19.2) keeps
    ``self.local_probs``, the masked_select of the transposed probs [N] (router dtype) it hands the experts, beside
    ``self.local_map`` [G, E_l] bool and the int64 mapping [N] until the layer's next forward. memguard counted it only
    as the experts' saved probs: after the step the allgather runs were 4 x p x N low (about 8 KiB in bf16, 16 KiB
    with the fp32 router). The referee's own routing records give N of each layer's last forward (what the state
    holds after the step): with the held mapping and probs taken at those rows instead of the balanced
    N = T k = 1,024, the after-step bytes are the measured ones within 300 B on every rank (the same few scalars,
    -248 B, on all eight), where they were 7.7 to 17.5 KB low."""
    by = {c["name"]: c for c in json.load(open(MEASURED))["configs"] if c.get("status") == "ok"}
    for name in ("moe_ep2_allgather", "moe_ep2_router_fp32_allgather", "moe_tp2_sp_ep2_allgather"):
        cfg = next(c for c in MOE_GRID if c["name"] == name)
        L, _ = resolve_config(cfg["flags"], cfg["world_size"])
        G, El, N = 1024, 2, 1024       # tokens of the ETP x EP group (s b = 512 x EP 2), local experts, balanced rows
        p = 4 if "fp32" in name else 2
        st = estimate(L, profile="local", device="cpu").stages[0]
        state = next(t.bytes for t in st.terms if t.name == "moe_dispatcher_state")
        # local_map [G, E_l] bool, the int64 mapping [N] and local_probs [N], per MoE layer
        assert state == 4 * (G * El + 8 * N + p * N), name
        for r in by[name]["ranks"]:
            last = r["routing"][-1]["phase"]
            rows = [x["expert_input_rows"] for x in r["routing"] if x["phase"] == last]
            assert len(rows) == 4 and r["routing"][-1]["probs_dtype"] == ("float32" if p == 4 else "bfloat16")
            routed = st.persistent_bytes + (8 + p) * (sum(rows) - 4 * N)
            assert abs(routed - r["live_bytes_after_step"]) < 300, (name, r["rank"], routed - r["live_bytes_after_step"])
