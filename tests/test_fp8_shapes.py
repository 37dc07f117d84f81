"""FP8 / FP4 at GEMM shapes Transformer Engine does not run: refused at resolve naming the flag
(resolve/fp8_shapes.py). The divisors are Transformer Engine 2.11.0's (transformer_engine/pytorch):
utils.assert_dim_for_fp8_exec (tokens and output features by 8, input features by 16; module/linear.py,
layernorm_linear.py), constants.MXFP8_BLOCK_SCALING_SIZE = 32 and NVFP4_BLOCK_SCALING_SIZE = 16 (enforced for
every quantized tensor by csrc/quantizer.cpp MXFP8Quantizer / NVFP4Quantizer::create_tensor), and
Float8BlockQuantizer.block_len = 128 (the sequence-parallel all-gather, utils.assert_dim_for_all_gather).
Megatron-core (0.16.1, 0.19.2) pads only MoE expert tokens (get_align_size_for_quantization)."""
import pytest

from megatron_memguard import layout_from_flags
from megatron_memguard.errors import ConfigError, ConfigErrors
from planner_util import make_planner

BASE = ("--num-layers 4 --hidden-size 4096 --num-attention-heads 32 --seq-length 4096 --max-position-embeddings 4096 "
        "--micro-batch-size 1 --global-batch-size 64 --bf16 --use-distributed-optimizer --swiglu --vocab-size 32000 "
        "--ffn-hidden-size 11008").split()
ERAS = pytest.mark.parametrize("era", ["0.16", "0.19"])


def _flags(extra, **swap):
    out = list(BASE)
    for k, v in swap.items():
        i = out.index(k)
        out[i + 1] = v
    return out + extra.split()


def _refusal(flags, world=8, era="0.19") -> ConfigError:
    with pytest.raises((ConfigError, ConfigErrors)) as e:
        layout_from_flags(flags, world_size=world, megatron_version=era)
    err = e.value if isinstance(e.value, ConfigError) else e.value.errors[0]
    assert "\n" not in str(err)
    return err


@ERAS
def test_mxfp8_ffn_per_tp_rank_must_be_a_multiple_of_32(era):
    # 11008 / 8 = 1376 = 32 x 43 runs; 11000 / 8 = 1375 (fc2's input features, fc1's output 2 x 1375 = 2750)
    mx = "--fp8-format e4m3 --fp8-recipe mxfp8 --tensor-model-parallel-size 8 --sequence-parallel"
    layout_from_flags(_flags(mx), world_size=8, megatron_version=era)
    err = _refusal(_flags(mx, **{"--ffn-hidden-size": "11000"}), era=era)
    assert err.key == "--ffn-hidden-size" and "32" in err.rule and "2750" in err.rule
    # the same model runs in BF16; under delayed scaling fc1's output features 2750 % 8 == 6 stop it too
    layout_from_flags(_flags("--tensor-model-parallel-size 8 --sequence-parallel", **{"--ffn-hidden-size": "11000"}),
                      world_size=8, megatron_version=era)
    err = _refusal(_flags("--fp8-format hybrid --fp8-recipe delayed --tensor-model-parallel-size 8 --sequence-parallel",
                          **{"--ffn-hidden-size": "11000"}), era=era)
    assert err.key == "--ffn-hidden-size" and "(2750)" in err.rule and "multiple of 8" in err.rule


@ERAS
def test_delayed_scaling_needs_output_features_by_8_and_input_by_16(era):
    # ffn 11004 at TP 1: fc1 [2 x 11004, 4096] passes (22008 % 8 == 0); fc2 [4096, 11004]: 11004 % 16 == 12
    err = _refusal(_flags("--fp8-format e4m3", **{"--ffn-hidden-size": "11004"}), world=1, era=era)
    assert err.key == "--ffn-hidden-size" and "11004" in err.rule
    # 11008 % 16 == 0 runs
    layout_from_flags(_flags("--fp8-format e4m3", **{"--ffn-hidden-size": "11008"}), world_size=1, megatron_version=era)


@ERAS
def test_tokens_per_gemm_input_are_not_padded_for_dense_layers(era):
    # 4100 tokens: 4100 % 8 == 4 (assert_dim_for_fp8_exec on the [s x b, h] input)
    err = _refusal(_flags("--fp8-format e4m3 --fp8-recipe tensorwise", **{"--seq-length": "4100",
                                                                          "--max-position-embeddings": "4100"}),
                   world=1, era=era)
    assert err.key == "--seq-length" and "4100 tokens" in err.rule and "multiple of 8" in err.rule
    # NVFP4, TP 8 with sequence parallelism: 4104 / 8 = 513 local tokens, not a multiple of 16
    err = _refusal(_flags("--fp4-format e2m1 --tensor-model-parallel-size 8 --sequence-parallel",
                          **{"--seq-length": "4104", "--max-position-embeddings": "4104"}), era=era)
    assert err.key == "--seq-length" and "513 tokens" in err.rule and "multiple of 16" in err.rule
    # micro-batch 2: 4104 x 2 / 8 = 1026, still not a multiple of 16
    err = _refusal(_flags("--fp4-format e2m1 --tensor-model-parallel-size 8 --sequence-parallel",
                          **{"--seq-length": "4104", "--max-position-embeddings": "4104", "--micro-batch-size": "2"}),
                   era=era)
    assert "1026 tokens" in err.rule
    # 4224 / 8 = 528 = 16 x 33 runs
    layout_from_flags(_flags("--fp4-format e2m1 --tensor-model-parallel-size 8 --sequence-parallel",
                             **{"--seq-length": "4224", "--max-position-embeddings": "4224"}), world_size=8,
                      megatron_version=era)


@ERAS
def test_blockwise_sequence_parallel_all_gather_needs_128(era):
    # 4160 / 8 = 520 local tokens: a multiple of 8, not of 128 (Float8BlockQuantizer.is_quantizable)
    seq = {"--seq-length": "4160", "--max-position-embeddings": "4160"}
    err = _refusal(_flags("--fp8-format e4m3 --fp8-recipe blockwise --tensor-model-parallel-size 8 --sequence-parallel",
                          **seq), era=era)
    assert err.key == "--seq-length" and "520 tokens" in err.rule and "128" in err.rule
    # without sequence parallelism there is no FP8 all-gather: 4160 tokens pass the 8 / 16 rule
    layout_from_flags(_flags("--fp8-format e4m3 --fp8-recipe blockwise --tensor-model-parallel-size 8", **seq),
                      world_size=8, megatron_version=era)


MOE = ("--num-experts 8 --moe-router-topk 2 --expert-model-parallel-size 8 --moe-grouped-gemm "
       "--moe-token-dispatcher-type alltoall --disable-bias-linear")


@ERAS
def test_expert_widths_are_checked_and_expert_tokens_are_padded(era):
    # moe_ffn 1400: MXFP8 expert weights [2 x 1400, 4096] (2800 % 32 == 16) and [4096, 1400] (1400 % 32 == 24)
    err = _refusal(_flags(f"--fp8-format e4m3 --fp8-recipe mxfp8 {MOE} --moe-ffn-hidden-size 1400"), era=era)
    assert err.key == "--moe-ffn-hidden-size" and "(2800)" in err.rule and "multiple of 32" in err.rule
    # 1408 = 32 x 44 runs: the expert token counts are padded by Megatron (Fp8Padding) and are not checked
    layout_from_flags(_flags(f"--fp8-format e4m3 --fp8-recipe mxfp8 {MOE} --moe-ffn-hidden-size 1408"),
                      world_size=8, megatron_version=era)


def test_local_transformer_impl_runs_no_fp8_gemm():
    # --transformer-impl local: the FP8 flags have no effect (resolve/fp8.py note), so no TE shape rule applies
    layout_from_flags(_flags("--fp8-format e4m3 --fp8-recipe mxfp8 --transformer-impl local",
                             **{"--ffn-hidden-size": "11000"}), world_size=1)


def test_planner_never_proposes_a_layout_fp8_cannot_run():
    """ffn 11040 = 32 x 345: under MXFP8 ffn / TP is a multiple of 32 only at TP 1 (11040 / 2 = 5520 = 32 x 172.5).
    The planner re-resolves every candidate, so the TP 2 and TP 4 layouts it ranks without the rule (checked
    by hand: they fill most of the top 200) are dropped, and every layout shown runs."""
    model = ("--num-layers 8 --hidden-size 4096 --num-attention-heads 32 --ffn-hidden-size 11040 --swiglu "
             "--vocab-size 32000 --bf16 --fp8-format e4m3 --fp8-recipe mxfp8 --use-distributed-optimizer")
    P = make_planner(model.split(), 16, 4096, 64, gpu="B200")
    res = P.plan(top=50)
    assert res.entries
    for e in res.entries:
        c = e.candidate
        assert c.tp == 1 and 4096 * c.mbs // c.cp % 32 == 0


def test_autotune_never_lowers_the_micro_batch_below_what_fp8_runs():
    """NVFP4, TP 2 with sequence parallelism, sequence 8200: micro-batch 4 gives 8200 x 4 / 2 = 16,400 tokens per
    GEMM input (16 x 1025), micro-batch 2 and 1 give 8200 and 4100 (not multiples of 16). Without the rule autotune
    answers MBS 1, PP 2 (checked by hand); with it every smaller micro-batch is rejected naming --seq-length."""
    from conftest import LLAMA31_8B
    from megatron_memguard import lookup_gpu
    from megatron_memguard.autotune import autotune
    from megatron_memguard.readers.megatron_flags import parse_megatron_flags
    from megatron_memguard.units import GiB
    raw = parse_megatron_flags(LLAMA31_8B + ("--micro-batch-size 4 --tensor-model-parallel-size 2 --sequence-parallel "
                                             "--fp4-format e2m1 --seq-length 8200 --max-position-embeddings 8200").split())
    r = autotune(raw, world_size=16, gpu=lookup_gpu("B200"), gpu_memory=80 * GiB)
    assert r.chosen is None or r.chosen.layout.micro_batch_size == 4
    rejected = dict(r.rejected)
    assert "8200 tokens" in rejected["MBS 2, PP 1"] and "4100 tokens" in rejected["MBS 1, PP 1"]


def test_planner_fp8_option_tries_fp8_only_where_it_runs():
    """memguard plan --fp8 mxfp8 on a BF16 model (ffn 11040, as above): the FP8 variants of TP 2 and 4 (ranked
    first without the rule, checked by hand) are dropped; TP 1 keeps both precisions."""
    from megatron_memguard.planner.space import Constraints
    model = ("--num-layers 8 --hidden-size 4096 --num-attention-heads 32 --ffn-hidden-size 11040 --swiglu "
             "--vocab-size 32000 --bf16 --use-distributed-optimizer")
    res = make_planner(model.split(), 16, 4096, 64, gpu="B200").plan(Constraints(fp8=("off", "mxfp8")), top=100)
    fp8 = [e.candidate for e in res.entries if e.candidate.fp8 == "mxfp8"]
    assert fp8 and all(c.tp == 1 for c in fp8)


def test_mxfp8_output_layer_rows_follow_the_vocabulary_padding():
    """--fp8-output-proj (core 0.19.2) runs the LM head [padded vocabulary / TP, h] under MXFP8: GPT-2's 50,257
    tokens padded to 128 (the default --make-vocab-size-divisible-by) give 50,304 = 32 x 1,572 rows; unpadded
    (divisible by 1) 50,257 rows are not a multiple of 32."""
    flags = _flags("--fp8-format e4m3 --fp8-recipe mxfp8 --fp8-output-proj --untie-embeddings-and-output-weights")
    i = flags.index("--vocab-size")
    flags[i:i + 2] = ["--tokenizer-type", "GPT2BPETokenizer"]
    layout_from_flags(flags, world_size=1, megatron_version="0.19")
    err = _refusal(flags + ["--make-vocab-size-divisible-by", "1"], world=1)
    assert err.key == "--make-vocab-size-divisible-by" and "(50257)" in err.rule and "multiple of 32" in err.rule
