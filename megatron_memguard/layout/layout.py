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
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from .chunk import Chunk
from .flat import FLAT, FLAT_NAMES, TUPLE_FIELDS
from .kernels import Kernels
from .parallelism import Parallelism, ShardGroup
from .precision import Precision, TensorKind
from .provenance import Provenance
from .shape import ModelShape
from .training import Batch, Optimizer, PipelineSplit, Recompute


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
    notes: tuple[str, ...] = field(default=(), compare=False)

    def __hash__(self) -> int:
        # Layouts key the estimator's caches; hashing every setting on every lookup is the cost, so the
        # hash is computed once (frozen: it cannot change).
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash((self.parallel, self.shape, self.batch, self.split, self.precision, self.optim,
                      self.recompute, self.kernels, self.provenance))
            self.__dict__["_hash"] = h
        return h

    # ----- building -----
    @classmethod
    def from_flat(cls, **kw: Any) -> "Layout":
        """A Layout from Megatron's flat names (what ``resolve`` computes); TypeError for an unknown
        name or a missing required one, as a dataclass constructor raises."""
        notes = tuple(kw.pop("notes", ()))
        per: dict[str, dict[str, Any]] = {p: {} for p in PARTS}
        for name, value in kw.items():
            part = FLAT.get(name)
            if not part:
                raise TypeError(f"Layout has no field {name!r}")
            per[part][name] = value
        return cls(**{p: t(**per[p]) for p, t in PARTS.items()}, notes=notes)

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
        d = {name: getattr(self, name) for name in FLAT_NAMES}
        d["recompute_modules"] = list(self.recompute_modules)
        d["env"] = dict(self.env)
        d["notes"] = list(self.notes)
        return d

    # ----- derived quantities used across the estimator -----
    @property
    def tp(self) -> int:
        return self.parallel.tensor_model_parallel_size

    @property
    def pp(self) -> int:
        return self.parallel.pipeline_model_parallel_size

    @property
    def cp(self) -> int:
        return self.parallel.context_parallel_size

    @property
    def dp(self) -> int:
        return self.parallel.data_parallel_size

    @property
    def vpp(self) -> int:
        return self.parallel.vpp

    @property
    def param_bytes(self) -> int:
        return self.precision.bytes_of(TensorKind.PARAM)

    @property
    def act_bytes(self) -> int:
        """Bytes per activation element: the autocast dtype when set, else the params' dtype."""
        return self.precision.bytes_of(TensorKind.ACTIVATION)

    @property
    def grad_bytes(self) -> int:
        """Bytes per element of gradients as DDP accumulates and reduces them."""
        return self.precision.bytes_of(TensorKind.GRAD_REDUCE)

    @property
    def dp_shard_size(self) -> int:
        """Ranks the distributed optimizer shards over: DP x CP / optimizer instances."""
        return self.parallel.shard_size(ShardGroup.DENSE_DP)

    @property
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
        by: dict[int, list[Chunk]] = {}
        for c in self.chunks:
            by.setdefault(c.pp_rank, []).append(c)
        return {k: tuple(v) for k, v in by.items()}

    def stage_chunks(self, pp_rank: int) -> tuple[Chunk, ...]:
        return self._chunks_by_stage.get(pp_rank, ())


PARTS: dict[str, type] = {"parallel": Parallelism, "shape": ModelShape, "batch": Batch, "split": PipelineSplit,
                          "precision": Precision, "optim": Optimizer, "recompute": Recompute, "kernels": Kernels,
                          "provenance": Provenance}


class _Flat:
    """A flat Megatron name read from its part. A non-data descriptor: the first read stores the
    value in the instance, so later reads are plain attribute reads (the estimator reads these in
    its inner loops); writing is refused by the frozen dataclass like any other attribute."""

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
FLAT_REQUIRED: tuple[str, ...] = tuple(
    n for n in FLAT_NAMES
    if n in {f.name for t in PARTS.values() for f in dataclasses.fields(t)
             if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING})
