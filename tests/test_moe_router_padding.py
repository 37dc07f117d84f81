"""--moe-router-padding-for-quantization (and its alias --moe-router-padding-for-fp8): the dispatcher pads the
routing map so every expert's token count is a multiple of the quantization alignment.

Sources (megatron-core 0.19.2, the same code in 0.16.1): transformer/moe/moe_utils.py ``pad_routing_map`` (zeros
of the routing map [T, E] become ones until each expert's count is a multiple) and
``get_align_size_for_quantization`` (fp8_utils.get_fp8_align_size: 16, mxfp8 32; fp4_utils.get_fp4_align_size:
128; 0.19.2: 256 under the op fuser); token_dispatcher.py ``MoEAlltoAllTokenDispatcher.dispatch_preprocess``
(pads on the source rank) and ``_DeepepManager._pad_routing_map`` (pads on the receiving rank, unless a target
exceeds the rows it received); transformer_config.py ``__post_init__`` (needs fp8 / fp4, not allgather).
With --moe-expert-capacity-factor the router drops first (``apply_router_token_dropping``, TopKRouter.routing), the
dispatcher pads what is left (same order in 0.16.1 and 0.19.2).
The first tests run Megatron's own ``pad_routing_map`` (and ``apply_router_token_dropping``) on CPU against
memguard's padded row count.
"""
from __future__ import annotations

import pytest

from megatron_memguard import layout_from_flags
from megatron_memguard.errors import ConfigError, ConfigErrors
from megatron_memguard.estimator.layers.moe import expert_rows, moe_activations, sent_rows, tokens_per_rank

# TP 2 with SP, EP 2, 6 experts top-2, seq 1024 x micro-batch 4: T = 4096 / 2 = 2048 tokens a rank; T k / E = 682.7
MOE = ("--num-layers 4 --hidden-size 512 --num-attention-heads 8 --seq-length 1024 --max-position-embeddings 1024 "
       "--micro-batch-size 4 --global-batch-size 32 --bf16 --tensor-model-parallel-size 2 --sequence-parallel "
       "--expert-model-parallel-size 2 --num-experts 6 --moe-router-topk 2 --moe-token-dispatcher-type alltoall "
       "--moe-grouped-gemm --disable-bias-linear --swiglu --tokenizer-type NullTokenizer --vocab-size 50257").split()
T, E, K, H, ETP, EP = 2048, 6, 2, 512, 2, 2
FP8 = ["--fp8-format", "e4m3"]
PAD = ["--moe-router-padding-for-quantization"]


def _layout(extra, version=None):
    L = layout_from_flags(MOE + extra, world_size=8, megatron_version=version)
    assert tokens_per_rank(L) == T
    return L


def _balanced_top2(torch):
    """Token t picks experts 2(t mod 3) and 2(t mod 3) + 1."""
    rmap = torch.zeros(T, E, dtype=torch.bool)
    t = torch.arange(T)
    rmap[t, 2 * (t % 3)] = True
    rmap[t, 2 * (t % 3) + 1] = True
    return rmap


def test_megatrons_pad_routing_map_gives_the_padded_rows():
    torch = pytest.importorskip("torch")
    moe_utils = pytest.importorskip("megatron.core.transformer.moe.moe_utils")
    # balanced top-2 routing: token t picks experts 2(t mod 3) and 2(t mod 3) + 1, so experts 0-3 get 683
    # tokens and 4-5 get 682 (4,096 choices)
    rmap = _balanced_top2(torch)
    for align in (16, 32, 128):
        padded = moe_utils.pad_routing_map(rmap.clone(), align)
        counts = padded.sum(dim=0)
        assert bool((counts % align == 0).all())
        fmt = {16: FP8, 32: FP8 + ["--fp8-recipe", "mxfp8"], 128: ["--fp4-format", "e2m1"]}[align]
        L = _layout(fmt + PAD)
        assert L.moe.moe_router_padding_align == align
        assert sent_rows(L.moe, T) == int(counts.sum())          # 16: 6 x 688 = 4,128


def test_alltoall_rows_by_hand():
    L = _layout(FP8 + PAD)
    er = expert_rows(L.moe, T)
    # each source rank sends ceil(683 / 16) x 16 = 688 rows per expert; this rank's 3 experts receive them from
    # the 2 EP ranks, then all-gather over ETP 2: 2 x 6 x 688
    assert er.balanced == ETP * E * 688 == 8_256
    # worst: every token to this rank's 3 experts at most k = 2 times, plus 15 padding rows per expert and source
    assert er.worst == ETP * EP * (T * 2 + 3 * 15) == 16_564
    plain = moe_activations(_layout(FP8), _layout(FP8).moe).saved
    padded = moe_activations(L, L.moe).saved
    # the experts' input [N, h] and its probs [N] (the router dtype: bf16 here) grow by the 64 padded rows
    assert padded["moe_expert_input"] - plain["moe_expert_input"] == 64 * (2 * H + 2)
    # 0.19's unfused permute keeps two int64 indices per sent row: 4,128 instead of 4,096; one of them is the
    # dispatcher's mapping, held until the layer's next forward (moe_dispatcher_state)
    assert padded["moe_permute_maps"] - plain["moe_permute_maps"] == 16 * (4_128 - 4_096)
    assert moe_activations(L, L.moe).held - moe_activations(_layout(FP8), _layout(FP8).moe).held == 8 * (4_128 - 4_096)


def test_alias_and_mxfp8_alignment():
    L = _layout(FP8 + ["--fp8-recipe", "mxfp8", "--moe-router-padding-for-fp8"])
    assert L.moe.moe_router_padding_align == 32
    assert expert_rows(L.moe, T).balanced == ETP * E * 704        # ceil(683 / 32) x 32 = 704


def test_flex_pads_on_the_receiving_rank():
    flex = ["--moe-token-dispatcher-type", "flex", "--tensor-model-parallel-size", "1", "--expert-model-parallel-size",
            "8", "--num-experts", "16"]
    L = layout_from_flags(MOE + FP8 + PAD + flex, world_size=8)
    Tf = 4096                                    # TP 1: seq 1024 x micro-batch 4
    assert tokens_per_rank(L) == Tf
    # this rank's 2 experts receive T k = 8,192 rows, 4,096 each (a multiple of 16: no padding); the worst
    # case is every token of the 8 ranks to both local experts, which padding cannot exceed (a local expert
    # gets at most the rows received)
    er = expert_rows(L.moe, Tf)
    assert er.balanced == 8_192 and er.worst == Tf * 8 * 2
    L = layout_from_flags(MOE + FP8 + PAD + flex + ["--seq-length", "1002", "--max-position-embeddings", "1002"],
                          world_size=8)
    # 1002 x 4 = 4,008 tokens: 8,016 rows, 4,008 per local expert, padded to 4,016 (251 x 16)
    assert tokens_per_rank(L) == 4_008 and expert_rows(L.moe, 4_008).balanced == 2 * 4_016


def test_rules_name_the_flag():
    for era in ("0.16", "0.19"):
        with pytest.raises((ConfigError, ConfigErrors)) as e:
            _layout(PAD, era)
        assert str(e.value).startswith("--moe-router-padding-for-quantization: needs --fp8-format or --fp4-format")
        with pytest.raises((ConfigError, ConfigErrors)) as e:
            _layout(FP8 + PAD + ["--moe-token-dispatcher-type", "allgather"], era)
        assert "allgather" in str(e.value) and "\n" not in str(e.value)


CAP = ["--moe-expert-capacity-factor", "0.5", "--moe-router-load-balancing-type", "aux_loss"]


def test_megatrons_drop_then_pad_gives_the_padded_rows():
    torch = pytest.importorskip("torch")
    moe_utils = pytest.importorskip("megatron.core.transformer.moe.moe_utils")
    # the balanced top-2 routing above; capacity ceil(2048 x 2 / 6 x 0.5) = 342 per expert: the router keeps 342
    # of each expert's 683 / 682 tokens, the dispatcher pads each to 352 (22 x 16)
    rmap = _balanced_top2(torch)
    probs = torch.rand(T, E) * rmap
    _, dropped = moe_utils.apply_router_token_dropping(probs, rmap, router_topk=K, capacity_factor=0.5)
    padded = moe_utils.pad_routing_map(dropped.clone(), 16)
    assert dropped.sum(dim=0).tolist() == [342] * E and padded.sum(dim=0).tolist() == [352] * E
    L = _layout(FP8 + PAD + CAP)
    assert sent_rows(L.moe, T) == int(padded.sum()) == 2_112


def test_capacity_then_padding_by_hand():
    L = _layout(FP8 + PAD + CAP)
    er = expert_rows(L.moe, T)
    # this rank's 3 experts get 352 rows from each of the 2 EP ranks, all-gathered over ETP 2: 2 x 6 x 352
    assert er.balanced == ETP * E * 352 == 4_224
    # worst: no source sends an expert more than its 342 kept rows padded to 352, so the bound is the balanced count
    assert er.worst == ETP * EP * 3 * 352 == 4_224
    # sending: at most 6 x 342 kept choices plus 15 padding rows per expert
    assert sent_rows(L.moe, T, worst=True) == E * 342 + E * 15
    # padded to capacity the dispatcher permutes C = 342 rows per expert whatever the padded map holds
    Lp = _layout(FP8 + PAD + CAP + ["--moe-pad-expert-input-to-capacity"])
    assert expert_rows(Lp.moe, T).balanced == expert_rows(Lp.moe, T).worst == ETP * E * 342
    assert sent_rows(Lp.moe, T) == E * 342
    # flex (DeepEP): the receiving rank pads each local expert's kept rows, 2 x 2 sources x 342 = 1,368, to 1,376
    Lf = _layout(FP8 + PAD + CAP + ["--moe-token-dispatcher-type", "flex"])
    assert expert_rows(Lf.moe, T).balanced == 3 * 1_376
