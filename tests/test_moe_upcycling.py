"""--moe-use-upcycling (megatron/training training.py setup_model_and_optimizer and
megatron/core/transformer/moe/upcycling_utils.py, megatron-core 0.16.1; 0.17 to 0.19 fail at start-up): the training peak is an ordinary
MoE run's; the start-up figure holds the MoE model's parameters, gradient buffer and fp32 main parameters, a dense
model (FFN x --moe-upcycling-granularity, no experts, EP 1) wrapped in DDP, and the deep copies of both state dicts
_convert_to_moe_state_dict makes; the verdict weighs the larger of the two."""
from __future__ import annotations

import pytest

from megatron_memguard import estimate, layout_from_flags
from megatron_memguard.errors import ConfigError, ConfigErrors, NotModelledError
from megatron_memguard.estimator.states import stage_states

# 4 layers, h 256, SwiGLU, PP 2 (2 layers a stage), 8 experts of F 512, EP 2 (4 local experts), granularity 2: the
# dense model's FFN is 1024 x 2 = 2048
BASE = ("--num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 512 --max-position-embeddings 512 "
        "--micro-batch-size 1 --global-batch-size 16 --pipeline-model-parallel-size 2 --vocab-size 32000 "
        "--tokenizer-type NullTokenizer --bf16 --position-embedding-type rope --swiglu --normalization RMSNorm "
        "--disable-bias-linear --untie-embeddings-and-output-weights --use-distributed-optimizer "
        "--ffn-hidden-size 1024").split()
MOE = ("--num-experts 8 --moe-router-topk 2 --expert-model-parallel-size 2 --moe-ffn-hidden-size 512 "
       "--moe-token-dispatcher-type alltoall --moe-grouped-gemm").split()
UP = ["--moe-use-upcycling", "--moe-upcycling-granularity", "2", "--save", "/ckpt/moe"]
V, H = 32128, 256        # NullTokenizer's 32000 + 1 (eod) padded to a multiple of 128


def _layout(extra=(), version="0.16", base=BASE, moe=MOE):
    return layout_from_flags(list(base) + list(moe) + list(extra), world_size=4, megatron_version=version)


def test_startup_terms_by_hand():
    L = _layout(UP)
    assert L.moe.moe_use_upcycling and L.moe.moe_upcycling_granularity == 2
    est = estimate(L)
    attn = 3 * H * H + H * H + H             # linear_qkv (+ its norm) and linear_proj
    dense_layer = attn + H + 2 * 2048 * H + H * 2048                        # pre-MLP norm, fc1 [2 x 2048, h], fc2
    moe_layer = attn + H + 8 * H + 4 * (2 * 512 * H + H * 512)              # router [8, h], 4 local experts
    for s in est.stages:
        terms = {t["name"]: t["bytes"] for t in s.startup["terms"]}
        head = V * H + (H if s.pp_rank == 1 else 0)                          # embedding, or final norm + output
        dense_params, moe_params = 2 * dense_layer + head, 2 * moe_layer + head
        assert stage_states(L, s.pp_rank).parameters == moe_params
        # both state dicts deep-copied on the GPU in bf16
        assert terms["upcycling_state_dict_copies"] == 2 * (dense_params + moe_params)
        # the dense model as megatron/training builds it: the same flags without the experts, FFN 2048
        dense = stage_states(layout_from_flags(list(BASE[:-2]) + ["--ffn-hidden-size", "2048"], world_size=4,
                                               megatron_version="0.16"), s.pp_rank)
        assert dense.parameters == dense_params
        assert terms["upcycling_dense_model"] == dense.param_bytes + dense.grad_bytes
        # the MoE model: the training estimate's parameters, gradient buffer and fp32 main parameters (no moments)
        b = s.breakdown
        assert terms["upcycling_moe_model_state"] == b["parameters"] + b["gradient_buffer"] + b["main_parameters"]
        assert s.startup["device_total_bytes"] == (s.startup["peak_reserved_bytes"] + b["cuda_context"]
                                                   + b["nccl_buffers"])
        assert s.required_device_bytes == max(s.device_total_bytes, s.startup["device_total_bytes"])
    assert estimate(L, gpu_memory=80 << 30).verdict == "fits"
    # without upcycling the same run has no start-up figure and the same training peak
    plain = estimate(_layout())
    assert [s.device_total_bytes for s in plain.stages] == [s.device_total_bytes for s in est.stages]
    assert all(s.startup is None for s in plain.stages)


def test_the_verdict_weighs_the_startup_when_it_is_larger():
    """A large vocabulary, full recomputation and a short sequence: per parameter the start-up holds about 18 bytes
    (the MoE model's 2 + 4 + 4 / DP, the dense model's 2 + 4, two bf16 copies) against training's 12 (2 + 4 + 12 /
    DP) plus little activation memory. A GPU sized between the training peak and the start-up figure makes the
    verdict follow the start-up."""
    L = _layout(UP + ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers",
                      "1", "--seq-length", "64", "--max-position-embeddings", "64", "--hidden-size", "1024",
                      "--num-attention-heads", "16", "--vocab-size", "128000"])
    est = estimate(L)
    s = max(est.stages, key=lambda x: x.startup["device_total_bytes"])
    assert s.startup["device_total_bytes"] > s.device_total_bytes
    gpu = (s.startup["device_total_bytes"] + max(x.device_total_bytes for x in est.stages)) // 2
    tight = estimate(L, gpu_memory=gpu, threshold=1.0)
    assert tight.verdict == "will not fit"
    assert tight.peak_device_bytes == max(x.required_device_bytes for x in tight.stages)


def test_rules_name_the_flag():
    def error(extra, version="0.16", moe=MOE):
        with pytest.raises((ConfigError, ConfigErrors, NotModelledError)) as e:
            _layout(extra, version, moe=moe)
        return str(e.value)
    # validate_args (0.16.1 to 0.19.2 arguments.py)
    assert error(UP[:3]).startswith("--moe-use-upcycling: needs --save")
    # upcycle_state_dict swaps its arguments for several model chunks (upcycling_utils.py)
    assert "virtual pipeline" in error(UP + ["--num-virtual-stages-per-pipeline-rank", "2"])
    # _get_config: the dense FFN divisible by the experts' and the experts by the granularity
    assert error(UP[:1] + UP[3:] + ["--moe-upcycling-granularity", "3", "--moe-ffn-hidden-size", "1024"]) \
        .startswith("--num-experts: must be divisible by the upcycling granularity 3")
    assert error(UP[:1] + UP[3:] + ["--moe-ffn-hidden-size", "768"]).startswith("--moe-upcycling-granularity:")
    # every dense MLP becomes experts and loads strictly
    assert error(UP + ["--moe-layer-freq", "[1,0,1,1]"]).startswith("--moe-layer-freq:")
    # megatron/training 0.17.1 to 0.19.2: training.py calls load_checkpoint(model=...), checkpointing.py's parameter
    # is ddp_model (both wheels' source; the TypeError seen on 0.19.2's, tests/test_moe_upcycling_real.py)
    for v in ("0.17", "0.18", "0.19"):
        assert error(UP, v).startswith("--moe-use-upcycling: does not work in megatron/training 0.17 to 0.19")
    assert error(UP + ["--fp8-format", "hybrid"]).startswith("--moe-use-upcycling:")


def test_json_and_text_show_the_startup():
    import json
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "megatron_memguard.cli.main", "estimate", "--world-size", "4",
                          "--megatron-version", "0.16", "--json", "--", *BASE, *MOE, *UP], capture_output=True,
                         text=True, timeout=300)
    doc = json.loads(out.stdout)
    for s in doc["stages"]:
        up = s["upcycling_startup"]
        assert [t["name"] for t in up["terms"]][:3] == ["upcycling_moe_model_state", "upcycling_dense_model",
                                                         "upcycling_state_dict_copies"]
        assert up["device_total_bytes"] == sum(t["bytes"] for t in up["terms"])
    text = subprocess.run([sys.executable, "-m", "megatron_memguard.cli.main", "estimate", "--world-size", "4",
                           "--megatron-version", "0.16", "--", *BASE, *MOE, *UP], capture_output=True, text=True,
                          timeout=300).stdout
    assert "upcycling start-up: peak allocated" in text
