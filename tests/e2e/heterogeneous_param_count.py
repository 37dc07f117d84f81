"""Parameter names and sizes of megatron-core's own heterogeneous GPT (HeterogeneousTransformerConfig +
get_gpt_heterogeneous_layer_spec, local spec, TP = PP = 1) built on CPU.

    python tests/e2e/heterogeneous_param_count.py BLOCKS.json '{"num_layers": 4, "hidden_size": 512, ...}'

prints {name: numel} as JSON (the last line). With "experts" in the config the model is a mixture of experts and
the layer spec is the one megatron/training 0.19.2 (models/gpt.py default_layer_spec) takes first for it:
get_gpt_decoder_block_spec (the --moe-layer-freq pattern "freq" of MoE / dense layers), built by TransformerBlock
from each layer's get_config_for_layer. With "mtp" (depths) the MTP block is models/gpt.py mtp_block_spec's:
get_gpt_mtp_block_spec of get_gpt_decoder_layer_specs(config)[-1].
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def build(blocks_path: str, cfg: dict):
    from single_rank import start   # beside this script (sys.path[0])
    start()
    import torch
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.heterogeneous.heterogeneous_layer_specs import get_gpt_heterogeneous_layer_spec
    from megatron.core.transformer.heterogeneous.heterogeneous_config import HeterogeneousTransformerConfig

    moe = {}
    if cfg.get("experts"):
        moe = dict(num_moe_experts=cfg["experts"], moe_ffn_hidden_size=cfg.get("moe_ffn"),
                   moe_router_topk=cfg.get("topk", 2), moe_layer_freq=cfg.get("freq", 1),
                   moe_shared_expert_intermediate_size=cfg.get("shared_ffn"), moe_grouped_gemm=False,
                   moe_token_dispatcher_type="alltoall")
    config = HeterogeneousTransformerConfig(
        num_layers=cfg["num_layers"], hidden_size=cfg["hidden_size"], num_attention_heads=cfg["heads"],
        num_query_groups=cfg["groups"], ffn_hidden_size=cfg["ffn"], normalization="RMSNorm", add_bias_linear=False,
        gated_linear_unit=True, activation_func=F.silu, use_cpu_initialization=True, params_dtype=torch.float32,
        persist_layer_norm=False, heterogeneous_layers_config_path=blocks_path, mtp_num_layers=cfg.get("mtp"), **moe)
    if moe:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    else:
        spec = get_gpt_heterogeneous_layer_spec(config, use_te=False)
    mtp = None
    if cfg.get("mtp"):
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_layer_specs, get_gpt_mtp_block_spec
        last = get_gpt_decoder_layer_specs(config, use_transformer_engine=False, normalization="RMSNorm")[-1]
        mtp = get_gpt_mtp_block_spec(config, last, use_transformer_engine=False)
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=cfg["vocab"],
                    max_sequence_length=cfg["seq"], position_embedding_type="rope",
                    share_embeddings_and_output_weights=False, **({"mtp_block_spec": mtp} if mtp else {}))


if __name__ == "__main__":
    model = build(sys.argv[1], json.loads(sys.argv[2]))
    print(json.dumps({n: p.numel() for n, p in model.named_parameters()}))
