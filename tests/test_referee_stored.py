"""The estimate against the CPU referee's stored measurements (benchmarks/results/referee-measured.json).

The measurements are real megatron-core 0.16.1 training steps on CPU with every live tensor byte
counted (benchmarks/referee/); scoring them again takes a second and catches an estimator change that
moves any of the 145 measured ranks. The runs themselves are redone by tests/test_referee_ci.py (its
subset) and `python -m benchmarks.referee.report` (all).
"""
import json
import os

import pytest

from benchmarks.referee.compare import BOUNDS, compare_entry

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MEASURED = os.path.join(ROOT, "benchmarks", "results", "referee-measured.json")


@pytest.fixture(scope="module")
def rows():
    with open(MEASURED) as fh:
        data = json.load(fh)
    return {(r.config, r.rank): r for e in data["configs"] if e.get("status") == "ok" for r in compare_entry(e)}


def test_every_stored_rank_within_the_bounds(rows):
    assert len(rows) >= 110
    for key, r in rows.items():
        assert r.params_predicted == r.params_measured, key
        assert abs(r.after_err) <= BOUNDS["after_step"], (key, r.after_err)
        assert not r.failures, (key, r.failures)
        # the bound the estimator holds today (since the interleaved schedule's pipeline tensors are counted pass by
        # pass, corners5): every peak within 0.1% (the largest: gqa2_tp4_sp, -0.068%)
        assert abs(r.peak_err) <= 0.001, (key, r.peak_err, r.peak_phase_measured, r.peak_phase_predicted)


@pytest.mark.parametrize("config, ranks", [
    # issue 13, bug 4: the backward walked op by op and the retained pipeline inputs placed where 1F1B
    # keeps them. Middle stages of PP4 with 2 micro-batches peak in the first backward (unfused GLU);
    # pp4_mb8's middle stages in a steady-state backward (one earlier input gradient alive); pp2_mb1's
    # last stage in its only forward (no earlier backward); a TP2 SP first stage and a recomputed
    # core attention in the attention backward.
    ("llama_pp4_mb2", (1, 2)), ("pp4_mb2", (1, 2)), ("pp4_mb8", (1, 2)), ("pp2_mb1", (1,)),
    ("tp2_sp_pp2", (0, 1)), ("recomp_selective_pp2", (0,)),
    # issue 13, bug 1 and 2: DP x CP = 1 with the distributed optimizer, block recompute with 0 layers
    ("tp2_dp1_distopt", (0, 1)), ("pp2_dp1_distopt", (0, 1)), ("recomp_full_block0", (0,)),
])
def test_issue_13_ranks_match_to_a_tenth_of_a_percent(rows, config, ranks):
    for rank in ranks:
        r = rows[(config, rank)]
        assert abs(r.peak_err) <= 0.001, (config, rank, r.peak_measured, r.peak_predicted)
        assert abs(r.peak_default_err) <= 0.001 and abs(r.after_default_err) <= 0.0001, (config, rank)


@pytest.mark.parametrize("config", [
    # pipeline split corners measured 2026-11-30: the last stage's count, the embedding and loss counted in the
    # split (without and with virtual stages), a layout string, uneven virtual stages, 5 micro-batches in groups
    # of 3 (not a multiple of PP), 2 KV groups under TP 4, --calculate-per-token-loss under PP 2
    "pp2_last1", "pp2_acc_emb_loss", "pp2_layout", "vpp_pp2_first2", "vpp_pp2_acc_emb_loss", "vpp_pp2_group3_mb5",
    "gqa2_tp4_sp", "per_token_loss_pp2",
    # corners5 (2026-11-30): VPP without p2p overlap, groups of 6 over PP 4 (the first stage's queue of inputs and the
    # last stage's of output gradients received ahead), TP 2 with untied output weights at PP 1
    "vpp_pp4_v2_no_overlap", "vpp_pp4_group6_mb12", "untied_tp2",
    # props8 (2026-11-30): the distributed optimizer over DP 3, a group that is not a power of two
    "dp3_distopt_overlap",
])
def test_layout_corners_match_to_a_quarter_percent(rows, config):
    """Each rank of the corner: parameters exact, the bytes after the step within 0.001% (the step counters and
    scalars), the peak within 0.25% (the largest today: gqa2_tp4_sp, -0.068%)."""
    ranks = [r for (c, _), r in rows.items() if c == config]
    assert ranks, config
    for r in ranks:
        assert r.params_predicted == r.params_measured, (config, r.rank)
        assert abs(r.after_err) <= 1e-5, (config, r.rank, r.after_err)
        assert abs(r.peak_err) <= 0.0025, (config, r.rank, r.peak_measured, r.peak_predicted)


def test_a_data_parallel_group_of_three_pads_its_bucket_to_lcm_3_128():
    """dp3_distopt_overlap (props8, 2026-11-30, core 0.16.1): the 5,289,472 parameters (4 layers of h 256 and the tied
    [8064, 256] embedding, every start a multiple of 64) fill one bucket whose end megatron-core pads to
    lcm(DP, 128) = 384 elements (param_and_grad_buffer.py _pad_end_of_bucket_if_needed): 13,775 x 384 = 5,289,600,
    the run's own DDP buffer. Each rank's slice is 5,289,600 / 3 = 1,763,200 elements; the last rank's ends in the
    128 elements of padding, so it keeps 128 x (4 + 8) B less fp32 main weight and Adam moments than the others."""
    from benchmarks.referee.grids.dense import resolve_config
    from megatron_memguard.estimator.states import stage_states
    with open(MEASURED) as fh:
        entry = next(e for e in json.load(fh)["configs"] if e["name"] == "dp3_distopt_overlap")
    L, _ = resolve_config(entry["flags"], entry["world_size"])
    assert 13_775 * 384 == 5_289_600 and 5_289_600 - 5_289_472 == 128
    assert {b["numel"] for r in entry["ranks"] for b in r["ddp_buffers"]} == {5_289_600}
    assert stage_states(L, 0).buffer_numel == 5_289_600
    assert [stage_states(L, 0, r).exp_avg_bytes // 4 for r in range(3)] == [1_763_200, 1_763_200, 1_763_072]
    after = [r["live_bytes_after_step"] for r in entry["ranks"]]
    # measured: the last rank 128 x 12 B = 1,536 B lower (and under 128 B of step scalars)
    assert 0 <= after[1] - after[2] - 128 * 12 < 128


def test_fewer_key_groups_than_tp_ranks_keep_the_gathered_qkv_projection(rows):
    """mqa_h2_tp2_rope(_recomp_core) (props8, 2026-11-30, core 0.16.1): h 256, 2 heads of d 128, 1 key group, TP 2,
    rope, s 256 x b 2 = 512 tokens, bf16. With fewer groups than TP ranks, Attention all-gathers linear_qkv's output
    (2 x 256 wide) into the whole projection, (2 + 2 x 1) x 128 = 512 wide, and slices its rank's group from it
    (get_query_key_value_tensors); the core attention, built for one group per rank, repeats nothing for one head
    (DotProductAttention.forward). Rope makes q and k new; v stays a view of the gathered projection, and the bmm with
    the probs (or core_attn's checkpoint) keeps it: 512 x 512 x 2 = 524,288 B a layer besides q and k (131,072 B
    each). memguard counted K and V repeated (131,072 B each) and no projection without recompute, and the rank's own
    256-wide output under the checkpoint: 393,216 B and 262,144 B a layer low, x 4 layers 1,572,864 B (-3.53% of the
    peak) and 1,048,576 B (-2.43%), the measured shortfall to the byte beside the loss forward's 29 KB of scalars;
    now -0.064% and -0.066%."""
    from benchmarks.referee.grids.dense import resolve_config
    from megatron_memguard.estimator.activations import layer_activations
    with open(MEASURED) as fh:
        entries = {e["name"]: e for e in json.load(fh)["configs"]}
    for name in ("mqa_h2_tp2_rope", "mqa_h2_tp2_rope_recomp_core"):
        L, _ = resolve_config(entries[name]["flags"], 2)
        saved = layer_activations(L).saved
        assert saved["qkv_output"] == 512 * 512 * 2 == 524_288
        assert saved["query_rope"] == saved["key_rope"] == 512 * 128 * 2
        assert "key_repeated" not in saved and "value_repeated" not in saved
        for rank in (0, 1):
            r = rows[(name, rank)]
            assert r.params_predicted == r.params_measured
            # the step's scalars (464 B), and at the peak the loss forward's (test_the_loss_forwards_uncounted_bytes)
            assert 0 <= r.after_measured - r.after_predicted < 512, (name, rank)
            assert 0 < r.peak_measured - r.peak_predicted < 30_000, (name, rank)


def test_a_view_of_a_replicated_group_keeps_the_whole_gathered_projection():
    """gqa2_h4_tp4_rope (props8, 2026-11-30, core 0.16.1): 4 heads of d 64 in 2 key groups over TP 4, rope, 512 tokens,
    bf16. The rank's group slice is (4 / 2 + 2) x 64 = 256 wide, but it is a view of the all-gathered projection,
    (4 + 2 x 2) x 64 = 512 wide: the four 512 x 512 x 2 = 524,288 B ``cat`` storages (one a layer) are live at the
    measured peak, and memguard keeps the same per layer (it kept K and V repeated instead: the peak -5.96%, now
    +0.87%, the excess at the loss forward, not in the layers: open). gqa2_tp4_sp_recomp_core (8 heads in 2 groups,
    TP 4 with SP, core_attn recomputed: the checkpoint's v keeps the gathered (8 + 4) x 32 = 384-wide projection of
    the 512 tokens, 393,216 B a layer; memguard kept the rank's own 96-wide output): -4.38%, now -0.29%."""
    # (stored apart, benchmarks/results/referee-replicated-groups.json: outside this file's 0.1% bound)
    with open(os.path.join(ROOT, "benchmarks", "results", "referee-replicated-groups.json")) as fh:
        entries = {e["name"]: e for e in json.load(fh)["configs"]}
    rows = {(r.config, r.rank): r for e in entries.values() for r in compare_entry(e)}
    from benchmarks.referee.grids.dense import resolve_config
    from megatron_memguard.estimator.activations import layer_activations
    entry = entries["gqa2_h4_tp4_rope"]
    for rank in entry["ranks"]:
        gathered = [t for t in rank["peak_top_storages"] if t["op"] == "cat" and t["shape"] == [256, 2, 512]]
        assert [(t["count"], t["bytes"]) for t in gathered] == [(4, 4 * 524_288)]
    L, _ = resolve_config(entry["flags"], 4)
    assert layer_activations(L).saved["qkv_output"] == 524_288
    L, _ = resolve_config(entries["gqa2_tp4_sp_recomp_core"]["flags"], 4)
    assert layer_activations(L).saved["qkv_output"] == 512 * 384 * 2 == 393_216
    for name, bound in (("gqa2_h4_tp4_rope", 0.009), ("gqa2_tp4_sp_recomp_core", 0.003)):
        for rank in range(4):
            r = rows[(name, rank)]
            assert r.params_predicted == r.params_measured and abs(r.after_err) < 1e-4
            assert abs(r.peak_err) <= bound, (name, rank, r.peak_err)


def test_interleaved_ranks_match_to_three_hundredths_of_a_percent(rows):
    """Every rank of every VPP configuration: the schedule's own activation-sized tensors at the peak's pass
    (schedule.p2p_tensors_at: idle chunks' input and gradient, the loop's last input gradient, the pair's forward
    output, inputs received ahead, the warm-up's last receive) are what megatron-core 0.16.1 keeps there, so the
    peak is within 0.03% (a few hundred bytes of scalars; 29-31 KB more at the last stage's loss forward of
    vpp_pp2_group3_mb5 and vpp_pp4_v2_no_overlap, not a pipeline tensor: the batch and cross-entropy temporaries
    docs/terms/loss_targets.md lists, test below: -0.016%, -0.023%). Counting every receiving chunk's pair at every
    pass was -0.97% (vpp_pp4_v2 rank 2, 3 tensors short in a steady backward with chunk 1 idle) to +0.64%
    (vpp_pp4_first2_last2 rank 1, 4 tensors over at its first backward, where no backward had run)."""
    ranks = [r for (c, _), r in rows.items() if c.startswith("vpp_")]
    assert len(ranks) >= 16
    for r in ranks:
        assert abs(r.peak_err) <= 0.0003, (r.config, r.rank, r.peak_measured, r.peak_predicted,
                                           r.peak_phase_measured, r.peak_phase_predicted)
    # the first backward of vpp_pp4_first2_last2's middle stages (the brief's corner): no pair at all (every chunk holds
    # micro-batches, no backward ran); rank 1 runs every forward in its warm-up and keeps nothing more, rank 2 keeps its
    # steady forward's output and the next forward's input received ahead (2 tensors): to the scalars
    for rank in (1, 2):
        r = rows[("vpp_pp4_first2_last2", rank)]
        assert 0 <= r.peak_measured - r.peak_predicted < 1024, (rank, r.peak_measured, r.peak_predicted)


def test_the_loss_forwards_uncounted_bytes(rows):
    """The two VPP ranks whose measured peak is the last stage's loss forward are short by what docs/terms/
    loss_targets.md lists as not counted (megatron/training/utils.py get_batch_on_this_tp_rank, megatron-core 0.16.1
    GPTModel.compute_language_model_loss and _VocabParallelCrossEntropy.forward, pretrain_gpt.py loss_func), with
    s b = 256 x 2 tokens: the micro-batch's tokens, labels and position ids (int64) and loss mask (fp32), 28 s b; the
    cross entropy's transposed labels (int64), logits max (fp32), arange (int64), predicted logits and their clone
    (fp32), 28 s b; the loss mask of each other loss-chunk micro-batch held, 4 s b (vpp_pp2_group3_mb5: micro-batch 3
    of chunk 1; vpp_pp4_v2_no_overlap: none). What remains is the scalars every rank shows (116-252 B)."""
    T = 256 * 2
    for config, rank, others in (("vpp_pp2_group3_mb5", 1, 1), ("vpp_pp4_v2_no_overlap", 3, 0)):
        r = rows[(config, rank)]
        assert r.peak_phase_measured.startswith("it2 fwd c1 "), (config, r.peak_phase_measured)
        gap = r.peak_measured - r.peak_predicted
        assert 0 <= gap - (56 * T + 4 * T * others) < 512, (config, gap)


def test_merge_results_replaces_and_adds_in_the_grid_order(tmp_path):
    """grid.py --update: a stored file keeps its other configurations byte for byte, a re-run one is replaced and a
    new one lands at its place in the grid's order."""
    from benchmarks.referee.grid import merge_results
    p = tmp_path / "r.json"
    p.write_text(json.dumps({"configs": [{"name": "a", "run_time_s": 1, "x": 1}, {"name": "c", "run_time_s": 2, "x": 3}],
                             "total_run_time_s": 3, "environment": {"torch": "t"}}))
    res = merge_results(str(p), {"configs": [{"name": "b", "run_time_s": 4}, {"name": "c", "run_time_s": 5, "x": 9}],
                                 "environment": {"torch": "u"}}, order=["a", "b", "c"])
    assert [c["name"] for c in res["configs"]] == ["a", "b", "c"]
    assert res["configs"][0] == {"name": "a", "run_time_s": 1, "x": 1} and res["configs"][2]["x"] == 9
    assert res["total_run_time_s"] == 10 and res["environment"] == {"torch": "t"}
    assert res["updates"] == [{"configs": ["b", "c"], "environment": {"torch": "u"}}]
