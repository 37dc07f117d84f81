"""Megatron-Bridge's ``scripts/training/run_recipe.py`` command line, read as the script reads it.

Followed: ``run_recipe.py`` and ``recipe_runner.py`` of Megatron-Bridge v0.6.0 (the 0.6 line, pip
releases up to 0.6.2) and of main (2026-08-22); they are in the repository, not in the pip package.
What a ``torchrun ... run_recipe.py ARGS`` launch turns into a ConfigContainer, in the script's order:

1. its argparse parser (``allow_abbrev=False``, ``parse_known_args``): ``--model`` or ``--recipe`` (one
   of them, required), ``--mode {pretrain,sft,lora,dora}``, ``--dataset``, the convenience options
   (``-mb/--micro_batch_size``, ``-gb``, ``-sl/--seq_length``, ``-tp``, ``-pp``, ``-cp``, ``-vp``, ``-ep``,
   ``-etp``, ``-ms``, ``--lr``, ``--min_lr``, ``--warmup_iters``, the checkpoint paths), ``--deterministic``,
   ``--dry-run``, ``--dump-env``, ``--step-func``; every other token must be ``KEY=VALUE``, else the
   script stops ("Unknown option", "Expected override in KEY=VALUE form");
2. the mode: ``--mode``, else inferred from a conventional ``--recipe`` name (``..._pretrain_...``);
   none: the script stops; a ``--recipe`` whose name contradicts ``--mode`` stops it too;
3. the recipe function: ``--recipe NAME`` exactly, or ``{model}_{task}_config`` for ``--model`` (task
   ``pretrain``, ``sft``, or ``peft`` for lora / dora), looked up in ``megatron.bridge.recipes``: a
   short name such as ``llama3_8b`` is not a function there, and the script stops;
4. ``--dataset mock`` / ``megatron-indexed`` replace the recipe's dataset with a fresh one of the
   recipe model's sequence length; ``--deterministic`` sets ``model.deterministic_mode`` and
   ``model.cross_entropy_loss_fusion=False`` and the deterministic environment;
5. the overrides: the convenience options first (``train.micro_batch_size=...``,
   ``dataset.seq_length=...``, ``model.tensor_model_parallel_size=...``), then the trailing
   ``KEY=VALUE`` tokens, so a trailing override wins;
6. ``sync_model_dataset_sequence_length``: ``model.seq_length`` := ``dataset.seq_length``.

Assumed where the scripts call helpers that are not in these two files (``recipe_metadata.py``):
``recipe_task`` maps pretrain -> ``pretrain``, sft -> ``sft``, lora / dora -> ``peft`` (the names
``megatron.bridge.recipes`` exports: ``llama3_8b_pretrain_config``, ``..._sft_config``, ``..._peft_config``),
and ``infer_recipe_mode`` reads that task word from the recipe name. memguard estimates pretraining and, for the
Llama PEFT recipes in its presets, ``--mode lora`` / ``dora`` (``load_recipe(name, peft_scheme=mode)``): SFT and
other models' PEFT recipes are refused (a PEFT run's run_config.yaml is read).
"""
from __future__ import annotations

import argparse
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError, NotModelledError

SCRIPT = "run_recipe.py"

# run_recipe.py COMMON_OVERRIDE_FIELDS: option dest -> ConfigContainer key, in the script's order.
COMMON_OVERRIDE_FIELDS = (
    ("max_steps", "train.train_iters"), ("global_batch_size", "train.global_batch_size"),
    ("micro_batch_size", "train.micro_batch_size"), ("seq_length", "dataset.seq_length"),
    ("tensor_model_parallel_size", "model.tensor_model_parallel_size"),
    ("pipeline_model_parallel_size", "model.pipeline_model_parallel_size"),
    ("context_parallel_size", "model.context_parallel_size"),
    ("virtual_pipeline_model_parallel_size", "model.virtual_pipeline_model_parallel_size"),
    ("expert_model_parallel_size", "model.expert_model_parallel_size"),
    ("expert_tensor_parallel_size", "model.expert_tensor_parallel_size"),
    ("lr", "optimizer.lr"), ("min_lr", "optimizer.min_lr"), ("warmup_iters", "scheduler.lr_warmup_iters"),
    ("pretrained_checkpoint", "checkpoint.pretrained_checkpoint"), ("save_dir", "checkpoint.save"),
    ("load_dir", "checkpoint.load"), ("save_interval", "checkpoint.save_interval"),
)
# (option strings, dest, type) of the convenience options.
_OPTIONS = (
    (("-ms", "--max_steps"), int), (("-gb", "--global_batch_size"), int), (("-mb", "--micro_batch_size"), int),
    (("-sl", "--seq_length"), int), (("-tp", "--tensor_model_parallel_size"), int),
    (("-pp", "--pipeline_model_parallel_size"), int), (("-cp", "--context_parallel_size"), int),
    (("-vp", "--virtual_pipeline_model_parallel_size"), int), (("-ep", "--expert_model_parallel_size"), int),
    (("-etp", "--expert_tensor_parallel_size"), int), (("--lr",), float), (("--min_lr",), float),
    (("--warmup_iters",), int), (("--pretrained_checkpoint",), str), (("--save_dir",), str), (("--load_dir",), str),
    (("--save_interval",), int),
)
MODES = ("pretrain", "sft", "lora", "dora")
# megatron.bridge.recipes.utils.dataset_utils DATASET_PRESETS (0.6.2); mock and megatron-indexed build a
# GPTDatasetConfig (pretraining), the others fine-tuning datasets.
DATASETS = ("mock", "megatron-indexed", "squad", "tulu3", "openmathinstruct2", "openmathinstruct2-thinking", "gsm8k",
            "local-jsonl", "local-vlm", "cord-v2", "llava-video-178k", "medpix", "raven", "rdr")
PRETRAIN_DATASETS = ("mock", "megatron-indexed")
# the vision-language presets (dataset_utils._local_vlm_dataset_config, _hf_vlm_dataset_config)
VLM_DATASETS = ("local-vlm", "cord-v2", "llava-video-178k", "medpix", "raven", "rdr")
# recipes/utils/determinism_utils.py apply_determinism_overrides (env_vars it adds to the config).
DETERMINISTIC_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "NCCL_ALGO": "Ring", "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0"}


def is_run_recipe(script: str) -> bool:
    return os.path.basename(script) == SCRIPT


@dataclass(frozen=True)
class RunRecipeArgs:
    """What run_recipe.py makes of its command line."""

    recipe: str                                     # the recipe function it loads
    mode: str
    overrides: list[str] = field(default_factory=list)   # ConfigContainer overrides, in the order applied
    dataset: str | None = None
    deterministic: bool = False
    ignored: list[str] = field(default_factory=list)     # options that do not change memory


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse would print usage and exit 2: the launch stops there
        raise ConfigError(SCRIPT, f"{message}; the launch would stop at start-up")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog=SCRIPT, allow_abbrev=False, add_help=False)
    sel = p.add_mutually_exclusive_group(required=True)
    sel.add_argument("--model")
    sel.add_argument("--recipe")
    p.add_argument("--mode", choices=MODES)
    p.add_argument("--step-func", "--step_func", dest="step_func")
    p.add_argument("--dataset", choices=sorted(DATASETS))
    for opts, typ in _OPTIONS:
        p.add_argument(*opts, type=typ)
    p.add_argument("--dry-run", "--dry_run", action="store_true", dest="dryrun")
    p.add_argument("--deterministic", action="store_true")
    p.add_argument("--dump-env", "--dump_env", action="store_true", dest="dump_env")
    p.add_argument("-h", "--help", action="store_true")
    return p


def recipe_task(mode: str) -> str:
    return "peft" if mode in ("lora", "dora") else mode


def infer_recipe_mode(recipe: str) -> str | None:
    words = recipe.lower().split("_")
    for task, mode in (("pretrain", "pretrain"), ("sft", "sft"), ("peft", "lora")):
        if task in words:
            return mode
    return None


def parse_run_recipe(argv: list[str]) -> RunRecipeArgs:
    """run_recipe.py's ``parse_args`` and mode checks on the script's arguments (ConfigError where the
    script would stop)."""
    parser = _parser()
    args, unknown = parser.parse_known_args(argv)
    if args.help:
        raise ConfigError(f"{SCRIPT} --help", "prints the help and starts no training")
    trailing = []
    for value in unknown:
        if value.startswith("-"):
            raise ConfigError(value, f"Unknown option of {SCRIPT}; the launch would stop at start-up",
                              "write the setting as a KEY=VALUE ConfigContainer override")
        if "=" not in value:
            raise ConfigError(value, f"{SCRIPT} expects overrides in KEY=VALUE form; the launch would stop at start-up")
        trailing.append(value)
    common = []
    for dest, key in COMMON_OVERRIDE_FIELDS:
        v = getattr(args, dest)
        if v is not None:
            common.append(f"{key}={json.dumps(v) if isinstance(v, str) else v}")
    for opt in ("recipe", "model"):
        if getattr(args, opt) is not None and not str(getattr(args, opt)).strip():
            # (an empty name read as no name: the errors then spoke of '--model None')
            raise ConfigError(f"--{opt}", f"{SCRIPT} needs a name, got {getattr(args, opt)!r}")
    mode = args.mode
    if mode is None and args.recipe:
        mode = infer_recipe_mode(args.recipe)
    if mode is None:
        hint = _short_name_hint(args.recipe) if args.recipe else f"add --mode pretrain after --model {args.model}"
        raise ConfigError("--mode", f"{SCRIPT} cannot infer the training mode from --recipe {args.recipe}"
                          if args.recipe else f"{SCRIPT} needs --mode with --model", hint)
    if args.recipe:
        named = infer_recipe_mode(args.recipe)
        if named is not None and recipe_task(named) != recipe_task(mode):
            raise ConfigError("--mode", f"{mode} is incompatible with recipe {args.recipe!r} ({SCRIPT} stops)")
    recipe = args.recipe or f"{args.model}_{recipe_task(mode)}_config"
    ignored = [o for o, on in (("--dry-run", args.dryrun), ("--dump-env", args.dump_env),
                               ("--step-func", args.step_func is not None)) if on]
    ignored += [f"{k}={v}" for k, v in (o.split("=", 1) for o in common) if k.startswith(("optimizer.", "scheduler."))]
    return RunRecipeArgs(recipe=recipe, mode=mode, overrides=common + trailing, dataset=args.dataset,
                         deterministic=args.deterministic, ignored=ignored)


def _short_name_hint(recipe: str) -> str:
    return (f"{SCRIPT} takes the recipe function's full name: --recipe {recipe}_pretrain_config, "
            f"or --model {recipe} --mode pretrain")


def recipe_key(rr: RunRecipeArgs) -> str:
    """memguard's recipe key for the function run_recipe.py would load (ConfigError / NotModelledError where
    it cannot be estimated)."""
    from .models import find_recipe, presets, recipe_for_function, unmodelled_recipe

    if rr.mode in ("lora", "dora") and not recipe_for_function(rr.recipe):
        # memguard models LoRA / DoRA (resolve/peft.py) and has Bridge's Llama ..._peft_config recipes; for another
        # the run's own ConfigContainer dump carries it all
        have = ", ".join(f for r in presets().get("recipes", {}).values() for f in (r.get("functions") or ())[:1]
                         if "_peft_" in f)
        raise NotModelledError(f"--mode {rr.mode}", f"the Megatron-Bridge PEFT recipe {rr.recipe} (memguard has "
                               f"Bridge's pretraining recipes and these PEFT ones: {have})",
                               "estimate the run's run_config.yaml: memguard reads its peft: section")
    key = recipe_for_function(rr.recipe)
    if key:
        return key
    if find_recipe(rr.recipe):   # memguard's short name, which megatron.bridge.recipes does not export
        # (before the unmodelled prefixes: 'nemotronh_8b' matched 'nemotronh_', "a recipe memguard has no entry for")
        raise ConfigError(f"--recipe {rr.recipe}", "is not a recipe function of megatron.bridge.recipes; "
                          f"{SCRIPT} would stop with \"Recipe '{rr.recipe}' not found\"", _short_name_hint(rr.recipe))
    unmodelled_recipe(rr.recipe, f"--recipe {rr.recipe}")
    names = sorted(f for r in presets().get("recipes", {}).values() for f in (r.get("functions") or ()))
    raise ConfigError("--recipe" if not re.search(r"_(sft|peft)_", rr.recipe + "_") else "--mode",
                      f"{rr.recipe} is not a Megatron-Bridge pretraining recipe memguard has",
                      "memguard has: " + ", ".join(names) + " (or give a full run_config.yaml to memguard estimate "
                      "--config)")


def overrides_before_cli(rr: RunRecipeArgs, key: str) -> list[str]:
    """The changes run_recipe.py makes between loading the recipe and applying the overrides: --dataset and
    --deterministic, as KEY=VALUE overrides."""
    from .models import recipe_doc

    out: list[str] = []
    peft = rr.mode in ("lora", "dora")
    if rr.dataset is not None:
        seq = (recipe_doc(key)[0].get("model") or {}).get("seq_length")
        if rr.dataset in VLM_DATASETS:
            # dataset_utils._require_direct_hf_config: a text recipe's dataset is no DirectHFSFTDatasetConfig
            raise ConfigError("--dataset", f"{rr.dataset} requires a recipe using DirectHFSFTDatasetConfig ({SCRIPT} "
                              f"stops: {rr.recipe} is a text recipe)")
        if (rr.dataset in PRETRAIN_DATASETS) == peft:
            # run_recipe._apply_dataset: dataset_train_mode (pretrain for a GPTDatasetConfig) must be the mode's
            raise ConfigError("--dataset", f"Mode '{rr.mode}' is incompatible with dataset '{rr.dataset}' ({SCRIPT} "
                              "stops: it is a " + ("pretraining" if peft else "fine-tuning") + " dataset)")
        if peft:
            # dataset_utils._squad_dataset_config (packing off), _tulu3_ / _gsm8k_ / _local_jsonl_dataset_config...: a
            # new fine-tuning dataset of the recipe model's sequence length (samples up to that many tokens)
            out.append("dataset={seq_length: %s}" % seq)
        else:
            # dataset_utils._mock_dataset_config / _megatron_indexed_dataset_config: a new GPTDatasetConfig of the
            # recipe model's sequence length that skips the attention mask.
            out.append("dataset={seq_length: %s, skip_getting_attention_mask_from_dataset: true}" % seq)
    if rr.deterministic:
        out += ["model.deterministic_mode=true", "model.cross_entropy_loss_fusion=false"]
    return out


# Megatron-Bridge 0.6.2 peft/dora.py DoRA's fields and defaults (target_modules, dim 32, alpha 64, dropout 0.0 'pre')
DORA_DEFAULTS = {"_target_": "megatron.bridge.peft.dora.DoRA",
                 "target_modules": ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"], "dim": 32, "alpha": 64,
                 "dropout": 0.0, "dropout_position": "pre", "lora_A_init_method": "xavier", "lora_B_init_method": "zero"}


def recipe_peft(mode: str, key: str) -> tuple[dict[str, Any], str] | None:
    """The PEFT object run_recipe.py's ``--mode dora`` makes the recipe build (``load_recipe(name, peft_scheme=mode)``;
    dataset_utils.default_peft_config: ``DoRA()``, then the fields the recipe function sets on it, ``peft_fields`` in
    data/presets.yaml); None for lora (memguard's recipes hold the functions' LoRA objects) and the other modes."""
    from .models import presets

    if mode != "dora":
        return None
    return {**DORA_DEFAULTS, **(presets()["recipes"][key].get("peft_fields") or {})}, f"--mode {mode}"


def read_run_recipe(argv: list[str], extra_overrides: list[str] | None = None) -> tuple[RunRecipeArgs, Any]:
    """(RunRecipeArgs, RawConfig) of a run_recipe.py launch: the recipe, --dataset / --deterministic, the
    overrides in run_recipe's order (``extra_overrides``, memguard's own --set, after them), then the
    dataset-to-model sequence-length sync."""
    from dataclasses import replace

    from ..config import memory_env
    from ._common import parse_overrides
    from .bridge import read_bridge

    rr = parse_run_recipe(argv)
    key = recipe_key(rr)
    overrides = overrides_before_cli(rr, key) + rr.overrides + list(extra_overrides or [])
    raw = read_bridge({}, f"recipe {key}", parse_overrides(overrides), recipe=key, sync_seq_length=SCRIPT,
                      recipe_peft=recipe_peft(rr.mode, key))
    raw = replace(raw, source=f"Megatron-Bridge {SCRIPT} --recipe {rr.recipe} (memguard recipe {key})")
    if rr.deterministic:
        raw = replace(raw, env={**raw.env, **memory_env(DETERMINISTIC_ENV)})
    return rr, raw
