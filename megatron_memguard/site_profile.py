"""Site profile files: the constants ``memguard calibrate`` fitted for one site, as small versioned YAML.

    schema: memguard.site/1
    memguard_version: 0.1.0.dev0
    name: my-cluster                # optional
    gpu: H100-80GB                  # optional: the GPU the runs used
    constants:                      # only the fitted ones; the others keep memguard's defaults
      cuda_context: 547356672       # bytes, or a size such as 522MiB
      nccl_per_communicator: 96MiB
      allocator_fragmentation: 0.071
    time:                           # optional (schema memguard.site/2): the planner's step-time constants
      gemm_efficiency: 0.71         #   fitted from measured step times on ``gpu``; the others keep its row's
    fit: {...}                      # optional: how they were fitted (informational)

Read by ``estimate``, ``validate``, ``check``, ``plan`` and ``report`` (``--site-profile FILE``), the
Megatron hook (``--memguard-profile FILE`` / ``MEMGUARD_PROFILE``) and the Bridge / Lightning callbacks
(``site_profile=`` / ``MEMGUARD_PROFILE``). A file from a newer memguard (schema or version) or with a key
this version does not know is refused, naming the key: a constant silently ignored would make the
estimate wrong without anyone noticing. The format is documented in docs/calibrate.md.
"""
from __future__ import annotations

import datetime
import json
import math
import os
import re
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from .errors import ConfigError
from .estimator.site import DEFAULT_SITE, SPEC, SPECS, SiteConstants
from .numbers import shown
from .units import format_bytes

SCHEMA = "memguard.site/1"
# A profile with a ``time:`` section is written as /2 (an older memguard would refuse the key anyway, by name);
# one without it stays /1, readable by every version. This version reads both.
SCHEMA_TIME = "memguard.site/2"
_SCHEMA_RE = re.compile(r"^memguard\.site/(\d+)$")
TOP_KEYS = ("schema", "memguard_version", "name", "gpu", "created", "constants", "time", "fit")
ENV = "MEMGUARD_PROFILE"
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(B|KiB|MiB|GiB)?\s*$", re.IGNORECASE)
_UNIT = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30}


@dataclass(frozen=True)
class SiteProfile:
    constants: SiteConstants
    path: str = ""
    name: str = ""
    gpu: str | None = None
    memguard_version: str = ""
    created: str = ""
    fit: Mapping[str, Any] = field(default_factory=dict, compare=False)
    # the planner's step-time constants fitted on ``gpu`` (time_constants.TIME_CONSTANTS); empty: its row's
    time: Mapping[str, float] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return self.name or (os.path.basename(self.path) if self.path else "site profile")


def _version() -> str:
    from . import __version__
    return __version__


def _newer(theirs: str, ours: str) -> bool | None:
    """Whether ``theirs`` is a newer version than ``ours``; None when it is no version."""
    from packaging.version import InvalidVersion, Version
    try:
        if len(theirs) > 40:   # (packaging converts each part to an int: 5000 digits would not convert)
            return None
        return Version(theirs) > Version(ours)
    except (InvalidVersion, ValueError):
        return None


def _bytes(v: Any, key: str) -> int:
    if isinstance(v, bool):
        raise ConfigError(key, f"expects a size in bytes (e.g. 512MiB), got {v!r}")
    if isinstance(v, int):
        return v
    if isinstance(v, float) and math.isfinite(v) and v == int(v):
        return int(v)
    m = _SIZE.match(str(v)) if isinstance(v, str) and len(v) < 100 else None
    if not m:
        raise ConfigError(key, f"expects a size in bytes (e.g. 512MiB or 536870912), got {shown(v)}")
    size = float(m.group(1)) * _UNIT[(m.group(2) or "").lower()]
    if not math.isfinite(size):   # (1e400MiB: the bounds check below names the constant's range)
        size = float(2**63)
    return int(size)


def _ratio(v: Any, key: str) -> float:
    if isinstance(v, str) and v.strip().endswith("%"):
        try:
            return float(v.strip()[:-1]) / 100
        except ValueError:
            pass
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ConfigError(key, f"expects a fraction such as 0.05 (or 5%), got {v!r}")
    return float(v)


def parse_site_profile(doc: Any, source: str = "site profile") -> SiteProfile:
    """A SiteProfile from the parsed YAML document; ConfigError naming ``source`` and the key otherwise."""
    if not isinstance(doc, dict):
        raise ConfigError(source, f"a site profile is a YAML mapping with 'schema: {SCHEMA}', got {type(doc).__name__}")
    schema = doc.get("schema")
    m = _SCHEMA_RE.match(str(schema)) if isinstance(schema, str) else None
    if not m:
        raise ConfigError(f"{source}: schema", f"expected {SCHEMA!r}, got {schema!r} (is this a memguard site profile?)")
    if m.group(1) in ("0",) or (m.group(1).startswith("0") and len(m.group(1)) > 1):   # (no /0; /02 is no schema)
        raise ConfigError(f"{source}: schema", f"expected {SCHEMA!r} or {SCHEMA_TIME!r}, got {shown(schema)} (no memguard "
                                               "wrote that schema)")
    if len(m.group(1)) > 3 or int(m.group(1)) > 2:
        raise ConfigError(f"{source}: schema", f"{schema} was written by a newer memguard; this version ({_version()}) "
                                               f"reads {SCHEMA} and {SCHEMA_TIME}",
                          "upgrade memguard or calibrate again with this version")
    for k in doc:
        if k not in TOP_KEYS:
            raise ConfigError(f"{source}: {k}", f"unknown key in a {SCHEMA} profile (known: {', '.join(TOP_KEYS)})",
                              "a profile from a newer memguard? upgrade memguard")
    written_by = doc.get("memguard_version")
    if written_by is not None and not isinstance(written_by, str):
        raise ConfigError(f"{source}: memguard_version", f"expects a version string, got {written_by!r}")
    newer = _newer(written_by, _version()) if written_by else False
    if newer is None:   # (a version nothing can compare: it may well be newer)
        raise ConfigError(f"{source}: memguard_version", f"cannot read version {shown(written_by)}; expected e.g. "
                                                         f"{_version()}")
    if newer:
        raise ConfigError(f"{source}: memguard_version", f"written by memguard {written_by}, newer than this "
                                                         f"memguard ({_version()})", "upgrade memguard")
    for k in ("name", "gpu", "created"):
        if doc.get(k) is not None and not isinstance(doc[k], (str, datetime.date)):
            raise ConfigError(f"{source}: {k}", f"expects a string, got {doc[k]!r}")
    consts = doc.get("constants")
    if consts is None:
        consts = {}
    if not isinstance(consts, dict):
        raise ConfigError(f"{source}: constants", f"expects a mapping of constant to value, got {type(consts).__name__}")
    values: dict[str, Any] = {}
    for k, v in consts.items():
        key = f"{source}: constants.{k}"
        if k not in SPEC:
            raise ConfigError(key, f"unknown site constant (known: {', '.join(SPEC)})",
                              "a profile from a newer memguard? upgrade memguard")
        s = SPEC[k]
        values[k] = _ratio(v, key) if s.unit == "ratio" else _bytes(v, key)
        if not s.lower <= values[k] <= s.upper:
            raise ConfigError(key, f"{s.format(values[k])} is outside the physical bounds "
                                   f"[{s.format(s.lower)}, {s.format(s.upper)}] of {s.what}")
    fit = doc.get("fit") or {}
    if not isinstance(fit, dict):
        raise ConfigError(f"{source}: fit", f"expects a mapping, got {type(fit).__name__}")
    time = _time_section(doc, source, int(m.group(1)))
    return SiteProfile(constants=replace(DEFAULT_SITE, **values), name=str(doc.get("name") or ""),
                       gpu=doc.get("gpu"), memguard_version=written_by or "", created=str(doc.get("created") or ""),
                       fit=fit, time=time)


def _time_section(doc: dict, source: str, version: int) -> dict[str, float]:
    """The ``time:`` section's constants, each checked against its bounds (plan's own option bounds)."""
    from .time_constants import TIME_SPEC, check_time_constant

    sec = doc.get("time")
    if sec is None:
        return {}
    if version < 2:
        raise ConfigError(f"{source}: time", f"a time section needs schema {SCHEMA_TIME} (this file says "
                                             f"memguard.site/{version})")
    if not isinstance(sec, dict):
        raise ConfigError(f"{source}: time", f"expects a mapping of time constant to value, got {type(sec).__name__}")
    if sec and not doc.get("gpu"):
        raise ConfigError(f"{source}: time", "time constants hold for one GPU type: the profile needs 'gpu:'")
    if sec:
        # (memguard plan plans the profile's GPU by its row: an unknown name was named as plan's own --gpu)
        from .gpus import GPUS, lookup_gpu
        try:
            lookup_gpu(str(doc["gpu"]))
        except ConfigError:
            raise ConfigError(f"{source}: gpu", f"{shown(doc['gpu'])} is not a GPU memguard knows (known: "
                                                f"{', '.join(GPUS)}); the time constants apply to that GPU's row") from None
    out = {}
    for k, v in sec.items():
        key = f"{source}: time.{k}"
        if k not in TIME_SPEC:
            raise ConfigError(key, f"unknown time constant (known: {', '.join(TIME_SPEC)})",
                              "a profile from a newer memguard? upgrade memguard")
        out[k] = check_time_constant(k, v, key)
    return out


def load_site_profile(path: str, key: str = "--site-profile") -> SiteProfile:
    """Read a site profile file; every problem is a ConfigError naming ``key`` (the flag or variable) and
    the file."""
    from .errors import ReaderError
    from .files import load_yaml, read_text

    try:
        doc = load_yaml(read_text(path), path)
    except ReaderError as e:   # unreadable, over 1 MiB, not YAML, nested too deep: one line with its position
        raise ConfigError(key, f"cannot read site profile: {e}") from None
    try:
        prof = parse_site_profile(doc, path)
    except ConfigError as e:
        raise ConfigError(f"{key} {e.key}" if e.key else key, e.rule, e.fix) from None
    return replace(prof, path=path)


def site_from(path: str | None, environ: Mapping[str, str] | None = None,
              key: str = "--site-profile") -> SiteProfile | None:
    """The profile at ``path``, else at $MEMGUARD_PROFILE, else None."""
    environ = os.environ if environ is None else environ
    if path:
        return load_site_profile(path, key)
    if environ.get(ENV):
        return load_site_profile(environ[ENV], ENV)
    return None


# characters YAML does not allow in a file (PyYAML's reader: C0 / C1 controls, DEL, surrogates, U+FFFE / U+FFFF) or
# reads as a line break inside quotes (NEL, U+2028, U+2029: a break folds to a space)
_YAML_UNPRINTABLE = re.compile("[^\x09\x0a\x0d\x20-\x7e\xa0-\u2027\u202a-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def name_problem(name: str) -> str | None:
    """The rule a site's name breaks, or None: it must be text (a name from bytes that are not UTF-8 holds
    surrogates, which no YAML file can hold: the profile written would not load)."""
    if any("\ud800" <= ch <= "\udfff" for ch in name):
        return f"holds bytes that are not UTF-8 text ({shown(name)}); give the name in UTF-8"
    return None


def _quoted(text: str) -> str:
    """``text`` as a YAML double-quoted scalar that reads back as ``text``: JSON's escapes (YAML has them all), other
    characters as they are, the few YAML refuses in a file as \\u escapes. (``json.dumps`` alone writes a character
    beyond U+FFFF as a surrogate pair, which YAML refuses: a name with an emoji gave a profile memguard could not read.)"""
    return _YAML_UNPRINTABLE.sub(lambda m: f"\\u{ord(m.group()):04x}", json.dumps(text, ensure_ascii=False))


def dump_site_profile(constants: Mapping[str, Any], *, name: str = "", gpu: str | None = None,
                      fit: Mapping[str, Any] | None = None, time: Mapping[str, float] | None = None) -> str:
    """The YAML text of a profile holding ``constants`` (only those given), with a comment per constant, and the
    step-time constants ``time`` fitted on ``gpu`` (schema /2 then)."""
    import yaml

    from .time_constants import TIME_CONSTANTS
    if time and not gpu:
        raise ValueError("time constants are written with the GPU they were fitted on")

    lines = ["# memguard site profile: physical constants of one site, fitted by `memguard calibrate`",
             "# (docs/calibrate.md). Use it with: memguard estimate|validate|check|plan|report --site-profile FILE;",
             "# in Megatron: --memguard-profile FILE or MEMGUARD_PROFILE=FILE; in the callbacks: site_profile=FILE.",
             "# Constants not listed keep memguard's defaults.",
             f"schema: {SCHEMA_TIME if time else SCHEMA}", f"memguard_version: {_version()}"]
    if name:
        lines.append(f"name: {_quoted(name)}")
    if gpu:
        lines.append(f"gpu: {gpu}")
    lines.append(f"created: '{datetime.date.today().isoformat()}'")
    lines.append("constants:" + ("" if constants else " {}"))
    for s in SPECS:
        if s.name not in constants:
            continue
        v = constants[s.name]
        default = getattr(DEFAULT_SITE, s.name)
        lines.append(f"  # {s.what}")
        if s.unit == "bytes":
            lines.append(f"  {s.name}: {int(v)}    # {format_bytes(v)}; default {s.format(default)}")
        else:
            lines.append(f"  {s.name}: {round(float(v), 5)}    # default {s.format(default)}")
    if time:
        from .gpus import lookup_gpu
        row = lookup_gpu(gpu)
        lines.append("time:    # memguard plan's step-time constants on this GPU (its --gemm-efficiency, ...; options win)")
        for c in TIME_CONSTANTS:
            if c.name in time:
                lines.append(f"  {c.name}: {round(float(time[c.name]), 5)}    # default {c.format(c.default(row))}")
    if fit:
        lines.append(yaml.safe_dump({"fit": dict(fit)}, sort_keys=False, default_flow_style=None, width=120).rstrip())
    return "\n".join(lines) + "\n"


__all__ = ["SCHEMA", "SCHEMA_TIME", "ENV", "SiteProfile", "parse_site_profile", "load_site_profile", "site_from", "dump_site_profile",
           "name_problem"]
