"""--moe-latent-size (latent MoE, megatron-core 0.16.1 and 0.19.2 transformer/moe/moe_layer.py): the router reads
the full hidden states; ``fc1_latent_proj`` [latent, h] projects them down before the dispatch and
``fc2_latent_proj`` [h, latent] back up after the combine, both TELinear parallel_mode "duplicated" (whole on every
TP rank); the dispatcher and the routed experts work at the latent width (mlp.py / experts.py: fc1 [g F, latent],
fc2 [latent, F]); the shared experts stay on the full hidden states. validate_args: a positive size;
MoELayer.preprocess: no shared-expert overlap in training; GroupedMLP asserts no latent.

The first test builds the model with megatron-core's own MoELayer on CPU (tests/e2e/moe_rank_params.py, the TE
projections by the MLA down projections' stand-in), in this interpreter's era and the other venv's.
"""
from __future__ import annotations

import json
import os
import sys

import pytest

from build_util import run_script   # tests/e2e scripts through a fork server (torch and megatron imported once)

from megatron_memguard import estimate, layout_from_flags
from megatron_memguard.errors import ConfigError, ConfigErrors, NotModelledError
from megatron_memguard.estimator.layers.moe import moe_activations
from megatron_memguard.estimator.params import chunk_params

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# 2 layers, h 64, SwiGLU, 4 experts of F 96 at latent 32, top-2, TP 2 with SP, EP 2: 2 local experts a rank
FLAGS = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --kv-channels 16 --ffn-hidden-size 128 "
         "--seq-length 64 --max-position-embeddings 64 --micro-batch-size 2 --global-batch-size 2 "
         "--tensor-model-parallel-size 2 --sequence-parallel --tokenizer-type NullTokenizer --vocab-size 1024 --bf16 "
         "--position-embedding-type rope --normalization RMSNorm --num-experts 4 --moe-router-topk 2 "
         "--expert-model-parallel-size 2 --expert-tensor-parallel-size 1 --moe-ffn-hidden-size 96 "
         "--moe-token-dispatcher-type alltoall --swiglu --disable-bias-linear --untie-embeddings-and-output-weights").split()
LATENT = ["--moe-latent-size", "32"]
H, F, LAT, EL = 64, 96, 32, 2


def _layout(extra=(), version=None):
    return layout_from_flags(FLAGS + list(extra), world_size=2, megatron_version=version)


def _pythons() -> list[str]:
    out = [sys.executable]
    other = os.environ.get("MEMGUARD_PY312") or os.path.join(ROOT, ".venv312", "bin", "python")
    if os.path.exists(other) and os.path.realpath(other) != os.path.realpath(sys.executable):
        out.append(other)
    return out


@pytest.mark.parametrize("which", [0, 1])
def test_parameters_are_megatron_cores(which):
    pythons = _pythons()
    if which >= len(pythons):
        pytest.skip("no second Python with megatron-core ($MEMGUARD_PY312, .venv312)")
    py = pythons[which]
    ver = run_script([py, "-c", "from megatron.core import package_info as p; print(p.__version__)"])
    if ver.returncode:
        pytest.skip("megatron-core is not installed")
    era = "0.16" if ver.stdout.startswith("0.16") else "0.19"
    L = _layout(LATENT, era)
    job = dict(num_layers=2, hidden_size=H, heads=4, kv_channels=16, groups=None, ffn=128, bias=False, glu=True,
               norm="RMSNorm", tp=2, pp=1, vpp=None, ep=2, etp=1, experts=4, moe_ffn=F, topk=2, freq=1,
               shared_ffn=None, shared_gate=False, expert_bias=False, untied=True, seq=64, mtp=None, mla=None,
               first=None, last=None, acc_emb=False, acc_loss=False, layout=None, vocab=L.padded_vocab_size,
               latent=LAT, ranks=[[0, None, 0, 0, 0], [0, None, 1, 1, 0]])
    env = dict(os.environ, PYTHONPATH=ROOT, MEMGUARD_E2E_PORT=f"2959{6 + which}", MASTER_PORT=f"2959{6 + which}")
    out = run_script([py, os.path.join(ROOT, "tests", "e2e", "moe_rank_params.py"), json.dumps([job])],
                     env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    mine = chunk_params(L, L.stage_chunks(0)[0])
    for r in json.loads(out.stdout.strip().splitlines()[-1])[0]:
        assert r["params"] == sum(p.numel for p in mine)
        # routed experts at the latent width: 2 layers x 2 local experts x (2 F + F) x 32 = 36,864
        assert r["tags"]["expert"] == sum(p.numel for p in mine if p.expert) == 2 * EL * 3 * F * LAT == 36_864


def test_projections_by_hand():
    plain, lat = chunk_params(_layout(), _layout().stage_chunks(0)[0]), chunk_params(
        _layout(LATENT), _layout(LATENT).stage_chunks(0)[0])
    names = {p.name.split("layers.0.")[-1]: p.numel for p in lat if "layers.0." in p.name}
    assert names["mlp.fc1_latent_proj.weight"] == names["mlp.fc2_latent_proj.weight"] == LAT * H == 2_048
    # per layer: + 2 projections, experts (2 F + F) x (latent - h) x E_l
    assert sum(p.numel for p in lat) - sum(p.numel for p in plain) == 2 * (2 * LAT * H + EL * 3 * F * (LAT - H))


def test_activations_by_hand():
    L0, L1 = _layout(), _layout(LATENT)
    a0, a1 = moe_activations(L0, L0.moe), moe_activations(L1, L1.moe)
    T, N = 64, 128                # T = s b / TP = 64 tokens a rank; N = T k = 128
    assert a1.rows == N
    # the dispatched tokens [N, latent] bf16 and their bf16 probs
    assert a1.saved["moe_expert_input"] == 2 * N * LAT + 2 * N
    assert a0.saved["moe_expert_input"] - a1.saved["moe_expert_input"] == 2 * N * (H - LAT)
    # fc2_latent_proj keeps the combined tokens [T, latent]
    assert a1.saved["moe_latent_projections"] == 2 * T * LAT
    assert a1.saved["moe_expert_activations"] == a0.saved["moe_expert_activations"]   # F-wide, as before
    assert estimate(L1).stages[0].peak_allocated_bytes < estimate(L0).stages[0].peak_allocated_bytes


def test_rules_and_refusals_name_the_flag():
    with pytest.raises((ConfigError, ConfigErrors)) as e:
        _layout(["--moe-latent-size", "0"])
    assert str(e.value).startswith("--moe-latent-size: must be greater than zero")
    with pytest.raises((ConfigError, ConfigErrors)) as e:
        _layout(LATENT + ["--moe-shared-expert-intermediate-size", "64", "--moe-shared-expert-overlap"])
    assert str(e.value).startswith("--moe-shared-expert-overlap: does not work with --moe-latent-size")
    # megatron-core 0.16.1: the projections defer their weight gradients (TELinear with config.delay_wgrad_compute)
    # but MoELayer.backward_dw never runs them (0.17.1 added the calls): an error naming the flag
    with pytest.raises((ConfigError, ConfigErrors)) as e:
        _layout(LATENT + ["--overlap-moe-expert-parallel-comm", "--delay-wgrad-compute"], "0.16")
    assert str(e.value).startswith("--delay-wgrad-compute: does not work with --moe-latent-size in megatron-core 0.16")


OVERLAP = ["--overlap-moe-expert-parallel-comm"]


@pytest.mark.parametrize("version", ["0.17.1", "0.18.2", "0.19"])
def test_delayed_wgrad_of_the_latent_projections_by_hand(version):
    # MoELayer.backward_dw (core 0.17.1 to 0.19.2): the mlp node's backward_dw (after the experts' backward,
    # TransformerLayerSchedulePlan.run) runs the experts' and fc2_latent_proj's deferred wgrads; the pre-dispatch
    # node's (_BackwardDWWrapper, the layer's end) fc1_latent_proj's
    from megatron_memguard.estimator.activations import layer_activations
    from megatron_memguard.partition import MLP_MOE, LayerKind
    kind = LayerKind("attention", MLP_MOE)
    delay, plain = (layer_activations(_layout(LATENT + OVERLAP + x, version), True, kind)
                    for x in (["--delay-wgrad-compute"], []))
    dense_delay = layer_activations(_layout(OVERLAP + ["--delay-wgrad-compute"], version), True, kind)
    assert delay.saved == plain.saved and len(delay.bwd_steps) == len(plain.bwd_steps) + 2
    # T = 64 x 2 / TP 2 = 64 tokens, N = T k = 128 rows, bf16. The experts' end: the expert input gradient [N, lat],
    # fc1's output gradient [N, 2F], fc2's output gradient [N, lat] and input [N, F] (beside the fc1 step's
    # [N, 2F] + [N, lat]), and fc2_latent_proj's output gradient [T, h]
    e, T, N = 2, 64, 128
    assert delay.bwd_steps[3][1] - plain.bwd_steps[2][1] == e * N * (LAT + F) + e * T * H == 40_960
    # the layer's end: the attention's linears as without latent, plus fc1_latent_proj's input [T, h] and output
    # gradient [T, lat] ("duplicated": the sequence-parallel tokens); fc2_latent_proj's ran before
    assert delay.bwd_steps[-1][1] - dense_delay.bwd_steps[-1][1] == e * T * (H + LAT) == 12_288
    # without the deferral, latent MoE under the overlap is the overlap's schedule at the latent width: the
    # dispatched tokens [N, lat] and their probs [N] (bf16 without --moe-router-dtype)
    assert plain.saved["moe_expert_input"] == e * N * LAT + e * N


def test_latent_under_the_overlap_on_core_0_16():
    L = _layout(LATENT + OVERLAP, "0.16")
    assert L.moe.moe_latent_size == LAT and L.moe.overlap_moe_expert_parallel_comm


TENSORWISE = ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"]


def test_fp8_latent_weight_caches_by_hand():
    """FP8 tensorwise on an H100 (Hopper keeps a transpose): TE caches each BF16 GEMM weight as row-wise + column-wise
    FP8 data (1 B each) and one fp32 scale_inv, every allocation rounded up to 512 B. Per layer on a TP rank:
    linear_qkv [96, 64], linear_proj [64, 32], fc1_latent_proj [32, 64] and fc2_latent_proj [64, 32] (TELinear
    "duplicated", MoELayer.__init__, core 0.16.1 and 0.19.2) and 2 local experts' fc1 [192, 32] and fc2 [32, 96]
    (at the latent width 32): 30,720 elements, 8 weights -> 2 x 30,720 + 8 x 512 = 65,536 B; 2 layers 131,072 B,
    18,432 B of it the latent projections' (2 x (2 x 4,096 + 2 x 512))."""
    from megatron_memguard.gpus import lookup_gpu
    terms = {t.name: t.bytes for t in estimate(_layout(LATENT + TENSORWISE, "0.19"), gpu=lookup_gpu("H100"))
             .stages[0].terms}
    assert terms["fp8_weight_cache"] == 2 * (2 * (96 * 64 + 64 * 32 + 32 * 64 + 64 * 32 + 2 * (192 * 32 + 32 * 96))
                                             + 8 * 512) == 131_072


@pytest.mark.parametrize("recompute", [[], ["--recompute-granularity", "selective", "--recompute-modules", "layernorm"]])
def test_fp8_latent_saved_inputs_by_hand(recompute):
    """FP8 tensorwise (H100): a quantized GEMM keeps its input's column-wise FP8 data (the transpose, 1 B an element)
    and a 512 B scale_inv. T = s b / TP = 64 tokens. fc2_latent_proj keeps [64, 32] (2,048 + 512 B) instead of the
    BF16 4,096 B; fc1_latent_proj a copy of the pre-MLP norm's output [64, 64] (4,096 + 512 B), also under 'layernorm'
    recompute (set_for_recompute_pre_mlp_layernorm makes only the shared experts' fc1 save its original input,
    moe_layer.py core 0.19.2). The grouped experts keep the dispatched tokens at the latent width: N = 128 rows over
    2 local experts, 64 each (a multiple of TE's 16-token alignment): 2 x ([32, 64] 2,048 + 512) + the BF16 probs
    128 x 2 B = 5,376 B (the hidden width 64 would give 9,472)."""
    from megatron_memguard.estimator.activations import layer_activations
    from megatron_memguard.partition import model_kind_runs
    L = _layout(LATENT + TENSORWISE + recompute, "0.19")
    kind = model_kind_runs(L)[0][0]
    saved = layer_activations(L, kind=kind).saved
    assert saved["moe_latent_projections"] == (64 * 32 + 512) + (64 * 64 + 512) == 7_168
    assert saved["moe_expert_input"] == 2 * (32 * 64 + 512) + 128 * 2 == 5_376


def test_fp8_latent_shape_rules_name_the_latent_size():
    """MXFP8 quantizes in 32-element blocks along every dimension (TE 2.11 MXFP8_BLOCK_SCALING_SIZE): a latent width
    of 48 gives fc1_latent_proj [48, 64] and the experts' fc1 [192, 48], not multiples of 32: the flag named is
    --moe-latent-size; 64 passes."""
    with pytest.raises((ConfigError, ConfigErrors)) as e:
        _layout(["--moe-latent-size", "48", "--fp8-format", "e4m3", "--fp8-recipe", "mxfp8"], "0.19")
    msg = str(e.value)
    assert msg.startswith("--moe-latent-size: with --fp8-recipe mxfp8:") and "(48) are not a multiple of 32" in msg
    L = _layout(["--moe-latent-size", "64", "--fp8-format", "e4m3", "--fp8-recipe", "mxfp8"], "0.19")
    assert L.moe.moe_latent_size == 64


def test_allgather_gathers_latent_tokens_by_hand():
    """The allgather dispatcher gathers what fc1_latent_proj made (MoELayer.preprocess runs the projection before
    dispatch_preprocess; token_dispatcher.py MoEAllGatherTokenDispatcher.token_dispatch gathers the hidden states
    over the TP x EP group into megatron's GlobalMemoryBuffer, core 0.16.1 and 0.19.2): [T x ETP x EP, latent],
    T = s b / TP = 64, ETP x EP = 2: 128 x 32 x 2 B = 8 KiB, half of the h-wide 16 KiB; the experts' input is the
    balanced N = 128 gathered tokens x k 2 x 2 of the 4 experts local = 128 latent-wide rows."""
    from megatron_memguard.estimator.layers.moe import global_buffer_request
    L0 = _layout(["--moe-token-dispatcher-type", "allgather"])
    L1 = _layout(LATENT + ["--moe-token-dispatcher-type", "allgather"])
    assert global_buffer_request(L1, L1.moe) == 64 * 2 * LAT * 2 == 8_192
    assert global_buffer_request(L0, L0.moe) == 64 * 2 * H * 2
    a0, a1 = moe_activations(L0, L0.moe), moe_activations(L1, L1.moe)
    assert a1.rows == a0.rows == 128
    assert a0.saved["moe_expert_input"] - a1.saved["moe_expert_input"] == 2 * 128 * (H - LAT)
    assert a1.saved["moe_latent_projections"] == 2 * 64 * LAT
    assert a1.saved["moe_permute_maps"] == a0.saved["moe_permute_maps"]      # routing metadata: width-free


def test_deepep_buffer_at_the_latent_width_by_hand():
    """DeepEP's NVLink buffer is sized from the dispatched tokens' hidden bytes (fused_a2a.get_buffer(group,
    get_hidden_bytes(x)), x the latent-wide tokens): Config::get_nvl_buffer_size_hint with 20 SMs (10 channels),
    2 NVLink peers, 1 RDMA rank, 256 receive tokens of latent x 2 B + 8 + 128 x (8 + 4 + 4) B of metadata, plus
    (2 x 1 + 3) int32 per channel and peer, rounded up to 128 B."""
    from megatron_memguard.estimator.layers.moe import deepep_buffer_bytes
    L = _layout(LATENT + ["--moe-token-dispatcher-type", "flex", "--moe-enable-deepep"], "0.19")
    per = (2 * 1 + 3) * 4 + 256 * (LAT * 2 + 8 + 128 * 16)
    assert deepep_buffer_bytes(L, L.moe) == -(-10 * 2 * per // 128) * 128 == 10_854_912
    a = moe_activations(L, L.moe)
    assert a.saved["moe_latent_projections"] == 2 * 64 * LAT


def test_megatron_fsdp_expert_groups_at_the_latent_width():
    """Under Megatron-FSDP the routed experts' groups take their per-rank shapes (TEGroupedMLP / SequentialMLP,
    core 0.16.1 and 0.19.2: fc1 [g F / ETP, latent], fc2 [latent, F / ETP]); the latent projections are dense
    [latent, h] and [h, latent] (duplicated: whole on every TP rank), like MLA's down projections."""
    from megatron_memguard.estimator.fsdp_layout import _layer_shapes
    from megatron_memguard.partition import LayerKind
    L = _layout(LATENT + ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params",
                          "--use-distributed-optimizer", "--no-gradient-accumulation-fusion", "--ckpt-format",
                          "fsdp_dtensor"], "0.19")
    kind = next(k for c in L.chunks for k, _ in c.kind_runs if k.mlp == "moe")
    assert isinstance(kind, LayerKind)
    dense, experts = _layer_shapes(L, kind)
    assert sorted(set(experts)) == sorted({(2 * F, LAT), (LAT, F)})
    assert (LAT, H) in dense and (H, LAT) in dense
    est = estimate(L)
    assert est.stages[0].peak_allocated_bytes > 0


def test_experts_wgrad_beside_the_dispatch_at_the_latent_width():
    # --overlap-dispatch-backward-with-experts-wgrad (core 0.19.2): only TEGroupedLinear defers (its
    # delay_wgrad_compute reads the flag; the latent projections' TELinear does not), so the dispatch step keeps
    # fc1's input [N, lat], its output gradient [N, 2F], fc2's input [N, F] and output gradient [N, lat]
    from megatron_memguard.estimator.activations import layer_activations
    from megatron_memguard.partition import MLP_MOE, LayerKind
    kind = LayerKind("attention", MLP_MOE)
    a, b = (layer_activations(_layout(LATENT + x, "0.19"), True, kind)
            for x in (["--overlap-dispatch-backward-with-experts-wgrad"], []))
    e, N = 2, 128
    diff = [wa - wb for (_, wa), (_, wb) in zip(a.bwd_steps, b.bwd_steps)]
    assert diff == [0, 0, 0, e * N * (2 * LAT + 2 * F + F)] + [0] * (len(diff) - 4)
