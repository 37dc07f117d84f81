"""FP8 / FP4 in the estimate: the terms and the saved activations of a whole model, by hand from the
per-tensor formulas of tests/test_fp8.py (TE 2.11 storage, megatron-core FP8 rules) and Megatron-Bridge's
FP8 presets read end to end."""
import os
import textwrap

import pytest

from megatron_memguard import estimate, layout_from_flags
from megatron_memguard.cli.main import main
from megatron_memguard.errors import ConfigError
from megatron_memguard.estimator.activations import layer_activations
from megatron_memguard.gpus import lookup_gpu
from megatron_memguard.readers.detect import read_config_file
from megatron_memguard.resolve import resolve

from conftest import LLAMA31_8B

DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "terms")
# Llama-3.1-8B (HF config: h 4096, ffn 14336, 32 heads, 8 KV heads, head dim 128), TP 2 + SP, PP 2, seq 8192
BASE = LLAMA31_8B + ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--sequence-parallel",
                     "--use-distributed-optimizer", "--micro-batch-size", "1", "--global-batch-size", "64"]
T, TF, H = 4096, 8192, 4096          # tokens of the SP shard, of the TP region; hidden
CTX, F_T = 2048, 7168                # attention output and ffn width per TP rank
# GEMM weight elements per layer per rank: qkv [3072, 4096], proj [4096, 2048], fc1 [14336, 4096], fc2 [4096, 7168]
W = 3072 * 4096 + 4096 * 2048 + 14336 * 4096 + 4096 * 7168


def lay(*extra, version=None):
    return layout_from_flags(BASE + list(extra), world_size=16, megatron_version=version)


def terms(est, stage=0):
    return {t.name: t for t in est.stages[stage].terms}


@pytest.mark.parametrize("version", ["0.16.1", "0.19.2"])
def test_saved_gemm_inputs_per_layer(version):
    bf16 = layer_activations(lay(version=version)).saved
    fp8 = layer_activations(lay("--fp8-format", "hybrid", "--fp8-recipe", "tensorwise", version=version)).saved
    # layernorm_linear.py: the SP-local norm output kept quantized (rowwise, 1 B + a 512-byte scale block);
    # linear.py: fc2's input kept quantized (columnwise); linear_proj keeps the BF16 attention output the core
    # attention keeps (set_save_original_input: attention.py, core 0.16.1 and 0.19.2), no quantized copy
    assert fp8["qkv_input"] == T * H + 512 and fp8["fc1_input"] == T * H + 512
    assert fp8["fc2_input"] == TF * F_T + 512 and "fp8_proj_input" not in fp8
    assert bf16["fc2_input"] == 2 * TF * F_T and bf16["proj_input"] == fp8["proj_input"] == 2 * TF * CTX
    # net -T h - T h - Tf ffn/TP per layer (moe-fp8.md 2.5), + the three scale blocks
    assert sum(fp8.values()) - sum(bf16.values()) == -2 * T * H - TF * F_T + 3 * 512
    # delayed scaling (no save_original_input: TE asserts against Float8Quantizer) keeps the quantized copy,
    # [Tf, ctx] columnwise (Hopper: the transpose) = 16 MiB + 512 per layer
    delayed = layer_activations(lay("--fp8-format", "hybrid", "--fp8-recipe", "delayed", version=version)).saved
    assert delayed["fp8_proj_input"] == TF * CTX + 512 == 16 * 2**20 + 512
    assert sum(delayed.values()) - sum(fp8.values()) == TF * CTX + 512


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise", "mxfp8", "nvfp4"])
def test_linear_proj_backward_requantizes_its_bf16_input(recipe):
    # TE 2.11 module/linear.py _Linear.backward quantizes the saved BF16 input for the wgrad GEMM: a transient
    # of linear_proj's backward step (the mixer's first, after the pre-MLP norm's), where delayed scaling's saved
    # copy was. [Tf, ctx] = [8192, 2048] per rank; tensorwise both usages (Hopper: data + transpose)
    flags = ["--fp4-format", "e2m1"] if recipe == "nvfp4" else ["--fp8-format", "hybrid", "--fp8-recipe", recipe]
    L = lay(*flags, version="0.19.2")
    bf16 = layer_activations(lay(version="0.19.2"))
    fp8 = layer_activations(L)

    def proj_step(acts):
        return next(w for rel, w in acts.bwd_steps if "mlp_norm_input" in rel)

    requant = {"tensorwise": 2 * TF * CTX + 512, "blockwise": TF * CTX + 64 * 2048 * 4,
               "mxfp8": TF * CTX + 256 * 2048, "nvfp4": TF * CTX // 2 + 2048 * 512 + 512}[recipe]
    from megatron_memguard.estimator.fp8 import quantized_tensor
    r = "nvfp4" if recipe == "nvfp4" else recipe
    grad_out = quantized_tensor(r, TF, H, rowwise=True, columnwise=True).allocated    # grad_output_preprocess
    assert proj_step(fp8) - proj_step(bf16) == grad_out + requant


@pytest.mark.parametrize("gpu, per_weight", [("H100-80GB", 2), ("B200", 1)])
def test_weight_cache_hopper_and_blackwell(gpu, per_weight):
    est = estimate(lay("--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"), gpu=lookup_gpu(gpu))
    t = terms(est)
    # pp0 holds 16 layers; 4 GEMM weights each, one 512-byte scale block per cached weight
    assert t["fp8_weight_cache"].bytes == 16 * (per_weight * W + 4 * 512)
    # tensorwise: a one-element fp32 scale and amax per quantizer, 5 quantizers per GEMM
    assert t["fp8_scales"].bytes == 16 * 4 * 10 * 512
    assert t["parameters"].bytes == terms(estimate(lay(), gpu=lookup_gpu(gpu)))["parameters"].bytes


def test_primary_fp8_weights():
    bf16 = terms(estimate(lay()))
    t = terms(estimate(lay("--fp8-format", "hybrid", "--fp8-recipe", "tensorwise", "--fp8-param-gather")))
    # uint8 parameter buffer: 1 byte instead of 2 for each GEMM weight; TE keeps the Hopper transpose
    assert bf16["parameters"].bytes - t["parameters"].bytes == 16 * W
    assert t["fp8_weight_columnwise"].bytes == 16 * (W + 4 * 512)
    assert "fp8_weight_cache" not in t
    # the optimizer state is unchanged: fp32 shards of every parameter
    assert t["main_parameters"].bytes == bf16["main_parameters"].bytes


def test_first_last_layers_bf16_on_the_end_stages():
    est = estimate(lay("--fp8-format", "hybrid", "--fp8-recipe", "blockwise", "--first-last-layers-bf16"))
    # fp8_utils.is_first_last_bf16_layer: layer 0 (pp0) and layer 31 (pp1) stay BF16: 15 FP8 layers each
    one = terms(estimate(lay("--fp8-format", "hybrid", "--fp8-recipe", "blockwise")))["fp8_weight_cache"].bytes // 16
    assert terms(est, 0)["fp8_weight_cache"].bytes == 15 * one
    assert terms(est, 1)["fp8_weight_cache"].bytes == 15 * one


def test_every_fp8_term_is_documented():
    for extra in (["--fp8-recipe", "delayed"], ["--fp8-recipe", "tensorwise", "--fp8-param-gather"]):
        for st in estimate(lay("--fp8-format", "hybrid", *extra)).stages:
            for t in st.terms:
                assert os.path.exists(os.path.join(DOCS, t.name + ".md")), t.name


@pytest.mark.parametrize("extra, flag", [
    (["--fp8-format", "hybrid", "--first-last-layers-bf16"], "--first-last-layers-bf16"),
    (["--fp8-param-gather"], "--fp8-param-gather"),
    (["--fp8-format", "hybrid", "--fp4-format", "e2m1"], "--fp4-format"),
])
def test_rules_name_the_flag(capsys, extra, flag):
    code = main(["estimate", "--world-size", "16", "--", *BASE, *extra])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and flag in err[0]


def test_gpu_without_fp8(capsys):
    code = main(["estimate", "--world-size", "16", "--gpu", "A100-80GB", "--", *BASE, "--fp8-format", "hybrid"])
    err = capsys.readouterr().err
    assert code == 2 and "8.9" in err


def test_bridge_fp8_preset_is_estimated(tmp_path):
    from test_readers_bridge import FLAT
    p = tmp_path / "run_config.yaml"
    p.write_text(textwrap.dedent(FLAT.replace("bf16_mixed", "bf16_with_fp8_current_scaling_mixed")))
    L = resolve(read_config_file(str(p)), world_size=8)
    # the preset: tensorwise, first and last layer in BF16, primary FP8 weights (Bridge 0.6.2)
    assert (L.fp8, L.fp8_recipe, L.fp8_param_gather, L.first_last_layers_bf16) == ("hybrid", "tensorwise", True, True)
    names = {t.name for t in estimate(L).stages[0].terms}
    assert "fp8_weight_columnwise" in names and "fp8_weight_cache" not in names


PLAN = ["plan", "--gpus", "64", "--gpu", "H100-80GB", "--seq-length", "8192", "--global-batch-size", "512", "--json"]


def test_planner_searches_fp8_only_when_allowed(capsys):
    import json
    assert main([*PLAN, "--top", "40", "--", *LLAMA31_8B]) == 0
    plain = json.loads(capsys.readouterr().out)["layouts"]
    assert not any("fp8" in x["name"] or any("fp8" in f for f in x["megatron_flags"]) for x in plain)
    assert main([*PLAN, "--top", "40", "--fp8", "tensorwise", "--", *LLAMA31_8B]) == 0
    doc = json.loads(capsys.readouterr().out)
    fp8 = [x for x in doc["layouts"] if x["name"].endswith("fp8=tensorwise")]
    assert fp8 and all("FP8-tensorwise" in x["label"] for x in fp8)
    # printed with its flags, and the estimate behind it is the FP8 one (its layout says so)
    assert {"--fp8-format hybrid", "--fp8-recipe tensorwise"} <= set(fp8[0]["megatron_flags"])
    assert fp8[0]["layout"]["fp8_recipe"] == "tensorwise"
    # the same layout with FP8 off is searched too, and FP8 GEMMs make the FP8 one faster
    off = {x["name"].replace(",fp8=off", ""): x for x in doc["layouts"] if x["name"].endswith("fp8=off")}
    twin = off.get(fp8[0]["name"].replace(",fp8=tensorwise", ""))
    if twin is not None:
        assert fp8[0]["step_time_s"] < twin["step_time_s"]


def test_planner_fp8_needs_an_fp8_gpu(capsys):
    code = main([*PLAN[:4], "A100-80GB", *PLAN[5:], "--fp8", "tensorwise", "--", *LLAMA31_8B])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "--fp8" in err[0]


def test_planner_memory_bound_stays_below_the_fp8_estimate():
    from megatron_memguard.planner.bounds import layer_activation_bytes
    from megatron_memguard.planner.space import Candidate, model_shape
    from megatron_memguard.readers.megatron_flags import parse_megatron_flags
    probe = layout_from_flags(LLAMA31_8B + ["--micro-batch-size", "1"], world_size=1)
    shape = model_shape(probe, parse_megatron_flags(LLAMA31_8B))
    c = Candidate(2, 2, 1, 1, None, None, True, 1, "none", True, 4, 16, (16, 16), fp8="tensorwise")
    L = lay("--fp8-format", "hybrid", "--fp8-recipe", "tensorwise")
    assert layer_activation_bytes(shape, c) <= layer_activations(L).total


def test_real_megatron_namespace():
    # megatron-core 0.19.2's own parse_args (Python 3.12 suite): the FP8 dests as the hook reads them
    pytest.importorskip("megatron.training")
    import sys
    from megatron.training.arguments import parse_args
    from megatron_memguard import layout_from_megatron_args
    argv = ["pretrain_gpt.py", *BASE, "--fp8-format", "hybrid", "--fp8-recipe", "blockwise", "--fp8-param-gather",
            "--first-last-layers-bf16", "--num-layers-at-end-in-bf16", "2"]
    old, sys.argv = sys.argv, argv
    try:
        ns = parse_args(ignore_unknown_args=True)
    finally:
        sys.argv = old
    L = layout_from_megatron_args(ns, world_size=16)
    assert (L.fp8, L.fp8_recipe, L.fp8_param_gather, L.num_layers_at_start_in_bf16, L.num_layers_at_end_in_bf16) == \
        ("hybrid", "blockwise", True, 1, 2)


def test_moe_expert_inputs_and_weight_caches():
    # with mixture of experts modelled (estimator/layers/moe.py): TEGroupedLinear quantizes each local
    # expert's tokens (tex.split_quantize) and caches one weight workspace per local expert
    pytest.importorskip("megatron_memguard.estimator.layers.moe")
    moe = ["--num-layers", "4", "--hidden-size", "1024", "--ffn-hidden-size", "4096", "--num-attention-heads", "16",
           "--seq-length", "4096", "--max-position-embeddings", "4096", "--position-embedding-type", "rope",
           "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
           "--bf16", "--tensor-model-parallel-size", "2", "--sequence-parallel", "--use-distributed-optimizer",
           "--micro-batch-size", "4", "--global-batch-size", "32", "--vocab-size", "32000",
           "--tokenizer-type", "NullTokenizer", "--num-experts", "32", "--expert-model-parallel-size", "4",
           "--moe-ffn-hidden-size", "1024", "--moe-router-topk", "4", "--moe-token-dispatcher-type", "alltoall",
           "--moe-grouped-gemm", "--hidden-dropout", "0", "--attention-dropout", "0"]
    bf16 = layout_from_flags(moe, world_size=8)
    fp8 = layout_from_flags(moe + ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"], world_size=8)
    kind = fp8.stage_chunks(0)[0].kind_runs[0][0]
    a, b = layer_activations(bf16, True, bf16.stage_chunks(0)[0].kind_runs[0][0]).saved, layer_activations(fp8, True, kind).saved
    # T = 4096 x 4 / TP 2 = 8192 tokens, k = 4, ETP = TP = 2: N = T k ETP = 65,536 rows on E_l = 8 experts,
    # 8,192 each (a multiple of the FP8 alignment 16); h = 1024, F / ETP = 512
    N, El, h, F = 65536, 8, 1024, 512
    assert a["moe_expert_input"] - b["moe_expert_input"] == 2 * N * h - (N * h + El * 512)
    assert a["moe_expert_activations"] - b["moe_expert_activations"] == 2 * N * F - (N * F + El * 512)
    # weight workspaces (Hopper: data + transpose): 8 experts x (fc1 [1024, 1024] + fc2 [1024, 512]) + qkv + proj
    per_layer = 2 * (8 * (1024 * 1024 + 1024 * 512) + 1536 * 1024 + 1024 * 512) + (2 * 8 + 2) * 512
    assert terms(estimate(fp8))["fp8_weight_cache"].bytes == 4 * per_layer


def test_local_spec_runs_fp8_flags_in_bf16():
    # only TE modules quantize (fp8_autocast acts on TransformerEngineBaseModule); megatron-core's local
    # ColumnParallelLinear / RowParallelLinear ignore it
    local = ["--transformer-impl", "local"]
    a, b = estimate(lay(*local)), estimate(lay(*local, "--fp8-format", "hybrid"))
    assert a.stages[0].peak_allocated_bytes == b.stages[0].peak_allocated_bytes
    assert any("--transformer-impl local" in n for n in b.layout.notes)


@pytest.mark.parametrize("extra, param_bytes", [
    # MXFP8 primary weights: no parameter buffer of their own (the fp32 grad buffer doubles as their
    # all-gather buffer, param_and_grad_buffer.py shared_buffer): 2 bytes less per GEMM weight element
    (["--fp8-format", "e4m3", "--fp8-recipe", "mxfp8", "--fp8-param-gather", "--reuse-grad-buf-for-mxfp8-param-ag"], 0),
    # NVFP4 primary weights: the packed half byte in the uint8 buffer
    (["--fp4-format", "e2m1", "--fp4-param-gather"], 0.5),
])
def test_blackwell_primary_weights(extra, param_bytes):
    bf16 = terms(estimate(lay(), gpu=lookup_gpu("B200")))
    t = terms(estimate(lay(*extra), gpu=lookup_gpu("B200")))
    assert bf16["parameters"].bytes - t["parameters"].bytes == int(16 * W * (2 - param_bytes))
    assert "fp8_weight_cache" not in t and t["fp8_weight_columnwise"].bytes > 0
    # the weight's full TE storage minus what lives in the buffer: 2 + 1/16 (mxfp8) or 1 + 1/8 (nvfp4)
    # bytes per element with scales, minus the buffer's share
    per = {0: 2 + 2 / 32, 0.5: 1 + 2 / 16}[param_bytes] - param_bytes
    assert t["fp8_weight_columnwise"].bytes == pytest.approx(16 * W * per, rel=0.01)


def test_hopper_refuses_mxfp8(capsys):
    code = main(["estimate", "--world-size", "16", "--gpu", "H100-80GB", "--", *BASE, "--fp8-format", "e4m3",
                 "--fp8-recipe", "mxfp8"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("memguard: error: --gpu") and "Blackwell" in err[0]


def test_megatron_fsdp_primary_fp8_weights_keep_only_scales_outside_its_buffers():
    # Megatron-FSDP holds primary FP8 weights in its own uint8 buffers and drops TE's transposes after
    # each use (unless --keep-fp8-transpose-cache): one 512-byte scale block per GEMM weight remains
    fsdp = ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params",
            "--ckpt-format", "fsdp_dtensor"]
    t = terms(estimate(lay(*fsdp, "--fp8-format", "hybrid", "--fp8-recipe", "tensorwise", "--fp8-param-gather")))
    assert t["fp8_weight_columnwise"].bytes == 16 * 4 * 512
    assert "parameters" not in t and "fp8_weight_cache" not in t


# a small multi-latent attention model: 16 heads x v_head_dim 64, TP 2 + SP, seq 4096: linear_proj's input [4096, 512]
MLA = ["--num-layers", "4", "--hidden-size", "1024", "--num-attention-heads", "16", "--multi-latent-attention",
       "--q-lora-rank", "256", "--kv-lora-rank", "128", "--qk-head-dim", "64", "--qk-pos-emb-head-dim", "32",
       "--v-head-dim", "64", "--seq-length", "4096", "--max-position-embeddings", "4096", "--micro-batch-size", "1",
       "--global-batch-size", "8", "--tensor-model-parallel-size", "2", "--sequence-parallel", "--swiglu",
       "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--bf16", "--vocab-size", "32000",
       "--use-distributed-optimizer"]


@pytest.mark.parametrize("version", ["0.16.1", "0.19.2"])
@pytest.mark.parametrize("recipe", ["delayed", "blockwise"])
def test_mla_linear_proj_saved_input(recipe, version):
    # multi_latent_attention.py (core 0.16.1 and 0.19.2) sets save_original_input on linear_proj as attention.py
    # does: blockwise keeps the BF16 output [4096, 8 x 64] (proj_input, as in BF16) and quantizes it again in
    # linear_proj's backward (column-wise, 1x128 scales: data + fp32 [ceil(4096/128), round4(512)]); delayed keeps
    # its column-wise FP8 copy (data + a 512-byte scale block). MLA adds no quantized output gradients
    # (docs/assumptions.md), so linear_proj's backward step differs from BF16's by that copy alone.
    bf16 = layer_activations(layout_from_flags(MLA, world_size=2, megatron_version=version))
    L = layout_from_flags(MLA + ["--fp8-format", "hybrid", "--fp8-recipe", recipe], world_size=2,
                          megatron_version=version)
    fp8 = layer_activations(L)
    n = 4096 * 512
    assert fp8.saved["proj_input"] == bf16.saved["proj_input"] == 2 * n

    def proj_step(acts):
        return next(w for rel, w in acts.bwd_steps if "mlp_norm_input" in rel)

    if recipe == "delayed":
        assert fp8.saved["fp8_proj_input"] == n + 512
        assert proj_step(fp8) == proj_step(bf16)
    else:
        assert "fp8_proj_input" not in fp8.saved
        assert proj_step(fp8) - proj_step(bf16) == n + 32 * 512 * 4
