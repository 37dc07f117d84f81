"""Muon's optimizer state per parameter, from megatron-core 0.19.2's optimizer/__init__.py
(_get_megatron_emerging_optimizer), optimizer/emerging_optimizers.py (which parameters Muon takes)
and optimizer/layer_wise_optimizer.py (how the distributed variant shards them)."""
import pytest

from megatron_memguard.estimator.muon import (MuonSpec, layer_wise_shard_numel, muon_bytes_per_param,
                                              scalar_bytes_per_param, takes_muon)


def test_which_params_take_muon():
    # _is_nonlinear_or_embedding: embedding/output or not 2-D -> the scalar optimizer.
    assert takes_muon((4096, 4096), False)
    assert not takes_muon((128256, 4096), True)      # embedding / output layer
    assert not takes_muon((4096,), False)            # norm weight, bias
    assert not takes_muon((8, 4096, 4096), False)    # a 3-D grouped weight is not a matrix


def test_state_bytes_bf16():
    # Float16OptimizerWithFloat16Params keeps an fp32 main param; Muon one momentum buffer like it.
    assert sum(muon_bytes_per_param(MuonSpec()).values()) == 4 + 4
    assert sum(muon_bytes_per_param(MuonSpec(optimizer="adaptive_muon")).values()) == 4 + 4 + 4
    # the fallback is Adam: main param + exp_avg + exp_avg_sq, Megatron's 12 B/param
    assert sum(scalar_bytes_per_param(MuonSpec()).values()) == 12
    assert sum(scalar_bytes_per_param(MuonSpec(muon_scalar_optimizer="lion")).values()) == 8


def test_state_bytes_fp32_run_has_no_main_copy():
    # FP32Optimizer wraps the optimizer directly when not bf16: no separate main params.
    assert sum(muon_bytes_per_param(MuonSpec(bf16=False)).values()) == 4


def test_layer_wise_greedy_lpt():
    # _emit_bucket: largest first onto the least-loaded shard. 10,7,5,4,3 over 2 ranks:
    # 10->A, 7->B, 5->B(12), 4->A(14), 3->B(15): max 15 (not the ideal 14.5 rounded up).
    assert layer_wise_shard_numel([3, 5, 10, 4, 7], 2) == 15
    assert layer_wise_shard_numel([3, 5, 10, 4, 7], 1) == 29
    # one dominating matrix holds a shard alone
    assert layer_wise_shard_numel([100, 1, 1, 1], 4) == 100


def test_dist_muon_is_layer_wise():
    assert MuonSpec(optimizer="dist_muon").layer_wise
    assert MuonSpec(use_distributed_optimizer=True).layer_wise
    assert not MuonSpec().layer_wise


def test_ping_pong_of_core_0_16():
    # layer_wise_optimizer.py (0.16.1) shard_params' own example: 4 ranks, p0..p9 sorted by numel ->
    # [[p0, p7, p8], [p1, p6, p9], [p2, p5], [p3, p4]]; with numels 1..10 rank 1 holds 2+7+10 = 19.
    from megatron_memguard.estimator.muon import ping_pong_shard_numel
    assert ping_pong_shard_numel(range(1, 11), 4) == 19
    assert ping_pong_shard_numel(range(1, 11), 1) == 55


def test_which_params_take_muon_by_name():
    # megatron-core parameter names; norms and biases 1-D, word embedding / output layer flagged
    # (language_module.py sets is_embedding_or_output_parameter on exactly those two)
    from megatron_memguard.estimator.muon import takes_muon_by_name
    yes = ["decoder.layers.0.self_attention.linear_qkv.weight", "decoder.layers.3.mlp.linear_fc2.weight",
           "decoder.layers.1.mlp.router.weight", "decoder.layers.1.mlp.experts.linear_fc1.weight7",
           "embedding.position_embeddings.weight"]
    no = ["decoder.layers.0.self_attention.linear_qkv.layer_norm_weight", "decoder.layers.0.input_layernorm.weight",
          "decoder.layers.0.self_attention.q_layernorm.weight", "decoder.final_layernorm.weight",
          "decoder.layers.0.mlp.linear_fc1.bias", "embedding.word_embeddings.weight", "output_layer.weight"]
    assert all(takes_muon_by_name(n) for n in yes)
    assert not any(takes_muon_by_name(n) for n in no)


def test_state_split():
    from megatron_memguard.estimator.muon import state_split
    ps = [("embedding.word_embeddings.weight", 1000), ("decoder.layers.0.self_attention.linear_qkv.weight", 300),
          ("decoder.layers.0.self_attention.linear_qkv.layer_norm_weight", 10), ("output_layer.weight", 1000)]
    assert state_split(ps) == (300, 2010)


def test_shares():
    from megatron_memguard.estimator.muon import MuonSpec, shares
    chunk = [("embedding.word_embeddings.weight", 1000), ("decoder.layers.0.mlp.linear_fc1.weight", 400),
             ("decoder.layers.0.mlp.linear_fc2.weight", 300), ("decoder.layers.0.self_attention.linear_qkv.weight", 200),
             ("decoder.final_layernorm.weight", 10)]
    # not distributed: all of it on every rank
    s = shares(MuonSpec(), [chunk], dp=4, legacy=False)
    assert (s.muon_elems, s.scalar_elems, s.muon_buffer_numel) == (900, 1010, 900)
    # 0.19 layer-wise over 2 ranks: 400 -> A, 300 -> B, 200 -> B (500): max 500, buffer 2 x 500;
    # the fallback 1010 split evenly (505)
    s = shares(MuonSpec(use_distributed_optimizer=True), [chunk], dp=2, legacy=False)
    assert (s.muon_elems, s.scalar_elems, s.muon_buffer_numel) == (500, 505, 1000)
    # 0.16 dist_muon ping-pong by size 10, 200, 300, 400, 1000 over ranks 0, 1, 1, 0, 0:
    # rank 0 gets 10 (norm), 400, 1000 (embedding) -> 8*400 + 12*1010; rank 1 gets 200 + 300 (Muon)
    s = shares(MuonSpec(optimizer="dist_muon"), [chunk], dp=2, legacy=True)
    assert (s.muon_elems, s.scalar_elems) == (400, 1010)


# A 4-layer GPT (h 512, GELU, biases, learned positions over 1024, GPT-2 vocab 50257 -> 50304, tied): per layer
# the 2-D weights QKV 512x1536, proj 512x512, fc1 2048x512, fc2 512x2048; Muon also takes the position table.
GPT4 = ("--num-layers 4 --hidden-size 512 --num-attention-heads 8 --seq-length 1024 --max-position-embeddings 1024 "
        "--micro-batch-size 4 --global-batch-size 32 --bf16 --tokenizer-type NullTokenizer --vocab-size 50257").split()
MUON_ELEMS = 4 * (786_432 + 262_144 + 1_048_576 + 1_048_576) + 1024 * 512


def _terms(extra, world=1, version=None):
    from megatron_memguard import estimate, layout_from_flags
    L = layout_from_flags(GPT4 + extra, world_size=world, megatron_version=version)
    st = estimate(L).stages[0]
    return {t.name: t.bytes for t in st.terms}, st.parameters


def test_muon_estimate_not_distributed():
    terms, params = _terms(["--optimizer", "muon"])
    assert MUON_ELEMS == 13_107_200
    assert terms["muon_momentum"] == 4 * MUON_ELEMS
    assert terms["adam_exp_avg"] == terms["adam_exp_avg_sq"] == 4 * (params - MUON_ELEMS)
    assert terms["main_parameters"] == 4 * params
    adam, _ = _terms([])
    assert adam["adam_exp_avg"] == 4 * params and "muon_momentum" not in adam


def test_muon_estimate_layer_wise_core_0_19():
    # 8 ranks, largest first onto the least loaded: the eight 1,048,576 MLP matrices one each, the four QKV
    # (786,432) onto ranks 0-3 (1,835,008), the position table and the four projections onto the others:
    # the most loaded rank keeps 1,835,008 Muon elements; the fallback's 25,783,296 split 8 ways
    terms, params = _terms(["--optimizer", "muon", "--use-distributed-optimizer"], world=8)
    assert terms["muon_momentum"] == 4 * 1_835_008
    assert terms["adam_exp_avg"] == 4 * -(-(params - MUON_ELEMS) // 8)


def test_muon_with_distributed_optimizer_in_core_0_16():
    from megatron_memguard import layout_from_flags
    from megatron_memguard.errors import ConfigError, ConfigErrors
    with pytest.raises((ConfigError, ConfigErrors)) as e:
        layout_from_flags(GPT4 + ["--optimizer", "muon", "--use-distributed-optimizer"], world_size=8,
                          megatron_version="0.16")
    assert "--use-distributed-optimizer" in str(e.value)
    terms, _ = _terms(["--optimizer", "dist_muon"], world=8, version="0.16")
    assert terms["muon_momentum"] < 4 * MUON_ELEMS


def test_shares_keep_routed_experts_on_the_expert_group():
    # LayerWiseDistributedOptimizer.shard_params: routed experts over the expert-DP group, the rest over DP x CP
    from megatron_memguard.estimator.muon import MuonSpec, shares
    chunk = [("decoder.layers.0.self_attention.linear_qkv.weight", 400), ("decoder.layers.0.mlp.router.weight", 8),
             ("decoder.layers.0.mlp.experts.linear_fc1.weight0", 1000), ("decoder.layers.0.mlp.experts.linear_fc2.weight0", 1000),
             ("decoder.layers.0.mlp.shared_experts.linear_fc1.weight", 300)]
    s = shares(MuonSpec(use_distributed_optimizer=True), [chunk], dp=2, legacy=False, expert_dp=1)
    # dense Muon 400, 300, 8 over 2 ranks: max 400; experts 2000 whole on the one expert-DP rank
    assert s.muon_elems == 400 + 2000


def test_other_state_terms_stay():
    # Muon replaces only the Adam/SGD optimizer terms; weights, gradient buffers and other features' terms stay
    from megatron_memguard import layout_from_flags
    from megatron_memguard.estimator.muon import stage_state_terms
    from megatron_memguard.estimator.result import Term
    L = layout_from_flags(GPT4 + ["--optimizer", "muon"], world_size=1)
    terms = (Term("parameters", 1, "weights"), Term("feature_weights", 2, "weights"), Term("gradient_buffer", 3, "gradients"),
             Term("main_parameters", 4, "optimizer"), Term("adam_exp_avg", 5, "optimizer"),
             Term("adam_exp_avg_sq", 6, "optimizer"), Term("feature_state", 7, "optimizer"))
    names = [t.name for t in stage_state_terms(L, 0, terms)]
    assert names == ["parameters", "feature_weights", "gradient_buffer", "main_parameters", "muon_momentum",
                     "adam_exp_avg", "adam_exp_avg_sq", "feature_state"]


# ----- the optimizer step's Newton-Schulz working set ---------------------------------------------------
# emerging_optimizers 0.3.0 orthogonalized_optimizers/muon_utils.py newton_schulz + megatron-core 0.19.2
# optimizer/emerging_optimizers.py TensorParallelMuon. Each value below was also measured on CPU with the
# real TensorParallelMuon and the referee's live-bytes tracker (benchmarks/referee/muon_step_probe.py):
# equal to the byte.

def test_newton_schulz_fc1_medium_precision():
    # [1024, 512], fp32 momentum, M = 524,288 elements; transpose -> Gram 512 x 512.
    # normalize: 4M; .to(bf16): 4M + 2M; a step: X, new X (2M each) + A, B (2 x 2 x 512^2);
    # .to(fp32): 2M + 4M; then orth * scale * extra keeps orth, t1, t2: 12M = 6,291,456 B.
    from megatron_memguard.estimator.muon import NsSpec, newton_schulz_peak, orthogonalize_peak
    M = 1024 * 512
    assert newton_schulz_peak(M, 512, bf16_io=True) == 6 * M
    assert orthogonalize_peak(1024, 512, NsSpec()) == 12 * M == 6_291_456
    assert orthogonalize_peak(512, 1024, NsSpec()) == 6_291_456


def test_newton_schulz_fp32_square():
    # --muon-fp32-matmul-prec highest: X stays fp32; a step on [512, 512] holds X, new X, A, B:
    # 4 x 4 x 262,144 = 4,194,304 B, more than the 12 B/elem scaling (3,145,728 B).
    from megatron_memguard.estimator.muon import NsSpec, orthogonalize_peak
    assert orthogonalize_peak(512, 512, NsSpec(fp32_matmul_prec="highest")) == 4_194_304
    assert orthogonalize_peak(512, 512, NsSpec()) == 3_145_728


def test_split_qkv_working_set():
    # linear_qkv [8 groups x (64 + 64 + 64), 512], M = 786,432: the view [8, 192, 512] split along dim 1
    # and reshaped copies all three parts (4M); while the last part (M/3) is orthogonalised the first two
    # outputs are kept (4 x 2M/3) and it needs 12 x M/3: 4M + 8M/3 + 4M = 32M/3 = 8,388,608 B (the cat
    # afterwards holds only 8M). One query group per rank: the parts are views, 12 x 65,536 = 786,432 B.
    from megatron_memguard.estimator.muon import NsSpec, qkv_orthogonalize_peak
    assert qkv_orthogonalize_peak(8, (64, 64, 64), 512, NsSpec()) == 8_388_608
    assert qkv_orthogonalize_peak(1, (64, 64, 64), 512, NsSpec()) == 786_432
    # GQA 4:1 (query 256, key 64, value 64 per group): the query part first, 8 x 256 x 512 = 1,048,576
    # elements: copies 4 x 1,572,864 + 12 x 1,048,576 = 18,874,368 B
    assert qkv_orthogonalize_peak(8, (256, 64, 64), 512, NsSpec()) == 18_874_368


def test_duplicated_tp_mode_gathers_the_full_matrix():
    # newton_schulz_tp "duplicated": x_shards (TP x shard) and torch.cat's global_x (the full matrix) live
    # while the full matrix is orthogonalised (bf16: 6 B/elem of it at most). fc1 shard [512, 512] of TP 2:
    # full [1024, 512] = 524,288 elements: 8 x 524,288 + 6 x 524,288 = 7,340,032 B.
    from megatron_memguard.estimator.muon import NsSpec, orthogonalize_peak
    assert orthogonalize_peak(512, 512, NsSpec(tp_mode="duplicated"), group=2, partition_dim=0) == 7_340_032
    # blockwise (the default) ignores the split: the shard alone
    assert orthogonalize_peak(512, 512, NsSpec(), group=2, partition_dim=0) == 3_145_728
    # "distributed": the shard alone, but the Gram matrix spans the unpartitioned side. Column shard
    # [64, 1024] (M = 65,536) is transposed to [1024, 64]: A and B are [1024, 1024] bf16 next to X and the
    # new X: 2 x 2 x 65,536 + 2 x 2 x 1,048,576 = 4,456,448 B (more than the scaling's 786,432)
    assert orthogonalize_peak(64, 1024, NsSpec(tp_mode="distributed"), group=2, partition_dim=0) == 4_456_448


def _muon_ci_layout(**extra):
    # the flags of Megatron CI's gpt3_moe_mcore_te_ep8_resume_torch_dist_muon (12 layers, hidden 512,
    # 8 heads, 8 experts of width 1024, top-2, EP 8, TP 1, micro-batch 4 x 1024)
    from megatron_memguard.config import RawConfig
    from megatron_memguard.resolve import resolve
    args = dict(num_layers=12, hidden_size=512, num_attention_heads=8, seq_length=1024, max_position_embeddings=1024,
                micro_batch_size=4, global_batch_size=32, num_experts=8, moe_ffn_hidden_size=1024, moe_router_topk=2,
                expert_model_parallel_size=8, moe_grouped_gemm=True, disable_bias_linear=True, bf16=True,
                optimizer="muon", vocab_size=50257, transformer_impl="transformer_engine", **extra)
    return resolve(RawConfig(args=args, world_size=8))


def test_step_working_set_of_the_ci_muon_model():
    # its largest Muon matrix is linear_qkv [1536, 512] (8 query groups): 8,388,608 B, far below the
    # ~2.3 GB the forward pass adds on top of the states, so the step is not the peak
    from megatron_memguard import estimate
    from megatron_memguard.estimator.muon import step_working_set
    L = _muon_ci_layout()
    ws = step_working_set(L, 0)
    assert (ws.matrix, ws.shape, ws.bytes) == ("linear_qkv", (1536, 512), 8_388_608)
    st = estimate(L).stages[-1]
    assert st.peak_phase.startswith("forward")
    assert st.peak_allocated_bytes > st.persistent_bytes + ws.bytes


def test_step_settings_are_read_and_checked():
    from megatron_memguard.errors import ConfigErrors, ConfigError
    from megatron_memguard.estimator.muon import step_working_set
    L = _muon_ci_layout(muon_split_qkv=False, muon_nesterov=True)
    # unsplit [1536, 512] (12 B/elem) plus Nesterov's copy (4 B/elem): 16 x 786,432
    assert step_working_set(L, 0).bytes == 16 * 786_432
    with pytest.raises((ConfigError, ConfigErrors)) as e:
        _muon_ci_layout(muon_tp_mode="sideways")
    assert "muon" in str(e.value) and "tp" in str(e.value)


def test_step_peak_counts_the_working_set_but_not_the_steady_state():
    # a wide model with tiny activations (micro-batch 1 x 32 tokens): the step is the peak, and it is the
    # steady state plus the largest matrix's working set: fc1 [16384, 4096] unsplit = 12 B x 67,108,864. Untied: with
    # a tied output layer at PP 1 the end of the backward holds one more [V, h] (estimator/head.py tied_wgrad_wait),
    # 412 MB here, above the step's 805 MB over the steady state
    from megatron_memguard import estimate
    from megatron_memguard.config import RawConfig
    from megatron_memguard.resolve import resolve
    L = resolve(RawConfig(args=dict(num_layers=2, hidden_size=4096, ffn_hidden_size=16384, num_attention_heads=32,
                                    seq_length=32, max_position_embeddings=32, micro_batch_size=1,
                                    global_batch_size=1, bf16=True, optimizer="muon", vocab_size=1024,
                                    disable_bias_linear=True, untie_embeddings_and_output_weights=True), world_size=1))
    st = estimate(L).stages[-1]
    assert st.peak_phase == "optimizer step"
    ns = {t.name: t.bytes for t in st.terms}["muon_newton_schulz"]
    assert ns == 12 * 16384 * 4096
    assert st.peak_allocated_bytes == st.persistent_bytes + ns


def test_core_0_16_dist_muon_all_gathers_the_parameters_after_the_step():
    # layer_wise_optimizer.py (0.16.1) allgather_params: src = this rank's params flattened, output_list =
    # every rank's (its own too), bf16. GPT4's 52 parameters sorted by numel and dealt 0..7, 7..0: the
    # word embedding (25,755,648, index 51 -> rank 3) joins indices 3, 12, 19 (512 each), 28 (a QKV bias,
    # 1,536), 35 (a proj weight, 262,144) and 44 (an fc weight, 1,048,576): 27,069,440 elements. All:
    # 4 x 3,152,384 per layer + 25,755,648 + 524,288 positions + 1,024 final norm = 38,890,496.
    from megatron_memguard import estimate, layout_from_flags
    from megatron_memguard.estimator.muon import legacy_allgather_bytes
    L = layout_from_flags(GPT4 + ["--optimizer", "dist_muon"], world_size=8, megatron_version="0.16")
    assert legacy_allgather_bytes(L, 0) == 2 * (27_069_440 + 38_890_496)
    assert estimate(L).stages[0].parameters == 38_890_496
    # core 0.19's parameter layout syncs through the DDP buffer: no copy
    L19 = layout_from_flags(GPT4 + ["--optimizer", "muon", "--use-distributed-optimizer"], world_size=8,
                            megatron_version="0.19")
    assert legacy_allgather_bytes(L19, 0) == 0


def test_muon_ci_records_peak_misses_are_routing_not_the_optimizer():
    # Megatron CI's five first-run Muon MoE records (shared/groundtruth, GPU measurements; see
    # benchmarks/muon_peak_evidence.py and docs/calibration.md). act = what the peak holds above the model
    # state: measured peak(iteration 1) - (steady - the state the first step creates).
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    from muon_peak_evidence import rows
    rs = rows()
    assert len(rs) == 5
    acts = [r["act_measured"] for r in rs]
    by_group: dict = {}
    for r in rs:
        by_group.setdefault((r["platform"], r["ep"]), []).append(r["act_measured"])
    # the two optimizer layouts (Muon, layer-wise distributed Muon) hold the same activations within 0.2%
    for v in by_group.values():
        assert max(v) - min(v) <= 0.002 * min(v)
    # memguard's balanced estimate lies inside the spread the same flags show across platform and EP
    for r in rs:
        assert min(acts) < r["act_est"] < max(acts)
        # every measured peak is below the worst-case routing bound memguard prints
        assert r["peak"] < r["worst"]
        # the step's own working set is far below what the forward adds to the steady state
        assert r["step_ws"] < 0.01 * (r["est_peak"] - r["est_steady"])
