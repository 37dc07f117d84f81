"""Parameter names and sizes of megatron-core's own heterogeneous GPT (HeterogeneousTransformerConfig +
get_gpt_heterogeneous_layer_spec, local spec, TP = PP = 1) built on CPU.

    python tests/e2e/heterogeneous_param_count.py BLOCKS.json '{"num_layers": 4, "hidden_size": 512, ...}'

prints {name: numel} as JSON (the last line).
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def build(blocks_path: str, cfg: dict):
    from benchmarks.referee import shims
    shims.install()
    import torch
    import torch.nn.functional as F
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29541")
    torch.distributed.init_process_group(backend="gloo", rank=0, world_size=1)
    from megatron.core import parallel_state as mpu
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.heterogeneous.heterogeneous_layer_specs import get_gpt_heterogeneous_layer_spec
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.heterogeneous.heterogeneous_config import HeterogeneousTransformerConfig

    mpu.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1)
    config = HeterogeneousTransformerConfig(
        num_layers=cfg["num_layers"], hidden_size=cfg["hidden_size"], num_attention_heads=cfg["heads"],
        num_query_groups=cfg["groups"], ffn_hidden_size=cfg["ffn"], normalization="RMSNorm", add_bias_linear=False,
        gated_linear_unit=True, activation_func=F.silu, use_cpu_initialization=True, params_dtype=torch.float32,
        persist_layer_norm=False, heterogeneous_layers_config_path=blocks_path)
    spec = get_gpt_heterogeneous_layer_spec(config, use_te=False)
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=cfg["vocab"],
                    max_sequence_length=cfg["seq"], position_embedding_type="rope",
                    share_embeddings_and_output_weights=False)


if __name__ == "__main__":
    model = build(sys.argv[1], json.loads(sys.argv[2]))
    print(json.dumps({n: p.numel() for n, p in model.named_parameters()}))
