"""--moe-use-upcycling on the real megatron/training 0.19.2 (Python 3.12 venv), driven on CPU by
tests/e2e/upcycling_models.py (one gloo rank, a tiny model): setup_model_and_optimizer never finishes start-up, so
memguard reports the flag as an error there rather than a start-up figure.

Tiny model: 2 layers, h 64, 4 heads (MHA), no biases, GELU MLP, learned absolute positions (32), vocab 128, tied
embeddings, LayerNorm (weight + bias). By hand:
  embedding 128 x 64 + positions 32 x 64 = 10,240; final norm 128
  a layer's attention: linear_qkv [3 x 64, 64] 12,288 + its input norm 128 + linear_proj 4,096 + pre-MLP norm 128
  dense MLP of FFN 256: fc1 [256, 64] + fc2 [64, 256] = 32,768  -> the dense model 10,240 + 2 x 49,408 + 128 = 109,184
  MoE MLP: router [4, 64] 256 + 4 experts of FFN 128 (16,384 each) = 65,792 -> 10,240 + 2 x 82,432 + 128 = 175,232
"""
from __future__ import annotations

import json
import os
import sys

import pytest

from build_util import run_script   # tests/e2e scripts through a fork server (torch and megatron imported once)

from conftest import CONTAINER_ERA

pytestmark = CONTAINER_ERA

HERE = os.path.dirname(os.path.abspath(__file__))
COMMON = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
          "--micro-batch-size 1 --global-batch-size 1 --vocab-size 128 --make-vocab-size-divisible-by 128 --lr 1e-4 "
          "--train-iters 1 --mock-data --no-rope-fusion --bf16 --no-gradient-accumulation-fusion "
          "--no-masked-softmax-fusion --no-bias-swiglu-fusion --no-bias-dropout-fusion --transformer-impl local "
          "--use-cpu-initialization --tokenizer-type NullTokenizer --disable-bias-linear --save-interval 1 "
          "--ckpt-format torch").split()
# the MoE run upcycling a dense FFN 256 checkpoint: 4 experts of FFN 128, granularity 2 (dense FFN 128 x 2 = 256)
MOE = ("--ffn-hidden-size 128 --num-experts 4 --moe-ffn-hidden-size 128 --moe-router-topk 2 --moe-use-upcycling "
       "--moe-upcycling-granularity 2").split()
DENSE, MOE_PARAMS = 109_184, 175_232


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _drive(mode: str, *flags: str) -> dict:
    env = {**os.environ, "MASTER_PORT": str(_free_port()), "PYTHONPATH": os.path.dirname(HERE)}
    out = run_script([sys.executable, os.path.join(HERE, "e2e", "upcycling_models.py"), mode, *COMMON, *flags],
                     timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def dense_checkpoint(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("dense"))
    seen = _drive("save-dense", "--ffn-hidden-size", "256", "--save", path)
    assert seen["dense_checkpoint"]["parameters"] == DENSE
    return path


def test_pretrain_gpt_path_builds_a_moe_shaped_dense_model_then_fails_to_load(dense_checkpoint):
    seen = _drive("builder", *MOE, "--load", dense_checkpoint)
    if "skipped" in seen:   # 0.18.2 (tests/run_releases.sh): pretrain_gpt.py has only the model provider path
        pytest.skip(seen["skipped"])
    # core_v0.19's pretrain_gpt.py: GPTModelConfig in the container, so _build_model_wrapper builds from cfg.model,
    # which the reset num_experts / ffn_hidden_size never reach
    assert seen["moe_model"] == {"parameters": MOE_PARAMS, "expert_parameters": 4 * 2 * 16_384}
    assert seen["dense_model"] == seen["moe_model"]            # not the 109,184 of the dense checkpoint
    assert seen["dense_model_ddp_wrapped"] == "DistributedDataParallel"
    # training.py passes load_kwargs={'model': ...}; checkpointing.py 0.19.2's load_checkpoint(ddp_model, ...)
    assert seen["error"].startswith("TypeError") and "'model'" in seen["error"]
    assert seen["raised_at"] == "core/transformer/moe/upcycling_utils.py:load_and_upcycle_model"
    assert "upcycled" not in seen


def test_model_provider_path_fails_at_the_dense_config(dense_checkpoint):
    # get_model(model_provider) from the reset arguments: validate_args set moe_ffn_hidden_size, num_experts is None
    seen = _drive("provider", *MOE, "--load", dense_checkpoint)
    assert "moe_model" not in seen and seen["error"].startswith("ValueError: moe_ffn_hidden_size is set but")
    assert seen["raised_at"] == "core/transformer/transformer_config.py:__post_init__"


def test_memguard_names_the_flag_on_019():
    from megatron_memguard import layout_from_flags
    from megatron_memguard.errors import ConfigError, ConfigErrors
    with pytest.raises((ConfigError, ConfigErrors)) as e:
        layout_from_flags([*COMMON, *MOE, "--save", "/ckpt/moe"], world_size=1, megatron_version="0.19")
    assert str(e.value).startswith("--moe-use-upcycling: does not work in megatron/training 0.17 to 0.19")
