"""Mixture of experts under Megatron-FSDP, and hybrid-sharded Megatron-FSDP (HSDP), by hand.

Model: the flags of Megatron's CI test moe/gpt3_mcore_te_tp2_zp_z3_resume_torch_dist_te_8experts2parallel_
top2router (12 layers, hidden 512, 8 heads, GELU ffn 2048, LayerNorm, learned positions, tied embedding,
GPT-2 vocabulary 50257 -> 50432; 8 experts top-2, EP 2, ETP = TP = 2, --disable-bias-linear), 8 GPUs:
DP 4, expert DP = 8 / (ETP 2 x EP 2) = 2.

Per rank, Megatron-FSDP optim_grads_params (param_and_grad_buffer.py _get_parameter_groups and
build_data_parallel_buffer_index, megatron-core 0.16.1 and 0.19.2): each layer is an FSDP unit with
* a dense group: QKV [768, 512] + its LayerNorm (2 x 512), proj [512, 256], pre-MLP LayerNorm (2 x 512),
  router [8, 512] = 530,432 elements; chunk factor 512 (widest row; proj's 256 divides it) -> padded to
  a multiple of 4 x 512 = 2048: 530,432 (= 259 x 2048), shard 132,608;
* an expert group (".experts." in the name): 8 / EP = 4 local experts, fc1 [1024, 512] and fc2 [512, 1024]
  each = 4,194,304 elements; factor 1024 -> multiple of 2 x 1024: 4,194,304, shard over expert DP 2:
  2,097,152;
and one group outside units: embedding [25216, 512] + positions [1024, 512] + final LayerNorm (2 x 512) =
13,435,904 -> padded to a multiple of 4 x 512: 13,436,928, shard 3,359,232.
Optimizer elements per rank: 12 x (132,608 + 2,097,152) + 3,359,232 = 30,116,352.
"""
import pytest

from megatron_memguard import estimate, layout_from_flags
from megatron_memguard.errors import ConfigError, ConfigErrors, NotModelledError
from megatron_memguard.estimator.fsdp_layout import fsdp_stage_terms

ZP_Z3 = ("--num-layers 12 --hidden-size 512 --num-attention-heads 8 --seq-length 1024 "
         "--max-position-embeddings 1024 --micro-batch-size 4 --global-batch-size 32 --bf16 "
         "--tensor-model-parallel-size 2 --sequence-parallel --disable-bias-linear "
         "--transformer-impl transformer_engine --num-experts 8 --expert-model-parallel-size 2 "
         "--moe-router-topk 2 --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 0.01 "
         "--moe-grouped-gemm --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params "
         "--use-distributed-optimizer --no-gradient-accumulation-fusion --ckpt-format fsdp_dtensor "
         "--lr 1e-4 --train-iters 10 --mock-data --vocab-size 50257").split()
DENSE_UNIT, EXPERT_UNIT, OUTSIDE = 530_432, 4_194_304, 13_436_928
OPT = 12 * (DENSE_UNIT // 4 + EXPERT_UNIT // 2) + OUTSIDE // 4


def _stage(flags, version="0.19.2", world=8):
    L = layout_from_flags(flags, world_size=world, megatron_version=version)
    s = estimate(L).stages[-1]
    return L, s, {t.name: t.bytes for t in s.terms}


def test_expert_groups_are_sharded_over_the_expert_data_parallel_group():
    L, s, t = _stage(ZP_Z3)
    assert OPT == 30_116_352
    assert t["fsdp_parameters"] == 2 * OPT and t["fsdp_gradients"] == 2 * OPT   # 0.19: bf16 grads
    assert t["main_parameters"] == t["adam_exp_avg"] == t["adam_exp_avg_sq"] == 4 * OPT
    assert t["fsdp_non_unit_parameters"] == 2 * OUTSIDE
    # after the step (update_main_grads casts the bf16 grad shards to fp32 for the fp32 main weights;
    # start_param_sync re-gathers every unit: the prefetch limit, 5e8 elements, is past all of them)
    ft = fsdp_stage_terms(L, s.chunks, [0] * len(s.chunks))
    step = {x.name: x.bytes for x in ft.step_terms}
    assert step["main_grad_copies"] == 4 * OPT
    assert step["fsdp_gathered_after_step"] == 2 * 12 * (DENSE_UNIT + EXPERT_UNIT)
    assert "expert groups over 2 (expert DP)" in ft.state_terms[0].detail


def test_core_0_16_keeps_fp32_grads_for_experts_too():
    _, _, t = _stage(ZP_Z3, version="0.16.1")
    assert t["fsdp_gradients"] == 4 * OPT and t["main_parameters"] == 4 * OPT


def test_expert_parallel_overlap_under_fsdp_is_refused_by_name():
    flags = ZP_Z3 + ["--moe-token-dispatcher-type", "alltoall", "--overlap-moe-expert-parallel-comm"]
    with pytest.raises(NotModelledError, match="--overlap-moe-expert-parallel-comm.*forward layer"):
        layout_from_flags(flags, world_size=8, megatron_version="0.19.2")
    with pytest.raises(NotModelledError, match="--overlap-moe-expert-parallel-comm.*bypasses the FSDP unit hooks"):
        layout_from_flags(flags, world_size=8, megatron_version="0.16.1")
    # what MegatronFSDP's adapter asserts first (mcore_fsdp_adapter.py, core 0.19.2)
    with pytest.raises((ConfigError, ConfigErrors), match="--fsdp-double-buffer"):
        layout_from_flags(flags + ["--fsdp-double-buffer"], world_size=8, megatron_version="0.19.2")


@pytest.mark.parametrize("strategy", ["optim_grads", "optim"])
def test_expert_parallel_overlap_where_fsdp_gathers_no_weights(strategy):
    """Core 0.19.2: only optim_grads_params shards the compute weights. Under optim / optim_grads the adapter builds
    no FSDP units (mcore_fsdp_adapter.py: fsdp_unit_modules = [] and no backward unshard hook) and combined_1f1b.py
    wires no reshard hooks: the overlap gathers nothing, so FSDP's sharded states are the ones without it and the
    overlap adds what it adds without FSDP."""
    flags = [strategy if f == "optim_grads_params" else f for f in ZP_Z3] + ["--moe-token-dispatcher-type", "alltoall"]
    L, _, off = _stage(flags)
    L, _, on = _stage(flags + ["--overlap-moe-expert-parallel-comm"])
    assert any("nothing is gathered per sub-module" in n for n in L.notes)
    # fp32 main weights and Adam moments over the sharded groups: 4 bytes x OPT (module docstring; every group
    # but the one outside units is already a multiple of its padding, so the sum is the same without units)
    assert on["main_parameters"] == off["main_parameters"] == on["adam_exp_avg"] == 4 * OPT
    # the overlap's own terms: the same as under the plain distributed optimizer
    plain = [f for f in flags if f not in ("--use-megatron-fsdp", "--data-parallel-sharding-strategy", strategy,
                                           "--ckpt-format", "fsdp_dtensor")]
    _, _, plain_off = _stage(plain)
    _, _, plain_on = _stage(plain + ["--overlap-moe-expert-parallel-comm"])
    assert (on["moe_dispatcher_state"] - off["moe_dispatcher_state"]
            == plain_on["moe_dispatcher_state"] - plain_off["moe_dispatcher_state"] > 0)


def test_hsdp_shards_over_one_replica():
    """--num-distributed-optimizer-instances 2: FSDP shards over the partial DP x CP group (4 / 2 = 2
    ranks) and the partial expert DP group (2 / 2 = 1: the experts are not sharded), and all-reduces
    the gradient shards across the 2 replicas in place (mcore_fsdp_adapter._init_dist_index, outer
    no_shard). Dense unit 530,432 padded to 2 x 512 -> 530,432, shard 265,216; experts whole
    4,194,304; outside units 13,435,904 (already a multiple of 2 x 512), shard 6,717,952."""
    _, _, t = _stage(ZP_Z3 + ["--num-distributed-optimizer-instances", "2"])
    opt = 12 * (265_216 + 4_194_304) + 6_717_952
    assert t["main_parameters"] == 4 * opt and t["fsdp_parameters"] == 2 * opt
    assert t["fsdp_non_unit_parameters"] == 2 * 13_435_904
    # core 0.16.1 builds no expert mesh under HSDP: its expert groups shard over the dense partial group
    # (2 ranks; measured on the CPU referee, tests/test_referee_fsdp_stored.py)
    _, _, t = _stage(ZP_Z3 + ["--num-distributed-optimizer-instances", "2"], version="0.16.1")
    assert t["main_parameters"] == 4 * (12 * (265_216 + 4_194_304 // 2) + 6_717_952)
    # core 0.17.1's _init_dist_index builds the expert mesh from the partial expert DP group under HSDP, as 0.19.2
    # does (mcore_fsdp_adapter.py): the experts whole again, the rest as in 0.16.1 (same vocabulary rules)
    _, _, t17 = _stage(ZP_Z3 + ["--num-distributed-optimizer-instances", "2"], version="0.17.1")
    assert t17["main_parameters"] - t["main_parameters"] == 4 * 12 * (4_194_304 - 4_194_304 // 2)


def test_experts_under_hfsdp_shard_their_optimizer_over_the_outer_group():
    """HFSDP with experts (core 0.19.2): the expert device mesh takes the dense outer (inter-instance) group
    (mcore_fsdp_adapter._init_dist_index) and ParamAndGradBuffer builds the expert groups' helper buffers over
    get_outer_fsdp_group(is_expert_parallel=True) (param_and_grad_buffer.py): weights and gradients over one
    replica's expert DP group (2 / 2 = 1 rank: whole), main weights and Adam over the 2 instances. Buckets padded
    to shard x outer x 512: dense unit 530,432 (a multiple of 2 x 2 x 512) -> replica shard 265,216, optimizer
    132,608; experts 4,194,304 -> optimizer 2,097,152; outside units 13,435,904 -> 13,436,928, replica shard
    6,718,464, optimizer 3,359,232. The optimizer shard is then the non-HSDP one over all 8 ranks (OPT)."""
    hfsdp = ["--num-distributed-optimizer-instances", "2", "--outer-dp-sharding-strategy", "optim"]
    _, _, t = _stage(ZP_Z3 + hfsdp)
    assert 12 * (132_608 + 2_097_152) + 3_359_232 == OPT
    assert t["main_parameters"] == t["adam_exp_avg"] == t["adam_exp_avg_sq"] == 4 * OPT
    assert t["fsdp_parameters"] == 2 * (12 * (265_216 + 4_194_304) + 6_718_464)
    # core 0.16.1 builds no expert mesh under HSDP and fails to build this on the CPU referee: refused
    with pytest.raises(NotModelledError, match="--outer-dp-sharding-strategy.*no expert device mesh"):
        layout_from_flags(ZP_Z3 + hfsdp, world_size=8, megatron_version="0.16.1")
    # without HSDP the outer strategy has no group to act on (MegatronFSDP reads it only with an outer group)
    layout_from_flags(ZP_Z3 + ["--outer-dp-sharding-strategy", "optim"], world_size=8, megatron_version="0.19.2")


def test_instances_must_divide_the_expert_data_parallel_size():
    from megatron_memguard.errors import ConfigError, ConfigErrors
    # world 8, DP 8 (TP 1), expert DP = 8 / EP 8 = 1: 2 instances cannot split it
    flags = [f for f in ZP_Z3] + ["--num-distributed-optimizer-instances", "2"]
    flags[flags.index("--tensor-model-parallel-size") + 1] = "1"
    flags[flags.index("--expert-model-parallel-size") + 1] = "8"
    with pytest.raises((ConfigError, ConfigErrors), match="--num-distributed-optimizer-instances"):
        layout_from_flags(flags, world_size=8, megatron_version="0.19.2")


def _ci_rows():
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    from accuracy_megatron_ci import evaluate, load_records
    from shared_data import MOE_RECORDS
    return [evaluate(r) for r in load_records(MOE_RECORDS) if "--use-megatron-fsdp" in r["model_args"]]


def test_megatron_ci_fsdp_moe_records():
    """The three clean MoE records under Megatron-FSDP (megatron-functional-moe-dev.jsonl): estimated, none
    refused. deepseek_proxy_fsdp (GB200, FP8 primary weights, peak in the forward): +2.1 %. zp_z3 (top-2
    aux-loss routing, dropless): -6.2 % (H100), -8.9 % (GB200), the same flags peaking 3 % apart on the two
    GPUs; each measured peak lies between memguard's balanced-routing estimate and its worst-case bound
    (every token of the micro-batch's top-k on the last EP rank's experts), as routing that sends the last
    rank's experts 1.2-1.3 times the balanced rows would make it. The FSDP terms of the same model shape are
    checked on the CPU referee (tests/test_referee_fsdp_stored.py: peak within 1.7 %). After the step both
    runs log with --log-params-norm, whose calc_params_l2_norm releases the unit buckets start_param_sync
    re-gathered (test_params_norm_releases_the_regathered_units): deepseek_proxy -1.3 %; zp_z3 +10.8 %, the
    fp32 gradient copies 0.19.2's update_main_grads keeps until the next zero_grad (115 MiB) where the
    run holds 34 MiB above its model state: docs/assumptions.md."""
    from megatron_memguard import estimate, lookup_gpu
    rows = _ci_rows()
    assert len(rows) == 3 and not any(r.error for r in rows), [r.error for r in rows]
    by = {(r.id.split("/")[1][:14], r.platform): r for r in rows}
    assert abs(by["deepseek_proxy", "GB200"].peak_err) <= 0.05
    for plat, gpu in (("H100", "H100-80GB"), ("GB200", "GB200")):
        r = by["gpt3_mcore_te_", plat]
        st = estimate(r.layout, gpu=lookup_gpu(gpu), dp_rank="last").stages[-1]
        assert st.peak_allocated_bytes <= r.measured_peak <= st.moe["worst_case"]["peak_allocated_bytes"], plat
        assert -0.10 <= r.peak_err <= 0.0, plat
    assert abs(by["deepseek_proxy", "GB200"].steady_err) <= 0.03
    # zp_z3: the safe side after the step, by at most its fp32 gradient copies (115 MiB of 751 MiB)
    for plat in ("H100", "GB200"):
        assert 0 <= by["gpt3_mcore_te_", plat].steady_err <= 115 * 2**20 / (751 * 2**20), plat


def test_fine_grained_gather_keeps_the_unit_buckets():
    # the sub-module hooks gather the same unit groups' buckets and the unit's _post_forward releases them
    _, s0, t0 = _stage(ZP_Z3)
    _, s1, t1 = _stage(ZP_Z3 + ["--megatron-fsdp-enable-fine-grained-param-gather"])
    assert t0 == t1 and s0.peak_allocated_bytes == s1.peak_allocated_bytes


def test_full_sharding_in_hsdp_flag_is_read_nowhere_in_0_19():
    # megatron-core 0.19.2 parses --enable-full-sharding-in-hsdp but no code reads it
    _, _, t0 = _stage(ZP_Z3 + ["--num-distributed-optimizer-instances", "2"])
    _, _, t1 = _stage(ZP_Z3 + ["--num-distributed-optimizer-instances", "2", "--enable-full-sharding-in-hsdp"])
    assert t0 == t1


def test_backward_top_holds_every_unit_but_no_gradient_bucket():
    """At the backward's top the prefetch (limit 5e8 elements) has every unit's weights gathered; the first
    gradient bucket (the tied output layer's, outside units: 13,436,928 x 2 B) comes after the cross entropy
    frees its fp32 softmax (4 x 1024 x 25,216 x 4 B = 394 MiB), so it adds nothing at the peak (the CPU
    referee's FSDP runs: no gradient bucket live at the backward's peak). Core 0.16.1 and 0.17.1: the final norm's
    pre-forward prefetch has gathered the units again before the loss."""
    for version in ("0.16.1", "0.17.1"):
        _, s, t = _stage(ZP_Z3, version)
        assert s.peak_phase.startswith("backward")
        assert t["fsdp_unsharded_parameters"] == 2 * 12 * (DENSE_UNIT + EXPERT_UNIT)
        assert t["loss_softmax_fp32"] == 4 * 1024 * 25_216 * 4
        assert "fsdp_unsharded_gradients" not in t


def test_units_at_the_loss_from_core_0_18_only_in_the_first_micro_batch():
    """From core 0.18 _root_pre_backward marks every module PRE_BACKWARD and the modules outside units stay so: the
    final norm's pre-forward no longer prefetches the units (megatron_fsdp.py 0.18.2 and 0.19.2), whose weights are
    then gathered only by the last unit's pre-backward hook, after the loss buffers have gone: none at the peak. The
    run's first micro-batch (before any backward) still has them at its loss, but the first step has not made Adam's
    states yet: 8 B x 30,116,352 optimizer elements = 240,930,816 B against 2 B x 12 x (530,432 + 4,194,304) =
    113,393,664 B of units, so the steady state is the peak. With --load (ckpt-format fsdp_dtensor) Megatron-FSDP
    makes the states before the first forward (a dummy step while building the loading state dict, as Megatron CI's
    zp_z3 record does: its peak is set in iteration 1), and the first micro-batch's loss, with every unit, is the
    peak; --no-load-optim skips those states."""
    _, s, t = _stage(ZP_Z3, "0.19.2")
    assert "fsdp_unsharded_parameters" not in t and t["adam_exp_avg"] + t["adam_exp_avg_sq"] == 8 * OPT
    assert 8 * OPT > 2 * 12 * (DENSE_UNIT + EXPERT_UNIT)
    L, s1, t1 = _stage(ZP_Z3 + ["--load", "/checkpoints"], "0.19.2")
    assert L.fsdp_optimizer_states_at_start
    assert t1["fsdp_unsharded_parameters"] == 2 * 12 * (DENSE_UNIT + EXPERT_UNIT)
    assert s1.peak_allocated_bytes - s.peak_allocated_bytes == 2 * 12 * (DENSE_UNIT + EXPERT_UNIT)
    _, s2, t2 = _stage(ZP_Z3 + ["--load", "/checkpoints", "--no-load-optim"], "0.19.2")
    assert "fsdp_unsharded_parameters" not in t2 and s2.peak_allocated_bytes == s.peak_allocated_bytes
    # 0.18.2 as 0.19.2 (its other differences, fp32 gradients under grad_reduce_in_fp32, aside)
    _, _, t3 = _stage(ZP_Z3, "0.18.2")
    assert "fsdp_unsharded_parameters" not in t3


FP8 = ["--fp8-format", "e4m3", "--fp8-recipe", "tensorwise", "--fp8-param-gather"]


def test_keep_fp8_transpose_cache_keeps_every_fp8_weights_transpose():
    """--keep-fp8-transpose-cache (megatron_fsdp.py release_module_parameters): Megatron-FSDP no longer
    drops the FP8 primary weights' transposes (Hopper Float8Tensor, 1 B per element of the whole weight)
    when it releases a unit. Per layer on this rank: QKV [768, 512] + proj [512, 256] + 4 local experts'
    fc1 [1024, 512] and fc2 [512, 1024] (the router stays BF16) = 4,718,592 elements; 12 layers."""
    _, s0, t0 = _stage(ZP_Z3 + FP8)
    _, s1, t1 = _stage(ZP_Z3 + FP8 + ["--keep-fp8-transpose-cache"])
    transposes = 12 * (768 * 512 + 512 * 256 + 4 * 2 * 1024 * 512)
    assert t1["fp8_weight_columnwise"] - t0["fp8_weight_columnwise"] == transposes == 56_623_104
    assert s1.persistent_bytes - s0.persistent_bytes == transposes
    # no FP8 primary weights: no Float8 parameters whose transposes it could keep
    _, _, t2 = _stage(ZP_Z3 + ["--keep-fp8-transpose-cache"])
    _, _, t3 = _stage(ZP_Z3)
    assert t2 == t3
    # blockwise: fp8_discard_transpose_cache (megatron_fsdp mixed_precision.py, 0.16.1 and 0.19.2) calls
    # update_usage(columnwise_usage=False) on a Float8BlockwiseQTensor; kept, its column-wise data [cols, rows]
    # (1 B per element, the same 4,718,592 per layer) stay; the 128x128-block scales are counted either way
    bw = ["--fp8-format", "e4m3", "--fp8-recipe", "blockwise", "--fp8-param-gather"]
    _, b0, u0 = _stage(ZP_Z3 + bw)
    _, b1, u1 = _stage(ZP_Z3 + bw + ["--keep-fp8-transpose-cache"])
    assert u1["fp8_weight_columnwise"] - u0["fp8_weight_columnwise"] == transposes
    assert b1.persistent_bytes - b0.persistent_bytes == transposes
    # mxfp8: an MXFP8Tensor is left alone (its column-wise data are Megatron-FSDP's transpose buffers): no change
    mx = ["--fp8-format", "e4m3", "--fp8-recipe", "mxfp8", "--fp8-param-gather"]
    _, m0, v0 = _stage(ZP_Z3 + mx)
    L, m1, v1 = _stage(ZP_Z3 + mx + ["--keep-fp8-transpose-cache"])
    assert v1 == v0 and m1.persistent_bytes == m0.persistent_bytes
    assert any("--keep-fp8-transpose-cache: no effect with the mxfp8 recipe" in n for n in L.notes)


def test_params_norm_releases_the_regathered_units():
    """--log-params-norm under Megatron-FSDP (core 0.19.2): train() calls calc_params_l2_norm after every step
    (training/training.py), which calls each chunk's stop_communication() (training/utils/common_utils.py):
    synchronize_param_gather() -> AllGatherPipeline.reset(preserve_non_fsdp_units=True) releases every unit
    bucket start_param_sync gathered at the end of the step and keeps the embedding's (megatron_fsdp.py,
    param_and_grad_buffer.py). So the allocated bytes Megatron logs after the iteration lack the 12 units'
    bf16 buckets, 2 x 12 x (530,432 + 4,194,304) B; the step itself still holds them; the peak (forward /
    backward, where the units are gathered again) does not move."""
    _, s0, _ = _stage(ZP_Z3)
    L1, s1, t1 = _stage(ZP_Z3 + ["--log-params-norm"])
    units = 2 * 12 * (DENSE_UNIT + EXPERT_UNIT)
    assert s0.persistent_bytes - s1.persistent_bytes == units == 113_393_664
    assert s1.peak_allocated_bytes == s0.peak_allocated_bytes
    ft = fsdp_stage_terms(L1, s1.chunks, [0] * len(s1.chunks))
    assert [t.bytes for t in ft.step_only if t.name == "fsdp_gathered_after_step"] == [units]
    assert "fsdp_gathered_after_step" not in {t.name for t in ft.step_terms}
    assert "fsdp_non_unit_parameters" in t1          # the buckets outside units are preserved
    # core 0.17.1's calc_params_l2_norm (training/utils.py) calls stop_communication() too
    _, a, _ = _stage(ZP_Z3, version="0.17.1")
    _, b, _ = _stage(ZP_Z3 + ["--log-params-norm"], version="0.17.1")
    assert a.persistent_bytes - b.persistent_bytes == units
    # core 0.16.1's training loop is not read: unchanged there
    _, a, _ = _stage(ZP_Z3, version="0.16.1")
    _, b, _ = _stage(ZP_Z3 + ["--log-params-norm"], version="0.16.1")
    assert a.persistent_bytes == b.persistent_bytes
    # without Megatron-FSDP the flag is a log line: the same layout
    dense = [f for f in ZP_Z3 if f not in ("--use-megatron-fsdp", "--data-parallel-sharding-strategy",
                                           "optim_grads_params", "--ckpt-format", "fsdp_dtensor")]
    assert layout_from_flags(dense, world_size=8) == layout_from_flags(dense + ["--log-params-norm"], world_size=8)


def test_expert_parallel_overlap_under_optim_grads_against_the_referee():
    """benchmarks/referee/fsdp_grid.py FSDP_OVERLAP on megatron-core 0.19.2 (CPU, 4 ranks: the MoE grid's model, EP 2,
    optim_grads, 2 micro-batches; CUDA streams are no-ops), stored in benchmarks/results/referee-fsdp-overlap-
    core019.json, measured by the tracker that sees a storage's own resize_ (the combined schedule frees the MoE
    nodes' inputs with untyped_storage().resize_(0); before it, the overlap run's peak was 6.0-6.6 MB higher and the
    plain run's the same byte for byte). Both runs: parameters exact, live bytes after the step within 1%, peak within
    the referee's 3% (compare.py) without the overlap. With it the measured peak is 7.6-8.8 KB above the plain run's
    (the same routing), under the 2 MiB memguard adds (moe_dispatcher_state: each MoE layer's input and its gradient
    that the held probs keep, an upper bound at a forward peak, as without FSDP): the estimate is 0.1-3.2% high."""
    import os
    from benchmarks.referee.grids.fsdp import FSDP_OVERLAP, stored_rank_layouts
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "results",
                        "referee-fsdp-overlap-core019.json")
    core, by, rows = stored_rank_layouts(path, FSDP_OVERLAP)
    assert core == "0.19.2"
    peaks = {}
    for cfg, r, L in rows:
        st = estimate(L, profile="local", device="cpu", dp_rank=r["dp_rank"] % L.dp_shard_size).stages[0]
        assert st.parameters == r["num_params"], (cfg["name"], r["rank"])
        assert abs(st.persistent_bytes / r["live_bytes_after_step"] - 1) <= 0.01, (cfg["name"], r["rank"])
        peaks[cfg["name"], r["rank"]] = (st.peak_allocated_bytes, r["peak_bytes"])
    plain, overlap = (c["name"] for c in FSDP_OVERLAP)
    for rank in range(4):
        (est0, got0), (est1, got1) = peaks[plain, rank], peaks[overlap, rank]
        assert abs(est0 / got0 - 1) <= 0.03, rank
        # the overlap's moe_dispatcher_state, as without FSDP: 2 a T h per MoE layer (docs/assumptions.md), a = 2 B,
        # T = seq 256 x micro-batch 2, h 256, 4 layers
        assert est1 - est0 == 2 * 2 * (256 * 2) * 256 * 4 == 2_097_152
        assert by[plain]["ranks"][rank]["routing_summary"] == by[overlap]["ranks"][rank]["routing_summary"]
        assert 0 < got1 - got0 < est1 - est0, rank      # measured: 7,626-8,758 B
        assert 0 < est1 / got1 - 1 <= 0.035, rank
