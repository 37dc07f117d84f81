"""Structured configs that are not Megatron functional-test files: detect the format, dispatch.

* NeMo 1 Hydra YAML (``trainer:`` + ``model:``), NeMo-Framework-Launcher training fragments, and a
  ``.nemo`` checkpoint's ``model_config.yaml`` -> nemo1.py (needs omegaconf)
* Megatron-Bridge ConfigContainer YAML (``train`` / ``optimizer`` / ``ddp`` ... sections) -> bridge.py
* NeMo 2 YAML (``_target_: nemo...``) -> nemo2.py (best effort)
* Hugging Face ``config.json`` (``model_type``) -> hf.py (the model shape only)
"""
from __future__ import annotations

from typing import Any, Mapping

from ..config import RawConfig
from ..errors import ReaderError
from ._common import parse_overrides


def detect_format(doc: Any) -> tuple[str | None, str]:
    """(format, why not) for a parsed YAML/JSON document."""
    from .bridge import looks_like_bridge
    from .hf import looks_like_hf
    from .nemo1 import looks_like_nemo1, looks_like_nemo1_model_config
    from .nemo2 import looks_like_nemo2

    if not isinstance(doc, Mapping):
        kind = {list: "a list", str: "a string", int: "a number", float: "a number", bool: "a boolean"}.get(
            type(doc), f"a {type(doc).__name__}")
        what = "empty" if doc is None else f"{kind}, not a mapping of settings"
        return None, f"the file is {what}"
    if looks_like_hf(doc):
        return "hf", ""
    if looks_like_nemo2(doc):
        return "nemo2", ""
    if looks_like_bridge(doc):
        return "bridge", ""
    if looks_like_nemo1(doc):
        return "nemo1", ""
    if looks_like_nemo1_model_config(doc):
        return "nemo1-model", ""
    keys = ", ".join(str(k) for k in list(doc)[:8]) or "none"
    return None, (f"not a training config memguard knows (top-level keys: {keys}); expected a NeMo config "
                  "(trainer: and model:), a Megatron-Bridge ConfigContainer (model/train/optimizer/ddp/...), a NeMo 2 "
                  "export (_target_: nemo...), a Hugging Face config.json (model_type), or a Megatron functional-test "
                  "config (MODEL_ARGS)")


def read_structured_config(doc: Any, path: str, text: str = "", overrides: list[str] | None = None,
                           environ: Mapping[str, str] | None = None, model: str | None = None) -> RawConfig:
    """Read a NeMo / Megatron-Bridge / NeMo 2 / Hugging Face config. ``overrides``: ``KEY=VALUE``
    strings applied before anything is resolved. ``model``: the ``--model`` value, used as the recipe
    a Megatron-Bridge override file applies to."""
    fmt, why = detect_format(doc)
    if fmt is None:
        raise ReaderError(f"{path}: {why}")
    ovs = parse_overrides(overrides or [])
    if fmt == "hf":
        if ovs:
            raise ReaderError(f"{path}: KEY=VALUE overrides do not apply to a Hugging Face config.json")
        from .hf import read_hf_config
        return read_hf_config(doc, path)
    if fmt == "nemo2":
        from .nemo2 import read_nemo2
        return read_nemo2(doc, path, ovs)
    if fmt in ("nemo1", "nemo1-model"):
        from .nemo1 import read_nemo1
        return read_nemo1(doc, path, ovs, model_only=fmt == "nemo1-model")
    from .bridge import read_bridge
    from .models import find_recipe

    recipe = find_recipe(model) if model else None
    return read_bridge(doc, path, ovs, recipe=recipe)
