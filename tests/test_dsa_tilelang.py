"""DSA with --dsa-kernel-backend tilelang (megatron-core 0.19.2, read from the source; the kernels need a GPU).

Source: transformer/experimental_attention_variant/dsa_kernels.py (use_fused_dsa_kernels: a backend unless
--attention-backend unfused), dsa_tilelang_kernels.py, ops/tilelang_dsa.py (fused_qk_topk_lighting: int32 top-k in
blocks of 8192 query rows; fused_sparse_mla_absorbed: query / key [..., 576], 512 value channels, bf16, heads padded
to 16 and a power of two, top-k a multiple of 64, else None and the PyTorch path), ops/sparse_mla.py (SparseMLA keeps
q, kv, indices and the valid-head mask, not its output), ops/indexer.py, ops/tilelang_sparse_mla_fwd.py / _bwd.py.
Every number below is derived by hand from those lines.
"""
import pytest

from megatron_memguard import estimate, layout_from_flags
from megatron_memguard.errors import NotModelledError
from megatron_memguard.estimator.activations import layer_activations
from megatron_memguard.estimator.layers import dsa
from megatron_memguard.partition import uniform_kind

# DeepSeek-V3.2's absorbed dims (kv_lora 512 + rope 64 = 576) on a small model: 32 heads over TP 2 = 16 per rank
BASE = ("--num-layers 4 --hidden-size 1024 --num-attention-heads 32 --seq-length 4096 --max-position-embeddings 4096 "
        "--micro-batch-size 1 --global-batch-size 8 --bf16 --multi-latent-attention --q-lora-rank 256 "
        "--kv-lora-rank 512 --qk-head-dim 64 --qk-pos-emb-head-dim 64 --v-head-dim 64 --normalization RMSNorm "
        "--swiglu --disable-bias-linear --no-rope-fusion --vocab-size 32000 "
        "--experimental-attention-variant dsa --dsa-indexer-n-heads 8 --dsa-indexer-head-dim 64 "
        "--dsa-indexer-topk 512 --tensor-model-parallel-size 2 --sequence-parallel").split()
TL = ["--dsa-kernel-backend", "tilelang"]
S, D, K = 4096, 576, 512
DENSE = {"dsa_qk_fp32", "dsa_masks", "dsa_softmax_fp32", "dsa_probs", "dsa_value_copy"}


def _layout(*extra, world_size=4):
    return layout_from_flags(BASE + list(extra), world_size=world_size)


def _saved(L):
    return layer_activations(L, True, uniform_kind(L)).saved


def test_sparse_mla_keeps_query_key_indices_and_mask_not_scores_by_hand():
    L = _layout(*TL)
    assert L.dsa_kernel_backend == "tilelang"
    saved = _saved(L)
    assert not DENSE & set(saved)
    # b 1, 16 heads (no padding): SparseMLA's q is the absorbed query itself [s, 1, 16, 576] bf16
    assert saved["dsa_query"] == S * 16 * D * 2 == 75_497_472
    # the TileLang indexer's int32 top-k [1, s, 512] and the valid-head mask bool [1, s, 16]
    assert saved["dsa_tl_indices"] == 4 * S * K == 8_388_608
    assert saved["dsa_tl_valid_heads"] == S * 16
    # kv: the latent key [s, 1, 1, 576], a view; V's up projection as on the PyTorch path
    assert saved["dsa_key"] == S * D * 2
    plain = _saved(_layout())
    assert saved["dsa_latent_output"] == plain["dsa_latent_output"] and DENSE & set(plain)


def test_batch_2_and_padded_heads_keep_a_contiguous_query_copy_by_hand():
    # b > 1: query.permute(1, 0, 2, 3).contiguous() copies; the key's copy is as large as the key
    saved = _saved(_layout(*TL, "--micro-batch-size", "2"))
    assert saved["dsa_tl_query"] == 2 * S * 16 * D * 2 and "dsa_query" not in saved
    assert saved["dsa_key"] == 2 * S * D * 2
    # TP 4: 8 heads per rank, padded to SparseMLA's 16 (F.pad of the contiguous query)
    saved = _saved(_layout(*TL, "--tensor-model-parallel-size", "4"))
    assert saved["dsa_tl_query"] == S * 16 * D * 2 and saved["dsa_tl_valid_heads"] == S * 16


def test_indexer_loss_keeps_its_int64_topk_and_sparse_mla_an_int32_copy_by_hand():
    saved = _saved(_layout(*TL, "--dsa-indexer-loss-coeff", "0.01"))
    # the reference loss path (FusedDSAIndexerLoss, dense) runs without --dsa-indexer-use-sparse-loss
    assert saved["indexer_topk"] == 8 * S * K and saved["dsa_tl_indices"] == 4 * S * K
    assert saved["dsa_query"] == S * 16 * D * 2 and "dsa_tl_query" not in saved      # one storage, kept by both


def test_indexer_working_set_by_hand():
    L = _layout(*TL)
    _, held, iw, *_ = dsa.layer_items(L, False)
    # weights in fp32 [s, 8], logits fp32 [4096 rows, s], torch.topk's fp32 scores and int64 indices [rows, 512]
    # cast to int32, the int32 output [1, s, 512]; the top-k is saved (SparseMLA), not held
    assert iw == 4 * S * 8 + 4 * S * S + 16 * S * K + 4 * S * K
    assert "indexer_topk" not in held


@pytest.mark.parametrize("extra, topk", [
    (["--kv-lora-rank", "128"], K),                          # not the 576-wide absorbed head SparseMLA is built for
    (["--dsa-indexer-topk", "500"], 500),                    # top-k not a multiple of 64
    (["--num-attention-heads", "48", "--kv-channels", "64"], K),   # 24 heads per rank: not a power of two
])
def test_shapes_sparse_mla_declines_take_the_pytorch_path(extra, topk):
    L = _layout(*TL, *extra)
    saved = _saved(L)
    assert {"dsa_masks", "dsa_softmax_fp32"} <= set(saved) and "dsa_tl_indices" not in saved
    # the TileLang indexer still runs: its int32 top-k [1, s, top-k] lives through the core's forward
    _, held, *_ = dsa.layer_items(L, False)
    assert held["indexer_topk"] == 4 * S * topk


def test_unfused_attention_backend_keeps_the_pytorch_path():
    # dsa_kernels.use_fused_dsa_kernels: False with --attention-backend unfused, whatever the DSA backend
    L = _layout(*TL, "--attention-backend", "unfused")
    assert L.dsa_kernel_backend == "none"
    assert _saved(L) == _saved(_layout("--attention-backend", "unfused"))


def test_the_planners_bound_leaves_out_the_scores():
    L = _layout(*TL)
    # the input norm's output [s/2, h] and the latent key: no [b, heads, s, s] term
    assert dsa.bound_saved(L, 2, 1, S, True, set()) == S // 2 * 1024 * 2 + S * D * 2


def test_estimate_and_report():
    from megatron_memguard.report.text import render
    est = estimate(_layout(*TL))
    assert est.stages[0].peak_allocated_bytes < estimate(_layout()).stages[0].peak_allocated_bytes
    assert "DSA TileLang kernels" in render(est, detail=True)


@pytest.mark.parametrize("extra", [
    ["--dsa-indexer-loss-coeff", "0.01", "--dsa-indexer-use-sparse-loss"],
    ["--recompute-granularity", "selective", "--recompute-modules", "core_attn"],
    ["--recompute-granularity", "selective", "--recompute-modules", "mla_up_proj"],
    ["--context-parallel-size", "2", "--cp-comm-type", "all_gather"],
    ["--dsa-indexer-topk-freq", "2"],
    ["--seq-length", "4000"],
])
def test_unfollowed_tilelang_combinations_are_refused_by_name(extra):
    with pytest.raises(NotModelledError) as e:
        _layout(*TL, *extra, world_size=8)
    assert e.value.key == "--dsa-kernel-backend"


def test_cudnn_is_refused_by_name():
    with pytest.raises(NotModelledError) as e:
        _layout("--dsa-kernel-backend", "cudnn")
    assert e.value.key == "--dsa-kernel-backend" and "cudnn" in str(e.value)
