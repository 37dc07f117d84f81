"""Parameter names and sizes of megatron-core's own GPT model with multi-latent attention.

    python tests/e2e/mla_param_count.py '{"num_layers": 2, "hidden_size": 512, ...}'

Builds megatron-core's GPTModel (local MLA spec, TP = PP = 1) on CPU with the referee's shims and
prints {name: numel} as JSON. At TP 1 the local spec holds the same parameters as the TE spec: the
TE spec only moves the pre-MLP norm into linear_fc1 and the latent norms into the up projections.
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
    from megatron.core.transformer.transformer_config import MLATransformerConfig
    import megatron.core.transformer.multi_latent_attention as mla

    config = MLATransformerConfig(
        num_layers=cfg["num_layers"], hidden_size=cfg["hidden_size"], num_attention_heads=cfg["heads"],
        ffn_hidden_size=cfg["ffn"], multi_latent_attention=True, q_lora_rank=cfg["q_lora"],
        kv_lora_rank=cfg["kv_lora"], qk_head_dim=cfg["qk"], qk_pos_emb_head_dim=cfg["pe"], v_head_dim=cfg["v"],
        normalization=cfg["norm"], add_bias_linear=cfg["bias"], qk_layernorm=cfg["qk_ln"],
        gated_linear_unit=cfg["glu"], use_cpu_initialization=True, params_dtype=torch.float32,
        rope_type="rope", apply_rope_fusion=False)
    # Without TE, MLASelfAttention's isinstance checks need a class that nothing is an instance of.
    for name in ("TELinear", "TEColumnParallelLinear"):
        if not isinstance(getattr(mla, name, None), type):
            setattr(mla, name, type(name, (), {}))

    class NoParamsAttention(torch.nn.Module):
        # megatron-core 0.16.1's local DotProductAttention takes no k_channels (MLA's query/key head
        # dim); the core attention holds no parameters, so a stand-in leaves the count unchanged.
        def __init__(self, *args, **kwargs):
            super().__init__()

    spec = get_gpt_layer_local_spec(None, False, cfg["qk_ln"], True, normalization=cfg["norm"])
    spec.submodules.self_attention.submodules.core_attention = NoParamsAttention
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=cfg["vocab"],
                    max_sequence_length=cfg["seq"], position_embedding_type=cfg["pos"],
                    share_embeddings_and_output_weights=not cfg.get("untie", False))


if __name__ == "__main__":
    model = build(json.loads(sys.argv[1]))
    print(json.dumps({n: p.numel() for n, p in model.named_parameters()}))
