"""--fp8-output-proj (megatron-core 0.19.2): the LM head as TE's linear under MXFP8, hand-computed.

Sources: core/models/gpt/gpt_model.py (TELMHeadColumnParallelLinear when fp8_utils.is_mxfp8_output_proj_active),
core/extensions/transformer_engine.py (a TEColumnParallelLinear: TE caches the quantized weight like every TE
linear; the weight is built outside fp8_model_init, so it stays BF16 even with --fp8-param-gather), TE 2.11
tensor/mxfp8_tensor.py (one byte per element per usage, E8M0 scales per 32 elements padded to 128 x 4 tiles).
"""
import pytest

from megatron_memguard.config import RawConfig
from megatron_memguard.errors import ConfigError
from megatron_memguard.estimator import estimate
from megatron_memguard.resolve import resolve

V, H, S = 128256, 4096, 4096        # Llama-3 vocabulary (divisible by 128: no padding), hidden, sequence
BASE = dict(num_layers=4, hidden_size=H, num_attention_heads=32, seq_length=S, max_position_embeddings=S,
            micro_batch_size=1, global_batch_size=8, bf16=True, tokenizer_type="NullTokenizer", vocab_size=V,
            make_vocab_size_divisible_by=128, use_distributed_optimizer=True, untie_embeddings_and_output_weights=True,
            fp8="e4m3", fp8_recipe="mxfp8")


def terms(**kw):
    L = resolve(RawConfig(args={**BASE, **kw}, world_size=8))
    s = estimate(L, gpu_memory=80 * 2**30, gpu=None).critical
    return L, {t.name: t.bytes for t in s.terms}


def mxfp8_both_usages(rows, cols):
    # rowwise data + scales [round128(rows), round4(cols/32)]; columnwise data + scales [round4(rows/32), round128(cols)]
    r128 = lambda n: -(-n // 128) * 128   # noqa: E731
    r4 = lambda n: -(-n // 4) * 4          # noqa: E731
    return 2 * rows * cols + r128(rows) * r4(cols // 32) + r4(rows // 32) * r128(cols)


def test_output_layer_weight_cache_and_saved_input():
    L0, off = terms()
    L1, on = terms(fp8_output_proj=True)
    assert L1.padded_vocab_size == V
    # [128256, 4096]: 2 x 525,336,576 data + 16,416,768 + 16,416,768 scales
    assert mxfp8_both_usages(V, H) == 1_083_506_688
    assert on["fp8_weight_cache"] - off["fp8_weight_cache"] == 1_083_506_688
    # the LM head keeps its input column-wise in MXFP8: [4096, 4096] data + [round4(4096/32), 4096] scales
    assert off["output_layer_input"] == S * H * 2
    assert on["output_layer_input"] == S * H + 128 * H == 17_301_504


def test_tensor_parallel_shards_the_vocabulary_and_primary_weights_keep_the_head_cache():
    _, off = terms(tensor_model_parallel_size=2, sequence_parallel=True, fp8_param_gather=True)
    _, on = terms(tensor_model_parallel_size=2, sequence_parallel=True, fp8_param_gather=True, fp8_output_proj=True)
    # primary MXFP8 layer weights have no cache; the head's BF16 weight [V/2, h] does
    assert off.get("fp8_weight_cache", 0) == 0
    assert on["fp8_weight_cache"] == mxfp8_both_usages(V // 2, H)


def test_megatron_refuses_the_shared_weight_and_recipes_other_than_mxfp8():
    with pytest.raises(ConfigError, match="--fp8-output-proj: needs --untie-embeddings-and-output-weights"):
        terms(fp8_output_proj=True, untie_embeddings_and_output_weights=False)
    with pytest.raises(ConfigError, match="--fp8-output-proj: needs --fp8-format with --fp8-recipe mxfp8"):
        terms(fp8_output_proj=True, fp8_recipe="tensorwise")


def test_with_mtp_the_heads_keep_quantized_chunks_instead_of_the_concatenation():
    # MTP (multi_token_prediction.py): the block returns cat(main, depth 1) [2 rows, h] and the output layer runs
    # per chunk. BF16 ColumnParallelLinear keeps views of it (the whole concatenation); the MXFP8 TE head keeps a
    # quantized copy per chunk ([4096, 4096] column-wise + scales each); hnorm still keeps the BF16 final hidden
    _, off = terms(mtp_num_layers=1, position_embedding_type="rope")
    _, on = terms(mtp_num_layers=1, position_embedding_type="rope", fp8_output_proj=True)
    assert on["output_layer_input"] == off["output_layer_input"] == S * H * 2
    q = S * H + 128 * H
    assert off["mtp_block_activations"] - on["mtp_block_activations"] == 2 * S * H * 2 - 2 * q
