"""Builds a Megatron-Bridge 0.6.2 PEFT recipe's model on CPU and applies the recipe's own PEFT object to it, as
Bridge's training setup does (megatron/bridge/peft/base.py PEFT.__call__: freeze the model, wrap the targets);
``peft_model.py RECIPE_FUNCTION SCHEME LAYERS PORT [TARGETS]`` prints one JSON line: the trainable and frozen
parameter counts of a model of LAYERS decoder layers (the recipe's shape otherwise; fewer layers keep the CPU build
small: every layer is the same), the trainable count per layer, the names of the wrapped modules and every
parameter's name, shape, dtype and trainability (what a forked build is compared by with a new interpreter's). TARGETS
(comma-separated) replaces the PEFT object's target_modules. megatron-core's local layer spec stands in for
Transformer Engine's (no GPU): the adapters take the same in / out features from either linear
(peft/utils.py get_adapter_attributes_from_linear)."""
import json
import os
import sys

import torch

fn, scheme, layers, port = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
targets = sys.argv[5].split(",") if len(sys.argv) > 5 else None
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK="0", WORLD_SIZE="1")
torch.distributed.init_process_group("gloo")
from megatron.core import parallel_state  # noqa: E402
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed  # noqa: E402

parallel_state.initialize_model_parallel(1, 1)
import megatron.core.transformer.transformer_block as block  # noqa: E402

# (the Transformer Engine stand-in has no activation-offload context; none is used without cpu_offloading)
block.get_cpu_offload_context = None
from megatron.core.transformer.torch_norm import WrappedTorchNorm  # noqa: E402

block.LayerNormImpl = WrappedTorchNorm     # (the final norm: frozen, not wrapped)
import megatron.bridge.recipes as recipes  # noqa: E402

cfg = getattr(recipes, fn)(peft_scheme=scheme)
m = cfg.model
m.num_layers = layers
m.transformer_impl = "local"
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402

m.transformer_layer_spec = get_gpt_layer_local_spec(normalization=m.normalization, qk_layernorm=m.qk_layernorm)
m.use_cpu_initialization = True
m.perform_initialization = False
m.persist_layer_norm = False   # (TE's fused norm option; torch's norm refuses it)
m.gradient_accumulation_fusion = False   # (needs APEX / TE's fused wgrad kernels)
m.params_dtype = torch.bfloat16
m.vocab_size = 1024          # (the embedding is frozen; a small one keeps the build quick)
m.finalize()
try:
    model_parallel_cuda_manual_seed(1234)
except Exception:            # (no CUDA: the local spec's dropout needs no CUDA RNG tracker on CPU)
    pass
model = m.provide(pre_process=True, post_process=True)
if targets:
    cfg.peft.target_modules = targets
model = cfg.peft(model, training=True)
wrapped = sorted(n for n, mod in model.named_modules() if hasattr(mod, "adapter"))
train = sum(p.numel() for p in model.parameters() if p.requires_grad)
frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
print(json.dumps({"trainable": train, "frozen": frozen, "per_layer": train // layers,
                  "dim": cfg.peft.dim, "class": type(cfg.peft).__name__, "wrapped": wrapped,
                  "parameters": [[n, list(p.shape), str(p.dtype), p.requires_grad] for n, p in model.named_parameters()]}))
torch.distributed.destroy_process_group()
