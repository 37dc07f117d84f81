"""Multi-token prediction under FP8, and the backward working sets of FP8 layers, hand-computed.

megatron/core/transformer/multi_token_prediction.py (core 0.16.1 and 0.19.2): each depth is built under
``get_fp8_context(config, is_init=True)`` and runs its eh_proj and transformer layer under
``get_fp8_context(config)`` with layer_no -1 ("MTP only use global fp8 context"), so --first-last-layers-bf16
does not keep it in BF16; FP4 is not applied ("currently ignoring FP4 in MTP layers"). eh_proj is the TE
column-parallel linear [h/TP, 2h]. TE 2.11 tensorwise on Hopper: a cached weight keeps FP8 data and its
transpose (2 x rows x cols bytes) and a 4-byte scale_inv (one 512-byte allocator block).
"""
from megatron_memguard.config import RawConfig
from megatron_memguard.estimator import estimate
from megatron_memguard.estimator.params import mtp_layer_kind
from megatron_memguard.resolve import resolve

H, F, S = 1024, 4096, 1024
BASE = dict(num_layers=4, hidden_size=H, ffn_hidden_size=F, swiglu=True, num_attention_heads=8, seq_length=S,
            max_position_embeddings=S, micro_batch_size=1, global_batch_size=8, bf16=True,
            tokenizer_type="NullTokenizer", vocab_size=32000, use_distributed_optimizer=True,
            position_embedding_type="rope", normalization="RMSNorm", disable_bias_linear=True,
            fp8="hybrid", fp8_recipe="tensorwise")


def last_stage(**kw):
    L = resolve(RawConfig(args={**BASE, **kw}, world_size=8))
    return L, {t.name: t.bytes for t in estimate(L, gpu_memory=80 * 2**30).critical.terms}


def test_mtp_runs_in_the_global_fp8_context():
    L, _ = last_stage(mtp_num_layers=1, fp8_recipe="blockwise", first_last_layers_bf16=True)
    assert mtp_layer_kind(L).quantized == "blockwise"   # the last decoder layer itself is BF16
    L, _ = last_stage(mtp_num_layers=1, fp8=None, fp4="e2m1")
    assert mtp_layer_kind(L).quantized is None          # FP4 is not applied to MTP


def test_mtp_weight_cache_includes_its_layer_and_eh_proj():
    # per depth, TP 1 (MHA: qkv [3 x 1024, 1024]; proj [1024, 1024]; SwiGLU fc1 [2 x 4096, 1024]; fc2 [1024, 4096];
    # eh_proj [1024, 2048]): 18,874,368 weight elements, each cached as data + transpose, 5 scale blocks
    elements = 3 * H * H + H * H + 2 * F * H + H * F + H * 2 * H
    assert elements == 18_874_368
    _, without = last_stage()
    _, with_mtp = last_stage(mtp_num_layers=1)
    assert with_mtp["fp8_weight_cache"] - without["fp8_weight_cache"] == 2 * elements + 5 * 512
    # tensorwise recipe state: 5 quantizers x (scale, amax) per module, 512-byte blocks, 5 modules
    assert with_mtp["fp8_scales"] - without["fp8_scales"] == 5 * 5 * 2 * 512


def test_eh_proj_keeps_its_input_quantized():
    # BF16: the [1024, 2048] concatenation (4,194,304 B); tensorwise: its column-wise FP8 data (2,097,152 B) and
    # the scale_inv block
    _, bf16 = last_stage(mtp_num_layers=1, fp8=None)
    _, fp8 = last_stage(mtp_num_layers=1)
    assert bf16["mtp_block_activations"] - fp8["mtp_block_activations"] == S * 2 * H * 2 - (S * 2 * H + 512)


def test_backward_adds_the_quantized_output_gradients():
    # TE 2.11 module/base.py grad_output_preprocess: every FP8 GEMM quantizes its output gradient (row-wise for
    # dgrad, column-wise for wgrad: data + transpose on Hopper, one 512-byte scale block) next to the BF16 one.
    # At the step of each GEMM (S tokens, TP 1): fc2 and proj [1024, 1024]; fc1 [1024, 8192]; qkv [1024, 3072]
    from megatron_memguard.estimator.activations import layer_activations
    L, _ = last_stage()
    kind = mtp_layer_kind(L)
    fp8 = layer_activations(L, True, kind).bwd_steps
    bf16 = layer_activations(L, True, kind._replace(quantized=None)).bwd_steps
    extra = [a[1] - b[1] for a, b in zip(fp8, bf16)]
    q = lambda w: 2 * S * w + 512   # noqa: E731
    # fc2, activation, fc1, pre-MLP norm, linear_proj, core attention, linear_qkv, input norm; linear_proj saved its
    # BF16 input (set_save_original_input, not delayed) and quantizes it again for wgrad (linear.py _Linear.backward,
    # tensorwise: row-wise + column-wise, [1024, 1024])
    assert extra == [q(H), 0, q(2 * F), 0, q(H) + q(H), 0, q(3 * H), 0]
