"""``memguard``: estimate, validate, plan and check Megatron training layouts.

Exit codes (all commands): 0 fits, 1 tight or will not fit (or problems found), 2 bad input.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import TYPE_CHECKING, NoReturn, Sequence

from ..errors import ConfigError, ConfigErrors, MemguardError, one_line
from ..numbers import INT32_MAX, MAX_WORLD_SIZE, WORLD_SIZE_WHY, shown

if TYPE_CHECKING:
    from ..config import RawConfig
    from ..estimator.site import SiteConstants
    from ..gpus import GpuSpec

EXIT_FITS, EXIT_PROBLEM, EXIT_BAD_INPUT = 0, 1, 2
COMMANDS = ("estimate", "validate", "check", "plan", "report", "calibrate", "gpus")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # argparse's usage errors -> one line, exit 2
        self.exit(EXIT_BAD_INPUT, f"memguard: error: {one_line(message)}\n")


def _split_dashdash(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    argv = list(argv)
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1:]
    return argv, []


def positive_int(text: str) -> int:
    """argparse type of counts and sizes: an integer >= 1 (0 and negatives are refused, not ignored)
    and at most 2**31 - 1 (numbers.py)."""
    return _bounded(text, INT32_MAX, "")


def gpu_count(text: str) -> int:
    """argparse type of GPU and node counts: an integer in [1, numbers.MAX_WORLD_SIZE]."""
    return _bounded(text, MAX_WORLD_SIZE, WORLD_SIZE_WHY)


def _bounded(text: str, maximum: int, why: str) -> int:
    from ..numbers import integral, shown
    try:
        n = integral(text, "")
    except ConfigError:
        raise argparse.ArgumentTypeError(f"expects a positive integer, got {shown(text)}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {shown(text)}")
    if n > maximum:
        raise argparse.ArgumentTypeError(f"must be <= {maximum}" + (f" ({why})" if why else "") + f", got {shown(text)}")
    return n


def _dp_rank(text: str) -> int | str:
    if text in ("max", "last"):
        return text
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"expects a data-parallel rank index (0, 1, ...), last or max, got {text!r}")
    return n


def add_target_options(p: argparse.ArgumentParser) -> None:
    """Options shared by commands that estimate: where the job runs and what is trusted."""
    g = p.add_argument_group("cluster")
    g.add_argument("--world-size", type=gpu_count, help="number of GPUs (ranks) of the job")
    g.add_argument("--nnodes", "--nodes", type=gpu_count, dest="nnodes", help="nodes (with --nproc-per-node)")
    g.add_argument("--nproc-per-node", "--gpus-per-node", type=gpu_count, dest="nproc_per_node", help="GPUs per node")
    g.add_argument("--gpus", type=gpu_count, dest="gpus", help="same as --world-size")
    g.add_argument("--gpu", help="GPU model from the table (memguard gpus), default H100-80GB")
    g.add_argument("--gpu-memory", help="GPU memory as PyTorch reports it, e.g. 79.1GiB (overrides --gpu's)")
    g.add_argument("--threshold", type=float, default=0.8,
                   help="fraction of GPU memory the device total may use and still 'fit' (default 0.8, Fujii et al.)")
    g.add_argument("--site-profile", metavar="FILE",
                   help="site constants fitted by memguard calibrate (CUDA context, NCCL buffers, workspaces, allocator "
                        "slack); default $MEMGUARD_PROFILE, else memguard's defaults")
    m = p.add_argument_group("model")
    m.add_argument("--config", help="a Megatron functional-test model_config.yaml, a launch command / script, a NeMo 1 "
                                    "(or launcher, .nemo) / Megatron-Bridge / NeMo 2 YAML, or a Hugging Face config.json")
    m.add_argument("--model", help="the model shape from a preset (llama-3.1-8b, qwen2.5-7b, gpt3-175b, ...) or a Hugging "
                                   "Face config.json; a Megatron-Bridge recipe name (llama32_1b, llama3_8b, ...) gives "
                                   "the whole recipe, the one an override file applies to")
    m.add_argument("--vocab-size", type=positive_int, help="vocabulary size when only a tokenizer is named")
    m.add_argument("--megatron-version", default=None,
                   help="Megatron core version whose defaults apply (default 0.19; e.g. 0.16 for the legacy era)")
    m.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key (Bridge/NeMo style) before resolving; repeatable")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="memguard", description="Per-rank GPU memory of Megatron-LM / NeMo / Megatron-Bridge training.")
    sub = p.add_subparsers(dest="command")
    e = sub.add_parser("estimate", help="estimate per-stage peak memory and give a verdict",
                       description="memguard estimate [options] -- <Megatron flags as pretrain_gpt.py takes them, "
                                   "or KEY=VALUE overrides of a --config YAML>")
    add_target_options(e)
    e.add_argument("--profile", default="auto", help="auto (by --transformer-impl), transformer_engine, local, fujii2024")
    e.add_argument("--device", choices=["gpu", "cpu"], default="gpu",
                   help="cpu: the same terms without GPU-only ones (for the CPU referee)")
    e.add_argument("--dp-rank", type=_dp_rank, default="max",
                   help="DP rank whose optimizer shard to count: an index, last or max")
    e.add_argument("--json", action="store_true", help="machine-readable output (schema in docs/json-schema.md)")
    e.add_argument("--detail", action="store_true", help="show how each term is computed")
    e.add_argument("--all-stages", action="store_true", help="show the breakdown of every stage, not only the critical one")
    e.add_argument("--plot", metavar="FILE", help="also draw every stage's terms as stacked bars with the GPU capacity and "
                                                  "threshold: FILE.png, FILE.svg or FILE.html (one offline page); "
                                                  "needs matplotlib: pip install 'megatron-memguard[plot]'")
    g = sub.add_parser("gpus", help="list the GPU table")
    g.add_argument("--json", action="store_true", help="the table as JSON (bytes, FLOP/s, bytes/s)")
    for name, helptext in (("validate", "check a config against Megatron's rules and the memory verdict"),
                           ("plan", "search layouts that fit and rank them"),
                           ("check", "pre-flight a launch command"),
                           ("report", "render predicted vs actual memory of a run (memguard's JSONL or Megatron's logs)"),
                           ("calibrate", "fit a site's constants (CUDA context, NCCL buffers, workspaces, allocator "
                                         "slack) from its runs' logs")):
        sp = sub.add_parser(name, help=helptext, add_help=False)
        sp.add_argument("rest", nargs=argparse.REMAINDER)
    return p


def resolve_world(ns: argparse.Namespace) -> int | None:
    if ns.world_size:
        return ns.world_size
    if getattr(ns, "gpus", None):
        return ns.gpus
    if ns.nnodes and ns.nproc_per_node:
        return ns.nnodes * ns.nproc_per_node   # (resolve() bounds the product)
    env = os.environ.get("WORLD_SIZE")
    if env and env.strip().isdigit():
        from ..numbers import to_int
        return to_int(env, "WORLD_SIZE", 1, MAX_WORLD_SIZE, WORLD_SIZE_WHY)
    return None


def load_raw(ns: argparse.Namespace, flags: list[str]) -> RawConfig:
    """The RawConfig from --config / --model, ``--set`` and bare ``KEY=VALUE`` overrides, and the
    Megatron flags after ``--`` (flags win over the config, the config over --model)."""
    from ..config import RawConfig
    from ..readers._common import is_override_token, parse_overrides
    from ..readers.megatron_flags import parse_megatron_flags

    raw = RawConfig(args={}, source="")
    overrides = list(getattr(ns, "set", None) or [])
    model = getattr(ns, "model", None)
    recipe = None
    if model:
        from ..readers.models import find_recipe
        recipe = find_recipe(model)
    structured = bool(ns.config) and ns.config.lower().endswith((".yaml", ".yml", ".json", ".nemo"))
    if flags and (structured or (recipe and not ns.config)):
        # Bridge / Hydra style: bare KEY=VALUE tokens after -- are config overrides, not Megatron flags.
        overrides += [t for t in flags if is_override_token(t)]
        flags = [t for t in flags if not is_override_token(t)]
    model_applied = False
    if ns.config:
        from ..readers.detect import read_config_file
        raw = read_config_file(ns.config, environ=os.environ, overrides=overrides, model=model)
        model_applied = bool(recipe) and raw.source.startswith("Megatron-Bridge")
        if model_applied is False and raw.source.startswith("Megatron-Bridge") and "num_layers" not in raw.args and not model:
            from ..readers.models import recipes_named_in
            named = recipes_named_in(ns.config)
            hint = f" (the file name suggests --model {named[0]})" if named else ""
            raise ConfigError("--model", f"{ns.config} is a Megatron-Bridge override file without the model shape; "
                                         f"name the recipe it applies to{hint}",
                              "e.g. --model llama32_1b; memguard presets: see docs/readers.md")
    elif overrides:
        if not recipe:
            what = ""
            if model:
                # a refused recipe or an unknown name: its own error says more than the overrides' one
                from ..readers.models import read_model
                read_model(model)
                what = f" (--model {shown(model)} is a model preset, not a recipe)"
            raise ConfigError("--set", "KEY=VALUE overrides need --config FILE (a NeMo / Megatron-Bridge YAML) "
                                       "or --model RECIPE (a Megatron-Bridge recipe)" + what)
        from ..readers.bridge import read_bridge
        raw = read_bridge({}, f"recipe {recipe}", parse_overrides(overrides), recipe=recipe)
        model_applied = True
    if model and not model_applied:
        from ..readers.models import read_model

        mraw = read_model(model, shape_only=bool(ns.config))
        raw = mraw.merged(raw) if raw.args else mraw
    if flags:
        fraw = parse_megatron_flags(flags, env=os.environ, refuse_overrides=True)
        raw = raw.merged(fraw) if raw.args else fraw
    if not raw.args:
        raise ConfigError("", "no model given: pass Megatron flags after --, or --config FILE, or --model NAME")
    return raw


def target_gpu(ns: argparse.Namespace) -> tuple[GpuSpec | None, int | None]:
    """(--gpu's table entry, --gpu-memory in bytes); H100-80GB when neither is given."""
    from ..gpus import lookup_gpu
    from ..units import parse_bytes

    # (an empty --gpu '' / --gpu-memory '' is a value, refused by name, not the default taken silently)
    gpu = lookup_gpu(ns.gpu) if ns.gpu is not None else (None if ns.gpu_memory is not None else lookup_gpu("H100-80GB"))
    mem = parse_bytes(ns.gpu_memory, "--gpu-memory") if ns.gpu_memory is not None else None
    if not 0 < ns.threshold <= 1.5:
        raise ConfigError("--threshold", f"must be a fraction of GPU memory in (0, 1.5], got {ns.threshold}")
    return gpu, mem


def file_name(path: str | None, flag: str) -> str | None:
    """``path`` as given to ``flag`` (None: not given). An empty name or one holding a NUL character names no file:
    an error, where a plain ``if path:`` would silently skip the output or read memguard's defaults."""
    if path is None:
        return None
    if not path:
        raise ConfigError(flag, "is an empty file name", f"leave {flag} out, or give a file")
    if "\x00" in path:
        raise ConfigError(flag, f"{shown(path)} is not a file name (it holds a NUL character)")
    return path


def path_text(path: str) -> str:
    """``path`` for a message line: as it is, or quoted with escapes when it holds a line break or another
    control character (a file name may hold any but NUL and '/': printed raw it would break the line)."""
    return path if path.isprintable() else repr(path)


def target_site(ns: argparse.Namespace) -> SiteConstants | None:
    """The constants of --site-profile (or $MEMGUARD_PROFILE); None: memguard's defaults."""
    from ..site_profile import site_from

    key = getattr(ns, "site_profile_key", None) or "--site-profile"   # (check: the launch's own variable or flag)
    prof = site_from(file_name(getattr(ns, "site_profile", None), key), key=key)
    return prof.constants if prof is not None else None


def cmd_estimate(ns: argparse.Namespace, flags: list[str]) -> int:
    from ..estimator import estimate
    from ..report.text import render
    from ..resolve import resolve

    stream = None
    file_name(ns.plot, "--plot")
    if ns.plot:  # fail before any output when the file name or matplotlib is wrong
        from ..report.plots import open_early, output_format, require_matplotlib
        stream = open_early(ns.plot, output_format(ns.plot))   # a named pipe: opened now, refused if nobody reads it
        require_matplotlib()                                   # (after: importing matplotlib takes a second)
    raw = load_raw(ns, flags)
    if raw.problems:  # the config breaks a rule of its own format (memguard validate lists them with the rest)
        raise ConfigErrors(list(raw.problems))
    layout = resolve(raw, world_size=resolve_world(ns), megatron_version=ns.megatron_version, vocab_size=ns.vocab_size)
    gpu, mem = target_gpu(ns)
    est = estimate(layout, profile=ns.profile, device=ns.device, gpu=gpu, gpu_memory=mem, threshold=ns.threshold,
                   dp_rank=ns.dp_rank, site=target_site(ns))
    if ns.json:
        print(json.dumps(est.to_dict(), indent=2))
    else:
        print(render(est, detail=ns.detail, all_stages=ns.all_stages))
    if ns.plot:
        from ..report.plots import write_estimate_plot
        write_estimate_plot(est, ns.plot, stream)
        print(f"memguard: plot written to {path_text(ns.plot)}", file=sys.stderr)
    return EXIT_FITS if est.verdict in ("fits", "unknown") else EXIT_PROBLEM


def cmd_gpus(ns: argparse.Namespace) -> int:
    from ..gpus import GPUS
    from ..report.text import table
    from ..units import format_bytes

    if ns.json:
        print(json.dumps({g.name: {"memory_bytes": g.memory_bytes, "nominal": g.nominal, "gpus_per_node": g.gpus_per_node,
                                   "nvlink_domain": g.nvlink_domain, "bf16_flops": g.bf16_flops,
                                   "hbm_bytes_per_s": g.hbm_bytes_per_s, "nvlink_bytes_per_s": g.nvlink_bytes_per_s,
                                   "network_bytes_per_s": g.network_bytes_per_s, "gemm_efficiency": g.gemm_efficiency,
                                   "attention_efficiency": g.attention_efficiency, "sms": g.sms,
                                   "host_bytes_per_s": g.host_bytes_per_s}
                          for g in GPUS.values()}, indent=2))
        return 0
    rows = [[g.name, g.nominal, format_bytes(g.memory_bytes), str(g.gpus_per_node), f"{g.bf16_flops / 1e12:.0f}",
             f"{g.hbm_bytes_per_s / 1e12:.2f}", f"{g.nvlink_bytes_per_s / 1e9:.0f}", f"{g.network_bytes_per_s * 8 / 1e9:.0f}",
             f"{g.host_bytes_per_s / 1e9:.0f}", f"{g.gemm_efficiency:.2f}", f"{g.attention_efficiency:.2f}", str(g.sms)] for g in GPUS.values()]
    print(table(rows, ["gpu", "part", "memory (as PyTorch reports)", "per node", "bf16 TFLOP/s", "HBM TB/s",
                       "NVLink GB/s", "network Gb/s", "host link GB/s", "GEMM eff.", "attention eff.", "SMs"],
                right=tuple(range(2, 12))))
    print("\nLinks per GPU and direction. The speed columns (HBM to SMs) feed `memguard plan`'s step-time model; set your "
          "cluster's own with --network-gbps, --gemm-efficiency, --attention-efficiency (docs/planner.md).")
    return 0


def _no_command() -> int:
    print(f"memguard: error: no command given; choose one of {', '.join(COMMANDS)} (memguard --help describes them)",
          file=sys.stderr)
    return EXIT_BAD_INPUT


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    own, flags = _split_dashdash(argv)
    parser = build_parser()
    if not own:
        return _no_command()
    cmd = own[0]
    try:
        if cmd in ("validate", "plan", "check", "report", "calibrate"):
            import importlib
            try:
                mod = importlib.import_module(f"megatron_memguard.cli.{cmd}")
            except ModuleNotFoundError:
                print(f"memguard: error: '{cmd}' is not available in this version", file=sys.stderr)
                return EXIT_BAD_INPUT
            return mod.run(own[1:], flags)
        ns = parser.parse_args(own)
        if ns.command == "estimate":
            return cmd_estimate(ns, flags)
        if ns.command == "gpus":
            return cmd_gpus(ns)
        return _no_command()
    except ConfigErrors as e:
        for err in e.errors:
            print(f"memguard: error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except MemguardError as e:
        print(f"memguard: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except BrokenPipeError:
        return EXIT_FITS
    except Exception as e:  # a bug of memguard's own: one line, not a traceback (MEMGUARD_DEBUG=1 shows it)
        if os.environ.get("MEMGUARD_DEBUG"):
            raise
        print(f"memguard: internal error: {type(e).__name__}: {one_line(str(e))} (a bug in memguard, not in your input; "
              "MEMGUARD_DEBUG=1 shows where)", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
