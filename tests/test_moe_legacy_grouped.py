"""--moe-use-legacy-grouped-gemm (megatron-core 0.16.1; GroupedMLP and the option are gone from 0.17.0): with
--moe-grouped-gemm the experts are GroupedMLP (transformer/moe/experts.py), two parameters for all local experts,
weight1 [h, E_l g F / ETP] and weight2 [E_l F / ETP, h], the same elements as TE's per-expert grouped weights.
Its forward: grouped_gemm's ``gmm`` keeps its input, ``activation_func_with_probs`` (a jit_fuser = torch.compile
function) keeps its inputs (fc1's output and the probs), the second ``gmm`` keeps fc2's input; each ``gmm``'s
backward makes the weight's gradient as a new tensor. Rules: no bias (asserted at build), bf16 (asserted at the
first forward), no moe_act recompute under FP8 / FP4, not with --delay-wgrad-compute (TransformerConfig).

The first test builds the model with megatron-core 0.16.1's own GroupedMLP on CPU (tests/e2e/moe_rank_params.py).
"""
from __future__ import annotations

import json
import os
import sys

import pytest

from build_util import run_script   # tests/e2e scripts through a fork server (torch and megatron imported once)

from megatron_memguard import estimate, layout_from_flags
from megatron_memguard.errors import ConfigError, ConfigErrors
from megatron_memguard.estimator.layers.moe import moe_activations
from megatron_memguard.estimator.params import chunk_params

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# 2 layers, h 64, SwiGLU, 4 experts of F 96, top-2, TP 2 with SP, EP 2: 2 local experts a rank
FLAGS = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --kv-channels 16 --ffn-hidden-size 128 "
         "--seq-length 64 --max-position-embeddings 64 --micro-batch-size 2 --global-batch-size 2 "
         "--tensor-model-parallel-size 2 --sequence-parallel --tokenizer-type NullTokenizer --vocab-size 1024 --bf16 "
         "--position-embedding-type rope --normalization RMSNorm --num-experts 4 --moe-router-topk 2 "
         "--expert-model-parallel-size 2 --expert-tensor-parallel-size 1 --moe-ffn-hidden-size 96 "
         "--moe-token-dispatcher-type alltoall --swiglu --disable-bias-linear --untie-embeddings-and-output-weights "
         "--moe-grouped-gemm").split()
LEGACY = ["--moe-use-legacy-grouped-gemm"]
H, F, EL = 64, 96, 2


def _layout(extra=(), version="0.16"):
    return layout_from_flags(FLAGS + list(extra), world_size=2, megatron_version=version)


def _expert_params(L):
    return [p for p in chunk_params(L, L.stage_chunks(0)[0]) if p.expert]


def test_parameters_are_megatron_cores_grouped_mlp():
    import importlib.util
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        pytest.skip("megatron-core is not installed")
    from megatron.core import package_info
    if not package_info.__version__.startswith("0.16"):
        pytest.skip("GroupedMLP is megatron-core 0.16's (the 3.11 venv)")
    L = _layout(LEGACY)
    job = dict(num_layers=2, hidden_size=H, heads=4, kv_channels=16, groups=None, ffn=128, bias=False, glu=True,
               norm="RMSNorm", tp=2, pp=1, vpp=None, ep=2, etp=1, experts=4, moe_ffn=F, topk=2, freq=1,
               shared_ffn=None, shared_gate=False, expert_bias=False, untied=True, seq=64, mtp=None, mla=None,
               first=None, last=None, acc_emb=False, acc_loss=False, layout=None,
               vocab=L.padded_vocab_size,     # as megatron.training pads it (NullTokenizer's EOD, TP x 128)
               ranks=[[0, None, 0, 0, 0], [0, None, 1, 1, 0]], legacy_grouped=True)
    env = dict(os.environ, PYTHONPATH=ROOT, MEMGUARD_E2E_PORT="29593", MASTER_PORT="29593")
    out = run_script([sys.executable, os.path.join(ROOT, "tests", "e2e", "moe_rank_params.py"), json.dumps([job])],
                     env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    built = json.loads(out.stdout.strip().splitlines()[-1])[0]
    mine = chunk_params(L, L.stage_chunks(0)[0])
    for r in built:
        assert r["params"] == sum(p.numel for p in mine)
        # 2 MoE layers x (weight1, weight2); 2 layers x 2 local experts x (2 F h + F h) = 73,728 elements
        assert r["expert_tensors"] == len(_expert_params(L)) == 4
        assert r["tags"]["expert"] == sum(p.numel for p in _expert_params(L)) == 2 * EL * 3 * F * H == 73_728
        # EP 2: GroupedMLP marks its weights allreduce=False, so DDP puts them in the expert buffer
        assert r["tags"]["expert_buffer"] == 73_728


def test_same_elements_as_the_te_grouped_experts():
    legacy, te = _expert_params(_layout(LEGACY)), _expert_params(_layout())
    assert sum(p.numel for p in legacy) == sum(p.numel for p in te) and (len(legacy), len(te)) == (4, 8)
    assert [(p.name.rsplit(".", 1)[-1], p.numel // p.cols, p.cols) for p in legacy[:2]] == [
        ("weight1", H, EL * 2 * F), ("weight2", EL * F, H)]


def test_activations_by_hand():
    L = _layout(LEGACY)
    a = moe_activations(L, L.moe)
    N = 64 * 2 // 2 * 2          # T = s b / TP = 64, k = 2, ETP 1: N = 128
    assert a.rows == N
    # the compiled activation keeps fc1's output [N, 2F] and gmm keeps fc2's input [N, F], bf16
    assert a.saved["moe_expert_activations"] == 2 * N * 3 * F
    # moe_act recompute (CheckpointWithoutOutput) drops fc2's input
    Lr = _layout(LEGACY + ["--recompute-granularity", "selective", "--recompute-modules", "moe_act"])
    assert moe_activations(Lr, Lr.moe).saved["moe_expert_activations"] == 2 * N * 2 * F
    # the backward makes weight2's and weight1's gradients as new bf16 tensors: [E_l F, h] and [h, E_l 2F]
    te = moe_activations(_layout(), _layout().moe)
    assert a.bwd_steps[0][1] - te.bwd_steps[0][1] == 2 * EL * F * H
    assert a.bwd_steps[2][1] - te.bwd_steps[2][1] == 2 * EL * 2 * F * H
    assert estimate(L).stages[0].peak_allocated_bytes > 0


def _err(extra, version="0.16") -> str:
    with pytest.raises((ConfigError, ConfigErrors)) as e:
        _layout(extra, version)
    return str(e.value)


def test_rules_name_the_flag():
    assert _err(LEGACY, "0.19").startswith("--moe-use-legacy-grouped-gemm: needs megatron-core < 0.17")
    flags = [f for f in FLAGS if f != "--disable-bias-linear"] + LEGACY + ["--expert-tensor-parallel-size", "1"]
    with pytest.raises((ConfigError, ConfigErrors)) as e:
        layout_from_flags(flags, world_size=2, megatron_version="0.16")
    assert "--moe-use-legacy-grouped-gemm: needs --disable-bias-linear" in str(e.value)
    assert "needs --bf16" in _err(LEGACY + ["--fp16"]) or "--bf16" in _err(LEGACY + ["--fp16"])
    assert "moe_act" in _err(LEGACY + ["--fp8-format", "hybrid", "--recompute-granularity", "selective",
                                       "--recompute-modules", "moe_act"])


def test_without_grouped_gemm_it_does_nothing():
    flags = [f for f in FLAGS if f != "--moe-grouped-gemm"]
    plain = layout_from_flags(flags, world_size=2, megatron_version="0.16")
    L = layout_from_flags(flags + LEGACY, world_size=2, megatron_version="0.16")
    assert not L.moe.moe_use_legacy_grouped_gemm and any("no effect" in n for n in L.notes)
    assert estimate(L).stages[0].peak_allocated_bytes == estimate(plain).stages[0].peak_allocated_bytes


def _terms(extra):
    return {t.name: t.bytes for t in estimate(_layout(extra)).stages[0].terms}


def test_fp8_runs_the_experts_in_bf16():
    """megatron-core 0.16.1 builds GroupedMLP under FP8 (nothing refuses it but moe_act recompute; config.bf16 holds
    with --bf16 --fp8-format) and its grouped_gemm ``gmm`` is no TE module: the experts' GEMMs, inputs and weights
    stay BF16, attention (and any shared expert) runs FP8."""
    L = _layout(LEGACY + ["--fp8-format", "hybrid"])
    assert any("legacy GroupedMLP runs its expert GEMMs in BF16" in n for n in L.notes)
    fp8_legacy, bf16_legacy, fp8_te = _terms(LEGACY + ["--fp8-format", "hybrid"]), _terms(LEGACY), \
        _terms(["--fp8-format", "hybrid"])
    # the experts keep what the BF16 GroupedMLP keeps (BF16 gmm inputs, no Fp8Padding)
    assert fp8_legacy["moe_layer_activations"] == bf16_legacy["moe_layer_activations"]
    assert fp8_te["moe_layer_activations"] != bf16_legacy["moe_layer_activations"]
    # TE's cached delayed-scaling copies of the experts' weights are gone: per layer E_l x (2F h + F h) elements,
    # FP8 data + transpose on Hopper (2 B a element), and each of the 2 x E_l x 2 copies' fp32 scale-inverse in a
    # 512-byte block of the caching allocator
    assert fp8_te["fp8_weight_cache"] - fp8_legacy["fp8_weight_cache"] == 2 * EL * 3 * F * H * 2 + 2 * EL * 2 * 512
    # what stays: the attention's qkv [3 h / TP, h] and proj [h, h / TP] of both layers, same storage
    assert fp8_legacy["fp8_weight_cache"] == 2 * (3 * H // 2 * H + H * H // 2) * 2 + 2 * 2 * 512
