"""Lion and SOAP as the main optimizer (megatron-core 0.19.2 ``--optimizer lion`` / ``soap``), by hand.

Sources: megatron-core 0.19.2 megatron/training/arguments.py (the --optimizer choices; validate_args sends every
choice but adam and sgd to the emerging-optimizer path), megatron/core/optimizer/__init__.py
``_get_megatron_emerging_optimizer`` and optimizer/emerging_optimizers.py (2-D weights other than the embedding
and output layer take the emerging optimizer, the rest Adam: ``_default_param_overrides_factory``), and
emerging-optimizers 0.3.0 (scalar_optimizers/lion.py ``Lion._init_group``: one ``exp_avg`` like the parameter;
soap/soap.py ``SOAP._init_group``: fp32 ``exp_avg``, ``exp_avg_sq``, Kronecker factors L [m, m], R [n, n] and
eigenbases Q_L, Q_R of the same sizes).
"""
import pytest

from megatron_memguard import estimate, layout_from_flags
from megatron_memguard.errors import ConfigError, ConfigErrors, NotModelledError
from megatron_memguard.estimator.muon import MuonSpec, muon_bytes_per_param, soap_factor_bytes

# The 4-layer GPT of tests/test_muon.py (h 512, 8 heads, GELU MLP 2048, biases, learned positions over 1024,
# vocabulary 50257 -> 50304, tied). Its 2-D weights per layer: QKV [1536, 512], proj [512, 512],
# fc1 [2048, 512], fc2 [512, 2048]; plus the position table [1024, 512].
GPT4 = ("--num-layers 4 --hidden-size 512 --num-attention-heads 8 --seq-length 1024 --max-position-embeddings 1024 "
        "--micro-batch-size 4 --global-batch-size 32 --bf16 --tokenizer-type NullTokenizer --vocab-size 50257").split()
MATRIX_ELEMS = 4 * (1536 * 512 + 512 * 512 + 2048 * 512 + 512 * 2048) + 1024 * 512   # 13,107,200


def _terms(extra, world=1, version=None):
    L = layout_from_flags(GPT4 + extra, world_size=world, megatron_version=version)
    st = estimate(L).stages[0]
    return {t.name: t.bytes for t in st.terms}, st.parameters


def test_bytes_per_element():
    # bf16: the fp32 main copy (Float16OptimizerWithFloat16Params) + Lion's exp_avg = 8 B; SOAP's two moments = 12 B
    assert sum(muon_bytes_per_param(MuonSpec(optimizer="lion")).values()) == 8
    assert sum(muon_bytes_per_param(MuonSpec(optimizer="soap")).values()) == 12
    # [4, 2] weight: L 4x4 + Q_L 4x4 + R 2x2 + Q_R 2x2 fp32 = (16 + 16 + 4 + 4) x 4 B
    assert soap_factor_bytes(4, 2) == 160


def test_lion_estimate():
    terms, params = _terms(["--optimizer", "lion"])
    assert MATRIX_ELEMS == 13_107_200
    assert terms["lion_exp_avg"] == 4 * MATRIX_ELEMS
    # the rest (embedding, norms, biases) takes Adam; every parameter keeps an fp32 main copy
    assert terms["adam_exp_avg"] == terms["adam_exp_avg_sq"] == 4 * (params - MATRIX_ELEMS)
    assert terms["main_parameters"] == 4 * params
    assert "muon_momentum" not in terms


def test_soap_estimate():
    terms, params = _terms(["--optimizer", "soap"])
    assert terms["soap_exp_avg"] == terms["soap_exp_avg_sq"] == 4 * MATRIX_ELEMS
    # 8 (m^2 + n^2) B per weight: QKV 8 (1536^2 + 512^2) = 20,971,520; proj 4,194,304; fc1 and fc2
    # 8 (2048^2 + 512^2) = 35,651,584 each; four layers, plus the position table 8 (1024^2 + 512^2) = 10,485,760
    assert terms["soap_preconditioners"] == 4 * (20_971_520 + 4_194_304 + 2 * 35_651_584) + 10_485_760 == 396_361_728
    assert terms["adam_exp_avg"] == 4 * (params - MATRIX_ELEMS)


def test_soap_layer_wise_over_8_ranks():
    # LayerWiseDistributedOptimizer._emit_bucket, largest first onto the least-loaded rank: the eight
    # 1,048,576-element MLP matrices one per rank, the four QKV onto ranks 0-3: rank 0 holds fc + QKV,
    # the most state (its factors 35,651,584 + 20,971,520 B)
    terms, params = _terms(["--optimizer", "soap", "--use-distributed-optimizer"], world=8)
    assert terms["soap_exp_avg"] == 4 * (1_048_576 + 786_432)
    assert terms["soap_preconditioners"] == 35_651_584 + 20_971_520
    assert terms["adam_exp_avg"] == 4 * -(-(params - MATRIX_ELEMS) // 8)


def test_lion_and_soap_need_their_release():
    # --optimizer choices: 0.16 adam, sgd, muon, dist_muon; megatron-core 0.17.1's arguments.py adds lion (to
    # 0.16.1's optimizer factory, not modelled); 0.18.2's adds soap and adaptive_muon with the emerging-optimizer
    # factory of 0.19.2 (optimizer/emerging_optimizers.py)
    for opt, version, since in (("lion", "0.16", "0.17"), ("soap", "0.16", "0.18"), ("soap", "0.17.1", "0.18"),
                                ("adaptive_muon", "0.17.1", "0.18")):
        with pytest.raises((ConfigError, ConfigErrors)) as e:
            layout_from_flags(GPT4 + ["--optimizer", opt], world_size=1, megatron_version=version)
        assert f"{opt} needs megatron-core {since}" in str(e.value)
    with pytest.raises(NotModelledError, match="lion in megatron-core 0.17"):
        layout_from_flags(GPT4 + ["--optimizer", "lion"], world_size=1, megatron_version="0.17.1")
    with pytest.raises(NotModelledError, match="--muon-scalar-optimizer"):
        layout_from_flags(GPT4 + ["--optimizer", "dist_muon", "--muon-scalar-optimizer", "lion"], world_size=1,
                          megatron_version="0.17.1")


def test_soap_on_core_0_18_is_core_0_19s():
    # 0.18.2's emerging-optimizer factory and layer-wise optimizer are 0.19.2's: the same terms
    flags = GPT4 + ["--optimizer", "soap", "--use-distributed-optimizer"]
    a, b = (estimate(layout_from_flags(flags, world_size=8, megatron_version=v)) for v in ("0.18.2", "0.19.2"))
    assert [{t.name: t.bytes for t in s.terms} for s in a.stages] == [{t.name: t.bytes for t in s.terms} for s in b.stages]
    assert any(t.name == "soap_preconditioners" and t.bytes > 0 for t in a.stages[0].terms)


def test_soap_with_fp16():
    with pytest.raises((ConfigError, ConfigErrors)) as e:
        layout_from_flags([a for a in GPT4 if a != "--bf16"] + ["--fp16", "--optimizer", "soap"], world_size=1)
    assert "--fp16" in str(e.value)


@pytest.mark.parametrize("depths", [1, 2])
def test_soap_with_mtp_layers(depths):
    # MTP (validate_args: rope) adds per depth (multi_token_prediction.py MultiTokenPredictionLayer, core 0.19.2):
    # eh_proj [512, 1024] (2-D, not flagged embedding_or_output: SOAP) and one layer of the decoder's kind (its four
    # matrices, SOAP); enorm, hnorm, the final norm (LayerNorm weight + bias) and the layer's biases and norms go to
    # Adam (emerging_optimizers.py _is_nonlinear_or_embedding). Without a position table the decoder's matrices are
    # 4 x 3,145,728 and their factors 4 x 96,468,992 B (test_soap_estimate's per-layer figures).
    rope = ["--optimizer", "soap", "--position-embedding-type", "rope"]
    base, _ = _terms(rope)
    terms, _ = _terms(rope + ["--mtp-num-layers", str(depths)])
    layer = 1536 * 512 + 512 * 512 + 2048 * 512 + 512 * 2048                  # 3,145,728
    assert base["soap_exp_avg"] == 4 * 4 * layer
    assert terms["soap_exp_avg"] == terms["soap_exp_avg_sq"] == 4 * (4 + depths) * layer + 4 * depths * 512 * 1024
    # eh_proj's factors: 8 (512^2 + 1024^2) = 10,485,760 B per depth
    assert terms["soap_preconditioners"] == (4 + depths) * 96_468_992 + depths * 10_485_760
    # Adam per depth: 3 LayerNorms (enorm, hnorm, final) 3 x 1,024 + the layer's biases 1,536 + 512 + 2,048 + 512 and
    # its two LayerNorms 2 x 1,024 = 9,728 elements
    assert terms["adam_exp_avg"] - base["adam_exp_avg"] == 4 * depths * 9_728


def test_live_namespace_after_validate_args():
    # core 0.19.2 validate_args turns --optimizer lion --use-distributed-optimizer into
    # use_layer_wise_distributed_optimizer=True, use_distributed_optimizer=False (the hook reads that namespace)
    from megatron_memguard.config import RawConfig
    from megatron_memguard.resolve import resolve
    args = dict(num_layers=4, hidden_size=512, num_attention_heads=8, seq_length=1024, max_position_embeddings=1024,
                micro_batch_size=4, global_batch_size=32, bf16=True, tokenizer_type="NullTokenizer", vocab_size=50257,
                optimizer="lion", use_distributed_optimizer=False, use_layer_wise_distributed_optimizer=True)
    L = resolve(RawConfig(args=args, world_size=8))
    flags, _ = _terms(["--optimizer", "lion", "--use-distributed-optimizer"], world=8)
    assert {t.name: t.bytes for t in estimate(L).stages[0].terms} == flags
