"""``memguard validate FILE``: the config checker for NeMo, Megatron-Bridge and Megatron configs.

Checks the rules Megatron / NeMo / Bridge enforce at start-up (divisibility of the world size and of
the layers, heads and query groups, GBS vs MBS x DP, virtual-pipeline rules, CP and the sequence
length, keys that must agree, NeMo-only restrictions) and the memory verdict, and prints every problem
at once with the key that causes it and a fix.

Exit codes: 0 fits and no problems; 1 problems or it does not fit (tight counts); 2 the input cannot
be read or something memguard needs is missing (the world size, the shape, the vocabulary) or not
modelled.
"""
from __future__ import annotations

import argparse
import json
import sys

from ..errors import BadValueError, ConfigError, ConfigErrors, MemguardError, NotModelledError
from .main import (EXIT_BAD_INPUT, EXIT_FITS, EXIT_PROBLEM, _Parser, add_target_options, load_raw, resolve_world, target_gpu,
                   target_site)

_NEEDS_INPUT = ("is required", "the number of GPUs is unknown", "unknown vocabulary")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="memguard validate",
                description="memguard validate FILE [KEY=VALUE ...] [options] [-- Megatron flags or KEY=VALUE]")
    p.add_argument("file", nargs="?", help="a NeMo / Megatron-Bridge / NeMo 2 YAML, a Megatron functional-test "
                                           "config or a launch script (or give --config)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides (as with --set)")
    add_target_options(p)
    p.add_argument("--profile", default="auto", help="auto, transformer_engine, local, fujii2024")
    p.add_argument("--json", action="store_true", help="machine-readable output: the estimate document plus problems")
    return p


def _needs_input(e: ConfigError) -> bool:
    return any(s in e.rule for s in _NEEDS_INPUT)


def _memory_problem(raw, est) -> ConfigError:
    """The verdict as a problem: the key most responsible for the critical stage, and what to change."""
    from ..units import format_bytes

    L = est.layout
    c = est.critical
    mem = est.gpu_memory_bytes or 1
    pct = 100.0 * c.device_total_bytes / mem
    groups = {g: c.group_bytes(g) for g in ("weights", "gradients", "optimizer", "activations", "logits_loss")}
    top = max(groups, key=groups.get)
    fixes: list[str] = []
    key = raw.key("micro_batch_size")
    if top in ("optimizer", "gradients") and not L.use_distributed_optimizer and L.dp * L.cp > 1:
        key = raw.key("use_distributed_optimizer")
        fixes.append(f"enable the distributed optimizer ({key})")
    if top in ("activations", "logits_loss"):
        if L.recompute_granularity is None:
            key = raw.key("recompute_granularity")
            fixes.append(f"recompute activations ({key}: selective, or full)")
        if L.micro_batch_size > 1:
            fixes.append(f"lower {raw.key('micro_batch_size')} (now {L.micro_batch_size})")
        if L.tp > 1 and not L.sequence_parallel:
            fixes.append(f"turn on {raw.key('sequence_parallel')}")
    if top in ("weights", "gradients", "optimizer") or not fixes:
        if not fixes:
            key = raw.key("tensor_model_parallel_size")
        fixes.append(f"raise {raw.key('tensor_model_parallel_size')} (now {L.tp}) or "
                     f"{raw.key('pipeline_model_parallel_size')} (now {L.pp})")
    rule = (f"memory: {est.verdict} - critical stage pp{est.critical_stage} needs {format_bytes(c.device_total_bytes)} = "
            f"{pct:.0f}% of {format_bytes(mem)} (threshold {est.threshold * 100:.0f}%); largest: {top} "
            f"{format_bytes(groups[top])}")
    return ConfigError(key, rule, "; or ".join(fixes))


def run(own_args: list[str], flags: list[str]) -> int:
    p = build_parser()
    ns = p.parse_intermixed_args(own_args)  # FILE, KEY=VALUE and options in any order
    if ns.file and ns.config:
        print("memguard validate: error: give the config either as FILE or with --config, not both", file=sys.stderr)
        return EXIT_BAD_INPUT
    ns.config = ns.config or ns.file
    from ..readers._common import is_override_token

    bad = [t for t in ns.overrides if not is_override_token(t)]
    if bad:
        from ..numbers import shown
        print(f"memguard validate: error: {shown(bad[0])} is not a KEY=VALUE override", file=sys.stderr)
        return EXIT_BAD_INPUT
    ns.set = list(ns.set) + list(ns.overrides)
    if not ns.config and not flags and not ns.model:
        print("memguard validate: error: give a config FILE, --model NAME or Megatron flags after -- "
              "(memguard validate --help describes the options)", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        return _validate(ns, flags)
    except NotModelledError as e:
        _emit_unusable(ns, [f"{e}"])
        return EXIT_BAD_INPUT
    except ConfigErrors as e:
        _emit_unusable(ns, [str(x) for x in e.errors])
        return EXIT_BAD_INPUT
    except MemguardError as e:
        _emit_unusable(ns, [str(e)])
        return EXIT_BAD_INPUT


def _emit_unusable(ns, messages: list[str]) -> None:
    if ns.json:
        print(json.dumps({"schema": "memguard.validate/1", "valid": False, "readable": False, "errors": messages}, indent=2))
    for m in messages:
        print(f"memguard validate: error: {m}", file=sys.stderr)


def _validate(ns: argparse.Namespace, flags: list[str]) -> int:
    from ..estimator import estimate
    from ..resolve import check
    from ..units import format_bytes

    raw = load_raw(ns, flags)
    gpu, mem = target_gpu(ns)
    site = target_site(ns)
    layout, errors = check(raw, world_size=resolve_world(ns), megatron_version=ns.megatron_version, vocab_size=ns.vocab_size)
    unreadable = [e for e in errors if isinstance(e, BadValueError)]
    if unreadable:  # values memguard cannot compute with: the input cannot be read (exit 2), like estimate
        raise ConfigErrors(unreadable)
    needs = [e for e in errors if _needs_input(e)]
    problems: list[ConfigError] = list(raw.problems) + [e for e in errors if not _needs_input(e)]
    est = None
    if layout is not None and not needs:
        est = estimate(layout, profile=ns.profile, gpu=gpu, gpu_memory=mem, threshold=ns.threshold, site=site)
        if est.verdict not in ("fits", "unknown"):
            problems.append(_memory_problem(raw, est))
    problem_texts = {str(pr) for pr in raw.problems}
    notes = [w for w in raw.warnings if w not in problem_texts]
    if layout is not None:
        notes += [n for n in layout.notes if n not in raw.warnings and n not in notes]
    if raw.best_effort:
        notes.insert(0, f"{raw.source}: read on a best-effort basis (NeMo 2 exports leave out defaults)")

    if ns.json:
        doc = est.to_dict() if est is not None else {"layout": layout.to_dict() if layout else None, "stages": [],
                                                     "verdict": None}
        doc["schema"] = "memguard.validate/1"
        doc["source"] = raw.source
        doc["best_effort"] = raw.best_effort
        doc["valid"] = not problems and not needs
        doc["problems"] = [{"key": e.key, "rule": e.rule, "fix": e.fix} for e in problems]
        doc["needs_input"] = [{"key": e.key, "rule": e.rule, "fix": e.fix} for e in needs]
        doc["notes"] = notes
        print(json.dumps(doc, indent=2))
    else:
        out = [f"memguard validate: {raw.source}"]
        if needs:
            out.append(f"needs input ({len(needs)}):")
            out += [f"  {e.key}: {e.rule}" + (f"\n      fix: {e.fix}" if e.fix else "") for e in needs]
        if problems:
            out.append(f"problems ({len(problems)}):")
            for e in problems:
                out.append(f"  {e.key}: {e.rule}" if e.key else f"  {e.rule}")
                if e.fix:
                    out.append(f"      fix: {e.fix}")
        if notes:
            out.append("notes:")
            out += [f"  {n}" for n in notes]
        if est is not None:
            c = est.critical
            where = f" of {format_bytes(est.gpu_memory_bytes)}" if est.gpu_memory_bytes else ""
            out.append(f"memory: {est.verdict.upper()} - critical stage pp{est.critical_stage} needs "
                       f"{format_bytes(c.device_total_bytes)}{where} on {est.gpu or 'the GPU'} "
                       f"({layout.world_size} GPUs: TP{layout.tp} PP{layout.pp} CP{layout.cp} DP{layout.dp})")
        if needs:
            out.append("result: cannot validate until the inputs above are given")
        else:
            out.append("result: OK" if not problems else f"result: {len(problems)} problem{'s' if len(problems) > 1 else ''}")
        print("\n".join(out))
    if needs:
        return EXIT_BAD_INPUT
    return EXIT_PROBLEM if problems else EXIT_FITS
