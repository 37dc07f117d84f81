"""benchmarks/referee/moe_check.py over every stored MoE run (benchmarks/results/referee-moe-measured.json, real
megatron-core 0.16.1 on CPU, benchmarks/referee/moe_grid.py): each MoE module of each whole MoE layer at each rank's
peak keeps exactly the bytes of its hand formula (derived from megatron-core's source in
benchmarks/referee/MOE-NOTES.md), evaluated with the tokens the run really routed. No live run: the stored dump only,
so the hand check cannot fall behind the grid again unnoticed. The second half redoes the rows the formulas gained
for the shared-expert overlap, recomputed shared experts, router jitter, MoE recompute and the combined 1F1B schedule
with the bytes written out by hand."""
from __future__ import annotations

import functools
import json
import os

import pytest

from benchmarks.referee.moe_check import check, skipped

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MEASURED = os.path.join(ROOT, "benchmarks", "results", "referee-moe-measured.json")

# The grid's model (moe_grid.py, MOE-NOTES.md "Setting of the grid"): hidden 256, 4 experts, top-2, shared-expert
# width 384, bf16 activations and router probs (2 bytes), s x b = 256 x 2 tokens per rank (256 with TP2 + SP).
H, E, K, FS, A = 256, 4, 2, 384, 2


@functools.lru_cache(maxsize=None)
def _result() -> dict:
    with open(MEASURED) as f:
        return json.load(f)


@functools.lru_cache(maxsize=None)
def _rows() -> tuple:
    return tuple(check(_result()))


def _names() -> list:
    return [c["name"] for c in _result()["configs"] if c.get("status") == "ok"]


def _row(config: str, rank: int, layer: int, module: str) -> dict:
    found = [r for r in _rows() if (r["config"], r["rank"], r["layer"], r["module"]) == (config, rank, layer, module)]
    assert len(found) == 1, (config, rank, layer, module, len(found))
    return found[0]


def test_every_rank_of_every_stored_configuration_is_checked():
    assert len(_names()) >= 25, _names()   # (the grid had 25 configurations when this was written)
    assert skipped(_result()) == []
    checked = {(r["config"], r["rank"]) for r in _rows()}
    for c in _result()["configs"]:
        if c.get("status") == "ok":
            for rank in c["ranks"]:
                assert (c["name"], rank["rank"]) in checked, (c["name"], rank["rank"])


@pytest.mark.parametrize("name", _names())
def test_each_module_keeps_its_formulas_bytes(name):
    rows = [r for r in _rows() if r["config"] == name]
    assert rows, name
    bad = [r for r in rows if r["measured"] != r["formula"]]
    assert bad == [], bad[:5]


def test_router_jitter_keeps_the_noise_and_the_jittered_input():
    # router.py apply_input_jitter: input * Uniform(1 - eps, 1 + eps).rsample(): the noise [T, h] (saved by the
    # product) and the product (saved by RouterGatingLinearFunction), bf16, beside the router's 12 T k (top-k int64
    # indices + fp32 top-k softmax) and the all-to-all dispatcher's held probs + bool map, (2 + 1) T E
    T = 512
    assert _row("moe_ep2_shared_jitter", 0, 1, "router")["measured"] == 12 * T * K + 3 * T * E + 2 * A * T * H \
        == 542_720


def test_shared_expert_overlap_runs_in_the_dispatcher_without_the_offset_copy():
    # shared_experts.py linear_fc1_forward_and_act, called from the alltoall dispatch_postprocess: fc1's output
    # [T, 2 F_s], silu [T, F_s] and the product [T, F_s] (its own GLU adds no glu_linear_offset copy), beside the
    # expert input [N, h] and its probs [N]; nothing under the shared_experts label
    T = 512
    for layer in (1, 2, 3, 4):
        row = _row("moe_ep2_shared_overlap", 0, layer, "dispatch_postprocess")
        assert row["measured"] == A * row["N"] * H + A * row["N"] + A * T * 4 * FS, layer
        assert _row("moe_ep2_shared_overlap", 0, layer, "shared_experts")["measured"] == 0, layer
    assert _row("moe_ep2_shared_overlap", 0, 1, "dispatch_postprocess")["measured"] == 2_085_322   # N = 997


def test_shared_expert_overlap_under_tp2_sp_keeps_the_gathered_input():
    # pre_forward_comm (called in dispatch_preprocess) gathers the sequence-parallel input [T, h] into a new
    # [2 T, h], which fc1 (explicit_expert_comm: no gather of its own) saves; fc1's output [2 T, 2 F_s/2] etc.
    T, tp = 256, 2
    row = _row("moe_tp2_sp_ep2_shared_overlap", 0, 1, "dispatch_preprocess")
    # permute: probs.T [E, T] bf16 + bool mask [E, T] + int64 indices [T k]; + the gathered input
    assert row["measured"] == A * T * E + T * E + 8 * T * K + A * tp * T * H == 269_312
    row = _row("moe_tp2_sp_ep2_shared_overlap", 0, 1, "dispatch_postprocess")
    assert row["measured"] == A * row["N"] * H + A * row["N"] + A * tp * T * 4 * (FS // tp)


def test_recomputed_shared_experts_keep_nothing_of_their_own():
    # moe_layer.py shared_experts_compute: tensor_parallel.checkpoint keeps only the pre-MLP norm output (the norm's)
    for rank in (0, 1):
        for layer in (1, 2, 3, 4):
            assert _row("moe_ep2_recompute_shared", rank, layer, "shared_experts")["measured"] == 0


def test_moe_recompute_keeps_the_dispatchers_held_state_only():
    # the checkpointed MoELayer.forward leaves MoEAlltoAllTokenDispatcher's self.probs [T, E] bf16, self.routing_map
    # [T, E] bool (router) and the int64 permutation mapping [T k] (dispatch_preprocess)
    T = 512
    for layer in (1, 2, 3, 4):
        assert _row("moe_ep2_recompute_moe", 0, layer, "router")["measured"] == 3 * T * E == 6_144
        assert _row("moe_ep2_recompute_moe", 0, layer, "dispatch_preprocess")["measured"] == 8 * T * K == 8_192
        # no other module of the layer holds a byte (check() makes a row of any module that does)
        modules = {r["module"] for r in _rows()
                   if (r["config"], r["rank"], r["layer"]) == ("moe_ep2_recompute_moe", 0, layer)}
        assert modules == {"router", "dispatch_preprocess"}, layer


def test_combined_1f1b_keeps_the_all_to_all_probs_in_the_dispatch_node():
    # fine_grained_callables.py submodule_dispatch_forward: node.detach(dispatched_probs) keeps the all-to-all's
    # probs output [N] bf16 in ScheduleNode.before_detached until the node's backward
    for name in ("moe_ep2_a2a_overlap", "moe_ep2_a2a_overlap_recompute_moe"):
        for layer in (1, 2, 3, 4):
            row = _row(name, 0, layer, "token_dispatch")
            assert row["measured"] == A * row["N"] > 0, (name, layer)
