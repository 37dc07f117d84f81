"""The pre-flight decision: one result type and one abort exception for every integration.

The Megatron hook (``megatron_memguard.megatron.preflight.decide``) and the Bridge / Lightning
pre-flight (``megatron_memguard._integration.run_preflight``) take the same decision (does the
estimated critical stage stay under the threshold of GPU memory?) and report it with the same type,
so that a caller, a test or a log reader handles one shape. The modes, the default threshold and the
exit code live here once.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

PREFIX = "[memguard]"
ABORT_EXIT_CODE = 3  # every memguard abort: distinct from Python (1) and argparse errors (2)
# The Megatron hook's modes; ``autotune`` rewrites Megatron's arguments, which only the hook can do.
MODES = ("off", "report", "warn", "abort", "autotune")
PREFLIGHT_MODES = MODES[:4]  # the Bridge / Lightning pre-flight: reports, warns or aborts
DEFAULT_MODE = "warn"
DEFAULT_THRESHOLD = 0.8  # of GPU memory (the hook's --memguard-threshold, the integrations' threshold=)
# What was done: skipped | unsupported | unknown | fits | reported | warned | tuned | abort
ACTIONS = ("skipped", "unsupported", "unknown", "fits", "reported", "warned", "tuned", "abort")


@dataclass
class Decision:
    """What the pre-flight check found and did. Mutable on purpose: the check fills it in as it goes
    (the GPU first, then the layout and estimate, then the action and message)."""

    mode: str
    action: str
    raw: Any = None                   # the RawConfig read (None when reading failed)
    layout: Any = None
    estimate: Any = None
    updates: dict[str, Any] = field(default_factory=dict)   # autotune's argument changes (hook only)
    message: str = ""
    gpu: Any = None
    gpu_memory: int | None = None
    gpu_memory_source: str = ""
    megatron_version: str | None = None
    autotune: Any = None              # the AutotuneResult (hook, mode autotune / abort suggestion)
    reason: str = ""
    world_size: int | None = None
    world_size_from: str = ""
    notes: list[str] = field(default_factory=list)
    taken_by: str = "hook"            # "hook" (Megatron's validate_args) | "preflight" (Bridge / Lightning)

    @property
    def verdict(self) -> str | None:
        return self.estimate.verdict if self.estimate is not None else None

    @property
    def fits(self) -> bool:
        return self.verdict == "fits"

    def to_dict(self) -> dict[str, Any]:
        """The decision as the run log's ``context.decision`` records it (docs/hook.md); the keys are
        those each integration has always written."""
        e = self.estimate
        critical = e.critical_stage if e else None
        predicted = e.peak_device_bytes if e else None
        gpu = self.gpu.name if self.gpu is not None else None
        if self.taken_by == "hook":
            return {"mode": self.mode, "action": self.action, "updates": dict(self.updates), "gpu": gpu,
                    "gpu_memory": self.gpu_memory, "gpu_memory_source": self.gpu_memory_source,
                    "megatron_version": self.megatron_version, "reason": self.reason, "verdict": self.verdict,
                    "critical_stage": critical, "predicted_device_total": predicted}
        return {"mode": self.mode, "action": self.action, "verdict": self.verdict, "reason": self.reason,
                "world_size": self.world_size, "world_size_from": self.world_size_from, "gpu": gpu,
                "gpu_memory": self.gpu_memory, "gpu_memory_source": self.gpu_memory_source,
                "critical_stage": critical, "predicted_device_total": predicted,
                "source": self.raw.source if self.raw is not None else None}


class MemguardAbort(SystemExit):
    """Raised on every rank when the layout does not fit and the mode says stop (``abort``, or
    ``autotune`` that found nothing). A clean ``SystemExit`` with exit code 3, before any GPU memory
    is allocated."""

    def __init__(self, message: str, decision: Decision | None = None):
        super().__init__(ABORT_EXIT_CODE)
        self.message = message
        self.decision = decision

    @property
    def result(self) -> Decision | None:
        """The integrations' name for ``decision``."""
        return self.decision


# The names the Bridge / Lightning integrations export (kept: user code catches PreflightAbort).
PreflightResult = Decision
PreflightAbort = MemguardAbort


def megatron_failure(e: BaseException) -> str | None:
    """Where Megatron stops on an input memguard refused although Megatron's argument validation accepts it, and
    what to change (the marker ``megatron_fails_later`` set where the error is raised); None for memguard's own
    refusals, after which the run does go on unchecked."""
    where = getattr(e, "megatron_fails_later", None)
    if not where:
        return None
    errors = getattr(e, "errors", None) or [e]
    keys = list(dict.fromkeys(k.key for k in errors if getattr(k, "megatron_fails_later", None) and getattr(k, "key", "")))
    return f"the run will stop {where}" + (f" (change {', '.join(keys)})" if keys else "")


def expert_grid_failure(get: Any, world: Any, flag: Any = None) -> str | None:
    """The expert-grid rule megatron-core checks only after its argument validation: initialize_model_parallel
    (parallel_state.py, 0.16.1 and 0.19.2) lays the expert groups ETP x EP x expert-DP x PP over the same
    world and raises when the world does not divide into them. ``get(name)`` reads Megatron's argument names;
    ``flag(name)`` spells one as the launch does. None when the grid divides (or is not plain integers)."""
    flag = flag or (lambda n: "--" + n.replace("_", "-"))
    def whole(v: Any) -> int:
        n = int(v)
        if n != v or n < 1:    # (0.5, Fraction(1, 2), -2: the argument checks refuse them by name)
            raise ValueError(v)
        return n

    try:
        if not get("num_experts") or world is None or world == "":
            return None         # (no experts, or the world is not known yet: nothing to check)
        # (the pre-flight falls back on the environment's WORLD_SIZE, a string)
        world = whole(int(world) if isinstance(world, str) else world)
        tp = whole(get("tensor_model_parallel_size") or 1)
        pp = whole(get("pipeline_model_parallel_size") or 1)
        ep = whole(get("expert_model_parallel_size") or 1)
        etp = whole(get("expert_tensor_parallel_size") or tp)
    except (TypeError, ValueError, OverflowError, ArithmeticError):
        return None
    if world % (etp * ep * pp) == 0:
        return None
    names = ", ".join(flag(n) for n in ("expert_model_parallel_size", "expert_tensor_parallel_size",
                                         "pipeline_model_parallel_size"))
    return (f"the run will stop in initialize_model_parallel: world size {world} is not divisible by expert tensor "
            f"parallel {etp} x expert parallel {ep} x pipeline parallel {pp} = {etp * ep * pp} (change {names})")
