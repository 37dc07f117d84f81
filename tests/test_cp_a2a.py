"""BF16 attention under context parallelism with an all-to-all (--cp-comm-type a2a, and a2a+p2p over two levels):
what Transformer Engine keeps and holds, by hand from its source, and which settings TE lets through.

Sources: TE 2.11 (megatron-core 0.16) and TE 2.20.2 (later releases) attention/dot_product_attention/
context_parallel.py: AttnFuncWithCPAndQKVOA2A.forward saves (q_part, k_part, v_part, out_part), the exchanged q, k, v
and the kernel's output before flash_attn_a2a_communicate sends it back (the exchanged output it returns is a new
tensor, linear_proj's input); AttnFuncWithCPAndKVP2P with cp_size_a2a > 1 exchanges q, k, v before its ring (its
saved q is the exchanged one) and the output after it: TE 2.11 saves the exchanged output it returns (out_f16), TE
2.20.2 the ring's output before the exchange (out_part = out.to(dtype), saved as out_f16);
attn_forward_func_with_cp: a2a+p2p with one rank on a level runs as a2a or p2p, MLA only with p2p or a2a+p2p;
AttnFuncWithCPAndQKVOA2A asserts heads % CP == 0 for q and k. backends.py FusedAttention.forward makes q, k, v
contiguous (v, a view of the qkv output, is copied)."""
import pytest

from megatron_memguard import estimate
from megatron_memguard.errors import ConfigError
from megatron_memguard.estimator.activations import layer_activations
from megatron_memguard.estimator.layers.attention import activations as attention
from megatron_memguard.estimator.layers.attention import attention_keeps_proj_input
from megatron_memguard.estimator.layers.cp_attention import a2a_peak, cp_a2a_attention
from megatron_memguard.gpus import lookup_gpu
from megatron_memguard.readers.megatron_flags import parse_megatron_flags
from megatron_memguard.resolve import resolve

from test_fp8_attention import BASE, lay

MiB = 2 ** 20
# Llama-3.1-8B (32 heads, 8 KV heads, head dim 128), TP 2 + SP, micro-batch 1, seq 8192 (test_fp8_attention.BASE):
# per TP rank 16 heads and 4 query groups; CP 2: 4096 tokens per rank
CP2 = ["--context-parallel-size", "2"]
Q = 4096 * 16 * 128 * 2              # bytes of q (and of the output) on a rank: 16 MiB
K = 4096 * 4 * 128 * 2               # of k (and of v): 4 MiB
W = Q + 2 * K
STATS = 16 * 4096 * 4                # fp32 softmax statistic [b, a/CP, s] = [b, a, s/CP]
RING_BWD = Q + 3 * Q + 10 * K + STATS    # attention.py _cp_attention_items' backward step (the p2p ring): dO + its own


def test_a2a_saved_by_hand():
    ring = layer_activations(lay(*CP2)).saved
    got = layer_activations(lay(*CP2, "--cp-comm-type", "a2a")).saved
    # the ring kept the rope'd q and its last K/V buffer; the all-to-all keeps the exchanged q, k, v
    assert ring["query_rope"] == Q and ring["cp_kv_buffer"] == 2 * K
    assert "query_rope" not in got and "cp_kv_buffer" not in got
    assert got["cp_a2a_qkv"] == W == 24 * MiB
    # one fp32 statistic either way; the kernel's output before its exchange, apart from linear_proj's
    assert got["softmax_stats"] == ring["softmax_stats"] == STATS
    assert got["cp_a2a_attention_output"] == Q and got["proj_input"] == ring["proj_input"] == Q
    # the ring's estimate was low by one [s/CP, a d / TP] x 2 B tensor per layer: 16 MiB here
    assert sum(got.values()) - sum(ring.values()) == Q == 16 * MiB
    assert attention_keeps_proj_input(ring) and not attention_keeps_proj_input(got)


def test_a2a_peak_by_hand():
    # before the attention, q 16, k 4, v 4 (MiB): the peak is at q's reorder: send copies of q and k (20), receive
    # buffers of q and k (20), q's two reorder copies (32)
    assert a2a_peak((16, 4, 4), True) == 72
    # after it: the three send copies (24), receive buffers of dq and dk (20), dq's contiguous copy (16)
    assert a2a_peak((16, 4, 4), False) == 60


@pytest.mark.parametrize("version", ["0.16.1", "0.19.2"])
def test_a2a_working_sets_by_hand(version):
    L = lay(*CP2, "--cp-comm-type", "a2a", version=version)
    m = attention(L, set(), True, False, frozenset(), frozenset(), 0)
    f = cp_a2a_attention(L, m)
    alive = Q + K                            # Megatron's rope'd q, v made contiguous (FusedAttention.forward)
    # q, k, v exchanged (its outputs are the saved cp_a2a_qkv): 4 Q + 2 K
    assert f.fwd_steps[0][1] == alive + 4 * Q + 2 * K == 92 * MiB
    # the output's exchange back: send copy, receive buffer, contiguous copy (= proj_input)
    assert f.fwd_steps[1][1] == alive + 3 * Q == 68 * MiB
    # backward (the same in TE 2.11 and 2.20.2): dO handed in, then the larger of its exchange (4 Q) and the
    # exchanged dO with the kernel's dq, dk, dv and their exchange (3 Q + 3 K)
    bwd = Q + max(4 * Q, Q + W + 3 * Q + 3 * K)
    assert bwd == 116 * MiB
    assert [b[1] - a[1] for a, b in zip(m.bwd_steps, f.bwd_steps)] == [0, bwd - RING_BWD, 0, 0]
    assert {"cp_a2a_qkv", "cp_a2a_attention_output"} <= f.bwd_steps[2][0]     # freed with the core attention


def test_a2a_estimate_moves_by_the_saved_tensor():
    # 32 layers, PP 1: the layer_activations term moves by the layers x micro-batches in flight (1) x Q
    gpu = lookup_gpu("H100-80GB")
    pp1 = ["--pipeline-model-parallel-size", "1", *CP2]
    ring = {t.name: t.bytes for t in estimate(lay(*pp1), gpu=gpu).stages[0].terms}
    a2a = {t.name: t.bytes for t in estimate(lay(*pp1, "--cp-comm-type", "a2a"), gpu=gpu).stages[0].terms}
    assert a2a["layer_activations"] - ring["layer_activations"] == 32 * Q


def test_a2a_with_core_attention_recompute():
    args = [*CP2, "--cp-comm-type", "a2a", "--recompute-granularity", "selective"]
    # the checkpoint keeps Megatron's q, k, v: the saved tensors are the ring's
    assert layer_activations(lay(*args)).saved == layer_activations(lay(*CP2, "--recompute-granularity",
                                                                          "selective")).saved
    L = lay(*args)
    m = attention(L, {"core_attn"}, True, False, frozenset(), frozenset(), 0)
    f = cp_a2a_attention(L, m)
    # no-grad forward: v made contiguous, then the exchanged q, k, v, statistic and output next to its exchange
    assert f.fwd_steps[0][1] == K + max(4 * Q + 2 * K, W + STATS + Q + 3 * Q)
    # the replay keeps exchanged q, k, v, statistic, output before and after the exchange through the backward
    kept = W + STATS + 2 * Q
    bwd = Q + max(4 * Q, Q + W + 3 * Q + 3 * K)
    recomputed = RING_BWD + 2 * K + STATS + Q         # attention_items' recompute step under CP (the ring's)
    assert [b[1] - a[1] for a, b in zip(m.bwd_steps, f.bwd_steps)] == [0, kept + bwd - recomputed, 0, 0]


# CP 4 as a2a+p2p [2 2]: 2048 tokens per rank
Q4, K4 = Q // 2, K // 2
W4, STATS4 = Q4 + 2 * K4, STATS // 2
TWO_LEVEL = ["--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes",
             "2", "2"]


@pytest.mark.parametrize("version", ["0.16.1", "0.19.2"])
def test_two_level_a2a_p2p_by_hand(version):
    p2p = layer_activations(lay("--context-parallel-size", "4", version=version)).saved
    L = lay(*TWO_LEVEL, version=version)
    assert L.cp_a2a_size == 2
    got = layer_activations(L).saved
    te211 = version == "0.16.1"
    # the ring's tensors keep their bytes (its q is the exchanged one); TE 2.20.2 also saves its output before the
    # exchange back, apart from the exchanged one linear_proj keeps
    assert sum(got.values()) - sum(p2p.values()) == (0 if te211 else Q4)
    assert attention_keeps_proj_input(got) == te211
    m = attention(L, set(), True, False, frozenset(), frozenset(), 0)
    f = cp_a2a_attention(L, m)
    alive = Q4 + K4                          # Megatron's rope'd q, v made contiguous
    # the ring over CP / 2 = 2 ranks: TE 2.11 keeps every step's output and K/V buffer (Q + 2 Q + 2 K), TE 2.20.2 two
    ring_fwd = Q4 + 2 * Q4 + 2 * K4 if te211 else 3 * Q4 + 4 * K4
    out = (0 if not te211 else Q4) + 3 * Q4  # TE 2.11: the ring's output (not saved) next to its exchange
    assert [w for _, w in f.fwd_steps[:3]] == [alive + 4 * Q4 + 2 * K4, alive + ring_fwd, alive + out]
    # backward: TE 2.11 exchanges [out, dO] (6 Q) and keeps both through the ring, TE 2.20.2 dO alone (4 Q);
    # then the ring's dq, dk, dv exchanged (3 Q + 3 K)
    held = 2 * Q4 if te211 else Q4
    first = 6 * Q4 if te211 else 4 * Q4
    ring_bwd = Q4 + 3 * Q4 + 10 * K4 + STATS4          # the ring's step: dO + its own buffers
    bwd = Q4 + max(first, held + ring_bwd - Q4, held + W4 + 3 * Q4 + 3 * K4)   # its dO is the exchanged one, in held
    assert [b[1] - a[1] for a, b in zip(m.bwd_steps, f.bwd_steps)] == [0, bwd - ring_bwd, 0, 0]


def test_comm_type_rules():
    # a2a+p2p with one rank on a level runs as a2a or p2p (attn_forward_func_with_cp)
    for sizes, a2a in ((["2", "1"], 2), (["1", "2"], 1)):
        L = lay(*CP2, "--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes", *sizes)
        assert L.cp_a2a_size == a2a
    assert lay(*CP2).cp_a2a_size == 1 and lay(*CP2, "--cp-comm-type", "all_gather").cp_a2a_size == 1
    # the all-to-all splits heads and query groups per TP rank over its ranks: 4 groups per TP rank, CP 8
    with pytest.raises(ConfigError, match="cp.comm.type.*multiples of the all-to-all.s 8 ranks"):
        resolve(parse_megatron_flags(BASE + ["--context-parallel-size", "8", "--cp-comm-type", "a2a"]), world_size=32)
    # one type per layer (TransformerConfig asserts one per layer: BASE's 32): each layer's kind carries its own (was
    # refused with an all-to-all among them; tests/test_fp8_attention.py test_per_layer_comm_types_*)
    L = lay(*CP2, "--cp-comm-type", "p2p", *["a2a"] * 31)
    assert L.cp_comm_layers == ",".join(["p2p"] + ["a2a"] * 31) and L.cp_a2a_size == 1   # (the first layer's)
    # a2a+p2p with one rank on its all-to-all level is the ring: one kind, no per-layer types
    L = lay(*CP2, "--cp-comm-type", *["p2p", "a2a+p2p"] * 16, "--hierarchical-context-parallel-sizes", "1", "2")
    assert L.cp_comm_layers is None and L.cp_a2a_size == 1


def test_mla_refuses_a2a():
    # attn_forward_func_with_cp asserts "Context parallelism does not support MLA with cp_comm_type='a2a'" (k's head
    # dim 128 + 64 differs from v's 128)
    mla = ["--num-layers", "4", "--hidden-size", "1024", "--num-attention-heads", "16", "--seq-length", "4096",
           "--max-position-embeddings", "4096", "--micro-batch-size", "1", "--global-batch-size", "8", "--bf16",
           "--multi-latent-attention", "--kv-lora-rank", "512", "--qk-head-dim", "128", "--qk-pos-emb-head-dim", "64",
           "--v-head-dim", "128", "--context-parallel-size", "2"]
    with pytest.raises(ConfigError, match="cp.comm.type.*multi-latent"):
        resolve(parse_megatron_flags(mla + ["--cp-comm-type", "a2a"]), world_size=2)
    # a2a+p2p over two levels runs (MLA keeps its CP-less model under CP: docs/assumptions.md)
    L = resolve(parse_megatron_flags(mla[:-1] + ["4", "--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-"
                                                 "sizes", "2", "2"]), world_size=4)
    assert L.cp_a2a_size == 2


@pytest.mark.parametrize("version", ["0.16.1", "0.19.2"])
def test_two_level_with_core_attention_recompute(version):
    args = [*TWO_LEVEL, "--recompute-granularity", "selective"]
    L = lay(*args, version=version)
    m = attention(L, {"core_attn"}, True, False, frozenset(), frozenset(), 0)
    f = cp_a2a_attention(L, m)
    te211 = version == "0.16.1"
    ring_fwd = 3 * Q4 + 2 * K4 if te211 else 3 * Q4 + 4 * K4
    # no-grad forward next to the contiguous v: q, k, v exchanged; the ring beside the exchanged q; the ring's saved
    # q, K/V buffer, statistic and its output (not saved under TE 2.11, out_part under 2.20.2) next to its exchange
    assert f.fwd_steps[0][1] == K4 + max(4 * Q4 + 2 * K4, Q4 + ring_fwd, Q4 + 2 * K4 + STATS4 + Q4 + 3 * Q4)
    # the replay keeps the exchanged q, the last K/V buffer, the statistic and the output returned (TE 2.20.2: and
    # the one before the exchange) through the backward
    kept = Q4 + 2 * K4 + STATS4 + Q4 + (0 if te211 else Q4)
    held, first = (2 * Q4, 6 * Q4) if te211 else (Q4, 4 * Q4)
    ring_bwd = Q4 + 3 * Q4 + 10 * K4 + STATS4          # the ring's step: dO + its own buffers
    bwd = Q4 + max(first, held + ring_bwd - Q4, held + W4 + 3 * Q4 + 3 * K4)   # its dO is the exchanged one, in held
    recomputed = ring_bwd + 2 * K4 + STATS4 + Q4
    assert [b[1] - a[1] for a, b in zip(m.bwd_steps, f.bwd_steps)] == [0, kept + bwd - recomputed, 0, 0]


def test_a2a_flash_backend():
    # FlashAttention.forward copies q, k, v to [b, s, h, d] before the CP function; flash-attn's output before the
    # exchange is the one saved (the ring kept its [b, s, h, d] output too): the same bytes as the ring's
    flash = ["--attention-backend", "flash"]
    ring = layer_activations(lay(*CP2, *flash)).saved
    got = layer_activations(lay(*CP2, *flash, "--cp-comm-type", "a2a")).saved
    assert ring["attention_output_bshd"] == Q and "attention_output_bshd" not in got
    assert got["cp_a2a_qkv"] == W and got["cp_a2a_attention_output"] == Q
    assert sum(got.values()) == sum(ring.values())
    L = lay(*CP2, *flash, "--cp-comm-type", "a2a")
    f = cp_a2a_attention(L, attention(L, set(), True, False, frozenset(), frozenset(), 0))
    # Megatron's rope'd q and the [b, s, h, d] copies of q, k, v next to the exchange (4 Q + 2 K)
    assert f.fwd_steps[0][1] == Q + W + 4 * Q + 2 * K
