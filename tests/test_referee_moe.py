"""The CPU referee on a mixture-of-experts model (real megatron-core 0.16.1 on CPU, gloo, 2 ranks).

One configuration of benchmarks/referee/moe_grid.py, `moe_ep2_alltoall`: 4 layers, hidden 256, 4 experts
of width 512, top-2, EP2 (= DP2), alltoall dispatcher, SwiGLU, no biases, bf16. The numbers checked are
the ones a reader can redo by hand: the parameter count of each rank, the expert gradient buffer, the
consistency of the routing the two ranks report (what one rank's router sends must be what the other
rank's experts receive), and the bytes each MoE module keeps for backward, from the formulas of
benchmarks/referee/MOE-NOTES.md evaluated with the tokens the run really routed. About a minute.
"""
import functools

import pytest

pytest.importorskip("megatron.core")

from benchmarks.referee.run import unsupported_reason  # noqa: E402

pytestmark = pytest.mark.skipif(unsupported_reason() is not None, reason=str(unsupported_reason()))

from benchmarks.referee.moe_check import check  # noqa: E402
from benchmarks.referee.grids.moe import MOE_GRID, moe_settings  # noqa: E402
from benchmarks.referee.run import run_referee  # noqa: E402

NAME = "moe_ep2_alltoall"


@functools.lru_cache(maxsize=None)
def measured() -> dict:
    cfg = next(c for c in MOE_GRID if c["name"] == NAME)
    _, settings = moe_settings(cfg)
    ranks = run_referee(settings, cfg["world_size"], timeout=900)
    return {"name": NAME, "status": "ok", "settings": settings, "ranks": ranks}


# The model by hand: V = 8000 + 1 (NullTokenizer's EOD) padded to a multiple of 128 -> 8064; h = 256;
# 8 heads of 32 with 4 KV groups; 4 experts, 2 per rank; expert FFN 512 with SwiGLU (fc1 is 2·512 wide).
H, V, F, KV = 256, 8064, 512, 4 * 32
ATTN = H * (H + 2 * KV) + H * H          # QKV and output projection, no biases
EXPERT = 2 * F * H + H * F               # fc1 [2F, h] + fc2 [h, F]
LAYER = 2 * H + ATTN + 4 * H + 2 * EXPERT  # two RMSNorms, attention, router [E, h], 2 local experts
TOTAL = 2 * V * H + 4 * LAYER + H        # untied embedding and output layer, final norm


def test_parameters_of_each_rank_by_hand():
    assert TOTAL == 8_067_328
    for r in measured()["ranks"]:
        assert r["num_params"] == TOTAL, r["rank"]
        assert r["num_params_expert"] == 4 * 2 * EXPERT, r["rank"]


def test_expert_gradient_buffer_is_separate_and_holds_the_local_experts():
    for r in measured()["ranks"]:
        numels = sorted(b["numel"] for b in r["ddp_buffers"])
        # EP2 on 2 ranks: the expert data-parallel group has one rank, so no padding
        assert numels == sorted([TOTAL - 4 * 2 * EXPERT, 4 * 2 * EXPERT]), r["rank"]


def test_routing_each_rank_reports_agrees_with_the_other_rank():
    ranks = measured()["ranks"]
    T, k, local = 256 * 2, 2, 2  # s·b tokens per rank, top-2, experts per rank
    by = [{(x["phase"], x["layer"]): x for x in r["routing"]} for r in ranks]
    assert set(by[0]) == set(by[1]) and len(by[0]) == 2 * 2 * 4  # iterations x micro-batches x layers
    for key in by[0]:
        sent = [by[r][key]["routed_per_expert"] for r in (0, 1)]
        for r in (0, 1):
            rec = by[r][key]
            assert rec["tokens"] == T and sum(rec["routed_per_expert"]) == T * k
            ep_rank = ranks[r]["ep_rank"]
            want = [sent[0][ep_rank * local + j] + sent[1][ep_rank * local + j] for j in range(local)]
            assert rec["tokens_per_local_expert"] == want, (key, r)
            assert rec["expert_input_rows"] == sum(want)


def test_each_moe_module_keeps_what_the_formulas_say():
    entry = dict(measured())
    rows = check({"configs": [entry]})
    assert len(rows) >= 2 * 4 * 4  # 2 ranks x 4 MoE layers x (router, permute, expert input, experts)
    for row in rows:
        assert row["measured"] == row["formula"], row
