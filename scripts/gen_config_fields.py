"""Regenerate megatron_memguard/data/config_fields.json (run at development time, not at runtime).

    python scripts/gen_config_fields.py [path/to/megatron_bridge/source/root]

Reads the field names of megatron-core's config dataclasses (the installed megatron-core, 0.16.1 when
this file was last generated) and, when a Megatron-Bridge source tree is given, the extra fields of
Bridge's GPTModelProvider (parsed with ast, so Bridge's torch-heavy imports are never executed).
memguard itself never imports megatron: the readers only look names up in the JSON file.
"""
from __future__ import annotations

import ast
import dataclasses
import json
import os
import sys

OUT = os.path.join(os.path.dirname(__file__), "..", "megatron_memguard", "data", "config_fields.json")


def _ast_fields(path: str, cls: str) -> list[str]:
    tree = ast.parse(open(path, encoding="utf-8").read())
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            return [s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)]
    return []


def main() -> None:
    import megatron.core as mc
    from megatron.core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.optimizer.optimizer_config import OptimizerConfig
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    def names(c):
        return sorted(f.name for f in dataclasses.fields(c))

    out = {
        "source": f"megatron-core {mc.__version__} dataclass fields (scripts/gen_config_fields.py)",
        "ModelParallelConfig": names(ModelParallelConfig),
        "TransformerConfig": sorted(set(names(TransformerConfig)) - set(names(ModelParallelConfig))),
        "MLATransformerConfig": sorted(set(names(MLATransformerConfig)) - set(names(TransformerConfig))),
        "OptimizerConfig": names(OptimizerConfig),
        "DistributedDataParallelConfig": names(DistributedDataParallelConfig),
    }
    if len(sys.argv) > 1:
        root = sys.argv[1]
        out["bridge_source"] = "Megatron-Bridge source at " + os.path.basename(os.path.abspath(root))
        out["GPTModelProvider"] = sorted(_ast_fields(os.path.join(root, "megatron/bridge/models/gpt_provider.py"), "GPTModelProvider"))
    else:
        with open(OUT, encoding="utf-8") as fh:
            old = json.load(fh)
        for k in ("bridge_source", "GPTModelProvider"):
            if k in old:
                out[k] = old[k]
    with open(OUT, "w", encoding="utf-8") as fh:
        json.dump(out, fh, indent=1, sort_keys=False)
        fh.write("\n")


if __name__ == "__main__":
    main()
