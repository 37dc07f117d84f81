"""Regenerate megatron_memguard/data/config_fields.json (run at development time, not at runtime).

    pip download --no-deps --only-binary=:all: --python-version 3.12 megatron-core==0.19.2 -d wheels/
    pip download --no-deps --only-binary=:all: megatron-bridge==0.6.2 -d wheels/
    python scripts/gen_config_fields.py wheels/*.whl

Reads the field names of the config dataclasses every supported release declares, straight from the
wheels' sources (parsed with ast: nothing is imported, so no torch, no Transformer Engine): megatron-core's
ModelParallelConfig, TransformerConfig, MLATransformerConfig, OptimizerConfig and
DistributedDataParallelConfig, megatron.training's GPTModelConfig (the nested model layout, core >= 0.18),
and Megatron-Bridge's GPTModelProvider and its OptimizerConfig / DistributedDataParallelConfig
subclasses. Each list in the JSON file is the union over the wheels given, so that a field of any
supported release is known; ``versions`` names them. memguard itself never imports megatron: the readers
only look names up in the JSON file.
"""
from __future__ import annotations

import ast
import json
import os
import re
import sys
import zipfile

OUT = os.path.join(os.path.dirname(__file__), "..", "megatron_memguard", "data", "config_fields.json")

# JSON key -> (package, file in the wheel, class). Several rows may feed one key (Bridge's subclasses add
# fields to megatron-core's classes of the same name).
CLASSES = (
    ("ModelParallelConfig", "megatron-core", "megatron/core/model_parallel_config.py", "ModelParallelConfig"),
    ("TransformerConfig", "megatron-core", "megatron/core/transformer/transformer_config.py", "TransformerConfig"),
    ("MLATransformerConfig", "megatron-core", "megatron/core/transformer/transformer_config.py", "MLATransformerConfig"),
    ("OptimizerConfig", "megatron-core", "megatron/core/optimizer/optimizer_config.py", "OptimizerConfig"),
    ("DistributedDataParallelConfig", "megatron-core", "megatron/core/distributed/distributed_data_parallel_config.py",
     "DistributedDataParallelConfig"),
    ("GPTModelConfig", "megatron-core", "megatron/training/models/base.py", "ModelConfig"),
    ("GPTModelConfig", "megatron-core", "megatron/training/models/gpt.py", "GPTModelConfig"),
    ("GPTModelProvider", "megatron-bridge", "megatron/bridge/models/gpt_provider.py", "GPTModelProvider"),
    ("OptimizerConfig", "megatron-bridge", "megatron/bridge/training/config.py", "OptimizerConfig"),
    ("DistributedDataParallelConfig", "megatron-bridge", "megatron/bridge/training/config.py",
     "DistributedDataParallelConfig"),
)


def class_fields(source: str, cls: str) -> list[str] | None:
    """The annotated class-level names of ``cls`` (its dataclass fields; ClassVar excluded), or None."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            out = []
            for s in node.body:
                if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name):
                    if "ClassVar" in ast.unparse(s.annotation):
                        continue
                    out.append(s.target.id)
            return out
    return None


def wheel_package(path: str) -> tuple[str, str]:
    m = re.match(r"(megatron_core|megatron_bridge)-([^-]+)-", os.path.basename(path))
    if not m:
        raise SystemExit(f"{path}: not a megatron-core or megatron-bridge wheel")
    return m.group(1).replace("_", "-"), m.group(2)


def main(wheels: list[str]) -> None:
    if not wheels:
        raise SystemExit(__doc__)
    union: dict[str, set[str]] = {}
    versions: list[str] = []
    for path in sorted(wheels):
        package, version = wheel_package(path)
        versions.append(f"{package} {version}")
        with zipfile.ZipFile(path) as z:
            names = set(z.namelist())
            for key, pkg, member, cls in CLASSES:
                if pkg != package or member not in names:
                    continue
                fields = class_fields(z.read(member).decode("utf-8"), cls)
                if fields is not None:
                    union.setdefault(key, set()).update(fields)
    out: dict[str, object] = {
        "source": "dataclass fields read from the wheels by scripts/gen_config_fields.py (union over the versions)",
        "versions": versions,
    }
    for key in dict.fromkeys(k for k, *_ in CLASSES):
        out[key] = sorted(union.get(key, ()))
    with open(OUT, "w", encoding="utf-8") as fh:
        json.dump(out, fh, indent=1, sort_keys=False)
        fh.write("\n")


if __name__ == "__main__":
    main(sys.argv[1:])
