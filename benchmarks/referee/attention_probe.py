"""What a causal core attention keeps for backward on CPU: megatron-core's local DotProductAttention, fp32.

Transformer Engine's UnfusedDotProductAttention needs CUDA, but on fp32 scores it runs the same torch ops as
megatron-core's unfused attention (baddbmm, ``masked_fill_``, torch's softmax, dropout, bmm): this measures the
tensors those ops keep, for the estimate of TE's unfused path to be checked against (tests/test_attention_backend_auto.py).

    python -m benchmarks.referee.attention_probe --seq 64 --batch 2 --heads 4 --head-dim 16 [--batch-mask]

prints one JSON object: the bytes alive after the forward per (op, dtype, shape), the attention output excluded.
One process per probe (it starts a one-rank gloo group and megatron-core's model-parallel state).
"""
from __future__ import annotations

import argparse
import json
import os


def probe(seq: int, batch: int, heads: int, head_dim: int, batch_mask: bool) -> list[dict]:
    import torch

    from benchmarks.referee import shims
    shims.install()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29000 + os.getpid() % 1000))
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from benchmarks.referee.livebytes import LiveBytesTracker
    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1)
    cfg = TransformerConfig(num_layers=1, hidden_size=heads * head_dim, num_attention_heads=heads,
                            attention_dropout=0.0, masked_softmax_fusion=False, params_dtype=torch.float32)
    attn = DotProductAttention(cfg, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    q, k, v = [torch.randn(seq, batch, heads, head_dim, requires_grad=True) for _ in range(3)]
    mask = torch.triu(torch.ones(batch, 1, seq, seq, dtype=torch.bool), 1) if batch_mask else None
    # megatron's global memory buffer (the scores' preallocated output) is made by the first call: make it here
    attn(q.detach(), k.detach(), v.detach(), mask, attn_mask_type=AttnMaskType.causal)
    tracker = LiveBytesTracker()
    with tracker:
        out = attn(q, k, v, mask, attn_mask_type=AttnMaskType.causal)
        rows = tracker.dump(tracker.seq)
    out_shape = list(out.shape)
    torch.distributed.destroy_process_group()
    # the output (a view of the context's contiguous copy) is linear_proj's input, not the core attention's
    return [r for r in rows if not (r["op"] == "clone" and r["bytes"] == 4 * out.numel())
            and list(r["shape"]) != out_shape]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=16)
    p.add_argument("--batch-mask", action="store_true")
    a = p.parse_args()
    print(json.dumps(probe(a.seq, a.batch, a.heads, a.head_dim, a.batch_mask)))


if __name__ == "__main__":
    main()
