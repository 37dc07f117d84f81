"""Multi-token prediction's extra parameters and saved tensors, hand-computed from the source lines of
megatron/core/transformer/multi_token_prediction.py (core 0.19.2) the module follows."""
import pytest

from megatron_memguard.estimator.mtp import (MtpSpec, block_activations, depth_params, embedding_copy_params,
                                             extra_params, fp32_softmax_bytes, logits_in_flight,
                                             loss_buffers)

# Llama-3.1-8B shape (Meta's config.json): h 4096, vocab 128256 (already a multiple of 128*TP), RMSNorm.
LLAMA8B = dict(hidden_size=4096, padded_vocab_size=128256, seq_length=8192, micro_batch_size=1,
               normalization="RMSNorm", position_embedding_type="rope", untie_embeddings_and_output_weights=True)


def test_depth_params_rmsnorm_tp2():
    # enorm, hnorm, final_layernorm: 3 RMSNorm weights of 4096; eh_proj column-parallel 2h -> h, bias=False
    # (MultiTokenPredictionLayer.__init__: build_module(eh_proj, 2h, h, gather_output=False, bias=False)).
    spec = MtpSpec(mtp_num_layers=1, tensor_model_parallel_size=2, **LLAMA8B)
    assert depth_params(spec) == 3 * 4096 + (4096 // 2) * 8192 == 16_789_504


def test_depth_params_layernorm_has_bias():
    spec = MtpSpec(mtp_num_layers=1, hidden_size=512, padded_vocab_size=50304, seq_length=1024, micro_batch_size=4)
    assert depth_params(spec) == 3 * 2 * 512 + 512 * 1024 == 527_360


def test_embedding_copy_only_when_the_last_stage_is_not_the_first():
    # GPTModel.__init__ builds self.embedding when pre_process or mtp_process: with PP = 1 it exists anyway.
    one = MtpSpec(mtp_num_layers=1, pipeline_model_parallel_size=1, tensor_model_parallel_size=2, **LLAMA8B)
    two = MtpSpec(mtp_num_layers=1, pipeline_model_parallel_size=2, tensor_model_parallel_size=2, **LLAMA8B)
    assert embedding_copy_params(one) == 0
    assert embedding_copy_params(two) == 128256 // 2 * 4096 == 262_668_288
    assert extra_params(two) == 16_789_504 + 262_668_288


def test_embedding_copy_with_learned_positions():
    # The MoE dev records' shape: h 512, GPT-2 vocab padded to 50304, learned positions over 1024.
    spec = MtpSpec(mtp_num_layers=1, hidden_size=512, padded_vocab_size=50304, seq_length=1024, micro_batch_size=4,
                   pipeline_model_parallel_size=2, tensor_model_parallel_size=2, max_position_embeddings=1024)
    assert embedding_copy_params(spec) == 25152 * 512 + 1024 * 512 == 13_402_112


def test_no_mtp_no_copy():
    assert embedding_copy_params(MtpSpec(mtp_num_layers=0, pipeline_model_parallel_size=4, **LLAMA8B)) == 0


@pytest.mark.parametrize("sp, rows", [(True, 8192 // 2), (False, 8192)])
def test_block_activations(sp, rows):
    # _concat_embeddings: enorm saves its input [rows, h]; eh_proj saves the cat [rows, 2h];
    # final_layernorm saves [rows, h]; MultiTokenPredictionBlock.forward's torch.cat keeps all 1+D chunks.
    spec = MtpSpec(mtp_num_layers=2, tensor_model_parallel_size=2, sequence_parallel=sp, **LLAMA8B)
    a = block_activations(spec)
    assert a.embedding_norm_inputs == 2 * rows * 4096 * 2
    assert a.eh_proj_inputs == 2 * rows * 8192 * 2
    assert a.hidden_concat == 3 * rows * 4096 * 2
    assert a.norm_stats == 2 * 3 * rows * 4                  # RMSNorm: one fp32 rstd per row
    assert a.token_ids == 2 * (8192 * 8 + 8192)              # rope: no position ids; TP 2: masked ids + mask
    assert block_activations(MtpSpec(mtp_num_layers=0, **LLAMA8B)).total == 0


def test_logits_in_flight():
    # core 0.16.1: GPTModel._postprocess runs the MTP loop inline, its mtp_logits [s*b, V/TP] bf16 stay
    # referenced while the main head runs
    spec = MtpSpec(mtp_num_layers=3, tensor_model_parallel_size=8, megatron_version="0.16", **LLAMA8B)
    assert logits_in_flight(spec) == 8192 * (128256 // 8) * 2
    # core 0.19.2: the loop is the function process_mtp_loss, which has returned before the main head; so in
    # the 0.17.1 and 0.18.2 wheels (gpt_model.py _postprocess calls process_mtp_loss)
    for version in ("0.17.1", "0.18.2", "0.19"):
        assert logits_in_flight(MtpSpec(mtp_num_layers=3, tensor_model_parallel_size=8, megatron_version=version,
                                        **LLAMA8B)) == 0


def test_loss_buffers_per_depth():
    # vocab-parallel cross entropy keeps 4 * (s*b/CP) * V/TP bytes of fp32 softmax per depth
    # (tensor_parallel/cross_entropy.py); per depth the rolled labels (int64) and loss mask (fp32), and the
    # [b, s] fp32 loss MTPLossAutoScaler saves.
    spec = MtpSpec(mtp_num_layers=2, tensor_model_parallel_size=4, context_parallel_size=2, **LLAMA8B)
    soft = fp32_softmax_bytes(spec)
    assert soft == 4 * 4096 * (128256 // 4) == 525_336_576
    assert loss_buffers(spec, soft) == 2 * (soft + 4096 * (8 + 4 + 4))


def test_chunk_params_add_up_to_the_referee_stage():
    # the referee stage of tests/test_referee_mtp.py: h 128, V 1024, learned positions over 64, LayerNorm, PP 2;
    # one GPT layer of 198,272 parameters; the measured extra of the MTP stage was 371,072
    from megatron_memguard.estimator.mtp import chunk_params
    spec = MtpSpec(mtp_num_layers=1, hidden_size=128, padded_vocab_size=1024, seq_length=64, micro_batch_size=2,
                   pipeline_model_parallel_size=2, max_position_embeddings=64)
    ps = chunk_params(spec, [("layer", 198_272)])
    assert sum(n for _, n, _ in ps) == 371_072
    assert [name for name, _, shared in ps if shared] == ["embedding.word_embeddings.weight"]


def test_estimate_counts_the_mtp_stage():
    # the referee model of tests/test_referee_mtp.py (700,672 parameters measured on its MTP stage)
    from megatron_memguard import estimate, layout_from_flags
    flags = ("--transformer-impl local --no-masked-softmax-fusion --no-bias-gelu-fusion --no-bias-dropout-fusion "
             "--no-gradient-accumulation-fusion --hidden-dropout 0 --attention-dropout 0 --tokenizer-type NullTokenizer "
             "--num-layers 2 --hidden-size 128 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 "
             "--micro-batch-size 2 --global-batch-size 4 --pipeline-model-parallel-size 2 --vocab-size 1000 --bf16 "
             "--mtp-num-layers 1").split()
    stages = estimate(layout_from_flags(flags, world_size=2, megatron_version="0.16"), device="cpu").stages
    assert stages[0].parameters == 1024 * 128 + 64 * 128 + 198_272
    assert stages[1].parameters == 198_272 + 2 * 128 + 1024 * 128 + 198_272 + 172_800
    terms = {t.name: t.bytes for t in stages[1].terms}
    spec = MtpSpec(mtp_num_layers=1, hidden_size=128, padded_vocab_size=1024, seq_length=64, micro_batch_size=2,
                   pipeline_model_parallel_size=2, max_position_embeddings=64)
    assert terms["mtp_block_activations"] == block_activations(spec).total
    assert not any(t.name.startswith("mtp_") for t in stages[0].terms)


def _real_mlp_kinds(freq, monkeypatch):
    """The MLP module of each decoder layer and of the MTP layer, from megatron-core's own spec builders (installed
    release: 0.16.1 in the 3.11 suite, 0.19.2 in the 3.12 one): the MTP layer takes the spec of the global last
    decoder layer (gpt_builders.py / megatron.training.models.gpt.mtp_block_spec: get_gpt_decoder_layer_specs(...)
    [-1] -> get_gpt_mtp_block_spec)."""
    import inspect

    pytest.importorskip("megatron.core")
    from megatron.core import parallel_state
    from megatron.core.models.gpt import gpt_layer_specs as G
    from megatron.core.transformer.transformer_config import TransformerConfig

    monkeypatch.setattr(parallel_state, "is_pipeline_last_stage", lambda *a, **k: True)   # the MTP stage
    cfg = TransformerConfig(num_layers=4, hidden_size=96, num_attention_heads=6, kv_channels=16, ffn_hidden_size=100,
                            num_moe_experts=4, moe_ffn_hidden_size=96, moe_layer_freq=freq, mtp_num_layers=1,
                            tensor_model_parallel_size=3, sequence_parallel=True, add_bias_linear=False)
    kw = {"normalization": "LayerNorm"} if "normalization" in inspect.signature(
        G.get_gpt_decoder_layer_specs).parameters else {}
    specs = G.get_gpt_decoder_layer_specs(cfg, use_transformer_engine=False, **kw)
    sub = G.get_gpt_mtp_block_spec(cfg, specs[-1], use_transformer_engine=False).layer_specs[0].submodules
    mtp = getattr(sub, "mtp_model_layer", None) or sub.transformer_layer

    def name(spec):
        m = getattr(spec.submodules.mlp, "module", spec.submodules.mlp)
        while hasattr(m, "func"):
            m = m.func
        return "moe" if getattr(m, "__name__", "") == "MoELayer" else "dense"
    return [name(s) for s in specs], name(mtp)


@pytest.mark.parametrize("freq", [[1, 1, 1, 1], [1, 1, 1, 0], [0, 1, 1, 1]])
def test_ffn_width_is_checked_where_megatron_builds_a_dense_mlp(freq, monkeypatch):
    """FFN width 100 over TP 3: megatron.core.utils.divide asserts in the dense MLP's linear_fc2 (RowParallelLinear
    over ffn_hidden_size), nowhere else (TransformerConfig and validate_args do not check it; the experts split
    --moe-ffn-hidden-size). An all-MoE model's MTP layer is MoE (the last decoder layer's spec), so with --moe-layer-freq
    1 no layer splits ffn_hidden_size and the job builds; memguard refuses it exactly when a dense MLP is built."""
    from megatron_memguard import layout_from_flags
    from megatron_memguard.errors import ConfigError, ConfigErrors
    decoder, mtp = _real_mlp_kinds(freq, monkeypatch)
    assert mtp == decoder[-1]
    flags = ("--num-layers 4 --hidden-size 96 --num-attention-heads 6 --kv-channels 16 --ffn-hidden-size 100 "
             "--num-experts 4 --moe-ffn-hidden-size 96 --mtp-num-layers 1 --tensor-model-parallel-size 3 "
             "--sequence-parallel --disable-bias-linear --position-embedding-type rope --seq-length 96 "
             "--max-position-embeddings 96 --micro-batch-size 1 --vocab-size 1536 --bf16").split()
    flags += ["--moe-layer-freq", "[" + ",".join(map(str, freq)) + "]"]
    for version in ("0.16", "0.19"):
        if "dense" in decoder + [mtp]:
            with pytest.raises((ConfigError, ConfigErrors), match="--ffn-hidden-size: FFN width 100 must be divisible "
                                                                  "by tensor-model-parallel size 3"):
                layout_from_flags(flags, world_size=3, megatron_version=version)
        else:
            L = layout_from_flags(flags, world_size=3, megatron_version=version)
            assert L.mtp_num_layers == 1 and L.ffn_hidden_size == 100


def test_the_second_depth_keeps_the_first_depths_output_for_hnorm():
    # MultiTokenPredictionBlock.forward (multi_token_prediction.py, megatron-core 0.16.1 and 0.19.2) passes depth
    # k-1's final_layernorm output to depth k as hidden_states; depth k's hnorm saves it (torch.cat copies it into
    # the concatenation, which is another tensor). One [s*b/CP (/TP with SP), h] row set per depth after the first:
    # 64 * 2 rows x 128 x 2 B = 32 KiB each here; with SP over TP 2 half of it.
    from megatron_memguard.estimator.mtp import MtpSpec, block_activations
    spec = dict(hidden_size=128, padded_vocab_size=1024, seq_length=64, micro_batch_size=2)
    assert block_activations(MtpSpec(mtp_num_layers=1, **spec)).previous_depth_outputs == 0
    assert block_activations(MtpSpec(mtp_num_layers=2, **spec)).previous_depth_outputs == 32 * 1024
    assert block_activations(MtpSpec(mtp_num_layers=3, **spec)).previous_depth_outputs == 2 * 32 * 1024
    sp = MtpSpec(mtp_num_layers=3, tensor_model_parallel_size=2, sequence_parallel=True, **spec)
    assert block_activations(sp).previous_depth_outputs == 2 * 16 * 1024
