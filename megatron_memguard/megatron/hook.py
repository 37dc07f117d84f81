"""Installing the hook: wrap call-time globals of ``megatron.training`` (both eras).

Megatron has no plugin API, and ``pretrain_gpt.py`` binds ``pretrain`` / ``parse_and_validate_args``
at import time (in-process restart wraps ``pretrain`` too), so the hook wraps only functions that
Megatron looks up in a module's globals when it calls them (megatron.md section 3.3):

============================================  ==============================  ===============================
purpose                                       config-container era (>= 0.18)  legacy era (<= 0.17)
============================================  ==============================  ===============================
``--memguard*`` flags                         arguments.add_megatron_arguments (both: parse_args calls it)
pre-allocation decision                       arguments.validate_args         initialize.validate_args
                                              (parse_and_validate_args)       (imported by name) and
                                                                              arguments.validate_args
``--yaml-cfg`` pre-allocation decision        yaml_arguments.validate_yaml    initialize.validate_yaml
monitor set-up (after mpu, around the build)  training.setup_model_and_optimizer (both)
per-iteration sample                          training.training_log (both; iteration is its 4th argument)
end-of-training summary, OOM report           training.train (both) + torch's CUDA OOM observer
============================================  ==============================  ===============================

Each wrapper keeps the original in ``__memguard_original__``; installing twice, or again after an
in-process restart, wraps nothing twice; a module reloaded since gets wrapped afresh.
"""
from __future__ import annotations

import atexit
import functools
import importlib
import sys
from typing import TYPE_CHECKING, Any, Callable

from .flags import Settings, add_arguments, settings_from_args
from .._integration import attach_oom_observer, default_source, is_oom, parallel_ranks
from .._integration import build_monitor as build_rank_monitor
from ..runtime.reporting import ErrorReporter
from .preflight import PREFIX, Decision, MemguardAbort, decide
from .yaml_args import assign_yaml, is_yaml_namespace, yaml_settings_namespace

if TYPE_CHECKING:
    from ..runtime.monitor import MemoryMonitor
    from ..runtime.sources import MemorySource

_TARGETS = (
    ("megatron.training.arguments", "add_megatron_arguments", "flags"),
    ("megatron.training.arguments", "validate_args", "validate"),
    ("megatron.training.initialize", "validate_args", "validate"),
    ("megatron.training.yaml_arguments", "validate_yaml", "validate_yaml"),
    ("megatron.training.initialize", "validate_yaml", "validate_yaml"),
    ("megatron.training.training", "setup_model_and_optimizer", "setup"),
    ("megatron.training.training", "training_log", "training_log"),
    ("megatron.training.training", "train", "train"),
)


class HookState:
    def __init__(self):
        self.era: str | None = None
        self.megatron_version: str | None = None
        self.wrapped: list[tuple[Any, str, Callable]] = []   # (module, name, original)
        self.settings: Settings | None = None
        self.decision: Decision | None = None
        self.monitor: MemoryMonitor | None = None
        self.source_factory: Callable[[], Any] | None = None
        self.atexit_registered = False
        self.emit: Callable[[str], None] = lambda s: print(s, flush=True)
        self.emit_error: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True)
        # an exception inside memguard: reported once, training goes on
        self.error = ErrorReporter(lambda s: self.emit_error(s), prefix=PREFIX)

    @property
    def errors(self) -> int:
        return self.error.errors


STATE = HookState()


# -- installation ----------------------------------------------------------------------------------------
def _import(name: str):
    try:
        return importlib.import_module(name)
    except Exception:
        return None


def detect_era(arguments_mod: Any, initialize_mod: Any) -> str:
    """config-container (core >= 0.18: pretrain_gpt.py calls parse_and_validate_args) or legacy."""
    if arguments_mod is not None and hasattr(arguments_mod, "parse_and_validate_args"):
        return "config-container"
    if initialize_mod is not None and hasattr(initialize_mod, "parse_args"):
        return "legacy"
    return "unknown"


def _megatron_version() -> str | None:
    for mod in ("megatron.core.package_info", "megatron.core"):
        m = _import(mod)
        v = getattr(m, "__version__", None) if m is not None else None
        if v:
            return str(v)
    return None


def install(quiet: bool = False) -> bool:
    """Wrap Megatron's call-time globals (idempotent). Returns False when megatron.training is absent."""
    arguments = _import("megatron.training.arguments")
    training = _import("megatron.training.training")
    if arguments is None or training is None:
        if not quiet:
            STATE.emit_error(f"{PREFIX} megatron.training is not importable here; the hook is inactive")
        return False
    initialize = _import("megatron.training.initialize")
    STATE.era = detect_era(arguments, initialize)
    STATE.megatron_version = _megatron_version()
    makers = {"flags": _wrap_flags, "validate": _wrap_validate, "validate_yaml": _wrap_validate_yaml,
              "setup": _wrap_setup, "training_log": _wrap_training_log, "train": _wrap_train}
    for modname, attr, kind in _TARGETS:
        mod = sys.modules.get(modname) or (_import(modname) if kind == "validate_yaml" else None)
        if mod is None or not hasattr(mod, attr):
            continue
        current = getattr(mod, attr)
        if getattr(current, "__memguard_original__", None) is not None:
            continue  # already wrapped
        wrapper = makers[kind](current)
        wrapper.__memguard_original__ = current
        setattr(mod, attr, wrapper)
        STATE.wrapped.append((mod, attr, current))
    if not STATE.atexit_registered:
        atexit.register(_at_exit)
        STATE.atexit_registered = True
    return True


def uninstall() -> None:
    """Restore every wrapped function and forget the run's state: decision, settings, monitor (finished)
    and a memory source set with ``set_memory_source`` (tests)."""
    for mod, attr, original in reversed(STATE.wrapped):
        cur = getattr(mod, attr, None)
        if getattr(cur, "__memguard_original__", None) is original:
            setattr(mod, attr, original)
    STATE.wrapped.clear()
    if STATE.monitor is not None:
        try:
            STATE.monitor.finish()
        except Exception:
            pass
    STATE.monitor = None
    STATE.decision = None
    STATE.settings = None
    STATE.source_factory = None


def wrapped_targets() -> list[str]:
    return [f"{mod.__name__}.{attr}" for mod, attr, _ in STATE.wrapped]


def set_memory_source(source: MemorySource | Callable[[], MemorySource | None] | None) -> None:
    """Use another memory source for the runtime monitor: a ``MemorySource``, a callable returning one, or
    None for the default (``CudaMemorySource`` when CUDA is available, otherwise no runtime monitoring)."""
    from ..runtime.sources import MemorySource
    if source is None:
        STATE.source_factory = None
    elif isinstance(source, MemorySource):
        STATE.source_factory = lambda: source
    else:
        STATE.source_factory = source


# -- flags -------------------------------------------------------------------------------------------------
def _wrap_flags(original):
    @functools.wraps(original)
    def add_megatron_arguments(parser, *a, **k):
        parser = original(parser, *a, **k)
        try:
            add_arguments(parser)
        except Exception as e:  # a conflicting option added by someone else
            STATE.error("adding --memguard flags", e)
        return parser
    return add_megatron_arguments


# -- pre-allocation ----------------------------------------------------------------------------------------
def _read_settings(args, yaml: bool = False) -> Settings:
    from ..errors import ConfigError
    try:
        return settings_from_args(yaml_settings_namespace(args) if yaml else args)
    except ConfigError as e:  # a bad MEMGUARD_* value while the flags were not added to the parser (or in a YAML file)
        STATE.emit_error(f"pretrain_gpt.py: error: {e}")
        raise SystemExit(2) from None


def _checked(original, args, defaults, a, k, settings: Settings, *, assign=setattr, validator="validate_args"):
    """The pre-allocation decision, then Megatron's own validation with the decision's updates applied."""
    STATE.settings = settings
    if settings.mode == "off":
        STATE.decision = None
        return original(args, defaults, *a, **k)
    decision = None
    try:
        decision = decide(args, defaults, lambda ns, d: original(ns, d, *a, **k), settings,
                          megatron_version=STATE.megatron_version, emit=STATE.emit, assign=assign, validator=validator)
    except Exception as e:
        STATE.error("the pre-allocation check", e)
    STATE.decision = decision
    if decision is not None and decision.action == "abort":
        raise MemguardAbort(decision.message, decision)
    if decision is not None and decision.updates:
        for key, value in decision.updates.items():
            assign(args, key, value)
    return original(args, defaults, *a, **k)


def _wrap_validate(original):
    @functools.wraps(original)
    def validate_args(args, defaults={}, *a, **k):  # noqa: B006 (Megatron's own signature)
        try:
            settings = _read_settings(args)
        except SystemExit:   # a bad --memguard* value: Megatron's own kind of error
            raise
        except Exception as e:  # memguard's fault (an attribute that raises on reading): the run goes on unchecked
            STATE.error("reading the --memguard settings", e)
            STATE.decision = None
            return original(args, defaults, *a, **k)
        return _checked(original, args, defaults, a, k, settings)
    return validate_args


def _wrap_validate_yaml(original):
    """``--yaml-cfg``: the same decision as for flag-built arguments, on the namespace ``load_yaml``
    returned, before ``validate_yaml`` builds the merged namespace Megatron uses next (yaml_args.py)."""
    @functools.wraps(original)
    def validate_yaml(args, defaults={}, *a, **k):  # noqa: B006
        try:
            shaped = is_yaml_namespace(args)
        except Exception as e:  # (a section or yaml_cfg value that raises when read)
            STATE.error("reading a --yaml-cfg namespace", e)
            shaped = False
        if not shaped:  # not load_yaml's shape: validate_yaml will say what is wrong
            STATE.decision = None
            return original(args, defaults, *a, **k)
        try:
            settings = _read_settings(args, yaml=True)
        except Exception as e:  # memguard's fault: the run goes on unchecked
            STATE.error("reading the --memguard settings of a --yaml-cfg run", e)
            STATE.decision = None
            return original(args, defaults, *a, **k)
        return _checked(original, args, defaults, a, k, settings, assign=assign_yaml, validator="validate_yaml")
    return validate_yaml


# -- runtime -----------------------------------------------------------------------------------------------
def _runtime_enabled() -> bool:
    s = STATE.settings
    return s is None or s.mode != "off"


def _get_args():
    gv = sys.modules.get("megatron.training.global_vars") or _import("megatron.training.global_vars")
    try:
        return gv.get_args() if gv is not None else None
    except Exception:
        return None


def _writers():
    gv = sys.modules.get("megatron.training.global_vars")
    tb = wb = None
    if gv is not None:
        try:
            tb = gv.get_tensorboard_writer()
        except Exception:
            tb = None
        try:
            wb = gv.get_wandb_writer()
        except Exception:
            wb = None
    return tb, wb


def _stage_gather(ranks: dict[str, int]):
    """All-gather of sample vectors over rank 0's pipeline group (its members are the ranks with
    TP = DP = CP = 0): rank 0 then logs one line per pipeline stage."""
    if ranks["pp_size"] <= 1 or ranks["tp_rank"] or ranks["dp_rank"] or ranks["cp_rank"]:
        return None
    import torch
    import torch.distributed as dist
    from ..runtime.torch_gather import torch_stage_gather
    if not (dist.is_available() and dist.is_initialized()):
        return None
    mpu = _import("megatron.core.parallel_state")
    group = mpu.get_pipeline_model_parallel_group()
    device = None
    if dist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    return torch_stage_gather(group, device)


def build_monitor(source: MemorySource) -> MemoryMonitor:
    """This rank's runtime monitor: its own pipeline stage's prediction from the pre-allocation decision
    (the final layout, after autotune), the ``--memguard-log-*`` settings, Megatron's TensorBoard / W&B
    writers and, on rank 0's pipeline group, the per-stage all-gather."""
    from ..runtime.sinks import WriterSink

    args = _get_args()
    settings = STATE.settings or settings_from_args(args if args is not None else object())
    ranks = parallel_ranks()
    tb, wb = _writers()
    gather = None
    try:
        gather = _stage_gather(ranks)
    except Exception as e:
        STATE.error("setting up the per-stage gather", e)
    return build_rank_monitor(
        source, STATE.decision, ranks=ranks, interval=settings.log_interval or getattr(args, "log_interval", None) or 100,
        log_dir=settings.log_dir, extra_sinks=[WriterSink(tb, wb)] if tb is not None or wb is not None else [],
        reset_peak=settings.reset_peak, context={"era": STATE.era, "megatron_version": STATE.megatron_version,
                                                 "mode": settings.mode},
        report=STATE.error, emit=STATE.emit, threshold=settings.threshold, gather=gather, what="pre-allocation")


def _wrap_setup(original):
    @functools.wraps(original)
    def setup_model_and_optimizer(*a, **k):
        if not _runtime_enabled():
            return original(*a, **k)
        source = None
        try:
            if STATE.monitor is not None:  # an in-process restart re-enters pretrain
                STATE.monitor.finish()
                STATE.monitor = None
            source = (STATE.source_factory or default_source)()
            if source is not None:
                source.start()
                STATE.monitor = build_monitor(source)  # before the build: an OOM there gets the breakdown too
                if source.device == "gpu":
                    attach_oom_observer(STATE.monitor)
        except Exception as e:
            STATE.error("setting up the runtime monitor", e)
            STATE.monitor = None
            if source is not None:
                try:
                    source.stop()
                except Exception:
                    pass
        result = original(*a, **k)
        if STATE.monitor is not None:
            try:
                STATE.monitor.start()
            except Exception as e:
                STATE.error("starting the runtime monitor", e)
        return result
    return setup_model_and_optimizer


def _iteration_of(a, k):
    if "iteration" in k:
        return k["iteration"]
    return a[3] if len(a) > 3 else None


def _wrap_training_log(original):
    @functools.wraps(original)
    def training_log(*a, **k):
        result = original(*a, **k)
        m = STATE.monitor
        if m is not None:
            try:
                m.step(_iteration_of(a, k))
            except Exception as e:
                STATE.error("the runtime sample", e)
        return result
    return training_log


def _wrap_train(original):
    @functools.wraps(original)
    def train(*a, **k):
        try:
            return original(*a, **k)
        except BaseException as e:
            m = STATE.monitor
            try:   # (memguard's look at the error must not replace it with one of its own)
                if m is not None and not m.oom_reported and is_oom(e):
                    m.on_oom()
            except Exception as own:
                STATE.error("the out-of-memory report", own)
            raise
        finally:
            m = STATE.monitor
            if m is not None:
                try:
                    m.finish()
                except Exception as e:
                    STATE.error("the end-of-training summary", e)
    return train


def _at_exit() -> None:
    m = STATE.monitor
    if m is not None and not m.finished:
        try:
            m.finish()
        except Exception:
            pass
