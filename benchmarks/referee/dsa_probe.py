"""Measure megatron-core 0.19.2's DSAttention (DeepSeek sparse attention, the PyTorch path of
``--dsa-kernel-backend none``) on CPU: the bytes its forward keeps for the backward, and the peaks of its
forward and backward above what was live before, per micro-batch.

Runs the real ``DSAttention`` module (experimental_attention_variant/dsa.py) with its real ``DSAIndexer``, on one
gloo rank (TP = CP = 1), in bf16, for the absorbed-MLA layout AbsorbedMLASelfAttention hands it: query
[s, b, heads, kv_lora + rope], key [s, b, 1, kv_lora + rope], the per-head V up-projection weight, the hidden
states x [s, b, h] and the query latent qr [s, b, q_lora]. The indexer's projections are plain bias-free linears
(what TE's duplicated Linear computes); its key norm a LayerNorm; Hadamard rotation off (fast_hadamard_transform is a
CUDA package). Storages are counted by the referee's LiveBytesTracker (livebytes.py). ``measure_attention`` runs
the whole AbsorbedMLASelfAttention around it (megatron-core's local parallel linears for the MLA projections);
``measure_shared`` a layer that reuses another's top-k (``--dsa-indexer-topk-freq``).

    /work/venv312/bin/python -m benchmarks.referee.dsa_probe [--seq 64 --heads 4 ...] [--no-loss]
    /work/venv312/bin/python -m benchmarks.referee.dsa_probe --grid benchmarks/results/referee-dsa-measured.json
    /work/venv312/bin/python -m benchmarks.referee.dsa_probe --grid-add benchmarks/results/referee-dsa-measured.json

Prints one JSON object: the shapes, the indexer's parameter count (its linears sized by DSAIndexer.__init__) and
{"saved", "fwd_peak", "bwd_peak"} in bytes (each above the inputs).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
from typing import Any


def _core_version() -> str:
    from importlib.metadata import version
    return version("megatron-core")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init_rank():
    """One gloo rank on CPU, and the stand-ins for TE's duplicated Linear and its LayerNorm."""
    import torch
    import torch.distributed as dist
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        dist.init_process_group("gloo", rank=0, world_size=1)
    # the indexer's RotaryEmbedding asks for the current CUDA device (it passes no use_cpu_initialization)
    torch.cuda.current_device = lambda: "cpu"
    # CheckpointWithoutOutput (mla_up_proj recompute) saves and restores the CUDA generator's state: a CPU one
    import megatron.core.tensor_parallel.random as mrandom
    gen = torch.Generator()
    mrandom._get_cuda_rng_state = lambda *_, **__: gen.get_state()
    mrandom._set_cuda_rng_state = lambda state, *_, **__: gen.set_state(state)
    # context parallelism: the rotary tables' slice of this CP rank (rope_utils.get_pos_emb_on_this_cp_rank pins and
    # moves its two chunk indices to the GPU): the same index_select on CPU
    import megatron.core.models.common.embeddings.rope_utils as rope_utils
    import megatron.core.models.common.embeddings.rotary_pos_embedding as rotary

    def pos_emb_on_this_cp_rank(pos_emb, seq_dim, cp_group):
        n, r = cp_group.size(), cp_group.rank()
        pos_emb = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * n, -1, *pos_emb.shape[seq_dim + 1:])
        pos_emb = pos_emb.index_select(seq_dim, torch.tensor([r, 2 * n - r - 1]))
        return pos_emb.view(*pos_emb.shape[:seq_dim], -1, *pos_emb.shape[seq_dim + 2:])
    rope_utils.get_pos_emb_on_this_cp_rank = rotary.get_pos_emb_on_this_cp_rank = pos_emb_on_this_cp_rank

    class Lin(torch.nn.Module):
        """A duplicated bias-free linear returning (output, bias) as TE's Linear does."""

        def __init__(self, inp: int, out: int, **_: Any) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(out, inp, dtype=torch.bfloat16) * 0.02)

        def forward(self, x):
            return torch.nn.functional.linear(x, self.weight), None

    class Norm(torch.nn.Module):
        def __init__(self, config: Any = None, hidden_size: int = 0, eps: float = 1e-5, **_: Any) -> None:
            super().__init__()
            self.ln = torch.nn.LayerNorm(hidden_size, eps=eps, dtype=torch.bfloat16)

        def forward(self, x):
            return self.ln(x)

    return Lin, Norm


def _core_setup(layers: int, hidden: int, heads: int, q_lora: int, kv_lora: int, qk_head: int, rope: int, v_head: int,
                index_heads: int, index_dim: int, topk: int, loss_coeff: float, **more: Any) -> tuple:
    """One gloo rank, the DSA config ``measure`` and ``measure_shared`` build their cores with (``more``: further
    TransformerConfig fields), DSAttention's submodules and the process groups: (cfg, spec, pgs)."""
    import torch
    import torch.distributed as dist
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.experimental_attention_variant.dsa import (DSAIndexer, DSAIndexerSubmodules,
                                                                              DSAttentionSubmodules)
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    Lin, Norm = _init_rank()
    cfg = MLATransformerConfig(
        num_layers=layers, hidden_size=hidden, num_attention_heads=heads, q_lora_rank=q_lora, kv_lora_rank=kv_lora,
        qk_head_dim=qk_head, qk_pos_emb_head_dim=rope, v_head_dim=v_head, rope_type="rope", add_bias_linear=False,
        apply_rope_fusion=False, bf16=True, params_dtype=torch.bfloat16, experimental_attention_variant="dsa",
        dsa_indexer_n_heads=index_heads, dsa_indexer_head_dim=index_dim, dsa_indexer_topk=topk,
        dsa_indexer_loss_coeff=loss_coeff, dsa_indexer_rotate_activation=False, use_cpu_initialization=True, **more)
    group = dist.group.WORLD
    spec = DSAttentionSubmodules(indexer=ModuleSpec(module=DSAIndexer, submodules=DSAIndexerSubmodules(
        linear_wq_b=Lin, linear_wk=Lin, k_norm=Norm, linear_weights_proj=Lin)))
    return cfg, spec, ProcessGroupCollection(tp=group, cp=group)


def measure(seq: int = 64, batch: int = 1, heads: int = 4, hidden: int = 64, q_lora: int = 32, kv_lora: int = 32,
            rope: int = 16, v_head: int = 16, qk_head: int = 16, index_heads: int = 4, index_dim: int = 32,
            topk: int = 16, loss_coeff: float = 0.01, sparse_loss: bool = False) -> dict[str, Any]:
    import torch
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.experimental_attention_variant.dsa import DSAttention

    from .livebytes import LiveBytesTracker

    cfg, spec, pgs = _core_setup(1, hidden, heads, q_lora, kv_lora, qk_head, rope, v_head, index_heads, index_dim, topk,
                                 loss_coeff, dsa_indexer_use_sparse_loss=sparse_loss)
    D = kv_lora + rope
    core = DSAttention(cfg, spec, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self",
                       softmax_scale=D ** -0.5, k_channels=D, v_channels=kv_lora, cp_comm_type="p2p",
                       pg_collection=pgs)
    core.train()
    bf = torch.bfloat16
    query = torch.randn(seq, batch, heads, D, dtype=bf, requires_grad=True)
    key = torch.randn(seq, batch, 1, D, dtype=bf, requires_grad=True)
    x = torch.randn(seq, batch, hidden, dtype=bf, requires_grad=True)
    qr = torch.randn(seq, batch, q_lora, dtype=bf, requires_grad=True)
    up_v = torch.randn(heads, v_head, kv_lora, dtype=bf, requires_grad=True)
    tracker = LiveBytesTracker(keep_log=False)
    with tracker:
        base = tracker.current
        with tracker.region("fwd"):
            out = core(query, key, None, None, x, qr, attn_mask_type=AttnMaskType.causal, up_v_weight=up_v)
        saved = tracker.current - base - out.untyped_storage().nbytes()
        grad = torch.ones_like(out)
        after_grad = tracker.current
        with tracker.region("bwd"):
            out.backward(grad)
        fwd = tracker.region_result("fwd")
        bwd = tracker.region_result("bwd")
    return {"seq": seq, "batch": batch, "heads": heads, "hidden": hidden, "q_lora": q_lora, "kv_lora": kv_lora,
            "rope": rope, "v_head": v_head, "index_heads": index_heads, "index_dim": index_dim, "topk": topk,
            "loss_coeff": loss_coeff, "sparse_loss": sparse_loss,
            "indexer_params": sum(p.numel() for p in core.parameters()),
            "saved": saved, "fwd_peak": fwd["peak_bytes"] - base, "bwd_peak": bwd["peak_bytes"] - after_grad}


def measure_shared(seq: int = 64, batch: int = 1, heads: int = 4, hidden: int = 64, q_lora: int = 32,
                   kv_lora: int = 32, rope: int = 16, v_head: int = 16, qk_head: int = 16, index_heads: int = 4,
                   index_dim: int = 32, topk: int = 16, loss_coeff: float = 0.01, mask: bool = False,
                   recompute_core: bool = False) -> dict[str, Any]:
    """Top-k sharing (``--dsa-indexer-topk-freq 2``): layer 1 computes its top-k, layer 2 reuses it
    (DSAttention.skip_topk: no indexer). Runs layer 1's forward, then measures layer 2's forward and backward as
    ``measure`` does, and the top-k the forward hands over (the dict DSAttention hangs on the config when the forward
    has no attention mask): its bytes, and whether it is still there after both backwards. ``mask``: the forwards get
    the dataloader's causal mask [b, 1, s, s] (bool, True above the diagonal), which then carries the dict; the mask
    is dropped before the backwards, and whether the top-k died with it is recorded. ``recompute_core``: each core
    under tensor_parallel.checkpoint as AbsorbedMLA runs it with ``--recompute-modules core_attn`` (no mask: its replay
    finds the top-k on the config)."""
    import weakref

    import torch
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.experimental_attention_variant.dsa import DSAttention

    from .livebytes import LiveBytesTracker

    cfg, spec, pgs = _core_setup(2, hidden, heads, q_lora, kv_lora, qk_head, rope, v_head, index_heads, index_dim, topk,
                                 loss_coeff, dsa_indexer_topk_freq=2)
    from megatron.core import parallel_state, tensor_parallel
    if recompute_core and not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    D = kv_lora + rope
    cores = [DSAttention(cfg, spec, layer_number=n, attn_mask_type=AttnMaskType.causal, attention_type="self",
                         softmax_scale=D ** -0.5, k_channels=D, v_channels=kv_lora, cp_comm_type="p2p",
                         pg_collection=pgs).train() for n in (1, 2)]
    bf = torch.bfloat16

    def inputs():
        return (torch.randn(seq, batch, heads, D, dtype=bf, requires_grad=True),
                torch.randn(seq, batch, 1, D, dtype=bf, requires_grad=True),
                torch.randn(seq, batch, hidden, dtype=bf, requires_grad=True),
                torch.randn(seq, batch, q_lora, dtype=bf, requires_grad=True),
                torch.randn(heads, v_head, kv_lora, dtype=bf, requires_grad=True))

    batch_mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), 1).view(1, 1, seq, seq).expand(
        batch, 1, seq, seq).contiguous() if mask else None

    def run(core, args):
        def forward(query, key, x, qr, up_v):
            return core(query, key, None, batch_mask, x, qr, attn_mask_type=AttnMaskType.causal, up_v_weight=up_v)
        return tensor_parallel.checkpoint(forward, False, *args) if recompute_core else forward(*args)

    first, second = inputs(), inputs()
    out1 = run(cores[0], first)
    holder = getattr(batch_mask if mask else cfg, DSAttention._HOLDER_ATTR)
    shared = holder[1]
    on_config = getattr(cfg, DSAttention._HOLDER_ATTR, None) is not None
    del holder
    tracker = LiveBytesTracker(keep_log=False)
    with tracker:
        base = tracker.current
        with tracker.region("fwd"):
            out2 = run(cores[1], second)
        saved = tracker.current - base - out2.untyped_storage().nbytes()
        grad = torch.ones_like(out2)
        after_grad = tracker.current
        if mask:
            batch_mask = None                 # (the forward step returns: its batch goes)
        with tracker.region("bwd"):
            out2.backward(grad)
    handed = {"topk_bytes": shared.untyped_storage().nbytes(), "topk_dtype": str(shared.dtype)}
    alive = weakref.ref(shared)
    del shared
    out1.backward(torch.ones_like(out1))
    kept = getattr(cfg, DSAttention._HOLDER_ATTR, {}).get(1)
    return {"seq": seq, "batch": batch, "heads": heads, "hidden": hidden, "q_lora": q_lora, "kv_lora": kv_lora,
            "rope": rope, "v_head": v_head, "index_heads": index_heads, "index_dim": index_dim, "topk": topk,
            "loss_coeff": loss_coeff, "skip_layer_params": sum(p.numel() for p in cores[1].parameters()),
            **handed, "holder_on_config": on_config, **({"mask": True} if mask else {}),
            **({"recompute_core": True} if recompute_core else {}),
            "topk_kept_after_backward": kept.untyped_storage().nbytes() if kept is not None else 0,
            "topk_alive_after_backward": alive() is not None,
            "saved": saved, "fwd_peak": tracker.region_result("fwd")["peak_bytes"] - base,
            "bwd_peak": tracker.region_result("bwd")["peak_bytes"] - after_grad}


def measure_attention(seq: int = 64, batch: int = 1, heads: int = 4, hidden: int = 64, q_lora: int = 32,
                      kv_lora: int = 32, rope: int = 16, v_head: int = 16, qk_head: int = 16, index_heads: int = 4,
                      index_dim: int = 32, topk: int = 16, loss_coeff: float = 0.01,
                      qk_layernorm: bool = False, tp: int = 1, recompute_up: bool = False,
                      cp: int = 1, recompute_core: bool = False) -> dict[str, Any]:
    """The whole AbsorbedMLASelfAttention (DSA's attention layer without its input norm) on one gloo rank, TP 1:
    megatron-core's local ColumnParallelLinear / RowParallelLinear for the projections, LayerNorms for the latent
    norms (with ``qk_layernorm``), the real DSAttention and DSAIndexer as in ``measure``. Input: the input norm's
    output [s, b, h]. ``recompute_up``: ``--recompute-modules mla_up_proj`` (the query and key made under
    CheckpointWithoutOutput, freed after the core and remade in the backward); ``recompute_core``: ``--recompute-modules
    core_attn`` (DSAttention under tensor_parallel.checkpoint, run without autograd and replayed in the backward). Returns the bytes kept after the forward
    (without the output) and the two peaks."""
    import torch
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.experimental_attention_variant.absorbed_mla import (
        AbsorbedMLASelfAttention, AbsorbedMLASelfAttentionSubmodules)
    from megatron.core.transformer.experimental_attention_variant.dsa import (DSAIndexer, DSAIndexerSubmodules,
                                                                              DSAttention, DSAttentionSubmodules)
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from .livebytes import LiveBytesTracker

    Lin, Norm = _init_rank()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tp, 1, context_parallel_size=cp)
    down = ColumnParallelLinear
    if tp > 1:
        from megatron.core.transformer.experimental_attention_variant import absorbed_mla
        absorbed_mla.TELinear = Lin
        down = Lin
    cfg = MLATransformerConfig(
        num_layers=1, hidden_size=hidden, num_attention_heads=heads, q_lora_rank=q_lora, kv_lora_rank=kv_lora,
        qk_head_dim=qk_head, qk_pos_emb_head_dim=rope, v_head_dim=v_head, rope_type="rope", add_bias_linear=False,
        apply_rope_fusion=False, bf16=True, params_dtype=torch.bfloat16, experimental_attention_variant="dsa",
        dsa_indexer_n_heads=index_heads, dsa_indexer_head_dim=index_dim, dsa_indexer_topk=topk,
        dsa_indexer_loss_coeff=loss_coeff, dsa_indexer_rotate_activation=False, use_cpu_initialization=True,
        transformer_impl="local", qk_layernorm=qk_layernorm, gradient_accumulation_fusion=False,
        normalization="LayerNorm", tensor_model_parallel_size=tp, sequence_parallel=tp > 1,
        context_parallel_size=cp, cp_comm_type="allgather" if cp > 1 else "p2p",
        **(dict(recompute_granularity="selective",
                recompute_modules=["mla_up_proj"] * recompute_up + ["core_attn"] * recompute_core)
           if recompute_up or recompute_core else {}))
    core = ModuleSpec(module=DSAttention, submodules=DSAttentionSubmodules(indexer=ModuleSpec(
        module=DSAIndexer, submodules=DSAIndexerSubmodules(linear_wq_b=Lin, linear_wk=Lin, k_norm=Norm,
                                                           linear_weights_proj=Lin))))
    qk_norm = Norm if qk_layernorm else IdentityOp
    sub = AbsorbedMLASelfAttentionSubmodules(
        linear_q_proj=ColumnParallelLinear, linear_q_down_proj=down,
        linear_q_up_proj=ColumnParallelLinear, linear_kv_down_proj=down,
        linear_kv_up_proj=ColumnParallelLinear, core_attention=core, linear_proj=RowParallelLinear,
        q_layernorm=qk_norm, kv_layernorm=qk_norm)
    att = AbsorbedMLASelfAttention(cfg, sub, layer_number=1, attn_mask_type=AttnMaskType.causal,
                                   **({"cp_comm_type": "allgather"} if cp > 1 else {}))
    att.train()
    seq //= cp                                  # the rank's share of the sequence
    if tp > 1 or cp > 1:
        x = torch.randn(seq // tp, batch, hidden, dtype=torch.bfloat16, requires_grad=True)
        out, _ = att(x, None)
        out.backward(torch.ones_like(out))
        for p in att.parameters():
            p.grad = None
    x = torch.randn(seq // tp, batch, hidden, dtype=torch.bfloat16, requires_grad=True)
    tracker = LiveBytesTracker(keep_log=False)
    with tracker:
        base = tracker.current
        with tracker.region("fwd"):
            out, _ = att(x, None)
        saved = tracker.current - base - out.untyped_storage().nbytes()
        grad = torch.ones_like(out)
        after_grad = tracker.current
        with tracker.region("bwd"):
            out.backward(grad)
    return {"seq": seq, "batch": batch, "heads": heads, "hidden": hidden, "q_lora": q_lora, "kv_lora": kv_lora,
            "rope": rope, "v_head": v_head, "qk_head": qk_head, "index_heads": index_heads, "index_dim": index_dim,
            "topk": topk, "loss_coeff": loss_coeff, "qk_layernorm": qk_layernorm, "tp": tp,
            **({"cp": cp, "seq": seq * cp} if cp > 1 else {}),
            **({"recompute_up": True} if recompute_up else {}),
            **({"recompute_core": True} if recompute_core else {}), "saved": saved,
            "fwd_peak": tracker.region_result("fwd")["peak_bytes"] - base,
            "bwd_peak": tracker.region_result("bwd")["peak_bytes"] - after_grad}


def _tp_rank(rank: int, tp: int, port: int, out: str, kw: dict[str, Any]) -> None:
    import torch.distributed as dist
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=tp * kw.get("cp", 1))
    r = measure_attention(tp=tp, **kw)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(r, f)
    dist.destroy_process_group()


def measure_attention_tp(tp: int = 2, **kw: Any) -> dict[str, Any]:
    """``measure_attention`` on ``tp`` gloo ranks with sequence parallelism (``tp`` x ``cp`` ranks with ``cp`` in
    ``kw``: context parallelism, allgather): rank 0's figures."""
    import tempfile

    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "rank0.json")
        mp.spawn(_tp_rank, args=(tp, _free_port(), out, kw), nprocs=tp * kw.get("cp", 1))
        with open(out) as f:
            return json.load(f)


# the stored grid (benchmarks/results/referee-dsa-measured.json, tests/test_dsa.py): the default shapes and one change
GRID: dict[str, dict[str, Any]] = {
    "base_loss": {},
    "base_noloss": {"loss_coeff": 0.0},
    "seq128": {"seq": 128},
    "heads8": {"heads": 8},
    "batch2": {"batch": 2},
    "indexer_heavy_loss": {"heads": 1, "index_heads": 32},
    "indexer_heavy_noloss": {"heads": 1, "index_heads": 32, "loss_coeff": 0.0},
    "seq128_topk64_sparse": {"seq": 128, "topk": 64, "sparse_loss": True},
}


# the whole absorbed-MLA attention layer (measure_attention)
ATTENTION_GRID: dict[str, dict[str, Any]] = {
    "loss": {},
    "noloss": {"loss_coeff": 0.0},
    "latent_norms": {"qk_layernorm": True},
    "batch2_seq128": {"batch": 2, "seq": 128},
    # --recompute-modules mla_up_proj (CheckpointWithoutOutput around the up projections and the rope)
    "up_recompute_loss": {"recompute_up": True},
    "up_recompute_noloss": {"loss_coeff": 0.0, "recompute_up": True},
    "up_recompute_latent_norms": {"qk_layernorm": True, "recompute_up": True},
    "up_recompute_batch2_seq128": {"batch": 2, "seq": 128, "recompute_up": True},
    # --recompute-modules core_attn (tensor_parallel.checkpoint around DSAttention: a no-grad forward, a replay)
    "core_recompute_loss": {"recompute_core": True},
    "core_recompute_noloss": {"loss_coeff": 0.0, "recompute_core": True},
}


# the same on two ranks, TP 2 with sequence parallelism (measure_attention_tp)
ATTENTION_TP2_GRID: dict[str, dict[str, Any]] = {
    "loss": {},
    "noloss": {"loss_coeff": 0.0},
    "up_recompute_loss": {"recompute_up": True},
    "up_recompute_noloss": {"loss_coeff": 0.0, "recompute_up": True},
}


# context parallelism 2 (allgather), two gloo ranks (TP 1) or four (TP 2 with SP): rank 0's figures
ATTENTION_CP2_GRID: dict[str, dict[str, Any]] = {
    "noloss": {"loss_coeff": 0.0, "cp": 2},
    "loss": {"cp": 2},
    "batch2_seq128_noloss": {"loss_coeff": 0.0, "batch": 2, "seq": 128, "cp": 2},
    "tp2_noloss": {"loss_coeff": 0.0, "cp": 2, "tp": 2},
    # with core_attn or mla_up_proj recomputed
    "core_recompute_noloss": {"loss_coeff": 0.0, "cp": 2, "recompute_core": True},
    "core_recompute_loss": {"cp": 2, "recompute_core": True},
    "core_recompute_batch2_seq128_noloss": {"loss_coeff": 0.0, "batch": 2, "seq": 128, "cp": 2, "recompute_core": True},
    "core_recompute_tp2_noloss": {"loss_coeff": 0.0, "cp": 2, "tp": 2, "recompute_core": True},
    "up_recompute_noloss": {"loss_coeff": 0.0, "cp": 2, "recompute_up": True},
    "up_recompute_loss": {"cp": 2, "recompute_up": True},
    "up_recompute_batch2_seq128_noloss": {"loss_coeff": 0.0, "batch": 2, "seq": 128, "cp": 2, "recompute_up": True},
    "up_recompute_tp2_noloss": {"loss_coeff": 0.0, "cp": 2, "tp": 2, "recompute_up": True},
    "core_up_recompute_loss": {"cp": 2, "recompute_core": True, "recompute_up": True},
}


# top-k sharing (--dsa-indexer-topk-freq 2): the layer reusing layer 1's top-k
SHARED_GRID: dict[str, dict[str, Any]] = {
    "shared_noloss": {"loss_coeff": 0.0},
    "shared_loss": {},
    "shared_batch2_seq128_noloss": {"loss_coeff": 0.0, "batch": 2, "seq": 128},
    "shared_heads8_topk64": {"loss_coeff": 0.0, "heads": 8, "topk": 64},
    "shared_mask_noloss": {"loss_coeff": 0.0, "mask": True},
    "shared_mask_loss": {"mask": True},
    "shared_core_recompute_noloss": {"loss_coeff": 0.0, "recompute_core": True},
    "shared_core_recompute_batch2_seq128_loss": {"batch": 2, "seq": 128, "recompute_core": True},
}


def _add_missing(path: str) -> None:
    """Measure the GRID / ATTENTION_GRID / ATTENTION_TP2_GRID / ATTENTION_CP2_GRID / SHARED_GRID entries ``path`` lacks
    and add them to it (the stored ones stay as they are)."""
    with open(path) as f:
        result = json.load(f)
    for part, grid, run in (("runs", GRID, measure), ("attention", ATTENTION_GRID, measure_attention),
                            ("attention_tp2", ATTENTION_TP2_GRID, lambda **kw: measure_attention_tp(2, **kw)),
                            ("attention_cp2", ATTENTION_CP2_GRID,
                             lambda tp=1, **kw: measure_attention_tp(tp, **kw)),
                            ("shared", SHARED_GRID, measure_shared)):
        for name, kw in grid.items():
            if name not in result.setdefault(part, {}):
                result[part][name] = run(**kw)
                with open(path, "w") as f:        # after each entry: a long grid keeps what it measured
                    json.dump(result, f, indent=1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--topk", type=int, default=16)
    p.add_argument("--index-heads", type=int, default=4)
    p.add_argument("--no-loss", action="store_true")
    p.add_argument("--sparse-loss", action="store_true")
    p.add_argument("--grid", metavar="OUT", help="measure every GRID entry and write them to OUT (JSON)")
    p.add_argument("--grid-add", metavar="FILE", help="measure the grid entries FILE (JSON) lacks and add them to it")
    o = p.parse_args()
    if o.grid_add:
        _add_missing(o.grid_add)
        return
    if o.grid:
        import torch
        result = {"source": f"benchmarks/referee/dsa_probe.py, megatron-core {_core_version()}, torch {torch.__version__}, CPU",
                  "runs": {name: measure(**kw) for name, kw in GRID.items()},
                  "attention": {name: measure_attention(**kw) for name, kw in ATTENTION_GRID.items()},
                  "attention_tp2": {name: measure_attention_tp(2, **kw) for name, kw in ATTENTION_TP2_GRID.items()}}
        with open(o.grid, "w") as f:
            json.dump(result, f, indent=1)
        return
    print(json.dumps(measure(seq=o.seq, batch=o.batch, heads=o.heads, topk=o.topk, index_heads=o.index_heads,
                             loss_coeff=0.0 if o.no_loss else 0.01, sparse_loss=o.sparse_loss)))


if __name__ == "__main__":
    main()
