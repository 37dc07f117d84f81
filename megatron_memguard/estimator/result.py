"""What an estimate is made of: named terms per pipeline stage, three levels, and the verdict."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable

from ..layout import Chunk, Layout


class TermGroup(str, Enum):
    """What a term is, in the order reports show the groups. Members are their JSON strings
    (``TermGroup.WEIGHTS == "weights"``), so terms made with plain strings group the same."""

    WEIGHTS = "weights"
    GRADIENTS = "gradients"
    OPTIMIZER = "optimizer"
    ACTIVATIONS = "activations"
    LOGITS_LOSS = "logits_loss"
    TRANSIENTS = "transients"
    FIXED = "fixed"
    ALLOCATOR = "allocator"

    __str__ = str.__str__
    __format__ = str.__format__


class TermLevel(str, Enum):
    """Where a term's bytes show: "allocated" terms are live tensors (torch.cuda.memory_allocated);
    "reserved" adds what the caching allocator holds but has not handed out; "device" adds what
    lives outside PyTorch's allocator (nvidia-smi)."""

    ALLOCATED = "allocated"
    RESERVED = "reserved"
    DEVICE = "device"

    __str__ = str.__str__
    __format__ = str.__format__


GROUPS: tuple[TermGroup, ...] = tuple(TermGroup)
LEVELS: tuple[TermLevel, ...] = tuple(TermLevel)


# GPUs per node assumed for the per-node host-memory figure (DGX / HGX nodes).
HOST_GPUS_PER_NODE = 8


@dataclass(frozen=True)
class Term:
    name: str
    bytes: int
    group: TermGroup | str          # a TermGroup member or its string
    level: TermLevel | str = TermLevel.ALLOCATED
    detail: str = ""

    def __init__(self, name: str, bytes: int, group: TermGroup | str, level: TermLevel | str = TermLevel.ALLOCATED,
                 detail: str | Callable[[], str] = "") -> None:
        # the dataclass's frozen __init__ sets each field through object.__setattr__; an estimate makes
        # a hundred terms or more, so each field is stored straight into the instance dict (same fields, same
        # defaults; a store per field costs half of dict.update with keywords, which builds a dict first)
        d = self.__dict__
        d["name"] = name
        d["bytes"] = bytes
        d["group"] = group
        d["level"] = level
        # the detail may come as a function making it, called at its first read (_MadeAtFirstRead): formatting
        # a detail costs more than the term, and the estimate's totals need only its bytes
        if detail.__class__ is str:
            d["detail"] = detail
        else:
            d["_make_detail"] = detail

    def __getstate__(self) -> dict[str, Any]:
        # pickling / deep copies carry the detail, not the function making it
        self.detail
        return dict(self.__dict__)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "bytes": self.bytes, "group": self.group, "level": self.level, "detail": self.detail}


def slack_term(allocated: int, fragmentation: float) -> Term:
    """The caching allocator's slack over a phase's ``allocated`` bytes (a phase figure's reserved level)."""
    return Term("allocator_fragmentation", int(allocated * fragmentation), "allocator", "reserved",
                lambda: f"caching-allocator slack, {fragmentation:.0%} of peak allocated")


def phase_figure(phase: str, terms: tuple[Term, ...], **extra: Any) -> dict[str, Any]:
    """A phase beside the training step (the evaluation step, upcycling's start-up): its levels (allocated,
    reserved, device total) and terms, as the JSON shows them; ``extra`` fields follow the phase's name."""
    allocated = sum(t.bytes for t in terms if t.level == "allocated")
    reserved = allocated + sum(t.bytes for t in terms if t.level == "reserved")
    device = reserved + sum(t.bytes for t in terms if t.level == "device")
    return {"phase": phase, **extra, "peak_allocated_bytes": allocated, "peak_reserved_bytes": reserved,
            "device_total_bytes": device, "terms": [t.to_dict() for t in terms]}


def verdict_for(device_total: int, gpu_memory: int | None, threshold: float) -> str:
    """fits (at most ``threshold`` of the GPU), tight (up to all of it), will not fit, or unknown
    (no GPU memory given)."""
    if not gpu_memory:
        return "unknown"
    frac = device_total / gpu_memory
    if frac <= threshold:
        return "fits"
    if frac <= 1.0:
        return "tight"
    return "will not fit"


@dataclass(frozen=True)
class StageEstimate:
    pp_rank: int
    chunks: tuple[Chunk, ...]
    num_layers: int
    parameters: int
    persistent_bytes: int          # live after the optimizer step: model state and persistent buffers
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    device_total_bytes: int
    peak_phase: str
    in_flight: int                 # most (micro-batch, chunk) forwards held at once
    terms: tuple[Term, ...]        # breakdown at the peak moment, plus reserved/device terms
    # mixture of experts: the expert rows per micro-batch (balanced, the estimate; worst) and the
    # stage's peak with the worst routing the dispatcher allows (None for dense models)
    moe: dict[str, Any] | None = None
    host_terms: tuple[Term, ...] = ()  # host (CPU) memory of one rank: optimizer CPU offload
    # --moe-use-upcycling: the start-up figure (estimator/upcycling.py startup_figure), None otherwise
    startup: dict[str, Any] | None = None
    # --eval-micro-batch-size: the evaluation step's figure (estimator/eval_step.py eval_figure), None otherwise
    eval_step: dict[str, Any] | None = None

    def __init__(self, pp_rank: int, chunks: tuple[Chunk, ...], num_layers: int, parameters: int,
                 persistent_bytes: int, peak_allocated_bytes: int, peak_reserved_bytes: int, device_total_bytes: int,
                 peak_phase: str, in_flight: int, terms: tuple[Term, ...] | Callable[[], tuple[Term, ...]],
                 moe: dict[str, Any] | Callable[[], dict[str, Any]] | None = None,
                 host_terms: tuple[Term, ...] = (), startup: dict[str, Any] | None = None,
                 eval_step: dict[str, Any] | None = None) -> None:
        # one per stage of every estimate: the fields are stored directly (as Term's)
        d = self.__dict__
        d["pp_rank"] = pp_rank
        d["chunks"] = chunks
        d["num_layers"] = num_layers
        d["parameters"] = parameters
        d["persistent_bytes"] = persistent_bytes
        d["peak_allocated_bytes"] = peak_allocated_bytes
        d["peak_reserved_bytes"] = peak_reserved_bytes
        d["device_total_bytes"] = device_total_bytes
        d["peak_phase"] = peak_phase
        d["in_flight"] = in_flight
        # the terms and the MoE figure may come as functions making them, called at their first read
        # (_MadeAtFirstRead): a planner ranking layouts reads the totals only
        if callable(terms):
            d["_make_terms"] = terms
        else:
            d["terms"] = terms
        if callable(moe):
            d["_make_moe"] = moe
        else:
            d["moe"] = moe
        d["host_terms"] = host_terms
        d["startup"] = startup
        d["eval_step"] = eval_step

    @property
    def required_device_bytes(self) -> int:
        """The device total the verdict weighs: the training peak's, or a larger start-up figure (upcycling) or
        evaluation step's (--eval-micro-batch-size)."""
        s, e = self.startup, self.eval_step
        need = self.device_total_bytes if s is None else max(self.device_total_bytes, s["device_total_bytes"])
        return need if e is None else max(need, e["device_total_bytes"])

    def __getstate__(self) -> dict[str, Any]:
        # pickling / deep copies carry the values, not the functions making them
        for name in ("terms", "moe"):
            getattr(self, name)
        return dict(self.__dict__)

    @property
    def host_bytes(self) -> int:
        return sum(t.bytes for t in self.host_terms)

    @property
    def breakdown(self) -> dict[str, int]:
        return {t.name: t.bytes for t in self.terms}

    def group_bytes(self, group: str) -> int:
        return sum(t.bytes for t in self.terms if t.group == group)

    @property
    def dominant_term(self) -> Term:
        return max(self.terms, key=lambda t: t.bytes)

    def to_dict(self) -> dict[str, Any]:
        d = {
            "pp_rank": self.pp_rank,
            "vpp_chunks": [{"vpp_rank": c.vpp_rank, "first_layer": c.first_layer, "num_layers": c.num_layers,
                            "embedding": c.has_embedding, "output": c.has_output} for c in self.chunks],
            "num_layers": self.num_layers,
            "parameters": self.parameters,
            "persistent_bytes": self.persistent_bytes,
            "peak_allocated_bytes": self.peak_allocated_bytes,
            "peak_reserved_bytes": self.peak_reserved_bytes,
            "device_total_bytes": self.device_total_bytes,
            "peak_phase": self.peak_phase,
            "in_flight": self.in_flight,
            "dominant_term": self.dominant_term.name,
            "breakdown": self.breakdown,
            "terms": [t.to_dict() for t in self.terms],
            **({"host_bytes": self.host_bytes, "host_terms": [t.to_dict() for t in self.host_terms]}
               if self.host_terms else {}),
        }
        if self.moe is not None:
            d["moe"] = dict(self.moe)
        if self.startup is not None:
            d["upcycling_startup"] = dict(self.startup)
        if self.eval_step is not None:
            d["eval_step"] = dict(self.eval_step)
        return d


class _MadeAtFirstRead:
    """A StageEstimate (or Term, ...) field given as a function making it (its ``_make_<name>``): called at the first read,
    its value then stored in the instance (a non-data descriptor: later reads find it there)."""

    def __init__(self, name: str, default: Any) -> None:
        self.name, self.make, self.default = name, "_make_" + name, default

    def __get__(self, obj: Any, owner: Any = None) -> Any:
        if obj is None:
            return self.default
        d = obj.__dict__
        make = d.get(self.make)
        if make is None:
            raise AttributeError(self.name)
        value = d[self.name] = make()       # (an error while making it leaves the function for the next read)
        del d[self.make]
        return value


# (set after the dataclass is made: its fields and their defaults stay as declared)
StageEstimate.terms = _MadeAtFirstRead("terms", None)  # type: ignore[assignment]
StageEstimate.moe = _MadeAtFirstRead("moe", None)  # type: ignore[assignment]
Term.detail = _MadeAtFirstRead("detail", "")  # type: ignore[assignment]


@dataclass(frozen=True)
class Estimate:
    layout: Layout
    profile: str
    device: str                    # "gpu" or "cpu"
    gpu: str | None
    gpu_memory_bytes: int | None
    threshold: float
    stages: tuple[StageEstimate, ...]
    verdict: str                   # "fits" | "tight" | "will not fit" | "unknown"
    critical_stage: int
    notes: tuple[str, ...] = field(default=())
    site: Any = None               # the SiteConstants used (estimator/site.py); None: memguard's defaults
    attention: Any = None          # the core-attention kernel modelled (estimator/attention_backend.py)

    def __init__(self, layout: Layout, profile: str, device: str, gpu: str | None, gpu_memory_bytes: int | None,
                 threshold: float, stages: tuple[StageEstimate, ...], verdict: str, critical_stage: int,
                 notes: tuple[str, ...] = (), site: Any = None, attention: Any = None) -> None:
        # one per estimate: the fields are stored directly (as Term's)
        d = self.__dict__
        d["layout"] = layout
        d["profile"] = profile
        d["device"] = device
        d["gpu"] = gpu
        d["gpu_memory_bytes"] = gpu_memory_bytes
        d["threshold"] = threshold
        d["stages"] = stages
        d["verdict"] = verdict
        d["critical_stage"] = critical_stage
        d["notes"] = notes
        d["site"] = site
        d["attention"] = attention

    @property
    def critical(self) -> StageEstimate:
        return self.stages[self.critical_stage]

    @property
    def peak_device_bytes(self) -> int:
        return self.critical.required_device_bytes

    def stage(self, pp_rank: int) -> StageEstimate:
        return self.stages[pp_rank]

    @property
    def host_bytes_per_rank(self) -> int:
        """Host memory of the rank that needs the most (0 without optimizer CPU offload)."""
        return max((s.host_bytes for s in self.stages), default=0)

    @property
    def gpus_per_node(self) -> int:
        # The layout does not know the node size: HOST_GPUS_PER_NODE, or the world if smaller.
        return min(HOST_GPUS_PER_NODE, self.layout.world_size)

    @property
    def host_bytes_per_node(self) -> int:
        from .offload_optimizer import host_bytes_per_node
        return host_bytes_per_node([s.host_bytes for s in self.stages], self.gpus_per_node)

    def _moe_parameters(self) -> dict[str, Any]:
        """MoE models: the whole model's parameters and those one token passes through (the published
        total / active figures); dense documents are unchanged."""
        if self.layout.moe is None:
            return {}
        from .params import active_parameters, total_parameters
        return {"model_parameters": {"total": total_parameters(self.layout), "active": active_parameters(self.layout)}}

    def _peft_parameters(self) -> dict[str, Any]:
        """LoRA / DoRA: the whole model's trainable (adapter) parameters; documents without PEFT are unchanged."""
        if self.layout.peft is None:
            return {}
        from .peft import adapter_param_count
        return {"trainable_parameters": adapter_param_count(self.layout)}

    def to_dict(self) -> dict[str, Any]:
        c = self.critical
        return {
            "schema": "memguard.estimate/1",
            "world_size": self.layout.world_size,
            "profile": self.profile,
            "device": self.device,
            "gpu": self.gpu,
            "gpu_memory_bytes": self.gpu_memory_bytes,
            "threshold": self.threshold,
            "verdict": self.verdict,
            "critical_stage": self.critical_stage,
            "critical_term": c.dominant_term.name,
            "layout": self.layout.to_dict(),
            "stages": [s.to_dict() for s in self.stages],
            "site": self.site.to_dict() if self.site is not None else None,
            **({"attention_backend": self.attention.to_dict()} if self.attention is not None else {}),
            "notes": list(self.notes),
            **self._moe_parameters(),
            **self._peft_parameters(),
            **({"host_bytes_per_rank": self.host_bytes_per_rank, "host_bytes_per_node": self.host_bytes_per_node,
                "host_gpus_per_node": self.gpus_per_node} if self.host_bytes_per_rank else {}),
        }
