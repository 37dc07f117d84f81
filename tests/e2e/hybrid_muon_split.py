"""Which parameters of megatron-core's own hybrid model an emerging optimizer (Muon, Lion, SOAP) updates, and which
fall back to Adam, on CPU (the small model of mamba_param_count.py, TP = PP = 1).

    python tests/e2e/hybrid_muon_split.py '{"pattern": "M*M-", ...}'

prints {name: [numel, managed]} as JSON (the last line): ``managed`` is megatron-core's own answer, 0.19.2's
``is_managed_by_layer_wise_optimizer`` (optimizer/layer_wise_optimizer.py: a 2-D parameter that is not the embedding
or output layer; the emerging optimizer's ``_is_nonlinear_or_embedding`` is its negation), or on releases without it
the same test 0.16.1's get_megatron_muon_optimizer writes inline (optimizer/muon.py: len(param.shape) == 2 and not
is_embedding_or_output_parameter).
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main(cfg: dict) -> dict:
    from mamba_param_count import build
    model = build(cfg)
    try:
        from megatron.core.optimizer.layer_wise_optimizer import is_managed_by_layer_wise_optimizer as managed
    except ImportError:
        def managed(p):
            return len(p.shape) == 2 and not getattr(p, "is_embedding_or_output_parameter", False)
    return {n: [p.numel(), bool(managed(p))] for n, p in model.named_parameters()}


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
