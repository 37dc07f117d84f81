"""Megatron-Bridge pre-training with memguard's pre-flight: the recipe, then the --config-file and
KEY=VALUE overrides, then the check, then pretrain() with the memguard callback.

    torchrun --nproc-per-node 8 examples/bridge_pretrain.py --config-file my_overrides.yaml \\
        model.tensor_model_parallel_size=2 train.global_batch_size=256

Every rank runs the check on the ConfigContainer as it will be trained (after the overrides, before
pretrain() builds anything); with --memguard abort (or MEMGUARD=abort) every rank exits with code 3
when it does not fit. While training, each rank logs its peak memory against its own stage's
prediction (--memguard-log-dir, or MEMGUARD_LOG_DIR: one JSONL file per rank, and Bridge's TensorBoard
/ W&B writers).

Without Megatron-Bridge installed (and for the tests): MEMGUARD_LAUNCH_STUB=echo builds the recipe's
ConfigContainer as a dict from memguard's recipe table (megatron_memguard/data/presets.yaml), applies
the same overrides, runs the same pre-flight and prints the pretrain() call instead of making it.
"""
from __future__ import annotations

import argparse
import os
import sys


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default="llama3_8b", help="the Bridge recipe (llama3_8b -> llama3_8b_pretrain_config)")
    p.add_argument("--config-file", help="a YAML of overrides, merged over the recipe")
    p.add_argument("--memguard", default=None, choices=["off", "report", "warn", "abort"],
                   help="what the pre-flight does (default: MEMGUARD, else warn)")
    p.add_argument("--memguard-gpu", default=None, help="GPU to check against (default: this rank's device)")
    p.add_argument("--memguard-log-dir", default=None, help="one memguard-rankNNNNN.jsonl per rank")
    p.add_argument("overrides", nargs="*", help="KEY=VALUE overrides (Hydra syntax)")
    return p.parse_args(argv)


def bridge_config(args):
    """The recipe with the overrides applied, as Bridge's own example scripts build it."""
    import importlib

    from megatron.bridge.training.utils.omegaconf_utils import process_config_with_overrides  # type: ignore

    recipes = importlib.import_module("megatron.bridge.recipes.llama")
    cfg = getattr(recipes, f"{args.recipe}_pretrain_config")()
    return process_config_with_overrides(cfg, config_filepath=args.config_file, cli_overrides=args.overrides)


def stub_config(args) -> dict:
    """Without Bridge: the recipe's ConfigContainer as a dict, the same overrides merged over it."""
    import yaml

    from megatron_memguard.readers._common import apply_overrides, parse_overrides
    from megatron_memguard.readers.models import recipe_doc

    doc, _, _ = recipe_doc(args.recipe)
    doc = {"_target_": "megatron.bridge.training.config.ConfigContainer", **doc}
    if args.config_file:
        with open(args.config_file) as f:
            over = yaml.safe_load(f) or {}
        doc = merge(doc, over)
    return apply_overrides(doc, parse_overrides(args.overrides))


def merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def main(argv=None) -> int:
    from megatron_memguard.bridge import MemguardCallback, bridge_available, preflight

    args = parse_args(argv)
    stub = os.environ.get("MEMGUARD_LAUNCH_STUB")
    if bridge_available() and not stub:
        cfg = bridge_config(args)
    elif stub:
        cfg = stub_config(args)
    else:
        print("bridge_pretrain.py needs Megatron-Bridge (pip install megatron-bridge); MEMGUARD_LAUNCH_STUB=echo "
              "runs the pre-flight without it", file=sys.stderr)
        return 2

    # The pre-flight: on the container as it will train, before pretrain() allocates anything.
    result = preflight(cfg, gpu=args.memguard_gpu, mode=args.memguard)

    if stub:
        print(f"[MEMGUARD_LAUNCH_STUB={stub}] pretrain(cfg, forward_step, callbacks=[MemguardCallback(result, log_dir={args.memguard_log_dir!r})])"
              f"  # verdict: {result.verdict}")
        return 0
    from megatron.bridge.training.gpt_step import forward_step  # type: ignore
    from megatron.bridge.training.pretrain import pretrain  # type: ignore

    pretrain(cfg, forward_step, callbacks=[MemguardCallback(result, log_dir=args.memguard_log_dir)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
