"""Which layers of megatron-core's own hybrid model the TE CUDA-graph helper captures, and the bytes of each
one's static inputs, on CPU (the small model of mamba_param_count.py, TP = PP = 1).

    python tests/e2e/hybrid_graph_inputs.py '{"pattern": "M*M-/*-", ..., "modules": ["mamba"]}'

prints, as JSON (the last line), one entry per decoder layer and then per MTP depth: [graphable, bytes of the
static inputs get_layer_static_inputs builds]. It asks megatron-core's own ``_layer_is_graphable``
(transformer/cuda_graphs.py) of ``decoder.layers[i]`` and ``mtp.layers[i].mtp_model_layer``, as
TECudaGraphHelper._discover_layers does (0.19.2; 0.16.1: the decoder only, ``cuda_graph_scope``).
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main(cfg: dict) -> list:
    import torch
    from mamba_param_count import build
    try:
        from megatron.core.transformer.enums import CudaGraphModule as Mod
        field = "cuda_graph_modules"
    except ImportError:
        from megatron.core.transformer.enums import CudaGraphScope as Mod     # megatron-core 0.16.1 / 0.17.1
        field = "cuda_graph_scope"
    cfg = dict(cfg, config={"cuda_graph_impl": "transformer_engine", field: [Mod[m] for m in cfg.get("modules", [])],
                            "bf16": True})
    model = build(cfg)
    from megatron.core.transformer.cuda_graphs import _layer_is_graphable
    layers = list(model.decoder.layers)
    if getattr(model, "mtp", None) is not None:
        layers += [m.mtp_model_layer for m in model.mtp.layers]
    out = []
    for layer in layers:
        ok = bool(_layer_is_graphable(layer, model.config))
        nbytes = 0
        if ok:
            inputs = layer.get_layer_static_inputs(cfg["seq"], cfg.get("mbs", 1))
            nbytes = sum(t.numel() * t.element_size() for t in inputs.values())
        out.append([ok, nbytes])
    return out


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
