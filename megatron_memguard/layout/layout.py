"""``Layout``: the resolved training layout, as frozen parts under Megatron's argument names.

A Layout is what ``resolve`` makes of a RawConfig after applying Megatron's defaults and derivations
(``validate_args``, the tokenizer's vocabulary padding, TransformerConfig's ``__post_init__``) and
checking its rules. It holds parts the way megatron-core separates ``ModelParallelConfig`` from
``TransformerConfig``: ``parallel``, ``shape``, ``batch``, ``split``, ``precision``, ``optim``,
``recompute``, ``kernels``, ``provenance`` (+ ``notes``). Every Megatron ``args`` name stays readable
as a flat read-only property (``L.hidden_size``), and ``to_dict()`` writes the flat document that
``memguard estimate --json`` shows.
"""
from __future__ import annotations

import dataclasses
import operator
from itertools import groupby
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from .chunk import Chunk
from .flat import FLAT, FLAT_NAMES, FP8_NAMES, MOE_ONLY, OMITTED_AT_DEFAULT, TUPLE_FIELDS
from .kernels import Kernels
from .parallelism import Parallelism, ShardGroup
from .precision import Precision, TensorKind
from .provenance import Provenance
from .shape import ModelShape
from .training import Batch, Optimizer, PipelineSplit, Recompute


class _derived:
    """A read-only value derived from a frozen layout, stored in the instance at its first read (a
    non-data descriptor, like functools.cached_property without its lock): the estimator reads these
    in its inner loops, where a property call per read is the cost."""

    def __init__(self, func: Any) -> None:
        self.func, self.name, self.__doc__ = func, func.__name__, func.__doc__

    def __get__(self, obj: Any, owner: Any = None) -> Any:
        if obj is None:
            return self
        value = obj.__dict__[self.name] = self.func(obj)
        return value


@dataclass(frozen=True)
class Layout:
    parallel: Parallelism
    shape: ModelShape
    batch: Batch
    split: PipelineSplit
    precision: Precision
    optim: Optimizer
    recompute: Recompute
    kernels: Kernels
    provenance: Provenance
    # mixture of experts: the MoE settings (megatron_memguard.estimator.layers.moe.MoeSpec), None: dense
    moe: Any = None
    # LoRA / DoRA fine-tuning: the adapters (megatron_memguard.layout.peft.PeftSpec), None: every weight trains
    peft: Any = None
    notes: tuple[str, ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        # Every flat name as a plain instance attribute from the start (see _Flat).
        d = self.__dict__
        for p, t in PARTS.items():
            part = d[p]
            d.update({n: getattr(part, n) for n in _PART_FIELDS[t]})

    def __hash__(self) -> int:
        # Layouts key the estimator's caches; hashing every setting on every lookup is the cost, so the
        # hash is computed once (frozen: it cannot change).
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash((self.parallel, self.shape, self.batch, self.split, self.precision, self.optim,
                      self.recompute, self.kernels, self.provenance, self.moe, self.peft))
            self.__dict__["_hash"] = h
        return h

    # ----- building -----
    @classmethod
    def from_flat(cls, **kw: Any) -> "Layout":
        """A Layout from Megatron's flat names (what ``resolve`` computes); TypeError for an unknown
        name or a missing required one, as a dataclass constructor raises."""
        notes = tuple(kw.pop("notes", ()))
        moe = kw.pop("moe", None)
        peft = kw.pop("peft", None)
        # Built without the dataclasses' __init__, whose object.__setattr__ per field made building a
        # layout 3x slower than the flat one (resolve runs once per layout the planner considers).
        obj = object.__new__(cls)
        d = obj.__dict__
        used = 0
        for p, t in PARTS.items():
            names = _PART_FIELDS[t]
            try:
                given = _PART_GETTERS[t](kw)                 # all of the part's names given (resolve)
            except KeyError:
                values = {n: kw[n] for n in names if n in kw}
                part = _build(t, values)
                d.update(part.__dict__)                      # the defaults of the names not given
                used += len(values)
            else:
                part = object.__new__(t)
                part.__dict__.update(zip(names, given))
                used += len(names)
            d[p] = part
        if used != len(kw):
            raise TypeError(f"Layout has no field {sorted(kw.keys() - _PART_NAMES)[0]!r}")
        d.update(kw)                                         # every flat name as an instance attribute
        d["moe"] = _moe_part(moe)
        d["peft"] = _peft_part(peft)
        d["notes"] = notes
        return obj

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Layout":
        """The inverse of ``to_dict`` (lists and objects back to tuples)."""
        kw = dict(d)
        for name in TUPLE_FIELDS:
            if name in kw:
                v = kw[name]
                kw[name] = tuple(tuple(x) if isinstance(x, list) else x
                                 for x in (v.items() if isinstance(v, dict) else v or ()))
        return cls.from_flat(**kw)

    def replace(self, **kw: Any) -> "Layout":
        """A copy with some flat settings changed (``dataclasses.replace`` for the flat names)."""
        changes: dict[str, dict[str, Any]] = {}
        own: dict[str, Any] = {}
        for name, value in kw.items():
            part = FLAT.get(name)
            if part is None:
                raise TypeError(f"Layout has no field {name!r}")
            if part:
                changes.setdefault(part, {})[name] = value
            else:
                own[name] = value
        for part, c in changes.items():
            own[part] = dataclasses.replace(getattr(self, part), **c)
        return dataclasses.replace(self, **own)

    def to_dict(self) -> dict[str, Any]:
        quantized = self.fp8 or self.fp4
        d = {name: getattr(self, name) for name in FLAT_NAMES if quantized or name not in FP8_NAMES}
        if self.moe is None:
            for name in MOE_ONLY:
                del d[name]
        else:
            d["moe"] = self.moe.to_dict()
        if self.peft is not None:
            d["peft"] = self.peft.to_dict()
        for name, default in OMITTED_AT_DEFAULT.items():
            if d.get(name, default) == default:   # (an FP8 name is absent without FP8)
                d.pop(name, None)
            elif isinstance(d[name], tuple):
                d[name] = list(d[name])
        d["recompute_modules"] = list(self.recompute_modules)
        d["env"] = dict(self.env)
        d["notes"] = list(self.notes)
        return d

    # ----- derived quantities used across the estimator (computed once per layout, see _derived) -----
    @_derived
    def tp(self) -> int:
        return self.parallel.tensor_model_parallel_size

    @_derived
    def pp(self) -> int:
        return self.parallel.pipeline_model_parallel_size

    @_derived
    def cp(self) -> int:
        return self.parallel.context_parallel_size

    @_derived
    def dp(self) -> int:
        return self.parallel.data_parallel_size

    @_derived
    def vpp(self) -> int:
        return self.parallel.vpp

    @_derived
    def param_bytes(self) -> int:
        return self.precision.bytes_of(TensorKind.PARAM)

    @property
    def fp8_spec(self):
        """FP8 / FP4 settings (``estimator.fp8.Fp8Spec``; ``.enabled`` is False without them)."""
        return self.precision.fp8_spec

    @_derived
    def act_bytes(self) -> int:
        """Bytes per activation element: the autocast dtype when set, else the params' dtype."""
        return self.precision.bytes_of(TensorKind.ACTIVATION)

    @_derived
    def grad_bytes(self) -> int:
        """Bytes per element of gradients as DDP accumulates and reduces them."""
        return self.precision.bytes_of(TensorKind.GRAD_REDUCE)

    @_derived
    def dp_shard_size(self) -> int:
        """Ranks the distributed optimizer shards over: DP x CP / optimizer instances."""
        return self.parallel.shard_size(ShardGroup.DENSE_DP)

    @_derived
    def fused_wgrad(self) -> bool:
        return self.kernels.fused_wgrad

    @property
    def env_dict(self) -> dict[str, str]:
        return dict(self.provenance.env)

    @cached_property
    def chunks(self) -> tuple[Chunk, ...]:
        from ..partition import partition_layers
        return partition_layers(self)

    @cached_property
    def _chunks_by_stage(self) -> dict[int, tuple[Chunk, ...]]:
        # partition_layers lists the chunks rank by rank (each rank's virtual stages in order): one run per rank
        return {r: tuple(cs) for r, cs in groupby(self.chunks, _PP_RANK)}

    def stage_chunks(self, pp_rank: int) -> tuple[Chunk, ...]:
        return self._chunks_by_stage.get(pp_rank, ())


_PP_RANK = operator.attrgetter("pp_rank")

PARTS: dict[str, type] = {"parallel": Parallelism, "shape": ModelShape, "batch": Batch, "split": PipelineSplit,
                          "precision": Precision, "optim": Optimizer, "recompute": Recompute, "kernels": Kernels,
                          "provenance": Provenance}


_PART_FIELDS: dict[type, tuple[str, ...]] = {t: tuple(f.name for f in dataclasses.fields(t)) for t in PARTS.values()}
_PART_GETTERS = {t: operator.itemgetter(*names) for t, names in _PART_FIELDS.items()}
_PART_NAMES = frozenset(n for names in _PART_FIELDS.values() for n in names)
_PART_DEFAULTS: dict[type, dict[str, Any]] = {
    t: {f.name: f.default for f in dataclasses.fields(t) if f.default is not dataclasses.MISSING} for t in PARTS.values()}


def _moe_part(value: Any) -> Any:
    """The ``moe`` part from a MoeSpec, its ``to_dict()`` (from_dict), or None."""
    if value is None or not isinstance(value, dict):
        return value
    from .moe import MoeSpec
    return MoeSpec.from_dict(value)


def _peft_part(value: Any) -> Any:
    """The ``peft`` part from a PeftSpec, its ``to_dict()`` (from_dict), or None."""
    if value is None or not isinstance(value, dict):
        return value
    from .peft import PeftSpec
    return PeftSpec.from_dict(value)


def _build(t: type, values: dict[str, Any]) -> Any:
    """``t(**values)`` for a frozen part whose fields all have immutable defaults or are given."""
    obj = object.__new__(t)
    d = obj.__dict__
    d.update(_PART_DEFAULTS[t])
    d.update(values)
    if len(d) != len(_PART_FIELDS[t]):
        return t(**values)  # a required field is missing: the dataclass's own TypeError names it
    return obj


class _Flat:
    """A flat Megatron name read from its part. Building a Layout already stores every flat value
    in the instance (the estimator reads them in its inner loops, where a property call per read is
    the cost); this non-data descriptor is the fallback and stores the value at its first read.
    Writing is refused by the frozen dataclass like any other attribute."""

    __slots__ = ("part", "name")

    def __init__(self, part: str, name: str) -> None:
        self.part, self.name = part, name

    def __get__(self, obj: Any, owner: Any = None) -> Any:
        if obj is None:
            return self
        value = getattr(obj.__dict__[self.part], self.name)
        obj.__dict__[self.name] = value
        return value


for _name, _part in FLAT.items():
    if _part:
        setattr(Layout, _name, _Flat(_part, _name))

# flat names a Layout cannot be built without (no default in their part), in JSON order
FLAT_REQUIRED: tuple[str, ...] = tuple(n for n in FLAT_NAMES if n in _PART_NAMES and not any(
    n in defaults for defaults in _PART_DEFAULTS.values()))
