"""Activation offloading, hand-computed from TE's cpu_offload.py (the (L - N) * T_layer bound it documents)
and megatron/core/pipeline_parallel/fine_grained_activation_offload.py (core 0.19.2)."""
import pytest

from megatron_memguard.estimator.offload_activations import (fine_grained_plan, group_bytes, layer_offload_host_bytes,
                                                              layer_offload_removed, layer_offload_resident_layers)


def test_layer_level():
    assert layer_offload_resident_layers(32, 8) == 24
    assert layer_offload_removed(32, 8, per_layer_saved=100) == 800
    assert layer_offload_host_bytes(8, per_layer_saved=100) == 800
    with pytest.raises(ValueError):
        layer_offload_resident_layers(32, 32)     # TransformerConfig: 0 <= N < num_layers


def test_min_tensor_size():
    # tensors below --min-offloaded-tensor-size elements (default 1,048,576) stay on the GPU
    tensors = {"attn_norm": [(1024 * 1024, 2)], "core_attn": [(4 * 1024 * 1024, 2), (1000, 4)]}
    assert group_bytes(tensors, ("attn_norm", "core_attn", "mlp_norm")) == {
        "attn_norm": 2 * 1024 * 1024, "core_attn": 8 * 1024 * 1024, "mlp_norm": 0}


def test_plan_last_stage_keeps_last_group():
    groups = {"mlp_norm": 30, "attn_norm": 10, "core_attn": 50}
    last = fine_grained_plan(groups, layers=4, last_stage=True)
    # forward order attn_norm, core_attn, mlp_norm: the last layer's mlp_norm group stays
    assert last.offloaded == 4 * 90 - 30 and last.kept_last_group == 30
    assert last.staging == 2 * 50
    mid = fine_grained_plan(groups, layers=4, last_stage=False)
    assert mid.offloaded == 360 and mid.host_bytes == 360


def test_layer_groups_of_a_te_layer():
    # memguard's saved tensors of one TE layer (names of the layer recipe); TE fuses the input norm into the
    # QKV projection, so attn_norm takes nothing and qkv_linear takes the layer input and the norm output.
    from megatron_memguard.estimator.offload_activations import layer_groups
    mib = 1024 * 1024
    saved = {"layer_input": 4 * mib, "norm1_stats": 8192, "qkv_input": 4 * mib, "query_rope": 4 * mib,
             "key_rope": 4 * mib, "softmax_stats": 128 * 1024, "proj_input": 4 * mib, "mlp_norm_input": 4 * mib,
             "fc1_input": 4 * mib}
    groups = layer_groups(saved, ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm"), elem_bytes=2)
    # softmax_stats (64 Ki fp32 elements) is below the 1,048,576-element threshold and stays
    assert groups == {"qkv_linear": 8 * mib, "core_attn": 8 * mib, "attn_proj": 4 * mib}
    # without attn_proj listed the attention output goes with core_attn (flash attention saves it)
    assert layer_groups(saved, ("core_attn",), 2) == {"core_attn": 12 * mib}
    # a 2 MiB bf16 tensor is exactly 1,048,576 elements: offloaded
    assert layer_groups({"proj_input": 2 * mib}, ("attn_proj", "core_attn"), 2) == {"attn_proj": 2 * mib}


def test_layer_groups_of_a_flash_attention_layer():
    # --attention-backend flash (or auto on an A100): TE 2.11 FlashAttention saves, inside the core_attn call,
    # contiguous [b, s, h, d] copies of q, k, v and flash-attn's own output (backends.py FlashAttention.forward);
    # the sbhd copy it returns (output.contiguous()) is saved by linear_proj only, inside the attn_proj call
    from megatron_memguard.estimator.offload_activations import layer_groups
    mib = 1024 * 1024
    saved = {"layer_input": 4 * mib, "qkv_input": 4 * mib, "flash_qkv": 8 * mib, "attention_output_bshd": 4 * mib,
             "softmax_stats": 128 * 1024, "proj_input": 4 * mib}
    assert layer_groups(saved, ("core_attn",), 2) == {"core_attn": 12 * mib}
    assert layer_groups(saved, ("core_attn", "attn_proj"), 2) == {"core_attn": 12 * mib, "attn_proj": 4 * mib}
    # unfused attention (no statistics: its context is a new tensor the bmm does not save) and a recomputed core
    # attention leave linear_proj the only holder of its input, too
    unfused = {"qkv_output": 6 * mib, "attention_probs": 64 * mib, "proj_input": 4 * mib}
    assert layer_groups(unfused, ("core_attn",), 2) == {"core_attn": 70 * mib}


def test_layer_groups_of_an_mla_layer():
    # MLA (TE): the input norm is a module of its own, so attn_norm takes the layer input; the down
    # projections' latents go with qkv_linear, the attention inputs with core_attn
    from megatron_memguard.estimator.offload_activations import layer_groups
    mib = 1024 * 1024
    saved = {"layer_input": 4 * mib, "qkv_input": 4 * mib, "q_latent": 2 * mib, "kv_latent": 1 * mib,
             "query": 6 * mib, "key": 6 * mib, "value": 4 * mib, "softmax_stats": 64 * 1024, "proj_input": 4 * mib}
    groups = layer_groups(saved, ("attn_norm", "qkv_linear", "core_attn"), 2, separate_input_norm=True)
    # kv_latent (1 MiB of bf16 = 524,288 elements) and the fp32 statistics are under the threshold and stay; the
    # output linear_proj reads is FusedAttention's saved output, offloaded with core_attn
    assert groups == {"attn_norm": 4 * mib, "qkv_linear": 6 * mib, "core_attn": 20 * mib}


def test_groups_next_to_cuda_graphs():
    # TransformerLayer.__init__ (core 0.19.2) switches attn_norm / mlp_norm offloading off at graph boundaries
    from megatron_memguard.estimator.offload_activations import effective_modules
    mods = ("attn_norm", "qkv_linear", "mlp_norm", "expert_fc1")
    assert effective_modules(mods, "none", ("attn",), False) == mods
    assert effective_modules(mods, "transformer_engine", ("attn",), False) == ("qkv_linear", "expert_fc1")
    assert effective_modules(mods, "transformer_engine", ("attn", "mlp"), False) == ("qkv_linear", "mlp_norm", "expert_fc1")
    assert effective_modules(mods, "transformer_engine", ("moe_router",), True) == ("attn_norm", "qkv_linear", "expert_fc1")


def test_staging_never_exceeds_what_left():
    """Regression (props round, found by test_properties_features' offload property): one layer with one
    offloaded group on the last stage (`--fine-grained-activation-offloading --offload-modules expert_fc1`,
    --num-layers 1) offloads nothing, yet staged two groups (+4.7 MB at the peak); two such layers offload
    one group and staged two. The staged groups are groups that left."""
    assert fine_grained_plan({"expert_fc1": 70}, layers=1, last_stage=True).staging == 0
    two = fine_grained_plan({"expert_fc1": 70}, layers=2, last_stage=True)
    assert two.offloaded == 70 and two.staging == 70
    # the biggest group that leaves: with one layer, not the kept last group
    one = fine_grained_plan({"attn_norm": 10, "mlp_norm": 30}, layers=1, last_stage=True)
    assert one.offloaded == 10 and one.staging == 10
    assert fine_grained_plan({"expert_fc1": 70}, layers=1, last_stage=False).staging == 70


def test_plan_with_an_in_flight_cap():
    # ChunkOffloadHandler._drain_offload_pending (core 0.19.2): up to `cap` copies of each name pending, each name's
    # count at most its groups that left, plus one group (the largest) reloaded ahead, never more than left
    groups = {"qkv_linear": 10, "core_attn": 30, "mlp_norm": 20}
    assert fine_grained_plan(groups, layers=4, last_stage=False, max_inflight=2).staging == 2 * 60 + 30
    # last stage: the last mlp_norm group stays (3 of 4 leave); 4 x 10 + 4 x 30 + 3 x 20 + 30 = 250 > 220 that left
    last = fine_grained_plan(groups, layers=4, last_stage=True, max_inflight=4)
    assert last.offloaded == 220 and last.staging == 220
    # a cap of 1 (or none) keeps the two groups of the largest module
    assert fine_grained_plan(groups, layers=4, last_stage=False, max_inflight=1).staging == 60
    assert fine_grained_plan(groups, layers=4, last_stage=False).staging == 60


def test_layers_of_different_kinds_compose_what_the_layers_above_keep():
    """Regression (props round, found by test_properties_features' offload property at 50 examples, core 0.19): a
    chunk of an MoE layer under a dense one (--moe-layer-freq 2) took the largest layer's working set over the whole
    chunk once offloading was on (an upper bound), above the composed one without offloading. A layer's forward
    runs before the layers above it saved anything, its backward after they freed theirs: its working set comes
    over the chunk's kept bytes less what the layers above keep on the GPU (their saved bytes less the groups
    they send to the host)."""
    from megatron_memguard.estimator.activations import LayerActivations
    from megatron_memguard.estimator.core import _kept_transients, _mixed_transients
    # bottom layer: saves 1000 B, forward working set 5000 B, backward 300 B; top layer: saves 3000 B, 100 B / 200 B
    bottom = LayerActivations({"a": 1000}, fwd_steps=(((), 5000),), bwd_steps=(((), 300),))
    top = LayerActivations({"b": 3000}, fwd_steps=(((), 100),), bwd_steps=(((), 200),))
    runs = [(bottom, 1), (top, 1)]
    # nothing sent: as without offloading, max(5000 - 3000, 100) and max(300 - 3000, 200)
    assert _kept_transients(runs, [[], []], 0) == _mixed_transients(runs) == (2000, 200)
    # the bottom layer sends 600 B, the top one 2000 B: the top keeps 1000 B, so the bottom layer's forward comes
    # 5000 - 1000 = 4000 B over the chunk's 400 + 1000 kept bytes: 5400 B = its own 400 kept + 5000 working
    assert _kept_transients(runs, [[600], [2000]], 0) == (4000, 200)
    # --activation-offload-fraction keeps the chunk's last groups on the GPU: 2000 B kept, the top layer's group
    assert _kept_transients(runs, [[600], [2000]], 2000) == (2000, 200)
    # two top layers of 3000 B sending [1500, 500] each, the fraction keeping the last 700 B (the last layer's 500
    # and 200 of its 1500): above the bottom layer 2 x 3000 - (2000 + 1300) = 2700 B stay
    assert _kept_transients([(bottom, 1), (top, 2)], [[600], [1500, 500], [1500, 500]], 700) == (2300, 200)


def test_offloading_a_module_the_te_layer_fuses_away_changes_nothing():
    """--offload-modules attn_norm on the TE spec, whose input norm is fused into linear_qkv: the layer's
    input_layernorm is an IdentityOp and _set_offload_modules leaves attn_norm off (transformer_layer.py, core
    0.19.2), so offloading moves nothing and every stage's numbers are those of the run without it, on a chunk of an
    MoE layer under a dense one too (before: pp1 and pp2 +640 B, the MoE layer's forward working set over the
    dense layer's saved bytes)."""
    from megatron_memguard import estimate, layout_from_flags
    flags = ("--transformer-impl transformer_engine --num-layers 8 --hidden-size 16 --num-attention-heads 1 "
             "--kv-channels 16 --ffn-hidden-size 8 --seq-length 8 --max-position-embeddings 8 --micro-batch-size 1 "
             "--global-batch-size 1 --pipeline-model-parallel-size 4 --tokenizer-type NullTokenizer --vocab-size 1000 "
             "--hidden-dropout 0.0 --attention-dropout 0.0 --bf16 --position-embedding-type rope --disable-bias-linear "
             "--num-experts 2 --moe-router-topk 1 --moe-ffn-hidden-size 8 --moe-token-dispatcher-type allgather "
             "--moe-router-pre-softmax --moe-layer-freq 2").split()

    def numbers(extra):
        est = estimate(layout_from_flags(flags + extra, world_size=4, megatron_version="0.19"))
        return [(s.peak_allocated_bytes, s.peak_phase, s.breakdown) for s in est.stages]
    assert numbers(["--fine-grained-activation-offloading", "--offload-modules", "attn_norm"]) == numbers([])
