"""From what the user wrote to a Layout: Megatron's defaults, derivations and rules.

This mirrors ``validate_args`` in ``megatron/training/arguments.py`` (core_v0.16 .. core_v0.19), the
vocabulary padding done when the tokenizer is built, and the checks of TransformerConfig and the
pipeline schedules, for the settings that decide memory. Every broken rule is reported with the flag
or key the user wrote; ``resolve`` raises all of them at once.

The work is split in sections (one module each), run in validate_args's order by ``SECTIONS``: each
reads the raw arguments through ``Args`` and returns its part of the Layout as flat Megatron names,
recording broken rules in ``Args.errors`` as it goes. What memguard refuses to estimate is data in
``refusals.py``. A new feature (MoE, FP8, Megatron-FSDP) is one new section and one refusal row less.
"""
from __future__ import annotations

from typing import Any, Callable

from packaging.version import InvalidVersion, Version

from ..config import RawConfig
from ..errors import ConfigError, ConfigErrors
from ..layout import Layout
from ..numbers import shown
from . import batch, kernels, optimizer, parallel, pipeline, precision, recompute, runtime, shape, vocab
from .args import Args, Stop
from .refusals import refuse

DEFAULT_MEGATRON_VERSION = "0.19"

__all__ = ["DEFAULT_MEGATRON_VERSION", "SECTIONS", "check", "parse_version", "resolve"]


def parse_version(text: str, key: str = "--megatron-version") -> Version:
    try:
        if len(str(text)) > 40:   # (packaging converts each part to an int: 5000 digits would not convert)
            raise InvalidVersion(text)
        return Version(str(text).lstrip("v").replace("core_v", "").replace("core_r", ""))
    except InvalidVersion:
        raise ConfigError(key, f"cannot read Megatron version {shown(text)}; write e.g. 0.16 or 0.19.2") from None


class _Context:
    """What sections need besides the flat names resolved so far: the version and the overrides."""

    def __init__(self, version: Version, world_size: int | None, vocab_size: int | None):
        self.version = version
        self.legacy = version < Version("0.18")
        self.world_size = world_size
        self.vocab_size = vocab_size


Section = Callable[[Args, dict, _Context], dict]

# The sections in validate_args's order: the order decides the order of the errors a user sees (and
# where a Stop ends the reading), so a new section goes where Megatron checks its flags.
SECTIONS: tuple[tuple[str, Section], ...] = (
    ("refusals", lambda a, kw, c: refuse(a)),
    ("parallel", lambda a, kw, c: parallel.parallel(a, c.world_size)),
    ("shape (required)", lambda a, kw, c: shape.required(a)),
    ("recompute granularity", lambda a, kw, c: recompute.granularity(a)),
    ("batch", lambda a, kw, c: batch.batch(a, kw)),
    ("sequence", lambda a, kw, c: shape.sequence(a, kw)),
    ("shape", lambda a, kw, c: shape.dense_shape(a, kw)),
    ("precision", lambda a, kw, c: precision.precision(a, kw)),
    ("sequence parallel", lambda a, kw, c: parallel.sequence_parallel(a, kw)),
    ("pipeline split", lambda a, kw, c: pipeline.pipeline(a, kw)),
    ("recompute", lambda a, kw, c: recompute.recompute(a, kw)),
    ("optimizer", lambda a, kw, c: optimizer.optimizer(a, kw)),
    ("kernels", lambda a, kw, c: kernels.implementation(a, kw)),
    ("attention variant", lambda a, kw, c: shape.attention_variant(a, kw)),
    ("numerics", lambda a, kw, c: kernels.numerics(a, kw, c.legacy)),
    ("vocabulary", lambda a, kw, c: vocab.vocab(a, kw, c.legacy, c.vocab_size)),
    ("weight-gradient deferral", lambda a, kw, c: kernels.wgrad(a, kw)),
    ("runtime", lambda a, kw, c: runtime.runtime(a, kw, c.version)),
)


def _run(a: Args, world_size: int | None, version_text: str, vocab_size: int | None) -> Layout | None:
    """Every section in order; None when a rule is broken (the errors are in ``a.errors``)."""
    version = parse_version(version_text)
    ctx = _Context(version, world_size, vocab_size)
    kw: dict[str, Any] = {}
    try:
        for _name, section in SECTIONS:
            kw.update(section(a, kw, ctx))
    except Stop:
        return None
    if a.errors:
        return None
    kw.update(runtime.late_options(a, kw))
    kw.update(megatron_version=str(version), notes=tuple(a.notes))
    return Layout(**kw)


def _version_text(a: Args, megatron_version: str | None) -> str:
    return megatron_version or a.a.get("megatron_version") or DEFAULT_MEGATRON_VERSION


def resolve(
    raw: RawConfig,
    world_size: int | None = None,
    megatron_version: str | None = None,
    vocab_size: int | None = None,
) -> Layout:
    """Apply Megatron's defaults and rules to ``raw``; raise ConfigErrors listing every problem."""
    a = Args(raw)
    layout = _run(a, world_size, _version_text(a, megatron_version), vocab_size)
    if a.errors:
        if len(a.errors) == 1:
            raise a.errors[0]
        raise ConfigErrors(a.errors)
    assert layout is not None
    return layout


def check(raw: RawConfig, world_size: int | None = None, megatron_version: str | None = None,
          vocab_size: int | None = None) -> tuple[Layout | None, list[ConfigError]]:
    """Like ``resolve`` but returns the problems instead of raising (for ``memguard validate``)."""
    a = Args(raw)
    try:
        layout = _run(a, world_size, _version_text(a, megatron_version), vocab_size)
    except ConfigError as e:
        return None, a.errors + [e]
    return (layout if not a.errors else None), a.errors
