"""`memguard plan` on hybrid Mamba models (--hybrid-layer-pattern) and heterogeneous layer configs: the Mamba mixer's
FLOPs counted by hand from the Mamba-2 paper's chunked SSD algorithm, the model FLOPs of Nemotron-H 8B by hand, the
planner's parameters against the estimator's, its memory bound below full estimates, its pipeline splits as
megatron-core's select_pipeline_segment allows them, and its first choices accepted by the estimator."""
import os
import random

import pytest

from megatron_memguard.errors import ConfigError, ConfigErrors, NotModelledError
from megatron_memguard.planner import Constraints
from megatron_memguard.planner.hybrid import MambaShape, ssd_flops_per_token
from megatron_memguard.planner.space import enumerate_space

from planner_util import make_planner

HERE = os.path.dirname(os.path.abspath(__file__))
HET_DIR = os.path.join(HERE, "data", "heterogeneous")
MAMBA = ("--hidden-size 1024 --ffn-hidden-size 4096 --num-attention-heads 8 --group-query-attention "
         "--num-query-groups 8 --max-position-embeddings 4096 --position-embedding-type none --normalization RMSNorm "
         "--disable-bias-linear --squared-relu --untie-embeddings-and-output-weights --tokenizer-type NullTokenizer "
         "--vocab-size 32000 --bf16 --mamba-num-heads 32 --mamba-head-dim 64 --mamba-num-groups 8 "
         "--mamba-state-dim 128").split()
HYBRID = MAMBA + ["--hybrid-override-pattern", "M-M*-M-M-M*-M-M-", "--num-layers", "16"]
HYBRID_MOE = MAMBA + ["--hybrid-override-pattern", "MEM*EMEM*EME", "--num-layers", "12", "--num-experts", "8",
                      "--moe-router-topk", "2", "--moe-ffn-hidden-size", "512", "--moe-shared-expert-intermediate-size",
                      "1024", "--moe-token-dispatcher-type", "alltoall", "--moe-grouped-gemm"]
# the flags validate_model_config_args_from_heterogeneous_config (0.19.2) wants for tests/data/heterogeneous
HET = ("--num-layers 4 --hidden-size 512 --num-attention-heads 8 --group-query-attention --num-query-groups 2 "
       "--ffn-hidden-size 1024 --swiglu --normalization RMSNorm --position-embedding-type rope --use-rope-scaling "
       "--use-rotary-position-embeddings --rotary-base 500000 --untie-embeddings-and-output-weights "
       "--disable-bias-linear --max-position-embeddings 4096 --bf16 --hidden-dropout 0 --attention-dropout 0 "
       "--tokenizer-type NullTokenizer --vocab-size 1024 --heterogeneous-layers-config-path").split()


def test_ssd_scan_flops_by_hand():
    # Nemotron-H 8B's mixer (Megatron-Bridge 0.6.2 nemotronh.py: 128 heads of 64, 8 groups, state 128; chunk 128,
    # HybridModelProvider.mamba_chunk_size). Dao & Gu 2024 section 6, per token: diagonal blocks H 2 Q P + G 2 Q N,
    # chunk states H 2 N P, state passing H 2 N P / Q, off-diagonal output H 2 N P:
    # 128 (16,384 + 16,384 + 128 + 16,384) + 8 x 32,768 = 6,569,984
    fwd, bwd = ssd_flops_per_token(128, 64, 8, 128, 128)
    assert fwd == 128 * (2 * 128 * 64 + 4 * 128 * 64 + 2 * 128 * 64 / 128) + 8 * 2 * 128 * 128 == 6_569_984
    # backward: 2 x forward + the recomputed C B^T (8 x 32,768) and chunk states with their passing (128 x 16,512)
    assert bwd == 2 * 6_569_984 + 262_144 + 128 * 16_512 == 15_515_648


def test_mamba_layer_flops_per_token_by_hand():
    # a Mamba layer of HYBRID at TP 1: in_proj [2 x 2048 + 2 x 8 x 128 + 32 = 6,176, 1024], out_proj [1024, 2048]
    # (MambaMixer: d_inner = 32 heads x 64), 2 FLOPs per weight per token, plus the SSD scan's forward
    P = make_planner(HYBRID, 8, 4096, 32)
    m = MambaShape(32, 64, 8, 128, 128)
    assert m.in_proj_width(1) == 6_176 and m.conv_channels(2) == (2048 + 2048) // 2
    mixer = next(k for k in P.shape.kind_set if k.mixer == "mamba")
    lc = P.timer.kind_cost(mixer, 1, 1, 1, False)
    tokens = 4096
    assert lc.flops_fwd / tokens == pytest.approx(2 * 1024 * (6_176 + 2_048) + ssd_flops_per_token(32, 64, 8, 128, 128)[0])
    assert lc.ssm and lc.attn_fwd > 0 and lc.tp_fwd == 0


def test_nemotron_h_8b_model_flops_by_hand():
    # per token: 6 x matmul weights (24 Mamba layers x (18,560 x 4,096 + 4,096 x 8,192), 24 MLP layers x 2 x 21,504 x
    # 4,096, 4 attention layers x ((4,096 + 2 x 1,024) x 4,096 + 4,096 x 4,096), output layer 32,000 x 4,096), plus
    # 4 x 6 x 32 heads x 256 x 8,192 attention, plus 24 SSD scans forward and backward
    from megatron_memguard.planner import Cluster, Planner
    from megatron_memguard.gpus import lookup_gpu
    from megatron_memguard.readers.models import read_model
    g = lookup_gpu("H100-80GB")
    P = Planner(read_model("nemotronh_8b"), Cluster(8, 8, g, 8, g.memory_bytes))
    weights = 24 * (18_560 * 4_096 + 4_096 * 8_192) + 24 * 2 * 21_504 * 4_096 + 4 * (6_144 * 4_096 + 4_096 * 4_096)
    assert P.shape.matmul_params() == weights == 7_025_459_200
    ssd = sum(ssd_flops_per_token(128, 64, 8, 128, 128))
    assert P.timer.flops_per_token == 6 * (weights + 32_000 * 4_096) + 4 * 6 * 32 * 256 * 8_192 + 24 * ssd


def test_planner_parameters_match_the_estimator_per_stage():
    # the planner's per-rank parameters of each stage (per-kind recipes) against the estimator's count of that stage
    for flags, gpus, gbs in ((HYBRID, 16, 64), (HYBRID_MOE, 16, 64), (HET + [os.path.join(HET_DIR, "linear_blocks.json")], 8, 32)):
        P = make_planner(flags, gpus, 4096, gbs)
        cands = [c for c in enumerate_space(P.shape, P.cluster, gbs, Constraints(recompute=("none",), mbs=(1,)))
                 if c.pp > 1 or c.tp > 1][:40]
        assert cands
        for c in cands:
            est = P.estimate(P.layout(c))
            for st in est.stages:
                dense = P.timer.stage_params(c, st.pp_rank) + P.timer.stage_expert_params(c, st.pp_rank)
                assert dense == st.parameters, (c.name, st.pp_rank)


# '|' segments kept as given (4: PP 2 with VPP 2, PP 4), and '/' MTP depths (the planner's own segments for VPP)
HYBRID_PIPES = MAMBA + ["--hybrid-layer-pattern", "M-M*|-M-M-|M*-M|-M-"]
HYBRID_MTP = MAMBA + ["--hybrid-layer-pattern", "M-M*-M-M-M*-M-M-/M*-/M*-"]


@pytest.mark.parametrize("name", ["hybrid", "hybrid-moe", "hybrid-pipes", "hybrid-mtp", "small_blocks", "linear_blocks",
                                  "top_mlp_only", "own_query_groups"])
def test_bound_stays_below_the_estimate_and_no_candidate_breaks_a_rule(name):
    flags = {"hybrid": HYBRID, "hybrid-moe": HYBRID_MOE, "hybrid-pipes": HYBRID_PIPES, "hybrid-mtp": HYBRID_MTP}.get(
        name) or HET + [os.path.join(HET_DIR, name + ".json")]
    gpus, gbs = (16, 64) if name.startswith("hybrid") else (8, 32)
    P = make_planner(flags, gpus, 4096, gbs)
    cands = enumerate_space(P.shape, P.cluster, gbs, Constraints())
    for c in random.Random(3).sample(cands, min(50, len(cands))):
        est = P.estimate(P.layout(c))          # (a rule the space missed would raise here)
        assert P.replay_bound(c) <= est.peak_device_bytes, c.name
        assert P.timer.step_time_bound(c) <= P.step_time(c).seconds, c.name


def _planner_016(flags):
    """A planner for megatron-core 0.16 (memguard's --megatron-version; as a model flag it is not Megatron's)."""
    from megatron_memguard.gpus import lookup_gpu
    from megatron_memguard.planner import Cluster, Planner
    from megatron_memguard.readers.megatron_flags import parse_megatron_flags
    g = lookup_gpu("H100-80GB")
    return Planner(parse_megatron_flags(flags), Cluster(8, 8, g, 8, g.memory_bytes), seq_length=4096,
                   global_batch_size=32, megatron_version="0.16")


def test_hybrid_pipeline_splits_follow_select_pipeline_segment():
    # megatron-core 0.16.1 MambaStack._select_layers_for_pipeline_parallel: an even split or first / last stage sizes,
    # no virtual pipeline (it asserts virtual_pipeline_model_parallel_size is None), no '|' symbol (dropped, noted)
    P = _planner_016(MAMBA + ["--hybrid-override-pattern", "M-M*-M-M|-M*-M-M-M-", "--num-layers", "18"])
    assert any("'|' pipeline segments are left out" in n for n in P.notes)
    cands = enumerate_space(P.shape, P.cluster, 32, Constraints())
    assert all(c.vpp == 1 and not c.chunks and not c.pp_layout and not c.segments for c in cands)
    # 18 layers on PP 4: 4 + 5 + 5 + 4 / 5 + 4 + 4 + 5 style splits with first / last sizes only
    four = {c.stage_layers for c in cands if c.pp == 4}
    assert four and all(sum(s) == 18 and len(set(s[1:-1])) <= 1 for s in four)
    for c in [c for c in cands if c.pp == 4][:4]:
        L = P.layout(c)
        assert L.hybrid_layer_pattern == "M-M*-M-M-M*-M-M-M-" and L.pipeline_model_parallel_layout is None


def test_a_users_pipe_segments_are_kept_as_given():
    # megatron-core 0.19.2 validate_args: the '|' segments' count divisible by PP, VPP = count / PP (none when equal);
    # select_pipeline_segment gives segment v x PP + rank to that rank's virtual stage v; PP 1 with 2 or more segments
    # is refused (the interleaved schedule needs a pipeline)
    two = "M-M*-M-M|-M*-M-M-M-"                  # 8 + 10 layers
    P = make_planner(MAMBA + ["--hybrid-layer-pattern", two], 8, 4096, 32)
    assert any("2 '|' pipeline segments are kept as given" in n for n in P.notes)
    cands = enumerate_space(P.shape, P.cluster, 32, Constraints())
    assert cands and {(c.pp, c.vpp, c.stage_layers, c.segments) for c in cands} == {(2, 1, (8, 10), two)}
    L = P.layout(cands[0])
    assert L.pipeline_model_parallel_layout == "E" + "t" * 8 + "|" + "t" * 10 + "L" and L.vpp == 1
    four = "M-M*-|M-M-|M*-M-|M-M-"               # 5, 4, 5, 4 layers
    P = make_planner(MAMBA + ["--hybrid-layer-pattern", four], 8, 4096, 32)
    cands = enumerate_space(P.shape, P.cluster, 32, Constraints())
    # PP 2: rank 0 holds segments 0 and 2 (5 + 5), rank 1 segments 1 and 3 (4 + 4), VPP 2; PP 4: one each
    assert {(c.pp, c.vpp, c.stage_layers, c.chunks) for c in cands} == {(2, 2, (10, 8), (5, 4, 5, 4)),
                                                                         (4, 1, (5, 4, 5, 4), ())}
    L = P.layout(next(c for c in cands if c.pp == 2))
    assert L.vpp == 2 and L.pipeline_model_parallel_layout == "Ettttt|tttt|ttttt|ttttL"
    assert not enumerate_space(P.shape, P.cluster, 32, Constraints(vpp=(1,), pp=(2,)))   # VPP is the segments'
    # three segments: PP 3 does not divide 8 GPUs, PP 1 cannot interleave: nothing to plan, said so
    P = make_planner(MAMBA + ["--hybrid-layer-pattern", "M-M*-M|-M-M*|-M-M-M-"], 8, 4096, 32)
    res = P.plan(Constraints(), top=3)
    assert not res.entries and any("3 '|' segments allow only a PP > 1 dividing 3" in n for n in res.notes)


def test_virtual_stages_of_a_pattern_without_pipes_are_written_as_segments():
    # select_pipeline_segment (0.19.2) raises for a vp_stage without '|': the planner's virtual stages are its own
    # split of the pattern written with '|'. 18 layers on PP 2: the even split's VPP 3 and 9 (divisors of 9), and VPP 2
    # (4 does not divide 18) as space.uneven_vpp_splits deals it: first / last 8 + 10 or 10 + 8 layers in chunks of
    # 4, 5, 4, 5 / 5, 4, 5, 4, then the embedding and loss counted as layers, 20 / 4 = 5 per virtual stage: 4, 5, 5, 4
    pattern = "M-M*-M-M-M*-M-M-M-"
    P = make_planner(MAMBA + ["--hybrid-layer-pattern", pattern], 8, 4096, 32)
    cands = enumerate_space(P.shape, P.cluster, 32, Constraints())
    got = {(c.vpp, c.segments) for c in cands if c.pp == 2 and c.vpp > 1}
    assert got == {(3, "M-M|*-M|-M-|M*-|M-M|-M-"), (9, "M|-|M|*|-|M|-|M|-|M|*|-|M|-|M|-|M|-"),
                   (2, "M-M*|-M-M-|M*-M|-M-M-"), (2, "M-M*-|M-M-|M*-M-|M-M-"), (2, "M-M*|-M-M-|M*-M-|M-M-")}
    # VPP 1 keeps the flags' spelling (even, or first / last sizes)
    assert all(c.segments is None for c in cands if c.vpp == 1)
    c = next(c for c in cands if c.pp == 2 and c.vpp == 3)
    L = P.layout(c)
    assert L.vpp == 3 and L.pipeline_model_parallel_layout == "Ettt|ttt|ttt|ttt|ttt|tttL"
    # the exported flags carry the pattern, not the layout / VPP flags validate_args refuses beside it, and they
    # give the same layout again
    from megatron_memguard.planner.export import bridge_overrides, megatron_flags, nemo2_overrides
    from megatron_memguard.readers.megatron_flags import parse_megatron_flags
    from megatron_memguard.resolve import resolve
    import shlex
    flags = megatron_flags(L)
    assert "--hybrid-layer-pattern 'M-M|*-M|-M-|M*-|M-M|-M-'" in flags
    assert not any(f.startswith(("--pipeline-model-parallel-layout", "--num-virtual-stages")) for f in flags)
    # Bridge: the pattern alone (HybridModelProvider asserts virtual_pipeline_model_parallel_size unset); NeMo 2 runs
    # no validate_args to derive the size: written beside it
    bridge = bridge_overrides(L)
    assert "model.hybrid_layer_pattern='M-M|*-M|-M-|M*-|M-M|-M-'" in bridge
    assert "model.virtual_pipeline_model_parallel_size=null" in bridge
    assert not any("pipeline_model_parallel_layout" in o for o in bridge)
    nemo2 = nemo2_overrides(L)
    assert "model.config.hybrid_override_pattern='M-M|*-M|-M-|M*-|M-M|-M-'" in nemo2
    assert "trainer.strategy.virtual_pipeline_model_parallel_size=3" in nemo2
    again = resolve(parse_megatron_flags(MAMBA + shlex.split(" ".join(flags))),
                    world_size=8)
    assert again.vpp == 3 and again.pipeline_model_parallel_layout == L.pipeline_model_parallel_layout
    # megatron-core 0.16: no virtual stages, no '|'
    old = _planner_016(MAMBA + ["--hybrid-override-pattern", pattern, "--num-layers", "18"])
    assert all(c.vpp == 1 and not c.segments for c in enumerate_space(old.shape, old.cluster, 32, Constraints()))


def test_explain_takes_a_segmented_pattern():
    from megatron_memguard.planner.explain import explain
    pattern = "M-M*-M-M-M*-M-M-M-"
    P = make_planner(MAMBA + ["--hybrid-layer-pattern", pattern], 8, 4096, 32)
    x = explain(P, "tp=1,pp=2,mbs=1,segments=M-M|*-M|-M-|M*-|M-M|-M-")
    assert x.candidate.vpp == 3 and x.candidate.stage_layers == (9, 9) and x.layout.vpp == 3
    with pytest.raises(ConfigError, match="--explain segments.*the model's pattern"):
        explain(P, "tp=1,pp=2,segments=M-M|*-M|-M-|M*-|M-M|-M*")
    with pytest.raises(ConfigError, match="divides their count"):
        explain(P, "tp=1,pp=4,segments=M-M|*-M|-M-|M*-|M-M|-M-")


def test_plans_with_segments_or_virtual_stages_fit_as_estimated():
    # every layout a plan shows was estimated in full and fits; again from its flags
    for pattern in ("M-M*-M-|M-M-M*|-M-M-|M-", "M-M*-M-M-M*-M-M-M-", "M-M*-M-M-M*-M-M-M-/M*/M*"):
        P = make_planner(MAMBA + ["--hybrid-layer-pattern", pattern], 8, 4096, 32)
        res = P.plan(Constraints(pp=(2,)), top=4)
        assert res.entries and not res.rejected, pattern
        for e in res.entries:
            assert e.estimate.verdict == "fits"
            assert P.estimate(P.layout(e.candidate)).peak_device_bytes == e.estimate.peak_device_bytes


def test_plan_of_nemotron_h_8b_preset_fits_as_estimated(capsys):
    # Megatron-Bridge 0.6.2 nemotronh_8b recipe (TP communication overlap on: candidates without SP are dropped);
    # every layout shown was estimated in full and fits
    from megatron_memguard.cli.main import main
    from megatron_memguard.gpus import lookup_gpu
    from megatron_memguard.planner import Cluster, Planner
    from megatron_memguard.readers.models import read_model
    g = lookup_gpu("H100-80GB")
    P = Planner(read_model("nemotronh_8b"), Cluster(8, 8, g, 8, g.memory_bytes))
    res = P.plan(Constraints(), top=5)
    assert len(res.entries) == 5
    for e in res.entries:
        assert e.estimate.verdict == "fits" and e.candidate.tp > 1 and e.candidate.sp, e.candidate.name
        again = P.estimate(P.layout(e.candidate))
        assert again.peak_device_bytes == e.estimate.peak_device_bytes
    assert main(["plan", "--model", "nemotronh_8b", "--gpus", "8", "--gpu", "h100-80gb", "--explain"]) == 0
    out = capsys.readouterr().out
    assert "24 Mamba layers" in out and "SSD scan" in out and "24 MLP layers, 4 attention layers" in out


def test_hybrid_mtp_depths_are_planned_on_the_last_stage():
    # parse_hybrid_pattern (0.19.2): two depths of 'M*' after '/'; MultiTokenPredictionLayer builds a HybridStack of
    # one Mamba and one attention layer per depth, on the last pipeline stage (hybrid_model.py mtp_on_this_rank)
    flags = MAMBA + ["--hybrid-layer-pattern", "M-M*-M-M-/M*/M*"]
    P = make_planner(flags, 8, 4096, 32)
    base = make_planner(MAMBA + ["--hybrid-layer-pattern", "M-M*-M-M-"], 8, 4096, 32)
    cands = [c for c in enumerate_space(P.shape, P.cluster, 32, Constraints(recompute=("none",), mbs=(1,)))
             if c.tp == 1 and c.cp == 1 and c.dist_opt]
    for pp in (1, 2):
        c = next(c for c in cands if c.pp == pp and c.vpp == 1)
        est = P.estimate(P.layout(c))
        # the planner's parameters of the last stage, its MTP depths included, are the estimator's count
        assert P.timer.stage_params(c, pp - 1) + P.timer.mtp_params(c)[0] == est.stages[-1].parameters
    one, two = (next(c for c in cands if c.pp == pp and c.vpp == 1) for pp in (1, 2))
    # with PP > 1 the last stage builds its own word embedding for the MTP depths: 32,000 x 1,024 more parameters
    assert P.timer.mtp_params(two)[0] - P.timer.mtp_params(one)[0] == 32_000 * 1_024
    # step time: each depth's layers at their kinds' costs, twice for two depths; the last rank pays them
    fp8 = False
    lc, ec = P.timer.layer_cost(1, 1, 1, False), P.timer.ends_cost(1, 1, 1, False)
    mtp = P.timer.mtp_cost(one, lc, ec, None, 0.0, 0.0, fp8)
    kinds = [k for k in P.shape.kind_set if k.mixer in ("mamba", "attention") and k.mlp == "none"]
    assert len(kinds) == 2
    layers_gemm = sum(P.timer.kind_cost(k, 1, 1, 1, False).per_layer[0] for k in kinds)
    single = make_planner(MAMBA + ["--hybrid-layer-pattern", "M-M*-M-M-/M*"], 8, 4096, 32)
    mtp1 = single.timer.mtp_cost(one, lc, ec, None, 0.0, 0.0, fp8)
    assert mtp == pytest.approx(tuple(2 * x for x in mtp1))
    # one depth's GEMMs: its two layers', eh_proj [2h -> h] and the output layer's
    from megatron_memguard.planner.timing import linear_seconds
    proj = sum(linear_seconds(4096, 1024, 2048, P.timer.gpu, P.shape.grad_bytes))
    assert mtp1[0] == pytest.approx(layers_gemm + proj + ec.out_gemm_fwd + ec.out_gemm_bwd)
    assert P.step_time(one).seconds > base.step_time(one).seconds
    res = P.plan(Constraints(), top=3)
    assert res.entries and all(e.estimate.verdict == "fits" for e in res.entries)


def test_heterogeneous_models_with_mtp_depths_are_refused_by_name():
    flags = HET + [os.path.join(HET_DIR, "small_blocks.json"), "--mtp-num-layers", "1"]
    with pytest.raises((NotModelledError, ConfigError, ConfigErrors), match="mtp"):
        make_planner(flags, 8, 4096, 32)


def test_linear_replacement_blocks_plan_without_sequence_parallelism():
    # resolve/heterogeneous.py: a linear replacement's output gather fails under SP with TP > 1
    P = make_planner(HET + [os.path.join(HET_DIR, "linear_blocks.json")], 8, 4096, 32)
    cands = enumerate_space(P.shape, P.cluster, 32, Constraints())
    assert any(c.tp > 1 for c in cands) and not any(c.sp for c in cands)
    res = P.plan(Constraints(), top=3)
    assert res.entries and not res.rejected
    from megatron_memguard.planner.space import Candidate
    with pytest.raises((ConfigError, ConfigErrors), match="replace_with_linear"):
        P.layout(Candidate(2, 1, 1, 1, None, None, True, 1, "none", True, 4, 8, (4,)))      # TP 2 with SP: refused


def test_the_legacy_pattern_spelling_is_cleared_beside_the_segmented_one():
    # validate_args (0.19.2) and Bridge's HybridModelProvider.finalize assert --hybrid-override-pattern and
    # --hybrid-layer-pattern are not both given: the exported pattern replaces the legacy one
    from megatron_memguard.planner.export import bridge_overrides, flags_to_remove, megatron_flags
    P = make_planner(MAMBA + ["--hybrid-override-pattern", "M-M*-|M-M-|M*-M-|M-M-", "--num-layers", "18"], 8, 4096, 32)
    c = next(c for c in enumerate_space(P.shape, P.cluster, 32, Constraints()) if c.vpp == 2)
    L = P.layout(c)
    assert flags_to_remove(P.raw, megatron_flags(L)) == ["--hybrid-override-pattern"]
    assert "model.hybrid_override_pattern=null" in bridge_overrides(L, raw=P.raw)


def test_hybrid_mtp_depths_with_moe_layers_count_their_experts():
    # a depth of '*E' (attention, then an MoE block): the last stage's parameters, its routed experts over expert DP
    # included, are the estimator's count
    flags = HYBRID_MOE[:HYBRID_MOE.index("--hybrid-override-pattern")] + [
        "--hybrid-layer-pattern", "MEM*EMEM*EME/*E"] + HYBRID_MOE[HYBRID_MOE.index("--num-experts"):]
    P = make_planner(flags, 16, 4096, 64)
    cands = [c for c in enumerate_space(P.shape, P.cluster, 64, Constraints(recompute=("none",), mbs=(1,)))
             if c.pp > 1 and c.ep > 1][:4]
    assert cands
    for c in cands:
        last = P.estimate(P.layout(c)).stages[-1]
        assert (P.timer.stage_params(c, c.pp - 1) + P.timer.stage_expert_params(c, c.pp - 1)
                + sum(P.timer.mtp_params(c))) == last.parameters, c.name
        assert P.timer.mtp_params(c)[1] > 0
