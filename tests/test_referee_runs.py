"""End-to-end referee runs on small configurations, checked against numbers derived by hand.

Each run starts real megatron-core training processes (gloo on 127.0.0.1), so these tests need
torch + megatron-core; they take a few seconds each.
"""

import math

import pytest

pytest.importorskip("megatron.core")

from benchmarks.referee.run import unsupported_reason  # noqa: E402

pytestmark = pytest.mark.skipif(unsupported_reason() is not None, reason=str(unsupported_reason()))

from benchmarks.referee.run import run_referee  # noqa: E402

BF16, FP32 = 2, 4


def _settings(**kw):
    s = dict(
        num_layers=2, hidden_size=64, ffn_hidden_size=256, num_attention_heads=4,
        num_query_groups=4, group_query_attention=False, kv_channels=16,
        seq_length=64, max_position_embeddings=64, vocab_size=1001, padded_vocab_size=1024,
        micro_batch_size=2, global_batch_size=4, data_parallel_size=1,
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
        virtual_pipeline_model_parallel_size=None, context_parallel_size=1,
        sequence_parallel=False, use_distributed_optimizer=False, bf16=True, fp16=False,
        accumulate_allreduce_grads_in_fp32=True, normalization="LayerNorm", swiglu=False,
        add_bias_linear=True, add_qkv_bias=True, position_embedding_type="learned_absolute",
        untie_embeddings_and_output_weights=False, hidden_dropout=0.0, attention_dropout=0.0,
        create_attention_mask_in_dataloader=True, optimizer="adam", transformer_impl="local",
    )
    s.update(kw)
    return s


def _layer_params(h, heads, kv, groups, ffn, tp=1, bias=True):
    """Parameters of one GPT layer (LayerNorm, GELU MLP, biases) on one TP rank."""
    q = kv * heads  # query projection width (= h here)
    qkv_out = q + 2 * kv * groups  # fused QKV output width
    n = 0
    n += 2 * h  # input_layernorm weight + bias (replicated)
    n += qkv_out * h // tp + (qkv_out // tp if bias else 0)  # linear_qkv (column parallel)
    n += h * q // tp + (h if bias else 0)  # linear_proj (row parallel; bias replicated)
    n += 2 * h  # pre_mlp_layernorm weight + bias
    n += ffn * h // tp + (ffn // tp if bias else 0)  # linear_fc1 (column parallel)
    n += h * ffn // tp + (h if bias else 0)  # linear_fc2 (row parallel; bias replicated)
    return n


def _gpt_params(s, tp=1):
    h, L = s["hidden_size"], s["num_layers"]
    groups = s["num_query_groups"] if s["group_query_attention"] else s["num_attention_heads"]
    n = s["padded_vocab_size"] * h // tp  # word embedding (vocab parallel), tied with the output layer
    n += s["max_position_embeddings"] * h  # learned absolute position embedding (replicated)
    n += L * _layer_params(h, s["num_attention_heads"], s["kv_channels"], groups,
                           s["ffn_hidden_size"], tp=tp)
    n += 2 * h  # final layernorm weight + bias
    return n


def _n_param_tensors(L):
    return 2 + 12 * L + 2  # embeddings, 12 per layer (6 weights + 6 biases incl. norms), final norm


def _attention_buffer_bytes(s, tp=1):
    # megatron's GlobalMemoryBuffer ("mpu", bf16): the baddbmm input of DotProductAttention,
    # [b * heads/tp, s, s], allocated once and kept for the whole run.
    return s["micro_batch_size"] * (s["num_attention_heads"] // tp) * s["seq_length"] ** 2 * BF16


def test_tp1_param_count_and_18_bytes_per_param():
    s = _settings(group_query_attention=True, num_query_groups=2)  # GQA: qkv width h + 2*16*2
    (r,) = run_referee(s, world_size=1, timeout=300)
    P = _gpt_params(s)
    # 1024*64 + 64*64 + 2*(128 + (128*64+128) + (64*64+64) + 128 + (256*64+256) + (64*256+64)) + 128
    assert P == 65536 + 4096 + 2 * 45824 + 128 == 161408
    assert r["num_params"] == P
    # bf16 param (2) + fp32 grad buffer (4) + fp32 main param (4) + Adam exp_avg/exp_avg_sq (8)
    small = (
        _attention_buffer_bytes(s)  # GlobalMemoryBuffer for the attention scores
        + 4 * _n_param_tensors(s["num_layers"])  # Adam 'step' scalar (fp32) per parameter tensor
        + 4  # Float16OptimizerWithFloat16Params._scale_one (bf16 without loss scaler)
    )
    assert r["live_bytes_after_step"] == 18 * P + small
    # before the first step there are no Adam moments yet: 2 + 4 + 4 bytes per parameter
    assert r["live_bytes_after_build"] == 10 * P + 4
    # the peak is above the steady state (activations); during the optimizer step only
    # scalars (per-tensor grad norms, clip coefficient) come on top of the steady state
    assert r["peak_bytes"] > r["live_bytes_after_step"]
    assert 0 <= r["optimizer_step_peak_bytes"] - r["live_bytes_after_step"] < 1024
    assert r["peak_top_storages"]


def _distopt_layout(sizes, dp):
    """param_and_grad_buffer.py layout with the distributed optimizer, one bucket: params in
    reverse order, each start aligned to 64 elements, bucket end padded to lcm(dp, 128)."""
    start = 0
    ranges = []
    for n in reversed(sizes):
        start = math.ceil(start / 64) * 64
        ranges.append((start, start + n))
        start += n
    numel = math.ceil(start / math.lcm(dp, 128)) * math.lcm(dp, 128)
    return ranges, numel


def test_dp2_distributed_optimizer_with_padding():
    h, ffn, L, V = 72, 288, 2, 1024  # h=72 makes the 64-element alignment pad
    s = _settings(hidden_size=h, ffn_hidden_size=ffn, num_attention_heads=4, num_query_groups=4,
                  kv_channels=18, seq_length=32, max_position_embeddings=32, micro_batch_size=1,
                  global_batch_size=2, data_parallel_size=2, use_distributed_optimizer=True)
    ranks = run_referee(s, world_size=2, timeout=300)
    P = _gpt_params(s)
    layer = [h, h, h * h, h, 3 * h * h, 3 * h, h, h, ffn * h, ffn, h * ffn, h]
    # registration order: embeddings; per layer input_layernorm (w, b), linear_proj (w, b),
    # linear_qkv (w, b), pre_mlp_layernorm (w, b), linear_fc1 (w, b), linear_fc2 (w, b); final norm
    sizes = [V * h, 32 * h] + layer * L + [h, h]
    assert sum(sizes) == P
    ranges, numel = _distopt_layout(sizes, dp=2)
    assert numel > P  # padding present
    for r in ranks:
        assert r["num_params"] == P
        (buf,) = r["ddp_buffers"]
        # numel_unpadded counts the 64-element alignment gaps, only the bucket-end padding is excluded
        assert buf["numel"] == numel and buf["numel_unpadded"] == ranges[-1][1]
        lo, hi = r["dp_rank"] * numel // 2, (r["dp_rank"] + 1) * numel // 2
        local = [max(0, min(e, hi) - max(b, lo)) for b, e in ranges]
        local_elems = sum(local)
        n_local = sum(1 for x in local if x > 0)
        expected = (
            numel * BF16  # contiguous bf16 param buffer (dist-opt re-maps params into it)
            + numel * FP32  # fp32 grad buffer
            + local_elems * (4 + 8)  # fp32 main-param shard + Adam moments of this rank's shard
            + 4 * n_local  # Adam 'step' scalars
            + 4  # _scale_one
            + _attention_buffer_bytes(s)
        )
        assert r["live_bytes_after_step"] == expected
        # i.e. (6 + 12/2) bytes per parameter plus padding, within a few hundred bytes
        approx = (6 + 12 / 2) * P + 6 * (numel - P) + _attention_buffer_bytes(s)
        assert abs(r["live_bytes_after_step"] - approx) <= 12 * abs(local_elems - P / 2) + 4 * n_local + 4


def test_tp2_sequence_parallel_param_count():
    s = _settings(tensor_model_parallel_size=2, sequence_parallel=True, padded_vocab_size=1024)
    ranks = run_referee(s, world_size=2, timeout=300)
    P = _gpt_params(s, tp=2)
    for r in ranks:
        assert r["num_params"] == P
        assert r["live_bytes_after_step"] >= 18 * P
    assert ranks[0]["live_bytes_after_step"] == ranks[1]["live_bytes_after_step"]
