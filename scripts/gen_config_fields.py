"""Regenerate megatron_memguard/data/config_fields.json (run at development time, not at runtime).

    pip download --no-deps --only-binary=:all: --python-version 3.12 megatron-core==0.19.2 -d wheels/
    pip download --no-deps --only-binary=:all: megatron-bridge==0.6.2 -d wheels/
    python scripts/gen_config_fields.py wheels/*.whl

Reads the field names of the config dataclasses every supported release declares, straight from the
wheels' sources (parsed with ast: nothing is imported, so no torch, no Transformer Engine): megatron-core's
ModelParallelConfig, TransformerConfig, MLATransformerConfig, OptimizerConfig and
DistributedDataParallelConfig, megatron.training's GPTModelConfig (the nested model layout, core >= 0.18),
and Megatron-Bridge's GPTModelProvider and its OptimizerConfig / DistributedDataParallelConfig
subclasses; Bridge's ConfigContainer's own fields; and, under ``BridgeSections``, the sections of Megatron-Bridge's ConfigContainer (train, dataset,
optimizer, scheduler, ...: every field whose annotation names a config class) with, per section, the names of
those classes and of their subclasses in the Bridge wheel (``classes``) and the union of their fields, inherited
ones included (``fields``; base classes are followed through the imports of every wheel given, so Bridge's
TrainingConfig gets megatron.training's fields). Each list in the JSON file is the union over the wheels given, so that a field of any
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


# ConfigContainer sections not listed: the model (its fields are the lists above, read by map_mcore_fields)
# and peft (a LoRA / DoRA object, read field by field in readers/bridge.py _peft).
BRIDGE_CONTAINER = ("megatron.bridge.training.config", "ConfigContainer")
SKIPPED_SECTIONS = ("model", "peft")


class Sources:
    """Every module of the wheels given, by dotted name (a module of several versions has several sources),
    and the dataclass-field reading that follows base classes and imports across them."""

    def __init__(self) -> None:
        self.trees: dict[str, list[ast.Module]] = {}
        self.bridge_modules: set[str] = set()

    def add(self, member: str, source: str, bridge: bool) -> None:
        mod = member[:-3].replace("/", ".")
        if mod.endswith(".__init__"):
            mod = mod[: -len(".__init__")]
        try:
            tree = ast.parse(source)
        except SyntaxError:
            return
        tree.is_package = member.endswith("__init__.py")  # type: ignore[attr-defined]
        self.trees.setdefault(mod, []).append(tree)
        if bridge:
            self.bridge_modules.add(mod)

    @staticmethod
    def _imported(mod: str, tree: ast.Module, name: str) -> tuple[str, str] | None:
        """Where ``name`` comes from when ``mod`` imports it (``from X import Y as name``)."""
        for node in tree.body:
            if isinstance(node, ast.ImportFrom):
                for a in node.names:
                    if (a.asname or a.name) == name:
                        base = node.module or ""
                        if node.level:
                            pkg = mod.split(".") if getattr(tree, "is_package", False) else mod.split(".")[:-1]
                            pkg = pkg[: len(pkg) - node.level + 1]
                            base = ".".join(pkg + ([node.module] if node.module else []))
                        return base, a.name
        return None

    def resolve(self, mod: str, name: str, depth: int = 0) -> list[tuple[str, ast.ClassDef]]:
        """The class definitions ``mod.name`` stands for (one per version that defines it)."""
        if depth > 20 or mod not in self.trees:
            return []
        out = []
        for tree in self.trees[mod]:
            cls = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name), None)
            if cls is not None:
                out.append((mod, cls))
                continue
            src = self._imported(mod, tree, name)
            if src is not None:
                out.extend(self.resolve(src[0], src[1], depth + 1))
        return out

    def fields(self, mod: str, cls: ast.ClassDef, depth: int = 0) -> set[str]:
        """The dataclass fields of ``cls``: its own annotated names and those of its bases."""
        out = set(f for f in (class_fields(ast.unparse(cls), cls.name) or ()))
        if depth > 20:
            return out
        for base in cls.bases:
            if isinstance(base, ast.Name):
                for bmod, bcls in self.resolve(mod, base.id):
                    out |= self.fields(bmod, bcls, depth + 1)
        return out

    def ancestors(self, mod: str, cls: ast.ClassDef, depth: int = 0) -> set[tuple[str, str]]:
        out = {(mod, cls.name)}
        if depth <= 20:
            for base in cls.bases:
                if isinstance(base, ast.Name):
                    for bmod, bcls in self.resolve(mod, base.id):
                        out |= self.ancestors(bmod, bcls, depth + 1)
        return out

    def container_fields(self) -> list[str]:
        """Every field of ConfigContainer (its sections, ``data_parallel_size``, private ones a dump carries)."""
        return sorted(set().union(*(self.fields(m, c) for m, c in self.resolve(*BRIDGE_CONTAINER))))

    def container_sections(self) -> dict[str, dict[str, list[str]]]:
        mod, name = BRIDGE_CONTAINER
        sections: dict[str, tuple[set[tuple[str, str]], set[str]]] = {}
        for cmod, container in self.resolve(mod, name):
            for s in container.body:
                if not (isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)):
                    continue
                sec = s.target.id
                if sec.startswith("_") or sec in SKIPPED_SECTIONS:
                    continue
                for node in ast.walk(s.annotation):
                    if isinstance(node, ast.Name):
                        for bmod, bcls in self.resolve(cmod, node.id):
                            classes, fields = sections.setdefault(sec, (set(), set()))
                            classes.add((bmod, bcls.name))
                            fields |= self.fields(bmod, bcls)
        # Bridge's subclasses of a section's classes (MockGPTDatasetConfig for GPTDatasetConfig...): a dump
        # names them in _target_
        for bmod in sorted(self.bridge_modules):
            for tree in self.trees[bmod]:
                for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
                    anc = self.ancestors(bmod, cls)
                    for classes, fields in sections.values():
                        if anc & classes and (bmod, cls.name) not in classes:
                            classes.add((bmod, cls.name))
                            fields |= self.fields(bmod, cls)
        return {sec: {"classes": sorted({c for _, c in classes}), "fields": sorted(fields)}
                for sec, (classes, fields) in sorted(sections.items()) if fields}


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
    sources = Sources()
    for path in sorted(wheels):
        package, version = wheel_package(path)
        versions.append(f"{package} {version}")
        with zipfile.ZipFile(path) as z:
            names = set(z.namelist())
            for member in sorted(names):
                if member.startswith("megatron/") and member.endswith(".py"):
                    sources.add(member, z.read(member).decode("utf-8"), package == "megatron-bridge")
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
    out["ConfigContainer"] = sources.container_fields()
    out["BridgeSections"] = sources.container_sections()
    with open(OUT, "w", encoding="utf-8") as fh:
        json.dump(out, fh, indent=1, sort_keys=False)
        fh.write("\n")


if __name__ == "__main__":
    main(sys.argv[1:])
