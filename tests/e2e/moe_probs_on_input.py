"""Bytes autograd keeps saved by megatron-core's own SequentialMLP (the experts without grouped GEMM), with and
without --moe-apply-probs-on-input, on CPU.

    python tests/e2e/moe_probs_on_input.py     # prints {"plain": bytes, "probs_on_input": bytes}

Two local experts (40 and 56 of N = 96 dispatched tokens), h 64, F 128, SwiGLU unfused, top-1, fp32, no bias;
one rank (a one-rank gloo group, model-parallel groups that answer only size() and rank(), as
moe_rank_params.py sets them). The dispatched tokens and probs are non-leaf tensors, as the dispatcher's output
is; the experts' weights are not counted; distinct storages once the forward returns.
"""
import gc
import json
import os
import sys
import tempfile
import weakref

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

N, H, F, SPLIT = 96, 64, 128, (40, 56)


def _experts(flag: bool):
    import torch
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.transformer_config import TransformerConfig
    cfg = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=4, ffn_hidden_size=F, num_moe_experts=2,
                            moe_router_topk=1, moe_router_pre_softmax=True, add_bias_linear=False,
                            use_cpu_initialization=True, params_dtype=torch.float32, gated_linear_unit=True,
                            activation_func=torch.nn.functional.silu, bias_activation_fusion=False,
                            gradient_accumulation_fusion=False, moe_apply_probs_on_input=flag)
    return SequentialMLP(2, cfg, MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
                         pg_collection=get_default_pg_collection())


def saved_bytes(flag: bool) -> int:
    import torch
    mlp = _experts(flag)
    torch.manual_seed(0)
    x = torch.randn(N, H, requires_grad=True) * 1.0
    probs = torch.rand(N, requires_grad=True) * 1.0
    refs = []

    class Box:
        __slots__ = ("t", "__weakref__")

        def __init__(self, t):
            self.t = t

    def pack(t):
        b = Box(t)
        refs.append(weakref.ref(b))
        return b
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda b: b.t):
        out, _ = mlp(x, torch.tensor(SPLIT), probs)
    gc.collect()
    weights = {p.untyped_storage().data_ptr() for p in mlp.parameters()}
    seen = {}
    for r in refs:
        b = r()
        if b is not None:
            s = b.t.untyped_storage()
            if s.data_ptr() not in weights:
                seen[s.data_ptr()] = s.nbytes()
    del out
    return sum(seen.values())


def main() -> None:
    import torch
    from megatron.core import parallel_state as ps
    from moe_rank_params import _Group, _set_ranks
    with tempfile.TemporaryDirectory() as d:
        torch.distributed.init_process_group("gloo", init_method=f"file://{d}/store", rank=0, world_size=1)
        _set_ranks(dict(tp=1, pp=1, ep=1, etp=1), 0, None, 0, 0, 0)
        for name in ("_EXPERT_DATA_PARALLEL_GROUP", "_TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP", "_CONTEXT_PARALLEL_GROUP"):
            setattr(ps, name, _Group(1, 0))
        print(json.dumps({"plain": saved_bytes(False), "probs_on_input": saved_bytes(True)}))
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
