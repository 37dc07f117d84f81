"""Regenerate megatron_memguard/data/typed_defaults.json (development time only; nothing is imported).

    python scripts/gen_typed_defaults.py CORE_0.16.1_SITE CORE_0.19.2_SITE BRIDGE_0.6.2_SRC

Each argument is a directory holding ``megatron/``. Lists the model-config dataclass fields annotated
``int``, ``float`` or ``bool`` (not Optional, not a union) whose default is a value, not None: megatron-core's
ModelParallelConfig, TransformerConfig, MLATransformerConfig and Megatron-Bridge's GPTModelProvider,
MLAModelProvider, HybridModelProvider, MambaModelProvider. A field some class or release declares None-able
(``Optional[int]``, ``int | None``, ``= None``) is left out: there None has a meaning; so is a field the code of
any of these releases tests against None (``config.q_lora_rank is None``: MLATransformerConfig declares
``q_lora_rank: int = 512`` but DeepSeek-V2-Lite's None means no query compression). Megatron-Bridge hands a
YAML null to the dataclass as None (no type check), so for these fields a null is not the default.
"""
from __future__ import annotations

import ast
import json
import os
import sys

OUT = os.path.join(os.path.dirname(__file__), "..", "megatron_memguard", "data", "typed_defaults.json")
FILES = (
    ("megatron/core/model_parallel_config.py", ("ModelParallelConfig",)),
    ("megatron/core/transformer/transformer_config.py", ("TransformerConfig", "MLATransformerConfig")),
    ("megatron/bridge/models/gpt_provider.py", ("GPTModelProvider",)),
    ("megatron/bridge/models/mla_provider.py", ("MLAModelProvider",)),
    ("megatron/bridge/models/hybrid/hybrid_provider.py", ("HybridModelProvider",)),
    ("megatron/bridge/models/mamba/mamba_provider.py", ("MambaModelProvider",)),
)
TYPES = ("int", "float", "bool")


def tested_against_none(roots: list[str]) -> set[str]:
    """Attribute names the code compares with ``is None`` / ``is not None`` / ``== None`` anywhere in megatron/."""
    out: set[str] = set()
    for root in roots:
        for dirpath, _, files in os.walk(os.path.join(root, "megatron")):
            for fn in files:
                if not fn.endswith(".py"):
                    continue
                try:
                    tree = ast.parse(open(os.path.join(dirpath, fn), encoding="utf-8").read())
                except (SyntaxError, UnicodeDecodeError):
                    continue
                for node in ast.walk(tree):
                    if isinstance(node, ast.Compare) and len(node.ops) == 1:
                        sides = (node.left, node.comparators[0])
                        if any(isinstance(x, ast.Constant) and x.value is None for x in sides):
                            out.update(x.attr for x in sides if isinstance(x, ast.Attribute))
    return out


def main(roots: list[str]) -> None:
    typed: dict[str, dict] = {}
    noneable: set[str] = set()
    for root in roots:
        for rel, classes in FILES:
            path = os.path.join(root, rel)
            if not os.path.exists(path):
                continue
            for node in ast.walk(ast.parse(open(path).read())):
                if not (isinstance(node, ast.ClassDef) and node.name in classes):
                    continue
                for s in node.body:
                    if not (isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)):
                        continue
                    name, ann = s.target.id, ast.unparse(s.annotation)
                    default = s.value
                    if isinstance(default, ast.Call) and ast.unparse(default.func).endswith("field"):
                        kw = {k.arg: k.value for k in default.keywords}
                        default = kw.get("default")
                    if isinstance(default, (ast.Name, ast.Attribute)) and ast.unparse(default) != "None":
                        default = ast.Constant(ast.unparse(default))   # a module constant (DEFAULT_MAMBA_CHUNK_SIZE)
                    if ann not in TYPES or not isinstance(default, ast.Constant) or default.value is None:
                        noneable.add(name)   # None-able, a union, a factory or another type: not this rule's
                        continue
                    typed.setdefault(name, {"type": ann, "default": default.value, "classes": []})
                    if typed[name]["type"] != ann:
                        noneable.add(name)
                    if node.name not in typed[name]["classes"]:
                        typed[name]["classes"].append(node.name)
    noneable |= tested_against_none(roots)
    fields = {k: v for k, v in sorted(typed.items()) if k not in noneable}
    doc = {"source": "scripts/gen_typed_defaults.py over megatron-core 0.16.1 and 0.19.2 and Megatron-Bridge 0.6.2 "
                     "model-config dataclasses: int/float/bool fields whose default is a value",
           "fields": fields}
    with open(OUT, "w") as f:
        json.dump(doc, f, indent=1, sort_keys=False)
        f.write("\n")
    print(f"{len(fields)} fields -> {OUT}")


if __name__ == "__main__":
    main(sys.argv[1:])
