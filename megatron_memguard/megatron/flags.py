"""The ``--memguard*`` flags added to Megatron's parser, and their ``MEMGUARD_*`` environment variables.

A flag on the command line wins over its environment variable, which wins over the default. Bad
values are argparse errors naming the flag (and the variable when the value came from it), exactly
as Megatron reports its own bad flags: ``pretrain_gpt.py: error: argument --memguard-threshold: ...``.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from ..decision import DEFAULT_MODE, DEFAULT_THRESHOLD, MODES  # noqa: F401 (re-exported: megatron_memguard.megatron.MODES)
from ..errors import ConfigError
from ..numbers import INT64_MAX, python_scalar, shown, to_int
from ..units import parse_bytes


class _EnvValue(str):
    """A default taken from an environment variable (so that errors can name the variable)."""

    env: str = ""


def _from(value: str) -> str:
    env = getattr(value, "env", "")
    return f" (from {env})" if env else ""


def _mode(value: str) -> str:
    v = str(value).strip().lower()
    if v not in MODES:
        raise argparse.ArgumentTypeError(f"invalid choice: {shown(str(value))}{_from(value)} (choose from {', '.join(MODES)})")
    return v


def _threshold(value: str) -> float:
    try:
        v = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid value {shown(str(value))}{_from(value)}: expected a fraction of GPU memory such as 0.8") from None
    if not 0 < v <= 1.5:
        raise argparse.ArgumentTypeError(f"invalid value {shown(str(value))}{_from(value)}: must be in (0, 1.5]")
    return v


def _gpu_memory(value: str) -> int:
    try:
        return parse_bytes(str(value), "--memguard-gpu-memory")
    except ConfigError as e:
        raise argparse.ArgumentTypeError(f"invalid value {shown(str(value))}{_from(value)}: {e.rule}") from None


def _interval(value: str) -> int:
    try:
        return to_int(str(value), "", 1, INT64_MAX, "a 64-bit integer")
    except ConfigError as e:
        raise argparse.ArgumentTypeError(f"invalid value {shown(str(value))}{_from(value)}: {e.rule}") from None


def _env_path_problem(value: str, problem: str, instead: str) -> None:
    """A path from MEMGUARD_PROFILE / MEMGUARD_LOG_DIR that is no use: one line on stderr (rank 0) and the job
    goes on without it. The variable is set for a whole site or cluster, where the file can disappear or
    be rewritten under a running queue; a flag on the command line stays an argparse error."""
    import sys

    from ..decision import PREFIX

    if os.environ.get("RANK", "0") == "0":
        print(f"{PREFIX} error: {getattr(value, 'env', '')}={shown(str(value))}: {problem}; {instead} "
              "(training continues)", file=sys.stderr, flush=True)


def _directory(value: str) -> str | None:
    v = str(value).strip()
    problem = "empty path" if not v else "exists and is not a directory" if os.path.exists(v) and not os.path.isdir(v) else ""
    if problem and getattr(value, "env", ""):
        _env_path_problem(value, problem, "no JSONL files are written")
        return None
    if problem:
        raise argparse.ArgumentTypeError(f"invalid value {shown(str(value))}{_from(value)}: {problem}")
    return v


def _site_profile(value: str) -> str | None:
    """The path of a readable site profile (memguard calibrate's file); the path is what args keep
    (Megatron saves its args in checkpoints). From MEMGUARD_PROFILE, an unreadable profile (junk, a
    directory, a named pipe) is reported and memguard's defaults are used."""
    from ..site_profile import load_site_profile

    v = str(value).strip()
    try:
        load_site_profile(v, key="--memguard-profile")
    except ConfigError as e:
        if getattr(value, "env", ""):
            _env_path_problem(value, str(e).removeprefix("--memguard-profile").lstrip(": "),
                              "memguard's default site constants are used")
            return None
        raise argparse.ArgumentTypeError(f"invalid value {shown(str(value))}{_from(value)}: {e}") from None
    return v


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


def _boolean(value: str) -> bool:
    if isinstance(value, bool):
        return value
    v = str(value).strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise argparse.ArgumentTypeError(f"invalid value {shown(str(value))}{_from(value)}: expected true or false")


@dataclass(frozen=True)
class FlagSpec:
    flag: str
    dest: str
    env: str
    convert: Callable[[str], Any]
    default: Any
    boolean: bool
    metavar: str | None
    help: str


FLAGS: tuple[FlagSpec, ...] = (
    FlagSpec("--memguard", "memguard", "MEMGUARD", _mode, DEFAULT_MODE, False, "{" + ",".join(MODES) + "}",
             "memguard's pre-allocation check: off, report (print the estimate), warn (default: warn when it does not "
             "fit), abort (exit on every rank before allocating), autotune (change micro-batch / pipeline size to fit)"),
    FlagSpec("--memguard-threshold", "memguard_threshold", "MEMGUARD_THRESHOLD", _threshold, DEFAULT_THRESHOLD, False, "FRACTION",
             "fraction of GPU memory the predicted device total may use and still fit (default 0.8)"),
    FlagSpec("--memguard-gpu-memory", "memguard_gpu_memory", "MEMGUARD_GPU_MEMORY", _gpu_memory, None, False, "SIZE",
             "GPU memory to check against, e.g. 79.1GiB (default: the device's total memory)"),
    FlagSpec("--memguard-log-interval", "memguard_log_interval", "MEMGUARD_LOG_INTERVAL", _interval, None, False, "N",
             "compare actual with predicted memory every N iterations (default: --log-interval)"),
    FlagSpec("--memguard-log-dir", "memguard_log_dir", "MEMGUARD_LOG_DIR", _directory, None, False, "DIR",
             "write memguard-rankNNNNN.jsonl per rank here (default: no files)"),
    FlagSpec("--memguard-reset-peak", "memguard_reset_peak", "MEMGUARD_RESET_PEAK", _boolean, False, True, None,
             "reset PyTorch's peak memory stats after each memguard sample (per-interval peaks; changes what "
             "Megatron's own 'max allocated' reports mean)"),
    FlagSpec("--memguard-profile", "memguard_profile", "MEMGUARD_PROFILE", _site_profile, None, False, "FILE",
             "site constants fitted by memguard calibrate (CUDA context, NCCL buffers, workspaces, allocator slack) "
             "for the check and the runtime predictions (default: memguard's defaults)"),
    FlagSpec("--memguard-allow-recompute", "memguard_allow_recompute", "MEMGUARD_ALLOW_RECOMPUTE", _boolean, False, True, None,
             "let --memguard autotune also turn on activation recomputation (selective, then full) when "
             "micro-batch and pipeline size alone do not fit"),
)


def _env_default(spec: FlagSpec, environ: Mapping[str, str]) -> Any:
    if spec.env in environ:
        v = _EnvValue(environ[spec.env])
        v.env = spec.env
        return v
    return spec.default


def add_arguments(parser: argparse.ArgumentParser, environ: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """Add the memguard group to ``parser`` (once per parser)."""
    if "--memguard" in getattr(parser, "_option_string_actions", {}):
        return parser
    environ = os.environ if environ is None else environ
    g = parser.add_argument_group(title="memguard", description="GPU memory check before allocation and predicted vs "
                                  "actual memory while training (megatron_memguard); each flag also reads MEMGUARD_*")
    for spec in FLAGS:
        helptext = f"{spec.help} [env {spec.env}]"
        if spec.boolean:
            g.add_argument(spec.flag, dest=spec.dest, nargs="?", const=True, type=spec.convert,
                           default=_env_default(spec, environ), metavar="BOOL", help=helptext)
        else:
            g.add_argument(spec.flag, dest=spec.dest, type=spec.convert, default=_env_default(spec, environ),
                           metavar=spec.metavar, help=helptext)
    return parser


@dataclass(frozen=True)
class Settings:
    mode: str = DEFAULT_MODE
    threshold: float = DEFAULT_THRESHOLD
    gpu_memory: int | None = None
    log_interval: int | None = None
    log_dir: str | None = None
    reset_peak: bool = False
    allow_recompute: bool = False
    profile: str | None = None
    from_flags: bool = True

    def to_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "threshold": self.threshold, "gpu_memory": self.gpu_memory,
                "log_interval": self.log_interval, "log_dir": self.log_dir, "reset_peak": self.reset_peak,
                "allow_recompute": self.allow_recompute, "profile": self.profile}


def _checked_value(spec: FlagSpec, v: Any) -> Any:
    """A value found in the namespace, checked as its flag's: argparse converted what it parsed, but a
    default it did not convert, or a value set by other code (a YAML loader, a launcher), may be anything."""
    v = python_scalar(v)
    if v is None:
        return spec.default
    if spec.boolean and isinstance(v, bool):
        return v
    try:
        if spec.convert in (_directory, _site_profile):   # (checked when parsed: they touch the filesystem)
            if not isinstance(v, str):
                raise argparse.ArgumentTypeError(f"invalid value {shown(repr(v))}: expected a path")
            return v
        if isinstance(v, (bool, float)) and spec.convert is _interval or not isinstance(v, (str, int, float)):
            raise argparse.ArgumentTypeError(f"invalid value {shown(repr(v))}: expected {spec.metavar or 'true or false'}")
        return spec.convert(str(v))
    except argparse.ArgumentTypeError as e:
        raise ConfigError(spec.flag, str(e)) from None


def settings_from_args(args: Any, environ: Mapping[str, str] | None = None) -> Settings:
    """Settings from Megatron's parsed args; from the environment when the flags were not added
    (a parser built before the hook was imported, or a YAML config). Raises ConfigError naming the
    variable for a bad environment value in that case."""
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    from_flags = all(hasattr(args, s.dest) for s in FLAGS)
    for spec in FLAGS:
        if hasattr(args, spec.dest):
            v = _checked_value(spec, getattr(args, spec.dest))
        else:
            v = _env_default(spec, environ)
            if isinstance(v, str):
                try:
                    v = spec.convert(v)
                except argparse.ArgumentTypeError as e:
                    raise ConfigError(spec.env, str(e)) from None
        values[spec.dest] = v
    return Settings(mode=values["memguard"], threshold=values["memguard_threshold"], gpu_memory=values["memguard_gpu_memory"],
                    log_interval=values["memguard_log_interval"], log_dir=values["memguard_log_dir"],
                    reset_peak=bool(values["memguard_reset_peak"]), allow_recompute=bool(values["memguard_allow_recompute"]),
                    profile=values["memguard_profile"], from_flags=from_flags)
