"""Gemma 2 as Megatron-Bridge 0.6.2 builds it (models/gemma/gemma2_provider.py): gemma2_layer_spec's
Gemma2FlexDotProductAttention (PyTorch FlexAttention with the attention-logit softcap as its score_mod) and
TERowParallelLinearLayerNorm post-projection norms, and Gemma2OutputLayer's final logit softcap. Parameter counts
against the Gemma 2 technical report and the published checkpoints, the saved bytes by hand and measured with torch on
CPU (the softcap's saved tanh, FlexAttention's block masks)."""
from __future__ import annotations

import pytest

from megatron_memguard import estimate, layout_from_flags
from megatron_memguard.estimator.activations import layer_activations
from megatron_memguard.estimator.attention_backend import select
from megatron_memguard.estimator.head import output_items
from megatron_memguard.estimator.layers.attention import attention_kind, bound_saved, flex_block_masks
from megatron_memguard.estimator.params import total_parameters
from megatron_memguard.errors import NotModelledError

# google/gemma-2-{2b,9b,27b} config.json: layers, hidden, intermediate, heads, key/value heads, head_dim
GEMMA2 = {
    "2b": (26, 2304, 9216, 8, 4, 256),
    "9b": (42, 3584, 14336, 16, 8, 256),
    "27b": (46, 4608, 36864, 32, 16, 128),
}


def _layout(name: str, *extra: str, gemma2: bool = True, cap: float = 30.0, seq: int = 4096, vocab: int = 256_000,
            world: int = 1, mbs: int = 1):
    n, h, f, a, g, d = GEMMA2[name]
    L = layout_from_flags(["--num-layers", str(n), "--hidden-size", str(h), "--ffn-hidden-size", str(f),
                           "--num-attention-heads", str(a), "--group-query-attention", "--num-query-groups", str(g),
                           "--kv-channels", str(d), "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
                           "--position-embedding-type", "rope", "--seq-length", str(seq), "--max-position-embeddings",
                           str(seq), "--micro-batch-size", str(mbs), "--global-batch-size", "8", "--bf16",
                           "--attention-dropout", "0", "--hidden-dropout", "0", "--transformer-impl",
                           "transformer_engine", *extra], world_size=world)
    # the vocabulary as is (no padding), Gemma 2's layers as the Bridge reader sets them
    return L.replace(post_proj_norms=gemma2, gemma2_attention=gemma2, final_logit_softcapping=cap if gemma2 else 0.0,
                     vocab_size=vocab, padded_vocab_size=vocab)


# Gemma 2 technical report (arXiv 2408.00118), Table 2: embedding and non-embedding parameters (its vocabulary of
# 256,128 entries)
REPORT = {"2b": (590_118_912, 2_024_517_888), "9b": (917_962_752, 8_324_201_984),
          "27b": (1_180_237_824, 26_047_480_320)}


@pytest.mark.parametrize("name", list(GEMMA2))
def test_parameters_match_the_technical_report(name):
    L = _layout(name, vocab=256_128)
    embedding, non_embedding = REPORT[name]
    h = GEMMA2[name][1]
    assert L.padded_vocab_size * h == embedding
    assert total_parameters(L) - embedding == non_embedding        # tied output layer: one copy
    # four [h] norms a layer (input, post-attention, pre-MLP, post-MLP): two more than a GPT layer's
    assert total_parameters(_layout(name, vocab=256_128, gemma2=False)) == total_parameters(L) - 2 * GEMMA2[name][0] * h


# the published checkpoints (Hugging Face google/gemma-2-*, model.safetensors metadata, vocabulary 256,000)
@pytest.mark.parametrize("name, total", [("2b", 2_614_341_888), ("9b", 9_241_705_984), ("27b", 27_227_128_320)])
def test_total_matches_the_published_checkpoint(name, total):
    assert total_parameters(_layout(name)) == total


def test_flex_attention_keeps_what_te_fused_attention_keeps_by_hand():
    # 2B, s 4096, MBS 1, TP 1. FlexAttentionAutogradOp saves q, k, v, out and the fp32 logsumexp (torch 2.14
    # _higher_order_ops/flex_attention.py); inductor writes out in the query's [s, b, a, d] order, so the
    # .contiguous() linear_proj gets is the same storage. By hand (bf16): linear_qkv's output (v is a view of it)
    # 4096 x (8 + 2 x 4) x 256 x 2 = 33,554,432; the rope'd q 4096 x 8 x 256 x 2 = 16,777,216 and k 8,388,608;
    # logsumexp 8 x 4096 x 4 = 131,072; the output / linear_proj's input 16,777,216
    L = _layout("2b")
    assert attention_kind(L) == "flex"
    saved = layer_activations(L).saved
    assert {k: saved[k] for k in ("qkv_output", "query_rope", "key_rope", "softmax_stats", "proj_input")} == {
        "qkv_output": 33_554_432, "query_rope": 16_777_216, "key_rope": 8_388_608, "softmax_stats": 131_072,
        "proj_input": 16_777_216}
    # nothing s x s, and the same tensors as TE's cuDNN attention with the same post-projection norms
    te = _layout("2b").replace(gemma2_attention=False)
    assert saved == layer_activations(te).saved
    # whatever TE backend is asked for: FlexAttention runs (gemma2_layer_spec's core attention)
    for backend in ("flash", "unfused", "fused"):
        Lb = L.replace(attention_backend=backend)
        assert attention_kind(Lb) == "flex" and layer_activations(Lb).saved == saved
        assert select(Lb, None).selected == "flex"
        assert bound_saved(Lb, 1, 1, 4096, False, set()) == bound_saved(te, 1, 1, 4096, False, set())
    # --attention-backend local: Bridge's provide() swaps in megatron-core's DotProductAttention (gpt_provider.py)
    local = L.replace(attention_backend="local")
    assert attention_kind(local).startswith("local") and "attention_probs" in layer_activations(local).saved
    assert flex_block_masks(local, 26) is None


def test_flex_block_masks_by_hand_and_measured():
    # create_block_mask(B=None, H=None, Q_LEN=KV_LEN=s): 4 int32 [1, 1, n] counts and 4 int32 [1, 1, n, n] index tables,
    # n = s / 128: s 4096 -> 4 x 4 x (32 + 32 x 32) = 16,896 B a layer; 26 layers 439,296 B
    assert flex_block_masks(_layout("2b"), 26)[0] == 439_296
    assert flex_block_masks(_layout("2b", seq=8192), 1)[0] == 4 * 4 * (64 + 64 * 64)
    torch = pytest.importorskip("torch")
    fa = pytest.importorskip("torch.nn.attention.flex_attention")
    # (s 1000: ceil(1000 / 128) = 8 blocks, 4 x 4 x (8 + 64) = 1,152 B)
    assert flex_block_masks(_layout("2b", seq=1000), 1)[0] == 1_152
    for seq, window, by_hand in ((4096, None, 16_896), (4096, 4095, 16_896), (1000, 511, 1_152)):
        # the global and the sliding-window layers' masks (gemma2_provider.py _build_flex_block_mask)
        def mask(b, h, q, k, _w=window):
            return q >= k if _w is None else (q >= k) & (q - k <= _w)
        bm = fa.create_block_mask(mask, B=None, H=None, Q_LEN=seq, KV_LEN=seq, device="cpu")
        tensors = [t for t in vars(bm).values() if isinstance(t, torch.Tensor)]
        assert sum(t.numel() * t.element_size() for t in tensors) == by_hand


def test_final_softcap_keeps_the_tanh_measured():
    # Gemma2OutputLayer: cap * tanh(logits / cap) (gemma2_provider.py logit_softcapping). On CPU, the tensors autograd
    # saves for that expression on bf16 logits [s, b, V]: one, the tanh's output, as large as the logits
    torch = pytest.importorskip("torch")
    s, b, v = 64, 2, 512
    logits = torch.randn(s, b, v, dtype=torch.bfloat16, requires_grad=True)
    saved = {}

    def pack(t):
        saved[t.data_ptr()] = t.numel() * t.element_size()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = 30.0 * torch.tanh(logits / 30.0)
    assert sum(saved.values()) == s * b * v * 2 and out.dtype == torch.bfloat16
    L = _layout("2b", seq=s, vocab=v, mbs=b)
    items = output_items(L)
    assert items.saved["final_logit_softcap"] == s * b * v * 2
    # without the softcap nothing more is kept, and the rest of the head is the same
    plain = output_items(L.replace(final_logit_softcapping=0.0))
    assert "final_logit_softcap" not in plain.saved
    assert {k: x for k, x in items.saved.items() if k != "final_logit_softcap"} == plain.saved


def test_the_recipe_estimate_names_the_gemma2_terms():
    L = _layout("2b", "--tensor-model-parallel-size", "2", world=2, mbs=2)
    names = {t.name for t in estimate(L).critical.terms}
    assert {"final_logit_softcap", "flex_block_masks"} <= names
    # V / TP = 128,000, s 4096, b 2: the bf16 tanh 4096 x 2 x 128,000 x 2 = 2,097,152,000 B
    assert next(t.bytes for t in estimate(L).critical.terms if t.name == "final_logit_softcap") == 2_097_152_000


def test_fujii2024_refuses_gemma2_by_name():
    from megatron_memguard.estimator.fujii2024 import estimate_fujii2024
    with pytest.raises(NotModelledError, match="Gemma 2's post-projection norms"):
        estimate_fujii2024(_layout("2b"))
    # the output layer's softcap alone (a GPT layer spec under Gemma2ModelProvider)
    with pytest.raises(NotModelledError, match="Gemma 2's final logit softcapping"):
        estimate_fujii2024(_layout("2b", gemma2=False).replace(final_logit_softcapping=30.0))
