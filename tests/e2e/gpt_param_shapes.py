"""Parameter names and shapes of megatron-core's own GPT model (standard attention, local spec).

    python tests/e2e/gpt_param_shapes.py '{"num_layers": 2, "hidden_size": 256, ...}'

Builds megatron-core's GPTModel (local spec, TP = PP = 1) on CPU with the referee's shims and prints
{name: shape} as JSON: the shapes SOAP's Kronecker factors depend on, and the output gate's rows of linear_qkv
(``attention_output_gate``).
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def build(cfg: dict):
    from single_rank import start   # beside this script (sys.path[0])
    start()
    import torch
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=cfg["num_layers"], hidden_size=cfg["hidden_size"], num_attention_heads=cfg["heads"],
        num_query_groups=cfg.get("groups"), ffn_hidden_size=cfg["ffn"], add_bias_linear=cfg["bias"],
        gated_linear_unit=cfg["glu"], attention_output_gate=cfg["gate"], use_cpu_initialization=True,
        params_dtype=torch.float32)
    spec = get_gpt_layer_local_spec(None, False, False, False, normalization="LayerNorm")
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=cfg["vocab"],
                    max_sequence_length=cfg["seq"], position_embedding_type=cfg["pos"],
                    share_embeddings_and_output_weights=True)


if __name__ == "__main__":
    model = build(json.loads(sys.argv[1]))
    print(json.dumps({n: list(p.shape) for n, p in model.named_parameters()}))
