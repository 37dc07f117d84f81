"""Regenerate megatron_memguard/data/typed_defaults.json (development time only; nothing is imported).

    python scripts/gen_typed_defaults.py CORE_0.16.1_SITE CORE_0.19.2_SITE BRIDGE_0.6.2_SRC
    BRIDGE_VENV/bin/python scripts/gen_typed_defaults.py --sections     # (Bridge 0.6.2 + megatron-core 0.19.2)
    VENV312/bin/python scripts/gen_typed_defaults.py --yaml-cfg     # (megatron-core 0.19.2's megatron.training)

``--sections`` imports Megatron-Bridge 0.6.2's ConfigContainer (Transformer Engine stood in by
tests/bridge_real/te_standin) and lists, per non-model section (train, optimizer, ddp, dist, mixed_precision,
scheduler, checkpoint, dataset, tokenizer, comm_overlap, ...), the fields typed int / float / bool / str /
torch.dtype (not Optional, not a union; a Literal of ints is int) whose default is a value or that have none
(required): Bridge's ``_apply_overrides`` / instantiate set a YAML null as None on them, no type check.
``--yaml-cfg`` lists the Megatron arguments whose argparse default is neither None nor False (megatron-core
0.19.2 ``megatron/training/arguments.py``): ``--yaml-cfg``'s ``load_yaml`` gives the namespace a YAML null as None
where the flags would give that default.

Each argument is a directory holding ``megatron/``. Lists the model-config dataclass fields annotated
``int``, ``float``, ``bool`` or ``str`` (or a Literal of strings; not Optional, not a union) whose default is a value, not None: megatron-core's
ModelParallelConfig, TransformerConfig, MLATransformerConfig and Megatron-Bridge's GPTModelProvider,
MLAModelProvider, HybridModelProvider, MambaModelProvider. A field some class or release declares None-able
(``Optional[int]``, ``int | None``, ``= None``) is left out: there None has a meaning; so is a field the code of
any of these releases tests against None (``config.q_lora_rank is None``: MLATransformerConfig declares
``q_lora_rank: int = 512`` but DeepSeek-V2-Lite's None means no query compression). Megatron-Bridge hands a
YAML null to the dataclass as None (no type check), so for these fields a null is not the default. ``bool_fields``:
the fields of these classes annotated ``bool`` or ``Optional[bool]``, whatever their default (readers/bridge.py reads a
value of another kind there as Bridge does: by its truth).
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
TYPES = ("int", "float", "bool", "str")
# the annotations of a model-config flag (``bool_fields``: Megatron-Bridge's override path sets any value on them
# unchecked, and the code tests its truth)
_BOOL_ANNOTATIONS = ("bool", "Optional[bool]", "typing.Optional[bool]", "bool|None", "None|bool")


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
    bools: set[str] = set()
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
                    if ann.replace(" ", "") in _BOOL_ANNOTATIONS:
                        bools.add(name)
                    if isinstance(s.annotation, ast.Subscript) and ast.unparse(s.annotation.value) in ("Literal", "typing.Literal"):
                        elts = s.annotation.slice.elts if isinstance(s.annotation.slice, ast.Tuple) else [s.annotation.slice]
                        if all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in elts):
                            ann = "str"   # Literal['allgather', 'alltoall', 'flex']: a string with choices
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
                     "model-config dataclasses: int/float/bool/str fields whose default is a value",
           "fields": fields, "bool_fields": sorted(bools)}
    if os.path.exists(OUT):   # (keep what --sections and --yaml-cfg wrote)
        with open(OUT) as f:
            doc = {**json.load(f), **doc}
    with open(OUT, "w") as f:
        json.dump(doc, f, indent=1, sort_keys=False)
        f.write("\n")
    print(f"{len(fields)} fields -> {OUT}")


def _hint_kind(t) -> str | None:
    """'int' / 'float' / 'bool' / 'str' / 'dtype' for a plain annotation, None for Optional, unions and the rest."""
    import typing

    if typing.get_origin(t) is typing.Literal and all(isinstance(a, int) and not isinstance(a, bool)
                                                      for a in typing.get_args(t)):
        return "int"
    if t in (int, float, bool, str):
        return t.__name__
    if getattr(t, "__module__", "") == "torch" and getattr(t, "__name__", "") == "dtype":
        return "dtype"
    return None


def sections() -> dict[str, dict]:
    """Megatron-Bridge's non-model ConfigContainer sections: section -> {field: {type, default, class}}."""
    import dataclasses
    import typing

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "bridge_real", "te_standin"))
    from megatron.bridge.training.config import ConfigContainer

    out: dict[str, dict] = {}
    hints = typing.get_type_hints(ConfigContainer)
    for sec in dataclasses.fields(ConfigContainer):
        if sec.name in ("model", "peft") or sec.name.startswith("_"):
            continue   # (model sections: main(); peft: the reader's own rule)
        kinds = typing.get_args(hints[sec.name]) or (hints[sec.name],)
        cls = next((c for c in kinds if dataclasses.is_dataclass(c)), None)
        if cls is None:
            continue
        own = typing.get_type_hints(cls)
        # the section itself: may it be None (Optional[...] / default None)?
        rows = {"": {"type": "section", "default": "optional" if type(None) in kinds or sec.default is None
                     else "required", "class": cls.__name__}}
        for f in dataclasses.fields(cls):
            kind = _hint_kind(own.get(f.name))
            if kind is None or f.default_factory is not dataclasses.MISSING:
                continue
            if f.default is dataclasses.MISSING:
                default = "required"
            elif f.default is None:
                continue   # None-able by its default: None is that meaning
            else:
                default = str(f.default).removeprefix("torch.") if kind == "dtype" else f.default
            if isinstance(default, float) and default != default or default in (float("inf"), float("-inf")):
                default = str(default)   # (JSON has no inf / nan)
            rows[f.name] = {"type": kind, "default": default, "class": cls.__name__}
        out[sec.name] = dict(sorted(rows.items()))
    return out


def yaml_cfg_defaults() -> dict[str, object]:
    """Megatron argument dest -> argparse default, for the defaults that are neither None nor False."""
    import argparse
    import math

    from megatron.training.arguments import add_megatron_arguments

    parser = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    out = {}
    for a in parser._actions:
        d = a.default
        if a.dest == "help" or d is None or d is False or d is argparse.SUPPRESS:
            continue
        if isinstance(d, float) and not math.isfinite(d):
            d = str(d)
        elif not isinstance(d, (int, float, str, bool)):
            d = str(d)
        out[a.dest] = d
    return dict(sorted(out.items()))


def merge(key: str, value: dict) -> None:
    with open(OUT) as f:
        doc = json.load(f)
    doc[key] = value
    with open(OUT, "w") as f:
        json.dump(doc, f, indent=1, sort_keys=False)
        f.write("\n")
    print(f"{key}: {len(value)} entries -> {OUT}")


if __name__ == "__main__":
    if sys.argv[1:] == ["--sections"]:
        merge("sections", sections())
    elif sys.argv[1:] == ["--yaml-cfg"]:
        merge("yaml_cfg_arg_defaults", yaml_cfg_defaults())
    else:
        main(sys.argv[1:])
