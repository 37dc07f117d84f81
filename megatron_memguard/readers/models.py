"""``--model NAME`` (a preset from data/presets.yaml) and ``--model path/to/config.json`` (Hugging Face).

A model name gives the shape only. A Megatron-Bridge recipe name (``llama32_1b``, ``llama3_8b`` ...)
gives the whole recipe: shape, sequence length, parallel sizes, batch, precision and optimizer as the
recipe function sets them; flags and config files on top override any of it.
"""
from __future__ import annotations

import copy
import difflib
import os
import re
from dataclasses import replace
from functools import lru_cache
from importlib import resources
from typing import Any

import yaml

from ..config import RawConfig
from ..errors import ConfigError, ReaderError
from ..numbers import shown


@lru_cache(maxsize=1)
def presets() -> dict[str, Any]:
    text = resources.files("megatron_memguard").joinpath("data/presets.yaml").read_text()
    # libyaml's safe loader when PyYAML has it: the same data (our own 150 kB file) in an eighth of the CPU time
    return yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


def canonical(name: str) -> str:
    """Case, ``-`` and ``_``, an organisation prefix, ``Meta-`` and ``-hf`` do not matter in model names."""
    n = name.strip().lower()
    n = n.rsplit("/", 1)[-1]
    n = re.sub(r"^meta-", "", n)
    n = re.sub(r"-hf$", "", n)
    return re.sub(r"[-_\s]", "", n)  # dots stay: gpt3-1.3b is not gpt3-13b


@lru_cache(maxsize=1)
def _model_index() -> dict[str, str]:
    idx: dict[str, str] = {}
    for key, m in presets()["models"].items():
        for n in [key, *(m.get("aliases") or [])]:
            c = canonical(n)
            if idx.get(c, key) != key:
                raise AssertionError(f"preset names collide: {n!r} ({key}) and {idx[c]}")
            idx[c] = key
    return idx


def find_model(name: str) -> str | None:
    return _model_index().get(canonical(name))


def find_recipe(name: str) -> str | None:
    """memguard's recipe key for ``llama3_8b``, ``llama3-8b-pretrain`` or a name Megatron-Bridge exports the
    recipe function under (``llama3_8b_pretrain_config``, ``llama3_8b_pretrain_2gpu_h100_bf16_config``)."""
    n = name.strip().lower().replace("-", "_")
    key = recipe_for_function(n)
    if key:
        return key
    if re.search(r"[-./]", name) and find_model(name):
        return None   # qwen3-30b-a3b is the model; the recipe is spelt as Bridge spells it, qwen3_30b_a3b
    n = re.sub(r"_(pretrain|config|pretrain_config)$", "", n)
    return n if n in presets().get("recipes", {}) else None


def unmodelled_recipe(name: str, key: str = "--model") -> None:
    """Refuse, naming why, a Megatron-Bridge recipe memguard has no entry for
    (``unmodelled_recipes`` in data/presets.yaml)."""
    from ..errors import NotModelledError

    n = name.strip().lower().replace("-", "_")
    for r in presets().get("unmodelled_recipes") or ():
        if n.startswith(r["prefix"]):
            dump = ("its run_config.yaml dump can be read with --config" if r.get("dump", True)
                    else "its run_config.yaml dump is refused for the same reason")
            raise NotModelledError(key, f"the Megatron-Bridge recipe {shown(name)} ({r['what']}; {dump})")


def recipe_for_function(name: str) -> str | None:
    """memguard's recipe key for the exact name of a Megatron-Bridge recipe function, else None."""
    for key, r in presets().get("recipes", {}).items():
        if name in (r.get("functions") or ()):
            return key
    return None


def nemo2_model(class_name: str) -> str | None:
    """The preset whose shape a NeMo 2 config class (``Llama31Config8B``) has."""
    for key, m in presets()["models"].items():
        if class_name in (m.get("nemo2") or []):
            return key
    return None


def nemo2_class_fields(class_name: str) -> dict[str, Any]:
    """A NeMo 2 config class's fields beyond its model's shape (MoE classes: dispatcher, router, fusions;
    ``nemo2_classes`` in data/presets.yaml), or {}."""
    return dict((presets().get("nemo2_classes") or {}).get(class_name) or {})


def recipes_named_in(text: str) -> list[str]:
    """Recipe names that appear in a file name (``quantized_llama3_8b_pretrain_override.yaml``)."""
    low = os.path.basename(text).lower()
    found = [r for r in presets().get("recipes", {}) if re.search(rf"(^|[^a-z0-9]){re.escape(r)}($|[^0-9])", low)]
    return sorted(found, key=len, reverse=True)


def known_names() -> list[str]:
    return sorted(presets()["models"]) + sorted(presets().get("recipes", {}))


def model_hf(key: str) -> dict[str, Any]:
    return dict(presets()["models"][key]["hf"])


def recipe_gpus(name: str) -> int | None:
    """The number of GPUs a recipe is written for (the ``NNgpu`` of its Bridge function name), or None."""
    g = presets()["recipes"][name].get("gpus")
    return int(g) if g else None


def recipe_doc(name: str) -> tuple[dict[str, Any], str, str]:
    """(Bridge ConfigContainer dict of the recipe with its model provider, the model preset, source)."""
    r = presets()["recipes"][name]
    doc = copy.deepcopy(r["config"])
    provider = recipe_provider(name)
    provider.update(doc.get("model") or {})
    doc["model"] = provider
    return doc, r["model"], r.get("source", "")


def recipe_provider(name: str) -> dict[str, Any]:
    """The model provider a recipe starts from: AutoBridge's for its model preset, or the provider the
    recipe builds itself (OLMoE: ``provider`` in data/presets.yaml)."""
    from .hf import hf_to_provider

    r = presets()["recipes"][name]
    return hf_to_provider(model_hf(r["model"])) if r.get("model") else copy.deepcopy(r["provider"])


def recipe_notes(name: str) -> tuple[str, ...]:
    """What memguard approximates in a recipe (its ``notes`` in data/presets.yaml)."""
    return tuple(f"recipe {name}: {' '.join(str(n).split())}" for n in presets()["recipes"][name].get("notes") or ())


def read_model(name_or_path: str, shape_only: bool = False) -> RawConfig:
    """The RawConfig for ``--model``: a preset, a Bridge recipe, or a Hugging Face config.json.
    ``shape_only``: for a recipe, only its model's shape (when a config file gives the rest)."""
    from .hf import hf_key_names, hf_notes, hf_to_provider, provider_to_raw, read_hf_config

    arg = str(name_or_path)
    path = os.path.join(arg, "config.json") if os.path.isdir(arg) else arg
    if os.path.isdir(arg) and not os.path.isfile(path):
        raise ReaderError(f"{arg}: a directory without config.json (--model takes a preset name, a Hugging Face "
                          "config.json or the directory holding it)")
    if os.path.isfile(path):
        from ..files import load_json, load_yaml, read_text

        text = read_text(path)
        doc = load_json(text, path) if path.lower().endswith(".json") else load_yaml(text, path)
        if not isinstance(doc, dict):
            raise ReaderError(f"{path}: not a Hugging Face config.json (not a JSON object)")
        return read_hf_config(doc, path)
    recipe = find_recipe(arg)
    if recipe and shape_only and not presets()["recipes"][recipe].get("model"):
        return provider_to_raw(recipe_provider(recipe), f"recipe {recipe}", key_prefix=f"--model {recipe}: ")
    if recipe and shape_only:
        arg = presets()["recipes"][recipe]["model"]
    elif recipe:
        from .bridge import read_bridge

        return read_bridge({}, f"recipe {recipe}", [], recipe=recipe)
    key = find_model(arg)
    if key is None:
        unmodelled_recipe(arg)
        # (difflib's matching is quadratic in the length: no hints for a run-away argument)
        close = difflib.get_close_matches(canonical(arg), list(_model_index()), n=3, cutoff=0.6) if len(arg) < 100 else []
        hint = ""
        if close:
            hint = "; did you mean " + ", ".join(dict.fromkeys(_model_index()[c] for c in close)) + "?"
        raise ConfigError("--model", f"unknown model {shown(arg)} (not a preset and no such file){hint}",
                          "give a Hugging Face config.json path, or one of: " + ", ".join(known_names()))
    hf = model_hf(key)
    names = hf_key_names(hf.get("model_type"))
    raw = provider_to_raw(hf_to_provider(hf), f"model preset {key}", key_prefix=f"--model {key}: ", hf_names=names)
    if hf.get("sliding_window"):
        raw = replace(raw, warnings=raw.warnings + (
            f"--model {key}: sliding-window attention ({hf['sliding_window']} tokens) is estimated as full attention",))
    notes = hf_notes(hf, f"--model {key}: ")
    return replace(raw, warnings=raw.warnings + notes) if notes else raw
