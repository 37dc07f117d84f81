"""Builds Megatron-Bridge 0.6.2's real LoRA / DoRA adapters (megatron/bridge/peft/utils.py ParallelLinearAdapter,
dora_layers.py ParallelLinearDoRAAdapter) for one layer of Llama-3.2-1B's shape on CPU (gloo). Run as
``peft_adapters.py RANK TP PORT``, one process per TP rank (tests/test_bridge_real.py); rank 0 prints one JSON line:
``params``: per scheme (lora, dora), the trainable parameters of each target on this TP rank; with TP 1 also
``saved``: per dropout probability (0.0, 0.1), each LoRA adapter's forward on a [s, b, in] bf16 input and, per
target, the bytes of what autograd saves for backward (torch.autograd.graph.saved_tensors_hooks; parameters left
out, one count per storage) and whether the input itself is among them. One process per rank for everything: the
tests fork them from a server that has imported Bridge (tests/test_bridge_real.py PEFT_SERVER), whose import took
most of a new interpreter's time."""
import json
import os
import sys

import torch

rank, tp, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), WORLD_SIZE=str(tp))
torch.distributed.init_process_group("gloo")
from megatron.core import parallel_state  # noqa: E402

parallel_state.initialize_model_parallel(tp, 1)
from megatron.core.model_parallel_config import ModelParallelConfig  # noqa: E402
from megatron.bridge.peft.dora_layers import ParallelLinearDoRAAdapter  # noqa: E402
from megatron.bridge.peft.utils import ParallelLinearAdapter  # noqa: E402

cfg = ModelParallelConfig(tensor_model_parallel_size=tp, use_cpu_initialization=True, bf16=True,
                          params_dtype=torch.bfloat16)
h, ffn, qkv = 2048, 8192, (32 + 2 * 8) * 64      # Llama-3.2-1B: 32 heads, 8 query groups, head dim 64
targets = {"linear_qkv": (h, qkv, False), "linear_proj": (h, h, True), "linear_fc1": (h, 2 * ffn, False),
           "linear_fc2": (ffn, h, True)}   # (in, out, input_is_parallel), as get_adapter_attributes_from_linear gives


def saved_for_backward(dropout: float) -> dict:
    S, B, R = 64, 2, 32
    out = {}
    for name, (i, o, row) in targets.items():
        a = ParallelLinearAdapter(i, o, R, base_linear_name="decoder.layers.0." + name, activation="identity",
                                  input_is_parallel=row, model_parallel_config=cfg, alpha=32, dropout=dropout)
        a.train()
        x = torch.randn(S, B, i // tp if row else i, dtype=torch.bfloat16, requires_grad=True)
        params = {p.data_ptr() for p in a.parameters()}
        saved: dict[int, int] = {}

        def pack(t):
            ptr = t.untyped_storage().data_ptr()
            if ptr not in params:
                saved[ptr] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = a(x)
        out[name] = {"bytes": sum(saved.values()), "input_kept": x.untyped_storage().data_ptr() in saved,
                     "tokens": S * B, "in": x.shape[-1], "r": R}
        del y
    return out


def trainable(scheme: str) -> dict:
    out = {}
    for name, (i, o, row) in targets.items():
        cls = ParallelLinearDoRAAdapter if scheme == "dora" else ParallelLinearAdapter
        a = cls(i, o, 32, base_linear_name="decoder.layers.0." + name, activation="identity", input_is_parallel=row,
                model_parallel_config=cfg, alpha=32)
        n = sum(p.numel() for p in a.parameters() if p.requires_grad)
        if scheme == "dora":
            # DoRALinear.__init__ sets weight_magnitude to the norms of the wrapped weight's local rows
            n += o // tp if not row else o
        out[name] = n
    return out


result = {"params": {s: trainable(s) for s in ("lora", "dora")}}
if tp == 1:
    result["saved"] = {str(d): saved_for_backward(d) for d in (0.0, 0.1)}
if rank == 0:
    print(json.dumps(result))
torch.distributed.destroy_process_group()
