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

from typing import Any, Callable, Mapping

from packaging.version import InvalidVersion, Version

from ..config import RawConfig
from ..errors import ConfigError, ConfigErrors
from ..layout import Layout
from ..numbers import shown
from . import batch, cuda_graphs, fp8, fsdp, heterogeneous, hybrid, kernels, moe, mtp, muon, offload, optimizer, parallel
from . import dsa, gdn, peft, pipeline, precision, recompute, releases, runtime, shape, tp_overlap, vocab
from .args import Args, Context, Stop
from .refusals import refuse

DEFAULT_MEGATRON_VERSION = "0.19"

__all__ = ["DEFAULT_MEGATRON_VERSION", "SECTIONS", "check", "parse_version", "resolve"]


# the releases whose rules memguard has read (docs/assumptions.md, "Megatron version")
OLDEST_READ, NEWEST_READ = Version("0.16"), Version("0.19")


def parse_version(text: str, key: str = "--megatron-version") -> Version:
    """The release a version names: its numbers only. A pre-release, dev build or local build (``0.19.0rc0``,
    what a Megatron-LM checkout reports) has its release's rules: packaging orders ``0.19.0rc0`` before 0.19,
    which gave it 0.18's rules in some sections and 0.19's in others. An epoch (``1!0.16``) names no release."""
    try:
        if len(str(text)) > 40:   # (packaging converts each part to an int: 5000 digits would not convert)
            raise InvalidVersion(text)
        v = Version(str(text).lstrip("v").replace("core_v", "").replace("core_r", ""))
    except InvalidVersion:
        raise ConfigError(key, f"cannot read Megatron version {shown(text)}; write e.g. 0.16 or 0.19.2") from None
    if v.epoch:
        raise ConfigError(key, f"cannot read Megatron version {shown(text)} (no megatron-core release has an epoch); "
                               "write e.g. 0.16 or 0.19.2")
    return Version(".".join(map(str, v.release)))


def version_note(v: Version) -> str | None:
    """What a version outside the releases memguard has read is estimated with."""
    if v < OLDEST_READ:
        return (f"megatron-core {v} is older than the oldest release memguard has read ({OLDEST_READ}): "
                f"its rules and defaults are {OLDEST_READ}'s")
    if Version(f"{v.major}.{v.minor}") > NEWEST_READ:
        return (f"megatron-core {v} is newer than the newest release memguard has read ({NEWEST_READ}): "
                f"its rules and defaults are {NEWEST_READ}'s")
    return None


# A section: (raw arguments, flat names resolved so far, context) -> its flat names. It records broken
# rules in Args.errors and raises Stop only when it cannot go on.
Section = Callable[[Args, Mapping[str, Any], Context], dict[str, Any]]

# The sections in validate_args's order: the order decides the order of the errors a user sees (and
# where a Stop ends the reading), so a new section goes where Megatron checks its flags.
SECTIONS: tuple[tuple[str, Section], ...] = (
    ("release flags", releases.release_flags),     # the release's argparse, before validate_args
    ("refusals", refuse),
    ("parallel", parallel.parallel),
    ("hybrid pattern", hybrid.pattern),            # sets the layer count and the pipeline split
    ("shape (required)", shape.required),
    ("recompute granularity", recompute.granularity),
    ("batch", batch.batch),
    ("sequence", shape.sequence),
    ("shape", shape.dense_shape),
    ("context-parallel attention", shape.cp_attention),
    ("precision", precision.precision),
    ("sequence parallel", parallel.sequence_parallel),
    ("tp comm overlap", tp_overlap.tp_overlap),
    ("pipeline split", pipeline.pipeline),
    ("recompute", recompute.recompute),
    ("fsdp", fsdp.fsdp),
    ("optimizer", optimizer.optimizer),
    ("optimizer offload", fsdp.optimizer_offload),
    ("fp8", fp8.fp8),
    ("kernels", kernels.implementation),
    ("mixture of experts", moe.moe),
    ("attention variant", shape.attention_variant),
    ("deepseek sparse attention", dsa.dsa),
    ("multi-token prediction", mtp.mtp),
    ("muon", muon.muon),
    ("activation offloading", offload.offload),
    ("cuda graphs", cuda_graphs.cuda_graphs),
    ("numerics", kernels.numerics),
    ("heterogeneous layers", heterogeneous.heterogeneous),
    ("gated delta net", gdn.gdn),      # GDN layers: a GPT model's --linear-attention-freq, a hybrid model's 'G'
    ("mamba", hybrid.mamba),
    ("tensor-parallel split", shape.tp_split),
    ("vocabulary", vocab.vocab),
    ("weight-gradient deferral", kernels.wgrad),
    ("peft", peft.peft),               # Bridge / NeMo only: Megatron-LM has no PEFT
    ("hybrid peft", hybrid.with_peft),
    ("gdn peft", gdn.with_peft),
    ("runtime", runtime.runtime),
)


def _run(a: Args, world_size: int | None, version_text: str, vocab_size: int | None) -> Layout | None:
    """Every section in order; None when a rule is broken (the errors are in ``a.errors``)."""
    ctx = Context(parse_version(version_text), world_size, vocab_size)
    note = version_note(ctx.version)
    if note:
        a.notes.append(note)
    kw: dict[str, Any] = {}
    try:
        for _name, section in SECTIONS:
            kw.update(section(a, kw, ctx))
        if a.errors:
            return None
        kw.update(runtime.late_options(a, kw, ctx))
    except Stop:
        return None
    kw.update(megatron_version=str(ctx.version), notes=tuple(a.notes))
    layout = Layout.from_flat(**kw)
    # the layer count of each model chunk comes from the partition of the built layout
    uniform = recompute.uniform_group_violation(layout)
    if uniform:
        a.fail(*uniform)
        return None
    if layout.fp8 or layout.fp4:
        # the quantized GEMMs' shapes come from the layer recipes, so this rule reads the built layout
        from .fp8_shapes import shape_violations
        for dest, rule in shape_violations(layout):
            a.fail(dest, rule)
        if a.errors:
            return None
    return layout


def _version_text(a: Args, megatron_version: str | None) -> str:
    if megatron_version is not None:   # ('' is a version given and unreadable, not the default)
        return megatron_version
    return dict.get(a.a, "megatron_version") or DEFAULT_MEGATRON_VERSION


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
